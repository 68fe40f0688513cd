// Ledger: boundary order, scopes, and reports that cover several tiers.
#include "spillway/allocator/ledger.h"

#include <gtest/gtest.h>

#include "spillway/allocator/host_arena.h"

namespace spillway::allocator {
namespace {

bool Contains(const Status& st, const std::string& text) {
  return st.message().find(text) != std::string::npos;
}

TEST(LedgerTest, EndEpochWithoutBeginEpochIsRefusedAndChangesNothing) {
  Ledger ledger;
  BoundaryReport report;
  Status st = ledger.EndEpoch(&report);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(st, "call BeginEpoch(n)")) << st.ToString();
  EXPECT_EQ(ledger.epoch(), -1);
  EXPECT_FALSE(ledger.in_epoch());
  EXPECT_TRUE(ledger.BeginEpoch(0).ok());
}

TEST(LedgerTest, EndStepWithoutBeginStepIsRefused) {
  Ledger ledger;
  Status st = ledger.EndStep(nullptr);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(st, "BeginStep")) << st.ToString();
}

TEST(LedgerTest, NestedOrRepeatedBeginsAreRefused) {
  Ledger ledger;
  ASSERT_TRUE(ledger.BeginEpoch(0).ok());
  EXPECT_EQ(ledger.BeginEpoch(1).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(ledger.BeginStep(0).ok());
  EXPECT_EQ(ledger.BeginStep(1).code(), StatusCode::kFailedPrecondition);
  Status st = ledger.EndEpoch(nullptr);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(st, "call EndStep first")) << st.ToString();
  EXPECT_TRUE(ledger.in_epoch());  // the refused EndEpoch changed nothing
  ASSERT_TRUE(ledger.EndStep(nullptr).ok());
  ASSERT_TRUE(ledger.EndEpoch(nullptr).ok());
}

TEST(LedgerTest, NumbersMustIncrease) {
  Ledger ledger;
  ASSERT_TRUE(ledger.BeginEpoch(3).ok());
  ASSERT_TRUE(ledger.EndEpoch(nullptr).ok());
  Status st = ledger.BeginEpoch(3);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(st, "the last epoch was 3")) << st.ToString();
  EXPECT_EQ(ledger.BeginEpoch(-1).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(ledger.BeginStep(7).ok());
  ASSERT_TRUE(ledger.EndStep(nullptr).ok());
  EXPECT_EQ(ledger.BeginStep(7).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(ledger.BeginStep(8).ok());
}

TEST(LedgerTest, ScopesAreCreatedReleasedOnceAndNeverReused) {
  Ledger ledger;
  auto a = ledger.CreateScope("engine-a");
  auto b = ledger.CreateScope("engine-b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  EXPECT_TRUE(ledger.scope_live(*a));
  EXPECT_EQ(ledger.scope_name(*a), "engine-a");
  auto r = ledger.ReleaseScope(*a);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->name, "engine-a");
  EXPECT_FALSE(ledger.scope_live(*a));
  EXPECT_TRUE(ledger.scope_exists(*a));
  auto again = ledger.ReleaseScope(*a);
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(again.status(), "already released"));
  EXPECT_EQ(ledger.ReleaseScope(kProcessScope).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger.ReleaseScope(9999).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(ledger.scope_live(*b));
}

TEST(LedgerTest, OneBoundaryReportCoversEveryAttachedTier) {
  Ledger ledger;
  HostArenaOptions o;
  o.pin = PinMode::kPageable;
  o.ledger = &ledger;
  o.name = "hostA";
  auto a = HostArena::Create(o);
  o.name = "hostB";
  o.policy = EscapePolicy::kReclaim;
  auto b = HostArena::Create(o);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(ledger.BeginEpoch(0).ok());
  ASSERT_TRUE(ledger.BeginStep(0).ok());
  OwnerTag step_tag{Kind::kTransient, Lifetime::kStep, 1, kProcessScope, SPILLWAY_SITE};
  ASSERT_TRUE((*a)->Allocate(10000, step_tag).ok());
  ASSERT_TRUE((*b)->Allocate(5000, step_tag).ok());
  BoundaryReport report;
  ASSERT_TRUE(ledger.EndStep(&report).ok());
  ASSERT_EQ(report.tiers.size(), 2u);
  EXPECT_EQ(report.escape_count(), 2u);
  EXPECT_EQ(report.escaped_bytes(), 3u * 4096 + 2 * 4096);
  EXPECT_EQ(report.tiers[0].tier, "hostA");
  EXPECT_EQ(report.tiers[0].reclaimed_count, 0u);
  EXPECT_EQ(report.tiers[1].reclaimed_count, 1u);
  EXPECT_EQ(report.live_bytes(), 3u * 4096);  // B reclaimed its escape
  EXPECT_NE(report.ToString().find("escape: transient/step owner 1"), std::string::npos)
      << report.ToString();
}

}  // namespace
}  // namespace spillway::allocator
