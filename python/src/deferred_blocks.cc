// The blocks' deleter and the arena allocation every torch-facing allocator shares.
#include "deferred_blocks.h"

#include <c10/util/Exception.h>

#include "spillway/base/status.h"

namespace spillway::python::torch_alloc {

void ReleaseBlock(void* ctx) {
  if (ctx != nullptr) Blocks::Get().Release(static_cast<Block*>(ctx));
}

void* ArenaAllocate(PyArena& arena, uint64_t bytes, const allocator::OwnerTag& tag,
                    const char* what) {
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

}  // namespace spillway::python::torch_alloc
