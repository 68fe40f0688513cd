// The capacity planner. See planner.h and docs/offload.md, Note [Planner].
#include "spillway/offload/planner.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace spillway::offload {
namespace {

uint64_t Bytes(double x) { return static_cast<uint64_t>(std::llround(x)); }

Place HostPlace(bool pinned) { return pinned ? Place::kHostPinned : Place::kHostPageable; }

std::string Gb(double bytes) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(1);
  o << bytes / 1e9 << " GB";
  return o.str();
}

// The plan without suggestions (they re-plan with changed settings).
Result<PlanReport> Compute(const PlanInput& in) {
  if (!(in.params > 0)) return Status::InvalidArgument("--params must be a positive number of parameters");
  if (in.world_size == 0 || in.nodes == 0 || in.world_size % in.nodes != 0) {
    return Status::InvalidArgument(StrCat("--world-size ", in.world_size, " must be a positive multiple of --nodes ", in.nodes));
  }
  if (in.host_ram_bytes == 0) return Status::InvalidArgument("--host-ram must be given (bytes per node, e.g. 1TiB)");
  const Config& c = in.config;
  if (c.any_nvme() && in.nvme_bytes == 0) {
    return Status::InvalidArgument("the config offloads to nvme but --nvme is 0; give the NVMe bytes per node");
  }
  PlanReport r;
  const double p = in.params / in.world_size;  // elements per rank
  const OffloadDevice pd = c.offload_param.device, od = c.offload_optimizer.device;
  auto add = [&](const std::string& what, Place place, double bytes) {
    r.lines.push_back({what, place, Bytes(bytes)});
  };
  // 16-bit parameters.
  const Place param_place = pd == OffloadDevice::kNone ? Place::kGpu
                            : pd == OffloadDevice::kCpu ? HostPlace(c.offload_param.pin_memory)
                                                        : Place::kNvme;
  add("16-bit parameters", param_place, 2 * p);
  if (pd == OffloadDevice::kNvme) {
    add("param swap buffers (buffer_count x buffer_size x 2 B)", Place::kHostPinned,
        static_cast<double>(c.offload_param.buffer_count) * static_cast<double>(c.offload_param.buffer_size) * 2);
    add("params kept in CPU (min(max_in_cpu, partition) x 2 B)", Place::kHostPageable,
        std::min(static_cast<double>(c.offload_param.max_in_cpu), p) * 2);
  }
  // Gradients: 16-bit on the GPU without optimizer offload; an fp32 partition on the host with it.
  if (od == OffloadDevice::kNone) {
    add("16-bit gradients", Place::kGpu, 2 * p);
  } else {
    add("fp32 gradients (host partition)", HostPlace(c.offload_optimizer.pin_memory), 4 * p);
  }
  const Place opt_place = od == OffloadDevice::kNone ? Place::kGpu
                          : od == OffloadDevice::kCpu ? HostPlace(c.offload_optimizer.pin_memory)
                                                      : Place::kNvme;
  add("fp32 master weights", opt_place, 4 * p);
  add("Adam exp_avg", opt_place, 4 * p);
  add("Adam exp_avg_sq", opt_place, 4 * p);
  if (od == OffloadDevice::kNvme) {
    const double sub_group = std::min(static_cast<double>(c.sub_group_size), p);
    add("optimizer swap buffers (buffer_count x sub-group x 4 B)", Place::kHostPinned,
        static_cast<double>(c.offload_optimizer.buffer_count) * sub_group * 4);
  }
  const double ranks_per_node = static_cast<double>(in.world_size / in.nodes);
  for (const PlanLine& l : r.lines) r.per_rank[static_cast<int>(l.place)] += l.bytes_per_rank;
  for (int k = 0; k < 4; ++k) r.per_node[k] = Bytes(static_cast<double>(r.per_rank[k]) * ranks_per_node);
  r.host_steady_per_node = r.per_node[1] + r.per_node[2];
  r.nvme_per_node = r.per_node[3];
  r.checkpoint_gather_bytes = Bytes(2 * in.params);
  r.checkpoint_streamed_bytes = Bytes(static_cast<double>(c.aio.block_size) *
                                      static_cast<double>(c.aio.queue_depth) * ranks_per_node);
  r.fork_extra_naive_per_node = r.host_steady_per_node;
  r.fork_extra_spillway_per_node =
      c.spillway.fork_safety == allocator::ForkSafety::kInherit ? r.host_steady_per_node : 0;
  r.host_peak_naive_per_node =
      r.host_steady_per_node + r.checkpoint_gather_bytes + r.fork_extra_naive_per_node;
  r.host_peak_spillway_per_node =
      r.host_steady_per_node + r.checkpoint_streamed_bytes + r.fork_extra_spillway_per_node;
  r.host_headroom = static_cast<int64_t>(in.host_ram_bytes) - static_cast<int64_t>(r.host_peak_spillway_per_node);
  r.nvme_headroom = static_cast<int64_t>(in.nvme_bytes) - static_cast<int64_t>(r.nvme_per_node);
  r.fits = r.host_headroom >= 0 && r.nvme_headroom >= 0;
  r.naive_fits = r.host_peak_naive_per_node <= in.host_ram_bytes && r.nvme_headroom >= 0;
  return r;
}

}  // namespace

const char* PlaceName(Place place) {
  switch (place) {
    case Place::kGpu: return "gpu";
    case Place::kHostPinned: return "host pinned";
    case Place::kHostPageable: return "host pageable";
    case Place::kNvme: return "nvme";
  }
  return "?";
}

Result<PlanReport> MakePlan(const PlanInput& input) {
  auto r = Compute(input);
  if (!r.ok() || r->fits) return r;
  // Settings that would make it fit, each tried on its own, then the nodes needed as they are.
  struct Try {
    std::string what;
    void (*apply)(Config&);
  };
  const Try tries[] = {
      {"zero_optimization.offload_optimizer.device = \"nvme\"",
       [](Config& c) { c.offload_optimizer.device = OffloadDevice::kNvme; }},
      {"zero_optimization.offload_param.device = \"nvme\"",
       [](Config& c) { c.offload_param.device = OffloadDevice::kNvme; }},
      {"offload_optimizer and offload_param both on \"nvme\"",
       [](Config& c) {
         c.offload_optimizer.device = OffloadDevice::kNvme;
         c.offload_param.device = OffloadDevice::kNvme;
       }},
      {"sub_group_size = 1e8 (smaller optimizer swap buffers)", [](Config& c) { c.sub_group_size = 100'000'000; }},
      {"offload_optimizer.buffer_count = 2", [](Config& c) { c.offload_optimizer.buffer_count = 2; }},
  };
  for (const Try& t : tries) {
    PlanInput changed = input;
    t.apply(changed.config);
    if (changed.config.any_nvme() && changed.nvme_bytes == 0) continue;
    auto alt = Compute(changed);
    if (alt.ok() && alt->fits) {
      r->suggestions.push_back(StrCat(t.what, ": Spillway peak ", Gb(static_cast<double>(alt->host_peak_spillway_per_node)),
                                      " per node"));
    }
  }
  for (uint32_t nodes = input.nodes + 1; nodes <= input.world_size; ++nodes) {
    if (input.world_size % nodes != 0) continue;
    PlanInput more = input;
    more.nodes = nodes;
    auto alt = Compute(more);
    if (alt.ok() && alt->fits) {
      r->suggestions.push_back(StrCat("--nodes ", nodes, " (", input.world_size / nodes, " ranks per node)"));
      break;
    }
  }
  return r;
}

std::string PlanReport::ToString() const {
  std::ostringstream o;
  o << "state                                                  where           per rank\n";
  for (const PlanLine& l : lines) {
    o << l.what << std::string(l.what.size() < 55 ? 55 - l.what.size() : 1, ' ') << PlaceName(l.place)
      << std::string(16 - std::string(PlaceName(l.place)).size(), ' ') << Gb(static_cast<double>(l.bytes_per_rank)) << "\n";
  }
  o << "\nper node: gpu " << Gb(static_cast<double>(per_node[0])) << ", host pinned "
    << Gb(static_cast<double>(per_node[1])) << ", host pageable " << Gb(static_cast<double>(per_node[2]))
    << ", nvme " << Gb(static_cast<double>(per_node[3])) << "\n";
  o << "end-of-epoch checkpoint: DeepSpeed gathers " << Gb(static_cast<double>(checkpoint_gather_bytes))
    << " into node 0's host memory; Spillway streams through " << Gb(static_cast<double>(checkpoint_streamed_bytes)) << "\n";
  o << "fork of the trainer, first optimizer step after it: +" << Gb(static_cast<double>(fork_extra_naive_per_node))
    << " per node without fork-safe arenas, +" << Gb(static_cast<double>(fork_extra_spillway_per_node)) << " with Spillway\n";
  o << "host peak per node: DeepSpeed defaults " << Gb(static_cast<double>(host_peak_naive_per_node))
    << (naive_fits ? " (fits)" : " (does not fit)") << ", Spillway " << Gb(static_cast<double>(host_peak_spillway_per_node)) << "\n";
  o << "verdict: " << (fits ? "fits" : "does not fit") << " (host headroom "
    << Gb(static_cast<double>(host_headroom)) << ", nvme headroom " << Gb(static_cast<double>(nvme_headroom)) << ")\n";
  for (const std::string& s : suggestions) o << "  would fit with " << s << "\n";
  return o.str();
}

}  // namespace spillway::offload
