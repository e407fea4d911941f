// Tests for the model and plan inputs of mixture-of-experts and context parallelism (core/):
// parameter counts of MoE models against their published totals, the MoE fields of Hugging Face
// configs (Mixtral, Qwen-MoE, DeepSeek), which layers are MoE, and the plan rules and Megatron
// flags of context and expert parallelism.
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "core/layer_ops.h"
#include "core/model_spec.h"
#include "core/parallel_plan.h"
#include "core/plan_rules.h"
#include "core/presets.h"
#include "planner/cost_model.h"
#include "planner/search.h"
#include "planner/simulation_input.h"
#include "runtime/moe_layer.h"
#include "tests/support/input_error.h"

namespace ptdp {
namespace {

using nlohmann::json;
using test::error_of;
using test::field_of;
using test::message_of;

std::string example(const std::string& name) {
  return std::string(PTDP_SOURCE_DIR) + "/examples/models/" + name;
}

// Published totals: Mixtral 46.7B (Jiang et al. 2024, Sec. 2), Mixtral 8x22B 141B (Mistral AI),
// Qwen2-57B-A14B 57B (Qwen2 report, Table 1; the Hugging Face checkpoint holds 57.4B), DeepSeekMoE
// 16B 16.4B (Dai et al. 2024, Table 2), Qwen1.5-MoE-A2.7B 14.3B (its model card).
TEST(MoeModel, ParameterCountsMatchPublishedTotals) {
  EXPECT_NEAR(resolve_model("mixtral-8x7b").parameters() / 1e9, 46.7, 0.1);
  EXPECT_NEAR(resolve_model("mixtral-8x22b").parameters() / 1e9, 140.6, 0.5);  // "141B"
  EXPECT_NEAR(resolve_model("qwen2-57b-a14b").parameters() / 1e9, 57.4, 0.2);
  EXPECT_NEAR(resolve_model(example("deepseek-moe-16b.config.json")).parameters() / 1e9, 16.4, 0.1);
  EXPECT_NEAR(resolve_model(example("qwen1.5-moe-a2.7b.config.json")).parameters() / 1e9, 14.3,
              0.1);
  // A dense model's count is unchanged by the MoE fields it does not use.
  const ModelSpec dense = resolve_model("llama3-8b");
  EXPECT_EQ(dense.parameters(), dense.num_layers * dense.parameters_per_layer() +
                                    dense.embedding_parameters() + dense.output_parameters() +
                                    dense.hidden_size);
  EXPECT_EQ(dense.expert_parameters(), 0);
}

TEST(MoeModel, HuggingFaceMoeFields) {
  const ModelSpec ds = resolve_model(example("deepseek-moe-16b.config.json"));
  EXPECT_EQ(ds.num_experts, 64);
  EXPECT_EQ(ds.moe_router_topk, 6);
  EXPECT_EQ(ds.moe_ffn_hidden(), 1408);
  EXPECT_EQ(ds.moe_shared_expert_ffn_size, 2 * 1408);
  EXPECT_EQ(ds.moe_first_dense_layers, 1);
  EXPECT_EQ(ds.ffn_hidden(), 10944);
  EXPECT_FALSE(ds.is_moe_layer(0));
  EXPECT_TRUE(ds.is_moe_layer(1));
  EXPECT_EQ(ds.num_moe_layers(), 27);
  EXPECT_TRUE(ds.untie_embeddings_and_output_weights);
  EXPECT_FALSE(ds.learned_position_embeddings);

  const ModelSpec qw = resolve_model(example("qwen1.5-moe-a2.7b.config.json"));
  EXPECT_EQ(qw.num_experts, 60);
  EXPECT_EQ(qw.moe_router_topk, 4);
  EXPECT_EQ(qw.moe_shared_expert_ffn_size, 5632);
  EXPECT_EQ(qw.num_moe_layers(), 24);

  json mixtral = {{"model_type", "mixtral"},     {"num_hidden_layers", 32},
                  {"hidden_size", 4096},         {"num_attention_heads", 32},
                  {"num_key_value_heads", 8},    {"intermediate_size", 14336},
                  {"vocab_size", 32000},         {"max_position_embeddings", 32768},
                  {"hidden_act", "silu"},        {"rope_theta", 1e6},
                  {"num_local_experts", 8},      {"num_experts_per_tok", 2},
                  {"tie_word_embeddings", false}};
  const ModelSpec mx = model_from_json(mixtral);
  const ModelSpec preset = resolve_model("mixtral-8x7b");
  EXPECT_EQ(mx.parameters(), preset.parameters());
  EXPECT_EQ(mx.moe_ffn_hidden(), 14336);

  // Shapes ptdp does not model are refused, naming the field.
  json mla = mixtral;  // multi-head latent attention with grouped key-value heads
  mla["kv_lora_rank"] = 512;
  EXPECT_EQ(field_of([&] { model_from_json(mla); }), "num_key_value_heads");
  json step = mixtral;
  step["decoder_sparse_step"] = 2;
  EXPECT_EQ(field_of([&] { model_from_json(step); }), "decoder_sparse_step");
  json shared = mixtral;  // a product that would overflow is refused before it is formed
  shared["n_shared_experts"] = int64_t{1} << 40;
  shared["moe_intermediate_size"] = int64_t{1} << 40;
  EXPECT_EQ(field_of([&] { model_from_json(shared); }), "n_shared_experts");
  json topk = mixtral;
  topk["num_experts_per_tok"] = 9;
  EXPECT_EQ(field_of([&] { model_from_json(topk); }), "num_experts_per_tok");  // the config's key
}

TEST(MoeModel, WhichLayersAreMoe) {
  ModelSpec m = resolve_model("mixtral-8x7b");
  EXPECT_EQ(m.num_moe_layers(), 32);
  m.moe_layer_freq = 2;  // Megatron: layer i is MoE when i % 2 == 0
  EXPECT_TRUE(m.is_moe_layer(0));
  EXPECT_FALSE(m.is_moe_layer(1));
  EXPECT_EQ(m.num_moe_layers(), 16);
  m.moe_first_dense_layers = 3;
  EXPECT_EQ(m.num_moe_layers(), 14);  // 4, 6, ..., 30
  // moe_layers_in counts exactly what is_moe_layer says, for every range.
  for (int64_t first = 0; first < 32; ++first)
    for (int64_t count = 0; first + count <= 32; ++count) {
      int64_t n = 0;
      for (int64_t i = first; i < first + count; ++i) n += m.is_moe_layer(i);
      ASSERT_EQ(m.moe_layers_in(first, count), n) << first << " " << count;
    }
}

TEST(MoeModel, BadFieldsNameThemselves) {
  json j = to_json(resolve_model("mixtral-8x7b"));
  EXPECT_EQ(to_json(model_from_json(j)), j);  // round trip
  auto with = [&](const std::string& key, json value) {
    json k = j;
    k[key] = std::move(value);
    return field_of([&] { model_from_json(k); });
  };
  EXPECT_EQ(with("num_experts", -1), "num_experts");
  EXPECT_EQ(with("moe_router_topk", 0), "moe_router_topk");
  EXPECT_EQ(with("moe_ffn_hidden_size", -5), "moe_ffn_hidden_size");
  EXPECT_EQ(with("moe_first_dense_layers", 32), "moe_first_dense_layers");
  EXPECT_EQ(with("moe_layer_freq", 0), "moe_layer_freq");
  EXPECT_EQ(with("moe_capacity_factor", 0.5), "moe_capacity_factor");
  EXPECT_EQ(with("num_experts", int64_t{1} << 40), "num_experts");
  EXPECT_EQ(with("moe_expert_count", 8), "moe_expert_count");  // unknown MoE field
  EXPECT_EQ(with("moe_token_drop_policy", "random"), "moe_token_drop_policy");
  EXPECT_EQ(with("moe_expert_load", 0.9), "moe_expert_load");  // below the mean
  EXPECT_EQ(with("moe_expert_load", 2000), "moe_expert_load");
  // A measured load (ptdp reconcile) travels with the model, in its files and run traces.
  json loaded = j;
  loaded["moe_expert_load"] = 1.3;
  EXPECT_EQ(model_from_json(loaded).moe_expert_load, 1.3);
  EXPECT_EQ(to_json(model_from_json(loaded)), loaded);
  EXPECT_FALSE(j.contains("moe_expert_load"));  // not written when assumed
}

// --moe-token-drop-policy position was accepted and ignored (found by exploratory testing): it
// is now a model field that reaches the JSON, the printed Megatron flags and the runtime.
TEST(MoeModel, TokenDropPolicyIsKept) {
  ModelSpec m = resolve_model("mixtral-8x7b");
  m.moe_capacity_factor = 1.25;
  EXPECT_NE(ParallelPlan{}.megatron_flags(m).find("--moe-token-drop-policy probs"),
            std::string::npos);
  m.moe_drop_by_position = true;
  const json j = to_json(m);
  EXPECT_EQ(j.at("moe_token_drop_policy"), "position");
  EXPECT_TRUE(model_from_json(j).moe_drop_by_position);
  EXPECT_NE(ParallelPlan{}.megatron_flags(m).find("--moe-token-drop-policy position"),
            std::string::npos);
  EXPECT_TRUE(moe_dims(m, 1, 1, 0, 1, 0).drop_by_position);
}

TEST(ContextAndExpertParallel, PlanRulesNameTheFlag) {
  const ModelSpec moe = resolve_model("mixtral-8x7b");
  ParallelPlan p;
  p.tensor_parallel = 2;
  p.data_parallel = 4;
  p.global_batch_size = 64;
  p.expert_parallel = 4;
  EXPECT_EQ(field_of([&] { p.validate(moe); }), "--sequence-parallel");  // Megatron-Core's rule
  p.sequence_parallel = true;
  EXPECT_EQ(error_of([&] { p.validate(moe); }), "no error");
  EXPECT_EQ(p.num_gpus(), 8);
  EXPECT_EQ(p.expert_tp(), 2);
  EXPECT_EQ(p.expert_data_parallel(), 1);
  p.expert_parallel = 3;
  EXPECT_EQ(field_of([&] { p.validate(moe); }), "--expert-model-parallel-size");
  p.expert_parallel = 8;  // 2 * 8 does not divide the 8 ranks of a stage
  EXPECT_EQ(field_of([&] { p.validate(moe); }), "--expert-model-parallel-size");
  p.expert_tensor_parallel = 1;  // 1 * 8 does
  EXPECT_EQ(error_of([&] { p.validate(moe); }), "no error");
  EXPECT_EQ(p.expert_data_parallel(), 1);
  p.expert_tensor_parallel = 0;
  p.expert_parallel = 1;

  p.context_parallel = 2;
  EXPECT_EQ(p.num_gpus(), 16);
  EXPECT_EQ(error_of([&] { p.validate(moe); }), "no error");
  ModelSpec odd = moe;
  odd.seq_length = 32766;  // not a multiple of 2 * cp
  EXPECT_EQ(field_of([&] { p.validate(odd); }), "--context-parallel-size");
  p.context_parallel = 0;
  EXPECT_EQ(field_of([&] { p.validate(moe); }), "--context-parallel-size");
  p.context_parallel = 1;

  const ModelSpec dense = resolve_model("llama3-8b");
  p.expert_parallel = 2;
  EXPECT_EQ(field_of([&] { p.validate(dense); }), "--expert-model-parallel-size");
  p.expert_parallel = 1;
  p.expert_tensor_parallel = 1;
  EXPECT_EQ(field_of([&] { p.validate(dense); }), "--expert-tensor-parallel-size");
}

TEST(ContextAndExpertParallel, MegatronFlagsAndJson) {
  const ModelSpec moe = resolve_model("mixtral-8x7b");
  ParallelPlan p;
  p.tensor_parallel = 2;
  p.context_parallel = 2;
  p.data_parallel = 4;
  p.expert_parallel = 8;
  p.expert_tensor_parallel = 1;
  p.global_batch_size = 64;
  p.sequence_parallel = true;
  p.fp8 = true;
  p.validate(moe);
  const std::string f = p.megatron_flags(moe);
  for (const char* flag : {"--num-experts 8", "--moe-router-topk 2", "--context-parallel-size 2",
                           "--expert-model-parallel-size 8", "--expert-tensor-parallel-size 1",
                           "--moe-token-dispatcher-type alltoall", "--fp8-format hybrid"})
    EXPECT_NE(f.find(flag), std::string::npos) << flag << " in " << f;
  const ParallelPlan back = plan_from_json(to_json(p));
  EXPECT_EQ(to_json(back), to_json(p));

  ModelSpec ds = resolve_model(example("deepseek-moe-16b.config.json"));
  const std::string g = ParallelPlan{}.megatron_flags(ds);
  EXPECT_NE(g.find("--moe-layer-freq \"[0,1,1"), std::string::npos) << g;
  EXPECT_NE(g.find("--moe-shared-expert-intermediate-size 2816"), std::string::npos) << g;
}

// --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes A B (Megatron-Core's hierarchical
// context parallelism): A B must be cp, A must divide each tensor-parallel rank's heads and query
// groups (the all-to-all's share), and the sizes go only with a2a+p2p at cp > 1; the Megatron line
// and a plan file carry both sizes; natural_hierarchical_cp keeps the all-to-all inside a node.
TEST(ContextAndExpertParallel, HierarchicalContextParallelRulesFlagsAndJson) {
  const ModelSpec m = resolve_model("llama3-8b");  // 32 heads, 8 query groups
  ParallelPlan p;
  p.tensor_parallel = 2;
  p.context_parallel = 8;  // 4 query groups per rank: a2a refuses cp 8
  p.global_batch_size = 8;
  p.cp_comm = CpComm::kA2AP2P;
  EXPECT_EQ(field_of([&] { p.validate(m); }), "--hierarchical-context-parallel-sizes");
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kHierarchicalContext);
  p.hierarchical_cp = 3;  // does not divide 8
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kHierarchicalContext);
  p.hierarchical_cp = 8;  // the all-to-all over 8 ranks: 4 query groups per rank
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kContextDividesHeads);
  EXPECT_EQ(field_of([&] { p.validate(m); }), "--hierarchical-context-parallel-sizes");
  p.hierarchical_cp = 4;
  EXPECT_EQ(error_of([&] { p.validate(m); }), "no error");
  EXPECT_EQ(p.cp_a2a_size(), 4);
  EXPECT_EQ(p.cp_ring_size(), 2);
  EXPECT_NE(p.megatron_flags(m).find("--context-parallel-size 8 --cp-comm-type a2a+p2p "
                                     "--hierarchical-context-parallel-sizes 4 2"),
            std::string::npos)
      << p.megatron_flags(m);
  EXPECT_EQ(to_json(plan_from_json(to_json(p))), to_json(p));
  EXPECT_EQ(plan_from_json(to_json(p)).hierarchical_cp, 4);
  nlohmann::json j = to_json(p);
  j["hierarchical_context_parallel_sizes"] = {4, 4};  // 16, not cp
  EXPECT_EQ(field_of([&] { plan_from_json(j); }), "hierarchical_context_parallel_sizes");
  j["hierarchical_context_parallel_sizes"] = {8};
  EXPECT_EQ(field_of([&] { plan_from_json(j); }), "hierarchical_context_parallel_sizes");
  p.cp_comm = CpComm::kP2P;  // sizes without a2a+p2p
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kHierarchicalContext);
  p.hierarchical_cp = 0;
  EXPECT_EQ(p.cp_a2a_size(), 1);
  EXPECT_EQ(p.cp_ring_size(), 8);
  p.cp_comm = CpComm::kA2AP2P;
  // 8-GPU nodes: t 2 x A 4 fills one; 4-GPU nodes: A 2.
  EXPECT_EQ(natural_hierarchical_cp(m, p, 8), 4);
  EXPECT_EQ(natural_hierarchical_cp(m, p, 4), 2);
  EXPECT_EQ(natural_hierarchical_cp(m, p, 2), 0);  // no group of two fits beside t 2
  p.context_parallel = 2;                          // no size between 1 and cp
  EXPECT_EQ(natural_hierarchical_cp(m, p, 8), 0);
}

// --recompute-modules (Megatron-Core's): core_attn, mlp, moe_act, layernorm, shared_experts, moe
// with selective recomputation only (shared_experts with shared experts, moe in MoE models); the
// Megatron line names them when they are not the default, a plan file keeps them, and the modules
// ptdp does not model are refused by name. (moe_act: the routed experts' activation.)
TEST(ContextAndExpertParallel, RecomputeModulesRulesFlagsAndJson) {
  const ModelSpec m = resolve_model("llama3-8b");
  ParallelPlan p;
  p.tensor_parallel = 2;
  p.global_batch_size = 8;
  p.recompute_modules = kRecomputeCoreAttn | kRecomputeMlp;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kRecomputeModules);
  EXPECT_EQ(field_of([&] { p.validate(m); }), "--recompute-modules");
  p.recompute = Recompute::kSelective;
  EXPECT_EQ(error_of([&] { p.validate(m); }), "no error");
  EXPECT_NE(p.megatron_flags(m).find(
                "--recompute-granularity selective --recompute-modules core_attn mlp"),
            std::string::npos)
      << p.megatron_flags(m);
  EXPECT_EQ(recompute_label(p), "selective+mlp");
  EXPECT_EQ(to_json(plan_from_json(to_json(p))), to_json(p));
  EXPECT_EQ(plan_from_json(to_json(p)).recompute_modules, p.recompute_modules);
  p.recompute_modules = kRecomputeCoreAttn;  // the default: no flag
  EXPECT_EQ(p.megatron_flags(m).find("--recompute-modules"), std::string::npos);
  EXPECT_EQ(recompute_label(p), "selective");
  p.recompute_modules = 0;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kRecomputeModules);
  nlohmann::json j = to_json(p);
  j["recompute_modules"] = {"mla_upproj"};
  EXPECT_EQ(field_of([&] { plan_from_json(j); }), "recompute_modules");
  EXPECT_EQ(recompute_modules_from_strings({"mlp", "core_attn"}, "f"),
            kRecomputeCoreAttn | kRecomputeMlp);
  EXPECT_EQ(
      field_of([&] { recompute_modules_from_strings({"mla_upproj"}, "--recompute-modules"); }),
      "--recompute-modules");
  // mla_up_proj is a module of latent-attention models only.
  EXPECT_EQ(recompute_modules_from_strings({"mla_up_proj"}, "f"), kRecomputeMlaUpProj);
  p.recompute_modules = kRecomputeCoreAttn | kRecomputeMlaUpProj;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kRecomputeModules);
  EXPECT_NE(message_of([&] { p.validate(m); }).find("mla_up_proj needs multi-latent attention"),
            std::string::npos);
  p.recompute_modules = kRecomputeCoreAttn | kRecomputeMoeAct;
  EXPECT_EQ(recompute_label(p), "selective+moe_act");
  EXPECT_NE(p.megatron_flags(m).find("--recompute-modules core_attn moe_act"), std::string::npos);
  p.recompute_modules = kRecomputeMlp | kRecomputeMoeAct;
  EXPECT_EQ(recompute_label(p), "selective(mlp,moe_act)");
  EXPECT_EQ(to_json(plan_from_json(to_json(p))), to_json(p));
  // layernorm: both layernorms' outputs rerun (the spelling Megatron-Core's recipes use).
  EXPECT_EQ(recompute_modules_from_strings({"layernorm", "moe_act", "core_attn"}, "f"),
            kRecomputeCoreAttn | kRecomputeMoeAct | kRecomputeLayernorm);
  p.recompute_modules = kRecomputeCoreAttn | kRecomputeMoeAct | kRecomputeLayernorm;
  EXPECT_EQ(recompute_label(p), "selective+moe_act+layernorm");
  EXPECT_NE(p.megatron_flags(m).find("--recompute-modules core_attn moe_act layernorm"),
            std::string::npos);
  EXPECT_EQ(plan_from_json(to_json(p)).recompute_modules, p.recompute_modules);
  // shared_experts: an MoE model with shared experts only (Qwen2-57B-A14B's 20480-wide one).
  p.recompute_modules = kRecomputeCoreAttn | kRecomputeSharedExperts;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kRecomputeModules);
  EXPECT_NE(
      message_of([&] { p.validate(m); }).find("shared_experts needs an MoE model with shared"),
      std::string::npos);
  const ModelSpec qwen = resolve_model("qwen2-57b-a14b");
  p.sequence_parallel = true;  // MoE with t > 1
  EXPECT_EQ(error_of([&] { p.validate(qwen); }), "no error");
  EXPECT_EQ(recompute_label(p), "selective+shared_experts");
  EXPECT_NE(p.megatron_flags(qwen).find("--recompute-modules core_attn shared_experts"),
            std::string::npos);
  EXPECT_EQ(layer_recompute_modules(p.recompute_modules, true), kRecomputeCoreAttn | kRecomputeMlp);
  EXPECT_EQ(layer_recompute_modules(p.recompute_modules, false), kRecomputeCoreAttn);
  // moe: the whole MoE layer, shared experts included; MoE models only, not with the combined
  // 1F1B.
  p.recompute_modules = kRecomputeCoreAttn | kRecomputeMoe;
  EXPECT_NE(message_of([&] { p.validate(m); }).find("moe needs an MoE model"), std::string::npos);
  EXPECT_EQ(error_of([&] { p.validate(qwen); }), "no error");
  EXPECT_EQ(recompute_label(p), "selective+moe");
  EXPECT_NE(p.megatron_flags(qwen).find("--recompute-modules core_attn moe"), std::string::npos);
  EXPECT_EQ(layer_recompute_modules(p.recompute_modules | kRecomputeMoeAct, true),
            kRecomputeCoreAttn | kRecomputeMoe | kRecomputeMlp);
  p.expert_parallel = 2;
  p.data_parallel = 2;
  p.overlap_moe_ep_comm = true;
  EXPECT_NE(message_of([&] { p.validate(qwen); }).find("moe does not run with --overlap-moe"),
            std::string::npos);
}

// --cp-comm-type: a2a needs cp to divide each tensor-parallel rank's heads and query groups
// (Transformer Engine's assertions); the Megatron line names a type other than the ring, and a
// plan file keeps it.
TEST(ContextAndExpertParallel, CpCommTypeRulesFlagsAndJson) {
  const ModelSpec m = resolve_model("llama3-8b");  // 32 heads, 8 query groups
  ParallelPlan p;
  p.tensor_parallel = 2;
  p.context_parallel = 4;
  p.global_batch_size = 8;
  p.cp_comm = CpComm::kA2A;
  EXPECT_EQ(error_of([&] { p.validate(m); }), "no error");  // 16 heads, 4 groups per rank
  EXPECT_NE(p.megatron_flags(m).find("--context-parallel-size 4 --cp-comm-type a2a"),
            std::string::npos);
  EXPECT_EQ(to_json(plan_from_json(to_json(p))), to_json(p));
  EXPECT_EQ(plan_from_json(to_json(p)).cp_comm, CpComm::kA2A);
  p.context_parallel = 8;  // 4 query groups per rank
  EXPECT_EQ(field_of([&] { p.validate(m); }), "--cp-comm-type");
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kContextDividesHeads);
  p.cp_comm = CpComm::kAllGather;
  EXPECT_EQ(error_of([&] { p.validate(m); }), "no error");
  EXPECT_NE(p.megatron_flags(m).find("--cp-comm-type all_gather"), std::string::npos);
  EXPECT_EQ(cp_comm_from_string("allgather"), CpComm::kAllGather);  // Megatron-LM's --help
  p.cp_comm = CpComm::kP2P;                                         // Megatron's default: no flag
  EXPECT_EQ(p.megatron_flags(m).find("--cp-comm-type"), std::string::npos);
  nlohmann::json j = to_json(p);
  j["cp_comm_type"] = "ring";
  EXPECT_EQ(field_of([&] { plan_from_json(j); }), "cp_comm_type");
}

// Multi-token prediction (--mtp-num-layers): one module of DeepSeek-V2-Lite's shape on its last
// pipeline stage. Only that stage changes: its parameters by the module's (its MoE layer's
// routed experts among the expert parameters) and a copy of the untied word embedding, its
// passes and its memory; the model FLOPs by one MoE layer's and the module's embedding lookup,
// projection, head and loss, as the op lists count them.
TEST(MultiTokenPrediction, PricedOnTheLastStageOnly) {
  ModelSpec without = resolve_model("deepseek-v2-lite");
  ModelSpec with = without;
  with.mtp_num_layers = 1;
  ASSERT_NO_THROW(with.validate());
  ASSERT_TRUE(with.mtp_layer_is_moe());
  ClusterSpec cluster = resolve_cluster("dgx-h100");
  cluster.resize(48);
  const HardwareProfile profile = resolve_profile("h100-sxm");
  ParallelPlan p;
  p.tensor_parallel = 2;
  p.pipeline_parallel = 3;
  p.data_parallel = 8;
  p.expert_parallel = 8;
  p.expert_tensor_parallel = 1;
  p.sequence_parallel = true;
  p.distributed_optimizer = true;
  p.global_batch_size = 256;
  // The last stage the most loaded (1F1B's first stage holds three microbatches): the peak is
  // its memory.
  p.layers_per_chunk = {4, 4, 19};
  ASSERT_NO_THROW(p.validate(with));
  const CostModel a(without, cluster, profile), b(with, cluster, profile);
  for (int64_t r = 0; r < 2; ++r) {
    EXPECT_EQ(b.parameters_on_stage(p, r), a.parameters_on_stage(p, r)) << r;
    EXPECT_EQ(b.chunk_time(p, r, 0).forward.total(), a.chunk_time(p, r, 0).forward.total()) << r;
  }
  const double module = with.mtp_module_parameters_per_rank(2) +
                        with.expert_parameters_per_rank(8, 1) +
                        static_cast<double>(with.vocab_size * with.hidden_size) / 2;
  EXPECT_DOUBLE_EQ(b.parameters_on_stage(p, 2) - a.parameters_on_stage(p, 2), module);
  EXPECT_DOUBLE_EQ(b.expert_parameters_on_stage(p, 2) - a.expert_parameters_on_stage(p, 2),
                   with.expert_parameters_per_rank(8, 1));
  EXPECT_GT(b.chunk_time(p, 2, 0).forward.total(), a.chunk_time(p, 2, 0).forward.total());
  EXPECT_GT(b.chunk_time(p, 2, 0).backward.total(), a.chunk_time(p, 2, 0).backward.total());
  const Prediction pa = a.predict(p), pb = b.predict(p);
  EXPECT_GT(pb.iteration_time_s, pa.iteration_time_s);
  EXPECT_GT(pb.memory.peak, pa.memory.peak);
  // The untied embedding's copy is all-reduced with the first stage's, as a tied one is.
  EXPECT_EQ(a.embedding_sync_time(p), 0.0);
  EXPECT_GT(b.embedding_sync_time(p), 0.0);
  // Model FLOPs: one more MoE layer, and the module's embedding, projection and head.
  ModelSpec deeper = without;
  deeper.num_layers += 1;  // the added last layer is an MoE layer
  ASSERT_TRUE(deeper.is_moe_layer(deeper.num_layers - 1));
  const CostModel c(deeper, cluster, profile);
  LayerShape shape = b.priced_layer_shape(p);
  double module_flops = 0;
  for (const PassOps& ops :
       {embedding_ops(with, shape), mtp_projection_ops(with, shape), lm_head_ops(with, shape)})
    for (const auto* list : {&ops.forward, &ops.backward})
      for (const Op& op : *list) module_flops += op.flops();
  const double replicas =
      static_cast<double>(p.tensor_parallel * p.num_microbatches() * p.data_parallel);
  ParallelPlan q = p;
  q.layers_per_chunk = {4, 4, 20};  // the deeper model's 28 layers
  EXPECT_NEAR(pb.model_flops - pa.model_flops,
              c.predict(q).model_flops - pa.model_flops + module_flops * replicas,
              1e-9 * pb.model_flops);
  // Simulated, the last stage's module costs time too.
  EXPECT_GT(simulate_plan(b, p).iteration, simulate_plan(a, p).iteration);
}

// Under Megatron-Core's combined 1F1B a stage's all-to-alls hide behind its kernels: the stage
// that sets the pace is the one slowest with what stays exposed, so a heavier last stage (its
// MTP module and head) cannot make the step shorter (it did when the stage was picked by its
// passes' sum before the overlap).
TEST(MultiTokenPrediction, AHeavierLastStageNeverShortensTheCombinedStep) {
  // DeepSeek-V3 as Megatron-Bridge's recipe lays it out: the last rank holds 6 layers against 8
  // elsewhere, and the MTP module and both heads besides.
  ModelSpec with = resolve_model("deepseek-v3");
  with.moe_expert_load = 1;  // force-balanced, as the recipe measured it
  ModelSpec without = with;
  without.mtp_num_layers = 0;
  ClusterSpec cluster = resolve_cluster("dgx-h100");
  cluster.resize(1024);
  const HardwareProfile profile = resolve_profile("h100-sxm");
  ParallelPlan p;
  p.tensor_parallel = 2;
  p.pipeline_parallel = 8;
  p.data_parallel = 64;
  p.expert_parallel = 64;
  p.expert_tensor_parallel = 1;
  p.sequence_parallel = true;
  p.distributed_optimizer = true;
  p.global_batch_size = 8192;
  const PipelineLayout layout = parse_pipeline_layout("Et|(tt|)*30mL", 8);
  p.layers_per_chunk = layout.layers_per_chunk;
  p.virtual_stages = layout.virtual_stages;
  p.schedule = Schedule::kInterleaved1F1B;
  p.overlap_moe_ep_comm = true;
  ASSERT_NO_THROW(p.validate(with));
  const double a = CostModel(without, cluster, profile).predict(p).iteration_time_s;
  const double b = CostModel(with, cluster, profile).predict(p).iteration_time_s;
  EXPECT_GT(b, a);
}

// The flags: Megatron-LM's line carries --mtp-num-layers (and a layout its 'm'); bad values are
// refused naming the flag, as are layouts that place other than the model's modules.
TEST(MultiTokenPrediction, FlagsAndRules) {
  ModelSpec m = resolve_model("deepseek-v2-lite");
  m.mtp_num_layers = 2;
  m.mtp_loss_scaling_factor = 0.3;
  ParallelPlan p;
  p.pipeline_parallel = 2;
  p.virtual_stages = 2;
  p.schedule = Schedule::kInterleaved1F1B;
  p.global_batch_size = 4;
  p.layers_per_chunk = {6, 7, 7, 7};
  ASSERT_NO_THROW(p.validate(m));
  const std::string flags = p.megatron_flags(m);
  EXPECT_NE(flags.find("--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3"), std::string::npos)
      << flags;
  EXPECT_NE(flags.find("--pipeline-model-parallel-layout \"Et*6|(t*7|)*2t*7mmL\""),
            std::string::npos)
      << flags;
  EXPECT_EQ(model_from_json(to_json(m)).mtp_num_layers, 2);
  EXPECT_EQ(model_from_json(to_json(m)).mtp_loss_scaling_factor, 0.3);
  ModelSpec bad = m;
  bad.mtp_num_layers = -1;
  EXPECT_EQ(field_of([&] { bad.validate(); }), "mtp_num_layers");
  bad = resolve_model("gpt-1.7b");  // learned positions
  bad.mtp_num_layers = 1;
  EXPECT_EQ(message_of([&] { bad.validate(); }),
            "mtp_num_layers: multi-token prediction needs rotary (or no) position embeddings, as "
            "in Megatron-Core");
  bad = m;
  bad.mtp_loss_scaling_factor = -1;
  EXPECT_EQ(field_of([&] { bad.validate(); }), "mtp_loss_scaling_factor");
}

}  // namespace
}  // namespace ptdp
