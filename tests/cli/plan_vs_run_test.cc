// `spillway plan --trainer` against measured `spillway train` runs (RunTrainJob, the code the
// command runs), for offload none, cpu and nvme: the host bytes by kind and the NVMe bytes at an
// epoch boundary (the ledger), the host arena's committed bytes (what an inherited arena's fork
// copies), and what the end-of-epoch save holds beyond the steady state (the host arena's live
// peak during Trainer::Save). Each within 10% of the plan, or equal where the plan says 0. The
// process-level fork cost is printed beside the plan's (see the test for why it is not held to
// 10%).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "spillway/base/bytes.h"
#include "spillway/base/status.h"
#include "spillway/cli/train_job.h"
#include "spillway/offload/planner.h"

namespace spillway::cli {
namespace {

struct PlannedRun {
  offload::PlanReport plan;
  TrainJobResult result;
};

std::string Dir(const std::string& name) {
  const std::string d =
      ::testing::TempDir() + "/plan_vs_run_" + name + "_" + std::to_string(getpid());
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// A model whose state (20 bytes per parameter, about 7.3M parameters) is large against the fork's
// other costs (the trainer's heap and the workers' own pages, tens of MiB).
void WriteConfig(const std::string& path, const std::string& offload,
                 const std::string& fork_safety) {
  std::ofstream(path) << R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
      "zero_optimization": {"stage": 3, "sub_group_size": 1000000,
        "offload_optimizer": {"device": ")"
                      << offload << R"(", "nvme_path": "/unused", "pin_memory": true},
        "offload_param": {"device": ")"
                      << offload << R"(", "nvme_path": "/unused", "pin_memory": true}},
      "aio": {"block_size": 1048576, "queue_depth": 8},
      "spillway": {"host_budget_bytes": "2GiB", "nvme_budget_bytes": "2GiB", "fork_safety": ")"
                      << fork_safety << R"("}})";
}

constexpr const char* kModelFlags = "--layers 4 --d-model 384 --heads 4 --seq-len 32";

// The second epoch's fork cost (tree anonymous PSS at its first step over just before its fork)
// of a real `spillway train` process: a fresh process each time, so that no heap of an earlier run
// in this one is copied on its account.
double ForkCostOfAProcess(const std::string& offload, const std::string& fork_safety) {
  const std::string dir = Dir("cli_" + offload + "_" + fork_safety);
  WriteConfig(dir + "/ds.json", offload, fork_safety);
  const std::string cmd =
      StrCat(SPILLWAY_BINARY, " train --config ", dir, "/ds.json --swap-dir ", dir,
             " --epochs 2 --steps 2 --workers 1 --threads 2 --sample 0 --metrics off ", kModelFlags,
             " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (p != nullptr && std::fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  const int status = p != nullptr ? pclose(p) : -1;
  std::filesystem::remove_all(dir);
  EXPECT_EQ(status, 0) << out;
  const std::string key = "the fork cost ";
  const size_t at = out.rfind(key);  // the last epoch's
  EXPECT_NE(at, std::string::npos) << out;
  return at == std::string::npos
             ? 0.0
             : std::strtod(out.c_str() + at + key.size(), nullptr) * static_cast<double>(kMiB);
}

// The job's options for `offload` (none, cpu, nvme) and `fork_safety`, its config written in `dir`.
TrainJobOptions Options(const std::string& offload, const std::string& fork_safety,
                        const std::string& dir) {
  TrainJobOptions o;
  o.epochs = 2;
  o.steps_per_epoch = 2;
  o.workers = 1;
  o.model.d_model = 384;  // as kModelFlags
  o.model.n_head = 4;
  o.model.n_layer = 4;
  o.model.seq_len = 32;
  o.metrics_address = "off";
  o.threads = 2;
  o.sample_chars = 0;
  o.progress = false;
  o.swap_dir = dir;
  o.save_dir = dir + "/checkpoints";
  o.config_path = dir + "/ds.json";
  WriteConfig(o.config_path, offload, fork_safety);
  return o;
}

offload::PlanReport Plan(const TrainJobOptions& o) {
  auto in = TrainJobPlanInput(o);
  EXPECT_TRUE(in.ok()) << in.status().ToString();
  if (!in.ok()) return {};
  in->host_ram_bytes = in->nvme_bytes = 64ull << 30;
  auto plan = offload::MakePlan(*in);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  return plan.ok() ? *plan : offload::PlanReport{};
}

// The plan, and an in-process run with a save at its end (the ledger's and the arena's numbers).
PlannedRun PlanAndRun(const std::string& offload) {
  const std::string dir = Dir(offload);
  const TrainJobOptions o = Options(offload, "dontfork", dir);
  PlannedRun run;
  run.plan = Plan(o);
  auto r = RunTrainJob(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (r.ok()) run.result = std::move(*r);
  std::filesystem::remove_all(dir);
  return run;
}

const allocator::TierReport* Tier(const EpochSummary& e, const std::string& name) {
  for (const auto& t : e.boundary.tiers) {
    if (t.tier == name) return &t;
  }
  return nullptr;
}

void ExpectWithinTenPercent(double planned, double measured, const std::string& what) {
  std::printf("  %-34s plan %9.2f MiB  run %9.2f MiB  (%+.1f%%)\n", what.c_str(),
              planned / static_cast<double>(kMiB), measured / static_cast<double>(kMiB),
              planned == 0 ? 0.0 : 100.0 * (measured - planned) / planned);
  if (planned == 0) {
    EXPECT_EQ(measured, 0) << what;
  } else {
    EXPECT_LE(std::fabs(measured - planned), 0.1 * planned)
        << what << ": plan " << planned << ", run " << measured;
  }
}

class PlanVsRunTest : public ::testing::TestWithParam<const char*> {};

TEST_P(PlanVsRunTest, ThePlanIsWithinTenPercentOfTheRun) {
  const std::string offload = GetParam();
  const PlannedRun safe = PlanAndRun(offload);
  ASSERT_EQ(safe.result.epochs.size(), 2u);
  const offload::PlanReport& plan = safe.plan;
  std::printf("offload %s\n%s", offload.c_str(), plan.ToString().c_str());

  // Host bytes by kind and NVMe bytes at the last boundary.
  const EpochSummary& last = safe.result.epochs.back();
  const allocator::TierReport* host = Tier(last, "host");
  ASSERT_NE(host, nullptr);
  for (int k = 0; k < allocator::kKindCount; ++k) {
    const auto kind = static_cast<allocator::Kind>(k);
    ExpectWithinTenPercent(static_cast<double>(plan.host_by_kind_per_rank[k]),
                           static_cast<double>(host->live_by_kind[k]),
                           std::string("host ") + allocator::KindName(kind));
  }
  const allocator::TierReport* nvme = Tier(last, "nvme");
  ExpectWithinTenPercent(static_cast<double>(plan.nvme_per_node),
                         nvme ? static_cast<double>(nvme->live_bytes) : 0.0, "nvme");

  // What the arena holds from the OS (mapped and pinned whole), which an inherited arena's fork
  // copies page for page.
  ExpectWithinTenPercent(static_cast<double>(plan.host_committed_per_node),
                         static_cast<double>(host->committed_bytes), "host arena committed");

  // The fork. Spillway's arena (dontfork) is not copied; an inherited one is copied whole, every
  // committed page (the committed bytes are checked above), because io_uring's fixed buffers are
  // DMA-pinned and the kernel copies pinned anonymous pages at the fork itself.
  EXPECT_EQ(plan.fork_extra_spillway_per_node, 0u);
  const std::string dir = Dir(offload + "_inherit_plan");
  const offload::PlanReport inherit_plan = Plan(Options(offload, "inherit", dir));
  std::filesystem::remove_all(dir);
  EXPECT_EQ(inherit_plan.fork_extra_spillway_per_node, inherit_plan.host_committed_per_node);
  // At the level of processes the copy shows, but it is printed, not held to 10%: a fork's cost
  // also holds what the loader's worker and the trainer's heap write, and that part moved by 30 MiB
  // with the machine's load (a dontfork run cost +22.7 MiB alone and +51.9 MiB in CI's parallel
  // ctest, five processes alike each time). What is held: an inherited arena's fork costs more
  // than a fork-safe one's. Second epoch (the first also pays for first touches), fresh processes.
  const double dontfork = ForkCostOfAProcess(offload, "dontfork");
  const double inherit = ForkCostOfAProcess(offload, "inherit");
  std::printf(
      "  fork cost: dontfork %+.2f MiB, inherit %+.2f MiB; inherit - dontfork %.2f MiB against "
      "the plan's %.2f MiB\n",
      dontfork / static_cast<double>(kMiB), inherit / static_cast<double>(kMiB),
      (inherit - dontfork) / static_cast<double>(kMiB),
      inherit_plan.fork_extra_spillway_per_node / static_cast<double>(kMiB));
  EXPECT_GT(inherit, dontfork);

  // The save.
  ASSERT_EQ(safe.result.checkpoints.size(), 1u);
  const auto& save = safe.result.checkpoints[0];
  std::printf("  save: tree anonymous PSS %+.2f MiB\n",
              save.peak_extra_pss_bytes / static_cast<double>(kMiB));
  ExpectWithinTenPercent(static_cast<double>(plan.checkpoint_streamed_bytes),
                         static_cast<double>(save.peak_extra_host_bytes), "save, host arena peak");
}

INSTANTIATE_TEST_SUITE_P(Offload, PlanVsRunTest, ::testing::Values("none", "cpu", "nvme"),
                         [](const auto& p) { return std::string(p.param); });

}  // namespace
}  // namespace spillway::cli
