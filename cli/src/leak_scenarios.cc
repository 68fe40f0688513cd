// Leak-suite scenarios that need no libtorch: fork-cow, pinned-pow2, bounce-leak, swapped-alive,
// epoch-checkpoint. Each runs Spillway's way and then the naive control under the same detector.
// Note [Leak suite] in docs/leak-suite.md says where each comes from.
#include "leak_scenarios.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <vector>

#include "spillway/allocator/pow2_caching_policy.h"
#include "spillway/base/bytes.h"
#include "spillway/cli/fork_loader.h"
#include "spillway/cli/proc_memory.h"
#include "spillway/engine/checkpoint_file.h"
#include "spillway/engine/host_optimizer.h"
#include "spillway/offload/config.h"
#include "spillway/offload/partition_store.h"

namespace spillway::cli::leak {

using allocator::Kind;
using allocator::Lifetime;
using allocator::OwnerTag;

std::string ScratchDir(const LeakSuiteOptions& suite) {
  return suite.scratch_dir.empty() ? suite.out_dir : suite.scratch_dir;
}

Result<std::unique_ptr<Rig>> MakeRig(const LeakSuiteOptions& suite, const RigOptions& o) {
  auto rig = std::make_unique<Rig>();
  allocator::HostArenaOptions ho;
  ho.budget_bytes = o.host_budget_bytes;
  ho.region_bytes = o.region_bytes;
  // Pinned as `spillway train` pins (its default config has pin_memory: true): CUDA-registered
  // where a device is present, mlock otherwise. A machine whose mlock limit is too small fails
  // here as the main job would, naming RLIMIT_MEMLOCK.
  ho.pin = allocator::PinMode::kAuto;
  ho.fork_safety = o.fork_safety;
  ho.capture_backtraces = o.capture_backtraces;
  ho.ledger = &rig->ledger;
  auto host = allocator::HostArena::Create(ho);
  if (!host.ok()) return host.status();
  rig->host = std::move(*host);
  allocator::IoEngineOptions eo;
  eo.arena = rig->host.get();
  eo.bounce_buffers = o.bounce_buffers;
  eo.block_size = o.block_size;
  auto io = allocator::IoEngine::Create(eo);
  if (!io.ok()) return io.status();
  rig->io = std::move(*io);
  if (o.with_nvme) {
    allocator::NvmeArenaOptions no;
    no.directory = ScratchDir(suite);
    no.budget_bytes = 1ull << 30;
    no.ledger = &rig->ledger;
    auto n = allocator::NvmeArena::Create(no, rig->io.get());
    if (!n.ok()) return n.status();
    rig->nvme = std::move(*n);
  }
  return rig;
}

uint64_t Escapes(const allocator::BoundaryReport& r, std::string* first_site) {
  if (first_site != nullptr && first_site->empty()) {
    for (const auto& t : r.tiers) {
      for (const auto& e : t.escapes) {
        if (!e.site.empty()) {
          *first_site = e.site;
          break;
        }
      }
    }
  }
  return r.escape_count();
}

namespace {

double HostCommitted(const Rig& r) { return static_cast<double>(r.host->Stats().committed_bytes); }

Result<double> TreePss() {
  auto m = ProcessTreeMemory(getpid());
  if (!m.ok()) return m.status();
  return static_cast<double>(m->pss_anon_bytes);
}

std::string Fmt(const char* fmt, double a, double b = 0, double c = 0, double d = 0) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), fmt, a, b, c, d);
  return buf;
}

// A small text for the data loader, written to the scratch directory.
Result<CharCorpus> ScratchCorpus(const LeakSuiteOptions& suite) {
  const std::string path = ScratchDir(suite) + "/corpus.txt";
  {
    std::ofstream f(path);
    for (int i = 0; i < 400; ++i)
      f << "the first optimizer step after a fork copies every page it writes. ";
  }
  return CharCorpus::Load(path, 64);
}

}  // namespace

// 1. fork-cow. Detector: summed anonymous PSS of the process tree after every step; growth is each
// epoch's peak over the PSS before its workers were forked.
Result<ScenarioOutcome> ForkCow(const LeakSuiteOptions& suite) {
  constexpr uint64_t kElems = 4ull << 20;  // 16 MiB per array: master, exp_avg, exp_avg_sq, grad
  constexpr int kEpochs = 4, kSteps = 5;
  ScenarioOutcome out;
  out.detector = "process-tree anonymous PSS";
  out.epochs = kEpochs;
  // Pages the parent's runtime dirties while workers share them (thread stacks, heap, the loader's
  // buffers): measured at 0.2-0.5 MiB here, an eighth of one 16 MiB state array.
  out.tolerance = 2.0 * kMiB;
  auto corpus = ScratchCorpus(suite);
  if (!corpus.ok()) return corpus.status();
  engine::HostOptimizerOptions oo;
  oo.threads = 2;
  auto opt = engine::HostOptimizer::Create(oo);
  if (!opt.ok()) return opt.status();
  auto rig = MakeRig(suite, {});
  if (!rig.ok()) return rig.status();
  Rig& r = **rig;

  auto run = [&](bool spillway, LeakSeries* series) -> Status {
    const uint64_t bytes = kElems * 4;
    float* arrays[4] = {};
    const Kind kinds[4] = {Kind::kMasterWeight, Kind::kOptimizerState, Kind::kOptimizerState,
                           Kind::kGrad};
    for (int i = 0; i < 4; ++i) {
      if (spillway) {
        auto p = r.host->Allocate(bytes, OwnerTag{kinds[i], Lifetime::kPersistent,
                                                  static_cast<uint64_t>(i), 0, SPILLWAY_SITE});
        if (!p.ok()) return p.status();
        arrays[i] = static_cast<float*>(*p);
      } else {
        arrays[i] = static_cast<float*>(std::aligned_alloc(64, bytes));  // ordinary pageable memory
        if (arrays[i] == nullptr) return Status::Make(StatusCode::kOutOfMemory, "aligned_alloc");
      }
      std::fill(arrays[i], arrays[i] + kElems, i == 3 ? 1e-3f : 0.5f);
    }
    engine::SubGroup g;
    g.name = "fork-cow";
    g.numel = kElems;
    g.master = arrays[0];
    g.exp_avg = arrays[1];
    g.exp_avg_sq = arrays[2];
    g.grad = arrays[3];
    g.param = nullptr;
    LoaderOptions lo;
    lo.workers = 2;
    lo.batch_size = 4;
    lo.seq_len = 32;
    auto loader = ForkingLoader::Create(&*corpus, lo);
    if (!loader.ok()) return loader.status();
    std::vector<int64_t> rows(lo.batch_size * (*loader)->row_elems());
    int64_t step = 0;
    double first = 0, rest = 0;
    Status st;
    auto pss = TreePss();
    if (!pss.ok()) return pss.status();
    series->Add(step, 0, true, *pss);
    for (int e = 1; e <= kEpochs && st.ok(); ++e) {
      st = (*loader)->BeginEpoch(e, kSteps);
      for (int s = 0; s < kSteps && st.ok(); ++s) {
        st = (*loader)->Next(rows.data());
        if (!st.ok()) break;
        const auto t0 = std::chrono::steady_clock::now();
        auto rep = (*opt)->Step({&g, 1});
        const double sec =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!rep.ok()) st = rep.status();
        (s == 0 ? first : rest) += sec;
        pss = TreePss();
        if (!pss.ok())
          st = pss.status();
        else
          series->Add(++step, e, false, *pss);
      }
      if (st.ok()) st = (*loader)->EndEpoch();
      pss = TreePss();
      if (st.ok() && pss.ok()) series->Add(step, e, true, *pss);
    }
    out.notes.push_back(
        Fmt(spillway ? "spillway: first step after the fork %.1f ms, other steps %.1f ms (x%.2f)"
                     : "control:  first step after the fork %.1f ms, other steps %.1f ms (x%.2f)",
            1e3 * first / kEpochs, 1e3 * rest / (kEpochs * (kSteps - 1)),
            first / kEpochs / (rest / (kEpochs * (kSteps - 1)))));
    for (float* a : arrays) {
      if (a == nullptr) continue;
      if (spillway)
        (void)r.host->Free(a);
      else
        std::free(a);
    }
    return st;
  };
  SPILLWAY_RETURN_IF_ERROR(run(true, &out.spillway));
  SPILLWAY_RETURN_IF_ERROR(run(false, &out.control));
  ScoreBy(&out, &LeakSeries::PeakGrowthPerEpoch);
  return out;
}

// 2. pinned-pow2. Detector: host bytes held from the OS (arena committed; the cache's held bytes),
// at every step and boundary; growth is boundary over boundary. Sizes grow 15% an epoch (buckets
// and sequence lengths that change), and each epoch's buffers die at its end.

Result<ScenarioOutcome> PinnedPow2(const LeakSuiteOptions& suite) {
  constexpr int kEpochs = 6, kSteps = 4, kParts = 12;
  ScenarioOutcome out;
  out.detector = "host bytes held from the OS";
  out.epochs = kEpochs;
  out.tolerance = 4096;  // one page
  auto rig = MakeRig(suite, {.with_nvme = false});
  if (!rig.ok()) return rig.status();
  Rig& r = **rig;
  allocator::baseline::Pow2CachingPolicy cache;  // PyTorch's CachingHostAllocator policy
  auto size_of = [](int e, int i) {
    return static_cast<uint64_t>((1.0 + 0.5 * i) * (1.0 + 0.15 * e) * kMiB) / 4096 * 4096 + 4096;
  };
  auto run = [&](bool spillway, LeakSeries* series) -> Status {
    auto alloc = [&](uint64_t bytes, Lifetime life) -> Result<void*> {
      if (!spillway) return cache.Alloc(bytes);
      return r.host->Allocate(bytes, OwnerTag{Kind::kSwapBuffer, life, 0, 0, SPILLWAY_SITE});
    };
    auto release = [&](void* p) -> Status { return spillway ? r.host->Free(p) : cache.Free(p); };
    auto held = [&] {
      return spillway ? HostCommitted(r) : static_cast<double>(cache.held_bytes());
    };
    int64_t step = 0;
    series->Add(0, 0, true, held());
    for (int e = 1; e <= kEpochs; ++e) {
      std::vector<void*> parts;
      for (int i = 0; i < kParts; ++i) {
        auto p = alloc(size_of(e, i), Lifetime::kEpoch);
        if (!p.ok()) return p.status();
        std::memset(*p, 1, 4096);
        parts.push_back(*p);
      }
      for (int s = 0; s < kSteps; ++s) {
        std::vector<void*> gathers;
        for (int i = s; i < kParts; i += kSteps) {
          auto p = alloc(2 * size_of(e, i), Lifetime::kStep);
          if (!p.ok()) return p.status();
          gathers.push_back(*p);
        }
        for (void* p : gathers) SPILLWAY_RETURN_IF_ERROR(release(p));
        series->Add(++step, e, false, held());
      }
      for (void* p : parts) SPILLWAY_RETURN_IF_ERROR(release(p));
      if (spillway) r.host->Trim();  // the epoch boundary gives back what the epoch no longer uses
      series->Add(step, e, true, held());
    }
    return Status::Ok();
  };
  SPILLWAY_RETURN_IF_ERROR(run(true, &out.spillway));
  SPILLWAY_RETURN_IF_ERROR(run(false, &out.control));
  ScoreBy(&out, &LeakSeries::BoundaryGrowthPerEpoch);
  double peak_s = 0, peak_c = 0;
  for (const auto& p : out.spillway.points) peak_s = std::max(peak_s, p.bytes);
  for (const auto& p : out.control.points) peak_c = std::max(peak_c, p.bytes);
  out.notes.push_back(Fmt("peak held: spillway %.1f MiB, pow2 cache %.1f MiB (x%.2f)",
                          peak_s / kMiB, peak_c / kMiB, peak_c / peak_s));
  return out;
}

// 3. bounce-leak. Detector: the ledger's live host bytes at every step and boundary.
Result<ScenarioOutcome> BounceLeak(const LeakSuiteOptions& suite) {
  constexpr int kEpochs = 4, kSteps = 6;
  constexpr uint64_t kBytes = 4 * kMiB;
  ScenarioOutcome out;
  out.detector = "ledger live host bytes";
  out.epochs = kEpochs;
  out.tolerance = 4096;
  auto run = [&](bool spillway, LeakSeries* series) -> Status {
    auto rig = MakeRig(suite, {});
    if (!rig.ok()) return rig.status();
    Rig& r = **rig;
    auto off = r.nvme->Allocate(kBytes,
                                OwnerTag{Kind::kParam, Lifetime::kPersistent, 1, 0, SPILLWAY_SITE});
    if (!off.ok()) return off.status();
    std::vector<uint8_t> src(kBytes),
        back(kBytes);  // the user's pageable buffers, not arena memory
    auto naive = r.ledger.CreateScope("naive I/O path");
    if (!naive.ok()) return naive.status();
    std::string site;
    int64_t step = 0;
    series->Add(0, 0, true, HostLive(r));
    for (int e = 1; e <= kEpochs; ++e) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(e));
      for (int s = 0; s < kSteps; ++s) {
        SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginStep(++step));
        std::fill(src.begin(), src.end(), static_cast<uint8_t>(step));
        if (spillway) {
          SPILLWAY_RETURN_IF_ERROR(
              r.nvme->Write(*off, src.data(), kBytes));  // bounced by the engine
        } else {
          // The naive path: a bounce buffer per operation that nobody frees.
          auto bounce = r.host->Allocate(
              kBytes, OwnerTag{Kind::kSwapBuffer, Lifetime::kStep, 7, *naive, SPILLWAY_SITE});
          if (!bounce.ok()) return bounce.status();
          std::memcpy(*bounce, src.data(), kBytes);
          SPILLWAY_RETURN_IF_ERROR(r.nvme->Write(*off, *bounce, kBytes));
        }
        SPILLWAY_RETURN_IF_ERROR(r.nvme->Read(*off, back.data(), kBytes));
        if (back != src)
          return Status::Internal("bounce-leak: data read back differs from data written");
        allocator::BoundaryReport rep;
        SPILLWAY_RETURN_IF_ERROR(r.ledger.EndStep(&rep));
        series->escapes += Escapes(rep, &site);
        series->Add(step, e, false, HostLive(r));
      }
      allocator::BoundaryReport rep;
      SPILLWAY_RETURN_IF_ERROR(r.ledger.EndEpoch(&rep));
      series->escapes += Escapes(rep, &site);
      series->Add(step, e, true, HostLive(r));
    }
    if (!spillway)
      out.notes.push_back(
          StrCat("control: the ledger names the leaking site: ", site.empty() ? "(none!)" : site));
    if (!spillway && site.empty())
      out.failure = "the ledger did not name the control's leaking site";
    // Releasing the naive path's scope frees what it leaked.
    auto released = r.ledger.ReleaseScope(*naive);
    if (!released.ok()) return released.status();
    return r.nvme->Free(*off);
  };
  SPILLWAY_RETURN_IF_ERROR(run(true, &out.spillway));
  SPILLWAY_RETURN_IF_ERROR(run(false, &out.control));
  ScoreBy(&out, &LeakSeries::BoundaryGrowthPerEpoch);
  return out;
}

// 4. swapped-alive. Detector: ledger live host bytes. Every step brings each parameter partition in
// from NVMe, updates it, and swaps it out again.
Result<ScenarioOutcome> SwappedAlive(const LeakSuiteOptions& suite) {
  constexpr int kEpochs = 4, kSteps = 4, kParts = 8;
  constexpr uint64_t kBytes = 2 * kMiB;
  ScenarioOutcome out;
  out.detector = "ledger live host bytes";
  out.epochs = kEpochs;
  out.tolerance = 4096;
  auto run = [&](bool spillway, LeakSeries* series) -> Status {
    auto rig = MakeRig(suite, {});
    if (!rig.ok()) return rig.status();
    Rig& r = **rig;
    auto config = offload::Config::Parse(StrCat(
        R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ")",
        ScratchDir(suite), R"("}}})"));
    if (!config.ok()) return config.status();
    auto store = offload::PartitionStore::Create(*config, r.host.get(), r.nvme.get(),
                                                 allocator::kProcessScope);
    if (!store.ok()) return store.status();
    std::vector<offload::PartitionId> ids;
    for (uint32_t i = 0; i < kParts; ++i) {
      auto id = (*store)->Register({0, i, offload::StateKind::kParam}, kBytes);
      if (!id.ok()) return id.status();
      ids.push_back(*id);
    }
    std::vector<void*> kept;  // the control's host copies, still referenced after swap-out
    std::string site;
    int64_t step = 0;
    series->Add(0, 0, true, HostLive(r));
    for (int e = 1; e <= kEpochs; ++e) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(e));
      for (int s = 0; s < kSteps; ++s) {
        SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginStep(++step));
        for (offload::PartitionId id : ids) {
          auto h = (*store)->Acquire(id, offload::Access::kReadWrite);
          if (!h.ok()) return h.status();
          auto data = h->Data();
          if (!data.ok()) return data.status();
          static_cast<float*>(*data)[0] += 1.0f;
          if (!spillway) {
            auto copy = r.host->Allocate(
                kBytes, OwnerTag{Kind::kParam, Lifetime::kStep, id, 0, SPILLWAY_SITE});
            if (!copy.ok()) return copy.status();
            std::memcpy(*copy, *data, kBytes);
            kept.push_back(*copy);
          }
          SPILLWAY_RETURN_IF_ERROR((*store)->Release(*h));
          SPILLWAY_RETURN_IF_ERROR((*store)->Evict(id));  // swap out: the host copy goes
        }
        allocator::BoundaryReport rep;
        SPILLWAY_RETURN_IF_ERROR(r.ledger.EndStep(&rep));
        series->escapes += Escapes(rep, &site);
        series->Add(step, e, false, HostLive(r));
      }
      allocator::BoundaryReport rep;
      SPILLWAY_RETURN_IF_ERROR(r.ledger.EndEpoch(&rep));
      series->escapes += Escapes(rep, &site);
      series->Add(step, e, true, HostLive(r));
    }
    // The data survived every round trip: each partition was incremented once per step.
    for (offload::PartitionId id : ids) {
      auto h = (*store)->Acquire(id, offload::Access::kRead);
      if (!h.ok()) return h.status();
      const float v = static_cast<float*>(*h->Data())[0];
      if (v != static_cast<float>(kEpochs * kSteps)) {
        return Status::Internal(StrCat("swapped-alive: partition ", id, " reads ", v, " after ",
                                       kEpochs * kSteps, " round trips"));
      }
      SPILLWAY_RETURN_IF_ERROR((*store)->Release(*h));
    }
    for (void* p : kept) SPILLWAY_RETURN_IF_ERROR(r.host->Free(p));
    if (!spillway) out.notes.push_back(StrCat("control: escapes named at ", site));
    return Status::Ok();
  };
  SPILLWAY_RETURN_IF_ERROR(run(true, &out.spillway));
  SPILLWAY_RETURN_IF_ERROR(run(false, &out.control));
  ScoreBy(&out, &LeakSeries::BoundaryGrowthPerEpoch);
  return out;
}

// 6. epoch-checkpoint. Detector: host bytes held from the OS, sampled during the save; growth is
// each epoch's peak over the previous boundary. Both save through the trainer's checkpoint writer
// (engine/checkpoint_file.h: safetensors through the io_uring engine). Spillway's way streams each
// partition from where it lives in the arena; the control first gathers the whole fp32 state into
// one host buffer (DeepSpeed's stage3_gather_16bit_weights_on_model_save) and writes that. The
// budget leaves 4 MiB of headroom over the state.
Result<ScenarioOutcome> EpochCheckpoint(const LeakSuiteOptions& suite) {
  constexpr int kEpochs = 4, kSteps = 3, kParts = 16;
  constexpr uint64_t kElems = 1 << 20;  // 4 MiB of fp32 per partition: 64 MiB of master weights
  ScenarioOutcome out;
  out.detector = "host bytes held from the OS";
  out.epochs = kEpochs;
  out.tolerance = 4.0 * kMiB;  // the budget's headroom
  auto run = [&](bool spillway, LeakSeries* series) -> Status {
    RigOptions ro;
    ro.with_nvme = false;
    ro.region_bytes = 2 * kMiB;
    // Spillway runs under the budget; the control gets an unbounded arena so its peak is visible
    // instead of an out-of-memory error.
    ro.host_budget_bytes = spillway ? kParts * kElems * 4 + 4 * kMiB : (1ull << 30);
    ro.bounce_buffers = 1;
    ro.block_size = 256 << 10;
    auto rig = MakeRig(suite, ro);
    if (!rig.ok()) return rig.status();
    Rig& r = **rig;
    std::vector<float*> master;
    for (int i = 0; i < kParts; ++i) {
      auto p = r.host->Allocate(kElems * 4, OwnerTag{Kind::kMasterWeight, Lifetime::kPersistent,
                                                     static_cast<uint64_t>(i), 0, SPILLWAY_SITE});
      if (!p.ok()) return p.status();
      master.push_back(static_cast<float*>(*p));
      std::fill(master.back(), master.back() + kElems, 0.25f * i);
    }
    const std::string path = StrCat(ScratchDir(suite), "/checkpoint-",
                                    spillway ? "spillway" : "control", ".safetensors");
    std::vector<engine::checkpoint::TensorSpec> specs;
    if (spillway) {
      for (int i = 0; i < kParts; ++i) {
        specs.push_back({StrCat("master.", i), "F32", {static_cast<int64_t>(kElems)}, kElems * 4});
      }
    } else {
      specs.push_back(
          {"master", "F32", {static_cast<int64_t>(kParts * kElems)}, kParts * kElems * 4});
    }
    int64_t step = 0;
    series->Add(0, 0, true, HostCommitted(r));
    for (int e = 1; e <= kEpochs; ++e) {
      for (int s = 0; s < kSteps; ++s) {
        for (float* m : master) m[s] += 1.0f;
        series->Add(++step, e, false, HostCommitted(r));
      }
      auto writer = engine::checkpoint::FileWriter::Create(path, specs, r.io.get());
      if (!writer.ok()) return writer.status();
      if (spillway) {
        for (float* m : master) {
          SPILLWAY_RETURN_IF_ERROR((*writer)->Write(m));
          series->Add(step, e, false, HostCommitted(r));
        }
      } else {
        auto gathered =
            r.host->Allocate(kParts * kElems * 4,
                             OwnerTag{Kind::kCheckpoint, Lifetime::kEpoch, 0, 0, SPILLWAY_SITE});
        if (!gathered.ok()) return gathered.status().WithContext("the gathered model");
        for (int i = 0; i < kParts; ++i) {
          std::memcpy(static_cast<float*>(*gathered) + i * kElems, master[i], kElems * 4);
          series->Add(step, e, false, HostCommitted(r));
        }
        Status st = (*writer)->Write(*gathered);
        SPILLWAY_RETURN_IF_ERROR(r.host->Free(*gathered));
        SPILLWAY_RETURN_IF_ERROR(st);
      }
      auto done = (*writer)->Finish();
      if (!done.ok()) return done.status();
      series->Add(step, e, true, HostCommitted(r));
    }
    for (float* m : master) SPILLWAY_RETURN_IF_ERROR(r.host->Free(m));
    std::remove(path.c_str());
    return Status::Ok();
  };
  SPILLWAY_RETURN_IF_ERROR(run(true, &out.spillway));
  SPILLWAY_RETURN_IF_ERROR(run(false, &out.control));
  ScoreBy(&out, &LeakSeries::PeakGrowthPerEpoch);
  out.notes.push_back(
      Fmt("peak during a save over the state: spillway %.1f MiB (budget headroom 4 MiB), "
          "control %.1f MiB",
          out.spillway_growth / kMiB, out.control_growth / kMiB));
  return out;
}

}  // namespace spillway::cli::leak
