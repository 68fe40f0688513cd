// Installing Spillway as torch's CPU allocator (cpu_router.h) and pinned host allocator
// (pinned_allocator.h), and their Python bindings. Note [Torch allocators] in docs/deepspeed.md has
// the design; the summary is in torch_allocators.h.
#include "torch_allocators.h"

#include <ATen/TensorUtils.h>
#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <pthread.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cpu_router.h"
#include "deferred_blocks.h"
#include "errors.h"
#include "pinned_allocator.h"
#include "py_arena.h"
#include "spillway/allocator/fork_fault.h"
#include "spillway/allocator/owner.h"
#include "tag_scope.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

using allocator::Kind;
using allocator::Lifetime;
using allocator::OwnerTag;
using torch_alloc::Blocks;
using torch_alloc::BlockStats;
using torch_alloc::CpuRouter;
using torch_alloc::CurrentTag;
using torch_alloc::Forked;
using torch_alloc::g_open_scopes;
using torch_alloc::g_router;
using torch_alloc::g_tag_serial;
using torch_alloc::kTagKind;
using torch_alloc::PinnedAllocator;
using torch_alloc::TagScope;

// The process install() ran in (null before): in a child made by fork() after install, the
// arenas' regions are MADV_DONTFORK, so the child has no mapping of them. It must neither allocate
// from nor free into them. Set once, never freed.
std::atomic<const allocator::ProcessTag*> g_installed_in{nullptr};

}  // namespace

bool torch_alloc::Forked() {
  const allocator::ProcessTag* tag = g_installed_in.load(std::memory_order_acquire);
  return tag != nullptr && !tag->InOwner();
}

namespace {

// The pinned allocator, once installed; like the router it lives for the rest of the process
// (torch keeps raw pointers).
PinnedAllocator* g_pinned = nullptr;
bool g_installed = false;  // both registrations took

at::HostAllocator* CurrentCudaHostAllocator() {
  try {
    return at::getHostAllocator(at::kCUDA);
  } catch (const c10::Error&) {
    return nullptr;  // a CPU-only torch has none registered
  }
}

Status Install(std::shared_ptr<PyArena> host, std::shared_ptr<PyArena> pinned, uint64_t small_bytes,
               uint8_t priority) {
  if (g_installed) {
    return Status::FailedPrecondition(
        "spillway.install() already ran in this process: torch's allocators are Spillway's; "
        "use spillway.installed() to get its arenas instead of installing again");
  }
  if (g_router != nullptr) {
    return Status::FailedPrecondition(
        "an earlier spillway.install() in this process failed (its error named the allocator that "
        "kept its place); start a new process to install again");
  }
  if (Forked()) {
    return Status::FailedPrecondition(
        "spillway.install() in a forked child: install in the parent");
  }
  if (small_bytes == 0) {
    return Status::InvalidArgument("spillway.install(small_bytes=0): must be at least 1 byte");
  }
  SPILLWAY_RETURN_IF_ERROR(allocator::ForkTracking().WithContext("spillway.install()"));
  g_installed_in.store(new allocator::ProcessTag(), std::memory_order_release);
  c10::Allocator* const previous_cpu = c10::GetCPUAllocator();
  // Published before torch can call them: once SetCPUAllocator returns, other threads may already
  // allocate, and raw frees read g_router. Never destroyed (torch keeps the raw pointers).
  g_router = new CpuRouter(previous_cpu, std::move(host), small_bytes);
  g_pinned = new PinnedAllocator(CurrentCudaHostAllocator(), std::move(pinned));
  c10::SetCPUAllocator(g_router, priority);
  if (c10::GetCPUAllocator() != g_router) {
    return Status::FailedPrecondition(StrCat(
        "spillway.install(): torch kept its CPU allocator; another one is registered at a priority "
        "above ",
        static_cast<int>(priority),
        ". Pass a higher priority= to spillway.install(). Nothing "
        "was installed"));
  }
  at::setHostAllocator(at::kCUDA, g_pinned, priority);
  if (CurrentCudaHostAllocator() != g_pinned) {
    c10::SetCPUAllocator(previous_cpu, priority);  // the router keeps serving what it handed out
    return Status::FailedPrecondition(StrCat(
        "spillway.install(): torch kept its pinned host allocator; another one is registered at a "
        "priority above ",
        static_cast<int>(priority),
        ". Pass a higher priority= to "
        "spillway.install(). Nothing was installed"));
  }
  g_installed = true;
  return Status::Ok();
}

// A uint8 CPU tensor over a DataPtr (pinned blocks for the tests that cannot call pin_memory()).
torch::Tensor TensorOver(at::DataPtr data, int64_t bytes, c10::Allocator* alloc) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), alloc, false);
  return torch::empty({0}, torch::kUInt8).set_(storage, 0, {bytes}, {1});
}

py::dict BlockStatsDict(bool pinned_only) {
  const BlockStats s = Blocks::Get().Stats(pinned_only);
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

}  // namespace

void BindTorchAllocators(py::module_& m) {
  m.attr("_torch_version_built") = TORCH_VERSION;

  // Tag scopes. Python's spillway.tag() wraps these.
  py::class_<TagScope, std::shared_ptr<TagScope>>(m, "_TagScope")
      .def_property_readonly("label", [](const TagScope& s) { return s.label; });
  m.def("_enter_tag", [](const std::string& kind, const std::string& lifetime, uint64_t owner) {
    auto scope = std::make_shared<TagScope>();
    scope->tag =
        OwnerTag{Check(allocator::ParseKind(kind)), Check(allocator::ParseLifetime(lifetime)),
                 owner, allocator::kProcessScope, "spillway.tag"};
    scope->label = StrCat(kind, "/", lifetime);
    scope->serial = ++g_tag_serial;
    c10::ThreadLocalDebugInfo::_push(kTagKind, scope);
    g_open_scopes.fetch_add(1, std::memory_order_relaxed);
    return scope;
  });
  m.def("_exit_tag", [](const std::shared_ptr<TagScope>& scope) {
    const TagScope* current = CurrentTag();
    if (current != scope.get()) {
      Raise(Status::FailedPrecondition(
          StrCat("spillway.tag('", scope->label, "') exited ",
                 current == nullptr ? std::string("while no tag scope is open on this thread")
                                    : StrCat("while spillway.tag('", current->label,
                                             "'), entered after it, is still open"),
                 "; exit tag scopes in the reverse order of entering them, on the thread that "
                 "entered them. "
                 "Nothing was changed")));
    }
    try {
      c10::ThreadLocalDebugInfo::_pop(kTagKind);
      g_open_scopes.fetch_sub(1, std::memory_order_relaxed);
    } catch (const c10::Error&) {
      Raise(Status::FailedPrecondition(StrCat("spillway.tag('", scope->label,
                                              "') exited while another thread-local debug scope (a "
                                              "profiler record, say) entered inside it is still "
                                              "open; close that one first. Nothing was "
                                              "changed")));
    }
  });
  m.def("_current_tag", []() -> py::object {
    const TagScope* s = CurrentTag();
    if (s == nullptr) return py::none();
    return py::str(s->label);
  });
  m.def("_forked_after_install", [] { return Forked(); });

  m.def("_install", [](std::shared_ptr<PyArena> host, std::shared_ptr<PyArena> pinned,
                       uint64_t small_bytes, int priority) {
    if (priority < 1 || priority > 255) {
      Raise(Status::InvalidArgument(StrCat("spillway.install(priority=", priority,
                                           "): must be 1..255 "
                                           "(torch's own allocators register at 0)")));
    }
    Check(Install(std::move(host), std::move(pinned), small_bytes, static_cast<uint8_t>(priority)));
  });
  m.def("_installed", [] { return g_installed; });
  m.def("_router_stats", [] {
    py::dict d;
    if (!g_installed) return d;
    d["routed_allocations"] = g_router->stats().routed_allocations.load();
    d["routed_bytes"] = g_router->stats().routed_bytes.load();
    d["small_forwarded"] = g_router->stats().small_forwarded.load();
    d["forwarded_live_bytes"] = std::max<int64_t>(0, g_router->stats().forwarded_live_bytes.load());
    d["small_bytes"] = g_router->small_bytes();
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
    return py::make_tuple(g_installed && c10::GetCPUAllocator() == g_router,
                          g_installed && CurrentCudaHostAllocator() == g_pinned);
  });

  // Through torch's registry, as torch itself calls it: on a machine without a GPU, pin_memory()
  // cannot run, so the tests reach the pinned allocator here.
  m.def("_host_allocator_empty", [](int64_t bytes) {
    if (bytes < 0)
      Raise(Status::InvalidArgument(StrCat("_host_allocator_empty(", bytes, "): negative size")));
    at::HostAllocator* a = CurrentCudaHostAllocator();
    if (a == nullptr)
      Raise(Status::FailedPrecondition("no pinned host allocator is registered for CUDA"));
    return TensorOver(a->allocate(static_cast<size_t>(bytes)), bytes, a);
  });
  m.def("_host_allocator_record_event", [](const torch::Tensor& t) {
    at::HostAllocator* a = CurrentCudaHostAllocator();
    if (a == nullptr)
      Raise(Status::FailedPrecondition("no pinned host allocator is registered for CUDA"));
    const c10::DataPtr& d = t.storage().data_ptr();
    return a->record_event(d.get(), d.get_context(),
                           c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)));
  });
  m.def("_host_allocator_empty_cache", [] {
    if (at::HostAllocator* a = CurrentCudaHostAllocator()) a->empty_cache();
  });
  m.def("_host_allocator_pool", [](const std::string& what, int64_t a, int64_t b) {
    at::HostAllocator* h = CurrentCudaHostAllocator();
    if (h == nullptr)
      Raise(Status::FailedPrecondition("no pinned host allocator is registered for CUDA"));
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
  m.def("_testing_manual_events", [](bool on) { Blocks::Get().events().SetManual(on); });
  m.def("_testing_complete_events", [] { Blocks::Get().events().CompleteManual(); });
  m.def("_poll_deferred", [] { return Blocks::Get().Poll(); });
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
