// FormatBytes, FormatMiB, FormatMiBDelta: byte counts a person reads.
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

std::string FormatMiB(uint64_t bytes) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", ToMiB(bytes));
  return buf;
}

std::string FormatMiBDelta(double bytes) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%+.2f MiB", bytes / static_cast<double>(kMiB));
  return buf;
}

}  // namespace spillway
