// CUDA host registration for HostArena regions: mmap(MAP_ANONYMOUS) + cudaHostRegister, so one
// region is CUDA-pinned and can also be an io_uring fixed buffer (FIELD.md §3).
#include "cuda_host.h"

#if SPILLWAY_WITH_CUDA
#include "spillway/allocator/cuda_status.h"
#include "spillway/base/bytes.h"
#include "spillway/base/log.h"
#endif

#include <algorithm>
#include <mutex>

namespace spillway::allocator::cuda {

#if SPILLWAY_WITH_CUDA
namespace {
Status CudaError(cudaError_t err, const std::string& what) {
  return spillway::cuda::ToStatus(err, what, StatusCode::kOutOfMemory,
                                  "; lower the host budget or set pin_memory=false");
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
      reason =
          StrCat("cudaGetDeviceCount: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
      spillway::cuda::ConsumeError();
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
      Status st = CudaError(err, StrCat("cudaHostRegister of ", FormatBytes(piece)));
      for (size_t undo = 0; undo < done; undo += kMaxRegisterBytes) {
        // Undoing a failed registration: the registration error is the one to report.
        CudaError(cudaHostUnregister(p + undo), "cudaHostUnregister").IgnoreError();
      }
      return st;
    }
    done += piece;
  }
  return Status::Ok();
}

Status HostUnregister(void* base, size_t bytes) {
  auto* p = static_cast<char*>(base);
  Status first;
  for (size_t done = 0; done < bytes; done += kMaxRegisterBytes) {
    Status st = CudaError(cudaHostUnregister(p + done), "cudaHostUnregister");
    if (first.ok()) first = std::move(st);
  }
  return first;
}

int CurrentDevice() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    spillway::cuda::ConsumeError();
    return -1;
  }
  return device;
}
void SetDevice(int device) {
  if (device < 0) return;
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    Log(LogLevel::kWarning,
        StrCat("cudaSetDevice(", device, ") on a Spillway thread: ", cudaGetErrorName(err)));
    spillway::cuda::ConsumeError();
  }
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
int CurrentDevice() { return -1; }
void SetDevice(int) {}

#endif

}  // namespace spillway::allocator::cuda
