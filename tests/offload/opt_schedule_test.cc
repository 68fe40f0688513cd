// OptSchedule alone: the distance to each partition's next use, the cursor, the prefetch window,
// and bad input. The distances are checked against a brute-force scan of the repeating order.
#include "spillway/offload/opt_schedule.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace spillway::offload {
namespace {

// How many positions after `cursor` the next use of `id` is, scanning the repeating order.
uint64_t ScanDistance(const std::vector<PartitionId>& order, uint64_t cursor, PartitionId id) {
  for (uint64_t k = 1; k <= order.size(); ++k) {
    if (order[(cursor + k) % order.size()] == id) return k;
  }
  return order.size() + 1;
}

TEST(OptScheduleTest, TheFirstUseIsOneAwayAndAnUnscheduledPartitionIsFurthest) {
  OptSchedule s;
  ASSERT_TRUE(s.Set({0, 1, 2, 3}, 5).ok());
  EXPECT_EQ(s.NextUseDistance(0), 1u);
  EXPECT_EQ(s.NextUseDistance(1), 2u);
  EXPECT_EQ(s.NextUseDistance(3), 4u);
  EXPECT_EQ(s.NextUseDistance(4), 5u);   // registered, never used: spilled first
  EXPECT_EQ(s.NextUseDistance(99), 5u);  // registered after the schedule was set
  EXPECT_TRUE(s.Validate().ok());
}

TEST(OptScheduleTest, AdvanceMovesTheCursorToTheNearestUseOfAPartitionUsedTwice) {
  OptSchedule s;
  ASSERT_TRUE(s.Set({0, 1, 0, 2}, 3).ok());
  s.Advance(0);
  EXPECT_EQ(s.cursor(), 0u);
  EXPECT_EQ(s.NextUseDistance(0), 2u);  // its second use, two positions on
  s.Advance(1);
  s.Advance(0);
  EXPECT_EQ(s.cursor(), 2u);
  EXPECT_EQ(s.NextUseDistance(0), 2u);  // wraps round to position 0
  EXPECT_EQ(s.NextUseDistance(2), 1u);
  s.Advance(7);  // not in the schedule: the cursor stays
  EXPECT_EQ(s.cursor(), 2u);
  EXPECT_TRUE(s.Validate().ok());
}

TEST(OptScheduleTest, DistancesMatchAScanOfTheRepeatingOrderAtEveryStep) {
  std::mt19937 rng(23);
  for (int trial = 0; trial < 200; ++trial) {
    const uint64_t partitions = 1 + rng() % 12;
    std::vector<PartitionId> order(1 + rng() % 30);
    for (PartitionId& id : order) id = static_cast<PartitionId>(rng() % partitions);
    OptSchedule s;
    ASSERT_TRUE(s.Set(order, partitions + 1).ok());
    for (int step = 0; step < 50; ++step) {
      for (PartitionId id = 0; id <= partitions; ++id) {
        ASSERT_EQ(s.NextUseDistance(id), ScanDistance(order, s.cursor(), id))
            << "trial " << trial << " step " << step << " partition " << id;
      }
      // Use the partition whose turn it is, as a training step does.
      s.Advance(order[(s.cursor() + 1) % order.size()]);
      ASSERT_TRUE(s.Validate().ok());
    }
  }
}

TEST(OptScheduleTest, UpcomingIsTheWindowAfterTheCursorAndNeverTheCursorItself) {
  OptSchedule s;
  ASSERT_TRUE(s.Set({5, 6, 7, 8}, 9).ok());
  std::vector<PartitionId> next;
  s.Upcoming(2, &next);
  EXPECT_EQ(next, (std::vector<PartitionId>{5, 6}));
  s.Advance(7);
  s.Upcoming(10, &next);  // at most size() - 1: the cursor's own partition is in use
  EXPECT_EQ(next, (std::vector<PartitionId>{8, 5, 6}));
  s.Upcoming(0, &next);
  EXPECT_TRUE(next.empty());
}

TEST(OptScheduleTest, AnEmptyScheduleHasNoCursorNoWindowAndEveryDistanceOne) {
  OptSchedule s;
  EXPECT_EQ(s.NextUseDistance(0), 1u);
  s.Advance(0);
  std::vector<PartitionId> next{1};
  s.Upcoming(4, &next);
  EXPECT_TRUE(next.empty());
  ASSERT_TRUE(s.Set({1, 2}, 3).ok());
  ASSERT_TRUE(s.Set({}, 3).ok());  // cleared
  EXPECT_EQ(s.size(), 0u);
  EXPECT_FALSE(s.Has(1));
  EXPECT_TRUE(s.Validate().ok());
}

TEST(OptScheduleTest, AnUnknownPartitionIsRefusedByNameAndTheOldScheduleStays) {
  OptSchedule s;
  ASSERT_TRUE(s.Set({0, 1, 2}, 3).ok());
  s.Advance(1);
  const Status st = s.Set({0, 3, 1}, 3);
  ASSERT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("partition 3 is not registered"), std::string::npos) << st.ToString();
  EXPECT_EQ(s.order(), (std::vector<PartitionId>{0, 1, 2}));
  EXPECT_EQ(s.cursor(), 1u);
  EXPECT_TRUE(s.Validate().ok());
}

}  // namespace
}  // namespace spillway::offload
