// ptdp calibrate's pieces without timing anything: the GEMM table's interpolation, each fit
// recovering known parameters from synthetic data (with residuals), the machine file's round
// trip and loading through --cluster, and one-line errors for bad machine files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <tuple>
#include <utility>

#include "calibration/fit.h"
#include "calibration/measure.h"
#include "cli/cli.h"
#include "core/cluster_spec.h"
#include "core/error.h"
#include "core/hardware_profile.h"
#include "core/presets.h"
#include "planner/comm_model.h"
#include "planner/cost_model.h"
#include "runtime/backend.h"
#include "runtime/communicator.h"
#include "tests/support/cli_run.h"

namespace ptdp {
namespace {

using nlohmann::json;

void set_curve(GemmEfficiency& g, double max, double mh, double nh, double kh) {
  g.max_efficiency = max;
  g.m_half = mh;
  g.n_half = nh;
  g.k_half = kh;
  g.sm_count = 0;
}

// ---- the measured GEMM table ----

TEST(GemmTable, ExactShapesGetTheirMeasurementAndOthersInterpolate) {
  HardwareProfile h;
  set_curve(h.gemm, 0.8, 64, 64, 64);
  const GemmEfficiency& g = h.gemm;
  const double c1 = g.at(512, 512, 512), c2 = g.at(1024, 512, 512);
  h.gemm_table = {{512, 512, 512, 1, 0.5 * c1}, {1024, 512, 512, 1, 0.25 * c2}};
  EXPECT_DOUBLE_EQ(h.gemm_efficiency(512, 512, 512), 0.5 * c1);
  EXPECT_DOUBLE_EQ(h.gemm_efficiency(1024, 512, 512), 0.25 * c2);
  // Halfway (in log2 m) between the two: the ratio to the curve lies between theirs.
  const double mid = std::sqrt(512.0 * 1024.0);
  const double r = h.gemm_efficiency(mid, 512, 512) / g.at(mid, 512, 512);
  EXPECT_GT(r, 0.25);
  EXPECT_LT(r, 0.5);
  // Nearer the first entry, nearer its ratio.
  const double r_near = h.gemm_efficiency(600, 512, 512) / g.at(600, 512, 512);
  EXPECT_GT(r_near, r);
  // Far from every entry: the curve alone (to within the vanishing weights).
  EXPECT_NEAR(h.gemm_efficiency(8, 65536, 16), g.at(8, 65536, 16), 1e-6 * g.at(8, 65536, 16));
  // Without a table, the curve.
  HardwareProfile plain;
  set_curve(plain.gemm, 0.8, 64, 64, 64);
  EXPECT_DOUBLE_EQ(plain.gemm_efficiency(300, 200, 100, 2), plain.gemm.at(300, 200, 100, 2));
}

TEST(GemmTable, EfficiencyStaysAFraction) {
  HardwareProfile h;
  set_curve(h.gemm, 1.0, 0, 0, 0);
  h.gemm_table = {{64, 64, 64, 1, 1.0}};
  for (double m : {32.0, 60.0, 70.0, 128.0}) {
    const double e = h.gemm_efficiency(m, 64, 64);
    EXPECT_GT(e, 0);
    EXPECT_LE(e, 1);
  }
}

// ---- fits recover known parameters ----

TEST(Fits, GemmCurveRecoversItsParameters) {
  HardwareProfile truth_profile;
  set_curve(truth_profile.gemm, 0.7, 48, 96, 24);
  const GemmEfficiency& truth = truth_profile.gemm;
  std::vector<GemmSample> s;
  for (double m : {16, 64, 256, 1024})
    for (double n : {16, 64, 256, 1024})
      for (double k : {8, 32, 128, 512}) s.push_back({m, n, k, 1, truth.at(m, n, k)});
  const GemmCurveFit f = fit_gemm_curve(s);
  EXPECT_NEAR(f.max_efficiency, 0.7, 0.7e-3);
  EXPECT_NEAR(f.m_half, 48, 0.5);
  EXPECT_NEAR(f.n_half, 96, 1.0);
  EXPECT_NEAR(f.k_half, 24, 0.3);
  EXPECT_EQ(f.residuals.points, static_cast<int64_t>(s.size()));
  EXPECT_LT(f.residuals.max_relative, 1e-3);
  // With 5% multiplicative noise the fit still lands near, and says how far off it is.
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> noise(-0.05, 0.05);
  for (GemmSample& g : s) g.efficiency *= 1 + noise(rng);
  const GemmCurveFit nf = fit_gemm_curve(s);
  EXPECT_NEAR(nf.max_efficiency, 0.7, 0.05);
  EXPECT_GT(nf.residuals.rms_relative, 0.005);
  EXPECT_LT(nf.residuals.max_relative, 0.1);
}

TEST(Fits, LatencyAndBandwidthAreRecovered) {
  std::vector<double> x, t;
  for (double b = 1024; b <= 64 << 20; b *= 4) {
    x.push_back(b);
    t.push_back(12e-6 + b / 3e9);
  }
  const LinearFit f = fit_latency_bandwidth(x, t);
  EXPECT_NEAR(f.latency_s, 12e-6, 1e-9);
  EXPECT_NEAR(1 / f.seconds_per_unit, 3e9, 3e6);
  EXPECT_LT(f.residuals.max_relative, 1e-9);
  // Noise: residuals say so.
  for (size_t i = 0; i < t.size(); ++i) t[i] *= i % 2 ? 1.1 : 0.9;
  const LinearFit nf = fit_latency_bandwidth(x, t);
  EXPECT_NEAR(nf.residuals.max_relative, 0.1, 0.03);
  EXPECT_GE(nf.latency_s, 0);
}

TEST(Fits, MemoryKernelsShareOneGapAndHaveAThroughputEach) {
  std::vector<int> fam;
  std::vector<double> bytes, t;
  const double gap = 2e-6, spb[3] = {1 / 10e9, 1 / 4e9, 1 / 20e9};
  for (int f = 0; f < 3; ++f)
    for (double b = 4096; b <= 16 << 20; b *= 4) {
      fam.push_back(f);
      bytes.push_back(b);
      t.push_back(gap + b * spb[f]);
    }
  const MemoryFit m = fit_memory_kernels(fam, bytes, t, 4);  // family 3 has no samples
  EXPECT_NEAR(m.gap_s, gap, 1e-10);
  for (int f = 0; f < 3; ++f) EXPECT_NEAR(m.seconds_per_byte[f] / spb[f], 1.0, 1e-6);
  EXPECT_EQ(m.residuals[3].points, 0);
  EXPECT_EQ(m.all.points, static_cast<int64_t>(t.size()));
  EXPECT_LT(m.all.max_relative, 1e-6);
}

// The fit's coefficients are never negative: a family whose time falls with its bytes (noise
// alone does that) gets no throughput term rather than a negative one, and the others keep
// theirs. A family measured at one size only cannot tell its gap from its throughput; the fit
// still reproduces its times.
TEST(Fits, MemoryKernelsNeverGoNegativeAndSurviveOneSize) {
  std::vector<int> fam;
  std::vector<double> bytes, t;
  for (double b = 4096; b <= 16 << 20; b *= 4) {
    fam.push_back(0), bytes.push_back(b), t.push_back(3e-6 + b / 10e9);
    fam.push_back(1), bytes.push_back(b), t.push_back(3e-6 - b * 1e-16);
  }
  const MemoryFit m = fit_memory_kernels(fam, bytes, t, 2);
  EXPECT_NEAR(m.gap_s, 3e-6, 3e-9);
  EXPECT_EQ(m.seconds_per_byte[1], 0);
  EXPECT_NEAR(m.seconds_per_byte[0] * 10e9, 1.0, 0.01);
  EXPECT_LT(m.residuals[1].max_relative, 1e-3);

  const std::vector<int> one_fam(4, 0);
  const std::vector<double> one_size(4, 1 << 20), one_t = {2e-5, 2.02e-5, 1.98e-5, 2e-5};
  const MemoryFit o = fit_memory_kernels(one_fam, one_size, one_t, 1);
  EXPECT_GE(o.gap_s, 0);
  EXPECT_GE(o.seconds_per_byte[0], 0);
  EXPECT_TRUE(std::isfinite(o.gap_s) && std::isfinite(o.seconds_per_byte[0]));
  EXPECT_LT(o.all.max_relative, 0.02);
  EXPECT_THROW(fit_memory_kernels({0, 2}, {1, 2}, {1e-6, 2e-6}, 2), std::invalid_argument);
}

// ---- the machine file ----

// A machine file as ptdp calibrate writes one, with every measured field of the profile.
// The small GPT the machine-file tests price (2 layers, hidden 256, sequence 128).
ModelSpec small_gpt() {
  ModelSpec m;
  m.num_layers = 2, m.hidden_size = 256, m.num_attention_heads = 4, m.seq_length = 128,
  m.vocab_size = 1024;
  return m;
}

json machine_file() {
  ClusterSpec c;
  c.name = "measured-cpu";
  c.gpu.name = "Test CPU (1 of 2 ranks)";
  c.gpu.peak_tflops_16bit = 0.05;
  c.gpu.memory_gib = 8;
  c.gpu.hbm_bandwidth_gbps = 10;
  c.gpus_per_node = 2;
  c.num_nodes = 1;
  c.nvlink_bandwidth_gbps = 5;
  c.nics_per_node = 1;
  c.nic_bandwidth_gbps = 5;
  HardwareProfile p;
  p.name = "measured-cpu";
  set_curve(p.gemm, 0.9, 16, 16, 8);
  // The first GEMM was also timed cold; the second was not.
  p.gemm_table = {{128, 768, 256, 1, 0.6, 1.3}, {128, 256, 256, 1, 0.5}};
  // A cache larger than any working set here: ops priced warm, as measured.
  p.cache.bytes_per_rank = 1e12;
  p.cache.memory_cold_factor = {{"norm", 1.2}};
  p.kernel_gap_us = 1.5;
  p.hbm_efficiency = 1;
  p.collectives = {{Collective::kAllReduce, 2, 1, 20, 2.5},
                   {Collective::kSendRecv, 2, 1, 8, 4},
                   {Collective::kAllReduce, 2, 1, 30, 0.5, DType::kBF16}};
  p.memory_efficiency = {{"norm", 0.4}, {"softmax", 1.7}, {"optimizer", 0.3}};
  p.activation_dtype = DType::kF32;
  p.optimizer_bytes_per_param = 36;
  return {{"format", kMachineFileFormat}, {"machine", {{"device", "Test CPU"}, {"ranks", 2}}},
          {"cluster", to_json(c)},        {"profile", to_json(p)},
          {"fits", json::object()},       {"measurements", json::object()}};
}

// The field a profile's InputError names, or "accepted" when profile_from_json takes it.
std::string profile_error_field(const json& profile) {
  try {
    profile_from_json(profile);
  } catch (const InputError& e) {
    return e.field();
  }
  return "accepted";
}

std::string write_temp(const std::string& name, const json& j) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("ptdp_calibration_test_" + std::to_string(::getpid()) + "_" + name);
  std::ofstream(path) << j.dump(1);
  return path.string();
}

TEST(MachineFile, RoundTripsAndCarriesItsProfile) {
  const json j = machine_file();
  const ClusterSpec c = cluster_from_json(j);
  ASSERT_TRUE(c.measured_profile);
  EXPECT_EQ(to_json(c), j["cluster"]);
  EXPECT_EQ(to_json(*c.measured_profile), j["profile"]);
  EXPECT_EQ(to_json(profile_from_json(to_json(*c.measured_profile))), j["profile"]);
  EXPECT_EQ(default_profile_for(c).name, "measured-cpu");
  // --profile machine.json: its measured profile alone.
  EXPECT_EQ(to_json(profile_from_json(j)), j["profile"]);
  // Presets carry none of the measured fields and still write what they read.
  const HardwareProfile a100 = resolve_profile("a100-80gb");
  EXPECT_TRUE(a100.gemm_table.empty() && a100.collectives.empty());
  EXPECT_FALSE(to_json(a100).contains("collectives"));
  EXPECT_FALSE(resolve_cluster("dgx-a100-80gb").measured_profile);
}

TEST(MachineFile, CostModelPricesWithTheMeasurements) {
  const ClusterSpec c = cluster_from_json(machine_file());
  const HardwareProfile& h = *c.measured_profile;
  const ModelSpec m = small_gpt();
  const CostModel cm(m, c, h);
  // A GEMM of the table runs at its measured efficiency.
  Op g;
  g.kind = OpKind::kGemm;
  g.m = 128, g.n = 768, g.k = 256;
  EXPECT_DOUBLE_EQ(cm.gemm_time(g), g.flops() / (0.05e12 * 0.6) + 1.5e-6);
  // A memory-bound op at its family's efficiency; an unmeasured family at hbm_efficiency.
  Op n;
  n.kind = OpKind::kMemory;
  n.id = OpId::kInputLayernorm;
  n.bytes = 1e6;
  EXPECT_DOUBLE_EQ(cm.op_time(n, ParallelPlan{}), 1e6 / (10e9 * 0.4) + 1.5e-6);
  n.id = OpId::kBiasGelu;
  EXPECT_DOUBLE_EQ(cm.op_time(n, ParallelPlan{}), 1e6 / (10e9 * 1.0) + 1.5e-6);
  // The all-reduce fit over two ranks; its group size only.
  GroupSpan two;
  two.size = 2;
  EXPECT_DOUBLE_EQ(cm.comm().collective_time(Collective::kAllReduce, 1e6, two, DType::kF32),
                   20e-6 + 1.0 * 1e6 / 2.5e9);
  GroupSpan four = two;
  four.size = 4;
  EXPECT_NE(cm.comm().collective_time(Collective::kAllReduce, 1e6, four, DType::kF32),
            20e-6 + 1.5 * 1e6 / 2.5e9);
  // bf16 elements: the fit timed on them (a 16-bit sum is another kernel); fp16, not measured:
  // the fp32 fit.
  EXPECT_DOUBLE_EQ(cm.comm().collective_time(Collective::kAllReduce, 1e6, two, DType::kBF16),
                   30e-6 + 1.0 * 1e6 / 0.5e9);
  EXPECT_DOUBLE_EQ(cm.comm().collective_time(Collective::kAllReduce, 1e6, two, DType::kF16),
                   20e-6 + 1.0 * 1e6 / 2.5e9);
  // fp32 activations: pipeline messages of 4 bytes per element.
  ParallelPlan p;
  p.pipeline_parallel = 2;
  p.global_batch_size = 2;
  EXPECT_DOUBLE_EQ(cm.activation_message_bytes(p), 128.0 * 256 * 4);
  // The optimizer at its family's efficiency.
  EXPECT_DOUBLE_EQ(cm.optimizer_time(p, 1e6), 1e6 * 36 / (10e9 * 0.3) + 1.5e-6);
}

// The machine file's measured profile with an arrival skew of `skew`, and with none.
std::pair<HardwareProfile, HardwareProfile> with_and_without_skew(const ClusterSpec& c,
                                                                  double skew) {
  HardwareProfile skewed = *c.measured_profile, lockstep = *c.measured_profile;
  skewed.arrival_skew = skew;
  lockstep.arrival_skew = 0;
  return {skewed, lockstep};
}

// Arrival skew: every collective inside a layer that waits for its group's ranks (the
// tensor-parallel group's, and an MoE layer's all-to-alls and expert-tensor collectives) also
// waits for the last rank, the measured fraction of the compute since the group's previous
// collective; nothing else changes, and a layout without such collectives is priced as before.
TEST(MachineFile, ArrivalSkewDelaysEveryCollectiveInsideALayer) {
  const ClusterSpec c = cluster_from_json(machine_file());
  const auto [skewed, lockstep] = with_and_without_skew(c, 0.2);
  ModelSpec m = small_gpt();
  m.num_experts = 4, m.moe_router_topk = 2;
  const CostModel a(m, c, skewed), b(m, c, lockstep);
  struct Layout {
    int64_t t, d, ep;
    int waiting;  // collectives of a layer's forward that wait for their group (t = 2: the
                  // sequence-parallel gather and scatter, and the experts' over etp = 2)
  };
  for (const Layout& l : {Layout{1, 1, 1, 0}, Layout{2, 1, 1, 4}, Layout{1, 2, 2, 2}}) {
    ParallelPlan p;
    p.tensor_parallel = l.t;
    p.data_parallel = l.d;
    p.expert_parallel = l.ep;
    p.sequence_parallel = l.t > 1;
    p.global_batch_size = 4;
    const std::vector<Op> ops = moe_layer_ops(m, a.priced_layer_shape(p)).forward;
    const std::vector<double> with = a.exposed_times(ops, p), without = b.exposed_times(ops, p);
    double since = 0;
    int waited = 0;
    for (size_t i = 0; i < ops.size(); ++i) {
      const std::string at =
          std::string(ops[i].name()) + " t" + std::to_string(l.t) + " ep" + std::to_string(l.ep);
      if (ops[i].kind != OpKind::kCollective) {
        EXPECT_DOUBLE_EQ(with[i], without[i]) << at;
        since += without[i];
        continue;
      }
      EXPECT_NEAR(with[i], without[i] + 0.2 * since, 1e-12) << at;
      waited += with[i] > without[i];
      since = 0;
    }
    EXPECT_EQ(waited, l.waiting) << l.t << " " << l.ep;
  }
}

// Context parallelism's ring waits once per layer pass: its first exchange of the pass for the
// measured fraction of the whole pass's compute (the ring's previous wait was the previous
// layer's), its others not at all; everything else as without skew.
TEST(MachineFile, ArrivalSkewDelaysTheRingOncePerPass) {
  const ClusterSpec c = cluster_from_json(machine_file());
  const auto [skewed, lockstep] = with_and_without_skew(c, 0.2);
  const ModelSpec m = small_gpt();
  const CostModel a(m, c, skewed), b(m, c, lockstep);
  ParallelPlan p;
  p.context_parallel = 4;
  p.global_batch_size = 4;
  const PassOps layer = transformer_layer_ops(m, a.priced_layer_shape(p));
  for (const std::vector<Op>* ops : {&layer.forward, &layer.backward}) {
    const std::vector<double> with = a.exposed_times(*ops, p), without = b.exposed_times(*ops, p);
    double compute = 0;
    for (size_t i = 0; i < ops->size(); ++i)
      if ((*ops)[i].kind != OpKind::kCollective) compute += without[i];
    int ring = 0;
    for (size_t i = 0; i < ops->size(); ++i) {
      const Op& op = (*ops)[i];
      const bool waits =
          op.kind == OpKind::kCollective && op.group == CommGroup::kContext && ring++ == 0;
      EXPECT_NEAR(with[i], without[i] + (waits ? 0.2 * compute : 0.0), 1e-12) << op.name();
    }
    EXPECT_EQ(ring, 3);  // cp - 1 exchanges a pass
  }
}

// A fused (flash) attention's kernels are priced as calibrate measured them, per op: the
// measured size at its time, other sizes in proportion from the nearest measurement; only the
// ops of a fused list (Op::fused), so the unfused attention keeps its GEMM pricing. The table
// survives the machine file's JSON, and bad entries are one-line errors naming the field.
TEST(MachineFile, FusedAttentionIsPricedAsMeasured) {
  const ClusterSpec c = cluster_from_json(machine_file());
  HardwareProfile h = *c.measured_profile;
  h.fused_ops = {{"attn_scores", 1e9, 2e-3},
                 {"attn_scores", 8e9, 20e-3},
                 {"attn_scores_recompute", 1e9, 5e-3}};
  const ModelSpec m = small_gpt();
  const CostModel cm(m, c, h);
  Op op;
  op.kind = OpKind::kGemm;
  op.id = OpId::kAttnScores;
  op.fused = true;
  op.m = 500, op.n = 1000, op.k = 1000;  // 1e9 FLOPs: the measurement itself
  EXPECT_DOUBLE_EQ(cm.op_time(op, ParallelPlan{}), 2e-3);
  op.batch = 2;  // 2e9: nearest 1e9, scaled
  EXPECT_DOUBLE_EQ(cm.op_time(op, ParallelPlan{}), 4e-3);
  op.batch = 6;  // 6e9: nearest 8e9
  EXPECT_DOUBLE_EQ(cm.op_time(op, ParallelPlan{}), 15e-3);
  op.id = OpId::kAttnScoresRecompute;
  op.batch = 1;
  EXPECT_DOUBLE_EQ(cm.op_time(op, ParallelPlan{}), 5e-3);
  op.id = OpId::kAttnContext;  // not measured: the GEMM curve
  EXPECT_DOUBLE_EQ(cm.op_time(op, ParallelPlan{}), cm.gemm_time(op));
  op.id = OpId::kAttnScores;
  op.fused = false;  // the unfused scores GEMM
  EXPECT_DOUBLE_EQ(cm.op_time(op, ParallelPlan{}), cm.gemm_time(op));
  const HardwareProfile back = profile_from_json(to_json(h));
  ASSERT_EQ(back.fused_ops.size(), 3u);
  EXPECT_EQ(back.fused_ops[2].op, "attn_scores_recompute");
  EXPECT_DOUBLE_EQ(back.fused_ops[1].seconds, 20e-3);
  for (const auto& [key, value, field] :
       {std::tuple<const char*, json, const char*>{"size", 0.0, "fused_ops[0].size"},
        {"seconds", -1.0, "fused_ops[0].seconds"},
        {"op", "", "fused_ops[0].op"},
        {"op", "nope", "fused_ops[0].op"},  // not an op of the layer op list
        {"flops", 1.0, "fused_ops[0].flops"}}) {
    json j = to_json(h);
    j["fused_ops"][0][key] = value;
    EXPECT_EQ(profile_error_field(j), field) << key;
  }
}

// A memory-bound op calibrate measured is priced at its measured time; another size of it at
// the family fit times the measured/fit ratio of its measurements nearby (one octave's weight,
// the fit alone far from them); an op of the same family that was not measured at the fit.
// The table survives the JSON; a bad entry is a one-line error naming its field.
TEST(MachineFile, MemoryBoundOpsArePricedAsMeasured) {
  const ClusterSpec c = cluster_from_json(machine_file());
  HardwareProfile h = *c.measured_profile;
  const ModelSpec m = small_gpt();
  const CostModel fit(m, c, h);  // no table: the family fit
  Op op;
  op.kind = OpKind::kMemory;
  op.id = OpId::kBiasGelu;
  auto fit_at = [&](double bytes) {
    op.bytes = bytes;
    return fit.memory_time(op);
  };
  // Measured 3x the fit at 1 MB and 2x at 4 MB: a kernel slower a byte at one size than another.
  h.memory_ops = {{"bias_gelu", 1e6, 3 * fit_at(1e6)}, {"bias_gelu", 4e6, 2 * fit_at(4e6)}};
  const CostModel cm(m, c, h);
  // Priced over priced by the fit, cache model included (the same for both).
  auto ratio = [&](double bytes) {
    op.bytes = bytes;
    return cm.op_time(op, ParallelPlan{}) / fit.op_time(op, ParallelPlan{});
  };
  EXPECT_NEAR(ratio(1e6), 3.0, 1e-12);
  EXPECT_NEAR(ratio(4e6), 2.0, 1e-12);
  const double between = ratio(2e6);  // one octave from each
  EXPECT_GT(between, 2.0);
  EXPECT_LT(between, 3.0);
  EXPECT_NEAR(ratio(1e12), 1.0, 1e-6);  // far from both: the fit
  op.id = OpId::kMlpBiasDropoutAdd;     // another op: the fit
  EXPECT_DOUBLE_EQ(ratio(1e6), 1.0);
  const HardwareProfile back = profile_from_json(to_json(h));
  ASSERT_EQ(back.memory_ops.size(), 2u);
  EXPECT_EQ(back.memory_ops[1].op, "bias_gelu");
  EXPECT_DOUBLE_EQ(back.memory_ops[1].seconds, h.memory_ops[1].seconds);
  for (const auto& [key, value, field] :
       {std::tuple<const char*, json, const char*>{"size", -1.0, "memory_ops[0].size"},
        {"seconds", "slow", "memory_ops[0].seconds"},
        {"op", "bias_gelus", "memory_ops[0].op"}}) {
    json j = to_json(h);
    j["memory_ops"][0][key] = value;
    EXPECT_EQ(profile_error_field(j), field) << key;
  }
  json j = to_json(h);
  j["memory_ops"] = 1;
  EXPECT_EQ(profile_error_field(j), "memory_ops");
}

// Measured at several sequence lengths, a fused attention is priced from the sequence nearest
// the op's (its m) before the size: 4 sequences of 1024 and 1 of 2048 have the same FLOPs, and
// the longer one runs slower per FLOP (its longest query tile's work is twice as long). Rows
// survive the JSON; a file without them prices by size alone.
TEST(MachineFile, FusedAttentionIsPricedFromTheNearestSequence) {
  const ClusterSpec c = cluster_from_json(machine_file());
  HardwareProfile h = *c.measured_profile;
  Op op;
  op.kind = OpKind::kGemm;
  op.id = OpId::kAttnScores;
  op.fused = true;
  op.k = 64;
  auto shape = [&](int64_t s, int64_t heads) {  // causal: half the keys on average
    op.m = s, op.n = s / 2, op.batch = heads;
    return op.flops();
  };
  const double f1024x4 = shape(1024, 48), f2048x1 = shape(2048, 12), f512x4 = shape(512, 48);
  ASSERT_DOUBLE_EQ(f1024x4, f2048x1);
  h.fused_ops = {{"attn_scores", f1024x4, 1.0e-3, 1024},
                 {"attn_scores", f2048x1, 1.3e-3, 2048},
                 {"attn_scores", f512x4, 0.3e-3, 512}};
  ModelSpec m;
  m.num_layers = 2, m.hidden_size = 768, m.num_attention_heads = 12, m.seq_length = 2048,
  m.vocab_size = 1024;
  const CostModel cm(m, c, h);
  shape(2048, 12);
  EXPECT_DOUBLE_EQ(cm.op_time(op, ParallelPlan{}), 1.3e-3);
  shape(2048, 24);  // the same sequence, twice the heads: scaled from it
  EXPECT_DOUBLE_EQ(cm.op_time(op, ParallelPlan{}), 2.6e-3);
  shape(1024, 48);
  EXPECT_DOUBLE_EQ(cm.op_time(op, ParallelPlan{}), 1.0e-3);
  shape(4096, 12);  // beyond the longest measured: from it, in proportion to FLOPs
  EXPECT_DOUBLE_EQ(cm.op_time(op, ParallelPlan{}), 4 * 1.3e-3);
  shape(700, 48);  // nearer 512 than 1024 in ratio
  EXPECT_NEAR(cm.op_time(op, ParallelPlan{}), 0.3e-3 * shape(700, 48) / f512x4, 1e-15);
  const HardwareProfile back = profile_from_json(to_json(h));
  ASSERT_EQ(back.fused_ops.size(), 3u);
  EXPECT_DOUBLE_EQ(back.fused_ops[1].rows, 2048);
  h.fused_ops[0].rows = 0;  // unrecorded: not written, read back as 0
  EXPECT_FALSE(to_json(h)["fused_ops"][0].contains("rows"));
  json j = to_json(h);
  j["fused_ops"][1]["rows"] = 0.5;
  EXPECT_EQ(profile_error_field(j), "fused_ops[1].rows");
  // Without rows on either side the nearest size decides, as before: 2048 x 1 and 1024 x 4
  // tie in size, and the first listed wins.
  for (FusedOpMeasurement& e : h.fused_ops) e.rows = 0;
  const CostModel by_size(m, c, h);
  shape(2048, 12);
  EXPECT_DOUBLE_EQ(by_size.op_time(op, ParallelPlan{}), 1.0e-3);
}

// Where calibrate measured the host's time to issue each op (a GPU: kernels run asynchronously),
// a list the host issues slower than the device runs it takes the host's time, its ops
// stretched in proportion; a list the device is the slower for keeps its device times. Ops
// calibrate did not time get the mean issue time. The map survives the JSON; a bad value or an
// unknown op is a one-line error naming it.
TEST(MachineFile, HostBoundListsTakeTheHostsIssueTime) {
  const ClusterSpec c = cluster_from_json(machine_file());
  HardwareProfile h = *c.measured_profile;
  h.cache = {};
  const ModelSpec m = small_gpt();
  ParallelPlan p;
  p.global_batch_size = 4;
  std::vector<Op> ops(3);
  ops[0].kind = OpKind::kMemory, ops[0].id = OpId::kInputLayernorm, ops[0].bytes = 1e6;
  ops[1].kind = OpKind::kGemm, ops[1].id = OpId::kQkv, ops[1].m = 128, ops[1].n = 768,
  ops[1].k = 256;
  ops[2].kind = OpKind::kCollective, ops[2].id = OpId::kAttnAllReduce,
  ops[2].collective = Collective::kAllReduce, ops[2].group = CommGroup::kTensor, ops[2].bytes = 1e5;
  const std::vector<double> device = CostModel(m, c, h).exposed_times(ops, p);
  const double busy = device[0] + device[1];
  // Issue slower than the device: stretched to the host's total, the collective untouched.
  h.host_op_us = {{"input_layernorm", 0.6e6 * busy}, {"qkv", 1.4e6 * busy}};
  std::vector<double> t = CostModel(m, c, h).exposed_times(ops, p);
  EXPECT_NEAR(t[0] + t[1], 2 * busy, 1e-12 * busy);
  EXPECT_NEAR(t[0] / t[1], device[0] / device[1], 1e-9);
  EXPECT_DOUBLE_EQ(t[2], device[2]);
  // Issue faster than the device: the device's times.
  h.host_op_us = {{"input_layernorm", 0.1e6 * busy}, {"qkv", 0.2e6 * busy}};
  EXPECT_EQ(CostModel(m, c, h).exposed_times(ops, p), device);
  // qkv not timed: the mean of the timed ops, 0.9 busy, so 1.8 busy in all.
  h.host_op_us = {{"input_layernorm", 0.9e6 * busy}, {"fc1", 0.9e6 * busy}};
  t = CostModel(m, c, h).exposed_times(ops, p);
  EXPECT_NEAR(t[0] + t[1], 1.8 * busy, 1e-12 * busy);

  const HardwareProfile back = profile_from_json(to_json(h));
  EXPECT_EQ(back.host_op_us, h.host_op_us);
  for (const auto& [key, value, field] :
       {std::tuple<const char*, json, const char*>{"qkv", -1.0, "host_op_us.qkv"},
        {"qkv", "fast", "host_op_us.qkv"},
        {"no_such_op", 1.0, "host_op_us.no_such_op"}}) {
    json j = to_json(h);
    j["host_op_us"][key] = value;
    EXPECT_EQ(profile_error_field(j), field) << key;
  }
}

// What calibrate measured cold prices an op by how much of its stage's working set the
// last-level cache holds: warm when all of it, cold when none, linearly between.
TEST(CacheModel, OpsArePricedBetweenWarmAndColdByTheWorkingSet) {
  const ClusterSpec c = cluster_from_json(machine_file());
  HardwareProfile h = *c.measured_profile;
  const ModelSpec m = small_gpt();
  ParallelPlan p;
  p.global_batch_size = 4;
  Op g;
  g.kind = OpKind::kGemm;
  g.m = 128, g.n = 768, g.k = 256;
  Op other = g;  // no cold time of its own: the measured one's, interpolated
  other.n = 256;
  Op n;
  n.kind = OpKind::kMemory;
  n.id = OpId::kInputLayernorm;
  n.bytes = 1e6;
  Op gelu = n;  // no factor of its own: the mean of the measured families
  gelu.id = OpId::kBiasGelu;
  EXPECT_NEAR(h.gemm_cold_factor(128, 256, 256), 1.3, 1e-12);
  EXPECT_DOUBLE_EQ(h.memory_cold_factor_of("activation"), 1.2);

  const CostModel warm(m, c, h);
  EXPECT_EQ(warm.cache_hit(p), 1.0);
  EXPECT_DOUBLE_EQ(warm.op_time(g, p), warm.gemm_time(g));
  EXPECT_DOUBLE_EQ(warm.op_time(n, p), warm.memory_time(n));

  // A 1 MB cache: a small part of the working set (fp32 weights and gradients alone are
  // about 15 MB here).
  h.cache.bytes_per_rank = 1e6;
  const CostModel small(m, c, h);
  const double hit = small.cache_hit(p);
  EXPECT_GT(hit, 0.0);
  EXPECT_LT(hit, 1e6 / 15e6);
  for (const auto& [op, cold] :
       {std::pair{g, 1.3}, std::pair{other, 1.3}, std::pair{n, 1.2}, std::pair{gelu, 1.2}}) {
    const double w = warm.op_time(op, p);
    EXPECT_NEAR(small.op_time(op, p), w * (hit + (1 - hit) * cold), 1e-12 * w) << op.name();
  }
  // More activations (a larger microbatch): less of them in cache.
  ParallelPlan big = p;
  big.micro_batch_size = 4;
  EXPECT_LT(small.cache_hit(big), hit);
  // The whole step prices above the warm one.
  EXPECT_GT(small.predict(p).iteration_time_s, warm.predict(p).iteration_time_s);
  // Half the working set in cache: halfway.
  h.cache.bytes_per_rank = 1e6 / hit / 2;
  const CostModel half(m, c, h);
  EXPECT_NEAR(half.cache_hit(p), 0.5, 0.01);
}

// A measured hit curve (what the cache kept of an op's operands while each rank streamed so
// many bytes between two calls) replaces C / working set: interpolated linearly in bytes from
// (0, 1), never rising with more bytes (noise), beyond its last point that hit times its bytes
// over the working set. It survives
// the JSON; points out of order or hits outside [0, 1] are one-line errors naming them.
TEST(CacheModel, AMeasuredHitCurveReplacesTheRandomRetentionModel) {
  HardwareProfile h;
  h.cache.bytes_per_rank = 16e6;
  EXPECT_DOUBLE_EQ(h.cache_hit(32e6), 0.5);  // C / working set without a curve
  h.cache.hit_curve = {{8e6, 0.75}, {16e6, 0.45}, {24e6, 0.30}, {32e6, 0.35}};
  EXPECT_DOUBLE_EQ(h.cache_hit(0), 1.0);
  EXPECT_DOUBLE_EQ(h.cache_hit(4e6), 0.875);   // halfway from (0, 1) to (8 MB, 0.75)
  EXPECT_DOUBLE_EQ(h.cache_hit(16e6), 0.45);   // a point
  EXPECT_DOUBLE_EQ(h.cache_hit(20e6), 0.375);  // between two
  EXPECT_DOUBLE_EQ(h.cache_hit(32e6), 0.30);   // 0.35 measured after 0.30: held at 0.30
  // Beyond the curve: its last hit thinning with the working set, to 0 far beyond the cache.
  EXPECT_DOUBLE_EQ(h.cache_hit(64e6), 0.15);
  EXPECT_NEAR(h.cache_hit(1e12), 0.0, 1e-4);
  // What the cost model prices: the curve at the plan's working set.
  const ClusterSpec c = cluster_from_json(machine_file());
  HardwareProfile measured = *c.measured_profile;
  measured.cache.bytes_per_rank = 1e6;
  const ModelSpec m = small_gpt();
  ParallelPlan p;
  p.global_batch_size = 4;
  const double random_retention = CostModel(m, c, measured).cache_hit(p);
  measured.cache.hit_curve = {{1e6, 0.0}};  // LRU-like: nothing survives a larger working set
  EXPECT_GT(random_retention, 0.0);
  EXPECT_EQ(CostModel(m, c, measured).cache_hit(p), 0.0);
  // A curve alone (no cache size) is a model too, and survives the JSON.
  HardwareProfile alone;
  alone.cache.hit_curve = h.cache.hit_curve;
  EXPECT_DOUBLE_EQ(alone.cache_hit(16e6), 0.45);
  EXPECT_EQ(profile_from_json(to_json(alone)).cache.hit_curve.size(), 4u);
  const HardwareProfile back = profile_from_json(to_json(h));
  ASSERT_EQ(back.cache.hit_curve.size(), 4u);
  EXPECT_DOUBLE_EQ(back.cache.hit_curve[2].bytes, 24e6);
  EXPECT_DOUBLE_EQ(back.cache.hit_curve[3].hit, 0.35);
  for (const auto& [index, key, value, field] : {std::tuple<int, const char*, double, const char*>{
                                                     1, "bytes", 8e6, "cache.hit_curve[1].bytes"},
                                                 {0, "bytes", 0.0, "cache.hit_curve[0].bytes"},
                                                 {2, "hit", 1.5, "cache.hit_curve[2].hit"},
                                                 {3, "hit", -0.1, "cache.hit_curve[3].hit"}}) {
    json j = to_json(h);
    j["cache"]["hit_curve"][index][key] = value;
    EXPECT_EQ(profile_error_field(j), field) << key;
  }
}

using CliResult = test::CliResult;
constexpr auto cli = &test::run_ptdp;

std::vector<std::string> predict(const std::string& cluster) {
  return {"predict", "--num-layers",
          "2",       "--hidden-size",
          "256",     "--num-attention-heads",
          "4",       "--seq-length",
          "128",     "--vocab-size",
          "1024",    "--cluster",
          cluster,   "--num-gpus",
          "2",       "--global-batch-size",
          "4",       "--tensor-model-parallel-size",
          "1",       "--pipeline-model-parallel-size",
          "2",       "--micro-batch-size",
          "1",       "--json"};
}

TEST(MachineFile, PredictLoadsItThroughCluster) {
  const std::string path = write_temp("machine.json", machine_file());
  const CliResult r = cli(predict(path));
  ASSERT_EQ(r.status, 0) << r.err;
  const json j = json::parse(r.out);
  // The same numbers as the cost model with the file's cluster and profile.
  const ClusterSpec c = resolve_cluster(path);
  ModelSpec m;
  m.name = "custom";
  m.num_layers = 2, m.hidden_size = 256, m.num_attention_heads = 4, m.seq_length = 128,
  m.vocab_size = 1024;
  ParallelPlan p;
  p.pipeline_parallel = 2;
  p.global_batch_size = 4;
  const Prediction want = CostModel(m, c, *c.measured_profile).predict(p);
  EXPECT_NEAR(j["iteration_time_s"].get<double>(), want.iteration_time_s,
              1e-9 * want.iteration_time_s);
  // --profile still overrides the profile alone.
  auto args = predict(path);
  args.insert(args.end(), {"--profile", "a100-80gb"});
  const CliResult o = cli(args);
  ASSERT_EQ(o.status, 0) << o.err;
  const Prediction a100 = CostModel(m, c, resolve_profile("a100-80gb")).predict(p);
  EXPECT_NEAR(json::parse(o.out)["iteration_time_s"].get<double>(), a100.iteration_time_s,
              1e-9 * a100.iteration_time_s);
  std::filesystem::remove(path);
}

TEST(MachineFile, BadFilesGetOneLineErrorsNamingTheField) {
  struct Case {
    std::string name;
    std::function<void(json&)> edit;
    std::string field;
  };
  const std::vector<Case> cases = {
      {"efficiency", [](json& j) { j["profile"]["gemm"]["table"][1]["efficiency"] = 1.5; },
       "profile.gemm.table[1].efficiency"},
      {"table_m", [](json& j) { j["profile"]["gemm"]["table"][0]["m"] = 0; },
       "profile.gemm.table[0].m"},
      {"collective", [](json& j) { j["profile"]["collectives"][0]["collective"] = "all-to-all"; },
       "profile.collectives[0].collective"},
      {"busbw", [](json& j) { j["profile"]["collectives"][1]["busbw_gbps"] = -1; },
       "profile.collectives[1].busbw_gbps"},
      {"ranks", [](json& j) { j["profile"]["collectives"][0]["ranks"] = 1; },
       "profile.collectives[0].ranks"},
      {"dtype", [](json& j) { j["profile"]["collectives"][2]["dtype"] = "int8"; },
       "profile.collectives[2].dtype"},
      {"family", [](json& j) { j["profile"]["memory_efficiency"]["norms"] = 0.5; },
       "profile.memory_efficiency.norms"},
      {"family_value", [](json& j) { j["profile"]["memory_efficiency"]["norm"] = 0; },
       "profile.memory_efficiency.norm"},
      {"dtype", [](json& j) { j["profile"]["activation_dtype"] = "fp8"; },
       "profile.activation_dtype"},
      {"cold_factor", [](json& j) { j["profile"]["gemm"]["table"][0]["cold_factor"] = 0; },
       "profile.gemm.table[0].cold_factor"},
      {"cache_bytes", [](json& j) { j["profile"]["cache"]["bytes_per_rank"] = -1; },
       "profile.cache.bytes_per_rank"},
      {"cold_family", [](json& j) { j["profile"]["cache"]["memory_cold_factor"]["norms"] = 1.1; },
       "profile.cache.memory_cold_factor.norms"},
      {"cold_family_value",
       [](json& j) { j["profile"]["cache"]["memory_cold_factor"]["norm"] = 5000; },
       "profile.cache.memory_cold_factor.norm"},
      {"peak", [](json& j) { j["cluster"]["gpu"]["peak_tflops_16bit"] = 0; },
       "cluster.gpu.peak_tflops_16bit"},
      {"no_profile", [](json& j) { j.erase("profile"); }, "profile"},
      {"no_cluster", [](json& j) { j.erase("cluster"); }, "cluster"},
      {"fits", [](json& j) { j["fits"] = 3; }, "fits"},
      {"unknown", [](json& j) { j["extra"] = 1; }, "extra"},
  };
  for (const Case& k : cases) {
    json j = machine_file();
    k.edit(j);
    try {
      (void)cluster_from_json(j);
      ADD_FAILURE() << k.name << " was accepted";
    } catch (const InputError& e) {
      EXPECT_EQ(e.field(), k.field) << k.name << ": " << e.what();
    }
    // Through the command line: exit 2, one line naming the flag and the field.
    const std::string path = write_temp(k.name + ".json", j);
    const CliResult r = cli(predict(path));
    EXPECT_EQ(r.status, 2) << k.name;
    EXPECT_EQ(r.out, "") << k.name;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("--cluster"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(k.field), std::string::npos) << r.err;
    std::filesystem::remove(path);
  }
}

// An unknown backend, and cuda where it cannot run (a build without CUDA, or no GPU visible:
// scripts/gpu-check.sh calibrates it on a GPU), are refused before anything is measured.
TEST(Calibrate, UnusableBackendsAndBadFlagsAreRefusedBeforeMeasuring) {
  const auto out =
      (std::filesystem::temp_directory_path() / "ptdp_calibration_test_x.json").string();
  CliResult r = cli({"calibrate", "--backend", "tpu", "--out", out});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err.rfind("ptdp: --backend:", 0), 0u) << r.err;
  bool gpu = true;
  try {
    make_backend("cuda");
  } catch (const InputError&) {
    gpu = false;
  }
  if (!gpu) {
    r = cli({"calibrate", "--backend", "cuda", "--out", out});
    EXPECT_EQ(r.status, 2);
    EXPECT_EQ(r.err.rfind("ptdp: --backend:", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  // A model this machine cannot time: refused before measuring, naming what to change (the
  // memory a 405B layer's ops need, or, on a machine with that much, the time they take).
  r = cli({"calibrate", "--quick", "--model", "llama3-405b", "--time-limit-s", "10", "--out", out});
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_TRUE(r.err.rfind("ptdp: --model:", 0) == 0 || r.err.rfind("ptdp: --time-limit-s:", 0) == 0)
      << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  r = cli({"calibrate", "--out", "/no/such/dir/m.json"});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err.rfind("ptdp: --out:", 0), 0u) << r.err;
  EXPECT_FALSE(std::filesystem::exists(out));
}

// An MoE model's ops at t = 2 are timed in the layout that runs them (sequence parallel): the
// calibration of every MoE model under mpirun stopped on "MoE layers with tensor parallelism
// need sequence parallelism". A device backend times them too.
TEST(Calibrate, MoeOpsAtTensorParallelTwoAreTimed) {
  ModelSpec m;
  m.name = "tiny-moe";
  m.num_layers = 2;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.seq_length = 32;
  m.vocab_size = 128;
  m.num_experts = 4;
  m.moe_router_topk = 2;
  m.moe_ffn_hidden_size = 128;
  m.validate();
  // On the CPU and on memory treated as a device's (what a GPU calibration runs: the routing
  // on the host from downloaded logits, the row moves on the device).
  for (const char* backend : {"cpu", "cpu-staged"}) {
    SCOPED_TRACE(backend);
    const auto be = make_backend(backend);
    const auto control = make_self_control_plane();
    Stopwatch sw(*control, 1e-4);
    std::vector<OpSample> s;
    EXPECT_NO_THROW(s = measure_ops(*be, m, {{1, 1}, {2, 1}}, sw, nullptr, {}));
    EXPECT_GT(s.size(), 10u);
    // The MoE layer's own compute ops are timed too (calibrate priced them from the generic GEMM
    // curve and the default bandwidth before), at both t, its collectives not.
    using I = OpId;
    for (const int64_t t : {1, 2})
      for (const OpId id :
           {I::kRouter, I::kRouterTopk, I::kMoePermute, I::kExpertFc1, I::kExpertActivation,
            I::kExpertFc2, I::kMoeUnpermute, I::kMoeUnpermuteBackward, I::kExpertFc2Dgrad,
            I::kExpertFc2Wgrad, I::kExpertActivationBackward, I::kExpertFc1Dgrad,
            I::kExpertFc1Wgrad, I::kMoePermuteBackward, I::kRouterTopkBackward, I::kRouterDgrad,
            I::kRouterWgrad}) {
        const auto it = std::find_if(s.begin(), s.end(),
                                     [&](const OpSample& x) { return x.op.id == id && x.t == t; });
        ASSERT_NE(it, s.end()) << op_name(id) << " t" << t;
        EXPECT_GT(it->seconds, 0) << op_name(id);
        if (it->op.kind == OpKind::kGemm && id != I::kRouter && id != I::kRouterDgrad &&
            id != I::kRouterWgrad) {
          EXPECT_EQ(it->op.batch, m.num_experts) << op_name(id);  // one GEMM per local expert
        }
        if (it->op.kind == OpKind::kMemory) {
          EXPECT_FALSE(memory_family(id).empty()) << op_name(id);  // fitted per family
        }
      }
    for (const OpSample& x : s) EXPECT_NE(x.op.kind, OpKind::kCollective) << x.op.name();
  }
}

// The CPU share counts the timed calls only: an untimed step before each call (the cache
// eviction) used to count its CPU time but not its wall time, giving 172% of a CPU.
TEST(Calibrate, CpuShareLeavesOutTheUntimedStep) {
  const auto control = make_self_control_plane();
  Stopwatch sw(*control, 0.02);
  volatile double sink = 0;
  auto spin = [&](int n) {
    for (int i = 0; i < n; ++i) sink = sink + std::sqrt(static_cast<double>(i));
  };
  sw.mean_seconds([&] { spin(2000); }, [&] { spin(200000); });
  EXPECT_LE(sw.cpu_share(), 1.05);
  EXPECT_GT(sw.cpu_share(), 0.0);
}

}  // namespace
}  // namespace ptdp
