// `ptdp run --dry-run`'s memory figures: what each rank would hold, and what it may hold.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/model_spec.h"
#include "core/parallel_plan.h"
#include "runtime/trainer.h"

namespace ptdp {

// Bytes one rank of `ptdp run` would use (fp32 throughout).
struct RankMemory {
  double parameters = 0, gradients = 0, optimizer = 0;  // exact: the rank's RankFootprint
  // Predicted by the memory model's formulas (planner/cost_model.cc, CostModel::memory) for
  // this pipeline rank, in 4-byte elements: the in-flight layers' activations (and the layer
  // being recomputed), the first stage's embedding output, the last stage's logits and their
  // gradient, the pipeline's send and receive buffers.
  double activations = 0;
  double peak() const { return parameters + gradients + optimizer + activations; }
};

// The model as ptdp run executes it under plan `p`: without dropout (the runtime has none), with
// the loss fused (computed in place on the logits), and with fused (flash) attention under
// context parallelism, as its ring runs it; its memory is priced on this.
ModelSpec as_executed(const ModelSpec& m, const ParallelPlan& p);
// The plan as ptdp run executes it for `m`: the settings it prices but does not run
// (execution_note) off: FP8 GEMMs, 16-bit gradient reduction, the sequence-parallel collectives'
// overlap with their GEMMs, Megatron-FSDP's sharding where it does not run sharded
// (runs_megatron_fsdp, runtime/fsdp.h: then as the distributed optimizer, or DDP), the combined
// 1F1B's all-to-all overlap (its order is run: the memory of its extra warm-up forward is not
// counted then). What a run's trace records, so that reconcile prices what ran.
ParallelPlan executed_plan(const ModelSpec& m, const ParallelPlan& p);
// "" when the runtime runs `m` as given, else a note saying what it runs instead.
std::string execution_note(const ModelSpec& m, const ParallelPlan& p);

RankMemory rank_memory(const ModelSpec& m, const ParallelPlan& p, const RankFootprint& f);

// The bytes this rank may use: `limit_gib` when given, else MemAvailable (/proc/meminfo)
// divided by the ranks on this host (the launcher's local size, else the world size).
// `source` says which, for messages.
double memory_limit_bytes(std::optional<double> limit_gib, int world_size, std::string* source);

}  // namespace ptdp
