// HostArena: page-locked host memory in exact-size extents, fork-safe, budgeted, every byte owned.
// Regions are anonymous mappings pinned as a unit (cudaHostRegister or mlock) and marked so a
// forked child neither shares nor copies them. See docs/allocator.md.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "spillway/allocator/extent_map.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/live_stats.h"
#include "spillway/allocator/node_governor.h"
#include "spillway/allocator/owner.h"
#include "spillway/allocator/process.h"
#include "spillway/base/status.h"

namespace spillway::allocator {

class LiveTable;  // src/live_table.h

// How regions are made page-locked.
enum class PinMode : uint8_t {
  kAuto = 0,  // CUDA when a device is present at run time, mlock otherwise (logged once)
  kCuda,      // cudaHostRegister on anonymous mmap; fails when no device is present
  kMlock,     // mlock; needs RLIMIT_MEMLOCK or CAP_IPC_LOCK
  kPageable,  // no pinning (DeepSpeed's pin_memory=false)
};
const char* PinModeName(PinMode mode);
Result<PinMode> ParsePinMode(std::string_view name);

// What a forked child sees of the arena. Note [Fork safety] in docs/allocator.md.
enum class ForkSafety : uint8_t {
  kDontFork = 0,  // MADV_DONTFORK: the child has no mapping; touching it faults (the default)
  kWipeOnFork,    // MADV_WIPEONFORK: the child sees zero pages
  kInherit,       // copy-on-write like any memory: for negative controls only
};
const char* ForkSafetyName(ForkSafety mode);
Result<ForkSafety> ParseForkSafety(std::string_view name);

// The memory this process may use: physical memory, lowered by the cgroup limit of the process's
// own cgroup or any ancestor (v2 `memory.max`, v1 `memory.limit_in_bytes`) where one is set. A
// container's limit is what the OOM killer enforces, not the machine's RAM.
//   proc_self_cgroup: the text of /proc/self/cgroup; cgroup_root: where the hierarchy is mounted.
uint64_t MemoryLimitBytes();
uint64_t MemoryLimitBytes(std::string_view proc_self_cgroup, const std::string& cgroup_root,
                          uint64_t physical_bytes);
// The limit in force and where it is set: the cgroup directory whose limit file gave it, the
// outermost of equal ones (empty: no cgroup limits below physical memory, the machine's). The node
// ledger is this limit's.
struct MemoryLimit {
  uint64_t bytes = 0;
  std::string cgroup;  // e.g. "/sys/fs/cgroup/job.slice/step_0"; empty: the machine
};
MemoryLimit MemoryLimitOf();
MemoryLimit MemoryLimitOf(std::string_view proc_self_cgroup, const std::string& cgroup_root,
                          uint64_t physical_bytes);
// The budget of an arena made with budget_bytes = 0: 3/4 of MemoryLimitBytes().
uint64_t DefaultHostBudget();

// One-shot fault injection for tests: a non-zero errno makes the next map or pin fail with it.
struct HostArenaFaults {
  std::atomic<int> map_errno{0};
  std::atomic<int> pin_errno{0};
  // Called inside AddRegionObserver between its snapshot of the regions and their replay to the
  // new observer (a test makes another thread map or unmap a region there).
  std::function<void()> after_observer_snapshot;
};

struct HostArenaOptions {
  std::string name = "host";  // tier name in reports and metrics
  uint64_t budget_bytes = 0;  // hard cap on bytes held from the OS; 0 = DefaultHostBudget()
  uint64_t region_bytes = 32ull << 20;  // smaller requests share regions of this size
  // Empty regions kept for reuse (Note [Retained cache]): at most
  //   min(retain_limit_bytes, max(region_bytes, retain_fraction * live_bytes)).
  // Independently, the cache never raises the high-water mark: when a new region would lift
  // committed bytes above their previous peak, retained regions are released first.
  uint64_t retain_limit_bytes = 1ull << 30;
  double retain_fraction = 0.25;
  // How far the retained cache may lift the high-water mark, as a fraction of the peak of what is
  // needed (committed bytes less the cache, at their highest so far): at 0 a new region first
  // evicts retained regions until it fits under that peak; larger values trade peak memory for
  // fewer re-pins and re-faults (measured in docs/benchmarks.md).
  double peak_slack = 0.0;
  // Requests of at least region_bytes / dedicated_divisor get a region of their own exact size,
  // so large transients never carve holes into regions shared with long-lived extents. They reuse
  // a free extent only if it wastes at most 1/reuse_waste_divisor of it.
  uint64_t dedicated_divisor = 8;
  uint64_t reuse_waste_divisor = 8;
  PinMode pin = PinMode::kAuto;
  ForkSafety fork_safety = ForkSafety::kDontFork;
  EscapePolicy policy = EscapePolicy::kReport;
  bool capture_backtraces = false;  // record a backtrace per allocation (slow; for leak hunts)
  Ledger* ledger = nullptr;         // null = Ledger::Default()
  // The node's budget, shared with the job's other local ranks (Note [Node governor]): every
  // region is booked there before it is mapped and given back when it is unmapped. Null: the
  // process's NodeGovernor::Current() when it has joined one, else no node budget.
  std::shared_ptr<NodeGovernor> node;
  HostArenaFaults* faults = nullptr;  // test seam
};

// The retained cache's limit at `live_bytes` live: min(retain_limit_bytes, max(region_bytes,
// retain_fraction * live_bytes)). HostArena::RetainLimit() and the planner both use it.
uint64_t RetainLimitFor(const HostArenaOptions& options, uint64_t live_bytes);

struct HostArenaStats : LiveStats {
  PinMode pin_mode = PinMode::kPageable;  // resolved: never kAuto
  ForkSafety fork_safety = ForkSafety::kDontFork;
  EscapePolicy policy = EscapePolicy::kReport;
  uint64_t budget_bytes = 0;
  uint64_t retain_limit_bytes = 0;      // the absolute cap (see HostArenaOptions)
  uint64_t retain_limit_now_bytes = 0;  // the cap in force at this live size
  // Regions are mapped and pinned whole, so reserved == committed (Note [Regions]).
  uint64_t reserved_bytes = 0;
  uint64_t committed_bytes = 0;
  uint64_t pinned_bytes = 0;  // cuda_registered_bytes + mlocked_bytes
  uint64_t cuda_registered_bytes = 0;
  uint64_t mlocked_bytes = 0;
  uint64_t retained_bytes = 0;  // empty regions kept for reuse (<= retain limit)
  uint64_t fragment_bytes = 0;  // free bytes inside regions that hold live extents
  uint64_t regions = 0;
  uint64_t peak_committed_bytes = 0;
  // Monotonic counters (the owner-side ones are in LiveStats).
  uint64_t region_map_count = 0;
  uint64_t region_unmap_count = 0;
  uint64_t trim_count = 0;  // Trim() calls and automatic trims
  uint64_t trimmed_bytes = 0;
  uint64_t over_budget_count = 0;
  uint64_t node_refusals = 0;  // regions the node budget refused (after every rank trimmed)
  uint64_t spill_calls = 0;
  uint64_t spilled_bytes = 0;  // what spill handlers said they freed
};

// Thread-safe. One mutex guards the extent map and the tables; it is never held across a syscall,
// a CUDA call, or a call into the ledger or the spill handler.
//
// Invariants (Validate):
//   committed == live + retained + fragment        (all page multiples)
//   committed <= budget;  retained <= RetainLimit() after every Free/boundary/Trim returns
//   every live extent lies in one region; extents are disjoint and free neighbours are coalesced
//   sum(live_by_kind) == sum(live_by_lifetime) == live
class HostArena final : public Tier {
 public:
  // Told about every region the arena maps or is about to unmap, in the order they happen, without
  // the arena's mutex held (Note [Region observers] in docs/allocator.md): the I/O engine registers
  // regions as io_uring fixed buffers. OnRegionUnmapping runs before the region's memory goes away.
  // Calls are serialized: an observer must not map or free arena memory from inside one.
  class RegionObserver {
   public:
    virtual ~RegionObserver() = default;
    virtual void OnRegionMapped(void* base, uint64_t bytes) = 0;
    virtual void OnRegionUnmapping(void* base, uint64_t bytes) = 0;
  };

  // What a spill handler is asked for. Freed bytes help only where they make room for the request:
  // either `bytes_needed` more budget headroom (once freed extents empty a region), or one freed
  // extent of at least `request_bytes`. Small frees scattered through shared regions do neither.
  struct SpillRequest {
    uint64_t bytes_needed = 0;   // the budget headroom still missing
    uint64_t request_bytes = 0;  // the failed request, rounded up to pages
  };
  // Called without locks when a request would cross the budget; returns the bytes it freed
  // (by calling Free on this arena). Set by the offload layer to spill partitions to NVMe.
  using SpillHandler = std::function<uint64_t(const SpillRequest& request)>;

  // Resolves kAuto and checks the options; the arena maps nothing until the first Allocate.
  static Result<std::unique_ptr<HostArena>> Create(HostArenaOptions options);
  ~HostArena() override;
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Exact size at page granularity. On error nothing changed.
  Result<void*> Allocate(uint64_t bytes, const OwnerTag& tag);
  // Frees an allocation. A double free, a foreign or interior pointer, or a pointer whose scope was
  // released returns kInvalidArgument naming what it was; nothing changes.
  Status Free(void* ptr);
  // Gives every empty region back to the OS. Returns the bytes released.
  uint64_t Trim();
  // Starts the peaks over (peak_live_bytes, peak_requested_bytes, peak_committed_bytes) from the
  // current values, as torch's reset_peak_stats does: to measure the peak of one phase.
  void ResetPeakStats();

  // Installs `handler` for `owner` (replacing any other). ClearSpillHandler(owner) removes it only
  // if it is still `owner`'s, and returns after every call of it in flight has returned, so the
  // owner may then be destroyed.
  void SetSpillHandler(SpillHandler handler, const void* owner);
  void ClearSpillHandler(const void* owner);
  // Adds an observer and reports every existing region to it. RemoveRegionObserver waits for
  // callbacks in flight, after which the observer may be destroyed.
  void AddRegionObserver(RegionObserver* observer);
  void RemoveRegionObserver(RegionObserver* observer);
  void set_policy(EscapePolicy policy);

  // True when [ptr, ptr+bytes) lies inside one region of this arena (pinned memory for I/O).
  bool Contains(const void* ptr, uint64_t bytes) const;
  // The live allocation that starts at ptr: its size, or an error naming what ptr is.
  Result<uint64_t> AllocationSize(const void* ptr) const;
  struct RegionInfo {
    void* base;
    uint64_t bytes;
  };
  // The regions as they are now (for io_uring fixed-buffer registration).
  std::vector<RegionInfo> Regions() const;

  HostArenaStats Stats() const;
  // Walks every structure and checks the invariants above. O(n log n).
  Status Validate() const;

  const std::string& tier_name() const override { return options_.name; }
  Status CollectBoundary(BoundaryKind kind, int64_t epoch, int64_t step, TierReport* out) override;
  void ReleaseScope(ScopeId scope, TierReport* out) override;

  Ledger& ledger() const { return *ledger_; }
  uint64_t page_bytes() const { return page_; }
  PinMode pin_mode() const { return pin_mode_; }  // resolved: never kAuto

 private:
  struct Region {
    void* base;
    uint64_t bytes;
    PinMode pinned_with;
  };

  HostArena(HostArenaOptions options, PinMode resolved, Ledger* ledger,
            std::shared_ptr<NodeGovernor> node);
  class SpillCallGuard;
  struct AllocRequest;  // one Allocate call, checked (host_arena.cc)
  struct AllocRound;    // what one round of Allocate planned under mu_ (host_arena.cc)

  // Private methods assume mu_ is held unless they say otherwise.
  void FreeExtent(uint64_t addr, uint64_t bytes) {  // assumes mu_
    extents_.Free(addr, bytes);
    ++given_back_;
  }
  std::string DescribeLive() const;  // "param 1.2 GiB, grad ..." for budget errors
  // Detaches empty regions from the map until retained <= retain_limit, largest first.
  void DetachEmptyRegions(uint64_t retain_limit, std::vector<Region>* out);
  void NoteCommitted();  // also PublishToNode
  void PublishToNode();  // live bytes by kind into this rank's node slot (relaxed stores)
  // Copies the spill handler out for this allocation round and, when there is one and rounds are
  // left, counts its call in flight (the caller's SpillCallGuard gives it back). Also snapshots
  // given_back_ for the "memory came back meanwhile" check.
  bool TakeSpillHandlerLocked(int round, SpillHandler* handler, uint64_t* given_back);
  uint64_t RetainLimit() const;  // min(cap, max(region, fraction * live))
  // Allocate's steps under mu_ (Note [Lock discipline]):
  void* TakeFreeExtent(AllocRequest* req);  // a free extent placed for req; null: none fits
  // A region within the budget into r->map_bytes, or, short of headroom, the spill handler taken.
  void PlanRegion(const AllocRequest& req, int round, AllocRound* r);
  // The over-budget error of a round that gave up: what was needed and why nothing freed it.
  Status OverBudgetError(const AllocRequest& req, const AllocRound& r) const;

  // Without the lock: syscalls.
  Result<Region> MapRegion(uint64_t bytes);
  void ReleaseRegions(const std::vector<Region>& regions);
  // Allocate's steps without mu_ held (each takes it only for its bookkeeping):
  Status CheckRequest(uint64_t bytes, const OwnerTag& tag);  // over budget: counted, refused
  AllocRequest MakeRequest(uint64_t bytes, const OwnerTag& tag) const;  // rounded, extent bound
  // Books r->map_bytes on the node's budget; refused: maps nothing and takes the spill handler.
  Status BookOnNode(const AllocRequest& req, int round, AllocRound* r);
  // Maps the planned region and places req in it; null: the scope was released or another
  // thread took the room (go round again).
  Result<void*> MapAndTake(AllocRequest* req, uint64_t map_bytes);

  HostArenaOptions options_;
  const PinMode pin_mode_;
  Ledger* const ledger_;
  const std::shared_ptr<NodeGovernor> node_;  // null: no node budget
  const NodeTier node_tier_;                  // kPinned or kPageable, from pin_mode_
  std::atomic<int> cuda_device_{-1};          // kCuda: the device of the last registration
  const uint64_t page_;

  const ProcessTag process_;  // Note [Fork]: every entry point refuses in a forked child
  mutable std::mutex mu_;
  ExtentMap extents_;                   // guarded by mu_
  std::map<uint64_t, Region> regions_;  // guarded by mu_; by base address
  // Observers: their own mutex, held while calling them (Note [Region observers]); never mu_.
  std::mutex observers_mu_;
  std::vector<RegionObserver*> observers_;                        // guarded by observers_mu_
  void NotifyObservers(bool mapped, void* base, uint64_t bytes);  // without mu_
  std::unique_ptr<LiveTable> live_;   // guarded by mu_ (owner records, tombstones)
  uint64_t pending_map_bytes_ = 0;    // guarded by mu_: regions being mapped right now
  uint64_t need_peak_bytes_ = 0;      // guarded by mu_: peak of held minus retained
  uint64_t pending_unmap_bytes_ = 0;  // guarded by mu_: detached, not yet unmapped
  // Guarded by mu_: counts extents freed and regions unmapped, so an allocation whose spill
  // handler freed nothing itself sees that memory came back meanwhile (it tries again).
  uint64_t given_back_ = 0;
  SpillHandler spill_handler_;         // guarded by mu_ (copied out before calling)
  const void* spill_owner_ = nullptr;  // guarded by mu_
  int spill_calls_in_flight_ = 0;      // guarded by mu_
  ForkSafeCondition spill_idle_;       // spill_calls_in_flight_ reached 0
  HostArenaStats stats_;               // guarded by mu_
};

}  // namespace spillway::allocator
