// Parameter counts of one rank's shard, following GptShard's constructor
// (runtime/gpt_model.cc): per chunk the word and position embeddings on the first stage, the
// transformer layers, the final norm and the LM head (or the tied copy) on the last stage, and
// there the multi-token prediction modules (with an untied model's copy of the word table); for
// MoE models a third segment, the routed experts.
#include "runtime/shard_footprint.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

namespace ptdp {

namespace {

// Elements of one rank's parameters by kind (shard_segment_sizes' terms).
struct ShardTerms {
  int64_t vl = 0, h = 0, biases = 0;
  int64_t per_layer = 0, per_moe_layer = 0, per_moe_experts = 0;
};

ShardTerms shard_terms(const ModelSpec& m, const ShardLayout& l) {
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
  return {vl, h, biases, per_layer, per_moe_layer, per_moe_experts};
}

int64_t padded(int64_t n, int64_t multiple) {
  const int64_t mult = std::max<int64_t>(1, multiple);
  return (n + mult - 1) / mult * mult;
}

}  // namespace

std::vector<int64_t> shard_segment_sizes(const ModelSpec& m, const ShardLayout& l) {
  const auto [vl, h, biases, per_layer, per_moe_layer, per_moe_experts] = shard_terms(m, l);
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
  std::vector<int64_t> sizes = {padded(word, l.segment_multiple), padded(rest, l.segment_multiple)};
  if (m.is_moe()) sizes.push_back(padded(experts, l.expert_segment_multiple));
  return sizes;
}

FsdpHeld fsdp_held(const ModelSpec& m, const ShardLayout& l) {
  const ShardTerms T = shard_terms(m, l);
  const std::vector<int64_t> sizes = shard_segment_sizes(m, l);
  // The flat arrays as GptShard lays them out at p = v = 1: segment 0 the word table; segment 1
  // the position table (the embedding part), each layer, the final norm (and the untied output
  // layer); segment 2 each MoE layer's routed experts. Ranges [lo, hi) per part.
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  const int64_t word = T.vl * T.h;
  int64_t at1 = sizes[0], at2 = sizes[0] + sizes[1];
  Ranges embedding = {{0, word}};
  if (m.learned_position_embeddings) {
    embedding.emplace_back(at1, at1 + m.max_positions() * T.h);
    at1 = embedding.back().second;
  }
  std::vector<Ranges> layers;
  for (int64_t i = 0; i < m.num_layers; ++i) {
    const bool moe = m.is_moe_layer(i);
    Ranges r = {{at1, at1 + (moe ? T.per_moe_layer : T.per_layer)}};
    at1 = r.back().second;
    if (moe) {
      r.emplace_back(at2, at2 + T.per_moe_experts);
      at2 = r.back().second;
    }
    layers.push_back(r);
  }
  const int64_t head_size =
      T.h + T.biases * T.h + (m.untie_embeddings_and_output_weights ? word : 0);
  const Ranges head = {{at1, at1 + head_size}};
  at1 += head_size;
  // Each multi-token prediction module: its three norms, eh_proj and layer (whole weights).
  std::vector<Ranges> mtp;
  for (int64_t k = 0; k < m.mtp_num_layers; ++k) {
    const bool moe = m.mtp_layer_is_moe();
    Ranges r = {{at1, at1 + 3 * (T.h + T.biases * T.h) + T.h / l.t * 2 * T.h +
                          (moe ? T.per_moe_layer : T.per_layer)}};
    at1 = r.back().second;
    if (moe) {
      r.emplace_back(at2, at2 + T.per_moe_experts);
      at2 = r.back().second;
    }
    mtp.push_back(r);
  }
  // This rank's block of each segment.
  Ranges own;
  int64_t offset = 0;
  for (size_t seg = 0; seg < sizes.size(); ++seg) {
    const int64_t n =
        std::max<int64_t>(1, seg == 2 ? l.expert_segment_multiple : l.segment_multiple);
    const int64_t rank = seg == 2 ? l.expert_shard_rank : l.shard_rank, block = sizes[seg] / n;
    own.emplace_back(offset + rank * block, offset + (rank + 1) * block);
    offset += sizes[seg];
  }
  auto size_of = [](const Ranges& r) {
    int64_t n = 0;
    for (const auto& [lo, hi] : r) n += hi - lo;
    return n;
  };
  auto union_size = [](Ranges r) {
    std::sort(r.begin(), r.end());
    int64_t n = 0, end = 0;
    for (const auto& [lo, hi] : r) {
      const int64_t a = std::max(lo, end);
      if (hi > a) n += hi - a;
      end = std::max(end, hi);
    }
    return n;
  };
  FsdpHeld out;
  out.gradients = size_of(own);
  if (l.fsdp == FsdpSharding::kOptimGradsParams) {
    Ranges kept = own;
    for (const Ranges* r : std::initializer_list<const Ranges*>{&embedding, &head})
      kept.insert(kept.end(), r->begin(), r->end());
    for (const Ranges& r : mtp) kept.insert(kept.end(), r.begin(), r.end());
    out.weights = union_size(kept);
    // Layers gathered at once: the one running and those ahead, until kFsdpPrefetchElements
    // (runtime/fsdp.cc).
    int64_t all = 0;
    for (const Ranges& r : layers) all += size_of(r);
    const auto n = static_cast<int64_t>(layers.size());
    if (n > 0 && all > 0) {
      const double unit = static_cast<double>(all) / static_cast<double>(n);
      const auto ahead = static_cast<int64_t>(fsdp_units_ahead(unit));
      for (int64_t i = 0; i < n; ++i) {
        int64_t g = 0;
        for (int64_t k = i; k < std::min(n, i + ahead + 1); ++k)
          g += size_of(layers[static_cast<size_t>(k)]);
        out.gathered = std::max(out.gathered, g);
      }
    }
  } else {
    out.weights = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  }
  // Gradient windows in the backward pass's order: the MTP modules from the last, the head, the
  // layers from the last, the embedding; each with the one before it still reducing. The word
  // table's is open throughout when the output layer (tied) or an MTP module shares it, and an
  // untied head's from the last MTP module's pass (the modules end in the output layer).
  const bool tied = !m.untie_embeddings_and_output_weights;
  const bool word_throughout = tied || !mtp.empty();
  struct Window {
    int64_t own, shared;  // the part's window; another open beside it
  };
  std::vector<Window> windows;
  for (auto it = mtp.rbegin(); it != mtp.rend(); ++it)
    windows.push_back({size_of(*it), tied ? 0 : size_of(head)});
  windows.push_back({size_of(head), 0});
  for (auto it = layers.rbegin(); it != layers.rend(); ++it) windows.push_back({size_of(*it), 0});
  windows.push_back({size_of(embedding) - (word_throughout ? word : 0), 0});
  int64_t most = 0;
  for (size_t i = 0; i < windows.size(); ++i)
    most = std::max(most, windows[i].own + windows[i].shared + (i > 0 ? windows[i - 1].own : 0));
  out.gradient_windows = most + (word_throughout ? word : 0);
  return out;
}

}  // namespace ptdp
