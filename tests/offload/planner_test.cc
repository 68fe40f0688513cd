// The capacity planner against numbers computed by hand (in the comments), including Yi-34B on one
// 8-GPU node: the run fits in steady state, does not fit with DeepSpeed's end-of-epoch gather plus
// the copy-on-write of a DataLoader fork, and fits with Spillway's streamed save and fork-safe arena.
#include "spillway/offload/planner.h"

#include <gtest/gtest.h>

#include <cstdio>

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
  // Per rank p = 34e9 / 8 = 4.25e9 elements: params 2p = 8.5e9 B; fp32 grads, master, exp_avg,
  // exp_avg_sq 4p = 17e9 B each; all pinned host: 76.5e9 B per rank, 612e9 B per node.
  ASSERT_EQ(r->lines.size(), 5u);
  EXPECT_EQ(r->lines[0].bytes_per_rank, 8'500'000'000u);
  for (size_t i = 1; i < 5; ++i) EXPECT_EQ(r->lines[i].bytes_per_rank, 17'000'000'000u) << i;
  EXPECT_EQ(r->per_rank[static_cast<int>(Place::kHostPinned)], 76'500'000'000u);
  EXPECT_EQ(r->per_node[static_cast<int>(Place::kGpu)], 0u);
  EXPECT_EQ(r->host_steady_per_node, 612'000'000'000u);
  // DeepSpeed: + full 16-bit model on node 0 (2 x 34e9 = 68e9) + the fork's copy of every host
  // page (612e9) = 1292e9 B > 1 TiB (1099.5e9 B).
  EXPECT_EQ(r->checkpoint_gather_bytes, 68'000'000'000u);
  EXPECT_EQ(r->fork_extra_naive_per_node, 612'000'000'000u);
  EXPECT_EQ(r->host_peak_naive_per_node, 1'292'000'000'000u);
  EXPECT_FALSE(r->naive_fits);
  // Spillway: + 8 ranks x 1 MiB blocks x queue depth 8 = 67,108,864 B; no fork copy.
  EXPECT_EQ(r->checkpoint_streamed_bytes, 67'108'864u);
  EXPECT_EQ(r->fork_extra_spillway_per_node, 0u);
  EXPECT_EQ(r->host_peak_spillway_per_node, 612'067'108'864u);
  EXPECT_TRUE(r->fits);
  EXPECT_EQ(r->host_headroom, static_cast<int64_t>(kTiB) - 612'067'108'864);
  EXPECT_TRUE(r->suggestions.empty());
  const std::string table = r->ToString();
  EXPECT_NE(table.find("verdict: fits"), std::string::npos) << table;
  std::printf("%s", table.c_str());
  EXPECT_NE(table.find("DeepSpeed defaults 1292.0 GB (does not fit)"), std::string::npos) << table;
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
  // Per rank: swap buffers 4 x min(1e9, 4.25e9) x 4 B = 16e9 pinned; params 8.5e9 and fp32 grads
  // 17e9 pageable: 41.5e9 per rank, 332e9 per node > 274.9e9. NVMe: 12 x 4.25e9 x 8 = 408e9.
  EXPECT_EQ(r->per_rank[static_cast<int>(Place::kHostPinned)], 16'000'000'000u);
  EXPECT_EQ(r->per_rank[static_cast<int>(Place::kHostPageable)], 25'500'000'000u);
  EXPECT_EQ(r->nvme_per_node, 408'000'000'000u);
  EXPECT_FALSE(r->fits);
  EXPECT_LT(r->host_headroom, 0);
  // sub_group_size 1e8: pool 1.6e9 -> 27.1e9 per rank, 216.8e9 per node: fits.
  EXPECT_TRUE(Mentions(*r, "sub_group_size = 1e8"));
  // buffer_count 2: pool 8e9 -> 33.5e9 per rank, 268e9 per node: fits.
  EXPECT_TRUE(Mentions(*r, "buffer_count = 2"));
  // params to nvme alone: pools 1e9 pinned + 2e9 kept in CPU -> 36e9 per rank, 288e9: does not.
  EXPECT_FALSE(Mentions(*r, "offload_param.device = \"nvme\":"));
  // Two nodes: 4 ranks x 41.5e9 = 166e9 per node: fits.
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
  // Host: fp32 grads + master + moments = 16e9 B; the fork copies all of it.
  EXPECT_EQ(r->host_steady_per_node, 16'000'000'000u);
  EXPECT_EQ(r->fork_extra_spillway_per_node, 16'000'000'000u);
}

TEST(PlannerTest, ImpossibleInputsNameTheFlag) {
  PlanInput in;
  in.params = 7e9;
  in.world_size = 8;
  in.nodes = 3;
  in.host_ram_bytes = kTiB;
  auto r = MakePlan(in);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--world-size 8 must be a positive multiple of --nodes 3"), std::string::npos);
  in.nodes = 1;
  in.params = 0;
  EXPECT_NE(MakePlan(in).status().message().find("--params"), std::string::npos);
  in.params = 7e9;
  in.host_ram_bytes = 0;
  EXPECT_NE(MakePlan(in).status().message().find("--host-ram"), std::string::npos);
  in.host_ram_bytes = kTiB;
  in.config = Parse(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}})");
  EXPECT_NE(MakePlan(in).status().message().find("--nvme is 0"), std::string::npos);
}

}  // namespace
}  // namespace spillway::offload
