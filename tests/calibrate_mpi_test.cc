// `mpirun -np 2 ptdp calibrate --quick` on a tiny model, as a user runs it, then `ptdp predict
// --cluster` with the machine file it wrote: the file describes the two ranks measured, every
// fit reports its residuals, and the prediction prices with the measurements.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "tests/support/launch.h"

namespace ptdp {
namespace {

namespace fs = std::filesystem;
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

}  // namespace
}  // namespace ptdp
