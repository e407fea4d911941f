// Token and position embedding on the GPU, vocabulary-parallel as in kernels/cpu/elementwise.h:
// this rank holds rows [v0, v0 + vl) of the token table. CPU twins: vocab_embedding_lookup +
// add_positions (forward), vocab_embedding_grad + position_grad (backward).
#pragma once

#include <vector>

#include "kernels/cuda/common.h"

namespace ptdp::kernels::cuda {

// tokens [b, sl]; y [b * sl, h] = table[token - v0] (zero for tokens outside the shard)
// + pos[first + j] for position j of each sequence (pos may be null). Sums in fp32, stored bf16.
void embedding_forward(const int32_t* tokens, const bf16* table, const bf16* pos, bf16* y,
                       int64_t b, int64_t sl, int64_t h, int64_t v0, int64_t vl, int64_t first,
                       cudaStream_t stream);
// dtable [vl, h] += the rows of dy whose token is in the shard; dpos [*, h] rows first.. += the
// sum over sequences (either may be null). fp32 gradients, deterministic (no atomics: each
// output element is owned by one thread that adds in token order).
void embedding_backward(const int32_t* tokens, const bf16* dy, float* dtable, float* dpos,
                        int64_t b, int64_t sl, int64_t h, int64_t v0, int64_t vl, int64_t first,
                        cudaStream_t stream);

// The table gradient by rows, for callers that hold their tokens on the host (ptdp run's CUDA
// backend). First, on the host, the shard's rows that tokens [0, n) hit, grouped:
// packed = [rows (m) | offsets (m + 1) | positions], the rows (token - v0) in increasing order,
// row k's token positions in token order at positions[offsets[k] .. offsets[k + 1]). Returns m.
// `count` is scratch kept between calls (all zeros again on return). Throws std::invalid_argument
// above 2^31 - 1 tokens.
int64_t group_token_rows(const int32_t* tokens, int64_t n, int64_t v0, int64_t vl,
                         std::vector<int32_t>& packed, std::vector<int32_t>& count);
// Then, with `packed` in device memory: dtable [vl, h] += each grouped row's dy rows, added in
// token order, the same adds in the same order as embedding_backward's table gradient and the
// CPU twin (the same bits). Each (row, 8 columns) is one thread's, its dy loads issued 8 rows
// ahead, so a row that many tokens hit (the commonest tokens of real text; every token of
// byte-level text falls in two 128-row tiles) is summed alongside every other row, where a
// vocabulary tile's block adds its tile's hits 4 at a time.
void embedding_table_grad_rows(const int32_t* packed, int64_t m, const bf16* dy, float* dtable,
                               int64_t h, cudaStream_t stream);
void embedding_table_grad_rows(const int32_t* packed, int64_t m, const float* dy, float* dtable,
                               int64_t h, cudaStream_t stream);

}  // namespace ptdp::kernels::cuda
