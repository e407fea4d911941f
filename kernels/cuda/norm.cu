// LayerNorm / RMSNorm fused with the residual add (kernels/cuda/norm.h). A row of h columns, h a
// multiple of 8 and the pointers 16-byte aligned, is held in registers and read once as 16-byte
// vectors: one warp per row up to 1024 columns (warp-shuffle sums, no block barrier), one block
// per row up to 8192. Other rows go one block per row, re-read from global memory (L1/L2-
// resident) once per pass, which keeps that kernel independent of h; on an H100 it is
// latency-bound (about 60 us for 4096 rows of 768, 200 GB/s; 1.6 TB/s at 4096 columns). The
// backward pass of a row held in registers also sums the weight gradients in the same read
// (norm_backward_fused_kernel).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/norm.h"

namespace ptdp::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// r = x + residual, rounded to bf16 exactly as stored in r_out.
__device__ __forceinline__ float residual_at(const bf16* x, const bf16* residual, int64_t i) {
  return residual ? to_float(to_bf16(to_float(x[i]) + to_float(residual[i]))) : to_float(x[i]);
}

template <bool kRms>
__global__ void __launch_bounds__(kThreads)
    norm_forward_kernel(const bf16* x, const bf16* residual, bf16* r_out, const bf16* g,
                        const bf16* b, bf16* y, float* mean_out, float* rstd_out, int64_t h,
                        float eps) {
  __shared__ float scratch[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * h;
  float mean = 0;
  if (!kRms) {
    float s = 0;
    for (int64_t e = threadIdx.x; e < h; e += blockDim.x) s += residual_at(x, residual, base + e);
    mean = block_sum(s, scratch) / static_cast<float>(h);
  }
  float ss = 0;  // sum of (r - mean)^2, or of r^2 for RMSNorm
  for (int64_t e = threadIdx.x; e < h; e += blockDim.x) {
    const float r = residual_at(x, residual, base + e);
    if (r_out) r_out[base + e] = to_bf16(r);
    ss += (r - mean) * (r - mean);
  }
  const float rstd = rsqrtf(block_sum(ss, scratch) / static_cast<float>(h) + eps);
  for (int64_t e = threadIdx.x; e < h; e += blockDim.x) {
    const float r = residual_at(x, residual, base + e);
    float out = (r - mean) * rstd * to_float(g[e]);
    if (!kRms) out += to_float(b[e]);
    y[base + e] = to_bf16(out);
  }
  if (threadIdx.x == 0) {
    if (!kRms) mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
}

// LayerNorm: dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * g.
// RMSNorm:   dx = rstd * dxhat - r * rstd^3 * mean(dxhat * r).
template <bool kRms>
__global__ void __launch_bounds__(kThreads)
    norm_backward_kernel(const bf16* r, const bf16* g, const float* mean_in, const float* rstd_in,
                         const bf16* dy, const bf16* dresid, bf16* dx, int64_t h) {
  __shared__ float scratch[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * h;
  const float mean = kRms ? 0.0f : mean_in[blockIdx.x], rstd = rstd_in[blockIdx.x];
  float a = 0, c = 0;  // sum dxhat, sum dxhat * xhat (LayerNorm) or dxhat * r (RMSNorm)
  for (int64_t e = threadIdx.x; e < h; e += blockDim.x) {
    const float dxhat = to_float(dy[base + e]) * to_float(g[e]);
    const float v = to_float(r[base + e]);
    a += dxhat;
    c += dxhat * (kRms ? v : (v - mean) * rstd);
  }
  const float inv_h = 1.0f / static_cast<float>(h);
  const float sum_a = kRms ? 0.0f : block_sum(a, scratch) * inv_h;
  const float sum_c = block_sum(c, scratch) * inv_h;
  for (int64_t e = threadIdx.x; e < h; e += blockDim.x) {
    const float dxhat = to_float(dy[base + e]) * to_float(g[e]);
    const float v = to_float(r[base + e]);
    float d = kRms ? dxhat * rstd - v * rstd * rstd * rstd * sum_c
                   : rstd * (dxhat - sum_a - (v - mean) * rstd * sum_c);
    if (dresid) d += to_float(dresid[base + e]);
    dx[base + e] = to_bf16(d);
  }
}

// ---- the row in registers, read as 16-byte vectors: one warp per row (rows up to 1024
// columns, kRowsPerBlock rows a block) or one block per row (up to 8192 columns) ----
constexpr int kRowVecs = 4;  // 16-byte vectors per thread
constexpr int64_t kWarpRowColumns = 32 * kRowVecs * kVec;
constexpr int64_t kBlockRowColumns = kThreads * kRowVecs * kVec;
constexpr int kRowsPerBlock = kThreads / 32;

// A 16-byte load cached at every level (ld.global.ca): the backward pass's second read of a row
// that the thread loaded in its first, which is an L1 hit where the first read is in registers
// that the compiler would otherwise keep across the team's sums.
__device__ __forceinline__ Bf16x8 reread(const Bf16x8* p) {
  const uint4 u = __ldca(reinterpret_cast<const uint4*>(p));
  Bf16x8 v;
  memcpy(&v, &u, sizeof v);
  return v;
}
__device__ __forceinline__ const Bf16x8* vec_row(const bf16* p, int64_t base) {
  return reinterpret_cast<const Bf16x8*>(p + base);
}

// Who holds which part of a row: kWarp, the 32 lanes of one warp per row; else the whole block.
template <bool kWarp>
struct RowTeam {
  int lane, stride;
  int64_t row;
  __device__ RowTeam()
      : lane(kWarp ? static_cast<int>(threadIdx.x % 32) : static_cast<int>(threadIdx.x)),
        stride(kWarp ? 32 : static_cast<int>(blockDim.x)),
        row(kWarp ? static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32
                  : static_cast<int64_t>(blockIdx.x)) {}
  // The sum over the team, returned to every member; every member must call it.
  __device__ float sum(float v, float* scratch) const {
    return kWarp ? warp_sum(v) : block_sum(v, scratch);
  }
};

template <bool kRms, bool kWarp>
__global__ void __launch_bounds__(kThreads)
    norm_forward_row_kernel(const bf16* x, const bf16* residual, bf16* r_out, const bf16* g,
                            const bf16* b, bf16* y, float* mean_out, float* rstd_out, int64_t n,
                            int64_t h, float eps) {
  __shared__ float scratch[32];
  const RowTeam<kWarp> team;
  if (team.row >= n) return;  // a whole warp (one row per block never returns here)
  const int64_t base = team.row * h;
  const int vecs = static_cast<int>(h / kVec);
  float v[kRowVecs][kVec];
  float s = 0;
  for (int k = 0; k < kRowVecs; ++k) {
    const int idx = team.lane + team.stride * k;
    if (idx >= vecs) break;
    const Bf16x8 xv = vec_row(x, base)[idx];
    Bf16x8 rv = xv;
    if (residual) rv = vec_row(residual, base)[idx];
    Bf16x8 out;
    for (int j = 0; j < kVec; ++j) {
      // r = x + residual rounded to bf16, exactly as stored in r_out (residual_at above).
      const float r =
          residual ? to_float(to_bf16(to_float(xv.v[j]) + to_float(rv.v[j]))) : to_float(xv.v[j]);
      v[k][j] = r;
      s += r;
      out.v[j] = to_bf16(r);
    }
    if (r_out) reinterpret_cast<Bf16x8*>(r_out + base)[idx] = out;
  }
  const float mean = kRms ? 0.0f : team.sum(s, scratch) / static_cast<float>(h);
  float ss = 0;
  for (int k = 0; k < kRowVecs; ++k) {
    if (team.lane + team.stride * k >= vecs) break;
    for (int j = 0; j < kVec; ++j) ss += (v[k][j] - mean) * (v[k][j] - mean);
  }
  const float rstd = rsqrtf(team.sum(ss, scratch) / static_cast<float>(h) + eps);
  for (int k = 0; k < kRowVecs; ++k) {
    const int idx = team.lane + team.stride * k;
    if (idx >= vecs) break;
    const Bf16x8 gv = vec_row(g, 0)[idx];
    Bf16x8 bv = gv;
    if (!kRms) bv = vec_row(b, 0)[idx];
    Bf16x8 out;
    for (int j = 0; j < kVec; ++j) {
      float o = (v[k][j] - mean) * rstd * to_float(gv.v[j]);
      if (!kRms) o += to_float(bv.v[j]);
      out.v[j] = to_bf16(o);
    }
    reinterpret_cast<Bf16x8*>(y + base)[idx] = out;
  }
  if (team.lane == 0) {
    if (!kRms) mean_out[team.row] = mean;
    rstd_out[team.row] = rstd;
  }
}

// ---- the backward pass reading each row once: dx, and the partial sums of the gamma (and
// beta) gradients per chunk of rows, which column_sums then adds up chunk by chunk. A block per
// chunk; a row to a warp (kWarp) or to the whole block, as in the forward pass. A thread reads
// its part of the row (kVecs 16-byte vectors each of dy and r) for the row's sums, then again
// with dresid for dx, and keeps its columns' gradient sums in registers across the chunk's
// rows. A block's
// warps add theirs into shared memory in warp order. The chunks depend on n alone (at most
// kBackwardChunks), so the order of every sum does too. Two passes (dx, then the column sums
// re-reading r and dy) move 6 bytes an element where 4 are needed, at most 2/3 of the copy
// bandwidth by construction.
// Registers set the occupancy here (ptxas -v, sm_90): holding the row and g across the team's
// sums took 127 registers a thread at 2 vectors a thread and 172 at 3 (GPT-2's 768 columns a
// warp), one block of 8 warps an SM, and the H200 moved 36.5% of its copy bandwidth at 4096
// columns. So the second pass reads its vectors of dy, r and g again from L1 (reread: this
// thread loaded them a moment before), and a thread keeps its dy and r only through the first
// pass; up to 2 vectors a thread (512 columns a warp, 4096 a block) it loads the next row's
// while it works on this one, so two rows are in flight. 106 registers at 2 vectors with the
// next row, 127 at 3: two blocks an SM with no spills, which __launch_bounds__ now asks for up
// to 3 vectors. ----
constexpr int kBackwardChunks = 256;

// LayerNorm: dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * g,
// xhat = (r - mean) * rstd. RMSNorm is the same with mean 0 and without the mean(dxhat) term.
template <bool kRms, bool kWarp, int kVecs, bool kAhead = (kVecs <= 2)>
__global__ void __launch_bounds__(kThreads, kVecs <= 3 ? 2 : 1)
    norm_backward_fused_kernel(const bf16* r, const bf16* g, const float* mean_in,
                               const float* rstd_in, const bf16* dy, const bf16* dresid, bf16* dx,
                               float* partial, int outputs, int chunks, int64_t n, int64_t h,
                               int64_t rows_per_chunk) {
  __shared__ float scratch[64];
  __shared__ float warp_sums[kWarp ? 2 * kWarpRowColumns : 1];
  const int lane = kWarp ? static_cast<int>(threadIdx.x % 32) : static_cast<int>(threadIdx.x);
  const int stride = kWarp ? 32 : static_cast<int>(blockDim.x);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows_per_chunk;
  const int64_t end = first + rows_per_chunk < n ? first + rows_per_chunk : n;
  const int vecs = static_cast<int>(h / kVec);
  const float inv_h = 1.0f / static_cast<float>(h);
  auto team_sum = [&](float v) { return kWarp ? warp_sum(v) : block_sum(v, scratch); };
  // The two sums of a LayerNorm row in one exchange (one block barrier pair, not two).
  auto team_sum2 = [&](float& a, float& c) {
    if constexpr (kWarp) {
      a = warp_sum(a);
      c = warp_sum(c);
    } else {
      block_sum2(a, c, scratch);
    }
  };
  float dg[kVecs][kVec] = {}, db[kVecs][kVec] = {};
  // Where registers allow (a row ahead, a block a row: 4096 columns), a thread holds its dresid
  // from the row's load to dx; elsewhere that load is asked of L2 then and made at dx.
  constexpr bool kResidInRegs = kAhead && !kWarp;
  // A row's dy, r and dresid (if any), all issued before any is used.
  auto load_row = [&](int64_t row, Bf16x8(&d)[kVecs], Bf16x8(&x)[kVecs], Bf16x8(&e)[kVecs]) {
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int idx = lane + stride * k;
      if (idx >= vecs) continue;
      d[k] = vec_row(dy, row * h)[idx];
      x[k] = vec_row(r, row * h)[idx];
      if (!dresid) continue;
      if constexpr (kResidInRegs)
        e[k] = vec_row(dresid, row * h)[idx];
      else
        prefetch_l2(vec_row(dresid, row * h) + idx);
    }
  };
  // A later row's dy, r and dresid asked of L2 (prefetch_l2): more bytes in flight than the
  // registers hold, so that its loads, when they come, wait on L2 rather than on memory. (Rows
  // are their owners' alone, so no row prefetched is written meanwhile.)
  auto prefetch_row = [&](int64_t row) {
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int idx = lane + stride * k;
      if (idx >= vecs) continue;
      prefetch_l2(vec_row(dy, row * h) + idx);
      prefetch_l2(vec_row(r, row * h) + idx);
      if (dresid) prefetch_l2(vec_row(dresid, row * h) + idx);
    }
  };
  // One row, its dy, r and dresid in registers: dg, db and the row's sums from dy and r, then
  // dx from a second read of dy and r (from L1) and the dresid held since the load.
  auto process = [&](int64_t row, const Bf16x8(&dv)[kVecs], const Bf16x8(&rv)[kVecs],
                     const Bf16x8(&ev)[kVecs]) {
    const int64_t base = row * h;
    const float mean = kRms ? 0.0f : mean_in[row], rstd = rstd_in[row];
    float a = 0, c = 0;  // sums of dxhat and dxhat * xhat
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (lane + stride * k >= vecs) continue;
      const Bf16x8 gk = reread(vec_row(g, 0) + lane + stride * k);
      for (int j = 0; j < kVec; ++j) {
        const float d = to_float(dv[k].v[j]), xhat = (to_float(rv[k].v[j]) - mean) * rstd;
        const float dxhat = d * to_float(gk.v[j]);
        a += dxhat;
        c += dxhat * xhat;
        dg[k][j] += d * xhat;
        if (!kRms) db[k][j] += d;
      }
    }
    if constexpr (kRms) {
      c = team_sum(c);
    } else {
      team_sum2(a, c);
    }
    const float mean_a = kRms ? 0.0f : a * inv_h, mean_c = c * inv_h;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int idx = lane + stride * k;
      if (idx >= vecs) continue;
      // The row again, from L1 (this thread read it a moment ago), not from registers.
      const Bf16x8 d8 = reread(vec_row(dy, base) + idx), r8 = reread(vec_row(r, base) + idx);
      const Bf16x8 g8 = reread(vec_row(g, 0) + idx);
      Bf16x8 res{};
      if (dresid) res = kResidInRegs ? ev[k] : vec_row(dresid, base)[idx];
      Bf16x8 out;
      for (int j = 0; j < kVec; ++j) {
        const float xhat = (to_float(r8.v[j]) - mean) * rstd;
        float d = rstd * (to_float(d8.v[j]) * to_float(g8.v[j]) - mean_a - xhat * mean_c);
        if (dresid) d += to_float(res.v[j]);
        out.v[j] = to_bf16(d);
      }
      reinterpret_cast<Bf16x8*>(dx + base)[idx] = out;  // after the row's loads: dx may be dy
    }
  };
  // Rows uniform over the team (a warp, or the block whose block_sum every thread must reach).
  const int64_t row0 = first + (kWarp ? warp : 0), step = kWarp ? kRowsPerBlock : 1;
  if constexpr (kAhead) {
    Bf16x8 dv[kVecs]{}, rv[kVecs]{}, ev[kVecs]{};  // zeros: the host compilers ask
    if (row0 < end) load_row(row0, dv, rv, ev);
    for (int64_t row = row0; row < end; row += step) {
      Bf16x8 dv_next[kVecs]{}, rv_next[kVecs]{}, ev_next[kVecs]{};
      // In flight through this row's work. (This row's dx, which may be dy or dresid, is not
      // the next row.)
      if (row + step < end) load_row(row + step, dv_next, rv_next, ev_next);
      if (row + 2 * step < end) prefetch_row(row + 2 * step);
      process(row, dv, rv, ev);
#pragma unroll
      for (int k = 0; k < kVecs; ++k) dv[k] = dv_next[k], rv[k] = rv_next[k], ev[k] = ev_next[k];
    }
  } else {
    for (int64_t row = row0; row < end; row += step) {
      Bf16x8 dv[kVecs]{}, rv[kVecs]{}, ev[kVecs]{};
      load_row(row, dv, rv, ev);
      if (row + step < end) prefetch_row(row + step);
      process(row, dv, rv, ev);
    }
  }
  if (!partial) return;  // no weight gradients (uniform over the block)
  float* out0 = partial + static_cast<int64_t>(blockIdx.x) * h;  // output k at + k chunks h
  const int64_t next = static_cast<int64_t>(chunks) * h;
  if constexpr (!kWarp) {  // a thread's columns are its own
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int idx = lane + stride * k;
      if (idx >= vecs) continue;
      for (int j = 0; j < kVec; ++j) {
        out0[idx * kVec + j] = dg[k][j];
        if (outputs == 2) out0[next + idx * kVec + j] = db[k][j];
      }
    }
  } else {
    for (int w = 0; w < kRowsPerBlock; ++w) {  // the warps' sums, in warp order
      if (warp == w) {
#pragma unroll
        for (int k = 0; k < kVecs; ++k) {
          const int idx = lane + stride * k;
          if (idx >= vecs) continue;
          for (int j = 0; j < kVec; ++j) {
            float* s = warp_sums + idx * kVec + j;
            s[0] = (w == 0 ? 0.0f : s[0]) + dg[k][j];
            s[kWarpRowColumns] = (w == 0 ? 0.0f : s[kWarpRowColumns]) + db[k][j];
          }
        }
      }
      __syncthreads();
    }
    for (int64_t col = threadIdx.x; col < h; col += blockDim.x) {
      out0[col] = warp_sums[col];
      if (outputs == 2) out0[next + col] = warp_sums[kWarpRowColumns + col];
    }
  }
}

// How a row of h columns is normalised: the block-per-row kernels above re-reading it, or in
// registers by a warp or by a block.
enum class RowKernel { kReread, kWarp, kBlock };
RowKernel row_kernel(int64_t h, std::initializer_list<const void*> pointers) {
  if (!vectorizable(h, pointers) || h > kBlockRowColumns) return RowKernel::kReread;
  return h <= kWarpRowColumns ? RowKernel::kWarp : RowKernel::kBlock;
}
unsigned warp_row_blocks(int64_t n) {
  return static_cast<unsigned>((n + kRowsPerBlock - 1) / kRowsPerBlock);
}

// dg: dy * xhat (LayerNorm) or dy * r * rstd (RMSNorm); db: dy.
struct GammaGrad {
  const bf16 *r, *dy;
  const float *mean, *rstd;
  int64_t h;
  __device__ float operator()(int64_t row, int64_t c) const {
    const float m = mean ? mean[row] : 0.0f;
    return to_float(dy[row * h + c]) * (to_float(r[row * h + c]) - m) * rstd[row];
  }
};
struct BetaGrad {
  const bf16* dy;
  int64_t h;
  __device__ float operator()(int64_t row, int64_t c) const { return to_float(dy[row * h + c]); }
};

// dg (and db: kOutputs 2) 8 columns a thread from 16-byte loads of r and dy, in one pass.
template <int K>
struct GammaBetaGradVec {
  static constexpr int kOutputs = K;
  const bf16 *r, *dy;
  const float *mean, *rstd;
  int64_t h;
  struct In {
    Bf16x8 r, dy;
    float mean, rstd;
  };
  __device__ In load(int64_t row, int64_t c0) const {
    return {*reinterpret_cast<const Bf16x8*>(r + row * h + c0),
            *reinterpret_cast<const Bf16x8*>(dy + row * h + c0), mean ? mean[row] : 0.0f,
            rstd[row]};
  }
  __device__ void operator()(int64_t, int64_t, const In& in, float (&v)[K][kVec]) const {
    for (int e = 0; e < kVec; ++e) {
      const float g = to_float(in.dy.v[e]);
      v[0][e] = g * (to_float(in.r.v[e]) - in.mean) * in.rstd;
      if constexpr (K == 2) v[1][e] = g;
    }
  }
};

template <bool kRms>
void forward(const bf16* x, const bf16* residual, bf16* r_out, const bf16* g, const bf16* b,
             bf16* y, float* mean, float* rstd, int64_t n, int64_t h, float eps,
             cudaStream_t stream) {
  if (n <= 0 || h <= 0) return;
  if (const RowKernel kind = row_kernel(h, {x, residual, r_out, g, b, y});
      kind == RowKernel::kWarp) {
    PTDP_KERNEL_LAUNCH((norm_forward_row_kernel<kRms, true>), warp_row_blocks(n), kThreads, 0,
                       stream)
    (x, residual, r_out, g, b, y, mean, rstd, n, h, eps);
    check_launch("norm_forward_kernel (one warp per row)");
    return;
  } else if (kind == RowKernel::kBlock) {
    PTDP_KERNEL_LAUNCH((norm_forward_row_kernel<kRms, false>), static_cast<unsigned>(n), kThreads,
                       0, stream)
    (x, residual, r_out, g, b, y, mean, rstd, n, h, eps);
    check_launch("norm_forward_kernel (row in registers)");
    return;
  }
  PTDP_KERNEL_LAUNCH(norm_forward_kernel<kRms>, static_cast<unsigned>(n), kThreads, 0, stream)
  (x, residual, r_out, g, b, y, mean, rstd, h, eps);
  check_launch("norm_forward_kernel");
}

// The fused backward kernel for a team of kWarp ? 32 : kThreads threads a row: dx, and dg (and
// db) through the chunks' partial sums.
template <bool kRms, bool kWarp>
void backward_in_one_read(const bf16* r, const bf16* g, const float* mean, const float* rstd,
                          const bf16* dy, const bf16* dresid, bf16* dx, float* dg, float* db,
                          int64_t n, int64_t h, cudaStream_t stream) {
  const int64_t lanes = kWarp ? 32 : kThreads;
  const int64_t per_thread = (h / kVec + lanes - 1) / lanes;  // 1 to kRowVecs vectors
  auto kernel = norm_backward_fused_kernel<kRms, kWarp, kRowVecs>;
  if (per_thread == 1) kernel = norm_backward_fused_kernel<kRms, kWarp, 1>;
  if (per_thread == 2) kernel = norm_backward_fused_kernel<kRms, kWarp, 2>;
  if (per_thread == 3) kernel = norm_backward_fused_kernel<kRms, kWarp, 3>;
  if (!dg && db) column_sum(BetaGrad{dy, h}, db, n, h, stream);  // before dx (may be dy) is written
  const int outputs = dg ? (db ? 2 : 1) : 0;
  const ColumnChunks cc(n, kBackwardChunks);
  auto launch = [&](float* partial) {
    PTDP_KERNEL_LAUNCH(kernel, static_cast<unsigned>(cc.chunks), kThreads, 0, stream)
    (r, g, mean, rstd, dy, dresid, dx, partial, outputs, cc.chunks, n, h, cc.per);
    check_launch(kWarp ? "norm_backward_kernel (one warp per row)"
                       : "norm_backward_kernel (row in registers)");
  };
  if (outputs == 0) return launch(nullptr);
  float* const out[2] = {dg, db};
  column_sums(cc, out, outputs, h, stream, launch);
}

template <bool kRms>
void backward(const bf16* r, const bf16* g, const float* mean, const float* rstd, const bf16* dy,
              const bf16* dresid, bf16* dx, float* dg, float* db, int64_t n, int64_t h,
              cudaStream_t stream) {
  if (n <= 0 || h <= 0) return;
  if (const RowKernel kind = row_kernel(h, {r, g, dy, dresid, dx}); kind == RowKernel::kWarp) {
    backward_in_one_read<kRms, true>(r, g, mean, rstd, dy, dresid, dx, dg, db, n, h, stream);
    return;
  } else if (kind == RowKernel::kBlock) {
    backward_in_one_read<kRms, false>(r, g, mean, rstd, dy, dresid, dx, dg, db, n, h, stream);
    return;
  }
  // Rows re-read from memory: the column sums first, since they read dy, which dx may alias.
  if (dg && vectorizable(h, {r, dy})) {  // one pass over r and dy for both sums
    if (db)
      column_sum_vec(GammaBetaGradVec<2>{r, dy, mean, rstd, h}, {dg, db}, n, h, stream);
    else
      column_sum_vec(GammaBetaGradVec<1>{r, dy, mean, rstd, h}, {dg}, n, h, stream);
  } else {
    if (dg) column_sum(GammaGrad{r, dy, mean, rstd, h}, dg, n, h, stream);
    if (db) column_sum(BetaGrad{dy, h}, db, n, h, stream);
  }
  PTDP_KERNEL_LAUNCH(norm_backward_kernel<kRms>, static_cast<unsigned>(n), kThreads, 0, stream)
  (r, g, mean, rstd, dy, dresid, dx, h);
  check_launch("norm_backward_kernel");
}

}  // namespace

void add_layernorm_forward(const bf16* x, const bf16* residual, bf16* r_out, const bf16* g,
                           const bf16* b, bf16* y, float* mean, float* rstd, int64_t n, int64_t h,
                           float eps, cudaStream_t stream) {
  forward<false>(x, residual, r_out, g, b, y, mean, rstd, n, h, eps, stream);
}

void add_layernorm_backward(const bf16* r, const bf16* g, const float* mean, const float* rstd,
                            const bf16* dy, const bf16* dresid, bf16* dx, float* dg, float* db,
                            int64_t n, int64_t h, cudaStream_t stream) {
  backward<false>(r, g, mean, rstd, dy, dresid, dx, dg, db, n, h, stream);
}

void add_rmsnorm_forward(const bf16* x, const bf16* residual, bf16* r_out, const bf16* g, bf16* y,
                         float* rstd, int64_t n, int64_t h, float eps, cudaStream_t stream) {
  forward<true>(x, residual, r_out, g, nullptr, y, nullptr, rstd, n, h, eps, stream);
}

void add_rmsnorm_backward(const bf16* r, const bf16* g, const float* rstd, const bf16* dy,
                          const bf16* dresid, bf16* dx, float* dg, int64_t n, int64_t h,
                          cudaStream_t stream) {
  backward<true>(r, g, nullptr, rstd, dy, dresid, dx, dg, nullptr, n, h, stream);
}

}  // namespace ptdp::kernels::cuda
