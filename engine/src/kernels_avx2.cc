// AVX2 + FMA + F16C kernels: a block of 16 is two 8-lane vectors. Same operations, same order as
// the scalar reference (kernels_body.inc), so the results are identical bit for bit.
#include <immintrin.h>

#include <cstring>

#include "kernels.h"
#include "kernels_scalar_ops.h"

namespace spillway::engine::kernels {
namespace {

struct F {
  __m256 lo, hi;
};
struct Acc {
  __m256d a0, a1, a2, a3;  // lanes 0-3, 4-7, 8-11, 12-15
};

F Set(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
F Add(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
F Mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
F Div(F a, F b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
F Sqrt(F a) { return {_mm256_sqrt_ps(a.lo), _mm256_sqrt_ps(a.hi)}; }
F Fma(F a, F b, F c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

F LoadF32(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
void StoreF32(float* p, F x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}

__m256 Bf16x8ToF32(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
F LoadBf16(const uint16_t* p) {
  return {Bf16x8ToF32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          Bf16x8ToF32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
// Bf16FromFloat, eight lanes: 32-bit results in the low halves.
__m256i F32x8ToBf16(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i top = _mm256_srli_epi32(b, 16);
  const __m256i lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
  const __m256i rne =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
  const __m256i zero = _mm256_and_si256(top, _mm256_set1_epi32(0x8000));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i is_small = _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F800000)),
                                              _mm256_setzero_si256());
  __m256i r = _mm256_blendv_epi8(rne, zero, is_small);
  return _mm256_blendv_epi8(r, nan, is_nan);
}
void StoreBf16(uint16_t* p, F x) {
  const __m256i packed = _mm256_packus_epi32(F32x8ToBf16(x.lo), F32x8ToBf16(x.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}

F LoadF16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
void StoreF16(uint16_t* p, F x) {
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x.lo, kRne));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(x.hi, kRne));
}

Acc AccZero() {
  const __m256d z = _mm256_setzero_pd();
  return {z, z, z, z};
}
void AccSq(Acc& acc, F x) {
  const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x.lo));
  const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x.lo, 1));
  const __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(x.hi));
  const __m256d d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(x.hi, 1));
  acc.a0 = _mm256_fmadd_pd(d0, d0, acc.a0);
  acc.a1 = _mm256_fmadd_pd(d1, d1, acc.a1);
  acc.a2 = _mm256_fmadd_pd(d2, d2, acc.a2);
  acc.a3 = _mm256_fmadd_pd(d3, d3, acc.a3);
}
void AccStore(double out[kBlock], const Acc& acc) {
  _mm256_storeu_pd(out, acc.a0);
  _mm256_storeu_pd(out + 4, acc.a1);
  _mm256_storeu_pd(out + 8, acc.a2);
  _mm256_storeu_pd(out + 12, acc.a3);
}

#include "kernels_body.inc"

}  // namespace

const Table& Avx2Table() {
  static const Table table = MakeTable("avx2");
  return table;
}

}  // namespace spillway::engine::kernels
