// AVX-512 kernels: a block of 16 is one vector. Built twice: without native bf16 conversion
// (integer rounding, any AVX-512F/BW/VL CPU) and with AVX512_BF16's VCVTNEPS2BF16
// (kernels_avx512bf16.cc defines SPILLWAY_NATIVE_BF16 and includes this file). Same operations,
// same order as the scalar reference (kernels_body.inc).
#include <immintrin.h>

#include <cstring>

#include "kernels.h"
#include "kernels_scalar_ops.h"

namespace spillway::engine::kernels {
namespace {

using F = __m512;
struct Acc {
  __m512d lo, hi;  // lanes 0-7, 8-15
};

F Set(float x) { return _mm512_set1_ps(x); }
F Add(F a, F b) { return _mm512_add_ps(a, b); }
F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
F Div(F a, F b) { return _mm512_div_ps(a, b); }
F Sqrt(F a) { return _mm512_sqrt_ps(a); }
F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }

F LoadF32(const float* p) { return _mm512_loadu_ps(p); }
void StoreF32(float* p, F x) { _mm512_storeu_ps(p, x); }

F LoadBf16(const uint16_t* p) {
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
void StoreBf16(uint16_t* p, F x) {
#if defined(SPILLWAY_NATIVE_BF16)
  const __m256bh h = _mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(h));
#else
  const __m512i b = _mm512_castps_si512(x);
  const __m512i top = _mm512_srli_epi32(b, 16);
  const __m512i lsb = _mm512_and_si512(top, _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 is_small = _mm512_cmpeq_epi32_mask(
      _mm512_and_si512(b, _mm512_set1_epi32(0x7F800000)), _mm512_setzero_si512());
  r = _mm512_mask_and_epi32(r, is_small, top, _mm512_set1_epi32(0x8000));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, is_nan, top, _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}

F LoadF16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
void StoreF16(uint16_t* p, F x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

Acc AccZero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
void AccSq(Acc& acc, F x) {
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d hi =
      _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(x), 1)));
  acc.lo = _mm512_fmadd_pd(lo, lo, acc.lo);
  acc.hi = _mm512_fmadd_pd(hi, hi, acc.hi);
}
void AccStore(double out[kBlock], const Acc& acc) {
  _mm512_storeu_pd(out, acc.lo);
  _mm512_storeu_pd(out + 8, acc.hi);
}

#include "kernels_body.inc"

}  // namespace

#if defined(SPILLWAY_NATIVE_BF16)
const Table& Avx512Bf16Table() {
  static const Table table = MakeTable("avx512_bf16");
  return table;
}
#else
const Table& Avx512Table() {
  static const Table table = MakeTable("avx512");
  return table;
}
#endif

}  // namespace spillway::engine::kernels
