#include "kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "runtime/float16.h"

namespace ptdp::kernels {

void topk_softmax(const float* logits, int64_t n, int64_t experts, int64_t k, int32_t* expert,
                  float* prob) {
  std::vector<int32_t> idx(static_cast<size_t>(experts));
  for (int64_t i = 0; i < n; ++i) {
    const float* z = logits + i * experts;
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [z](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
    const float top = z[idx[0]];
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(static_cast<double>(z[idx[j]] - top));
    for (int64_t j = 0; j < k; ++j) {
      expert[i * k + j] = idx[static_cast<size_t>(j)];
      prob[i * k + j] = static_cast<float>(std::exp(static_cast<double>(z[idx[j]] - top)) / sum);
    }
  }
}

void topk_softmax_backward(const float* prob, const float* dprob, const int32_t* chosen, int64_t n,
                           int64_t experts, int64_t k, float* dlogits) {
  std::fill(dlogits, dlogits + n * experts, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    double dot = 0;
    for (int64_t j = 0; j < k; ++j) dot += static_cast<double>(prob[i * k + j]) * dprob[i * k + j];
    for (int64_t j = 0; j < k; ++j)
      dlogits[i * experts + chosen[i * k + j]] =
          static_cast<float>(prob[i * k + j] * (dprob[i * k + j] - dot));
  }
}

int64_t drop_over_capacity(int32_t* expert, const float* prob, int64_t n, int64_t k,
                           int64_t experts, int64_t capacity, bool by_position, int64_t sequences) {
  std::vector<std::vector<int64_t>> of(static_cast<size_t>(experts));
  for (int64_t s = 0; s < n * k; ++s)
    if (expert[s] >= 0) of[static_cast<size_t>(expert[s])].push_back(s);
  int64_t dropped = 0;
  for (auto& slots : of) {
    if (static_cast<int64_t>(slots.size()) <= capacity) continue;
    if (by_position) {
      // Slots are listed in [sequence, position] order; Megatron's is [position, sequence].
      const int64_t per = n / std::max<int64_t>(sequences, 1);
      std::stable_sort(slots.begin(), slots.end(),
                       [k, per](int64_t a, int64_t b) { return (a / k) % per < (b / k) % per; });
    } else {
      std::stable_sort(slots.begin(), slots.end(),
                       [prob](int64_t a, int64_t b) { return prob[a] > prob[b]; });
    }
    for (size_t i = static_cast<size_t>(capacity); i < slots.size(); ++i) {
      expert[slots[i]] = -1;
      ++dropped;
    }
  }
  return dropped;
}

int64_t permutation(const int32_t* expert, int64_t n, int64_t k, int64_t experts,
                    int64_t* slot_of_row, int64_t* counts) {
  std::fill(counts, counts + experts, int64_t{0});
  for (int64_t s = 0; s < n * k; ++s)
    if (expert[s] >= 0) ++counts[expert[s]];
  std::vector<int64_t> at(static_cast<size_t>(experts), 0);
  for (int64_t e = 1; e < experts; ++e)
    at[static_cast<size_t>(e)] = at[static_cast<size_t>(e - 1)] + counts[e - 1];
  int64_t rows = 0;
  for (int64_t s = 0; s < n * k; ++s)  // slots in token order: tokens ascend within an expert
    if (expert[s] >= 0) {
      slot_of_row[at[static_cast<size_t>(expert[s])]++] = s;
      ++rows;
    }
  return rows;
}

namespace {

// Rows of T as fp32: float itself, or bf16 bit patterns.
inline float load(float x) {
  return x;
}
inline float load(uint16_t x) {
  return bf16_to_float(x);
}
inline void store(float v, float* to) {
  *to = v;
}
inline void store(float v, uint16_t* to) {
  *to = float_to_bf16(v);
}

}  // namespace

template <class T>
void gather_rows(const T* x, const int64_t* index, const float* weight, int64_t rows, int64_t h,
                 T* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* from = x + index[r] * h;
    T* to = y + r * h;
    if (weight) {
      const float w = weight[r];
      for (int64_t c = 0; c < h; ++c) store(w * load(from[c]), to + c);
    } else {
      std::copy_n(from, h, to);
    }
  }
}

template <class T>
void gather_add_rows(const T* y, const int64_t* index, const float* weight, int64_t n, int64_t k,
                     int64_t h, T* out) {
  std::vector<float> sum(static_cast<size_t>(h));
  for (int64_t i = 0; i < n; ++i) {
    T* o = out + i * h;
    for (int64_t c = 0; c < h; ++c) sum[static_cast<size_t>(c)] = load(o[c]);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = index[i * k + j];
      if (r < 0) continue;
      const T* v = y + r * h;
      const float w = weight ? weight[i * k + j] : 1.0f;  // 1 * x is x exactly
      for (int64_t c = 0; c < h; ++c) sum[static_cast<size_t>(c)] += w * load(v[c]);
    }
    for (int64_t c = 0; c < h; ++c) store(sum[static_cast<size_t>(c)], o + c);
  }
}

template <class T>
void row_dots(const T* a, const int64_t* index, const T* b, int64_t rows, int64_t h, float* dot) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* u = a + index[r] * h;
    const T* v = b + r * h;
    double s = 0;
    for (int64_t c = 0; c < h; ++c) s += static_cast<double>(load(u[c])) * load(v[c]);
    dot[r] = static_cast<float>(s);
  }
}

#define PTDP_ROW_MOVES(T)                                                                     \
  template void gather_rows<T>(const T*, const int64_t*, const float*, int64_t, int64_t, T*); \
  template void gather_add_rows<T>(const T*, const int64_t*, const float*, int64_t, int64_t,  \
                                   int64_t, T*);                                              \
  template void row_dots<T>(const T*, const int64_t*, const T*, int64_t, int64_t, float*);
PTDP_ROW_MOVES(float)
PTDP_ROW_MOVES(uint16_t)
#undef PTDP_ROW_MOVES

void token_of_rows(const int64_t* slot_of_row, int64_t rows, int64_t k, int64_t* token_of_row) {
  for (int64_t r = 0; r < rows; ++r) token_of_row[r] = slot_of_row[r] / k;
}

void rows_of_tokens(const int64_t* slot_of_row, int64_t rows, int64_t n, int64_t k,
                    const float* prob, int64_t* row_of, float* row_prob) {
  std::vector<int64_t> filled(static_cast<size_t>(n), 0);
  std::fill(row_of, row_of + n * k, int64_t{-1});
  std::fill(row_prob, row_prob + n * k, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {  // rows ascend, so each token's entries do too
    const int64_t s = slot_of_row[r], i = s / k;
    const int64_t at = i * k + filled[static_cast<size_t>(i)]++;
    row_of[at] = r;
    row_prob[at] = prob[s];
  }
}

void transpose_blocks_index(const int64_t* rows, int64_t A, int64_t B, int64_t* index) {
  std::vector<int64_t> start(static_cast<size_t>(A * B));
  int64_t at = 0;
  for (int64_t i = 0; i < A * B; ++i) {
    start[static_cast<size_t>(i)] = at;
    at += rows[i];
  }
  int64_t o = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t a = 0; a < A; ++a)
      for (int64_t r = 0; r < rows[a * B + b]; ++r)
        index[o++] = start[static_cast<size_t>(a * B + b)] + r;
}

}  // namespace ptdp::kernels
