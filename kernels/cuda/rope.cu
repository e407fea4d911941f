// Rotary embedding kernel (kernels/cuda/rope.h). One thread per (position j, pair i): the angle
// is computed once in fp64 (as the CPU twin does; fp32 loses ~1e-3 rad at j ~ 8k) and applied
// to that pair in every sequence and head, rows read with consecutive i coalesced.
#include <stdexcept>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rope.h"

namespace ptdp::kernels::cuda {
namespace {

__global__ void rope_kernel(bf16* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base,
                            bool inverse) {
  const int64_t half = d / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= s * half) return;
  const int64_t j = idx / half, i = idx % half;
  const double angle =
      static_cast<double>(j) * pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
  double sn, cs;
  sincos(angle, &sn, &cs);
  const float c = static_cast<float>(cs), sv = static_cast<float>(inverse ? -sn : sn);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t h = 0; h < heads; ++h) {
      bf16* v = x + ((bi * s + j) * heads + h) * d;
      const float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
      v[i] = to_bf16(x1 * c - x2 * sv);
      v[i + half] = to_bf16(x2 * c + x1 * sv);
    }
}

}  // namespace

void rope(bf16* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base, bool inverse,
          cudaStream_t stream) {
  if (d <= 0 || d % 2 != 0) throw std::invalid_argument("rope: head dimension d must be even");
  if (b <= 0 || s <= 0 || heads <= 0) return;
  PTDP_KERNEL_LAUNCH(rope_kernel, blocks_for(s * (d / 2), 256), 256, 0, stream)
  (x, b, s, heads, d, base, inverse);
  check_launch("rope_kernel");
}

}  // namespace ptdp::kernels::cuda
