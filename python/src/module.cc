// The `spillway._spillway` extension: Spillway's host arena for Python, the exceptions, and the
// bindings of the parts in their own files (aio_binding.cc, torch_allocators.cc, engine.cc).
// Pure-Python parts (exceptions, spillway.deepspeed, spillway.metrics) live in python/spillway/.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "aio_binding.h"
#include "errors.h"
#include "log_bridge.h"
#include "py_arena.h"
#include "py_node.h"
#include "spillway/allocator/crc32c.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/ledger.h"
#include "spillway/base/log.h"
#include "spillway/metrics/exporter.h"
#include "swap_store.h"
#include "torch_allocators.h"

namespace py = pybind11;
using namespace spillway;
using allocator::HostArena;
using python::Check;
using python::ExceptionTypes;
using python::KindBytesDict;
using python::PyArena;
using python::Raise;

namespace {

py::dict ArenaStats(PyArena& a) {
  const allocator::HostArenaStats s = a.get()->Stats();
  py::dict d;
  d["name"] = a.name();
  d["pin_mode"] = allocator::PinModeName(s.pin_mode);
  d["fork_safety"] = allocator::ForkSafetyName(s.fork_safety);
  d["budget_bytes"] = s.budget_bytes;
  d["live_bytes"] = s.live_bytes;
  d["live_allocations"] = s.live_allocations;
  d["live_by_kind"] = KindBytesDict(s.live_by_kind);
  d["committed_bytes"] = s.committed_bytes;
  d["peak_committed_bytes"] = s.peak_committed_bytes;
  d["retained_bytes"] = s.retained_bytes;
  d["pinned_bytes"] = s.pinned_bytes;
  d["regions"] = s.regions;
  d["over_budget_count"] = s.over_budget_count;
  d["escape_count"] = s.escape_count;
  return d;
}

py::dict ReportToDict(const allocator::BoundaryReport& r) {
  py::dict d;
  d["kind"] = r.kind == allocator::BoundaryKind::kEpoch ? "epoch" : "step";
  d["epoch"] = r.epoch;
  d["step"] = r.step;
  d["live_bytes"] = r.live_bytes();
  d["escape_count"] = r.escape_count();
  d["escaped_bytes"] = r.escaped_bytes();
  d["clean"] = r.clean();
  d["text"] = r.ToString();
  return d;
}

std::shared_ptr<PyArena>& DefaultArena() {
  static auto* arena = new std::shared_ptr<PyArena>();
  return *arena;
}

// The default arena is per process: a forked child that makes an aio handle (DeepSpeed's test
// harness, fork-start pools) gets one of its own, made on first use; the parent's arenas refuse
// there (Note [Fork] in docs/allocator.md). Called with the GIL held.
std::shared_ptr<PyArena> ArenaOrDefault(std::shared_ptr<PyArena> arena) {
  if (arena) return arena;
  auto& d = DefaultArena();
  if (d && !d->made_in_this_process()) {
    // The parent's: never destroyed in the child (its destructor would take the parent's locks).
    new std::shared_ptr<PyArena>(std::move(d));
    d = nullptr;
  }
  if (!d)
    d = std::make_shared<PyArena>(0, allocator::PinMode::kAuto, allocator::EscapePolicy::kReport,
                                  "python", nullptr);
  return d;
}

}  // namespace

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

  py::class_<PyArena, std::shared_ptr<PyArena>>(m, "HostArena")
      .def(py::init([](uint64_t budget_bytes, bool pinned, const std::string& policy,
                       const std::string& name, std::shared_ptr<PyArena> share_ledger_with) {
             const allocator::EscapePolicy p = Check(allocator::ParseEscapePolicy(policy));
             if (p == allocator::EscapePolicy::kReclaim) {
               // Reclaim frees escaped allocations at a boundary; a Python tensor may still view
               // one.
               Raise(Status::InvalidArgument(
                   "HostArena(policy='reclaim'): a boundary would free memory that a live torch "
                   "tensor "
                   "may still view. Use policy='report' (list escapes) or 'fail' (raise Escaped)"));
             }
             return std::make_shared<PyArena>(
                 budget_bytes, pinned ? allocator::PinMode::kAuto : allocator::PinMode::kPageable,
                 p, name, share_ledger_with);
           }),
           py::arg("budget_bytes") = 0, py::arg("pinned") = true, py::arg("policy") = "report",
           py::arg("name") = "python", py::arg("share_ledger_with") = nullptr)
      .def(
          "empty",
          [](PyArena& a, std::vector<int64_t> shape, py::object dtype, const std::string& kind,
             const std::string& lifetime, uint64_t owner) {
            const c10::ScalarType st = dtype.is_none()
                                           ? c10::ScalarType::Float
                                           : torch::python::detail::py_object_to_dtype(dtype);
            return a.Empty(shape, st, Check(allocator::ParseKind(kind)),
                           Check(allocator::ParseLifetime(lifetime)), owner);
          },
          py::arg("shape"), py::arg("dtype") = py::none(), py::arg("kind") = "transient",
          py::arg("lifetime") = "step", py::arg("owner") = 0)
      .def("owns", &PyArena::Owns)
      .def(
          "contains",
          [](const PyArena& a, uint64_t ptr, uint64_t bytes) {
            return a.Contains(reinterpret_cast<const void*>(ptr), bytes);
          },
          py::arg("ptr"), py::arg("nbytes"))
      .def_property_readonly("name", &PyArena::name)
      .def("stats", &ArenaStats)
      .def("trim",
           [](PyArena& a) {
             py::gil_scoped_release nogil;
             return a.get()->Trim();
           })
      .def("_begin_epoch", [](PyArena& a, int64_t e) { Check(a.ledger().BeginEpoch(e)); })
      .def("_end_epoch",
           [](PyArena& a) {
             allocator::BoundaryReport r;
             Check(a.ledger().EndEpoch(&r));
             return ReportToDict(r);
           })
      .def("_begin_step", [](PyArena& a, int64_t s) { Check(a.ledger().BeginStep(s)); })
      .def("_end_step", [](PyArena& a) {
        allocator::BoundaryReport r;
        Check(a.ledger().EndStep(&r));
        return ReportToDict(r);
      });
  m.def("default_arena", [] { return ArenaOrDefault(nullptr); });
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
  python::BindAioHandle(m, [](std::shared_ptr<PyArena> a) { return ArenaOrDefault(std::move(a)); });

  py::class_<metrics::Exporter>(m, "Exporter")
      .def_property_readonly("port", &metrics::Exporter::port)
      .def_property_readonly("address", &metrics::Exporter::address)
      .def("render", &metrics::Exporter::Render)
      .def(
          "watch",
          [](metrics::Exporter& e, std::shared_ptr<PyArena> a) {
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
  python::BindTorchAllocators(m);
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
