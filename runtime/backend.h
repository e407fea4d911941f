// Backend: the device a rank computes on, as the sharded model and the optimizer see it. Every
// kernel the runtime runs goes through this interface (GEMMs, the attention pieces, norms,
// activations, the element-wise glue, the optimizer and the gradient norm), so a device backend
// (the CUDA issue) implements exactly this list and nothing else of the model changes.
//
// Pointers are in the backend's memory space (host memory for the CPU backend), except token
// ids (`tokens`, `targets`), which are always host memory: the data loader's. Shapes follow
// kernels/cpu/kernels.h and kernels/cpu/elementwise.h, whose functions are the CPU backend.
// Element type: fp32 throughout for now (the CPU backend's activations, weights and gradients);
// the op list states the type each op runs in (core/layer_ops.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

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

  // Causal attention fused the flash-attention way (--use-flash-attn): q, out [b, s, hq, d], k,
  // v [b, s, hk, d], lse [b, hq, s] the natural log of each row's softmax denominator over the
  // scores q.k / sqrt(d). No s x s matrix is kept: the backward pass recomputes the probabilities
  // from lse and overwrites dq, dk and dv (dk, dv summed over the query heads of a group).
  virtual void flash_attention_forward(const float* q, const float* k, const float* v, float* out,
                                       float* lse, int64_t b, int64_t s, int64_t hq, int64_t hk,
                                       int64_t d) = 0;
  virtual void flash_attention_backward(const float* q, const float* k, const float* v,
                                        const float* out, const float* lse, const float* dout,
                                        float* dq, float* dk, float* dv, int64_t b, int64_t s,
                                        int64_t hq, int64_t hk, int64_t d) = 0;

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

  // Optimizer and gradient norm.
  // acc + the sum of squares of x, accumulated in double in index order.
  virtual double sum_squares(const float* x, int64_t n, double acc) = 0;
  // step counts from 1.
  virtual void adamw(float* param, const float* grad, float* m, float* v, int64_t n,
                     const AdamWSettings& o, int64_t step) = 0;

  // Memory in the backend's space: zero-filled, counted towards the run's peak memory
  // (runtime/tensor.h's MemoryCounter), 64-byte aligned.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
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

  // Waits for all work queued on this backend (a no-op where kernels run synchronously).
  virtual void synchronize() = 0;

  // A GPU backend's device index and the stream its work is queued on (a cudaStream_t), which a
  // device data plane orders its operations after (runtime/data_plane.h); -1 and null elsewhere.
  virtual int device_index() const { return -1; }
  virtual void* native_stream() const { return nullptr; }
  // A GPU backend's device; an empty name for host backends.
  virtual DeviceInfo device_info() const { return {}; }
};

// "cpu" (Eigen and the reference kernels), or "cuda" (runtime/cuda/cuda_backend.h) in a build
// with CUDA. "cpu-staged" is the CPU backend acting as a device whose memory host code may not
// touch (for testing the CUDA backend's host-side paths without a GPU). Any other name, "cuda" in a
// build without it, or "cuda" with no GPU visible: an InputError naming --backend.
std::unique_ptr<Backend> make_backend(std::string_view name);

// How the CUDA backend's fp32 GEMMs compute: PTDP_CUDA_MATH, "fp32" (default), "tf32" or "bf16"
// (the inputs rounded for the tensor cores, fp32 accumulation and storage); PTDP_CUDA_TF32=1,
// the older switch, means "tf32". Any other value: an InputError naming PTDP_CUDA_MATH.
std::string cuda_math();

// The backend as machine files and traces name it: `name`, with the GEMM arithmetic added for
// cuda when it is not fp32 ("cuda/bf16"), since that changes what every GEMM costs (ptdp
// reconcile refuses a machine file measured with other arithmetic than the run's).
std::string backend_label(std::string_view name);

}  // namespace ptdp
