// Rotary embedding kernels (kernels/cuda/rope.h). The angle is computed or reduced in fp64 (the
// CPU twin computes it in fp64; fp32 loses ~1e-3 rad at j ~ 8k). The general kernel: one thread
// per (position j, pair i), applied to that pair in every sequence and head, rows read with
// consecutive i coalesced; the vector kernel below where the head dimension allows it.
#include <cmath>
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
// H100's copy bandwidth. The rows are loaded kRopeBatch at a time before any is written, so
// that loads are in flight together (the compiler cannot move a row's load above the previous
// row's store: they may alias). 122 registers a thread (ptxas, sm_90), two blocks an SM, each
// thread with 4 rows in flight; 2 rows a batch take 80 registers and 3 blocks, fewer bytes in
// flight an SM.
// The angles: a pow and a sincos in fp64 for each of a thread's 8 pairs were, by a count of
// instructions, most of the 71 us an H200 took on the bench's layer (44% of the copy;
// unprofiled). Now the frequency of pair i is ratio^i, with ratio = base^(-2/d) from the host:
// ratio^i0 by squaring, then a multiply a pair, in fp64. The
// angle j * frequency is reduced to [-pi, pi] in fp64 (exact to about 1e-10 rad up to 2^20
// positions), then turned to a sine and cosine in fp32 by __sincosf (within 4e-7 there). The CPU
// twin's fp64 angles differ by less than 1e-6 rad, far below a bf16 rounding; fp32 angles
// throughout would be 1e-3 rad off by position 8k.
constexpr int kRopeRows = 16, kRopeBatch = 4;
__device__ __forceinline__ void pair_turn(double angle, bool inverse, float& c, float& s) {
  constexpr double kTwoPi = 6.283185307179586, kInvTwoPi = 0.15915494309189535;
  const float r = static_cast<float>(fma(-rint(angle * kInvTwoPi), kTwoPi, angle));
  float sn, cs;
  __sincosf(r, &sn, &cs);
  c = cs;
  s = inverse ? -sn : sn;
}
__global__ void rope_vector_kernel(bf16* x, int64_t b, int64_t s, int64_t heads, int64_t d,
                                   double ratio, bool inverse) {
  const int64_t half = d / 2, groups = half / kVec;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= s * groups) return;
  const int64_t j = idx / groups, i0 = idx % groups * kVec;
  float c[kVec], sv[kVec];
  double frequency = 1.0, p = ratio;  // ratio^i0 by squaring
  for (int64_t e = i0; e > 0; e >>= 1, p *= p)
    if (e & 1) frequency *= p;
  for (int k = 0; k < kVec; ++k) {
    pair_turn(static_cast<double>(j) * frequency, inverse, c[k], sv[k]);
    frequency *= ratio;
  }
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRopeRows;
  const int64_t r1 = r0 + kRopeRows < b * heads ? r0 + kRopeRows : b * heads;
  // Row r is head r % heads of sequence r / heads: one division, then counted along.
  int64_t seq = r0 / heads, head = r0 % heads;
  for (int64_t rb = r0; rb < r1; rb += kRopeBatch) {
    Bf16x8* lo[kRopeBatch] = {};
    Bf16x8* hi[kRopeBatch] = {};
    Bf16x8 a[kRopeBatch]{}, bv[kRopeBatch]{};
#pragma unroll
    for (int q = 0; q < kRopeBatch; ++q) {
      if (rb + q >= r1) continue;
      bf16* v = x + ((seq * s + j) * heads + head) * d + i0;
      if (++head == heads) head = 0, ++seq;
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
    (x, b, s, heads, d, std::pow(base, -2.0 / static_cast<double>(d)), inverse);
    check_launch("rope_vector_kernel");
    return;
  }
  PTDP_KERNEL_LAUNCH(rope_kernel, blocks_for(s * (d / 2), 256), 256, 0, stream)
  (x, b, s, heads, d, base, inverse);
  check_launch("rope_kernel");
}

}  // namespace ptdp::kernels::cuda
