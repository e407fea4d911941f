// Fuzzes the trace `ptdp reconcile --trace FILE` reads (cli/trace_file.h read_run_trace): the
// Chrome trace `ptdp run --trace` writes, with the job's metadata in "otherData". Every span
// read back must lie inside the plan it claims (stage, replica, chunk, microbatch) and last a
// finite, non-negative time.
#include <cmath>

#include "cli/trace_file.h"
#include "tests/fuzz/fuzz_support.h"

using namespace ptdp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_scratch_file("run_trace.json", data, size);
  fuzz::expect_value_or_input_error([&] {
    const RunTrace t = read_run_trace(path);
    const ParallelPlan& p = t.info.plan;
    for (const TraceOp& o : t.ops) {
      if (o.stage < 0 || o.stage >= p.pipeline_parallel || o.replica < 0 ||
          o.replica >= p.data_parallel || o.chunk < 0 || o.chunk >= p.virtual_stages)
        fuzz::fail("an op outside the plan");
      if (!(o.end >= o.start) || !std::isfinite(o.end)) fuzz::fail("an op of no duration");
    }
    for (const TraceAction& a : t.actions)
      if (a.stage < 0 || a.stage >= p.pipeline_parallel || !(a.end >= a.start))
        fuzz::fail("an action outside the plan");
    for (const TraceSync& n : t.norm_reductions)
      if (n.stage < 0 || n.stage >= p.pipeline_parallel || !(n.end >= n.start))
        fuzz::fail("a norm all-reduce outside the plan");
    for (const TraceStep& s : t.steps)
      if (s.step < 0 || s.step >= t.info.steps) fuzz::fail("a step outside the run");
  });
  return 0;
}
