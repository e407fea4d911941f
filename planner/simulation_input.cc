#include "planner/simulation_input.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "core/units.h"

namespace ptdp {
namespace {

PassCost picos(const PassTime& t) {
  PassCost c;
  c.compute = to_picos(t.compute);
  c.tp_comm = to_picos(t.tp_comm);
  c.cp_comm = to_picos(t.cp_comm);
  c.ep_comm = to_picos(t.ep_comm);
  c.dp_comm = to_picos(t.dp_comm);
  c.cp_bytes = t.cp_bytes;
  c.ep_bytes = t.ep_bytes;
  return c;
}

PassCost plus(const PassCost& a, const PassCost& b, int sign = 1) {
  PassCost c;
  c.compute = a.compute + sign * b.compute;
  c.tp_comm = a.tp_comm + sign * b.tp_comm;
  c.cp_comm = a.cp_comm + sign * b.cp_comm;
  c.ep_comm = a.ep_comm + sign * b.ep_comm;
  c.dp_comm = a.dp_comm + sign * b.dp_comm;
  c.cp_bytes = a.cp_bytes + sign * b.cp_bytes;
  c.ep_bytes = a.ep_bytes + sign * b.ep_bytes;
  return c;
}

}  // namespace

SimulationInput simulation_input(const CostModel& cm, const ParallelPlan& p) {
  const ModelSpec& m = cm.model();
  SimulationInput in;
  // The first and last stage all-reduce their word embeddings' gradients when tied, or when
  // multi-token prediction keeps a copy on the last (CostModel::embedding_sync_time).
  in.schedule = schedule_spec(p, m.last_stage_shares_word_embedding());
  in.tensor_parallel = p.tensor_parallel;
  // Context-parallel ranks sit between the tensor- and data-parallel ones (Megatron's order),
  // so for placement a stage's replicas are its d * cp context/data-parallel ranks.
  in.data_parallel = p.data_parallel * p.context_parallel;
  in.context_parallel = p.context_parallel;
  in.cp_comm = p.cp_comm;
  in.cp_a2a_size = p.cp_a2a_size();
  in.expert_parallel = p.expert_parallel;
  in.expert_tensor_parallel = p.expert_tp();
  // Expert gradients overlap too when only the experts have data-parallel replicas (d cp = 1,
  // expert-data-parallel > 1), as the analytic model and Megatron-Core do.
  // Megatron-FSDP's sharded gradients are reduced in each backward pass (PassCost::dp_comm):
  // what is left after the last one, the weights' all-gather, waits for it.
  in.overlap_grad_reduce = p.overlap_grad_reduce && !p.shards_gradients() &&
                           (in.data_parallel > 1 || p.expert_data_parallel() > 1);
  const int64_t pp = p.pipeline_parallel, v = p.virtual_stages;
  for (int64_t r = 0; r < pp; ++r) {
    std::vector<ChunkCost> chunks;
    for (int64_t k = 0; k < v; ++k) {
      const ChunkTime t = cm.chunk_time(p, r, k);
      ChunkCost cc;
      cc.forward = picos(t.forward);
      cc.backward = plus(picos(t.backward), picos(t.recompute));
      cc.backward_weight = picos(t.weight_grad);
      cc.backward_input = plus(cc.backward, cc.backward_weight, -1);
      chunks.push_back(cc);
    }
    in.cost.push_back(chunks);
    // Each stage reduces and updates its own parameters.
    const double experts = cm.expert_parameters_on_stage(p, r);
    const double params = cm.parameters_on_stage(p, r) - experts;
    double forward = 0;  // one microbatch through all the stage's chunks
    for (int64_t k = 0; k < v; ++k) forward += cm.chunk_time(p, r, k).forward.total();
    const double dp_time = cm.gradient_sync_time(p, params) +
                           cm.expert_gradient_sync_time(p, experts) -
                           cm.hidden_param_gather(p, params, p.layers_on_stage(m, r), forward);
    // The sequence-parallel all-reduce follows the last bucket, as predict adds it.
    const double sp_sync = cm.sequence_parallel_grad_sync_time(p, r);
    in.dp_sync.push_back(to_picos(dp_time + sp_sync));
    in.dp_last_bucket.push_back(
        to_picos(last_gradient_bucket_time(dp_time, p.layers_on_stage(m, r)) + sp_sync));
    // Each chunk's buckets reduce its own parameters' gradients.
    std::vector<double> share;
    const double stage = cm.parameters_on_stage(p, r);
    for (int64_t k = 0; k < v; ++k)
      share.push_back(stage > 0 ? cm.parameters_in_chunk(p, r, k) / stage
                                : 1.0 / static_cast<double>(v));
    in.dp_chunk_share.push_back(std::move(share));
    in.optimizer.push_back(to_picos(cm.optimizer_time(p, params, experts)));
  }
  in.embedding_sync = to_picos(cm.embedding_sync_time(p));

  // Pipeline transfers, split as CommModel::p2p_split prices them: the bytes each
  // tensor-parallel rank moves travel as a flow in the topology.
  if (pp > 1) {
    const P2PSplit split = cm.comm().p2p_split(cm.activation_message_bytes(p), p);
    in.p2p_latency = to_picos(split.latency_s);
    in.p2p_bytes = split.bytes;
    in.p2p_gather = to_picos(split.gather_s);
    in.overlap_p2p = p.overlap_p2p_comm && v > 1;
  }
  return in;
}

SimulationResult simulate_plan(const CostModel& cm, const ParallelPlan& p, bool full,
                               const std::map<int64_t, double>& slowdown, bool timeline) {
  // The simulator's clock counts int64 picoseconds (about 106 days); an iteration beyond
  // kMaxSimulatedSeconds, slowest rank included, is refused rather than overflowing it.
  double slowest = 1;
  for (const auto& [rank, factor] : slowdown) slowest = std::max(slowest, factor);
  const double predicted = cm.predict(p).iteration_time_s;
  if (!(predicted * slowest <= kMaxSimulatedSeconds))
    throw InputError(slowest > 1 && predicted <= kMaxSimulatedSeconds ? "--slow-rank" : "--profile",
                     "the iteration is predicted at " + std::to_string(predicted) + " s" +
                         (slowest > 1 ? " (x" + std::to_string(slowest) + " on the slowest rank)"
                                      : std::string()) +
                         ", beyond the " +
                         std::to_string(static_cast<int64_t>(kMaxSimulatedSeconds)) +
                         " s the simulator covers; check the cluster's and profile's rates");
  SimulationInput in = simulation_input(cm, p);
  in.full = full;
  in.slowdown = slowdown;
  in.record_timeline = timeline;
  return simulate(in, cm.cluster(), cm.profile());
}

}  // namespace ptdp
