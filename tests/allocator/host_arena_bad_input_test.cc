// Bad input to HostArena: one test per case. Each must return a clear error and change nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "spillway/allocator/host_arena.h"
#include "spillway/base/bytes.h"
#include "test_util.h"

namespace spillway::allocator {
namespace {

using testing::Has;
using testing::MakeArena;
using testing::PageableOptions;
using testing::Tag;

// Fixture: an arena holding one live allocation filled with a pattern. After each bad call the
// test checks that stats, invariants and the data are exactly as before.
class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    arena_ = MakeArena(PageableOptions(&ledger_));
    auto p = arena_->Allocate(kKeepBytes, Tag(Kind::kParam, Lifetime::kPersistent, 1));
    ASSERT_TRUE(p.ok());
    keep_ = static_cast<unsigned char*>(*p);
    std::memset(keep_, 0x5a, kKeepBytes);
    before_ = arena_->Stats();
  }
  void ExpectUnchanged() {
    HostArenaStats now = arena_->Stats();
    EXPECT_EQ(now.committed_bytes, before_.committed_bytes);
    EXPECT_EQ(now.live_bytes, before_.live_bytes);
    EXPECT_EQ(now.live_allocations, before_.live_allocations);
    EXPECT_EQ(now.regions, before_.regions);
    EXPECT_EQ(now.alloc_count, before_.alloc_count);
    EXPECT_EQ(now.free_count, before_.free_count);
    for (size_t i = 0; i < kKeepBytes; i += 4093) ASSERT_EQ(keep_[i], 0x5a);
    Status v = arena_->Validate();
    EXPECT_TRUE(v.ok()) << v.ToString();
  }
  static constexpr uint64_t kKeepBytes = 3 * kMiB + 100;
  Ledger ledger_;
  std::unique_ptr<HostArena> arena_;
  unsigned char* keep_ = nullptr;
  HostArenaStats before_;
};

TEST_F(BadInputTest, SizeZero) {
  auto p = arena_->Allocate(0, Tag(Kind::kGrad, Lifetime::kStep, 5));
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(p.status(), "size 0 for grad owner 5")) << p.status().ToString();
  ExpectUnchanged();
}

TEST_F(BadInputTest, SizeOverflowFromANegativeNumber) {
  auto p = arena_->Allocate(static_cast<uint64_t>(-8), Tag(Kind::kGrad, Lifetime::kStep));
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(p.status(), "overflows")) << p.status().ToString();
  ExpectUnchanged();
}

TEST_F(BadInputTest, SizeOverTheWholeBudget) {
  auto p = arena_->Allocate(600 * kMiB, Tag(Kind::kMasterWeight, Lifetime::kPersistent));
  EXPECT_EQ(p.status().code(), StatusCode::kOverBudget);
  EXPECT_TRUE(Has(p.status(), "larger than the whole host budget of 512.00 MiB"))
      << p.status().ToString();
  EXPECT_TRUE(Has(p.status(), "sub_group_size")) << p.status().ToString();
  ExpectUnchanged();
}

TEST_F(BadInputTest, DoubleFree) {
  auto p = arena_->Allocate(kMiB, Tag(Kind::kTransient, Lifetime::kStep));
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(arena_->Free(*p).ok());
  before_ = arena_->Stats();
  Status st = arena_->Free(*p);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(st, "double free")) << st.ToString();
  EXPECT_TRUE(Has(st, "Free each allocation exactly once")) << st.ToString();
  ExpectUnchanged();
  EXPECT_EQ(arena_->Stats().bad_free_count, 1u);
}

TEST_F(BadInputTest, ForeignPointerFromMalloc) {
  void* foreign = std::malloc(4096);
  Status st = arena_->Free(foreign);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(st, "foreign pointer")) << st.ToString();
  std::free(foreign);
  ExpectUnchanged();
}

TEST_F(BadInputTest, ForeignPointerFromAnotherArena) {
  auto other = MakeArena(PageableOptions(&ledger_));
  auto p = other->Allocate(4096, Tag(Kind::kParam, Lifetime::kPersistent));
  ASSERT_TRUE(p.ok());
  Status st = arena_->Free(*p);
  EXPECT_TRUE(Has(st, "foreign pointer")) << st.ToString();
  ExpectUnchanged();
  EXPECT_TRUE(other->Free(*p).ok());
}

TEST_F(BadInputTest, InteriorPointer) {
  Status st = arena_->Free(keep_ + 8192);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(st, "interior pointer, 8192 bytes into the allocation")) << st.ToString();
  EXPECT_TRUE(Has(st, "param owner 1")) << st.ToString();
  ExpectUnchanged();
}

TEST_F(BadInputTest, NullPointer) {
  Status st = arena_->Free(nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(st, "null pointer")) << st.ToString();
  ExpectUnchanged();
}

TEST_F(BadInputTest, FreeAfterTheScopeWasReleased) {
  auto scope = ledger_.CreateScope("rlhf-actor-3");
  ASSERT_TRUE(scope.ok());
  auto p = arena_->Allocate(kMiB, Tag(Kind::kOptimizerState, Lifetime::kPersistent, 1, *scope));
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(ledger_.ReleaseScope(*scope).ok());
  before_ = arena_->Stats();
  Status st = arena_->Free(*p);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(st, "free after scope release")) << st.ToString();
  EXPECT_TRUE(Has(st, "'rlhf-actor-3'")) << st.ToString();
  ExpectUnchanged();
}

TEST_F(BadInputTest, ScopeThatWasNeverCreated) {
  auto p = arena_->Allocate(kMiB, Tag(Kind::kParam, Lifetime::kPersistent, 1, 4242));
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(p.status(), "scope 4242 was never created")) << p.status().ToString();
  ExpectUnchanged();
}

TEST_F(BadInputTest, OwnerTagOutOfRange) {
  OwnerTag tag = Tag(Kind::kParam, Lifetime::kPersistent);
  tag.kind = static_cast<Kind>(99);
  EXPECT_EQ(arena_->Allocate(kMiB, tag).status().code(), StatusCode::kInvalidArgument);
  ExpectUnchanged();
}

TEST_F(BadInputTest, BoundaryOutOfOrder) {
  Status st = ledger_.EndEpoch(nullptr);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Has(st, "EndEpoch without BeginEpoch")) << st.ToString();
  ExpectUnchanged();
}

TEST_F(BadInputTest, UnknownPolicyString) {
  auto p = ParseEscapePolicy("ignore");
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      Has(p.status(), "unknown escape policy 'ignore'; allowed values: report, reclaim, fail"))
      << p.status().ToString();
  EXPECT_EQ(*ParseEscapePolicy("reclaim"), EscapePolicy::kReclaim);
  ExpectUnchanged();
}

TEST_F(BadInputTest, UnknownKindLifetimeAndPinModeStrings) {
  EXPECT_TRUE(Has(ParseKind("weights").status(), "allowed values: param, grad"));
  EXPECT_TRUE(Has(ParseLifetime("forever").status(), "persistent, epoch, step"));
  EXPECT_TRUE(Has(ParsePinMode("hugepage").status(), "auto, cuda, mlock, pageable"));
  EXPECT_TRUE(Has(ParseForkSafety("copy").status(), "dontfork, wipeonfork, inherit"));
  EXPECT_EQ(*ParseKind("optimizer_state"), Kind::kOptimizerState);
  ExpectUnchanged();
}

// Each option out of range is refused by name, with the value given (the message once named all
// four together, whichever was wrong, and no value).
TEST_F(BadInputTest, OptionsOutOfRangeAreRefusedByNameAndValue) {
  const struct {
    void (*set)(HostArenaOptions*);
    const char* says;
  } cases[] = {
      {[](HostArenaOptions* o) { o->retain_fraction = 1.25; },
       "retain_fraction must be in [0, 1], not 1.25"},
      {[](HostArenaOptions* o) { o->peak_slack = -0.5; }, "peak_slack must be in [0, 1], not -0.5"},
      {[](HostArenaOptions* o) { o->peak_slack = 1.0000001; },
       "peak_slack must be in [0, 1], not 1.0000001"},
      {[](HostArenaOptions* o) { o->peak_slack = std::nan(""); },
       "peak_slack must be in [0, 1], not nan"},
      {[](HostArenaOptions* o) { o->dedicated_divisor = 0; },
       "dedicated_divisor must be at least 1, not 0"},
      {[](HostArenaOptions* o) { o->reuse_waste_divisor = 0; },
       "reuse_waste_divisor must be at least 1, not 0"},
  };
  for (const auto& c : cases) {
    HostArenaOptions o = PageableOptions(&ledger_);
    c.set(&o);
    auto arena = HostArena::Create(o);
    ASSERT_FALSE(arena.ok()) << c.says;
    EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Has(arena.status(), c.says)) << arena.status().ToString();
  }
  // The refused arenas touched nothing of the fixture's arena, which shares their ledger.
  ExpectUnchanged();
}

TEST_F(BadInputTest, BudgetBelowOnePageIsRefusedAtCreation) {
  HostArenaOptions o = PageableOptions(&ledger_);
  o.budget_bytes = 100;
  auto r = HostArena::Create(o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(r.status(), "below one page")) << r.status().ToString();
}

}  // namespace
}  // namespace spillway::allocator
