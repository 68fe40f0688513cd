// Built without CUDA (SPILLWAY_WITH_CUDA=OFF): every device call says so.
#include "spillway/engine/cuda_kernels.h"

namespace spillway::engine::cuda {

Status Available() {
  return Status::Make(StatusCode::kUnavailable,
                      "Spillway was built without CUDA (SPILLWAY_WITH_CUDA=OFF); rebuild with a "
                      "CUDA toolkit to use device kernels");
}

Result<uint64_t> DeviceMemoryBytes() { return Available(); }
Result<NormResult> SumOfSquares(const DeviceTensor*, size_t, void*) { return Available(); }
Status ScaleCast(const void*, DType, void*, DType, uint64_t, float, void*) { return Available(); }

}  // namespace spillway::engine::cuda
