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

#include "kernels_scalar_ops.h"
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

// The kernels read 16-byte vectors from the first aligned element on and handle the head and the
// tail one element at a time: every offset from an aligned base and every length around a vector
// and a chunk boundary must give the host's answer.
TEST_F(CudaKernelsTest, TheNormIsExactAtEveryAlignmentAndLength) {
  const size_t max_n = 200'011 + 8;
  std::vector<float> f(max_n);
  for (size_t i = 0; i < max_n; ++i) f[i] = std::cos(0.37f * static_cast<float>(i)) * 3.0f + 0.01f;
  for (DType dt : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    const size_t es = DTypeBytes(dt);
    std::vector<uint8_t> host(max_n * es);
    std::vector<double> value(max_n);
    for (size_t i = 0; i < max_n; ++i) {
      if (dt == DType::kFp32) {
        std::memcpy(&host[i * 4], &f[i], 4);
        value[i] = f[i];
      } else {
        const uint16_t h =
            dt == DType::kBf16 ? kernels::Bf16FromFloat(f[i]) : kernels::F16FromFloat(f[i]);
        std::memcpy(&host[i * 2], &h, 2);
        value[i] = dt == DType::kBf16 ? kernels::FloatFromBf16(h) : kernels::FloatFromF16(h);
      }
    }
    auto* base = static_cast<uint8_t*>(ToDevice(host.data(), host.size()));
    for (size_t offset : {0, 1, 3, 7}) {
      for (size_t n : {1, 5, 8, 9, 65'535, 65'536, 65'537, 200'011}) {
        double want = 0;
        for (size_t i = offset; i < offset + n; ++i) want += value[i] * value[i];
        cuda::DeviceTensor t{base + offset * es, n, dt};
        auto r = cuda::SumOfSquares(&t, 1);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        EXPECT_NEAR(r->sum_of_squares, want, 1e-12 * want)
            << DTypeName(dt) << " offset " << offset << " n " << n;
        EXPECT_TRUE(r->finite);
      }
    }
    if (es == 2) {  // a pointer between two elements is refused, naming the alignment
      cuda::DeviceTensor odd{base + 1, 10, dt};
      auto r = cuda::SumOfSquares(&odd, 1);
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(r.status().message().find("not aligned"), std::string::npos)
          << r.status().ToString();
    }
  }
}

TEST_F(CudaKernelsTest, ScaleCastEveryDtypePairAtEveryAlignment) {
  const size_t max_n = 10'007 + 8;
  std::vector<float> f(max_n);
  for (size_t i = 0; i < max_n; ++i) f[i] = std::sin(0.11f * static_cast<float>(i)) * 100.0f + 0.5f;
  auto encode = [](DType dt, float x, uint8_t* out) {
    if (dt == DType::kFp32) {
      std::memcpy(out, &x, 4);
    } else {
      const uint16_t h = dt == DType::kBf16 ? kernels::Bf16FromFloat(x) : kernels::F16FromFloat(x);
      std::memcpy(out, &h, 2);
    }
  };
  auto decode = [](DType dt, const uint8_t* in) {
    if (dt == DType::kFp32) {
      float x;
      std::memcpy(&x, in, 4);
      return x;
    }
    uint16_t h;
    std::memcpy(&h, in, 2);
    return dt == DType::kBf16 ? kernels::FloatFromBf16(h) : kernels::FloatFromF16(h);
  };
  const float scale = 0.3f;
  for (DType di : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    std::vector<uint8_t> in(max_n * DTypeBytes(di));
    for (size_t i = 0; i < max_n; ++i) encode(di, f[i], &in[i * DTypeBytes(di)]);
    auto* d_in = static_cast<uint8_t*>(ToDevice(in.data(), in.size()));
    for (DType dout : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      const size_t eo = DTypeBytes(dout);
      for (size_t off_in : {0, 3}) {
        for (size_t off_out : {0, 1}) {
          for (size_t n : {1, 7, 8, 9, 10'007}) {
            std::vector<uint8_t> poison(max_n * eo, 0xA5);
            auto* d_out = static_cast<uint8_t*>(ToDevice(poison.data(), poison.size()));
            ASSERT_TRUE(cuda::ScaleCast(d_in + off_in * DTypeBytes(di), di, d_out + off_out * eo,
                                        dout, n, scale)
                            .ok());
            std::vector<uint8_t> got(poison.size());
            ASSERT_EQ(cudaMemcpy(got.data(), d_out, got.size(), cudaMemcpyDeviceToHost),
                      cudaSuccess);
            for (size_t i = 0; i < max_n; ++i) {
              std::vector<uint8_t> want(eo, 0xA5);  // outside [off_out, off_out + n): untouched
              if (i >= off_out && i < off_out + n) {
                encode(dout, decode(di, &in[(i - off_out + off_in) * DTypeBytes(di)]) * scale,
                       want.data());
              }
              ASSERT_EQ(std::memcmp(&got[i * eo], want.data(), eo), 0)
                  << DTypeName(di) << "->" << DTypeName(dout) << " in+" << off_in << " out+"
                  << off_out << " n " << n << " element " << i;
            }
          }
        }
      }
    }
  }
}
#endif

}  // namespace
}  // namespace spillway::engine
