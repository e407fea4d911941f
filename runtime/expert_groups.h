// Expert parallelism's process groups (Megatron-Core's expert grid): the t * d ranks of one
// pipeline stage, in the dense order (tensor-parallel innermost, global rank
// tp + t * (dp + d * pp)), regroup for the routed experts of MoE layers as etp (innermost) x
// ep x expert-data-parallel, edp = t * d / (etp * ep). With context parallelism d is the
// runtime's d * cp (the cp ranks of one data-parallel replica are consecutive in dp), so the
// grid spans t * cp * d ranks, as Megatron-Core's does. An MoE layer's tokens are exchanged
// (all-to-all) among the ep ranks of an expert-parallel group; each expert's weights are split
// over the etp ranks of an expert-tensor group; the edp ranks of an expert-data-parallel group
// hold the same expert shard and reduce its gradients.
#pragma once

#include <cstdint>

namespace ptdp {

struct ExpertPosition {
  int64_t etp = 1, ep = 1, edp = 1;                 // group sizes
  int64_t etp_rank = 0, ep_rank = 0, edp_rank = 0;  // this rank's index in each
  // Colours for a communicator split of the world (equal colour: same group).
  int64_t etp_color = 0, ep_color = 0, edp_color = 0;
};

// For a rank at (tp, dp, pp) of a (t, d) stage grid. Throws InputError naming
// --expert-model-parallel-size unless etp * ep divides t * d.
ExpertPosition expert_position(int64_t t, int64_t d, int64_t etp, int64_t ep, int64_t tp,
                               int64_t dp, int64_t pp);

}  // namespace ptdp
