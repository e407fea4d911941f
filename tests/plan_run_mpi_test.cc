// One validity rule (core/plan_rules.h), as a property of the two commands users chain: every
// plan `ptdp plan` ranks is one `ptdp run` accepts. For three small models (a GPT, a deeper GPT
// whose FFN width and sequence length t = 4 or 8 does not always divide, and a GQA + SwiGLU +
// untied model with rotary positions, as Llama) and 1, 2, 4, 8 and 16 ranks, every plan of `ptdp
// plan --top 20 --out` passes `ptdp run --dry-run` under mpirun (one launch per model and rank
// count, --plan-index all), one process working out every rank gives the same footprints, and
// the best plan trains to the single-rank losses. Also: the dry run
// refuses a rank whose predicted memory exceeds --memory-limit-gib, naming it.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/support/launch.h"

namespace ptdp {
namespace {

namespace fs = std::filesystem;

using test::Outcome;
using test::read_file;

fs::path scratch() {
  return test::scratch_dir("ptdp_plan_run_mpi_test");
}

// Runs `ptdp <args>` on np ranks under the launcher (np = 0: directly).
Outcome ptdp(int np, const std::string& args) {
  return test::launch(PTDP_MPIEXEC, PTDP_BINARY, np, args, "ptdp_plan_run_mpi_test");
}

nlohmann::json json_of(const Outcome& r, const std::string& what) {
  EXPECT_EQ(r.status, 0) << what << "\n" << r.err;
  try {
    return nlohmann::json::parse(r.out);
  } catch (const nlohmann::json::exception&) {
    ADD_FAILURE() << "no JSON from " << what << ":\n" << r.out << r.err;
    return {};
  }
}

std::vector<double> losses(const nlohmann::json& j) {
  return j.contains("losses") ? j["losses"].get<std::vector<double>>() : std::vector<double>{};
}

// Small global batches, so that d is small and the ranked plans use t and p on many ranks.
// The tiny GPT of tests/run_mpi_test.cc.
const std::string kTiny =
    " --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 128"
    " --global-batch-size 4";
// Eight heads, so t reaches 8; t = 8 does not divide the FFN width (100) and t = 4 not the
// sequence (30), which only sequence parallelism minds. With B = 1 every plan on 8 or 16
// ranks is d = 1, and a search that missed these rules ranks such plans (even first on 16).
const std::string kDeep =
    " --num-layers 8 --hidden-size 64 --num-attention-heads 8 --ffn-hidden-size 100"
    " --seq-length 30 --vocab-size 128 --global-batch-size 1";
// Llama's shape: grouped-query attention, SwiGLU, untied embeddings, rotary positions, and a
// vocabulary (127) that t does not divide.
const std::string kLlama =
    " --num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 --swiglu"
    " --untie-embeddings-and-output-weights --ffn-hidden-size 96 --seq-length 32"
    " --vocab-size 127 --global-batch-size 4 --position-embedding-type rope";

// For each rank count: plan, dry-run every ranked plan in one launch, train the best.
void every_ranked_plan_runs(const std::string& model, const std::string& name) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // A plan file's plan trains in the precision it was priced in. `ptdp plan` prices bf16 here (the
  // default cluster's profile); the files are set to fp32 (as a plan priced with a machine file
  // of fp32 kernels says) so that layouts are held to fp32's 1e-5 (a layout's bug moves 1e-3).
  const nlohmann::json single =
      json_of(ptdp(0, "run" + model + " --steps 2 --json"), name + " on one rank");
  ASSERT_EQ(losses(single).size(), 2u);
  int checked = 0;
  for (int n : {1, 2, 4, 8, 16}) {
    const std::string ranks = name + " on " + std::to_string(n) + " ranks";
    const fs::path file = scratch() / (name + "_" + std::to_string(n) + ".json");
    const Outcome planned = ptdp(0, "plan" + model + " --num-gpus " + std::to_string(n) +
                                        " --top 20 --no-progress --out " + file.string());
    ASSERT_EQ(planned.status, 0) << ranks << "\n" << planned.err;
    nlohmann::json planned_file = nlohmann::json::parse(read_file(file));
    for (nlohmann::json& plan : planned_file["plans"]) {
      ASSERT_EQ(plan["precision"], "bf16") << ranks;
      plan["precision"] = "fp32";
    }
    std::ofstream(file) << planned_file.dump();
    const nlohmann::json plans = planned_file["plans"];
    ASSERT_FALSE(plans.empty()) << ranks;

    // Every ranked plan passes every check `ptdp run` makes.
    const nlohmann::json dry =
        json_of(ptdp(n, "run --plan " + file.string() + " --plan-index all --dry-run --json"),
                ranks + ": dry run of every plan");
    ASSERT_TRUE(dry.contains("plans")) << ranks;
    ASSERT_EQ(dry["plans"].size(), plans.size()) << ranks;
    for (size_t i = 0; i < plans.size(); ++i) {
      const nlohmann::json& d = dry["plans"][i];
      EXPECT_EQ(d["index"], static_cast<int>(i + 1));
      EXPECT_EQ(d["configuration"], plans[i]["configuration"]) << ranks << " plan " << i + 1;
      ASSERT_EQ(d["ranks"].size(), static_cast<size_t>(n)) << ranks;
      for (int r = 0; r < n; ++r) {
        const nlohmann::json& rank = d["ranks"][static_cast<size_t>(r)];
        EXPECT_EQ(rank["rank"], r);
        EXPECT_GT(rank["parameters"].get<int64_t>(), 0);
        EXPECT_GT(rank["peak_bytes"].get<double>(), rank["parameter_bytes"].get<double>());
      }
      ++checked;
    }
    // One process works out the same ranks of every plan (no mpirun: each rank's layout checked
    // here, no memory limit as the ranks are not on this host).
    const nlohmann::json here =
        json_of(ptdp(0, "run --plan " + file.string() + " --plan-index all --dry-run --json"),
                ranks + ": dry run of every plan in one process");
    ASSERT_EQ(here["plans"].size(), dry["plans"].size()) << ranks;
    for (size_t i = 0; i < plans.size(); ++i)
      EXPECT_EQ(here["plans"][i]["ranks"], dry["plans"][i]["ranks"]) << ranks << " plan " << i + 1;

    // The best plan trains to the single-rank losses.
    const nlohmann::json best = json_of(
        ptdp(n, "run --plan " + file.string() + " --steps 2 --json"), ranks + ": the best plan");
    EXPECT_EQ(best["configuration"], plans[0]["configuration"]) << ranks;
    EXPECT_EQ(best["parameters"], single["parameters"]) << ranks;
    EXPECT_EQ(best["precision"], "fp32") << ranks;
    const auto got = losses(best), want = losses(single);
    ASSERT_EQ(got.size(), want.size()) << ranks;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << ranks << " step " << i;
  }
  std::printf("%s: %d ranked plans passed the dry run on 1-16 ranks in %.1f s\n", name.c_str(),
              checked, std::chrono::duration<double>(Clock::now() - start).count());
}

TEST(PlanRunMpi, EveryRankedPlanOfTheTinyGptRuns) {
  every_ranked_plan_runs(kTiny, "tiny");
}

TEST(PlanRunMpi, EveryRankedPlanOfTheEightLayerGptRuns) {
  every_ranked_plan_runs(kDeep, "deep");
}

TEST(PlanRunMpi, EveryRankedPlanOfTheRotaryGqaSwigluUntiedModelRuns) {
  every_ranked_plan_runs(kLlama, "llama");
}

// A limit between the ranks' predicted peaks: the dry run stops every rank, and the one line
// names the lowest rank over the limit.
TEST(PlanRunMpi, DryRunRefusesARankOverTheMemoryLimit) {
  const std::string plan =
      "run" + kTiny + " --pipeline-model-parallel-size 4 --micro-batch-size 1 --dry-run";
  const nlohmann::json dry = json_of(ptdp(4, plan + " --json"), "dry run");
  ASSERT_EQ(dry["plans"].size(), 1u);
  const nlohmann::json& ranks = dry["plans"][0]["ranks"];
  ASSERT_EQ(ranks.size(), 4u);
  double lo = HUGE_VAL, hi = 0;
  for (const auto& r : ranks) {
    lo = std::min(lo, r["peak_bytes"].get<double>());
    hi = std::max(hi, r["peak_bytes"].get<double>());
  }
  ASSERT_LT(lo, hi) << "the stages should differ (embedding, LM head)";
  const double limit = (lo + hi) / 2;
  int first_over = -1;
  for (const auto& r : ranks)
    if (r["peak_bytes"].get<double>() > limit) {
      first_over = r["rank"].get<int>();
      break;
    }
  char gib[32];
  std::snprintf(gib, sizeof gib, "%.9f", limit / (1024.0 * 1024.0 * 1024.0));
  const Outcome refused = ptdp(4, plan + " --memory-limit-gib " + gib);
  EXPECT_EQ(refused.status, 2) << refused.err;
  const std::string needle = "ptdp: --memory-limit-gib: rank " + std::to_string(first_over) + " ";
  const size_t at = refused.err.find(needle);
  EXPECT_NE(at, std::string::npos) << refused.err;
  EXPECT_EQ(refused.err.find("ptdp:", at + 1), std::string::npos) << "reported twice\n"
                                                                  << refused.err;
  EXPECT_EQ(refused.out, "");
  // Above every rank's peak, the same plan passes.
  std::snprintf(gib, sizeof gib, "%.9f", hi * 1.01 / (1024.0 * 1024.0 * 1024.0));
  EXPECT_EQ(ptdp(4, plan + " --memory-limit-gib " + gib).status, 0);
}

}  // namespace
}  // namespace ptdp
