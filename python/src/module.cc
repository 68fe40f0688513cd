// The `spillway._spillway` extension: its exception classes, one per StatusCode, and the bindings
// of each library, one file each (bind_<library>.cc, declared in bindings.h). The pure-Python parts
// (spillway.deepspeed, spillway.metrics, ...) live in python/spillway/.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "bindings.h"
#include "errors.h"

namespace py = pybind11;
using namespace spillway;
using python::ExceptionTypes;

PYBIND11_MODULE(_spillway, m) {
  m.doc() = "Spillway: host-memory and NVMe offload for large-model training (C++ core)";
  py::module_ builtins = py::module_::import("builtins");
  py::object base = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
  py::object error =
      py::reinterpret_steal<py::object>(PyErr_NewException("spillway.Error", base.ptr(), nullptr));
  m.attr("Error") = error;
  auto make = [&](const char* name, StatusCode code, PyObject* extra) {
    py::tuple bases = extra != nullptr ? py::tuple(py::make_tuple(error, py::handle(extra)))
                                       : py::tuple(py::make_tuple(error));
    py::object cls = py::reinterpret_steal<py::object>(
        PyErr_NewException(StrCat("spillway.", name).c_str(), bases.ptr(), nullptr));
    m.attr(name) = cls;
    ExceptionTypes()[code] = cls;
  };
  make("InvalidArgument", StatusCode::kInvalidArgument, PyExc_ValueError);
  make("FailedPrecondition", StatusCode::kFailedPrecondition, nullptr);
  {
    // Also a torch.OutOfMemoryError: code that catches torch's OOM around an allocation that
    // spillway.install() now serves keeps catching it (docs/deepspeed.md).
    py::object torch_oom = py::module_::import("torch").attr("OutOfMemoryError");
    py::tuple bases = py::make_tuple(error, torch_oom, py::handle(PyExc_MemoryError));
    py::object cls = py::reinterpret_steal<py::object>(
        PyErr_NewException("spillway.OverBudget", bases.ptr(), nullptr));
    m.attr("OverBudget") = cls;
    ExceptionTypes()[StatusCode::kOverBudget] = cls;
  }
  make("OutOfMemory", StatusCode::kOutOfMemory, PyExc_MemoryError);
  make("IoError", StatusCode::kIoError, PyExc_OSError);
  make("NoSpace", StatusCode::kNoSpace, PyExc_OSError);
  make("ChecksumMismatch", StatusCode::kChecksumMismatch, nullptr);
  make("Unavailable", StatusCode::kUnavailable, nullptr);
  make("Escaped", StatusCode::kEscaped, nullptr);
  make("InternalError", StatusCode::kInternal, nullptr);
  make("ResourceExhausted", StatusCode::kResourceExhausted, nullptr);
  make("ExternalError", StatusCode::kExternal, nullptr);

  // HostArena first: the others' signatures name it.
  python::BindTorchAlloc(m);
  python::BindBase(m);
  python::BindAllocator(m);
  python::BindAio(m);
  python::BindOffload(m);
  python::BindEngine(m);
  python::BindMetrics(m);
  python::BindTrainer(m);
}
