// compare_host_arena: replays a ZeRO-3-like host allocation trace against Spillway's HostArena,
// glibc malloc, jemalloc (mallocx in its own arena) and a faithful model of PyTorch's
// CachingHostAllocator policy (round up to a power of two, exact-bin reuse, never released).
// overhead = peak bytes held from the OS / peak bytes requested. The last line is one JSON object.
//
// The trace: LLaMA-7B shapes (or --model 34b: Yi-34B) partitioned over --ranks ranks. Persistent
// bf16 parameter and gradient partitions, each pinned on its own as ZeRO-3 does; per step, gather
// buffers of whole parameters with two in flight (prefetch) in forward and backward, and
// swap-buffer churn whose sizes vary by sub-group and by epoch; per epoch, bounded checkpoint
// buffers. Memory is not touched unless --pin mlock, so the run fits any machine; the accounting is
// the same.
#include <jemalloc/jemalloc.h>
#include <malloc.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "spillway/allocator/host_arena.h"
#include "spillway/allocator/pow2_caching_policy.h"
#include "spillway/base/bytes.h"

extern "C" void* __libc_malloc(size_t);  // glibc's own malloc, even when jemalloc is linked in
extern "C" void __libc_free(void*);

namespace {

using spillway::kMiB;
using spillway::allocator::HostArena;
using spillway::allocator::HostArenaOptions;
using spillway::allocator::Kind;
using spillway::allocator::Lifetime;
using spillway::allocator::OwnerTag;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct Op {
  bool alloc;
  uint32_t id;     // slot id: an alloc fills it, a free empties it
  uint64_t bytes;  // for allocs
  Kind kind;
  Lifetime lifetime;
};

struct Model {
  const char* name;
  uint64_t d, ffn, layers, vocab, kv_dim;
};

std::vector<uint64_t> ParamNumels(const Model& m) {
  std::vector<uint64_t> p;
  p.push_back(m.vocab * m.d);  // embedding
  for (uint64_t l = 0; l < m.layers; ++l) {
    p.push_back(m.d * m.d);       // q
    p.push_back(m.d * m.kv_dim);  // k
    p.push_back(m.d * m.kv_dim);  // v
    p.push_back(m.d * m.d);       // o
    p.push_back(m.d * m.ffn);     // gate
    p.push_back(m.d * m.ffn);     // up
    p.push_back(m.ffn * m.d);     // down
    p.push_back(m.d);             // input norm
    p.push_back(m.d);             // post-attention norm
  }
  p.push_back(m.d);            // final norm
  p.push_back(m.vocab * m.d);  // lm head
  return p;
}

std::vector<Op> BuildTrace(const Model& m, uint64_t ranks, int epochs, int steps,
                           uint64_t* persistent_bf16_bytes) {
  std::vector<Op> ops;
  uint32_t next_id = 0;
  const auto params = ParamNumels(m);
  auto alloc = [&](uint64_t bytes, Kind k, Lifetime l) {
    ops.push_back({true, next_id, bytes, k, l});
    return next_id++;
  };
  auto release = [&](uint32_t id) {
    ops.push_back({false, id, 0, Kind::kTransient, Lifetime::kStep});
  };
  *persistent_bf16_bytes = 0;
  for (uint64_t n : params) {  // each partition pinned on its own
    const uint64_t part = (n + ranks - 1) / ranks * 2;
    alloc(part, Kind::kParam, Lifetime::kPersistent);
    alloc(part, Kind::kGrad, Lifetime::kPersistent);
    *persistent_bf16_bytes += part;
  }
  // Sub-groups of the flat fp32 optimizer state (sub_group_size elements; last one shorter).
  uint64_t total = 0;
  for (uint64_t n : params) total += (n + ranks - 1) / ranks;
  const uint64_t sub_group = 100'000'000 / ranks;
  for (int e = 0; e < epochs; ++e) {
    for (int s = 0; s < steps; ++s) {
      // forward then backward: whole-parameter gather buffers, two in flight
      for (int pass = 0; pass < 2; ++pass) {
        std::vector<uint32_t> inflight;
        for (size_t i = 0; i < params.size(); ++i) {
          const uint64_t n = params[pass == 0 ? i : params.size() - 1 - i];
          inflight.push_back(alloc(n * 2, Kind::kTransient, Lifetime::kStep));
          if (inflight.size() > 2) {
            release(inflight.front());
            inflight.erase(inflight.begin());
          }
        }
        for (uint32_t id : inflight) release(id);
      }
      // optimizer: swap buffers of each sub-group (fp32 master + 2 moments), 4 in flight; the
      // sub-group boundaries shift with the epoch, as when bucket sizes or data shapes change.
      std::vector<uint32_t> swap;
      const uint64_t shifted = sub_group + sub_group / 16 * static_cast<uint64_t>(e);
      for (uint64_t off = 0; off < total; off += shifted) {
        const uint64_t n = std::min(shifted, total - off);
        swap.push_back(alloc(n * 4 * 3, Kind::kSwapBuffer, Lifetime::kStep));
        if (swap.size() > 4) {
          release(swap.front());
          swap.erase(swap.begin());
        }
      }
      for (uint32_t id : swap) release(id);
    }
    // end-of-epoch checkpoint streamed through two bounded buffers, re-used per chunk
    for (int c = 0; c < 8; ++c) {
      uint32_t a = alloc(64 * kMiB + 4096 * c, Kind::kCheckpoint, Lifetime::kEpoch);
      uint32_t b = alloc(64 * kMiB + 4096 * c, Kind::kCheckpoint, Lifetime::kEpoch);
      release(a);
      release(b);
    }
  }
  return ops;
}

// The allocators under comparison.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual const char* name() const = 0;
  virtual void* Alloc(const Op& op) = 0;
  virtual void Free(void* p, uint64_t bytes) = 0;
  virtual uint64_t HeldBytes() = 0;  // bytes held from the OS right now
};

class SpillwayAlloc final : public Allocator {
 public:
  SpillwayAlloc(spillway::allocator::PinMode pin, uint64_t region_bytes, uint64_t retain_bytes,
                double peak_slack) {
    HostArenaOptions o;
    o.peak_slack = peak_slack;
    o.pin = pin;
    o.region_bytes = region_bytes;
    o.retain_limit_bytes = retain_bytes;
    o.budget_bytes = 1ull << 46;
    o.ledger = &ledger_;
    arena_ = std::move(HostArena::Create(o).value());
  }
  const char* name() const override { return "spillway"; }
  void* Alloc(const Op& op) override {
    auto r = arena_->Allocate(op.bytes, OwnerTag{op.kind, op.lifetime, op.id, 0, nullptr});
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      std::exit(1);
    }
    return *r;
  }
  void Free(void* p, uint64_t) override {
    if (!arena_->Free(p).ok()) std::abort();
  }
  uint64_t HeldBytes() override { return arena_->Stats().committed_bytes; }
  HostArena& arena() { return *arena_; }

 private:
  spillway::allocator::Ledger ledger_;
  std::unique_ptr<HostArena> arena_;
};

class MallocAlloc final : public Allocator {
 public:
  const char* name() const override { return "glibc malloc"; }
  void* Alloc(const Op& op) override { return __libc_malloc(op.bytes); }
  void Free(void* p, uint64_t) override { __libc_free(p); }
  uint64_t HeldBytes() override {
    struct mallinfo2 mi = mallinfo2();
    return mi.arena + mi.hblkhd;
  }
};

class JemallocAlloc final : public Allocator {
 public:
  JemallocAlloc() {
    size_t sz = sizeof(arena_);
    if (mallctl("arenas.create", &arena_, &sz, nullptr, 0) != 0) std::abort();
    flags_ = MALLOCX_ARENA(arena_) | MALLOCX_TCACHE_NONE;
    mapped_key_ = "stats.arenas." + std::to_string(arena_) + ".mapped";
  }
  const char* name() const override { return "jemalloc"; }
  void* Alloc(const Op& op) override { return mallocx(op.bytes, flags_); }
  void Free(void* p, uint64_t) override { dallocx(p, flags_); }
  uint64_t HeldBytes() override {
    uint64_t epoch = 1;
    size_t sz = sizeof(epoch);
    mallctl("epoch", &epoch, &sz, &epoch, sz);
    size_t mapped = 0;
    sz = sizeof(mapped);
    if (mallctl(mapped_key_.c_str(), &mapped, &sz, nullptr, 0) != 0) return 0;
    return mapped;
  }

 private:
  unsigned arena_ = 0;
  int flags_ = 0;
  std::string mapped_key_;
};

// PyTorch's CachingHostAllocator policy (spillway/allocator/pow2_caching_policy.h).
class Pow2Model final : public Allocator {
 public:
  const char* name() const override { return "pow2 cache (torch)"; }
  void* Alloc(const Op& op) override {
    auto p = policy_.Alloc(op.bytes);
    if (!p.ok()) Die(p.status());
    return *p;
  }
  void Free(void* p, uint64_t) override {
    if (spillway::Status st = policy_.Free(p); !st.ok()) Die(st);
  }
  uint64_t HeldBytes() override { return policy_.held_bytes(); }

 private:
  static void Die(const spillway::Status& st) {
    std::fprintf(stderr, "compare_host_arena: pow2 model: %s\n", st.ToString().c_str());
    std::exit(1);
  }
  spillway::allocator::baseline::Pow2CachingPolicy policy_;
};

struct Replay {
  uint64_t peak_held = 0;
  uint64_t peak_requested = 0;
  double seconds = 0;
};

Replay RunTrace(Allocator& a, const std::vector<Op>& ops, uint32_t slots) {
  std::vector<void*> ptr(slots, nullptr);
  std::vector<uint64_t> size(slots, 0);
  Replay r;
  uint64_t requested = 0;
  double busy = 0;
  for (const Op& op : ops) {
    auto t0 = std::chrono::steady_clock::now();
    if (op.alloc) {
      ptr[op.id] = a.Alloc(op);
      size[op.id] = op.bytes;
      requested += op.bytes;
    } else {
      a.Free(ptr[op.id], size[op.id]);
      requested -= size[op.id];
      ptr[op.id] = nullptr;
    }
    busy += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.peak_requested = std::max(r.peak_requested, requested);
    r.peak_held = std::max(r.peak_held, a.HeldBytes());
  }
  for (uint32_t i = 0; i < slots; ++i)
    if (ptr[i]) a.Free(ptr[i], size[i]);
  r.seconds = busy;
  return r;
}

// Alloc+free pairs of one size after warm-up: the retained-cache hot path.
double HotPathNs(Allocator& a, uint64_t bytes, int pairs) {
  Op op{true, 0, bytes, Kind::kTransient, Lifetime::kStep};
  a.Free(a.Alloc(op), bytes);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < pairs; ++i) a.Free(a.Alloc(op), bytes);
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
         pairs;
}

}  // namespace

int main(int argc, char** argv) {
  Model model{"llama-7b", 4096, 11008, 32, 32000, 4096};
  uint64_t ranks = 8;
  int epochs = 3, steps = 4;
  auto pin = spillway::allocator::PinMode::kPageable;
  uint64_t region_mib = HostArenaOptions{}.region_bytes / kMiB;
  uint64_t retain_mib = HostArenaOptions{}.retain_limit_bytes / kMiB;
  double peak_slack = HostArenaOptions{}.peak_slack;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") {
      std::string m = next();
      if (m == "34b")
        model = {"yi-34b", 7168, 20480, 60, 64000, 1024};
      else if (m != "7b") {
        std::fprintf(stderr, "--model: 7b or 34b\n");
        return 2;
      }
    } else if (a == "--ranks")
      ranks = std::stoull(next());
    else if (a == "--epochs")
      epochs = std::stoi(next());
    else if (a == "--steps")
      steps = std::stoi(next());
    else if (a == "--region-mib")
      region_mib = std::stoull(next());
    else if (a == "--retain-mib")
      retain_mib = std::stoull(next());
    else if (a == "--peak-slack")
      peak_slack = std::stod(next());
    else if (a == "--pin") {
      auto p = spillway::allocator::ParsePinMode(next());
      if (!p.ok()) {
        std::fprintf(stderr, "--pin: %s\n", p.status().message().c_str());
        return 2;
      }
      pin = *p;
    } else {
      std::fprintf(stderr,
                   "usage: compare_host_arena [--model 7b|34b] [--ranks N] [--epochs N] "
                   "[--steps N] [--pin pageable|mlock|cuda|auto] [--region-mib N] [--retain-mib N] "
                   "[--peak-slack F]\nunknown argument: %s\n",
                   a.c_str());
      return 2;
    }
  }
  if (ranks == 0 || epochs <= 0 || steps <= 0) {
    std::fprintf(stderr, "--ranks, --epochs and --steps must be positive\n");
    return 2;
  }
  uint64_t bf16_bytes = 0;
  const auto ops = BuildTrace(model, ranks, epochs, steps, &bf16_bytes);
  uint32_t slots = 0;
  for (const Op& op : ops) slots = std::max(slots, op.id + 1);
  std::printf("trace: %s over %" PRIu64 " ranks, %d epochs x %d steps, %zu ops; pin mode %s\n",
              model.name, ranks, epochs, steps, ops.size(), spillway::allocator::PinModeName(pin));

  // Cross-check against FIELD.md §1: per-partition pinning of the bf16 parameters alone.
  {
    uint64_t pow2 = 0;
    for (uint64_t n : ParamNumels(model)) {
      uint64_t part = (n + ranks - 1) / ranks * 2, r = 1;
      while (r < part) r <<= 1;
      pow2 += r;
    }
    std::printf("bf16 partitions alone: %.2f GiB requested, pow2 rounding holds %.2f GiB (%.3fx)\n",
                bf16_bytes / kGiB, pow2 / kGiB, double(pow2) / bf16_bytes);
  }

  struct Row {
    std::string name;
    Replay r;
    double hot_ns;
  };
  std::vector<Row> rows;
  std::vector<std::unique_ptr<Allocator>> allocs;
  allocs.push_back(
      std::make_unique<SpillwayAlloc>(pin, region_mib * kMiB, retain_mib * kMiB, peak_slack));
  allocs.push_back(std::make_unique<Pow2Model>());
  allocs.push_back(std::make_unique<JemallocAlloc>());
  allocs.push_back(std::make_unique<MallocAlloc>());
  for (auto& a : allocs) {
    Replay r = RunTrace(*a, ops, slots);
    double hot = HotPathNs(*a, 256 * 1024, 1'000'000);
    rows.push_back({a->name(), r, hot});
  }
  auto* sw = static_cast<SpillwayAlloc*>(allocs[0].get());
  if (auto v = sw->arena().Validate(); !v.ok()) {
    std::fprintf(stderr, "spillway arena invalid after the trace: %s\n", v.ToString().c_str());
    return 1;
  }
  const auto sws = sw->arena().Stats();
  std::printf("spillway regions: %" PRIu64 " mapped, %" PRIu64
              " unmapped over the trace (each one "
              "a pin and an unpin when pinned); retained now %.3f GiB\n",
              sws.region_map_count, sws.region_unmap_count, sws.retained_bytes / kGiB);

  std::printf("\n%-20s %14s %14s %9s %12s %14s\n", "allocator", "peak held GiB", "peak asked GiB",
              "overhead", "trace ops/s", "alloc+free ns");
  for (const Row& row : rows) {
    std::printf("%-20s %14.3f %14.3f %9.3f %12.0f %14.1f\n", row.name.c_str(),
                row.r.peak_held / kGiB, row.r.peak_requested / kGiB,
                double(row.r.peak_held) / row.r.peak_requested, ops.size() / row.r.seconds,
                row.hot_ns);
  }
  auto overhead = [&](size_t i) { return double(rows[i].r.peak_held) / rows[i].r.peak_requested; };
  std::printf(
      "{\"bench\":\"host_arena\",\"model\":\"%s\",\"ranks\":%" PRIu64
      ",\"trace_ops\":%zu,"
      "\"peak_requested_bytes\":%" PRIu64
      ",\"spillway_overhead\":%.4f,\"pow2_overhead\":%.4f,"
      "\"jemalloc_overhead\":%.4f,\"malloc_overhead\":%.4f,\"spillway_allocs_per_s\":%.0f,"
      "\"pow2_allocs_per_s\":%.0f,\"jemalloc_allocs_per_s\":%.0f,\"malloc_allocs_per_s\":%.0f,"
      "\"spillway_alloc_free_ns\":%.1f,\"pow2_alloc_free_ns\":%.1f,\"jemalloc_alloc_free_ns\":%.1f,"
      "\"malloc_alloc_free_ns\":%.1f,\"spillway_region_maps\":%" PRIu64 "}\n",
      model.name, ranks, ops.size(), rows[0].r.peak_requested, overhead(0), overhead(1),
      overhead(2), overhead(3), 1e9 / rows[0].hot_ns, 1e9 / rows[1].hot_ns, 1e9 / rows[2].hot_ns,
      1e9 / rows[3].hot_ns, rows[0].hot_ns, rows[1].hot_ns, rows[2].hot_ns, rows[3].hot_ns,
      sws.region_map_count);
  return 0;
}
