// Leveled stderr logging. One write(2) per line so lines from threads do not interleave.
#include "spillway/allocator/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace spillway {
namespace {

// Quiet by default: errors and warnings print, informational lines only when asked for.
LogLevel ThresholdFromEnv() {
  const char* env = std::getenv("SPILLWAY_LOG");
  if (env == nullptr) return LogLevel::kWarning;
  if (std::strcmp(env, "error") == 0) return LogLevel::kError;
  if (std::strcmp(env, "info") == 0) return LogLevel::kInfo;
  if (std::strcmp(env, "debug") == 0) return LogLevel::kDebug;
  return LogLevel::kWarning;
}

std::atomic<int>& Threshold() {
  static std::atomic<int> threshold{static_cast<int>(ThresholdFromEnv())};
  return threshold;
}

}  // namespace

bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) <= Threshold().load(std::memory_order_relaxed);
}

void SetLogLevel(LogLevel level) { Threshold().store(static_cast<int>(level), std::memory_order_relaxed); }

void Log(LogLevel level, std::string_view message) {
  if (!LogEnabled(level)) return;
  static const char* kNames[] = {"error", "warning", "info", "debug"};
  std::string line = "spillway ";
  line += kNames[static_cast<int>(level)];
  line += ": ";
  line += message;
  line += '\n';
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

}  // namespace spillway
