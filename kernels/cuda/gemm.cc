// cuBLASLt GEMM wrapper (kernels/cuda/gemm.h). cuBLASLt is column-major: a row-major [r, c]
// matrix is a column-major [c, r] one, so row-major C = op(A) op(B) is computed as column-major
// C^T = op(B)^T op(A)^T, i.e. cuBLASLt's "A" is our B and its "B" is our A, with the same
// transpose flags.
#include "kernels/cuda/gemm.h"

#include <cublasLt.h>

#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

namespace ptdp::kernels::cuda {
namespace {

void check_lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": cuBLASLt status " +
                             std::to_string(static_cast<int>(s)));
}
#define PTDP_LT_CHECK(call) check_lt((call), #call)

// The largest power of two (up to 256) dividing the address: cuBLASLt's heuristic must know the
// alignment it may assume.
uint32_t alignment(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && u % a != 0) a /= 2;
  return a;
}

struct Key {
  int64_t m, n, k;
  bool ta, tb, c32, accumulate;
  Epilogue epi;
  uint32_t align_a, align_b, align_c, align_bias;
  auto tie() const {
    return std::tie(m, n, k, ta, tb, c32, accumulate, epi, align_a, align_b, align_c, align_bias);
  }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

}  // namespace

struct Gemm::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::map<Key, std::unique_ptr<Plan>> plans;

  Plan& plan(const Key& key) {
    auto it = plans.find(key);
    if (it != plans.end()) return *it->second;
    auto p = std::make_unique<Plan>();
    PTDP_LT_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // cuBLASLt's A is our B, its B our A (see the top of this file).
    const cublasOperation_t op_a = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    PTDP_LT_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    PTDP_LT_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
    if (key.epi == Epilogue::kBias) epi = CUBLASLT_EPILOGUE_BIAS;
    if (key.epi == Epilogue::kBiasGelu) epi = CUBLASLT_EPILOGUE_GELU_BIAS;
    PTDP_LT_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (key.epi != Epilogue::kNone) {
      const cudaDataType_t bias_type = CUDA_R_16BF;
      PTDP_LT_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                   &bias_type, sizeof bias_type));
    }
    // Column-major shapes: cuBLASLt computes C' [n, m] = op(B') [n, k] op(A') [k, m].
    const uint64_t m = static_cast<uint64_t>(key.m), n = static_cast<uint64_t>(key.n),
                   k = static_cast<uint64_t>(key.k);
    PTDP_LT_CHECK(key.tb ? cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, k, n, key.k)
                         : cublasLtMatrixLayoutCreate(&p->la, CUDA_R_16BF, n, k, key.n));
    PTDP_LT_CHECK(key.ta ? cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_16BF, m, k, key.m)
                         : cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_16BF, k, m, key.k));
    PTDP_LT_CHECK(
        cublasLtMatrixLayoutCreate(&p->lc, key.c32 ? CUDA_R_32F : CUDA_R_16BF, n, m, key.n));

    cublasLtMatmulPreference_t pref = nullptr;
    PTDP_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
      PTDP_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value));
    };
    set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(workspace_bytes));
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, p->desc, p->la, p->lb, p->lc,
                                                             p->lc, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0)
      throw std::runtime_error("gemm: cuBLASLt has no algorithm for m=" + std::to_string(key.m) +
                               " n=" + std::to_string(key.n) + " k=" + std::to_string(key.k));
    p->algo = result.algo;
    return *plans.emplace(key, std::move(p)).first->second;
  }
};

Gemm::Gemm(size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  PTDP_LT_CHECK(cublasLtCreate(&impl_->handle));
  impl_->workspace_bytes = workspace_bytes;
  if (workspace_bytes > 0) {
    const cudaError_t e = cudaMalloc(&impl_->workspace, workspace_bytes);
    if (e != cudaSuccess) {
      cublasLtDestroy(impl_->handle);
      check(e, "gemm workspace");
    }
  }
}

Gemm::~Gemm() {
  impl_->plans.clear();
  if (impl_->workspace) cudaFree(impl_->workspace);
  if (impl_->handle) cublasLtDestroy(impl_->handle);
}

size_t Gemm::cached_plans() const {
  return impl_->plans.size();
}

void Gemm::run(const GemmArgs& g, cudaStream_t stream) {
  if (g.m <= 0 || g.n <= 0 || g.k <= 0)
    throw std::invalid_argument("gemm: m, n and k must be positive");
  if (!g.a || !g.b || !g.c) throw std::invalid_argument("gemm: a, b and c must be set");
  if (g.epilogue != Epilogue::kNone && !g.bias)
    throw std::invalid_argument("gemm: the bias epilogues need a bias");
  const Key key{g.m,
                g.n,
                g.k,
                g.trans_a,
                g.trans_b,
                g.c_fp32,
                g.beta != 0.0f,
                g.epilogue,
                alignment(g.a),
                alignment(g.b),
                alignment(g.c),
                g.bias ? alignment(g.bias) : 256u};
  Plan& p = impl_->plan(key);
  if (g.epilogue != Epilogue::kNone)
    PTDP_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                                 sizeof g.bias));
  PTDP_LT_CHECK(cublasLtMatmul(impl_->handle, p.desc, &g.alpha, g.b, p.la, g.a, p.lb, &g.beta, g.c,
                               p.lc, g.c, p.lc, &p.algo, impl_->workspace, impl_->workspace_bytes,
                               stream));
}

}  // namespace ptdp::kernels::cuda
