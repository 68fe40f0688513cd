// The router's frees, and its child path: in a process forked after install(), tagged allocations
// come from an arena of the child's own.
#include "spillway/torch_alloc/cpu_router.h"

#include <malloc.h>

#include <cstdio>
#include <mutex>
#include <unordered_set>

#include "spillway/allocator/ledger.h"
#include "spillway/allocator/process.h"
#include "spillway/torch_alloc/installation.h"

namespace spillway::torch_alloc {

// The arena a forked child's tagged allocations come from, made on the first one. One per process:
// a grandchild makes its own. The parent's storages that die here free through FreeRouted, a
// no-op in a child, so they never reach this arena even where mmap gave it the parent's unmapped
// (MADV_DONTFORK) addresses; a grandchild's cannot alias ours either, since this arena is
// MADV_WIPEONFORK and its ranges stay mapped there. `live` names what this process allocated, for
// raw frees, which carry no deleter of their own. The installation holds the pointer.
struct ChildArena {
  allocator::Ledger ledger;  // declared first: destroyed after the arena
  std::unique_ptr<allocator::HostArena> arena;
  const allocator::ProcessTag process;
  std::mutex mu;
  std::unordered_set<void*> live;  // guarded by mu
};

namespace {

CpuRouter& Router() { return Installation::Get()->router(); }

ChildArena* ThisProcessChild() {
  Installation* i = Installation::Get();
  ChildArena* c = i != nullptr ? i->child_arena().load(std::memory_order_acquire) : nullptr;
  return c != nullptr && c->process.InOwner() ? c : nullptr;
}

// Owns `p` when this process's child arena allocated it (and forgets it).
bool TakeChildPointer(ChildArena* c, void* p) {
  std::lock_guard<std::mutex> lock(c->mu);
  return c->live.erase(p) == 1;
}

void FreeChildPointer(ChildArena* c, void* p) {
  const Status st = c->arena->Free(p);
  if (!st.ok()) std::fprintf(stderr, "spillway: freeing a CPU tensor: %s\n", st.ToString().c_str());
}

}  // namespace

void CpuRouter::FreeRouted(void* p) {
  if (Installation::Forked()) return;  // the parent's memory: the child has no mapping to free
  const Status st = Router().arena_->get()->Free(p);
  if (!st.ok()) std::fprintf(stderr, "spillway: freeing a CPU tensor: %s\n", st.ToString().c_str());
}

size_t CpuRouter::UsableBytes(void* p) { return malloc_usable_size(p); }

void CpuRouter::FreeForwarded(void* p) {
  // RawFree comes here for every pointer not in an arena: malloc_usable_size only where the
  // replaced allocator is malloc's (torch's default), as Forward counts only there.
  if (Router().next_is_default_) {
    Router().stats_.forwarded_live_bytes.fetch_sub(static_cast<int64_t>(UsableBytes(p)),
                                                   std::memory_order_relaxed);
  }
  Router().next_->raw_deleter()(p);
}

void CpuRouter::FreeInChild(void* p) {
  ChildArena* c = ThisProcessChild();
  if (c != nullptr && TakeChildPointer(c, p)) FreeChildPointer(c, p);
}

void CpuRouter::RawFree(void* p) {
  if (!Installation::Forked()) {
    if (Router().arena_->Contains(p, 1)) return FreeRouted(p);
  } else if (ChildArena* c = ThisProcessChild(); c != nullptr && TakeChildPointer(c, p)) {
    return FreeChildPointer(c, p);
  }
  // In a forked child the parent's regions are not mapped, and malloc may reuse their addresses.
  FreeForwarded(p);
}

c10::DataPtr CpuRouter::AllocateInChild(size_t n, const allocator::OwnerTag& tag) {
  ChildArena* c = ThisProcessChild();
  while (c == nullptr) {
    auto made = std::make_unique<ChildArena>();
    allocator::HostArenaOptions o;
    o.name = "child";
    o.budget_bytes = child_budget_bytes_;
    o.pin = allocator::PinMode::kPageable;
    // WIPEONFORK, not DONTFORK: in a grandchild these ranges stay mapped (zero pages, nothing
    // copied), so the grandchild's own arena cannot be placed at their addresses, and a storage
    // of ours that dies there can never name one of its live pointers.
    o.fork_safety = allocator::ForkSafety::kWipeOnFork;
    o.ledger = &made->ledger;
    Result<std::unique_ptr<allocator::HostArena>> arena = allocator::HostArena::Create(o);
    TORCH_CHECK(arena.ok(),
                "spillway: making the arena for tagged allocations in a process "
                "forked after spillway.install(): ",
                arena.status().ToString());
    made->arena = std::move(*arena);
    std::atomic<ChildArena*>& slot = Installation::Get()->child_arena();
    ChildArena* seen = slot.load(std::memory_order_acquire);
    if (seen != nullptr && seen->process.InOwner()) {
      c = seen;  // another thread of this process made it first; ours is destroyed here
    } else if (slot.compare_exchange_strong(seen, made.get(), std::memory_order_acq_rel)) {
      c = made.release();  // an ancestor's (in `seen`) is left as it is
    }
  }
  void* p = AllocatedOrThrow(c->arena->Allocate(n, tag),
                             "a CPU tensor allocation inside spillway.tag "
                             "in a forked child");
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->live.insert(p);
  }
  stats_.routed_allocations.fetch_add(1, std::memory_order_relaxed);
  stats_.routed_bytes.fetch_add(n, std::memory_order_relaxed);
  return {p, p, &FreeInChild, c10::Device(c10::DeviceType::CPU)};
}

std::optional<allocator::HostArenaStats> CpuRouter::ChildStats() {
  ChildArena* c = ThisProcessChild();
  if (c == nullptr) return std::nullopt;
  return c->arena->Stats();
}

}  // namespace spillway::torch_alloc
