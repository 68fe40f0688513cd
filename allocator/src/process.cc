// ProcessTag. Note [Fork] in docs/allocator.md.
#include "spillway/allocator/process.h"

#include <pthread.h>
#include <unistd.h>

#include <mutex>

namespace spillway::allocator {

namespace internal {
std::atomic<uint64_t> g_fork_generation{0};
}  // namespace internal

namespace {

void InChild() { internal::g_fork_generation.fetch_add(1, std::memory_order_relaxed); }

}  // namespace

ProcessTag::ProcessTag() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, InChild); });
  generation_ = internal::g_fork_generation.load(std::memory_order_relaxed);
  pid_ = getpid();
}

Status ProcessTag::Refuse(const char* what, const char* call) const {
  return Status::FailedPrecondition(StrCat(
      what, "::", call, " in a forked child (pid ", getpid(), ") of the process that made it (pid ",
      pid_, "): the child has none of its threads, memory or ring. Make a new one in the child, "
      "or do this work in the parent"));
}

}  // namespace spillway::allocator
