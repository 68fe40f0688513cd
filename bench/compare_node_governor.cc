// compare_node_governor: what the node budget costs a rank (Note [Node governor]). Three
// measurements, each interleaved A/B/A/B in one run, medians and spread of the ratios printed:
//   fast path    alloc/free pairs inside mapped regions: HostArena with a NodeGovernor against the
//                same arena without, fresh arenas each round (the governor is not on this path at
//                all: expect the A/A band);
//   region path  alloc/free pairs that map and unmap a dedicated region each (retain limit 0): the
//                region is booked and given back on the node segment around mmap/munmap;
//   A/A          the plain arena against itself: the noise band the other two sit in.
// Then the cross-rank trim's latency: a forked rank holds retained regions, this rank asks for
// memory only they can free, and the time until its Reserve returns is reported (median, max).
// The last line is one JSON object.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/node_governor.h"
#include "spillway/base/bytes.h"

namespace {

using spillway::kMiB;
using spillway::StrCat;
using namespace spillway::allocator;
using Clock = std::chrono::steady_clock;

const OwnerTag kTag{Kind::kTransient, Lifetime::kStep, 0, kProcessScope, "bench"};

std::unique_ptr<HostArena> MakeArena(Ledger* ledger, std::shared_ptr<NodeGovernor> node,
                                     uint64_t retain_bytes) {
  HostArenaOptions o;
  o.pin = PinMode::kPageable;
  o.ledger = ledger;
  o.budget_bytes = 4096 * kMiB;
  o.region_bytes = 32 * kMiB;
  o.retain_limit_bytes = retain_bytes;
  o.retain_fraction = retain_bytes == 0 ? 0.0 : 1.0;
  o.node = std::move(node);
  auto r = HostArena::Create(o);
  if (!r.ok()) {
    std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(r.value());
}

double PairsNs(HostArena* a, uint64_t bytes, int pairs) {
  const auto t0 = Clock::now();
  for (int i = 0; i < pairs; ++i) {
    auto p = a->Allocate(bytes, kTag);
    if (!p.ok() || !a->Free(*p).ok()) std::exit(2);
  }
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / pairs;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Ratio {
  double median, low, high;
};

// Interleaves a and b `rounds` times, alternating which runs first (ABBA: the second of a pair
// runs on warmer caches); returns the median b/a ratio and its range.
template <typename A, typename B>
Ratio Interleaved(int rounds, A a, B b) {
  std::vector<double> ratios;
  for (int r = 0; r < rounds; ++r) {
    double ta = 0, tb = 0;
    if (r % 2 == 0) {
      ta = a();
      tb = b();
    } else {
      tb = b();
      ta = a();
    }
    ratios.push_back(tb / ta);
  }
  auto [lo, hi] = std::minmax_element(ratios.begin(), ratios.end());
  return {Median(ratios), *lo, *hi};
}

std::shared_ptr<NodeGovernor> Join(const std::string& job, int rank, uint64_t budget) {
  NodeGovernorOptions o;
  o.job = job;
  o.ledger = job;  // its own: the machine's ledger may hold other jobs with other budgets
  o.local_rank = rank;
  o.host_budget_bytes = budget;
  auto g = NodeGovernor::Join(o);
  if (!g.ok()) {
    std::fprintf(stderr, "%s\n", g.status().ToString().c_str());
    std::exit(1);
  }
  return std::shared_ptr<NodeGovernor>(std::move(g.value()));
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 15, pairs = 200000, region_pairs = 2000, trims = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (flag == "--rounds")
      rounds = v;
    else if (flag == "--pairs")
      pairs = v;
    else if (flag == "--region-pairs")
      region_pairs = v;
    else if (flag == "--trims")
      trims = v;
    else {
      std::fprintf(stderr,
                   "usage: compare_node_governor [--rounds N] [--pairs N] "
                   "[--region-pairs N] [--trims N]\n");
      return 2;
    }
  }
  const std::string job = StrCat("bench-", getpid());
  auto node = Join(job, 0, 64ull << 30);
  Ledger ledger;
  const uint64_t small = 64 * 1024;
  // Fresh arenas every round, so no one arena's placement in memory (which two plain arenas
  // differ by, a few percent) decides the ratio; each maps its first region before timing.
  auto fresh_pairs = [&](std::shared_ptr<NodeGovernor> with) {
    auto arena = MakeArena(&ledger, std::move(with), 256 * kMiB);
    PairsNs(arena.get(), small, 1000);
    return PairsNs(arena.get(), small, pairs);
  };
  const Ratio aa = Interleaved(
      rounds, [&] { return fresh_pairs(nullptr); }, [&] { return fresh_pairs(nullptr); });
  const Ratio fast = Interleaved(
      rounds, [&] { return fresh_pairs(nullptr); }, [&] { return fresh_pairs(node); });
  const double fast_ns = fresh_pairs(nullptr);
  auto plain_r = MakeArena(&ledger, nullptr, 0);
  auto governed_r = MakeArena(&ledger, node, 0);
  const uint64_t big = 8 * kMiB;  // >= region / 8: a dedicated region, unmapped at free (retain 0)
  const Ratio region = Interleaved(
      rounds, [&] { return PairsNs(plain_r.get(), big, region_pairs); },
      [&] { return PairsNs(governed_r.get(), big, region_pairs); });
  const double region_ns = PairsNs(plain_r.get(), big, region_pairs);

  // Cross-rank trim: a second rank (forked) keeps 32 MiB of retained regions (its retain limit at
  // no live bytes is one region); this rank asks for 112 MiB of a 128 MiB node, which
  // fits only once that rank trims. Each round: the other rank refills its cache, this one
  // reserves.
  const std::string trim_job = StrCat("bench-trim-", getpid());
  auto r0 = Join(trim_job, 0, 128 * kMiB);
  int to_child[2], to_parent[2];
  if (pipe(to_child) != 0 || pipe(to_parent) != 0) return 1;
  const pid_t child = fork();
  if (child == 0) {
    auto r1 = Join(trim_job, 1, 0);
    Ledger l;
    auto arena = MakeArena(&l, r1, 1024 * kMiB);
    char cmd = 0;
    while (read(to_child[0], &cmd, 1) == 1 && cmd == 'f') {
      std::vector<void*> held;  // fill 64 MiB of regions, free them: they stay retained
      for (int i = 0; i < 8; ++i) held.push_back(*arena->Allocate(8 * kMiB, kTag));
      for (void* p : held) (void)arena->Free(p).ok();
      if (write(to_parent[1], "r", 1) != 1) break;
    }
    arena.reset();
    r1.reset();
    _exit(0);
  }
  std::vector<double> trim_ms;
  for (int i = 0; i < trims; ++i) {
    char ack = 0;
    if (write(to_child[1], "f", 1) != 1 || read(to_parent[0], &ack, 1) != 1) return 1;
    const auto t0 = Clock::now();
    auto st = r0->Reserve(NodeTier::kPinned, 112 * kMiB);  // fits only once rank 1 trimmed
    trim_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    if (!st.ok()) {
      std::fprintf(stderr, "trim round %d: %s\n", i, st.ToString().c_str());
      return 1;
    }
    r0->Release(NodeTier::kPinned, 112 * kMiB);
  }
  if (write(to_child[1], "q", 1) != 1) return 1;
  waitpid(child, nullptr, 0);
  const double trim_median = Median(trim_ms);
  const double trim_max = *std::max_element(trim_ms.begin(), trim_ms.end());

  std::printf("compare_node_governor: %d interleaved rounds, medians of governed / plain\n",
              rounds);
  std::printf("  %-12s %10s %24s %12s\n", "path", "ratio", "range", "plain ns/op");
  std::printf("  %-12s %10.3f %11.3f - %-10.3f %12s\n", "A/A", aa.median, aa.low, aa.high, "");
  std::printf("  %-12s %10.3f %11.3f - %-10.3f %12.1f\n", "fast path", fast.median, fast.low,
              fast.high, fast_ns);
  std::printf("  %-12s %10.3f %11.3f - %-10.3f %12.1f\n", "region path", region.median, region.low,
              region.high, region_ns);
  std::printf("  cross-rank trim: median %.2f ms, max %.2f ms over %d requests\n", trim_median,
              trim_max, trims);
  std::printf(
      "{\"aa\": %.4f, \"aa_low\": %.4f, \"aa_high\": %.4f, \"fast\": %.4f, \"fast_low\": %.4f, "
      "\"fast_high\": %.4f, \"region\": %.4f, \"region_low\": %.4f, \"region_high\": %.4f, "
      "\"fast_plain_ns\": %.1f, \"region_plain_ns\": %.1f, \"trim_median_ms\": %.3f, "
      "\"trim_max_ms\": %.3f}\n",
      aa.median, aa.low, aa.high, fast.median, fast.low, fast.high, region.median, region.low,
      region.high, fast_ns, region_ns, trim_median, trim_max);
  return 0;
}
