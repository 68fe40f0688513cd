// ExtentMap: best fit, coalescing, span boundaries, and a seeded random walk checked by Validate.
#include "spillway/allocator/extent_map.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

namespace spillway::allocator {
namespace {

std::vector<std::pair<uint64_t, uint64_t>> Allocated(const std::map<uint64_t, uint64_t>& m) {
  return {m.begin(), m.end()};
}

TEST(ExtentMapTest, BestFitTakesTheSmallestHoleThatFits) {
  ExtentMap em;
  ASSERT_TRUE(em.AddSpan(0, 100).ok());
  std::map<uint64_t, uint64_t> live;
  for (uint64_t size : {10, 5, 20, 3, 30}) live[*em.Allocate(size)] = size;
  // Layout: [0,10) [10,15) [15,35) [35,38) [38,68) free [68,100)
  em.Free(10, 5);
  live.erase(10);
  em.Free(35, 3);
  live.erase(35);
  EXPECT_EQ(*em.Allocate(3), 35u);  // the 3-hole, not the 5-hole or the tail
  live[35] = 3;
  EXPECT_EQ(*em.Allocate(4), 10u);  // the 5-hole
  live[10] = 4;
  EXPECT_EQ(*em.Allocate(32), 68u);  // only the tail fits
  live[68] = 32;
  EXPECT_FALSE(em.Allocate(2).has_value());  // one byte left at 14
  EXPECT_TRUE(em.Validate(Allocated(live)).ok()) << em.Validate(Allocated(live)).ToString();
}

TEST(ExtentMapTest, FreeCoalescesWithBothNeighbours) {
  ExtentMap em;
  ASSERT_TRUE(em.AddSpan(1000, 30).ok());
  uint64_t a = *em.Allocate(10), b = *em.Allocate(10), c = *em.Allocate(10);
  em.Free(a, 10);
  em.Free(c, 10);
  EXPECT_EQ(em.free_extent_count(), 2u);
  em.Free(b, 10);
  EXPECT_EQ(em.free_extent_count(), 1u);
  EXPECT_EQ(em.largest_free_extent(), 30u);
  EXPECT_EQ(em.empty_span_bytes(), 30u);
  EXPECT_TRUE(em.Validate({}).ok());
}

TEST(ExtentMapTest, NeverCoalescesAcrossAdjacentSpans) {
  // Two mmaps can be adjacent; an extent across them would cross two pinned registrations.
  ExtentMap em;
  ASSERT_TRUE(em.AddSpan(0, 100).ok());
  ASSERT_TRUE(em.AddSpan(100, 100).ok());
  EXPECT_EQ(em.free_extent_count(), 2u);
  EXPECT_FALSE(em.Allocate(150).has_value());
  uint64_t a = *em.Allocate(100), b = *em.Allocate(100);
  em.Free(a, 100);
  em.Free(b, 100);
  EXPECT_EQ(em.free_extent_count(), 2u);
  EXPECT_TRUE(em.Validate({}).ok());
}

TEST(ExtentMapTest, OverlappingSpanIsRefused) {
  ExtentMap em;
  ASSERT_TRUE(em.AddSpan(100, 100).ok());
  EXPECT_FALSE(em.AddSpan(150, 100).ok());
  EXPECT_FALSE(em.AddSpan(50, 60).ok());
  EXPECT_FALSE(em.AddSpan(0, 0).ok());
  EXPECT_EQ(em.span_count(), 1u);
}

TEST(ExtentMapTest, RemoveSpanRefusesABusySpan) {
  ExtentMap em;
  ASSERT_TRUE(em.AddSpan(0, 64).ok());
  uint64_t a = *em.Allocate(8);
  Status st = em.RemoveSpan(0);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("still holds 1 allocations"), std::string::npos) << st.ToString();
  em.Free(a, 8);
  EXPECT_TRUE(em.RemoveSpan(0).ok());
  EXPECT_EQ(em.span_bytes(), 0u);
  EXPECT_FALSE(em.RemoveSpan(0).ok());
}

TEST(ExtentMapTest, ValidateCatchesAWrongCallerList) {
  ExtentMap em;
  ASSERT_TRUE(em.AddSpan(0, 64).ok());
  uint64_t a = *em.Allocate(8);
  EXPECT_TRUE(em.Validate({{a, 8}}).ok());
  EXPECT_FALSE(em.Validate({{a, 4}}).ok());  // gap
  EXPECT_FALSE(em.Validate({}).ok());        // a hole nobody owns
}

TEST(ExtentMapTest, SeededRandomWalkKeepsEveryInvariant) {
  std::mt19937_64 rng(20261122);
  ExtentMap em;
  for (int s = 0; s < 8; ++s) ASSERT_TRUE(em.AddSpan(uint64_t(s) * 10000, 5000 + s * 100).ok());
  std::map<uint64_t, uint64_t> live;
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      uint64_t size = 1 + rng() % 700;
      if (auto a = em.Allocate(size)) {
        ASSERT_FALSE(live.count(*a));
        live[*a] = size;
      }
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      em.Free(it->first, it->second);
      live.erase(it);
    }
    if (i % 1000 == 0) {
      Status st = em.Validate(Allocated(live));
      ASSERT_TRUE(st.ok()) << "op " << i << ": " << st.ToString();
    }
  }
  for (auto& [a, s] : live) em.Free(a, s);
  EXPECT_EQ(em.free_bytes(), em.span_bytes());
  EXPECT_EQ(em.free_extent_count(), em.span_count());
  EXPECT_TRUE(em.Validate({}).ok());
}

// Freeing bytes that are already free would hand them out twice: a fatal check in every build,
// not undefined behaviour in the trees.
TEST(ExtentMapDeathTest, FreeingAFreeOrForeignRangeIsFatal) {
  ExtentMap em;
  ASSERT_TRUE(em.AddSpan(4096, 100).ok());
  const uint64_t a = *em.Allocate(10);
  const uint64_t b = *em.Allocate(10);
  em.Free(a, 10);
  EXPECT_DEATH(em.Free(a, 10),
               "CHECK failed: .*ExtentMap::Free\\(4096, 10\\): overlaps the free extent");
  EXPECT_DEATH(em.Free(b, 95), "ExtentMap::Free\\(4106, 95\\): not inside one span");
  EXPECT_DEATH(em.Free(0, 10), "not inside one span");
}

}  // namespace
}  // namespace spillway::allocator
