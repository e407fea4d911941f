// Device twins of the CPU backend's fp32 kernels (runtime/cuda/fp32_kernels.h). Plain
// grid-stride loops for element-wise work, one block per row for row reductions, and for column
// sums the two-pass column_sum of kernels/cuda/common.cuh (fixed row chunks, each added in
// order), so results are deterministic. The kernels of
// the typed calls that mixed precision runs natively are templates on the storage type T of
// their activations (float, or bf16 loaded as fp32 and stored rounded to nearest even), with
// the same fp32 arithmetic for both.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <stdexcept>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/embedding.h"
#include "runtime/cuda/fp32_kernels.h"

namespace ptdp::cuda_fp32 {
namespace {

constexpr int kThreads = 256;
constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? (blocks > 0 ? blocks : 1) : 65535 * 16);
}

__device__ __forceinline__ int64_t first_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Block-wide reduction (blockDim.x == kThreads) by `op`, returned to every thread. The leading
// barrier lets consecutive calls reuse the shared array.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op) {
  __shared__ T sh[kThreads];
  __syncthreads();
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int o = kThreads / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) sh[threadIdx.x] = op(sh[threadIdx.x], sh[threadIdx.x + o]);
    __syncthreads();
  }
  return sh[0];
}
struct Sum {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
__device__ float block_sum(float v) {
  return block_reduce(v, Sum{});
}
__device__ float block_max(float v) {
  return block_reduce(v, Max{});
}

// Storage: fp32 as it is; bf16 widened on load (as_float, kernels/cuda/common.cuh) and rounded to
// nearest even on store, which is what widening to fp32, running the fp32 kernel and rounding
// back computes.
using kernels::cuda::as_float;
template <typename T>
__device__ __forceinline__ T store(float x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return kernels::cuda::to_bf16(x);
}

// ---- element-wise ----
// Sums are written x + y, the operand order nvcc gave `y += x`: the fp32 kernels compile as before.
template <typename T>
__global__ void add_k(T* y, const T* x, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride())
    y[i] = store<T>(as_float(x[i]) + as_float(y[i]));
}
template <typename T>
__global__ void add_bias_k(T* y, const T* bias, int64_t n, int64_t width) {
  for (int64_t i = first_index(); i < n; i += grid_stride())
    y[i] = store<T>(as_float(bias[i % width]) + as_float(y[i]));
}
// bf16 add and bias add, 8 elements at a time (kernels/cuda/common.cuh's vectorizable).
using kernels::cuda::Bf16x8;
using kernels::cuda::kVec;
__global__ void add_vec_k(Bf16x8* y, const Bf16x8* x, int64_t nvec) {
  for (int64_t i = first_index(); i < nvec; i += grid_stride()) {
    const Bf16x8 a = x[i];
    Bf16x8 b = y[i];
    for (int j = 0; j < kVec; ++j) b.v[j] = store<bf16>(as_float(a.v[j]) + as_float(b.v[j]));
    y[i] = b;
  }
}
__global__ void add_bias_vec_k(Bf16x8* y, const bf16* bias, int64_t nvec, int64_t width) {
  for (int64_t i = first_index(); i < nvec; i += grid_stride()) {
    const int64_t c = i * kVec % width;
    Bf16x8 b = y[i];
    for (int j = 0; j < kVec; ++j) b.v[j] = store<bf16>(as_float(bias[c + j]) + as_float(b.v[j]));
    y[i] = b;
  }
}
// db[c] += sum over rows of dy[r, c] (db fp32 whatever dy's type), through column_sum: one
// thread per column with rows in order left 4096-row column sums latency-bound (a quarter of a
// millisecond each on an H100, docs/gpu.md).
template <typename T>
struct ColumnOf {
  const T* dy;
  int64_t width;
  __device__ float operator()(int64_t r, int64_t c) const { return as_float(dy[r * width + c]); }
};
// The same for bf16 rows of a multiple of 8 columns, 8 a thread from one 16-byte load
// (kernels::cuda::column_sum_vec; the same sums to the bit).
struct ColumnsOfBf16 {
  static constexpr int kOutputs = 1;
  const bf16* dy;
  int64_t width;
  using In = Bf16x8;
  __device__ In load(int64_t r, int64_t c0) const {
    return *reinterpret_cast<const Bf16x8*>(dy + r * width + c0);
  }
  __device__ void operator()(int64_t, int64_t, const In& a, float (&v)[1][kVec]) const {
    for (int e = 0; e < kVec; ++e) v[0][e] = as_float(a.v[e]);
  }
};
// residual_add's backward (Backend::residual_add_backward): those column sums, with dy's vectors
// also stored to y0 and y1 from the same loads: dy read once where bias_grad and two copies read
// it three times. (A separate type: optional stores in ColumnsOfBf16 took bias_grad's kernel
// from 74 registers to 89.)
struct CopiedColumnsOfBf16 : ColumnsOfBf16 {
  bf16 *y0, *y1;
  __device__ void operator()(int64_t r, int64_t c0, const In& a, float (&v)[1][kVec]) const {
    *reinterpret_cast<Bf16x8*>(y0 + r * width + c0) = a;
    *reinterpret_cast<Bf16x8*>(y1 + r * width + c0) = a;
    ColumnsOfBf16::operator()(r, c0, a, v);
  }
};
// The bf16 kernels' own conversions (kernels/cuda/common.cuh).
__global__ void to_bf16_k(const float* x, kernels::cuda::bf16* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = kernels::cuda::to_bf16(x[i]);
}
__global__ void from_bf16_k(const kernels::cuda::bf16* x, float* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = kernels::cuda::to_float(x[i]);
}
// fp16 (--fp16 runs): round to nearest even, overflow to infinity, as the host's conversion.
__global__ void to_fp16_k(const float* x, __half* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = __float2half_rn(x[i]);
}
__global__ void from_fp16_k(const __half* x, float* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = __half2float(x[i]);
}
template <typename T>
__global__ void scale_k(T* x, int64_t n, double f) {
  for (int64_t i = first_index(); i < n; i += grid_stride())
    x[i] = store<T>(static_cast<float>(static_cast<double>(as_float(x[i])) * f));
}

// Copies (split, concatenation, sequence shards): T moves as it is.
template <typename T>
__global__ void split3_k(const T* x, T* y0, T* y1, T* y2, int64_t n, int64_t a, int64_t b,
                         int64_t c) {
  const int64_t w = a + b + c, total = n * w;
  for (int64_t i = first_index(); i < total; i += grid_stride()) {
    const int64_t r = i / w, col = i % w;
    if (col < a)
      y0[r * a + col] = x[i];
    else if (col < a + b)
      y1[r * b + col - a] = x[i];
    else
      y2[r * c + col - a - b] = x[i];
  }
}
template <typename T>
__global__ void concat3_k(const T* x0, const T* x1, const T* x2, T* y, int64_t n, int64_t a,
                          int64_t b, int64_t c) {
  const int64_t w = a + b + c, total = n * w;
  for (int64_t i = first_index(); i < total; i += grid_stride()) {
    const int64_t r = i / w, col = i % w;
    y[i] = col < a ? x0[r * a + col] : col < a + b ? x1[r * b + col - a] : x2[r * c + col - a - b];
  }
}
// The same two on 16-byte vectors of bf16 (V), by column and row group: a thread takes one
// vector column of the joined width w = a + b + c (in vectors), whose part and offset it finds
// with one 32-bit division, in kCopyRows consecutive rows, every load issued before the first
// store. (The flat loop above spent a 64-bit division and modulo on each vector, near an
// element-wise kernel's whole instruction budget at the copy bandwidth, and kept one vector in
// flight a thread.) `groups` = ceil(n / kCopyRows); groups * w < 2^31.
constexpr int kCopyRows = 4;
struct ColumnPart {  // where a column of the joined width lies: part, its width, its column
  int k;
  int64_t width, col;
};
__device__ __forceinline__ ColumnPart part_of(uint32_t col, uint32_t a, uint32_t b, uint32_t c) {
  if (col < a) return {0, a, col};
  if (col < a + b) return {1, b, col - a};
  return {2, c, col - a - b};
}
template <typename V>
__global__ void split3_rows_k(const V* x, V* y0, V* y1, V* y2, int64_t n, uint32_t a, uint32_t b,
                              uint32_t c, uint32_t groups) {
  const uint32_t w = a + b + c, total = groups * w;
  for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += gridDim.x * blockDim.x) {
    const uint32_t g = t / w, col = t - g * w;
    const ColumnPart p = part_of(col, a, b, c);
    V* y = p.k == 0 ? y0 : p.k == 1 ? y1 : y2;
    const int64_t r0 = static_cast<int64_t>(g) * kCopyRows;
    V v[kCopyRows];
#pragma unroll
    for (int u = 0; u < kCopyRows; ++u)
      if (r0 + u < n) v[u] = x[(r0 + u) * w + col];
#pragma unroll
    for (int u = 0; u < kCopyRows; ++u)
      if (r0 + u < n) y[(r0 + u) * p.width + p.col] = v[u];
  }
}
template <typename V>
__global__ void concat3_rows_k(const V* x0, const V* x1, const V* x2, V* y, int64_t n, uint32_t a,
                               uint32_t b, uint32_t c, uint32_t groups) {
  const uint32_t w = a + b + c, total = groups * w;
  for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += gridDim.x * blockDim.x) {
    const uint32_t g = t / w, col = t - g * w;
    const ColumnPart p = part_of(col, a, b, c);
    const V* x = p.k == 0 ? x0 : p.k == 1 ? x1 : x2;
    const int64_t r0 = static_cast<int64_t>(g) * kCopyRows;
    V v[kCopyRows];
#pragma unroll
    for (int u = 0; u < kCopyRows; ++u)
      if (r0 + u < n) v[u] = x[(r0 + u) * p.width + p.col];
#pragma unroll
    for (int u = 0; u < kCopyRows; ++u)
      if (r0 + u < n) y[(r0 + u) * w + col] = v[u];
  }
}
// The row-group kernels' launch where their 32-bit index fits (else the flat loop's).
bool copy_rows_fit(int64_t n, int64_t w) {
  return (n + kCopyRows - 1) / kCopyRows * w < (int64_t{1} << 31);
}
uint32_t copy_groups(int64_t n) {
  return static_cast<uint32_t>((n + kCopyRows - 1) / kCopyRows);
}

// full [b, s, width] <-> shards [t][b, s/t, width]; `to_full` picks the direction.
template <typename T>
__global__ void sequence_k(const T* src, T* dst, int64_t t, int64_t b, int64_t s, int64_t width,
                           bool to_full) {
  const int64_t sl = s / t, total = b * s * width;
  for (int64_t i = first_index(); i < total; i += grid_stride()) {
    const int64_t bi = i / (s * width), pos = (i / width) % s, e = i % width;
    const int64_t shard = ((pos / sl * b + bi) * sl + pos % sl) * width + e;
    if (to_full)
      dst[i] = src[shard];
    else
      dst[shard] = src[i];
  }
}

template <typename T>
__global__ void embedding_lookup_k(const int32_t* tokens, const T* table, T* y, int64_t n,
                                   int64_t h, int64_t v0, int64_t vl) {
  for (int64_t i = first_index(); i < n * h; i += grid_stride()) {
    const int64_t row = i / h, tok = tokens[row] - v0;
    y[i] = tok >= 0 && tok < vl ? table[tok * h + i % h] : store<T>(0.0f);
  }
}
template <typename T>
__global__ void add_positions_k(T* x, const T* pos, int64_t b, int64_t sl, int64_t h,
                                int64_t first) {
  const int64_t total = b * sl * h;
  for (int64_t i = first_index(); i < total; i += grid_stride()) {
    const int64_t j = (i / h) % sl, e = i % h;
    x[i] = store<T>(as_float(pos[(first + j) * h + e]) + as_float(x[i]));
  }
}
// dpos is fp32.
template <typename T>
__global__ void position_grad_k(const T* dx, float* dpos, int64_t b, int64_t sl, int64_t h,
                                int64_t first) {
  for (int64_t i = first_index(); i < sl * h; i += grid_stride()) {
    const int64_t j = i / h, e = i % h;
    float acc = dpos[(first + j) * h + e];
    for (int64_t bi = 0; bi < b; ++bi) acc += as_float(dx[(bi * sl + j) * h + e]);
    dpos[(first + j) * h + e] = acc;
  }
}

// The position add and gradient for bf16 rows 16 bytes at a time (h a multiple of 8, pointers
// 16-byte aligned), where the scalar kernels spent a 64-bit division or two on every 2-byte
// element. The same values: the positions add in fp32 and round, and the gradient adds the
// sequences onto dpos in the same order. (The bf16 lookup is kernels/cuda/embedding.h's.)
__global__ void add_positions_vec_k(Bf16x8* x, const Bf16x8* pos, int64_t b, int64_t sl, int64_t hv,
                                    int64_t first) {
  for (int64_t i = first_index(); i < b * sl * hv; i += grid_stride()) {
    const int64_t row = i / hv, j = row % sl, e = i - row * hv;
    const Bf16x8 p = pos[(first + j) * hv + e];
    Bf16x8 a = x[i];
    for (int k = 0; k < kVec; ++k) a.v[k] = store<bf16>(as_float(p.v[k]) + as_float(a.v[k]));
    x[i] = a;
  }
}
__global__ void position_grad_vec_k(const bf16* dx, float* dpos, int64_t b, int64_t sl, int64_t h,
                                    int64_t first) {
  const int64_t hv = h / kVec;
  for (int64_t i = first_index(); i < sl * hv; i += grid_stride()) {
    const int64_t j = i / hv, e = (i - j * hv) * kVec;
    float acc[kVec];
    kernels::cuda::load8(dpos + (first + j) * h + e, acc);
#pragma unroll 4  // 4 sequences' loads issued before their adds (in order: the same sums)
    for (int64_t bi = 0; bi < b; ++bi) {
      float v[kVec];
      kernels::cuda::load8(dx + (bi * sl + j) * h + e, v);
      for (int k = 0; k < kVec; ++k) acc[k] += v[k];
    }
    kernels::cuda::store8(dpos + (first + j) * h + e, acc);
  }
}

// ---- cross-entropy (logits T; statistics, lse and row losses fp32) ----
// A running (max, sum of exp(x - max)) pair, combined as the online softmax combines them: one
// pass over the logits instead of a max pass and a sum pass.
struct MaxSum {
  float m = -INFINITY, s = 0;
};
struct CombineMaxSum {
  __device__ MaxSum operator()(MaxSum a, MaxSum b) const {
    if (a.m == -INFINITY) return b;
    if (b.m == -INFINITY) return a;
    const float m = fmaxf(a.m, b.m);
    return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
  }
};
template <typename T>
__global__ void ce_stats_k(const T* logits, const int32_t* targets, float* stats, int64_t vl,
                           int64_t valid, int64_t v0) {
  const int64_t i = blockIdx.x;
  const T* row = logits + i * vl;
  MaxSum acc;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) {
    const float x = as_float(row[j]);
    if (x > acc.m) {
      acc.s = acc.s * expf(acc.m - x) + 1.0f;  // expf(-inf) = 0 on the first element
      acc.m = x;
    } else if (x > -INFINITY) {  // -inf adds nothing (and -inf - -inf would be NaN)
      acc.s += expf(x - acc.m);
    }
  }
  acc = block_reduce(acc, CombineMaxSum{});
  const float mx = acc.m, sum = acc.s;
  if (threadIdx.x == 0) {
    const int64_t tgt = targets[i] - v0;
    stats[i * 3] = valid > 0 ? mx : -INFINITY;
    stats[i * 3 + 1] = sum;
    stats[i * 3 + 2] = tgt >= 0 && tgt < valid ? as_float(row[tgt]) : 0.0f;
  }
}
// The statistics of bf16 rows of a multiple of 8 logits, 8 a vector
// (kernels::cuda::logit_stats_share).
__global__ void ce_stats_vec_k(const bf16* logits, const int32_t* targets, float* stats, int64_t vl,
                               int64_t valid, int64_t v0) {
  const int64_t i = blockIdx.x;
  const bf16* row = logits + i * vl;
  MaxSum acc;
  kernels::cuda::logit_stats_share(row, valid, true, acc.m, acc.s);
  acc = block_reduce(acc, CombineMaxSum{});
  if (threadIdx.x == 0) {
    const int64_t tgt = targets[i] - v0;
    stats[i * 3] = valid > 0 ? acc.m : -INFINITY;
    stats[i * 3 + 1] = acc.s;
    stats[i * 3 + 2] = tgt >= 0 && tgt < valid ? as_float(row[tgt]) : 0.0f;
  }
}
__global__ void ce_lse_k(const float* stats, int64_t ranks, float* lse, float* row_loss,
                         int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    float mx = -INFINITY;
    for (int64_t r = 0; r < ranks; ++r) mx = fmaxf(mx, stats[(r * n + i) * 3]);
    float sum = 0, target = 0;
    for (int64_t r = 0; r < ranks; ++r) {
      const float* st = stats + (r * n + i) * 3;
      sum += st[1] * expf(st[0] - mx);
      target += st[2];
    }
    lse[i] = mx + logf(sum);
    row_loss[i] = lse[i] - target;
  }
}
template <typename T>
__global__ void ce_probs_k(T* logits, const float* lse, int64_t n, int64_t vl, int64_t valid) {
  for (int64_t i = first_index(); i < n * vl; i += grid_stride()) {
    const int64_t j = i % vl;
    logits[i] = store<T>(j < valid ? expf(as_float(logits[i]) - lse[i / vl]) : 0.0f);
  }
}
template <typename T>
__global__ void ce_backward_k(T* probs, const int32_t* targets, int64_t n, int64_t vl, int64_t v0,
                              float f) {
  for (int64_t i = first_index(); i < n * vl; i += grid_stride()) {
    const int64_t row = i / vl, j = i % vl;
    float v = __fmul_rn(as_float(probs[i]), f);  // rounded, never fused with the - f
    if (targets[row] - v0 == j) v -= f;
    probs[i] = store<T>(v);
  }
}
// The same two for bf16 rows of a multiple of 8 (the vocabulary shard's width), 8 elements a
// vector: a division per 8 logits rather than per logit.
__global__ void ce_probs_vec_k(Bf16x8* logits, const float* lse, int64_t n, int64_t vl,
                               int64_t valid) {
  const int64_t per_row = vl / kVec;
  for (int64_t i = first_index(); i < n * per_row; i += grid_stride()) {
    const int64_t row = i / per_row, j0 = i % per_row * kVec;
    const float m = lse[row];
    Bf16x8 v = logits[i];
    for (int e = 0; e < kVec; ++e)
      v.v[e] = store<bf16>(j0 + e < valid ? expf(as_float(v.v[e]) - m) : 0.0f);
    logits[i] = v;
  }
}
// ce_probs_vec_k and then ce_backward_vec_k in one pass over the logits, a block a row (lse and
// the target loaded once, no division), kCeUnroll vectors of the row in flight a thread: the
// probability rounded to bf16 as the first stored it, then scaled and the target's f taken off,
// as the second did, so the same bits from two passes over the logits fewer.
constexpr int kCeUnroll = 4;
__global__ void ce_backward_from_lse_vec_k(Bf16x8* logits, const float* lse, const int32_t* targets,
                                           int64_t vl, int64_t valid, int64_t v0, float f) {
  const int64_t row = blockIdx.x, per_row = vl / kVec;
  Bf16x8* x = logits + row * per_row;
  const float m = lse[row];
  const int64_t target = targets[row] - v0;
  kernels::cuda::rewrite_vectors<kCeUnroll>(
      x, x, threadIdx.x, per_row, blockDim.x, kCeUnroll * blockDim.x, [&](int64_t c, Bf16x8& v) {
        for (int e = 0; e < kVec; ++e) {
          const int64_t j = c * kVec + e;
          const float p = as_float(store<bf16>(j < valid ? expf(as_float(v.v[e]) - m) : 0.0f));
          float g = __fmul_rn(p, f);
          if (target == j) g -= f;
          v.v[e] = store<bf16>(g);
        }
      });
}
__global__ void ce_backward_vec_k(Bf16x8* probs, const int32_t* targets, int64_t n, int64_t vl,
                                  int64_t v0, float f) {
  const int64_t per_row = vl / kVec;
  for (int64_t i = first_index(); i < n * per_row; i += grid_stride()) {
    const int64_t row = i / per_row, j0 = i % per_row * kVec;
    const int64_t target = targets[row] - v0;
    Bf16x8 v = probs[i];
    for (int e = 0; e < kVec; ++e) {
      float x = __fmul_rn(as_float(v.v[e]), f);
      if (target == j0 + e) x -= f;
      v.v[e] = store<bf16>(x);
    }
    probs[i] = v;
  }
}

// ---- norms ----
__global__ void layernorm_forward_k(const float* x, const float* g, const float* b, float* y,
                                    float* mean, float* rstd, int64_t h) {
  const int64_t i = blockIdx.x;
  const float* xi = x + i * h;
  float s = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) s += xi[j];
  const float mu = block_sum(s) / static_cast<float>(h);
  float v = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) v += (xi[j] - mu) * (xi[j] - mu);
  const float var = block_sum(v) / static_cast<float>(h);
  const float r = 1.0f / sqrtf(var + 1e-5f);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    y[i * h + j] = (xi[j] - mu) * r * g[j] + b[j];
  if (threadIdx.x == 0) {
    mean[i] = mu;
    rstd[i] = r;
  }
}
__global__ void layernorm_dx_k(const float* x, const float* g, const float* mean, const float* rstd,
                               const float* dy, float* dx, int64_t h) {
  const int64_t i = blockIdx.x;
  const float* xi = x + i * h;
  const float* dyi = dy + i * h;
  const float mu = mean[i], r = rstd[i];
  float s1 = 0, s2 = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float xhat = (xi[j] - mu) * r, dxhat = dyi[j] * g[j];
    s1 += dxhat;
    s2 += dxhat * xhat;
  }
  s1 = block_sum(s1);
  s2 = block_sum(s2);
  const float inv_h = 1.0f / static_cast<float>(h);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float xhat = (xi[j] - mu) * r, dxhat = dyi[j] * g[j];
    dx[i * h + j] = r * (dxhat - inv_h * s1 - xhat * inv_h * s2);
  }
}
// dg[j] += sum_i dy * xhat (through column_sum), and db[j] += sum_i dy (ColumnOf); xhat from
// mean (may be null: RMSNorm, xhat = x * rstd).
struct NormGammaOf {
  const float *x, *mean, *rstd, *dy;
  int64_t h;
  __device__ float operator()(int64_t i, int64_t j) const {
    const float xv = x[i * h + j];
    const float xhat = mean ? (xv - mean[i]) * rstd[i] : xv * rstd[i];
    return dy[i * h + j] * xhat;
  }
};
__global__ void rmsnorm_forward_k(const float* x, const float* g, float* y, float* rstd,
                                  int64_t h) {
  const int64_t i = blockIdx.x;
  const float* xi = x + i * h;
  float s = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) s += xi[j] * xi[j];
  const float r = 1.0f / sqrtf(block_sum(s) / static_cast<float>(h) + 1e-5f);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) y[i * h + j] = xi[j] * r * g[j];
  if (threadIdx.x == 0) rstd[i] = r;
}
__global__ void rmsnorm_dx_k(const float* x, const float* g, const float* rstd, const float* dy,
                             float* dx, int64_t h) {
  const int64_t i = blockIdx.x;
  const float* xi = x + i * h;
  const float* dyi = dy + i * h;
  float dot = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) dot += dyi[j] * g[j] * xi[j];
  dot = block_sum(dot);
  const float r = rstd[i];
  const float c = r * r * r * dot / static_cast<float>(h);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    dx[i * h + j] = dyi[j] * g[j] * r - xi[j] * c;
}

// ---- activations ----
__global__ void gelu_k(const float* x, float* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float v = x[i];
    const float u = static_cast<float>(kGeluC) * (v + 0.044715f * v * v * v);
    y[i] = 0.5f * v * (1.0f + tanhf(u));
  }
}
__global__ void gelu_backward_k(const float* x, const float* dy, float* dx, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float v = x[i];
    const float u = static_cast<float>(kGeluC) * (v + 0.044715f * v * v * v);
    const float th = tanhf(u);
    const float du = static_cast<float>(kGeluC) * (1.0f + static_cast<float>(3 * 0.044715) * v * v);
    dx[i] = dy[i] * (0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du);
  }
}
__global__ void swiglu_k(const float* x, float* y, int64_t n, int64_t f) {
  for (int64_t i = first_index(); i < n * f; i += grid_stride()) {
    const int64_t r = i / f, j = i % f;
    const float g = x[r * 2 * f + j], u = x[r * 2 * f + f + j];
    y[i] = g / (1.0f + expf(-g)) * u;
  }
}
__global__ void swiglu_backward_k(const float* x, const float* dy, float* dx, int64_t n,
                                  int64_t f) {
  for (int64_t i = first_index(); i < n * f; i += grid_stride()) {
    const int64_t r = i / f, j = i % f;
    const float g = x[r * 2 * f + j], u = x[r * 2 * f + f + j];
    const float sig = 1.0f / (1.0f + expf(-g));
    dx[r * 2 * f + j] = dy[i] * u * sig * (1.0f + g * (1.0f - sig));
    dx[r * 2 * f + f + j] = dy[i] * g * sig;
  }
}
template <typename T>
__global__ void rope_k(T* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base,
                       bool inverse) {
  const int64_t half = d / 2, total = b * s * heads * half;
  for (int64_t idx = first_index(); idx < total; idx += grid_stride()) {
    const int64_t i = idx % half, vec = idx / half;  // vec: (bi * s + j) * heads + hd
    const int64_t j = (vec / heads) % s;
    const double angle =
        static_cast<double>(j) * pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
    const float c = static_cast<float>(cos(angle));
    const float sn = static_cast<float>(inverse ? -sin(angle) : sin(angle));
    T* v = x + vec * d;
    const float x1 = as_float(v[i]), x2 = as_float(v[i + half]);
    v[i] = store<T>(x1 * c - x2 * sn);
    v[i + half] = store<T>(x2 * c + x1 * sn);
  }
}

// ---- attention pieces ----
template <typename T>
__global__ void causal_softmax_k(T* scores, int64_t s) {
  const int64_t row = blockIdx.x, i = row % s;
  T* p = scores + row * s;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, as_float(p[j]));
  mx = block_max(mx);
  float sum = 0;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) sum += expf(as_float(p[j]) - mx);
  sum = block_sum(sum);
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x)
    p[j] = store<T>(expf(as_float(p[j]) - mx) / sum);
}
template <typename T>
__global__ void causal_softmax_backward_k(const T* probs, const T* dprobs, T* dscores, int64_t s) {
  const int64_t row = blockIdx.x, i = row % s;
  const T* p = probs + row * s;
  const T* dp = dprobs + row * s;
  float dot = 0;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) dot += as_float(p[j]) * as_float(dp[j]);
  dot = block_sum(dot);
  for (int64_t j = threadIdx.x; j < s; j += blockDim.x)
    dscores[row * s + j] = store<T>(j <= i ? as_float(p[j]) * (as_float(dp[j]) - dot) : 0.0f);
}
template <typename T>
__global__ void zero_upper_k(T* m, int64_t total, int64_t s) {
  for (int64_t idx = first_index(); idx < total; idx += grid_stride())
    if (idx % s > (idx / s) % s) m[idx] = store<T>(0.0f);
}

// AdamW (the CPU twin's arithmetic: double, moments rounded to fp32), fused with the gradient's
// scale before it and the new weights' copy after it (Backend::adamw_update): one pass instead
// of three. The scaled gradient is rounded to fp32 as Backend::scale leaves it, so the update is
// the three calls' arithmetic; out (may be null) receives the new weights stored as T. With
// grad_scale 1 and no out, it is plain adamw. One element: m and v updated in place, the new
// weight returned.
__device__ __forceinline__ float adamw_math(float grad, float& m, float& v, float param,
                                            const AdamWArgs& a, double weight_decay,
                                            double grad_scale) {
  const double g =
      grad_scale == 1.0 ? grad : static_cast<float>(static_cast<double>(grad) * grad_scale);
  m = static_cast<float>(a.beta1 * m + (1 - a.beta1) * g);
  v = static_cast<float>(a.beta2 * v + (1 - a.beta2) * g * g);
  const double mhat = m / a.c1, vhat = v / a.c2;
  const double p = param;
  return static_cast<float>(p - a.lr * (mhat / (sqrt(vhat) + a.eps) + weight_decay * p));
}
// A launch's spans, adjacent and in order: span s is [start[s], start[s + 1]), with decay[s].
// The table is a kernel argument (about 0.6 KB), copied to shared memory by each block.
struct AdamWSpans {
  int count = 0;
  int64_t start[kAdamWSpans + 1] = {};
  bool decay[kAdamWSpans] = {};
};
// 4 bf16, the new weights' copy of a vector of 4 fp32 (8 bytes).
struct alignas(8) Bf16x4 {
  bf16 v[4];
};
__device__ __forceinline__ void store_quad(float* out, const float (&p)[4]) {
  *reinterpret_cast<float4*>(out) = make_float4(p[0], p[1], p[2], p[3]);
}
__device__ __forceinline__ void store_quad(bf16* out, const float (&p)[4]) {
  Bf16x4 q;
  for (int e = 0; e < 4; ++e) q.v[e] = store<bf16>(p[e]);
  *reinterpret_cast<Bf16x4*>(out) = q;
}
// With `vectors`: elements [first + 4u, first + 4u + 4) for u over the grid, those within the
// spans, where every array's element first + 4u starts a 16-byte vector (8 bytes for a bf16
// out). A quad wholly inside the spans moves as one float4 an array, its 4 loads issued before
// the span lookup and the arithmetic (the scalar loop left the step's optimizer at about half
// the copy bandwidth on an H200, docs/gpu.md); the quads at the ends go element by element.
// Without: element first + u, one a thread. Same arithmetic either way.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    adamw_spans_k(float* param, const float* grad, float* m, float* v, T* out, AdamWSpans t,
                  int64_t first, int64_t quads, bool vectors, AdamWArgs a, double grad_scale) {
  __shared__ int64_t start[kAdamWSpans + 1];
  __shared__ bool decay[kAdamWSpans];
  for (int s = threadIdx.x; s <= t.count; s += blockDim.x) {
    start[s] = t.start[s];
    if (s < t.count) decay[s] = t.decay[s];
  }
  __syncthreads();
  const int64_t lo = start[0], hi = start[t.count];
  auto span_of = [&](int64_t i) {  // the last span starting at or before i
    int l = 0, h = t.count - 1;
    while (l < h) {
      const int mid = (l + h + 1) / 2;
      if (start[mid] <= i)
        l = mid;
      else
        h = mid - 1;
    }
    return l;
  };
  auto rate = [&](int s) { return decay[s] ? a.weight_decay : 0.0; };
  for (int64_t u = first_index(); u < quads; u += grid_stride()) {
    const int64_t i0 = first + (vectors ? 4 * u : u);
    if (vectors && i0 >= lo && i0 + 4 <= hi) {
      const float4 g4 = *reinterpret_cast<const float4*>(grad + i0);
      const float4 m4 = *reinterpret_cast<const float4*>(m + i0);
      const float4 v4 = *reinterpret_cast<const float4*>(v + i0);
      const float4 p4 = *reinterpret_cast<const float4*>(param + i0);
      const float g[4] = {g4.x, g4.y, g4.z, g4.w}, w[4] = {p4.x, p4.y, p4.z, p4.w};
      float mm[4] = {m4.x, m4.y, m4.z, m4.w}, vv[4] = {v4.x, v4.y, v4.z, v4.w}, np[4];
      int s = span_of(i0);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (i0 + e >= start[s + 1]) ++s;  // (spans are not empty)
        np[e] = adamw_math(g[e], mm[e], vv[e], w[e], a, rate(s), grad_scale);
      }
      store_quad(m + i0, mm);
      store_quad(v + i0, vv);
      store_quad(param + i0, np);
      if (out) store_quad(out + i0, np);
    } else {
      const int64_t end = i0 + (vectors ? 4 : 1);
      for (int64_t i = i0 < lo ? lo : i0; i < end && i < hi; ++i) {
        float mi = m[i], vi = v[i];
        const float np = adamw_math(grad[i], mi, vi, param[i], a, rate(span_of(i)), grad_scale);
        m[i] = mi;
        v[i] = vi;
        param[i] = np;
        if (out) out[i] = store<T>(np);
      }
    }
  }
}

// The MoE row moves, one block per output row, the columns over its threads: a gather of rows
// (scaled), a token's rows added in its index order (fp32, rounded once), and a row's dot
// product (double, as the CPU twin sums). Rows of T: fp32, or bf16 loaded as fp32 and stored
// rounded. The scalar kernels take any width; the *_vec ones below 16 bytes at a time.
template <typename T>
__global__ void gather_rows_k(const T* x, const int64_t* index, const float* weight, T* y,
                              int64_t h) {
  const int64_t r = blockIdx.x;
  const T* from = x + index[r] * h;
  T* to = y + r * h;
  if (weight) {
    const float w = weight[r];
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) to[c] = store<T>(w * as_float(from[c]));
  } else {
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) to[c] = from[c];
  }
}
template <typename T>
__global__ void gather_add_rows_k(const T* y, const int64_t* index, const float* weight, T* out,
                                  int64_t slots, int64_t h) {
  const int64_t i = blockIdx.x;
  const int64_t* rows = index + i * slots;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    float o = as_float(out[i * h + c]);
    for (int64_t j = 0; j < slots; ++j) {
      if (rows[j] < 0) continue;
      const float w = weight ? weight[i * slots + j] : 1.0f;  // 1 * x is x exactly
      o += w * as_float(y[rows[j] * h + c]);
    }
    out[i * h + c] = store<T>(o);
  }
}

// ---- the same moves 16 bytes at a time (8 bf16 or 4 fp32; rows a whole number of them and
// 16-byte aligned: row_vectors): the scalar kernels' 2-byte accesses moved a third (unpermute)
// to under half (permute) of an H200's copy bandwidth on the bench's bf16 rows of 4096. A thread
// issues every load of kRowUnroll vectors (and, adding, of every slot's row) before it stores,
// since the compiler may not move a load above a store that might alias it. Same arithmetic in
// the same order as the scalar kernels, so the same bits. ----
template <typename T>
struct alignas(16) Pack {
  static constexpr int kN = 16 / static_cast<int>(sizeof(T));
  T v[kN];
};
constexpr int kRowUnroll = 4;
// The threads of a block for a row of `vecs` vectors, `per` a thread: whole warps, from one to
// kThreads / 32. (A row of 4096 bf16 is 512 vectors: 128 threads of 4, where a fixed 256 had 2
// each, and twice the blocks an SM.)
unsigned row_threads(int64_t vecs, int per) {
  const int64_t warps = ((vecs + per - 1) / per + 31) / 32;
  return static_cast<unsigned>(32 * (warps < 1               ? 1
                                     : warps < kThreads / 32 ? warps
                                                             : kThreads / 32));
}
// Whether rows of h elements of T at these pointers can move as Pack<T>.
template <typename T>
bool row_vectors(int64_t h, std::initializer_list<const void*> pointers) {
  if (h % Pack<T>::kN != 0) return false;
  for (const void* p : pointers)
    if (p && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

template <typename T>
__global__ void gather_rows_vec_k(const T* x, const int64_t* index, const float* weight, T* y,
                                  int64_t h) {
  using P = Pack<T>;
  const int64_t r = blockIdx.x, vecs = h / P::kN;
  const P* from = reinterpret_cast<const P*>(x + index[r] * h);
  P* to = reinterpret_cast<P*>(y + r * h);
  const float w = weight ? weight[r] : 1.0f;
  kernels::cuda::rewrite_vectors<kRowUnroll>(from, to, threadIdx.x, vecs, blockDim.x,
                                             kRowUnroll * blockDim.x, [&](int64_t, P& v) {
                                               if (weight)
                                                 for (int e = 0; e < P::kN; ++e)
                                                   v.v[e] = store<T>(w * as_float(v.v[e]));
                                             });
}

// A token's slots (row index and weight) are read once into shared memory: at most
// kMaxVecSlots of them (MoE routes a token to a handful of experts; more take the scalar kernel).
constexpr int64_t kMaxVecSlots = 64;
constexpr int kAddUnroll = 2;
template <typename T>
__global__ void gather_add_rows_vec_k(const T* y, const int64_t* index, const float* weight, T* out,
                                      int64_t slots, int64_t h) {
  using P = Pack<T>;
  __shared__ int64_t row_of[kMaxVecSlots];
  __shared__ float weight_of[kMaxVecSlots];
  const int64_t i = blockIdx.x, vecs = h / P::kN;
  for (int64_t j = threadIdx.x; j < slots; j += blockDim.x) {
    row_of[j] = index[i * slots + j];
    weight_of[j] = weight ? weight[i * slots + j] : 1.0f;  // 1 * x is x exactly
  }
  __syncthreads();
  P* o = reinterpret_cast<P*>(out + i * h);
  const P* yv = reinterpret_cast<const P*>(y);
  for (int64_t c0 = threadIdx.x; c0 < vecs; c0 += kAddUnroll * blockDim.x) {
    float acc[kAddUnroll][P::kN] = {};
#pragma unroll
    for (int u = 0; u < kAddUnroll; ++u) {
      if (c0 + u * blockDim.x >= vecs) continue;
      const P a = o[c0 + u * blockDim.x];
      for (int e = 0; e < P::kN; ++e) acc[u][e] = as_float(a.v[e]);
    }
    for (int64_t j = 0; j < slots; ++j) {
      const int64_t row = row_of[j];
      if (row < 0) continue;
      const float w = weight_of[j];
      P v[kAddUnroll]{};
#pragma unroll
      for (int u = 0; u < kAddUnroll; ++u)
        if (c0 + u * blockDim.x < vecs) v[u] = yv[row * vecs + c0 + u * blockDim.x];
#pragma unroll
      for (int u = 0; u < kAddUnroll; ++u)
        for (int e = 0; e < P::kN; ++e) acc[u][e] += w * as_float(v[u].v[e]);
    }
#pragma unroll
    for (int u = 0; u < kAddUnroll; ++u) {
      if (c0 + u * blockDim.x >= vecs) continue;
      P a;
      for (int e = 0; e < P::kN; ++e) a.v[e] = store<T>(acc[u][e]);
      o[c0 + u * blockDim.x] = a;
    }
  }
}
// The same for a token of at most kSlots slots (MoE's top-1, top-2 and top-4): every load of
// the output's vectors and of each slot's rows is issued before the first add, where the loop
// above waits for each slot's in turn. Slots are read straight from `index`, with no shared
// memory or barrier. Same adds in the same order, so the same bits.
template <typename T, int kSlots>
__global__ void gather_add_rows_few_k(const T* y, const int64_t* index, const float* weight, T* out,
                                      int64_t slots, int64_t h) {
  using P = Pack<T>;
  const int64_t i = blockIdx.x, vecs = h / P::kN;
  int64_t row_of[kSlots];
  float weight_of[kSlots];
#pragma unroll
  for (int j = 0; j < kSlots; ++j) {
    row_of[j] = j < slots ? index[i * slots + j] : -1;
    weight_of[j] = j < slots && weight ? weight[i * slots + j] : 1.0f;  // 1 * x is x exactly
  }
  P* o = reinterpret_cast<P*>(out + i * h);
  const P* yv = reinterpret_cast<const P*>(y);
  for (int64_t c0 = threadIdx.x; c0 < vecs; c0 += kAddUnroll * blockDim.x) {
    P a[kAddUnroll]{}, v[kSlots][kAddUnroll]{};
#pragma unroll
    for (int u = 0; u < kAddUnroll; ++u) {
      const int64_t c = c0 + u * blockDim.x;
      if (c >= vecs) continue;
      a[u] = o[c];
#pragma unroll
      for (int j = 0; j < kSlots; ++j)
        if (row_of[j] >= 0) v[j][u] = yv[row_of[j] * vecs + c];
    }
#pragma unroll
    for (int u = 0; u < kAddUnroll; ++u) {
      const int64_t c = c0 + u * blockDim.x;
      if (c >= vecs) continue;
      float acc[P::kN];
      for (int e = 0; e < P::kN; ++e) acc[e] = as_float(a[u].v[e]);
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        if (row_of[j] < 0) continue;
        for (int e = 0; e < P::kN; ++e) acc[e] += weight_of[j] * as_float(v[j][u].v[e]);
      }
      P r;
      for (int e = 0; e < P::kN; ++e) r.v[e] = store<T>(acc[e]);
      o[c] = r;
    }
  }
}
template <typename T>
__global__ void row_dots_k(const T* a, const int64_t* index, const T* b, float* dot, int64_t h) {
  const int64_t r = blockIdx.x;
  const T* u = a + index[r] * h;
  const T* v = b + r * h;
  double s = 0;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x)
    s += static_cast<double>(as_float(u[c])) * as_float(v[c]);
  s = block_reduce(s, Sum{});
  if (threadIdx.x == 0) dot[r] = static_cast<float>(s);
}

unsigned rows_grid(int64_t rows) {
  if (rows > 2147483647) throw std::invalid_argument("too many rows for one launch");
  return static_cast<unsigned>(rows);
}

}  // namespace

#define PTDP_LAUNCH(kernel, grid, ...)                                                \
  do {                                                                                \
    if ((grid) > 0) PTDP_KERNEL_LAUNCH(kernel, (grid), kThreads, 0, st)(__VA_ARGS__); \
    kernels::cuda::check_launch(#kernel);                                             \
  } while (0)

// The launchers of the templated kernels, for either storage type; the fp32 and bf16 entry
// points below forward to them.
namespace {

// Whether a storage type T's rows of `cols` (a multiple of kVec) at these pointers go through
// the 16-byte-vector kernels: bf16 only, rows and pointers as kernels/cuda/common.cuh's
// vectorizable wants. The split and concat run their kernels on Bf16x8 elements, every width
// divided by kVec.
template <typename T>
bool bf16_vectors(int64_t cols, std::initializer_list<const void*> pointers) {
  if constexpr (std::is_same_v<T, bf16>)
    return kernels::cuda::vectorizable(cols, pointers);
  else
    return false;
}

// Backend::residual_add in one pass: out = residual + partial, rounded to T, then + bias[column],
// rounded to T. These are the bits of the copy, add and add_bias that it replaces, which moved
// the stream seven times where this moves it three (or four with the bias). The vector kernel
// takes 16-byte vectors of a column in kResidualRows rows a thread, their loads issued before the
// first store; out may alias residual or partial (a thread reads its elements before it writes
// them).
template <typename T>
__global__ void residual_add_k(T* out, const T* residual, const T* partial, const T* bias,
                               int64_t n, int64_t width) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const T s = store<T>(as_float(partial[i]) + as_float(residual[i]));
    out[i] = bias ? store<T>(as_float(bias[i % width]) + as_float(s)) : s;
  }
}
constexpr int kResidualRows = 4;
template <typename T>
__global__ void __launch_bounds__(kThreads)
    residual_add_vec_k(T* out, const T* residual, const T* partial, const T* bias, int64_t rows,
                       int64_t width) {
  using P = Pack<T>;
  const int64_t cv = width / P::kN, units = (rows + kResidualRows - 1) / kResidualRows * cv;
  const P *rv = reinterpret_cast<const P*>(residual), *pv = reinterpret_cast<const P*>(partial);
  P* ov = reinterpret_cast<P*>(out);
  for (int64_t u = first_index(); u < units; u += grid_stride()) {
    const int64_t g = u / cv, c = u - g * cv, r0 = g * kResidualRows;
    P a[kResidualRows]{}, b[kResidualRows]{}, bv{};
#pragma unroll
    for (int k = 0; k < kResidualRows; ++k)
      if (r0 + k < rows) a[k] = rv[(r0 + k) * cv + c], b[k] = pv[(r0 + k) * cv + c];
    if (bias) bv = reinterpret_cast<const P*>(bias)[c];
#pragma unroll
    for (int k = 0; k < kResidualRows; ++k) {
      if (r0 + k >= rows) continue;
      P o;
      for (int j = 0; j < P::kN; ++j) {
        const T s = store<T>(as_float(b[k].v[j]) + as_float(a[k].v[j]));
        o.v[j] = bias ? store<T>(as_float(bv.v[j]) + as_float(s)) : s;
      }
      ov[(r0 + k) * cv + c] = o;
    }
  }
}
template <typename T>
void residual_add_t(T* out, const T* residual, const T* partial, const T* bias, int64_t rows,
                    int64_t width, cudaStream_t st) {
  const int64_t n = rows * width;
  if (n <= 0) return;
  if (row_vectors<T>(width, {out, residual, partial, bias})) {
    const int64_t units = (rows + kResidualRows - 1) / kResidualRows * (width / Pack<T>::kN);
    PTDP_LAUNCH(residual_add_vec_k<T>, grid_for(units), out, residual, partial, bias, rows, width);
    return;
  }
  PTDP_LAUNCH(residual_add_k<T>, grid_for(n), out, residual, partial, bias, n, width);
}

// residual_add's backward without a bias: dout read once, stored twice, 16 bytes at a time.
template <typename T>
__global__ void copy_twice_vec_k(const Pack<T>* x, Pack<T>* y0, Pack<T>* y1, int64_t nvec) {
  for (int64_t i = first_index(); i < nvec; i += grid_stride()) {
    const Pack<T> a = x[i];
    y0[i] = a;
    y1[i] = a;
  }
}
// Backend::residual_add_backward in one pass where it can: the bias gradient's column sums with
// the two copies (bf16 rows of a multiple of 8 columns), or the two copies alone (any type, 16
// bytes at a time). False, nothing queued, elsewhere.
template <typename T>
bool residual_add_backward_t(const T* dout, T* d_residual, T* d_partial, float* db, int64_t rows,
                             int64_t width, cudaStream_t st) {
  const int64_t n = rows * width;
  if (db) {
    if constexpr (std::is_same_v<T, bf16>) {
      if (!bf16_vectors<bf16>(width, {dout, d_residual, d_partial})) return false;
      kernels::cuda::column_sum_vec(CopiedColumnsOfBf16{{dout, width}, d_residual, d_partial}, {db},
                                    rows, width, st);
      return true;
    }
    return false;
  }
  if (!row_vectors<T>(n, {dout, d_residual, d_partial})) return false;
  if (n > 0)
    PTDP_LAUNCH(copy_twice_vec_k<T>, grid_for(n / Pack<T>::kN),
                reinterpret_cast<const Pack<T>*>(dout), reinterpret_cast<Pack<T>*>(d_residual),
                reinterpret_cast<Pack<T>*>(d_partial), n / Pack<T>::kN);
  return true;
}

template <typename T>
void add_t(T* y, const T* x, int64_t n, cudaStream_t st) {
  if (n <= 0) return;
  if (bf16_vectors<T>(n, {y, x})) {
    PTDP_LAUNCH(add_vec_k, grid_for(n / kVec), reinterpret_cast<Bf16x8*>(y),
                reinterpret_cast<const Bf16x8*>(x), n / kVec);
    return;
  }
  PTDP_LAUNCH(add_k<T>, grid_for(n), y, x, n);
}
template <typename T>
void add_bias_t(T* y, const T* bias, int64_t rows, int64_t width, cudaStream_t st) {
  if (rows * width <= 0) return;
  if (bf16_vectors<T>(width, {y, bias})) {
    PTDP_LAUNCH(add_bias_vec_k, grid_for(rows * width / kVec), reinterpret_cast<Bf16x8*>(y),
                reinterpret_cast<const bf16*>(bias), rows * width / kVec, width);  // T is bf16
    return;
  }
  PTDP_LAUNCH(add_bias_k<T>, grid_for(rows * width), y, bias, rows * width, width);
}
template <typename T>
void bias_grad_t(const T* dy, float* db, int64_t rows, int64_t width, cudaStream_t st) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (bf16_vectors<T>(width, {dy})) {
      kernels::cuda::column_sum_vec(ColumnsOfBf16{dy, width}, {db}, rows, width, st);
      return;
    }
  }
  kernels::cuda::column_sum(ColumnOf<T>{dy, width}, db, rows, width, st);
}
template <typename T>
void scale_t(T* x, int64_t n, double f, cudaStream_t st) {
  if (n > 0) PTDP_LAUNCH(scale_k<T>, grid_for(n), x, n, f);
}
template <typename T>
void split_columns3_t(const T* x, T* y0, T* y1, T* y2, int64_t n, int64_t a, int64_t b, int64_t c,
                      cudaStream_t st) {
  if (n * (a + b + c) <= 0) return;
  if (bf16_vectors<T>(a, {x, y0, y1, y2}) && b % kVec == 0 && c % kVec == 0) {
    using V = Bf16x8;
    const int64_t w = (a + b + c) / kVec;
    if (copy_rows_fit(n, w)) {
      PTDP_LAUNCH(split3_rows_k<V>, grid_for(copy_groups(n) * w), reinterpret_cast<const V*>(x),
                  reinterpret_cast<V*>(y0), reinterpret_cast<V*>(y1), reinterpret_cast<V*>(y2), n,
                  static_cast<uint32_t>(a / kVec), static_cast<uint32_t>(b / kVec),
                  static_cast<uint32_t>(c / kVec), copy_groups(n));
      return;
    }
    PTDP_LAUNCH(split3_k<V>, grid_for(n * (a + b + c) / kVec), reinterpret_cast<const V*>(x),
                reinterpret_cast<V*>(y0), reinterpret_cast<V*>(y1), reinterpret_cast<V*>(y2), n,
                a / kVec, b / kVec, c / kVec);
    return;
  }
  PTDP_LAUNCH(split3_k<T>, grid_for(n * (a + b + c)), x, y0, y1, y2, n, a, b, c);
}
template <typename T>
void concat_columns3_t(const T* x0, const T* x1, const T* x2, T* y, int64_t n, int64_t a, int64_t b,
                       int64_t c, cudaStream_t st) {
  if (n * (a + b + c) <= 0) return;
  if (bf16_vectors<T>(a, {x0, x1, x2, y}) && b % kVec == 0 && c % kVec == 0) {
    using V = Bf16x8;
    const int64_t w = (a + b + c) / kVec;
    if (copy_rows_fit(n, w)) {
      PTDP_LAUNCH(concat3_rows_k<V>, grid_for(copy_groups(n) * w), reinterpret_cast<const V*>(x0),
                  reinterpret_cast<const V*>(x1), reinterpret_cast<const V*>(x2),
                  reinterpret_cast<V*>(y), n, static_cast<uint32_t>(a / kVec),
                  static_cast<uint32_t>(b / kVec), static_cast<uint32_t>(c / kVec), copy_groups(n));
      return;
    }
    PTDP_LAUNCH(concat3_k<V>, grid_for(n * (a + b + c) / kVec), reinterpret_cast<const V*>(x0),
                reinterpret_cast<const V*>(x1), reinterpret_cast<const V*>(x2),
                reinterpret_cast<V*>(y), n, a / kVec, b / kVec, c / kVec);
    return;
  }
  PTDP_LAUNCH(concat3_k<T>, grid_for(n * (a + b + c)), x0, x1, x2, y, n, a, b, c);
}
template <typename T>
void sequence_t(const T* src, T* dst, int64_t t, int64_t b, int64_t s, int64_t width, bool to_full,
                cudaStream_t st) {
  if (b * s * width > 0)
    PTDP_LAUNCH(sequence_k<T>, grid_for(b * s * width), src, dst, t, b, s, width, to_full);
}
template <typename T>
void vocab_embedding_lookup_t(const int32_t* tokens, const T* table, T* y, int64_t n, int64_t h,
                              int64_t v0, int64_t vl, cudaStream_t st) {
  if (n * h <= 0) return;
  if constexpr (std::is_same_v<T, bf16>)  // a copy of rows (zeros off the shard): the kernels'
    kernels::cuda::embedding_forward(tokens, table, nullptr, y, 1, n, h, v0, vl, 0, st);
  else
    PTDP_LAUNCH(embedding_lookup_k<T>, grid_for(n * h), tokens, table, y, n, h, v0, vl);
}
template <typename T>
void add_positions_t(T* x, const T* pos, int64_t b, int64_t sl, int64_t h, int64_t first,
                     cudaStream_t st) {
  if (b * sl * h <= 0) return;
  if (bf16_vectors<T>(h, {x, pos})) {
    PTDP_LAUNCH(add_positions_vec_k, grid_for(b * sl * h / kVec), reinterpret_cast<Bf16x8*>(x),
                reinterpret_cast<const Bf16x8*>(pos), b, sl, h / kVec, first);
    return;
  }
  PTDP_LAUNCH(add_positions_k<T>, grid_for(b * sl * h), x, pos, b, sl, h, first);
}
template <typename T>
void position_grad_t(const T* dx, float* dpos, int64_t b, int64_t sl, int64_t h, int64_t first,
                     cudaStream_t st) {
  if (sl * h <= 0) return;
  if (bf16_vectors<T>(h, {dx, dpos})) {
    PTDP_LAUNCH(position_grad_vec_k, grid_for(sl * h / kVec), reinterpret_cast<const bf16*>(dx),
                dpos, b, sl, h, first);
    return;
  }
  PTDP_LAUNCH(position_grad_k<T>, grid_for(sl * h), dx, dpos, b, sl, h, first);
}
template <typename T>
void cross_entropy_stats_t(const T* logits, const int32_t* targets, float* stats, int64_t n,
                           int64_t vl, int64_t valid, int64_t v0, cudaStream_t st) {
  if (n <= 0) return;
  if (bf16_vectors<T>(vl, {logits})) {
    PTDP_LAUNCH(ce_stats_vec_k, rows_grid(n), reinterpret_cast<const bf16*>(logits), targets, stats,
                vl, valid, v0);
    return;
  }
  PTDP_LAUNCH(ce_stats_k<T>, rows_grid(n), logits, targets, stats, vl, valid, v0);
}
template <typename T>
void cross_entropy_finish_t(const float* stats, int64_t ranks, T* logits, float* lse,
                            float* row_loss, int64_t n, int64_t vl, int64_t valid,
                            cudaStream_t st) {
  if (n <= 0) return;
  PTDP_LAUNCH(ce_lse_k, grid_for(n), stats, ranks, lse, row_loss, n);
  if (vl <= 0) return;
  if (bf16_vectors<T>(vl, {logits})) {
    PTDP_LAUNCH(ce_probs_vec_k, grid_for(n * vl / kVec), reinterpret_cast<Bf16x8*>(logits), lse, n,
                vl, valid);
    return;
  }
  PTDP_LAUNCH(ce_probs_k<T>, grid_for(n * vl), logits, lse, n, vl, valid);
}
template <typename T>
void cross_entropy_backward_t(T* probs, const int32_t* targets, int64_t n, int64_t vl, int64_t v0,
                              double scale, cudaStream_t st) {
  if (n * vl <= 0) return;
  const float f = static_cast<float>(scale / static_cast<double>(n));
  if (bf16_vectors<T>(vl, {probs})) {
    PTDP_LAUNCH(ce_backward_vec_k, grid_for(n * vl / kVec), reinterpret_cast<Bf16x8*>(probs),
                targets, n, vl, v0, f);
    return;
  }
  PTDP_LAUNCH(ce_backward_k<T>, grid_for(n * vl), probs, targets, n, vl, v0, f);
}
template <typename T>
void rope_t(T* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base, bool inverse,
            cudaStream_t st) {
  if (b * s * heads * (d / 2) > 0)
    PTDP_LAUNCH(rope_k<T>, grid_for(b * s * heads * (d / 2)), x, b, s, heads, d, base, inverse);
}
template <typename T>
void causal_softmax_t(T* scores, int64_t rows, int64_t s, cudaStream_t st) {
  if (rows * s > 0) PTDP_LAUNCH(causal_softmax_k<T>, rows_grid(rows * s), scores, s);
}
template <typename T>
void causal_softmax_backward_t(const T* probs, const T* dprobs, T* dscores, int64_t rows, int64_t s,
                               cudaStream_t st) {
  if (rows * s > 0)
    PTDP_LAUNCH(causal_softmax_backward_k<T>, rows_grid(rows * s), probs, dprobs, dscores, s);
}
template <typename T>
void zero_upper_t(T* m, int64_t count, int64_t s, cudaStream_t st) {
  if (count * s * s > 0) PTDP_LAUNCH(zero_upper_k<T>, grid_for(count * s * s), m, count * s * s, s);
}

}  // namespace

void add(float* y, const float* x, int64_t n, cudaStream_t st) {
  add_t(y, x, n, st);
}
void residual_add(float* out, const float* residual, const float* partial, const float* bias,
                  int64_t rows, int64_t width, cudaStream_t st) {
  residual_add_t(out, residual, partial, bias, rows, width, st);
}
void add_bias(float* y, const float* bias, int64_t rows, int64_t width, cudaStream_t st) {
  add_bias_t(y, bias, rows, width, st);
}
void bias_grad(const float* dy, float* db, int64_t rows, int64_t width, cudaStream_t st) {
  bias_grad_t(dy, db, rows, width, st);
}
void scale(float* x, int64_t n, double f, cudaStream_t st) {
  scale_t(x, n, f, st);
}
void to_bf16(const float* x, void* y, int64_t n, cudaStream_t st) {
  if (n > 0) PTDP_LAUNCH(to_bf16_k, grid_for(n), x, static_cast<kernels::cuda::bf16*>(y), n);
}
void from_bf16(const void* x, float* y, int64_t n, cudaStream_t st) {
  if (n > 0)
    PTDP_LAUNCH(from_bf16_k, grid_for(n), static_cast<const kernels::cuda::bf16*>(x), y, n);
}
void to_fp16(const float* x, void* y, int64_t n, cudaStream_t st) {
  if (n > 0) PTDP_LAUNCH(to_fp16_k, grid_for(n), x, static_cast<__half*>(y), n);
}
void from_fp16(const void* x, float* y, int64_t n, cudaStream_t st) {
  if (n > 0) PTDP_LAUNCH(from_fp16_k, grid_for(n), static_cast<const __half*>(x), y, n);
}
void split_columns3(const float* x, float* y0, float* y1, float* y2, int64_t n, int64_t a,
                    int64_t b, int64_t c, cudaStream_t st) {
  split_columns3_t(x, y0, y1, y2, n, a, b, c, st);
}
void concat_columns3(const float* x0, const float* x1, const float* x2, float* y, int64_t n,
                     int64_t a, int64_t b, int64_t c, cudaStream_t st) {
  concat_columns3_t(x0, x1, x2, y, n, a, b, c, st);
}
void sequence_unshard(const float* shards, float* full, int64_t t, int64_t b, int64_t s,
                      int64_t width, cudaStream_t st) {
  sequence_t(shards, full, t, b, s, width, true, st);
}
void sequence_shard(const float* full, float* shards, int64_t t, int64_t b, int64_t s,
                    int64_t width, cudaStream_t st) {
  sequence_t(full, shards, t, b, s, width, false, st);
}
void vocab_embedding_lookup(const int32_t* tokens, const float* table, float* y, int64_t n,
                            int64_t h, int64_t v0, int64_t vl, cudaStream_t st) {
  vocab_embedding_lookup_t(tokens, table, y, n, h, v0, vl, st);
}
void add_positions(float* x, const float* pos, int64_t b, int64_t sl, int64_t h, int64_t first,
                   cudaStream_t st) {
  add_positions_t(x, pos, b, sl, h, first, st);
}
void position_grad(const float* dx, float* dpos, int64_t b, int64_t sl, int64_t h, int64_t first,
                   cudaStream_t st) {
  position_grad_t(dx, dpos, b, sl, h, first, st);
}
void cross_entropy_stats(const float* logits, const int32_t* targets, float* stats, int64_t n,
                         int64_t vl, int64_t valid, int64_t v0, cudaStream_t st) {
  cross_entropy_stats_t(logits, targets, stats, n, vl, valid, v0, st);
}
void cross_entropy_finish(const float* stats, int64_t ranks, float* logits, float* lse,
                          float* row_loss, int64_t n, int64_t vl, int64_t valid, cudaStream_t st) {
  cross_entropy_finish_t(stats, ranks, logits, lse, row_loss, n, vl, valid, st);
}
void cross_entropy_backward(float* probs, const int32_t* targets, int64_t n, int64_t vl, int64_t v0,
                            double scale, cudaStream_t st) {
  cross_entropy_backward_t(probs, targets, n, vl, v0, scale, st);
}
template <typename T>
void gather_rows_t(const T* x, const int64_t* index, const float* weight, T* y, int64_t rows,
                   int64_t h, cudaStream_t st) {
  if (rows <= 0 || h <= 0) return;
  if (row_vectors<T>(h, {x, y})) {
    PTDP_KERNEL_LAUNCH(gather_rows_vec_k<T>, rows_grid(rows),
                       row_threads(h / Pack<T>::kN, kRowUnroll), 0, st)
    (x, index, weight, y, h);
    kernels::cuda::check_launch("gather_rows_vec_k");
  } else
    PTDP_LAUNCH(gather_rows_k<T>, rows_grid(rows), x, index, weight, y, h);
}
template <typename T>
void gather_add_rows_t(const T* y, const int64_t* index, const float* weight, T* out, int64_t n,
                       int64_t slots, int64_t h, cudaStream_t st) {
  if (n <= 0 || h <= 0 || slots <= 0) return;
  if (slots <= kMaxVecSlots && row_vectors<T>(h, {y, out})) {
    auto kernel = gather_add_rows_vec_k<T>;
    if (slots <= 4) kernel = gather_add_rows_few_k<T, 4>;
    if (slots <= 2) kernel = gather_add_rows_few_k<T, 2>;
    PTDP_KERNEL_LAUNCH(kernel, rows_grid(n), row_threads(h / Pack<T>::kN, kAddUnroll), 0, st)
    (y, index, weight, out, slots, h);
    kernels::cuda::check_launch(slots <= 4 ? "gather_add_rows_few_k" : "gather_add_rows_vec_k");
  } else
    PTDP_LAUNCH(gather_add_rows_k<T>, rows_grid(n), y, index, weight, out, slots, h);
}
template <typename T>
void row_dots_t(const T* a, const int64_t* index, const T* b, float* dot, int64_t rows, int64_t h,
                cudaStream_t st) {
  if (rows > 0) PTDP_LAUNCH(row_dots_k<T>, rows_grid(rows), a, index, b, dot, h);
}
void gather_rows(const float* x, const int64_t* index, const float* weight, float* y, int64_t rows,
                 int64_t h, cudaStream_t st) {
  gather_rows_t(x, index, weight, y, rows, h, st);
}
void gather_add_rows(const float* y, const int64_t* index, const float* weight, float* out,
                     int64_t n, int64_t slots, int64_t h, cudaStream_t st) {
  gather_add_rows_t(y, index, weight, out, n, slots, h, st);
}
void row_dots(const float* a, const int64_t* index, const float* b, float* dot, int64_t rows,
              int64_t h, cudaStream_t st) {
  row_dots_t(a, index, b, dot, rows, h, st);
}
void gather_rows(const bf16* x, const int64_t* index, const float* weight, bf16* y, int64_t rows,
                 int64_t h, cudaStream_t st) {
  gather_rows_t(x, index, weight, y, rows, h, st);
}
void gather_add_rows(const bf16* y, const int64_t* index, const float* weight, bf16* out, int64_t n,
                     int64_t slots, int64_t h, cudaStream_t st) {
  gather_add_rows_t(y, index, weight, out, n, slots, h, st);
}
void row_dots(const bf16* a, const int64_t* index, const bf16* b, float* dot, int64_t rows,
              int64_t h, cudaStream_t st) {
  row_dots_t(a, index, b, dot, rows, h, st);
}
void layernorm_forward(const float* x, const float* g, const float* b, float* y, float* mean,
                       float* rstd, int64_t n, int64_t h, cudaStream_t st) {
  if (n > 0) PTDP_LAUNCH(layernorm_forward_k, rows_grid(n), x, g, b, y, mean, rstd, h);
}
void layernorm_backward(const float* x, const float* g, const float* mean, const float* rstd,
                        const float* dy, float* dx, float* dg, float* db, int64_t n, int64_t h,
                        cudaStream_t st) {
  if (n <= 0) return;
  PTDP_LAUNCH(layernorm_dx_k, rows_grid(n), x, g, mean, rstd, dy, dx, h);
  kernels::cuda::column_sum(NormGammaOf{x, mean, rstd, dy, h}, dg, n, h, st);
  if (db) kernels::cuda::column_sum(ColumnOf<float>{dy, h}, db, n, h, st);
}
void rmsnorm_forward(const float* x, const float* g, float* y, float* rstd, int64_t n, int64_t h,
                     cudaStream_t st) {
  if (n > 0) PTDP_LAUNCH(rmsnorm_forward_k, rows_grid(n), x, g, y, rstd, h);
}
void rmsnorm_backward(const float* x, const float* g, const float* rstd, const float* dy, float* dx,
                      float* dg, int64_t n, int64_t h, cudaStream_t st) {
  if (n <= 0) return;
  PTDP_LAUNCH(rmsnorm_dx_k, rows_grid(n), x, g, rstd, dy, dx, h);
  kernels::cuda::column_sum(NormGammaOf{x, nullptr, rstd, dy, h}, dg, n, h, st);
}
void gelu(const float* x, float* y, int64_t n, cudaStream_t st) {
  if (n > 0) PTDP_LAUNCH(gelu_k, grid_for(n), x, y, n);
}
void gelu_backward(const float* x, const float* dy, float* dx, int64_t n, cudaStream_t st) {
  if (n > 0) PTDP_LAUNCH(gelu_backward_k, grid_for(n), x, dy, dx, n);
}
void swiglu(const float* x, float* y, int64_t n, int64_t f, cudaStream_t st) {
  if (n * f > 0) PTDP_LAUNCH(swiglu_k, grid_for(n * f), x, y, n, f);
}
void swiglu_backward(const float* x, const float* dy, float* dx, int64_t n, int64_t f,
                     cudaStream_t st) {
  if (n * f > 0) PTDP_LAUNCH(swiglu_backward_k, grid_for(n * f), x, dy, dx, n, f);
}
void rope(float* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base, bool inverse,
          cudaStream_t st) {
  rope_t(x, b, s, heads, d, base, inverse, st);
}
void causal_softmax(float* scores, int64_t rows, int64_t s, cudaStream_t st) {
  causal_softmax_t(scores, rows, s, st);
}
void causal_softmax_backward(const float* probs, const float* dprobs, float* dscores, int64_t rows,
                             int64_t s, cudaStream_t st) {
  causal_softmax_backward_t(probs, dprobs, dscores, rows, s, st);
}
void zero_upper(float* m, int64_t count, int64_t s, cudaStream_t st) {
  zero_upper_t(m, count, s, st);
}
void adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWArgs& a,
           cudaStream_t st) {
  adamw_update(param, grad, m, v, static_cast<float*>(nullptr), n, a, 1.0, st);
}
namespace {
// The element index, mod 4, at which p lies on a `bytes` boundary (elements of `elem` bytes); -1
// if none does.
int vector_phase(const void* p, int elem, int bytes) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  if (at % elem != 0) return -1;
  return static_cast<int>((bytes - at % bytes) % bytes / elem);
}
}  // namespace
// A launch for every kAdamWSpans spans adjacent in order (empty ones skipped), in quads of 4
// elements that start where every array is vector-aligned, if there is such a phase.
template <typename T>
void adamw_update_spans_t(float* param, const float* grad, float* m, float* v, T* out,
                          const std::vector<AdamWSpan>& spans, const AdamWArgs& a,
                          double grad_scale, cudaStream_t st) {
  int phase = vector_phase(param, 4, 16);
  bool vectors = phase >= 0;
  for (const void* p :
       {static_cast<const void*>(grad), static_cast<const void*>(m), static_cast<const void*>(v)})
    vectors = vectors && vector_phase(p, 4, 16) == phase;
  constexpr int kOut = static_cast<int>(sizeof(T));
  if (out) vectors = vectors && vector_phase(out, kOut, 4 * kOut) == phase;
  if (!vectors) phase = 0;
  size_t s = 0;
  while (s < spans.size()) {
    AdamWSpans t;
    for (; s < spans.size() && t.count < kAdamWSpans; ++s) {
      if (spans[s].n <= 0) continue;
      if (t.count > 0 && spans[s].start != t.start[t.count]) break;
      t.start[t.count] = spans[s].start;
      t.decay[t.count] = spans[s].decay;
      t.start[++t.count] = spans[s].start + spans[s].n;
    }
    if (t.count == 0) continue;
    const int64_t lo = t.start[0], hi = t.start[t.count];
    const int64_t first = vectors ? lo - ((lo - phase) % 4 + 4) % 4 : lo;
    const int64_t quads = vectors ? (hi - first + 3) / 4 : hi - lo;  // (or elements)
    PTDP_LAUNCH(adamw_spans_k<T>, grid_for(quads), param, grad, m, v, out, t, first, quads, vectors,
                a, grad_scale);
  }
}
void adamw_update_spans(float* param, const float* grad, float* m, float* v, float* out,
                        const std::vector<AdamWSpan>& spans, const AdamWArgs& a, double grad_scale,
                        cudaStream_t st) {
  adamw_update_spans_t(param, grad, m, v, out, spans, a, grad_scale, st);
}
void adamw_update_spans(float* param, const float* grad, float* m, float* v, bf16* out,
                        const std::vector<AdamWSpan>& spans, const AdamWArgs& a, double grad_scale,
                        cudaStream_t st) {
  adamw_update_spans_t(param, grad, m, v, out, spans, a, grad_scale, st);
}
void adamw_update(float* param, const float* grad, float* m, float* v, float* out, int64_t n,
                  const AdamWArgs& a, double grad_scale, cudaStream_t st) {
  adamw_update_spans_t(param, grad, m, v, out, {{0, n, true}}, a, grad_scale, st);
}
void adamw_update(float* param, const float* grad, float* m, float* v, bf16* out, int64_t n,
                  const AdamWArgs& a, double grad_scale, cudaStream_t st) {
  adamw_update_spans_t(param, grad, m, v, out, {{0, n, true}}, a, grad_scale, st);
}

// ---- bf16 storage: the templated kernels above on bf16 activations ----
void add(bf16* y, const bf16* x, int64_t n, cudaStream_t st) {
  add_t(y, x, n, st);
}
void residual_add(bf16* out, const bf16* residual, const bf16* partial, const bf16* bias,
                  int64_t rows, int64_t width, cudaStream_t st) {
  residual_add_t(out, residual, partial, bias, rows, width, st);
}
void add_bias(bf16* y, const bf16* bias, int64_t rows, int64_t width, cudaStream_t st) {
  add_bias_t(y, bias, rows, width, st);
}
bool residual_add_backward(const bf16* dout, bf16* d_residual, bf16* d_partial, float* db,
                           int64_t rows, int64_t width, cudaStream_t st) {
  return residual_add_backward_t(dout, d_residual, d_partial, db, rows, width, st);
}
bool residual_add_backward(const float* dout, float* d_residual, float* d_partial, float* db,
                           int64_t rows, int64_t width, cudaStream_t st) {
  return residual_add_backward_t(dout, d_residual, d_partial, db, rows, width, st);
}
void bias_grad(const bf16* dy, float* db, int64_t rows, int64_t width, cudaStream_t st) {
  bias_grad_t(dy, db, rows, width, st);
}
void scale(bf16* x, int64_t n, double f, cudaStream_t st) {
  scale_t(x, n, f, st);
}
void split_columns3(const bf16* x, bf16* y0, bf16* y1, bf16* y2, int64_t n, int64_t a, int64_t b,
                    int64_t c, cudaStream_t st) {
  split_columns3_t(x, y0, y1, y2, n, a, b, c, st);
}
void concat_columns3(const bf16* x0, const bf16* x1, const bf16* x2, bf16* y, int64_t n, int64_t a,
                     int64_t b, int64_t c, cudaStream_t st) {
  concat_columns3_t(x0, x1, x2, y, n, a, b, c, st);
}
void sequence_unshard(const bf16* shards, bf16* full, int64_t t, int64_t b, int64_t s,
                      int64_t width, cudaStream_t st) {
  sequence_t(shards, full, t, b, s, width, true, st);
}
void sequence_shard(const bf16* full, bf16* shards, int64_t t, int64_t b, int64_t s, int64_t width,
                    cudaStream_t st) {
  sequence_t(full, shards, t, b, s, width, false, st);
}
void vocab_embedding_lookup(const int32_t* tokens, const bf16* table, bf16* y, int64_t n, int64_t h,
                            int64_t v0, int64_t vl, cudaStream_t st) {
  vocab_embedding_lookup_t(tokens, table, y, n, h, v0, vl, st);
}
void add_positions(bf16* x, const bf16* pos, int64_t b, int64_t sl, int64_t h, int64_t first,
                   cudaStream_t st) {
  add_positions_t(x, pos, b, sl, h, first, st);
}
void position_grad(const bf16* dx, float* dpos, int64_t b, int64_t sl, int64_t h, int64_t first,
                   cudaStream_t st) {
  position_grad_t(dx, dpos, b, sl, h, first, st);
}
void cross_entropy_stats(const bf16* logits, const int32_t* targets, float* stats, int64_t n,
                         int64_t vl, int64_t valid, int64_t v0, cudaStream_t st) {
  cross_entropy_stats_t(logits, targets, stats, n, vl, valid, v0, st);
}
void cross_entropy_finish(const float* stats, int64_t ranks, bf16* logits, float* lse,
                          float* row_loss, int64_t n, int64_t vl, int64_t valid, cudaStream_t st) {
  cross_entropy_finish_t(stats, ranks, logits, lse, row_loss, n, vl, valid, st);
}
void cross_entropy_backward(bf16* probs, const int32_t* targets, int64_t n, int64_t vl, int64_t v0,
                            double scale, cudaStream_t st) {
  cross_entropy_backward_t(probs, targets, n, vl, v0, scale, st);
}
// The loss pass without the probabilities, and the gradient from the logits and lse
// (runtime/cuda/fp32_kernels.h).
void cross_entropy_lse(const float* stats, int64_t ranks, float* lse, float* row_loss, int64_t n,
                       cudaStream_t st) {
  if (n > 0) PTDP_LAUNCH(ce_lse_k, grid_for(n), stats, ranks, lse, row_loss, n);
}
void cross_entropy_backward_from_lse(bf16* logits, const float* lse, const int32_t* targets,
                                     int64_t n, int64_t vl, int64_t valid, int64_t v0, double scale,
                                     cudaStream_t st) {
  if (n * vl <= 0) return;
  if (bf16_vectors<bf16>(vl, {logits})) {
    const float f = static_cast<float>(scale / static_cast<double>(n));
    PTDP_LAUNCH(ce_backward_from_lse_vec_k, rows_grid(n), reinterpret_cast<Bf16x8*>(logits), lse,
                targets, vl, valid, v0, f);
    return;
  }
  PTDP_LAUNCH(ce_probs_k<bf16>, grid_for(n * vl), logits, lse, n, vl, valid);
  cross_entropy_backward_t(logits, targets, n, vl, v0, scale, st);
}
void causal_softmax(bf16* scores, int64_t rows, int64_t s, cudaStream_t st) {
  causal_softmax_t(scores, rows, s, st);
}
void causal_softmax_backward(const bf16* probs, const bf16* dprobs, bf16* dscores, int64_t rows,
                             int64_t s, cudaStream_t st) {
  causal_softmax_backward_t(probs, dprobs, dscores, rows, s, st);
}
void zero_upper(bf16* m, int64_t count, int64_t s, cudaStream_t st) {
  zero_upper_t(m, count, s, st);
}

}  // namespace ptdp::cuda_fp32
