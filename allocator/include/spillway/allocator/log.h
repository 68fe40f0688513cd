// Minimal leveled logging to stderr. SPILLWAY_LOG=error|warning|info|debug (default warning:
// informational lines print only when asked for).
#pragma once

#include <string_view>

namespace spillway {

enum class LogLevel : int { kError = 0, kWarning = 1, kInfo = 2, kDebug = 3 };

bool LogEnabled(LogLevel level);
void Log(LogLevel level, std::string_view message);
// Overrides SPILLWAY_LOG for the rest of the process (spillway.set_log_level in Python).
void SetLogLevel(LogLevel level);

}  // namespace spillway
