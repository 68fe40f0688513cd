// Element types' names and sizes.
#include "spillway/base/dtype.h"

namespace spillway {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return "float32";
    case DType::kBf16:
      return "bfloat16";
    case DType::kFp16:
      return "float16";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt64:
      return "int64";
  }
  return "unknown dtype";
}

uint64_t DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return 4;
    case DType::kBf16:
    case DType::kFp16:
      return 2;
    case DType::kUInt8:
      return 1;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

}  // namespace spillway
