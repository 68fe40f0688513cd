// The CPU allocator router: torch's CPU allocator, which sends allocations made inside a
// `spillway.tag(...)` scope to the host arena and forwards the rest to the allocator it replaced.
// Note [Torch allocators] in docs/deepspeed.md.
#pragma once

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

#include "spillway/torch_alloc/blocks.h"
#include "spillway/torch_alloc/installation.h"
#include "spillway/torch_alloc/shared_arena.h"
#include "spillway/torch_alloc/tag_scope.h"

namespace spillway::torch_alloc {

struct RouterStats {
  std::atomic<uint64_t> routed_allocations{0};
  std::atomic<uint64_t> routed_bytes{0};
  std::atomic<uint64_t> small_forwarded{0};  // inside a scope but below small_bytes
  // torch's own CPU tensors, live: malloc_usable_size of what the replaced allocator handed out
  // through this one (signed: a raw free of a pointer it made before install() is subtracted too).
  std::atomic<int64_t> forwarded_live_bytes{0};
};

// Thread-safe. While no tag scope is open anywhere in the process, allocate() is one relaxed atomic
// load and a forward; otherwise one ThreadLocalDebugInfo read (null unless some debug info is
// pushed on this thread or propagated to it) decides. A storage frees through the deleter of the
// allocator that made it; a forwarded one's deleter also takes its bytes off forwarded_live_bytes
// (one relaxed add each way: the process's memory names torch's CPU tensors with it).
class CpuRouter final : public c10::Allocator {
 public:
  CpuRouter(c10::Allocator* next, std::shared_ptr<SharedArena> arena, uint64_t small_bytes)
      : next_(next),
        arena_(std::move(arena)),
        small_bytes_(small_bytes),
        child_budget_bytes_(arena_->get()->Stats().budget_bytes) {}

  c10::DataPtr allocate(size_t n) override {
    if (C10_LIKELY(g_open_scopes.load(std::memory_order_relaxed) == 0)) return Forward(n);
    const TagScope* scope = CurrentTag();
    if (scope == nullptr) return Forward(n);
    if (n < small_bytes_) {
      stats_.small_forwarded.fetch_add(1, std::memory_order_relaxed);
      return Forward(n);
    }
    if (C10_UNLIKELY(Installation::Forked())) return AllocateInChild(n, scope->tag);
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
  static void FreeForwarded(void* p);
  static void RawFree(void* p);
  // In a process forked after install(): the child's own arena, made on its first tagged
  // allocation (Note [Fork] in docs/allocator.md). The parent's regions are not mapped there.
  c10::DataPtr AllocateInChild(size_t n, const allocator::OwnerTag& tag);
  static void FreeInChild(void* p);
  // The child arena's stats, or nullopt where this process has made none.
  static std::optional<allocator::HostArenaStats> ChildStats();
  SharedArena& arena() { return *arena_; }
  const RouterStats& stats() const { return stats_; }
  uint64_t small_bytes() const { return small_bytes_; }

 private:
  c10::Allocator* const next_;
  const std::shared_ptr<SharedArena> arena_;
  // The replaced allocator's allocation, counted where that is torch's default CPU allocator
  // (malloc's: malloc_usable_size applies) and the allocation is its plain kind (context == data,
  // freed by its raw deleter); any other passes through uncounted.
  c10::DataPtr Forward(size_t n) {
    c10::DataPtr dp = next_->allocate(n);
    void* p = dp.get();
    const c10::DeleterFnPtr raw = next_->raw_deleter();
    if (p == nullptr || raw == nullptr || !next_is_default_ || dp.get_context() != p ||
        !dp.compare_exchange_deleter(raw, &FreeForwarded)) {
      return dp;
    }
    stats_.forwarded_live_bytes.fetch_add(static_cast<int64_t>(UsableBytes(p)),
                                          std::memory_order_relaxed);
    return dp;
  }
  static size_t UsableBytes(void* p);

  const bool next_is_default_ = next_ == c10::GetDefaultCPUAllocator();
  const uint64_t small_bytes_;
  const uint64_t child_budget_bytes_;  // a forked child's arena gets the parent's budget
  RouterStats stats_;
};

}  // namespace spillway::torch_alloc
