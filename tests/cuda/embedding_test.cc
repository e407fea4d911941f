// kernels/cuda/embedding.h against vocab_embedding_* and add_positions / position_grad.
#include "kernels/cuda/embedding.h"

#include <algorithm>
#include <random>

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

// Checks group_token_rows' arrays against the tokens: rows increasing, each with its tokens'
// positions in increasing order, every token on the shard listed once.
void check_grouping(const std::vector<int32_t>& tokens, int64_t v0, int64_t vl,
                    const std::vector<int32_t>& packed, int64_t m) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  ASSERT_GE(static_cast<int64_t>(packed.size()), 2 * m + 1);
  const int32_t* offsets = packed.data() + m;
  const int32_t* positions = offsets + m + 1;
  int64_t on_shard = 0;
  for (const int32_t tk : tokens) on_shard += tk >= v0 && tk < v0 + vl ? 1 : 0;
  ASSERT_EQ(static_cast<int64_t>(packed.size()), 2 * m + 1 + on_shard);
  EXPECT_EQ(offsets[0], 0);
  EXPECT_EQ(offsets[m], on_shard);
  for (int64_t k = 0; k < m; ++k) {
    if (k > 0) {
      EXPECT_LT(packed[k - 1], packed[k]);
    }
    ASSERT_LT(offsets[k], offsets[k + 1]) << "row " << packed[k] << " listed with no token";
    for (int32_t i = offsets[k]; i < offsets[k + 1]; ++i) {
      ASSERT_GE(positions[i], 0);
      ASSERT_LT(positions[i], n);
      EXPECT_EQ(tokens[positions[i]] - v0, packed[k]);
      if (i > offsets[k]) {
        EXPECT_LT(positions[i - 1], positions[i]);
      }
    }
  }
}

// The table gradient by grouped rows (group_token_rows, then embedding_table_grad_rows: ptdp
// run's CUDA backend) on skewed tokens, as text gives them: a third of them one row, a quarter
// 8 rows, the rest spread (some off the shard). The same bits as the CPU twin and as
// embedding_backward's tile kernel: the same adds in the same order. bf16 and fp32 dy, widths
// that take 16-byte vectors (200, 768) and one that does not (36); a shard the tokens miss.
TEST(CudaEmbedding, TableGradientByRowsIsTheCpusOnSkewedTokens) {
  PTDP_REQUIRE_GPU();
  const int64_t n = 1500, v = 700, vl = v / 2;
  std::vector<int32_t> tokens(n);
  std::mt19937 g(7);
  for (auto& tk : tokens) {
    const uint32_t u = g() % 100;
    tk = static_cast<int32_t>(u < 33 ? 351 : u < 58 ? (g() % 8) * 40 : g() % v);
  }
  DeviceBuffer<int32_t> d_tokens(tokens);
  std::vector<int32_t> packed, count;
  for (const int64_t h : {200, 36, 768}) {
    for (const int64_t v0 : {int64_t{0}, vl}) {
      SCOPED_TRACE("h = " + std::to_string(h) + ", v0 = " + std::to_string(v0));
      const int64_t m = kernels::cuda::group_token_rows(tokens.data(), n, v0, vl, packed, count);
      check_grouping(tokens, v0, vl, packed, m);
      EXPECT_TRUE(std::all_of(count.begin(), count.end(), [](int32_t c) { return c == 0; }));
      DeviceBuffer<int32_t> d_packed(packed);
      const auto dy = random_bf16(n * h, 1, 30), dtable0 = random_f32(vl * h, 1, 31);
      auto want = dtable0;
      kernels::vocab_embedding_grad(tokens.data(), dy.data(), want.data(), n, h, v0, vl);
      // bf16 dy, by rows and by tiles.
      auto d_dy = to_device_bf16(dy);
      DeviceBuffer<float> rows(dtable0), tiles(dtable0);
      kernels::cuda::embedding_table_grad_rows(d_packed.get(), m, d_dy.get(), rows.get(), h,
                                               nullptr);
      kernels::cuda::embedding_backward(d_tokens.get(), d_dy.get(), tiles.get(), nullptr, 1, n, h,
                                        v0, vl, 0, nullptr);
      expect_close(rows.download(), want, 0, 0, "table gradient by rows, bf16 dy");
      EXPECT_EQ(rows.download(), tiles.download());
      // fp32 dy (the fp32 runtime's), the same values.
      DeviceBuffer<float> d_dy32(dy), rows32(dtable0);
      kernels::cuda::embedding_table_grad_rows(d_packed.get(), m, d_dy32.get(), rows32.get(), h,
                                               nullptr);
      expect_close(rows32.download(), want, 0, 0, "table gradient by rows, fp32 dy");
    }
  }
  // No token on the shard: nothing listed, nothing runs.
  const int64_t m = kernels::cuda::group_token_rows(tokens.data(), n, v, vl, packed, count);
  EXPECT_EQ(m, 0);
  EXPECT_EQ(packed, std::vector<int32_t>{0});
  // Byte-level text: every token below 256, in one shard of 50304.
  for (auto& tk : tokens) tk = static_cast<int32_t>(g() % 256);
  const int64_t mb = kernels::cuda::group_token_rows(tokens.data(), n, 0, 50304, packed, count);
  check_grouping(tokens, 0, 50304, packed, mb);
}

}  // namespace
}  // namespace ptdp::cuda_test
