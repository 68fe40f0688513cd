// Collector: turns stats snapshots into Prometheus metric families at scrape time.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/engine/host_optimizer.h"
#include "spillway/offload/partition_store.h"
#include "spillway/offload/transfer_pipeline.h"

namespace spillway::metrics {

// Thread-safe: mu_ guards the watch lists and is held for a whole Collect, so Unwatch cannot
// free a component mid-scrape. Collect takes each component's own lock briefly through Stats();
// the only syscalls it makes (reading /proc/self) happen before mu_ is taken.
class Collector final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override;

  void Watch(const allocator::HostArena* a);
  void Watch(const allocator::NvmeArena* a);
  void Watch(const allocator::IoEngine* e);
  void Watch(const allocator::Ledger* l);
  void Watch(const offload::PartitionStore* s);
  void Watch(const offload::TransferPipeline* p);
  void Watch(const engine::HostOptimizer* o);
  void Watch(const allocator::NodeGovernor* g);
  void Unwatch(const void* component);
  // Labels added to every sample of every later scrape.
  void SetConstLabels(std::vector<std::pair<std::string, std::string>> labels);

 private:
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, std::string>> const_labels_;  // guarded by mu_
  std::vector<const allocator::HostArena*> hosts_;                 // guarded by mu_
  std::vector<const allocator::NvmeArena*> nvmes_;                 // guarded by mu_
  std::vector<const allocator::IoEngine*> engines_;                // guarded by mu_
  std::vector<const allocator::Ledger*> ledgers_;                  // guarded by mu_
  std::vector<const offload::PartitionStore*> stores_;             // guarded by mu_
  std::vector<const offload::TransferPipeline*> pipelines_;        // guarded by mu_
  std::vector<const engine::HostOptimizer*> optimizers_;           // guarded by mu_
  std::vector<const allocator::NodeGovernor*> nodes_;              // guarded by mu_
};

}  // namespace spillway::metrics
