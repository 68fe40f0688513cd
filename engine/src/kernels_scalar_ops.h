// Scalar conversions that define what every kernel path computes (the SIMD paths implement the
// same rules lane by lane). Internal linkage on purpose: this header is compiled into translation
// units with different instruction sets, and no copy may be merged with another.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace spillway::engine::kernels {
namespace {

inline uint32_t BitsOf(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
inline float FloatOf(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// fp32 -> bf16, the rule of VCVTNEPS2BF16 (so the native AVX512_BF16 path agrees bit for bit):
// NaN stays NaN (top half, quiet bit set); zero and denormal inputs become a signed zero;
// everything else rounds to nearest even (overflow rounds to infinity).
inline uint16_t Bf16FromFloat(float x) {
  const uint32_t b = BitsOf(x);
  if ((b & 0x7F800000u) == 0x7F800000u && (b & 0x007FFFFFu) != 0) {
    return static_cast<uint16_t>((b >> 16) | 0x0040u);
  }
  if ((b & 0x7F800000u) == 0) return static_cast<uint16_t>((b >> 16) & 0x8000u);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
inline float FloatFromBf16(uint16_t h) { return FloatOf(static_cast<uint32_t>(h) << 16); }

// fp32 -> IEEE binary16, round to nearest even, denormals kept, overflow to infinity, NaN quiet
// (the rule of VCVTPS2PH with imm8 = round-to-nearest).
inline uint16_t F16FromFloat(float x) {
  uint32_t b = BitsOf(x);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  b &= 0x7FFFFFFFu;
  if (b >= 0x7F800000u) {  // inf or NaN
    return b == 0x7F800000u ? (sign | 0x7C00u)
                            : static_cast<uint16_t>(sign | 0x7E00u | ((b >> 13) & 0x3FFu));
  }
  if (b >= 0x477FF000u) return sign | 0x7C00u;  // rounds to 65520 or more: infinity
  if (b < 0x38800000u) {                        // below 2^-14: a half denormal (or zero)
    const uint32_t exp = b >> 23;
    const uint32_t shift = 126 - exp;  // mantissa (with its implicit bit) >> shift
    if (exp == 0 || shift > 24) return sign;
    const uint32_t mant = (b & 0x7FFFFFu) | 0x800000u;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (b - 0x38000000u) >> 13;  // rebias 127 -> 15
  const uint32_t rem = b & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float FloatFromF16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return FloatOf(sign | BitsOf(mag));
  }
  if (exp == 31) return FloatOf(sign | 0x7F800000u | (mant << 13));
  return FloatOf(sign | ((exp + 112) << 23) | (mant << 13));
}

}  // namespace
}  // namespace spillway::engine::kernels
