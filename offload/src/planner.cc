// The capacity planner. See planner.h and docs/offload.md, Note [Planner].
#include "spillway/offload/planner.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "spillway/allocator/io_engine.h"
#include "spillway/offload/transfer_pipeline.h"

namespace spillway::offload {
namespace {

uint64_t Bytes(double x) { return static_cast<uint64_t>(std::llround(x)); }

Place HostPlace(bool pinned) { return pinned ? Place::kHostPinned : Place::kHostPageable; }

// Decimal units, GB for anything of a gigabyte or more (a training node's scale), MB or kB below.
std::string Gb(double bytes) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(1);
  const double a = std::fabs(bytes);
  if (a >= 1e9 || a == 0) {
    o << bytes / 1e9 << " GB";
  } else if (a >= 1e6) {
    o << bytes / 1e6 << " MB";
  } else {
    o << bytes / 1e3 << " kB";
  }
  return o.str();
}

// DeepSpeed 0.19.8's ZeRO-3 buffers per rank (p elements), where it puts them: docs/offload.md,
// Note [Planner], cites the source line of each.
void DeepSpeedLines(const PlanInput& in, double p, std::vector<PlanLine>* lines) {
  const Config& c = in.config;
  const OffloadDevice pd = c.offload_param.device, od = c.offload_optimizer.device;
  const bool cuda = in.accelerator == Accelerator::kCuda;
  // torch-pinned (cudaHostAlloc) when asked for and CUDA pins; private pageable otherwise.
  auto pinned = [&](bool asked) {
    return asked && cuda ? Place::kHostPinned : Place::kHostPageable;
  };
  auto add = [&](std::string what, Place place, double bytes, allocator::Kind kind) {
    lines->push_back({std::move(what), place, Bytes(bytes), kind, place != Place::kHostPinned});
  };
  using allocator::Kind;
  // 16-bit parameters: with offload_param "cpu" they live in one flat buffer per group that
  // DeepSpeed always pins; on "nvme", that buffer keeps max_in_cpu of them.
  if (pd == OffloadDevice::kNone) add("16-bit parameters", Place::kGpu, 2 * p, Kind::kParam);
  if (pd == OffloadDevice::kCpu)
    add("16-bit parameters (flat buffer per group)", pinned(true), 2 * p, Kind::kParam);
  if (pd == OffloadDevice::kNvme) {
    add("16-bit parameters", Place::kNvme, 2 * p, Kind::kParam);
    add("params kept in CPU (min(max_in_cpu, partition) x 2 B)", pinned(true),
        std::min(static_cast<double>(c.offload_param.max_in_cpu), p) * 2, Kind::kParam);
    // The aio op's locked tensors: mlock'd private memory, which a fork copies.
    lines->push_back({"param swap buffers (buffer_count x buffer_size x 2 B)", Place::kHostPinned,
                      Bytes(static_cast<double>(c.offload_param.buffer_count) *
                            static_cast<double>(c.offload_param.buffer_size) * 2),
                      Kind::kSwapBuffer, true});
  }
  // Gradients: 16-bit on the GPU without optimizer offload. With it, a 16-bit flat partition
  // (grad_partitions_flat_buffer, in the model's dtype unless data_types.grad_accum_dtype says
  // otherwise) and an fp32 gradient per sub-group ("cpu"), or one sub-group's ("nvme").
  const double sub_group = std::min(static_cast<double>(c.sub_group_size), p);
  if (od == OffloadDevice::kNone) {
    add("16-bit gradients", Place::kGpu, 2 * p, Kind::kGrad);
  } else {
    add("16-bit gradient partitions", pinned(c.offload_optimizer.pin_memory), 2 * p, Kind::kGrad);
    if (od == OffloadDevice::kCpu) {
      add("fp32 gradients (one per sub-group)", pinned(c.offload_optimizer.pin_memory), 4 * p,
          Kind::kGrad);
    } else {
      add("fp32 gradient buffer (largest sub-group)", Place::kHostPageable, 4 * sub_group,
          Kind::kGrad);
    }
  }
  // fp32 master and Adam moments: plain CPU tensors even with pin_memory (stage3.py
  // _create_fp32_partitions, cpu_adam's zeros_like), or swapped on NVMe.
  const Place opt_place = od == OffloadDevice::kNone  ? Place::kGpu
                          : od == OffloadDevice::kCpu ? Place::kHostPageable
                                                      : Place::kNvme;
  add("fp32 master weights", opt_place, 4 * p, Kind::kMasterWeight);
  add("Adam exp_avg", opt_place, 4 * p, Kind::kOptimizerState);
  add("Adam exp_avg_sq", opt_place, 4 * p, Kind::kOptimizerState);
  if (od == OffloadDevice::kNvme) {
    lines->push_back({"optimizer swap buffers (buffer_count x sub-group x 4 B)", Place::kHostPinned,
                      Bytes(static_cast<double>(c.offload_optimizer.buffer_count) * sub_group * 4),
                      Kind::kSwapBuffer, true});
  }
}

// The reference trainer's partitions per rank (engine/trainer.h, Note [Trainer]): every state is
// fp32 and partitioned per unit; the optimizer always steps on the host, so nothing stays on the
// GPU between steps. An NVMe-homed parameter or gradient, once used, stays cached in host memory
// while the budget has room (a clean copy, spilled first); the optimizer's state streams from NVMe
// through step-lifetime buffers, so none of it is resident between steps.
void TrainerLines(const PlanInput& in, uint64_t shard, std::vector<PlanLine>* lines) {
  const Config& c = in.config;
  const bool param_nvme = c.offload_param.device == OffloadDevice::kNvme;
  const bool opt_nvme = c.offload_optimizer.device == OffloadDevice::kNvme;
  const Place param_host = HostPlace(c.offload_param.pin_memory);
  const Place opt_host = HostPlace(c.offload_optimizer.pin_memory);
  const double s = static_cast<double>(shard);
  auto add = [&](std::string what, Place place, double bytes, allocator::Kind kind) {
    lines->push_back({std::move(what), place, Bytes(bytes), kind, true});
  };
  using allocator::Kind;
  add("fp32 parameters", param_nvme ? Place::kNvme : param_host, 4 * s, Kind::kParam);
  if (param_nvme) add("host copies of the parameters (cached)", param_host, 4 * s, Kind::kParam);
  add("fp32 gradients", opt_nvme ? Place::kNvme : opt_host, 4 * s, Kind::kGrad);
  if (opt_nvme) add("host copies of the gradients (cached)", opt_host, 4 * s, Kind::kGrad);
  const Place opt = opt_nvme ? Place::kNvme : opt_host;
  add("fp32 master weights", opt, 4 * s, Kind::kMasterWeight);
  add("Adam exp_avg and exp_avg_sq", opt, 8 * s, Kind::kOptimizerState);
  const double bounce = static_cast<double>(c.spillway.bounce_buffers);
  add(StrCat("I/O engine bounce pool (", c.spillway.bounce_buffers, " x block_size)"),
      Place::kHostPinned, bounce * static_cast<double>(c.aio.block_size), Kind::kSwapBuffer);
  if (param_nvme) {
    add("transfer pipeline's staging ring (4 x block_size)", Place::kHostPinned,
        static_cast<double>(TransferPipelineOptions{}.staging_buffers) *
            static_cast<double>(c.aio.block_size),
        Kind::kSwapBuffer);
  }
}

uint64_t PageRound(uint64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

// The reference trainer's host arena after a step, packed the way HostArena packs
// (Note [Regions] in docs/allocator.md): `resident` are the allocations alive between steps,
// `transient` the step's largest set alive at once, which the retained cache keeps mapped up to its
// cap.
uint64_t ArenaCommitted(const allocator::HostArenaOptions& o, const std::vector<uint64_t>& resident,
                        uint64_t transient) {
  const uint64_t dedicated_from = o.region_bytes / std::max<uint64_t>(o.dedicated_divisor, 1);
  uint64_t dedicated = 0, shared = 0, live = 0;
  for (uint64_t b : resident) {
    const uint64_t r = PageRound(b);
    live += r;
    (r >= dedicated_from ? dedicated : shared) += r;
  }
  const uint64_t regions = (shared + o.region_bytes - 1) / o.region_bytes;
  return dedicated + regions * o.region_bytes +
         std::min(transient, allocator::RetainLimitFor(o, live));
}

// What a rank's state holds in host memory (on DeepSpeed's CPU accelerator, the GPU's share too):
// all of it, its 16-bit parameters, and the Adam moments.
struct HostState {
  double state = 0, params16 = 0, moments = 0;
};
HostState StateOnHost(const PlanReport& r, bool cpu) {
  HostState h;
  for (const PlanLine& l : r.lines) {
    const bool host = l.place == Place::kHostPinned || l.place == Place::kHostPageable ||
                      (cpu && l.place == Place::kGpu);
    if (!host) continue;
    h.state += static_cast<double>(l.bytes_per_rank);
    if (l.kind == allocator::Kind::kParam) h.params16 += static_cast<double>(l.bytes_per_rank);
    if (l.kind == allocator::Kind::kOptimizerState)
      h.moments += static_cast<double>(l.bytes_per_rank);
  }
  return h;
}

// What loading the model leaves on each rank, as the phases' input says it is loaded.
double LoadBytes(const PhaseInput& ph, double params16, double P) {
  const double b = ph.checkpoint_dtype_bytes;
  double load = static_cast<double>(kClientRuntimeBytes);
  switch (ph.load) {
    case ModelLoad::kZeroInit:
      // The partitions, and the model built whole in the checkpoint's dtype before zero.Init
      // partitions it, which the heap keeps; a .bin's records read through the heap as well, of
      // which glibc kept 5% to 70% in the runs measured (its moving mmap threshold decides): the
      // plan counts the middle, 3/8.
      load += params16 + b * P + (ph.torch_bin ? b * P * 3 / 8 : 0);
      break;
    case ModelLoad::kWhole:
      // transformers maps the checkpoint and keeps its tensors where the dtype is the file's:
      // file pages, shared by the ranks and not anonymous memory.
      break;
    case ModelLoad::kLoaded:
    case ModelLoad::kLoadedWhole:
      load = 0;
      break;
  }
  return load;
}

// After the first step, on the CPU accelerator the step's device side is host memory: the
// gradient bucket DeepSpeed reserves whole (its pages touched up to the model's 16-bit gradients)
// and the step's transients (the model gathered for the forward and for the backward, its full
// 16-bit gradients: 3 x 2P) that the arena's retained cache keeps, up to its cap. The cache fills
// toward them over the first epochs (75 to 95% of them at the checkpoints measured): the plan
// counts 5/6. With the one line the cache also keeps what its peak slack allows above the arena's
// need at its peak (the state, the bucket reserved whole, the transients; measured: 64 MiB more
// retained per rank at 33.6M parameters on 2 ranks, 5% of that need being 72 MiB), still under
// its cap; plain DeepSpeed's transients go to torch's allocator, so its run has no such slack.
// On CUDA: 0, and the report says what is not modelled.
struct DeviceSide {
  double both = 0;           // the bucket's touched pages and the transients the cache keeps
  double spillway_only = 0;  // what the host arena's peak slack lets its cache keep beyond that
};
DeviceSide DeviceSideOnHost(const PlanInput& in, double state, PlanReport* r) {
  if (in.accelerator != Accelerator::kCpu) {
    r->phases_note =
        "on CUDA the step's device side is the GPU's, and its host side beyond the state (CUDA's "
        "and NCCL's host memory) is not modelled: the phases are checked on the CPU accelerator";
    return {};
  }
  const Config& c = in.config;
  const double P = in.params;
  const double bucket = static_cast<double>(c.reduce_bucket_size);
  const double live = state + 2 * bucket;
  const double cap =
      static_cast<double>(allocator::RetainLimitFor(c.HostArenaOptions(), Bytes(live)));
  const double transients = 3 * 2 * P;
  const double kept = std::min(cap, 5.0 / 6 * transients);
  const double slack = std::min(cap - kept, kOneLineHostPeakSlack * (live + transients));
  return {2 * std::min(bucket, P) + kept, slack};
}

// One phase's peak into r: rank 0's and each other rank's, Spillway's and the naive run's.
void AddPhase(PlanReport* r, double ranks, const char* name, double rank0, double other,
              double naive_rank0, double naive_other) {
  PhasePeak p;
  p.name = name;
  p.rank0 = Bytes(rank0);
  p.other_rank = Bytes(other);
  p.node = Bytes(rank0 + (ranks - 1) * other);
  p.naive_node = Bytes(naive_rank0 + (ranks - 1) * naive_other);
  r->phases.push_back(p);
}

// Note [Phase peaks]: node 0's peak at each phase of a DeepSpeed ZeRO-3 run, per rank. `copied` is
// what a fork copies per rank without fork-safe arenas.
void PlanPhases(const PlanInput& in, uint64_t copied, PlanReport* r) {
  const PhaseInput& ph = in.phases;
  const Config& c = in.config;
  const bool cpu = in.accelerator == Accelerator::kCpu;
  const double P = in.params, ranks = static_cast<double>(in.world_size) / in.nodes;
  const double largest = ph.largest_tensor > 0 ? static_cast<double>(ph.largest_tensor) : P / 8;
  const HostState h = StateOnHost(*r, cpu);
  const bool partitioned = ph.load == ModelLoad::kZeroInit || ph.load == ModelLoad::kLoaded;
  const double base = static_cast<double>(ph.rank_baseline_bytes) + LoadBytes(ph, h.params16, P);
  // deepspeed.initialize: the state but the Adam moments (made at the first step); the partitions
  // exist already unless the whole model was loaded.
  const double init = base + h.state - h.moments - (partitioned ? h.params16 : 0) +
                      static_cast<double>(kEngineRuntimeBytes);
  // After the first step: the moments, and the step's device side where it is host memory.
  const DeviceSide device = DeviceSideOnHost(in, h.state, r);
  const double naive_steady = init + h.moments + device.both;
  const double steady = naive_steady + device.spillway_only;
  const double workers =
      static_cast<double>(ph.dataloader_workers) * static_cast<double>(kDataLoaderWorkerBytes);
  const double fork_spillway = static_cast<double>(r->fork_extra_spillway_per_node) / ranks;
  const double window =
      static_cast<double>(c.aio.block_size) * static_cast<double>(c.aio.queue_depth);
  // Without fork-safe arenas a fork copies the private state: on the CPU accelerator all of it
  // (its GPU share is host memory too), on CUDA what the pinned mapping does not hold.
  const double dc = cpu ? h.state : static_cast<double>(copied);
  AddPhase(r, ranks, "load", base, base, base, base);
  AddPhase(r, ranks, "initialize", init, init, init, init);
  // Spillway's checkpoint writer holds its buffers from the first save on (a boundary after an
  // epoch's checkpoint has them; counted at every boundary, the plan is an upper bound there).
  const double writer = static_cast<double>(kCheckpointWriterBytes);
  AddPhase(r, ranks, "epoch boundary", steady + workers + fork_spillway + writer,
           steady + workers + fork_spillway + writer, naive_steady + workers + dc,
           naive_steady + workers + dc);
  // Rank 0 writes the 16-bit model: Spillway streams it a tensor at a time; DeepSpeed gathers it.
  AddPhase(r, ranks, "checkpoint", steady + window + writer + 2 * largest, steady + window + writer,
           naive_steady + 2 * P, naive_steady);
  AddPhase(r, ranks, "final save", steady + writer + 2 * largest, steady + writer,
           naive_steady + 2 * P, naive_steady);
}

// Checks the plan's input: sizes in range, the world a multiple of the nodes, the phases' flags
// only where they are modelled.
Status CheckPlanInput(const PlanInput& in) {
  if (!(in.params > 0) || in.params > 1e15) {
    return Status::InvalidArgument(
        "--params must be a positive number of parameters, at most 1e15");
  }
  constexpr uint64_t kMaxBytes = 1ull << 60;  // an exbibyte: far past any machine, inside int64
  if (in.host_ram_bytes > kMaxBytes || in.nvme_bytes > kMaxBytes || in.gpu_mem_bytes > kMaxBytes) {
    return Status::InvalidArgument("--host-ram, --nvme and --gpu-mem must each be at most 1 EiB");
  }
  if (in.world_size == 0 || in.nodes == 0 || in.world_size % in.nodes != 0) {
    return Status::InvalidArgument(StrCat("--world-size ", in.world_size,
                                          " must be a positive multiple of --nodes ", in.nodes));
  }
  if (in.host_ram_bytes == 0)
    return Status::InvalidArgument("--host-ram must be given (bytes per node, e.g. 1TiB)");
  const Config& c = in.config;
  if (c.any_nvme() && in.nvme_bytes == 0) {
    return Status::InvalidArgument(
        "the config offloads to nvme but --nvme is 0; give the NVMe bytes per node");
  }
  const PhaseInput& ph = in.phases;
  if (ph.rank_baseline_bytes > (1ull << 40))
    return Status::InvalidArgument("--rank-baseline must be at most 1 TiB per rank");
  if (ph.dataloader_workers > 1024) {
    return Status::InvalidArgument(
        StrCat("--dataloader-workers ", ph.dataloader_workers, " is more than 1024 per rank"));
  }
  if (ph.rank_baseline_bytes > 0 && in.runtime != Runtime::kDeepSpeed) {
    return Status::InvalidArgument(
        "--rank-baseline plans a DeepSpeed run's phases; the trainer's are not modelled: drop it "
        "or --trainer");
  }
  if (!(ph.checkpoint_dtype_bytes == 2 || ph.checkpoint_dtype_bytes == 4)) {
    return Status::InvalidArgument(StrCat("--checkpoint-dtype has ", ph.checkpoint_dtype_bytes,
                                          " bytes per element; fp32 (4), bf16 or fp16 (2)"));
  }
  if (static_cast<double>(ph.largest_tensor) > in.params) {
    return Status::InvalidArgument(
        StrCat("--largest-tensor ", ph.largest_tensor, " is more than --params ", in.params));
  }
  if (!(in.gpu_reserve_fraction >= 0 && in.gpu_reserve_fraction < 1)) {
    return Status::InvalidArgument(
        StrCat("--gpu-reserve ", in.gpu_reserve_fraction, " must be in [0, 1)"));
  }
  return Status::Ok();
}

// The trainer's lines (Runtime::kTrainer) into r, with its checkpoint's gather and streamed bytes.
// Returns what its arena commits per rank, regions and transients included.
Result<uint64_t> PlanTrainer(const PlanInput& in, double ranks_per_node, PlanReport* r) {
  const Config& c = in.config;
  if (in.trainer_units.empty())
    return Status::InvalidArgument("a trainer plan needs the model's units");
  uint64_t numel = 0, shard = 0, largest = 0;
  for (uint64_t u : in.trainer_units) {
    const uint64_t per_rank = (u + in.world_size - 1) / in.world_size;
    numel += u;
    shard += per_rank;
    largest = std::max(largest, per_rank);
  }
  if (std::fabs(static_cast<double>(numel) - in.params) > 0.5) {
    return Status::InvalidArgument(
        StrCat("the trainer's units hold ", numel, " parameters, not --params ", in.params));
  }
  TrainerLines(in, shard, &r->lines);
  // What stays in the arena between steps: per unit, the parameter and gradient partitions (host
  // homed, or NVMe-homed copies cached), the optimizer's three unless they stream from NVMe;
  // the engine's bounce pool. The step's transients: one unit gathered whole, and, streaming,
  // the optimizer's three partitions of the group in use and of the prefetched ones.
  const bool opt_nvme = c.offload_optimizer.device == OffloadDevice::kNvme;
  std::vector<uint64_t> resident;
  for (uint64_t u : in.trainer_units) {
    const uint64_t b = 4 * ((u + in.world_size - 1) / in.world_size);
    for (int k = 0; k < (opt_nvme ? 2 : 5); ++k) resident.push_back(b);
  }
  uint64_t staging = c.spillway.bounce_buffers;
  if (c.offload_param.device == OffloadDevice::kNvme)
    staging += TransferPipelineOptions{}.staging_buffers;
  for (uint64_t i = 0; i < staging; ++i) resident.push_back(c.aio.block_size);
  const uint64_t gather = PageRound(4 * largest * in.world_size);
  const uint64_t streamed =
      opt_nvme ? (uint64_t{1} + c.PrefetchWindow()) * 3 * PageRound(4 * largest) : 0;
  const uint64_t committed_per_rank =
      ArenaCommitted(c.HostArenaOptions(), resident, std::max(gather, streamed));
  r->checkpoint_gather_bytes = Bytes(4 * in.params);
  // Save brings in, one at a time, the partitions that are neither host-homed nor cached: the
  // optimizer's state when it streams from NVMe.
  r->checkpoint_streamed_bytes = c.offload_optimizer.device == OffloadDevice::kNvme
                                     ? Bytes(4 * static_cast<double>(largest) * ranks_per_node)
                                     : 0;
  return committed_per_rank;
}

// Adds the lines up per rank: by place, and host and NVMe bytes by kind. Returns the host bytes
// per rank that a fork copies.
uint64_t SumLines(PlanReport* r) {
  uint64_t copied_per_rank = 0;
  for (const PlanLine& l : r->lines) {
    r->per_rank[static_cast<int>(l.place)] += l.bytes_per_rank;
    const size_t k = static_cast<size_t>(l.kind);
    if (l.place == Place::kHostPinned || l.place == Place::kHostPageable) {
      r->host_by_kind_per_rank[k] += l.bytes_per_rank;
      if (l.fork_copies) copied_per_rank += l.bytes_per_rank;
    } else if (l.place == Place::kNvme) {
      r->nvme_by_kind_per_rank[k] += l.bytes_per_rank;
    }
  }
  return copied_per_rank;
}

// The node's totals and peaks, Spillway's and the naive run's, and the host and NVMe headroom.
void AddNodeTotals(const PlanInput& in, uint64_t committed_per_rank, uint64_t copied_per_rank,
                   double ranks_per_node, PlanReport* r) {
  const Config& c = in.config;
  for (int k = 0; k < 4; ++k)
    r->per_node[k] = Bytes(static_cast<double>(r->per_rank[k]) * ranks_per_node);
  r->host_steady_per_node = r->per_node[1] + r->per_node[2];
  r->nvme_per_node = r->per_node[3];
  r->fork_extra_naive_per_node = Bytes(static_cast<double>(copied_per_rank) * ranks_per_node);
  r->host_committed_per_node =
      committed_per_rank == 0 ? r->host_steady_per_node
                              : Bytes(static_cast<double>(committed_per_rank) * ranks_per_node);
  r->fork_extra_spillway_per_node =
      c.spillway.fork_safety == allocator::ForkSafety::kInherit ? r->host_committed_per_node : 0;
  r->host_peak_naive_per_node =
      r->host_steady_per_node + r->checkpoint_gather_bytes + r->fork_extra_naive_per_node;
  r->host_peak_spillway_per_node =
      r->host_committed_per_node + r->checkpoint_streamed_bytes + r->fork_extra_spillway_per_node;
  r->host_headroom = static_cast<int64_t>(in.host_ram_bytes) -
                     static_cast<int64_t>(r->host_peak_spillway_per_node);
  r->nvme_headroom = static_cast<int64_t>(in.nvme_bytes) - static_cast<int64_t>(r->nvme_per_node);
}

// The GPU's bytes per rank against its memory less the reserve. Returns whether they fit (true
// when the GPU is not checked).
bool PlanGpu(const PlanInput& in, PlanReport* r) {
  r->gpu_per_rank = r->per_rank[static_cast<int>(Place::kGpu)];
  if (in.gpu_mem_bytes > 0) {
    r->gpu_reserve_bytes = Bytes(static_cast<double>(in.gpu_mem_bytes) * in.gpu_reserve_fraction);
    r->gpu_headroom = static_cast<int64_t>(in.gpu_mem_bytes) -
                      static_cast<int64_t>(r->gpu_reserve_bytes) -
                      static_cast<int64_t>(r->gpu_per_rank);
    return r->gpu_headroom >= 0;
  }
  return true;
}

// The plan without suggestions (they re-plan with changed settings).
Result<PlanReport> Compute(const PlanInput& in) {
  SPILLWAY_RETURN_IF_ERROR(CheckPlanInput(in));
  PlanReport r;
  r.runtime = in.runtime;
  uint64_t committed_per_rank = 0;  // 0: as the steady state
  const double ranks_per_node =
      static_cast<double>(in.world_size) / in.nodes;  // divisible: checked above
  if (in.runtime == Runtime::kTrainer) {
    SPILLWAY_ASSIGN_OR_RETURN(committed_per_rank, PlanTrainer(in, ranks_per_node, &r));
  } else {
    DeepSpeedLines(in, in.params / in.world_size, &r.lines);
    r.checkpoint_gather_bytes = Bytes(2 * in.params);
    r.checkpoint_streamed_bytes =
        Bytes(static_cast<double>(in.config.aio.block_size) *
              static_cast<double>(in.config.aio.queue_depth) * ranks_per_node);
  }
  const uint64_t copied_per_rank = SumLines(&r);
  AddNodeTotals(in, committed_per_rank, copied_per_rank, ranks_per_node, &r);
  const bool gpu_fits = PlanGpu(in, &r);
  const PhaseInput& ph = in.phases;
  bool phases_fit = true, naive_phases_fit = true;
  if (ph.rank_baseline_bytes > 0) {
    PlanPhases(in, copied_per_rank, &r);
    for (const PhasePeak& p : r.phases) {
      phases_fit = phases_fit && p.node <= in.host_ram_bytes;
      naive_phases_fit = naive_phases_fit && p.naive_node <= in.host_ram_bytes;
    }
  }
  r.fits = r.host_headroom >= 0 && r.nvme_headroom >= 0 && gpu_fits && phases_fit;
  r.naive_fits = r.host_peak_naive_per_node <= in.host_ram_bytes && r.nvme_headroom >= 0 &&
                 gpu_fits && naive_phases_fit;
  return r;
}

}  // namespace

const char* PlaceName(Place place) {
  switch (place) {
    case Place::kGpu:
      return "gpu";
    case Place::kHostPinned:
      return "host pinned";
    case Place::kHostPageable:
      return "host pageable";
    case Place::kNvme:
      return "nvme";
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
      {"zero_optimization.offload_optimizer.device = \"cpu\"",
       [](Config& c) { c.offload_optimizer.device = OffloadDevice::kCpu; }},
      {"offload_optimizer and offload_param both on \"cpu\"",
       [](Config& c) {
         c.offload_optimizer.device = OffloadDevice::kCpu;
         c.offload_param.device = OffloadDevice::kCpu;
       }},
      {"zero_optimization.offload_optimizer.device = \"nvme\"",
       [](Config& c) { c.offload_optimizer.device = OffloadDevice::kNvme; }},
      {"zero_optimization.offload_param.device = \"nvme\"",
       [](Config& c) { c.offload_param.device = OffloadDevice::kNvme; }},
      {"offload_optimizer and offload_param both on \"nvme\"",
       [](Config& c) {
         c.offload_optimizer.device = OffloadDevice::kNvme;
         c.offload_param.device = OffloadDevice::kNvme;
       }},
      {"sub_group_size = 1e8 (smaller optimizer swap buffers)",
       [](Config& c) { c.sub_group_size = 100'000'000; }},
      {"offload_optimizer.buffer_count = 2",
       [](Config& c) { c.offload_optimizer.buffer_count = 2; }},
  };
  for (const Try& t : tries) {
    PlanInput changed = input;
    t.apply(changed.config);
    if (changed.config.any_nvme() && changed.nvme_bytes == 0) continue;
    auto alt = Compute(changed);
    if (alt.ok() && alt->fits) {
      r->suggestions.push_back(StrCat(t.what, ": Spillway peak ",
                                      Gb(static_cast<double>(alt->host_peak_spillway_per_node)),
                                      " per node"));
    }
  }
  for (uint32_t nodes = input.nodes + 1; nodes <= input.world_size; ++nodes) {
    if (input.world_size % nodes != 0) continue;
    PlanInput more = input;
    more.nodes = nodes;
    auto alt = Compute(more);
    if (alt.ok() && alt->fits) {
      r->suggestions.push_back(
          StrCat("--nodes ", nodes, " (", input.world_size / nodes, " ranks per node)"));
      break;
    }
  }
  return r;
}

std::string PlanReport::ToString() const {
  std::ostringstream o;
  o << "state                                                  where           per rank\n";
  for (const PlanLine& l : lines) {
    o << l.what << std::string(l.what.size() < 55 ? 55 - l.what.size() : 1, ' ')
      << PlaceName(l.place) << std::string(16 - std::string(PlaceName(l.place)).size(), ' ')
      << Gb(static_cast<double>(l.bytes_per_rank)) << "\n";
  }
  o << "\nper node: gpu " << Gb(static_cast<double>(per_node[0])) << ", host pinned "
    << Gb(static_cast<double>(per_node[1])) << ", host pageable "
    << Gb(static_cast<double>(per_node[2])) << ", nvme " << Gb(static_cast<double>(per_node[3]))
    << "\n";
  const bool trainer = runtime == Runtime::kTrainer;
  if (trainer) {
    o << "host arena after a step: " << Gb(static_cast<double>(host_committed_per_node))
      << " per node held from the OS (regions, the step's transients it keeps)\n";
    o << "end-of-epoch checkpoint: gathering the model to host would hold "
      << Gb(static_cast<double>(checkpoint_gather_bytes)) << " on node 0; Trainer::Save holds "
      << Gb(static_cast<double>(checkpoint_streamed_bytes))
      << " per node beyond the steady state\n";
  } else {
    o << "end-of-epoch checkpoint: DeepSpeed gathers "
      << Gb(static_cast<double>(checkpoint_gather_bytes))
      << " into node 0's host memory; Spillway streams through "
      << Gb(static_cast<double>(checkpoint_streamed_bytes)) << "\n";
  }
  o << "fork of the trainer, first optimizer step after it: +"
    << Gb(static_cast<double>(fork_extra_naive_per_node)) << " per node without fork-safe arenas, +"
    << Gb(static_cast<double>(fork_extra_spillway_per_node)) << " with Spillway\n";
  o << "host peak per node: " << (trainer ? "without Spillway's arena " : "DeepSpeed defaults ")
    << Gb(static_cast<double>(host_peak_naive_per_node))
    << (naive_fits ? " (fits)" : " (does not fit)") << ", Spillway "
    << Gb(static_cast<double>(host_peak_spillway_per_node)) << "\n";
  if (gpu_reserve_bytes > 0 && trainer) {
    o << "gpu: the trainer keeps no model states on the GPU between steps (its gathered unit and "
         "activations are not modelled); reserve "
      << Gb(static_cast<double>(gpu_reserve_bytes)) << "\n";
  } else if (gpu_reserve_bytes > 0) {
    o << "gpu: model states " << Gb(static_cast<double>(gpu_per_rank)) << " per GPU + reserve "
      << Gb(static_cast<double>(gpu_reserve_bytes)) << " (activations, context; --gpu-reserve)"
      << (gpu_headroom >= 0 ? ": fits" : ": does not fit") << "\n";
  }
  o << "verdict: " << (fits ? "fits" : "does not fit") << " (host headroom "
    << Gb(static_cast<double>(host_headroom)) << ", nvme headroom "
    << Gb(static_cast<double>(nvme_headroom));
  if (gpu_reserve_bytes > 0) o << ", gpu headroom " << Gb(static_cast<double>(gpu_headroom));
  o << ")\n";
  for (const std::string& s : suggestions) o << "  would fit with " << s << "\n";
  if (!phases.empty()) {
    auto cell = [&](const std::string& text, size_t width) {
      o << text << std::string(text.size() < width ? width - text.size() : 1, ' ');
    };
    o << "\n";
    cell("phase peaks on node 0 (Note [Phase peaks])", 44);
    cell("rank 0", 12);
    cell("other rank", 12);
    cell("node", 12);
    o << "DeepSpeed defaults\n";
    for (const PhasePeak& p : phases) {
      cell(StrCat("  ", p.name), 44);
      cell(Gb(static_cast<double>(p.rank0)), 12);
      cell(Gb(static_cast<double>(p.other_rank)), 12);
      cell(Gb(static_cast<double>(p.node)), 12);
      o << Gb(static_cast<double>(p.naive_node)) << "\n";
    }
    if (!phases_note.empty()) o << "  (" << phases_note << ")\n";
  }
  return o.str();
}

}  // namespace spillway::offload
