// Blocks whose free waits for events: allocations handed to torch (the pinned allocator's blocks,
// HostArena.empty() tensors) that go back to their arena once every stream that used them is done.
// Note [Deferred free] in docs/deepspeed.md.
#pragma once

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/Event.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "py_arena.h"
#include "spillway/allocator/owner.h"
#include "spillway/allocator/process.h"
#include "spillway/base/status.h"

namespace spillway::python::torch_alloc {

// True in a child forked after spillway.install() (defined with it, in torch_allocators.cc): the
// arenas' regions are not mapped there, so nothing may be allocated from or freed into them.
bool Forked();

// An allocation handed to torch with a context that torch passes back to record_event: blocks of
// the pinned allocator and tensors from HostArena.empty(). The memory goes back to its arena when
// the storage dies and the work queued on every stream that used it has completed
// (Note [Deferred free]). As in torch's CachingHostAllocator, record_event only notes the stream;
// one event per stream is recorded when the storage dies, so a buffer copied every step does not
// collect events.
struct Block {
  void* ptr = nullptr;
  uint64_t bytes = 0;
  std::shared_ptr<PyArena> arena;             // keeps the arena (and its ledger) alive
  bool pinned_allocator = false;              // made by the pinned allocator (host_memory_stats)
  std::vector<c10::Stream> streams;           // streams that used it (record_event), no duplicates
  std::vector<std::function<bool()>> events;  // recorded at release; true once that work completed
  bool pooled = false;                        // made while a CUDA-graph pool was being allocated to
  c10::MempoolId_t pool{0, 0};
  bool used_in_pool = false;  // record_event while pooled: a graph may use it
};

// How an event is recorded and queried: c10::Event on the stream's own device (CUDA's through
// torch's device guard), or, for tests on machines without a GPU, events a test completes by hand.
class Events {
 public:
  std::function<bool()> Record(c10::Stream stream) {
    if (manual_.load(std::memory_order_acquire)) {
      const uint64_t mine = ++manual_recorded_;
      return [this, mine] { return manual_completed_.load(std::memory_order_acquire) >= mine; };
    }
    auto event = std::make_shared<c10::Event>(stream.device_type());
    event->record(stream);
    return [event] { return event->query(); };
  }
  void SetManual(bool on) { manual_.store(on, std::memory_order_release); }
  void CompleteManual() { manual_completed_.store(manual_recorded_.load()); }

 private:
  std::atomic<bool> manual_{false};
  std::atomic<uint64_t> manual_recorded_{0};
  std::atomic<uint64_t> manual_completed_{0};
};

struct BlockStats {
  uint64_t live_blocks = 0, live_bytes = 0;              // handed out, storage alive
  uint64_t deferred_blocks = 0, deferred_bytes = 0;      // storage dead, events pending
  uint64_t graph_held_blocks = 0, graph_held_bytes = 0;  // used in a graph pool: never reused
  uint64_t peak_live_bytes = 0;
  uint64_t allocations_total = 0, allocated_bytes_total = 0, freed_bytes_total = 0;
  uint64_t events_recorded_total = 0, deferred_frees_total = 0;
  uint64_t event_errors_total = 0;           // an event could not be recorded: block held
  uint64_t foreign_record_events_total = 0;  // record_event calls for memory not ours
};

// Thread-safe. mu_ guards the tables; no event record or query, no CUDA call and no arena call
// (which may unmap) runs under it.
class Blocks {
 public:
  // One table per process: a forked child makes its own on first use (the parent's mutex may
  // have been held by a thread the child does not have, and the parent's blocks are not mapped
  // there). Never destroyed: frees may come during interpreter exit, and a child holds a copy of
  // its parent's.
  static Blocks& Get() {
    Blocks* b = current_.load(std::memory_order_acquire);
    if (C10_LIKELY(b != nullptr && b->process_.InOwner())) return *b;
    return MakeForThisProcess();
  }

  // `stream`: the current stream of the allocating thread, for the pools' filters (CUDA only).
  Block* Make(void* ptr, uint64_t bytes, std::shared_ptr<PyArena> arena, bool pinned_allocator,
              const c10::Stream* stream);

  // The storage died (a deleter: never throws). Frees now when no stream used the block, else
  // records one event per stream and parks it. A block whose arena an ancestor process made (a
  // storage a forked child inherited) is left alone: its memory is not mapped here.
  void Release(Block* b);

  // Notes that `stream` uses the block. False when ctx is not a live block of ours.
  bool Record(void* ctx, c10::Stream stream);

  // Frees parked blocks whose events have all completed; returns how many. Does nothing while a
  // graph pool is being allocated to (querying an event during a capture breaks the capture). A
  // query that throws puts every block back and rethrows.
  size_t Poll();

  // CUDA-graph pools (torch's contract: begin/end bracket a capture; release_pool when a graph
  // using the pool is reset; pools may be shared by several graphs, so uses are counted). A block
  // made inside the bracket on a stream the filter accepts belongs to the pool: if it was used
  // (record_event) it is never reused, like torch's; if not, it is freed once the pool is released.
  // Whether some pool is being allocated to (a hint read without the lock; Make decides under it).
  bool PoolsActive() const { return active_pool_count_.load(std::memory_order_acquire) > 0; }

  void BeginPool(c10::MempoolId_t id, std::function<bool(c10::Stream)> filter);
  void EndPool(c10::MempoolId_t id);
  void ReleasePool(c10::MempoolId_t id);

  BlockStats Stats(bool pinned_only) const {
    std::lock_guard<std::mutex> lock(mu_);
    return pinned_only ? pinned_stats_ : stats_;
  }
  void ResetAccumulated();
  void ResetPeak() {
    std::lock_guard<std::mutex> lock(mu_);
    for (BlockStats* s : {&stats_, &pinned_stats_}) s->peak_live_bytes = s->live_bytes;
  }
  Events& events() { return events_; }

 private:
  struct PoolIdHash {
    size_t operator()(const c10::MempoolId_t& id) const {
      return std::hash<uint64_t>()(id.first) * 31 + std::hash<uint64_t>()(id.second);
    }
  };

  Blocks() = default;
  static Blocks& MakeForThisProcess();
  static inline std::atomic<Blocks*> current_{nullptr};
  const allocator::ProcessTag process_;
  // Applies f to the stats every block counts in, and to the pinned allocator's own.
  template <typename F>
  void ForEach(const Block* b, F f) {  // assumes mu_
    f(stats_);
    if (b->pinned_allocator) f(pinned_stats_);
  }
  void Park(Block* b);  // assumes mu_
  bool PoolReleased(c10::MempoolId_t id) const { return released_pools_.count(id) > 0; }  // mu_
  void Free(Block* b);  // without mu_

  mutable std::mutex mu_;
  std::unordered_set<Block*> live_;  // guarded by mu_
  std::vector<Block*> deferred_;     // guarded by mu_
  std::vector<Block*> held_;         // guarded by mu_: never freed (event errors)
  std::vector<std::pair<c10::MempoolId_t, std::function<bool(c10::Stream)>>> active_pools_;  // mu_
  std::atomic<int> active_pool_count_{0};  // active_pools_.size(), written under mu_
  std::unordered_map<c10::MempoolId_t, int, PoolIdHash> pool_uses_;  // guarded by mu_
  std::unordered_set<c10::MempoolId_t, PoolIdHash> released_pools_;  // guarded by mu_
  BlockStats stats_;                                                 // guarded by mu_: every block
  BlockStats pinned_stats_;  // guarded by mu_: the pinned allocator's blocks
  Events events_;
};

// The deleter torch calls with a Block as the context (null for empty allocations).
void ReleaseBlock(void* ctx);

// An allocation of `bytes` from `arena` under `tag`, for torch. Throws c10::OutOfMemoryError
// (torch.OutOfMemoryError in Python) over budget, with a message that starts
// "spillway.OverBudget:" so the Python edge can re-raise it as spillway.OverBudget.
// In a forked child it refuses by name: the pinned allocator has no child path (the CPU router
// has one, CpuRouter::AllocateInChild).
void* ArenaAllocate(PyArena& arena, uint64_t bytes, const allocator::OwnerTag& tag,
                    const char* what);
// `arena->Allocate`'s result for torch: the pointer, or the throw ArenaAllocate describes.
void* AllocatedOrThrow(const Result<void*>& r, const char* what);

}  // namespace spillway::python::torch_alloc
