// compare_cuda: the engine's CUDA kernels and the pinned host arena on a real GPU, each against the
// device's own ceiling or the strongest baseline, measured in the same run:
//   roofline   cudaMemcpy device-to-device of the working set (bytes read + written / time)
//   norm       SumOfSquares over many tensors (fp32, then bf16): bytes read / time, fraction of
//   roofline scale-cast the fused unscale+clip+cast, fp32 gradient -> bf16 (one pass: 4 B read, 2 B
//   written
//              per element) vs the unfused sequence DeepSpeed runs (scale the fp32 buffer in place,
//              then cast it: three passes over the fp32 data), both built from the same kernel
//   h2d / d2h  copies from a HostArena extent (mmap + cudaHostRegister), from cudaMallocHost memory
//              (what torch's pin_memory uses) and from pageable malloc memory
// Every result is checked before it is timed (norm against a host sum in double, the cast against
// the host's round-to-nearest-even). Device work is timed with CUDA events (the norm, which returns
// its result to the host, with a host clock); the median of --reps runs after a warm-up.
// Last line: one JSON object. Needs a CUDA device; without one it says so and exits 2.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels_scalar_ops.h"  // the host optimizer's conversions: the reference
#include "spillway/allocator/host_arena.h"
#include "spillway/base/bytes.h"
#include "spillway/engine/cuda_kernels.h"

namespace {

using namespace spillway;
using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "compare_cuda: %s\n", what.c_str());
  std::exit(1);
}
void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) Die(std::string(what) + ": " + cudaGetErrorString(err));
}
void Must(const Status& st) {
  if (!st.ok()) Die(st.ToString());
}
template <typename T>
T Must(Result<T> r) {
  if (!r.ok()) Die(r.status().ToString());
  return std::move(r.value());
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds per call of `body` (device work on `stream`), timed with events: median of reps.
double TimeDevice(cudaStream_t stream, int reps, const std::function<void()>& body) {
  cudaEvent_t a, b;
  Check(cudaEventCreate(&a), "cudaEventCreate");
  Check(cudaEventCreate(&b), "cudaEventCreate");
  body();  // warm-up
  Check(cudaStreamSynchronize(stream), "warm-up");
  std::vector<double> s;
  for (int r = 0; r < reps; ++r) {
    Check(cudaEventRecord(a, stream), "cudaEventRecord");
    body();
    Check(cudaEventRecord(b, stream), "cudaEventRecord");
    Check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    s.push_back(ms / 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return Median(s);
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t mib = 1024;  // fp32 working set
  int tensors = 64;
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--mib" && i + 1 < argc)
      mib = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--tensors" && i + 1 < argc)
      tensors = std::atoi(argv[++i]);
    else if (a == "--reps" && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr,
                   "usage: compare_cuda [--mib N (fp32 working set, default 1024)] "
                   "[--tensors N (default 64)] [--reps N (default 20)]\n");
      return 2;
    }
  }
  if (mib == 0 || tensors <= 0 || reps <= 0) Die("--mib, --tensors and --reps must be positive");
  if (Status st = engine::cuda::Available(); !st.ok()) {
    std::fprintf(stderr, "compare_cuda: needs a CUDA device: %s\n", st.ToString().c_str());
    return 2;
  }
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const uint64_t n = mib * kMiB / 4;  // fp32 elements
  const uint64_t per = n / tensors;
  const uint64_t used = per * tensors;
  std::printf("device: %s, %d SMs, %.0f MiB; working set %llu fp32 elements in %d tensors\n",
              prop.name, prop.multiProcessorCount, prop.totalGlobalMem / double(kMiB),
              static_cast<unsigned long long>(used), tensors);

  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  // Host data: fixed-seed values in [-2, 2) (never zeros), and the reference sum in double.
  std::vector<float> host(used);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& v : host) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v = static_cast<float>((x >> 40) * 0x1p-24 * 4.0 - 2.0);
  }
  double ref32 = 0;
  for (float v : host) ref32 += static_cast<double>(v) * v;
  std::vector<uint16_t> host_bf(used);
  double ref16 = 0;
  for (uint64_t i = 0; i < used; ++i) {
    host_bf[i] = engine::kernels::Bf16FromFloat(host[i]);
    const float f = engine::kernels::FloatFromBf16(host_bf[i]);
    ref16 += static_cast<double>(f) * f;
  }

  float *d32 = nullptr, *d32b = nullptr;
  uint16_t *d16 = nullptr, *d16b = nullptr;
  Check(cudaMalloc(&d32, used * 4), "cudaMalloc fp32");
  Check(cudaMalloc(&d32b, used * 4), "cudaMalloc fp32 copy");
  Check(cudaMalloc(&d16, used * 2), "cudaMalloc bf16");
  Check(cudaMalloc(&d16b, used * 2), "cudaMalloc bf16 out");
  Check(cudaMemcpy(d32, host.data(), used * 4, cudaMemcpyHostToDevice), "upload fp32");
  Check(cudaMemcpy(d16, host_bf.data(), used * 2, cudaMemcpyHostToDevice), "upload bf16");

  // 1. The roofline: a device-to-device copy of the fp32 working set.
  const double t_copy = TimeDevice(stream, reps, [&] {
    Check(cudaMemcpyAsync(d32b, d32, used * 4, cudaMemcpyDeviceToDevice, stream), "D2D copy");
  });
  const double roof = 2.0 * used * 4 / t_copy;  // bytes/s, read + written
  std::printf("%-34s %9.3f ms %8.1f GB/s\n", "roofline: D2D copy (read+write)", t_copy * 1e3,
              roof / 1e9);

  // 2. The norm, checked, then timed (it synchronizes: host clock).
  auto norm = [&](const void* base, DType dt, uint64_t esize, double ref, const char* name) {
    std::vector<engine::cuda::DeviceTensor> ts(tensors);
    for (int t = 0; t < tensors; ++t) {
      ts[t] = {static_cast<const char*>(base) + t * per * esize, per, dt};
    }
    const auto r = Must(engine::cuda::SumOfSquares(ts.data(), ts.size(), stream));
    const double rel = std::fabs(r.sum_of_squares - ref) / ref;
    if (!r.finite || rel > 1e-9) {
      Die(std::string(name) + ": device sum of squares " + std::to_string(r.sum_of_squares) +
          " vs host " + std::to_string(ref));
    }
    std::vector<double> s;
    for (int k = 0; k < reps; ++k) {
      const auto t0 = Clock::now();
      Must(engine::cuda::SumOfSquares(ts.data(), ts.size(), stream).status());
      s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    const double t = Median(s);
    const double bw = used * esize / t;
    std::printf("%-34s %9.3f ms %8.1f GB/s  %.2f of roofline  (rel err %.1e)\n", name, t * 1e3,
                bw / 1e9, bw / roof, rel);
    return bw;
  };
  const double norm32 = norm(d32, DType::kFp32, 4, ref32, "norm fp32 (multi-tensor)");
  const double norm16 = norm(d16, DType::kBf16, 2, ref16, "norm bf16 (multi-tensor)");

  // 3. Unscale+clip+cast, fused (one pass) vs unfused (scale in place, then cast).
  const float scale = 0.37f;
  Must(engine::cuda::ScaleCast(d32, DType::kFp32, d16b, DType::kBf16, used, scale, stream));
  {
    std::vector<uint16_t> got(used);
    Check(cudaMemcpy(got.data(), d16b, used * 2, cudaMemcpyDeviceToHost), "download bf16");
    for (uint64_t i = 0; i < used; i += 4099) {
      if (got[i] != engine::kernels::Bf16FromFloat(host[i] * scale))
        Die("ScaleCast: element " + std::to_string(i) + " differs from the host's rounding");
    }
  }
  const double t_fused = TimeDevice(stream, reps, [&] {
    Must(engine::cuda::ScaleCast(d32, DType::kFp32, d16b, DType::kBf16, used, scale, stream));
  });
  // The unfused sequence works on a copy so that repeated runs do not shrink the data to zero.
  Check(cudaMemcpy(d32b, d32, used * 4, cudaMemcpyDeviceToDevice), "copy");
  const double t_unfused = TimeDevice(stream, reps, [&] {
    Must(engine::cuda::ScaleCast(d32b, DType::kFp32, d32b, DType::kFp32, used, 1.0f,
                                 stream));  // the unscale/clip pass, in place
    Must(engine::cuda::ScaleCast(d32b, DType::kFp32, d16b, DType::kBf16, used, 1.0f,
                                 stream));  // the cast pass
  });
  const double fused_bw = used * 6.0 / t_fused;
  std::printf("%-34s %9.3f ms %8.1f GB/s  %.2f of roofline\n", "scale-cast fused fp32->bf16",
              t_fused * 1e3, fused_bw / 1e9, fused_bw / roof);
  std::printf("%-34s %9.3f ms  (fused x%.2f faster)\n", "scale-cast unfused (scale, cast)",
              t_unfused * 1e3, t_unfused / t_fused);

  // 4. Host <-> device from three kinds of host memory, 256 MiB each way.
  const uint64_t xfer = std::min<uint64_t>(256 * kMiB, used * 4);
  allocator::Ledger ledger;
  allocator::HostArenaOptions ho;
  ho.ledger = &ledger;
  ho.budget_bytes = xfer + 64 * kMiB;
  ho.region_bytes = xfer;
  ho.pin = allocator::PinMode::kCuda;
  auto arena = Must(allocator::HostArena::Create(ho));
  void* from_arena = Must(arena->Allocate(
      xfer, {allocator::Kind::kSwapBuffer, allocator::Lifetime::kPersistent, 1, 0, nullptr}));
  void* from_cuda_host = nullptr;
  Check(cudaMallocHost(&from_cuda_host, xfer), "cudaMallocHost");
  void* from_malloc = std::malloc(xfer);
  if (from_malloc == nullptr) Die("malloc");
  for (void* p : {from_arena, from_cuda_host, from_malloc}) std::memcpy(p, host.data(), xfer);
  struct Xfer {
    const char* name;
    void* p;
    double h2d, d2h;
  } kinds[] = {{"HostArena (cudaHostRegister)", from_arena, 0, 0},
               {"cudaMallocHost", from_cuda_host, 0, 0},
               {"pageable malloc", from_malloc, 0, 0}};
  for (auto& k : kinds) {
    k.h2d = xfer / TimeDevice(stream, reps, [&] {
              Check(cudaMemcpyAsync(d32b, k.p, xfer, cudaMemcpyHostToDevice, stream), "H2D");
            });
    k.d2h = xfer / TimeDevice(stream, reps, [&] {
              Check(cudaMemcpyAsync(k.p, d32b, xfer, cudaMemcpyDeviceToHost, stream), "D2H");
            });
    std::printf("%-34s h2d %6.1f GB/s  d2h %6.1f GB/s\n", k.name, k.h2d / 1e9, k.d2h / 1e9);
  }
  if (std::memcmp(from_arena, host.data(), xfer) != 0) Die("D2H into the arena changed the data");
  Must(arena->Free(from_arena));
  cudaFreeHost(from_cuda_host);
  std::free(from_malloc);
  cudaFree(d32);
  cudaFree(d32b);
  cudaFree(d16);
  cudaFree(d16b);
  cudaStreamDestroy(stream);

  std::printf(
      "{\"bench\":\"cuda\",\"device\":\"%s\",\"roofline_gb_s\":%.1f,\"norm_fp32_gb_s\":%.1f,"
      "\"norm_fp32_roofline_fraction\":%.3f,\"norm_bf16_gb_s\":%.1f,\"scale_cast_fused_gb_s\":%.1f,"
      "\"scale_cast_roofline_fraction\":%.3f,\"fused_vs_unfused\":%.3f,"
      "\"h2d_arena_gb_s\":%.2f,\"h2d_cuda_host_gb_s\":%.2f,\"h2d_pageable_gb_s\":%.2f,"
      "\"d2h_arena_gb_s\":%.2f,\"d2h_cuda_host_gb_s\":%.2f,\"d2h_pageable_gb_s\":%.2f,"
      "\"arena_vs_cuda_host_h2d\":%.3f}\n",
      prop.name, roof / 1e9, norm32 / 1e9, norm32 / roof, norm16 / 1e9, fused_bw / 1e9,
      fused_bw / roof, t_unfused / t_fused, kinds[0].h2d / 1e9, kinds[1].h2d / 1e9,
      kinds[2].h2d / 1e9, kinds[0].d2h / 1e9, kinds[1].d2h / 1e9, kinds[2].d2h / 1e9,
      kinds[0].h2d / kinds[1].h2d);
  return 0;
}
