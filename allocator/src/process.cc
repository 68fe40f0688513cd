// ProcessTag. Note [Fork] in docs/allocator.md.
#include "spillway/allocator/process.h"

#include <pthread.h>
#include <unistd.h>

#include "spillway/base/log.h"

namespace spillway::allocator {

namespace internal {
std::atomic<uint64_t> g_fork_generation{0};
}  // namespace internal

namespace {

void InChild() { internal::g_fork_generation.fetch_add(1, std::memory_order_relaxed); }

}  // namespace

Status ForkTracking() {
  static const Status status = [] {
    const int rc = pthread_atfork(nullptr, nullptr, InChild);
    if (rc == 0) return Status::Ok();
    Status st =
        Status::FromErrno(StatusCode::kInternal, rc,
                          "pthread_atfork failed: fork checks fall back to getpid() per call");
    Log(LogLevel::kError, st.ToString());
    return st;
  }();
  return status;
}

ProcessTag::ProcessTag()
    : tracked_(ForkTracking().ok()),
      generation_(internal::g_fork_generation.load(std::memory_order_relaxed)),
      pid_(getpid()) {}

pid_t ProcessTag::CurrentPid() { return getpid(); }

Status ProcessTag::Refuse(const char* what, const char* call) const {
  return Status::FailedPrecondition(
      StrCat(what, "::", call, " in a forked child (pid ", getpid(),
             ") of the process that made it (pid ", pid_,
             "): the child has none of its threads, memory or ring. Make a new one in the child, "
             "or do this work in the parent"));
}

}  // namespace spillway::allocator
