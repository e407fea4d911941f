#include "runtime/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/activation.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/common.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/grad_norm.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/rope.h"
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
// An optional operand (a null dq, dk, dprobs or dv) that is bf16 where it is given.
bool bf16_or_null(CPtr x) {
  return !x || x.t == DType::kBF16;
}

// cuBLAS's name for a storage type: float or bf16.
template <class T>
constexpr cudaDataType cuda_type() {
  return std::is_same_v<T, float> ? CUDA_R_32F : CUDA_R_16BF;
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
    // Keep what the stream-ordered allocator has mapped: by default it returns memory to the
    // device at every synchronisation, and the next step's cudaMallocAsync calls map it again.
    cudaMemPool_t pool = nullptr;
    PTDP_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
    uint64_t keep = UINT64_MAX;
    PTDP_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    PTDP_CHECK(cublasCreate(&blas_));
    PTDP_CHECK(cublasSetStream(blas_, stream_));
    lt_ = std::make_unique<kc::Gemm>();  // after cudaSetDevice: its workspace is on this device
    PTDP_CHECK(cudaMalloc(&scratch_, kScratchBytes));
    // Freed blocks kept for reuse: at most an eighth of the device, and 16 GiB.
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
      max_cached_bytes_ = std::min(max_cached_bytes_, total_bytes / 8);
    // A kernel's or a communicator's temporary that finds the device full frees them first.
    kc::set_out_of_memory_handler([](void* self) { static_cast<CudaBackend*>(self)->relieve(); },
                                  this);
    set_buffer_space(this);
  }
  ~CudaBackend() override {
    if (buffer_space() == this) set_buffer_space(nullptr);
    kc::set_out_of_memory_handler(nullptr, nullptr);
    release_cached();
    cudaStreamSynchronize(stream_);
    for (cudaEvent_t e : free_marks_) cudaEventDestroy(e);
    cudaFree(scratch_);
    for (Staging* st : {&tokens_, &index_, &weight_, &grouped_rows_}) cudaFree(st->p);
    for (PinnedSlot& slot : pinned_) {
      if (slot.p) cudaFreeHost(slot.p);
      if (slot.copied) cudaEventDestroy(slot.copied);
    }
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
  // the typed forms, which run them natively too (native_add_bias, native_bias_grad).
  static bool bf16(CPtr x) { return x.t == DType::kBF16; }
  bool native_linear_forward(CPtr x, CPtr w, CPtr b, Ptr y, int64_t n, int64_t in,
                             int64_t out) override {
    if (!bf16(x) || !bf16(w) || !bf16(y) || (b && !bf16(b))) return false;
    // The bias in cuBLASLt's epilogue: no second pass over y (kernels/cuda/gemm.h). A bias
    // inside the parameter buffer is 16-byte aligned only where the sizes before it allow; cuBLASLt
    // may refuse a less aligned one, so that one is added after the GEMM.
    if (b && n > 0 && in > 0 && out > 0 && reinterpret_cast<uintptr_t>(b.p) % 16 == 0) {
      kc::GemmArgs g;
      g.m = n, g.n = out, g.k = in, g.a = b16(x), g.b = b16(w), g.trans_b = true, g.c = y.p;
      g.epilogue = kc::Epilogue::kBias, g.bias = b16(b);
      lt_->run(g, stream_);
      return true;
    }
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
  // residual), GELU (with no bias) and SwiGLU. Flash attention at other head dimensions, and any
  // call with an fp32 operand beside bf16 ones, is widened.
  bool native_flash_attention_forward(CPtr q, CPtr kk, CPtr v, Ptr out, float* lse, int64_t b,
                                      int64_t sq, int64_t sk, int64_t hq, int64_t hk,
                                      int64_t d) override {
    if (!all_bf16({q, kk, v, out}) || (d != 64 && d != 128)) return false;
    kc::flash_attention_forward(b16(q), b16(kk), b16(v), b16(out), lse, b, sq, sk, hq, hk, d,
                                stream_);
    return true;
  }
  bool native_flash_attention_backward(CPtr q, CPtr kk, CPtr v, CPtr out, const float* lse,
                                       CPtr dout, Ptr dq, Ptr dk, Ptr dv, int64_t b, int64_t sq,
                                       int64_t sk, int64_t hq, int64_t hk, int64_t d) override {
    if (!all_bf16({q, kk, v, out, dout, dq, dk, dv}) || (d != 64 && d != 128)) return false;
    kc::flash_attention_backward(b16(q), b16(kk), b16(v), b16(out), lse, b16(dout), b16(dq),
                                 b16(dk), b16(dv), b, sq, sk, hq, hk, d, stream_);
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
  bool native_norm_backward_add(CPtr x, CPtr g, bool has_beta, const float* mean, const float* rstd,
                                CPtr dy, Ptr dacc, float* dg, float* dbeta, int64_t n,
                                int64_t h) override {
    if (!all_bf16({x, g, dy, dacc})) return false;
    if (has_beta)
      kc::add_layernorm_backward(b16(x), b16(g), mean, rstd, b16(dy), b16(dacc), b16(dacc), dg,
                                 dbeta, n, h, stream_);
    else
      kc::add_rmsnorm_backward(b16(x), b16(g), rstd, b16(dy), b16(dacc), b16(dacc), dg, n, h,
                               stream_);
    return true;
  }
  bool native_gelu(CPtr x, Ptr y, int64_t n) override {
    if (!all_bf16({x, y})) return false;
    kc::bias_gelu_forward(b16(x), nullptr, b16(y), 1, n, stream_);
    return true;
  }
  bool native_gelu_backward_bias_grad(CPtr x, CPtr dy, Ptr dx, float* db, int64_t rows,
                                      int64_t width) override {
    if (!all_bf16({x, dy, dx})) return false;
    kc::bias_gelu_backward(b16(x), nullptr, b16(dy), b16(dx), db, rows, width, stream_);
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
  // T is the storage of every operand and output: float, or bf16 with mixed precision (cuBLAS
  // computes in fp32 and rounds the outputs once).
  void attention_scores(const float* q, const float* kk, float* scores, int64_t b, int64_t s,
                        int64_t hq, int64_t hk, int64_t d) override {
    run_attention_scores(q, kk, scores, b, s, hq, hk, d);
  }
  void attention_scores_backward(const float* q, const float* kk, const float* dscores, float* dq,
                                 float* dk, int64_t b, int64_t s, int64_t hq, int64_t hk,
                                 int64_t d) override {
    run_attention_scores_backward(q, kk, dscores, dq, dk, b, s, hq, hk, d);
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
    run_attention_context(probs, v, out, b, s, hq, hk, d);
  }
  void attention_context_backward(const float* probs, const float* v, const float* dout,
                                  float* dprobs, float* dv, int64_t b, int64_t s, int64_t hq,
                                  int64_t hk, int64_t d) override {
    run_attention_context_backward(probs, v, dout, dprobs, dv, b, s, hq, hk, d);
  }

  // dk and dv sum over the per query heads of a group (GEMMs with beta = 1). fp32: in place,
  // zeroed first. bf16: written directly (beta = 0) when per is 1; else summed in a counted fp32
  // temporary and rounded once by finish(), as the widening path rounds its fp32 sum once.
  template <class T>
  class GroupSum {
   public:
    GroupSum(CudaBackend& be, T* out, int64_t n, int64_t per) : be_(be), out_(out), n_(n) {
      if (!out) return;
      if constexpr (std::is_same_v<T, float>)
        be.fill_zero(out, n);
      else if (per > 1)
        temp_ = static_cast<float*>(be.allocate(bytes()));  // zero-filled
    }
    ~GroupSum() {
      if (temp_) be_.deallocate(temp_, bytes());
    }
    GroupSum(const GroupSum&) = delete;
    GroupSum& operator=(const GroupSum&) = delete;

    // Where element e of the sum goes, in which type, and the GEMMs' beta.
    void* at(int64_t e) const {
      return temp_ ? static_cast<void*>(temp_ + e) : static_cast<void*>(out_ + e);
    }
    cudaDataType type() const { return temp_ ? CUDA_R_32F : cuda_type<T>(); }
    float beta() const { return std::is_same_v<T, float> || temp_ ? 1.0f : 0.0f; }
    void finish() {
      if constexpr (!std::is_same_v<T, float>)
        if (temp_) k::to_bf16(temp_, out_, n_, be_.stream_);
    }

   private:
    size_t bytes() const { return sizeof(float) * static_cast<size_t>(n_); }
    CudaBackend& be_;
    T* out_;
    int64_t n_;
    float* temp_ = nullptr;
  };

  template <class T>
  void run_attention_scores(const T* q, const T* kk, T* scores, int64_t b, int64_t s, int64_t hq,
                            int64_t hk, int64_t d) {
    constexpr cudaDataType t = cuda_type<T>();
    const int64_t per = hq / hk;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t j = 0; j < per; ++j)
        gemm(s, s, d, scale, {q + (bi * s * hq + j) * d, hq * d, per * d, false, t},
             {kk + bi * s * hk * d, hk * d, d, true, t}, 0.0f, scores + (bi * hq + j) * s * s, s,
             per * s * s, hk, t);
    k::zero_upper(scores, b * hq, s, stream_);
  }
  template <class T>
  void run_attention_scores_backward(const T* q, const T* kk, const T* dscores, T* dq, T* dk,
                                     int64_t b, int64_t s, int64_t hq, int64_t hk, int64_t d) {
    constexpr cudaDataType t = cuda_type<T>();
    const int64_t per = hq / hk;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    GroupSum<T> sum_dk(*this, dk, b * s * hk * d, per);
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t j = 0; j < per; ++j) {
        const Mat ds{dscores + (bi * hq + j) * s * s, s, per * s * s, false, t};
        if (dq)
          gemm(s, d, s, scale, ds, {kk + bi * s * hk * d, hk * d, d, false, t}, 0.0f,
               dq + (bi * s * hq + j) * d, hq * d, per * d, hk, t);
        if (dk)
          gemm(s, d, s, scale, {ds.p, s, per * s * s, true, t},
               {q + (bi * s * hq + j) * d, hq * d, per * d, false, t}, sum_dk.beta(),
               sum_dk.at(bi * s * hk * d), hk * d, d, hk, sum_dk.type());
      }
    sum_dk.finish();
  }
  template <class T>
  void run_attention_context(const T* probs, const T* v, T* out, int64_t b, int64_t s, int64_t hq,
                             int64_t hk, int64_t d) {
    constexpr cudaDataType t = cuda_type<T>();
    const int64_t per = hq / hk;
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t j = 0; j < per; ++j)
        gemm(s, d, s, 1.0f, {probs + (bi * hq + j) * s * s, s, per * s * s, false, t},
             {v + bi * s * hk * d, hk * d, d, false, t}, 0.0f, out + (bi * s * hq + j) * d, hq * d,
             per * d, hk, t);
  }
  template <class T>
  void run_attention_context_backward(const T* probs, const T* v, const T* dout, T* dprobs, T* dv,
                                      int64_t b, int64_t s, int64_t hq, int64_t hk, int64_t d) {
    constexpr cudaDataType t = cuda_type<T>();
    const int64_t per = hq / hk;
    GroupSum<T> sum_dv(*this, dv, b * s * hk * d, per);
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t j = 0; j < per; ++j) {
        const Mat dO{dout + (bi * s * hq + j) * d, hq * d, per * d, false, t};
        if (dprobs)
          gemm(s, s, d, 1.0f, dO, {v + bi * s * hk * d, hk * d, d, true, t}, 0.0f,
               dprobs + (bi * hq + j) * s * s, s, per * s * s, hk, t);
        if (dv)
          gemm(s, d, s, 1.0f, {probs + (bi * hq + j) * s * s, s, per * s * s, true, t}, dO,
               sum_dv.beta(), sum_dv.at(bi * s * hk * d), hk * d, d, hk, sum_dv.type());
      }
    sum_dv.finish();
    if (dprobs) k::zero_upper(dprobs, b * hq, s, stream_);
  }

  // Mixed precision: the unfused attention pieces where every operand is bf16.
  bool native_attention_scores(CPtr q, CPtr kk, Ptr scores, int64_t b, int64_t s, int64_t hq,
                               int64_t hk, int64_t d) override {
    if (!all_bf16({q, kk, scores})) return false;
    run_attention_scores(b16(q), b16(kk), b16(scores), b, s, hq, hk, d);
    return true;
  }
  bool native_attention_scores_backward(CPtr q, CPtr kk, CPtr dscores, Ptr dq, Ptr dk, int64_t b,
                                        int64_t s, int64_t hq, int64_t hk, int64_t d) override {
    if (!all_bf16({q, kk, dscores}) || !bf16_or_null(dq) || !bf16_or_null(dk)) return false;
    run_attention_scores_backward(b16(q), b16(kk), b16(dscores), b16(dq), b16(dk), b, s, hq, hk, d);
    return true;
  }
  bool native_causal_softmax(Ptr scores, int64_t rows, int64_t s) override {
    if (!bf16(scores)) return false;
    k::causal_softmax(b16(scores), rows, s, stream_);
    return true;
  }
  bool native_causal_softmax_backward(CPtr probs, CPtr dprobs, Ptr dscores, int64_t rows,
                                      int64_t s) override {
    if (!all_bf16({probs, dprobs, dscores})) return false;
    k::causal_softmax_backward(b16(probs), b16(dprobs), b16(dscores), rows, s, stream_);
    return true;
  }
  bool native_attention_context(CPtr probs, CPtr v, Ptr out, int64_t b, int64_t s, int64_t hq,
                                int64_t hk, int64_t d) override {
    if (!all_bf16({probs, v, out})) return false;
    run_attention_context(b16(probs), b16(v), b16(out), b, s, hq, hk, d);
    return true;
  }
  bool native_attention_context_backward(CPtr probs, CPtr v, CPtr dout, Ptr dprobs, Ptr dv,
                                         int64_t b, int64_t s, int64_t hq, int64_t hk,
                                         int64_t d) override {
    if (!all_bf16({probs, v, dout}) || !bf16_or_null(dprobs) || !bf16_or_null(dv)) return false;
    run_attention_context_backward(b16(probs), b16(v), b16(dout), b16(dprobs), b16(dv), b, s, hq,
                                   hk, d);
    return true;
  }

  void flash_attention_forward(const float* q, const float* kk, const float* v, float* out,
                               float* lse, int64_t b, int64_t sq, int64_t sk, int64_t hq,
                               int64_t hk, int64_t d) override {
    k::flash_attention_forward(q, kk, v, out, lse, b, sq, sk, hq, hk, d, stream_);
  }
  void flash_attention_backward(const float* q, const float* kk, const float* v, const float* out,
                                const float* lse, const float* dout, float* dq, float* dk,
                                float* dv, int64_t b, int64_t sq, int64_t sk, int64_t hq,
                                int64_t hk, int64_t d) override {
    // The workspace is counted like any allocation (it is the size of lse).
    const size_t bytes = static_cast<size_t>(b * hq * sq) * sizeof(float);
    float* delta = static_cast<float*>(allocate(bytes));
    try {
      k::flash_attention_backward(q, kk, v, out, lse, dout, dq, dk, dv, delta, b, sq, sk, hq, hk, d,
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
    table_grad_by_rows(tokens, dy, dtable, n, h, v0, vl);
  }
  // The table gradient by the rows the tokens hit, grouped here on the host where the tokens
  // are (kernels/cuda/embedding.h): each row's hits summed in token order by its own threads.
  template <class T>
  void table_grad_by_rows(const int32_t* tokens, const T* dy, float* dtable, int64_t n, int64_t h,
                          int64_t v0, int64_t vl) {
    const int64_t m = kc::group_token_rows(tokens, n, v0, vl, grouped_, row_counts_);
    if (m == 0 || h <= 0) return;
    const auto* packed = static_cast<const int32_t*>(
        staged(grouped_rows_, grouped_.data(), sizeof(int32_t) * grouped_.size()));
    kc::embedding_table_grad_rows(packed, m, dy, dtable, h, stream_);
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
    return run_cross_entropy_finish(stats, ranks, logits, lse, n, vl, valid);
  }
  // The loss: each row's, computed on the device, downloaded and added in row order.
  template <class T>
  double run_cross_entropy_finish(const float* stats, int64_t ranks, T* logits, float* lse,
                                  int64_t n, int64_t vl, int64_t valid) {
    return sum_row_losses(n, [&](float* row_loss) {
      k::cross_entropy_finish(stats, ranks, logits, lse, row_loss, n, vl, valid, stream_);
    });
  }
  // `rows(row_loss)` queues the rows' losses into row_loss (n floats of device memory); their
  // sum in row order.
  template <class Rows>
  double sum_row_losses(int64_t n, Rows rows) {
    if (n <= 0) return 0.0;
    auto* row_loss = static_cast<float*>(allocate(sizeof(float) * static_cast<size_t>(n)));
    rows(row_loss);
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

  // Mixed precision: the rotary embedding, the glue, the embedding and the cross-entropy on bf16
  // activations, the kernels above loading bf16 and storing it rounded (fp32 arithmetic in
  // between, as the widening computes); gradients of biases, tables and positions, and the
  // statistics, stay fp32.
  bool native_rope(Ptr x, int64_t b, int64_t s, int64_t heads, int64_t d, double base,
                   bool inverse) override {
    if (!bf16(x)) return false;
    kc::rope(b16(x), b, s, heads, d, base, inverse, stream_);  // 16-byte vectors where it can
    return true;
  }
  bool native_add(Ptr y, CPtr x, int64_t n) override {
    if (!all_bf16({y, x})) return false;
    k::add(b16(y), b16(x), n, stream_);
    return true;
  }
  bool native_add_bias(Ptr y, CPtr bias, int64_t rows, int64_t width) override {
    if (!all_bf16({y, bias})) return false;
    k::add_bias(b16(y), b16(bias), rows, width, stream_);
    return true;
  }
  bool native_residual_add(Ptr out, CPtr residual, CPtr partial, CPtr bias, int64_t rows,
                           int64_t width) override {
    if (all_bf16({out, residual, partial}) && (!bias || bf16(bias))) {
      k::residual_add(b16(out), b16(residual), b16(partial), bias ? b16(bias) : nullptr, rows,
                      width, stream_);
      return true;
    }
    if (!out.f32() || !residual.f32() || !partial.f32() || (bias && !bias.f32())) return false;
    k::residual_add(out.f(), residual.f(), partial.f(), bias ? bias.f() : nullptr, rows, width,
                    stream_);
    return true;
  }
  bool native_residual_add_backward(CPtr dout, Ptr d_residual, Ptr d_partial, float* db,
                                    int64_t rows, int64_t width) override {
    if (all_bf16({dout, d_residual, d_partial}))
      return k::residual_add_backward(b16(dout), b16(d_residual), b16(d_partial), db, rows, width,
                                      stream_);
    if (!dout.f32() || !d_residual.f32() || !d_partial.f32()) return false;
    return k::residual_add_backward(dout.f(), d_residual.f(), d_partial.f(), db, rows, width,
                                    stream_);
  }
  bool native_bias_grad(CPtr dy, float* db, int64_t rows, int64_t width) override {
    if (!bf16(dy)) return false;
    k::bias_grad(b16(dy), db, rows, width, stream_);
    return true;
  }
  bool native_scale(Ptr x, int64_t n, double f) override {
    if (!bf16(x)) return false;
    k::scale(b16(x), n, f, stream_);
    return true;
  }
  bool native_split_columns3(CPtr x, Ptr y0, Ptr y1, Ptr y2, int64_t n, int64_t a, int64_t b,
                             int64_t c) override {
    if (!all_bf16({x, y0, y1, y2})) return false;
    k::split_columns3(b16(x), b16(y0), b16(y1), b16(y2), n, a, b, c, stream_);
    return true;
  }
  bool native_concat_columns3(CPtr x0, CPtr x1, CPtr x2, Ptr y, int64_t n, int64_t a, int64_t b,
                              int64_t c) override {
    if (!all_bf16({x0, x1, x2, y})) return false;
    k::concat_columns3(b16(x0), b16(x1), b16(x2), b16(y), n, a, b, c, stream_);
    return true;
  }
  bool native_sequence_unshard(CPtr shards, Ptr full, int64_t t, int64_t b, int64_t s,
                               int64_t width) override {
    if (!all_bf16({shards, full})) return false;
    k::sequence_unshard(b16(shards), b16(full), t, b, s, width, stream_);
    return true;
  }
  bool native_sequence_shard(CPtr full, Ptr shards, int64_t t, int64_t b, int64_t s,
                             int64_t width) override {
    if (!all_bf16({full, shards})) return false;
    k::sequence_shard(b16(full), b16(shards), t, b, s, width, stream_);
    return true;
  }
  bool native_vocab_embedding_lookup(const int32_t* tokens, CPtr table, Ptr y, int64_t n, int64_t h,
                                     int64_t v0, int64_t vl) override {
    if (!all_bf16({table, y})) return false;
    k::vocab_embedding_lookup(device_tokens(tokens, n), b16(table), b16(y), n, h, v0, vl, stream_);
    return true;
  }
  bool native_vocab_embedding_grad(const int32_t* tokens, CPtr dy, float* dtable, int64_t n,
                                   int64_t h, int64_t v0, int64_t vl) override {
    if (!bf16(dy)) return false;
    table_grad_by_rows(tokens, b16(dy), dtable, n, h, v0, vl);
    return true;
  }
  bool native_add_positions(Ptr x, CPtr pos, int64_t b, int64_t sl, int64_t h,
                            int64_t first) override {
    if (!all_bf16({x, pos})) return false;
    k::add_positions(b16(x), b16(pos), b, sl, h, first, stream_);
    return true;
  }
  bool native_position_grad(CPtr dx, float* dpos, int64_t b, int64_t sl, int64_t h,
                            int64_t first) override {
    if (!bf16(dx)) return false;
    k::position_grad(b16(dx), dpos, b, sl, h, first, stream_);
    return true;
  }
  bool native_cross_entropy_stats(CPtr logits, const int32_t* targets, float* stats, int64_t n,
                                  int64_t vl, int64_t valid, int64_t v0) override {
    if (!bf16(logits)) return false;
    k::cross_entropy_stats(b16(logits), device_tokens(targets, n), stats, n, vl, valid, v0,
                           stream_);
    return true;
  }
  bool native_cross_entropy_finish(const float* stats, int64_t ranks, Ptr logits, float* lse,
                                   int64_t n, int64_t vl, int64_t valid, double& loss) override {
    if (!bf16(logits)) return false;
    loss = run_cross_entropy_finish(stats, ranks, b16(logits), lse, n, vl, valid);
    return true;
  }
  bool native_cross_entropy_backward(Ptr probs, const int32_t* targets, int64_t n, int64_t vl,
                                     int64_t v0, double scale) override {
    if (!bf16(probs)) return false;
    k::cross_entropy_backward(b16(probs), device_tokens(targets, n), n, vl, v0, scale, stream_);
    return true;
  }
  // The deferred pair on bf16 logits: the loss without the probabilities, then the gradient
  // from the logits and lse in one pass (fp32_kernels.h); two passes over the logits fewer.
  bool native_cross_entropy_loss(const float* stats, int64_t ranks, Ptr logits, float* lse,
                                 int64_t n, double& loss) override {
    if (!bf16(logits)) return false;
    loss = sum_row_losses(
        n, [&](float* row_loss) { k::cross_entropy_lse(stats, ranks, lse, row_loss, n, stream_); });
    return true;
  }
  bool native_cross_entropy_backward_from_lse(Ptr logits, const float* lse, const int32_t* targets,
                                              int64_t n, int64_t vl, int64_t valid, int64_t v0,
                                              double scale) override {
    if (!bf16(logits)) return false;
    k::cross_entropy_backward_from_lse(b16(logits), lse, device_tokens(targets, n), n, vl, valid,
                                       v0, scale, stream_);
    return true;
  }

  void gather_rows(CPtr x, const int64_t* index, const float* weight, Ptr y, int64_t rows,
                   int64_t h) override {
    const bool b = row_moves_bf16({x.t, y.t});
    if (rows <= 0) return;
    const int64_t* i = device_index(index, rows);
    const float* w = device_weight(weight, rows);
    if (b)
      k::gather_rows(b16(x), i, w, b16(y), rows, h, stream_);
    else
      k::gather_rows(x.f(), i, w, y.f(), rows, h, stream_);
  }
  void gather_add_rows(CPtr y, const int64_t* index, const float* weight, Ptr out, int64_t n,
                       int64_t slots, int64_t h) override {
    const bool b = row_moves_bf16({y.t, out.t});
    if (n * slots <= 0) return;
    const int64_t* i = device_index(index, n * slots);
    const float* w = device_weight(weight, n * slots);
    if (b)
      k::gather_add_rows(b16(y), i, w, b16(out), n, slots, h, stream_);
    else
      k::gather_add_rows(y.f(), i, w, out.f(), n, slots, h, stream_);
  }
  void row_dots(CPtr a, const int64_t* index, CPtr b, float* dot, int64_t rows,
                int64_t h) override {
    const bool bf = row_moves_bf16({a.t, b.t});
    if (rows <= 0) return;
    const int64_t* i = device_index(index, rows);
    if (bf)
      k::row_dots(b16(a), i, b16(b), dot, rows, h, stream_);
    else
      k::row_dots(a.f(), i, b.f(), dot, rows, h, stream_);
  }

  double sum_squares(const float* x, int64_t n, double acc) override {
    if (n <= 0) return acc;
    // The kernels' deterministic sum (kernels/cuda/grad_norm.h), up to 1024 blocks a call.
    auto* partials = static_cast<double*>(scratch_);
    kernels::cuda::sum_squares_to(x, n, partials, partials + kernels::cuda::kSumSquaresMaxBlocks,
                                  stream_);
    double s = 0;
    download(partials + kernels::cuda::kSumSquaresMaxBlocks, &s, sizeof s);
    return acc + s;
  }
  // The kernels' settings for step `step` (from 1), with its bias corrections.
  static k::AdamWArgs adamw_args(const AdamWSettings& o, int64_t step) {
    if (step < 1) throw std::invalid_argument("adamw: step counts from 1");
    return {o.lr,
            o.beta1,
            o.beta2,
            o.eps,
            o.weight_decay,
            1.0 - std::pow(o.beta1, static_cast<double>(step)),
            1.0 - std::pow(o.beta2, static_cast<double>(step))};
  }
  void adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWSettings& o,
             int64_t step) override {
    k::adamw(param, grad, m, v, n, adamw_args(o, step), stream_);
  }
  // One pass instead of scale, adamw and copy: three launches a parameter range and two passes
  // over the gradient and the weights fewer (on GPT-2-124M about 150 ranges: the step's
  // optimizer was bound by the host's launches).
  void adamw_update(float* w, float* grad, float* m, float* v, Ptr copy_to, int64_t n,
                    const AdamWSettings& o, int64_t step, double grad_scale) override {
    if (copy_to.p && copy_to.t != DType::kF32 && copy_to.t != DType::kBF16)
      return Backend::adamw_update(w, grad, m, v, copy_to, n, o, step, grad_scale);
    const k::AdamWArgs a = adamw_args(o, step);
    if (copy_to.t == DType::kBF16 && copy_to.p)
      k::adamw_update(w, grad, m, v, static_cast<kernels::cuda::bf16*>(copy_to.p), n, a, grad_scale,
                      stream_);
    else
      k::adamw_update(w, grad, m, v, static_cast<float*>(copy_to.p), n, a, grad_scale, stream_);
  }

  // One launch for up to k::kAdamWSpans spans (on GPT-2-124M some 100 spans of alternating
  // weight decay, one launch each before).
  void adamw_update_spans(float* w, float* grad, float* m, float* v, Ptr copy_to,
                          const std::vector<DecaySpan>& spans, const AdamWSettings& o, int64_t step,
                          double grad_scale) override {
    if (copy_to.p && copy_to.t != DType::kF32 && copy_to.t != DType::kBF16)
      return Backend::adamw_update_spans(w, grad, m, v, copy_to, spans, o, step, grad_scale);
    const k::AdamWArgs a = adamw_args(o, step);
    std::vector<k::AdamWSpan> table;
    table.reserve(spans.size());
    for (const DecaySpan& s : spans) table.push_back({s.start, s.n, s.decay});
    if (copy_to.t == DType::kBF16 && copy_to.p)
      k::adamw_update_spans(w, grad, m, v, static_cast<kernels::cuda::bf16*>(copy_to.p), table, a,
                            grad_scale, stream_);
    else
      k::adamw_update_spans(w, grad, m, v, static_cast<float*>(copy_to.p), table, a, grad_scale,
                            stream_);
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
  // Events come from a pool: a traced step queues one per op, and creating each would add a
  // driver call to every op's launch.
  void* record_mark() override {
    cudaEvent_t e = nullptr;
    if (free_marks_.empty()) {
      PTDP_CHECK(cudaEventCreate(&e));
    } else {
      e = free_marks_.back();
      free_marks_.pop_back();
    }
    PTDP_CHECK(cudaEventRecord(e, stream_));
    return e;
  }
  double mark_seconds(void* from, void* to) override {
    float ms = 0;
    PTDP_CHECK(
        cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(from), static_cast<cudaEvent_t>(to)));
    return ms * 1e-3;
  }
  void release_mark(void* mark) override { free_marks_.push_back(static_cast<cudaEvent_t>(mark)); }
  // Widened blocks of 64 MiB of fp32: a GPT-2 cross-entropy in a dozen launches, not hundreds.
  int64_t widen_block_elements() const override { return int64_t{1} << 24; }

  void* allocate(size_t bytes) override {
    void* p = allocate_for_overwrite(bytes);
    if (bytes > 0) PTDP_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    return p;
  }
  // No memset: the caller writes every byte first (Buffer::resize_for_overwrite).
  // A block of the same size freed earlier is reused before the stream-ordered allocator is
  // asked: a step allocates the same sizes every time, and a cudaMallocAsync and cudaFreeAsync
  // for each activation were a good part of the host's time for every small op (a GPT-2-124M
  // LayerNorm's span was 20 us against its 5 us kernel: the device waited for the host). One
  // stream, so a block freed there is only reused by work queued after its last reader.
  void* allocate_for_overwrite(size_t bytes) override {
    void* p = nullptr;
    if (bytes > 0) {
      auto it = cached_.find(bytes);
      if (it != cached_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= bytes;
      } else {
        cudaError_t e = cudaMallocAsync(&p, bytes, stream_);
        if (e == cudaErrorMemoryAllocation) {  // the cache's blocks and the pool's spare first
          cudaGetLastError();
          relieve();
          e = cudaMallocAsync(&p, bytes, stream_);
        }
        if (e != cudaSuccess)
          throw std::runtime_error("cuda: cannot allocate " + std::to_string(bytes) +
                                   " bytes on device " + std::to_string(device_) + " (" +
                                   cudaGetErrorString(e) + "; " +
                                   std::to_string(MemoryCounter::current()) + " bytes in use)");
      }
    }
    MemoryCounter::allocated(bytes);
    return p;
  }
  void deallocate(void* p, size_t bytes) override {
    MemoryCounter::freed(bytes);
    if (!p) return;
    if (bytes > max_cached_bytes_ / 4) {  // a block this large is rare: back to the pool
      cudaFreeAsync(p, stream_);
      return;
    }
    // Over the bound (sizes that do not recur, such as an MoE layer's routed rows): all back to
    // the pool, where any size can use them.
    if (cached_bytes_ + bytes > max_cached_bytes_) release_cached();
    cached_[bytes].push_back(p);
    cached_bytes_ += bytes;
  }
  // Out of device memory: the cached blocks back to the pool, and the pool's unused memory back
  // to the device (the release threshold keeps it otherwise), once the stream has drained.
  void relieve() {
    release_cached();
    cudaStreamSynchronize(stream_);
    cudaMemPool_t pool = nullptr;
    if (cudaDeviceGetDefaultMemPool(&pool, device_) == cudaSuccess) cudaMemPoolTrimTo(pool, 0);
    cudaGetLastError();  // whatever the trim said, the caller's retry reports for itself
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
  static constexpr size_t kScratchBytes =
      sizeof(double) * (kernels::cuda::kSumSquaresMaxBlocks + 8);

  // Host arrays that kernels read (token ids from the data loader, the MoE layer's index and
  // weight arrays) go up through reused device buffers, one per argument. Each call's kernels
  // read theirs before the next upload overwrites it, as the stream runs in order. The copy is
  // queued, not waited for: the bytes go first into a pinned host slot (kPinnedSlots of them,
  // reused round-robin, each only once its last copy has run), so the caller's array may go as
  // soon as the call returns and the stream is not drained. (A synchronous upload drained it
  // four times a microbatch: the embedding, the loss's two passes and the embedding gradient
  // each uploaded the tokens, and the GPU then waited for the host to queue the next kernels.)
  struct Staging {
    void* p = nullptr;
    size_t bytes = 0;
  };
  const void* staged(Staging& s, const void* host, size_t bytes) {
    if (bytes > s.bytes) {
      synchronize();
      cudaFree(s.p);
      s.p = nullptr;
      PTDP_CHECK(cudaMalloc(&s.p, bytes));
      s.bytes = bytes;
    }
    if (bytes > 0) upload_queued(host, s.p, bytes);
    return s.p;
  }
  struct PinnedSlot {
    void* p = nullptr;
    size_t bytes = 0;
    cudaEvent_t copied = nullptr;  // recorded after the slot's last copy
  };
  static constexpr int kPinnedSlots = 8;
  PinnedSlot pinned_[kPinnedSlots];
  int next_pinned_ = 0;
  void upload_queued(const void* host, void* device, size_t bytes) {
    PinnedSlot& slot = pinned_[next_pinned_];
    next_pinned_ = (next_pinned_ + 1) % kPinnedSlots;
    if (slot.copied)
      PTDP_CHECK(cudaEventSynchronize(slot.copied));  // its previous copy has been made
    else
      PTDP_CHECK(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming));
    if (bytes > slot.bytes) {
      if (slot.p) PTDP_CHECK(cudaFreeHost(slot.p));
      slot.p = nullptr;
      slot.bytes = 0;
      PTDP_CHECK(cudaMallocHost(&slot.p, bytes));
      slot.bytes = bytes;
    }
    std::memcpy(slot.p, host, bytes);
    PTDP_CHECK(cudaMemcpyAsync(device, slot.p, bytes, cudaMemcpyHostToDevice, stream_));
    PTDP_CHECK(cudaEventRecord(slot.copied, stream_));
  }
  const int32_t* device_tokens(const int32_t* host, int64_t n) {
    return static_cast<const int32_t*>(
        staged(tokens_, host, sizeof(int32_t) * static_cast<size_t>(std::max<int64_t>(n, 0))));
  }
  const int64_t* device_index(const int64_t* host, int64_t n) {
    return static_cast<const int64_t*>(
        staged(index_, host, sizeof(int64_t) * static_cast<size_t>(std::max<int64_t>(n, 0))));
  }
  const float* device_weight(const float* host, int64_t n) {
    if (!host) return nullptr;
    return static_cast<const float*>(
        staged(weight_, host, sizeof(float) * static_cast<size_t>(std::max<int64_t>(n, 0))));
  }

  int device_ = 0;
  cublasComputeType_t compute_ = CUBLAS_COMPUTE_32F;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  std::unique_ptr<kc::Gemm> lt_;         // cuBLASLt, for the GEMMs with a fused epilogue
  std::vector<cudaEvent_t> free_marks_;  // released markers (record_mark), for reuse
  // Freed blocks by size (allocate_for_overwrite), at most max_cached_bytes_ of them.
  size_t max_cached_bytes_ = size_t{16} << 30;
  std::unordered_map<size_t, std::vector<void*>> cached_;
  size_t cached_bytes_ = 0;
  void release_cached() {
    for (auto& [bytes, blocks] : cached_)
      for (void* b : blocks) cudaFreeAsync(b, stream_);
    cached_.clear();
    cached_bytes_ = 0;
  }
  void* scratch_ = nullptr;
  Staging tokens_, index_, weight_;
  Staging grouped_rows_;                       // group_token_rows' packed arrays
  std::vector<int32_t> grouped_, row_counts_;  // and its host arrays
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() {
  return std::make_unique<CudaBackend>();
}

}  // namespace ptdp
