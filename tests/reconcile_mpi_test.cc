// `ptdp run --trace` on 2 CPU ranks under mpirun, then `ptdp reconcile` on its trace, as a user
// runs them: the trace holds every op of both stages (or both tensor-parallel halves), and the
// reconciliation's table and JSON have every row with finite numbers. Accuracy is not asserted
// (the CPU cluster file is an uncalibrated estimate); tests/reconcile_test.cc checks the
// arithmetic against a run of known times.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "tests/support/launch.h"

namespace ptdp {
namespace {

const std::string kTiny =
    " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64"
    " --global-batch-size 8 --micro-batch-size 2 --steps 3";
const std::string kCluster = std::string(" --cluster ") + PTDP_SOURCE_DIR +
                             "/examples/cpu-cluster.json --profile " + PTDP_SOURCE_DIR +
                             "/examples/cpu-profile.json";

test::Outcome ptdp(int np, const std::string& args) {
  return test::launch(PTDP_MPIEXEC, PTDP_BINARY, np, args, "ptdp_reconcile_mpi_test");
}

void expect_finite(const nlohmann::json& c, const std::string& what) {
  for (const char* k : {"predicted_s", "measured_s", "error_s"}) {
    ASSERT_TRUE(c.contains(k)) << what << " " << k;
    EXPECT_TRUE(std::isfinite(c[k].get<double>())) << what << " " << k;
  }
  EXPECT_TRUE(c["relative_error"].is_null() || std::isfinite(c["relative_error"].get<double>()))
      << what;
}

// Every op span lies inside the forward or backward action of its replica, stage, microbatch
// and chunk (times are written to the picosecond).
void expect_ops_inside_their_passes(const std::string& trace) {
  const auto j = nlohmann::json::parse(test::read_file(trace));
  using Key = std::tuple<int, int, int, int>;  // replica, stage, microbatch, chunk
  std::multimap<Key, std::pair<double, double>> passes;
  for (const auto& e : j["traceEvents"])
    if (e["ph"] == "X" && e["args"].contains("action") &&
        (e["args"]["action"] == "F" || e["args"]["action"] == "B"))
      passes.insert({Key{e["pid"], e["args"]["stage"], e["args"]["microbatch"], e["args"]["chunk"]},
                     {e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>()}});
  int ops = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X" || e["cat"] != "op") continue;
    ++ops;
    const double start = e["ts"], end = start + e["dur"].get<double>();
    const auto [lo, hi] = passes.equal_range(
        Key{e["pid"], e["args"]["stage"], e["args"]["microbatch"], e["args"]["chunk"]});
    bool inside = false;
    for (auto it = lo; it != hi; ++it)
      inside |= it->second.first - 1e-6 <= start && end <= it->second.second + 1e-6;
    EXPECT_TRUE(inside) << e.dump();
  }
  EXPECT_GT(ops, 0);
}

void run_and_reconcile(const std::string& layout, const std::string& family_with_time) {
  const auto dir = test::scratch_dir("ptdp_reconcile_mpi_test");
  const std::string trace =
      (dir / ("trace" + std::to_string(std::hash<std::string>{}(layout)) + ".json")).string();
  const test::Outcome run = ptdp(2, "run" + kTiny + layout + " --trace " + trace + " --json");
  ASSERT_EQ(run.status, 0) << run.err;
  expect_ops_inside_their_passes(trace);
  const test::Outcome table = ptdp(0, "reconcile --trace " + trace + kCluster);
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_NE(table.out.find("largest contributor"), std::string::npos) << table.out;
  const test::Outcome json = ptdp(0, "reconcile --json --trace " + trace + kCluster);
  ASSERT_EQ(json.status, 0) << json.err;
  const auto j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["measured_steps"], 2);
  EXPECT_EQ(j["warmup_steps"], 1);
  expect_finite(j["iteration"], "iteration");
  EXPECT_GT(j["iteration"]["measured_s"].get<double>(), 0);
  EXPECT_GT(j["peak_memory"]["measured_bytes"].get<double>(), 0);
  const std::set<std::string> want = {
      "attention_gemm", "mlp_gemm",      "attention_core", "norm",         "elementwise", "tp_comm",
      "embedding_head", "pass_overhead", "pipeline_p2p",   "dp_grad_sync", "optimizer",   "bubble"};
  for (const auto& s : j["stages"]) {
    std::set<std::string> names;
    double sum = 0;
    for (const auto& row : s["rows"]) {
      names.insert(row["name"]);
      expect_finite(row, row["name"]);
      sum += row["measured_s"].get<double>();
      if (row["name"] == "attention_gemm" || row["name"] == family_with_time) {
        EXPECT_GT(row["measured_s"].get<double>(), 0) << row["name"];
      }
    }
    EXPECT_EQ(names, want);
    EXPECT_NEAR(sum, j["iteration"]["measured_s"].get<double>(),
                1e-9 + 1e-6 * j["iteration"]["measured_s"].get<double>());
  }
  EXPECT_TRUE(j["largest_contributor"]["name"].is_string());
}

TEST(ReconcileMpi, PipelineParallelRun) {
  run_and_reconcile(" --pipeline-model-parallel-size 2", "embedding_head");
}

TEST(ReconcileMpi, TensorParallelRun) {
  run_and_reconcile(" --tensor-model-parallel-size 2", "tp_comm");
}

}  // namespace
}  // namespace ptdp
