// The reference ZeRO-3 trainer (libtorch): the GPT of model.h, each unit's flat fp32 parameter
// vector partitioned across ranks in the PartitionStore. Per micro-batch: for each unit gather ->
// forward
// -> release (activation checkpoints at unit boundaries only); backward in reverse, recomputing
// each unit from its checkpoint, reduce-scattering its gradient into this rank's partition;
// gradient accumulation over micro-batches; then the host optimizer step (streamed from NVMe when
// the optimizer state lives there). Steps bracket the ledger's BeginStep/EndStep. See
// docs/engine.md, Note [Trainer].
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/ledger.h"
#include "spillway/base/status.h"
#include "spillway/engine/checkpoint_file.h"
#include "spillway/engine/host_optimizer.h"
#include "spillway/engine/streamed_step.h"
#include "spillway/offload/device_guard.h"
#include "spillway/offload/partition_store.h"
#include "spillway/offload/transfer_pipeline.h"
#include "spillway/trainer/collectives.h"
#include "spillway/trainer/compute_device.h"
#include "spillway/trainer/model.h"

namespace spillway::trainer {

struct TrainerOptions {
  GptConfig model;
  // The optimizer step always runs on the host (it is the offloaded optimizer); parameters are
  // gathered into pinned host memory and copied to this device per unit, gradients come back to
  // their host partitions per unit.
  torch::Device compute = torch::kCPU;
  engine::AdamWConfig adam;
  uint32_t optimizer_threads = 0;
  double max_grad_norm = 0.0;  // 0: no clipping
  // The path from NVMe to `compute` (offload::Tiers::OpenDevicePipeline makes it): parameters
  // homed on NVMe reach the compute device through it, the next unit's while this one computes
  // (Note [Trainer pipeline] in docs/engine.md). Its device must be `compute`. Null: every
  // parameter is gathered in host memory and copied to `compute` from there.
  offload::TransferPipeline* pipeline = nullptr;
  // Hands the store each step's access order (Note [Schedule] in docs/engine.md), so that it
  // spills the partition used furthest ahead and swaps the next ones in ahead of use. Off: the
  // store has no schedule (every next use looks equally far; the bench's baseline).
  bool schedule = true;

  // Takes the optimizer settings of a DeepSpeed config's training keys (optimizer.type and
  // .params, gradient_clipping); the model, device and threads are left as they are.
  void ApplyTraining(const offload::TrainingConfig& tc);
};

struct TrainStepResult {
  double loss = 0.0;                   // mean over micro-batches and ranks
  engine::StepReport report;           // the optimizer's
  allocator::BoundaryReport boundary;  // the ledger's EndStep report (empty without a ledger)
  engine::StreamedStepStats stream;    // when the optimizer state streamed from NVMe
};

// Save and Load (Note [Checkpoint] in docs/checkpoint.md).
struct CheckpointOptions {
  allocator::IoEngine* io = nullptr;  // required: every byte goes through it
  // The caller's own state (a JSON object: the data position, its settings), kept in the
  // manifest and handed back by Load.
  std::string extra_json = "{}";
  // Checkpoints kept in the directory after a save, newest first (the one just written counts);
  // 0 keeps every one. Saving never removes the previous checkpoint before the new one is in place.
  int keep = 2;
  engine::checkpoint::FaultHook fault_hook;  // test seam: see checkpoint_file.h; the trainer adds
                                             // "manifest", "rename" and "latest" (before each)
};

struct CheckpointInfo {
  std::string path;        // the checkpoint's own directory (DIR/step-N)
  int64_t step = 0;        // optimizer steps applied when it was saved
  std::string extra_json;  // CheckpointOptions::extra_json of the save
};

// Owned by one thread; collectives are issued in the same order on every rank.
class Trainer {
 public:
  // The store decides each state's home from the DeepSpeed config it was created with. The
  // ledger may be null. Every pointer must outlive the trainer.
  static Result<std::unique_ptr<Trainer>> Create(
      const TrainerOptions& options, Collectives* collectives, offload::PartitionStore* store,
      allocator::HostArena* arena, allocator::Ledger* ledger, allocator::ScopeId scope);
  ~Trainer();

  // One optimizer step over this rank's micro-batches (int64 tokens [B, T + 1], T <= seq_len, on
  // the cpu or the compute device; gradients are averaged over all of them and over ranks). Every
  // micro-batch is checked by the device guard before any runs. A micro-batch that fails abandons
  // the step: nothing is applied, its gradients are zeroed, and the ledger step is closed. A failed
  // optimizer step ends the same way, and its error says which units already took the step.
  Result<TrainStepResult> Step(const std::vector<torch::Tensor>& micro_batches);
  // The full parameters of one unit, on the host (an all-gather: call it on every rank).
  Result<torch::Tensor> GatherUnit(int64_t unit);
  engine::HostOptimizer& optimizer() { return *optimizer_; }
  // Fault-injection seam for tests: called with the unit index before each unit's forward; what
  // it throws takes the path a libtorch exception takes (the step is abandoned with a status).
  void SetFaultHookForTesting(std::function<void(int64_t unit)> hook) {
    fault_hook_ = std::move(hook);
  }
  // Where the per-unit all-gather and reduce-scatter run: on the compute device when it is a GPU
  // and the group has a CUDA backend (NCCL), else on the host (Note [Device collectives]).
  torch::Device collectives_device() const {
    return DeviceCollectives() ? options_.compute : torch::Device(torch::kCPU);
  }
  int64_t steps() const { return steps_; }

  // Writes a checkpoint of this trainer into `dir` (created if needed) as DIR/step-N, N = steps():
  // one safetensors file per rank with its partitions (parameters, fp32 master, both moments) and
  // the torch CPU generator's state, streamed from wherever the store keeps them (one partition at
  // a time; the NVMe-homed ones pass through the store's host slot) through the io_uring engine;
  // then a manifest with the world size, the model, the dtypes and a CRC32C per tensor; then
  // DIR/latest names it. Every rank calls it between steps; each step of it is agreed by all ranks
  // before the next, so an error on one rank is an error on all. A save that fails or is killed
  // leaves the previous checkpoint (and `latest`) as they were.
  Result<CheckpointInfo> Save(const std::string& dir, const CheckpointOptions& options);
  // Restores what Save wrote: `dir` is the directory given to Save (its `latest` is loaded) or one
  // checkpoint's own directory. Every rank calls it. A wrong world size, a missing rank file, a
  // model whose shapes differ, and a byte whose CRC32C does not match are refused, naming the
  // file, the tensor and what to change, before anything in the trainer changes.
  Result<CheckpointInfo> Load(const std::string& dir, const CheckpointOptions& options);

 private:
  struct Unit {
    int64_t numel = 0;
    int64_t shard = 0;  // elements per rank (numel padded up to world * shard)
    offload::PartitionId param = 0, grad = 0, master = 0, exp_avg = 0, exp_avg_sq = 0;
  };
  Trainer(const TrainerOptions& options, Collectives* collectives, offload::PartitionStore* store,
          allocator::HostArena* arena, allocator::Ledger* ledger, allocator::ScopeId scope,
          std::unique_ptr<engine::HostOptimizer> optimizer);
  Status Init();
  Result<torch::Tensor> Gather(int64_t unit);  // arena-backed, step lifetime
  // On options_.compute. `ahead`, when valid, is this unit's DeviceShard started earlier.
  Result<torch::Tensor> GatherToCompute(int64_t unit,
                                        std::future<Result<torch::Tensor>>* ahead = nullptr);
  // Whether unit `u`'s parameters come through the pipeline (homed on NVMe, a pipeline given, and
  // a gather that can run where the shard lands).
  bool OnPipeline(int64_t u) const;
  // This rank's shard of unit `u` as a device view on options_.compute, through the pipeline; the
  // view is released when the tensor dies.
  Result<torch::Tensor> DeviceShard(int64_t u);
  // DeviceShard(u) started on the helper thread, so the transfer overlaps the caller's compute;
  // invalid when `u` is out of range or not OnPipeline.
  std::future<Result<torch::Tensor>> ShardAhead(int64_t u);
  class AheadThread;  // one persistent helper thread running ShardAhead's transfers in order
  bool DeviceCollectives() const;
  Status ReduceGrad(int64_t unit, const torch::Tensor& grad);
  // The device guard on every micro-batch before any runs: on the cpu or the compute device,
  // int64, dense, [B, T + 1], ids below vocab. INVALID_ARGUMENT naming the batch and the fix.
  Status CheckMicroBatches(const std::vector<torch::Tensor>& micro_batches) const;
  Status MicroBatch(const torch::Tensor& tokens, double scale, double* loss);
  // `applied`: how many units (in order) took the step, also when it fails.
  Result<engine::StepReport> OptimizerStep(engine::StreamedStepStats* stream, size_t* applied);
  Status ZeroGrads();
  // One step's partition accesses in order, for `micro_batches` micro-batches.
  std::vector<offload::PartitionId> Schedule(size_t micro_batches) const;
  std::vector<engine::checkpoint::TensorSpec> CheckpointSpecs(uint64_t rng_bytes) const;
  // Every rank's `local` outcome: OK only when every rank's is (the ranks stay in step).
  Status Agree(const Status& local, const char* what);

  const TrainerOptions options_;
  Collectives* const coll_;
  offload::PartitionStore* const store_;
  allocator::HostArena* const arena_;
  allocator::Ledger* const ledger_;
  const allocator::ScopeId scope_;
  std::unique_ptr<engine::HostOptimizer> optimizer_;
  std::vector<Unit> units_;
  std::unique_ptr<AheadThread> ahead_;  // with a pipeline only
  std::function<void(int64_t)> fault_hook_;
  Status out_of_step_;    // a failed optimizer step with world size > 1: every later Step refuses
  int64_t steps_ = 0;     // applied
  int64_t attempts_ = 0;  // begun (the ledger's step numbers)
  size_t scheduled_micro_batches_ = 0;  // the schedule the store holds; 0: none yet
};

}  // namespace spillway::trainer
