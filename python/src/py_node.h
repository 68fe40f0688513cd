// The node governor's Python binding (py_node.cc).
#pragma once

#include <pybind11/pybind11.h>

namespace spillway::python {

void BindNode(pybind11::module_& m);

}  // namespace spillway::python
