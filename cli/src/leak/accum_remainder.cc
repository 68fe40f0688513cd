// accum-remainder: 10 micro-batches an epoch, accumulated over 4, where a hand-written loop drops
// the remainder's accumulation buffer at the epoch's end. Detector: the ledger's live host bytes
// at every step and boundary, boundary rule. Note [Leak suite] in docs/leak-suite.md.
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <functional>
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

constexpr int kEpochs = 4, kMicro = 10, kAccum = 4;
constexpr RigOptions kRig = {.offload = offload::OffloadDevice::kCpu};

// Both arms share the collectives and the model's shape; each builds its own rig.
class AccumRemainder final : public Trial {
 public:
  AccumRemainder(const LeakSuiteOptions& suite, std::unique_ptr<trainer::Collectives> collectives)
      : suite_(suite), collectives_(std::move(collectives)) {}

  // The trainer takes the remainder as a short step, inside the ledger's step.
  Status Spillway(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite_, kRig));
    offload::Tiers& r = *rig;
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<trainer::Trainer> trainer,
                              MakeTrainer(r, collectives_.get(), model_));
    LeakSeries& series = out->spillway;
    int64_t step = 0;
    series.Add(0, 0, true, HostLive(r));
    for (int ep = 1; ep <= kEpochs; ++ep) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(ep));
      for (int m = 0; m < kMicro; m += kAccum) {
        std::vector<torch::Tensor> mbs;
        for (int k = m; k < std::min(kMicro, m + kAccum); ++k)
          mbs.push_back(Batch(model_, ep * 100 + k));
        SPILLWAY_RETURN_IF_ERROR(trainer->Step(mbs).status());
        series.Add(++step, ep, false, HostLive(r));
      }
      SPILLWAY_RETURN_IF_ERROR(SampleLiveAtEpoch(r, &series, step, ep));
    }
    series.escapes = TotalEscapes(r);
    return Status::Ok();
  }

  // A hand-written accumulation loop: it opens an accumulation buffer per window and frees it
  // when the window reaches 4; the remainder's buffer is dropped at the epoch's end.
  Status Control(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite_, kRig));
    offload::Tiers& r = *rig;
    int64_t numel = 0;
    for (int64_t u = 0; u < gpt::Units(model_); ++u) numel += gpt::UnitNumel(model_, u);
    std::vector<torch::Tensor> flats;
    for (int64_t u = 0; u < gpt::Units(model_); ++u)
      flats.push_back(gpt::InitUnit(model_, u).requires_grad_(true));
    SPILLWAY_ASSIGN_OR_RETURN(const allocator::ScopeId naive,
                              r.ledger.CreateScope("naive accumulation loop"));
    LeakSeries& series = out->control;
    int64_t step = 0;
    series.Add(0, 0, true, HostLive(r));
    for (int ep = 1; ep <= kEpochs; ++ep) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(ep));
      float* accum = nullptr;
      int in_window = 0;
      for (int k = 0; k < kMicro; ++k) {
        if (accum == nullptr) {
          SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginStep(++step));
          SPILLWAY_ASSIGN_OR_RETURN(
              void* p, r.host->Allocate(numel * 4, OwnerTag{Kind::kGrad, Lifetime::kStep, 1, naive,
                                                            SPILLWAY_SITE}));
          accum = static_cast<float*>(p);
          std::memset(accum, 0, numel * 4);
        }
        const torch::Tensor t = Batch(model_, ep * 100 + k);
        torch::Tensor x = t.narrow(1, 0, model_.seq_len);
        for (int64_t u = 0; u < gpt::Units(model_); ++u) x = gpt::Forward(model_, u, flats[u], x);
        gpt::Loss(x, t.narrow(1, 1, model_.seq_len)).backward();
        torch::Tensor acc = torch::from_blob(accum, {numel}, torch::kFloat32);
        int64_t off = 0;
        for (auto& f : flats) {
          acc.narrow(0, off, f.numel()).add_(f.grad());
          off += f.numel();
          f.mutable_grad().zero_();
        }
        if (++in_window == kAccum) {
          SPILLWAY_RETURN_IF_ERROR(r.host->Free(accum));
          accum = nullptr;
          in_window = 0;
          SPILLWAY_RETURN_IF_ERROR(SampleLiveAtStep(r, &series, step, ep));
        }
      }
      if (accum != nullptr) {  // the remainder: the loop moves on and forgets the buffer
        SPILLWAY_RETURN_IF_ERROR(SampleLiveAtStep(r, &series, step, ep));
      }
      SPILLWAY_RETURN_IF_ERROR(SampleLiveAtEpoch(r, &series, step, ep));
    }
    series.escapes = TotalEscapes(r);
    return r.ledger.ReleaseScope(naive).status();
  }

  // Besides the growths: Spillway's live bytes are the same at every boundary after the first.
  void Verdict(ScenarioOutcome* out) override {
    out->epochs = kEpochs;
    out->tolerance = 4096;
    std::vector<double> b;
    for (const auto& p : out->spillway.points) {
      if (p.boundary && p.epoch > 0) b.push_back(p.bytes);
    }
    if (std::adjacent_find(b.begin(), b.end(), std::not_equal_to<>()) != b.end())
      out->failure = "live bytes differ between epoch boundaries";
    ScoreBy(out, &LeakSeries::BoundaryGrowthPerEpoch);
    out->notes.push_back(
        StrCat("escapes: spillway ", out->spillway.escapes, ", control ", out->control.escapes));
  }

 private:
  const LeakSuiteOptions suite_;
  std::unique_ptr<trainer::Collectives> collectives_;
  const trainer::GptConfig model_ = Tiny();
};

}  // namespace

Result<std::unique_ptr<Trial>> StartAccumRemainder(const LeakSuiteOptions& suite) {
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<trainer::Collectives> collectives,
                            trainer::Collectives::Create(trainer::DistEnv{}));
  return std::unique_ptr<Trial>(std::make_unique<AccumRemainder>(suite, std::move(collectives)));
}

}  // namespace spillway::cli::leak
