#include "runtime/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/activation.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/common.h"
#include "kernels/cuda/norm.h"
#include "runtime/cuda/fp32_kernels.h"
#include "runtime/tensor.h"

namespace ptdp {
namespace {

namespace k = cuda_fp32;
namespace kc = kernels::cuda;  // the bf16 kernels

bool all_bf16(std::initializer_list<CPtr> xs) {
  for (const CPtr& x : xs)
    if (x.t != DType::kBF16) return false;
  return true;
}
const kc::bf16* b16(CPtr x) {
  return static_cast<const kc::bf16*>(x.p);
}
kc::bf16* b16(Ptr x) {
  return static_cast<kc::bf16*>(x.p);
}

using kernels::cuda::check;  // cudaError_t
void check(cublasStatus_t e, const char* what) {
  if (e != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(e));
}
#define PTDP_CHECK(call) check((call), #call)

int local_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"})
    if (const char* v = std::getenv(name)) return std::atoi(v);
  return 0;
}

// How the fp32 GEMMs compute (cuda_math(), runtime/backend.h): fp32 products as the CPU
// backend, or the inputs rounded to TF32 or bf16 inside cuBLAS for the tensor cores.
cublasComputeType_t gemm_compute_type() {
  const std::string m = cuda_math();
  if (m == "tf32") return CUBLAS_COMPUTE_32F_FAST_TF32;
  if (m == "bf16") return CUBLAS_COMPUTE_32F_FAST_16BF;
  return CUBLAS_COMPUTE_32F;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend() : compute_(gemm_compute_type()) {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0)
      throw InputError("--backend", std::string("cuda: no CUDA device visible (") +
                                        (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") +
                                        ")");
    device_ = local_rank() % count;
    PTDP_CHECK(cudaSetDevice(device_));
    // A blocking stream: it also orders against the legacy default stream.
    PTDP_CHECK(cudaStreamCreate(&stream_));
    PTDP_CHECK(cublasCreate(&blas_));
    PTDP_CHECK(cublasSetStream(blas_, stream_));
    PTDP_CHECK(cudaMalloc(&scratch_, kScratchBytes));
    set_buffer_space(this);
  }
  ~CudaBackend() override {
    if (buffer_space() == this) set_buffer_space(nullptr);
    cudaStreamSynchronize(stream_);
    cudaFree(scratch_);
    cudaFree(tokens_);
    cublasDestroy(blas_);
    cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "cuda"; }

  // ---- GEMMs, row-major, through cuBLAS's column-major calls: row-major C = op(A) op(B) is
  // column-major C^T = op(B)^T op(A)^T, so A and B swap places and keep their transposes.
  // Batched with fixed strides between the matrices of a batch.
  struct Mat {
    const void* p;
    int64_t ld, stride;
    bool trans;
    cudaDataType t = CUDA_R_32F;
  };
  // C (of type ct) = alpha op(A) op(B) + beta C. fp32 operands compute as PTDP_CUDA_MATH says;
  // bf16 ones (mixed precision) in fp32 on the tensor cores.
  void gemm(int64_t m, int64_t n, int64_t kk, float alpha, Mat a, Mat b, float beta, void* c,
            int64_t ldc, int64_t stride_c, int64_t batch, cudaDataType ct = CUDA_R_32F) {
    if (m <= 0 || n <= 0 || batch <= 0) return;
    const size_t elem = ct == CUDA_R_32F ? sizeof(float) : 2;
    if (kk <= 0) {  // an empty sum: C = beta C
      if (beta == 0.0f)
        for (int64_t i = 0; i < batch; ++i)
          PTDP_CHECK(cudaMemset2DAsync(static_cast<char*>(c) + i * stride_c * elem, ldc * elem, 0,
                                       n * elem, m, stream_));
      return;
    }
    auto i32 = [](int64_t v) {
      if (v > 2147483647) throw std::invalid_argument("a GEMM dimension above 2^31");
      return static_cast<int>(v);
    };
    const bool f32 = a.t == CUDA_R_32F && b.t == CUDA_R_32F && ct == CUDA_R_32F;
    PTDP_CHECK(cublasGemmStridedBatchedEx(
        blas_, b.trans ? CUBLAS_OP_T : CUBLAS_OP_N, a.trans ? CUBLAS_OP_T : CUBLAS_OP_N, i32(n),
        i32(m), i32(kk), &alpha, b.p, b.t, i32(b.ld), b.stride, a.p, a.t, i32(a.ld), a.stride,
        &beta, c, ct, i32(ldc), stride_c, i32(batch), f32 ? compute_ : CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT));
  }

  void linear_forward(const float* x, const float* w, const float* bias, float* y, int64_t n,
                      int64_t in, int64_t out) override {
    gemm(n, out, in, 1.0f, {x, in, 0, false}, {w, in, 0, true}, 0.0f, y, out, 0, 1);
    if (bias) k::add_bias(y, bias, n, out, stream_);
  }
  void linear_dgrad(const float* w, const float* dy, float* dx, int64_t n, int64_t in,
                    int64_t out) override {
    gemm(n, in, out, 1.0f, {dy, out, 0, false}, {w, in, 0, false}, 0.0f, dx, in, 0, 1);
  }
  void linear_wgrad(const float* x, const float* dy, float* dw, float* db, int64_t n, int64_t in,
                    int64_t out) override {
    gemm(out, in, n, 1.0f, {dy, out, 0, true}, {x, in, 0, false}, 1.0f, dw, in, 0, 1);
    if (db) k::bias_grad(dy, db, n, out, stream_);
  }

  // Mixed precision: GEMMs whose operands are all bf16 run natively (bf16 in, fp32 accumulation,
  // bf16 out; weight gradients accumulate into fp32). The bias add and bias gradient go through
  // the widening typed forms.
  static bool bf16(CPtr x) { return x.t == DType::kBF16; }
  bool native_linear_forward(CPtr x, CPtr w, CPtr b, Ptr y, int64_t n, int64_t in,
                             int64_t out) override {
    if (!bf16(x) || !bf16(w) || !bf16(y) || (b && !bf16(b))) return false;
    gemm(n, out, in, 1.0f, {x.p, in, 0, false, CUDA_R_16BF}, {w.p, in, 0, true, CUDA_R_16BF}, 0.0f,
         y.p, out, 0, 1, CUDA_R_16BF);
    if (b) Backend::add_bias(y, b, n, out);
    return true;
  }
  bool native_linear_dgrad(CPtr w, CPtr dy, Ptr dx, int64_t n, int64_t in, int64_t out) override {
    if (!bf16(w) || !bf16(dy) || !bf16(dx)) return false;
    gemm(n, in, out, 1.0f, {dy.p, out, 0, false, CUDA_R_16BF}, {w.p, in, 0, false, CUDA_R_16BF},
         0.0f, dx.p, in, 0, 1, CUDA_R_16BF);
    return true;
  }
  bool native_linear_wgrad(CPtr x, CPtr dy, float* dw, float* db, int64_t n, int64_t in,
                           int64_t out) override {
    if (!bf16(x) || !bf16(dy)) return false;
    gemm(out, in, n, 1.0f, {dy.p, out, 0, true, CUDA_R_16BF}, {x.p, in, 0, false, CUDA_R_16BF},
         1.0f, dw, in, 0, 1);
    if (db) Backend::bias_grad(dy, db, n, out);
    return true;
  }

  // The bf16 kernels of kernels/cuda/ where every operand is bf16 (the statistics fp32): flash
  // attention for head dimensions 64 and 128, LayerNorm and RMSNorm (the fused kernels with no
  // residual), GELU (with no bias) and SwiGLU. Anything else is widened.
  bool native_flash_attention_forward(CPtr q, CPtr kk, CPtr v, Ptr out, float* lse, int64_t b,
                                      int64_t s, int64_t hq, int64_t hk, int64_t d) override {
    if (!all_bf16({q, kk, v, out}) || (d != 64 && d != 128)) return false;
    kc::flash_attention_forward(b16(q), b16(kk), b16(v), b16(out), lse, b, s, hq, hk, d, stream_);
    return true;
  }
  bool native_flash_attention_backward(CPtr q, CPtr kk, CPtr v, CPtr out, const float* lse,
                                       CPtr dout, Ptr dq, Ptr dk, Ptr dv, int64_t b, int64_t s,
                                       int64_t hq, int64_t hk, int64_t d) override {
    if (!all_bf16({q, kk, v, out, dout, dq, dk, dv}) || (d != 64 && d != 128)) return false;
    kc::flash_attention_backward(b16(q), b16(kk), b16(v), b16(out), lse, b16(dout), b16(dq),
                                 b16(dk), b16(dv), b, s, hq, hk, d, stream_);
    return true;
  }
  bool native_norm_forward(CPtr x, CPtr g, CPtr beta, Ptr y, float* mean, float* rstd, int64_t n,
                           int64_t h) override {
    if (!all_bf16({x, g, y}) || (beta && !all_bf16({beta}))) return false;
    constexpr float kEps = 1e-5f;  // the CPU kernels' default
    if (beta)
      kc::add_layernorm_forward(b16(x), nullptr, nullptr, b16(g), b16(beta), b16(y), mean, rstd, n,
                                h, kEps, stream_);
    else
      kc::add_rmsnorm_forward(b16(x), nullptr, nullptr, b16(g), b16(y), rstd, n, h, kEps, stream_);
    return true;
  }
  bool native_norm_backward(CPtr x, CPtr g, bool has_beta, const float* mean, const float* rstd,
                            CPtr dy, Ptr dx, float* dg, float* dbeta, int64_t n,
                            int64_t h) override {
    if (!all_bf16({x, g, dy, dx})) return false;
    if (has_beta)
      kc::add_layernorm_backward(b16(x), b16(g), mean, rstd, b16(dy), nullptr, b16(dx), dg, dbeta,
                                 n, h, stream_);
    else
      kc::add_rmsnorm_backward(b16(x), b16(g), rstd, b16(dy), nullptr, b16(dx), dg, n, h, stream_);
    return true;
  }
  bool native_gelu(CPtr x, Ptr y, int64_t n) override {
    if (!all_bf16({x, y})) return false;
    kc::bias_gelu_forward(b16(x), nullptr, b16(y), 1, n, stream_);
    return true;
  }
  bool native_gelu_backward(CPtr x, CPtr dy, Ptr dx, int64_t n) override {
    if (!all_bf16({x, dy, dx})) return false;
    kc::bias_gelu_backward(b16(x), nullptr, b16(dy), b16(dx), nullptr, 1, n, stream_);
    return true;
  }
  bool native_swiglu(CPtr x, Ptr y, int64_t n, int64_t f) override {
    if (!all_bf16({x, y})) return false;
    kc::swiglu_forward(b16(x), b16(y), n, f, stream_);
    return true;
  }
  bool native_swiglu_backward(CPtr x, CPtr dy, Ptr dx, int64_t n, int64_t f) override {
    if (!all_bf16({x, dy, dx})) return false;
    kc::swiglu_backward(b16(x), b16(dy), b16(dx), n, f, stream_);
    return true;
  }

  // Attention: query head hi = g * per + j reads key/value head g. For each batch element and
  // each j, one batched call covers the hk heads g (strides: per heads of q, one of k and v).
  void attention_scores(const float* q, const float* kk, float* scores, int64_t b, int64_t s,
                        int64_t hq, int64_t hk, int64_t d) override {
    const int64_t per = hq / hk;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t j = 0; j < per; ++j)
        gemm(s, s, d, scale, {q + (bi * s * hq + j) * d, hq * d, per * d, false},
             {kk + bi * s * hk * d, hk * d, d, true}, 0.0f, scores + (bi * hq + j) * s * s, s,
             per * s * s, hk);
    k::zero_upper(scores, b * hq, s, stream_);
  }
  void attention_scores_backward(const float* q, const float* kk, const float* dscores, float* dq,
                                 float* dk, int64_t b, int64_t s, int64_t hq, int64_t hk,
                                 int64_t d) override {
    const int64_t per = hq / hk;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    if (dk) fill_zero(dk, b * s * hk * d);
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t j = 0; j < per; ++j) {
        const Mat ds{dscores + (bi * hq + j) * s * s, s, per * s * s, false};
        if (dq)
          gemm(s, d, s, scale, ds, {kk + bi * s * hk * d, hk * d, d, false}, 0.0f,
               dq + (bi * s * hq + j) * d, hq * d, per * d, hk);
        if (dk)
          gemm(s, d, s, scale, {ds.p, s, per * s * s, true},
               {q + (bi * s * hq + j) * d, hq * d, per * d, false}, 1.0f, dk + bi * s * hk * d,
               hk * d, d, hk);
      }
  }
  void causal_softmax(float* scores, int64_t rows, int64_t s) override {
    k::causal_softmax(scores, rows, s, stream_);
  }
  void causal_softmax_backward(const float* probs, const float* dprobs, float* dscores,
                               int64_t rows, int64_t s) override {
    k::causal_softmax_backward(probs, dprobs, dscores, rows, s, stream_);
  }
  void attention_context(const float* probs, const float* v, float* out, int64_t b, int64_t s,
                         int64_t hq, int64_t hk, int64_t d) override {
    const int64_t per = hq / hk;
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t j = 0; j < per; ++j)
        gemm(s, d, s, 1.0f, {probs + (bi * hq + j) * s * s, s, per * s * s, false},
             {v + bi * s * hk * d, hk * d, d, false}, 0.0f, out + (bi * s * hq + j) * d, hq * d,
             per * d, hk);
  }
  void attention_context_backward(const float* probs, const float* v, const float* dout,
                                  float* dprobs, float* dv, int64_t b, int64_t s, int64_t hq,
                                  int64_t hk, int64_t d) override {
    const int64_t per = hq / hk;
    if (dv) fill_zero(dv, b * s * hk * d);
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t j = 0; j < per; ++j) {
        const Mat dO{dout + (bi * s * hq + j) * d, hq * d, per * d, false};
        if (dprobs)
          gemm(s, s, d, 1.0f, dO, {v + bi * s * hk * d, hk * d, d, true}, 0.0f,
               dprobs + (bi * hq + j) * s * s, s, per * s * s, hk);
        if (dv)
          gemm(s, d, s, 1.0f, {probs + (bi * hq + j) * s * s, s, per * s * s, true}, dO, 1.0f,
               dv + bi * s * hk * d, hk * d, d, hk);
      }
    if (dprobs) k::zero_upper(dprobs, b * hq, s, stream_);
  }

  void flash_attention_forward(const float* q, const float* kk, const float* v, float* out,
                               float* lse, int64_t b, int64_t s, int64_t hq, int64_t hk,
                               int64_t d) override {
    k::flash_attention_forward(q, kk, v, out, lse, b, s, hq, hk, d, stream_);
  }
  void flash_attention_backward(const float* q, const float* kk, const float* v, const float* out,
                                const float* lse, const float* dout, float* dq, float* dk,
                                float* dv, int64_t b, int64_t s, int64_t hq, int64_t hk,
                                int64_t d) override {
    // The workspace is counted like any allocation (it is the size of lse).
    const size_t bytes = static_cast<size_t>(b * hq * s) * sizeof(float);
    float* delta = static_cast<float*>(allocate(bytes));
    try {
      k::flash_attention_backward(q, kk, v, out, lse, dout, dq, dk, dv, delta, b, s, hq, hk, d,
                                  stream_);
    } catch (...) {
      deallocate(delta, bytes);
      throw;
    }
    deallocate(delta, bytes);
  }

  void norm_forward(const float* x, const float* g, const float* beta, float* y, float* mean,
                    float* rstd, int64_t n, int64_t h) override {
    if (beta)
      k::layernorm_forward(x, g, beta, y, mean, rstd, n, h, stream_);
    else
      k::rmsnorm_forward(x, g, y, rstd, n, h, stream_);
  }
  void norm_backward(const float* x, const float* g, bool has_beta, const float* mean,
                     const float* rstd, const float* dy, float* dx, float* dg, float* dbeta,
                     int64_t n, int64_t h) override {
    if (has_beta)
      k::layernorm_backward(x, g, mean, rstd, dy, dx, dg, dbeta, n, h, stream_);
    else
      k::rmsnorm_backward(x, g, rstd, dy, dx, dg, n, h, stream_);
  }
  void gelu(const float* x, float* y, int64_t n) override { k::gelu(x, y, n, stream_); }
  void gelu_backward(const float* x, const float* dy, float* dx, int64_t n) override {
    k::gelu_backward(x, dy, dx, n, stream_);
  }
  void swiglu(const float* x, float* y, int64_t n, int64_t f) override {
    k::swiglu(x, y, n, f, stream_);
  }
  void swiglu_backward(const float* x, const float* dy, float* dx, int64_t n, int64_t f) override {
    k::swiglu_backward(x, dy, dx, n, f, stream_);
  }
  void rope(float* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base,
            bool inverse) override {
    k::rope(x, b, s, heads, d, base, inverse, stream_);
  }

  void copy(const float* x, float* y, int64_t n) override {
    if (n > 0 && x != y)
      PTDP_CHECK(cudaMemcpyAsync(y, x, sizeof(float) * static_cast<size_t>(n),
                                 cudaMemcpyDeviceToDevice, stream_));
  }
  void fill_zero(float* x, int64_t n) override {
    if (n > 0) PTDP_CHECK(cudaMemsetAsync(x, 0, sizeof(float) * static_cast<size_t>(n), stream_));
  }
  void copy_bytes(const void* from, void* to, size_t bytes) override {
    if (bytes > 0 && from != to)
      PTDP_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  void zero_bytes(void* p, size_t bytes) override {
    if (bytes > 0) PTDP_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  }
  void convert(const void* from, DType from_type, void* to, DType to_type, int64_t n) override {
    if (from_type == to_type)
      return copy_bytes(from, to, static_cast<size_t>(n) * dtype_bytes(to_type));
    if (from_type == DType::kF32 && to_type == DType::kBF16)
      return k::to_bf16(static_cast<const float*>(from), to, n, stream_);
    if (from_type == DType::kBF16 && to_type == DType::kF32)
      return k::from_bf16(from, static_cast<float*>(to), n, stream_);
    if (from_type == DType::kF32 && to_type == DType::kF16)
      return k::to_fp16(static_cast<const float*>(from), to, n, stream_);
    if (from_type == DType::kF16 && to_type == DType::kF32)
      return k::from_fp16(from, static_cast<float*>(to), n, stream_);
    throw std::invalid_argument("the CUDA backend converts between fp32 and bf16 or fp16, not " +
                                to_string(from_type) + " and " + to_string(to_type));
  }
  void add(float* y, const float* x, int64_t n) override { k::add(y, x, n, stream_); }
  void add_bias(float* y, const float* bias, int64_t rows, int64_t width) override {
    k::add_bias(y, bias, rows, width, stream_);
  }
  void bias_grad(const float* dy, float* db, int64_t rows, int64_t width) override {
    k::bias_grad(dy, db, rows, width, stream_);
  }
  void scale(float* x, int64_t n, double f) override { k::scale(x, n, f, stream_); }
  void split_columns3(const float* x, float* y0, float* y1, float* y2, int64_t n, int64_t a,
                      int64_t b, int64_t c) override {
    k::split_columns3(x, y0, y1, y2, n, a, b, c, stream_);
  }
  void concat_columns3(const float* x0, const float* x1, const float* x2, float* y, int64_t n,
                       int64_t a, int64_t b, int64_t c) override {
    k::concat_columns3(x0, x1, x2, y, n, a, b, c, stream_);
  }
  void sequence_unshard(const float* shards, float* full, int64_t t, int64_t b, int64_t s,
                        int64_t width) override {
    k::sequence_unshard(shards, full, t, b, s, width, stream_);
  }
  void sequence_shard(const float* full, float* shards, int64_t t, int64_t b, int64_t s,
                      int64_t width) override {
    k::sequence_shard(full, shards, t, b, s, width, stream_);
  }
  void vocab_embedding_lookup(const int32_t* tokens, const float* table, float* y, int64_t n,
                              int64_t h, int64_t v0, int64_t vl) override {
    k::vocab_embedding_lookup(device_tokens(tokens, n), table, y, n, h, v0, vl, stream_);
  }
  void vocab_embedding_grad(const int32_t* tokens, const float* dy, float* dtable, int64_t n,
                            int64_t h, int64_t v0, int64_t vl) override {
    k::vocab_embedding_grad(device_tokens(tokens, n), dy, dtable, n, h, v0, vl, stream_);
  }
  void add_positions(float* x, const float* pos, int64_t b, int64_t sl, int64_t h,
                     int64_t first) override {
    k::add_positions(x, pos, b, sl, h, first, stream_);
  }
  void position_grad(const float* dx, float* dpos, int64_t b, int64_t sl, int64_t h,
                     int64_t first) override {
    k::position_grad(dx, dpos, b, sl, h, first, stream_);
  }
  void cross_entropy_stats(const float* logits, const int32_t* targets, float* stats, int64_t n,
                           int64_t vl, int64_t valid, int64_t v0) override {
    k::cross_entropy_stats(logits, device_tokens(targets, n), stats, n, vl, valid, v0, stream_);
  }
  double cross_entropy_finish(const float* stats, int64_t ranks, float* logits, float* lse,
                              int64_t n, int64_t vl, int64_t valid) override {
    if (n <= 0) return 0.0;
    auto* row_loss = static_cast<float*>(allocate(sizeof(float) * static_cast<size_t>(n)));
    k::cross_entropy_finish(stats, ranks, logits, lse, row_loss, n, vl, valid, stream_);
    std::vector<float> host(static_cast<size_t>(n));
    download(row_loss, host.data(), host.size() * sizeof(float));
    deallocate(row_loss, sizeof(float) * static_cast<size_t>(n));
    double loss = 0;
    for (float l : host) loss += static_cast<double>(l);
    return loss;
  }
  void cross_entropy_backward(float* probs, const int32_t* targets, int64_t n, int64_t vl,
                              int64_t v0, double scale) override {
    k::cross_entropy_backward(probs, device_tokens(targets, n), n, vl, v0, scale, stream_);
  }

  double sum_squares(const float* x, int64_t n, double acc) override {
    if (n <= 0) return acc;
    auto* partials = static_cast<double*>(scratch_);
    k::sum_squares(x, n, partials, partials + k::kSumSquaresBlocks, stream_);
    double s = 0;
    download(partials + k::kSumSquaresBlocks, &s, sizeof s);
    return acc + s;
  }
  void adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWSettings& o,
             int64_t step) override {
    if (step < 1) throw std::invalid_argument("adamw: step counts from 1");
    k::AdamWArgs a{o.lr,
                   o.beta1,
                   o.beta2,
                   o.eps,
                   o.weight_decay,
                   1.0 - std::pow(o.beta1, static_cast<double>(step)),
                   1.0 - std::pow(o.beta2, static_cast<double>(step))};
    k::adamw(param, grad, m, v, n, a, stream_);
  }

  int device_index() const override { return device_; }
  DeviceInfo device_info() const override {
    cudaDeviceProp prop{};
    PTDP_CHECK(cudaGetDeviceProperties(&prop, device_));
    DeviceInfo d;
    d.name = prop.name;
    d.memory_bytes = static_cast<double>(prop.totalGlobalMem);
    d.cache_bytes = static_cast<double>(prop.l2CacheSize);
    d.multiprocessors = prop.multiProcessorCount;
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    auto version = [](int v) {  // 12080 -> "12.8"
      return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
    };
    d.driver = version(driver);
    d.runtime = version(runtime);
    return d;
  }
  void* native_stream() const override { return stream_; }
  // Widened blocks of 64 MiB of fp32: a GPT-2 cross-entropy in a dozen launches, not hundreds.
  int64_t widen_block_elements() const override { return int64_t{1} << 24; }

  void* allocate(size_t bytes) override {
    void* p = nullptr;
    if (bytes > 0) {
      const cudaError_t e = cudaMallocAsync(&p, bytes, stream_);
      if (e != cudaSuccess)
        throw std::runtime_error("cuda: cannot allocate " + std::to_string(bytes) +
                                 " bytes on device " + std::to_string(device_) + " (" +
                                 cudaGetErrorString(e) + "; " +
                                 std::to_string(MemoryCounter::current()) + " bytes in use)");
      PTDP_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    }
    MemoryCounter::allocated(bytes);
    return p;
  }
  void deallocate(void* p, size_t bytes) override {
    MemoryCounter::freed(bytes);
    if (p) cudaFreeAsync(p, stream_);
  }
  void upload(const void* host, void* device, size_t bytes) override {
    if (bytes == 0) return;
    PTDP_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
    PTDP_CHECK(cudaStreamSynchronize(stream_));  // the host buffer may go once this returns
  }
  void download(const void* device, void* host, size_t bytes) override {
    if (bytes == 0) return;
    PTDP_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_));
    PTDP_CHECK(cudaStreamSynchronize(stream_));
  }
  bool host_accessible() const override { return false; }
  bool device_pointer(const void* p) const override {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();  // a plain host pointer on old drivers: clear the error
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }

  void synchronize() override { PTDP_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  static constexpr size_t kScratchBytes = sizeof(double) * (k::kSumSquaresBlocks + 8);

  // Token ids arrive in host memory (the data loader's); they go up through one reused buffer.
  // Each call uses them before the next upload, as the stream runs in order.
  const int32_t* device_tokens(const int32_t* host, int64_t n) {
    const size_t bytes = sizeof(int32_t) * static_cast<size_t>(n > 0 ? n : 1);
    if (bytes > tokens_bytes_) {
      synchronize();
      cudaFree(tokens_);
      tokens_ = nullptr;
      PTDP_CHECK(cudaMalloc(&tokens_, bytes));
      tokens_bytes_ = bytes;
    }
    if (n > 0) upload(host, tokens_, sizeof(int32_t) * static_cast<size_t>(n));
    return static_cast<const int32_t*>(tokens_);
  }

  int device_ = 0;
  cublasComputeType_t compute_ = CUBLAS_COMPUTE_32F;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  void* scratch_ = nullptr;
  void* tokens_ = nullptr;
  size_t tokens_bytes_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() {
  return std::make_unique<CudaBackend>();
}

}  // namespace ptdp
