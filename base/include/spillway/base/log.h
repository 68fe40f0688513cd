// Minimal leveled logging. SPILLWAY_LOG=error|warning|info|debug (default warning: informational
// lines print only when asked for). Lines go to stderr, one write(2) each, unless a sink is set:
// the Python module sets one that hands them to Python's `logging` (python/src/log_bridge.cc).
#pragma once

#include <optional>
#include <string_view>

namespace spillway {

enum class LogLevel : int { kError = 0, kWarning = 1, kInfo = 2, kDebug = 3 };

bool LogEnabled(LogLevel level);
void Log(LogLevel level, std::string_view message);
// Overrides SPILLWAY_LOG for the rest of the process (spillway.set_log_level in Python).
void SetLogLevel(LogLevel level);
// "error", "warning", "info" or "debug".
const char* LogLevelName(LogLevel level);
// The level a name names (LogLevelName's inverse), or nullopt.
std::optional<LogLevel> ParseLogLevel(std::string_view name);
// Writes "spillway <level>: <message>" on stderr in one write(2), bypassing any sink and the level
// (for a sink that must put a line on stderr itself).
void LogToStderr(LogLevel level, std::string_view message);

// Where enabled lines go instead of stderr; nullptr (the default) restores stderr. A sink runs on
// the thread that logs, possibly with Spillway's locks held, so it must not block, call into
// Spillway or take a lock a Spillway caller may hold: queue the line and return.
using LogSink = void (*)(LogLevel level, std::string_view message);
void SetLogSink(LogSink sink);

}  // namespace spillway
