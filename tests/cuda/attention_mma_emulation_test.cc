// The tensor-core flash-attention kernels (kernels/cuda/attention_mma.cu) run on the host under
// tests/cuda/emulated_cuda.h (every CUDA thread a fiber, mma.sync emulated from the PTX
// fragment layout) against their CPU twin, causal_attention_* (kernels/cpu/fused.h). This checks
// the kernels' own logic (fragment loads, the register reuse of accumulators as operands, masks,
// the online softmax, the tiling at awkward sequence lengths, grouped queries) on any machine;
// the GPU tests (attention_test.cc) check the same kernels on the hardware.

#define PTDP_MMA_EMULATION 1
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "kernels/cpu/fused.h"
#include "kernels/cuda/attention_mma.cu"  // NOLINT: the kernels themselves, compiled for the host

namespace ptdp::kernels::cuda::attention {
namespace {

using Floats = std::vector<float>;
using Bf16s = std::vector<bf16>;

// bf16-rounded random values, as bf16 and as the floats they are.
void random_bf16(size_t n, uint32_t seed, Bf16s& b, Floats& f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  b.resize(n);
  f.resize(n);
  for (size_t i = 0; i < n; ++i) {
    b[i] = __float2bfloat16_rn(u(gen));
    f[i] = __bfloat162float(b[i]);
  }
}
Floats floats(const Bf16s& b) {
  Floats f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = __bfloat162float(b[i]);
  return f;
}
float max_abs(const Floats& x) {
  float m = 0;
  for (float v : x) m = std::max(m, std::abs(v));
  return m;
}
void expect_close(const Floats& got, const Floats& want, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(got[i] - want[i]) <= atol + rtol * std::abs(want[i])))
      if (bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements differ; first "
                     << first << ": " << got[first] << " against " << want[first];
}

struct Shape {
  int64_t b, s, hq, hk, d;
};

template <int D>
void check(const Shape& sh) {
  const auto [b, s, hq, hk, d] = sh;
  ASSERT_EQ(d, D);
  const size_t nq = b * s * hq * d, nk = b * s * hk * d;
  Bf16s q, k, v, dout;
  Floats qf, kf, vf, dof;
  random_bf16(nq, 1, q, qf);
  random_bf16(nk, 2, k, kf);
  random_bf16(nk, 3, v, vf);
  random_bf16(nq, 4, dout, dof);
  const int si = static_cast<int>(s), hqi = static_cast<int>(hq), hki = static_cast<int>(hk);
  const unsigned tiles = static_cast<unsigned>((s + kRowTile - 1) / kRowTile);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  Bf16s out(nq);
  Floats lse(b * hq * s);
  emu::launch({tiles, static_cast<unsigned>(hq), static_cast<unsigned>(b)}, kMmaThreads, 0, [&] {
    mma_forward_kernel<D>(q.data(), k.data(), v.data(), out.data(), lse.data(), si, hqi, hki,
                          scale * kLog2e);
  });
  Floats out_want(nq), lse_want(b * hq * s);
  causal_attention_forward(qf.data(), kf.data(), vf.data(), out_want.data(), lse_want.data(), b, s,
                           hq, hk, d);
  expect_close(floats(out), out_want, 1e-2, 1e-2, "output");
  expect_close(lse, lse_want, 1e-4, 1e-3, "log-sum-exp");

  // Backward from the kernel's own output and lse; delta = rowsum(dout * out) as launch_delta.
  const Floats outf = floats(out);
  Floats delta(b * hq * s);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t pos = 0; pos < s; ++pos)
      for (int64_t h = 0; h < hq; ++h) {
        float acc = 0;
        for (int64_t e = 0; e < d; ++e) {
          const size_t i = ((bi * s + pos) * hq + h) * d + e;
          acc += dof[i] * outf[i];
        }
        delta[(bi * hq + h) * s + pos] = acc;
      }
  Bf16s dq(nq), dk(nk), dv(nk);
  const size_t kv_smem = (2 * kRowTile + 2 * kBwdCols) * kMmaPitch<D> * 2 + 2 * kBwdCols * 4;
  emu::launch({tiles, static_cast<unsigned>(hk), static_cast<unsigned>(b)}, kMmaThreads, kv_smem,
              [&] {
                mma_backward_kv_kernel<D>(q.data(), k.data(), v.data(), lse.data(), delta.data(),
                                          dout.data(), dk.data(), dv.data(), si, hqi, hki, scale);
              });
  emu::launch({tiles, static_cast<unsigned>(hq), static_cast<unsigned>(b)}, kMmaThreads, kv_smem,
              [&] {
                mma_backward_q_kernel<D>(q.data(), k.data(), v.data(), lse.data(), delta.data(),
                                         dout.data(), dq.data(), si, hqi, hki, scale);
              });
  Floats dq_want(nq), dk_want(nk), dv_want(nk);
  causal_attention_backward(qf.data(), kf.data(), vf.data(), outf.data(), lse.data(), dof.data(),
                            dq_want.data(), dk_want.data(), dv_want.data(), b, s, hq, hk, d);
  expect_close(floats(dq), dq_want, 2e-2 * max_abs(dq_want), 1e-2, "dq");
  expect_close(floats(dk), dk_want, 2e-2 * max_abs(dk_want), 1e-2, "dk");
  expect_close(floats(dv), dv_want, 2e-2 * max_abs(dv_want), 1e-2, "dv");
}

TEST(FlashAttentionMmaEmulated, GroupedQueriesHeadDim64PartialTiles) {
  check<64>({1, 70, 4, 2, 64});  // two query tiles, the second partial; two query heads per group
}

TEST(FlashAttentionMmaEmulated, TwoSequencesHeadDim128ShorterThanATile) {
  check<128>({2, 21, 2, 2, 128});
}

TEST(FlashAttentionMmaEmulated, MultiQueryHeadDim64) {
  check<64>({1, 33, 3, 1, 64});  // one key/value head for three query heads
}

}  // namespace
}  // namespace ptdp::kernels::cuda::attention
