// The analytic model against the published Megatron-LM measurements (SC'21 Table 1 and
// Figures 11, 12, 16). Prints a table of every point, then asserts the bounds.
#include "tests/support/validation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "core/presets.h"
#include "planner/cost_model.h"
#include "planner/search.h"

namespace ptdp {
namespace {

std::vector<ValidationCase> cases() {
  return load_sc21_cases(std::string(PTDP_SOURCE_DIR) +
                         "/tests/data/validation/megatron_sc21.json");
}

ClusterSpec selene(int64_t gpus) {
  ClusterSpec c = resolve_cluster("dgx-a100-80gb");
  c.resize(gpus);
  return c;
}

double predicted_time(const ValidationCase& v) {
  const ClusterSpec c = selene(v.plan.num_gpus());
  v.plan.validate(v.model);
  return CostModel(v.model, c, resolve_profile("a100-80gb")).predict(v.plan).iteration_time_s;
}

double rel_error(const ValidationCase& v) {
  return predicted_time(v) / v.measured_iteration_s - 1.0;
}

TEST(Validation, PrintsEveryPoint) {
  for (const ValidationCase& v : cases()) {
    const double pred = predicted_time(v);
    std::printf("%-26s measured %8.3f s (%5.1f TFLOP/s)  predicted %8.3f s  error %+6.1f%%\n",
                v.label.c_str(), v.measured_iteration_s, v.measured_tflops_per_gpu, pred,
                100 * (pred / v.measured_iteration_s - 1));
  }
}

TEST(Validation, Table1EveryRowWithin10PercentMeanWithin5) {
  double sum = 0;
  int n = 0;
  for (const ValidationCase& v : cases()) {
    if (v.label.rfind("table1", 0) != 0) continue;
    const double e = rel_error(v);
    EXPECT_LT(std::abs(e), 0.10) << v.label;
    sum += std::abs(e);
    ++n;
  }
  ASSERT_EQ(n, 10);
  EXPECT_LE(sum / n, 0.05);
}

TEST(Validation, FiguresEveryPointWithin10Percent) {
  int n = 0;
  for (const ValidationCase& v : cases()) {
    if (v.label.rfind("fig", 0) != 0) continue;
    EXPECT_LT(std::abs(rel_error(v)), 0.10) << v.label;
    ++n;
  }
  EXPECT_EQ(n, 8 + 10 + 8);
}

double tflops(const ValidationCase& v) {
  return tflops_per_gpu(
      sc21_equation3_flops(v.model, static_cast<double>(v.plan.global_batch_size)),
      predicted_time(v), v.plan.num_gpus());
}

TEST(Validation, Figure12InterleavingWinsAtEveryBatch) {
  std::map<std::string, double> t;
  for (const ValidationCase& v : cases()) {
    if (v.label.rfind("fig12", 0) == 0) t[v.label] = tflops(v);
  }
  for (int batch : {12, 24, 36, 48, 60}) {
    const std::string b = " B=" + std::to_string(batch);
    EXPECT_GT(t.at("fig12 interleaved" + b), t.at("fig12 1f1b" + b)) << b;
  }
}

// Figure 11 (weak scaling of p, 3 layers per stage): throughput falls with p at both batches,
// steeply at B=8 where the bubble (p-1)/m reaches 7/8, gently at B=128.
TEST(Validation, Figure11ThroughputFallsWithPipelineDepth) {
  std::map<std::string, double> t;
  for (const ValidationCase& v : cases()) {
    if (v.label.rfind("fig11", 0) == 0) t[v.label] = tflops(v);
  }
  for (int batch : {8, 128}) {
    const std::string b = " B=" + std::to_string(batch);
    for (int p : {1, 2, 4}) {
      EXPECT_GT(t.at("fig11 p=" + std::to_string(p) + b),
                t.at("fig11 p=" + std::to_string(2 * p) + b))
          << "p=" << p << b;
    }
  }
  // Measured: p=8 keeps 53% of p=1's throughput at B=8 and 92% at B=128.
  EXPECT_LT(t.at("fig11 p=8 B=8") / t.at("fig11 p=1 B=8"), 0.65);
  EXPECT_GT(t.at("fig11 p=8 B=128") / t.at("fig11 p=1 B=128"), 0.9);
}

// b=1 loses to b=2 through tile and wave quantisation of its GEMMs; b=4 and b=8 lose through
// the larger bubble. The margins are thin (1.1% over b=1 at B=128, 0.5% over b=4 at B=512;
// measured 1.8% and 7%), and docs/validation.md says what they rest on.
TEST(Validation, Figure16MicroBatchTwoIsBest) {
  for (int batch : {128, 512}) {
    std::map<int, double> t;
    for (const ValidationCase& v : cases()) {
      if (v.label.rfind("fig16", 0) == 0 && v.plan.global_batch_size == batch) {
        t[static_cast<int>(v.plan.micro_batch_size)] = tflops(v);
      }
    }
    ASSERT_EQ(t.size(), 4u);
    for (int b : {1, 4, 8}) EXPECT_GT(t.at(2), t.at(b)) << "B=" << batch << " b=" << b;
  }
}

// For every Table 1 row the search finds a plan at least as fast as the paper's.
TEST(Validation, PlanBeatsOrMatchesEveryTable1Configuration) {
  for (const ValidationCase& v : cases()) {
    if (v.label.rfind("table1", 0) != 0) continue;
    const ClusterSpec c = selene(v.plan.num_gpus());
    const HardwareProfile h = resolve_profile("a100-80gb");
    SearchOptions o;
    o.global_batch_size = v.plan.global_batch_size;
    o.top_k = 1;
    o.defaults = v.plan;  // the paper's precision and communication settings
    const SearchResult r = search_plans(v.model, c, h, o);
    ASSERT_FALSE(r.top.empty()) << v.label;
    const double paper = CostModel(v.model, c, h).predict(v.plan).iteration_time_s;
    EXPECT_LE(r.top[0].prediction.iteration_time_s, paper * (1 + 1e-12)) << v.label;
    std::printf("%-18s paper %s: %.3f s; best %s: %.3f s (%s)\n", v.label.c_str(),
                plan_summary(v.plan).c_str(), paper, plan_summary(r.top[0].plan).c_str(),
                r.top[0].prediction.iteration_time_s,
                plan_difference(v.plan, r.top[0].plan).c_str());
  }
}

}  // namespace
}  // namespace ptdp
