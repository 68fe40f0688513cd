// Buffers of one sub-group for the optimizer tests: fp32 master weights and moments, gradients and
// a parameter copy in any dtype, filled from a seed.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "spillway/engine/host_optimizer.h"

namespace spillway::engine::testing {

inline uint16_t TopHalf(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return static_cast<uint16_t>(b >> 16);
}

struct GroupBuffers {
  uint64_t numel = 0;
  DType grad_dtype = DType::kFp32;
  DType param_dtype = DType::kBf16;
  bool with_param = true;
  std::vector<float> master, exp_avg, exp_avg_sq;
  std::vector<unsigned char> grad, param;

  GroupBuffers(uint64_t n, DType g, DType p, bool has_param, uint64_t seed)
      : numel(n),
        grad_dtype(g),
        param_dtype(p),
        with_param(has_param),
        master(n),
        exp_avg(n),
        exp_avg_sq(n),
        grad(n * DTypeBytes(g)),
        param(n * DTypeBytes(p)) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> w(0.0f, 1.0f);
    for (uint64_t i = 0; i < n; ++i) master[i] = w(rng);
    FillGrad(seed + 1, 1.0f);
  }

  // Gradients ~ N(0, sigma) stored in grad_dtype (bf16 by truncation-free rounding of the top
  // half, fp16 by the hardware-independent rule: values small enough to be exact in both).
  void FillGrad(uint64_t seed, float sigma) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> d(0.0f, sigma);
    for (uint64_t i = 0; i < numel; ++i) SetGrad(i, d(rng));
  }

  void SetGrad(uint64_t i, float x) {
    if (grad_dtype == DType::kFp32) {
      std::memcpy(grad.data() + 4 * i, &x, 4);
    } else if (grad_dtype == DType::kBf16) {
      const uint16_t h = TopHalf(x);  // any bit pattern is a valid bf16 gradient
      std::memcpy(grad.data() + 2 * i, &h, 2);
    } else {
      // An fp16 value built from a small integer and an exponent: exact in fp16 and fp32.
      const int q = static_cast<int>(x * 256.0f);
      const uint16_t h = F16Of(static_cast<float>(q) / 256.0f);
      std::memcpy(grad.data() + 2 * i, &h, 2);
    }
  }
  void SetGradBits(uint64_t i, uint32_t bits32, uint16_t bits16) {
    if (grad_dtype == DType::kFp32) {
      std::memcpy(grad.data() + 4 * i, &bits32, 4);
    } else {
      std::memcpy(grad.data() + 2 * i, &bits16, 2);
    }
  }
  float GradAt(uint64_t i) const {
    if (grad_dtype == DType::kFp32) {
      float x;
      std::memcpy(&x, grad.data() + 4 * i, 4);
      return x;
    }
    uint16_t h;
    std::memcpy(&h, grad.data() + 2 * i, 2);
    if (grad_dtype == DType::kBf16) {
      const uint32_t b = static_cast<uint32_t>(h) << 16;
      float x;
      std::memcpy(&x, &b, 4);
      return x;
    }
    return FloatOfF16(h);
  }

  // Exact for the values SetGrad makes (|q| < 2048, scaled by 2^-8).
  static uint16_t F16Of(float x) {
    if (x == 0.0f) return std::signbit(x) ? 0x8000 : 0;
    uint16_t sign = x < 0 ? 0x8000 : 0;
    float a = std::fabs(x);
    int e;
    const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    const int exp = e - 1 + 15;
    const uint32_t mant = static_cast<uint32_t>((m * 2.0f - 1.0f) * 1024.0f);
    return static_cast<uint16_t>(sign | (exp << 10) | mant);
  }
  static float FloatOfF16(uint16_t h) {
    const int exp = (h >> 10) & 0x1F;
    const int mant = h & 0x3FF;
    const float sign = (h & 0x8000) ? -1.0f : 1.0f;
    if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -24);
    if (exp == 31) return mant ? NAN : sign * INFINITY;
    return sign * std::ldexp(1.0f + static_cast<float>(mant) / 1024.0f, exp - 15);
  }

  SubGroup View(const char* name = "test") {
    SubGroup g;
    g.name = name;
    g.numel = numel;
    g.master = master.data();
    g.exp_avg = exp_avg.data();
    g.exp_avg_sq = exp_avg_sq.data();
    g.grad = grad.data();
    g.grad_dtype = grad_dtype;
    g.param = with_param ? param.data() : nullptr;
    g.param_dtype = param_dtype;
    return g;
  }

  bool SameState(const GroupBuffers& o) const {
    return std::memcmp(master.data(), o.master.data(), numel * 4) == 0 &&
           std::memcmp(exp_avg.data(), o.exp_avg.data(), numel * 4) == 0 &&
           std::memcmp(exp_avg_sq.data(), o.exp_avg_sq.data(), numel * 4) == 0 &&
           (!with_param || param == o.param);
  }
};

}  // namespace spillway::engine::testing
