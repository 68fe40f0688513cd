// Naming the fault of a forked child that touches a region kept out of it (MADV_DONTFORK): a
// lock-free table of those regions, and a SIGSEGV handler that a pthread_atfork child handler
// installs, which writes one message when the faulting address lies in a recorded region and then
// leaves the fault to the disposition that was there before. Note [Fork fault] in
// docs/allocator.md.
#pragma once

#include <cstdint>
#include <vector>

namespace spillway::allocator::fork_fault {

// At most this many regions are named at once; a region past it is kept out of children as
// before, only not named, nor told apart in the process's memory (Stats says how many).
inline constexpr int kMaxRegions = 4096;

// Records a host arena region of `arena` (copied, at most 47 characters), first mapped for an
// allocation of `kind` (a static string). `kept_out`: the region is MADV_DONTFORK, so a forked
// child's fault on it is named (the first such region arms the atfork handler); every region is
// listed by Regions() either way. Lock-free.
void Register(const void* base, uint64_t bytes, const char* arena, const char* kind,
              bool kept_out = true);
// Forgets the region at `base` (before it is unmapped). Lock-free.
void Unregister(const void* base);

// Every region recorded now, kept out of children or not: what the process's memory map
// attributes to the arenas (process_memory.h). Lock-free; allocates the vector.
struct RegionRange {
  uintptr_t base;
  uint64_t bytes;
};
std::vector<RegionRange> Regions();

// Installs the handler in this process now, in front of whatever handles SIGSEGV at this moment
// (which takes every fault after it): for a child whose runtime replaced the handler the fork left
// (torch's DataLoader worker sets its own at its start). Nothing when no region is recorded.
void Rearm();

struct Stats {
  int regions = 0;       // recorded now (kept out of children or not)
  uint64_t unnamed = 0;  // regions that found the table full
  bool armed = false;    // the atfork handler is installed
};
Stats Snapshot();

}  // namespace spillway::allocator::fork_fault
