// Spillway as torch's CPU allocator (a router by tag scope) and as its pinned host allocator for
// CUDA, plus the blocks whose free waits for recorded events. Note [Torch allocators] in
// docs/deepspeed.md has the design; the summary is in torch_allocators.h.
#include "torch_allocators.h"

#include <ATen/TensorUtils.h>
#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <pthread.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "errors.h"
#include "py_arena.h"
#include "spillway/allocator/owner.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

using allocator::Kind;
using allocator::Lifetime;
using allocator::OwnerTag;

// ---- Tag scopes ----

constexpr std::string_view kTagKindName = "spillway.tag";
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
const c10::DebugInfoKind kTagKind(&kTagKindName);
#else
// Before 2.13 the kinds are a closed enum; TEST_INFO_2 is the slot nothing in torch itself uses.
constexpr c10::DebugInfoKind kTagKind = c10::DebugInfoKind::TEST_INFO_2;
#endif

// One open `spillway.tag(...)`. Immutable once pushed; shared by every thread the debug info was
// propagated to (autograd's workers hold it through ThreadLocalStateGuard).
struct TagScope final : c10::DebugInfoBase {
  OwnerTag tag;
  std::string label;  // "optimizer_state/persistent"
  uint64_t serial = 0;
};
std::atomic<uint64_t> g_tag_serial{0};
// Tag scopes open in the process, on any thread. Zero (the state outside training code) lets the
// router forward without touching thread-local state: torch's ThreadLocalDebugInfo lives in
// libc10.so, whose thread-locals cost a __tls_get_addr call (measured: ~4 ns on a 77 ns
// allocation). A task torch launched inside a scope that outlives the scope's exit allocates
// untagged.
std::atomic<int64_t> g_open_scopes{0};

const TagScope* CurrentTag() {
  return static_cast<const TagScope*>(c10::ThreadLocalDebugInfo::get(kTagKind));
}

// The process install() ran in (null before): in a child made by fork() after install, the
// arenas' regions are MADV_DONTFORK, so the child has no mapping of them. It must neither allocate
// from nor free into them. Set once, never freed.
std::atomic<const allocator::ProcessTag*> g_installed_in{nullptr};
bool Forked() {
  const allocator::ProcessTag* tag = g_installed_in.load(std::memory_order_acquire);
  return tag != nullptr && !tag->InOwner();
}

// ---- Blocks whose free waits for events ----

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

void ReleaseBlock(void* ctx) {
  if (ctx != nullptr) Blocks::Get().Release(static_cast<Block*>(ctx));
}

// An allocation of `bytes` from `arena` under the current tag (or `untagged`), for torch.
// Throws c10::OutOfMemoryError (torch.OutOfMemoryError in Python) over budget, with a message that
// starts "spillway.OverBudget:" so the Python edge can re-raise it as spillway.OverBudget.
void* ArenaAllocate(PyArena& arena, uint64_t bytes, const OwnerTag& tag, const char* what) {
  TORCH_CHECK(
      !Forked(), "spillway: ", what, " of ", bytes,
      " bytes in a process forked after spillway.install(): "
      "Spillway's arenas are not mapped in a forked child (MADV_DONTFORK). Leave the "
      "spillway.tag() scope before forking, or allocate in the child outside any tag scope");
  Result<void*> r = arena.get()->Allocate(bytes, tag);
  // Parked blocks hold budget until their copies end: give back what has ended and try once more.
  if (!r.ok() && r.status().code() == StatusCode::kOverBudget && Blocks::Get().Poll() > 0) {
    r = arena.get()->Allocate(bytes, tag);
  }
  if (r.ok()) return *r;
  if (r.status().code() == StatusCode::kOverBudget) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "spillway.OverBudget: ", r.status().message());
  }
  TORCH_CHECK(false, "spillway: ", what, ": ", r.status().ToString());
}

// ---- The CPU allocator router ----

struct RouterStats {
  std::atomic<uint64_t> routed_allocations{0};
  std::atomic<uint64_t> routed_bytes{0};
  std::atomic<uint64_t> small_forwarded{0};  // inside a scope but below small_bytes
};

// Thread-safe. While no tag scope is open anywhere in the process, allocate() is one relaxed atomic
// load and a forward; otherwise one ThreadLocalDebugInfo read (null unless some debug info is
// pushed on this thread or propagated to it) decides. Frees need no routing: a storage
// frees through the deleter of the allocator that made it.
class CpuRouter final : public c10::Allocator {
 public:
  CpuRouter(c10::Allocator* next, std::shared_ptr<PyArena> arena, uint64_t small_bytes)
      : next_(next), arena_(std::move(arena)), small_bytes_(small_bytes) {}

  c10::DataPtr allocate(size_t n) override {
    if (C10_LIKELY(g_open_scopes.load(std::memory_order_relaxed) == 0)) return next_->allocate(n);
    const TagScope* scope = CurrentTag();
    if (scope == nullptr) return next_->allocate(n);
    if (n < small_bytes_) {
      stats_.small_forwarded.fetch_add(1, std::memory_order_relaxed);
      return next_->allocate(n);
    }
    void* p = ArenaAllocate(*arena_, n, scope->tag, "a CPU tensor allocation inside spillway.tag");
    stats_.routed_allocations.fetch_add(1, std::memory_order_relaxed);
    stats_.routed_bytes.fetch_add(n, std::memory_order_relaxed);
    return {p, p, &FreeRouted, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  // raw_allocate()/raw_deallocate() (oneDNN's scratch buffers use them) need one deleter for both
  // kinds of pointer: routed ones are found in the arena, the rest go to the replaced allocator's.
  c10::DeleterFnPtr raw_deleter() const override {
    return next_->raw_deleter() != nullptr ? &RawFree : nullptr;
  }

  static void FreeRouted(void* p);
  static void RawFree(void* p);
  PyArena& arena() { return *arena_; }
  const RouterStats& stats() const { return stats_; }
  uint64_t small_bytes() const { return small_bytes_; }

 private:
  c10::Allocator* const next_;
  const std::shared_ptr<PyArena> arena_;
  const uint64_t small_bytes_;
  RouterStats stats_;
};

// ---- The pinned host allocator ----

// The allocating thread's current stream on the CUDA device (through torch's device guard, so no
// CUDA call of Spillway's own); a CPU stream where torch has no CUDA (the tests' pools).
c10::Stream CurrentStream() {
  const c10::Stream host(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU));
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return host;  // a CPU build of torch
  const c10::impl::DeviceGuardImplInterface* impl =
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  // A CUDA build of torch on a machine without a usable GPU: getDevice() would throw (no driver).
  if (impl->deviceCount() == 0) return host;
  return impl->getStream(impl->getDevice());
}

// Thread-safe (Blocks is). Memory the allocator did not make goes to the allocator it replaced.
class PinnedAllocator final : public at::HostAllocator {
 public:
  PinnedAllocator(at::HostAllocator* previous, std::shared_ptr<PyArena> arena)
      : previous_(previous), arena_(std::move(arena)) {}

  at::DataPtr allocate(size_t n) override {
    Blocks::Get().Poll();
    if (n == 0) return {nullptr, nullptr, &ReleaseBlock, c10::Device(c10::DeviceType::CPU)};
    const TagScope* scope = CurrentTag();
    const OwnerTag tag = scope != nullptr ? scope->tag
                                          : OwnerTag{Kind::kTransient, Lifetime::kPersistent, 0,
                                                     allocator::kProcessScope, "pinned"};
    void* p = ArenaAllocate(*arena_, n, tag, "a pinned host allocation");
    // The current stream (a device call) is asked only while a graph pool is being allocated to:
    // its filter is the only thing that reads it.
    std::optional<c10::Stream> stream;
    if (Blocks::Get().PoolsActive()) stream = CurrentStream();
    Block* b =
        Blocks::Get().Make(p, n, arena_, /*pinned_allocator=*/true, stream ? &*stream : nullptr);
    return {p, b, &ReleaseBlock, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool record_event(void* ptr, void* ctx, c10::Stream stream) override {
    if (Blocks::Get().Record(ctx, stream)) return true;
    return previous_ != nullptr && previous_->record_event(ptr, ctx, stream);
  }
  void empty_cache() override {
    if (Forked()) return;  // nothing of the parent's to give back
    Blocks::Get().Poll();
    (void)arena_->get()->Trim();
    if (previous_ != nullptr) previous_->empty_cache();
  }
  // Spillway's blocks plus whatever the replaced allocator still holds, so host_memory_stats()
  // keeps describing every pinned byte of the process.
  at::HostStats get_stats() override {
    at::HostStats s = previous_ != nullptr ? previous_->get_stats() : at::HostStats{};
    const BlockStats b = Blocks::Get().Stats(/*pinned_only=*/true);
    const allocator::HostArenaStats a = arena_->get()->Stats();
    s.active_requests.current += static_cast<int64_t>(b.live_blocks);
    s.active_bytes.current += static_cast<int64_t>(b.live_bytes);
    s.active_bytes.peak += static_cast<int64_t>(b.peak_live_bytes);
    s.active_bytes.allocated += static_cast<int64_t>(b.allocated_bytes_total);
    s.active_bytes.freed += static_cast<int64_t>(b.freed_bytes_total);
    s.allocations.current += static_cast<int64_t>(b.live_blocks + b.deferred_blocks);
    s.allocations.allocated += static_cast<int64_t>(b.allocations_total);
    s.allocated_bytes.current += static_cast<int64_t>(a.committed_bytes);
    s.allocated_bytes.peak += static_cast<int64_t>(a.peak_committed_bytes);
    s.num_host_alloc += static_cast<int64_t>(a.region_map_count);
    s.num_host_free += static_cast<int64_t>(a.region_unmap_count);
    return s;
  }
  void reset_accumulated_stats() override {
    Blocks::Get().ResetAccumulated();
    if (previous_ != nullptr) previous_->reset_accumulated_stats();
  }
  void reset_peak_stats() override {
    Blocks::Get().ResetPeak();
    if (previous_ != nullptr) previous_->reset_peak_stats();
  }
  // Note [Torch allocators] in docs/deepspeed.md: blocks made inside the bracket on a stream the
  // filter accepts belong to the pool (Blocks::BeginPool).
  void begin_allocate_to_pool(c10::MempoolId_t pool_id,
                              std::function<bool(c10::Stream)> filter) override {
    Blocks::Get().BeginPool(pool_id, std::move(filter));
  }
  void end_allocate_to_pool(c10::MempoolId_t pool_id) override { Blocks::Get().EndPool(pool_id); }
  void release_pool(c10::MempoolId_t pool_id) override { Blocks::Get().ReleasePool(pool_id); }

  PyArena& arena() { return *arena_; }

 private:
  at::HostAllocator* const previous_;
  const std::shared_ptr<PyArena> arena_;
};

// Both allocators live for the rest of the process once installed (torch keeps raw pointers).
CpuRouter* g_router = nullptr;
PinnedAllocator* g_pinned = nullptr;
bool g_installed = false;  // both registrations took

void CpuRouter::FreeRouted(void* p) {
  if (Forked()) return;  // the child has no mapping to free
  const Status st = g_router->arena_->get()->Free(p);
  if (!st.ok()) std::fprintf(stderr, "spillway: freeing a CPU tensor: %s\n", st.ToString().c_str());
}

void CpuRouter::RawFree(void* p) {
  // In a forked child the arena's regions are not mapped, and malloc may reuse their addresses.
  if (!Forked() && p != nullptr && g_router->arena_->Contains(p, 1)) {
    FreeRouted(p);
    return;
  }
  g_router->next_->raw_deleter()(p);
}

at::HostAllocator* CurrentCudaHostAllocator() {
  try {
    return at::getHostAllocator(at::kCUDA);
  } catch (const c10::Error&) {
    return nullptr;  // a CPU-only torch has none registered
  }
}

Status Install(std::shared_ptr<PyArena> host, std::shared_ptr<PyArena> pinned, uint64_t small_bytes,
               uint8_t priority) {
  if (g_installed) {
    return Status::FailedPrecondition(
        "spillway.install() already ran in this process: torch's allocators are Spillway's; "
        "use spillway.installed() to get its arenas instead of installing again");
  }
  if (g_router != nullptr) {
    return Status::FailedPrecondition(
        "an earlier spillway.install() in this process failed (its error named the allocator that "
        "kept its place); start a new process to install again");
  }
  if (Forked()) {
    return Status::FailedPrecondition(
        "spillway.install() in a forked child: install in the parent");
  }
  if (small_bytes == 0) {
    return Status::InvalidArgument("spillway.install(small_bytes=0): must be at least 1 byte");
  }
  SPILLWAY_RETURN_IF_ERROR(allocator::ForkTracking().WithContext("spillway.install()"));
  g_installed_in.store(new allocator::ProcessTag(), std::memory_order_release);
  c10::Allocator* const previous_cpu = c10::GetCPUAllocator();
  // Published before torch can call them: once SetCPUAllocator returns, other threads may already
  // allocate, and raw frees read g_router. Never destroyed (torch keeps the raw pointers).
  g_router = new CpuRouter(previous_cpu, std::move(host), small_bytes);
  g_pinned = new PinnedAllocator(CurrentCudaHostAllocator(), std::move(pinned));
  c10::SetCPUAllocator(g_router, priority);
  if (c10::GetCPUAllocator() != g_router) {
    return Status::FailedPrecondition(StrCat(
        "spillway.install(): torch kept its CPU allocator; another one is registered at a priority "
        "above ",
        static_cast<int>(priority),
        ". Pass a higher priority= to spillway.install(). Nothing "
        "was installed"));
  }
  at::setHostAllocator(at::kCUDA, g_pinned, priority);
  if (CurrentCudaHostAllocator() != g_pinned) {
    c10::SetCPUAllocator(previous_cpu, priority);  // the router keeps serving what it handed out
    return Status::FailedPrecondition(StrCat(
        "spillway.install(): torch kept its pinned host allocator; another one is registered at a "
        "priority above ",
        static_cast<int>(priority),
        ". Pass a higher priority= to "
        "spillway.install(). Nothing was installed"));
  }
  g_installed = true;
  return Status::Ok();
}

// A uint8 CPU tensor over a DataPtr (pinned blocks for the tests that cannot call pin_memory()).
torch::Tensor TensorOver(at::DataPtr data, int64_t bytes, c10::Allocator* alloc) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), alloc, false);
  return torch::empty({0}, torch::kUInt8).set_(storage, 0, {bytes}, {1});
}

py::dict BlockStatsDict(bool pinned_only) {
  const BlockStats s = Blocks::Get().Stats(pinned_only);
  py::dict d;
  d["live_blocks"] = s.live_blocks;
  d["live_bytes"] = s.live_bytes;
  d["deferred_blocks"] = s.deferred_blocks;
  d["deferred_bytes"] = s.deferred_bytes;
  d["peak_live_bytes"] = s.peak_live_bytes;
  d["allocations_total"] = s.allocations_total;
  d["allocated_bytes_total"] = s.allocated_bytes_total;
  d["freed_bytes_total"] = s.freed_bytes_total;
  d["events_recorded_total"] = s.events_recorded_total;
  d["deferred_frees_total"] = s.deferred_frees_total;
  d["foreign_record_events_total"] = s.foreign_record_events_total;
  d["graph_held_blocks"] = s.graph_held_blocks;
  d["graph_held_bytes"] = s.graph_held_bytes;
  d["event_errors_total"] = s.event_errors_total;
  return d;
}

}  // namespace

// ---- PyArena (declared in py_arena.h) ----

PyArena::PyArena(uint64_t budget_bytes, allocator::PinMode pin, allocator::EscapePolicy policy,
                 const std::string& name, const std::shared_ptr<PyArena>& share_ledger_with)
    : ledger_(share_ledger_with ? share_ledger_with->ledger_
                                : std::make_shared<allocator::Ledger>()) {
  allocator::HostArenaOptions o;
  o.name = name;
  o.budget_bytes = budget_bytes;
  o.pin = pin;
  o.policy = policy;
  o.ledger = ledger_.get();
  arena_ = Check(allocator::HostArena::Create(o));
}

torch::Tensor PyArena::Empty(const std::vector<int64_t>& shape, c10::ScalarType dtype, Kind kind,
                             Lifetime lifetime, uint64_t owner) {
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0)
      Raise(
          Status::InvalidArgument(StrCat("arena.empty: negative dimension ", d, " in the shape")));
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
      Raise(Status::InvalidArgument("arena.empty: the shape's element count overflows 64 bits"));
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(c10::elementSize(dtype)), &bytes)) {
    Raise(Status::InvalidArgument("arena.empty: the tensor's size in bytes overflows 64 bits"));
  }
  const OwnerTag tag{kind, lifetime, owner, allocator::kProcessScope, "python"};
  Blocks::Get().Poll();  // parked blocks hold budget until their copies end
  auto r = [&] {
    py::gil_scoped_release nogil;  // mapping and pinning a region are syscalls
    return arena_->Allocate(std::max<uint64_t>(bytes, 1), tag);
  }();
  void* p = Check(std::move(r));
  Block* b = Blocks::Get().Make(p, bytes, shared_from_this(), /*pinned_allocator=*/false, nullptr);
  return at::for_blob(p, shape)
      .context(b, &ReleaseBlock)
      .target_device(c10::Device(c10::DeviceType::CPU))
      .options(torch::TensorOptions().dtype(dtype))
      .make_tensor();
}

bool PyArena::Owns(const torch::Tensor& t) const {
  return t.defined() && t.device().is_cpu() && t.numel() > 0 &&
         arena_->Contains(t.data_ptr(), static_cast<uint64_t>(t.numel()) * t.element_size());
}

void BindTorchAllocators(py::module_& m) {
  m.attr("_torch_version_built") = TORCH_VERSION;

  // Tag scopes. Python's spillway.tag() wraps these.
  py::class_<TagScope, std::shared_ptr<TagScope>>(m, "_TagScope")
      .def_property_readonly("label", [](const TagScope& s) { return s.label; });
  m.def("_enter_tag", [](const std::string& kind, const std::string& lifetime, uint64_t owner) {
    auto scope = std::make_shared<TagScope>();
    scope->tag =
        OwnerTag{Check(allocator::ParseKind(kind)), Check(allocator::ParseLifetime(lifetime)),
                 owner, allocator::kProcessScope, "spillway.tag"};
    scope->label = StrCat(kind, "/", lifetime);
    scope->serial = ++g_tag_serial;
    c10::ThreadLocalDebugInfo::_push(kTagKind, scope);
    g_open_scopes.fetch_add(1, std::memory_order_relaxed);
    return scope;
  });
  m.def("_exit_tag", [](const std::shared_ptr<TagScope>& scope) {
    const TagScope* current = CurrentTag();
    if (current != scope.get()) {
      Raise(Status::FailedPrecondition(
          StrCat("spillway.tag('", scope->label, "') exited ",
                 current == nullptr ? std::string("while no tag scope is open on this thread")
                                    : StrCat("while spillway.tag('", current->label,
                                             "'), entered after it, is still open"),
                 "; exit tag scopes in the reverse order of entering them, on the thread that "
                 "entered them. "
                 "Nothing was changed")));
    }
    try {
      c10::ThreadLocalDebugInfo::_pop(kTagKind);
      g_open_scopes.fetch_sub(1, std::memory_order_relaxed);
    } catch (const c10::Error&) {
      Raise(Status::FailedPrecondition(StrCat("spillway.tag('", scope->label,
                                              "') exited while another thread-local debug scope (a "
                                              "profiler record, say) entered inside it is still "
                                              "open; close that one first. Nothing was "
                                              "changed")));
    }
  });
  m.def("_current_tag", []() -> py::object {
    const TagScope* s = CurrentTag();
    if (s == nullptr) return py::none();
    return py::str(s->label);
  });
  m.def("_forked_after_install", [] { return Forked(); });

  m.def("_install", [](std::shared_ptr<PyArena> host, std::shared_ptr<PyArena> pinned,
                       uint64_t small_bytes, int priority) {
    if (priority < 1 || priority > 255) {
      Raise(Status::InvalidArgument(StrCat("spillway.install(priority=", priority,
                                           "): must be 1..255 "
                                           "(torch's own allocators register at 0)")));
    }
    Check(Install(std::move(host), std::move(pinned), small_bytes, static_cast<uint8_t>(priority)));
  });
  m.def("_installed", [] { return g_installed; });
  m.def("_router_stats", [] {
    py::dict d;
    if (!g_installed) return d;
    d["routed_allocations"] = g_router->stats().routed_allocations.load();
    d["routed_bytes"] = g_router->stats().routed_bytes.load();
    d["small_forwarded"] = g_router->stats().small_forwarded.load();
    d["small_bytes"] = g_router->small_bytes();
    return d;
  });
  m.def("_pinned_stats", [] { return BlockStatsDict(/*pinned_only=*/true); });
  m.def("_block_stats", [] { return BlockStatsDict(/*pinned_only=*/false); });
  // Whether torch's current allocators are Spillway's (what `spillway.installed()` reports).
  m.def("_torch_allocators_are_spillways", [] {
    return py::make_tuple(g_installed && c10::GetCPUAllocator() == g_router,
                          g_installed && CurrentCudaHostAllocator() == g_pinned);
  });

  // Through torch's registry, as torch itself calls it: on a machine without a GPU, pin_memory()
  // cannot run, so the tests reach the pinned allocator here.
  m.def("_host_allocator_empty", [](int64_t bytes) {
    if (bytes < 0)
      Raise(Status::InvalidArgument(StrCat("_host_allocator_empty(", bytes, "): negative size")));
    at::HostAllocator* a = CurrentCudaHostAllocator();
    if (a == nullptr)
      Raise(Status::FailedPrecondition("no pinned host allocator is registered for CUDA"));
    return TensorOver(a->allocate(static_cast<size_t>(bytes)), bytes, a);
  });
  m.def("_host_allocator_record_event", [](const torch::Tensor& t) {
    at::HostAllocator* a = CurrentCudaHostAllocator();
    if (a == nullptr)
      Raise(Status::FailedPrecondition("no pinned host allocator is registered for CUDA"));
    const c10::DataPtr& d = t.storage().data_ptr();
    return a->record_event(d.get(), d.get_context(),
                           c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)));
  });
  m.def("_host_allocator_empty_cache", [] {
    if (at::HostAllocator* a = CurrentCudaHostAllocator()) a->empty_cache();
  });
  m.def("_host_allocator_pool", [](const std::string& what, int64_t a, int64_t b) {
    at::HostAllocator* h = CurrentCudaHostAllocator();
    if (h == nullptr)
      Raise(Status::FailedPrecondition("no pinned host allocator is registered for CUDA"));
    const c10::MempoolId_t id{static_cast<c10::CaptureId_t>(a), static_cast<c10::CaptureId_t>(b)};
    if (what == "begin")
      h->begin_allocate_to_pool(id, [](c10::Stream) { return true; });
    else if (what == "end")
      h->end_allocate_to_pool(id);
    else if (what == "release")
      h->release_pool(id);
    else
      Raise(Status::InvalidArgument("_host_allocator_pool: begin, end or release"));
  });
  m.def("_host_allocator_stats", [] {
    at::HostAllocator* a = CurrentCudaHostAllocator();
    py::dict d;
    if (a == nullptr) return d;
    const at::HostStats s = a->get_stats();
    d["active_requests"] = s.active_requests.current;
    d["active_bytes"] = s.active_bytes.current;
    d["allocations"] = s.allocations.current;
    d["allocated_bytes"] = s.allocated_bytes.current;
    d["num_host_alloc"] = s.num_host_alloc;
    d["num_host_free"] = s.num_host_free;
    return d;
  });
  // Test seam (docs/deepspeed.md, Note [Deferred free]): without a GPU no copy is ever in flight,
  // so tests stand in for one with events that complete when they say.
  m.def("_testing_manual_events", [](bool on) { Blocks::Get().events().SetManual(on); });
  m.def("_testing_complete_events", [] { Blocks::Get().events().CompleteManual(); });
  m.def("_poll_deferred", [] { return Blocks::Get().Poll(); });
  // For bench/compare_torch_allocators.py: nanoseconds per allocate + free pair through torch's
  // current CPU allocator, timed in C++ so the interpreter's overhead does not hide the
  // allocator's.
  m.def("_time_cpu_allocator", [](uint64_t bytes, uint64_t iters) {
    py::gil_scoped_release nogil;
    c10::Allocator* a = c10::GetCPUAllocator();
    const auto t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < iters; ++i) {
      c10::DataPtr d = a->allocate(bytes);
      if (d.get() == nullptr && bytes != 0) std::abort();
    }
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(iters);
  });
}

}  // namespace spillway::python
