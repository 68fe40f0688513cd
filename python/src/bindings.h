// The extension's binding functions, one per file of python/src, each called once from
// PYBIND11_MODULE in module.cc, and the one value they share: the module's default arena.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "spillway/torch_alloc/shared_arena.h"

namespace spillway::python {

void BindAioHandle(pybind11::module_& m);   // aio_binding.cc: spillway.aio_handle
void BindEngine(pybind11::module_& m);      // engine.cc: the libtorch trainer, for spillway.engine
void BindLogBridge(pybind11::module_& m);   // log_bridge.cc: C++ log lines into Python's logging
void BindNode(pybind11::module_& m);        // py_node.cc: the node governor
void BindOptim(pybind11::module_& m);       // optim.cc: the fused host AdamW pass
void BindSwapStore(pybind11::module_& m);   // swap_store.cc: DeepSpeed's swap files on NVMe
void BindTorchAlloc(pybind11::module_& m);  // bind_torch_alloc.cc: torch's host allocators

// `arena`, or (null) the module's default pinned arena, made on first use in each process
// (bind_torch_alloc.cc). Called with the GIL held.
std::shared_ptr<torch_alloc::SharedArena> ArenaOrDefault(
    std::shared_ptr<torch_alloc::SharedArena> arena);

}  // namespace spillway::python
