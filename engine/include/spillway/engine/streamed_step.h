// StreamedStep: one optimizer step over sub-groups whose fp32 master weights and Adam moments live
// in a PartitionStore (host or NVMe homed). Gradients and the 16-bit parameter copy are host
// buffers. After the norm pass, group i is updated while a reader thread swaps group i+1 in and a
// writer thread writes group i-1 back to NVMe and drops its host copy, so at most three groups'
// state is resident and the disk time hides behind the update. See docs/engine.md,
// Note [Streamed step].
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "spillway/base/status.h"
#include "spillway/engine/host_optimizer.h"
#include "spillway/offload/partition_store.h"

namespace spillway::engine {

struct StreamedGroup {
  std::string name;
  uint64_t numel = 0;
  offload::PartitionId master = 0;      // fp32, numel * 4 bytes
  offload::PartitionId exp_avg = 0;     // fp32
  offload::PartitionId exp_avg_sq = 0;  // fp32
  const void* grad = nullptr;           // host gradients (still loss-scaled)
  DType grad_dtype = DType::kFp32;
  void* param = nullptr;  // host parameter copy written by the step; may be null
  DType param_dtype = DType::kBf16;
};

struct StreamedStepStats {
  uint64_t groups = 0;         // groups that took the step (also when the step fails)
  uint64_t evictions = 0;      // NVMe-homed groups written back behind the update
  uint64_t update_ns = 0;      // time in the fused update
  uint64_t wait_read_ns = 0;   // time the update loop waited for a swap-in
  uint64_t wait_write_ns = 0;  // time it waited for a write-back (bounded in-flight state)
  uint64_t total_ns = 0;
};

// On success every group has the step applied and NVMe-homed state is back on NVMe. A failed read
// or update (an I/O error, a checksum mismatch, the budget) names the group; groups before it have
// the step applied and those from it on do not (no buffer is ever half-updated). A failed
// write-back names the groups that have the step; their state stays in host memory and
// PartitionStore::Flush() retries the write. Nothing is lost either way.
// `reduce_sum`, when given, turns this rank's sum of squared gradients into the global one (an
// all-reduce across ZeRO ranks) before the plan is made.
using NormReducer = std::function<Result<double>(double local_sum_of_squares)>;
Result<StepReport> StreamedStep(HostOptimizer& optimizer, offload::PartitionStore& store,
                                std::span<const StreamedGroup> groups,
                                const StepOptions& options = {}, StreamedStepStats* stats = nullptr,
                                const NormReducer& reduce_sum = nullptr);

// Test seam: the next `n` thread launches of StreamedStep fail as std::async does when the
// process cannot start a thread.
void FailThreadLaunchesForTesting(int n);

}  // namespace spillway::engine
