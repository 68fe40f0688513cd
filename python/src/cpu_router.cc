// The router's frees: routed storages back to the arena, raw frees by where the pointer lives.
#include "cpu_router.h"

#include <cstdio>

namespace spillway::python::torch_alloc {

CpuRouter* g_router = nullptr;

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

}  // namespace spillway::python::torch_alloc
