// TransferPipeline: moves a partition NVMe -> pinned staging -> device (and back) in chunks, with a
// small ring of staging buffers so the disk read of the next chunks overlaps the device copy of
// this one. Checksums are checked as chunks land; nothing is lost: a failed read leaves the
// destination marked invalid with the error, and a failed write leaves the source as it was and
// the NVMe extent marked invalid. See docs/offload.md, Note [Pipeline].
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/nvme_arena.h"
#include "spillway/offload/device.h"

namespace spillway::offload {

struct TransferPipelineOptions {
  uint64_t chunk_bytes = 1ull << 20;  // aio.block_size
  uint32_t staging_buffers = 4;       // ring size: staging_buffers - 1 reads ahead of the copy
};

struct TransferPipelineStats {
  uint64_t nvme_to_device_bytes = 0;
  uint64_t device_to_nvme_bytes = 0;
  uint64_t host_to_device_bytes = 0;
  uint64_t chunks = 0;
  uint64_t failures = 0;
  uint64_t checksum_failures = 0;
};

// Driven by one thread at a time: its stream and staging ring are not shared, so a call made while
// another thread's call is in progress is refused (FAILED_PRECONDITION) instead of refilling a
// staging slot under a queued copy. Callers that share one pipeline serialise their calls (the
// PartitionStore does). Stats are atomics.
class TransferPipeline {
 public:
  static Result<std::unique_ptr<TransferPipeline>> Create(allocator::HostArena* staging_arena,
                                                          allocator::NvmeArena* nvme,
                                                          Device* device,
                                                          TransferPipelineOptions options);
  ~TransferPipeline();
  TransferPipeline(const TransferPipeline&) = delete;
  TransferPipeline& operator=(const TransferPipeline&) = delete;

  // The extent at `nvme_offset` (exactly `bytes` long) into device memory.
  Status NvmeToDevice(uint64_t nvme_offset, uint64_t bytes, void* device_dst);
  // Device memory into the extent at `nvme_offset`; its checksum is recorded when all chunks are on
  // disk.
  Status DeviceToNvme(const void* device_src, uint64_t nvme_offset, uint64_t bytes);
  // Pinned host memory into device memory, chunked on the copy stream.
  Status HostToDevice(const void* host_src, void* device_dst, uint64_t bytes);
  // The serial baseline (DeepSpeed's swap-in pattern): the whole extent read into `host_buffer`,
  // then one copy to the device.
  Status NvmeToDeviceSerial(uint64_t nvme_offset, uint64_t bytes, void* host_buffer,
                            void* device_dst);

  // A snapshot; each counter is read once (relaxed), so the set may straddle a call in flight.
  TransferPipelineStats Stats() const;
  Device* device() const { return device_; }

 private:
  TransferPipeline(allocator::HostArena* arena, allocator::NvmeArena* nvme, Device* device,
                   TransferPipelineOptions options);
  uint64_t ChunkLength(uint64_t i, uint64_t bytes) const;
  class Driving;  // marks a call in progress; refuses a second thread

  std::atomic<bool> driving_{false};

  allocator::HostArena* const arena_;
  allocator::NvmeArena* const nvme_;
  Device* const device_;
  const TransferPipelineOptions options_;
  std::unique_ptr<Stream> stream_;
  std::vector<char*> staging_;
  struct Counters {
    std::atomic<uint64_t> nvme_to_device_bytes{0};
    std::atomic<uint64_t> device_to_nvme_bytes{0};
    std::atomic<uint64_t> host_to_device_bytes{0};
    std::atomic<uint64_t> chunks{0};
    std::atomic<uint64_t> failures{0};
    std::atomic<uint64_t> checksum_failures{0};
  };
  Counters stats_;
};

}  // namespace spillway::offload
