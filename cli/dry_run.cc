#include "cli/dry_run.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "core/error.h"
#include "core/layer_ops.h"
#include "core/units.h"
#include "planner/cost_model.h"
#include "runtime/fsdp.h"

namespace ptdp {

ModelSpec as_executed(const ModelSpec& m, const ParallelPlan& p) {
  ModelSpec run = m;
  run.attention_dropout = 0;
  run.hidden_dropout = 0;
  run.cross_entropy_fusion = true;  // the runtime's loss runs in place on the logits
  // Context parallelism runs fused (flash) attention whatever the model says, as Megatron-Core
  // does and as the op list prices it (runtime/context_parallel.h).
  if (p.context_parallel > 1) run.flash_attention = true;
  return run;
}

ParallelPlan executed_plan(const ModelSpec& m, const ParallelPlan& p) {
  ParallelPlan run = p;
  run.fp8 = false;
  run.fp32_grad_reduce = true;
  run.tp_comm_overlap = false;
  run.overlap_moe_ep_comm = false;
  if (runs_megatron_fsdp(m, p)) {      // sharded as Megatron-FSDP shards it, with nothing to
    run.overlap_grad_reduce = false;   // overlap: the passes gather and reduce themselves, and
    run.overlap_param_gather = false;  // the step gathers what stays whole
    return run;
  }
  run.fsdp = FsdpSharding::kOff;  // the distributed optimizer's layout (or DDP's for no_shard)
  // HSDP: the distributed optimizer in the same instances, or (HFSDP, its states sharded across
  // them) in one.
  if (run.fsdp_outer == FsdpSharding::kOptim) run.optimizer_instances = 1;
  run.fsdp_outer = FsdpSharding::kNoShard;
  return run;
}

std::string execution_note(const ModelSpec& m, const ParallelPlan& p) {
  std::string note;
  if (m.attention_dropout > 0 || m.hidden_dropout > 0)
    note = "trains without dropout (ptdp run has none)";
  // Settings plan and predict price that the runtime does not execute.
  auto add = [&note](const std::string& what) { note += (note.empty() ? "" : "; ") + what; };
  if (!p.fp32_grad_reduce && p.data_parallel * p.context_parallel > 1)
    add("reduces gradients in fp32 (--fp16-grad-reduce is priced, not run)");
  if (p.fp8)
    add("runs its GEMMs in the run's precision (--fp8-format is priced, not run; Transformer "
        "Engine's FP8 GEMMs are not in ptdp's kernels)");
  if (p.overlap_moe_ep_comm)
    add("runs each combined step's two passes one after the other (--overlap-moe-expert-"
        "parallel-comm: its schedule is run, its overlap priced)");
  if (p.shards_gradients() && p.data_parallel * p.context_parallel > 1 && !runs_megatron_fsdp(m, p))
    add(std::string(p.shards_weights()
                        ? "keeps whole weights and gradients and reduces the gradients"
                        : "keeps whole gradients and reduces them") +
        " once a step, as the distributed optimizer does" +
        (p.optimizer_instances > 1
             ? std::string(p.fsdp_outer == FsdpSharding::kOptim
                               ? ""
                               : " in the same " + std::to_string(p.optimizer_instances) +
                                     " instances")
             : std::string()) +
        " (--data-parallel-sharding-strategy " + to_string(p.fsdp) +
        " is priced, not run: same math, more memory, fewer collectives)");
  if (p.sequence_parallel && p.tensor_parallel > 1 && p.schedule != Schedule::kZeroBubbleH1)
    add("gathers QKV's and FC1's inputs again for their weight gradients before the input-"
        "gradient GEMMs, not behind them (priced as Megatron overlaps them)");
  if (p.tp_comm_overlap && p.tensor_parallel > 1)
    add("runs the sequence-parallel collectives after their GEMMs (--tp-comm-overlap is priced, "
        "not run)");
  return note;
}

RankMemory rank_memory(const ModelSpec& model, const ParallelPlan& p, const RankFootprint& f) {
  constexpr double kFloat = 4.0;  // gradients and optimizer states are fp32
  // Weights and activations in the run's precision (fp32, or bf16 with --bf16).
  const double element = static_cast<double>(dtype_bytes(f.precision));
  // With context parallelism a rank holds s / cp tokens of each microbatch (two of the 2 cp
  // chunks, runtime/context_parallel.h), as the memory model counts them; with a heads
  // all-to-all (a2a, a2a+p2p) also the moved Q, K, V and output it keeps for the backward pass.
  const ModelSpec m = as_executed(model, p);
  const ParallelPlan& local = p;
  RankMemory r;
  r.parameters = element * static_cast<double>(f.parameter_floats);
  r.gradients = kFloat * static_cast<double>(f.parameter_floats);
  if (f.fsdp) {  // Megatron-FSDP: the shards, what stays whole, and the windows at their most
    const FsdpHeld& held = f.fsdp_held;
    r.parameters = element * static_cast<double>(held.weights + held.gathered);
    r.gradients = kFloat * static_cast<double>(held.gradients + held.gradient_windows);
  }
  r.optimizer = kFloat * static_cast<double>(f.optimizer_floats);
  const std::vector<int64_t> moe_chunks = moe_layers_per_chunk(m, local);
  const ActivationMemory activations(m, local, f.precision, moe_chunks);
  r.activations = activations.on_stage(f.pp) + activations.p2p_buffers();
  if (f.pp == p.pipeline_parallel - 1) {
    // The logits of the vocabulary shard and their gradient, freed by the LM head's backward
    // pass (runtime/embedding_head.cc), as the memory model counts them.
    const double tokens =
        static_cast<double>(p.micro_batch_size * (m.seq_length / p.context_parallel));
    const double logits =
        tokens *
        std::ceil(static_cast<double>(m.vocab_size) / static_cast<double>(p.tensor_parallel)) *
        2.0 * element;
    r.activations += activations.logits_beyond_transient(f.pp, logits);
  }
  return r;
}

namespace {

// MemAvailable of /proc/meminfo in bytes; 0 if unknown.
double mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (in >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024.0;
    in.ignore(1 << 20, '\n');
  }
  return 0;
}

}  // namespace

double memory_limit_bytes(std::optional<double> limit_gib, int world_size, std::string* source) {
  if (limit_gib) {
    if (!(*limit_gib > 0 && std::isfinite(*limit_gib)))
      throw InputError("--memory-limit-gib", "must be positive and finite");
    *source = "--memory-limit-gib";
    return *limit_gib * kGiB;
  }
  int local = world_size;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})
    if (const char* v = std::getenv(name)) local = std::max(1, std::atoi(v));
  const double available = mem_available();
  if (available <= 0) {
    *source = "no limit (MemAvailable unknown)";
    return HUGE_VAL;
  }
  *source = "MemAvailable / " + std::to_string(local) + " ranks on this host";
  return available / local;
}

}  // namespace ptdp
