#include "cli/job_flags.h"

#include <CLI/CLI.hpp>
#include <exception>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/presets.h"

namespace ptdp {
namespace {

// Runs f, re-labelling an InputError about `what` (model, cluster, profile) with the flag
// that named it, so the user sees "--model: ..." for "--model FILE".
template <class F>
auto for_flag(const std::string& flag, const std::string& what, F f) {
  try {
    return f();
  } catch (const InputError& e) {
    if (e.field() == what) throw InputError(flag, std::string(e.what()).substr(what.size() + 2));
    throw InputError(flag, e.what());
  }
}

}  // namespace

void JobFlags::add_to(CLI::App& app, bool plan_flags_required) {
  add_model_flags(app);
  add_cluster_flags(app);
  add_parallel_flags(app, plan_flags_required, true);
  app.add_flag("--json", json, "machine-readable output");
}

void JobFlags::add_model_flags(CLI::App& app) {
  app.add_option("--model", model, "model preset, ptdp model JSON or Hugging Face config.json");
  app.add_option("--num-layers", num_layers);
  app.add_option("--hidden-size", hidden_size);
  app.add_option("--num-attention-heads", num_attention_heads);
  app.add_option("--num-query-groups", num_query_groups);
  app.add_option("--ffn-hidden-size", ffn_hidden_size);
  app.add_option("--seq-length", seq_length);
  app.add_option("--max-position-embeddings", max_position_embeddings,
                 "rows of the learned position table (default and minimum: --seq-length)");
  app.add_option("--vocab-size", vocab_size);
  app.add_option("--kv-channels", kv_channels,
                 "the attention's head width (default: --hidden-size / --num-attention-heads)");
  app.add_flag("--qk-layernorm", qk_layernorm,
               "normalise each head's query and key (Qwen3's q_norm and k_norm; with MLA its "
               "latents, DeepSeek's q_a_layernorm and kv_a_layernorm)");
  app.add_flag("--add-qkv-bias", add_qkv_bias,
               "biases on the QKV projection of a gated model (Qwen2's)");
  app.add_flag("--multi-latent-attention", multi_latent_attention,
               "DeepSeek-V2/V3's multi-head latent attention (widths below, Megatron's defaults)");
  app.add_option("--q-lora-rank", q_lora_rank, "MLA: the query latent's width (default: none)");
  app.add_option("--kv-lora-rank", kv_lora_rank, "MLA: the key-value latent's width (32)");
  app.add_option("--qk-head-dim", qk_head_dim, "MLA: a head's unrotated query/key channels (128)");
  app.add_option("--qk-pos-emb-head-dim", qk_pos_emb_head_dim,
                 "MLA: a head's rotated query/key channels (64)");
  app.add_option("--v-head-dim", v_head_dim, "MLA: a head's value channels (128)");
  app.add_option("--mtp-num-layers", mtp_num_layers,
                 "multi-token prediction modules after the decoder (DeepSeek-V3: 1; priced, not "
                 "run by ptdp run)");
  app.add_option("--mtp-loss-scaling-factor", mtp_loss_scaling_factor,
                 "weight of the multi-token prediction losses (0.1)");
  app.add_flag("--group-query-attention", group_query_attention,
               "grouped-query attention with --num-query-groups groups (Megatron's default: 1)");
  app.add_flag("--swiglu", swiglu);
  app.add_flag("--disable-bias-linear", disable_bias_linear,
               "no biases on linear layers (ptdp: as every --swiglu model)");
  app.add_option("--normalization", normalization,
                 "LayerNorm or RMSNorm (ptdp: RMSNorm exactly for --swiglu models)");
  app.add_flag("--untie-embeddings-and-output-weights", untie);
  app.add_option("--position-embedding-type", position_embedding_type, "learned_absolute or rope");
  app.add_option("--rotary-base", rotary_base, "rotary embedding base (Hugging Face rope_theta)");
  app.add_option(
      "--attention-dropout", attention_dropout,
      "dropout on attention probabilities (default: the model's; presets 0.1 GPT, 0 Llama)");
  app.add_option("--hidden-dropout", hidden_dropout,
                 "dropout after attention and MLP (default: the model's)");
  app.add_flag("--use-flash-attn", flash_attention,
               "flash attention: no s x s attention scores kept for the backward pass");
  app.add_flag("--cross-entropy-loss-fusion", cross_entropy_fusion,
               "the loss computed in place on the 16-bit logits, no fp32 softmax kept (ptdp run "
               "always runs it so)");
  app.add_option("--num-experts", num_experts, "routed experts per MoE layer (0: dense)");
  app.add_option("--moe-router-topk", moe_router_topk, "experts each token is routed to");
  app.add_option("--moe-ffn-hidden-size", moe_ffn_hidden_size, "one routed expert's FFN width");
  app.add_option("--moe-shared-expert-intermediate-size", moe_shared_expert_ffn_size,
                 "FFN width of the shared experts together");
  app.add_option("--moe-layer-freq", moe_layer_freq,
                 "every N-th layer is an MoE layer, or a pattern like \"([0]*3+[1]*29)\"");
  app.add_option("--moe-expert-capacity-factor", moe_capacity_factor,
                 "expert capacity as a multiple of the fair share (default: dropless)");
  app.add_option("--moe-expert-load", moe_expert_load,
                 "ptdp's: the busiest expert-parallel rank's routed tokens over the mean to price "
                 "MoE layers at, as ptdp reconcile measures it (default: 1.1)");
  app.add_option("--moe-token-dispatcher-type", moe_token_dispatcher_type,
                 "alltoall (what ptdp prices and runs)");
  app.add_option("--moe-token-drop-policy", moe_token_drop_policy,
                 "probs or position: which tokens past an expert's capacity drop");
  app.add_flag("--moe-grouped-gemm", moe_grouped_gemm,
               "a rank's experts as one grouped GEMM (how ptdp prices them)");
}

void JobFlags::add_cluster_flags(CLI::App& app) {
  app.add_option("--cluster", cluster, "cluster preset or JSON file")->capture_default_str();
  app.add_option("--profile", profile, "hardware profile preset or JSON (default: by GPU)");
  app.add_option("--gemm-from", gemm_from,
                 "a machine file (ptdp calibrate): its measured GEMM table and curve replace the "
                 "profile's, the rest of the profile kept");
  app.add_option("--num-gpus", num_gpus, "GPUs to use (whole nodes)");
}

void JobFlags::add_parallel_flags(CLI::App& app, bool plan_flags_required, bool batch_required) {
  auto* batch = app.add_option("--global-batch-size", global_batch_size);
  if (batch_required) batch->required();
  auto* t = app.add_option("--tensor-model-parallel-size", tensor_parallel);
  auto* p = app.add_option("--pipeline-model-parallel-size", pipeline_parallel);
  auto* b = app.add_option("--micro-batch-size", micro_batch_size);
  if (plan_flags_required) {
    t->required();
    p->required();
    b->required();
  }
  app.add_option("--context-parallel-size", context_parallel,
                 "ranks the sequence is split over (context parallelism)");
  app.add_option("--cp-comm-type", cp_comm_type,
                 "p2p (ring, Megatron's default), all_gather, a2a (Ulysses) or a2a+p2p "
                 "(hierarchical): how context-parallel attention meets the other ranks' keys "
                 "(ptdp plan: only this one)");
  app.add_option("--hierarchical-context-parallel-sizes", hierarchical_cp_sizes,
                 "A B with --cp-comm-type a2a+p2p: all-to-alls within groups of A adjacent "
                 "context-parallel ranks, a ring over the B groups (A B = cp; ptdp plan: "
                 "default, the largest A within a node)")
      ->expected(2);
  app.add_option("--expert-model-parallel-size", expert_parallel,
                 "ranks an MoE layer's experts are split over");
  app.add_option("--expert-tensor-parallel-size", expert_tensor_parallel,
                 "ranks each expert's weights are split over (default: t)");
  app.add_option("--fp8-format", fp8_format, "hybrid or e4m3: FP8 GEMMs (priced; not run)");
  app.add_option("--fp8-recipe", fp8_recipe,
                 "delayed (Megatron-LM's default) or tensorwise: FP8 scaling (priced alike)");
  app.add_option("--num-layers-per-virtual-pipeline-stage", layers_per_virtual_stage);
  app.add_option("--num-virtual-stages-per-pipeline-rank", virtual_stages_per_rank,
                 "model chunks per pipeline rank (interleaving; also with uneven stages)");
  app.add_option("--microbatch-group-size-per-virtual-pipeline-stage", microbatch_group,
                 "interleaving: microbatches each model chunk runs in a row (default: p; a larger "
                 "group runs microbatch counts p does not divide; ptdp plan picks the smallest "
                 "that works)");
  app.add_option("--pipeline-model-parallel-layout", pipeline_layout,
                 "every model chunk's layers, as Megatron-Core writes them: stages split by |, t "
                 "a transformer layer, E the embedding (first), L the loss (last), (...)*n and "
                 "t*n repeat; p * v stages (it sets v), e.g. \"Et|(tt|)*6L\" at p = 4");
  app.add_option("--decoder-first-pipeline-num-layers", first_stage_layers,
                 "layers on the first pipeline stage (the others share the rest evenly)");
  app.add_option("--decoder-last-pipeline-num-layers", last_stage_layers,
                 "layers on the last pipeline stage (the others share the rest evenly)");
  app.add_flag("--account-for-embedding-in-pipeline-split", account_for_embedding,
               "the embedding counts as a layer of the first pipeline stage (one decoder layer "
               "fewer there)");
  app.add_flag("--account-for-loss-in-pipeline-split", account_for_loss,
               "the loss counts as a layer of the last pipeline stage (one decoder layer fewer "
               "there)");
  app.add_option("--recompute-granularity", recompute_granularity,
                 "full or selective (default: none)");
  app.add_option("--recompute-method", recompute_method,
                 "with --recompute-granularity full: uniform (every layer) or block (the first "
                 "--recompute-num-layers of each model chunk)");
  app.add_option("--recompute-num-layers", recompute_num_layers,
                 "uniform: layers per checkpoint (1); block: layers recomputed per model chunk");
  app.add_option("--recompute-modules", recompute_modules,
                 "with --recompute-granularity selective: core_attn (the default), mlp (the "
                 "dense MLP from its input), moe_act (the experts' activation), layernorm (the "
                 "QKV and MLP inputs from the residual stream), shared_experts, moe (the whole "
                 "MoE layer), mla_up_proj (MLA's up projections and rotary embedding); ptdp "
                 "plan: the "
                 "modules its selective plans recompute");
  app.add_flag("--sequence-parallel", sequence_parallel);
  app.add_flag("--use-distributed-optimizer", distributed_optimizer);
  app.add_flag("--overlap-grad-reduce", overlap_grad_reduce);
  app.add_option("--num-distributed-optimizer-instances", optimizer_instances,
                 "the distributed optimizer in K instances of d * cp / K ranks each (shard "
                 "within, all-reduce across; default 1); ptdp plan: K, or auto (one instance per "
                 "node's part of the data-parallel group)");
  app.add_flag("--use-megatron-fsdp", use_megatron_fsdp,
               "Megatron-FSDP data parallelism (p = 1; ptdp plan: also tries optim_grads and "
               "optim_grads_params, or the --data-parallel-sharding-strategy given)");
  app.add_option("--data-parallel-sharding-strategy", dp_sharding_strategy,
                 "with --use-megatron-fsdp: no_shard (Megatron's default), optim (ZeRO-1), "
                 "optim_grads (ZeRO-2) or optim_grads_params (ZeRO-3)");
  app.add_option("--outer-dp-sharding-strategy", outer_dp_sharding_strategy,
                 "with --use-megatron-fsdp and --num-distributed-optimizer-instances K > 1 (HSDP): "
                 "no_shard (Megatron's default) or optim (the optimizer states also sharded "
                 "across the instances; needs optim_grads_params)");
  app.add_option("--megatron-fsdp-main-grads-dtype", fsdp_main_grads_dtype,
                 "fp32 (ptdp's default) or bf16, fp16, auto (16-bit gradients; Megatron-FSDP's "
                 "default is auto)");
  app.add_option("--ckpt-format", ckpt_format,
                 "Megatron's checkpoint format (fsdp_dtensor with --use-megatron-fsdp); accepted, "
                 "changes nothing priced");
  app.add_flag("--overlap-param-gather", overlap_param_gather,
               "hide the distributed optimizer's parameter all-gather behind the next forward");
  app.add_flag(
      "--tp-comm-overlap", tp_comm_overlap,
      "overlap sequence-parallel collectives with their GEMMs (needs --sequence-parallel)");
  app.add_flag("--overlap-moe-expert-parallel-comm", overlap_moe_ep_comm,
               "combined 1F1B: each steady-state forward runs with a backward of another "
               "microbatch, hiding each one's expert all-to-alls (ep > 1; interleaved, or p = 1; "
               "16-bit; ptdp plan: tried where a plan allows it)");
  app.add_flag("--bf16", bf16, "bf16 weights and activations (fp32 master weights and gradients)");
  app.add_flag("--fp16", fp16,
               "fp16 weights and activations (fp32 master weights and gradients; loss scaling)");
  app.add_flag("--accumulate-allreduce-grads-in-fp32", accumulate_allreduce_grads_in_fp32,
               "keep and reduce gradients in fp32 (the default)");
  app.add_flag("--fp16-grad-reduce", fp16_grad_reduce,
               "keep and reduce gradients in 16 bits (SC'21 fp16 runs) instead of fp32");
  app.add_flag("--no-overlap-p2p-communication", no_overlap_p2p,
               "do not overlap the interleaved schedule's pipeline transfers with compute");
  app.add_flag("--no-scatter-gather", no_scatter_gather,
               "disable SC'21's scatter/gather optimisation of pipeline transfers");
  app.add_flag("--no-gradient-accumulation-fusion", no_grad_accumulation_fusion,
               "accumulate weight gradients in a separate pass (Megatron-LM before 2022)");
  app.add_option("--pipeline-schedule", pipeline_schedule,
                 "gpipe, 1f1b, interleaved or zb-h1 (zero bubble); interleaved needs v > 1, the "
                 "others v = 1 (ptdp plan: only this schedule is searched)");
}

namespace {

struct GivenFlag {
  const char* flag;
  bool given;
};

// The first of `flags` that was given ("" when none).
std::string first_given(std::initializer_list<GivenFlag> flags) {
  for (const GivenFlag& f : flags)
    if (f.given) return f.flag;
  return "";
}

// A model flag, the ModelSpec field it sets ("" for none of its own), and whether it was given.
struct ModelFlag {
  const char* flag;
  const char* field;
  bool given;
};

std::vector<ModelFlag> model_flags(const JobFlags& j) {
  return {
      {"--model", "", !j.model.empty()},
      {"--num-layers", "num_layers", j.num_layers.has_value()},
      {"--hidden-size", "hidden_size", j.hidden_size.has_value()},
      {"--num-attention-heads", "num_attention_heads", j.num_attention_heads.has_value()},
      {"--num-query-groups", "num_query_groups", j.num_query_groups.has_value()},
      {"--ffn-hidden-size", "ffn_hidden_size", j.ffn_hidden_size.has_value()},
      {"--seq-length", "seq_length", j.seq_length.has_value()},
      {"--max-position-embeddings", "max_position_embeddings",
       j.max_position_embeddings.has_value()},
      {"--vocab-size", "vocab_size", j.vocab_size.has_value()},
      {"--kv-channels", "kv_channels", j.kv_channels.has_value()},
      {"--qk-layernorm", "qk_layernorm", j.qk_layernorm},
      {"--add-qkv-bias", "add_qkv_bias", j.add_qkv_bias},
      {"--multi-latent-attention", "multi_latent_attention", j.multi_latent_attention},
      {"--q-lora-rank", "q_lora_rank", j.q_lora_rank.has_value()},
      {"--kv-lora-rank", "kv_lora_rank", j.kv_lora_rank.has_value()},
      {"--qk-head-dim", "qk_head_dim", j.qk_head_dim.has_value()},
      {"--qk-pos-emb-head-dim", "qk_pos_emb_head_dim", j.qk_pos_emb_head_dim.has_value()},
      {"--v-head-dim", "v_head_dim", j.v_head_dim.has_value()},
      {"--mtp-num-layers", "mtp_num_layers", j.mtp_num_layers.has_value()},
      {"--mtp-loss-scaling-factor", "mtp_loss_scaling_factor",
       j.mtp_loss_scaling_factor.has_value()},
      {"--swiglu", "", j.swiglu},
      {"--untie-embeddings-and-output-weights", "", j.untie},
      {"--group-query-attention", "", j.group_query_attention},
      {"--disable-bias-linear", "", j.disable_bias_linear},
      {"--normalization", "", !j.normalization.empty()},
      {"--position-embedding-type", "learned_position_embeddings",
       !j.position_embedding_type.empty()},
      {"--rotary-base", "rotary_base", j.rotary_base.has_value()},
      {"--attention-dropout", "attention_dropout", j.attention_dropout.has_value()},
      {"--hidden-dropout", "hidden_dropout", j.hidden_dropout.has_value()},
      {"--use-flash-attn", "", j.flash_attention},
      {"--cross-entropy-loss-fusion", "", j.cross_entropy_fusion},
      {"--num-experts", "num_experts", j.num_experts.has_value()},
      {"--moe-router-topk", "moe_router_topk", j.moe_router_topk.has_value()},
      {"--moe-ffn-hidden-size", "moe_ffn_hidden_size", j.moe_ffn_hidden_size.has_value()},
      {"--moe-shared-expert-intermediate-size", "moe_shared_expert_ffn_size",
       j.moe_shared_expert_ffn_size.has_value()},
      {"--moe-layer-freq", "moe_layer_freq", !j.moe_layer_freq.empty()},
      {"--moe-expert-capacity-factor", "moe_capacity_factor", j.moe_capacity_factor.has_value()},
      {"--moe-expert-load", "moe_expert_load", j.moe_expert_load.has_value()},
      {"--moe-token-dispatcher-type", "", !j.moe_token_dispatcher_type.empty()},
      {"--moe-token-drop-policy", "moe_token_drop_policy", !j.moe_token_drop_policy.empty()},
      {"--moe-grouped-gemm", "", j.moe_grouped_gemm},
  };
}

}  // namespace

std::string JobFlags::first_model_flag() const {
  for (const ModelFlag& f : model_flags(*this))
    if (f.given) return f.flag;
  return "";
}

std::string JobFlags::first_plan_setting_flag() const {
  return first_given({
      {"--recompute-granularity", !recompute_granularity.empty()},
      {"--recompute-method", !recompute_method.empty()},
      {"--recompute-num-layers", recompute_num_layers.has_value()},
      {"--recompute-modules", !recompute_modules.empty()},
      {"--sequence-parallel", sequence_parallel},
      {"--use-distributed-optimizer", distributed_optimizer},
      {"--overlap-grad-reduce", overlap_grad_reduce},
      {"--num-distributed-optimizer-instances", !optimizer_instances.empty()},
      {"--overlap-param-gather", overlap_param_gather},
      {"--tp-comm-overlap", tp_comm_overlap},
      {"--overlap-moe-expert-parallel-comm", overlap_moe_ep_comm},
      {"--accumulate-allreduce-grads-in-fp32", accumulate_allreduce_grads_in_fp32},
      {"--fp16-grad-reduce", fp16_grad_reduce},
      {"--use-megatron-fsdp", use_megatron_fsdp},
      {"--data-parallel-sharding-strategy", !dp_sharding_strategy.empty()},
      {"--outer-dp-sharding-strategy", !outer_dp_sharding_strategy.empty()},
      {"--megatron-fsdp-main-grads-dtype", !fsdp_main_grads_dtype.empty()},
      {"--no-scatter-gather", no_scatter_gather},
      {"--no-gradient-accumulation-fusion", no_grad_accumulation_fusion},
      {"--no-overlap-p2p-communication", no_overlap_p2p},
      {"--pipeline-schedule", !pipeline_schedule.empty()},
      {"--fp8-format", !fp8_format.empty()},
      {"--fp8-recipe", !fp8_recipe.empty()},
      {"--cp-comm-type", !cp_comm_type.empty()},
      {"--hierarchical-context-parallel-sizes", !hierarchical_cp_sizes.empty()},
  });
}

ModelSpec JobFlags::resolve_model() const {
  ModelSpec m;
  if (!model.empty()) {
    m = for_flag("--model", "model", [&] { return ptdp::resolve_model(model); });
  } else if (!num_layers && !hidden_size) {
    throw InputError("--model", "give a preset, a file, or the Megatron-LM model flags");
  } else {
    m.name = "custom";
  }
  auto set = [](int64_t& field, const std::optional<int64_t>& v) {
    if (v) field = *v;
  };
  set(m.num_layers, num_layers);
  set(m.hidden_size, hidden_size);
  set(m.num_attention_heads, num_attention_heads);
  set(m.num_query_groups, num_query_groups);
  set(m.ffn_hidden_size, ffn_hidden_size);
  set(m.seq_length, seq_length);
  set(m.max_position_embeddings, max_position_embeddings);
  set(m.vocab_size, vocab_size);
  set(m.kv_channels, kv_channels);
  if (qk_layernorm) m.qk_layernorm = true;
  if (multi_latent_attention) m.multi_latent_attention = true;
  if (add_qkv_bias) m.add_qkv_bias = true;
  for (const auto& [flag, given] : {std::pair{"--q-lora-rank", q_lora_rank.has_value()},
                                    {"--kv-lora-rank", kv_lora_rank.has_value()},
                                    {"--qk-head-dim", qk_head_dim.has_value()},
                                    {"--qk-pos-emb-head-dim", qk_pos_emb_head_dim.has_value()},
                                    {"--v-head-dim", v_head_dim.has_value()}})
    if (given && !m.multi_latent_attention)
      throw InputError(flag, "needs --multi-latent-attention");
  set(m.q_lora_rank, q_lora_rank);
  set(m.kv_lora_rank, kv_lora_rank);
  set(m.qk_head_dim, qk_head_dim);
  set(m.qk_pos_emb_head_dim, qk_pos_emb_head_dim);
  set(m.v_head_dim, v_head_dim);
  set(m.mtp_num_layers, mtp_num_layers);
  if (mtp_loss_scaling_factor) m.mtp_loss_scaling_factor = *mtp_loss_scaling_factor;
  if (mtp_loss_scaling_factor && m.mtp_num_layers == 0)
    throw InputError("--mtp-loss-scaling-factor", "needs --mtp-num-layers");
  if (swiglu) m.swiglu = true;
  if (ffn_hidden_size && *ffn_hidden_size <= 0)
    throw InputError("--ffn-hidden-size",
                     "must be positive, got " + std::to_string(*ffn_hidden_size));
  // Megatron-LM's default FFN width for a gated MLP given by flags without --ffn-hidden-size
  // (megatron/training/arguments.py): 2/3 of 4 h, down to a multiple of 64, so that the two
  // input projections hold about the parameters of one 4 h projection.
  if (model.empty() && m.swiglu && !ffn_hidden_size && m.hidden_size > 0)
    m.ffn_hidden_size = 4 * m.hidden_size * 2 / 3 / 64 * 64;
  if (untie) m.untie_embeddings_and_output_weights = true;
  if (position_embedding_type == "rope")
    m.learned_position_embeddings = false;
  else if (position_embedding_type == "learned_absolute")
    m.learned_position_embeddings = true;
  else if (!position_embedding_type.empty())
    throw InputError("--position-embedding-type",
                     "must be learned_absolute or rope, got '" + position_embedding_type + "'");
  if (rotary_base) m.rotary_base = *rotary_base;
  if (attention_dropout) m.attention_dropout = *attention_dropout;
  if (hidden_dropout) m.hidden_dropout = *hidden_dropout;
  if (flash_attention) m.flash_attention = true;
  if (cross_entropy_fusion) m.cross_entropy_fusion = true;
  set(m.num_experts, num_experts);
  set(m.moe_router_topk, moe_router_topk);
  set(m.moe_ffn_hidden_size, moe_ffn_hidden_size);
  set(m.moe_shared_expert_ffn_size, moe_shared_expert_ffn_size);
  if (!moe_layer_freq.empty()) set_moe_layer_freq(m, moe_layer_freq);
  if (moe_capacity_factor) m.moe_capacity_factor = *moe_capacity_factor;
  if (moe_expert_load) m.moe_expert_load = *moe_expert_load;
  if (!moe_token_drop_policy.empty()) m.moe_drop_by_position = moe_token_drop_policy == "position";
  apply_megatron_model_flags(m);
  try {
    m.validate();
  } catch (const InputError& e) {
    // Name the flag the user typed rather than the JSON field: the field's flag where one was
    // given, or, for a model made of flags alone, its flag whether given or defaulted.
    std::string flag = "--" + e.field();
    for (char& ch : flag) ch = ch == '_' ? '-' : ch;
    bool from_flag = false;
    for (const ModelFlag& f : model_flags(*this)) {
      if (e.field() != f.field) continue;
      flag = f.flag;
      from_flag = f.given;
    }
    if (model.empty() || from_flag)
      throw InputError(flag, std::string(e.what()).substr(e.field().size() + 2));
    // A field of the --model that a given flag conflicts with (--model llama3-8b
    // --num-attention-heads 4: 8 query groups do not divide 4 heads): name that flag.
    const std::string problem = std::string(e.what()).substr(e.field().size() + 2);
    for (const ModelFlag& f : model_flags(*this))
      if (f.given && *f.field && find_identifier(problem, f.field) != std::string::npos)
        throw InputError(f.flag, "conflicts with --model " + model + ": " + e.what());
    throw InputError("--model", e.what());
  }
  return m;
}

void JobFlags::apply_megatron_model_flags(ModelSpec& m) const {
  // Megatron reads --num-query-groups (default 1) only with --group-query-attention.
  if (group_query_attention && !num_query_groups && m.query_groups() == m.num_attention_heads)
    m.num_query_groups = 1;
  if (disable_bias_linear && !m.swiglu)
    throw InputError("--disable-bias-linear",
                     "ptdp's GPT-style models (no --swiglu) keep their linear biases; gated "
                     "(--swiglu) models have none");
  if (!normalization.empty()) {
    if (normalization != "LayerNorm" && normalization != "RMSNorm")
      throw InputError("--normalization",
                       "must be LayerNorm or RMSNorm, got '" + normalization + "'");
    if ((normalization == "RMSNorm") != m.swiglu)
      throw InputError("--normalization",
                       "ptdp's models use RMSNorm exactly when gated (--swiglu), LayerNorm "
                       "otherwise; this model wants " +
                           std::string(m.swiglu ? "RMSNorm" : "LayerNorm"));
  }
  if (!moe_token_dispatcher_type.empty() && moe_token_dispatcher_type != "alltoall")
    throw InputError("--moe-token-dispatcher-type",
                     "ptdp prices and runs the alltoall dispatcher only, got '" +
                         moe_token_dispatcher_type + "'");
  if (!moe_token_drop_policy.empty() && moe_token_drop_policy != "probs" &&
      moe_token_drop_policy != "position")
    throw InputError("--moe-token-drop-policy",
                     "must be probs or position, got '" + moe_token_drop_policy + "'");
}

void JobFlags::check_recompute_method(Recompute r) const {
  if (recompute_num_layers && recompute_method.empty())
    throw InputError("--recompute-num-layers", "needs --recompute-method uniform");
  if (recompute_method.empty()) return;
  if (r != Recompute::kFull)
    throw InputError("--recompute-method", "goes with --recompute-granularity full");
  if (recompute_method == "block") {
    if (!recompute_num_layers || *recompute_num_layers < 1)
      throw InputError("--recompute-num-layers",
                       "block recompute needs the number of layers of each model chunk to "
                       "recompute (at least 1)");
    return;
  }
  if (recompute_method != "uniform")
    throw InputError("--recompute-method",
                     "must be uniform or block, got '" + recompute_method + "'");
  if (recompute_num_layers && *recompute_num_layers != 1)
    throw InputError("--recompute-num-layers",
                     "uniform recompute with more than one layer per checkpoint is not "
                     "modelled: give 1 (each layer its own checkpoint), got " +
                         std::to_string(*recompute_num_layers));
}

ClusterSpec JobFlags::resolve_cluster() const {
  ClusterSpec c = for_flag("--cluster", "cluster", [&] { return ptdp::resolve_cluster(cluster); });
  if (num_gpus) for_flag("--num-gpus", "num_gpus", [&] { c.resize(*num_gpus); });
  c.validate();
  return c;
}

HardwareProfile JobFlags::resolve_profile(const ClusterSpec& c) const {
  if (bf16 && fp16) throw InputError("--fp16", "conflicts with --bf16");
  HardwareProfile p = profile.empty() ? default_profile_for(c)
                                      : for_flag("--profile", "profile",
                                                 [&] { return ptdp::resolve_profile(profile); });
  if (bf16) p.activation_dtype = DType::kBF16;
  if (fp16) p.activation_dtype = DType::kF16;
  // Megatron-Core combines passes only in 16-bit training (TransformerConfig's check).
  if (overlap_moe_ep_comm && p.activation_dtype == DType::kF32)
    throw InputError("--overlap-moe-expert-parallel-comm",
                     "needs 16-bit training (--bf16 or --fp16; the profile prices fp32)");
  if (!gemm_from.empty()) {
    // cuBLAS GEMMs are what ptdp run and Megatron-LM share, so a measured GEMM table carries
    // over to a job whose other kernels (attention, fused elementwise) are not ptdp's own. Its
    // efficiencies are relative to the measured device's peak: rescaled to this cluster's.
    const auto [measured, device] = for_flag("--gemm-from", "machine file", [&] {
      return std::make_pair(ptdp::resolve_profile(gemm_from), ptdp::resolve_cluster(gemm_from));
    });
    if (measured.gemm_table.empty())
      throw InputError("--gemm-from", "'" + gemm_from + "' holds no measured GEMM table");
    const double scale = device.gpu.peak_tflops_16bit / c.gpu.peak_tflops_16bit;
    p.gemm = measured.gemm;
    p.gemm.max_efficiency *= scale;
    p.gemm_table = measured.gemm_table;
    for (GemmMeasurement& g : p.gemm_table) g.efficiency *= scale;
    p.sources.push_back("GEMMs measured: " + gemm_from);
  }
  return p;
}

ParallelPlan JobFlags::resolve_plan(const ModelSpec& m, const ClusterSpec& c) const {
  ParallelPlan p = resolve_plan(m, c.num_gpus(), "--num-gpus");
  // What plan, predict and simulate print must be a line Megatron-LM takes, which asserts
  // (megatron/training/arguments.py) that --overlap-param-gather comes with
  // --overlap-grad-reduce, and that the interleaved schedule without its p2p overlap runs on
  // more than two pipeline ranks. (ptdp run runs either: its overlaps are separate settings,
  // and its schedule does not overlap the pipeline transfers.)
  if (overlap_param_gather && !overlap_grad_reduce)
    throw InputError("--overlap-param-gather",
                     "needs --overlap-grad-reduce (Megatron-LM asserts it)");
  if (no_overlap_p2p && p.virtual_stages > 1 && p.pipeline_parallel == 2)
    throw InputError("--no-overlap-p2p-communication",
                     "the interleaved schedule without its p2p overlap needs "
                     "pipeline-model-parallel-size > 2 (Megatron-LM asserts it)");
  return p;
}

void JobFlags::apply_megatron_fsdp_flags(ParallelPlan& p) const {
  const char* strategy_flag = "--data-parallel-sharding-strategy";
  if (!ckpt_format.empty() && ckpt_format != "torch" && ckpt_format != "torch_dist" &&
      ckpt_format != "zarr" && ckpt_format != "fsdp_dtensor")
    throw InputError("--ckpt-format",
                     "must be torch, torch_dist, zarr or fsdp_dtensor, got '" + ckpt_format + "'");
  if (!use_megatron_fsdp) {
    if (!dp_sharding_strategy.empty() && dp_sharding_strategy != "no_shard")
      throw InputError(strategy_flag, "needs --use-megatron-fsdp");
    if (!fsdp_main_grads_dtype.empty())
      throw InputError("--megatron-fsdp-main-grads-dtype", "needs --use-megatron-fsdp");
    if (!outer_dp_sharding_strategy.empty() && outer_dp_sharding_strategy != "no_shard")
      throw InputError("--outer-dp-sharding-strategy", "needs --use-megatron-fsdp");
    return;
  }
  if (!outer_dp_sharding_strategy.empty()) {
    if (outer_dp_sharding_strategy != "no_shard" && outer_dp_sharding_strategy != "optim")
      throw InputError("--outer-dp-sharding-strategy",
                       "must be no_shard or optim, got '" + outer_dp_sharding_strategy + "'");
    p.fsdp_outer = fsdp_sharding_from_string(outer_dp_sharding_strategy);
  }
  if (!ckpt_format.empty() && ckpt_format != "fsdp_dtensor")
    throw InputError("--ckpt-format",
                     "must be fsdp_dtensor with --use-megatron-fsdp (Megatron-LM's "
                     "rule), got '" +
                         ckpt_format + "'");
  p.fsdp = dp_sharding_strategy.empty() ? FsdpSharding::kNoShard
                                        : fsdp_sharding_from_string(dp_sharding_strategy);
  if (p.fsdp == FsdpSharding::kNoShard && overlap_param_gather)
    throw InputError("--overlap-param-gather",
                     "has no sharded weights to gather with --data-parallel-sharding-strategy "
                     "no_shard (Megatron-FSDP's default): give optim, optim_grads or "
                     "optim_grads_params");
  // Megatron-FSDP turns the distributed optimizer on; only the strategies from optim on shard
  // its states (no_shard keeps them whole, as DDP does).
  p.distributed_optimizer = p.fsdp >= FsdpSharding::kOptim;
  if (!fsdp_main_grads_dtype.empty()) {
    const std::string& d = fsdp_main_grads_dtype;
    if (d != "fp32" && d != "bf16" && d != "fp16" && d != "auto")
      throw InputError("--megatron-fsdp-main-grads-dtype",
                       "must be fp32, bf16, fp16 or auto, got '" + d + "'");
    if (d == "fp32" && fp16_grad_reduce)
      throw InputError("--megatron-fsdp-main-grads-dtype",
                       "fp32 conflicts with --fp16-grad-reduce");
    p.fp32_grad_reduce = d == "fp32";
  }
}

ParallelPlan JobFlags::resolve_plan(const ModelSpec& m, int64_t num_gpus,
                                    const std::string& what) const {
  ParallelPlan p;
  p.global_batch_size = global_batch_size.value_or(0);
  if (p.global_batch_size <= 0) {
    throw InputError("--global-batch-size",
                     "must be positive, got " + std::to_string(p.global_batch_size));
  }
  p.tensor_parallel = tensor_parallel.value_or(1);
  p.pipeline_parallel = pipeline_parallel.value_or(1);
  p.micro_batch_size = micro_batch_size.value_or(1);
  if (p.tensor_parallel <= 0) throw InputError("--tensor-model-parallel-size", "must be positive");
  if (p.pipeline_parallel <= 0)
    throw InputError("--pipeline-model-parallel-size", "must be positive");
  if (p.micro_batch_size <= 0) throw InputError("--micro-batch-size", "must be positive");
  p.context_parallel = context_parallel.value_or(1);
  p.expert_parallel = expert_parallel.value_or(1);
  p.expert_tensor_parallel = expert_tensor_parallel.value_or(0);
  if (p.context_parallel <= 0) throw InputError("--context-parallel-size", "must be positive");
  if (!cp_comm_type.empty()) p.cp_comm = cp_comm_from_string(cp_comm_type);
  if (!hierarchical_cp_sizes.empty()) {
    const char* flag = "--hierarchical-context-parallel-sizes";
    const int64_t a = hierarchical_cp_sizes.front(), b = hierarchical_cp_sizes.back();
    if (hierarchical_cp_sizes.size() != 2 || a <= 0 || b <= 0 || a > kMaxGpus || b > kMaxGpus)
      throw InputError(flag, "must be two positive sizes A B (the all-to-all's and the ring's)");
    if (!context_parallel) p.context_parallel = a * b;
    if (a * b != p.context_parallel)
      throw InputError(flag, std::to_string(a) + " x " + std::to_string(b) +
                                 " is not the context-parallel size (" +
                                 std::to_string(p.context_parallel) + ")");
    p.hierarchical_cp = a;
  }
  if (p.expert_parallel <= 0) throw InputError("--expert-model-parallel-size", "must be positive");
  if (expert_tensor_parallel && p.expert_tensor_parallel <= 0)
    throw InputError("--expert-tensor-parallel-size", "must be positive");
  if (p.tensor_parallel > kMaxGpus || p.pipeline_parallel > kMaxGpus ||
      p.context_parallel > kMaxGpus)
    throw InputError(p.context_parallel > kMaxGpus  ? "--context-parallel-size"
                     : p.tensor_parallel > kMaxGpus ? "--tensor-model-parallel-size"
                                                    : "--pipeline-model-parallel-size",
                     "exceeds the " + std::to_string(kMaxGpus) + " GPUs ptdp handles");
  const int64_t tp = p.tensor_parallel * p.pipeline_parallel * p.context_parallel;
  if (num_gpus % tp != 0) {
    throw InputError(what, std::to_string(num_gpus) + (what == "--num-gpus" ? " GPUs" : " ranks") +
                               " are not a multiple of t * cp * p = " + std::to_string(tp));
  }
  p.data_parallel = num_gpus / tp;
  if (fp8_format == "hybrid" || fp8_format == "e4m3")
    p.fp8 = true;
  else if (!fp8_format.empty())
    throw InputError("--fp8-format", "must be hybrid or e4m3, got '" + fp8_format + "'");
  if (first_stage_layers && *first_stage_layers <= 0)
    throw InputError("--decoder-first-pipeline-num-layers", "must be positive");
  if (last_stage_layers && *last_stage_layers <= 0)
    throw InputError("--decoder-last-pipeline-num-layers", "must be positive");
  if (first_stage_layers || last_stage_layers)
    p.layers_per_stage =
        megatron_stage_split(m.num_layers, p.pipeline_parallel, first_stage_layers.value_or(0),
                             last_stage_layers.value_or(0));
  if (account_for_embedding || account_for_loss) {
    const char* flag = account_for_embedding ? "--account-for-embedding-in-pipeline-split"
                                             : "--account-for-loss-in-pipeline-split";
    if (first_stage_layers || last_stage_layers)
      throw InputError(flag, std::string("conflicts with ") +
                                 (first_stage_layers ? "--decoder-first-pipeline-num-layers"
                                                     : "--decoder-last-pipeline-num-layers") +
                                 ": give one way to split the layers");
    if (p.pipeline_parallel < 2) throw InputError(flag, "needs pipeline-model-parallel-size > 1");
    if (layers_per_virtual_stage)
      throw InputError(flag, "with interleaving give --num-virtual-stages-per-pipeline-rank");
    // Megatron-Core counts the embedding and the loss as layers of the first and the last model
    // chunk: every chunk holds the same share, those two one layer fewer.
    const int64_t v = std::max<int64_t>(1, virtual_stages_per_rank.value_or(1));
    const int64_t slots = m.num_layers + account_for_embedding + account_for_loss;
    const int64_t chunks = p.pipeline_parallel * v;
    if (slots % chunks != 0)
      throw InputError(flag, std::to_string(m.num_layers) + " layers and " +
                                 std::to_string(slots - m.num_layers) +
                                 " counted module(s) do not split evenly over " +
                                 std::to_string(chunks) +
                                 (v > 1 ? " model chunks" : " pipeline stages"));
    const int64_t per = slots / chunks;
    if (per - 1 < 1)
      throw InputError(flag, v > 1 ? "leaves a model chunk without layers"
                                   : "leaves a pipeline stage without layers");
    if (v > 1) {
      p.layers_per_chunk.assign(static_cast<size_t>(chunks), per);
      if (account_for_embedding) --p.layers_per_chunk.front();
      if (account_for_loss) --p.layers_per_chunk.back();
    } else {
      p.layers_per_stage =
          megatron_stage_split(m.num_layers, p.pipeline_parallel,
                               account_for_embedding ? per - 1 : 0, account_for_loss ? per - 1 : 0);
    }
  }
  if (!pipeline_layout.empty()) {
    const char* flag = "--pipeline-model-parallel-layout";
    const std::string other = first_stage_layers      ? "--decoder-first-pipeline-num-layers"
                              : last_stage_layers     ? "--decoder-last-pipeline-num-layers"
                              : account_for_embedding ? "--account-for-embedding-in-pipeline-split"
                              : account_for_loss      ? "--account-for-loss-in-pipeline-split"
                              : layers_per_virtual_stage ? "--num-layers-per-virtual-pipeline-stage"
                                                         : "";
    if (!other.empty())
      throw InputError(flag, "conflicts with " + other + ": the layout gives every stage's layers");
    const PipelineLayout layout = parse_pipeline_layout(pipeline_layout, p.pipeline_parallel);
    if (virtual_stages_per_rank && *virtual_stages_per_rank != layout.virtual_stages)
      throw InputError("--num-virtual-stages-per-pipeline-rank",
                       std::to_string(*virtual_stages_per_rank) + ", but the layout's " +
                           std::to_string(layout.layers_per_chunk.size()) + " stages make " +
                           std::to_string(layout.virtual_stages) + " per pipeline rank");
    if (layout.mtp_layers != m.mtp_num_layers)
      throw InputError(flag, "places " + std::to_string(layout.mtp_layers) +
                                 " multi-token prediction layer(s) (m), but the model has " +
                                 std::to_string(m.mtp_num_layers) + " (--mtp-num-layers)");
    p.layers_per_chunk = layout.layers_per_chunk;
    p.virtual_stages = layout.virtual_stages;
  }
  if (layers_per_virtual_stage && virtual_stages_per_rank)
    throw InputError("--num-virtual-stages-per-pipeline-rank",
                     "give it or --num-layers-per-virtual-pipeline-stage, not both");
  if (virtual_stages_per_rank) {
    if (*virtual_stages_per_rank <= 0)
      throw InputError("--num-virtual-stages-per-pipeline-rank", "must be positive");
    if (*virtual_stages_per_rank > 1 && p.pipeline_parallel < 2)  // named as given
      throw InputError("--num-virtual-stages-per-pipeline-rank",
                       "interleaving needs pipeline-model-parallel-size >= 2");
    p.virtual_stages = *virtual_stages_per_rank;  // each stage's layers: checked by validate
  } else if (layers_per_virtual_stage && !p.layers_per_stage.empty()) {
    throw InputError("--num-layers-per-virtual-pipeline-stage",
                     "with uneven stages give --num-virtual-stages-per-pipeline-rank instead");
  } else if (layers_per_virtual_stage) {
    const int64_t k = *layers_per_virtual_stage;
    if (k <= 0 || m.num_layers % (p.pipeline_parallel * k) != 0) {
      throw InputError("--num-layers-per-virtual-pipeline-stage",
                       std::to_string(k) + " does not divide the " +
                           std::to_string(m.num_layers / p.pipeline_parallel) +
                           " layers of a pipeline stage");
    }
    p.virtual_stages = m.num_layers / (p.pipeline_parallel * k);
  }
  if (microbatch_group) {
    if (*microbatch_group <= 0)
      throw InputError("--microbatch-group-size-per-virtual-pipeline-stage", "must be positive");
    // Against the microbatches: checked by validate. Megatron-Core's default (p) and a group
    // without virtual stages (unused there) are stored as not given, as the flags print them.
    if (p.virtual_stages > 1 && *microbatch_group != p.pipeline_parallel)
      p.microbatch_group = *microbatch_group;
  }
  p.schedule = p.virtual_stages > 1 ? Schedule::kInterleaved1F1B : Schedule::k1F1B;
  if (!pipeline_schedule.empty()) p.schedule = schedule_from_string(pipeline_schedule);
  if (!recompute_granularity.empty()) p.recompute = recompute_from_string(recompute_granularity);
  check_recompute_method(p.recompute);
  if (recompute_method == "block") p.recompute_layers = *recompute_num_layers;
  if (!recompute_modules.empty())
    p.recompute_modules = recompute_modules_from_strings(recompute_modules, "--recompute-modules");
  if (accumulate_allreduce_grads_in_fp32 && fp16_grad_reduce)
    throw InputError("--accumulate-allreduce-grads-in-fp32", "conflicts with --fp16-grad-reduce");
  p.sequence_parallel = sequence_parallel;
  p.distributed_optimizer = distributed_optimizer;
  if (!optimizer_instances.empty()) {
    const char* flag = "--num-distributed-optimizer-instances";
    if (optimizer_instances == "auto") throw InputError(flag, "auto is for ptdp plan; give K");
    size_t used = 0;
    try {
      p.optimizer_instances = std::stoll(optimizer_instances, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != optimizer_instances.size())
      throw InputError(flag, "must be a whole number, got '" + optimizer_instances + "'");
    if (p.optimizer_instances < 1) throw InputError(flag, "must be positive");
  }
  p.overlap_grad_reduce = overlap_grad_reduce;
  p.overlap_param_gather = overlap_param_gather;
  p.tp_comm_overlap = tp_comm_overlap;
  p.overlap_moe_ep_comm = overlap_moe_ep_comm;
  p.fp32_grad_reduce = !fp16_grad_reduce;
  apply_megatron_fsdp_flags(p);
  p.scatter_gather_p2p = !no_scatter_gather;
  p.overlap_p2p_comm = !no_overlap_p2p;
  p.gradient_accumulation_fusion = !no_grad_accumulation_fusion;
  if (!fp8_recipe.empty()) {
    const char* flag = "--fp8-recipe";
    if (fp8_recipe != "delayed" && fp8_recipe != "tensorwise")
      throw InputError(flag,
                       "must be delayed or tensorwise (the per-tensor scalings ptdp prices), "
                       "got '" +
                           fp8_recipe + "'");
    if (!p.fp8) throw InputError(flag, "needs --fp8-format");
    if (fp8_recipe == "delayed" && fp8_needs_current_scaling(p))
      throw InputError(flag,
                       "delayed scaling does not support moe_act and layernorm "
                       "recomputation (Megatron-Core refuses it); use tensorwise");
  }
  return p;
}

}  // namespace ptdp
