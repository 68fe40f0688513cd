// Crash safety of `spillway train --save`: the real program is SIGKILLed in the middle of its
// second save (between tensors, halfway through a tensor, after a file, before the manifest, before
// the rename, before `latest` moves), through the SPILLWAY_TEST_KILL_SAVE_AT seam. The first
// checkpoint must still be what `latest` names, and resuming from it must end where an
// uninterrupted run ends: every tensor's CRC32C in the final manifests is equal, so the states are
// equal bit for bit. (The seam is the CLI's; the kill is a real SIGKILL of the real process.)
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

namespace fs = std::filesystem;

struct Outcome {
  bool killed = false;  // by SIGKILL (directly, or as the shell reports it)
  int exit_code = -1;
  std::string out;
};

Outcome Spillway(const std::string& env, const std::string& args) {
  Outcome r;
  FILE* p = popen((env + " " + SPILLWAY_BINARY + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) r.out.append(buf, n);
  const int st = pclose(p);
  r.killed = (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) ||
             (WIFEXITED(st) && WEXITSTATUS(st) == 128 + SIGKILL);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// 3 steps per epoch, so epoch 1 ends at step-00000003; the default model has 4 units, so a save
// writes 4 x 4 + 1 = 17 tensors.
const std::string kTrain = "train --steps 3 --workers 1 --sample 0 --metrics off --quiet";
constexpr int kTensorsPerSave = 17;

std::string Dir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/crash-" + std::to_string(getpid()) + "-" + name;
  fs::remove_all(d);
  return d;
}

nlohmann::json LatestManifest(const std::string& dir) {
  std::ifstream latest(dir + "/latest");
  std::string name;
  latest >> name;
  return nlohmann::json::parse(std::ifstream(dir + "/" + name + "/manifest.json"), nullptr, false);
}

class KilledSaveTest : public ::testing::TestWithParam<std::pair<const char*, int>> {
 protected:
  static void SetUpTestSuite() {
    reference_dir_ = new std::string(Dir("reference"));
    Outcome r = Spillway("", kTrain + " --epochs 3 --save " + *reference_dir_);
    ASSERT_EQ(r.exit_code, 0) << r.out;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*reference_dir_);
    delete reference_dir_;
  }
  static std::string* reference_dir_;
};
std::string* KilledSaveTest::reference_dir_ = nullptr;

TEST_P(KilledSaveTest, ThePreviousCheckpointLoadsAndResumesExactly) {
  const auto [point, nth] = GetParam();
  const std::string dir = Dir(std::string(point) + std::to_string(nth));
  // The job's own swap directory goes under this TMPDIR: a SIGKILL must leave nothing there.
  const std::string tmp = Dir(std::string("tmp-") + point + std::to_string(nth));
  fs::create_directories(tmp);
  Outcome killed = Spillway(std::string("TMPDIR=") + tmp + " SPILLWAY_TEST_KILL_SAVE_AT=" + point +
                                ":" + std::to_string(nth),
                            kTrain + " --epochs 2 --save-every-epoch --keep 0 --save " + dir);
  ASSERT_TRUE(killed.killed) << "the seam did not fire at " << point << ":" << nth << "\n"
                             << killed.out;
  for (const auto& left : fs::directory_iterator(tmp))
    ADD_FAILURE() << "the killed job left " << left.path() << " behind";
  fs::remove_all(tmp);
  // `latest` still names the first epoch's checkpoint, complete.
  const nlohmann::json before = LatestManifest(dir);
  ASSERT_FALSE(before.is_discarded()) << "latest does not name a readable manifest";
  EXPECT_EQ(before["step"], 3);
  EXPECT_EQ(before["extra"]["epoch"], 1);

  const std::string resumed_dir = Dir(std::string("resumed-") + point + std::to_string(nth));
  Outcome resumed = Spillway("", kTrain + " --epochs 3 --resume " + dir + " --save " + resumed_dir);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out;
  EXPECT_NE(resumed.out.find("done, 2 epochs"), std::string::npos) << resumed.out;
  const nlohmann::json got = LatestManifest(resumed_dir);
  const nlohmann::json want = LatestManifest(*reference_dir_);
  EXPECT_EQ(got["step"], 9);
  ASSERT_EQ(got["ranks"][0]["tensors"].size(), static_cast<size_t>(kTensorsPerSave));
  for (const auto& [name, t] : want["ranks"][0]["tensors"].items()) {
    // The torch CPU generator starts from a random seed in every process, so the reference run's
    // differs; its restore is checked in one process by trainer_checkpoint_test.
    if (name == "rng.torch_cpu") continue;
    EXPECT_EQ(got["ranks"][0]["tensors"][name]["crc32c"], t["crc32c"]) << name;
  }
  fs::remove_all(dir);
  fs::remove_all(resumed_dir);
}

INSTANTIATE_TEST_SUITE_P(
    SecondSave, KilledSaveTest,
    ::testing::Values(std::pair{"header", 2},                    // the file has its header only
                      std::pair{"tensor", kTensorsPerSave + 3},  // between tensors
                      std::pair{"tensor-half", kTensorsPerSave + 9},  // in the middle of a file
                      std::pair{"file", 2},                           // the file is complete
                      std::pair{"manifest", 2}, std::pair{"rename", 2}, std::pair{"latest", 2}),
    [](const auto& test_param) {
      std::string n =
          std::string(test_param.param.first) + "_" + std::to_string(test_param.param.second);
      for (char& c : n) c = c == '-' ? '_' : c;
      return n;
    });

TEST(KilledSaveControl, AResumeFromTheWrongEpochDoesNotMatch) {
  // The CRC comparison can fail: a run resumed from epoch 2's checkpoint trained one epoch fewer.
  const std::string dir = Dir("control"), resumed_dir = Dir("control-resumed"),
                    ref = Dir("control-ref");
  ASSERT_EQ(Spillway("", kTrain + " --epochs 3 --save " + ref).exit_code, 0);
  ASSERT_EQ(Spillway("", kTrain + " --epochs 1 --save " + dir).exit_code, 0);
  ASSERT_EQ(
      Spillway("", kTrain + " --epochs 2 --resume " + dir + " --save " + resumed_dir).exit_code, 0);
  const nlohmann::json got = LatestManifest(resumed_dir), want = LatestManifest(ref);
  EXPECT_NE(got["ranks"][0]["tensors"]["unit.1.master"]["crc32c"],
            want["ranks"][0]["tensors"]["unit.1.master"]["crc32c"]);
  for (const std::string& d : {dir, resumed_dir, ref}) fs::remove_all(d);
}

TEST(ResumeFlags, NothingLeftOrNoCheckpointIsAClearError) {
  const std::string dir = Dir("flags");
  ASSERT_EQ(Spillway("", kTrain + " --epochs 1 --save " + dir).exit_code, 0);
  Outcome r = Spillway("", kTrain + " --epochs 1 --resume " + dir);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("nothing is left to train; raise --epochs"), std::string::npos) << r.out;
  r = Spillway("", kTrain + " --epochs 2 --resume " + dir + "/nothing-here");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("holds no checkpoint"), std::string::npos) << r.out;
  r = Spillway("", kTrain + " --epochs 2 --save-every-epoch");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--save-every-epoch needs --save DIR"), std::string::npos) << r.out;
  r = Spillway("", kTrain + " --epochs 2 --d-model 64 --resume " + dir);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("d_model = 128"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

}  // namespace
