// The only place host-arena code makes memory syscalls: mmap, munmap, madvise, mlock.
// A one-shot fault-injection seam lets tests make the next map or pin fail with a chosen errno.
#pragma once

#include <cstddef>

#include "spillway/allocator/host_arena.h"
#include "spillway/base/status.h"

namespace spillway::allocator::os {

size_t PageSize();
// Total physical memory from sysconf, for the default budget.
uint64_t PhysicalMemoryBytes();

// Anonymous private read-write mapping; nothing is touched.
Result<void*> MapAnonymous(size_t bytes, HostArenaFaults* faults);
Status Unmap(void* base, size_t bytes);
// MADV_DONTFORK or MADV_WIPEONFORK on the range; kInherit does nothing.
Status MarkForkSafety(void* base, size_t bytes, ForkSafety mode);
// mlock: faults in and locks the pages. On failure, names RLIMIT_MEMLOCK and pin_memory=false.
Status LockPages(void* base, size_t bytes, HostArenaFaults* faults);

}  // namespace spillway::allocator::os
