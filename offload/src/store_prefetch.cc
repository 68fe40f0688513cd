// PartitionStore's prefetch: the next partitions of the schedule swapped in ahead of the Acquire
// that needs them, on the prefetcher's thread. Note [Spill] in docs/offload.md.
#include "prefetcher.h"
#include "spillway/base/check.h"
#include "spillway/base/log.h"
#include "spillway/offload/partition_store.h"

namespace spillway::offload {

void PartitionStore::QueuePrefetchLocked() {
  if (prefetcher_ == nullptr || schedule_.size() == 0) return;
  // The window of schedule entries after the cursor: O(window) per Acquire, in storage the
  // prefetcher hands back. Not those already in, nor one whose device view is live (a host copy
  // would be stale).
  schedule_.Upcoming(prefetch_window_, &prefetch_next_);
  std::erase_if(prefetch_next_, [this](PartitionId id) {
    return parts_[id].host != nullptr || parts_[id].device != nullptr;
  });
  prefetcher_->Replace(&prefetch_next_);
}

void PartitionStore::PrefetchOne(PartitionId id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Part& p = parts_[id];
    // Already there, someone is on it, or its device view is live (a host copy would be stale).
    if (stopping_ || p.host != nullptr || p.busy || p.device != nullptr || p.device_pins > 0) {
      return;
    }
    MarkBusy(p);
  }
  Status st = SwapIn(id);  // may spill others under the budget (never a pinned one)
  std::lock_guard<std::mutex> lock(mu_);
  ClearBusyLocked(id);
  if (st.ok()) {
    parts_[id].last_use = ++use_clock_;  // brought in for a use: LRU must not spill it first
    stats_.prefetches++;
  } else {
    stats_.prefetch_failures++;  // the Acquire that needs it will retry and report the error
  }
}

void PartitionStore::DrainPrefetch() {
  if (prefetcher_ != nullptr) prefetcher_->Drain();
}

PartitionStore::OffSchedule::OffSchedule(PartitionStore& store) : store_(store) {
  {
    std::lock_guard<std::mutex> lock(store_.mu_);
    store_.off_schedule_++;  // from here no Acquire queues a prefetch
  }
  if (store_.prefetcher_ != nullptr) store_.prefetcher_->Cancel();  // without mu_: it waits
}

PartitionStore::OffSchedule::~OffSchedule() {
  std::lock_guard<std::mutex> lock(store_.mu_);
  store_.off_schedule_--;
}

Status PartitionStore::Prefetch(const std::vector<PartitionId>& ids) {
  SPILLWAY_VALIDATE_ON_EXIT(*this);  // first: runs after every lock below is released
  SPILLWAY_RETURN_IF_ERROR(process_.Check("PartitionStore", "Prefetch"));  // Note [Fork]
  for (PartitionId id : ids) {
    SPILLWAY_ASSIGN_OR_RETURN(auto h, Acquire(id, Access::kRead));
  }
  return Status::Ok();
}

}  // namespace spillway::offload
