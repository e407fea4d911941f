// Backend: the device a rank computes on, as the sharded model and the optimizer see it. Every
// kernel the runtime runs goes through this interface (GEMMs, the attention pieces, norms,
// activations, the element-wise glue, the optimizer and the gradient norm), so a device backend
// (the CUDA issue) implements exactly this list and nothing else of the model changes.
//
// Pointers are in the backend's memory space (host memory for the CPU backend), except token
// ids (`tokens`, `targets`), which are always host memory (the data loader's), and the MoE
// row moves' index and weight arrays, which the host computes from the routing. Shapes follow
// kernels/cpu/kernels.h and kernels/cpu/elementwise.h, whose functions are the CPU backend.
// Element types. The virtual entry points are fp32: each backend's kernels. Every kernel the
// model runs also has a typed form (below, "Typed forms") taking Ptr/CPtr (runtime/typed_ptr.h)
// for activations and weights, which are fp32 or, with mixed precision (--bf16), bf16. Weight
// gradients, statistics (norm mean and rstd, log-sum-exp, cross-entropy statistics), master
// weights and Adam states stay fp32 there. A typed call whose tensors are all fp32 is the
// virtual call; otherwise the bf16 operands are widened to fp32 temporaries in the backend's
// memory, the fp32 kernel runs, and bf16 outputs are rounded back (to nearest even): bf16
// storage, fp32 arithmetic, as Megatron's mixed precision computes. A device backend may run
// a typed call natively on bf16 instead (the native_* hooks, offered every typed call but copy
// and fill_zero, which move bytes). The CUDA backend runs each natively where every activation
// operand is bf16 (flash attention: head dimensions 64 and 128): cuBLAS GEMMs with fp32
// accumulation, the bf16 kernels of kernels/cuda/, and its own kernels loading bf16 and storing
// it rounded, fp32 in between, which compute what the widening computes without the fp32 round
// trip. The CPU backend runs natively the glue that only moves elements (split_columns3,
// concat_columns3, sequence_shard, sequence_unshard: bytes moved as they are).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "runtime/typed_ptr.h"

namespace ptdp {

struct AdamWSettings {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

// What a GPU backend says of its device, for machine files (ptdp calibrate) and messages.
struct DeviceInfo {
  std::string name;  // "NVIDIA H100 80GB HBM3"
  double memory_bytes = 0;
  double cache_bytes = 0;  // the last-level (L2) cache
  int multiprocessors = 0;
  std::string driver, runtime;  // CUDA driver and runtime versions, "12.8"
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // GEMMs. linear: y[n, out] = x[n, in] W[out, in]^T (+ b); dgrad dx = dy W (overwrites);
  // wgrad dW += dy^T x and db += column sums of dy (accumulate).
  virtual void linear_forward(const float* x, const float* w, const float* b, float* y, int64_t n,
                              int64_t in, int64_t out) = 0;
  virtual void linear_dgrad(const float* w, const float* dy, float* dx, int64_t n, int64_t in,
                            int64_t out) = 0;
  virtual void linear_wgrad(const float* x, const float* dy, float* dw, float* db, int64_t n,
                            int64_t in, int64_t out) = 0;
  // Attention with grouped queries: q [b, s, hq, d], k and v [b, s, hk, d], scores [b, hq, s, s].
  virtual void attention_scores(const float* q, const float* k, float* scores, int64_t b, int64_t s,
                                int64_t hq, int64_t hk, int64_t d) = 0;
  // dq and dk (either may be null) from d scores.
  virtual void attention_scores_backward(const float* q, const float* k, const float* dscores,
                                         float* dq, float* dk, int64_t b, int64_t s, int64_t hq,
                                         int64_t hk, int64_t d) = 0;
  virtual void causal_softmax(float* scores, int64_t rows, int64_t s) = 0;
  virtual void causal_softmax_backward(const float* probs, const float* dprobs, float* dscores,
                                       int64_t rows, int64_t s) = 0;
  virtual void attention_context(const float* probs, const float* v, float* out, int64_t b,
                                 int64_t s, int64_t hq, int64_t hk, int64_t d) = 0;
  // dprobs and dv (either may be null) from d out.
  virtual void attention_context_backward(const float* probs, const float* v, const float* dout,
                                          float* dprobs, float* dv, int64_t b, int64_t s,
                                          int64_t hq, int64_t hk, int64_t d) = 0;

  // Causal attention fused the flash-attention way (--use-flash-attn): q, out [b, sq, hq, d], k,
  // v [b, sk, hk, d] (sq <= sk), lse [b, hq, sq] the natural log of each row's softmax
  // denominator over the scores q.k / sqrt(d). The mask is aligned to the last key (query i
  // sees keys j <= i + sk - sq): sq == sk is self-attention, sq < sk the last sq queries of a
  // longer sequence (context parallelism). No s x s matrix is kept: the backward pass recomputes
  // the probabilities from lse and overwrites dq, dk and dv (dk, dv summed over the query heads of
  // a group).
  virtual void flash_attention_forward(const float* q, const float* k, const float* v, float* out,
                                       float* lse, int64_t b, int64_t sq, int64_t sk, int64_t hq,
                                       int64_t hk, int64_t d) = 0;
  virtual void flash_attention_backward(const float* q, const float* k, const float* v,
                                        const float* out, const float* lse, const float* dout,
                                        float* dq, float* dk, float* dv, int64_t b, int64_t sq,
                                        int64_t sk, int64_t hq, int64_t hk, int64_t d) = 0;

  // Norms (beta null: RMSNorm) and activations.
  virtual void norm_forward(const float* x, const float* g, const float* beta, float* y,
                            float* mean, float* rstd, int64_t n, int64_t h) = 0;
  virtual void norm_backward(const float* x, const float* g, bool has_beta, const float* mean,
                             const float* rstd, const float* dy, float* dx, float* dg, float* dbeta,
                             int64_t n, int64_t h) = 0;
  virtual void gelu(const float* x, float* y, int64_t n) = 0;
  virtual void gelu_backward(const float* x, const float* dy, float* dx, int64_t n) = 0;
  virtual void swiglu(const float* x, float* y, int64_t n, int64_t f) = 0;
  virtual void swiglu_backward(const float* x, const float* dy, float* dx, int64_t n,
                               int64_t f) = 0;
  // Rotary position embedding in place on x [b, s, heads, d]; inverse: its backward.
  virtual void rope(float* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base,
                    bool inverse) = 0;

  // Element-wise glue (kernels/cpu/elementwise.h).
  virtual void copy(const float* x, float* y, int64_t n) = 0;
  virtual void fill_zero(float* x, int64_t n) = 0;
  virtual void add(float* y, const float* x, int64_t n) = 0;
  virtual void add_bias(float* y, const float* bias, int64_t rows, int64_t width) = 0;
  virtual void bias_grad(const float* dy, float* db, int64_t rows, int64_t width) = 0;
  virtual void scale(float* x, int64_t n, double f) = 0;
  virtual void split_columns3(const float* x, float* y0, float* y1, float* y2, int64_t n, int64_t a,
                              int64_t b, int64_t c) = 0;
  virtual void concat_columns3(const float* x0, const float* x1, const float* x2, float* y,
                               int64_t n, int64_t a, int64_t b, int64_t c) = 0;
  virtual void sequence_unshard(const float* shards, float* full, int64_t t, int64_t b, int64_t s,
                                int64_t width) = 0;
  virtual void sequence_shard(const float* full, float* shards, int64_t t, int64_t b, int64_t s,
                              int64_t width) = 0;
  virtual void vocab_embedding_lookup(const int32_t* tokens, const float* table, float* y,
                                      int64_t n, int64_t h, int64_t v0, int64_t vl) = 0;
  virtual void vocab_embedding_grad(const int32_t* tokens, const float* dy, float* dtable,
                                    int64_t n, int64_t h, int64_t v0, int64_t vl) = 0;
  virtual void add_positions(float* x, const float* pos, int64_t b, int64_t sl, int64_t h,
                             int64_t first) = 0;
  virtual void position_grad(const float* dx, float* dpos, int64_t b, int64_t sl, int64_t h,
                             int64_t first) = 0;
  virtual void cross_entropy_stats(const float* logits, const int32_t* targets, float* stats,
                                   int64_t n, int64_t vl, int64_t valid, int64_t v0) = 0;
  virtual double cross_entropy_finish(const float* stats, int64_t ranks, float* logits, float* lse,
                                      int64_t n, int64_t vl, int64_t valid) = 0;
  virtual void cross_entropy_backward(float* probs, const int32_t* targets, int64_t n, int64_t vl,
                                      int64_t v0, double scale) = 0;

  // The MoE layer's row moves (runtime/moe_layer.h; the CPU forms in kernels/cpu/moe.h): rows
  // of width h, all of one type, fp32 or bf16 (loaded as fp32, stored rounded), driven by
  // `index` and `weight` arrays the host computes from the routing, in host memory like token
  // ids (weight null: 1; index -1: skipped). gather_rows: y[r] = weight[r] x[index[r]];
  // gather_add_rows: out[i] += weight[i k + j] y[index[i k + j]] for j = 0 .. k - 1 in order,
  // summed in fp32 and rounded once; row_dots: dot[r] = <a[index[r]], b[r]> (fp32).
  virtual void gather_rows(CPtr x, const int64_t* index, const float* weight, Ptr y, int64_t rows,
                           int64_t h) = 0;
  virtual void gather_add_rows(CPtr y, const int64_t* index, const float* weight, Ptr out,
                               int64_t n, int64_t k, int64_t h) = 0;
  virtual void row_dots(CPtr a, const int64_t* index, CPtr b, float* dot, int64_t rows,
                        int64_t h) = 0;

  // Optimizer and gradient norm.
  // acc + the sum of squares of x, accumulated in double in index order.
  virtual double sum_squares(const float* x, int64_t n, double acc) = 0;
  // step counts from 1.
  virtual void adamw(float* param, const float* grad, float* m, float* v, int64_t n,
                     const AdamWSettings& o, int64_t step) = 0;
  // One optimizer update of [n] parameters: the gradient times grad_scale (unscaling and
  // clipping; 1 leaves it), AdamW on the fp32 weights w, then, unless copy_to is null, the new
  // weights copied into copy_to in its type (the model's bf16 weights under mixed precision).
  // The default is those three calls, which leave the gradient scaled; a device backend fuses
  // them into one pass, which leaves it as it was (the next step zeroes it either way).
  virtual void adamw_update(float* w, float* grad, float* m, float* v, Ptr copy_to, int64_t n,
                            const AdamWSettings& o, int64_t step, double grad_scale);
  // Elements [start, start + n) of an update's arrays, with o.weight_decay or with none.
  struct DecaySpan {
    int64_t start = 0, n = 0;
    bool decay = false;
  };
  // adamw_update over parameters adjacent in every array (w, grad, m, v, copy_to) whose weight
  // decay differs span by span: the default is one adamw_update a span; a device backend makes
  // one launch for them all (a model's weights and biases alternate along its parameters, so
  // runs of one decay are short: some 100 a GPT-2-124M step).
  virtual void adamw_update_spans(float* w, float* grad, float* m, float* v, Ptr copy_to,
                                  const std::vector<DecaySpan>& spans, const AdamWSettings& o,
                                  int64_t step, double grad_scale);

  // Memory in the backend's space: zero-filled, counted towards the run's peak memory
  // (runtime/tensor.h's MemoryCounter), 64-byte aligned.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  // Memory (or bytes of it) that the caller writes in full before reading
  // (Buffer::resize_for_overwrite): counted like allocate's, but not zeroed. A GPU backend skips
  // the memset; the host backends fill it with 0xFF bytes, a NaN in fp32, bf16 and fp16, so a
  // read before the write turns a CPU test's losses into NaN.
  virtual void* allocate_for_overwrite(size_t bytes) { return allocate(bytes); }
  virtual void poison_bytes(void* p, size_t bytes) { (void)p, (void)bytes; }
  // Copies between host memory and the backend's.
  virtual void upload(const void* host, void* device, size_t bytes) = 0;
  virtual void download(const void* device, void* host, size_t bytes) = 0;
  // Whether host code may read and write the backend's memory directly (the CPU backend).
  virtual bool host_accessible() const = 0;
  // Whether p points into the backend's own (not host-accessible) memory. Host pointers handed
  // to a communicator beside device ones (a norm's partial sum) answer false.
  virtual bool device_pointer(const void* p) const {
    (void)p;
    return false;
  }
  // Writes [p, p + bytes) of memory the backend's kernels read back to memory and drops it from
  // every cache level, as other data passing through would (calibration's cold timings). False
  // where the backend cannot; the caller then streams other data through the caches instead.
  virtual bool flush_from_caches(const void* p, size_t bytes) {
    (void)p, (void)bytes;
    return false;
  }

  // Bytes within the backend's memory, and zero bytes (any element type).
  virtual void copy_bytes(const void* from, void* to, size_t bytes) = 0;
  virtual void zero_bytes(void* p, size_t bytes) = 0;
  // n elements of type `from_type` converted to `to_type` (fp32 and bf16; rounding to nearest
  // even into bf16).
  virtual void convert(const void* from, DType from_type, void* to, DType to_type, int64_t n) = 0;

  // Waits for all work queued on this backend (a no-op where kernels run synchronously).
  virtual void synchronize() = 0;

  // Timestamps in the backend's own queue, for timing ops without synchronising after each
  // (runtime/op_timer.h): record_mark() queues a marker after the work queued so far and returns
  // it; once synchronize() has returned, mark_seconds(a, b) is the time between two markers.
  // release_mark frees one. Backends whose kernels run as they are called return null markers,
  // and callers read a host clock instead.
  virtual void* record_mark() { return nullptr; }
  virtual double mark_seconds(void* /*from*/, void* /*to*/) { return 0.0; }
  virtual void release_mark(void* /*mark*/) {}

  // A GPU backend's device index and the stream its work is queued on (a cudaStream_t), which a
  // device data plane orders its operations after (runtime/data_plane.h); -1 and null elsewhere.
  virtual int device_index() const { return -1; }
  virtual void* native_stream() const { return nullptr; }
  // A GPU backend's device; an empty name for host backends.
  virtual DeviceInfo device_info() const { return {}; }
  // About how many fp32 elements the widened temporaries of one block of a row-independent
  // typed call may take (runtime/mixed_precision.cc): 2^18 (1 MiB) by default; a GPU backend
  // takes larger blocks, fewer launches.
  virtual int64_t widen_block_elements() const { return int64_t{1} << 18; }

  // --- Typed forms (runtime/mixed_precision.cc): the entry points above for fp32 or bf16
  // activations and weights, with the same shapes. Outputs are overwritten except where the
  // fp32 form accumulates (weight and bias gradients, fp32 only); in-place operands (Ptr of
  // rope, add, scale, ...) are read and written.
  void linear_forward(CPtr x, CPtr w, CPtr b, Ptr y, int64_t n, int64_t in, int64_t out);
  void linear_dgrad(CPtr w, CPtr dy, Ptr dx, int64_t n, int64_t in, int64_t out);
  void linear_wgrad(CPtr x, CPtr dy, float* dw, float* db, int64_t n, int64_t in, int64_t out);
  void attention_scores(CPtr q, CPtr k, Ptr scores, int64_t b, int64_t s, int64_t hq, int64_t hk,
                        int64_t d);
  void attention_scores_backward(CPtr q, CPtr k, CPtr dscores, Ptr dq, Ptr dk, int64_t b, int64_t s,
                                 int64_t hq, int64_t hk, int64_t d);
  void causal_softmax(Ptr scores, int64_t rows, int64_t s);
  void causal_softmax_backward(CPtr probs, CPtr dprobs, Ptr dscores, int64_t rows, int64_t s);
  void attention_context(CPtr probs, CPtr v, Ptr out, int64_t b, int64_t s, int64_t hq, int64_t hk,
                         int64_t d);
  void attention_context_backward(CPtr probs, CPtr v, CPtr dout, Ptr dprobs, Ptr dv, int64_t b,
                                  int64_t s, int64_t hq, int64_t hk, int64_t d);
  void flash_attention_forward(CPtr q, CPtr k, CPtr v, Ptr out, float* lse, int64_t b, int64_t sq,
                               int64_t sk, int64_t hq, int64_t hk, int64_t d);
  void flash_attention_backward(CPtr q, CPtr k, CPtr v, CPtr out, const float* lse, CPtr dout,
                                Ptr dq, Ptr dk, Ptr dv, int64_t b, int64_t sq, int64_t sk,
                                int64_t hq, int64_t hk, int64_t d);
  void norm_forward(CPtr x, CPtr g, CPtr beta, Ptr y, float* mean, float* rstd, int64_t n,
                    int64_t h);
  void norm_backward(CPtr x, CPtr g, bool has_beta, const float* mean, const float* rstd, CPtr dy,
                     Ptr dx, float* dg, float* dbeta, int64_t n, int64_t h);
  // norm_backward whose input gradient is added to dacc (the residual stream's gradient, which
  // reaches the norm's input from above), not written. The default is norm_backward into a
  // temporary of dacc's type, then add; a device backend fuses the two (the CUDA backend's bf16
  // kernel adds dacc before it rounds, so once where the two calls round twice).
  void norm_backward_add(CPtr x, CPtr g, bool has_beta, const float* mean, const float* rstd,
                         CPtr dy, Ptr dacc, float* dg, float* dbeta, int64_t n, int64_t h);
  void gelu(CPtr x, Ptr y, int64_t n);
  void gelu_backward(CPtr x, CPtr dy, Ptr dx, int64_t n);
  // gelu_backward over rows of `width`, then db (fp32; null: none) += dx's column sums, as
  // bias_grad adds them. The default is those two calls; the CUDA backend's bf16 kernel does
  // both in one pass, summing dx before it rounds it.
  void gelu_backward_bias_grad(CPtr x, CPtr dy, Ptr dx, float* db, int64_t rows, int64_t width);
  void swiglu(CPtr x, Ptr y, int64_t n, int64_t f);
  void swiglu_backward(CPtr x, CPtr dy, Ptr dx, int64_t n, int64_t f);
  void rope(Ptr x, int64_t b, int64_t s, int64_t heads, int64_t d, double base, bool inverse);
  // copy converts when the types differ.
  void copy(CPtr x, Ptr y, int64_t n);
  void fill_zero(Ptr x, int64_t n);
  void add(Ptr y, CPtr x, int64_t n);
  void add_bias(Ptr y, CPtr bias, int64_t rows, int64_t width);
  // out [rows, width] = residual + partial, then + bias (may be null) over each row: a
  // transformer layer's bias-add-residual, computed as copy, add and add_bias compute it (each
  // sum rounded to out's type). A device backend does it in one pass (native_residual_add),
  // where the three calls moved the stream seven times. out may alias residual or partial.
  void residual_add(Ptr out, CPtr residual, CPtr partial, CPtr bias, int64_t rows, int64_t width);
  void bias_grad(CPtr dy, float* db, int64_t rows, int64_t width);
  // residual_add's backward: dout [rows, width] copied to d_residual and to d_partial, and db
  // (fp32; null: none) += its column sums, as bias_grad and two copies give them. A device
  // backend reads dout once (native_residual_add_backward).
  void residual_add_backward(CPtr dout, Ptr d_residual, Ptr d_partial, float* db, int64_t rows,
                             int64_t width);
  void scale(Ptr x, int64_t n, double f);
  void split_columns3(CPtr x, Ptr y0, Ptr y1, Ptr y2, int64_t n, int64_t a, int64_t b, int64_t c);
  void concat_columns3(CPtr x0, CPtr x1, CPtr x2, Ptr y, int64_t n, int64_t a, int64_t b,
                       int64_t c);
  void sequence_unshard(CPtr shards, Ptr full, int64_t t, int64_t b, int64_t s, int64_t width);
  void sequence_shard(CPtr full, Ptr shards, int64_t t, int64_t b, int64_t s, int64_t width);
  void vocab_embedding_lookup(const int32_t* tokens, CPtr table, Ptr y, int64_t n, int64_t h,
                              int64_t v0, int64_t vl);
  void vocab_embedding_grad(const int32_t* tokens, CPtr dy, float* dtable, int64_t n, int64_t h,
                            int64_t v0, int64_t vl);
  void add_positions(Ptr x, CPtr pos, int64_t b, int64_t sl, int64_t h, int64_t first);
  void position_grad(CPtr dx, float* dpos, int64_t b, int64_t sl, int64_t h, int64_t first);
  void cross_entropy_stats(CPtr logits, const int32_t* targets, float* stats, int64_t n, int64_t vl,
                           int64_t valid, int64_t v0);
  double cross_entropy_finish(const float* stats, int64_t ranks, Ptr logits, float* lse, int64_t n,
                              int64_t vl, int64_t valid);
  void cross_entropy_backward(Ptr probs, const int32_t* targets, int64_t n, int64_t vl, int64_t v0,
                              double scale);
  // cross_entropy_finish and, later, cross_entropy_backward, as a pair whose first half a backend
  // may run without turning the logits into probabilities: the second then computes them from
  // the logits and lse in the gradient's own pass (the CUDA backend on bf16 logits: two passes
  // over the logits fewer, the same bits). Nothing may read the buffer between the two. Where
  // the backend does not, they are those two calls.
  double cross_entropy_loss(const float* stats, int64_t ranks, Ptr logits, float* lse, int64_t n,
                            int64_t vl, int64_t valid);
  void cross_entropy_backward_from_lse(Ptr logits, const float* lse, const int32_t* targets,
                                       int64_t n, int64_t vl, int64_t valid, int64_t v0,
                                       double scale);

 protected:
  // A typed GEMM with a bf16 operand, offered to the backend before widening: true when it ran
  // it natively. The default runs nothing.
  virtual bool native_linear_forward(CPtr x, CPtr w, CPtr b, Ptr y, int64_t n, int64_t in,
                                     int64_t out) {
    (void)x, (void)w, (void)b, (void)y, (void)n, (void)in, (void)out;
    return false;
  }
  virtual bool native_linear_dgrad(CPtr w, CPtr dy, Ptr dx, int64_t n, int64_t in, int64_t out) {
    (void)w, (void)dy, (void)dx, (void)n, (void)in, (void)out;
    return false;
  }
  virtual bool native_linear_wgrad(CPtr x, CPtr dy, float* dw, float* db, int64_t n, int64_t in,
                                   int64_t out) {
    (void)x, (void)dy, (void)dw, (void)db, (void)n, (void)in, (void)out;
    return false;
  }
  // The same for the fused attention, the norms and the activations (the CUDA backend's bf16
  // kernels of kernels/cuda/), with the typed forms' arguments.
  virtual bool native_flash_attention_forward(CPtr, CPtr, CPtr, Ptr, float*, int64_t, int64_t,
                                              int64_t, int64_t, int64_t, int64_t) {
    return false;
  }
  virtual bool native_flash_attention_backward(CPtr, CPtr, CPtr, CPtr, const float*, CPtr, Ptr, Ptr,
                                               Ptr, int64_t, int64_t, int64_t, int64_t, int64_t,
                                               int64_t) {
    return false;
  }
  virtual bool native_norm_forward(CPtr, CPtr, CPtr, Ptr, float*, float*, int64_t, int64_t) {
    return false;
  }
  virtual bool native_norm_backward(CPtr, CPtr, bool, const float*, const float*, CPtr, Ptr, float*,
                                    float*, int64_t, int64_t) {
    return false;
  }
  virtual bool native_norm_backward_add(CPtr, CPtr, bool, const float*, const float*, CPtr, Ptr,
                                        float*, float*, int64_t, int64_t) {
    return false;
  }
  virtual bool native_gelu(CPtr, Ptr, int64_t) { return false; }
  virtual bool native_gelu_backward(CPtr, CPtr, Ptr, int64_t) { return false; }
  virtual bool native_gelu_backward_bias_grad(CPtr, CPtr, Ptr, float*, int64_t, int64_t) {
    return false;
  }
  virtual bool native_swiglu(CPtr, Ptr, int64_t, int64_t) { return false; }
  virtual bool native_swiglu_backward(CPtr, CPtr, Ptr, int64_t, int64_t) { return false; }
  // The same for the unfused attention pieces, the rotary embedding, the element-wise glue, the
  // embedding and the cross-entropy (the CUDA backend's kernels on bf16 storage, fp32 inside).
  // cross_entropy_finish returns its loss through the last argument.
  virtual bool native_attention_scores(CPtr, CPtr, Ptr, int64_t, int64_t, int64_t, int64_t,
                                       int64_t) {
    return false;
  }
  virtual bool native_attention_scores_backward(CPtr, CPtr, CPtr, Ptr, Ptr, int64_t, int64_t,
                                                int64_t, int64_t, int64_t) {
    return false;
  }
  virtual bool native_causal_softmax(Ptr, int64_t, int64_t) { return false; }
  virtual bool native_causal_softmax_backward(CPtr, CPtr, Ptr, int64_t, int64_t) { return false; }
  virtual bool native_attention_context(CPtr, CPtr, Ptr, int64_t, int64_t, int64_t, int64_t,
                                        int64_t) {
    return false;
  }
  virtual bool native_attention_context_backward(CPtr, CPtr, CPtr, Ptr, Ptr, int64_t, int64_t,
                                                 int64_t, int64_t, int64_t) {
    return false;
  }
  virtual bool native_rope(Ptr, int64_t, int64_t, int64_t, int64_t, double, bool) { return false; }
  virtual bool native_add(Ptr, CPtr, int64_t) { return false; }
  virtual bool native_add_bias(Ptr, CPtr, int64_t, int64_t) { return false; }
  // residual_add in one call, for any operand types (fp32 ones too).
  virtual bool native_residual_add(Ptr, CPtr, CPtr, CPtr, int64_t, int64_t) { return false; }
  virtual bool native_bias_grad(CPtr, float*, int64_t, int64_t) { return false; }
  virtual bool native_residual_add_backward(CPtr, Ptr, Ptr, float*, int64_t, int64_t) {
    return false;
  }
  virtual bool native_scale(Ptr, int64_t, double) { return false; }
  virtual bool native_split_columns3(CPtr, Ptr, Ptr, Ptr, int64_t, int64_t, int64_t, int64_t) {
    return false;
  }
  virtual bool native_concat_columns3(CPtr, CPtr, CPtr, Ptr, int64_t, int64_t, int64_t, int64_t) {
    return false;
  }
  virtual bool native_sequence_unshard(CPtr, Ptr, int64_t, int64_t, int64_t, int64_t) {
    return false;
  }
  virtual bool native_sequence_shard(CPtr, Ptr, int64_t, int64_t, int64_t, int64_t) {
    return false;
  }
  virtual bool native_vocab_embedding_lookup(const int32_t*, CPtr, Ptr, int64_t, int64_t, int64_t,
                                             int64_t) {
    return false;
  }
  virtual bool native_vocab_embedding_grad(const int32_t*, CPtr, float*, int64_t, int64_t, int64_t,
                                           int64_t) {
    return false;
  }
  virtual bool native_add_positions(Ptr, CPtr, int64_t, int64_t, int64_t, int64_t) { return false; }
  virtual bool native_position_grad(CPtr, float*, int64_t, int64_t, int64_t, int64_t) {
    return false;
  }
  virtual bool native_cross_entropy_stats(CPtr, const int32_t*, float*, int64_t, int64_t, int64_t,
                                          int64_t) {
    return false;
  }
  virtual bool native_cross_entropy_finish(const float*, int64_t, Ptr, float*, int64_t, int64_t,
                                           int64_t, double& loss) {
    (void)loss;
    return false;
  }
  virtual bool native_cross_entropy_backward(Ptr, const int32_t*, int64_t, int64_t, int64_t,
                                             double) {
    return false;
  }
  // The deferred pair (cross_entropy_loss, cross_entropy_backward_from_lse): a backend answers
  // both alike for a buffer of a type.
  virtual bool native_cross_entropy_loss(const float*, int64_t, Ptr, float*, int64_t,
                                         double& loss) {
    (void)loss;
    return false;
  }
  virtual bool native_cross_entropy_backward_from_lse(Ptr, const float*, const int32_t*, int64_t,
                                                      int64_t, int64_t, int64_t, double) {
    return false;
  }
};

// "cpu" (Eigen and the reference kernels), or "cuda" (runtime/cuda/cuda_backend.h) in a build
// with CUDA. "cpu-staged" is the CPU backend acting as a device whose memory host code may not
// touch (for testing the CUDA backend's host-side paths without a GPU). Any other name, "cuda" in a
// build without it, or "cuda" with no GPU visible: an InputError naming --backend.
std::unique_ptr<Backend> make_backend(std::string_view name);

// The element type of a row move's operands (Backend::gather_rows and friends): true for bf16,
// false for fp32; a std::logic_error for operands of different types or of another type.
bool row_moves_bf16(std::initializer_list<DType> types);

// Backend::convert on host memory (the CPU backend's, and host staging elsewhere).
void convert_on_host(const void* from, DType from_type, void* to, DType to_type, int64_t n);

// n fp32 values on the host into `to` (the backend's memory), converted to its element type;
// and the n elements at `from` back to fp32 values on the host.
void upload_floats(Backend& be, const float* host, Ptr to, int64_t n);
void download_floats(Backend& be, CPtr from, float* host, int64_t n);

// How the CUDA backend's fp32 GEMMs compute: PTDP_CUDA_MATH, "fp32" (default), "tf32" or "bf16"
// (the inputs rounded for the tensor cores, fp32 accumulation and storage); PTDP_CUDA_TF32=1,
// the older switch, means "tf32". Any other value: an InputError naming PTDP_CUDA_MATH.
std::string cuda_math();

// The backend as machine files and traces name it: `name`, with the GEMM arithmetic added for
// cuda when it is not fp32 ("cuda/bf16"), since that changes what every GEMM costs (ptdp
// reconcile refuses a machine file measured with other arithmetic than the run's).
std::string backend_label(std::string_view name);

}  // namespace ptdp
