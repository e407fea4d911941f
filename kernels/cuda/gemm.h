// GEMMs through cuBLASLt: bf16 inputs, fp32 accumulation, bf16 or fp32 output, with the bias and
// bias + GELU epilogues fused into the matmul. The Gemm object owns a cuBLASLt handle and a
// workspace and caches, per shape, the matmul descriptor, the matrix layouts and the algorithm
// the heuristic picked, so a training step asks the heuristic once per distinct GEMM. CPU twin:
// linear_forward / linear_backward in kernels/cpu/kernels.h (and gelu_forward for the epilogue).
#pragma once

#include <cstddef>
#include <memory>

#include "kernels/cuda/common.h"

namespace ptdp::kernels::cuda {

enum class Epilogue { kNone, kBias, kBiasGelu };

// Row-major C[m, n] = alpha * op(A) op(B) + beta * C, then the epilogue (bias[n] added to every
// row; GELU's tanh approximation after it). op(A) is [m, k]: A is stored [m, k], or [k, m] when
// trans_a. op(B) is [k, n]: B is stored [k, n], or [n, k] when trans_b. So, for a linear layer
// with W [out, in]:
//   forward   y[n, out]   = x[n, in] W^T   : A = x, B = W (trans_b)
//   backward  dx[n, in]   = dy[n, out] W   : A = dy, B = W
//             dW[out, in] += dy^T x        : A = dy (trans_a), B = x, fp32 C, beta = 1
struct GemmArgs {
  int64_t m = 0, n = 0, k = 0;
  const bf16* a = nullptr;
  bool trans_a = false;
  const bf16* b = nullptr;
  bool trans_b = false;
  void* c = nullptr;  // bf16, or fp32 when c_fp32
  bool c_fp32 = false;
  float alpha = 1.0f, beta = 0.0f;
  Epilogue epilogue = Epilogue::kNone;
  const bf16* bias = nullptr;  // [n], for kBias and kBiasGelu
};

class Gemm {
 public:
  explicit Gemm(size_t workspace_bytes = size_t{32} << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // Queues the GEMM on `stream`. Throws std::invalid_argument for bad shapes or a missing bias,
  // std::runtime_error when cuBLASLt has no algorithm for it or fails.
  void run(const GemmArgs& args, cudaStream_t stream);
  // How many distinct GEMM configurations have been planned (cache entries).
  size_t cached_plans() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ptdp::kernels::cuda
