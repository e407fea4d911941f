// MoE layers in the runtime on one process: the routing loops against naive ones, the layer's
// gradients against finite differences, the parameter count and segment sizes, and the trace
// of the dispatch and combine all-to-alls. Expert parallelism across ranks is in
// run_mpi_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>

#include "core/presets.h"
#include "kernels/cpu/moe.h"
#include "planner/cost_model.h"
#include "runtime/communicator.h"
#include "runtime/data.h"
#include "runtime/float16.h"
#include "runtime/gpt_model.h"
#include "runtime/moe_layer.h"
#include "runtime/shard_footprint.h"

namespace ptdp {
namespace {

ModelSpec tiny_moe(bool swiglu, int64_t shared, int64_t freq) {
  ModelSpec m;
  m.name = "tiny-moe";
  m.num_layers = 2;
  m.hidden_size = 16;
  m.num_attention_heads = 4;
  m.seq_length = 8;
  m.vocab_size = 32;
  m.swiglu = swiglu;
  if (swiglu) m.ffn_hidden_size = 24;
  m.num_experts = 4;
  m.moe_router_topk = 2;
  m.moe_ffn_hidden_size = 12;
  m.moe_shared_expert_ffn_size = shared;
  m.moe_layer_freq = freq;
  return m;
}

// The layout of the last rank of each group (t-way sequence-parallel tensor parallelism, ep-way
// expert and etp-way expert-tensor parallelism).
ShardLayout last_ranks(int64_t t, int64_t ep, int64_t etp) {
  ShardLayout l;
  l.t = t;
  l.tp = t - 1;
  l.sequence_parallel = t > 1;
  l.ep = ep;
  l.ep_rank = ep - 1;
  l.etp = etp;
  l.etp_rank = etp - 1;
  return l;
}

std::vector<float> random_floats(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

TEST(MoeRouting, TopkSoftmaxAndPermutationMatchNaiveLoops) {
  const int64_t n = 13, E = 6, k = 2;
  std::vector<float> logits = random_floats(static_cast<size_t>(n * E), 1);
  logits[7] = logits[8];  // a tie: the lower expert index wins
  std::vector<int32_t> expert(static_cast<size_t>(n * k));
  std::vector<float> prob(static_cast<size_t>(n * k));
  kernels::topk_softmax(logits.data(), n, E, k, expert.data(), prob.data());
  for (int64_t i = 0; i < n; ++i) {
    std::vector<std::pair<float, int>> order;
    for (int e = 0; e < E; ++e) order.push_back({-logits[static_cast<size_t>(i * E + e)], e});
    std::sort(order.begin(), order.end());
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(-order[j].first);
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(expert[static_cast<size_t>(i * k + j)], order[j].second) << i;
      EXPECT_NEAR(prob[static_cast<size_t>(i * k + j)], std::exp(-order[j].first) / sum, 1e-6);
    }
  }
  // Capacity: each expert keeps its `cap` most probable assignments.
  std::vector<int32_t> kept = expert;
  const int64_t cap = 3;
  const int64_t dropped = kernels::drop_over_capacity(kept.data(), prob.data(), n, k, E, cap);
  int64_t naive_dropped = 0;
  for (int e = 0; e < E; ++e) {
    std::vector<std::pair<float, int64_t>> mine;  // (-prob, slot)
    for (int64_t s = 0; s < n * k; ++s)
      if (expert[static_cast<size_t>(s)] == e) mine.push_back({-prob[static_cast<size_t>(s)], s});
    std::stable_sort(mine.begin(), mine.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t r = 0; r < mine.size(); ++r) {
      const bool keep = static_cast<int64_t>(r) < cap;
      EXPECT_EQ(kept[static_cast<size_t>(mine[r].second)], keep ? e : -1);
      naive_dropped += !keep;
    }
  }
  EXPECT_EQ(dropped, naive_dropped);
  EXPECT_GT(dropped, 0);
  // The position policy keeps each expert's first `cap` assignments in token order.
  std::vector<int32_t> first = expert;
  EXPECT_EQ(kernels::drop_over_capacity(first.data(), prob.data(), n, k, E, cap, true), dropped);
  std::vector<int64_t> seen(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < n * k; ++s) {
    const int32_t e = expert[static_cast<size_t>(s)];
    EXPECT_EQ(first[static_cast<size_t>(s)], seen[static_cast<size_t>(e)]++ < cap ? e : -1) << s;
  }
  EXPECT_NE(first, kept);  // the two policies differ on these logits
  // With several sequences, position j of every sequence before position j + 1 of any (the
  // [s, b] order of Megatron's tokens): 12 tokens as 3 sequences of 4.
  const int64_t seqs = 3, per = 12 / seqs;
  std::vector<int32_t> by_seq(expert.begin(), expert.begin() + 12 * k);
  const std::vector<int32_t> routed = by_seq;
  kernels::drop_over_capacity(by_seq.data(), prob.data(), 12, k, E, cap, true, seqs);
  std::vector<int64_t> order;  // slots in (position, sequence) order
  for (int64_t j = 0; j < per; ++j)
    for (int64_t q = 0; q < seqs; ++q)
      for (int64_t slot = 0; slot < k; ++slot) order.push_back((q * per + j) * k + slot);
  std::vector<int64_t> taken(static_cast<size_t>(E), 0);
  for (int64_t s : order) {
    const int32_t e = routed[static_cast<size_t>(s)];
    EXPECT_EQ(by_seq[static_cast<size_t>(s)], taken[static_cast<size_t>(e)]++ < cap ? e : -1) << s;
  }
  // Permutation: rows grouped by expert, tokens ascending; unpermute is the weighted sum.
  std::vector<int64_t> slot_of_row(static_cast<size_t>(n * k)), counts(static_cast<size_t>(E));
  const int64_t rows =
      kernels::permutation(kept.data(), n, k, E, slot_of_row.data(), counts.data());
  std::vector<int64_t> naive;
  for (int e = 0; e < E; ++e)
    for (int64_t s = 0; s < n * k; ++s)
      if (kept[static_cast<size_t>(s)] == e) naive.push_back(s);
  ASSERT_EQ(rows, static_cast<int64_t>(naive.size()));
  EXPECT_EQ(std::vector<int64_t>(slot_of_row.begin(), slot_of_row.begin() + rows), naive);
  EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t{0}), rows);
  // The row moves: permute gathers each row's token, unpermute adds each token's rows weighted
  // by their probabilities (in ascending row order), its backward the rows' dot products.
  const int64_t h = 3;
  const std::vector<float> x = random_floats(static_cast<size_t>(n * h), 2);
  std::vector<int64_t> token(static_cast<size_t>(rows)), row_of(static_cast<size_t>(n * k));
  std::vector<float> weight(static_cast<size_t>(n * k));
  kernels::token_of_rows(slot_of_row.data(), rows, k, token.data());
  kernels::rows_of_tokens(slot_of_row.data(), rows, n, k, prob.data(), row_of.data(),
                          weight.data());
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int64_t> want;
    for (int64_t r = 0; r < rows; ++r)
      if (token[static_cast<size_t>(r)] == i) want.push_back(r);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t got = row_of[static_cast<size_t>(i * k + j)];
      if (j < static_cast<int64_t>(want.size())) {
        EXPECT_EQ(got, want[static_cast<size_t>(j)]) << i;
        EXPECT_EQ(weight[static_cast<size_t>(i * k + j)],
                  prob[static_cast<size_t>(slot_of_row[static_cast<size_t>(got)])]);
      } else {
        EXPECT_EQ(got, -1) << i;  // a dropped slot
        EXPECT_EQ(weight[static_cast<size_t>(i * k + j)], 0.0f);
      }
    }
  }
  std::vector<float> permuted(static_cast<size_t>(rows * h)), out(static_cast<size_t>(n * h), 0);
  kernels::gather_rows(x.data(), token.data(), nullptr, rows, h, permuted.data());
  kernels::gather_add_rows(permuted.data(), row_of.data(), weight.data(), n, k, h, out.data());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < h; ++c) {
      double want = 0;
      for (int64_t j = 0; j < k; ++j)
        if (kept[static_cast<size_t>(i * k + j)] >= 0)
          want += prob[static_cast<size_t>(i * k + j)] * x[static_cast<size_t>(i * h + c)];
      EXPECT_NEAR(out[static_cast<size_t>(i * h + c)], want, 1e-5);
    }
  std::vector<float> dot(static_cast<size_t>(rows)), scaled(static_cast<size_t>(rows * h));
  kernels::row_dots(x.data(), token.data(), permuted.data(), rows, h, dot.data());
  kernels::gather_rows(x.data(), token.data(), dot.data(), rows, h, scaled.data());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = token[static_cast<size_t>(r)];
    double want = 0;
    for (int64_t c = 0; c < h; ++c)
      want += static_cast<double>(x[static_cast<size_t>(i * h + c)]) *
              x[static_cast<size_t>(i * h + c)];
    EXPECT_NEAR(dot[static_cast<size_t>(r)], want, 1e-6);
    for (int64_t c = 0; c < h; ++c)
      EXPECT_EQ(scaled[static_cast<size_t>(r * h + c)],
                dot[static_cast<size_t>(r)] * x[static_cast<size_t>(i * h + c)]);
  }
}

// bf16 rows (a bf16 model's routed rows): loaded as fp32, the arithmetic in fp32, stored rounded
// to nearest even once: a token's weighted rows summed in fp32 onto its row, then rounded.
TEST(MoeRouting, Bf16RowMovesComputeInFp32AndRoundOnce) {
  const int64_t n = 3, k = 2, h = 5, rows = 4;
  const std::vector<float> xf = random_floats(static_cast<size_t>(rows * h), 8);
  std::vector<uint16_t> x(xf.size()), base(static_cast<size_t>(n * h));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float_to_bf16(xf[i]);
  for (size_t i = 0; i < base.size(); ++i) base[i] = float_to_bf16(0.1f * static_cast<float>(i));
  const std::vector<int64_t> index = {2, 0, -1, 3, 1, 1};  // token 1 has one row, token 2 a repeat
  const std::vector<float> w = {0.7f, 0.3f, 0.9f, 0.6f, 0.25f, 0.5f};
  std::vector<uint16_t> out = base;
  kernels::gather_add_rows(x.data(), index.data(), w.data(), n, k, h, out.data());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < h; ++c) {
      float sum = bf16_to_float(base[static_cast<size_t>(i * h + c)]);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = index[static_cast<size_t>(i * k + j)];
        if (r >= 0)
          sum +=
              w[static_cast<size_t>(i * k + j)] * bf16_to_float(x[static_cast<size_t>(r * h + c)]);
      }
      EXPECT_EQ(out[static_cast<size_t>(i * h + c)], float_to_bf16(sum)) << i << " " << c;
    }
  const std::vector<int64_t> gather = {3, 3, 0};
  const std::vector<float> scale = {2.0f, -0.3f, 1.1f};
  std::vector<uint16_t> y(static_cast<size_t>(3 * h));
  kernels::gather_rows(x.data(), gather.data(), scale.data(), 3, h, y.data());
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t c = 0; c < h; ++c)
      EXPECT_EQ(y[static_cast<size_t>(r * h + c)],
                float_to_bf16(
                    scale[static_cast<size_t>(r)] *
                    bf16_to_float(x[static_cast<size_t>(gather[static_cast<size_t>(r)] * h + c)])));
  kernels::gather_rows(x.data(), gather.data(), nullptr, 3, h, y.data());  // unscaled: a copy
  EXPECT_TRUE(std::equal(y.begin(), y.begin() + h, x.begin() + 3 * h));
  std::vector<float> dot(3);
  kernels::row_dots(x.data(), gather.data(), y.data(), 3, h, dot.data());
  double want = 0;
  for (int64_t c = 0; c < h; ++c)
    want += static_cast<double>(bf16_to_float(x[static_cast<size_t>(3 * h + c)])) *
            bf16_to_float(y[static_cast<size_t>(c)]);
  EXPECT_FLOAT_EQ(dot[0], static_cast<float>(want));
}

// The chunk sort around an all-to-all: blocks (a, b) held a-major, read back b-major; the
// counts transposed give the inverse.
TEST(MoeRouting, BlockTransposeIndexReordersAndInverts) {
  const int64_t A = 3, B = 2;
  const std::vector<int64_t> rows = {2, 0, 1, 3, 0, 1};  // (a, b) a-major
  std::vector<int64_t> index(7), back(7);
  kernels::transpose_blocks_index(rows.data(), A, B, index.data());
  // a-major starts: (0,0) 0, (0,1) 2, (1,0) 2, (1,1) 3, (2,0) 6, (2,1) 6.
  EXPECT_EQ(index, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
  const std::vector<int64_t> t = {2, 1, 0, 0, 3, 1};  // the counts transposed: (b, a) b-major
  kernels::transpose_blocks_index(t.data(), B, A, back.data());
  EXPECT_EQ(back, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
  const std::vector<int64_t> uneven = {1, 2, 2, 1};  // A = B = 2
  std::vector<int64_t> u(6);
  kernels::transpose_blocks_index(uneven.data(), 2, 2, u.data());
  // starts: (0,0) 0, (0,1) 1, (1,0) 3, (1,1) 5; b-major: (0,0) (1,0) (0,1) (1,1).
  EXPECT_EQ(u, (std::vector<int64_t>{0, 3, 4, 1, 2, 5}));
  std::vector<float> x = {10, 11, 12, 13, 14, 15}, y(6), z(6);
  kernels::gather_rows(x.data(), u.data(), nullptr, 6, 1, y.data());
  const std::vector<int64_t> ut = {1, 2, 2, 1};  // transposed counts of `uneven`
  std::vector<int64_t> inv(6);
  kernels::transpose_blocks_index(ut.data(), 2, 2, inv.data());
  kernels::gather_rows(y.data(), inv.data(), nullptr, 6, 1, z.data());
  EXPECT_EQ(z, x);
}

TEST(MoeRouting, TopkSoftmaxBackwardMatchesFiniteDifferences) {
  const int64_t n = 5, E = 5, k = 3;
  std::vector<float> logits = random_floats(static_cast<size_t>(n * E), 3);
  const std::vector<float> weight = random_floats(static_cast<size_t>(n * k), 4);
  auto objective = [&](const std::vector<float>& z, std::vector<int32_t>* chosen,
                       std::vector<float>* p) {
    kernels::topk_softmax(z.data(), n, E, k, chosen->data(), p->data());
    double f = 0;
    for (size_t i = 0; i < p->size(); ++i) f += weight[i] * (*p)[i];
    return f;
  };
  std::vector<int32_t> chosen(static_cast<size_t>(n * k));
  std::vector<float> p(static_cast<size_t>(n * k)), d(static_cast<size_t>(n * E));
  objective(logits, &chosen, &p);
  kernels::topk_softmax_backward(p.data(), weight.data(), chosen.data(), n, E, k, d.data());
  for (size_t i = 0; i < logits.size(); ++i) {
    std::vector<int32_t> c2 = chosen;
    std::vector<float> p2 = p, z = logits;
    const float eps = 1e-3f;
    z[i] += eps;
    const double up = objective(z, &c2, &p2);
    z[i] -= 2 * eps;
    const double down = objective(z, &c2, &p2);
    EXPECT_NEAR(d[i], (up - down) / (2 * eps), 2e-3) << i;
  }
}

TEST(MoeShard, ParameterCountAndSegmentSizes) {
  auto self = make_self_communicator();
  for (bool swiglu : {false, true}) {
    const ModelSpec m = tiny_moe(swiglu, swiglu ? 8 : 0, swiglu ? 2 : 1);
    GptShard one(m, ShardLayout{}, self.get(), 1);
    EXPECT_EQ(one.real_parameters(), static_cast<int64_t>(m.parameters())) << swiglu;
    for (int64_t t : {1, 2})
      for (int64_t ep : {1, 2, 4})
        for (int64_t etp : {int64_t{1}, t}) {
          ShardLayout l = last_ranks(t, ep, etp);
          l.segment_multiple = 3;
          l.expert_segment_multiple = 5;
          GptShard shard(m, l, self.get(), 1);
          std::vector<int64_t> built;
          for (const Segment& s : shard.segments()) built.push_back(s.size);
          EXPECT_EQ(shard_segment_sizes(m, l), built) << t << " " << ep << " " << etp;
          ASSERT_EQ(built.size(), 3u);
          EXPECT_EQ(built[2] % 5, 0);
        }
  }
}

// What the cost model counts on a rank (its memory and gradient-sync terms) is what the runtime
// builds there: the router, norms and row-parallel biases whole on every tensor-parallel rank,
// and each expert's FC2 bias whole on every expert-tensor rank (once divided by etp: 4 x 16
// parameters short per MoE layer at etp = 2).
TEST(MoeShard, CostModelCountsTheParametersTheShardHolds) {
  auto self = make_self_communicator();
  ClusterSpec c = resolve_cluster("dgx-a100-80gb");
  for (bool swiglu : {false, true}) {
    const ModelSpec m = tiny_moe(swiglu, swiglu ? 8 : 0, swiglu ? 2 : 1);
    const CostModel cost(m, c, resolve_profile("a100-80gb"));
    for (int64_t t : {1, 2})
      for (int64_t ep : {1, 2, 4})
        for (int64_t etp : {int64_t{1}, t}) {
          const ShardLayout l = last_ranks(t, ep, etp);
          GptShard shard(m, l, self.get(), 1);
          ParallelPlan p;
          p.tensor_parallel = t;
          p.sequence_parallel = t > 1;
          p.expert_parallel = ep;
          p.expert_tensor_parallel = etp;
          p.data_parallel = ep * etp;  // ep etp divides t d
          EXPECT_DOUBLE_EQ(cost.parameters_on_stage(p, 0),
                           static_cast<double>(shard.real_parameters()))
              << swiglu << " t " << t << " ep " << ep << " etp " << etp;
        }
  }
}

// DeepSeek-V3's shape: rotary positions and a multi-token prediction module whose layer is an
// MoE layer (the decoder's last layer's kind), its loss weighted 0.3.
ModelSpec tiny_moe_mtp() {
  ModelSpec m = tiny_moe(true, 8, 1);
  m.name = "tiny-moe-mtp";
  m.learned_position_embeddings = false;
  m.rotary_base = 10000;
  m.untie_embeddings_and_output_weights = true;
  m.mtp_num_layers = 1;
  m.mtp_loss_scaling_factor = 0.3;
  return m;
}

// The MoE layer's backward pass against central differences of the loss, for a few parameters
// of every kind (router, experts, shared experts, the dense layer between; an MTP module's MoE
// layer, the objective then the main loss plus the module's weighted loss).
TEST(MoeShard, GradientsMatchFiniteDifferences) {
  for (const ModelSpec& m : {tiny_moe(false, 0, 1), tiny_moe(true, 8, 2), tiny_moe_mtp()}) {
    auto self = make_self_communicator();
    GptShard shard(m, ShardLayout{}, self.get(), 7);
    std::vector<int32_t> tokens(static_cast<size_t>(shard.tokens_per_microbatch()));
    TokenSource::synthetic(m.vocab_size, 3).sequence(0, m.seq_length, tokens.data());
    const double mtp_weight = m.mtp_loss_scaling_factor / static_cast<double>(m.mtp_num_layers);
    auto loss = [&] {
      const double v = shard.forward(0, 0, tokens.data(), nullptr, nullptr);
      shard.backward(0, 0, nullptr, nullptr, 0.0);
      return v + (m.mtp_num_layers > 0 ? mtp_weight * shard.take_mtp_loss() : 0.0);
    };
    ASSERT_TRUE(shard.backend().host_accessible());
    const auto grads = shard.grads().view<float>(0, shard.grads().size());
    const auto params = shard.params().view<float>(0, shard.params().size());
    // Top-k is piecewise: logits spread wide (routers scaled up) keep a perturbation from
    // changing which experts a token chooses, where the loss jumps.
    for (const ParamInfo& p : shard.param_infos())
      if (p.name.find("router") != std::string::npos)
        for (int64_t i = p.offset; i < p.offset + p.size; ++i) params[static_cast<size_t>(i)] *= 40;
    std::fill(grads.begin(), grads.end(), 0.0f);
    shard.forward(0, 0, tokens.data(), nullptr, nullptr);
    shard.backward(0, 0, nullptr, nullptr, 1.0);
    shard.take_mtp_loss();  // the objective's own calls start from none
    const std::vector<float> analytic(grads.begin(), grads.end());
    std::mt19937 rng(5);
    int experts = 0, routers = 0;
    for (const ParamInfo& p : shard.param_infos()) {
      experts += p.expert;
      routers += p.name.find("router") != std::string::npos;
      for (int k = 0; k < 3; ++k) {
        const int64_t i =
            p.offset + static_cast<int64_t>(rng() % static_cast<uint32_t>(p.real_size));
        float& x = params[static_cast<size_t>(i)];
        const float keep = x, eps = 2e-3f;
        x = keep + eps;
        const double up = loss();
        x = keep - eps;
        const double down = loss();
        x = keep;
        const double numeric = (up - down) / (2.0 * eps);
        EXPECT_NEAR(analytic[static_cast<size_t>(i)], numeric, 2e-3 + 0.05 * std::abs(numeric))
            << m.swiglu << " " << p.name << " [" << i << "]";
      }
    }
    EXPECT_EQ(routers, m.num_moe_layers() + (m.mtp_layer_is_moe() ? m.mtp_num_layers : 0));
    EXPECT_GT(experts, 0);
  }
}

// Rank 0 of an expert-parallel group of two whose other rank routes as this one does: it sends
// this rank what this rank sends it, cut or padded with zeros to the count the call expects
// (the counts' exchange is then exact: both ranks chose alike; the rows' values are not a real
// group's, their sizes are). Enough to run the dispatch and combine in one process and see
// what they move.
class MirrorExperts final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }

 protected:
  struct Done final : Work {
    bool test() override { return true; }
    void wait() override {}
    void wait(CommDuration) override {}
  };
  std::unique_ptr<Work> start_all_to_all_v(const void* in, std::span<const size_t> send, void* out,
                                           std::span<const size_t> recv, DType t,
                                           DeviceStream) override {
    const size_t e = dtype_bytes(t);
    size_t from = 0, to = 0;
    for (size_t r = 0; r < recv.size(); ++r) {
      const size_t n = std::min(send[r], recv[r]);
      std::memcpy(static_cast<char*>(out) + to * e, static_cast<const char*>(in) + from * e, n * e);
      std::memset(static_cast<char*>(out) + (to + n) * e, 0, (recv[r] - n) * e);
      from += send[r];
      to += recv[r];
    }
    return std::make_unique<Done>();
  }
  [[noreturn]] static void refuse() { throw std::logic_error("not an expert-group call"); }
  std::unique_ptr<Work> start_all_reduce(void*, size_t, DType, DeviceStream) override { refuse(); }
  std::unique_ptr<Work> start_all_gather(const void*, void*, size_t, DType, DeviceStream) override {
    refuse();
  }
  std::unique_ptr<Work> start_reduce_scatter(const void*, void*, size_t, DType,
                                             DeviceStream) override {
    refuse();
  }
  std::unique_ptr<Work> start_broadcast(void*, size_t, DType, int, DeviceStream) override {
    refuse();
  }
  std::unique_ptr<Work> start_batch(std::span<const P2P>, DeviceStream) override { refuse(); }
  std::unique_ptr<Work> start_barrier() override { refuse(); }
  std::unique_ptr<Communicator> make_split(int, int) override { refuse(); }
};

// One microbatch of the synthetic tokens through `shard`, forward and backward; the loss.
double one_microbatch(GptShard& shard, const ModelSpec& m) {
  std::vector<int32_t> tokens(static_cast<size_t>(shard.tokens_per_microbatch()));
  TokenSource::synthetic(m.vocab_size, 3).sequence(0, m.seq_length, tokens.data());
  const double loss = shard.forward(0, 0, tokens.data(), nullptr, nullptr);
  shard.backward(0, 0, nullptr, nullptr, 1.0);
  return loss;
}

// With expert parallelism each MoE layer's dispatch and combine (and their backward) run as
// all-to-alls over the expert-parallel group carrying the rank's routed tokens x h x 4 bytes;
// without it no all-to-all runs, as the op list has none (the permuted rows are the experts'
// rows). Dense layers route nothing. The experts' GEMMs are recorded as the op list gives
// them: the local experts as the batch, each at the routed rows' mean (at ep = 1, dropless,
// every assignment is computed here, so the mean is the op list's rows per expert).
TEST(MoeShard, TraceShowsTheAllToAllsWithTheRoutedBytes) {
  const ModelSpec m = tiny_moe(true, 8, 2);
  ASSERT_EQ(m.num_moe_layers(), 1);
  for (const int64_t ep : {1, 2}) {
    auto self = make_self_communicator();
    MirrorExperts mirror;
    ShardLayout l;
    l.ep = ep;
    GptShard shard(m, l, self.get(), 7);
    if (ep > 1) shard.set_expert_groups(&mirror, nullptr);
    std::vector<ExecutedOp> trace;
    shard.trace_ops(&trace);
    const double loss = one_microbatch(shard, m);
    shard.trace_ops(nullptr);
    EXPECT_TRUE(std::isfinite(loss)) << ep;
    LayerShape shape = runtime_layer_shape(m, l);
    shape.expert_parallel = ep;
    const PassOps listed = moe_layer_ops(m, shape);
    int expert_gemms = 0;
    for (const ExecutedOp& op : trace)
      for (const std::vector<Op>* pass : {&listed.forward, &listed.backward})
        for (const Op& want : *pass)
          if (want.id == op.id && want.kind == OpKind::kGemm &&
              op_name(op.id).find("expert") != std::string_view::npos) {
            // The rows per expert (k of a weight gradient, else m) are the list's exactly at
            // ep = 1; with ep = 2 they are what this group's routing sent each rank.
            const bool rows_in_k = want.role == OpRole::kWeightGrad;
            if (ep == 1 || rows_in_k) {
              EXPECT_EQ(op.m, want.m) << op_name(op.id) << " ep " << ep;
            }
            EXPECT_EQ(op.n, want.n) << op_name(op.id);
            if (ep == 1 || !rows_in_k) {
              EXPECT_EQ(op.k, want.k) << op_name(op.id) << " ep " << ep;
            }
            EXPECT_EQ(op.batch, m.num_experts / ep) << op_name(op.id);
            ++expert_gemms;
          }
    EXPECT_EQ(expert_gemms, 6);
    // b = 1, dropless: each of the rank's tokens goes to k experts.
    const double routed_bytes =
        static_cast<double>(m.seq_length * m.moe_router_topk * m.hidden_size) * sizeof(float);
    int all_to_alls = 0, listed_all_to_alls = 0, routers = 0;
    for (const std::vector<Op>* pass : {&listed.forward, &listed.backward})
      for (const Op& op : *pass) listed_all_to_alls += op.collective == Collective::kAllToAll;
    for (const ExecutedOp& op : trace) {
      routers += op.id == OpId::kRouter;
      const bool a2a = op.id == OpId::kMoeDispatch || op.id == OpId::kMoeCombine ||
                       op.id == OpId::kMoeDispatchBackward || op.id == OpId::kMoeCombineBackward;
      if (!a2a) continue;
      ++all_to_alls;
      EXPECT_EQ(op.kind, OpKind::kCollective) << op_name(op.id);
      EXPECT_EQ(op.collective, Collective::kAllToAll) << op_name(op.id);
      EXPECT_EQ(op.group, CommGroup::kExpert) << op_name(op.id);
      EXPECT_EQ(op.bytes, routed_bytes) << op_name(op.id);
    }
    EXPECT_EQ(routers, 1);
    EXPECT_EQ(all_to_alls, ep > 1 ? 4 : 0) << ep;
    EXPECT_EQ(all_to_alls, listed_all_to_alls) << ep;
  }
}

// The load MoE layers are priced at: the busiest expert-parallel rank's share of the routed
// tokens over the mean. A rank that holds every expert (ep = 1) computes every kept token
// whatever the routing, so its load is 1 (the runtime's expert GEMMs above, at exactly the op
// list's rows); with ep > 1 the assumed imbalance, capped by a capacity factor.
TEST(MoeShard, ExpertLoadIsTheMeanWithoutExpertParallelism) {
  ModelSpec m = tiny_moe(false, 0, 1);
  EXPECT_EQ(expert_load(m, 1), 1.0);
  EXPECT_EQ(expert_load(m, 2), kDroplessExpertLoad);
  m.moe_capacity_factor = 0.5;  // each expert keeps half its fair share at most
  EXPECT_EQ(expert_load(m, 1), 0.5);
  EXPECT_EQ(expert_load(m, 4), 0.5);
  m.moe_capacity_factor = 2.0;
  EXPECT_EQ(expert_load(m, 1), 1.0);
  EXPECT_EQ(expert_load(m, 4), kDroplessExpertLoad);
  ModelSpec dense = m;
  dense.num_experts = 0;
  EXPECT_EQ(expert_load(dense, 4), 1.0);
  // A load the model states (--moe-expert-load, as a run measured it) replaces the assumed one,
  // still capped by the capacity and by ep (the busiest of ep ranks takes all at most).
  m.moe_capacity_factor = 0;
  m.moe_expert_load = 1.4;
  EXPECT_EQ(expert_load(m, 1), 1.0);
  EXPECT_EQ(expert_load(m, 2), 1.4);
  m.moe_expert_load = 3;
  EXPECT_EQ(expert_load(m, 2), 2.0);
  EXPECT_EQ(expert_load(m, 4), 3.0);
  m.moe_capacity_factor = 1.25;
  EXPECT_EQ(expert_load(m, 4), 1.25);
}

// The load of one routing over an expert-parallel group, from every rank's rows per expert:
// rank r holds experts r E/ep .. (r+1) E/ep - 1 and computes what every rank sent them.
TEST(MoeShard, ExpertLoadOfARouting) {
  // ep = 2, E = 4: rank 0 holds experts 0, 1; rank 1 experts 2, 3.
  const std::vector<int64_t> counts = {5, 1, 0, 2,   // from rank 0
                                       3, 3, 1, 1};  // from rank 1
  const ExpertLoad l = expert_load_of(counts, 2, 4);
  EXPECT_DOUBLE_EQ(l.busiest, 12);  // rank 0: 5 + 1 + 3 + 3; rank 1: 0 + 2 + 1 + 1 = 4
  EXPECT_DOUBLE_EQ(l.mean, 8);
  const ExpertLoad even = expert_load_of({2, 2, 2, 2, 2, 2, 2, 2}, 2, 4);
  EXPECT_DOUBLE_EQ(even.busiest, even.mean);
  EXPECT_THROW(expert_load_of(counts, 3, 4), std::logic_error);  // 4 experts over 3 ranks
  // Over the routings a shard dispatched: 1 without expert parallelism (one rank computes
  // every row), the busiest share with it (here the group of the trace test above, whose two
  // ranks route alike: between 1 and 2).
  const ModelSpec m = tiny_moe(false, 0, 1);
  for (const int64_t ep : {1, 2}) {
    auto self = make_self_communicator();
    MirrorExperts mirror;
    ShardLayout sl;
    sl.ep = ep;
    GptShard shard(m, sl, self.get(), 7);
    if (ep > 1) shard.set_expert_groups(&mirror, nullptr);
    EXPECT_EQ(shard.expert_load(), ep > 1 ? 0.0 : 1.0);  // nothing dispatched yet
    one_microbatch(shard, m);
    if (ep == 1) {
      EXPECT_EQ(shard.expert_load(), 1.0);
    } else {
      EXPECT_GE(shard.expert_load(), 1.0);
      EXPECT_LE(shard.expert_load(), 2.0);
    }
  }
  ModelSpec dense = m;
  dense.num_experts = 0;
  auto self = make_self_communicator();
  EXPECT_EQ(GptShard(dense, ShardLayout{}, self.get(), 7).expert_load(), 0.0);
}

}  // namespace
}  // namespace ptdp
