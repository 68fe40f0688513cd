// budget-pressure: a host budget of a quarter of the model states, so the store spills partitions
// to NVMe as it trains; the control is the same run with no budget, holding every state in host
// memory. Detector: host bytes held over the budget, most over it. Note [Leak suite].
#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "leak/rig.h"
#include "leak/scenario.h"
#include "leak/tiny_trainer.h"
#include "spillway/base/bytes.h"

namespace spillway::cli::leak {
namespace {

namespace gpt = trainer::gpt;

constexpr int kEpochs = 3, kSteps = 4;

// The most a series held over the budget (0 when it stayed under).
double MostOver(const LeakSeries& s) {
  double m = -1e300;
  for (const auto& p : s.points) m = std::max(m, p.bytes);
  return std::max(0.0, m);
}

// The two arms are one training run under two host budgets; their losses must match bit for bit.
class BudgetPressure final : public Trial {
 public:
  BudgetPressure(const LeakSuiteOptions& suite, std::unique_ptr<trainer::Collectives> collectives)
      : suite_(suite), collectives_(std::move(collectives)) {
    for (int64_t u = 0; u < gpt::Units(model_); ++u)
      state_bytes_ += 5 * 4 * gpt::UnitNumel(model_, u);
    budget_ = state_bytes_ / 4;
  }

  // Under the budget: the store spills partitions to the rig's NVMe arena as the budget fills.
  Status Spillway(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(spills_,
                              Train(budget_, "under the budget", &losses_[0], &out->spillway));
    return Status::Ok();
  }

  // Unbounded (1 GiB): every state stays in host memory.
  Status Control(ScenarioOutcome* out) override {
    return Train(1ull << 30, "unbounded", &losses_[1], &out->control).status();
  }

  // Besides the growths: the losses match, and the budget really made the store spill.
  void Verdict(ScenarioOutcome* out) override {
    out->epochs = kEpochs;
    out->tolerance = 0;
    out->spillway_growth = MostOver(out->spillway);
    out->control_growth = MostOver(out->control);
    if (losses_[0] != losses_[1])
      out->failure = "losses under the budget differ from the unbounded run's";
    if (spills_ == 0) out->failure = "nothing spilled: the budget did not bind";
    out->notes.push_back(StrCat("states ", FormatBytes(state_bytes_), ", budget ",
                                FormatBytes(budget_), ", partitions spilled to NVMe ", spills_,
                                ", losses identical to the "
                                "unbounded run: ",
                                losses_[0] == losses_[1] ? "yes" : "NO"));
  }

 private:
  // kEpochs epochs of kSteps steps on a rig whose host arena holds at most `host_budget_bytes`
  // (small regions and one small bounce buffer, so that the budget is what binds), sampling the
  // arena's peak committed bytes over budget_ (the same line for both arms); the losses go to
  // `losses`. Returns the partitions the store spilled. `what` names the run in errors.
  Result<uint64_t> Train(uint64_t host_budget_bytes, const char* what, std::vector<double>* losses,
                         LeakSeries* series) {
    RigOptions ro;
    ro.host_budget_bytes = host_budget_bytes;
    ro.offload = offload::OffloadDevice::kCpu;
    ro.region_bytes = 256 << 10;
    ro.bounce_buffers = 1;
    ro.block_size = 64 << 10;
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite_, ro));
    offload::Tiers& r = *rig;
    auto trainer = MakeTrainer(r, collectives_.get(), model_);
    if (!trainer.ok()) return trainer.status().WithContext(what);
    auto over = [&] {
      return static_cast<double>(r.host->Stats().peak_committed_bytes) -
             static_cast<double>(budget_);
    };
    int64_t step = 0;
    series->Add(0, 0, true, over());
    for (int ep = 1; ep <= kEpochs; ++ep) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(ep));
      for (int s = 0; s < kSteps; ++s) {
        auto res = (*trainer)->Step({Batch(model_, ep * 10 + s)});
        if (!res.ok()) return res.status().WithContext(what);
        losses->push_back(res->loss);
        series->Add(++step, ep, false, over());
      }
      allocator::BoundaryReport rep;
      SPILLWAY_RETURN_IF_ERROR(r.ledger.EndEpoch(&rep));
      series->Add(step, ep, true, over());
    }
    series->escapes = TotalEscapes(r);
    return r.store->Stats().spills;
  }

  const LeakSuiteOptions suite_;
  std::unique_ptr<trainer::Collectives> collectives_;
  const trainer::GptConfig model_ = Tiny(16, 64);
  uint64_t state_bytes_ = 0;  // the model's states: parameters, gradients, master, both moments
  uint64_t budget_ = 0;       // a quarter of them
  std::vector<double> losses_[2];  // Spillway's, the control's
  uint64_t spills_ = 0;            // Spillway's store's
};

}  // namespace

Result<std::unique_ptr<Trial>> StartBudgetPressure(const LeakSuiteOptions& suite) {
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<trainer::Collectives> collectives,
                            trainer::Collectives::Create(trainer::DistEnv{}));
  return std::unique_ptr<Trial>(std::make_unique<BudgetPressure>(suite, std::move(collectives)));
}

}  // namespace spillway::cli::leak
