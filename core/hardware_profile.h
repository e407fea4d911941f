// HardwareProfile: how fast a GPU and its links really run, as opposed to their datasheet.
//
// The cost model multiplies datasheet numbers (ClusterSpec) by these efficiencies. Each number
// is physically meaningful and documented with its source in the preset's JSON and in
// docs/cost_model.md. `ptdp calibrate` measures a machine and fits them (docs/calibration.md);
// a measured profile also carries what the fits cannot say in a few numbers: the measured GEMM
// table, per-collective latency and bandwidth per group span, and memory-bound efficiency per
// kernel family. Every such addition is optional: a preset without them prices as before.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/layer_ops.h"

namespace ptdp {

// One CTA tile shape cuBLAS may cut a GEMM's output into, and how fast an SM runs it relative
// to the best tile (smaller tiles reuse each loaded operand less).
struct GemmTile {
  int64_t m = 256;
  int64_t n = 128;
  double efficiency = 1.0;
};

// Achieved fraction of tensor-core peak for `batch` GEMMs of shape (m, n, k):
//   efficiency = max_efficiency * fill(m, n, batch) * s(k, k_half),  s(x, h) = x / (x + h)
// fill is how much of the GPU the output tiles keep busy. With sm_count > 0 it is counted
// (NVIDIA's tile and wave quantisation): for each tile shape (either orientation) the output
// is cut into tm x tn tiles, each SM works on one tile at a time, and a wave that leaves SMs
// idle costs as much as a full one:
//   tiles = batch * ceil(m / tm) * ceil(n / tn),  waves = ceil(tiles / sm_count)
//   fill  = tile.efficiency * batch * m * n / (waves * sm_count * tm * tn)
// and the best tile wins, as cuBLAS's heuristics aim to pick it.
// With sm_count = 0 a smooth curve stands in: fill = s(batch * m, m_half) * s(n, n_half).
// s(k, k_half) is the K loop's prologue and epilogue, amortised over a longer loop.
struct GemmEfficiency {
  double max_efficiency = 0.8;
  double m_half = 64;
  double n_half = 64;
  double k_half = 64;
  int64_t sm_count = 0;  // 0: the smooth curve instead of counted tiles and waves
  std::vector<GemmTile> tiles = {GemmTile{}};
  double at(double m, double n, double k, double batch = 1) const;
};

// One GEMM shape measured by `ptdp calibrate` (HardwareProfile::gemm_table).
struct GemmMeasurement {
  int64_t m = 1, n = 1, k = 1, batch = 1;
  double efficiency = 1;  // achieved / the cluster's peak, in (0, 1]
  // The time with the caches evicted before each call (the GEMM's input operand excepted)
  // over the time as measured, the caches warm from the call before: 0 where not measured.
  double cold_factor = 0;
};

// One op of a fused kernel measured by `ptdp calibrate` (HardwareProfile::fused_ops): a fused
// (flash) attention runs its whole forward pass on the op list's `attn_scores` and its whole
// backward pass on `attn_scores_recompute`, the other ops of the attention core inside them
// (measured at what an empty op costs). A GEMM efficiency table cannot hold these, so the time
// is kept per op: `size` is the op's FLOPs (GEMMs) or bytes (memory-bound ops) at the measured
// shape, `rows` its m (an attention's queries per sequence; 0: not recorded). Another shape of
// the same op is priced from the measurement nearest in rows, then nearest in size, at
// seconds * its size / size: a causal attention's time is not linear in FLOPs across sequence
// lengths (its longest query tile's work grows with them), so calibrate measures sequences
// around the model's.
struct FusedOpMeasurement {
  std::string op;  // op_name(): "attn_scores"
  double size = 0;
  double seconds = 0;
  double rows = 0;
};

// What the last-level cache does to measured times (CPU ranks, measured by ptdp calibrate).
// An op's time is measured warm (its operands in cache from the call before) and cold; in a
// run, between two uses of its weights and stored activations a rank touches its whole working
// set, of which the cache keeps a fraction: as calibrate measured it (hit_curve), else about
// min(1, C / working set) for a cache of C bytes. The cost model prices each op at warm +
// (1 - that fraction) (cold - warm) (docs/calibration.md).
struct CacheModel {
  double bytes_per_rank = 0;  // last-level cache per rank; 0: no model (ops priced warm)
  std::map<std::string, double> memory_cold_factor;  // cold / warm per memory-bound family
  // Measured by calibrate (empty: not measured): the fraction of an op's operands the cache
  // kept while each rank streamed `bytes` of other data between two calls, ascending in bytes.
  // Where present it replaces min(1, C / working set): a cache's replacement policy decides how
  // much of a cyclic working set a little larger than it survives (LRU: none of it).
  struct Hit {
    double bytes = 0, hit = 0;
  };
  std::vector<Hit> hit_curve;  // JSON: "hit_curve": [{"bytes", "hit"}, ...]
};

// One kind of link a collective may span.
//   time = latency_us + per_step_latency_us * steps + algorithm_bytes / (busbw_efficiency * link
//   GB/s)
struct LinkEfficiency {
  double latency_us = 10;          // fixed cost of launching a collective on this link
  double per_step_latency_us = 1;  // each of the ring's steps (n-1 or 2(n-1))
  double busbw_efficiency = 0.8;   // achieved bus bandwidth / link bandwidth, large messages
};

// A collective's measured cost over groups of `ranks` ranks spanning `nodes` nodes (1: inside
// one node), fitted by `ptdp calibrate` to nccl-tests-style timings:
//   time = latency_us + algorithm_factor(kind, ranks) * bytes / busbw_gbps
// (the algorithm factor of planner/comm_model.cc: 2(n-1)/n for all-reduce, (n-1)/n for
// all-gather and reduce-scatter, 1 for send/recv). Used in preference to the link model.
struct CollectiveFit {
  Collective kind = Collective::kAllReduce;
  int64_t ranks = 2;
  int64_t nodes = 1;
  double latency_us = 0;
  double busbw_gbps = 1;
  // The elements it was timed on (JSON "dtype", absent: fp32). A reduction of 16-bit values is
  // another kernel: MPI sums bf16 with a user-defined op, several times its fp32 time a byte.
  DType dtype = DType::kF32;
};

// "all_reduce", "all_gather", "reduce_scatter", "send_recv": the names the files use.
std::string collective_key(Collective c);

// The memory-bound kernel family an op belongs to, for per-family efficiencies: "norm",
// "softmax", "activation" (GeLU, SwiGLU), "rotary", "embedding", "cross_entropy",
// "elementwise" (bias-dropout-add, gradient accumulation), an MoE layer's "routing" (softmax
// and top-k over the experts) and "permute" (tokens to and from expert order), each with a
// "_backward" twin (a backward kernel is another kernel), and "dropout"; "" for GEMMs and
// collectives. The experts' activations are "activation".
std::string memory_family(OpId id);
// The families a profile's memory_efficiency may name, and "optimizer" (the AdamW step).
const std::vector<std::string>& memory_families();

struct HardwareProfile {
  std::string name = "custom";
  GemmEfficiency gemm;
  double hbm_efficiency = 0.8;            // achieved / datasheet bandwidth for streaming kernels
  double kernel_gap_us = 3;               // idle time between two dependent kernels on a stream
  LinkEfficiency nvlink;                  // collectives whose group stays inside a node
  LinkEfficiency network;                 // collectives whose group spans nodes
  double optimizer_bytes_per_param = 32;  // bytes moved per parameter by a fused AdamW step
  std::vector<std::string> sources;       // where each number comes from

  // Measured by `ptdp calibrate` (absent from presets; see docs/calibration.md).
  std::vector<GemmMeasurement> gemm_table;    // JSON: "gemm": {"table": [...]}
  std::vector<FusedOpMeasurement> fused_ops;  // JSON: "fused_ops": [...]
  // The memory-bound ops of the layer op list as calibrate measured them at the model's shapes
  // (`size` in bytes, warm seconds; `rows` unused). The per-family fit (memory_efficiency and
  // kernel_gap_us) is one line through kernels whose time a byte varies with size (a GELU's
  // transcendentals on a CPU, a kernel's tail on a GPU): an op is priced at the fit times the
  // measured/fit ratio of its own measurements (memory_op_ratio).
  std::vector<FusedOpMeasurement> memory_ops;       // JSON: "memory_ops": [...]
  std::vector<CollectiveFit> collectives;           // per collective and group span
  std::map<std::string, double> memory_efficiency;  // per kernel family, of the HBM bandwidth
  // Host time to issue one op (op_name() -> microseconds), measured by `ptdp calibrate` on a
  // device whose kernels run asynchronously: launches, allocations and the runtime's own work
  // on the host. A pass cannot run faster than the host issues it: where a layer's ops take the
  // host longer than the device, CostModel::exposed_times stretches them to the host's time
  // (docs/calibration.md). Empty: not measured (CPU ranks, whose ops run as they are issued).
  std::map<std::string, double, std::less<>> host_op_us;
  // Element type of activations on this device (fp32 on CPU ranks); 16-bit when not given.
  DType activation_dtype = DType::kBF16;
  // Arrival skew: what a tensor-parallel collective waits for its last rank, as a fraction of
  // the compute since the group's previous collective (the ranks' compute times jitter, and
  // each collective waits for the slowest). 0 when not measured (GPUs in lockstep).
  double arrival_skew = 0;
  CacheModel cache;  // JSON: "cache": {"bytes_per_rank", "memory_cold_factor"}

  // Achieved fraction of peak for a GEMM: with a measured table, a shape in the table gets its
  // measured efficiency and any other shape the curve (gemm.at) times the measured/curve ratio
  // of the nearby entries, interpolated in log2(m, n, k, batch) with a Gaussian weight of one
  // octave and tending to the curve alone two octaves from every entry; without one, gemm.at.
  // Always in (0, 1].
  double gemm_efficiency(double m, double n, double k, double batch = 1) const;
  // The measured time of op `op` (op_name) at `size` FLOPs or bytes, from fused_ops; a negative
  // value when the op has no measurement.
  double fused_op_seconds(std::string_view op, double size, double rows = 0) const;
  // The measured/fitted time of memory-bound op `op` (op_name) at `bytes`, where `fitted(b)` is
  // the fit's time at b bytes: an entry's own ratio where the op was measured at `bytes`, else
  // the ratios of its measurements interpolated in log2(bytes) with a Gaussian weight of one
  // octave, tending to 1 (the fit alone) two octaves from each; 1 where it was not measured.
  double memory_op_ratio(std::string_view op, double bytes,
                         const std::function<double(double)>& fitted) const;
  // The host's time to issue op `op` (op_name) in microseconds: its measurement, else the mean
  // of those measured; 0 without any.
  double host_issue_us(std::string_view op) const;
  // The fit for `kind` over `ranks` ranks on `nodes` nodes timed on `element`s, else the one
  // timed on fp32, else null.
  const CollectiveFit* find_collective(Collective kind, int64_t ranks, int64_t nodes,
                                       DType element) const;
  // The efficiency of a memory-bound family: its measured one, else hbm_efficiency.
  double memory_efficiency_of(const std::string& family) const;
  // Fraction of its operands an op finds in cache when a rank touches `working_set_bytes`
  // between two uses of them: with a measured cache.hit_curve, the curve interpolated linearly
  // in bytes from (0, 1) through its points, made non-increasing, and beyond its last point that
  // point's hit times its bytes / working set; else min(1, cache.bytes_per_rank / working set);
  // 1 without a model. (The curve's bytes are other data streamed; the working set includes the
  // op's own operands, a small part of a stage's.)
  double cache_hit(double working_set_bytes) const;
  // Cold over warm time for a GEMM: the table's cold factors interpolated as gemm_efficiency
  // interpolates efficiencies, tending to their geometric mean away from every entry; for a
  // memory-bound family, its measured factor, else the mean of the measured ones. 1 without.
  double gemm_cold_factor(double m, double n, double k, double batch = 1) const;
  double memory_cold_factor_of(const std::string& family) const;
};

// Reads a profile file, or a machine file's measured profile (`--profile machine.json`).
HardwareProfile profile_from_json(const nlohmann::json& j);
nlohmann::json to_json(const HardwareProfile& p);

}  // namespace ptdp
