// The policy Spillway's host arena replaces, kept as a baseline to measure against: PyTorch's
// CachingHostAllocator rounds every request up to a power of two, keeps a free list per rounded
// size, reuses a block only for a request of the same rounded size, and gives nothing back to the
// OS until it is destroyed (FIELD.md §1). bench/compare_host_arena replays traces through it and
// the leak suite's pinned-pow2 scenario is its negative control; both use this one model.
// Not thread-safe (neither user needs it). Memory comes from mmap, so "held" is address space
// taken from the OS, as the real cache's cudaHostAlloc'd blocks are.
#pragma once

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <map>
#include <unordered_map>
#include <vector>

#include "spillway/base/status.h"

namespace spillway::allocator::baseline {

class Pow2CachingPolicy {
 public:
  static constexpr uint64_t kMinBlock = 4096;

  Pow2CachingPolicy() = default;
  Pow2CachingPolicy(const Pow2CachingPolicy&) = delete;
  Pow2CachingPolicy& operator=(const Pow2CachingPolicy&) = delete;
  ~Pow2CachingPolicy() {
    for (const auto& [p, size] : size_) munmap(p, size);  // live and cached blocks alike
  }

  // The size a request of `bytes` occupies: the next power of two, at least one page.
  static uint64_t Rounded(uint64_t bytes) {
    uint64_t rounded = kMinBlock;
    while (rounded < bytes) rounded <<= 1;
    return rounded;
  }

  Result<void*> Alloc(uint64_t bytes) {
    if (bytes == 0 || bytes > (uint64_t{1} << 62)) {
      return Status::InvalidArgument(
          StrCat("Pow2CachingPolicy::Alloc(", bytes, "): size must be in [1, 2^62]"));
    }
    const uint64_t rounded = Rounded(bytes);
    auto& bin = free_[rounded];
    if (!bin.empty()) {
      void* p = bin.back();
      bin.pop_back();
      return p;
    }
    void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return Status::FromErrno(StatusCode::kOutOfMemory, errno,
                               StrCat("Pow2CachingPolicy: mmap of ", rounded, " bytes"));
    }
    size_[p] = rounded;
    held_ += rounded;
    return p;
  }

  // Back to its size's free list; never to the OS. A pointer this policy did not hand out is an
  // error (a double free is not detected: the real cache does not detect it either).
  Status Free(void* p) {
    auto it = size_.find(p);
    if (it == size_.end()) {
      return Status::InvalidArgument("Pow2CachingPolicy::Free: pointer was not allocated here");
    }
    free_[it->second].push_back(p);
    return Status::Ok();
  }

  uint64_t held_bytes() const { return held_; }

 private:
  std::map<uint64_t, std::vector<void*>> free_;  // rounded size -> cached blocks
  std::unordered_map<void*, uint64_t> size_;     // every block ever mapped -> rounded size
  uint64_t held_ = 0;
};

}  // namespace spillway::allocator::baseline
