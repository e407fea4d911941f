// Context parallelism on one process (runtime/context_parallel.h): the chunk assignment, and the
// ring attention of cp shards (one thread each, joined by an in-process ring) against one shard
// holding the whole sequence: the same mean loss, the same averaged gradients, and the ring's
// exchanges in the executed-op record with one block's K and V each. `ptdp run` with cp under
// mpirun is in run_mpi_test.cc.
#include "runtime/context_parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>

#include "core/error.h"
#include "runtime/communicator.h"
#include "runtime/data.h"
#include "runtime/gpt_model.h"

namespace ptdp {
namespace {

TEST(ContextParallel, EachRankHoldsChunksRAndTwoCpMinusOneMinusR) {
  const int64_t s = 32;
  for (int64_t cp : {1, 2, 4}) {
    const int64_t c = s / (2 * cp), sl = s / cp;
    std::vector<int> owners(static_cast<size_t>(s), 0);
    for (int64_t r = 0; r < cp; ++r) {
      std::vector<int64_t> global;  // rank r's local tokens' global positions, in local order
      for (const PositionRun& run : context_runs(s, cp, r, 0, sl)) {
        EXPECT_EQ(static_cast<int64_t>(global.size()), run.local);
        for (int64_t i = 0; i < run.len; ++i) global.push_back(run.global + i);
      }
      ASSERT_EQ(static_cast<int64_t>(global.size()), sl);
      for (int64_t i = 0; i < sl; ++i) {
        const int64_t chunk = i < c ? r : 2 * cp - 1 - r;
        EXPECT_EQ(global[static_cast<size_t>(i)], chunk * c + i % c) << "cp " << cp << " r " << r;
        ++owners[static_cast<size_t>(global[static_cast<size_t>(i)])];
      }
      // A slice of the local tokens (a sequence-parallel rank's) maps to the same positions.
      for (const PositionRun& run : context_runs(s, cp, r, c / 2, c)) {
        for (int64_t i = 0; i < run.len; ++i)
          EXPECT_EQ(run.global + i, global[static_cast<size_t>(run.local + i)]);
      }
      // Tokens: inputs are positions 0..s-1 of each sequence of s + 1, targets 1..s.
      const int64_t b = 2;
      std::vector<int32_t> seq(static_cast<size_t>(b * (s + 1)));
      std::iota(seq.begin(), seq.end(), 0);
      std::vector<int32_t> in(static_cast<size_t>(b * sl)), tgt(in.size());
      context_token_window(seq.data(), in.data(), b, s, cp, r, 0);
      context_token_window(seq.data(), tgt.data(), b, s, cp, r, 1);
      for (int64_t bi = 0; bi < b; ++bi)
        for (int64_t i = 0; i < sl; ++i) {
          const int32_t want = static_cast<int32_t>(bi * (s + 1) + global[static_cast<size_t>(i)]);
          EXPECT_EQ(in[static_cast<size_t>(bi * sl + i)], want);
          EXPECT_EQ(tgt[static_cast<size_t>(bi * sl + i)], want + 1);
        }
    }
    for (int n : owners) EXPECT_EQ(n, 1) << "cp " << cp;  // every position held exactly once
  }
}

// Ranks of one process joined for point-to-point and all-to-all (what the ring and Ulysses
// need): a send is copied into the receiver's mailbox, a receive waits for it (bounded).
struct Mailboxes {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::pair<int, int>, std::deque<std::vector<char>>> queue;  // (from, to)
};

class DoneWork : public Work {
 public:
  bool test() override { return true; }
  void wait() override {}
  void wait(CommDuration) override {}
};

class InProcessRing : public Communicator {
 public:
  InProcessRing(Mailboxes& box, int rank, int size) : box_(box), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

 protected:
  std::unique_ptr<Communicator> make_split(int, int) override { throw unsupported(); }
  std::unique_ptr<Work> start_all_reduce(void*, size_t, DType, DeviceStream) override {
    throw unsupported();
  }
  std::unique_ptr<Work> start_all_gather(const void*, void*, size_t, DType, DeviceStream) override {
    throw unsupported();
  }
  std::unique_ptr<Work> start_reduce_scatter(const void*, void*, size_t, DType,
                                             DeviceStream) override {
    throw unsupported();
  }
  std::unique_ptr<Work> start_broadcast(void*, size_t, DType, int, DeviceStream) override {
    throw unsupported();
  }
  std::unique_ptr<Work> start_barrier() override { throw unsupported(); }
  // As a batch: a send of each block to its rank, then a receive of each (this rank's own block
  // through its own mailbox too).
  std::unique_ptr<Work> start_all_to_all_v(const void* in, std::span<const size_t> send_counts,
                                           void* out, std::span<const size_t> recv_counts, DType t,
                                           DeviceStream s) override {
    std::vector<P2P> ops;
    size_t at = 0;
    for (int r = 0; r < size_; ++r) {
      ops.push_back({true, const_cast<char*>(static_cast<const char*>(in)) + at * dtype_bytes(t),
                     send_counts[static_cast<size_t>(r)], r, 0, t});
      at += send_counts[static_cast<size_t>(r)];
    }
    at = 0;
    for (int r = 0; r < size_; ++r) {
      ops.push_back({false, static_cast<char*>(out) + at * dtype_bytes(t),
                     recv_counts[static_cast<size_t>(r)], r, 0, t});
      at += recv_counts[static_cast<size_t>(r)];
    }
    return start_batch(ops, s);
  }
  std::unique_ptr<Work> start_batch(std::span<const P2P> ops, DeviceStream) override {
    std::unique_lock<std::mutex> lock(box_.mu);
    for (const P2P& op : ops)
      if (op.send) {
        const char* p = static_cast<const char*>(op.data);
        box_.queue[{rank_, op.peer}].emplace_back(p, p + op.n * dtype_bytes(op.dtype));
      }
    box_.cv.notify_all();
    for (const P2P& op : ops) {
      if (op.send) continue;
      auto& q = box_.queue[{op.peer, rank_}];
      if (!box_.cv.wait_for(lock, std::chrono::seconds(60), [&] { return !q.empty(); }))
        throw CommTimeout("in-process ring", "recv", {op.peer}, std::chrono::seconds(60), "");
      if (q.front().size() != op.n * dtype_bytes(op.dtype))
        throw std::logic_error("in-process ring: message size differs");
      std::memcpy(op.data, q.front().data(), q.front().size());
      q.pop_front();
    }
    return std::make_unique<DoneWork>();
  }

 private:
  static std::logic_error unsupported() {
    return std::logic_error("in-process ring: point-to-point and all-to-all only");
  }
  Mailboxes& box_;
  int rank_, size_;
};

ModelSpec tiny(bool rotary) {
  ModelSpec m;
  m.name = "tiny";
  m.num_layers = 2;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.seq_length = 32;
  m.vocab_size = 128;
  if (rotary) {  // Llama's shape: GQA, SwiGLU, untied, rotary positions
    m.num_query_groups = 2;
    m.swiglu = true;
    m.untie_embeddings_and_output_weights = true;
    m.ffn_hidden_size = 96;
    m.learned_position_embeddings = false;
    m.rotary_base = 10000;
  }
  return m;
}

struct Pass {
  double loss = 0;
  std::vector<float> grads;
  std::vector<ExecutedOp> trace;
};

// One forward and backward pass of microbatch 0 on a shard of `layout` (with a2a+p2p, `heads`
// and `ring` are its all-to-all group and its ring).
Pass run_shard(const ModelSpec& m, const ShardLayout& layout, Communicator* group,
               Communicator* heads = nullptr, Communicator* ring = nullptr) {
  auto self = make_self_communicator();
  GptShard shard(m, layout, self.get(), 11);
  if (group) shard.set_context_group(group, heads, ring);
  std::vector<int32_t> tokens(static_cast<size_t>(shard.tokens_per_microbatch()));
  const TokenSource data = TokenSource::synthetic(m.vocab_size, 5);
  for (int64_t i = 0; i < layout.micro_batch; ++i)
    data.sequence(i, m.seq_length, tokens.data() + i * (m.seq_length + 1));
  Pass out;
  shard.trace_ops(&out.trace);
  out.loss = shard.forward(0, 0, tokens.data(), nullptr, nullptr);
  shard.backward(0, 0, nullptr, nullptr, 1.0);
  const auto g = shard.grads().view<float>(0, shard.grads().size());
  out.grads.assign(g.begin(), g.end());
  return out;
}

// cp shards in threads; rank r's pass in result[r]. With a2a+p2p (1 < layout.cp_a2a_size = A <
// cp) each rank also joins its all-to-all group (ranks A k .. A k + A - 1) and its ring (the
// ranks at its place in the groups), as the trainer splits them.
std::vector<Pass> run_ring(const ModelSpec& m, ShardLayout layout, int cp) {
  const int a = static_cast<int>(layout.cp_a2a_size), groups = cp / a;
  const bool hierarchical = a > 1 && a < cp;
  std::deque<Mailboxes> boxes(static_cast<size_t>(1 + (hierarchical ? groups + a : 0)));
  std::vector<std::unique_ptr<InProcessRing>> rings, heads, outer;
  for (int r = 0; r < cp; ++r) {
    rings.push_back(std::make_unique<InProcessRing>(boxes[0], r, cp));
    if (!hierarchical) continue;
    heads.push_back(
        std::make_unique<InProcessRing>(boxes[static_cast<size_t>(1 + r / a)], r % a, a));
    outer.push_back(std::make_unique<InProcessRing>(boxes[static_cast<size_t>(1 + groups + r % a)],
                                                    r / a, groups));
  }
  std::vector<Pass> out(static_cast<size_t>(cp));
  std::vector<std::string> errors(static_cast<size_t>(cp));
  std::vector<std::thread> threads;
  for (int r = 0; r < cp; ++r)
    threads.emplace_back([&, r] {
      try {
        ShardLayout l = layout;
        l.cp = cp;
        l.cp_rank = r;
        const auto i = static_cast<size_t>(r);
        out[i] = run_shard(m, l, rings[i].get(), hierarchical ? heads[i].get() : nullptr,
                           hierarchical ? outer[i].get() : nullptr);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::string& e : errors) EXPECT_EQ(e, "");
  return out;
}

// The cp shards together compute what one shard of the whole sequence does: the mean of their
// losses (each the mean over its s / cp tokens) is the loss, the mean of their gradients (what
// the dp x cp all-reduce forms) is the gradient.
void expect_shards_match_one(const ModelSpec& m, const ShardLayout& layout, int cp,
                             const std::string& what) {
  const Pass plain = run_shard(m, layout, nullptr);
  const std::vector<Pass> ring = run_ring(m, layout, cp);
  if (::testing::Test::HasFailure()) return;
  double loss = 0;
  std::vector<double> grads(plain.grads.size(), 0.0);
  for (const Pass& p : ring) {
    loss += p.loss / cp;
    ASSERT_EQ(p.grads.size(), grads.size());
    for (size_t i = 0; i < grads.size(); ++i) grads[i] += p.grads[i] / cp;
  }
  EXPECT_NEAR(loss, plain.loss, 1e-5 * plain.loss) << what;
  double scale = 0;
  for (float g : plain.grads) scale = std::max(scale, std::abs(static_cast<double>(g)));
  ASSERT_GT(scale, 0);
  size_t bad = 0;
  for (size_t i = 0; i < grads.size(); ++i)
    if (std::abs(grads[i] - plain.grads[i]) > 1e-5 * scale) ++bad;
  EXPECT_EQ(bad, 0u) << what;
}

// A pass's backward exchanges (kCpKvExchangeBackward, kCpOutAllToAllBackward) move what the
// layer op list prices for its layout, layer by layer: the bytes of each op and collective
// summed (the ring's steps are recorded one block each, the list's two blocks a step). With a
// heads all-to-all only gradients cross it: the output's in, dQ, dK and dV back.
void expect_backward_exchanges_listed(const ModelSpec& m, ShardLayout layout, int cp, const Pass& p,
                                      const std::string& what) {
  layout.cp = cp;
  const PassOps ops = transformer_layer_ops(m, runtime_layer_shape(m, layout));
  auto exchange = [](OpId id) {
    return id == OpId::kCpKvExchangeBackward || id == OpId::kCpOutAllToAllBackward;
  };
  std::map<std::pair<OpId, Collective>, double> listed, executed;
  for (const Op& o : ops.backward)
    if (o.kind == OpKind::kCollective && exchange(o.id))
      listed[{o.id, o.collective}] += o.bytes * static_cast<double>(m.num_layers);
  for (const ExecutedOp& e : p.trace)
    if (e.kind == OpKind::kCollective && exchange(e.id)) executed[{e.id, e.collective}] += e.bytes;
  ASSERT_FALSE(listed.empty()) << what;
  ASSERT_EQ(executed.size(), listed.size()) << what;
  for (const auto& [key, bytes] : listed) {
    ASSERT_TRUE(executed.count(key)) << what << ": " << op_name(key.first) << " not executed";
    EXPECT_NEAR(executed.at(key), bytes, 1e-9 * bytes) << what << ": " << op_name(key.first);
  }
}

TEST(ContextParallel, RingAttentionEqualsPlainAttention) {
  for (bool rotary : {false, true})
    for (Recompute rc : {Recompute::kNone, Recompute::kSelective, Recompute::kFull})
      for (int cp : {2, 4}) {
        ShardLayout layout;
        layout.micro_batch = 2;
        layout.recompute = rc;
        expect_shards_match_one(tiny(rotary), layout, cp,
                                std::string(rotary ? "rotary" : "learned") + " cp " +
                                    std::to_string(cp) + " recompute " + to_string(rc));
      }
}

// Multi-head latent attention: keys of 12 + 4 channels (the rotated part one key shared by the
// heads, rotated at its tokens' global positions) and values of 10 go round the ring, through
// Ulysses' all-to-alls and a2a+p2p's, each at its own width; every shard's fused attention pads V
// to the query width for its kernel. The same losses and gradients as one rank, and a ring step
// carries one block of K and V at their widths.
TEST(ContextParallel, LatentAttentionEqualsPlainAttention) {
  ModelSpec m = tiny(true);
  m.name = "tiny-mla";
  m.num_query_groups = 0;
  m.multi_latent_attention = true;
  m.qk_layernorm = true;
  m.q_lora_rank = 24;
  m.kv_lora_rank = 16;
  m.qk_head_dim = 12;
  m.qk_pos_emb_head_dim = 4;
  m.v_head_dim = 10;
  struct Case {
    int cp, a2a;
    Recompute rc;
  };
  for (const Case& k :
       {Case{2, 1, Recompute::kNone}, Case{4, 1, Recompute::kSelective},
        Case{2, 1, Recompute::kFull}, Case{2, 2, Recompute::kNone}, Case{4, 2, Recompute::kNone}}) {
    ShardLayout layout;
    layout.micro_batch = 2;
    layout.recompute = k.rc;
    layout.cp_a2a_size = k.a2a;
    const std::string what = "mla cp " + std::to_string(k.cp) + " a2a " + std::to_string(k.a2a) +
                             " recompute " + to_string(k.rc);
    expect_shards_match_one(m, layout, k.cp, what);
    if (k.a2a != 1 || k.rc != Recompute::kNone) continue;
    const double block = 1.0 * layout.micro_batch * (m.seq_length / k.cp) * m.num_attention_heads *
                         (m.head_dim() + m.value_dim()) * sizeof(float);
    int steps = 0;
    const std::vector<Pass> ring = run_ring(m, layout, k.cp);  // (kept alive for the loop)
    for (const ExecutedOp& e : ring[0].trace)
      if (e.id == OpId::kCpKvExchange && e.role == OpRole::kForward) {
        EXPECT_DOUBLE_EQ(e.bytes, block) << what;
        ++steps;
      }
    EXPECT_EQ(steps, (k.cp - 1) * m.num_layers) << what;
  }
}

// Ulysses (--cp-comm-type a2a): all-to-alls trade each rank's tokens of every head for every
// token of cp's share of the heads; the attention of the whole sequence per heads block gives
// the same losses and gradients (4 heads: cp 2 and 4; the rotary model's 2 query groups: cp 2).
// Each layer's forward pass moves Q, K and V in (kCpKvExchange) and the output back
// (kCpOutAllToAll), every one an all-to-all of one local tensor.
TEST(ContextParallel, UlyssesAttentionEqualsPlainAttention) {
  for (bool rotary : {false, true})
    for (Recompute rc : {Recompute::kNone, Recompute::kSelective, Recompute::kFull})
      for (int cp : {2, 4}) {
        if (rotary && cp == 4) continue;
        ShardLayout layout;
        layout.micro_batch = 2;
        layout.recompute = rc;
        layout.cp_a2a_size = cp;
        const ModelSpec m = tiny(rotary);
        const std::string what = std::string(rotary ? "rotary" : "learned") + " a2a cp " +
                                 std::to_string(cp) + " recompute " + to_string(rc);
        expect_shards_match_one(m, layout, cp, what);
        const Pass p = run_ring(m, layout, cp)[0];
        expect_backward_exchanges_listed(m, layout, cp, p, what);
        if (rotary || rc != Recompute::kNone) continue;
        const double q = 1.0 * layout.micro_batch * (m.seq_length / cp) * m.hidden_size * 4;
        int in = 0, out = 0;
        for (const ExecutedOp& e : p.trace) {
          if (e.id != OpId::kCpKvExchange && e.id != OpId::kCpOutAllToAll) continue;
          EXPECT_EQ(e.collective, Collective::kAllToAll);
          EXPECT_DOUBLE_EQ(e.bytes, q);  // MHA: Q, K, V and the output are alike
          ++(e.id == OpId::kCpKvExchange ? in : out);
        }
        EXPECT_EQ(in, 3 * m.num_layers);
        EXPECT_EQ(out, m.num_layers);
        // The fused backward's kernel is recorded in the role its op began with (after the
        // all-to-alls, which are the backward pass's), with Ulysses' shapes: all s queries of
        // hl / cp heads.
        const auto first = std::find_if(p.trace.begin(), p.trace.end(), [](const ExecutedOp& e) {
          return e.id == OpId::kAttnScoresRecompute;
        });
        ASSERT_NE(first, p.trace.end());
        const auto kernel = std::find_if(first, p.trace.end(), [](const ExecutedOp& e) {
          return e.id == OpId::kAttnScoresRecompute && e.kind == OpKind::kGemm;
        });
        ASSERT_NE(kernel, p.trace.end());
        EXPECT_EQ(kernel->role, first->role);
        EXPECT_EQ(kernel->m, m.seq_length);
        EXPECT_EQ(kernel->batch, layout.micro_batch * m.num_attention_heads / cp);
      }
}

// a2a+p2p (--hierarchical-context-parallel-sizes A B): all-to-alls within groups of A adjacent
// ranks, then the ring over the B groups with hl / A heads of the group's s / B tokens, give the
// same losses and gradients as one rank with the whole sequence: A x B = 2 x 2, 2 x 4 and 4 x 2
// (4 heads), the rotary GQA model's 2 query groups at 2 x 2, each recompute mode at 2 x 2. A
// layer's forward pass records Q, K and V's all-to-alls (kCpKvExchange), B - 1 ring steps of one
// block each (the group's tokens of its heads block: s / cp tokens' worth of every query
// group), and the output's all-to-all (kCpOutAllToAll).
TEST(ContextParallel, HierarchicalAttentionEqualsPlainAttention) {
  struct Case {
    int a, b;
    bool rotary;
    Recompute rc;
  };
  const Case cases[] = {{2, 2, false, Recompute::kNone},    {2, 2, false, Recompute::kSelective},
                        {2, 2, false, Recompute::kFull},    {2, 4, false, Recompute::kNone},
                        {4, 2, false, Recompute::kNone},    {2, 2, true, Recompute::kNone},
                        {2, 2, true, Recompute::kSelective}};
  for (const Case& k : cases) {
    const int cp = k.a * k.b;
    ShardLayout layout;
    layout.micro_batch = 2;
    layout.recompute = k.rc;
    layout.cp_a2a_size = k.a;
    const ModelSpec m = tiny(k.rotary);
    const std::string what = std::string(k.rotary ? "rotary" : "learned") + " a2a+p2p " +
                             std::to_string(k.a) + "x" + std::to_string(k.b) + " recompute " +
                             to_string(k.rc);
    expect_shards_match_one(m, layout, cp, what);
    const Pass p = run_ring(m, layout, cp)[1];
    expect_backward_exchanges_listed(m, layout, cp, p, what);
    if (k.rc != Recompute::kNone) continue;
    const double tokens = 1.0 * layout.micro_batch * (m.seq_length / cp);
    const double q = tokens * m.hidden_size * 4, kv = tokens * m.query_groups() * m.head_dim() * 4;
    int a2a = 0, steps = 0, out = 0;
    for (const ExecutedOp& e : p.trace) {
      if (e.role != OpRole::kForward) continue;
      if (e.id == OpId::kCpOutAllToAll) {
        EXPECT_EQ(e.collective, Collective::kAllToAll) << what;
        EXPECT_DOUBLE_EQ(e.bytes, q) << what;
        ++out;
      } else if (e.id == OpId::kCpKvExchange && e.collective == Collective::kAllToAll) {
        ++a2a;
      } else if (e.id == OpId::kCpKvExchange) {
        EXPECT_EQ(e.collective, Collective::kSendRecv) << what;
        EXPECT_DOUBLE_EQ(e.bytes, 2 * kv) << what;  // K and V of the group's tokens, heads / A
        ++steps;
      }
    }
    EXPECT_EQ(a2a, 3 * m.num_layers) << what;
    EXPECT_EQ(steps, (k.b - 1) * m.num_layers) << what;
    EXPECT_EQ(out, m.num_layers) << what;
  }
}

// Every layer's forward pass has cp - 1 kCpKvExchange steps, each a send/recv of one block's K
// and V: b s / cp tokens of the local query groups' keys and values, in fp32. Its backward pass
// sends the blocks round again and returns their gradients: 2 (cp - 1) kCpKvExchangeBackward
// steps of one block each (the op list's cp - 1 steps of two blocks). A recomputation that
// starts before the attention (full) or at it (selective) repeats the forward ring.
TEST(ContextParallel, ExchangesAreRecordedWithOneBlockPerStep) {
  for (Recompute rc : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    const ModelSpec m = tiny(true);
    ShardLayout layout;
    layout.micro_batch = 2;
    layout.recompute = rc;
    const int cp = 4;
    const std::vector<Pass> ring = run_ring(m, layout, cp);
    if (::testing::Test::HasFailure()) return;
    const double block = 2.0 * layout.micro_batch * (m.seq_length / cp) * m.query_groups() *
                         m.head_dim() * sizeof(float);
    for (const Pass& p : ring) {
      int64_t fwd = 0, bwd = 0, rec = 0;
      for (const ExecutedOp& e : p.trace) {
        if (e.id != OpId::kCpKvExchange && e.id != OpId::kCpKvExchangeBackward) continue;
        EXPECT_EQ(e.kind, OpKind::kCollective);
        EXPECT_EQ(e.collective, Collective::kSendRecv);
        EXPECT_DOUBLE_EQ(e.bytes, block);
        if (e.id == OpId::kCpKvExchangeBackward) {
          EXPECT_EQ(e.role, OpRole::kInputGrad);
          ++bwd;
        } else if (e.role == OpRole::kRecompute) {
          ++rec;
        } else {
          EXPECT_EQ(e.role, OpRole::kForward);
          ++fwd;
        }
      }
      EXPECT_EQ(fwd, m.num_layers * (cp - 1)) << to_string(rc);
      EXPECT_EQ(bwd, 2 * m.num_layers * (cp - 1)) << to_string(rc);
      EXPECT_EQ(rec, rc == Recompute::kNone ? 0 : m.num_layers * (cp - 1)) << to_string(rc);
    }
    // The forward exchanges come after the rotary embedding and before the scores; the backward
    // pass's first exchanges inside the fused attention's backward (which goes on after them),
    // the others after it.
    const auto& t = ring[0].trace;
    const auto first = std::find_if(
        t.begin(), t.end(), [](const ExecutedOp& e) { return e.id == OpId::kCpKvExchange; });
    ASSERT_NE(first, t.end());
    ASSERT_NE(first, t.begin());
    EXPECT_EQ((first - 1)->id, OpId::kRotaryEmbedding);
    EXPECT_EQ((first + cp - 1)->id, OpId::kAttnScores);
    const auto back = std::find_if(t.begin(), t.end(), [](const ExecutedOp& e) {
      return e.id == OpId::kCpKvExchangeBackward;
    });
    ASSERT_NE(back, t.end());
    EXPECT_EQ((back - 1)->id, OpId::kAttnScoresRecompute);
    EXPECT_EQ((back + cp - 1)->id, OpId::kAttnScoresRecompute);
    EXPECT_EQ((back + cp - 1)->kind, OpKind::kGemm);  // the kernel's work is the resumed record's
  }
}

TEST(ContextParallel, BadLayoutsAreInputErrors) {
  ShardLayout l;
  l.cp = 3;  // 2 * 3 does not divide 32
  try {
    validate_shard_layout(tiny(false), l);
    ADD_FAILURE() << "accepted cp 3 with a sequence of 32";
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), "--context-parallel-size") << e.what();
  }
  l.cp = 2;
  l.cp_rank = 2;
  EXPECT_THROW(validate_shard_layout(tiny(false), l), InputError);
}

}  // namespace
}  // namespace ptdp
