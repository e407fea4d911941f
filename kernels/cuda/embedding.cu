// Token and position embedding kernels (kernels/cuda/embedding.h).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/embedding.h"

namespace ptdp::kernels::cuda {
namespace {

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

// The table gradient by vocabulary tiles (common.cuh): every table row sums its tokens in order.
constexpr int kGradThreads = 256;
__global__ void embedding_table_grad_kernel(const int32_t* tokens, const bf16* dy, float* dtable,
                                            int64_t n, int64_t h, int64_t v0, int64_t vl) {
  add_token_rows_of_tile<kGradThreads>(tokens, dy, dtable, n, h, v0, vl);
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

void embedding_forward(const int32_t* tokens, const bf16* table, const bf16* pos, bf16* y,
                       int64_t b, int64_t sl, int64_t h, int64_t v0, int64_t vl, int64_t first,
                       cudaStream_t stream) {
  const int64_t n = b * sl;
  if (n <= 0 || h <= 0) return;
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
    (tokens, dy, dtable, n, h, v0, vl);
    check_launch("embedding_table_grad_kernel");
  }
  if (dpos) {
    PTDP_KERNEL_LAUNCH(embedding_pos_grad_kernel, blocks_for(sl * h, 256), 256, 0, stream)
    (dy, dpos, b, sl, h, first);
    check_launch("embedding_pos_grad_kernel");
  }
}

}  // namespace ptdp::kernels::cuda
