// `mpirun -np 2 ptdp calibrate --quick` on a tiny model, as a user runs it, then `ptdp predict
// --cluster` with the machine file it wrote: the file describes the two ranks measured, every
// fit reports its residuals, and the prediction prices with the measurements.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "tests/support/launch.h"

namespace ptdp {
namespace {

namespace fs = std::filesystem;

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif
using nlohmann::json;

const std::string kModel =
    " --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 128";

TEST(CalibrateMpi, QuickCalibrationOnTwoRanksThenPredictWithIt) {
  const fs::path dir = test::scratch_dir("ptdp_calibrate_mpi_test");
  const std::string file = (dir / "machine.json").string();
  fs::remove(file);
  const test::Outcome c =
      test::launch(PTDP_MPIEXEC, PTDP_BINARY, 2,
                   "calibrate --backend cpu --quick --time-limit-s 10" + kModel + " --out " + file,
                   "ptdp_calibrate_mpi_test");
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_NE(c.out.find("residuals"), std::string::npos) << c.out;
  EXPECT_EQ(c.err.find('\r'), std::string::npos) << "a progress bar without a terminal";
  // Progress through the launcher: rank 0's lines, one a tenth at most, in order.
  const size_t tenth = c.err.find("ptdp calibrate: 10% ("),
               half = c.err.find("ptdp calibrate: 50% (");
  ASSERT_NE(half, std::string::npos) << c.err;
  EXPECT_LT(tenth, half) << c.err;
  EXPECT_LE(std::count(c.err.begin(), c.err.end(), '\n'), 10) << c.err;
  ASSERT_TRUE(fs::exists(file));
  const json m = json::parse(test::read_file(file));
  EXPECT_EQ(m["format"], "ptdp-machine");
  EXPECT_EQ(m["machine"]["ranks"], 2);
  EXPECT_EQ(m["machine"]["backend"], "cpu");
  EXPECT_NE(m["machine"]["command"].get<std::string>().find("calibrate"), std::string::npos);
  for (const char* key : {"device", "eigen", "mpi", "date"})
    EXPECT_FALSE(m["machine"][key].get<std::string>().empty()) << key;
  EXPECT_EQ(m["cluster"]["gpus_per_node"].get<int64_t>() * m["cluster"]["num_nodes"].get<int64_t>(),
            2);
  EXPECT_GT(m["cluster"]["gpu"]["peak_tflops_16bit"].get<double>(), 0);
  // The op-list shapes of t = 1 and 2 were measured; every collective has its fit over 2 ranks.
  EXPECT_FALSE(m["profile"]["gemm"]["table"].empty());
  std::set<int64_t> ts;
  for (const json& op : m["measurements"]["ops"]) ts.insert(op["t"].get<int64_t>());
  EXPECT_EQ(ts, (std::set<int64_t>{1, 2}));
  std::set<std::string> kinds;
  for (const json& f : m["fits"]["collectives"]) {
    kinds.insert(f["collective"].get<std::string>());
    EXPECT_EQ(f["ranks"], 2);
    EXPECT_GT(f["residuals"]["points"].get<int64_t>(), 1);
    EXPECT_GT(f["busbw_gbps"].get<double>(), 0);
  }
  EXPECT_EQ(kinds,
            (std::set<std::string>{"all_gather", "all_reduce", "reduce_scatter", "send_recv"}));
  EXPECT_TRUE(m["fits"]["gemm"].contains("residuals"));
  EXPECT_TRUE(m["fits"]["memory"]["all"].contains("rms_relative"));
  // Every memory-bound op measured is in the profile's table at its bytes (the geometric mean of
  // its times there), and nothing else is.
  std::map<std::pair<std::string, double>, std::vector<double>> memory_ops;
  for (const json& op : m["measurements"]["ops"])
    if (op.contains("family") && !op.value("fused", false))
      memory_ops[{op["op"], op["bytes"]}].push_back(op["seconds"]);
  ASSERT_FALSE(memory_ops.empty());
  ASSERT_EQ(m["profile"]["memory_ops"].size(), memory_ops.size());
  for (const json& e : m["profile"]["memory_ops"]) {
    const auto it = memory_ops.find({e["op"], e["size"]});
    ASSERT_NE(it, memory_ops.end()) << e.dump();
    double log_sum = 0;
    for (double t : it->second) log_sum += std::log(t);
    EXPECT_NEAR(e["seconds"].get<double>(),
                std::exp(log_sum / static_cast<double>(it->second.size())),
                1e-9 * e["seconds"].get<double>())
        << e.dump();
  }
  EXPECT_FALSE(m["profile"].contains("host_op_us"));  // ops run as they are issued
  // Where Linux reports the last-level cache, every op was also timed cold, and the profile
  // shares the cache between the node's two ranks.
  if (m["fits"].contains("cache")) {
    const double llc = m["fits"]["cache"]["last_level_cache_bytes"].get<double>();
    EXPECT_GT(llc, 0);
    EXPECT_DOUBLE_EQ(m["profile"]["cache"]["bytes_per_rank"].get<double>(), llc / 2);
    for (const json& op : m["measurements"]["ops"])
      EXPECT_GT(op.value("cold_seconds", 0.0), 0) << op.dump();
    int cold = 0;
    for (const json& e : m["profile"]["gemm"]["table"]) cold += e.contains("cold_factor");
    EXPECT_GT(cold, 0);
    // The cache's hits: the largest GEMM after each stream of 0.5 to 2 caches a rank, its
    // hits in [0, 1]; the profile's curve (where cold was measurably slower than warm) is them.
    const json& hits = m["measurements"]["cache_hits"];
    ASSERT_EQ(hits["streams"].size(), 4u);
    EXPECT_GE(hits["cold_seconds"].get<double>(), hits["warm_seconds"].get<double>());
    for (size_t i = 0; i < 4; ++i) {
      const json& s = hits["streams"][i];
      EXPECT_DOUBLE_EQ(s["bytes"].get<double>(), (0.5 + 0.5 * static_cast<double>(i)) * llc / 2);
      EXPECT_GE(s["hit"].get<double>(), 0.0);
      EXPECT_LE(s["hit"].get<double>(), 1.0);
      // The profile's curve is the measurement, wherever cold was measurably slower than warm.
      if (hits["cold_seconds"].get<double>() > 1.02 * hits["warm_seconds"].get<double>()) {
        ASSERT_TRUE(m["profile"]["cache"].contains("hit_curve"));
        EXPECT_EQ(m["profile"]["cache"]["hit_curve"][i]["hit"], s["hit"]);
        EXPECT_EQ(m["profile"]["cache"]["hit_curve"][i]["bytes"], s["bytes"]);
      }
    }
  } else {
    EXPECT_FALSE(m["profile"].contains("cache"));
  }
  // Busbw of every measured collective is its algbw times the ring factor (nccl-tests).
  for (const json& s : m["measurements"]["collectives"]) {
    const double f = s["collective"] == "all_reduce"  ? 1.0
                     : s["collective"] == "send_recv" ? 1.0
                                                      : 0.5;
    EXPECT_NEAR(s["busbw_gbps"].get<double>(), f * s["algbw_gbps"].get<double>(),
                1e-9 * s["algbw_gbps"].get<double>());
  }

  // Predict with the file for both layouts of the two ranks: priced with fp32 activations and
  // the measured collectives, and the iteration is positive and finite.
  for (const std::string layout :
       {" --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2",
        " --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1"}) {
    const test::Outcome p = test::launch(PTDP_MPIEXEC, PTDP_BINARY, 0,
                                         "predict" + kModel + " --cluster " + file +
                                             " --num-gpus 2 --micro-batch-size 1" +
                                             " --global-batch-size 4 --json" + layout,
                                         "ptdp_calibrate_mpi_test");
    ASSERT_EQ(p.status, 0) << p.err;
    const json j = json::parse(p.out);
    const double it = j["iteration_time_s"].get<double>();
    EXPECT_GT(it, 0);
    EXPECT_LT(it, 60);
    if (layout.find("tensor-model-parallel-size 2") != std::string::npos)
      EXPECT_GT(j["breakdown"]["tp_comm_s"].get<double>(), 0);
    else
      EXPECT_GT(j["breakdown"]["pp_comm_s"].get<double>(), 0);
  }
  fs::remove_all(dir);
}

// The device paths of calibrate (operands uploaded to the backend's memory, each op's host
// issue timed apart from its run, collectives on the host-staged data plane of
// runtime/data_plane.h) on the CPU backend acting as a device: what calibrate --backend cuda
// runs, minus the GPU (whose L2 a device kernel evicts; here the host's caches are the ones).
TEST(CalibrateMpi, DeviceMemoryPathsCalibrateOnTheStagedCpuBackend) {
  const fs::path dir = test::scratch_dir("ptdp_calibrate_mpi_staged");
  const std::string file = (dir / "machine.json").string();
  fs::remove(file);
  const test::Outcome c =
      test::launch(PTDP_MPIEXEC, PTDP_BINARY, 2,
                   "calibrate --backend cpu-staged --quick --time-limit-s 8 --use-flash-attn" +
                       kModel + " --out " + file,
                   "ptdp_calibrate_mpi_staged");
  ASSERT_EQ(c.status, 0) << c.err;
  const json m = json::parse(test::read_file(file));
  EXPECT_EQ(m["machine"]["backend"], "cpu-staged");
  EXPECT_FALSE(m["profile"]["gemm"]["table"].empty());
  for (const json& op : m["measurements"]["ops"]) {
    EXPECT_GT(op["seconds"].get<double>(), 0) << op.dump();
    // Cold too, but for the fused attention's further sequences (priced as measured, warm).
    if (m["fits"].contains("cache") && !op.value("fused", false)) {
      EXPECT_GT(op.value("cold_seconds", 0.0), 0) << op.dump();
    }
  }
  // Its kernels "run asynchronously" (a device backend): the host's issue time of each op was
  // measured too; the plain CPU backend's are not (above).
  ASSERT_TRUE(m["profile"].contains("host_op_us"));
  EXPECT_TRUE(m["profile"]["host_op_us"].contains("qkv"));
  for (const auto& [name, us] : m["profile"]["host_op_us"].items())
    EXPECT_GT(us.get<double>(), 0) << name;
  // The fused attention at half and twice the model's sequence of 32 as well.
  std::set<double> rows;
  for (const json& f : m["profile"]["fused_ops"])
    if (f["op"] == "attn_scores") rows.insert(f["rows"].get<double>());
  EXPECT_EQ(rows, (std::set<double>{16, 32, 64}));
  std::set<std::string> kinds;
  for (const json& f : m["fits"]["collectives"]) {
    kinds.insert(f["collective"].get<std::string>());
    EXPECT_GT(f["busbw_gbps"].get<double>(), 0);
  }
  EXPECT_EQ(kinds,
            (std::set<std::string>{"all_gather", "all_reduce", "reduce_scatter", "send_recv"}));
  fs::remove_all(dir);
}

// Collectives over more ranks than the calibration has (or over one) are refused before any
// measurement: exit status 2 on every rank, one line naming --group-sizes, no file.
TEST(CalibrateMpi, GroupsTheRanksCannotFormAreRefused) {
  const fs::path dir = test::scratch_dir("ptdp_calibrate_mpi_test");
  const std::string file = (dir / "refused.json").string();
  for (const auto& [np, sizes, needle] :
       {std::tuple<int, std::string, std::string>{2, "2,4", "a group of 4 ranks needs 4 ranks"},
        {2, "1", "a collective's group has at least 2 ranks"},
        {0, "2", "a group of 2 ranks needs 2 ranks, but this calibration has 1"}}) {
    fs::remove(file);
    const test::Outcome c =
        test::launch(PTDP_MPIEXEC, PTDP_BINARY, np,
                     "calibrate --quick" + kModel + " --group-sizes " + sizes + " --out " + file,
                     "ptdp_calibrate_mpi_test");
    EXPECT_EQ(c.status, 2) << sizes << ": " << c.err;
    const size_t at = c.err.find("ptdp: --group-sizes: " + needle);
    EXPECT_NE(at, std::string::npos) << c.err;
    // Said once (by rank 0); mpirun adds its own lines about the status.
    if (at != std::string::npos) {
      EXPECT_EQ(c.err.find("ptdp:", at + 1), std::string::npos) << c.err;
    }
    EXPECT_TRUE(c.out.empty()) << c.out;
    EXPECT_FALSE(fs::exists(file)) << sizes;
  }
}

// One attempt of the loop: the iteration-time error of each layout (reconcile's).
// `precision`: "" (fp32) or " --bf16", given to calibrate, predict and run alike.
std::vector<double> calibrate_predict_run_reconcile(const fs::path& dir,
                                                    const std::string& precision = "") {
  const std::string machine = (dir / "machine.json").string();
  const std::string model =
      " --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128"
      " --vocab-size 1024";
  const test::Outcome c =
      test::launch(PTDP_MPIEXEC, PTDP_BINARY, 2,
                   "calibrate --backend cpu --quick" + precision + model + " --out " + machine,
                   "ptdp_calibration_loop");
  EXPECT_EQ(c.status, 0) << c.err;
  std::vector<double> errors;
  for (const std::string layout :
       {" --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2",
        " --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1"}) {
    // The job as ptdp run executes it (no dropout, the loss fused), which its trace records:
    // predict is then given what runs.
    const std::string job = model + layout +
                            " --micro-batch-size 1 --global-batch-size 8 --attention-dropout 0"
                            " --hidden-dropout 0 --cross-entropy-loss-fusion" +
                            precision;
    const test::Outcome p =
        test::launch(PTDP_MPIEXEC, PTDP_BINARY, 0,
                     "predict" + job + " --cluster " + machine + " --num-gpus 2 --json",
                     "ptdp_calibration_loop");
    EXPECT_EQ(p.status, 0) << p.err;
    if (p.status != 0) return {};
    const double predicted = json::parse(p.out)["iteration_time_s"].get<double>();
    const std::string trace = (dir / "run.trace.json").string();
    const test::Outcome r = test::launch(
        PTDP_MPIEXEC, PTDP_BINARY, 2,
        "run" + job + " --steps 6 --trace " + trace + " --cluster " + machine + " --json",
        "ptdp_calibration_loop");
    EXPECT_EQ(r.status, 0) << r.err;
    const test::Outcome rec =
        test::launch(PTDP_MPIEXEC, PTDP_BINARY, 0,
                     "reconcile --cluster " + machine + " --trace " + trace + " --json",
                     "ptdp_calibration_loop");
    EXPECT_EQ(rec.status, 0) << rec.err;
    if (r.status != 0 || rec.status != 0) return {};
    const json it = json::parse(rec.out)["iteration"];
    // reconcile predicts what predict predicts, from the trace's own record of the job.
    EXPECT_NEAR(it["predicted_s"].get<double>(), predicted, 1e-9 * predicted);
    errors.push_back(it["relative_error"].get<double>());
    std::printf("[ measured ]%s%s: predicted %.3f s, measured %.3f s, error %+.1f%%\n",
                layout.c_str(), precision.c_str(), predicted, it["measured_s"].get<double>(),
                100 * errors.back());
  }
  return errors;
}

// The loop the product promises, on CPU ranks: calibrate (quick) on 2 ranks, predict a small
// GPT at t=1,p=2 and at t=2,p=1 with the machine file, run each for a few steps with a trace,
// and reconcile. The bar: an iteration-time error under 25% (goal 10%). On this shared
// 2-vCPU machine, with the cache model and the arrival skew clocked inside the all-reduce,
// loops land between -14% and +45% (docs/calibration.md); on a 2-vCPU Intel VM whose speed
// moved by a third within minutes, between -43% and +66%. PTDP_ACCURACY_BOUND sets another
// bound (e.g. 0.10 to see three loops). Run alone (RUN_SERIAL) so that the ranks have the
// cores they had while calibrating; a quick calibration can catch a passing load, so up to
// four loops, calibration included, each printed (8 of 12 loops held 25% here: about one
// test in 80 fails).
TEST(CalibrateMpi, CalibratePredictRunReconcile) {
  // A sanitizer build slows each kernel family by its own factor, and differently while
  // calibrating and while training: its timings are not the product's (the quick calibration
  // test above checks the behaviour there).
  if (kSanitized) GTEST_SKIP() << "timings of a sanitizer build say nothing of the product's";
  const fs::path dir = test::scratch_dir("ptdp_calibration_loop_test");
  const char* bound_env = std::getenv("PTDP_ACCURACY_BOUND");
  const double bound = bound_env ? std::atof(bound_env) : 0.25;
  auto within = [bound](const std::vector<double>& errors) {
    if (errors.size() != 2) return false;
    for (double e : errors)
      if (!(std::abs(e) < bound)) return false;
    return true;
  };
  std::vector<double> errors;
  for (int attempt = 0; attempt < 4 && !within(errors); ++attempt) {
    errors = calibrate_predict_run_reconcile(dir);
    ASSERT_EQ(errors.size(), 2u);
  }
  EXPECT_TRUE(within(errors)) << "bound " << bound << ": t1p2 " << errors[0] << ", t2p1 "
                              << errors[1];
  fs::remove_all(dir);
}

// The same loop in mixed precision (--bf16): a machine file of the kernels on bf16 operands
// (widened to the fp32 kernels on the CPU) prices a --bf16 run, whose trace says bf16; reconcile
// refuses to price it with an fp32 machine file. Up to four loops, as above (docs/calibration.md:
// until the op executor's inputs were spread as activations are, the t = 2 loop came out 25-33%
// over its prediction, the GeLU timed on easy values).
TEST(CalibrateMpi, Bf16CalibratePredictRunReconcile) {
  if (kSanitized) GTEST_SKIP() << "timings of a sanitizer build say nothing of the product's";
  const fs::path dir = test::scratch_dir("ptdp_calibration_loop_bf16_test");
  const char* bound_env = std::getenv("PTDP_ACCURACY_BOUND");
  const double bound = bound_env ? std::atof(bound_env) : 0.25;
  std::vector<double> errors;
  auto within = [&] {
    if (errors.size() != 2) return false;
    for (double e : errors)
      if (!(std::abs(e) < bound)) return false;
    return true;
  };
  for (int attempt = 0; attempt < 4 && !within(); ++attempt) {
    errors = calibrate_predict_run_reconcile(dir, " --bf16");
    ASSERT_EQ(errors.size(), 2u);
  }
  EXPECT_TRUE(within()) << "bound " << bound << ": t1p2 " << errors[0] << ", t2p1 " << errors[1];
  // The bf16 trace against an fp32 machine file: refused, naming the file and what to do.
  const std::string fp32 = (dir / "fp32.json").string();
  ASSERT_EQ(test::launch(PTDP_MPIEXEC, PTDP_BINARY, 0,
                         "calibrate --backend cpu --quick --time-limit-s 5 --num-layers 1"
                         " --hidden-size 64 --num-attention-heads 2 --seq-length 32"
                         " --vocab-size 128 --out " +
                             fp32,
                         "ptdp_calibration_loop")
                .status,
            0);
  const test::Outcome refused =
      test::launch(PTDP_MPIEXEC, PTDP_BINARY, 0,
                   "reconcile --cluster " + fp32 + " --trace " + (dir / "run.trace.json").string(),
                   "ptdp_calibration_loop");
  EXPECT_EQ(refused.status, 2);
  EXPECT_NE(refused.err.find("calibrate with --bf16"), std::string::npos) << refused.err;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace ptdp
