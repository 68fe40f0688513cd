// OptSchedule: the access order a PartitionStore evicts and prefetches by. It holds the order in
// which one training step uses partitions; the order repeats step after step. A cursor marks the
// last use. From it the schedule answers the two questions Belady's OPT asks: how far away is a
// partition's next use (spill the one furthest away), and which partitions come next (prefetch
// them). A pure structure: no memory, no I/O, no lock (the store calls it under its own).
// docs/offload.md, Note [Spill].
#pragma once

#include <cstdint>
#include <vector>

#include "spillway/base/status.h"

namespace spillway::offload {

using PartitionId = uint32_t;

// Invariants (Validate):
//   order_[u] == p  for every u in uses_[p], and every position u belongs to exactly one p
//   cursor_ < |order_|  when order_ is not empty
class OptSchedule {
 public:
  // The step's order. Partitions must be < `partitions`; a partition may appear several times.
  // The cursor starts at the last position, so the first use is at distance 1. Empty clears it.
  Status Set(std::vector<PartitionId> order, uint64_t partitions);

  // How many uses away `id`'s next use is: 1 for the use right after the cursor, up to size() for
  // the cursor's own position (a full step away). size() + 1 when `id` is not in the schedule:
  // never needed again, so it goes first.
  uint64_t NextUseDistance(PartitionId id) const;

  // `id` is being used now: the cursor moves to its nearest use. Nothing when it has no use.
  void Advance(PartitionId id);

  // The partitions of the next `window` positions after the cursor (at most size() - 1 of them,
  // never wrapping onto the cursor), in order, into `out` (cleared first).
  void Upcoming(uint64_t window, std::vector<PartitionId>* out) const;

  bool Has(PartitionId id) const { return id < uses_.size() && !uses_[id].empty(); }
  uint64_t size() const { return order_.size(); }
  uint64_t cursor() const { return cursor_; }
  const std::vector<PartitionId>& order() const { return order_; }

  // Checks the invariants above; INTERNAL naming the first one broken.
  Status Validate() const;

 private:
  // Distance from the cursor to position `use`, in 1..size().
  uint64_t Distance(uint64_t use) const;

  std::vector<PartitionId> order_;
  std::vector<std::vector<uint64_t>> uses_;  // per partition: its positions in order_
  uint64_t cursor_ = 0;
};

}  // namespace spillway::offload
