// Capacity planner: where a ZeRO-3 run's states live per rank and per node, the pinned buffer
// pools, the peak at an end-of-epoch checkpoint, the extra memory a fork of the trainer costs on
// its first optimizer step (copy-on-write) with and without fork-safe arenas, and the GPU's share;
// then a verdict and the settings that would make it fit. Two runtimes: a DeepSpeed run under its
// config (the buffers DeepSpeed 0.19.8 allocates, where it puts them), and `spillway train`'s
// reference trainer (the partitions its store holds). The model behind each number is in
// docs/offload.md, Note [Planner]; tests/cli/plan_vs_run_test.cc holds the trainer's against
// measured runs. Pure arithmetic: no allocation, no I/O.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/allocator/owner.h"
#include "spillway/base/status.h"
#include "spillway/offload/config.h"

namespace spillway::offload {

// What pins DeepSpeed's `pin_memory` buffers: torch's CUDA host allocator (cudaHostAlloc, a
// shared mapping that a fork does not copy), or nothing on DeepSpeed's CPU accelerator.
enum class Accelerator : uint8_t { kCuda = 0, kCpu };

enum class Runtime : uint8_t {
  kDeepSpeed = 0,  // a DeepSpeed ZeRO-3 run under `config`
  kTrainer,        // `spillway train`'s reference trainer (engine/trainer.h) under `config`
};

// How each rank comes to hold the model before deepspeed.initialize (Note [Phase peaks]).
enum class ModelLoad : uint8_t {
  kZeroInit = 0,  // from_pretrained under zero.Init: HF Trainer's and Accelerate's path when their
                  // DeepSpeed ZeRO-3 config exists before the model
  kWhole,         // from_pretrained before any DeepSpeed config: the whole model on every rank
  kLoaded,        // in memory, partitioned by zero.Init: rank_baseline_bytes includes it
                  // (admission at deepspeed.initialize)
  kLoadedWhole,   // in memory, whole: rank_baseline_bytes includes it; initialize partitions it
};

// The run's phases, for a DeepSpeed plan (Note [Phase peaks] in docs/offload.md).
struct PhaseInput {
  // What each rank holds before it loads the model and makes its client's arguments (the
  // interpreter, torch, DeepSpeed, transformers imported, the process group); 0: phases are not
  // planned.
  uint64_t rank_baseline_bytes = 0;
  ModelLoad load = ModelLoad::kZeroInit;
  bool torch_bin = false;             // the checkpoint is a torch .bin (else safetensors)
  double checkpoint_dtype_bytes = 4;  // the checkpoint's dtype, which from_pretrained keeps
  uint64_t largest_tensor = 0;        // elements of the model's largest tensor; 0: params / 8
  uint32_t dataloader_workers = 2;    // per rank, forked at each epoch (at most 1024)
};

// Measured constants of the phase model (Note [Phase peaks]; torch 2.13, DeepSpeed 0.19.8,
// transformers 5.24): what the client's runtime adds to a rank when it first runs (HF's
// TrainingArguments, or the first from_pretrained), what DeepSpeed's engine, its CPU Adam op and
// HF Trainer add beyond the state at deepspeed.initialize, and one forked DataLoader worker's own
// pages while it runs.
inline constexpr uint64_t kClientRuntimeBytes = 106ull << 20;
inline constexpr uint64_t kEngineRuntimeBytes = 72ull << 20;
inline constexpr uint64_t kDataLoaderWorkerBytes = 20ull << 20;
// spillway.deepspeed's O_DIRECT checkpoint writer on each rank, from its first save on: eight
// 4 MiB staging buffers and its eight handles' 1 MiB bounce buffers, which share one 32 MiB region
// of the pinned arena (deepspeed/_direct_file.py; test_deepspeed_checkpoint.py measures it).
inline constexpr uint64_t kCheckpointWriterBytes = 64ull << 20;
// The peak_slack of the host arena spillway.install() makes (python/spillway/_torch_allocators.py
// reads it from here): its retained cache may lift the arena's committed bytes 5% above their need
// at its peak, so a step's transients stay mapped from one iteration to the next
// (docs/benchmarks.md, "Whole iterations"). The phases count it in the steady state:
// Note [Phase peaks].
inline constexpr double kOneLineHostPeakSlack = 0.05;

// One phase's peak on node 0: rank 0 (which writes the saves) and each other rank.
struct PhasePeak {
  const char* name = "";  // "load", "initialize", "epoch boundary", "checkpoint", "final save"
  uint64_t rank0 = 0;
  uint64_t other_rank = 0;
  uint64_t node = 0;        // rank0 + (ranks per node - 1) x other_rank
  uint64_t naive_node = 0;  // the same run with DeepSpeed's defaults (no Spillway)
};

struct PlanInput {
  double params = 0;        // model parameters (34e9 for Yi-34B)
  uint32_t world_size = 1;  // ranks (one per GPU)
  uint32_t nodes = 1;
  uint64_t host_ram_bytes = 0;  // per node
  uint64_t nvme_bytes = 0;      // per node (0: no NVMe)
  Config config;
  Runtime runtime = Runtime::kDeepSpeed;
  Accelerator accelerator = Accelerator::kCuda;
  // kTrainer: each unit's element count (embedding, blocks, head); `params` is their sum. Each
  // unit is partitioned on its own (ceil(numel / world_size) elements per rank).
  std::vector<uint64_t> trainer_units;
  // Memory of one GPU (0: the GPU is not checked). The model states the config leaves on the GPU
  // plus `gpu_reserve_fraction` of it (activations, the CUDA context, the caching allocator's
  // fragmentation; a stated estimate, not a model of the network) must fit.
  uint64_t gpu_mem_bytes = 0;
  double gpu_reserve_fraction = 0.25;
  PhaseInput phases;  // kDeepSpeed only
};

enum class Place : uint8_t { kGpu = 0, kHostPinned, kHostPageable, kNvme };
const char* PlaceName(Place place);

struct PlanLine {
  std::string what;  // "fp32 master weights", "param swap buffers", ...
  Place place = Place::kGpu;
  uint64_t bytes_per_rank = 0;
  allocator::Kind kind = allocator::Kind::kParam;  // the ledger's kind for these bytes
  // Copied by the first write after a fork without a fork-safe arena: private anonymous memory
  // (pageable, or locked with mlock), not a cudaHostAlloc shared mapping.
  bool fork_copies = true;
};

struct PlanReport {
  Runtime runtime = Runtime::kDeepSpeed;
  std::vector<PlanLine> lines;
  uint64_t per_rank[4] = {};                     // by Place
  uint64_t per_node[4] = {};                     // by Place (ranks per node x per rank)
  allocator::KindBytes host_by_kind_per_rank{};  // host places only, by the ledger's kind
  allocator::KindBytes nvme_by_kind_per_rank{};
  uint64_t host_steady_per_node = 0;
  // kTrainer: what Spillway's host arena holds from the OS after a step (its regions are mapped
  // and pinned whole): the steady bytes packed as the arena packs them (partitions of at least
  // region_bytes / dedicated_divisor in regions of their own, page-rounded; smaller ones sharing
  // region_bytes regions) plus the step's transients that its retained cache keeps. A fork copies
  // every one of these pages when the arena is inherited: io_uring has them registered (pinned
  // for DMA), and the kernel copies such pages at the fork itself. Equal to host_steady_per_node
  // for a DeepSpeed plan (its packing is not modelled).
  uint64_t host_committed_per_node = 0;
  // End-of-epoch checkpoint on node 0. DeepSpeed: stage3_gather_16bit_weights_on_model_save
  // gathers the full 16-bit model into rank 0's host memory; the reference trainer's gather-to-
  // host control holds its full fp32 model. Spillway streamed, per node (ranks per node x per
  // rank): for DeepSpeed, the I/O window (block_size x queue_depth per rank); for the trainer,
  // what Trainer::Save holds beyond the steady state: one host slot per rank for the largest
  // partition it must bring in from NVMe (the streamed optimizer's state), 0 when every saved
  // partition is host-resident (the cached parameter copies count as resident: a budget too small
  // for them is not modelled).
  uint64_t checkpoint_gather_bytes = 0;
  uint64_t checkpoint_streamed_bytes = 0;
  // The first optimizer step after a fork (a DataLoader re-forking its workers) writes every host
  // page of state once: copy-on-write duplicates the private ones unless the arena is
  // MADV_DONTFORK. Naive: the lines with fork_copies; Spillway: none, or, with
  // spillway.fork_safety "inherit", every committed byte of the arena (host_committed_per_node).
  uint64_t fork_extra_naive_per_node = 0;
  uint64_t fork_extra_spillway_per_node = 0;
  uint64_t host_peak_naive_per_node = 0;     // steady + checkpoint gather + fork copy
  uint64_t host_peak_spillway_per_node = 0;  // committed + streamed checkpoint + fork copy (0)
  uint64_t nvme_per_node = 0;
  uint64_t gpu_per_rank = 0;       // model states on each GPU
  uint64_t gpu_reserve_bytes = 0;  // gpu_mem x gpu_reserve_fraction (0: not checked)
  bool fits = false;               // Spillway's peak fits host RAM, the NVMe need fits the disk and
                                   // each GPU's states fit beside the reserve
  int64_t host_headroom = 0;       // host_ram - Spillway peak (negative: short by that much)
  int64_t nvme_headroom = 0;
  int64_t gpu_headroom = 0;              // gpu_mem - reserve - states (0 when not checked)
  bool naive_fits = false;               // the same run with DeepSpeed's default behaviour
  std::vector<std::string> suggestions;  // settings that make it fit, when it does not
  // The run's phases on node 0, in order (empty unless phases.rank_baseline_bytes is given). When
  // planned, `fits` and `naive_fits` also need the largest phase within host RAM.
  std::vector<PhasePeak> phases;
  std::string phases_note;  // what the phases leave out for this accelerator, if anything

  std::string ToString() const;  // the table `spillway plan` prints
};

// INVALID_ARGUMENT for impossible inputs (no params, world not divisible by nodes, no host RAM,
// NVMe placement without NVMe bytes, a trainer plan without units or whose units do not sum to
// params, a reserve outside [0, 1)) naming the flag to change.
Result<PlanReport> MakePlan(const PlanInput& input);

}  // namespace spillway::offload
