// CUDA kernels of the step. See cuda_kernels.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "spillway/allocator/cuda_status.h"
#include "spillway/engine/cuda_kernels.h"

namespace spillway::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kChunk = 1 << 16;  // elements per block in the norm
constexpr int kUnroll = 4;            // 16-byte loads in flight per thread

// A tensor of the norm and the index of its first kChunk-element chunk among all tensors' chunks.
struct TensorDesc {
  const void* data;
  uint64_t numel;
  uint64_t first_chunk;
  int dtype;
};

// Every failure consumes the thread's last error (Note [CUDA error state], docs/engine.md).
Status CudaError(cudaError_t err, const char* what) {
  return spillway::cuda::ToStatus(err, what, StatusCode::kUnavailable);
}

// Element types by dtype code (0 fp32, 1 bf16, 2 fp16), with their conversions.
template <int D>
struct Elem;
template <>
struct Elem<0> {
  using T = float;
  static __device__ float Get(T x) { return x; }
  static __device__ T Put(float x) { return x; }
};
template <>
struct Elem<1> {
  using T = __nv_bfloat16;
  static __device__ float Get(T x) { return __bfloat162float(x); }
  static __device__ T Put(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Elem<2> {
  using T = __half;
  static __device__ float Get(T x) { return __half2float(x); }
  static __device__ T Put(float x) { return __float2half_rn(x); }
};

// kV elements in one aligned vector: 16 bytes of fp32 or 16-bit inputs, and their outputs.
template <typename T, int kV>
struct alignas(sizeof(T) * kV) Vec {
  T v[kV];
};

// Sum of squares of p[begin, end) over the block's threads, in double: a square of a float is
// exact in double, so only the association (fixed per thread, then a fixed tree) rounds. The body
// reads 16-byte vectors, kUnroll of them in flight per thread; the unaligned head and the tail go
// one element at a time.
template <int D>
__device__ double SumSqRange(const void* data, uint64_t begin, uint64_t end) {
  using E = Elem<D>;
  using T = typename E::T;
  constexpr int kV = 16 / sizeof(T);
  const T* p = static_cast<const T*>(data);
  const uint64_t misaligned = (reinterpret_cast<uintptr_t>(p + begin) % 16) / sizeof(T);
  const uint64_t head = begin + min(end - begin, misaligned == 0 ? 0 : kV - misaligned);
  const uint64_t nvec = (end - head) / kV;
  const uint64_t tail = head + nvec * kV;
  double acc[kUnroll] = {};
  for (uint64_t i = begin + threadIdx.x; i < head; i += blockDim.x) {
    const double x = E::Get(p[i]);
    acc[0] = fma(x, x, acc[0]);
  }
  const auto* v = reinterpret_cast<const Vec<T, kV>*>(p + head);
  const uint64_t stride = static_cast<uint64_t>(blockDim.x) * kUnroll;
  for (uint64_t k = threadIdx.x; k < nvec; k += stride) {
    Vec<T, kV> w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t j = k + static_cast<uint64_t>(u) * blockDim.x;
      if (j < nvec)
        w[u] = v[j];
      else
        for (int e = 0; e < kV; ++e) w[u].v[e] = E::Put(0.0f);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int e = 0; e < kV; ++e) {
        const double x = E::Get(w[u].v[e]);
        acc[u] = fma(x, x, acc[u]);
      }
    }
  }
  for (uint64_t i = tail + threadIdx.x; i < end; i += blockDim.x) {
    const double x = E::Get(p[i]);
    acc[1] = fma(x, x, acc[1]);
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// A persistent grid: block b takes chunks b, b + gridDim.x, ... (each chunk's tensor found by a
// binary search over first_chunk) and writes its sum of squares to partial[b]. The order of every
// addition is fixed by the grid size, so the same device gives the same bits every time. No
// separate inf/NaN flag: squares are never negative and a float's square cannot overflow a double,
// so the total is non-finite exactly when some element is.
__global__ void SumSqChunks(const TensorDesc* tensors, int count, uint64_t chunks,
                            double* partial) {
  double acc = 0.0;
  for (uint64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    int lo = 0, hi = count - 1;  // the last tensor whose first_chunk <= c
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tensors[mid].first_chunk <= c)
        lo = mid;
      else
        hi = mid - 1;
    }
    const TensorDesc t = tensors[lo];
    const uint64_t begin = (c - t.first_chunk) * kChunk;
    const uint64_t end = min(t.numel, begin + kChunk);
    if (t.dtype == 0)
      acc += SumSqRange<0>(t.data, begin, end);
    else if (t.dtype == 1)
      acc += SumSqRange<1>(t.data, begin, end);
    else
      acc += SumSqRange<2>(t.data, begin, end);
  }
  __shared__ double sh[kThreads];
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// One block: sums the partials in a fixed order.
__global__ void SumPartials(const double* partial, int n, double* out) {
  __shared__ double sh[kThreads];
  double acc = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = sh[0];
}

// out[i] = Put(Get(in[i]) * scale). Vectorized: kV input elements (16 bytes) per load and the
// matching output vector per store, kUnroll in flight; `in` and `out` must be 16-byte aligned
// (ScaleCast checks, else it launches the scalar kernel below).
template <int DI, int DO>
__global__ void ScaleCastVec(const void* in, void* out, uint64_t n, float scale) {
  using TI = typename Elem<DI>::T;
  using TO = typename Elem<DO>::T;
  constexpr int kV = 16 / sizeof(TI);
  const auto* vi = static_cast<const Vec<TI, kV>*>(in);
  auto* vo = static_cast<Vec<TO, kV>*>(out);
  const uint64_t nvec = n / kV;
  const uint64_t threads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t k = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; k < nvec;
       k += threads * kUnroll) {
    Vec<TI, kV> w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t j = k + u * threads;
      if (j < nvec) w[u] = vi[j];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t j = k + u * threads;
      if (j >= nvec) break;
      Vec<TO, kV> o;
#pragma unroll
      for (int e = 0; e < kV; ++e) o.v[e] = Elem<DO>::Put(Elem<DI>::Get(w[u].v[e]) * scale);
      vo[j] = o;
    }
  }
  // The last n % kV elements.
  const uint64_t rest = nvec * kV + blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  if (rest < n) {
    static_cast<TO*>(out)[rest] =
        Elem<DO>::Put(Elem<DI>::Get(static_cast<const TI*>(in)[rest]) * scale);
  }
}

template <int DI, int DO>
__global__ void ScaleCastScalar(const void* in, void* out, uint64_t n, float scale) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    static_cast<typename Elem<DO>::T*>(out)[i] =
        Elem<DO>::Put(Elem<DI>::Get(static_cast<const typename Elem<DI>::T*>(in)[i]) * scale);
  }
}

template <int DI, int DO>
void LaunchScaleCast(const void* in, void* out, uint64_t n, float scale, cudaStream_t stream,
                     unsigned max_blocks) {
  const bool aligned =
      reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const uint64_t items =
      aligned ? (n + 16 / sizeof(typename Elem<DI>::T) - 1) / (16 / sizeof(typename Elem<DI>::T))
              : n;
  const auto blocks = static_cast<unsigned>(
      std::min<uint64_t>(std::max<uint64_t>((items + kThreads - 1) / kThreads, 1), max_blocks));
  if (aligned)
    ScaleCastVec<DI, DO><<<blocks, kThreads, 0, stream>>>(in, out, n, scale);
  else
    ScaleCastScalar<DI, DO><<<blocks, kThreads, 0, stream>>>(in, out, n, scale);
}

// Enough resident blocks to fill the current device several times over; the grid-stride loops do
// the rest. Asked of the runtime on every call (an attribute read, no device work) rather than
// cached once, so a process whose threads drive GPUs of different sizes sizes each launch for the
// device it lands on; a failed query is the caller's error, not a guessed grid.
Result<unsigned> MaxBlocks() {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess)
    return CudaError(err, "reading the current device's multiprocessor count");
  return static_cast<unsigned>(sms) * 16;
}

}  // namespace

Status Available() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return CudaError(err, "no usable CUDA device (cudaGetDeviceCount)");
  if (count == 0) return Status::Make(StatusCode::kUnavailable, "no CUDA device is present");
  return Status::Ok();
}

Result<uint64_t> DeviceMemoryBytes() {
  SPILLWAY_RETURN_IF_ERROR(Available());
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (err != cudaSuccess) return CudaError(err, "cudaMemGetInfo");
  return static_cast<uint64_t>(total_bytes);
}

Result<NormResult> SumOfSquares(const DeviceTensor* tensors, size_t count, void* stream_ptr) {
  SPILLWAY_RETURN_IF_ERROR(Available());
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  std::vector<TensorDesc> descs;
  descs.reserve(count);
  uint64_t chunks = 0;
  for (size_t t = 0; t < count; ++t) {
    const DeviceTensor& d = tensors[t];
    if (d.data == nullptr || d.numel == 0 || !IsFloatingDType(d.dtype)) {
      return Status::InvalidArgument(
          StrCat("device tensor ", t, " is empty, null or of an unknown dtype"));
    }
    if (reinterpret_cast<uintptr_t>(d.data) % DTypeBytes(d.dtype) != 0) {
      return Status::InvalidArgument(StrCat(
          "device tensor ", t, " at ", d.data, " is not aligned to its ", DTypeName(d.dtype),
          " elements (", DTypeBytes(d.dtype), " bytes); pass the tensor's own data pointer"));
    }
    descs.push_back({d.data, d.numel, chunks, static_cast<int>(d.dtype)});
    chunks += (d.numel + kChunk - 1) / kChunk;
  }
  NormResult r;
  if (descs.empty()) return r;
  const Result<unsigned> max_blocks = MaxBlocks();
  if (!max_blocks.ok()) return max_blocks.status();
  const auto blocks = static_cast<unsigned>(std::min<uint64_t>(chunks, *max_blocks / 2));
  // One scratch allocation: the tensor table, one partial per block and the sum.
  const size_t table_bytes = descs.size() * sizeof(TensorDesc);
  const size_t partial_bytes = blocks * sizeof(double);
  const size_t bytes = table_bytes + partial_bytes + sizeof(double);
  char* scratch = nullptr;
  cudaError_t err = cudaMallocAsync(reinterpret_cast<void**>(&scratch), bytes, stream);
  if (err != cudaSuccess) return CudaError(err, "cudaMallocAsync for the norm's scratch");
  auto* d_descs = reinterpret_cast<TensorDesc*>(scratch);
  auto* d_partial = reinterpret_cast<double*>(scratch + table_bytes);
  auto* d_sum = reinterpret_cast<double*>(scratch + table_bytes + partial_bytes);
  double h_sum = 0.0;
  err = cudaMemcpyAsync(d_descs, descs.data(), table_bytes, cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess) {
    SumSqChunks<<<blocks, kThreads, 0, stream>>>(d_descs, static_cast<int>(descs.size()), chunks,
                                                 d_partial);
    SumPartials<<<1, kThreads, 0, stream>>>(d_partial, static_cast<int>(blocks), d_sum);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(&h_sum, d_sum, sizeof(double), cudaMemcpyDeviceToHost, stream);
  const cudaError_t free_err = cudaFreeAsync(scratch, stream);
  if (err == cudaSuccess) err = free_err;
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return CudaError(err, "the device norm");
  r.sum_of_squares = h_sum;
  r.finite = std::isfinite(h_sum);  // see SumSqChunks
  return r;
}

Status ScaleCast(const void* in, DType in_dtype, void* out, DType out_dtype, uint64_t numel,
                 float scale, void* stream_ptr) {
  SPILLWAY_RETURN_IF_ERROR(Available());
  if (in == nullptr || out == nullptr || numel == 0) {
    return Status::InvalidArgument("ScaleCast: null buffer or numel 0");
  }
  if (!IsFloatingDType(in_dtype) || !IsFloatingDType(out_dtype)) {
    return Status::InvalidArgument(StrCat("ScaleCast: ", DTypeName(in_dtype), " to ",
                                          DTypeName(out_dtype),
                                          "; both must be float32, bfloat16 or float16"));
  }
  if (in == out && in_dtype != out_dtype) {
    return Status::InvalidArgument("ScaleCast: in place needs the same dtype on both sides");
  }
  if (reinterpret_cast<uintptr_t>(in) % DTypeBytes(in_dtype) != 0 ||
      reinterpret_cast<uintptr_t>(out) % DTypeBytes(out_dtype) != 0) {
    return Status::InvalidArgument(
        StrCat("ScaleCast: in (", in, ") or out (", out, ") is not aligned to its element size"));
  }
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const Result<unsigned> max_blocks = MaxBlocks();
  if (!max_blocks.ok()) return max_blocks.status();
  const unsigned mb = *max_blocks;
  // Nine instantiations: every (input, output) pair of fp32, bf16 and fp16.
  using Launch = void (*)(const void*, void*, uint64_t, float, cudaStream_t, unsigned);
  static constexpr Launch kLaunch[3][3] = {
      {LaunchScaleCast<0, 0>, LaunchScaleCast<0, 1>, LaunchScaleCast<0, 2>},
      {LaunchScaleCast<1, 0>, LaunchScaleCast<1, 1>, LaunchScaleCast<1, 2>},
      {LaunchScaleCast<2, 0>, LaunchScaleCast<2, 1>, LaunchScaleCast<2, 2>}};
  kLaunch[static_cast<int>(in_dtype)][static_cast<int>(out_dtype)](in, out, numel, scale, stream,
                                                                   mb);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError(err, "launching ScaleCast");
  return Status::Ok();
}

}  // namespace spillway::engine::cuda
