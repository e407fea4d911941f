// Flash attention on the tensor cores (kernels/cuda/attention.h, FlashKernel::kTensorCore), with
// FlashAttention-2's split of the work (Dao 2023): each warp owns 16 rows of a tile, scores and
// probabilities stay in the registers of the mma.sync.m16n8k16 bf16 accumulators, and the
// accumulator fragment of one product is the A operand of the next (no shared-memory round trip
// for P). Arithmetic: bf16 products with fp32 accumulation; the probabilities and score gradients
// are rounded to bf16 before they multiply V, dO, Q or K, as FlashAttention does.
//
// Fragment layout of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 g + t:
//   A 16 x 16 (row major), four 32-bit registers of two bf16 each (low half: the lower column):
//     a0 (row g, cols 2t, 2t+1), a1 (row g+8, cols 2t..), a2 (row g, cols 2t+8..),
//     a3 (row g+8, cols 2t+8..)
//   B 16 x 8 (k x n), two registers: b0 (rows 2t, 2t+1; col g), b1 (rows 2t+8, 2t+9; col g)
//   C 16 x 8 fp32, four floats: c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, cols 2t, 2t+1)
// so the C fragments of two adjacent n-tiles are, packed to bf16, exactly the A fragment of one
// k-step of 16.
//
// Kernels (D = 64 or 128, 4 warps of 32 threads):
//   forward:  a block per (64-query tile, query head, sequence); K/V tiles of 64 keys up to the
//             diagonal; online softmax in base 2 (exp2 of log2(e)-scaled scores).
// With sq queries against sk > sq keys (the last sq positions of sk) the diagonal shifts right by
// sk - sq: query i sees keys j <= i + sk - sq, and every loop bound and mask below moves with it.
//   dk/dv:    a block per (64-key tile, key/value head, sequence); it walks every query head of
//             its group and every 32-query tile at or below the diagonal, accumulating its rows
//             of dk and dv in registers.
//   dq:       a block per (64-query tile, query head, sequence) over the 32-key tiles up to the
//             diagonal.
// Every output row has one writer: deterministic, no atomics (as the CUDA-core kernels).
// Fragments come from shared memory by ldmatrix.x4 (.trans for operands stored k-major), and
// tiles reach shared memory by cp.async, overlapped with the math (see each kernel).
//
// Under tests/cuda/emulated_cuda.h (PTDP_CUDA_EMULATION) these kernels run on the host, every
// CUDA thread a fiber and mma.sync computed from the layout above, so the GPU tests check them
// on a machine without a GPU too (docs/gpu.md).
#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_tile.cuh"

#ifdef PTDP_CUDA_EMULATION
#define PTDP_DYNAMIC_SMEM(name) unsigned char* name = ::emu::dynamic_smem()
#else
#define PTDP_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace ptdp::kernels::cuda::attention {
namespace {

constexpr int kWarps = 4;
constexpr int kMmaThreads = 32 * kWarps;
constexpr int kRowTile = 16 * kWarps;  // rows a block owns: 16 per warp
constexpr int kFwdKeys = 64;           // keys per K/V tile in the forward pass
constexpr int kBwdCols = 32;           // queries (dk/dv) or keys (dq) per inner tile, backward
constexpr float kLog2e = 1.4426950408889634f;

// Shared-memory row pitch in bf16: 8 more than D keeps rows 16-byte aligned, and the eight rows
// g = 0..7 that a fragment load touches start 4 banks apart (D / 2 + 4 words), so the 32 lanes
// of a 32-bit fragment load hit 32 different banks.
template <int D>
constexpr int kMmaPitch = D + 8;

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(PTDP_CUDA_EMULATION)
  ::emu::mma16816(c, a, b0, b1);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  (void)c, (void)a, (void)b0, (void)b1;
  __trap();  // the host side only launches these kernels on sm_80 and later
#endif
}

// Two adjacent n-tiles from one A fragment and the four B registers of load_bt2 / load_b2.
__device__ __forceinline__ void mma_pair(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[4]) {
  mma16816(c0, a, b[0], b[1]);
  mma16816(c1, a, b[2], b[3]);
}

// Two bf16 from anywhere, lo in the low half.
__device__ __forceinline__ uint32_t pack(bf16 lo, bf16 hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  return pack(__float2bfloat16_rn(lo), __float2bfloat16_rn(hi));
}

#if !defined(PTDP_CUDA_EMULATION)
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// ldmatrix.x4 (sm_75 and later): lanes 8 i .. 8 i + 7 give the row addresses of 8 x 8 bf16
// matrix i, and register i of lane 4 g + t gets its elements (g, 2 t) and (g, 2 t + 1), or with
// Trans (2 t, g) and (2 t + 1, g): one instruction for what took four (eight transposed) shared
// loads of 32 (16) bits.
template <bool Trans>
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const bf16* row) {
#if defined(PTDP_CUDA_EMULATION)
  ::emu::ldmatrix_x4(r, row, Trans);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(row)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(row)));
#else
  (void)r, (void)row;
  __trap();
#endif
}

// cp.async of 16 bytes from global to shared memory (sm_80 and later), zeros where `valid` is
// false; copies are committed in groups and waited for with cp_async_wait<n>: at most the n
// newest groups still in flight. The data is visible to the block after the wait and a barrier.
__device__ __forceinline__ void cp_async16(bf16* dst, const bf16* src, bool valid) {
#if defined(PTDP_CUDA_EMULATION)
  ::emu::cp_async16(dst, src, valid ? 16 : 0);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
#else
  (void)dst, (void)src, (void)valid;
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(PTDP_CUDA_EMULATION)
  ::emu::cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(PTDP_CUDA_EMULATION)
  ::emu::cp_async_wait(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Starts copying dst[r][0..D) = row (first + r) of src for r < rows, zeros past s (the source
// address of a zero row stays inside the tensor); the caller commits and waits.
template <int D>
__device__ __forceinline__ void stage_async(bf16* dst, const bf16* src, int64_t stride, int first,
                                            int rows, int s) {
  constexpr int kChunks = D / 8;
  for (int idx = threadIdx.x; idx < rows * kChunks; idx += blockDim.x) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = first + r < s;
    cp_async16(dst + r * kMmaPitch<D> + c * 8,
               src + static_cast<int64_t>(valid ? first + r : 0) * stride + c * 8, valid);
  }
}

// The A fragment of rows [row0, row0 + 16) and columns [col0, col0 + 16) of a staged tile:
// a0..a3 are the 8 x 8 blocks (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
template <int D>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* tile, int row0, int col0) {
  const int lane = threadIdx.x % 32, i = lane / 8;
  ldsm4<false>(a, tile + (row0 + lane % 8 + 8 * (i & 1)) * kMmaPitch<D> + col0 + 8 * (i >> 1));
}
// The B fragments of n-tiles n0 (b[0], b[1]) and n0 + 8 (b[2], b[3]) at k-step k0 for a product
// with a staged tile's transpose, B[k][n] = tile[n0 + n][k0 + k] (scores against keys or
// queries stored row by row): b0 of an n-tile is the block (its 8 rows, cols k0..k0 + 7).
template <int D>
__device__ __forceinline__ void load_bt2(uint32_t (&b)[4], const bf16* tile, int n0, int k0) {
  const int lane = threadIdx.x % 32, i = lane / 8;
  ldsm4<false>(b, tile + (n0 + lane % 8 + 8 * (i >> 1)) * kMmaPitch<D> + k0 + 8 * (i & 1));
}
// The same for a product with a staged tile itself, B[k][n] = tile[k0 + k][n0 + n]
// (probabilities times V, score gradients times Q or K): transposed 8 x 8 blocks.
template <int D>
__device__ __forceinline__ void load_b2(uint32_t (&b)[4], const bf16* tile, int k0, int n0) {
  const int lane = threadIdx.x % 32, i = lane / 8;
  ldsm4<true>(b, tile + (k0 + lane % 8 + 8 * (i & 1)) * kMmaPitch<D> + n0 + 8 * (i >> 1));
}

// The A fragment of k-step j from the C fragments of n-tiles 2j and 2j + 1.
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&lo)[4],
                                       const float (&hi)[4]) {
  a[0] = pack(lo[0], lo[1]);
  a[1] = pack(lo[2], lo[3]);
  a[2] = pack(hi[0], hi[1]);
  a[3] = pack(hi[2], hi[3]);
}

template <int D>
__global__ void __launch_bounds__(kMmaThreads)
    mma_forward_kernel(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int s,
                       int skeys, int hq, int hk, float scale_log2) {
  constexpr int P = kMmaPitch<D>;
  constexpr int kSteps = D / 16;  // k-steps over the head dimension
  constexpr int kDTiles = D / 8;  // n-tiles of the output
  constexpr int kKeyTiles = kFwdKeys / 8;
  static_assert(kRowTile == kFwdKeys, "the diagonal tile must give every row a valid key");
  __shared__ __align__(16) bf16 sk[kFwdKeys * P];  // also stages the query tile first
  __shared__ __align__(16) bf16 sv[kFwdKeys * P];

  // Query tiles longest first: a causal tile's work grows with q0, and blocks start in index
  // order, so the longest ones ending the grid would leave the GPU a long tail.
  const int bi = blockIdx.z, h = blockIdx.y, q0 = (gridDim.x - 1 - blockIdx.x) * kRowTile;
  const int kh = h / (hq / hk);
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
  const int row0 = q0 + 16 * warp + g, row1 = row0 + 8;
  const int64_t qstride = static_cast<int64_t>(hq) * D, kstride = static_cast<int64_t>(hk) * D;
  const bf16* qb = q + static_cast<int64_t>(bi) * s * qstride + static_cast<int64_t>(h) * D;
  const bf16* kb = k + static_cast<int64_t>(bi) * skeys * kstride + static_cast<int64_t>(kh) * D;
  const bf16* vb = v + static_cast<int64_t>(bi) * skeys * kstride + static_cast<int64_t>(kh) * D;
  const int shift = skeys - s;

  uint32_t qa[kSteps][4];
  stage_async<D>(sk, qb, qstride, q0, kRowTile, s);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) load_a<D>(qa[kk], sk, 16 * warp, 16 * kk);
  __syncthreads();  // every warp holds its query fragments before sk takes the first keys
  stage_async<D>(sk, kb, kstride, 0, kFwdKeys, skeys);
  cp_async_commit();

  float o[kDTiles][4];
#pragma unroll
  for (int n = 0; n < kDTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // this thread's part of the sums

  // Software pipeline, one group of copies in flight behind the math: the values of a tile load
  // while its scores are computed, and the next tile's keys while its probabilities multiply V.
  const int last = min(q0 + kRowTile, s) - 1 + shift;  // the last key of the tile's last row
  for (int k0 = 0; k0 <= last; k0 += kFwdKeys) {
    __syncthreads();  // every warp is done with sv (the previous tile's p v)
    stage_async<D>(sv, vb, kstride, k0, kFwdKeys, skeys);
    cp_async_commit();
    cp_async_wait<1>();  // this tile's keys have landed; its values may still be in flight
    __syncthreads();
    // Every warp has work in every tile: keys start at multiples of 64 <= q0 + shift (kRowTile
    // == kFwdKeys), so the diagonal tile holds a key at or before each warp's first row's last.
    float sc[kKeyTiles][4];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
    for (int n = 0; n < kKeyTiles; n += 2)
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
        uint32_t b[4];
        load_bt2<D>(b, sk, 8 * n, 16 * kk);
        mma_pair(sc[n], sc[n + 1], qa[kk], b);
      }
    __syncthreads();  // every warp is done with sk
    if (k0 + kFwdKeys <= last) stage_async<D>(sk, kb, kstride, k0 + kFwdKeys, kFwdKeys, skeys);
    cp_async_commit();  // perhaps empty: every tile commits two groups, so the waits stay right

    // Scale to base 2, mask (causal, and keys past s), and take the row maxima.
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + 8 * n + 2 * t + (e & 1), row = e < 2 ? row0 : row1;
        float x = sc[n][e] * scale_log2;
        if (key > row + shift || key >= skeys) x = -INFINITY;
        sc[n][e] = x;
        if (e < 2)
          mx0 = fmaxf(mx0, x);
        else
          mx1 = fmaxf(mx1, x);
      }
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {  // the 4 threads of a row (lanes 4g .. 4g + 3)
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
    }
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float alpha0 = m0 == -INFINITY ? 0.0f : exp2f(m0 - n0);
    const float alpha1 = m1 == -INFINITY ? 0.0f : exp2f(m1 - n1);
    m0 = n0;
    m1 = n1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = sc[n][e], m = e < 2 ? m0 : m1;
        const float p = x == -INFINITY ? 0.0f : exp2f(x - m);
        sc[n][e] = p;
        if (e < 2)
          sum0 += p;
        else
          sum1 += p;
      }
    l0 = l0 * alpha0 + sum0;
    l1 = l1 * alpha1 + sum1;
#pragma unroll
    for (int n = 0; n < kDTiles; ++n) {
      o[n][0] *= alpha0;
      o[n][1] *= alpha0;
      o[n][2] *= alpha1;
      o[n][3] *= alpha1;
    }
    cp_async_wait<1>();  // this tile's values have landed (the softmax overlapped them)
    __syncthreads();
    // o += p v, 16 keys per k-step.
#pragma unroll
    for (int j = 0; j < kKeyTiles / 2; ++j) {
      uint32_t pa[4];
      c_to_a(pa, sc[2 * j], sc[2 * j + 1]);
#pragma unroll
      for (int n = 0; n < kDTiles; n += 2) {
        uint32_t b[4];
        load_b2<D>(b, sv, 16 * j, 8 * n);
        mma_pair(o[n], o[n + 1], pa, b);
      }
    }
  }

#pragma unroll
  for (int o2 = 1; o2 <= 2; o2 <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o2);
  }
  const int64_t obase = static_cast<int64_t>(bi) * s * qstride + static_cast<int64_t>(h) * D;
  for (int half = 0; half < 2; ++half) {
    const int row = half == 0 ? row0 : row1;
    if (row >= s) continue;
    const float l = half == 0 ? l0 : l1, m = half == 0 ? m0 : m1, inv = 1.0f / l;
    bf16* orow = out + obase + static_cast<int64_t>(row) * qstride;
#pragma unroll
    for (int n = 0; n < kDTiles; ++n) {
      const float x = o[n][2 * half] * inv, y = o[n][2 * half + 1] * inv;
      *reinterpret_cast<uint32_t*>(orow + 8 * n + 2 * t) = pack(x, y);
    }
    if (t == 0) lse[(static_cast<int64_t>(bi) * hq + h) * s + row] = m / kLog2e + logf(l);
  }
}

// The recomputed probability of one (query, key) pair and its mask: p = exp(score - lse), with
// the score scaled to base 2 (lse2 = lse * log2(e)); zero when masked.
__device__ __forceinline__ float prob(float acc, float scale_log2, float lse2, bool valid) {
  return valid ? exp2f(acc * scale_log2 - lse2) : 0.0f;
}

// The backward pass's two products for this warp's 16 rows against an inner tile of kCols
// columns: x = A1 T1^T and y = A2 T2^T, A1 and A2 the warp's rows of two staged tiles (keys and
// values, or queries and output gradients), T1 and T2 the inner tile's rows of two others.
template <int D, int kCols>
__device__ __forceinline__ void two_products(float (&x)[kCols / 8][4], float (&y)[kCols / 8][4],
                                             const bf16* a1, const bf16* a2, const bf16* t1,
                                             const bf16* t2) {
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[n][e] = y[n][e] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t fa1[4], fa2[4];
    load_a<D>(fa1, a1, 16 * warp, 16 * kk);
    load_a<D>(fa2, a2, 16 * warp, 16 * kk);
#pragma unroll
    for (int n = 0; n < kCols / 8; n += 2) {
      uint32_t b[4];
      load_bt2<D>(b, t1, 8 * n, 16 * kk);
      mma_pair(x[n], x[n + 1], fa1, b);
      load_bt2<D>(b, t2, 8 * n, 16 * kk);
      mma_pair(y[n], y[n + 1], fa2, b);
    }
  }
}

// Both backward kernels walk inner tiles of kBwdCols rows double-buffered: while the block
// computes with tile i, cp.async brings tile i + 1 into the other buffer, and one barrier per
// tile (after the copies are waited for) hands it over.
template <int D>
constexpr int kInnerTile = kBwdCols* kMmaPitch<D>;  // one staged inner tile, in bf16

template <int D>
__global__ void __launch_bounds__(kMmaThreads)
    mma_backward_kv_kernel(const bf16* q, const bf16* k, const bf16* v, const float* lse,
                           const float* delta, const bf16* dout, bf16* dk, bf16* dv, int s,
                           int skeys, int hq, int hk, float scale) {
  constexpr int P = kMmaPitch<D>;
  constexpr int kDTiles = D / 8;
  constexpr int kQTiles = kBwdCols / 8;  // n-tiles of queries per inner tile
  PTDP_DYNAMIC_SMEM(smem);
  bf16* sk = reinterpret_cast<bf16*>(smem);                         // [kRowTile][P] keys
  bf16* sv = sk + kRowTile * P;                                     // [kRowTile][P] values
  bf16* sq = sv + kRowTile * P;                                     // [2][kBwdCols][P] queries
  bf16* sdo = sq + 2 * kInnerTile<D>;                               // [2][kBwdCols][P] dO
  float* slse = reinterpret_cast<float*>(sdo + 2 * kInnerTile<D>);  // [2][kBwdCols], base 2
  float* sdelta = slse + 2 * kBwdCols;                              // [2][kBwdCols]

  const int bi = blockIdx.z, kh = blockIdx.y, k0 = blockIdx.x * kRowTile;
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
  const int key0 = k0 + 16 * warp + g, key1 = key0 + 8;
  const int group = hq / hk;
  const float scale_log2 = scale * kLog2e;
  const int64_t qstride = static_cast<int64_t>(hq) * D, kstride = static_cast<int64_t>(hk) * D;
  const int64_t koff = static_cast<int64_t>(bi) * skeys * kstride + static_cast<int64_t>(kh) * D;
  const int shift = skeys - s;

  // Inner tile i: query head kh * group + i / per_head, queries from first + (i % per_head) *
  // kBwdCols, first = k0 - shift the first query that sees key k0 (the tiles at or below the
  // diagonal). Its lse and delta travel through registers of the first kBwdCols threads: loaded
  // when the copy starts, stored before the barrier.
  const int first = max(0, k0 - shift);
  const int per_head = (s - first + kBwdCols - 1) / kBwdCols, tiles = group * per_head;
  float next_lse = 0.0f, next_delta = 0.0f;
  auto start_tile = [&](int i) {
    const int h = kh * group + i / per_head, q0 = first + (i % per_head) * kBwdCols;
    const int64_t qoff = static_cast<int64_t>(bi) * s * qstride + static_cast<int64_t>(h) * D;
    stage_async<D>(sq + (i & 1) * kInnerTile<D>, q + qoff, qstride, q0, kBwdCols, s);
    stage_async<D>(sdo + (i & 1) * kInnerTile<D>, dout + qoff, qstride, q0, kBwdCols, s);
    cp_async_commit();
    if (threadIdx.x < kBwdCols) {
      const int row = q0 + threadIdx.x;
      const int64_t stat = (static_cast<int64_t>(bi) * hq + h) * s + row;
      next_lse = row < s ? lse[stat] * kLog2e : 0.0f;
      next_delta = row < s ? delta[stat] : 0.0f;
    }
  };
  auto finish_tile = [&](int i) {
    if (threadIdx.x < kBwdCols) {
      slse[(i & 1) * kBwdCols + threadIdx.x] = next_lse;
      sdelta[(i & 1) * kBwdCols + threadIdx.x] = next_delta;
    }
    cp_async_wait<0>();
    __syncthreads();
  };
  stage_async<D>(sk, k + koff, kstride, k0, kRowTile, skeys);
  stage_async<D>(sv, v + koff, kstride, k0, kRowTile, skeys);
  start_tile(0);  // commits the keys and values with it
  finish_tile(0);

  float dka[kDTiles][4], dva[kDTiles][4];
#pragma unroll
  for (int n = 0; n < kDTiles; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.0f;

  for (int i = 0; i < tiles; ++i) {
    if (i + 1 < tiles) start_tile(i + 1);  // its buffer was last read before the barrier
    const int q0 = first + (i % per_head) * kBwdCols, buf = i & 1;
    const bf16* tq = sq + buf * kInnerTile<D>;
    const bf16* tdo = sdo + buf * kInnerTile<D>;
    const float* tlse = slse + buf * kBwdCols;
    const float* tdelta = sdelta + buf * kBwdCols;
    if (q0 + kBwdCols - 1 + shift >= k0 + 16 * warp) {  // else no query sees this warp's keys
      // s^T = k q^T and dp^T = v do^T: rows are this warp's 16 keys, columns the tile's queries.
      float st[kQTiles][4], dpt[kQTiles][4];
      two_products<D, kBwdCols>(st, dpt, sk, sv, tq, tdo);
      // p^T and ds^T = p^T (dp^T - delta), in place.
#pragma unroll
      for (int n = 0; n < kQTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * n + 2 * t + (e & 1), query = q0 + col;
          const int key = e < 2 ? key0 : key1;
          const float p = prob(st[n][e], scale_log2, tlse[col], key <= query + shift && query < s);
          st[n][e] = p;
          dpt[n][e] = p * (dpt[n][e] - tdelta[col]);
        }
        // dv += p^T do and dk += ds^T q, 16 queries per k-step.
#pragma unroll
      for (int j = 0; j < kQTiles / 2; ++j) {
        uint32_t pa[4], dsa[4];
        c_to_a(pa, st[2 * j], st[2 * j + 1]);
        c_to_a(dsa, dpt[2 * j], dpt[2 * j + 1]);
#pragma unroll
        for (int n = 0; n < kDTiles; n += 2) {
          uint32_t b[4];
          load_b2<D>(b, tdo, 16 * j, 8 * n);
          mma_pair(dva[n], dva[n + 1], pa, b);
          load_b2<D>(b, tq, 16 * j, 8 * n);
          mma_pair(dka[n], dka[n + 1], dsa, b);
        }
      }
    }
    if (i + 1 < tiles) finish_tile(i + 1);
  }

  for (int half = 0; half < 2; ++half) {
    const int key = half == 0 ? key0 : key1;
    if (key >= skeys) continue;
    bf16* dkrow = dk + koff + static_cast<int64_t>(key) * kstride;
    bf16* dvrow = dv + koff + static_cast<int64_t>(key) * kstride;
#pragma unroll
    for (int n = 0; n < kDTiles; ++n) {
      *reinterpret_cast<uint32_t*>(dkrow + 8 * n + 2 * t) =
          pack(dka[n][2 * half] * scale, dka[n][2 * half + 1] * scale);
      *reinterpret_cast<uint32_t*>(dvrow + 8 * n + 2 * t) =
          pack(dva[n][2 * half], dva[n][2 * half + 1]);
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kMmaThreads)
    mma_backward_q_kernel(const bf16* q, const bf16* k, const bf16* v, const float* lse,
                          const float* delta, const bf16* dout, bf16* dq, int s, int skeys, int hq,
                          int hk, float scale) {
  constexpr int P = kMmaPitch<D>;
  constexpr int kDTiles = D / 8;
  constexpr int kKeyTiles = kBwdCols / 8;
  PTDP_DYNAMIC_SMEM(smem);
  bf16* sq = reinterpret_cast<bf16*>(smem);  // [kRowTile][P] queries
  bf16* sdo = sq + kRowTile * P;             // [kRowTile][P] output gradients
  bf16* sk = sdo + kRowTile * P;             // [2][kBwdCols][P] keys
  bf16* sv = sk + 2 * kInnerTile<D>;         // [2][kBwdCols][P] values

  // Query tiles longest first: a causal tile's work grows with q0, and blocks start in index
  // order, so the longest ones ending the grid would leave the GPU a long tail.
  const int bi = blockIdx.z, h = blockIdx.y, q0 = (gridDim.x - 1 - blockIdx.x) * kRowTile;
  const int kh = h / (hq / hk);
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
  const int row0 = q0 + 16 * warp + g, row1 = row0 + 8;
  const float scale_log2 = scale * kLog2e;
  const int64_t qstride = static_cast<int64_t>(hq) * D, kstride = static_cast<int64_t>(hk) * D;
  const int64_t qoff = static_cast<int64_t>(bi) * s * qstride + static_cast<int64_t>(h) * D;
  const int64_t koff = static_cast<int64_t>(bi) * skeys * kstride + static_cast<int64_t>(kh) * D;
  const int shift = skeys - s;
  const int64_t stat = (static_cast<int64_t>(bi) * hq + h) * s;
  const float lse0 = row0 < s ? lse[stat + row0] * kLog2e : 0.0f;
  const float lse1 = row1 < s ? lse[stat + row1] * kLog2e : 0.0f;
  const float delta0 = row0 < s ? delta[stat + row0] : 0.0f;
  const float delta1 = row1 < s ? delta[stat + row1] : 0.0f;

  // Inner tile i: keys from i * kBwdCols, up to the last key the block's last row sees.
  const int tiles = (min(q0 + kRowTile, s) + shift + kBwdCols - 1) / kBwdCols;
  auto start_tile = [&](int i) {
    stage_async<D>(sk + (i & 1) * kInnerTile<D>, k + koff, kstride, i * kBwdCols, kBwdCols, skeys);
    stage_async<D>(sv + (i & 1) * kInnerTile<D>, v + koff, kstride, i * kBwdCols, kBwdCols, skeys);
    cp_async_commit();
  };
  stage_async<D>(sq, q + qoff, qstride, q0, kRowTile, s);
  stage_async<D>(sdo, dout + qoff, qstride, q0, kRowTile, s);
  start_tile(0);  // commits the queries and output gradients with it
  cp_async_wait<0>();
  __syncthreads();

  float dqa[kDTiles][4];
#pragma unroll
  for (int n = 0; n < kDTiles; ++n) dqa[n][0] = dqa[n][1] = dqa[n][2] = dqa[n][3] = 0.0f;

  for (int i = 0; i < tiles; ++i) {
    if (i + 1 < tiles) start_tile(i + 1);  // its buffer was last read before the barrier
    const int k0 = i * kBwdCols;
    const bf16* tk = sk + (i & 1) * kInnerTile<D>;
    const bf16* tv = sv + (i & 1) * kInnerTile<D>;
    if (k0 <= q0 + 16 * warp + 15 + shift) {  // else no row of this warp sees the tile
      // s = q k^T and dp = do v^T for this warp's 16 queries against the tile's keys.
      float sc[kKeyTiles][4], dp[kKeyTiles][4];
      two_products<D, kBwdCols>(sc, dp, sq, sdo, tk, tv);
      // ds = p (dp - delta), in place of dp.
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + 8 * n + 2 * t + (e & 1), row = e < 2 ? row0 : row1;
          const float p =
              prob(sc[n][e], scale_log2, e < 2 ? lse0 : lse1, key <= row + shift && key < skeys);
          dp[n][e] = p * (dp[n][e] - (e < 2 ? delta0 : delta1));
        }
        // dq += ds k, 16 keys per k-step.
#pragma unroll
      for (int j = 0; j < kKeyTiles / 2; ++j) {
        uint32_t dsa[4];
        c_to_a(dsa, dp[2 * j], dp[2 * j + 1]);
#pragma unroll
        for (int n = 0; n < kDTiles; n += 2) {
          uint32_t b[4];
          load_b2<D>(b, tk, 16 * j, 8 * n);
          mma_pair(dqa[n], dqa[n + 1], dsa, b);
        }
      }
    }
    if (i + 1 < tiles) {
      cp_async_wait<0>();
      __syncthreads();
    }
  }

  for (int half = 0; half < 2; ++half) {
    const int row = half == 0 ? row0 : row1;
    if (row >= s) continue;
    bf16* dqrow = dq + qoff + static_cast<int64_t>(row) * qstride;
#pragma unroll
    for (int n = 0; n < kDTiles; ++n)
      *reinterpret_cast<uint32_t*>(dqrow + 8 * n + 2 * t) =
          pack(dqa[n][2 * half] * scale, dqa[n][2 * half + 1] * scale);
  }
}

// Dynamic shared memory of the two backward kernels, in bytes.
template <int D>
constexpr int kKvSmem = (2 * kRowTile * kMmaPitch<D> + 4 * kInnerTile<D>)*2 + 4 * kBwdCols * 4;
template <int D>
constexpr int kQSmem = (2 * kRowTile * kMmaPitch<D> + 4 * kInnerTile<D>)*2;

template <int D>
void forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int64_t b,
             int64_t s, int64_t sk, int64_t hq, int64_t hk, cudaStream_t stream) {
  const dim3 grid(blocks_for(s, kRowTile), static_cast<unsigned>(hq), static_cast<unsigned>(b));
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(D));
  PTDP_KERNEL_LAUNCH(mma_forward_kernel<D>, grid, kMmaThreads, 0, stream)
  (q, k, v, out, lse, static_cast<int>(s), static_cast<int>(sk), static_cast<int>(hq),
   static_cast<int>(hk), scale_log2);
  check_launch("mma_forward_kernel");
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
  launch_delta(out, dout, delta, b, s, hq, D, stream);
  // Above 48 KB of shared memory a kernel must opt in (sm_80: up to 163 KB, sm_90: 227 KB).
  PTDP_CUDA_CHECK(cudaFuncSetAttribute(mma_backward_kv_kernel<D>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kKvSmem<D>));
  PTDP_CUDA_CHECK(cudaFuncSetAttribute(mma_backward_q_kernel<D>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kQSmem<D>));
  const unsigned ub = static_cast<unsigned>(b);
  PTDP_KERNEL_LAUNCH(mma_backward_kv_kernel<D>,
                     dim3(blocks_for(sk, kRowTile), static_cast<unsigned>(hk), ub), kMmaThreads,
                     kKvSmem<D>, stream)
  (q, k, v, lse, delta, dout, dk, dv, si, ski, hqi, hki, scale);
  check_launch("mma_backward_kv_kernel");
  PTDP_KERNEL_LAUNCH(mma_backward_q_kernel<D>,
                     dim3(blocks_for(s, kRowTile), static_cast<unsigned>(hq), ub), kMmaThreads,
                     kQSmem<D>, stream)
  (q, k, v, lse, delta, dout, dq, si, ski, hqi, hki, scale);
  check_launch("mma_backward_q_kernel");
  PTDP_CUDA_CHECK(cudaFreeAsync(delta, stream));
}

}  // namespace

void mma_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int64_t b,
                 int64_t s, int64_t sk, int64_t hq, int64_t hk, int64_t d, cudaStream_t stream) {
  if (d == 64)
    forward<64>(q, k, v, out, lse, b, s, sk, hq, hk, stream);
  else
    forward<128>(q, k, v, out, lse, b, s, sk, hq, hk, stream);
}

void mma_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                  const bf16* dout, bf16* dq, bf16* dk, bf16* dv, int64_t b, int64_t s, int64_t sk,
                  int64_t hq, int64_t hk, int64_t d, cudaStream_t stream) {
  if (d == 64)
    backward<64>(q, k, v, out, lse, dout, dq, dk, dv, b, s, sk, hq, hk, stream);
  else
    backward<128>(q, k, v, out, lse, dout, dq, dk, dv, b, s, sk, hq, hk, stream);
}

}  // namespace ptdp::kernels::cuda::attention
