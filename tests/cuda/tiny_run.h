// What the GPU training tests share (backend_test.cc, nccl_test.cc): the tiny GPT they train
// and the losses of a one-rank run.
#pragma once

#include <vector>

#include "core/model_spec.h"
#include "runtime/communicator.h"
#include "runtime/trainer.h"

namespace ptdp::cuda_test {

// 2 layers, hidden 64, 4 heads; a sequence (33) and a vocabulary (131) that are no multiple of
// a warp or a tile.
inline ModelSpec tiny_gpt() {
  ModelSpec m;
  m.num_layers = 2;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.seq_length = 33;
  m.vocab_size = 131;
  return m;
}

// Steps of the training tests: 20 on a GPU; 4 under the host emulation (tests/cuda/
// emulated_cuda.h), which runs every kernel thread as a fiber and is some thousand times slower
// (three optimizer steps, each kernel's path after an update included).
#ifdef PTDP_CUDA_EMULATION
inline constexpr int kTrainingSteps = 4;
#else
inline constexpr int kTrainingSteps = 20;
#endif

// `m` trained on `backend` for `steps` steps at global batch 6, micro-batch 3 (two microbatches).
inline TrainOptions tiny_training(const ModelSpec& m, const char* backend, int64_t steps) {
  TrainOptions o;
  o.model = m;
  o.plan.global_batch_size = 6;
  o.plan.micro_batch_size = 3;
  o.steps = steps;
  o.backend = backend;
  return o;
}

// Each step's loss of `o` trained on one rank.
inline std::vector<double> losses_of_one_rank(const TrainOptions& o) {
  auto self = make_self_communicator();
  std::vector<double> l;
  for (const StepStats& s : train(o, *self).steps) l.push_back(s.loss);
  return l;
}

}  // namespace ptdp::cuda_test
