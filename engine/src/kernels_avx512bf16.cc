// AVX-512 kernels with AVX512_BF16's native fp32 -> bf16 conversion. See kernels_avx512.cc.
#define SPILLWAY_NATIVE_BF16 1
#include "kernels_avx512.cc"  // NOLINT(bugprone-suspicious-include)
