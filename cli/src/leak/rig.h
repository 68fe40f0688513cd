// The leak scenarios' rig: the storage a run offloads into, offload::Tiers, composed from a Config
// the way `spillway train` composes it, in the suite's scratch directory; and the detectors the
// scenarios sample (ledger live bytes, arena committed bytes, the process tree's anonymous PSS).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "spillway/allocator/ledger.h"
#include "spillway/base/status.h"
#include "spillway/cli/leak_suite.h"
#include "spillway/offload/config.h"
#include "spillway/offload/tiers.h"

namespace spillway::cli::leak {

struct RigOptions {
  uint64_t host_budget_bytes = 1ull << 30;  // spillway.host_budget_bytes
  // Where the store homes partitions, as zero_optimization.offload_*.device name it:
  //   kNvme: parameters on an NVMe arena in the scratch directory (offload_param only);
  //   kCpu: every state in host memory (offload_param and offload_optimizer), with an NVMe arena
  //     in the scratch directory to spill to over the host budget;
  //   kNone: no NVMe arena at all.
  offload::OffloadDevice offload = offload::OffloadDevice::kNvme;
  uint64_t region_bytes = 32ull << 20;  // the host arena's (HostArenaOptions::region_bytes)
  uint64_t bounce_buffers = 8;          // the I/O engine's (IoEngineOptions::bounce_buffers)
  uint64_t block_size = 1ull << 20;     // aio.block_size
};

// Swap files and checkpoints go here: --scratch, else --out.
std::string ScratchDir(const LeakSuiteOptions& suite);

// The rig's config: ZeRO stage 3 offloading as `options` says, pinned the way `spillway train`
// pins (its default config has pin_memory: true, so PinMode::kAuto: CUDA-registered where a device
// is present, mlock otherwise), a 1 GiB NVMe budget, and no prefetching (the scenarios' stores
// take no prefetch thread).
offload::Config RigConfig(const LeakSuiteOptions& suite, const RigOptions& options);

// The tiers RigConfig describes; the store's partitions belong to the process scope. A machine
// whose mlock limit is too small fails here as the main job would, naming RLIMIT_MEMLOCK.
Result<std::unique_ptr<offload::Tiers>> MakeRig(const LeakSuiteOptions& suite,
                                                const RigOptions& options);

// The detectors.
inline double HostLive(const offload::Tiers& rig) {
  return static_cast<double>(rig.host->Stats().live_bytes);
}
inline double HostCommitted(const offload::Tiers& rig) {
  return static_cast<double>(rig.host->Stats().committed_bytes);
}
// The process tree's summed anonymous PSS (cli/proc_memory.h).
Result<double> TreePss();

// Escapes the rig's arenas found at every boundary so far (including abandoned steps' boundaries).
inline uint64_t TotalEscapes(const offload::Tiers& rig) {
  return rig.host->Stats().escape_count + (rig.nvme ? rig.nvme->Stats().escape_count : 0);
}
// Ends the ledger's step (or epoch), adds the boundary's escapes to series->escapes (the first
// listed escape's site to `first_site` when that is still empty), and samples the ledger's live
// host bytes there.
Status SampleLiveAtStep(offload::Tiers& rig, LeakSeries* series, int64_t step, int64_t epoch,
                        std::string* first_site = nullptr);
Status SampleLiveAtEpoch(offload::Tiers& rig, LeakSeries* series, int64_t step, int64_t epoch,
                         std::string* first_site = nullptr);
// One boundary report's escapes, summed over tiers; the first listed escape's site goes to
// `first_site` when that is still empty.
uint64_t Escapes(const allocator::BoundaryReport& report, std::string* first_site = nullptr);

}  // namespace spillway::cli::leak
