// ModelSpec: the shape of a GPT-like decoder-only transformer, in Megatron-LM's vocabulary.
//
// Fields mirror Megatron-LM's flags (--num-layers, --hidden-size, ...). Zero for
// num_query_groups / ffn_hidden_size means "the default": as many groups as heads (plain
// multi-head attention) and 4 * hidden (8/3 * hidden rounded as Llama does is the user's job).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

namespace ptdp {

// The largest value of any size of a model (layers, widths, heads, sequence, vocabulary):
// hundreds of times today's largest models, and small enough that the products ptdp forms from
// sizes stay far from overflowing. validate() refuses more, naming the field.
inline constexpr int64_t kMaxModelSize = int64_t{1} << 24;
// The most multi-token prediction modules a model may have (DeepSeek-V3 has one).
inline constexpr int64_t kMaxMtpLayers = 64;

struct ModelSpec {
  std::string name = "custom";
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_query_groups = 0;  // 0: equal to num_attention_heads (no GQA)
  int64_t ffn_hidden_size = 0;   // 0: 4 * hidden_size
  int64_t seq_length = 0;
  // --max-position-embeddings: rows of the learned position table (0: seq_length). Megatron
  // requires at least seq_length; a longer table costs parameters, rotary models have none.
  int64_t max_position_embeddings = 0;
  int64_t vocab_size = 0;
  bool swiglu = false;  // gated MLP (three weight matrices)
  bool untie_embeddings_and_output_weights = false;
  bool learned_position_embeddings = true;  // false: rotary (no position table)
  double rotary_base = 10000;               // --rotary-base (Hugging Face rope_theta)
  // What the activations hold besides the tensors themselves (core/layer_ops.cc's
  // layer_activation_bytes). Dropout probabilities as Megatron's --attention-dropout and
  // --hidden-dropout (default 0.1 both; Hugging Face configs say 0 for Llama); a positive one
  // keeps a mask (and, for attention, the dropped-out scores) per element. Flash attention
  // (--use-flash-attn) keeps no s x s scores, only the softmax's log-sum-exp per row.
  double attention_dropout = 0.1;
  double hidden_dropout = 0.1;
  bool flash_attention = false;
  // The loss over the vocabulary shard computed in place on the logits, as Megatron-Core's
  // --cross-entropy-loss-fusion and ptdp run do: no fp32 softmax kept beside the 16-bit logits.
  // Unfused, Megatron upcasts the logits and keeps their fp32 softmax for the backward pass.
  bool cross_entropy_fusion = false;
  // The attention's head width, Megatron's --kv-channels (Hugging Face head_dim; 0:
  // hidden_size / num_attention_heads). Qwen3 and Mistral-Nemo set it apart from the hidden
  // size: the queries are num_attention_heads x kv_channels wide, and so is the projection's
  // input. --qk-layernorm (Qwen3, OLMo 2): a norm of each head's query and key over its
  // kv_channels, after the QKV projection and before the rotary embedding, one weight (and
  // bias, for LayerNorm models) of kv_channels for all queries and one for all keys.
  int64_t kv_channels = 0;
  bool qk_layernorm = false;
  // --add-qkv-bias (Qwen2, Qwen2.5): biases on the QKV projection of a gated (otherwise bias-free)
  // model; GPT-style models have them anyway.
  bool add_qkv_bias = false;
  // Multi-head latent attention (DeepSeek-V2/V3; Megatron-Core's --multi-latent-attention and
  // its widths, with Megatron's defaults). Each head's query and key are qk_head_dim channels
  // without position plus qk_pos_emb_head_dim rotated ones, its value v_head_dim. The queries
  // come from the hidden state through a q_lora_rank latent (--q-lora-rank; 0: one projection,
  // linear_q_proj), the keys and values from a kv_lora_rank latent (--kv-lora-rank) beside one
  // rotated key of qk_pos_emb_head_dim shared by every head. With qk_layernorm each latent is
  // normalised before its up projection, as Megatron-Core's MLA layer spec does with
  // --qk-layernorm (DeepSeek's q_a_layernorm and kv_a_layernorm); without it there are no latent
  // norms. The down projections and the latents' norms are whole on every tensor-parallel rank;
  // the up projections are column-parallel and the output projection row-parallel. Modelled as
  // DeepSeek's: gated MLP, RMSNorm, no biases, rotary positions, no grouped queries.
  bool multi_latent_attention = false;
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 32;
  int64_t qk_head_dim = 128;
  int64_t qk_pos_emb_head_dim = 64;
  int64_t v_head_dim = 128;

  // Multi-token prediction (DeepSeek-V3; Megatron-Core's --mtp-num-layers and
  // --mtp-loss-scaling-factor): after the decoder, mtp_num_layers modules in a row on the last
  // pipeline stage, each predicting one token further: the token embedding of the next input
  // (the model's word embedding) and the previous module's output, each normalised,
  // concatenated and projected from 2h to h (eh_proj, column-parallel), one transformer layer
  // built as the decoder's last (an MoE layer if that is), a final norm, and the shared output
  // layer's logits and loss, weighted mtp_loss_scaling_factor / mtp_num_layers. Priced by
  // plan, predict and simulate; ptdp run trains the model without them (and says so).
  int64_t mtp_num_layers = 0;
  double mtp_loss_scaling_factor = 0.1;

  // Mixture of experts, in Megatron-Core's terms; num_experts 0 is a dense model.
  //   num_experts           --num-experts (routed experts per MoE layer)
  //   moe_router_topk       --moe-router-topk (experts each token is routed to)
  //   moe_ffn_hidden_size   --moe-ffn-hidden-size (one routed expert's FFN width; 0: ffn_hidden)
  //   moe_shared_expert_ffn_size  --moe-shared-expert-intermediate-size (all shared experts
  //                         together, run on every token; 0: none)
  //   moe_layer_freq        --moe-layer-freq N: layer i (from 0) is an MoE layer when i % N == 0
  //   moe_first_dense_layers  the first K layers stay dense (DeepSeek's first_k_dense_replace;
  //                         Megatron states it as a --moe-layer-freq pattern)
  //   moe_capacity_factor   --moe-expert-capacity-factor (tokens an expert takes, as a multiple
  //                         of its fair share; 0: dropless)
  //   moe_drop_by_position  --moe-token-drop-policy position: an expert over its capacity keeps
  //                         its first tokens in sequence order (default probs: the tokens of
  //                         highest routing probability)
  //   moe_expert_load       --moe-expert-load (ptdp's, not Megatron's): the busiest
  //                         expert-parallel rank's routed tokens over the mean that MoE layers
  //                         are priced at, as `ptdp reconcile` measures it (0: the assumed 1.1,
  //                         planner/cost_model.h)
  // Dense layers use ffn_hidden().
  int64_t num_experts = 0;
  int64_t moe_router_topk = 2;
  int64_t moe_ffn_hidden_size = 0;
  int64_t moe_shared_expert_ffn_size = 0;
  int64_t moe_layer_freq = 1;
  int64_t moe_first_dense_layers = 0;
  double moe_capacity_factor = 0;
  bool moe_drop_by_position = false;
  double moe_expert_load = 0;

  int64_t query_groups() const {
    return num_query_groups > 0 ? num_query_groups : num_attention_heads;
  }
  int64_t ffn_hidden() const { return ffn_hidden_size > 0 ? ffn_hidden_size : 4 * hidden_size; }
  int64_t max_positions() const {
    return max_position_embeddings > 0 ? max_position_embeddings : seq_length;
  }
  // A query's (and key's) channels per head: with MLA the unrotated and rotated parts together.
  int64_t head_dim() const {
    if (multi_latent_attention) return qk_head_dim + qk_pos_emb_head_dim;
    return kv_channels > 0 ? kv_channels : hidden_size / num_attention_heads;
  }
  int64_t value_dim() const { return multi_latent_attention ? v_head_dim : head_dim(); }
  int64_t query_width() const { return num_attention_heads * head_dim(); }     // Q
  int64_t context_width() const { return num_attention_heads * value_dim(); }  // the context
  // MLA's down projections' outputs: the query latent (0 without q_lora_rank) and the key-value
  // latent with the shared rotated key.
  int64_t q_latent_width() const { return multi_latent_attention ? q_lora_rank : 0; }
  int64_t kv_latent_width() const {
    return multi_latent_attention ? kv_lora_rank + qk_pos_emb_head_dim : 0;
  }
  bool has_qkv_bias() const { return !swiglu || add_qkv_bias; }
  bool is_moe() const { return num_experts > 0; }
  int64_t moe_ffn_hidden() const {
    return moe_ffn_hidden_size > 0 ? moe_ffn_hidden_size : ffn_hidden();
  }
  // Whether layer i (from 0) is an MoE layer, and how many of layers [first, first + count) are.
  bool is_moe_layer(int64_t i) const;
  int64_t moe_layers_in(int64_t first, int64_t count) const;
  int64_t num_moe_layers() const { return moe_layers_in(0, num_layers); }

  // Exact parameter counts (weights and biases, layernorms included). parameters_per_layer is a
  // dense layer's; an MoE layer has moe_layer_parameters, of which expert_parameters_per_layer
  // are its routed experts' (what expert parallelism shards; the router and shared experts are
  // dense parameters).
  double parameters_per_layer() const;
  double moe_layer_parameters() const;
  double expert_parameters_per_layer() const;
  double expert_parameters() const;  // all routed experts of all MoE layers
  // What every tensor-parallel rank holds whole of a layer: its two norms and, with biases, the
  // attention projection's and the (dense or shared-expert) FC2's bias, which row-parallel
  // layers add after their reduction; and an MoE layer's router.
  double replicated_parameters_per_layer(bool moe_layer = false) const;
  // One layer's parameters on a rank of t-way tensor parallelism, an MoE layer's routed experts
  // left out: the replicated ones above whole, the rest split t ways.
  double layer_parameters_per_rank(int64_t t, bool moe_layer = false) const;
  // One MoE layer's routed experts on a rank of ep-way expert and etp-way expert-tensor
  // parallelism: each local expert split etp ways but for its FC2 bias, which the row-parallel
  // FC2 adds whole after its reduction (runtime/moe_params.cc).
  double expert_parameters_per_rank(int64_t ep, int64_t etp) const;
  double position_embedding_parameters() const;  // learned positions (replicated), else 0
  double norm_parameters() const;     // one LayerNorm (weight and bias) or RMSNorm (weight)
  double qk_norm_parameters() const;  // --qk-layernorm's two norms of head_dim (else 0)
  // MLA's parameters whole on every tensor-parallel rank: the down projections and the
  // latents' norms (0 without MLA).
  double mla_replicated_parameters() const;
  double embedding_parameters() const;  // word (+ position) embeddings
  double output_parameters() const;     // untied LM head, 0 when tied
  double parameters() const;            // everything; final layernorm and MTP included
  // Multi-token prediction: whether its layers are MoE layers (built as the decoder's last
  // layer), one module's parameters (norms, eh_proj, its layer, final norm; the embedding and
  // output layer are the model's), and those on a rank of t-way tensor parallelism without the
  // routed experts (which expert_parameters_per_rank gives per MoE layer).
  bool mtp_layer_is_moe() const { return mtp_num_layers > 0 && is_moe_layer(num_layers - 1); }
  // Whether the last pipeline stage holds a copy of the word embedding whose gradients are
  // all-reduced with the first stage's: tied embeddings, or multi-token prediction's inputs.
  bool last_stage_shares_word_embedding() const {
    return !untie_embeddings_and_output_weights || mtp_num_layers > 0;
  }
  double mtp_module_parameters() const;
  double mtp_module_parameters_per_rank(int64_t t) const;

  // Throws InputError naming the field when a size is missing, zero or inconsistent.
  void validate() const;
};

// Reads ptdp's own JSON (keys as the struct fields) or a Hugging Face config.json
// (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
// vocab_size, max_position_embeddings, tie_word_embeddings, hidden_act, rope_theta; the MoE
// fields of Mixtral, Qwen-MoE and DeepSeek configs). Validates.
ModelSpec model_from_json(const nlohmann::json& j);
// Megatron-LM's --moe-layer-freq: an integer N (every N-th layer) or a layer pattern, as a list
// "[0,0,1,1,...]" or Megatron's expression "([0]*3+[1]*29)", one entry per layer. Sets
// moe_layer_freq and moe_first_dense_layers; throws InputError("--moe-layer-freq") for a
// pattern of the wrong length or one that is not "dense for the first K layers, then every
// N-th", the MoE layouts ptdp models.
void set_moe_layer_freq(ModelSpec& m, const std::string& value);
nlohmann::json to_json(const ModelSpec& m);

}  // namespace ptdp
