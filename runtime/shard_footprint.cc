// Parameter counts of one rank's shard, following GptShard's constructor
// (runtime/gpt_model.cc): per chunk the word and position embeddings on the first stage, the
// transformer layers, the final norm and the LM head (or the tied copy) on the last stage.
#include "runtime/shard_footprint.h"

#include <algorithm>

namespace ptdp {

std::vector<int64_t> shard_segment_sizes(const ModelSpec& m, const ShardLayout& l) {
  const int64_t t = l.t, h = m.hidden_size, d = m.kv_channels();
  const int64_t hl = m.num_attention_heads / t, gl = m.query_groups() / t;
  const int64_t ffl = m.ffn_hidden() / t, vl = (m.vocab_size + t - 1) / t;
  const int64_t biases = m.swiglu ? 0 : 1;  // Llama-style models have no biases
  const int64_t qkv = (hl + 2 * gl) * d, fc1 = m.swiglu ? 2 * ffl : ffl;
  const int64_t per_layer = h + biases * h             // input layernorm
                            + qkv * h + biases * qkv   // QKV
                            + h * hl * d + biases * h  // attention projection
                            + h + biases * h           // post-attention layernorm
                            + fc1 * h + biases * ffl   // FC1
                            + h * ffl + biases * h;    // FC2
  const int64_t stages = l.p * l.v;
  std::vector<int64_t> per_stage = l.layers_per_stage;
  if (per_stage.empty()) per_stage.assign(static_cast<size_t>(stages), m.num_layers / stages);
  int64_t word = 0, rest = 0;
  bool holds_word = false;
  for (int64_t c = 0; c < l.v; ++c) {
    const int64_t g = c * l.p + l.pp;
    if (g == 0) {
      word += vl * h;  // word embedding (vocabulary-parallel, padded)
      if (m.learned_position_embeddings) rest += m.seq_length * h;  // position table (replicated)
      holds_word = true;
    }
    rest += per_stage[static_cast<size_t>(g)] * per_layer;
    if (g == stages - 1) {
      rest += h + biases * h;  // final layernorm
      if (m.untie_embeddings_and_output_weights)
        rest += vl * h;  // LM head
      else if (!holds_word)
        word += vl * h;  // the tied copy of the word embedding
    }
  }
  const int64_t mult = std::max<int64_t>(1, l.segment_multiple);
  auto padded = [mult](int64_t n) { return (n + mult - 1) / mult * mult; };
  return {padded(word), padded(rest)};
}

}  // namespace ptdp
