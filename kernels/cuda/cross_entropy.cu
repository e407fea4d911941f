// Vocabulary-parallel cross-entropy kernels (kernels/cuda/cross_entropy.h). The statistics
// kernel gives each row one block; each thread keeps a running (max, sum) pair over its columns
// (logit_stats_share, kernels/cuda/common.cuh, which the runtime's kernel shares) and the pairs
// are merged across the block (the online-softmax combination).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cross_entropy.h"

namespace ptdp::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// (m1, s1) + (m2, s2): sums of exp(x - m) rescaled to the larger max.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;  // both empty
  s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
  m = mx;
}

__global__ void __launch_bounds__(kThreads)
    ce_stats_kernel(const bf16* logits, const int32_t* targets, float* stats, int64_t vl,
                    int64_t valid, int64_t v0, bool vectors) {
  __shared__ float sm[kThreads / 32], ss[kThreads / 32];
  const int64_t i = blockIdx.x;
  const bf16* row = logits + i * vl;
  float m, s;
  logit_stats_share(row, valid, vectors, m, s);
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge(m, s, m2, s2);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) merge(m, s, sm[w], ss[w]);
    const int64_t tgt = targets[i] - v0;
    stats[i * 3] = m;
    stats[i * 3 + 1] = s;
    stats[i * 3 + 2] = tgt >= 0 && tgt < valid ? to_float(row[tgt]) : 0.0f;
  }
}

__global__ void ce_finish_kernel(const float* stats, int64_t ranks, float* lse, float* loss,
                                 int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float m = -INFINITY, s = 0.0f, target = 0.0f;
  for (int64_t r = 0; r < ranks; ++r) {
    const float* st = stats + (r * n + i) * 3;
    merge(m, s, st[0], st[1]);
    target += st[2];
  }
  lse[i] = m + logf(s);
  loss[i] = lse[i] - target;
}

__global__ void ce_backward_kernel(bf16* logits, const int32_t* targets, const float* lse,
                                   int64_t n, int64_t vl, int64_t valid, int64_t v0, float f) {
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n * vl;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx / vl, j = idx % vl;
    float g = 0.0f;
    if (j < valid) {
      g = __expf(to_float(logits[idx]) - lse[i]) * f;
      if (j == targets[i] - v0) g -= f;
    }
    logits[idx] = to_bf16(g);
  }
}

// The same, 8 logits a 16-byte vector (vl a multiple of 8, logits 16-byte aligned), by rows
// (blockIdx.y, then every gridDim.y-th) and vectors of the row: a row's target and lse read once
// a thread, kCeVecs vectors' loads issued before the first store. (A grid-stride loop over the
// flat array divided by the row length for every vector.)
constexpr int kCeVecs = 4, kCeThreads = 256;
__global__ void __launch_bounds__(kCeThreads)
    ce_backward_vec_kernel(Bf16x8* logits, const int32_t* targets, const float* lse, int64_t n,
                           int64_t vl, int64_t valid, int64_t v0, float f) {
  const int64_t per_row = vl / kVec, step = static_cast<int64_t>(blockDim.x) * kCeVecs;
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    const int64_t target = targets[i] - v0;
    const float m = lse[i];
    Bf16x8* row = logits + i * per_row;
    rewrite_vectors<kCeVecs>(row, row, static_cast<int64_t>(blockIdx.x) * step + threadIdx.x,
                             per_row, blockDim.x, static_cast<int64_t>(gridDim.x) * step,
                             [&](int64_t q, Bf16x8& v) {
                               for (int e = 0; e < kVec; ++e) {
                                 const int64_t j = q * kVec + e;
                                 float g = 0.0f;
                                 if (j < valid) {
                                   g = __expf(to_float(v.v[e]) - m) * f;
                                   if (j == target) g -= f;
                                 }
                                 v.v[e] = to_bf16(g);
                               }
                             });
  }
}

}  // namespace

void cross_entropy_stats(const bf16* logits, const int32_t* targets, float* stats, int64_t n,
                         int64_t vl, int64_t valid, int64_t v0, cudaStream_t stream) {
  if (n <= 0) return;
  PTDP_KERNEL_LAUNCH(ce_stats_kernel, static_cast<unsigned>(n), kThreads, 0, stream)
  (logits, targets, stats, vl, valid, v0, vectorizable(vl, {logits}));
  check_launch("ce_stats_kernel");
}

void cross_entropy_finish(const float* stats, int64_t ranks, float* lse, float* loss, int64_t n,
                          cudaStream_t stream) {
  if (n <= 0) return;
  PTDP_KERNEL_LAUNCH(ce_finish_kernel, blocks_for(n, 256), 256, 0, stream)
  (stats, ranks, lse, loss, n);
  check_launch("ce_finish_kernel");
}

void cross_entropy_backward(bf16* logits, const int32_t* targets, const float* lse, int64_t n,
                            int64_t vl, int64_t valid, int64_t v0, double scale,
                            cudaStream_t stream) {
  if (n <= 0 || vl <= 0) return;
  const float f = static_cast<float>(scale / static_cast<double>(n));
  if (vectorizable(vl, {logits})) {
    const int64_t across = (vl / kVec + kCeThreads * kCeVecs - 1) / (kCeThreads * kCeVecs);
    const dim3 grid(static_cast<unsigned>(across < 65535 ? across : 65535),
                    static_cast<unsigned>(n < 65535 ? n : 65535));
    PTDP_KERNEL_LAUNCH(ce_backward_vec_kernel, grid, kCeThreads, 0, stream)
    (reinterpret_cast<Bf16x8*>(logits), targets, lse, n, vl, valid, v0, f);
    check_launch("ce_backward_vec_kernel");
    return;
  }
  const int64_t blocks = (n * vl + 255) / 256;
  PTDP_KERNEL_LAUNCH(ce_backward_kernel, static_cast<unsigned>(blocks < 65536 ? blocks : 65536),
                     256, 0, stream)
  (logits, targets, lse, n, vl, valid, v0, f);
  check_launch("ce_backward_kernel");
}

}  // namespace ptdp::kernels::cuda
