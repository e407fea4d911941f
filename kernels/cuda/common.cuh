// Device helpers shared by the .cu files of kernels/cuda/: bf16 conversion, warp and block
// reductions, launch checks, and the deterministic column sum used for bias, gamma and beta
// gradients (fixed row chunks summed in a fixed order, so results do not depend on scheduling).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "kernels/cuda/common.h"

// Kernel launches are written PTDP_KERNEL_LAUNCH(kernel, grid, block, shared bytes, stream)(args),
// CUDA's kernel<<<grid, block, shared bytes, stream>>>(args), so that the same source also runs
// on the host under tests/cuda/emulated_cuda.h (PTDP_CUDA_EMULATION), where every kernel can be
// tested without a GPU.
#ifdef PTDP_CUDA_EMULATION
#include "tests/cuda/emulated_cuda.h"
#define PTDP_KERNEL_LAUNCH(kernel, ...) \
  ::emu::launcher(__VA_ARGS__, [&](auto&&... args) { kernel(args...); })
#else
#define PTDP_KERNEL_LAUNCH(kernel, ...) kernel<<<__VA_ARGS__>>>
#endif

namespace ptdp::kernels::cuda {

__device__ __forceinline__ float to_float(bf16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ bf16 to_bf16(float x) {
  return __float2bfloat16_rn(x);
}
// Either storage type widened to fp32 (kernels templated on fp32 or bf16 operands).
__device__ __forceinline__ float as_float(float x) {
  return x;
}
__device__ __forceinline__ float as_float(bf16 x) {
  return to_float(x);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
// `scratch` holds 32 floats of shared memory; the call synchronizes the block.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}
// Asks for the 128-byte line holding p to be brought into L2 ahead of its load
// (prefetch.global.L2): the latency of a later load, without a register held meanwhile.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
#else
  (void)p;
#endif
}
// Two block sums at the cost of one (two barriers, not four), each summed in block_sum's order,
// so each is block_sum's to the bit. `scratch` holds 64 floats of shared memory.
__device__ __forceinline__ void block_sum2(float& a, float& b, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  a = warp_sum(a);
  b = warp_sum(b);
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = a, scratch[32 + warp] = b;
  __syncthreads();
  a = warp_sum(lane < warps ? scratch[lane] : 0.0f);
  b = warp_sum(lane < warps ? scratch[32 + lane] : 0.0f);
}

// ---- 16-byte vectors of 8 bf16, for the memory-bound kernels: one load or store instruction
// per 8 elements instead of 8 (scalar bf16 accesses left the element-wise kernels near 1 TB/s
// of an H100's 3) ----
constexpr int kVec = 8;
struct alignas(16) Bf16x8 {
  bf16 v[kVec];
};
// Vectors c = first, first + step, ... below count of `from`, each changed by f(c, v) and stored
// at to[c], kUnroll of them loaded before the first is stored (a loop's loads may not pass its
// stores, which might alias them: one at a time would keep one vector in flight a thread). The
// next kUnroll start `stride` after these; to may be from.
template <int kUnroll, typename V, typename F>
__device__ __forceinline__ void rewrite_vectors(const V* from, V* to, int64_t first, int64_t count,
                                                int64_t step, int64_t stride, F f) {
  for (int64_t c0 = first; c0 < count; c0 += stride) {
    V v[kUnroll]{};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c0 + u * step < count) v[u] = from[c0 + u * step];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * step;
      if (c >= count) continue;
      f(c, v[u]);
      to[c] = v[u];
    }
  }
}

// Whether `n` elements (a multiple of kVec in every row of `cols`) at these pointers can be
// read and written as Bf16x8: each pointer 16-byte aligned, `cols` a multiple of kVec.
inline bool vectorizable(int64_t cols, std::initializer_list<const void*> pointers) {
  if (cols % kVec != 0) return false;
  for (const void* p : pointers)
    if (p && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// 8 columns as fp32: loaded from bf16 or fp32, stored or added to fp32 (16-byte aligned).
__device__ inline void load8(const bf16* p, float (&v)[kVec]) {
  const Bf16x8 a = *reinterpret_cast<const Bf16x8*>(p);
  for (int e = 0; e < kVec; ++e) v[e] = as_float(a.v[e]);
}
__device__ inline void load8(const float* p, float (&v)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ inline void store8(float* p, const float (&v)[kVec]) {
  float4* o = reinterpret_cast<float4*>(p);
  o[0] = make_float4(v[0], v[1], v[2], v[3]);
  o[1] = make_float4(v[4], v[5], v[6], v[7]);
}
// out[0..8) += v, two float4 read-modify-writes (out 16-byte aligned).
__device__ inline void add8(float* out, const float (&v)[kVec]) {
  float4* o = reinterpret_cast<float4*>(out);
  float4 a = o[0], b = o[1];
  a.x += v[0], a.y += v[1], a.z += v[2], a.w += v[3];
  b.x += v[4], b.y += v[5], b.z += v[6], b.w += v[7];
  o[0] = a, o[1] = b;
}

// ---- a row's softmax statistics: this thread's running maximum m and sum s of exp(x - m) over
// the logits [0, valid) of `row`, the block's threads taking turns; with `vectors` (the row
// 16-byte aligned) 8 logits a 16-byte load, their maximum first, so that the sum is rescaled
// at most once a vector (2-byte loads left the pass far below the copy bandwidth). The caller
// merges the threads' pairs (as the online softmax merges them). ----
__device__ inline void logit_stats_share(const bf16* row, int64_t valid, bool vectors, float& m,
                                         float& s) {
  m = -INFINITY;
  s = 0.0f;
  auto add = [&](const float* x, int count) {
    float mx = -INFINITY;
    for (int e = 0; e < count; ++e) mx = fmaxf(mx, x[e]);
    if (mx == -INFINITY) return;  // nothing but -inf adds nothing (and -inf - -inf is NaN)
    if (mx > m) {
      s *= expf(m - mx);  // expf(-inf) = 0 the first time
      m = mx;
    }
    for (int e = 0; e < count; ++e) s += expf(x[e] - m);
  };
  if (vectors) {
    // Two vectors' loads in flight a thread, added in the same order as one at a time.
    const Bf16x8* v = reinterpret_cast<const Bf16x8*>(row);
    auto add_vector = [&](const Bf16x8& a, int64_t q) {
      float x[kVec];
      for (int e = 0; e < kVec; ++e) x[e] = q * kVec + e < valid ? as_float(a.v[e]) : -INFINITY;
      add(x, kVec);
    };
    for (int64_t q = threadIdx.x; q * kVec < valid; q += 2 * blockDim.x) {
      const int64_t q2 = q + blockDim.x;
      const Bf16x8 a = v[q];
      Bf16x8 b{};
      if (q2 * kVec < valid) b = v[q2];
      add_vector(a, q);
      if (q2 * kVec < valid) add_vector(b, q2);
    }
    return;
  }
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) {
    const float x = as_float(row[j]);
    add(&x, 1);
  }
}

// ---- sum of squares, deterministic: this thread's share of sum x[i]^2 over n floats ----
// float4 vectors 4 at a time, their loads issued together, grid-stride (one scalar load per
// thread in flight kept 256 KiB moving and reached half an H100's copy bandwidth). The
// elements before the first 16-byte boundary and after the last whole vector go to the first
// threads. The split depends only on n, x's alignment and the grid, so a fixed grid sums in a
// fixed order.
__device__ inline double sum_squares_share(const float* x, int64_t n) {
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
  return acc;
}

inline unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

inline void check_launch(const char* kernel) {
  check(cudaGetLastError(), kernel);
}

// ---- deterministic column sums: out[c] += sum over rows r of f(r, c) ----
constexpr int kColumnChunks = 128;  // row chunks; fixed, so the summation order is too

template <typename F>
__global__ void column_partials_kernel(F f, float* partial, int64_t rows, int64_t cols,
                                       int64_t rows_per_chunk) {
  __shared__ float sh[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float acc = 0;
  if (c < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc += f(r, c);
  sh[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = 0;
    for (int i = 0; i < 8; ++i) s += sh[i][threadIdx.x];
    partial[blockIdx.y * cols + c] = s;
  }
}

// A template so that every .cu file gets its own copy (no relocatable device code needed).
// A block of 32 x 8 threads takes 32 columns: thread (x, y) adds chunks y, y + 8, ... of column
// x in order, then the 8 sums are added in y order; a fixed order, as in the partials. (One
// thread a column, over every chunk in turn, left a narrow sum latency-bound: 768 columns of 256
// chunks were 3 blocks of dependent loads, most of a GPT-2 LayerNorm backward's 36 us.)
// blockIdx.y picks the output (of up to two): its partials at partial + y chunks cols, out0 or
// out1 (one launch for a norm's gamma and beta gradients, not two).
template <typename T = float>
__global__ void column_finish_kernel(const T* partial, T* out0, T* out1, int chunks, int64_t cols) {
  __shared__ T sh[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  T* out = blockIdx.y == 0 ? out0 : out1;
  partial += static_cast<int64_t>(blockIdx.y) * chunks * cols;
  T s = 0;
  if (c < cols) {
#pragma unroll 4
    for (int i = static_cast<int>(threadIdx.y); i < chunks; i += 8)
      s += partial[static_cast<int64_t>(i) * cols + c];
  }
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    T t = 0;
    for (int i = 0; i < 8; ++i) t += sh[i][threadIdx.x];
    out[c] += t;
  }
}

// The row chunks of a column sum over `rows` (each chunk's partial sums, then their sum per
// column in a fixed order, column_finish_kernel), and the second pass: out[k][c] += the partials
// of output k.
// `most` chunks at most (a fixed number, so that the order of the sums depends only on rows).
struct ColumnChunks {
  int64_t per = 0;  // rows per chunk
  int chunks = 0;
  explicit ColumnChunks(int64_t rows, int most = kColumnChunks)
      : per((rows + most - 1) / most), chunks(static_cast<int>((rows + per - 1) / per)) {}
};
// Allocates `outputs` x chunks x cols partial sums, lets `partials(p)` fill them, adds them to
// out[0..outputs), and frees them.
template <typename Partials>
void column_sums(const ColumnChunks& cc, float* const* out, int outputs, int64_t cols,
                 cudaStream_t stream, Partials partials) {
  float* partial = nullptr;
  partial = static_cast<float*>(allocate_async(sizeof(float) * outputs * cc.chunks * cols, stream));
  partials(partial);
  for (int k = 0; k < outputs; k += 2) {  // two outputs a launch
    const int here = outputs - k < 2 ? outputs - k : 2;
    PTDP_KERNEL_LAUNCH(column_finish_kernel<float>,
                       dim3(blocks_for(cols, 32), static_cast<unsigned>(here)), dim3(32, 8), 0,
                       stream)
    (partial + static_cast<int64_t>(k) * cc.chunks * cols, out[k], here == 2 ? out[k + 1] : out[k],
     cc.chunks, cols);
    check_launch("column_finish_kernel");
  }
  PTDP_CUDA_CHECK(cudaFreeAsync(partial, stream));
}

template <typename F>
void column_sum(F f, float* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const ColumnChunks cc(rows);
  column_sums(cc, &out, 1, cols, stream, [&](float* partial) {
    PTDP_KERNEL_LAUNCH(column_partials_kernel, dim3(blocks_for(cols, 32), cc.chunks), dim3(32, 8),
                       0, stream)
    (f, partial, rows, cols, cc.per);
    check_launch("column_partials_kernel");
  });
}

// The same sums 8 columns a thread (cols a multiple of kVec), for F::kOutputs sums at once, in
// two steps a row: f.load(r, c0) reads what row r needs for columns [c0, c0 + 8) (an F::In, the
// 16-byte vectors as loaded), then f(r, c0, in, v) gives the row's values of each output k in
// v[k], and may write what it computed (a fused kernel's output) with one 16-byte store. A
// thread loads kColumnRowsAhead of its rows before it computes any of them: a load may not move
// above a store that might alias it, so one row at a time left one row's loads in flight a thread
// (bias + GELU backward, its column sum fused, moved 50% of an H200's copy bandwidth). Each
// column sums the same rows in the same order as column_sum (on the host, to the bit; on a GPU
// nvcc may contract a functor's product into the add differently in the two, a last bit).
constexpr int kColumnRowsAhead = 4;
template <typename F>
__global__ void column_partials_vec_kernel(F f, float* partial, int64_t rows, int64_t cols,
                                           int64_t rows_per_chunk) {
  constexpr int K = F::kOutputs;
  __shared__ float sh[8][K * 32 * kVec];
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * kVec;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float acc[K][kVec] = {};
  if (c0 < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8 * kColumnRowsAhead) {
      typename F::In in[kColumnRowsAhead]{};
#pragma unroll
      for (int u = 0; u < kColumnRowsAhead; ++u)
        if (r + 8 * u < r1) in[u] = f.load(r + 8 * u, c0);
#pragma unroll
      for (int u = 0; u < kColumnRowsAhead; ++u) {
        if (r + 8 * u >= r1) continue;
        float v[K][kVec];
        f(r + 8 * u, c0, in[u], v);
        for (int k = 0; k < K; ++k)
          for (int e = 0; e < kVec; ++e) acc[k][e] += v[k][e];
      }
    }
  for (int k = 0; k < K; ++k)
    for (int e = 0; e < kVec; ++e) sh[threadIdx.y][(k * 32 + threadIdx.x) * kVec + e] = acc[k][e];
  __syncthreads();
  if (threadIdx.y == 0 && c0 < cols)
    for (int k = 0; k < K; ++k)
      for (int e = 0; e < kVec; ++e) {
        float s = 0;
        for (int i = 0; i < 8; ++i) s += sh[i][(k * 32 + threadIdx.x) * kVec + e];
        partial[(static_cast<int64_t>(k) * gridDim.y + blockIdx.y) * cols + c0 + e] = s;
      }
}

template <typename F>
void column_sum_vec(F f, const std::array<float*, F::kOutputs>& out, int64_t rows, int64_t cols,
                    cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const ColumnChunks cc(rows);
  column_sums(cc, out.data(), F::kOutputs, cols, stream, [&](float* partial) {
    PTDP_KERNEL_LAUNCH(column_partials_vec_kernel, dim3(blocks_for(cols / kVec, 32), cc.chunks),
                       dim3(32, 8), 0, stream)
    (f, partial, rows, cols, cc.per);
    check_launch("column_partials_vec_kernel");
  });
}

}  // namespace ptdp::kernels::cuda
