#include "kernels/cpu/flash.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/fast_math.h"

namespace ptdp::kernels {
namespace {

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Rows = Eigen::Map<const Mat, 0, Eigen::OuterStride<>>;
using MutRows = Eigen::Map<Mat, 0, Eigen::OuterStride<>>;

constexpr int64_t kTile = 64;

// Rows [first, first + n) of head h of sequence bi of a [b, s, heads, d] tensor.
Rows rows(const float* x, int64_t bi, int64_t h, int64_t s, int64_t heads, int64_t d, int64_t first,
          int64_t n) {
  return Rows(x + ((bi * s + first) * heads + h) * d, n, d, Eigen::OuterStride<>(heads * d));
}
MutRows rows(float* x, int64_t bi, int64_t h, int64_t s, int64_t heads, int64_t d, int64_t first,
             int64_t n) {
  return MutRows(x + ((bi * s + first) * heads + h) * d, n, d, Eigen::OuterStride<>(heads * d));
}

// The keys a tile of queries [i0, i0 + nq) sees: [0, min(sk, i0 + nq + shift)).
int64_t keys_seen(int64_t i0, int64_t nq, int64_t sk, int64_t shift) {
  return std::min(sk, i0 + nq + shift);
}

// Columns of row r of a tile (queries from i0, keys from j0) that query i0 + r sees: [0, n).
int64_t visible(int64_t i0, int64_t r, int64_t j0, int64_t nk, int64_t shift) {
  return std::clamp<int64_t>(i0 + r + shift - j0 + 1, 0, nk);
}

}  // namespace

void flash_attention_forward(const float* q, const float* k, const float* v, float* out, float* lse,
                             int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk, int64_t d) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t group = hq / hk, shift = sk - sq;
  Mat S(kTile, kTile), O(kTile, d);
  std::vector<float> mx(kTile), sum(kTile);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kh = h / group;
      for (int64_t i0 = 0; i0 < sq; i0 += kTile) {
        const int64_t nq = std::min(kTile, sq - i0);
        const Rows Q = rows(q, bi, h, sq, hq, d, i0, nq);
        auto Ot = O.topRows(nq);
        Ot.setZero();
        std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
        std::fill(sum.begin(), sum.end(), 0.0f);
        const int64_t keys = keys_seen(i0, nq, sk, shift);
        for (int64_t j0 = 0; j0 < keys; j0 += kTile) {
          const int64_t nk = std::min(kTile, keys - j0);
          const Rows K = rows(k, bi, kh, sk, hk, d, j0, nk), V = rows(v, bi, kh, sk, hk, d, j0, nk);
          auto St = S.topLeftCorner(nq, nk);
          St.noalias() = Q * K.transpose();
          for (int64_t r = 0; r < nq; ++r) {
            const int64_t n = visible(i0, r, j0, nk, shift);
            float* p = St.row(r).data();
            float m = mx[r];
            for (int64_t c = 0; c < n; ++c) m = std::max(m, p[c] * scale);
            // The first key tile holds key 0, which every query sees: m is finite from there.
            const float alpha = std::exp(mx[r] - m);
            float add = 0;
            for (int64_t c = 0; c < n; ++c) p[c] = exp_f32(p[c] * scale - m);  // vectorised
            for (int64_t c = 0; c < n; ++c) add += p[c];
            std::fill(p + n, p + nk, 0.0f);
            sum[r] = sum[r] * alpha + add;
            mx[r] = m;
            Ot.row(r) *= alpha;
          }
          Ot.noalias() += St * V;
        }
        MutRows Out = rows(out, bi, h, sq, hq, d, i0, nq);
        float* l = lse + (bi * hq + h) * sq + i0;
        for (int64_t r = 0; r < nq; ++r) {
          Out.row(r) = Ot.row(r) / sum[r];
          l[r] = mx[r] + std::log(sum[r]);
        }
      }
    }
}

void flash_attention_backward(const float* q, const float* k, const float* v, const float* out,
                              const float* lse, const float* dout, float* dq, float* dk, float* dv,
                              int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hk,
                              int64_t d) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t group = hq / hk, shift = sk - sq;
  std::fill(dq, dq + b * sq * hq * d, 0.0f);
  std::fill(dk, dk + b * sk * hk * d, 0.0f);
  std::fill(dv, dv + b * sk * hk * d, 0.0f);
  Mat P(kTile, kTile), dS(kTile, kTile);
  std::vector<float> delta(kTile);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kh = h / group;
      for (int64_t i0 = 0; i0 < sq; i0 += kTile) {
        const int64_t nq = std::min(kTile, sq - i0);
        const Rows Q = rows(q, bi, h, sq, hq, d, i0, nq), dO = rows(dout, bi, h, sq, hq, d, i0, nq),
                   O = rows(out, bi, h, sq, hq, d, i0, nq);
        MutRows dQ = rows(dq, bi, h, sq, hq, d, i0, nq);
        const float* l = lse + (bi * hq + h) * sq + i0;
        for (int64_t r = 0; r < nq; ++r) delta[r] = dO.row(r).dot(O.row(r));  // rowsum(dO O)
        const int64_t keys = keys_seen(i0, nq, sk, shift);
        for (int64_t j0 = 0; j0 < keys; j0 += kTile) {
          const int64_t nk = std::min(kTile, keys - j0);
          const Rows K = rows(k, bi, kh, sk, hk, d, j0, nk), V = rows(v, bi, kh, sk, hk, d, j0, nk);
          MutRows dK = rows(dk, bi, kh, sk, hk, d, j0, nk),
                  dV = rows(dv, bi, kh, sk, hk, d, j0, nk);
          auto Pt = P.topLeftCorner(nq, nk);
          auto dSt = dS.topLeftCorner(nq, nk);
          Pt.noalias() = Q * K.transpose();
          dSt.noalias() = dO * V.transpose();  // dP
          for (int64_t r = 0; r < nq; ++r) {
            const int64_t n = visible(i0, r, j0, nk, shift);
            float *p = Pt.row(r).data(), *ds = dSt.row(r).data();
            for (int64_t c = 0; c < n; ++c) {
              p[c] = exp_f32(p[c] * scale - l[r]);
              ds[c] = p[c] * (ds[c] - delta[r]) * scale;
            }
            std::fill(p + n, p + nk, 0.0f);
            std::fill(ds + n, ds + nk, 0.0f);
          }
          dV.noalias() += Pt.transpose() * dO;
          dQ.noalias() += dSt * K;
          dK.noalias() += dSt.transpose() * Q;
        }
      }
    }
}

}  // namespace ptdp::kernels
