#include "cli/run_trace.h"

#include <sstream>
#include <tuple>

#include "simulator/timeline_export.h"

namespace ptdp {
namespace {

Picos picos(double seconds) {
  return static_cast<Picos>(seconds * 1e12);
}

}  // namespace

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
  s.start = picos(e.start);
  s.end = picos(e.end);
  return s;
}

std::string run_trace_text(const TrainResult& r, RunTraceInfo info, const std::string& title) {
  info.first_step = r.first_step;
  info.peak_memory_bytes = static_cast<double>(r.peak_memory_bytes);
  info.peak_rss_bytes = static_cast<double>(r.peak_rss_bytes);
  info.expert_load = r.expert_load;
  std::vector<Span> spans;
  for (const TimelineEvent& e : r.timeline) spans.push_back(to_span(e));
  TraceExtras x;
  x.other_data = run_trace_metadata(info);
  for (const OpTimelineEvent& e : r.op_timeline)
    x.ops.push_back({e.dp, e.pp, e.op.microbatch, e.op.chunk, std::string(op_name(e.op.id)),
                     to_string(e.op.role), picos(e.op.start), picos(e.op.end), "op", std::nullopt});
  // The norm all-reduce on the ops track; buckets and gathers beside the passes, on the data
  // stream's track.
  for (const auto& [events, name, stream] :
       {std::tuple{&r.norm_reductions, kNormReduction, std::optional<Stream>{}},
        std::tuple{&r.grad_buckets, kGradBucket, std::optional{Stream::kData}},
        std::tuple{&r.param_gathers, kParamGather, std::optional{Stream::kData}}})
    for (const SyncEvent& e : *events)
      x.ops.push_back(
          {e.dp, e.pp, -1, -1, name, "", picos(e.start), picos(e.end), kSyncCategory, stream});
  for (const StepStats& s : r.steps)
    x.steps.push_back({s.step, s.step < r.first_step + info.warmup_steps, picos(s.start),
                       picos(s.start + s.seconds)});
  std::ostringstream out;
  write_chrome_trace(out, spans, title, x);
  return out.str();
}

}  // namespace ptdp
