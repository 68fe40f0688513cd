// swapped-alive: parameters swapped to NVMe and back every step, where the naive swapper keeps
// each swapped-out partition's host copy referenced (DeepSpeed #5700). Detector: the ledger's live
// host bytes at every step and boundary, boundary rule. Note [Leak suite] in docs/leak-suite.md.
#include <cstring>
#include <functional>
#include <vector>

#include "leak/rig.h"
#include "leak/scenario.h"
#include "spillway/base/bytes.h"
#include "spillway/offload/partition_store.h"

namespace spillway::cli::leak {
namespace {

using allocator::Kind;
using allocator::Lifetime;
using allocator::OwnerTag;

constexpr int kEpochs = 4, kSteps = 4, kParts = 8;
constexpr uint64_t kBytes = 2 * kMiB;

// kParts parameter partitions homed on NVMe in the rig's store; every step acquires each one
// (swap-in), updates it, hands its bytes to `keep`, releases and evicts it (swap-out). At the end
// each must read back the count of its round trips. The ledger's step and epoch boundaries report
// escapes, the first one's site into `site`.
Status Cycle(offload::Tiers& rig,
             const std::function<Status(offload::PartitionId id, const void* data)>& keep,
             LeakSeries* series, std::string* site) {
  offload::PartitionStore& store = *rig.store;
  std::vector<offload::PartitionId> ids;
  for (uint32_t i = 0; i < kParts; ++i) {
    SPILLWAY_ASSIGN_OR_RETURN(const offload::PartitionId id,
                              store.Register({0, i, offload::StateKind::kParam}, kBytes));
    ids.push_back(id);
  }
  int64_t step = 0;
  series->Add(0, 0, true, HostLive(rig));
  for (int e = 1; e <= kEpochs; ++e) {
    SPILLWAY_RETURN_IF_ERROR(rig.ledger.BeginEpoch(e));
    for (int s = 0; s < kSteps; ++s) {
      SPILLWAY_RETURN_IF_ERROR(rig.ledger.BeginStep(++step));
      for (offload::PartitionId id : ids) {
        SPILLWAY_ASSIGN_OR_RETURN(offload::Handle h,
                                  store.Acquire(id, offload::Access::kReadWrite));
        SPILLWAY_ASSIGN_OR_RETURN(void* data, h.Data());
        static_cast<float*>(data)[0] += 1.0f;
        SPILLWAY_RETURN_IF_ERROR(keep(id, data));
        SPILLWAY_RETURN_IF_ERROR(store.Release(h));
        SPILLWAY_RETURN_IF_ERROR(store.Evict(id));  // swap out: the host copy goes
      }
      SPILLWAY_RETURN_IF_ERROR(SampleLiveAtStep(rig, series, step, e, site));
    }
    SPILLWAY_RETURN_IF_ERROR(SampleLiveAtEpoch(rig, series, step, e, site));
  }
  // The data survived every round trip: each partition was incremented once per step.
  for (offload::PartitionId id : ids) {
    SPILLWAY_ASSIGN_OR_RETURN(offload::Handle h, store.Acquire(id, offload::Access::kRead));
    const float v = static_cast<float*>(*h.Data())[0];
    if (v != static_cast<float>(kEpochs * kSteps)) {
      return Status::Internal(StrCat("swapped-alive: partition ", id, " reads ", v, " after ",
                                     kEpochs * kSteps, " round trips"));
    }
    SPILLWAY_RETURN_IF_ERROR(store.Release(h));
  }
  return Status::Ok();
}

// Each arm builds its own rig, parameters on NVMe in the scratch directory.
class SwappedAlive final : public Trial {
 public:
  explicit SwappedAlive(const LeakSuiteOptions& suite) : suite_(suite) {}

  // Swap-out drops the host copy; nothing else refers to it.
  Status Spillway(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite_, {}));
    std::string site;
    return Cycle(
        *rig, [](offload::PartitionId, const void*) { return Status::Ok(); }, &out->spillway,
        &site);
  }

  // The naive swapper keeps a host copy of each partition after swap-out.
  Status Control(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite_, {}));
    std::vector<void*> kept;
    auto keep = [&](offload::PartitionId id, const void* data) -> Status {
      SPILLWAY_ASSIGN_OR_RETURN(
          void* copy, rig->host->Allocate(
                          kBytes, OwnerTag{Kind::kParam, Lifetime::kStep, id, 0, SPILLWAY_SITE}));
      std::memcpy(copy, data, kBytes);
      kept.push_back(copy);
      return Status::Ok();
    };
    std::string site;
    SPILLWAY_RETURN_IF_ERROR(Cycle(*rig, keep, &out->control, &site));
    for (void* p : kept) SPILLWAY_RETURN_IF_ERROR(rig->host->Free(p));
    out->notes.push_back(StrCat("control: escapes named at ", site));
    return Status::Ok();
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

Result<std::unique_ptr<Trial>> StartSwappedAlive(const LeakSuiteOptions& suite) {
  return std::unique_ptr<Trial>(std::make_unique<SwappedAlive>(suite));
}

}  // namespace spillway::cli::leak
