// OptSchedule: one step's access order and the distance to each partition's next use.
#include "spillway/offload/opt_schedule.h"

#include <algorithm>
#include <limits>

namespace spillway::offload {

Status OptSchedule::Set(std::vector<PartitionId> order, uint64_t partitions) {
  for (PartitionId id : order) {
    if (id >= partitions) {
      return Status::InvalidArgument(StrCat("OptSchedule::Set: partition ", id,
                                            " is not registered (ids run below ", partitions,
                                            "); schedule registered partitions only"));
    }
  }
  uses_.assign(partitions, {});
  for (uint64_t pos = 0; pos < order.size(); ++pos) uses_[order[pos]].push_back(pos);
  order_ = std::move(order);
  cursor_ = order_.empty() ? 0 : order_.size() - 1;
  return Status::Ok();
}

uint64_t OptSchedule::Distance(uint64_t use) const {
  const uint64_t len = order_.size();
  return (use + len - cursor_ - 1) % len + 1;
}

uint64_t OptSchedule::NextUseDistance(PartitionId id) const {
  uint64_t best = order_.size() + 1;  // never used again under the schedule
  if (id >= uses_.size()) return best;
  for (uint64_t u : uses_[id]) best = std::min(best, Distance(u));
  return best;
}

void OptSchedule::Advance(PartitionId id) {
  if (!Has(id)) return;
  uint64_t best = uses_[id].front();
  uint64_t best_d = std::numeric_limits<uint64_t>::max();
  for (uint64_t u : uses_[id]) {
    const uint64_t d = Distance(u);
    if (d < best_d) {
      best_d = d;
      best = u;
    }
  }
  cursor_ = best;
}

void OptSchedule::Upcoming(uint64_t window, std::vector<PartitionId>* out) const {
  out->clear();
  const uint64_t len = order_.size();
  for (uint64_t k = 1; k <= window && k < len; ++k) out->push_back(order_[(cursor_ + k) % len]);
}

Status OptSchedule::Validate() const {
  if (!order_.empty() && cursor_ >= order_.size()) {
    return Status::Internal(
        StrCat("OptSchedule: cursor ", cursor_, " past the ", order_.size(), " positions"));
  }
  uint64_t uses = 0;
  for (PartitionId id = 0; id < uses_.size(); ++id) {
    for (uint64_t u : uses_[id]) {
      if (u >= order_.size() || order_[u] != id) {
        return Status::Internal(
            StrCat("OptSchedule: partition ", id, " claims position ", u, ", which is not its"));
      }
    }
    uses += uses_[id].size();
  }
  if (uses != order_.size()) {
    return Status::Internal(StrCat("OptSchedule: ", order_.size(),
                                   " positions, the partitions "
                                   "claim ",
                                   uses));
  }
  return Status::Ok();
}

}  // namespace spillway::offload
