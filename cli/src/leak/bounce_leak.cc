// bounce-leak: I/O from pageable buffers through bounce buffers, epoch after epoch, where the
// naive path allocates a bounce buffer per operation and never frees it (DeepSpeed #6592).
// Detector: the ledger's live host bytes, boundary rule. Note [Leak suite] in docs/leak-suite.md.
#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "leak/rig.h"
#include "leak/scenario.h"
#include "spillway/base/bytes.h"

namespace spillway::cli::leak {
namespace {

using allocator::Kind;
using allocator::Lifetime;
using allocator::OwnerTag;

constexpr int kEpochs = 4, kSteps = 6;
constexpr uint64_t kBytes = 4 * kMiB;

// Every step writes kBytes of the user's pageable buffer to NVMe extent `offset` by `write`, reads
// them back into another pageable buffer (not arena memory) and checks them; the ledger's step and
// epoch boundaries report escapes, the first one's site into `site`.
Status Cycle(offload::Tiers& rig, uint64_t offset,
             const std::function<Status(const uint8_t* src)>& write, LeakSeries* series,
             std::string* site) {
  std::vector<uint8_t> src(kBytes), back(kBytes);
  int64_t step = 0;
  series->Add(0, 0, true, HostLive(rig));
  for (int e = 1; e <= kEpochs; ++e) {
    SPILLWAY_RETURN_IF_ERROR(rig.ledger.BeginEpoch(e));
    for (int s = 0; s < kSteps; ++s) {
      SPILLWAY_RETURN_IF_ERROR(rig.ledger.BeginStep(++step));
      std::fill(src.begin(), src.end(), static_cast<uint8_t>(step));
      SPILLWAY_RETURN_IF_ERROR(write(src.data()));
      SPILLWAY_RETURN_IF_ERROR(rig.nvme->Read(offset, back.data(), kBytes));
      if (back != src)
        return Status::Internal("bounce-leak: data read back differs from data written");
      SPILLWAY_RETURN_IF_ERROR(SampleLiveAtStep(rig, series, step, e, site));
    }
    SPILLWAY_RETURN_IF_ERROR(SampleLiveAtEpoch(rig, series, step, e, site));
  }
  return Status::Ok();
}

OwnerTag ExtentTag() { return OwnerTag{Kind::kParam, Lifetime::kPersistent, 1, 0, SPILLWAY_SITE}; }

// Each arm builds its own rig.
class BounceLeak final : public Trial {
 public:
  explicit BounceLeak(const LeakSuiteOptions& suite) : suite_(suite) {}

  // The engine bounces the pageable buffer through its own bounded pool.
  Status Spillway(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite_, {}));
    SPILLWAY_ASSIGN_OR_RETURN(const uint64_t offset, rig->nvme->Allocate(kBytes, ExtentTag()));
    std::string site;
    SPILLWAY_RETURN_IF_ERROR(Cycle(
        *rig, offset, [&](const uint8_t* src) { return rig->nvme->Write(offset, src, kBytes); },
        &out->spillway, &site));
    return rig->nvme->Free(offset);
  }

  // The naive path: a bounce buffer per operation that nobody frees, in a scope of its own.
  Status Control(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite_, {}));
    SPILLWAY_ASSIGN_OR_RETURN(const uint64_t offset, rig->nvme->Allocate(kBytes, ExtentTag()));
    SPILLWAY_ASSIGN_OR_RETURN(const allocator::ScopeId naive,
                              rig->ledger.CreateScope("naive I/O path"));
    auto write = [&](const uint8_t* src) -> Status {
      SPILLWAY_ASSIGN_OR_RETURN(
          void* bounce, rig->host->Allocate(kBytes, OwnerTag{Kind::kSwapBuffer, Lifetime::kStep, 7,
                                                             naive, SPILLWAY_SITE}));
      std::memcpy(bounce, src, kBytes);
      return rig->nvme->Write(offset, bounce, kBytes);
    };
    std::string site;
    SPILLWAY_RETURN_IF_ERROR(Cycle(*rig, offset, write, &out->control, &site));
    out->notes.push_back(
        StrCat("control: the ledger names the leaking site: ", site.empty() ? "(none!)" : site));
    if (site.empty()) out->failure = "the ledger did not name the control's leaking site";
    // Releasing the naive path's scope frees what it leaked.
    SPILLWAY_RETURN_IF_ERROR(rig->ledger.ReleaseScope(naive).status());
    return rig->nvme->Free(offset);
  }

  void Verdict(ScenarioOutcome* out) override {
    out->epochs = kEpochs;
    out->tolerance = 4096;
    ScoreBy(out, &LeakSeries::BoundaryGrowthPerEpoch);
  }

 private:
  const LeakSuiteOptions suite_;
};

}  // namespace

Result<std::unique_ptr<Trial>> StartBounceLeak(const LeakSuiteOptions& suite) {
  return std::unique_ptr<Trial>(std::make_unique<BounceLeak>(suite));
}

}  // namespace spillway::cli::leak
