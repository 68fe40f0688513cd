// The extension's binding functions, one per library and file of python/src (bind_<library>.cc),
// each called once from PYBIND11_MODULE in module.cc, and the one value they share: the module's
// default arena.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "spillway/torch_alloc/shared_arena.h"

namespace spillway::python {

void BindBase(pybind11::module_& m);        // bind_base.cc: logging, C++ log lines into Python's
void BindAllocator(pybind11::module_& m);   // bind_allocator.cc: the node governor, crc32c, limits
void BindAio(pybind11::module_& m);         // bind_aio.cc: aio_handle, DeepSpeed's swap store
void BindOffload(pybind11::module_& m);     // bind_offload.cc: the planner, for node admission
void BindEngine(pybind11::module_& m);      // bind_engine.cc: the fused host AdamW pass
void BindMetrics(pybind11::module_& m);     // bind_metrics.cc: the Prometheus exporter
void BindTorchAlloc(pybind11::module_& m);  // bind_torch_alloc.cc: torch's host allocators
void BindTrainer(pybind11::module_& m);  // bind_trainer.cc: the libtorch trainer (spillway.trainer)

// `arena`, or (null) the module's default pinned arena, made on first use in each process
// (bind_torch_alloc.cc). Called with the GIL held.
std::shared_ptr<torch_alloc::SharedArena> ArenaOrDefault(
    std::shared_ptr<torch_alloc::SharedArena> arena);

}  // namespace spillway::python
