// SharedArena: a HostArena with the ledger its boundaries run on and the process that made it, as
// torch's allocators and tensors share it (spillway.HostArena in Python). Arenas made by one
// installation share one ledger, so one epoch or step boundary covers the pageable and the pinned
// arena together. No torch here: the deferred-block table (block_table.h) holds these.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/process.h"
#include "spillway/base/status.h"

namespace spillway::torch_alloc {

struct SharedArenaOptions {
  std::string name;
  uint64_t budget_bytes = 0;
  allocator::PinMode pin = allocator::PinMode::kAuto;
  allocator::EscapePolicy policy = allocator::EscapePolicy::kReport;
  // HostArenaOptions::peak_slack: how far the retained cache may lift the high-water mark.
  double peak_slack = allocator::HostArenaOptions{}.peak_slack;
};

// Thread-safe (HostArena and Ledger are). Tensors over it keep it alive through shared_ptr.
class SharedArena {
 public:
  // `share_ledger_with`: null for a ledger of its own, or an arena whose ledger this one joins.
  static Result<std::shared_ptr<SharedArena>> Create(
      const SharedArenaOptions& options,
      const std::shared_ptr<SharedArena>& share_ledger_with = nullptr);

  // Whether [ptr, ptr + bytes) is memory of this arena (any live allocation's pages).
  bool Contains(const void* ptr, uint64_t bytes) const { return arena_->Contains(ptr, bytes); }
  allocator::Ledger& ledger() { return *ledger_; }
  // False in a process forked from the one that made it (whose memory the child does not have).
  bool made_in_this_process() const { return process_.InOwner(); }
  allocator::HostArena* get() { return arena_.get(); }
  const allocator::HostArena* get() const { return arena_.get(); }
  const std::string& name() const { return arena_->tier_name(); }

 private:
  explicit SharedArena(std::shared_ptr<allocator::Ledger> ledger) : ledger_(std::move(ledger)) {}
  std::shared_ptr<allocator::Ledger> ledger_;  // declared first: destroyed after the arena
  std::unique_ptr<allocator::HostArena> arena_;
  const allocator::ProcessTag process_;
};

}  // namespace spillway::torch_alloc
