// Element types: one enum for the optimizer's gradients and 16-bit copies, the CUDA kernels and
// the device guard's tensor descriptions. C++17-clean: the CUDA kernels include it.
#pragma once

#include <cstdint>

namespace spillway {

// The floating types first, in the order the kernels' tables index them (fp32, bf16, fp16).
enum class DType : uint8_t { kFp32 = 0, kBf16 = 1, kFp16 = 2, kUInt8 = 3, kInt64 = 4 };

// torch's name: "float32", "bfloat16", "float16", "uint8", "int64"; "unknown dtype" for a value out
// of range.
const char* DTypeName(DType dtype);
// Bytes per element; 0 for a value out of range.
uint64_t DTypeBytes(DType dtype);
// fp32, bf16 or fp16: the types the optimizer and the kernels compute in.
inline bool IsFloatingDType(DType dtype) { return dtype <= DType::kFp16; }

}  // namespace spillway
