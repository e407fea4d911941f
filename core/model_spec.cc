// ModelSpec: exact parameter counts, validation, and JSON I/O (ptdp JSON and Hugging Face
// config.json).
//
// Bias rule: GPT-style models (plain GELU MLP) have biases on every linear layer and LayerNorm
// with weight and bias (2h); gated (SwiGLU, Llama-style) models have no biases and use RMSNorm
// (weight only, h). With it GPT-3 175B matches SC'21 eq. 2 and Llama 2/3 match their published
// counts exactly.
#include "core/model_spec.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_reader.h"

namespace ptdp {

using nlohmann::json;

namespace {

bool has_biases(const ModelSpec& m) {
  return !m.swiglu;
}

double norm_parameters(const ModelSpec& m) {
  return (has_biases(m) ? 2.0 : 1.0) * static_cast<double>(m.hidden_size);
}

void require_positive(const std::string& field, int64_t value) {
  if (value <= 0) throw InputError(field, "must be positive, got " + std::to_string(value));
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
  r.read("max_position_embeddings", m.seq_length);
  bool tied = !is_one_of(model_type, {"llama", "mistral"});
  r.read("tie_word_embeddings", tied);
  m.untie_embeddings_and_output_weights = !tied;
  r.read("hidden_act", hidden_act);
  m.swiglu = is_one_of(hidden_act, {"silu", "swiglu"});
  m.learned_position_embeddings =
      !(is_one_of(model_type, {"llama", "mistral", "qwen2"}) || j.contains("rope_theta"));
  r.read("rope_theta", m.rotary_base);
  // Dropout as the config states it (GPT-2's attn_pdrop/resid_pdrop); none where it is silent.
  m.attention_dropout = 0;
  m.hidden_dropout = 0;
  r.read("attn_pdrop", m.attention_dropout);
  r.read("attention_dropout", m.attention_dropout);
  r.read("resid_pdrop", m.hidden_dropout);
  r.read("hidden_dropout", m.hidden_dropout);
  m.name = !name_or_path.empty() ? name_or_path : !model_type.empty() ? model_type : "custom";
  return m;
}

}  // namespace

double ModelSpec::parameters_per_layer() const {
  const double h = static_cast<double>(hidden_size);
  const double f = static_cast<double>(ffn_hidden());
  const double kv = static_cast<double>(kv_channels() * query_groups());  // width of K (and V)
  const double bias = has_biases(*this) ? 1.0 : 0.0;
  const double qkv = h * (h + 2 * kv) + bias * (h + 2 * kv);
  const double proj = h * h + bias * h;
  const double mlp = swiglu ? 3 * h * f + bias * (2 * f + h) : 2 * h * f + bias * (f + h);
  return qkv + proj + mlp + 2 * norm_parameters(*this);
}

double ModelSpec::embedding_parameters() const {
  const double positions = learned_position_embeddings ? static_cast<double>(seq_length) : 0.0;
  return (static_cast<double>(vocab_size) + positions) * static_cast<double>(hidden_size);
}

double ModelSpec::output_parameters() const {
  if (!untie_embeddings_and_output_weights) return 0;
  return static_cast<double>(vocab_size) * static_cast<double>(hidden_size);
}

double ModelSpec::parameters() const {
  return static_cast<double>(num_layers) * parameters_per_layer() + embedding_parameters() +
         output_parameters() + norm_parameters(*this);
}

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
  if (hidden_size % num_attention_heads != 0)
    throw InputError("hidden_size", std::to_string(hidden_size) +
                                        " is not divisible by num_attention_heads (" +
                                        std::to_string(num_attention_heads) + ")");
  if (num_attention_heads % query_groups() != 0)
    throw InputError("num_query_groups", std::to_string(query_groups()) +
                                             " does not divide num_attention_heads (" +
                                             std::to_string(num_attention_heads) + ")");
  for (const auto& [field, p] :
       {std::pair<const char*, double>{"attention_dropout", attention_dropout},
        {"hidden_dropout", hidden_dropout}})
    if (!(p >= 0 && p < 1))
      throw InputError(field, "must be a probability in [0, 1), got " + std::to_string(p));
  if (!learned_position_embeddings && !(rotary_base > 1))
    throw InputError("rotary_base", "must be greater than 1");
  if (!learned_position_embeddings && (hidden_size / num_attention_heads) % 2 != 0)
    throw InputError("num_attention_heads",
                     "rotary embeddings need an even head dimension (hidden_size / "
                     "num_attention_heads)");
}

ModelSpec model_from_json(const json& j) {
  ModelSpec m;
  if (j.is_object() && j.contains("num_hidden_layers")) {
    m = model_from_hf_config(j);
  } else {
    JsonObjectReader r(j, "model");
    r.read("name", m.name);
    r.read("num_layers", m.num_layers);
    r.read("hidden_size", m.hidden_size);
    r.read("num_attention_heads", m.num_attention_heads);
    r.read("num_query_groups", m.num_query_groups);
    r.read("ffn_hidden_size", m.ffn_hidden_size);
    r.read("seq_length", m.seq_length);
    r.read("vocab_size", m.vocab_size);
    r.read("swiglu", m.swiglu);
    r.read("untie_embeddings_and_output_weights", m.untie_embeddings_and_output_weights);
    r.read("learned_position_embeddings", m.learned_position_embeddings);
    r.read("rotary_base", m.rotary_base);
    r.read("attention_dropout", m.attention_dropout);
    r.read("hidden_dropout", m.hidden_dropout);
    r.read("flash_attention", m.flash_attention);
    r.reject_unknown_keys();
  }
  m.validate();
  return m;
}

json to_json(const ModelSpec& m) {
  return json{{"name", m.name},
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
              {"flash_attention", m.flash_attention}};
}

}  // namespace ptdp
