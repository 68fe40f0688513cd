// spillway.aio_handle: the binding of spillway::aio::AioHandle, DeepSpeed's aio_handle contract on
// Spillway's I/O engine (Note [aio_handle] in docs/aio.md).
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <memory>

#include "py_arena.h"

namespace spillway::python {

// Defines spillway._spillway.aio_handle. `arena_or_default` maps the `arena=` argument (None: the
// module's default pinned arena) to the arena its locked tensors come from.
void BindAioHandle(
    pybind11::module_& m,
    std::function<std::shared_ptr<PyArena>(std::shared_ptr<PyArena>)> arena_or_default);

}  // namespace spillway::python
