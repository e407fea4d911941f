#include "runtime/process_groups.h"

#include <string>

#include "core/error.h"

namespace ptdp {

ProcessGroups::ProcessGroups(int64_t world, int64_t t, int64_t p, int64_t d, int64_t rank)
    : t_(t), p_(p), d_(d), rank_(rank) {
  if (t < 1 || p < 1 || d < 1) throw InputError("world size", "t, p and d must be positive");
  if (world != t * p * d)
    throw InputError("world size", std::to_string(world) + " ranks, but t * p * d = " +
                                       std::to_string(t) + " * " + std::to_string(p) + " * " +
                                       std::to_string(d) + " = " + std::to_string(t * p * d));
  if (rank < 0 || rank >= world)
    throw InputError("rank", std::to_string(rank) + " is out of range");
  pos_.tp = rank % t;
  pos_.dp = (rank / t) % d;
  pos_.pp = rank / (t * d);
}

std::vector<int64_t> ProcessGroups::tensor_group() const {
  std::vector<int64_t> g;
  for (int64_t i = 0; i < t_; ++i) g.push_back(global_rank(i, pos_.dp, pos_.pp));
  return g;
}

std::vector<int64_t> ProcessGroups::data_group() const {
  std::vector<int64_t> g;
  for (int64_t i = 0; i < d_; ++i) g.push_back(global_rank(pos_.tp, i, pos_.pp));
  return g;
}

std::vector<int64_t> ProcessGroups::pipeline_group() const {
  std::vector<int64_t> g;
  for (int64_t i = 0; i < p_; ++i) g.push_back(global_rank(pos_.tp, pos_.dp, i));
  return g;
}

std::vector<int64_t> ProcessGroups::model_group() const {
  std::vector<int64_t> g;
  for (int64_t pp = 0; pp < p_; ++pp)
    for (int64_t tp = 0; tp < t_; ++tp) g.push_back(global_rank(tp, pos_.dp, pp));
  return g;
}

std::vector<int64_t> ProcessGroups::embedding_group() const {
  if (p_ == 1) return {rank_};
  return {global_rank(pos_.tp, pos_.dp, 0), global_rank(pos_.tp, pos_.dp, p_ - 1)};
}

}  // namespace ptdp
