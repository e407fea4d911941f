// Flash-attention backward on CUDA cores (kernels/cuda/attention.h, FlashKernel::kSimt), in
// three kernels:
//   delta:  delta[row] = sum(dout * out) over the row (the softmax backward's correction term);
//   dk/dv:  one block per (32-key tile, key/value head, sequence) walks every query head of its
//           group and every query tile at or below the diagonal (shifted by sk - sq when the
//           queries are the last sq of sk positions), recomputing p = exp(s - lse),
//           and accumulates its 32 rows of dk and dv in registers;
//   dq:     one block per (32-query tile, query head, sequence) walks the key tiles up to the
//           diagonal and accumulates its rows of dq.
// Recomputing the scores twice costs more arithmetic than FlashAttention-2's atomic dq update,
// but every output row has exactly one writer, so the result is deterministic.
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_tile.cuh"

namespace ptdp::kernels::cuda {
namespace {

using attention::kThreads;
using attention::kTile;

// One warp per (sequence, position, query head) row; delta is [b, hq, s].
template <int D>
__global__ void flash_delta_kernel(const bf16* out, const bf16* dout, float* delta, int64_t rows,
                                   int s, int hq) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= rows) return;
  float acc = 0;
  for (int e = lane; e < D; e += 32) acc += to_float(out[w * D + e]) * to_float(dout[w * D + e]);
  acc = warp_sum(acc);
  if (lane == 0) {
    const int64_t h = w % hq, pos = (w / hq) % s, bi = w / (static_cast<int64_t>(hq) * s);
    delta[(bi * hq + h) * s + pos] = acc;
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_backward_kv_kernel(const bf16* q, const bf16* k, const bf16* v, const float* lse,
                             const float* delta, const bf16* dout, bf16* dk, bf16* dv, int s,
                             int skeys, int hq, int hk, float scale) {
  constexpr int P = attention::kPitch<D>;
  constexpr int kCols = D / 4;
  constexpr int kRows = kTile / 4;  // query rows per thread per tile
  __shared__ __align__(16) bf16 sk[kTile * P];
  __shared__ __align__(16) bf16 sv[kTile * P];
  __shared__ __align__(16) bf16 sq[kTile * P];
  __shared__ __align__(16) bf16 sdo[kTile * P];
  __shared__ float sp[kTile][kTile + 1];   // [key][query] probabilities
  __shared__ float sds[kTile][kTile + 1];  // [key][query] score gradients
  __shared__ float slse[kTile], sdelta[kTile];

  const int bi = blockIdx.z, kh = blockIdx.y, k0 = blockIdx.x * kTile;
  const int c = threadIdx.x / 4, quad = threadIdx.x % 4, key = k0 + c;
  const int group = hq / hk;
  const int64_t qstride = static_cast<int64_t>(hq) * D, kstride = static_cast<int64_t>(hk) * D;
  const int64_t koff = static_cast<int64_t>(bi) * skeys * kstride + static_cast<int64_t>(kh) * D;
  const int shift = skeys - s;  // query i sees keys j <= i + shift
  attention::load_tile<D>(sk, k + koff, kstride, k0, skeys);
  attention::load_tile<D>(sv, v + koff, kstride, k0, skeys);

  float dk_acc[kCols], dv_acc[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) dk_acc[i] = dv_acc[i] = 0.0f;

  for (int g = 0; g < group; ++g) {
    const int h = kh * group + g;
    const int64_t qoff = static_cast<int64_t>(bi) * s * qstride + static_cast<int64_t>(h) * D;
    const float* lse_h = lse + (static_cast<int64_t>(bi) * hq + h) * s;
    const float* delta_h = delta + (static_cast<int64_t>(bi) * hq + h) * s;
    // Query tiles at or below the diagonal: from the first query that sees key k0.
    for (int q0 = max(0, k0 - shift); q0 < s; q0 += kTile) {
      __syncthreads();
      attention::load_tile<D>(sq, q + qoff, qstride, q0, s);
      attention::load_tile<D>(sdo, dout + qoff, qstride, q0, s);
      if (threadIdx.x < kTile) {
        const int row = q0 + threadIdx.x;
        slse[threadIdx.x] = row < s ? lse_h[row] : 0.0f;
        sdelta[threadIdx.x] = row < s ? delta_h[row] : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int rr = quad + 4 * i, row = q0 + rr;
        float p = 0.0f, ds = 0.0f;
        if (key <= row + shift && row < s) {
          p = __expf(attention::row_dot<D>(sq + rr * P, sk + c * P) * scale - slse[rr]);
          const float dp = attention::row_dot<D>(sdo + rr * P, sv + c * P);
          ds = p * (dp - sdelta[rr]);
        }
        sp[c][rr] = p;
        sds[c][rr] = ds;
      }
      __syncwarp();  // key row c's 32 entries, written by its 4 threads, are visible to all 4
      for (int rr = 0; rr < kTile; ++rr) {
        const float p = sp[c][rr], ds = sds[c][rr];
        const bf16* dorow = sdo + rr * P + quad;
        const bf16* qrow = sq + rr * P + quad;
#pragma unroll
        for (int i = 0; i < kCols; ++i) {
          dv_acc[i] = fmaf(p, to_float(dorow[4 * i]), dv_acc[i]);
          dk_acc[i] = fmaf(ds, to_float(qrow[4 * i]), dk_acc[i]);
        }
      }
    }
  }
  if (key < skeys) {
    bf16* dkrow = dk + koff + static_cast<int64_t>(key) * kstride;
    bf16* dvrow = dv + koff + static_cast<int64_t>(key) * kstride;
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      dkrow[quad + 4 * i] = to_bf16(dk_acc[i] * scale);
      dvrow[quad + 4 * i] = to_bf16(dv_acc[i]);
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    flash_backward_q_kernel(const bf16* q, const bf16* k, const bf16* v, const float* lse,
                            const float* delta, const bf16* dout, bf16* dq, int s, int skeys,
                            int hq, int hk, float scale) {
  constexpr int P = attention::kPitch<D>;
  constexpr int kCols = D / 4;
  constexpr int kKeys = kTile / 4;
  __shared__ __align__(16) bf16 sq[kTile * P];
  __shared__ __align__(16) bf16 sdo[kTile * P];
  __shared__ __align__(16) bf16 sk[kTile * P];
  __shared__ __align__(16) bf16 sv[kTile * P];
  __shared__ float sds[kTile][kTile + 1];  // [query][key]

  // Query tiles longest first: a causal tile's work grows with q0, and blocks start in index
  // order, so the longest ones ending the grid would leave the GPU a long tail.
  const int bi = blockIdx.z, h = blockIdx.y, q0 = (gridDim.x - 1 - blockIdx.x) * kTile;
  const int kh = h / (hq / hk);
  const int r = threadIdx.x / 4, quad = threadIdx.x % 4, row = q0 + r;
  const int64_t qstride = static_cast<int64_t>(hq) * D, kstride = static_cast<int64_t>(hk) * D;
  const int64_t qoff = static_cast<int64_t>(bi) * s * qstride + static_cast<int64_t>(h) * D;
  const int64_t koff = static_cast<int64_t>(bi) * skeys * kstride + static_cast<int64_t>(kh) * D;
  const int shift = skeys - s;
  attention::load_tile<D>(sq, q + qoff, qstride, q0, s);
  attention::load_tile<D>(sdo, dout + qoff, qstride, q0, s);
  const int64_t stat = (static_cast<int64_t>(bi) * hq + h) * s + row;
  const float row_lse = row < s ? lse[stat] : 0.0f, row_delta = row < s ? delta[stat] : 0.0f;

  float dq_acc[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) dq_acc[i] = 0.0f;

  const int last = min(q0 + kTile, s) - 1 + shift;  // the last key of the tile's last query
  for (int k0 = 0; k0 <= last; k0 += kTile) {
    __syncthreads();
    attention::load_tile<D>(sk, k + koff, kstride, k0, skeys);
    attention::load_tile<D>(sv, v + koff, kstride, k0, skeys);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kKeys; ++i) {
      const int j = quad + 4 * i, key = k0 + j;
      float ds = 0.0f;
      if (key <= row + shift && row < s) {
        const float p = __expf(attention::row_dot<D>(sq + r * P, sk + j * P) * scale - row_lse);
        const float dp = attention::row_dot<D>(sdo + r * P, sv + j * P);
        ds = p * (dp - row_delta);
      }
      sds[r][j] = ds;
    }
    __syncwarp();
    for (int j = 0; j < kTile; ++j) {
      const float ds = sds[r][j];
      const bf16* krow = sk + j * P + quad;
#pragma unroll
      for (int i = 0; i < kCols; ++i) dq_acc[i] = fmaf(ds, to_float(krow[4 * i]), dq_acc[i]);
    }
  }
  if (row < s) {
    bf16* dqrow = dq + qoff + static_cast<int64_t>(row) * qstride;
#pragma unroll
    for (int i = 0; i < kCols; ++i) dqrow[quad + 4 * i] = to_bf16(dq_acc[i] * scale);
  }
}

template <int D>
void backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
              const bf16* dout, bf16* dq, bf16* dk, bf16* dv, int64_t b, int64_t s, int64_t sk,
              int64_t hq, int64_t hk, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(D));
  const int si = static_cast<int>(s), ski = static_cast<int>(sk), hqi = static_cast<int>(hq),
            hki = static_cast<int>(hk);
  float* delta = nullptr;
  delta = static_cast<float*>(allocate_async(sizeof(float) * b * s * hq, stream));
  attention::launch_delta(out, dout, delta, b, s, hq, D, stream);
  const unsigned ub = static_cast<unsigned>(b);
  PTDP_KERNEL_LAUNCH(flash_backward_kv_kernel<D>,
                     dim3(blocks_for(sk, kTile), static_cast<unsigned>(hk), ub), kThreads, 0,
                     stream)
  (q, k, v, lse, delta, dout, dk, dv, si, ski, hqi, hki, scale);
  check_launch("flash_backward_kv_kernel");
  PTDP_KERNEL_LAUNCH(flash_backward_q_kernel<D>,
                     dim3(blocks_for(s, kTile), static_cast<unsigned>(hq), ub), kThreads, 0, stream)
  (q, k, v, lse, delta, dout, dq, si, ski, hqi, hki, scale);
  check_launch("flash_backward_q_kernel");
  PTDP_CUDA_CHECK(cudaFreeAsync(delta, stream));
}

}  // namespace

void attention::launch_delta(const bf16* out, const bf16* dout, float* delta, int64_t b, int64_t s,
                             int64_t hq, int64_t d, cudaStream_t stream) {
  const int64_t rows = b * s * hq;
  const int si = static_cast<int>(s), hqi = static_cast<int>(hq);
  if (d == 64) {
    PTDP_KERNEL_LAUNCH(flash_delta_kernel<64>, blocks_for(rows * 32, 256), 256, 0, stream)
    (out, dout, delta, rows, si, hqi);
  } else {
    PTDP_KERNEL_LAUNCH(flash_delta_kernel<128>, blocks_for(rows * 32, 256), 256, 0, stream)
    (out, dout, delta, rows, si, hqi);
  }
  check_launch("flash_delta_kernel");
}

void attention::simt_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                              const float* lse, const bf16* dout, bf16* dq, bf16* dk, bf16* dv,
                              int64_t b, int64_t s, int64_t sk, int64_t hq, int64_t hk, int64_t d,
                              cudaStream_t stream) {
  if (d == 64)
    backward<64>(q, k, v, out, lse, dout, dq, dk, dv, b, s, sk, hq, hk, stream);
  else
    backward<128>(q, k, v, out, lse, dout, dq, dk, dv, b, s, sk, hq, hk, stream);
}

}  // namespace ptdp::kernels::cuda
