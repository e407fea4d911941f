// The flags that describe a training job, shared by plan, predict and (later) simulate and run:
// the model (--model preset/file plus Megatron-LM's model flags on top), the cluster
// (--cluster, --num-gpus, --profile) and the parallel configuration (Megatron-LM's flags).
#pragma once

#include <CLI/App.hpp>
#include <optional>
#include <string>

#include "core/cluster_spec.h"
#include "core/hardware_profile.h"
#include "core/model_spec.h"
#include "core/parallel_plan.h"

namespace ptdp {

struct JobFlags {
  std::string model;
  std::optional<int64_t> num_layers, hidden_size, num_attention_heads, num_query_groups,
      ffn_hidden_size, seq_length, max_position_embeddings, vocab_size, kv_channels;
  bool qk_layernorm = false;
  bool add_qkv_bias = false;
  // Multi-head latent attention (--multi-latent-attention and its widths).
  bool multi_latent_attention = false;
  std::optional<int64_t> q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim;
  std::optional<int64_t> mtp_num_layers;          // --mtp-num-layers
  std::optional<double> mtp_loss_scaling_factor;  // --mtp-loss-scaling-factor
  bool swiglu = false, untie = false;
  // Megatron flags that ptdp's models tie to others, accepted where they agree: grouped-query
  // attention (the groups from --num-query-groups), no linear biases and RMSNorm (both go with
  // --swiglu in ptdp's models).
  bool group_query_attention = false, disable_bias_linear = false;
  std::string normalization;            // LayerNorm or RMSNorm
  std::string position_embedding_type;  // learned_absolute or rope (Megatron's names)
  std::optional<double> rotary_base;
  std::optional<double> attention_dropout, hidden_dropout;
  bool flash_attention = false;
  bool cross_entropy_fusion = false;
  std::optional<int64_t> num_experts, moe_router_topk, moe_ffn_hidden_size,
      moe_shared_expert_ffn_size;
  std::string moe_layer_freq;  // N, or a layer pattern (core/model_spec.h set_moe_layer_freq)
  std::optional<double> moe_capacity_factor;
  std::optional<double> moe_expert_load;
  // Megatron-Core MoE settings that ptdp prices and runs one way: the all-to-all dispatcher,
  // grouped expert GEMMs; either drop policy (only with a capacity factor).
  std::string moe_token_dispatcher_type, moe_token_drop_policy;
  bool moe_grouped_gemm = false;
  std::string cluster = "dgx-a100-80gb";
  std::string profile;
  std::string gemm_from;  // a machine file whose measured GEMMs replace the profile's
  std::optional<int64_t> num_gpus;
  std::optional<int64_t> global_batch_size;
  std::optional<int64_t> tensor_parallel, pipeline_parallel, micro_batch_size,
      layers_per_virtual_stage, virtual_stages_per_rank, microbatch_group;
  std::optional<int64_t> context_parallel, expert_parallel, expert_tensor_parallel;
  std::string cp_comm_type;  // Megatron's --cp-comm-type (p2p, all_gather, a2a, a2a+p2p)
  std::vector<int64_t> hierarchical_cp_sizes;  // --hierarchical-context-parallel-sizes A B
  std::string fp8_format;  // Megatron's --fp8-format (hybrid or e4m3): priced, never run
  // Megatron's --fp8-recipe: delayed (its default) or tensorwise, priced alike. Megatron-Core
  // refuses delayed scaling with moe_act or layernorm recomputation.
  std::string fp8_recipe;
  // Megatron-Core's --pipeline-model-parallel-layout (core/parallel_plan.h
  // parse_pipeline_layout): every model chunk's layers, and v.
  std::string pipeline_layout;
  // Megatron's uneven pipeline split (core/parallel_plan.h megatron_stage_split).
  std::optional<int64_t> first_stage_layers, last_stage_layers;
  // Megatron-Core's --account-for-embedding-in-pipeline-split and
  // --account-for-loss-in-pipeline-split: the embedding (the loss) counts as one layer of the
  // first (last) pipeline stage, which then holds one decoder layer fewer. At v = 1 the split
  // --decoder-first/last-pipeline-num-layers give; with interleaving it leaves chunks of
  // unequal layers, which ptdp does not model (refused).
  bool account_for_embedding = false, account_for_loss = false;
  std::string recompute_granularity;
  // Megatron's --recompute-method and --recompute-num-layers for full recomputation: uniform
  // with one layer per checkpoint (every layer), or block N (the first N of each model chunk).
  std::string recompute_method;
  std::vector<std::string> recompute_modules;  // Megatron-Core's --recompute-modules
  std::optional<int64_t> recompute_num_layers;
  bool sequence_parallel = false, distributed_optimizer = false, overlap_grad_reduce = false;
  bool overlap_param_gather = false, tp_comm_overlap = false, overlap_moe_ep_comm = false;
  bool accumulate_allreduce_grads_in_fp32 = false;  // Megatron's; ptdp's default
  // Megatron-FSDP: --use-megatron-fsdp, --data-parallel-sharding-strategy (Megatron's default
  // no_shard), --megatron-fsdp-main-grads-dtype (fp32, or bf16/fp16/auto for 16-bit gradients:
  // ptdp's default is fp32, Megatron-FSDP's auto) and --ckpt-format (accepted: its value changes
  // nothing priced or run).
  bool use_megatron_fsdp = false;
  // --num-distributed-optimizer-instances: a number (Megatron's flag), or for ptdp plan "auto"
  // (each distributed-optimizer candidate also tried with one instance per node's share of its
  // data-parallel group).
  std::string optimizer_instances;
  // Megatron-FSDP's --outer-dp-sharding-strategy (no_shard or optim) across those instances.
  std::string outer_dp_sharding_strategy;
  std::string dp_sharding_strategy, fsdp_main_grads_dtype, ckpt_format;
  bool fp16_grad_reduce = false, no_scatter_gather = false, no_grad_accumulation_fusion = false;
  bool no_overlap_p2p = false;
  // Megatron's precision flags: weights and activations in bf16 or fp16 (fp32 master weights).
  // plan, predict and simulate price that precision in place of the profile's; ptdp run
  // trains in bf16 with --bf16 and in fp32 without.
  bool bf16 = false, fp16 = false;
  std::string pipeline_schedule;
  bool json = false;

  void add_to(CLI::App& app, bool plan_flags_required);
  // The pieces of add_to: model flags; --cluster, --profile, --num-gpus; the parallel
  // configuration and batch (add_parallel_flags(app, false, false) for ptdp run, whose
  // --plan file may give them instead).
  void add_model_flags(CLI::App& app);
  void add_cluster_flags(CLI::App& app);
  void add_parallel_flags(CLI::App& app, bool plan_flags_required, bool batch_required);

  ModelSpec resolve_model() const;
  ClusterSpec resolve_cluster() const;  // sized by --num-gpus
  HardwareProfile resolve_profile(const ClusterSpec& c) const;
  // Shared settings (precision, overlap, ...) and, where given, the parallel flags.
  ParallelPlan resolve_plan(const ModelSpec& m, const ClusterSpec& c) const;
  // The same for `num_gpus` ranks; `what` names the source of that count in errors.
  ParallelPlan resolve_plan(const ModelSpec& m, int64_t num_gpus, const std::string& what) const;
  // Throw InputError naming the flag when a Megatron flag above asks for what ptdp's models do
  // not have; apply_megatron_model_flags also sets --group-query-attention's default of one
  // group.
  void apply_megatron_model_flags(ModelSpec& m) const;
  void check_recompute_method(Recompute r) const;
  // Sets p's Megatron-FSDP strategy, optimizer sharding and gradient dtype from the flags above;
  // throws InputError naming the flag for a value Megatron does not take or a flag without
  // --use-megatron-fsdp.
  void apply_megatron_fsdp_flags(ParallelPlan& p) const;
  // The first model flag given ("" when none): a --plan file with a model gives them all.
  std::string first_model_flag() const;
  // The first flag given that sets the plan beyond its sizes (recompute, sequence parallelism,
  // the optimizer, overlaps, gradient reduction, schedule, FP8; "" when none): a --plan file
  // gives those too.
  std::string first_plan_setting_flag() const;
  bool has_parallel_flags() const {
    return tensor_parallel || pipeline_parallel || micro_batch_size || layers_per_virtual_stage ||
           !pipeline_layout.empty() || virtual_stages_per_rank || microbatch_group ||
           first_stage_layers || last_stage_layers || account_for_embedding || account_for_loss ||
           context_parallel || !hierarchical_cp_sizes.empty() || expert_parallel ||
           expert_tensor_parallel;
  }
};

}  // namespace ptdp
