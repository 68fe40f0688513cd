// The node governor's Python binding (spillway.node): join, the process's governor, admission, the
// ledger as dicts, and the planner's per-rank need for a DeepSpeed config. Note [Node governor].
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <string>

#include "bindings.h"
#include "errors.h"
#include "spillway/allocator/node_governor.h"
#include "spillway/offload/config.h"
#include "spillway/offload/planner.h"

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

void BindNode(py::module_& m) {
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

  // The planner's per-rank host need for a DeepSpeed run (offload/planner.h), for admission.
  m.def(
      "_plan_deepspeed",
      [](double params, uint32_t world_size, uint32_t nodes, uint64_t host_ram_bytes,
         const std::string& config_json, bool cpu_accelerator, uint64_t rank_level_bytes,
         uint64_t largest_tensor, bool partitioned) {
        offload::PlanInput in;
        in.params = params;
        in.world_size = world_size;
        in.nodes = nodes;
        in.host_ram_bytes = host_ram_bytes;
        in.nvme_bytes = 1ull << 59;  // admission checks host memory; the disk is not its to judge
        // DeepSpeed's own config: the keys Spillway does not act on are DeepSpeed's to act on.
        in.config = Check(offload::Config::Parse(config_json, /*warn_ignored=*/false));
        in.accelerator = cpu_accelerator ? offload::Accelerator::kCpu : offload::Accelerator::kCuda;
        in.gpu_mem_bytes = 0;
        // The phases ahead of a ZeRO-3 rank that holds its model already (Note [Phase peaks]);
        // the DataLoader's workers are not known at initialize: none.
        in.phases.rank_baseline_bytes = in.config.zero_stage == 3 ? rank_level_bytes : 0;
        in.phases.load =
            partitioned ? offload::ModelLoad::kLoaded : offload::ModelLoad::kLoadedWhole;
        in.phases.largest_tensor = largest_tensor;
        in.phases.dataloader_workers = 0;
        const offload::PlanReport r = Check(offload::MakePlan(in));
        const auto host = static_cast<size_t>(offload::Place::kHostPinned);
        const auto pageable = static_cast<size_t>(offload::Place::kHostPageable);
        const uint32_t per_node = world_size / nodes;
        py::dict d;
        d["host_pinned_per_rank"] = r.per_rank[host];
        d["host_pageable_per_rank"] = r.per_rank[pageable];
        d["host_per_rank"] = r.per_rank[host] + r.per_rank[pageable];
        d["fork_copy_per_rank"] = r.fork_extra_spillway_per_node / per_node;
        d["fork_copy_naive_per_rank"] = r.fork_extra_naive_per_node / per_node;
        d["suggestions"] = r.suggestions;
        py::list phases;
        for (const offload::PhasePeak& p : r.phases) {
          py::dict ph;
          ph["name"] = p.name;
          ph["rank0"] = p.rank0;
          ph["other_rank"] = p.other_rank;
          ph["node"] = p.node;
          ph["naive_node"] = p.naive_node;
          phases.append(ph);
        }
        d["phases"] = r.phases.empty() ? py::object(py::none()) : py::object(phases);
        d["text"] = r.ToString();
        return d;
      },
      py::arg("params"), py::arg("world_size"), py::arg("nodes"), py::arg("host_ram_bytes"),
      py::arg("config_json"), py::arg("cpu_accelerator"), py::arg("rank_level_bytes") = 0,
      py::arg("largest_tensor") = 0, py::arg("partitioned") = true);
}

}  // namespace spillway::python
