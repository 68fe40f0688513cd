// Exporter: prometheus-cpp's CivetWeb exposer serving the Collector.
#include "spillway/metrics/exporter.h"

#include <prometheus/exposer.h>
#include <prometheus/text_serializer.h>

#include <exception>

#include "collector.h"
#include "spillway/base/bytes.h"
#include "thread_stack_floor.h"

namespace spillway::metrics {

Result<std::unique_ptr<Exporter>> Exporter::Start(const ExporterOptions& options) {
  std::unique_ptr<Exporter> e(new Exporter());
  e->collector_ = std::make_shared<Collector>();
  e->collector_->SetConstLabels(options.const_labels);
  if (!options.enabled) return e;
  const auto colon = options.address.rfind(':');
  if (colon == std::string::npos || colon + 1 == options.address.size()) {
    return Status::InvalidArgument(
        StrCat("metrics address '", options.address, "' is not host:port; e.g. 127.0.0.1:9464"));
  }
  e->host_ = options.address.substr(0, colon);
  try {
    e->exposer_ = std::make_unique<prometheus::Exposer>(options.address, 2);
  } catch (const std::exception& ex) {
    // CivetWeb says "null context" both for a port in use and for threads it could not start.
    // Its threads get at least ThreadStackFloor() bytes of stack where the floor is in force
    // (Note [Thread stack floor]); where it is not (inside Python), find out which it was.
    if (!ThreadStackFloorActive() && !ThreadWithStackStarts(kCivetWebThreadStack)) {
      return Status::Make(
          StatusCode::kUnavailable,
          StrCat("metrics exporter could not start on ", options.address, " (", ex.what(),
                 "): a thread with CivetWeb's ", FormatBytes(kCivetWebThreadStack),
                 " stack cannot start in this process, because libraries loaded at process start "
                 "(LD_PRELOAD, or the executable's own dependencies) hold more static TLS than "
                 "that. Spillway's executables raise such stacks (Note [Thread stack floor]); a "
                 "Python extension cannot. Load those libraries later (import them instead of "
                 "preloading), or serve metrics from a spillway binary"));
    }
    return Status::Make(
        StatusCode::kUnavailable,
        StrCat("metrics exporter could not listen on ", options.address, " (", ex.what(),
               "); the port is probably in use. Set "
               "spillway.metrics_address to a free port, or turn metrics off",
               ThreadStackFloorActive()
                   ? StrCat(" (its threads had ", FormatBytes(ThreadStackFloor()), " of stack)")
                   : std::string()));
  }
  e->exposer_->RegisterCollectable(e->collector_, "/metrics");
  const auto ports = e->exposer_->GetListeningPorts();
  e->port_ = ports.empty() ? 0 : ports.front();
  return e;
}

Exporter::~Exporter() { exposer_.reset(); }  // stop serving before the collector goes

void Exporter::Watch(const allocator::HostArena* a) { collector_->Watch(a); }
void Exporter::Watch(const allocator::NvmeArena* a) { collector_->Watch(a); }
void Exporter::Watch(const allocator::IoEngine* e) { collector_->Watch(e); }
void Exporter::Watch(const allocator::Ledger* l) { collector_->Watch(l); }
void Exporter::Watch(const offload::PartitionStore* s) { collector_->Watch(s); }
void Exporter::Watch(const offload::TransferPipeline* p) { collector_->Watch(p); }
void Exporter::Watch(const engine::HostOptimizer* o) { collector_->Watch(o); }
void Exporter::Watch(const allocator::NodeGovernor* g) { collector_->Watch(g); }
void Exporter::Unwatch(const void* c) { collector_->Unwatch(c); }

std::string Exporter::address() const { return StrCat(host_, ":", port_); }

std::string Exporter::Render() const {
  return prometheus::TextSerializer().Serialize(collector_->Collect());
}

}  // namespace spillway::metrics
