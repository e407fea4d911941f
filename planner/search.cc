#include "planner/search.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <tuple>

#include "core/error.h"
#include "core/plan_rules.h"

namespace ptdp {
namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 1; i * i <= n; ++i) {
    if (n % i == 0) {
      out.push_back(i);
      if (i != n / i) out.push_back(n / i);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A total order on configurations, used to break ties in predicted time.
auto plan_key(const ParallelPlan& p) {
  return std::make_tuple(p.tensor_parallel, p.context_parallel, p.pipeline_parallel,
                         p.micro_batch_size, p.expert_parallel, p.expert_tensor_parallel,
                         p.virtual_stages, p.microbatch_group, static_cast<int>(p.recompute),
                         p.recompute_layers, p.sequence_parallel, p.distributed_optimizer,
                         p.optimizer_instances, static_cast<int>(p.fsdp),
                         static_cast<int>(p.fsdp_outer), p.layers_per_stage, p.layers_per_chunk);
}

bool better(const RankedPlan& a, const RankedPlan& b) {
  if (a.prediction.iteration_time_s != b.prediction.iteration_time_s) {
    return a.prediction.iteration_time_s < b.prediction.iteration_time_s;
  }
  return plan_key(a.plan) < plan_key(b.plan);
}

// One unit of work: a (t, p, d, b) and a layer split to expand over v, recompute, SP and the
// optimizer.
struct Cell {
  int64_t t, cp, p, d, b, ep, etp;  // etp 0: t
  std::vector<int64_t> split;       // empty: the even split
  // Also the interleaved layouts that count the embedding and the loss as layers (one per
  // (t, cp, p, d, b, ep, etp): set on the cell of the first split).
  bool chunk_layouts = false;
};

struct Tally {
  std::vector<RankedPlan> top;
  std::map<std::string, int64_t> rejected;
  int64_t evaluated = 0, considered = 0;

  void keep(RankedPlan r, size_t k) {
    if (top.size() == k && !better(r, top.back())) return;
    top.insert(std::upper_bound(top.begin(), top.end(), r, better), std::move(r));
    if (top.size() > k) top.pop_back();
  }
  void merge(Tally&& o, size_t k) {
    for (auto& r : o.top) keep(std::move(r), k);
    for (const auto& [why, n] : o.rejected) rejected[why] += n;
    evaluated += o.evaluated;
    considered += o.considered;
  }
};

// Block recompute for a fitting full-recompute plan: the smallest N (layers recomputed per
// model chunk) that still fits, found by bisection (memory falls as N grows; N at the largest
// chunk is the full plan). Nothing when the plan fits without recomputation.
void try_block_recompute(const ParallelPlan& full, const ModelSpec& m, const CostModel& cost,
                         Tally& tally, size_t k) {
  const int64_t most = full.most_layers_in_a_chunk(m);
  if (most < 2) return;
  ParallelPlan block = full;
  block.recompute = Recompute::kNone;
  if (cost.memory(block).fits) return;
  block.recompute = Recompute::kFull;
  int64_t lo = 1, hi = most;
  while (lo < hi) {
    block.recompute_layers = lo + (hi - lo) / 2;
    if (cost.memory(block).fits)
      hi = block.recompute_layers;
    else
      lo = block.recompute_layers + 1;
  }
  if (lo == most) return;
  block.recompute_layers = lo;
  ++tally.considered;
  ++tally.evaluated;
  tally.keep(RankedPlan{block, cost.predict(block)}, k);
}

// The fastest variant of a candidate that fits: with each of `types` (--cp-comm-type) the
// rules `ptdp run` and ParallelPlan::validate apply allow (core/plan_rules.h), and where
// `combinable` also with the combined 1F1B, which holds one more chunk in flight and hides no
// pipeline transfer (kept only where it fits and is faster). `broken`: the first rule broken,
// for a candidate no type is allowed for.
struct Variant {
  bool allowed = false, fits = false;
  PlanRule broken = PlanRule::kNone;
  ParallelPlan plan;
  Prediction prediction;
};

Variant fastest_variant(const ParallelPlan& plan, std::span<const CpComm> types, bool combinable,
                        const ModelSpec& m, const CostModel& cost) {
  Variant out;
  auto consider = [&](const ParallelPlan& p) {
    if (!cost.memory(p).fits) return;
    Prediction q = cost.predict(p);
    if (out.fits && q.iteration_time_s >= out.prediction.iteration_time_s) return;
    out.fits = true;
    out.plan = p;
    out.prediction = std::move(q);
  };
  for (CpComm type : types) {
    // a2a+p2p: the all-to-all size given, or else each whose group fits in a node (none: the
    // rules refuse the plan). Which is fastest depends on how much of the ring the attention
    // hides: the largest is not always it.
    std::vector<int64_t> sizes = {plan.hierarchical_cp};
    if (type == CpComm::kA2AP2P && plan.context_parallel > 1 && plan.hierarchical_cp == 0) {
      sizes = hierarchical_cp_sizes(m, plan, cost.cluster().gpus_per_node);
      if (sizes.empty()) sizes = {0};
    }
    for (const int64_t a : sizes) {
      ParallelPlan cand = plan;
      cand.hierarchical_cp = a;
      cand = with_cp_comm(cand, type, m, cost.cluster().gpus_per_node);
      if (const PlanRule rule = first_violated_rule(m, cand); rule != PlanRule::kNone) {
        if (out.broken == PlanRule::kNone) out.broken = rule;
        continue;
      }
      out.allowed = true;
      consider(cand);
      if (!combinable) continue;
      cand.overlap_moe_ep_comm = true;
      consider(cand);
    }
  }
  return out;
}

}  // namespace

unsigned memory_saving_modules(const ModelSpec& m) {
  const unsigned mla = m.multi_latent_attention ? unsigned{kRecomputeMlaUpProj} : 0u;
  if (!m.is_moe()) return kRecomputeCoreAttn | kRecomputeMlp | mla;
  unsigned modules = kRecomputeCoreAttn | kRecomputeLayernorm | kRecomputeMoeAct | mla;
  if (m.moe_shared_expert_ffn_size > 0) modules |= kRecomputeSharedExperts;
  return modules;
}

std::vector<int64_t> hierarchical_cp_sizes(const ModelSpec& m, const ParallelPlan& p,
                                           int64_t gpus_per_node) {
  const int64_t cp = p.context_parallel, t = p.tensor_parallel;
  std::vector<int64_t> out;
  if (t <= 0 || m.num_attention_heads % t != 0 || m.query_groups() % t != 0) return out;
  for (int64_t a = 2; a < cp && a * t <= gpus_per_node; ++a)
    if (cp % a == 0 && (m.num_attention_heads / t) % a == 0 && (m.query_groups() / t) % a == 0)
      out.push_back(a);
  return out;
}

int64_t fastest_hierarchical_cp(const CostModel& cost, const ModelSpec& m, const ParallelPlan& p) {
  int64_t best = 0;
  bool best_fits = false;
  double best_time = 0;
  for (const int64_t a : hierarchical_cp_sizes(m, p, cost.cluster().gpus_per_node)) {
    ParallelPlan q = p;
    q.cp_comm = CpComm::kA2AP2P;
    q.hierarchical_cp = a;
    if (first_violated_rule(m, q) != PlanRule::kNone) continue;
    const Prediction r = cost.predict(q);
    const bool fits = r.memory.fits;
    const bool better = best == 0 || (fits != best_fits ? fits : r.iteration_time_s < best_time);
    if (!better) continue;
    best = a;
    best_fits = fits;
    best_time = r.iteration_time_s;
  }
  return best;
}

int64_t natural_hierarchical_cp(const ModelSpec& m, const ParallelPlan& p, int64_t gpus_per_node) {
  const std::vector<int64_t> sizes = hierarchical_cp_sizes(m, p, gpus_per_node);
  return sizes.empty() ? 0 : sizes.back();
}

ParallelPlan with_cp_comm(ParallelPlan p, CpComm type, const ModelSpec& m, int64_t gpus_per_node) {
  p.cp_comm = type;
  if (type != CpComm::kA2AP2P || p.context_parallel <= 1)
    p.hierarchical_cp = 0;
  else if (p.hierarchical_cp == 0)
    p.hierarchical_cp = natural_hierarchical_cp(m, p, gpus_per_node);
  return p;
}

namespace {

// Each recompute mode tried, with the module sets selective recomputation is tried with.
std::vector<std::pair<Recompute, unsigned>> recompute_variants(const SearchOptions& o) {
  std::vector<std::pair<Recompute, unsigned>> out;
  for (Recompute rc : o.recompute_modes) {
    if (rc != Recompute::kSelective) {
      out.emplace_back(rc, kRecomputeCoreAttn);
      continue;
    }
    for (unsigned modules : o.selective_modules) out.emplace_back(rc, modules);
  }
  return out;
}

// `plan` with the cell's layout: its parallel sizes, stage split and micro-batch size.
ParallelPlan with_cell(ParallelPlan plan, const Cell& c) {
  plan.layers_per_stage = c.split;
  plan.layers_per_chunk.clear();
  plan.tensor_parallel = c.t;
  plan.context_parallel = c.cp;
  plan.expert_parallel = c.ep;
  plan.expert_tensor_parallel = c.etp;
  plan.pipeline_parallel = c.p;
  plan.data_parallel = c.d;
  plan.micro_batch_size = c.b;
  return plan;
}

// The optimizer instances to try for a cell's distributed optimizer besides one
// (SearchOptions::optimizer_instances), or 1 where there are none: they must divide the d * cp
// data-parallel ranks (and the experts' edp) into instances of more than one rank.
int64_t optimizer_instances_for(const Cell& c, const ModelSpec& m, const SearchOptions& o,
                                const CostModel& cost) {
  const int64_t dp = c.d * c.cp;
  const ParallelPlan plan = with_cell(ParallelPlan{}, c);
  int64_t k = o.optimizer_instances;
  if (k == 0) {
    // auto: one instance per node's part of the data-parallel group, where the group spans nodes.
    const GroupSpan span = data_group_span(cost.cluster(), plan);
    k = span.nodes > 1 && dp % span.ranks_per_node == 0 ? dp / span.ranks_per_node : 1;
  }
  if (k <= 1 || dp % k != 0 || dp / k < 2) return 1;
  if (m.is_moe() && plan.expert_data_parallel() % k != 0) return 1;
  return k;
}

// How a candidate keeps and reduces its optimizer states and gradients.
struct OptimizerVariant {
  bool distributed = false;
  int64_t instances = 1;
  FsdpSharding fsdp = FsdpSharding::kOff, outer = FsdpSharding::kNoShard;
};

// A cell's optimizer variants: DDP; the distributed optimizer, in one instance and in the
// instances asked for; then Megatron-FSDP's strategies asked for (p = 1 only), each in one
// instance, and those that shard the gradients also in the instances asked for (HSDP, across
// them no_shard, and with optim_grads_params also optim).
std::vector<OptimizerVariant> optimizer_variants(const Cell& c, const ModelSpec& m,
                                                 const SearchOptions& o, const CostModel& cost) {
  std::vector<OptimizerVariant> out = {{}};
  if (c.d * c.cp == 1) return out;
  const int64_t k = optimizer_instances_for(c, m, o, cost);
  if (o.try_distributed_optimizer) {
    out.push_back({true, 1});
    if (k > 1) out.push_back({true, k});
  }
  if (c.p != 1) return out;
  for (FsdpSharding s : o.fsdp_strategies) {
    out.push_back({s >= FsdpSharding::kOptim, 1, s});
    if (k == 1 || s < FsdpSharding::kOptimGrads) continue;
    for (FsdpSharding outer : o.fsdp_outer_strategies)
      if (outer == FsdpSharding::kNoShard ||
          (outer == FsdpSharding::kOptim && s == FsdpSharding::kOptimGradsParams))
        out.push_back({true, k, s, outer});
  }
  return out;
}

void expand(const Cell& c, const ModelSpec& m, const SearchOptions& o, const CostModel& cost,
            Tally& tally, size_t k) {
  // Chunks per rank: v divides every stage's layers (the smallest stage's divisors), and
  // Megatron-Core's interleaved layouts that count the embedding and the loss as layers.
  int64_t fewest_layers = m.num_layers / c.p;
  for (int64_t n : c.split) fewest_layers = std::min(fewest_layers, n);
  const std::vector<OptimizerVariant> optimizers = optimizer_variants(c, m, o, cost);
  std::vector<std::pair<int64_t, std::vector<int64_t>>> chunkings;
  for (int64_t v : divisors(fewest_layers)) chunkings.emplace_back(v, std::vector<int64_t>{});
  if (c.chunk_layouts && o.try_uneven_stages && o.try_interleaving)
    for (auto& layout : accounted_chunk_layouts(m.num_layers, c.p, m.mtp_num_layers))
      chunkings.emplace_back(static_cast<int64_t>(layout.size()) / c.p, std::move(layout));
  for (const auto& [v, layout] : chunkings) {
    if (v > 1 && (!o.try_interleaving || c.p < 2)) continue;
    if (v > 1 && c.p == 2 && !o.interleave_two_stages) continue;
    if (o.schedule && (*o.schedule == Schedule::kInterleaved1F1B) != (v > 1)) continue;
    for (const auto& [rc, modules] : recompute_variants(o)) {
      for (int sp = 0; sp < 2; ++sp) {
        if (sp && (c.t == 1 || !o.try_sequence_parallel)) continue;
        for (const OptimizerVariant& ov : optimizers) {
          ++tally.considered;
          ParallelPlan plan = with_cell(o.defaults, c);
          plan.global_batch_size = o.global_batch_size;
          plan.virtual_stages = v;
          if (!layout.empty()) {
            plan.layers_per_stage.clear();
            plan.layers_per_chunk = layout;
          }
          // Megatron-Core's microbatch group: p (its default) when p divides the microbatches,
          // else the smallest group that runs them. The bubble does not depend on it; the
          // activations in flight and the overlapped schedule's exposed transfers grow with it.
          plan.microbatch_group = 0;
          if (v > 1 && plan.num_microbatches() % c.p != 0)
            plan.microbatch_group = smallest_microbatch_group(plan.num_microbatches(), c.p);
          plan.schedule =
              o.schedule ? *o.schedule : (v > 1 ? Schedule::kInterleaved1F1B : Schedule::k1F1B);
          plan.recompute = rc;
          plan.recompute_modules = modules;
          plan.sequence_parallel = sp != 0;
          plan.distributed_optimizer = ov.distributed;
          plan.optimizer_instances = ov.instances;
          plan.fsdp = ov.fsdp;
          plan.fsdp_outer = ov.outer;
          if (plan.fsdp != FsdpSharding::kOff) plan.fp32_grad_reduce = o.fsdp_fp32_grad_reduce;
          // Overlaps asked for apply where there is what they overlap (and only then does
          // Megatron take their flags).
          plan.tp_comm_overlap = o.defaults.tp_comm_overlap && plan.sequence_parallel;
          plan.overlap_param_gather = o.defaults.overlap_param_gather && plan.distributed_optimizer;
          // Megatron-Core's combined 1F1B where its conditions hold (core/plan_rules.h; 16-bit
          // training, TransformerConfig's check).
          const bool combinable = o.defaults.overlap_moe_ep_comm && c.ep > 1 &&
                                  rc != Recompute::kFull &&
                                  cost.profile().activation_dtype != DType::kF32 &&
                                  (c.p == 1 ? plan.schedule == Schedule::k1F1B
                                            : plan.schedule == Schedule::kInterleaved1F1B);
          plan.overlap_moe_ep_comm = false;
          // With cp > 1 each way of meeting the other ranks' keys that the plan allows.
          const std::span<const CpComm> types = c.cp > 1 && !o.cp_comms.empty()
                                                    ? std::span<const CpComm>(o.cp_comms)
                                                    : std::span<const CpComm>(&plan.cp_comm, 1);
          Variant best = fastest_variant(plan, types, combinable, m, cost);
          if (best.allowed && !best.fits && rc == Recompute::kSelective &&
              modules == kRecomputeCoreAttn && o.try_memory_saving_modules) {
            plan.recompute_modules = memory_saving_modules(m);
            best = fastest_variant(plan, types, combinable, m, cost);
          }
          if (!best.allowed) {
            ++tally.rejected[rule_reason(best.broken)];
            continue;
          }
          if (!best.fits) {
            ++tally.rejected["does not fit in GPU memory"];
            continue;
          }
          ++tally.evaluated;
          tally.keep(RankedPlan{best.plan, best.prediction}, k);
          if (rc == Recompute::kFull && o.try_block_recompute)
            try_block_recompute(best.plan, m, cost, tally, k);
        }
      }
    }
  }
}

}  // namespace

std::vector<std::vector<int64_t>> stage_splits(int64_t layers, int64_t p, bool uneven) {
  std::vector<std::vector<int64_t>> out;
  if (layers % p == 0) out.push_back({});
  if (!uneven || p < 2 || layers <= p) return out;
  auto add = [&](int64_t first, int64_t last) {
    if (first < 1 || last < 1) return;
    std::vector<int64_t> split;
    try {
      split = megatron_stage_split(layers, p, first, last);
    } catch (const InputError&) {
      return;
    }
    bool all_equal = true;
    for (int64_t n : split) all_equal = all_equal && n == split.front();
    if (all_equal || std::find(out.begin(), out.end(), split) != out.end()) return;
    out.push_back(std::move(split));
  };
  if (p == 2) {
    for (int64_t first = layers / 2 - 1; first <= layers / 2 + 1; ++first)
      add(first, layers - first);
    return out;
  }
  const int64_t lowest_mid = (layers + p - 1) / p;
  for (int64_t mid = lowest_mid; mid <= lowest_mid + 2; ++mid) {
    const int64_t ends = layers - mid * (p - 2);  // layers left for the first and last stages
    if (ends < 2 || ends > 2 * mid) continue;
    add(ends / 2, ends - ends / 2);
    add(ends - ends / 2, ends / 2);
    if (ends - mid >= 1) {  // one end as full as the middle, the other lighter
      add(mid, ends - mid);
      add(ends - mid, mid);
    }
  }
  return out;
}

std::vector<std::vector<int64_t>> accounted_chunk_layouts(int64_t layers, int64_t p,
                                                          int64_t mtp_layers) {
  std::vector<std::vector<int64_t>> out;
  if (p < 2) return out;
  // The embedding and the loss counted, or one of them (Megatron's
  // --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split); with
  // multi-token prediction also its modules, a layer each in the last chunk (as Megatron-Bridge's
  // DeepSeek-V3 layout "Et|(tt|)*30mL" counts them).
  std::vector<int64_t> counted_mtp = {0};
  if (mtp_layers > 0) counted_mtp.push_back(mtp_layers);
  for (const int64_t mtp : counted_mtp) {
    for (const auto& [embedding, loss] : {std::pair{1, 1}, std::pair{1, 0}, std::pair{0, 1}}) {
      const int64_t slots = layers + embedding + loss + mtp;
      for (int64_t v = 2; p * v <= slots / 2; ++v) {
        if (slots % (p * v) != 0) continue;
        const int64_t per = slots / (p * v);  // at least 2: a chunk keeps a layer, or its modules
        std::vector<int64_t> layout(static_cast<size_t>(p * v), per);
        layout.front() -= embedding;
        layout.back() -= loss + mtp;
        if (layout.back() < 0) continue;
        if (std::find(out.begin(), out.end(), layout) == out.end())
          out.push_back(std::move(layout));
      }
    }
  }
  return out;
}

SearchResult search_plans(const ModelSpec& m, const ClusterSpec& c, const HardwareProfile& h,
                          const SearchOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t n = c.num_gpus();
  const size_t k = static_cast<size_t>(std::max(1, o.top_k));
  Tally total;
  // Enumerate the (t, cp, p, d, b, ep, etp) cells.
  std::vector<Cell> cells;
  for (int64_t t : divisors(n)) {
    if (o.max_tensor_parallel > 0 && t > o.max_tensor_parallel) continue;
    for (int64_t cp : divisors(n / t)) {
      if (cp > 1 && (!o.try_context_parallel || m.seq_length % (2 * cp) != 0 ||
                     m.seq_length / cp < o.min_context_tokens ||
                     (o.max_context_parallel > 0 && cp > o.max_context_parallel)))
        continue;
      for (int64_t p : divisors(n / (t * cp))) {
        const int64_t d = n / (t * cp * p);
        // Rules no b, v or flag can rescue (t against the heads, groups and FFN, p against the
        // layers, B against d) are counted once per (t, p, d): the plan with b = 1, v = 1 and
        // no sequence parallelism breaks only those.
        const std::vector<std::vector<int64_t>> splits =
            stage_splits(m.num_layers, p, o.try_uneven_stages);
        ParallelPlan cell = o.defaults;
        cell.layers_per_stage = splits.empty() ? std::vector<int64_t>{} : splits.front();
        cell.layers_per_chunk.clear();  // a baseline's layout is for its own p and v
        cell.tensor_parallel = t;
        cell.context_parallel = cp;
        cell.pipeline_parallel = p;
        cell.data_parallel = d;
        cell.micro_batch_size = 1;
        cell.global_batch_size = o.global_batch_size;
        cell.virtual_stages = 1;
        cell.microbatch_group = 0;
        cell.schedule = Schedule::k1F1B;
        cell.sequence_parallel = m.is_moe() && t > 1;  // required there; tried either way else
        // The overlaps apply per plan, where SP and the distributed optimizer are on (expand).
        cell.tp_comm_overlap = cell.overlap_param_gather = cell.overlap_moe_ep_comm = false;
        cell.fsdp = FsdpSharding::kOff;  // tried per plan (expand)
        // a2a+p2p's sizes are the variant's (fastest_variant), checked there.
        if (cell.cp_comm == CpComm::kA2AP2P) {
          cell.cp_comm = CpComm::kP2P;
          cell.hierarchical_cp = 0;
        }
        if (const PlanRule rule = first_violated_rule(m, cell); rule != PlanRule::kNone) {
          ++total.considered;
          ++total.rejected[rule_reason(rule)];
          continue;
        }
        // Expert layouts: ep dividing the experts, each expert over t ranks or whole (etp = 1).
        std::vector<std::pair<int64_t, int64_t>> experts{{1, 0}};
        if (m.is_moe()) {
          experts.clear();
          for (int64_t ep : divisors(m.num_experts)) {
            if (ep > 1 && !o.try_expert_parallel) continue;
            for (int64_t etp : {int64_t{0}, int64_t{1}}) {
              if (etp == 1 && t == 1) continue;  // the same as etp = t
              const int64_t e = etp == 0 ? t : etp;
              if ((t * cp * d) % (e * ep) != 0 || m.moe_ffn_hidden() % e != 0) continue;
              experts.emplace_back(ep, etp);
            }
          }
        }
        for (int64_t b : divisors(o.global_batch_size / d))
          for (const auto& [ep, etp] : experts)
            for (const std::vector<int64_t>& split : splits)
              cells.push_back(Cell{t, cp, p, d, b, ep, etp, split, &split == &splits.front()});
      }
    }
  }

  int threads = o.threads > 0 ? o.threads
                              : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = std::max(1, std::min<int>(threads, static_cast<int>(cells.size())));
  std::atomic<size_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex merge_mutex;
  std::exception_ptr failure;  // the first error of any worker, rethrown here after the join
  auto worker = [&] {
    try {
      CostModel cost(m, c, h);
      Tally local;
      for (size_t i = next++; i < cells.size(); i = next++) {
        expand(cells[i], m, o, cost, local, k);
        const int64_t d = ++done;
        if (o.progress && (d % 64 == 0 || d == static_cast<int64_t>(cells.size()))) {
          o.progress(d, static_cast<int64_t>(cells.size()));
        }
      }
      std::lock_guard<std::mutex> lock(merge_mutex);
      total.merge(std::move(local), k);
    } catch (...) {         // an exception leaving a std::thread would terminate the process
      next = cells.size();  // the other workers stop at their next cell
      std::lock_guard<std::mutex> lock(merge_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (failure) std::rethrow_exception(failure);

  SearchResult r;
  r.top = std::move(total.top);
  r.rejected = std::move(total.rejected);
  r.evaluated = total.evaluated;
  r.considered = total.considered;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

std::string loses_because(const Prediction& w, const Prediction& l) {
  const TimeBreakdown& a = w.breakdown;
  const TimeBreakdown& b = l.breakdown;
  const std::pair<const char*, double> parts[] = {
      {"compute (GEMM shapes)", b.compute - a.compute},
      {"recomputation", b.recompute - a.recompute},
      {"tensor-parallel communication", b.tp_comm - a.tp_comm},
      {"context-parallel communication", b.cp_comm - a.cp_comm},
      {"expert-parallel communication", b.ep_comm - a.ep_comm},
      {"pipeline bubble", b.bubble - a.bubble},
      {"pipeline communication", b.pp_comm - a.pp_comm},
      {"data-parallel communication", b.dp_comm - a.dp_comm},
      {"optimizer step", b.optimizer - a.optimizer},
  };
  const auto* worst = &parts[0];
  for (const auto& part : parts) {
    if (part.second > worst->second) worst = &part;
  }
  char buf[128];
  if (worst->second <= 0) return "ties with the best";
  std::snprintf(buf, sizeof buf, "%s +%.3g s", worst->first, worst->second);
  return buf;
}

std::string plan_difference(const ParallelPlan& a, const ParallelPlan& b) {
  std::string out;
  auto field = [&](const char* name, const std::string& x, const std::string& y) {
    if (x == y) return;
    if (!out.empty()) out += ", ";
    out += std::string(name) + " " + x + "->" + y;
  };
  auto num = [](int64_t v) { return std::to_string(v); };
  auto flag = [](bool v) { return std::string(v ? "on" : "off"); };
  field("t", num(a.tensor_parallel), num(b.tensor_parallel));
  field("cp", num(a.context_parallel), num(b.context_parallel));
  if (a.context_parallel > 1 || b.context_parallel > 1)
    field("cp-comm-type", to_string(a.cp_comm), to_string(b.cp_comm));
  if (a.cp_comm == CpComm::kA2AP2P || b.cp_comm == CpComm::kA2AP2P)
    field("hierarchical-cp", num(a.cp_a2a_size()) + "x" + num(a.cp_ring_size()),
          num(b.cp_a2a_size()) + "x" + num(b.cp_ring_size()));
  field("ep", num(a.expert_parallel), num(b.expert_parallel));
  // etp only where it is not t's (it follows t by default, and a dense model has no experts).
  if (a.expert_tp() != a.tensor_parallel || b.expert_tp() != b.tensor_parallel)
    field("etp", num(a.expert_tp()), num(b.expert_tp()));
  field("p", num(a.pipeline_parallel), num(b.pipeline_parallel));
  field("d", num(a.data_parallel), num(b.data_parallel));
  field("b", num(a.micro_batch_size), num(b.micro_batch_size));
  field("v", num(a.virtual_stages), num(b.virtual_stages));
  if (a.virtual_stages > 1 && b.virtual_stages > 1)
    field("microbatch group", num(a.microbatch_group_size()), num(b.microbatch_group_size()));
  field(a.layers_per_chunk.empty() && b.layers_per_chunk.empty() ? "layers per stage"
                                                                 : "layers per stage or chunk",
        stage_split_summary(a), stage_split_summary(b));
  field("recompute", recompute_label(a), recompute_label(b));
  field("sequence-parallel", flag(a.sequence_parallel), flag(b.sequence_parallel));
  field("distributed-optimizer", flag(a.distributed_optimizer), flag(b.distributed_optimizer));
  field("optimizer instances", num(a.optimizer_instances), num(b.optimizer_instances));
  field("megatron-fsdp", to_string(a.fsdp), to_string(b.fsdp));
  field("megatron-fsdp outer", to_string(a.fsdp_outer), to_string(b.fsdp_outer));
  field("expert all-to-all overlap", flag(a.overlap_moe_ep_comm), flag(b.overlap_moe_ep_comm));
  return out.empty() ? "same configuration" : out;
}

std::string stage_split_summary(const ParallelPlan& p) {
  const std::vector<int64_t>& n =
      p.layers_per_chunk.empty() ? p.layers_per_stage : p.layers_per_chunk;
  if (n.empty()) return "even";
  // Runs of equal stages print once with their count: 7+14x8+7.
  std::string s;
  for (size_t i = 0; i < n.size();) {
    size_t j = i;
    while (j < n.size() && n[j] == n[i]) ++j;
    if (!s.empty()) s += "+";
    if (j - i > 1) s += std::to_string(j - i) + "x";
    s += std::to_string(n[i]);
    i = j;
  }
  return s;
}

std::string plan_summary(const ParallelPlan& p) {
  std::string s = "t" + std::to_string(p.tensor_parallel);
  if (p.context_parallel > 1) s += " cp" + std::to_string(p.context_parallel);
  if (p.context_parallel > 1 && p.cp_comm != CpComm::kP2P) s += "-" + to_string(p.cp_comm);
  if (p.context_parallel > 1 && p.cp_comm == CpComm::kA2AP2P)
    s += "-" + std::to_string(p.cp_a2a_size()) + "x" + std::to_string(p.cp_ring_size());
  s += " p" + std::to_string(p.pipeline_parallel) + " d" + std::to_string(p.data_parallel) + " b" +
       std::to_string(p.micro_batch_size);
  if (p.expert_parallel > 1) s += " ep" + std::to_string(p.expert_parallel);
  if (p.expert_tensor_parallel > 0 && p.expert_tensor_parallel != p.tensor_parallel)
    s += " etp" + std::to_string(p.expert_tensor_parallel);
  if (!p.layers_per_stage.empty() || !p.layers_per_chunk.empty())
    s += " L" + stage_split_summary(p);
  if (p.virtual_stages > 1) s += " v" + std::to_string(p.virtual_stages);
  if (p.virtual_stages > 1 && p.microbatch_group_size() != p.pipeline_parallel)
    s += " g" + std::to_string(p.microbatch_group_size());
  s += " " + recompute_label(p);
  if (p.sequence_parallel) s += " sp";
  if (p.distributed_optimizer && p.fsdp == FsdpSharding::kOff) s += " dopt";
  // Megatron-FSDP's strategy, in FsdpSharding's order.
  constexpr const char* kFsdpLabels[] = {"", " fsdp-ns", " fsdp-o", " fsdp-og", " fsdp-ogp"};
  s += kFsdpLabels[static_cast<size_t>(p.fsdp)];
  // The optimizer's instances (with Megatron-FSDP: HSDP, "-o" when the states shard across them).
  if (p.optimizer_instances > 1) s += "-x" + std::to_string(p.optimizer_instances);
  if (p.fsdp_outer == FsdpSharding::kOptim) s += "-o";
  if (p.overlap_moe_ep_comm) s += " a2a-overlap";
  return s;
}

}  // namespace ptdp
