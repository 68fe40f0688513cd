// Leak-suite scenarios that drive the reference trainer (libtorch): engine-rebuild,
// accum-remainder, step-exception, budget-pressure. Note [Leak suite] in docs/leak-suite.md.
#include <torch/torch.h>

#include <cstring>

#include "leak_scenarios.h"
#include "spillway/base/bytes.h"
#include "spillway/offload/config.h"
#include "spillway/offload/partition_store.h"
#include "spillway/trainer/collectives.h"
#include "spillway/trainer/trainer.h"

namespace spillway::cli::leak {

using allocator::Kind;
using allocator::Lifetime;
using allocator::OwnerTag;
using engine::GptConfig;
namespace gpt = engine::gpt;

namespace {

GptConfig Tiny(int64_t layers = 1, int64_t d = 32) {
  GptConfig c;
  c.vocab = 32;
  c.d_model = d;
  c.n_layer = layers;
  c.n_head = 2;
  c.seq_len = 16;
  c.seed = 11;
  return c;
}

torch::Tensor Batch(const GptConfig& c, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(1000 + seed));
  return torch::randint(0, c.vocab, {4, c.seq_len + 1}, gen, torch::kInt64);
}

Result<offload::Config> CpuOffload(const std::string& extra = "") {
  return offload::Config::Parse(
      StrCat(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "cpu"}})",
             extra, "}"));
}

engine::TrainerOptions Options(const GptConfig& c) {
  engine::TrainerOptions o;
  o.model = c;
  o.adam.lr = 1e-2;
  o.optimizer_threads = 2;
  o.max_grad_norm = 1.0;
  return o;
}

// A trainer with its own partition store over a rig's arenas.
struct Engine {
  std::unique_ptr<offload::PartitionStore> store;
  std::unique_ptr<engine::Trainer> trainer;
};

Result<Engine> MakeEngine(Rig& r, engine::Collectives* coll, const offload::Config& config,
                          const GptConfig& c, allocator::ScopeId scope, bool with_ledger) {
  Engine e;
  auto store = offload::PartitionStore::Create(config, r.host.get(), r.nvme.get(), scope);
  if (!store.ok()) return store.status();
  e.store = std::move(*store);
  auto t = engine::Trainer::Create(Options(c), coll, e.store.get(), r.host.get(),
                                   with_ledger ? &r.ledger : nullptr, scope);
  if (!t.ok()) return t.status();
  e.trainer = std::move(*t);
  return e;
}

}  // namespace

// 5. engine-rebuild. Detector: ledger live host bytes after each rebuild (one "epoch" each).
Result<ScenarioOutcome> EngineRebuild(const LeakSuiteOptions& suite) {
  constexpr int kRebuilds = 10;
  ScenarioOutcome out;
  out.detector = "ledger live host bytes";
  out.epochs = kRebuilds;
  out.tolerance = 4096;
  auto coll = engine::Collectives::Create(engine::DistEnv{});
  if (!coll.ok()) return coll.status();
  auto config = CpuOffload();
  if (!config.ok()) return config.status();
  const GptConfig c = Tiny(2);
  auto run = [&](bool spillway, LeakSeries* series) -> Status {
    auto rig = MakeRig(suite, {});
    if (!rig.ok()) return rig.status();
    Rig& r = **rig;
    std::vector<Engine> lingering;  // the control: something still holds each old engine
    int64_t step = 0;
    series->Add(0, 0, true, HostLive(r));
    for (int k = 1; k <= kRebuilds; ++k) {
      auto scope = r.ledger.CreateScope(StrCat("engine ", k));
      if (!scope.ok()) return scope.status();
      auto e = MakeEngine(r, coll->get(), *config, c, *scope, /*with_ledger=*/false);
      if (!e.ok()) return e.status();
      auto s = e->trainer->Step({Batch(c, k)});
      if (!s.ok()) return s.status();
      series->Add(++step, k, false, HostLive(r));
      if (spillway) {
        e->trainer.reset();
        e->store.reset();
        auto rel = r.ledger.ReleaseScope(*scope);
        if (!rel.ok()) return rel.status();
      } else {
        lingering.push_back(std::move(*e));
      }
      series->Add(step, k, true, HostLive(r));
    }
    return Status::Ok();
  };
  SPILLWAY_RETURN_IF_ERROR(run(true, &out.spillway));
  SPILLWAY_RETURN_IF_ERROR(run(false, &out.control));
  ScoreBy(&out, &LeakSeries::BoundaryGrowthPerEpoch);
  return out;
}

// 7. accum-remainder. Detector: ledger live host bytes at every step and boundary; 10 micro-batches
// an epoch with accumulation over 4 leaves a remainder of 2.
Result<ScenarioOutcome> AccumRemainder(const LeakSuiteOptions& suite) {
  constexpr int kEpochs = 4, kMicro = 10, kAccum = 4;
  ScenarioOutcome out;
  out.detector = "ledger live host bytes";
  out.epochs = kEpochs;
  out.tolerance = 4096;
  auto coll = engine::Collectives::Create(engine::DistEnv{});
  if (!coll.ok()) return coll.status();
  auto config = CpuOffload();
  if (!config.ok()) return config.status();
  const GptConfig c = Tiny();
  int64_t numel = 0;
  for (int64_t u = 0; u < gpt::Units(c); ++u) numel += gpt::UnitNumel(c, u);

  // Spillway: the trainer takes the remainder as a short step, inside the ledger's step.
  {
    auto rig = MakeRig(suite, {});
    if (!rig.ok()) return rig.status();
    Rig& r = **rig;
    auto e = MakeEngine(r, coll->get(), *config, c, allocator::kProcessScope, true);
    if (!e.ok()) return e.status();
    int64_t step = 0;
    out.spillway.Add(0, 0, true, HostLive(r));
    for (int ep = 1; ep <= kEpochs; ++ep) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(ep));
      for (int m = 0; m < kMicro; m += kAccum) {
        std::vector<torch::Tensor> mbs;
        for (int k = m; k < std::min(kMicro, m + kAccum); ++k)
          mbs.push_back(Batch(c, ep * 100 + k));
        auto s = e->trainer->Step(mbs);
        if (!s.ok()) return s.status();
        out.spillway.Add(++step, ep, false, HostLive(r));
      }
      allocator::BoundaryReport rep;
      SPILLWAY_RETURN_IF_ERROR(r.ledger.EndEpoch(&rep));
      out.spillway.Add(step, ep, true, HostLive(r));
    }
    out.spillway.escapes = TotalEscapes(r);
    std::vector<double> b;
    for (const auto& p : out.spillway.points) {
      if (p.boundary && p.epoch > 0) b.push_back(p.bytes);
    }
    if (std::adjacent_find(b.begin(), b.end(), std::not_equal_to<>()) != b.end()) {
      out.failure = "live bytes differ between epoch boundaries";
    }
  }
  // The control: a hand-written accumulation loop. It opens an accumulation buffer per window and
  // frees it when the window reaches 4; the remainder's buffer is dropped at the epoch's end.
  {
    auto rig = MakeRig(suite, {});
    if (!rig.ok()) return rig.status();
    Rig& r = **rig;
    std::vector<torch::Tensor> flats;
    for (int64_t u = 0; u < gpt::Units(c); ++u)
      flats.push_back(gpt::InitUnit(c, u).requires_grad_(true));
    auto naive = r.ledger.CreateScope("naive accumulation loop");
    if (!naive.ok()) return naive.status();
    int64_t step = 0;
    out.control.Add(0, 0, true, HostLive(r));
    for (int ep = 1; ep <= kEpochs; ++ep) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(ep));
      float* accum = nullptr;
      int in_window = 0;
      for (int k = 0; k < kMicro; ++k) {
        if (accum == nullptr) {
          SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginStep(++step));
          auto p = r.host->Allocate(
              numel * 4, OwnerTag{Kind::kGrad, Lifetime::kStep, 1, *naive, SPILLWAY_SITE});
          if (!p.ok()) return p.status();
          accum = static_cast<float*>(*p);
          std::memset(accum, 0, numel * 4);
        }
        const torch::Tensor t = Batch(c, ep * 100 + k);
        torch::Tensor x = t.narrow(1, 0, c.seq_len);
        for (int64_t u = 0; u < gpt::Units(c); ++u) x = gpt::Forward(c, u, flats[u], x);
        gpt::Loss(x, t.narrow(1, 1, c.seq_len)).backward();
        torch::Tensor acc = torch::from_blob(accum, {numel}, torch::kFloat32);
        int64_t off = 0;
        for (auto& f : flats) {
          acc.narrow(0, off, f.numel()).add_(f.grad());
          off += f.numel();
          f.mutable_grad().zero_();
        }
        if (++in_window == kAccum) {
          SPILLWAY_RETURN_IF_ERROR(r.host->Free(accum));
          accum = nullptr;
          in_window = 0;
          allocator::BoundaryReport rep;
          SPILLWAY_RETURN_IF_ERROR(r.ledger.EndStep(&rep));
          out.control.Add(step, ep, false, HostLive(r));
        }
      }
      if (accum != nullptr) {  // the remainder: the loop moves on and forgets the buffer
        allocator::BoundaryReport rep;
        SPILLWAY_RETURN_IF_ERROR(r.ledger.EndStep(&rep));
        out.control.Add(step, ep, false, HostLive(r));
      }
      allocator::BoundaryReport rep;
      SPILLWAY_RETURN_IF_ERROR(r.ledger.EndEpoch(&rep));
      out.control.Add(step, ep, true, HostLive(r));
    }
    out.control.escapes = TotalEscapes(r);
    auto released = r.ledger.ReleaseScope(*naive);
    if (!released.ok()) return released.status();
  }
  ScoreBy(&out, &LeakSeries::BoundaryGrowthPerEpoch);
  out.notes.push_back(
      StrCat("escapes: spillway ", out.spillway.escapes, ", control ", out.control.escapes));
  return out;
}

// 8. step-exception. Detector: ledger live host bytes. The second step of every epoch throws in the
// middle: after the first micro-batch's forward and backward, in the second one's forward at unit
// 1 (a libtorch error there, injected through the trainer's fault seam; bad token ids would be
// refused before the step starts, Note [Guard]).
Result<ScenarioOutcome> StepException(const LeakSuiteOptions& suite) {
  constexpr int kEpochs = 4, kSteps = 3;
  ScenarioOutcome out;
  out.detector = "ledger live host bytes";
  out.epochs = kEpochs;
  out.tolerance = 4096;
  auto coll = engine::Collectives::Create(engine::DistEnv{});
  if (!coll.ok()) return coll.status();
  auto config = CpuOffload();
  if (!config.ok()) return config.status();
  GptConfig c = Tiny(2);
  c.vocab = 256;  // an embedding of 68 KiB: what one failure strands is well above a page
  const torch::Tensor bad = torch::full({4, c.seq_len + 1}, c.vocab + 5, torch::kInt64);
  const int64_t units = gpt::Units(c);
  uint64_t failures = 0;
  {
    auto rig = MakeRig(suite, {});
    if (!rig.ok()) return rig.status();
    Rig& r = **rig;
    auto e = MakeEngine(r, coll->get(), *config, c, allocator::kProcessScope, true);
    if (!e.ok()) return e.status();
    bool armed = false;
    int64_t forwards = 0;  // units whose forward started in this step
    e->trainer->SetFaultHookForTesting([&](int64_t u) {
      if (armed && ++forwards > units && u == 1)
        throw std::runtime_error("step-exception: injected in the forward");
    });
    int64_t step = 0;
    out.spillway.Add(0, 0, true, HostLive(r));
    for (int ep = 1; ep <= kEpochs; ++ep) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(ep));
      for (int s = 0; s < kSteps; ++s) {
        std::vector<torch::Tensor> mbs = {Batch(c, ep * 10 + s), Batch(c, ep * 10 + s + 5)};
        armed = s == 1;
        forwards = 0;
        auto res = e->trainer->Step(mbs);
        if (!res.ok())
          ++failures;
        else if (s == 1)
          return Status::Internal(
              "step-exception: the step with the injected failure did not fail");
        out.spillway.Add(++step, ep, false, HostLive(r));
      }
      allocator::BoundaryReport rep;
      SPILLWAY_RETURN_IF_ERROR(r.ledger.EndEpoch(&rep));
      out.spillway.Add(step, ep, true, HostLive(r));
    }
    out.spillway.escapes = TotalEscapes(r);
  }
  // The control: per-unit gather buffers freed at the end of the forward pass, which an exception
  // skips (no RAII, as in hand-written swap code).
  {
    auto rig = MakeRig(suite, {});
    if (!rig.ok()) return rig.status();
    Rig& r = **rig;
    std::vector<torch::Tensor> flats;
    for (int64_t u = 0; u < gpt::Units(c); ++u) flats.push_back(gpt::InitUnit(c, u));
    auto naive = r.ledger.CreateScope("naive forward");
    if (!naive.ok()) return naive.status();
    int64_t step = 0;
    out.control.Add(0, 0, true, HostLive(r));
    for (int ep = 1; ep <= kEpochs; ++ep) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(ep));
      for (int s = 0; s < kSteps; ++s) {
        SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginStep(++step));
        const torch::Tensor t = s == 1 ? bad : Batch(c, ep * 10 + s);
        std::vector<void*> gathers;
        try {
          torch::NoGradGuard no_grad;
          torch::Tensor x = t.narrow(1, 0, c.seq_len);
          for (int64_t u = 0; u < gpt::Units(c); ++u) {
            auto p = r.host->Allocate(flats[u].numel() * 4,
                                      OwnerTag{Kind::kTransient, Lifetime::kStep,
                                               static_cast<uint64_t>(u), *naive, SPILLWAY_SITE});
            if (!p.ok()) return p.status();
            gathers.push_back(*p);
            torch::Tensor g = torch::from_blob(*p, {flats[u].numel()}, torch::kFloat32);
            g.copy_(flats[u]);
            x = gpt::Forward(c, u, g, x);  // unit 0 throws on the bad batch
          }
          for (void* p : gathers) SPILLWAY_RETURN_IF_ERROR(r.host->Free(p));
        } catch (const c10::Error&) {
          // The training loop logs and goes on; the gathers are never freed.
        }
        allocator::BoundaryReport rep;
        SPILLWAY_RETURN_IF_ERROR(r.ledger.EndStep(&rep));
        out.control.Add(step, ep, false, HostLive(r));
      }
      allocator::BoundaryReport rep;
      SPILLWAY_RETURN_IF_ERROR(r.ledger.EndEpoch(&rep));
      out.control.Add(step, ep, true, HostLive(r));
    }
    out.control.escapes = TotalEscapes(r);
    auto released = r.ledger.ReleaseScope(*naive);
    if (!released.ok()) return released.status();
  }
  if (failures != kEpochs)
    out.failure = StrCat("expected ", kEpochs, " failed steps, saw ", failures);
  ScoreBy(&out, &LeakSeries::BoundaryGrowthPerEpoch);
  out.notes.push_back(StrCat("failed steps: ", failures, "; escapes: spillway ",
                             out.spillway.escapes, ", control ", out.control.escapes));
  return out;
}

// 9. budget-pressure. Detector: host bytes held from the OS against the budget (a quarter of the
// model states); growth is the most the run held above the budget. The control is the same run with
// no budget: it holds every state in host memory. Losses must match bit for bit.
Result<ScenarioOutcome> BudgetPressure(const LeakSuiteOptions& suite) {
  constexpr int kEpochs = 3, kSteps = 4;
  ScenarioOutcome out;
  out.detector = "host bytes over the budget";
  out.epochs = kEpochs;
  out.tolerance = 0;
  auto coll = engine::Collectives::Create(engine::DistEnv{});
  if (!coll.ok()) return coll.status();
  const GptConfig c = Tiny(16, 64);
  uint64_t state_bytes = 0;
  for (int64_t u = 0; u < gpt::Units(c); ++u) state_bytes += 5 * 4 * gpt::UnitNumel(c, u);
  const uint64_t budget = state_bytes / 4;
  std::vector<double> losses[2];
  uint64_t spills = 0;
  auto run = [&](bool spillway, LeakSeries* series) -> Status {
    RigOptions ro;
    ro.host_budget_bytes = spillway ? budget : (1ull << 30);
    ro.region_bytes = 256 << 10;
    ro.bounce_buffers = 1;
    ro.block_size = 64 << 10;
    auto rig = MakeRig(suite, ro);
    if (!rig.ok()) return rig.status();
    Rig& r = **rig;
    auto config = CpuOffload();
    if (!config.ok()) return config.status();
    auto e = MakeEngine(r, coll->get(), *config, c, allocator::kProcessScope, true);
    if (!e.ok()) return e.status().WithContext(spillway ? "under the budget" : "unbounded");
    int64_t step = 0;
    auto over = [&] {
      return static_cast<double>(r.host->Stats().peak_committed_bytes) -
             static_cast<double>(budget);
    };
    series->Add(0, 0, true, over());
    for (int ep = 1; ep <= kEpochs; ++ep) {
      SPILLWAY_RETURN_IF_ERROR(r.ledger.BeginEpoch(ep));
      for (int s = 0; s < kSteps; ++s) {
        auto res = e->trainer->Step({Batch(c, ep * 10 + s)});
        if (!res.ok()) return res.status().WithContext(spillway ? "under the budget" : "unbounded");
        losses[spillway ? 0 : 1].push_back(res->loss);
        series->Add(++step, ep, false, over());
      }
      allocator::BoundaryReport rep;
      SPILLWAY_RETURN_IF_ERROR(r.ledger.EndEpoch(&rep));
      series->Add(step, ep, true, over());
    }
    series->escapes = TotalEscapes(r);
    if (spillway) spills = e->store->Stats().spills;
    return Status::Ok();
  };
  SPILLWAY_RETURN_IF_ERROR(run(true, &out.spillway));
  SPILLWAY_RETURN_IF_ERROR(run(false, &out.control));
  auto most_over = [](const LeakSeries& s) {
    double m = -1e300;
    for (const auto& p : s.points) m = std::max(m, p.bytes);
    return std::max(0.0, m);
  };
  out.spillway_growth = most_over(out.spillway);
  out.control_growth = most_over(out.control);
  if (losses[0] != losses[1])
    out.failure = "losses under the budget differ from the unbounded run's";
  if (spills == 0) out.failure = "nothing spilled: the budget did not bind";
  out.notes.push_back(StrCat("states ", FormatBytes(state_bytes), ", budget ", FormatBytes(budget),
                             ", partitions spilled to NVMe ", spills,
                             ", losses identical to the "
                             "unbounded run: ",
                             losses[0] == losses[1] ? "yes" : "NO"));
  return out;
}

}  // namespace spillway::cli::leak
