// The host optimizer's SIMD kernels: one table per instruction set, all built from the same
// templated body (kernels_body.inc) so every path runs the same operations in the same order and
// their fp32 results are bit-identical. See docs/engine.md, Note [Fused step].
//
// This header is included by translation units compiled with different -m flags. It declares
// only plain structs and function pointers: nothing inline that the linker could merge across
// instruction sets.
#pragma once

#include <cstddef>
#include <cstdint>

namespace spillway::engine::kernels {

// Every kernel works on [begin, end) of a sub-group; begin is a multiple of kBlock. Elements are
// processed in blocks of 16 on every path (two AVX2 vectors, one AVX-512 vector, sixteen scalars),
// and the tail is padded to a block, so results never depend on the path or the thread count.
inline constexpr size_t kBlock = 16;

// The tables' index for a dtype is its DType value (asserted in host_optimizer.cc: this header
// includes nothing with inline code).
enum DTypeIndex : int { kF32 = 0, kBf16 = 1, kF16 = 2, kNone = 3 };

struct AdamArgs {
  // The state, in the state dtype (kF32, or kBf16: DeepSpeed's bf16_optimizer_states).
  void* master;      // master weights, updated in place
  void* exp_avg;     // first moment
  void* exp_avg_sq;  // second moment
  const void* grad;  // gradients in grad dtype
  void* param;       // 16-bit (or fp32) parameter copy written from the new master; may be null
  float grad_scale;  // combined unscale and clip factor, applied to every gradient element
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float decay;          // AdamW: 1 - lr * weight_decay; Adam (L2) mode: 1
  float l2;             // Adam (L2) mode: weight_decay added to the gradient as l2 * w; AdamW: 0
  float neg_step_size;  // -lr / bias_correction1
  float inv_bc2_sqrt;   // 1 / sqrt(bias_correction2); denom = sqrt(v) * inv_bc2_sqrt + eps
};

struct Table {
  const char* name;
  // Sum of squares of grad[begin, end) in double, 16 lanes, fixed reduction order.
  double (*sum_sq[3])(const void* grad, size_t begin, size_t end);
  // The fused step: [state dtype: kF32 or kBf16][grad dtype][param dtype].
  void (*adam[2][3][4])(const AdamArgs& args, size_t begin, size_t end);
  // The unfused sequence's passes (the baseline DeepSpeed runs): grad *= scale in place, and the
  // master -> parameter copy, [state dtype][param dtype].
  void (*scale[3])(void* grad, float scale, size_t begin, size_t end);
  void (*cast[2][3])(const void* master, void* param, size_t begin, size_t end);
};

const Table& ScalarTable();
const Table& Avx2Table();        // requires AVX2 + FMA + F16C
const Table& Avx512Table();      // requires AVX-512 F/BW/VL + F16C
const Table& Avx512Bf16Table();  // also requires AVX512_BF16

}  // namespace spillway::engine::kernels
