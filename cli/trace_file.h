// The trace `ptdp run --trace` writes and `ptdp reconcile` reads: a Chrome trace-event file
// (simulator/timeline_export.h) whose "otherData" records the job (model, plan, optional
// cluster, world size, backend and steps), the measured memory peaks and the warm-up steps,
// and whose events hold every action of every pipeline rank (category: the stream), every op
// of every pass (category "op") and one marker per training step (category "step").
// docs/file_formats.md describes the fields.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/layer_ops.h"
#include "core/model_spec.h"
#include "core/parallel_plan.h"
#include "core/schedule.h"

namespace ptdp {

inline constexpr const char* kRunTraceFormat = "ptdp-run-trace";
// 2 added the "sync" events dp_grad_bucket and dp_param_gather; version 1 files still read.
inline constexpr int64_t kRunTraceVersion = 2;

struct TraceAction {
  int32_t replica = 0, stage = 0;
  ActionKind kind = ActionKind::kForward;
  int32_t microbatch = -1, chunk = -1;
  double start = 0, end = 0;  // seconds since the first step began
};

struct TraceOp {
  int32_t replica = 0, stage = 0, microbatch = -1, chunk = -1;
  OpId id = OpId::kInputLayernorm;
  OpRole role = OpRole::kForward;
  double start = 0, end = 0;
};

// Inside the optimizer step: the gradient-norm all-reduce (category "sync", named so).
inline constexpr const char* kSyncCategory = "sync";
inline constexpr const char* kNormReduction = "grad_norm_allreduce";
// --overlap-grad-reduce: one data-parallel gradient bucket, queued during the backward pass (same
// category), from when it was queued to when its rank saw it complete.
inline constexpr const char* kGradBucket = "dp_grad_bucket";
// --overlap-param-gather: one part's parameter all-gather, queued in the optimizer step, from
// then to when its rank saw it complete.
inline constexpr const char* kParamGather = "dp_param_gather";
struct TraceSync {
  int32_t replica = 0, stage = 0;
  double start = 0, end = 0;
};

struct TraceStep {
  int64_t step = 0;
  bool warmup = false;
  double start = 0, end = 0;
};

// What the run's metadata says (otherData), apart from the title.
struct RunTraceInfo {
  ModelSpec model;
  ParallelPlan plan;
  std::string cluster;  // as given to `ptdp run --cluster` (empty: not recorded)
  int64_t world_size = 1;
  std::string backend = "cpu";
  DType precision = DType::kF32;  // of weights and activations (--bf16: bf16)
  int64_t steps = 0, first_step = 0, warmup_steps = 1;
  double peak_memory_bytes = 0, peak_rss_bytes = 0;
  // MoE models: the busiest expert-parallel rank's routed rows over the mean
  // (TrainResult::expert_load; "measured.expert_load", absent before 2026-11-27); 0: none.
  double expert_load = 0;
};

struct RunTrace {
  RunTraceInfo info;
  std::vector<TraceAction> actions;
  std::vector<TraceOp> ops;
  std::vector<TraceSync> norm_reductions;
  std::vector<TraceSync> grad_buckets;
  std::vector<TraceSync> param_gathers;
  std::vector<TraceStep> steps;
};

// The members of "otherData" for `info` as JSON text (simulator/timeline_export.h TraceExtras).
std::string run_trace_metadata(const RunTraceInfo& info);

// Reads and checks a run trace. Throws InputError(flag + " " + path, "<field>: <problem>") for a
// file that is not JSON, is not a ptdp run trace, misses a field or holds a value out of range
// (a stage, replica or chunk the plan does not have, an unknown op or role, a negative span).
RunTrace read_run_trace(const std::string& path, const std::string& flag = "--trace");
// The same on a parsed document (`what` names it in errors).
RunTrace parse_run_trace(const std::string& text, const std::string& what);

}  // namespace ptdp
