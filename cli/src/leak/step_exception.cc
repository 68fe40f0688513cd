// step-exception: a layer fails in the middle of a step, where hand-written swap code frees its
// gather buffers only at the end of the forward pass, which the exception skips. Detector: the
// ledger's live host bytes at every step and boundary, boundary rule. Note [Leak suite].
#include <torch/torch.h>

#include <stdexcept>
#include <vector>

#include "leak/rig.h"
#include "leak/scenario.h"
#include "leak/tiny_trainer.h"

namespace spillway::cli::leak {
namespace {

using allocator::Kind;
using allocator::Lifetime;
using allocator::OwnerTag;
namespace gpt = trainer::gpt;

constexpr int kEpochs = 4, kSteps = 3;
constexpr RigOptions kRig = {.offload = offload::OffloadDevice::kCpu};

trainer::GptConfig Model() {
  trainer::GptConfig c = Tiny(2);
  c.vocab = 256;  // an embedding of 68 KiB: what one failure strands is well above a page
  return c;
}

// The second step of every epoch throws in the middle. Both arms share the collectives and the
// model's shape; each builds its own rig.
class StepException final : public Trial {
 public:
  StepException(const LeakSuiteOptions& suite, std::unique_ptr<trainer::Collectives> collectives)
      : suite_(suite), collectives_(std::move(collectives)) {}

  // The trainer's step: after the first micro-batch's forward and backward, the second one's
  // forward fails at unit 1 (a libtorch error there, injected through the trainer's fault seam;
  // bad token ids would be refused before the step starts, Note [Guard]). The step is abandoned
  // and everything it held goes back.
  Status Spillway(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite_, kRig));
    offload::Tiers& r = *rig;
    const int64_t units = gpt::Units(model_);
    bool armed = false;
    int64_t forwards = 0;  // units whose forward started in this step
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<trainer::Trainer> trainer,
                              MakeTrainer(r, collectives_.get(), model_));
    trainer->SetFaultHookForTesting([&](int64_t u) {
      if (armed && ++forwards > units && u == 1)
        throw std::runtime_error("step-exception: injected in the forward");
    });
    LeakSeries& series = out->spillway;
    int64_t step = 0;
    series.Add(0, 0, true, HostLive(r));
    for (int ep = 1; ep <= kEpochs; ++ep) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(ep));
      for (int s = 0; s < kSteps; ++s) {
        std::vector<torch::Tensor> mbs = {Batch(model_, ep * 10 + s),
                                          Batch(model_, ep * 10 + s + 5)};
        armed = s == 1;
        forwards = 0;
        auto res = trainer->Step(mbs);
        if (!res.ok())
          ++failures_;
        else if (s == 1)
          return Status::Internal(
              "step-exception: the step with the injected failure did not fail");
        series.Add(++step, ep, false, HostLive(r));
      }
      SPILLWAY_RETURN_IF_ERROR(SampleLiveAtEpoch(r, &series, step, ep));
    }
    series.escapes = TotalEscapes(r);
    return Status::Ok();
  }

  // Per-unit gather buffers freed at the end of the forward pass, which an exception skips (no
  // RAII, as in hand-written swap code); the second step's batch has token ids past the
  // vocabulary, so unit 0 throws.
  Status Control(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite_, kRig));
    offload::Tiers& r = *rig;
    const torch::Tensor bad = torch::full({4, model_.seq_len + 1}, model_.vocab + 5, torch::kInt64);
    std::vector<torch::Tensor> flats;
    for (int64_t u = 0; u < gpt::Units(model_); ++u) flats.push_back(gpt::InitUnit(model_, u));
    SPILLWAY_ASSIGN_OR_RETURN(const allocator::ScopeId naive,
                              r.ledger.CreateScope("naive forward"));
    LeakSeries& series = out->control;
    int64_t step = 0;
    series.Add(0, 0, true, HostLive(r));
    for (int ep = 1; ep <= kEpochs; ++ep) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(ep));
      for (int s = 0; s < kSteps; ++s) {
        SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginStep(++step));
        const torch::Tensor t = s == 1 ? bad : Batch(model_, ep * 10 + s);
        std::vector<void*> gathers;
        try {
          torch::NoGradGuard no_grad;
          torch::Tensor x = t.narrow(1, 0, model_.seq_len);
          for (int64_t u = 0; u < gpt::Units(model_); ++u) {
            SPILLWAY_ASSIGN_OR_RETURN(
                void* p,
                r.host->Allocate(flats[u].numel() * 4,
                                 OwnerTag{Kind::kTransient, Lifetime::kStep,
                                          static_cast<uint64_t>(u), naive, SPILLWAY_SITE}));
            gathers.push_back(p);
            torch::Tensor g = torch::from_blob(p, {flats[u].numel()}, torch::kFloat32);
            g.copy_(flats[u]);
            x = gpt::Forward(model_, u, g, x);  // unit 0 throws on the bad batch
          }
          for (void* p : gathers) SPILLWAY_RETURN_IF_ERROR(r.host->Free(p));
        } catch (const c10::Error&) {
          // The training loop logs and goes on; the gathers are never freed.
        }
        SPILLWAY_RETURN_IF_ERROR(SampleLiveAtStep(r, &series, step, ep));
      }
      SPILLWAY_RETURN_IF_ERROR(SampleLiveAtEpoch(r, &series, step, ep));
    }
    series.escapes = TotalEscapes(r);
    return r.ledger.ReleaseScope(naive).status();
  }

  // Besides the growths: Spillway's step failed once an epoch.
  void Verdict(ScenarioOutcome* out) override {
    out->epochs = kEpochs;
    out->tolerance = 4096;
    if (failures_ != kEpochs)
      out->failure = StrCat("expected ", kEpochs, " failed steps, saw ", failures_);
    ScoreBy(out, &LeakSeries::BoundaryGrowthPerEpoch);
    out->notes.push_back(StrCat("failed steps: ", failures_, "; escapes: spillway ",
                                out->spillway.escapes, ", control ", out->control.escapes));
  }

 private:
  const LeakSuiteOptions suite_;
  std::unique_ptr<trainer::Collectives> collectives_;
  const trainer::GptConfig model_ = Model();
  uint64_t failures_ = 0;  // Spillway's steps that failed
};

}  // namespace

Result<std::unique_ptr<Trial>> StartStepException(const LeakSuiteOptions& suite) {
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<trainer::Collectives> collectives,
                            trainer::Collectives::Create(trainer::DistEnv{}));
  return std::unique_ptr<Trial>(std::make_unique<StepException>(suite, std::move(collectives)));
}

}  // namespace spillway::cli::leak
