// `ptdp run`: train a GPT model with a PTD-P plan on CPU ranks (one process per rank; under
// mpirun or srun every process runs this command). Rank 0 prints a line per step and, with
// --json, one object with the losses and step times; --trace writes the measured timeline in
// the simulator's Chrome trace format, with every op's span and the job for `ptdp reconcile`
// (cli/run_trace.h). --dry-run makes every check a run makes, reports each rank's memory and
// trains nothing; with --plan-index all it does so for every plan of a `ptdp plan --out` file
// in one launch.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "cli/cli.h"
#include "cli/commands.h"
#include "cli/dry_run.h"
#include "cli/job_flags.h"
#include "cli/plan_file.h"
#include "cli/report.h"
#include "cli/run_trace.h"
#include "core/error.h"
#include "core/presets.h"
#include "core/units.h"
#include "planner/search.h"
#include "runtime/communicator.h"
#include "runtime/trainer.h"
#include "runtime/watchdog.h"
#include "simulator/timeline_export.h"

namespace ptdp {
namespace {

struct RunFlags {
  JobFlags job;
  std::string plan_file;
  std::string plan_index;  // empty: the first (best) plan
  TrainOptions train;
  std::string trace, svg;
  std::string cluster;  // recorded in the --trace for ptdp reconcile
  bool json = false;
  bool dry_run = false;
  std::optional<double> memory_limit_gib;
  std::optional<int64_t> keep_checkpoints;
  std::vector<CLI::Option*> loss_scale_opts;  // --loss-scale, --initial-loss-scale, ...
  // The first fp16 loss-scaling flag given ("" when none).
  std::string loss_scale_flag_given() const {
    for (const CLI::Option* o : loss_scale_opts)
      if (o->count() > 0) return o->get_name();
    return "";
  }
};

std::string plan_line(const ModelSpec& m, const ParallelPlan& p) {
  std::ostringstream s;
  s << m.name << " (" << m.num_layers << " layers, hidden " << m.hidden_size << ", "
    << m.num_attention_heads << " heads, sequence " << m.seq_length << ", vocabulary "
    << m.vocab_size << ") with t=" << p.tensor_parallel << " p=" << p.pipeline_parallel
    << " d=" << p.data_parallel << (p.context_parallel > 1 ? " " + context_note(p) : std::string())
    << " b=" << p.micro_batch_size << " B=" << p.global_batch_size << " m=" << p.num_microbatches();
  if (p.virtual_stages > 1) s << " v=" << p.virtual_stages << group_note(p);
  if (!p.layers_per_chunk.empty())
    s << " (layout " << pipeline_layout_string(p.layers_per_chunk, m.mtp_num_layers) << ")";
  s << ", " << to_string(p.schedule) << ", recompute " << recompute_label(p);
  if (p.sequence_parallel) s << ", sequence parallel";
  s << optimizer_note(p);
  return s.str();
}

// The precision a plan trains in: --bf16 or --fp16 where given, else the one a plan file's plan
// was priced in (its Megatron-LM flags carry it), else fp32 (ptdp run's default, as Megatron-LM's).
DType run_precision(const RunFlags& f, const NumberedPlan& np) {
  if (f.job.bf16) return DType::kBF16;
  if (f.job.fp16) return DType::kF16;
  return np.priced.value_or(DType::kF32);
}

// Said where a precision flag runs a plan file's plan in another precision than it was priced in.
std::string precision_note(const RunFlags& f, const NumberedPlan& np) {
  const DType run = run_precision(f, np);
  if (!np.priced || *np.priced == run) return "";
  return "the plan was priced in " + to_string(*np.priced) + "; --" + to_string(run) +
         " runs it in " + to_string(run);
}

// The refusal of a plan file's plan made for another number of ranks.
InputError world_mismatch(const ParallelPlan& p, int world) {
  return InputError("--plan", "the plan needs t * cp * p * d = " + std::to_string(p.num_gpus()) +
                                  " ranks, not " + std::to_string(world));
}

// One rank's line of the dry-run table; its cp coordinate too when there is context parallelism
// (`with_cp`), or the ranks of one cp group print alike.
std::string memory_row(const RankFootprint& r, const RankMemory& mem, bool with_cp) {
  char buf[200];
  char cp[16] = "";
  if (with_cp) std::snprintf(cp, sizeof cp, " %4lld", static_cast<long long>(r.cp));
  std::snprintf(
      buf, sizeof buf, "%5lld %4lld%s %4lld %4lld %14lld %11.2f %10.2f %10.2f %10.2f %10.2f\n",
      static_cast<long long>(r.rank), static_cast<long long>(r.tp), cp,
      static_cast<long long>(r.pp), static_cast<long long>(r.dp),
      static_cast<long long>(r.parameter_floats), to_mib(mem.parameters), to_mib(mem.gradients),
      to_mib(mem.optimizer), to_mib(mem.activations), to_mib(mem.peak()));
  return buf;
}

// `ptdp run --dry-run`: for each plan, every check of a real run and the memory check, agreed
// on by all ranks; rank 0 reports each rank's memory. Stops at the first plan refused.
int dry_run_plans(const RunFlags& f, const ModelSpec& model, const std::vector<NumberedPlan>& plans,
                  Communicator& world, std::ostream& out, std::ostream& err) {
  const bool root = world.rank() == 0;
  // One process checks a plan of several ranks by working out every rank (the ranks are not on
  // this host then: only --memory-limit-gib gives them a limit).
  const bool every_rank_here = world.size() == 1;
  std::string limit_source;
  const double host_limit = memory_limit_bytes(f.memory_limit_gib, world.size(), &limit_source);
  nlohmann::json j;
  j["model"] = to_json(model);
  j["world_size"] = world.size();
  j["memory_limit_bytes"] =
      std::isfinite(host_limit) ? nlohmann::json(host_limit) : nlohmann::json();
  j["memory_limit"] = limit_source;
  j["plans"] = nlohmann::json::array();
  for (const NumberedPlan& np : plans) {
    const std::string which =
        np.index > 0 ? "plan " + std::to_string(np.index) + " of " + f.plan_file : "the plan";
    TrainOptions o = f.train;
    o.plan = np.plan;
    o.precision = run_precision(f, np);
    const bool elsewhere = every_rank_here && np.plan.num_gpus() > 1 && !f.memory_limit_gib;
    const double limit = elsewhere ? HUGE_VAL : host_limit;
    const std::string plan_limit_source =
        elsewhere ? "no limit: the plan's ranks are not on this host (--memory-limit-gib sets one)"
                  : limit_source;
    auto check = [&](const RankFootprint& r) {
      const double need = rank_memory(model, o.plan, r).peak();
      if (need > limit) {
        char buf[200];
        std::snprintf(buf, sizeof buf,
                      "rank %lld (tp %lld, cp %lld, pp %lld, dp %lld) would need %.1f MiB, more "
                      "than the %.1f MiB it has (%s)",
                      static_cast<long long>(r.rank), static_cast<long long>(r.tp),
                      static_cast<long long>(r.cp), static_cast<long long>(r.pp),
                      static_cast<long long>(r.dp), to_mib(need), to_mib(limit),
                      plan_limit_source.c_str());
        throw InputError(f.memory_limit_gib ? "--memory-limit-gib" : "memory", buf);
      }
    };
    // Several plans in one launch: say which one was refused.
    auto refuse = [&](const InputError& e) {
      if (plans.size() > 1) throw InputError(which + " (" + plan_summary(np.plan) + ")", e.what());
      throw e;
    };
    // The same on every rank: rank 0 reports.
    if (!every_rank_here && o.plan.num_gpus() != world.size())
      refuse(world_mismatch(o.plan, world.size()));
    std::vector<RankFootprint> ranks;
    try {
      ranks = dry_run(o, world, check);
    } catch (const PeerFailed&) {
      return 2;
    } catch (const InputError& e) {
      // Agreed on: only the lowest failing rank gets here, and reports.
      try {
        refuse(e);
      } catch (const InputError& named) {
        err << "ptdp: " << named.what() << "\n";
      }
      return 2;
    }
    if (!root) continue;
    nlohmann::json p;
    p["index"] = np.index;
    p["configuration"] = to_json(np.plan);
    p["memory_limit_bytes"] = std::isfinite(limit) ? nlohmann::json(limit) : nlohmann::json();
    p["memory_limit"] = plan_limit_source;
    p["ranks"] = nlohmann::json::array();
    size_t worst = 0;
    std::vector<RankMemory> mem;
    for (const RankFootprint& r : ranks) {
      mem.push_back(rank_memory(model, np.plan, r));
      if (mem.back().peak() > mem[worst].peak()) worst = mem.size() - 1;
      p["ranks"].push_back({{"rank", r.rank},
                            {"tp", r.tp},
                            {"pp", r.pp},
                            {"dp", r.dp},
                            {"cp", r.cp},
                            {"parameters", r.parameter_floats},
                            {"parameter_bytes", mem.back().parameters},
                            {"gradient_bytes", mem.back().gradients},
                            {"optimizer_bytes", mem.back().optimizer},
                            {"activation_bytes", mem.back().activations},
                            {"peak_bytes", mem.back().peak()}});
    }
    p["peak_bytes"] = mem[worst].peak();
    j["plans"].push_back(p);
    if (f.json) continue;
    out << "ptdp run --dry-run: " << which << ": " << plan_line(model, np.plan) << "\n";
    if (const std::string note = precision_note(f, np); !note.empty())
      out << "ptdp run --dry-run: " << note << "\n";
    // What the run would execute differently from the plan as priced (its memory is the run's).
    if (const std::string note = execution_note(model, np.plan); !note.empty())
      out << "ptdp run --dry-run: the run " << note << "\n";
    char buf[200];
    const bool with_cp = np.plan.context_parallel > 1;
    std::snprintf(buf, sizeof buf, "%5s %4s%s %4s %4s %14s %11s %10s %10s %10s %10s\n", "rank",
                  "tp", with_cp ? "   cp" : "", "pp", "dp", "parameters", "params MiB", "grads MiB",
                  "optim MiB", "activ MiB", "peak MiB");
    out << buf;
    for (size_t i = 0; i < ranks.size(); ++i) out << memory_row(ranks[i], mem[i], with_cp);
    std::snprintf(buf, sizeof buf, "ok: %zu ranks; largest predicted peak %.2f MiB (rank %zu); ",
                  ranks.size(), to_mib(mem[worst].peak()), worst);
    out << buf;
    if (std::isfinite(limit)) {
      std::snprintf(buf, sizeof buf, "limit %.1f MiB per rank (%s)\n\n", to_mib(limit),
                    plan_limit_source.c_str());
      out << buf;
    } else {
      out << plan_limit_source << "\n\n";
    }
  }
  if (root && f.json) out << j.dump(2) << "\n";
  return 0;
}

int run(RunFlags& f, std::ostream& out, std::ostream& err) {
  const int lrank = launcher_rank();
  const bool launched = lrank >= 0;
  // Errors in the flags are the same on every rank: rank 0 reports them.
  ModelSpec model;
  std::vector<NumberedPlan> plans;
  try {
    bool have_model = false;
    if (!f.plan_index.empty() && f.plan_file.empty())
      throw InputError("--plan-index", "needs --plan FILE");
    if (f.plan_index == "all" && !f.dry_run)
      throw InputError("--plan-index", "all needs --dry-run (a run trains one plan)");
    if (f.memory_limit_gib && !f.dry_run) throw InputError("--memory-limit-gib", "needs --dry-run");
    if (f.keep_checkpoints) {
      if (*f.keep_checkpoints < 1) throw InputError("--keep-checkpoints", "must be at least 1");
      f.train.keep_checkpoints = *f.keep_checkpoints;
    }
    if (!f.cluster.empty() && f.trace.empty()) throw InputError("--cluster", "needs --trace FILE");
    if (!f.cluster.empty()) {
      try {
        resolve_cluster(f.cluster).validate();  // a typo found now, not by ptdp reconcile
      } catch (const InputError& e) {
        throw InputError("--cluster", e.what());
      }
    }
    // Megatron's precision flags: --bf16 and --fp16 train in mixed precision, fp16 with loss
    // scaling (runtime/loss_scaler.h).
    if (f.job.bf16 && f.job.fp16) throw InputError("--fp16", "conflicts with --bf16");
    if (f.dry_run && (!f.trace.empty() || !f.svg.empty() || !f.train.save_dir.empty()))
      throw InputError("--dry-run", "trains nothing: drop --trace, --svg and --save");
    // Outputs written after training (or at its first checkpoint) are checked before it.
    if (!f.trace.empty()) check_writable(f.trace, "--trace");
    if (!f.svg.empty()) check_writable(f.svg, "--svg");
    if (!f.plan_file.empty()) {
      if (f.job.has_parallel_flags() || f.job.global_batch_size)
        throw InputError("--plan", "gives the parallel configuration; drop the parallel flags");
      // What the plan file sets is not overridden: a flag for it is refused, not ignored.
      if (const std::string flag = f.job.first_plan_setting_flag(); !flag.empty())
        throw InputError(flag, "the --plan file sets this; drop the flag");
      plans = read_plan_file(f.plan_file, f.plan_index, &model, &have_model);
      if (const std::string flag = f.job.first_model_flag(); have_model && !flag.empty())
        throw InputError(flag, "the --plan file gives the model; drop the model flags");
    }
    if (!have_model || !f.job.model.empty() || f.job.num_layers || f.job.hidden_size)
      model = f.job.resolve_model();
    f.train.model = model;
    // A plan file's plans come from one `ptdp plan`, priced in one precision.
    f.train.precision = run_precision(f, plans.empty() ? NumberedPlan{} : plans.front());
    if (const std::string flag = f.loss_scale_flag_given();
        f.train.precision != DType::kF16 && !flag.empty())
      throw InputError(flag,
                       "needs fp16 training (--fp16, or a plan priced in fp16 without "
                       "--bf16)");
    if (f.train.precision == DType::kF16) f.train.loss_scale.validate();
    // Created once every other flag is checked: a refused command leaves no directory behind.
    if (!f.train.save_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(f.train.save_dir, ec);
      if (ec || !std::filesystem::is_directory(f.train.save_dir, ec))
        throw InputError("--save", "cannot create the directory '" + f.train.save_dir + "'");
      check_writable((std::filesystem::path(f.train.save_dir) / "latest").string(), "--save");
    }
  } catch (const InputError& e) {
    if (lrank <= 0) err << "ptdp: " << e.what() << "\n";
    return 2;
  }
  std::unique_ptr<Communicator> world;
  if (launched && mpi_available()) world = make_mpi_world();
  if (!world) world = make_self_communicator();
  const bool root = world->rank() == 0;
  try {
    if (f.job.num_gpus) {
      if (!f.dry_run)
        throw InputError("--num-gpus", "needs --dry-run (a run's ranks are the launcher's)");
      if (!f.plan_file.empty()) throw InputError("--num-gpus", "the --plan file gives the ranks");
      if (*f.job.num_gpus <= 0 || *f.job.num_gpus > kMaxGpus)
        throw InputError("--num-gpus", "must be 1.." + std::to_string(kMaxGpus));
      if (world->size() != 1 && world->size() != *f.job.num_gpus)
        throw InputError("--num-gpus", std::to_string(*f.job.num_gpus) + ", but launched on " +
                                           std::to_string(world->size()) + " ranks");
    }
    if (f.plan_file.empty()) {
      if (!f.job.global_batch_size) throw InputError("--global-batch-size", "is required");
      plans.push_back({f.job.resolve_plan(model, f.job.num_gpus.value_or(world->size()),
                                          f.job.num_gpus ? "--num-gpus" : "world size"),
                       0, std::nullopt});
    }
    if (f.dry_run) return dry_run_plans(f, model, plans, *world, out, err);
    f.train.plan = plans.front().plan;
    if (f.train.plan.num_gpus() != world->size()) throw world_mismatch(f.train.plan, world->size());
  } catch (const InputError& e) {
    if (root) err << "ptdp: " << e.what() << "\n";
    return 2;
  }
  f.train.record_timeline = !f.trace.empty() || !f.svg.empty();
  std::ostream& lines = f.json ? err : out;
  bool header = false;  // printed with the first step, once every check has passed
  auto on_step = [&](const StepStats& s) {
    if (!header && !f.json) {
      out << "ptdp run: " << plan_line(model, f.train.plan) << "\n";
      if (const std::string note = precision_note(f, plans.front()); !note.empty())
        out << "ptdp run: " << note << "\n";
      const std::string half = to_string(f.train.precision);
      if (f.train.precision != DType::kF32)
        out << "ptdp run: " << half
            << " weights and activations; fp32 gradients, master weights and Adam states\n";
      if (f.train.precision == DType::kF16) {
        const LossScaleSettings& ls = f.train.loss_scale;
        char line[160];
        if (ls.static_scale > 0)
          std::snprintf(line, sizeof line, "ptdp run: static loss scale %g\n", ls.static_scale);
        else
          std::snprintf(line, sizeof line,
                        "ptdp run: dynamic loss scale from %g (window %lld, hysteresis %lld, "
                        "min %g)\n",
                        ls.initial_scale, static_cast<long long>(ls.window),
                        static_cast<long long>(ls.hysteresis), ls.min_scale);
        out << line;
      }
      if (f.train.precision == DType::kF16 && model.is_moe())
        out << "ptdp run: the routed experts compute in fp32 (their weights fp16): an MoE "
               "layer's routed rows are bf16 or fp32\n";
      if (const std::string note = execution_note(model, f.train.plan); !note.empty())
        out << "ptdp run: " << note << "\n";
    }
    header = true;
    char buf[256], norm[64];
    if (s.skipped)
      std::snprintf(norm, sizeof norm, "skipped (overflow)");
    else
      std::snprintf(norm, sizeof norm, "grad norm %.3f", s.grad_norm);
    std::snprintf(buf, sizeof buf,
                  "step %5lld/%lld  loss %.4f  %s  lr %.2e  %8.1f ms  %10.0f tokens/s",
                  static_cast<long long>(s.step + 1), static_cast<long long>(f.train.steps), s.loss,
                  norm, s.lr, s.seconds * 1e3, static_cast<double>(s.tokens) / s.seconds);
    lines << buf;
    if (s.loss_scale > 0) lines << "  loss scale " << s.loss_scale;
    if (model.mtp_num_layers > 0) {
      std::snprintf(buf, sizeof buf, "  mtp loss %.4f", s.mtp_loss);
      lines << buf;
    }
    lines << "\n" << std::flush;
  };
  TrainResult r;
  try {
    r = train(f.train, *world, on_step);
  } catch (const PeerFailed&) {
    return 2;
  } catch (const NonFiniteLoss& e) {  // on every rank, at the same step
    if (root) err << "ptdp: " << e.what() << "\n";
    return 3;
  } catch (const CommTimeout& e) {  // a wait past PTDP_COMM_TIMEOUT_S: stop the whole job
    abort_job("ptdp: world rank " + std::to_string(world->rank()) + ": " + e.what());
  }
  if (!root) return 0;
  if (!r.timeline.empty()) {
    std::vector<Span> spans;
    Picos end = 0;
    for (const TimelineEvent& e : r.timeline) {
      spans.push_back(to_span(e));
      end = std::max(end, spans.back().end);
    }
    const std::string title = "ptdp run: " + plan_line(model, f.train.plan);
    if (!f.trace.empty()) {
      RunTraceInfo info;
      info.model = as_executed(model, f.train.plan);   // what ran, for reconcile to price
      info.plan = executed_plan(model, f.train.plan);  // without what is priced, not run
      // A machine file by its absolute path, so that reconcile finds it from any directory.
      std::error_code ec;
      const std::vector<std::string> presets = cluster_preset_names();
      const bool preset = std::find(presets.begin(), presets.end(), f.cluster) != presets.end();
      info.cluster = !preset && std::filesystem::is_regular_file(f.cluster, ec)
                         ? std::filesystem::absolute(f.cluster, ec).string()
                         : f.cluster;
      info.world_size = world->size();
      info.backend = backend_label(f.train.backend);
      info.precision = f.train.precision;
      info.steps = f.train.steps;
      write_file_atomically(f.trace, run_trace_text(r, info, title), "--trace");
    }
    if (!f.svg.empty()) {
      std::ostringstream s;
      write_svg(s, spans, end, title);
      write_file_atomically(f.svg, s.str(), "--svg");
    }
  }
  double seconds = 0;
  int64_t tokens = 0;
  for (const StepStats& s : r.steps) {
    seconds += s.seconds;
    tokens += s.tokens;
  }
  const double tokens_per_s = seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
  if (f.json) {
    nlohmann::json j;
    j["model"] = to_json(model);
    j["configuration"] = to_json(f.train.plan);
    j["world_size"] = world->size();
    j["parameters"] = r.parameters;
    j["first_step"] = r.first_step;
    j["losses"] = nlohmann::json::array();
    j["step_time_s"] = nlohmann::json::array();
    j["grad_norms"] = nlohmann::json::array();
    int64_t skipped = 0;
    for (const StepStats& s : r.steps) {
      j["losses"].push_back(s.loss);
      j["step_time_s"].push_back(s.seconds);
      j["grad_norms"].push_back(s.grad_norm);  // null for a skipped fp16 step
      skipped += s.skipped;
    }
    if (model.mtp_num_layers > 0) {  // the modules' mean loss, unweighted, beside "losses"
      j["mtp_losses"] = nlohmann::json::array();
      for (const StepStats& s : r.steps) j["mtp_losses"].push_back(s.mtp_loss);
    }
    if (f.train.precision == DType::kF16) {
      j["loss_scales"] = nlohmann::json::array();
      for (const StepStats& s : r.steps) j["loss_scales"].push_back(s.loss_scale);
      j["skipped_steps"] = skipped;
    }
    j["tokens_per_s"] = tokens_per_s;
    j["peak_memory_gib"] = to_gib(static_cast<double>(r.peak_memory_bytes));
    j["peak_rss_gib"] = to_gib(static_cast<double>(r.peak_rss_bytes));
    if (r.expert_load > 0) j["expert_load"] = r.expert_load;
    j["data_plane"] = r.data_plane;
    j["precision"] = to_string(f.train.precision);
    j["schedule"] = to_string(f.train.plan.schedule);
    j["scatter_gather_p2p"] = r.scatter_gather_p2p;
    out << j.dump(2) << "\n";
    return 0;
  }
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "%zu steps in %.2f s (%.0f tokens/s); final loss %.4f; %lld parameters; peak "
                "memory per rank %.1f MiB of tensors, %.1f MiB resident\n",
                r.steps.size(), seconds, tokens_per_s, r.steps.empty() ? 0.0 : r.steps.back().loss,
                static_cast<long long>(r.parameters),
                to_mib(static_cast<double>(r.peak_memory_bytes)),
                to_mib(static_cast<double>(r.peak_rss_bytes)));
  out << buf;
  return 0;
}

}  // namespace

Action add_run_command(CLI::App& app) {
  auto* sub =
      app.add_subcommand("run", "train with a PTD-P plan on CPU ranks (mpirun -np N ptdp run ...)");
  auto f = std::make_shared<RunFlags>();
  f->job.add_model_flags(*sub);
  f->job.add_parallel_flags(*sub, false, false);
  TrainOptions& t = f->train;
  sub->add_option("--plan", f->plan_file, "run a plan of a `ptdp plan --out` file (the best)");
  sub->add_option("--plan-index", f->plan_index,
                  "which plan of the --plan file: its rank (1 = the best), or all (--dry-run)");
  sub->add_flag("--dry-run", f->dry_run,
                "check the plan, data and --load checkpoint, report each rank's memory, train "
                "nothing");
  sub->add_option("--memory-limit-gib", f->memory_limit_gib,
                  "--dry-run: memory per rank (default: MemAvailable / ranks on this host; none "
                  "when one process checks a plan of several ranks)");
  sub->add_option("--num-gpus", f->job.num_gpus,
                  "--dry-run in one process: the ranks of the plan to check (a run's ranks are "
                  "the launcher's)");
  sub->add_option("--backend", t.backend,
                  "where the kernels run: cpu, cuda (a CUDA build), or cpu-staged (the CPU "
                  "kernels on memory treated as a device's: tests the GPU's host side)")
      ->capture_default_str();
  sub->add_option("--steps", t.steps, "training steps")->capture_default_str();
  // Checked as text: CLI11 would wrap -1 to 2^64 - 1 and saturate what is past 2^64 - 1.
  sub->add_option("--seed", t.seed, "initialisation and synthetic-data seed")
      ->check(
          [](const std::string& v) -> std::string {
            const bool digits = !v.empty() && v.size() <= 20 &&
                                v.find_first_not_of("0123456789") == std::string::npos;
            if (digits && (v.size() < 20 || v <= "18446744073709551615")) return "";
            return "must be an integer in [0, 2^64 - 1], got '" + v + "'";
          },
          "SEED")
      ->capture_default_str();
  sub->add_option("--data", t.data, "synthetic, or a token file from `ptdp tokenize`")
      ->capture_default_str();
  sub->add_option("--lr", t.lr, "peak learning rate")->capture_default_str();
  sub->add_option("--min-lr", t.min_lr, "final learning rate of the cosine decay")
      ->capture_default_str();
  sub->add_option("--lr-warmup-steps", t.warmup_steps)->capture_default_str();
  sub->add_option("--lr-decay-style", t.lr_decay, "constant or cosine")->capture_default_str();
  sub->add_option("--weight-decay", t.weight_decay)->capture_default_str();
  sub->add_option("--adam-beta1", t.beta1)->capture_default_str();
  sub->add_option("--adam-beta2", t.beta2)->capture_default_str();
  sub->add_option("--adam-eps", t.eps)->capture_default_str();
  // fp16 loss scaling (Megatron-LM's flags; with --fp16). Plain options of the subcommand: a
  // CLI11 option group loops forever on empty positional arguments (found by fuzzing).
  f->loss_scale_opts = {
      sub->add_option("--loss-scale", t.loss_scale.static_scale, "a static loss scale"),
      sub->add_option("--initial-loss-scale", t.loss_scale.initial_scale,
                      "the dynamic loss scale's start")
          ->capture_default_str(),
      sub->add_option("--min-loss-scale", t.loss_scale.min_scale)->capture_default_str(),
      sub->add_option("--loss-scale-window", t.loss_scale.window,
                      "overflow-free steps before the scale doubles")
          ->capture_default_str(),
      sub->add_option("--hysteresis", t.loss_scale.hysteresis,
                      "overflows tolerated before the scale halves")
          ->capture_default_str()};
  sub->add_option("--clip-grad", t.clip_grad, "gradient clipping by global norm (0: off)")
      ->capture_default_str();
  sub->add_option("--save", t.save_dir, "checkpoint directory");
  sub->add_option("--save-interval", t.save_interval, "steps between checkpoints");
  sub->add_option("--keep-checkpoints", f->keep_checkpoints,
                  "keep only the newest N checkpoints in --save (older ones removed after each "
                  "save)");
  sub->add_option("--load", t.load_dir, "resume from the latest checkpoint in this directory");
  sub->add_option("--trace", f->trace,
                  "write the measured timeline, every op of every pass and the job (Chrome trace "
                  "JSON; ptdp reconcile reads it)");
  sub->add_option("--cluster", f->cluster,
                  "cluster or machine file name recorded in the --trace for ptdp reconcile (the "
                  "run does not use it)");
  sub->add_option("--svg", f->svg, "write the measured timeline as an SVG chart");
  sub->add_flag("--json", f->json, "print one JSON object (rank 0) instead of the summary");
  return [f](std::ostream& out, std::ostream& err) { return run(*f, out, err); };
}

}  // namespace ptdp
