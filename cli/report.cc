#include "cli/report.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/units.h"
#include "planner/search.h"

namespace ptdp {

std::string group_note(const ParallelPlan& p) {
  if (p.virtual_stages == 1 || p.microbatch_group_size() == p.pipeline_parallel) return "";
  return " in groups of " + std::to_string(p.microbatch_group_size());
}

std::string context_note(const ParallelPlan& p) {
  std::string s = "cp=" + std::to_string(p.context_parallel);
  if (p.context_parallel > 1 && p.cp_comm == CpComm::kA2AP2P)
    s += " (a2a+p2p: all-to-alls over " + std::to_string(p.cp_a2a_size()) + ", a ring of " +
         std::to_string(p.cp_ring_size()) + ")";
  else if (p.context_parallel > 1 && p.cp_comm != CpComm::kP2P)
    s += " (" + to_string(p.cp_comm) + ")";
  return s;
}

std::string optimizer_note(const ParallelPlan& p) {
  if (p.fsdp != FsdpSharding::kOff)
    return ", Megatron-FSDP " + to_string(p.fsdp) +
           (p.optimizer_instances > 1 ? " in " + std::to_string(p.optimizer_instances) +
                                            " instances, " + to_string(p.fsdp_outer) + " across"
                                      : std::string());
  if (p.distributed_optimizer && p.optimizer_instances > 1)
    return ", distributed optimizer in " + std::to_string(p.optimizer_instances) + " instances";
  return p.distributed_optimizer ? ", distributed optimizer" : "";
}

nlohmann::json prediction_json(const ModelSpec& m, const ParallelPlan& p, const Prediction& r) {
  nlohmann::json j;
  j["configuration"] = to_json(p);
  j["megatron_flags"] = p.megatron_flags(m, r.precision);
  j["ptdp_flags"] = p.ptdp_flags();         // give them with megatron_flags (empty: none)
  j["precision"] = to_string(r.precision);  // weights and activations, as priced
  j["iteration_time_s"] = r.iteration_time_s;
  j["tokens_per_s"] = r.tokens_per_s;
  j["model_tflops_per_gpu"] = r.model_tflops_per_gpu;
  j["model_tflops_per_gpu_all_pairs"] = r.model_tflops_per_gpu_all_pairs;
  j["hardware_tflops_per_gpu"] = r.hardware_tflops_per_gpu;
  j["mfu"] = r.mfu;
  j["fits"] = r.memory.fits;
  j["memory"] = {{"weights_gib", to_gib(r.memory.weights)},
                 {"gradients_gib", to_gib(r.memory.gradients)},
                 {"optimizer_gib", to_gib(r.memory.optimizer)},
                 {"activations_gib", to_gib(r.memory.activations)},
                 {"buffers_gib", to_gib(r.memory.buffers)},
                 {"peak_gib", to_gib(r.memory.peak)},
                 {"capacity_gib", to_gib(r.memory.capacity)}};
  // Dense (attention, router, shared experts, embeddings) and routed-expert parts of the
  // model state: the experts' shard by ep x etp and their optimizer state by the
  // expert-data-parallel ranks.
  const MemoryBreakdown& mb = r.memory;
  j["memory"]["dense"] = {{"weights_gib", to_gib(mb.weights - mb.expert_weights)},
                          {"gradients_gib", to_gib(mb.gradients - mb.expert_gradients)},
                          {"optimizer_gib", to_gib(mb.optimizer - mb.expert_optimizer)}};
  j["memory"]["expert"] = {{"weights_gib", to_gib(mb.expert_weights)},
                           {"gradients_gib", to_gib(mb.expert_gradients)},
                           {"optimizer_gib", to_gib(mb.expert_optimizer)}};
  const TimeBreakdown& b = r.breakdown;
  j["breakdown"] = {
      {"compute_s", b.compute}, {"recompute_s", b.recompute}, {"tp_comm_s", b.tp_comm},
      {"cp_comm_s", b.cp_comm}, {"ep_comm_s", b.ep_comm},     {"pp_comm_s", b.pp_comm},
      {"dp_comm_s", b.dp_comm}, {"bubble_s", b.bubble},       {"optimizer_s", b.optimizer}};
  return j;
}

std::string describe_job(const ModelSpec& m, const ClusterSpec& c, int64_t global_batch) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "%s (%.1fB parameters) on %lld x %s (%lld nodes), global batch %lld, sequence %lld",
                m.name.c_str(), m.parameters() / 1e9, static_cast<long long>(c.num_gpus()),
                c.gpu.name.c_str(), static_cast<long long>(c.num_nodes),
                static_cast<long long>(global_batch), static_cast<long long>(m.seq_length));
  return buf;
}

void print_prediction(std::ostream& out, const ModelSpec& m, const ClusterSpec& c,
                      const ParallelPlan& p, const Prediction& r) {
  char buf[256];
  out << describe_job(m, c, p.global_batch_size) << "\n";
  if (m.is_moe()) {
    std::snprintf(buf, sizeof buf, "%s ep=%lld etp=%lld (expert data-parallel %lld)%s\n",
                  context_note(p).c_str(), static_cast<long long>(p.expert_parallel),
                  static_cast<long long>(p.expert_tp()),
                  static_cast<long long>(p.expert_data_parallel()), p.fp8 ? ", FP8 GEMMs" : "");
    out << buf;
  } else if (p.context_parallel > 1 || p.fp8) {
    std::snprintf(buf, sizeof buf, "%s%s\n", context_note(p).c_str(), p.fp8 ? ", FP8 GEMMs" : "");
    out << buf;
  }
  const std::string group = group_note(p);
  std::snprintf(
      buf, sizeof buf,
      "t=%lld p=%lld d=%lld b=%lld v=%lld m=%lld microbatches%s, schedule %s, recompute %s%s%s",
      static_cast<long long>(p.tensor_parallel), static_cast<long long>(p.pipeline_parallel),
      static_cast<long long>(p.data_parallel), static_cast<long long>(p.micro_batch_size),
      static_cast<long long>(p.virtual_stages), static_cast<long long>(p.num_microbatches()),
      group.c_str(), to_string(p.schedule).c_str(), recompute_label(p).c_str(),
      p.sequence_parallel ? ", sequence parallel" : "", optimizer_note(p).c_str());
  out << buf;
  // The layers of each stage where they are uneven, or each model chunk's (as Megatron-Core's
  // layout string).
  if (!p.layers_per_chunk.empty())
    out << "\npipeline layout " << pipeline_layout_string(p.layers_per_chunk, m.mtp_num_layers);
  else if (!p.layers_per_stage.empty())
    out << "\nlayers per stage " << stage_split_summary(p);
  out << "\n\n";
  std::snprintf(buf, sizeof buf,
                "iteration time      %10.3f s\ntokens/s            %10.0f\nmodel TFLOP/s/GPU   "
                "%10.1f   (MFU %.1f%%)\n"
                "hardware TFLOP/s/GPU%10.1f   (with recomputation)\n\n",
                r.iteration_time_s, r.tokens_per_s, r.model_tflops_per_gpu, 100 * r.mfu,
                r.hardware_tflops_per_gpu);
  out << buf;
  const TimeBreakdown& b = r.breakdown;
  // Context- and expert-parallel rows only where the plan has that parallelism (a ring hidden
  // behind attention shows as 0).
  struct Part {
    const char* name;
    double s;
    bool shown = true;
  };
  const Part parts[] = {{"compute", b.compute},
                        {"recompute", b.recompute},
                        {"tensor-parallel comm", b.tp_comm},
                        {"context-parallel comm", b.cp_comm, p.context_parallel > 1},
                        {"expert-parallel comm", b.ep_comm, p.expert_parallel > 1},
                        {"pipeline bubble", b.bubble},
                        {"pipeline comm", b.pp_comm},
                        {"data-parallel comm", b.dp_comm},
                        {"optimizer step", b.optimizer}};
  out << "time breakdown (exposed)\n";
  for (const auto& [name, s, shown] : parts) {
    if (!shown) continue;
    std::snprintf(buf, sizeof buf, "  %-22s %9.3f s  %5.1f%%\n", name, s,
                  100 * s / r.iteration_time_s);
    out << buf;
  }
  const MemoryBreakdown& mem = r.memory;
  std::snprintf(buf, sizeof buf,
                "\nmemory, most loaded GPU (GiB)\n  weights %.1f  gradients %.1f  optimizer %.1f  "
                "activations %.1f  buffers %.1f\n"
                "  peak %.1f of %.1f: %s\n",
                to_gib(mem.weights), to_gib(mem.gradients), to_gib(mem.optimizer),
                to_gib(mem.activations), to_gib(mem.buffers), to_gib(mem.peak),
                to_gib(mem.capacity), mem.fits ? "fits" : "DOES NOT FIT");
  out << buf;
  if (m.is_moe()) {
    std::snprintf(buf, sizeof buf,
                  "  of which routed experts: weights %.1f  gradients %.1f  optimizer %.1f\n",
                  to_gib(mem.expert_weights), to_gib(mem.expert_gradients),
                  to_gib(mem.expert_optimizer));
    out << buf;
  }
}

}  // namespace ptdp
