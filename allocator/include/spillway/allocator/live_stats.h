// LiveStats: the owner-side counters every arena reports (live bytes by kind and lifetime, escapes,
// reclaims, refused frees). HostArenaStats and NvmeArenaStats extend it with their tier's own.
#pragma once

#include <array>
#include <cstdint>

#include "spillway/allocator/owner.h"

namespace spillway::allocator {

// Counters by (kind, lifetime), e.g. escapes found at boundaries.
using KindLifetimeCounts = std::array<std::array<uint64_t, kLifetimeCount>, kKindCount>;

struct LiveStats {
  uint64_t live_bytes = 0;       // granule-rounded extents handed out
  uint64_t requested_bytes = 0;  // what callers asked for
  KindBytes live_by_kind{};
  LifetimeBytes live_by_lifetime{};
  uint64_t live_allocations = 0;
  uint64_t peak_live_bytes = 0;
  uint64_t peak_requested_bytes = 0;
  // Monotonic counters.
  uint64_t alloc_count = 0;
  uint64_t free_count = 0;
  uint64_t escape_count = 0;
  uint64_t escaped_bytes = 0;
  KindLifetimeCounts escapes_by{};        // escape_count split by kind and lifetime
  KindLifetimeCounts escaped_bytes_by{};  // escaped_bytes split likewise
  uint64_t reclaim_count = 0;             // escapes freed by the reclaim policy
  uint64_t reclaimed_bytes = 0;
  uint64_t scope_freed_count = 0;  // freed by ReleaseScope
  uint64_t scope_freed_bytes = 0;
  uint64_t bad_free_count = 0;  // double, foreign or interior frees refused
};

}  // namespace spillway::allocator
