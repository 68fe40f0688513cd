// SharedArena (shared_arena.h): an arena and the ledger it shares.
#include "spillway/torch_alloc/shared_arena.h"

#include <utility>

namespace spillway::torch_alloc {

Result<std::shared_ptr<SharedArena>> SharedArena::Create(
    const SharedArenaOptions& options, const std::shared_ptr<SharedArena>& share_ledger_with) {
  std::shared_ptr<SharedArena> made(new SharedArena(
      share_ledger_with ? share_ledger_with->ledger_ : std::make_shared<allocator::Ledger>()));
  allocator::HostArenaOptions o;
  o.name = options.name;
  o.budget_bytes = options.budget_bytes;
  o.pin = options.pin;
  o.policy = options.policy;
  o.peak_slack = options.peak_slack;
  o.ledger = made->ledger_.get();
  SPILLWAY_ASSIGN_OR_RETURN(made->arena_, allocator::HostArena::Create(o));
  return made;
}

}  // namespace spillway::torch_alloc
