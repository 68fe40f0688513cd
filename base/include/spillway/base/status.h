// Status and Result<T>: how every fallible Spillway call reports failure.
// A failed status carries a code, the errno / cqe result / CUDA error behind it, and a message that
// says what was wrong and what to change. An OK status allocates nothing.
//
// The message convention, for every status Spillway makes:
//   "<Call>(<the argument that matters>): <what was wrong, with the numbers>; <what to change>"
// e.g. "RegisterFile('opt.swp'): all 64 file slots are in use; unregister files you no longer
// need". The first part names the call and the object so that a line in a log can be traced; the
// last part names the setting, argument or action that fixes it, so that nobody has to read the
// source. Byte counts go through FormatBytes (base/bytes.h). Context added on the way up
// (WithContext) is prefixed: "while swapping out param 12: <message>".
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

namespace spillway {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,     // the caller passed something wrong (size 0, foreign pointer, bad key)
  kFailedPrecondition,  // the call is out of order (EndEpoch without BeginEpoch, released scope)
  kOverBudget,          // a configured budget would be crossed
  kOutOfMemory,         // the OS refused memory (mmap/mlock/cudaHostRegister)
  kIoError,             // a read or write failed (errno in sys_error)
  kNoSpace,             // ENOSPC / EFBIG / a file size limit
  kChecksumMismatch,    // data read back does not match the checksum written with it
  kUnavailable,         // a facility is missing at run time (no CUDA device, no io_uring)
  kEscaped,             // a boundary found escaped allocations under the `fail` policy
  kInternal,            // an invariant broke: a bug in Spillway
  kResourceExhausted,   // a fixed table is full (file slots, scope ids): release some, or raise it
  kExternal,            // a library Spillway calls (libtorch) raised an error it does not classify
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK

  static Status Ok() { return Status(); }
  static Status Make(StatusCode code, std::string message, int sys_error = 0);
  static Status InvalidArgument(std::string message) {
    return Make(StatusCode::kInvalidArgument, std::move(message));
  }
  static Status FailedPrecondition(std::string message) {
    return Make(StatusCode::kFailedPrecondition, std::move(message));
  }
  static Status OverBudget(std::string message) {
    return Make(StatusCode::kOverBudget, std::move(message));
  }
  static Status Internal(std::string message) {
    return Make(StatusCode::kInternal, std::move(message));
  }
  static Status ResourceExhausted(std::string message) {
    return Make(StatusCode::kResourceExhausted, std::move(message));
  }
  // errno-carrying failures: the message gets ": <strerror> (errno N)" appended.
  static Status FromErrno(StatusCode code, int err, std::string message);

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return state_ ? state_->code : StatusCode::kOk; }
  // errno, negated cqe result or CUDA error code behind the failure; 0 when there is none.
  int sys_error() const { return state_ ? state_->sys_error : 0; }
  const std::string& message() const;
  // "OVER_BUDGET: <message>"
  std::string ToString() const;

  // Prefixes context ("while swapping out param 12: ...") and keeps code and errno.
  Status WithContext(std::string_view context) const;

  // The one named way to drop a status on purpose: where the failure is already reported another
  // way, or nothing can be done about it (a best-effort cleanup on an error path). Say why at the
  // call site. A bare `(void)` cast hides the choice; this names it.
  void IgnoreError() const {}

 private:
  struct State {
    StatusCode code;
    int sys_error;
    std::string message;
  };
  std::shared_ptr<const State> state_;  // null == OK; shared so copies are cheap
};

// strerror's text for an errno value, from strerror_r: safe on any thread (strerror is not).
std::string ErrnoText(int err);

// Prints "spillway fatal: Result::value() on an error: <status>" and aborts.
[[noreturn]] void DieOnValueOfError(const Status& status);

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT(google-explicit-constructor)
  Result(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (status_.ok())
      status_ = Status::Internal("Result constructed from an OK status without a value");
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  // The value. On an error these do not return: they print the status and abort (always on, in
  // every build), so a caller that forgot to check ok() learns why instead of reading garbage.
  T& value() & { return *Checked(); }
  const T& value() const& { return *Checked(); }
  T&& value() && { return std::move(*Checked()); }
  T* operator->() { return &*Checked(); }
  const T* operator->() const { return &*Checked(); }
  T& operator*() & { return *Checked(); }
  const T& operator*() const& { return *Checked(); }
  T&& operator*() && { return std::move(*Checked()); }

 private:
  std::optional<T>& Checked() {
    if (!status_.ok()) [[unlikely]]
      DieOnValueOfError(status_);
    return value_;
  }
  const std::optional<T>& Checked() const {
    if (!status_.ok()) [[unlikely]]
      DieOnValueOfError(status_);
    return value_;
  }

  Status status_;
  std::optional<T> value_;
};

// Concatenates anything with an operator<< into a string: StrCat("freed ", n, " bytes").
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

}  // namespace spillway

#define SPILLWAY_STRINGIZE_INNER(x) #x
#define SPILLWAY_STRINGIZE(x) SPILLWAY_STRINGIZE_INNER(x)
// A static "file:line" string for OwnerTag::site.
#define SPILLWAY_SITE (__FILE__ ":" SPILLWAY_STRINGIZE(__LINE__))

#define SPILLWAY_RETURN_IF_ERROR(expr) \
  do {                                 \
    ::spillway::Status _st = (expr);   \
    if (!_st.ok()) return _st;         \
  } while (0)

#define SPILLWAY_CONCAT_INNER(a, b) a##b
#define SPILLWAY_CONCAT(a, b) SPILLWAY_CONCAT_INNER(a, b)
// SPILLWAY_ASSIGN_OR_RETURN(auto fd, OpenFile(path)); returns the Result's status from the
// enclosing function on an error, else declares (or assigns) `lhs` from its value.
#define SPILLWAY_ASSIGN_OR_RETURN(lhs, expr) \
  SPILLWAY_ASSIGN_OR_RETURN_IMPL(SPILLWAY_CONCAT(_spillway_result_, __LINE__), lhs, expr)
// NOLINTBEGIN(bugprone-macro-parentheses): `lhs` may be a declaration, `result` a name
#define SPILLWAY_ASSIGN_OR_RETURN_IMPL(result, lhs, expr) \
  auto result = (expr);                                   \
  if (!result.ok()) return result.status();               \
  lhs = std::move(result).value()
// NOLINTEND(bugprone-macro-parentheses)
