// Rotary embedding kernels (kernels/cuda/rope.h). The angle is computed in fp64 (as the CPU
// twin does; fp32 loses ~1e-3 rad at j ~ 8k). The general kernel: one thread per (position j,
// pair i), applied to that pair in every sequence and head, rows read with consecutive i
// coalesced; the vector kernel below where the head dimension allows it.
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

// The same rotation 8 pairs a thread, as 16-byte vectors of each half of the row (half a
// multiple of 8, x 16-byte aligned), and kRopeRows (sequence, head) rows a thread, blockIdx.y
// choosing them: the scalar kernel's 2-byte accesses, one row at a time, moved 43% of an
// H100's copy bandwidth. The angles (a pow and a sincos in fp64 each) are the costly part: at
// 4 rows a thread they were, by a count of instructions, some 50 fp64 instructions a pair, which
// would be most of an H200's 71 us on the bench's layer (44% of the copy; the split between
// angles and memory is an estimate, not measured); at 16 rows a quarter of that. The rows are
// loaded kRopeBatch at a time before any is written, so that loads are in flight together (the
// compiler cannot move a row's load above the previous row's store: they may alias).
constexpr int kRopeRows = 16, kRopeBatch = 4;
__global__ void rope_vector_kernel(bf16* x, int64_t b, int64_t s, int64_t heads, int64_t d,
                                   double base, bool inverse) {
  const int64_t half = d / 2, groups = half / kVec;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= s * groups) return;
  const int64_t j = idx / groups, i0 = idx % groups * kVec;
  float c[kVec], sv[kVec];
  for (int k = 0; k < kVec; ++k) {
    const double angle = static_cast<double>(j) *
                         pow(base, -2.0 * static_cast<double>(i0 + k) / static_cast<double>(d));
    double sn, cs;
    sincos(angle, &sn, &cs);
    c[k] = static_cast<float>(cs);
    sv[k] = static_cast<float>(inverse ? -sn : sn);
  }
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRopeRows;
  const int64_t r1 = r0 + kRopeRows < b * heads ? r0 + kRopeRows : b * heads;
  for (int64_t rb = r0; rb < r1; rb += kRopeBatch) {
    Bf16x8* lo[kRopeBatch] = {};
    Bf16x8* hi[kRopeBatch] = {};
    Bf16x8 a[kRopeBatch]{}, bv[kRopeBatch]{};
#pragma unroll
    for (int q = 0; q < kRopeBatch; ++q) {
      const int64_t r = rb + q;
      if (r >= r1) continue;
      bf16* v = x + ((r / heads * s + j) * heads + r % heads) * d + i0;
      lo[q] = reinterpret_cast<Bf16x8*>(v);
      hi[q] = reinterpret_cast<Bf16x8*>(v + half);
      a[q] = *lo[q];
      bv[q] = *hi[q];
    }
#pragma unroll
    for (int q = 0; q < kRopeBatch; ++q) {
      if (!lo[q]) continue;
      Bf16x8 ya, yb;
      for (int k = 0; k < kVec; ++k) {
        const float x1 = to_float(a[q].v[k]), x2 = to_float(bv[q].v[k]);
        ya.v[k] = to_bf16(x1 * c[k] - x2 * sv[k]);
        yb.v[k] = to_bf16(x2 * c[k] + x1 * sv[k]);
      }
      *lo[q] = ya;
      *hi[q] = yb;
    }
  }
}

}  // namespace

void rope(bf16* x, int64_t b, int64_t s, int64_t heads, int64_t d, double base, bool inverse,
          cudaStream_t stream) {
  if (d <= 0 || d % 2 != 0) throw std::invalid_argument("rope: head dimension d must be even");
  if (b <= 0 || s <= 0 || heads <= 0) return;
  if (vectorizable(d / 2, {x}) && (b * heads + kRopeRows - 1) / kRopeRows <= 65535) {
    const dim3 grid(blocks_for(s * (d / 2 / kVec), 256),
                    static_cast<unsigned>((b * heads + kRopeRows - 1) / kRopeRows));
    PTDP_KERNEL_LAUNCH(rope_vector_kernel, grid, 256, 0, stream)
    (x, b, s, heads, d, base, inverse);
    check_launch("rope_vector_kernel");
    return;
  }
  PTDP_KERNEL_LAUNCH(rope_kernel, blocks_for(s * (d / 2), 256), 256, 0, stream)
  (x, b, s, heads, d, base, inverse);
  check_launch("rope_kernel");
}

}  // namespace ptdp::kernels::cuda
