// spillway.trainer: the ZeRO-3 reference trainer (trainer/trainer.h) driven from Python, so that it
// can run on a c10d process group that `torch.distributed.init_process_group("gloo")` made. The
// torch wheels ship c10d's headers but not gloo's, so C++ cannot construct ProcessGroupGloo itself;
// it can use one (Note [Process groups] in docs/engine.md).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "bindings.h"
#include "errors.h"
#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/offload/config.h"
#include "spillway/offload/partition_store.h"
#include "spillway/offload/tiers.h"
#include "spillway/trainer/collectives.h"
#include "spillway/trainer/trainer.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

struct TrainRequest {
  std::string config_json;
  trainer::GptConfig model;
  int64_t steps = 0;
  int64_t micro_batches = 1;  // per rank, per step
  int64_t batch_rows = 4;
  int64_t data_seed = 10'000;
  std::string device = "cpu";
  std::string save_dir, resume_dir;  // empty: none
};

struct TrainOutcome {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;  // every unit's full parameters after the last step
  std::string backend;
  std::string compute, collectives;  // devices: where the math ran, where gather/scatter ran
  int rank = 0, world_size = 1;
  uint64_t host_live_bytes = 0, nvme_live_bytes = 0, host_escapes = 0;
  int64_t start_step = 0;  // the checkpoint's step after a resume
  std::string checkpoint;  // the checkpoint saved at the end, when asked
};

// Global micro-batch k of step s: the same tokens whatever the world size, so ranks that split the
// k's between them see exactly the batch one process sees (rank r takes r*M .. r*M+M-1). Each row
// is an arithmetic sequence mod vocab with a random start and stride: learnable from the context,
// so the loss falls well below ln(vocab) and a wrong gradient shows.
torch::Tensor GlobalMicroBatch(const TrainRequest& q, int64_t step, int64_t k) {
  auto gen =
      at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(q.data_seed + step * 100 + k));
  const torch::Tensor start =
      torch::randint(0, q.model.vocab, {q.batch_rows, 1}, gen, torch::kInt64);
  const torch::Tensor stride = torch::randint(1, 4, {q.batch_rows, 1}, gen, torch::kInt64);
  const torch::Tensor pos = torch::arange(q.model.seq_len + 1, torch::kInt64).unsqueeze(0);
  return (start + stride * pos).remainder(q.model.vocab);
}

// The tiers over one ledger, as `spillway train` composes them; everything dies before returning.
Result<TrainOutcome> RunTraining(const TrainRequest& q, trainer::Collectives* coll) {
  SPILLWAY_ASSIGN_OR_RETURN(auto config, offload::Config::Parse(q.config_json));
  // LOCAL_RANK picks this rank's GPU.
  SPILLWAY_ASSIGN_OR_RETURN(auto dist, trainer::DistEnvFromEnvironment());
  SPILLWAY_ASSIGN_OR_RETURN(auto compute, trainer::ResolveComputeDevice(q.device, dist.local_rank));
  SPILLWAY_ASSIGN_OR_RETURN(auto tiers, offload::Tiers::Create(config));
  allocator::Ledger& ledger = tiers->ledger;
  allocator::HostArena* host = tiers->host.get();
  allocator::NvmeArena* nvme = tiers->nvme.get();
  offload::PartitionStore* store = tiers->store.get();

  const offload::TrainingConfig& tc = config.training;
  trainer::TrainerOptions to;
  to.model = q.model;
  to.compute = compute;
  to.ApplyTraining(tc);
  SPILLWAY_ASSIGN_OR_RETURN(to.pipeline,
                            tiers->OpenDevicePipeline(config, trainer::ToDeviceId(compute)));
  SPILLWAY_ASSIGN_OR_RETURN(auto trainer, trainer::Trainer::Create(to, coll, store, host, &ledger,
                                                                   allocator::kProcessScope));

  TrainOutcome out;
  out.backend = coll->backend();
  out.compute = compute.str();
  out.collectives = trainer->collectives_device().str();
  out.rank = coll->rank();
  out.world_size = coll->world_size();
  // The data position is the step: micro-batches are a function of (data_seed, step, k).
  const std::string position =
      StrCat(R"({"data_seed": )", q.data_seed, R"(, "batch_rows": )", q.batch_rows,
             R"(, "micro_batches_per_rank": )", q.micro_batches, "}");
  if (!q.resume_dir.empty()) {
    trainer::CheckpointOptions co;
    co.io = tiers->io.get();
    SPILLWAY_ASSIGN_OR_RETURN(auto info, trainer->Load(q.resume_dir, co));
    out.start_step = info.step;
  }
  for (int64_t s = out.start_step; s < out.start_step + q.steps; ++s) {
    std::vector<torch::Tensor> mbs;
    for (int64_t j = 0; j < q.micro_batches; ++j) {
      mbs.push_back(GlobalMicroBatch(q, s, coll->rank() * q.micro_batches + j));
    }
    auto r = trainer->Step(mbs);
    if (!r.ok()) return r.status().WithContext(StrCat("step ", s, " on rank ", coll->rank()));
    out.losses.push_back(r->loss);
  }
  for (int64_t u = 0; u < trainer::gpt::Units(q.model); ++u) {
    // An all-gather: every rank takes part.
    SPILLWAY_ASSIGN_OR_RETURN(torch::Tensor p, trainer->GatherUnit(u));
    out.params.push_back(std::move(p));
  }
  if (!q.save_dir.empty()) {
    trainer::CheckpointOptions co;
    co.io = tiers->io.get();
    co.extra_json = position;
    SPILLWAY_ASSIGN_OR_RETURN(auto info, trainer->Save(q.save_dir, co));
    out.checkpoint = info.path;
  }
  out.host_live_bytes = host->Stats().live_bytes;
  out.host_escapes = host->Stats().escape_count;
  out.nvme_live_bytes = nvme ? nvme->Stats().live_bytes : 0;
  return out;
}

trainer::GptConfig ModelFromDict(const py::dict& d) {
  trainer::GptConfig c;
  for (auto item : d) {
    const std::string k = py::str(item.first);
    const int64_t v = item.second.cast<int64_t>();
    if (k == "vocab")
      c.vocab = v;
    else if (k == "d_model")
      c.d_model = v;
    else if (k == "n_layer")
      c.n_layer = v;
    else if (k == "n_head")
      c.n_head = v;
    else if (k == "seq_len")
      c.seq_len = v;
    else if (k == "seed")
      c.seed = static_cast<uint64_t>(v);
    else {
      Raise(Status::InvalidArgument(
          StrCat("model: unknown key '", k,
                 "'; the keys are vocab, d_model, n_layer, n_head, seq_len, seed")));
    }
  }
  if (c.vocab < 2 || c.d_model < 1 || c.n_layer < 1 || c.n_head < 1 || c.seq_len < 1 ||
      c.d_model % c.n_head != 0) {
    Raise(Status::InvalidArgument(
        StrCat("model: vocab ", c.vocab, ", d_model ", c.d_model, ", n_layer ", c.n_layer,
               ", n_head ", c.n_head, ", seq_len ", c.seq_len,
               " is not a model: every size must be positive, vocab at least 2, "
               "and d_model a multiple of n_head")));
  }
  return c;
}

}  // namespace

void BindTrainer(py::module_& m) {
  m.def(
      "_train_gpt",
      [](const std::string& config_json, const py::dict& model, int64_t steps,
         int64_t micro_batches, int64_t batch_rows, int64_t data_seed, const std::string& device,
         py::object group, const std::string& save, const std::string& resume) {
        if (steps < 1 || micro_batches < 1 || batch_rows < 1) {
          Raise(Status::InvalidArgument(StrCat("steps (", steps, "), micro_batches (",
                                               micro_batches, ") and batch_rows (", batch_rows,
                                               ") must be at least 1")));
        }
        TrainRequest q;
        q.config_json = config_json;
        q.model = ModelFromDict(model);
        q.steps = steps;
        q.micro_batches = micro_batches;
        q.batch_rows = batch_rows;
        q.data_seed = data_seed;
        q.device = device;
        q.save_dir = save;
        q.resume_dir = resume;
        std::unique_ptr<trainer::Collectives> coll;
        if (group.is_none()) {
          coll = Check(trainer::Collectives::Create(trainer::DistEnv{}));
        } else {
          c10::intrusive_ptr<c10d::ProcessGroup> pg;
          try {
            pg = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
          } catch (const py::cast_error&) {
            Raise(Status::InvalidArgument(StrCat(
                "group: expected a torch.distributed ProcessGroup (torch.distributed.group.WORLD "
                "after init_process_group(\"gloo\") or (\"cpu:gloo,cuda:nccl\")), got ",
                std::string(py::str(py::type::of(group))))));
          }
          coll = Check(trainer::Collectives::FromProcessGroup(std::move(pg)));
        }
        Result<TrainOutcome> r = [&] {
          py::gil_scoped_release nogil;  // collectives block on other ranks; compute needs no GIL
          return RunTraining(q, coll.get());
        }();
        TrainOutcome o = Check(std::move(r));
        py::dict d;
        d["losses"] = o.losses;
        d["params"] = o.params;
        d["backend"] = o.backend;
        d["compute_device"] = o.compute;
        d["collectives_device"] = o.collectives;
        d["rank"] = o.rank;
        d["world_size"] = o.world_size;
        d["host_live_bytes"] = o.host_live_bytes;
        d["nvme_live_bytes"] = o.nvme_live_bytes;
        d["host_escapes"] = o.host_escapes;
        d["start_step"] = o.start_step;
        d["checkpoint"] =
            o.checkpoint.empty() ? py::object(py::none()) : py::object(py::str(o.checkpoint));
        return d;
      },
      py::arg("config_json"), py::arg("model"), py::arg("steps"), py::arg("micro_batches"),
      py::arg("batch_rows"), py::arg("data_seed"), py::arg("device"), py::arg("group"),
      py::arg("save") = "", py::arg("resume") = "");
}

}  // namespace spillway::python
