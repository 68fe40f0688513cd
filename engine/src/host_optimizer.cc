// HostOptimizer: validation, the norm/plan/update sequence and the fan-out over sub-group chunks.
// The arithmetic lives in the kernels (kernels_body.inc). See docs/engine.md, Note [Fused step].
#include "spillway/engine/host_optimizer.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "clock.h"
#include "kernels.h"
#include "worker_pool.h"

namespace spillway::engine {

static_assert(kernels::kF32 == static_cast<int>(DType::kFp32) &&
                  kernels::kBf16 == static_cast<int>(DType::kBf16) &&
                  kernels::kF16 == static_cast<int>(DType::kFp16),
              "the kernel tables are indexed by DType's value");

namespace {

// The kernel tables' state index: kF32 (0) or kBf16 (1), as Check allows.
int StateIndex(const SubGroup& g) {
  return g.state_dtype == DType::kBf16 ? kernels::kBf16 : kernels::kF32;
}

const kernels::Table& TableFor(Isa isa) {
  switch (isa) {
    case Isa::kAvx2:
      return kernels::Avx2Table();
    case Isa::kAvx512:
      return kernels::Avx512Table();
    case Isa::kAvx512Bf16:
      return kernels::Avx512Bf16Table();
    default:
      return kernels::ScalarTable();
  }
}

std::string GroupName(const SubGroup& g) {
  return g.name.empty() ? std::string("sub-group") : StrCat("sub-group '", g.name, "'");
}

// A chunk of one group: the unit of work handed to a thread.
struct Task {
  size_t group;
  uint64_t begin, end;
};

std::vector<Task> Split(std::span<const SubGroup> groups, uint64_t chunk) {
  std::vector<Task> tasks;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (uint64_t b = 0; b < groups[g].numel; b += chunk) {
      tasks.push_back({g, b, std::min(groups[g].numel, b + chunk)});
    }
  }
  return tasks;
}

}  // namespace

namespace {
// The hyperparameters' domains; `where` prefixes the message ("" or "<group>: ").
Status CheckConfig(const AdamWConfig& a, std::string_view where) {
  const std::string at = where.empty() ? std::string() : StrCat(where, ": ");
  if (!(a.lr >= 0.0) || !std::isfinite(a.lr)) {
    return Status::InvalidArgument(
        StrCat(at, "AdamW lr = ", a.lr, " is invalid; use a finite lr >= 0"));
  }
  for (auto [name, beta] : {std::pair{"beta1", a.beta1}, std::pair{"beta2", a.beta2}}) {
    if (!(beta >= 0.0 && beta < 1.0)) {
      return Status::InvalidArgument(
          StrCat(at, "AdamW ", name, " = ", beta, " is invalid; use a value in [0, 1)"));
    }
  }
  if (!(a.eps > 0.0) || !std::isfinite(a.eps)) {
    return Status::InvalidArgument(StrCat(at, "AdamW eps = ", a.eps, " is invalid; use eps > 0"));
  }
  if (!(a.weight_decay >= 0.0) || !std::isfinite(a.weight_decay)) {
    return Status::InvalidArgument(
        StrCat(at, "AdamW weight_decay = ", a.weight_decay, " is invalid; use a value >= 0"));
  }
  return Status::Ok();
}
}  // namespace

Result<std::unique_ptr<HostOptimizer>> HostOptimizer::Create(const HostOptimizerOptions& options) {
  SPILLWAY_RETURN_IF_ERROR(CheckConfig(options.adam, ""));
  if (options.chunk_elems == 0 || options.chunk_elems % kernels::kBlock != 0) {
    return Status::InvalidArgument(StrCat("chunk_elems = ", options.chunk_elems,
                                          " is invalid; use a positive multiple of ",
                                          kernels::kBlock));
  }
  if (options.threads > 1024) {
    return Status::InvalidArgument(
        StrCat("threads = ", options.threads, " is invalid; use 0 (one per CPU) up to 1024"));
  }
  SPILLWAY_ASSIGN_OR_RETURN(Isa isa, ResolveIsa(options.isa));
  return std::unique_ptr<HostOptimizer>(new HostOptimizer(options, isa));
}

HostOptimizer::HostOptimizer(const HostOptimizerOptions& options, Isa isa)
    : options_(options), isa_(isa), table_(&TableFor(isa)) {
  uint32_t threads = options.threads;
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  pool_ = std::make_unique<WorkerPool>(threads);
}

HostOptimizer::~HostOptimizer() = default;

uint32_t HostOptimizer::threads() const { return pool_->threads(); }

Status HostOptimizer::SetLearningRate(double lr) {
  if (!(lr >= 0.0) || !std::isfinite(lr)) {
    return Status::InvalidArgument(StrCat("AdamW lr = ", lr, " is invalid; use a finite lr >= 0"));
  }
  options_.adam.lr = lr;
  return Status::Ok();
}

void HostOptimizer::RestoreStep(uint64_t step) { step_ = step; }

Status HostOptimizer::Check(const SubGroup& g, bool needs_state) const {
  if (g.numel == 0) {
    return Status::InvalidArgument(StrCat(GroupName(g), " has numel 0; register non-empty groups"));
  }
  if (g.grad == nullptr) return Status::InvalidArgument(StrCat(GroupName(g), " has no gradient"));
  if (!IsFloatingDType(g.grad_dtype) || !IsFloatingDType(g.param_dtype)) {
    return Status::InvalidArgument(StrCat(
        GroupName(g), " has gradient dtype ", DTypeName(g.grad_dtype), " and 16-bit copy dtype ",
        DTypeName(g.param_dtype), "; both must be float32, bfloat16 or float16"));
  }
  if (!needs_state) return Status::Ok();
  if (g.state_dtype != DType::kFp32 && g.state_dtype != DType::kBf16) {
    return Status::InvalidArgument(StrCat(GroupName(g), " has state dtype ",
                                          DTypeName(g.state_dtype),
                                          "; master weights and moments must be float32 or "
                                          "bfloat16"));
  }
  const uint64_t state_bytes = g.numel * DTypeBytes(g.state_dtype);
  struct Range {
    const char* what;
    const void* p;
    uint64_t bytes;
  };
  const Range ranges[] = {{"master", g.master, state_bytes},
                          {"exp_avg", g.exp_avg, state_bytes},
                          {"exp_avg_sq", g.exp_avg_sq, state_bytes},
                          {"grad", g.grad, g.numel * DTypeBytes(g.grad_dtype)},
                          {"param", g.param, g.numel * DTypeBytes(g.param_dtype)}};
  for (const Range& r : ranges) {
    if (r.p == nullptr && std::string_view(r.what) != "param") {
      return Status::InvalidArgument(StrCat(GroupName(g), " has no ", r.what, " buffer"));
    }
  }
  for (size_t i = 0; i < std::size(ranges); ++i) {
    for (size_t j = i + 1; j < std::size(ranges); ++j) {
      if (ranges[i].p == nullptr || ranges[j].p == nullptr) continue;
      const auto a = reinterpret_cast<uintptr_t>(ranges[i].p);
      const auto b = reinterpret_cast<uintptr_t>(ranges[j].p);
      if (a < b + ranges[j].bytes && b < a + ranges[i].bytes) {
        return Status::InvalidArgument(StrCat(GroupName(g), ": the ", ranges[i].what, " and ",
                                              ranges[j].what, " buffers overlap; each state ",
                                              "needs its own ", g.numel, "-element buffer"));
      }
    }
  }
  return Status::Ok();
}

Result<double> HostOptimizer::SumOfSquaresAll(std::span<const SubGroup> groups) {
  for (const SubGroup& g : groups) SPILLWAY_RETURN_IF_ERROR(Check(g, /*needs_state=*/false));
  const auto& t = *static_cast<const kernels::Table*>(table_);
  const std::vector<Task> tasks = Split(groups, options_.chunk_elems);
  std::vector<double> partial(tasks.size());
  pool_->Run(tasks.size(), [&](size_t i) {
    const Task& k = tasks[i];
    const SubGroup& g = groups[k.group];
    partial[i] = t.sum_sq[static_cast<int>(g.grad_dtype)](g.grad, k.begin, k.end);
  });
  double sum = 0.0;
  for (double p : partial) sum += p;  // chunk order: independent of threads and path
  return sum;
}

Result<double> HostOptimizer::SumOfSquares(const SubGroup& group) {
  return SumOfSquaresAll(std::span<const SubGroup>(&group, 1));
}

Result<StepReport> HostOptimizer::Plan(double sum_of_squares, const StepOptions& options) {
  if (!(options.loss_scale > 0.0) || !std::isfinite(options.loss_scale)) {
    return Status::InvalidArgument(StrCat("loss_scale = ", options.loss_scale,
                                          " is invalid; use a finite value > 0 (1 without fp16)"));
  }
  if (!(options.max_grad_norm >= 0.0)) {
    return Status::InvalidArgument(StrCat("max_grad_norm = ", options.max_grad_norm,
                                          " is invalid; use a value > 0, or 0 for no clipping"));
  }
  StepReport r;
  r.grad_norm = std::sqrt(sum_of_squares) / options.loss_scale;
  if (!std::isfinite(r.grad_norm)) {
    r.skipped = true;
    r.combined_scale = 0.0;
    skipped_.fetch_add(1, std::memory_order_relaxed);
    return r;
  }
  double clip = 1.0;
  if (options.max_grad_norm > 0.0) {
    clip = std::min(1.0, options.max_grad_norm / (r.grad_norm + 1e-6));  // torch's clip_grad_norm_
  }
  r.combined_scale = clip / options.loss_scale;
  r.step = ++step_;
  steps_.fetch_add(1, std::memory_order_relaxed);
  return r;
}

Status HostOptimizer::Unplan(const StepReport& plan) {
  if (plan.skipped || plan.step == 0) return Status::Ok();
  if (plan.step != step_) {
    return Status::FailedPrecondition(StrCat("Unplan: step ", plan.step, " is not the last plan (",
                                             step_, "); only the last plan can be taken back"));
  }
  --step_;
  steps_.fetch_sub(1, std::memory_order_relaxed);
  return Status::Ok();
}

void HostOptimizer::RunAdam(std::span<const SubGroup> groups, const AdamWConfig& c,
                            uint64_t step_number, double grad_scale, bool fused) {
  const auto& t = *static_cast<const kernels::Table*>(table_);
  const double step = static_cast<double>(step_number);
  const double bc1 = c.bias_correction ? 1.0 - std::pow(c.beta1, step) : 1.0;
  const double bc2 = c.bias_correction ? 1.0 - std::pow(c.beta2, step) : 1.0;
  kernels::AdamArgs base{};
  base.grad_scale = fused ? static_cast<float>(grad_scale) : 1.0f;
  base.beta1 = static_cast<float>(c.beta1);
  base.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  base.beta2 = static_cast<float>(c.beta2);
  base.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  base.eps = static_cast<float>(c.eps);
  base.decay = c.adamw_mode ? static_cast<float>(1.0 - c.lr * c.weight_decay) : 1.0f;
  base.l2 = c.adamw_mode ? 0.0f : static_cast<float>(c.weight_decay);
  base.neg_step_size = static_cast<float>(-c.lr / bc1);
  base.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));

  const std::vector<Task> tasks = Split(groups, options_.chunk_elems);
  if (!fused) {  // pass 2 of the unfused sequence: rewrite the gradients scaled
    const float scale = static_cast<float>(grad_scale);
    pool_->Run(tasks.size(), [&](size_t i) {
      const Task& k = tasks[i];
      const SubGroup& g = groups[k.group];
      t.scale[static_cast<int>(g.grad_dtype)](const_cast<void*>(g.grad), scale, k.begin, k.end);
    });
  }
  pool_->Run(tasks.size(), [&](size_t i) {
    const Task& k = tasks[i];
    const SubGroup& g = groups[k.group];
    kernels::AdamArgs a = base;
    a.master = g.master;
    a.exp_avg = g.exp_avg;
    a.exp_avg_sq = g.exp_avg_sq;
    a.grad = g.grad;
    a.param = g.param;
    const int p = (g.param == nullptr || !fused) ? kernels::kNone : static_cast<int>(g.param_dtype);
    t.adam[StateIndex(g)][static_cast<int>(g.grad_dtype)][p](a, k.begin, k.end);
  });
  if (!fused) {  // pass 4: the 16-bit copy
    pool_->Run(tasks.size(), [&](size_t i) {
      const Task& k = tasks[i];
      const SubGroup& g = groups[k.group];
      if (g.param != nullptr)
        t.cast[StateIndex(g)][static_cast<int>(g.param_dtype)](g.master, g.param, k.begin, k.end);
    });
  }
}

Status HostOptimizer::Update(const SubGroup& group, const StepReport& plan) {
  SPILLWAY_RETURN_IF_ERROR(Check(group, /*needs_state=*/true));
  if (plan.skipped) return Status::Ok();
  if (plan.step == 0 || plan.step > step_) {
    return Status::FailedPrecondition(StrCat("Update got a plan for step ", plan.step,
                                             " but the optimizer is at step ", step_,
                                             "; pass the StepReport that Plan returned"));
  }
  const uint64_t t0 = NowNs();
  RunAdam(std::span<const SubGroup>(&group, 1), options_.adam, plan.step, plan.combined_scale,
          /*fused=*/true);
  elements_.fetch_add(group.numel, std::memory_order_relaxed);
  step_ns_total_.fetch_add(NowNs() - t0, std::memory_order_relaxed);
  return Status::Ok();
}

Status HostOptimizer::UpdateWith(const SubGroup& group, const AdamWConfig& adam, uint64_t step,
                                 double grad_scale) {
  SPILLWAY_RETURN_IF_ERROR(Check(group, /*needs_state=*/true));
  SPILLWAY_RETURN_IF_ERROR(CheckConfig(adam, group.name));
  if (step == 0) {
    return Status::InvalidArgument(StrCat(group.name,
                                          ": Adam step 0; the first step is 1 (count "
                                          "the step before calling, as torch.optim does)"));
  }
  if (!std::isfinite(grad_scale)) {
    return Status::InvalidArgument(StrCat(group.name, ": gradient scale ", grad_scale,
                                          " is not finite; skip the step instead"));
  }
  const uint64_t t0 = NowNs();
  RunAdam(std::span<const SubGroup>(&group, 1), adam, step, grad_scale, /*fused=*/true);
  elements_.fetch_add(group.numel, std::memory_order_relaxed);
  step_ns_total_.fetch_add(NowNs() - t0, std::memory_order_relaxed);
  return Status::Ok();
}

Result<StepReport> HostOptimizer::RunStep(std::span<const SubGroup> groups,
                                          const StepOptions& options, bool fused) {
  const uint64_t t0 = NowNs();
  uint64_t elements = 0;
  for (const SubGroup& g : groups) {
    SPILLWAY_RETURN_IF_ERROR(Check(g, /*needs_state=*/true));
    elements += g.numel;
  }
  SPILLWAY_ASSIGN_OR_RETURN(double sum, SumOfSquaresAll(groups));
  SPILLWAY_ASSIGN_OR_RETURN(StepReport plan, Plan(sum, options));
  if (!plan.skipped) {
    RunAdam(groups, options_.adam, plan.step, plan.combined_scale, fused);
    elements_.fetch_add(elements, std::memory_order_relaxed);
  }
  const uint64_t ns = NowNs() - t0;
  step_ns_total_.fetch_add(ns, std::memory_order_relaxed);
  last_step_ns_.store(ns, std::memory_order_relaxed);
  return plan;
}

Result<StepReport> HostOptimizer::Step(std::span<const SubGroup> groups,
                                       const StepOptions& options) {
  return RunStep(groups, options, /*fused=*/true);
}

Result<StepReport> HostOptimizer::StepUnfused(std::span<const SubGroup> groups,
                                              const StepOptions& options) {
  return RunStep(groups, options, /*fused=*/false);
}

HostOptimizerStats HostOptimizer::Stats() const {
  HostOptimizerStats s;
  s.steps = steps_.load(std::memory_order_relaxed);
  s.skipped_steps = skipped_.load(std::memory_order_relaxed);
  s.elements_updated = elements_.load(std::memory_order_relaxed);
  s.step_ns_total = step_ns_total_.load(std::memory_order_relaxed);
  s.last_step_ns = last_step_ns_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace spillway::engine
