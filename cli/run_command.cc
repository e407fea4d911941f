// `ptdp run`: train a GPT model with a PTD-P plan on CPU ranks (one process per rank; under
// mpirun or srun every process runs this command). Rank 0 prints a line per step and, with
// --json, one object with the losses and step times; --trace writes the measured timeline in
// the simulator's Chrome trace format.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli.h"
#include "cli/commands.h"
#include "cli/job_flags.h"
#include "cli/report.h"
#include "core/error.h"
#include "core/presets.h"
#include "core/units.h"
#include "runtime/communicator.h"
#include "runtime/trainer.h"
#include "simulator/timeline_export.h"

namespace ptdp {
namespace {

struct RunFlags {
  JobFlags job;
  std::string plan_file;
  TrainOptions train;
  std::string trace, svg;
  bool json = false;
};

// The parallel configuration from `ptdp plan --out` (best plan first), or from a file holding
// one plan object; its model too, when the file records it.
void read_plan_file(RunFlags& f, ModelSpec* model, bool* have_model) {
  const nlohmann::json j = read_json_file(f.plan_file, "--plan");
  const nlohmann::json* plan = &j;
  if (j.contains("plans")) {
    if (!j["plans"].is_array() || j["plans"].empty())
      throw InputError("--plan", "'plans' holds no plan");
    plan = &j["plans"][0];
  }
  if (plan->contains("configuration")) plan = &(*plan)["configuration"];
  try {
    f.train.plan = plan_from_json(*plan);
  } catch (const InputError& e) {
    throw InputError("--plan", e.what());
  }
  *have_model = j.contains("model");
  if (*have_model) {
    try {
      *model = model_from_json(j["model"]);
    } catch (const InputError& e) {
      throw InputError("--plan", std::string("model: ") + e.what());
    }
  }
}

Span to_span(const TimelineEvent& e) {
  Span s;
  s.replica = e.dp;
  s.rank = e.pp;
  s.kind = e.kind;
  s.microbatch = e.microbatch;
  s.chunk = e.chunk;
  s.stream = is_p2p(e.kind) ? Stream::kPipeline
             : e.kind == ActionKind::kGradSync || e.kind == ActionKind::kEmbeddingSync
                 ? Stream::kData
                 : Stream::kCompute;
  s.start = static_cast<Picos>(e.start * 1e12);
  s.end = static_cast<Picos>(e.end * 1e12);
  return s;
}

std::string plan_line(const ModelSpec& m, const ParallelPlan& p) {
  std::ostringstream s;
  s << m.name << " (" << m.num_layers << " layers, hidden " << m.hidden_size << ", "
    << m.num_attention_heads << " heads, sequence " << m.seq_length << ", vocabulary "
    << m.vocab_size << ") with t=" << p.tensor_parallel << " p=" << p.pipeline_parallel
    << " d=" << p.data_parallel << " b=" << p.micro_batch_size << " B=" << p.global_batch_size
    << " m=" << p.num_microbatches();
  if (p.virtual_stages > 1) s << " v=" << p.virtual_stages;
  s << ", " << to_string(p.schedule) << ", recompute " << to_string(p.recompute);
  if (p.sequence_parallel) s << ", sequence parallel";
  if (p.distributed_optimizer) s << ", distributed optimizer";
  return s.str();
}

int run(RunFlags& f, std::ostream& out, std::ostream& err) {
  const int lrank = launcher_rank();
  const bool launched = lrank >= 0;
  // Errors in the flags are the same on every rank: rank 0 reports them.
  ModelSpec model;
  try {
    bool have_model = false;
    if (!f.plan_file.empty()) {
      if (f.job.has_parallel_flags() || f.job.global_batch_size)
        throw InputError("--plan", "gives the parallel configuration; drop the parallel flags");
      read_plan_file(f, &model, &have_model);
    }
    if (!have_model || !f.job.model.empty() || f.job.num_layers || f.job.hidden_size)
      model = f.job.resolve_model();
    f.train.model = model;
  } catch (const InputError& e) {
    if (lrank <= 0) err << "ptdp: " << e.what() << "\n";
    return 2;
  }
  std::unique_ptr<Communicator> world;
  if (launched && mpi_available()) world = make_mpi_world();
  if (!world) world = make_self_communicator();
  const bool root = world->rank() == 0;
  try {
    if (f.plan_file.empty()) {
      if (!f.job.global_batch_size) throw InputError("--global-batch-size", "is required");
      f.train.plan = f.job.resolve_plan(model, world->size(), "world size");
    } else if (f.train.plan.num_gpus() != world->size()) {
      throw InputError("--plan",
                       "the plan needs t * p * d = " + std::to_string(f.train.plan.num_gpus()) +
                           " ranks, not " + std::to_string(world->size()));
    }
  } catch (const InputError& e) {
    if (root) err << "ptdp: " << e.what() << "\n";
    return 2;
  }
  f.train.record_timeline = !f.trace.empty() || !f.svg.empty();
  std::ostream& lines = f.json ? err : out;
  bool header = false;  // printed with the first step, once every check has passed
  auto on_step = [&](const StepStats& s) {
    if (!header && !f.json) out << "ptdp run: " << plan_line(model, f.train.plan) << "\n";
    header = true;
    char buf[256];
    std::snprintf(
        buf, sizeof buf,
        "step %5lld/%lld  loss %.4f  grad norm %.3f  lr %.2e  %8.1f ms  %10.0f tokens/s\n",
        static_cast<long long>(s.step + 1), static_cast<long long>(f.train.steps), s.loss,
        s.grad_norm, s.lr, s.seconds * 1e3, static_cast<double>(s.tokens) / s.seconds);
    lines << buf << std::flush;
  };
  TrainResult r;
  try {
    r = train(f.train, *world, on_step);
  } catch (const PeerFailed&) {
    return 2;
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
      std::ostringstream s;
      write_chrome_trace(s, spans, title);
      write_file_atomically(f.trace, s.str(), "--trace");
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
    for (const StepStats& s : r.steps) {
      j["losses"].push_back(s.loss);
      j["step_time_s"].push_back(s.seconds);
      j["grad_norms"].push_back(s.grad_norm);
    }
    j["tokens_per_s"] = tokens_per_s;
    j["peak_memory_gib"] = to_gib(static_cast<double>(r.peak_memory_bytes));
    j["peak_rss_gib"] = to_gib(static_cast<double>(r.peak_rss_bytes));
    out << j.dump(2) << "\n";
    return 0;
  }
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "%zu steps in %.2f s (%.0f tokens/s); final loss %.4f; %lld parameters; peak "
                "memory per rank %.1f MiB of tensors, %.1f MiB resident\n",
                r.steps.size(), seconds, tokens_per_s, r.steps.empty() ? 0.0 : r.steps.back().loss,
                static_cast<long long>(r.parameters),
                static_cast<double>(r.peak_memory_bytes) / (1024.0 * 1024),
                static_cast<double>(r.peak_rss_bytes) / (1024.0 * 1024));
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
  sub->add_option("--plan", f->plan_file, "run the best plan of a `ptdp plan --out` file");
  sub->add_option("--steps", t.steps, "training steps")->capture_default_str();
  sub->add_option("--seed", t.seed, "initialisation and synthetic-data seed")
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
  sub->add_option("--clip-grad", t.clip_grad, "gradient clipping by global norm (0: off)")
      ->capture_default_str();
  sub->add_option("--save", t.save_dir, "checkpoint directory");
  sub->add_option("--save-interval", t.save_interval, "steps between checkpoints");
  sub->add_option("--load", t.load_dir, "resume from the latest checkpoint in this directory");
  sub->add_option("--trace", f->trace, "write the measured timeline (Chrome trace JSON)");
  sub->add_option("--svg", f->svg, "write the measured timeline as an SVG chart");
  sub->add_flag("--json", f->json, "print one JSON object (rank 0) instead of the summary");
  return [f](std::ostream& out, std::ostream& err) { return run(*f, out, err); };
}

}  // namespace ptdp
