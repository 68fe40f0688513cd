// Monotonic nanoseconds for the engine's timing stats.
#pragma once

#include <chrono>
#include <cstdint>

namespace spillway::engine {

inline uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace spillway::engine
