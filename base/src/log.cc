// Leveled logging: stderr, one write(2) per line so lines from threads do not interleave, or the
// sink that SetLogSink installed.
#include "spillway/base/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace spillway {
namespace {

// Quiet by default: errors and warnings print, informational lines only when asked for. A value
// that names no level is said, not ignored.
LogLevel ThresholdFromEnv() {
  const char* env = std::getenv("SPILLWAY_LOG");  // NOLINT(concurrency-mt-unsafe): once, no setenv
  if (env == nullptr || *env == '\0') return LogLevel::kWarning;
  if (std::optional<LogLevel> l = ParseLogLevel(env)) return *l;
  LogToStderr(LogLevel::kWarning,
              std::string("SPILLWAY_LOG='") + env +
                  "' names no level; use error, warning, info or debug. Logging at warning");
  return LogLevel::kWarning;
}

std::atomic<int>& Threshold() {
  static std::atomic<int> threshold{static_cast<int>(ThresholdFromEnv())};
  return threshold;
}

std::atomic<LogSink> g_sink{nullptr};

}  // namespace

void LogToStderr(LogLevel level, std::string_view message) {
  std::string line = "spillway ";
  line += LogLevelName(level);
  line += ": ";
  line += message;
  line += '\n';
  std::string_view rest = line;
  while (!rest.empty()) {
    const ssize_t n = ::write(STDERR_FILENO, rest.data(), rest.size());
    if (n <= 0) return;  // stderr is gone or full: a log line has nowhere else to go
    rest.remove_prefix(static_cast<size_t>(n));
  }
}

std::optional<LogLevel> ParseLogLevel(std::string_view name) {
  for (LogLevel l : {LogLevel::kError, LogLevel::kWarning, LogLevel::kInfo, LogLevel::kDebug}) {
    if (name == LogLevelName(l)) return l;
  }
  return std::nullopt;
}

const char* LogLevelName(LogLevel level) {
  static const char* const kNames[] = {"error", "warning", "info", "debug"};
  return kNames[static_cast<int>(level)];
}

bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) <= Threshold().load(std::memory_order_relaxed);
}

void SetLogLevel(LogLevel level) {
  Threshold().store(static_cast<int>(level), std::memory_order_relaxed);
}

void SetLogSink(LogSink sink) { g_sink.store(sink, std::memory_order_release); }

void Log(LogLevel level, std::string_view message) {
  if (!LogEnabled(level)) return;
  if (LogSink sink = g_sink.load(std::memory_order_acquire)) {
    sink(level, message);
    return;
  }
  LogToStderr(level, message);
}

}  // namespace spillway
