// HostOptimizer: the fused host-side AdamW step over ZeRO-3 sub-groups. One pass per sub-group
// reads the gradient (fp32, bf16 or fp16), applies the combined unscale-and-clip factor, updates
// the fp32 master weights and both Adam moments, and writes the 16-bit parameter copy. The global
// gradient norm is computed first, from the gradients where they live, as a host double; an
// inf/NaN norm skips the step and is counted (loss-scaling semantics). See docs/engine.md,
// Note [Fused step].
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "spillway/base/dtype.h"
#include "spillway/base/status.h"
#include "spillway/engine/cpu_features.h"

namespace spillway::engine {

struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  bool adamw_mode = true;  // decoupled weight decay (AdamW); false: L2 added to the gradient
  bool bias_correction = true;
};

// One sub-group's buffers, all `numel` elements long and not overlapping one another.
struct SubGroup {
  std::string_view name;  // for error messages ("layer3.exp_avg group 7")
  uint64_t numel = 0;
  // The state, in `state_dtype`: fp32, or bf16 (DeepSpeed's bf16_optimizer_states with
  // bf16_master_weights_and_grads: loaded to fp32, updated in fp32, stored rounded to nearest
  // even).
  void* master = nullptr;      // master weights (updated)
  void* exp_avg = nullptr;     // (updated)
  void* exp_avg_sq = nullptr;  // (updated)
  DType state_dtype = DType::kFp32;
  const void* grad = nullptr;  // gradients, still multiplied by the loss scale
  DType grad_dtype = DType::kFp32;
  void* param = nullptr;  // parameter copy written from the new master; null: none
  DType param_dtype = DType::kBf16;
};

struct HostOptimizerOptions {
  AdamWConfig adam;
  uint32_t threads = 0;            // 0: one per online CPU
  Isa isa = Isa::kAuto;            // kAuto: the best path this CPU runs (CPUID at run time)
  uint64_t chunk_elems = 1 << 16;  // elements per task; a multiple of 16
};

struct StepOptions {
  double loss_scale = 1.0;     // the gradients are divided by this
  double max_grad_norm = 0.0;  // clip the global norm to this (torch's clip_grad_norm_); 0: off
};

struct StepReport {
  double grad_norm = 0.0;       // global L2 norm of the unscaled gradients (inf/NaN if overflowed)
  bool skipped = false;         // the norm was not finite: nothing was updated
  double combined_scale = 1.0;  // what each gradient element was multiplied by
  uint64_t step = 0;            // the Adam step number used for bias correction (0 if skipped)
};

struct HostOptimizerStats {
  uint64_t steps = 0;             // applied
  uint64_t skipped_steps = 0;     // inf/NaN gradients
  uint64_t elements_updated = 0;  // summed over applied steps
  uint64_t step_ns_total = 0;     // wall time in Step / StepUnfused
  uint64_t last_step_ns = 0;
};

class WorkerPool;  // engine/src/worker_pool.h

// Thread-compatible: one thread drives a HostOptimizer (it fans the work out to its own pool).
// Stats() may be read from any thread.
class HostOptimizer {
 public:
  static Result<std::unique_ptr<HostOptimizer>> Create(const HostOptimizerOptions& options);
  ~HostOptimizer();
  HostOptimizer(const HostOptimizer&) = delete;
  HostOptimizer& operator=(const HostOptimizer&) = delete;

  // The whole step: global norm, skip on inf/NaN, the combined factor, then the fused pass over
  // every group. On an error nothing was updated.
  Result<StepReport> Step(std::span<const SubGroup> groups, const StepOptions& options = {});

  // The same step in pieces, for groups that stream in from NVMe one at a time:
  //   sum += SumOfSquares(g) for every group; plan = Plan(sum, options);
  //   then Update(g, plan) for every group as it arrives (nothing to do when plan.skipped).
  Result<double> SumOfSquares(const SubGroup& group);  // of the gradients as stored (scaled)
  Result<StepReport> Plan(double sum_of_squares, const StepOptions& options);
  Status Update(const SubGroup& group, const StepReport& plan);
  // One fused pass over `group` with the caller's hyperparameters and Adam step number, for callers
  // that keep both per parameter group (DeepSpeed's CPU Adam, torch.optim): `step` is this group's
  // step counted from 1, `grad_scale` multiplies every gradient element (the combined
  // unscale-and-clip factor). Neither this optimizer's step counter nor its config is used or
  // changed. On an error nothing was updated.
  Status UpdateWith(const SubGroup& group, const AdamWConfig& adam, uint64_t step,
                    double grad_scale);
  // Takes back a plan no group was updated with (the step failed before the first Update), so
  // the next plan reuses its Adam step number. FAILED_PRECONDITION if a later plan was made.
  Status Unplan(const StepReport& plan);

  // The unfused sequence DeepSpeed runs (norm pass, unscale/clip pass that rewrites the
  // gradients, Adam pass, fp32 -> 16-bit copy pass), built from the same kernels: the baseline of
  // bench/compare_optimizer. Overwrites the gradients with the scaled ones.
  Result<StepReport> StepUnfused(std::span<const SubGroup> groups, const StepOptions& options = {});

  Isa isa() const { return isa_; }
  uint32_t threads() const;
  const AdamWConfig& config() const { return options_.adam; }
  Status SetLearningRate(double lr);  // schedulers change lr between steps
  uint64_t step() const { return step_; }
  // A checkpoint's resume: the Adam steps already applied to the state it restored (the next
  // applied step is step + 1, as bias correction needs). The counters in Stats() are this
  // process's and are not changed.
  void RestoreStep(uint64_t step);
  HostOptimizerStats Stats() const;

 private:
  HostOptimizer(const HostOptimizerOptions& options, Isa isa);
  Status Check(const SubGroup& group, bool needs_state) const;
  Result<double> SumOfSquaresAll(std::span<const SubGroup> groups);
  void RunAdam(std::span<const SubGroup> groups, const AdamWConfig& adam, uint64_t step,
               double grad_scale, bool fused);
  Result<StepReport> RunStep(std::span<const SubGroup> groups, const StepOptions& options,
                             bool fused);

  HostOptimizerOptions options_;
  const Isa isa_;
  const void* table_;  // kernels::Table of isa_
  std::unique_ptr<WorkerPool> pool_;
  uint64_t step_ = 0;  // Adam steps applied so far (the next applied step is step_ + 1)

  std::atomic<uint64_t> steps_{0}, skipped_{0}, elements_{0}, step_ns_total_{0}, last_step_ns_{0};
};

}  // namespace spillway::engine
