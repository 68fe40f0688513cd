// See tiers.h.
#include "spillway/offload/tiers.h"

#include "spillway/base/log.h"

namespace spillway::offload {

Result<std::unique_ptr<Tiers>> Tiers::Create(const Config& config, allocator::ScopeId scope) {
  auto t = std::make_unique<Tiers>();  // the ledger's address is stable from here on
  allocator::HostArenaOptions ho = config.HostArenaOptions();
  ho.ledger = &t->ledger;
  auto host = allocator::HostArena::Create(ho);
  if (!host.ok()) return host.status().WithContext("host arena");
  t->host = std::move(*host);
  auto io = allocator::IoEngine::Create(config.EngineOptions(t->host.get()));
  if (!io.ok()) return io.status().WithContext("I/O engine");
  t->io = std::move(*io);
  // A config that homes something on NVMe has its arena there. One with host-homed offload
  // ("cpu") gets a spill arena: an empty swap file that grows only when the host budget is full
  // and the store spills (Note [Spill] in docs/offload.md); the first spill says where.
  const bool spill_only =
      !config.any_nvme() && (config.offload_param.device == OffloadDevice::kCpu ||
                             config.offload_optimizer.device == OffloadDevice::kCpu);
  std::string spill_dir;
  if (config.any_nvme() || spill_only) {
    allocator::NvmeArenaOptions no =
        spill_only ? config.SpillArenaOptions() : config.NvmeArenaOptions();
    no.ledger = &t->ledger;
    auto nvme = allocator::NvmeArena::Create(no, t->io.get());
    if (nvme.ok()) {
      t->nvme = std::move(*nvme);
      spill_dir = no.directory;
    } else if (!spill_only) {
      return nvme.status().WithContext("NVMe arena");
    } else if (!config.spillway.spill_path.empty()) {
      return nvme.status().WithContext(
          StrCat("the spill arena in ", no.directory, " (spillway.spill_path)"));
    } else {
      // The default place did not work and nobody asked for it: run without spilling, and say so.
      Log(LogLevel::kWarning,
          StrCat("no spill arena in ", no.directory, " (", nvme.status().message(),
                 "): partitions cannot spill over the host budget; set "
                 "spillway.spill_path to a writable directory on a local disk"));
    }
  }
  SPILLWAY_ASSIGN_OR_RETURN(t->store, PartitionStore::Create(config, t->host.get(), t->nvme.get(),
                                                             scope, config.PrefetchWindow()));
  if (spill_only) {
    t->store->SetSpillNotice(
        StrCat("the host budget (spillway.host_budget_bytes) is full: spilling "
               "partitions to a swap file in ",
               spill_dir, " (spillway.spill_path; the config homes nothing on NVMe)"));
  }
  return t;
}

Result<TransferPipeline*> Tiers::OpenDevicePipeline(const Config& config, DeviceId compute) {
  if (config.offload_param.device != OffloadDevice::kNvme)
    return static_cast<TransferPipeline*>(nullptr);
  if (pipeline != nullptr)
    return Status::FailedPrecondition("Tiers::OpenDevicePipeline: already open");
  if (nvme == nullptr || store == nullptr) {
    return Status::FailedPrecondition(
        "Tiers::OpenDevicePipeline: parameters on NVMe need the NVMe arena and the store");
  }
  auto d = compute.type == DeviceType::kCuda ? Device::OpenCuda(compute.index) : Device::OpenCpu();
  if (!d.ok() && compute.type == DeviceType::kCuda &&
      d.status().code() == StatusCode::kUnavailable) {
    // libtorch computes on the GPU but Spillway's device seam cannot reach it (a build without
    // CUDA): the parameters are gathered in host memory and copied by libtorch, and the log says
    // so.
    Log(LogLevel::kWarning,
        StrCat("parameters on NVMe reach ", compute.ToString(),
               " through host memory, not the transfer pipeline: ", d.status().message()));
    return static_cast<TransferPipeline*>(nullptr);
  }
  if (!d.ok()) return d.status().WithContext(StrCat("the compute device ", compute.ToString()));
  TransferPipelineOptions po;
  po.chunk_bytes = config.aio.block_size;
  auto p = TransferPipeline::Create(host.get(), nvme.get(), d->get(), po);
  if (!p.ok())
    return p.status().WithContext(StrCat("the transfer pipeline to ", compute.ToString()));
  // Attached before it is kept: on an error the pipeline goes, then its device (locals, in order).
  SPILLWAY_RETURN_IF_ERROR(store->AttachDevice(p->get()));
  device = std::move(*d);
  pipeline = std::move(*p);
  return pipeline.get();
}

}  // namespace spillway::offload
