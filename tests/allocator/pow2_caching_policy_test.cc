// The baseline policy the arena is compared against (bench/compare_host_arena, the leak suite's
// pinned-pow2 control). Its behaviour is the point of comparison, so it is pinned down here:
// rounding, reuse only within a rounded size, nothing ever given back.
#include "spillway/allocator/pow2_caching_policy.h"

#include <gtest/gtest.h>

#include <cstring>

namespace spillway::allocator::baseline {
namespace {

TEST(Pow2CachingPolicyTest, RoundsUpToAPowerOfTwoOfAtLeastAPage) {
  EXPECT_EQ(Pow2CachingPolicy::Rounded(1), 4096u);
  EXPECT_EQ(Pow2CachingPolicy::Rounded(4096), 4096u);
  EXPECT_EQ(Pow2CachingPolicy::Rounded(4097), 8192u);
  EXPECT_EQ(Pow2CachingPolicy::Rounded((uint64_t{1} << 20) + 1), uint64_t{2} << 20);
}

TEST(Pow2CachingPolicyTest, ReusesOnlyWithinARoundedSizeAndNeverGivesBack) {
  Pow2CachingPolicy cache;
  auto a = cache.Alloc(5000);  // -> 8 KiB
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  std::memset(*a, 7, 5000);
  EXPECT_EQ(cache.held_bytes(), 8192u);
  ASSERT_TRUE(cache.Free(*a).ok());
  EXPECT_EQ(cache.held_bytes(), 8192u);  // cached, not released

  auto b = cache.Alloc(8000);  // same rounded size: the cached block
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, *a);
  auto c = cache.Alloc(9000);  // 16 KiB: a new block although 8 KiB would be free after b
  ASSERT_TRUE(c.ok());
  EXPECT_NE(*c, *a);
  EXPECT_EQ(cache.held_bytes(), 8192u + 16384u);
  ASSERT_TRUE(cache.Free(*b).ok());
  ASSERT_TRUE(cache.Free(*c).ok());
  auto d = cache.Alloc(20000);  // 32 KiB: neither cached block serves it
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(cache.held_bytes(), 8192u + 16384u + 32768u);
}

TEST(Pow2CachingPolicyTest, BadInputIsAnError) {
  Pow2CachingPolicy cache;
  EXPECT_EQ(cache.Alloc(0).status().code(), StatusCode::kInvalidArgument);
  int local = 0;
  const Status st = cache.Free(&local);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not allocated here"), std::string::npos) << st.ToString();
  EXPECT_EQ(cache.held_bytes(), 0u);
}

}  // namespace
}  // namespace spillway::allocator::baseline
