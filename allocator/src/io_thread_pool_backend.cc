// The I/O engine's fallback backend: `threads` workers that take chunks from the core and move
// them with pread/pwrite. It runs where io_uring is not allowed (ENOSYS/EPERM under seccomp), or
// when asked for (IoEngineOptions::force_thread_pool). No fixed files or buffers.
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <thread>
#include <vector>

#include "io_backend.h"
#include "io_core.h"

namespace spillway::allocator {
namespace {

class ThreadPoolBackend final : public IoBackendImpl {
 public:
  ThreadPoolBackend(IoCore* core, uint32_t threads) : core_(core), thread_count_(threads) {}

  IoBackend kind() const override { return IoBackend::kThreadPool; }

  void Start() override {
    for (uint32_t i = 0; i < thread_count_; ++i) threads_.emplace_back([this] { Loop(); });
  }
  void Wake() override { core_->work_cv.notify_all(); }
  void Join() override {
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void Loop() {
    for (;;) {
      IoChunk* c = nullptr;
      {
        std::unique_lock<std::mutex> lock(core_->mu);
        for (;;) {
          c = core_->NextChunkLocked(false);
          if (c != nullptr || core_->DrainedLocked()) break;
          core_->work_cv.wait(lock);
        }
      }
      if (c == nullptr) return;
      core_->StageWrite(c);
      bool again;
      do {
        core_->FillFault(c);
        char* buf = c->io_buffer + c->done;
        const auto off = static_cast<off_t>(c->file_offset + c->done);
        ssize_t n = c->request->op == IoOp::kRead ? pread(c->fd, buf, c->submit_length, off)
                                                  : pwrite(c->fd, buf, c->submit_length, off);
        again = core_->CompleteChunk(c, n < 0 ? -errno : n);
      } while (again);
    }
  }

  IoCore* const core_;
  const uint32_t thread_count_;
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<IoBackendImpl> NewThreadPoolBackend(IoCore* core, uint32_t threads) {
  return std::make_unique<ThreadPoolBackend>(core, threads);
}

}  // namespace spillway::allocator
