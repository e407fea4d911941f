// Reading and checking `ptdp run --trace` files (cli/trace_file.h).
#include "cli/trace_file.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/presets.h"

namespace ptdp {
namespace {

using nlohmann::json;

// Bounds on what a run can have measured: a rank's peak memory, and the end of any event
// (1e13 us, 116 days of training).
constexpr double kMaxPeakBytes = 1125899906842624.0;
constexpr double kMaxTraceMicros = 1e13;

class Reader {
 public:
  explicit Reader(std::string what) : what_(std::move(what)) {}
  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    throw InputError(what_, field + ": " + problem);
  }
  const json& member(const json& j, const std::string& key, const std::string& field) const {
    if (!j.is_object()) fail(field, "expected an object");
    auto it = j.find(key);
    if (it == j.end()) fail(field + "." + key, "missing");
    return *it;
  }
  double number(const json& j, const std::string& key, const std::string& field) const {
    const json& v = member(j, key, field);
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      fail(field + "." + key, "expected a finite number");
    return v.get<double>();
  }
  int64_t integer(const json& j, const std::string& key, const std::string& field, int64_t lo,
                  int64_t hi) const {
    const json& v = member(j, key, field);
    if (!v.is_number_integer()) fail(field + "." + key, "expected an integer");
    const int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX}
                          ? INT64_MAX
                          : v.get<int64_t>();
    if (x < lo || x > hi)
      fail(field + "." + key, std::to_string(x) + " is outside [" + std::to_string(lo) + ", " +
                                  std::to_string(hi) + "]");
    return x;
  }
  std::string string(const json& j, const std::string& key, const std::string& field) const {
    const json& v = member(j, key, field);
    if (!v.is_string()) fail(field + "." + key, "expected a string");
    return v.get<std::string>();
  }

 private:
  std::string what_;
};

bool parse_kind(const std::string& code, ActionKind* kind) {
  for (int k = 0; k <= static_cast<int>(ActionKind::kOptimizerStep); ++k) {
    PipelineAction a;
    a.kind = static_cast<ActionKind>(k);
    if (to_string(a) == code) {
      *kind = a.kind;
      return true;
    }
  }
  return false;
}

bool parse_op(const std::string& name, OpId* id) {
  for (int i = 0; i < kNumOpIds; ++i)
    if (op_name(static_cast<OpId>(i)) == name) {
      *id = static_cast<OpId>(i);
      return true;
    }
  return false;
}

bool parse_role(const std::string& name, OpRole* role) {
  for (OpRole r : {OpRole::kForward, OpRole::kInputGrad, OpRole::kWeightGrad, OpRole::kRecompute})
    if (to_string(r) == name) {
      *role = r;
      return true;
    }
  return false;
}

RunTraceInfo read_info(const Reader& r, const json& meta) {
  const std::string f = "otherData";
  RunTraceInfo info;
  if (!meta.is_object() || !meta.contains("format"))
    r.fail(f + ".format", std::string("missing: not a ptdp run trace (`ptdp run --trace` writes "
                                      "one; `ptdp simulate --trace` writes a timeline to view)"));
  if (r.string(meta, "format", f) != kRunTraceFormat)
    r.fail(f + ".format", std::string("not a ptdp run trace (expected \"") + kRunTraceFormat +
                              "\"; `ptdp run --trace` writes one)");
  if (const int64_t v = r.integer(meta, "version", f, 0, INT64_MAX); v < 1 || v > kRunTraceVersion)
    r.fail(f + ".version", "this ptdp reads versions 1 to " + std::to_string(kRunTraceVersion));
  const json& model = r.member(meta, "model", f);
  const json& configuration = r.member(meta, "configuration", f);
  try {
    info.model = model_from_json(model);
    info.model.validate();
  } catch (const InputError& e) {
    r.fail(f + ".model", e.what());
  }
  try {
    info.plan = plan_from_json(configuration);
    info.plan.validate(info.model);
  } catch (const InputError& e) {
    r.fail(f + ".configuration", e.what());
  }
  const auto cluster = meta.find("cluster");
  if (cluster != meta.end() && !cluster->is_null()) info.cluster = r.string(meta, "cluster", f);
  info.world_size = r.integer(meta, "world_size", f, 1, 1 << 24);
  if (info.world_size != info.plan.num_gpus())
    r.fail(f + ".world_size", std::to_string(info.world_size) + " ranks, but the plan has " +
                                  std::to_string(info.plan.num_gpus()));
  const json& job = r.member(meta, "job", f);
  info.backend = r.string(job, "backend", f + ".job");
  if (job.contains("precision")) {  // written since --bf16 trains; older traces are fp32
    const std::string p = r.string(job, "precision", f + ".job");
    if (p == "bf16")
      info.precision = DType::kBF16;
    else if (p == "fp16")
      info.precision = DType::kF16;
    else if (p != "fp32")
      r.fail(f + ".job.precision", "must be fp32, bf16 or fp16, got '" + p + "'");
  }
  info.steps = r.integer(job, "steps", f + ".job", 1, INT64_MAX);
  info.first_step = r.integer(job, "first_step", f + ".job", 0, info.steps - 1);
  info.warmup_steps = r.integer(meta, "warmup_steps", f, 0, INT64_MAX);
  const json& measured = r.member(meta, "measured", f);
  info.peak_memory_bytes = r.number(measured, "peak_memory_bytes", f + ".measured");
  info.peak_rss_bytes = r.number(measured, "peak_rss_bytes", f + ".measured");
  if (!(info.peak_memory_bytes >= 0 && info.peak_memory_bytes <= kMaxPeakBytes) ||
      !(info.peak_rss_bytes >= 0 && info.peak_rss_bytes <= kMaxPeakBytes))
    r.fail(f + ".measured", "peaks must be between 0 and 2^50 bytes (1 PiB) a rank");
  if (measured.contains("expert_load")) {
    info.expert_load = r.number(measured, "expert_load", f + ".measured");
    // The busiest rank's share over the mean: at least 1, at most ep (one rank takes all).
    const int64_t ep = std::max<int64_t>(1, info.plan.expert_parallel);
    if (!info.model.is_moe() || !(info.expert_load >= 1 && info.expert_load <= ep * (1 + 1e-9)))
      r.fail(f + ".measured.expert_load",
             info.model.is_moe()
                 ? "must be between 1 and the plan's expert parallelism, " + std::to_string(ep)
                 : std::string("given for a model without experts"));
  }
  return info;
}

}  // namespace

std::string run_trace_metadata(const RunTraceInfo& info) {
  json j;
  j["format"] = kRunTraceFormat;
  j["version"] = kRunTraceVersion;
  j["source"] = "ptdp run";
  j["model"] = to_json(info.model);
  j["configuration"] = to_json(info.plan);
  j["cluster"] = info.cluster.empty() ? json() : json(info.cluster);
  j["world_size"] = info.world_size;
  j["job"] = {{"backend", info.backend},
              {"precision", to_string(info.precision)},
              {"steps", info.steps},
              {"first_step", info.first_step}};
  j["warmup_steps"] = info.warmup_steps;
  j["time_unit"] = "ts and dur in microseconds since the first step began";
  j["measured"] = {{"peak_memory_bytes", info.peak_memory_bytes},
                   {"peak_rss_bytes", info.peak_rss_bytes}};
  if (info.expert_load > 0) j["measured"]["expert_load"] = info.expert_load;
  const std::string text = j.dump();
  return text.substr(1, text.size() - 2);  // the members, without the braces
}

RunTrace parse_run_trace(const std::string& text, const std::string& what) {
  const Reader r(what);
  const json doc = json::parse(text, nullptr, false);
  if (doc.is_discarded()) r.fail("file", "not JSON");
  RunTrace out;
  out.info = read_info(r, r.member(doc, "otherData", "trace"));
  const ParallelPlan& p = out.info.plan;
  const json& events = r.member(doc, "traceEvents", "trace");
  if (!events.is_array()) r.fail("traceEvents", "expected an array");
  for (size_t i = 0; i < events.size(); ++i) {
    const json& e = events[i];
    const std::string f = "traceEvents[" + std::to_string(i) + "]";
    if (r.string(e, "ph", f) != "X") continue;  // metadata records
    const double ts = r.number(e, "ts", f), dur = r.number(e, "dur", f);
    if (ts < 0 || dur < 0) r.fail(f, "negative ts or dur");
    if (ts + dur > kMaxTraceMicros)
      r.fail(f, "ends after 1e13 us (116 days): not a time this run measured");
    const double start = ts * 1e-6, end = (ts + dur) * 1e-6;
    const std::string cat = r.string(e, "cat", f);
    const json& args = r.member(e, "args", f);
    const std::string a = f + ".args";
    if (cat == "step") {
      if (!(dur > 0)) r.fail(f + ".dur", "a step takes time (0 given)");
      out.steps.push_back(
          {r.integer(args, "step", a, 0, out.info.steps - 1),
           r.member(args, "warmup", a).is_boolean() && r.member(args, "warmup", a).get<bool>(),
           start, end});
      continue;
    }
    const int32_t replica = static_cast<int32_t>(r.integer(e, "pid", f, 0, p.data_parallel - 1));
    const int32_t stage =
        static_cast<int32_t>(r.integer(args, "stage", a, 0, p.pipeline_parallel - 1));
    const int32_t mb =
        static_cast<int32_t>(r.integer(args, "microbatch", a, -1, p.num_microbatches() - 1));
    const int32_t chunk =
        static_cast<int32_t>(r.integer(args, "chunk", a, -1, p.virtual_stages - 1));
    if (cat == kSyncCategory) {
      const std::string name = r.string(e, "name", f);
      std::vector<TraceSync>* list = name == kNormReduction ? &out.norm_reductions
                                     : name == kGradBucket  ? &out.grad_buckets
                                     : name == kParamGather ? &out.param_gathers
                                                            : nullptr;
      if (!list)
        r.fail(f + ".name", std::string("expected ") + kNormReduction + ", " + kGradBucket +
                                " or " + kParamGather);
      list->push_back({replica, stage, start, end});
      continue;
    }
    if (cat == "op") {
      TraceOp op{replica, stage, mb, chunk, OpId::kInputLayernorm, OpRole::kForward, start, end};
      if (!parse_op(r.string(e, "name", f), &op.id)) r.fail(f + ".name", "not an op of ptdp");
      if (!parse_role(r.string(args, "role", a), &op.role)) r.fail(a + ".role", "unknown role");
      if (mb < 0 || chunk < 0) r.fail(a, "an op belongs to a microbatch and a chunk");
      out.ops.push_back(op);
      continue;
    }
    TraceAction act{replica, stage, ActionKind::kForward, mb, chunk, start, end};
    if (!parse_kind(r.string(args, "action", a), &act.kind))
      r.fail(a + ".action", "unknown action code");
    out.actions.push_back(act);
  }
  // Every span lies near the steps: within their whole length (at least 10 ms) either side.
  // The steps are rank 0's, and another rank may finish its last action a little later; a span
  // further out was not measured by this run.
  if (!out.steps.empty()) {
    double first = out.steps.front().start, last = out.steps.front().end;
    for (const TraceStep& st : out.steps) {
      first = std::min(first, st.start);
      last = std::max(last, st.end);
    }
    const double spare = std::max(1e-2, last - first);
    auto inside = [&](double start, double end, const char* kind) {
      if (start < first - spare || end > last + spare)
        r.fail("traceEvents", std::string("a ") + kind + " span lies far outside the steps (" +
                                  std::to_string(start) + " s to " + std::to_string(end) +
                                  " s; the steps run from " + std::to_string(first) + " s to " +
                                  std::to_string(last) + " s)");
    };
    for (const TraceOp& o : out.ops) inside(o.start, o.end, "op");
    for (const TraceAction& a : out.actions) inside(a.start, a.end, "schedule action");
    for (const auto* list : {&out.norm_reductions, &out.grad_buckets, &out.param_gathers})
      for (const TraceSync& x : *list) inside(x.start, x.end, "sync");
  }
  // Every rank of the plan ran the schedule: a trace missing one (a file merged from fewer
  // ranks, or from another plan's run) cannot be set against the plan.
  std::set<std::pair<int32_t, int32_t>> ran;
  for (const TraceAction& a : out.actions) ran.insert({a.replica, a.stage});
  for (int32_t d = 0; d < p.data_parallel; ++d)
    for (int32_t s = 0; s < p.pipeline_parallel; ++s)
      if (!ran.count({d, s}))
        r.fail("traceEvents", "no action of replica " + std::to_string(d) + " stage " +
                                  std::to_string(s) +
                                  ", which the plan (d=" + std::to_string(p.data_parallel) +
                                  ", p=" + std::to_string(p.pipeline_parallel) + ") has");
  return out;
}

RunTrace read_run_trace(const std::string& path, const std::string& flag) {
  return parse_run_trace(read_input_file(path, flag), flag + " " + path);
}

}  // namespace ptdp
