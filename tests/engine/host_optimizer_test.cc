// The fused host optimizer: every SIMD path against the scalar path bit for bit, the scalar path
// against an independent per-element reference, loss-scaling skips, clipping, the streamed
// pieces, the unfused baseline and every error. Comparison with libtorch's AdamW is in
// adamw_torch_test.cc.
#include "spillway/engine/host_optimizer.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "optimizer_test_util.h"
#include "spillway/engine/cpu_features.h"

namespace spillway::engine {
namespace {

using testing::GroupBuffers;

std::unique_ptr<HostOptimizer> MakeOptimizer(Isa isa, uint32_t threads = 2, AdamWConfig adam = {},
                                             uint64_t chunk = 1 << 12) {
  HostOptimizerOptions o;
  o.isa = isa;
  o.threads = threads;
  o.adam = adam;
  o.chunk_elems = chunk;
  auto opt = HostOptimizer::Create(o);
  EXPECT_TRUE(opt.ok()) << opt.status().ToString();
  return opt.ok() ? std::move(*opt) : nullptr;
}

// An independent per-element reference written from torch.optim.AdamW's definition, with the
// fused multiply-adds and conversions spelled out (the contract in Note [Fused step]).
uint16_t RefBf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if (std::isnan(x)) return static_cast<uint16_t>((b >> 16) | 0x40);
  if ((b & 0x7F800000u) == 0) return static_cast<uint16_t>((b >> 16) & 0x8000);
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

void ReferenceStep(GroupBuffers& b, const AdamWConfig& c, uint64_t step, float scale) {
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
  const float neg_step = static_cast<float>(-c.lr / bc1);
  const float inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  const float b1 = static_cast<float>(c.beta1), omb1 = static_cast<float>(1.0 - c.beta1);
  const float b2 = static_cast<float>(c.beta2), omb2 = static_cast<float>(1.0 - c.beta2);
  const float decay = c.adamw_mode ? static_cast<float>(1.0 - c.lr * c.weight_decay) : 1.0f;
  const float l2 = c.adamw_mode ? 0.0f : static_cast<float>(c.weight_decay);
  for (uint64_t i = 0; i < b.numel; ++i) {
    float g = b.GradAt(i) * scale;
    float w = b.master[i];
    if (l2 != 0.0f) g = std::fma(l2, w, g);
    w = w * decay;
    const float m = std::fma(b1, b.exp_avg[i], omb1 * g);
    const float v = std::fma(b2, b.exp_avg_sq[i], (omb2 * g) * g);
    const float denom = std::sqrt(v) * inv_bc2_sqrt + static_cast<float>(c.eps);
    w = std::fma(neg_step, m / denom, w);
    b.master[i] = w;
    b.exp_avg[i] = m;
    b.exp_avg_sq[i] = v;
    if (b.with_param && b.param_dtype == DType::kBf16) {
      const uint16_t h = RefBf16(w);
      std::memcpy(b.param.data() + 2 * i, &h, 2);
    } else if (b.with_param && b.param_dtype == DType::kFp32) {
      std::memcpy(b.param.data() + 4 * i, &w, 4);
    }
  }
}

struct Pair {
  DType grad, param;
};
const Pair kPairs[] = {{DType::kFp32, DType::kFp32}, {DType::kBf16, DType::kBf16},
                       {DType::kFp16, DType::kFp16}, {DType::kFp32, DType::kBf16},
                       {DType::kBf16, DType::kFp32}, {DType::kFp16, DType::kBf16}};

std::string PairName(const Pair& p) {
  return StrCat("grad ", DTypeName(p.grad), " / param ", DTypeName(p.param));
}

TEST(HostOptimizerTest, TheScalarPathIsThePerElementReference) {
  // Odd size: full blocks, several chunks and a padded tail.
  constexpr uint64_t kN = 3 * 4096 + 16 * 5 + 7;
  AdamWConfig c;
  c.lr = 3e-3;
  c.weight_decay = 0.1;
  for (bool adamw : {true, false}) {
    c.adamw_mode = adamw;
    for (DType gd : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      for (DType pd : {DType::kFp32, DType::kBf16}) {
        SCOPED_TRACE(StrCat("adamw=", adamw, " ", DTypeName(gd), "/", DTypeName(pd)));
        GroupBuffers got(kN, gd, pd, true, 7), want(kN, gd, pd, true, 7);
        auto opt = MakeOptimizer(Isa::kScalar, 2, c);
        StepOptions so;
        so.loss_scale = 64.0;
        for (uint64_t step = 1; step <= 5; ++step) {
          got.FillGrad(100 + step, 32.0f);
          want.FillGrad(100 + step, 32.0f);
          SubGroup g = got.View();
          auto r = opt->Step({&g, 1}, so);
          ASSERT_TRUE(r.ok()) << r.status().ToString();
          ASSERT_FALSE(r->skipped);
          ASSERT_EQ(r->step, step);
          ReferenceStep(want, c, step, static_cast<float>(r->combined_scale));
          ASSERT_TRUE(got.SameState(want)) << "step " << step;
        }
      }
    }
  }
}

TEST(HostOptimizerTest, EverySimdPathMatchesTheScalarPathBitForBit) {
  const std::vector<Isa> isas = SupportedIsas();
  if (isas.size() < 2) GTEST_SKIP() << "this CPU runs only the scalar path";
  constexpr uint64_t kN = 2 * 4096 + 16 * 3 + 13;
  AdamWConfig c;
  c.lr = 1e-2;
  c.weight_decay = 0.05;
  for (const Pair& pair : kPairs) {
    for (bool adamw : {true, false}) {
      c.adamw_mode = adamw;
      GroupBuffers scalar(kN, pair.grad, pair.param, true, 11);
      auto ref = MakeOptimizer(Isa::kScalar, 1, c);
      std::vector<GroupBuffers> bufs;
      std::vector<std::unique_ptr<HostOptimizer>> opts;
      for (size_t i = 1; i < isas.size(); ++i) {
        bufs.emplace_back(kN, pair.grad, pair.param, true, 11);
        opts.push_back(MakeOptimizer(isas[i], 3, c));
      }
      StepOptions so;
      so.loss_scale = 1024.0;
      so.max_grad_norm = 50.0;  // clips on some steps
      for (uint64_t step = 1; step <= 12; ++step) {
        const float sigma = step % 3 == 0 ? 4096.0f : 256.0f;
        scalar.FillGrad(500 + step, sigma);
        SubGroup sg = scalar.View();
        auto want = ref->Step({&sg, 1}, so);
        ASSERT_TRUE(want.ok()) << want.status().ToString();
        for (size_t i = 0; i < bufs.size(); ++i) {
          SCOPED_TRACE(
              StrCat(IsaName(isas[i + 1]), " ", PairName(pair), " adamw=", adamw, " step ", step));
          bufs[i].FillGrad(500 + step, sigma);
          SubGroup g = bufs[i].View();
          auto got = opts[i]->Step({&g, 1}, so);
          ASSERT_TRUE(got.ok()) << got.status().ToString();
          // The norm is reduced in a fixed 16-lane order on every path: identical bits.
          ASSERT_EQ(got->grad_norm, want->grad_norm);
          ASSERT_EQ(got->combined_scale, want->combined_scale);
          ASSERT_TRUE(bufs[i].SameState(scalar));
        }
      }
    }
  }
}

TEST(HostOptimizerTest, ResultsDoNotDependOnTheThreadCountOrChunkSize) {
  constexpr uint64_t kN = 100'003;
  GroupBuffers a(kN, DType::kBf16, DType::kBf16, true, 3),
      b(kN, DType::kBf16, DType::kBf16, true, 3);
  auto one = MakeOptimizer(Isa::kAuto, 1, {}, 1 << 16);
  auto many = MakeOptimizer(Isa::kAuto, 4, {}, 1 << 10);
  for (uint64_t step = 1; step <= 3; ++step) {
    a.FillGrad(step, 1.0f);
    b.FillGrad(step, 1.0f);
    SubGroup ga = a.View(), gb = b.View();
    auto ra = one->Step({&ga, 1});
    auto rb = many->Step({&gb, 1});
    ASSERT_TRUE(ra.ok() && rb.ok());
    // The norm's chunk partials are summed in chunk order, so a different chunk size may change
    // the last bits of the norm; the update itself is element-wise and must be identical.
    EXPECT_NEAR(ra->grad_norm, rb->grad_norm, 1e-12 * ra->grad_norm);
  }
  // With no clipping the norm does not feed the update: identical state.
  EXPECT_TRUE(a.SameState(b));
}

TEST(HostOptimizerTest, TheNormIsTheGlobalL2NormOfTheUnscaledGradientsInDouble) {
  GroupBuffers a(10'007, DType::kFp32, DType::kBf16, true, 1);
  GroupBuffers b(777, DType::kBf16, DType::kBf16, true, 2);
  GroupBuffers c(33, DType::kFp16, DType::kFp16, true, 3);
  long double want = 0;
  for (GroupBuffers* g : {&a, &b, &c}) {
    for (uint64_t i = 0; i < g->numel; ++i)
      want += static_cast<long double>(g->GradAt(i)) * g->GradAt(i);
  }
  for (Isa isa : SupportedIsas()) {
    auto opt = MakeOptimizer(isa);
    std::vector<SubGroup> groups = {a.View("a"), b.View("b"), c.View("c")};
    double sum = 0;
    for (const SubGroup& g : groups) {
      auto s = opt->SumOfSquares(g);
      ASSERT_TRUE(s.ok());
      sum += *s;
    }
    EXPECT_NEAR(sum, static_cast<double>(want), 1e-12 * static_cast<double>(want)) << IsaName(isa);
    StepOptions so;
    so.loss_scale = 8.0;
    auto r = opt->Plan(sum, so);
    ASSERT_TRUE(r.ok());
    EXPECT_NEAR(r->grad_norm, std::sqrt(static_cast<double>(want)) / 8.0, 1e-9);
    EXPECT_DOUBLE_EQ(r->combined_scale, 1.0 / 8.0);
  }
}

TEST(HostOptimizerTest, InfOrNanGradientsSkipTheStepAndLeaveTheStateUntouched) {
  for (Isa isa : SupportedIsas()) {
    for (DType gd : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      for (bool nan : {false, true}) {
        SCOPED_TRACE(StrCat(IsaName(isa), " ", DTypeName(gd), nan ? " NaN" : " inf"));
        GroupBuffers b(5000, gd, DType::kBf16, true, 9);
        auto opt = MakeOptimizer(isa);
        SubGroup g = b.View();
        ASSERT_TRUE(opt->Step({&g, 1}).ok());  // step 1 applies
        const GroupBuffers before = b;
        // One bad element in the padded tail, where a sloppy tail would miss it.
        const uint32_t bits32 = nan ? 0x7FC00000u : 0x7F800000u;
        const uint16_t bits16 =
            gd == DType::kBf16 ? (nan ? 0x7FC0 : 0x7F80) : (nan ? 0x7E00 : 0x7C00);
        b.SetGradBits(4999, bits32, bits16);
        auto r = opt->Step({&g, 1});
        ASSERT_TRUE(r.ok());
        EXPECT_TRUE(r->skipped);
        EXPECT_FALSE(std::isfinite(r->grad_norm));
        EXPECT_EQ(r->step, 0u);
        EXPECT_EQ(opt->step(), 1u);
        EXPECT_TRUE(b.SameState(before));
        EXPECT_EQ(opt->Stats().skipped_steps, 1u);
        EXPECT_EQ(opt->Stats().steps, 1u);
        // The next good step is step 2, not 3: a skipped step does not advance bias correction.
        b.FillGrad(77, 1.0f);
        auto next = opt->Step({&g, 1});
        ASSERT_TRUE(next.ok());
        EXPECT_EQ(next->step, 2u);
      }
    }
  }
}

TEST(HostOptimizerTest, ClippingScalesByMaxNormOverNormAsTorchDoes) {
  GroupBuffers b(4096, DType::kFp32, DType::kFp32, true, 5);
  auto opt = MakeOptimizer(Isa::kAuto);
  SubGroup g = b.View();
  StepOptions so;
  so.loss_scale = 2.0;
  so.max_grad_norm = 1.0;
  auto r = opt->Step({&g, 1}, so);
  ASSERT_TRUE(r.ok());
  ASSERT_GT(r->grad_norm, 1.0);
  EXPECT_DOUBLE_EQ(r->combined_scale, (1.0 / (r->grad_norm + 1e-6)) / 2.0);
  so.max_grad_norm = 1e9;  // no clip when the norm is below the limit
  auto r2 = opt->Step({&g, 1}, so);
  ASSERT_TRUE(r2.ok());
  EXPECT_DOUBLE_EQ(r2->combined_scale, 0.5);
}

TEST(HostOptimizerTest, TheStreamedPiecesEqualOneStep) {
  constexpr uint64_t kN = 20'000;
  std::vector<GroupBuffers> whole, pieces;
  for (int i = 0; i < 4; ++i) {
    whole.emplace_back(kN + i, DType::kBf16, DType::kBf16, true, 40 + i);
    pieces.emplace_back(kN + i, DType::kBf16, DType::kBf16, true, 40 + i);
  }
  auto a = MakeOptimizer(Isa::kAuto), b = MakeOptimizer(Isa::kAuto);
  StepOptions so;
  so.max_grad_norm = 10.0;
  for (uint64_t step = 1; step <= 3; ++step) {
    std::vector<SubGroup> ga, gb;
    for (int i = 0; i < 4; ++i) {
      whole[i].FillGrad(step * 10 + i, 1.0f);
      pieces[i].FillGrad(step * 10 + i, 1.0f);
      ga.push_back(whole[i].View());
      gb.push_back(pieces[i].View());
    }
    auto r = a->Step(ga, so);
    ASSERT_TRUE(r.ok());
    double sum = 0;
    for (const SubGroup& g : gb) sum += *b->SumOfSquares(g);
    auto plan = b->Plan(sum, so);
    ASSERT_TRUE(plan.ok());
    for (const SubGroup& g : gb) ASSERT_TRUE(b->Update(g, *plan).ok());
    // Summing per-group partials regroups the norm's additions; allow the last bits.
    EXPECT_NEAR(plan->grad_norm, r->grad_norm, 1e-12 * r->grad_norm);
    EXPECT_FLOAT_EQ(static_cast<float>(plan->combined_scale),
                    static_cast<float>(r->combined_scale));
  }
  for (int i = 0; i < 4; ++i) {
    // Equal up to the float rounding of the clip factor (identical when it rounds the same).
    for (uint64_t k = 0; k < whole[i].numel; ++k) {
      ASSERT_NEAR(whole[i].master[k], pieces[i].master[k],
                  1e-6f * (1 + std::fabs(whole[i].master[k])));
    }
  }
  EXPECT_EQ(b->Stats().steps, 3u);
}

// UpdateWith is Update with the caller's own hyperparameters and step number (DeepSpeed and
// torch.optim keep them per parameter group): bit for bit the same pass, and the optimizer's own
// step counter and config are neither read nor moved.
TEST(HostOptimizerTest, UpdateWithTheCallersStepAndConfigEqualsUpdate) {
  constexpr uint64_t kN = 30'001;
  GroupBuffers a(kN, DType::kBf16, DType::kBf16, true, 61),
      b(kN, DType::kBf16, DType::kBf16, true, 61);
  auto planner = MakeOptimizer(Isa::kAuto);
  HostOptimizerOptions other;
  other.adam.lr = 0.5;  // must not be used by UpdateWith
  other.adam.weight_decay = 0.3;
  auto caller = HostOptimizer::Create(other);
  ASSERT_TRUE(caller.ok());
  StepOptions so;
  so.loss_scale = 4.0;
  so.max_grad_norm = 1.0;
  for (uint64_t step = 1; step <= 3; ++step) {
    a.FillGrad(step, 2.0f);
    b.FillGrad(step, 2.0f);
    auto plan = planner->Plan(*planner->SumOfSquares(a.View()), so);
    ASSERT_TRUE(plan.ok());
    ASSERT_TRUE(planner->Update(a.View(), *plan).ok());
    ASSERT_TRUE(
        (*caller)->UpdateWith(b.View(), planner->config(), plan->step, plan->combined_scale).ok());
  }
  EXPECT_EQ(std::memcmp(a.master.data(), b.master.data(), kN * 4), 0);
  EXPECT_EQ(std::memcmp(a.exp_avg_sq.data(), b.exp_avg_sq.data(), kN * 4), 0);
  EXPECT_EQ(a.param, b.param);
  EXPECT_EQ((*caller)->step(), 0u);
  EXPECT_EQ((*caller)->config().lr, 0.5);
  // Bad input: named, and nothing is touched.
  const std::vector<float> before = b.master;
  AdamWConfig bad = planner->config();
  bad.beta2 = 1.0;
  Status st = (*caller)->UpdateWith(b.View(), bad, 4, 1.0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("beta2"), std::string::npos) << st.ToString();
  st = (*caller)->UpdateWith(b.View(), planner->config(), 0, 1.0);
  EXPECT_NE(st.message().find("step 0"), std::string::npos) << st.ToString();
  st = (*caller)->UpdateWith(b.View(), planner->config(), 4, std::nan(""));
  EXPECT_NE(st.message().find("not finite"), std::string::npos) << st.ToString();
  EXPECT_EQ(b.master, before);
}

// DeepSpeed's bf16_optimizer_states: master weights and moments in bf16. Each element is the fp32
// step on the widened bf16 values, every state rounded to nearest even, on every path.
TEST(HostOptimizerTest, Bf16StateIsTheFp32StepOnWidenedValuesRoundedToNearestEven) {
  constexpr uint64_t kN = 2 * 4096 + 16 * 3 + 5;  // several chunks and a padded tail
  auto widen = [](uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); };
  AdamWConfig c;
  c.lr = 3e-3;
  c.weight_decay = 0.1;
  for (Isa isa : SupportedIsas()) {
    for (DType gd : {DType::kBf16, DType::kFp32}) {
      SCOPED_TRACE(StrCat(IsaName(isa), " grad ", DTypeName(gd)));
      GroupBuffers want(kN, gd, DType::kBf16, true, 17);
      // The state in bf16, and the reference's fp32 state holding exactly those values.
      std::vector<uint16_t> master(kN), m(kN), v(kN);
      for (uint64_t i = 0; i < kN; ++i) {
        master[i] = RefBf16(want.master[i]);
        m[i] = RefBf16(want.exp_avg[i]);
        v[i] = RefBf16(std::fabs(want.exp_avg_sq[i]));
        want.master[i] = widen(master[i]);
        want.exp_avg[i] = widen(m[i]);
        want.exp_avg_sq[i] = widen(v[i]);
      }
      std::vector<uint16_t> param(kN);
      auto opt = MakeOptimizer(isa, 2, c);
      for (uint64_t step = 1; step <= 3; ++step) {
        want.FillGrad(300 + step, 4.0f);
        SubGroup g = want.View();
        g.master = master.data();
        g.exp_avg = m.data();
        g.exp_avg_sq = v.data();
        g.state_dtype = DType::kBf16;
        g.param = param.data();
        ASSERT_TRUE(opt->UpdateWith(g, c, step, 0.25).ok());
        ReferenceStep(want, c, step, 0.25f);
        for (uint64_t i = 0; i < kN; ++i) {  // the reference's state, rounded as stored
          want.master[i] = widen(RefBf16(want.master[i]));
          want.exp_avg[i] = widen(RefBf16(want.exp_avg[i]));
          want.exp_avg_sq[i] = widen(RefBf16(want.exp_avg_sq[i]));
        }
        for (uint64_t i = 0; i < kN; ++i) {
          ASSERT_EQ(master[i], RefBf16(want.master[i])) << "step " << step << " master " << i;
          ASSERT_EQ(m[i], RefBf16(want.exp_avg[i])) << "step " << step << " exp_avg " << i;
          ASSERT_EQ(v[i], RefBf16(want.exp_avg_sq[i])) << "step " << step << " exp_avg_sq " << i;
          ASSERT_EQ(param[i], master[i]) << "the 16-bit copy is the new master";
        }
      }
    }
  }
  // A state dtype other than float32 or bfloat16 is refused by name, and nothing is touched.
  GroupBuffers b(64, DType::kFp32, DType::kBf16, true, 3);
  SubGroup g = b.View();
  g.state_dtype = DType::kFp16;
  const std::vector<float> before = b.master;
  const Status st = MakeOptimizer(Isa::kScalar)->UpdateWith(g, c, 1, 1.0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("state dtype float16"), std::string::npos) << st.ToString();
  EXPECT_EQ(b.master, before);
}

TEST(HostOptimizerTest, TheUnfusedSequenceComputesTheSameStepForFp32Gradients) {
  constexpr uint64_t kN = 30'001;
  GroupBuffers fused(kN, DType::kFp32, DType::kBf16, true, 8),
      unfused(kN, DType::kFp32, DType::kBf16, true, 8);
  auto a = MakeOptimizer(Isa::kAuto), b = MakeOptimizer(Isa::kAuto);
  StepOptions so;
  so.loss_scale = 128.0;
  so.max_grad_norm = 0.5;
  for (uint64_t step = 1; step <= 4; ++step) {
    fused.FillGrad(step, 64.0f);
    unfused.FillGrad(step, 64.0f);
    SubGroup ga = fused.View(), gb = unfused.View();
    ASSERT_TRUE(a->Step({&ga, 1}, so).ok());
    ASSERT_TRUE(b->StepUnfused({&gb, 1}, so).ok());
    // fp32 gradients rewritten as g * c then multiplied by 1: the same bits as g * c in the loop.
    ASSERT_TRUE(std::memcmp(fused.master.data(), unfused.master.data(), kN * 4) == 0);
    ASSERT_TRUE(fused.param == unfused.param);
  }
}

TEST(HostOptimizerTest, ConversionsRoundToNearestEvenAndKeepSpecialValues) {
  // lr = 0 and no weight decay: the master is unchanged and the parameter copy is its conversion.
  AdamWConfig c;
  c.lr = 0.0;
  c.weight_decay = 0.0;
  const float inputs[] = {1.0f,
                          std::bit_cast<float>(0x3F808000u),  // bf16 tie, even below: down
                          std::bit_cast<float>(0x3F818000u),  // bf16 tie, odd below: up
                          std::bit_cast<float>(0x3F808001u),  // just above a tie: up
                          std::numeric_limits<float>::max(),  // rounds to bf16 inf
                          1e-40f,
                          -1e-40f,  // fp32 denormals
                          INFINITY,
                          -INFINITY,
                          65504.0f,
                          65520.0f,  // fp16 max, and the first to overflow
                          1e-7f,     // an fp16 denormal (2 * 2^-24)
                          -0.0f,
                          std::bit_cast<float>(0x7F800001u)};  // a signalling NaN: quieted
  const uint16_t want_bf16[] = {0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x0000, 0x8000,
                                0x7F80, 0xFF80, 0x4780, 0x4780, 0x33D7, 0x8000, 0x7FC0};
  const uint16_t want_f16[] = {0x3C00, 0x3C04, 0x3C0C, 0x3C04, 0x7C00, 0x0000, 0x8000,
                               0x7C00, 0xFC00, 0x7BFF, 0x7C00, 0x0002, 0x8000, 0x7E00};
  constexpr size_t kCount = std::size(inputs);
  // Inputs without a zero, denormal or NaN: a block of only these takes the vector paths' fast
  // rounding (no special-case masks), so they get blocks of their own too.
  constexpr size_t kPlain[] = {0, 1, 2, 3, 4, 7, 8, 9, 10, 11};
  // The kernel's loops: two blocks at a time, then one, then a padded tail. [0, 32): every input,
  // two blocks at a time; [32, 64): plain inputs only, two blocks at a time; [64, 80): every input,
  // one block; [80, 80 + kCount): the tail.
  constexpr size_t kTotal = 80 + kCount;
  auto input_at = [&](size_t i) {
    if (i >= 80) return i - 80;
    if (i >= 32 && i < 64) return kPlain[i % std::size(kPlain)];
    return i % kCount;
  };
  for (Isa isa : SupportedIsas()) {
    for (DType pd : {DType::kBf16, DType::kFp16}) {
      SCOPED_TRACE(StrCat(IsaName(isa), " ", DTypeName(pd)));
      GroupBuffers b(kTotal, DType::kFp32, pd, true, 1);
      for (size_t i = 0; i < kTotal; ++i) {
        b.master[i] = inputs[input_at(i)];
        b.SetGrad(i, 0.0f);
      }
      auto opt = MakeOptimizer(isa, 1, c);
      SubGroup g = b.View();
      ASSERT_TRUE(opt->Step({&g, 1}).ok());
      for (size_t i = 0; i < kTotal; ++i) {
        const size_t k = input_at(i);
        uint16_t h;
        std::memcpy(&h, b.param.data() + 2 * i, 2);
        EXPECT_EQ(h, pd == DType::kBf16 ? want_bf16[k] : want_f16[k])
            << "input " << inputs[k] << " at " << i;
      }
    }
  }
}

TEST(HostOptimizerTest, BadOptionsAreRefusedWithTheSettingToChange) {
  auto expect_error = [](HostOptimizerOptions o, const std::string& needle) {
    auto r = HostOptimizer::Create(o);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  HostOptimizerOptions o;
  o.adam.lr = -1;
  expect_error(o, "lr = -1");
  o = {};
  o.adam.beta1 = 1.0;
  expect_error(o, "beta1 = 1 is invalid; use a value in [0, 1)");
  o = {};
  o.adam.beta2 = NAN;
  expect_error(o, "beta2");
  o = {};
  o.adam.eps = 0;
  expect_error(o, "eps = 0");
  o = {};
  o.adam.weight_decay = -0.1;
  expect_error(o, "weight_decay");
  o = {};
  o.chunk_elems = 1000;
  expect_error(o, "multiple of 16");
  o = {};
  o.threads = 5000;
  expect_error(o, "threads = 5000");
  if (!IsaSupported(Isa::kAvx512Bf16)) {
    o = {};
    o.isa = Isa::kAvx512Bf16;
    expect_error(o, "cannot run the avx512_bf16 optimizer path");
  }
  EXPECT_FALSE(ParseIsa("sse9").ok());
  EXPECT_EQ(*ParseIsa("avx2"), Isa::kAvx2);
}

TEST(HostOptimizerTest, BadGroupsAreRefusedAndNothingIsUpdated) {
  auto opt = MakeOptimizer(Isa::kAuto);
  GroupBuffers good(1000, DType::kFp32, DType::kBf16, true, 1);
  GroupBuffers other(1000, DType::kFp32, DType::kBf16, true, 2);
  const GroupBuffers good_before = good;
  auto expect_error = [&](SubGroup bad, const std::string& needle) {
    std::vector<SubGroup> groups = {good.View("good"), bad};
    auto r = opt->Step(groups);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
    EXPECT_TRUE(good.SameState(good_before));  // validation precedes any update
  };
  SubGroup g = other.View("layer7");
  g.numel = 0;
  expect_error(g, "sub-group 'layer7' has numel 0");
  g = other.View("layer7");
  g.exp_avg = nullptr;
  expect_error(g, "has no exp_avg buffer");
  g = other.View("layer7");
  g.exp_avg = g.master + 10;
  expect_error(g, "the master and exp_avg buffers overlap");
  g = other.View("layer7");
  g.param = const_cast<void*>(g.grad);
  expect_error(g, "the grad and param buffers overlap");
  g = other.View("layer7");
  g.grad_dtype = static_cast<DType>(9);
  expect_error(g, "unknown dtype");

  StepOptions so;
  so.loss_scale = 0;
  SubGroup ok = good.View();
  auto r = opt->Step({&ok, 1}, so);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("loss_scale = 0"), std::string::npos);
  so = {};
  so.max_grad_norm = -1;
  EXPECT_FALSE(opt->Step({&ok, 1}, so).ok());
  EXPECT_TRUE(good.SameState(good_before));
  EXPECT_EQ(opt->step(), 0u);

  // A plan from the future (or a forged one) is refused.
  StepReport forged;
  forged.step = 5;
  auto st = opt->Update(ok, forged);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("pass the StepReport that Plan returned"), std::string::npos);
  EXPECT_FALSE(opt->SetLearningRate(-1).ok());
  EXPECT_TRUE(opt->SetLearningRate(1e-4).ok());
  EXPECT_EQ(opt->config().lr, 1e-4);
}

TEST(HostOptimizerTest, TheBestPathIsChosenFromCpuidAtRunTime) {
  auto opt = MakeOptimizer(Isa::kAuto);
  EXPECT_EQ(opt->isa(), BestIsa());
  const CpuFeatures& f = DetectCpu();
  // /proc/cpuinfo is the kernel's view of the same CPUID bits.
  std::FILE* cpuinfo = std::fopen("/proc/cpuinfo", "r");
  ASSERT_NE(cpuinfo, nullptr);
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), cpuinfo)) > 0) text.append(buf, n);
  std::fclose(cpuinfo);
  const size_t end = text.find("\n\n");
  const std::string first = text.substr(0, end);
  auto has = [&](const char* flag) {
    return first.find(StrCat(" ", flag, " ")) != std::string::npos ||
           first.find(StrCat(" ", flag, "\n")) != std::string::npos;
  };
  EXPECT_EQ(f.avx2, has("avx2"));
  EXPECT_EQ(f.avx512f, has("avx512f"));
  EXPECT_EQ(f.avx512_bf16, has("avx512_bf16"));
  EXPECT_EQ(f.f16c, has("f16c"));
}

}  // namespace
}  // namespace spillway::engine
