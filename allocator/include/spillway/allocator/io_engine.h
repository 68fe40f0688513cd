// IoEngine: block I/O between host memory and swap files on io_uring, with the host arena's
// regions as fixed buffers and the swap files as fixed files. Large transfers are split into
// block_size chunks kept queue_depth deep; short transfers are resubmitted, EINTR/EAGAIN retried,
// real errors reported on the ticket. A pread/pwrite thread pool takes over where io_uring is not
// allowed (ENOSYS/EPERM under seccomp), says so once, and shows itself in the stats.
// See docs/nvme.md.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/process.h"
#include "spillway/base/status.h"

namespace spillway::allocator {

enum class IoBackend : uint8_t { kUring = 0, kThreadPool };
const char* IoBackendName(IoBackend backend);

// Fault-injection seam (tests): each counter makes that many upcoming chunks misbehave. The I/O
// itself is real; only its reported result or its length is changed.
struct IoFaults {
  std::atomic<int> read_errno{0};    // the next read chunk completes with -read_errno
  std::atomic<int> write_errno{0};   // the next write chunk completes with -write_errno
  std::atomic<int> short_reads{0};   // the next N read chunks are submitted at half length
  std::atomic<int> short_writes{0};  // likewise for writes
  std::atomic<int> eintr{0};         // the next N chunk completions report -EINTR
  std::atomic<int> eagain{0};        // the next N chunk completions report -EAGAIN
  // Ring only. The next io_uring_submit_and_wait is not made and reports -submit_errno instead
  // (its SQEs stay unsubmitted, as when the call really fails).
  std::atomic<int> submit_errno{0};
  std::atomic<int> null_sqes{0};     // the next N io_uring_get_sqe calls return null
  // Ring only. The next fixed-file slot clear in UnregisterFile fails with -unregister_errno.
  std::atomic<int> unregister_errno{0};
  // Read once at Create: sparse table registration fails with this errno (a kernel before 5.19).
  int sparse_registration_errno = 0;
};

struct IoEngineOptions {
  uint32_t queue_depth = 32;           // chunks in flight at most
  uint64_t block_size = 1ull << 20;    // chunk size
  bool sqpoll = false;                 // IORING_SETUP_SQPOLL (liburing handles NEED_WAKEUP)
  bool force_thread_pool = false;      // use the fallback backend (to test it, or by choice)
  uint32_t pool_threads = 4;           // fallback backend threads
  uint32_t bounce_buffers = 8;         // bounded bounce pool for buffers outside the arena
  HostArena* arena = nullptr;          // required: fixed buffers and the bounce pool come from it
  IoFaults* faults = nullptr;          // test seam
};

// Latency buckets (seconds, upper bounds) of per-chunk completions; the last bucket is +Inf.
inline constexpr std::array<double, 12> kIoLatencyBuckets = {
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 1.0};

struct IoEngineStats {
  IoBackend backend = IoBackend::kUring;
  std::string fallback_reason;           // why the thread pool runs, when it does
  std::string registration;              // ring tables: "sparse", or "plain files, no fixed buffers (why)"
  uint64_t ring_failures = 0;            // io_uring_submit_and_wait failed: the ring stopped
  std::string ring_error;                // that failure, when there was one
  uint64_t sqe_shortages = 0;            // chunks deferred because no SQE was free
  uint64_t read_bytes = 0;               // completed, by requests that succeeded or not
  uint64_t write_bytes = 0;
  uint64_t read_ops = 0;                 // chunk completions
  uint64_t write_ops = 0;
  uint64_t requests = 0;                 // Read/Write calls accepted
  uint64_t failed_requests = 0;
  uint64_t in_flight_chunks = 0;         // gauge
  uint64_t queued_requests = 0;          // gauge: accepted, not yet complete
  uint64_t fixed_buffer_chunks = 0;      // chunks that used a registered buffer
  uint64_t bounce_chunks = 0;            // chunks staged through the bounce pool
  uint64_t bounce_bytes = 0;
  uint64_t retries = 0;                  // EINTR / EAGAIN resubmissions
  uint64_t short_resubmits = 0;          // short transfers whose rest was resubmitted
  uint64_t registered_regions = 0;       // gauge: arena regions registered as fixed buffers
  uint64_t registration_failures = 0;    // regions that could not be registered (served unfixed)
  std::array<uint64_t, kIoLatencyBuckets.size() + 1> read_latency{};   // per-chunk histogram
  std::array<uint64_t, kIoLatencyBuckets.size() + 1> write_latency{};
  double read_latency_sum_seconds = 0;
  double write_latency_sum_seconds = 0;
};

using Ticket = uint64_t;

// Thread-safe. Callers enqueue requests under mu_ and wake the backend through an eventfd; one ring
// thread owns the ring (submission and completion), so no lock is held across io_uring_enter.
// Invariants: in_flight_chunks <= queue_depth; a bounce buffer is owned by at most one chunk;
// a request completes exactly once, after its last in-flight chunk.
class IoEngine final : public HostArena::RegionObserver {
 public:
  static Result<std::unique_ptr<IoEngine>> Create(IoEngineOptions options);
  ~IoEngine() override;  // waits for outstanding I/O; must go before the arena
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Registers an open file (O_DIRECT or not) as a fixed file. `alignment` is its direct-I/O
  // granule: file offsets must be multiples of it, and buffers or lengths that are not are
  // staged through the bounce pool. Returns the file id used by Read/Write.
  Result<int> RegisterFile(int fd, std::string name, uint32_t alignment);
  Status UnregisterFile(int file_id);

  // Queue a transfer. The buffer must stay valid, and unmodified for writes, until Wait returns.
  // A write whose length is not a multiple of the alignment is padded with zeros: the file must own
  // those bytes (NvmeArena extents do).
  Result<Ticket> Write(int file_id, uint64_t offset, const void* buffer, uint64_t bytes);
  Result<Ticket> Read(int file_id, uint64_t offset, void* buffer, uint64_t bytes);
  // The ticket's final status; the ticket is consumed. Waiting twice is an error.
  Status Wait(Ticket ticket);
  // Waits for every outstanding ticket this thread submitted (and no other thread is waiting for),
  // consumes them, returns the first failure (if any). Other threads' tickets stay theirs.
  Status WaitAll();
  Status WriteSync(int file_id, uint64_t offset, const void* buffer, uint64_t bytes);
  Status ReadSync(int file_id, uint64_t offset, void* buffer, uint64_t bytes);

  IoEngineStats Stats() const;
  IoBackend backend() const { return backend_; }
  const IoEngineOptions& options() const { return options_; }

  void OnRegionMapped(void* base, uint64_t bytes) override;
  void OnRegionUnmapping(void* base, uint64_t bytes) override;

  struct Impl;  // backends; defined in the .cc

 private:
  friend struct Impl;
  enum class Op : uint8_t { kRead, kWrite };
  struct File {
    int fd;
    int slot;        // fixed-file slot, -1 under the thread pool
    std::string name;
    uint32_t alignment;
  };
  struct Request {
    Ticket ticket;
    Op op;
    int file_id;
    uint64_t offset;
    char* buffer;
    uint64_t bytes;
    uint64_t chunked = 0;       // bytes already cut into chunks
    uint32_t in_flight = 0;     // chunks not yet complete
    bool done = false;
    bool waited = false;
    std::thread::id submitter;  // WaitAll consumes only its caller's tickets
    Status status;
  };
  struct Chunk {
    Request* request;
    uint64_t offset_in_request;
    uint64_t length;            // bytes of the request this chunk covers
    uint64_t io_length;         // bytes actually transferred (aligned length when bouncing)
    uint64_t done;              // bytes of io_length already transferred (short transfers)
    uint64_t submit_length;     // what the next submission asks for
    char* io_buffer;            // request memory or a bounce buffer
    int bounce_index;           // -1 when not bouncing
    int buf_index;              // fixed-buffer slot, -1 when none
    uint32_t retries;
    int fd;                     // raw fd (thread pool) or fixed slot (uring)
    uint64_t file_offset;       // of io_buffer[0]
    double started;             // steady clock seconds, for the latency histogram
  };

  explicit IoEngine(IoEngineOptions options);
  Result<Ticket> Enqueue(Op op, int file_id, uint64_t offset, char* buffer, uint64_t bytes);

  // Backend side (called by the ring thread or pool threads; take mu_ briefly, no syscalls).
  // Cuts the next chunk, or returns null when nothing can be cut now (empty queue, depth reached,
  // or no bounce buffer free). Copies into the bounce buffer happen outside mu_.
  Chunk* NextChunkLocked(bool use_fixed_slots);  // mu_ held
  void StageWrite(Chunk* chunk);                  // without mu_: copy into the bounce buffer
  bool DrainedLocked() const;                     // mu_ held: stopping and nothing left
  // A completion's result for `c`: true when the chunk must be submitted again (a retry, a short
  // transfer); otherwise `error` holds the failure, if there is one.
  bool ApplyResult(Chunk* c, int64_t result, Status* error);
  // Applies a completion: returns true when the chunk must be submitted again (retry or short).
  // With `failure`, the chunk ends with that status whatever `result` says (a ring that failed).
  bool CompleteChunk(Chunk* chunk, int64_t result, const Status* failure = nullptr);
  // Ring thread: io_uring_submit_and_wait failed with `err`. Fails `unsubmitted` chunks and every
  // request not yet cut, and refuses new requests from now on. Returns the failure.
  // AbandonInFlight: the ring cannot even report completions; every request not done fails.
  void AbandonInFlight(const Status& failure);
  Status RingFailed(int err, const std::vector<Chunk*>& unsubmitted);
  void FillFault(Chunk* chunk);  // applies short-transfer faults before a submission
  int64_t InjectResult(const Chunk* chunk, int64_t result);

  const IoEngineOptions options_;
  IoBackend backend_ = IoBackend::kUring;
  std::unique_ptr<Impl> impl_;

  const ProcessTag process_;  // Note [Fork]: every entry point refuses in a forked child
  mutable std::mutex mu_;
  ForkSafeCondition done_cv_;               // a request completed
  ForkSafeCondition work_cv_;               // work for pool threads
  std::map<int, File> files_;                     // guarded by mu_
  // Fixed-file slots taken: by registered files, and by registrations and unregistrations whose
  // ring update is in flight (a slot is reserved before the update and freed after it is cleared).
  std::vector<bool> file_slot_taken_ = std::vector<bool>(kFileSlots, false);  // guarded by mu_
  uint32_t file_slots_reserved_ = 0;              // guarded by mu_: files_ plus updates in flight
  int next_file_id_ = 0;                          // guarded by mu_
  std::deque<Request*> pending_;                  // guarded by mu_: requests with bytes to cut
  std::unordered_map<Ticket, std::unique_ptr<Request>> requests_;  // guarded by mu_
  Ticket next_ticket_ = 1;                        // guarded by mu_
  uint32_t in_flight_ = 0;                        // guarded by mu_
  std::vector<char*> bounce_;                     // the pool, allocated in the arena
  std::vector<int> bounce_free_;                  // guarded by mu_
  // Arena regions, base -> size and one fixed-buffer slot per GiB (-1: not registered).
  struct RegisteredRegion {
    uint64_t bytes;
    std::vector<int> slots;
  };
  std::map<uint64_t, RegisteredRegion> regions_;  // guarded by mu_
  std::vector<int> free_buffer_slots_;            // guarded by mu_
  bool stopping_ = false;                         // guarded by mu_
  Status ring_error_;                             // guarded by mu_: set once, when the ring fails
  bool fixed_buffers_ = true;                     // set by Create: the ring has a buffer table
  IoEngineStats stats_;                                 // guarded by mu_

  static constexpr uint64_t kMaxIovecBytes = 1ull << 30;  // io_uring's limit per fixed buffer
  static constexpr uint32_t kBufferSlots = 4096;
  static constexpr uint32_t kFileSlots = 256;
  static constexpr uint32_t kMaxRetries = 64;
};

}  // namespace spillway::allocator
