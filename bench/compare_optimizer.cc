// compare_optimizer: one host optimizer step over N elements in sub-groups, side by side in one
// run, repetitions interleaved, medians reported with their spread:
//   fused    HostOptimizer::Step: norm pass + one fused pass (unscale/clip, AdamW, 16-bit copy)
//   unfused  the 4-pass sequence DeepSpeed runs (norm; unscale/clip rewriting the gradients;
//            Adam; fp32 -> 16-bit copy), built from the same SIMD kernels
//   torch    libtorch's torch::optim::AdamW on fp32 tensors of the same size (no norm, no copy)
//   roofline memory bandwidth measured here (STREAM triad and an in-place read-modify-write,
//            the faster of the two) divided by the bytes the fused step must move per element
// Last line: {"bench":"optimizer","fused_gelem_s":F,"unfused_gelem_s":U,"torch_gelem_s":T,
//             "fused_vs_unfused":F/U,"roofline_fraction":R}
#include <immintrin.h>
#include <sys/mman.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "spillway/engine/cpu_features.h"
#include "spillway/engine/host_optimizer.h"

namespace {

using namespace spillway;
using namespace spillway::engine;
using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "compare_optimizer: %s\n", what.c_str());
  std::exit(1);
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Summary {
  double median, lo, hi;
};
Summary Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

// Anonymous memory, first touched by the threads that will use it (NUMA- and THP-friendly).
template <typename T>
T* Map(uint64_t n) {
  void* p =
      mmap(nullptr, n * sizeof(T), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) Die("mmap failed: lower --elements");
  madvise(p, n * sizeof(T), MADV_HUGEPAGE);
  return static_cast<T*>(p);
}

template <typename Fn>
void Parallel(uint32_t threads, uint64_t n, Fn fn) {
  std::vector<std::thread> ts;
  for (uint32_t t = 0; t < threads; ++t) {
    const uint64_t b = n * t / threads, e = n * (t + 1) / threads;
    ts.emplace_back([=] { fn(b, e); });
  }
  for (auto& t : ts) t.join();
}

// The roofline kernel: the fused step's exact memory traffic with no arithmetic to speak of. A
// read of the gradients (the norm pass), then per element: read grad, master, exp_avg,
// exp_avg_sq; write master, exp_avg, exp_avg_sq (each plus a runtime zero, so no store can be
// elided) and the bf16 parameter (truncated master). Whatever the fused step loses to this is
// compute or scheduling; what both lose to the hardware is the memory system's.
volatile float g_zero = 0.0f;
volatile float g_sink = 0.0f;  // the kernels' sums go here, so no call is dropped as pure
constexpr int kNormPart = 1, kUpdatePart = 2, kBothParts = 3;  // which of its loops to run
// Or'ed into the part: prefetch every stream ahead in software, at the distances the optimizer's
// kernels use (kernels_body.inc). The roofline is the faster of the kernel with and without it, so
// the optimizer's own prefetching cannot make it look better than the memory system allows.
constexpr int kPrefetched = 4;
constexpr uint64_t kNormAhead = 1024, kUpdateAhead = 512;  // elements

inline void PrefetchUpdate(const unsigned char* grad, uint64_t gbytes, const float* w,
                           const float* m, const float* v, const uint16_t* p, uint64_t i) {
  const uint64_t j = i + kUpdateAhead;
  __builtin_prefetch(grad + j * gbytes, 0, 3);
  __builtin_prefetch(w + j, 1, 3);
  __builtin_prefetch(m + j, 1, 3);
  __builtin_prefetch(v + j, 1, 3);
  __builtin_prefetch(p + j, 1, 3);
}

__attribute__((target("avx512f,avx512bw"))) float MemoryOnlyAvx512(int part,
                                                                   const unsigned char* grad,
                                                                   uint64_t gbytes, float* w,
                                                                   float* m, float* v, uint16_t* p,
                                                                   uint64_t begin, uint64_t end) {
  const __m512 z = _mm512_set1_ps(g_zero);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  const uint64_t step = 64 / gbytes;  // elements per 64-byte line of gradients
  const bool ahead = part & kPrefetched;
  for (uint64_t i = begin; (part & kNormPart) && i + step <= end;
       i += step) {  // norm pass: read the gradients
    if (ahead && i + kNormAhead + step <= end)
      __builtin_prefetch(grad + (i + kNormAhead) * gbytes, 0, 3);
    acc0 = _mm512_add_ps(acc0, _mm512_castsi512_ps(_mm512_loadu_si512(grad + i * gbytes)));
  }
  uint64_t i = begin;
  for (; (part & kUpdatePart) && i + 16 <= end; i += 16) {
    if (ahead && i + kUpdateAhead + 16 <= end) PrefetchUpdate(grad, gbytes, w, m, v, p, i);
    __m512 g;
    if (gbytes == 4) {
      g = _mm512_loadu_ps(reinterpret_cast<const float*>(grad) + i);
    } else {
      g = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grad + 2 * i))),
          16));
    }
    acc1 = _mm512_add_ps(acc1, g);
    const __m512 nw = _mm512_add_ps(_mm512_loadu_ps(w + i), z);
    _mm512_storeu_ps(w + i, nw);
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), z));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), z));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(nw), 16)));
  }
  float out[16];
  _mm512_storeu_ps(out, _mm512_add_ps(acc0, acc1));
  return out[0];
}

__attribute__((target("avx2"))) float MemoryOnlyAvx2(int part, const unsigned char* grad,
                                                     uint64_t gbytes, float* w, float* m, float* v,
                                                     uint16_t* p, uint64_t begin, uint64_t end) {
  const __m256 z = _mm256_set1_ps(g_zero);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const uint64_t step = 32 / gbytes;
  const bool ahead = part & kPrefetched;
  for (uint64_t i = begin; (part & kNormPart) && i + step <= end; i += step) {
    if (ahead && i % (64 / gbytes) == 0 && i + kNormAhead + step <= end) {
      __builtin_prefetch(grad + (i + kNormAhead) * gbytes, 0, 3);
    }
    acc0 = _mm256_add_ps(acc0, _mm256_castsi256_ps(_mm256_loadu_si256(
                                   reinterpret_cast<const __m256i*>(grad + i * gbytes))));
  }
  for (uint64_t i = begin; (part & kUpdatePart) && i + 8 <= end; i += 8) {
    if (ahead && i % 16 == 0 && i + kUpdateAhead + 16 <= end)
      PrefetchUpdate(grad, gbytes, w, m, v, p, i);
    __m256 g;
    if (gbytes == 4) {
      g = _mm256_loadu_ps(reinterpret_cast<const float*>(grad) + i);
    } else {
      g = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grad + 2 * i))),
          16));
    }
    acc1 = _mm256_add_ps(acc1, g);
    const __m256 nw = _mm256_add_ps(_mm256_loadu_ps(w + i), z);
    _mm256_storeu_ps(w + i, nw);
    _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), z));
    _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), z));
    const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(nw), 16);
    const __m256i packed = _mm256_packus_epi32(top, top);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
  }
  float out[8];
  _mm256_storeu_ps(out, _mm256_add_ps(acc0, acc1));
  return out[0];
}

// STREAM triad, for reference (its write stream costs a read-for-ownership the fused step's
// in-place stores do not pay).
__attribute__((target_clones("avx512f", "avx2", "default"))) void Triad(float* __restrict a,
                                                                        const float* __restrict b,
                                                                        const float* __restrict c,
                                                                        float s, uint64_t begin,
                                                                        uint64_t end) {
  for (uint64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

// --in-cache: is the step compute- or memory-bound? One thread steps one 4096-element sub-group
// (64-72 KiB of state, inside L2) over and over, best of 250 trials of 200 steps, with and
// without the 16-bit copy, next to the memory-only kernel on the same arrays. Memory costs next
// to nothing there, so what the fused step takes is its arithmetic.
void InCache(Isa isa, DType gd) {
  constexpr uint64_t kN = 4096;
  constexpr int kTrials = 250, kInner = 200;
  HostOptimizerOptions o;
  o.isa = isa;
  o.threads = 1;
  auto opt = HostOptimizer::Create(o);
  if (!opt.ok()) Die(opt.status().ToString());
  const uint64_t gbytes = DTypeBytes(gd);
  std::vector<float> w(kN, 0.5f), m(kN, 0.0f), v(kN, 0.0f);
  std::vector<unsigned char> g(kN * gbytes);
  for (uint64_t i = 0; i < kN; ++i) {
    const float gv = 1e-3f * static_cast<float>(static_cast<int>(i % 977) - 488);
    uint32_t bits;
    std::memcpy(&bits, &gv, 4);
    if (gd == DType::kFp32) {
      std::memcpy(g.data() + 4 * i, &bits, 4);
    } else {
      const uint16_t h = static_cast<uint16_t>(bits >> 16);
      std::memcpy(g.data() + 2 * i, &h, 2);
    }
  }
  std::vector<uint16_t> p(kN);
  auto best_ns_per_block = [&](auto&& body) {
    double best = 1e30;
    for (int t = 0; t < kTrials; ++t) {
      const auto t0 = Clock::now();
      for (int r = 0; r < kInner; ++r) body();
      best = std::min(best, Seconds(t0, Clock::now()));
    }
    return best / kInner / (kN / 16) * 1e9;
  };
  auto step = [&](bool copy) {
    SubGroup sg;
    sg.name = "in-cache";
    sg.numel = kN;
    sg.master = w.data();
    sg.exp_avg = m.data();
    sg.exp_avg_sq = v.data();
    sg.grad = g.data();
    sg.grad_dtype = gd;
    sg.param = copy ? p.data() : nullptr;
    return best_ns_per_block([&] {
      auto r = (*opt)->Step({&sg, 1}, StepOptions{});
      if (!r.ok()) Die(r.status().ToString());
    });
  };
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  (void)step(true);  // warm-up: the first trials of a run come out slower (clock ramp, page faults)
  const double with_copy = step(true), without_copy = step(false);
  const double memory = best_ns_per_block([&] {
    if (avx512) {
      g_sink = MemoryOnlyAvx512(kBothParts, g.data(), gbytes, w.data(), m.data(), v.data(),
                                p.data(), 0, kN);
    } else {
      g_sink = MemoryOnlyAvx2(kBothParts, g.data(), gbytes, w.data(), m.data(), v.data(), p.data(),
                              0, kN);
    }
  });
  std::printf("compare_optimizer --in-cache: %" PRIu64
              " elements, grad %s, 1 thread, isa %s, "
              "best of %d x %d steps, ns per 16 elements\n",
              kN, DTypeName(gd), IsaName((*opt)->isa()), kTrials, kInner);
  std::printf(
      "  fused step, bf16 copy     %6.2f\n  fused step, no copy       %6.2f\n"
      "  memory-only kernel        %6.2f\n",
      with_copy, without_copy, memory);
  std::printf(
      "{\"bench\":\"optimizer_in_cache\",\"fused_ns_per_16\":%.2f,"
      "\"fused_no_copy_ns_per_16\":%.2f,\"memory_only_ns_per_16\":%.2f}\n",
      with_copy, without_copy, memory);
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t elements = 256ull << 20;
  uint64_t group = 32ull << 20;
  int reps = 5;
  uint32_t threads = std::max(1u, std::thread::hardware_concurrency());
  std::string grad_name = "bf16", isa_name = "auto";
  bool run_torch = true, in_cache = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--elements")
      elements = std::stoull(next());
    else if (a == "--group")
      group = std::stoull(next());
    else if (a == "--reps")
      reps = std::stoi(next());
    else if (a == "--threads")
      threads = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--grad")
      grad_name = next();
    else if (a == "--isa")
      isa_name = next();
    else if (a == "--no-torch")
      run_torch = false;
    else if (a == "--in-cache")
      in_cache = true;
    else {
      std::fprintf(stderr,
                   "usage: compare_optimizer [--elements N] [--group N] [--reps N] [--threads N]\n"
                   "                         [--grad bf16|fp32] [--isa "
                   "auto|scalar|avx2|avx512|avx512_bf16]\n"
                   "                         [--no-torch] [--in-cache]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (grad_name != "bf16" && grad_name != "fp32") Die("--grad must be bf16 or fp32");
  if (group == 0 || elements == 0 || reps < 1)
    Die("--elements, --group and --reps must be positive");
  auto isa = ParseIsa(isa_name);
  if (!isa.ok()) Die(isa.status().ToString());
  const DType gd = grad_name == "bf16" ? DType::kBf16 : DType::kFp32;
  const uint64_t gbytes = DTypeBytes(gd);
  if (in_cache) {
    InCache(*isa, gd);
    return 0;
  }

  HostOptimizerOptions o;
  o.isa = *isa;
  o.threads = threads;
  auto fused = HostOptimizer::Create(o);
  auto unfused = HostOptimizer::Create(o);
  if (!fused.ok()) Die(fused.status().ToString());
  if (!unfused.ok()) Die(unfused.status().ToString());

  // Two copies of the state (fused and unfused each step their own).
  struct State {
    float *w, *m, *v;
    unsigned char* g;
    uint16_t* p;
  };
  auto make_state = [&]() {
    State s{Map<float>(elements), Map<float>(elements), Map<float>(elements),
            Map<unsigned char>(elements * gbytes), Map<uint16_t>(elements)};
    Parallel(threads, elements, [&](uint64_t b, uint64_t e) {
      for (uint64_t i = b; i < e; ++i) {
        s.w[i] = 0.01f * static_cast<float>(i % 1000) - 5.0f;
        s.m[i] = 0.0f;
        s.v[i] = 0.0f;
        const float gv = 1e-3f * static_cast<float>(static_cast<int>(i % 977) - 488);
        if (gd == DType::kFp32) {
          std::memcpy(s.g + 4 * i, &gv, 4);
        } else {
          uint32_t bits;
          std::memcpy(&bits, &gv, 4);
          const uint16_t h = static_cast<uint16_t>(bits >> 16);
          std::memcpy(s.g + 2 * i, &h, 2);
        }
        s.p[i] = 0;
      }
    });
    return s;
  };
  State sf = make_state(), su = make_state();
  auto groups_of = [&](State& s) {
    std::vector<SubGroup> gs;
    for (uint64_t b = 0; b < elements; b += group) {
      SubGroup g;
      g.name = "bench";
      g.numel = std::min(group, elements - b);
      g.master = s.w + b;
      g.exp_avg = s.m + b;
      g.exp_avg_sq = s.v + b;
      g.grad = s.g + b * gbytes;
      g.grad_dtype = gd;
      g.param = s.p + b;
      g.param_dtype = DType::kBf16;
      gs.push_back(g);
    }
    return gs;
  };
  std::vector<SubGroup> gf = groups_of(sf), gu = groups_of(su);

  // libtorch: fp32 parameters and gradients of the same size, one tensor per sub-group.
  std::vector<torch::Tensor> tparams;
  std::unique_ptr<torch::optim::AdamW> topt;
  if (run_torch) {
    torch::set_num_threads(static_cast<int>(threads));
    for (uint64_t b = 0; b < elements; b += group) {
      const int64_t n = static_cast<int64_t>(std::min(group, elements - b));
      torch::Tensor p = torch::full({n}, 0.5f).set_requires_grad(true);
      p.mutable_grad() = torch::full({n}, 1e-3f);
      tparams.push_back(p);
    }
    topt = std::make_unique<torch::optim::AdamW>(
        tparams, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  }

  // Triad arrays: 3 x 1 GiB or the state size, whichever is smaller (both far beyond cache).
  const uint64_t bw_n = std::min<uint64_t>(elements, 256ull << 20);
  float* a = Map<float>(bw_n);
  float* b = Map<float>(bw_n);
  float* c = Map<float>(bw_n);
  Parallel(threads, bw_n, [&](uint64_t lo, uint64_t hi) {
    for (uint64_t i = lo; i < hi; ++i) a[i] = b[i] = c[i] = 1.0f;
  });
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (!avx512 && !__builtin_cpu_supports("avx2")) Die("the roofline kernel needs AVX2 or AVX-512");
  // The memory-only pass runs on the fused state (it changes no value) in 16-element-aligned
  // thread slices, as the optimizer's chunks are.
  auto memory_only = [&](int part) {
    Parallel(threads, elements / 16, [&](uint64_t lo, uint64_t hi) {
      lo *= 16;
      hi = hi == elements / 16 ? elements : hi * 16;
      if (avx512) {
        g_sink = MemoryOnlyAvx512(part, sf.g, gbytes, sf.w, sf.m, sf.v, sf.p, lo, hi);
      } else {
        g_sink = MemoryOnlyAvx2(part, sf.g, gbytes, sf.w, sf.m, sf.v, sf.p, lo, hi);
      }
    });
  };

  std::vector<double> t_fused, t_unfused, t_torch, t_memory, t_memory_pf, bw_triad;
  StepOptions so;  // loss scale 1, no clipping: the unscale pass multiplies by 1 but still runs
  for (int r = 0; r < reps + 1; ++r) {  // repetition 0 warms up and is dropped
    auto t0 = Clock::now();
    auto rf = (*fused)->Step(gf, so);
    auto t1 = Clock::now();
    if (!rf.ok()) Die(rf.status().ToString());
    auto ru = (*unfused)->StepUnfused(gu, so);
    auto t2 = Clock::now();
    if (!ru.ok()) Die(ru.status().ToString());
    double tt = 0;
    if (run_torch) {
      auto t3 = Clock::now();
      topt->step();
      tt = Seconds(t3, Clock::now());
    }
    auto t4 = Clock::now();
    memory_only(kBothParts);
    auto t5p = Clock::now();
    memory_only(kBothParts | kPrefetched);
    auto t5 = Clock::now();
    Parallel(threads, bw_n, [&](uint64_t lo, uint64_t hi) { Triad(a, b, c, 1.0001f, lo, hi); });
    auto t6 = Clock::now();
    if (r == 0) continue;
    t_fused.push_back(Seconds(t0, t1));
    t_unfused.push_back(Seconds(t1, t2));
    t_torch.push_back(tt);
    t_memory.push_back(Seconds(t4, t5p));
    t_memory_pf.push_back(Seconds(t5p, t5));
    bw_triad.push_back(12.0 * static_cast<double>(bw_n) / Seconds(t5, t6) / 1e9);
  }
  // The fused and unfused states must agree (same kernels, loss scale 1): a broken variant would
  // otherwise look fast.
  if (std::memcmp(sf.w, su.w, elements * 4) != 0) Die("fused and unfused results differ");

  // Where the fused step loses to the roofline: its two passes timed apart (the norm over every
  // group, then Plan and the update of each), each next to the memory-only kernel's same part.
  std::vector<double> t_norm, t_update, t_mem_norm, t_mem_update;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    double sum = 0.0;
    for (const SubGroup& g : gf) {
      auto s = (*fused)->SumOfSquares(g);
      if (!s.ok()) Die(s.status().ToString());
      sum += *s;
    }
    auto t1 = Clock::now();
    auto plan = (*fused)->Plan(sum, so);
    if (!plan.ok()) Die(plan.status().ToString());
    for (const SubGroup& g : gf) {
      Status st = (*fused)->Update(g, *plan);
      if (!st.ok()) Die(st.ToString());
    }
    auto t2 = Clock::now();
    memory_only(kNormPart);
    auto t3 = Clock::now();
    memory_only(kNormPart | kPrefetched);
    auto t4 = Clock::now();
    memory_only(kUpdatePart);
    auto t5 = Clock::now();
    memory_only(kUpdatePart | kPrefetched);
    auto t6 = Clock::now();
    t_norm.push_back(Seconds(t0, t1));
    t_update.push_back(Seconds(t1, t2));
    t_mem_norm.push_back(std::min(Seconds(t2, t3), Seconds(t3, t4)));
    t_mem_update.push_back(std::min(Seconds(t4, t5), Seconds(t5, t6)));
  }
  const Summary pn = Summarize(t_norm), pu = Summarize(t_update);
  const Summary mn = Summarize(t_mem_norm), mu = Summarize(t_mem_update);

  const double n = static_cast<double>(elements);
  const Summary f = Summarize(t_fused), u = Summarize(t_unfused), t = Summarize(t_torch);
  const Summary plain = Summarize(t_memory), pf = Summarize(t_memory_pf), tri = Summarize(bw_triad);
  const Summary mem = pf.median < plain.median ? pf : plain;  // the faster of the two
  const double fused_gelem = n / f.median / 1e9;
  const double unfused_gelem = n / u.median / 1e9;
  const double torch_gelem = run_torch ? n / t.median / 1e9 : 0.0;
  // Bytes the fused step moves per element: the norm reads the gradient; the pass reads
  // gradient, master, exp_avg, exp_avg_sq and writes master, exp_avg, exp_avg_sq, param.
  const double fused_bytes = static_cast<double>(gbytes) + (gbytes + 12) + (12 + 2);
  const double unfused_bytes = static_cast<double>(gbytes) + 2.0 * gbytes + (gbytes + 24) + (4 + 2);
  const double roofline_gelem = n / mem.median / 1e9;
  const double bw = roofline_gelem * fused_bytes;

  std::printf(
      "compare_optimizer: %llu elements in sub-groups of %llu, grad %s, param bfloat16, "
      "%u threads, isa %s, %d reps (median [min, max])\n",
      static_cast<unsigned long long>(elements), static_cast<unsigned long long>(group),
      DTypeName(gd), threads, IsaName((*fused)->isa()), reps);
  std::printf("  %-9s %8.3f s [%.3f, %.3f]  %6.3f Gelem/s  %5.1f GB/s (%g B/elem)\n", "fused",
              f.median, f.lo, f.hi, fused_gelem, fused_gelem * fused_bytes, fused_bytes);
  std::printf("  %-9s %8.3f s [%.3f, %.3f]  %6.3f Gelem/s  %5.1f GB/s (%g B/elem)\n", "unfused",
              u.median, u.lo, u.hi, unfused_gelem, unfused_gelem * unfused_bytes, unfused_bytes);
  if (run_torch) {
    std::printf("  %-9s %8.3f s [%.3f, %.3f]  %6.3f Gelem/s  (fp32 AdamW, %d intra-op threads)\n",
                "torch", t.median, t.lo, t.hi, torch_gelem, torch::get_num_threads());
  }
  std::printf(
      "  %-9s %8.3f s [%.3f, %.3f]  %6.3f Gelem/s  %5.1f GB/s (the fused step's traffic, no math;"
      " %s: %.3f s without software prefetch, %.3f s with)\n",
      "roofline", mem.median, mem.lo, mem.hi, roofline_gelem, bw,
      pf.median < plain.median ? "with" : "without", plain.median, pf.median);
  std::printf(
      "  STREAM triad %.1f GB/s [%.1f, %.1f] (reference; its stores pay a read for ownership)\n",
      tri.median, tri.lo, tri.hi);
  std::printf(
      "  parts: norm pass %.3f s vs its traffic %.3f s (x%.3f); update pass %.3f s vs its "
      "traffic %.3f s (x%.3f)\n",
      pn.median, mn.median, mn.median / pn.median, pu.median, mu.median, mu.median / pu.median);
  std::printf(
      "{\"bench\":\"optimizer_parts\",\"norm_s\":%.4f,\"norm_traffic_s\":%.4f,"
      "\"update_s\":%.4f,\"update_traffic_s\":%.4f}\n",
      pn.median, mn.median, pu.median, mu.median);
  std::printf("  fused/unfused %.3f  fused/torch %.2f  fused/roofline %.3f\n",
              fused_gelem / unfused_gelem, run_torch ? fused_gelem / torch_gelem : 0.0,
              fused_gelem / roofline_gelem);
  std::printf(
      "{\"bench\":\"optimizer\",\"fused_gelem_s\":%.4f,\"unfused_gelem_s\":%.4f,"
      "\"torch_gelem_s\":%.4f,\"fused_vs_unfused\":%.3f,\"roofline_fraction\":%.3f}\n",
      fused_gelem, unfused_gelem, torch_gelem, fused_gelem / unfused_gelem,
      fused_gelem / roofline_gelem);
  return 0;
}
