// The CUDA device backend: cudaMalloc, a non-blocking copy stream, events. Every call makes its
// device current for the call and gives the caller's back, and no failed call leaves its error for
// torch to find (Note [CUDA error state], docs/engine.md). An UNAVAILABLE stub without CUDA.
#include "spillway/offload/device.h"

#if SPILLWAY_WITH_CUDA
#include "spillway/allocator/cuda_status.h"
#include "spillway/base/bytes.h"
#endif

namespace spillway::offload {

#if SPILLWAY_WITH_CUDA
namespace {

using spillway::cuda::DeviceScope;
using spillway::cuda::ToStatus;

class CudaEvent final : public Event {
 public:
  CudaEvent(int device, cudaEvent_t e) : device_(device), event_(e) {}
  ~CudaEvent() override {
    DeviceScope scope(device_);
    if (scope.status().ok()) ToStatus(cudaEventDestroy(event_), "cudaEventDestroy").IgnoreError();
  }
  Status Wait() override {
    DeviceScope scope(device_);
    SPILLWAY_RETURN_IF_ERROR(scope.status());
    return ToStatus(cudaEventSynchronize(event_), "cudaEventSynchronize");
  }

 private:
  int device_;
  cudaEvent_t event_;
};

class CudaStream final : public Stream {
 public:
  CudaStream(int device, cudaStream_t s) : device_(device), stream_(s) {}
  ~CudaStream() override {
    DeviceScope scope(device_);
    if (!scope.status().ok()) return;
    // A destructor reports nothing; a device error here shows again on the next CUDA call.
    ToStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize").IgnoreError();
    ToStatus(cudaStreamDestroy(stream_), "cudaStreamDestroy").IgnoreError();
  }
  Status SubmitCopy(void* dst, const void* src, uint64_t bytes) override {
    DeviceScope scope(device_);
    SPILLWAY_RETURN_IF_ERROR(scope.status());
    return ToStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_),
                    StrCat("cudaMemcpyAsync of ", FormatBytes(bytes)));
  }
  Result<std::shared_ptr<Event>> Record() override {
    DeviceScope scope(device_);
    SPILLWAY_RETURN_IF_ERROR(scope.status());
    cudaEvent_t e;
    SPILLWAY_RETURN_IF_ERROR(
        ToStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate"));
    Status st = ToStatus(cudaEventRecord(e, stream_), "cudaEventRecord");
    if (!st.ok()) {
      ToStatus(cudaEventDestroy(e), "cudaEventDestroy").IgnoreError();
      return st;
    }
    return std::shared_ptr<Event>(new CudaEvent(device_, e));
  }
  Status Synchronize() override {
    DeviceScope scope(device_);
    SPILLWAY_RETURN_IF_ERROR(scope.status());
    return ToStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  int device_;
  cudaStream_t stream_;
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int index) : index_(index) {}
  DeviceId id() const override { return {DeviceType::kCuda, index_}; }
  Result<void*> Allocate(uint64_t bytes) override {
    DeviceScope scope(index_);
    SPILLWAY_RETURN_IF_ERROR(scope.status());
    void* p = nullptr;
    SPILLWAY_RETURN_IF_ERROR(
        ToStatus(cudaMalloc(&p, bytes), StrCat("cudaMalloc of ", FormatBytes(bytes))));
    return p;
  }
  Status Free(void* ptr) override {
    DeviceScope scope(index_);
    SPILLWAY_RETURN_IF_ERROR(scope.status());
    return ToStatus(cudaFree(ptr), "cudaFree");
  }
  Result<std::unique_ptr<Stream>> NewStream() override {
    DeviceScope scope(index_);
    SPILLWAY_RETURN_IF_ERROR(scope.status());
    cudaStream_t s;
    SPILLWAY_RETURN_IF_ERROR(
        ToStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"));
    return std::unique_ptr<Stream>(new CudaStream(index_, s));
  }
  Status CopyToHost(void* host, const void* device, uint64_t bytes) override {
    DeviceScope scope(index_);
    SPILLWAY_RETURN_IF_ERROR(scope.status());
    return ToStatus(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost),
                    StrCat("cudaMemcpy D2H of ", FormatBytes(bytes)));
  }
  Status CopyFromHost(void* device, const void* host, uint64_t bytes) override {
    DeviceScope scope(index_);
    SPILLWAY_RETURN_IF_ERROR(scope.status());
    return ToStatus(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice),
                    StrCat("cudaMemcpy H2D of ", FormatBytes(bytes)));
  }

 private:
  int index_;
};

}  // namespace

Result<std::unique_ptr<Device>> Device::OpenCuda(int index) {
  int count = 0;
  SPILLWAY_RETURN_IF_ERROR(spillway::cuda::ToStatus(
      cudaGetDeviceCount(&count), "cudaGetDeviceCount", StatusCode::kUnavailable));
  if (index < 0 || index >= count) {
    return Status::Make(StatusCode::kUnavailable,
                        StrCat("CUDA device ", index, " does not exist (", count, " present)"));
  }
  return std::unique_ptr<Device>(new CudaDevice(index));
}

#else

Result<std::unique_ptr<Device>> Device::OpenCuda(int) {
  return Status::Make(StatusCode::kUnavailable,
                      "Spillway was built without CUDA (SPILLWAY_WITH_CUDA=OFF)");
}

#endif

}  // namespace spillway::offload
