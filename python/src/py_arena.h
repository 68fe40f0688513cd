// PyArena: a HostArena as the Python module hands it out (spillway.HostArena), with the ledger its
// boundaries run on. Arenas made by spillway.install() share one ledger, so one epoch or step
// boundary covers the pageable and the pinned arena together.
#pragma once

#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/ledger.h"

namespace spillway::python {

// Thread-safe (HostArena and Ledger are). Tensors from Empty() keep the arena alive.
class PyArena : public std::enable_shared_from_this<PyArena> {
 public:
  // `share_ledger_with`: null for a ledger of its own, or an arena whose ledger this one joins.
  PyArena(uint64_t budget_bytes, allocator::PinMode pin, allocator::EscapePolicy policy,
          const std::string& name, const std::shared_ptr<PyArena>& share_ledger_with);

  // A tensor over exact-size arena memory. The memory returns to the arena when the storage's last
  // reference dies and every event recorded on it through torch's host allocator has completed
  // (Note [Deferred free] in docs/python.md).
  torch::Tensor Empty(const std::vector<int64_t>& shape, c10::ScalarType dtype,
                      allocator::Kind kind, allocator::Lifetime lifetime, uint64_t owner);
  bool Owns(const torch::Tensor& t) const;
  // Whether [ptr, ptr + bytes) is memory of this arena (any live allocation's pages).
  bool Contains(const void* ptr, uint64_t bytes) const { return arena_->Contains(ptr, bytes); }

  allocator::Ledger& ledger() { return *ledger_; }
  // False in a process forked from the one that made it (whose memory the child does not have).
  bool made_in_this_process() const { return process_.InOwner(); }
  allocator::HostArena* get() { return arena_.get(); }
  const std::string& name() const { return arena_->tier_name(); }

 private:
  std::shared_ptr<allocator::Ledger> ledger_;  // declared first: destroyed after the arena
  std::unique_ptr<allocator::HostArena> arena_;
  const allocator::ProcessTag process_;
};

}  // namespace spillway::python
