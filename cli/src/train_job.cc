// The main job: see train_job.h and Note [Main job] in docs/cli.md.
#include "spillway/cli/train_job.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/base/bytes.h"
#include "spillway/base/log.h"
#include "spillway/cli/char_corpus.h"
#include "spillway/cli/fork_loader.h"
#include "spillway/metrics/exporter.h"
#include "spillway/offload/config.h"
#include "spillway/offload/partition_store.h"
#include "spillway/offload/tiers.h"

namespace spillway::cli {

const char* const kDefaultTrainConfig = R"({
  "train_micro_batch_size_per_gpu": 16,
  "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW",
                "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}},
  "zero_optimization": {
    "stage": 3,
    "sub_group_size": 1000000,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "offload_param": {"device": "nvme", "nvme_path": @SWAP_DIR@, "pin_memory": true}
  },
  "aio": {"block_size": 1048576, "queue_depth": 8},
  "spillway": {"host_budget_bytes": "1GiB", "nvme_budget_bytes": "1GiB", "escape_policy": "report"}
})";

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string SignedMib(int64_t bytes) { return FormatMiBDelta(static_cast<double>(bytes)); }

// The swap directory the job made. Its swap files are anonymous (O_TMPFILE, or unlinked as soon
// as they are open), so once the arenas hold them the directory is removed: a job that is killed
// (SIGKILL, the OOM killer) leaves nothing behind. The destructor removes it on the paths that
// end the job before that.
struct TempDir {
  std::string path;
  ~TempDir() { RemoveNow(); }
  void RemoveNow() {
    if (path.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    if (ec) {
      Log(LogLevel::kWarning,
          StrCat("could not remove the swap directory ", path, ": ", ec.message()));
    }
    path.clear();
  }
};

// kDefaultTrainConfig with its swap directory filled in.
Result<offload::Config> DefaultConfig(const std::string& swap) {
  std::string text = kDefaultTrainConfig;
  text.replace(text.find("@SWAP_DIR@"), 10, nlohmann::json(swap).dump());
  return offload::Config::Parse(text);
}

Result<offload::Config> LoadConfig(const TrainJobOptions& o, TempDir* temp) {
  std::string swap = o.swap_dir;
  if (o.config_path.empty()) {
    if (swap.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      std::string tmpl =
          StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/var/tmp", "/spillway-swap-XXXXXX");
      if (mkdtemp(tmpl.data()) == nullptr) {
        return Status::FromErrno(StatusCode::kInvalidArgument, errno,
                                 StrCat("cannot create the swap directory ", tmpl,
                                        "; pass --swap-dir DIR on a writable NVMe file system"));
      }
      swap = temp->path = tmpl;
    }
    return DefaultConfig(swap);
  }
  SPILLWAY_ASSIGN_OR_RETURN(auto c, offload::Config::Load(o.config_path));
  if (!swap.empty()) {
    if (c.offload_param.device == offload::OffloadDevice::kNvme) c.offload_param.nvme_path = swap;
    if (c.offload_optimizer.device == offload::OffloadDevice::kNvme)
      c.offload_optimizer.nvme_path = swap;
  }
  if (c.zero_stage != 3) {
    return Status::InvalidArgument(StrCat("config ", o.config_path, ": zero_optimization.stage is ",
                                          c.zero_stage,
                                          "; the reference trainer is ZeRO-3, set it to 3"));
  }
  return c;
}

// The process-tree memory now; a failure to read /proc is an error of the job.
Result<TreeMemory> Tree() { return ProcessTreeMemory(getpid()); }

class ProgressLine {
 public:
  ProgressLine(std::FILE* out, bool enabled, int64_t epoch, int64_t epochs, int64_t steps)
      : out_(out),
        enabled_(enabled),
        tty_(isatty(fileno(out)) != 0),
        epoch_(epoch),
        epochs_(epochs),
        steps_(steps) {}
  void Update(int64_t done, double loss, double tokens_per_second, uint64_t host, uint64_t nvme) {
    if (!enabled_) return;
    const int64_t every = std::max<int64_t>(1, steps_ / 4);
    if (!tty_ && done != steps_ && done % every != 0) return;
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * done / steps_);
    std::string bar(filled, '#');
    bar.resize(kWidth, '.');
    std::fprintf(out_,
                 "%sepoch %" PRId64 "/%" PRId64 " [%s] %3" PRId64 "/%" PRId64
                 "  loss %.4f  %6.0f tok/s  host %s  nvme %s%s",
                 tty_ ? "\r" : "", epoch_, epochs_, bar.c_str(), done, steps_, loss,
                 tokens_per_second, FormatMiB(host).c_str(), FormatMiB(nvme).c_str(),
                 tty_ && done != steps_ ? "" : "\n");
    std::fflush(out_);
  }

 private:
  std::FILE* out_;
  bool enabled_, tty_;
  int64_t epoch_, epochs_, steps_;
};

const allocator::TierReport* FindTier(const allocator::BoundaryReport& r, const std::string& name) {
  for (const auto& t : r.tiers) {
    if (t.tier == name) return &t;
  }
  return nullptr;
}

// Greedy continuation of `prompt` with the trained weights.
Result<std::string> Sample(trainer::Trainer& trainer, const trainer::GptConfig& m,
                           const std::string& prompt, int chars) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flats;
  for (int64_t u = 0; u < trainer::gpt::Units(m); ++u) {
    SPILLWAY_ASSIGN_OR_RETURN(auto f, trainer.GatherUnit(u));
    flats.push_back(f.clone());
  }
  std::vector<int64_t> ids;
  for (unsigned char c : prompt) ids.push_back(CharCorpus::Encode(c));
  std::string out = prompt;
  for (int i = 0; i < chars; ++i) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(ids.size()), m.seq_len);
    torch::Tensor x =
        torch::tensor(std::vector<int64_t>(ids.end() - n, ids.end()), torch::kInt64).view({1, n});
    for (int64_t u = 0; u < trainer::gpt::Units(m); ++u)
      x = trainer::gpt::Forward(m, u, flats[u], x);
    const int64_t next = x[0][n - 1].argmax().item<int64_t>();
    ids.push_back(next);
    out += CharCorpus::Decode(next);
  }
  return out;
}

// The running job's pieces that its steps share; RunTrainJob owns them.
struct JobContext {
  const TrainJobOptions& o;
  const offload::TrainingConfig& tc;
  const trainer::GptConfig& model;
  allocator::Ledger& ledger;
  allocator::HostArena* host;
  allocator::IoEngine* io;
  allocator::NvmeArena* nvme;  // null: nothing on NVMe
  trainer::Trainer& trainer;
  TrainJobResult* result;

  uint64_t HostLive() const { return host->Stats().live_bytes; }
  uint64_t NvmeLive() const { return nvme ? nvme->Stats().live_bytes : 0; }
};

// The trainer over the tiers, with the model, the compute device and the config's training
// settings; *pipeline is the device pipeline it streams parameters through (null: none).
Result<std::unique_ptr<trainer::Trainer>> MakeTrainer(
    const TrainJobOptions& o, const offload::Config& config, const trainer::GptConfig& model,
    const c10::Device& compute, offload::Tiers& tiers, trainer::Collectives* coll,
    offload::TransferPipeline** pipeline) {
  trainer::TrainerOptions to;
  to.model = model;
  to.compute = compute;
  to.ApplyTraining(config.training);
  to.optimizer_threads = o.threads;
  SPILLWAY_ASSIGN_OR_RETURN(*pipeline,
                            tiers.OpenDevicePipeline(config, trainer::ToDeviceId(compute)));
  to.pipeline = *pipeline;
  return trainer::Trainer::Create(to, coll, tiers.store.get(), tiers.host.get(), &tiers.ledger,
                                  allocator::kProcessScope);
}

// Where the job computes, in words: the device and, for CUDA, how many libtorch sees.
std::string DescribeCompute(const c10::Device& compute, const std::string& device) {
  if (compute.is_cuda()) {
    return StrCat(compute.str(), " (", device == "auto" ? "auto: " : "", "libtorch sees ",
                  static_cast<int>(torch::cuda::device_count()),
                  " CUDA device(s)); the optimizer step runs on "
                  "the host, where its state lives");
  }
  return device == "auto" ? "cpu (auto: libtorch sees no CUDA device, or is a CPU build)"
                          : "cpu (--device cpu)";
}

// The Prometheus exporter at `address`, watching the tiers, the optimizer and the pipeline; null
// when `address` is "off".
Result<std::unique_ptr<metrics::Exporter>> StartExporter(const std::string& address,
                                                         offload::Tiers& tiers,
                                                         trainer::Trainer& trainer,
                                                         offload::TransferPipeline* pipeline) {
  if (address == "off") return std::unique_ptr<metrics::Exporter>();
  metrics::ExporterOptions eo;
  eo.address = address;
  SPILLWAY_ASSIGN_OR_RETURN(auto exporter, metrics::Exporter::Start(eo));
  exporter->Watch(tiers.host.get());
  exporter->Watch(tiers.io.get());
  if (tiers.nvme) exporter->Watch(tiers.nvme.get());
  exporter->Watch(&tiers.ledger);
  exporter->Watch(tiers.store.get());
  exporter->Watch(&trainer.optimizer());
  if (pipeline != nullptr) exporter->Watch(pipeline);
  return exporter;
}

// Takes the job's components off the exporter before they are destroyed.
void StopWatching(metrics::Exporter* exporter, offload::Tiers& tiers, trainer::Trainer& trainer,
                  offload::TransferPipeline* pipeline) {
  for (const void* c : std::initializer_list<const void*>{
           tiers.host.get(), tiers.io.get(), tiers.nvme.get(), &tiers.ledger, tiers.store.get(),
           &trainer.optimizer(), pipeline}) {
    if (c != nullptr) exporter->Unwatch(c);
  }
}

// The data position: epochs are whole (the loader's batches depend on the seed and the epoch
// number only), so a checkpoint at an epoch's end resumes at the next one exactly.
nlohmann::json DataPosition(const JobContext& job, int64_t epoch) {
  return nlohmann::json{{"epoch", epoch},
                        {"steps_per_epoch", job.o.steps_per_epoch},
                        {"data_path", job.o.data_path},
                        {"loader_seed", job.model.seed},
                        {"micro_batch_size", job.tc.micro_batch_size},
                        {"gradient_accumulation_steps", job.tc.gradient_accumulation_steps}};
}

// --resume: loads the checkpoint, checks that epochs are left to train and warns where it was
// trained at another data position. Returns the first epoch to train (1 without --resume).
Result<int64_t> Resume(const JobContext& job) {
  const TrainJobOptions& o = job.o;
  if (o.resume_dir.empty()) return 1;
  trainer::CheckpointOptions co;
  co.io = job.io;
  auto info = job.trainer.Load(o.resume_dir, co);
  if (!info.ok()) return info.status().WithContext(StrCat("--resume ", o.resume_dir));
  const nlohmann::json saved = nlohmann::json::parse(info->extra_json);
  if (!saved.contains("epoch") || !saved["epoch"].is_number_integer()) {
    return Status::InvalidArgument(StrCat("--resume ", info->path,
                                          ": the checkpoint has no epoch "
                                          "(it was not saved by spillway train)"));
  }
  const int64_t done = job.result->resumed_from_epoch = saved["epoch"].get<int64_t>();
  if (done + 1 > o.epochs) {
    return Status::InvalidArgument(StrCat("--resume ", info->path, " is at the end of epoch ", done,
                                          " and --epochs is ", o.epochs,
                                          ": nothing is left to train; raise --epochs"));
  }
  const nlohmann::json now = DataPosition(job, done);
  for (const auto& [key, value] : saved.items()) {
    if (key != "epoch" && now.contains(key) && now[key] != value) {
      Log(LogLevel::kWarning, StrCat("--resume ", info->path, ": it was trained with ", key, " = ",
                                     value.dump(), ", this run has ", now[key].dump(),
                                     "; the run goes on, but not as the uninterrupted run would"));
    }
  }
  if (o.progress) {
    std::fprintf(o.out, "  resumed from %s: step %" PRId64 ", epoch %" PRId64 " done\n",
                 info->path.c_str(), info->step, done);
  }
  return done + 1;
}

// --save: a checkpoint after `epoch`, with the peaks of memory it took, added to the result.
Status SaveCheckpoint(const JobContext& job, int64_t epoch) {
  const TrainJobOptions& o = job.o;
  trainer::CheckpointOptions co;
  co.io = job.io;
  co.extra_json = DataPosition(job, epoch).dump();
  co.keep = o.keep_checkpoints;
  co.fault_hook = o.checkpoint_fault_hook;
  SPILLWAY_ASSIGN_OR_RETURN(auto before, Tree());
  job.host->ResetPeakStats();
  const uint64_t live_before = job.host->Stats().live_bytes;  // after the reset: peak >= it
  PeakSampler sampler(getpid());
  const auto t0 = Clock::now();
  auto info = job.trainer.Save(o.save_dir, co);
  const double seconds = Seconds(t0, Clock::now());
  auto peak = sampler.Stop();
  const uint64_t peak_live = job.host->Stats().peak_live_bytes;
  const uint64_t host_extra = peak_live > live_before ? peak_live - live_before : 0;
  if (!info.ok())
    return info.status().WithContext(StrCat("--save ", o.save_dir, " after epoch ", epoch));
  int64_t extra = 0;  // the save is done; a failed /proc read only loses the measurement
  if (peak.ok()) {
    extra = static_cast<int64_t>(*peak) - static_cast<int64_t>(before.pss_anon_bytes);
  } else {
    Log(LogLevel::kWarning,
        StrCat("checkpoint saved; its memory peak is unknown: ", peak.status().message()));
  }
  TrainJobResult::Checkpoint c{info->path, info->step, seconds, extra, host_extra};
  if (o.progress) {
    std::fprintf(o.out,
                 "   checkpoint: %s (step %" PRId64
                 ", %.2f s; peak during the save: tree anonymous PSS %s, host arena %s)\n",
                 c.path.c_str(), c.step, c.seconds, SignedMib(c.peak_extra_pss_bytes).c_str(),
                 SignedMib(static_cast<int64_t>(c.peak_extra_host_bytes)).c_str());
  }
  job.result->checkpoints.push_back(std::move(c));
  return Status::Ok();
}

// The data loader over `corpus`, forking its workers every epoch.
Result<std::unique_ptr<ForkingLoader>> MakeLoader(const JobContext& job, const CharCorpus* corpus) {
  ForkingLoaderOptions lo;
  lo.workers = job.o.workers;
  lo.batch_size = static_cast<uint32_t>(job.tc.micro_batch_size);
  lo.seq_len = static_cast<uint32_t>(job.model.seq_len);
  lo.seed = job.model.seed;
  return ForkingLoader::Create(corpus, lo);
}

// The job's opening lines: the model, the data, where each state lives, the batch, the compute
// device and the metrics address.
void PrintJobHeader(const JobContext& job, const offload::Config& config, const CharCorpus& corpus,
                    const metrics::Exporter* exporter) {
  const TrainJobOptions& o = job.o;
  const offload::TrainingConfig& tc = job.tc;
  const trainer::GptConfig& model = job.model;
  int64_t params = 0;
  for (int64_t u = 0; u < trainer::gpt::Units(model); ++u)
    params += trainer::gpt::UnitNumel(model, u);
  std::fprintf(o.out,
               "spillway train: %" PRId64 "-layer GPT, d_model %" PRId64 ", %" PRId64
               " parameters, on %s (%zu characters)\n"
               "  offload: optimizer -> %s, parameters -> %s%s%s; host arena %s\n"
               "  batch %" PRIu64 " x %" PRId64 " tokens, accumulate %" PRIu64
               ", %s lr %.0e, clip %.2g; "
               "%u loader workers forked per epoch\n"
               "  compute: %s\n  metrics: %s\n",
               model.n_layer, model.d_model, params, o.data_path.c_str(), corpus.tokens().size(),
               offload::OffloadDeviceName(config.offload_optimizer.device),
               offload::OffloadDeviceName(config.offload_param.device),
               config.any_nvme() ? " in " : "",
               config.any_nvme() ? config.NvmeArenaOptions().directory.c_str() : "",
               allocator::PinModeName(job.host->Stats().pin_mode), tc.micro_batch_size,
               model.seq_len, tc.gradient_accumulation_steps, tc.optimizer.c_str(), tc.lr,
               tc.gradient_clipping, o.workers, job.result->compute.c_str(),
               exporter ? StrCat("http://", exporter->address(), "/metrics").c_str() : "off");
}

// One optimizer step's micro-batches, read from the loader.
Result<std::vector<torch::Tensor>> NextMicroBatches(const JobContext& job, ForkingLoader& loader) {
  std::vector<torch::Tensor> mbs;
  for (uint64_t k = 0; k < job.tc.gradient_accumulation_steps; ++k) {
    torch::Tensor t = torch::empty(
        {static_cast<int64_t>(job.tc.micro_batch_size), static_cast<int64_t>(loader.row_elems())},
        torch::kInt64);
    SPILLWAY_RETURN_IF_ERROR(loader.Next(t.data_ptr<int64_t>()));
    mbs.push_back(std::move(t));
  }
  return mbs;
}

// One epoch: the ledger's and the loader's epoch around --steps optimizer steps, with the
// process tree's memory before the fork, at the first step and at the boundary.
Result<EpochSummary> RunEpoch(const JobContext& job, ForkingLoader& loader, int64_t epoch) {
  const TrainJobOptions& o = job.o;
  const uint64_t accum = job.tc.gradient_accumulation_steps;
  EpochSummary s;
  s.epoch = epoch;
  SPILLWAY_RETURN_IF_ERROR(job.ledger.BeginEpoch(epoch));
  SPILLWAY_ASSIGN_OR_RETURN(s.tree_before_fork, Tree());
  SPILLWAY_RETURN_IF_ERROR(loader.BeginEpoch(epoch, o.steps_per_epoch * accum));
  ProgressLine progress(o.out, o.progress, epoch, o.epochs, o.steps_per_epoch);
  std::vector<double> step_seconds;
  double loss_sum = 0, tokens = 0, busy = 0;
  for (int64_t step = 0; step < o.steps_per_epoch; ++step) {
    SPILLWAY_ASSIGN_OR_RETURN(auto mbs, NextMicroBatches(job, loader));
    const auto t0 = Clock::now();
    auto r = job.trainer.Step(mbs);
    const double sec = Seconds(t0, Clock::now());
    if (!r.ok()) return r.status().WithContext(StrCat("epoch ", epoch, " step ", step));
    if (step == 0) {
      SPILLWAY_ASSIGN_OR_RETURN(s.tree_at_first_step, Tree());
      s.first_step_seconds = sec;
    }
    step_seconds.push_back(sec);
    loss_sum += r->loss;
    busy += sec;
    tokens += static_cast<double>(job.tc.micro_batch_size * accum * job.model.seq_len);
    progress.Update(step + 1, r->loss, tokens / busy, job.HostLive(), job.NvmeLive());
    if (o.on_step) {
      o.on_step(
          {epoch, step, r->loss, sec, job.HostLive(), job.NvmeLive(), job.result->metrics_address});
    }
  }
  SPILLWAY_RETURN_IF_ERROR(loader.EndEpoch());
  SPILLWAY_RETURN_IF_ERROR(job.ledger.EndEpoch(&s.boundary));
  SPILLWAY_ASSIGN_OR_RETURN(s.tree_at_boundary, Tree());
  s.steps = o.steps_per_epoch;
  s.mean_loss = loss_sum / static_cast<double>(o.steps_per_epoch);
  s.tokens_per_second = tokens / busy;
  std::sort(step_seconds.begin(), step_seconds.end());
  s.median_step_seconds = step_seconds[step_seconds.size() / 2];
  return s;
}

// What the last boundary held: host and NVMe live bytes, the process tree's anonymous PSS.
struct Held {
  uint64_t host = 0, nvme = 0, pss = 0;
};

// The epoch's growth since the last boundary, into `s`; `prev` moves on to this boundary.
void NoteGrowth(const JobContext& job, EpochSummary* s, Held* prev) {
  const allocator::TierReport* h = FindTier(s->boundary, job.host->tier_name());
  const allocator::TierReport* n =
      job.nvme ? FindTier(s->boundary, job.nvme->tier_name()) : nullptr;
  const uint64_t host_now = h ? h->live_bytes : 0, nvme_now = n ? n->live_bytes : 0;
  s->host_live_growth = static_cast<int64_t>(host_now) - static_cast<int64_t>(prev->host);
  s->nvme_live_growth = static_cast<int64_t>(nvme_now) - static_cast<int64_t>(prev->nvme);
  s->pss_growth =
      static_cast<int64_t>(s->tree_at_boundary.pss_anon_bytes) - static_cast<int64_t>(prev->pss);
  *prev = Held{host_now, nvme_now, s->tree_at_boundary.pss_anon_bytes};
}

}  // namespace

std::string FormatEpochReport(const EpochSummary& s) {
  using allocator::KindName;
  using allocator::LifetimeName;
  std::string out = StrCat("-- end of epoch ", s.epoch, ": ", s.steps, " steps, mean loss ");
  char line[256];
  std::snprintf(line, sizeof(line), "%.4f, %.0f tok/s, first step %.3f s vs median %.3f s\n",
                s.mean_loss, s.tokens_per_second, s.first_step_seconds, s.median_step_seconds);
  out += line;
  std::snprintf(line, sizeof(line), "   %-5s %-18s %12s %12s %12s\n", "tier", "kind / lifetime",
                "live", "escapes", "reclaimed");
  out += line;
  for (const auto& t : s.boundary.tiers) {
    for (int k = 0; k < allocator::kKindCount; ++k) {
      if (t.live_by_kind[k] == 0) continue;
      std::snprintf(line, sizeof(line), "   %-5s %-18s %12s\n", t.tier.c_str(),
                    KindName(static_cast<allocator::Kind>(k)),
                    FormatMiB(t.live_by_kind[k]).c_str());
      out += line;
    }
    for (int l = 0; l < allocator::kLifetimeCount; ++l) {
      std::snprintf(line, sizeof(line), "   %-5s %-18s %12s\n", t.tier.c_str(),
                    StrCat("lifetime ", LifetimeName(static_cast<allocator::Lifetime>(l))).c_str(),
                    FormatMiB(t.live_by_lifetime[l]).c_str());
      out += line;
    }
    std::snprintf(line, sizeof(line), "   %-5s %-18s %12s %12" PRIu64 " %12s\n", t.tier.c_str(),
                  "total", FormatMiB(t.live_bytes).c_str(), t.escape_count,
                  FormatMiB(t.reclaimed_bytes).c_str());
    out += line;
    for (const auto& e : t.escapes) {
      out += StrCat("     escape: ", KindName(e.kind), "/", LifetimeName(e.lifetime), " ", e.bytes,
                    " B from scope '", e.scope_name, "' born epoch ", e.birth_epoch, " step ",
                    e.birth_step, e.site.empty() ? "" : " at ", e.site, "\n");
    }
  }
  std::snprintf(line, sizeof(line),
                "   process tree anonymous PSS: %s before the fork, %s at the first step (%u "
                "processes), %s now (%u)\n",
                FormatMiB(s.tree_before_fork.pss_anon_bytes).c_str(),
                FormatMiB(s.tree_at_first_step.pss_anon_bytes).c_str(),
                s.tree_at_first_step.processes,
                FormatMiB(s.tree_at_boundary.pss_anon_bytes).c_str(), s.tree_at_boundary.processes);
  out += line;
  out += StrCat("   growth since the last boundary: host live ", SignedMib(s.host_live_growth),
                ", nvme live ", SignedMib(s.nvme_live_growth), ", tree anonymous PSS ",
                SignedMib(s.pss_growth), "; the fork cost ", SignedMib(s.fork_pss_growth()), "\n");
  return out;
}

Result<offload::PlanInput> TrainJobPlanInput(const TrainJobOptions& o) {
  offload::PlanInput in;
  in.runtime = offload::Runtime::kTrainer;
  if (o.config_path.empty()) {
    SPILLWAY_ASSIGN_OR_RETURN(in.config,
                              DefaultConfig(o.swap_dir.empty() ? "/var/tmp" : o.swap_dir));
  } else {
    SPILLWAY_ASSIGN_OR_RETURN(in.config, offload::Config::Load(o.config_path));
  }
  trainer::GptConfig model = o.model;
  model.vocab = CharCorpus::kVocab;
  in.params = 0;
  for (int64_t u = 0; u < trainer::gpt::Units(model); ++u) {
    in.trainer_units.push_back(static_cast<uint64_t>(trainer::gpt::UnitNumel(model, u)));
    in.params += static_cast<double>(in.trainer_units.back());
  }
  SPILLWAY_ASSIGN_OR_RETURN(auto dist, trainer::DistEnvFromEnvironment());
  in.world_size = static_cast<uint32_t>(dist.world_size);
  return in;
}

Result<TrainJobResult> RunTrainJob(const TrainJobOptions& o) {
  if (o.epochs < 1 || o.steps_per_epoch < 1) {
    return Status::InvalidArgument(StrCat("--epochs (", o.epochs, ") and --steps (",
                                          o.steps_per_epoch, ") must be at least 1"));
  }
  SPILLWAY_ASSIGN_OR_RETURN(auto dist, trainer::DistEnvFromEnvironment());
  // Before anything is allocated.
  SPILLWAY_ASSIGN_OR_RETURN(auto compute, trainer::ResolveComputeDevice(o.device, dist.local_rank));
  TempDir temp;
  SPILLWAY_ASSIGN_OR_RETURN(auto config, LoadConfig(o, &temp));
  const offload::TrainingConfig& tc = config.training;
  trainer::GptConfig model = o.model;
  model.vocab = CharCorpus::kVocab;
  SPILLWAY_ASSIGN_OR_RETURN(
      auto corpus, CharCorpus::Load(o.data_path, static_cast<uint64_t>(model.seq_len) + 2));

  // The tiers, all reporting to one ledger.
  SPILLWAY_ASSIGN_OR_RETURN(auto tiers, offload::Tiers::Create(config));
  temp.RemoveNow();  // the arenas' swap files are open and anonymous
  SPILLWAY_ASSIGN_OR_RETURN(auto coll, trainer::Collectives::Create(dist));
  offload::TransferPipeline* pipeline = nullptr;  // the tiers', when parameters stream through it
  SPILLWAY_ASSIGN_OR_RETURN(auto trainer,
                            MakeTrainer(o, config, model, compute, *tiers, coll.get(), &pipeline));

  TrainJobResult result;
  result.compute = DescribeCompute(compute, o.device);
  SPILLWAY_ASSIGN_OR_RETURN(
      auto exporter,
      StartExporter(o.metrics_address.empty() ? config.spillway.metrics_address : o.metrics_address,
                    *tiers, *trainer, pipeline));
  if (exporter) result.metrics_address = exporter->address();
  const JobContext job{.o = o,
                       .tc = tc,
                       .model = model,
                       .ledger = tiers->ledger,
                       .host = tiers->host.get(),
                       .io = tiers->io.get(),
                       .nvme = tiers->nvme.get(),
                       .trainer = *trainer,
                       .result = &result};
  SPILLWAY_ASSIGN_OR_RETURN(const int64_t first_epoch, Resume(job));
  SPILLWAY_ASSIGN_OR_RETURN(auto loader, MakeLoader(job, &corpus));
  if (o.progress) PrintJobHeader(job, config, corpus, exporter.get());

  SPILLWAY_ASSIGN_OR_RETURN(auto baseline_tree, Tree());
  Held prev{job.HostLive(), job.NvmeLive(), baseline_tree.pss_anon_bytes};
  for (int64_t epoch = first_epoch; epoch <= o.epochs; ++epoch) {
    SPILLWAY_ASSIGN_OR_RETURN(EpochSummary s, RunEpoch(job, *loader, epoch));
    NoteGrowth(job, &s, &prev);
    if (o.progress) std::fputs(FormatEpochReport(s).c_str(), o.out);
    result.epochs.push_back(std::move(s));
    if (!o.save_dir.empty() && (o.save_every_epoch || epoch == o.epochs))
      SPILLWAY_RETURN_IF_ERROR(SaveCheckpoint(job, epoch));
  }
  result.forks = loader->Stats().forks;
  if (o.sample_chars > 0) {
    SPILLWAY_ASSIGN_OR_RETURN(result.sample,
                              Sample(*trainer, model, "This License ", o.sample_chars));
    if (o.progress) std::fprintf(o.out, "sample (greedy): %s\n", result.sample.c_str());
  }
  if (exporter) StopWatching(exporter.get(), *tiers, *trainer, pipeline);
  return result;
}

}  // namespace spillway::cli
