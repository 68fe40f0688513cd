// compare_pipeline: the reference trainer's step with its parameters on NVMe, reaching the compute
// device through the TransferPipeline (the next unit's transfer overlapping this unit's compute),
// against the same step with the parameters in host memory, and against plain libtorch training
// with everything resident on the compute device. Contenders, the same model and batches, each on
// tiers of its own:
//   resident    plain libtorch: the units' weights and torch's AdamW on the compute device,
//               autograd through the whole model (no offload at all: the no-offload step)
//   host        offload_param cpu (the baseline), twice: host and host' are the A/A pair
//   pipe-cached offload_param nvme + pipeline, a budget that keeps the parameters' host copies
//               (each view is a host -> device copy)
//   pipe-nvme   offload_param nvme + pipeline, a budget too small for them (views come from NVMe)
//   no-pipe     offload_param nvme without a pipeline (gathered in host memory; the store
//   prefetches)
// Rounds run one step of each, in a rotating order; medians over rounds, and the ratios
// host / contender (1.0: the offload costs nothing; >= 0.9: the transfer is hidden) and
// contender / resident (the offload step against the no-offload step). Also the time of one
// unit's transfer alone (its device view, from NVMe) and one unit's compute (the host step time
// over units and micro-batches). Last line: one JSON object.
//
//   compare_pipeline [--device cpu|cuda|cuda:N] [--d-model N] [--layers N] [--rounds N] [--dir DIR]
// On cuda every step ends with a device synchronize, in every contender.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "spillway/base/bytes.h"
#include "spillway/offload/config.h"
#include "spillway/offload/tiers.h"
#include "spillway/trainer/compute_device.h"
#include "spillway/trainer/model.h"
#include "spillway/trainer/trainer.h"

namespace {

using namespace spillway;
using bench::Clock;
using bench::Die;
using bench::Median;
using bench::Must;
using bench::Seconds;

// Plain libtorch training on `device`: the trainer's model functions, autograd through all units,
// torch's AdamW with the trainer's hyperparameters; gradients averaged over the micro-batches as
// the trainer does.
struct Resident {
  trainer::GptConfig model;
  torch::Device device;
  std::vector<torch::Tensor> flats;
  std::unique_ptr<torch::optim::AdamW> opt;

  Resident(const trainer::GptConfig& m, torch::Device d) : model(m), device(d) {
    for (int64_t u = 0; u < trainer::gpt::Units(m); ++u)
      flats.push_back(trainer::gpt::InitUnit(m, u).to(d).requires_grad_(true));
    const engine::AdamWConfig a;
    opt = std::make_unique<torch::optim::AdamW>(flats, torch::optim::AdamWOptions(a.lr)
                                                           .betas({a.beta1, a.beta2})
                                                           .eps(a.eps)
                                                           .weight_decay(a.weight_decay));
  }
  void Step(const std::vector<torch::Tensor>& mbs) {
    opt->zero_grad();
    for (const torch::Tensor& batch : mbs) {
      const torch::Tensor t = batch.to(device);
      const int64_t n = t.size(1) - 1;
      torch::Tensor x = t.narrow(1, 0, n);
      for (int64_t u = 0; u < trainer::gpt::Units(model); ++u)
        x = trainer::gpt::Forward(model, u, flats[u], x);
      (trainer::gpt::Loss(x, t.narrow(1, 1, n)) / static_cast<double>(mbs.size())).backward();
    }
    opt->step();
  }
};

struct Contender {
  std::string name;
  std::unique_ptr<offload::Tiers> tiers;
  std::unique_ptr<trainer::Collectives> coll;
  std::unique_ptr<trainer::Trainer> trainer;
  std::unique_ptr<Resident> resident;
  std::vector<double> seconds;

  void Step(const std::vector<torch::Tensor>& mbs) {
    if (resident != nullptr) {
      resident->Step(mbs);
    } else {
      Must(trainer->Step(mbs));
    }
  }
};

Contender Make(const std::string& name, const trainer::GptConfig& model, const std::string& dir,
               const std::string& param, const std::string& budget, bool pipeline,
               torch::Device device) {
  Contender c;
  c.name = name;
  const std::string swap = dir + "/" + name;
  std::filesystem::create_directories(swap);
  const offload::Config config = Must(offload::Config::Parse(
      R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
          "offload_param": {"device": ")" +
      param + R"(", "nvme_path": ")" + swap + R"("}},
          "aio": {"block_size": 1048576, "queue_depth": 8},
          "spillway": {"host_budget_bytes": ")" +
      budget + R"(", "nvme_budget_bytes": "4GiB"}})"));
  c.tiers = Must(offload::Tiers::Create(config));
  trainer::TrainerOptions o;
  o.model = model;
  o.optimizer_threads = 1;
  o.compute = device;
  if (pipeline) {
    o.pipeline = Must(c.tiers->OpenDevicePipeline(config, trainer::ToDeviceId(device)));
    if (o.pipeline == nullptr) Die("no pipeline opens to " + device.str() + " in this build");
  }
  c.coll = Must(trainer::Collectives::Create(trainer::DistEnv{}));
  c.trainer =
      Must(trainer::Trainer::Create(o, c.coll.get(), c.tiers->store.get(), c.tiers->host.get(),
                                    &c.tiers->ledger, allocator::kProcessScope));
  if (!c.tiers->ledger.BeginEpoch(0).ok()) Die("BeginEpoch");
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  trainer::GptConfig model;
  model.vocab = 96;
  model.d_model = 384;
  model.n_layer = 4;
  model.n_head = 6;
  model.seq_len = 128;
  int rounds = 7;
  std::string dir = "/var/tmp/spillway-compare-pipeline";
  std::string device_name = "cpu";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--device")
      device_name = argv[i + 1];
    else if (a == "--d-model")
      model.d_model = std::stoll(argv[i + 1]);
    else if (a == "--layers")
      model.n_layer = std::stoll(argv[i + 1]);
    else if (a == "--rounds")
      rounds = std::stoi(argv[i + 1]);
    else if (a == "--dir")
      dir = argv[i + 1];
    else
      Die("unknown flag " + a + " (--device D --d-model N --layers N --rounds N --dir DIR)");
  }
  const torch::Device device = Must(trainer::ResolveComputeDevice(device_name));
  const bool cuda = device.is_cuda();
  torch::set_num_threads(
      1);  // one compute thread: the transfer's helper thread has a core of its own
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  uint64_t params = 0, largest = 0;
  for (int64_t u = 0; u < trainer::gpt::Units(model); ++u) {
    params += static_cast<uint64_t>(trainer::gpt::UnitNumel(model, u));
    largest = std::max<uint64_t>(largest, static_cast<uint64_t>(trainer::gpt::UnitNumel(model, u)));
  }
  // Five fp32 states of 4 B per parameter: a budget of four of them (plus 16 MiB for the bounce
  // pool, the staging ring and a gather) holds the rest but not the parameters' host copies.
  const std::string small = std::to_string(params * 4 * 4 + (16u << 20));
  std::vector<Contender> cs;
  cs.push_back(Make("host", model, dir, "cpu", "4GiB", false, device));
  cs.push_back(Make("pipe-cached", model, dir, "nvme", "4GiB", true, device));
  cs.push_back(Make("pipe-nvme", model, dir, "nvme", small, true, device));
  cs.push_back(Make("no-pipe", model, dir, "nvme", "4GiB", false, device));
  cs.push_back(Make("host'", model, dir, "cpu", "4GiB", false, device));
  cs.push_back(Contender{});
  cs.back().name = "resident";
  cs.back().resident = std::make_unique<Resident>(model, device);
  constexpr int kMicro = 2;
  const auto batch = [&](int step, int k) {
    torch::manual_seed(1000 * step + k);
    return torch::randint(0, model.vocab, {8, model.seq_len + 1}, torch::kInt64);
  };
  for (int r = -1; r < rounds; ++r) {  // round -1 warms up
    for (size_t j = 0; j < cs.size(); ++j) {
      Contender& c = cs[(j + static_cast<size_t>(std::max(r, 0))) % cs.size()];
      std::vector<torch::Tensor> mbs;
      for (int k = 0; k < kMicro; ++k) mbs.push_back(batch(r + 1, k));
      const auto t0 = Clock::now();
      c.Step(mbs);
      if (cuda) torch::cuda::synchronize();
      if (r >= 0) c.seconds.push_back(Seconds(t0));
    }
  }
  // One unit's transfer alone: the largest unit's parameters, out of host memory, into a device
  // view.
  Contender& nv = cs[2];
  std::vector<double> transfer;
  for (int i = 0; i < 5; ++i) {
    // The largest unit is a block (unit 1). The trainer registers five partitions per unit in
    // order, parameter first (Trainer::Init), so unit 1's parameter partition is id 5.
    const offload::PartitionId id = 5;
    if (nv.tiers->store->bytes(id) != largest * 4) Die("partition 5 is not unit 1's parameters");
    if (!nv.tiers->store->Evict(id).ok()) Die("evict");
    const auto t0 = Clock::now();
    auto h =
        Must(nv.tiers->store->Acquire(id, offload::Access::kRead, offload::Placement::kDevice));
    transfer.push_back(Seconds(t0));
    if (!nv.tiers->store->Release(h).ok()) Die("release");
  }
  const double host = Median(cs[0].seconds);
  const double resident = Median(cs.back().seconds);
  const double per_unit_compute =
      host / static_cast<double>(trainer::gpt::Units(model) * kMicro * 2);
  std::printf(
      "compare_pipeline on %s: %llu parameters, %lld units, %d micro-batches of 8 x %lld tokens, "
      "%d rounds\n",
      device.str().c_str(), static_cast<unsigned long long>(params),
      static_cast<long long>(trainer::gpt::Units(model)), kMicro,
      static_cast<long long>(model.seq_len), rounds);
  std::printf("%-12s %12s %16s %18s %22s\n", "contender", "median s", "spread", "host / contender",
              "contender / resident");
  nlohmann::json j;
  j["device"] = device.str();
  for (const Contender& c : cs) {
    std::vector<double> s = c.seconds;
    std::sort(s.begin(), s.end());
    const double med = Median(s);
    std::printf("%-12s %12.4f %7.4f-%7.4f %18.3f %22.3f\n", c.name.c_str(), med, s.front(),
                s.back(), host / med, med / resident);
    j[c.name] = {{"median_s", med},
                 {"min_s", s.front()},
                 {"max_s", s.back()},
                 {"ratio", host / med},
                 {"vs_resident", med / resident}};
  }
  std::printf(
      "one unit (%.2f MiB of parameters): transfer alone %.4f s (NVMe -> staging -> device), "
      "compute %.4f s (forward or backward's recompute + backward, its share of the host step)\n",
      static_cast<double>(largest) * 4 / static_cast<double>(kMiB), Median(transfer),
      per_unit_compute);
  for (size_t k : {size_t{1}, size_t{2}}) {
    const auto ps = cs[k].tiers->pipeline->Stats();
    std::printf("%s: %.1f MiB into device views from NVMe, %.1f MiB from host copies\n",
                cs[k].name.c_str(), ps.nvme_to_device_bytes / static_cast<double>(kMiB),
                ps.host_to_device_bytes / static_cast<double>(kMiB));
    j[cs[k].name]["nvme_to_device_mib"] = ps.nvme_to_device_bytes / static_cast<double>(kMiB);
    j[cs[k].name]["host_to_device_mib"] = ps.host_to_device_bytes / static_cast<double>(kMiB);
  }
  j["unit_transfer_s"] = Median(transfer);
  j["unit_compute_s"] = per_unit_compute;
  std::filesystem::remove_all(dir);
  std::printf("%s\n", j.dump().c_str());
  return 0;
}
