// WorkerPool. See worker_pool.h.
#include "worker_pool.h"

namespace spillway::engine {

WorkerPool::WorkerPool(uint32_t threads) {
  for (uint32_t i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void WorkerPool::Drain() {
  for (;;) {
    const size_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= tasks_) return;
    (*job_)(i);
  }
}

void WorkerPool::WorkerLoop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    lock.unlock();
    Drain();
    lock.lock();
    if (--busy_workers_ == 0) done_cv_.notify_one();
  }
}

void WorkerPool::Run(size_t tasks, const std::function<void(size_t)>& fn) {
  if (tasks == 0) return;
  std::lock_guard<std::mutex> run_lock(run_mu_);
  if (workers_.empty() || tasks == 1) {
    for (size_t i = 0; i < tasks; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    tasks_ = tasks;
    next_.store(0, std::memory_order_relaxed);
    busy_workers_ = static_cast<uint32_t>(workers_.size());
    ++generation_;
  }
  start_cv_.notify_all();
  Drain();
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return busy_workers_ == 0; });
  job_ = nullptr;
}

}  // namespace spillway::engine
