// The device kernels of the step: on a GPU, against the host optimizer's norm and conversions;
// without one, every call is UNAVAILABLE with the reason. Suites named Cuda* carry the `gpu` label.
#include "spillway/engine/cuda_kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "optimizer_test_util.h"
#include "spillway/engine/host_optimizer.h"

#if SPILLWAY_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace spillway::engine {
namespace {

TEST(DeviceKernelsTest, WithoutADeviceEveryCallIsUnavailableAndSaysWhy) {
  if (cuda::Available().ok()) GTEST_SKIP() << "a CUDA device is present: CudaKernelsTest covers it";
  const Status st = cuda::Available();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_FALSE(st.message().empty());
  float x = 1.0f;
  cuda::DeviceTensor t{&x, 1, DType::kFp32};
  auto r = cuda::SumOfSquares(&t, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(cuda::ScaleCast(&x, DType::kFp32, &x, DType::kFp32, 1, 2.0f).code(),
            StatusCode::kUnavailable);
  EXPECT_EQ(x, 1.0f);  // nothing was touched
}

#if SPILLWAY_WITH_CUDA
class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Status st = cuda::Available();
    if (!st.ok()) GTEST_SKIP() << "needs a CUDA device: " << st.message();
  }
  void* ToDevice(const void* host, size_t bytes) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    owned_.push_back(d);
    return d;
  }
  void TearDown() override {
    for (void* d : owned_) cudaFree(d);
  }
  std::vector<void*> owned_;
};

TEST_F(CudaKernelsTest, TheDeviceNormEqualsTheHostNormForEveryDtype) {
  testing::GroupBuffers a(1'000'003, DType::kFp32, DType::kBf16, false, 1);
  testing::GroupBuffers b(70'001, DType::kBf16, DType::kBf16, false, 2);
  testing::GroupBuffers c(4'097, DType::kFp16, DType::kBf16, false, 3);
  auto opt = std::move(HostOptimizer::Create({}).value());
  double want = 0;
  std::vector<cuda::DeviceTensor> tensors;
  for (testing::GroupBuffers* g : {&a, &b, &c}) {
    want += *opt->SumOfSquares(g->View());
    tensors.push_back({ToDevice(g->grad.data(), g->grad.size()), g->numel, g->grad_dtype});
  }
  auto r = cuda::SumOfSquares(tensors.data(), tensors.size());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->finite);
  // Both sum double squares of the same floats; only the association differs.
  EXPECT_NEAR(r->sum_of_squares, want, 1e-12 * want);
  // Deterministic: the same bits twice.
  auto again = cuda::SumOfSquares(tensors.data(), tensors.size());
  EXPECT_EQ(again->sum_of_squares, r->sum_of_squares);
}

TEST_F(CudaKernelsTest, AnInfOrNanAnywhereRaisesTheFlag) {
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    std::vector<float> host(300'000, 0.5f);
    host[299'999] = bad;
    cuda::DeviceTensor t{ToDevice(host.data(), host.size() * 4), host.size(), DType::kFp32};
    auto r = cuda::SumOfSquares(&t, 1);
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r->finite) << bad;
  }
}

TEST_F(CudaKernelsTest, ScaleCastRoundsToNearestEvenLikeTheHost) {
  const size_t n = 100'003;
  std::vector<float> in(n);
  for (size_t i = 0; i < n; ++i) in[i] = std::sin(static_cast<float>(i)) * 1000.0f;
  void* d_in = ToDevice(in.data(), n * 4);
  std::vector<uint16_t> zeros(n, 0);
  void* d_out = ToDevice(zeros.data(), n * 2);
  ASSERT_TRUE(cuda::ScaleCast(d_in, DType::kFp32, d_out, DType::kBf16, n, 0.25f).ok());
  std::vector<uint16_t> got(n);
  ASSERT_EQ(cudaMemcpy(got.data(), d_out, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < n; ++i) {
    const float x = in[i] * 0.25f;
    uint32_t b;
    std::memcpy(&b, &x, 4);
    const uint16_t want = static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
    ASSERT_EQ(got[i], want) << i;
  }
  EXPECT_EQ(cuda::ScaleCast(d_in, DType::kFp32, d_in, DType::kBf16, n, 1.0f).code(),
            StatusCode::kInvalidArgument);
}
#endif

}  // namespace
}  // namespace spillway::engine
