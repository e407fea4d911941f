// Flash-attention forward on CUDA cores (kernels/cuda/attention.h, FlashKernel::kSimt). One block
// per (32-query tile, query head, sequence). The query tile stays in shared memory; each 32-key
// tile of K and V up to the diagonal (shifted by sk - sq when the queries are the last sq of sk
// positions) is staged in turn. Thread t owns query row t / 4: it computes
// 8 of that row's 32 scores, the 4 threads of the row combine their maxima and sums by warp
// shuffles, and the thread keeps D / 4 columns of the output row in registers, rescaled whenever
// the running max grows (online softmax). Memory: O(tile) per block; lse is the only per-row state
// saved.
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_tile.cuh"

namespace ptdp::kernels::cuda {
namespace {

using attention::kThreads;
using attention::kTile;

template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int s,
                         int skeys, int hq, int hk, float scale) {
  constexpr int P = attention::kPitch<D>;
  constexpr int kCols = D / 4;      // output columns per thread
  constexpr int kKeys = kTile / 4;  // scores per thread per key tile
  __shared__ __align__(16) bf16 sq[kTile * P];
  __shared__ __align__(16) bf16 sk[kTile * P];
  __shared__ __align__(16) bf16 sv[kTile * P];
  __shared__ float sp[kTile][kTile + 1];

  // Query tiles longest first: a causal tile's work grows with q0, and blocks start in index
  // order, so the longest ones ending the grid would leave the GPU a long tail.
  const int bi = blockIdx.z, h = blockIdx.y, q0 = (gridDim.x - 1 - blockIdx.x) * kTile;
  const int kh = h / (hq / hk);
  const int r = threadIdx.x / 4, quad = threadIdx.x % 4, row = q0 + r;
  const int64_t qstride = static_cast<int64_t>(hq) * D, kstride = static_cast<int64_t>(hk) * D;
  const bf16* qb = q + static_cast<int64_t>(bi) * s * qstride + static_cast<int64_t>(h) * D;
  const bf16* kb = k + static_cast<int64_t>(bi) * skeys * kstride + static_cast<int64_t>(kh) * D;
  const bf16* vb = v + static_cast<int64_t>(bi) * skeys * kstride + static_cast<int64_t>(kh) * D;
  const int shift = skeys - s;  // query i sees keys j <= i + shift

  attention::load_tile<D>(sq, qb, qstride, q0, s);
  float o[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) o[c] = 0.0f;
  float m = -INFINITY, l = 0.0f;

  const int last = min(q0 + kTile, s) - 1 + shift;  // the last key of the tile's last query
  for (int k0 = 0; k0 <= last; k0 += kTile) {
    __syncthreads();  // everyone is done with the previous K/V tile
    attention::load_tile<D>(sk, kb, kstride, k0, skeys);
    attention::load_tile<D>(sv, vb, kstride, k0, skeys);
    __syncthreads();

    float sc[kKeys];
    float tile_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kKeys; ++i) {
      const int j = quad + 4 * i, key = k0 + j;
      float x = attention::row_dot<D>(sq + r * P, sk + j * P) * scale;
      if (key > row + shift || key >= skeys) x = -INFINITY;  // causal mask (and padding)
      sc[i] = x;
      tile_max = fmaxf(tile_max, x);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);
    // Rows past s see only masked keys; keep them finite (they are never stored).
    const float alpha = m == -INFINITY ? 0.0f : __expf(m - m_new);
    float tile_sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kKeys; ++i) {
      const float p = sc[i] == -INFINITY ? 0.0f : __expf(sc[i] - m_new);
      sp[r][quad + 4 * i] = p;
      tile_sum += p;
    }
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 2);
    l = l * alpha + tile_sum;
    m = m_new;
    __syncwarp();  // the row's probabilities, written by its 4 threads, are visible to all 4

#pragma unroll
    for (int c = 0; c < kCols; ++c) o[c] *= alpha;
    for (int j = 0; j < kTile; ++j) {
      const float p = sp[r][j];
      const bf16* vrow = sv + j * P + quad;
#pragma unroll
      for (int c = 0; c < kCols; ++c) o[c] = fmaf(p, to_float(vrow[4 * c]), o[c]);
    }
  }

  if (row < s) {
    const float inv = 1.0f / l;
    bf16* orow = out + (static_cast<int64_t>(bi) * s + row) * qstride + static_cast<int64_t>(h) * D;
#pragma unroll
    for (int c = 0; c < kCols; ++c) orow[quad + 4 * c] = to_bf16(o[c] * inv);
    if (quad == 0) lse[(static_cast<int64_t>(bi) * hq + h) * s + row] = m + logf(l);
  }
}

}  // namespace

void attention::simt_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse,
                             int64_t b, int64_t s, int64_t sk, int64_t hq, int64_t hk, int64_t d,
                             cudaStream_t stream) {
  const dim3 grid(blocks_for(s, kTile), static_cast<unsigned>(hq), static_cast<unsigned>(b));
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const int si = static_cast<int>(s), ski = static_cast<int>(sk), hqi = static_cast<int>(hq),
            hki = static_cast<int>(hk);
  if (d == 64) {
    PTDP_KERNEL_LAUNCH(flash_forward_kernel<64>, grid, kThreads, 0, stream)
    (q, k, v, out, lse, si, ski, hqi, hki, scale);
  } else {
    PTDP_KERNEL_LAUNCH(flash_forward_kernel<128>, grid, kThreads, 0, stream)
    (q, k, v, out, lse, si, ski, hqi, hki, scale);
  }
  check_launch("flash_forward_kernel");
}

}  // namespace ptdp::kernels::cuda
