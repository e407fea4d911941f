#include "kernels/cpu/elementwise.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/fast_math.h"

namespace ptdp::kernels {

void add(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void add_bias(float* y, const float* bias, int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) y[r * width + c] += bias[c];
}

void bias_grad(const float* dy, float* db, int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) db[c] += dy[r * width + c];
}

void scale(float* x, int64_t n, double f) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(x[i] * f);
}

double sum_squares(const float* x, int64_t n, double acc) {
  double s = acc;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

void split_columns3(const void* x, void* y0, void* y1, void* y2, int64_t n, int64_t a, int64_t b,
                    int64_t c, size_t element) {
  const auto e = static_cast<int64_t>(element), w = a + b + c;
  const auto* from = static_cast<const char*>(x);
  auto *to0 = static_cast<char*>(y0), *to1 = static_cast<char*>(y1), *to2 = static_cast<char*>(y2);
  for (int64_t i = 0; i < n; ++i) {
    const char* row = from + i * w * e;
    std::memcpy(to0 + i * a * e, row, static_cast<size_t>(a * e));
    std::memcpy(to1 + i * b * e, row + a * e, static_cast<size_t>(b * e));
    std::memcpy(to2 + i * c * e, row + (a + b) * e, static_cast<size_t>(c * e));
  }
}

void concat_columns3(const void* x0, const void* x1, const void* x2, void* y, int64_t n, int64_t a,
                     int64_t b, int64_t c, size_t element) {
  const auto e = static_cast<int64_t>(element), w = a + b + c;
  const auto *from0 = static_cast<const char*>(x0), *from1 = static_cast<const char*>(x1),
             *from2 = static_cast<const char*>(x2);
  auto* to = static_cast<char*>(y);
  for (int64_t i = 0; i < n; ++i) {
    char* row = to + i * w * e;
    std::memcpy(row, from0 + i * a * e, static_cast<size_t>(a * e));
    std::memcpy(row + a * e, from1 + i * b * e, static_cast<size_t>(b * e));
    std::memcpy(row + (a + b) * e, from2 + i * c * e, static_cast<size_t>(c * e));
  }
}

void sequence_unshard(const void* shards, void* full, int64_t t, int64_t b, int64_t s,
                      int64_t width, size_t element) {
  const auto e = static_cast<int64_t>(element);
  const int64_t sl = s / t, block = sl * width * e;
  for (int64_t r = 0; r < t; ++r)
    for (int64_t bi = 0; bi < b; ++bi)
      std::memcpy(static_cast<char*>(full) + (bi * s + r * sl) * width * e,
                  static_cast<const char*>(shards) + (r * b + bi) * block,
                  static_cast<size_t>(block));
}

void sequence_shard(const void* full, void* shards, int64_t t, int64_t b, int64_t s, int64_t width,
                    size_t element) {
  const auto e = static_cast<int64_t>(element);
  const int64_t sl = s / t, block = sl * width * e;
  for (int64_t r = 0; r < t; ++r)
    for (int64_t bi = 0; bi < b; ++bi)
      std::memcpy(static_cast<char*>(shards) + (r * b + bi) * block,
                  static_cast<const char*>(full) + (bi * s + r * sl) * width * e,
                  static_cast<size_t>(block));
}

void vocab_embedding_lookup(const int32_t* tokens, const float* table, float* y, int64_t n,
                            int64_t h, int64_t v0, int64_t vl) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tok = tokens[i] - v0;
    if (tok >= 0 && tok < vl)
      std::memcpy(y + i * h, table + tok * h, sizeof(float) * h);
    else
      std::fill(y + i * h, y + (i + 1) * h, 0.0f);
  }
}

void vocab_embedding_grad(const int32_t* tokens, const float* dy, float* dtable, int64_t n,
                          int64_t h, int64_t v0, int64_t vl) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tok = tokens[i] - v0;
    if (tok < 0 || tok >= vl) continue;
    for (int64_t e = 0; e < h; ++e) dtable[tok * h + e] += dy[i * h + e];
  }
}

void add_positions(float* x, const float* pos, int64_t b, int64_t sl, int64_t h, int64_t first) {
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t j = 0; j < sl; ++j)
      for (int64_t e = 0; e < h; ++e) x[(bi * sl + j) * h + e] += pos[(first + j) * h + e];
}

void position_grad(const float* dx, float* dpos, int64_t b, int64_t sl, int64_t h, int64_t first) {
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t j = 0; j < sl; ++j)
      for (int64_t e = 0; e < h; ++e) dpos[(first + j) * h + e] += dx[(bi * sl + j) * h + e];
}

void cross_entropy_stats(const float* logits, const int32_t* targets, float* stats, int64_t n,
                         int64_t vl, int64_t valid, int64_t v0) {
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits + i * vl;
    float mx = -INFINITY;
    for (int64_t j = 0; j < valid; ++j) mx = std::max(mx, row[j]);
    float sum = 0;
    for (int64_t j = 0; j < valid; ++j) sum += exp_f32(row[j] - mx);
    const int64_t tgt = targets[i] - v0;
    stats[i * 3] = valid > 0 ? mx : -INFINITY;
    stats[i * 3 + 1] = sum;
    stats[i * 3 + 2] = tgt >= 0 && tgt < valid ? row[tgt] : 0.0f;
  }
}

double cross_entropy_finish(const float* stats, int64_t ranks, float* logits, float* lse, int64_t n,
                            int64_t vl, int64_t valid) {
  double loss = 0;
  for (int64_t i = 0; i < n; ++i) {
    float mx = -INFINITY;
    for (int64_t r = 0; r < ranks; ++r) mx = std::max(mx, stats[(r * n + i) * 3]);
    float sum = 0, target = 0;
    for (int64_t r = 0; r < ranks; ++r) {
      const float* st = stats + (r * n + i) * 3;
      sum += st[1] * std::exp(st[0] - mx);
      target += st[2];
    }
    lse[i] = mx + std::log(sum);
    loss += static_cast<double>(lse[i] - target);
  }
  // A shard past the vocabulary's end has valid <= 0 (a tiny vocabulary over many ranks).
  const int64_t nv = std::clamp<int64_t>(valid, 0, vl);
  for (int64_t i = 0; i < n; ++i) {
    float* row = logits + i * vl;
    for (int64_t j = 0; j < nv; ++j) row[j] = exp_f32(row[j] - lse[i]);
    std::fill(row + nv, row + vl, 0.0f);
  }
  return loss;
}

void cross_entropy_backward(float* probs, const int32_t* targets, int64_t n, int64_t vl, int64_t v0,
                            double scale) {
  const float f = static_cast<float>(scale / static_cast<double>(n));
  for (int64_t i = 0; i < n; ++i) {
    float* row = probs + i * vl;
    for (int64_t j = 0; j < vl; ++j) row[j] *= f;
    const int64_t tgt = targets[i] - v0;
    if (tgt >= 0 && tgt < vl) row[tgt] -= f;
  }
}

void token_window(const int32_t* sequences, int32_t* out, int64_t b, int64_t s, int64_t shift) {
  for (int64_t bi = 0; bi < b; ++bi)
    std::memcpy(out + bi * s, sequences + bi * (s + 1) + shift, sizeof(int32_t) * s);
}

}  // namespace ptdp::kernels
