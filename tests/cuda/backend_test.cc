// The CUDA backend (runtime/cuda/) against the CPU backend: every Backend call on fresh random
// inputs of awkward shapes (rows, widths and sequence lengths that are not multiples of a block
// or a warp, grouped-query attention, a vocabulary shard that is not a multiple of 128), then
// whole training runs. Each test skips, saying why, where no GPU is visible (scripts/gpu-check.sh
// runs them on a GPU machine).
#include "runtime/backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/model_spec.h"
#include "runtime/communicator.h"
#include "runtime/data.h"
#include "runtime/float16.h"
#include "runtime/gpt_model.h"
#include "runtime/tensor.h"
#include "runtime/trainer.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/cuda/tiny_run.h"

namespace ptdp {
namespace {

using Host = std::vector<float>;

Host random(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  Host x(n);
  for (float& v : x) v = u(g);
  return x;
}
// A GPU call's output starts as NaN, not zero, so a call that leaves an element unwritten (a
// zero it should have written, say) fails the comparison instead of passing on the zero.
Host unset(size_t n) {
  return Host(n, std::numeric_limits<float>::quiet_NaN());
}
// Random tokens of a vocabulary of 131, with a shard's first and last rows (or the vocabulary's
// last, where the shard runs past it), the row before it and a repeat among the first four.
std::vector<int32_t> shard_tokens(int64_t n, uint32_t seed, int64_t v0, int64_t vl) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  std::mt19937 g(seed);
  for (auto& tk : tokens) tk = static_cast<int32_t>(g() % 131);
  tokens[0] = tokens[3] = static_cast<int32_t>(v0);
  tokens[1] = static_cast<int32_t>(std::min<int64_t>(v0 + vl, 131) - 1);
  tokens[2] = static_cast<int32_t>(v0 - 1);
  return tokens;
}

// One GPU backend for the whole program; tests add their arrays to it and read them back.
class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PTDP_REQUIRE_GPU();
    cpu_ = make_backend("cpu");
    gpu_ = make_backend("cuda");
  }
  void TearDown() override {
    for (auto& [p, bytes] : owned_) gpu_->deallocate(p, bytes);
    owned_.clear();
    gpu_.reset();
  }
  float* up(const Host& h) {
    auto* p = static_cast<float*>(gpu_->allocate(h.size() * sizeof(float)));
    owned_.push_back({p, h.size() * sizeof(float)});
    gpu_->upload(h.data(), p, h.size() * sizeof(float));
    return p;
  }
  Host down(const float* p, size_t n) {
    Host h(n);
    gpu_->download(p, h.data(), n * sizeof(float));
    return h;
  }
  // bf16 arrays (mixed precision): rounded from fp32, widened back, moved to and from the GPU.
  using Bf16 = std::vector<uint16_t>;
  static Bf16 narrow(const Host& h) {
    Bf16 b(h.size());
    convert_on_host(h.data(), DType::kF32, b.data(), DType::kBF16, static_cast<int64_t>(h.size()));
    return b;
  }
  static Bf16 unset16(size_t n) { return Bf16(n, 0x7fc0); }  // NaN, as unset()
  static Host widen(const Bf16& b) {
    Host h(b.size());
    convert_on_host(b.data(), DType::kBF16, h.data(), DType::kF32, static_cast<int64_t>(b.size()));
    return h;
  }
  static Ptr host16(Bf16& b) { return Ptr(b.data(), DType::kBF16); }
  Ptr up16(const Bf16& b) {
    void* p = gpu_->allocate(b.size() * 2);
    owned_.push_back({p, b.size() * 2});
    gpu_->upload(b.data(), p, b.size() * 2);
    return Ptr(p, DType::kBF16);
  }
  Host down16(Ptr p, size_t count) {
    Bf16 b(count);
    gpu_->download(p.p, b.data(), count * 2);
    return widen(b);
  }
  // Every element within atol + rtol * |want|; the worst one is reported.
  static void expect_close(const Host& got, const Host& want, const std::string& what,
                           double rtol = 1e-4, double atol = 1e-5) {
    ASSERT_EQ(got.size(), want.size()) << what;
    size_t worst = 0;
    double worst_excess = -1;
    for (size_t i = 0; i < want.size(); ++i) {
      const double err = std::abs(static_cast<double>(got[i]) - want[i]);
      const double excess = err - (atol + rtol * std::abs(static_cast<double>(want[i])));
      if (!(excess <= worst_excess)) {
        worst_excess = excess;
        worst = i;
      }
    }
    EXPECT_LE(worst_excess, 0.0) << what << ": element " << worst << " is " << got[worst]
                                 << ", the CPU backend gives " << want[worst];
  }

  // Runs `call` (GPU work) and checks that it ran natively: no widened fp32 temporaries, at most
  // `bytes` of counted memory (the native call's own workspace) while it ran, none kept.
  static void expect_native(const std::function<void()>& call, const std::string& what,
                            int64_t bytes = 0) {
    MemoryCounter::reset_peak();
    const int64_t before = MemoryCounter::current();
    call();
    EXPECT_LE(MemoryCounter::peak() - before, bytes) << what << " was widened";
    EXPECT_EQ(MemoryCounter::current(), before) << what << " kept memory";
  }

  void moe_row_moves(int64_t h, int64_t k);  // MoeRowMovesMatchTheCpu: one width, k slots

  // An optimizer update's state on both sides: weights, a gradient in [-0.1, 0.1), zero
  // moments and a zero bf16 model copy (host arrays, and their device copies), with the update
  // tests' settings (lr 3e-3, weight decay 0.1).
  struct AdamWCase {
    Host p, gr, m, v;
    Bf16 model;
    float *gp = nullptr, *gm = nullptr, *gv = nullptr;
    Ptr gmodel;
    AdamWSettings o;
  };
  AdamWCase adamw_case(int64_t n, uint32_t seed) {
    AdamWCase c;
    c.p = random(n, seed);
    c.gr = random(n, seed + 1, -0.1f, 0.1f);
    c.m = c.v = Host(n);
    c.model = Bf16(static_cast<size_t>(n), 0);
    c.gp = up(c.p), c.gm = up(c.m), c.gv = up(c.v);
    c.gmodel = up16(c.model);
    c.o.lr = 3e-3;
    c.o.weight_decay = 0.1;
    return c;
  }

  std::unique_ptr<Backend> cpu_, gpu_;
  std::vector<std::pair<void*, size_t>> owned_;
};

TEST_F(CudaBackendTest, LinearLayersMatchTheCpu) {
  const int64_t n = 37, in = 70, out = 45;
  const Host x = random(n * in, 1), w = random(out * in, 2), b = random(out, 3),
             dy = random(n * out, 4), dw0 = random(out * in, 5), db0 = random(out, 6);
  Host y(n * out), dx(n * in), dw = dw0, db = db0;
  cpu_->linear_forward(x.data(), w.data(), b.data(), y.data(), n, in, out);
  cpu_->linear_dgrad(w.data(), dy.data(), dx.data(), n, in, out);
  cpu_->linear_wgrad(x.data(), dy.data(), dw.data(), db.data(), n, in, out);
  float *gx = up(x), *gw = up(w), *gb = up(b), *gdy = up(dy);
  float *gy = up(unset(n * out)), *gdx = up(unset(n * in)), *gdw = up(dw0), *gdb = up(db0);
  gpu_->linear_forward(gx, gw, gb, gy, n, in, out);
  gpu_->linear_dgrad(gw, gdy, gdx, n, in, out);
  gpu_->linear_wgrad(gx, gdy, gdw, gdb, n, in, out);
  expect_close(down(gy, y.size()), y, "linear forward");
  expect_close(down(gdx, dx.size()), dx, "linear dgrad");
  expect_close(down(gdw, dw.size()), dw, "linear wgrad (accumulated)");
  expect_close(down(gdb, db.size()), db, "bias grad (accumulated)");
}

// Mixed precision (--bf16): the typed GEMMs on bf16 operands run natively on the GPU (cuBLAS,
// bf16 in, fp32 accumulation) and the CPU widens them to its fp32 kernels; a widened element-wise
// call (bias add, GELU) goes through the GPU's conversion kernels. Outputs agree within bf16's
// rounding; weight and bias gradients accumulate into fp32.
TEST_F(CudaBackendTest, MixedPrecisionGemmsAndWideningMatchTheCpu) {
  const int64_t n = 37, in = 70, out = 45;
  auto x = narrow(random(n * in, 11)), w = narrow(random(out * in, 12)),
       b = narrow(random(out, 13)), dy = narrow(random(n * out, 14));
  const Host dw0 = random(out * in, 15), db0 = random(out, 16);
  Bf16 y(n * out), dx(n * in), act(n * out);
  Host dw = dw0, db = db0;
  const Ptr cx(x.data(), DType::kBF16), cw(w.data(), DType::kBF16), cb(b.data(), DType::kBF16),
      cdy(dy.data(), DType::kBF16);
  cpu_->linear_forward(cx, cw, cb, Ptr(y.data(), DType::kBF16), n, in, out);
  cpu_->linear_dgrad(cw, cdy, Ptr(dx.data(), DType::kBF16), n, in, out);
  cpu_->linear_wgrad(cx, cdy, dw.data(), db.data(), n, in, out);
  cpu_->gelu(Ptr(y.data(), DType::kBF16), Ptr(act.data(), DType::kBF16), n * out);
  const Ptr gx = up16(x), gw = up16(w), gb = up16(b), gdy = up16(dy);
  const Ptr gy = up16(std::vector<uint16_t>(n * out)), gdx = up16(std::vector<uint16_t>(n * in)),
            gact = up16(std::vector<uint16_t>(n * out));
  float *gdw = up(dw0), *gdb = up(db0);
  gpu_->linear_forward(gx, gw, gb, gy, n, in, out);
  gpu_->linear_dgrad(gw, gdy, gdx, n, in, out);
  gpu_->linear_wgrad(gx, gdy, gdw, gdb, n, in, out);
  gpu_->gelu(gy, gact, n * out);
  // Two bf16 roundings apart at most (the GPU sums in another order before rounding).
  expect_close(down16(gy, y.size()), widen(y), "bf16 linear forward", 1e-2, 1e-2);
  expect_close(down16(gdx, dx.size()), widen(dx), "bf16 linear dgrad", 1e-2, 1e-2);
  expect_close(down(gdw, dw.size()), dw, "bf16 linear wgrad into fp32", 1e-4, 1e-4);
  expect_close(down(gdb, db.size()), db, "bf16 bias grad into fp32", 1e-4, 1e-4);
  expect_close(down16(gact, act.size()), widen(act), "bf16 gelu (widened)", 2e-2, 2e-2);
}

// --fp16 runs widen every call on the GPU: its fp32 <-> fp16 conversion kernels round as the
// host's conversions do (to nearest even; past 65504 to infinity; subnormals kept), and a
// widened GEMM on fp16 operands matches the CPU's within fp16 rounding.
TEST_F(CudaBackendTest, Fp16ConversionsAndWideningMatchTheHost) {
  Host x = random(4099, 41);
  for (size_t i = 0; i < x.size(); i += 7) x[i] *= 1e5f;    // overflows
  for (size_t i = 3; i < x.size(); i += 11) x[i] *= 1e-6f;  // subnormals
  float* gx = up(x);
  void* g16 = gpu_->allocate(x.size() * 2);
  owned_.emplace_back(g16, x.size() * 2);
  gpu_->convert(gx, DType::kF32, g16, DType::kF16, static_cast<int64_t>(x.size()));
  std::vector<uint16_t> got(x.size());
  gpu_->download(g16, got.data(), got.size() * 2);
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(got[i], float_to_fp16(x[i])) << "element " << i << " = " << x[i];
  float* back = up(unset(x.size()));
  gpu_->convert(g16, DType::kF16, back, DType::kF32, static_cast<int64_t>(x.size()));
  const Host wide = down(back, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = fp16_to_float(got[i]);
    if (std::isinf(want))
      EXPECT_EQ(wide[i], want) << i;
    else
      ASSERT_EQ(wide[i], want) << i;
  }

  const int64_t n = 37, in = 70, out = 45;
  auto half = [](const Host& h) {
    std::vector<uint16_t> o(h.size());
    for (size_t i = 0; i < h.size(); ++i) o[i] = float_to_fp16(h[i]);
    return o;
  };
  std::vector<uint16_t> hx = half(random(n * in, 42)), hw = half(random(out * in, 43)), hy(n * out);
  cpu_->linear_forward(Ptr(hx.data(), DType::kF16), Ptr(hw.data(), DType::kF16), Ptr(),
                       Ptr(hy.data(), DType::kF16), n, in, out);
  auto up_half = [&](const std::vector<uint16_t>& h) {
    void* p = gpu_->allocate(h.size() * 2);
    owned_.emplace_back(p, h.size() * 2);
    gpu_->upload(h.data(), p, h.size() * 2);
    return Ptr(p, DType::kF16);
  };
  const Ptr gy = up_half(std::vector<uint16_t>(hy.size()));
  gpu_->linear_forward(up_half(hx), up_half(hw), Ptr(), gy, n, in, out);
  std::vector<uint16_t> ry(hy.size());
  gpu_->download(gy.p, ry.data(), ry.size() * 2);
  Host a(hy.size()), b(hy.size());
  for (size_t i = 0; i < hy.size(); ++i) {
    a[i] = fp16_to_float(ry[i]);
    b[i] = fp16_to_float(hy[i]);
  }
  expect_close(a, b, "fp16 linear forward (widened)", 2e-3, 2e-3);
}

// The bf16 kernels of kernels/cuda/ behind the typed calls (flash attention at head dimension
// 64 with grouped queries and an odd sequence, also as the last 37 of 90 positions, the
// diagonal shifted as context parallelism calls it; LayerNorm and RMSNorm, SwiGLU) against the
// CPU backend's widening of the same bf16 inputs.
TEST_F(CudaBackendTest, MixedPrecisionNativeKernelsMatchTheCpu) {
  for (const int64_t sk : {37, 90}) {
    const int64_t b = 2, s = 37, hq = 4, hk = 2, d = 64, nq = b * s * hq * d, nk = b * sk * hk * d;
    const std::string at = " (" + std::to_string(s) + " queries, " + std::to_string(sk) + " keys)";
    Bf16 q = narrow(random(nq, 21)), kk = narrow(random(nk, 22)), v = narrow(random(nk, 23)),
         dout = narrow(random(nq, 24));
    Bf16 out(nq), dq(nq), dk(nk), dv(nk);
    Host lse(b * hq * s);
    cpu_->flash_attention_forward(host16(q), host16(kk), host16(v), host16(out), lse.data(), b, s,
                                  sk, hq, hk, d);
    cpu_->flash_attention_backward(host16(q), host16(kk), host16(v), host16(out), lse.data(),
                                   host16(dout), host16(dq), host16(dk), host16(dv), b, s, sk, hq,
                                   hk, d);
    const Ptr gq = up16(q), gk = up16(kk), gv = up16(v), gdo = up16(dout), gout = up16(unset16(nq)),
              gdq = up16(unset16(nq)), gdk = up16(unset16(nk)), gdv = up16(unset16(nk));
    float* glse = up(unset(lse.size()));
    gpu_->flash_attention_forward(gq, gk, gv, gout, glse, b, s, sk, hq, hk, d);
    gpu_->flash_attention_backward(gq, gk, gv, gout, glse, gdo, gdq, gdk, gdv, b, s, sk, hq, hk, d);
    expect_close(down16(gout, out.size()), widen(out), "bf16 flash attention output" + at, 2e-2,
                 2e-2);
    expect_close(down(glse, lse.size()), lse, "bf16 flash attention lse" + at, 1e-3, 1e-3);
    expect_close(down16(gdq, dq.size()), widen(dq), "bf16 flash attention d q" + at, 5e-2, 5e-2);
    expect_close(down16(gdk, dk.size()), widen(dk), "bf16 flash attention d k" + at, 5e-2, 5e-2);
    expect_close(down16(gdv, dv.size()), widen(dv), "bf16 flash attention d v" + at, 5e-2, 5e-2);
  }

  const int64_t n = 19, h = 301;
  for (const bool layernorm : {true, false}) {
    Bf16 x = narrow(random(n * h, 31)), g = narrow(random(h, 32)), beta = narrow(random(h, 33)),
         dy = narrow(random(n * h, 34)), y(n * h), dx(n * h);
    Host mean(n), rstd(n), dg(h), db(h);
    const Ptr cbeta = layernorm ? host16(beta) : Ptr();
    cpu_->norm_forward(host16(x), host16(g), cbeta, host16(y), layernorm ? mean.data() : nullptr,
                       rstd.data(), n, h);
    cpu_->norm_backward(host16(x), host16(g), layernorm, layernorm ? mean.data() : nullptr,
                        rstd.data(), host16(dy), host16(dx), dg.data(),
                        layernorm ? db.data() : nullptr, n, h);
    const Ptr gx = up16(x), gg = up16(g), gbeta = layernorm ? up16(beta) : Ptr(), gdy = up16(dy),
              gy = up16(unset16(n * h)), gdx = up16(unset16(n * h));
    float *gmean = up(unset(n)), *grstd = up(unset(n)), *gdg = up(Host(h)),
          *gdb = up(Host(h));  // added to
    gpu_->norm_forward(gx, gg, gbeta, gy, layernorm ? gmean : nullptr, grstd, n, h);
    gpu_->norm_backward(gx, gg, layernorm, layernorm ? gmean : nullptr, grstd, gdy, gdx, gdg,
                        layernorm ? gdb : nullptr, n, h);
    const std::string what = layernorm ? "bf16 layernorm" : "bf16 rmsnorm";
    expect_close(down16(gy, y.size()), widen(y), what + " forward", 2e-2, 2e-2);
    expect_close(down(grstd, n), rstd, what + " rstd", 1e-4, 1e-5);
    expect_close(down16(gdx, dx.size()), widen(dx), what + " dx", 2e-2, 2e-2);
    expect_close(down(gdg, h), dg, what + " d gamma", 1e-3, 1e-3);
  }

  const int64_t rows = 23, f = 45;
  Bf16 sx = narrow(random(rows * 2 * f, 41)), sdy = narrow(random(rows * f, 42)), sy(rows * f),
       sdx(rows * 2 * f);
  cpu_->swiglu(host16(sx), host16(sy), rows, f);
  cpu_->swiglu_backward(host16(sx), host16(sdy), host16(sdx), rows, f);
  const Ptr gsx = up16(sx), gsdy = up16(sdy), gsy = up16(unset16(sy.size())),
            gsdx = up16(unset16(sdx.size()));
  gpu_->swiglu(gsx, gsy, rows, f);
  gpu_->swiglu_backward(gsx, gsdy, gsdx, rows, f);
  expect_close(down16(gsy, sy.size()), widen(sy), "bf16 swiglu", 2e-2, 2e-2);
  expect_close(down16(gsdx, sdx.size()), widen(sdx), "bf16 swiglu backward", 2e-2, 2e-2);
}

// Mixed precision (--bf16): the glue, the rotary embedding, the vocabulary-parallel embedding and
// the cross-entropy run natively on bf16 storage on the GPU (no counted fp32 temporaries) and
// give what the CPU backend's widening of the same bf16 inputs gives: bf16 outputs within bf16
// rounding, fp32 gradients and statistics within fp32 summation order, copies exactly.
TEST_F(CudaBackendTest, MixedPrecisionGlueEmbeddingAndCrossEntropyRunNatively) {
  constexpr double kBf16 = 2e-2, kF32 = 1e-3;  // relative tolerances
  // Element-wise: add, bias add and its gradient into fp32, scale.
  const int64_t rows = 25, width = 41, m = rows * width;
  Bf16 y = narrow(random(m, 70)), x = narrow(random(m, 71)), bias = narrow(random(width, 72));
  const Host db0 = random(width, 73);
  Host db = db0;
  const Ptr gy = up16(y), gx = up16(x), gbias = up16(bias);
  float* gdb = up(db0);
  cpu_->add(host16(y), host16(x), m);
  expect_native([&] { gpu_->add(gy, gx, m); }, "bf16 add");
  expect_close(down16(gy, y.size()), widen(y), "bf16 add", kBf16, 1e-3);
  cpu_->add_bias(host16(y), host16(bias), rows, width);
  expect_native([&] { gpu_->add_bias(gy, gbias, rows, width); }, "bf16 add_bias");
  expect_close(down16(gy, y.size()), widen(y), "bf16 add_bias", kBf16, 1e-3);
  cpu_->bias_grad(host16(y), db.data(), rows, width);
  expect_native([&] { gpu_->bias_grad(gy, gdb, rows, width); }, "bf16 bias_grad");
  expect_close(down(gdb, db.size()), db, "bf16 bias_grad into fp32", kF32, 1e-5);
  {  // 40 columns: 8 a thread from 16-byte loads (column_sum_vec)
    Host db40(db0.begin(), db0.begin() + 40);
    float* gdb40 = up(db40);
    cpu_->bias_grad(host16(y), db40.data(), rows, 40);
    expect_native([&] { gpu_->bias_grad(gy, gdb40, rows, 40); }, "bf16 bias_grad, 40 columns");
    expect_close(down(gdb40, 40), db40, "bf16 bias_grad of 40 columns into fp32", kF32, 1e-5);
  }
  cpu_->scale(host16(y), m, 0.37);
  expect_native([&] { gpu_->scale(gy, m, 0.37); }, "bf16 scale");
  expect_close(down16(gy, y.size()), widen(y), "bf16 scale", kBf16, 1e-3);

  // Copies: column split and concatenation (widths of no whole vector: element by element; of
  // whole 16-byte vectors, 21 rows, not a whole number of the kernel's 4-row groups; and with no
  // third part, whose buffer the runtime passes as the first's), sequence shards (t = 3).
  for (const auto& [a, bw, c] : {std::array<int64_t, 3>{5, 7, 9}, {16, 8, 24}, {16, 8, 0}}) {
    SCOPED_TRACE("split widths " + std::to_string(a) + ", " + std::to_string(bw) + ", " +
                 std::to_string(c));
    const int64_t n = 21;
    Bf16 cols = narrow(random(n * (a + bw + c), 74)), y0(n * a), y1(n * bw), y2(n * c),
         back(cols.size());
    Bf16& y2_or_0 = c > 0 ? y2 : y0;
    cpu_->split_columns3(host16(cols), host16(y0), host16(y1), host16(y2_or_0), n, a, bw, c);
    cpu_->concat_columns3(host16(y0), host16(y1), host16(y2_or_0), host16(back), n, a, bw, c);
    const Ptr gcols = up16(cols), g0 = up16(unset16(y0.size())), g1 = up16(unset16(y1.size())),
              g2 = c > 0 ? up16(unset16(y2.size())) : g0, gback = up16(unset16(back.size()));
    expect_native([&] { gpu_->split_columns3(gcols, g0, g1, g2, n, a, bw, c); }, "bf16 split");
    expect_native([&] { gpu_->concat_columns3(g0, g1, g2, gback, n, a, bw, c); }, "bf16 concat");
    expect_close(down16(g0, y0.size()), widen(y0), "bf16 split_columns3 (a)", 0, 0);
    expect_close(down16(g1, y1.size()), widen(y1), "bf16 split_columns3 (b)", 0, 0);
    if (c > 0) expect_close(down16(g2, y2.size()), widen(y2), "bf16 split_columns3 (c)", 0, 0);
    expect_close(down16(gback, back.size()), widen(cols), "bf16 concat_columns3", 0, 0);
  }
  const int64_t t = 3, b = 2, s = 12, sw = 11;
  Bf16 full = narrow(random(b * s * sw, 75)), shards(full.size());
  cpu_->sequence_shard(host16(full), host16(shards), t, b, s, sw);
  const Ptr gfull = up16(full), gsh = up16(unset16(full.size())), gun = up16(unset16(full.size()));
  expect_native([&] { gpu_->sequence_shard(gfull, gsh, t, b, s, sw); }, "bf16 sequence_shard");
  expect_native([&] { gpu_->sequence_unshard(gsh, gun, t, b, s, sw); }, "bf16 sequence_unshard");
  expect_close(down16(gsh, shards.size()), widen(shards), "bf16 sequence_shard", 0, 0);
  expect_close(down16(gun, full.size()), widen(full), "bf16 sequence_unshard", 0, 0);

  // The rotary embedding in place, both directions.
  const int64_t heads = 3, d = 10, sr = 23;
  for (const bool inverse : {false, true}) {
    Bf16 r = narrow(random(b * sr * heads * d, 76));
    const Ptr gr = up16(r);
    cpu_->rope(host16(r), b, sr, heads, d, 10000.0, inverse);
    expect_native([&] { gpu_->rope(gr, b, sr, heads, d, 10000.0, inverse); }, "bf16 rope");
    expect_close(down16(gr, r.size()), widen(r), inverse ? "bf16 rope inverse" : "bf16 rope", kBf16,
                 1e-3);
  }

  // The embedding on a vocabulary shard from row 67 of 72 rows, the last 11 padding (72 is a
  // multiple of 8, so the bf16 cross-entropy takes its 16-byte-vector kernels, while the
  // training tests' vocabulary of 131 takes the element-wise ones; 61 valid, so one vector holds
  // both logits and padding), token ids of a 131-token vocabulary inside and outside it, from
  // host memory; positions from 7 on.
  const int64_t tokens_n = 30, h = 13, v0 = 67, vl = 72, valid = 61, pb = 3, sl = 10, first = 7;
  const std::vector<int32_t> tokens = shard_tokens(tokens_n, 77, v0, vl);
  Bf16 table = narrow(random(vl * h, 78)), dy = narrow(random(tokens_n * h, 79)),
       pos = narrow(random((first + sl) * h, 80)), emb(tokens_n * h);
  const Host dtable0 = random(vl * h, 81), dpos0 = random((first + sl) * h, 82);
  Host dtable = dtable0, dpos = dpos0;
  cpu_->vocab_embedding_lookup(tokens.data(), host16(table), host16(emb), tokens_n, h, v0, vl);
  const Ptr gtable = up16(table), gdy = up16(dy), gpos = up16(pos),
            gemb = up16(unset16(emb.size()));
  float *gdtable = up(dtable0), *gdpos = up(dpos0);
  expect_native(
      [&] { gpu_->vocab_embedding_lookup(tokens.data(), gtable, gemb, tokens_n, h, v0, vl); },
      "bf16 embedding lookup");
  expect_close(down16(gemb, emb.size()), widen(emb), "bf16 embedding lookup", 0, 0);
  cpu_->add_positions(host16(emb), host16(pos), pb, sl, h, first);
  expect_native([&] { gpu_->add_positions(gemb, gpos, pb, sl, h, first); }, "bf16 add_positions");
  expect_close(down16(gemb, emb.size()), widen(emb), "bf16 add_positions", kBf16, 1e-3);
  cpu_->vocab_embedding_grad(tokens.data(), host16(dy), dtable.data(), tokens_n, h, v0, vl);
  expect_native(
      [&] { gpu_->vocab_embedding_grad(tokens.data(), gdy, gdtable, tokens_n, h, v0, vl); },
      "bf16 embedding gradient");
  expect_close(down(gdtable, dtable.size()), dtable, "bf16 embedding gradient into fp32", kF32,
               1e-5);
  cpu_->position_grad(host16(dy), dpos.data(), pb, sl, h, first);
  expect_native([&] { gpu_->position_grad(gdy, gdpos, pb, sl, h, first); }, "bf16 position_grad");
  expect_close(down(gdpos, dpos.size()), dpos, "bf16 position gradient into fp32", kF32, 1e-5);

  // The cross-entropy on the same shard: statistics, then the finish with this rank's statistics
  // alone and beside two other tensor-parallel ranks' ([3, n, 3]), then the backward pass.
  constexpr int64_t k = 3;  // statistics per token
  const Bf16 logits0 = narrow(random(tokens_n * vl, 83, -5, 5));
  Bf16 logits = logits0;
  Host stats(tokens_n * k);
  cpu_->cross_entropy_stats(host16(logits), tokens.data(), stats.data(), tokens_n, vl, valid, v0);
  const Ptr glogits = up16(logits);
  float* gstats = up(unset(stats.size()));
  expect_native(
      [&] { gpu_->cross_entropy_stats(glogits, tokens.data(), gstats, tokens_n, vl, valid, v0); },
      "bf16 cross-entropy statistics");
  expect_close(down(gstats, stats.size()), stats, "bf16 cross-entropy statistics", kF32, 1e-5);
  Host others = stats;  // this rank's, then two more ranks' (max, sum of exp, target logit)
  for (const uint32_t seed : {84u, 85u}) {
    const Host mx = random(tokens_n, seed, -5, 5), sum = random(tokens_n, seed + 10, 0.5f, 60.0f),
               tgt = random(tokens_n, seed + 20, -5, 5);
    for (int64_t i = 0; i < tokens_n; ++i) others.insert(others.end(), {mx[i], sum[i], tgt[i]});
  }
  for (const int64_t ranks : {int64_t{1}, int64_t{3}}) {
    const std::string at = " (" + std::to_string(ranks) + " ranks)";
    Bf16 probs = logits0;
    Host lse(tokens_n);
    const double loss = cpu_->cross_entropy_finish(others.data(), ranks, host16(probs), lse.data(),
                                                   tokens_n, vl, valid);
    const Ptr gprobs = up16(logits0);
    float *gothers = up(others), *glse = up(unset(tokens_n));
    double gloss = 0;
    expect_native(
        [&] {
          gloss = gpu_->cross_entropy_finish(gothers, ranks, gprobs, glse, tokens_n, vl, valid);
        },
        "bf16 cross-entropy finish" + at,
        static_cast<int64_t>(sizeof(float)) * tokens_n);  // the rows' losses
    EXPECT_NEAR(gloss, loss, 1e-5 * tokens_n + 1e-4 * std::abs(loss)) << at;
    expect_close(down(glse, lse.size()), lse, "bf16 cross-entropy log-sum-exp" + at, 1e-4, 1e-5);
    expect_close(down16(gprobs, probs.size()), widen(probs), "bf16 probabilities" + at, kBf16,
                 1e-5);
    // The backward pass from the CPU's probabilities on both sides.
    const Ptr gp = up16(probs);
    cpu_->cross_entropy_backward(host16(probs), tokens.data(), tokens_n, vl, v0, 0.5);
    expect_native([&] { gpu_->cross_entropy_backward(gp, tokens.data(), tokens_n, vl, v0, 0.5); },
                  "bf16 cross-entropy backward" + at);
    expect_close(down16(gp, probs.size()), widen(probs), "bf16 logit gradient" + at, kBf16, 1e-6);

    // The deferred pair (the runtime's calls): the loss and lse without the probabilities, then
    // the gradient from the logits and lse in one pass; against the GPU's two calls above on
    // the same logits, the same bits, loss and lse. At this vocabulary's 72 columns (16-byte
    // vectors) and at 61 with 58 valid (element by element; no vector kernel's shape).
    for (const auto& [cols, good] : {std::pair<int64_t, int64_t>{vl, valid}, {61, 58}}) {
      const std::string in = at + ", " + std::to_string(cols) + " columns";
      const Bf16 x0(logits0.begin(), logits0.begin() + tokens_n * cols);
      const Ptr two = up16(x0), pair = up16(x0);
      float *glse2 = up(unset(tokens_n)), *glse_pair = up(unset(tokens_n));
      const double loss2 =
          gpu_->cross_entropy_finish(gothers, ranks, two, glse2, tokens_n, cols, good);
      gpu_->cross_entropy_backward(two, tokens.data(), tokens_n, cols, v0, 0.5);
      double loss_pair = 0;
      expect_native(
          [&] {
            loss_pair =
                gpu_->cross_entropy_loss(gothers, ranks, pair, glse_pair, tokens_n, cols, good);
          },
          "bf16 cross-entropy loss" + in, static_cast<int64_t>(sizeof(float)) * tokens_n);
      expect_close(down16(pair, x0.size()), widen(x0), "logits kept by the loss" + in, 0, 0);
      expect_native(
          [&] {
            gpu_->cross_entropy_backward_from_lse(pair, glse_pair, tokens.data(), tokens_n, cols,
                                                  good, v0, 0.5);
          },
          "bf16 cross-entropy backward from lse" + in);
      EXPECT_EQ(loss_pair, loss2) << in;
      expect_close(down(glse_pair, tokens_n), down(glse2, tokens_n), "pair's lse" + in, 0, 0);
      expect_close(down16(pair, x0.size()), down16(two, x0.size()), "pair's gradient" + in, 0, 0);
    }
  }
}

// Mixed precision: the unfused attention pieces (scores, causal softmax, context and their
// backward) on bf16 operands run natively on the GPU (cuBLAS with bf16 in and out, fp32
// accumulation; the softmax kernels on bf16 storage) with grouped queries (4 query heads on 2
// key/value heads: dk and dv summed over a group in an fp32 workspace, rounded once) and without
// (3 on 3: written directly), at a sequence length that is no multiple of 32. Each GPU call gets
// the CPU's bf16 inputs, so every step is compared on its own; outputs start non-zero, so they
// must be overwritten, not added to.
TEST_F(CudaBackendTest, MixedPrecisionAttentionPiecesRunNatively) {
  constexpr double kBf16 = 2e-2;
  for (const auto& heads : {std::pair<int64_t, int64_t>{4, 2}, {3, 3}}) {
    const int64_t hq = heads.first, hk = heads.second;  // named, for the lambdas to capture
    const int64_t b = 2, s = 19, d = 16, rows = b * hq, nq = b * s * hq * d, nk = b * s * hk * d,
                  np = rows * s * s;
    const std::string at = " (hq " + std::to_string(hq) + ", hk " + std::to_string(hk) + ")";
    const Bf16 q = narrow(random(nq, 90)), kk = narrow(random(nk, 91)), v = narrow(random(nk, 92)),
               dout = narrow(random(nq, 93));
    Bf16 scores(np), probs(np), ctx(nq), dprobs(np), dv(nk), dscores(np), dq(nq), dk(nk);
    cpu_->attention_scores(CPtr(q.data(), DType::kBF16), CPtr(kk.data(), DType::kBF16),
                           host16(scores), b, s, hq, hk, d);
    probs = scores;
    cpu_->causal_softmax(host16(probs), rows, s);
    cpu_->attention_context(host16(probs), CPtr(v.data(), DType::kBF16), host16(ctx), b, s, hq, hk,
                            d);
    cpu_->attention_context_backward(host16(probs), CPtr(v.data(), DType::kBF16),
                                     CPtr(dout.data(), DType::kBF16), host16(dprobs), host16(dv), b,
                                     s, hq, hk, d);
    cpu_->causal_softmax_backward(host16(probs), host16(dprobs), host16(dscores), rows, s);
    cpu_->attention_scores_backward(CPtr(q.data(), DType::kBF16), CPtr(kk.data(), DType::kBF16),
                                    host16(dscores), host16(dq), host16(dk), b, s, hq, hk, d);

    const Ptr gq = up16(q), gk = up16(kk), gv = up16(v), gdout = up16(dout);
    const Bf16 sevens = narrow(Host(np, 7.0f)), threes = narrow(Host(std::max(nq, nk), 3.0f));
    const Ptr gs = up16(sevens);
    expect_native([&] { gpu_->attention_scores(gq, gk, gs, b, s, hq, hk, d); },
                  "bf16 attention scores" + at);
    expect_close(down16(gs, scores.size()), widen(scores), "bf16 attention scores" + at, kBf16,
                 1e-3);
    const Ptr gp = up16(scores);
    expect_native([&] { gpu_->causal_softmax(gp, rows, s); }, "bf16 causal softmax" + at);
    expect_close(down16(gp, probs.size()), widen(probs), "bf16 causal softmax" + at, kBf16, 1e-3);
    const Ptr gprobs = up16(probs), gctx = up16(Bf16(threes.begin(), threes.begin() + nq));
    expect_native([&] { gpu_->attention_context(gprobs, gv, gctx, b, s, hq, hk, d); },
                  "bf16 attention context" + at);
    expect_close(down16(gctx, ctx.size()), widen(ctx), "bf16 attention context" + at, kBf16, 1e-3);
    // dk and dv: an fp32 workspace of their size when query heads share them.
    const int64_t sum_bytes = hq > hk ? static_cast<int64_t>(sizeof(float)) * nk : 0;
    const Ptr gdp = up16(sevens), gdv = up16(Bf16(threes.begin(), threes.begin() + nk));
    expect_native(
        [&] { gpu_->attention_context_backward(gprobs, gv, gdout, gdp, gdv, b, s, hq, hk, d); },
        "bf16 attention context backward" + at, sum_bytes);
    expect_close(down16(gdp, dprobs.size()), widen(dprobs), "bf16 d probs" + at, kBf16, 1e-3);
    expect_close(down16(gdv, dv.size()), widen(dv), "bf16 d v" + at, kBf16, 1e-3);
    const Ptr gdprobs = up16(dprobs), gds = up16(sevens);
    expect_native([&] { gpu_->causal_softmax_backward(gprobs, gdprobs, gds, rows, s); },
                  "bf16 causal softmax backward" + at);
    expect_close(down16(gds, dscores.size()), widen(dscores), "bf16 d scores" + at, kBf16, 1e-3);
    const Ptr gdscores = up16(dscores), gdq = up16(Bf16(threes.begin(), threes.begin() + nq)),
              gdk = up16(Bf16(threes.begin(), threes.begin() + nk));
    expect_native(
        [&] { gpu_->attention_scores_backward(gq, gk, gdscores, gdq, gdk, b, s, hq, hk, d); },
        "bf16 attention scores backward" + at, sum_bytes);
    expect_close(down16(gdq, dq.size()), widen(dq), "bf16 d q" + at, kBf16, 1e-3);
    expect_close(down16(gdk, dk.size()), widen(dk), "bf16 d k" + at, kBf16, 1e-3);
    // Either gradient alone (the other null), as the typed forms allow.
    const Ptr gdk2 = up16(Bf16(threes.begin(), threes.begin() + nk));
    expect_native(
        [&] { gpu_->attention_scores_backward(gq, gk, gdscores, Ptr(), gdk2, b, s, hq, hk, d); },
        "bf16 attention scores backward, dk alone" + at, sum_bytes);
    expect_close(down16(gdk2, dk.size()), widen(dk), "bf16 d k alone" + at, kBf16, 1e-3);
  }
}

// Scores, softmax, context and their backward, with grouped queries (4 query heads on 2 key/value
// heads) and without, at a sequence length that is not a multiple of 32.
TEST_F(CudaBackendTest, AttentionPiecesMatchTheCpu) {
  for (const auto& [hq, hk] : {std::pair<int64_t, int64_t>{4, 2}, {3, 3}}) {
    const int64_t b = 2, s = 19, d = 16, rows = b * hq;
    const std::string at = " (hq " + std::to_string(hq) + ", hk " + std::to_string(hk) + ")";
    const Host q = random(b * s * hq * d, 10), k = random(b * s * hk * d, 11),
               v = random(b * s * hk * d, 12), dout = random(b * s * hq * d, 13);
    Host probs(rows * s * s), ctx(b * s * hq * d), dprobs(rows * s * s), dv(b * s * hk * d),
        dscores(rows * s * s), dq(b * s * hq * d), dk(b * s * hk * d);
    cpu_->attention_scores(q.data(), k.data(), probs.data(), b, s, hq, hk, d);
    const Host scores = probs;
    cpu_->causal_softmax(probs.data(), rows, s);
    cpu_->attention_context(probs.data(), v.data(), ctx.data(), b, s, hq, hk, d);
    cpu_->attention_context_backward(probs.data(), v.data(), dout.data(), dprobs.data(), dv.data(),
                                     b, s, hq, hk, d);
    cpu_->causal_softmax_backward(probs.data(), dprobs.data(), dscores.data(), rows, s);
    cpu_->attention_scores_backward(q.data(), k.data(), dscores.data(), dq.data(), dk.data(), b, s,
                                    hq, hk, d);
    float *gq = up(q), *gk = up(k), *gv = up(v), *gdout = up(dout);
    float *gp = up(Host(probs.size(), 7.0f)), *gctx = up(unset(ctx.size())),
          *gdp = up(unset(dprobs.size())), *gdv = up(Host(dv.size(), 3.0f)),
          *gds = up(unset(dscores.size())), *gdq = up(unset(dq.size())),
          *gdk = up(Host(dk.size(), 3.0f));
    gpu_->attention_scores(gq, gk, gp, b, s, hq, hk, d);
    expect_close(down(gp, scores.size()), scores, "attention scores" + at);
    gpu_->causal_softmax(gp, rows, s);
    expect_close(down(gp, probs.size()), probs, "causal softmax" + at);
    gpu_->attention_context(gp, gv, gctx, b, s, hq, hk, d);
    expect_close(down(gctx, ctx.size()), ctx, "attention context" + at);
    gpu_->attention_context_backward(gp, gv, gdout, gdp, gdv, b, s, hq, hk, d);
    expect_close(down(gdp, dprobs.size()), dprobs, "d probs" + at);
    expect_close(down(gdv, dv.size()), dv, "d v" + at);
    gpu_->causal_softmax_backward(gp, gdp, gds, rows, s);
    expect_close(down(gds, dscores.size()), dscores, "d scores" + at);
    gpu_->attention_scores_backward(gq, gk, gds, gdq, gdk, b, s, hq, hk, d);
    expect_close(down(gdq, dq.size()), dq, "d q" + at);
    expect_close(down(gdk, dk.size()), dk, "d k" + at);
  }
}

// The fused (flash) attention of --use-flash-attn against the CPU twin, forward and backward,
// with and without grouped queries, at odd sequence lengths and head dimensions that are not a
// multiple of the warp (16, 40) beside GPT-2's 64; and queries that are the last s of sk
// positions (context parallelism's chunks).
TEST_F(CudaBackendTest, FlashAttentionMatchesTheCpu) {
  struct Case {
    int64_t b, s, sk, hq, hk, d;
  };
  for (const Case& c :
       {Case{2, 19, 19, 4, 2, 16}, Case{1, 70, 70, 3, 3, 40}, Case{2, 33, 33, 2, 1, 64},
        Case{2, 12, 36, 4, 2, 16}, Case{1, 8, 40, 2, 2, 40}}) {
    const std::string at = " (s " + std::to_string(c.s) + ", sk " + std::to_string(c.sk) + ", hq " +
                           std::to_string(c.hq) + ", hk " + std::to_string(c.hk) + ", d " +
                           std::to_string(c.d) + ")";
    const size_t nq = static_cast<size_t>(c.b * c.s * c.hq * c.d),
                 nk = static_cast<size_t>(c.b * c.sk * c.hk * c.d),
                 nl = static_cast<size_t>(c.b * c.hq * c.s);
    const Host q = random(nq, 20), k = random(nk, 21), v = random(nk, 22), dout = random(nq, 23);
    Host out(nq), lse(nl), dq(nq), dk(nk), dv(nk);
    cpu_->flash_attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), c.b, c.s,
                                  c.sk, c.hq, c.hk, c.d);
    cpu_->flash_attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(),
                                   dout.data(), dq.data(), dk.data(), dv.data(), c.b, c.s, c.sk,
                                   c.hq, c.hk, c.d);
    float *gq = up(q), *gk = up(k), *gv = up(v), *gdout = up(dout);
    float *gout = up(unset(nq)), *glse = up(unset(nl)), *gdq = up(Host(nq, 5.0f)),
          *gdk = up(Host(nk, 5.0f)), *gdv = up(Host(nk, 5.0f));  // overwritten, not added to
    gpu_->flash_attention_forward(gq, gk, gv, gout, glse, c.b, c.s, c.sk, c.hq, c.hk, c.d);
    expect_close(down(gout, nq), out, "flash attention output" + at);
    expect_close(down(glse, nl), lse, "flash attention lse" + at);
    gpu_->flash_attention_backward(gq, gk, gv, gout, glse, gdout, gdq, gdk, gdv, c.b, c.s, c.sk,
                                   c.hq, c.hk, c.d);
    expect_close(down(gdq, nq), dq, "flash attention d q" + at);
    expect_close(down(gdk, nk), dk, "flash attention d k" + at);
    expect_close(down(gdv, nk), dv, "flash attention d v" + at);
    // Deterministic: a second backward pass gives the same bits.
    const Host first = down(gdk, nk);
    gpu_->flash_attention_backward(gq, gk, gv, gout, glse, gdout, gdq, gdk, gdv, c.b, c.s, c.sk,
                                   c.hq, c.hk, c.d);
    EXPECT_EQ(down(gdk, nk), first) << "flash attention d k is not reproducible" << at;
  }
}

TEST_F(CudaBackendTest, NormsMatchTheCpu) {
  for (const bool layernorm : {true, false}) {
    const int64_t n = 33, h = 301;
    const std::string what = layernorm ? "layernorm" : "rmsnorm";
    const Host x = random(n * h, 20, -2, 3), g = random(h, 21), beta = random(h, 22),
               dy = random(n * h, 23), dg0 = random(h, 24), db0 = random(h, 25);
    Host y(n * h), mean(n), rstd(n), dx(n * h), dg = dg0, db = db0;
    cpu_->norm_forward(x.data(), g.data(), layernorm ? beta.data() : nullptr, y.data(),
                       layernorm ? mean.data() : nullptr, rstd.data(), n, h);
    cpu_->norm_backward(x.data(), g.data(), layernorm, layernorm ? mean.data() : nullptr,
                        rstd.data(), dy.data(), dx.data(), dg.data(),
                        layernorm ? db.data() : nullptr, n, h);
    float *gx = up(x), *gg = up(g), *gbeta = up(beta), *gdy = up(dy);
    float *gy = up(unset(n * h)), *gmean = up(unset(n)), *grstd = up(unset(n)),
          *gdx = up(unset(n * h)), *gdg = up(dg0), *gdb = up(db0);
    gpu_->norm_forward(gx, gg, layernorm ? gbeta : nullptr, gy, layernorm ? gmean : nullptr, grstd,
                       n, h);
    gpu_->norm_backward(gx, gg, layernorm, layernorm ? gmean : nullptr, grstd, gdy, gdx, gdg,
                        layernorm ? gdb : nullptr, n, h);
    expect_close(down(gy, y.size()), y, what + " forward");
    expect_close(down(grstd, n), rstd, what + " rstd");
    if (layernorm) expect_close(down(gmean, n), mean, what + " mean");
    expect_close(down(gdx, dx.size()), dx, what + " dx");
    expect_close(down(gdg, h), dg, what + " d gamma (accumulated)");
    if (layernorm) expect_close(down(gdb, h), db, what + " d beta (accumulated)");
  }
}

TEST_F(CudaBackendTest, ActivationsAndRotaryEmbeddingMatchTheCpu) {
  const int64_t n = 29, f = 53;
  const Host x = random(n * 2 * f, 30, -4, 4), dy = random(n * 2 * f, 31);
  Host y(n * 2 * f), dx(n * 2 * f), sy(n * f), sdx(n * 2 * f);
  cpu_->gelu(x.data(), y.data(), n * 2 * f);
  cpu_->gelu_backward(x.data(), dy.data(), dx.data(), n * 2 * f);
  cpu_->swiglu(x.data(), sy.data(), n, f);
  cpu_->swiglu_backward(x.data(), dy.data(), sdx.data(), n, f);
  float *gx = up(x), *gdy = up(dy), *gy = up(unset(y.size())), *gdx = up(unset(dx.size())),
        *gsy = up(unset(sy.size())), *gsdx = up(unset(sdx.size()));
  gpu_->gelu(gx, gy, n * 2 * f);
  gpu_->gelu_backward(gx, gdy, gdx, n * 2 * f);
  gpu_->swiglu(gx, gsy, n, f);
  gpu_->swiglu_backward(gx, gdy, gsdx, n, f);
  expect_close(down(gy, y.size()), y, "gelu");
  expect_close(down(gdx, dx.size()), dx, "gelu backward");
  expect_close(down(gsy, sy.size()), sy, "swiglu");
  expect_close(down(gsdx, sdx.size()), sdx, "swiglu backward");

  const int64_t b = 2, s = 23, heads = 3, d = 10;
  for (const bool inverse : {false, true}) {
    Host r = random(b * s * heads * d, 32);
    float* gr = up(r);
    cpu_->rope(r.data(), b, s, heads, d, 10000.0, inverse);
    gpu_->rope(gr, b, s, heads, d, 10000.0, inverse);
    expect_close(down(gr, r.size()), r, inverse ? "rope inverse" : "rope");
  }
}

TEST_F(CudaBackendTest, GlueKernelsMatchTheCpu) {
  const int64_t n = 21, a = 5, bw = 7, c = 9, w = a + bw + c;
  const Host x = random(n * w, 40);
  Host y0(n * a), y1(n * bw), y2(n * c), back(n * w);
  cpu_->split_columns3(x.data(), y0.data(), y1.data(), y2.data(), n, a, bw, c);
  cpu_->concat_columns3(y0.data(), y1.data(), y2.data(), back.data(), n, a, bw, c);
  float *gx = up(x), *g0 = up(unset(y0.size())), *g1 = up(unset(y1.size())),
        *g2 = up(unset(y2.size())), *gback = up(unset(back.size()));
  gpu_->split_columns3(gx, g0, g1, g2, n, a, bw, c);
  gpu_->concat_columns3(g0, g1, g2, gback, n, a, bw, c);
  expect_close(down(g1, y1.size()), y1, "split_columns3", 0, 0);
  expect_close(down(gback, back.size()), back, "concat_columns3", 0, 0);

  const int64_t t = 3, b = 2, s = 12, width = 11;
  const Host full = random(b * s * width, 41);
  Host shards(full.size()), unsharded(full.size());
  cpu_->sequence_shard(full.data(), shards.data(), t, b, s, width);
  cpu_->sequence_unshard(shards.data(), unsharded.data(), t, b, s, width);
  float *gfull = up(full), *gsh = up(unset(full.size())), *gun = up(unset(full.size()));
  gpu_->sequence_shard(gfull, gsh, t, b, s, width);
  gpu_->sequence_unshard(gsh, gun, t, b, s, width);
  expect_close(down(gsh, shards.size()), shards, "sequence_shard", 0, 0);
  expect_close(down(gun, full.size()), full, "sequence_unshard", 0, 0);

  const int64_t m = 1000;
  Host p = random(m, 42), q = random(m, 43), r = p;
  float *gp = up(p), *gq = up(q);
  cpu_->add(r.data(), q.data(), m);
  gpu_->add(gp, gq, m);
  expect_close(down(gp, m), r, "add");
  cpu_->scale(r.data(), m, 0.37);
  gpu_->scale(gp, m, 0.37);
  expect_close(down(gp, m), r, "scale", 0, 0);
  const Host bias = random(40, 44);
  cpu_->add_bias(r.data(), bias.data(), 25, 40);
  gpu_->add_bias(gp, up(bias), 25, 40);
  expect_close(down(gp, m), r, "add_bias");
  Host db = random(40, 45);
  float* gdb = up(db);
  cpu_->bias_grad(r.data(), db.data(), 25, 40);
  gpu_->bias_grad(gp, gdb, 25, 40);
  expect_close(down(gdb, 40), db, "bias_grad");
  gpu_->copy(gp, gq, m);
  expect_close(down(gq, m), r, "copy", 0, 0);
  gpu_->fill_zero(gq, m);
  expect_close(down(gq, m), Host(m), "fill_zero", 0, 0);
  EXPECT_NEAR(gpu_->sum_squares(gp, m, 2.5), cpu_->sum_squares(r.data(), m, 2.5),
              1e-12 * cpu_->sum_squares(r.data(), m, 2.5));
}

// The MoE layer's row moves (runtime/moe_layer.h) with index and weight arrays in host memory:
// a gather of rows (plain and scaled, rows repeated and some skipped), each token's rows added
// with their weights (-1 entries skipped, into an output that is not zero), and the rows' dot
// products: at a width that is no multiple of the block or of a vector (the scalar kernels), and
// at widths that move as 16-byte vectors: a part of a warp, a few warps, and more vectors than a
// block of 256 threads takes in one round (8200). Tokens of 3 slots; and of 2 and 5, since the
// adds take one kernel up to 2 slots, another up to 4 and a third above.
TEST_F(CudaBackendTest, MoeRowMovesMatchTheCpu) {
  for (const int64_t h : {37, 64, 2080, 8200}) {
    SCOPED_TRACE("h = " + std::to_string(h));
    moe_row_moves(h, 3);
  }
  for (const int64_t k : {1, 2, 5}) {
    SCOPED_TRACE("k = " + std::to_string(k));
    moe_row_moves(2080, k);
  }
}

void CudaBackendTest::moe_row_moves(int64_t h, int64_t k) {
  const int64_t n = 19, rows = 41;
  const Host x = random(n * h, 60), y = random(rows * h, 61), base = random(n * h, 62);
  std::mt19937 g(63);
  std::vector<int64_t> token(rows), row_of(n * k);
  for (auto& t : token) t = static_cast<int64_t>(g() % n);
  for (auto& r : row_of) r = g() % 4 == 0 ? -1 : static_cast<int64_t>(g() % rows);
  const Host w_row = random(rows, 64), w_slot = random(n * k, 65);
  float *gx = up(x), *gy = up(y);
  for (const float* w : {static_cast<const float*>(nullptr), w_row.data()}) {
    Host want(rows * h);
    cpu_->gather_rows(x.data(), token.data(), w, want.data(), rows, h);
    float* got = up(unset(rows * h));
    gpu_->gather_rows(gx, token.data(), w, got, rows, h);
    expect_close(down(got, want.size()), want, w ? "gather_rows, scaled" : "gather_rows", 0, 0);
  }
  for (const float* w : {static_cast<const float*>(nullptr), w_slot.data()}) {
    Host want = base;
    cpu_->gather_add_rows(y.data(), row_of.data(), w, want.data(), n, k, h);
    float* got = up(base);
    gpu_->gather_add_rows(gy, row_of.data(), w, got, n, k, h);
    expect_close(down(got, want.size()), want, w ? "gather_add_rows, weighted" : "gather_add_rows");
  }
  Host want(rows);
  cpu_->row_dots(x.data(), token.data(), y.data(), want.data(), rows, h);
  float* got = up(unset(rows));
  gpu_->row_dots(gx, token.data(), gy, got, rows, h);
  expect_close(down(got, rows), want, "row_dots", 1e-6, 1e-6);
  gpu_->gather_rows(gx, token.data(), nullptr, got, 0, h);  // no rows: nothing runs

  // bf16 rows (a bf16 model's): loaded as fp32, stored rounded; the same inputs on both sides.
  Bf16 x16 = narrow(x), y16 = narrow(y), base16 = narrow(base);
  const Ptr gx16 = up16(x16), gy16 = up16(y16);
  for (const float* w : {static_cast<const float*>(nullptr), w_row.data()}) {
    Bf16 want16(rows * h);
    cpu_->gather_rows(host16(x16), token.data(), w, host16(want16), rows, h);
    const Ptr got16 = up16(unset16(rows * h));
    gpu_->gather_rows(gx16, token.data(), w, got16, rows, h);
    expect_close(down16(got16, rows * h), widen(want16), w ? "bf16 gather, scaled" : "bf16 gather",
                 0, 0);
  }
  for (const float* w : {static_cast<const float*>(nullptr), w_slot.data()}) {
    Bf16 want16 = base16;
    cpu_->gather_add_rows(host16(y16), row_of.data(), w, host16(want16), n, k, h);
    const Ptr got16 = up16(base16);
    gpu_->gather_add_rows(gy16, row_of.data(), w, got16, n, k, h);
    // Sums of the same fp32 values in the same order, rounded once: at most one bf16 step apart.
    expect_close(down16(got16, n * h), widen(want16),
                 w ? "bf16 gather_add_rows, weighted" : "bf16 gather_add_rows", 8e-3, 1e-6);
  }
  Host want16(rows);
  cpu_->row_dots(host16(x16), token.data(), host16(y16), want16.data(), rows, h);
  gpu_->row_dots(gx16, token.data(), gy16, got, rows, h);
  expect_close(down(got, rows), want16, "bf16 row_dots", 1e-6, 1e-6);
  // Rows of one type, fp32 or bf16: anything else is the caller's mistake.
  EXPECT_THROW(gpu_->gather_rows(gx, token.data(), nullptr, gx16, rows, h), std::logic_error);
}

// Vocabulary-parallel embedding and cross-entropy on a shard [67, 67 + 64) of a 131-token
// vocabulary, with targets inside and outside it; token ids come from host memory.
TEST_F(CudaBackendTest, VocabularyParallelEmbeddingAndCrossEntropyMatchTheCpu) {
  const int64_t n = 30, h = 13, v0 = 67, vl = 64, valid = 62, b = 3, sl = 10;
  const std::vector<int32_t> tokens = shard_tokens(n, 50, v0, vl);
  const Host table = random(vl * h, 51), dy = random(n * h, 52), pos = random(40 * h, 53);
  Host y(n * h), dtable = random(vl * h, 54), dpos = random(40 * h, 55);
  float *gtable = up(table), *gy = up(unset(n * h)), *gdy = up(dy), *gdtable = up(dtable),
        *gpos = up(pos), *gdpos = up(dpos);
  cpu_->vocab_embedding_lookup(tokens.data(), table.data(), y.data(), n, h, v0, vl);
  cpu_->vocab_embedding_grad(tokens.data(), dy.data(), dtable.data(), n, h, v0, vl);
  cpu_->add_positions(y.data(), pos.data(), b, sl, h, 7);
  cpu_->position_grad(dy.data(), dpos.data(), b, sl, h, 7);
  gpu_->vocab_embedding_lookup(tokens.data(), gtable, gy, n, h, v0, vl);
  gpu_->vocab_embedding_grad(tokens.data(), gdy, gdtable, n, h, v0, vl);
  gpu_->add_positions(gy, gpos, b, sl, h, 7);
  gpu_->position_grad(gdy, gdpos, b, sl, h, 7);
  expect_close(down(gy, y.size()), y, "embedding lookup + positions");
  expect_close(down(gdtable, dtable.size()), dtable, "embedding table gradient");
  expect_close(down(gdpos, dpos.size()), dpos, "position gradient");

  Host logits = random(n * vl, 56, -5, 5), stats(n * 3), lse(n);
  float *glogits = up(logits), *gstats = up(unset(n * 3)), *glse = up(unset(n));
  cpu_->cross_entropy_stats(logits.data(), tokens.data(), stats.data(), n, vl, valid, v0);
  gpu_->cross_entropy_stats(glogits, tokens.data(), gstats, n, vl, valid, v0);
  expect_close(down(gstats, stats.size()), stats, "cross-entropy statistics");
  const double loss =
      cpu_->cross_entropy_finish(stats.data(), 1, logits.data(), lse.data(), n, vl, valid);
  const double gloss = gpu_->cross_entropy_finish(gstats, 1, glogits, glse, n, vl, valid);
  EXPECT_NEAR(gloss, loss, 1e-5 * std::abs(loss));
  expect_close(down(glse, n), lse, "log-sum-exp");
  expect_close(down(glogits, logits.size()), logits, "probabilities");
  cpu_->cross_entropy_backward(logits.data(), tokens.data(), n, vl, v0, 0.5);
  gpu_->cross_entropy_backward(glogits, tokens.data(), n, vl, v0, 0.5);
  expect_close(down(glogits, logits.size()), logits, "logit gradient");
}

// The same embedding moves on bf16 rows, as a --bf16 model makes them: 16 bytes at a time at
// h = 24 and element by element at h = 13, each the CPU's bits (the lookup copies, the positions
// add in fp32 and round, the position gradient adds the sequences in the same order).
TEST_F(CudaBackendTest, Bf16EmbeddingAndPositionsAreTheCpusBits) {
  const int64_t n = 30, v0 = 67, vl = 64, b = 3, sl = 10, first = 7;
  const std::vector<int32_t> tokens = shard_tokens(n, 57, v0, vl);
  for (const int64_t h : {24, 13}) {
    SCOPED_TRACE("h = " + std::to_string(h));
    // y starts as garbage: the lookup must write every element, the zeros off the shard too.
    Bf16 table = narrow(random(vl * h, 58)), pos = narrow(random(40 * h, 59)),
         dy = narrow(random(n * h, 60)), y = narrow(random(n * h, 62));
    Host dpos = random(40 * h, 61);
    const Ptr gtable = up16(table), gpos = up16(pos), gdy = up16(dy), gy = up16(y);
    float* gdpos = up(dpos);
    cpu_->vocab_embedding_lookup(tokens.data(), host16(table), host16(y), n, h, v0, vl);
    gpu_->vocab_embedding_lookup(tokens.data(), gtable, gy, n, h, v0, vl);
    expect_close(down16(gy, n * h), widen(y), "bf16 embedding lookup", 0, 0);
    cpu_->add_positions(host16(y), host16(pos), b, sl, h, first);
    gpu_->add_positions(gy, gpos, b, sl, h, first);
    expect_close(down16(gy, n * h), widen(y), "bf16 positions added", 0, 0);
    cpu_->position_grad(host16(dy), dpos.data(), b, sl, h, first);
    gpu_->position_grad(gdy, gdpos, b, sl, h, first);
    expect_close(down(gdpos, dpos.size()), dpos, "bf16 position gradient", 0, 0);
  }
}

TEST_F(CudaBackendTest, AdamWMatchesTheCpu) {
  const int64_t n = 1031;
  Host p = random(n, 60), gr = random(n, 61, -0.1f, 0.1f), m(n), v(n);
  float *gp = up(p), *gg = up(gr), *gm = up(m), *gv = up(v);
  AdamWSettings o;
  o.lr = 3e-3;
  o.weight_decay = 0.1;
  for (int64_t step = 1; step <= 3; ++step) {
    cpu_->adamw(p.data(), gr.data(), m.data(), v.data(), n, o, step);
    gpu_->adamw(gp, gg, gm, gv, n, o, step);
  }
  expect_close(down(gp, n), p, "AdamW parameters", 1e-6, 1e-7);
  expect_close(down(gv, n), v, "AdamW second moment", 1e-6, 1e-12);
}

// The optimizer's update in one call (runtime/grad_sync.cc): the GPU fuses the gradient's scale,
// AdamW and the model's bf16 copy into one pass; the CPU makes the three calls. They agree, the
// copy is the new weights rounded to bf16, and a call without a copy writes none.
TEST_F(CudaBackendTest, FusedAdamWUpdateMatchesTheCpusThreeCalls) {
  const int64_t n = 2053;
  AdamWCase c = adamw_case(n, 62);
  auto& [p, gr, m, v, model, gp, gm, gv, gmodel, o] = c;
  for (int64_t step = 1; step <= 3; ++step) {
    Host g = gr;  // the CPU scales its gradient in place; each step starts from the same one
    float* gg = up(gr);
    const double scale = step == 2 ? 1.0 : 0.37;
    cpu_->adamw_update(p.data(), g.data(), m.data(), v.data(), host16(model), n, o, step, scale);
    gpu_->adamw_update(gp, gg, gm, gv, gmodel, n, o, step, scale);
    EXPECT_EQ(down(gg, n), gr) << "the GPU's update leaves the gradient as it was";
  }
  expect_close(down(gp, n), p, "AdamW parameters", 1e-6, 1e-7);
  expect_close(down(gv, n), v, "AdamW second moment", 1e-6, 1e-12);
  expect_close(down16(gmodel, static_cast<size_t>(n)), widen(model), "the bf16 copy", 8e-3, 1e-6);
  expect_close(widen(model), widen(narrow(p)), "the CPU's copy is the weights rounded", 0, 0);
  // fp32 weights with no copy (a run without mixed precision).
  const Host before = down(gp, n);
  gpu_->adamw_update(gp, up(gr), gm, gv, Ptr(), n, o, 4, 1.0);
  cpu_->adamw_update(p.data(), gr.data(), m.data(), v.data(), Ptr(), n, o, 4, 1.0);
  expect_close(down(gp, n), p, "AdamW parameters without a copy", 1e-6, 1e-7);
  EXPECT_NE(down(gp, n), before);
}

// The optimizer's update over a run of parameters whose weight decay changes span by span
// (runtime/grad_sync.cc): the GPU's one launch (of up to 64 spans, so 150 spans take three)
// against the CPU's one update a span, with the bf16 copy and without one.
TEST_F(CudaBackendTest, AdamWUpdateOverDecaySpansMatchesTheCpuSpanBySpan) {
  std::vector<Backend::DecaySpan> spans;
  int64_t n = 0;
  for (int i = 0; i < 150; ++i) {  // spans of 1 to 40 elements, decay on and off by turns
    const int64_t len = 1 + (i * 7) % 40;
    spans.push_back({n, len, i % 2 == 0});
    n += len;
  }
  AdamWCase c = adamw_case(n, 64);
  auto& [p, gr, m, v, model, gp, gm, gv, gmodel, o] = c;
  for (int64_t step = 1; step <= 2; ++step) {
    Host g = gr;
    float* gg = up(gr);
    cpu_->adamw_update_spans(p.data(), g.data(), m.data(), v.data(), host16(model), spans, o, step,
                             0.37);
    gpu_->adamw_update_spans(gp, gg, gm, gv, gmodel, spans, o, step, 0.37);
  }
  expect_close(down(gp, n), p, "AdamW parameters, span by span", 1e-6, 1e-7);
  expect_close(down(gm, n), m, "AdamW first moment, span by span", 1e-6, 1e-12);
  expect_close(down16(gmodel, static_cast<size_t>(n)), widen(model), "the bf16 copy", 8e-3, 1e-6);
  gpu_->adamw_update_spans(gp, up(gr), gm, gv, Ptr(), spans, o, 3, 1.0);  // fp32, no copy
  cpu_->adamw_update_spans(p.data(), gr.data(), m.data(), v.data(), Ptr(), spans, o, 3, 1.0);
  expect_close(down(gp, n), p, "AdamW parameters, span by span, no copy", 1e-6, 1e-7);
  // The decay is the span's: the same update with decay everywhere gives other weights.
  std::vector<Backend::DecaySpan> all_decay = {{0, n, true}};
  Host q = down(gp, n), mq = down(gm, n), vq = down(gv, n), g2 = gr;
  cpu_->adamw_update_spans(q.data(), g2.data(), mq.data(), vq.data(), Ptr(), all_decay, o, 4, 1.0);
  gpu_->adamw_update_spans(gp, up(gr), gm, gv, Ptr(), spans, o, 4, 1.0);
  EXPECT_NE(down(gp, n), q);
}

// The update moves 16-byte vectors where every array is aligned at the same element (mod 4),
// and goes element by element where they are not. The arrays start 1 element past their
// allocations (vectors from element 3 on), with the bf16 copy, with an fp32 copy (float4
// stores), and then with the first moment 2 past, or the bf16 copy 2 past (4 bytes: no common
// alignment either way). Spans of 1 to 5000 elements meet inside vectors. All agree with the CPU.
TEST_F(CudaBackendTest, AdamWUpdateMatchesTheCpuAtEveryAlignment) {
  const std::vector<Backend::DecaySpan> spans = {
      {0, 3, false}, {3, 5000, true}, {5003, 6, false}, {5009, 1, true}, {5010, 2051, false}};
  const int64_t n = 7061;
  struct Case {
    int64_t m_at, out_at;
    bool fp32_out;
    const char* what;
  };
  for (const Case& k :
       {Case{1, 1, false, "vectors, bf16 copy"}, Case{1, 1, true, "vectors, fp32 copy"},
        Case{2, 1, false, "element by element: the first moment"},
        Case{1, 2, false, "element by element: the copy"}}) {
    SCOPED_TRACE(k.what);
    AdamWCase c = adamw_case(n + 2, 80 + static_cast<uint32_t>(k.m_at + 2 * k.out_at));
    auto& [p, gr, m, v, model, gp, gm, gv, gmodel, o] = c;
    Host copy32(n + 2);
    float* gcopy32 = up(copy32);
    const Ptr hout = k.fp32_out ? Ptr(copy32.data() + k.out_at) : host16(model).at(k.out_at);
    const Ptr gout = k.fp32_out ? Ptr(gcopy32 + k.out_at) : gmodel.at(k.out_at);
    for (int64_t step = 1; step <= 2; ++step) {
      Host g = gr;
      float* gg = up(gr);
      cpu_->adamw_update_spans(p.data() + 1, g.data() + 1, m.data() + k.m_at, v.data() + 1, hout,
                               spans, o, step, 0.37);
      gpu_->adamw_update_spans(gp + 1, gg + 1, gm + k.m_at, gv + 1, gout, spans, o, step, 0.37);
      EXPECT_EQ(down(gg, n + 2), gr) << "the GPU's update leaves the gradient as it was";
    }
    expect_close(down(gp, n + 2), p, "AdamW parameters", 1e-6, 1e-7);
    expect_close(down(gm, n + 2), m, "AdamW first moment", 1e-6, 1e-12);
    expect_close(down(gv, n + 2), v, "AdamW second moment", 1e-6, 1e-12);
    if (k.fp32_out)
      expect_close(down(gcopy32, n + 2), copy32, "the fp32 copy", 1e-6, 1e-7);
    else
      expect_close(down16(gmodel, static_cast<size_t>(n + 2)), widen(model), "the bf16 copy", 8e-3,
                   1e-6);
  }
}

// A layer's bias-add-residual (ShardContext::residual_add) in one GPU pass gives the CPU's
// copy, add and add_bias to the bit: fp32 and bf16, with and without a bias, at widths that take
// 16-byte vectors (768; 36 in fp32) and element by element (37; 36 in bf16), and written over
// either input.
TEST_F(CudaBackendTest, ResidualAddInOnePassIsTheCpusThreeCallsToTheBit) {
  const int64_t rows = 37;
  for (const int64_t width : {768, 36, 37}) {
    const int64_t n = rows * width;
    const Host r = random(n, 90), p = random(n, 91), b = random(width, 92);
    for (const bool bf16 : {false, true})
      for (const bool bias : {false, true})
        for (const int alias : {0, 1, 2}) {  // out apart, out = residual, out = partial
          SCOPED_TRACE("width " + std::to_string(width) + (bf16 ? ", bf16" : ", fp32") +
                       (bias ? ", bias" : "") + ", alias " + std::to_string(alias));
          Host want, got;
          if (bf16) {
            Bf16 hr = narrow(r), hp = narrow(p), hb = narrow(b), ho(static_cast<size_t>(n));
            const Ptr gr = up16(hr), gp = up16(hp), gb = up16(hb), go = up16(ho);
            const Ptr out = alias == 1 ? gr : alias == 2 ? gp : go;
            const Ptr hout = alias == 1 ? host16(hr) : alias == 2 ? host16(hp) : host16(ho);
            cpu_->residual_add(hout, host16(hr), host16(hp), bias ? host16(hb) : Ptr(), rows,
                               width);
            expect_native([&] { gpu_->residual_add(out, gr, gp, bias ? gb : Ptr(), rows, width); },
                          "bf16 residual add");
            want = widen(alias == 1 ? hr : alias == 2 ? hp : ho);
            got = down16(out, static_cast<size_t>(n));
          } else {
            Host hr = r, hp = p, ho(n);
            float *gr = up(r), *gp = up(p), *gb = up(b), *go = up(ho);
            float* out = alias == 1 ? gr : alias == 2 ? gp : go;
            float* hout = alias == 1 ? hr.data() : alias == 2 ? hp.data() : ho.data();
            cpu_->residual_add(hout, hr.data(), hp.data(), bias ? b.data() : nullptr, rows, width);
            gpu_->residual_add(out, gr, gp, bias ? gb : nullptr, rows, width);
            want = alias == 1 ? hr : alias == 2 ? hp : ho;
            got = down(out, static_cast<size_t>(n));
          }
          EXPECT_EQ(got, want);
        }
  }
}

// A layer norm's backward with its input gradient added into the residual stream's gradient
// (Backend::norm_backward_add): on bf16 the GPU runs it as one kernel, with no temporary, and
// agrees with the CPU's norm_backward and add; fp32 takes the two calls on both. Widths of 768
// (a row a warp), 512 (a warp, the next row's loads in flight), 2048 (a row a block, the next in
// flight) and 301 (rows re-read); the weight gradients accumulate onto what they held.
TEST_F(CudaBackendTest, NormBackwardAddMatchesTheCpusTwoCalls) {
  // 19 rows: one a block. 530 rows at 2048 columns: 3 a block, the next row's dy, r and
  // residual gradient loaded ahead into registers while this row's dx (the residual gradient
  // itself, accumulated in place) is written.
  for (const auto& [n, h] :
       {std::pair<int64_t, int64_t>{19, 768}, {19, 301}, {19, 512}, {19, 2048}, {530, 2048}})
    for (const bool layernorm : {true, false})
      for (const bool bf16 : {true, false}) {
        const std::string what = std::string(layernorm ? "layernorm" : "rmsnorm") +
                                 (bf16 ? " bf16" : " fp32") + ", h " + std::to_string(h) + ", " +
                                 std::to_string(n) + " rows";
        const Host x = random(n * h, 100), g = random(h, 101), beta = random(h, 102),
                   dy = random(n * h, 103), acc = random(n * h, 104), dg0 = random(h, 105);
        Host mean(n), rstd(n), dg = dg0, db = dg0;
        float *gmean = up(unset(n)), *grstd = up(unset(n)), *gdg = up(dg0), *gdb = up(dg0);
        float* const cmean = layernorm ? mean.data() : nullptr;
        float* const gm = layernorm ? gmean : nullptr;
        Host got, want;
        if (bf16) {
          Bf16 hx = narrow(x), hg = narrow(g), hb = narrow(beta), hdy = narrow(dy),
               hacc = narrow(acc), hy(static_cast<size_t>(n * h));
          const Ptr cb = layernorm ? host16(hb) : Ptr();
          cpu_->norm_forward(host16(hx), host16(hg), cb, host16(hy), cmean, rstd.data(), n, h);
          cpu_->norm_backward_add(host16(hx), host16(hg), layernorm, cmean, rstd.data(),
                                  host16(hdy), host16(hacc), dg.data(),
                                  layernorm ? db.data() : nullptr, n, h);
          const Ptr gx = up16(narrow(x)), gg = up16(hg), gdy = up16(hdy), gacc = up16(narrow(acc)),
                    gy = up16(unset16(hy.size()));
          gpu_->norm_forward(gx, gg, layernorm ? up16(hb) : Ptr(), gy, gm, grstd, n, h);
          expect_native(
              [&] {
                gpu_->norm_backward_add(gx, gg, layernorm, gm, grstd, gdy, gacc, gdg,
                                        layernorm ? gdb : nullptr, n, h);
              },
              what);
          got = down16(gacc, static_cast<size_t>(n * h)), want = widen(hacc);
        } else {
          Host y(n * h), hacc = acc;
          cpu_->norm_forward(x.data(), g.data(), layernorm ? beta.data() : nullptr, y.data(), cmean,
                             rstd.data(), n, h);
          cpu_->norm_backward_add(x.data(), g.data(), layernorm, cmean, rstd.data(), dy.data(),
                                  hacc.data(), dg.data(), layernorm ? db.data() : nullptr, n, h);
          float *gx = up(x), *gg = up(g), *gacc = up(acc), *gy = up(unset(n * h));
          gpu_->norm_forward(gx, gg, layernorm ? up(beta) : nullptr, gy, gm, grstd, n, h);
          gpu_->norm_backward_add(gx, gg, layernorm, gm, grstd, up(dy), gacc, gdg,
                                  layernorm ? gdb : nullptr, n, h);
          got = down(gacc, static_cast<size_t>(n * h)), want = hacc;
        }
        expect_close(got, want, what + ": the residual gradient plus dx", 2e-2, 2e-2);
        expect_close(down(gdg, h), dg, what + ": d gamma", 1e-3, 1e-3);
        if (layernorm) expect_close(down(gdb, h), db, what + ": d beta", 1e-3, 1e-3);
        EXPECT_NE(down(gdg, h), dg0) << what;
      }
}

// GELU's backward with the bias gradient (Backend::gelu_backward_bias_grad): one kernel on
// bf16 (no temporary), agreeing with the CPU's gelu_backward and bias_grad (the bias gradient
// with their fp32 sums, as the kernel sums dx before rounding it); fp32 takes the two calls on
// both. Widths of 3072 (16-byte vectors) and 37; the bias gradient accumulates.
TEST_F(CudaBackendTest, GeluBackwardWithBiasGradMatchesTheCpusTwoCalls) {
  const int64_t rows = 29;
  for (const int64_t width : {3072, 37})
    for (const bool bf16 : {true, false}) {
      const std::string what =
          std::string(bf16 ? "bf16" : "fp32") + ", width " + std::to_string(width);
      const int64_t n = rows * width;
      const Host x = random(n, 110, -3.0f, 3.0f), dy = random(n, 111), db0 = random(width, 112);
      Host db = db0, got, want;
      float* gdb = up(db0);
      if (bf16) {
        Bf16 hx = narrow(x), hdy = narrow(dy), hdx(static_cast<size_t>(n));
        Host unused = db0;
        cpu_->gelu_backward_bias_grad(host16(hx), host16(hdy), host16(hdx), unused.data(), rows,
                                      width);
        // The fused kernel sums dx before rounding it: the CPU's fp32 call on the same inputs.
        Host dx32(n);
        cpu_->gelu_backward_bias_grad(widen(hx).data(), widen(hdy).data(), dx32.data(), db.data(),
                                      rows, width);
        const Ptr gx = up16(hx), gdy = up16(hdy), gdx = up16(unset16(hdx.size()));
        expect_native([&] { gpu_->gelu_backward_bias_grad(gx, gdy, gdx, gdb, rows, width); }, what);
        got = down16(gdx, static_cast<size_t>(n)), want = widen(hdx);
      } else {
        Host dx(n);
        cpu_->gelu_backward_bias_grad(x.data(), dy.data(), dx.data(), db.data(), rows, width);
        float* gdx = up(unset(n));
        gpu_->gelu_backward_bias_grad(up(x), up(dy), gdx, gdb, rows, width);
        got = down(gdx, static_cast<size_t>(n)), want = dx;
      }
      expect_close(got, want, what + ": dx", 2e-2, 2e-2);
      expect_close(down(gdb, width), db, what + ": bias gradient", 1e-3, 1e-3);
      EXPECT_NE(down(gdb, width), db0) << what;
    }
}

// The bias + residual add's backward (Backend::residual_add_backward): the gradient copied to
// both inputs' gradients and the bias gradient summed, in one pass on bf16 rows of a multiple of
// 8 columns (without a bias, the two copies in one pass wherever 16-byte vectors fit, fp32 too).
// Its bias gradient is the GPU's bias_grad to the bit (the same column sums), and within float
// rounding of the CPU's; the copies are exact. Widths 768 and 36 (in bf16 the three calls), bf16
// and fp32, with and without a bias.
TEST_F(CudaBackendTest, ResidualAddBackwardIsBiasGradAndTwoCopies) {
  const int64_t rows = 41;
  for (const int64_t width : {768, 36})
    for (const bool bf16 : {true, false})
      for (const bool bias : {true, false}) {
        const std::string what = std::string(bf16 ? "bf16" : "fp32") + ", width " +
                                 std::to_string(width) + (bias ? ", bias" : "");
        const int64_t n = rows * width;
        const Host dout = random(n, 120), db0 = random(width, 121);
        Host db = db0;
        float *gdb = up(db0), *gdb_apart = up(db0);
        Host want = dout, got_r, got_p;
        const Ptr gd = bf16 ? up16(narrow(dout)) : Ptr(up(dout));
        const Ptr gr = bf16 ? up16(unset16(static_cast<size_t>(n))) : Ptr(up(unset(n)));
        const Ptr gp = bf16 ? up16(unset16(static_cast<size_t>(n))) : Ptr(up(unset(n)));
        if (bf16) {
          Bf16 hd = narrow(dout), hr(static_cast<size_t>(n)), hp(static_cast<size_t>(n));
          cpu_->residual_add_backward(host16(hd), host16(hr), host16(hp),
                                      bias ? db.data() : nullptr, rows, width);
          want = widen(hd);
          EXPECT_EQ(widen(hr), want) << what;
          EXPECT_EQ(widen(hp), want) << what;
          auto call = [&] {
            gpu_->residual_add_backward(gd, gr, gp, bias ? gdb : nullptr, rows, width);
          };
          if (bias && width % 8 == 0)
            expect_native(call, what);
          else
            call();
          got_r = down16(gr, static_cast<size_t>(n)), got_p = down16(gp, static_cast<size_t>(n));
        } else {
          Host hr(n), hp(n);
          cpu_->residual_add_backward(dout.data(), hr.data(), hp.data(), bias ? db.data() : nullptr,
                                      rows, width);
          gpu_->residual_add_backward(gd, gr, gp, bias ? gdb : nullptr, rows, width);
          got_r = down(gr.f(), static_cast<size_t>(n)),
          got_p = down(gp.f(), static_cast<size_t>(n));
        }
        EXPECT_EQ(got_r, want) << what;
        EXPECT_EQ(got_p, want) << what;
        gpu_->bias_grad(gd, gdb_apart, rows, width);
        if (bias) {
          EXPECT_EQ(down(gdb, width), down(gdb_apart, width)) << what << ": bias_grad's bits";
          expect_close(down(gdb, width), db, what + ": the CPU's bias gradient", 1e-4, 1e-4);
        } else {
          EXPECT_EQ(down(gdb, width), db0) << what << ": no bias, no gradient";
        }
      }
}

// Freed device blocks are kept and handed out again (the backend's block cache): a Buffer that
// gets a block someone wrote and freed still starts as zeros, an overwrite one is the same block
// without the memset, and the memory counter counts what is held, not what is cached.
TEST_F(CudaBackendTest, ReusedBlocksAreZeroedForNewBuffers) {
  const int64_t before = MemoryCounter::current();
  void* first = nullptr;
  {
    Buffer dirty(1000, 3.0f);  // 4000 bytes of 3s on the device
    first = dirty.raw();
    EXPECT_EQ(MemoryCounter::current() - before, 4000);
  }
  EXPECT_EQ(MemoryCounter::current(), before);
  Buffer zeros(1000);  // the same size: the freed block again, zeroed
  EXPECT_EQ(zeros.raw(), first);
  EXPECT_EQ(down(zeros.data(), 1000), Host(1000));
  Buffer grown(10);
  grown.resize(600);  // a new block: the kept elements copied, the new ones zero
  EXPECT_EQ(down(grown.data(), 600), Host(600));
  Buffer over;
  over.resize_for_overwrite(1000);  // no zeroing asked for: any free block of that size
  EXPECT_NE(over.raw(), nullptr);
  EXPECT_EQ(MemoryCounter::current() - before,
            4000 + 4000 + static_cast<int64_t>(grown.capacity()) * 4);
}

TEST_F(CudaBackendTest, MemoryIsZeroedCountedAndKnownAsTheDevices) {
  const int64_t before = MemoryCounter::current();
  auto* p = static_cast<float*>(gpu_->allocate(4096));
  EXPECT_EQ(MemoryCounter::current() - before, 4096);
  EXPECT_EQ(down(p, 1024), Host(1024));
  EXPECT_TRUE(gpu_->device_pointer(p));
  const Host h(4);
  EXPECT_FALSE(gpu_->device_pointer(h.data()));
  EXPECT_FALSE(gpu_->host_accessible());
  // New Buffers live on the device while the backend does.
  Buffer b(100, 2.0f);
  EXPECT_EQ(b.space(), gpu_.get());
  EXPECT_TRUE(gpu_->device_pointer(b.data()));
  EXPECT_EQ(down(b.data(), 100), Host(100, 2.0f));
  gpu_->deallocate(p, 4096);
}

// `m` trained on one rank in `precision` on the CPU backend and on the GPU: each step's loss
// within `rel` (relative) of the CPU's, and the GPU's falling.
void expect_gpu_losses_track_the_cpu(const ModelSpec& m, DType precision, double rel) {
  std::vector<std::vector<double>> runs;
  for (const char* be : {"cpu", "cuda"}) {
    TrainOptions o = cuda_test::tiny_training(m, be, cuda_test::kTrainingSteps);
    o.precision = precision;
    runs.push_back(cuda_test::losses_of_one_rank(o));
  }
  ASSERT_EQ(runs[1].size(), runs[0].size()) << m.name;
  for (size_t i = 0; i < runs[0].size(); ++i)
    EXPECT_NEAR(runs[1][i], runs[0][i], rel * std::abs(runs[0][i])) << m.name << " step " << i;
  EXPECT_LT(runs[1].back(), runs[1].front()) << m.name;
}

// Whole runs on one rank: the GPU's losses follow the CPU backend's from the same seed (fp32 on
// both; the sums are added in other orders, so not to the bit), for the GPT shape and the
// Llama shape (grouped queries, SwiGLU with RMSNorm and no biases, rotary, untied head), that
// one also with flash attention.
TEST(CudaBackendTraining, LossesTrackTheCpuBackend) {
  PTDP_REQUIRE_GPU();
  const ModelSpec gpt = cuda_test::tiny_gpt();
  ModelSpec llama = gpt;
  llama.num_query_groups = 2;
  llama.swiglu = true;
  llama.untie_embeddings_and_output_weights = true;
  llama.learned_position_embeddings = false;
  llama.rotary_base = 10000;
  llama.ffn_hidden_size = 96;
  ModelSpec flash = llama;  // --use-flash-attn: the fused attention kernels
  flash.flash_attention = true;
  for (const ModelSpec& m : {gpt, llama, flash}) {
    expect_gpu_losses_track_the_cpu(m, DType::kF32, 1e-3);
  }
}

// The same in mixed precision (--bf16): the GPU runs every typed call natively on bf16 (GEMMs,
// attention pieces, norms, activations, glue, embedding, cross-entropy), the CPU backend widens
// them to its fp32 kernels; the losses agree within bf16's precision. The GPT shape covers the
// biases and learned positions, the Llama shape grouped queries, rotary, SwiGLU and RMSNorm with
// the unfused attention, and a Llama shape with head dimension 64 the bf16 flash attention.
TEST(CudaBackendTraining, Bf16LossesTrackTheCpuBackend) {
  PTDP_REQUIRE_GPU();
  const ModelSpec gpt = cuda_test::tiny_gpt();
  ModelSpec llama = gpt;
  llama.num_query_groups = 2;
  llama.swiglu = true;
  llama.untie_embeddings_and_output_weights = true;
  llama.learned_position_embeddings = false;
  llama.rotary_base = 10000;
  llama.ffn_hidden_size = 96;
  ModelSpec flash = llama;  // head dimension 64: the bf16 kernels of kernels/cuda/attention.h
  flash.hidden_size = 128;
  flash.num_attention_heads = 2;
  flash.num_query_groups = 1;
  flash.ffn_hidden_size = 192;
  flash.flash_attention = true;
  for (const ModelSpec& m : {gpt, llama, flash}) {
    expect_gpu_losses_track_the_cpu(m, DType::kBF16, 2e-2);
  }
}

// An MoE model's one-microbatch loss and every parameter's gradient on the GPU against the CPU
// backend's (the shard's own code on both: runtime/moe_layer.h, routing on the host from the
// downloaded logits, the row moves and GEMMs on the device), for GELU experts with biases and
// for SwiGLU experts with a shared expert and a capacity that drops tokens. The routers are
// scaled up so that no token's top-k is a near tie the two backends' roundings could break
// differently. Each gradient within 1e-3 of its parameter's largest.
TEST(CudaBackendMoe, ShardGradientsMatchTheCpu) {
  PTDP_REQUIRE_GPU();
  ModelSpec gelu = cuda_test::tiny_gpt();
  gelu.num_experts = 4;
  gelu.moe_router_topk = 2;
  gelu.moe_ffn_hidden_size = 48;
  ModelSpec swiglu = gelu;
  swiglu.swiglu = true;
  swiglu.ffn_hidden_size = 96;
  swiglu.moe_shared_expert_ffn_size = 32;
  swiglu.moe_capacity_factor = 1.0;
  for (const ModelSpec& m : {gelu, swiglu}) {
    std::vector<int32_t> tokens;
    std::vector<std::vector<float>> grads;  // per backend
    std::vector<double> loss;
    std::vector<ParamInfo> infos;
    for (const char* name : {"cpu", "cuda"}) {
      // The CPU run ends before the GPU backend exists: a CUDA backend makes new Buffers its own.
      std::unique_ptr<Backend> be = make_backend(name);
      auto self = make_self_communicator();
      GptShard shard(m, ShardLayout{}, self.get(), 11, be.get());
      tokens.resize(static_cast<size_t>(shard.tokens_per_microbatch()));
      TokenSource::synthetic(m.vocab_size, 3).sequence(0, m.seq_length, tokens.data());
      std::vector<float> params(static_cast<size_t>(shard.params().size()));
      be->download(shard.params().ptr().p, params.data(), params.size() * sizeof(float));
      for (const ParamInfo& p : shard.param_infos())
        if (p.name.find("router") != std::string::npos)
          for (int64_t i = p.offset; i < p.offset + p.size; ++i)
            params[static_cast<size_t>(i)] *= 40;
      be->upload(params.data(), shard.params().ptr().p, params.size() * sizeof(float));
      loss.push_back(shard.forward(0, 0, tokens.data(), nullptr, nullptr));
      shard.backward(0, 0, nullptr, nullptr, 1.0);
      grads.emplace_back(static_cast<size_t>(shard.grads().size()));
      be->download(shard.grads().ptr().p, grads.back().data(), grads.back().size() * sizeof(float));
      infos = shard.param_infos();
    }
    EXPECT_NEAR(loss[1], loss[0], 1e-5 * std::abs(loss[0])) << m.swiglu;
    int routers = 0, experts = 0;
    for (const ParamInfo& p : infos) {
      routers += p.name.find("router") != std::string::npos;
      experts += p.expert;
      float largest = 0;
      for (int64_t i = p.offset; i < p.offset + p.real_size; ++i)
        largest = std::max(largest, std::abs(grads[0][static_cast<size_t>(i)]));
      EXPECT_GT(largest, 0.0f) << p.name;
      for (int64_t i = p.offset; i < p.offset + p.real_size; ++i) {
        const auto at = static_cast<size_t>(i);
        ASSERT_NEAR(grads[1][at], grads[0][at], 1e-3 * largest + 1e-7)
            << m.swiglu << " " << p.name << " [" << i - p.offset << "]";
      }
    }
    EXPECT_EQ(routers, 2);
    EXPECT_GT(experts, 0);
  }
}

// Training with MoE layers on the GPU follows the CPU backend, in mixed precision (the routed
// rows bf16, the expert GEMMs native): SwiGLU experts, a shared expert, capacity dropping.
TEST(CudaBackendMoe, Bf16LossesTrackTheCpuBackend) {
  PTDP_REQUIRE_GPU();
  ModelSpec m = cuda_test::tiny_gpt();
  m.num_experts = 4;
  m.moe_router_topk = 2;
  m.moe_ffn_hidden_size = 48;
  m.swiglu = true;
  m.ffn_hidden_size = 96;
  m.moe_shared_expert_ffn_size = 32;
  m.moe_capacity_factor = 1.0;
  expect_gpu_losses_track_the_cpu(m, DType::kBF16, 2e-2);
}

// Traced, the CUDA backend's ops are timed with device markers (runtime/op_timer.h): every op
// of every pass gets a span inside its pass's span, the spans of a pass follow one another in
// order, and they cover most of the pass (the gaps between markers are the only part left out).
TEST(CudaBackendTraining, OpSpansFromDeviceMarkersTileEachPass) {
  PTDP_REQUIRE_GPU();
  TrainOptions o = cuda_test::tiny_training(cuda_test::tiny_gpt(), "cuda", 2);
  o.record_timeline = true;
  auto self = make_self_communicator();
  const TrainResult r = train(o, *self);
  ASSERT_FALSE(r.op_timeline.empty());
  ASSERT_FALSE(r.timeline.empty());
  int passes = 0;
  for (const TimelineEvent& pass : r.timeline) {
    if (pass.kind != ActionKind::kForward && pass.kind != ActionKind::kBackward) continue;
    ++passes;
    double covered = 0, last_end = pass.start;
    int ops = 0;
    for (const OpTimelineEvent& e : r.op_timeline) {
      if (e.op.chunk != pass.chunk || e.op.microbatch != pass.microbatch ||
          e.op.start < pass.start - 1e-6 || e.op.end > pass.end + 1e-6)
        continue;
      EXPECT_LE(e.op.start, e.op.end);
      EXPECT_GE(e.op.start, last_end - 1e-6) << "spans of a pass overlap";
      last_end = e.op.end;
      covered += e.op.end - e.op.start;
      ++ops;
    }
    EXPECT_GT(ops, 0) << "a pass with no op inside its span";
    EXPECT_GT(covered, 0.5 * (pass.end - pass.start));
  }
  EXPECT_EQ(passes, 2 * 2 * 2);  // two steps of two microbatches, forward and backward
}

}  // namespace
}  // namespace ptdp
