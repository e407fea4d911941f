// The measured timeline of `ptdp run` as a run trace (cli/trace_file.h): the actions of every
// pipeline rank, the ops of every pass, one marker per step and the job's metadata, in the
// simulator's Chrome trace format (simulator/timeline_export.h).
#pragma once

#include <string>
#include <vector>

#include "cli/trace_file.h"
#include "runtime/trainer.h"
#include "simulator/simulator.h"

namespace ptdp {

// A measured action as a timeline span (stream by kind: compute, pipeline p2p, data-parallel).
Span to_span(const TimelineEvent& e);

// The trace text of a run: `info` gives the metadata (its peaks are taken from `r`), the
// first info.warmup_steps steps are marked as warm-up.
std::string run_trace_text(const TrainResult& r, RunTraceInfo info, const std::string& title);

}  // namespace ptdp
