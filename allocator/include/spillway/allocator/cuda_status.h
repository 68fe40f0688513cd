// CUDA runtime results as Status, and the current device restored: for Spillway's own CUDA
// translation units only (it includes <cuda_runtime_api.h>). See Note [CUDA error state] in
// docs/engine.md.
//
// Why both exist. A failed runtime call also stores its code in the calling thread's last-error
// slot. torch checks every kernel launch with cudaGetLastError(), so an error Spillway returned
// as a Status and left in that slot would come back later as torch's own, attached to an unrelated
// kernel. And the current device is per thread and shared with torch: a Spillway call that
// switches to device 1 and returns leaves torch's next allocation on device 1.
#pragma once

#include <cuda_runtime_api.h>

#include <string_view>

#include "spillway/base/status.h"

namespace spillway::cuda {

// Clears the calling thread's last-error slot after a failed call. A sticky error (the context is
// corrupt, for example after an illegal address) cannot be cleared: every later call in the process
// fails, torch's included, which is the only honest outcome.
inline void ConsumeError() { (void)cudaGetLastError(); }

// OK for cudaSuccess. Otherwise consumes the error and returns `code` with
// "<what>: <cudaErrorName> (<description>)<fix>", carrying the CUDA code as sys_error.
// cudaErrorMemoryAllocation maps to kOutOfMemory whatever `code` says.
inline Status ToStatus(cudaError_t err, std::string_view what,
                       StatusCode code = StatusCode::kInternal, std::string_view fix = {}) {
  if (err == cudaSuccess) return Status::Ok();
  ConsumeError();
  if (err == cudaErrorMemoryAllocation) code = StatusCode::kOutOfMemory;
  return Status::Make(
      code, StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")", fix),
      static_cast<int>(err));
}

// Whether the calling thread has a current CUDA context. cudaGetDevice answers 0 on a thread that
// never chose a device, and cudaSetDevice(0) there would create device 0's primary context (memory
// on GPU 0 in every process, as torch's MaybeSetDevice avoids). The driver's cuCtxGetCurrent says;
// it is looked up through the runtime, so Spillway does not link libcuda. Unknown (no driver entry
// point) reads as true: restoring is then what it was before this check.
inline bool ThreadHasContext() {
  using CtxGetCurrent = int (*)(void**);  // CUresult cuCtxGetCurrent(CUcontext*)
  static const CtxGetCurrent get = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      ConsumeError();
      fn = nullptr;
    }
    return reinterpret_cast<CtxGetCurrent>(fn);
  }();
  if (get == nullptr) return true;
  void* ctx = nullptr;
  return get(&ctx) != 0 || ctx != nullptr;  // an error answers "unknown", hence true
}

// Makes `device` current for the scope and gives the caller back its own device at exit, as
// c10::cuda::CUDAGuard does. The switch is skipped when `device` is already current, so the common
// case costs one cudaGetDevice (a thread-local read in the runtime). A thread that had no context
// before is left on `device` rather than made to create a context on device 0. status() is the
// result of reading or setting the device; a caller checks it before touching the device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaError_t err = cudaGetDevice(&previous_);
    if (err == cudaSuccess && previous_ != device) {
      const bool had_context = ThreadHasContext();
      err = cudaSetDevice(device);
      switched_ = err == cudaSuccess && had_context;
    }
    status_ =
        ToStatus(err, StrCat("making CUDA device ", device, " current"), StatusCode::kUnavailable);
  }
  ~DeviceScope() {
    if (switched_ && cudaSetDevice(previous_) != cudaSuccess) ConsumeError();
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  const Status& status() const { return status_; }

 private:
  int previous_ = 0;
  bool switched_ = false;
  Status status_;
};

}  // namespace spillway::cuda
