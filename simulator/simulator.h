// The discrete-event simulator of one training iteration.
//
// It replays the action lists of a PipelineSchedule (core/schedule.h) against op costs it is
// handed (per pipeline rank and model chunk, from the cost model), with integer picosecond
// time and one event queue. Each simulated rank has a compute stream (tensor-parallel
// collectives sit inside its passes, as Megatron runs them), context-parallel ring steps (under
// the pass's kernels) and expert all-to-alls (after them) that travel as flows between the
// group's GPUs (exposed for the cost model's time, or longer when shared links hold the flows
// back), point-to-point transfers that
// travel as flows over the cluster Topology and share link bandwidth max-min fairly, a
// data-parallel stream whose gradient buckets overlap the last backward passes when asked, and
// the optimizer step, a barrier across the pipeline (Megatron all-reduces the gradient norm
// there; the microseconds of that all-reduce are not charged).
//
// By default one representative pipeline is simulated: the ranks across data- and
// tensor-parallel groups do the same thing at the same time. `full` simulates every GPU:
// each data-parallel replica's pipeline separately (the t ranks of a tensor-parallel group
// move in lock step, paced by their slowest member, since they meet in a collective in every
// layer), with data-parallel collectives as rendezvous across replicas.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/cluster_spec.h"
#include "core/hardware_profile.h"
#include "core/schedule.h"

namespace ptdp {

using Picos = int64_t;
inline constexpr double kPicosPerSecond = 1e12;
Picos to_picos(double seconds);
inline double to_seconds(Picos t) {
  return static_cast<double>(t) / kPicosPerSecond;
}

// One pass of one microbatch through one model chunk.
struct PassCost {
  Picos compute = 0;  // kernels
  Picos tp_comm = 0;  // tensor-parallel collectives inside the pass
  // Context-parallel ring steps (exposed part) and expert all-to-alls (with the expert-tensor
  // gathers): the cost model's time, a floor, and the bytes that travel as flows (cp_bytes,
  // what each rank sends: all ring steps to its ring neighbour, under the pass's kernels with
  // p2p, or its all-gather or all-to-all share (SimulationInput::cp_comm); ep_bytes,
  // each rank's all-to-all buffers, 1/ep of them to every member of its expert group).
  Picos cp_comm = 0, ep_comm = 0;
  double cp_bytes = 0, ep_bytes = 0;
  // Megatron-FSDP's gathers and reductions that the pass's compute does not hide (the cost
  // model's CostModel::add_fsdp_pass_comm), after its kernels, counted as data-parallel time.
  Picos dp_comm = 0;
  Picos total() const { return compute + tp_comm + cp_comm + ep_comm + dp_comm; }
};

// What one microbatch costs on one model chunk. `backward` includes recomputation; for split
// (zero-bubble) schedules it is divided into `backward_input` and `backward_weight`.
struct ChunkCost {
  PassCost forward, backward, backward_input, backward_weight;
};

// Built from a configuration by planner/simulation_input.h (the cost model prices it; the
// simulator itself depends on core only).
struct SimulationInput {
  ScheduleSpec schedule;                     // the simulator generates the action lists
  std::vector<std::vector<ChunkCost>> cost;  // [pipeline rank][chunk]
  int64_t tensor_parallel = 1;
  int64_t data_parallel = 1;  // for placement: d * cp (context ranks sit inside it)
  int64_t context_parallel = 1;
  // p2p: each pass's ring steps run under its kernels (flows from each rank to the next of its
  // ring); all_gather: NCCL-like rings after them, one per member in a node; a2a: flows from
  // each rank to every other of its cp group after them; a2a+p2p: the ring's flows under the
  // kernels, between the groups (its all-to-alls, within a group, only in the pass's time).
  CpComm cp_comm = CpComm::kP2P;
  // a2a+p2p: the all-to-all groups' size A; the ring's flows go between the cp / A groups.
  int64_t cp_a2a_size = 1;
  // Expert groups within a stage's t * data_parallel ranks: expert_parallel members at a
  // stride of expert_tensor_parallel.
  int64_t expert_parallel = 1, expert_tensor_parallel = 1;
  // Pipeline transfers: each tensor-parallel rank moves `p2p_bytes` to its counterpart on the
  // neighbouring stage (the 1/t slice with the scatter/gather optimisation), plus a fixed
  // software latency and, with scatter/gather, an all-gather in the receiving node.
  double p2p_bytes = 0;
  Picos p2p_latency = 0;
  Picos p2p_gather = 0;
  // Megatron-Core's overlapped interleaved schedule (ParallelPlan::overlap_p2p_comm, used when
  // v > 1): a rank posts each steady-state forward transfer after its forward pass and each
  // backward transfer after its backward pass without waiting; a pass waits only for the
  // transfer that brings its input, and the end of the iteration for the rank's sends.
  bool overlap_p2p = false;
  // End of the iteration, per pipeline rank.
  std::vector<Picos> dp_sync;         // the whole data-parallel gradient reduction
  std::vector<Picos> dp_last_bucket;  // with overlap: the part that cannot start early
  // Per pipeline rank, each chunk's share of its gradients (the part of dp_sync its buckets
  // reduce; empty: 1 / v each).
  std::vector<std::vector<double>> dp_chunk_share;
  bool overlap_grad_reduce = false;
  Picos embedding_sync = 0;      // tied-embedding all-reduce (first and last rank)
  std::vector<Picos> optimizer;  // the optimizer step
  // Every GPU (full) or one pipeline; full is needed for stragglers.
  bool full = false;
  std::map<int64_t, double> slowdown;  // global rank -> compute time multiplier (full only)
  bool record_timeline = false;
};

struct StageStats {
  int64_t rank = 0;
  Picos compute = 0;    // forward/backward/recompute kernels
  Picos tp_comm = 0;    // tensor-parallel collectives (never overlapped)
  Picos cp_comm = 0;    // exposed context-parallel ring steps
  Picos ep_comm = 0;    // expert all-to-alls and expert-tensor gathers
  Picos pp_comm = 0;    // waiting while own pipeline transfers are in flight
  Picos dp_comm = 0;    // exposed data-parallel and embedding gradient collectives
  Picos optimizer = 0;  // gradient-norm all-reduce and optimizer step
  Picos idle = 0;       // waiting for other ranks: the pipeline bubble (and stragglers)
  Picos busy() const { return compute + tp_comm + cp_comm + ep_comm; }
};

// One span of the timeline.
enum class Stream : uint8_t { kCompute, kTensor, kPipeline, kData, kContext, kExpert };
struct Span {
  int32_t replica = 0;  // data-parallel index (0 unless full)
  int32_t rank = 0;     // pipeline rank
  Stream stream = Stream::kCompute;
  ActionKind kind = ActionKind::kForward;
  int32_t microbatch = -1;
  int32_t chunk = -1;
  Picos start = 0, end = 0;
};

struct SimulationResult {
  Picos iteration = 0;
  std::vector<StageStats> stages;  // per pipeline rank (of the replica with the slowest GPU)
  int64_t critical_stage = 0;      // the stage with the most busy time
  double bubble_fraction = 0;      // idle / busy on the critical stage (SC'21's convention)
  Picos exposed_tp = 0, exposed_pp = 0, exposed_dp = 0;  // on the critical stage
  Picos exposed_cp = 0, exposed_ep = 0;
  int64_t events = 0;
  int64_t simulated_microbatches = 0;  // < m when the periodic steady state was extrapolated
  std::vector<Span> timeline;          // when asked for
};

// Throws std::logic_error if the schedule deadlocks and InputError for inconsistent input.
// Without a timeline, a long iteration (m > 16 p) is simulated at three smaller microbatch
// counts that differ by p; when the steady state is periodic (every figure grows by the same
// amount per p microbatches) the result is extrapolated exactly, so time and memory stay
// bounded for any m; otherwise the whole iteration is simulated.
SimulationResult simulate(const SimulationInput& in, const ClusterSpec& cluster,
                          const HardwareProfile& profile);

}  // namespace ptdp
