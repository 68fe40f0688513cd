// The `spillway` program as a user runs it: exit codes, output, and errors for bad flags, missing
// files and impossible inputs.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "spillway/allocator/node_governor.h"

namespace {

struct Outcome {
  int status = -1;
  std::string out;
};

Outcome Spillway(const std::string& args) {
  Outcome r;
  FILE* p = popen((std::string(SPILLWAY_BINARY) + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) r.out.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string WriteConfig(const std::string& name, const std::string& json) {
  // Per process: ctest runs these tests in parallel, and several write the same name.
  const std::string path = ::testing::TempDir() + "/" + std::to_string(getpid()) + "-" + name;
  std::ofstream(path) << json;
  static struct Written {  // removed when the test program exits
    std::vector<std::string> paths;
    ~Written() {
      for (const std::string& p : paths) std::remove(p.c_str());
    }
  } written;
  written.paths.push_back(path);
  return path;
}

TEST(CliTest, PlanYi34BOnOneNodeFitsWithSpillway) {
  const std::string cfg = WriteConfig("yi34b.json", R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu", "pin_memory": true},
      "offload_optimizer": {"device": "cpu", "pin_memory": true}}})");
  Outcome r = Spillway("plan --params 34e9 --world-size 8 --nodes 1 --config " + cfg +
                       " --host-ram 1TiB --nvme 4TiB");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("verdict: fits"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("DeepSpeed defaults 1156.0 GB (does not fit)"), std::string::npos) << r.out;
}

TEST(CliTest, PlanThatDoesNotFitExitsOneAndSaysWhatWould) {
  const std::string cfg = WriteConfig("tight.json", R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "offload_param": {"device": "cpu"}}})");
  Outcome r = Spillway("plan --params 34e9 --world-size 8 --config " + cfg +
                       " --host-ram 256GiB --nvme 4TiB");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("would fit with sub_group_size = 1e8"), std::string::npos) << r.out;
}

TEST(CliTest, PlanRefusesAModelItsGpusCannotHoldAndNamesTheOffloadThatFits) {
  // 34e9 parameters on 8 GPUs without offload: 16 B per parameter, 68 GB per GPU, against 80 GB
  // less the 25% reserve.
  Outcome r = Spillway("plan --params 34e9 --world-size 8 --host-ram 2TiB --gpu-mem 80GB");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("gpu: model states 68.0 GB per GPU + reserve 20.0 GB"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("would fit with zero_optimization.offload_optimizer.device = \"cpu\""),
            std::string::npos)
      << r.out;
  r = Spillway("plan --params 34e9 --world-size 8 --host-ram 2TiB --gpu-mem 0");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("GPU memory not checked"), std::string::npos) << r.out;
}

TEST(CliTest, PlanPrintsThePhasePeaksFromARankBaselineAndRefusesHalfAPhaseInput) {
  const std::string cfg = WriteConfig("phases.json", R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}})");
  const std::string run =
      "plan --params 7e9 --nproc-per-node 8 --host-mem 2TiB --gpu-mem 0 --config " + cfg;
  Outcome r = Spillway(run + " --rank-baseline 2GiB --load whole --checkpoint-dtype bf16");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("phase peaks on node 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  final save"), std::string::npos) << r.out;
  r = Spillway(run + " --rank-baseline 2GiB --json");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find(R"("phases": [{"name": "load", "rank0": )"), std::string::npos) << r.out;
  r = Spillway(run + " --load whole");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("plan the run's phases: give --rank-baseline too"), std::string::npos)
      << r.out;
  r = Spillway(run + " --rank-baseline 0");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--rank-baseline '0' is not a byte size"), std::string::npos) << r.out;
  r = Spillway(run + " --rank-baseline 2GiB --largest-tensor 8000000000");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--largest-tensor 8000000000 is more than --params"), std::string::npos)
      << r.out;
}

#if SPILLWAY_WITH_TORCH
TEST(CliTest, PlanTheTrainerFromItsModelFlags) {
  // 2 blocks of width 64 with the corpus's vocabulary: the units' sum, all on the host (pinned, the
  // default config's pin_memory), the parameters on NVMe too.
  Outcome r = Spillway(
      "plan --trainer --layers 2 --d-model 64 --heads 4 --seq-len 32 --host-ram 8GiB --nvme 8GiB");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("spillway train's trainer"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("host copies of the parameters (cached)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Trainer::Save holds"), std::string::npos) << r.out;
  r = Spillway("plan --trainer --params 5 --host-ram 8GiB --nvme 8GiB");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--params does not go with --trainer"), std::string::npos) << r.out;
}
#endif

TEST(CliTest, BadFlagsMissingFilesAndBadValuesAreClearErrors) {
  Outcome r = Spillway("plan --params 7e9");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("--host-ram is required"), std::string::npos) << r.out;
  r = Spillway("plan --host-ram 1TiB");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("--params is required"), std::string::npos) << r.out;
  r = Spillway("plan --params 7e9 --host-ram 1TiB --gpu-mem lots");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("--gpu-mem"), std::string::npos) << r.out;
  r = Spillway("plan --params 7e9 --host-ram 1TiB --gpu-reserve 1.5");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("--gpu-reserve 1.5 must be in [0, 1)"), std::string::npos) << r.out;
  r = Spillway("plan --params 7e9 --host-ram 1TiB --config /nonexistent/ds.json");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("/nonexistent/ds.json"), std::string::npos) << r.out;
  r = Spillway("plan --params lots --host-ram 1TiB");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("--params 'lots' is not a positive number of parameters"), std::string::npos)
      << r.out;
  r = Spillway("plan --params 7e9 --host-ram 1TiB --world-size 8 --nodes 3");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("must be a positive multiple of --nodes 3"), std::string::npos) << r.out;
  const std::string bad =
      WriteConfig("bad.json", R"({"zero_optimization": {"stage": 3}, "spillway": {"colour": 1}})");
  r = Spillway("plan --params 7e9 --host-ram 1TiB --config " + bad);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("spillway.colour"), std::string::npos) << r.out;
  r = Spillway("frobnicate");
  EXPECT_EQ(r.status, 2) << r.out;
  r = Spillway("plan --help");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("--world-size"), std::string::npos) << r.out;
}

}  // namespace

TEST(CliTest, TrainAndLeakSuiteRefuseBadInputWithExitTwo) {
  Outcome r =
      Spillway("leak-suite --scenario no-such-thing --out " + ::testing::TempDir() + "/leak");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("'no-such-thing' is not a scenario; choose from fork-cow"),
            std::string::npos)
      << r.out;
  r = Spillway("leak-suite --list");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("budget-pressure"), std::string::npos) << r.out;
  r = Spillway("train --epochs 0");
  EXPECT_EQ(r.status, 2) << r.out;
  r = Spillway("train --help");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("train"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--device"), std::string::npos) << r.out;
  r = Spillway("train --device tpu --metrics off");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("'tpu' is not one of auto, cpu, cuda, cuda:N"), std::string::npos) << r.out;
}

TEST(CliTest, AskingForAGpuThatIsNotThereIsAnErrorNotACpuRun) {
  const Outcome r = Spillway("train --device cuda --metrics off");
  if (r.out.find("libtorch sees no CUDA device") == std::string::npos) {
    GTEST_SKIP() << "libtorch sees a CUDA device here; Gpu/TrainerCudaTest covers that case";
  }
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_EQ(r.out.find("end of epoch"), std::string::npos) << "it trained anyway: " << r.out;
}

namespace {

TEST(CliTest, PlanTakesTorchrunsFlagsAndGivesTheNodeVerdict) {
  const std::string cfg = WriteConfig("node.json", R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}})");
  Outcome r = Spillway("plan --params 7e9 --nproc-per-node 8 --config " + cfg +
                       " --host-mem 256GiB --gpu-mem 0");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("8 ranks on 1 node(s)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("node budget (host RAM 256.00 GiB (274877906944 bytes) less the reserve "
                       "32.00 GiB (34359738368 bytes)): 224.00 GiB"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("within it"), std::string::npos) << r.out;
  r = Spillway("plan --params 7e9 --nproc-per-node 8 --config " + cfg +
               " --host-mem 64GiB --gpu-mem 0");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("over it: every rank would fail at admission"), std::string::npos) << r.out;
  r = Spillway("plan --params 7e9 --nproc-per-node 8 --world-size 8 --host-mem 64GiB");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("excludes"), std::string::npos) << r.out;
}

// `spillway node` reads a live job's segment from outside: a forked process joins as local rank 0
// of a job named here and books 24 MiB; the command prints the ledger.
TEST(CliTest, NodePrintsTheLedgerOfALiveJobAndSaysWhenThereIsNone) {
  const std::string job = "cli-test-" + std::to_string(getpid());
  int ready[2], done[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(done), 0);
  const pid_t child = fork();
  if (child == 0) {
    spillway::allocator::NodeGovernorOptions o;
    o.job = job;
    o.ledger = job;  // its own (tests run beside each other); --job finds the ledger holding it
    o.local_rank = 0;
    o.host_budget_bytes = 512ull << 20;
    auto g = spillway::allocator::NodeGovernor::Join(o);
    if (!g.ok() || !(*g)->Reserve(spillway::allocator::NodeTier::kPinned, 24ull << 20).ok()) {
      _exit(1);
    }
    char b = 1;
    if (write(ready[1], &b, 1) != 1 || read(done[0], &b, 1) != 1) _exit(2);
    g->reset();
    _exit(0);
  }
  char b = 0;
  ASSERT_EQ(read(ready[0], &b, 1), 1);
  Outcome r = Spillway("node --job " + job);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("job " + job), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("host budget 512.00 MiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("host committed 24.00 MiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("24.0 MiB"), std::string::npos) << "rank 0's pinned column: " << r.out;
  ASSERT_EQ(write(done[1], &b, 1), 1);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  r = Spillway("node --job " + job);  // the last rank out removed the segment
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("no node segment"), std::string::npos) << r.out;
}

}  // namespace
