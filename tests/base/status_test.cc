// Status, Result, the return macros and the byte helpers: what every other layer builds on.
#include "spillway/base/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <set>
#include <string>

#include "spillway/base/bytes.h"

namespace spillway {
namespace {

TEST(StatusTest, DefaultIsOkAndCarriesNothing) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.sys_error(), 0);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_TRUE(Status::Make(StatusCode::kOk, "ignored").ok());
}

TEST(StatusTest, FailureKeepsCodeMessageAndErrno) {
  Status s = Status::FromErrno(StatusCode::kIoError, ENOSPC, "pwrite('a.swp', 4096 B at 0)");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.sys_error(), ENOSPC);
  EXPECT_NE(s.message().find("pwrite('a.swp', 4096 B at 0): "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("(errno 28)"), std::string::npos) << s.message();
  EXPECT_EQ(s.ToString().rfind("IO_ERROR: pwrite", 0), 0u) << s.ToString();
}

TEST(StatusTest, ContextIsPrefixedAndCodeAndErrnoSurvive) {
  Status s =
      Status::FromErrno(StatusCode::kNoSpace, ENOSPC, "write").WithContext("swapping out 12");
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_EQ(s.sys_error(), ENOSPC);
  EXPECT_EQ(s.message().rfind("swapping out 12: write: ", 0), 0u) << s.message();
  EXPECT_TRUE(Status().WithContext("nothing").ok());
}

TEST(StatusTest, EveryCodeHasItsOwnName) {
  std::set<std::string> names;
  const int last = static_cast<int>(StatusCode::kExternal);
  for (int c = 0; c <= last; ++c) {
    const std::string name = StatusCodeName(static_cast<StatusCode>(c));
    EXPECT_NE(name, "UNKNOWN") << c;
    EXPECT_TRUE(names.insert(name).second) << name << " named twice";
  }
  EXPECT_EQ(Status::ResourceExhausted("x").ToString(), "RESOURCE_EXHAUSTED: x");
}

TEST(StatusTest, CopiesShareTheFailure) {
  Status a = Status::InvalidArgument("size 0");
  Status b = a;
  EXPECT_EQ(b.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(&a.message(), &b.message());  // one allocation, shared
}

TEST(ResultTest, HoldsAValueOrTheStatus) {
  Result<int> v = 7;
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 7);
  EXPECT_EQ(v.value(), 7);
  Result<int> e = Status::OverBudget("over");
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kOverBudget);
}

TEST(ResultTest, AnOkStatusWithoutAValueIsAnInternalError) {
  Result<int> r = Status::Ok();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(ResultDeathTest, ValueOfAnErrorPrintsTheStatusAndAborts) {
  Result<std::string> r = Status::InvalidArgument("Open('x'): no such file; create it first");
  EXPECT_DEATH((void)r.value(), "Result::value\\(\\) on an error.*INVALID_ARGUMENT: Open\\('x'\\)");
  EXPECT_DEATH((void)r->size(), "INVALID_ARGUMENT");
  EXPECT_DEATH((void)*std::move(r), "INVALID_ARGUMENT");
}

Status Fails() { return Status::Make(StatusCode::kNoSpace, "disk full"); }
Status Succeeds() { return Status::Ok(); }
Result<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidArgument(StrCat("Half(", x, "): odd"));
  return x / 2;
}

Status ReturnIfError(bool fail, int* reached) {
  SPILLWAY_RETURN_IF_ERROR(Succeeds());
  if (fail) SPILLWAY_RETURN_IF_ERROR(Fails());
  *reached = 1;
  return Status::Ok();
}

Result<int> Quarter(int x) {
  SPILLWAY_ASSIGN_OR_RETURN(int half, Half(x));
  SPILLWAY_ASSIGN_OR_RETURN(half, Half(half));  // assigns an existing variable too
  return half;
}

TEST(StatusMacrosTest, ReturnIfErrorReturnsTheFailureAndOnlyIt) {
  int reached = 0;
  EXPECT_TRUE(ReturnIfError(false, &reached).ok());
  EXPECT_EQ(reached, 1);
  reached = 0;
  Status s = ReturnIfError(true, &reached);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_EQ(reached, 0);
}

TEST(StatusMacrosTest, AssignOrReturnUnwrapsOrReturnsTheStatus) {
  Result<int> q = Quarter(12);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(*q, 3);
  Result<int> odd = Quarter(6);  // 6 -> 3, then 3 is odd
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().message(), "Half(3): odd");
}

TEST(BytesTest, FormatAndRound) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(3 * kMiB / 2), "1.50 MiB (1572864 bytes)");
  EXPECT_EQ(FormatBytes(kGiB), "1.00 GiB (1073741824 bytes)");
  static_assert(RoundUp(1, 4096) == 4096 && RoundUp(4096, 4096) == 4096 && RoundUp(0, 4096) == 0);
  static_assert(RoundUp(10, 3) == 12 && RoundDown(10, 3) == 9);
  EXPECT_DOUBLE_EQ(ToMiB(3 * kMiB / 2), 1.5);
  EXPECT_EQ(FormatMiB(3 * kMiB / 2), "1.5 MiB");
  EXPECT_EQ(FormatMiB(0), "0.0 MiB");
  EXPECT_EQ(FormatMiBDelta(static_cast<double>(kMiB) / 4), "+0.25 MiB");
  EXPECT_EQ(FormatMiBDelta(-static_cast<double>(kMiB) / 2), "-0.50 MiB");
  EXPECT_EQ(FormatMiBDelta(0), "+0.00 MiB");
}

}  // namespace
}  // namespace spillway
