// Spillway's C++ log lines into Python's `logging` (logger "spillway"): python/src/log_bridge.cc.
#pragma once

#include <pybind11/pybind11.h>

namespace spillway::python {

void BindLogBridge(pybind11::module_& m);

}  // namespace spillway::python
