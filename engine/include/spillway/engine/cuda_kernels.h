// Device-side pieces of the step, for gradients that live on a CUDA device: a multi-tensor sum of
// squares with an inf/NaN flag (the global norm, returned as a host double) and a fused
// unscale+clip+cast. Compiled for sm_80 and sm_90 (plus PTX) when SPILLWAY_WITH_CUDA; every call
// returns UNAVAILABLE, naming why, where there is no device or no CUDA build. C++17 (nvcc side).
#pragma once

#include <cstddef>
#include <cstdint>

#include "spillway/base/dtype.h"
#include "spillway/base/status.h"

namespace spillway::engine::cuda {

struct DeviceTensor {
  const void* data = nullptr;  // device memory
  uint64_t numel = 0;
  DType dtype = DType::kFp32;
};

struct NormResult {
  double sum_of_squares = 0.0;  // of the values as stored (still loss-scaled)
  bool finite = true;           // false if any element is inf or NaN
};

// OK when a CUDA device can be used; otherwise UNAVAILABLE with the reason (no CUDA build, no
// driver, no device).
Status Available();

// Total memory of the current CUDA device (cudaMemGetInfo), for `spillway plan --gpu-mem`'s
// default; UNAVAILABLE as Available() says.
Result<uint64_t> DeviceMemoryBytes();

// One pass over every tensor on `stream` (a cudaStream_t; null = the legacy default stream).
// Deterministic: every addition happens in an order fixed by the device's SM count, so one GPU
// gives the same bits every time (a GPU with another SM count associates the sum differently).
// Blocks until the result is on the host.
Result<NormResult> SumOfSquares(const DeviceTensor* tensors, size_t count, void* stream = nullptr);

// out[i] = convert(in[i] * scale) for numel elements (device memory; in and out may be the same
// buffer when the dtypes match). Asynchronous on `stream`.
Status ScaleCast(const void* in, DType in_dtype, void* out, DType out_dtype, uint64_t numel,
                 float scale, void* stream = nullptr);

}  // namespace spillway::engine::cuda
