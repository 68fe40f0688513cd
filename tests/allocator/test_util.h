// Helpers shared by the allocator tests: arena factories and /proc readers.
#pragma once

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "spillway/allocator/host_arena.h"
#include "spillway/base/bytes.h"

namespace spillway::allocator::testing {

// ASan and TSan intercept mlock as a no-op and reroute fork and signals; tests that observe the
// kernel's view of those skip under them (the plain build runs them).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kUnderSanitizer = true;
#else
inline constexpr bool kUnderSanitizer = false;
#endif
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kUnderTsan = true;
#else
inline constexpr bool kUnderTsan = false;
#endif

inline HostArenaOptions PageableOptions(Ledger* ledger) {
  HostArenaOptions o;
  o.pin = PinMode::kPageable;
  o.ledger = ledger;
  o.budget_bytes = 512 * kMiB;
  o.region_bytes = 4 * kMiB;
  o.retain_limit_bytes = 16 * kMiB;
  return o;
}

inline std::unique_ptr<HostArena> MakeArena(const HostArenaOptions& o) {
  auto r = HostArena::Create(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r.value()) : nullptr;
}

inline OwnerTag Tag(Kind kind, Lifetime lifetime, uint64_t owner = 0,
                    ScopeId scope = kProcessScope) {
  return OwnerTag{kind, lifetime, owner, scope, SPILLWAY_SITE};
}

// A field from /proc/self/status in kB, e.g. "VmLck".
inline uint64_t ProcStatusKb(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1));
  }
  return 0;
}

// Whether [p, p+bytes) is mapped at all: mincore fails with ENOMEM on an unmapped range.
inline bool IsMapped(void* p, size_t bytes) {
  std::vector<unsigned char> vec((bytes + 4095) / 4096);
  return mincore(p, bytes, vec.data()) == 0;
}

inline bool Has(const Status& st, const std::string& text) {
  return st.message().find(text) != std::string::npos;
}

// In a forked child (Note [Fork]): counts the calls that did not refuse with FAILED_PRECONDITION
// naming the fork, each printed to stderr; the child exits with bad == 0.
struct RefusedInChild {
  int bad = 0;
  void operator()(const Status& st, const char* call) {
    if (st.code() != StatusCode::kFailedPrecondition ||
        st.message().find("in a forked child") == std::string::npos) {
      std::fprintf(stderr, "child: %s returned %s\n", call, st.ToString().c_str());
      ++bad;
    }
  }
};

}  // namespace spillway::allocator::testing
