// SPILLWAY_CHECK is on in every build; SPILLWAY_DCHECK only without NDEBUG; SPILLWAY_VALIDATE only
// with SPILLWAY_DEBUG_CHECKS.
#include "spillway/base/check.h"

#include <gtest/gtest.h>

namespace spillway {
namespace {

TEST(CheckDeathTest, AFailedCheckNamesTheConditionAndTheContextAndAborts) {
  const int slots = 64;
  int slot = 70;
  EXPECT_DEATH(SPILLWAY_CHECK(slot < slots) << "slot " << slot << " of " << slots,
               "spillway fatal: .*check_test.cc:[0-9]+: CHECK failed: slot < slots: slot 70 of 64");
  EXPECT_DEATH(SPILLWAY_CHECK(slot == 0), "CHECK failed: slot == 0");
}

TEST(CheckTest, APassingCheckEvaluatesItsConditionOnceAndNotTheContext) {
  int evaluated = 0;
  int streamed = 0;
  SPILLWAY_CHECK(++evaluated == 1) << ++streamed;
  EXPECT_EQ(evaluated, 1);
  EXPECT_EQ(streamed, 0);
}

TEST(CheckTest, DcheckRunsExactlyInBuildsWithoutNdebug) {
  int evaluated = 0;
  SPILLWAY_DCHECK(++evaluated > 0);
#ifdef NDEBUG
  EXPECT_EQ(evaluated, 0);
#else
  EXPECT_EQ(evaluated, 1);
  EXPECT_DEATH(SPILLWAY_DCHECK(evaluated == 0) << "debug", "CHECK failed: evaluated == 0: debug");
#endif
}

struct Walked {
  mutable int validations = 0;
  bool broken = false;
  Status Validate() const {
    ++validations;
    return broken ? Status::Internal("Validate: the free list is not sorted") : Status::Ok();
  }
  void Mutate() const { SPILLWAY_VALIDATE_ON_EXIT(*this); }
};

TEST(CheckTest, ValidateRunsExactlyWithDebugChecks) {
  Walked w;
  SPILLWAY_VALIDATE(w);
  EXPECT_EQ(w.validations, SPILLWAY_DEBUG_CHECKS_ON);
  w.Mutate();
  EXPECT_EQ(w.validations, 2 * SPILLWAY_DEBUG_CHECKS_ON);
}

TEST(CheckDeathTest, ABrokenInvariantIsFatalWithDebugChecks) {
  Walked w;
  w.broken = true;
#if SPILLWAY_DEBUG_CHECKS_ON
  EXPECT_DEATH(w.Mutate(),
               "check_test.cc:[0-9]+: CHECK failed: Validate\\(\\): INTERNAL: Validate: the free "
               "list is not sorted");
#else
  w.Mutate();  // compiled out
  EXPECT_EQ(w.validations, 0);
#endif
}

}  // namespace
}  // namespace spillway
