// DeepSpeed's swap files in Spillway's NVMe arena (swap_store.cc).
#pragma once

#include <pybind11/pybind11.h>

namespace spillway::python {

void BindSwapStore(pybind11::module_& m);

}  // namespace spillway::python
