// ExtentMap: exact-size, best-fit extent allocation with coalescing over a set of disjoint spans.
// Spans are address ranges the owner obtained elsewhere (mmap'd host regions, ranges of a swap
// file). It knows nothing about memory or files; HostArena and NvmeArena wrap it with a lock and
// the OS.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "spillway/base/status.h"

namespace spillway::allocator {

// Thread-compatible (the caller locks), like RocksDB's Arena under ConcurrentArena.
//
// Invariants (checked by Validate):
//   for each span s:  s.size == sum(free extents in s) + s.used_bytes
//   free extents are disjoint, lie inside one span, and two free extents never touch (coalesced)
//   free_by_size_ and free_by_addr_ hold the same extents
//   empty_count_ == |{ s : s.used_count == 0 }|, empty_bytes_ == sum of their sizes
class ExtentMap {
 public:
  struct Span {
    uint64_t base = 0;
    uint64_t size = 0;
    uint64_t used_bytes = 0;
    uint64_t used_count = 0;
  };

  // Adds [base, base+size) as one free extent. The range must not overlap an existing span.
  Status AddSpan(uint64_t base, uint64_t size);
  // Extends the span at `base` by `extra` bytes at its end (a file that grew); the new space merges
  // with a free extent that ends where the span did.
  Status GrowSpan(uint64_t base, uint64_t extra);
  // Removes a span that holds no allocation. On error nothing changed.
  Status RemoveSpan(uint64_t base);

  // Best fit: the smallest free extent that holds `size` (lowest address among equals), provided it
  // is no larger than `max_extent`. The extent is split and the remainder stays free. Returns
  // nullopt when no free extent fits.
  std::optional<uint64_t> Allocate(uint64_t size, uint64_t max_extent = UINT64_MAX);
  // Returns [base, base+size) to the free set and coalesces it with free neighbours in its span.
  // The caller guarantees it is an extent returned by Allocate with that size (the arenas check
  // this against their live table before calling).
  void Free(uint64_t base, uint64_t size);

  // The span that contains `addr`, or null.
  const Span* FindSpan(uint64_t addr) const;
  // The size of the free extent that ends exactly at `end`, or 0.
  uint64_t FreeBytesEndingAt(uint64_t end) const;
  // Whether `addr` lies inside a free extent.
  bool IsFree(uint64_t addr) const;

  uint64_t span_bytes() const { return span_bytes_; }
  uint64_t free_bytes() const { return free_bytes_; }
  // Bytes in spans that hold no allocation at all (what Trim can give back whole).
  uint64_t empty_span_bytes() const { return empty_bytes_; }
  size_t span_count() const { return spans_.size(); }
  size_t free_extent_count() const { return free_by_addr_.size(); }
  uint64_t largest_free_extent() const;
  // Bases of the spans that hold no allocation, largest first.
  std::vector<Span> EmptySpans() const;  // O(spans); only called when trimming
  const std::map<uint64_t, Span>& spans() const { return spans_; }

  // Walks every structure and checks the invariants above against the caller's list of allocated
  // extents (base, size). Costs O(n log n); for tests and debug builds.
  Status Validate(const std::vector<std::pair<uint64_t, uint64_t>>& allocated) const;
  // The invariants that need no list of allocated extents: the two free indexes agree, every free
  // extent lies inside its span and is coalesced with its free neighbours, and each span's free and
  // used bytes add up to its size. O(n log n). With SPILLWAY_DEBUG_CHECKS it runs after every
  // mutating call (Note [Check levels] in docs/base.md).
  Status Validate() const;

 private:
  struct Free_ {
    uint64_t size;
    uint64_t span_base;
  };
  Span* SpanOf(uint64_t addr);
  void InsertFree(uint64_t base, uint64_t size, uint64_t span_base);
  void EraseFree(std::map<uint64_t, Free_>::iterator it);
  void NoteUsed(Span& span, int64_t delta_bytes, int64_t delta_count);

  std::map<uint64_t, Span> spans_;                        // by base
  std::map<uint64_t, Free_> free_by_addr_;                // by extent base
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;  // (size, base)
  uint64_t empty_count_ = 0;
  uint64_t span_bytes_ = 0;
  uint64_t free_bytes_ = 0;
  uint64_t empty_bytes_ = 0;
};

}  // namespace spillway::allocator
