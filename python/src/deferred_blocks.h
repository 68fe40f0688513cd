// Blocks whose free waits for events: allocations handed to torch (the pinned allocator's blocks,
// HostArena.empty() tensors) that go back to their arena once every stream that used them is done.
// Note [Deferred free] in docs/deepspeed.md.
#pragma once

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/Event.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "py_arena.h"
#include "spillway/allocator/owner.h"
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
  static Blocks& Get() {
    static auto* blocks = new Blocks();  // never destroyed: frees may come during interpreter exit
    return *blocks;
  }

  // `stream`: the current stream of the allocating thread, for the pools' filters (CUDA only).
  Block* Make(void* ptr, uint64_t bytes, std::shared_ptr<PyArena> arena, bool pinned_allocator,
              const c10::Stream* stream) {
    auto* b = new Block{ptr, bytes, std::move(arena), pinned_allocator};
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
  // records one event per stream and parks it.
  void Release(Block* b) {
    if (Forked()) return;  // the child has no mapping to free
    std::vector<c10::Stream> streams;
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
    std::vector<std::function<bool()>> events;
    bool failed = false;
    for (const c10::Stream& s : streams) {
      try {
        events.push_back(events_.Record(s));
      } catch (const c10::Error& e) {
        // Without an event nobody can tell when the copy ends: hold the block for good, and say so.
        std::fprintf(stderr,
                     "spillway: recording an event for a freed pinned block failed; the block "
                     "(%llu bytes) is held until exit: %s\n",
                     static_cast<unsigned long long>(b->bytes), e.what_without_backtrace());
        failed = true;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (failed) {
      ForEach(b, [&](BlockStats& s) { s.event_errors_total++; });
      held_.push_back(b);
      return;
    }
    b->events = std::move(events);
    ForEach(b, [&](BlockStats& s) { s.events_recorded_total += streams.size(); });
    Park(b);
  }

  // Notes that `stream` uses the block. False when ctx is not a live block of ours.
  bool Record(void* ctx, c10::Stream stream) {
    if (Forked()) return false;
    auto* b = static_cast<Block*>(ctx);
    std::lock_guard<std::mutex> lock(mu_);
    if (ctx == nullptr || live_.count(b) == 0) {
      stats_.foreign_record_events_total++;
      pinned_stats_.foreign_record_events_total++;
      return false;
    }
    if (b->pooled) b->used_in_pool = true;
    for (const c10::Stream& s : b->streams) {
      if (s == stream) return true;
    }
    b->streams.push_back(stream);
    return true;
  }

  // Frees parked blocks whose events have all completed; returns how many. Does nothing while a
  // graph pool is being allocated to (querying an event during a capture breaks the capture). A
  // query that throws puts every block back and rethrows.
  size_t Poll() {
    if (Forked()) return 0;
    std::vector<Block*> pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (deferred_.empty() || !active_pools_.empty()) return 0;
      pending.swap(deferred_);
    }
    std::vector<Block*> keep, ready;
    std::vector<std::function<bool()>> finished;  // destroyed (event destroy) without the lock
    try {
      for (Block* b : pending) {
        if (b->pooled && b->events.empty()) {  // waits for its pool's release, not for events
          keep.push_back(b);
          continue;
        }
        auto& ev = b->events;
        for (auto it = ev.begin(); it != ev.end();) {
          if ((*it)()) {
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
      for (Block* b : ready) {
        ForEach(b, [&](BlockStats& s) {
          s.deferred_blocks--;
          s.deferred_bytes -= b->bytes;
        });
      }
      deferred_.insert(deferred_.end(), keep.begin(), keep.end());
    }
    for (Block* b : ready) Free(b);
    return ready.size();
  }

  // CUDA-graph pools (torch's contract: begin/end bracket a capture; release_pool when a graph
  // using the pool is reset; pools may be shared by several graphs, so uses are counted). A block
  // made inside the bracket on a stream the filter accepts belongs to the pool: if it was used
  // (record_event) it is never reused, like torch's; if not, it is freed once the pool is released.
  // Whether some pool is being allocated to (a hint read without the lock; Make decides under it).
  bool PoolsActive() const { return active_pool_count_.load(std::memory_order_acquire) > 0; }

  void BeginPool(c10::MempoolId_t id, std::function<bool(c10::Stream)> filter) {
    std::lock_guard<std::mutex> lock(mu_);
    active_pools_.emplace_back(id, std::move(filter));
    active_pool_count_.store(static_cast<int>(active_pools_.size()), std::memory_order_release);
    pool_uses_[id]++;
    released_pools_.erase(id);
  }
  void EndPool(c10::MempoolId_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = active_pools_.rbegin(); it != active_pools_.rend(); ++it) {
      if (it->first == id) {
        active_pools_.erase(std::next(it).base());
        active_pool_count_.store(static_cast<int>(active_pools_.size()), std::memory_order_release);
        return;
      }
    }
  }
  void ReleasePool(c10::MempoolId_t id) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pool_uses_.find(id);
      if (it != pool_uses_.end() && --it->second > 0) return;  // another graph still uses it
      if (it != pool_uses_.end()) pool_uses_.erase(it);
      released_pools_.insert(id);
    }
    Poll();
  }

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
  Events& events() { return events_; }

 private:
  struct PoolIdHash {
    size_t operator()(const c10::MempoolId_t& id) const {
      return std::hash<uint64_t>()(id.first) * 31 + std::hash<uint64_t>()(id.second);
    }
  };

  Blocks() = default;
  // Applies f to the stats every block counts in, and to the pinned allocator's own.
  template <typename F>
  void ForEach(const Block* b, F f) {  // assumes mu_
    f(stats_);
    if (b->pinned_allocator) f(pinned_stats_);
  }
  void Park(Block* b) {  // assumes mu_
    deferred_.push_back(b);
    ForEach(b, [&](BlockStats& s) {
      s.deferred_blocks++;
      s.deferred_bytes += b->bytes;
      s.deferred_frees_total++;
    });
  }
  bool PoolReleased(c10::MempoolId_t id) const { return released_pools_.count(id) > 0; }  // mu_
  void Free(Block* b) {  // without mu_
    const Status st = b->arena->get()->Free(b->ptr);
    if (!st.ok())
      std::fprintf(stderr, "spillway: freeing a host block: %s\n", st.ToString().c_str());
    {
      std::lock_guard<std::mutex> lock(mu_);
      ForEach(b, [&](BlockStats& s) { s.freed_bytes_total += b->bytes; });
    }
    delete b;
  }

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
void* ArenaAllocate(PyArena& arena, uint64_t bytes, const allocator::OwnerTag& tag,
                    const char* what);

}  // namespace spillway::python::torch_alloc
