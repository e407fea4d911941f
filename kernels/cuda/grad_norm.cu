// Deterministic sum-of-squares kernels (kernels/cuda/grad_norm.h).
#include <cmath>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grad_norm.h"

namespace ptdp::kernels::cuda {
namespace {

constexpr int kBlocks = 256, kThreads = 256;  // fixed: they define the summation order

__device__ double block_sum_double(double v, double* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) sh[threadIdx.x] += sh[threadIdx.x + half];
    __syncthreads();
  }
  return sh[0];
}

// Each thread squares float4 vectors 4 at a time, their loads issued together: one scalar load
// per thread in flight kept 256 KiB moving and reached half an H100's copy bandwidth. The
// elements before the first 16-byte boundary and after the last whole vector go to the first
// threads. Deterministic: the split depends only on n and x's alignment.
__global__ void __launch_bounds__(kThreads)
    sum_squares_partial_kernel(const float* x, int64_t n, double* partial) {
  __shared__ double sh[kThreads];
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(x) % 16 / 4);
  const int64_t head = misaligned == 0 ? 0 : (4 - misaligned < n ? 4 - misaligned : n);
  const int64_t vecs = (n - head) / 4, tail = n - head - 4 * vecs;
  double acc = 0;
  if (tid < head) acc += static_cast<double>(x[tid]) * x[tid];
  if (tid < tail) {
    const float t = x[head + 4 * vecs + tid];
    acc += static_cast<double>(t) * t;
  }
  const float4* v = reinterpret_cast<const float4*>(x + head);
  auto add = [&](const float4 q) {
    acc += static_cast<double>(q.x) * q.x + static_cast<double>(q.y) * q.y +
           static_cast<double>(q.z) * q.z + static_cast<double>(q.w) * q.w;
  };
  int64_t i = tid;
  for (; i + 3 * stride < vecs; i += 4 * stride) {
    const float4 q0 = v[i], q1 = v[i + stride], q2 = v[i + 2 * stride], q3 = v[i + 3 * stride];
    add(q0), add(q1), add(q2), add(q3);
  }
  for (; i < vecs; i += stride) add(v[i]);
  const double s = block_sum_double(acc, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const double* partial, double* acc) {
  __shared__ double sh[kThreads];
  const double s = block_sum_double(partial[threadIdx.x], sh);  // kThreads == kBlocks
  if (threadIdx.x == 0) *acc += s;
}

}  // namespace

void sum_squares(const float* x, int64_t n, double* acc, cudaStream_t stream) {
  if (n <= 0) return;
  double* partial = nullptr;
  PTDP_CUDA_CHECK(cudaMallocAsync(&partial, sizeof(double) * kBlocks, stream));
  PTDP_KERNEL_LAUNCH(sum_squares_partial_kernel, kBlocks, kThreads, 0, stream)(x, n, partial);
  check_launch("sum_squares_partial_kernel");
  PTDP_KERNEL_LAUNCH(sum_partials_kernel, 1, kThreads, 0, stream)(partial, acc);
  check_launch("sum_partials_kernel");
  PTDP_CUDA_CHECK(cudaFreeAsync(partial, stream));
}

double global_norm(const std::vector<std::pair<const float*, int64_t>>& tensors,
                   cudaStream_t stream) {
  double* acc = nullptr;
  PTDP_CUDA_CHECK(cudaMallocAsync(&acc, sizeof(double), stream));
  PTDP_CUDA_CHECK(cudaMemsetAsync(acc, 0, sizeof(double), stream));
  for (const auto& [x, n] : tensors) sum_squares(x, n, acc, stream);
  double host = 0;
  PTDP_CUDA_CHECK(cudaMemcpyAsync(&host, acc, sizeof(double), cudaMemcpyDeviceToHost, stream));
  PTDP_CUDA_CHECK(cudaFreeAsync(acc, stream));
  PTDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  return std::sqrt(host);
}

}  // namespace ptdp::kernels::cuda
