// FormatBytes: byte counts in messages a person reads.
#include "spillway/base/bytes.h"

#include <cinttypes>
#include <cstdio>

namespace spillway {

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
