// Note [CUDA error state] (docs/engine.md): a Spillway call that fails on a CUDA error leaves the
// calling thread's last-error slot empty, so torch's next launch check does not report Spillway's
// error as its own, and it leaves the caller's current device as it found it. Every test needs a
// GPU: without a driver the runtime returns its initialization error from every call,
// cudaGetLastError() included, so there is nothing to observe.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "spillway/allocator/cuda_status.h"
#include "spillway/offload/device.h"

namespace spillway {
namespace {

class CudaErrorStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = offload::Device::OpenCuda(0);
    if (!device.ok()) GTEST_SKIP() << "needs a CUDA device: " << device.status().message();
    device_ = std::move(*device);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  }
  void ExpectClean(const char* what) {
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << what << " left its error for the next check";
  }
  std::unique_ptr<offload::Device> device_;
};

// Each failure here is synchronous and not sticky (a refused argument, an allocation too large):
// an asynchronous fault (an illegal address) would poison the context for the rest of the binary.
TEST_F(CudaErrorStateTest, AFailedAllocationFreeOrDeviceSwitchIsReturnedAndNotLeftForTorch) {
  auto huge = device_->Allocate(uint64_t{1} << 50);  // 1 PiB
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kOutOfMemory);
  ExpectClean("Device::Allocate of 1 PiB");

  int stack = 0;
  Status st = device_->Free(&stack);  // not a device allocation: cudaErrorInvalidValue
  ASSERT_FALSE(st.ok());
  ExpectClean("Device::Free of a host address");

  {
    spillway::cuda::DeviceScope scope(-1);
    EXPECT_FALSE(scope.status().ok());
  }
  ExpectClean("DeviceScope(-1)");

  // The device still works for the caller afterwards.
  auto ok = device_->Allocate(4096);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_TRUE(device_->Free(*ok).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST_F(CudaErrorStateTest, TheCallersCurrentDeviceIsKeptAcrossSpillwayCalls) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count < 2) GTEST_SKIP() << "needs two CUDA devices to see a switch (found " << count << ")";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto other = offload::Device::OpenCuda(1);
  ASSERT_TRUE(other.ok());
  auto p = (*other)->Allocate(4096);
  ASSERT_TRUE(p.ok());
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0) << "Allocate on device 1 left device 1 current";
  auto stream = (*other)->NewStream();
  ASSERT_TRUE(stream.ok());
  std::vector<char> host(4096, 'y');
  ASSERT_TRUE((*stream)->SubmitCopy(*p, host.data(), host.size()).ok());
  ASSERT_TRUE((*stream)->Synchronize().ok());
  stream->reset();
  EXPECT_TRUE((*other)->Free(*p).ok());
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0) << "a copy, a stream or a free on device 1 left device 1 current";
}

}  // namespace
}  // namespace spillway
