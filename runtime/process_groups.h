// ProcessGroups: where a global rank sits in the (t, p, d) grid, and the ranks of each of its
// parallel groups, in Megatron-LM's order: tensor-parallel innermost, then data-parallel, then
// pipeline-parallel, so global rank = tp + t * (dp + d * pp). Pure arithmetic: the
// communicators for these groups are made by a Communicator backend.
#pragma once

#include <cstdint>
#include <vector>

#include "core/parallel_plan.h"

namespace ptdp {

struct GridPosition {
  int64_t tp = 0, dp = 0, pp = 0;
};

class ProcessGroups {
 public:
  // Throws InputError("world size", ...) unless world == t * p * d.
  ProcessGroups(int64_t world, int64_t t, int64_t p, int64_t d, int64_t rank);

  int64_t rank() const { return rank_; }
  GridPosition position() const { return pos_; }
  int64_t global_rank(int64_t tp, int64_t dp, int64_t pp) const {
    return megatron_global_rank(t_, d_, tp, dp, pp);
  }

  std::vector<int64_t> tensor_group() const;    // same dp, pp; tp = 0..t-1
  std::vector<int64_t> data_group() const;      // same tp, pp; dp = 0..d-1
  std::vector<int64_t> pipeline_group() const;  // same tp, dp; pp = 0..p-1
  std::vector<int64_t> model_group() const;     // same dp: every tp and pp (gradient norm)
  // First and last pipeline stage of this rank's (tp, dp) column: tied-embedding gradients.
  std::vector<int64_t> embedding_group() const;
  // Colours for a communicator split: ranks with equal colour share a group.
  int64_t tensor_color() const { return pos_.dp + d_ * pos_.pp; }
  int64_t data_color() const { return pos_.tp + t_ * pos_.pp; }
  int64_t pipeline_color() const { return pos_.tp + t_ * pos_.dp; }
  int64_t model_color() const { return pos_.dp; }

  int64_t t() const { return t_; }
  int64_t p() const { return p_; }
  int64_t d() const { return d_; }

 private:
  int64_t t_, p_, d_, rank_;
  GridPosition pos_;
};

}  // namespace ptdp
