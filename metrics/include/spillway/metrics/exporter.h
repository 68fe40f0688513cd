// Exporter: a live Prometheus /metrics endpoint for Spillway. A scrape reads the stats snapshots of
// the watched components (arenas, engines, the ledger) and renders them; nothing on the allocation
// or I/O hot path calls prometheus-cpp or takes a lock for metrics. See docs/metrics.md.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/ledger.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/base/status.h"
#include "spillway/engine/host_optimizer.h"
#include "spillway/offload/partition_store.h"
#include "spillway/offload/transfer_pipeline.h"

namespace prometheus {
class Exposer;
}

namespace spillway::metrics {

struct ExporterOptions {
  std::string address = "127.0.0.1:9464";  // host:port; port 0 picks a free one
  bool enabled = true;                     // false: serve nothing (Render still works)
  // Labels added to every sample, e.g. {"rank", "3"} so the ranks of one job can be told apart.
  // Keep them few and bounded (Prometheus conventions): never an id that changes per run.
  std::vector<std::pair<std::string, std::string>> const_labels;
};

class Collector;  // src/collector.h

// Thread-safe. Watched components must stay alive until unwatched or until the exporter is
// destroyed; Unwatch waits for a scrape in progress.
class Exporter {
 public:
  // Binds the address and starts serving. A port already in use is an UNAVAILABLE status naming
  // the address and the setting to change, never a crash.
  static Result<std::unique_ptr<Exporter>> Start(const ExporterOptions& options);
  ~Exporter();
  Exporter(const Exporter&) = delete;
  Exporter& operator=(const Exporter&) = delete;

  void Watch(const allocator::HostArena* arena);
  void Watch(const allocator::NvmeArena* arena);
  void Watch(const allocator::IoEngine* engine);
  void Watch(const allocator::Ledger* ledger);
  void Watch(const offload::PartitionStore* store);
  void Watch(const offload::TransferPipeline* pipeline);
  void Watch(const engine::HostOptimizer* optimizer);
  // The node's ledger (every local rank's bytes; the same series from each rank's exporter).
  void Watch(const allocator::NodeGovernor* node);
  void Unwatch(const void* component);

  // The port actually bound (useful with port 0); 0 when disabled.
  int port() const { return port_; }
  std::string address() const;
  // The text exposition a scrape returns now.
  std::string Render() const;

 private:
  Exporter() = default;
  std::shared_ptr<Collector> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string host_;
  int port_ = 0;
};

}  // namespace spillway::metrics
