// Timeline export: the simulator's (and later the runtime's) spans as a Chrome trace-event
// JSON file, which Perfetto (ui.perfetto.dev) and chrome://tracing open, and as an SVG Gantt
// chart a person can read in any browser.
//
// Tracks: one process per data-parallel replica, one thread per (pipeline rank, stream):
// compute, tensor-parallel collectives, pipeline p2p, data-parallel reduction, context-parallel
// ring steps ("context") and expert all-to-alls ("expert"). Span names
// carry the microbatch and chunk ("F3.1": forward of microbatch 3 on chunk 1); colours follow
// the pass kind, shaded by chunk. Every span's args carry its microbatch, chunk, pipeline
// stage and action code ("F", "B", "sF", "sync", "opt": core/schedule.h's to_string).
//
// A measured run (`ptdp run --trace`) adds TraceExtras: one more track per pipeline rank with
// each op of its passes (category "op"), a track of step markers (category "step") and the
// run's metadata in "otherData" (docs/file_formats.md; read back by cli/trace_file.h).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "simulator/simulator.h"

namespace ptdp {

std::string span_name(const Span& s);

// One op of a pass (layer_ops.h's op name and role name), or with another category a named
// piece of a step-level action (e.g. "sync": the gradient-norm all-reduce), without a role.
struct OpSpan {
  int32_t replica = 0, rank = 0, microbatch = -1, chunk = -1;
  std::string name, role;
  Picos start = 0, end = 0;
  std::string category = "op";
  // Drawn on the rank's ops track, or with a stream on that stream's track (overlapped gradient
  // buckets run beside the passes' ops, on the data stream).
  std::optional<Stream> stream;
};

// One training step; the warm-up step is marked so that readers leave it out of their figures.
struct StepSpan {
  int64_t step = 0;
  bool warmup = false;
  Picos start = 0, end = 0;
};

struct TraceExtras {
  // Further members of "otherData" as JSON text, `"key":value,...` without braces (may be empty).
  std::string other_data;
  std::vector<OpSpan> ops;
  std::vector<StepSpan> steps;
};

// Track ids of the extras: ops of pipeline rank r on tid kOpTrack + r, steps on kStepTrack (pid 0).
inline constexpr int kOpTrack = 10000;
inline constexpr int kStepTrack = 20000;

void write_chrome_trace(std::ostream& out, const std::vector<Span>& spans,
                        const std::string& title);
void write_chrome_trace(std::ostream& out, const std::vector<Span>& spans, const std::string& title,
                        const TraceExtras& extras);
void write_svg(std::ostream& out, const std::vector<Span>& spans, Picos end,
               const std::string& title);

}  // namespace ptdp
