#include "kernels/cpu/fused.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace ptdp::kernels {
namespace {

// r = x + residual (or x), into r_out when given, else into scratch.
const float* residual_sum(const float* x, const float* residual, float* r_out,
                          std::vector<float>& scratch, int64_t count) {
  if (!residual && !r_out) return x;
  float* r = r_out;
  if (!r) {
    scratch.resize(static_cast<size_t>(count));
    r = scratch.data();
  }
  for (int64_t i = 0; i < count; ++i) r[i] = x[i] + (residual ? residual[i] : 0.0f);
  return r;
}

void add_incoming(float* dx, const float* dresid, int64_t count) {
  if (!dresid) return;
  for (int64_t i = 0; i < count; ++i) dx[i] += dresid[i];
}

}  // namespace

void add_layernorm_forward(const float* x, const float* residual, float* r_out, const float* g,
                           const float* b, float* y, float* mean, float* rstd, int64_t n, int64_t h,
                           float eps) {
  std::vector<float> scratch;
  const float* r = residual_sum(x, residual, r_out, scratch, n * h);
  layernorm_forward(r, g, b, y, mean, rstd, n, h, eps);
}

void add_layernorm_backward(const float* r, const float* g, const float* mean, const float* rstd,
                            const float* dy, const float* dresid, float* dx, float* dg, float* db,
                            int64_t n, int64_t h) {
  layernorm_backward(r, g, mean, rstd, dy, dx, dg, db, n, h);
  add_incoming(dx, dresid, n * h);
}

void add_rmsnorm_forward(const float* x, const float* residual, float* r_out, const float* g,
                         float* y, float* rstd, int64_t n, int64_t h, float eps) {
  std::vector<float> scratch;
  const float* r = residual_sum(x, residual, r_out, scratch, n * h);
  rmsnorm_forward(r, g, y, rstd, n, h, eps);
}

void add_rmsnorm_backward(const float* r, const float* g, const float* rstd, const float* dy,
                          const float* dresid, float* dx, float* dg, int64_t n, int64_t h) {
  rmsnorm_backward(r, g, rstd, dy, dx, dg, n, h);
  add_incoming(dx, dresid, n * h);
}

void bias_gelu_forward(const float* x, const float* bias, float* y, int64_t rows, int64_t cols) {
  std::vector<float> pre(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      pre[static_cast<size_t>(c)] = x[r * cols + c] + (bias ? bias[c] : 0.0f);
    gelu_forward(pre.data(), y + r * cols, cols);
  }
}

void bias_gelu_backward(const float* x, const float* bias, const float* dy, float* dx, float* dbias,
                        int64_t rows, int64_t cols) {
  std::vector<float> pre(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      pre[static_cast<size_t>(c)] = x[r * cols + c] + (bias ? bias[c] : 0.0f);
    gelu_backward(pre.data(), dy + r * cols, dx + r * cols, cols);
    if (dbias)
      for (int64_t c = 0; c < cols; ++c) dbias[c] += dx[r * cols + c];
  }
}

void causal_attention_forward(const float* q, const float* k, const float* v, float* out,
                              float* lse, int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk,
                              int64_t d) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const int64_t group = hq / hk, shift = sk - sq;
  std::vector<double> p(static_cast<size_t>(sk)), o(static_cast<size_t>(d));
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kh = h / group;
      for (int64_t i = 0; i < sq; ++i) {
        const float* qi = q + ((bi * sq + i) * hq + h) * d;
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i + shift; ++j) {
          const float* kj = k + ((bi * sk + j) * hk + kh) * d;
          double dot = 0;
          for (int64_t e = 0; e < d; ++e) dot += static_cast<double>(qi[e]) * kj[e];
          p[static_cast<size_t>(j)] = dot * scale;
          mx = std::max(mx, dot * scale);
        }
        double sum = 0;
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t j = 0; j <= i + shift; ++j) {
          const double pj = std::exp(p[static_cast<size_t>(j)] - mx);
          sum += pj;
          const float* vj = v + ((bi * sk + j) * hk + kh) * d;
          for (int64_t e = 0; e < d; ++e) o[static_cast<size_t>(e)] += pj * vj[e];
        }
        float* oi = out + ((bi * sq + i) * hq + h) * d;
        for (int64_t e = 0; e < d; ++e) oi[e] = static_cast<float>(o[static_cast<size_t>(e)] / sum);
        lse[(bi * hq + h) * sq + i] = static_cast<float>(mx + std::log(sum));
      }
    }
}

void causal_attention_backward(const float* q, const float* k, const float* v, const float* out,
                               const float* lse, const float* dout, float* dq, float* dk, float* dv,
                               int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk,
                               int64_t d) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const int64_t group = hq / hk, shift = sk - sq;
  std::fill(dq, dq + b * sq * hq * d, 0.0f);
  std::fill(dk, dk + b * sk * hk * d, 0.0f);
  std::fill(dv, dv + b * sk * hk * d, 0.0f);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kh = h / group;
      for (int64_t i = 0; i < sq; ++i) {
        const int64_t qoff = ((bi * sq + i) * hq + h) * d;
        const float *qi = q + qoff, *doi = dout + qoff, *oi = out + qoff;
        double delta = 0;  // rowsum(dO * O)
        for (int64_t e = 0; e < d; ++e) delta += static_cast<double>(doi[e]) * oi[e];
        const double l = lse[(bi * hq + h) * sq + i];
        for (int64_t j = 0; j <= i + shift; ++j) {
          const int64_t koff = ((bi * sk + j) * hk + kh) * d;
          const float *kj = k + koff, *vj = v + koff;
          double dot = 0, dp = 0;
          for (int64_t e = 0; e < d; ++e) {
            dot += static_cast<double>(qi[e]) * kj[e];
            dp += static_cast<double>(doi[e]) * vj[e];
          }
          const double p = std::exp(dot * scale - l);
          const double ds = p * (dp - delta) * scale;
          for (int64_t e = 0; e < d; ++e) {
            dv[koff + e] += static_cast<float>(p * doi[e]);
            dq[qoff + e] += static_cast<float>(ds * kj[e]);
            dk[koff + e] += static_cast<float>(ds * qi[e]);
          }
        }
      }
    }
}

}  // namespace ptdp::kernels
