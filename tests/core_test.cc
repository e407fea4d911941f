// Tests for core/: parameter counts against the papers, presets, JSON round trips, Hugging Face
// config.json parsing, ParallelPlan validation and Megatron flags, and that every kind of bad
// input throws an InputError naming the right field.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "core/cluster_spec.h"
#include "core/error.h"
#include "core/hardware_profile.h"
#include "core/model_spec.h"
#include "core/output_file.h"
#include "core/parallel_plan.h"
#include "core/plan_rules.h"
#include "core/presets.h"
#include "tests/support/input_error.h"

namespace ptdp {
namespace {

using nlohmann::json;
using test::error_of;
using test::field_of;
using test::message_of;

std::string write_temp(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "ptdp_core_test_" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

double eq2_parameters(const ModelSpec& m) {  // SC'21 eq. 2
  const double l = m.num_layers, h = m.hidden_size, V = m.vocab_size, s = m.seq_length;
  return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h));
}

json model_json() {
  return to_json(resolve_model("gpt3-175b"));
}

// ---- parameter counts ----

TEST(ModelSpec, Gpt3ParametersMatchEquation2) {
  const ModelSpec m = resolve_model("gpt3-175b");
  EXPECT_NEAR(m.parameters(), 174.6e9, 0.1e9);
  EXPECT_NEAR(m.parameters() / eq2_parameters(m), 1.0, 1e-3);
  const double h = m.hidden_size;
  EXPECT_EQ(m.parameters_per_layer(), 12 * h * h + 13 * h);
}

TEST(ModelSpec, LlamaParametersMatchPublishedCounts) {
  const struct {
    const char* name;
    double expected;
  } cases[] = {{"llama2-7b", 6.74e9},
               {"llama2-70b", 68.98e9},
               {"llama3-8b", 8.03e9},
               {"llama3-70b", 70.55e9},
               {"llama3-405b", 405.8e9}};
  for (const auto& c : cases) {
    const double p = resolve_model(c.name).parameters();
    EXPECT_NEAR(p / c.expected, 1.0, 0.005) << c.name << ": " << p;
  }
  // Exact counts of the Hugging Face checkpoints.
  EXPECT_EQ(resolve_model("llama2-7b").parameters(), 6738415616.0);
  EXPECT_EQ(resolve_model("llama3-8b").parameters(), 8030261248.0);
}

// Qwen3's model cards give the total and the non-embedding count (to the digits below); its
// heads are 128 wide whatever the hidden size (--kv-channels) and carry query and key norms.
TEST(ModelSpec, Qwen3ParametersMatchTheModelCards) {
  const struct {
    const char* name;
    double total, non_embedding, digits;  // billions, and the cards' rounding
  } cases[] = {{"qwen3-8b", 8.2, 6.95, 0.01},
               {"qwen3-30b-a3b", 30.5, 29.9, 0.1},
               {"qwen3-235b-a22b", 235, 234, 1}};
  for (const auto& c : cases) {
    const ModelSpec m = resolve_model(c.name);
    EXPECT_EQ(m.head_dim(), 128) << c.name;
    EXPECT_TRUE(m.qk_layernorm) << c.name;
    const double total = m.parameters() / 1e9;
    const double non_embedding =
        (m.parameters() - m.embedding_parameters() - m.output_parameters()) / 1e9;
    // Within half a unit of the last digit printed (the 8B total is printed to 0.1).
    EXPECT_NEAR(total, c.total, std::max(0.05, c.digits / 2)) << c.name;
    EXPECT_NEAR(non_embedding, c.non_embedding, c.digits / 2) << c.name;
  }
  // Without its 128-wide heads Qwen3-30B-A3B's attention would have half the query weights.
  ModelSpec narrow = resolve_model("qwen3-30b-a3b");
  const double wide = narrow.parameters_per_layer();
  narrow.kv_channels = 0;
  const double h = 2048, q = 32 * 128, kv = 4 * 128;
  EXPECT_EQ(wide - narrow.parameters_per_layer(),
            2 * h * (q - h) + 2 * h * (kv - 4 * 64) + 2 * (128 - 64));
}

// Qwen2.5's query, key and value projections carry biases (--add-qkv-bias) on an otherwise
// bias-free gated model. The 7B checkpoint holds 7,615,616,512 parameters (the card prints 7.61B,
// 6.53B without the embeddings); the 72B card prints 72.7B (its 70.0B non-embedding figure is not
// the total less the two 152064 x 8192 tables, 70.2B).
TEST(ModelSpec, Qwen25ParametersMatchTheModelCards) {
  const ModelSpec q7 = resolve_model("qwen2.5-7b");
  EXPECT_TRUE(q7.add_qkv_bias);
  EXPECT_EQ(q7.parameters(), 7615616512.0);
  EXPECT_NEAR((q7.parameters() - q7.embedding_parameters() - q7.output_parameters()) / 1e9, 6.53,
              0.005);
  EXPECT_NEAR(resolve_model("qwen2.5-72b").parameters() / 1e9, 72.7, 0.05);
  // The biases: the query's and the key-value groups' widths per layer, split over the
  // tensor-parallel ranks with the projection.
  ModelSpec m = resolve_model("qwen2.5-7b");
  const double with = m.parameters_per_layer();
  m.add_qkv_bias = false;
  EXPECT_EQ(with - m.parameters_per_layer(), 3584 + 2 * 4 * 128);
  ParallelPlan p;
  p.tensor_parallel = 4;
  EXPECT_NE(p.megatron_flags(resolve_model("qwen2.5-7b")).find(" --add-qkv-bias"),
            std::string::npos);
  EXPECT_EQ(p.megatron_flags(m).find("--add-qkv-bias"), std::string::npos);
}

// DeepSeek's reports give the total and the activated count (a token's routed experts and
// everything else but the word embedding, a lookup); multi-head latent attention replaces QKV
// with latent projections.
TEST(ModelSpec, DeepSeekParametersMatchTheReports) {
  const struct {
    const char* name;
    double total, activated;  // billions
  } cases[] = {{"deepseek-v3", 671, 37}, {"deepseek-v2-lite", 15.7, 2.4}};
  for (const auto& c : cases) {
    const ModelSpec m = resolve_model(c.name);
    ASSERT_TRUE(m.multi_latent_attention) << c.name;
    // The reports count the main model; DeepSeek-V3's multi-token prediction module is apart.
    const double main =
        m.parameters() - static_cast<double>(m.mtp_num_layers) * m.mtp_module_parameters();
    const double experts = m.expert_parameters();
    const double activated =
        main - m.embedding_parameters() - experts +
        experts * static_cast<double>(m.moe_router_topk) / static_cast<double>(m.num_experts);
    EXPECT_NEAR(main / 1e9, c.total, c.total < 100 ? 0.05 : 0.5) << c.name;
    // (V2-Lite's 2.4B reads 2.45B counted this way: the report's own convention differs by a
    // little more than its rounding.)
    EXPECT_NEAR(activated / 1e9, c.activated, c.activated < 10 ? 0.1 : 0.5) << c.name;
  }
  // DeepSeek-V3's one MTP module: an MoE layer (the last decoder layer's kind), eh_proj of 2h x h
  // and three norms. Hugging Face's 14B for it also holds copies of the embedding and the output
  // layer (2 x 129280 x 7168 = 1.85B), which Megatron-Core shares with the main model.
  const ModelSpec mtp = resolve_model("deepseek-v3");
  EXPECT_EQ(mtp.mtp_num_layers, 1);
  EXPECT_TRUE(mtp.mtp_layer_is_moe());
  EXPECT_EQ(mtp.mtp_module_parameters(), mtp.moe_layer_parameters() + 2.0 * 7168 * 7168 + 3 * 7168);
  EXPECT_NEAR((mtp.mtp_module_parameters() + 2.0 * 129280 * 7168) / 1e9, 14, 1);
  // DeepSeek-V3's attention, by hand: the query latent (7168 x 1536, its norm, 1536 x 128 x 192),
  // the key-value latent with the rotated key (7168 x 576, the norm of 512, 512 x 128 x 256) and
  // the projection (128 x 128 x 7168), beside the two layer norms.
  const ModelSpec v3 = resolve_model("deepseek-v3");
  const double h = 7168;
  const double attention =
      h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h + 2 * h;
  EXPECT_EQ(v3.parameters_per_layer(), attention + 3 * h * 18432);
  // On a tensor-parallel rank the down projections and the latents' norms stay whole.
  EXPECT_EQ(v3.layer_parameters_per_rank(8),
            (attention - (h * 1536 + 1536 + h * 576 + 512 + 2 * h)) / 8 +
                (h * 1536 + 1536 + h * 576 + 512 + 2 * h) + 3 * h * 18432 / 8);
}

// MLA's widths as ptdp runs them, refused by name otherwise.
TEST(ModelSpec, MultiLatentAttentionIsValidated) {
  const ModelSpec v3 = resolve_model("deepseek-v3");
  auto field = [](ModelSpec m) { return field_of([&] { m.validate(); }); };
  ModelSpec m = v3;
  m.v_head_dim = 256;  // wider than a query: the fused attention runs at the query width
  EXPECT_EQ(field(m), "v_head_dim");
  m = v3;
  m.qk_pos_emb_head_dim = 63;
  EXPECT_EQ(field(m), "qk_pos_emb_head_dim");
  m = v3;
  m.kv_lora_rank = 0;
  EXPECT_EQ(field(m), "kv_lora_rank");
  m = v3;
  m.num_query_groups = 8;
  EXPECT_EQ(field(m), "num_query_groups");
  m = v3;
  m.kv_channels = 128;
  EXPECT_EQ(field(m), "kv_channels");
  m = v3;
  m.swiglu = false;
  EXPECT_EQ(field(m), "swiglu");
  // The JSON form round-trips.
  EXPECT_EQ(model_from_json(to_json(v3)).parameters(), v3.parameters());
}

TEST(ModelSpec, Sc21Table1PresetsMatchThePaper) {
  const json v = read_json_file(
      std::string(PTDP_SOURCE_DIR) + "/tests/data/validation/megatron_sc21.json", "v");
  const char* names[] = {"gpt-1.7b",  "gpt-3.6b",   "gpt-7.5b",   "gpt-18.4b",  "gpt-39.1b",
                         "gpt-76.1b", "gpt-145.6b", "gpt-310.1b", "gpt-529.6b", "gpt-1t"};
  const json& rows = v["table1_weak_scaling"]["rows"];
  ASSERT_EQ(rows.size(), std::size(names));
  for (size_t i = 0; i < rows.size(); ++i) {
    const ModelSpec m = resolve_model(names[i]);
    EXPECT_EQ(m.num_attention_heads, rows[i][1].get<int64_t>()) << names[i];
    EXPECT_EQ(m.hidden_size, rows[i][2].get<int64_t>()) << names[i];
    EXPECT_EQ(m.num_layers, rows[i][3].get<int64_t>()) << names[i];
    // The table prints the count rounded to 0.1 billion.
    EXPECT_NEAR(m.parameters() / 1e9, rows[i][0].get<double>(), 0.05) << names[i];
    EXPECT_NEAR(m.parameters() / eq2_parameters(m), 1.0, 1e-3) << names[i];
  }
}

TEST(ModelSpec, GroupedQueryAttentionShrinksKeyValueWeights) {
  ModelSpec m = resolve_model("llama3-8b");
  const double gqa = m.parameters_per_layer();
  m.num_query_groups = 0;  // plain multi-head attention
  const double h = m.hidden_size, kv = 8 * 128;
  EXPECT_EQ(m.parameters_per_layer() - gqa, 2 * h * (h - kv));
}

// ---- presets ----

TEST(Presets, EveryPresetLoadsAndValidates) {
  EXPECT_EQ(model_preset_names().size(), 27u);
  for (const std::string& name : model_preset_names()) {
    const ModelSpec m = resolve_model(name);
    EXPECT_EQ(m.name, name);
    EXPECT_NO_THROW(m.validate()) << name;
  }
  EXPECT_EQ(cluster_preset_names(),
            (std::vector<std::string>{"dgx-a100-80gb", "dgx-b200", "dgx-h100", "dgx-h200",
                                      "gb200-nvl72"}));
  for (const std::string& name : cluster_preset_names()) {
    const ClusterSpec c = resolve_cluster(name);
    EXPECT_EQ(c.name, name);
    EXPECT_EQ(c.num_nodes, 1);
    EXPECT_NO_THROW(c.validate()) << name;
  }
  EXPECT_EQ(profile_preset_names(),
            (std::vector<std::string>{"a100-80gb", "b200", "h100-sxm", "h200-sxm"}));
  for (const std::string& name : profile_preset_names()) {
    const HardwareProfile p = resolve_profile(name);
    EXPECT_EQ(p.name, name);
    EXPECT_FALSE(p.sources.empty());
  }
}

TEST(Presets, ClusterFacts) {
  const ClusterSpec a = resolve_cluster("dgx-a100-80gb");
  EXPECT_EQ(a.gpu.peak_tflops_16bit, 312);
  EXPECT_EQ(a.nvlink_bandwidth_gbps, 300);
  EXPECT_EQ(a.nic_bandwidth_gbps, 25);
  ASSERT_EQ(a.tiers.size(), 2u);
  EXPECT_EQ(a.tiers[0].nodes_per_switch, 20);
  EXPECT_EQ(default_profile_for(a).name, "a100-80gb");
  const ClusterSpec h = resolve_cluster("dgx-h100");
  EXPECT_EQ(h.gpu.peak_tflops_16bit, 989);
  EXPECT_EQ(default_profile_for(h).name, "h100-sxm");
  ClusterSpec other = h;
  other.gpu.name = "Some GPU";
  EXPECT_EQ(field_of([&] { default_profile_for(other); }), "profile");
}

// Every built-in cluster is priced with its own GPU's profile, never another's by default.
TEST(Presets, EachClusterHasItsGpusProfile) {
  const std::pair<const char*, const char*> expected[] = {{"dgx-a100-80gb", "a100-80gb"},
                                                          {"dgx-h100", "h100-sxm"},
                                                          {"dgx-h200", "h200-sxm"},
                                                          {"dgx-b200", "b200"},
                                                          {"gb200-nvl72", "b200"}};
  for (const auto& [cluster, profile] : expected)
    EXPECT_EQ(default_profile_for(resolve_cluster(cluster)).name, profile) << cluster;
  const ClusterSpec h200 = resolve_cluster("dgx-h200");
  EXPECT_EQ(h200.gpu.hbm_bandwidth_gbps, 4800);
  EXPECT_GT(h200.gpu.memory_gib, resolve_cluster("dgx-h100").gpu.memory_gib);
  const ClusterSpec nvl72 = resolve_cluster("gb200-nvl72");
  EXPECT_EQ(nvl72.gpus_per_node, 72);  // the NVLink domain is the node
  EXPECT_EQ(nvl72.nvlink_bandwidth_gbps, 900);
}

TEST(Presets, UnknownNameListsPresets) {
  EXPECT_EQ(field_of([] { resolve_model("gpt-9000"); }), "model");
  EXPECT_NE(message_of([] { resolve_model("gpt-9000"); }).find("gpt3-175b"), std::string::npos);
  EXPECT_EQ(field_of([] { resolve_cluster("selene"); }), "cluster");
  EXPECT_EQ(field_of([] { resolve_profile("/no/such/profile.json"); }), "profile");
}

// ---- JSON round trips ----

TEST(Json, RoundTripsAreExact) {
  for (const std::string& name : model_preset_names()) {
    const json j = to_json(resolve_model(name));
    EXPECT_EQ(to_json(model_from_json(j)), j) << name;
  }
  for (const std::string& name : cluster_preset_names()) {
    const json j = to_json(resolve_cluster(name));
    EXPECT_EQ(to_json(cluster_from_json(j)), j) << name;
  }
  for (const std::string& name : profile_preset_names()) {
    const json j = to_json(resolve_profile(name));
    EXPECT_EQ(to_json(profile_from_json(j)), j) << name;
  }
  ParallelPlan p;
  p.tensor_parallel = 8;
  p.pipeline_parallel = 4;
  p.virtual_stages = 2;
  p.schedule = Schedule::kInterleaved1F1B;
  p.recompute = Recompute::kSelective;
  p.sequence_parallel = true;
  p.layers_per_stage = {23, 25, 24, 24};
  const json j = to_json(p);
  EXPECT_EQ(j["schedule"], "interleaved");
  EXPECT_EQ(j["recompute"], "selective");
  EXPECT_EQ(to_json(plan_from_json(j)), j);
}

TEST(Json, DocumentationKeysAreIgnored) {
  json j = model_json();
  j["note"] = "a note";
  j["hidden_size_source"] = "a paper";
  EXPECT_NO_THROW(model_from_json(j));
  json c = to_json(resolve_cluster("dgx-h100"));
  c["gpu"]["memory_gib_note"] = "HBM3";
  c["tiers"][0]["latency_us_source"] = "datasheet";
  EXPECT_NO_THROW(cluster_from_json(c));
}

TEST(Json, EnumStrings) {
  for (Schedule s :
       {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B, Schedule::kZeroBubbleH1})
    EXPECT_EQ(schedule_from_string(to_string(s)), s);
  for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull})
    EXPECT_EQ(recompute_from_string(to_string(r)), r);
  EXPECT_EQ(field_of([] { schedule_from_string("1F1B-fast"); }), "--pipeline-schedule");
  EXPECT_EQ(field_of([] { recompute_from_string("partial"); }), "--recompute-granularity");
  json p = to_json(ParallelPlan{});
  p["schedule"] = "pipedream";
  EXPECT_EQ(field_of([&] { plan_from_json(p); }), "schedule");
}

// ---- Hugging Face config.json ----

TEST(HuggingFace, LlamaConfig) {
  const std::string path = write_temp("llama_config.json", R"({
    "_name_or_path": "meta-llama/Meta-Llama-3-8B", "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": null, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "vocab_size": 128256})");
  const ModelSpec m = resolve_model(path);
  EXPECT_EQ(m.name, "meta-llama/Meta-Llama-3-8B");
  EXPECT_EQ(m.num_layers, 32);
  EXPECT_EQ(m.query_groups(), 8);
  EXPECT_EQ(m.ffn_hidden(), 14336);
  EXPECT_EQ(m.seq_length, 8192);
  EXPECT_TRUE(m.swiglu);
  EXPECT_TRUE(m.untie_embeddings_and_output_weights);  // llama: untied unless stated
  EXPECT_FALSE(m.learned_position_embeddings);
  EXPECT_EQ(m.parameters(), resolve_model("llama3-8b").parameters());
  EXPECT_EQ(m.attention_dropout, 0);  // the config is silent: no dropout
  EXPECT_EQ(m.hidden_dropout, 0);
  EXPECT_EQ(to_json(m)["attention_dropout"],
            to_json(resolve_model("llama3-8b"))["attention_dropout"]);
}

// A rotary base beyond any real model's (the fuzzer's 5e79) is refused naming the field, rather
// than overflowing the integer --rotary-base of the printed Megatron flags.
TEST(ModelSpec, RotaryBaseIsBounded) {
  json llama = to_json(resolve_model("llama3-8b"));
  llama["rotary_base"] = 5e79;
  EXPECT_EQ(field_of([&] { model_from_json(llama); }), "rotary_base");
  llama["rotary_base"] = 1e12;
  EXPECT_DOUBLE_EQ(model_from_json(llama).rotary_base, 1e12);
}

TEST(ModelSpec, DropoutIsReadAndChecked) {
  const json gpt2 = {{"model_type", "gpt2"}, {"num_hidden_layers", 12},
                     {"hidden_size", 768},   {"num_attention_heads", 12},
                     {"vocab_size", 50257},  {"attn_pdrop", 0.1},
                     {"resid_pdrop", 0.05},  {"max_position_embeddings", 1024}};
  const ModelSpec m = model_from_json(gpt2);
  EXPECT_DOUBLE_EQ(m.attention_dropout, 0.1);
  EXPECT_DOUBLE_EQ(m.hidden_dropout, 0.05);
  EXPECT_DOUBLE_EQ(resolve_model("gpt3-175b").attention_dropout, 0.1);  // Megatron's default
  json own = to_json(m);
  EXPECT_EQ(model_from_json(own).hidden_dropout, m.hidden_dropout);
  own["hidden_dropout"] = 1.0;
  EXPECT_EQ(field_of([&] { model_from_json(own); }), "hidden_dropout");
  json hf = gpt2;
  hf["attn_pdrop"] = -0.5;
  EXPECT_EQ(field_of([&] { model_from_json(hf); }), "attention_dropout");
}

// Qwen/Qwen3-30B-A3B's config.json (the fields ptdp reads): its 128-wide heads become
// --kv-channels, its q_norm and k_norm --qk-layernorm, and it reads as the preset does.
TEST(HuggingFace, Qwen3MoeConfigReadsAsThePreset) {
  const json qwen3 = {{"model_type", "qwen3_moe"},
                      {"hidden_act", "silu"},
                      {"hidden_size", 2048},
                      {"num_hidden_layers", 48},
                      {"num_attention_heads", 32},
                      {"num_key_value_heads", 4},
                      {"head_dim", 128},
                      {"intermediate_size", 6144},
                      {"moe_intermediate_size", 768},
                      {"num_experts", 128},
                      {"num_experts_per_tok", 8},
                      {"decoder_sparse_step", 1},
                      {"mlp_only_layers", json::array()},
                      {"vocab_size", 151936},
                      {"max_position_embeddings", 40960},
                      {"rope_theta", 1000000.0},
                      {"attention_bias", false},
                      {"tie_word_embeddings", false}};
  const ModelSpec m = model_from_json(qwen3);
  const ModelSpec preset = resolve_model("qwen3-30b-a3b");
  EXPECT_EQ(m.kv_channels, 128);
  EXPECT_TRUE(m.qk_layernorm);
  EXPECT_FALSE(m.learned_position_embeddings);
  EXPECT_TRUE(m.untie_embeddings_and_output_weights);
  EXPECT_EQ(m.parameters(), preset.parameters());
  EXPECT_EQ(m.expert_parameters(), preset.expert_parameters());
  // transformers' defaults where a config leaves them out: head_dim 128, untied embeddings.
  json sparse = qwen3;
  sparse.erase("head_dim");
  sparse.erase("tie_word_embeddings");
  EXPECT_EQ(model_from_json(sparse).parameters(), preset.parameters());
  // A dense Qwen3 config (model_type qwen3) has the norms too.
  json dense = qwen3;
  dense["model_type"] = "qwen3";
  for (const char* k : {"moe_intermediate_size", "num_experts", "num_experts_per_tok"})
    dense.erase(k);
  EXPECT_TRUE(model_from_json(dense).qk_layernorm);
  EXPECT_FALSE(model_from_json(dense).is_moe());
}

// deepseek-ai/DeepSeek-V3's and DeepSeek-V2-Lite's config.json (the fields ptdp reads): the
// latent attention's widths (qk_nope_head_dim, qk_rope_head_dim; q_lora_rank null: one query
// projection) read as the presets.
TEST(HuggingFace, DeepSeekConfigsReadAsThePresets) {
  const json v3 = {{"model_type", "deepseek_v3"},
                   {"hidden_act", "silu"},
                   {"hidden_size", 7168},
                   {"num_hidden_layers", 61},
                   {"num_attention_heads", 128},
                   {"num_key_value_heads", 128},
                   {"q_lora_rank", 1536},
                   {"kv_lora_rank", 512},
                   {"qk_nope_head_dim", 128},
                   {"qk_rope_head_dim", 64},
                   {"v_head_dim", 128},
                   {"intermediate_size", 18432},
                   {"moe_intermediate_size", 2048},
                   {"n_routed_experts", 256},
                   {"n_shared_experts", 1},
                   {"num_experts_per_tok", 8},
                   {"first_k_dense_replace", 3},
                   {"moe_layer_freq", 1},
                   {"num_nextn_predict_layers", 1},
                   {"vocab_size", 129280},
                   {"max_position_embeddings", 163840},
                   {"rope_theta", 10000},
                   {"tie_word_embeddings", false}};
  const ModelSpec m = model_from_json(v3);
  const ModelSpec preset = resolve_model("deepseek-v3");
  EXPECT_TRUE(m.multi_latent_attention);
  EXPECT_TRUE(m.qk_layernorm);  // q_a_layernorm and kv_a_layernorm
  EXPECT_EQ(m.head_dim(), 192);
  EXPECT_EQ(m.value_dim(), 128);
  EXPECT_EQ(m.parameters(), preset.parameters());
  EXPECT_EQ(m.mtp_num_layers, 1);  // num_nextn_predict_layers
  json lite = v3;
  lite.erase("num_nextn_predict_layers");  // V2-Lite has no MTP module
  for (auto [k, v] :
       std::initializer_list<std::pair<const char*, json>>{{"hidden_size", 2048},
                                                           {"num_hidden_layers", 27},
                                                           {"num_attention_heads", 16},
                                                           {"num_key_value_heads", 16},
                                                           {"q_lora_rank", nullptr},
                                                           {"intermediate_size", 10944},
                                                           {"moe_intermediate_size", 1408},
                                                           {"n_routed_experts", 64},
                                                           {"n_shared_experts", 2},
                                                           {"num_experts_per_tok", 6},
                                                           {"first_k_dense_replace", 1},
                                                           {"vocab_size", 102400}})
    lite[k] = v;
  lite["model_type"] = "deepseek_v2";
  const ModelSpec l = model_from_json(lite);
  EXPECT_EQ(l.q_lora_rank, 0);
  EXPECT_EQ(l.parameters(), resolve_model("deepseek-v2-lite").parameters());
  json odd = v3;  // named in the config's terms
  odd["qk_rope_head_dim"] = 63;
  EXPECT_EQ(field_of([&] { model_from_json(odd); }), "qk_rope_head_dim");
}

// Qwen/Qwen2.5-7B's config.json (the fields ptdp reads): model_type qwen2 has QKV biases.
TEST(HuggingFace, Qwen2ConfigsHaveQkvBiases) {
  const json qwen2 = {{"model_type", "qwen2"},
                      {"hidden_act", "silu"},
                      {"hidden_size", 3584},
                      {"num_hidden_layers", 28},
                      {"num_attention_heads", 28},
                      {"num_key_value_heads", 4},
                      {"intermediate_size", 18944},
                      {"vocab_size", 152064},
                      {"max_position_embeddings", 4096},
                      {"rope_theta", 1000000.0},
                      {"tie_word_embeddings", false}};
  const ModelSpec m = model_from_json(qwen2);
  EXPECT_TRUE(m.add_qkv_bias);
  EXPECT_EQ(m.parameters(), resolve_model("qwen2.5-7b").parameters());
  json llama = qwen2;
  llama["model_type"] = "llama";
  EXPECT_FALSE(model_from_json(llama).add_qkv_bias);
}

TEST(HuggingFace, DefaultsForOtherModels) {
  const json j = {
      {"model_type", "gpt_neox"},       {"hidden_act", "gelu"},      {"hidden_size", 2048},
      {"num_hidden_layers", 24},        {"num_attention_heads", 16}, {"vocab_size", 50304},
      {"max_position_embeddings", 2048}};
  const ModelSpec m = model_from_json(j);
  EXPECT_EQ(m.query_groups(), 16);
  EXPECT_EQ(m.ffn_hidden(), 4 * 2048);
  EXPECT_FALSE(m.swiglu);
  EXPECT_FALSE(m.untie_embeddings_and_output_weights);  // tied unless stated
  EXPECT_TRUE(m.learned_position_embeddings);
  json bad = j;
  bad["num_key_value_heads"] = "8";
  EXPECT_EQ(field_of([&] { model_from_json(bad); }), "num_key_value_heads");
}

// Hugging Face's config classes default the families ptdp reads to SiLU (gated) and rotary
// positions, Mixtral's with rope_theta 1e6, so a config that leaves them out is priced as the
// class reads it (found by review: a Mixtral config without hidden_act was priced as an ungated
// GELU model, 31.8B parameters instead of 46.7B).
TEST(HuggingFace, FamilyDefaultsForActivationAndPositions) {
  const json mixtral = {{"model_type", "mixtral"},     {"hidden_size", 4096},
                        {"intermediate_size", 14336},  {"num_hidden_layers", 32},
                        {"num_attention_heads", 32},   {"num_key_value_heads", 8},
                        {"vocab_size", 32000},         {"max_position_embeddings", 4096},
                        {"num_local_experts", 8},      {"num_experts_per_tok", 2},
                        {"tie_word_embeddings", false}};
  const ModelSpec m = model_from_json(mixtral);
  EXPECT_TRUE(m.swiglu);
  EXPECT_FALSE(m.learned_position_embeddings);
  EXPECT_DOUBLE_EQ(m.rotary_base, 1e6);
  EXPECT_NEAR(m.parameters() / 1e9, 46.7, 0.1);
  for (const char* type : {"llama", "mistral", "qwen2", "qwen2_moe"}) {
    json j = mixtral;
    j["model_type"] = type;
    j.erase("num_local_experts");
    j.erase("num_experts_per_tok");
    const ModelSpec d = model_from_json(j);
    EXPECT_TRUE(d.swiglu) << type;
    EXPECT_FALSE(d.learned_position_embeddings) << type;
    EXPECT_DOUBLE_EQ(d.rotary_base, 10000) << type;
  }
  json gelu = mixtral;
  gelu["hidden_act"] = "gelu";  // stated, it is read as given
  EXPECT_FALSE(model_from_json(gelu).swiglu);
}

// What ptdp would price wrongly is refused naming the config's key, and errors found after
// reading name the config's keys, not ptdp's fields (found by exploratory testing: Qwen3's
// head_dim was ignored, pricing 3.7B parameters for a 4.0B model).
TEST(HuggingFace, UnmodelledFieldsAreRefusedInTheConfigsTerms) {
  const json llama = {
      {"model_type", "llama"},     {"hidden_act", "silu"},      {"hidden_size", 2560},
      {"num_hidden_layers", 4},    {"num_attention_heads", 32}, {"num_key_value_heads", 8},
      {"intermediate_size", 9728}, {"vocab_size", 1024},        {"max_position_embeddings", 4096},
      {"rope_theta", 1e6}};
  EXPECT_EQ(model_from_json(llama).num_layers, 4);
  json j = llama;
  j["head_dim"] = 80;  // hidden_size / num_attention_heads: the default width
  EXPECT_EQ(model_from_json(j).head_dim(), 80);
  EXPECT_EQ(model_from_json(j).kv_channels, 0);
  j["head_dim"] = 0;
  EXPECT_EQ(field_of([&] { model_from_json(j); }), "head_dim");
  j["head_dim"] = 7;  // odd: no rotary embedding
  EXPECT_EQ(field_of([&] { model_from_json(j); }), "head_dim");
  j = llama;
  j["model_type"] = "olmo2";  // its query and key norms span the whole projection
  EXPECT_EQ(field_of([&] { model_from_json(j); }), "model_type");
  j = llama;
  j["attention_bias"] = true;  // Llama configs may ask for attention biases
  EXPECT_EQ(field_of([&] { model_from_json(j); }), "attention_bias");
  j = llama;
  j["model_type"] = "gemma";
  EXPECT_EQ(field_of([&] { model_from_json(j); }), "model_type");
  j = llama;
  j["hidden_activation"] = "gelu_pytorch_tanh";
  EXPECT_EQ(field_of([&] { model_from_json(j); }), "hidden_activation");
  j = llama;
  j["hidden_act"] = "swish";  // SiLU by its other name
  EXPECT_TRUE(model_from_json(j).swiglu);
  j["hidden_act"] = "relu";
  EXPECT_EQ(field_of([&] { model_from_json(j); }), "hidden_act");
  j = llama;
  j["num_key_value_heads"] = 3;
  EXPECT_EQ(message_of([&] { model_from_json(j); }),
            "num_key_value_heads: 3 does not divide num_attention_heads (32)");
  j = llama;
  j.erase("max_position_embeddings");
  EXPECT_EQ(message_of([&] { model_from_json(j); }),
            "max_position_embeddings: missing: ptdp takes the sequence length from it");
  j = llama;
  j["rope_theta"] = 0.5;
  EXPECT_EQ(field_of([&] { model_from_json(j); }), "rope_theta");
  j = llama;
  j["num_experts"] = nullptr;  // dense, as stated
  EXPECT_EQ(model_from_json(j).num_experts, 0);
  j["num_experts"] = 4;
  j["n_shared_experts"] = -1;
  EXPECT_EQ(field_of([&] { model_from_json(j); }), "n_shared_experts");
}

// ---- bad input ----

TEST(BadInput, Files) {
  EXPECT_EQ(message_of([] { read_json_file("/no/such/file.json", "cluster"); }),
            "cluster: cannot open '/no/such/file.json'");
  const std::string truncated = write_temp("truncated.json", R"({"num_layers": 96, "hidden_)");
  EXPECT_EQ(field_of([&] { resolve_model(truncated); }), "model");
  EXPECT_NE(message_of([&] { resolve_model(truncated); }).find("invalid JSON at byte"),
            std::string::npos);
  const std::string random = write_temp("random.json", std::string("\x8f\x01\xff{\x00z", 6));
  EXPECT_EQ(field_of([&] { resolve_cluster(random); }), "cluster");
  const std::string array = write_temp("array.json", "[1, 2]");
  EXPECT_EQ(message_of([&] { resolve_model(array); }), "model: expected a JSON object, got array");
  EXPECT_EQ(field_of([&] { resolve_profile(array); }), "profile");
}

TEST(BadInput, ModelSizesAndTypes) {
  auto with = [](const std::string& key, const json& value) {
    json j = model_json();
    j[key] = value;
    return [j] { model_from_json(j); };
  };
  EXPECT_EQ(message_of(with("hidden_size", -4)), "hidden_size: must be positive, got -4");
  EXPECT_EQ(field_of(with("num_layers", 0)), "num_layers");
  EXPECT_EQ(field_of(with("vocab_size", 0)), "vocab_size");
  EXPECT_EQ(field_of(with("hidden_size", "12288")), "hidden_size");
  EXPECT_EQ(field_of(with("num_layers", 2.5)), "num_layers");
  EXPECT_NO_THROW(with("num_layers", 96.0)());
  EXPECT_EQ(field_of(with("swiglu", "yes")), "swiglu");
  EXPECT_EQ(field_of(with("name", 7)), "name");
  EXPECT_EQ(field_of(with("hidden_sise", 12288)), "hidden_sise");  // typo
  EXPECT_EQ(field_of(with("hidden_size", 12290)), "hidden_size");  // not divisible by heads
  EXPECT_EQ(field_of(with("num_query_groups", 5)), "num_query_groups");
  EXPECT_EQ(field_of(with("num_query_groups", -1)), "num_query_groups");
  EXPECT_EQ(field_of([] { model_from_json(json(42)); }), "model");
}

TEST(BadInput, ClusterAndProfile) {
  json c = to_json(resolve_cluster("dgx-a100-80gb"));
  c["gpu"]["memory_gib"] = "80";
  EXPECT_EQ(field_of([&] { cluster_from_json(c); }), "gpu.memory_gib");
  c = to_json(resolve_cluster("dgx-a100-80gb"));
  c["tiers"][1]["oversubscription"] = 0.5;
  EXPECT_EQ(field_of([&] { cluster_from_json(c); }), "tiers[1].oversubscription");
  c = to_json(resolve_cluster("dgx-a100-80gb"));
  c["gpus_per_node"] = 0;
  EXPECT_EQ(field_of([&] { cluster_from_json(c); }), "gpus_per_node");
  c = to_json(resolve_cluster("dgx-a100-80gb"));
  c["gpu"] = json::array();
  EXPECT_EQ(message_of([&] { cluster_from_json(c); }), "gpu: expected a JSON object, got array");
  c = to_json(resolve_cluster("dgx-a100-80gb"));
  c["nvlink_bw"] = 300;
  EXPECT_EQ(field_of([&] { cluster_from_json(c); }), "nvlink_bw");

  json p = to_json(resolve_profile("a100-80gb"));
  p["nvlink"]["bandwidth"] = 1;
  EXPECT_EQ(field_of([&] { profile_from_json(p); }), "nvlink.bandwidth");
  p = to_json(resolve_profile("a100-80gb"));
  p["gemm"]["max_efficiency"] = 1.5;
  EXPECT_EQ(field_of([&] { profile_from_json(p); }), "gemm.max_efficiency");
  p = to_json(resolve_profile("a100-80gb"));
  p["sources"] = {"ok", 3};
  EXPECT_EQ(field_of([&] { profile_from_json(p); }), "sources");
  p = to_json(resolve_profile("a100-80gb"));
  p["gemm"]["tiles"] = json::array();
  EXPECT_EQ(field_of([&] { profile_from_json(p); }), "gemm.tiles");
  p = to_json(resolve_profile("a100-80gb"));
  p["gemm"]["tiles"][1]["n"] = 0;
  EXPECT_EQ(field_of([&] { profile_from_json(p); }), "gemm.tiles[1].n");
  p = to_json(resolve_profile("a100-80gb"));
  p["gemm"]["tiles"][2]["efficiency"] = 1.2;
  EXPECT_EQ(field_of([&] { profile_from_json(p); }), "gemm.tiles[2].efficiency");
  p = to_json(resolve_profile("a100-80gb"));
  p["gemm"]["tiles"][0]["k"] = 32;
  EXPECT_EQ(field_of([&] { profile_from_json(p); }), "gemm.tiles[0].k");
  p = to_json(resolve_profile("a100-80gb"));
  p["gemm"]["sm_count"] = -1;
  EXPECT_EQ(field_of([&] { profile_from_json(p); }), "gemm.sm_count");
}

// ---- cluster ----

TEST(ClusterSpec, Resize) {
  ClusterSpec c = resolve_cluster("dgx-a100-80gb");
  c.resize(1024);
  EXPECT_EQ(c.num_nodes, 128);
  EXPECT_EQ(c.num_gpus(), 1024);
  EXPECT_EQ(message_of([&] { c.resize(1001); }),
            "num_gpus: 1001 is not a multiple of gpus_per_node (8)");
  EXPECT_EQ(field_of([&] { c.resize(0); }), "num_gpus");
  c.resize(4);
  EXPECT_EQ(c.num_nodes, 1);
  EXPECT_EQ(c.gpus_per_node, 4);
}

// ---- hardware profile ----

TEST(HardwareProfile, GemmEfficiency) {
  GemmEfficiency g{0.8, 64, 32, 16, 0, {}};
  EXPECT_DOUBLE_EQ(g.at(64, 32, 16), 0.8 / 8);
  EXPECT_NEAR(g.at(1e9, 1e9, 1e9), 0.8, 1e-6);
  EXPECT_LT(g.at(128, 4096, 4096), g.at(4096, 4096, 4096));
}

// Counted tiles and waves on 108 SMs with 256 x 128 tiles (k_half 0: the K loop is free).
TEST(HardwareProfile, GemmEfficiencyCountsTilesAndWaves) {
  GemmEfficiency g{1.0, 0, 0, 0, 108, {GemmTile{256, 128, 1.0}}};
  // 2048 x 5760: 8 x 45 = 360 tiles = 3.33 waves, paid as 4: 360 / 432.
  EXPECT_DOUBLE_EQ(g.at(2048, 5760, 15360), 360.0 / 432.0);
  // Twice the rows: 720 tiles, 6.67 waves paid as 7.
  EXPECT_DOUBLE_EQ(g.at(4096, 5760, 15360), 720.0 / 756.0);
  // Exactly one full wave: 108 tiles of 256 x 128 (12 x 9 in the better orientation).
  EXPECT_DOUBLE_EQ(g.at(12 * 256, 9 * 128, 1024), 1.0);
  // One tile more costs a second wave.
  EXPECT_DOUBLE_EQ(g.at(12 * 256, 9 * 128 + 1, 1024),
                   (12.0 * 256 * (9 * 128 + 1)) / (2 * 108 * 256 * 128.0));
  // A ragged edge is a partly empty tile: 100 x 100 fills 10000 / 32768 of one tile.
  EXPECT_DOUBLE_EQ(g.at(100, 100, 64), 100.0 * 100 / (108 * 256 * 128.0));
  // Either orientation: 128 x 256 fits the 256 x 128 tile turned over, in one tile.
  EXPECT_DOUBLE_EQ(g.at(128, 256, 64), g.at(256, 128, 64));
  // Batched products share the waves: 16 x (2048 x 2048) is 16 x 8 x 16 = 2048 tiles,
  // 18.96 waves paid as 19.
  EXPECT_DOUBLE_EQ(g.at(2048, 2048, 120, 16), 2048.0 / (19 * 108));
  // With several tiles the best one wins: 2048 x 5760 on 128 x 128 tiles is 720 tiles, 6.67
  // waves paid as 7, at 0.92 of the big tile's rate; better than the big tile's 360 / 432.
  GemmEfficiency two = g;
  two.tiles.push_back(GemmTile{128, 128, 0.92});
  EXPECT_DOUBLE_EQ(two.at(2048, 5760, 15360), 0.92 * 720.0 / 756.0);
  // ... but not where the big tile fills the GPU as well.
  EXPECT_DOUBLE_EQ(two.at(12 * 256, 9 * 128, 1024), 1.0);
  // The K loop: k = k_half halves it.
  GemmEfficiency gk = g;
  gk.k_half = 64;
  EXPECT_DOUBLE_EQ(gk.at(12 * 256, 9 * 128, 64), 0.5);
}

// ---- parallel plan ----

ParallelPlan gpt3_plan() {  // SC'21 Figure 12 / a Table 1-like layout for GPT-3 175B
  ParallelPlan p;
  p.tensor_parallel = 8;
  p.pipeline_parallel = 16;
  p.data_parallel = 8;
  p.micro_batch_size = 1;
  p.global_batch_size = 1536;
  p.recompute = Recompute::kFull;
  return p;
}

TEST(ParallelPlan, ValidPlansAndStages) {
  const ModelSpec m = resolve_model("gpt3-175b");
  ParallelPlan p = gpt3_plan();
  EXPECT_NO_THROW(p.validate(m));
  EXPECT_EQ(p.num_gpus(), 1024);
  EXPECT_EQ(p.num_microbatches(), 192);
  EXPECT_EQ(p.layers_on_stage(m, 15), 6);
  p.virtual_stages = 3;
  p.schedule = Schedule::kInterleaved1F1B;
  EXPECT_NO_THROW(p.validate(m));
  p = gpt3_plan();
  p.pipeline_parallel = 5;
  p.layers_per_stage = {18, 20, 20, 20, 18};
  p.global_batch_size = 1600;
  EXPECT_NO_THROW(p.validate(m));
  EXPECT_EQ(p.layers_on_stage(m, 1), 20);
  EXPECT_NE(p.megatron_flags(m).find(
                "--decoder-first-pipeline-num-layers 18 --decoder-last-pipeline-num-layers 18"),
            std::string::npos);
  p = gpt3_plan();
  p.data_parallel = 1;
  p.global_batch_size = 16;
  p.distributed_optimizer = true;  // allowed, if pointless
  EXPECT_NO_THROW(p.validate(m));
}

TEST(ParallelPlan, RejectsPlansMegatronCannotRun) {
  const ModelSpec m = resolve_model("gpt3-175b");
  auto check = [&](const std::function<void(ParallelPlan&)>& change) {
    ParallelPlan p = gpt3_plan();
    change(p);
    return error_of([&] { p.validate(m); });
  };
  auto field = [&](const std::function<void(ParallelPlan&)>& change) {
    const std::string e = check(change);
    return e.substr(0, e.find('|'));
  };
  EXPECT_EQ(check([](ParallelPlan& p) { p.tensor_parallel = 5; }),
            "--tensor-model-parallel-size|--tensor-model-parallel-size: 5 does not divide "
            "num_attention_heads (96)");
  EXPECT_EQ(check([](ParallelPlan& p) {
              p.data_parallel = 64;
              p.micro_batch_size = 2;
              p.global_batch_size = 1000;
            }),
            "--global-batch-size|--global-batch-size: 1000 is not divisible by data-parallel "
            "size * micro-batch size (64 * 2)");
  EXPECT_EQ(field([](ParallelPlan& p) { p.tensor_parallel = 0; }), "--tensor-model-parallel-size");
  EXPECT_EQ(field([](ParallelPlan& p) { p.micro_batch_size = -1; }), "--micro-batch-size");
  EXPECT_EQ(field([](ParallelPlan& p) { p.pipeline_parallel = 128; }),
            "--pipeline-model-parallel-size");
  EXPECT_EQ(field([](ParallelPlan& p) { p.pipeline_parallel = 7; }),
            "--pipeline-model-parallel-size");
  EXPECT_EQ(field([](ParallelPlan& p) { p.layers_per_stage = {6, 6}; }), "layers_per_stage");
  EXPECT_EQ(field([](ParallelPlan& p) { p.layers_per_stage.assign(16, 5); }), "layers_per_stage");
  const std::string vp = "--num-layers-per-virtual-pipeline-stage";
  EXPECT_EQ(field([](ParallelPlan& p) { p.virtual_stages = 2; }), vp);  // schedule is 1f1b
  EXPECT_EQ(field([](ParallelPlan& p) {
              p.virtual_stages = 4;  // 6 layers per stage
              p.schedule = Schedule::kInterleaved1F1B;
            }),
            vp);
  EXPECT_EQ(field([](ParallelPlan& p) {
              p.virtual_stages = 2;
              p.schedule = Schedule::kInterleaved1F1B;
              p.global_batch_size = 8 * 24;  // 24 microbatches, not a multiple of 16
            }),
            vp);
  EXPECT_EQ(field([](ParallelPlan& p) {
              p.pipeline_parallel = 1;
              p.data_parallel = 1;
              p.virtual_stages = 2;
              p.schedule = Schedule::kInterleaved1F1B;
            }),
            vp);
  EXPECT_EQ(check([](ParallelPlan& p) {
              p.tensor_parallel = 1;
              p.sequence_parallel = true;
            }),
            "--sequence-parallel|--sequence-parallel: needs tensor-model-parallel-size > 1");

  ModelSpec gqa = resolve_model("llama3-70b");  // 8 query groups
  ParallelPlan p;
  p.tensor_parallel = 16;
  p.pipeline_parallel = 5;
  EXPECT_NE(error_of([&] { p.validate(gqa); }).find("num_query_groups (8)"), std::string::npos);
}

// The rules the search, ParallelPlan::validate and the runtime share: each violation has its
// rule and one message naming the Megatron flag, whichever entry point finds it.
TEST(PlanRules, OneRuleOneMessage) {
  ModelSpec m;
  m.num_layers = 8;
  m.hidden_size = 64;
  m.num_attention_heads = 8;
  m.ffn_hidden_size = 100;
  m.seq_length = 30;
  m.vocab_size = 128;
  ParallelPlan p;
  p.tensor_parallel = 8;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kTensorDividesFfn);
  EXPECT_EQ(error_of([&] { check_plan(m, p); }),
            "--tensor-model-parallel-size|--tensor-model-parallel-size: 8 does not divide "
            "ffn_hidden_size (100)");
  EXPECT_EQ(error_of([&] { p.validate(m); }), error_of([&] { check_plan(m, p); }));
  p.tensor_parallel = 4;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  p.sequence_parallel = true;  // 4 does not divide the 30 tokens of a sequence
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kSequenceParallelDividesSequence);
  EXPECT_EQ(error_of([&] { p.validate(m); }),
            "--sequence-parallel|--sequence-parallel: seq_length (30) is not a multiple of "
            "tensor-model-parallel-size (4)");
  p.tensor_parallel = 2;
  EXPECT_NO_THROW(check_plan(m, p));
  EXPECT_STRNE(rule_reason(PlanRule::kTensorDividesFfn),
               rule_reason(PlanRule::kSequenceParallelDividesSequence));
}

// Multi-token prediction's eh_proj splits its h outputs over the tensor-parallel ranks (a rule
// only for models with the modules), and module k predicts k + 1 tokens ahead (fewer modules
// than the sequence has tokens).
TEST(PlanRules, MultiTokenPredictionSplitsTheHiddenSize) {
  ModelSpec m;
  m.num_layers = 4;
  m.hidden_size = 100;
  m.kv_channels = 16;  // 8 heads of 16: the heads' width is not the hidden size
  m.num_attention_heads = 8;
  m.ffn_hidden_size = 256;
  m.seq_length = 32;
  m.vocab_size = 128;
  m.learned_position_embeddings = false;
  ParallelPlan p;
  p.tensor_parallel = 8;  // divides the heads and the FFN, not the hidden size
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  m.mtp_num_layers = 1;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kTensorDividesMtpHidden);
  EXPECT_EQ(error_of([&] { check_plan(m, p); }),
            "--tensor-model-parallel-size|--tensor-model-parallel-size: 8 does not divide "
            "hidden_size (100), whose eh_proj outputs multi-token prediction splits over the "
            "tensor-parallel ranks");
  p.tensor_parallel = 4;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  m.mtp_num_layers = 32;
  EXPECT_THROW(m.validate(), InputError);
  m.mtp_num_layers = 31;
  EXPECT_NO_THROW(m.validate());
}

// The small model of the plan-rule tests below: 8 layers, hidden 64, 8 heads, s 32, V 128.
ModelSpec eight_layers() {
  ModelSpec m;
  m.num_layers = 8;
  m.hidden_size = 64;
  m.num_attention_heads = 8;
  m.seq_length = 32;
  m.vocab_size = 128;
  return m;
}

// The interleaved schedule is only a schedule of several chunks a rank: with one it would be
// priced as 1F1B in time and otherwise in memory, so it is refused, naming the schedule flag.
// ptdp_flags gives back what the Megatron-LM line cannot say, and nothing for a plain plan.
TEST(PlanRules, InterleavedNeedsVirtualStagesAndPtdpFlagsSayWhatMegatronCannot) {
  const ModelSpec m = eight_layers();
  ParallelPlan p;
  p.pipeline_parallel = 2;
  p.global_batch_size = 4;
  EXPECT_EQ(p.ptdp_flags(), "");
  p.schedule = Schedule::kInterleaved1F1B;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kInterleavedNeedsVirtual);
  EXPECT_EQ(field_of([&] { p.validate(m); }), "--pipeline-schedule");
  p.virtual_stages = 2;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  EXPECT_EQ(p.ptdp_flags(), "");  // interleaved is what v = 2 implies
  p.virtual_stages = 1;
  p.schedule = Schedule::kZeroBubbleH1;
  p.fp32_grad_reduce = false;
  p.scatter_gather_p2p = false;
  EXPECT_EQ(p.ptdp_flags(), "--fp16-grad-reduce --no-scatter-gather --pipeline-schedule zb-h1");
}

// Megatron-Core's microbatch groups: the default group (p) needs p | m; another group runs
// other counts when it fits them, is refused naming its flag when it does not, prints as its
// Megatron flag only where it is not p, and survives a plan file.
TEST(PlanRules, MicrobatchGroupsOfTheInterleavedSchedule) {
  const ModelSpec m = eight_layers();
  ParallelPlan p;
  p.pipeline_parallel = 4;
  p.virtual_stages = 2;
  p.schedule = Schedule::kInterleaved1F1B;
  p.global_batch_size = 6;  // 6 microbatches: groups of 4 leave 2 behind
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kMicrobatchGroup);
  EXPECT_EQ(error_of([&] { p.validate(m); }),
            "--num-layers-per-virtual-pipeline-stage|--num-layers-per-virtual-pipeline-stage: the "
            "interleaved schedule's microbatch group 4 (p, the default) leaves a last group of 2 "
            "< 4 microbatches (6 microbatches): "
            "--microbatch-group-size-per-virtual-pipeline-stage 6 runs them");
  p.microbatch_group = 5;
  EXPECT_EQ(field_of([&] { p.validate(m); }), "--microbatch-group-size-per-virtual-pipeline-stage");
  p.microbatch_group = 7;  // more than the microbatches
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kMicrobatchGroup);
  p.microbatch_group = -1;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kPositiveSizes);
  p.microbatch_group = 6;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  EXPECT_NE(p.megatron_flags(m).find(" --microbatch-group-size-per-virtual-pipeline-stage 6"),
            std::string::npos);
  const ParallelPlan back = plan_from_json(to_json(p));
  EXPECT_EQ(back.microbatch_group, 6);
  EXPECT_EQ(to_json(back), to_json(p));
  p.global_batch_size = 3;  // fewer microbatches than pipeline ranks: no group runs them
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kVirtualMicrobatches);
  p.global_batch_size = 8;
  p.microbatch_group = 4;  // p itself: Megatron's default, no flag
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  EXPECT_EQ(p.megatron_flags(m).find("--microbatch-group"), std::string::npos);
  EXPECT_STRNE(rule_reason(PlanRule::kMicrobatchGroup),
               rule_reason(PlanRule::kVirtualMicrobatches));
}

// Megatron-Core's conditions for --overlap-moe-expert-parallel-comm, one message each.
TEST(PlanRules, ExpertAllToAllOverlapNeedsWhatMegatronCoreNeeds) {
  ModelSpec m = eight_layers();
  m.num_experts = 4;
  m.moe_router_topk = 2;
  ParallelPlan p;
  p.data_parallel = 2;
  p.global_batch_size = 8;
  p.overlap_moe_ep_comm = true;
  EXPECT_EQ(error_of([&] { p.validate(m); }),
            "--overlap-moe-expert-parallel-comm|--overlap-moe-expert-parallel-comm: needs "
            "expert-model-parallel-size > 1");
  p.expert_parallel = 2;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);  // 1f1b at p = 1
  EXPECT_NE(p.megatron_flags(m).find(" --overlap-moe-expert-parallel-comm"), std::string::npos);
  EXPECT_EQ(plan_from_json(to_json(p)).overlap_moe_ep_comm, true);
  p.recompute = Recompute::kFull;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kExpertOverlap);
  p.recompute = Recompute::kSelective;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  p.pipeline_parallel = 2;  // 1f1b with p > 1: Megatron-Core needs virtual stages
  EXPECT_EQ(error_of([&] { p.validate(m); }),
            "--overlap-moe-expert-parallel-comm|--overlap-moe-expert-parallel-comm: needs the "
            "interleaved schedule (virtual stages) with p > 1, not 1f1b");
  p.virtual_stages = 2;
  p.schedule = Schedule::kInterleaved1F1B;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  EXPECT_STRNE(rule_reason(PlanRule::kExpertOverlap), rule_reason(PlanRule::kRecomputeLayers));
}

// Megatron-FSDP: p = 1 (as Megatron-Core runs it), the distributed optimizer exactly where the
// strategy shards the optimizer states, Megatron's flags (its checkpoint format, and fp32 main
// gradients where the plan is priced with them), and the plan file's field.
TEST(PlanRules, MegatronFsdpRunsAtOnePipelineStage) {
  const ModelSpec m = eight_layers();
  ParallelPlan p;
  p.data_parallel = 4;
  p.global_batch_size = 8;
  p.fsdp = FsdpSharding::kOptimGrads;
  EXPECT_EQ(error_of([&] { p.validate(m); }),
            "--use-megatron-fsdp|--use-megatron-fsdp: --data-parallel-sharding-strategy "
            "optim_grads shards the optimizer states: the plan needs the distributed optimizer");
  p.distributed_optimizer = true;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  const std::string flags = p.megatron_flags(m, DType::kBF16);
  EXPECT_NE(flags.find(" --use-distributed-optimizer --use-megatron-fsdp "
                       "--data-parallel-sharding-strategy optim_grads --ckpt-format fsdp_dtensor "
                       "--megatron-fsdp-main-grads-dtype fp32"),
            std::string::npos)
      << flags;
  p.fp32_grad_reduce = false;  // Megatron-FSDP's default (auto): the model's 16 bits
  EXPECT_EQ(p.megatron_flags(m, DType::kBF16).find("main-grads-dtype"), std::string::npos);
  EXPECT_EQ(p.ptdp_flags(), "--fp16-grad-reduce");
  for (FsdpSharding s : {FsdpSharding::kNoShard, FsdpSharding::kOptim, FsdpSharding::kOptimGrads,
                         FsdpSharding::kOptimGradsParams}) {
    p.fsdp = s;
    p.distributed_optimizer = s != FsdpSharding::kNoShard;
    EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone) << to_string(s);
    EXPECT_EQ(plan_from_json(to_json(p)).fsdp, s);
    EXPECT_EQ(fsdp_sharding_from_string(to_string(s)), s);
  }
  EXPECT_EQ(plan_from_json(to_json(ParallelPlan{})).fsdp, FsdpSharding::kOff);
  p.schedule = Schedule::kZeroBubbleH1;  // its deferred W passes would hold the gradients back
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kMegatronFsdp);
  p.schedule = Schedule::k1F1B;
  p.data_parallel = 2;
  p.pipeline_parallel = 2;
  EXPECT_EQ(error_of([&] { p.validate(m); }),
            "--use-megatron-fsdp|--use-megatron-fsdp: runs with pipeline-model-parallel-size 1 "
            "(Megatron-FSDP shards each data-parallel replica's layers), got 2");
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kMegatronFsdp);
  EXPECT_EQ(field_of([] { fsdp_sharding_from_string("zero3"); }),
            "--data-parallel-sharding-strategy");
  json j = to_json(ParallelPlan{});
  j["megatron_fsdp"] = "zero3";
  EXPECT_EQ(field_of([&] { plan_from_json(j); }), "megatron_fsdp");
}

// Megatron-Core's distributed optimizer in K instances: the distributed optimizer on, K
// dividing the d * cp data-parallel ranks (and an MoE model's edp), not with Megatron-FSDP
// (whose HSDP is not priced); Megatron's flag, the plan file's field.
TEST(PlanRules, DistributedOptimizerInstancesDivideTheDataParallelRanks) {
  const ModelSpec m = eight_layers();
  ParallelPlan p;
  p.data_parallel = 4;
  p.context_parallel = 2;
  p.global_batch_size = 8;
  p.optimizer_instances = 2;
  EXPECT_EQ(error_of([&] { p.validate(m); }),
            "--num-distributed-optimizer-instances|--num-distributed-optimizer-instances: needs "
            "--use-distributed-optimizer");
  p.distributed_optimizer = true;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  EXPECT_EQ(p.optimizer_shards(), 4);  // d * cp / K
  EXPECT_NE(p.megatron_flags(m).find(
                " --use-distributed-optimizer --num-distributed-optimizer-instances 2"),
            std::string::npos);
  EXPECT_EQ(plan_from_json(to_json(p)).optimizer_instances, 2);
  EXPECT_EQ(plan_from_json(to_json(ParallelPlan{})).optimizer_instances, 1);
  p.optimizer_instances = 8;  // one rank an instance: allowed (Megatron's replicated instances)
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  EXPECT_EQ(p.optimizer_shards(), 1);
  p.optimizer_instances = 3;
  EXPECT_EQ(error_of([&] { p.validate(m); }),
            "--num-distributed-optimizer-instances|--num-distributed-optimizer-instances: 3 does "
            "not divide the data-parallel size d * cp (4 * 2)");
  p.optimizer_instances = 0;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kOptimizerInstances);
  EXPECT_EQ(p.optimizer_shards(), 8);  // as one instance: no division by zero before the check
  // Megatron-FSDP in instances (HSDP): the strategies that shard the gradients; across the
  // instances no_shard, or optim (HFSDP) over optim_grads_params only, and only with K > 1.
  p.optimizer_instances = 2;
  p.fsdp = FsdpSharding::kOptim;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kOptimizerInstances);
  p.fsdp = FsdpSharding::kOptimGrads;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  EXPECT_EQ(p.instance_ranks(), 4);
  EXPECT_EQ(p.optimizer_shards(), 4);
  p.fsdp_outer = FsdpSharding::kOptim;
  EXPECT_EQ(error_of([&] { p.validate(m); }),
            "--outer-dp-sharding-strategy|--outer-dp-sharding-strategy: optim needs "
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
            "(Megatron-FSDP's rule: the outer sharding builds on the inner)");
  p.fsdp = FsdpSharding::kOptimGradsParams;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kNone);
  EXPECT_EQ(p.instance_ranks(), 4);    // gradients and weights over an instance
  EXPECT_EQ(p.optimizer_shards(), 8);  // the states over every data-parallel rank
  const std::string hsdp = p.megatron_flags(m, DType::kBF16);
  EXPECT_NE(hsdp.find(" --num-distributed-optimizer-instances 2 --use-megatron-fsdp "
                      "--data-parallel-sharding-strategy optim_grads_params --ckpt-format "
                      "fsdp_dtensor --megatron-fsdp-main-grads-dtype fp32 "
                      "--outer-dp-sharding-strategy optim"),
            std::string::npos)
      << hsdp;
  EXPECT_EQ(plan_from_json(to_json(p)).fsdp_outer, FsdpSharding::kOptim);
  EXPECT_EQ(plan_from_json(to_json(ParallelPlan{})).fsdp_outer, FsdpSharding::kNoShard);
  p.optimizer_instances = 1;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kMegatronFsdp);
  p.optimizer_instances = 2;
  p.fsdp_outer = FsdpSharding::kOptimGrads;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kMegatronFsdp);
  p.fsdp_outer = FsdpSharding::kNoShard;
  p.fsdp = FsdpSharding::kOff;
  // MoE: K divides the experts' data-parallel ranks too (t cp d / (etp ep) = 8 / 8 = 1 here).
  ModelSpec moe = m;
  moe.num_experts = 8;
  moe.moe_router_topk = 2;
  p.expert_parallel = 8;
  ASSERT_EQ(p.expert_data_parallel(), 1);
  EXPECT_EQ(first_violated_rule(moe, p), PlanRule::kOptimizerInstances);
  p.expert_parallel = 4;
  EXPECT_EQ(first_violated_rule(moe, p), PlanRule::kNone);
  EXPECT_EQ(p.expert_optimizer_shards(), 1);
}

// Rates beyond any machine (the simulator's picosecond clock would overflow on them, the
// reports would print hundreds of digits) are refused naming the field.
TEST(Json, ClusterRatesOutsideTheirRangesAreRefused) {
  for (const auto& [key, value] : {std::pair<const char*, double>{"peak_tflops_16bit", 1e-300},
                                   {"peak_tflops_16bit", 1e300},
                                   {"hbm_bandwidth_gbps", 1e-9},
                                   {"memory_gib", 1e12}}) {
    json c = to_json(resolve_cluster("dgx-h100"));
    c["gpu"][key] = value;
    EXPECT_EQ(field_of([&] { cluster_from_json(c).validate(); }), std::string("gpu.") + key);
  }
  json c = to_json(resolve_cluster("dgx-h100"));
  c["nic_latency_us"] = 1e300;
  EXPECT_EQ(field_of([&] { cluster_from_json(c).validate(); }), "nic_latency_us");
  c = to_json(resolve_cluster("dgx-h100"));
  c["gpu"]["peak_tflops_fp8"] = 0;  // no FP8: allowed
  EXPECT_NO_THROW(cluster_from_json(c).validate());
}

// A small model of `layers` layers, and an interleaved plan of two pipeline ranks of two chunks
// each for it (the pipeline layout tests').
ModelSpec toy_model(int64_t layers) {
  ModelSpec m;
  m.num_layers = layers;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.seq_length = 32;
  m.vocab_size = 128;
  return m;
}
ParallelPlan two_stages_two_chunks() {
  ParallelPlan p;
  p.pipeline_parallel = 2;
  p.virtual_stages = 2;
  p.schedule = Schedule::kInterleaved1F1B;
  p.global_batch_size = 4;
  return p;
}

TEST(PlanRules, ChunksOfAnUnevenInterleavedPlan) {
  const ModelSpec m = toy_model(6);
  ParallelPlan p = two_stages_two_chunks();
  p.layers_per_stage = {2, 4};
  ASSERT_NO_THROW(p.validate(m));
  // Chunk c of pipeline rank r is global stage c * p + r.
  EXPECT_EQ(layers_per_model_chunk(m, p), (std::vector<int64_t>{1, 2, 1, 2}));
  p.virtual_stages = 1;
  p.schedule = Schedule::k1F1B;
  p.layers_per_stage.clear();
  EXPECT_EQ(layers_per_model_chunk(m, p), (std::vector<int64_t>{3, 3}));
}

// Megatron-Core's --pipeline-model-parallel-layout: its documented examples read as its parser
// reads them, the string ptdp writes reads back to the same chunks, and every malformed layout
// is refused naming the flag.
TEST(PipelineLayout, ReadsMegatronCoreLayoutsAndWritesThemBack) {
  // DeepSeek-V3's 61 layers over p = 8, v = 4 (Megatron-Bridge's recipe, without its MTP layer).
  const PipelineLayout ds = parse_pipeline_layout("Et|(tt|)*30L", 8);
  EXPECT_EQ(ds.virtual_stages, 4);
  std::vector<int64_t> want(32, 2);
  want.front() = 1;
  want.back() = 0;
  EXPECT_EQ(ds.layers_per_chunk, want);
  // Megatron-Core's own examples: commas are cosmetic, "t*3" repeats a layer.
  EXPECT_EQ(parse_pipeline_layout("Et*3|(tt|)*29,t|L", 16).layers_per_chunk.front(), 3);
  EXPECT_EQ(parse_pipeline_layout("Et*3|(tt|)*29,t|L", 16).virtual_stages, 2);
  EXPECT_EQ(parse_pipeline_layout("Ettt|tttt|tttL", 3).layers_per_chunk,
            (std::vector<int64_t>{3, 4, 3}));
  EXPECT_EQ(parse_pipeline_layout("E|(t|)*4L", 3).layers_per_chunk,
            (std::vector<int64_t>{0, 1, 1, 1, 1, 0}));
  // Written back: runs of equal middle stages as "(...|)*n", and read again unchanged.
  EXPECT_EQ(pipeline_layout_string(want), "Et|(tt|)*30L");
  for (const std::vector<int64_t>& chunks :
       {std::vector<int64_t>{3, 4, 3}, std::vector<int64_t>{0, 1, 1, 1, 1, 0},
        std::vector<int64_t>{5, 0, 5, 5, 2, 2}, std::vector<int64_t>{1, 1}}) {
    const std::string s = pipeline_layout_string(chunks);
    EXPECT_EQ(parse_pipeline_layout(s, 1).layers_per_chunk, chunks) << s;
  }
  using test::error_of;
  const std::string flag = "--pipeline-model-parallel-layout|--pipeline-model-parallel-layout: ";
  auto bad = [](const std::string& layout, int64_t p) {
    return error_of([&] { parse_pipeline_layout(layout, p); });
  };
  EXPECT_EQ(bad("Et|t|tL", 2),
            flag + "has 3 stages, not a multiple of pipeline-model-parallel-size (2)");
  const std::string chars =
      "not one of t (transformer layer), m (multi-token prediction), E (embedding), L (loss), |, "
      "(...)*n or x*n";
  EXPECT_EQ(bad("Et|tx|tL", 3), flag + "has 'x', " + chars);
  EXPECT_EQ(bad("t|EtL", 2), flag + "places the embedding (E) other than first in the first stage");
  EXPECT_EQ(bad("EtL|t", 2), flag + "places the loss (L) other than last in the last stage");
  EXPECT_EQ(bad("Et|tt", 2), flag + "must end with the loss (L)");
  EXPECT_EQ(bad("t|tL", 2), flag + "must begin with the embedding (E)");
  EXPECT_EQ(bad("Et|(tt|*3L", 2), flag + "needs (...)*n for a group, in 'Et|(tt|*3L'");
  EXPECT_EQ(bad("Et|(tt|)L", 2), flag + "needs (...)*n for a group, in 'Et|(tt|)L'");
  EXPECT_EQ(bad("Et|()*2tL", 2), flag + "needs (...)*n for a group, in 'Et|()*2tL'");
  EXPECT_EQ(bad("Et| tL", 2), flag + "has ' ', " + chars);
  EXPECT_EQ(bad("Et*|tL", 2), flag + "has '*', " + chars);
  // Multi-token prediction layers: after the last stage's layers, as Megatron-Core's DeepSeek-V3
  // recipe places its one.
  const PipelineLayout with_mtp = parse_pipeline_layout("Et|(tt|)*30mL", 8);
  EXPECT_EQ(with_mtp.mtp_layers, 1);
  EXPECT_EQ(with_mtp.layers_per_chunk, want);
  EXPECT_EQ(pipeline_layout_string(want, 1), "Et|(tt|)*30mL");
  EXPECT_EQ(pipeline_layout_string({2, 2}, 3), "Ett|ttm*3L");
  EXPECT_EQ(parse_pipeline_layout("Ett|ttm*3L", 1).mtp_layers, 3);
  EXPECT_EQ(bad("Et|mtL", 2),
            flag + "places a transformer layer (t) after a multi-token prediction layer (m)");
  EXPECT_EQ(bad("Etm|tL", 2), flag +
                                  "places multi-token prediction layers (m) other than in the last "
                                  "stage, where ptdp runs them");
  EXPECT_EQ(bad("", 2), flag + "is empty");
  EXPECT_EQ(bad("E(t|)*99999999L", 2),
            flag + "repeats more than 999999 times in 'E(t|)*99999999L'");
  EXPECT_EQ(bad("E(t|)*999999(t|)*999999L", 2), flag + "unrolls to more than a million characters");
}

// A plan with a layout: each chunk's layers are the layout's, the rules check it, and the
// Megatron-LM line carries it (and sets v with it).
TEST(PipelineLayout, PlansWithALayout) {
  const ModelSpec m = toy_model(7);
  ParallelPlan p = two_stages_two_chunks();
  p.layers_per_chunk = {1, 3, 3, 0};
  ASSERT_NO_THROW(p.validate(m));
  EXPECT_EQ(layers_per_model_chunk(m, p), p.layers_per_chunk);
  EXPECT_EQ(p.layers_on_stage(m, 0), 4);
  EXPECT_EQ(p.layers_on_stage(m, 1), 3);
  EXPECT_EQ(p.first_layer_of_chunk(m, 1, 1), 7);
  EXPECT_EQ(p.first_layer_of_chunk(m, 0, 1), 4);
  EXPECT_EQ(p.most_layers_in_a_chunk(m), 3);
  EXPECT_NE(
      p.megatron_flags(m).find(
          "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout \"Et|(t*3|)*2L\""),
      std::string::npos)
      << p.megatron_flags(m);
  EXPECT_EQ(p.megatron_flags(m).find("virtual"), std::string::npos) << p.megatron_flags(m);
  EXPECT_EQ(plan_from_json(to_json(p)).layers_per_chunk, p.layers_per_chunk);
  using test::error_of;
  const std::string flag = "--pipeline-model-parallel-layout|--pipeline-model-parallel-layout: ";
  ParallelPlan q = p;
  q.layers_per_chunk = {1, 3, 3};
  EXPECT_EQ(error_of([&] { q.validate(m); }),
            flag + "has 3 stages, expected pipeline-model-parallel-size * virtual stages (2 * 2)");
  q.layers_per_chunk = {1, 3, 3, 1};
  EXPECT_EQ(error_of([&] { q.validate(m); }), flag + "places more than num_layers (7)");
  q.layers_per_chunk = {1, 3, 2, 0};
  EXPECT_EQ(error_of([&] { q.validate(m); }),
            flag + "places 6 transformer layers, expected num_layers (7)");
  q.layers_per_chunk = {1, 3, 4, -1};
  EXPECT_EQ(error_of([&] { q.validate(m); }), flag + "has a stage of -1 layers");
  q.layers_per_chunk = p.layers_per_chunk;
  q.layers_per_stage = {4, 3};
  EXPECT_EQ(error_of([&] { q.validate(m); }),
            flag + "conflicts with layers_per_stage (give one way to split the layers)");
  // An uneven split Megatron's first/last flags cannot say is written as a layout too.
  ParallelPlan r;
  r.pipeline_parallel = 4;
  r.global_batch_size = 4;
  r.layers_per_stage = {2, 1, 3, 1};
  ASSERT_NO_THROW(r.validate(m));
  EXPECT_NE(r.megatron_flags(m).find("--pipeline-model-parallel-layout \"Ett|t|t*3|tL\""),
            std::string::npos)
      << r.megatron_flags(m);
}

TEST(ParallelPlan, MegatronFlags) {
  const ModelSpec gpt3 = resolve_model("gpt3-175b");
  ParallelPlan p = gpt3_plan();
  p.distributed_optimizer = true;
  EXPECT_EQ(p.megatron_flags(gpt3),
            "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
            "--max-position-embeddings 2048 --vocab-size 51200 --tensor-model-parallel-size 8 "
            "--pipeline-model-parallel-size 16 --micro-batch-size 1 --global-batch-size 1536 "
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            "--use-distributed-optimizer --accumulate-allreduce-grads-in-fp32");

  const ModelSpec llama = resolve_model("llama3-70b");
  ParallelPlan q;
  q.tensor_parallel = 8;
  q.pipeline_parallel = 4;
  q.data_parallel = 2;
  q.virtual_stages = 5;
  q.schedule = Schedule::kInterleaved1F1B;
  q.global_batch_size = 128;
  q.recompute = Recompute::kSelective;
  q.sequence_parallel = true;
  q.overlap_grad_reduce = true;
  q.fp32_grad_reduce = false;
  EXPECT_NO_THROW(q.validate(llama));
  EXPECT_EQ(q.megatron_flags(llama),
            "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --seq-length 8192 "
            "--max-position-embeddings 8192 --vocab-size 128256 --ffn-hidden-size 28672 "
            "--group-query-attention --num-query-groups 8 --swiglu --disable-bias-linear "
            "--normalization RMSNorm --untie-embeddings-and-output-weights "
            "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 "
            "--num-layers-per-virtual-pipeline-stage 4 --micro-batch-size 1 "
            "--global-batch-size 128 --recompute-granularity selective --sequence-parallel "
            "--overlap-grad-reduce --no-overlap-p2p-communication --position-embedding-type rope "
            "--rotary-base 500000 "
            "--attention-dropout 0 --hidden-dropout 0 --use-flash-attn");
}

// ---- found by fuzzing (tests/fuzz/, docs/reliability.md) ----

TEST(FuzzFindings, HugeClustersAreRefusedNamingTheField) {
  json c = to_json(resolve_cluster("dgx-a100-80gb"));
  c["num_nodes"] = 125000000000;  // 10^12 GPUs
  EXPECT_EQ(message_of([&] { cluster_from_json(c); }),
            "num_nodes: 125000000000 nodes of 8 GPUs exceed the 1048576 GPUs ptdp handles");
  c["num_nodes"] = 2;
  c["gpus_per_node"] = int64_t{1} << 62;  // the product would overflow
  EXPECT_EQ(field_of([&] { cluster_from_json(c); }), "gpus_per_node");
  ClusterSpec d = resolve_cluster("dgx-a100-80gb");
  EXPECT_EQ(message_of([&] { d.resize(1000000000000); }),
            "num_gpus: 1000000000000 exceeds the 1048576 GPUs ptdp handles");
  d.resize(kMaxGpus);
  EXPECT_EQ(d.num_gpus(), kMaxGpus);
  EXPECT_NO_THROW(d.validate());
}

TEST(FuzzFindings, ErrorsStayOneLineAndNameAField) {
  // An empty key: the field was "", the message ": unknown key ...".
  EXPECT_EQ(field_of([] { plan_from_json(json{{"", 1}}); }), "\"\"");
  // A line break in a value or a key is shown escaped.
  const std::string m = message_of([] { plan_from_json(json{{"schedule", "1f1b\nx"}}); });
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_NE(m.find("'1f1b\\nx'"), std::string::npos) << m;
  EXPECT_EQ(field_of([] { model_from_json(json{{"a\rb\x01", 1}}); }), "a\\rb\\x01");
}

TEST(FuzzFindings, NumbersOutOfRange) {
  // 2e48 where an integer is expected: converted to int64 before its range was checked.
  EXPECT_EQ(message_of([] { model_from_json(json::parse(R"({"num_hidden_layers": 2e48})")); }),
            "num_hidden_layers: expected an integer, got number 2e+48");
  EXPECT_EQ(field_of([] { model_from_json(json::parse(R"({"hidden_size": -1e300})")); }),
            "hidden_size");
  // A number past a double's range: nlohmann::json's out_of_range escaped read_json_file.
  const std::string huge = write_temp("huge_number.json", R"({"num_layers": 1e999})");
  EXPECT_EQ(field_of([&] { resolve_model(huge); }), "model");
}

TEST(FuzzFindings, HugeModelsAndPlansAreRefusedBeforeAnyProductOverflows) {
  json j = model_json();
  j["hidden_size"] = int64_t{1} << 62;  // 4 * hidden_size (the default FFN width) overflowed
  j["num_attention_heads"] = 1;
  EXPECT_EQ(message_of([&] { model_from_json(j); }),
            "hidden_size: 4611686018427387904 exceeds 16777216, the largest size ptdp handles");
  j = model_json();
  j["seq_length"] = kMaxModelSize;
  EXPECT_NO_THROW(model_from_json(j));
  j["seq_length"] = kMaxModelSize + 1;
  EXPECT_EQ(field_of([&] { model_from_json(j); }), "seq_length");

  const ModelSpec m = resolve_model("gpt3-175b");
  ParallelPlan p;
  p.data_parallel = int64_t{1} << 40;  // d * b overflowed in the batch rule
  p.micro_batch_size = int64_t{1} << 40;
  p.global_batch_size = int64_t{1} << 62;
  EXPECT_EQ(first_violated_rule(m, p), PlanRule::kSizesInRange);
  EXPECT_EQ(field_of([&] { p.validate(m); }), "data_parallel");
  p.data_parallel = 4;
  EXPECT_EQ(field_of([&] { p.validate(m); }), "--micro-batch-size");
  // Stage sizes whose sum overflowed int64.
  ParallelPlan u;
  u.pipeline_parallel = 2;
  u.layers_per_stage = {INT64_MAX, INT64_MAX};
  EXPECT_EQ(message_of([&] { u.validate(m); }),
            "layers_per_stage: sums to more than num_layers (96)");
}

namespace output_file {
namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("ptdp_output_file_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}
std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
size_t entries(const fs::path& d) {
  return static_cast<size_t>(std::distance(fs::directory_iterator(d), fs::directory_iterator()));
}

// A link is followed: its target gets the new contents and the link stays a link.
TEST(OutputFile, ALinkIsFollowedAndKept) {
  const fs::path d = fresh_dir("link");
  std::ofstream(d / "target.json") << "old";
  fs::create_symlink("target.json", d / "link.json");  // relative, as users make them
  write_file_atomically((d / "link.json").string(), "new", "--out");
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(d / "link.json")));
  EXPECT_EQ(read(d / "target.json"), "new");
  EXPECT_EQ(entries(d), 2u);  // no temporary file left
}

// A FIFO, a directory or an empty name is refused naming the flag, and left as it was.
TEST(OutputFile, NonRegularTargetsAreRefusedAndKept) {
  const fs::path d = fresh_dir("special");
  const fs::path fifo = d / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(test::field_of([&] { write_file_atomically(fifo.string(), "x", "--trace"); }),
            "--trace");
  EXPECT_EQ(test::field_of([&] { check_writable(fifo.string(), "--svg"); }), "--svg");
  EXPECT_TRUE(fs::is_fifo(fs::symlink_status(fifo)));
  fs::create_symlink(fifo, d / "to_fifo");
  EXPECT_EQ(test::field_of([&] { write_file_atomically((d / "to_fifo").string(), "x", "--out"); }),
            "--out");
  EXPECT_EQ(test::field_of([&] { write_file_atomically(d.string(), "x", "--out"); }), "--out");
  EXPECT_EQ(test::field_of([&] { write_file_atomically("", "x", "output"); }), "output");
  EXPECT_EQ(test::field_of([&] { write_file_atomically((d / "no" / "f").string(), "x", "--out"); }),
            "--out");
  EXPECT_EQ(entries(d), 2u);  // the FIFO and the link, nothing else
}

// Standard streams and descriptors are links into /proc: renaming over what they name would
// drop an appended log (`tokenize in.txt /dev/stdout >> log`), so they are refused.
TEST(OutputFile, StreamsAreRefused) {
  for (const char* p : {"/dev/stdout", "/dev/stderr", "/proc/self/fd/1"})
    EXPECT_EQ(test::field_of([&] { check_writable(p, "--out"); }), "--out") << p;
}

// A replaced file keeps its permissions.
TEST(OutputFile, AReplacedFileKeepsItsMode) {
  const fs::path d = fresh_dir("mode");
  const fs::path f = d / "private.json";
  std::ofstream(f) << "old";
  fs::permissions(f, fs::perms::owner_read | fs::perms::owner_write);
  write_file_atomically(f.string(), "new", "--out");
  EXPECT_EQ(fs::status(f).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(read(f), "new");
}

// Contents reach the file only at commit(); an output dropped before it leaves nothing behind.
TEST(OutputFile, OnlyACommittedFileAppears) {
  const fs::path d = fresh_dir("commit");
  const fs::path f = d / "out.bin";
  std::ofstream(f) << "previous";
  {
    AtomicOutputFile out(f.string(), "--out");
    out.stream() << std::string(200000, 'z');  // past the stream's buffer
    EXPECT_EQ(read(f), "previous");
    EXPECT_TRUE(fs::exists(out.temporary_path()));
  }
  EXPECT_EQ(read(f), "previous");
  EXPECT_EQ(entries(d), 1u);
  AtomicOutputFile out(f.string(), "--out");
  out.stream() << std::string(200000, 'z');
  out.commit();
  EXPECT_EQ(read(f), std::string(200000, 'z'));
  EXPECT_EQ(entries(d), 1u);
}

// A process stopped by SIGINT, SIGTERM or SIGHUP while writing (Ctrl-C during a checkpoint
// save) removes its temporary files and still ends by that signal (found by exploratory
// testing: a 113 MB shard's temporary file stayed under a name no run reuses).
TEST(OutputFile, AStopSignalRemovesTheTemporaryFile) {
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    const fs::path d = fresh_dir("signal" + std::to_string(sig));
    const fs::path f = d / "shard.bin";
    std::ofstream(f) << "previous";
    EXPECT_EXIT(
        {
          AtomicOutputFile first(f.string(), "--save");
          first.stream() << std::string(200000, 'z');
          AtomicOutputFile second((d / "other.bin").string(), "--save");
          second.stream() << "partial";
          second.stream().flush();
          if (fs::exists(first.temporary_path()) && fs::exists(second.temporary_path()))
            std::raise(sig);
          std::exit(0);  // the files were not created: the test fails
        },
        ::testing::KilledBySignal(sig), "");
    EXPECT_EQ(read(f), "previous");
    EXPECT_EQ(entries(d), 1u) << "signal " << sig;
  }
}

}  // namespace output_file

}  // namespace
}  // namespace ptdp
