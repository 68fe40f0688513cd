// Tiers: the storage a config describes, as `spillway train` and spillway.engine compose it.
#include "spillway/offload/tiers.h"

#include <gtest/gtest.h>

#include "store_test_util.h"

namespace spillway::offload {
namespace {

using testing::OffloadJson;
using testing::ParseOrDie;

TEST(TiersTest, NvmeIsMadeWhereTheConfigPlacesSomethingAndToSpillCpuOffload) {
  auto with = Tiers::Create(ParseOrDie(OffloadJson("nvme", "cpu")));
  ASSERT_TRUE(with.ok()) << with.status().ToString();
  EXPECT_NE((*with)->host, nullptr);
  EXPECT_NE((*with)->io, nullptr);
  EXPECT_NE((*with)->nvme, nullptr);
  EXPECT_NE((*with)->store, nullptr);

  // cpu offload: a spill arena (an empty swap file until the host budget is full).
  auto spill = Tiers::Create(
      ParseOrDie(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "cpu"}}, "spillway": {"spill_path": ")" +
                 allocator::testing::NvmeTestDir() + R"("}})"));
  ASSERT_TRUE(spill.ok()) << spill.status().ToString();
  ASSERT_NE((*spill)->nvme, nullptr);
  EXPECT_EQ((*spill)->nvme->Stats().capacity_bytes, 0u) << "nothing is written before a spill";

  auto without = Tiers::Create(ParseOrDie(OffloadJson("none", "none")));
  ASSERT_TRUE(without.ok()) << without.status().ToString();
  EXPECT_EQ((*without)->nvme, nullptr);
  EXPECT_NE((*without)->store, nullptr);
}

TEST(TiersTest, ASpillPathThatCannotHoldASwapFileIsNamed) {
  auto t = Tiers::Create(
      ParseOrDie(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
      "spillway": {"spill_path": "/proc/spillway-cannot-be-here"}})"));
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find(
                "the spill arena in /proc/spillway-cannot-be-here (spillway.spill_path)"),
            std::string::npos)
      << t.status().ToString();
}

TEST(TiersTest, TheStoreReportsToTheOneLedger) {
  auto t = Tiers::Create(ParseOrDie(OffloadJson("nvme", "nvme")));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto id = (*t)->store->Register({0, 0, StateKind::kMasterWeight}, 4 << 20);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  {
    auto h = (*t)->store->Acquire(*id);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
  }
  ASSERT_TRUE((*t)->store->Flush().ok());
  ASSERT_TRUE((*t)->ledger.BeginEpoch(1).ok());
  allocator::BoundaryReport report;
  ASSERT_TRUE((*t)->ledger.EndEpoch(&report).ok());
  const uint64_t live = report.live_bytes();
  EXPECT_GT(live, 0u) << "the registered partition's state lives in a tier of the ledger";
}

TEST(TiersTest, AFailingTierIsNamed) {
  const std::string json = R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
      "nvme_path": "/proc/spillway-cannot-be-here"}}})";
  auto t = Tiers::Create(ParseOrDie(json));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message().rfind("NVMe arena", 0), 0u) << t.status().ToString();
}

}  // namespace
}  // namespace spillway::offload
