// Spillway under torch's two host allocators (Note [Torch allocators] in docs/deepspeed.md):
//  - a CPU allocator router (c10::SetCPUAllocator) that serves allocations made inside a tag scope
//    from a pageable, MADV_DONTFORK, budgeted arena and forwards every other one to the allocator
//    it replaced;
//  - a pinned host allocator (at::setHostAllocator for CUDA): every pin_memory(), pinned empty()
//  and
//    non_blocking D2H output from a pinned arena, exact size, with a block's reuse deferred until
//    the events recorded on it have completed.
// Tag scopes ride on c10::ThreadLocalDebugInfo, which torch carries into autograd's worker threads.
#pragma once

#include <pybind11/pybind11.h>

namespace spillway::python {

// Defines spillway._spillway's install/tag/pinned functions (called from PYBIND11_MODULE).
void BindTorchAllocators(pybind11::module_& m);

}  // namespace spillway::python
