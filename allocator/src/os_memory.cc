// Memory syscalls for HostArena, behind one seam (mimalloc's prim.h habit).
#include "os_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <sstream>
#include <string>

#include "spillway/base/bytes.h"

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

}  // namespace spillway::allocator::os

namespace spillway::allocator {
namespace {

// The first line of a cgroup limit file as bytes; UINT64_MAX for "max", absent or unparsable files.
uint64_t ReadLimitFile(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return UINT64_MAX;
  uint64_t v = 0;
  for (char c : word) {
    if (c < '0' || c > '9') return UINT64_MAX;
    if (v > (UINT64_MAX - 9) / 10) return UINT64_MAX;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

}  // namespace

MemoryLimit MemoryLimitOf(std::string_view proc_self_cgroup, const std::string& cgroup_root,
                          uint64_t physical_bytes) {
  MemoryLimit limit{physical_bytes, ""};
  std::istringstream lines{std::string(proc_self_cgroup)};
  std::string line;
  while (std::getline(lines, line)) {
    // "0::/path" (v2) or "N:controller[,controller]:/path" (v1).
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    std::string dir, file;
    if (controllers.empty()) {
      dir = cgroup_root;
      file = "memory.max";
    } else if ((StrCat(",", controllers, ",")).find(",memory,") != std::string::npos) {
      dir = cgroup_root + "/memory";
      file = "memory.limit_in_bytes";
    } else {
      continue;
    }
    // The limit in force is the smallest one on the way from the cgroup up to the root; of equal
    // ones, the outermost: Slurm sets the same memory.max on a job and on each of its steps, and
    // two steps of one allocation meet one OOM killer, so they keep one ledger.
    while (true) {
      const std::string at = path == "/" ? dir : StrCat(dir, path);
      const uint64_t here = ReadLimitFile(StrCat(at, "/", file));
      if (here < limit.bytes || (here == limit.bytes && !limit.cgroup.empty())) {
        limit = MemoryLimit{here, at};
      }
      if (path.empty() || path == "/") break;
      const size_t slash = path.rfind('/');
      path = slash == 0 || slash == std::string::npos ? std::string("/") : path.substr(0, slash);
    }
  }
  return limit;
}

MemoryLimit MemoryLimitOf() {
  std::ifstream in("/proc/self/cgroup");
  std::stringstream text;
  text << in.rdbuf();
  return MemoryLimitOf(text.str(), "/sys/fs/cgroup", os::PhysicalMemoryBytes());
}

uint64_t MemoryLimitBytes(std::string_view proc_self_cgroup, const std::string& cgroup_root,
                          uint64_t physical_bytes) {
  return MemoryLimitOf(proc_self_cgroup, cgroup_root, physical_bytes).bytes;
}

uint64_t MemoryLimitBytes() { return MemoryLimitOf().bytes; }

uint64_t DefaultHostBudget() { return MemoryLimitBytes() / 4 * 3; }

}  // namespace spillway::allocator

namespace spillway::allocator::os {

Result<void*> MapAnonymous(size_t bytes, HostArenaFaults* faults) {
  if (int err = TakeFault(faults ? &faults->map_errno : nullptr); err != 0) {
    return Status::FromErrno(StatusCode::kOutOfMemory, err,
                             StrCat("mmap of ", FormatBytes(bytes),
                                    " for a host arena region "
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
    case ForkSafety::kInherit:
      return Status::Ok();
    case ForkSafety::kDontFork:
      advice = MADV_DONTFORK;
      break;
    case ForkSafety::kWipeOnFork:
      advice = MADV_WIPEONFORK;
      break;
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
