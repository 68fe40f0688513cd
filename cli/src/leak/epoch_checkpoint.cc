// epoch-checkpoint: a checkpoint saved at every epoch end, where the naive save first gathers the
// whole fp32 state into one host buffer (DeepSpeed's stage3_gather_16bit_weights_on_model_save).
// Detector: host bytes held from the OS, sampled during the save, peak rule. Note [Leak suite].
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "leak/rig.h"
#include "leak/scenario.h"
#include "spillway/base/bytes.h"
#include "spillway/engine/checkpoint_file.h"

namespace spillway::cli::leak {
namespace {

using allocator::Kind;
using allocator::Lifetime;
using allocator::OwnerTag;
using engine::checkpoint::FileWriter;
using engine::checkpoint::TensorSpec;

constexpr int kEpochs = 4, kSteps = 3, kParts = 16;
constexpr uint64_t kElems = 1 << 20;  // 4 MiB of fp32 per partition: 64 MiB of master weights
constexpr uint64_t kStateBytes = kParts * kElems * 4;
constexpr uint64_t kHeadroom = 4 * kMiB;  // Spillway's budget over the state

// Both arms' rigs: host only, small regions, one small bounce buffer, under `budget_bytes`.
RigOptions SaveRig(uint64_t budget_bytes) {
  RigOptions o;
  o.host_budget_bytes = budget_bytes;
  o.offload = offload::OffloadDevice::kNone;
  o.region_bytes = 2 * kMiB;
  o.bounce_buffers = 1;
  o.block_size = 256 << 10;
  return o;
}

// How one arm saves the master partitions through `writer`; it calls `sample` as it goes.
using Save = std::function<Status(FileWriter* writer, const std::vector<float*>& master,
                                  const std::function<void()>& sample)>;

// kParts master partitions in the host arena, kSteps steps an epoch that write them, and at every
// epoch end a safetensors file of `specs` (the trainer's checkpoint writer, through the io_uring
// engine) written by `save` to <scratch>/checkpoint-<who>.safetensors.
Status Train(const LeakSuiteOptions& suite, offload::Tiers& rig, const char* who,
             const std::vector<TensorSpec>& specs, const Save& save, LeakSeries* series) {
  std::vector<float*> master;
  for (int i = 0; i < kParts; ++i) {
    SPILLWAY_ASSIGN_OR_RETURN(
        void* p,
        rig.host->Allocate(kElems * 4, OwnerTag{Kind::kMasterWeight, Lifetime::kPersistent,
                                                static_cast<uint64_t>(i), 0, SPILLWAY_SITE}));
    master.push_back(static_cast<float*>(p));
    std::fill(master.back(), master.back() + kElems, 0.25f * i);
  }
  const std::string path = StrCat(ScratchDir(suite), "/checkpoint-", who, ".safetensors");
  int64_t step = 0;
  int e = 0;
  auto sample = [&] { series->Add(step, e, false, HostCommitted(rig)); };
  series->Add(0, 0, true, HostCommitted(rig));
  for (e = 1; e <= kEpochs; ++e) {
    for (int s = 0; s < kSteps; ++s) {
      for (float* m : master) m[s] += 1.0f;
      series->Add(++step, e, false, HostCommitted(rig));
    }
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<FileWriter> writer,
                              FileWriter::Create(path, specs, rig.io.get()));
    SPILLWAY_RETURN_IF_ERROR(save(writer.get(), master, sample));
    SPILLWAY_RETURN_IF_ERROR(writer->Finish().status());
    series->Add(step, e, true, HostCommitted(rig));
  }
  for (float* m : master) SPILLWAY_RETURN_IF_ERROR(rig.host->Free(m));
  std::remove(path.c_str());
  return Status::Ok();
}

// Each arm builds its own rig.
class EpochCheckpoint final : public Trial {
 public:
  explicit EpochCheckpoint(const LeakSuiteOptions& suite) : suite_(suite) {}

  // Under a budget of the state plus 4 MiB: each partition streams from where it lives in the
  // arena, one tensor each.
  Status Spillway(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig,
                              MakeRig(suite_, SaveRig(kStateBytes + kHeadroom)));
    std::vector<TensorSpec> specs;
    for (int i = 0; i < kParts; ++i)
      specs.push_back({StrCat("master.", i), "F32", {static_cast<int64_t>(kElems)}, kElems * 4});
    auto save = [](FileWriter* writer, const std::vector<float*>& master,
                   const std::function<void()>& sample) -> Status {
      for (float* m : master) {
        SPILLWAY_RETURN_IF_ERROR(writer->Write(m));
        sample();
      }
      return Status::Ok();
    };
    return Train(suite_, *rig, "spillway", specs, save, &out->spillway);
  }

  // Gathers the whole state into one host buffer, then writes that as one tensor. The arena is
  // unbounded so that its peak is visible instead of an out-of-memory error.
  Status Control(ScenarioOutcome* out) override {
    SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig,
                              MakeRig(suite_, SaveRig(1ull << 30)));
    allocator::HostArena& host = *rig->host;
    auto save = [&host](FileWriter* writer, const std::vector<float*>& master,
                        const std::function<void()>& sample) -> Status {
      auto gathered = host.Allocate(
          kStateBytes, OwnerTag{Kind::kCheckpoint, Lifetime::kEpoch, 0, 0, SPILLWAY_SITE});
      if (!gathered.ok()) return gathered.status().WithContext("the gathered model");
      for (int i = 0; i < kParts; ++i) {
        std::memcpy(static_cast<float*>(*gathered) + i * kElems, master[i], kElems * 4);
        sample();
      }
      const Status st = writer->Write(*gathered);
      SPILLWAY_RETURN_IF_ERROR(host.Free(*gathered));
      return st;
    };
    return Train(suite_, *rig, "control",
                 {{"master", "F32", {static_cast<int64_t>(kParts * kElems)}, kStateBytes}}, save,
                 &out->control);
  }

  void Verdict(ScenarioOutcome* out) override {
    out->epochs = kEpochs;
    out->tolerance = static_cast<double>(kHeadroom);  // the budget's headroom
    ScoreBy(out, &LeakSeries::PeakGrowthPerEpoch);
    out->notes.push_back(
        Fmt("peak during a save over the state: spillway %.1f MiB (budget headroom 4 MiB), "
            "control %.1f MiB",
            out->spillway_growth / kMiB, out->control_growth / kMiB));
  }

 private:
  const LeakSuiteOptions suite_;
};

}  // namespace

Result<std::unique_ptr<Trial>> StartEpochCheckpoint(const LeakSuiteOptions& suite) {
  return std::unique_ptr<Trial>(std::make_unique<EpochCheckpoint>(suite));
}

}  // namespace spillway::cli::leak
