// Status: code names, construction, formatting, and the abort of Result::value() on an error.
#include "spillway/base/status.h"

#include <cstring>

#include "spillway/base/check.h"

namespace spillway {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case StatusCode::kOverBudget:
      return "OVER_BUDGET";
    case StatusCode::kOutOfMemory:
      return "OUT_OF_MEMORY";
    case StatusCode::kIoError:
      return "IO_ERROR";
    case StatusCode::kNoSpace:
      return "NO_SPACE";
    case StatusCode::kChecksumMismatch:
      return "CHECKSUM_MISMATCH";
    case StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case StatusCode::kEscaped:
      return "ESCAPED";
    case StatusCode::kInternal:
      return "INTERNAL";
    case StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case StatusCode::kExternal:
      return "EXTERNAL";
  }
  return "UNKNOWN";
}

Status Status::Make(StatusCode code, std::string message, int sys_error) {
  Status s;
  if (code == StatusCode::kOk) return s;
  s.state_ = std::make_shared<const State>(State{code, sys_error, std::move(message)});
  return s;
}

std::string ErrnoText(int err) {
  char buf[128];
  // GNU strerror_r returns the string it chose, which may not be buf.
  return strerror_r(err, buf, sizeof(buf));
}

Status Status::FromErrno(StatusCode code, int err, std::string message) {
  message += StrCat(": ", ErrnoText(err), " (errno ", err, ")");
  return Make(code, std::move(message), err);
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return state_ ? state_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return StrCat(StatusCodeName(code()), ": ", message());
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Make(code(), StrCat(context, ": ", message()), sys_error());
}

void DieOnValueOfError(const Status& status) {
  internal::Fatal(StrCat("Result::value() on an error (check ok() first): ", status.ToString()));
}

}  // namespace spillway
