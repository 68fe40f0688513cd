// CUDA host registration for HostArena regions: mmap(MAP_ANONYMOUS) + cudaHostRegister, so one
// region is CUDA-pinned and can also be an io_uring fixed buffer (FIELD.md §3).
#include "cuda_host.h"

#if SPILLWAY_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <mutex>

namespace spillway::allocator::cuda {

#if SPILLWAY_WITH_CUDA
namespace {
Status CudaError(cudaError_t err, const std::string& what) {
  return Status::Make(StatusCode::kOutOfMemory,
                      StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
                             "); lower the host budget or set pin_memory=false"),
                      static_cast<int>(err));
}
}  // namespace

bool DeviceAvailable(std::string* why) {
  static std::once_flag once;
  static bool available = false;
  static std::string reason;
  std::call_once(once, [] {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      reason = StrCat("cudaGetDeviceCount: ", cudaGetErrorName(err), " (",
                      cudaGetErrorString(err), ")");
      cudaGetLastError();  // clear the sticky error
    } else if (count == 0) {
      reason = "cudaGetDeviceCount found 0 devices";
    } else {
      available = true;
    }
  });
  if (why != nullptr) *why = reason;
  return available;
}

Status HostRegister(void* base, size_t bytes) {
  auto* p = static_cast<char*>(base);
  size_t done = 0;
  while (done < bytes) {
    const size_t piece = std::min(kMaxRegisterBytes, bytes - done);
    cudaError_t err = cudaHostRegister(p + done, piece, cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      for (size_t undo = 0; undo < done; undo += kMaxRegisterBytes) cudaHostUnregister(p + undo);
      return CudaError(err, StrCat("cudaHostRegister of ", FormatBytes(piece)));
    }
    done += piece;
  }
  return Status::Ok();
}

Status HostUnregister(void* base, size_t bytes) {
  auto* p = static_cast<char*>(base);
  Status first;
  for (size_t done = 0; done < bytes; done += kMaxRegisterBytes) {
    cudaError_t err = cudaHostUnregister(p + done);
    if (err != cudaSuccess && first.ok()) first = CudaError(err, "cudaHostUnregister");
  }
  return first;
}

#else  // !SPILLWAY_WITH_CUDA

bool DeviceAvailable(std::string* why) {
  if (why != nullptr) *why = "Spillway was built without CUDA (SPILLWAY_WITH_CUDA=OFF)";
  return false;
}
Status HostRegister(void*, size_t) {
  return Status::Make(StatusCode::kUnavailable,
                      "cudaHostRegister: Spillway was built without CUDA; rebuild with "
                      "SPILLWAY_WITH_CUDA=ON or use pin mode mlock");
}
Status HostUnregister(void*, size_t) { return Status::Ok(); }

#endif

}  // namespace spillway::allocator::cuda
