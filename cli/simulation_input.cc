#include "cli/simulation_input.h"

#include <algorithm>

#include "core/units.h"

namespace ptdp {
namespace {

PassCost picos(const PassTime& t) {
  return {to_picos(t.compute), to_picos(t.tp_comm)};
}

double grad_bytes(const ParallelPlan& p) {
  return p.fp32_grad_reduce ? 4.0 : 2.0;
}

}  // namespace

SimulationInput simulation_input(const CostModel& cm, const ParallelPlan& p) {
  const ModelSpec& m = cm.model();
  const ClusterSpec& c = cm.cluster();
  const HardwareProfile& h = cm.profile();
  const CommModel comm(c, h);
  SimulationInput in;
  in.schedule = schedule_spec(p, !m.untie_embeddings_and_output_weights);
  in.tensor_parallel = p.tensor_parallel;
  in.data_parallel = p.data_parallel;
  in.overlap_grad_reduce = p.overlap_grad_reduce && p.data_parallel > 1;
  const int64_t pp = p.pipeline_parallel, v = p.virtual_stages;
  const GroupSpan dp = data_group_span(c, p);
  for (int64_t r = 0; r < pp; ++r) {
    std::vector<ChunkCost> chunks;
    for (int64_t k = 0; k < v; ++k) {
      const ChunkTime t = cm.chunk_time(p, r, k);
      ChunkCost cc;
      cc.forward = picos(t.forward);
      PassTime backward = t.backward;
      backward.compute += t.recompute.compute;
      backward.tp_comm += t.recompute.tp_comm;
      cc.backward = picos(backward);
      cc.backward_weight = picos(t.weight_grad);
      cc.backward_input = {cc.backward.compute - cc.backward_weight.compute,
                           cc.backward.tp_comm - cc.backward_weight.tp_comm};
      chunks.push_back(cc);
    }
    in.cost.push_back(chunks);
    const double params = cm.parameters_on_stage(p, r);
    const double gbytes = params * grad_bytes(p);
    double dp_time = 0;
    if (p.distributed_optimizer)
      dp_time = comm.collective_time(Collective::kReduceScatter, gbytes, dp) +
                comm.collective_time(Collective::kAllGather, params * 2.0, dp);
    else
      dp_time = comm.collective_time(Collective::kAllReduce, gbytes, dp);
    in.dp_sync.push_back(to_picos(dp_time));
    in.dp_last_bucket.push_back(
        to_picos(dp_time / std::max<double>(1.0, static_cast<double>(p.layers_on_stage(m, r)))));
    const double opt_params =
        params / (p.distributed_optimizer ? static_cast<double>(p.data_parallel) : 1.0);
    in.optimizer.push_back(to_picos(cm.memory_time(opt_params * h.optimizer_bytes_per_param)));
  }

  // Pipeline transfers, as CommModel::p2p_time prices them, split into a fixed latency, the
  // bytes each tensor-parallel rank moves (a flow in the topology) and the gather.
  if (pp > 1) {
    const double act = static_cast<double>(p.micro_batch_size * m.seq_length) *
                       static_cast<double>(m.hidden_size) * 2.0 /
                       (p.sequence_parallel ? static_cast<double>(p.tensor_parallel) : 1.0);
    const bool inter = pipeline_crosses_nodes(c, p);
    const LinkEfficiency& link = inter ? h.network : h.nvlink;
    in.p2p_latency = to_picos((link.latency_us + link.per_step_latency_us) * kMicrosecond);
    in.p2p_bytes = act;
    if (inter && p.scatter_gather_p2p && p.tensor_parallel > 1) {
      in.p2p_bytes = act / static_cast<double>(p.tensor_parallel);
      in.p2p_gather =
          to_picos(comm.collective_time(Collective::kAllGather, act, tensor_group_span(c, p)));
    }
    if (!m.untie_embeddings_and_output_weights) {
      GroupSpan pair;
      pair.size = 2;
      pair.nodes = inter ? 2 : 1;
      pair.concurrent_per_node = c.gpus_per_node;
      const double emb = static_cast<double>(m.vocab_size * m.hidden_size) /
                         static_cast<double>(p.tensor_parallel) * grad_bytes(p);
      in.embedding_sync = to_picos(comm.collective_time(Collective::kAllReduce, emb, pair));
    }
  }
  return in;
}

SimulationResult simulate_plan(const CostModel& cm, const ParallelPlan& p, bool full,
                               const std::map<int64_t, double>& slowdown, bool timeline) {
  SimulationInput in = simulation_input(cm, p);
  in.full = full;
  in.slowdown = slowdown;
  in.record_timeline = timeline;
  return simulate(in, cm.cluster(), cm.profile());
}

}  // namespace ptdp
