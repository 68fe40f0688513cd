// IoBackendImpl: what moves the I/O engine's bytes. The core (io_core.h) owns every request, chunk
// and ticket; a backend takes chunks from it (IoCore::NextChunkLocked), performs them, and hands
// each result back (IoCore::CompleteChunk). Two exist: an io_uring ring thread with fixed files and
// buffers (io_uring_backend.cc), and a pread/pwrite thread pool for where io_uring is not allowed
// (io_thread_pool_backend.cc). Private to spillway::allocator. Note [Ticket lifecycle] in
// docs/nvme.md.
#pragma once

#include <cerrno>
#include <cstdint>
#include <memory>

#include "spillway/allocator/io_engine.h"

namespace spillway::allocator {

class IoBackendImpl {
 public:
  virtual ~IoBackendImpl() = default;  // after Join; releases the backend's kernel objects
  virtual IoBackend kind() const = 0;

  // Starts the backend's threads. They run until the core is stopping and drained.
  virtual void Start() = 0;
  // New work, a freed queue slot, or the stop. Any thread; takes no lock of the core's.
  virtual void Wake() = 0;
  // Joins the threads; the core was told to stop and woken first.
  virtual void Join() = 0;

  // Fixed tables, io_uring only. A backend without a table is never asked to update it.
  virtual bool fixed_files() const { return false; }
  virtual bool fixed_buffers() const { return false; }
  // Points fixed-file slot `slot` at `fd`, or clears it with -1. Returns 0 or -errno (-ENOTSUP for
  // a backend without the table).
  virtual int UpdateFileSlot(int /*slot*/, int /*fd*/) { return -ENOTSUP; }
  // Registers [base, base + bytes) as fixed buffer `slot`, or clears it with a null base.
  // Returns 0 or -errno (-ENOTSUP for a backend without the table).
  virtual int UpdateBufferSlot(int /*slot*/, void* /*base*/, uint64_t /*bytes*/) {
    return -ENOTSUP;
  }
};

// The ring, or null with *err set to the errno that stopped it (ENOSYS or EPERM under seccomp,
// EINVAL or ENOMEM elsewhere). Records the ring's table registration in core->stats.
std::unique_ptr<IoBackendImpl> NewUringBackend(IoCore* core, int* err);
std::unique_ptr<IoBackendImpl> NewThreadPoolBackend(IoCore* core, uint32_t threads);

}  // namespace spillway::allocator
