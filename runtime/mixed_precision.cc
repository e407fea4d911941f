// The Backend's typed forms (runtime/backend.h): a call whose tensors are all fp32 is the fp32
// kernel; one with bf16 operands is first offered to the backend's native_* hook (the CUDA
// backend runs it on bf16 storage), else widens them to fp32 temporaries in the backend's
// memory, runs the fp32 kernel and rounds its bf16 outputs back, so every backend runs mixed
// precision with the kernels it has (bf16 storage, fp32 arithmetic).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/layer_ops.h"
#include "runtime/backend.h"
#include "runtime/device_buffer.h"

namespace ptdp {
namespace {

bool f32(std::initializer_list<CPtr> xs) {
  for (const CPtr& x : xs)
    if (!x.f32()) return false;
  return true;
}

// The fp32 operands of one call: bf16 inputs widened, bf16 outputs computed in fp32 and
// rounded back by finish().
class Widen {
 public:
  explicit Widen(Backend& be) : be_(be) {}

  const float* in(CPtr x, int64_t n) {
    if (x.f32()) return x.f();
    float* t = temp(n);
    be_.convert(x.p, x.t, t, DType::kF32, n);
    return t;
  }
  float* out(Ptr y, int64_t n) {
    if (y.f32()) return y.f();
    float* t = temp(n);
    back_.push_back({t, y, n});
    return t;
  }
  float* inout(Ptr y, int64_t n) {
    if (y.f32()) return y.f();
    float* t = const_cast<float*>(in(y, n));
    back_.push_back({t, y, n});
    return t;
  }
  void finish() {
    for (const Back& b : back_) be_.convert(b.from, DType::kF32, b.to.p, b.to.t, b.n);
  }

 private:
  float* temp(int64_t n) {
    temps_.emplace_back(be_, DType::kF32, n);
    return temps_.back().data<float>();
  }
  struct Back {
    float* from;
    Ptr to;
    int64_t n;
  };
  Backend& be_;
  std::vector<DeviceBuffer> temps_;
  std::vector<Back> back_;
};

// Runs f(w) with a Widen w, then rounds its outputs back.
template <class F>
void widened(Backend& be, F f) {
  Widen w(be);
  f(w);
  w.finish();
}

// The same for a row-independent call, in blocks of rows so that its fp32 temporaries stay near
// Backend::widen_block_elements() whatever the tensor (what a bf16 run holds beyond the memory
// model's count stays small): f(w, first, count) for consecutive blocks of [0, rows), each row
// `per_row` widened elements.
template <class F>
void widened(Backend& be, int64_t rows, int64_t per_row, F f, int64_t min_rows = 1) {
  const int64_t step =
      std::max(min_rows, be.widen_block_elements() / std::max<int64_t>(1, per_row));
  for (int64_t r = 0; r < rows; r += step)
    widened(be, [&](Widen& w) { f(w, r, std::min(step, rows - r)); });
}

}  // namespace

// The GEMMs widen their weight (and bias) whole and their rows in blocks: a GEMM's output rows
// depend on its own input rows alone (forward and dgrad), and a weight gradient is a sum over
// rows (wgrad, accumulated block by block), so the fp32 copies of a large activation (the LM
// head's logits, n x V / t) never exist whole. Each block is one GEMM of about
// widen_block_elements() / (in + out) rows, and at least kGemmBlockRows: the LM head of a
// 32000-token vocabulary at hidden 512 (8 rows a block otherwise) took a one-layer bf16 step on
// the CPU from 8.0 s (whole) to 11 s; whole, its fp32 copies took the peak from 599 to 859 MB.
constexpr int64_t kGemmBlockRows = 128;
void Backend::linear_forward(CPtr x, CPtr w, CPtr b, Ptr y, int64_t n, int64_t in, int64_t out) {
  if (f32({x, w, b, y})) return linear_forward(x.f(), w.f(), b.f(), y.f(), n, in, out);
  if (native_linear_forward(x, w, b, y, n, in, out)) return;
  Widen weights(*this);
  const float* wf = weights.in(w, out * in);
  const float* bf = weights.in(b, out);
  widened(
      *this, n, in + out,
      [&](Widen& wd, int64_t r0, int64_t rows) {
        linear_forward(wd.in(x.at(r0 * in), rows * in), wf, bf, wd.out(y.at(r0 * out), rows * out),
                       rows, in, out);
      },
      kGemmBlockRows);
}

void Backend::linear_dgrad(CPtr w, CPtr dy, Ptr dx, int64_t n, int64_t in, int64_t out) {
  if (f32({w, dy, dx})) return linear_dgrad(w.f(), dy.f(), dx.f(), n, in, out);
  if (native_linear_dgrad(w, dy, dx, n, in, out)) return;
  Widen weights(*this);
  const float* wf = weights.in(w, out * in);
  widened(
      *this, n, in + out,
      [&](Widen& wd, int64_t r0, int64_t rows) {
        linear_dgrad(wf, wd.in(dy.at(r0 * out), rows * out), wd.out(dx.at(r0 * in), rows * in),
                     rows, in, out);
      },
      kGemmBlockRows);
}

void Backend::linear_wgrad(CPtr x, CPtr dy, float* dw, float* db, int64_t n, int64_t in,
                           int64_t out) {
  if (f32({x, dy})) return linear_wgrad(x.f(), dy.f(), dw, db, n, in, out);
  if (native_linear_wgrad(x, dy, dw, db, n, in, out)) return;
  widened(
      *this, n, in + out,
      [&](Widen& w, int64_t r0, int64_t rows) {
        linear_wgrad(w.in(x.at(r0 * in), rows * in), w.in(dy.at(r0 * out), rows * out), dw, db,
                     rows, in, out);
      },
      kGemmBlockRows);
}

void Backend::attention_scores(CPtr q, CPtr k, Ptr scores, int64_t b, int64_t s, int64_t hq,
                               int64_t hk, int64_t d) {
  if (f32({q, k, scores})) return attention_scores(q.f(), k.f(), scores.f(), b, s, hq, hk, d);
  if (native_attention_scores(q, k, scores, b, s, hq, hk, d)) return;
  const int64_t nq = s * hq * d, nk = s * hk * d, ns = hq * s * s;  // per sequence
  widened(*this, b, nq + nk + ns, [&](Widen& w, int64_t i, int64_t c) {
    attention_scores(w.in(q.at(i * nq), c * nq), w.in(k.at(i * nk), c * nk),
                     w.out(scores.at(i * ns), c * ns), c, s, hq, hk, d);
  });
}

void Backend::attention_scores_backward(CPtr q, CPtr k, CPtr dscores, Ptr dq, Ptr dk, int64_t b,
                                        int64_t s, int64_t hq, int64_t hk, int64_t d) {
  if (f32({q, k, dscores, dq, dk}))
    return attention_scores_backward(q.f(), k.f(), dscores.f(), dq.f(), dk.f(), b, s, hq, hk, d);
  if (native_attention_scores_backward(q, k, dscores, dq, dk, b, s, hq, hk, d)) return;
  const int64_t nq = s * hq * d, nk = s * hk * d, ns = hq * s * s;  // per sequence
  widened(*this, b, 2 * nq + 2 * nk + ns, [&](Widen& w, int64_t i, int64_t c) {
    attention_scores_backward(w.in(q.at(i * nq), c * nq), w.in(k.at(i * nk), c * nk),
                              w.in(dscores.at(i * ns), c * ns), w.out(dq.at(i * nq), c * nq),
                              w.out(dk.at(i * nk), c * nk), c, s, hq, hk, d);
  });
}

void Backend::causal_softmax(Ptr scores, int64_t rows, int64_t s) {
  if (scores.f32()) return causal_softmax(scores.f(), rows, s);
  if (native_causal_softmax(scores, rows, s)) return;
  widened(*this, rows, s * s, [&](Widen& w, int64_t r, int64_t c) {
    causal_softmax(w.inout(scores.at(r * s * s), c * s * s), c, s);
  });
}

void Backend::causal_softmax_backward(CPtr probs, CPtr dprobs, Ptr dscores, int64_t rows,
                                      int64_t s) {
  if (f32({probs, dprobs, dscores}))
    return causal_softmax_backward(probs.f(), dprobs.f(), dscores.f(), rows, s);
  if (native_causal_softmax_backward(probs, dprobs, dscores, rows, s)) return;
  const int64_t ss = s * s;
  widened(*this, rows, 3 * ss, [&](Widen& w, int64_t r, int64_t c) {
    causal_softmax_backward(w.in(probs.at(r * ss), c * ss), w.in(dprobs.at(r * ss), c * ss),
                            w.out(dscores.at(r * ss), c * ss), c, s);
  });
}

void Backend::attention_context(CPtr probs, CPtr v, Ptr out, int64_t b, int64_t s, int64_t hq,
                                int64_t hk, int64_t d) {
  if (f32({probs, v, out})) return attention_context(probs.f(), v.f(), out.f(), b, s, hq, hk, d);
  if (native_attention_context(probs, v, out, b, s, hq, hk, d)) return;
  const int64_t np = hq * s * s, nv = s * hk * d, no = s * hq * d;  // per sequence
  widened(*this, b, np + nv + no, [&](Widen& w, int64_t i, int64_t c) {
    attention_context(w.in(probs.at(i * np), c * np), w.in(v.at(i * nv), c * nv),
                      w.out(out.at(i * no), c * no), c, s, hq, hk, d);
  });
}

void Backend::attention_context_backward(CPtr probs, CPtr v, CPtr dout, Ptr dprobs, Ptr dv,
                                         int64_t b, int64_t s, int64_t hq, int64_t hk, int64_t d) {
  if (f32({probs, v, dout, dprobs, dv}))
    return attention_context_backward(probs.f(), v.f(), dout.f(), dprobs.f(), dv.f(), b, s, hq, hk,
                                      d);
  if (native_attention_context_backward(probs, v, dout, dprobs, dv, b, s, hq, hk, d)) return;
  const int64_t np = hq * s * s, nv = s * hk * d, no = s * hq * d;  // per sequence
  widened(*this, b, 2 * np + 2 * nv + no, [&](Widen& w, int64_t i, int64_t c) {
    attention_context_backward(w.in(probs.at(i * np), c * np), w.in(v.at(i * nv), c * nv),
                               w.in(dout.at(i * no), c * no), w.out(dprobs.at(i * np), c * np),
                               w.out(dv.at(i * nv), c * nv), c, s, hq, hk, d);
  });
}

namespace {

void check_query_rows(int64_t sq, int64_t sk) {
  if (sq < 0 || sq > sk)
    throw std::invalid_argument("flash attention: " + std::to_string(sq) + " queries against " +
                                std::to_string(sk) + " keys (need queries <= keys)");
}

}  // namespace

void Backend::flash_attention_forward(CPtr q, CPtr k, CPtr v, Ptr out, float* lse, int64_t b,
                                      int64_t sq, int64_t sk, int64_t hq, int64_t hk, int64_t d) {
  check_query_rows(sq, sk);
  if (f32({q, k, v, out}))
    return flash_attention_forward(q.f(), k.f(), v.f(), out.f(), lse, b, sq, sk, hq, hk, d);
  if (native_flash_attention_forward(q, k, v, out, lse, b, sq, sk, hq, hk, d)) return;
  const int64_t nq = sq * hq * d, nk = sk * hk * d, nl = hq * sq;  // per sequence
  widened(*this, b, 2 * nq + 2 * nk, [&](Widen& w, int64_t i, int64_t c) {
    flash_attention_forward(w.in(q.at(i * nq), c * nq), w.in(k.at(i * nk), c * nk),
                            w.in(v.at(i * nk), c * nk), w.out(out.at(i * nq), c * nq), lse + i * nl,
                            c, sq, sk, hq, hk, d);
  });
}

void Backend::flash_attention_backward(CPtr q, CPtr k, CPtr v, CPtr out, const float* lse,
                                       CPtr dout, Ptr dq, Ptr dk, Ptr dv, int64_t b, int64_t sq,
                                       int64_t sk, int64_t hq, int64_t hk, int64_t d) {
  check_query_rows(sq, sk);
  if (f32({q, k, v, out, dout, dq, dk, dv}))
    return flash_attention_backward(q.f(), k.f(), v.f(), out.f(), lse, dout.f(), dq.f(), dk.f(),
                                    dv.f(), b, sq, sk, hq, hk, d);
  if (native_flash_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, b, sq, sk, hq, hk, d))
    return;
  const int64_t nq = sq * hq * d, nk = sk * hk * d, nl = hq * sq;  // per sequence
  widened(*this, b, 4 * nq + 4 * nk, [&](Widen& w, int64_t i, int64_t c) {
    flash_attention_backward(w.in(q.at(i * nq), c * nq), w.in(k.at(i * nk), c * nk),
                             w.in(v.at(i * nk), c * nk), w.in(out.at(i * nq), c * nq), lse + i * nl,
                             w.in(dout.at(i * nq), c * nq), w.out(dq.at(i * nq), c * nq),
                             w.out(dk.at(i * nk), c * nk), w.out(dv.at(i * nk), c * nk), c, sq, sk,
                             hq, hk, d);
  });
}

void Backend::norm_forward(CPtr x, CPtr g, CPtr beta, Ptr y, float* mean, float* rstd, int64_t n,
                           int64_t h) {
  if (f32({x, g, beta, y})) return norm_forward(x.f(), g.f(), beta.f(), y.f(), mean, rstd, n, h);
  if (native_norm_forward(x, g, beta, y, mean, rstd, n, h)) return;
  // Rows normalise alone, and the backward pass adds into the gain and bias gradients: both go
  // in blocks of rows, the gain and bias widened once.
  Widen weights(*this);
  const float *gf = weights.in(g, h), *bf = weights.in(beta, h);
  widened(*this, n, 2 * h, [&](Widen& w, int64_t r0, int64_t rows) {
    norm_forward(w.in(x.at(r0 * h), rows * h), gf, bf, w.out(y.at(r0 * h), rows * h),
                 mean ? mean + r0 : nullptr, rstd ? rstd + r0 : nullptr, rows, h);
  });
}

void Backend::norm_backward(CPtr x, CPtr g, bool has_beta, const float* mean, const float* rstd,
                            CPtr dy, Ptr dx, float* dg, float* dbeta, int64_t n, int64_t h) {
  if (f32({x, g, dy, dx}))
    return norm_backward(x.f(), g.f(), has_beta, mean, rstd, dy.f(), dx.f(), dg, dbeta, n, h);
  if (native_norm_backward(x, g, has_beta, mean, rstd, dy, dx, dg, dbeta, n, h)) return;
  Widen weights(*this);
  const float* gf = weights.in(g, h);
  widened(*this, n, 3 * h, [&](Widen& w, int64_t r0, int64_t rows) {
    norm_backward(w.in(x.at(r0 * h), rows * h), gf, has_beta, mean ? mean + r0 : nullptr,
                  rstd ? rstd + r0 : nullptr, w.in(dy.at(r0 * h), rows * h),
                  w.out(dx.at(r0 * h), rows * h), dg, dbeta, rows, h);
  });
}

void Backend::norm_backward_add(CPtr x, CPtr g, bool has_beta, const float* mean, const float* rstd,
                                CPtr dy, Ptr dacc, float* dg, float* dbeta, int64_t n, int64_t h) {
  if (native_norm_backward_add(x, g, has_beta, mean, rstd, dy, dacc, dg, dbeta, n, h)) return;
  if (n <= 0 || h <= 0) return;
  const size_t bytes = static_cast<size_t>(n * h) * dtype_bytes(dacc.t);
  void* t = allocate_for_overwrite(bytes);
  try {
    norm_backward(x, g, has_beta, mean, rstd, dy, Ptr(t, dacc.t), dg, dbeta, n, h);
    add(dacc, CPtr(t, dacc.t), n * h);
  } catch (...) {
    deallocate(t, bytes);
    throw;
  }
  deallocate(t, bytes);
}

void Backend::gelu(CPtr x, Ptr y, int64_t n) {
  if (f32({x, y})) return gelu(x.f(), y.f(), n);
  if (native_gelu(x, y, n)) return;
  widened(*this, n, 2,
          [&](Widen& w, int64_t i, int64_t c) { gelu(w.in(x.at(i), c), w.out(y.at(i), c), c); });
}

void Backend::gelu_backward(CPtr x, CPtr dy, Ptr dx, int64_t n) {
  if (f32({x, dy, dx})) return gelu_backward(x.f(), dy.f(), dx.f(), n);
  if (native_gelu_backward(x, dy, dx, n)) return;
  widened(*this, n, 3, [&](Widen& w, int64_t i, int64_t c) {
    gelu_backward(w.in(x.at(i), c), w.in(dy.at(i), c), w.out(dx.at(i), c), c);
  });
}

void Backend::gelu_backward_bias_grad(CPtr x, CPtr dy, Ptr dx, float* db, int64_t rows,
                                      int64_t width) {
  if (db && native_gelu_backward_bias_grad(x, dy, dx, db, rows, width)) return;
  gelu_backward(x, dy, dx, rows * width);
  if (db) bias_grad(dx, db, rows, width);
}

void Backend::swiglu(CPtr x, Ptr y, int64_t n, int64_t f) {
  if (f32({x, y})) return swiglu(x.f(), y.f(), n, f);
  if (native_swiglu(x, y, n, f)) return;
  widened(*this, n, 3 * f, [&](Widen& w, int64_t r, int64_t c) {
    swiglu(w.in(x.at(2 * r * f), 2 * c * f), w.out(y.at(r * f), c * f), c, f);
  });
}

void Backend::swiglu_backward(CPtr x, CPtr dy, Ptr dx, int64_t n, int64_t f) {
  if (f32({x, dy, dx})) return swiglu_backward(x.f(), dy.f(), dx.f(), n, f);
  if (native_swiglu_backward(x, dy, dx, n, f)) return;
  widened(*this, n, 5 * f, [&](Widen& w, int64_t r, int64_t c) {
    swiglu_backward(w.in(x.at(2 * r * f), 2 * c * f), w.in(dy.at(r * f), c * f),
                    w.out(dx.at(2 * r * f), 2 * c * f), c, f);
  });
}

void Backend::rope(Ptr x, int64_t b, int64_t s, int64_t heads, int64_t d, double base,
                   bool inverse) {
  if (x.f32()) return rope(x.f(), b, s, heads, d, base, inverse);
  if (native_rope(x, b, s, heads, d, base, inverse)) return;
  widened(*this,
          [&](Widen& w) { rope(w.inout(x, b * s * heads * d), b, s, heads, d, base, inverse); });
}

void Backend::copy(CPtr x, Ptr y, int64_t n) {
  if (x.t == y.t) return copy_bytes(x.p, y.p, static_cast<size_t>(n) * dtype_bytes(x.t));
  convert(x.p, x.t, y.p, y.t, n);
}

void Backend::adamw_update(float* w, float* grad, float* m, float* v, Ptr copy_to, int64_t n,
                           const AdamWSettings& o, int64_t step, double grad_scale) {
  if (grad_scale != 1.0) scale(grad, n, grad_scale);
  adamw(w, grad, m, v, n, o, step);
  if (copy_to.p) copy(CPtr(w), copy_to, n);
}

void Backend::adamw_update_spans(float* w, float* grad, float* m, float* v, Ptr copy_to,
                                 const std::vector<DecaySpan>& spans, const AdamWSettings& o,
                                 int64_t step, double grad_scale) {
  for (const DecaySpan& s : spans) {
    AdamWSettings a = o;
    a.weight_decay = s.decay ? o.weight_decay : 0.0;
    adamw_update(w + s.start, grad + s.start, m + s.start, v + s.start,
                 copy_to.p ? copy_to.at(s.start) : Ptr(), s.n, a, step, grad_scale);
  }
}

void Backend::fill_zero(Ptr x, int64_t n) {
  zero_bytes(x.p, static_cast<size_t>(n) * dtype_bytes(x.t));
}

void Backend::add(Ptr y, CPtr x, int64_t n) {
  if (f32({y, x})) return add(y.f(), x.f(), n);
  if (native_add(y, x, n)) return;
  widened(*this, n, 2,
          [&](Widen& w, int64_t i, int64_t c) { add(w.inout(y.at(i), c), w.in(x.at(i), c), c); });
}

void Backend::add_bias(Ptr y, CPtr bias, int64_t rows, int64_t width) {
  if (f32({y, bias})) return add_bias(y.f(), bias.f(), rows, width);
  if (native_add_bias(y, bias, rows, width)) return;
  widened(*this,
          [&](Widen& w) { add_bias(w.inout(y, rows * width), w.in(bias, width), rows, width); });
}

void Backend::residual_add(Ptr out, CPtr residual, CPtr partial, CPtr bias, int64_t rows,
                           int64_t width) {
  if (native_residual_add(out, residual, partial, bias, rows, width)) return;
  if (out.p == partial.p) {
    add(out, residual, rows * width);  // the same sum: a rounded addition is commutative
  } else {
    if (out.p != residual.p) copy(residual, out, rows * width);
    add(out, partial, rows * width);
  }
  if (bias) add_bias(out, bias, rows, width);
}

void Backend::residual_add_backward(CPtr dout, Ptr d_residual, Ptr d_partial, float* db,
                                    int64_t rows, int64_t width) {
  if (native_residual_add_backward(dout, d_residual, d_partial, db, rows, width)) return;
  if (db) bias_grad(dout, db, rows, width);
  copy(dout, d_residual, rows * width);
  copy(dout, d_partial, rows * width);
}

void Backend::bias_grad(CPtr dy, float* db, int64_t rows, int64_t width) {
  if (dy.f32()) return bias_grad(dy.f(), db, rows, width);
  if (native_bias_grad(dy, db, rows, width)) return;
  widened(*this, [&](Widen& w) { bias_grad(w.in(dy, rows * width), db, rows, width); });
}

void Backend::scale(Ptr x, int64_t n, double f) {
  if (x.f32()) return scale(x.f(), n, f);
  if (native_scale(x, n, f)) return;
  widened(*this, n, 1, [&](Widen& w, int64_t i, int64_t c) { scale(w.inout(x.at(i), c), c, f); });
}

void Backend::split_columns3(CPtr x, Ptr y0, Ptr y1, Ptr y2, int64_t n, int64_t a, int64_t b,
                             int64_t c) {
  if (f32({x, y0, y1, y2})) return split_columns3(x.f(), y0.f(), y1.f(), y2.f(), n, a, b, c);
  if (native_split_columns3(x, y0, y1, y2, n, a, b, c)) return;
  widened(*this, [&](Widen& w) {
    split_columns3(w.in(x, n * (a + b + c)), w.out(y0, n * a), w.out(y1, n * b), w.out(y2, n * c),
                   n, a, b, c);
  });
}

void Backend::concat_columns3(CPtr x0, CPtr x1, CPtr x2, Ptr y, int64_t n, int64_t a, int64_t b,
                              int64_t c) {
  if (f32({x0, x1, x2, y})) return concat_columns3(x0.f(), x1.f(), x2.f(), y.f(), n, a, b, c);
  if (native_concat_columns3(x0, x1, x2, y, n, a, b, c)) return;
  widened(*this, [&](Widen& w) {
    concat_columns3(w.in(x0, n * a), w.in(x1, n * b), w.in(x2, n * c), w.out(y, n * (a + b + c)), n,
                    a, b, c);
  });
}

void Backend::sequence_unshard(CPtr shards, Ptr full, int64_t t, int64_t b, int64_t s,
                               int64_t width) {
  if (f32({shards, full})) return sequence_unshard(shards.f(), full.f(), t, b, s, width);
  if (native_sequence_unshard(shards, full, t, b, s, width)) return;
  widened(*this, [&](Widen& w) {
    sequence_unshard(w.in(shards, b * s * width), w.out(full, b * s * width), t, b, s, width);
  });
}

void Backend::sequence_shard(CPtr full, Ptr shards, int64_t t, int64_t b, int64_t s,
                             int64_t width) {
  if (f32({full, shards})) return sequence_shard(full.f(), shards.f(), t, b, s, width);
  if (native_sequence_shard(full, shards, t, b, s, width)) return;
  widened(*this, [&](Widen& w) {
    sequence_shard(w.in(full, b * s * width), w.out(shards, b * s * width), t, b, s, width);
  });
}

void Backend::vocab_embedding_lookup(const int32_t* tokens, CPtr table, Ptr y, int64_t n, int64_t h,
                                     int64_t v0, int64_t vl) {
  if (f32({table, y})) return vocab_embedding_lookup(tokens, table.f(), y.f(), n, h, v0, vl);
  if (native_vocab_embedding_lookup(tokens, table, y, n, h, v0, vl)) return;
  widened(*this, [&](Widen& w) {
    vocab_embedding_lookup(tokens, w.in(table, vl * h), w.out(y, n * h), n, h, v0, vl);
  });
}

void Backend::vocab_embedding_grad(const int32_t* tokens, CPtr dy, float* dtable, int64_t n,
                                   int64_t h, int64_t v0, int64_t vl) {
  if (dy.f32()) return vocab_embedding_grad(tokens, dy.f(), dtable, n, h, v0, vl);
  if (native_vocab_embedding_grad(tokens, dy, dtable, n, h, v0, vl)) return;
  widened(*this,
          [&](Widen& w) { vocab_embedding_grad(tokens, w.in(dy, n * h), dtable, n, h, v0, vl); });
}

void Backend::add_positions(Ptr x, CPtr pos, int64_t b, int64_t sl, int64_t h, int64_t first) {
  if (f32({x, pos})) return add_positions(x.f(), pos.f(), b, sl, h, first);
  if (native_add_positions(x, pos, b, sl, h, first)) return;
  widened(*this, [&](Widen& w) {
    add_positions(w.inout(x, b * sl * h), w.in(pos, (first + sl) * h), b, sl, h, first);
  });
}

void Backend::position_grad(CPtr dx, float* dpos, int64_t b, int64_t sl, int64_t h, int64_t first) {
  if (dx.f32()) return position_grad(dx.f(), dpos, b, sl, h, first);
  if (native_position_grad(dx, dpos, b, sl, h, first)) return;
  widened(*this, [&](Widen& w) { position_grad(w.in(dx, b * sl * h), dpos, b, sl, h, first); });
}

void Backend::cross_entropy_stats(CPtr logits, const int32_t* targets, float* stats, int64_t n,
                                  int64_t vl, int64_t valid, int64_t v0) {
  if (logits.f32()) return cross_entropy_stats(logits.f(), targets, stats, n, vl, valid, v0);
  if (native_cross_entropy_stats(logits, targets, stats, n, vl, valid, v0)) return;
  constexpr int64_t k = kCrossEntropyStatsPerToken;
  widened(*this, n, vl, [&](Widen& w, int64_t r, int64_t c) {
    cross_entropy_stats(w.in(logits.at(r * vl), c * vl), targets + r, stats + r * k, c, vl, valid,
                        v0);
  });
}

double Backend::cross_entropy_finish(const float* stats, int64_t ranks, Ptr logits, float* lse,
                                     int64_t n, int64_t vl, int64_t valid) {
  if (logits.f32()) return cross_entropy_finish(stats, ranks, logits.f(), lse, n, vl, valid);
  if (double loss = 0; native_cross_entropy_finish(stats, ranks, logits, lse, n, vl, valid, loss))
    return loss;
  // Each block's rows of every rank's statistics ([ranks, n, k]) side by side: [ranks, c, k].
  constexpr int64_t k = kCrossEntropyStatsPerToken;
  double loss = 0;
  widened(*this, n, vl, [&](Widen& w, int64_t r, int64_t c) {
    const float* rows = stats + r * k;  // one rank's: contiguous already
    DeviceBuffer part;
    if (ranks > 1) {
      part = DeviceBuffer(*this, DType::kF32, ranks * c * k);
      for (int64_t q = 0; q < ranks; ++q)
        copy_bytes(stats + (q * n + r) * k, part.data<float>() + q * c * k,
                   static_cast<size_t>(c * k) * sizeof(float));
      rows = part.data<float>();
    }
    loss += cross_entropy_finish(rows, ranks, w.inout(logits.at(r * vl), c * vl), lse + r, c, vl,
                                 valid);
  });
  return loss;
}

void Backend::cross_entropy_backward(Ptr probs, const int32_t* targets, int64_t n, int64_t vl,
                                     int64_t v0, double scale) {
  if (probs.f32()) return cross_entropy_backward(probs.f(), targets, n, vl, v0, scale);
  if (native_cross_entropy_backward(probs, targets, n, vl, v0, scale)) return;
  // The kernel divides by its row count: a block of c rows gets scale * c / n.
  widened(*this, n, vl, [&](Widen& w, int64_t r, int64_t c) {
    cross_entropy_backward(w.inout(probs.at(r * vl), c * vl), targets + r, c, vl, v0,
                           scale * static_cast<double>(c) / static_cast<double>(n));
  });
}

double Backend::cross_entropy_loss(const float* stats, int64_t ranks, Ptr logits, float* lse,
                                   int64_t n, int64_t vl, int64_t valid) {
  if (double loss = 0; native_cross_entropy_loss(stats, ranks, logits, lse, n, loss)) return loss;
  return cross_entropy_finish(stats, ranks, logits, lse, n, vl, valid);
}

void Backend::cross_entropy_backward_from_lse(Ptr logits, const float* lse, const int32_t* targets,
                                              int64_t n, int64_t vl, int64_t valid, int64_t v0,
                                              double scale) {
  if (native_cross_entropy_backward_from_lse(logits, lse, targets, n, vl, valid, v0, scale)) return;
  cross_entropy_backward(logits, targets, n, vl, v0, scale);
}

}  // namespace ptdp
