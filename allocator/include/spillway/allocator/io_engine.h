// IoEngine: block I/O between host memory and swap files on io_uring, with the host arena's
// regions as fixed buffers and the swap files as fixed files. Large transfers are split into
// block_size chunks kept queue_depth deep; short transfers are resubmitted, EINTR/EAGAIN retried,
// real errors reported on the ticket. A pread/pwrite thread pool takes over where io_uring is not
// allowed (ENOSYS/EPERM under seccomp), says so once, and shows itself in the stats.
// This header is what callers use; the request/chunk core and the two backends are private
// (src/io_core.h, src/io_backend.h). See docs/nvme.md.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "spillway/allocator/host_arena.h"
#include "spillway/base/status.h"

namespace spillway::allocator {

struct IoCore;    // src/io_core.h
struct IoFaults;  // io_faults.h: the test seam

enum class IoBackend : uint8_t { kUring = 0, kThreadPool };
const char* IoBackendName(IoBackend backend);

inline constexpr uint32_t kMaxBounceBuffers = 1024;  // IoEngineOptions::bounce_buffers
inline constexpr uint32_t kMaxPoolThreads = 1024;    // IoEngineOptions::pool_threads

struct IoEngineOptions {
  uint32_t queue_depth = 32;         // chunks in flight at most
  uint64_t block_size = 1ull << 20;  // chunk size
  bool sqpoll = false;               // IORING_SETUP_SQPOLL (liburing handles NEED_WAKEUP)
  bool force_thread_pool = false;    // use the fallback backend (to test it, or by choice)
  uint32_t pool_threads = 4;         // fallback backend threads
  uint32_t bounce_buffers = 8;       // bounded bounce pool for buffers outside the arena
  HostArena* arena = nullptr;        // required: fixed buffers and the bounce pool come from it
  IoFaults* faults = nullptr;        // test seam
};

// Latency buckets (seconds, upper bounds) of per-chunk completions; the last bucket is +Inf.
inline constexpr std::array<double, 12> kIoLatencyBuckets = {
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 1.0};

struct IoEngineStats {
  IoBackend backend = IoBackend::kUring;
  std::string fallback_reason;  // why the thread pool runs, when it does
  std::string registration;     // ring tables: "sparse", or "plain files, no fixed buffers (why)"
  uint64_t ring_failures = 0;   // io_uring_submit_and_wait failed: the ring stopped
  std::string ring_error;       // that failure, when there was one
  uint64_t sqe_shortages = 0;   // chunks deferred because no SQE was free
  uint64_t read_bytes = 0;      // completed, by requests that succeeded or not
  uint64_t write_bytes = 0;
  uint64_t read_ops = 0;  // chunk completions
  uint64_t write_ops = 0;
  uint64_t requests = 0;  // transfers accepted, blocking or submitted
  uint64_t failed_requests = 0;
  uint64_t in_flight_chunks = 0;     // gauge
  uint64_t queued_requests = 0;      // gauge: accepted, not yet complete
  uint64_t fixed_buffer_chunks = 0;  // chunks that used a registered buffer
  uint64_t bounce_chunks = 0;        // chunks staged through the bounce pool
  uint64_t bounce_bytes = 0;
  uint64_t retries = 0;                // EINTR / EAGAIN resubmissions
  uint64_t short_resubmits = 0;        // short transfers whose rest was resubmitted
  uint64_t registered_regions = 0;     // gauge: arena regions registered as fixed buffers
  uint64_t registration_failures = 0;  // regions that could not be registered (served unfixed)
  std::array<uint64_t, kIoLatencyBuckets.size() + 1> read_latency{};  // per-chunk histogram
  std::array<uint64_t, kIoLatencyBuckets.size() + 1> write_latency{};
  double read_latency_sum_seconds = 0;
  double write_latency_sum_seconds = 0;
};

using Ticket = uint64_t;

// Thread-safe. Callers enqueue requests under the core's lock and wake the backend; one ring thread
// owns the ring (submission and completion), so no lock is held across io_uring_enter.
// Invariants: in-flight chunks <= queue_depth; a bounce buffer is owned by at most one chunk;
// a request completes exactly once, after its last in-flight chunk.
class IoEngine final : public HostArena::RegionObserver {
 public:
  static Result<std::unique_ptr<IoEngine>> Create(IoEngineOptions options);
  ~IoEngine() override;  // waits for outstanding I/O; must go before the arena
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Registers an open file (O_DIRECT or not) as a fixed file. `alignment` is its direct-I/O
  // granule: file offsets must be multiples of it, and buffers or lengths that are not are
  // staged through the bounce pool. Returns the file id that reads and writes name.
  Result<int> RegisterFile(int fd, std::string name, uint32_t alignment);
  Status UnregisterFile(int file_id);

  // The verbs follow one rule (Note [Vocabulary] in CONTRIBUTING.md): Write and Read block until
  // the transfer completed; SubmitWrite and SubmitRead queue it and return a ticket, which Wait
  // (or WaitAll) collects.
  //
  // The buffer must stay valid, and unmodified for writes, until the transfer completed. A write
  // whose length is not a multiple of the alignment is padded with zeros: the file must own those
  // bytes (NvmeArena extents do).
  Status Write(int file_id, uint64_t offset, const void* buffer, uint64_t bytes);
  Status Read(int file_id, uint64_t offset, void* buffer, uint64_t bytes);
  Result<Ticket> SubmitWrite(int file_id, uint64_t offset, const void* buffer, uint64_t bytes);
  Result<Ticket> SubmitRead(int file_id, uint64_t offset, void* buffer, uint64_t bytes);
  // The ticket's final status; the ticket is consumed. Waiting twice is an error.
  Status Wait(Ticket ticket);
  // Waits for every outstanding ticket this thread submitted (and no other thread is waiting for),
  // consumes them, returns the first failure (if any). Other threads' tickets stay theirs.
  Status WaitAll();

  IoEngineStats Stats() const;
  IoBackend backend() const;
  const IoEngineOptions& options() const;

  void OnRegionMapped(void* base, uint64_t bytes) override;
  void OnRegionUnmapping(void* base, uint64_t bytes) override;

 private:
  explicit IoEngine(std::unique_ptr<IoCore> core);

  std::unique_ptr<IoCore> core_;
};

}  // namespace spillway::allocator
