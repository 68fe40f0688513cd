// The `spillway._spillway` extension: the exceptions, the base and metrics functions, and the
// bindings of the parts in their own files (bindings.h).
// Pure-Python parts (exceptions, spillway.deepspeed, spillway.metrics) live in python/spillway/.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "errors.h"
#include "spillway/allocator/crc32c.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/ledger.h"
#include "spillway/base/log.h"
#include "spillway/metrics/exporter.h"
#include "spillway/torch_alloc/shared_arena.h"

namespace py = pybind11;
using namespace spillway;
using python::Check;
using python::ExceptionTypes;
using python::Raise;

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

  m.def(
      "set_log_level",
      [](const std::string& level) {
        const std::optional<LogLevel> l = ParseLogLevel(level);
        if (!l)
          Raise(Status::InvalidArgument(
              StrCat("set_log_level('", level, "'): use error, warning, info or debug")));
        SetLogLevel(*l);
      },
      "What Spillway's C++ core logs from now on (default: SPILLWAY_LOG, else warning).");
  python::BindLogBridge(m);
  m.def(
      "memory_limit_bytes", [] { return allocator::MemoryLimitBytes(); },
      "Physical memory, lowered by this process's cgroup limit (memory.max) where one is set.");
  m.def(
      "default_host_budget", [] { return allocator::DefaultHostBudget(); },
      "3/4 of memory_limit_bytes(): what spillway.install()'s two arenas share by default.");

  m.def(
      "crc32c",
      [](const py::object& data, uint32_t crc) {
        // A contiguous buffer only (PyBUF_SIMPLE): a strided view would be summed in the wrong
        // order. The GIL is released while it runs; the view keeps the memory alive.
        Py_buffer view;
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
        std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> release(&view, PyBuffer_Release);
        py::gil_scoped_release unlocked;
        return allocator::Crc32cExtend(crc, view.buf, static_cast<size_t>(view.len));
      },
      py::arg("data"), py::arg("crc") = 0,
      "The CRC32C of `data` (a contiguous buffer) continuing `crc`: crc32c(b, crc32c(a)) == "
      "crc32c(a + b).");
  python::BindAioHandle(m);

  py::class_<metrics::Exporter>(m, "Exporter")
      .def_property_readonly("port", &metrics::Exporter::port)
      .def_property_readonly("address", &metrics::Exporter::address)
      .def("render", &metrics::Exporter::Render)
      .def(
          "watch",
          [](metrics::Exporter& e, std::shared_ptr<torch_alloc::SharedArena> a) {
            e.Watch(a->get());
            e.Watch(&a->ledger());
          },
          py::keep_alive<1, 2>())
      .def("_watch_node", [](metrics::Exporter& e) {
        // The exporter holds a raw pointer: every governor it watches is kept for the life of
        // the process (one per join, at most a few).
        static auto* kept = new std::vector<std::shared_ptr<allocator::NodeGovernor>>();
        std::shared_ptr<allocator::NodeGovernor> g = allocator::NodeGovernor::Current();
        if (g == nullptr) return false;
        kept->push_back(g);
        e.Watch(g.get());
        return true;
      });
  python::BindEngine(m);
  python::BindNode(m);
  python::BindOptim(m);
  python::BindSwapStore(m);
  python::BindTorchAlloc(m);
  m.def(
      "_serve",
      [](const std::string& address, const std::map<std::string, std::string>& labels) {
        metrics::ExporterOptions o;
        o.address = address;
        o.const_labels.assign(labels.begin(), labels.end());
        return std::unique_ptr<metrics::Exporter>(Check(metrics::Exporter::Start(o)).release());
      },
      py::arg("address"), py::arg("labels") = std::map<std::string, std::string>{});
}
