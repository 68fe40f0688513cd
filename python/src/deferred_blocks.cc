// The table of blocks whose free waits for events (Blocks), the blocks' deleter and the arena
// allocation every torch-facing allocator shares. Note [Deferred free] in docs/deepspeed.md.
#include "deferred_blocks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>

#include "spillway/base/status.h"

namespace spillway::python::torch_alloc {

Blocks& Blocks::MakeForThisProcess() {
  auto made = std::unique_ptr<Blocks>(new Blocks());
  for (;;) {
    Blocks* seen = current_.load(std::memory_order_acquire);
    if (seen != nullptr && seen->process_.InOwner()) return *seen;  // another thread made it
    // An ancestor's table (in `seen`) is left as it is.
    if (current_.compare_exchange_weak(seen, made.get(), std::memory_order_acq_rel)) {
      return *made.release();
    }
  }
}

Block* Blocks::Make(void* ptr, uint64_t bytes, std::shared_ptr<PyArena> arena,
                    bool pinned_allocator, const c10::Stream* stream) {
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

void Blocks::Release(Block* b) {
  if (!b->arena->made_in_this_process()) return;  // an ancestor's: not mapped here
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

bool Blocks::Record(void* ctx, c10::Stream stream) {
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

size_t Blocks::Poll() {
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

void Blocks::BeginPool(c10::MempoolId_t id, std::function<bool(c10::Stream)> filter) {
  std::lock_guard<std::mutex> lock(mu_);
  active_pools_.emplace_back(id, std::move(filter));
  active_pool_count_.store(static_cast<int>(active_pools_.size()), std::memory_order_release);
  pool_uses_[id]++;
  released_pools_.erase(id);
}

void Blocks::EndPool(c10::MempoolId_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = active_pools_.rbegin(); it != active_pools_.rend(); ++it) {
    if (it->first == id) {
      active_pools_.erase(std::next(it).base());
      active_pool_count_.store(static_cast<int>(active_pools_.size()), std::memory_order_release);
      return;
    }
  }
}

void Blocks::ReleasePool(c10::MempoolId_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pool_uses_.find(id);
    if (it != pool_uses_.end() && --it->second > 0) return;  // another graph still uses it
    if (it != pool_uses_.end()) pool_uses_.erase(it);
    released_pools_.insert(id);
  }
  Poll();
}

void Blocks::ResetAccumulated() {
  std::lock_guard<std::mutex> lock(mu_);
  for (BlockStats* s : {&stats_, &pinned_stats_}) {
    s->allocations_total = s->allocated_bytes_total = s->freed_bytes_total = 0;
  }
}

void Blocks::Park(Block* b) {  // assumes mu_
  deferred_.push_back(b);
  ForEach(b, [&](BlockStats& s) {
    s.deferred_blocks++;
    s.deferred_bytes += b->bytes;
    s.deferred_frees_total++;
  });
}

void Blocks::Free(Block* b) {  // without mu_
  const Status st = b->arena->get()->Free(b->ptr);
  if (!st.ok()) std::fprintf(stderr, "spillway: freeing a host block: %s\n", st.ToString().c_str());
  {
    std::lock_guard<std::mutex> lock(mu_);
    ForEach(b, [&](BlockStats& s) { s.freed_bytes_total += b->bytes; });
  }
  delete b;
}

void ReleaseBlock(void* ctx) {
  if (ctx != nullptr) Blocks::Get().Release(static_cast<Block*>(ctx));
}

void* ArenaAllocate(PyArena& arena, uint64_t bytes, const allocator::OwnerTag& tag,
                    const char* what) {
  TORCH_CHECK(!Forked(), "spillway: ", what, " of ", bytes,
              " bytes in a process forked after spillway.install(): the pinned arena and the "
              "arenas made before the fork are the parent's, and their memory is not mapped in a "
              "forked child (MADV_DONTFORK). Make pinned memory in the parent, or start the "
              "process with the 'spawn' start method (CUDA cannot run in a forked child either)");
  Result<void*> r = arena.get()->Allocate(bytes, tag);
  // Parked blocks hold budget until their copies end: give back what has ended and try once more.
  if (!r.ok() && r.status().code() == StatusCode::kOverBudget && Blocks::Get().Poll() > 0) {
    r = arena.get()->Allocate(bytes, tag);
  }
  return AllocatedOrThrow(r, what);
}

void* AllocatedOrThrow(const Result<void*>& r, const char* what) {
  if (r.ok()) return *r;
  if (r.status().code() == StatusCode::kOverBudget) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "spillway.OverBudget: ", r.status().message());
  }
  TORCH_CHECK(false, "spillway: ", what, ": ", r.status().ToString());
}

}  // namespace spillway::python::torch_alloc
