// The storage a Config describes, composed the one way every entry point needs it (`spillway
// train`, the Python module's train_gpt): one ledger; the host arena; the io_uring engine over it;
// the NVMe arena when anything is placed on NVMe; the partition store over them.
#pragma once

#include <memory>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/allocator/status.h"
#include "spillway/allocator/uring_engine.h"
#include "spillway/offload/config.h"
#include "spillway/offload/partition_store.h"

namespace spillway::offload {

struct Tiers {
  // Members in dependency order, so destruction runs the other way: the store before the arenas,
  // the NVMe arena before the engine it submits to, the arenas before the ledger they report to.
  allocator::Ledger ledger;
  std::unique_ptr<allocator::HostArena> host;
  std::unique_ptr<allocator::UringEngine> io;
  std::unique_ptr<allocator::NvmeArena> nvme;  // null when the config places nothing on NVMe
  std::unique_ptr<PartitionStore> store;

  // Errors carry which tier failed ("host arena: ...", "NVMe arena: ..."); whatever was made
  // before the failure is released. The store's partitions belong to `scope`.
  static Result<std::unique_ptr<Tiers>> Create(const Config& config,
                                               allocator::ScopeId scope = allocator::kProcessScope);
};

}  // namespace spillway::offload
