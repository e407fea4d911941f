// `ptdp reconcile --trace run.json [--cluster machine.json] [--json]`: the measured run of a
// `ptdp run --trace` file against the cost model's prediction for the same job (cli/reconcile.h),
// as a table or one JSON object.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "cli/commands.h"
#include "cli/job_flags.h"
#include "cli/reconcile.h"
#include "cli/report.h"
#include "cli/trace_file.h"
#include "core/error.h"
#include "core/units.h"

namespace ptdp {
namespace {

struct ReconcileFlags {
  std::string trace, cluster, profile;
  bool json = false;
};

nlohmann::json number_or_null(double x) {
  return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json();
}

nlohmann::json compared_json(const Compared& c, const char* unit) {
  return {{std::string("predicted_") + unit, c.predicted},
          {std::string("measured_") + unit, c.measured},
          {std::string("error_") + unit, c.error()},
          {"relative_error", number_or_null(c.relative_error())}};
}

std::string line(const std::string& what, const Compared& c, double scale, const char* unit) {
  char rel[32] = "      -";
  if (std::isfinite(c.relative_error()))
    std::snprintf(rel, sizeof rel, "%+7.1f%%", 100 * c.relative_error());
  char buf[200];
  std::snprintf(buf, sizeof buf, "%-30s %12.3f %12.3f %+12.3f %8s  %s\n", what.c_str(),
                c.predicted * scale, c.measured * scale, c.error() * scale, rel, unit);
  return buf;
}

// A machine file (ptdp calibrate) prices a run only with what it measured: the run's backend and
// precision, and collectives over every group size the run's plan communicates over.
void check_machine_matches(const ClusterSpec& cluster, const RunTraceInfo& run,
                           const std::string& flag) {
  if (!cluster.measured_profile) return;  // a preset or a hand-written cluster file
  if (!cluster.measured_backend.empty() && cluster.measured_backend != run.backend)
    throw InputError(flag, "measured the " + cluster.measured_backend +
                               " backend, but the trace ran the " + run.backend + " backend");
  const std::string kernels =
      cluster.measured_activations.empty() ? "fp32" : cluster.measured_activations;
  if (kernels != to_string(run.precision))
    throw InputError(flag, "measured " + kernels + " kernels, but the trace trained in " +
                               to_string(run.precision) + ": calibrate with" +
                               (run.precision == DType::kF32 ? "out --bf16 or --fp16"
                                                             : " --" + to_string(run.precision)));
  std::set<int64_t> measured;
  for (const CollectiveFit& c : cluster.measured_profile->collectives) measured.insert(c.ranks);
  const ParallelPlan& p = run.plan;
  std::set<int64_t> needed = {p.tensor_parallel, p.context_parallel,
                              p.data_parallel * p.context_parallel, p.expert_parallel};
  if (p.pipeline_parallel > 1) needed.insert(2);  // send/recv pairs
  for (int64_t g : needed) {
    if (g <= 1 || measured.count(g)) continue;
    std::string have;
    for (int64_t m : measured) have += (have.empty() ? "" : ", ") + std::to_string(m);
    throw InputError(
        flag, "collectives over " + std::to_string(g) + " ranks were not measured (it measured " +
                  std::to_string(cluster.measured_ranks) + " rank(s)" +
                  (have.empty() ? std::string(", no collectives") : ", groups of " + have) +
                  "), but the trace's plan needs them: calibrate with mpirun -np " +
                  std::to_string(run.world_size) + " ptdp calibrate");
  }
}

int reconcile_command(const ReconcileFlags& f, std::ostream& out) {
  const RunTrace trace = read_run_trace(f.trace, "--trace");
  JobFlags job;
  job.cluster = f.cluster.empty() ? trace.info.cluster : f.cluster;
  if (job.cluster.empty())
    throw InputError("--cluster", "is required: the trace " + f.trace + " records no cluster");
  job.profile = f.profile;
  job.num_gpus = trace.info.world_size;
  job.bf16 = trace.info.precision == DType::kBF16;  // priced in the precision the run trained in
  job.fp16 = trace.info.precision == DType::kF16;
  ClusterSpec cluster;
  try {
    cluster = job.resolve_cluster();
  } catch (const InputError& e) {
    if (!f.cluster.empty()) throw;
    throw InputError("--trace " + f.trace, "its cluster (otherData.cluster '" + job.cluster +
                                               "') cannot be loaded; give --cluster (" + e.what() +
                                               ")");
  }
  check_machine_matches(cluster, trace.info, "--cluster " + job.cluster);
  HardwareProfile profile = job.resolve_profile(cluster);
  // Presets price 16-bit training by default; an fp32 run (ptdp run's default) is priced in fp32:
  // 4-byte weights, activations and Adam states with no master copy. (A machine file already
  // matches the run's precision, checked above.)
  profile.activation_dtype = trace.info.precision;
  const CostModel cost(trace.info.model, cluster, profile);
  Reconciliation r;
  try {
    r = reconcile(trace, cost, "--trace " + f.trace);
  } catch (const InputError& e) {
    if (e.field().rfind("--trace", 0) == 0) throw;
    throw InputError("--cluster " + job.cluster,
                     "cannot price the trace's model and plan: " + std::string(e.what()));
  }
  const ParallelPlan& p = trace.info.plan;
  if (f.json) {
    nlohmann::json j;
    j["trace"] = f.trace;
    j["cluster"] = cluster.name;
    j["profile"] = profile.name;
    j["model"] = to_json(trace.info.model);
    j["configuration"] = to_json(p);
    j["measured_steps"] = r.measured_steps;
    j["warmup_steps"] = r.warmup_steps;
    j["iteration"] = compared_json(r.iteration, "s");
    j["peak_memory"] = compared_json(r.peak_memory, "bytes");
    if (trace.info.model.is_moe() && r.expert_load.measured > 0)
      j["expert_load"] = compared_json(r.expert_load, "load");
    j["stages"] = nlohmann::json::array();
    for (const StageReconciliation& s : r.stages) {
      nlohmann::json js;
      js["stage"] = s.stage;
      js["busy"] = compared_json(s.busy, "s");
      js["rows"] = nlohmann::json::array();
      for (const ReconcileRow& row : s.rows) {
        nlohmann::json jr = compared_json(row.time, "s");
        jr["name"] = row.name;
        if (parse_family(row.name) && row.name != family_name(OpFamily::kPipelineP2p) &&
            row.name != family_name(OpFamily::kDataParallel) &&
            row.name != family_name(OpFamily::kOptimizer)) {
          for (int role = 0; role < 4; ++role)
            jr["roles"][to_string(static_cast<OpRole>(role))] = compared_json(row.roles[role], "s");
        }
        js["rows"].push_back(jr);
      }
      j["stages"].push_back(js);
    }
    j["critical_stage"] = r.critical_stage;
    j["largest_contributor"] = {{"stage", r.largest_stage},
                                {"name", r.largest_row},
                                {"error_s", r.largest_error},
                                {"share_of_iteration_error", r.largest_share}};
    out << j.dump(2) << "\n";
    return 0;
  }
  out << "ptdp reconcile: " << trace.info.model.name << " with t=" << p.tensor_parallel
      << " p=" << p.pipeline_parallel << " d=" << p.data_parallel;
  if (p.context_parallel > 1) out << " " << context_note(p);
  if (p.expert_parallel > 1) out << " ep=" << p.expert_parallel;
  out << " b=" << p.micro_batch_size << " B=" << p.global_batch_size << " ("
      << to_string(p.schedule) << ") on " << cluster.name << " / " << profile.name << "\n";
  out << r.measured_steps << " measured step(s), " << r.warmup_steps
      << " warm-up step(s) left out; times per iteration, error = measured - predicted\n\n";
  char head[200];
  std::snprintf(head, sizeof head, "%-30s %12s %12s %12s %8s\n", "", "predicted", "measured",
                "error", "error %");
  out << head;
  out << line("iteration", r.iteration, 1e3, "ms");
  for (const StageReconciliation& s : r.stages) {
    const std::string stage = "stage " + std::to_string(s.stage) + " ";
    out << line(stage + "busy", s.busy, 1e3, "ms");
    for (const ReconcileRow& row : s.rows) out << line("  " + row.name, row.time, 1e3, "ms");
  }
  out << line("peak memory", r.peak_memory, 1.0 / kMiB, "MiB");
  if (trace.info.model.is_moe() && r.expert_load.measured > 0)
    out << line("expert load (busiest / mean)", r.expert_load, 1.0, "x");
  char buf[300];
  std::snprintf(buf, sizeof buf,
                "\nlargest contributor: stage %lld %s, %+.3f ms (%.0f%% of the iteration's "
                "error of %+.3f ms)\n",
                static_cast<long long>(r.largest_stage), r.largest_row.c_str(),
                r.largest_error * 1e3, 100 * r.largest_share, r.iteration.error() * 1e3);
  out << buf;
  return 0;
}

}  // namespace

Action add_reconcile_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "reconcile", "set a measured run (ptdp run --trace) against the prediction for its job");
  auto f = std::make_shared<ReconcileFlags>();
  sub->add_option("--trace", f->trace, "the trace `ptdp run --trace` wrote")->required();
  sub->add_option("--cluster", f->cluster,
                  "cluster preset, cluster JSON or machine file that prices the job (default: "
                  "the one the trace records)");
  sub->add_option("--profile", f->profile, "hardware profile preset or JSON (default: by GPU)");
  sub->add_flag("--json", f->json, "print one JSON object instead of the table");
  return [f](std::ostream& out, std::ostream&) { return reconcile_command(*f, out); };
}

}  // namespace ptdp
