// fork-cow: DataLoader workers re-forked every epoch, and the first optimizer step after the fork
// writes every page of optimizer state (xtuner's Yi-34B host OOM at epoch 2; pytorch#13246).
// Detector: the process tree's anonymous PSS after every step, peak rule. Note [Leak suite].
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "leak/rig.h"
#include "leak/scenario.h"
#include "spillway/base/bytes.h"
#include "spillway/cli/char_corpus.h"
#include "spillway/cli/fork_loader.h"
#include "spillway/engine/host_optimizer.h"

namespace spillway::cli::leak {
namespace {

using allocator::Kind;
using allocator::Lifetime;
using allocator::OwnerTag;

constexpr uint64_t kElems = 4ull << 20;  // 16 MiB per array: master, exp_avg, exp_avg_sq, grad
constexpr uint64_t kBytes = kElems * 4;
constexpr int kEpochs = 4, kSteps = 5;

// A small text for the data loader, written to the scratch directory.
Result<CharCorpus> ScratchCorpus(const LeakSuiteOptions& suite) {
  const std::string path = ScratchDir(suite) + "/corpus.txt";
  {
    std::ofstream f(path);
    for (int i = 0; i < 400; ++i)
      f << "the first optimizer step after a fork copies every page it writes. ";
  }
  return CharCorpus::Load(path, 64);
}

// Both arms step the same four arrays with one optimizer, fed by the same corpus; they differ in
// where the arrays live.
class ForkCow final : public Trial {
 public:
  ForkCow(CharCorpus corpus, std::unique_ptr<engine::HostOptimizer> optimizer,
          std::unique_ptr<offload::Tiers> rig)
      : corpus_(std::move(corpus)), optimizer_(std::move(optimizer)), rig_(std::move(rig)) {}

  // The state in the host arena, which forked workers do not inherit (ForkSafety::kDontFork).
  Status Spillway(ScenarioOutcome* out) override {
    const Kind kinds[4] = {Kind::kMasterWeight, Kind::kOptimizerState, Kind::kOptimizerState,
                           Kind::kGrad};
    float* arrays[4] = {};
    // Frees what was allocated however the run ends, a failed allocation included. The run's own
    // status is what the suite reports; freeing the state only tidies up.
    const auto free_all = [&] {
      for (float* a : arrays) {
        if (a != nullptr) rig_->host->Free(a).IgnoreError();
      }
    };
    for (int i = 0; i < 4; ++i) {
      auto p = rig_->host->Allocate(kBytes, OwnerTag{kinds[i], Lifetime::kPersistent,
                                                     static_cast<uint64_t>(i), 0, SPILLWAY_SITE});
      if (!p.ok()) {
        free_all();
        return p.status();
      }
      arrays[i] = static_cast<float*>(*p);
    }
    const Status st = Train(arrays, "spillway: ", &out->spillway, &out->notes);
    free_all();
    return st;
  }

  // The state in ordinary pageable memory, which every worker inherits copy-on-write.
  Status Control(ScenarioOutcome* out) override {
    float* arrays[4] = {};
    for (float*& a : arrays) {
      a = static_cast<float*>(std::aligned_alloc(64, kBytes));
      if (a == nullptr) {
        for (float* b : arrays) std::free(b);  // free(nullptr) is a no-op
        return Status::Make(StatusCode::kOutOfMemory,
                            StrCat("fork-cow control: aligned_alloc of ", FormatMiB(kBytes)));
      }
    }
    const Status st = Train(arrays, "control:  ", &out->control, &out->notes);
    for (float* a : arrays) std::free(a);
    return st;
  }

  void Verdict(ScenarioOutcome* out) override {
    out->epochs = kEpochs;
    // Pages the parent's runtime dirties while workers share them (thread stacks, heap, the
    // loader's buffers): measured at 0.2-0.5 MiB here, an eighth of one 16 MiB state array.
    out->tolerance = 2.0 * kMiB;
    ScoreBy(out, &LeakSeries::PeakGrowthPerEpoch);
  }

 private:
  // The workload: kEpochs epochs of kSteps fused optimizer steps over the arrays (master, both
  // moments, gradient), fed by a loader whose 2 workers are forked at every epoch's start; the
  // tree's PSS sampled after every step and at every boundary. Notes the first step's time after
  // each fork against the others', prefixed by `who`.
  Status Train(float* const (&arrays)[4], const char* who, LeakSeries* series,
               std::vector<std::string>* notes) {
    for (int i = 0; i < 4; ++i) std::fill(arrays[i], arrays[i] + kElems, i == 3 ? 1e-3f : 0.5f);
    engine::SubGroup g;
    g.name = "fork-cow";
    g.numel = kElems;
    g.master = arrays[0];
    g.exp_avg = arrays[1];
    g.exp_avg_sq = arrays[2];
    g.grad = arrays[3];
    g.param = nullptr;
    ForkingLoaderOptions lo;
    lo.workers = 2;
    lo.batch_size = 4;
    lo.seq_len = 32;
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<ForkingLoader> loader,
                              ForkingLoader::Create(&corpus_, lo));
    std::vector<int64_t> rows(lo.batch_size * loader->row_elems());
    int64_t step = 0;
    double first = 0, rest = 0;
    Status st;
    SPILLWAY_ASSIGN_OR_RETURN(const double before, TreePss());
    series->Add(step, 0, true, before);
    for (int e = 1; e <= kEpochs && st.ok(); ++e) {
      st = loader->BeginEpoch(e, kSteps);
      for (int s = 0; s < kSteps && st.ok(); ++s) {
        st = loader->Next(rows.data());
        if (!st.ok()) break;
        const auto t0 = std::chrono::steady_clock::now();
        auto rep = optimizer_->Step({&g, 1});
        const double sec =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!rep.ok()) st = rep.status();
        (s == 0 ? first : rest) += sec;
        auto pss = TreePss();
        if (!pss.ok())
          st = pss.status();
        else
          series->Add(++step, e, false, *pss);
      }
      if (st.ok()) st = loader->EndEpoch();
      auto pss = TreePss();
      if (st.ok() && pss.ok()) series->Add(step, e, true, *pss);
    }
    notes->push_back(
        StrCat(who, Fmt("first step after the fork %.1f ms, other steps %.1f ms (x%.2f)",
                        1e3 * first / kEpochs, 1e3 * rest / (kEpochs * (kSteps - 1)),
                        first / kEpochs / (rest / (kEpochs * (kSteps - 1))))));
    return st;
  }

  CharCorpus corpus_;  // ForkingLoader keeps its address
  std::unique_ptr<engine::HostOptimizer> optimizer_;
  std::unique_ptr<offload::Tiers> rig_;
};

}  // namespace

Result<std::unique_ptr<Trial>> StartForkCow(const LeakSuiteOptions& suite) {
  SPILLWAY_ASSIGN_OR_RETURN(CharCorpus corpus, ScratchCorpus(suite));
  engine::HostOptimizerOptions oo;
  oo.threads = 2;
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<engine::HostOptimizer> optimizer,
                            engine::HostOptimizer::Create(oo));
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite, {}));
  return std::unique_ptr<Trial>(
      std::make_unique<ForkCow>(std::move(corpus), std::move(optimizer), std::move(rig)));
}

}  // namespace spillway::cli::leak
