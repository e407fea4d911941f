// Parameter counts of one rank's shard, following GptShard's constructor
// (runtime/gpt_model.cc): per chunk the word and position embeddings on the first stage, the
// transformer layers, the final norm and the LM head (or the tied copy) on the last stage, and
// there the multi-token prediction modules (with an untied model's copy of the word table); for
// MoE models a third segment, the routed experts.
#include "runtime/shard_footprint.h"

#include <algorithm>

namespace ptdp {

std::vector<int64_t> shard_segment_sizes(const ModelSpec& m, const ShardLayout& l) {
  const int64_t t = l.t, h = m.hidden_size, d = m.head_dim();
  const int64_t hl = m.num_attention_heads / t, gl = m.query_groups() / t;
  const int64_t ffl = m.ffn_hidden() / t, vl = (m.vocab_size + t - 1) / t;
  const int64_t biases = m.swiglu ? 0 : 1;  // Llama-style models have no biases
  const int64_t qkv = (hl + 2 * gl) * d;
  // MLA (no biases): the down projections and the latents' norms whole, the up projections
  // column-parallel, in place of QKV.
  const int64_t ql = m.q_latent_width(), kvl = m.kv_lora_rank, kvw = m.kv_latent_width();
  const int64_t norms = m.qk_layernorm ? ql + kvl : 0;  // MLA's latents' norms
  const int64_t mla = ql * h + norms + hl * d * (ql > 0 ? ql : h) + kvw * h +
                      hl * (m.qk_head_dim + m.v_head_dim) * kvl;
  const int64_t dv = m.value_dim();
  const int64_t attention =
      h + biases * h  // input layernorm
      + (m.multi_latent_attention ? mla : qkv * h + (m.has_qkv_bias() ? qkv : 0))  // QKV
      + h * hl * dv + biases * h  // attention projection
      + h + biases * h            // post-attention norm
      + (m.qk_layernorm && !m.multi_latent_attention ? 2 * (d + biases * d) : 0);  // q/k norms
  auto mlp = [&](int64_t width) {  // FC1 and FC2 of local width `width`
    return (m.swiglu ? 2 * width : width) * h + biases * width + h * width + biases * h;
  };
  const int64_t per_layer = attention + mlp(ffl);
  // An MoE layer: the router, the shared experts (width / t) and, in segment 2, this rank's
  // E / ep routed experts of width moe_ffn / etp.
  const int64_t shared = m.moe_shared_expert_ffn_size / t;
  const int64_t per_moe_layer = attention + m.num_experts * h + (shared > 0 ? mlp(shared) : 0);
  const int64_t per_moe_experts =
      m.is_moe() ? m.num_experts / l.ep * mlp(m.moe_ffn_hidden() / l.etp) : 0;
  const int64_t stages = l.p * l.v;
  std::vector<int64_t> per_stage = l.layers_per_stage;
  if (per_stage.empty()) per_stage.assign(static_cast<size_t>(stages), m.num_layers / stages);
  int64_t word = 0, rest = 0, experts = 0;
  bool holds_word = false;
  for (int64_t c = 0; c < l.v; ++c) {
    const int64_t g = c * l.p + l.pp;
    if (g == 0) {
      word += vl * h;  // word embedding (vocabulary-parallel, padded)
      if (m.learned_position_embeddings)
        rest += m.max_positions() * h;  // position table (replicated)
      holds_word = true;
    }
    int64_t first = 0;
    for (int64_t i = 0; i < g; ++i) first += per_stage[static_cast<size_t>(i)];
    const int64_t layers = per_stage[static_cast<size_t>(g)];
    const int64_t moe = m.moe_layers_in(first, layers);
    rest += (layers - moe) * per_layer + moe * per_moe_layer;
    experts += moe * per_moe_experts;
    if (g == stages - 1) {
      rest += h + biases * h;  // final layernorm
      if (m.untie_embeddings_and_output_weights)
        rest += vl * h;  // LM head
      else if (!holds_word)
        word += vl * h;  // the tied copy of the word embedding
      // Multi-token prediction modules: three norms, eh_proj's h / t rows of 2h, a layer of the
      // last layer's kind; untied, a copy of the word embedding for their inputs.
      if (m.mtp_num_layers > 0) {
        const bool moe_mtp = m.mtp_layer_is_moe();
        rest += m.mtp_num_layers *
                (3 * (h + biases * h) + h / l.t * 2 * h + (moe_mtp ? per_moe_layer : per_layer));
        if (moe_mtp) experts += m.mtp_num_layers * per_moe_experts;
        if (m.untie_embeddings_and_output_weights && !holds_word) word += vl * h;
      }
    }
  }
  auto padded = [](int64_t n, int64_t multiple) {
    const int64_t mult = std::max<int64_t>(1, multiple);
    return (n + mult - 1) / mult * mult;
  };
  std::vector<int64_t> sizes = {padded(word, l.segment_multiple), padded(rest, l.segment_multiple)};
  if (m.is_moe()) sizes.push_back(padded(experts, l.expert_segment_multiple));
  return sizes;
}

}  // namespace ptdp
