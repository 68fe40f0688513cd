// spillway._spillway's bindings of spillway::torch_alloc (torch_alloc/): HostArena (a
// SharedArena and its tensors), tag scopes, installing torch's two host allocators, their stats,
// and the test seams that reach torch's pinned allocator on machines without a GPU.
#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "errors.h"
#include "spillway/allocator/fork_fault.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/owner.h"
#include "spillway/torch_alloc/blocks.h"
#include "spillway/torch_alloc/cpu_router.h"
#include "spillway/torch_alloc/installation.h"
#include "spillway/torch_alloc/pinned_allocator.h"
#include "spillway/torch_alloc/shared_arena.h"
#include "spillway/torch_alloc/tag_scope.h"
#include "spillway/torch_alloc/tensors.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

using torch_alloc::Blocks;
using torch_alloc::BlockStats;
using torch_alloc::CpuRouter;
using torch_alloc::CurrentCudaHostAllocator;
using torch_alloc::Installation;
using torch_alloc::SharedArena;
using torch_alloc::TagScope;

at::HostAllocator* CudaHostAllocatorOrRaise() {
  at::HostAllocator* a = CurrentCudaHostAllocator();
  if (a == nullptr)
    Raise(Status::FailedPrecondition("no pinned host allocator is registered for CUDA"));
  return a;
}

py::dict ArenaStats(SharedArena& a) {
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

py::dict BlockStatsDict(bool pinned_only) {
  const BlockStats s = Blocks::ForThisProcess().Stats(pinned_only);
  py::dict d;
  d["live_blocks"] = s.live_blocks;
  d["live_bytes"] = s.live_bytes;
  d["deferred_blocks"] = s.deferred_blocks;
  d["deferred_bytes"] = s.deferred_bytes;
  d["peak_live_bytes"] = s.peak_live_bytes;
  d["allocations_total"] = s.allocations_total;
  d["allocated_bytes_total"] = s.allocated_bytes_total;
  d["freed_bytes_total"] = s.freed_bytes_total;
  d["events_recorded_total"] = s.events_recorded_total;
  d["deferred_frees_total"] = s.deferred_frees_total;
  d["foreign_record_events_total"] = s.foreign_record_events_total;
  d["graph_held_blocks"] = s.graph_held_blocks;
  d["graph_held_bytes"] = s.graph_held_bytes;
  d["event_errors_total"] = s.event_errors_total;
  return d;
}

std::shared_ptr<SharedArena>& DefaultArena() {
  static auto* arena = new std::shared_ptr<SharedArena>();
  return *arena;
}

}  // namespace

// The default arena is per process: a forked child that makes an aio handle (DeepSpeed's test
// harness, fork-start pools) gets one of its own, made on first use; the parent's arenas refuse
// there (Note [Fork] in docs/allocator.md). Called with the GIL held.
std::shared_ptr<SharedArena> ArenaOrDefault(std::shared_ptr<SharedArena> arena) {
  if (arena) return arena;
  auto& d = DefaultArena();
  if (d && !d->made_in_this_process()) {
    // The parent's: never destroyed in the child (its destructor would take the parent's locks).
    new std::shared_ptr<SharedArena>(std::move(d));
    d = nullptr;
  }
  if (!d) {
    torch_alloc::SharedArenaOptions o;
    o.name = "python";
    d = Check(SharedArena::Create(o));
  }
  return d;
}

void BindTorchAlloc(py::module_& m) {
  py::class_<SharedArena, std::shared_ptr<SharedArena>>(m, "HostArena")
      .def(py::init([](uint64_t budget_bytes, bool pinned, const std::string& policy,
                       const std::string& name, std::shared_ptr<SharedArena> share_ledger_with,
                       double peak_slack) {
             const allocator::EscapePolicy p = Check(allocator::ParseEscapePolicy(policy));
             if (p == allocator::EscapePolicy::kReclaim) {
               // Reclaim frees escaped allocations at a boundary; a Python tensor may still view
               // one.
               Raise(Status::InvalidArgument(
                   "HostArena(policy='reclaim'): a boundary would free memory that a live torch "
                   "tensor "
                   "may still view. Use policy='report' (list escapes) or 'fail' (raise Escaped)"));
             }
             torch_alloc::SharedArenaOptions o;
             o.name = name;
             o.budget_bytes = budget_bytes;
             o.pin = pinned ? allocator::PinMode::kAuto : allocator::PinMode::kPageable;
             o.policy = p;
             o.peak_slack = peak_slack;
             return Check(SharedArena::Create(o, share_ledger_with));
           }),
           py::arg("budget_bytes") = 0, py::arg("pinned") = true, py::arg("policy") = "report",
           py::arg("name") = "python", py::arg("share_ledger_with") = nullptr,
           py::arg("peak_slack") = allocator::HostArenaOptions{}.peak_slack)
      .def(
          "empty",
          [](const std::shared_ptr<SharedArena>& a, std::vector<int64_t> shape, py::object dtype,
             const std::string& kind, const std::string& lifetime, uint64_t owner) {
            const c10::ScalarType st = dtype.is_none()
                                           ? c10::ScalarType::Float
                                           : torch::python::detail::py_object_to_dtype(dtype);
            const allocator::OwnerTag tag{Check(allocator::ParseKind(kind)),
                                          Check(allocator::ParseLifetime(lifetime)), owner,
                                          allocator::kProcessScope, "python"};
            Result<torch::Tensor> t = [&] {
              py::gil_scoped_release nogil;  // mapping and pinning a region are syscalls
              return torch_alloc::EmptyTensor(a, shape, st, tag);
            }();
            return Check(std::move(t));
          },
          py::arg("shape"), py::arg("dtype") = py::none(), py::arg("kind") = "transient",
          py::arg("lifetime") = "step", py::arg("owner") = 0)
      .def("owns", [](const SharedArena& a,
                      const torch::Tensor& t) { return torch_alloc::ArenaOwns(a, t); })
      .def(
          "contains",
          [](const SharedArena& a, uint64_t ptr, uint64_t bytes) {
            return a.Contains(reinterpret_cast<const void*>(ptr), bytes);
          },
          py::arg("ptr"), py::arg("nbytes"))
      .def_property_readonly("name", &SharedArena::name)
      .def("stats", &ArenaStats)
      .def("trim",
           [](SharedArena& a) {
             py::gil_scoped_release nogil;
             return a.get()->Trim();
           })
      .def("_begin_epoch", [](SharedArena& a, int64_t e) { Check(a.ledger().BeginEpoch(e)); })
      .def("_end_epoch",
           [](SharedArena& a) {
             allocator::BoundaryReport r;
             Check(a.ledger().EndEpoch(&r));
             return ReportToDict(r);
           })
      .def("_begin_step", [](SharedArena& a, int64_t s) { Check(a.ledger().BeginStep(s)); })
      .def("_end_step", [](SharedArena& a) {
        allocator::BoundaryReport r;
        Check(a.ledger().EndStep(&r));
        return ReportToDict(r);
      });
  m.def("default_arena", [] { return ArenaOrDefault(nullptr); });

  m.attr("_torch_version_built") = TORCH_VERSION;

  // Tag scopes. Python's spillway.tag() wraps these.
  py::class_<TagScope, std::shared_ptr<TagScope>>(m, "_TagScope")
      .def_property_readonly("label", [](const TagScope& s) { return s.label; });
  m.def("_enter_tag", [](const std::string& kind, const std::string& lifetime, uint64_t owner) {
    return Check(torch_alloc::EnterTag(kind, lifetime, owner));
  });
  m.def("_exit_tag",
        [](const std::shared_ptr<TagScope>& scope) { Check(torch_alloc::ExitTag(scope)); });
  m.def("_current_tag", []() -> py::object {
    const TagScope* s = torch_alloc::CurrentTag();
    if (s == nullptr) return py::none();
    return py::str(s->label);
  });
  m.def("_forked_after_install", [] { return Installation::Forked(); });

  m.def("_install", [](std::shared_ptr<SharedArena> host, std::shared_ptr<SharedArena> pinned,
                       uint64_t small_bytes, int priority) {
    Check(Installation::Install(std::move(host), std::move(pinned), small_bytes, priority));
  });
  m.def("_installed", [] { return Installation::Installed(); });
  m.def("_router_stats", [] {
    py::dict d;
    if (!Installation::Installed()) return d;
    const CpuRouter& router = Installation::Get()->router();
    d["routed_allocations"] = router.stats().routed_allocations.load();
    d["routed_bytes"] = router.stats().routed_bytes.load();
    d["small_forwarded"] = router.stats().small_forwarded.load();
    d["forwarded_live_bytes"] = std::max<int64_t>(0, router.stats().forwarded_live_bytes.load());
    d["small_bytes"] = router.small_bytes();
    // A process forked after install(): its own arena for tagged allocations, once it made one.
    if (auto child = CpuRouter::ChildStats()) {
      d["child_live_bytes"] = child->live_bytes;
      d["child_live_allocations"] = child->live_allocations;
      d["child_committed_bytes"] = child->committed_bytes;
      d["child_budget_bytes"] = child->budget_bytes;
    }
    return d;
  });
  // Puts the handler that names a fault on a MADV_DONTFORK page back in front (a DataLoader worker
  // replaces the one its fork installed; Note [Fork fault]).
  m.def("_fork_fault_rearm", [] { allocator::fork_fault::Rearm(); });
  m.def("_fork_fault_stats", [] {
    const allocator::fork_fault::Stats s = allocator::fork_fault::Snapshot();
    py::dict d;
    d["regions"] = s.regions;
    d["unnamed"] = s.unnamed;
    d["armed"] = s.armed;
    return d;
  });
  m.def("_pinned_stats", [] { return BlockStatsDict(/*pinned_only=*/true); });
  m.def("_block_stats", [] { return BlockStatsDict(/*pinned_only=*/false); });
  // Whether torch's current allocators are Spillway's (what `spillway.installed()` reports).
  m.def("_torch_allocators_are_spillways", [] {
    const Installation::Current ours = Installation::TorchAllocatorsAreOurs();
    return py::make_tuple(ours.cpu, ours.pinned);
  });

  // Through torch's registry, as torch itself calls it: on a machine without a GPU, pin_memory()
  // cannot run, so the tests reach the pinned allocator here.
  m.def("_host_allocator_empty", [](int64_t bytes) {
    if (bytes < 0)
      Raise(Status::InvalidArgument(StrCat("_host_allocator_empty(", bytes, "): negative size")));
    at::HostAllocator* a = CudaHostAllocatorOrRaise();
    return torch_alloc::TensorOver(a->allocate(static_cast<size_t>(bytes)), bytes, a);
  });
  m.def("_host_allocator_record_event", [](const torch::Tensor& t) {
    at::HostAllocator* a = CudaHostAllocatorOrRaise();
    const c10::DataPtr& d = t.storage().data_ptr();
    return a->record_event(d.get(), d.get_context(),
                           c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)));
  });
  m.def("_host_allocator_empty_cache", [] {
    if (at::HostAllocator* a = CurrentCudaHostAllocator()) a->empty_cache();
  });
  m.def("_host_allocator_pool", [](const std::string& what, int64_t a, int64_t b) {
    at::HostAllocator* h = CudaHostAllocatorOrRaise();
    const c10::MempoolId_t id{static_cast<c10::CaptureId_t>(a), static_cast<c10::CaptureId_t>(b)};
    if (what == "begin")
      h->begin_allocate_to_pool(id, [](c10::Stream) { return true; });
    else if (what == "end")
      h->end_allocate_to_pool(id);
    else if (what == "release")
      h->release_pool(id);
    else
      Raise(Status::InvalidArgument("_host_allocator_pool: begin, end or release"));
  });
  m.def("_host_allocator_stats", [] {
    at::HostAllocator* a = CurrentCudaHostAllocator();
    py::dict d;
    if (a == nullptr) return d;
    const at::HostStats s = a->get_stats();
    d["active_requests"] = s.active_requests.current;
    d["active_bytes"] = s.active_bytes.current;
    d["allocations"] = s.allocations.current;
    d["allocated_bytes"] = s.allocated_bytes.current;
    d["num_host_alloc"] = s.num_host_alloc;
    d["num_host_free"] = s.num_host_free;
    return d;
  });
  // Test seam (docs/deepspeed.md, Note [Deferred free]): without a GPU no copy is ever in flight,
  // so tests stand in for one with events that complete when they say.
  m.def("_testing_manual_events", [](bool on) { Blocks::ForThisProcess().traits().SetManual(on); });
  m.def("_testing_complete_events", [] { Blocks::ForThisProcess().traits().CompleteManual(); });
  m.def("_poll_deferred", [] { return Blocks::ForThisProcess().Poll(); });
  // For bench/compare_torch_allocators.py: nanoseconds per allocate + free pair through torch's
  // current CPU allocator, timed in C++ so the interpreter's overhead does not hide the
  // allocator's.
  m.def("_time_cpu_allocator", [](uint64_t bytes, uint64_t iters) {
    py::gil_scoped_release nogil;
    c10::Allocator* a = c10::GetCPUAllocator();
    const auto t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < iters; ++i) {
      c10::DataPtr d = a->allocate(bytes);
      if (d.get() == nullptr && bytes != 0) std::abort();
    }
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(iters);
  });
}

}  // namespace spillway::python
