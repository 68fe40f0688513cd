// The store's per-thread spill note: the memory-wait deadline of the store's allocation in
// progress, shared by every spill-handler call the arena makes for it, and why the last Spill freed
// less than asked. Private to offload/src. Note [Spill] in docs/offload.md.
#pragma once

#include <chrono>
#include <string>

#include "spillway/offload/partition_store.h"

namespace spillway::offload {

struct SpillNote {
  const PartitionStore* store = nullptr;
  std::string text;
  bool has_deadline = false;
  std::chrono::steady_clock::time_point deadline;
};

// This thread's note (defined in spill.cc).
SpillNote& ThisThreadsSpillNote();

// Starts one of the store's own allocations: every Spill call for it shares one deadline.
inline void BeginStoreAllocation(const PartitionStore* store, std::chrono::milliseconds wait) {
  ThisThreadsSpillNote() =
      SpillNote{store, std::string(), true, std::chrono::steady_clock::now() + wait};
}

}  // namespace spillway::offload
