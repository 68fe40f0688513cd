// spillway._spillway's bindings of spillway::allocator: the node governor (spillway.node: join, the
// process's governor, admission, the ledger as dicts; Note [Node governor]), the memory limits the
// default budgets come from, and CRC32C.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <string>

#include "bindings.h"
#include "errors.h"
#include "spillway/allocator/crc32c.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/node_governor.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

using allocator::NodeGovernor;
using allocator::NodeStats;

// {"arenas": bytes, ...}: a rank's resident memory by owner.
py::dict OwnerDict(const allocator::OwnerBytes& owners) {
  py::dict d;
  for (int o = 0; o < allocator::kMemoryOwnerCount; ++o) {
    d[allocator::MemoryOwnerName(static_cast<allocator::MemoryOwner>(o))] = owners[o];
  }
  return d;
}

py::dict StatsToDict(const NodeStats& s) {
  py::dict d;
  d["job"] = s.job;
  d["ledger"] = s.ledger;
  d["scope"] = s.scope;
  d["budget_by"] = s.budget_by;
  d["path"] = s.path;
  d["memory_limit_bytes"] = s.memory_limit_bytes;
  d["reserve_bytes"] = s.reserve_bytes;
  d["budget_explicit"] = s.budget_explicit;
  d["host_budget_bytes"] = s.host_budget_bytes;
  d["nvme_budget_bytes"] = s.nvme_budget_bytes;
  d["host_committed_bytes"] = s.host_committed_bytes;
  d["nvme_committed_bytes"] = s.nvme_committed_bytes;
  d["peak_host_committed_bytes"] = s.peak_host_committed_bytes;
  d["host_headroom_bytes"] = s.host_headroom_bytes;
  d["reaped_ranks"] = s.reaped_ranks;
  d["over_budget_count"] = s.over_budget_count;
  d["trim_requests"] = s.trim_requests;
  d["local_world_size"] = s.local_world_size;
  py::list jobs;
  for (const allocator::NodeJobStats& j : s.jobs) {
    py::dict jd;
    jd["name"] = j.name;
    jd["local_world_size"] = j.local_world_size;
    jd["ranks"] = j.ranks;
    jd["host_bytes"] = j.host_bytes;
    jd["nvme_bytes"] = j.nvme_bytes;
    jd["declared_bytes"] = j.declared_bytes;
    jobs.append(jd);
  }
  d["jobs"] = jobs;
  py::list ranks;
  for (const allocator::NodeRankStats& r : s.ranks) {
    py::dict rd;
    rd["job"] = r.job;
    rd["local_rank"] = r.local_rank;
    rd["pid"] = r.pid;
    rd["pinned_bytes"] = r.bytes[0];
    rd["pageable_bytes"] = r.bytes[1];
    rd["nvme_bytes"] = r.bytes[2];
    rd["host_bytes"] = r.host_bytes;
    rd["peak_host_bytes"] = r.peak_host_bytes;
    rd["live_by_kind"] = KindBytesDict(r.host_by_kind);
    rd["declared_bytes"] = r.declared_bytes;
    rd["workers_private_bytes"] = r.workers_private_bytes;
    rd["workers"] = r.workers;
    rd["trims"] = r.trims;
    rd["memory"] = OwnerDict(r.memory.owners);
    rd["memory_counted_beyond_resident_bytes"] = r.memory.counted_beyond_resident;
    ranks.append(rd);
  }
  d["ranks"] = ranks;
  d["text"] = s.ToString();
  return d;
}

std::shared_ptr<NodeGovernor> CurrentOrRaise(const char* what) {
  std::shared_ptr<NodeGovernor> g = NodeGovernor::Current();
  if (g == nullptr) {
    Raise(Status::FailedPrecondition(
        StrCat(what,
               ": this process has joined no node budget: spillway.install() was not called, "
               "ran with node=False or SPILLWAY_NODE=0, ran in a child of a rank, or warned "
               "that no ledger could take the process (spillway.node.NodeWarning)")));
  }
  return g;
}

}  // namespace

void BindAllocator(py::module_& m) {
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
  m.def(
      "crc32",
      [](const py::object& data, uint32_t crc) {
        Py_buffer view;  // as crc32c: contiguous only, the GIL released while it runs
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
        std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> release(&view, PyBuffer_Release);
        py::gil_scoped_release unlocked;
        return allocator::Crc32ZipExtend(crc, view.buf, static_cast<size_t>(view.len));
      },
      py::arg("data"), py::arg("crc") = 0,
      "zip's CRC-32 of `data` continuing `crc`, as zlib.crc32(data, crc) (ISA-L's, vectorised).");

  m.def("_node_job", [] {
    const allocator::NodeJob job = Check(allocator::NodeJobFromEnvironment());
    py::dict d;
    d["id"] = job.id;
    d["source"] = job.source;
    d["local_rank"] = job.local_rank;
    d["local_world_size"] = job.local_world_size;
    d["rank_variable"] = job.rank_variable;
    return d;
  });
  m.def(
      "_node_join",
      [](const std::string& job, const std::string& ledger, int local_rank, int local_world_size,
         uint64_t host_budget_bytes, uint64_t memory_limit_bytes, uint64_t nvme_budget_bytes,
         const std::string& dir) {
        allocator::NodeGovernorOptions o;
        o.job = job;
        o.ledger = ledger;
        o.local_rank = local_rank;
        o.local_world_size = local_world_size;
        o.host_budget_bytes = host_budget_bytes;
        o.memory_limit_bytes = memory_limit_bytes;
        o.nvme_budget_bytes = nvme_budget_bytes;
        o.dir = dir;
        Result<std::unique_ptr<NodeGovernor>> joined = [&] {
          py::gil_scoped_release nogil;  // waits for a segment's creator, reaps (syscalls)
          return NodeGovernor::Join(std::move(o));
        }();
        // With the GIL: raising builds a Python exception.
        std::shared_ptr<NodeGovernor> g(Check(std::move(joined)));
        NodeGovernor::SetCurrent(g);
        return g->path();
      },
      py::arg("job"), py::arg("ledger"), py::arg("local_rank"), py::arg("local_world_size"),
      py::arg("host_budget_bytes"), py::arg("memory_limit_bytes"), py::arg("nvme_budget_bytes"),
      py::arg("dir") = "/dev/shm");
  // Leaves the node now (the slot is freed; the arenas' later regions are refused) and drops the
  // process's reference.
  m.def("_node_leave", [] {
    std::shared_ptr<NodeGovernor> g = NodeGovernor::Current();
    if (g != nullptr) {
      py::gil_scoped_release nogil;
      g->Leave();
    }
    NodeGovernor::SetCurrent(nullptr);
  });
  // At interpreter exit (spillway.node registers it): frees this rank's slot now, while its arenas
  // still exist, so the last rank out removes the segment.
  m.def("_node_exit", [] {
    std::shared_ptr<NodeGovernor> g = NodeGovernor::Current();
    if (g == nullptr) return;
    py::gil_scoped_release nogil;
    g->Leave();
  });
  m.def("_node_joined", [] { return NodeGovernor::Current() != nullptr; });
  m.def("_node_stats", [] {
    std::shared_ptr<NodeGovernor> g = CurrentOrRaise("spillway.node.stats()");
    NodeStats s;
    {
      py::gil_scoped_release nogil;
      s = g->Stats();
    }
    return StatsToDict(s);
  });
  m.def(
      "_node_inspect",
      [](const std::string& path) {
        Result<NodeStats> s = [&] {
          py::gil_scoped_release nogil;
          return NodeGovernor::Inspect(path);
        }();
        return StatsToDict(Check(std::move(s)));  // with the GIL: raising builds a Python exception
      },
      py::arg("path"));
  m.def(
      "_node_segments", [](const std::string& dir) { return NodeGovernor::ListSegments(dir); },
      py::arg("dir") = "/dev/shm");
  m.def(
      "_node_admit",
      [](uint64_t need_bytes, uint64_t workers_fork_bytes, double timeout_seconds,
         const std::string& detail) {
        std::shared_ptr<NodeGovernor> g = CurrentOrRaise("spillway.node.admit()");
        Status st;
        {
          py::gil_scoped_release nogil;  // waits for the other ranks
          st = g->Admit(need_bytes, workers_fork_bytes,
                        std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)),
                        detail);
        }
        Check(st);
      },
      py::arg("need_bytes"), py::arg("workers_fork_bytes"), py::arg("timeout_seconds"),
      py::arg("detail"));
  m.def(
      "_node_rekey",
      [](const std::string& job, int local_rank, int local_world_size) {
        std::shared_ptr<NodeGovernor> g = CurrentOrRaise("spillway.node.learn_job()");
        Status st;
        {
          py::gil_scoped_release nogil;  // takes the segment's lock
          st = g->Rekey(job, local_rank, local_world_size);
        }
        Check(st);
      },
      py::arg("job"), py::arg("local_rank"), py::arg("local_world_size"));
  m.def(
      "_node_publish_workers",
      [](uint64_t private_bytes, uint32_t workers) {
        CurrentOrRaise("spillway.node.publish_workers()")->PublishWorkers(private_bytes, workers);
      },
      py::arg("private_bytes"), py::arg("workers"));
  m.def(
      "_process_memory",
      [](uint64_t torch_cpu, uint64_t torch_pinned, uint64_t python, bool publish) {
        allocator::HeapCounters c;
        c.torch_cpu = torch_cpu;
        c.torch_pinned = torch_pinned;
        c.python = python;
        Result<allocator::MappedBytes> mapped = [&] {
          py::gil_scoped_release nogil;  // one read of /proc/self/smaps
          allocator::ReadMallocCounters(&c);
          return allocator::ReadMappedBytes();
        }();
        Check(mapped.status());  // with the GIL held
        const allocator::ProcessMemory pm = allocator::AttributeMemory(*mapped, c);
        if (publish) {
          if (std::shared_ptr<NodeGovernor> g = NodeGovernor::Current()) g->PublishMemory(pm);
        }
        py::dict d;
        d["owners"] = OwnerDict(pm.owners);
        d["resident_bytes"] = pm.total;
        d["counted_beyond_resident_bytes"] = pm.counted_beyond_resident;
        d["named_fraction"] = pm.named_fraction();
        d["mappings"] = mapped->mappings;
        d["text"] = allocator::DescribeMemory(pm);
        return d;
      },
      py::arg("torch_cpu"), py::arg("torch_pinned"), py::arg("python"), py::arg("publish"));
  m.def("_node_trim", [] {
    std::shared_ptr<NodeGovernor> g = CurrentOrRaise("spillway.node.trim()");
    py::gil_scoped_release nogil;
    return g->TrimLocal();
  });
  m.def(
      "_node_default_budget",
      [](uint64_t limit) {
        return py::make_tuple(allocator::DefaultNodeHostBudget(limit),
                              allocator::DefaultNodeReserve(limit));
      },
      py::arg("memory_limit_bytes"));
}

}  // namespace spillway::python
