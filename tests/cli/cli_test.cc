// The `spillway` program as a user runs it: exit codes, output, and errors for bad flags, missing
// files and impossible inputs.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

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
