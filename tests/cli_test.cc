// The command line, run in-process: outputs, JSON keys, and one-line errors with exit status 2.
#include "cli/cli.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>

#include "cli/dry_run.h"
#include "cli/trace_file.h"
#include "core/presets.h"
#include "tests/support/cli_run.h"

namespace ptdp {
namespace {

using Result = test::CliResult;
constexpr auto run = &test::run_ptdp;

std::string temp_file(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / ("ptdp_cli_test_" + name);
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

const std::vector<std::string> kPredict175B = {"predict",
                                               "--num-layers",
                                               "96",
                                               "--hidden-size",
                                               "12288",
                                               "--num-attention-heads",
                                               "96",
                                               "--seq-length",
                                               "2048",
                                               "--vocab-size",
                                               "51200",
                                               "--cluster",
                                               "dgx-a100-80gb",
                                               "--num-gpus",
                                               "1024",
                                               "--global-batch-size",
                                               "1536",
                                               "--tensor-model-parallel-size",
                                               "8",
                                               "--pipeline-model-parallel-size",
                                               "16",
                                               "--micro-batch-size",
                                               "1"};

// `ptdp run` says what it runs differently from what the plan prices: nothing for a plain plan,
// one clause per setting it does not execute, and only where the setting has an effect.
TEST(Cli, RunSaysWhichPricedSettingsItDoesNotExecute) {
  ModelSpec m = resolve_model("gpt-1.7b");
  m.attention_dropout = m.hidden_dropout = 0;
  ParallelPlan p;
  p.tensor_parallel = 2;
  p.data_parallel = 2;
  EXPECT_EQ(execution_note(m, p), "");
  p.fp32_grad_reduce = false;
  EXPECT_NE(execution_note(m, p).find("--fp16-grad-reduce"), std::string::npos);
  p.data_parallel = 1;  // nothing to reduce
  EXPECT_EQ(execution_note(m, p), "");
  p.sequence_parallel = true;
  p.tp_comm_overlap = true;
  const std::string note = execution_note(m, p);
  EXPECT_NE(note.find("--tp-comm-overlap"), std::string::npos);
  EXPECT_EQ(note.find('\n'), std::string::npos);
  // Megatron-FSDP's gradient and weight sharding runs sharded (runtime/fsdp.h) at p = 1, in one
  // optimizer instance or in two with whole copies across them (HSDP), with multi-token
  // prediction too: nothing to say, the plan as given. Where it does not (HFSDP's states sharded
  // across the instances), it runs as the distributed optimizer, which does the same arithmetic,
  // and says so; no_shard and optim are DDP's and the distributed optimizer's.
  ParallelPlan f;
  f.data_parallel = 4;
  f.distributed_optimizer = true;
  ModelSpec with_mtp = m;
  with_mtp.mtp_num_layers = 1;
  for (FsdpSharding s :
       {FsdpSharding::kOptim, FsdpSharding::kOptimGrads, FsdpSharding::kOptimGradsParams}) {
    f.fsdp = s;
    for (const int64_t instances : {1, 2}) {
      f.optimizer_instances = instances;
      EXPECT_EQ(execution_note(m, f), "") << to_string(s);
      EXPECT_EQ(executed_plan(m, f).fsdp, f.shards_gradients() ? s : FsdpSharding::kOff);
    }
    f.optimizer_instances = 1;
    EXPECT_EQ(execution_note(with_mtp, f), "") << to_string(s);
    EXPECT_EQ(executed_plan(with_mtp, f).fsdp, f.shards_gradients() ? s : FsdpSharding::kOff);
  }
  f.fsdp = FsdpSharding::kOptimGradsParams;
  f.optimizer_instances = 2;
  f.fsdp_outer = FsdpSharding::kOptim;  // HFSDP
  EXPECT_NE(execution_note(m, f).find("is priced, not run"), std::string::npos);
  EXPECT_EQ(executed_plan(m, f).fsdp, FsdpSharding::kOff);
  // Multi-token prediction runs (runtime/gpt_model.h): nothing to say, nothing dropped.
  ModelSpec mtp = resolve_model("deepseek-v2-lite");
  mtp.mtp_num_layers = 1;
  EXPECT_EQ(execution_note(mtp, ParallelPlan{}).find("multi-token"), std::string::npos);
  EXPECT_EQ(as_executed(mtp, ParallelPlan{}).mtp_num_layers, 1);
}

// Context parallelism runs fused attention whatever the model asks (as Megatron-Core and the op
// list): nothing to say, and the model as executed (what reconcile prices) has it.
TEST(Cli, ContextParallelRunsFusedAttention) {
  ModelSpec m = resolve_model("gpt-1.7b");
  m.attention_dropout = m.hidden_dropout = 0;
  ParallelPlan p;
  p.context_parallel = 2;
  for (const bool flash : {false, true}) {
    m.flash_attention = flash;
    EXPECT_EQ(execution_note(m, p), "");
    EXPECT_TRUE(as_executed(m, p).flash_attention);
  }
  // Every --cp-comm-type runs as priced (a2a as Ulysses' all-to-alls, keeping what they moved
  // for the backward pass as Transformer Engine does; the others as the K/V gather).
  for (const CpComm c : {CpComm::kP2P, CpComm::kAllGather, CpComm::kA2A}) {
    p.cp_comm = c;
    EXPECT_EQ(execution_note(m, p), "");
    EXPECT_EQ(executed_plan(m, p).cp_comm, c);
  }
  p.context_parallel = 1;
  m.flash_attention = false;
  EXPECT_FALSE(as_executed(m, p).flash_attention);
}

// A context-parallel plan's prediction lists the plan with each --cp-comm-type the rules allow
// (Llama-2-7B is MHA: 16 heads per tensor rank take a2a at cp 16; Llama-3-8B's 4 query groups
// per rank do not), its own type's line being the prediction itself.
TEST(Cli, PredictListsEachCpCommTypeOfAContextParallelPlan) {
  std::vector<std::string> args = {"predict",
                                   "--model",
                                   "llama2-7b",
                                   "--cluster",
                                   "dgx-h100",
                                   "--seq-length",
                                   "16384",
                                   "--num-gpus",
                                   "128",
                                   "--global-batch-size",
                                   "64",
                                   "--bf16",
                                   "--tensor-model-parallel-size",
                                   "2",
                                   "--context-parallel-size",
                                   "16",
                                   "--pipeline-model-parallel-size",
                                   "4",
                                   "--micro-batch-size",
                                   "1",
                                   "--sequence-parallel",
                                   "--json"};
  Result r = run(args);
  ASSERT_EQ(r.status, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  const auto& types = j.at("cp_comm_types");
  EXPECT_EQ(types.size(), 4u) << types.dump();
  EXPECT_DOUBLE_EQ(types.at("p2p").at("iteration_time_s").get<double>(),
                   j.at("iteration_time_s").get<double>());
  // a2a+p2p at the sizes ptdp plan takes: all-to-alls over 4 ranks (t 2 x 4 fill a node), a
  // ring over the 4 nodes.
  EXPECT_EQ(types.at("a2a+p2p").at("hierarchical_context_parallel_sizes"),
            nlohmann::json::array({4, 4}));
  // The ring crosses nodes on one NIC per step behind attention blocks of 1024 queries.
  EXPECT_LT(types.at("a2a").at("iteration_time_s").get<double>(),
            types.at("p2p").at("iteration_time_s").get<double>());
  args[2] = "llama3-8b";
  r = run(args);
  ASSERT_EQ(r.status, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_FALSE(j.at("cp_comm_types").contains("a2a")) << r.out;
  // Its 4 query groups per rank split over a2a+p2p's all-to-all of 4.
  EXPECT_TRUE(j.at("cp_comm_types").contains("a2a+p2p")) << r.out;
  args.pop_back();  // the table
  r = run(args);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("  p2p"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("<- this plan"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("  a2a "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  a2a+p2p 4x4"), std::string::npos) << r.out;
  // The plan itself as a2a+p2p: the table marks it with its sizes.
  args.insert(args.end(),
              {"--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "8"});
  r = run(args);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("a2a+p2p 2x8         "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(a2a+p2p: all-to-alls over 2, a ring of 8)"), std::string::npos) << r.out;
  // A p2p plan lists a2a+p2p with the sizes ptdp plan would take, the fastest of those whose
  // all-to-all group fits a node: Llama 3 8B at 64k tokens, t1 cp16 on 8-GPU nodes (A 2, 4, 8),
  // each priced as the plan itself.
  const std::vector<std::string> ring = {"predict",
                                         "--model",
                                         "llama3-8b",
                                         "--cluster",
                                         "dgx-h100",
                                         "--seq-length",
                                         "65536",
                                         "--num-gpus",
                                         "128",
                                         "--global-batch-size",
                                         "64",
                                         "--bf16",
                                         "--tensor-model-parallel-size",
                                         "1",
                                         "--context-parallel-size",
                                         "16",
                                         "--pipeline-model-parallel-size",
                                         "1",
                                         "--micro-batch-size",
                                         "1",
                                         "--use-distributed-optimizer",
                                         "--json"};
  r = run(ring);
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json listed = nlohmann::json::parse(r.out).at("cp_comm_types").at("a2a+p2p");
  const double listed_s = listed.at("iteration_time_s").get<double>();
  for (const int64_t a : {2, 4, 8}) {
    std::vector<std::string> pinned = ring;
    pinned.insert(pinned.end(),
                  {"--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                   std::to_string(a), std::to_string(16 / a)});
    r = run(pinned);
    ASSERT_EQ(r.status, 0) << r.err;
    const double s = nlohmann::json::parse(r.out).at("iteration_time_s").get<double>();
    EXPECT_LE(listed_s, s * (1 + 1e-12)) << "all-to-alls over " << a;
    if (listed.at("hierarchical_context_parallel_sizes")[0].get<int64_t>() == a) {
      EXPECT_DOUBLE_EQ(listed_s, s);
    }
  }
}

TEST(Cli, PredictJsonHasTheDocumentedKeys) {
  auto args = kPredict175B;
  args.push_back("--json");
  const Result r = run(args);
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* key : {"iteration_time_s", "tokens_per_s", "model_tflops_per_gpu",
                          "hardware_tflops_per_gpu", "mfu", "fits"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  for (const char* key :
       {"weights_gib", "gradients_gib", "optimizer_gib", "activations_gib", "peak_gib"}) {
    EXPECT_TRUE(j["memory"].contains(key)) << key;
  }
  for (const char* key : {"compute_s", "recompute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s",
                          "pp_comm_s", "dp_comm_s", "bubble_s", "optimizer_s"}) {
    EXPECT_TRUE(j["breakdown"].contains(key)) << key;
  }
  double sum = 0;
  for (auto& [k, v] : j["breakdown"].items()) sum += v.get<double>();
  EXPECT_NEAR(sum, j["iteration_time_s"].get<double>(), 1e-9);
  EXPECT_GT(j["mfu"].get<double>(), 0.2);
  EXPECT_LT(j["mfu"].get<double>(), 0.8);
}

TEST(Cli, PlanPrintsTableFlagsAndTrainingTime) {
  const Result r = run({"plan", "--model", "gpt3-175b", "--num-gpus", "1024", "--global-batch-size",
                        "1536", "--train-tokens", "300e9", "--top", "5"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("--tensor-model-parallel-size"), std::string::npos);
  EXPECT_NE(r.out.find("days"), std::string::npos);
  EXPECT_NE(r.out.find("rejected"), std::string::npos);
}

// Re-ranked by simulation, the days to train are the simulated winner's (they were its analytic
// time's while the ranking was the simulated one's: found by exploratory testing).
TEST(Cli, SimulatedRankingPricesTheTrainingDaysWithTheSimulatedTime) {
  const Result r = run({"plan", "--model", "gpt-7.5b", "--num-gpus", "128", "--global-batch-size",
                        "512", "--json", "--top", "3", "--simulate-top", "5", "--train-tokens",
                        "1e11", "--overlap-grad-reduce"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  const double sim = j["plans"][0]["simulated_iteration_time_s"].get<double>();
  const double tokens_per_iteration = 512.0 * 2048.0;
  EXPECT_NEAR(j["train_days"].get<double>(), 1e11 / tokens_per_iteration * sim / 86400.0,
              1e-9 * j["train_days"].get<double>());
}

TEST(Cli, PlanJsonListsPlansBestFirst) {
  const Result r = run({"plan", "--model", "gpt-7.5b", "--num-gpus", "128", "--global-batch-size",
                        "512", "--json", "--top", "4"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["plans"].size(), 4u);
  for (size_t i = 1; i < 4; ++i) {
    EXPECT_GE(j["plans"][i]["iteration_time_s"].get<double>(),
              j["plans"][i - 1]["iteration_time_s"].get<double>());
    EXPECT_TRUE(j["plans"][i].contains("configuration"));
  }
}

// `args` with `extra` after them.
std::vector<std::string> plus(std::vector<std::string> args,
                              std::initializer_list<const char*> extra) {
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

void expect_bad(const std::vector<std::string>& args, const std::string& names) {
  const Result r = run(args);
  EXPECT_EQ(r.status, 2) << names << ": " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(names), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

std::vector<std::string> predict_with(const std::string& flag, const std::string& value) {
  auto args = kPredict175B;
  auto it = std::find(args.begin(), args.end(), flag);
  if (it == args.end()) {
    args.push_back(flag);
    args.push_back(value);
  } else {
    *(it + 1) = value;
  }
  return args;
}

TEST(CliErrors, UnknownSubcommand) {
  expect_bad({"plna"}, "plna");
}
TEST(CliErrors, NonNumericFlag) {
  expect_bad(predict_with("--num-gpus", "many"), "--num-gpus");
}
TEST(CliErrors, NegativeSize) {
  expect_bad(predict_with("--hidden-size", "-4"), "--hidden-size");
}
// --kv-channels: a head width of its own, positive (0: the default) and bounded; GPT-3's learned
// positions take any width, a rotary model only an even one.
TEST(CliErrors, KvChannels) {
  expect_bad(predict_with("--kv-channels", "-4"), "--kv-channels");
  expect_bad(predict_with("--kv-channels", "99999999"), "--kv-channels");
  auto rotary = predict_with("--kv-channels", "7");
  rotary.insert(rotary.end(), {"--position-embedding-type", "rope"});
  expect_bad(rotary, "--kv-channels");
  const Result ok = run(predict_with("--kv-channels", "7"));
  EXPECT_EQ(ok.status, 0) << ok.err;
}
// Multi-head latent attention's flags: its widths only with --multi-latent-attention, each named
// where it is out of range or conflicts with the rest of the model.
TEST(CliErrors, MultiLatentAttention) {
  expect_bad(predict_with("--q-lora-rank", "64"), "--q-lora-rank");
  auto mla = [](std::initializer_list<const char*> extra) {
    std::vector<std::string> a = {"predict",
                                  "--model",
                                  "deepseek-v2-lite",
                                  "--num-gpus",
                                  "8",
                                  "--global-batch-size",
                                  "64",
                                  "--tensor-model-parallel-size",
                                  "1",
                                  "--pipeline-model-parallel-size",
                                  "1",
                                  "--expert-model-parallel-size",
                                  "8",
                                  "--micro-batch-size",
                                  "1"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  expect_bad(mla({"--kv-lora-rank", "-1"}), "--kv-lora-rank");
  expect_bad(mla({"--qk-pos-emb-head-dim", "7"}), "--qk-pos-emb-head-dim");
  expect_bad(mla({"--v-head-dim", "512"}), "--v-head-dim");
  expect_bad(mla({"--kv-channels", "64"}), "--kv-channels");
  // Context parallelism runs with MLA: its ring carries keys and values of their own widths.
  const Result cp = run(mla({"--context-parallel-size", "2", "--expert-model-parallel-size", "4"}));
  EXPECT_EQ(cp.status, 0) << cp.err;
  const Result ok = run(mla({"--q-lora-rank", "512", "--json"}));
  ASSERT_EQ(ok.status, 0) << ok.err;
  EXPECT_NE(nlohmann::json::parse(ok.out)["megatron_flags"].get<std::string>().find(
                "--qk-layernorm --multi-latent-attention --q-lora-rank 512 --kv-lora-rank 512 "
                "--qk-head-dim 128 "
                "--qk-pos-emb-head-dim 64 --v-head-dim 128"),
            std::string::npos);
}
// Megatron-Core's --account-for-embedding-in-pipeline-split and
// --account-for-loss-in-pipeline-split: at v = 1 the split that the first and last stages'
// layer counts give (36 layers and the two modules over p = 2: 18 + 18), printed that way;
// an uneven split over p (or over p * v chunks with interleaving), or beside an explicit split,
// refused by name.
TEST(Cli, AccountingForTheEmbeddingAndLossSplitsAsMegatronDoes) {
  const std::vector<std::string> base = {"predict",  "--model",
                                         "gpt-7.5b", "--num-gpus",
                                         "64",       "--global-batch-size",
                                         "128",      "--tensor-model-parallel-size",
                                         "4",        "--pipeline-model-parallel-size",
                                         "2",        "--micro-batch-size",
                                         "1",        "--json"};
  auto with = [&](std::initializer_list<const char*> extra) { return plus(base, extra); };
  const Result both = run(
      with({"--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"}));
  const Result explicit_split = run(with(
      {"--decoder-first-pipeline-num-layers", "18", "--decoder-last-pipeline-num-layers", "18"}));
  ASSERT_EQ(both.status, 0) << both.err;
  ASSERT_EQ(explicit_split.status, 0) << explicit_split.err;
  const auto a = nlohmann::json::parse(both.out), b = nlohmann::json::parse(explicit_split.out);
  EXPECT_EQ(a["iteration_time_s"], b["iteration_time_s"]);
  EXPECT_EQ(a["megatron_flags"], b["megatron_flags"]);
  EXPECT_EQ(run(with({"--account-for-embedding-in-pipeline-split"})).status, 2);  // 37 over 2
  expect_bad(with({"--account-for-loss-in-pipeline-split"}),
             "--account-for-loss-in-pipeline-split");
  expect_bad(
      with({"--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
            "--num-virtual-stages-per-pipeline-rank", "2"}),
      "--account-for-embedding-in-pipeline-split");
  expect_bad(
      with({"--account-for-loss-in-pipeline-split", "--decoder-first-pipeline-num-layers", "17"}),
      "--account-for-loss-in-pipeline-split");
}
// With interleaving the embedding and the loss take a layer's place in the first and the last
// model chunk (Megatron-Core's get_num_layers_to_build): 34 layers and the two modules over
// p = 2, v = 2 are chunks of 8, 9, 9 and 8 layers, the layout Megatron-Core's
// --pipeline-model-parallel-layout states; either way the same plan, time and memory, printed as
// that layout, which reads back to the same plan. A layout conflicting with other split flags,
// or with a v it does not make, is refused naming the flag.
TEST(Cli, PipelineLayoutsAndInterleavedAccounting) {
  const std::vector<std::string> base = {"predict",  "--model",
                                         "gpt-7.5b", "--num-layers",
                                         "34",       "--num-gpus",
                                         "64",       "--global-batch-size",
                                         "128",      "--tensor-model-parallel-size",
                                         "4",        "--pipeline-model-parallel-size",
                                         "2",        "--micro-batch-size",
                                         "1",        "--json"};
  auto with = [&](std::initializer_list<const char*> extra) { return plus(base, extra); };
  const Result accounted =
      run(with({"--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                "--num-virtual-stages-per-pipeline-rank", "2"}));
  const Result layout = run(with({"--pipeline-model-parallel-layout", "Et*8|t*9|t*9|t*8L"}));
  ASSERT_EQ(accounted.status, 0) << accounted.err;
  ASSERT_EQ(layout.status, 0) << layout.err;
  const auto a = nlohmann::json::parse(accounted.out), b = nlohmann::json::parse(layout.out);
  EXPECT_EQ(a["configuration"]["layers_per_chunk"], nlohmann::json({8, 9, 9, 8}));
  EXPECT_EQ(a["configuration"]["virtual_stages"], 2);
  EXPECT_EQ(a["configuration"], b["configuration"]);
  EXPECT_EQ(a["iteration_time_s"], b["iteration_time_s"]);
  EXPECT_EQ(a["memory"], b["memory"]);
  const std::string flags = a["megatron_flags"].get<std::string>();
  EXPECT_NE(flags.find("--pipeline-model-parallel-layout \"Et*8|(t*9|)*2t*8L\""), std::string::npos)
      << flags;
  EXPECT_EQ(flags.find("virtual"), std::string::npos) << flags;
  const Result again = run(with({"--pipeline-model-parallel-layout", "Et*8|(t*9|)*2t*8L"}));
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_EQ(nlohmann::json::parse(again.out)["configuration"], a["configuration"]);
  // A layout that moves a layer from rank 1 to rank 0 changes the stages' loads.
  const Result moved = run(with({"--pipeline-model-parallel-layout", "Et*9|t*9|t*9|t*7L"}));
  ASSERT_EQ(moved.status, 0) << moved.err;
  EXPECT_NE(nlohmann::json::parse(moved.out)["iteration_time_s"], a["iteration_time_s"]);

  expect_bad(with({"--pipeline-model-parallel-layout", "Et*8|t*9|t*9|t*8L",
                   "--num-virtual-stages-per-pipeline-rank", "4"}),
             "--num-virtual-stages-per-pipeline-rank");
  expect_bad(with({"--pipeline-model-parallel-layout", "Et*8|t*9|t*9|t*8L",
                   "--decoder-first-pipeline-num-layers", "4"}),
             "--pipeline-model-parallel-layout");
  expect_bad(with({"--pipeline-model-parallel-layout", "Et*8|t*9|t*9|t*7L"}),
             "--pipeline-model-parallel-layout");  // 33 layers placed
  expect_bad(with({"--pipeline-model-parallel-layout", "Et*8|t*9|t*9|t*8"}),
             "--pipeline-model-parallel-layout");  // no loss
  // `ptdp plan` with a layout: the baseline it compares with; the search's own candidates are
  // laid out for their own p and v.
  const Result planned = run({"plan",
                              "--model",
                              "gpt-7.5b",
                              "--num-layers",
                              "34",
                              "--num-gpus",
                              "64",
                              "--global-batch-size",
                              "128",
                              "--tensor-model-parallel-size",
                              "4",
                              "--pipeline-model-parallel-size",
                              "2",
                              "--micro-batch-size",
                              "1",
                              "--pipeline-model-parallel-layout",
                              "Et*8|t*9|t*9|t*8L",
                              "--top",
                              "10",
                              "--json",
                              "--no-progress"});
  ASSERT_EQ(planned.status, 0) << planned.err;
  EXPECT_EQ(nlohmann::json::parse(planned.out)["plans"].size(), 10u);
  // Without interleaving a layout is a stage split: the even one here, priced as the plan
  // without it.
  const Result plain = run(base),
               even = run(with({"--pipeline-model-parallel-layout", "Et*17|t*17L"}));
  ASSERT_EQ(even.status, 0) << even.err;
  EXPECT_EQ(nlohmann::json::parse(even.out)["iteration_time_s"],
            nlohmann::json::parse(plain.out)["iteration_time_s"]);
  EXPECT_EQ(nlohmann::json::parse(even.out)["memory"], nlohmann::json::parse(plain.out)["memory"]);
}
// --mtp-num-layers and --mtp-loss-scaling-factor: priced on the command line as in the model
// file, printed among the Megatron-LM flags, refused by name where they cannot apply; a layout
// places the model's modules ('m') or is refused.
TEST(Cli, MultiTokenPredictionFlags) {
  const std::vector<std::string> base = {"predict",
                                         "--model",
                                         "deepseek-v2-lite",
                                         "--num-gpus",
                                         "24",
                                         "--global-batch-size",
                                         "64",
                                         "--tensor-model-parallel-size",
                                         "1",
                                         "--pipeline-model-parallel-size",
                                         "3",
                                         "--expert-model-parallel-size",
                                         "8",
                                         "--micro-batch-size",
                                         "1",
                                         "--json"};
  auto with = [&](std::initializer_list<const char*> extra) { return plus(base, extra); };
  const Result plain = run(base), mtp = run(with({"--mtp-num-layers", "1"}));
  ASSERT_EQ(plain.status, 0) << plain.err;
  ASSERT_EQ(mtp.status, 0) << mtp.err;
  const auto a = nlohmann::json::parse(plain.out), b = nlohmann::json::parse(mtp.out);
  EXPECT_GT(b["iteration_time_s"].get<double>(), a["iteration_time_s"].get<double>());
  // Model FLOPs a token (TFLOP/s over tokens/s) grow by the module's.
  auto flops_per_token = [](const nlohmann::json& j) {
    return j["model_tflops_per_gpu"].get<double>() / j["tokens_per_s"].get<double>();
  };
  EXPECT_GT(flops_per_token(b), flops_per_token(a));
  EXPECT_NE(b["megatron_flags"].get<std::string>().find("--mtp-num-layers 1"), std::string::npos);
  EXPECT_EQ(a["megatron_flags"].get<std::string>().find("--mtp"), std::string::npos);
  const Result layout =
      run(with({"--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Et*9|t*9|t*9mL"}));
  ASSERT_EQ(layout.status, 0) << layout.err;
  expect_bad(with({"--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Et*9|t*9|t*9L"}),
             "--pipeline-model-parallel-layout: places 0 multi-token prediction layer(s) (m), but "
             "the model has 1 (--mtp-num-layers)");
  expect_bad(with({"--mtp-num-layers", "-1"}), "--mtp-num-layers: must be in [0, 64], got -1");
  expect_bad(with({"--mtp-loss-scaling-factor", "0.2"}),
             "--mtp-loss-scaling-factor: needs --mtp-num-layers");
  expect_bad({"predict", "--model", "gpt-1.7b", "--num-gpus", "8", "--global-batch-size", "64",
              "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
              "--micro-batch-size", "1", "--mtp-num-layers", "1"},
             "--mtp-num-layers: multi-token prediction needs rotary");
}
TEST(CliErrors, ZeroLayers) {
  expect_bad(predict_with("--num-layers", "0"), "--num-layers");
}
TEST(CliErrors, TensorParallelNotDividingHeads) {
  expect_bad(predict_with("--tensor-model-parallel-size", "5"), "--num-gpus");
  auto args = predict_with("--tensor-model-parallel-size", "64");  // 96 heads
  expect_bad(args, "--tensor-model-parallel-size");
}
TEST(CliErrors, BatchNotDivisible) {
  expect_bad(predict_with("--global-batch-size", "1001"), "--global-batch-size");
}
TEST(CliErrors, PipelineAboveLayers) {
  auto args = predict_with("--pipeline-model-parallel-size", "128");
  expect_bad(args, "--pipeline-model-parallel-size");
}
// Megatron's --decoder-first/last-pipeline-num-layers: the other stages share the rest evenly,
// the flags come back in the printed plan, and a split that does not divide is refused.
TEST(Cli, UnevenPipelineStagesFromMegatronFlags) {
  auto args = predict_with("--num-layers", "94");  // 96 layers do not allow 94 on p = 16
  args.insert(args.end(), {"--decoder-first-pipeline-num-layers", "4",
                           "--decoder-last-pipeline-num-layers", "6", "--json"});
  const Result r = run(args);
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  std::vector<int64_t> expected(16, 6);  // (94 - 4 - 6) / 14
  expected.front() = 4;
  EXPECT_EQ(j["configuration"]["layers_per_stage"].get<std::vector<int64_t>>(), expected);
  EXPECT_NE(
      r.out.find("--decoder-first-pipeline-num-layers 4 --decoder-last-pipeline-num-layers 6"),
      std::string::npos);
}
TEST(CliErrors, UnevenStagesThatDoNotDivide) {
  auto args = predict_with("--decoder-first-pipeline-num-layers", "5");  // 91 over 15 stages
  expect_bad(args, "--decoder-first-pipeline-num-layers");
  expect_bad(predict_with("--decoder-last-pipeline-num-layers", "0"),
             "--decoder-last-pipeline-num-layers");
  args = predict_with("--num-virtual-stages-per-pipeline-rank", "2");
  args.insert(args.end(), {"--num-layers-per-virtual-pipeline-stage", "3"});
  expect_bad(args, "--num-virtual-stages-per-pipeline-rank");
}
// Context and expert parallelism: predict prices them, reports dense and expert memory apart,
// and refuses values Megatron cannot run, naming the flag or field.
const std::vector<std::string> kPredictMixtral = {"predict",
                                                  "--model",
                                                  "mixtral-8x7b",
                                                  "--cluster",
                                                  "dgx-h100",
                                                  "--num-gpus",
                                                  "64",
                                                  "--global-batch-size",
                                                  "256",
                                                  "--seq-length",
                                                  "4096",
                                                  "--pipeline-model-parallel-size",
                                                  "4",
                                                  "--tensor-model-parallel-size",
                                                  "1",
                                                  "--micro-batch-size",
                                                  "1",
                                                  "--use-distributed-optimizer"};

TEST(Cli, PredictReportsDenseAndExpertMemoryAndExpertParallelismShrinksIt) {
  auto args = kPredictMixtral;
  args.insert(args.end(), {"--json"});
  const Result one = run(args);
  ASSERT_EQ(one.status, 0) << one.err;
  args.insert(args.end(), {"--expert-model-parallel-size", "8"});
  const Result eight = run(args);
  ASSERT_EQ(eight.status, 0) << eight.err;
  const auto a = nlohmann::json::parse(one.out), b = nlohmann::json::parse(eight.out);
  const auto& ea = a["memory"]["expert"];
  const auto& eb = b["memory"]["expert"];
  // 8 experts over 8 ranks: each holds an eighth of the expert weights, dense weights unchanged.
  EXPECT_NEAR(eb["weights_gib"].get<double>() * 8, ea["weights_gib"].get<double>(), 1e-6);
  EXPECT_DOUBLE_EQ(b["memory"]["dense"]["weights_gib"].get<double>(),
                   a["memory"]["dense"]["weights_gib"].get<double>());
  EXPECT_GT(ea["weights_gib"].get<double>(), a["memory"]["dense"]["weights_gib"].get<double>());
  EXPECT_EQ(b["configuration"]["expert_parallel"], 8);
  EXPECT_NE(b["megatron_flags"].get<std::string>().find("--expert-model-parallel-size 8"),
            std::string::npos);
  // The all-to-alls are expert-parallel communication in the breakdown, not tensor-parallel:
  // none without expert parallelism, and neither plan has t > 1 collectives.
  EXPECT_EQ(a["breakdown"]["ep_comm_s"].get<double>(), 0);
  EXPECT_GT(b["breakdown"]["ep_comm_s"].get<double>(), 0);
  EXPECT_EQ(a["configuration"]["tensor_parallel"], 1);
  EXPECT_EQ(b["breakdown"]["tp_comm_s"].get<double>(), 0);
  EXPECT_EQ(b["breakdown"]["cp_comm_s"].get<double>(), 0);
  // The load measured by a run (ptdp reconcile) prices the experts in place of the assumed
  // 1.1: a busier rank, a longer step; ptdp's own setting, not a Megatron flag.
  args.insert(args.end(), {"--moe-expert-load", "1.6"});
  const Result loaded = run(args);
  ASSERT_EQ(loaded.status, 0) << loaded.err;
  const auto c = nlohmann::json::parse(loaded.out);
  EXPECT_GT(c["iteration_time_s"].get<double>(), 1.05 * b["iteration_time_s"].get<double>());
  EXPECT_EQ(c["megatron_flags"].get<std::string>().find("expert-load"), std::string::npos);
  // Without expert parallelism one rank computes every token: the load does not apply.
  auto unsharded = kPredictMixtral;
  unsharded.insert(unsharded.end(), {"--json", "--moe-expert-load", "1.6"});
  const Result same = run(unsharded);
  ASSERT_EQ(same.status, 0) << same.err;
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(same.out)["iteration_time_s"].get<double>(),
                   a["iteration_time_s"].get<double>());
}

TEST(Cli, ContextParallelismSplitsTheSequencesActivations) {
  const std::vector<std::string> base = {"predict",
                                         "--model",
                                         "llama3-8b",
                                         "--cluster",
                                         "dgx-h100",
                                         "--num-gpus",
                                         "16",
                                         "--global-batch-size",
                                         "16",
                                         "--seq-length",
                                         "65536",
                                         "--tensor-model-parallel-size",
                                         "8",
                                         "--pipeline-model-parallel-size",
                                         "1",
                                         "--sequence-parallel",
                                         "--micro-batch-size",
                                         "1",
                                         "--json"};
  const Result one = run(base);
  auto args = base;
  args.insert(args.end(), {"--context-parallel-size", "2"});
  const Result two = run(args);
  ASSERT_EQ(one.status, 0) << one.err;
  ASSERT_EQ(two.status, 0) << two.err;
  const auto a = nlohmann::json::parse(one.out), b = nlohmann::json::parse(two.out);
  EXPECT_EQ(b["configuration"]["context_parallel"], 2);
  EXPECT_EQ(b["configuration"]["data_parallel"], 1);
  // The ring's exposed steps are context-parallel communication, apart from the tensor
  // group's (none without cp).
  EXPECT_EQ(a["breakdown"]["cp_comm_s"].get<double>(), 0);
  EXPECT_GE(b["breakdown"]["cp_comm_s"].get<double>(), 0);
  EXPECT_GT(b["breakdown"]["tp_comm_s"].get<double>(), 0);
  EXPECT_LT(b["memory"]["activations_gib"].get<double>(),
            0.6 * a["memory"]["activations_gib"].get<double>());
}

TEST(CliErrors, ContextAndExpertParallelValues) {
  auto cp = kPredictMixtral;
  cp.insert(cp.end(), {"--context-parallel-size", "3"});  // 192 GPUs would be needed anyway
  expect_bad(cp, "--num-gpus");
  cp = kPredictMixtral;
  cp[std::find(cp.begin(), cp.end(), "4096") - cp.begin()] = "4098";  // 2 * 2 does not divide
  cp.insert(cp.end(), {"--context-parallel-size", "2"});
  expect_bad(cp, "--context-parallel-size");
  auto ep = kPredictMixtral;
  ep.insert(ep.end(), {"--expert-model-parallel-size", "3"});  // 8 experts
  expect_bad(ep, "--expert-model-parallel-size");
  auto dense = predict_with("--expert-model-parallel-size", "2");
  expect_bad(dense, "--expert-model-parallel-size");
  auto topk = kPredictMixtral;
  topk.insert(topk.end(), {"--moe-router-topk", "9"});
  expect_bad(topk, "--moe-router-topk");
  auto load = kPredictMixtral;
  load.insert(load.end(), {"--moe-expert-load", "0.8"});  // the busiest rank is at least the mean
  expect_bad(load, "--moe-expert-load");
  auto fp8 = predict_with("--fp8-format", "e5m2");
  expect_bad(fp8, "--fp8-format");
  auto cp_comm = kPredictMixtral;
  cp_comm.insert(cp_comm.end(), {"--context-parallel-size", "2", "--cp-comm-type", "ring"});
  expect_bad(cp_comm, "--cp-comm-type");
  // a2a+p2p: sizes A B multiplying to cp, given with it and only with it.
  const char* hcp = "--hierarchical-context-parallel-sizes";
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {"--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"},
           {"--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", hcp, "4", "2"},
           {"--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", hcp, "0", "4"},
           {"--context-parallel-size", "4", hcp, "2", "2"},
           {"--cp-comm-type", "a2a+p2p", hcp, "2", "x"},
           {"--cp-comm-type", "a2a+p2p", hcp, "2"}}) {
    auto args = kPredictMixtral;
    args.insert(args.end(), extra.begin(), extra.end());
    expect_bad(args, hcp);
  }
  // --recompute-modules: selective only, and only the modules ptdp models.
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {"--recompute-modules", "mlp"},
           {"--recompute-granularity", "full", "--recompute-modules", "core_attn", "mlp"},
           // (Mixtral has no latent attention)
           {"--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"},
           {"--recompute-granularity", "selective", "--recompute-modules", "attn"}}) {
    auto args = kPredictMixtral;
    args.insert(args.end(), extra.begin(), extra.end());
    expect_bad(args, "--recompute-modules");
  }
  fp8 = predict_with("--fp8-format", "hybrid");  // the A100 preset has no FP8 tensor cores
  expect_bad(fp8, "--fp8-format");
  // An unknown MoE field in a model file.
  const std::string path = testing::TempDir() + "ptdp_cli_moe_unknown.json";
  nlohmann::json j = to_json(resolve_model("mixtral-8x7b"));
  j["moe_expert_capacity"] = 2;
  std::ofstream(path) << j.dump();
  expect_bad({"plan", "--model", path, "--global-batch-size", "8"}, "moe_expert_capacity");
}

// Megatron-Core refuses FP8's delayed scaling (Megatron-LM's default --fp8-recipe) with moe_act
// or layernorm recomputation: a plan that recomputes them in FP8 prints --fp8-recipe tensorwise,
// --fp8-recipe delayed with them is refused, and the recipe needs --fp8-format.
TEST(Cli, Fp8WithMoeActOrLayernormRecomputationTakesCurrentScaling) {
  auto args = kPredictMixtral;
  args.insert(args.end(), {"--expert-model-parallel-size", "8", "--fp8-format", "hybrid",
                           "--recompute-granularity", "selective", "--json"});
  auto flags_of = [&](std::vector<std::string> extra) {
    auto a = args;
    a.insert(a.end(), extra.begin(), extra.end());
    const Result r = run(a);
    EXPECT_EQ(r.status, 0) << r.err;
    return nlohmann::json::parse(r.out)["megatron_flags"].get<std::string>();
  };
  EXPECT_EQ(flags_of({}).find("--fp8-recipe"), std::string::npos);
  for (const char* module : {"moe_act", "layernorm"}) {
    EXPECT_NE(
        flags_of({"--recompute-modules", "core_attn", module}).find("--fp8-recipe tensorwise"),
        std::string::npos)
        << module;
    EXPECT_NE(flags_of({"--recompute-modules", "core_attn", module, "--fp8-recipe", "tensorwise"})
                  .find("--fp8-recipe tensorwise"),
              std::string::npos);
    auto delayed = args;
    delayed.insert(delayed.end(),
                   {"--recompute-modules", "core_attn", module, "--fp8-recipe", "delayed"});
    expect_bad(delayed, "--fp8-recipe: delayed scaling does not support moe_act and layernorm");
  }
  auto bad = args;
  bad.insert(bad.end(), {"--fp8-recipe", "mxfp9"});
  expect_bad(bad, "--fp8-recipe: must be delayed or tensorwise");
  auto no_fp8 = kPredictMixtral;
  no_fp8.insert(no_fp8.end(), {"--expert-model-parallel-size", "8", "--fp8-recipe", "tensorwise"});
  expect_bad(no_fp8, "--fp8-recipe: needs --fp8-format");
}

TEST(Cli, Fp8IsPricedFasterOnH100AndRunSaysItRunsTheGemmsInItsPrecision) {
  auto args = kPredictMixtral;
  args.insert(args.end(), {"--expert-model-parallel-size", "8", "--json"});
  const Result bf16 = run(args);
  args.insert(args.end(), {"--fp8-format", "hybrid"});
  const Result fp8 = run(args);
  ASSERT_EQ(bf16.status, 0) << bf16.err;
  ASSERT_EQ(fp8.status, 0) << fp8.err;
  const double a = nlohmann::json::parse(bf16.out)["iteration_time_s"].get<double>();
  const double b = nlohmann::json::parse(fp8.out)["iteration_time_s"].get<double>();
  EXPECT_LT(b, 0.9 * a);
  EXPECT_GT(b, 0.4 * a);  // the attention core, router and communication stay as they were
  const std::string trace = (std::filesystem::temp_directory_path() / "ptdp_fp8_run.json").string();
  const Result run_fp8 =
      run({"run",     "--num-layers", "2",  "--hidden-size", "32",     "--num-attention-heads",
           "2",       "--seq-length", "16", "--vocab-size",  "64",     "--global-batch-size",
           "2",       "--steps",      "2",  "--fp8-format",  "hybrid", "--bf16",
           "--trace", trace});
  EXPECT_EQ(run_fp8.status, 0) << run_fp8.err;
  EXPECT_NE(run_fp8.out.find("runs its GEMMs in the run's precision (--fp8-format is priced, not "
                             "run"),
            std::string::npos)
      << run_fp8.out;
  // Its trace records the plan as it ran, so that reconcile prices bf16 GEMMs, not FP8 ones.
  const RunTrace t = read_run_trace(trace);
  EXPECT_FALSE(t.info.plan.fp8);
  EXPECT_EQ(t.info.plan.global_batch_size, 2);
}

TEST(CliErrors, UnknownPresetAndCluster) {
  expect_bad({"plan", "--model", "gpt-9000", "--global-batch-size", "8"}, "--model");
  expect_bad(predict_with("--cluster", "dgx-z9000"), "--cluster");
}
TEST(CliErrors, BadJsonFiles) {
  const std::string truncated = temp_file("truncated.json", "{\"num_layers\": 4, \"hidden");
  const std::string random =
      temp_file("random.json", std::string("\x8f\x01\xffgarbage\x00\x13", 12));
  const std::string array = temp_file("array.json", "[1, 2, 3]");
  const std::string negative =
      temp_file("negative.json",
                R"({"num_layers": -2, "hidden_size": 64, "num_attention_heads": 4,
                                            "seq_length": 32, "vocab_size": 128})");
  for (const auto& f : {truncated, random, array}) {
    expect_bad({"plan", "--model", f, "--global-batch-size", "8"}, "model");
    expect_bad(predict_with("--cluster", f), "cluster");
  }
  expect_bad({"plan", "--model", negative, "--global-batch-size", "8"}, "num_layers");
}
// --gemm-from: a machine file's measured GEMMs (examples/machines/, an H100) replace the profile's
// and move the prediction, the rest of the profile kept; a file without a GEMM table, or none,
// is refused naming the flag.
TEST(Cli, GemmFromAMachineFileRepricesTheGemms) {
  const std::string machine =
      std::string(PTDP_SOURCE_DIR) + "/examples/machines/h100-sxm-80gb.json";
  auto args = predict_with("--cluster", "dgx-h100");
  args.push_back("--json");
  const auto base = run(args);
  ASSERT_EQ(base.status, 0) << base.err;
  args.push_back("--gemm-from");
  args.push_back(machine);
  const auto measured = run(args);
  ASSERT_EQ(measured.status, 0) << measured.err;
  const auto a = nlohmann::json::parse(base.out), b = nlohmann::json::parse(measured.out);
  EXPECT_NE(a["iteration_time_s"].get<double>(), b["iteration_time_s"].get<double>());
  EXPECT_EQ(a["memory"]["peak_gib"].get<double>(), b["memory"]["peak_gib"].get<double>());
  expect_bad(predict_with("--gemm-from", "/nonexistent/machine.json"), "--gemm-from");
  const std::string no_table = std::string(PTDP_SOURCE_DIR) + "/examples/cpu-profile.json";
  expect_bad(predict_with("--gemm-from", no_table), "--gemm-from");
}
TEST(CliErrors, MissingFile) {
  expect_bad({"plan", "--model", "/nonexistent/x.json", "--global-batch-size", "8"}, "model");
}
// Devices, FIFOs and directories given as input files are refused at once (reading /dev/zero
// used to never end), naming the flag.
TEST(CliErrors, NonRegularInputFilesAreRefusedNamingTheFlag) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  for (const std::string& path : {std::string("/dev/zero"), dir}) {
    expect_bad({"plan", "--model", path, "--global-batch-size", "8"}, "--model");
    expect_bad(predict_with("--cluster", path), "--cluster");
    expect_bad({"run", "--plan", path}, "--plan");
    expect_bad(
        {"run", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "256", "--global-batch-size", "2", "--data", path},
        "--data");
    expect_bad({"tokenize", path, dir + "/ptdp_cli_test_tokens.bin"}, path);
    expect_bad({"reconcile", "--trace", path}, "--trace");
  }
}

// Outputs that are not regular files are refused before anything is written (renaming over a
// FIFO or a device replaced it with a plain file), a link is followed, and tokenize will not
// overwrite its own input.
TEST(CliErrors, OutputsThatAreNotRegularFilesAreRefused) {
  namespace fs = std::filesystem;
  const fs::path d = fs::temp_directory_path() / "ptdp_cli_outputs";
  fs::remove_all(d);
  fs::create_directories(d / "sub");
  const std::string fifo = (d / "fifo").string(), text = temp_file("outputs.txt", "hello\n");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_bad({"plan", "--model", "gpt-1.7b", "--num-gpus", "8", "--global-batch-size", "16",
              "--out", fifo},
             "--out");
  expect_bad({"tokenize", text, fifo}, "output");
  expect_bad({"tokenize", text, (d / "sub").string()}, "output");
  expect_bad({"tokenize", text, ""}, "output");
  expect_bad({"tokenize", text, text}, "output");
  expect_bad({"calibrate", "--quick", "--out", (d / "sub").string()}, "--out");
  EXPECT_TRUE(fs::is_fifo(fs::symlink_status(fifo)));
  EXPECT_EQ(std::distance(fs::directory_iterator(d), fs::directory_iterator()), 2);
  std::ifstream in(text);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "hello\n");
  fs::create_symlink(d / "tokens.bin", d / "link.bin");
  ASSERT_EQ(run({"tokenize", text, (d / "link.bin").string()}).status, 0);
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(d / "link.bin")));
  EXPECT_EQ(fs::file_size(d / "tokens.bin"), 12u);
}
TEST(CliErrors, BadRecomputeAndNumGpus) {
  expect_bad(predict_with("--recompute-granularity", "some"), "--recompute-granularity");
  expect_bad(predict_with("--num-gpus", "1001"), "--num-gpus");
}

TEST(Cli, PlanOutFileIsWrittenWholeOrNotAtAll) {
  const auto path = (std::filesystem::temp_directory_path() / "ptdp_cli_test_plan.json").string();
  std::filesystem::remove(path);
  const Result bad =
      run({"plan", "--model", "gpt-9000", "--global-batch-size", "8", "--out", path});
  EXPECT_EQ(bad.status, 2);
  EXPECT_FALSE(std::filesystem::exists(path));
  const Result ok = run({"plan", "--model", "gpt-1.7b", "--num-gpus", "32", "--global-batch-size",
                         "512", "--out", path});
  ASSERT_EQ(ok.status, 0) << ok.err;
  std::ifstream f(path);
  EXPECT_EQ(nlohmann::json::parse(f)["plans"].size(), 10u);
}

std::vector<std::string> simulate_small(std::vector<std::string> extra) {
  std::vector<std::string> args = {"simulate", "--num-layers",
                                   "24",       "--hidden-size",
                                   "2048",     "--num-attention-heads",
                                   "16",       "--seq-length",
                                   "2048",     "--vocab-size",
                                   "51200",    "--num-gpus",
                                   "64",       "--global-batch-size",
                                   "32",       "--tensor-model-parallel-size",
                                   "8",        "--pipeline-model-parallel-size",
                                   "4",        "--micro-batch-size",
                                   "1"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST(CliSimulate, JsonHasTheDocumentedKeysAndAgreesWithPredict) {
  const Result r = run(simulate_small({"--json"}));
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* key : {"iteration_time_s", "bubble_fraction", "stages", "exposed_comm_s",
                          "predicted_iteration_time_s"})
    EXPECT_TRUE(j.contains(key)) << key;
  for (const char* key : {"tp", "pp", "dp"}) EXPECT_TRUE(j["exposed_comm_s"].contains(key)) << key;
  ASSERT_EQ(j["stages"].size(), 4u);
  const double sim = j["iteration_time_s"].get<double>();
  const double pred = j["predicted_iteration_time_s"].get<double>();
  EXPECT_NEAR(sim / pred, 1.0, 0.05);
  // Every stage's time adds up to the iteration.
  for (const auto& s : j["stages"]) {
    const double sum = s["compute_s"].get<double>() + s["tp_comm_s"].get<double>() +
                       s["cp_comm_s"].get<double>() + s["ep_comm_s"].get<double>() +
                       s["pp_comm_s"].get<double>() + s["dp_comm_s"].get<double>() +
                       s["optimizer_s"].get<double>() + s["idle_s"].get<double>();
    EXPECT_NEAR(sum, sim, 1e-9);
  }
}

// Megatron-Core's overlap settings: each hides what it overlaps (and no more), the simulator
// agrees with the analytic model, the flags come back in the plan, and each refuses the plan
// it cannot apply to.
TEST(CliSimulate, OverlapSettingsHideTheirCommunication) {
  auto time = [](std::vector<std::string> extra) {
    extra.push_back("--json");
    const Result r = run(simulate_small(extra));
    EXPECT_EQ(r.status, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_NEAR(j["iteration_time_s"].get<double>() / j["predicted_iteration_time_s"].get<double>(),
                1.0, 0.05);
    return j;
  };
  const auto sp = time({"--sequence-parallel"});
  const auto tp = time({"--sequence-parallel", "--tp-comm-overlap"});
  EXPECT_LT(tp["exposed_comm_s"]["tp"].get<double>(),
            0.5 * sp["exposed_comm_s"]["tp"].get<double>());
  EXPECT_LT(tp["iteration_time_s"].get<double>(), sp["iteration_time_s"].get<double>());
  const auto dopt = time({"--use-distributed-optimizer", "--overlap-grad-reduce"});
  const auto gather =
      time({"--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"});
  EXPECT_LT(gather["exposed_comm_s"]["dp"].get<double>(),
            dopt["exposed_comm_s"]["dp"].get<double>());
  EXPECT_GT(gather["exposed_comm_s"]["dp"].get<double>(), 0);  // the reduce-scatter stays
  auto pred = kPredict175B;
  pred.insert(pred.end(),
              {"--sequence-parallel", "--tp-comm-overlap", "--use-distributed-optimizer",
               "--overlap-grad-reduce", "--overlap-param-gather", "--json"});
  const Result r = run(pred);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string flags = nlohmann::json::parse(r.out)["megatron_flags"];
  EXPECT_NE(flags.find("--overlap-param-gather"), std::string::npos);
  EXPECT_NE(flags.find("--tp-comm-overlap"), std::string::npos);
}
TEST(CliErrors, OverlapSettingsNeedWhatTheyOverlap) {
  for (const char* flag : {"--tp-comm-overlap", "--overlap-param-gather"}) {
    auto args = kPredict175B;
    args.push_back(flag);
    expect_bad(args, flag);
  }
  // Megatron-LM asserts --overlap-grad-reduce with --overlap-param-gather, and p > 2 for the
  // interleaved schedule without its p2p overlap: plan, predict and simulate refuse what it
  // would; the search leaves interleaving at p = 2 out when told not to overlap.
  auto gather = kPredict175B;
  gather.insert(gather.end(), {"--use-distributed-optimizer", "--overlap-param-gather"});
  expect_bad(gather, "--overlap-param-gather: needs --overlap-grad-reduce");
  gather.push_back("--overlap-grad-reduce");
  EXPECT_EQ(run(gather).status, 0);
  const std::vector<std::string> two = {"predict",  "--model",
                                        "gpt-1.7b", "--num-gpus",
                                        "8",        "--global-batch-size",
                                        "64",       "--tensor-model-parallel-size",
                                        "1",        "--pipeline-model-parallel-size",
                                        "2",        "--micro-batch-size",
                                        "1",        "--num-layers-per-virtual-pipeline-stage",
                                        "4"};
  EXPECT_EQ(run(two).status, 0);
  auto no_overlap = two;
  no_overlap.push_back("--no-overlap-p2p-communication");
  expect_bad(no_overlap,
             "--no-overlap-p2p-communication: the interleaved schedule without its "
             "p2p overlap needs pipeline-model-parallel-size > 2");
  const Result planned =
      run({"plan", "--model", "gpt-1.7b", "--num-gpus", "8", "--global-batch-size", "64",
           "--pipeline-model-parallel-size", "2", "--top", "100", "--json", "--no-progress",
           "--no-overlap-p2p-communication"});
  ASSERT_EQ(planned.status, 0) << planned.err;
  const nlohmann::json listed = nlohmann::json::parse(planned.out);  // outlives the loop
  int two_stages = 0, interleaved = 0;
  for (const nlohmann::json& p : listed["plans"]) {
    const std::string flags = p["megatron_flags"];
    const bool virtual_stages = flags.find("--num-layers-per-virtual") != std::string::npos;
    interleaved += virtual_stages;
    if (flags.find("--pipeline-model-parallel-size 2 ") == std::string::npos) continue;
    ++two_stages;
    EXPECT_FALSE(virtual_stages) << flags;
  }
  EXPECT_GT(two_stages, 0);
  EXPECT_GT(interleaved, 0);  // at p > 2 it stays
}

// --num-distributed-optimizer-instances: a whole number that divides d * cp, with the
// distributed optimizer; "auto" only for ptdp plan, where it (or K) adds plans in instances.
TEST(CliErrors, DistributedOptimizerInstances) {
  const char* flag = "--num-distributed-optimizer-instances";
  auto dopt = kPredict175B;
  dopt.push_back("--use-distributed-optimizer");
  for (const char* bad : {"auto", "two", "0", "-2", "2x", "3"}) {
    auto args = dopt;
    args.insert(args.end(), {flag, bad});
    expect_bad(args, flag);
  }
  auto no_dopt = kPredict175B;
  no_dopt.insert(no_dopt.end(), {flag, "2"});
  expect_bad(no_dopt, flag);
  const Result plan =
      run({"plan", "--model", "llama2-7b", "--cluster", "dgx-h100", "--num-gpus", "64",
           "--global-batch-size", "256", "--top", "60", "--json", flag, "auto"});
  ASSERT_EQ(plan.status, 0) << plan.err;
  bool seen = false;
  const nlohmann::json plans = nlohmann::json::parse(plan.out);
  for (const auto& p : plans["plans"]) {
    const int64_t k = p["configuration"]["distributed_optimizer_instances"].get<int64_t>();
    if (k == 1) continue;
    seen = true;
    EXPECT_NE(p["megatron_flags"].get<std::string>().find(
                  " --use-distributed-optimizer --num-distributed-optimizer-instances " +
                  std::to_string(k)),
              std::string::npos);
  }
  EXPECT_TRUE(seen);
  expect_bad({"plan", "--model", "llama2-7b", "--num-gpus", "64", "--global-batch-size", "256",
              flag, "many"},
             flag);
  // Megatron-FSDP's outer strategy across the instances (HSDP).
  const char* outer = "--outer-dp-sharding-strategy";
  auto fsdp = kPredict175B;
  fsdp[std::find(fsdp.begin(), fsdp.end(), "--pipeline-model-parallel-size") - fsdp.begin() + 1] =
      "1";
  fsdp.insert(fsdp.end(), {"--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                           "optim_grads_params", flag, "4"});
  EXPECT_EQ(run(fsdp).status, 0) << run(fsdp).err;
  for (const std::vector<std::string>& extra :
       std::vector<std::vector<std::string>>{{outer, "optim_grads"}, {outer, "sideways"}}) {
    auto args = fsdp;
    args.insert(args.end(), extra.begin(), extra.end());
    expect_bad(args, outer);
  }
  auto hfsdp = fsdp;
  hfsdp.insert(hfsdp.end(), {outer, "optim"});
  const Result h = run(hfsdp);
  ASSERT_EQ(h.status, 0) << h.err;
  auto no_fsdp = kPredict175B;
  no_fsdp.insert(no_fsdp.end(), {outer, "optim"});
  expect_bad(no_fsdp, outer);
}

TEST(CliSimulate, WritesTraceAndSvg) {
  const auto dir = std::filesystem::temp_directory_path();
  const std::string trace = (dir / "ptdp_cli_test_trace.json").string();
  const std::string svg = (dir / "ptdp_cli_test_timeline.svg").string();
  std::filesystem::remove(trace);
  std::filesystem::remove(svg);
  const Result r = run(simulate_small(
      {"--num-layers-per-virtual-pipeline-stage", "3", "--trace", trace, "--svg", svg}));
  ASSERT_EQ(r.status, 0) << r.err;
  std::ifstream t(trace);
  const auto j = nlohmann::json::parse(t);
  EXPECT_GT(j["traceEvents"].size(), 4u * 8 * 2 * 2);
  std::ifstream s(svg);
  std::stringstream text;
  text << s.rdbuf();
  EXPECT_NE(text.str().find("<svg"), std::string::npos);
  EXPECT_NE(text.str().find("</svg>"), std::string::npos);
}

TEST(CliSimulate, FullWithAStragglerIsSlower) {
  auto base = nlohmann::json::parse(run(simulate_small({"--json", "--full"})).out);
  auto slow =
      nlohmann::json::parse(run(simulate_small({"--json", "--full", "--slow-rank", "9:1.5"})).out);
  // Its compute (not its collectives) takes 1.5x, and every stage of the pipeline waits for it.
  const double ratio =
      slow["iteration_time_s"].get<double>() / base["iteration_time_s"].get<double>();
  EXPECT_GT(ratio, 1.1);
  EXPECT_LT(ratio, 1.5);
}

TEST(CliErrors, SlowRank) {
  expect_bad(simulate_small({"--slow-rank", "3:1.5"}), "--slow-rank");  // without --full
  expect_bad(simulate_small({"--full", "--slow-rank", "3"}), "--slow-rank");
  expect_bad(simulate_small({"--full", "--slow-rank", "x:2"}), "--slow-rank");
  expect_bad(simulate_small({"--full", "--slow-rank", "3:-1"}), "--slow-rank");
  expect_bad(simulate_small({"--full", "--slow-rank", "640:2"}), "--slow-rank");
  expect_bad(simulate_small({"--pipeline-schedule", "zb-h2"}), "--pipeline-schedule");
}

TEST(Cli, PlanSimulateTopReranksBySimulation) {
  const Result r = run({"plan", "--model", "gpt-7.5b", "--num-gpus", "128", "--global-batch-size",
                        "512", "--json", "--top", "4", "--simulate-top", "4"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["plans"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(j["plans"][i].contains("simulated_iteration_time_s"));
    if (i > 0) {
      EXPECT_GE(j["plans"][i]["simulated_iteration_time_s"].get<double>(),
                j["plans"][i - 1]["simulated_iteration_time_s"].get<double>());
    }
  }
}

// Found by exploratory testing (2026-11-25): inputs that crashed, overflowed or misprinted.
TEST(CliErrors, PlanRefusesWhatWouldCrashOrMisprint) {
  const std::vector<std::string> plan = {
      "plan", "--model", "gpt-1.7b", "--num-gpus", "8", "--global-batch-size", "64"};
  auto with = [&](std::vector<std::string> extra) {
    auto a = plan;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  // An error inside the search's threads (no FP8 on an A100) is one line, not an abort.
  expect_bad(with({"--fp8-format", "hybrid", "--threads", "2"}), "--fp8-format");
  expect_bad(with({"--train-tokens", "nan"}), "--train-tokens");
  expect_bad(with({"--train-tokens", "1e300"}), "--train-tokens");
  expect_bad(with({"--threads", "-3"}), "--threads");
  expect_bad(
      {"plan", "--model", "gpt-1.7b", "--num-gpus", "8", "--global-batch-size", "99999999999"},
      "--global-batch-size");  // as predict and run refuse it: exit 2, not 1
  // Beyond what any machine has, a price overflows the simulator's clock: refused, not wrapped.
  const std::string slow = temp_file("slow_cluster.json", R"({"name": "slow", "gpu": {
      "name": "slow", "peak_tflops_16bit": 1e-300, "memory_gib": 80, "hbm_bandwidth_gbps": 2000},
      "gpus_per_node": 8, "num_nodes": 1, "nvlink_bandwidth_gbps": 300, "nvlink_latency_us": 1,
      "nics_per_node": 1, "nic_bandwidth_gbps": 25, "nic_latency_us": 2, "tiers": []})");
  expect_bad(simulate_small({"--cluster", slow}), "gpu.peak_tflops_16bit");
  expect_bad(simulate_small({"--full", "--slow-rank", "0:1e10"}), "--slow-rank");
}

TEST(Cli, PlanSearchesOnlyTheScheduleAskedAndPrintsItsOwnFlags) {
  for (const std::string schedule : {"gpipe", "zb-h1", "interleaved"}) {
    SCOPED_TRACE(schedule);
    const Result r = run({"plan", "--model", "gpt-7.5b", "--num-gpus", "128", "--global-batch-size",
                          "512", "--json", "--top", "5", "--pipeline-schedule", schedule});
    ASSERT_EQ(r.status, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    ASSERT_FALSE(j["plans"].empty());
    for (const auto& e : j["plans"]) {
      EXPECT_EQ(e["configuration"]["schedule"], schedule);
      EXPECT_EQ(e["configuration"]["virtual_stages"].get<int>() > 1, schedule == "interleaved");
      const std::string own = e["ptdp_flags"];
      EXPECT_EQ(own.find("--pipeline-schedule " + schedule) != std::string::npos,
                schedule != "interleaved")
          << own;
    }
  }
  // The two lines together read back as the plan: 16-bit gradient reduction has no Megatron flag
  // under --bf16, so it is among ptdp's own.
  const Result r =
      run({"plan", "--model", "gpt-7.5b", "--num-gpus", "128", "--global-batch-size", "512",
           "--json", "--top", "1", "--fp16-grad-reduce", "--no-scatter-gather"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto best = nlohmann::json::parse(r.out)["plans"][0];
  EXPECT_EQ(best["ptdp_flags"], "--fp16-grad-reduce --no-scatter-gather");
  std::vector<std::string> args = {"predict", "--num-gpus", "128", "--json"};
  std::istringstream words(best["megatron_flags"].get<std::string>() + " " +
                           best["ptdp_flags"].get<std::string>());
  for (std::string w; words >> w;) args.push_back(w);
  const Result p = run(args);
  ASSERT_EQ(p.status, 0) << p.err;
  EXPECT_EQ(nlohmann::json::parse(p.out)["iteration_time_s"], best["iteration_time_s"]);
}

TEST(Cli, PlanTableComparesSimulatedRowsBySimulatedTime) {
  const Result r = run({"plan", "--model", "gpt3-175b", "--num-gpus", "1024", "--global-batch-size",
                        "1536", "--top", "5", "--simulate-top", "5"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find("+-"), std::string::npos) << r.out;  // was "+-1.3%" before
  EXPECT_EQ(r.out.find("ties with the best"), std::string::npos) << r.out;
}

TEST(Cli, TokenizeWritesTwoBytesPerByte) {
  const std::string in = temp_file("tokenize_in.txt", "hello world\n");
  const std::string out =
      (std::filesystem::temp_directory_path() / "ptdp_cli_test_tokens.bin").string();
  const Result r = run({"tokenize", in, out});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(std::filesystem::file_size(out), 24u);
  expect_bad({"tokenize", "/nonexistent/input.txt", out}, "/nonexistent/input.txt");
}

const std::vector<std::string> kTinyRun = {
    "run", "--num-layers",       "2",  "--hidden-size", "32", "--num-attention-heads",
    "4",   "--seq-length",       "16", "--vocab-size",  "64", "--global-batch-size",
    "4",   "--micro-batch-size", "2",  "--steps",       "2"};

std::vector<std::string> tiny_run(std::vector<std::string> extra) {
  auto args = kTinyRun;
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// Found by exploratory testing: an empty value (an unset shell variable) was taken as the flag
// left out (`--save ''` trained without checkpoints and exited 0), non-finite numbers passed
// checks written as `x > 0`, a seed past 2^64 - 1 saturated, and a job that fits no
// configuration exited 1 (an internal error's status) without naming a flag.
TEST(CliErrors, EmptyValuesNonFiniteNumbersAndJobsThatFitNothing) {
  expect_bad(predict_with("--tensor-model-parallel-size", ""), "--tensor-model-parallel-size");
  expect_bad(predict_with("--pipeline-schedule", ""), "--pipeline-schedule");
  expect_bad(tiny_run({"--save", ""}), "--save: needs a value");
  expect_bad(tiny_run({"--load", ""}), "--load");
  expect_bad(tiny_run({"--svg", ""}), "--svg");
  expect_bad(tiny_run({"--seed", "-1"}), "--seed");
  expect_bad(tiny_run({"--seed", "18446744073709551616"}), "--seed");
  expect_bad(tiny_run({"--seed", "0x10"}), "--seed");
  expect_bad(tiny_run({"--lr", "inf"}), "--lr");
  expect_bad(tiny_run({"--dry-run", "--memory-limit-gib", "inf"}), "--memory-limit-gib");
  expect_bad(
      {"plan", "--model", "gpt-1.7b", "--num-gpus", "8", "--global-batch-size", "8", "--out", ""},
      "--out");
  expect_bad({"plan", "--model", "gpt-1t", "--num-gpus", "8", "--global-batch-size", "512",
              "--no-progress", "--json"},
             "--num-gpus: no configuration of gpt-1t fits on 8 GPUs");
  const Result seed = run(tiny_run({"--seed", "18446744073709551615"}));
  EXPECT_EQ(seed.status, 0) << seed.err;
  // The flag given is named: of two that state the interleaving, and of a --model's fields
  // that a flag on top of it breaks.
  auto v12 = predict_with("--pipeline-model-parallel-size", "16");
  v12.insert(v12.end(), {"--num-virtual-stages-per-pipeline-rank", "12"});
  expect_bad(v12, "--num-virtual-stages-per-pipeline-rank: 12 virtual stages");
  expect_bad({"predict", "--model", "llama3-8b", "--num-attention-heads", "4", "--num-gpus", "8",
              "--global-batch-size", "8", "--tensor-model-parallel-size", "1",
              "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1"},
             "--num-attention-heads: conflicts with --model llama3-8b");
}

TEST(Cli, RunPrintsAStepLineEachAndJsonWithLossesAndTimes) {
  const Result text = run(kTinyRun);
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find("step     1/2  loss"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("step     2/2  loss"), std::string::npos) << text.out;
  const Result r = run(tiny_run({"--json"}));
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["losses"].size(), 2u);
  ASSERT_EQ(j["step_time_s"].size(), 2u);
  EXPECT_GT(j["step_time_s"][0].get<double>(), 0.0);
  EXPECT_GT(j["peak_memory_gib"].get<double>(), 0.0);
  EXPECT_NEAR(j["losses"][0].get<double>(), std::log(64.0), 0.2);
  EXPECT_EQ(j["parameters"].get<double>(),
            2 * (12.0 * 32 * 32 + 13 * 32) + (64 + 16) * 32 + 2 * 32);
}

TEST(Cli, RunOnTheCpuBackendIsTheDefault) {
  const Result a = run(tiny_run({"--json"}));
  const Result b = run(tiny_run({"--json", "--backend", "cpu"}));
  ASSERT_EQ(a.status, 0) << a.err;
  ASSERT_EQ(b.status, 0) << b.err;
  EXPECT_EQ(nlohmann::json::parse(a.out)["losses"], nlohmann::json::parse(b.out)["losses"]);
}

// cpu-staged runs the CPU kernels on memory the host side treats as a device's (as the CUDA
// backend's): the data plane stages through host copies, and the losses are the CPU backend's
// to the bit.
TEST(Cli, RunOnStagedDeviceMemoryGivesTheCpuBackendsLosses) {
  const Result a = run(tiny_run({"--json"}));
  const Result b = run(tiny_run({"--json", "--backend", "cpu-staged"}));
  ASSERT_EQ(a.status, 0) << a.err;
  ASSERT_EQ(b.status, 0) << b.err;
  const auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  EXPECT_EQ(ja["losses"], jb["losses"]);
  EXPECT_EQ(ja["peak_memory_gib"], jb["peak_memory_gib"]);
  EXPECT_EQ(ja["data_plane"], "self");    // one rank on host memory
  EXPECT_EQ(jb["data_plane"], "staged");  // a device backend without NCCL
  // A data plane PTDP_DATA_PLANE cannot have: refused naming the variable.
  setenv("PTDP_DATA_PLANE", "nccl", 1);
  const Result c = run(tiny_run({"--json", "--backend", "cpu-staged"}));
  unsetenv("PTDP_DATA_PLANE");
  EXPECT_EQ(c.status, 2) << c.err;
  EXPECT_NE(c.err.find("PTDP_DATA_PLANE"), std::string::npos) << c.err;
  EXPECT_EQ(std::count(c.err.begin(), c.err.end(), '\n'), 1) << c.err;
}

TEST(Cli, RunWritesItsMeasuredTimelineAsAChromeTrace) {
  const std::string trace =
      (std::filesystem::temp_directory_path() / "ptdp_cli_test_run_trace.json").string();
  const Result r = run(tiny_run({"--trace", trace}));
  ASSERT_EQ(r.status, 0) << r.err;
  std::ifstream in(trace);
  const auto j = nlohmann::json::parse(in);
  int spans = 0, ops = 0, steps = 0, norms = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    if (e["cat"] == "op")
      ++ops;
    else if (e["cat"] == "step")
      ++steps;
    else if (e["cat"] == "sync")
      ++norms;
    else
      ++spans;
  }
  EXPECT_EQ(spans, 2 * (2 + 2 + 2));  // per step: 2 forwards, 2 backwards, grad sync, optimizer
  EXPECT_EQ(steps, 2);
  EXPECT_EQ(norms, 2);    // the gradient-norm all-reduce inside each optimizer step
  EXPECT_GT(ops, 4 * 2);  // every op of every pass (tests/reconcile_test.cc checks them)
}

// `ptdp plan --out` for a tiny model on one rank, into a temporary file named `name`.
std::string tiny_plan_file(const std::string& name) {
  const std::string plans = (std::filesystem::temp_directory_path() / name).string();
  const Result p = run({"plan", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                        "4", "--seq-length", "16", "--vocab-size", "64", "--global-batch-size", "4",
                        "--num-gpus", "1", "--out", plans});
  EXPECT_EQ(p.status, 0) << p.err;
  return plans;
}

TEST(Cli, RunExecutesTheBestPlanOfAPlanFile) {
  const std::string plans = tiny_plan_file("ptdp_cli_test_run_plans.json");
  const Result r = run({"run", "--plan", plans, "--steps", "1", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["losses"].size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(r.out)["precision"], "bf16");
  // The plan was priced in bf16 (the default cluster's profile): the run trains in bf16, as
  // priced, and says so; --fp16 runs it in fp16 and says that the plan was priced otherwise.
  const Result as_priced = run({"run", "--plan", plans, "--steps", "1"});
  ASSERT_EQ(as_priced.status, 0) << as_priced.err;
  EXPECT_NE(as_priced.out.find("bf16 weights and activations"), std::string::npos) << as_priced.out;
  EXPECT_EQ(as_priced.out.find("priced in"), std::string::npos) << as_priced.out;
  const std::string note = "the plan was priced in bf16; --fp16 runs it in fp16";
  const Result fp16 = run({"run", "--plan", plans, "--steps", "1", "--fp16"});
  ASSERT_EQ(fp16.status, 0) << fp16.err;
  EXPECT_NE(fp16.out.find(note), std::string::npos) << fp16.out;
  const Result dry = run({"run", "--plan", plans, "--dry-run", "--fp16"});
  EXPECT_NE(dry.out.find(note), std::string::npos) << dry.out;
  // The dry run counts the plan's precision: bf16 weights are half of fp32's.
  const Result dry_json = run({"run", "--plan", plans, "--dry-run", "--json"});
  ASSERT_EQ(dry_json.status, 0) << dry_json.err;
  const auto rank0 = nlohmann::json::parse(dry_json.out)["plans"][0]["ranks"][0];
  EXPECT_EQ(rank0["parameter_bytes"].get<double>(), 2.0 * rank0["parameters"].get<double>());
  // Loss-scale flags need fp16: a flag or a plan priced in it.
  expect_bad({"run", "--plan", plans, "--steps", "1", "--loss-scale", "1024"}, "--loss-scale");
  // A precision the file cannot mean is refused naming the file's flag.
  nlohmann::json j = nlohmann::json::parse(std::ifstream(plans));
  j["plans"][0]["precision"] = "fp12";
  const std::string bad = plans + ".bad.json";
  std::ofstream(bad) << j.dump();
  expect_bad({"run", "--plan", bad, "--dry-run"}, "--plan");
}

// Outputs written after training are checked before it; optimizer settings out of range and
// flags that a --plan file already sets are refused by name.
TEST(Cli, RunRefusesBeforeTrainingWhatItWouldFailOrIgnoreLater) {
  for (const std::string flag : {"--trace", "--svg", "--save"}) {
    const Result r = run(tiny_run({flag, "/proc/ptdp-no-such-dir/out"}));
    EXPECT_EQ(r.status, 2) << flag;
    EXPECT_EQ(r.out.find("step"), std::string::npos) << flag << ": trained first\n" << r.out;
    EXPECT_NE(r.err.find(flag), std::string::npos) << r.err;
  }
  expect_bad(tiny_run({"--seed", "-1"}), "--seed");
  expect_bad(tiny_run({"--adam-beta1", "1.5"}), "--adam-beta1");
  expect_bad(tiny_run({"--adam-beta2", "-3"}), "--adam-beta2");
  expect_bad(tiny_run({"--adam-eps", "-1"}), "--adam-eps");
  const std::string plans = tiny_plan_file("ptdp_cli_test_conflict_plans.json");
  for (const std::vector<std::string>& extra :
       std::vector<std::vector<std::string>>{{"--sequence-parallel"},
                                             {"--pipeline-schedule", "gpipe"},
                                             {"--recompute-granularity", "full"},
                                             {"--model", "gpt-1.7b"},
                                             {"--num-layers", "8"},
                                             {"--swiglu"}}) {
    std::vector<std::string> args = {"run", "--plan", plans, "--dry-run"};
    args.insert(args.end(), extra.begin(), extra.end());
    expect_bad(args, extra.front());
  }
}

// A gated model given by Megatron-LM's flags without --ffn-hidden-size gets Megatron-LM's
// default width, 2/3 of 4 h down to a multiple of 64 (Llama 2 7B's shape: 10880, not 4 h), and
// the printed line says so; a width that is not positive is refused by name.
TEST(Cli, GatedModelFlagsTakeMegatronsDefaultFfnWidth) {
  const std::vector<std::string> llama = {"predict",
                                          "--num-layers",
                                          "32",
                                          "--hidden-size",
                                          "4096",
                                          "--num-attention-heads",
                                          "32",
                                          "--seq-length",
                                          "4096",
                                          "--vocab-size",
                                          "32000",
                                          "--swiglu",
                                          "--position-embedding-type",
                                          "rope",
                                          "--num-gpus",
                                          "8",
                                          "--global-batch-size",
                                          "64",
                                          "--tensor-model-parallel-size",
                                          "8",
                                          "--pipeline-model-parallel-size",
                                          "1",
                                          "--micro-batch-size",
                                          "1"};
  auto ffn_of = [&](std::vector<std::string> args) {
    args.push_back("--json");
    const Result r = run(args);
    EXPECT_EQ(r.status, 0) << r.err;
    const std::string flags = nlohmann::json::parse(r.out)["megatron_flags"];
    const size_t at = flags.find("--ffn-hidden-size ");
    return at == std::string::npos ? int64_t{0} : int64_t{std::stoll(flags.substr(at + 18))};
  };
  EXPECT_EQ(ffn_of(llama), 10880);
  auto given = llama;
  given.insert(given.end(), {"--ffn-hidden-size", "11008"});
  EXPECT_EQ(ffn_of(given), 11008);
  auto plain = llama;
  plain.erase(std::find(plain.begin(), plain.end(), "--swiglu"));
  EXPECT_EQ(ffn_of(plain), 0);  // 4 h, Megatron-LM's default for it too: not printed
  auto zero = llama;
  zero.insert(zero.end(), {"--ffn-hidden-size", "0"});
  expect_bad(zero, "--ffn-hidden-size: must be positive");
}

// A flag given twice takes its last value, as Megatron-LM's argparse does, so that a launch
// script's shared flag line can be overridden by appending; an empty last value is still
// refused, and so is an empty earlier one.
TEST(Cli, AFlagGivenTwiceTakesItsLastValueAsMegatronDoes) {
  const std::vector<std::string> base = {"predict",  "--model",
                                         "gpt-1.7b", "--num-gpus",
                                         "8",        "--global-batch-size",
                                         "64",       "--tensor-model-parallel-size",
                                         "2",        "--pipeline-model-parallel-size",
                                         "1",        "--micro-batch-size",
                                         "4",        "--json"};
  auto flags_of = [](const std::vector<std::string>& args) {
    const Result r = run(args);
    EXPECT_EQ(r.status, 0) << r.err;
    return r.status == 0 ? nlohmann::json::parse(r.out)["megatron_flags"].get<std::string>()
                         : std::string();
  };
  auto twice = base;
  twice.insert(twice.end(), {"--num-layers", "16", "--tensor-model-parallel-size", "4",
                             "--num-layers", "12", "--tensor-model-parallel-size", "1"});
  const std::string flags = flags_of(twice);
  EXPECT_NE(flags.find("--num-layers 12 "), std::string::npos) << flags;
  EXPECT_NE(flags.find("--tensor-model-parallel-size 1 "), std::string::npos) << flags;
  auto once = base;
  once.insert(once.end(), {"--num-layers", "12", "--tensor-model-parallel-size", "1"});
  EXPECT_EQ(flags_of(once), flags);
  auto empty_last = base;
  empty_last.insert(empty_last.end(), {"--num-layers", "12", "--num-layers", ""});
  expect_bad(empty_last, "--num-layers");
  auto empty_first = base;
  empty_first.insert(empty_first.end(), {"--num-layers", "", "--num-layers", "12"});
  expect_bad(empty_first, "--num-layers");
}

TEST(Cli, RunRefusesBadInputWithOneLine) {
  expect_bad(tiny_run({"--tensor-model-parallel-size", "2"}), "world size");
  expect_bad(tiny_run({"--data", "/nonexistent/tokens.bin"}), "--data");
  expect_bad(tiny_run({"--lr-decay-style", "sometimes"}), "--lr-decay-style");
  expect_bad(tiny_run({"--backend", "tpu"}), "--backend");
  {
    // Without the CUDA backend in the build, or without a GPU, one line naming --backend.
    const Result cuda = run(tiny_run({"--backend", "cuda"}));
    if (cuda.status != 0) expect_bad(tiny_run({"--backend", "cuda"}), "--backend");
  }
  expect_bad(tiny_run({"--load", "/nonexistent/checkpoints"}), "--load");
  auto odd_micro = kTinyRun;
  *(std::find(odd_micro.begin(), odd_micro.end(), "--micro-batch-size") + 1) = "3";
  expect_bad(odd_micro, "--global-batch-size");
  expect_bad({"run", "--plan", "/nonexistent/plans.json"}, "--plan");
  auto no_batch = kTinyRun;
  no_batch.erase(no_batch.begin() + 11, no_batch.begin() + 13);
  expect_bad(no_batch, "--global-batch-size");
  auto bad_steps = kTinyRun;
  bad_steps.back() = "0";
  expect_bad(bad_steps, "--steps");
}

// One process dry-runs a plan of several ranks by working out every rank: the plan from flags
// with --num-gpus (or from a --plan file), each rank's coordinates and footprint, no memory
// limit unless --memory-limit-gib gives one (the ranks are not on this host), and that limit
// checked on every rank. What it cannot check here is refused by name.
TEST(Cli, OneProcessDryRunsEveryRankOfALargerPlan) {
  const auto eight =
      tiny_run({"--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                "--num-gpus", "8", "--dry-run"});
  auto with = [](std::vector<std::string> a, std::vector<std::string> extra) {
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const Result r = run(with(eight, {"--json"}));
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json plan = nlohmann::json::parse(r.out)["plans"][0];
  EXPECT_EQ(plan["configuration"]["data_parallel"], 2);
  const nlohmann::json& ranks = plan["ranks"];
  ASSERT_EQ(ranks.size(), 8u);
  std::set<std::tuple<int, int, int>> seen;
  double worst = 0, least = HUGE_VAL;
  for (size_t i = 0; i < ranks.size(); ++i) {
    EXPECT_EQ(ranks[i]["rank"], static_cast<int>(i));
    seen.insert({ranks[i]["tp"].get<int>(), ranks[i]["pp"].get<int>(), ranks[i]["dp"].get<int>()});
    worst = std::max(worst, ranks[i]["peak_bytes"].get<double>());
    least = std::min(least, ranks[i]["peak_bytes"].get<double>());
  }
  EXPECT_EQ(seen.size(), 8u) << "every (tp, pp, dp) once";
  EXPECT_TRUE(plan["memory_limit_bytes"].is_null()) << plan["memory_limit"];
  const Result table = run(eight);
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_NE(table.out.find("ok: 8 ranks"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("not on this host"), std::string::npos) << table.out;
  // A limit between the ranks' peaks: refused, naming a rank over it; above them all: passes.
  char gib[32];
  std::snprintf(gib, sizeof gib, "%.9f", (least + worst) / 2 / (1024.0 * 1024.0 * 1024.0));
  const Result over = run(with(eight, {"--memory-limit-gib", gib}));
  EXPECT_EQ(over.status, 2);
  EXPECT_NE(over.err.find("--memory-limit-gib: rank "), std::string::npos) << over.err;
  EXPECT_EQ(over.out, "");
  std::snprintf(gib, sizeof gib, "%.9f", worst * 1.01 / (1024.0 * 1024.0 * 1024.0));
  EXPECT_EQ(run(with(eight, {"--memory-limit-gib", gib})).status, 0);
  // Not without --dry-run, not with a plan file, not out of range; no checkpoint shards here.
  expect_bad(tiny_run({"--num-gpus", "8"}), "--num-gpus: needs --dry-run");
  expect_bad(tiny_run({"--num-gpus", "0", "--dry-run"}), "--num-gpus");
  expect_bad(tiny_run({"--num-gpus", "3", "--tensor-model-parallel-size", "2", "--dry-run"}),
             "--num-gpus");
  expect_bad(with(eight, {"--load", std::filesystem::temp_directory_path().string()}), "--load");
}

// Megatron's precision flags: plan prints --bf16 where it priced bf16 (the GPU presets) and not
// on an fp32 profile; ptdp run trains --bf16 (MoE models too, their routed experts computing in
// fp32, as it says) and --fp16 with loss scaling (whose flags need --fp16); the dry run counts 2 +
// 4 + 4 + 8 bytes per parameter in bf16 (weights, gradients, master weights, Adam) where fp32
// counts 4 + 4
// + 8.
TEST(Cli, PrecisionFlagsArePrintedPricedAndRun) {
  const Result plan = run(
      {"plan", "--model", "gpt-1.7b", "--num-gpus", "8", "--global-batch-size", "64", "--json"});
  ASSERT_EQ(plan.status, 0) << plan.err;
  const std::string flags = nlohmann::json::parse(plan.out)["plans"][0]["megatron_flags"];
  EXPECT_NE(flags.find(" --bf16"), std::string::npos) << flags;
  const std::vector<std::string> predict = {"predict",  "--model",
                                            "gpt-1.7b", "--num-gpus",
                                            "8",        "--global-batch-size",
                                            "64",       "--tensor-model-parallel-size",
                                            "1",        "--pipeline-model-parallel-size",
                                            "1",        "--micro-batch-size",
                                            "1"};
  auto with = [](std::vector<std::string> a, std::vector<std::string> extra) {
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const Result fp16 = run(with(predict, {"--fp16", "--json"}));
  ASSERT_EQ(fp16.status, 0) << fp16.err;
  EXPECT_NE(nlohmann::json::parse(fp16.out)["megatron_flags"].get<std::string>().find(" --fp16"),
            std::string::npos);
  const Result half = run(tiny_run({"--fp16", "--loss-scale", "512"}));
  ASSERT_EQ(half.status, 0) << half.err;
  EXPECT_NE(half.out.find("fp16 weights and activations"), std::string::npos) << half.out;
  EXPECT_NE(half.out.find("static loss scale 512"), std::string::npos) << half.out;
  EXPECT_NE(half.out.find("loss scale 512\n"), std::string::npos) << half.out;
  expect_bad(tiny_run({"--bf16", "--fp16"}), "--fp16: conflicts with --bf16");
  expect_bad(tiny_run({"--loss-scale", "512"}), "--loss-scale: needs fp16 training (--fp16");
  expect_bad(tiny_run({"--fp16", "--hysteresis", "0"}), "--hysteresis: must be at least 1");
  expect_bad(tiny_run({"--fp16", "--initial-loss-scale", "-1"}), "--initial-loss-scale");
  expect_bad(tiny_run({"--fp16", "--min-loss-scale", "1e20"}), "--min-loss-scale");
  expect_bad(with(predict, {"--bf16", "--fp16"}), "--fp16");
  // A bf16 model's routed rows are bf16; an fp16 model's are widened to fp32, and run says so.
  const Result moe = run(tiny_run({"--bf16", "--num-experts", "2"}));
  EXPECT_EQ(moe.status, 0) << moe.err;
  EXPECT_EQ(moe.out.find("routed experts compute in fp32"), std::string::npos) << moe.out;
  const Result moe16 = run(tiny_run({"--fp16", "--num-experts", "2"}));
  EXPECT_EQ(moe16.status, 0) << moe16.err;
  EXPECT_NE(moe16.out.find("routed experts compute in fp32"), std::string::npos) << moe16.out;
  auto dry = [&](std::vector<std::string> extra) {
    auto args = tiny_run(std::move(extra));
    args.insert(args.end(), {"--dry-run", "--json"});
    const Result r = run(args);
    EXPECT_EQ(r.status, 0) << r.err;
    return nlohmann::json::parse(r.out)["plans"][0]["ranks"][0];
  };
  const nlohmann::json f32 = dry({}), b16 = dry({"--bf16"});
  const double params = f32["parameters"].get<double>();
  EXPECT_EQ(b16["parameters"].get<double>(), params);
  EXPECT_EQ(f32["parameter_bytes"].get<double>(), 4 * params);
  EXPECT_EQ(b16["parameter_bytes"].get<double>(), 2 * params);
  EXPECT_EQ(b16["gradient_bytes"].get<double>(), 4 * params);
  EXPECT_EQ(f32["optimizer_bytes"].get<double>(), 8 * params);
  EXPECT_EQ(b16["optimizer_bytes"].get<double>(), 12 * params);
  EXPECT_LT(b16["activation_bytes"].get<double>(), f32["activation_bytes"].get<double>());
  const Result trained = run(tiny_run({"--bf16"}));
  ASSERT_EQ(trained.status, 0) << trained.err;
  EXPECT_NE(trained.out.find("bf16 weights and activations"), std::string::npos) << trained.out;
}

// Splits a command line as a POSIX shell does for plain words and double-quoted ones (what
// megatron_flags prints).
std::vector<std::string> shell_words(const std::string& line) {
  std::vector<std::string> words;
  std::string word;
  bool in_word = false, quoted = false;
  for (char ch : line) {
    if (ch == '"') {
      quoted = !quoted;
      in_word = true;
    } else if (ch == ' ' && !quoted) {
      if (in_word) words.push_back(word);
      word.clear();
      in_word = false;
    } else {
      word += ch;
      in_word = true;
    }
  }
  if (in_word) words.push_back(word);
  return words;
}

// The mission's promise, checked at the command line: the Megatron-LM flags `ptdp plan` prints
// for each plan it lists, handed back verbatim to `ptdp predict` with the same cluster, are
// read as that very plan (the same configuration, time and memory). The cases between them
// print every kind of flag the planner chooses; the last check says they did.
TEST(Cli, TheMegatronFlagsOfEveryListedPlanPredictThatPlan) {
  const std::string deepseek =
      std::string(PTDP_SOURCE_DIR) + "/examples/models/deepseek-moe-16b.config.json";
  struct Case {
    std::vector<std::string> plan;  // after "plan"; --cluster and --num-gpus come first
    // ptdp's settings that are not Megatron-LM flags: given to predict again, as a user would.
    std::vector<std::string> ptdp_only = {};
  };
  const std::vector<Case> cases = {
      {{"--cluster", "dgx-a100-80gb", "--num-gpus", "1024", "--model", "gpt3-175b",
        "--global-batch-size", "1536"}},
      // 125 microbatches at d = 8, b = 1: interleaving in Megatron-Core's microbatch groups.
      {{"--cluster", "dgx-a100-80gb", "--num-gpus", "384", "--model", "gpt3-175b",
        "--global-batch-size", "1000"}},
      {{"--cluster", "dgx-a100-80gb", "--num-gpus", "64", "--model", "gpt3-175b",
        "--global-batch-size", "512", "--seq-length", "8192", "--fp16", "--overlap-grad-reduce"},
       {"--fp16-grad-reduce", "--no-scatter-gather"}},
      {{"--cluster", "dgx-h100", "--num-gpus", "64", "--model", "llama3-8b", "--global-batch-size",
        "256", "--fp8-format", "hybrid", "--no-gradient-accumulation-fusion"}},
      // At s = 4096 the best MoE plans split the sequence (cp 2), at 2048 the experts.
      {{"--cluster", "dgx-h100", "--num-gpus", "128", "--model", "mixtral-8x7b",
        "--global-batch-size", "256", "--seq-length", "4096"}},
      {{"--cluster", "dgx-h100", "--num-gpus", "128", "--model", "mixtral-8x7b",
        "--global-batch-size", "256", "--seq-length", "2048"}},
      {{"--cluster", "dgx-a100-80gb", "--num-gpus", "64", "--model", deepseek,
        "--global-batch-size", "256", "--moe-expert-capacity-factor", "1.5"}},
      // Megatron-Core's combined 1F1B where a plan allows it (ep > 1; interleaved, or p = 1).
      {{"--cluster", "dgx-h100", "--num-gpus", "64", "--model", "qwen2-57b-a14b",
        "--global-batch-size", "256", "--overlap-moe-expert-parallel-comm"}},
      // DeepSeek's multi-head latent attention (no context parallelism), with an MTP module.
      {{"--cluster", "dgx-h100", "--num-gpus", "64", "--model", "deepseek-v2-lite",
        "--global-batch-size", "256", "--mtp-num-layers", "1"}},
      // Megatron-FSDP's strategies where p = 1.
      {{"--cluster", "dgx-h100", "--num-gpus", "16", "--model", "llama2-7b", "--global-batch-size",
        "64", "--use-megatron-fsdp"}},
      // 126 layers: interleaved layouts that count the embedding and the loss as layers.
      {{"--cluster", "dgx-h100", "--num-gpus", "1024", "--model", "llama3-405b",
        "--global-batch-size", "1536", "--seq-length", "8192"}},
      // The distributed optimizer in instances (one per node's part of the data-parallel group).
      {{"--cluster", "dgx-h100", "--num-gpus", "64", "--model", "llama2-7b", "--global-batch-size",
        "256", "--num-distributed-optimizer-instances", "auto"}},
      {{"--cluster", "dgx-h100", "--num-gpus", "32", "--model", "llama2-7b", "--global-batch-size",
        "128", "--num-distributed-optimizer-instances", "auto", "--use-megatron-fsdp"}},
      {{"--cluster",
        "dgx-a100-80gb",
        "--num-gpus",
        "64",
        "--num-layers",
        "30",
        "--hidden-size",
        "6144",
        "--num-attention-heads",
        "48",
        "--seq-length",
        "2048",
        "--max-position-embeddings",
        "4096",
        "--vocab-size",
        "50257",
        "--global-batch-size",
        "256",
        "--tp-comm-overlap",
        "--overlap-grad-reduce",
        "--overlap-param-gather"}},
  };
  std::set<std::string> seen;
  const std::vector<std::string> kinds = {"--recompute-method uniform",
                                          "--recompute-method block",
                                          "--recompute-granularity selective",
                                          "--moe-layer-freq",
                                          "--decoder-first-pipeline-num-layers",
                                          "--pipeline-model-parallel-layout",
                                          "--mtp-num-layers",
                                          "--num-layers-per-virtual-pipeline-stage",
                                          "--microbatch-group-size-per-virtual-pipeline-stage",
                                          "--group-query-attention",
                                          "--context-parallel-size",
                                          "--expert-model-parallel-size",
                                          "--expert-tensor-parallel-size",
                                          "--sequence-parallel",
                                          "--use-distributed-optimizer",
                                          "--max-position-embeddings 4096",
                                          "--fp16",
                                          "--fp8-format",
                                          "--overlap-grad-reduce",
                                          "--moe-expert-capacity-factor",
                                          "--no-gradient-accumulation-fusion",
                                          "--tp-comm-overlap",
                                          "--overlap-param-gather",
                                          "--overlap-moe-expert-parallel-comm",
                                          "--data-parallel-sharding-strategy optim_grads ",
                                          "--data-parallel-sharding-strategy optim_grads_params",
                                          "--num-distributed-optimizer-instances",
                                          "--outer-dp-sharding-strategy",
                                          "--untie-embeddings-and-output-weights"};
  for (const Case& c : cases) {
    std::vector<std::string> args = {"plan", "--top", "40", "--json", "--no-progress"};
    args.insert(args.end(), c.plan.begin(), c.plan.end());
    args.insert(args.end(), c.ptdp_only.begin(), c.ptdp_only.end());
    const Result planned = run(args);
    ASSERT_EQ(planned.status, 0) << planned.err;
    const nlohmann::json plans = nlohmann::json::parse(planned.out)["plans"];
    ASSERT_GE(plans.size(), 5u) << c.plan[5];
    for (const nlohmann::json& p : plans) {
      const std::string flags = p["megatron_flags"].get<std::string>();
      for (const std::string& k : kinds)
        if (flags.find(k) != std::string::npos) seen.insert(k);
      std::vector<std::string> again = {"predict", c.plan[0], c.plan[1],
                                        c.plan[2], c.plan[3], "--json"};
      for (const std::string& w : shell_words(flags)) again.push_back(w);
      again.insert(again.end(), c.ptdp_only.begin(), c.ptdp_only.end());
      const Result predicted = run(again);
      ASSERT_EQ(predicted.status, 0) << flags << "\n" << predicted.err;
      const nlohmann::json q = nlohmann::json::parse(predicted.out);
      EXPECT_EQ(q["configuration"], p["configuration"]) << flags;
      EXPECT_EQ(q["memory"], p["memory"]) << flags;
      EXPECT_DOUBLE_EQ(q["iteration_time_s"].get<double>(), p["iteration_time_s"].get<double>())
          << flags;
      EXPECT_EQ(q["megatron_flags"], p["megatron_flags"]);
    }
  }
  for (const std::string& k : kinds) EXPECT_TRUE(seen.count(k)) << "no listed plan printed " << k;
}

// Megatron's flags that ptdp's models tie to others are accepted where they agree and refused,
// naming the flag, where they ask for what ptdp does not model.
TEST(CliErrors, MegatronFlagsPtdpDoesNotModel) {
  const auto predict_plus = [](std::initializer_list<std::string> more) {
    auto a = kPredict175B;
    a.insert(a.end(), more);
    return a;
  };
  expect_bad(predict_plus({"--disable-bias-linear"}), "--disable-bias-linear: ptdp's GPT-style");
  expect_bad(predict_plus({"--normalization", "RMSNorm"}), "--normalization: ptdp's models use");
  expect_bad(predict_plus({"--normalization", "BatchNorm"}), "--normalization: must be LayerNorm");
  expect_bad(predict_plus({"--max-position-embeddings", "1024"}),
             "--max-position-embeddings: must be at least seq_length (2048)");
  expect_bad(predict_plus({"--recompute-granularity", "full", "--recompute-method", "block"}),
             "--recompute-num-layers: block recompute needs the number of layers");
  expect_bad(predict_plus({"--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "2"}),
             "--recompute-num-layers: uniform recompute with more than one layer per checkpoint");
  expect_bad(predict_plus({"--recompute-method", "uniform"}),
             "--recompute-method: goes with --recompute-granularity full");
  expect_bad(predict_plus({"--recompute-granularity", "full", "--recompute-num-layers", "1"}),
             "--recompute-num-layers: needs");
  expect_bad(predict_plus({"--accumulate-allreduce-grads-in-fp32", "--fp16-grad-reduce"}),
             "--accumulate-allreduce-grads-in-fp32: conflicts with --fp16-grad-reduce");
  // Megatron-FSDP: its flags need --use-megatron-fsdp, take Megatron's values, and run at p = 1.
  expect_bad(predict_plus({"--data-parallel-sharding-strategy", "optim_grads"}),
             "--data-parallel-sharding-strategy: needs --use-megatron-fsdp");
  expect_bad(predict_plus({"--megatron-fsdp-main-grads-dtype", "fp32"}),
             "--megatron-fsdp-main-grads-dtype: needs --use-megatron-fsdp");
  expect_bad(predict_plus({"--use-megatron-fsdp", "--data-parallel-sharding-strategy", "zero3"}),
             "--data-parallel-sharding-strategy: unknown value 'zero3'");
  expect_bad(predict_plus({"--use-megatron-fsdp", "--megatron-fsdp-main-grads-dtype", "fp8"}),
             "--megatron-fsdp-main-grads-dtype: must be fp32, bf16, fp16 or auto");
  expect_bad(predict_plus({"--ckpt-format", "hdf5"}), "--ckpt-format: must be torch");
  expect_bad(predict_plus({"--use-megatron-fsdp", "--ckpt-format", "torch_dist"}),
             "--ckpt-format: must be fsdp_dtensor with --use-megatron-fsdp");
  expect_bad(
      predict_plus({"--use-megatron-fsdp", "--overlap-grad-reduce", "--overlap-param-gather"}),
      "--overlap-param-gather: has no sharded weights to gather");
  expect_bad(predict_plus({"--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                           "optim_grads_params"}),
             "--use-megatron-fsdp: runs with pipeline-model-parallel-size 1");
  expect_bad(predict_plus({"--num-experts", "8", "--moe-token-dispatcher-type", "allgather"}),
             "--moe-token-dispatcher-type: ptdp prices and runs the alltoall dispatcher only");
  // Megatron-Core's conditions for its combined 1F1B: expert parallelism, and 16-bit training.
  auto combined = kPredictMixtral;
  combined.insert(combined.end(), {"--overlap-moe-expert-parallel-comm"});
  expect_bad(combined, "--overlap-moe-expert-parallel-comm: needs expert-model-parallel-size > 1");
  const std::string fp32 = temp_file("fp32-profile.json", [] {
    nlohmann::json j = to_json(resolve_profile("h100-sxm"));
    j["activation_dtype"] = "fp32";
    return j.dump();
  }());
  combined.insert(combined.end(), {"--expert-model-parallel-size", "8", "--profile", fp32});
  expect_bad(combined, "--overlap-moe-expert-parallel-comm: needs 16-bit training");
  combined.push_back("--bf16");
  expect_bad(combined, "--overlap-moe-expert-parallel-comm: needs the interleaved schedule");
  combined.insert(combined.end(), {"--num-virtual-stages-per-pipeline-rank", "2"});
  const Result ok = run(combined);
  EXPECT_EQ(ok.status, 0) << ok.err;
  const auto moe = [&](const std::string& freq) {
    return predict_plus(
        {"--num-experts", "8", "--sequence-parallel", "--moe-layer-freq", freq, "--json"});
  };
  expect_bad(moe("[0,1]"),
             "--moe-layer-freq: cannot read the layer pattern '[0,1]': it has 2 "
             "entries for 96 layers");
  expect_bad(moe("[0,1]*48"), "--moe-layer-freq: ptdp models MoE layers as every N-th layer");
  expect_bad(moe("([0]*3+[2]*93)"), "--moe-layer-freq: cannot read");
  expect_bad(moe("x"), "--moe-layer-freq: must be a positive integer or a layer pattern");
  // What does agree is read: patterns as Megatron writes them, and GQA's default of one group.
  const auto flags_of = [](const std::vector<std::string>& args) {
    const Result r = run(args);
    EXPECT_EQ(r.status, 0) << r.err;
    return r.status ? std::string()
                    : nlohmann::json::parse(r.out)["megatron_flags"].get<std::string>();
  };
  EXPECT_NE(flags_of(moe("([0]*3+[1]*93)")).find("--moe-layer-freq \"[0,0,0,1,1,"),
            std::string::npos);
  EXPECT_NE(flags_of(moe("[1,0]*48")).find("--moe-layer-freq 2 "), std::string::npos);
  auto mqa = predict_with("--tensor-model-parallel-size", "1");
  mqa.insert(mqa.end(), {"--group-query-attention", "--json"});
  EXPECT_NE(flags_of(mqa).find("--group-query-attention --num-query-groups 1 "), std::string::npos);
}

// Found by fuzzing (tests/fuzz/, docs/reliability.md): still one line naming the field.
TEST(CliErrors, HugeNumbersAndLineBreaksInArguments) {
  expect_bad(predict_with("--num-gpus", "1000000000000"), "--num-gpus: 1000000000000 exceeds");
  expect_bad(predict_with("--hidden-size", "4611686018427387904"), "--hidden-size");
  expect_bad({"pl\nan"}, "unknown subcommand 'pl?an'");
  // Empty arguments once sent CLI11 into an endless loop through an option group.
  expect_bad({"run", "--plan", "x", "", "", "--json", ""}, "not expected");
  const std::string plans = temp_file("one_plan.json", R"({"tensor_parallel": 1})");
  expect_bad({"run", "--plan", plans, "--plan-index", "1\n2", "--model", "gpt-1.7b"},
             "--plan-index: must be a plan's rank (1 = the best) or all, got '1\\n2'");
}

}  // namespace
}  // namespace ptdp
