// The CUDA device backend: cudaMalloc, a non-blocking copy stream, events. Every call sets the
// device first (the current device is per thread). Compiled to an UNAVAILABLE stub without CUDA.
#include "spillway/offload/device.h"

#if SPILLWAY_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace spillway::offload {

#if SPILLWAY_WITH_CUDA
namespace {

Status CudaStatus(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Make(err == cudaErrorMemoryAllocation ? StatusCode::kOutOfMemory
                                                       : StatusCode::kInternal,
                      StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"),
                      static_cast<int>(err));
}

class CudaEvent final : public Event {
 public:
  CudaEvent(int device, cudaEvent_t e) : device_(device), event_(e) {}
  ~CudaEvent() override {
    cudaSetDevice(device_);
    cudaEventDestroy(event_);
  }
  Status Wait() override {
    cudaSetDevice(device_);
    return CudaStatus(cudaEventSynchronize(event_), "cudaEventSynchronize");
  }

 private:
  int device_;
  cudaEvent_t event_;
};

class CudaStream final : public Stream {
 public:
  CudaStream(int device, cudaStream_t s) : device_(device), stream_(s) {}
  ~CudaStream() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  Status CopyAsync(void* dst, const void* src, uint64_t bytes) override {
    cudaSetDevice(device_);
    return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_),
                      "cudaMemcpyAsync");
  }
  Result<std::shared_ptr<Event>> Record() override {
    cudaSetDevice(device_);
    cudaEvent_t e;
    SPILLWAY_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                                        "cudaEventCreate"));
    Status st = CudaStatus(cudaEventRecord(e, stream_), "cudaEventRecord");
    if (!st.ok()) {
      cudaEventDestroy(e);
      return st;
    }
    return std::shared_ptr<Event>(new CudaEvent(device_, e));
  }
  Status Synchronize() override {
    cudaSetDevice(device_);
    return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
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
    cudaSetDevice(index_);
    void* p = nullptr;
    SPILLWAY_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, bytes),
                                        StrCat("cudaMalloc of ", FormatBytes(bytes))));
    return p;
  }
  Status Free(void* ptr) override {
    cudaSetDevice(index_);
    return CudaStatus(cudaFree(ptr), "cudaFree");
  }
  Result<std::unique_ptr<Stream>> NewStream() override {
    cudaSetDevice(index_);
    cudaStream_t s;
    SPILLWAY_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                                        "cudaStreamCreate"));
    return std::unique_ptr<Stream>(new CudaStream(index_, s));
  }
  Status CopyToHost(void* host, const void* device, uint64_t bytes) override {
    cudaSetDevice(index_);
    return CudaStatus(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }
  Status CopyFromHost(void* device, const void* host, uint64_t bytes) override {
    cudaSetDevice(index_);
    return CudaStatus(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }

 private:
  int index_;
};

}  // namespace

Result<std::unique_ptr<Device>> Device::OpenCuda(int index) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::Make(StatusCode::kUnavailable,
                        StrCat("cudaGetDeviceCount: ", cudaGetErrorName(err)));
  }
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
