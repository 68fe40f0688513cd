// The reference ZeRO-3 trainer (libtorch): a small GPT-style model written as a sequence of units
// (embedding, N transformer blocks, head), each unit's parameters one flat fp32 vector
// partitioned across ranks in the PartitionStore. Per micro-batch: for each unit gather -> forward
// -> release (activation checkpoints at unit boundaries only); backward in reverse, recomputing
// each unit from its checkpoint, reduce-scattering its gradient into this rank's partition;
// gradient accumulation over micro-batches; then the host optimizer step (streamed from NVMe when
// the optimizer state lives there). Steps bracket the ledger's BeginStep/EndStep. See
// docs/engine.md, Note [Trainer].
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/status.h"
#include "spillway/engine/collectives.h"
#include "spillway/engine/host_optimizer.h"
#include "spillway/engine/streamed_step.h"
#include "spillway/offload/partition_store.h"

namespace spillway::engine {

struct GptConfig {
  int64_t vocab = 96;
  int64_t d_model = 64;
  int64_t n_layer = 2;
  int64_t n_head = 4;
  int64_t seq_len = 32;
  uint64_t seed = 1234;
};

// The model, as plain functions so that a plain libtorch training loop (the tests' reference)
// runs exactly the same math. Unit 0 is the embedding, 1..n_layer the blocks, n_layer+1 the head.
namespace gpt {
int64_t Units(const GptConfig& c);
int64_t UnitNumel(const GptConfig& c, int64_t unit);
torch::Tensor InitUnit(const GptConfig& c, int64_t unit);  // deterministic from c.seed
// x: token ids [B, T] for unit 0, hidden states [B, T, d_model] otherwise. Returns hidden states,
// or logits [B, T, vocab] from the head.
torch::Tensor Forward(const GptConfig& c, int64_t unit, const torch::Tensor& flat,
                      const torch::Tensor& x);
torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& targets);
}  // namespace gpt

// Where the forward and backward math runs: "auto" (this local rank's CUDA device when libtorch
// sees one, else the CPU), "cpu", "cuda" (this local rank's) or "cuda:N". Local rank r takes
// cuda:r, torchrun's layout, so ranks on one node never share a GPU (NCCL refuses that); a local
// rank without a GPU of its own is an error, as is an explicit CUDA device that libtorch cannot
// use: never a silent fall back to the CPU.
Result<torch::Device> ResolveComputeDevice(const std::string& spec, int local_rank = 0);

struct TrainerOptions {
  GptConfig model;
  // The optimizer step always runs on the host (it is the offloaded optimizer); parameters are
  // gathered into pinned host memory and copied to this device per unit, gradients come back to
  // their host partitions per unit.
  torch::Device compute = torch::kCPU;
  AdamWConfig adam;
  uint32_t optimizer_threads = 0;
  double max_grad_norm = 0.0;  // 0: no clipping

  // Takes the optimizer settings of a DeepSpeed config's training keys (optimizer.type and
  // .params, gradient_clipping); the model, device and threads are left as they are.
  void ApplyTraining(const offload::TrainingConfig& tc);
};

struct TrainStepResult {
  double loss = 0.0;  // mean over micro-batches and ranks
  StepReport report;  // the optimizer's
  allocator::BoundaryReport boundary;  // the ledger's EndStep report (empty without a ledger)
  StreamStats stream;                  // when the optimizer state streamed from NVMe
};

// Owned by one thread; collectives are issued in the same order on every rank.
class Trainer {
 public:
  // The store decides each state's home from the DeepSpeed config it was created with. The
  // ledger may be null. Every pointer must outlive the trainer.
  static Result<std::unique_ptr<Trainer>> Create(const TrainerOptions& options,
                                                 Collectives* collectives,
                                                 offload::PartitionStore* store,
                                                 allocator::HostArena* arena,
                                                 allocator::Ledger* ledger,
                                                 allocator::ScopeId scope);
  ~Trainer();

  // One optimizer step over this rank's micro-batches (int64 tokens [B, T + 1], T <= seq_len;
  // gradients are averaged over all of them and over ranks). A micro-batch that fails abandons the
  // step: nothing is applied, its gradients are zeroed, and the ledger step is closed. A failed
  // optimizer step ends the same way, and its error says which units already took the step.
  Result<TrainStepResult> Step(const std::vector<torch::Tensor>& micro_batches);
  // The full parameters of one unit, on the host (an all-gather: call it on every rank).
  Result<torch::Tensor> GatherUnit(int64_t unit);
  HostOptimizer& optimizer() { return *optimizer_; }
  // Fault-injection seam for tests: called with the unit index before each unit's forward; what
  // it throws takes the path a libtorch exception takes (the step is abandoned with a status).
  void SetFaultHookForTesting(std::function<void(int64_t unit)> hook) { fault_hook_ = std::move(hook); }
  // Where the per-unit all-gather and reduce-scatter run: on the compute device when it is a GPU
  // and the group has a CUDA backend (NCCL), else on the host (Note [Device collectives]).
  torch::Device collectives_device() const {
    return DeviceCollectives() ? options_.compute : torch::Device(torch::kCPU);
  }
  int64_t steps() const { return steps_; }

 private:
  struct Unit;
  Trainer(const TrainerOptions& options, Collectives* collectives, offload::PartitionStore* store,
          allocator::HostArena* arena, allocator::Ledger* ledger, allocator::ScopeId scope,
          std::unique_ptr<HostOptimizer> optimizer);
  Status Init();
  Result<torch::Tensor> Gather(int64_t unit);  // arena-backed, step lifetime
  Result<torch::Tensor> GatherToCompute(int64_t unit);  // on options_.compute
  bool DeviceCollectives() const;
  Status ReduceGrad(int64_t unit, const torch::Tensor& grad);
  Status MicroBatch(const torch::Tensor& tokens, double scale, double* loss);
  // `applied`: how many units (in order) took the step, also when it fails.
  Result<StepReport> OptimizerStep(StreamStats* stream, size_t* applied);
  Status ZeroGrads();

  const TrainerOptions options_;
  Collectives* const coll_;
  offload::PartitionStore* const store_;
  allocator::HostArena* const arena_;
  allocator::Ledger* const ledger_;
  const allocator::ScopeId scope_;
  std::unique_ptr<HostOptimizer> optimizer_;
  std::vector<Unit> units_;
  std::function<void(int64_t)> fault_hook_;
  Status out_of_step_;    // a failed optimizer step with world size > 1: every later Step refuses
  int64_t steps_ = 0;     // applied
  int64_t attempts_ = 0;  // begun (the ledger's step numbers)
};

}  // namespace spillway::engine
