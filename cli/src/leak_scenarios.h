// The leak suite's scenarios (leak_scenarios.cc without libtorch, leak_scenarios_torch.cc with it)
// and the rig they share: a ledger, a host arena, an io_uring engine and an NVMe arena.
#pragma once

#include <memory>
#include <string>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/cli/leak_suite.h"

namespace spillway::cli::leak {

struct Rig {
  allocator::Ledger ledger;
  std::unique_ptr<allocator::HostArena> host;
  std::unique_ptr<allocator::IoEngine> io;
  std::unique_ptr<allocator::NvmeArena> nvme;
  ~Rig() {
    nvme.reset();
    io.reset();
    host.reset();
  }
};

struct RigOptions {
  uint64_t host_budget_bytes = 1ull << 30;
  bool capture_backtraces = false;
  bool with_nvme = true;
  allocator::ForkSafety fork_safety = allocator::ForkSafety::kDontFork;
  uint64_t region_bytes = 32ull << 20;
  uint32_t bounce_buffers = 8;
  uint64_t block_size = 1ull << 20;
};

// Host memory pinned the way `spillway train` pins it (PinMode::kAuto: CUDA or mlock).
Result<std::unique_ptr<Rig>> MakeRig(const LeakSuiteOptions& suite, const RigOptions& options);
std::string ScratchDir(const LeakSuiteOptions& suite);

// The first boundary report's escapes, summed over tiers, plus the listed escapes' sites.
uint64_t Escapes(const allocator::BoundaryReport& r, std::string* first_site = nullptr);

// The detectors the scenarios share.
inline double HostLive(const Rig& r) { return static_cast<double>(r.host->Stats().live_bytes); }
// Escapes the rig's arenas found at every boundary so far (including abandoned steps' boundaries).
inline uint64_t TotalEscapes(const Rig& r) {
  return r.host->Stats().escape_count + (r.nvme ? r.nvme->Stats().escape_count : 0);
}
// Sets both growths by one rule (LeakSeries::BoundaryGrowthPerEpoch or PeakGrowthPerEpoch).
inline void ScoreBy(ScenarioOutcome* out, double (LeakSeries::*rule)() const) {
  out->spillway_growth = (out->spillway.*rule)();
  out->control_growth = (out->control.*rule)();
}

Result<ScenarioOutcome> ForkCow(const LeakSuiteOptions& o);
Result<ScenarioOutcome> PinnedPow2(const LeakSuiteOptions& o);
Result<ScenarioOutcome> BounceLeak(const LeakSuiteOptions& o);
Result<ScenarioOutcome> SwappedAlive(const LeakSuiteOptions& o);
Result<ScenarioOutcome> EpochCheckpoint(const LeakSuiteOptions& o);
#if SPILLWAY_WITH_TORCH
Result<ScenarioOutcome> EngineRebuild(const LeakSuiteOptions& o);
Result<ScenarioOutcome> AccumRemainder(const LeakSuiteOptions& o);
Result<ScenarioOutcome> StepException(const LeakSuiteOptions& o);
Result<ScenarioOutcome> BudgetPressure(const LeakSuiteOptions& o);
#endif

}  // namespace spillway::cli::leak
