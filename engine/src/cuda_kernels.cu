// CUDA kernels of the step. See cuda_kernels.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "spillway/engine/cuda_kernels.h"

namespace spillway::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kChunk = 1 << 16;  // elements per block in the norm

struct Chunk {
  const void* data;
  uint64_t begin, end;
  int dtype;
};

Status CudaError(cudaError_t err, const char* what) {
  return Status::Make(StatusCode::kUnavailable,
                      StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"),
                      static_cast<int>(err));
}

__device__ float Load(const void* p, uint64_t i, int dtype) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  if (dtype == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return __half2float(static_cast<const __half*>(p)[i]);
}

__device__ void Store(void* p, uint64_t i, int dtype, float x) {
  if (dtype == 0) {
    static_cast<float*>(p)[i] = x;
  } else if (dtype == 1) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  } else {
    static_cast<__half*>(p)[i] = __float2half_rn(x);
  }
}

// One block per chunk: partial[b] = sum of squares of the chunk in double; flag |= non-finite.
__global__ void SumSqChunks(const Chunk* chunks, double* partial, int* nonfinite) {
  const Chunk c = chunks[blockIdx.x];
  double acc = 0.0;
  bool bad = false;
  for (uint64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
    const float x = Load(c.data, i, c.dtype);
    bad |= !isfinite(x);
    acc = fma(static_cast<double>(x), static_cast<double>(x), acc);
  }
  __shared__ double sh[kThreads];
  sh[threadIdx.x] = acc;
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(nonfinite, 1);
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

__global__ void ScaleCastKernel(const void* in, int in_dtype, void* out, int out_dtype,
                                uint64_t n, float scale) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    Store(out, i, out_dtype, Load(in, i, in_dtype) * scale);
  }
}

}  // namespace

Status Available() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return CudaError(err, "no usable CUDA device (cudaGetDeviceCount)");
  if (count == 0) return Status::Make(StatusCode::kUnavailable, "no CUDA device is present");
  return Status::Ok();
}

Result<NormResult> SumOfSquares(const DeviceTensor* tensors, size_t count, void* stream_ptr) {
  SPILLWAY_RETURN_IF_ERROR(Available());
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < count; ++t) {
    const DeviceTensor& d = tensors[t];
    if (d.data == nullptr || d.numel == 0 || static_cast<unsigned>(d.dtype) > 2) {
      return Status::InvalidArgument(StrCat("device tensor ", t, " is empty, null or of an unknown dtype"));
    }
    for (uint64_t b = 0; b < d.numel; b += kChunk) {
      chunks.push_back({d.data, b, std::min(d.numel, b + kChunk), static_cast<int>(d.dtype)});
    }
  }
  NormResult r;
  if (chunks.empty()) return r;
  // One scratch allocation: chunk table, partials, the sum and the flag.
  const size_t table_bytes = chunks.size() * sizeof(Chunk);
  const size_t partial_bytes = chunks.size() * sizeof(double);
  const size_t bytes = table_bytes + partial_bytes + sizeof(double) + sizeof(int);
  char* scratch = nullptr;
  cudaError_t err = cudaMallocAsync(reinterpret_cast<void**>(&scratch), bytes, stream);
  if (err != cudaSuccess) return CudaError(err, "cudaMallocAsync for the norm's scratch");
  auto* d_chunks = reinterpret_cast<Chunk*>(scratch);
  auto* d_partial = reinterpret_cast<double*>(scratch + table_bytes);
  auto* d_sum = reinterpret_cast<double*>(scratch + table_bytes + partial_bytes);
  auto* d_flag = reinterpret_cast<int*>(scratch + table_bytes + partial_bytes + sizeof(double));
  double h_sum = 0.0;
  int h_flag = 0;
  err = cudaMemcpyAsync(d_chunks, chunks.data(), table_bytes, cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(d_flag, 0, sizeof(int), stream);
  if (err == cudaSuccess) {
    SumSqChunks<<<static_cast<unsigned>(chunks.size()), kThreads, 0, stream>>>(d_chunks, d_partial, d_flag);
    SumPartials<<<1, kThreads, 0, stream>>>(d_partial, static_cast<int>(chunks.size()), d_sum);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaMemcpyAsync(&h_sum, d_sum, sizeof(double), cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaMemcpyAsync(&h_flag, d_flag, sizeof(int), cudaMemcpyDeviceToHost, stream);
  const cudaError_t free_err = cudaFreeAsync(scratch, stream);
  if (err == cudaSuccess) err = free_err;
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return CudaError(err, "the device norm");
  r.sum_of_squares = h_sum;
  r.finite = h_flag == 0;
  return r;
}

Status ScaleCast(const void* in, DType in_dtype, void* out, DType out_dtype, uint64_t numel,
                 float scale, void* stream_ptr) {
  SPILLWAY_RETURN_IF_ERROR(Available());
  if (in == nullptr || out == nullptr || numel == 0) {
    return Status::InvalidArgument("ScaleCast: null buffer or numel 0");
  }
  if (static_cast<unsigned>(in_dtype) > 2 || static_cast<unsigned>(out_dtype) > 2) {
    return Status::InvalidArgument("ScaleCast: unknown dtype; use fp32, bf16 or fp16");
  }
  if (in == out && in_dtype != out_dtype) {
    return Status::InvalidArgument("ScaleCast: in place needs the same dtype on both sides");
  }
  const uint64_t blocks = std::min<uint64_t>((numel + kThreads - 1) / kThreads, 65535ull * 8);
  ScaleCastKernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream_ptr)>>>(
      in, static_cast<int>(in_dtype), out, static_cast<int>(out_dtype), numel, scale);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaError(err, "launching ScaleCast");
  return Status::Ok();
}

}  // namespace spillway::engine::cuda
