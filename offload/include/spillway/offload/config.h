// Config: a DeepSpeed JSON config read once and validated: the keys Spillway acts on
// (zero_optimization.offload_param / offload_optimizer, aio, sub_group_size) with DeepSpeed's
// names and defaults, plus a `spillway` section of our own. See docs/offload.md, Note [Config].
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/allocator/owner.h"
#include "spillway/base/status.h"

namespace spillway::offload {

enum class OffloadDevice : uint8_t { kNone = 0, kCpu, kNvme };
const char* OffloadDeviceName(OffloadDevice device);

struct OffloadParamConfig {  // zero_optimization.offload_param
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  uint64_t buffer_count = 5;
  uint64_t buffer_size = 100'000'000;   // elements
  uint64_t max_in_cpu = 1'000'000'000;  // elements
  bool pin_memory = false;
};

struct OffloadOptimizerConfig {  // zero_optimization.offload_optimizer
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  uint64_t buffer_count = 4;
  bool pin_memory = false;
  bool pipeline_read = false;
  bool pipeline_write = false;
  bool fast_init = false;
  double ratio = 1.0;
};

struct AioConfig {  // aio
  uint64_t block_size = 1 << 20;
  uint64_t queue_depth = 8;
  uint64_t intra_op_parallelism = 1;
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;
};

// DeepSpeed's training keys, which the reference trainer (engine/) acts on; the offload layer does
// not. DeepSpeed's defaults.
struct TrainingConfig {
  uint64_t micro_batch_size = 1;             // train_micro_batch_size_per_gpu
  uint64_t gradient_accumulation_steps = 1;  // gradient_accumulation_steps
  double gradient_clipping = 0.0;            // gradient_clipping; 0: off
  std::string optimizer = "AdamW";           // optimizer.type: "Adam" (L2) or "AdamW"
  double lr = 1e-3;                          // optimizer.params.lr
  double beta1 = 0.9, beta2 = 0.999;         // optimizer.params.betas
  double eps = 1e-8;                         // optimizer.params.eps
  double weight_decay = 0.0;                 // optimizer.params.weight_decay
};

// Which resident partition the store spills first over the host budget. kOpt: the one whose next
// use under the trainer's schedule is furthest away (Belady's OPT; without a schedule every
// partition ties and the lowest-numbered goes). kLru: the one acquired longest ago, for comparison
// with OPT.
enum class Eviction : uint8_t { kOpt, kLru };

struct SpillwayConfig {            // spillway (ours)
  uint64_t host_budget_bytes = 0;  // 0: 3/4 of physical memory
  uint64_t nvme_budget_bytes = 0;  // 0: 90% of the free space at nvme_path, found at start
  allocator::EscapePolicy host_escape_policy = allocator::EscapePolicy::kReport;
  allocator::EscapePolicy nvme_escape_policy = allocator::EscapePolicy::kReport;
  std::string metrics_address = "127.0.0.1:9464";  // "off" disables the exporter
  bool checksum = true;
  allocator::ForkSafety fork_safety = allocator::ForkSafety::kDontFork;
  bool capture_backtraces = false;
  uint64_t retain_limit_bytes = allocator::HostArenaOptions{}.retain_limit_bytes;
  double peak_slack = allocator::HostArenaOptions{}.peak_slack;
  // The host arena's shared regions (smaller requests share them) and the I/O engine's bounce
  // buffers (block_size each, from the arena, for buffers outside it): small runs lower both.
  uint64_t host_region_bytes = allocator::HostArenaOptions{}.region_bytes;
  uint64_t bounce_buffers = allocator::IoEngineOptions{}.bounce_buffers;
  // Where partitions spill over the host budget when the config offloads to "cpu" and homes nothing
  // on NVMe: a swap file in this directory (its budget: nvme_budget_bytes, else 90% of the free
  // space there). Empty: $TMPDIR, else /var/tmp.
  std::string spill_path;
  // Partitions of the step's schedule the store swaps in ahead of use (a background thread).
  // zero_optimization.stage3_prefetch_bucket_size = 0 turns it off, as it turns off DeepSpeed's.
  uint64_t prefetch_partitions = 2;
  Eviction eviction = Eviction::kOpt;
};

// "68719476736", "64GiB", "512 MiB", "1.5TB", "34e9": a positive byte count. Units: B, KiB, MiB,
// GiB, TiB (powers of 1024), KB, MB, GB, TB (powers of 1000). INVALID_ARGUMENT names the text.
Result<uint64_t> ParseByteSize(std::string_view text);

struct Config {
  int zero_stage = 0;
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
  uint64_t sub_group_size = 1'000'000'000;     // elements
  uint64_t prefetch_bucket_size = 50'000'000;  // zero_optimization.stage3_prefetch_bucket_size
  uint64_t reduce_bucket_size = 500'000'000;   // zero_optimization.reduce_bucket_size (elements)
  AioConfig aio;
  TrainingConfig training;
  SpillwayConfig spillway;
  // DeepSpeed keys present in the file that Spillway accepts but does not act on ("fp16",
  // "zero_optimization.overlap_comm", ...), listed once in a warning by Parse.
  std::vector<std::string> ignored_keys;

  // Reads a JSON document. Errors name the key (as a dotted path), what it was, and what is
  // allowed. An unknown key under "spillway" is an error; unknown DeepSpeed keys are ignored_keys,
  // named in a warning unless `warn_ignored` is false (the config of a DeepSpeed run, which
  // Spillway only reads to plan: DeepSpeed acts on those keys).
  static Result<Config> Parse(std::string_view json, bool warn_ignored = true);
  static Result<Config> Load(const std::string& path);

  // The settings each allocator-layer component takes, derived in one place.
  allocator::HostArenaOptions HostArenaOptions() const;
  allocator::IoEngineOptions EngineOptions(allocator::HostArena* arena) const;
  // For offload_param or offload_optimizer on nvme (the optimizer's path wins when both are set).
  allocator::NvmeArenaOptions NvmeArenaOptions() const;
  // The spill arena's settings when nothing is homed on NVMe (spillway.spill_path).
  allocator::NvmeArenaOptions SpillArenaOptions() const;
  // The store's prefetch window: spillway.prefetch_partitions, 0 when prefetching is off.
  uint32_t PrefetchWindow() const {
    return prefetch_bucket_size == 0 ? 0 : static_cast<uint32_t>(spillway.prefetch_partitions);
  }
  bool any_nvme() const {
    return offload_param.device == OffloadDevice::kNvme ||
           offload_optimizer.device == OffloadDevice::kNvme;
  }
};

}  // namespace spillway::offload
