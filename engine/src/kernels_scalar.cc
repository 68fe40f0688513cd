// Scalar kernels: the reference every SIMD path must match bit for bit, and the fallback on CPUs
// without AVX2. Built without -m flags; std::fma keeps the fused steps fused.
#include <cmath>
#include <cstring>

#include "kernels.h"
#include "kernels_scalar_ops.h"

namespace spillway::engine::kernels {
namespace {

struct F {
  float v[kBlock];
};
struct Acc {
  double v[kBlock];
};

template <typename Op>
F Map(Op op) {
  F r;
  for (size_t i = 0; i < kBlock; ++i) r.v[i] = op(i);
  return r;
}

F Set(float x) {
  return Map([&](size_t) { return x; });
}
F Add(F a, F b) {
  return Map([&](size_t i) { return a.v[i] + b.v[i]; });
}
F Mul(F a, F b) {
  return Map([&](size_t i) { return a.v[i] * b.v[i]; });
}
F Div(F a, F b) {
  return Map([&](size_t i) { return a.v[i] / b.v[i]; });
}
F Sqrt(F a) {
  return Map([&](size_t i) { return std::sqrt(a.v[i]); });
}
F Fma(F a, F b, F c) {
  return Map([&](size_t i) { return std::fma(a.v[i], b.v[i], c.v[i]); });
}

F LoadF32(const float* p) {
  return Map([&](size_t i) { return p[i]; });
}
void StoreF32(float* p, F x) { std::memcpy(p, x.v, sizeof(x.v)); }
F LoadBf16(const uint16_t* p) {
  return Map([&](size_t i) { return FloatFromBf16(p[i]); });
}
void StoreBf16(uint16_t* p, F x) {
  for (size_t i = 0; i < kBlock; ++i) p[i] = Bf16FromFloat(x.v[i]);
}
F LoadF16(const uint16_t* p) {
  return Map([&](size_t i) { return FloatFromF16(p[i]); });
}
void StoreF16(uint16_t* p, F x) {
  for (size_t i = 0; i < kBlock; ++i) p[i] = F16FromFloat(x.v[i]);
}

Acc AccZero() { return Acc{}; }
void AccSq(Acc& acc, F x) {
  for (size_t i = 0; i < kBlock; ++i) {
    const double d = x.v[i];
    acc.v[i] = std::fma(d, d, acc.v[i]);
  }
}
void AccStore(double out[kBlock], const Acc& acc) { std::memcpy(out, acc.v, sizeof(acc.v)); }

#include "kernels_body.inc"

}  // namespace

const Table& ScalarTable() {
  static const Table table = MakeTable("scalar");
  return table;
}

}  // namespace spillway::engine::kernels
