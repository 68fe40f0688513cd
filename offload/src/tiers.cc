// See tiers.h.
#include "spillway/offload/tiers.h"

namespace spillway::offload {

Result<std::unique_ptr<Tiers>> Tiers::Create(const Config& config, allocator::ScopeId scope) {
  auto t = std::make_unique<Tiers>();  // the ledger's address is stable from here on
  allocator::HostArenaOptions ho = config.HostArenaOptions();
  ho.ledger = &t->ledger;
  auto host = allocator::HostArena::Create(ho);
  if (!host.ok()) return host.status().WithContext("host arena");
  t->host = std::move(*host);
  auto io = allocator::UringEngine::Create(config.EngineOptions(t->host.get()));
  if (!io.ok()) return io.status().WithContext("I/O engine");
  t->io = std::move(*io);
  if (config.any_nvme()) {
    allocator::NvmeArenaOptions no = config.NvmeArenaOptions();
    no.ledger = &t->ledger;
    auto nvme = allocator::NvmeArena::Create(no, t->io.get());
    if (!nvme.ok()) return nvme.status().WithContext("NVMe arena");
    t->nvme = std::move(*nvme);
  }
  auto store = PartitionStore::Create(config, t->host.get(), t->nvme.get(), scope);
  if (!store.ok()) return store.status();
  t->store = std::move(*store);
  return t;
}

}  // namespace spillway::offload
