#include "kernels/cpu/kernels.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "kernels/cpu/fast_math.h"

namespace ptdp::kernels {
namespace {

template <typename T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using MapM = Eigen::Map<Mat<T>>;
template <typename T>
using CMapM = Eigen::Map<const Mat<T>>;
template <typename T>
using Vec = Eigen::Matrix<T, 1, Eigen::Dynamic>;

}  // namespace

template <typename T>
void linear_forward(const T* x, const T* w, const T* b, T* y, int64_t n, int64_t in, int64_t out) {
  MapM<T> Y(y, n, out);
  Y.noalias() = CMapM<T>(x, n, in) * CMapM<T>(w, out, in).transpose();
  if (b) Y.rowwise() += Eigen::Map<const Vec<T>>(b, out);
}

template <typename T>
void linear_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, T* db, int64_t n,
                     int64_t in, int64_t out) {
  CMapM<T> DY(dy, n, out);
  if (dx) MapM<T>(dx, n, in).noalias() = DY * CMapM<T>(w, out, in);
  if (dw) MapM<T>(dw, out, in).noalias() += DY.transpose() * CMapM<T>(x, n, in);
  if (db) Eigen::Map<Vec<T>>(db, out) += DY.colwise().sum();
}

template <typename T>
void layernorm_forward(const T* x, const T* g, const T* b, T* y, T* mean, T* rstd, int64_t n,
                       int64_t h, T eps) {
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * h;
    T mu = 0;
    for (int64_t j = 0; j < h; ++j) mu += xi[j];
    mu /= static_cast<T>(h);
    T var = 0;
    for (int64_t j = 0; j < h; ++j) var += (xi[j] - mu) * (xi[j] - mu);
    var /= static_cast<T>(h);
    const T r = T(1) / std::sqrt(var + eps);
    for (int64_t j = 0; j < h; ++j) y[i * h + j] = (xi[j] - mu) * r * g[j] + b[j];
    mean[i] = mu;
    rstd[i] = r;
  }
}

template <typename T>
void layernorm_backward(const T* x, const T* g, const T* mean, const T* rstd, const T* dy, T* dx,
                        T* dg, T* db, int64_t n, int64_t h) {
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * h;
    const T* dyi = dy + i * h;
    T sum_dxhat = 0, sum_dxhat_xhat = 0;
    for (int64_t j = 0; j < h; ++j) {
      const T xhat = (xi[j] - mean[i]) * rstd[i];
      const T dxhat = dyi[j] * g[j];
      sum_dxhat += dxhat;
      sum_dxhat_xhat += dxhat * xhat;
      dg[j] += dyi[j] * xhat;
      db[j] += dyi[j];
    }
    const T inv_h = T(1) / static_cast<T>(h);
    for (int64_t j = 0; j < h; ++j) {
      const T xhat = (xi[j] - mean[i]) * rstd[i];
      const T dxhat = dyi[j] * g[j];
      dx[i * h + j] = rstd[i] * (dxhat - inv_h * sum_dxhat - xhat * inv_h * sum_dxhat_xhat);
    }
  }
}

template <typename T>
void rmsnorm_forward(const T* x, const T* g, T* y, T* rstd, int64_t n, int64_t h, T eps) {
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * h;
    T ms = 0;
    for (int64_t j = 0; j < h; ++j) ms += xi[j] * xi[j];
    const T r = T(1) / std::sqrt(ms / static_cast<T>(h) + eps);
    for (int64_t j = 0; j < h; ++j) y[i * h + j] = xi[j] * r * g[j];
    rstd[i] = r;
  }
}

template <typename T>
void rmsnorm_backward(const T* x, const T* g, const T* rstd, const T* dy, T* dx, T* dg, int64_t n,
                      int64_t h) {
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * h;
    const T* dyi = dy + i * h;
    T dot = 0;  // sum_j dy_j g_j x_j
    for (int64_t j = 0; j < h; ++j) {
      dot += dyi[j] * g[j] * xi[j];
      dg[j] += dyi[j] * xi[j] * rstd[i];
    }
    const T r = rstd[i];
    const T c = r * r * r * dot / static_cast<T>(h);
    for (int64_t j = 0; j < h; ++j) dx[i * h + j] = dyi[j] * g[j] * r - xi[j] * c;
  }
}

namespace {
constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
}

template <typename T>
void gelu_forward(const T* x, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T u = static_cast<T>(kGeluC) * (x[i] + T(0.044715) * x[i] * x[i] * x[i]);
    T th, unused;
    tanh_parts(u, &th, &unused);
    y[i] = T(0.5) * x[i] * (T(1) + th);
  }
}

template <typename T>
void gelu_backward(const T* x, const T* dy, T* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T xi = x[i];
    const T u = static_cast<T>(kGeluC) * (xi + T(0.044715) * xi * xi * xi);
    T th, sech2;  // tanh(u) and 1 - tanh(u)^2, the latter without cancellation
    tanh_parts(u, &th, &sech2);
    const T du = static_cast<T>(kGeluC) * (T(1) + T(3 * 0.044715) * xi * xi);
    dx[i] = dy[i] * (T(0.5) * (T(1) + th) + T(0.5) * xi * sech2 * du);
  }
}

template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* probs, int64_t b, int64_t s,
                       int64_t heads, int64_t d) {
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const int64_t row = heads * d;  // stride between consecutive positions
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t hi = 0; hi < heads; ++hi) {
      const int64_t base = bi * s * row + hi * d;
      T* p = probs + (bi * heads + hi) * s * s;
      for (int64_t i = 0; i < s; ++i) {
        T mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          T dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += q[base + i * row + c] * k[base + j * row + c];
          p[i * s + j] = dot * scale;
          mx = std::max(mx, p[i * s + j]);
        }
        T sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += (p[i * s + j] = std::exp(p[i * s + j] - mx));
        for (int64_t j = 0; j <= i; ++j) p[i * s + j] /= sum;
        for (int64_t j = i + 1; j < s; ++j) p[i * s + j] = 0;
        for (int64_t c = 0; c < d; ++c) {
          T acc = 0;
          for (int64_t j = 0; j <= i; ++j) acc += p[i * s + j] * v[base + j * row + c];
          out[base + i * row + c] = acc;
        }
      }
    }
  }
}

template <typename T>
void attention_backward(const T* q, const T* k, const T* v, const T* probs, const T* dout, T* dq,
                        T* dk, T* dv, int64_t b, int64_t s, int64_t heads, int64_t d) {
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const int64_t row = heads * d;
  std::vector<T> dp(static_cast<size_t>(s));
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t hi = 0; hi < heads; ++hi) {
      const int64_t base = bi * s * row + hi * d;
      const T* p = probs + (bi * heads + hi) * s * s;
      for (int64_t i = 0; i < s; ++i)
        for (int64_t c = 0; c < d; ++c) {
          dq[base + i * row + c] = 0;
          dk[base + i * row + c] = 0;
          dv[base + i * row + c] = 0;
        }
      for (int64_t i = 0; i < s; ++i) {
        // dP = dO V^T; dS = P (dP - sum(P dP)); dQ = dS K scale; dK += dS^T Q scale; dV += P^T dO.
        T dot_pdp = 0;
        for (int64_t j = 0; j <= i; ++j) {
          T acc = 0;
          for (int64_t c = 0; c < d; ++c) acc += dout[base + i * row + c] * v[base + j * row + c];
          dp[static_cast<size_t>(j)] = acc;
          dot_pdp += p[i * s + j] * acc;
        }
        for (int64_t j = 0; j <= i; ++j) {
          const T ds = p[i * s + j] * (dp[static_cast<size_t>(j)] - dot_pdp) * scale;
          for (int64_t c = 0; c < d; ++c) {
            dq[base + i * row + c] += ds * k[base + j * row + c];
            dk[base + j * row + c] += ds * q[base + i * row + c];
            dv[base + j * row + c] += p[i * s + j] * dout[base + i * row + c];
          }
        }
      }
    }
  }
}

namespace {
// One head's [s, d] slice of a [b, s, heads, d] tensor.
template <typename T>
using HeadMap = Eigen::Map<Mat<T>, 0, Eigen::OuterStride<>>;
template <typename T>
using CHeadMap = Eigen::Map<const Mat<T>, 0, Eigen::OuterStride<>>;

template <typename T>
CHeadMap<T> head(const T* x, int64_t bi, int64_t hi, int64_t s, int64_t heads, int64_t d) {
  return CHeadMap<T>(x + (bi * s * heads + hi) * d, s, d, Eigen::OuterStride<>(heads * d));
}
template <typename T>
HeadMap<T> head(T* x, int64_t bi, int64_t hi, int64_t s, int64_t heads, int64_t d) {
  return HeadMap<T>(x + (bi * s * heads + hi) * d, s, d, Eigen::OuterStride<>(heads * d));
}
}  // namespace

template <typename T>
void attention_scores_forward(const T* q, const T* k, T* scores, int64_t b, int64_t s, int64_t hq,
                              int64_t hk, int64_t d) {
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const int64_t per_group = hq / hk;
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < hq; ++hi) {
      MapM<T> S(scores + (bi * hq + hi) * s * s, s, s);
      S.noalias() = head(q, bi, hi, s, hq, d) * head(k, bi, hi / per_group, s, hk, d).transpose();
      S *= scale;
      S.template triangularView<Eigen::StrictlyUpper>().setZero();
    }
}

template <typename T>
void attention_scores_backward(const T* q, const T* k, const T* dscores, T* dq, T* dk, int64_t b,
                               int64_t s, int64_t hq, int64_t hk, int64_t d) {
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const int64_t per_group = hq / hk;
  if (dk) std::fill(dk, dk + b * s * hk * d, T(0));
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < hq; ++hi) {
      CMapM<T> dS(dscores + (bi * hq + hi) * s * s, s, s);
      const int64_t g = hi / per_group;
      if (dq) head(dq, bi, hi, s, hq, d).noalias() = scale * dS * head(k, bi, g, s, hk, d);
      if (dk)
        head(dk, bi, g, s, hk, d).noalias() += scale * dS.transpose() * head(q, bi, hi, s, hq, d);
    }
}

template <typename T>
void causal_softmax_forward(T* scores, int64_t rows, int64_t s) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < s; ++i) {
      T* p = scores + (r * s + i) * s;
      const T mx = *std::max_element(p, p + i + 1);
      for (int64_t j = 0; j <= i; ++j) p[j] = fast_exp(p[j] - mx);  // vectorised, then summed
      T sum = 0;
      for (int64_t j = 0; j <= i; ++j) sum += p[j];
      const T inv = T(1) / sum;
      for (int64_t j = 0; j <= i; ++j) p[j] *= inv;
    }
}

template <typename T>
void causal_softmax_backward(const T* probs, const T* dprobs, T* dscores, int64_t rows, int64_t s) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < s; ++i) {
      const T* p = probs + (r * s + i) * s;
      const T* dp = dprobs + (r * s + i) * s;
      T* ds = dscores + (r * s + i) * s;
      T dot = 0;
      for (int64_t j = 0; j <= i; ++j) dot += p[j] * dp[j];
      for (int64_t j = 0; j <= i; ++j) ds[j] = p[j] * (dp[j] - dot);
      for (int64_t j = i + 1; j < s; ++j) ds[j] = 0;
    }
}

template <typename T>
void attention_context_forward(const T* probs, const T* v, T* out, int64_t b, int64_t s, int64_t hq,
                               int64_t hk, int64_t d) {
  const int64_t per_group = hq / hk;
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < hq; ++hi)
      head(out, bi, hi, s, hq, d).noalias() =
          CMapM<T>(probs + (bi * hq + hi) * s * s, s, s) * head(v, bi, hi / per_group, s, hk, d);
}

template <typename T>
void attention_context_backward(const T* probs, const T* v, const T* dout, T* dprobs, T* dv,
                                int64_t b, int64_t s, int64_t hq, int64_t hk, int64_t d) {
  const int64_t per_group = hq / hk;
  if (dv) std::fill(dv, dv + b * s * hk * d, T(0));
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < hq; ++hi) {
      const int64_t g = hi / per_group;
      const auto dO = head(dout, bi, hi, s, hq, d);
      if (dprobs) {
        MapM<T> dP(dprobs + (bi * hq + hi) * s * s, s, s);
        dP.noalias() = dO * head(v, bi, g, s, hk, d).transpose();
        dP.template triangularView<Eigen::StrictlyUpper>().setZero();
      }
      if (dv)
        head(dv, bi, g, s, hk, d).noalias() +=
            CMapM<T>(probs + (bi * hq + hi) * s * s, s, s).transpose() * dO;
    }
}

template <typename T>
void swiglu_forward(const T* x, T* y, int64_t n, int64_t f) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < f; ++j) {
      const T g = x[i * 2 * f + j], u = x[i * 2 * f + f + j];
      y[i * f + j] = g / (T(1) + fast_exp(-g)) * u;
    }
}

template <typename T>
void swiglu_backward(const T* x, const T* dy, T* dx, int64_t n, int64_t f) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < f; ++j) {
      const T g = x[i * 2 * f + j], u = x[i * 2 * f + f + j];
      const T sig = T(1) / (T(1) + fast_exp(-g));
      const T dyi = dy[i * f + j];
      dx[i * 2 * f + j] = dyi * u * sig * (T(1) + g * (T(1) - sig));
      dx[i * 2 * f + f + j] = dyi * g * sig;
    }
}

template <typename T>
T cross_entropy(const T* logits, const int32_t* targets, T* dlogits, int64_t n, int64_t v) {
  T loss = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T* li = logits + i * v;
    const T mx = *std::max_element(li, li + v);
    T sum = 0;
    for (int64_t j = 0; j < v; ++j) sum += fast_exp(li[j] - mx);
    const T lse = mx + std::log(sum);
    loss += lse - li[targets[i]];
    if (dlogits) {
      for (int64_t j = 0; j < v; ++j)
        dlogits[i * v + j] = fast_exp(li[j] - lse) / static_cast<T>(n);
      dlogits[i * v + targets[i]] -= T(1) / static_cast<T>(n);
    }
  }
  return loss / static_cast<T>(n);
}

template <typename T>
void embedding_forward(const int32_t* tokens, const T* table, const T* pos, T* y, int64_t n,
                       int64_t s, int64_t h) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < h; ++j)
      y[i * h + j] = table[tokens[i] * h + j] + (pos ? pos[(i % s) * h + j] : T(0));
}

template <typename T>
void embedding_backward(const int32_t* tokens, const T* dy, T* dtable, T* dpos, int64_t n,
                        int64_t s, int64_t h) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < h; ++j) {
      if (dtable) dtable[tokens[i] * h + j] += dy[i * h + j];
      if (dpos) dpos[(i % s) * h + j] += dy[i * h + j];
    }
}

template <typename T>
void adamw_step(T* param, const T* grad, T* m, T* v, int64_t n, const AdamW& o, int64_t step) {
  const double c1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double c2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  for (int64_t i = 0; i < n; ++i) {
    m[i] = static_cast<T>(o.beta1 * m[i] + (1 - o.beta1) * grad[i]);
    v[i] = static_cast<T>(o.beta2 * v[i] + (1 - o.beta2) * grad[i] * grad[i]);
    const double mhat = m[i] / c1, vhat = v[i] / c2;
    param[i] = static_cast<T>(
        param[i] - o.lr * (mhat / (std::sqrt(vhat) + o.eps) + o.weight_decay * param[i]));
  }
}

template <typename T>
void rope(T* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base, bool inverse) {
  const int64_t half = d / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv_freq[static_cast<size_t>(i)] =
        std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
  std::vector<T> c(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
  for (int64_t j = 0; j < s; ++j) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(j) * inv_freq[static_cast<size_t>(i)];
      c[static_cast<size_t>(i)] = static_cast<T>(std::cos(angle));
      sn[static_cast<size_t>(i)] = static_cast<T>(inverse ? -std::sin(angle) : std::sin(angle));
    }
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* v = x + ((bi * s + j) * heads + hd) * d;
        for (int64_t i = 0; i < half; ++i) {
          const T x1 = v[i], x2 = v[i + half];
          v[i] = x1 * c[static_cast<size_t>(i)] - x2 * sn[static_cast<size_t>(i)];
          v[i + half] = x2 * c[static_cast<size_t>(i)] + x1 * sn[static_cast<size_t>(i)];
        }
      }
  }
}

#define PTDP_INSTANTIATE(T)                                                                      \
  template void linear_forward<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t);  \
  template void linear_backward<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t,   \
                                   int64_t);                                                     \
  template void layernorm_forward<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, \
                                     T);                                                         \
  template void layernorm_backward<T>(const T*, const T*, const T*, const T*, const T*, T*, T*,  \
                                      T*, int64_t, int64_t);                                     \
  template void rmsnorm_forward<T>(const T*, const T*, T*, T*, int64_t, int64_t, T);             \
  template void rmsnorm_backward<T>(const T*, const T*, const T*, const T*, T*, T*, int64_t,     \
                                    int64_t);                                                    \
  template void gelu_forward<T>(const T*, T*, int64_t);                                          \
  template void gelu_backward<T>(const T*, const T*, T*, int64_t);                               \
  template void attention_forward<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t,     \
                                     int64_t, int64_t);                                          \
  template void attention_backward<T>(const T*, const T*, const T*, const T*, const T*, T*, T*,  \
                                      T*, int64_t, int64_t, int64_t, int64_t);                   \
  template T cross_entropy<T>(const T*, const int32_t*, T*, int64_t, int64_t);                   \
  template void embedding_forward<T>(const int32_t*, const T*, const T*, T*, int64_t, int64_t,   \
                                     int64_t);                                                   \
  template void embedding_backward<T>(const int32_t*, const T*, T*, T*, int64_t, int64_t,        \
                                      int64_t);                                                  \
  template void adamw_step<T>(T*, const T*, T*, T*, int64_t, const AdamW&, int64_t);             \
  template void attention_scores_forward<T>(const T*, const T*, T*, int64_t, int64_t, int64_t,   \
                                            int64_t, int64_t);                                   \
  template void attention_scores_backward<T>(const T*, const T*, const T*, T*, T*, int64_t,      \
                                             int64_t, int64_t, int64_t, int64_t);                \
  template void causal_softmax_forward<T>(T*, int64_t, int64_t);                                 \
  template void causal_softmax_backward<T>(const T*, const T*, T*, int64_t, int64_t);            \
  template void attention_context_forward<T>(const T*, const T*, T*, int64_t, int64_t, int64_t,  \
                                             int64_t, int64_t);                                  \
  template void attention_context_backward<T>(const T*, const T*, const T*, T*, T*, int64_t,     \
                                              int64_t, int64_t, int64_t, int64_t);               \
  template void swiglu_forward<T>(const T*, T*, int64_t, int64_t);                               \
  template void swiglu_backward<T>(const T*, const T*, T*, int64_t, int64_t);                    \
  template void rope<T>(T*, int64_t, int64_t, int64_t, int64_t, double, bool);

PTDP_INSTANTIATE(float)
PTDP_INSTANTIATE(double)

}  // namespace ptdp::kernels
