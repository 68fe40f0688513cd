// The main job end to end, in process: real forked loader workers, a real NVMe swap file, the real
// exporter scraped over HTTP mid-run. It learns (the loss falls), nothing escapes, host and NVMe
// live bytes are flat across epoch boundaries, and bad input is refused with what to change.
#include "spillway/cli/train_job.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "../metrics/http_util.h"
#include "spillway/metrics/exporter.h"

namespace spillway::cli {
namespace {

// Removes the tests' swap directories once every test has run (in the test process only: the
// loader's workers never run global tear-downs).
class SwapDirs : public ::testing::Environment {
 public:
  static std::vector<std::string>& dirs() {
    static std::vector<std::string> d;
    return d;
  }
  void TearDown() override {
    for (const std::string& d : dirs()) std::filesystem::remove_all(d);
  }
};
[[maybe_unused]] ::testing::Environment* const kSwapDirs =
    ::testing::AddGlobalTestEnvironment(new SwapDirs);

TrainJobOptions Small() {
  TrainJobOptions o;
  o.epochs = 3;
  o.steps_per_epoch = 6;
  o.workers = 2;
  o.model.d_model = 32;
  o.model.n_head = 2;
  o.model.n_layer = 1;
  o.model.seq_len = 32;
  o.metrics_address = "127.0.0.1:0";
  o.threads = 2;
  o.sample_chars = 20;
  o.progress = false;
  // One directory per test and process: ctest runs these tests in parallel, and two jobs must not
  // share swap files.
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  o.swap_dir =
      ::testing::TempDir() + "/train_job_swap_" + info->name() + "_" + std::to_string(getpid());
  std::filesystem::create_directories(o.swap_dir);
  SwapDirs::dirs().push_back(o.swap_dir);
  return o;
}

TEST(TrainJobTest, LearnsWithFlatMemoryAndLiveMetrics) {
  TrainJobOptions o = Small();
  std::vector<double> losses;
  std::string scraped, bound;
  // Port 0: the job binds a free port itself (a port picked beforehand can be taken by another
  // test running in parallel before the job binds it).
  o.metrics_address = "127.0.0.1:0";
  o.on_step = [&](const TrainJobOptions::StepEvent& e) {
    bound = e.metrics_address;
    losses.push_back(e.loss);
    EXPECT_GT(e.nvme_live_bytes, 0u) << "parameters are homed on NVMe in the default config";
    if (e.epoch == 2 && e.step == 1) {
      // The job is live: scrape it the way Prometheus would.
      const int port = std::stoi(e.metrics_address.substr(e.metrics_address.rfind(':') + 1));
      EXPECT_NE(port, 0);
      scraped = metrics::testing::Body(metrics::testing::HttpGet(port, "/metrics"));
    }
  };
  auto r = RunTrainJob(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->epochs.size(), 3u);
  EXPECT_EQ(r->forks, 6u);
  EXPECT_EQ(r->metrics_address, bound);
  EXPECT_EQ(bound.rfind("127.0.0.1:", 0), 0u) << bound;
  // It learns: a uniform guess over 96 symbols is ln 96 = 4.56.
  ASSERT_EQ(losses.size(), 18u);
  EXPECT_LT(r->epochs.back().mean_loss, r->epochs.front().mean_loss);
  EXPECT_LT(losses.back(), 4.0);
  for (const EpochSummary& s : r->epochs) {
    EXPECT_TRUE(s.boundary.clean()) << s.boundary.ToString();
    EXPECT_EQ(s.tree_at_first_step.processes, 3u) << "the two workers are alive at the first step";
    EXPECT_EQ(s.tree_at_boundary.processes, 1u) << "the workers are reaped at the boundary";
    if (s.epoch > 1) {
      EXPECT_EQ(s.host_live_growth, 0) << "epoch " << s.epoch;
      EXPECT_EQ(s.nvme_live_growth, 0) << "epoch " << s.epoch;
    }
    const std::string report = FormatEpochReport(s);
    EXPECT_NE(report.find("process tree anonymous PSS"), std::string::npos) << report;
    EXPECT_NE(report.find("optimizer_state"), std::string::npos) << report;
  }
  EXPECT_NE(scraped.find("spillway_optimizer_steps_total"), std::string::npos) << scraped;
  EXPECT_NE(scraped.find("spillway_epoch 2"), std::string::npos) << scraped;
  EXPECT_NE(scraped.find("tier=\"nvme\""), std::string::npos) << scraped;
  // The parameters reach the compute device through the transfer pipeline, which the job exports.
  EXPECT_NE(scraped.find("spillway_transfer_bytes_total{direction=\"nvme_to_device\"}"),
            std::string::npos)
      << scraped;
  EXPECT_EQ(r->sample.size(), std::string("This License ").size() + 20);
}

// The save streams partitions from where they live: the tree's anonymous PSS during it stays within
// the config's I/O window (queue_depth 8 x block_size 1 MiB) plus 4 MiB, for a model four times
// that size (and its three optimizer states), so a gathered copy, even a 16-bit one, would not fit
// under the bound. The control checks the sampler: under it, a copy of the parameters held in host
// memory while it is written (the shape of DeepSpeed's gather-to-host save) grows by the model.
TEST(TrainJobTest, ASaveHoldsNoCopyOfTheModel) {
  TrainJobOptions o = Small();
  o.epochs = 1;
  o.steps_per_epoch = 1;
  o.workers = 1;
  o.sample_chars = 0;
  o.metrics_address = "off";
  o.model.d_model = 512;
  o.model.n_layer = 4;
  o.model.n_head = 8;
  o.config_path = o.swap_dir + "/small-batch.json";
  std::ofstream(o.config_path)
      << R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                            "offload_param": {"device": "nvme", "nvme_path": "/unused"}},
      "aio": {"block_size": 1048576, "queue_depth": 8},
      "spillway": {"host_budget_bytes": "1GiB", "nvme_budget_bytes": "1GiB"}})";
  o.save_dir = o.swap_dir + "/checkpoints";
  auto r = RunTrainJob(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->checkpoints.size(), 1u);
  int64_t params = 0;
  for (int64_t u = 0; u < trainer::gpt::Units(o.model); ++u)
    params += trainer::gpt::UnitNumel(o.model, u);
  const int64_t model_bytes = params * 4, bound = (8 + 4) << 20;
  std::printf("save of a %.1f MiB model (x4 states): tree anonymous PSS peak %+.2f MiB\n",
              model_bytes / 1048576.0, r->checkpoints[0].peak_extra_pss_bytes / 1048576.0);
  EXPECT_LE(r->checkpoints[0].peak_extra_pss_bytes, bound);

  auto before = ProcessTreeMemory(getpid());
  ASSERT_TRUE(before.ok());
  PeakSampler sampler(getpid());
  {
    // Fresh pages (glibc would serve a vector from heap it kept from the training, already
    // counted).
    void* gathered = mmap(nullptr, static_cast<size_t>(model_bytes), PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(gathered, MAP_FAILED);
    std::memset(gathered, 0x3f, static_cast<size_t>(model_bytes));
    std::ofstream(o.swap_dir + "/gathered.bin", std::ios::binary)
        .write(static_cast<const char*>(gathered), model_bytes);
    munmap(gathered, static_cast<size_t>(model_bytes));
  }
  auto peak = sampler.Stop();
  ASSERT_TRUE(peak.ok());
  const int64_t control =
      static_cast<int64_t>(*peak) - static_cast<int64_t>(before->pss_anon_bytes);
  std::printf("control, gather to host: %+.2f MiB\n", control / 1048576.0);
  EXPECT_GE(control, model_bytes * 9 / 10);
  EXPECT_GT(control, bound);
}

TEST(TrainJobTest, ItsOwnSwapDirectoryIsRemoved) {
  TrainJobOptions o = Small();
  o.swap_dir.clear();
  const std::string tmp = ::testing::TempDir() + "/train_job_tmp";
  std::filesystem::create_directories(tmp);
  setenv("TMPDIR", tmp.c_str(), 1);
  o.epochs = 1;
  o.steps_per_epoch = 1;
  o.metrics_address = "off";
  auto r = RunTrainJob(o);
  unsetenv("TMPDIR");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(std::filesystem::is_empty(tmp)) << "the job left its swap directory behind";
}

TEST(TrainJobTest, BadInputSaysWhatToChange) {
  TrainJobOptions o = Small();
  o.metrics_address = "off";
  o.data_path = "/nonexistent/licence.txt";
  auto r = RunTrainJob(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--data /nonexistent/licence.txt: cannot open"),
            std::string::npos);

  o = Small();
  o.metrics_address = "off";
  o.config_path = ::testing::TempDir() + "/stage2.json";
  std::ofstream(o.config_path) << R"({"zero_optimization": {"stage": 2}})";
  r = RunTrainJob(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("set it to 3"), std::string::npos) << r.status().message();

  std::ofstream(o.config_path)
      << R"({"zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD"}})";
  r = RunTrainJob(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("implements \"Adam\" and \"AdamW\""), std::string::npos);

  o = Small();
  o.model.n_head = 3;  // 32 is not a multiple of 3
  o.metrics_address = "off";
  r = RunTrainJob(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("multiple of n_head"), std::string::npos);

  // The metrics port is taken: the job says so instead of training blind.
  o = Small();
  auto first = metrics::Exporter::Start({"127.0.0.1:0", true});
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  o.metrics_address = "127.0.0.1:" + std::to_string((*first)->port());
  r = RunTrainJob(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace spillway::cli
