// The prefetcher: one thread that hands the store's next partitions, one at a time, to a fetch
// callback ahead of the Acquire that will need them. Note [Spill] in docs/offload.md.
#pragma once

#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "spillway/allocator/process.h"
#include "spillway/offload/opt_schedule.h"

namespace spillway::offload {

// Thread-safe. mu_ guards the queue and is never held while `fetch` runs, so a caller may hold its
// own lock across Replace and Clear (the store holds its table lock) as long as `fetch` takes that
// lock only without mu_ (it does: the thread calls it with nothing held). Cancel, Drain and the
// destructor wait for the fetch in flight: never call them holding a lock `fetch` takes.
class Prefetcher {
 public:
  // Starts the thread. `fetch` must be callable until the destructor returns.
  explicit Prefetcher(std::function<void(PartitionId)> fetch);
  // Drops the queue, waits for the fetch in flight and joins the thread. In a forked child, which
  // has no such thread, the thread object is leaked instead (Note [Fork] in docs/allocator.md).
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Makes `*ids` the queue (front first) and hands the old queue's storage back in `*ids`,
  // cleared: a steady state allocates nothing.
  void Replace(std::vector<PartitionId>* ids);
  // Drops what is queued; a fetch in flight goes on.
  void Clear();
  // Drops what is queued and waits for the fetch in flight.
  void Cancel();
  // Waits until nothing is queued or in flight.
  void Drain();
  // The thread's id; constant from construction on.
  std::thread::id thread_id() const { return thread_id_; }

 private:
  void Loop();

  const allocator::ProcessTag process_;
  const std::function<void(PartitionId)> fetch_;
  std::mutex mu_;
  allocator::ForkSafeCondition cv_;  // work queued, a fetch finished, or stopping
  std::vector<PartitionId> queue_;   // guarded by mu_
  bool running_ = false;             // guarded by mu_: a fetch is in flight
  bool stopping_ = false;            // guarded by mu_
  std::thread thread_;
  std::thread::id thread_id_;
};

}  // namespace spillway::offload
