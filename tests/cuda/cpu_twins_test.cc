// The CPU twins added for the CUDA kernels (kernels/cpu/fused.h), checked
// against the existing CPU kernels and against finite differences. Runs on every machine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/flash.h"
#include "kernels/cpu/fused.h"
#include "kernels/cpu/kernels.h"

namespace ptdp::kernels {
namespace {

std::vector<float> normal(size_t n, float sd, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> x(n);
  for (auto& v : x) v = dist(gen);
  return x;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

TEST(CpuTwins, FlashAttentionTwinEqualsTheSplitAttentionKernels) {
  const int64_t b = 2, s = 9, hq = 4, hk = 2, d = 8;
  const auto q = normal(b * s * hq * d, 1, 1), k = normal(b * s * hk * d, 1, 2),
             v = normal(b * s * hk * d, 1, 3), dout = normal(b * s * hq * d, 1, 4);
  std::vector<float> out(q.size()), lse(b * hq * s);
  causal_attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), b, s, s, hq, hk,
                           d);

  std::vector<float> scores(b * hq * s * s), ref(q.size());
  attention_scores_forward(q.data(), k.data(), scores.data(), b, s, hq, hk, d);
  std::vector<float> raw = scores;
  causal_softmax_forward(scores.data(), b * hq, s);
  attention_context_forward(scores.data(), v.data(), ref.data(), b, s, hq, hk, d);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-5) << i;
  for (int64_t r = 0; r < b * hq; ++r)
    for (int64_t i = 0; i < s; ++i) {  // lse: the log of the row's softmax denominator
      double sum = 0;
      for (int64_t j = 0; j <= i; ++j) sum += std::exp(raw[(r * s + i) * s + j]);
      EXPECT_NEAR(lse[r * s + i], std::log(sum), 1e-5);
    }

  std::vector<float> dq(q.size()), dk(k.size()), dv(v.size());
  causal_attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(),
                            dq.data(), dk.data(), dv.data(), b, s, s, hq, hk, d);
  std::vector<float> dprobs(scores.size()), rdq(q.size()), rdk(k.size()), rdv(v.size());
  attention_context_backward(scores.data(), v.data(), dout.data(), dprobs.data(), rdv.data(), b, s,
                             hq, hk, d);
  causal_softmax_backward(scores.data(), dprobs.data(), dprobs.data(), b * hq, s);
  attention_scores_backward(q.data(), k.data(), dprobs.data(), rdq.data(), rdk.data(), b, s, hq, hk,
                            d);
  for (size_t i = 0; i < dq.size(); ++i) EXPECT_NEAR(dq[i], rdq[i], 1e-4) << i;
  for (size_t i = 0; i < dk.size(); ++i) EXPECT_NEAR(dk[i], rdk[i], 1e-4) << i;
  for (size_t i = 0; i < dv.size(); ++i) EXPECT_NEAR(dv[i], rdv[i], 1e-4) << i;
}

// loss = sum(y * w) for y = norm(x + residual); its gradient against central differences.
template <typename Forward, typename Backward>
void check_norm_gradient(Forward forward, Backward backward, int64_t n, int64_t h) {
  const auto x = normal(n * h, 1, 11), res = normal(n * h, 1, 12), w = normal(n * h, 1, 13);
  const auto dresid = normal(n * h, 1, 14);
  std::vector<float> r(n * h), y(n * h), dx(n * h), dx_plain(n * h);
  forward(x, res, r, y);
  backward(r, w, nullptr, dx_plain);
  backward(r, w, dresid.data(), dx);
  for (size_t i = 0; i < dx.size(); ++i)  // the residual stream's gradient passes through
    EXPECT_NEAR(dx[i], dx_plain[i] + dresid[i], 1e-6);
  for (size_t i = 0; i < x.size(); i += 7) {
    auto xp = x, xm = x;
    const float eps = 1e-2f;
    xp[i] += eps;
    xm[i] -= eps;
    std::vector<float> rp(n * h), yp(n * h), rm(n * h), ym(n * h);
    forward(xp, res, rp, yp);
    forward(xm, res, rm, ym);
    const double numeric = (dot(yp, w) - dot(ym, w)) / (2 * eps);
    EXPECT_NEAR(dx_plain[i], numeric, 2e-3 * (1 + std::fabs(numeric))) << i;
  }
}

// sq queries against sk > sq keys are the last sq rows of the causal self-attention over sk
// positions: the same outputs, log-sum-exps and dq; and, with no gradient on the earlier rows,
// the same dk and dv.
TEST(CpuTwins, ShiftedQueriesAreTheLastRowsOfTheLongerAttention) {
  const int64_t b = 2, sk = 11, sq = 4, hq = 4, hk = 2, d = 8, shift = sk - sq;
  const auto q_all = normal(b * sk * hq * d, 1, 5), k = normal(b * sk * hk * d, 1, 6),
             v = normal(b * sk * hk * d, 1, 7), dout_last = normal(b * sq * hq * d, 1, 8);
  const int64_t row = hq * d;  // floats of one position's queries
  std::vector<float> q(b * sq * row), dout_all(q_all.size(), 0.0f);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t e = 0; e < row; ++e) {
        q[(bi * sq + i) * row + e] = q_all[(bi * sk + shift + i) * row + e];
        dout_all[(bi * sk + shift + i) * row + e] = dout_last[(bi * sq + i) * row + e];
      }
  std::vector<float> out_all(q_all.size()), lse_all(b * hq * sk), out(q.size()), lse(b * hq * sq);
  causal_attention_forward(q_all.data(), k.data(), v.data(), out_all.data(), lse_all.data(), b, sk,
                           sk, hq, hk, d);
  causal_attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), b, sq, sk, hq, hk,
                           d);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t i = 0; i < sq; ++i) {
      for (int64_t e = 0; e < row; ++e)
        EXPECT_NEAR(out[(bi * sq + i) * row + e], out_all[(bi * sk + shift + i) * row + e], 1e-6);
      for (int64_t h = 0; h < hq; ++h)
        EXPECT_NEAR(lse[(bi * hq + h) * sq + i], lse_all[(bi * hq + h) * sk + shift + i], 1e-6);
    }
  std::vector<float> dq_all(q_all.size()), dk_all(k.size()), dv_all(v.size()), dq(q.size()),
      dk(k.size(), 7.0f), dv(v.size(), 7.0f);  // overwritten
  causal_attention_backward(q_all.data(), k.data(), v.data(), out_all.data(), lse_all.data(),
                            dout_all.data(), dq_all.data(), dk_all.data(), dv_all.data(), b, sk, sk,
                            hq, hk, d);
  causal_attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dout_last.data(),
                            dq.data(), dk.data(), dv.data(), b, sq, sk, hq, hk, d);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t e = 0; e < row; ++e)
        EXPECT_NEAR(dq[(bi * sq + i) * row + e], dq_all[(bi * sk + shift + i) * row + e], 1e-5);
  for (size_t i = 0; i < dk.size(); ++i) {
    EXPECT_NEAR(dk[i], dk_all[i], 1e-5) << i;
    EXPECT_NEAR(dv[i], dv_all[i], 1e-5) << i;
  }
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, std::abs(static_cast<double>(v)));
  return m;
}

// The CPU backend's tiled fp32 flash attention (kernels/cpu/flash.h) against the double-precision
// twin: sequences of one tile, of several with the last partial, queries after longer keys (the
// diagonal inside a tile and across tiles), grouped queries; and the same bits twice.
TEST(CpuTwins, TiledFlashAttentionMatchesTheTwin) {
  struct Case {
    int64_t b, sq, sk, hq, hk, d;
  };
  for (const Case& c :
       {Case{2, 150, 150, 4, 2, 16}, Case{1, 70, 200, 2, 1, 40}, Case{2, 9, 9, 3, 3, 64},
        Case{1, 64, 128, 2, 2, 8}, Case{1, 1, 77, 2, 1, 8}}) {
    SCOPED_TRACE("sq " + std::to_string(c.sq) + " sk " + std::to_string(c.sk));
    const size_t nq = static_cast<size_t>(c.b * c.sq * c.hq * c.d),
                 nk = static_cast<size_t>(c.b * c.sk * c.hk * c.d),
                 nl = static_cast<size_t>(c.b * c.hq * c.sq);
    const auto q = normal(nq, 1, 11), k = normal(nk, 1, 12), v = normal(nk, 1, 13),
               dout = normal(nq, 1, 14);
    std::vector<float> out(nq), lse(nl), want(nq), want_lse(nl);
    flash_attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), c.b, c.sq, c.sk,
                            c.hq, c.hk, c.d);
    causal_attention_forward(q.data(), k.data(), v.data(), want.data(), want_lse.data(), c.b, c.sq,
                             c.sk, c.hq, c.hk, c.d);
    for (size_t i = 0; i < nq; ++i) ASSERT_NEAR(out[i], want[i], 1e-5) << i;
    for (size_t i = 0; i < nl; ++i) ASSERT_NEAR(lse[i], want_lse[i], 1e-5) << i;
    std::vector<float> dq(nq), dk(nk), dv(nk), wq(nq), wk(nk), wv(nk);
    flash_attention_backward(q.data(), k.data(), v.data(), want.data(), want_lse.data(),
                             dout.data(), dq.data(), dk.data(), dv.data(), c.b, c.sq, c.sk, c.hq,
                             c.hk, c.d);
    causal_attention_backward(q.data(), k.data(), v.data(), want.data(), want_lse.data(),
                              dout.data(), wq.data(), wk.data(), wv.data(), c.b, c.sq, c.sk, c.hq,
                              c.hk, c.d);
    const double tq = 1e-5 * max_abs(wq), tk = 1e-5 * max_abs(wk), tv = 1e-5 * max_abs(wv);
    for (size_t i = 0; i < nq; ++i) ASSERT_NEAR(dq[i], wq[i], tq) << i;
    for (size_t i = 0; i < nk; ++i) ASSERT_NEAR(dk[i], wk[i], tk) << i;
    for (size_t i = 0; i < nk; ++i) ASSERT_NEAR(dv[i], wv[i], tv) << i;
    std::vector<float> again(nk, 3.0f), dq2(nq), dv2(nk);  // overwritten, the same bits
    flash_attention_backward(q.data(), k.data(), v.data(), want.data(), want_lse.data(),
                             dout.data(), dq2.data(), again.data(), dv2.data(), c.b, c.sq, c.sk,
                             c.hq, c.hk, c.d);
    EXPECT_EQ(again, dk);
  }
}

TEST(CpuTwins, ResidualLayerNormGradientMatchesFiniteDifferences) {
  const int64_t n = 3, h = 16;
  const auto g = normal(h, 1, 21), bta = normal(h, 1, 22);
  std::vector<float> mean(n), rstd(n);
  auto fwd = [&](const std::vector<float>& x, const std::vector<float>& res, std::vector<float>& r,
                 std::vector<float>& y) {
    add_layernorm_forward(x.data(), res.data(), r.data(), g.data(), bta.data(), y.data(),
                          mean.data(), rstd.data(), n, h, 1e-5f);
  };
  auto bwd = [&](const std::vector<float>& r, const std::vector<float>& dy, const float* dresid,
                 std::vector<float>& dx) {
    std::vector<float> dg(h), db(h);
    add_layernorm_backward(r.data(), g.data(), mean.data(), rstd.data(), dy.data(), dresid,
                           dx.data(), dg.data(), db.data(), n, h);
  };
  check_norm_gradient(fwd, bwd, n, h);
}

TEST(CpuTwins, ResidualRmsNormGradientMatchesFiniteDifferences) {
  const int64_t n = 3, h = 16;
  const auto g = normal(h, 1, 31);
  std::vector<float> rstd(n);
  auto fwd = [&](const std::vector<float>& x, const std::vector<float>& res, std::vector<float>& r,
                 std::vector<float>& y) {
    add_rmsnorm_forward(x.data(), res.data(), r.data(), g.data(), y.data(), rstd.data(), n, h,
                        1e-5f);
  };
  auto bwd = [&](const std::vector<float>& r, const std::vector<float>& dy, const float* dresid,
                 std::vector<float>& dx) {
    std::vector<float> dg(h);
    add_rmsnorm_backward(r.data(), g.data(), rstd.data(), dy.data(), dresid, dx.data(), dg.data(),
                         n, h);
  };
  check_norm_gradient(fwd, bwd, n, h);
}

TEST(CpuTwins, ResidualNormWithoutResidualIsThePlainNorm) {
  const int64_t n = 4, h = 10;
  const auto x = normal(n * h, 2, 41), g = normal(h, 1, 42), bta = normal(h, 1, 43);
  std::vector<float> y(n * h), mean(n), rstd(n), ref(n * h), rmean(n), rrstd(n);
  add_layernorm_forward(x.data(), nullptr, nullptr, g.data(), bta.data(), y.data(), mean.data(),
                        rstd.data(), n, h, 1e-5f);
  layernorm_forward(x.data(), g.data(), bta.data(), ref.data(), rmean.data(), rrstd.data(), n, h);
  EXPECT_EQ(y, ref);
  EXPECT_EQ(rstd, rrstd);
}

TEST(CpuTwins, BiasGeluGradientMatchesFiniteDifferences) {
  const int64_t rows = 3, cols = 5;
  const auto x = normal(rows * cols, 1.5f, 51), bias = normal(cols, 1, 52),
             dy = normal(rows * cols, 1, 53);
  std::vector<float> dx(rows * cols), dbias(cols, 0.5f);
  bias_gelu_backward(x.data(), bias.data(), dy.data(), dx.data(), dbias.data(), rows, cols);
  auto loss = [&](const std::vector<float>& xx, const std::vector<float>& bb) {
    std::vector<float> y(rows * cols);
    bias_gelu_forward(xx.data(), bb.data(), y.data(), rows, cols);
    return dot(y, dy);
  };
  const float eps = 1e-2f;
  for (size_t i = 0; i < x.size(); ++i) {
    auto xp = x, xm = x;
    xp[i] += eps;
    xm[i] -= eps;
    EXPECT_NEAR(dx[i], (loss(xp, bias) - loss(xm, bias)) / (2 * eps), 2e-3) << i;
  }
  for (int64_t c = 0; c < cols; ++c) {  // dbias accumulates onto its 0.5 start
    auto bp = bias, bm = bias;
    bp[c] += eps;
    bm[c] -= eps;
    EXPECT_NEAR(dbias[c] - 0.5f, (loss(x, bp) - loss(x, bm)) / (2 * eps), 5e-3) << c;
  }
}

}  // namespace
}  // namespace ptdp::kernels
