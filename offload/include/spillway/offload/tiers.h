// The storage a Config describes, composed the one way every entry point needs it (`spillway
// train`, the Python module's train_gpt): one ledger; the host arena; the io_uring engine over it;
// the NVMe arena when anything is placed on NVMe; the partition store over them.
#pragma once

#include <memory>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/base/status.h"
#include "spillway/offload/config.h"
#include "spillway/offload/device.h"
#include "spillway/offload/device_guard.h"
#include "spillway/offload/partition_store.h"
#include "spillway/offload/transfer_pipeline.h"

namespace spillway::offload {

struct Tiers {
  // Members in dependency order, so destruction runs the other way: the store before the pipeline
  // it may hold, the pipeline before its device and the arenas it stages through, the NVMe arena
  // before the engine it submits to, the arenas before the ledger they report to.
  allocator::Ledger ledger;
  std::unique_ptr<allocator::HostArena> host;
  std::unique_ptr<allocator::IoEngine> io;
  std::unique_ptr<allocator::NvmeArena> nvme;  // null when the config places nothing on NVMe
  std::unique_ptr<Device> device;              // OpenDevicePipeline's; null before it
  std::unique_ptr<TransferPipeline> pipeline;  // likewise
  std::unique_ptr<PartitionStore> store;

  // Errors carry which tier failed ("host arena: ...", "NVMe arena: ..."); whatever was made
  // before the failure is released. The store's partitions belong to `scope`.
  static Result<std::unique_ptr<Tiers>> Create(const Config& config,
                                               allocator::ScopeId scope = allocator::kProcessScope);

  // The path from NVMe to the compute device (Note [Pipeline] in docs/offload.md): when the config
  // homes parameters on NVMe, opens `compute` (cpu: the CPU backend; cuda:N) and a TransferPipeline
  // staging through the host arena (aio.block_size chunks, a ring of 4), and attaches it to the
  // store. Returns it, or null when parameters are not on NVMe, or (with a warning) when the
  // compute device is a GPU this build of Spillway cannot reach (no CUDA). Call once, before
  // training.
  Result<TransferPipeline*> OpenDevicePipeline(const Config& config, DeviceId compute);
};

}  // namespace spillway::offload
