// Causal attention in fp32 for the CUDA backend's --use-flash-attn path
// (runtime/cuda/fp32_kernels.h): the device twin of causal_attention_* in kernels/cpu/fused.h.
// One warp per query row (forward, dq) or per key row (dk, dv); each lane holds d / 32 of the
// row's elements in registers; dot products are warp sums; the forward pass keeps a running max
// and sum (online softmax) and writes only the output and the log-sum-exp, so no s x s matrix
// exists. Every output row has one writer and its sum runs in key (or query) order: no atomics,
// the same bits on every run. Any head dimension up to kMaxD.
//
// This is the correctness baseline beside the CPU backend, not the fast path: the bf16
// tensor-tile kernels of kernels/cuda/attention.h are.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels/cuda/common.cuh"
#include "runtime/cuda/fp32_kernels.h"

namespace ptdp::cuda_fp32 {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 4;  // warps per block
constexpr int kPerLane = kMaxAttentionHeadDim / kWarp;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Loads row `p` (d elements) into the lane's registers: element lane + 32 r goes to x[r].
__device__ __forceinline__ void load_row(float (&x)[kPerLane], const float* p, int d) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int e = lane + kWarp * r;
    x[r] = e < d ? p[e] : 0.0f;
  }
}
__device__ __forceinline__ float dot_row(const float (&x)[kPerLane], const float* p, int d) {
  const int lane = threadIdx.x % kWarp;
  float acc = 0;
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int e = lane + kWarp * r;
    if (e < d) acc = fmaf(x[r], p[e], acc);
  }
  return warp_sum(acc);
}
__device__ __forceinline__ void store_row(const float (&x)[kPerLane], float* p, int d, float f) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int e = lane + kWarp * r;
    if (e < d) p[e] = x[r] * f;
  }
}

// sq queries against sk keys (sq <= sk); query i sees keys j <= i + shift, shift = sk - sq.
struct Shape {
  int64_t b, sq, sk, hq, hk;
  int d;
  float scale;
  // Element offsets of row i of head h: a query row of [b, sq, hq, d], a key row of
  // [b, sk, hk, d].
  __device__ int64_t qat(int64_t bi, int64_t i, int64_t h) const {
    return ((bi * sq + i) * hq + h) * d;
  }
  __device__ int64_t kat(int64_t bi, int64_t j, int64_t h) const {
    return ((bi * sk + j) * hk + h) * d;
  }
  __device__ int64_t shift() const { return sk - sq; }
};

// grid (ceil(s / kRowsPerBlock), b * hq): warp w of block x owns query row x * 4 + w of one
// (batch, head).
__global__ void flash_forward_k(const float* q, const float* k, const float* v, float* out,
                                float* lse, Shape sh) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (i >= sh.sq) return;
  const int64_t bi = blockIdx.y / sh.hq, h = blockIdx.y % sh.hq, kh = h / (sh.hq / sh.hk);
  float qi[kPerLane], acc[kPerLane];
  load_row(qi, q + sh.qat(bi, i, h), sh.d);
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) acc[r] = 0;
  float mx = -INFINITY, sum = 0;
  for (int64_t j = 0; j <= i + sh.shift(); ++j) {
    const float score = dot_row(qi, k + sh.kat(bi, j, kh), sh.d) * sh.scale;
    const float m_new = fmaxf(mx, score);
    const float correction = expf(mx - m_new), p = expf(score - m_new);
    sum = sum * correction + p;
    const float* vj = v + sh.kat(bi, j, kh);
    const int lane = threadIdx.x % kWarp;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int e = lane + kWarp * r;
      acc[r] = acc[r] * correction + (e < sh.d ? p * vj[e] : 0.0f);
    }
    mx = m_new;
  }
  store_row(acc, out + sh.qat(bi, i, h), sh.d, 1.0f / sum);
  if (threadIdx.x % kWarp == 0) lse[(bi * sh.hq + h) * sh.sq + i] = mx + logf(sum);
}

// delta [b, hq, sq]: rowsum(dout * out), FlashAttention-2's D.
__global__ void flash_delta_k(const float* out, const float* dout, float* delta, Shape sh) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (i >= sh.sq) return;
  const int64_t bi = blockIdx.y / sh.hq, h = blockIdx.y % sh.hq;
  float o[kPerLane];
  load_row(o, out + sh.qat(bi, i, h), sh.d);
  const float dot = dot_row(o, dout + sh.qat(bi, i, h), sh.d);
  if (threadIdx.x % kWarp == 0) delta[(bi * sh.hq + h) * sh.sq + i] = dot;
}

// dq_i = scale * sum_{j <= i + shift} p_ij (dout_i . v_j - delta_i) k_j. Grid as the forward pass.
__global__ void flash_dq_k(const float* q, const float* k, const float* v, const float* lse,
                           const float* delta, const float* dout, float* dq, Shape sh) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (i >= sh.sq) return;
  const int64_t bi = blockIdx.y / sh.hq, h = blockIdx.y % sh.hq, kh = h / (sh.hq / sh.hk);
  const int64_t row = (bi * sh.hq + h) * sh.sq + i;
  float qi[kPerLane], doi[kPerLane], acc[kPerLane];
  load_row(qi, q + sh.qat(bi, i, h), sh.d);
  load_row(doi, dout + sh.qat(bi, i, h), sh.d);
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) acc[r] = 0;
  const float l = lse[row], di = delta[row];
  const int lane = threadIdx.x % kWarp;
  for (int64_t j = 0; j <= i + sh.shift(); ++j) {
    const float* kj = k + sh.kat(bi, j, kh);
    const float p = expf(dot_row(qi, kj, sh.d) * sh.scale - l);
    const float ds = p * (dot_row(doi, v + sh.kat(bi, j, kh), sh.d) - di) * sh.scale;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int e = lane + kWarp * r;
      if (e < sh.d) acc[r] = fmaf(ds, kj[e], acc[r]);
    }
  }
  store_row(acc, dq + sh.qat(bi, i, h), sh.d, 1.0f);
}

// dk_j and dv_j of key row j of key/value head kh, summed over the group's query heads and the
// queries i >= j - shift. grid (ceil(sk / kRowsPerBlock), b * hk).
__global__ void flash_dkdv_k(const float* q, const float* k, const float* v, const float* lse,
                             const float* delta, const float* dout, float* dk, float* dv,
                             Shape sh) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (j >= sh.sk) return;
  const int64_t bi = blockIdx.y / sh.hk, kh = blockIdx.y % sh.hk, group = sh.hq / sh.hk;
  float kj[kPerLane], vj[kPerLane], dkj[kPerLane], dvj[kPerLane];
  load_row(kj, k + sh.kat(bi, j, kh), sh.d);
  load_row(vj, v + sh.kat(bi, j, kh), sh.d);
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) dkj[r] = dvj[r] = 0;
  const int lane = threadIdx.x % kWarp;
  for (int64_t h = kh * group; h < (kh + 1) * group; ++h)
    for (int64_t i = j > sh.shift() ? j - sh.shift() : 0; i < sh.sq; ++i) {
      const int64_t row = (bi * sh.hq + h) * sh.sq + i;
      const float* qi = q + sh.qat(bi, i, h);
      const float* doi = dout + sh.qat(bi, i, h);
      const float p = expf(dot_row(kj, qi, sh.d) * sh.scale - lse[row]);
      const float ds = p * (dot_row(vj, doi, sh.d) - delta[row]) * sh.scale;
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) {
        const int e = lane + kWarp * r;
        if (e < sh.d) {
          dvj[r] = fmaf(p, doi[e], dvj[r]);
          dkj[r] = fmaf(ds, qi[e], dkj[r]);
        }
      }
    }
  store_row(dkj, dk + sh.kat(bi, j, kh), sh.d, 1.0f);
  store_row(dvj, dv + sh.kat(bi, j, kh), sh.d, 1.0f);
}

Shape shape_of(int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk, int64_t d) {
  if (d < 1 || d > kMaxAttentionHeadDim)
    throw std::invalid_argument("flash attention (fp32): head dimension must be 1.." +
                                std::to_string(kMaxAttentionHeadDim));
  if (hk < 1 || hq % hk != 0)
    throw std::invalid_argument("flash attention (fp32): hq must be a positive multiple of hk");
  if (sq < 0 || sq > sk)
    throw std::invalid_argument("flash attention (fp32): more queries than keys");
  if (b * hq > 65535 || sk > (int64_t{1} << 30))
    throw std::invalid_argument("flash attention (fp32): b * heads or s too large for one launch");
  return Shape{b, sq, sk, hq, hk, static_cast<int>(d), static_cast<float>(1.0 / sqrt(double(d)))};
}

// One warp per row of `rows` (queries or keys) of each (batch, head).
dim3 grid_of(const Shape& sh, int64_t rows, int64_t heads) {
  return dim3(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock),
              static_cast<unsigned>(sh.b * heads));
}

}  // namespace

void flash_attention_forward(const float* q, const float* k, const float* v, float* out, float* lse,
                             int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk, int64_t d,
                             cudaStream_t st) {
  const Shape sh = shape_of(b, sq, sk, hq, hk, d);
  if (b * sq == 0) return;
  PTDP_KERNEL_LAUNCH(flash_forward_k, grid_of(sh, sq, hq), kRowsPerBlock * kWarp, 0, st)
  (q, k, v, out, lse, sh);
  kernels::cuda::check_launch("flash_forward_k");
}

void flash_attention_backward(const float* q, const float* k, const float* v, const float* out,
                              const float* lse, const float* dout, float* dq, float* dk, float* dv,
                              float* delta, int64_t b, int64_t sq, int64_t sk, int64_t hq,
                              int64_t hk, int64_t d, cudaStream_t st) {
  const Shape sh = shape_of(b, sq, sk, hq, hk, d);
  if (b * sk == 0) return;
  constexpr int threads = kRowsPerBlock * kWarp;
  if (sq > 0) {  // no queries: dk and dv are zero
    PTDP_KERNEL_LAUNCH(flash_delta_k, grid_of(sh, sq, hq), threads, 0, st)(out, dout, delta, sh);
    kernels::cuda::check_launch("flash_delta_k");
    PTDP_KERNEL_LAUNCH(flash_dq_k, grid_of(sh, sq, hq), threads, 0, st)
    (q, k, v, lse, delta, dout, dq, sh);
    kernels::cuda::check_launch("flash_dq_k");
  }
  PTDP_KERNEL_LAUNCH(flash_dkdv_k, grid_of(sh, sk, hk), threads, 0, st)
  (q, k, v, lse, delta, dout, dk, dv, sh);
  kernels::cuda::check_launch("flash_dkdv_k");
}

}  // namespace ptdp::cuda_fp32
