// `ptdp run --trace` files and `ptdp reconcile`: a trace written and read back holds the same
// spans and metadata; a trace whose every op took exactly the time the cost model prices it at
// reconciles with zero error (the warm-up step, made slower, is left out); bad traces and
// clusters are refused with one line and exit status 2.
#include "cli/reconcile.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli.h"
#include "cli/run_trace.h"
#include "cli/trace_file.h"
#include "core/error.h"
#include "core/presets.h"
#include "core/schedule.h"
#include "planner/op_breakdown.h"
#include "tests/support/cli_run.h"

namespace ptdp {
namespace {

ModelSpec tiny_model() {
  ModelSpec m;
  m.name = "tiny";
  m.num_layers = 4;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.seq_length = 32;
  m.vocab_size = 128;
  return m;
}

ParallelPlan plan_of(int64_t p, int64_t d, int64_t v) {
  ParallelPlan plan;
  plan.pipeline_parallel = p;
  plan.data_parallel = d;
  plan.micro_batch_size = 2;
  plan.global_batch_size = 16;
  plan.virtual_stages = v;
  if (v > 1) plan.schedule = Schedule::kInterleaved1F1B;
  return plan;
}

CostModel cost_for(const ModelSpec& m, const ParallelPlan& p) {
  ClusterSpec c = resolve_cluster("dgx-a100-80gb");
  c.resize(p.num_gpus());
  return CostModel(m, c, default_profile_for(c));
}

// A run whose every op, p2p call, gradient sync and optimizer step took exactly its predicted
// time, each step lasting the predicted iteration; the warm-up step (step 0) takes `warmup`
// times as long in everything. With `slow_mlp` > 0 every MLP GEMM of the last stage takes that
// much longer, and each step as much longer as the last stage's extra time.
// With `norm_wait`, in step s the first stage's optimizer step holds a gradient-norm all-reduce
// of norm_wait[s] (waiting for the others), and the step is as much longer.
TrainResult predicted_run(const CostModel& cost, const ParallelPlan& p, int steps, double warmup,
                          double slow_mlp = 0, const std::vector<double>& norm_wait = {}) {
  const ModelSpec& m = cost.model();
  const PredictedBreakdown pred = predict_breakdown(cost, p);
  const LayerShape shape = layer_shape(p);
  const PassOps layer = transformer_layer_ops(m, shape), embed = embedding_ops(m, shape),
                head = lm_head_ops(m, shape);
  const PipelineSchedule sched =
      make_pipeline_schedule(schedule_spec(p, !m.untie_embeddings_and_output_weights));
  const double p2p = cost.comm().p2p_time(cost.activation_message_bytes(p), p);
  TrainResult r;
  double step_start = 0;
  std::vector<double> cursor(static_cast<size_t>(p.pipeline_parallel * p.data_parallel), 0.0);
  for (int s = 0; s < steps; ++s) {
    const double scale = s == 0 ? warmup : 1.0;
    StepStats st;
    st.step = s;
    st.start = step_start;
    st.seconds = pred.iteration * scale;
    double slower = 0;  // the last stage's extra time this step
    for (int32_t dp = 0; dp < p.data_parallel; ++dp) {
      for (int32_t pp = 0; pp < p.pipeline_parallel; ++pp) {
        double& t = cursor[static_cast<size_t>(dp * p.pipeline_parallel + pp)];
        t = std::max(t, step_start);
        const StagePrediction& ps = pred.stages[static_cast<size_t>(pp)];
        const auto& list = sched.ranks[static_cast<size_t>(pp)];
        for (size_t i = 0; i < list.size(); ++i) {
          const PipelineAction& a = list[i];
          const double start = t;
          if (a.kind == ActionKind::kForward || a.kind == ActionKind::kBackward) {
            const bool fwd = a.kind == ActionKind::kForward;
            const int64_t layers = p.layers_on_stage(m, pp) / p.virtual_stages;
            auto run_ops = [&](const std::vector<Op>& ops, int64_t times) {
              for (int64_t k = 0; k < times; ++k)
                for (const Op& op : ops) {
                  double d = cost.op_time(op, p) * scale;
                  if (pp == p.pipeline_parallel - 1 && op_family(op.id) == OpFamily::kMlpGemm) {
                    d += slow_mlp;
                    if (dp == 0) slower += slow_mlp;
                  }
                  r.op_timeline.push_back(
                      {pp, dp, TimedOp{op.id, op.role, a.chunk, a.microbatch, t, t + d}});
                  t += d;
                }
            };
            const bool first = pp == 0 && a.chunk == 0;
            const bool last = pp == p.pipeline_parallel - 1 && a.chunk == p.virtual_stages - 1;
            if (fwd) {
              if (first) run_ops(embed.forward, 1);
              run_ops(layer.forward, layers);
              if (last) run_ops(head.forward, 1);
            } else {
              if (last) run_ops(head.backward, 1);
              run_ops(layer.recompute, layers);
              run_ops(layer.backward, layers);
              if (first) run_ops(embed.backward, 1);
            }
          } else if (is_p2p(a.kind)) {
            // One batched call: every action of it spans the call.
            size_t j = i;
            while (list[j].batched_with_next) ++j;
            t += p2p * scale;
            for (size_t k = i; k <= j; ++k)
              r.timeline.push_back(
                  {pp, dp, list[k].kind, list[k].microbatch, list[k].chunk, start, t});
            i = j;
            continue;
          } else if (a.kind == ActionKind::kGradSync) {
            t += ps.families.family(OpFamily::kDataParallel) * scale;
          } else if (a.kind == ActionKind::kOptimizerStep) {
            const double wait =
                pp == 0 && s < static_cast<int>(norm_wait.size()) ? norm_wait[s] : 0;
            if (pp == 0 && s < static_cast<int>(norm_wait.size())) {
              r.norm_reductions.push_back({pp, dp, t, t + wait});
              if (dp == 0) slower += wait;
            }
            t += ps.families.family(OpFamily::kOptimizer) * scale + wait;
          }
          r.timeline.push_back({pp, dp, a.kind, a.microbatch, a.chunk, start, t});
        }
      }
    }
    st.seconds += slower;
    r.steps.push_back(st);
    step_start += st.seconds;
  }
  r.peak_memory_bytes = 123456789;
  r.peak_rss_bytes = 987654321;
  return r;
}

RunTraceInfo info_of(const ModelSpec& m, const ParallelPlan& p, int steps) {
  RunTraceInfo info;
  info.model = m;
  info.plan = p;
  info.cluster = "dgx-a100-80gb";
  info.world_size = p.num_gpus();
  info.steps = steps;
  return info;
}

TEST(RunTrace, RoundTripKeepsSpansAndMetadata) {
  const ModelSpec m = tiny_model();
  const ParallelPlan p = plan_of(2, 2, 1);
  const TrainResult r = predicted_run(cost_for(m, p), p, 3, 2.0);
  const std::string text = run_trace_text(r, info_of(m, p, 3), "round trip");
  const RunTrace t = parse_run_trace(text, "test");
  EXPECT_EQ(t.info.model.num_layers, 4);
  EXPECT_EQ(to_json(t.info.plan), to_json(p));
  EXPECT_EQ(t.info.cluster, "dgx-a100-80gb");
  EXPECT_EQ(t.info.world_size, 4);
  EXPECT_EQ(t.info.backend, "cpu");
  EXPECT_EQ(t.info.steps, 3);
  EXPECT_EQ(t.info.peak_memory_bytes, 123456789);
  EXPECT_EQ(t.info.peak_rss_bytes, 987654321);
  ASSERT_EQ(t.actions.size(), r.timeline.size());
  for (size_t i = 0; i < t.actions.size(); ++i) {
    const TraceAction& a = t.actions[i];
    const TimelineEvent& e = r.timeline[i];
    EXPECT_EQ(a.kind, e.kind) << i;
    EXPECT_EQ(a.stage, e.pp) << i;
    EXPECT_EQ(a.replica, e.dp) << i;
    EXPECT_EQ(a.microbatch, e.microbatch) << i;
    EXPECT_EQ(a.chunk, e.chunk) << i;
    EXPECT_NEAR(a.start, e.start, 1e-11) << i;
    EXPECT_NEAR(a.end, e.end, 1e-11) << i;
  }
  ASSERT_EQ(t.ops.size(), r.op_timeline.size());
  for (size_t i = 0; i < t.ops.size(); ++i) {
    const TraceOp& o = t.ops[i];
    const OpTimelineEvent& e = r.op_timeline[i];
    EXPECT_EQ(o.id, e.op.id) << i;
    EXPECT_EQ(o.role, e.op.role) << i;
    EXPECT_EQ(o.stage, e.pp) << i;
    EXPECT_EQ(o.replica, e.dp) << i;
    EXPECT_EQ(o.microbatch, e.op.microbatch) << i;
    EXPECT_EQ(o.chunk, e.op.chunk) << i;
    EXPECT_NEAR(o.end - o.start, e.op.end - e.op.start, 1e-11) << i;
  }
  ASSERT_EQ(t.steps.size(), 3u);
  EXPECT_TRUE(t.steps[0].warmup);
  EXPECT_FALSE(t.steps[1].warmup);
  EXPECT_NEAR(t.steps[2].end - t.steps[2].start, r.steps[2].seconds, 1e-11);
  // Still a Chrome trace: every event has ph, pid and (for spans) ts and dur.
  const auto j = nlohmann::json::parse(text);
  for (const auto& e : j["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid"));
    if (e["ph"] == "X") {
      EXPECT_TRUE(e.contains("ts") && e.contains("dur") && e.contains("tid"));
    }
  }
}

class PredictedTrace : public testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(PredictedTrace, ReconcilesWithZeroError) {
  const auto [pp, dp, v] = GetParam();
  const ModelSpec m = tiny_model();
  const ParallelPlan p = plan_of(pp, dp, v);
  const CostModel cost = cost_for(m, p);
  const TrainResult r = predicted_run(cost, p, 4, 3.0);
  const RunTrace t = parse_run_trace(run_trace_text(r, info_of(m, p, 4), "predicted"), "test");
  const Reconciliation rec = reconcile(t, cost, "test");
  EXPECT_EQ(rec.measured_steps, 3);
  EXPECT_EQ(rec.warmup_steps, 1);
  const double tol = 1e-6 * rec.iteration.predicted;
  EXPECT_GT(rec.iteration.predicted, 0);
  EXPECT_NEAR(rec.iteration.error(), 0, tol);
  ASSERT_EQ(rec.stages.size(), static_cast<size_t>(pp));
  for (const StageReconciliation& s : rec.stages) {
    EXPECT_NEAR(s.busy.error(), 0, tol) << "stage " << s.stage;
    double sum_p = 0, sum_m = 0;
    for (const ReconcileRow& row : s.rows) {
      EXPECT_NEAR(row.time.error(), 0, tol) << "stage " << s.stage << " " << row.name;
      for (const Compared& c : row.roles) EXPECT_NEAR(c.error(), 0, tol) << row.name;
      sum_p += row.time.predicted;
      sum_m += row.time.measured;
    }
    // The rows are a partition of the iteration on both sides.
    EXPECT_NEAR(sum_p, rec.iteration.predicted, tol);
    EXPECT_NEAR(sum_m, rec.iteration.measured, tol);
    EXPECT_GT(s.rows.front().time.predicted, 0);  // attention GEMMs cost something
  }
  EXPECT_NEAR(rec.largest_error, 0, tol);
  EXPECT_EQ(rec.peak_memory.measured, 123456789);
  EXPECT_GT(rec.peak_memory.predicted, 0);
}

INSTANTIATE_TEST_SUITE_P(Layouts, PredictedTrace,
                         testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(2, 2, 1),
                                         std::make_tuple(2, 1, 2)));

TEST(Reconcile, NamesTheFamilyThatWasSlower) {
  const ModelSpec m = tiny_model();
  const ParallelPlan p = plan_of(2, 1, 1);
  const CostModel cost = cost_for(m, p);
  // Stage 1's MLP GEMMs take 0.1 ms longer each: the iteration gets as much longer.
  const TrainResult r = predicted_run(cost, p, 3, 1.0, 1e-4);
  const RunTrace t = parse_run_trace(run_trace_text(r, info_of(m, p, 3), "slow"), "test");
  const Reconciliation rec = reconcile(t, cost, "test");
  EXPECT_EQ(rec.largest_stage, 1);
  EXPECT_EQ(rec.largest_row, "mlp_gemm");
  EXPECT_GT(rec.largest_error, 0);
  EXPECT_EQ(rec.critical_stage, 1);
  // All of the iteration's error is the MLP GEMMs': each of the last stage's, every microbatch.
  const PassOps layer = transformer_layer_ops(m, layer_shape(p));
  int64_t gemms = 0;
  for (const auto* list : {&layer.forward, &layer.backward, &layer.recompute})
    for (const Op& op : *list) gemms += op_family(op.id) == OpFamily::kMlpGemm;
  ASSERT_GT(gemms, 0);
  gemms *= p.layers_on_stage(m, 1) * p.num_microbatches();
  EXPECT_NEAR(rec.largest_error, static_cast<double>(gemms) * 1e-4, 1e-9);
  EXPECT_NEAR(rec.iteration.error(), static_cast<double>(gemms) * 1e-4, 1e-9);
  EXPECT_NEAR(rec.largest_share, 1.0, 1e-6);
}

// What --overlap-grad-reduce and --overlap-param-gather hide comes off each stage's
// data-parallel row, not off its bubble: every stage's rows still add up to the iteration with a
// bubble that is not negative, and the first stage (p = 1: no bubble at all) exposes less.
TEST(Reconcile, OverlappedGradientSyncShrinksTheDataParallelRowNotTheBubble) {
  const ModelSpec m = tiny_model();
  for (int64_t p : {1, 2}) {
    ParallelPlan plain = plan_of(p, 4, 1);
    plain.distributed_optimizer = true;
    ParallelPlan overlapped = plain;
    overlapped.overlap_grad_reduce = true;
    overlapped.overlap_param_gather = true;
    double dp_row[2] = {0, 0};
    for (const ParallelPlan* plan : {&plain, &overlapped}) {
      const PredictedBreakdown pred = predict_breakdown(cost_for(m, *plan), *plan);
      ASSERT_EQ(pred.stages.size(), static_cast<size_t>(p));
      for (const StagePrediction& st : pred.stages) {
        EXPECT_GE(st.bubble, -1e-9 * pred.iteration) << "p=" << p << " stage " << st.stage;
        EXPECT_NEAR(st.families.total() + st.bubble, pred.iteration, 1e-9 * pred.iteration);
      }
      if (p == 1) {
        EXPECT_EQ(pred.stages[0].bubble, 0.0);
      }
      dp_row[plan == &overlapped] =
          pred.stages[0].families.at(OpFamily::kDataParallel, OpRole::kForward);
    }
    EXPECT_GT(dp_row[0], 0.0);
    EXPECT_LT(dp_row[1], dp_row[0]) << "p=" << p;
  }
}

// Megatron-FSDP's per-microbatch collectives are data-parallel time, not bubble: at p = 1 the
// stage has no bubble, and its data-parallel row is what predict's breakdown says.
TEST(Reconcile, MegatronFsdpCollectivesFillTheDataParallelRow) {
  const ModelSpec m = tiny_model();
  for (FsdpSharding s : {FsdpSharding::kOptimGrads, FsdpSharding::kOptimGradsParams}) {
    ParallelPlan plan = plan_of(1, 4, 1);
    plan.distributed_optimizer = true;
    plan.fsdp = s;
    plan.validate(m);
    const CostModel cost = cost_for(m, plan);
    const PredictedBreakdown pred = predict_breakdown(cost, plan);
    ASSERT_EQ(pred.stages.size(), 1u);
    EXPECT_EQ(pred.stages[0].bubble, 0.0) << to_string(s);
    EXPECT_NEAR(pred.stages[0].families.at(OpFamily::kDataParallel, OpRole::kForward),
                cost.predict(plan).breakdown.dp_comm, 1e-12)
        << to_string(s);
  }
}

TEST(Reconcile, WaitingInTheNormAllReduceIsIdleTime) {
  const ModelSpec m = tiny_model();
  const ParallelPlan p = plan_of(2, 1, 1);
  const CostModel cost = cost_for(m, p);
  // Stage 0 waits 1 ms, then 3 ms in the norm all-reduce of the two measured steps: 1 ms is
  // counted as the all-reduce's cost (its shortest call), the other 1 ms on average is idle.
  const TrainResult r = predicted_run(cost, p, 3, 1.0, 0, {5e-3, 1e-3, 3e-3});
  const RunTrace t = parse_run_trace(run_trace_text(r, info_of(m, p, 3), "wait"), "test");
  ASSERT_EQ(t.norm_reductions.size(), 3u);
  const Reconciliation rec = reconcile(t, cost, "test");
  EXPECT_NEAR(rec.iteration.error(), 2e-3, 1e-9);
  auto row = [&](int64_t stage, const std::string& name) {
    for (const ReconcileRow& x : rec.stages[static_cast<size_t>(stage)].rows)
      if (x.name == name) return x.time.error();
    ADD_FAILURE() << name;
    return 0.0;
  };
  EXPECT_NEAR(row(0, "optimizer"), 1e-3, 1e-9);
  EXPECT_NEAR(row(0, "bubble"), 1e-3, 1e-9);
  EXPECT_NEAR(row(1, "bubble"), 2e-3, 1e-9);  // the last stage waited for the first
  EXPECT_NEAR(row(1, "optimizer"), 0, 1e-9);
}

using Result = test::CliResult;
constexpr auto cli = &test::run_ptdp;

std::string temp_file(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("ptdp_reconcile_test_" + std::to_string(::getpid()) + "_" + name);
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

std::string good_trace_text(int steps = 3) {
  const ModelSpec m = tiny_model();
  const ParallelPlan p = plan_of(2, 1, 1);
  return run_trace_text(predicted_run(cost_for(m, p), p, steps, 1.0), info_of(m, p, steps), "t");
}

TEST(ReconcileCli, TableAndJson) {
  const std::string path = temp_file("good.json", good_trace_text());
  const Result table = cli({"reconcile", "--trace", path});
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_NE(table.out.find("iteration"), std::string::npos);
  EXPECT_NE(table.out.find("stage 1 busy"), std::string::npos);
  EXPECT_NE(table.out.find("largest contributor"), std::string::npos);
  const Result json = cli({"reconcile", "--trace", path, "--json"});
  ASSERT_EQ(json.status, 0) << json.err;
  const auto j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["cluster"], "dgx-a100-80gb");
  EXPECT_EQ(j["measured_steps"], 2);
  EXPECT_EQ(j["stages"].size(), 2u);
  EXPECT_TRUE(j["largest_contributor"].contains("share_of_iteration_error"));
  std::filesystem::remove(path);
}

// A preset profile prices 16-bit training unless told; a trace records the precision the run
// trained in, and reconcile prices that one: an fp32 run's 4-byte weights, activations and
// Adam states (no master copy), a bf16 run's bf16 ones.
TEST(ReconcileCli, PricesThePrecisionTheRunTrainedIn) {
  const ModelSpec m = tiny_model();
  const ParallelPlan p = plan_of(2, 1, 1);
  ClusterSpec c = resolve_cluster("dgx-a100-80gb");
  c.resize(p.num_gpus());
  for (DType precision : {DType::kF32, DType::kBF16}) {
    RunTraceInfo info = info_of(m, p, 3);
    info.precision = precision;
    const std::string path = temp_file(
        "precision.json", run_trace_text(predicted_run(cost_for(m, p), p, 3, 1.0), info, "t"));
    const Result r = cli({"reconcile", "--trace", path, "--json"});
    std::filesystem::remove(path);
    ASSERT_EQ(r.status, 0) << r.err;
    HardwareProfile profile = default_profile_for(c);
    profile.activation_dtype = precision;
    const double want = CostModel(m, c, profile).memory(p).peak;
    SCOPED_TRACE(to_string(precision));
    EXPECT_DOUBLE_EQ(nlohmann::json::parse(r.out)["peak_memory"]["predicted_bytes"].get<double>(),
                     want);
  }
  // The two differ: the check above cannot pass by pricing one precision for both.
  HardwareProfile fp32 = default_profile_for(c), bf16 = fp32;
  fp32.activation_dtype = DType::kF32;
  bf16.activation_dtype = DType::kBF16;
  EXPECT_GT(CostModel(m, c, fp32).memory(p).peak, 1.2 * CostModel(m, c, bf16).memory(p).peak);
}

// Exit status 2 and one line on stderr that contains `needle`.
void expect_refused(const std::vector<std::string>& args, const std::string& needle) {
  const Result r = cli(args);
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << r.err;
  EXPECT_TRUE(r.out.empty());
}

TEST(ReconcileCli, BadInputs) {
  // One measured step after the warm-up: each call below reads the whole trace, which under the
  // sanitizers (and this file at -O0 there) is most of the test's time.
  const std::string good = good_trace_text(2);
  const nlohmann::json good_json = nlohmann::json::parse(good);
  auto edited = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& name) {
    nlohmann::json j = good_json;
    edit(j);
    return temp_file(name, j.dump());
  };
  expect_refused({"reconcile", "--trace", temp_file("notjson.json", "{\"otherData\": [")},
                 "not JSON");
  expect_refused({"reconcile", "--trace", "/nonexistent/run.json"}, "--trace");
  expect_refused({"reconcile", "--trace",
                  edited([](nlohmann::json& j) { j["otherData"].erase("model"); }, "nomodel.json")},
                 "otherData.model");
  expect_refused({"reconcile", "--trace",
                  edited([](nlohmann::json& j) { j["otherData"].erase("format"); }, "sim.json")},
                 "otherData.format");
  expect_refused({"reconcile", "--trace",
                  edited(
                      [](nlohmann::json& j) {
                        for (auto& e : j["traceEvents"])
                          if (e["ph"] == "X" && e["cat"] == "op") e["args"]["stage"] = 7;
                      },
                      "stage.json")},
                 "args.stage");
  expect_refused({"reconcile", "--trace",
                  edited(
                      [](nlohmann::json& j) {
                        for (auto& e : j["traceEvents"])
                          if (e["ph"] == "X" && e["cat"] == "op") e["name"] = "warp_drive";
                      },
                      "op.json")},
                 "not an op of ptdp");
  expect_refused(
      {"reconcile", "--trace",
       edited([](nlohmann::json& j) { j["otherData"]["cluster"] = nullptr; }, "nocluster.json")},
      "--cluster");
  const std::string good_path = temp_file("good2.json", good);
  expect_refused({"reconcile", "--trace", good_path, "--cluster", "no-such-cluster"}, "--cluster");
  expect_refused({"reconcile", "--trace", temp_file("warmup.json", good_trace_text(1))},
                 "no measured step");
  expect_refused({"reconcile"}, "--trace");
  // A trace missing a rank of its plan (here every event of stage 1).
  expect_refused(
      {"reconcile", "--trace",
       edited(
           [](nlohmann::json& j) {
             nlohmann::json kept = nlohmann::json::array();
             for (auto& e : j["traceEvents"])
               if (!e.contains("args") || !e["args"].contains("stage") || e["args"]["stage"] != 1)
                 kept.push_back(e);
             j["traceEvents"] = kept;
           },
           "nostage1.json")},
      "no action of replica 0 stage 1");
  // Events that cannot be this run's measurement, and metadata its events contradict.
  auto each_x = [&](const std::function<void(nlohmann::json&)>& f) {
    return [f](nlohmann::json& j) {
      for (auto& e : j["traceEvents"])
        if (e["ph"] == "X") f(e);
    };
  };
  expect_refused({"reconcile", "--trace",
                  edited(each_x([](nlohmann::json& e) {
                           if (e["cat"] == "step") e["dur"] = 1e308;
                         }),
                         "inf.json")},
                 "1e13 us");
  expect_refused({"reconcile", "--trace",
                  edited(each_x([](nlohmann::json& e) {
                           if (e["cat"] == "step") e["dur"] = 0;
                         }),
                         "zero.json")},
                 "a step takes time");
  expect_refused({"reconcile", "--trace",
                  edited(each_x([](nlohmann::json& e) {
                           if (e["cat"] == "op") e["dur"] = 1e9;
                         }),
                         "longop.json")},
                 "outside the steps");
  expect_refused(
      {"reconcile", "--trace",
       edited([](nlohmann::json& j) { j["otherData"]["measured"]["peak_memory_bytes"] = 1e308; },
              "peak.json")},
      "otherData.measured");
  expect_refused({"reconcile", "--trace",
                  edited(
                      [](nlohmann::json& j) {
                        nlohmann::json kept = nlohmann::json::array();
                        for (auto& e : j["traceEvents"])
                          if (e.value("cat", "") != "op") kept.push_back(e);
                        j["traceEvents"] = kept;
                      },
                      "noops.json")},
                 "layer forward passes");
  expect_refused({"reconcile", "--trace",
                  edited(
                      [](nlohmann::json& j) {
                        j["otherData"]["model"]["num_layers"] =
                            2 * j["otherData"]["model"]["num_layers"].get<int>();
                      },
                      "layers.json")},
                 "layer forward passes");
  expect_refused({"reconcile", "--trace",
                  edited(
                      [](nlohmann::json& j) {
                        auto& c = j["otherData"]["configuration"];
                        c["micro_batch_size"] = c["micro_batch_size"].get<int>() / 2;
                      },
                      "microbatch.json")},
                 "layer forward passes");
  // A missing model is named once; a cluster that the trace names and that cannot be found is
  // the trace's, since no --cluster was given.
  {
    const Result r =
        cli({"reconcile", "--trace",
             edited([](nlohmann::json& j) { j["otherData"].erase("model"); }, "m.json")});
    EXPECT_EQ(r.err.find("otherData.model", r.err.find("otherData.model") + 1), std::string::npos)
        << r.err;
  }
  expect_refused(
      {"reconcile", "--trace",
       edited([](nlohmann::json& j) { j["otherData"]["cluster"] = "/nonexistent/machine.json"; },
              "lostcluster.json")},
      "otherData.cluster");
  // ptdp run checks the cluster it records at once.
  expect_refused({"run", "--global-batch-size", "1", "--trace", temp_file("unused.json", ""),
                  "--cluster", "no-such-cluster"},
                 "--cluster");
  expect_refused({"run", "--global-batch-size", "1", "--cluster", "dgx-a100-80gb"}, "--trace");
}

// An MoE run's trace carries the expert load it measured (the busiest expert-parallel rank's
// routed rows over the mean); reconcile sets it against the load the cost model prices, as a
// row of the table and in --json. A load outside [1, ep], or one given for a dense model, is
// refused naming the field.
TEST(ReconcileCli, MoeRunsShowTheMeasuredExpertLoad) {
  ModelSpec m = tiny_model();
  m.num_experts = 4;
  m.moe_router_topk = 2;
  ParallelPlan p = plan_of(1, 2, 1);
  p.expert_parallel = 2;
  TrainResult r = predicted_run(cost_for(m, p), p, 2, 1.0);  // one measured step
  r.expert_load = 1.37;
  const std::string text = run_trace_text(r, info_of(m, p, 2), "moe");
  EXPECT_DOUBLE_EQ(parse_run_trace(text, "test").info.expert_load, 1.37);
  const std::string path = temp_file("moe.json", text);
  const Result table = cli({"reconcile", "--trace", path});
  ASSERT_EQ(table.status, 0) << table.err;
  const size_t row = table.out.find("expert load (busiest / mean)");
  ASSERT_NE(row, std::string::npos) << table.out;
  const std::string line = table.out.substr(row, table.out.find('\n', row) - row);
  EXPECT_NE(line.find("1.100"), std::string::npos) << line;
  EXPECT_NE(line.find("1.370"), std::string::npos) << line;
  EXPECT_NE(line.find("+24.5%"), std::string::npos) << line;
  const Result json = cli({"reconcile", "--trace", path, "--json"});
  ASSERT_EQ(json.status, 0) << json.err;
  const auto j = nlohmann::json::parse(json.out);
  EXPECT_DOUBLE_EQ(j["expert_load"]["measured_load"].get<double>(), 1.37);
  EXPECT_DOUBLE_EQ(j["expert_load"]["predicted_load"].get<double>(), kDroplessExpertLoad);
  // A dense run has no load to compare (the table and --json leave it out).
  const ModelSpec dense = tiny_model();
  const ParallelPlan dp = plan_of(2, 1, 1);
  const Reconciliation plain =
      reconcile(parse_run_trace(good_trace_text(2), "dense"), cost_for(dense, dp), "dense");
  EXPECT_EQ(plain.expert_load.predicted, 0.0);
  EXPECT_EQ(plain.expert_load.measured, 0.0);
  // Refused when read (as the CLI refuses it: exit 2 naming the field): a load outside
  // [1, ep], or one given for a dense model.
  auto refused = [&](const std::string& trace, double load) {
    nlohmann::json x = nlohmann::json::parse(trace);
    x["otherData"]["measured"]["expert_load"] = load;
    try {
      parse_run_trace(x.dump(), "--trace t.json");
    } catch (const InputError& e) {
      return std::string(e.what()).find("otherData.measured.expert_load") != std::string::npos;
    }
    return false;
  };
  EXPECT_TRUE(refused(text, 2.5));  // above ep = 2
  EXPECT_TRUE(refused(text, 0.9));
  EXPECT_TRUE(refused(good_trace_text(2), 1.2));
  EXPECT_FALSE(refused(text, 1.9));
  std::filesystem::remove(path);
}

// A machine file (ptdp calibrate) sets a run against what it measured only: the trace's plan
// communicates over groups of 2 (p=2's send/recv pairs), which a one-rank calibration never
// timed; a calibration of another backend measured other kernels.
TEST(ReconcileCli, RefusesAMachineFileThatDidNotMeasureTheRun) {
  const std::string trace = temp_file("machine_match.json", good_trace_text());
  const ClusterSpec c = resolve_cluster("dgx-a100-80gb");
  auto machine = [&](const std::string& backend, int64_t ranks, bool pairs) {
    HardwareProfile prof = default_profile_for(c);
    prof.collectives.clear();
    if (pairs) prof.collectives.push_back({Collective::kSendRecv, 2, 1, 5.0, 10.0});
    const nlohmann::json j = {{"format", "ptdp-machine"},
                              {"cluster", to_json(c)},
                              {"profile", to_json(prof)},
                              {"machine", {{"backend", backend}, {"ranks", ranks}}}};
    return temp_file("machine_" + backend + std::to_string(ranks) + ".json", j.dump());
  };
  const std::string one_rank = machine("cpu", 1, false);
  expect_refused({"reconcile", "--trace", trace, "--cluster", one_rank},
                 "--cluster " + one_rank + ": collectives over 2 ranks were not measured");
  expect_refused({"reconcile", "--trace", trace, "--cluster", machine("cuda", 2, true)},
                 "measured the cuda backend, but the trace ran the cpu backend");
  const Result ok = cli({"reconcile", "--trace", trace, "--cluster", machine("cpu", 2, true)});
  EXPECT_EQ(ok.status, 0) << ok.err;
}

}  // namespace
}  // namespace ptdp
