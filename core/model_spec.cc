// ModelSpec: exact parameter counts, validation, and JSON I/O (ptdp JSON and Hugging Face
// config.json).
//
// Bias rule: GPT-style models (plain GELU MLP) have biases on every linear layer and LayerNorm
// with weight and bias (2h); gated (SwiGLU, Llama-style) models have no biases and use RMSNorm
// (weight only, h). With it GPT-3 175B matches SC'21 eq. 2 and Llama 2/3 match their published
// counts exactly.
#include "core/model_spec.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "core/json_reader.h"

namespace ptdp {

using nlohmann::json;

namespace {

bool has_biases(const ModelSpec& m) {
  return !m.swiglu;
}

void require_non_negative(const std::string& field, int64_t value) {
  if (value < 0)
    throw InputError(field,
                     "must be positive (or 0 for the default), got " + std::to_string(value));
}

bool is_one_of(const std::string& s, std::initializer_list<const char*> options) {
  for (const char* o : options)
    if (s == o) return true;
  return false;
}

void validate_moe(const ModelSpec& m) {
  if (m.num_experts < 0)
    throw InputError("num_experts", "must be positive (or 0 for a dense model), got " +
                                        std::to_string(m.num_experts));
  if (m.num_experts == 0) return;
  const std::pair<const char*, int64_t> sizes[] = {
      {"num_experts", m.num_experts},
      {"moe_ffn_hidden_size", m.moe_ffn_hidden_size},
      {"moe_shared_expert_ffn_size", m.moe_shared_expert_ffn_size},
      {"moe_layer_freq", m.moe_layer_freq}};
  for (const auto& [field, value] : sizes) {
    require_non_negative(field, value);
    if (value > kMaxModelSize)
      throw InputError(field, std::to_string(value) + " exceeds " + std::to_string(kMaxModelSize) +
                                  ", the largest size ptdp handles");
  }
  require_positive("moe_layer_freq", m.moe_layer_freq);
  if (m.moe_router_topk < 1 || m.moe_router_topk > m.num_experts)
    throw InputError("moe_router_topk", "must be between 1 and num_experts (" +
                                            std::to_string(m.num_experts) + "), got " +
                                            std::to_string(m.moe_router_topk));
  if (m.moe_first_dense_layers < 0 || m.moe_first_dense_layers >= m.num_layers)
    throw InputError("moe_first_dense_layers", "must leave at least one MoE layer among the " +
                                                   std::to_string(m.num_layers) + " layers, got " +
                                                   std::to_string(m.moe_first_dense_layers));
  if (m.num_moe_layers() == 0) throw InputError("moe_layer_freq", "leaves no MoE layer");
  if (!(m.moe_capacity_factor == 0 || (m.moe_capacity_factor >= 1 && m.moe_capacity_factor <= 64)))
    throw InputError("moe_capacity_factor", "must be 0 (dropless) or between 1 and 64, got " +
                                                std::to_string(m.moe_capacity_factor));
  // The busiest of ep ranks takes at most all the tokens, ep times the mean; 1024 bounds ep.
  if (!(m.moe_expert_load == 0 || (m.moe_expert_load >= 1 && m.moe_expert_load <= 1024)))
    throw InputError("moe_expert_load", "must be 0 (assumed) or between 1 and 1024, got " +
                                            std::to_string(m.moe_expert_load));
}

// The MoE fields of a Hugging Face config: Mixtral (num_local_experts, every layer MoE with
// intermediate_size experts), Qwen-MoE (num_experts, moe_intermediate_size,
// shared_expert_intermediate_size, decoder_sparse_step, mlp_only_layers) and DeepSeek
// (n_routed_experts, n_shared_experts, moe_intermediate_size, first_k_dense_replace,
// moe_layer_freq). All route each token to num_experts_per_tok experts without dropping tokens.
void read_hf_moe_fields(JsonObjectReader& r, const json& j, const std::string& model_type,
                        ModelSpec& m) {
  const bool mixtral = model_type == "mixtral" || j.contains("num_local_experts");
  r.read("num_local_experts", m.num_experts);
  // null: a dense model (as some dense configs state it).
  if (!(j.contains("num_experts") && j.at("num_experts").is_null()))
    r.read("num_experts", m.num_experts);
  r.read("n_routed_experts", m.num_experts);
  if (m.num_experts <= 0) return;
  r.read("num_experts_per_tok", m.moe_router_topk);
  if (mixtral) m.moe_ffn_hidden_size = m.ffn_hidden_size;
  r.read("moe_intermediate_size", m.moe_ffn_hidden_size);
  r.read("shared_expert_intermediate_size", m.moe_shared_expert_ffn_size);
  int64_t shared_experts = 0;
  r.read("n_shared_experts", shared_experts);
  if (shared_experts < 0)
    throw InputError("n_shared_experts",
                     "must not be negative, got " + std::to_string(shared_experts));
  if (shared_experts > 0) {
    // Bounded before multiplying (a config may hold any integer).
    if (shared_experts > kMaxModelSize || m.moe_ffn_hidden_size > kMaxModelSize ||
        m.moe_ffn_hidden_size < 0)
      throw InputError(
          shared_experts > kMaxModelSize ? "n_shared_experts" : "moe_intermediate_size",
          "exceeds " + std::to_string(kMaxModelSize) + ", the largest size ptdp handles");
    m.moe_shared_expert_ffn_size = shared_experts * m.moe_ffn_hidden_size;
  }
  r.read("first_k_dense_replace", m.moe_first_dense_layers);
  r.read("moe_layer_freq", m.moe_layer_freq);
  int64_t sparse_step = 1;
  r.read("decoder_sparse_step", sparse_step);
  if (sparse_step != 1)
    throw InputError("decoder_sparse_step",
                     "only 1 (every layer MoE) is supported, got " + std::to_string(sparse_step));
  std::vector<int64_t> mlp_only;
  r.read("mlp_only_layers", mlp_only);
  for (size_t i = 0; i < mlp_only.size(); ++i)
    if (mlp_only[i] != static_cast<int64_t>(i))
      throw InputError("mlp_only_layers",
                       "only a leading run of dense layers (0, 1, ..., k-1) is supported");
  if (!mlp_only.empty()) m.moe_first_dense_layers = static_cast<int64_t>(mlp_only.size());
}

// A Hugging Face config.json (detected by its "num_hidden_layers" key). Other keys are ignored.
ModelSpec model_from_hf_config(const json& j) {
  JsonObjectReader r(j, "model");
  ModelSpec m;
  std::string model_type, name_or_path, hidden_act;
  r.read("model_type", model_type);
  r.read("_name_or_path", name_or_path);
  r.read("num_hidden_layers", m.num_layers);
  r.read("hidden_size", m.hidden_size);
  r.read("num_attention_heads", m.num_attention_heads);
  int64_t kv_heads = 0;
  r.read("num_key_value_heads", kv_heads);
  m.num_query_groups = kv_heads == m.num_attention_heads ? 0 : kv_heads;
  r.read("intermediate_size", m.ffn_hidden_size);
  r.read("vocab_size", m.vocab_size);
  if (!j.contains("max_position_embeddings"))
    throw InputError("max_position_embeddings", "missing: ptdp takes the sequence length from it");
  r.read("max_position_embeddings", m.seq_length);
  bool tied = !is_one_of(model_type, {"llama", "mistral", "mixtral", "qwen2_moe", "qwen3",
                                      "qwen3_moe", "deepseek", "deepseek_v2", "deepseek_v3"});
  r.read("tie_word_embeddings", tied);
  m.untie_embeddings_and_output_weights = !tied;
  // Hugging Face's config classes of these families default to SiLU and rotary positions, so a
  // config may leave either out (transformers' LlamaConfig, MistralConfig, MixtralConfig,
  // Qwen2Config, Qwen2MoeConfig, DeepseekV2/V3Config).
  const bool rotary_family =
      is_one_of(model_type, {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                             "qwen3_moe", "deepseek_v2", "deepseek_v3"});
  if (rotary_family) hidden_act = "silu";
  r.read("hidden_act", hidden_act);
  // SiLU configs are gated (SwiGLU, no biases); GELU ones are GPT's MLP (biases, ungated), as
  // GPT-NeoX and GPT-J. A gated GELU (Gemma's GeGLU) and other activations are refused: they
  // would be priced with the wrong weights.
  m.swiglu = is_one_of(hidden_act, {"silu", "swish", "swiglu"});
  if (is_one_of(model_type, {"gemma", "gemma2", "gemma3", "gemma3_text"}) ||
      j.contains("hidden_activation"))
    throw InputError(j.contains("hidden_activation") ? "hidden_activation" : "model_type",
                     "gated GELU MLPs (GeGLU, as Gemma's) are not modelled by ptdp");
  if (!hidden_act.empty() && !m.swiglu &&
      !is_one_of(hidden_act, {"gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh"}))
    throw InputError("hidden_act",
                     "'" + hidden_act + "' is not modelled: ptdp's MLPs are SwiGLU (silu) or GELU");
  m.learned_position_embeddings = !(rotary_family || j.contains("rope_theta"));
  if (model_type == "mixtral") m.rotary_base = 1e6;  // MixtralConfig's default rope_theta
  r.read("rope_theta", m.rotary_base);
  // Dropout as the config states it (GPT-2's attn_pdrop/resid_pdrop); none where it is silent.
  m.attention_dropout = 0;
  m.hidden_dropout = 0;
  r.read("attn_pdrop", m.attention_dropout);
  r.read("attention_dropout", m.attention_dropout);
  r.read("resid_pdrop", m.hidden_dropout);
  r.read("hidden_dropout", m.hidden_dropout);
  // A head width other than hidden_size / num_attention_heads (Qwen3, Mistral-Nemo set
  // head_dim): Megatron's --kv-channels.
  // transformers' Qwen3Config and Qwen3MoeConfig default head_dim to 128 (and untied
  // embeddings, above).
  const bool qwen3 = is_one_of(model_type, {"qwen3", "qwen3_moe"});
  if (qwen3) m.kv_channels = 128;
  // DeepSeek-V2/V3's multi-head latent attention (kv_lora_rank set; q_lora_rank null: one query
  // projection). transformers' DeepseekV3Config derives a head_dim from the rotated width, which
  // is not a head width of ptdp's: MLA's are its own.
  m.multi_latent_attention = j.contains("kv_lora_rank") && !j.at("kv_lora_rank").is_null();
  if (m.multi_latent_attention) {
    if (j.contains("q_lora_rank") && !j.at("q_lora_rank").is_null())
      r.read("q_lora_rank", m.q_lora_rank);
    r.read("kv_lora_rank", m.kv_lora_rank);
    r.read("qk_nope_head_dim", m.qk_head_dim);
    r.read("qk_rope_head_dim", m.qk_pos_emb_head_dim);
    r.read("v_head_dim", m.v_head_dim);
  } else if (j.contains("head_dim") && !j.at("head_dim").is_null()) {
    r.read("head_dim", m.kv_channels);
    if (m.kv_channels <= 0)
      throw InputError("head_dim", "must be positive, got " + std::to_string(m.kv_channels));
  }
  // (Both bounded before multiplying: validate() refuses the larger values by name.)
  if (m.kv_channels > 0 && m.kv_channels <= kMaxModelSize && m.num_attention_heads > 0 &&
      m.num_attention_heads <= kMaxModelSize &&
      m.kv_channels * m.num_attention_heads == m.hidden_size)
    m.kv_channels = 0;  // the default width
  // Qwen3's attention normalises each head's query and key (q_norm, k_norm: RMSNorm over
  // head_dim); so does OLMo 2's, over the whole projection, which ptdp does not model.
  // DeepSeek-V2/V3 normalise their latents (q_a_layernorm, kv_a_layernorm): Megatron-Core's
  // --qk-layernorm with multi-latent attention.
  m.qk_layernorm = qwen3 || m.multi_latent_attention;
  if (is_one_of(model_type, {"olmo2", "olmoe"}))
    throw InputError("model_type", "'" + model_type +
                                       "' normalises the whole query and key projections; "
                                       "ptdp's --qk-layernorm is per head (Qwen3's)");
  // Qwen2's attention has biases on its query, key and value projections (transformers'
  // Qwen2Attention, Qwen2MoeAttention): Megatron's --add-qkv-bias.
  m.add_qkv_bias = is_one_of(model_type, {"qwen2", "qwen2_moe"}) && m.swiglu;
  bool attention_bias = false;
  r.read("attention_bias", attention_bias);
  if (attention_bias && m.swiglu)
    throw InputError("attention_bias",
                     "biases on a gated (SwiGLU) model's attention are not modelled by ptdp");
  read_hf_moe_fields(r, j, model_type, m);
  // DeepSeek-V3's multi-token prediction modules (transformers keeps the field, not the modules).
  r.read("num_nextn_predict_layers", m.mtp_num_layers);
  m.name = !name_or_path.empty() ? name_or_path : !model_type.empty() ? model_type : "custom";
  return m;
}

}  // namespace

namespace {

// Attention (QKV and projection) and the two norms of a layer.
double attention_and_norm_parameters(const ModelSpec& m) {
  const double h = static_cast<double>(m.hidden_size);
  if (m.multi_latent_attention) {  // no biases (validate)
    const double heads = static_cast<double>(m.num_attention_heads);
    const double q_in = m.q_lora_rank > 0 ? static_cast<double>(m.q_lora_rank) : h;
    const double q_up = q_in * heads * static_cast<double>(m.head_dim());
    const double kv_up = static_cast<double>(m.kv_lora_rank) * heads *
                         static_cast<double>(m.qk_head_dim + m.v_head_dim);
    const double proj = static_cast<double>(m.context_width()) * h;
    return m.mla_replicated_parameters() + q_up + kv_up + proj + 2 * m.norm_parameters();
  }
  const double q = static_cast<double>(m.query_width());
  const double kv = static_cast<double>(m.head_dim() * m.query_groups());  // K (and V) width
  const double bias = has_biases(m) ? 1.0 : 0.0;
  const double qkv = h * (q + 2 * kv) + (m.has_qkv_bias() ? 1.0 : 0.0) * (q + 2 * kv);
  const double proj = q * h + bias * h;
  return qkv + proj + 2 * m.norm_parameters() + m.qk_norm_parameters();
}

// One MLP of FFN width `width`.
double mlp_parameters(const ModelSpec& m, int64_t width) {
  const double h = static_cast<double>(m.hidden_size);
  const double f = static_cast<double>(width);
  const double bias = has_biases(m) ? 1.0 : 0.0;
  return m.swiglu ? 3 * h * f + bias * (2 * f + h) : 2 * h * f + bias * (f + h);
}

}  // namespace

double ModelSpec::parameters_per_layer() const {
  return attention_and_norm_parameters(*this) + mlp_parameters(*this, ffn_hidden());
}

double ModelSpec::expert_parameters_per_layer() const {
  return static_cast<double>(num_experts) * mlp_parameters(*this, moe_ffn_hidden());
}

double ModelSpec::moe_layer_parameters() const {
  const double router = static_cast<double>(hidden_size) * static_cast<double>(num_experts);
  const double shared =
      moe_shared_expert_ffn_size > 0 ? mlp_parameters(*this, moe_shared_expert_ffn_size) : 0.0;
  return attention_and_norm_parameters(*this) + router + shared + expert_parameters_per_layer();
}

double ModelSpec::expert_parameters() const {
  return static_cast<double>(num_moe_layers()) * expert_parameters_per_layer();
}

bool ModelSpec::is_moe_layer(int64_t i) const {
  return num_experts > 0 && i >= moe_first_dense_layers && moe_layer_freq > 0 &&
         i % moe_layer_freq == 0;
}

int64_t ModelSpec::moe_layers_in(int64_t first, int64_t count) const {
  if (num_experts <= 0 || moe_layer_freq <= 0) return 0;
  // Layers i in [max(first, first_dense), first + count) with i % freq == 0.
  const int64_t lo = std::max(first, moe_first_dense_layers);
  const int64_t hi = first + count;  // exclusive
  if (hi <= lo) return 0;
  auto multiples_below = [&](int64_t x) { return (x + moe_layer_freq - 1) / moe_layer_freq; };
  return multiples_below(hi) - multiples_below(lo);
}

double ModelSpec::replicated_parameters_per_layer(bool moe_layer) const {
  const bool fc2 = !moe_layer || moe_shared_expert_ffn_size > 0;
  const double biases = has_biases(*this) ? (fc2 ? 2.0 : 1.0) : 0.0;
  const double router =
      moe_layer ? static_cast<double>(hidden_size) * static_cast<double>(num_experts) : 0.0;
  return 2 * norm_parameters() + qk_norm_parameters() + mla_replicated_parameters() +
         biases * static_cast<double>(hidden_size) + router;
}

double ModelSpec::layer_parameters_per_rank(int64_t t, bool moe_layer) const {
  const double kept = replicated_parameters_per_layer(moe_layer);
  const double layer =
      moe_layer ? moe_layer_parameters() - expert_parameters_per_layer() : parameters_per_layer();
  return (layer - kept) / static_cast<double>(t) + kept;
}

double ModelSpec::expert_parameters_per_rank(int64_t ep, int64_t etp) const {
  const double fc2_bias = has_biases(*this) ? static_cast<double>(hidden_size) : 0.0;
  const double expert = mlp_parameters(*this, moe_ffn_hidden());
  return static_cast<double>(num_experts) / static_cast<double>(ep) *
         ((expert - fc2_bias) / static_cast<double>(etp) + fc2_bias);
}

double ModelSpec::position_embedding_parameters() const {
  return learned_position_embeddings
             ? static_cast<double>(max_positions()) * static_cast<double>(hidden_size)
             : 0.0;
}

double ModelSpec::norm_parameters() const {
  return (has_biases(*this) ? 2.0 : 1.0) * static_cast<double>(hidden_size);
}

double ModelSpec::qk_norm_parameters() const {
  // (MLA's --qk-layernorm normalises its latents: mla_replicated_parameters.)
  return qk_layernorm && !multi_latent_attention
             ? 2.0 * (has_biases(*this) ? 2.0 : 1.0) * static_cast<double>(head_dim())
             : 0.0;
}

double ModelSpec::mla_replicated_parameters() const {
  if (!multi_latent_attention) return 0.0;
  const double h = static_cast<double>(hidden_size);
  const double ql = static_cast<double>(q_lora_rank), kvl = static_cast<double>(kv_lora_rank);
  const double norms = qk_layernorm ? ql + kvl : 0.0;
  return h * ql + h * static_cast<double>(kv_latent_width()) + norms;
}

double ModelSpec::embedding_parameters() const {
  return static_cast<double>(vocab_size) * static_cast<double>(hidden_size) +
         position_embedding_parameters();
}

double ModelSpec::output_parameters() const {
  if (!untie_embeddings_and_output_weights) return 0;
  return static_cast<double>(vocab_size) * static_cast<double>(hidden_size);
}

double ModelSpec::parameters() const {
  const auto moe_layers = static_cast<double>(num_moe_layers());
  const double layers = (static_cast<double>(num_layers) - moe_layers) * parameters_per_layer() +
                        (moe_layers > 0 ? moe_layers * moe_layer_parameters() : 0.0);
  return layers + embedding_parameters() + output_parameters() + norm_parameters() +
         static_cast<double>(mtp_num_layers) * mtp_module_parameters();
}

double ModelSpec::mtp_module_parameters() const {
  const double h = static_cast<double>(hidden_size);
  const double layer = mtp_layer_is_moe() ? moe_layer_parameters() : parameters_per_layer();
  return 3 * norm_parameters() + 2 * h * h + layer;  // enorm, hnorm, final norm; eh_proj
}

double ModelSpec::mtp_module_parameters_per_rank(int64_t t) const {
  const double h = static_cast<double>(hidden_size);
  return 3 * norm_parameters() + 2 * h * h / static_cast<double>(t) +
         layer_parameters_per_rank(t, mtp_layer_is_moe());
}

namespace {

// Multi-head latent attention's widths, and the rest of the model as ptdp models MLA
// (DeepSeek's: rotary, gated, no biases, no grouped queries or per-head norms).
void validate_mla(const ModelSpec& m) {
  if (!m.multi_latent_attention) return;
  const std::pair<const char*, int64_t> widths[] = {{"q_lora_rank", m.q_lora_rank},
                                                    {"kv_lora_rank", m.kv_lora_rank},
                                                    {"qk_head_dim", m.qk_head_dim},
                                                    {"qk_pos_emb_head_dim", m.qk_pos_emb_head_dim},
                                                    {"v_head_dim", m.v_head_dim}};
  for (const auto& [field, value] : widths) {
    if (value < 0 || (value == 0 && std::string_view(field) != "q_lora_rank"))
      throw InputError(field, std::string("must be positive") +
                                  (std::string_view(field) == "q_lora_rank" ? " or 0" : "") +
                                  ", got " + std::to_string(value));
    if (value > kMaxModelSize)
      throw InputError(field, std::to_string(value) + " exceeds " + std::to_string(kMaxModelSize) +
                                  ", the largest size ptdp handles");
  }
  if (m.qk_pos_emb_head_dim % 2 != 0)
    throw InputError("qk_pos_emb_head_dim", "rotary embeddings need an even width, got " +
                                                std::to_string(m.qk_pos_emb_head_dim));
  if (m.v_head_dim > m.qk_head_dim + m.qk_pos_emb_head_dim)
    throw InputError("v_head_dim", "must not exceed qk_head_dim + qk_pos_emb_head_dim (" +
                                       std::to_string(m.qk_head_dim + m.qk_pos_emb_head_dim) +
                                       "): ptdp runs MLA's fused attention at the query width");
  const int64_t widest = std::max(m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim);
  if (widest * m.num_attention_heads > kMaxModelSize)
    throw InputError("num_attention_heads", "x the MLA head widths exceeds " +
                                                std::to_string(kMaxModelSize) +
                                                ", the largest size ptdp handles");
  auto refuse = [](const char* field, const std::string& why) {
    throw InputError(field, why + " with multi_latent_attention (ptdp models DeepSeek's MLA)");
  };
  if (m.kv_channels > 0) refuse("kv_channels", "the head widths are MLA's own");
  if (m.add_qkv_bias) refuse("add_qkv_bias", "there is no QKV projection");
  if (m.query_groups() != m.num_attention_heads)
    refuse("num_query_groups", "grouped-query attention is not modelled");
  if (!m.swiglu) refuse("swiglu", "a GELU MLP with biases is not modelled");
  if (m.learned_position_embeddings)
    refuse("learned_position_embeddings", "learned positions are not modelled (rope is needed)");
}

}  // namespace

void ModelSpec::validate() const {
  require_positive("num_layers", num_layers);
  require_positive("hidden_size", hidden_size);
  require_positive("num_attention_heads", num_attention_heads);
  require_non_negative("num_query_groups", num_query_groups);
  require_non_negative("ffn_hidden_size", ffn_hidden_size);
  require_positive("seq_length", seq_length);
  require_positive("vocab_size", vocab_size);
  const std::pair<const char*, int64_t> sizes[] = {{"num_layers", num_layers},
                                                   {"hidden_size", hidden_size},
                                                   {"num_attention_heads", num_attention_heads},
                                                   {"num_query_groups", num_query_groups},
                                                   {"ffn_hidden_size", ffn_hidden_size},
                                                   {"seq_length", seq_length},
                                                   {"vocab_size", vocab_size}};
  for (const auto& [field, value] : sizes)
    if (value > kMaxModelSize)
      throw InputError(field, std::to_string(value) + " exceeds " + std::to_string(kMaxModelSize) +
                                  ", the largest size ptdp handles");
  validate_mla(*this);
  require_non_negative("kv_channels", kv_channels);
  if (kv_channels > kMaxModelSize)
    throw InputError("kv_channels", std::to_string(kv_channels) + " exceeds " +
                                        std::to_string(kMaxModelSize) +
                                        ", the largest size ptdp handles");
  if (kv_channels == 0 && !multi_latent_attention && hidden_size % num_attention_heads != 0)
    throw InputError("hidden_size", std::to_string(hidden_size) +
                                        " is not divisible by num_attention_heads (" +
                                        std::to_string(num_attention_heads) +
                                        "); set kv_channels for another head width");
  if (query_width() > kMaxModelSize)
    throw InputError(multi_latent_attention ? "qk_head_dim"
                     : kv_channels > 0      ? "kv_channels"
                                            : "num_attention_heads",
                     "num_attention_heads x kv_channels = " + std::to_string(query_width()) +
                         " exceeds " + std::to_string(kMaxModelSize) +
                         ", the largest size ptdp handles");
  if (num_attention_heads % query_groups() != 0)
    throw InputError("num_query_groups", std::to_string(query_groups()) +
                                             " does not divide num_attention_heads (" +
                                             std::to_string(num_attention_heads) + ")");
  for (const auto& [field, p] :
       {std::pair<const char*, double>{"attention_dropout", attention_dropout},
        {"hidden_dropout", hidden_dropout}})
    if (!(p >= 0 && p < 1))
      throw InputError(field, "must be a probability in [0, 1), got " + std::to_string(p));
  if (max_position_embeddings < 0 || max_position_embeddings > kMaxModelSize ||
      (max_position_embeddings > 0 && max_position_embeddings < seq_length))
    throw InputError("max_position_embeddings", "must be at least seq_length (" +
                                                    std::to_string(seq_length) + ") and at most " +
                                                    std::to_string(kMaxModelSize) + ", got " +
                                                    std::to_string(max_position_embeddings));
  validate_moe(*this);
  if (mtp_num_layers < 0 || mtp_num_layers > kMaxMtpLayers)
    throw InputError("mtp_num_layers", "must be in [0, " + std::to_string(kMaxMtpLayers) +
                                           "], got " + std::to_string(mtp_num_layers));
  if (!(mtp_loss_scaling_factor >= 0 && mtp_loss_scaling_factor <= 1e6))
    throw InputError("mtp_loss_scaling_factor", "must be in [0, 1e6]");
  if (mtp_num_layers >= seq_length)
    throw InputError("mtp_num_layers", "must be below seq_length (" + std::to_string(seq_length) +
                                           "): module k predicts k + 1 tokens ahead");
  if (mtp_num_layers > 0 && learned_position_embeddings)
    throw InputError("mtp_num_layers",
                     "multi-token prediction needs rotary (or no) position embeddings, as in "
                     "Megatron-Core");
  // Real models use 1e4 to 1e6 (Llama 3: 5e5); above 1e12 is a typo, and would not print as
  // Megatron's integer --rotary-base.
  if (!learned_position_embeddings && !(rotary_base > 1 && rotary_base <= 1e12))
    throw InputError("rotary_base", "must be in (1, 1e12]");
  if (!learned_position_embeddings && !multi_latent_attention && head_dim() % 2 != 0)
    throw InputError(kv_channels > 0 ? "kv_channels" : "num_attention_heads",
                     "rotary embeddings need an even head dimension (kv_channels, or "
                     "hidden_size / num_attention_heads), got " +
                         std::to_string(head_dim()));
}

namespace {

// An error in a model read from a Hugging Face config, named by the config's keys rather than
// ptdp's fields (num_key_value_heads, not num_query_groups).
InputError in_hf_terms(const InputError& e) {
  static const std::pair<const char*, const char*> kKeys[] = {
      {"num_layers", "num_hidden_layers"},
      {"num_query_groups", "num_key_value_heads"},
      {"ffn_hidden_size", "intermediate_size"},
      {"seq_length", "max_position_embeddings"},
      {"rotary_base", "rope_theta"},
      {"kv_channels", "head_dim"},
      {"qk_head_dim", "qk_nope_head_dim"},
      {"qk_pos_emb_head_dim", "qk_rope_head_dim"},
      {"moe_router_topk", "num_experts_per_tok"},
      {"moe_ffn_hidden_size", "moe_intermediate_size"},
      {"moe_first_dense_layers", "first_k_dense_replace"},
      {"moe_shared_expert_ffn_size", "shared_expert_intermediate_size"},
  };
  auto rename = [](std::string text) {
    for (const auto& [ours, theirs] : kKeys) {
      const std::string_view from = ours, to = theirs;
      for (size_t at = find_identifier(text, from); at != std::string::npos;
           at = find_identifier(text, from, at + to.size()))
        text.replace(at, from.size(), to);
    }
    return text;
  };
  const std::string what = e.what();
  const std::string problem = what.substr(std::min(what.size(), e.field().size() + 2));
  return InputError(rename(e.field()), rename(problem));
}

}  // namespace

ModelSpec model_from_json(const json& j) {
  ModelSpec m;
  if (j.is_object() && j.contains("num_hidden_layers")) {
    m = model_from_hf_config(j);
    try {
      m.validate();
    } catch (const InputError& e) {
      throw in_hf_terms(e);
    }
    return m;
  } else {
    JsonObjectReader r(j, "model");
    r.read("name", m.name);
    r.read("num_layers", m.num_layers);
    r.read("hidden_size", m.hidden_size);
    r.read("num_attention_heads", m.num_attention_heads);
    r.read("num_query_groups", m.num_query_groups);
    r.read("ffn_hidden_size", m.ffn_hidden_size);
    r.read("seq_length", m.seq_length);
    r.read("max_position_embeddings", m.max_position_embeddings);
    r.read("vocab_size", m.vocab_size);
    r.read("swiglu", m.swiglu);
    r.read("untie_embeddings_and_output_weights", m.untie_embeddings_and_output_weights);
    r.read("learned_position_embeddings", m.learned_position_embeddings);
    r.read("rotary_base", m.rotary_base);
    r.read("attention_dropout", m.attention_dropout);
    r.read("hidden_dropout", m.hidden_dropout);
    r.read("flash_attention", m.flash_attention);
    r.read("cross_entropy_fusion", m.cross_entropy_fusion);
    r.read("kv_channels", m.kv_channels);
    r.read("qk_layernorm", m.qk_layernorm);
    r.read("add_qkv_bias", m.add_qkv_bias);
    r.read("multi_latent_attention", m.multi_latent_attention);
    r.read("q_lora_rank", m.q_lora_rank);
    r.read("kv_lora_rank", m.kv_lora_rank);
    r.read("qk_head_dim", m.qk_head_dim);
    r.read("qk_pos_emb_head_dim", m.qk_pos_emb_head_dim);
    r.read("v_head_dim", m.v_head_dim);
    r.read("num_experts", m.num_experts);
    r.read("moe_router_topk", m.moe_router_topk);
    r.read("moe_ffn_hidden_size", m.moe_ffn_hidden_size);
    r.read("moe_shared_expert_ffn_size", m.moe_shared_expert_ffn_size);
    r.read("moe_layer_freq", m.moe_layer_freq);
    r.read("moe_first_dense_layers", m.moe_first_dense_layers);
    r.read("moe_capacity_factor", m.moe_capacity_factor);
    r.read("moe_expert_load", m.moe_expert_load);
    r.read("mtp_num_layers", m.mtp_num_layers);
    r.read("mtp_loss_scaling_factor", m.mtp_loss_scaling_factor);
    std::string policy = m.moe_drop_by_position ? "position" : "probs";
    r.read("moe_token_drop_policy", policy);
    if (policy != "probs" && policy != "position")
      throw InputError("moe_token_drop_policy", "must be probs or position, got '" + policy + "'");
    m.moe_drop_by_position = policy == "position";
    r.reject_unknown_keys();
  }
  m.validate();
  return m;
}

json to_json(const ModelSpec& m) {
  json j{{"name", m.name},
         {"num_layers", m.num_layers},
         {"hidden_size", m.hidden_size},
         {"num_attention_heads", m.num_attention_heads},
         {"num_query_groups", m.num_query_groups},
         {"ffn_hidden_size", m.ffn_hidden_size},
         {"seq_length", m.seq_length},
         {"vocab_size", m.vocab_size},
         {"swiglu", m.swiglu},
         {"untie_embeddings_and_output_weights", m.untie_embeddings_and_output_weights},
         {"learned_position_embeddings", m.learned_position_embeddings},
         {"rotary_base", m.rotary_base},
         {"attention_dropout", m.attention_dropout},
         {"hidden_dropout", m.hidden_dropout},
         {"flash_attention", m.flash_attention},
         {"cross_entropy_fusion", m.cross_entropy_fusion}};
  if (m.max_position_embeddings > 0) j["max_position_embeddings"] = m.max_position_embeddings;
  if (m.kv_channels > 0) j["kv_channels"] = m.kv_channels;
  if (m.qk_layernorm) j["qk_layernorm"] = true;
  if (m.add_qkv_bias) j["add_qkv_bias"] = true;
  if (m.multi_latent_attention) {
    j["multi_latent_attention"] = true;
    j["q_lora_rank"] = m.q_lora_rank;
    j["kv_lora_rank"] = m.kv_lora_rank;
    j["qk_head_dim"] = m.qk_head_dim;
    j["qk_pos_emb_head_dim"] = m.qk_pos_emb_head_dim;
    j["v_head_dim"] = m.v_head_dim;
  }
  if (m.mtp_num_layers > 0) {
    j["mtp_num_layers"] = m.mtp_num_layers;
    j["mtp_loss_scaling_factor"] = m.mtp_loss_scaling_factor;
  }
  if (m.is_moe()) {
    j["num_experts"] = m.num_experts;
    j["moe_router_topk"] = m.moe_router_topk;
    j["moe_ffn_hidden_size"] = m.moe_ffn_hidden_size;
    j["moe_shared_expert_ffn_size"] = m.moe_shared_expert_ffn_size;
    j["moe_layer_freq"] = m.moe_layer_freq;
    j["moe_first_dense_layers"] = m.moe_first_dense_layers;
    j["moe_capacity_factor"] = m.moe_capacity_factor;
    if (m.moe_drop_by_position) j["moe_token_drop_policy"] = "position";
    if (m.moe_expert_load > 0) j["moe_expert_load"] = m.moe_expert_load;
  }
  return j;
}

namespace {

// Megatron's --moe-layer-freq pattern: "[a,b,...]" lists joined by '+', each optionally
// repeated ("*N"), the whole optionally in parentheses. Entries are 0 or 1.
std::vector<int> parse_layer_pattern(std::string v, int64_t num_layers) {
  const char* flag = "--moe-layer-freq";
  std::string s;
  for (char ch : v)
    if (ch != ' ' && ch != '\t') s += ch;
  if (s.size() >= 2 && s.front() == '(' && s.back() == ')') s = s.substr(1, s.size() - 2);
  std::vector<int> out;
  size_t i = 0;
  auto bad = [&](const std::string& why) -> InputError {
    return InputError(flag, "cannot read the layer pattern '" + v + "': " + why);
  };
  auto number = [&](int64_t limit) {
    const size_t start = i;
    int64_t n = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
      n = n * 10 + (s[i++] - '0');
      if (n > limit) throw bad("a number exceeds " + std::to_string(limit));
    }
    if (i == start) throw bad("expected a number at position " + std::to_string(start + 1));
    return n;
  };
  while (true) {
    if (i >= s.size() || s[i] != '[')
      throw bad("expected '[' at position " + std::to_string(i + 1));
    ++i;
    std::vector<int> list;
    while (true) {
      const int64_t e = number(1);
      list.push_back(static_cast<int>(e));
      if (i < s.size() && s[i] == ',') {
        ++i;
        continue;
      }
      if (i < s.size() && s[i] == ']') break;
      throw bad("expected ',' or ']' at position " + std::to_string(i + 1));
    }
    ++i;
    int64_t repeat = 1;
    if (i < s.size() && s[i] == '*') {
      ++i;
      repeat = number(kMaxModelSize);
    }
    for (int64_t r = 0; r < repeat; ++r) {
      if (static_cast<int64_t>(out.size() + list.size()) > num_layers)
        throw bad("it lists more entries than the " + std::to_string(num_layers) + " layers");
      out.insert(out.end(), list.begin(), list.end());
    }
    if (i == s.size()) break;
    if (s[i] != '+') throw bad("expected '+' at position " + std::to_string(i + 1));
    ++i;
  }
  if (static_cast<int64_t>(out.size()) != num_layers)
    throw bad("it has " + std::to_string(out.size()) + " entries for " +
              std::to_string(num_layers) + " layers");
  return out;
}

}  // namespace

void set_moe_layer_freq(ModelSpec& m, const std::string& value) {
  const char* flag = "--moe-layer-freq";
  if (value.find('[') == std::string::npos) {
    size_t used = 0;
    int64_t n = 0;
    try {
      n = std::stoll(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != value.size() || n < 1 || n > kMaxModelSize)
      throw InputError(flag,
                       "must be a positive integer or a layer pattern like "
                       "\"([0]*3+[1]*29)\", got '" +
                           value + "'");
    m.moe_layer_freq = n;
    m.moe_first_dense_layers = 0;
    return;
  }
  if (m.num_layers <= 0) throw InputError(flag, "a layer pattern needs --num-layers");
  const std::vector<int> pattern = parse_layer_pattern(value, m.num_layers);
  std::vector<int64_t> moe;
  for (size_t i = 0; i < pattern.size(); ++i)
    if (pattern[i]) moe.push_back(static_cast<int64_t>(i));
  if (moe.empty()) throw InputError(flag, "the layer pattern has no MoE layer (no 1)");
  // ptdp's layouts: layer i is MoE when i >= K and i % N == 0, K the first MoE layer. N is the
  // gap between MoE layers; with one MoE layer, the only N that can leave it alone (K itself,
  // or the layer count when K is 0).
  const int64_t k = moe[0];
  const int64_t n = moe.size() > 1 ? moe[1] - k : k > 0 ? k : m.num_layers;
  bool same = true;  // ModelSpec::is_moe_layer with these K and N
  for (int64_t i = 0; i < m.num_layers && same; ++i)
    same = (i >= k && i % n == 0) == (pattern[static_cast<size_t>(i)] == 1);
  if (same) {
    m.moe_layer_freq = n;
    m.moe_first_dense_layers = k;
    return;
  }
  throw InputError(flag,
                   "ptdp models MoE layers as every N-th layer after the first K dense "
                   "ones; the pattern '" +
                       value + "' is not of that form");
}

}  // namespace ptdp
