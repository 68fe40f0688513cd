// The prefetcher's thread and queue. Note [Spill] in docs/offload.md.
#include "prefetcher.h"

#include <utility>

namespace spillway::offload {

Prefetcher::Prefetcher(std::function<void(PartitionId)> fetch) : fetch_(std::move(fetch)) {
  thread_ = std::thread([this] { Loop(); });
  thread_id_ = thread_.get_id();
}

Prefetcher::~Prefetcher() {
  if (!process_.InOwner()) {
    // A forked child has no prefetch thread to join.
    // NOLINTNEXTLINE(bugprone-unhandled-exception-at-new): a child that cannot allocate here ends
    new std::thread(std::move(thread_));  // leaked on purpose
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    queue_.clear();
  }
  cv_.notify_all();
  thread_.join();
}

void Prefetcher::Replace(std::vector<PartitionId>* ids) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.swap(*ids);
  }
  ids->clear();
  cv_.notify_all();
}

void Prefetcher::Clear() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.clear();
  }
  cv_.notify_all();  // a Drain waiting for the queue to empty
}

void Prefetcher::Cancel() {
  std::unique_lock<std::mutex> lock(mu_);
  queue_.clear();
  cv_.notify_all();  // a Drain waiting for the queue to empty
  cv_.wait(lock, [this] { return !running_; });
}

void Prefetcher::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return queue_.empty() && !running_; });
}

void Prefetcher::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    const PartitionId id = queue_.front();
    queue_.erase(queue_.begin());  // the window is short (at most 1024)
    running_ = true;
    lock.unlock();
    fetch_(id);
    lock.lock();
    running_ = false;
    cv_.notify_all();
  }
}

}  // namespace spillway::offload
