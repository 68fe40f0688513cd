// ProcessTag: which process an arena, engine or handle was made in. After fork() a child holds a
// copy of every object but none of its threads, its MADV_DONTFORK memory, or a ring of its own
// (an io_uring's rings are shared mappings: a child's submission lands in the parent's ring).
// Every entry point checks the tag and refuses in a child with FAILED_PRECONDITION naming the
// fork; destructors in a child leak instead of joining threads the child does not have.
// pthread_atfork bumps a generation counter in the child, so the check on every call is one
// relaxed atomic load, not a getpid() system call. Note [Fork] in docs/allocator.md.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "spillway/base/status.h"

namespace spillway::allocator {

namespace internal {
extern std::atomic<uint64_t> g_fork_generation;  // bumped in every forked child
}  // namespace internal

// Installs the atfork handler once; its error (pthread_atfork's ENOMEM) on every later call.
// ProcessTag works either way (see below); callers that can report an error check this.
Status ForkTracking();

class ProcessTag {
 public:
  ProcessTag();  // the calling process; installs the atfork handler once
  // True in the process that made the object, false in a forked child. Without the atfork
  // handler (its registration failed, which was logged) it compares getpid(), a system call.
  bool InOwner() const {
    if (!tracked_) return CurrentPid() == pid_;
    return internal::g_fork_generation.load(std::memory_order_relaxed) == generation_;
  }
  // OK in the owner; in a forked child, FAILED_PRECONDITION: "<what>::<call> in a forked child
  // (pid N) of the process that made it (pid M) ...".
  Status Check(const char* what, const char* call) const {
    return InOwner() ? Status::Ok() : Refuse(what, call);
  }
  pid_t pid() const { return pid_; }

 private:
  Status Refuse(const char* what, const char* call) const;
  static pid_t CurrentPid();
  bool tracked_;  // first: the handler is installed before the generation is read
  uint64_t generation_;
  pid_t pid_;
};

// A std::condition_variable that a forked child never destroys. glibc's pthread_cond_destroy
// waits until the waiters it counts have left, and in a child it counts the parent's threads that
// were waiting at fork time, which never leave there: destroying it would hang the child's exit.
class ForkSafeCondition {
 public:
  ForkSafeCondition() : cv_(new std::condition_variable) {}
  ~ForkSafeCondition() {
    if (process_.InOwner()) delete cv_;  // leaked in a forked child, on purpose
  }
  ForkSafeCondition(const ForkSafeCondition&) = delete;
  ForkSafeCondition& operator=(const ForkSafeCondition&) = delete;

  void notify_one() noexcept { cv_->notify_one(); }
  void notify_all() noexcept { cv_->notify_all(); }
  void wait(std::unique_lock<std::mutex>& lock) { cv_->wait(lock); }
  template <typename Pred>
  void wait(std::unique_lock<std::mutex>& lock, Pred pred) {
    cv_->wait(lock, std::move(pred));
  }
  template <typename Clock, typename Duration>
  std::cv_status wait_until(std::unique_lock<std::mutex>& lock,
                            const std::chrono::time_point<Clock, Duration>& deadline) {
    return cv_->wait_until(lock, deadline);
  }
  template <typename Rep, typename Period, typename Pred>
  bool wait_for(std::unique_lock<std::mutex>& lock, const std::chrono::duration<Rep, Period>& d,
                Pred pred) {
    return cv_->wait_for(lock, d, std::move(pred));
  }

 private:
  const ProcessTag process_;
  std::condition_variable* const cv_;
};

}  // namespace spillway::allocator
