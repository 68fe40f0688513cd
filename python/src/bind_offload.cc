// spillway._spillway's binding of spillway::offload: the planner's per-rank host need for a
// DeepSpeed run (offload/planner.h), for the node admission at deepspeed.initialize.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "bindings.h"
#include "errors.h"
#include "spillway/offload/config.h"
#include "spillway/offload/planner.h"

namespace py = pybind11;

namespace spillway::python {

void BindOffload(py::module_& m) {
  // install()'s host arena takes the slack the phase plan counts (offload/planner.h).
  m.attr("_ONE_LINE_HOST_PEAK_SLACK") = offload::kOneLineHostPeakSlack;
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
