// The command line, run in-process: outputs, JSON keys, and one-line errors with exit status 2.
#include "cli/cli.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace ptdp {
namespace {

struct Result {
  int status;
  std::string out, err;
};

Result run(std::vector<std::string> args) {
  args.insert(args.begin(), "ptdp");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int status = run_cli(static_cast<int>(argv.size()), argv.data(), out, err);
  return {status, out.str(), err.str()};
}

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
  for (const char* key : {"compute_s", "recompute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s",
                          "bubble_s", "optimizer_s"}) {
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
TEST(CliErrors, MissingFile) {
  expect_bad({"plan", "--model", "/nonexistent/x.json", "--global-batch-size", "8"}, "model");
}
TEST(CliErrors, BadRecomputeAndNumGpus) {
  expect_bad(predict_with("--recompute-granularity", "some"), "--recompute-granularity");
  expect_bad(predict_with("--num-gpus", "1001"), "num_gpus");
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

}  // namespace
}  // namespace ptdp
