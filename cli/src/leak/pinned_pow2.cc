// pinned-pow2: buffer sizes that change across epochs (buckets, sequence lengths) under PyTorch's
// CachingHostAllocator, which rounds up to a power of two and never gives memory back. Detector:
// host bytes held from the OS at every step and boundary, boundary rule. Note [Leak suite].
#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "leak/rig.h"
#include "leak/scenario.h"
#include "spillway/allocator/pow2_caching_policy.h"
#include "spillway/base/bytes.h"

namespace spillway::cli::leak {
namespace {

using allocator::Kind;
using allocator::Lifetime;
using allocator::OwnerTag;

constexpr int kEpochs = 6, kSteps = 4, kParts = 12;

// Partition i's size in epoch e: sizes grow 15% an epoch.
uint64_t SizeOf(int e, int i) {
  return static_cast<uint64_t>((1.0 + 0.5 * i) * (1.0 + 0.15 * e) * kMiB) / 4096 * 4096 + 4096;
}

// Where one arm's buffers come from, and what it holds from the OS (the detector).
struct Pool {
  std::function<Result<void*>(uint64_t bytes, Lifetime lifetime)> alloc;
  std::function<Status(void* p)> free;
  std::function<double()> held;
  std::function<void()> at_boundary;  // after each epoch's buffers are freed
};

// Each epoch: kParts epoch-lifetime buffers, then kSteps steps that each gather a few of them
// into step-lifetime buffers twice their size; everything the epoch allocated dies at its end.
Status Churn(const Pool& pool, LeakSeries* series) {
  int64_t step = 0;
  series->Add(0, 0, true, pool.held());
  for (int e = 1; e <= kEpochs; ++e) {
    std::vector<void*> parts;
    for (int i = 0; i < kParts; ++i) {
      SPILLWAY_ASSIGN_OR_RETURN(void* p, pool.alloc(SizeOf(e, i), Lifetime::kEpoch));
      std::memset(p, 1, 4096);
      parts.push_back(p);
    }
    for (int s = 0; s < kSteps; ++s) {
      std::vector<void*> gathers;
      for (int i = s; i < kParts; i += kSteps) {
        SPILLWAY_ASSIGN_OR_RETURN(void* p, pool.alloc(2 * SizeOf(e, i), Lifetime::kStep));
        gathers.push_back(p);
      }
      for (void* p : gathers) SPILLWAY_RETURN_IF_ERROR(pool.free(p));
      series->Add(++step, e, false, pool.held());
    }
    for (void* p : parts) SPILLWAY_RETURN_IF_ERROR(pool.free(p));
    pool.at_boundary();
    series->Add(step, e, true, pool.held());
  }
  return Status::Ok();
}

class PinnedPow2 final : public Trial {
 public:
  explicit PinnedPow2(std::unique_ptr<offload::Tiers> rig) : rig_(std::move(rig)) {}

  // The host arena: the epoch boundary gives back what the epoch no longer uses (Trim).
  Status Spillway(ScenarioOutcome* out) override {
    allocator::HostArena& host = *rig_->host;
    const offload::Tiers& rig = *rig_;
    return Churn(
        {.alloc = [&host](uint64_t bytes, Lifetime lifetime) -> Result<void*> {
           return host.Allocate(bytes, OwnerTag{Kind::kSwapBuffer, lifetime, 0, 0, SPILLWAY_SITE});
         },
         .free = [&host](void* p) { return host.Free(p); },
         .held = [&rig] { return HostCommitted(rig); },
         .at_boundary = [&host] { host.Trim(); }},
        &out->spillway);
  }

  // PyTorch's CachingHostAllocator policy: its held bytes never come down.
  Status Control(ScenarioOutcome* out) override {
    return Churn({.alloc = [this](uint64_t bytes, Lifetime) { return cache_.Alloc(bytes); },
                  .free = [this](void* p) { return cache_.Free(p); },
                  .held = [this] { return static_cast<double>(cache_.held_bytes()); },
                  .at_boundary = [] {}},
                 &out->control);
  }

  void Verdict(ScenarioOutcome* out) override {
    out->epochs = kEpochs;
    out->tolerance = 4096;  // one page
    ScoreBy(out, &LeakSeries::BoundaryGrowthPerEpoch);
    double peak_s = 0, peak_c = 0;
    for (const auto& p : out->spillway.points) peak_s = std::max(peak_s, p.bytes);
    for (const auto& p : out->control.points) peak_c = std::max(peak_c, p.bytes);
    out->notes.push_back(Fmt("peak held: spillway %.1f MiB, pow2 cache %.1f MiB (x%.2f)",
                             peak_s / kMiB, peak_c / kMiB, peak_c / peak_s));
  }

 private:
  std::unique_ptr<offload::Tiers> rig_;
  allocator::baseline::Pow2CachingPolicy cache_;
};

}  // namespace

Result<std::unique_ptr<Trial>> StartPinnedPow2(const LeakSuiteOptions& suite) {
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig,
                            MakeRig(suite, {.offload = offload::OffloadDevice::kNone}));
  return std::unique_ptr<Trial>(std::make_unique<PinnedPow2>(std::move(rig)));
}

}  // namespace spillway::cli::leak
