#include "cli/reconcile.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "core/error.h"

namespace ptdp {
namespace {

constexpr const char* kPassOverhead = "pass_overhead";
constexpr const char* kBubble = "bubble";

// Calls of one blocking exchange: how many, their total and their shortest duration.
struct Shortest {
  int64_t calls = 0;
  double total = 0, shortest = std::numeric_limits<double>::infinity();
  void add(double d) {
    ++calls;
    total += d;
    shortest = std::min(shortest, d);
  }
  double cost() const { return calls > 0 ? static_cast<double>(calls) * shortest : 0.0; }
};

// One stage's measured seconds, summed over the measured steps and replicas.
struct Measured {
  FamilyTimes families;
  double pass_overhead = 0;
  // Blocking exchanges with ranks that may still be busy: batched p2p calls, the embedding
  // sync, the gradient-norm all-reduce. Each counts at its shortest occurrence (a call that did
  // not wait), the rest is waiting (idle time, the bubble).
  Shortest p2p, embedding_sync, norm_reduction;
};

using RankKey = std::pair<int32_t, int32_t>;  // (replica, stage)

// Indices of the items of each rank, in time order.
template <class T>
std::map<RankKey, std::vector<const T*>> by_rank(const std::vector<T>& items) {
  std::map<RankKey, std::vector<const T*>> out;
  for (const T& x : items) out[{x.replica, x.stage}].push_back(&x);
  for (auto& [key, v] : out)
    std::stable_sort(v.begin(), v.end(),
                     [](const T* a, const T* b) { return a->start < b->start; });
  return out;
}

}  // namespace

double Compared::relative_error() const {
  // A prediction of nothing (below a picosecond) has no relative error.
  return std::abs(predicted) > 1e-12 ? error() / predicted
                                     : std::numeric_limits<double>::quiet_NaN();
}

Reconciliation reconcile(const RunTrace& trace, const CostModel& cost, const std::string& what) {
  const ParallelPlan& plan = trace.info.plan;
  Reconciliation out;
  // Steps in order; the warm-up ones are left out of every figure.
  std::vector<TraceStep> steps = trace.steps;
  std::sort(steps.begin(), steps.end(),
            [](const TraceStep& a, const TraceStep& b) { return a.step < b.step; });
  std::vector<bool> measured_step;
  double step_seconds = 0;
  for (const TraceStep& s : steps) {
    measured_step.push_back(!s.warmup);
    if (s.warmup) {
      ++out.warmup_steps;
    } else {
      ++out.measured_steps;
      step_seconds += s.end - s.start;
    }
  }
  if (out.measured_steps == 0)
    throw InputError(what, "no measured step: the trace holds " + std::to_string(out.warmup_steps) +
                               " warm-up step(s) only (run at least 2 steps)");
  const double samples = static_cast<double>(out.measured_steps * plan.data_parallel);
  out.iteration.measured = step_seconds / static_cast<double>(out.measured_steps);

  // Every layer of a stage starts with its input norm, once a microbatch in the forward pass:
  // a trace whose events disagree with its own model or plan (layers, microbatches) is refused
  // rather than set against the wrong prediction.
  std::map<RankKey, int64_t> layer_passes;
  for (const TraceOp& o : trace.ops)
    if (o.id == OpId::kInputLayernorm && o.role == OpRole::kForward)
      ++layer_passes[{o.replica, o.stage}];
  for (int32_t d = 0; d < plan.data_parallel; ++d)
    for (int32_t r = 0; r < plan.pipeline_parallel; ++r) {
      const int64_t layers = plan.layers_on_stage(cost.model(), r);
      const int64_t want = layers * plan.num_microbatches() * static_cast<int64_t>(steps.size());
      const int64_t got = layer_passes[{d, r}];
      if (got != want)
        throw InputError(what, "replica " + std::to_string(d) + " stage " + std::to_string(r) +
                                   " ran " + std::to_string(got) +
                                   " layer forward passes (input_layernorm ops), but its model "
                                   "and plan make " +
                                   std::to_string(want) + " (" + std::to_string(layers) +
                                   " layers x " + std::to_string(plan.num_microbatches()) +
                                   " microbatches x " + std::to_string(steps.size()) +
                                   " steps): the events do not match the trace's model or plan");
    }

  // Each rank runs the same action list every step: its k-th event of n belongs to step
  // k / (n / steps).
  std::vector<Measured> stage(static_cast<size_t>(plan.pipeline_parallel));
  auto step_of = [&](size_t k, size_t n, const RankKey& key, const char* kind) {
    if (n % steps.size() != 0)
      throw InputError(what, std::string("the ") + kind + " of replica " +
                                 std::to_string(key.first) + " stage " +
                                 std::to_string(key.second) + " do not split into " +
                                 std::to_string(steps.size()) + " steps");
    return k / (n / steps.size());
  };
  for (const auto& [key, ops] : by_rank(trace.ops)) {
    Measured& m = stage[static_cast<size_t>(key.second)];
    for (size_t k = 0; k < ops.size(); ++k) {
      if (!measured_step[step_of(k, ops.size(), key, "ops")]) continue;
      m.families.at(op_family(ops[k]->id), ops[k]->role) += ops[k]->end - ops[k]->start;
      m.pass_overhead -= ops[k]->end - ops[k]->start;
    }
  }
  for (const auto& [key, acts] : by_rank(trace.actions)) {
    Measured& m = stage[static_cast<size_t>(key.second)];
    const TraceAction* group = nullptr;  // the batched p2p call being read
    for (size_t k = 0; k < acts.size(); ++k) {
      const TraceAction& a = *acts[k];
      if (!measured_step[step_of(k, acts.size(), key, "actions")]) continue;
      const double d = a.end - a.start;
      if (is_p2p(a.kind)) {
        // The actions of one batched call share its start and end.
        if (group && group->start == a.start && group->end == a.end) continue;
        group = &a;
        m.p2p.add(d);
        continue;
      }
      group = nullptr;
      switch (a.kind) {
        case ActionKind::kGradSync:
          m.families.at(OpFamily::kDataParallel, OpRole::kForward) += d;
          break;
        case ActionKind::kEmbeddingSync:
          m.embedding_sync.add(d);
          break;
        case ActionKind::kOptimizerStep:
          m.families.at(OpFamily::kOptimizer, OpRole::kForward) += d;
          break;
        default:
          m.pass_overhead += d;
      }
    }
  }

  for (const auto& [key, norms] : by_rank(trace.norm_reductions)) {
    Measured& m = stage[static_cast<size_t>(key.second)];
    for (size_t k = 0; k < norms.size(); ++k)
      if (measured_step[step_of(k, norms.size(), key, "norm reductions")])
        m.norm_reduction.add(norms[k]->end - norms[k]->start);
  }

  // A collective costs what its quickest member saw: the member that arrived last did not wait.
  // (The embedding sync joins the first and last stage, the norm all-reduce every stage.)
  double emb_shortest = std::numeric_limits<double>::infinity(), norm_shortest = emb_shortest;
  for (const Measured& m : stage) {
    emb_shortest = std::min(emb_shortest, m.embedding_sync.shortest);
    norm_shortest = std::min(norm_shortest, m.norm_reduction.shortest);
  }
  for (Measured& m : stage) {
    m.embedding_sync.shortest = emb_shortest;
    m.norm_reduction.shortest = norm_shortest;
  }

  const PredictedBreakdown pred = predict_breakdown(cost, plan);
  out.iteration.predicted = pred.iteration;
  out.peak_memory = {cost.memory(plan).peak, trace.info.peak_memory_bytes};
  if (trace.info.model.is_moe())
    out.expert_load = {expert_load(trace.info.model, plan.expert_parallel), trace.info.expert_load};
  double worst = -1;
  for (int64_t r = 0; r < plan.pipeline_parallel; ++r) {
    const StagePrediction& ps = pred.stages[static_cast<size_t>(r)];
    Measured& m = stage[static_cast<size_t>(r)];
    // The first stage reaches the tied-embedding all-reduce long before the last; every stage
    // waits in the gradient-norm all-reduce (inside the optimizer step) for the slowest.
    m.families.at(OpFamily::kPipelineP2p, OpRole::kForward) = m.p2p.cost();
    m.families.at(OpFamily::kDataParallel, OpRole::kForward) += m.embedding_sync.cost();
    m.families.at(OpFamily::kOptimizer, OpRole::kForward) +=
        m.norm_reduction.cost() - m.norm_reduction.total;
    StageReconciliation sr;
    sr.stage = r;
    double busy_measured = 0;
    auto add_row = [&](const std::string& name, double predicted, double measured) {
      ReconcileRow row;
      row.name = name;
      row.time = {predicted, measured};
      busy_measured += measured;
      sr.rows.push_back(row);
      return &sr.rows.back();
    };
    for (int f = 0; f < kNumOpFamilies; ++f) {
      const auto fam = static_cast<OpFamily>(f);
      if (fam == OpFamily::kPipelineP2p) add_row(kPassOverhead, 0, m.pass_overhead / samples);
      // The context-parallel and MoE families appear only for plans that have them.
      const bool optional = fam == OpFamily::kContextComm || fam == OpFamily::kMoeRouting ||
                            fam == OpFamily::kExpertGemm || fam == OpFamily::kExpertComm;
      if (optional && ps.families.family(fam) == 0 && m.families.family(fam) == 0) continue;
      ReconcileRow* row = add_row(std::string(family_name(fam)), ps.families.family(fam),
                                  m.families.family(fam) / samples);
      for (int role = 0; role < 4; ++role)
        row->roles[role] = {ps.families.at(fam, static_cast<OpRole>(role)),
                            m.families.at(fam, static_cast<OpRole>(role)) / samples};
    }
    const double bubble_measured = out.iteration.measured - busy_measured;
    sr.busy = {pred.iteration - ps.bubble, busy_measured};
    ReconcileRow bubble;
    bubble.name = kBubble;
    bubble.time = {ps.bubble, bubble_measured};
    sr.rows.push_back(bubble);
    out.stages.push_back(sr);
  }
  // The stage busiest in the measurement sets the pace; the other stages' bubbles are what
  // they waited for it, an effect rather than a cause, so only its bubble competes.
  size_t critical = 0;
  for (size_t r = 0; r < out.stages.size(); ++r)
    if (out.stages[r].busy.measured > out.stages[critical].busy.measured) critical = r;
  out.critical_stage = static_cast<int64_t>(critical);
  for (const StageReconciliation& sr : out.stages) {
    for (const ReconcileRow& row : sr.rows) {
      if (row.name == kBubble && sr.stage != out.critical_stage) continue;
      if (std::fabs(row.time.error()) > worst) {
        worst = std::fabs(row.time.error());
        out.largest_stage = sr.stage;
        out.largest_row = row.name;
        out.largest_error = row.time.error();
      }
    }
  }
  const double e = out.iteration.error();
  out.largest_share = e != 0 ? out.largest_error / e : 0.0;
  return out;
}

}  // namespace ptdp
