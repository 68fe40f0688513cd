// Status formatting and the byte formatter used in every message a user reads.
#include "spillway/allocator/status.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>

namespace spillway {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kOverBudget: return "OVER_BUDGET";
    case StatusCode::kOutOfMemory: return "OUT_OF_MEMORY";
    case StatusCode::kIoError: return "IO_ERROR";
    case StatusCode::kNoSpace: return "NO_SPACE";
    case StatusCode::kChecksumMismatch: return "CHECKSUM_MISMATCH";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kEscaped: return "ESCAPED";
    case StatusCode::kInternal: return "INTERNAL";
  }
  return "UNKNOWN";
}

Status Status::Make(StatusCode code, std::string message, int sys_error) {
  Status s;
  if (code == StatusCode::kOk) return s;
  s.state_ = std::make_shared<const State>(State{code, sys_error, std::move(message)});
  return s;
}

Status Status::FromErrno(StatusCode code, int err, std::string message) {
  char buf[128];
  // GNU strerror_r returns the string it chose, which may not be buf.
  const char* text = strerror_r(err, buf, sizeof(buf));
  message += StrCat(": ", text, " (errno ", err, ")");
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

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 5) {
    v /= 1024.0;
    ++unit;
  }
  char buf[64];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%" PRIu64 " B", bytes);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s (%" PRIu64 " bytes)", v, kUnits[unit], bytes);
  }
  return buf;
}

}  // namespace spillway
