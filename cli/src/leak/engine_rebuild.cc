// engine-rebuild: the trainer created and destroyed 10 times in one process, as RLHF loops do,
// where something still holds each old engine. Detector: the ledger's live host bytes after each
// rebuild (one "epoch" each), boundary rule. Note [Leak suite] in docs/leak-suite.md.
#include <functional>
#include <vector>

#include "leak/rig.h"
#include "leak/scenario.h"
#include "leak/tiny_trainer.h"
#include "spillway/offload/partition_store.h"

namespace spillway::cli::leak {
namespace {

constexpr int kRebuilds = 10;
// States homed in host memory, for the rig and for every engine's own store.
constexpr RigOptions kRig = {.offload = offload::OffloadDevice::kCpu};

// A trainer with a store of its own over the rig's arenas, both in one ledger scope; it does not
// report steps to the ledger (here the rebuilds are the epochs).
struct Engine {
  std::unique_ptr<offload::PartitionStore> store;
  std::unique_ptr<trainer::Trainer> trainer;
};

Result<Engine> MakeEngine(offload::Tiers& rig, const offload::Config& config,
                          trainer::Collectives* collectives, const trainer::GptConfig& c,
                          allocator::ScopeId scope) {
  Engine e;
  SPILLWAY_ASSIGN_OR_RETURN(
      e.store, offload::PartitionStore::Create(config, rig.host.get(), rig.nvme.get(), scope));
  SPILLWAY_ASSIGN_OR_RETURN(
      e.trainer, trainer::Trainer::Create(TrainerOptionsFor(c), collectives, e.store.get(),
                                          rig.host.get(), nullptr, scope));
  return e;
}

// Both arms share the collectives and the model's shape; each builds its own rig.
class EngineRebuild final : public Trial {
 public:
  EngineRebuild(const LeakSuiteOptions& suite, std::unique_ptr<trainer::Collectives> collectives)
      : suite_(suite), collectives_(std::move(collectives)) {}

  // Each old engine is destroyed and its scope released.
  Status Spillway(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite_, kRig));
    auto retire = [&](Engine& e, allocator::ScopeId scope) -> Status {
      e.trainer.reset();
      e.store.reset();
      return rig->ledger.ReleaseScope(scope).status();
    };
    return Rebuild(*rig, retire, &out->spillway);
  }

  // Something still holds each old engine.
  Status Control(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig, MakeRig(suite_, kRig));
    std::vector<Engine> lingering;
    auto retire = [&](Engine& e, allocator::ScopeId) {
      lingering.push_back(std::move(e));
      return Status::Ok();
    };
    return Rebuild(*rig, retire, &out->control);
  }

  void Verdict(ScenarioOutcome* out) override {
    out->epochs = kRebuilds;
    out->tolerance = 4096;
    ScoreBy(out, &LeakSeries::BoundaryGrowthPerEpoch);
  }

 private:
  // kRebuilds times: an engine in a new scope takes one step, then `retire` deals with it.
  Status Rebuild(offload::Tiers& rig,
                 const std::function<Status(Engine& e, allocator::ScopeId scope)>& retire,
                 LeakSeries* series) {
    const offload::Config config = RigConfig(suite_, kRig);
    int64_t step = 0;
    series->Add(0, 0, true, HostLive(rig));
    for (int k = 1; k <= kRebuilds; ++k) {
      SPILLWAY_ASSIGN_OR_RETURN(const allocator::ScopeId scope,
                                rig.ledger.CreateScope(StrCat("engine ", k)));
      SPILLWAY_ASSIGN_OR_RETURN(Engine e,
                                MakeEngine(rig, config, collectives_.get(), model_, scope));
      SPILLWAY_RETURN_IF_ERROR(e.trainer->Step({Batch(model_, k)}).status());
      series->Add(++step, k, false, HostLive(rig));
      SPILLWAY_RETURN_IF_ERROR(retire(e, scope));
      series->Add(step, k, true, HostLive(rig));
    }
    return Status::Ok();
  }

  const LeakSuiteOptions suite_;
  std::unique_ptr<trainer::Collectives> collectives_;
  const trainer::GptConfig model_ = Tiny(2);
};

}  // namespace

Result<std::unique_ptr<Trial>> StartEngineRebuild(const LeakSuiteOptions& suite) {
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<trainer::Collectives> collectives,
                            trainer::Collectives::Create(trainer::DistEnv{}));
  return std::unique_ptr<Trial>(std::make_unique<EngineRebuild>(suite, std::move(collectives)));
}

}  // namespace spillway::cli::leak
