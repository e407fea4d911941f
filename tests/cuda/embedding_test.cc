// kernels/cuda/embedding.h against vocab_embedding_* and add_positions / position_grad.
#include "kernels/cuda/embedding.h"

#include "kernels/cpu/elementwise.h"
#include "tests/cuda/cuda_test_util.h"

namespace ptdp::cuda_test {
namespace {

// h 200 takes the 8-column vector kernels (common.cuh load8/add8), h 36 the element-wise ones.
// 21 tokens are fewer than one chunk of the table gradient's scan; 6000 are six chunks, and
// about 3000 of them fall in the one vocabulary tile of a rank, more than its list holds, so
// the list is added up in the middle of the scan and at its end (add_token_rows_of_tile).
// A vocabulary of 600 on 2 ranks is 3 tiles a rank, the last one partial.
void check_embedding(int64_t h, int64_t b, int64_t sl, int64_t v = 50) {
  SCOPED_TRACE("h = " + std::to_string(h) + ", " + std::to_string(b * sl) + " tokens, vocabulary " +
               std::to_string(v));
  const int64_t t = 2, vl = v / t, first = 5, positions = first + sl + 4;
  std::vector<int32_t> tokens(b * sl);
  for (size_t i = 0; i < tokens.size(); ++i)  // repeats, and tokens on both ranks
    tokens[i] = static_cast<int32_t>((i * 17 + 3) % v);
  tokens[1] = tokens[4] = 30;
  const auto pos = random_bf16(positions * h, 1, 2), dy = random_bf16(b * sl * h, 1, 3);
  DeviceBuffer<int32_t> d_tokens(tokens);
  auto d_pos = to_device_bf16(pos), d_dy = to_device_bf16(dy);
  for (int64_t rank = 0; rank < t; ++rank) {
    const int64_t v0 = rank * vl;
    const auto table = random_bf16(vl * h, 1, 10 + static_cast<uint32_t>(rank));
    auto d_table = to_device_bf16(table);
    DeviceBuffer<bf16> d_y(b * sl * h);
    kernels::cuda::embedding_forward(d_tokens.get(), d_table.get(), d_pos.get(), d_y.get(), b, sl,
                                     h, v0, vl, first, nullptr);
    std::vector<float> want(b * sl * h);
    kernels::vocab_embedding_lookup(tokens.data(), table.data(), want.data(), b * sl, h, v0, vl);
    kernels::add_positions(want.data(), pos.data(), b, sl, h, first);
    for (auto& x : want) x = round_bf16(x);
    expect_close(bf16_values(d_y), want, 0, 0, "embedding forward");  // one rounding of one sum

    // Gradients accumulate onto what is already there.
    const auto dtable0 = random_f32(vl * h, 1, 20), dpos0 = random_f32(positions * h, 1, 21);
    DeviceBuffer<float> d_dtable(dtable0), d_dpos(dpos0);
    kernels::cuda::embedding_backward(d_tokens.get(), d_dy.get(), d_dtable.get(), d_dpos.get(), b,
                                      sl, h, v0, vl, first, nullptr);
    auto dtable = dtable0, dpos = dpos0;
    kernels::vocab_embedding_grad(tokens.data(), dy.data(), dtable.data(), b * sl, h, v0, vl);
    kernels::position_grad(dy.data(), dpos.data(), b, sl, h, first);
    expect_close(d_dtable.download(), dtable, 1e-5, 1e-5, "embedding table gradient");
    expect_close(d_dpos.download(), dpos, 1e-5, 1e-5, "position gradient");
  }
}

TEST(CudaEmbedding, VocabParallelForwardAndBackwardMatchCpu) {
  PTDP_REQUIRE_GPU();
  for (int64_t h : {200, 36}) check_embedding(h, 3, 7);
  for (int64_t h : {200, 36}) check_embedding(h, 6, 1000);
  check_embedding(200, 2, 500, 600);
}

}  // namespace
}  // namespace ptdp::cuda_test
