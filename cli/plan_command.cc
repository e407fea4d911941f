// `ptdp plan`: search every configuration, rank, explain, print the winner as Megatron flags.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/job_flags.h"
#include "cli/report.h"
#include "cli/simulation.h"
#include "core/error.h"
#include "core/plan_rules.h"
#include "core/units.h"
#include "planner/search.h"

namespace ptdp {
namespace {

struct PlanFlags {
  JobFlags job;
  int top = 10;
  int threads = 0;
  double train_tokens = 0;
  std::string out_path;
  bool no_progress = false;
  int simulate_top = 0;
  TimelineFlags timeline;
};

// `simulated`: simulated iteration times of the first plans (re-ranked by them), if any.
void print_table(std::ostream& out, const SearchResult& r, const std::vector<double>& simulated) {
  // The configuration column is as wide as its longest entry (uneven splits lengthen it).
  int width = 34;
  for (const RankedPlan& rp : r.top)
    width = std::max(width, static_cast<int>(plan_summary(rp.plan).size()));
  char buf[400];
  std::snprintf(buf, sizeof buf, "%-4s %-*s %9s %9s %8s %6s %8s  %s\n", "rank", width,
                "configuration", "iter s", simulated.empty() ? "" : "sim s", "TFLOP/s", "MFU",
                "mem GiB", "loses to #1 by");
  out << buf;
  for (size_t i = 0; i < r.top.size(); ++i) {
    const RankedPlan& rp = r.top[i];
    const Prediction& p = rp.prediction;
    std::string why = "-";
    if (i > 0) {
      // Simulated rows against #1's simulated time (they are ranked by it); the rest
      // analytically. A row the analytic model puts ahead of #1 lost in the simulated schedule.
      const bool sim_row = i < simulated.size();
      const double mine = sim_row ? simulated[i] : p.iteration_time_s;
      const double best = sim_row ? simulated[0] : r.top[0].prediction.iteration_time_s;
      char slower[32];
      std::snprintf(slower, sizeof slower, "%+.1f%%: ", 100 * (mine / best - 1));
      why = slower + (sim_row && p.iteration_time_s <= r.top[0].prediction.iteration_time_s
                          ? std::string("the simulated schedule")
                          : loses_because(r.top[0].prediction, p));
    }
    char sim[16] = "";
    // A simulated row's throughput is the simulated time's, as its rank is.
    double rate = 1.0;
    if (i < simulated.size()) {
      std::snprintf(sim, sizeof sim, "%9.3f", simulated[i]);
      rate = p.iteration_time_s / simulated[i];
    }
    std::snprintf(buf, sizeof buf, "%-4zu %-*s %9.3f %9s %8.1f %5.1f%% %8.1f  %s\n", i + 1, width,
                  plan_summary(rp.plan).c_str(), p.iteration_time_s, sim,
                  p.model_tflops_per_gpu * rate, 100 * p.mfu * rate, to_gib(p.memory.peak),
                  why.c_str());
    out << buf;
  }
}

int run_plan(const PlanFlags& f, std::ostream& out, std::ostream& err) {
  const ModelSpec m = f.job.resolve_model();
  const ClusterSpec c = f.job.resolve_cluster();
  const HardwareProfile h = f.job.resolve_profile(c);
  if (f.top <= 0) throw InputError("--top", "must be positive");
  if (!(f.train_tokens >= 0 && f.train_tokens <= 1e18))  // nan and inf too
    throw InputError("--train-tokens", "must be in [0, 1e18]");
  if (f.threads < 0) throw InputError("--threads", "must not be negative (0: every core)");
  if (f.job.global_batch_size.value_or(0) > kMaxBatch)  // as predict and run refuse it
    throw InputError("--global-batch-size", std::to_string(*f.job.global_batch_size) + " exceeds " +
                                                std::to_string(kMaxBatch));
  if (f.simulate_top < 0) throw InputError("--simulate-top", "must not be negative");
  // --num-distributed-optimizer-instances: K, or auto, tried besides one instance (the search
  // sets each candidate's count).
  JobFlags job = f.job;
  const bool auto_instances = job.optimizer_instances == "auto";
  if (auto_instances) job.optimizer_instances.clear();
  ParallelPlan base = job.resolve_plan(m, c);
  const int64_t instances = auto_instances ? 0 : base.optimizer_instances;
  base.optimizer_instances = 1;
  // --recompute-modules: the modules the selective candidates recompute.
  const unsigned selective_modules = base.recompute_modules;
  if (base.recompute != Recompute::kSelective) base.recompute_modules = kRecomputeCoreAttn;
  const FsdpSharding outer = base.fsdp_outer;  // tried with the instances
  base.fsdp_outer = FsdpSharding::kNoShard;
  if (f.job.has_parallel_flags()) base.validate(m);

  SearchOptions o;
  if (!f.job.pipeline_schedule.empty())
    o.schedule = base.schedule;  // as the flag gave it (JobFlags::resolve_plan)
  o.global_batch_size = base.global_batch_size;
  o.top_k = std::max(f.top, f.simulate_top);
  o.threads = f.threads;
  o.defaults = base;
  o.optimizer_instances = instances;
  if (!f.job.cp_comm_type.empty()) o.cp_comms = {base.cp_comm};
  o.selective_modules = {selective_modules};
  // (An MoE model's retry adds moe_act and layernorm, which delayed FP8 scaling cannot take.)
  o.try_memory_saving_modules =
      f.job.recompute_modules.empty() && !(base.fp8 && f.job.fp8_recipe == "delayed" && m.is_moe());
  o.interleave_two_stages = !f.job.no_overlap_p2p;
  // --use-megatron-fsdp: the strategies that shard more than the distributed optimizer, or the
  // one given.
  if (f.job.use_megatron_fsdp) {
    o.fsdp_strategies =
        f.job.dp_sharding_strategy.empty()
            ? std::vector<FsdpSharding>{FsdpSharding::kOptimGrads, FsdpSharding::kOptimGradsParams}
            : std::vector<FsdpSharding>{base.fsdp};
    if (!f.job.outer_dp_sharding_strategy.empty()) o.fsdp_outer_strategies = {outer};
    // --megatron-fsdp-main-grads-dtype applies to those plans only.
    o.fsdp_fp32_grad_reduce = base.fp32_grad_reduce;
    o.defaults.fp32_grad_reduce = !f.job.fp16_grad_reduce;
  }
  const bool show_progress = !f.no_progress && !f.job.json && isatty(STDERR_FILENO);
  if (show_progress) {
    o.progress = [&err](int64_t done, int64_t total) {
      err << "\rsearching: " << (100 * done / total) << "% " << std::flush;
    };
  }
  SearchResult r = search_plans(m, c, h, o);
  if (show_progress) err << "\r                    \r" << std::flush;
  if (r.top.empty()) {
    // The job as given cannot run (an input error, status 2): say why the search rejected
    // what it enumerated, memory first (what more GPUs would change), then the rules by count.
    std::vector<std::pair<int64_t, std::string>> why;
    for (const auto& [reason, n] : r.rejected) why.emplace_back(n, reason);
    const std::string memory = "does not fit in GPU memory";
    std::sort(why.begin(), why.end(), [&](const auto& a, const auto& b) {
      return std::pair(a.second != memory, -a.first) < std::pair(b.second != memory, -b.first);
    });
    std::string reasons;
    for (size_t i = 0; i < why.size() && i < 3; ++i)
      reasons += (i ? ", " : "; rejected: ") + std::to_string(why[i].first) + " " + why[i].second;
    err << "ptdp: " << (f.job.num_gpus ? "--num-gpus" : "--cluster") << ": no configuration of "
        << m.name << " fits on " << c.num_gpus() << " GPUs with --global-batch-size "
        << base.global_batch_size << " (" << r.considered << " considered" << reasons << ")\n";
    return 2;
  }
  // Re-rank the analytic top K by simulated iteration time.
  std::vector<double> simulated;
  const CostModel cm(m, c, h);
  const size_t k = std::min(r.top.size(), static_cast<size_t>(f.simulate_top));
  std::vector<std::pair<double, RankedPlan>> sims;
  for (size_t i = 0; i < k; ++i) {
    if (show_progress) err << "\rsimulating " << i + 1 << "/" << k << " " << std::flush;
    sims.emplace_back(to_seconds(simulate_plan(cm, r.top[i].plan).iteration), r.top[i]);
  }
  if (show_progress && k > 0) err << "\r                         \r" << std::flush;
  std::stable_sort(sims.begin(), sims.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < k; ++i) {
    simulated.push_back(sims[i].first);
    r.top[i] = sims[i].second;
  }
  r.top.resize(std::min(r.top.size(), static_cast<size_t>(f.top)));
  if (simulated.size() > r.top.size()) simulated.resize(r.top.size());
  if (f.timeline.wanted()) {
    const SimulationResult best_sim = simulate_plan(cm, r.top[0].plan, false, {}, true);
    f.timeline.write(best_sim, r.top[0].plan, m);
  }
  std::optional<Prediction> baseline;
  double baseline_time = 0;  // simulated too when the best plan's is
  if (f.job.has_parallel_flags()) {
    baseline = CostModel(m, c, h).predict(base);
    baseline_time = simulated.empty() ? baseline->iteration_time_s
                                      : to_seconds(simulate_plan(cm, base).iteration);
  }
  const RankedPlan& best = r.top[0];
  // Re-ranked by simulation, the best plan's time (and so its days) is its simulated one.
  const double best_time = simulated.empty() ? best.prediction.iteration_time_s : simulated[0];
  const double tokens = f.train_tokens;
  const double best_tokens_per_s =
      best.prediction.tokens_per_s * best.prediction.iteration_time_s / best_time;
  const double days = tokens > 0 ? tokens / best_tokens_per_s / 86400.0 : 0.0;

  if (f.job.json || !f.out_path.empty()) {
    nlohmann::json j;
    j["plans"] = nlohmann::json::array();
    for (const RankedPlan& rp : r.top) {
      nlohmann::json e = prediction_json(m, rp.plan, rp.prediction);
      const size_t i = static_cast<size_t>(&rp - &r.top[0]);
      if (i < simulated.size()) e["simulated_iteration_time_s"] = simulated[i];
      if (&rp != &r.top[0]) e["loses_because"] = loses_because(best.prediction, rp.prediction);
      j["plans"].push_back(e);
    }
    j["model"] = to_json(m);  // so that `ptdp run --plan` can run it
    j["considered"] = r.considered;
    j["evaluated"] = r.evaluated;
    j["rejected"] = r.rejected;
    j["search_seconds"] = r.seconds;
    if (tokens > 0) {
      j["train_days"] = days;
      j["train_gpu_hours"] = days * 24.0 * static_cast<double>(c.num_gpus());
    }
    if (baseline) {
      j["baseline"] = prediction_json(m, base, *baseline);
      j["baseline"]["difference"] = plan_difference(base, best.plan);
      if (!simulated.empty()) j["baseline"]["simulated_iteration_time_s"] = baseline_time;
    }
    if (!f.out_path.empty()) write_file_atomically(f.out_path, j.dump(2) + "\n", "--out");
    if (f.job.json) {
      out << j.dump(2) << "\n";
      return 0;
    }
  }

  char buf[256];
  out << "ptdp plan: " << describe_job(m, c, base.global_batch_size) << "\n";
  std::snprintf(buf, sizeof buf,
                "searched %lld configurations in %.3f s (%.0f per second); %lld fit in memory\n\n",
                static_cast<long long>(r.considered), r.seconds,
                static_cast<double>(r.considered) / r.seconds, static_cast<long long>(r.evaluated));
  out << buf;
  print_table(out, r, simulated);
  if (!simulated.empty())
    out << "\n(the first " << simulated.size()
        << " re-ranked by simulated iteration time: ptdp simulate)\n";
  out << "\nbest plan as Megatron-LM flags:\n  "
      << best.plan.megatron_flags(m, best.prediction.precision) << "\n";
  if (const std::string own = best.plan.ptdp_flags(); !own.empty())
    out << "and ptdp's own flags (no Megatron-LM equivalent; give them with the line above):\n  "
        << own << "\n";
  if (!r.rejected.empty()) {
    out << "\nrejected:\n";
    for (const auto& [why, n] : r.rejected) out << "  " << n << "  " << why << "\n";
  }
  if (baseline) {
    // A configuration that does not fit may be priced faster than every plan that does.
    const bool faster = best_time <= baseline_time;
    std::snprintf(
        buf, sizeof buf,
        "\nyour configuration (%s): %.3f s/iteration%s; the best plan%s is %.1f%% %s: "
        "%s\n",
        plan_summary(base).c_str(), baseline_time,
        baseline->memory.fits ? "" : ", does NOT fit in memory",
        baseline->memory.fits ? "" : " that fits",
        faster ? 100 * (baseline_time / best_time - 1) : 100 * (best_time / baseline_time - 1),
        faster ? "faster" : "slower", plan_difference(base, best.plan).c_str());
    out << buf;
  }
  if (tokens > 0) {
    std::snprintf(buf, sizeof buf, "\ntraining on %.3g tokens: %.1f days, %.3g GPU-hours\n", tokens,
                  days, days * 24.0 * static_cast<double>(c.num_gpus()));
    out << buf;
  }
  return 0;
}

}  // namespace

Action add_plan_command(CLI::App& app) {
  auto* sub = app.add_subcommand("plan", "search all PTD-P configurations and rank them");
  auto f = std::make_shared<PlanFlags>();
  f->job.add_to(*sub, /*plan_flags_required=*/false);
  sub->add_option("--top", f->top, "how many plans to list")->capture_default_str();
  sub->add_option("--threads", f->threads, "search threads (default: all cores)");
  sub->add_option("--train-tokens", f->train_tokens, "tokens to train on, for days and GPU-hours");
  sub->add_option("--out", f->out_path, "write the ranked plans as JSON to this file");
  sub->add_flag("--no-progress", f->no_progress, "no progress line on the terminal");
  sub->add_option("--simulate-top", f->simulate_top,
                  "simulate the analytic top K and re-rank them by simulated time");
  f->timeline.add_to(*sub);
  return [f](std::ostream& out, std::ostream& err) { return run_plan(*f, out, err); };
}

}  // namespace ptdp
