// cuBLAS's strided batched GEMM on the host, for the emulated test programs
// (tests/cuda/emulated_cuda.h): what the CUDA backend of ptdp run (runtime/cuda/cuda_backend.cc)
// calls, column-major as cuBLAS documents it, fp32 and bf16 operands and outputs, sums in double.
// The reduced-precision compute types (TF32, bf16 inputs) are computed in full fp32 precision.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cstdint>

struct cublasContext {
  cudaStream_t stream = nullptr;
};

namespace {

double load(const void* p, cudaDataType t, int64_t i) {
  if (t == CUDA_R_16BF) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
void store(void* p, cudaDataType t, int64_t i, double v) {
  if (t == CUDA_R_16BF)
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(static_cast<float>(v));
  else
    static_cast<float*>(p)[i] = static_cast<float>(v);
}
bool supported(cudaDataType t) {
  return t == CUDA_R_32F || t == CUDA_R_16BF;
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

// C = alpha op(A) op(B) + beta C for each of batchCount matrices; C is not read when beta is 0.
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t, cublasOperation_t transa,
                                          cublasOperation_t transb, int m, int n, int k,
                                          const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B,
                                          cudaDataType Btype, int ldb, long long int strideB,
                                          const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount,
                                          cublasComputeType_t, cublasGemmAlgo_t) {
  if (m < 0 || n < 0 || k < 0 || batchCount < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (!supported(Atype) || !supported(Btype) || !supported(Ctype))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  const double a = *static_cast<const float*>(alpha), b = *static_cast<const float*>(beta);
  for (int64_t batch = 0; batch < batchCount; ++batch) {
    const int64_t oa = batch * strideA, ob = batch * strideB, oc = batch * strideC;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) {
        double acc = 0;
        for (int64_t l = 0; l < k; ++l) {
          const int64_t ai = transa == CUBLAS_OP_N ? i + l * lda : l + i * lda;
          const int64_t bi = transb == CUBLAS_OP_N ? l + j * ldb : j + l * ldb;
          acc += load(A, Atype, oa + ai) * load(B, Btype, ob + bi);
        }
        const int64_t ci = oc + i + j * ldc;
        store(C, Ctype, ci, a * acc + (b != 0.0 ? b * load(C, Ctype, ci) : 0.0));
      }
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"

// The cuBLASLt wrapper of kernels/cuda/gemm.h on the host, as its header specifies it: row-major
// C = alpha op(A) op(B) + beta C, then the bias (and GELU's tanh approximation), sums in double.
#include <cmath>
#include <stdexcept>

#include "kernels/cuda/gemm.h"

namespace ptdp::kernels::cuda {

struct Gemm::Impl {
  size_t plans = 0;
};
Gemm::Gemm(size_t) : impl_(std::make_unique<Impl>()) {}
Gemm::~Gemm() = default;
size_t Gemm::cached_plans() const {
  return impl_->plans;
}
void Gemm::run(const GemmArgs& g, cudaStream_t) {
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || !g.a || !g.b || !g.c)
    throw std::invalid_argument("Gemm::run: empty shape or null operand");
  if (g.epilogue != Epilogue::kNone && !g.bias)
    throw std::invalid_argument("Gemm::run: the epilogue needs a bias");
  ++impl_->plans;
  const cudaDataType ct = g.c_fp32 ? CUDA_R_32F : CUDA_R_16BF;
  for (int64_t i = 0; i < g.m; ++i)
    for (int64_t j = 0; j < g.n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < g.k; ++p) {
        const double a = load(g.a, CUDA_R_16BF, g.trans_a ? p * g.m + i : i * g.k + p);
        const double b = load(g.b, CUDA_R_16BF, g.trans_b ? j * g.k + p : p * g.n + j);
        s += a * b;
      }
      double v = g.alpha * s + (g.beta != 0.0f ? g.beta * load(g.c, ct, i * g.n + j) : 0.0);
      if (g.epilogue != Epilogue::kNone) v += load(g.bias, CUDA_R_16BF, j);
      if (g.epilogue == Epilogue::kBiasGelu)
        v = 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
      store(g.c, ct, i * g.n + j, v);
    }
}

}  // namespace ptdp::kernels::cuda
