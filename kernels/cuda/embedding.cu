// Token and position embedding kernels (kernels/cuda/embedding.h).
#include <algorithm>
#include <climits>
#include <stdexcept>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/embedding.h"

namespace ptdp::kernels::cuda {
namespace {

// ---- the embedding table's gradient, deterministic and without atomics ----
// Block b owns table rows [b kVocabTile, (b + 1) kVocabTile) of the vocabulary shard [v0, v0 +
// vl). It scans the n tokens in order, kBlock * kTokensPerThread at a time, and compacts the
// positions whose token falls in its tile into a list in shared memory, in token order (a scan
// of the threads' counts by warp shuffles, then across the warps). When the list might not take
// another chunk, and at the end, it adds the dy row of each listed position to its table row,
// in list order, so every table row sums its tokens in order, as the CPU does. dtable is fp32;
// dy is T (fp32 or bf16). blockDim.x must be kBlock.
// With `vectors` (h a multiple of 8, dy and dtable 16-byte aligned: vectorizable(h, {dy,
// dtable})) a thread takes 8 columns of kHitGroup listed rows at once: every load of the group
// (one or two 16-byte loads of dy a row, two float4 of dtable) is issued before any add, and a
// row that recurs in the group continues from its earlier sum in registers, so the adds and
// their order are the same as one row at a time. (The kernel before this one walked all kBlock
// slots of every chunk that held a hit, one shared-memory read each, and added one row at a
// time: on an H200 the bench's embedding forward and backward moved 28% of the copy bandwidth.)
constexpr int64_t kVocabTile = 128;
constexpr int kTokensPerThread = 4, kHitGroup = 4;
// Adds the dy rows at positions pos[0..count) to table rows row[0..count), in list order.
template <int kBlock, typename T>
__device__ void add_listed_rows(const int64_t* pos, const int32_t* row, int count, const T* dy,
                                float* dtable, int64_t h, bool vectors) {
  if (!vectors) {
    for (int j = 0; j < count; ++j) {
      float* out = dtable + static_cast<int64_t>(row[j]) * h;
      const T* in = dy + pos[j] * h;
      for (int64_t e = threadIdx.x; e < h; e += kBlock) out[e] += as_float(in[e]);
    }
    return;
  }
  for (int g = 0; g < count; g += kHitGroup) {
    const int m = count - g < kHitGroup ? count - g : kHitGroup;
    int64_t p[kHitGroup];
    int32_t r[kHitGroup];
#pragma unroll
    for (int j = 0; j < kHitGroup; ++j) {
      p[j] = j < m ? pos[g + j] : 0;
      r[j] = j < m ? row[g + j] : -1;
    }
    for (int64_t e = threadIdx.x * kVec; e < h; e += kBlock * kVec) {
      float d[kHitGroup][kVec] = {}, t[kHitGroup][kVec] = {};
#pragma unroll
      for (int j = 0; j < kHitGroup; ++j) {
        if (j >= m) continue;
        load8(dy + p[j] * h + e, d[j]);
        load8(dtable + static_cast<int64_t>(r[j]) * h + e, t[j]);
      }
#pragma unroll
      for (int j = 0; j < kHitGroup; ++j) {
        if (j >= m) continue;
#pragma unroll
        for (int k = 0; k < j; ++k)  // the latest earlier entry of the same row holds its sum
          if (r[k] == r[j])
            for (int q = 0; q < kVec; ++q) t[j][q] = t[k][q];
        for (int q = 0; q < kVec; ++q) t[j][q] += d[j][q];
      }
#pragma unroll
      for (int j = 0; j < kHitGroup; ++j)  // in order: a repeated row's last store has its sum
        if (j < m) store8(dtable + static_cast<int64_t>(r[j]) * h + e, t[j]);
    }
  }
}

template <int kBlock, typename T>
__device__ void add_token_rows_of_tile(const int32_t* tokens, const T* dy, float* dtable, int64_t n,
                                       int64_t h, int64_t v0, int64_t vl, bool vectors) {
  constexpr int kChunk = kBlock * kTokensPerThread, kList = 2 * kChunk, kWarps = kBlock / 32;
  __shared__ int64_t list_pos[kList];
  __shared__ int32_t list_row[kList];
  __shared__ int warp_hits[kWarps];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kVocabTile;
  const int64_t hi = lo + kVocabTile < vl ? lo + kVocabTile : vl;
  int listed = 0;  // the same in every thread
  int32_t tok[kTokensPerThread];
  auto load_chunk = [&](int64_t base) {  // this thread's consecutive tokens of a chunk
#pragma unroll
    for (int q = 0; q < kTokensPerThread; ++q) {
      const int64_t i = base + static_cast<int64_t>(threadIdx.x) * kTokensPerThread + q;
      tok[q] = i < n ? tokens[i] : 0;
    }
  };
  load_chunk(0);
  for (int64_t base = 0; base < n; base += kChunk) {
    int64_t mine[kTokensPerThread];  // a row of the tile, or -1
    int count = 0;
#pragma unroll
    for (int q = 0; q < kTokensPerThread; ++q) {
      const int64_t i = base + static_cast<int64_t>(threadIdx.x) * kTokensPerThread + q;
      const int64_t t = static_cast<int64_t>(tok[q]) - v0;
      mine[q] = i < n && t >= lo && t < hi ? t : -1;
      count += mine[q] >= 0 ? 1 : 0;
    }
    if (base + kChunk < n) load_chunk(base + kChunk);  // in flight while this chunk is listed
    int before = count;  // inclusive scan over the warp's lanes, then the warps before
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, before, o);
      if (lane >= o) before += v;
    }
    if (lane == 31) warp_hits[warp] = before;
    __syncthreads();
    int total = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += warp_hits[w];
      total += warp_hits[w];
    }
    int at = listed + before - count;
#pragma unroll
    for (int q = 0; q < kTokensPerThread; ++q)
      if (mine[q] >= 0) {
        list_pos[at] = base + static_cast<int64_t>(threadIdx.x) * kTokensPerThread + q;
        list_row[at] = static_cast<int32_t>(mine[q]);
        ++at;
      }
    listed += total;
    __syncthreads();  // the list is complete; warp_hits may be rewritten
    if (listed > kList - kChunk || base + kChunk >= n) {
      add_listed_rows<kBlock>(list_pos, list_row, listed, dy, dtable, h, vectors);
      listed = 0;
      __syncthreads();  // the list is read before the next chunk rewrites it
    }
  }
}
inline unsigned vocab_tiles(int64_t vl) {
  return static_cast<unsigned>((vl + kVocabTile - 1) / kVocabTile);
}

__global__ void embedding_forward_kernel(const int32_t* tokens, const bf16* table, const bf16* pos,
                                         bf16* y, int64_t sl, int64_t h, int64_t v0, int64_t vl,
                                         int64_t first) {
  const int64_t i = blockIdx.x;  // one block per token
  const int64_t tok = tokens[i] - v0;
  const bool here = tok >= 0 && tok < vl;
  const bf16* prow = pos ? pos + (first + i % sl) * h : nullptr;
  for (int64_t e = threadIdx.x; e < h; e += blockDim.x) {
    float x = here ? to_float(table[tok * h + e]) : 0.0f;
    if (prow) x += to_float(prow[e]);
    y[i * h + e] = to_bf16(x);
  }
}

// The same, 8 columns a thread from 16-byte loads (vectorizable(h, {table, pos, y})), the
// table's and the positions' loads of kForwardUnroll vectors issued before any store (the
// compiler may not move a load above a store to y, which might alias them).
constexpr int kForwardUnroll = 4;
__global__ void embedding_forward_vec_kernel(const int32_t* tokens, const bf16* table,
                                             const bf16* pos, bf16* y, int64_t sl, int64_t h,
                                             int64_t v0, int64_t vl, int64_t first) {
  const int64_t i = blockIdx.x;  // one block per token
  const int64_t tok = tokens[i] - v0;
  const bool here = tok >= 0 && tok < vl;
  const bf16* prow = pos ? pos + (first + i % sl) * h : nullptr;
  const int64_t step = static_cast<int64_t>(blockDim.x) * kVec;
  for (int64_t e0 = threadIdx.x * kVec; e0 < h; e0 += step * kForwardUnroll) {
    Bf16x8 x[kForwardUnroll]{}, p[kForwardUnroll]{};  // as loaded: 4 registers a vector
#pragma unroll
    for (int u = 0; u < kForwardUnroll; ++u) {
      const int64_t e = e0 + u * step;
      if (e >= h) continue;
      if (here) x[u] = *reinterpret_cast<const Bf16x8*>(table + tok * h + e);
      if (prow) p[u] = *reinterpret_cast<const Bf16x8*>(prow + e);
    }
#pragma unroll
    for (int u = 0; u < kForwardUnroll; ++u) {
      const int64_t e = e0 + u * step;
      if (e >= h) continue;
      Bf16x8 o;
      for (int j = 0; j < kVec; ++j) {  // zero for a token off the shard; -0 stays -0
        float v = here ? to_float(x[u].v[j]) : 0.0f;
        if (prow) v += to_float(p[u].v[j]);
        o.v[j] = to_bf16(v);
      }
      *reinterpret_cast<Bf16x8*>(y + i * h + e) = o;
    }
  }
}

// The table gradient by vocabulary tiles (above): every table row sums its tokens in order.
constexpr int kGradThreads = 256;
__global__ void __launch_bounds__(kGradThreads, 2)
    embedding_table_grad_kernel(const int32_t* tokens, const bf16* dy, float* dtable, int64_t n,
                                int64_t h, int64_t v0, int64_t vl, bool vectors) {
  add_token_rows_of_tile<kGradThreads>(tokens, dy, dtable, n, h, v0, vl, vectors);
}

// The table gradient by grouped rows (group_token_rows): thread (row k, vector) adds the row's dy
// vectors in token order onto its fp32 sum, kRowHitsAhead rows' loads issued before their adds
// and the next kRowHitsAhead rows prefetched into L2 (a row of many hits is a chain of batches).
constexpr int kRowHitsAhead = 8;
struct GroupedRows {
  const int32_t *rows, *offsets, *positions;
  __device__ GroupedRows(const int32_t* packed, int64_t m)
      : rows(packed), offsets(packed + m), positions(packed + 2 * m + 1) {}
};
template <typename T>
__global__ void table_grad_rows_vec_kernel(const int32_t* packed, int64_t m, const T* dy,
                                           float* dtable, int64_t h) {
  const int64_t vecs = h / kVec;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tid >= m * vecs) return;
  const GroupedRows g(packed, m);
  const int64_t k = tid / vecs, e = (tid - k * vecs) * kVec;
  float* out = dtable + static_cast<int64_t>(g.rows[k]) * h + e;
  float sum[kVec];
  load8(out, sum);
  const int32_t end = g.offsets[k + 1];
  for (int32_t i = g.offsets[k]; i < end; i += kRowHitsAhead) {
    // The batch after this one asked of L2 now, so that its loads (a long row's next batch)
    // wait on L2 rather than on memory.
#pragma unroll
    for (int j = kRowHitsAhead; j < 2 * kRowHitsAhead; ++j)
      if (i + j < end) prefetch_l2(dy + static_cast<int64_t>(g.positions[i + j]) * h + e);
    float d[kRowHitsAhead][kVec];
#pragma unroll
    for (int j = 0; j < kRowHitsAhead; ++j)
      if (i + j < end) load8(dy + static_cast<int64_t>(g.positions[i + j]) * h + e, d[j]);
#pragma unroll
    for (int j = 0; j < kRowHitsAhead; ++j)
      if (i + j < end)
        for (int q = 0; q < kVec; ++q) sum[q] += d[j][q];
  }
  store8(out, sum);
}
template <typename T>
__global__ void table_grad_rows_kernel(const int32_t* packed, int64_t m, const T* dy, float* dtable,
                                       int64_t h) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tid >= m * h) return;
  const GroupedRows g(packed, m);
  const int64_t k = tid / h, c = tid - k * h;
  float* out = dtable + static_cast<int64_t>(g.rows[k]) * h + c;
  float sum = *out;
  for (int32_t i = g.offsets[k]; i < g.offsets[k + 1]; ++i)
    sum += as_float(dy[static_cast<int64_t>(g.positions[i]) * h + c]);
  *out = sum;
}

template <typename T>
void table_grad_rows(const int32_t* packed, int64_t m, const T* dy, float* dtable, int64_t h,
                     cudaStream_t stream) {
  if (m <= 0 || h <= 0) return;
  constexpr int kThreadsPerBlock = 256;
  if (vectorizable(h, {dy, dtable})) {
    PTDP_KERNEL_LAUNCH(table_grad_rows_vec_kernel<T>, blocks_for(m * (h / kVec), kThreadsPerBlock),
                       kThreadsPerBlock, 0, stream)
    (packed, m, dy, dtable, h);
    check_launch("embedding_table_grad_rows (8-element vectors)");
    return;
  }
  PTDP_KERNEL_LAUNCH(table_grad_rows_kernel<T>, blocks_for(m * h, kThreadsPerBlock),
                     kThreadsPerBlock, 0, stream)
  (packed, m, dy, dtable, h);
  check_launch("embedding_table_grad_rows");
}

// The position gradient 8 columns a thread (h a multiple of 8, dy and dpos 16-byte aligned),
// the sequences summed in the same order as the scalar kernel.
__global__ void embedding_pos_grad_vec_kernel(const bf16* dy, float* dpos, int64_t b, int64_t sl,
                                              int64_t h, int64_t first) {
  const int64_t idx = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (idx >= sl * h) return;
  const int64_t j = idx / h, e = idx % h;
  float s[kVec] = {};
#pragma unroll 4  // 4 sequences' loads issued before their adds (in order: the same sums)
  for (int64_t bi = 0; bi < b; ++bi) {
    float v[kVec];
    load8(dy + (bi * sl + j) * h + e, v);
    for (int k = 0; k < kVec; ++k) s[k] += v[k];
  }
  add8(dpos + (first + j) * h + e, s);
}

__global__ void embedding_pos_grad_kernel(const bf16* dy, float* dpos, int64_t b, int64_t sl,
                                          int64_t h, int64_t first) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= sl * h) return;
  const int64_t j = idx / h, e = idx % h;
  float s = 0;
  for (int64_t bi = 0; bi < b; ++bi) s += to_float(dy[(bi * sl + j) * h + e]);
  dpos[(first + j) * h + e] += s;
}

}  // namespace

int64_t group_token_rows(const int32_t* tokens, int64_t n, int64_t v0, int64_t vl,
                         std::vector<int32_t>& packed, std::vector<int32_t>& count) {
  if (n > INT_MAX) throw std::invalid_argument("group_token_rows: more than 2^31 - 1 tokens");
  if (vl <= 0 || n <= 0) {
    packed.assign(1, 0);
    return 0;
  }
  if (static_cast<int64_t>(count.size()) < vl) count.resize(static_cast<size_t>(vl), 0);
  // Counts; the rows hit, in the order first hit, into packed (m <= min(n, vl) rows and
  // hits <= n positions: rows, offsets and positions fit in 2 min(n, vl) + n + 1).
  int64_t hits = 0, m = 0;
  packed.resize(static_cast<size_t>(2 * std::min(n, vl) + n + 1));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = static_cast<int64_t>(tokens[i]) - v0;
    if (t < 0 || t >= vl) continue;
    if (count[t]++ == 0) packed[m++] = static_cast<int32_t>(t);
    ++hits;
  }
  // The rows in increasing order: sorted where few, else read off the counts (a compare a row,
  // some 8 times cheaper than a sort's step, which takes log2 m of them a row).
  if (8 * static_cast<double>(m) * std::log2(static_cast<double>(m) + 2) <
      static_cast<double>(vl)) {
    std::sort(packed.begin(), packed.begin() + m);
  } else {
    int64_t k = 0;
    for (int64_t t = 0; t < vl; ++t)
      if (count[t] > 0) packed[k++] = static_cast<int32_t>(t);
  }
  // Offsets, with count[] as each row's cursor; then the positions in token order.
  int32_t* offsets = packed.data() + m;
  int32_t* positions = offsets + m + 1;
  int32_t at = 0;
  for (int64_t k = 0; k < m; ++k) {
    const int32_t t = packed[k], c = count[t];
    offsets[k] = at;
    count[t] = at;
    at += c;
  }
  offsets[m] = at;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = static_cast<int64_t>(tokens[i]) - v0;
    if (t >= 0 && t < vl) positions[count[t]++] = static_cast<int32_t>(i);
  }
  for (int64_t k = 0; k < m; ++k) count[packed[k]] = 0;
  packed.resize(static_cast<size_t>(2 * m + 1 + hits));
  return m;
}

void embedding_table_grad_rows(const int32_t* packed, int64_t m, const bf16* dy, float* dtable,
                               int64_t h, cudaStream_t stream) {
  table_grad_rows(packed, m, dy, dtable, h, stream);
}
void embedding_table_grad_rows(const int32_t* packed, int64_t m, const float* dy, float* dtable,
                               int64_t h, cudaStream_t stream) {
  table_grad_rows(packed, m, dy, dtable, h, stream);
}

void embedding_forward(const int32_t* tokens, const bf16* table, const bf16* pos, bf16* y,
                       int64_t b, int64_t sl, int64_t h, int64_t v0, int64_t vl, int64_t first,
                       cudaStream_t stream) {
  const int64_t n = b * sl;
  if (n <= 0 || h <= 0) return;
  if (vectorizable(h, {table, pos, y})) {
    PTDP_KERNEL_LAUNCH(embedding_forward_vec_kernel, static_cast<unsigned>(n), 128, 0, stream)
    (tokens, table, pos, y, sl, h, v0, vl, first);
    check_launch("embedding_forward_kernel (8-element vectors)");
    return;
  }
  PTDP_KERNEL_LAUNCH(embedding_forward_kernel, static_cast<unsigned>(n), 128, 0, stream)
  (tokens, table, pos, y, sl, h, v0, vl, first);
  check_launch("embedding_forward_kernel");
}

void embedding_backward(const int32_t* tokens, const bf16* dy, float* dtable, float* dpos,
                        int64_t b, int64_t sl, int64_t h, int64_t v0, int64_t vl, int64_t first,
                        cudaStream_t stream) {
  const int64_t n = b * sl;
  if (n <= 0 || h <= 0) return;
  if (dtable && vl > 0) {
    PTDP_KERNEL_LAUNCH(embedding_table_grad_kernel, vocab_tiles(vl), kGradThreads, 0, stream)
    (tokens, dy, dtable, n, h, v0, vl, vectorizable(h, {dy, dtable}));
    check_launch("embedding_table_grad_kernel");
  }
  if (dpos && vectorizable(h, {dy, dpos})) {
    PTDP_KERNEL_LAUNCH(embedding_pos_grad_vec_kernel, blocks_for(sl * h / kVec, 256), 256, 0,
                       stream)
    (dy, dpos, b, sl, h, first);
    check_launch("embedding_pos_grad_kernel (8-element vectors)");
  } else if (dpos) {
    PTDP_KERNEL_LAUNCH(embedding_pos_grad_kernel, blocks_for(sl * h, 256), 256, 0, stream)
    (dy, dpos, b, sl, h, first);
    check_launch("embedding_pos_grad_kernel");
  }
}

}  // namespace ptdp::kernels::cuda
