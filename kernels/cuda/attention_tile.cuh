// Tiles shared by the flash-attention forward and backward kernels (kernels/cuda/attention.h):
// 32-row tiles of a [b, s, heads, D] tensor staged in shared memory, rows padded by two bf16 so
// the four threads that share a query row and read four different key rows hit different banks.
// Thread layout (128 threads): thread t owns tile row t / 4 and, of every 32-wide set of
// columns or keys, the ones congruent to t % 4.
#pragma once

#include <stdexcept>

#include "kernels/cuda/common.cuh"

namespace ptdp::kernels::cuda::attention {

constexpr int kTile = 32;      // query rows and key rows per tile
constexpr int kThreads = 128;  // 4 threads per tile row

template <int D>
constexpr int kPitch = D + 2;  // shared-memory row pitch in bf16

// dst[r][0..D) = src row (first + r) for r < kTile, zeros past s. `stride`: elements between
// consecutive positions (heads * D); src points at the head's first element.
template <int D>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int64_t stride, int first,
                                          int s) {
  constexpr int kPairs = D / 2;
  for (int idx = threadIdx.x; idx < kTile * kPairs; idx += blockDim.x) {
    const int r = idx / kPairs, c = idx % kPairs;
    __nv_bfloat162 val = __floats2bfloat162_rn(0.0f, 0.0f);
    if (first + r < s) val = reinterpret_cast<const __nv_bfloat162*>(src + (first + r) * stride)[c];
    reinterpret_cast<__nv_bfloat162*>(dst + r * kPitch<D>)[c] = val;
  }
}

// Dot product of two staged rows.
template <int D>
__device__ __forceinline__ float row_dot(const bf16* a, const bf16* b) {
  float acc = 0;
#pragma unroll 8
  for (int e = 0; e < D; e += 2) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(a + e));
    const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(b + e));
    acc = fmaf(x.x, y.x, acc);
    acc = fmaf(x.y, y.y, acc);
  }
  return acc;
}

// The two implementations behind kernels/cuda/attention.h (shapes already checked, b, s, hq > 0,
// s <= sk): CUDA cores (attention_forward.cu, attention_backward.cu) and tensor cores
// (attention_mma.cu, sm_80 and later, 16-byte aligned pointers). s queries (the last s of sk
// positions) against sk keys. Both backward passes start from delta.
void simt_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int64_t b,
                  int64_t s, int64_t sk, int64_t hq, int64_t hk, int64_t d, cudaStream_t stream);
void simt_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                   const bf16* dout, bf16* dq, bf16* dk, bf16* dv, int64_t b, int64_t s, int64_t sk,
                   int64_t hq, int64_t hk, int64_t d, cudaStream_t stream);
void mma_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int64_t b,
                 int64_t s, int64_t sk, int64_t hq, int64_t hk, int64_t d, cudaStream_t stream);
void mma_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                  const bf16* dout, bf16* dq, bf16* dk, bf16* dv, int64_t b, int64_t s, int64_t sk,
                  int64_t hq, int64_t hk, int64_t d, cudaStream_t stream);
// delta [b, hq, s] = rowsum(dout * out), the softmax backward's correction term.
void launch_delta(const bf16* out, const bf16* dout, float* delta, int64_t b, int64_t s, int64_t hq,
                  int64_t d, cudaStream_t stream);

inline void check_shape(int64_t b, int64_t s, int64_t sk, int64_t hq, int64_t hk, int64_t d) {
  // The launches put the sequences on the grid's z and the heads on its y.
  if (b > 65535 || hq > 65535)
    throw std::invalid_argument(
        "flash attention: at most 65535 sequences (b) and query heads (hq) a call");
  if (d != 64 && d != 128)
    throw std::invalid_argument("flash attention: head dimension d must be 64 or 128");
  if (hk <= 0 || hq % hk != 0)
    throw std::invalid_argument("flash attention: hq must be a positive multiple of hk");
  if (sk > (int64_t{1} << 30)) throw std::invalid_argument("flash attention: s too large");
  if (s < 0 || s > sk)
    throw std::invalid_argument("flash attention: more queries than keys (sq > sk)");
}

}  // namespace ptdp::kernels::cuda::attention
