// Assertions at three cost levels (docs/base.md, Note [Check levels]):
//
//   SPILLWAY_CHECK(cond) << "context";   always on, in every build. For conditions that, if false,
//                                        would let a byte land in the wrong place: an offset past
//                                        an extent, a slot index out of range, a count that went
//                                        negative. Costs one compare.
//   SPILLWAY_DCHECK(cond) << "context";  debug builds only (NDEBUG unset). For invariants on hot
//                                        paths that the tests exercise. Compiled out, operands
//                                        unevaluated, in release builds.
//   SPILLWAY_VALIDATE(obj);              builds with SPILLWAY_DEBUG_CHECKS (the debug preset) only:
//                                        calls obj.Validate() (a Status), which walks the whole
//                                        structure and checks the invariants its class comment
//                                        states; a failure is fatal. O(size) per call.
//   SPILLWAY_VALIDATE_ON_EXIT(obj);      the same, when the enclosing function returns by any path.
//                                        Declare it first, before any lock the function takes:
//                                        Validate takes the object's own lock.
//
// A failed check prints "spillway fatal: file:line: CHECK failed: cond: context" on stderr and
// aborts. Checks are for bugs in Spillway; input from a caller or a file is validated with a
// Status.
#pragma once

#include <sstream>
#include <string_view>

#include "spillway/base/status.h"

namespace spillway::internal {

// Collects the message of a failed check; its destructor prints it and aborts.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition);
  [[noreturn]] ~CheckFailure();
  CheckFailure(const CheckFailure&) = delete;
  CheckFailure& operator=(const CheckFailure&) = delete;

  template <typename T>
  CheckFailure& operator<<(const T& v) {
    if (!has_context_) out_ << ": ";
    has_context_ = true;
    out_ << v;
    return *this;
  }

 private:
  std::ostringstream out_;
  bool has_context_ = false;
};

// Lets `cond ? (void)0 : Voidify() & CheckFailure(...) << ...` type-check as void.
struct Voidify {
  void operator&(const CheckFailure&) {}
};

[[noreturn]] void Fatal(std::string_view message);

// SPILLWAY_VALIDATE's body: a failed walk is fatal, naming the call site.
template <typename T>
void ValidateOrDie(const T& obj, const char* file, int line) {
  const Status valid = obj.Validate();
  if (!valid.ok()) [[unlikely]]
    CheckFailure(file, line, "Validate()") << valid.ToString();
}

// SPILLWAY_VALIDATE_ON_EXIT's guard.
template <typename T>
class ValidateOnExit {
 public:
  ValidateOnExit(const T& obj, const char* file, int line) : obj_(obj), file_(file), line_(line) {}
  ~ValidateOnExit() { ValidateOrDie(obj_, file_, line_); }
  ValidateOnExit(const ValidateOnExit&) = delete;
  ValidateOnExit& operator=(const ValidateOnExit&) = delete;

 private:
  const T& obj_;
  const char* file_;
  int line_;
};

}  // namespace spillway::internal

// NOLINTBEGIN(bugprone-macro-parentheses): `<< context` after it must reach the CheckFailure
#define SPILLWAY_CHECK(cond)                     \
  (__builtin_expect(static_cast<bool>(cond), 1)) \
      ? (void)0                                  \
      : ::spillway::internal::Voidify() &        \
            ::spillway::internal::CheckFailure(__FILE__, __LINE__, #cond)
// NOLINTEND(bugprone-macro-parentheses)

#ifdef NDEBUG
// `while (false)` keeps the operands type-checked and unevaluated.
#define SPILLWAY_DCHECK(cond) \
  while (false) SPILLWAY_CHECK(cond)
#else
#define SPILLWAY_DCHECK(cond) SPILLWAY_CHECK(cond)
#endif

#if defined(SPILLWAY_DEBUG_CHECKS) && SPILLWAY_DEBUG_CHECKS
#define SPILLWAY_DEBUG_CHECKS_ON 1
#define SPILLWAY_VALIDATE(obj) ::spillway::internal::ValidateOrDie((obj), __FILE__, __LINE__)
// NOLINTNEXTLINE(bugprone-macro-parentheses): a declaration cannot be parenthesised
#define SPILLWAY_VALIDATE_ON_EXIT(obj)                                                    \
  const ::spillway::internal::ValidateOnExit SPILLWAY_CONCAT(_spillway_validate_on_exit_, \
                                                             __LINE__)((obj), __FILE__, __LINE__)
#else
#define SPILLWAY_DEBUG_CHECKS_ON 0
#define SPILLWAY_VALIDATE(obj) \
  do {                         \
  } while (false)
#define SPILLWAY_VALIDATE_ON_EXIT(obj) static_cast<void>(0)
#endif
