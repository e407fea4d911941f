// CPU kernels of the GPT model: the reference twins of the CUDA kernels, and the CPU backend of
// `ptdp run`. Each has a forward and a backward; backwards accumulate (+=) into weight
// gradients and overwrite input gradients. Tensors are dense row-major arrays; shapes are
// given by the caller. Instantiated for float (training) and double (gradient checks).
//
//   linear        y[n, out] = x[n, in] W[out, in]^T (+ b[out])   (Megatron's weight layout)
//   layernorm     y = (x - mean) / sqrt(var + eps) * g + b, over the last dimension
//   gelu          tanh approximation (GPT-2, Megatron's bias_gelu)
//   attention     causal softmax(q k^T / sqrt(d)) v per (batch, head); q, k, v, out [b, s, heads,
//   d] cross_entropy mean over rows of -log softmax(logits)[target] embedding     y[n, h] =
//   table[token[n]] (+ pos[n mod s]) adamw         one decoupled-weight-decay Adam step
#pragma once

#include <cstdint>
#include <vector>

namespace ptdp::kernels {

template <typename T>
void linear_forward(const T* x, const T* w, const T* b, T* y, int64_t n, int64_t in, int64_t out);
template <typename T>
void linear_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, T* db, int64_t n,
                     int64_t in, int64_t out);

// mean and rstd ([n]) are saved for the backward pass.
template <typename T>
void layernorm_forward(const T* x, const T* g, const T* b, T* y, T* mean, T* rstd, int64_t n,
                       int64_t h, T eps = T(1e-5));
template <typename T>
void layernorm_backward(const T* x, const T* g, const T* mean, const T* rstd, const T* dy, T* dx,
                        T* dg, T* db, int64_t n, int64_t h);

// RMSNorm (Llama): y = x / sqrt(mean(x^2) + eps) * g; rstd ([n]) is saved.
template <typename T>
void rmsnorm_forward(const T* x, const T* g, T* y, T* rstd, int64_t n, int64_t h, T eps = T(1e-5));
template <typename T>
void rmsnorm_backward(const T* x, const T* g, const T* rstd, const T* dy, T* dx, T* dg, int64_t n,
                      int64_t h);

template <typename T>
void gelu_forward(const T* x, T* y, int64_t n);
template <typename T>
void gelu_backward(const T* x, const T* dy, T* dx, int64_t n);

// probs [b, heads, s, s] is saved for the backward pass.
template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* out, T* probs, int64_t b, int64_t s,
                       int64_t heads, int64_t d);
template <typename T>
void attention_backward(const T* q, const T* k, const T* v, const T* probs, const T* dout, T* dq,
                        T* dk, T* dv, int64_t b, int64_t s, int64_t heads, int64_t d);

// Attention split into the ops of the layer op list (attn_scores, attn_softmax, attn_context),
// with grouped-query attention: q [b, s, hq, d], k and v [b, s, hk, d], query head j reading
// key/value head j / (hq / hk). scores/probs [b, hq, s, s]; entries above the diagonal are 0.
// Backward outputs (dq, dk, dv, dprobs) are overwritten; any may be null.
template <typename T>
void attention_scores_forward(const T* q, const T* k, T* scores, int64_t b, int64_t s, int64_t hq,
                              int64_t hk, int64_t d);
template <typename T>
void attention_scores_backward(const T* q, const T* k, const T* dscores, T* dq, T* dk, int64_t b,
                               int64_t s, int64_t hq, int64_t hk, int64_t d);
// rows = b * hq matrices of s x s, in place.
template <typename T>
void causal_softmax_forward(T* scores, int64_t rows, int64_t s);
// dscores may alias dprobs.
template <typename T>
void causal_softmax_backward(const T* probs, const T* dprobs, T* dscores, int64_t rows, int64_t s);
template <typename T>
void attention_context_forward(const T* probs, const T* v, T* out, int64_t b, int64_t s, int64_t hq,
                               int64_t hk, int64_t d);
template <typename T>
void attention_context_backward(const T* probs, const T* v, const T* dout, T* dprobs, T* dv,
                                int64_t b, int64_t s, int64_t hq, int64_t hk, int64_t d);

// SwiGLU on x [n, 2f] = [gate | up]: y [n, f] = silu(gate) * up.
template <typename T>
void swiglu_forward(const T* x, T* y, int64_t n, int64_t f);
template <typename T>
void swiglu_backward(const T* x, const T* dy, T* dx, int64_t n, int64_t f);

// Rotary position embedding (Su et al. 2021, "RoFormer"), in place on x [b, s, heads, d] in the
// rotate-half layout Megatron-LM and Hugging Face use: element i < d/2 of a head pairs with
// i + d/2 and the pair at position j turns by j * base^(-2i/d). inverse: the transposed
// rotation, which is the backward pass (the rotation is orthogonal).
template <typename T>
void rope(T* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base, bool inverse);

// Returns the mean loss over n rows; dlogits may be null (forward only).
template <typename T>
T cross_entropy(const T* logits, const int32_t* targets, T* dlogits, int64_t n, int64_t v);

template <typename T>
void embedding_forward(const int32_t* tokens, const T* table, const T* pos, T* y, int64_t n,
                       int64_t s, int64_t h);
template <typename T>
void embedding_backward(const int32_t* tokens, const T* dy, T* dtable, T* dpos, int64_t n,
                        int64_t s, int64_t h);

struct AdamW {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};
// step counts from 1.
template <typename T>
void adamw_step(T* param, const T* grad, T* m, T* v, int64_t n, const AdamW& o, int64_t step);

}  // namespace ptdp::kernels
