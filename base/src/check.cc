// The failure path of SPILLWAY_CHECK / SPILLWAY_DCHECK: one line on stderr, then abort.
#include "spillway/base/check.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace spillway::internal {

void Fatal(std::string_view message) {
  // One write(2), no allocation after the string is built, no lock: this may run with any of
  // Spillway's locks held, or in a forked child.
  std::string line = "spillway fatal: ";
  line.append(message);
  line.push_back('\n');
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) break;
    p += n;
    left -= static_cast<size_t>(n);
  }
  std::abort();
}

CheckFailure::CheckFailure(const char* file, int line, const char* condition) {
  out_ << file << ":" << line << ": CHECK failed: " << condition;
}

CheckFailure::~CheckFailure() {
  std::string message = out_.str();
  Fatal(message);
}

}  // namespace spillway::internal
