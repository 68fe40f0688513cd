// The I/O engine's io_uring backend: one ring thread owns the ring, submission and completion
// both, so no lock is held across io_uring_enter. Callers wake it through an eventfd whose read is
// always armed in the ring. Swap files are fixed files and the host arena's regions fixed buffers
// (sparse tables, Linux 5.19; before that a plain file table and no fixed buffers).
#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "io_backend.h"
#include "io_core.h"
#include "spillway/base/log.h"

namespace spillway::allocator {
namespace {

constexpr uint64_t kWakeTag = 0;  // user_data of the eventfd read that wakes the ring thread

class UringBackend final : public IoBackendImpl {
 public:
  explicit UringBackend(IoCore* core) : core_(core) {}
  ~UringBackend() override {
    if (!initialized_) return;
    io_uring_queue_exit(&ring_);
    close(event_fd_);
  }

  IoBackend kind() const override { return IoBackend::kUring; }

  void Start() override {
    thread_ = std::thread([this] { RingLoop(); });
  }
  void Wake() override {
    const uint64_t one = 1;
    ssize_t n = write(event_fd_, &one, sizeof(one));
    (void)n;  // a full counter still wakes the reader
  }
  void Join() override {
    if (thread_.joinable()) thread_.join();
  }

  bool fixed_files() const override { return true; }
  bool fixed_buffers() const override { return fixed_buffers_; }
  int UpdateFileSlot(int slot, int fd) override {
    return io_uring_register_files_update(&ring_, slot, &fd, 1);
  }
  int UpdateBufferSlot(int slot, void* base, uint64_t bytes) override {
    iovec iov{base, bytes};  // a null base clears the slot
    return io_uring_register_buffers_update_tag(&ring_, slot, &iov, nullptr, 1);
  }

  // Sets up io_uring with sparse buffer and file tables. Returns the errno on failure.
  int Init() {
    io_uring_params params{};
    if (core_->options.sqpoll) {
      params.flags |= IORING_SETUP_SQPOLL;
      params.sq_thread_idle = 50;  // ms; liburing sets IORING_ENTER_SQ_WAKEUP on NEED_WAKEUP
    }
    const unsigned entries = std::max(8u, core_->options.queue_depth * 2 + 2);
    int rc = io_uring_queue_init_params(entries, &ring_, &params);
    if (rc < 0) return -rc;
    // Sparse tables (Linux 5.19). Before that, register the file table plainly (a table of -1
    // entries, filled by updates since 5.5) and run without fixed buffers, rather than leave
    // io_uring.
    const IoFaults* faults = core_->options.faults;
    const int fault = faults != nullptr ? faults->sparse_registration_errno : 0;
    const int buffers =
        fault != 0 ? -fault : io_uring_register_buffers_sparse(&ring_, IoCore::kBufferSlots);
    int files = fault != 0 ? -fault : io_uring_register_files_sparse(&ring_, IoCore::kFileSlots);
    if (buffers == 0 && files == 0) {
      core_->stats.registration = "sparse";
    } else if (buffers == -EINVAL || files == -EINVAL) {
      const int why = buffers != 0 ? -buffers : -files;
      if (buffers == 0) io_uring_unregister_buffers(&ring_);
      if (files != 0) {
        std::vector<int> empty(IoCore::kFileSlots, -1);
        files = io_uring_register_files(&ring_, empty.data(), IoCore::kFileSlots);
      }
      if (files < 0) {
        io_uring_queue_exit(&ring_);
        return -files;
      }
      fixed_buffers_ = false;
      core_->stats.registration =
          StrCat("plain files, no fixed buffers (sparse registration: ", ErrnoText(why), ")");
      Log(LogLevel::kWarning, StrCat("io_uring without sparse registration (", ErrnoText(why),
                                     "; Linux < 5.19?): files are registered plainly and reads "
                                     "and writes use no fixed buffers"));
    } else {
      io_uring_queue_exit(&ring_);
      return buffers != 0 ? -buffers : -files;
    }
    event_fd_ = eventfd(0, EFD_CLOEXEC);
    if (event_fd_ < 0) {
      const int err = errno;
      io_uring_queue_exit(&ring_);
      return err;
    }
    initialized_ = true;
    return 0;
  }

 private:
  // Queues the eventfd read that wakes the ring thread; false when no SQE is free (retried).
  bool ArmWake() {
    io_uring_sqe* sqe = GetSqe();
    if (sqe == nullptr) return false;
    io_uring_prep_read(sqe, event_fd_, &event_value_, sizeof(event_value_), 0);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    sq_order_.push_back(nullptr);
    return true;
  }

  // Null when the submission queue is full; the caller retries after the next submit. (Submitting
  // here would hide a submit failure from RingLoop.)
  io_uring_sqe* GetSqe() {
    if (IoFaults* f = core_->options.faults;
        f != nullptr && f->null_sqes.load() > 0 && f->null_sqes.fetch_sub(1) > 0) {
      return nullptr;
    }
    return io_uring_get_sqe(&ring_);
  }

  // False when no SQE was free: the chunk waits for the next round.
  bool Prep(IoChunk* c) {
    io_uring_sqe* sqe = GetSqe();
    if (sqe == nullptr) {
      std::lock_guard<std::mutex> lock(core_->mu);
      core_->stats.sqe_shortages++;
      return false;
    }
    core_->FillFault(c);
    char* buf = c->io_buffer + c->done;
    const uint64_t off = c->file_offset + c->done;
    const auto len = static_cast<unsigned>(c->submit_length);
    const bool read = c->request->op == IoOp::kRead;
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
    sq_order_.push_back(c);
    return true;
  }

  // Applies the completions in the CQ; chunks to resubmit go to `again`.
  void Reap(std::vector<IoChunk*>* again) {
    io_uring_cqe* cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      if (cqe->user_data == kWakeTag) {
        wake_armed_ = false;
        continue;
      }
      auto* c = static_cast<IoChunk*>(io_uring_cqe_get_data(cqe));
      if (core_->CompleteChunk(c, cqe->res)) again->push_back(c);
    }
    io_uring_cq_advance(&ring_, seen);
  }

  // After a failed submit: wait (without submitting) for the chunks the kernel already has; a
  // chunk that would need resubmitting (a retry, a short transfer) fails with the ring's error.
  void DrainAfterFailure(const Status& failure) {
    std::vector<IoChunk*> again;
    for (;;) {
      for (IoChunk* c : again) (void)core_->CompleteChunk(c, 0, &failure);
      again.clear();
      {
        std::lock_guard<std::mutex> lock(core_->mu);
        if (core_->in_flight == 0) return;
      }
      io_uring_cqe* cqe;
      const int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        // The ring cannot report completions either. Fail the requests so no Wait blocks for
        // ever, and leak their chunks and bounce buffers: the kernel may still touch that memory.
        Log(LogLevel::kError, StrCat("io_uring_wait_cqe after a ring failure: ", ErrnoText(-rc),
                                     "; the requests the kernel still holds fail now"));
        core_->AbandonInFlight(failure);
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
    std::vector<IoChunk*> again;  // to (re)submit: retries, short transfers, no SQE last time
    for (;;) {
      if (!wake_armed_) wake_armed_ = ArmWake();
      std::vector<IoChunk*> todo;
      todo.swap(again);
      for (IoChunk* c : todo) {
        if (!Prep(c)) again.push_back(c);
      }
      while (again.empty()) {
        IoChunk* c;
        {
          std::lock_guard<std::mutex> lock(core_->mu);
          if (core_->DrainedLocked()) return;
          c = core_->NextChunkLocked(true);
        }
        if (c == nullptr) break;
        core_->StageWrite(c);
        if (!Prep(c)) again.push_back(c);
      }
      // The eventfd read is armed, so this returns when a chunk completes or work arrives.
      int rc;
      if (IoFaults* f = core_->options.faults; f != nullptr && f->submit_errno.load() != 0) {
        rc = -f->submit_errno.exchange(0);
      } else {
        // A chunk that found no SQE must not wait for a completion that may never come: the
        // submit frees the queue's slots, so go round at once.
        rc = io_uring_submit_and_wait(&ring_, again.empty() && wake_armed_ ? 1 : 0);
      }
      if (rc >= 0) {
        const size_t n = std::min<size_t>(static_cast<size_t>(rc), sq_order_.size());
        sq_order_.erase(sq_order_.begin(), sq_order_.begin() + static_cast<std::ptrdiff_t>(n));
      } else if (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        // Unsubmitted: what is still in sq_order_ (minus the wake read) and what waits for an SQE.
        std::vector<IoChunk*> lost = again;
        for (IoChunk* c : sq_order_) {
          if (c != nullptr) lost.push_back(c);
        }
        sq_order_.clear();
        again.clear();
        DrainAfterFailure(core_->RingFailed(-rc, lost));
        return;
      }
      Reap(&again);
    }
  }

  IoCore* const core_;
  io_uring ring_{};
  bool initialized_ = false;   // Init succeeded: the ring and the eventfd are ours to release
  bool fixed_buffers_ = true;  // the ring has a buffer table (sparse registration worked)
  int event_fd_ = -1;
  uint64_t event_value_ = 0;
  std::thread thread_;
  std::deque<IoChunk*> sq_order_;  // ring thread: SQEs queued and not yet submitted (null: wake)
  bool wake_armed_ = false;        // ring thread: the eventfd read is queued or in flight
};

}  // namespace

std::unique_ptr<IoBackendImpl> NewUringBackend(IoCore* core, int* err) {
  auto backend = std::make_unique<UringBackend>(core);
  *err = backend->Init();
  if (*err != 0) return nullptr;
  return backend;
}

}  // namespace spillway::allocator
