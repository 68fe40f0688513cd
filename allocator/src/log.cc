// Leveled stderr logging. One write(2) per line so lines from threads do not interleave.
#include "spillway/allocator/log.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace spillway {
namespace {

LogLevel ThresholdFromEnv() {
  const char* env = std::getenv("SPILLWAY_LOG");
  if (env == nullptr) return LogLevel::kInfo;
  if (std::strcmp(env, "error") == 0) return LogLevel::kError;
  if (std::strcmp(env, "warning") == 0) return LogLevel::kWarning;
  if (std::strcmp(env, "debug") == 0) return LogLevel::kDebug;
  return LogLevel::kInfo;
}

}  // namespace

bool LogEnabled(LogLevel level) {
  static const LogLevel threshold = ThresholdFromEnv();
  return static_cast<int>(level) <= static_cast<int>(threshold);
}

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
