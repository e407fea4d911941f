#include "cli/dry_run.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "core/error.h"
#include "core/layer_ops.h"
#include "planner/cost_model.h"

namespace ptdp {

RankMemory rank_memory(const ModelSpec& m, const ParallelPlan& p, const RankFootprint& f) {
  constexpr double kFloat = 4.0;
  // The memory model counts 16-bit activations (2 bytes an element); the runtime keeps fp32.
  constexpr double kActivationScale = kFloat / 2.0;
  RankMemory r;
  r.parameters = kFloat * static_cast<double>(f.parameter_floats);
  r.gradients = r.parameters;
  r.optimizer = kFloat * static_cast<double>(f.optimizer_floats);

  const LayerShape shape = layer_shape(p);
  LayerShape full = shape;
  full.recompute = Recompute::kNone;
  const int64_t layers = p.layers_on_stage(m, f.pp);
  const double inflight = inflight_layer_activations(p, f.pp, layers);
  double act = inflight * layer_activation_bytes(m, shape);
  if (p.recompute != Recompute::kNone) act += layer_activation_bytes(m, full);
  act *= kActivationScale;
  const double tokens = static_cast<double>(p.micro_batch_size * m.seq_length);
  const double h = static_cast<double>(m.hidden_size), t = static_cast<double>(p.tensor_parallel);
  const double sp = p.sequence_parallel ? t : 1.0;
  if (f.pp == 0 && layers > 0)  // the embedding's output of every in-flight microbatch
    act += inflight / static_cast<double>(layers) * static_cast<double>(p.virtual_stages) * tokens *
           h * kFloat / sp;
  if (f.pp == p.pipeline_parallel - 1)  // logits of the vocabulary shard and their gradient
    act += tokens * std::ceil(static_cast<double>(m.vocab_size) / t) * 2.0 * kFloat;
  if (p.pipeline_parallel > 1) act += 4.0 * tokens * h * kFloat / sp;  // send/receive buffers
  r.activations = act;
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
    if (!(*limit_gib > 0)) throw InputError("--memory-limit-gib", "must be positive");
    *source = "--memory-limit-gib";
    return *limit_gib * 1024.0 * 1024.0 * 1024.0;
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
