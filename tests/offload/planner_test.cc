// The capacity planner against numbers computed by hand (in the comments), including Yi-34B on one
// 8-GPU node: the run fits in steady state, does not fit with DeepSpeed's end-of-epoch gather plus
// the copy-on-write of a DataLoader fork, and fits with Spillway's streamed save and fork-safe
// arena. The trainer's plan against measured runs is tests/cli/plan_vs_run_test.cc.
#include "spillway/offload/planner.h"

#include <gtest/gtest.h>

#include <cstdio>

#include "spillway/base/bytes.h"

namespace spillway::offload {
namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kTiB = 1ull << 40;

Config Parse(const std::string& json) {
  auto c = Config::Parse(json);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : Config{};
}

bool Mentions(const PlanReport& r, const std::string& needle) {
  for (const std::string& s : r.suggestions) {
    if (s.find(needle) != std::string::npos) return true;
  }
  return false;
}

TEST(PlannerTest, Yi34BOnOneEightGpuNodeWithCpuOffload) {
  PlanInput in;
  in.params = 34e9;
  in.world_size = 8;
  in.nodes = 1;
  in.host_ram_bytes = kTiB;
  in.nvme_bytes = 4 * kTiB;
  in.config = Parse(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu", "pin_memory": true},
      "offload_optimizer": {"device": "cpu", "pin_memory": true}}})");
  auto r = MakePlan(in);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  // Per rank p = 34e9 / 8 = 4.25e9 elements. Pinned (torch's cudaHostAlloc): the 16-bit parameter
  // buffer 2p, the 16-bit gradient partitions 2p, the fp32 gradients 4p = 34e9 B. Pageable even
  // with pin_memory: fp32 master, exp_avg, exp_avg_sq 4p each = 51e9 B. 85e9 per rank, 680e9 per
  // node.
  ASSERT_EQ(r->lines.size(), 6u);
  EXPECT_EQ(r->per_rank[static_cast<int>(Place::kHostPinned)], 34'000'000'000u);
  EXPECT_EQ(r->per_rank[static_cast<int>(Place::kHostPageable)], 51'000'000'000u);
  EXPECT_EQ(r->per_node[static_cast<int>(Place::kGpu)], 0u);
  EXPECT_EQ(r->host_steady_per_node, 680'000'000'000u);
  EXPECT_EQ(r->host_by_kind_per_rank[static_cast<size_t>(allocator::Kind::kGrad)], 25'500'000'000u);
  EXPECT_EQ(r->host_by_kind_per_rank[static_cast<size_t>(allocator::Kind::kOptimizerState)],
            34'000'000'000u);
  // DeepSpeed: + full 16-bit model on node 0 (2 x 34e9 = 68e9) + the fork's copy of every private
  // page, the pageable 8 x 51e9 = 408e9 (the pinned ones are a shared mapping): 1156e9 B > 1 TiB
  // (1099.5e9 B).
  EXPECT_EQ(r->checkpoint_gather_bytes, 68'000'000'000u);
  EXPECT_EQ(r->fork_extra_naive_per_node, 408'000'000'000u);
  EXPECT_EQ(r->host_peak_naive_per_node, 1'156'000'000'000u);
  EXPECT_FALSE(r->naive_fits);
  // Spillway: + 8 ranks x 1 MiB blocks x queue depth 8 = 67,108,864 B; no fork copy.
  EXPECT_EQ(r->checkpoint_streamed_bytes, 67'108'864u);
  EXPECT_EQ(r->fork_extra_spillway_per_node, 0u);
  EXPECT_EQ(r->host_peak_spillway_per_node, 680'067'108'864u);
  EXPECT_TRUE(r->fits);
  EXPECT_EQ(r->host_headroom, static_cast<int64_t>(kTiB) - 680'067'108'864);
  EXPECT_TRUE(r->suggestions.empty());
  const std::string table = r->ToString();
  EXPECT_NE(table.find("verdict: fits"), std::string::npos) << table;
  std::printf("%s", table.c_str());
  EXPECT_NE(table.find("DeepSpeed defaults 1156.0 GB (does not fit)"), std::string::npos) << table;
}

TEST(PlannerTest, OnDeepSpeedsCpuAcceleratorEveryHostByteIsPrivateAndTheKindsAreTheMeasuredOnes) {
  // The run of tests/python/test_deepspeed_host.py (DeepSpeed 0.19.8, CPU accelerator, bf16,
  // ZeRO-3 offload_optimizer + offload_param cpu, pin_memory true, 8,471,560 parameters) measured
  // in Spillway's arena, by kind: param 16,943,120 B, grad 50,829,360, master_weight 33,886,240,
  // optimizer_state 67,772,480 (20 B per parameter; state at the fork: 20.0 B/param).
  PlanInput in;
  in.params = 8'471'560;
  in.host_ram_bytes = 64 * kGiB;
  in.accelerator = Accelerator::kCpu;
  in.config = Parse(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu", "pin_memory": true},
      "offload_optimizer": {"device": "cpu", "pin_memory": true}}})");
  auto r = MakePlan(in);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  using allocator::Kind;
  const auto& k = r->host_by_kind_per_rank;
  EXPECT_EQ(k[static_cast<size_t>(Kind::kParam)], 16'943'120u);
  EXPECT_EQ(k[static_cast<size_t>(Kind::kGrad)], 50'829'360u);
  EXPECT_EQ(k[static_cast<size_t>(Kind::kMasterWeight)], 33'886'240u);
  EXPECT_EQ(k[static_cast<size_t>(Kind::kOptimizerState)], 67'772'480u);
  // The CPU accelerator pins nothing: the fork copies all 20 B per parameter.
  EXPECT_EQ(r->per_rank[static_cast<int>(Place::kHostPinned)], 0u);
  EXPECT_EQ(r->fork_extra_naive_per_node, 169'431'200u);
  // On CUDA the pinned 8 B per parameter are a shared mapping: 12 B per parameter copied.
  in.accelerator = Accelerator::kCuda;
  auto cuda = MakePlan(in);
  ASSERT_TRUE(cuda.ok());
  EXPECT_EQ(cuda->fork_extra_naive_per_node, 101'658'720u);
}

TEST(PlannerTest, AModelThatDoesNotFitItsGpusIsRefusedWithTheOffloadThatFits) {
  // Yi-34B on 8 GPUs without offload: per GPU 16-bit params 2p + 16-bit grads 2p + fp32 master and
  // moments 12p = 16 x 4.25e9 = 68e9 B; an 80 GB GPU less its 25% reserve holds 60e9.
  PlanInput in;
  in.params = 34e9;
  in.world_size = 8;
  in.host_ram_bytes = 2 * kTiB;
  in.gpu_mem_bytes = 80'000'000'000;
  in.config = Parse(R"({"zero_optimization": {"stage": 3}})");
  auto r = MakePlan(in);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->gpu_per_rank, 68'000'000'000u);
  EXPECT_EQ(r->gpu_reserve_bytes, 20'000'000'000u);
  EXPECT_EQ(r->gpu_headroom, -8'000'000'000);
  EXPECT_FALSE(r->fits);
  EXPECT_NE(r->ToString().find("does not fit"), std::string::npos);
  // The optimizer on the host leaves the 16-bit params, 2p = 8.5e9 B, per GPU, and the host holds
  // the rest: 16-bit and fp32 gradients, master and moments, 18p = 76.5e9 per rank, 612e9 < 2 TiB.
  EXPECT_TRUE(Mentions(*r, "offload_optimizer.device = \"cpu\""));
  // Without the GPU given, the GPU is not judged (the CLI passes what it sees, else 80 GB).
  in.gpu_mem_bytes = 0;
  EXPECT_TRUE(MakePlan(in)->fits);
}

TEST(PlannerTest, TheTrainersPlanPartitionsEachUnitAndStreamsItsSaveOneSlotAtATime) {
  // Two units of 10 and 7 elements on 4 ranks: 3 + 2 = 5 elements per rank (padded per unit).
  PlanInput in;
  in.params = 17;
  in.world_size = 4;
  in.host_ram_bytes = kGiB;
  in.nvme_bytes = kGiB;
  in.runtime = Runtime::kTrainer;
  in.trainer_units = {10, 7};
  in.config = Parse(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
      "aio": {"block_size": 1048576}})");
  auto r = MakePlan(in);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  using allocator::Kind;
  const auto& host = r->host_by_kind_per_rank;
  const auto& nvme = r->nvme_by_kind_per_rank;
  // Host: cached params and grads 20 B each, the bounce pool 8 x 1 MiB and the transfer pipeline's
  // staging ring 4 x 1 MiB (params on NVMe reach the device through it); the optimizer's state
  // streams. NVMe: every state, 4 x 5 B each, the moments twice.
  EXPECT_EQ(host[static_cast<size_t>(Kind::kParam)], 20u);
  EXPECT_EQ(host[static_cast<size_t>(Kind::kGrad)], 20u);
  EXPECT_EQ(host[static_cast<size_t>(Kind::kMasterWeight)], 0u);
  EXPECT_EQ(host[static_cast<size_t>(Kind::kSwapBuffer)], 12u << 20);  // + the pipeline's 4 x 1 MiB
  EXPECT_EQ(nvme[static_cast<size_t>(Kind::kOptimizerState)], 40u);
  EXPECT_EQ(r->nvme_per_node, 4u * (20 + 20 + 20 + 40));
  // The save brings in one optimizer partition at a time: the largest, 3 elements x 4 B, per rank.
  EXPECT_EQ(r->checkpoint_streamed_bytes, 4u * 12);
  EXPECT_EQ(r->checkpoint_gather_bytes, 68u);
  // spillway.bounce_buffers sizes the engine's pool: 2 x 1 MiB + the pipeline's 4 x 1 MiB.
  PlanInput two = in;
  two.config.spillway.bounce_buffers = 2;
  auto r2 = MakePlan(two);
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  EXPECT_EQ(r2->host_by_kind_per_rank[static_cast<size_t>(Kind::kSwapBuffer)], 6u << 20);
  // Units that do not add up to --params are refused.
  in.trainer_units = {10, 8};
  EXPECT_NE(MakePlan(in).status().message().find("not --params"), std::string::npos);
}

TEST(PlannerTest, OptimizerOnNvmeWithATightHostSuggestsWhatFits) {
  PlanInput in;
  in.params = 34e9;
  in.world_size = 8;
  in.host_ram_bytes = 256 * kGiB;  // 274.9e9 B
  in.nvme_bytes = 4 * kTiB;
  in.config = Parse(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})");
  auto r = MakePlan(in);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  // Per rank: pinned: the 16-bit parameter buffer 2p = 8.5e9 (DeepSpeed always pins it) and the
  // swap buffers 4 x min(1e9, 4.25e9) x 4 B = 16e9; pageable: the 16-bit gradient partitions
  // 8.5e9 and one sub-group's fp32 gradient 4e9. 37e9 per rank, 296e9 per node > 274.9e9.
  // NVMe: 12 x 4.25e9 x 8 = 408e9.
  EXPECT_EQ(r->per_rank[static_cast<int>(Place::kHostPinned)], 24'500'000'000u);
  EXPECT_EQ(r->per_rank[static_cast<int>(Place::kHostPageable)], 12'500'000'000u);
  EXPECT_EQ(r->nvme_per_node, 408'000'000'000u);
  EXPECT_FALSE(r->fits);
  EXPECT_LT(r->host_headroom, 0);
  // sub_group_size 1e8: pool 1.6e9, gradient 0.4e9 -> 19e9 per rank, 152e9 per node: fits.
  EXPECT_TRUE(Mentions(*r, "sub_group_size = 1e8"));
  // buffer_count 2: pool 8e9 -> 29e9 per rank, 232e9 per node: fits.
  EXPECT_TRUE(Mentions(*r, "buffer_count = 2"));
  // params to nvme too: 2e9 kept in CPU + 1e9 swap buffers instead of 8.5e9 -> 31.5e9 per rank,
  // 252e9 per node: fits.
  EXPECT_TRUE(Mentions(*r, "offload_param.device = \"nvme\":"));
  // The optimizer back on the host does not: 85e9 per rank.
  EXPECT_FALSE(Mentions(*r, "offload_optimizer.device = \"cpu\""));
  // Two nodes: 4 ranks x 37e9 = 148e9 per node: fits.
  EXPECT_TRUE(Mentions(*r, "--nodes 2"));
}

TEST(PlannerTest, WithoutForkSafetyTheForkCopyCountsForSpillwayToo) {
  PlanInput in;
  in.params = 1e9;
  in.world_size = 1;
  in.host_ram_bytes = 64 * kGiB;
  in.config = Parse(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                       "spillway": {"fork_safety": "inherit"}})");
  auto r = MakePlan(in);
  ASSERT_TRUE(r.ok());
  // Host: 16-bit and fp32 gradients + master + moments = 18e9 B; the fork copies all of it.
  EXPECT_EQ(r->host_steady_per_node, 18'000'000'000u);
  EXPECT_EQ(r->fork_extra_spillway_per_node, 18'000'000'000u);
}

TEST(PlannerTest, ImpossibleInputsNameTheFlag) {
  PlanInput in;
  in.params = 7e9;
  in.world_size = 8;
  in.nodes = 3;
  in.host_ram_bytes = kTiB;
  auto r = MakePlan(in);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--world-size 8 must be a positive multiple of --nodes 3"),
            std::string::npos);
  in.nodes = 1;
  in.params = 0;
  EXPECT_NE(MakePlan(in).status().message().find("--params"), std::string::npos);
  in.params = 7e9;
  in.host_ram_bytes = 0;
  EXPECT_NE(MakePlan(in).status().message().find("--host-ram"), std::string::npos);
  in.host_ram_bytes = kTiB;
  in.config = Parse(
      R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}})");
  EXPECT_NE(MakePlan(in).status().message().find("--nvme is 0"), std::string::npos);
}

TEST(PlannerTest, PhasePeaksFollowTheNoteOnTheCpuAccelerator) {
  // Note [Phase peaks], by hand: 24M parameters on 2 ranks (p = 12M each), ZeRO-3 cpu/cpu, an fp32
  // safetensors checkpoint loaded under zero.Init, a rank baseline of 200 MiB, DeepSpeed's default
  // gradient bucket (5e8 elements), largest tensor 4M, 2 DataLoader workers per rank.
  constexpr uint64_t kMiB = 1 << 20;
  PlanInput in;
  in.params = 24e6;
  in.world_size = 2;
  in.host_ram_bytes = 64 * kGiB;
  in.accelerator = Accelerator::kCpu;
  in.config = Parse(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu", "pin_memory": true},
      "offload_optimizer": {"device": "cpu", "pin_memory": true}}})");
  in.phases.rank_baseline_bytes = 200 * kMiB;
  in.phases.largest_tensor = 4'000'000;
  auto r = MakePlan(in);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->phases.size(), 5u);
  // load: baseline + client runtime + partitions 2p (24 MB) + the model built whole, 4P (96 MB).
  const uint64_t load = 200 * kMiB + kClientRuntimeBytes + 24'000'000 + 96'000'000;
  EXPECT_EQ(r->phases[0].rank0, load);
  // initialize: + 16-bit grads 2p, fp32 grads 4p, master 4p (120 MB) + the engine's runtime.
  const uint64_t init = load + 120'000'000 + kEngineRuntimeBytes;
  EXPECT_EQ(r->phases[1].other_rank, init);
  // steady: + moments 8p (96 MB) + the bucket's touched pages 2P (48 MB) + retained transients
  // 5/6 x 3 x 2P (120 MB) + what the one line's peak slack lets the cache keep beyond the arena's
  // need at its peak, 5% of (240 MB state + 1 GB bucket reserved + 144 MB transients): 69.2 MB;
  // together under the cap 0.25 x (240 MB state + 1 GB bucket).
  static_assert(kOneLineHostPeakSlack == 0.05);
  const uint64_t naive_steady = init + 96'000'000 + 48'000'000 + 120'000'000;
  const uint64_t steady = naive_steady + 69'200'000;
  // The boundary with Spillway: + its checkpoint writer's buffers (held from the first save on).
  EXPECT_EQ(r->phases[2].other_rank, steady + 2 * kDataLoaderWorkerBytes + kCheckpointWriterBytes);
  // The boundary without Spillway copies every private byte of the state (240 MB per rank); its
  // transients are torch's allocator's, with no peak slack.
  EXPECT_EQ(r->phases[2].naive_node, 2 * (naive_steady + 2 * kDataLoaderWorkerBytes + 240'000'000));
  // checkpoint: the I/O window (8 x 1 MiB) and the checkpoint writer on every rank, the 16-bit
  // largest tensor on rank 0.
  EXPECT_EQ(r->phases[3].rank0, steady + 8 * kMiB + kCheckpointWriterBytes + 8'000'000);
  EXPECT_EQ(r->phases[3].other_rank, steady + 8 * kMiB + kCheckpointWriterBytes);
  // final save: Spillway streams the largest tensor; DeepSpeed gathers the 16-bit model (2P).
  EXPECT_EQ(r->phases[4].node, 2 * (steady + kCheckpointWriterBytes) + 8'000'000);
  EXPECT_EQ(r->phases[4].naive_node, 2 * naive_steady + 48'000'000);
  // Loaded whole, the mapped checkpoint adds nothing anonymous; a .bin under zero.Init adds
  // 3/8 of its bytes (the middle of the heap's measured share of torch.load's reads).
  in.phases.load = ModelLoad::kWhole;
  EXPECT_EQ(MakePlan(in)->phases[0].rank0, 200 * kMiB + kClientRuntimeBytes);
  in.phases.load = ModelLoad::kZeroInit;
  in.phases.torch_bin = true;
  EXPECT_EQ(MakePlan(in)->phases[0].rank0, load + 36'000'000);
  // Admission's view at initialize: the level includes the model; partitioned by zero.Init it
  // holds the 16-bit partitions already, whole it does not (initialize makes them, 24 MB).
  in.phases.torch_bin = false;
  in.phases.load = ModelLoad::kLoaded;
  const uint64_t level = 200 * kMiB;
  EXPECT_EQ(MakePlan(in)->phases[1].rank0, level + 120'000'000 + kEngineRuntimeBytes);
  in.phases.load = ModelLoad::kLoadedWhole;
  EXPECT_EQ(MakePlan(in)->phases[1].rank0, level + 144'000'000 + kEngineRuntimeBytes);
  // The verdict needs every phase within host RAM: the steady state alone (480 MB on the node)
  // fits 1.2 GB, the epoch boundary (1.9 GB on the node) does not.
  in.phases.load = ModelLoad::kZeroInit;
  in.host_ram_bytes = 1'200'000'000;
  auto tight = MakePlan(in);
  ASSERT_TRUE(tight.ok());
  EXPECT_FALSE(tight->fits);
  in.phases.rank_baseline_bytes = 0;
  EXPECT_TRUE(MakePlan(in)->fits);
  // No baseline, no phases.
  EXPECT_TRUE(MakePlan(in)->phases.empty());
}

TEST(PlannerTest, PhaseInputsThatCannotBeNameTheFlag) {
  PlanInput in;
  in.params = 24e6;
  in.host_ram_bytes = 64 * kGiB;
  in.phases.rank_baseline_bytes = 1 << 28;
  in.phases.checkpoint_dtype_bytes = 8;
  EXPECT_NE(MakePlan(in).status().message().find("--checkpoint-dtype has 8 bytes"),
            std::string::npos);
  in.phases.checkpoint_dtype_bytes = 2;
  in.phases.largest_tensor = 25'000'000;
  EXPECT_NE(MakePlan(in).status().message().find("--largest-tensor 25000000 is more than --params"),
            std::string::npos);
  in.phases.largest_tensor = 0;
  in.phases.dataloader_workers = 2000;
  EXPECT_NE(MakePlan(in).status().message().find("--dataloader-workers 2000 is more than 1024"),
            std::string::npos);
  in.phases.dataloader_workers = 2;
  in.phases.rank_baseline_bytes = 2ull << 40;
  EXPECT_NE(MakePlan(in).status().message().find("--rank-baseline must be at most 1 TiB"),
            std::string::npos);
  in.phases.rank_baseline_bytes = 1 << 28;
  in.runtime = Runtime::kTrainer;
  in.trainer_units = {24'000'000};
  EXPECT_NE(MakePlan(in).status().message().find("--rank-baseline plans a DeepSpeed run's phases"),
            std::string::npos);
}

}  // namespace
}  // namespace spillway::offload
