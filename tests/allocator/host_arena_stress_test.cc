// Seeded multi-threaded stress: 4 threads allocate and free with mixed kinds, lifetimes and sizes,
// one of them drives step and epoch boundaries, another trims and reads stats, while a scope is
// created and released under them. Validate() runs after every round. Run it under asan and tsan.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/base/bytes.h"
#include "test_util.h"

namespace spillway::allocator {
namespace {

int OpsPerRound() {
  const char* env = std::getenv("SPILLWAY_STRESS_OPS");
  return env ? std::atoi(env) : 3000;
}

TEST(HostArenaStressTest, FourThreadsWithBoundariesScopesAndTrims) {
  Ledger ledger;
  HostArenaOptions o = testing::PageableOptions(&ledger);
  o.budget_bytes = 96 * kMiB;  // small enough that some requests meet the budget
  o.retain_limit_bytes = 8 * kMiB;
  auto arena = testing::MakeArena(o);
  ASSERT_NE(arena, nullptr);
  const int ops = OpsPerRound();
  int64_t step = 0;
  ASSERT_TRUE(ledger.BeginEpoch(0).ok());
  for (int round = 0; round < 8; ++round) {
    auto scope = ledger.CreateScope("stress-scope");
    ASSERT_TRUE(scope.ok());
    std::atomic<uint64_t> over_budget{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(1000 * round + t);
        std::vector<void*> mine;
        for (int i = 0; i < ops; ++i) {
          const int dice = static_cast<int>(rng() % 100);
          if (dice < 55 || mine.empty() || t == 3) {
            uint64_t bytes = 1 + rng() % (dice < 5 ? 9 * kMiB : 600 * 1024);
            // Thread 3 owns the scope's memory and never frees it: the scope release does.
            // (A pointer kept past its scope's release may by then name someone else's memory.)
            OwnerTag tag{static_cast<Kind>(rng() % kKindCount),
                         static_cast<Lifetime>(rng() % kLifetimeCount), rng() % 64,
                         t == 3 ? *scope : kProcessScope, SPILLWAY_SITE};
            auto p = arena->Allocate(bytes, tag);
            if (p.ok() && t == 3) {
              // Not touched: the driver may release the scope (and unmap it) at any moment.
            } else if (p.ok()) {
              static_cast<char*>(*p)[0] = 1;
              static_cast<char*>(*p)[bytes - 1] = 1;
              mine.push_back(*p);
            } else if (p.status().code() == StatusCode::kOverBudget) {
              over_budget++;
            } else {
              ASSERT_EQ(p.status().code(), StatusCode::kFailedPrecondition)
                  << p.status().ToString();
            }
          } else {
            size_t k = rng() % mine.size();
            Status st = arena->Free(mine[k]);
            ASSERT_TRUE(st.ok()) << st.ToString();
            mine[k] = mine.back();
            mine.pop_back();
          }
          if (t == 1 && i % 97 == 0) {
            HostArenaStats s = arena->Stats();
            ASSERT_LE(s.committed_bytes, o.budget_bytes);
            ASSERT_LE(s.live_bytes, s.committed_bytes);
            if (i % 3 == 0) arena->Trim();
          }
        }
        for (void* p : mine) ASSERT_TRUE(arena->Free(p).ok());
      });
    }
    // This thread drives boundaries and, half way through, releases the scope.
    std::thread driver([&] {
      for (int b = 0; b < 20; ++b) {
        ASSERT_TRUE(ledger.BeginStep(step++).ok());
        std::this_thread::yield();
        BoundaryReport report;
        ASSERT_TRUE(ledger.EndStep(&report).ok());
        if (b == 10) {
          ASSERT_TRUE(ledger.ReleaseScope(*scope).ok());
        }
      }
    });
    for (auto& th : threads) th.join();
    driver.join();
    Status v = arena->Validate();
    ASSERT_TRUE(v.ok()) << "round " << round << ": " << v.ToString();
    HostArenaStats s = arena->Stats();
    EXPECT_EQ(s.live_bytes, 0u) << "round " << round;
    EXPECT_LE(s.retained_bytes, o.retain_limit_bytes);
  }
  BoundaryReport report;
  ASSERT_TRUE(ledger.EndEpoch(&report).ok());
  EXPECT_EQ(report.live_bytes(), 0u);
}

}  // namespace
}  // namespace spillway::allocator
