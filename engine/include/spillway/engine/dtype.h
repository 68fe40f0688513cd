// Element types of gradients and parameter copies. C++17-clean: the CUDA kernels include it.
#pragma once

#include <cstdint>

namespace spillway::engine {

enum class DType : uint8_t { kFp32 = 0, kBf16 = 1, kFp16 = 2 };
const char* DTypeName(DType dtype);
uint64_t DTypeBytes(DType dtype);

}  // namespace spillway::engine
