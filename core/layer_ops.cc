// Builds the per-GPU op lists of a tensor-parallel (and optionally sequence-parallel)
// transformer layer as Megatron-LM executes it (column-parallel QKV and FC1, row-parallel
// projection and FC2, fused scale-mask-softmax, dropout after attention and both blocks).
#include "core/layer_ops.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace ptdp {
namespace {

constexpr std::array<std::string_view, kNumOpIds> kOpNames = {
    "input_layernorm",
    "attn_allgather",
    "qkv",
    "qk_layernorm",
    "q_down_proj",
    "kv_down_proj",
    "latent_layernorm",
    "q_up_proj",
    "kv_up_proj",
    "rotary_embedding",
    "attn_scores",
    "attn_softmax",
    "attn_dropout",
    "attn_context",
    "attn_proj",
    "attn_allreduce",
    "attn_reducescatter",
    "attn_bias_dropout_add",
    "post_attention_layernorm",
    "mlp_allgather",
    "fc1",
    "bias_gelu",
    "swiglu",
    "fc2",
    "mlp_allreduce",
    "mlp_reducescatter",
    "mlp_bias_dropout_add",
    "mlp_bias_dropout_add_backward",
    "mlp_reducescatter_backward",
    "fc2_dgrad",
    "fc2_wgrad",
    "bias_gelu_backward",
    "swiglu_backward",
    "mlp_input_regather",
    "fc1_dgrad",
    "fc1_input_grad_allreduce",
    "fc1_wgrad",
    "mlp_allgather_backward",
    "post_attention_layernorm_backward",
    "attn_bias_dropout_add_backward",
    "attn_reducescatter_backward",
    "attn_proj_dgrad",
    "attn_proj_wgrad",
    "attn_scores_recompute",
    "attn_context_dprobs",
    "attn_context_dv",
    "attn_dropout_backward",
    "attn_softmax_backward",
    "attn_scores_dq",
    "attn_scores_dk",
    "rotary_embedding_backward",
    "qk_layernorm_backward",
    "kv_up_proj_dgrad",
    "kv_up_proj_wgrad",
    "q_up_proj_dgrad",
    "q_up_proj_wgrad",
    "latent_input_grad_allreduce",
    "latent_layernorm_backward",
    "kv_down_proj_dgrad",
    "kv_down_proj_wgrad",
    "q_down_proj_dgrad",
    "q_down_proj_wgrad",
    "attn_input_regather",
    "qkv_dgrad",
    "qkv_input_grad_allreduce",
    "qkv_wgrad",
    "attn_allgather_backward",
    "input_layernorm_backward",
    "weight_grad_accumulate",
    "word_embedding_lookup",
    "embedding_allreduce",
    "embedding_reducescatter",
    "embedding_position_dropout",
    "embedding_dropout_backward",
    "embedding_grad_allgather",
    "word_embedding_grad_scatter_add",
    "embedding_grad_accumulate",
    "final_layernorm",
    "lm_head_allgather",
    "lm_head",
    "cross_entropy",
    "cross_entropy_allgather",
    "cross_entropy_backward",
    "lm_head_dgrad",
    "lm_head_wgrad",
    "lm_head_grad_reducescatter",
    "lm_head_input_grad_allreduce",
    "final_layernorm_backward",
    "output_grad_accumulate",
    "cp_kv_exchange",
    "cp_kv_exchange_backward",
    "cp_out_alltoall",
    "cp_out_alltoall_backward",
    "router",
    "router_topk",
    "moe_permute",
    "moe_dispatch",
    "moe_dispatch_allgather",
    "expert_fc1",
    "expert_activation",
    "expert_fc2",
    "moe_combine_reducescatter",
    "moe_combine",
    "moe_unpermute",
    "moe_unpermute_backward",
    "moe_combine_backward",
    "moe_combine_reducescatter_backward",
    "expert_fc2_dgrad",
    "expert_fc2_wgrad",
    "expert_activation_backward",
    "expert_fc1_dgrad",
    "expert_fc1_wgrad",
    "moe_dispatch_allgather_backward",
    "moe_dispatch_backward",
    "moe_permute_backward",
    "router_topk_backward",
    "router_dgrad",
    "router_wgrad",
    "mtp_norms",
    "mtp_proj_all_gather",
    "mtp_eh_proj",
    "mtp_proj_output_all_gather",
    "mtp_eh_proj_dgrad",
    "mtp_eh_proj_wgrad",
    "mtp_proj_input_grad_reduce",
    "mtp_norms_backward",
    "mtp_proj_output_scatter_backward",
};

// The backward ops of a forward op: for a GEMM its two backward GEMMs (the second computes a
// weight gradient unless the GEMM has no weights), for a memory-bound op or a collective its
// backward (kNone when a tensor-parallel all-reduce's backward is the identity).
struct BackwardOf {
  OpId first, second;
  bool has_second = false, second_is_weight_grad = false, none = false;
};

BackwardOf backward_ids(OpId f) {
  using I = OpId;
  switch (f) {
    case I::kQkv:
      return {I::kQkvDgrad, I::kQkvWgrad, true, true};
    case I::kQDownProj:
      return {I::kQDownProjDgrad, I::kQDownProjWgrad, true, true};
    case I::kKvDownProj:
      return {I::kKvDownProjDgrad, I::kKvDownProjWgrad, true, true};
    case I::kQUpProj:
      return {I::kQUpProjDgrad, I::kQUpProjWgrad, true, true};
    case I::kKvUpProj:
      return {I::kKvUpProjDgrad, I::kKvUpProjWgrad, true, true};
    case I::kLatentLayernorm:
      return {I::kLatentLayernormBackward, I::kLatentLayernormBackward};
    case I::kAttnScores:  // scores = Q K^T: dQ and dK, both input gradients
      return {I::kAttnScoresDq, I::kAttnScoresDk, true, false};
    case I::kAttnContext:  // context = P V: dP and dV, both input gradients
      return {I::kAttnContextDprobs, I::kAttnContextDv, true, false};
    case I::kAttnProj:
      return {I::kAttnProjDgrad, I::kAttnProjWgrad, true, true};
    case I::kFc1:
      return {I::kFc1Dgrad, I::kFc1Wgrad, true, true};
    case I::kFc2:
      return {I::kFc2Dgrad, I::kFc2Wgrad, true, true};
    case I::kLmHead:
      return {I::kLmHeadDgrad, I::kLmHeadWgrad, true, true};
    case I::kMtpEhProj:
      return {I::kMtpEhProjDgrad, I::kMtpEhProjWgrad, true, true};
    case I::kInputLayernorm:
      return {I::kInputLayernormBackward, I::kInputLayernormBackward};
    case I::kAttnSoftmax:
      return {I::kAttnSoftmaxBackward, I::kAttnSoftmaxBackward};
    case I::kRotaryEmbedding:
      return {I::kRotaryEmbeddingBackward, I::kRotaryEmbeddingBackward};
    case I::kQkLayernorm:
      return {I::kQkLayernormBackward, I::kQkLayernormBackward};
    case I::kAttnDropout:
      return {I::kAttnDropoutBackward, I::kAttnDropoutBackward};
    case I::kAttnBiasDropoutAdd:
      return {I::kAttnBiasDropoutAddBackward, I::kAttnBiasDropoutAddBackward};
    case I::kPostAttentionLayernorm:
      return {I::kPostAttentionLayernormBackward, I::kPostAttentionLayernormBackward};
    case I::kBiasGelu:
      return {I::kBiasGeluBackward, I::kBiasGeluBackward};
    case I::kSwiglu:
      return {I::kSwigluBackward, I::kSwigluBackward};
    case I::kMlpBiasDropoutAdd:
      return {I::kMlpBiasDropoutAddBackward, I::kMlpBiasDropoutAddBackward};
    case I::kAttnAllGather:
      return {I::kAttnAllGatherBackward, I::kAttnAllGatherBackward};
    case I::kAttnReduceScatter:
      return {I::kAttnReduceScatterBackward, I::kAttnReduceScatterBackward};
    case I::kMlpAllGather:
      return {I::kMlpAllGatherBackward, I::kMlpAllGatherBackward};
    case I::kMlpReduceScatter:
      return {I::kMlpReduceScatterBackward, I::kMlpReduceScatterBackward};
    case I::kCpKvExchange:
      return {I::kCpKvExchangeBackward, I::kCpKvExchangeBackward};
    case I::kCpOutAllToAll:
      return {I::kCpOutAllToAllBackward, I::kCpOutAllToAllBackward};
    case I::kRouter:
      return {I::kRouterDgrad, I::kRouterWgrad, true, true};
    case I::kExpertFc1:
      return {I::kExpertFc1Dgrad, I::kExpertFc1Wgrad, true, true};
    case I::kExpertFc2:
      return {I::kExpertFc2Dgrad, I::kExpertFc2Wgrad, true, true};
    case I::kRouterTopk:
      return {I::kRouterTopkBackward, I::kRouterTopkBackward};
    case I::kMoePermute:
      return {I::kMoePermuteBackward, I::kMoePermuteBackward};
    case I::kExpertActivation:
      return {I::kExpertActivationBackward, I::kExpertActivationBackward};
    case I::kMoeUnpermute:
      return {I::kMoeUnpermuteBackward, I::kMoeUnpermuteBackward};
    case I::kMoeDispatch:
      return {I::kMoeDispatchBackward, I::kMoeDispatchBackward};
    case I::kMoeDispatchAllGather:
      return {I::kMoeDispatchAllGatherBackward, I::kMoeDispatchAllGatherBackward};
    case I::kMoeCombineReduceScatter:
      return {I::kMoeCombineReduceScatterBackward, I::kMoeCombineReduceScatterBackward};
    case I::kMoeCombine:
      return {I::kMoeCombineBackward, I::kMoeCombineBackward};
    default:  // tensor-parallel all-reduces: the conjugate "f" operator is the identity
      return {f, f, false, false, true};
  }
}

struct Builder {
  std::vector<Op>* out;
  OpRole role;
  DType dtype;

  Op& add(OpId id, OpKind kind) {
    Op& op = out->emplace_back();
    op.id = id;
    op.kind = kind;
    op.role = role;
    op.dtype = dtype;
    return op;
  }
  void gemm(OpId id, int64_t m, int64_t n, int64_t k, int64_t batch = 1,
            OpRole r = OpRole::kForward) {
    Op& op = add(id, OpKind::kGemm);
    op.m = m;
    op.n = n;
    op.k = k;
    op.batch = batch;
    if (r != OpRole::kForward) op.role = r;
  }
  void memory(OpId id, double bytes, OpRole r = OpRole::kForward) {
    Op& op = add(id, OpKind::kMemory);
    op.bytes = bytes;
    if (r != OpRole::kForward) op.role = r;
  }
  void collective(OpId id, Collective c, double bytes, CommGroup g = CommGroup::kTensor) {
    Op& op = add(id, OpKind::kCollective);
    op.collective = c;
    op.bytes = bytes;
    op.group = g;
  }
};

// T: tokens of a microbatch this rank holds (b s / cp); s: the whole sequence (keys); sq: the
// rank's queries (s / cp).
// kv: a query's and key's channels per head, vd: a value's (they differ with MLA).
struct Dims {
  double T, h, s, heads, kv, vd, groups, ffn, t;
  int64_t Ti, hi, si, sqi, kvi, vdi;
  double act;  // bytes per activation element
};

Dims dims(const ModelSpec& m, const LayerShape& s) {
  Dims d;
  d.t = static_cast<double>(s.tensor_parallel);
  d.sqi = m.seq_length / s.context_parallel;
  d.Ti = s.micro_batch * d.sqi;
  d.T = static_cast<double>(d.Ti);
  d.hi = m.hidden_size;
  d.h = static_cast<double>(m.hidden_size);
  d.si = m.seq_length;
  d.s = static_cast<double>(m.seq_length);
  d.heads = static_cast<double>(m.num_attention_heads);
  d.kvi = m.head_dim();
  d.kv = static_cast<double>(d.kvi);
  d.vdi = m.value_dim();
  d.vd = static_cast<double>(d.vdi);
  d.groups = static_cast<double>(m.query_groups());
  d.ffn = static_cast<double>(m.ffn_hidden());
  d.act = static_cast<double>(dtype_bytes(s.activation_dtype));
  return d;
}

// The context-parallel ranks a heads all-to-all spans (ParallelPlan::cp_a2a_size).
int64_t heads_all_to_all_ranks(const LayerShape& s) {
  if (s.context_parallel <= 1) return 1;
  if (s.cp_comm == CpComm::kA2A) return s.context_parallel;
  return s.cp_comm == CpComm::kA2AP2P && s.hierarchical_cp > 0 ? s.hierarchical_cp : 1;
}

// Forward ops of the attention core (scores, softmax, dropout, context): the part selective
// recomputation redoes.
// Attention as fused (flash) kernels compute it: with --use-flash-attn, and always with context
// parallelism (Megatron-Core runs cp only with Transformer Engine's fused attention).
bool fused_attention(const ModelSpec& m, const LayerShape& s) {
  return s.fused_attention && (m.flash_attention || s.context_parallel > 1);
}

// A fused attention's backward pass first recomputes the scores (FlashAttention-2's backward is
// five GEMMs to the forward's two): one more scores GEMM, a recomputation, before the others.
void add_fused_attention_recompute(std::vector<Op>& bwd, const std::vector<Op>& fwd) {
  const auto scores =
      std::find_if(fwd.begin(), fwd.end(), [](const Op& op) { return op.id == OpId::kAttnScores; });
  const auto first = std::find_if(bwd.begin(), bwd.end(), [](const Op& op) {
    return op.id == OpId::kAttnContextDprobs || op.id == OpId::kAttnContextDv;
  });
  if (scores == fwd.end() || first == bwd.end()) return;
  Op again = *scores;
  again.id = OpId::kAttnScoresRecompute;
  again.role = OpRole::kRecompute;
  bwd.insert(first, again);
}

// With context parallelism the rank's s/cp queries meet all s keys. p2p: the K and V blocks of
// the other cp - 1 ranks arrive one ring step at a time (each step's transfer overlapping the
// previous block's attention, which the cost model prices). all_gather: one all-gather of the
// whole sequence's K and V before the attention, exposed (Transformer Engine's
// AttnFuncWithCPAndKVAllGather). a2a: an all-to-all turns the rank's s/cp tokens of all its
// heads into all s tokens of 1/cp of its heads (Q, K and V), the attention runs over the whole
// sequence, and a second all-to-all returns its output (AttnFuncWithCPAndQKVOA2A); the same
// query-key pairs, as fewer, longer GEMMs. a2a+p2p: the all-to-all within groups of A ranks
// gives each rank s / B tokens (its group's) of heads / A heads, whose K and V blocks then go
// round the ring of the B groups (B - 1 steps of the same bytes as a p2p step, under the
// attention), and the output comes back by the all-to-all.
//
// Unfused (Megatron's scale-mask-softmax), the scores of all s x s pairs are written, soft-maxed
// and dropped out in memory. Fused, they stay on chip: the GEMMs skip the blocks above the causal
// diagonal (half the pairs; causal load balancing gives every cp rank half of its block too),
// the softmax only writes one fp32 log-sum-exp per row, and dropout happens in the kernel.
void attention_core(Builder& b, const ModelSpec& m, const LayerShape& s, const Dims& d) {
  const int64_t cp = s.context_parallel;
  // The heads all-to-all's ranks (cp with a2a, A with a2a+p2p, else 1) and the ring's.
  const int64_t a2a = heads_all_to_all_ranks(s);
  const int64_t ring = s.cp_comm == CpComm::kP2P || s.cp_comm == CpComm::kA2AP2P ? cp / a2a : 1;
  // After an all-to-all: s / ring queries (the group's tokens) of heads / a2a heads; otherwise
  // s / cp queries of every local head.
  const int64_t local_heads = m.num_attention_heads / s.tensor_parallel / a2a;
  const int64_t queries = a2a > 1 ? d.si / ring : d.sqi;
  const int64_t batch = s.micro_batch * local_heads;
  const double rows = static_cast<double>(batch) * static_cast<double>(queries);
  const double scores = rows * d.s;  // elements
  const double kv_block = d.T * static_cast<double>(m.query_groups()) / d.t * (d.kv + d.vd) * d.act;
  const double q_block = d.T * d.heads / d.t * d.kv * d.act;
  const double out_block = d.T * d.heads / d.t * d.vd * d.act;
  if (cp > 1) {
    if (a2a > 1)
      b.collective(OpId::kCpKvExchange, Collective::kAllToAll, q_block + kv_block,
                   CommGroup::kContext);
    if (s.cp_comm == CpComm::kAllGather)  // the whole sequence's K and V (buffer: the output)
      b.collective(OpId::kCpKvExchange, Collective::kAllGather, kv_block * static_cast<double>(cp),
                   CommGroup::kContext);
    for (int64_t step = 1; step < ring; ++step)
      b.collective(OpId::kCpKvExchange, Collective::kSendRecv, kv_block, CommGroup::kContext);
  }
  auto out_back = [&] {
    if (a2a > 1)
      b.collective(OpId::kCpOutAllToAll, Collective::kAllToAll, out_block, CommGroup::kContext);
  };
  if (fused_attention(m, s)) {
    const int64_t keys = std::max<int64_t>(1, d.si / 2);  // the causal half
    const size_t first = b.out->size();
    b.gemm(OpId::kAttnScores, queries, keys, d.kvi, batch);
    b.memory(OpId::kAttnSoftmax, rows * 4.0);
    b.gemm(OpId::kAttnContext, queries, d.vdi, keys, batch);
    for (size_t i = first; i < b.out->size(); ++i) (*b.out)[i].fused = true;
    out_back();
    return;
  }
  b.gemm(OpId::kAttnScores, queries, d.si, d.kvi, batch);
  b.memory(OpId::kAttnSoftmax, scores * d.act * 2);  // read scores, write probabilities
  if (m.attention_dropout > 0)
    b.memory(OpId::kAttnDropout, scores * (d.act * 2 + 1.0));  // read, write, 1-byte mask
  b.gemm(OpId::kAttnContext, queries, d.vdi, d.si, batch);
  out_back();
}

// Entry into a column-parallel block: with sequence parallelism the s/t shard is all-gathered.
void enter_tp(Builder& b, const LayerShape& s, const Dims& d, OpId all_gather) {
  if (s.sequence_parallel) b.collective(all_gather, Collective::kAllGather, d.T * d.h * d.act);
}
// Exit of a row-parallel block: partial sums are all-reduced (or reduce-scattered with SP).
void exit_tp(Builder& b, const LayerShape& s, const Dims& d, OpId all_reduce, OpId reduce_scatter) {
  if (s.tensor_parallel == 1) return;
  if (s.sequence_parallel)
    b.collective(reduce_scatter, Collective::kReduceScatter, d.T * d.h * d.act);
  else
    b.collective(all_reduce, Collective::kAllReduce, d.T * d.h * d.act);
}

// Multi-head latent attention's projections (Megatron-Core's MLASelfAttention), from the
// input norm's output to Q, K and V. The down projections (whole weights on every rank) read the
// rank's tokens, R of them (T / t with sequence parallelism: no all-gather of the hidden state),
// and their latents are normalised there; with sequence parallelism the normalised latents (and
// the shared rotated key) are all-gathered, and without a query latent the hidden state too, for
// the column-parallel up projections over all T tokens. The rotary embedding rotates the
// queries' last qk_pos_emb_head_dim channels and the one shared rotated key, and assembles each
// local head's key from its unrotated part and that key (reads and writes Q; reads the up
// projection's keys and values and the rotated key, writes K and V).
void mla_projections(Builder& b, const ModelSpec& m, const LayerShape& s, const Dims& d) {
  const int64_t t = s.tensor_parallel;
  const double R = s.sequence_parallel ? d.T / d.t : d.T;
  const int64_t Ri = static_cast<int64_t>(R);
  const int64_t hl = m.num_attention_heads / t;
  const int64_t ql = m.q_latent_width(), kvw = m.kv_latent_width();
  const double latents = static_cast<double>(ql + m.kv_lora_rank);
  if (ql > 0) b.gemm(OpId::kQDownProj, Ri, ql, d.hi);
  b.gemm(OpId::kKvDownProj, Ri, kvw, d.hi);
  if (m.qk_layernorm) b.memory(OpId::kLatentLayernorm, R * latents * d.act * 2);
  if (t > 1 && s.sequence_parallel) {
    const double gathered = static_cast<double>(ql > 0 ? ql + kvw : kvw) + (ql > 0 ? 0.0 : d.h);
    b.collective(OpId::kAttnAllGather, Collective::kAllGather, d.T * gathered * d.act);
  }
  b.gemm(OpId::kQUpProj, d.Ti, hl * d.kvi, ql > 0 ? ql : d.hi);
  b.gemm(OpId::kKvUpProj, d.Ti, hl * (m.qk_head_dim + d.vdi), m.kv_lora_rank);
  const double q = static_cast<double>(hl) * d.kv, v = static_cast<double>(hl) * d.vd;
  const double kv_up = static_cast<double>(hl * (m.qk_head_dim + d.vdi));
  b.memory(OpId::kRotaryEmbedding,
           d.T * (2.0 * q + kv_up + static_cast<double>(m.qk_pos_emb_head_dim) + q + v) * d.act);
}

// The attention half of a layer, up to and including the post-attention layernorm.
void attention_forward(Builder& b, const ModelSpec& m, const LayerShape& s, const Dims& d) {
  const double rows = s.sequence_parallel ? d.T / d.t : d.T;  // tokens a rank holds outside TP
  const int64_t t = s.tensor_parallel;
  const int64_t qkv_out = (m.num_attention_heads + 2 * m.query_groups()) * m.head_dim() / t;

  b.memory(OpId::kInputLayernorm, rows * d.h * d.act * 2);
  if (m.multi_latent_attention) {
    mla_projections(b, m, s, d);
  } else {
    if (t > 1) enter_tp(b, s, d, OpId::kAttnAllGather);
    b.gemm(OpId::kQkv, d.Ti, qkv_out, d.hi);
    // --qk-layernorm normalises the local queries and keys per head (read and write).
    const double qk_heads = static_cast<double>((m.num_attention_heads + m.query_groups()) / t);
    if (m.qk_layernorm) b.memory(OpId::kQkLayernorm, d.T * qk_heads * d.kv * d.act * 2);
    // Rotary position embeddings rotate the local queries and keys in place (read and write).
    if (!m.learned_position_embeddings)
      b.memory(OpId::kRotaryEmbedding, d.T * qk_heads * d.kv * d.act * 2);
  }
  attention_core(b, m, s, d);
  b.gemm(OpId::kAttnProj, d.Ti, d.hi, m.context_width() / t);
  exit_tp(b, s, d, OpId::kAttnAllReduce, OpId::kAttnReduceScatter);
  b.memory(OpId::kAttnBiasDropoutAdd, rows * d.h * (d.act * 3 + 1.0));
  b.memory(OpId::kPostAttentionLayernorm, rows * d.h * d.act * 2);
}

// A tensor-parallel MLP of FFN width `width` (the dense MLP, or an MoE layer's shared experts),
// from its sequence-parallel all-gather to its reduce.
void dense_mlp(Builder& b, const ModelSpec& m, const LayerShape& s, const Dims& d, int64_t width) {
  const int64_t t = s.tensor_parallel;
  const int64_t ffn_local = width / t;
  if (t > 1) enter_tp(b, s, d, OpId::kMlpAllGather);
  b.gemm(OpId::kFc1, d.Ti, m.swiglu ? 2 * ffn_local : ffn_local, d.hi);
  b.memory(m.swiglu ? OpId::kSwiglu : OpId::kBiasGelu,
           d.T * static_cast<double>(ffn_local) * d.act * (m.swiglu ? 3 : 2));
  b.gemm(OpId::kFc2, d.Ti, d.hi, ffn_local);
  exit_tp(b, s, d, OpId::kMlpAllReduce, OpId::kMlpReduceScatter);
}

std::vector<Op> layer_forward(const ModelSpec& m, const LayerShape& s) {
  std::vector<Op> ops;
  Builder b{&ops, OpRole::kForward, s.activation_dtype};
  const Dims d = dims(m, s);
  const double rows = s.sequence_parallel ? d.T / d.t : d.T;
  attention_forward(b, m, s, d);
  dense_mlp(b, m, s, d, m.ffn_hidden());
  b.memory(OpId::kMlpBiasDropoutAdd, rows * d.h * (d.act * 3 + 1.0));
  return ops;
}

// Token assignments routed from this rank (its tokens times top-k), and those the rank's
// experts process: every rank of its expert-tensor group's assignments, at the busiest rank's
// load.
struct Routing {
  double sent = 0, processed = 0;
  int64_t local_experts = 1, per_expert = 0, ffn_local = 0;
};

Routing routing(const ModelSpec& m, const LayerShape& s, const Dims& d) {
  Routing r;
  const double rows = s.sequence_parallel ? d.T / d.t : d.T;
  r.sent = rows * static_cast<double>(m.moe_router_topk);
  r.processed = r.sent * static_cast<double>(s.expert_tensor_parallel) * s.expert_load;
  r.local_experts = m.num_experts / s.expert_parallel;
  r.per_expert = static_cast<int64_t>(
      std::ceil(r.processed / static_cast<double>(std::max<int64_t>(1, r.local_experts))));
  r.ffn_local = m.moe_ffn_hidden() / s.expert_tensor_parallel;
  return r;
}

// Megatron-Core's MoE layer with the all-to-all token dispatcher, in place of the MLP.
std::vector<Op> moe_forward(const ModelSpec& m, const LayerShape& s) {
  std::vector<Op> ops;
  Builder b{&ops, OpRole::kForward, s.activation_dtype};
  const Dims d = dims(m, s);
  const double rows = s.sequence_parallel ? d.T / d.t : d.T;
  const int64_t rows_i = static_cast<int64_t>(rows);
  const Routing r = routing(m, s, d);
  const double experts = static_cast<double>(m.num_experts);
  attention_forward(b, m, s, d);
  if (m.moe_shared_expert_ffn_size > 0) dense_mlp(b, m, s, d, m.moe_shared_expert_ffn_size);
  b.gemm(OpId::kRouter, rows_i, m.num_experts, d.hi);
  // Softmax over the experts' logits and the top-k (fp32 probabilities).
  b.memory(OpId::kRouterTopk, rows * experts * (d.act + 4.0) + r.sent * 8.0);
  b.memory(OpId::kMoePermute, r.sent * d.h * d.act * 2);
  const double routed = r.sent * d.h * d.act;
  if (s.expert_parallel > 1)
    b.collective(OpId::kMoeDispatch, Collective::kAllToAll, routed, CommGroup::kExpert);
  const double etp = static_cast<double>(s.expert_tensor_parallel);
  if (s.expert_tensor_parallel > 1)
    b.collective(OpId::kMoeDispatchAllGather, Collective::kAllGather, routed * etp,
                 CommGroup::kExpertTensor);
  const int64_t fc1_out = m.swiglu ? 2 * r.ffn_local : r.ffn_local;
  b.gemm(OpId::kExpertFc1, r.per_expert, fc1_out, d.hi, r.local_experts);
  b.memory(OpId::kExpertActivation,
           r.processed * static_cast<double>(r.ffn_local) * d.act * (m.swiglu ? 3 : 2));
  b.gemm(OpId::kExpertFc2, r.per_expert, d.hi, r.ffn_local, r.local_experts);
  if (s.expert_tensor_parallel > 1)
    b.collective(OpId::kMoeCombineReduceScatter, Collective::kReduceScatter, routed * etp,
                 CommGroup::kExpertTensor);
  if (s.expert_parallel > 1)
    b.collective(OpId::kMoeCombine, Collective::kAllToAll, routed, CommGroup::kExpert);
  // Each token's k outputs weighted by their probabilities and summed.
  b.memory(OpId::kMoeUnpermute, routed * 2 + rows * d.h * d.act);
  b.memory(OpId::kMlpBiasDropoutAdd, rows * d.h * (d.act * 3 + 1.0));
  return ops;
}

// The backward GEMMs of C = A B: dA = dC B^T and dB = A^T dC.
void add_gemm_backward(Builder& b, const Op& f) {
  const BackwardOf ids = backward_ids(f.id);
  b.gemm(ids.first, f.m, f.k, f.n, f.batch, OpRole::kInputGrad);
  b.gemm(ids.second, f.k, f.n, f.m, f.batch,
         ids.second_is_weight_grad ? OpRole::kWeightGrad : OpRole::kInputGrad);
}

// Backward of a forward list, in reverse order. GEMMs split into input- and weight-gradient
// GEMMs; memory-bound ops read the saved input and the incoming gradient and write the
// outgoing one (1.5x the forward traffic); a collective's backward is its conjugate.
std::vector<Op> backward_of(const std::vector<Op>& fwd, DType dtype) {
  std::vector<Op> ops;
  Builder b{&ops, OpRole::kInputGrad, dtype};
  for (auto it = fwd.rbegin(); it != fwd.rend(); ++it) {
    const Op& f = *it;
    const size_t first = ops.size();
    switch (f.kind) {
      case OpKind::kGemm:
        add_gemm_backward(b, f);
        break;
      case OpKind::kMemory:
        b.memory(backward_ids(f.id).first, f.bytes * 1.5);
        break;
      case OpKind::kCollective: {
        const BackwardOf ids = backward_ids(f.id);
        if (ids.none) continue;
        Collective c = f.collective;
        if (c == Collective::kAllGather)
          c = Collective::kReduceScatter;
        else if (c == Collective::kReduceScatter)
          c = Collective::kAllGather;
        // A context-parallel ring step moves K and V again and their gradients back; the
        // all-gather gathers K and V again and reduce-scatters their gradients (as much again);
        // a2a's all-to-alls return the gradients, as many bytes.
        const double bytes =
            f.id == OpId::kCpKvExchange && c != Collective::kAllToAll ? 2.0 * f.bytes : f.bytes;
        b.collective(ids.first, c, bytes, f.group);
        break;
      }
    }
    for (size_t i = first; i < ops.size(); ++i) ops[i].fused = f.fused;
  }
  return ops;
}

// Without sequence parallelism the identity "f" operator before each column-parallel block
// all-reduces the input gradient in the backward pass.
void add_tp_input_grad_allreduces(std::vector<Op>& bwd, const ModelSpec& m, const LayerShape& s,
                                  const Dims& d) {
  if (s.tensor_parallel == 1 || s.sequence_parallel) return;
  std::vector<Op> out;
  Builder b{&out, OpRole::kInputGrad, s.activation_dtype};
  for (const Op& op : bwd) {
    out.push_back(op);
    if (op.id == OpId::kFc1Dgrad)
      b.collective(OpId::kFc1InputGradAllReduce, Collective::kAllReduce, d.T * d.h * d.act);
    if (op.id == OpId::kQkvDgrad)
      b.collective(OpId::kQkvInputGradAllReduce, Collective::kAllReduce, d.T * d.h * d.act);
    // MLA: the up projections' input gradients, each rank's partial sum over its heads (the
    // latents and the shared rotated key; without a query latent the hidden state's), in one
    // all-reduce after the last of them.
    if (op.id == OpId::kQUpProjDgrad) {
      const double width = static_cast<double>(m.kv_latent_width()) +
                           (m.q_lora_rank > 0 ? static_cast<double>(m.q_lora_rank) : d.h);
      b.collective(OpId::kLatentInputGradAllReduce, Collective::kAllReduce, d.T * width * d.act);
    }
  }
  bwd.swap(out);
}

// With sequence parallelism Megatron's column-parallel linear (QKV, FC1) saves its input's
// sequence-parallel rows only and all-gathers them again in the backward pass for the weight
// gradient, started before the input-gradient GEMM and waited for after it: a collective of the
// weight gradient's (a zero-bubble schedule defers it with the GEMM that reads it).
// MLA's up projections (Megatron-Core's column-parallel linear_q_up_proj and linear_kv_up_proj)
// the same: the query latent (the hidden state without one) and the key-value latent, gathered
// again before the first of their input-gradient GEMMs.
void add_sp_input_regathers(std::vector<Op>& bwd, const ModelSpec& m, const LayerShape& s,
                            const Dims& d) {
  if (s.tensor_parallel == 1 || !s.sequence_parallel) return;
  std::vector<Op> out;
  Builder b{&out, OpRole::kWeightGrad, s.activation_dtype};
  const double up_inputs = static_cast<double>(m.q_lora_rank > 0 ? m.q_lora_rank : m.hidden_size) +
                           static_cast<double>(m.kv_lora_rank);
  for (const Op& op : bwd) {
    if (op.id == OpId::kFc1Dgrad)
      b.collective(OpId::kMlpInputRegather, Collective::kAllGather, d.T * d.h * d.act);
    if (op.id == OpId::kQkvDgrad)
      b.collective(OpId::kAttnInputRegather, Collective::kAllGather, d.T * d.h * d.act);
    if (op.id == OpId::kKvUpProjDgrad)
      b.collective(OpId::kAttnInputRegather, Collective::kAllGather, d.T * up_inputs * d.act);
    out.push_back(op);
  }
  bwd.swap(out);
}

// Without fused accumulation a weight gradient is written fresh in 16 bits, then a second
// pass reads it and the main gradient (main_grad_bytes per element) and writes the main one.
double accumulate_bytes(double params, const LayerShape& s, const Dims& d) {
  return params * (2.0 * d.act + 2.0 * s.main_grad_bytes);
}

}  // namespace

std::string_view op_name(OpId id) {
  return kOpNames[static_cast<size_t>(id)];
}

std::string to_string(OpRole r) {
  switch (r) {
    case OpRole::kForward:
      return "forward";
    case OpRole::kInputGrad:
      return "input-grad";
    case OpRole::kWeightGrad:
      return "weight-grad";
    case OpRole::kRecompute:
      return "recompute";
  }
  return "?";
}

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
    case Collective::kAllToAll:
      return "all-to-all";
  }
  return "?";
}

LayerShape layer_shape(const ParallelPlan& p) {
  LayerShape s;
  s.tensor_parallel = p.tensor_parallel;
  s.micro_batch = p.micro_batch_size;
  s.sequence_parallel = p.sequence_parallel;
  s.recompute = p.recompute;
  s.recompute_modules = p.recompute_modules;
  s.fused_grad_accumulation = p.gradient_accumulation_fusion;
  s.main_grad_bytes = p.fp32_grad_reduce ? 4.0 : 2.0;
  // SC'21's runs reduced 16-bit gradients in fp16 mixed precision; later runs use bf16.
  s.activation_dtype = p.fp32_grad_reduce ? DType::kBF16 : DType::kF16;
  s.context_parallel = p.context_parallel;
  s.cp_comm = p.cp_comm;
  s.hierarchical_cp = p.hierarchical_cp;
  s.expert_parallel = p.expert_parallel;
  s.expert_tensor_parallel = p.expert_tp();
  s.fp8 = p.fp8;
  return s;
}

namespace {

// What selective recomputation reruns of a layer's forward list, in its order
// (Megatron-Core's --recompute-modules):
// - core_attn: the attention core, its context-parallel exchanges included;
// - layernorm (an MoE layer's with layernorm, a dense layer's with mlp: layer_recompute_modules):
//   the pre-MLP layernorm, whose output is not kept (the layernorm before the attention is fused
//   into the QKV projection and keeps its output there);
// - mlp (a dense layer's MLP, an MoE layer's shared experts): the MLP from its input (the
//   layernorm's output, rerun first in a dense layer), from its all-gather (or FC1) to its
//   all-reduce (or reduce-scatter), FC2 included, as Megatron-Core's checkpointed MLP reruns its
//   forward;
// - moe_act: the routed experts' activation function, from FC1's output;
// - moe: the whole MoE layer (with its shared experts under mlp), from its input: router,
//   top-k, permutation, dispatch, experts, combine and unpermutation;
// - mla_up_proj: multi-head latent attention's up projections and rotary embedding (with
//   sequence parallelism the latents' all-gather before them), from the kept latents.
// `modules`: the layer's (layer_recompute_modules).
std::vector<Op> selective_recompute(const std::vector<Op>& forward, unsigned modules) {
  using I = OpId;
  const bool core = modules & kRecomputeCoreAttn, norms = modules & kRecomputeLayernorm,
             mlp = modules & kRecomputeMlp, moe_act = modules & kRecomputeMoeAct,
             moe = modules & kRecomputeMoe;
  // (MLA's up projections: only a latent attention's list has them.)
  const bool mla_up = (modules & kRecomputeMlaUpProj) != 0 &&
                      std::any_of(forward.begin(), forward.end(),
                                  [](const Op& op) { return op.id == OpId::kKvUpProj; });
  std::vector<Op> out;
  for (const Op& op : forward) {
    bool rerun = false;
    switch (op.id) {
      case I::kCpKvExchange:
      case I::kAttnScores:
      case I::kAttnSoftmax:
      case I::kAttnDropout:
      case I::kAttnContext:
      case I::kCpOutAllToAll:
        rerun = core;
        break;
      case I::kAttnAllGather:  // MLA: the latents gathered for the up projections
      case I::kQUpProj:
      case I::kKvUpProj:
      case I::kRotaryEmbedding:
        rerun = mla_up;
        break;
      case I::kPostAttentionLayernorm:
        rerun = norms;
        break;
      case I::kMlpAllGather:  // the input of FC1 (an MoE layer's shared experts') gathered:
        rerun = mlp;          // with layernorm alone FC1's weight gradient gathers it again
        break;
      case I::kFc1:
      case I::kBiasGelu:
      case I::kSwiglu:
      case I::kFc2:
      case I::kMlpAllReduce:
      case I::kMlpReduceScatter:
        rerun = mlp;
        break;
      case I::kExpertActivation:
        rerun = moe_act || moe;
        break;
      default:  // the rest of the routed path, kRouter to kMoeUnpermute, with moe
        rerun = moe && op.id >= I::kRouter && op.id <= I::kMoeUnpermute;
        break;
    }
    if (rerun) out.push_back(op);
  }
  return out;
}

// An MoE layer's backward list, the reverse of its forward list, has the routed experts' backward
// before the shared experts' (their forward comes first). Megatron-Core's MoE layer runs the
// shared experts after the routed ones (without --moe-shared-expert-overlap), so autograd reduces
// their gradient first, and so does ptdp run (the routed input gradient is added to theirs):
// the shared experts' block moves ahead of the routed block. A no-op without shared experts.
void shared_experts_backward_first(std::vector<Op>& backward) {
  // (The MoE backward ids, kMoeUnpermuteBackward to kRouterWgrad, are the routed path's.)
  auto routed = [](OpId id) {
    return id >= OpId::kMoeUnpermuteBackward && id <= OpId::kRouterWgrad;
  };
  const auto first =
      std::find_if(backward.begin(), backward.end(), [&](const Op& op) { return routed(op.id); });
  const auto shared =
      std::find_if(first, backward.end(), [&](const Op& op) { return !routed(op.id); });
  const auto norm = std::find_if(shared, backward.end(), [](const Op& op) {
    return op.id == OpId::kPostAttentionLayernormBackward;
  });
  std::rotate(first, shared, norm);
}

}  // namespace

PassOps transformer_layer_ops(const ModelSpec& m, const LayerShape& s) {
  PassOps p;
  const Dims d = dims(m, s);
  p.forward = layer_forward(m, s);
  p.backward = backward_of(p.forward, s.activation_dtype);
  if (fused_attention(m, s)) add_fused_attention_recompute(p.backward, p.forward);
  add_tp_input_grad_allreduces(p.backward, m, s, d);
  add_sp_input_regathers(p.backward, m, s, d);
  if (!s.fused_grad_accumulation) {
    Builder b{&p.backward, OpRole::kWeightGrad, s.activation_dtype};
    b.memory(OpId::kWeightGradAccumulate,
             accumulate_bytes(m.layer_parameters_per_rank(s.tensor_parallel), s, d),
             OpRole::kWeightGrad);
  }
  if (s.recompute == Recompute::kFull) {
    p.recompute = p.forward;
  } else if (s.recompute == Recompute::kSelective) {
    p.recompute =
        selective_recompute(p.forward, layer_recompute_modules(s.recompute_modules, false));
  }
  for (Op& op : p.recompute) op.role = OpRole::kRecompute;
  return p;
}

PassOps moe_layer_ops(const ModelSpec& m, const LayerShape& s) {
  PassOps p;
  const Dims d = dims(m, s);
  p.forward = moe_forward(m, s);
  p.backward = backward_of(p.forward, s.activation_dtype);
  shared_experts_backward_first(p.backward);
  if (fused_attention(m, s)) add_fused_attention_recompute(p.backward, p.forward);
  add_sp_input_regathers(p.backward, m, s, d);
  if (!s.fused_grad_accumulation) {
    const double dense = m.layer_parameters_per_rank(s.tensor_parallel, true);
    const double experts =
        m.expert_parameters_per_rank(s.expert_parallel, s.expert_tensor_parallel);
    Builder b{&p.backward, OpRole::kWeightGrad, s.activation_dtype};
    b.memory(OpId::kWeightGradAccumulate, accumulate_bytes(dense + experts, s, d),
             OpRole::kWeightGrad);
  }
  if (s.recompute == Recompute::kFull) {
    p.recompute = p.forward;
  } else if (s.recompute == Recompute::kSelective) {
    // (the mlp module is the dense MLP's; shared_experts reruns this layer's shared experts)
    p.recompute =
        selective_recompute(p.forward, layer_recompute_modules(s.recompute_modules, true));
  }
  for (Op& op : p.recompute) op.role = OpRole::kRecompute;
  return p;
}

PassOps embedding_ops(const ModelSpec& m, const LayerShape& s) {
  PassOps p;
  const Dims d = dims(m, s);
  const double rows = s.sequence_parallel ? d.T / d.t : d.T;
  Builder f{&p.forward, OpRole::kForward, s.activation_dtype};
  // Vocabulary-parallel lookup: each rank fills the rows of its vocabulary shard, zeros elsewhere.
  f.memory(OpId::kWordEmbeddingLookup, d.T * d.h * d.act * 2);
  if (s.tensor_parallel > 1)
    exit_tp(f, s, d, OpId::kEmbeddingAllReduce, OpId::kEmbeddingReduceScatter);
  f.memory(OpId::kEmbeddingPositionDropout, rows * d.h * (d.act * 3 + 1.0));
  Builder bw{&p.backward, OpRole::kInputGrad, s.activation_dtype};
  bw.memory(OpId::kEmbeddingDropoutBackward, rows * d.h * (d.act * 3 + 1.0));
  if (s.sequence_parallel)
    bw.collective(OpId::kEmbeddingGradAllGather, Collective::kAllGather, d.T * d.h * d.act);
  // The word embedding's gradient: rows of the table gathered by token (fp32 main gradient).
  bw.memory(OpId::kWordEmbeddingGradScatterAdd, d.T * d.h * (d.act + 4.0 * 2), OpRole::kWeightGrad);
  if (!s.fused_grad_accumulation) {
    bw.memory(OpId::kEmbeddingGradAccumulate,
              accumulate_bytes(m.embedding_parameters() / d.t, s, d), OpRole::kWeightGrad);
  }
  return p;
}

PassOps mtp_projection_ops(const ModelSpec& m, const LayerShape& s) {
  PassOps p;
  const Dims d = dims(m, s);
  const double rows = s.sequence_parallel ? d.T / d.t : d.T;
  Builder f{&p.forward, OpRole::kForward, s.activation_dtype};
  // enorm and hnorm (each reads and writes rows x h) into the 2h-wide concatenation.
  f.memory(OpId::kMtpNorms, rows * d.h * d.act * 4);
  if (s.sequence_parallel)
    f.collective(OpId::kMtpProjAllGather, Collective::kAllGather, d.T * 2 * d.h * d.act);
  const int64_t out = std::max<int64_t>(1, d.hi / s.tensor_parallel);
  f.gemm(OpId::kMtpEhProj, d.Ti, out, 2 * d.hi);
  // The column-parallel outputs gathered to the whole hidden state (gather_output), then, with
  // SP, each rank keeps its tokens' rows.
  if (s.tensor_parallel > 1)
    f.collective(OpId::kMtpProjOutputAllGather, Collective::kAllGather, d.T * d.h * d.act);
  Builder bw{&p.backward, OpRole::kInputGrad, s.activation_dtype};
  if (s.sequence_parallel)
    bw.collective(OpId::kMtpProjOutputScatterBackward, Collective::kAllGather, d.T * d.h * d.act);
  for (const Op& op : p.forward)
    if (op.kind == OpKind::kGemm) add_gemm_backward(bw, op);
  if (s.tensor_parallel > 1)
    bw.collective(OpId::kMtpProjInputGradReduce,
                  s.sequence_parallel ? Collective::kReduceScatter : Collective::kAllReduce,
                  d.T * 2 * d.h * d.act);
  bw.memory(OpId::kMtpNormsBackward, rows * d.h * d.act * 6);
  return p;
}

PassOps lm_head_ops(const ModelSpec& m, const LayerShape& s) {
  PassOps p;
  const Dims d = dims(m, s);
  const double rows = s.sequence_parallel ? d.T / d.t : d.T;
  const int64_t vocab_local = (m.vocab_size + s.tensor_parallel - 1) / s.tensor_parallel;
  const double logits = d.T * static_cast<double>(vocab_local);
  Builder f{&p.forward, OpRole::kForward, s.activation_dtype};
  f.memory(OpId::kFinalLayernorm, rows * d.h * d.act * 2);
  if (s.tensor_parallel > 1) enter_tp(f, s, d, OpId::kLmHeadAllGather);
  f.gemm(OpId::kLmHead, d.Ti, vocab_local, d.hi);
  // Vocabulary-parallel cross entropy: each rank's (max, sum-exp, target logit) per token in
  // fp32, all-gathered over the tensor-parallel ranks (an output of t times the stats).
  f.memory(OpId::kCrossEntropy, logits * (d.act + 4.0 * 2));
  if (s.tensor_parallel > 1) {
    f.collective(OpId::kCrossEntropyAllGather, Collective::kAllGather,
                 d.t * d.T * 4.0 * static_cast<double>(kCrossEntropyStatsPerToken));
    f.out->back().dtype = DType::kF32;
  }
  Builder bw{&p.backward, OpRole::kInputGrad, s.activation_dtype};
  bw.memory(OpId::kCrossEntropyBackward, logits * (4.0 + d.act));
  for (const Op& op : p.forward) {
    if (op.kind == OpKind::kGemm) add_gemm_backward(bw, op);
  }
  if (s.tensor_parallel > 1) {
    if (s.sequence_parallel) {
      bw.collective(OpId::kLmHeadGradReduceScatter, Collective::kReduceScatter, d.T * d.h * d.act);
    } else {
      bw.collective(OpId::kLmHeadInputGradAllReduce, Collective::kAllReduce, d.T * d.h * d.act);
    }
  }
  bw.memory(OpId::kFinalLayernormBackward, rows * d.h * d.act * 3);
  if (!s.fused_grad_accumulation) {
    bw.memory(OpId::kOutputGradAccumulate,
              accumulate_bytes(static_cast<double>(m.vocab_size) * d.h / d.t, s, d),
              OpRole::kWeightGrad);
  }
  return p;
}

namespace {

// Korthikanti et al.'s counts in units of 16-bit elements (2 bytes), split by how they shard:
// `replicated` over the tensor-parallel ranks unless sequence parallel, `sharded` by t, and
// `per_rank` already this rank's (the routed tokens of an MoE layer). `mlp_width` is the FFN
// width sharded by t (the dense MLP, or the shared experts of an MoE layer; 0: none).
struct ActivationUnits {
  double replicated = 0, sharded = 0, per_rank = 0;
};

// What selective recomputation recomputes of a layer of the kind (nothing without it), as
// layer_recompute_modules maps the set: an MoE layer's mlp bit is its shared experts'.
bool recomputes(const LayerShape& s, RecomputeModule module, bool moe_layer) {
  return s.recompute == Recompute::kSelective &&
         (layer_recompute_modules(s.recompute_modules, moe_layer) & module) != 0;
}

// `moe_layer`: mlp_width is an MoE layer's shared experts', which --recompute-modules
// shared_experts recomputes, else a dense MLP's, which mlp recomputes (their activation-function
// inputs and FC2 input are not kept; their input, the FC1 input, is).
// Bytes per element, in 2-byte units, of what a linear layer saves of its input for the backward
// pass: FP8 with --fp8-format (Transformer Engine's Linear, LayerNormLinear, GroupedLinear).
double saved_gemm_input_units(const LayerShape& s) {
  return s.fp8 ? 1.0 : 2.0;
}

ActivationUnits attention_and_mlp_units(const ModelSpec& m, const LayerShape& s, const Dims& d,
                                        double mlp_width, bool moe_layer) {
  ActivationUnits u;
  const double sbh = d.T * d.h;
  const double sbq = d.T * d.heads * d.kv;   // queries
  const double sbk = d.T * d.groups * d.kv;  // keys
  const double sbv = d.T * d.groups * d.vd;  // values
  const double sbo = d.T * d.heads * d.vd;   // the attention's output
  const double gate = m.swiglu ? 2.0 : 1.0;
  // Replicated across TP ranks unless sequence parallel: both layernorm inputs (4 sbh), the
  // QKV input (2 sbh), the FC1 (or router) input (2 sbh; not kept where the pre-MLP layernorm is
  // rerun: layer_recompute_modules) and, with hidden dropout, its two masks.
  // With FP8 the linear layers save their inputs as FP8 (Transformer Engine's Linear and
  // LayerNormLinear): 1 sbh each for the QKV and FC1 inputs and s b ffn for FC2's; the
  // projection saves an FP8 copy of its input (1 sbh) beside the 16-bit attention output that a
  // fused attention keeps for its own backward pass (2 sbh; the unfused attention keeps only
  // the FP8 copy). The layernorms' inputs, Q, K, V and the activation function's input stay in
  // 16 bits.
  const double gemm_input = saved_gemm_input_units(s);
  const double proj_input = !s.fp8 ? 2.0 : fused_attention(m, s) ? 3.0 : 1.0;
  u.replicated = (m.hidden_dropout > 0 ? 6.0 : 4.0) * sbh + gemm_input * sbh;
  // (An MoE layer's router reads the pre-MLP layernorm's output in 16 bits.)
  if (!recomputes(s, kRecomputeLayernorm, moe_layer))
    u.replicated += (moe_layer ? 2.0 : gemm_input) * sbh;
  // Sharded by t: Q, K, V (2 sbh, K and V scaled by groups/heads; heads x kv_channels wide
  // where --kv-channels sets another width), the projection input (2 sbh), the
  // activation-function input(s) and the FC2 input (2 s b ffn each).
  // (mla_up_proj reruns Q, K and V from the latents: none of them kept, unless a heads
  // all-to-all moved them into tensors of the attention's own, which it keeps while its core is
  // not recomputed: Transformer Engine's Ulysses, where the rerun has no reader.)
  const bool qkv_rerun =
      recomputes(s, kRecomputeMlaUpProj, moe_layer) &&
      (heads_all_to_all_ranks(s) == 1 || recomputes(s, kRecomputeCoreAttn, moe_layer));
  u.sharded = (qkv_rerun ? 0.0 : 2.0 * (sbq + sbk + sbv)) + proj_input * sbo;
  // MLA (the rank's tokens, as the input norm's): the up projections keep their inputs, the
  // latents (gathered again for the backward pass with sequence parallelism, as Megatron's
  // column-parallel layers do), and with --qk-layernorm the latents' norms their inputs and an
  // fp32 reciprocal RMS per token each; mla_up_proj's rerun keeps the rotated key too. The down
  // projections keep the input norm's output, as QKV does.
  if (m.multi_latent_attention) {
    const double latents = static_cast<double>(m.q_lora_rank + m.kv_lora_rank);
    u.replicated += (m.qk_layernorm ? 4.0 : 2.0) * d.T * latents;
    if (m.qk_layernorm) u.replicated += 4.0 / (d.act / 2.0) * d.T * (m.q_lora_rank > 0 ? 2 : 1);
    if (recomputes(s, kRecomputeMlaUpProj, moe_layer))
      u.replicated += 2.0 * d.T * static_cast<double>(m.qk_pos_emb_head_dim);
  }
  // --qk-layernorm's norms keep their inputs (the unnormalised queries and keys, 16-bit) and
  // per head and token an fp32 reciprocal RMS (and mean, for LayerNorm models).
  if (m.qk_layernorm && !m.multi_latent_attention)
    u.sharded += 2.0 * (sbq + sbk) +
                 (m.swiglu ? 1.0 : 2.0) * 4.0 / (d.act / 2.0) * d.T * (d.heads + d.groups);
  if (!recomputes(s, kRecomputeMlp, moe_layer))
    u.sharded += (2.0 * gate + gemm_input) * d.T * mlp_width;
  // Ulysses (a2a, and a2a+p2p's all-to-all) keeps the attention's output in the heads layout for
  // its backward pass and the projection keeps its input back on the rank's tokens: 2 sbh more.
  // (Selective recomputation keeps neither: the attention's inputs, the tokens' Q, K and V, are
  // what it saves.)
  if (heads_all_to_all_ranks(s) > 1 && s.recompute != Recompute::kFull &&
      !recomputes(s, kRecomputeCoreAttn, moe_layer))
    u.sharded += 2.0 * sbo;
  // Per score: the softmax output (2) and, with attention dropout, its mask (1) and output (2):
  // 5 a s^2 b. Flash attention keeps instead one fp32 log-sum-exp per row and head (4 a s b
  // bytes, whatever the activations' type; units of d.act / 2 bytes). With context parallelism
  // the rank's s/cp queries each score all s keys.
  const double per_score = m.attention_dropout > 0 ? 5.0 : 2.0;
  u.sharded += recomputes(s, kRecomputeCoreAttn, moe_layer) ? 0.0
               : fused_attention(m, s)                      ? 4.0 / (d.act / 2.0) * d.heads * d.T
                                                            : per_score * d.heads * d.s * d.T;
  return u;
}

double activation_bytes(const LayerShape& s, const Dims& d, const ActivationUnits& u) {
  const double unit = d.act / 2.0;
  if (s.recompute == Recompute::kFull)
    return unit * 2.0 * d.T * d.h / (s.sequence_parallel ? d.t : 1.0);
  if (s.sequence_parallel) return unit * ((u.replicated + u.sharded) / d.t + u.per_rank);
  return unit * (u.replicated + u.sharded / d.t + u.per_rank);
}

}  // namespace

double layer_backward_working_bytes(const ModelSpec& m, const LayerShape& s, bool moe_layer) {
  const Dims d = dims(m, s);
  // Elements, per rank: T tokens inside the tensor-parallel blocks, R outside them (T / t with
  // sequence parallelism); Q and the attention's output q wide, K and V kv each.
  const double T = d.T, R = s.sequence_parallel ? d.T / d.t : d.T, h = d.h;
  const double q = d.heads * d.kv / d.t, kv = d.groups * (d.kv + d.vd) / 2.0 / d.t;
  const double o = d.heads * d.vd / d.t;  // the attention's output
  const double gate = m.swiglu ? 2.0 : 1.0;
  const double norm_backward = T * h + (s.sequence_parallel ? 2.0 : 1.0) * R * h;
  // With sequence parallelism QKV's and FC1's inputs gathered again for their weight gradients
  // (add_sp_input_regathers), beside the input gradients.
  const double regathered = s.sequence_parallel && d.t > 1 ? T * h : 0.0;
  // A tensor-parallel MLP of local width f, from its output gradient (R h, the residual's
  // copy) on: FC2's input gradient beside its (gathered) output gradient, the activation
  // function's input gradient beside its output's, FC1's input gradient beside that (and the
  // regathered input), the pre-MLP norm's backward.
  auto mlp = [&](double f) {
    if (f <= 0) return 0.0;
    return R * h + std::max({T * h + T * f, T * f * (1.0 + gate), T * gate * f + T * h + regathered,
                             norm_backward - R * h});
  };
  double mlp_phase =
      mlp(static_cast<double>(moe_layer ? m.moe_shared_expert_ffn_size : m.ffn_hidden()) / d.t);
  if (moe_layer) {
    // The routed experts' rows (the busiest rank's): the combine's gradient arriving beside
    // its permuted copy, then as the dense MLP with P rows of width ffn / etp.
    const Routing r = routing(m, s, d);
    const double P = r.processed, f = static_cast<double>(r.ffn_local);
    mlp_phase = std::max(mlp_phase, R * h + std::max({2.0 * P * h, P * h + P * f * (1.0 + gate),
                                                      2.0 * P * h + P * gate * f}));
  }
  // The attention: the projection's input gradient beside its output gradient; the fused
  // backward's dQ, dK, dV beside it (unfused: the scores' gradient, b a s_q s / t, with dV,
  // then dQ and dK); --qk-layernorm's input gradient beside them; QKV's packed gradient while
  // its parts are copied in; QKV's input gradient; the input norm's backward.
  const double qkv = q + 2.0 * kv;
  const double scores = fused_attention(m, s) ? 0.0 : d.heads * d.s * d.T / d.t;
  // MLA: the up projections' packed output gradient beside their input gradients (the gathered
  // latents), then the latents' gradients on the rank's tokens beside the norms' backward.
  const double latents =
      static_cast<double>(m.kv_latent_width() + (m.q_lora_rank > 0 ? m.q_lora_rank : 0));
  // (With sequence parallelism the up projections' inputs gathered again beside them.)
  const double mla_regathered =
      s.sequence_parallel && d.t > 1
          ? T * static_cast<double>((m.q_lora_rank > 0 ? m.q_lora_rank : m.hidden_size) +
                                    m.kv_lora_rank)
          : 0.0;
  const double mla =
      m.multi_latent_attention
          ? std::max(T * qkv + T * (latents + (m.q_lora_rank > 0 ? 0.0 : h)) + mla_regathered,
                     2.0 * R * latents + R * h)
          : 0.0;
  const double attention_phase =
      R * h +
      std::max({T * h + T * o, T * o + (scores > 0 ? scores + T * kv : T * qkv), scores + T * qkv,
                m.qk_layernorm && !m.multi_latent_attention ? T * (qkv + q) : 0.0, 2.0 * T * qkv,
                T * qkv + T * h + (m.multi_latent_attention ? 0.0 : regathered), norm_backward,
                mla});
  // The gradient arriving from the next layer and the one leaving for the previous.
  return d.act * (2.0 * R * h + std::max(mlp_phase, attention_phase));
}

double layer_activation_bytes(const ModelSpec& m, const LayerShape& s) {
  const Dims d = dims(m, s);
  return activation_bytes(s, d, attention_and_mlp_units(m, s, d, d.ffn, false));
}

double moe_layer_activation_bytes(const ModelSpec& m, const LayerShape& s) {
  const Dims d = dims(m, s);
  ActivationUnits u =
      attention_and_mlp_units(m, s, d, static_cast<double>(m.moe_shared_expert_ffn_size), true);
  // The rank's experts keep, per token they process, its permuted input (2 h), the activation
  // input(s) and the FC2 input; unpermuting keeps the k outputs of each of the rank's tokens
  // (2 h each) and their fp32 probabilities.
  const Routing r = routing(m, s, d);
  const double gate = m.swiglu ? 2.0 : 1.0;
  const double ffn = static_cast<double>(r.ffn_local);
  // (--recompute-modules moe_act keeps no FC2 input: the activation is rerun from FC1's output;
  // moe keeps nothing of the routed path: the layer is rerun from its input.)
  const double gemm_input = saved_gemm_input_units(s);
  const double fc2_input = recomputes(s, kRecomputeMoeAct, true) ? 0.0 : gemm_input;
  u.per_rank = recomputes(s, kRecomputeMoe, true)
                   ? 0.0
                   : r.processed * (gemm_input * d.h + (2.0 * gate + fc2_input) * ffn) +
                         r.sent * (2.0 * d.h + 2.0);
  return activation_bytes(s, d, u);
}

}  // namespace ptdp
