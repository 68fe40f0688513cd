// What a process's resident memory is, by owner. One pass over /proc/<pid>/smaps tells apart, by
// address and path, the host arenas' regions, mapped files, shared memory and the executable with
// its libraries; the allocators' own counters (torch's CPU tensors, torch's pinned cache, Python's
// object arenas, malloc) then split the anonymous rest, and what none of them claims is "unowned".
// The node ledger publishes it per rank. Note [Every byte named] in docs/allocator.md.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <istream>
#include <string>
#include <vector>

#include "spillway/allocator/fork_fault.h"
#include "spillway/base/status.h"

namespace spillway::allocator {

// Bounded on purpose: these are Prometheus label values, and the ledger's slots hold one counter
// each.
enum class MemoryOwner : uint8_t {
  kArenas = 0,   // Spillway's host arena regions
  kTorchCpu,     // torch's CPU tensors outside the arenas (the CPU router's count)
  kTorchPinned,  // torch's own pinned host cache (CUDA's host allocator stats)
  kCudaDriver,   // mappings of the CUDA driver's devices (/dev/nvidia*)
  kPython,       // the interpreter's object arenas (obmalloc)
  kMalloc,       // other bytes malloc hands out: libraries, bindings, large Python objects
  kMallocFree,   // bytes malloc keeps after they were freed
  kMappedFiles,  // file mappings other than code: mmap'd checkpoints, datasets
  kShared,       // shared memory: /dev/shm, memfd, SysV, shared anonymous
  kLibraries,    // the executable and shared libraries (code, data, bss) and the main stack
  kUnowned,      // the anonymous rest that no counter claims
};
inline constexpr int kMemoryOwnerCount = 11;
const char* MemoryOwnerName(MemoryOwner owner);
using OwnerBytes = std::array<uint64_t, kMemoryOwnerCount>;

// Resident bytes (Rss) by where they lie in the memory map.
struct MappedBytes {
  uint64_t arenas = 0;
  uint64_t anonymous = 0;  // private anonymous outside the arenas: [heap], mmaps, thread stacks
  uint64_t files = 0;
  uint64_t shared = 0;
  uint64_t cuda_driver = 0;
  uint64_t libraries = 0;
  uint64_t total = 0;
  uint64_t mappings = 0;
};

// Classifies an smaps text. `regions` are the arenas' (fork_fault::Regions()), `bss` the loaded
// objects' zero-filled data (LoadedBss()): anonymous mappings, told apart only by address. A
// mapping that partly lies in them is split by the covered share of its bytes. Lines it does not
// know are skipped (the kernel adds fields); a text with no mapping gives all zeros.
MappedBytes ClassifySmaps(std::istream& smaps, std::vector<fork_fault::RegionRange> regions,
                          std::vector<fork_fault::RegionRange> bss = {});
// The bss of every object this process loaded (the executable and each shared library): the part
// of a writable PT_LOAD segment past its file bytes, page-aligned, from dl_iterate_phdr.
std::vector<fork_fault::RegionRange> LoadedBss();
// ClassifySmaps of /proc/self/smaps, with the arenas' regions and LoadedBss(); an error names the
// file it could not read.
Result<MappedBytes> ReadMappedBytes();
// The same for another process, whose arenas and bss this one does not know: they count as
// anonymous. `path` is read as an smaps text (tests give one of their own).
Result<MappedBytes> ReadMappedBytes(const std::string& path);

// What the allocators say they hold of the anonymous bytes.
struct HeapCounters {
  uint64_t torch_cpu = 0;
  uint64_t torch_pinned = 0;
  uint64_t python = 0;
  uint64_t malloc_in_use = 0;  // includes torch_cpu: torch's CPU allocator is malloc's client
  uint64_t malloc_free = 0;
};
// malloc_in_use and malloc_free of this process (glibc's mallinfo2: uordblks + hblkhd, fordblks;
// 0 without glibc 2.33's mallinfo2, so malloc's bytes show as unowned).
// Walks malloc's free lists under its locks: call it at a boundary, not per allocation.
void ReadMallocCounters(HeapCounters* counters);

struct ProcessMemory {
  OwnerBytes owners{};
  uint64_t total = 0;  // resident
  // What the counters claimed past the anonymous bytes (they count bytes handed out, some never
  // touched); the claims were scaled down by it, so the owners still sum to `total`.
  uint64_t counted_beyond_resident = 0;
  // The share of `total` known to be held by an owner other than kUnowned, at least: the bytes
  // counted beyond resident may hide as many resident bytes of nobody's, so they count as unnamed
  // here (1 when total is 0).
  double named_fraction() const;
};
ProcessMemory AttributeMemory(const MappedBytes& mapped, const HeapCounters& counters);

// "arenas 1.2 GiB, torch_cpu 300.0 MiB, ...; unowned 2.0 MiB, counted beyond resident 1.0 MiB
// (99.7% named)".
std::string DescribeMemory(const ProcessMemory& memory);

}  // namespace spillway::allocator
