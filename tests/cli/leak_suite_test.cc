// The leak suite's own rules: how growth is computed from the samples, and that bad requests are
// refused. The scenarios themselves run as ctest label `leak` (one `spillway leak-suite` each).
#include "spillway/cli/leak_suite.h"

#include <gtest/gtest.h>

namespace spillway::cli {
namespace {

TEST(LeakSuiteTest, BoundaryGrowthIsLastMinusFirstBoundaryPerEpoch) {
  LeakSeries s;
  s.Add(0, 0, true, 100);
  s.Add(1, 1, false, 500);  // transient peaks do not count here
  s.Add(1, 1, true, 110);
  s.Add(2, 2, false, 900);
  s.Add(2, 2, true, 130);
  EXPECT_DOUBLE_EQ(s.BoundaryGrowthPerEpoch(), 15.0);
  LeakSeries flat;
  flat.Add(0, 0, true, 7);
  EXPECT_DOUBLE_EQ(flat.BoundaryGrowthPerEpoch(), 0.0);
}

TEST(LeakSuiteTest, PeakGrowthIsEachEpochsPeakOverItsStart) {
  LeakSeries s;
  s.Add(0, 0, true, 100);
  s.Add(1, 1, false, 150);
  s.Add(2, 1, false, 140);
  s.Add(2, 1, true, 100);
  s.Add(3, 2, false, 130);
  s.Add(3, 2, true, 100);
  EXPECT_DOUBLE_EQ(s.PeakGrowthPerEpoch(), (50.0 + 30.0) / 2);
}

TEST(LeakSuiteTest, EveryScenarioOfTheIssueIsRegisteredInOrder) {
  const char* want[] = {"fork-cow",        "pinned-pow2",    "bounce-leak",
                        "swapped-alive",   "engine-rebuild", "epoch-checkpoint",
                        "accum-remainder", "step-exception", "budget-pressure"};
  const auto& all = LeakScenarios();
  ASSERT_EQ(all.size(), 9u);
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_STREQ(all[i].name, want[i]);
    EXPECT_TRUE(all[i].start != nullptr || all[i].unavailable != nullptr) << all[i].name;
  }
}

TEST(LeakSuiteTest, UnknownScenariosAndUnwritableDirectoriesAreRefused) {
  LeakSuiteOptions o;
  o.out_dir = ::testing::TempDir() + "/leak-refused";
  auto r = RunLeakSuite(o, {"fork-cw"});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'fork-cw' is not a scenario; choose from fork-cow"),
            std::string::npos);
  o.out_dir = "/proc/leak-suite";
  r = RunLeakSuite(o, {"fork-cow"});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("pass a writable directory"), std::string::npos);
}

}  // namespace
}  // namespace spillway::cli
