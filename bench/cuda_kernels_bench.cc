// Google Benchmark timings of the CUDA kernels (kernels/cuda/, and the MoE row moves of
// runtime/cuda/fp32_kernels.h) and a cuBLASLt GEMM, timed with
// CUDA events around each call (manual time), at the shapes of a GPT-3-like layer: hidden 4096,
// 32 heads of 128, sequence 2048, micro-batch 4, vocabulary 50304 split over t = 2 ranks.
// Counters: bytes/s for the memory-bound kernels (bytes the kernel must move at least), FLOP/s
// for the GEMM and attention. scripts/gpu-check.sh runs it; every benchmark reports an error
// where no GPU is visible.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/activation.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cross_entropy.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/grad_norm.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/rope.h"
#include "runtime/cuda/fp32_kernels.h"

namespace {

namespace kc = ptdp::kernels::cuda;
using kc::bf16;

constexpr int64_t kBatch = 4, kSeq = 2048, kHidden = 4096, kHeads = 32, kHeadDim = 128;
constexpr int64_t kTokens = kBatch * kSeq, kVocabShard = 50304 / 2;

// A device allocation filled with a constant byte pattern (small finite values for bf16/fp32).
struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) {
    PTDP_CUDA_CHECK(cudaMalloc(&p, bytes));
    PTDP_CUDA_CHECK(cudaMemset(p, 0x3c, bytes));  // bf16 0x3c3c ~ 0.0115; fp32 ~ 0.0115
  }
  ~Buf() { cudaFree(p); }
  template <typename T>
  T* as() {
    return static_cast<T*>(p);
  }
};

// Times `launch` with CUDA events; sets bytes and FLOPs per iteration as rates.
template <typename F>
void run(benchmark::State& state, double bytes, double flops, F launch) {
  cudaEvent_t start, stop;
  PTDP_CUDA_CHECK(cudaEventCreate(&start));
  PTDP_CUDA_CHECK(cudaEventCreate(&stop));
  launch();  // warm-up (and cuBLASLt's heuristic)
  PTDP_CUDA_CHECK(cudaDeviceSynchronize());
  for (auto _ : state) {
    PTDP_CUDA_CHECK(cudaEventRecord(start));
    launch();
    PTDP_CUDA_CHECK(cudaEventRecord(stop));
    PTDP_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    PTDP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms / 1e3);
  }
  if (bytes > 0)
    state.counters["bytes/s"] =
        benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  if (flops > 0)
    state.counters["FLOP/s"] =
        benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

bool have_gpu(benchmark::State& state) {
  if (kc::device_count() > 0) return true;
  state.SkipWithError("no CUDA device visible");
  for (auto _ : state) {
  }
  return false;
}

// The memory-bandwidth ceiling of this run: a 1 GiB device-to-device copy, counting the bytes
// read and written (2 GiB per copy), as the memory-bound kernels' bytes/s count theirs.
void BM_DeviceCopy(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const size_t bytes = size_t{1} << 30;
  Buf a(bytes), b(bytes);
  run(state, 2.0 * static_cast<double>(bytes), 0,
      [&] { PTDP_CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice)); });
}
BENCHMARK(BM_DeviceCopy)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_Gemm(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  Buf a(m * k * 2), b(k * n * 2), c(m * n * 2);
  kc::Gemm gemm;
  kc::GemmArgs g;
  g.m = m, g.n = n, g.k = k, g.a = a.as<bf16>(), g.b = b.as<bf16>(), g.trans_b = true, g.c = c.p;
  run(state, 0, 2.0 * m * n * k, [&] { gemm.run(g, nullptr); });
}
BENCHMARK(BM_Gemm)
    ->Args({8192, 8192, 8192})
    ->Args({kTokens, 3 * kHidden, kHidden})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// Argument 0: the tensor-core kernels; 1: the CUDA-core ones (kernels/cuda/attention.h).
kc::FlashKernel flash_kernel(benchmark::State& state) {
  const bool simt = state.range(0) == 1;
  state.SetLabel(simt ? "CUDA cores" : "tensor cores");
  return simt ? kc::FlashKernel::kSimt : kc::FlashKernel::kTensorCore;
}

void BM_FlashAttentionForward(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const kc::FlashKernel kernel = flash_kernel(state);
  const int64_t qkv = kBatch * kSeq * kHeads * kHeadDim;
  Buf q(qkv * 2), k(qkv * 2), v(qkv * 2), o(qkv * 2), lse(kBatch * kHeads * kSeq * 4);
  const double flops = 4.0 * kBatch * kHeads * kSeq * kSeq * kHeadDim / 2;  // causal half
  run(state, 0, flops, [&] {
    kc::flash_attention_forward(q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), o.as<bf16>(),
                                lse.as<float>(), kBatch, kSeq, kSeq, kHeads, kHeads, kHeadDim,
                                nullptr, kernel);
  });
}
BENCHMARK(BM_FlashAttentionForward)->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMillisecond);

void BM_FlashAttentionBackward(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const kc::FlashKernel kernel = flash_kernel(state);
  const int64_t qkv = kBatch * kSeq * kHeads * kHeadDim;
  Buf q(qkv * 2), k(qkv * 2), v(qkv * 2), o(qkv * 2), dout(qkv * 2), dq(qkv * 2), dk(qkv * 2),
      dv(qkv * 2), lse(kBatch * kHeads * kSeq * 4);
  kc::flash_attention_forward(q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), o.as<bf16>(),
                              lse.as<float>(), kBatch, kSeq, kSeq, kHeads, kHeads, kHeadDim,
                              nullptr);
  const double flops = 10.0 * kBatch * kHeads * kSeq * kSeq * kHeadDim / 2;  // 5 matmuls, causal
  run(state, 0, flops, [&] {
    kc::flash_attention_backward(q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), o.as<bf16>(),
                                 lse.as<float>(), dout.as<bf16>(), dq.as<bf16>(), dk.as<bf16>(),
                                 dv.as<bf16>(), kBatch, kSeq, kSeq, kHeads, kHeads, kHeadDim,
                                 nullptr, kernel);
  });
}
BENCHMARK(BM_FlashAttentionBackward)
    ->Arg(0)
    ->Arg(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

void BM_AddLayerNormForward(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t n = kTokens, h = kHidden;
  Buf x(n * h * 2), res(n * h * 2), r(n * h * 2), y(n * h * 2), g(h * 2), b(h * 2), mean(n * 4),
      rstd(n * 4);
  run(state, 4.0 * n * h * 2, 0, [&] {
    kc::add_layernorm_forward(x.as<bf16>(), res.as<bf16>(), r.as<bf16>(), g.as<bf16>(),
                              b.as<bf16>(), y.as<bf16>(), mean.as<float>(), rstd.as<float>(), n, h,
                              1e-5f, nullptr);
  });
}
BENCHMARK(BM_AddLayerNormForward)->UseManualTime()->Unit(benchmark::kMicrosecond);

// Arg: the width. 4096 (one block a row) and GPT-2's 768 (one warp a row), where calibrate
// timed the runtime's backward at a fixed 33-36 us for 1024 to 4096 rows (docs/gpu.md).
void BM_AddLayerNormBackward(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t n = kTokens, h = state.range(0);
  Buf r(n * h * 2), dy(n * h * 2), dres(n * h * 2), dx(n * h * 2), g(h * 2), mean(n * 4),
      rstd(n * 4), dg(h * 4), db(h * 4);
  run(state, 4.0 * n * h * 2, 0, [&] {
    kc::add_layernorm_backward(r.as<bf16>(), g.as<bf16>(), mean.as<float>(), rstd.as<float>(),
                               dy.as<bf16>(), dres.as<bf16>(), dx.as<bf16>(), dg.as<float>(),
                               db.as<float>(), n, h, nullptr);
  });
}
BENCHMARK(BM_AddLayerNormBackward)
    ->Arg(kHidden)
    ->Arg(768)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

void BM_BiasGeluForward(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t rows = kTokens, cols = 4 * kHidden / 2;  // the MLP's first GEMM output at t = 2
  Buf x(rows * cols * 2), bias(cols * 2), y(rows * cols * 2);
  run(state, 2.0 * rows * cols * 2, 0, [&] {
    kc::bias_gelu_forward(x.as<bf16>(), bias.as<bf16>(), y.as<bf16>(), rows, cols, nullptr);
  });
}
BENCHMARK(BM_BiasGeluForward)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_BiasGeluBackward(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t rows = kTokens, cols = 4 * kHidden / 2;
  Buf x(rows * cols * 2), bias(cols * 2), dy(rows * cols * 2), dx(rows * cols * 2), db(cols * 4);
  run(state, 3.0 * rows * cols * 2, 0, [&] {
    kc::bias_gelu_backward(x.as<bf16>(), bias.as<bf16>(), dy.as<bf16>(), dx.as<bf16>(),
                           db.as<float>(), rows, cols, nullptr);
  });
}
BENCHMARK(BM_BiasGeluBackward)->UseManualTime()->Unit(benchmark::kMicrosecond);

// GELU with no bias as the runtime calls it (Backend::gelu): the whole activation as one row,
// which the kernel takes as rows of up to 8192.
void BM_GeluOneRow(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t n = kTokens * 4 * kHidden / 2;
  Buf x(n * 2), y(n * 2);
  run(state, 2.0 * n * 2, 0,
      [&] { kc::bias_gelu_forward(x.as<bf16>(), nullptr, y.as<bf16>(), 1, n, nullptr); });
}
BENCHMARK(BM_GeluOneRow)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The runtime's bias + residual add (Backend::residual_add, runtime/cuda/fp32_kernels.h) and its
// backward (the bias gradient and two copies from one read) on bf16 [tokens, width], at
// width 4096 and at GPT-2's 768. Bytes: residual and branch read and the sum written; the
// gradient read and its two copies written.
void BM_ResidualAdd(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t rows = kTokens, width = state.range(0), n = rows * width;
  Buf r(n * 2), p(n * 2), bias(width * 2), out(n * 2);
  run(state, 3.0 * n * 2, 0, [&] {
    ptdp::cuda_fp32::residual_add(out.as<bf16>(), r.as<bf16>(), p.as<bf16>(), bias.as<bf16>(), rows,
                                  width, nullptr);
  });
}
BENCHMARK(BM_ResidualAdd)->Arg(kHidden)->Arg(768)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_ResidualAddBackward(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t rows = kTokens, width = state.range(0), n = rows * width;
  Buf dout(n * 2), dr(n * 2), dp(n * 2), db(width * 4);
  run(state, 3.0 * n * 2, 0, [&] {
    ptdp::cuda_fp32::residual_add_backward(dout.as<bf16>(), dr.as<bf16>(), dp.as<bf16>(),
                                           db.as<float>(), rows, width, nullptr);
  });
}
BENCHMARK(BM_ResidualAddBackward)
    ->Arg(kHidden)
    ->Arg(768)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

void BM_SwigluForward(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t n = kTokens, f = 11008 / 2;
  Buf x(n * 2 * f * 2), y(n * f * 2);
  run(state, 3.0 * n * f * 2, 0,
      [&] { kc::swiglu_forward(x.as<bf16>(), y.as<bf16>(), n, f, nullptr); });
}
BENCHMARK(BM_SwigluForward)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_CrossEntropy(benchmark::State& state) {  // stats, finish and the in-place gradient
  if (!have_gpu(state)) return;
  const int64_t n = kTokens, vl = kVocabShard;
  Buf logits(n * vl * 2), targets(n * 4), stats(n * 3 * 4), lse(n * 4), loss(n * 4);
  PTDP_CUDA_CHECK(cudaMemset(targets.p, 0, n * 4));
  run(state, 3.0 * n * vl * 2, 0, [&] {
    kc::cross_entropy_stats(logits.as<bf16>(), targets.as<int32_t>(), stats.as<float>(), n, vl, vl,
                            0, nullptr);
    kc::cross_entropy_finish(stats.as<float>(), 1, lse.as<float>(), loss.as<float>(), n, nullptr);
    kc::cross_entropy_backward(logits.as<bf16>(), targets.as<int32_t>(), lse.as<float>(), n, vl, vl,
                               0, 1.0, nullptr);
  });
}
BENCHMARK(BM_CrossEntropy)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The same loss as `ptdp run --bf16` computes it (runtime/cuda/fp32_kernels.h, not the kernels
// above): the statistics pass, the loss and lse from them, and the gradient written over the
// logits with their probabilities made in the same pass. Bytes: the logits read, then read and
// written.
void BM_RuntimeCrossEntropy(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t n = kTokens, vl = kVocabShard;
  Buf logits(n * vl * 2), targets(n * 4), stats(n * 3 * 4), lse(n * 4), loss(n * 4);
  PTDP_CUDA_CHECK(cudaMemset(targets.p, 0, n * 4));
  run(state, 3.0 * n * vl * 2, 0, [&] {
    ptdp::cuda_fp32::cross_entropy_stats(logits.as<bf16>(), targets.as<int32_t>(),
                                         stats.as<float>(), n, vl, vl, 0, nullptr);
    ptdp::cuda_fp32::cross_entropy_lse(stats.as<float>(), 1, lse.as<float>(), loss.as<float>(), n,
                                       nullptr);
    ptdp::cuda_fp32::cross_entropy_backward_from_lse(
        logits.as<bf16>(), lse.as<float>(), targets.as<int32_t>(), n, vl, vl, 0, 1.0, nullptr);
  });
}
BENCHMARK(BM_RuntimeCrossEntropy)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The embedding on a vocabulary shard of t = 2: tokens i * 7919 mod 2 vl, distinct, about half of
// them on this shard. Bytes, counted from the tokens: the forward pass reads the shard's rows
// of its tokens and the positions' rows, and writes the output; the backward pass reads the
// output gradient's rows of the shard's tokens and adds them onto their fp32 table rows (read
// and written), and reads every row of it to add the sums over the sequences onto the fp32
// position rows (read and written). (Until 2026-11-30 one benchmark timed both passes against
// 4 bf16 rows a token, leaving out the fp32 gradients' reads and writes: 268 MB of the 419 MB.)
struct EmbeddingBench {
  static constexpr int64_t h = kHidden, vl = kVocabShard;
  Buf tokens{kTokens * 4}, table{vl * h * 2}, pos{kSeq * h * 2}, y{kTokens * h * 2},
      dtable{vl * h * 4}, dpos{kSeq * h * 4};
  int64_t here = 0;  // tokens on this shard, each a distinct row
  EmbeddingBench() {
    std::vector<int32_t> tok(kTokens);
    for (int64_t i = 0; i < kTokens; ++i) {
      tok[i] = static_cast<int32_t>((i * 7919) % (2 * vl));
      here += tok[i] < vl ? 1 : 0;
    }
    PTDP_CUDA_CHECK(cudaMemcpy(tokens.p, tok.data(), kTokens * 4, cudaMemcpyHostToDevice));
  }
};

void BM_EmbeddingForward(benchmark::State& state) {
  if (!have_gpu(state)) return;
  EmbeddingBench e;
  const double bytes = (e.here + kSeq + kTokens) * e.h * 2.0;
  run(state, bytes, 0, [&] {
    kc::embedding_forward(e.tokens.as<int32_t>(), e.table.as<bf16>(), e.pos.as<bf16>(),
                          e.y.as<bf16>(), kBatch, kSeq, e.h, 0, e.vl, 0, nullptr);
  });
}
BENCHMARK(BM_EmbeddingForward)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_EmbeddingBackward(benchmark::State& state) {
  if (!have_gpu(state)) return;
  EmbeddingBench e;
  const double table_bytes = e.here * e.h * (2.0 + 2 * 4),
               pos_bytes = e.h * (kTokens * 2.0 + kSeq * 2 * 4);
  run(state, table_bytes + pos_bytes, 0, [&] {
    kc::embedding_backward(e.tokens.as<int32_t>(), e.y.as<bf16>(), e.dtable.as<float>(),
                           e.dpos.as<float>(), kBatch, kSeq, e.h, 0, e.vl, 0, nullptr);
  });
}
BENCHMARK(BM_EmbeddingBackward)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The table gradient on text-like tokens, at GPT-2-124M's shape (4096 tokens of hidden 768, one
// shard of 50304): Zipf-distributed tokens (weight 1 / rank, rank = id, as BPE vocabularies
// roughly order them; arg text 0), or byte-level text (ptdp tokenize: Zipf over the 256 byte
// values; text 1). Arg kernel 0: embedding_backward's tile kernel, each 128-row tile's block
// adding its hits 4 at a time; kernel 1: by grouped rows (ptdp run's CUDA backend; the grouping
// on the host, group_token_rows, is done once and not timed). Bytes: the dy rows of the hits
// read, each row hit read and written once in fp32; the same count for both kernels. A comparison
// of the two, not one of issue 11's shapes: neither can reach the copy bandwidth here, since the
// commonest row's hits (some 360 of the 4096 Zipf tokens) are one chain of ordered adds.
constexpr int64_t kTextTokens = 4096, kTextVocab = 50304;
std::vector<int32_t> text_tokens(bool bytes_text) {
  const int64_t ids = bytes_text ? 256 : kTextVocab;
  std::vector<double> weight(static_cast<size_t>(ids));
  for (int64_t r = 0; r < ids; ++r)
    weight[static_cast<size_t>(r)] = 1.0 / static_cast<double>(r + 1);
  std::discrete_distribution<int32_t> zipf(weight.begin(), weight.end());
  std::mt19937 g(11);
  std::vector<int32_t> tokens(kTextTokens);
  for (auto& t : tokens) t = zipf(g);
  return tokens;
}

void BM_EmbeddingTableGradText(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const bool rows = state.range(0) == 1;
  constexpr int64_t n = kTextTokens, h = 768, vl = kTextVocab;
  const std::vector<int32_t> tokens = text_tokens(state.range(1) == 1);
  std::vector<int32_t> packed, count;
  const int64_t m = kc::group_token_rows(tokens.data(), n, 0, vl, packed, count);
  Buf d_tokens(n * 4), d_packed(packed.size() * 4), dy(n * h * 2), dtable(vl * h * 4);
  PTDP_CUDA_CHECK(cudaMemcpy(d_tokens.p, tokens.data(), n * 4, cudaMemcpyHostToDevice));
  PTDP_CUDA_CHECK(cudaMemcpy(d_packed.p, packed.data(), packed.size() * 4, cudaMemcpyHostToDevice));
  state.counters["rows"] = static_cast<double>(m);
  run(state, static_cast<double>(n) * h * 2 + static_cast<double>(m) * h * 8, 0, [&] {
    if (rows)
      kc::embedding_table_grad_rows(d_packed.as<int32_t>(), m, dy.as<bf16>(), dtable.as<float>(), h,
                                    nullptr);
    else
      kc::embedding_backward(d_tokens.as<int32_t>(), dy.as<bf16>(), dtable.as<float>(), nullptr, 1,
                             n, h, 0, vl, 0, nullptr);
  });
}
BENCHMARK(BM_EmbeddingTableGradText)
    ->ArgNames({"kernel", "text"})
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// The host's part of the table gradient by rows (group_token_rows, on the CPU; no GPU needed),
// on the same tokens: text 0 Zipf over 50304 ids, text 1 byte-level.
void BM_GroupTokenRows(benchmark::State& state) {
  const std::vector<int32_t> tokens = text_tokens(state.range(0) == 1);
  std::vector<int32_t> packed, count;
  int64_t m = 0;
  for (auto _ : state) {
    m = kc::group_token_rows(tokens.data(), kTextTokens, 0, kTextVocab, packed, count);
    benchmark::DoNotOptimize(packed.data());
  }
  state.counters["rows"] = static_cast<double>(m);
}
BENCHMARK(BM_GroupTokenRows)->ArgName("text")->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

// The same forward pass as `ptdp run --bf16` makes it (runtime/cuda/fp32_kernels.h): the token
// lookup (zeros off the shard: written, not read), then the positions added in place. Bytes: the
// shard's rows read and the output written, then the output and the positions read and the
// output written.
void BM_RuntimeEmbeddingForward(benchmark::State& state) {
  if (!have_gpu(state)) return;
  EmbeddingBench e;
  const double bytes = (e.here + 3.0 * kTokens + kSeq) * e.h * 2.0;
  run(state, bytes, 0, [&] {
    ptdp::cuda_fp32::vocab_embedding_lookup(e.tokens.as<int32_t>(), e.table.as<bf16>(),
                                            e.y.as<bf16>(), kTokens, e.h, 0, e.vl, nullptr);
    ptdp::cuda_fp32::add_positions(e.y.as<bf16>(), e.pos.as<bf16>(), kBatch, kSeq, e.h, 0, nullptr);
  });
}
BENCHMARK(BM_RuntimeEmbeddingForward)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The runtime's position gradient: every row of the output gradient read, the fp32 position
// rows read and written.
void BM_RuntimePositionGrad(benchmark::State& state) {
  if (!have_gpu(state)) return;
  EmbeddingBench e;
  run(state, e.h * (kTokens * 2.0 + kSeq * 2 * 4), 0, [&] {
    ptdp::cuda_fp32::position_grad(e.y.as<bf16>(), e.dpos.as<float>(), kBatch, kSeq, e.h, 0,
                                   nullptr);
  });
}
BENCHMARK(BM_RuntimePositionGrad)->UseManualTime()->Unit(benchmark::kMicrosecond);

// QKV's output split into Q, K and V, and their gradients joined, as the runtime does each
// layer (runtime/cuda/fp32_kernels.h; heads over t = 2): every element read once, written once.
void qkv_copy(benchmark::State& state, bool join) {
  if (!have_gpu(state)) return;
  const int64_t rows = kTokens, w = kHidden / 2;
  Buf qkv(rows * 3 * w * 2), q(rows * w * 2), k(rows * w * 2), v(rows * w * 2);
  run(state, 2.0 * rows * 3 * w * 2, 0, [&] {
    if (join)
      ptdp::cuda_fp32::concat_columns3(q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), qkv.as<bf16>(),
                                       rows, w, w, w, nullptr);
    else
      ptdp::cuda_fp32::split_columns3(qkv.as<bf16>(), q.as<bf16>(), k.as<bf16>(), v.as<bf16>(),
                                      rows, w, w, w, nullptr);
  });
}
void BM_QkvSplit(benchmark::State& state) {
  qkv_copy(state, false);
}
void BM_QkvJoin(benchmark::State& state) {
  qkv_copy(state, true);
}
BENCHMARK(BM_QkvSplit)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_QkvJoin)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_Rope(benchmark::State& state) {  // queries of one layer, in place
  if (!have_gpu(state)) return;
  const int64_t n = kBatch * kSeq * kHeads * kHeadDim;
  Buf x(n * 2);
  run(state, 2.0 * n * 2, 0,
      [&] { kc::rope(x.as<bf16>(), kBatch, kSeq, kHeads, kHeadDim, 10000.0, false, nullptr); });
}
BENCHMARK(BM_Rope)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_AdamW(benchmark::State& state) {  // 100M parameters
  if (!have_gpu(state)) return;
  const int64_t n = 100'000'000;
  Buf p(n * 4), g(n * 4), m(n * 4), v(n * 4), pb(n * 2);
  ptdp::kernels::AdamW o;
  run(state, static_cast<double>(n) * (4 * 4 + 3 * 4 + 2), 0, [&] {
    kc::adamw_step(p.as<float>(), g.as<float>(), m.as<float>(), v.as<float>(), pb.as<bf16>(), n, o,
                   1, 1.0, nullptr);
  });
}
BENCHMARK(BM_AdamW)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The runtime's optimizer update (runtime/cuda/fp32_kernels.h: the gradient's scale, AdamW in
// the CPU twin's double arithmetic, the bf16 copy) over GPT-2-124M's parameters in its ~100 spans
// of alternating weight decay (a layer: the norms and biases undecayed, the four weight matrices
// decayed; the embeddings decayed). Argument 0: one launch a span, as the runtime made before
// 2026-11-30; 1: one launch for them all (adamw_update_spans), as it makes now.
void BM_AdamWUpdateSpans(benchmark::State& state) {
  if (!have_gpu(state)) return;
  namespace f = ptdp::cuda_fp32;
  const int64_t h = 768, layers = 12;
  std::vector<std::pair<int64_t, bool>> pieces = {{50304 * h, true}, {1024 * h, true}};
  for (int64_t l = 0; l < layers; ++l)
    for (const auto& piece : std::vector<std::pair<int64_t, bool>>{{2 * h, false},
                                                                   {3 * h * h, true},
                                                                   {3 * h, false},
                                                                   {h * h, true},
                                                                   {3 * h, false},
                                                                   {4 * h * h, true},
                                                                   {4 * h, false},
                                                                   {4 * h * h, true},
                                                                   {h, false}})
      pieces.push_back(piece);
  pieces.push_back({2 * h, false});
  std::vector<f::AdamWSpan> spans;
  int64_t n = 0;
  for (const auto& [len, decay] : pieces) {
    if (!spans.empty() && spans.back().decay == decay)
      spans.back().n += len;
    else
      spans.push_back({n, len, decay});
    n += len;
  }
  Buf p(n * 4), g(n * 4), m(n * 4), v(n * 4), pb(n * 2);
  const f::AdamWArgs a{3e-4, 0.9, 0.95, 1e-8, 0.1, 0.1, 0.05};
  const bool one_launch = state.range(0) == 1;
  state.SetLabel(std::to_string(spans.size()) + (one_launch ? " spans, one launch" : " launches"));
  run(state, static_cast<double>(n) * (4 * 4 + 3 * 4 + 2), 0, [&] {
    if (!one_launch) {
      for (const f::AdamWSpan& s : spans) {
        f::AdamWArgs b = a;
        b.weight_decay = s.decay ? a.weight_decay : 0.0;
        f::adamw_update(p.as<float>() + s.start, g.as<float>() + s.start, m.as<float>() + s.start,
                        v.as<float>() + s.start, pb.as<bf16>() + s.start, s.n, b, 0.5, nullptr);
      }
      return;
    }
    f::adamw_update_spans(p.as<float>(), g.as<float>(), m.as<float>(), v.as<float>(), pb.as<bf16>(),
                          spans, a, 0.5, nullptr);
  });
}
BENCHMARK(BM_AdamWUpdateSpans)->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_GradNorm(benchmark::State& state) {  // 100M fp32 gradients
  if (!have_gpu(state)) return;
  const int64_t n = 100'000'000;
  Buf g(n * 4), acc(8);
  run(state, n * 4.0, 0, [&] { kc::sum_squares(g.as<float>(), n, acc.as<double>(), nullptr); });
}
BENCHMARK(BM_GradNorm)->UseManualTime()->Unit(benchmark::kMicrosecond);

// An MoE layer's row moves (runtime/cuda/fp32_kernels.h) on bf16 rows of width kHidden: the
// permutation (each of the tokens' top-2 rows gathered) and the unpermutation (each token's two
// rows weighted and added onto its output), with a routing that sends token i to experts
// spread over the rows. Bytes: the rows read and written, the tokens' outputs read and written.
void BM_MoePermute(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t n = kTokens, k = 2, rows = n * k, h = kHidden;
  Buf x(n * h * 2), y(rows * h * 2), index(rows * 8);
  std::vector<int64_t> token(rows);
  for (int64_t r = 0; r < rows; ++r) token[r] = (r * 7919) % n;
  PTDP_CUDA_CHECK(cudaMemcpy(index.p, token.data(), rows * 8, cudaMemcpyHostToDevice));
  run(state, 2.0 * rows * h * 2, 0, [&] {
    ptdp::cuda_fp32::gather_rows(x.as<bf16>(), index.as<int64_t>(), nullptr, y.as<bf16>(), rows, h,
                                 nullptr);
  });
}
BENCHMARK(BM_MoePermute)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_MoeUnpermute(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int64_t n = kTokens, k = 2, rows = n * k, h = kHidden;
  Buf y(rows * h * 2), out(n * h * 2), index(rows * 8), weight(rows * 4);
  std::vector<int64_t> row_of(rows);
  for (int64_t r = 0; r < rows; ++r) row_of[r] = (r * 7919) % rows;
  PTDP_CUDA_CHECK(cudaMemcpy(index.p, row_of.data(), rows * 8, cudaMemcpyHostToDevice));
  run(state, (rows + 2.0 * n) * h * 2, 0, [&] {
    ptdp::cuda_fp32::gather_add_rows(y.as<bf16>(), index.as<int64_t>(), weight.as<float>(),
                                     out.as<bf16>(), n, k, h, nullptr);
  });
}
BENCHMARK(BM_MoeUnpermute)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
