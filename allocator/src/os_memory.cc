// Memory syscalls for HostArena, behind one seam (mimalloc's prim.h habit).
#include "os_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>

namespace spillway::allocator::os {
namespace {

int TakeFault(std::atomic<int>* slot) {
  return slot == nullptr ? 0 : slot->exchange(0, std::memory_order_acq_rel);
}

}  // namespace

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

uint64_t PhysicalMemoryBytes() {
  return static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * PageSize();
}

Result<void*> MapAnonymous(size_t bytes, HostArenaFaults* faults) {
  if (int err = TakeFault(faults ? &faults->map_errno : nullptr); err != 0) {
    return Status::FromErrno(StatusCode::kOutOfMemory, err,
                             StrCat("mmap of ", FormatBytes(bytes), " for a host arena region "
                                    "failed (injected)"));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return Status::FromErrno(StatusCode::kOutOfMemory, errno,
                             StrCat("mmap of ", FormatBytes(bytes),
                                    " for a host arena region failed; lower the host budget or "
                                    "free memory on the machine"));
  }
  return p;
}

Status Unmap(void* base, size_t bytes) {
  if (munmap(base, bytes) != 0) {
    return Status::FromErrno(StatusCode::kInternal, errno,
                             StrCat("munmap of a host arena region of ", FormatBytes(bytes)));
  }
  return Status::Ok();
}

Status MarkForkSafety(void* base, size_t bytes, ForkSafety mode) {
  int advice = 0;
  switch (mode) {
    case ForkSafety::kInherit: return Status::Ok();
    case ForkSafety::kDontFork: advice = MADV_DONTFORK; break;
    case ForkSafety::kWipeOnFork: advice = MADV_WIPEONFORK; break;
  }
  if (madvise(base, bytes, advice) != 0) {
    return Status::FromErrno(StatusCode::kUnavailable, errno,
                             StrCat("madvise(", ForkSafetyName(mode),
                                    ") on a host arena region; this kernel may lack it, set "
                                    "fork_safety=inherit to run without fork protection"));
  }
  return Status::Ok();
}

Status LockPages(void* base, size_t bytes, HostArenaFaults* faults) {
  int err = TakeFault(faults ? &faults->pin_errno : nullptr);
  if (err == 0 && mlock(base, bytes) != 0) err = errno;
  if (err != 0) {
    rlimit lim{};
    getrlimit(RLIMIT_MEMLOCK, &lim);
    const std::string limit =
        lim.rlim_cur == RLIM_INFINITY ? "unlimited" : FormatBytes(lim.rlim_cur);
    return Status::FromErrno(
        StatusCode::kOutOfMemory, err,
        StrCat("mlock of ", FormatBytes(bytes), " failed (RLIMIT_MEMLOCK is ", limit,
               "); raise `ulimit -l`, grant CAP_IPC_LOCK, lower the host budget, or set "
               "pin_memory=false to use pageable memory"));
  }
  return Status::Ok();
}

}  // namespace spillway::allocator::os
