// Status and Result<T>: how every fallible Spillway call reports failure.
// A failed status carries a code, the errno / cqe result / CUDA error behind it, and a message that
// says what was wrong and what to change. An OK status allocates nothing.
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

 private:
  struct State {
    StatusCode code;
    int sys_error;
    std::string message;
  };
  std::shared_ptr<const State> state_;  // null == OK; shared so copies are cheap
};

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (status_.ok()) status_ = Status::Internal("Result constructed from an OK status without a value");
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T&& operator*() && { return std::move(*value_); }

 private:
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

// "1.50 GiB (1610612736 bytes)" for messages a person reads.
std::string FormatBytes(uint64_t bytes);

}  // namespace spillway

#define SPILLWAY_STRINGIZE_INNER(x) #x
#define SPILLWAY_STRINGIZE(x) SPILLWAY_STRINGIZE_INNER(x)
// A static "file:line" string for OwnerTag::site.
#define SPILLWAY_SITE (__FILE__ ":" SPILLWAY_STRINGIZE(__LINE__))

#define SPILLWAY_RETURN_IF_ERROR(expr)   \
  do {                                   \
    ::spillway::Status _st = (expr);     \
    if (!_st.ok()) return _st;           \
  } while (0)
