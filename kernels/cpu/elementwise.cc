#include "kernels/cpu/elementwise.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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

void split_columns3(const float* x, float* y0, float* y1, float* y2, int64_t n, int64_t a,
                    int64_t b, int64_t c) {
  const int64_t w = a + b + c;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * w;
    std::memcpy(y0 + i * a, row, sizeof(float) * a);
    std::memcpy(y1 + i * b, row + a, sizeof(float) * b);
    std::memcpy(y2 + i * c, row + a + b, sizeof(float) * c);
  }
}

void concat_columns3(const float* x0, const float* x1, const float* x2, float* y, int64_t n,
                     int64_t a, int64_t b, int64_t c) {
  const int64_t w = a + b + c;
  for (int64_t i = 0; i < n; ++i) {
    float* row = y + i * w;
    std::memcpy(row, x0 + i * a, sizeof(float) * a);
    std::memcpy(row + a, x1 + i * b, sizeof(float) * b);
    std::memcpy(row + a + b, x2 + i * c, sizeof(float) * c);
  }
}

void sequence_unshard(const float* shards, float* full, int64_t t, int64_t b, int64_t s,
                      int64_t width) {
  const int64_t sl = s / t, block = sl * width;
  for (int64_t r = 0; r < t; ++r)
    for (int64_t bi = 0; bi < b; ++bi)
      std::memcpy(full + (bi * s + r * sl) * width, shards + (r * b + bi) * block,
                  sizeof(float) * block);
}

void sequence_shard(const float* full, float* shards, int64_t t, int64_t b, int64_t s,
                    int64_t width) {
  const int64_t sl = s / t, block = sl * width;
  for (int64_t r = 0; r < t; ++r)
    for (int64_t bi = 0; bi < b; ++bi)
      std::memcpy(shards + (r * b + bi) * block, full + (bi * s + r * sl) * width,
                  sizeof(float) * block);
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
    for (int64_t j = 0; j < valid; ++j) sum += std::exp(row[j] - mx);
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
  for (int64_t i = 0; i < n; ++i) {
    float* row = logits + i * vl;
    for (int64_t j = 0; j < vl; ++j) row[j] = j < valid ? std::exp(row[j] - lse[i]) : 0.0f;
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
