// Deterministic sum-of-squares kernels (kernels/cuda/grad_norm.h).
#include <cmath>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grad_norm.h"

namespace ptdp::kernels::cuda {
namespace {

// The grid defines the summation order, so it depends on n alone (sum_squares_blocks). Up to
// 1024 blocks of 256 threads (32 registers): 8 blocks an SM, so all resident at once on an
// H100 SXM or H200 (132 SMs; 912 of them on an H100 PCIe's 114), each thread with 4 float4
// loads in flight; the 256 blocks before this were 2 an SM and
// moved 60-63% of an H200's copy bandwidth. A short range takes fewer blocks, each thread at
// least 16 elements, rather than launching 1024 mostly idle ones.
constexpr int kBlocks = kSumSquaresMaxBlocks, kThreads = 256;
int sum_squares_blocks(int64_t n) {
  const int64_t per_block = int64_t{kThreads} * 16;
  const int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<int>(blocks < kBlocks ? (blocks > 0 ? blocks : 1) : kBlocks);
}

__device__ double block_sum_double(double v, double* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) sh[threadIdx.x] += sh[threadIdx.x + half];
    __syncthreads();
  }
  return sh[0];
}

__global__ void __launch_bounds__(kThreads)
    sum_squares_partial_kernel(const float* x, int64_t n, double* partial) {
  __shared__ double sh[kThreads];
  const double s = block_sum_double(sum_squares_share(x, n), sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const double* partial, int blocks, double* acc, bool accumulate) {
  __shared__ double sh[kThreads];
  double t = 0;  // this thread's partials, in order
  for (int i = static_cast<int>(threadIdx.x); i < blocks; i += kThreads) t += partial[i];
  const double s = block_sum_double(t, sh);
  if (threadIdx.x == 0) *acc = accumulate ? *acc + s : s;
}

// The partial sums, then *out (+)= their sum.
void sum_squares_through(const float* x, int64_t n, double* partial, double* out, bool accumulate,
                         cudaStream_t stream) {
  const int blocks = sum_squares_blocks(n);
  PTDP_KERNEL_LAUNCH(sum_squares_partial_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream)
  (x, n, partial);
  check_launch("sum_squares_partial_kernel");
  PTDP_KERNEL_LAUNCH(sum_partials_kernel, 1, kThreads, 0, stream)(partial, blocks, out, accumulate);
  check_launch("sum_partials_kernel");
}

}  // namespace

void sum_squares(const float* x, int64_t n, double* acc, cudaStream_t stream) {
  if (n <= 0) return;
  auto* partial = static_cast<double*>(
      allocate_async(sizeof(double) * static_cast<size_t>(sum_squares_blocks(n)), stream));
  sum_squares_through(x, n, partial, acc, true, stream);
  PTDP_CUDA_CHECK(cudaFreeAsync(partial, stream));
}

void sum_squares_to(const float* x, int64_t n, double* partials, double* out, cudaStream_t stream) {
  if (n <= 0) {
    PTDP_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), stream));
    return;
  }
  sum_squares_through(x, n, partials, out, false, stream);
}

double global_norm(const std::vector<std::pair<const float*, int64_t>>& tensors,
                   cudaStream_t stream) {
  double* acc = nullptr;
  acc = static_cast<double*>(allocate_async(sizeof(double), stream));
  PTDP_CUDA_CHECK(cudaMemsetAsync(acc, 0, sizeof(double), stream));
  for (const auto& [x, n] : tensors) sum_squares(x, n, acc, stream);
  double host = 0;
  PTDP_CUDA_CHECK(cudaMemcpyAsync(&host, acc, sizeof(double), cudaMemcpyDeviceToHost, stream));
  PTDP_CUDA_CHECK(cudaFreeAsync(acc, stream));
  PTDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  return std::sqrt(host);
}

}  // namespace ptdp::kernels::cuda
