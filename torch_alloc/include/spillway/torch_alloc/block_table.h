// BlockTable: allocations handed out (torch's pinned blocks, arena tensors) whose memory goes back
// to its arena only once every stream that used it is done. Generic over its events, as torch's
// CachingHostAllocatorImpl is: torch's own (blocks.h) in the process, fake ones in the tests, and
// no torch here, so the ThreadSanitizer build runs the table itself. Note [Deferred free] in
// docs/deepspeed.md.
//
// Traits, the event policy (an instance is owned by the table):
//   using Stream;                      copyable, ==
//   using Event;                       movable
//   using PoolId;                      copyable, ==; hashed by Traits::PoolIdHash
//   Event Record(const Stream&);       records an event on the stream; may throw std::exception
//   bool Query(Event&);                true once the work before the event completed; may throw
//   static std::string Describe(const std::exception&);   for the message of a failed Record
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "spillway/allocator/process.h"
#include "spillway/torch_alloc/shared_arena.h"

namespace spillway::torch_alloc {

// As in torch's CachingHostAllocator, record_event only notes the stream; one event per stream is
// recorded when the storage dies, so a buffer copied every step does not collect events.
template <typename Traits>
struct Block {
  void* ptr = nullptr;
  uint64_t bytes = 0;
  std::shared_ptr<SharedArena> arena;            // keeps the arena (and its ledger) alive
  bool pinned_allocator = false;                 // made by the pinned allocator (its stats)
  std::vector<typename Traits::Stream> streams;  // streams that used it, no duplicates
  std::vector<typename Traits::Event> events;    // recorded at release, pending
  bool pooled = false;                           // made while a graph pool was allocated to
  typename Traits::PoolId pool{};
  bool used_in_pool = false;  // recorded on while pooled: a graph may use it
};

struct BlockStats {
  uint64_t live_blocks = 0, live_bytes = 0;              // handed out, storage alive
  uint64_t deferred_blocks = 0, deferred_bytes = 0;      // storage dead, events pending
  uint64_t graph_held_blocks = 0, graph_held_bytes = 0;  // used in a graph pool: never reused
  uint64_t peak_live_bytes = 0;
  uint64_t allocations_total = 0, allocated_bytes_total = 0, freed_bytes_total = 0;
  uint64_t events_recorded_total = 0, deferred_frees_total = 0;
  uint64_t event_errors_total = 0;           // an event could not be recorded: block held
  uint64_t foreign_record_events_total = 0;  // Record calls for memory not ours
};

// Thread-safe. mu_ guards the tables; no event record or query, no device call and no arena call
// (which may unmap) runs under it.
template <typename Traits>
class BlockTable {
 public:
  using B = Block<Traits>;
  using Stream = typename Traits::Stream;
  using PoolId = typename Traits::PoolId;
  using PoolFilter = std::function<bool(const Stream&)>;

  BlockTable() = default;
  explicit BlockTable(Traits traits) : traits_(std::move(traits)) {}
  // The process's table is never destroyed; a table of the tests' own is, with the blocks it holds
  // for good and those it parked (their memory goes when their arena does). Live blocks belong to
  // their storages.
  ~BlockTable() {
    for (std::vector<B*>* held : {&held_, &graph_held_, &deferred_}) {
      for (B* b : *held) delete b;
    }
  }
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;

  // The process's table. A forked child makes its own on first use (the parent's mutex may have
  // been held by a thread the child does not have, and the parent's blocks are not mapped there).
  // Never destroyed: frees may come during interpreter exit, and a child holds its parent's copy.
  static BlockTable& ForThisProcess() {
    BlockTable* t = current_.load(std::memory_order_acquire);
    if (t != nullptr && t->process_.InOwner()) [[likely]]
      return *t;
    return MakeForThisProcess();
  }

  // A block over `ptr` (from `arena`). `stream`: the allocating thread's current stream, for the
  // pools' filters; null when no pool is active (the caller asks PoolsActive() first).
  B* Make(void* ptr, uint64_t bytes, std::shared_ptr<SharedArena> arena, bool pinned_allocator,
          const Stream* stream) {
    auto* b = new B{ptr, bytes, std::move(arena), pinned_allocator};
    std::lock_guard<std::mutex> lock(mu_);
    if (pinned_allocator && stream != nullptr) {
      for (auto it = active_pools_.rbegin(); it != active_pools_.rend(); ++it) {
        if (it->second(*stream)) {
          b->pooled = true;
          b->pool = it->first;
          break;
        }
      }
    }
    live_.insert(b);
    ForEach(b, [&](BlockStats& s) {
      s.live_blocks++;
      s.live_bytes += bytes;
      s.peak_live_bytes = std::max(s.peak_live_bytes, s.live_bytes);
      s.allocations_total++;
      s.allocated_bytes_total += bytes;
    });
    return b;
  }

  // The storage died (a deleter: never throws). Frees now when no stream used the block, else
  // records one event per stream and parks it. A block whose arena an ancestor process made (a
  // storage a forked child inherited) is left alone: its memory is not mapped here.
  void Release(B* b);

  // Notes that `stream` uses the block. False when ctx is not a live block of this table.
  bool Record(void* ctx, const Stream& stream) {
    auto* b = static_cast<B*>(ctx);
    std::lock_guard<std::mutex> lock(mu_);
    if (ctx == nullptr || live_.count(b) == 0) {
      stats_.foreign_record_events_total++;
      pinned_stats_.foreign_record_events_total++;
      return false;
    }
    if (b->pooled) b->used_in_pool = true;
    if (std::find(b->streams.begin(), b->streams.end(), stream) == b->streams.end()) {
      b->streams.push_back(stream);
    }
    return true;
  }

  // Frees parked blocks whose events have all completed; returns how many. Does nothing while a
  // graph pool is being allocated to (querying an event during a capture breaks the capture). A
  // query that throws puts every block back and rethrows.
  size_t Poll();

  // Graph pools (torch's contract: begin/end bracket a capture; release when a graph using the
  // pool is reset; a pool may be shared by several graphs, so uses are counted). A block made
  // inside the bracket on a stream the filter accepts belongs to the pool: if it was used (Record)
  // it is never reused, like torch's; if not, it is freed once the pool is released.
  // Whether some pool is being allocated to (a hint read without the lock; Make decides under it).
  bool PoolsActive() const { return active_pool_count_.load(std::memory_order_acquire) > 0; }
  void BeginPool(PoolId id, PoolFilter filter) {
    std::lock_guard<std::mutex> lock(mu_);
    active_pools_.emplace_back(id, std::move(filter));
    active_pool_count_.store(static_cast<int>(active_pools_.size()), std::memory_order_release);
    pool_uses_[id]++;
    released_pools_.erase(id);
  }
  void EndPool(PoolId id) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = active_pools_.rbegin(); it != active_pools_.rend(); ++it) {
      if (it->first == id) {
        active_pools_.erase(std::next(it).base());
        active_pool_count_.store(static_cast<int>(active_pools_.size()), std::memory_order_release);
        return;
      }
    }
  }
  void ReleasePool(PoolId id) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pool_uses_.find(id);
      if (it != pool_uses_.end() && --it->second > 0) return;  // another graph still uses it
      if (it != pool_uses_.end()) pool_uses_.erase(it);
      released_pools_.insert(id);
    }
    Poll();
  }

  // Every block's stats, or the pinned allocator's blocks' alone.
  BlockStats Stats(bool pinned_only) const {
    std::lock_guard<std::mutex> lock(mu_);
    return pinned_only ? pinned_stats_ : stats_;
  }
  void ResetAccumulated() {
    std::lock_guard<std::mutex> lock(mu_);
    for (BlockStats* s : {&stats_, &pinned_stats_}) {
      s->allocations_total = s->allocated_bytes_total = s->freed_bytes_total = 0;
    }
  }
  void ResetPeak() {
    std::lock_guard<std::mutex> lock(mu_);
    for (BlockStats* s : {&stats_, &pinned_stats_}) s->peak_live_bytes = s->live_bytes;
  }
  Traits& traits() { return traits_; }

 private:
  static BlockTable& MakeForThisProcess() {
    auto made = std::make_unique<BlockTable>();
    for (;;) {
      BlockTable* seen = current_.load(std::memory_order_acquire);
      if (seen != nullptr && seen->process_.InOwner()) return *seen;  // another thread made it
      // An ancestor's table (in `seen`) is left as it is.
      if (current_.compare_exchange_weak(seen, made.get(), std::memory_order_acq_rel)) {
        return *made.release();
      }
    }
  }
  // Applies f to the stats every block counts in, and to the pinned allocator's own.
  template <typename F>
  void ForEach(const B* b, F f) {  // assumes mu_
    f(stats_);
    if (b->pinned_allocator) f(pinned_stats_);
  }
  void Park(B* b) {  // assumes mu_
    deferred_.push_back(b);
    ForEach(b, [&](BlockStats& s) {
      s.deferred_blocks++;
      s.deferred_bytes += b->bytes;
      s.deferred_frees_total++;
    });
  }
  bool PoolReleased(const PoolId& id) const { return released_pools_.count(id) > 0; }  // mu_
  // Records one event per stream that used the block; false (and the block held) when one fails.
  bool RecordEvents(B* b, const std::vector<Stream>& streams);  // without mu_
  void Free(B* b);                                              // without mu_

  static inline std::atomic<BlockTable*> current_{nullptr};
  const allocator::ProcessTag process_;
  Traits traits_{};
  mutable std::mutex mu_;
  std::unordered_set<B*> live_;  // guarded by mu_
  std::vector<B*> deferred_;     // guarded by mu_
  std::vector<B*> held_;         // mu_: never freed (event errors)
  std::vector<B*> graph_held_;   // guarded by mu_: used in a graph pool, never freed
  std::vector<std::pair<PoolId, PoolFilter>> active_pools_;                 // guarded by mu_
  std::atomic<int> active_pool_count_{0};                                   // written under mu_
  std::unordered_map<PoolId, int, typename Traits::PoolIdHash> pool_uses_;  // guarded by mu_
  std::unordered_set<PoolId, typename Traits::PoolIdHash> released_pools_;  // guarded by mu_
  BlockStats stats_;         // guarded by mu_: every block
  BlockStats pinned_stats_;  // guarded by mu_: the pinned allocator's blocks
};

template <typename Traits>
void BlockTable<Traits>::Release(B* b) {
  if (!b->arena->made_in_this_process()) return;  // an ancestor's: not mapped here
  std::vector<Stream> streams;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(b);
    ForEach(b, [&](BlockStats& s) {
      s.live_blocks--;
      s.live_bytes -= b->bytes;
    });
    if (b->pooled && b->used_in_pool) {
      // A graph may replay work on it at any later time: like torch, never reuse it.
      ForEach(b, [&](BlockStats& s) {
        s.graph_held_blocks++;
        s.graph_held_bytes += b->bytes;
      });
      graph_held_.push_back(b);
      return;
    }
    if (b->pooled && !PoolReleased(b->pool)) {
      Park(b);
      return;
    }
    streams.swap(b->streams);
  }
  if (streams.empty()) {
    Free(b);
    return;
  }
  if (!RecordEvents(b, streams)) return;
  std::lock_guard<std::mutex> lock(mu_);
  ForEach(b, [&](BlockStats& s) { s.events_recorded_total += streams.size(); });
  Park(b);
}

template <typename Traits>
bool BlockTable<Traits>::RecordEvents(B* b, const std::vector<Stream>& streams) {
  std::vector<typename Traits::Event> events;
  bool failed = false;
  for (const Stream& s : streams) {
    try {
      events.push_back(traits_.Record(s));
    } catch (const std::exception& e) {
      // Without an event nobody can tell when the copy ends: hold the block for good, and say so.
      std::fprintf(stderr,
                   "spillway: recording an event for a freed pinned block failed; the block "
                   "(%llu bytes) is held until exit: %s\n",
                   static_cast<unsigned long long>(b->bytes), Traits::Describe(e).c_str());
      failed = true;
    }
  }
  if (failed) {
    std::lock_guard<std::mutex> lock(mu_);
    ForEach(b, [&](BlockStats& s) { s.event_errors_total++; });
    held_.push_back(b);
    return false;
  }
  b->events = std::move(events);  // the block is in no table: nobody else reads it
  return true;
}

template <typename Traits>
size_t BlockTable<Traits>::Poll() {
  std::vector<B*> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (deferred_.empty() || !active_pools_.empty()) return 0;
    pending.swap(deferred_);
  }
  std::vector<B*> keep, ready;
  std::vector<typename Traits::Event> finished;  // destroyed (event destroy) without the lock
  try {
    for (B* b : pending) {
      if (b->pooled && b->events.empty()) {  // waits for its pool's release, not for events
        keep.push_back(b);
        continue;
      }
      auto& ev = b->events;
      for (auto it = ev.begin(); it != ev.end();) {
        if (traits_.Query(*it)) {
          finished.push_back(std::move(*it));
          it = ev.erase(it);
        } else {
          ++it;
        }
      }
      (ev.empty() ? ready : keep).push_back(b);
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    deferred_.insert(deferred_.end(), pending.begin(), pending.end());
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = keep.begin(); it != keep.end();) {
      if ((*it)->pooled && (*it)->events.empty() && PoolReleased((*it)->pool)) {
        ready.push_back(*it);
        it = keep.erase(it);
      } else {
        ++it;
      }
    }
    for (B* b : ready) {
      ForEach(b, [&](BlockStats& s) {
        s.deferred_blocks--;
        s.deferred_bytes -= b->bytes;
      });
    }
    deferred_.insert(deferred_.end(), keep.begin(), keep.end());
  }
  for (B* b : ready) Free(b);
  return ready.size();
}

template <typename Traits>
void BlockTable<Traits>::Free(B* b) {
  const Status st = b->arena->get()->Free(b->ptr);
  if (!st.ok()) std::fprintf(stderr, "spillway: freeing a host block: %s\n", st.ToString().c_str());
  {
    std::lock_guard<std::mutex> lock(mu_);
    ForEach(b, [&](BlockStats& s) { s.freed_bytes_total += b->bytes; });
  }
  delete b;
}

}  // namespace spillway::torch_alloc
