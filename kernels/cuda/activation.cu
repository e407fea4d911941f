// Bias + GELU and SwiGLU kernels (kernels/cuda/activation.h): elementwise, grid-stride loops;
// bias + GELU and SwiGLU 8 bf16 at a time where rows and pointers allow (vectorizable,
// common.cuh).
#include "kernels/cuda/activation.h"
#include "kernels/cuda/common.cuh"

namespace ptdp::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)

// GELU's tanh approximation, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), as
// x * sigmoid(2u) = x / (1 + e^(-2u)), on the fast exponential (ex2.approx) and division. Its
// derivative: sigmoid(2u) + 2 x sigmoid(2u) (1 - sigmoid(2u)) u'. An element-wise kernel has a
// budget of instructions an element at the copy bandwidth (about 30 for the forward pass, on 16
// bytes read and written an 8-element vector, at an H200's 4.2 TB/s over 132 SMs issuing 128
// thread-instructions a clock): tanhf alone took some twenty, and the forward kernel reached 69%
// of the copy. This form takes about 10. e^(-2u) overflows to infinity for x below about -10,
// where the quotient is 0 (GELU's limit) and the sigmoid 0. In fp32 over [-20, 20] it is within
// 5e-7 of the tanhf form, and its derivative within 2e-6.
__device__ __forceinline__ float gelu_sigmoid(float x) {  // sigmoid(2u)
  const float u = kGeluC * (x + 0.044715f * x * x * x);
  return __fdividef(1.0f, 1.0f + __expf(-2.0f * u));
}
__device__ __forceinline__ float gelu(float x) {
  return x * gelu_sigmoid(x);
}
__device__ __forceinline__ float gelu_grad(float x) {
  const float s = gelu_sigmoid(x);
  const float du = kGeluC * (1.0f + 3.0f * 0.044715f * x * x);
  return s + 2.0f * x * s * (1.0f - s) * du;
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
  struct In {
    Bf16x8 x, dy;
  };
  __device__ In load(int64_t r, int64_t c0) const {
    const int64_t i = r * cols + c0;
    return {*reinterpret_cast<const Bf16x8*>(x + i), *reinterpret_cast<const Bf16x8*>(dy + i)};
  }
  __device__ void operator()(int64_t r, int64_t c0, const In& in, float (&out)[1][kVec]) const {
    float* v = out[0];
    Bf16x8 b{};
    if (bias) b = *reinterpret_cast<const Bf16x8*>(bias + c0);  // 16-byte aligned: c0 % 8 == 0
    Bf16x8 o;
    for (int j = 0; j < kVec; ++j) {
      const float pre = to_float(in.x.v[j]) + (bias ? to_float(b.v[j]) : 0.0f);
      v[j] = to_float(in.dy.v[j]) * gelu_grad(pre);
      o.v[j] = to_bf16(v[j]);
    }
    *reinterpret_cast<Bf16x8*>(dx + r * cols + c0) = o;  // after dy's load: dx may be dy
  }
};

__global__ void bias_gelu_backward_kernel(const bf16* x, const bf16* bias, const bf16* dy, bf16* dx,
                                          int64_t n, int64_t cols) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dx[i] = to_bf16(bias_gelu_dx(x, bias, dy, i, i % cols));
}

// The same per element, 8 at a time (vectorizable(cols, ...)), by columns and rows: a thread
// takes one vector of columns, its bias vector loaded once, in kGeluRows rows of a row group
// (blockIdx.y, then every gridDim.y-th group), every row's load issued before the first store.
// (A grid-stride loop over the flat array spent a 64-bit division and 8 scalar bias loads on
// every vector, and kept one load in flight a thread.)
constexpr int kGeluThreads = 128, kGeluRows = 4;
__global__ void __launch_bounds__(kGeluThreads)
    bias_gelu_forward_vec_kernel(const bf16* x, const bf16* bias, bf16* y, int64_t rows,
                                 int64_t cols) {
  const int64_t cv = cols / kVec, c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cv) return;
  Bf16x8 b{};
  if (bias) b = reinterpret_cast<const Bf16x8*>(bias)[c];
  const Bf16x8* xv = reinterpret_cast<const Bf16x8*>(x);
  Bf16x8* yv = reinterpret_cast<Bf16x8*>(y);
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kGeluRows; r0 < rows;
       r0 += static_cast<int64_t>(gridDim.y) * kGeluRows) {
    Bf16x8 a[kGeluRows]{};
#pragma unroll
    for (int u = 0; u < kGeluRows; ++u)
      if (r0 + u < rows) a[u] = xv[(r0 + u) * cv + c];
#pragma unroll
    for (int u = 0; u < kGeluRows; ++u) {
      if (r0 + u >= rows) continue;
      Bf16x8 o;
      for (int j = 0; j < kVec; ++j)
        o.v[j] = to_bf16(gelu(to_float(a[u].v[j]) + (bias ? to_float(b.v[j]) : 0.0f)));
      yv[(r0 + u) * cv + c] = o;
    }
  }
}
// dx alone, 8 elements a thread, by columns and rows as the forward kernel (BiasGeluGradVec
// without the column sum).
__global__ void __launch_bounds__(kGeluThreads)
    bias_gelu_backward_vec_kernel(BiasGeluGradVec f, int64_t rows) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (c0 >= f.cols) return;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kGeluRows; r0 < rows;
       r0 += static_cast<int64_t>(gridDim.y) * kGeluRows) {
    BiasGeluGradVec::In in[kGeluRows]{};
#pragma unroll
    for (int u = 0; u < kGeluRows; ++u)
      if (r0 + u < rows) in[u] = f.load(r0 + u, c0);
#pragma unroll
    for (int u = 0; u < kGeluRows; ++u) {
      if (r0 + u >= rows) continue;
      float unused[1][kVec];
      f(r0 + u, c0, in[u], unused);
    }
  }
}
// Without a bias, GELU is element-wise and any shape of the same elements will do: a long row
// (the runtime's plain GELU over a whole activation comes as one row of n) is taken as rows of
// kGeluCols down to a block's width of columns (kGeluThreads vectors), so that each thread has
// kGeluRows vectors in flight, not one. (Narrower rows would leave most of a block idle.)
constexpr int64_t kGeluCols = 8192;
void reshape_without_bias(const bf16* bias, int64_t& rows, int64_t& cols) {
  if (bias || cols <= kGeluCols) return;
  const int64_t n = rows * cols;
  for (int64_t c = kGeluCols; c >= kGeluThreads * kVec; c /= 2)
    if (n % c == 0) {
      rows = n / c, cols = c;
      return;
    }
}
// The grid of the two kernels above: column vectors over x, row groups over y (at most 65535).
dim3 gelu_grid(int64_t rows, int64_t cols) {
  const int64_t groups = (rows + kGeluRows - 1) / kGeluRows;
  return dim3(blocks_for(cols / kVec, kGeluThreads),
              static_cast<unsigned>(groups < 65535 ? groups : 65535));
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
  reshape_without_bias(bias, rows, cols);
  if (vectorizable(cols, {x, bias, y})) {
    PTDP_KERNEL_LAUNCH(bias_gelu_forward_vec_kernel, gelu_grid(rows, cols), kGeluThreads, 0, stream)
    (x, bias, y, rows, cols);
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
  if (!dbias) reshape_without_bias(bias, rows, cols);
  if (vectorizable(cols, {x, bias, dy, dx})) {
    PTDP_KERNEL_LAUNCH(bias_gelu_backward_vec_kernel, gelu_grid(rows, cols), kGeluThreads, 0,
                       stream)
    (BiasGeluGradVec{x, bias, dy, dx, cols}, rows);
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
