// The reference ZeRO-3 trainer. See trainer.h and docs/engine.md, Note [Trainer].
#include "spillway/trainer/trainer.h"

#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "catch_torch.h"
#include "spillway/base/log.h"
#include "spillway/offload/device_guard.h"
#include "spillway/torch_alloc/tensors.h"

namespace spillway::trainer {

void TrainerOptions::ApplyTraining(const offload::TrainingConfig& tc) {
  adam.lr = tc.lr;
  adam.beta1 = tc.beta1;
  adam.beta2 = tc.beta2;
  adam.eps = tc.eps;
  adam.weight_decay = tc.weight_decay;
  adam.adamw_mode = tc.optimizer == "AdamW";
  max_grad_norm = tc.gradient_clipping;
}

Trainer::Trainer(const TrainerOptions& options, Collectives* collectives,
                 offload::PartitionStore* store, allocator::HostArena* arena,
                 allocator::Ledger* ledger, allocator::ScopeId scope,
                 std::unique_ptr<engine::HostOptimizer> optimizer)
    : options_(options),
      coll_(collectives),
      store_(store),
      arena_(arena),
      ledger_(ledger),
      scope_(scope),
      optimizer_(std::move(optimizer)) {}

Trainer::~Trainer() = default;

Result<std::unique_ptr<Trainer>> Trainer::Create(
    const TrainerOptions& options, Collectives* collectives, offload::PartitionStore* store,
    allocator::HostArena* arena, allocator::Ledger* ledger, allocator::ScopeId scope) {
  const GptConfig& m = options.model;
  if (collectives == nullptr || store == nullptr || arena == nullptr) {
    return Status::InvalidArgument("Trainer needs collectives, a partition store and a host arena");
  }
  if (m.vocab < 2 || m.d_model < 1 || m.n_layer < 0 || m.n_head < 1 || m.seq_len < 1 ||
      m.d_model % m.n_head != 0) {
    return Status::InvalidArgument(StrCat("GPT config vocab=", m.vocab, " d_model=", m.d_model,
                                          " n_layer=", m.n_layer, " n_head=", m.n_head,
                                          " seq_len=", m.seq_len,
                                          " is impossible; d_model must be a multiple of "
                                          "n_head and every size positive"));
  }
  if (options.compute.is_cuda() &&
      (!torch::cuda::is_available() ||
       options.compute.index() >= static_cast<int64_t>(torch::cuda::device_count()))) {
    return Status::Make(
        StatusCode::kUnavailable,
        StrCat("the trainer's compute device ", options.compute.str(),
               " is not usable by this libtorch; resolve it with ResolveComputeDevice(\"auto\")"));
  }
  if (!options.compute.is_cpu() && !options.compute.is_cuda()) {
    return Status::InvalidArgument(
        StrCat("compute device ", options.compute.str(), " is not supported; use cpu or cuda"));
  }
  if (options.pipeline != nullptr) {
    // The device guard: the device views the pipeline fills must be on the compute device.
    const offload::DeviceId want = ToDeviceId(options.compute);
    const offload::DeviceId have = options.pipeline->device()->id();
    if (!(have == want)) {
      return Status::InvalidArgument(
          StrCat("TrainerOptions::pipeline moves partitions to ", have.ToString(),
                 " but the trainer computes on ", want.ToString(),
                 "; open the pipeline on the compute device (Tiers::OpenDevicePipeline)"));
    }
    SPILLWAY_RETURN_IF_ERROR(
        store->AttachDevice(options.pipeline).WithContext("TrainerOptions::pipeline"));
  }
  engine::HostOptimizerOptions oo;
  oo.adam = options.adam;
  oo.threads = options.optimizer_threads;
  SPILLWAY_ASSIGN_OR_RETURN(auto opt, engine::HostOptimizer::Create(oo));
  std::unique_ptr<Trainer> t(
      new Trainer(options, collectives, store, arena, ledger, scope, std::move(opt)));
  SPILLWAY_RETURN_IF_ERROR(t->Init());
  return t;
}

Status Trainer::Init() {
  const int64_t world = coll_->world_size(), rank = coll_->rank();
  for (int64_t u = 0; u < gpt::Units(options_.model); ++u) {
    Unit unit;
    unit.numel = gpt::UnitNumel(options_.model, u);
    unit.shard = (unit.numel + world - 1) / world;
    const uint64_t bytes = static_cast<uint64_t>(unit.shard) * 4;
    const auto key = [&](offload::StateKind k) {
      return offload::PartitionKey{static_cast<uint32_t>(rank), static_cast<uint32_t>(u), k};
    };
    offload::PartitionId* ids[] = {&unit.param, &unit.grad, &unit.master, &unit.exp_avg,
                                   &unit.exp_avg_sq};
    const offload::StateKind kinds[] = {offload::StateKind::kParam, offload::StateKind::kGrad,
                                        offload::StateKind::kMasterWeight,
                                        offload::StateKind::kExpAvg, offload::StateKind::kExpAvgSq};
    for (int k = 0; k < 5; ++k) {
      SPILLWAY_ASSIGN_OR_RETURN(auto id, store_->Register(key(kinds[k]), bytes));
      *ids[k] = id;
    }
    // This rank's slice of the deterministic initial weights, zero-padded.
    torch::Tensor full = torch::zeros({unit.shard * world});
    full.narrow(0, 0, unit.numel).copy_(gpt::InitUnit(options_.model, u));
    const float* mine = full.data_ptr<float>() + rank * unit.shard;
    for (offload::PartitionId id : {unit.param, unit.master}) {
      SPILLWAY_ASSIGN_OR_RETURN(auto v, store_->Acquire(id, offload::Access::kReadWrite));
      std::memcpy(v.data(), mine, bytes);
      SPILLWAY_RETURN_IF_ERROR(store_->Release(v));
    }
    units_.push_back(unit);
  }
  return Status::Ok();
}

Result<torch::Tensor> Trainer::Gather(int64_t u) {
  const Unit& unit = units_[u];
  const uint64_t full_elems = static_cast<uint64_t>(unit.shard * coll_->world_size());
  // Freed back to the arena when the last reference (autograd's included) dies.
  SPILLWAY_ASSIGN_OR_RETURN(
      torch::Tensor full,
      torch_alloc::TransientTensor(
          arena_, static_cast<int64_t>(full_elems),
          allocator::OwnerTag{allocator::Kind::kTransient, allocator::Lifetime::kStep,
                              static_cast<uint64_t>(u), scope_, SPILLWAY_SITE}));
  void* buf = full.data_ptr();
  SPILLWAY_ASSIGN_OR_RETURN(auto v, store_->Acquire(unit.param, offload::Access::kRead));
  Status st = coll_->AllGather(static_cast<const float*>(v.data()),
                               static_cast<uint64_t>(unit.shard), static_cast<float*>(buf));
  SPILLWAY_RETURN_IF_ERROR(store_->Release(v));
  SPILLWAY_RETURN_IF_ERROR(st);
  return full.narrow(0, 0, unit.numel);
}

bool Trainer::DeviceCollectives() const {
  return options_.compute.is_cuda() && coll_->HasBackendFor(options_.compute.type());
}

bool Trainer::OnPipeline(int64_t u) const {
  return options_.pipeline != nullptr &&
         store_->home(units_[u].param) == offload::Placement::kNvme &&
         (coll_->world_size() == 1 || options_.compute.is_cpu() || DeviceCollectives());
}

Result<torch::Tensor> Trainer::DeviceShard(int64_t u) {
  const Unit& unit = units_[u];
  SPILLWAY_ASSIGN_OR_RETURN(
      auto h, store_->Acquire(unit.param, offload::Access::kRead, offload::Placement::kDevice));
  SPILLWAY_ASSIGN_OR_RETURN(auto data, h.Data());
  auto handle = std::make_shared<offload::Handle>(std::move(h));
  offload::PartitionStore* store = store_;
  torch::Tensor t;
  SPILLWAY_RETURN_IF_ERROR(CatchTorch("wrapping a device view", [&]() -> Status {
    t = torch::from_blob(
        data, {unit.shard},
        [handle, store](void*) {
          Status st = store->Release(*handle);
          if (!st.ok())
            Log(LogLevel::kError, StrCat("releasing a parameter's device view: ", st.ToString()));
        },
        torch::TensorOptions().dtype(torch::kFloat32).device(options_.compute));
    return Status::Ok();
  }));
  return t;
}

// A thread of its own for the transfers ahead (not one per transfer: thread stacks that glibc
// caches and reuses are heap a fork copies). Tasks run in submission order.
class Trainer::AheadThread {
 public:
  AheadThread() : thread_([this] { Loop(); }) {}
  ~AheadThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();  // tasks still queued run first: every future handed out is fulfilled
  }
  std::future<Result<torch::Tensor>> Submit(std::function<Result<torch::Tensor>()> fn) {
    std::packaged_task<Result<torch::Tensor>()> task(std::move(fn));
    auto f = task.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_all();
    return f;
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_, and nothing left
      {
        auto task = std::move(tasks_.front());
        tasks_.pop_front();
        lock.unlock();
        task();  // an exception reaches the future
      }          // the task goes before the lock is taken again
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<Result<torch::Tensor>()>> tasks_;  // guarded by mu_
  bool stop_ = false;                                              // guarded by mu_
  std::thread thread_;
};

namespace {
// Takes a transfer started ahead before its scope is left on any path (an error, an exception), so
// no device view outlives the step: the optimizer then takes the same partitions on the host.
struct TakeAhead {
  std::future<Result<torch::Tensor>>& f;
  ~TakeAhead() {
    if (!f.valid()) return;
    try {
      Result<torch::Tensor> unused = f.get();  // the view dies here, on this thread
      if (!unused.ok())
        Log(LogLevel::kWarning,
            StrCat("a transfer ahead of an abandoned unit: ", unused.status().ToString()));
    } catch (const std::exception& e) {
      Log(LogLevel::kWarning, StrCat("a transfer ahead of an abandoned unit threw: ", e.what()));
    }
  }
};

// What Step's error says of a failed optimizer step: how many of the `n` units took Adam step
// `adam_step` before it failed.
std::string OptimizerFailure(size_t applied, size_t n, uint64_t adam_step) {
  return applied == 0   ? std::string("failed in the optimizer before any unit took the step")
         : applied == n ? StrCat("failed in the optimizer after all ", n,
                                 " units took the step (Adam step ", adam_step, ")")
                        : StrCat("failed in the optimizer after units 0..", applied - 1, " of ", n,
                                 " took the step (Adam step ", adam_step, "); units ", applied,
                                 "..", n - 1, " did not");
}

// The streamed step's group of unit `u` (a Trainer::Unit): its optimizer state partitions; the
// gradient and parameter views are the caller's to set.
template <typename Unit>
engine::StreamedGroup StreamedGroupOf(const Unit& unit, size_t u) {
  engine::StreamedGroup g;
  g.name = StrCat("unit ", u);
  g.numel = static_cast<uint64_t>(unit.shard);
  g.master = unit.master;
  g.exp_avg = unit.exp_avg;
  g.exp_avg_sq = unit.exp_avg_sq;
  g.param_dtype = DType::kFp32;
  return g;
}

// The sum of squares of a unit's gradient, read through a host view of it.
template <typename Unit>
Result<double> UnitGradSumOfSquares(offload::PartitionStore& store,
                                    engine::HostOptimizer& optimizer, const Unit& unit) {
  SPILLWAY_ASSIGN_OR_RETURN(auto g, store.Acquire(unit.grad, offload::Access::kRead));
  engine::SubGroup view;
  view.name = "unit";
  view.numel = static_cast<uint64_t>(unit.shard);
  view.grad = g.data();
  view.grad_dtype = DType::kFp32;
  auto s = optimizer.SumOfSquares(view);
  SPILLWAY_RETURN_IF_ERROR(store.Release(g));
  return s;
}

// The update's view of a unit through its five host handles: grad, param, master, exp_avg and
// exp_avg_sq, in that order.
template <typename Unit>
engine::SubGroup UnitSubGroup(const Unit& unit, const std::vector<offload::Handle>& views) {
  engine::SubGroup g;
  g.name = "unit";
  g.numel = static_cast<uint64_t>(unit.shard);
  g.grad = views[0].data();
  g.grad_dtype = DType::kFp32;
  g.param = views[1].data();
  g.param_dtype = DType::kFp32;
  g.master = static_cast<float*>(views[2].data());
  g.exp_avg = static_cast<float*>(views[3].data());
  g.exp_avg_sq = static_cast<float*>(views[4].data());
  return g;
}
}  // namespace

std::future<Result<torch::Tensor>> Trainer::ShardAhead(int64_t u) {
  if (u < 0 || u >= static_cast<int64_t>(units_.size()) || !OnPipeline(u)) return {};
  if (ahead_ == nullptr) ahead_ = std::make_unique<AheadThread>();
  return ahead_->Submit([this, u] { return DeviceShard(u); });
}

Result<torch::Tensor> Trainer::GatherToCompute(int64_t u,
                                               std::future<Result<torch::Tensor>>* ahead) {
  if (OnPipeline(u)) {
    // Note [Trainer pipeline] in docs/engine.md: this rank's shard came NVMe (or its host copy) ->
    // pinned staging -> device while the previous unit computed; only the all-gather is left.
    SPILLWAY_ASSIGN_OR_RETURN(torch::Tensor shard,
                              ahead != nullptr && ahead->valid() ? ahead->get() : DeviceShard(u));
    const Unit& unit = units_[u];
    if (coll_->world_size() == 1) return shard.narrow(0, 0, unit.numel);  // the view lives as long
    // A process group may hold its input a while after the collective returns (gloo releases it on
    // its own thread), and the view must be gone before the optimizer takes the partition on the
    // host: the all-gather reads a copy, and the view goes now.
    torch::Tensor input = shard.clone();
    shard = torch::Tensor();
    torch::Tensor full = torch::empty({unit.shard * coll_->world_size()}, input.options());
    SPILLWAY_RETURN_IF_ERROR(coll_->AllGather(input, full));
    return full.narrow(0, 0, unit.numel);
  }
  if (DeviceCollectives()) {
    // Note [Device collectives]: only this rank's shard crosses PCIe; the all-gather runs on the
    // device (NCCL), into a buffer of the caching allocator.
    const Unit& unit = units_[u];
    const auto on_device = torch::TensorOptions().dtype(torch::kFloat32).device(options_.compute);
    torch::Tensor shard = torch::empty({unit.shard}, on_device);
    SPILLWAY_ASSIGN_OR_RETURN(auto v, store_->Acquire(unit.param, offload::Access::kRead));
    // A blocking copy: the view is released right after it.
    shard.copy_(torch::from_blob(v.data(), {unit.shard}, torch::kFloat32), /*non_blocking=*/false);
    SPILLWAY_RETURN_IF_ERROR(store_->Release(v));
    torch::Tensor full = torch::empty({unit.shard * coll_->world_size()}, on_device);
    SPILLWAY_RETURN_IF_ERROR(coll_->AllGather(shard, full));
    return full.narrow(0, 0, unit.numel);
  }
  auto host = Gather(u);
  if (!host.ok() || options_.compute.is_cpu()) return host;
  // A blocking copy: the pinned gather buffer returns to the arena as soon as this returns, so the
  // copy must be complete by then (an asynchronous copy would need an event per buffer). Pinned
  // memory makes it a DMA at full PCIe speed (docs/results/gpu-findings.md).
  return host->to(torch::TensorOptions().device(options_.compute), /*non_blocking=*/false);
}

Status Trainer::ReduceGrad(int64_t u, const torch::Tensor& grad) {
  const Unit& unit = units_[u];
  const int64_t world = coll_->world_size();
  // On the compute device when the group can reduce there (only the shard comes back over PCIe),
  // else on the host (the whole gradient comes back).
  const torch::Device where = DeviceCollectives() ? options_.compute : torch::Device(torch::kCPU);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(where);
  torch::Tensor padded = torch::zeros({unit.shard * world}, opts);
  padded.narrow(0, 0, unit.numel).copy_(grad);
  torch::Tensor mine = torch::empty({unit.shard}, opts);
  SPILLWAY_RETURN_IF_ERROR(coll_->ReduceScatterSum(padded, mine));
  mine = mine.to(torch::kCPU);  // blocking; ordered after the collective by its wait()
  SPILLWAY_ASSIGN_OR_RETURN(auto v, store_->Acquire(unit.grad, offload::Access::kReadWrite));
  torch::from_blob(v.data(), {unit.shard}, torch::kFloat32)
      .add_(mine, 1.0 / static_cast<double>(world));
  return store_->Release(v);
}

Status Trainer::MicroBatch(const torch::Tensor& tokens, double scale, double* loss) {
  const GptConfig& c = options_.model;  // CheckMicroBatches has checked `tokens`
  const int64_t t = tokens.size(1) - 1;
  const torch::Tensor on_device = tokens.to(options_.compute);
  const torch::Tensor input = on_device.narrow(1, 0, t);
  const torch::Tensor targets = on_device.narrow(1, 1, t);
  const int64_t units = gpt::Units(c);
  std::vector<torch::Tensor> checkpoints;  // the input of each unit
  {
    torch::NoGradGuard no_grad;
    torch::Tensor x = input;
    std::future<Result<torch::Tensor>> ahead = ShardAhead(0);
    TakeAhead take_forward{ahead};
    for (int64_t u = 0; u < units; ++u) {
      SPILLWAY_ASSIGN_OR_RETURN(auto full, GatherToCompute(u, &ahead));
      ahead = ShardAhead(u + 1);  // moves while this unit computes
      checkpoints.push_back(x);
      if (fault_hook_) fault_hook_(u);
      x = gpt::Forward(c, u, full, x);
    }  // each gathered unit is released as `full` goes out of scope
  }
  torch::Tensor grad_out;
  std::future<Result<torch::Tensor>> ahead = ShardAhead(units - 1);
  TakeAhead take_backward{ahead};
  for (int64_t u = units - 1; u >= 0; --u) {
    SPILLWAY_ASSIGN_OR_RETURN(auto gathered, GatherToCompute(u, &ahead));
    ahead = ShardAhead(u - 1);
    torch::Tensor full = gathered.detach().requires_grad_(true);
    torch::Tensor xin = checkpoints[u];
    if (u > 0) xin = xin.detach().requires_grad_(true);
    torch::Tensor out = gpt::Forward(c, u, full, xin);  // recompute from the checkpoint
    if (u == units - 1) {
      torch::Tensor l = gpt::Loss(out, targets);
      *loss += l.item<double>();
      (l * scale).backward();
    } else {
      out.backward(grad_out);
    }
    if (u > 0) grad_out = xin.grad();
    SPILLWAY_RETURN_IF_ERROR(ReduceGrad(u, full.grad()));
    checkpoints[u] = torch::Tensor();
  }
  return Status::Ok();
}

Result<engine::StepReport> Trainer::OptimizerStep(engine::StreamedStepStats* stream,
                                                  size_t* applied) {
  *applied = 0;
  engine::StepOptions so;
  so.max_grad_norm = options_.max_grad_norm;
  if (store_->home(units_[0].master) == offload::Placement::kNvme) {
    // The streamed step overlaps NVMe reads and write-backs of the optimizer state with the update,
    // so it takes the gradient and parameter partitions (host views) for the whole step.
    std::vector<offload::Handle> held;
    std::vector<engine::StreamedGroup> groups(units_.size());
    for (size_t u = 0; u < units_.size(); ++u) {
      engine::StreamedGroup& g = groups[u] = StreamedGroupOf(units_[u], u);
      SPILLWAY_ASSIGN_OR_RETURN(auto grad,
                                store_->Acquire(units_[u].grad, offload::Access::kReadWrite));
      g.grad = grad.data();
      held.push_back(std::move(grad));
      SPILLWAY_ASSIGN_OR_RETURN(auto param,
                                store_->Acquire(units_[u].param, offload::Access::kReadWrite));
      g.param = param.data();
      held.push_back(std::move(param));
    }
    Result<engine::StepReport> report =
        engine::StreamedStep(*optimizer_, *store_, groups, so, stream,
                             [this](double s) { return coll_->AllReduceSum(s); });
    *applied = stream->groups;  // one group per unit, in order
    // The gradients start the next step at zero.
    for (size_t u = 0; u < units_.size(); ++u) {
      std::memset(const_cast<void*>(groups[u].grad), 0, static_cast<size_t>(units_[u].shard) * 4);
    }
    for (offload::Handle& v : held) SPILLWAY_RETURN_IF_ERROR(store_->Release(v));
    return report;
  }
  // Host-resident state: one unit's five partitions at a time, so a host budget smaller than the
  // states only has to hold one unit's working set (the store spills the rest). Pass 1: the norm.
  double local = 0.0;
  for (const Unit& unit : units_) {
    SPILLWAY_ASSIGN_OR_RETURN(const double s, UnitGradSumOfSquares(*store_, *optimizer_, unit));
    local += s;
  }
  SPILLWAY_ASSIGN_OR_RETURN(auto global, coll_->AllReduceSum(local));
  Result<engine::StepReport> report = optimizer_->Plan(global, so);
  if (!report.ok() || report->skipped) {
    SPILLWAY_RETURN_IF_ERROR(ZeroGrads());
    return report;
  }
  // Pass 2: update each unit and zero its gradient for the next step.
  for (const Unit& unit : units_) {
    std::vector<offload::Handle> views;
    for (offload::PartitionId id :
         {unit.grad, unit.param, unit.master, unit.exp_avg, unit.exp_avg_sq}) {
      SPILLWAY_ASSIGN_OR_RETURN(auto v, store_->Acquire(id, offload::Access::kReadWrite));
      views.push_back(std::move(v));
    }
    Status st = optimizer_->Update(UnitSubGroup(unit, views), *report);
    std::memset(views[0].data(), 0, static_cast<size_t>(unit.shard) * 4);
    for (offload::Handle& v : views) {
      Status rs = store_->Release(v);
      if (st.ok()) st = rs;
    }
    SPILLWAY_RETURN_IF_ERROR(st);
    ++*applied;
  }
  return report;
}

std::vector<offload::PartitionId> Trainer::Schedule(size_t micro_batches) const {
  std::vector<offload::PartitionId> order;
  const int64_t n = static_cast<int64_t>(units_.size());
  // A parameter that reaches the compute device through the pipeline (Note [Trainer pipeline]) is
  // not a host-tier use in forward and backward: the host prefetch would only add a copy.
  for (size_t m = 0; m < micro_batches; ++m) {
    for (int64_t u = 0; u < n; ++u) {  // forward
      if (!OnPipeline(u)) order.push_back(units_[u].param);
    }
    for (int64_t u = n - 1; u >= 0; --u) {  // backward: recompute, reduce
      if (!OnPipeline(u)) order.push_back(units_[u].param);
      order.push_back(units_[u].grad);
    }
  }
  if (store_->home(units_[0].master) ==
      offload::Placement::kNvme) {  // OptimizerStep's streamed path
    for (const Unit& unit : units_) {
      order.push_back(unit.grad);
      order.push_back(unit.param);
    }
    for (const Unit& unit : units_) {
      for (offload::PartitionId id : {unit.master, unit.exp_avg, unit.exp_avg_sq})
        order.push_back(id);
    }
  } else {
    for (const Unit& unit : units_) order.push_back(unit.grad);  // the norm
    for (const Unit& unit : units_) {
      for (offload::PartitionId id :
           {unit.grad, unit.param, unit.master, unit.exp_avg, unit.exp_avg_sq}) {
        order.push_back(id);
      }
    }
  }
  return order;
}

Status Trainer::ZeroGrads() {
  for (const Unit& unit : units_) {
    SPILLWAY_ASSIGN_OR_RETURN(auto v, store_->Acquire(unit.grad, offload::Access::kReadWrite));
    std::memset(v.data(), 0, static_cast<size_t>(unit.shard) * 4);
    SPILLWAY_RETURN_IF_ERROR(store_->Release(v));
  }
  return Status::Ok();
}

// Note [Guard] in docs/engine.md: every micro-batch, before any of them runs.
Status Trainer::CheckMicroBatches(const std::vector<torch::Tensor>& micro_batches) const {
  if (micro_batches.empty()) {
    return Status::InvalidArgument(
        "Step needs at least one micro-batch (gradient accumulation steps >= 1)");
  }
  const GptConfig& c = options_.model;
  const offload::DeviceId compute = ToDeviceId(options_.compute);
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const torch::Tensor& tokens = micro_batches[i];
    const std::string name = StrCat("micro_batches[", i, "] (token ids)");
    if (!tokens.defined()) return Status::InvalidArgument(StrCat(name, " is an undefined tensor"));
    if (!tokens.device().is_cpu() && !tokens.device().is_cuda()) {
      return Status::InvalidArgument(StrCat(
          name, " is on ", tokens.device().str(),
          "; token batches go on the cpu or on the compute device (", options_.compute.str(), ")"));
    }
    if (tokens.layout() != torch::kStrided) {
      return Status::InvalidArgument(
          StrCat(name, " is ", tokens.layout(), "; token batches are dense tensors (.to_dense())"));
    }
    if (tokens.scalar_type() != torch::kInt64) {
      return Status::InvalidArgument(
          StrCat(name, " is ", tokens.dtype(), "; token ids are int64 (.long())"));
    }
    // The device guard: on the host (the loader's memory) or on the compute device.
    const offload::TensorDesc desc{name, ToDeviceId(tokens.device()), DType::kInt64,
                                   static_cast<uint64_t>(tokens.numel()), true};
    offload::ExpectedPlacement want;
    want.device = desc.device.type == offload::DeviceType::kCpu ? desc.device : compute;
    want.dtype = DType::kInt64;
    want.numel = desc.numel;
    want.decided_by =
        StrCat("the trainer's compute device (TrainerOptions::compute = ", options_.compute.str(),
               "; token batches may also come from host memory)");
    SPILLWAY_RETURN_IF_ERROR(offload::CheckPlacement(desc, want));
    if (tokens.dim() != 2 || tokens.size(0) < 1 || tokens.size(1) < 2 ||
        tokens.size(1) - 1 > c.seq_len) {
      return Status::InvalidArgument(
          StrCat(name, " must be [B, T + 1] with B >= 1 and 1 <= T <= seq_len=", c.seq_len,
                 "; got ", tokens.sizes()));
    }
    if (tokens.min().item<int64_t>() < 0 || tokens.max().item<int64_t>() >= c.vocab) {
      return Status::InvalidArgument(
          StrCat(name, ": token ids must be in [0, vocab=", c.vocab, ")"));
    }
  }
  return Status::Ok();
}

Result<TrainStepResult> Trainer::Step(const std::vector<torch::Tensor>& micro_batches) {
  SPILLWAY_RETURN_IF_ERROR(
      CatchTorch("checking the micro-batches", [&] { return CheckMicroBatches(micro_batches); }));
  if (!out_of_step_.ok()) return out_of_step_;
  if (options_.schedule && micro_batches.size() != scheduled_micro_batches_) {
    SPILLWAY_RETURN_IF_ERROR(store_->SetSchedule(Schedule(micro_batches.size())));
    scheduled_micro_batches_ = micro_batches.size();
  }
  TrainStepResult r;
  // Ledger step numbers count attempts (they must increase), steps_ counts applied steps.
  if (ledger_ != nullptr) SPILLWAY_RETURN_IF_ERROR(ledger_->BeginStep(attempts_));
  ++attempts_;
  // A step that fails (a micro-batch, or the optimizer step: an I/O error, a checksum mismatch,
  // the budget, a collective) is ended here: the gradients it accumulated are zeroed and the
  // ledger's step is closed (step-scoped memory died with the tensors), so the next step starts as
  // if this one had not been tried, except for the units the optimizer already updated, which
  // the error names.
  auto end_failed = [&](const Status& st, const std::string& what, bool zero_grads) -> Status {
    Status z = zero_grads ? ZeroGrads() : Status::Ok();
    allocator::BoundaryReport ignored;
    Status b = ledger_ != nullptr ? ledger_->EndStep(&ignored) : Status::Ok();
    std::string also;
    if (!z.ok()) also += "; zeroing the gradients also failed: " + z.message();
    if (!b.ok()) also += "; closing the ledger step also failed: " + b.message();
    return Status::Make(st.code(), StrCat("step ", steps_, " ", what, ": ", st.message(), also),
                        st.sys_error());
  };
  double loss = 0.0;
  const double scale = 1.0 / static_cast<double>(micro_batches.size());
  for (const torch::Tensor& mb : micro_batches) {
    Status st = CatchTorch("a micro-batch", [&] { return MicroBatch(mb, scale, &loss); });
    if (!st.ok()) return end_failed(st, "abandoned, nothing applied", true);
  }
  size_t applied = 0;
  const uint64_t adam_before = optimizer_->step();
  auto report = OptimizerStep(&r.stream, &applied);
  if (!report.ok()) {
    const size_t n = units_.size();
    if (applied == 0 && optimizer_->step() == adam_before + 1) {
      engine::StepReport planned;
      planned.step = adam_before + 1;
      optimizer_->Unplan(planned)
          .IgnoreError();  // no unit used that Adam step: the next step reuses it
    }
    std::string what = OptimizerFailure(applied, n, optimizer_->step());
    if (coll_->world_size() > 1) {
      // The other ranks may have taken the step and be in the next collective: the group is out
      // of step, and going on would pair mismatched collectives. Every later Step says so.
      what +=
          ". The ranks are out of step (the others may have applied it): restart the group "
          "from a checkpoint";
      Status st = end_failed(report.status(), what, true);
      out_of_step_ =
          Status::FailedPrecondition(StrCat("Step: an earlier optimizer step failed on "
                                            "this rank with world size ",
                                            coll_->world_size(), " (", st.message(), ")"));
      return st;
    }
    what += ". The gradients are zeroed and the ledger step closed: the next step runs";
    return end_failed(report.status(), what, true);
  }
  r.report = *report;
  auto global = coll_->AllReduceSum(loss * scale);
  if (!global.ok()) {
    Status st = end_failed(global.status(),
                           "was applied, but the loss all-reduce failed (the "
                           "ledger step is closed; steps() counts it)",
                           false);
    ++steps_;
    return st;
  }
  r.loss = *global / static_cast<double>(coll_->world_size());
  if (ledger_ != nullptr) SPILLWAY_RETURN_IF_ERROR(ledger_->EndStep(&r.boundary));
  ++steps_;
  return r;
}

Result<torch::Tensor> Trainer::GatherUnit(int64_t unit) {
  if (unit < 0 || unit >= static_cast<int64_t>(units_.size())) {
    return Status::InvalidArgument(
        StrCat("unit ", unit, " does not exist (", units_.size(), " units)"));
  }
  torch::Tensor out;
  Status st = CatchTorch("gathering a unit", [&]() -> Status {
    SPILLWAY_ASSIGN_OR_RETURN(auto full, Gather(unit));
    out = full.clone();
    return Status::Ok();
  });
  if (!st.ok()) return st;
  return out;
}

}  // namespace spillway::trainer
