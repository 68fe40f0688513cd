// IoEngine: the shared request/chunk/ticket core, the io_uring ring thread, and the pread/pwrite
// pool that takes over when io_uring is not allowed. Note [Ticket lifecycle] in docs/nvme.md.
#include "spillway/allocator/io_engine.h"

#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "spillway/base/bytes.h"
#include "spillway/base/log.h"

namespace spillway::allocator {
namespace {

constexpr uint64_t kWakeTag = 0;  // user_data of the eventfd read that wakes the ring thread

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int TakeOne(std::atomic<int>* counter) {
  int v = counter->load(std::memory_order_relaxed);
  while (v > 0 && !counter->compare_exchange_weak(v, v - 1, std::memory_order_acq_rel)) {
  }
  return v > 0 ? 1 : 0;
}

size_t LatencyBucket(double seconds) {
  size_t i = 0;
  while (i < kIoLatencyBuckets.size() && seconds > kIoLatencyBuckets[i]) ++i;
  return i;
}

}  // namespace

const char* IoBackendName(IoBackend backend) {
  return backend == IoBackend::kUring ? "io_uring" : "thread_pool";
}

struct IoEngine::Impl {
  explicit Impl(IoEngine* engine) : e(engine) {}
  IoEngine* e;
  bool uring = false;
  io_uring ring{};
  int event_fd = -1;
  uint64_t event_value = 0;
  std::vector<std::thread> threads;

  // Tries to set up io_uring with sparse buffer and file tables. Returns the errno on failure.
  int InitUring() {
    io_uring_params params{};
    if (e->options_.sqpoll) {
      params.flags |= IORING_SETUP_SQPOLL;
      params.sq_thread_idle = 50;  // ms; liburing sets IORING_ENTER_SQ_WAKEUP on NEED_WAKEUP
    }
    const unsigned entries = std::max(8u, e->options_.queue_depth * 2 + 2);
    int rc = io_uring_queue_init_params(entries, &ring, &params);
    if (rc < 0) return -rc;
    // Sparse tables (Linux 5.19). Before that, register the file table plainly (a table of -1
    // entries, filled by updates since 5.5) and run without fixed buffers, rather than leave io_uring.
    const int fault = e->options_.faults != nullptr ? e->options_.faults->sparse_registration_errno : 0;
    const int buffers = fault != 0 ? -fault : io_uring_register_buffers_sparse(&ring, kBufferSlots);
    int files = fault != 0 ? -fault : io_uring_register_files_sparse(&ring, kFileSlots);
    if (buffers == 0 && files == 0) {
      e->stats_.registration = "sparse";
    } else if (buffers == -EINVAL || files == -EINVAL) {
      const int why = buffers != 0 ? -buffers : -files;
      if (buffers == 0) io_uring_unregister_buffers(&ring);
      if (files != 0) {
        std::vector<int> empty(kFileSlots, -1);
        files = io_uring_register_files(&ring, empty.data(), kFileSlots);
      }
      if (files < 0) {
        io_uring_queue_exit(&ring);
        return -files;
      }
      e->fixed_buffers_ = false;
      e->stats_.registration = StrCat("plain files, no fixed buffers (sparse registration: ",
                                      ErrnoText(why), ")");
      Log(LogLevel::kWarning, StrCat("io_uring without sparse registration (", ErrnoText(why),
                                     "; Linux < 5.19?): files are registered plainly and reads "
                                     "and writes use no fixed buffers"));
    } else {
      io_uring_queue_exit(&ring);
      return buffers != 0 ? -buffers : -files;
    }
    event_fd = eventfd(0, EFD_CLOEXEC);
    if (event_fd < 0) {
      const int err = errno;
      io_uring_queue_exit(&ring);
      return err;
    }
    uring = true;
    return 0;
  }

  // Queues the eventfd read that wakes the ring thread; false when no SQE is free (retried).
  bool ArmWake() {
    io_uring_sqe* sqe = GetSqe();
    if (sqe == nullptr) return false;
    io_uring_prep_read(sqe, event_fd, &event_value, sizeof(event_value), 0);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    sq_order.push_back(nullptr);
    return true;
  }

  void Wake() {
    if (uring) {
      const uint64_t one = 1;
      ssize_t n = write(event_fd, &one, sizeof(one));
      (void)n;  // a full counter still wakes the reader
    } else {
      e->work_cv_.notify_all();
    }
  }

  // Null when the submission queue is full; the caller retries after the next submit. (Submitting
  // here would hide a submit failure from RingLoop.)
  io_uring_sqe* GetSqe() {
    if (IoFaults* f = e->options_.faults; f != nullptr && f->null_sqes.load() > 0 &&
                                          f->null_sqes.fetch_sub(1) > 0) {
      return nullptr;
    }
    return io_uring_get_sqe(&ring);
  }

  // False when no SQE was free: the chunk waits for the next round.
  bool Prep(Chunk* c) {
    io_uring_sqe* sqe = GetSqe();
    if (sqe == nullptr) {
      std::lock_guard<std::mutex> lock(e->mu_);
      e->stats_.sqe_shortages++;
      return false;
    }
    e->FillFault(c);
    char* buf = c->io_buffer + c->done;
    const uint64_t off = c->file_offset + c->done;
    const auto len = static_cast<unsigned>(c->submit_length);
    const bool read = c->request->op == Op::kRead;
    if (c->buf_index >= 0) {
      if (read) {
        io_uring_prep_read_fixed(sqe, c->fd, buf, len, off, c->buf_index);
      } else {
        io_uring_prep_write_fixed(sqe, c->fd, buf, len, off, c->buf_index);
      }
    } else if (read) {
      io_uring_prep_read(sqe, c->fd, buf, len, off);
    } else {
      io_uring_prep_write(sqe, c->fd, buf, len, off);
    }
    sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, c);
    sq_order.push_back(c);
    return true;
  }

  // Applies the completions in the CQ; chunks to resubmit go to `again`.
  void Reap(std::vector<Chunk*>* again) {
    io_uring_cqe* cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&ring, head, cqe) {
      ++seen;
      if (cqe->user_data == kWakeTag) {
        wake_armed = false;
        continue;
      }
      auto* c = static_cast<Chunk*>(io_uring_cqe_get_data(cqe));
      if (e->CompleteChunk(c, cqe->res)) again->push_back(c);
    }
    io_uring_cq_advance(&ring, seen);
  }

  // After a failed submit: wait (without submitting) for the chunks the kernel already has; a
  // chunk that would need resubmitting (a retry, a short transfer) fails with the ring's error.
  void DrainAfterFailure(const Status& failure) {
    std::vector<Chunk*> again;
    for (;;) {
      for (Chunk* c : again) (void)e->CompleteChunk(c, 0, &failure);
      again.clear();
      {
        std::lock_guard<std::mutex> lock(e->mu_);
        if (e->in_flight_ == 0) return;
      }
      io_uring_cqe* cqe;
      const int rc = io_uring_wait_cqe(&ring, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        // The ring cannot report completions either. Fail the requests so no Wait blocks for
        // ever, and leak their chunks and bounce buffers: the kernel may still touch that memory.
        Log(LogLevel::kError, StrCat("io_uring_wait_cqe after a ring failure: ", ErrnoText(-rc),
                                     "; the requests the kernel still holds fail now"));
        e->AbandonInFlight(failure);
        return;
      }
      Reap(&again);
    }
  }

  // Owns the ring: cuts chunks, submits, reaps, until the engine stops and nothing is left.
  // A failed io_uring_submit_and_wait (other than EINTR, EAGAIN, EBUSY) stops the ring: the chunks
  // it did not submit and every request not yet cut fail with that error, the chunks the kernel
  // already has are waited for, and the engine refuses new requests (RingFailed).
  void RingLoop() {
    std::vector<Chunk*> again;  // to (re)submit: retries, short transfers, no SQE last time
    for (;;) {
      if (!wake_armed) wake_armed = ArmWake();
      std::vector<Chunk*> todo;
      todo.swap(again);
      for (Chunk* c : todo) {
        if (!Prep(c)) again.push_back(c);
      }
      while (again.empty()) {
        Chunk* c;
        {
          std::lock_guard<std::mutex> lock(e->mu_);
          if (e->DrainedLocked()) return;
          c = e->NextChunkLocked(true);
        }
        if (c == nullptr) break;
        e->StageWrite(c);
        if (!Prep(c)) again.push_back(c);
      }
      // The eventfd read is armed, so this returns when a chunk completes or work arrives.
      int rc;
      if (IoFaults* f = e->options_.faults; f != nullptr && f->submit_errno.load() != 0) {
        rc = -f->submit_errno.exchange(0);
      } else {
        // A chunk that found no SQE must not wait for a completion that may never come: the
        // submit frees the queue's slots, so go round at once.
        rc = io_uring_submit_and_wait(&ring, again.empty() && wake_armed ? 1 : 0);
      }
      if (rc >= 0) {
        const size_t n = std::min<size_t>(static_cast<size_t>(rc), sq_order.size());
        sq_order.erase(sq_order.begin(), sq_order.begin() + static_cast<std::ptrdiff_t>(n));
      } else if (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        // Unsubmitted: what is still in sq_order (minus the wake read) and what waits for an SQE.
        std::vector<Chunk*> lost = again;
        for (Chunk* c : sq_order) {
          if (c != nullptr) lost.push_back(c);
        }
        sq_order.clear();
        again.clear();
        DrainAfterFailure(e->RingFailed(-rc, lost));
        return;
      }
      Reap(&again);
    }
  }

  std::deque<Chunk*> sq_order;  // ring thread: SQEs queued and not yet submitted (null: wake)
  bool wake_armed = false;      // ring thread: the eventfd read is queued or in flight

  void PoolLoop() {
    for (;;) {
      Chunk* c = nullptr;
      {
        std::unique_lock<std::mutex> lock(e->mu_);
        for (;;) {
          c = e->NextChunkLocked(false);
          if (c != nullptr || e->DrainedLocked()) break;
          e->work_cv_.wait(lock);
        }
      }
      if (c == nullptr) return;
      e->StageWrite(c);
      bool again;
      do {
        e->FillFault(c);
        char* buf = c->io_buffer + c->done;
        const auto off = static_cast<off_t>(c->file_offset + c->done);
        ssize_t n = c->request->op == Op::kRead ? pread(c->fd, buf, c->submit_length, off)
                                                : pwrite(c->fd, buf, c->submit_length, off);
        again = e->CompleteChunk(c, n < 0 ? -errno : n);
      } while (again);
    }
  }
};

Result<std::unique_ptr<IoEngine>> IoEngine::Create(IoEngineOptions options) {
  if (options.arena == nullptr) {
    return Status::InvalidArgument("IoEngine: options.arena is required (fixed buffers and the "
                                   "bounce pool live in the host arena)");
  }
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    return Status::InvalidArgument(StrCat("IoEngine: queue_depth ", options.queue_depth,
                                          " is out of range; use 1..4096 (aio.queue_depth)"));
  }
  if (options.block_size < 4096 || options.block_size % 4096 != 0 ||
      options.block_size > kMaxIovecBytes) {
    return Status::InvalidArgument(StrCat("IoEngine: block_size ", options.block_size,
                                          " must be a multiple of 4096 between 4 KiB and 1 GiB "
                                          "(aio.block_size)"));
  }
  if (options.bounce_buffers == 0 || options.pool_threads == 0) {
    return Status::InvalidArgument("IoEngine: bounce_buffers and pool_threads must be >= 1");
  }
  std::unique_ptr<IoEngine> engine(new IoEngine(options));
  engine->impl_ = std::make_unique<Impl>(engine.get());
  Impl& impl = *engine->impl_;
  if (options.force_thread_pool) {
    engine->backend_ = IoBackend::kThreadPool;
    engine->stats_.fallback_reason = "forced by force_thread_pool";
  } else if (int err = impl.InitUring(); err != 0) {
    if (err != ENOSYS && err != EPERM && err != EACCES && err != EINVAL) {
      return Status::FromErrno(StatusCode::kUnavailable, err,
                               "io_uring_queue_init failed for a reason other than a missing or "
                               "forbidden io_uring");
    }
    engine->backend_ = IoBackend::kThreadPool;
    engine->stats_.fallback_reason = StrCat("io_uring unavailable: ", ErrnoText(err));
  }
  engine->stats_.backend = engine->backend_;
  if (engine->backend_ == IoBackend::kThreadPool) {
    Log(LogLevel::kWarning, StrCat("I/O engine runs on a pread/pwrite thread pool (",
                                   engine->stats_.fallback_reason, ")"));
  }
  options.arena->AddRegionObserver(engine.get());
  for (uint32_t i = 0; i < options.bounce_buffers; ++i) {
    OwnerTag tag{Kind::kSwapBuffer, Lifetime::kPersistent, i, kProcessScope, SPILLWAY_SITE};
    auto buf = options.arena->Allocate(options.block_size, tag);
    if (!buf.ok()) return buf.status().WithContext("IoEngine: allocating the bounce pool");
    engine->bounce_.push_back(static_cast<char*>(*buf));
    engine->bounce_free_.push_back(static_cast<int>(i));
  }
  if (impl.uring) {
    impl.threads.emplace_back([&impl] { impl.RingLoop(); });
  } else {
    for (uint32_t i = 0; i < options.pool_threads; ++i) {
      impl.threads.emplace_back([&impl] { impl.PoolLoop(); });
    }
  }
  return engine;
}

IoEngine::IoEngine(IoEngineOptions options) : options_(options) {
  for (int i = kBufferSlots - 1; i >= 0; --i) free_buffer_slots_.push_back(i);
}

IoEngine::~IoEngine() {
  if (impl_ == nullptr) return;
  if (!process_.InOwner()) {
    // A forked child has none of the ring or pool threads (joining them would hang or abort) and
    // shares the parent's ring mappings: leave everything as it is; the child's exit drops it.
    (void)impl_.release();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  impl_->Wake();
  work_cv_.notify_all();
  for (auto& t : impl_->threads) t.join();
  for (char* b : bounce_) (void)options_.arena->Free(b);
  options_.arena->RemoveRegionObserver(this);
  if (impl_->uring) {
    io_uring_queue_exit(&impl_->ring);
    close(impl_->event_fd);
  }
}

bool IoEngine::DrainedLocked() const {
  return stopping_ && pending_.empty() && in_flight_ == 0;
}

void IoEngine::OnRegionMapped(void* base, uint64_t bytes) {
  if (!process_.InOwner()) return;  // never the parent's buffer table
  const size_t pieces = (bytes + kMaxIovecBytes - 1) / kMaxIovecBytes;
  std::vector<int> slots(pieces, -1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < pieces && !free_buffer_slots_.empty(); ++i) {
      if (backend_ == IoBackend::kUring && fixed_buffers_) {
        slots[i] = free_buffer_slots_.back();
        free_buffer_slots_.pop_back();
      }
    }
  }
  uint32_t failed = 0;
  if (backend_ == IoBackend::kUring) {
    for (size_t i = 0; i < pieces; ++i) {
      if (slots[i] < 0) {
        ++failed;
        continue;
      }
      iovec iov{static_cast<char*>(base) + i * kMaxIovecBytes,
                std::min<uint64_t>(kMaxIovecBytes, bytes - i * kMaxIovecBytes)};
      int rc = io_uring_register_buffers_update_tag(&impl_->ring, slots[i], &iov, nullptr, 1);
      if (rc < 0) {
        Log(LogLevel::kWarning, StrCat("io_uring buffer registration of ", FormatBytes(iov.iov_len),
                                       " failed (", ErrnoText(-rc),
                                       "); chunks in it use unfixed reads and writes. Raise "
                                       "RLIMIT_MEMLOCK to register it"));
        std::lock_guard<std::mutex> lock(mu_);
        free_buffer_slots_.push_back(slots[i]);
        slots[i] = -1;
        ++failed;
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  regions_[reinterpret_cast<uint64_t>(base)] = RegisteredRegion{bytes, std::move(slots)};
  stats_.registered_regions = regions_.size();
  // Without a buffer table (plain registration) nothing was tried: that is not a failure.
  if (fixed_buffers_) stats_.registration_failures += failed;
}

void IoEngine::OnRegionUnmapping(void* base, uint64_t bytes) {
  if (!process_.InOwner()) return;
  std::vector<int> slots;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(reinterpret_cast<uint64_t>(base));
    if (it == regions_.end()) return;
    slots = std::move(it->second.slots);
    regions_.erase(it);  // no new chunk uses it from here on
    stats_.registered_regions = regions_.size();
  }
  (void)bytes;
  std::vector<int> cleared;
  for (int slot : slots) {
    if (slot < 0) continue;
    iovec empty{nullptr, 0};  // clears the slot; the kernel keeps pages of in-flight I/O alive
    int rc = io_uring_register_buffers_update_tag(&impl_->ring, slot, &empty, nullptr, 1);
    if (rc < 0) {
      Log(LogLevel::kError, StrCat("io_uring buffer unregistration: ", ErrnoText(-rc)));
      continue;  // leak the slot rather than reuse one the kernel may still map
    }
    cleared.push_back(slot);
  }
  std::lock_guard<std::mutex> lock(mu_);
  free_buffer_slots_.insert(free_buffer_slots_.end(), cleared.begin(), cleared.end());
}

Result<int> IoEngine::RegisterFile(int fd, std::string name, uint32_t alignment) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("IoEngine", "RegisterFile"));
  if (fd < 0) return Status::InvalidArgument(StrCat("RegisterFile('", name, "'): bad fd ", fd));
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > options_.block_size) {
    return Status::InvalidArgument(StrCat("RegisterFile('", name, "'): alignment ", alignment,
                                          " must be a power of two no larger than block_size"));
  }
  if (options_.block_size % alignment != 0) {  // chunks start every block_size bytes
    return Status::InvalidArgument(StrCat(
        "RegisterFile('", name, "'): its direct-I/O alignment is ", FormatBytes(alignment),
        " and block_size ", FormatBytes(options_.block_size), " would start chunks off it; set "
        "aio.block_size to a multiple of ", FormatBytes(alignment)));
  }
  int slot = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (file_slots_reserved_ >= kFileSlots) {
      return Status::ResourceExhausted(
                          StrCat("RegisterFile('", name, "'): all ", kFileSlots,
                                 " file slots are in use; unregister files you no longer need"));
    }
    // Reserved under the lock, so two registrations at once never pick the same slot.
    if (backend_ == IoBackend::kUring) {
      auto free = std::find(file_slot_taken_.begin(), file_slot_taken_.end(), false);
      if (free == file_slot_taken_.end()) {  // retired slots count against the limit for good
        return Status::ResourceExhausted(
                            StrCat("RegisterFile('", name, "'): no fixed file slot is free (",
                                   kFileSlots, ", some retired after failed clears)"));
      }
      slot = static_cast<int>(free - file_slot_taken_.begin());
      file_slot_taken_[slot] = true;
    }
    file_slots_reserved_++;
  }
  if (slot >= 0) {
    int rc = io_uring_register_files_update(&impl_->ring, slot, &fd, 1);
    if (rc < 0) {
      std::lock_guard<std::mutex> lock(mu_);
      file_slot_taken_[slot] = false;
      file_slots_reserved_--;
      return Status::FromErrno(StatusCode::kIoError, -rc,
                               StrCat("registering '", name, "' as an io_uring fixed file"));
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  const int id = next_file_id_++;
  files_[id] = File{fd, slot, std::move(name), alignment};
  return id;
}

Status IoEngine::UnregisterFile(int file_id) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("IoEngine", "UnregisterFile"));
  int slot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(file_id);
    if (it == files_.end()) {
      return Status::InvalidArgument(StrCat("UnregisterFile(", file_id, "): no such file"));
    }
    for (const auto& [t, r] : requests_) {
      if (r->file_id == file_id && !r->done) {
        return Status::FailedPrecondition(StrCat("UnregisterFile('", it->second.name,
                                                 "'): I/O is still in flight; Wait first"));
      }
    }
    slot = it->second.slot;
    files_.erase(it);
  }
  // The slot stays taken until it is cleared: a registration that reused it earlier would have
  // its file replaced by this update.
  if (slot >= 0) {
    int minus_one = -1;
    const int fault = options_.faults != nullptr ? options_.faults->unregister_errno.exchange(0) : 0;
    const int rc = fault != 0 ? -fault : io_uring_register_files_update(&impl_->ring, slot, &minus_one, 1);
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
  std::lock_guard<std::mutex> lock(mu_);
  if (slot >= 0) file_slot_taken_[slot] = false;
  file_slots_reserved_--;
  return Status::Ok();
}

Result<Ticket> IoEngine::Write(int file_id, uint64_t offset, const void* buffer,
                                  uint64_t bytes) {
  return Enqueue(Op::kWrite, file_id, offset, static_cast<char*>(const_cast<void*>(buffer)), bytes);
}

Result<Ticket> IoEngine::Read(int file_id, uint64_t offset, void* buffer, uint64_t bytes) {
  return Enqueue(Op::kRead, file_id, offset, static_cast<char*>(buffer), bytes);
}

Result<Ticket> IoEngine::Enqueue(Op op, int file_id, uint64_t offset, char* buffer,
                                    uint64_t bytes) {
  const char* verb = op == Op::kRead ? "Read" : "Write";
  SPILLWAY_RETURN_IF_ERROR(process_.Check("IoEngine", verb));
  if (buffer == nullptr || bytes == 0) {
    return Status::InvalidArgument(StrCat(verb, ": null buffer or 0 bytes"));
  }
  Ticket ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(file_id);
    if (it == files_.end()) {
      return Status::InvalidArgument(StrCat(verb, ": file id ", file_id, " is not registered"));
    }
    if (stopping_) return Status::FailedPrecondition(StrCat(verb, ": the engine is stopping"));
    if (!ring_error_.ok()) {
      return Status::FailedPrecondition(StrCat(verb, ": the I/O engine's ring failed (",
                                               ring_error_.message(), ")"));
    }
    const File& f = it->second;
    if (offset % f.alignment != 0) {
      return Status::InvalidArgument(StrCat(verb, " of '", f.name, "' at offset ", offset,
                                            ": the offset must be a multiple of the direct-I/O "
                                            "alignment ", f.alignment));
    }
    if (offset + bytes < offset) {
      return Status::InvalidArgument(StrCat(verb, ": offset + size overflows"));
    }
    ticket = next_ticket_++;
    auto req = std::make_unique<Request>();
    req->ticket = ticket;
    req->op = op;
    req->file_id = file_id;
    req->offset = offset;
    req->buffer = buffer;
    req->bytes = bytes;
    req->submitter = std::this_thread::get_id();
    pending_.push_back(req.get());
    requests_.emplace(ticket, std::move(req));
    stats_.requests++;
  }
  impl_->Wake();
  return ticket;
}

IoEngine::Chunk* IoEngine::NextChunkLocked(bool use_fixed_slots) {
  while (!pending_.empty() && in_flight_ < options_.queue_depth) {
    Request* r = pending_.front();
    if (!r->status.ok()) {  // a failed request cuts no more chunks
      pending_.pop_front();
      continue;
    }
    const File& f = files_.at(r->file_id);
    char* p = r->buffer + r->chunked;
    uint64_t len = std::min(options_.block_size, r->bytes - r->chunked);
    const auto addr = reinterpret_cast<uint64_t>(p);
    // Which registered region holds [p, p+len), and which 1 GiB piece of it.
    int slot = -1;
    bool in_arena = false;
    auto reg = regions_.upper_bound(addr);
    if (reg != regions_.begin()) {
      --reg;
      if (addr + len <= reg->first + reg->second.bytes) {
        in_arena = true;
        const uint64_t piece = (addr - reg->first) / kMaxIovecBytes;
        const uint64_t piece_end = reg->first + (piece + 1) * kMaxIovecBytes;
        if (addr + len > piece_end) len = piece_end - addr;  // stay inside one fixed buffer
        slot = reg->second.slots[piece];
      }
    }
    const bool aligned = addr % f.alignment == 0 && len % f.alignment == 0;
    auto* c = new Chunk{r, r->chunked, len, len, 0, len, p, -1, -1, 0, 0,
                        r->offset + r->chunked, NowSeconds()};
    if (!in_arena || !aligned) {
      if (bounce_free_.empty()) {
        delete c;
        return nullptr;  // wait for a bounce buffer to come back
      }
      c->bounce_index = bounce_free_.back();
      bounce_free_.pop_back();
      c->io_buffer = bounce_[c->bounce_index];
      c->io_length = RoundUp(len, f.alignment);
      c->submit_length = c->io_length;
      const auto baddr = reinterpret_cast<uint64_t>(c->io_buffer);
      auto breg = std::prev(regions_.upper_bound(baddr));
      slot = breg->second.slots[(baddr - breg->first) / kMaxIovecBytes];
      stats_.bounce_chunks++;
      stats_.bounce_bytes += len;
    }
    c->buf_index = use_fixed_slots ? slot : -1;
    c->fd = use_fixed_slots ? f.slot : f.fd;
    if (c->buf_index >= 0) stats_.fixed_buffer_chunks++;
    r->chunked += len;
    r->in_flight++;
    in_flight_++;
    stats_.in_flight_chunks = in_flight_;
    if (r->chunked == r->bytes) pending_.pop_front();
    return c;
  }
  return nullptr;
}

void IoEngine::StageWrite(Chunk* c) {
  if (c->bounce_index < 0 || c->request->op != Op::kWrite) return;
  std::memcpy(c->io_buffer, c->request->buffer + c->offset_in_request, c->length);
  if (c->io_length > c->length) std::memset(c->io_buffer + c->length, 0, c->io_length - c->length);
}

void IoEngine::FillFault(Chunk* c) {
  c->submit_length = c->io_length - c->done;
  IoFaults* f = options_.faults;
  if (f == nullptr) return;
  std::atomic<int>& shorts = c->request->op == Op::kRead ? f->short_reads : f->short_writes;
  const uint64_t align = 4096;
  if (c->submit_length >= 2 * align && TakeOne(&shorts)) {
    c->submit_length = c->submit_length / 2 / align * align;
  }
}

int64_t IoEngine::InjectResult(const Chunk* c, int64_t result) {
  IoFaults* f = options_.faults;
  if (f == nullptr) return result;
  if (TakeOne(&f->eintr)) return -EINTR;
  if (TakeOne(&f->eagain)) return -EAGAIN;
  std::atomic<int>& err = c->request->op == Op::kRead ? f->read_errno : f->write_errno;
  if (int e = err.exchange(0); e != 0) return -e;
  return result;
}

bool IoEngine::ApplyResult(Chunk* c, int64_t result, Status* error) {
  Request* r = c->request;
  const bool read = r->op == Op::kRead;
  result = InjectResult(c, result);
  if ((result == -EINTR || result == -EAGAIN) && c->retries < kMaxRetries) {
    c->retries++;
    std::lock_guard<std::mutex> lock(mu_);
    stats_.retries++;
    return true;
  }
  // A bounced read only needs the caller's bytes; the padding may lie past the end of the file.
  const uint64_t needed = read ? c->length : c->io_length;
  if (result > 0) {
    c->done += static_cast<uint64_t>(result);
    if (c->done < needed) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.short_resubmits++;
      return true;
    }
    return false;
  }
  std::string file;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(r->file_id);
    file = it == files_.end() ? StrCat("file ", r->file_id) : it->second.name;
  }
  const std::string what = StrCat(read ? "read" : "write", " of ", c->io_length - c->done,
                                  " bytes at offset ", c->file_offset + c->done, " of '", file, "'");
  if (result == 0) {
    *error = Status::Make(StatusCode::kIoError,
                          StrCat(what, " reached the end of the file after ", c->done,
                                 " bytes; the file is shorter than the transfer"));
    return false;
  }
  const int err = static_cast<int>(-result);
  const bool space = err == ENOSPC || err == EFBIG || err == EDQUOT;
  *error = Status::FromErrno(space ? StatusCode::kNoSpace : StatusCode::kIoError, err, what);
  if (err == ENOSPC || err == EDQUOT) {
    *error = error->WithContext("no space: free space on the NVMe path or lower the NVMe budget");
  } else if (err == EFBIG) {
    *error = error->WithContext(
        "file too large: the file size limit (ulimit -f) or the filesystem's maximum file size "
        "was reached");
  }
  return false;
}

bool IoEngine::CompleteChunk(Chunk* c, int64_t result, const Status* failure) {
  Request* r = c->request;
  const bool read = r->op == Op::kRead;
  Status error;
  if (failure != nullptr) {
    error = *failure;
  } else if (ApplyResult(c, result, &error)) {
    return true;
  }
  if (error.ok() && read && c->bounce_index >= 0) {
    std::memcpy(r->buffer + c->offset_in_request, c->io_buffer, c->length);
  }
  const double latency = NowSeconds() - c->started;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (read) {
      stats_.read_ops++;
      stats_.read_bytes += error.ok() ? c->length : 0;
      stats_.read_latency[LatencyBucket(latency)]++;
      stats_.read_latency_sum_seconds += latency;
    } else {
      stats_.write_ops++;
      stats_.write_bytes += error.ok() ? c->length : 0;
      stats_.write_latency[LatencyBucket(latency)]++;
      stats_.write_latency_sum_seconds += latency;
    }
    if (c->bounce_index >= 0) bounce_free_.push_back(c->bounce_index);
    in_flight_--;
    stats_.in_flight_chunks = in_flight_;
    r->in_flight--;
    if (!error.ok() && r->status.ok()) r->status = error;
    if (r->in_flight == 0 && (r->chunked == r->bytes || !r->status.ok())) {
      if (!r->status.ok()) {
        stats_.failed_requests++;
        pending_.erase(std::remove(pending_.begin(), pending_.end(), r), pending_.end());
      }
      r->done = true;
      done_cv_.notify_all();
    }
  }
  work_cv_.notify_all();  // a queue slot or a bounce buffer came back
  delete c;
  return false;
}

Status IoEngine::RingFailed(int err, const std::vector<Chunk*>& unsubmitted) {
  Status failure = Status::FromErrno(
      StatusCode::kIoError, err,
      "io_uring_submit_and_wait failed and the I/O engine's ring stopped: this request did not "
      "complete (parts of it may have been written or read: treat its destination, file range "
      "or buffer, as invalid); make a new engine");
  Log(LogLevel::kError, failure.ToString());
  {
    std::lock_guard<std::mutex> lock(mu_);
    ring_error_ = failure;
    stats_.ring_failures++;
    stats_.ring_error = failure.message();
    // Requests not cut yet fail now; those with chunks in flight fail as the chunks end.
    for (Request* r : pending_) {
      if (r->status.ok()) r->status = failure;
      if (r->in_flight == 0 && !r->done) {
        stats_.failed_requests++;
        r->done = true;
      }
    }
    pending_.clear();
    done_cv_.notify_all();
  }
  for (Chunk* c : unsubmitted) (void)CompleteChunk(c, 0, &failure);
  return failure;
}

void IoEngine::AbandonInFlight(const Status& failure) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [ticket, r] : requests_) {
    if (r->done) continue;
    if (r->status.ok()) r->status = failure;
    r->done = true;
    stats_.failed_requests++;
  }
  done_cv_.notify_all();
}

Status IoEngine::Wait(Ticket ticket) {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("IoEngine", "Wait"));
  std::unique_lock<std::mutex> lock(mu_);
  auto it = requests_.find(ticket);
  if (it == requests_.end() || it->second->waited) {
    return Status::InvalidArgument(StrCat("Wait(", ticket, "): unknown ticket, or already waited "
                                          "for; each ticket is waited for once"));
  }
  Request* r = it->second.get();
  r->waited = true;
  done_cv_.wait(lock, [r] { return r->done; });
  Status st = r->status;
  requests_.erase(ticket);
  return st;
}

Status IoEngine::WaitAll() {
  SPILLWAY_RETURN_IF_ERROR(process_.Check("IoEngine", "WaitAll"));
  const std::thread::id me = std::this_thread::get_id();
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this, me] {
    for (const auto& [t, r] : requests_) {
      if (r->submitter == me && !r->done && !r->waited) return false;
    }
    return true;
  });
  Status first;
  uint64_t failed = 0;
  for (auto it = requests_.begin(); it != requests_.end();) {
    // Another thread's ticket is theirs to wait for; one in Wait() is being waited for.
    if (it->second->submitter != me || it->second->waited) {
      ++it;
      continue;
    }
    if (!it->second->status.ok()) {
      if (first.ok()) first = it->second->status;
      ++failed;
    }
    it = requests_.erase(it);
  }
  if (failed > 1) first = first.WithContext(StrCat(failed, " requests failed; the first"));
  return first;
}

Status IoEngine::WriteSync(int file_id, uint64_t offset, const void* buffer, uint64_t bytes) {
  auto t = Write(file_id, offset, buffer, bytes);
  return t.ok() ? Wait(*t) : t.status();
}

Status IoEngine::ReadSync(int file_id, uint64_t offset, void* buffer, uint64_t bytes) {
  auto t = Read(file_id, offset, buffer, bytes);
  return t.ok() ? Wait(*t) : t.status();
}

IoEngineStats IoEngine::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  IoEngineStats s = stats_;
  s.queued_requests = 0;
  for (const auto& [t, r] : requests_) s.queued_requests += r->done ? 0 : 1;
  return s;
}

}  // namespace spillway::allocator
