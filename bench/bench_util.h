// What the benchmarks share: a benchmark has no error path worth keeping, so a failure ends it
// with the status and the program's name; the median of a sample; seconds since a time point.
#pragma once

#include <errno.h>  // program_invocation_short_name (GNU)

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "spillway/base/status.h"

namespace spillway::bench {

using Clock = std::chrono::steady_clock;

[[noreturn]] inline void Die(const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", program_invocation_short_name, what.c_str());
  std::exit(1);
}
inline void Must(const Status& st) {
  if (!st.ok()) Die(st.ToString());
}
template <typename T>
T Must(Result<T> r) {
  if (!r.ok()) Die(r.status().ToString());
  return std::move(r.value());
}

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

inline double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace spillway::bench
