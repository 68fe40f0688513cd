// Memory of a process tree as the kernel accounts it: Rss and Pss summed over a process and all its
// descendants, from /proc/<pid>/smaps_rollup. Pss divides each shared page among its sharers, so
// the sum over a tree counts every physical page once; a copy-on-write copy after fork() shows up
// as growth of the sum. This is the leak detector's ground truth, independent of Spillway's own
// books.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "spillway/base/status.h"

namespace spillway::cli {

struct TreeMemory {
  uint64_t rss_bytes = 0;  // over-counts shared pages; shown for comparison only
  uint64_t pss_bytes = 0;
  // Anonymous pages only (Pss_Anon). Copy-on-write copies are anonymous, and anonymous pages are
  // shared only through fork, so this sum is the tree's own: unlike pss_bytes it does not move when
  // an unrelated process maps or unmaps the same shared libraries. The leak detectors use it.
  uint64_t pss_anon_bytes = 0;
  uint32_t processes = 0;
};

// `pid` and its descendants (found through /proc/<pid>/task/<tid>/children). A descendant that
// exits while being read is skipped; `pid` itself missing is INVALID_ARGUMENT, and a kernel without
// Pss_Anon in smaps_rollup (before Linux 5.9) is UNAVAILABLE.
Result<TreeMemory> ProcessTreeMemory(pid_t pid);

// The largest tree anonymous PSS of `pid` while it runs: a thread samples ProcessTreeMemory every
// `interval` from construction until Stop (both ends sampled). For peaks that last milliseconds,
// such as a checkpoint save.
class PeakSampler {
 public:
  explicit PeakSampler(pid_t pid,
                       std::chrono::milliseconds interval = std::chrono::milliseconds(2));
  ~PeakSampler();
  PeakSampler(const PeakSampler&) = delete;
  PeakSampler& operator=(const PeakSampler&) = delete;
  // The largest pss_anon_bytes seen; the first failure to read /proc if there was one.
  Result<uint64_t> Stop();

 private:
  void Sample();
  const pid_t pid_;
  const std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  uint64_t peak_ = 0;  // written by the sampling thread; read after join
  Status error_;       // likewise
  std::thread thread_;
};

// The children of every thread of `pid` (one level).
std::vector<pid_t> ChildProcesses(pid_t pid);

}  // namespace spillway::cli
