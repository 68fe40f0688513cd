// compare_checkpoint: the reference trainer's checkpoint (Trainer::Save / Trainer::Load: per-rank
// safetensors through the io_uring engine, CRC32C per tensor, fsync, rename) against torch::save /
// torch::load of tensors of the same sizes (followed by an fsync, so both are durable) and against
// fio's sequential write of the same number of bytes on the same file system (ioengine io_uring, 1
// MiB blocks, end_fsync: the device's ceiling for buffered writes). Rounds interleave the savers
// and rotate their order; medians are reported with an A/A pair (Spillway twice per round) whose
// spread bounds what a ratio can resolve. Loads read files just written (the page cache is warm for
// every contender alike), and each contender starts after a sync(). Last line: one JSON object.
//
//   compare_checkpoint [--d-model N] [--layers N] [--rounds N] [--offload cpu|nvme] [--dir DIR]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "spillway/base/bytes.h"
#include "spillway/offload/config.h"
#include "spillway/offload/tiers.h"
#include "spillway/trainer/trainer.h"

namespace {

using namespace spillway;
using bench::Clock;
using bench::Die;
using bench::Median;
using bench::Must;
using bench::Seconds;
namespace fs = std::filesystem;

uint64_t DirBytes(const std::string& dir) {
  uint64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) n += e.file_size();
  }
  return n;
}

void Fsync(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) Die("fsync " + path);
  ::close(fd);
}

// fio's sequential write of `bytes` to a fresh file: seconds from its own bandwidth report.
double FioWrite(const std::string& dir, uint64_t bytes) {
  const std::string file = dir + "/fio.tmp";
  const std::string cmd =
      "fio --name=seqwrite --rw=write --bs=1M --ioengine=io_uring --iodepth=8 "
      "--end_fsync=1 --output-format=json --filename=" +
      file + " --size=" + std::to_string(bytes) + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) Die("cannot run fio");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  if (pclose(p) != 0) Die("fio failed (is it installed? scripts/install-deps)");
  fs::remove(file);
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  if (j.is_discarded()) Die("fio printed no JSON");
  // job_runtime (ms) includes the end_fsync.
  return j["jobs"][0]["job_runtime"].get<double>() / 1000.0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t d_model = 512, layers = 8;
  int rounds = 5;
  std::string offload = "cpu", dir = "nvme_test_swap";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--d-model" && i + 1 < argc)
      d_model = std::atoll(argv[++i]);
    else if (a == "--layers" && i + 1 < argc)
      layers = std::atoll(argv[++i]);
    else if (a == "--rounds" && i + 1 < argc)
      rounds = std::atoi(argv[++i]);
    else if (a == "--offload" && i + 1 < argc)
      offload = argv[++i];
    else if (a == "--dir" && i + 1 < argc)
      dir = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: compare_checkpoint [--d-model N] [--layers N] [--rounds N] "
                   "[--offload cpu|nvme] [--dir DIR]\n");
      return 2;
    }
  }
  fs::create_directories(dir);
  const std::string config_json = StrCat(
      R"({"zero_optimization": {"stage": 3, "offload_param": {"device": ")", offload,
      R"(", "nvme_path": )", nlohmann::json(dir).dump(), R"(}, "offload_optimizer": {"device": ")",
      offload, R"(", "nvme_path": )", nlohmann::json(dir).dump(),
      R"(}}, "aio": {"block_size": 1048576, "queue_depth": 8},
          "spillway": {"host_budget_bytes": "8GiB", "nvme_budget_bytes": "8GiB"}})");
  auto config = Must(offload::Config::Parse(config_json));
  auto tiers = Must(offload::Tiers::Create(config));
  auto coll = Must(trainer::Collectives::Create(trainer::DistEnv{}));
  trainer::TrainerOptions to;
  to.model.vocab = 96;
  to.model.d_model = d_model;
  to.model.n_layer = layers;
  to.model.n_head = 8;
  to.model.seq_len = 64;
  auto trainer =
      Must(trainer::Trainer::Create(to, coll.get(), tiers->store.get(), tiers->host.get(),
                                    &tiers->ledger, allocator::kProcessScope));
  // For torch::save: tensors of the same count and sizes as the checkpoint's (four per unit; at
  // world size 1 a unit's partition is the whole unit).
  std::vector<torch::Tensor> state;
  for (int64_t u = 0; u < trainer::gpt::Units(to.model); ++u) {
    const torch::Tensor full = Must(trainer->GatherUnit(u));
    for (int k = 0; k < 4; ++k) state.push_back(full.clone());
  }
  const std::string ours = dir + "/compare-checkpoint-spillway",
                    theirs = dir + "/compare-checkpoint-torch.pt";
  trainer::CheckpointOptions co;
  co.io = tiers->io.get();
  co.keep = 1;
  std::vector<double> save_a, save_a2, save_torch, fio, load_a, load_torch;
  uint64_t bytes = 0;
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 4; ++k) {
      // Each contender starts with no writeback pending: the previous one's deletes and dirty
      // pages are flushed first, outside the timed part.
      fs::remove_all(ours);
      fs::remove(theirs);
      ::sync();
      switch ((r + k) % 4) {  // rotate the order every round
        case 0:
        case 2: {
          auto t0 = Clock::now();
          Must(trainer->Save(ours, co));
          ((r + k) % 4 == 0 ? save_a : save_a2).push_back(Seconds(t0));
          bytes = DirBytes(ours);
          t0 = Clock::now();
          Must(trainer->Load(ours, co));
          if ((r + k) % 4 == 0) load_a.push_back(Seconds(t0));
          break;
        }
        case 1: {
          auto t0 = Clock::now();
          torch::save(state, theirs);
          Fsync(theirs);
          save_torch.push_back(Seconds(t0));
          t0 = Clock::now();
          std::vector<torch::Tensor> back;
          torch::load(back, theirs);
          load_torch.push_back(Seconds(t0));
          break;
        }
        case 3:
          fio.push_back(FioWrite(dir, bytes > 0 ? bytes : 64ull << 20));
          break;
      }
    }
  }
  fs::remove_all(ours);
  fs::remove(theirs);
  const double mib = static_cast<double>(bytes) / static_cast<double>(kMiB);
  const double a = Median(save_a), a2 = Median(save_a2), t = Median(save_torch), f = Median(fio);
  const double la = Median(load_a), lt = Median(load_torch);
  std::vector<double> aa;
  for (size_t i = 0; i < std::min(save_a.size(), save_a2.size()); ++i)
    aa.push_back(save_a2[i] / save_a[i]);
  std::sort(aa.begin(), aa.end());
  std::printf(
      "checkpoint of %.1f MiB (d_model %lld, %lld layers, offload %s), %d rounds interleaved, "
      "medians\n",
      mib, static_cast<long long>(d_model), static_cast<long long>(layers), offload.c_str(),
      rounds);
  std::printf(
      "  save   spillway %7.1f MiB/s   torch::save+fsync %7.1f MiB/s   fio seq write %7.1f MiB/s\n",
      mib / a, mib / t, mib / f);
  std::printf(
      "         spillway/torch x%.2f   spillway/fio x%.2f   A/A (spillway twice) x%.2f, spread "
      "%.2f..%.2f\n",
      t / a, f / a, a2 / a, aa.front(), aa.back());
  std::printf(
      "  load   spillway %7.1f MiB/s (with the CRC32C pass)   torch::load %7.1f MiB/s   "
      "spillway/torch x%.2f\n",
      mib / la, mib / lt, lt / la);
  nlohmann::json j = {{"bench", "compare_checkpoint"},
                      {"mib", mib},
                      {"offload", offload},
                      {"save_spillway_mibps", mib / a},
                      {"save_torch_mibps", mib / t},
                      {"save_fio_mibps", mib / f},
                      {"aa_ratio", a2 / a},
                      {"aa_min", aa.front()},
                      {"aa_max", aa.back()},
                      {"load_spillway_mibps", mib / la},
                      {"load_torch_mibps", mib / lt},
                      {"save_spillway_s", save_a},
                      {"save_torch_s", save_torch},
                      {"save_fio_s", fio}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}
