// Installing Spillway as torch's two host allocators (Note [Torch allocators] in
// docs/deepspeed.md):
//  - a CPU allocator router (c10::SetCPUAllocator, cpu_router.h) that serves allocations made
//    inside a tag scope from a pageable, MADV_DONTFORK, budgeted arena and forwards every other one
//    to the allocator it replaced;
//  - a pinned host allocator (at::setHostAllocator for CUDA, pinned_allocator.h): every
//    pin_memory(), pinned empty() and non_blocking D2H output from a pinned arena, exact size, with
//    a block's reuse deferred until the events recorded on it have completed.
// The process's installation is one object, made once and never destroyed (torch keeps raw
// pointers to both allocators): it owns them and the fork state. For libtorch programs and the
// Python module alike.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "spillway/allocator/process.h"
#include "spillway/base/status.h"
#include "spillway/torch_alloc/shared_arena.h"

namespace spillway::torch_alloc {

class CpuRouter;
class PinnedAllocator;
struct ChildArena;

class Installation {
 public:
  // Makes the router and the pinned allocator and registers both with torch at `priority` (1..255;
  // torch's own register at 0). Once per process, in the process that will use them (not in a
  // forked child); `small_bytes` (>= 1): tagged CPU allocations below it stay with torch's
  // allocator. Each refusal names the cause and installs nothing; a registration that torch did not
  // take (another allocator at a higher priority) leaves the process unable to install again.
  static Status Install(std::shared_ptr<SharedArena> host, std::shared_ptr<SharedArena> pinned,
                        uint64_t small_bytes, int priority);
  // The process's installation: null before Install made one. Made even where a registration then
  // failed (its allocators may have served allocations that still need their frees): see
  // installed().
  static Installation* Get() { return current_.load(std::memory_order_acquire); }
  // True in a child forked after Install: the arenas' regions are MADV_DONTFORK, so the child has
  // no mapping of them and must neither allocate from nor free into them.
  static bool Forked() {
    const Installation* i = Get();
    return i != nullptr && !i->installed_in_.InOwner();
  }
  // Whether both registrations took.
  static bool Installed() {
    const Installation* i = Get();
    return i != nullptr && i->installed_.load(std::memory_order_acquire);
  }
  // Whether torch's current allocators are this installation's: {CPU, pinned}.
  struct Current {
    bool cpu = false;
    bool pinned = false;
  };
  static Current TorchAllocatorsAreOurs();

  CpuRouter& router() { return *router_; }
  PinnedAllocator& pinned() { return *pinned_; }
  // The arena a child forked after Install makes for its tagged allocations (cpu_router.cc).
  std::atomic<ChildArena*>& child_arena() { return child_; }

 private:
  Installation() = default;
  static inline std::atomic<Installation*> current_{nullptr};
  const allocator::ProcessTag installed_in_;
  CpuRouter* router_ = nullptr;
  PinnedAllocator* pinned_ = nullptr;
  std::atomic<bool> installed_{false};
  // Per process: a grandchild makes its own. Never destroyed (a descendant holds a copy).
  std::atomic<ChildArena*> child_{nullptr};
};

}  // namespace spillway::torch_alloc
