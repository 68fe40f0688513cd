// The main job: `spillway train`. Trains the reference trainer's GPT-style model
// (trainer/trainer.h) as a character-level language model on a text file, with ZeRO-3 offload from
// a DeepSpeed config, a data loader that forks its workers every epoch (fork_loader.h), the
// Prometheus exporter, a progress line per epoch and a boundary report at every epoch end.
// Note [Main job] in docs/cli.md.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "spillway/allocator/ledger.h"
#include "spillway/base/status.h"
#include "spillway/cli/proc_memory.h"
#include "spillway/offload/planner.h"
#include "spillway/trainer/trainer.h"

namespace spillway::cli {

// The embedded default: optimizer state offloaded to pinned host memory, parameters to NVMe in a
// swap directory (@SWAP_DIR@ is replaced by the job), accumulation over 2 micro-batches.
extern const char* const kDefaultTrainConfig;

struct TrainJobOptions {
  std::string config_path;  // empty: kDefaultTrainConfig
  std::string data_path = "/usr/share/common-licenses/GPL-3";
  int64_t epochs = 3;
  int64_t steps_per_epoch = 64;  // optimizer steps; each takes gradient_accumulation_steps batches
  uint32_t workers = 2;          // data-loader processes forked per epoch
  std::string metrics_address;   // empty: the config's spillway.metrics_address; "off": none
  std::string swap_dir;  // empty: the config's nvme_path, or a fresh directory under $TMPDIR
  trainer::GptConfig model = DefaultModel();
  uint32_t threads = 0;         // optimizer threads; 0: one per core
  std::string device = "auto";  // forward/backward: auto (CUDA when present), cpu, cuda, cuda:N
  bool progress = true;
  std::FILE* out = stdout;
  int sample_chars = 100;  // greedy sample printed at the end; 0: none
  // Checkpoints (Note [Checkpoint] in docs/checkpoint.md). save_dir: a checkpoint after the last
  // epoch, or after every epoch with save_every_epoch. resume_dir: the run goes on from the
  // checkpoint there (its `latest`, or a step-N directory) with the epoch after the saved one, up
  // to `epochs` in total, so that 2 epochs + resume to 3 equals 3 epochs bit for bit.
  std::string save_dir;
  bool save_every_epoch = false;
  std::string resume_dir;
  int keep_checkpoints = 2;
  engine::checkpoint::FaultHook
      checkpoint_fault_hook;  // test seam (the CLI's SPILLWAY_TEST_KILL_SAVE_AT)

  struct StepEvent {
    int64_t epoch = 0, step = 0;  // step within the epoch
    double loss = 0.0, seconds = 0.0;
    uint64_t host_live_bytes = 0, nvme_live_bytes = 0;
    std::string metrics_address;  // the exporter's bound host:port (port 0 resolved); empty: off
  };
  std::function<void(const StepEvent&)> on_step;  // called after every step (tests, tools)

  static trainer::GptConfig DefaultModel() {
    trainer::GptConfig m;
    m.vocab = 96;
    m.d_model = 128;
    m.n_layer = 2;
    m.n_head = 4;
    m.seq_len = 64;
    m.seed = 1234;
    return m;
  }
};

struct EpochSummary {
  int64_t epoch = 0;
  int64_t steps = 0;
  double mean_loss = 0.0;
  double tokens_per_second = 0.0;
  double first_step_seconds = 0.0;  // the step right after the workers were forked
  double median_step_seconds = 0.0;
  TreeMemory tree_before_fork;    // just before the epoch's workers were forked
  TreeMemory tree_at_first_step;  // after the first optimizer step; the workers are alive
  TreeMemory tree_at_boundary;    // workers reaped
  allocator::BoundaryReport boundary;
  // Since the previous epoch boundary (the first epoch: since the job started training).
  int64_t host_live_growth = 0;
  int64_t nvme_live_growth = 0;
  int64_t pss_growth = 0;  // tree anonymous PSS, boundary over boundary
  // What the fork cost: tree anonymous PSS at the first step minus before the fork. Copy-on-write
  // copies of state the first step wrote land here (the Yi-34B mechanism). Anonymous PSS, as the
  // leak detectors use: total PSS also moves when unrelated processes map the same libraries.
  int64_t fork_pss_growth() const {
    return static_cast<int64_t>(tree_at_first_step.pss_anon_bytes) -
           static_cast<int64_t>(tree_before_fork.pss_anon_bytes);
  }
};

struct TrainJobResult {
  std::vector<EpochSummary> epochs;  // the epochs this run trained (after a resume: the rest)
  int64_t resumed_from_epoch = 0;    // the checkpoint's epoch; 0 when the run started fresh
  struct Checkpoint {
    std::string path;
    int64_t step = 0;
    double seconds = 0.0;
    // The tree's anonymous PSS during the save (sampled every 2 ms) over its level just before.
    int64_t peak_extra_pss_bytes = 0;
    // The host arena's live bytes at their peak during the save over their level just before
    // (HostArena::ResetPeakStats): what `spillway plan --trainer` predicts as the save's.
    uint64_t peak_extra_host_bytes = 0;
  };
  std::vector<Checkpoint> checkpoints;  // saved by this run, in order
  std::string sample;
  std::string metrics_address;  // bound address, empty when off
  std::string compute;          // where the math ran, and why
  uint64_t forks = 0;
};

// Runs the whole job. Every failure (bad config, missing data, a dead worker, an I/O error) is a
// status that says what to change; the swap directory the job created is removed either way.
Result<TrainJobResult> RunTrainJob(const TrainJobOptions& options);

// What `spillway plan --trainer` plans for this job: its model's units (the corpus's vocabulary)
// and its config (kDefaultTrainConfig when it names none; no swap directory is created). The
// host RAM, NVMe and GPU fields are left for the caller.
Result<offload::PlanInput> TrainJobPlanInput(const TrainJobOptions& options);

// The report printed at an epoch boundary.
std::string FormatEpochReport(const EpochSummary& s);

}  // namespace spillway::cli
