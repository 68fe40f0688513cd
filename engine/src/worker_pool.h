// WorkerPool: a fixed set of threads that run `tasks` independent tasks of one job, with the
// calling thread taking tasks too. Tasks are claimed from an atomic counter, so a slow thread
// never holds up the others' share. Thread-safe: concurrent Run calls are serialized.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace spillway::engine {

class WorkerPool {
 public:
  // `threads` counts the caller: 1 means no extra threads.
  explicit WorkerPool(uint32_t threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Runs fn(0) ... fn(tasks - 1), each once, and returns when all have finished.
  void Run(size_t tasks, const std::function<void(size_t)>& fn);
  uint32_t threads() const { return static_cast<uint32_t>(workers_.size()) + 1; }

 private:
  void WorkerLoop();
  void Drain();  // claims and runs tasks of the current job until none is left

  std::mutex run_mu_;  // serializes Run
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;                           // guarded by mu_
  bool stop_ = false;                                 // guarded by mu_
  uint32_t busy_workers_ = 0;                         // guarded by mu_
  const std::function<void(size_t)>* job_ = nullptr;  // set under mu_ before generation_ moves
  size_t tasks_ = 0;                                  // likewise
  std::atomic<size_t> next_{0};
  std::vector<std::thread> workers_;
};

}  // namespace spillway::engine
