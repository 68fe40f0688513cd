// LiveTable: the live allocations of one arena with their owner tags, the ring of recent frees
// that explains a bad Free, and the escape and scope sweeps a boundary runs. Shared by HostArena
// (addresses) and NvmeArena (file offsets); each owns the extents and the lock.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "spillway/allocator/ledger.h"
#include "spillway/allocator/live_stats.h"
#include "spillway/allocator/owner.h"
#include "spillway/base/status.h"

namespace spillway::allocator {

// Thread-compatible: the owning arena calls every method under its own mutex.
//
// Invariants (Validate): sum of live records == stats().live_bytes, and likewise per kind, per
// lifetime, and for requested bytes; every backtrace belongs to a live record.
class LiveTable {
 public:
  struct Live {
    uint64_t bytes;  // granule-rounded
    uint64_t requested;
    OwnerTag tag;
    int64_t birth_epoch;
    int64_t birth_step;
  };
  enum class FreeReason : uint8_t { kFreed, kReclaimed, kScopeReleased };
  // Frees one extent in the arena's extent map; called by the sweeps for each record they drop.
  using FreeExtentFn = std::function<void(uint64_t addr, uint64_t bytes)>;

  // `what` names the arena in messages: "host arena 'host'".
  LiveTable(Ledger* ledger, std::string what);

  void Insert(uint64_t addr, uint64_t bytes, uint64_t requested, const OwnerTag& tag,
              std::vector<void*>* frames);
  // Removes the record at addr (which must be live), leaves a tombstone, returns the record.
  Live Erase(uint64_t addr, FreeReason reason);
  const Live* Find(uint64_t addr) const;
  // Explains why addr is not a live allocation; `inside` says whether it lies in the arena.
  std::string DescribeBadFree(uint64_t addr, bool inside) const;
  void NoteBadFree() { stats_.bad_free_count++; }
  void ResetPeaks() {
    stats_.peak_live_bytes = stats_.live_bytes;
    stats_.peak_requested_bytes = stats_.requested_bytes;
  }

  // Boundary sweep: selects escapes (step records born at or before `step`; at an epoch end also
  // epoch records born at or before `epoch`), lists up to kMaxListedEscapes, frees them through
  // `free_extent` under the reclaim policy, and fills the live totals of `out`.
  // Backtraces of listed escapes come back in `traces` (escape index -> frames) for FinishEscapes.
  using Traces = std::vector<std::pair<size_t, std::vector<void*>>>;
  void CollectEscapes(BoundaryKind kind, int64_t epoch, int64_t step, EscapePolicy policy,
                      TierReport* out, Traces* traces, const FreeExtentFn& free_extent);
  // Frees every record of `scope` through `free_extent`.
  void ReleaseScope(ScopeId scope, TierReport* out, const FreeExtentFn& free_extent);
  void FillLive(TierReport* out) const;

  const LiveStats& stats() const { return stats_; }
  // The live extents (addr, bytes), for the arena's extent-map Validate.
  std::vector<std::pair<uint64_t, uint64_t>> Extents() const;
  Status Validate() const;

  // Outside any lock: fills scope names and symbolizes captured backtraces in out->escapes.
  static void FinishEscapes(const Ledger& ledger, const Traces& traces, TierReport* out);
  // The kEscaped status a `fail` policy returns, naming the first escape.
  static Status EscapeError(const std::string& what, BoundaryKind kind, int64_t epoch, int64_t step,
                            const TierReport& report);

  static constexpr size_t kMaxTombstones = 4096;

 private:
  struct Tombstone {
    uint64_t addr = 0;
    uint64_t bytes = 0;
    int64_t epoch = -1;
    int64_t step = -1;
    ScopeId scope = kProcessScope;
    FreeReason reason = FreeReason::kFreed;
  };
  static constexpr size_t kMaxCachedNodes = 64;

  Ledger* const ledger_;
  const std::string what_;
  std::map<uint64_t, Live> live_;  // by address; ordered for interior-pointer answers
  // Extracted nodes of live_, reused so the hot path allocates no tree nodes (bounded).
  std::vector<std::map<uint64_t, Live>::node_type> spare_nodes_;
  // Recent frees in a fixed ring, newest at tombstone_next_ - 1; scanned only on a failed Free.
  std::vector<Tombstone> tombstones_;
  size_t tombstone_next_ = 0;
  // Backtraces by address, only when the arena captures them.
  std::unordered_map<uint64_t, std::vector<void*>> traces_;
  LiveStats stats_;
};

}  // namespace spillway::allocator
