// See rig.h.
#include "leak/rig.h"

#include <unistd.h>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/cli/proc_memory.h"
#include "spillway/offload/partition_store.h"

namespace spillway::cli::leak {

std::string ScratchDir(const LeakSuiteOptions& suite) {
  return suite.scratch_dir.empty() ? suite.out_dir : suite.scratch_dir;
}

offload::Config RigConfig(const LeakSuiteOptions& suite, const RigOptions& options) {
  using offload::OffloadDevice;
  offload::Config c;
  c.zero_stage = 3;
  const std::string scratch = ScratchDir(suite);
  if (options.offload == OffloadDevice::kNvme) {
    c.offload_param.device = OffloadDevice::kNvme;
    c.offload_param.nvme_path = scratch;
  } else if (options.offload == OffloadDevice::kCpu) {
    c.offload_param.device = OffloadDevice::kCpu;
    c.offload_optimizer.device = OffloadDevice::kCpu;
  }
  c.offload_param.pin_memory = true;
  c.aio.block_size = options.block_size;
  // The engine's own defaults, as the scenarios have always run it.
  c.aio.queue_depth = allocator::IoEngineOptions{}.queue_depth;
  c.aio.intra_op_parallelism = allocator::IoEngineOptions{}.pool_threads;
  c.prefetch_bucket_size = 0;  // PrefetchWindow() == 0
  c.spillway.host_budget_bytes = options.host_budget_bytes;
  c.spillway.nvme_budget_bytes = 1ull << 30;
  c.spillway.spill_path = scratch;  // kCpu's NVMe arena
  c.spillway.host_region_bytes = options.region_bytes;
  c.spillway.bounce_buffers = options.bounce_buffers;
  return c;
}

Result<std::unique_ptr<offload::Tiers>> MakeRig(const LeakSuiteOptions& suite,
                                                const RigOptions& options) {
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<offload::Tiers> rig,
                            offload::Tiers::Create(RigConfig(suite, options)));
  rig->store->SetSpillNotice("");  // the scenarios report spills in their own notes
  return rig;
}

Result<double> TreePss() {
  SPILLWAY_ASSIGN_OR_RETURN(const TreeMemory m, ProcessTreeMemory(getpid()));
  return static_cast<double>(m.pss_anon_bytes);
}

uint64_t Escapes(const allocator::BoundaryReport& report, std::string* first_site) {
  if (first_site != nullptr && first_site->empty()) {
    for (const auto& t : report.tiers) {
      for (const auto& e : t.escapes) {
        if (!e.site.empty()) {
          *first_site = e.site;
          break;
        }
      }
    }
  }
  return report.escape_count();
}

Status SampleLiveAtStep(offload::Tiers& rig, LeakSeries* series, int64_t step, int64_t epoch,
                        std::string* first_site) {
  allocator::BoundaryReport report;
  SPILLWAY_RETURN_IF_ERROR(rig.ledger.EndStep(&report));
  series->escapes += Escapes(report, first_site);
  series->Add(step, epoch, /*boundary=*/false, HostLive(rig));
  return Status::Ok();
}

Status SampleLiveAtEpoch(offload::Tiers& rig, LeakSeries* series, int64_t step, int64_t epoch,
                         std::string* first_site) {
  allocator::BoundaryReport report;
  SPILLWAY_RETURN_IF_ERROR(rig.ledger.EndEpoch(&report));
  series->escapes += Escapes(report, first_site);
  series->Add(step, epoch, /*boundary=*/true, HostLive(rig));
  return Status::Ok();
}

}  // namespace spillway::cli::leak
