// IoCore: the I/O engine's requests, chunks and tickets, shared by both backends. A request (one
// transfer, blocking or submitted) is cut into chunks of at most block_size, at most queue_depth of
// them in flight; a chunk outside the arena's registered regions, or off the file's alignment, is
// staged through a bounce buffer. The backend performs each chunk and hands its result to
// CompleteChunk, which retries EINTR/EAGAIN, resubmits the rest of a short transfer, and completes
// the request after its last chunk. Private to spillway::allocator: IoEngine (io_engine.cc) is its
// public face. Note [Ticket lifecycle] in docs/nvme.md.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "io_backend.h"
#include "spillway/allocator/io_engine.h"
#include "spillway/allocator/io_faults.h"
#include "spillway/allocator/process.h"
#include "spillway/base/status.h"

namespace spillway::allocator {

enum class IoOp : uint8_t { kRead, kWrite };

struct IoFile {
  int fd;
  int slot;  // fixed-file slot, -1 without a file table
  std::string name;
  uint32_t alignment;
};

struct IoRequest {
  Ticket ticket;
  IoOp op;
  int file_id;
  uint64_t offset;
  char* buffer;
  uint64_t bytes;
  uint64_t chunked = 0;    // bytes already cut into chunks
  uint32_t in_flight = 0;  // chunks not yet complete
  bool done = false;
  bool waited = false;
  std::thread::id submitter;  // WaitAll consumes only its caller's tickets
  Status status;
};

struct IoChunk {
  IoRequest* request;
  uint64_t offset_in_request;
  uint64_t length;         // bytes of the request this chunk covers
  uint64_t io_length;      // bytes actually transferred (aligned length when bouncing)
  uint64_t done;           // bytes of io_length already transferred (short transfers)
  uint64_t submit_length;  // what the next submission asks for
  char* io_buffer;         // request memory or a bounce buffer
  int bounce_index;        // -1 when not bouncing
  int buf_index;           // fixed-buffer slot, -1 when none
  uint32_t retries;
  int fd;                // raw fd, or the fixed slot when the backend has a file table
  uint64_t file_offset;  // of io_buffer[0]
  double started;        // steady clock seconds, for the latency histogram
};

// Thread-safe through `mu`: callers enqueue under it, backend threads cut and complete chunks
// under it, and nobody holds it across a system call or a copy.
struct IoCore {
  explicit IoCore(IoEngineOptions opts);

  // Queues a request and wakes the backend. Refused in a forked child, after a ring failure, and
  // while stopping.
  // `verb` names the public call in errors (Read, SubmitRead, ...).
  Result<Ticket> Enqueue(IoOp op, const char* verb, int file_id, uint64_t offset, char* buffer,
                         uint64_t bytes);

  // Backend side. Cuts the next chunk, or returns null when nothing can be cut now (empty queue,
  // depth reached, or no bounce buffer free). `use_fixed_slots`: name fixed files and buffers.
  IoChunk* NextChunkLocked(bool use_fixed_slots);  // mu held
  void StageWrite(IoChunk* chunk);                 // without mu: copy into the bounce buffer
  bool DrainedLocked() const;                      // mu held: stopping and nothing left
  void FillFault(IoChunk* chunk);  // sets submit_length, shortened by a short-transfer fault
  // Applies a completion: returns true when the chunk must be submitted again (retry or short).
  // With `failure`, the chunk ends with that status whatever `result` says (a ring that failed).
  bool CompleteChunk(IoChunk* chunk, int64_t result, const Status* failure = nullptr);
  // io_uring_submit_and_wait failed with `err`. Fails `unsubmitted` chunks and every request not
  // yet cut, and refuses new requests from now on. Returns the failure.
  Status RingFailed(int err, const std::vector<IoChunk*>& unsubmitted);
  // The ring cannot even report completions: every request not done fails.
  void AbandonInFlight(const Status& failure);

  const IoEngineOptions options;
  std::unique_ptr<IoBackendImpl> backend;  // set once by IoEngine::Create

  const ProcessTag process;  // Note [Fork]: every entry point refuses in a forked child
  mutable std::mutex mu;
  ForkSafeCondition done_cv;    // a request completed
  ForkSafeCondition work_cv;    // work for pool threads
  std::map<int, IoFile> files;  // guarded by mu
  // Fixed-file slots taken: by registered files, and by registrations and unregistrations whose
  // ring update is in flight (a slot is reserved before the update and freed after it is cleared).
  std::vector<bool> file_slot_taken = std::vector<bool>(kFileSlots, false);  // guarded by mu
  uint32_t file_slots_reserved = 0;  // guarded by mu: files plus updates in flight
  int next_file_id = 0;              // guarded by mu
  std::deque<IoRequest*> pending;    // guarded by mu: requests with bytes to cut
  std::unordered_map<Ticket, std::unique_ptr<IoRequest>> requests;  // guarded by mu
  Ticket next_ticket = 1;                                           // guarded by mu
  uint32_t in_flight = 0;                                           // guarded by mu
  std::vector<char*> bounce;     // the pool, allocated in the arena
  std::vector<int> bounce_free;  // guarded by mu
  // Arena regions, base -> size and one fixed-buffer slot per GiB (-1: not registered).
  struct RegisteredRegion {
    uint64_t bytes;
    std::vector<int> slots;
  };
  std::map<uint64_t, RegisteredRegion> regions;  // guarded by mu
  std::vector<int> free_buffer_slots;            // guarded by mu
  bool stopping = false;                         // guarded by mu
  Status ring_error;                             // guarded by mu: set once, when the ring fails
  IoEngineStats stats;                           // guarded by mu

  static constexpr uint64_t kMaxIovecBytes = 1ull << 30;  // io_uring's limit per fixed buffer
  static constexpr uint32_t kBufferSlots = 4096;
  static constexpr uint32_t kFileSlots = 256;
  static constexpr uint32_t kMaxRetries = 64;

 private:
  // A completion's result for `c`: true when the chunk must be submitted again (a retry, a short
  // transfer); otherwise `error` holds the failure, if there is one.
  bool ApplyResult(IoChunk* c, int64_t result, Status* error);
  int64_t InjectResult(const IoChunk* chunk, int64_t result);
};

}  // namespace spillway::allocator
