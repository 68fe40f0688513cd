// Byte sizes: the size constants, rounding to a granule, and the one formatter for byte counts in
// messages a person reads.
#pragma once

#include <cstdint>
#include <string>

namespace spillway {

inline constexpr uint64_t kKiB = uint64_t{1} << 10;
inline constexpr uint64_t kMiB = uint64_t{1} << 20;
inline constexpr uint64_t kGiB = uint64_t{1} << 30;

// The smallest multiple of `granule` that is >= v. `granule` > 0; need not be a power of two.
constexpr uint64_t RoundUp(uint64_t v, uint64_t granule) {
  return (v + granule - 1) / granule * granule;
}
// The largest multiple of `granule` that is <= v.
constexpr uint64_t RoundDown(uint64_t v, uint64_t granule) { return v / granule * granule; }

// "1.50 GiB (1610612736 bytes)", or "512 B" below a KiB.
std::string FormatBytes(uint64_t bytes);

// Table columns, where the rows compare in one unit: "12.3 MiB".
std::string FormatMiB(uint64_t bytes);
// A change in bytes (growth between two samples; may be negative, may be a mean): "+1.25 MiB".
std::string FormatMiBDelta(double bytes);

// bytes / 2^20 as a double, for tables and reports ("12.34" MiB).
constexpr double ToMiB(uint64_t bytes) {
  return static_cast<double>(bytes) / static_cast<double>(kMiB);
}

}  // namespace spillway
