// spillway: the command-line program.
//   spillway train       the main job (cli/train_job.h); exit 0 done, 1 failed, 2 bad usage or
//   input spillway leak-suite  the epoch-boundary leak regression suite (cli/leak_suite.h); exit 0
//   all
//                        passed, 1 a scenario failed, 2 bad usage
//   spillway plan        the capacity planner (offload/planner.h); exit 0 fits, 1 does not, 2 bad
//   input
//   spillway node        the live node ledgers of this user (allocator/node_governor.h); exit
//                        0 printed, 1 no segment or one could not be read
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "spillway/allocator/node_governor.h"
#include "spillway/base/bytes.h"
#include "spillway/cli/leak_suite.h"
#include "spillway/engine/cuda_kernels.h"
#include "spillway/offload/config.h"
#include "spillway/offload/planner.h"
#if SPILLWAY_WITH_TORCH
#include "spillway/cli/train_job.h"
#endif

namespace {

using spillway::Result;
using spillway::Status;
using namespace spillway::offload;

int Fail(const std::string& message) {
  std::fprintf(stderr, "spillway: %s\n", message.c_str());
  return 2;
}

// 2 for input the user can fix by changing a flag or a file, 1 for a run that failed.
int FailStatus(const Status& st) {
  std::fprintf(stderr, "spillway: %s\n", st.ToString().c_str());
  return st.code() == spillway::StatusCode::kInvalidArgument ? 2 : 1;
}

#if SPILLWAY_WITH_TORCH
// Fault-injection seam for the crash tests (tests/cli/checkpoint_crash_test.cc):
// SPILLWAY_TEST_KILL_SAVE_AT=POINT:N SIGKILLs this process the Nth time a save reaches POINT
// (checkpoint_file.h and trainer.h name the points). Unset: no hook.
spillway::engine::checkpoint::FaultHook KillSaveAtFromEnvironment() {
  const char* env = std::getenv("SPILLWAY_TEST_KILL_SAVE_AT");
  if (env == nullptr || *env == '\0') return {};
  std::string spec = env;
  const size_t colon = spec.rfind(':');
  const std::string point = spec.substr(0, colon);
  const long nth =
      colon == std::string::npos ? 1 : std::strtol(spec.c_str() + colon + 1, nullptr, 10);
  auto seen = std::make_shared<long>(0);
  return [point, nth, seen](std::string_view p) {
    if (p == point && ++*seen == nth) ::raise(SIGKILL);
  };
}
#endif

// `spillway plan`'s flags.
struct PlanFlags {
  CLI::App* cmd = nullptr;
  std::string params_text, host_text, nvme_text = "0", config_path;
  uint32_t world = 1, nodes = 1;
  uint32_t nproc_per_node = 0;
  std::string accelerator = "cuda", gpu_mem_text;
  double gpu_reserve = 0.25;
  // The run's phases (Note [Phase peaks] in docs/offload.md).
  std::string rank_baseline_text, load_text = "zero-init", ckpt_dtype = "fp32";
  std::string ckpt_format = "safetensors";
  uint64_t largest_tensor = 0;
  uint32_t loader_workers = 2;
  bool json = false;
  bool trainer = false;
#if SPILLWAY_WITH_TORCH
  spillway::cli::TrainJobOptions job;  // with --trainer: the model
#endif
};

// `spillway train`'s flags.
struct TrainFlags {
  CLI::App* cmd = nullptr;
#if SPILLWAY_WITH_TORCH
  spillway::cli::TrainJobOptions options;
  bool quiet = false;
#endif
};

// `spillway leak-suite`'s flags.
struct LeakFlags {
  CLI::App* cmd = nullptr;
  spillway::cli::LeakSuiteOptions options;
  std::vector<std::string> scenarios;
  bool no_plots = false, list = false;
};

// `spillway node`'s flags.
struct NodeFlags {
  CLI::App* cmd = nullptr;
  std::string segment, job, dir = "/dev/shm";
  double watch = 0;
};

// `spillway plan`'s flags for the run's phases and --json.
void AddPlanPhaseFlags(PlanFlags* f) {
  CLI::App* plan = f->cmd;
  plan->add_option("--rank-baseline", f->rank_baseline_text,
                   "what each rank holds before it loads the model (the interpreter, torch, "
                   "DeepSpeed, the process group), e.g. 320MiB; plans the run's phase peaks");
  plan->add_option("--load", f->load_text,
                   "with --rank-baseline: how from_pretrained loads the model: zero-init (HF "
                   "Trainer's ZeRO-3 config made first) or whole (on every rank)")
      ->check(CLI::IsMember({"zero-init", "whole"}))
      ->capture_default_str();
  plan->add_option("--checkpoint-format", f->ckpt_format,
                   "with --rank-baseline: the checkpoint from_pretrained loads, safetensors or a "
                   "torch .bin")
      ->check(CLI::IsMember({"safetensors", "bin"}))
      ->capture_default_str();
  plan->add_option("--checkpoint-dtype", f->ckpt_dtype,
                   "with --rank-baseline: the dtype of the checkpoint from_pretrained loads")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  plan->add_option("--largest-tensor", f->largest_tensor,
                   "with --rank-baseline: elements of the model's largest tensor (default "
                   "params / 8), which the streamed saves hold on rank 0");
  plan->add_option("--dataloader-workers", f->loader_workers,
                   "with --rank-baseline: DataLoader workers per rank, forked at each epoch")
      ->capture_default_str();
  plan->add_flag("--json", f->json,
                 "print the verdict, Spillway's host peak per node and the phase peaks as one JSON "
                 "object");
}

// `spillway plan --trainer` and its model's flags.
void AddPlanTrainerFlags(PlanFlags* f) {
  CLI::App* plan = f->cmd;
  plan->add_flag(
      "--trainer", f->trainer,
      "plan spillway train's reference trainer (its model from --layers, --d-model, "
      "--heads, --seq-len) instead of a DeepSpeed run; the world size is --world-size's, "
      "else WORLD_SIZE's");
#if SPILLWAY_WITH_TORCH
  plan->add_option("--layers", f->job.model.n_layer, "with --trainer: transformer blocks")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  plan->add_option("--d-model", f->job.model.d_model, "with --trainer: model width")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  plan->add_option("--heads", f->job.model.n_head, "with --trainer: attention heads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  plan->add_option("--seq-len", f->job.model.seq_len, "with --trainer: tokens per sequence")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
#endif
}

// Declares `spillway plan` and its flags, read into `f`.
void AddPlanCommand(CLI::App& app, PlanFlags* f) {
  CLI::App* plan = f->cmd = app.add_subcommand(
      "plan",
      "Capacity plan for a ZeRO-3 run: bytes per tier and state, pools, checkpoint and fork "
      "peaks, a verdict and the settings that would make it fit");
  plan->add_option("--params", f->params_text, "model parameters, e.g. 34e9 (not with --trainer)");
  auto* world_opt = plan->add_option("--world-size", f->world, "ranks (GPUs) in total")
                        ->check(CLI::PositiveNumber);
  plan->add_option("--nproc-per-node", f->nproc_per_node,
                   "ranks on each node (torchrun's flag); the world size is this times --nodes")
      ->check(CLI::PositiveNumber)
      ->excludes(world_opt);
  plan->add_option("--nodes", f->nodes, "machines")->check(CLI::PositiveNumber);
  plan->add_option("--host-ram,--host-mem", f->host_text, "host memory per node, e.g. 1TiB")
      ->required();
  plan->add_option("--nvme", f->nvme_text, "NVMe bytes per node, e.g. 4TiB (default 0)");
  plan->add_option("--config", f->config_path,
                   "DeepSpeed JSON config (default: stage 3, no offload; with --trainer, spillway "
                   "train's default)")
      ->check(CLI::ExistingFile);
  plan->add_option("--accelerator", f->accelerator,
                   "what DeepSpeed's pin_memory pins with: cuda (a shared mapping a fork does not "
                   "copy) or cpu (DeepSpeed's CPU accelerator pins nothing)")
      ->check(CLI::IsMember({"cuda", "cpu"}))
      ->capture_default_str();
  plan->add_option("--gpu-mem", f->gpu_mem_text,
                   "memory of one GPU, e.g. 80GB (default: the visible GPU's, else 80GB; 0: do not "
                   "check the GPU)");
  plan->add_option("--gpu-reserve", f->gpu_reserve,
                   "share of each GPU kept for activations, the CUDA context and fragmentation")
      ->capture_default_str();
  AddPlanPhaseFlags(f);
  AddPlanTrainerFlags(f);
}

#if SPILLWAY_WITH_TORCH
// `spillway train`'s flags of the model and the run (after --device), and --quiet.
void AddTrainModelFlags(TrainFlags* f) {
  CLI::App* train = f->cmd;
  spillway::cli::TrainJobOptions& to = f->options;
  train->add_option("--layers", to.model.n_layer, "transformer blocks")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  train->add_option("--d-model", to.model.d_model, "model width")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  train->add_option("--heads", to.model.n_head, "attention heads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  train->add_option("--seq-len", to.model.seq_len, "tokens per sequence")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  train->add_option("--sample", to.sample_chars, "characters of greedy sample to print at the end")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  train->add_flag("--quiet", f->quiet, "no progress lines or reports, only the final summary");
}

// `spillway train`'s checkpoint flags: --save and its cadence, --resume.
void AddTrainCheckpointFlags(TrainFlags* f) {
  CLI::App* train = f->cmd;
  spillway::cli::TrainJobOptions& to = f->options;
  train->add_option(
      "--save", to.save_dir,
      "checkpoint directory: a checkpoint after the last epoch (DIR/step-N, DIR/latest)");
  train->add_flag("--save-every-epoch", to.save_every_epoch,
                  "with --save: a checkpoint after every epoch");
  train
      ->add_option("--keep", to.keep_checkpoints,
                   "with --save: checkpoints kept, newest first (0: all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  train->add_option("--resume", to.resume_dir,
                    "go on from the checkpoint in DIR (its latest, or a step-N directory) with the "
                    "next epoch, up to --epochs in all");
}
#endif

// Declares `spillway train` and its flags, read into `f` (none without libtorch).
void AddTrainCommand(CLI::App& app, TrainFlags* f) {
  f->cmd = app.add_subcommand(
      "train",
      "The main job: train a small GPT-style character model with ZeRO-3 offload, a data "
      "loader that forks its workers every epoch, live metrics and a memory report at "
      "every epoch boundary");
#if SPILLWAY_WITH_TORCH
  CLI::App* train = f->cmd;
  spillway::cli::TrainJobOptions& to = f->options;
  train
      ->add_option("--config", to.config_path,
                   "DeepSpeed JSON config (default: optimizer on pinned host memory, parameters on "
                   "NVMe in a temporary swap directory)")
      ->check(CLI::ExistingFile);
  train->add_option("--data", to.data_path, "text file to learn")->capture_default_str();
  train->add_option("--epochs", to.epochs, "epochs")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  train->add_option("--steps", to.steps_per_epoch, "optimizer steps per epoch")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  train->add_option("--workers", to.workers, "data-loader processes forked per epoch")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  train->add_option("--metrics", to.metrics_address,
                    "Prometheus address host:port, or off (default: the config's "
                    "spillway.metrics_address, 127.0.0.1:9464)");
  train->add_option("--swap-dir", to.swap_dir,
                    "directory for NVMe swap files (overrides nvme_path)");
  train->add_option("--threads", to.threads, "host optimizer threads (default: one per core)");
  train
      ->add_option(
          "--device", to.device,
          "where forward and backward run: auto (CUDA when libtorch sees a GPU), cpu, cuda, cuda:N")
      ->capture_default_str();
  AddTrainModelFlags(f);
  AddTrainCheckpointFlags(f);
#endif
}

// Declares `spillway leak-suite` and its flags, read into `f`.
void AddLeakCommand(CLI::App& app, LeakFlags* f) {
  CLI::App* leak = f->cmd = app.add_subcommand(
      "leak-suite",
      "Reproduce each known epoch-boundary memory failure, Spillway against the naive "
      "pattern, and prove it cannot build up (CSV and PNG per scenario)");
  std::string names;
  for (const auto& s : spillway::cli::LeakScenarios())
    names += std::string(names.empty() ? "" : ", ") + s.name;
  leak->add_option("--scenario", f->scenarios, "run only these (repeatable): " + names);
  leak->add_option("--out", f->options.out_dir, "directory for the CSV and PNG files")
      ->capture_default_str();
  leak->add_option("--scratch", f->options.scratch_dir,
                   "directory for swap files and checkpoints (default: --out)");
  leak->add_flag("--no-plots", f->no_plots, "write CSV only (no gnuplot needed)");
  leak->add_flag("--list", f->list, "list the scenarios and exit");
}

// Declares `spillway node` and its flags, read into `f`.
void AddNodeCommand(CLI::App& app, NodeFlags* f) {
  CLI::App* node_cmd = f->cmd = app.add_subcommand(
      "node",
      "The live node ledgers of this user, one per memory limit (a cgroup's, else the machine's), "
      "read from their shared-memory segments: the budget, each job, what each of its local ranks "
      "holds by tier and kind, its workers, the headroom");
  node_cmd->add_option("segment", f->segment, "a segment path (default: every one of this user's)");
  node_cmd->add_option("--job", f->job,
                       "only the ledger holding this job (SPILLWAY_NODE_JOB or its launcher's id)");
  node_cmd->add_option("--dir", f->dir, "where the segments are")->capture_default_str();
  node_cmd->add_option("--watch", f->watch, "print again every SECONDS")
      ->check(CLI::NonNegativeNumber);
}

// `spillway train`: runs the job and prints its summary.
int RunTrain(TrainFlags& f) {
#if SPILLWAY_WITH_TORCH
  spillway::cli::TrainJobOptions& to = f.options;
  to.progress = !f.quiet;
  if (to.save_every_epoch && to.save_dir.empty())
    return Fail("--save-every-epoch needs --save DIR");
  to.checkpoint_fault_hook = KillSaveAtFromEnvironment();
  auto r = spillway::cli::RunTrainJob(to);
  if (!r.ok()) return FailStatus(r.status());
  if (r->epochs.empty()) return Fail("no epoch was trained");
  const auto& last = r->epochs.back();
  std::printf("spillway train: done, %zu epochs, final mean loss %.4f, %" PRIu64
              " worker processes forked, escapes at the last boundary %" PRIu64 "\n",
              r->epochs.size(), last.mean_loss, r->forks, last.boundary.escape_count());
  return 0;
#else
  (void)f;
  return Fail(
      "this build has no libtorch, so `train` is not available; run scripts/install-deps "
      "(it installs torch 2.13 CPU) and rebuild");
#endif
}

// The text of each ledger `spillway node` shows (with --job, those where the job has live ranks);
// `bad` counts the segments that could not be read.
std::vector<std::string> ShowLedgers(const NodeFlags& f, int* bad) {
  using spillway::allocator::NodeGovernor;
  std::vector<std::string> paths;
  if (!f.segment.empty()) {
    paths.push_back(f.segment);
  } else {
    paths = NodeGovernor::ListSegments(f.dir);
  }
  // One ledger per memory limit; --job keeps those where the job has live ranks.
  std::vector<std::string> shown;
  for (const std::string& p : paths) {
    auto s = NodeGovernor::Inspect(p);
    if (!s.ok()) {
      if (access(p.c_str(), F_OK) != 0) continue;  // its last rank removed it meanwhile
      std::fprintf(stderr, "spillway node: %s\n", s.status().ToString().c_str());
      ++*bad;
      continue;
    }
    if (!f.job.empty() &&
        std::none_of(s->jobs.begin(), s->jobs.end(),
                     [&](const spillway::allocator::NodeJobStats& j) { return j.name == f.job; })) {
      continue;
    }
    shown.push_back(s->ToString());
  }
  return shown;
}

// `spillway node`: prints the ledgers, once or every --watch seconds.
int RunNode(const NodeFlags& f) {
  while (true) {
    int bad = 0;
    const std::vector<std::string> shown = ShowLedgers(f, &bad);
    if (shown.empty() && (bad == 0 || !f.job.empty())) {
      std::fprintf(stderr, "spillway node: no node segment of uid %u in %s%s\n",
                   static_cast<unsigned>(geteuid()), f.dir.c_str(),
                   f.job.empty() ? "" : (" with job " + f.job).c_str());
      return 1;
    }
    for (const std::string& text : shown) std::printf("%s\n", text.c_str());
    std::fflush(stdout);
    // With --job, another ledger that cannot be read (another Spillway's layout) is said, and
    // does not fail the look at the one holding the job.
    if (f.watch <= 0) return (f.job.empty() ? bad == 0 : !shown.empty()) ? 0 : 1;
    std::this_thread::sleep_for(std::chrono::duration<double>(f.watch));
  }
}

// `spillway leak-suite`: lists the scenarios, or runs them.
int RunLeak(LeakFlags& f) {
  if (f.list) {
    for (const auto& s : spillway::cli::LeakScenarios()) {
      std::printf("%-16s %s%s%s\n", s.name, s.summary, s.start ? "" : " [unavailable: ",
                  s.start ? "" : (std::string(s.unavailable) + "]").c_str());
    }
    return 0;
  }
  f.options.plots = !f.no_plots;
  auto r = spillway::cli::RunLeakSuite(f.options, f.scenarios);
  if (!r.ok()) return FailStatus(r.status());
  if (*r > 0) std::printf("leak-suite: %d scenario(s) FAILED\n", *r);
  return *r == 0 ? 0 : 1;
}

// The model and world size to plan: spillway train's trainer (--trainer), or --params with a
// DeepSpeed config. Returns the exit code when the flags are wrong.
std::optional<int> PlanModelFromFlags(PlanFlags& f, PlanInput* in) {
  if (f.trainer) {
#if SPILLWAY_WITH_TORCH
    if (!f.params_text.empty())
      return Fail("--params does not go with --trainer: the model's flags give it");
    f.job.config_path = f.config_path;
    auto job = spillway::cli::TrainJobPlanInput(f.job);
    if (!job.ok()) return FailStatus(job.status());
    *in = *job;
    if (f.cmd->count("--world-size") > 0)
      in->world_size = f.world;  // else WORLD_SIZE's, as train's
    f.world = in->world_size;
    return std::nullopt;
#else
    return Fail("--trainer needs a build with libtorch (SPILLWAY_WITH_TORCH=ON)");
#endif
  }
  if (f.params_text.empty()) return Fail("--params is required (e.g. 34e9), or --trainer");
  char* end = nullptr;
  in->params = std::strtod(f.params_text.c_str(), &end);
  if (end == f.params_text.c_str() || *end != '\0' || !(in->params > 0)) {
    return Fail("--params '" + f.params_text +
                "' is not a positive number of parameters (e.g. 34e9)");
  }
  in->world_size = f.world;
  auto c = !f.config_path.empty() ? Config::Load(f.config_path)
                                  : Config::Parse(R"({"zero_optimization": {"stage": 3}})");
  if (!c.ok()) return Fail(c.status().ToString());
  in->config = *c;
  return std::nullopt;
}

// The machine to plan for: host RAM, NVMe, nodes, the accelerator and the GPU's memory (the
// visible GPU's when --gpu-mem is not given). Returns the exit code when a flag is wrong.
std::optional<int> PlanMachineFromFlags(PlanFlags& f, PlanInput* in) {
  auto host = ParseByteSize(f.host_text);
  if (!host.ok()) return Fail("--host-ram " + host.status().message());
  in->host_ram_bytes = *host;
  if (f.nvme_text != "0") {
    auto nvme = ParseByteSize(f.nvme_text);
    if (!nvme.ok()) return Fail("--nvme " + nvme.status().message());
    in->nvme_bytes = *nvme;
  }
  in->nodes = f.nodes;
  in->accelerator = f.accelerator == "cpu" ? Accelerator::kCpu : Accelerator::kCuda;
  in->gpu_reserve_fraction = f.gpu_reserve;
  if (f.gpu_mem_text.empty()) {
    auto visible = spillway::engine::cuda::DeviceMemoryBytes();
    in->gpu_mem_bytes = visible.ok() ? *visible : 80'000'000'000ull;
    f.gpu_mem_text = visible.ok() ? "the visible GPU's" : "80 GB, no GPU visible";
  } else if (f.gpu_mem_text != "0") {  // "0": the GPU is not checked
    auto gpu = ParseByteSize(f.gpu_mem_text);
    if (!gpu.ok())
      return Fail("--gpu-mem " + gpu.status().message() + ", or 0 not to check the GPU");
    in->gpu_mem_bytes = *gpu;
  }
  return std::nullopt;
}

// The run's phases to plan (with --rank-baseline; its companion flags need it). Returns the exit
// code when a flag is wrong.
std::optional<int> PlanPhasesFromFlags(const PlanFlags& f, PlanInput* in) {
  if (!f.rank_baseline_text.empty()) {
    auto baseline = ParseByteSize(f.rank_baseline_text);
    if (!baseline.ok()) return Fail("--rank-baseline " + baseline.status().message());
    if (*baseline == 0) return Fail("--rank-baseline is under a byte; give e.g. 320MiB");
    in->phases.rank_baseline_bytes = *baseline;
    in->phases.load = f.load_text == "whole" ? spillway::offload::ModelLoad::kWhole
                                             : spillway::offload::ModelLoad::kZeroInit;
    in->phases.checkpoint_dtype_bytes = f.ckpt_dtype == "fp32" ? 4 : 2;
    in->phases.torch_bin = f.ckpt_format == "bin";
    in->phases.largest_tensor = f.largest_tensor;
    in->phases.dataloader_workers = f.loader_workers;
  } else if (f.cmd->count("--load") + f.cmd->count("--checkpoint-dtype") +
                 f.cmd->count("--checkpoint-format") + f.cmd->count("--largest-tensor") +
                 f.cmd->count("--dataloader-workers") >
             0) {
    return Fail(
        "--load, --checkpoint-format, --checkpoint-dtype, --largest-tensor and "
        "--dataloader-workers plan the run's phases: give --rank-baseline too");
  }
  return std::nullopt;
}

// `spillway plan --json`: the verdict, Spillway's host peak per node and the phase peaks.
void PrintPlanJson(const PlanReport& r) {
  std::printf("{\"fits\": %s, \"host_peak_spillway_per_node\": %llu, \"phases\": [",
              r.fits ? "true" : "false",
              static_cast<unsigned long long>(r.host_peak_spillway_per_node));
  for (size_t i = 0; i < r.phases.size(); ++i) {
    const auto& p = r.phases[i];
    std::printf(
        "%s{\"name\": \"%s\", \"rank0\": %llu, \"other_rank\": %llu, \"node\": %llu, "
        "\"naive_node\": %llu}",
        i ? ", " : "", p.name, static_cast<unsigned long long>(p.rank0),
        static_cast<unsigned long long>(p.other_rank), static_cast<unsigned long long>(p.node),
        static_cast<unsigned long long>(p.naive_node));
  }
  std::printf("]}\n");
}

// `spillway plan`'s report, then the node verdict under Spillway's node budget.
void PrintPlan(const PlanFlags& f, const PlanInput& in, const PlanReport& r) {
  std::printf("spillway plan: %s%.3g parameters, %u ranks on %u node(s), GPU memory %s\n\n%s",
              f.trainer ? "spillway train's trainer, " : "", in.params, f.world, f.nodes,
              f.gpu_mem_text == "0" ? "not checked" : f.gpu_mem_text.c_str(), r.ToString().c_str());
  // The node verdict under Spillway's node budget (Note [Node governor] in docs/allocator.md):
  // what every local rank books at the steady state, against the default node budget.
  const uint64_t node_budget = spillway::allocator::DefaultNodeHostBudget(in.host_ram_bytes);
  const uint64_t booked = r.host_committed_per_node;
  std::printf(
      "\nnode budget (host RAM %s less the reserve %s): %s; the %u ranks of a node book %s at "
      "the steady state and declare %s at admission, %s%s\n",
      spillway::FormatBytes(in.host_ram_bytes).c_str(),
      spillway::FormatBytes(spillway::allocator::DefaultNodeReserve(in.host_ram_bytes)).c_str(),
      spillway::FormatBytes(node_budget).c_str(), f.world / f.nodes,
      spillway::FormatBytes(booked).c_str(),
      spillway::FormatBytes(r.per_node[static_cast<int>(Place::kHostPinned)] +
                            r.per_node[static_cast<int>(Place::kHostPageable)] +
                            r.fork_extra_spillway_per_node)
          .c_str(),
      booked <= node_budget ? "within it" : "over it: every rank would fail at admission",
      booked <= node_budget ? "" : " (see the settings above)");
}

// `spillway plan`: the plan of the model and machine the flags give, as text or JSON.
int RunPlan(PlanFlags& f) {
  if (f.nproc_per_node != 0) f.world = f.nproc_per_node * f.nodes;
  PlanInput in;
  if (auto code = PlanModelFromFlags(f, &in)) return *code;
  if (auto code = PlanMachineFromFlags(f, &in)) return *code;
  if (auto code = PlanPhasesFromFlags(f, &in)) return *code;
  auto r = MakePlan(in);
  if (!r.ok()) return Fail(r.status().ToString());
  if (f.json) {
    PrintPlanJson(*r);
  } else {
    PrintPlan(f, in, *r);
  }
  return r->fits ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Spillway: host-memory and NVMe offload for ZeRO-3 training"};
  app.require_subcommand(1);
  PlanFlags plan;
  AddPlanCommand(app, &plan);
  TrainFlags train;
  AddTrainCommand(app, &train);
  LeakFlags leak;
  AddLeakCommand(app, &leak);
  NodeFlags node;
  AddNodeCommand(app, &node);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (train.cmd->parsed()) return RunTrain(train);
  if (node.cmd->parsed()) return RunNode(node);
  if (leak.cmd->parsed()) return RunLeak(leak);
  if (plan.cmd->parsed()) return RunPlan(plan);
  return 2;
}
