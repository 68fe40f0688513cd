// The process's deferred-block table on torch's events (block_table.h with c10::Event), the
// deleter torch calls for its blocks, and the arena allocation every torch-facing allocator shares.
// Note [Deferred free] in docs/deepspeed.md.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>

#include "spillway/allocator/owner.h"
#include "spillway/base/status.h"
#include "spillway/torch_alloc/block_table.h"
#include "spillway/torch_alloc/shared_arena.h"

namespace spillway::torch_alloc {

// c10::Event on the stream's own device (CUDA's through torch's device guard), or, for tests on
// machines without a GPU (the Python suite's seam), events a test completes by hand.
class TorchEvents {
 public:
  using Stream = c10::Stream;
  using Event = std::function<bool()>;  // true once the work before it completed
  using PoolId = c10::MempoolId_t;
  struct PoolIdHash {
    size_t operator()(const PoolId& id) const {
      return std::hash<uint64_t>()(id.first) * 31 + std::hash<uint64_t>()(id.second);
    }
  };

  Event Record(const Stream& stream);
  bool Query(Event& e) { return e(); }
  static std::string Describe(const std::exception& e);

  void SetManual(bool on) { manual_.store(on, std::memory_order_release); }
  void CompleteManual() { manual_completed_.store(manual_recorded_.load()); }

 private:
  std::atomic<bool> manual_{false};
  std::atomic<uint64_t> manual_recorded_{0};
  std::atomic<uint64_t> manual_completed_{0};
};

using TorchBlock = Block<TorchEvents>;
using Blocks = BlockTable<TorchEvents>;

// The deleter torch calls with a block as the context (null for empty allocations).
void ReleaseBlock(void* ctx);

// An allocation of `bytes` from `arena` under `tag`, for torch. Throws c10::OutOfMemoryError
// (torch.OutOfMemoryError in Python) over budget, with a message that starts
// "spillway.OverBudget:" so the Python edge can re-raise it as spillway.OverBudget. Parked blocks
// hold budget until their copies end: over budget, it frees what has ended and tries once more.
// In a child forked after Install it refuses by name: the pinned allocator has no child path (the
// CPU router has one, CpuRouter::AllocateInChild).
void* ArenaAllocate(SharedArena& arena, uint64_t bytes, const allocator::OwnerTag& tag,
                    const char* what);
// `arena->Allocate`'s result for torch: the pointer, or the throw ArenaAllocate describes.
void* AllocatedOrThrow(const Result<void*>& r, const char* what);

}  // namespace spillway::torch_alloc
