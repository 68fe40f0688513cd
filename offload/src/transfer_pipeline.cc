// TransferPipeline: chunked, overlapped NVMe <-> staging <-> device transfers with checksums.
#include "spillway/offload/transfer_pipeline.h"

#include <algorithm>
#include <optional>

#include "spillway/allocator/crc32c.h"
#include "spillway/base/bytes.h"

namespace spillway::offload {

Result<std::unique_ptr<TransferPipeline>> TransferPipeline::Create(
    allocator::HostArena* arena, allocator::NvmeArena* nvme, Device* device,
    TransferPipelineOptions options) {
  if (arena == nullptr || nvme == nullptr || device == nullptr) {
    return Status::InvalidArgument("TransferPipeline: arena, NVMe arena and device are required");
  }
  if (options.staging_buffers < 2 || options.chunk_bytes == 0 ||
      options.chunk_bytes % nvme->alignment() != 0) {
    return Status::InvalidArgument(StrCat("TransferPipeline: chunk_bytes ", options.chunk_bytes,
                                          " must be a positive multiple of "
                                          "the NVMe alignment ",
                                          nvme->alignment(),
                                          " (aio.block_size), and staging_buffers >= 2"));
  }
  std::unique_ptr<TransferPipeline> p(new TransferPipeline(arena, nvme, device, options));
  SPILLWAY_ASSIGN_OR_RETURN(p->stream_, device->NewStream());
  for (uint32_t i = 0; i < options.staging_buffers; ++i) {
    auto buf = arena->Allocate(options.chunk_bytes,
                               {allocator::Kind::kSwapBuffer, allocator::Lifetime::kPersistent, i,
                                allocator::kProcessScope, SPILLWAY_SITE});
    if (!buf.ok()) return buf.status().WithContext("TransferPipeline: staging ring");
    p->staging_.push_back(static_cast<char*>(*buf));
  }
  return p;
}

TransferPipeline::TransferPipeline(allocator::HostArena* arena, allocator::NvmeArena* nvme,
                                   Device* device, TransferPipelineOptions options)
    : arena_(arena), nvme_(nvme), device_(device), options_(options) {}

TransferPipeline::~TransferPipeline() {
  // A destructor reports nothing: the last call already returned any copy error.
  if (stream_) stream_->Synchronize().IgnoreError();
  for (char* b : staging_) arena_->Free(b).IgnoreError();
}

class TransferPipeline::Driving {
 public:
  explicit Driving(TransferPipeline* p)
      : p_(p), entered_(!p->driving_.exchange(true, std::memory_order_acquire)) {}
  ~Driving() {
    if (entered_) p_->driving_.store(false, std::memory_order_release);
  }
  Driving(const Driving&) = delete;
  Driving& operator=(const Driving&) = delete;
  Status status(const char* call) const {
    if (entered_) return Status::Ok();
    return Status::FailedPrecondition(StrCat(
        "TransferPipeline::", call,
        ": another thread is driving this pipeline (its staging ring "
        "and stream serve one call at a time); give each thread its own pipeline or serialise "
        "the calls"));
  }

 private:
  TransferPipeline* const p_;
  const bool entered_;
};

uint64_t TransferPipeline::ChunkLength(uint64_t i, uint64_t bytes) const {
  return std::min(options_.chunk_bytes, bytes - i * options_.chunk_bytes);
}

Status TransferPipeline::NvmeToDevice(uint64_t off, uint64_t bytes, void* device_dst) {
  const Driving driving(this);
  SPILLWAY_RETURN_IF_ERROR(driving.status("NvmeToDevice"));
  SPILLWAY_ASSIGN_OR_RETURN(auto expected, nvme_->ExpectedChecksum(off, bytes));
  const uint64_t chunk = options_.chunk_bytes;
  const uint64_t n = (bytes + chunk - 1) / chunk;
  const uint64_t k = staging_.size();
  std::vector<std::optional<allocator::Ticket>> tickets(n);
  std::vector<std::shared_ptr<Event>> copied(k);  // per slot: the copy that last used it
  Status error;
  // Read chunk j into its slot once the copy that last used the slot is done.
  auto issue = [&](uint64_t j) {
    const uint64_t slot = j % k;
    if (copied[slot]) {
      Status st = copied[slot]->Wait();
      copied[slot].reset();
      if (!st.ok()) return st;
    }
    SPILLWAY_ASSIGN_OR_RETURN(
        tickets[j], nvme_->SubmitReadRange(off, j * chunk, staging_[slot], ChunkLength(j, bytes)));
    return Status::Ok();
  };
  uint32_t crc = 0;
  for (uint64_t j = 0; j < std::min(k - 1, n) && error.ok(); ++j) error = issue(j);
  for (uint64_t i = 0; i < n && error.ok(); ++i) {
    // Keep k-1 reads in flight: chunk i+k-1 takes the slot chunk i-1 was copied from.
    if (i + k - 1 < n) error = issue(i + k - 1);
    if (!error.ok()) break;
    error = nvme_->Wait(*tickets[i]);
    tickets[i].reset();
    if (!error.ok()) break;
    const uint64_t len = ChunkLength(i, bytes);
    char* src = staging_[i % k];
    crc = allocator::Crc32cExtend(crc, src, len);  // overlaps the copies and reads in flight
    error = stream_->SubmitCopy(static_cast<char*>(device_dst) + i * chunk, src, len);
    if (!error.ok()) break;
    auto ev = stream_->Record();
    if (!ev.ok()) {
      error = ev.status();
      break;
    }
    copied[i % k] = *ev;
    stats_.chunks++;
  }
  // Drain whatever is still in flight before reporting, so no buffer is reused under I/O.
  for (auto& t : tickets) {
    if (t) nvme_->Wait(*t).IgnoreError();  // `error` already holds the first failure
  }
  Status synced = stream_->Synchronize();
  if (error.ok()) error = synced;
  if (error.ok() && nvme_->checksum_enabled() && crc != expected) {
    stats_.checksum_failures++;
    error = Status::Make(
        StatusCode::kChecksumMismatch,
        StrCat("checksum mismatch streaming the extent at offset ", off, " (", FormatBytes(bytes),
               ") to ", device_->id().ToString(), ": the data on disk is corrupt"));
  }
  if (!error.ok()) {
    stats_.failures++;
    return error.WithContext(StrCat("NVMe -> ", device_->id().ToString(),
                                    " transfer failed; the device destination is not valid"));
  }
  stats_.nvme_to_device_bytes += bytes;
  return Status::Ok();
}

Status TransferPipeline::DeviceToNvme(const void* device_src, uint64_t off, uint64_t bytes) {
  const Driving driving(this);
  SPILLWAY_RETURN_IF_ERROR(driving.status("DeviceToNvme"));
  SPILLWAY_ASSIGN_OR_RETURN(auto generation, nvme_->BeginWrite(off, bytes));
  const uint64_t chunk = options_.chunk_bytes;
  const uint64_t n = (bytes + chunk - 1) / chunk;
  const uint64_t k = staging_.size();
  std::vector<std::optional<allocator::Ticket>> writes(n);
  std::vector<std::shared_ptr<Event>> copied(k);
  uint32_t crc = 0;
  Status error;
  for (uint64_t i = 0; i <= n && error.ok(); ++i) {
    if (i < n) {  // copy chunk i down while chunk i-1 is written
      const uint64_t slot = i % k;
      if (i >= k && writes[i - k]) {  // the slot's previous write must be on disk first
        error = nvme_->Wait(*writes[i - k]);
        writes[i - k].reset();
        if (!error.ok()) break;
      }
      error = stream_->SubmitCopy(staging_[slot], static_cast<const char*>(device_src) + i * chunk,
                                  ChunkLength(i, bytes));
      if (!error.ok()) break;
      auto ev = stream_->Record();
      if (!ev.ok()) {
        error = ev.status();
        break;
      }
      copied[slot] = *ev;
    }
    if (i >= 1) {
      const uint64_t j = i - 1;
      const uint64_t slot = j % k;
      error = copied[slot]->Wait();
      if (!error.ok()) break;
      crc = allocator::Crc32cExtend(crc, staging_[slot], ChunkLength(j, bytes));
      auto t = nvme_->SubmitWriteRange(off, j * chunk, staging_[slot], ChunkLength(j, bytes));
      if (!t.ok()) {
        error = t.status();
        break;
      }
      writes[j] = *t;
      stats_.chunks++;
    }
  }
  for (auto& t : writes) {
    if (t) {
      Status st = nvme_->Wait(*t);
      if (error.ok()) error = st;
    }
  }
  Status synced = stream_->Synchronize();
  if (error.ok()) error = synced;
  if (!error.ok()) {
    stats_.failures++;
    return error.WithContext(StrCat(device_->id().ToString(),
                                    " -> NVMe transfer failed; the "
                                    "device source is unchanged and the NVMe extent is invalid"));
  }
  SPILLWAY_RETURN_IF_ERROR(nvme_->CommitWrite(off, bytes, crc, generation));
  stats_.device_to_nvme_bytes += bytes;
  return Status::Ok();
}

Status TransferPipeline::HostToDevice(const void* host_src, void* device_dst, uint64_t bytes) {
  const Driving driving(this);
  SPILLWAY_RETURN_IF_ERROR(driving.status("HostToDevice"));
  const uint64_t chunk = options_.chunk_bytes;
  for (uint64_t i = 0; i * chunk < bytes; ++i) {
    Status st =
        stream_->SubmitCopy(static_cast<char*>(device_dst) + i * chunk,
                            static_cast<const char*>(host_src) + i * chunk, ChunkLength(i, bytes));
    if (!st.ok()) {
      // The copies already queued still read host_src and write device_dst: drain them before
      // the caller frees either, as NvmeToDevice and DeviceToNvme do. The submit's error is the
      // one to return.
      stream_->Synchronize().IgnoreError();
      return st;
    }
  }
  SPILLWAY_RETURN_IF_ERROR(stream_->Synchronize());
  stats_.host_to_device_bytes += bytes;
  return Status::Ok();
}

Status TransferPipeline::NvmeToDeviceSerial(uint64_t off, uint64_t bytes, void* host_buffer,
                                            void* device_dst) {
  const Driving driving(this);
  SPILLWAY_RETURN_IF_ERROR(driving.status("NvmeToDeviceSerial"));
  SPILLWAY_RETURN_IF_ERROR(nvme_->Read(off, host_buffer, bytes));
  SPILLWAY_RETURN_IF_ERROR(stream_->SubmitCopy(device_dst, host_buffer, bytes));
  return stream_->Synchronize();
}

TransferPipelineStats TransferPipeline::Stats() const {
  TransferPipelineStats s;
  s.nvme_to_device_bytes = stats_.nvme_to_device_bytes.load(std::memory_order_relaxed);
  s.device_to_nvme_bytes = stats_.device_to_nvme_bytes.load(std::memory_order_relaxed);
  s.host_to_device_bytes = stats_.host_to_device_bytes.load(std::memory_order_relaxed);
  s.chunks = stats_.chunks.load(std::memory_order_relaxed);
  s.failures = stats_.failures.load(std::memory_order_relaxed);
  s.checksum_failures = stats_.checksum_failures.load(std::memory_order_relaxed);
  return s;
}

}  // namespace spillway::offload
