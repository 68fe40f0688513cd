// Capacity planner: where a ZeRO-3 run's states live per rank and per node under a DeepSpeed
// config, the pinned buffer pools, the peak at an end-of-epoch checkpoint, and the extra memory a
// fork of the trainer costs on its first optimizer step (copy-on-write) with and without
// fork-safe arenas; then a verdict and the settings that would make it fit. The model behind each
// number is in docs/offload.md, Note [Planner]. Pure arithmetic: no allocation, no I/O.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/allocator/status.h"
#include "spillway/offload/config.h"

namespace spillway::offload {

struct PlanInput {
  double params = 0;            // model parameters (34e9 for Yi-34B)
  uint32_t world_size = 1;      // ranks (one per GPU)
  uint32_t nodes = 1;
  uint64_t host_ram_bytes = 0;  // per node
  uint64_t nvme_bytes = 0;      // per node (0: no NVMe)
  Config config;
};

enum class Place : uint8_t { kGpu = 0, kHostPinned, kHostPageable, kNvme };
const char* PlaceName(Place place);

struct PlanLine {
  std::string what;        // "fp32 master weights", "param swap buffers", ...
  Place place = Place::kGpu;
  uint64_t bytes_per_rank = 0;
};

struct PlanReport {
  std::vector<PlanLine> lines;
  uint64_t per_rank[4] = {};  // by Place
  uint64_t per_node[4] = {};  // by Place (ranks per node x per rank)
  uint64_t host_steady_per_node = 0;
  // End-of-epoch checkpoint on node 0: DeepSpeed gathers the full 16-bit model into rank 0's host
  // memory (stage3_gather_16bit_weights_on_model_save); Spillway streams partitions through
  // bounded I/O buffers (block_size x queue_depth per rank).
  uint64_t checkpoint_gather_bytes = 0;
  uint64_t checkpoint_streamed_bytes = 0;
  // The first optimizer step after a fork (a DataLoader re-forking its workers) writes every host
  // page of state once: copy-on-write duplicates it unless the arena is MADV_DONTFORK.
  uint64_t fork_extra_naive_per_node = 0;
  uint64_t fork_extra_spillway_per_node = 0;
  uint64_t host_peak_naive_per_node = 0;     // steady + checkpoint gather + fork copy
  uint64_t host_peak_spillway_per_node = 0;  // steady + streamed checkpoint + fork copy (0)
  uint64_t nvme_per_node = 0;
  bool fits = false;            // Spillway's peak fits host RAM and the NVMe need fits the disk
  int64_t host_headroom = 0;    // host_ram - Spillway peak (negative: short by that much)
  int64_t nvme_headroom = 0;
  bool naive_fits = false;      // the same run with DeepSpeed's default behaviour
  std::vector<std::string> suggestions;  // settings that make it fit, when it does not

  std::string ToString() const;  // the table `spillway plan` prints
};

// INVALID_ARGUMENT for impossible inputs (no params, world not divisible by nodes, no host RAM,
// NVMe placement without NVMe bytes) naming the flag to change.
Result<PlanReport> MakePlan(const PlanInput& input);

}  // namespace spillway::offload
