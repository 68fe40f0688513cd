// The pinned host allocator: torch's CUDA host allocator (pin_memory(), non_blocking copies) served
// from the pinned arena as deferred blocks. Note [Torch allocators] in docs/deepspeed.md.
#pragma once

#include <ATen/core/CachingHostAllocator.h>

#include <functional>
#include <memory>
#include <optional>

#include "spillway/torch_alloc/blocks.h"
#include "spillway/torch_alloc/installation.h"
#include "spillway/torch_alloc/shared_arena.h"
#include "spillway/torch_alloc/tag_scope.h"

namespace spillway::torch_alloc {

// The allocating thread's current stream on the CUDA device (through torch's device guard, so no
// CUDA call of Spillway's own); a CPU stream where torch has no CUDA (the tests' pools).
c10::Stream CurrentStream();

// torch's registered host allocator for CUDA (Spillway's once installed), or null where a CPU-only
// torch has none.
at::HostAllocator* CurrentCudaHostAllocator();

// Thread-safe (Blocks is). Memory the allocator did not make goes to the allocator it replaced.
class PinnedAllocator final : public at::HostAllocator {
 public:
  PinnedAllocator(at::HostAllocator* previous, std::shared_ptr<SharedArena> arena)
      : previous_(previous), arena_(std::move(arena)) {}

  at::DataPtr allocate(size_t n) override {
    Blocks::ForThisProcess().Poll();
    if (n == 0) return {nullptr, nullptr, &ReleaseBlock, c10::Device(c10::DeviceType::CPU)};
    const TagScope* scope = CurrentTag();
    const allocator::OwnerTag tag =
        scope != nullptr
            ? scope->tag
            : allocator::OwnerTag{allocator::Kind::kTransient, allocator::Lifetime::kPersistent, 0,
                                  allocator::kProcessScope, "pinned"};
    void* p = ArenaAllocate(*arena_, n, tag, "a pinned host allocation");
    // The current stream (a device call) is asked only while a graph pool is being allocated to:
    // its filter is the only thing that reads it.
    std::optional<c10::Stream> stream;
    if (Blocks::ForThisProcess().PoolsActive()) stream = CurrentStream();
    TorchBlock* b = Blocks::ForThisProcess().Make(p, n, arena_, /*pinned_allocator=*/true,
                                                  stream ? &*stream : nullptr);
    return {p, b, &ReleaseBlock, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool record_event(void* ptr, void* ctx, c10::Stream stream) override {
    if (Blocks::ForThisProcess().Record(ctx, stream)) return true;
    return previous_ != nullptr && previous_->record_event(ptr, ctx, stream);
  }
  void empty_cache() override {
    if (Installation::Forked()) return;  // nothing of the parent's to give back
    Blocks::ForThisProcess().Poll();
    arena_->get()->Trim();  // returns the bytes given back; none is not an error
    if (previous_ != nullptr) previous_->empty_cache();
  }
  // Spillway's blocks plus whatever the replaced allocator still holds, so host_memory_stats()
  // keeps describing every pinned byte of the process.
  at::HostStats get_stats() override {
    at::HostStats s = previous_ != nullptr ? previous_->get_stats() : at::HostStats{};
    const BlockStats b = Blocks::ForThisProcess().Stats(/*pinned_only=*/true);
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
    Blocks::ForThisProcess().ResetAccumulated();
    if (previous_ != nullptr) previous_->reset_accumulated_stats();
  }
  void reset_peak_stats() override {
    Blocks::ForThisProcess().ResetPeak();
    if (previous_ != nullptr) previous_->reset_peak_stats();
  }
  // Note [Torch allocators] in docs/deepspeed.md: blocks made inside the bracket on a stream the
  // filter accepts belong to the pool (Blocks::BeginPool).
  void begin_allocate_to_pool(c10::MempoolId_t pool_id,
                              std::function<bool(c10::Stream)> filter) override {
    Blocks::ForThisProcess().BeginPool(pool_id, std::move(filter));
  }
  void end_allocate_to_pool(c10::MempoolId_t pool_id) override {
    Blocks::ForThisProcess().EndPool(pool_id);
  }
  void release_pool(c10::MempoolId_t pool_id) override {
    Blocks::ForThisProcess().ReleasePool(pool_id);
  }

  SharedArena& arena() { return *arena_; }

 private:
  at::HostAllocator* const previous_;
  const std::shared_ptr<SharedArena> arena_;
};

}  // namespace spillway::torch_alloc
