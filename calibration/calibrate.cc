#include "calibration/calibrate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <type_traits>

#include "calibration/fit.h"
#include "calibration/machine_info.h"
#include "calibration/measure.h"
#include "core/cluster_spec.h"
#include "core/error.h"
#include "core/hardware_profile.h"
#include "planner/comm_model.h"
#include "runtime/data_plane.h"
#include "runtime/op_executor.h"

namespace ptdp {

using nlohmann::json;

namespace {

// The work of one calibration, fixed before any timing so that progress and the time limit
// know the total.
struct Plan {
  std::vector<std::pair<int64_t, int64_t>> tb;  // (t, b) of the op lists
  // Further sequence lengths at which the fused ops (flash attention) are timed, at tb's first.
  std::vector<int64_t> fused_seqs;
  std::vector<std::array<int64_t, 3>> grid;  // generic GEMMs (m, n, k)
  std::vector<int64_t> stream_sizes;         // floats
  int64_t optimizer_params = 0;
  std::vector<int64_t> groups;  // group sizes of the collectives
  std::vector<double> message_bytes;
  int warmup = 5;
};

// `gpu`: sizes that fill a GPU (its GEMMs need thousands of rows to reach their peak, its
// memory streams hundreds of megabytes), else sizes for CPU cores.
Plan plan_for(const CalibrateOptions& o, int world, int ranks_per_node, bool gpu) {
  Plan p;
  const ModelSpec& m = o.model;
  // A GPU measures b = 4 even when quick: its smaller shapes sit on the launch-latency floor, from
  // which the fits extrapolate badly to the shapes training runs (seconds on a GPU, not minutes).
  std::vector<int64_t> bs =
      o.quick && !gpu ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1, 2, 4};
  for (int64_t t = 1; t <= std::max(1, ranks_per_node); ++t) {
    if (m.num_attention_heads % t != 0 || m.query_groups() % t != 0) continue;
    // MoE layers at t > 1 run sequence parallel, which needs t to divide the sequence.
    if (m.is_moe() && t > 1 && m.seq_length % t != 0) continue;
    for (int64_t b : bs) p.tb.push_back({t, b});
  }
  // A causal attention's time per FLOP moves with the sequence (its longest query tile does s
  // of work): half and twice the model's are timed too, as plans with context parallelism or
  // another sequence length price them.
  if (m.flash_attention)
    for (int64_t seq : {m.seq_length / 2, 2 * m.seq_length})
      if (seq >= 16) p.fused_seqs.push_back(seq);
  const std::vector<int64_t> edge =
      gpu ? (o.quick ? std::vector<int64_t>{512, 4096} : std::vector<int64_t>{256, 1024, 4096})
          : (o.quick ? std::vector<int64_t>{128, 512} : std::vector<int64_t>{64, 256, 1024});
  for (int64_t a : edge)
    for (int64_t b : edge)
      for (int64_t c : edge) p.grid.push_back({a, b, c});
  if (gpu) {
    p.stream_sizes = o.quick ? std::vector<int64_t>{1 << 20, 1 << 25}
                             : std::vector<int64_t>{1 << 18, 1 << 21, 1 << 24, 1 << 26};
    p.optimizer_params =
        1 << 24;  // 16M: smaller, the step's fixed costs inflate the per-parameter rate
  } else {
    p.stream_sizes = o.quick ? std::vector<int64_t>{1 << 16, 1 << 20}
                             : std::vector<int64_t>{1 << 14, 1 << 17, 1 << 20, 1 << 22};
    p.optimizer_params = o.quick ? 1 << 18 : 1 << 21;
  }
  if (!o.group_sizes.empty()) {
    p.groups = o.group_sizes;
  } else {
    for (int g = 2; g <= world; ++g)
      if (world % g == 0) p.groups.push_back(g);
  }
  const double largest = (o.quick ? 4.0 : 64.0) * (1 << 20) * (gpu ? 4.0 : 1.0);
  for (double b = o.quick ? 4096 : 1024; b <= largest; b *= 4) p.message_bytes.push_back(b);
  p.warmup = o.quick ? 2 : 5;
  return p;
}

// The model at another sequence length (with a learned position table as long).
ModelSpec with_sequence(const ModelSpec& m, int64_t seq) {
  ModelSpec out = m;
  out.seq_length = seq;
  out.max_position_embeddings = 0;
  return out;
}

// `cold`: ops are timed cold too; `issue`: and their host issue time (a device backend). As
// calibrate() ticks them: each distinct op, the grid, streams and optimizer, each collective
// of each group (send/recv in pairs only), and per group 2 late-arrival and 13 skew timings.
// What each rank streams between two calls of the cache-hit GEMM, in units of its share of the
// last-level cache (measure_cache_hits).
constexpr double kCacheHitStreams[] = {0.5, 1.0, 1.5, 2.0};

int64_t count_timings(const Plan& p, const ModelSpec& m, bool cold, int64_t issue, DType type) {
  int64_t n = static_cast<int64_t>(p.grid.size() + p.stream_sizes.size()) + 1;
  if (cold) n += 2 + static_cast<int64_t>(std::size(kCacheHitStreams));  // the cache's hits
  for (const auto& [t, b] : p.tb)
    n += static_cast<int64_t>(timed_ops(m, t, b, type).size()) * (1 + cold + issue);
  for (int64_t seq : p.fused_seqs)  // timed warm only, and issued
    n += static_cast<int64_t>(timed_ops(with_sequence(m, seq), p.tb.front().first,
                                        p.tb.front().second, type,
                                        [](const Op& op) { return op.fused; })
                                  .size()) *
         (1 + issue);
  // A 16-bit calibration times all-reduce, all-gather and reduce-scatter on its type as well.
  const int64_t typed = type == DType::kF32 ? 0 : 3;
  const int64_t all_to_all = m.is_moe() ? 1 : 0;  // an MoE layer's dispatch and combine
  for (int64_t g : p.groups)
    n += ((g == 2 ? 4 : 3) + typed + all_to_all) * static_cast<int64_t>(p.message_bytes.size()) +
         2 + 13;
  return n;
}

// Rank-major list of every rank's host name.
std::vector<std::string> hosts_of(ControlPlane& control) {
  const std::string me = host_name();
  std::vector<std::string> out;
  for (const auto& bytes : control.all_gather_bytes(std::vector<uint8_t>(me.begin(), me.end())))
    out.emplace_back(bytes.begin(), bytes.end());
  return out;
}

double gemm_flops(double m, double n, double k, double batch) {
  return 2.0 * m * n * k * batch;
}

// The memory one rank needs to time the op lists of `p`, in bytes: the executor's parameter
// buffer and its gradient, and the largest op's operands, at 4 bytes an element (fp32 master
// values; bf16 runs need less).
double op_memory_bytes(const Plan& p, const ModelSpec& m, DType type) {
  double most = 0;
  for (const auto& [t, b] : p.tb) {
    const double weight =
        static_cast<double>(OpExecutor::parameter_elements(m, op_layout(m, t, b, type)));
    double operands = 0;
    for (const Op& op : executed_ops(m, t, b, type))
      operands =
          std::max(operands, op.kind == OpKind::kGemm
                                 ? 4.0 * static_cast<double>(op.batch) *
                                       static_cast<double>(op.m * op.k + op.m * op.n + op.k * op.n)
                                 : op.bytes);
    most = std::max(most, 2 * 4.0 * weight + operands);
  }
  return most;
}

// Refuses, before any op is timed, a model whose op lists this machine cannot time: their
// operands would not fit in a rank's share of memory (a 405B model's layer on a workstation
// ran out after a minute), or their GEMMs alone, each called at least `calls` times at the
// rate of one GEMM timed here, would overrun --time-limit-s by more than twice.
void check_feasible(const CalibrateOptions& o, const Plan& p, Backend& be, bool gpu,
                    double memory_bytes, int ranks_per_node, int64_t calls, Stopwatch& sw) {
  auto gib = [](double b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f GiB", b / (1024.0 * 1024 * 1024));
    return std::string(buf);
  };
  // Host memory is shared by the node's ranks; a GPU rank has a device of its own.
  const int sharing = gpu ? 1 : std::max(1, ranks_per_node);
  const double need = op_memory_bytes(p, o.model, o.precision);
  const double share = 0.8 * memory_bytes / sharing;
  // Decided alike on every rank (nodes may differ): all stop, or none.
  const double over = sw.control().max(memory_bytes > 0 ? need / share : 0.0);
  if (over > 1)
    throw InputError("--model", "timing " + o.model.name + "'s ops needs about " + gib(need) +
                                    " a rank, more than the " + gib(share) + " a rank has here (" +
                                    std::to_string(sharing) + " rank(s) sharing " +
                                    (gpu ? "a GPU" : "the host") +
                                    "'s); calibrate a smaller model of the same family");
  if (o.time_limit_s <= 0) return;
  const int64_t e = gpu ? 4096 : 256;
  const double rate =
      gemm_flops(static_cast<double>(e), static_cast<double>(e), static_cast<double>(e), 1) /
      time_linear(be, e, e, e, sw, o.precision);
  double flops = 0;
  for (const auto& [t, b] : p.tb)
    for (const Op& op : executed_ops(o.model, t, b, o.precision)) flops += op.flops();
  const double seconds = static_cast<double>(calls) * flops / rate;
  if (seconds > 2 * o.time_limit_s) {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "timing %s's GEMMs needs at least %.0f s (%lld calls each at the %.1f GFLOP/s "
                  "measured here); raise it or calibrate a smaller model",
                  o.model.name.c_str(), seconds, static_cast<long long>(calls), rate / 1e9);
    throw InputError("--time-limit-s", buf);
  }
}

// Cold over warm time per key, the geometric mean over the ops of `kind` timed both ways that
// `key_of` gives a key (std::nullopt: left out), in [1e-3, 1000].
template <class KeyOf>
auto cold_factors(const std::vector<OpSample>& ops, OpKind kind, KeyOf key_of) {
  using Key = typename std::invoke_result_t<KeyOf, const Op&>::value_type;
  std::map<Key, std::pair<double, int>> logs;
  for (const OpSample& s : ops) {
    if (s.op.kind != kind || !(s.cold_seconds > 0) || !(s.seconds > 0)) continue;
    if (const auto key = key_of(s.op)) {
      auto& l = logs[*key];
      l.first += std::log(s.cold_seconds / s.seconds);
      l.second += 1;
    }
  }
  std::map<Key, double> out;
  for (const auto& [key, l] : logs)
    out[key] = std::clamp(std::exp(l.first / l.second), 1e-3, 1000.0);
  return out;
}

}  // namespace

void check_group_sizes(const std::vector<int64_t>& sizes, int ranks) {
  for (int64_t g : sizes) {
    if (g < 2)
      throw InputError("--group-sizes",
                       "a collective's group has at least 2 ranks, got " + std::to_string(g));
    if (g > ranks)
      throw InputError("--group-sizes",
                       "a group of " + std::to_string(g) + " ranks needs " + std::to_string(g) +
                           " ranks, but this calibration has " + std::to_string(ranks) +
                           " (mpirun -np " + std::to_string(g) + " ptdp calibrate ...)");
    if (ranks % g != 0)
      throw InputError("--group-sizes", std::to_string(g) + " does not divide the " +
                                            std::to_string(ranks) + " ranks");
  }
}

json calibrate(const CalibrateOptions& o, Communicator& world, ControlPlane& control) {
  o.model.validate();
  check_group_sizes(o.group_sizes, world.size());
  // An unknown backend, or cuda without a GPU: InputError naming --backend.
  auto backend = make_backend(o.backend);
  Backend& be = *backend;
  const DeviceInfo device = be.device_info();
  const bool gpu = !device.name.empty();
  // A GPU's collectives run on its data plane: NCCL where each rank has a GPU of its own.
  DataPlane plane;
  if (!be.host_accessible()) plane = make_device_data_plane(world, control, be);
  Communicator& data = plane.world ? *plane.world : world;
  const int n_world = world.size();
  const std::vector<std::string> hosts = hosts_of(control);
  const std::set<std::string> distinct(hosts.begin(), hosts.end());
  const int ranks_per_node =
      static_cast<int>(std::count(hosts.begin(), hosts.end(), hosts.front()));
  const Plan plan = plan_for(o, n_world, ranks_per_node, gpu);

  double target = o.quick ? 0.05 : 0.15;
  // Ops are timed warm and, where the last-level cache is known, cold (docs/calibration.md).
  // On a GPU that is its L2 cache.
  const double llc_bytes = gpu ? device.cache_bytes : last_level_cache_bytes();
  std::unique_ptr<CacheEvictor> evict;
  // A GPU's L2 by a kernel reading device memory; the host's caches (cpu-staged's too, whose
  // "device" is the CPU) by reading host memory a line at a time.
  if (llc_bytes > 0) evict = std::make_unique<CacheEvictor>(llc_bytes, gpu ? &be : nullptr);
  const int64_t issue = be.host_accessible() ? 0 : 1;  // a device's ops are also timed issued
  const int64_t timings = count_timings(plan, o.model, evict != nullptr, issue, o.precision);
  // Each timing runs about twice its target (the warm-up and the sizing call around it).
  if (o.time_limit_s > 0)
    target = std::min(target, 0.5 * o.time_limit_s / static_cast<double>(timings));
  Stopwatch sw(control, target);
  // A timing calls its op at least 7 times (warm-up, sizing, 5 chunks), cold as often again.
  check_feasible(o, plan, be, gpu, gpu ? device.memory_bytes : host_memory_bytes(), ranks_per_node,
                 7 * (1 + (evict != nullptr)), sw);
  const bool root = world.rank() == 0;
  double done = 0;
  auto tick = [&](const std::string& what, double timed = 1) {  // `timed` timings done
    done += timed;
    if (root && o.progress) o.progress(std::min(1.0, done / static_cast<double>(timings)), what);
  };

  // ---- compute: the op lists' kernels, a generic GEMM grid, bandwidth, optimizer ----
  std::vector<OpSample> ops = measure_ops(
      be, o.model, plan.tb, sw, evict.get(),
      // Called once an op is timed warm and once more cold: its timings, counted by
      // count_timings as 1 + cold + issue, spread over the calls.
      [&](int, int) {
        tick("kernels of the op list",
             static_cast<double>(1 + (evict != nullptr) + issue) / (evict != nullptr ? 2 : 1));
      },
      o.precision);
  // How much of a working set a little larger than the cache survives a step's streaming.
  CacheHits cache_hits;
  if (evict) {
    // A GPU's L2 is its own; a node's ranks share its CPUs' last-level cache.
    const double per_rank = gpu ? llc_bytes : llc_bytes / ranks_per_node;
    std::vector<double> streams;
    for (double f : kCacheHitStreams) streams.push_back(f * per_rank);
    cache_hits = measure_cache_hits(be, o.model, plan.tb.front().first, plan.tb.front().second, sw,
                                    *evict, streams, o.precision);
    tick("the cache's hits", 2 + static_cast<double>(streams.size()));
  }
  for (int64_t seq : plan.fused_seqs) {
    for (OpSample& s : measure_ops(
             be, with_sequence(o.model, seq), {plan.tb.front()}, sw, nullptr,
             [&](int, int) {
               tick("fused attention at sequence " + std::to_string(seq), 1 + issue);
             },
             o.precision, [](const Op& op) { return op.fused; }))
      ops.push_back(std::move(s));
  }
  std::vector<std::pair<std::array<int64_t, 3>, double>> grid;
  for (const auto& g : plan.grid) {
    grid.push_back({g, time_linear(be, g[0], g[1], g[2], sw, o.precision)});
    tick("GEMM grid");
  }
  double bandwidth = 0;  // bytes/s of the largest stream
  json stream = json::array();
  for (int64_t n : plan.stream_sizes) {
    const double bw = stream_bandwidth(be, n, sw);
    stream.push_back({{"floats", n}, {"bytes_per_s", bw}});
    bandwidth = bw;
    tick("memory bandwidth");
  }
  const double optimizer_s = time_optimizer(be, plan.optimizer_params, sw, o.precision);
  tick("optimizer");

  // ---- collectives over each group size, all groups at once ----
  std::vector<CommSample> comm;
  for (int64_t g : plan.groups) {
    const int color = world.rank() / static_cast<int>(g);
    auto group = data.split(color, world.rank(), "calibrate/" + std::to_string(g));
    std::set<std::string> group_hosts;
    for (int r = color * static_cast<int>(g); r < (color + 1) * static_cast<int>(g); ++r)
      group_hosts.insert(hosts[static_cast<size_t>(r)]);
    // Spans may differ between groups on uneven hosts: the most nodes any group spans.
    const int64_t nodes =
        static_cast<int64_t>(control.max(static_cast<int64_t>(group_hosts.size())));
    // fp32 (gradients, and everything of an fp32 run), and a 16-bit run's activations and
    // weights in their own type: a reduction sums them with another kernel. A send moves bytes.
    std::vector<DType> types{DType::kF32};
    if (o.precision != DType::kF32) types.push_back(o.precision);
    for (DType type : types) {
      for (Collective kind :
           {Collective::kAllReduce, Collective::kAllGather, Collective::kReduceScatter,
            Collective::kSendRecv, Collective::kAllToAll}) {
        if (kind == Collective::kSendRecv && (g != 2 || type != DType::kF32)) continue;
        // An MoE model's all-to-all, once: it moves bytes (a bf16 model's routed rows are bf16).
        if (kind == Collective::kAllToAll && (!o.model.is_moe() || type != DType::kF32)) continue;
        for (double bytes : plan.message_bytes) {
          CommSample s;
          s.kind = kind;
          s.ranks = g;
          s.nodes = nodes;
          s.dtype = type;
          // Whole elements, divisible by the group (nccl-tests rounds the same way).
          const double unit = static_cast<double>(dtype_bytes(type) * g);
          s.bytes = std::floor(bytes / unit) * unit;
          s.seconds = time_collective(kind, *group, s.bytes, sw, plan.warmup, type);
          s.algbw_gbps = s.bytes / s.seconds / 1e9;
          s.busbw_gbps = s.algbw_gbps * collective_algorithm_factor(kind, g);
          comm.push_back(s);
          tick(to_string(kind) + (type == DType::kF32 ? "" : " (" + to_string(type) + ")") +
               " over " + std::to_string(g) + " ranks");
        }
      }
    }
  }

  // The all-reduce of a tensor-parallel layer's output (T h fp32 values, b = 1) when one rank
  // arrives 1 ms late, against the same all-reduce in lockstep: what waiting costs in a run.
  json late = json::array();
  for (int64_t g : plan.groups) {
    auto group = data.split(world.rank() / static_cast<int>(g), world.rank(),
                            "calibrate/late/" + std::to_string(g));
    const double bytes = 4.0 * static_cast<double>(o.model.seq_length * o.model.hidden_size);
    const double lockstep = time_collective(Collective::kAllReduce, *group, bytes, sw, plan.warmup);
    const double after =
        time_collective_late(Collective::kAllReduce, *group, bytes, 1e-3, sw, plan.warmup);
    late.push_back({{"collective", "all_reduce"},
                    {"ranks", g},
                    {"bytes", bytes},
                    {"late_by_s", 1e-3},
                    {"lockstep_s", lockstep},
                    {"after_last_arrival_s", after}});
    done += 1;
    tick("late arrival over " + std::to_string(g) + " ranks");
  }

  // Arrival skew: a layer's GEMM then the all-reduce of its output, as tensor-parallel ranks
  // alternate them; what the pair takes beyond its parts is the wait for the slowest rank.
  json skew = json::array();
  double arrival_skew = 0;
  for (int64_t g : plan.groups) {
    if (g < 2) continue;
    auto group = data.split(world.rank() / static_cast<int>(g), world.rank(),
                            "calibrate/skew/" + std::to_string(g));
    // Jitter averages out slowly: four times the usual time for these three timings.
    Stopwatch long_sw(control, 4 * target);
    const SkewSample s = time_arrival_skew(be, *group, o.model, long_sw, plan.warmup);
    skew.push_back({{"ranks", s.ranks},
                    {"compute_s", s.compute_s},
                    {"all_reduce_s", s.all_reduce_s},
                    {"pair_s", s.pair_s},
                    {"skew", s.skew},
                    {"in_all_reduce_s", s.in_all_reduce_s}});
    arrival_skew = std::max(arrival_skew, s.skew);  // the widest group's (the most ranks wait)
    done += 12;
    tick("arrival skew over " + std::to_string(g) + " ranks");
  }

  // ---- fits ----
  // Memory-bound kernels: one per-kernel gap, one throughput per family.
  const std::vector<std::string>& families = memory_families();
  std::vector<int> fam;
  std::vector<double> mbytes, msec;
  for (const OpSample& s : ops) {
    if (s.op.kind != OpKind::kMemory || s.op.bytes <= 0 || s.op.fused) continue;
    const std::string f = memory_family(s.op.id);
    const auto it = std::find(families.begin(), families.end(), f);
    if (it == families.end()) continue;
    fam.push_back(static_cast<int>(it - families.begin()));
    mbytes.push_back(s.op.bytes);
    msec.push_back(s.seconds);
  }
  HardwareProfile prof;
  prof.name =
      "measured-" + o.backend + (o.precision == DType::kF32 ? "" : "-" + to_string(o.precision));
  prof.activation_dtype = o.precision;
  json fits;
  double gap_s = 0;
  if (!msec.empty()) {
    const MemoryFit mf = fit_memory_kernels(fam, mbytes, msec, static_cast<int>(families.size()));
    gap_s = mf.gap_s;
    json fj;
    fj["kernel_gap_us"] = gap_s * 1e6;
    fj["all"] = to_json(mf.all);
    for (size_t f = 0; f < families.size(); ++f) {
      if (mf.residuals[f].points == 0) continue;
      const double spb = mf.seconds_per_byte[f];
      const double eff = spb > 0 ? std::min(1000.0, 1.0 / (spb * bandwidth)) : 1000.0;
      prof.memory_efficiency[families[f]] = eff;
      fj["families"][families[f]] = {{"efficiency", eff},
                                     {"bytes_per_s", eff * bandwidth},
                                     {"residuals", to_json(mf.residuals[f])}};
    }
    fits["memory"] = fj;
  }
  prof.kernel_gap_us = gap_s * 1e6;
  prof.hbm_efficiency = 1.0;  // the cluster's bandwidth is itself measured
  // Optimizer: the per-parameter kernels' bytes at their measured rate.
  prof.optimizer_bytes_per_param = kOptimizerBytesPerParam;
  {
    const double bytes = kOptimizerBytesPerParam * static_cast<double>(plan.optimizer_params);
    const double eff =
        std::clamp(bytes / (bandwidth * std::max(optimizer_s - gap_s, 1e-9)), 1e-6, 1000.0);
    prof.memory_efficiency["optimizer"] = eff;
    fits["optimizer"] = {{"parameters", plan.optimizer_params},
                         {"seconds", optimizer_s},
                         {"bytes_per_param", kOptimizerBytesPerParam},
                         {"efficiency", eff}};
  }
  // GEMMs: the peak is the fastest measured; the table holds each op-list shape's efficiency
  // (net of the per-kernel gap the cost model adds); the curve is fitted to table and grid.
  struct G {
    double m, n, k, batch, seconds;
  };
  std::vector<G> gemms;
  for (const OpSample& s : ops)
    if (s.op.kind == OpKind::kGemm && !s.op.fused)
      gemms.push_back({static_cast<double>(s.op.m), static_cast<double>(s.op.n),
                       static_cast<double>(s.op.k), static_cast<double>(s.op.batch), s.seconds});
  for (const auto& [g, sec] : grid)
    gemms.push_back({static_cast<double>(g[0]), static_cast<double>(g[1]),
                     static_cast<double>(g[2]), 1.0, sec});
  double peak = 0;  // FLOP/s
  for (const G& g : gemms)
    peak = std::max(peak, gemm_flops(g.m, g.n, g.k, g.batch) / std::max(g.seconds - gap_s, 1e-9));
  std::vector<GemmSample> samples;
  std::map<std::array<int64_t, 4>, std::pair<double, int>> table;  // sum of log eff, count
  for (size_t i = 0; i < gemms.size(); ++i) {
    const G& g = gemms[i];
    const double eff = std::clamp(
        gemm_flops(g.m, g.n, g.k, g.batch) / (peak * std::max(g.seconds - gap_s, 1e-9)), 1e-9, 1.0);
    samples.push_back({g.m, g.n, g.k, g.batch, eff});
    const std::array<int64_t, 4> key = {static_cast<int64_t>(g.m), static_cast<int64_t>(g.n),
                                        static_cast<int64_t>(g.k), static_cast<int64_t>(g.batch)};
    auto& e = table[key];
    e.first += std::log(eff);
    e.second += 1;
  }
  if (!samples.empty()) {
    const GemmCurveFit gf = fit_gemm_curve(samples);
    prof.gemm.max_efficiency = std::min(1.0, gf.max_efficiency);
    prof.gemm.m_half = gf.m_half;
    prof.gemm.n_half = gf.n_half;
    prof.gemm.k_half = gf.k_half;
    prof.gemm.sm_count = 0;
    // Cold over warm per shape, where measured (the op-list GEMMs; the grid is timed warm).
    const auto cold = cold_factors(ops, OpKind::kGemm, [](const Op& op) {
      using Key = std::optional<std::array<int64_t, 4>>;
      return op.fused ? Key() : Key({op.m, op.n, op.k, op.batch});
    });
    for (const auto& [key, e] : table) {
      GemmMeasurement g{key[0], key[1], key[2], key[3],
                        std::clamp(std::exp(e.first / e.second), 1e-9, 1.0)};
      if (auto c = cold.find(key); c != cold.end()) g.cold_factor = c->second;
      prof.gemm_table.push_back(g);
    }
    fits["gemm"] = {{"peak_flops_per_s", peak},
                    {"max_efficiency", gf.max_efficiency},
                    {"m_half", gf.m_half},
                    {"n_half", gf.n_half},
                    {"k_half", gf.k_half},
                    {"table_entries", prof.gemm_table.size()},
                    {"residuals", to_json(gf.residuals)}};
  }
  // Fused kernels (a flash attention's core): each op's own time, as measured; the kernel runs
  // on one op of the group (CostModel prices these from the table, HardwareProfile::fused_ops).
  for (const OpSample& s : ops) {
    if (!s.op.fused) continue;
    const double size = s.op.kind == OpKind::kGemm ? s.op.flops() : s.op.bytes;
    if (size > 0)
      prof.fused_ops.push_back({std::string(s.op.name()), size, s.seconds,
                                s.op.kind == OpKind::kGemm ? static_cast<double>(s.op.m) : 0.0});
  }
  if (!prof.fused_ops.empty()) fits["fused_ops"] = prof.fused_ops.size();
  // Memory-bound ops (what the family fit prices): each op and size as measured, the geometric
  // mean where layouts repeat one (HardwareProfile::memory_ops).
  {
    std::map<std::pair<std::string, double>, std::pair<double, int>> measured;  // log s, count
    for (const OpSample& s : ops) {
      if (s.op.kind != OpKind::kMemory || s.op.bytes <= 0 || s.op.fused || !(s.seconds > 0))
        continue;
      auto& e = measured[{std::string(s.op.name()), s.op.bytes}];
      e.first += std::log(s.seconds);
      e.second += 1;
    }
    for (const auto& [key, e] : measured)
      prof.memory_ops.push_back({key.first, key.second, std::exp(e.first / e.second)});
    if (!prof.memory_ops.empty()) fits["memory_ops"] = prof.memory_ops.size();
  }
  // The host's issue time per op (a device's asynchronous kernels): the mean over the layouts
  // measured, in microseconds (CostModel::stretch_to_host).
  {
    std::map<std::string, std::pair<double, int>> host;
    for (const OpSample& s : ops) {
      if (!(s.host_seconds > 0)) continue;
      auto& h = host[std::string(s.op.name())];
      h.first += s.host_seconds * 1e6;
      h.second += 1;
    }
    for (const auto& [name, h] : host) prof.host_op_us[name] = h.first / h.second;
    if (!host.empty()) {
      double mean = 0;
      for (const auto& [name, us] : prof.host_op_us) mean += us;
      fits["host_op_us_mean"] = mean / static_cast<double>(prof.host_op_us.size());
    }
  }
  // The cache model: the node's last-level cache shared by its ranks, and cold over warm per
  // memory-bound family (GEMMs: per table entry, above).
  if (evict) {
    prof.cache.bytes_per_rank = gpu ? llc_bytes : llc_bytes / ranks_per_node;
    prof.cache.memory_cold_factor = cold_factors(ops, OpKind::kMemory, [](const Op& op) {
      std::string f = op.fused ? std::string() : memory_family(op.id);
      return f.empty() ? std::nullopt : std::optional<std::string>(std::move(f));
    });
    double gemm_log = 0;
    int gemm_measured = 0;
    for (const GemmMeasurement& g : prof.gemm_table)
      if (g.cold_factor > 0) gemm_log += std::log(g.cold_factor), ++gemm_measured;
    // The hit curve where the GEMM's cold time is measurably above its warm one (else the
    // cache model's C / working set).
    if (cache_hits.cold_seconds > 1.02 * cache_hits.warm_seconds)
      for (const CacheHitSample& h : cache_hits.samples)
        prof.cache.hit_curve.push_back({h.bytes, h.hit});
    fits["cache"] = {{"last_level_cache_bytes", llc_bytes},
                     {"bytes_per_rank", prof.cache.bytes_per_rank},
                     {"gemm_cold_factor_mean", std::exp(gemm_log / std::max(gemm_measured, 1))},
                     {"memory_cold_factor", prof.cache.memory_cold_factor}};
    if (!prof.cache.hit_curve.empty()) {
      json& curve = fits["cache"]["hit_curve"] = json::array();
      for (const CacheModel::Hit& h : prof.cache.hit_curve)
        curve.push_back({{"bytes", h.bytes}, {"hit", h.hit}});
    }
  }
  // Collectives: latency and bus bandwidth per (collective, group size, nodes).
  std::map<std::tuple<int, int64_t, int64_t, int>,
           std::pair<std::vector<double>, std::vector<double>>>
      series;
  for (const CommSample& s : comm) {
    auto& xy = series[{static_cast<int>(s.kind), s.ranks, s.nodes, static_cast<int>(s.dtype)}];
    xy.first.push_back(collective_algorithm_factor(s.kind, s.ranks) * s.bytes);
    xy.second.push_back(s.seconds);
  }
  fits["collectives"] = json::array();
  double intra_busbw = 0, inter_busbw = 0, intra_latency_us = -1;
  for (const auto& [key, xy] : series) {
    const LinearFit lf = fit_latency_bandwidth(xy.first, xy.second);
    CollectiveFit c;
    c.kind = static_cast<Collective>(std::get<0>(key));
    c.ranks = std::get<1>(key);
    c.nodes = std::get<2>(key);
    c.dtype = static_cast<DType>(std::get<3>(key));
    c.latency_us = lf.latency_s * 1e6;
    c.busbw_gbps = std::min(1e8, 1.0 / lf.seconds_per_unit / 1e9);
    prof.collectives.push_back(c);
    if (c.dtype == DType::kF32) {  // the link model's figures: fp32, as nccl-tests measure
      (c.nodes > 1 ? inter_busbw : intra_busbw) =
          std::max(c.nodes > 1 ? inter_busbw : intra_busbw, c.busbw_gbps);
      if (c.nodes == 1 && c.kind == Collective::kAllReduce && intra_latency_us < 0)
        intra_latency_us = c.latency_us;
    }
    fits["collectives"].push_back({{"collective", collective_key(c.kind)},
                                   {"ranks", c.ranks},
                                   {"nodes", c.nodes},
                                   {"dtype", to_string(c.dtype)},
                                   {"latency_us", c.latency_us},
                                   {"busbw_gbps", c.busbw_gbps},
                                   {"residuals", to_json(lf.residuals)}});
  }
  prof.arrival_skew = std::min(arrival_skew, 10.0);
  prof.nvlink.latency_us = std::max(0.0, intra_latency_us);
  prof.nvlink.per_step_latency_us = 0;
  prof.nvlink.busbw_efficiency = 1;
  prof.network = prof.nvlink;
  prof.sources = {
      "ptdp calibrate --backend " + o.backend + " on " + host_name() + ", " + utc_now() +
          " (docs/calibration.md)",
      "gemm: curve fitted by least squares to the measured table and grid; table: each op-list "
      "GEMM's measured efficiency",
      "kernel_gap_us, memory_efficiency: one least-squares fit of every memory-bound kernel; "
      "memory_ops: each memory-bound op as measured (priced at the fit times their ratio)",
      gpu ? "cache: the GPU's L2 cache (cudaDeviceProp::l2CacheSize); cold factors: each op "
            "timed after writing twice the L2 over the same op timed warm"
          : "cache: the last-level cache of /sys/devices/system/cpu over the node's ranks; cold "
            "factors: each op timed with the caches evicted over the same op timed warm",
      "collectives: latency and bus bandwidth fitted per collective and group span"};

  // ---- the cluster measured ----
  ClusterSpec cl;
  cl.name = "measured-" + o.backend;
  const double mem = host_memory_bytes();
  if (gpu) {  // ranks sharing a GPU share its memory
    const std::vector<std::string> gpus = gpu_of_each_rank(control, be);
    const int sharing = static_cast<int>(
        std::count(gpus.begin(), gpus.end(), gpus[static_cast<size_t>(world.rank())]));
    cl.gpu.name = device.name;
    cl.gpu.memory_gib = device.memory_bytes / sharing / (1024.0 * 1024 * 1024);
  } else {
    cl.gpu.name = cpu_model_name() + " (1 of " + std::to_string(ranks_per_node) + " ranks)";
    cl.gpu.memory_gib = std::max(mem, 1.0 * (1 << 30)) / ranks_per_node / (1024.0 * 1024 * 1024);
  }
  // The backend computes in fp32: its measured peak stands where a profile keeps the 16-bit one.
  cl.gpu.peak_tflops_16bit = std::max(peak, 1.0) / 1e12;
  cl.gpu.hbm_bandwidth_gbps = std::max(bandwidth, 1.0) / 1e9;
  cl.gpus_per_node = ranks_per_node;
  cl.num_nodes = static_cast<int64_t>(distinct.size());
  if (cl.num_nodes * cl.gpus_per_node != n_world)
    cl.num_nodes = (n_world + ranks_per_node - 1) / ranks_per_node;
  cl.nvlink_bandwidth_gbps = intra_busbw > 0 ? intra_busbw : cl.gpu.hbm_bandwidth_gbps;
  cl.nvlink_latency_us = 0;  // in the fits' latencies
  cl.nics_per_node = 1;
  cl.nic_bandwidth_gbps = inter_busbw > 0 ? inter_busbw : cl.nvlink_bandwidth_gbps;
  cl.nic_latency_us = 0;
  cl.validate();

  // ---- the file ----
  json measured;
  measured["ops"] = json::array();
  for (const OpSample& s : ops) {
    json j = {{"op", std::string(s.op.name())},
              {"role", to_string(s.op.role)},
              {"t", s.t},
              {"micro_batch", s.b},
              {"seconds", s.seconds}};
    if (s.cold_seconds > 0) j["cold_seconds"] = s.cold_seconds;
    if (s.host_seconds > 0) j["host_seconds"] = s.host_seconds;
    if (s.op.fused) j["fused"] = true;
    if (s.op.kind == OpKind::kGemm) {
      j["m"] = s.op.m, j["n"] = s.op.n, j["k"] = s.op.k, j["batch"] = s.op.batch;
      j["flops_per_s"] = s.op.flops() / s.seconds;
    } else {
      j["bytes"] = s.op.bytes;
      j["family"] = memory_family(s.op.id);
    }
    measured["ops"].push_back(j);
  }
  measured["gemm_grid"] = json::array();
  for (const auto& [g, sec] : grid)
    measured["gemm_grid"].push_back({{"m", g[0]},
                                     {"n", g[1]},
                                     {"k", g[2]},
                                     {"seconds", sec},
                                     {"flops_per_s", gemm_flops(g[0], g[1], g[2], 1) / sec}});
  measured["stream"] = stream;
  if (!cache_hits.samples.empty()) {
    json& h = measured["cache_hits"];
    h = {{"op", cache_hits.op.name()},
         {"m", cache_hits.op.m},
         {"n", cache_hits.op.n},
         {"k", cache_hits.op.k},
         {"warm_seconds", cache_hits.warm_seconds},
         {"cold_seconds", cache_hits.cold_seconds},
         {"streams", json::array()}};
    for (const CacheHitSample& s : cache_hits.samples)
      h["streams"].push_back({{"bytes", s.bytes}, {"seconds", s.seconds}, {"hit", s.hit}});
  }
  measured["late_arrival"] = late;
  measured["arrival_skew"] = skew;
  measured["collectives"] = json::array();
  for (const CommSample& s : comm)
    measured["collectives"].push_back({{"collective", collective_key(s.kind)},
                                       {"ranks", s.ranks},
                                       {"nodes", s.nodes},
                                       {"dtype", to_string(s.dtype)},
                                       {"bytes", s.bytes},
                                       {"seconds", s.seconds},
                                       {"algbw_gbps", s.algbw_gbps},
                                       {"busbw_gbps", s.busbw_gbps}});
  json machine = {{"device", gpu ? device.name : cpu_model_name()},
                  {"backend", backend_label(o.backend)},
                  {"activations", to_string(o.precision)},
                  {"ranks", n_world},
                  {"nodes", cl.num_nodes},
                  {"ranks_per_node", ranks_per_node},
                  {"hosts", json(std::vector<std::string>(distinct.begin(), distinct.end()))},
                  {"host_memory_bytes", mem},
                  {"eigen", eigen_version()},
                  {"mpi", mpi_library_version()},
                  {"date", utc_now()},
                  {"command", o.command},
                  {"quick", o.quick},
                  {"timing_target_s", target},
                  {"cpu_share", control.sum(sw.cpu_share()) / n_world},
                  {"model", to_json(o.model)}};
  if (gpu) {
    machine["cpu"] = cpu_model_name();
    machine["device_memory_bytes"] = device.memory_bytes;
    machine["device_l2_bytes"] = device.cache_bytes;
    machine["multiprocessors"] = device.multiprocessors;
    machine["cuda_driver"] = device.driver;
    machine["cuda_runtime"] = device.runtime;
    machine["data_plane"] = plane.kind;
  }
  return json{{"format", kMachineFileFormat}, {"machine", machine}, {"cluster", to_json(cl)},
              {"profile", to_json(prof)},     {"fits", fits},       {"measurements", measured}};
}

void print_calibration(std::ostream& out, const json& f) {
  char buf[400];
  const json& m = f["machine"];
  const json& c = f["cluster"];
  const json& fits = f["fits"];
  out << "machine: " << m["device"].get<std::string>() << ", " << m["ranks"].get<int64_t>()
      << " ranks (" << m["ranks_per_node"].get<int64_t>() << " per node), Eigen "
      << m["eigen"].get<std::string>() << ", MPI " << m["mpi"].get<std::string>() << "\n";
  std::snprintf(buf, sizeof buf,
                "each rank had %.0f%% of a CPU while timed (CPU time / wall time)\n",
                100 * m["cpu_share"].get<double>());
  out << buf;
  std::snprintf(buf, sizeof buf,
                "per rank: peak GEMM %.1f GFLOP/s, memory bandwidth %.2f GB/s, %.1f GiB\n",
                c["gpu"]["peak_tflops_16bit"].get<double>() * 1e3,
                c["gpu"]["hbm_bandwidth_gbps"].get<double>(), c["gpu"]["memory_gib"].get<double>());
  out << buf;
  auto res = [](const json& r) {
    char b[120];
    std::snprintf(b, sizeof b, "residuals rms %.1f%%, max %.1f%% over %lld points",
                  100 * r["rms_relative"].get<double>(), 100 * r["max_relative"].get<double>(),
                  static_cast<long long>(r["points"].get<int64_t>()));
    return std::string(b);
  };
  if (fits.contains("gemm")) {
    const json& g = fits["gemm"];
    std::snprintf(buf, sizeof buf,
                  "GEMM curve: max_efficiency %.3f, m_half %.1f, n_half %.1f, k_half %.1f; ",
                  g["max_efficiency"].get<double>(), g["m_half"].get<double>(),
                  g["n_half"].get<double>(), g["k_half"].get<double>());
    out << buf << res(g["residuals"]) << "; table of " << g["table_entries"].get<int64_t>()
        << " shapes\n";
  }
  if (fits.contains("memory")) {
    const json& mm = fits["memory"];
    std::snprintf(buf, sizeof buf,
                  "kernel gap %.2f us; memory-bound kernels: ", mm["kernel_gap_us"].get<double>());
    out << buf << res(mm["all"]) << "\n";
    bool above = false, idle = false;
    for (const auto& [name, fam] : mm["families"].items()) {
      const double eff = fam["efficiency"].get<double>();
      above = above || (eff > 1 && eff < 1000);
      idle = idle || eff >= 1000;
      std::snprintf(buf, sizeof buf, "  %-14s efficiency %8.3f (%7.2f GB/s); ", name.c_str(), eff,
                    fam["bytes_per_s"].get<double>() / 1e9);
      out << buf << res(fam["residuals"]) << "\n";
    }
    out << "  (efficiency: bytes moved against the measured memory bandwidth"
        << (above ? "; above 1, the kernel's data stayed in cache at the sizes timed" : "")
        << (idle ? "; 1000, no time beyond the kernel gap: the op does no work here" : "") << ")\n";
  }
  if (fits.contains("optimizer")) {
    std::snprintf(buf, sizeof buf,
                  "optimizer: %.2f ns per parameter (%g bytes at efficiency %.3f)\n",
                  fits["optimizer"]["seconds"].get<double>() /
                      fits["optimizer"]["parameters"].get<double>() * 1e9,
                  fits["optimizer"]["bytes_per_param"].get<double>(),
                  fits["optimizer"]["efficiency"].get<double>());
    out << buf;
  }
  if (f["measurements"].contains("late_arrival"))
    for (const json& l : f["measurements"]["late_arrival"]) {
      std::snprintf(buf, sizeof buf,
                    "all_reduce %3lld ranks, %.0f bytes: %.1f us in lockstep, %.1f us after the "
                    "last of ranks 1 ms apart arrives (not priced)\n",
                    static_cast<long long>(l["ranks"].get<int64_t>()), l["bytes"].get<double>(),
                    1e6 * l["lockstep_s"].get<double>(),
                    1e6 * l["after_last_arrival_s"].get<double>());
      out << buf;
    }
  if (f["measurements"].contains("arrival_skew"))
    for (const json& s : f["measurements"]["arrival_skew"]) {
      std::snprintf(buf, sizeof buf,
                    "arrival skew %3lld ranks: GEMM %.1f us then all_reduce (%.1f us in "
                    "lockstep) took %.1f us in the all_reduce: %.1f%% of the compute waited for "
                    "the last rank\n",
                    static_cast<long long>(s["ranks"].get<int64_t>()),
                    1e6 * s["compute_s"].get<double>(), 1e6 * s["all_reduce_s"].get<double>(),
                    1e6 * s.value("in_all_reduce_s", 0.0), 100 * s["skew"].get<double>());
      out << buf;
    }
  for (const json& cf : fits["collectives"]) {
    const std::string type = cf.value("dtype", "fp32");
    const std::string name =
        cf["collective"].get<std::string>() + (type == "fp32" ? "" : " " + type);
    std::snprintf(buf, sizeof buf,
                  "%-19s %3lld ranks %2lld nodes: latency %8.2f us, busbw %8.3f GB/s; ",
                  name.c_str(), static_cast<long long>(cf["ranks"].get<int64_t>()),
                  static_cast<long long>(cf["nodes"].get<int64_t>()),
                  cf["latency_us"].get<double>(), cf["busbw_gbps"].get<double>());
    out << buf << res(cf["residuals"]) << "\n";
  }
  if (fits["collectives"].empty())
    out << "collectives: none measured (one rank); a plan that communicates is priced with "
           "estimated links, and reconcile refuses its runs: mpirun -np N ptdp calibrate\n";
}

}  // namespace ptdp
