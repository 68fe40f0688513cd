// Device views: the copies into and out of device memory behind PartitionStore's device tier.
// Note [Spill] in docs/offload.md (its device-view paragraph).
#pragma once

#include <cstdint>
#include <mutex>

#include "spillway/base/status.h"
#include "spillway/offload/transfer_pipeline.h"

namespace spillway::offload {

// Holds no partition state. The store reads a partition's copies under its own lock, marks the
// partition busy, and passes them here; it records what changed when the call returns.
// Thread-safe: mu_ serialises calls into the pipeline, which one thread drives at a time, and is
// held across its I/O (a pipeline call is one transfer, not a wait on other work).
class DeviceViews {
 public:
  // The pipeline (and its device) must outlive this.
  explicit DeviceViews(TransferPipeline* pipeline) : pipeline_(pipeline) {}
  DeviceViews(const DeviceViews&) = delete;
  DeviceViews& operator=(const DeviceViews&) = delete;

  // Where a partition's bytes are now.
  struct Copies {
    const void* host = nullptr;  // the host copy (the newest when present), or null
    uint64_t nvme_off = 0;       // its extent, meaningful when nvme_valid
    bool nvme_valid = false;     // the extent holds its bytes
    uint64_t bytes = 0;
  };
  // A new view holding the newest bytes: the host copy's, else the extent's (straight from NVMe,
  // no host copy made), else zeros (never written). On error nothing is allocated.
  Result<void*> Fill(const Copies& from);
  // Copies a dirty view back into `host`, or to the extent at `nvme_off` when `host` is null.
  // The view is left as it was either way: on error it is the only good copy.
  Status WriteBack(const void* view, void* host, uint64_t nvme_off, uint64_t bytes);
  Status Free(void* view) { return pipeline_->device()->Free(view); }
  const TransferPipeline* pipeline() const { return pipeline_; }

 private:
  TransferPipeline* const pipeline_;
  std::mutex mu_;
};

}  // namespace spillway::offload
