// PartitionStore: ZeRO-3 partitions (16-bit params, grads, fp32 master weights, Adam moments) by
// (rank, sub-group, state kind), each with a home tier from the DeepSpeed config, served to callers
// through RAII handles. Under the host budget it spills to NVMe the resident partition needed
// furthest in the future under the registered access schedule (Belady's OPT, as Colossal-AI's
// Gemini does), never one in use. See docs/offload.md, Note [Spill].
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/base/status.h"
#include "spillway/offload/config.h"
#include "spillway/offload/opt_schedule.h"

namespace spillway::offload {

class TransferPipeline;  // transfer_pipeline.h
class DeviceViews;       // private: offload/src/device_views.h
class Prefetcher;        // private: offload/src/prefetcher.h

enum class StateKind : uint8_t { kParam = 0, kGrad, kMasterWeight, kExpAvg, kExpAvgSq };
const char* StateKindName(StateKind kind);

struct PartitionKey {
  uint32_t rank = 0;
  uint32_t group = 0;  // sub-group (sub_group_size elements) or parameter index
  StateKind kind = StateKind::kParam;
};

enum class Placement : uint8_t { kHost = 0, kNvme, kDevice };
const char* PlacementName(Placement placement);

class PartitionStore;

// A view of one partition in host memory, pinned in place while the handle lives. Move-only; the
// destructor releases it. Using a released handle is an error status, not a crash. A handle that
// outlives its store is a fatal error naming the partition in debug builds (NDEBUG unset) and
// does nothing in release builds (the store freed the memory when it was destroyed).
class Handle {
 public:
  Handle() = default;
  Handle(Handle&& other) noexcept { *this = std::move(other); }
  Handle& operator=(Handle&& other) noexcept;
  ~Handle();
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  // The partition's memory, for as long as the handle is held; null once released or moved from.
  // Unchecked: a handle that outlived its store still shows the freed address (Data() refuses).
  void* data() const { return data_; }
  // The same, checked: an error status naming the partition for a released handle, or for one
  // that outlived its store.
  Result<void*> Data() const;
  uint64_t bytes() const { return bytes_; }
  PartitionId id() const { return id_; }
  bool valid() const { return store_ != nullptr; }

 private:
  friend class PartitionStore;
  // Whether the store still exists: Handle never touches store_ once it is false.
  bool StoreAlive() const;
  void ReleaseFromDestructor();
  PartitionStore* store_ = nullptr;
  std::shared_ptr<const std::atomic<bool>> store_alive_;
  uint64_t handle_id_ = 0;
  PartitionId id_ = 0;
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
  bool write_ = false;
  bool device_ = false;
};

enum class Access : uint8_t { kRead, kReadWrite };

struct PartitionStoreStats {
  uint64_t partitions = 0;
  uint64_t resident_bytes = 0;  // host copies held now
  uint64_t nvme_bytes = 0;      // NVMe extents held now
  uint64_t swap_ins = 0;
  uint64_t swap_in_bytes = 0;
  uint64_t spills = 0;  // host copies written out (if dirty) and dropped under budget
  uint64_t spill_bytes = 0;
  uint64_t spill_writes = 0;  // of those, how many needed a write (dirty or never written)
  uint64_t flush_writes = 0;
  uint64_t live_handles = 0;
  uint64_t refused_releases = 0;   // double releases and released-handle uses
  uint64_t device_fills = 0;       // device views filled (from host or straight from NVMe)
  uint64_t device_writebacks = 0;  // dirty device views written back on their last release
  uint64_t prefetches = 0;         // swap-ins done ahead of use by the prefetch thread
  uint64_t prefetch_failures = 0;  // ahead-of-use swap-ins that failed (the Acquire retries)
  uint64_t memory_waits = 0;       // spills that waited for memory other threads were giving back
  uint64_t memory_wait_timeouts = 0;  // of those, how many gave up after memory_wait()
};

// Test seam: called without mu_ at the named points, with the partition concerned.
struct StoreHooks {
  std::function<void(uint32_t id)> before_spill_write;  // SpillOne, the partition is busy
  std::function<void(uint32_t id)> after_flush_write;   // Flush, written, before it is marked clean
};

// Thread-safe. mu_ guards the partition table; it is never held across an allocation (which may
// call back into the spill handler), I/O, or a copy. A partition in transition (being swapped in,
// spilled, flushed, or moved to or from the device) is marked busy by exactly one thread, which
// clears it; everyone else waits on busy_cv_ before taking it. Note [Memory held by others] in
// docs/offload.md: when the budget is full and every resident partition is in use or in
// transition by other threads, a spill waits (at most memory_wait()) for them to give it back.
//
// Invariants (Validate), for every partition p, under mu_:
//   handles(p) <= p.pins, equal unless a device handle's release is writing back
//   p.write_pins + p.device_pins <= p.pins            (write_pins counts host handles only)
//   p.busy == (p.busy_by != thread::id())
//   p.tombstone  =>  nothing held: no host copy, no extent, no device view, no pins
//   p.nvme_valid =>  p has an extent;   p.dirty => p has a host copy
//   and, when p is not busy (no thread is moving it):
//     host handles (pins - device_pins) > 0  =>  p has a host copy
//     p.device_pins > 0 => p has a device view;   p.device_dirty => p has a device view
//     a device view with no device pins is dirty: kept after its write-back failed, the only
//     good copy (a host Acquire is refused until a device Acquire + Release writes it back)
//     p has no host copy  =>  p has an extent (its bytes are on NVMe, or it was never written)
//   the schedule holds its own invariants (OptSchedule::Validate) and names registered partitions
//   stats_.live_handles == |live_handles_|;  stats_.partitions <= |registered, not tombstones|
class PartitionStore {
 public:
  // `nvme` may be null (no spill possible: the budget error then says how to allow it).
  // Registers itself as `host`'s spill handler; the store must outlive nothing it holds.
  // `prefetch_window`: after each Acquire, the next that many partitions of the schedule are
  // swapped in ahead of use by a background thread (0 = no prefetching).
  static Result<std::unique_ptr<PartitionStore>> Create(const Config& config,
                                                        allocator::HostArena* host,
                                                        allocator::NvmeArena* nvme,
                                                        allocator::ScopeId scope,
                                                        uint32_t prefetch_window = 0);
  ~PartitionStore();
  PartitionStore(const PartitionStore&) = delete;
  PartitionStore& operator=(const PartitionStore&) = delete;

  // Places a partition in its home tier (from offload_param / offload_optimizer.device) and
  // zero-fills it. Host-homed partitions are host-arena memory; nvme-homed ones get an extent and
  // are brought in on Acquire.
  Result<PartitionId> Register(PartitionKey key, uint64_t bytes);
  // The order partitions are used in one step; it repeats every step. OPT picks victims by it.
  Status SetSchedule(std::vector<PartitionId> order);

  // A view of the partition in host memory (kHost) or device memory (kDevice, through the transfer
  // pipeline given to AttachDevice: from the host copy when resident, else straight from NVMe).
  // A partition is used in one tier at a time: acquiring it on the other tier while handles are
  // live is FAILED_PRECONDITION. A dirty device view is written back on its last release (into the
  // host copy if resident, else to NVMe), and its device memory freed.
  Result<Handle> Acquire(PartitionId id, Access access = Access::kReadWrite,
                         Placement where = Placement::kHost);
  // Enables the device tier. The pipeline (and its device) must outlive the store; the store
  // serialises its own use of it (a pipeline is driven by one thread at a time). Attaching the same
  // pipeline again is a no-op; a different one, once one is attached, is FAILED_PRECONDITION (live
  // views and fills in flight copy through the first); null is INVALID_ARGUMENT.
  Status AttachDevice(TransferPipeline* pipeline);
  // How long a spill under the budget waits for memory that other threads' handles, spills or
  // swap-ins hold before the allocation fails (default 10 s). Memory this thread's own handles
  // hold is never waited for: that fails at once, saying so.
  void set_memory_wait(std::chrono::milliseconds wait);
  std::chrono::milliseconds memory_wait() const;
  void SetHooksForTesting(StoreHooks* hooks);
  // A warning logged once, at the first spill (Tiers names the spill arena's directory with it).
  void SetSpillNotice(std::string notice);
  Status Release(Handle& handle);
  // Brings partitions into host memory now (no handle kept).
  Status Prefetch(const std::vector<PartitionId>& ids);
  // Blocks until the prefetch thread has nothing queued (for tests and step boundaries).
  void DrainPrefetch();
  // Held by accesses outside the step's order (a checkpoint's save or load): while one lives, an
  // Acquire neither moves the schedule's cursor nor prefetches, so the partitions the schedule
  // says come next are not swapped in (and left resident) on account of the save. The constructor
  // drops the queued prefetches and waits for the one in flight. Movable only by scope;
  // thread-safe.
  class OffSchedule {
   public:
    explicit OffSchedule(PartitionStore& store);
    ~OffSchedule();
    OffSchedule(const OffSchedule&) = delete;
    OffSchedule& operator=(const OffSchedule&) = delete;

   private:
    PartitionStore& store_;
  };
  // Writes every dirty host copy that has an NVMe home or extent; host copies stay resident.
  Status Flush();
  // Writes (if needed) and drops the host copy of one partition not in use.
  Status Evict(PartitionId id);

  bool resident(PartitionId id) const;
  // Registered size in bytes; 0 for an id that is not registered.
  uint64_t bytes(PartitionId id) const;
  Placement home(PartitionId id) const;
  PartitionStoreStats Stats() const;
  // Walks the partition table and checks the invariants above. O(partitions + schedule + handles).
  // With SPILLWAY_DEBUG_CHECKS it runs after every public mutating call.
  Status Validate() const;

 private:
  friend class Handle;
  struct Part {
    PartitionKey key;
    uint64_t bytes = 0;
    Placement home = Placement::kHost;
    void* host = nullptr;           // host copy, or null
    uint64_t nvme_off = kNoExtent;  // NVMe extent, or kNoExtent
    bool nvme_valid = false;        // the NVMe copy holds the latest data
    bool dirty = false;             // the host copy is newer than the NVMe copy
    uint32_t pins = 0;              // live handles
    bool busy = false;              // being swapped in, spilled, or moved to or from the device
    std::thread::id busy_by;        // the one thread that set busy (and clears it)
    uint32_t write_pins = 0;        // of `pins`, host handles with write access: Flush skips it
    bool tombstone = false;         // its Register failed: the id stays, the key is free again
    void* device = nullptr;         // device view while device handles are live
    uint32_t device_pins = 0;       // of `pins`, how many are device handles
    bool device_dirty = false;
    uint64_t last_use = 0;  // use_clock_ at its last Acquire or prefetch (Eviction::kLru)
  };
  static constexpr uint64_t kNoExtent = std::numeric_limits<uint64_t>::max();
  // Its bytes are somewhere: a host copy or an extent. False for a tombstone and for a partition
  // whose Register is still placing it; true from then on (a spill makes the extent first).
  static bool Placed(const Part& p) { return p.host != nullptr || p.nvme_off != kNoExtent; }

  PartitionStore(const Config& config, allocator::HostArena* host, allocator::NvmeArena* nvme,
                 allocator::ScopeId scope, uint32_t prefetch_window);
  // On the prefetcher's thread, without mu_: swaps `id` in unless it is there, busy, or has a
  // live device view (a host copy would be stale); counts the outcome.
  void PrefetchOne(PartitionId id);
  // mu_ held: queues the next prefetch_window_ partitions of the schedule after the cursor.
  void QueuePrefetchLocked();
  allocator::OwnerTag Tag(PartitionId id) const;
  std::string Describe(PartitionId id) const;  // "master_weight rank 0 group 3 (4.00 MiB)"
  Placement HomeFor(StateKind kind) const;
  // Spill handler: frees at least `need` host bytes by spilling OPT victims; returns bytes freed.
  // Waits (bounded) for memory other threads will give back; see memory_wait().
  uint64_t Spill(const allocator::HostArena::SpillRequest& request);
  struct HandleInfo {
    PartitionId id;
    std::thread::id thread;  // the thread that acquired it
  };
  // mu_ held. Waits until `id` is not busy, then marks it busy for this thread.
  void TakeBusyLocked(std::unique_lock<std::mutex>& lock, PartitionId id);
  // mu_ held (or the part not yet visible). Marks `p` busy for this thread; `p` must not be busy.
  static void MarkBusy(Part& p);
  // mu_ held. Clears busy (only its owner may) and wakes waiters.
  void ClearBusyLocked(PartitionId id);
  // mu_ held (`lock`, waited on while `id` is busy): Acquire's checks, then pins `id` for the
  // handle and records it. Returns the handle's id; *io: the caller must swap `id` in (host) or
  // fill its device view, without mu_ (`id` is then busy for it).
  Result<uint64_t> PinLocked(std::unique_lock<std::mutex>& lock, PartitionId id, Access access,
                             Placement where, bool* io);
  // mu_ held. Undoes PinLocked's pin and handle when the swap-in or the fill failed.
  void UnpinLocked(PartitionId id, bool device, bool host_write, uint64_t handle_id);
  // mu_ held: bytes of resident partitions that other threads hold (busy or pinned) and no handle
  // of this thread pins; and the bytes this thread's own handles pin.
  void HeldBytesLocked(uint64_t* by_others, uint64_t* by_me) const;
  // Why this thread's last Spill call freed less than asked, for the budget error's context.
  std::string SpillShortfallNote() const;
  // Without mu_: makes the host copy of `id` exist (allocate + read or zero-fill). `id` is busy.
  Status SwapIn(PartitionId id);
  // Without mu_: writes `id` out if needed and drops its host copy. `id` is busy.
  Status SpillOne(PartitionId id, uint64_t* freed);
  // Returns the write-back status when this was the last device handle of a dirty view.
  Status ReleaseHandle(uint64_t handle_id, PartitionId id, bool write, bool device, bool* ok);
  Status FillDevice(PartitionId id);       // without mu_; `id` is busy
  Status WriteBackDevice(PartitionId id);  // without mu_; `id` is busy

  const Config config_;
  allocator::HostArena* const host_;
  allocator::NvmeArena* const nvme_;
  std::string spill_notice_;  // guarded by mu_; cleared once logged
  const allocator::ScopeId scope_;

  const allocator::ProcessTag process_;  // a forked child's destructor leaks (Note [Fork])
  mutable std::mutex mu_;
  allocator::ForkSafeCondition busy_cv_;
  std::vector<Part> parts_;    // guarded by mu_; index = PartitionId
  OptSchedule schedule_;       // guarded by mu_: SetSchedule's order and cursor
  uint64_t use_clock_ = 0;     // guarded by mu_: Acquires so far
  uint32_t off_schedule_ = 0;  // guarded by mu_: live OffSchedule scopes
  std::unordered_map<uint64_t, HandleInfo> live_handles_;  // guarded by mu_
  uint64_t next_handle_id_ = 1;                            // guarded by mu_
  PartitionStoreStats stats_;                              // guarded by mu_
  std::unique_ptr<DeviceViews> views_;  // guarded by mu_; made once by AttachDevice, then const
  const uint32_t prefetch_window_;
  std::vector<PartitionId> prefetch_next_;  // guarded by mu_: the window handed to prefetcher_
  bool stopping_ = false;                   // guarded by mu_: the destructor has begun
  std::unique_ptr<Prefetcher> prefetcher_;  // null without a window; made by Create, then const
  std::thread::id prefetcher_id_;           // its thread; set by Create before Spill can run
  std::chrono::milliseconds memory_wait_{10'000};  // guarded by mu_
  StoreHooks* hooks_ = nullptr;                    // test seam; set before use
  const std::shared_ptr<std::atomic<bool>> alive_ = std::make_shared<std::atomic<bool>>(true);
};

}  // namespace spillway::offload
