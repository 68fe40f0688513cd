// The process's deferred-block table on torch's events (blocks.h): recording and describing events,
// the blocks' deleter, and the arena allocation the torch-facing allocators share.
#include "spillway/torch_alloc/blocks.h"

#include <c10/core/Event.h>
#include <c10/util/Exception.h>

#include <memory>

#include "spillway/torch_alloc/installation.h"

namespace spillway::torch_alloc {

TorchEvents::Event TorchEvents::Record(const Stream& stream) {
  if (manual_.load(std::memory_order_acquire)) {
    const uint64_t mine = ++manual_recorded_;
    return [this, mine] { return manual_completed_.load(std::memory_order_acquire) >= mine; };
  }
  auto event = std::make_shared<c10::Event>(stream.device_type());
  event->record(stream);
  return [event] { return event->query(); };
}

std::string TorchEvents::Describe(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

void ReleaseBlock(void* ctx) {
  if (ctx != nullptr) Blocks::ForThisProcess().Release(static_cast<TorchBlock*>(ctx));
}

void* ArenaAllocate(SharedArena& arena, uint64_t bytes, const allocator::OwnerTag& tag,
                    const char* what) {
  TORCH_CHECK(!Installation::Forked(), "spillway: ", what, " of ", bytes,
              " bytes in a process forked after spillway.install(): the pinned arena and the "
              "arenas made before the fork are the parent's, and their memory is not mapped in a "
              "forked child (MADV_DONTFORK). Make pinned memory in the parent, or start the "
              "process with the 'spawn' start method (CUDA cannot run in a forked child either)");
  Result<void*> r = arena.get()->Allocate(bytes, tag);
  // Parked blocks hold budget until their copies end: give back what has ended and try once more.
  if (!r.ok() && r.status().code() == StatusCode::kOverBudget &&
      Blocks::ForThisProcess().Poll() > 0) {
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

}  // namespace spillway::torch_alloc
