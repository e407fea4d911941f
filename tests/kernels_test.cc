// Every CPU kernel's backward against central finite differences of its forward, in double
// precision: for a random projection R, L(x) = sum(forward(x) * R), and dL/dx from the backward
// with dy = R must match (L(x + e) - L(x - e)) / 2e element by element.
#include "kernels/cpu/kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/fast_math.h"

namespace ptdp::kernels {
namespace {

using V = std::vector<double>;

V random(size_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 g(seed);
  std::normal_distribution<double> d(0.0, scale);
  V v(n);
  for (double& x : v) x = d(g);
  return v;
}

double dot(const V& a, const V& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Checks analytic against numeric gradient of `loss` with respect to `x`.
void expect_gradient(V& x, const std::function<double()>& loss, const V& analytic,
                     const char* what) {
  ASSERT_EQ(x.size(), analytic.size());
  const double eps = 1e-6;
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + eps;
    const double up = loss();
    x[i] = keep - eps;
    const double down = loss();
    x[i] = keep;
    const double numeric = (up - down) / (2 * eps);
    const double err = std::abs(numeric - analytic[i]) / std::max(1.0, std::abs(numeric));
    worst = std::max(worst, err);
  }
  EXPECT_LT(worst, 1e-6) << what;
}

TEST(Kernels, LinearGradients) {
  const int64_t n = 5, in = 4, out = 3;
  V x = random(n * in, 1), w = random(out * in, 2), b = random(out, 3), r = random(n * out, 4);
  auto loss = [&] {
    V y(n * out);
    linear_forward(x.data(), w.data(), b.data(), y.data(), n, in, out);
    return dot(y, r);
  };
  V dx(n * in), dw(out * in, 0.0), db(out, 0.0);
  linear_backward(x.data(), w.data(), r.data(), dx.data(), dw.data(), db.data(), n, in, out);
  expect_gradient(x, loss, dx, "dx");
  expect_gradient(w, loss, dw, "dw");
  expect_gradient(b, loss, db, "db");
}

TEST(Kernels, LayerNormGradients) {
  const int64_t n = 4, h = 6;
  V x = random(n * h, 5), g = random(h, 6), b = random(h, 7), r = random(n * h, 8);
  V mean(n), rstd(n);
  auto loss = [&] {
    V y(n * h);
    layernorm_forward(x.data(), g.data(), b.data(), y.data(), mean.data(), rstd.data(), n, h);
    return dot(y, r);
  };
  loss();
  V dx(n * h), dg(h, 0.0), db(h, 0.0);
  layernorm_backward(x.data(), g.data(), mean.data(), rstd.data(), r.data(), dx.data(), dg.data(),
                     db.data(), n, h);
  expect_gradient(x, loss, dx, "dx");
  expect_gradient(g, loss, dg, "dg");
  expect_gradient(b, loss, db, "db");
}

TEST(Kernels, GeluGradientAndValues) {
  V x = random(20, 9, 2.0), r = random(20, 10);
  auto loss = [&] {
    V y(20);
    gelu_forward(x.data(), y.data(), 20);
    return dot(y, r);
  };
  V dx(20);
  gelu_backward(x.data(), r.data(), dx.data(), 20);
  expect_gradient(x, loss, dx, "dx");
  const double z[3] = {-1.0, 0.0, 1.0};
  double y[3];
  gelu_forward(z, y, 3);
  EXPECT_NEAR(y[1], 0.0, 1e-15);
  EXPECT_NEAR(y[2], 0.8411919906, 1e-9);        // tanh-approximate GELU(1)
  EXPECT_NEAR(y[0], 0.8411919906 - 1.0, 1e-9);  // GELU(-x) = GELU(x) - x
}

// The float kernels' inline exp and tanh (kernels/cpu/fast_math.h) against libm in double: exp
// within 2 ulp of the exact value over its range (every 97th float, both signs), 0 below it
// and for -inf, NaN through; tanh within 2e-7 absolutely and saturated to +-1 exactly. The
// float GELU, SwiGLU and softmax built on them agree with the double twins.
TEST(Kernels, InlineExpAndTanhMatchLibm) {
  double worst_ulp = 0, worst_tanh = 0;
  for (uint32_t bits = 0; bits < 0x42B00000u; bits += 97)  // |x| < 88
    for (const float x : {std::bit_cast<float>(bits), -std::bit_cast<float>(bits)}) {
      if (x < -87.3f || x > 88.3f) continue;
      const double want = std::exp(static_cast<double>(x));
      const float rounded = static_cast<float>(want);
      const double ulp = std::nextafter(rounded, INFINITY) - rounded;
      worst_ulp = std::max(worst_ulp, std::abs(kernels::exp_f32(x) - want) / ulp);
      worst_tanh =
          std::max(worst_tanh, std::abs(kernels::tanh_f32(x) - std::tanh(static_cast<double>(x))));
    }
  EXPECT_LT(worst_ulp, 2.0);
  EXPECT_LT(worst_tanh, 2e-7);
  EXPECT_EQ(kernels::exp_f32(-INFINITY), 0.0f);
  EXPECT_EQ(kernels::exp_f32(-100.0f), 0.0f);
  EXPECT_EQ(kernels::exp_f32(0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(kernels::exp_f32(NAN)));
  EXPECT_TRUE(std::isnan(kernels::tanh_f32(NAN)));
  EXPECT_EQ(kernels::tanh_f32(50.0f), 1.0f);
  EXPECT_EQ(kernels::tanh_f32(-50.0f), -1.0f);
  // The float kernels against their double twins.
  const V xd = random(999, 21, 3.0), dyd = random(999, 22);
  std::vector<float> xf(xd.begin(), xd.end()), dyf(dyd.begin(), dyd.end()), yf(999), dxf(999);
  V y(999), dx(999);
  gelu_forward(xd.data(), y.data(), 999);
  gelu_forward(xf.data(), yf.data(), 999);
  gelu_backward(xd.data(), dyd.data(), dx.data(), 999);
  gelu_backward(xf.data(), dyf.data(), dxf.data(), 999);
  for (size_t i = 0; i < 999; ++i) {
    EXPECT_NEAR(yf[i], y[i], 1e-6 * (1 + std::abs(y[i]))) << i;
    EXPECT_NEAR(dxf[i], dx[i], 1e-6 * (1 + std::abs(dx[i]))) << i;
  }
  std::vector<float> sw(333);
  V swd(333);
  swiglu_forward(xd.data(), swd.data(), 1, 333);  // 666 inputs: gate, then up
  swiglu_forward(xf.data(), sw.data(), 1, 333);
  for (size_t i = 0; i < 333; ++i) EXPECT_NEAR(sw[i], swd[i], 1e-6 * (1 + std::abs(swd[i]))) << i;
  V pd = random(37 * 37, 23, 3.0);
  std::vector<float> pf(pd.begin(), pd.end());
  causal_softmax_forward(pd.data(), 1, 37);
  causal_softmax_forward(pf.data(), 1, 37);
  for (size_t i = 0; i < pd.size(); ++i) EXPECT_NEAR(pf[i], pd[i], 1e-6) << i;
}

// Vocabulary-parallel cross-entropy over two ranks: the rows' losses are the whole
// vocabulary's, and a shard past the vocabulary's end (valid <= 0: a tiny vocabulary over many
// ranks) holds no probability and writes nothing outside its rows (ASan checks the bounds).
TEST(Kernels, VocabularyParallelCrossEntropyAndAnEmptyShard) {
  const int64_t n = 3, vl = 4;
  const V whole = random(n * 2 * vl, 31, 2.0);
  const std::vector<int32_t> targets = {1, 6, 3};
  std::vector<float> shards[2], stats(2 * n * 3);
  for (int r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < vl; ++j)
        shards[r].push_back(
            static_cast<float>(whole[static_cast<size_t>(i * 2 * vl + r * vl + j)]));
    kernels::cross_entropy_stats(shards[r].data(), targets.data(), stats.data() + r * n * 3, n, vl,
                                 vl, r * vl);
  }
  std::vector<float> lse(n);
  std::vector<float> probs = shards[0];
  const double loss =
      kernels::cross_entropy_finish(stats.data(), 2, probs.data(), lse.data(), n, vl, vl);
  double want = 0;
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int64_t j = 0; j < 2 * vl; ++j)
      sum += std::exp(whole[static_cast<size_t>(i * 2 * vl + j)]);
    want +=
        std::log(sum) - whole[static_cast<size_t>(i * 2 * vl + targets[static_cast<size_t>(i)])];
  }
  EXPECT_NEAR(loss, want, 1e-5 * std::abs(want));
  std::vector<float> empty(static_cast<size_t>(n * vl), 7.0f);
  kernels::cross_entropy_finish(stats.data(), 2, empty.data(), lse.data(), n, vl, -2);
  for (float p : empty) EXPECT_EQ(p, 0.0f);
}

TEST(Kernels, CausalAttentionGradientsAndMask) {
  const int64_t b = 2, s = 4, heads = 2, d = 3, n = b * s * heads * d;
  V q = random(n, 11), k = random(n, 12), v = random(n, 13), r = random(n, 14);
  V probs(b * heads * s * s);
  auto loss = [&] {
    V out(n);
    attention_forward(q.data(), k.data(), v.data(), out.data(), probs.data(), b, s, heads, d);
    return dot(out, r);
  };
  loss();
  V dq(n), dk(n), dv(n);
  attention_backward(q.data(), k.data(), v.data(), probs.data(), r.data(), dq.data(), dk.data(),
                     dv.data(), b, s, heads, d);
  expect_gradient(q, loss, dq, "dq");
  expect_gradient(k, loss, dk, "dk");
  expect_gradient(v, loss, dv, "dv");
  // Causal: position 0 attends only to itself; rows sum to 1.
  EXPECT_DOUBLE_EQ(probs[0], 1.0);
  for (int64_t i = 0; i < s; ++i) {
    double sum = 0;
    for (int64_t j = 0; j < s; ++j) sum += probs[i * s + j];
    EXPECT_NEAR(sum, 1.0, 1e-12);
    for (int64_t j = i + 1; j < s; ++j) EXPECT_EQ(probs[i * s + j], 0.0);
  }
}

// The split attention ops (scores, softmax, context) with grouped-query attention: gradients
// by finite differences, and with one query head per group they equal the fused kernel.
TEST(Kernels, SplitAttentionWithGroupedQueriesGradients) {
  const int64_t b = 2, s = 4, hq = 4, hk = 2, d = 3;
  V q = random(b * s * hq * d, 31), k = random(b * s * hk * d, 32), v = random(b * s * hk * d, 33);
  V r = random(b * s * hq * d, 34);
  const int64_t rows = b * hq;
  V probs(rows * s * s);
  auto forward = [&](V& out) {
    attention_scores_forward(q.data(), k.data(), probs.data(), b, s, hq, hk, d);
    causal_softmax_forward(probs.data(), rows, s);
    attention_context_forward(probs.data(), v.data(), out.data(), b, s, hq, hk, d);
  };
  auto loss = [&] {
    V out(b * s * hq * d);
    forward(out);
    return dot(out, r);
  };
  loss();
  V dprobs(rows * s * s), dq(q.size()), dk(k.size()), dv(v.size());
  attention_context_backward(probs.data(), v.data(), r.data(), dprobs.data(), dv.data(), b, s, hq,
                             hk, d);
  causal_softmax_backward(probs.data(), dprobs.data(), dprobs.data(), rows, s);  // in place
  attention_scores_backward(q.data(), k.data(), dprobs.data(), dq.data(), dk.data(), b, s, hq, hk,
                            d);
  expect_gradient(q, loss, dq, "dq");
  expect_gradient(k, loss, dk, "dk");
  expect_gradient(v, loss, dv, "dv");
}

TEST(Kernels, SplitAttentionEqualsFusedAttention) {
  const int64_t b = 2, s = 5, h = 3, d = 4;
  const size_t n = static_cast<size_t>(b * s * h * d);
  V q = random(n, 41), k = random(n, 42), v = random(n, 43), dout = random(n, 44);
  V fused(n), fused_probs(b * h * s * s), split(n), probs(b * h * s * s);
  attention_forward(q.data(), k.data(), v.data(), fused.data(), fused_probs.data(), b, s, h, d);
  attention_scores_forward(q.data(), k.data(), probs.data(), b, s, h, h, d);
  causal_softmax_forward(probs.data(), b * h, s);
  attention_context_forward(probs.data(), v.data(), split.data(), b, s, h, h, d);
  for (size_t i = 0; i < n; ++i) EXPECT_NEAR(split[i], fused[i], 1e-12);
  for (size_t i = 0; i < probs.size(); ++i) EXPECT_NEAR(probs[i], fused_probs[i], 1e-12);
  V dq1(n), dk1(n), dv1(n), dq2(n), dk2(n), dv2(n), dp(probs.size());
  attention_backward(q.data(), k.data(), v.data(), fused_probs.data(), dout.data(), dq1.data(),
                     dk1.data(), dv1.data(), b, s, h, d);
  attention_context_backward(probs.data(), v.data(), dout.data(), dp.data(), dv2.data(), b, s, h, h,
                             d);
  causal_softmax_backward(probs.data(), dp.data(), dp.data(), b * h, s);
  attention_scores_backward(q.data(), k.data(), dp.data(), dq2.data(), dk2.data(), b, s, h, h, d);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(dq1[i], dq2[i], 1e-12);
    EXPECT_NEAR(dk1[i], dk2[i], 1e-12);
    EXPECT_NEAR(dv1[i], dv2[i], 1e-12);
  }
}

TEST(Kernels, RmsNormGradients) {
  const int64_t n = 3, h = 5;
  V x = random(n * h, 61), g = random(h, 62), r = random(n * h, 63);
  V rstd(n);
  auto loss = [&] {
    V y(n * h);
    rmsnorm_forward(x.data(), g.data(), y.data(), rstd.data(), n, h);
    return dot(y, r);
  };
  loss();
  V dx(x.size()), dg(h, 0.0);
  rmsnorm_backward(x.data(), g.data(), rstd.data(), r.data(), dx.data(), dg.data(), n, h);
  expect_gradient(x, loss, dx, "dx");
  expect_gradient(g, loss, dg, "dg");
}

TEST(Kernels, SwiGluGradients) {
  const int64_t n = 3, f = 4;
  V x = random(n * 2 * f, 51), r = random(n * f, 52);
  auto loss = [&] {
    V y(n * f);
    swiglu_forward(x.data(), y.data(), n, f);
    return dot(y, r);
  };
  V dx(x.size());
  swiglu_backward(x.data(), r.data(), dx.data(), n, f);
  expect_gradient(x, loss, dx, "dx");
}

TEST(Kernels, CrossEntropyGradientAndUniformLoss) {
  const int64_t n = 3, vocab = 7;
  V logits = random(n * vocab, 15);
  const int32_t targets[n] = {0, 6, 3};
  V dl(n * vocab);
  cross_entropy(logits.data(), targets, dl.data(), n, vocab);
  expect_gradient(
      logits, [&] { return cross_entropy<double>(logits.data(), targets, nullptr, n, vocab); }, dl,
      "dlogits");
  V zeros(n * vocab, 0.0);
  EXPECT_NEAR(cross_entropy<double>(zeros.data(), targets, nullptr, n, vocab), std::log(7.0),
              1e-12);
}

TEST(Kernels, EmbeddingGradients) {
  const int64_t n = 6, s = 3, h = 4, vocab = 5;
  const int32_t tokens[n] = {1, 4, 1, 0, 2, 4};
  V table = random(vocab * h, 16), pos = random(s * h, 17), r = random(n * h, 18);
  auto loss = [&] {
    V y(n * h);
    embedding_forward(tokens, table.data(), pos.data(), y.data(), n, s, h);
    return dot(y, r);
  };
  V dt(vocab * h, 0.0), dp(s * h, 0.0);
  embedding_backward(tokens, r.data(), dt.data(), dp.data(), n, s, h);
  expect_gradient(table, loss, dt, "dtable");
  expect_gradient(pos, loss, dp, "dpos");
}

// Rotary embeddings: the inverse undoes the rotation; it is the adjoint (so the backward pass);
// position 0 is left alone; and a rotated query-key product depends only on their distance.
TEST(Kernels, RotaryEmbeddingIsAnOrthogonalRelativeRotation) {
  const int64_t b = 2, s = 5, heads = 3, d = 8;
  const size_t n = static_cast<size_t>(b * s * heads * d);
  const V x = random(n, 11), dy = random(n, 12);
  V y = x;
  kernels::rope(y.data(), b, s, heads, d, 10000.0, false);
  V back = y;
  kernels::rope(back.data(), b, s, heads, d, 10000.0, true);
  double moved = 0;
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(back[i], x[i], 1e-12);
    moved = std::max(moved, std::abs(y[i] - x[i]));
  }
  EXPECT_GT(moved, 0.1);
  for (int64_t i = 0; i < heads * d; ++i)  // batch 0, position 0
    EXPECT_EQ(y[static_cast<size_t>(i)], x[static_cast<size_t>(i)]);
  V dx = dy;
  kernels::rope(dx.data(), b, s, heads, d, 10000.0, true);
  double lhs = 0, rhs = 0;
  for (size_t i = 0; i < n; ++i) {
    lhs += dy[i] * y[i];
    rhs += dx[i] * x[i];
  }
  EXPECT_NEAR(lhs, rhs, 1e-9 * std::abs(lhs) + 1e-12);
  // One head, the same q and k at every position: <R_i q, R_j k> is a function of i - j.
  const V q = random(static_cast<size_t>(d), 21), k = random(static_cast<size_t>(d), 22);
  V qs, ks;
  for (int64_t j = 0; j < s; ++j) {
    qs.insert(qs.end(), q.begin(), q.end());
    ks.insert(ks.end(), k.begin(), k.end());
  }
  kernels::rope(qs.data(), 1, s, 1, d, 500000.0, false);
  kernels::rope(ks.data(), 1, s, 1, d, 500000.0, false);
  auto dot = [&](int64_t i, int64_t j) {
    double r = 0;
    for (int64_t e = 0; e < d; ++e)
      r += qs[static_cast<size_t>(i * d + e)] * ks[static_cast<size_t>(j * d + e)];
    return r;
  };
  EXPECT_NEAR(dot(3, 1), dot(2, 0), 1e-12);
  EXPECT_NEAR(dot(4, 4), dot(0, 0), 1e-12);
  EXPECT_GT(std::abs(dot(3, 0) - dot(0, 0)), 1e-6);
}

TEST(Kernels, AdamWFirstStepMovesByLearningRate) {
  // After one step m_hat = g and v_hat = g^2, so the update is lr * sign(g) (+ decay).
  V p = {1.0, -2.0}, g = {0.5, -3.0}, m(2, 0.0), v(2, 0.0);
  AdamW o;
  o.lr = 0.01;
  o.weight_decay = 0.0;
  adamw_step(p.data(), g.data(), m.data(), v.data(), 2, o, 1);
  EXPECT_NEAR(p[0], 1.0 - 0.01, 1e-9);
  EXPECT_NEAR(p[1], -2.0 + 0.01, 1e-9);
}

}  // namespace
}  // namespace ptdp::kernels
