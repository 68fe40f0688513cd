// Trainer::Save and Trainer::Load on real files through the real io_uring engine: a resumed run
// equals an uninterrupted one bit for bit (offload none, cpu, nvme; world size 2 runs in
// tests/python/test_engine.py on a Gloo group); a failed save leaves the previous checkpoint
// loadable; every bad checkpoint is refused, naming the file, the tensor and the fix, with the
// trainer unchanged. Killed saves: tests/cli/checkpoint_crash_test.cc.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../offload/store_test_util.h"
#include "spillway/allocator/io_faults.h"
#include "spillway/base/bytes.h"
#include "spillway/trainer/trainer.h"
#include "trainer_test_util.h"

namespace spillway::trainer {
namespace {

namespace fs = std::filesystem;
using offload::testing::ParseOrDie;
using offload::testing::StoreRig;
using testing::Adam;
using testing::Batch;
using testing::Json;
using testing::SmallGpt;

constexpr int kAccum = 2;

// A trainer on its own store, arenas and engine.
struct TrainRun {
  explicit TrainRun(const std::string& offload, GptConfig model = SmallGpt(),
                    allocator::IoFaults* faults = nullptr)
      // The product's prefetch window (spillway.prefetch_partitions' default).
      : model_(model),
        rig(ParseOrDie(Json(offload.c_str(), offload.c_str())), 256 * kMiB, true, faults, 2) {
    TrainerOptions o;
    o.model = model;
    o.adam = Adam();
    o.max_grad_norm = 0.5;
    o.optimizer_threads = 2;
    trainer = std::move(Trainer::Create(o, coll.get(), rig.store.get(), rig.host.get(), &rig.ledger,
                                        allocator::kProcessScope)
                            .value());
    EXPECT_TRUE(rig.ledger.BeginEpoch(0).ok());
  }
  std::vector<double> Train(int from, int to) {
    std::vector<double> losses;
    for (int s = from; s < to; ++s) {
      auto r = trainer->Step({Batch(trainer_model(), s, 0), Batch(trainer_model(), s, 1)});
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (r.ok()) losses.push_back(r->loss);
    }
    return losses;
  }
  std::vector<torch::Tensor> Weights() {
    std::vector<torch::Tensor> w;
    for (int64_t u = 0; u < gpt::Units(trainer_model()); ++u)
      w.push_back(trainer->GatherUnit(u).value());
    return w;
  }
  CheckpointOptions Options() {
    CheckpointOptions o;
    o.io = rig.engine.get();
    return o;
  }
  const GptConfig& trainer_model() const { return model_; }

  GptConfig model_ = SmallGpt();
  std::unique_ptr<Collectives> coll = std::move(Collectives::Create(DistEnv{}).value());
  StoreRig rig;
  std::unique_ptr<Trainer> trainer;
};

std::string FreshDir(const std::string& name) {
  const std::string d =
      allocator::testing::NvmeTestDir() + "/ckpt-" + std::to_string(getpid()) + "-" + name;
  fs::remove_all(d);
  return d;
}

void ExpectSameWeights(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t u = 0; u < a.size(); ++u) EXPECT_TRUE(torch::equal(a[u], b[u])) << "unit " << u;
}

class CheckpointResumeTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CheckpointResumeTest, AResumedRunEqualsAnUninterruptedOneBitForBit) {
  const std::string dir = FreshDir(StrCat("resume-", GetParam()));
  TrainRun whole(GetParam());
  const std::vector<double> want = whole.Train(0, 6);

  TrainRun first(GetParam());
  EXPECT_EQ(first.Train(0, 4), std::vector<double>(want.begin(), want.begin() + 4));
  CheckpointOptions so = first.Options();
  so.extra_json = R"({"epoch": 2})";
  auto saved = first.trainer->Save(dir, so);
  ASSERT_TRUE(saved.ok()) << saved.status().ToString();
  EXPECT_EQ(saved->step, 4);
  EXPECT_EQ(saved->path, dir + "/step-00000004");
  const torch::Tensor after_save = torch::rand({4});  // the CPU generator, past the saved state

  TrainRun resumed(GetParam());
  (void)torch::rand({7});  // move the generator elsewhere: the load must put it back
  auto loaded = resumed.trainer->Load(dir, resumed.Options());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->step, 4);
  EXPECT_EQ(loaded->path, dir + "/step-00000004");
  EXPECT_EQ(nlohmann::json::parse(loaded->extra_json)["epoch"], 2);
  EXPECT_EQ(resumed.trainer->steps(), 4);
  EXPECT_EQ(resumed.trainer->optimizer().step(), 4u);
  EXPECT_TRUE(torch::equal(torch::rand({4}), after_save)) << "the torch CPU generator's state";
  EXPECT_EQ(resumed.Train(4, 6), std::vector<double>(want.begin() + 4, want.end()));
  ExpectSameWeights(resumed.Weights(), whole.Weights());
  fs::remove_all(dir);
}

TEST_P(CheckpointResumeTest, ControlAFreshTrainerWithoutTheLoadDiffers) {
  // The comparison above can fail: a trainer that skipped the load trains to other losses.
  TrainRun whole(GetParam());
  const std::vector<double> want = whole.Train(0, 6);
  TrainRun fresh(GetParam());
  EXPECT_NE(fresh.Train(4, 6), std::vector<double>(want.begin() + 4, want.end()));
}

TEST_P(CheckpointResumeTest, ASaveLeavesTheHostArenaAsItFoundIt) {
  // A save streams each partition from where the store keeps it. One homed on NVMe and not in
  // host memory passes through a host slot for its own write only: the epoch boundary's host
  // bytes do not grow by the optimizer state (12 bytes per parameter) at every save.
  const std::string dir = FreshDir(StrCat("arena-", GetParam()));
  TrainRun run(GetParam());
  run.Train(0, 2);
  const uint64_t live = run.rig.host->Stats().live_bytes;
  const uint64_t resident = run.rig.store->Stats().resident_bytes;
  auto saved = run.trainer->Save(dir, run.Options());
  ASSERT_TRUE(saved.ok()) << saved.status().ToString();
  EXPECT_EQ(run.rig.host->Stats().live_bytes, live);
  EXPECT_EQ(run.rig.store->Stats().resident_bytes, resident);
  EXPECT_EQ(run.Train(2, 3).size(), 1u);  // and training goes on from there
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Offload, CheckpointResumeTest, ::testing::Values("none", "cpu", "nvme"),
                         [](const auto& p) { return std::string(p.param); });

TEST(CheckpointTest, TheFormatIsSafetensorsWithAManifestAndOldCheckpointsGo) {
  const std::string dir = FreshDir("format");
  TrainRun run("cpu");
  for (int i = 1; i <= 3; ++i) {
    run.Train(i - 1, i);
    ASSERT_TRUE(run.trainer->Save(dir, run.Options()).ok());
  }
  // keep = 2: the newest two remain, `latest` names the newest, no temporary directory is left.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000002", "step-00000003"}));
  std::ifstream latest(dir + "/latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-00000003");
  const std::string ckpt = dir + "/step-00000003";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(ckpt + "/manifest.json"));
  EXPECT_EQ(m["world_size"], 1);
  EXPECT_EQ(m["step"], 3);
  EXPECT_EQ(m["model"]["d_model"], 32);
  const nlohmann::json& t = m["ranks"][0]["tensors"];
  EXPECT_EQ(m["ranks"][0]["file"], "rank-00000-of-00001.safetensors");
  EXPECT_EQ(t.size(), 4u * gpt::Units(SmallGpt()) + 1);
  EXPECT_EQ(t["unit.1.exp_avg"]["dtype"], "F32");
  // Readable without Spillway's writer: the reader checks the header against the file size.
  auto reader = engine::checkpoint::FileReader::Open(ckpt + "/rank-00000-of-00001.safetensors",
                                                     run.rig.engine.get());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  const engine::checkpoint::TensorRecord* param = (*reader)->Find("unit.0.param");
  ASSERT_NE(param, nullptr);
  std::vector<float> p(param->spec.bytes / 4);
  auto crc = (*reader)->Read(*param, p.data());
  ASSERT_TRUE(crc.ok());
  EXPECT_EQ(*crc, t["unit.0.param"]["crc32c"].get<uint32_t>());
  const torch::Tensor unit0 = run.trainer->GatherUnit(0).value();
  EXPECT_TRUE(torch::equal(torch::from_blob(p.data(), {unit0.numel()}), unit0));
  fs::remove_all(dir);
}

TEST(CheckpointTest, AFailedSaveLeavesThePreviousCheckpointLoadable) {
  const std::string dir = FreshDir("failed-save");
  allocator::IoFaults faults;
  TrainRun run("cpu", SmallGpt(), &faults);
  run.Train(0, 2);
  ASSERT_TRUE(run.trainer->Save(dir, run.Options()).ok());
  const std::vector<torch::Tensor> at_two = run.Weights();
  run.Train(2, 3);
  CheckpointOptions o = run.Options();
  int tensors = 0;
  o.fault_hook = [&](std::string_view point) {
    if (point == "tensor" && ++tensors == 2) faults.write_errno = EIO;  // the third one fails
  };
  auto bad = run.trainer->Save(dir, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kIoError) << bad.status().ToString();
  EXPECT_NE(bad.status().message().find("writing tensor 'unit.0.exp_avg'"), std::string::npos)
      << bad.status().ToString();
  // The trainer goes on, and `latest` still names the step-2 checkpoint, which loads.
  run.Train(3, 4);
  TrainRun other("cpu");
  auto loaded = other.trainer->Load(dir, other.Options());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->step, 2);
  ExpectSameWeights(other.Weights(), at_two);
  // The next save succeeds and clears the failed one's temporary directory.
  ASSERT_TRUE(run.trainer->Save(dir, run.Options()).ok());
  EXPECT_FALSE(fs::exists(dir + "/.tmp-step-00000003"));
  fs::remove_all(dir);
}

// Each bad checkpoint is refused with what to change, and the trainer that tried is unchanged.
class BadCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    TrainRun saver("cpu");
    saver.Train(0, 2);
    ASSERT_TRUE(saver.trainer->Save(dir_, saver.Options()).ok());
    ckpt_ = dir_ + "/step-00000002";
    file_ = ckpt_ + "/rank-00000-of-00001.safetensors";
    target_.Train(0, 1);
    before_ = target_.Weights();
  }
  void TearDown() override { fs::remove_all(dir_); }
  void ExpectRefused(StatusCode code, const std::vector<std::string>& says,
                     TrainRun* run = nullptr) {
    TrainRun& r = run ? *run : target_;
    auto st = r.trainer->Load(dir_, r.Options());
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.status().code(), code) << st.status().ToString();
    for (const std::string& s : says) {
      EXPECT_NE(st.status().message().find(s), std::string::npos)
          << "missing '" << s << "' in: " << st.status().message();
    }
    if (run == nullptr) {
      ExpectSameWeights(target_.Weights(), before_);
      EXPECT_EQ(target_.trainer->steps(), steps_);
      EXPECT_EQ(target_.Train(steps_, steps_ + 1).size(), 1u) << "the trainer still steps";
      ++steps_;
      before_ = target_.Weights();
    }
  }
  // Rewrites the rank file with `edit` applied to each tensor's spec and bytes.
  void RewriteRankFile(
      const std::function<void(engine::checkpoint::TensorSpec&, std::vector<char>&)>& edit) {
    auto reader = engine::checkpoint::FileReader::Open(file_, target_.rig.engine.get());
    ASSERT_TRUE(reader.ok());
    std::vector<engine::checkpoint::TensorSpec> specs;
    std::vector<std::vector<char>> data;
    for (const auto& t : (*reader)->tensors()) {
      engine::checkpoint::TensorSpec s = t.spec;
      data.emplace_back(t.spec.bytes);
      ASSERT_TRUE((*reader)->Read(t, data.back().data()).ok());
      edit(s, data.back());
      specs.push_back(s);
    }
    reader->reset();
    auto w = engine::checkpoint::FileWriter::Create(file_, specs, target_.rig.engine.get());
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    for (const auto& d : data) ASSERT_TRUE((*w)->Write(d.data()).ok());
    ASSERT_TRUE((*w)->Finish().ok());
  }
  nlohmann::json Manifest() {
    return nlohmann::json::parse(std::ifstream(ckpt_ + "/manifest.json"));
  }
  void WriteManifest(const nlohmann::json& m) {
    std::ofstream(ckpt_ + "/manifest.json") << m.dump();
  }

  std::string dir_, ckpt_, file_;
  TrainRun target_{"cpu"};
  std::vector<torch::Tensor> before_;
  int steps_ = 1;
};

TEST_F(BadCheckpointTest, AFlippedByteIsCaughtByItsCrcAndNamesTheTensor) {
  auto reader = engine::checkpoint::FileReader::Open(file_, target_.rig.engine.get());
  ASSERT_TRUE(reader.ok());
  const uint64_t begin = (*reader)->Find("unit.1.master")->begin;
  reader->reset();
  std::ifstream in(file_, std::ios::binary);
  uint64_t header = 0;
  in.read(reinterpret_cast<char*>(&header), 8);
  in.close();
  std::fstream f(file_, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(8 + header + begin + 37));
  char c = 0;
  f.read(&c, 1);
  c ^= 0x10;
  f.seekp(static_cast<std::streamoff>(8 + header + begin + 37));
  f.write(&c, 1);
  f.close();
  ExpectRefused(StatusCode::kChecksumMismatch,
                {file_, "tensor 'unit.1.master'", "CRC32C", "older checkpoint"});
}

TEST_F(BadCheckpointTest, AWrongWorldSizeIsRefused) {
  nlohmann::json m = Manifest();
  m["world_size"] = 2;
  WriteManifest(m);
  ExpectRefused(StatusCode::kInvalidArgument,
                {"written by 2 rank(s); this run has 1", "--nproc-per-node 2"});
}

TEST_F(BadCheckpointTest, AMissingRankFileIsRefused) {
  fs::remove(file_);
  ExpectRefused(StatusCode::kInvalidArgument, {file_, "missing"});
}

TEST_F(BadCheckpointTest, AnotherModelIsRefusedNamingTheSetting) {
  GptConfig wider = SmallGpt();
  wider.d_model = 64;
  TrainRun other("cpu", wider);
  ExpectRefused(StatusCode::kInvalidArgument, {"d_model = 32", "this trainer's has 64"}, &other);
}

TEST_F(BadCheckpointTest, ADtypeOrShapeThatDisagreesWithTheTrainerIsRefused) {
  // A header that says F16 for a tensor: not what this trainer holds (checked before the manifest).
  RewriteRankFile([](engine::checkpoint::TensorSpec& s, std::vector<char>&) {
    if (s.name == "unit.2.param") {
      s.dtype = "F16";
      s.shape[0] *= 2;
    }
  });
  ExpectRefused(StatusCode::kInvalidArgument,
                {file_, "tensor 'unit.2.param'", "F16", "this trainer needs F32"});
}

TEST_F(BadCheckpointTest, ADamagedManifestOrLatestOrNoCheckpointIsRefused) {
  std::ofstream(ckpt_ + "/manifest.json") << "{\"format\": \"spillway-checkpoint\", \"versi";
  ExpectRefused(StatusCode::kChecksumMismatch, {"manifest.json", "damaged"});
  std::ofstream(dir_ + "/latest") << "../elsewhere\n";
  ExpectRefused(StatusCode::kChecksumMismatch, {"latest", "not a checkpoint name"});
  fs::remove(dir_ + "/latest");
  ExpectRefused(StatusCode::kInvalidArgument, {"holds no checkpoint"});
}

TEST_F(BadCheckpointTest, FieldsOfTheWrongTypeAreADamagedManifestNotACrash) {
  const nlohmann::json good = Manifest();
  for (int k = 0; k < 4; ++k) {
    nlohmann::json m = good;
    if (k == 0) m.erase("model");
    if (k == 1) m["ranks"][0] = "rank-00000-of-00001.safetensors";
    if (k == 2) m["ranks"][0]["tensors"]["unit.0.param"]["crc32c"] = "0x1234";
    if (k == 3) m["step"] = -4;
    WriteManifest(m);
    ExpectRefused(StatusCode::kChecksumMismatch, {"manifest.json", "wrong type", "damaged"});
  }
}

TEST_F(BadCheckpointTest, GeneratorStateOfAnotherSizeIsRefusedBeforeAnythingChanges) {
  // Another torch's generator state: the file is rewritten with 8 more bytes of it.
  RewriteRankFile([](engine::checkpoint::TensorSpec& s, std::vector<char>& bytes) {
    if (s.name != "rng.torch_cpu") return;
    s.shape[0] += 8;
    s.bytes += 8;
    bytes.resize(s.bytes);
  });
  ExpectRefused(StatusCode::kInvalidArgument, {"rng.torch_cpu", "another torch version"});
}

TEST(CheckpointTest, AfterAResumeFromAnOlderStepTheAbandonedCheckpointsGoFirst) {
  const std::string dir = FreshDir("prune-resume");
  TrainRun first("cpu");
  CheckpointOptions all = first.Options();
  all.keep = 0;
  for (int i = 1; i <= 3; ++i) {
    first.Train(i - 1, i);
    ASSERT_TRUE(first.trainer->Save(dir, all).ok());
  }
  TrainRun again("cpu");
  ASSERT_TRUE(again.trainer->Load(dir + "/step-00000001", again.Options()).ok());
  again.Train(1, 2);
  auto saved = again.trainer->Save(dir, again.Options());  // keep = 2; step 2 is taken
  ASSERT_TRUE(saved.ok()) << saved.status().ToString();
  EXPECT_EQ(saved->path, dir + "/step-00000002.1");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000002", "step-00000002.1"}));
  TrainRun check("cpu");
  auto loaded = check.trainer->Load(dir, check.Options());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->path, dir + "/step-00000002.1");
  ExpectSameWeights(check.Weights(), again.Weights());
  fs::remove_all(dir);
}

TEST(CheckpointTest, SaveRefusesBadOptions) {
  TrainRun run("cpu");
  CheckpointOptions o = run.Options();
  o.extra_json = "[1]";
  auto st = run.trainer->Save(FreshDir("bad-options"), o);
  EXPECT_EQ(st.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.status().message().find("JSON object"), std::string::npos) << st.status().message();
  o = CheckpointOptions{};
  st = run.trainer->Save(FreshDir("bad-options"), o);
  EXPECT_NE(st.status().message().find("io_uring engine"), std::string::npos)
      << st.status().message();
  fs::remove_all(FreshDir("bad-options"));
}

}  // namespace
}  // namespace spillway::trainer
