// Bias + GELU and SwiGLU kernels (kernels/cuda/activation.h): elementwise, grid-stride loops;
// bias + GELU and SwiGLU 8 bf16 at a time where rows and pointers allow (vectorizable,
// common.cuh).
#include "kernels/cuda/activation.h"
#include "kernels/cuda/common.cuh"

namespace ptdp::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)

// tanh(u) = 1 - 2 / (1 + e^(2u)) on the fast exponential (ex2.approx) and division: a handful
// of instructions where tanhf takes some twenty and a branch. At 16-byte vectors the bias + GELU
// kernels have about 30 instructions an element to spend at an H200's copy bandwidth, and the
// forward one reached 69% of it (a count, not a profile: unmeasured since). |u| is capped at 9,
// where tanh is 1 in fp32. Within 1e-6 of tanhf, far inside the bf16 output's rounding.
__device__ __forceinline__ float fast_tanh(float u) {
  const float e = __expf(2.0f * fminf(fmaxf(u, -9.0f), 9.0f));
  return 1.0f - __fdividef(2.0f, 1.0f + e);
}
__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.0f + fast_tanh(kGeluC * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float gelu_grad(float x) {
  const float th = fast_tanh(kGeluC * (x + 0.044715f * x * x * x));
  const float du = kGeluC * (1.0f + 3.0f * 0.044715f * x * x);
  return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
}

__global__ void bias_gelu_forward_kernel(const bf16* x, const bf16* bias, bf16* y, int64_t n,
                                         int64_t cols) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float pre = to_float(x[i]) + (bias ? to_float(bias[i % cols]) : 0.0f);
    y[i] = to_bf16(gelu(pre));
  }
}

__device__ __forceinline__ float bias_gelu_dx(const bf16* x, const bf16* bias, const bf16* dy,
                                              int64_t i, int64_t c) {
  const float pre = to_float(x[i]) + (bias ? to_float(bias[c]) : 0.0f);
  return to_float(dy[i]) * gelu_grad(pre);
}

struct BiasGeluGrad {
  const bf16 *x, *bias, *dy;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const {
    return bias_gelu_dx(x, bias, dy, r * cols + c, c);
  }
};

// dx of 8 columns of a row from 16-byte loads, giving the same values (unrounded) for the bias
// gradient's column sum (column_sum_vec): x and dy read once, where a column sum and then dx
// read them twice.
struct BiasGeluGradVec {
  static constexpr int kOutputs = 1;
  const bf16 *x, *bias, *dy;
  bf16* dx;
  int64_t cols;
  __device__ void operator()(int64_t r, int64_t c0, float (&out)[1][kVec]) const {
    float* v = out[0];
    const int64_t i = r * cols + c0;
    const Bf16x8 a = *reinterpret_cast<const Bf16x8*>(x + i);
    const Bf16x8 d = *reinterpret_cast<const Bf16x8*>(dy + i);
    Bf16x8 o;
    for (int j = 0; j < kVec; ++j) {
      const float pre = to_float(a.v[j]) + (bias ? to_float(bias[c0 + j]) : 0.0f);
      v[j] = to_float(d.v[j]) * gelu_grad(pre);
      o.v[j] = to_bf16(v[j]);
    }
    *reinterpret_cast<Bf16x8*>(dx + i) = o;  // after dy's load: dx may be dy
  }
};

__global__ void bias_gelu_backward_kernel(const bf16* x, const bf16* bias, const bf16* dy, bf16* dx,
                                          int64_t n, int64_t cols) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dx[i] = to_bf16(bias_gelu_dx(x, bias, dy, i, i % cols));
}

// The same per element, 8 at a time (vectorizable(cols, ...)): row-major, so the 8 elements of a
// vector share a row and have consecutive columns.
__global__ void bias_gelu_forward_vec_kernel(const Bf16x8* x, const bf16* bias, Bf16x8* y,
                                             int64_t nvec, int64_t cols) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Bf16x8 a = x[i];
    const int64_t c = i * kVec % cols;
    Bf16x8 o;
    for (int j = 0; j < kVec; ++j)
      o.v[j] = to_bf16(gelu(to_float(a.v[j]) + (bias ? to_float(bias[c + j]) : 0.0f)));
    y[i] = o;
  }
}
// dx alone, 8 elements a thread (BiasGeluGradVec without the column sum).
__global__ void bias_gelu_backward_vec_kernel(BiasGeluGradVec f, int64_t nvec) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float unused[1][kVec];
    f(i * kVec / f.cols, i * kVec % f.cols, unused);
  }
}

__global__ void swiglu_forward_kernel(const bf16* x, bf16* y, int64_t n, int64_t f) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n * f;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / f, j = i % f;
    const float g = to_float(x[row * 2 * f + j]), u = to_float(x[row * 2 * f + f + j]);
    y[i] = to_bf16(g / (1.0f + __expf(-g)) * u);
  }
}

__global__ void swiglu_backward_kernel(const bf16* x, const bf16* dy, bf16* dx, int64_t n,
                                       int64_t f) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n * f;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / f, j = i % f;
    const float g = to_float(x[row * 2 * f + j]), u = to_float(x[row * 2 * f + f + j]);
    const float sig = 1.0f / (1.0f + __expf(-g)), d = to_float(dy[i]);
    dx[row * 2 * f + j] = to_bf16(d * u * sig * (1.0f + g * (1.0f - sig)));
    dx[row * 2 * f + f + j] = to_bf16(d * g * sig);
  }
}

// SwiGLU 8 columns at a time (f a multiple of 8, pointers 16-byte aligned). Output vector i's
// gate and up vectors in x ([n, 2f]: gate columns [0, f), up [f, 2f)); `at` is the gate vector's
// offset, the up one's at + f, in x and dx alike.
struct GateUp {
  int64_t at;
  Bf16x8 g, u;
};
__device__ __forceinline__ GateUp gate_up(const bf16* x, int64_t i, int64_t f) {
  const int64_t fv = f / kVec, at = i / fv * 2 * f + i % fv * kVec;
  return {at, *reinterpret_cast<const Bf16x8*>(x + at),
          *reinterpret_cast<const Bf16x8*>(x + at + f)};
}
__global__ void swiglu_forward_vec_kernel(const bf16* x, bf16* y, int64_t n, int64_t f) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n * f / kVec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const GateUp in = gate_up(x, i, f);
    Bf16x8 o;
    for (int e = 0; e < kVec; ++e) {
      const float g = to_float(in.g.v[e]), u = to_float(in.u.v[e]);
      o.v[e] = to_bf16(g / (1.0f + __expf(-g)) * u);
    }
    reinterpret_cast<Bf16x8*>(y)[i] = o;
  }
}
__global__ void swiglu_backward_vec_kernel(const bf16* x, const bf16* dy, bf16* dx, int64_t n,
                                           int64_t f) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n * f / kVec;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const GateUp in = gate_up(x, i, f);
    const Bf16x8 dv = reinterpret_cast<const Bf16x8*>(dy)[i];
    Bf16x8 dg, du;
    for (int e = 0; e < kVec; ++e) {
      const float g = to_float(in.g.v[e]), u = to_float(in.u.v[e]);
      const float sig = 1.0f / (1.0f + __expf(-g)), d = to_float(dv.v[e]);
      dg.v[e] = to_bf16(d * u * sig * (1.0f + g * (1.0f - sig)));
      du.v[e] = to_bf16(d * g * sig);
    }
    *reinterpret_cast<Bf16x8*>(dx + in.at) = dg;
    *reinterpret_cast<Bf16x8*>(dx + in.at + f) = du;
  }
}

}  // namespace

void bias_gelu_forward(const bf16* x, const bf16* bias, bf16* y, int64_t rows, int64_t cols,
                       cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n <= 0) return;
  if (vectorizable(cols, {x, bias, y})) {
    PTDP_KERNEL_LAUNCH(bias_gelu_forward_vec_kernel, grid_for(n / kVec), kThreads, 0, stream)
    (reinterpret_cast<const Bf16x8*>(x), bias, reinterpret_cast<Bf16x8*>(y), n / kVec, cols);
    check_launch("bias_gelu_forward_kernel (8-element vectors)");
    return;
  }
  PTDP_KERNEL_LAUNCH(bias_gelu_forward_kernel, grid_for(n), kThreads, 0, stream)
  (x, bias, y, n, cols);
  check_launch("bias_gelu_forward_kernel");
}

void bias_gelu_backward(const bf16* x, const bf16* bias, const bf16* dy, bf16* dx, float* dbias,
                        int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n <= 0) return;
  if (dbias && vectorizable(cols, {x, bias, dy, dx})) {  // dx and the bias gradient in one pass
    column_sum_vec(BiasGeluGradVec{x, bias, dy, dx, cols}, {dbias}, rows, cols, stream);
    return;
  }
  // The bias gradient reads dy, so it runs before dx (which may alias dy) is written.
  if (dbias) column_sum(BiasGeluGrad{x, bias, dy, cols}, dbias, rows, cols, stream);
  if (vectorizable(cols, {x, bias, dy, dx})) {
    PTDP_KERNEL_LAUNCH(bias_gelu_backward_vec_kernel, grid_for(n / kVec), kThreads, 0, stream)
    (BiasGeluGradVec{x, bias, dy, dx, cols}, n / kVec);
    check_launch("bias_gelu_backward_kernel (8-element vectors)");
    return;
  }
  PTDP_KERNEL_LAUNCH(bias_gelu_backward_kernel, grid_for(n), kThreads, 0, stream)
  (x, bias, dy, dx, n, cols);
  check_launch("bias_gelu_backward_kernel");
}

void swiglu_forward(const bf16* x, bf16* y, int64_t n, int64_t f, cudaStream_t stream) {
  if (n * f <= 0) return;
  if (vectorizable(f, {x, y})) {
    PTDP_KERNEL_LAUNCH(swiglu_forward_vec_kernel, grid_for(n * f / kVec), kThreads, 0, stream)
    (x, y, n, f);
    check_launch("swiglu_forward_kernel (8-element vectors)");
    return;
  }
  PTDP_KERNEL_LAUNCH(swiglu_forward_kernel, grid_for(n * f), kThreads, 0, stream)(x, y, n, f);
  check_launch("swiglu_forward_kernel");
}

void swiglu_backward(const bf16* x, const bf16* dy, bf16* dx, int64_t n, int64_t f,
                     cudaStream_t stream) {
  if (n * f <= 0) return;
  if (vectorizable(f, {x, dy, dx})) {
    PTDP_KERNEL_LAUNCH(swiglu_backward_vec_kernel, grid_for(n * f / kVec), kThreads, 0, stream)
    (x, dy, dx, n, f);
    check_launch("swiglu_backward_kernel (8-element vectors)");
    return;
  }
  PTDP_KERNEL_LAUNCH(swiglu_backward_kernel, grid_for(n * f), kThreads, 0, stream)(x, dy, dx, n, f);
  check_launch("swiglu_backward_kernel");
}

}  // namespace ptdp::kernels::cuda
