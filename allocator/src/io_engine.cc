// IoEngine's public entry points: creation and teardown, file and region registration, submit
// and wait. The request/chunk core is io_core.cc, the backends io_uring_backend.cc and
// io_thread_pool_backend.cc. Note [Ticket lifecycle] in docs/nvme.md.
#include "spillway/allocator/io_engine.h"

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <thread>
#include <vector>

#include "io_backend.h"
#include "io_core.h"
#include "spillway/base/bytes.h"
#include "spillway/base/log.h"

namespace spillway::allocator {

const char* IoBackendName(IoBackend backend) {
  return backend == IoBackend::kUring ? "io_uring" : "thread_pool";
}

Result<std::unique_ptr<IoEngine>> IoEngine::Create(IoEngineOptions options) {
  if (options.arena == nullptr) {
    return Status::InvalidArgument(
        "IoEngine: options.arena is required (fixed buffers and the "
        "bounce pool live in the host arena)");
  }
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    return Status::InvalidArgument(StrCat("IoEngine: queue_depth ", options.queue_depth,
                                          " is out of range; use 1..4096 (aio.queue_depth)"));
  }
  if (options.block_size < 4096 || options.block_size % 4096 != 0 ||
      options.block_size > IoCore::kMaxIovecBytes) {
    return Status::InvalidArgument(StrCat("IoEngine: block_size ", options.block_size,
                                          " must be a multiple of 4096 between 4 KiB and 1 GiB "
                                          "(aio.block_size)"));
  }
  // Config::Parse holds spillway.bounce_buffers to 1..1024; options set in code reach here
  // unparsed.
  if (options.bounce_buffers == 0 || options.bounce_buffers > kMaxBounceBuffers) {
    return Status::InvalidArgument(StrCat("IoEngine: bounce_buffers ", options.bounce_buffers,
                                          " is out of range; use 1..", kMaxBounceBuffers,
                                          " (spillway.bounce_buffers)"));
  }
  if (options.pool_threads == 0 || options.pool_threads > kMaxPoolThreads) {
    return Status::InvalidArgument(StrCat("IoEngine: pool_threads ", options.pool_threads,
                                          " is out of range; use 1..", kMaxPoolThreads,
                                          " (aio.intra_op_parallelism)"));
  }
  auto core = std::make_unique<IoCore>(options);
  if (options.force_thread_pool) {
    core->stats.fallback_reason = "forced by force_thread_pool";
  } else {
    int err = 0;
    core->backend = NewUringBackend(core.get(), &err);
    if (core->backend == nullptr) {
      if (err != ENOSYS && err != EPERM && err != EACCES && err != EINVAL) {
        return Status::FromErrno(StatusCode::kUnavailable, err,
                                 "io_uring_queue_init failed for a reason other than a missing or "
                                 "forbidden io_uring");
      }
      core->stats.fallback_reason = StrCat("io_uring unavailable: ", ErrnoText(err));
    }
  }
  if (core->backend == nullptr) {
    core->backend = NewThreadPoolBackend(core.get(), options.pool_threads);
    Log(LogLevel::kWarning, StrCat("I/O engine runs on a pread/pwrite thread pool (",
                                   core->stats.fallback_reason, ")"));
  }
  core->stats.backend = core->backend->kind();
  std::unique_ptr<IoEngine> engine(new IoEngine(std::move(core)));
  IoCore& c = *engine->core_;
  options.arena->AddRegionObserver(engine.get());
  for (uint32_t i = 0; i < options.bounce_buffers; ++i) {
    OwnerTag tag{Kind::kSwapBuffer, Lifetime::kPersistent, i, kProcessScope, SPILLWAY_SITE};
    auto buf = options.arena->Allocate(options.block_size, tag);
    if (!buf.ok()) return buf.status().WithContext("IoEngine: allocating the bounce pool");
    c.bounce.push_back(static_cast<char*>(*buf));
    c.bounce_free.push_back(static_cast<int>(i));
  }
  c.backend->Start();
  return engine;
}

IoEngine::IoEngine(std::unique_ptr<IoCore> core) : core_(std::move(core)) {}

IoEngine::~IoEngine() {
  if (!core_->process.InOwner()) {
    // A forked child has none of the ring or pool threads (joining them would hang or abort) and
    // shares the parent's ring mappings: leave everything as it is; the child's exit drops it.
    (void)core_.release();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->stopping = true;
  }
  core_->backend->Wake();
  core_->backend->Join();
  for (char* b : core_->bounce) (void)core_->options.arena->Free(b);
  core_->options.arena->RemoveRegionObserver(this);
  core_.reset();  // the backend releases the ring
}

IoBackend IoEngine::backend() const { return core_->backend->kind(); }

const IoEngineOptions& IoEngine::options() const { return core_->options; }

void IoEngine::OnRegionMapped(void* base, uint64_t bytes) {
  if (!core_->process.InOwner()) return;  // never the parent's buffer table
  const size_t pieces = (bytes + IoCore::kMaxIovecBytes - 1) / IoCore::kMaxIovecBytes;
  const bool fixed = core_->backend->fixed_buffers();
  std::vector<int> slots(pieces, -1);
  if (fixed) {
    std::lock_guard<std::mutex> lock(core_->mu);
    for (size_t i = 0; i < pieces && !core_->free_buffer_slots.empty(); ++i) {
      slots[i] = core_->free_buffer_slots.back();
      core_->free_buffer_slots.pop_back();
    }
  }
  uint32_t failed = 0;
  if (fixed) {
    for (size_t i = 0; i < pieces; ++i) {
      if (slots[i] < 0) {
        ++failed;
        continue;
      }
      char* piece = static_cast<char*>(base) + i * IoCore::kMaxIovecBytes;
      const uint64_t piece_bytes =
          std::min<uint64_t>(IoCore::kMaxIovecBytes, bytes - i * IoCore::kMaxIovecBytes);
      const int rc = core_->backend->UpdateBufferSlot(slots[i], piece, piece_bytes);
      if (rc < 0) {
        Log(LogLevel::kWarning, StrCat("io_uring buffer registration of ", FormatBytes(piece_bytes),
                                       " failed (", ErrnoText(-rc),
                                       "); chunks in it use unfixed reads and writes. Raise "
                                       "RLIMIT_MEMLOCK to register it"));
        std::lock_guard<std::mutex> lock(core_->mu);
        core_->free_buffer_slots.push_back(slots[i]);
        slots[i] = -1;
        ++failed;
      }
    }
  }
  std::lock_guard<std::mutex> lock(core_->mu);
  core_->regions[reinterpret_cast<uint64_t>(base)] =
      IoCore::RegisteredRegion{bytes, std::move(slots)};
  core_->stats.registered_regions = core_->regions.size();
  // Without a buffer table (plain registration) nothing was tried: that is not a failure.
  core_->stats.registration_failures += failed;
}

void IoEngine::OnRegionUnmapping(void* base, uint64_t bytes) {
  if (!core_->process.InOwner()) return;
  std::vector<int> slots;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    auto it = core_->regions.find(reinterpret_cast<uint64_t>(base));
    if (it == core_->regions.end()) return;
    slots = std::move(it->second.slots);
    core_->regions.erase(it);  // no new chunk uses it from here on
    core_->stats.registered_regions = core_->regions.size();
  }
  (void)bytes;
  std::vector<int> cleared;
  for (int slot : slots) {
    if (slot < 0) continue;
    // Clears the slot; the kernel keeps the pages of in-flight I/O alive.
    const int rc = core_->backend->UpdateBufferSlot(slot, nullptr, 0);
    if (rc < 0) {
      Log(LogLevel::kError, StrCat("io_uring buffer unregistration: ", ErrnoText(-rc)));
      continue;  // leak the slot rather than reuse one the kernel may still map
    }
    cleared.push_back(slot);
  }
  std::lock_guard<std::mutex> lock(core_->mu);
  core_->free_buffer_slots.insert(core_->free_buffer_slots.end(), cleared.begin(), cleared.end());
}

Result<int> IoEngine::RegisterFile(int fd, std::string name, uint32_t alignment) {
  SPILLWAY_RETURN_IF_ERROR(core_->process.Check("IoEngine", "RegisterFile"));
  if (fd < 0) return Status::InvalidArgument(StrCat("RegisterFile('", name, "'): bad fd ", fd));
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 ||
      alignment > core_->options.block_size) {
    return Status::InvalidArgument(StrCat("RegisterFile('", name, "'): alignment ", alignment,
                                          " must be a power of two no larger than block_size"));
  }
  if (core_->options.block_size % alignment != 0) {  // chunks start every block_size bytes
    return Status::InvalidArgument(
        StrCat("RegisterFile('", name, "'): its direct-I/O alignment is ", FormatBytes(alignment),
               " and block_size ", FormatBytes(core_->options.block_size),
               " would start chunks off it; set "
               "aio.block_size to a multiple of ",
               FormatBytes(alignment)));
  }
  int slot = -1;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->file_slots_reserved >= IoCore::kFileSlots) {
      return Status::ResourceExhausted(
          StrCat("RegisterFile('", name, "'): all ", IoCore::kFileSlots,
                 " file slots are in use; unregister files you no longer need"));
    }
    // Reserved under the lock, so two registrations at once never pick the same slot.
    if (core_->backend->fixed_files()) {
      auto free = std::find(core_->file_slot_taken.begin(), core_->file_slot_taken.end(), false);
      if (free == core_->file_slot_taken.end()) {  // retired slots count against the limit for good
        return Status::ResourceExhausted(
            StrCat("RegisterFile('", name, "'): no fixed file slot is free (", IoCore::kFileSlots,
                   ", some retired after failed clears)"));
      }
      slot = static_cast<int>(free - core_->file_slot_taken.begin());
      core_->file_slot_taken[slot] = true;
    }
    core_->file_slots_reserved++;
  }
  if (slot >= 0) {
    const int rc = core_->backend->UpdateFileSlot(slot, fd);
    if (rc < 0) {
      std::lock_guard<std::mutex> lock(core_->mu);
      core_->file_slot_taken[slot] = false;
      core_->file_slots_reserved--;
      return Status::FromErrno(StatusCode::kIoError, -rc,
                               StrCat("registering '", name, "' as an io_uring fixed file"));
    }
  }
  std::lock_guard<std::mutex> lock(core_->mu);
  const int id = core_->next_file_id++;
  core_->files[id] = IoFile{fd, slot, std::move(name), alignment};
  return id;
}

Status IoEngine::UnregisterFile(int file_id) {
  SPILLWAY_RETURN_IF_ERROR(core_->process.Check("IoEngine", "UnregisterFile"));
  int slot;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    auto it = core_->files.find(file_id);
    if (it == core_->files.end()) {
      return Status::InvalidArgument(StrCat("UnregisterFile(", file_id, "): no such file"));
    }
    for (const auto& [t, r] : core_->requests) {
      if (r->file_id == file_id && !r->done) {
        return Status::FailedPrecondition(
            StrCat("UnregisterFile('", it->second.name, "'): I/O is still in flight; Wait first"));
      }
    }
    slot = it->second.slot;
    core_->files.erase(it);
  }
  // The slot stays taken until it is cleared: a registration that reused it earlier would have
  // its file replaced by this update.
  if (slot >= 0) {
    IoFaults* faults = core_->options.faults;
    const int fault = faults != nullptr ? faults->unregister_errno.exchange(0) : 0;
    const int rc = fault != 0 ? -fault : core_->backend->UpdateFileSlot(slot, -1);
    if (rc < 0) {
      // The slot still holds the old file: it stays taken and counted, never handed out again, and
      // no request can name it (the file id is gone). The table holds its own reference to the
      // open file, not the descriptor, so the caller may close its fd: a file that reuses the fd
      // number is a different file in a different slot. The ring lets go at teardown.
      return Status::FromErrno(StatusCode::kIoError, -rc,
                               StrCat("clearing fixed file slot ", slot,
                                      "; the slot is retired until the engine is destroyed, and "
                                      "the descriptor may be closed"));
    }
  }
  std::lock_guard<std::mutex> lock(core_->mu);
  if (slot >= 0) core_->file_slot_taken[slot] = false;
  core_->file_slots_reserved--;
  return Status::Ok();
}

Result<Ticket> IoEngine::SubmitWrite(int file_id, uint64_t offset, const void* buffer,
                                     uint64_t bytes) {
  return core_->Enqueue(IoOp::kWrite, "SubmitWrite", file_id, offset,
                        static_cast<char*>(const_cast<void*>(buffer)), bytes);
}

Result<Ticket> IoEngine::SubmitRead(int file_id, uint64_t offset, void* buffer, uint64_t bytes) {
  return core_->Enqueue(IoOp::kRead, "SubmitRead", file_id, offset, static_cast<char*>(buffer),
                        bytes);
}

Status IoEngine::Wait(Ticket ticket) {
  SPILLWAY_RETURN_IF_ERROR(core_->process.Check("IoEngine", "Wait"));
  std::unique_lock<std::mutex> lock(core_->mu);
  auto it = core_->requests.find(ticket);
  if (it == core_->requests.end() || it->second->waited) {
    return Status::InvalidArgument(StrCat("Wait(", ticket,
                                          "): unknown ticket, or already waited "
                                          "for; each ticket is waited for once"));
  }
  IoRequest* r = it->second.get();
  r->waited = true;
  core_->done_cv.wait(lock, [r] { return r->done; });
  Status st = r->status;
  core_->requests.erase(ticket);
  return st;
}

Status IoEngine::WaitAll() {
  SPILLWAY_RETURN_IF_ERROR(core_->process.Check("IoEngine", "WaitAll"));
  const std::thread::id me = std::this_thread::get_id();
  std::unique_lock<std::mutex> lock(core_->mu);
  core_->done_cv.wait(lock, [this, me] {
    for (const auto& [t, r] : core_->requests) {
      if (r->submitter == me && !r->done && !r->waited) return false;
    }
    return true;
  });
  Status first;
  uint64_t failed = 0;
  for (auto it = core_->requests.begin(); it != core_->requests.end();) {
    // Another thread's ticket is theirs to wait for; one in Wait() is being waited for.
    if (it->second->submitter != me || it->second->waited) {
      ++it;
      continue;
    }
    if (!it->second->status.ok()) {
      if (first.ok()) first = it->second->status;
      ++failed;
    }
    it = core_->requests.erase(it);
  }
  if (failed > 1) first = first.WithContext(StrCat(failed, " requests failed; the first"));
  return first;
}

Status IoEngine::Write(int file_id, uint64_t offset, const void* buffer, uint64_t bytes) {
  auto t = core_->Enqueue(IoOp::kWrite, "Write", file_id, offset,
                          static_cast<char*>(const_cast<void*>(buffer)), bytes);
  return t.ok() ? Wait(*t) : t.status();
}

Status IoEngine::Read(int file_id, uint64_t offset, void* buffer, uint64_t bytes) {
  auto t = core_->Enqueue(IoOp::kRead, "Read", file_id, offset, static_cast<char*>(buffer), bytes);
  return t.ok() ? Wait(*t) : t.status();
}

IoEngineStats IoEngine::Stats() const {
  std::lock_guard<std::mutex> lock(core_->mu);
  IoEngineStats s = core_->stats;
  s.queued_requests = 0;
  for (const auto& [t, r] : core_->requests) s.queued_requests += r->done ? 0 : 1;
  return s;
}

}  // namespace spillway::allocator
