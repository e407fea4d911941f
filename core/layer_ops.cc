// Builds the per-GPU op lists of a tensor-parallel (and optionally sequence-parallel)
// transformer layer as Megatron-LM executes it (column-parallel QKV and FC1, row-parallel
// projection and FC2, fused scale-mask-softmax, dropout after attention and both blocks).
#include "core/layer_ops.h"

namespace ptdp {
namespace {

constexpr double kAct = 2.0;  // bytes per 16-bit activation element

struct Builder {
  std::vector<Op>* out;

  void gemm(const std::string& name, int64_t m, int64_t n, int64_t k, int64_t batch = 1) {
    Op op;
    op.name = name;
    op.kind = OpKind::kGemm;
    op.m = m;
    op.n = n;
    op.k = k;
    op.batch = batch;
    out->push_back(op);
  }
  void memory(const std::string& name, double bytes) {
    Op op;
    op.name = name;
    op.kind = OpKind::kMemory;
    op.bytes = bytes;
    out->push_back(op);
  }
  void collective(const std::string& name, Collective c, double bytes,
                  CommGroup g = CommGroup::kTensor) {
    Op op;
    op.name = name;
    op.kind = OpKind::kCollective;
    op.collective = c;
    op.bytes = bytes;
    op.group = g;
    out->push_back(op);
  }
};

// The backward of a GEMM C = A B: dA = dC B^T and dB = A^T dC.
void add_gemm_backward(Builder& b, const Op& f) {
  b.gemm(f.name + "_dgrad", f.m, f.k, f.n, f.batch);
  b.gemm(f.name + "_wgrad", f.k, f.n, f.m, f.batch);
}

struct Dims {
  double T, h, s, heads, kv, groups, ffn, t;
  int64_t Ti, hi, si, kvi;
};

Dims dims(const ModelSpec& m, const LayerShape& s) {
  Dims d;
  d.t = static_cast<double>(s.tensor_parallel);
  d.Ti = s.micro_batch * m.seq_length;
  d.T = static_cast<double>(d.Ti);
  d.hi = m.hidden_size;
  d.h = static_cast<double>(m.hidden_size);
  d.si = m.seq_length;
  d.s = static_cast<double>(m.seq_length);
  d.heads = static_cast<double>(m.num_attention_heads);
  d.kvi = m.kv_channels();
  d.kv = static_cast<double>(d.kvi);
  d.groups = static_cast<double>(m.query_groups());
  d.ffn = static_cast<double>(m.ffn_hidden());
  return d;
}

// Forward ops of the attention core (scores, softmax, dropout, context): the part selective
// recomputation redoes.
void attention_core(Builder& b, const ModelSpec& m, const LayerShape& s, const Dims& d) {
  const int64_t local_heads = m.num_attention_heads / s.tensor_parallel;
  const int64_t batch = s.micro_batch * local_heads;
  const double scores = static_cast<double>(batch) * d.s * d.s;  // elements
  b.gemm("attn_scores", d.si, d.si, d.kvi, batch);
  b.memory("attn_softmax", scores * kAct * 2);          // read scores, write probabilities
  b.memory("attn_dropout", scores * (kAct * 2 + 1.0));  // read, write, 1-byte mask
  b.gemm("attn_context", d.si, d.kvi, d.si, batch);
}

// Entry into a column-parallel block: with sequence parallelism the s/t shard is all-gathered.
void enter_tp(Builder& b, const LayerShape& s, const Dims& d, const std::string& what) {
  if (s.sequence_parallel)
    b.collective(what + "_allgather", Collective::kAllGather, d.T * d.h * kAct);
}
// Exit of a row-parallel block: partial sums are all-reduced (or reduce-scattered with SP).
void exit_tp(Builder& b, const LayerShape& s, const Dims& d, const std::string& what) {
  if (s.tensor_parallel == 1) return;
  b.collective(what + (s.sequence_parallel ? "_reducescatter" : "_allreduce"),
               s.sequence_parallel ? Collective::kReduceScatter : Collective::kAllReduce,
               d.T * d.h * kAct);
}

std::vector<Op> layer_forward(const ModelSpec& m, const LayerShape& s) {
  std::vector<Op> ops;
  Builder b{&ops};
  const Dims d = dims(m, s);
  const double rows = s.sequence_parallel ? d.T / d.t : d.T;  // tokens a rank holds outside TP
  const int64_t t = s.tensor_parallel;
  const int64_t qkv_out = (m.num_attention_heads + 2 * m.query_groups()) * m.kv_channels() / t;
  const int64_t ffn_local = m.ffn_hidden() / t;

  b.memory("input_layernorm", rows * d.h * kAct * 2);
  if (t > 1) enter_tp(b, s, d, "attn");
  b.gemm("qkv", d.Ti, qkv_out, d.hi);
  attention_core(b, m, s, d);
  b.gemm("attn_proj", d.Ti, d.hi, m.hidden_size / t);
  exit_tp(b, s, d, "attn");
  b.memory("attn_bias_dropout_add", rows * d.h * (kAct * 3 + 1.0));
  b.memory("post_attention_layernorm", rows * d.h * kAct * 2);
  if (t > 1) enter_tp(b, s, d, "mlp");
  b.gemm("fc1", d.Ti, m.swiglu ? 2 * ffn_local : ffn_local, d.hi);
  b.memory(m.swiglu ? "swiglu" : "bias_gelu",
           d.T * static_cast<double>(ffn_local) * kAct * (m.swiglu ? 3 : 2));
  b.gemm("fc2", d.Ti, d.hi, ffn_local);
  exit_tp(b, s, d, "mlp");
  b.memory("mlp_bias_dropout_add", rows * d.h * (kAct * 3 + 1.0));
  return ops;
}

// Backward of a forward list, in reverse order. GEMMs split into input- and weight-gradient
// GEMMs; memory-bound ops read the saved input and the incoming gradient and write the
// outgoing one (1.5x the forward traffic); a collective's backward is its conjugate.
std::vector<Op> backward_of(const std::vector<Op>& fwd) {
  std::vector<Op> ops;
  Builder b{&ops};
  for (auto it = fwd.rbegin(); it != fwd.rend(); ++it) {
    const Op& f = *it;
    switch (f.kind) {
      case OpKind::kGemm:
        add_gemm_backward(b, f);
        break;
      case OpKind::kMemory:
        b.memory(f.name + "_backward", f.bytes * 1.5);
        break;
      case OpKind::kCollective: {
        Collective c = f.collective;
        if (c == Collective::kAllGather)
          c = Collective::kReduceScatter;
        else if (c == Collective::kReduceScatter)
          c = Collective::kAllGather;
        else if (c == Collective::kAllReduce && f.group == CommGroup::kTensor)
          continue;
        b.collective(f.name + "_backward", c, f.bytes, f.group);
        break;
      }
    }
  }
  return ops;
}

// Without sequence parallelism the identity "f" operator before each column-parallel block
// all-reduces the input gradient in the backward pass.
void add_tp_input_grad_allreduces(std::vector<Op>& bwd, const LayerShape& s, const Dims& d) {
  if (s.tensor_parallel == 1 || s.sequence_parallel) return;
  std::vector<Op> out;
  Builder b{&out};
  for (const Op& op : bwd) {
    out.push_back(op);
    if (op.name == "fc1_dgrad" || op.name == "qkv_dgrad") {
      b.collective(op.name.substr(0, op.name.find('_')) + "_input_grad_allreduce",
                   Collective::kAllReduce, d.T * d.h * kAct);
    }
  }
  bwd.swap(out);
}

}  // namespace

std::string to_string(Collective c) {
  switch (c) {
    case Collective::kAllReduce:
      return "all-reduce";
    case Collective::kAllGather:
      return "all-gather";
    case Collective::kReduceScatter:
      return "reduce-scatter";
    case Collective::kSendRecv:
      return "send/recv";
  }
  return "?";
}

LayerShape layer_shape(const ParallelPlan& p) {
  LayerShape s;
  s.tensor_parallel = p.tensor_parallel;
  s.micro_batch = p.micro_batch_size;
  s.sequence_parallel = p.sequence_parallel;
  s.recompute = p.recompute;
  s.fused_grad_accumulation = p.gradient_accumulation_fusion;
  s.main_grad_bytes = p.fp32_grad_reduce ? 4.0 : 2.0;
  return s;
}

PassOps transformer_layer_ops(const ModelSpec& m, const LayerShape& s) {
  PassOps p;
  p.forward = layer_forward(m, s);
  p.backward = backward_of(p.forward);
  add_tp_input_grad_allreduces(p.backward, s, dims(m, s));
  if (!s.fused_grad_accumulation) {
    // The weight-gradient GEMM writes a fresh 16-bit gradient; a second pass reads it and
    // the main gradient and writes the main gradient.
    Builder b{&p.backward};
    b.memory("weight_grad_accumulate", m.parameters_per_layer() /
                                           static_cast<double>(s.tensor_parallel) *
                                           (2.0 * kAct + 2.0 * s.main_grad_bytes));
  }
  if (s.recompute == Recompute::kFull) {
    p.recompute = p.forward;
  } else if (s.recompute == Recompute::kSelective) {
    Builder b{&p.recompute};
    attention_core(b, m, s, dims(m, s));
  }
  return p;
}

PassOps embedding_ops(const ModelSpec& m, const LayerShape& s) {
  PassOps p;
  const Dims d = dims(m, s);
  const double rows = s.sequence_parallel ? d.T / d.t : d.T;
  Builder f{&p.forward};
  // Vocabulary-parallel lookup: each rank fills the rows of its vocabulary shard, zeros elsewhere.
  f.memory("word_embedding_lookup", d.T * d.h * kAct * 2);
  if (s.tensor_parallel > 1) exit_tp(f, s, d, "embedding");
  f.memory("embedding_position_dropout", rows * d.h * (kAct * 3 + 1.0));
  Builder bw{&p.backward};
  bw.memory("embedding_dropout_backward", rows * d.h * (kAct * 3 + 1.0));
  if (s.sequence_parallel)
    bw.collective("embedding_grad_allgather", Collective::kAllGather, d.T * d.h * kAct);
  bw.memory("word_embedding_grad_scatter_add", d.T * d.h * (kAct + 4.0 * 2));
  if (!s.fused_grad_accumulation) {
    bw.memory("embedding_grad_accumulate",
              m.embedding_parameters() / d.t * (2.0 * kAct + 2.0 * s.main_grad_bytes));
  }
  return p;
}

PassOps lm_head_ops(const ModelSpec& m, const LayerShape& s) {
  PassOps p;
  const Dims d = dims(m, s);
  const double rows = s.sequence_parallel ? d.T / d.t : d.T;
  const int64_t vocab_local = (m.vocab_size + s.tensor_parallel - 1) / s.tensor_parallel;
  const double logits = d.T * static_cast<double>(vocab_local);
  Builder f{&p.forward};
  f.memory("final_layernorm", rows * d.h * kAct * 2);
  if (s.tensor_parallel > 1) enter_tp(f, s, d, "lm_head");
  f.gemm("lm_head", d.Ti, vocab_local, d.hi);
  // Vocabulary-parallel cross entropy: max, sum-exp and target logit reduced over TP ranks.
  f.memory("cross_entropy", logits * (kAct + 4.0 * 2));
  if (s.tensor_parallel > 1) {
    f.collective("cross_entropy_allreduce", Collective::kAllReduce, d.T * 4.0 * 3);
  }
  Builder bw{&p.backward};
  bw.memory("cross_entropy_backward", logits * (4.0 + kAct));
  for (const Op& op : p.forward) {
    if (op.kind == OpKind::kGemm) add_gemm_backward(bw, op);
  }
  if (s.tensor_parallel > 1) {
    if (s.sequence_parallel) {
      bw.collective("lm_head_grad_reducescatter", Collective::kReduceScatter, d.T * d.h * kAct);
    } else {
      bw.collective("lm_head_input_grad_allreduce", Collective::kAllReduce, d.T * d.h * kAct);
    }
  }
  bw.memory("final_layernorm_backward", rows * d.h * kAct * 3);
  if (!s.fused_grad_accumulation) {
    bw.memory("output_grad_accumulate", static_cast<double>(m.vocab_size) * d.h / d.t *
                                            (2.0 * kAct + 2.0 * s.main_grad_bytes));
  }
  return p;
}

double layer_activation_bytes(const ModelSpec& m, const LayerShape& s) {
  const Dims d = dims(m, s);
  const double sbh = d.T * d.h;
  const double t = d.t;
  if (s.recompute == Recompute::kFull) return kAct * sbh / (s.sequence_parallel ? t : 1.0);
  const double kv_fraction = d.groups / d.heads;
  const double gate = m.swiglu ? 2.0 : 1.0;
  // Replicated across TP ranks unless sequence parallel: both layernorm inputs (4 sbh), the
  // QKV and FC1 inputs (2 sbh each) and the two dropout masks (1 sbh each).
  const double replicated = 10.0 * sbh;
  // Sharded by t: Q, K, V (2 sbh, K and V scaled by groups/heads), the projection input
  // (2 sbh), the activation-function input(s) and the FC2 input (2 s b ffn each).
  const double sharded = (2.0 + 4.0 * kv_fraction + 2.0) * sbh + (2.0 * gate + 2.0) * d.T * d.ffn;
  // Softmax output (2), dropout mask (1) and dropout output (2) per score: 5 a s^2 b.
  const double scores = s.recompute == Recompute::kSelective ? 0.0 : 5.0 * d.heads * d.s * d.T;
  if (s.sequence_parallel) return (replicated + sharded + scores) / t;
  return replicated + (sharded + scores) / t;
}

bool is_weight_gradient(const Op& op) {
  const std::string& n = op.name;
  auto ends_with = [&](const std::string& tail) {
    return n.size() >= tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0;
  };
  return ends_with("_wgrad") || ends_with("grad_accumulate") ||
         n == "word_embedding_grad_scatter_add";
}

}  // namespace ptdp
