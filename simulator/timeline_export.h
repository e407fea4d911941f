// Timeline export: the simulator's (and later the runtime's) spans as a Chrome trace-event
// JSON file, which Perfetto (ui.perfetto.dev) and chrome://tracing open, and as an SVG Gantt
// chart a person can read in any browser.
//
// Tracks: one process per data-parallel replica, one thread per (pipeline rank, stream):
// compute, tensor-parallel collectives, pipeline p2p and data-parallel reduction. Span names
// carry the microbatch and chunk ("F3.1": forward of microbatch 3 on chunk 1); colours follow
// the pass kind, shaded by chunk.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "simulator/simulator.h"

namespace ptdp {

std::string span_name(const Span& s);

void write_chrome_trace(std::ostream& out, const std::vector<Span>& spans,
                        const std::string& title);
void write_svg(std::ostream& out, const std::vector<Span>& spans, Picos end,
               const std::string& title);

}  // namespace ptdp
