// OpExecutor: runs one op of the layer op list alone, on a backend and a tensor-parallel
// group, with buffers of the op's shapes, so that `ptdp calibrate` can time exactly the kernel
// or collective `ptdp run` executes for that op. GEMMs take their shape from the op itself
// (m, n, k, batch); memory-bound ops and collectives from the model and the layout the op list
// was built for (runtime_layer_shape of the same model and layout). Inputs hold deterministic
// values; outputs are scratch.
#pragma once

#include <memory>
#include <vector>

#include "core/layer_ops.h"
#include "core/model_spec.h"
#include "runtime/backend.h"
#include "runtime/communicator.h"
#include "runtime/gpt_model.h"

namespace ptdp {

class OpExecutor {
 public:
  OpExecutor(Backend& backend, Communicator* tensor_group, const ModelSpec& m,
             const ShardLayout& layout);
  ~OpExecutor();
  OpExecutor(const OpExecutor&) = delete;
  OpExecutor& operator=(const OpExecutor&) = delete;

  // Elements of the executor's parameter buffer (and of its fp32 gradient) for a model and
  // layout: what it holds besides the operands of the op it runs.
  static int64_t parameter_elements(const ModelSpec& m, const ShardLayout& layout);

  // Runs `op` once. Throws std::invalid_argument for an op ptdp run does not execute (the
  // separate gradient-accumulation passes), and for an MoE layer's collectives (all-to-alls
  // over the expert groups) and its ops on a backend whose memory the host cannot address.
  // An MoE layer's compute ops run the runtime's code on one routing of the layer's input,
  // the experts' GEMMs at the op's rows per expert.
  void run(const Op& op);
  // Records what each run executes (as GptShard::trace_ops does).
  void trace_ops(std::vector<ExecutedOp>* sink);
  // Reads the first operand of the op run last (its activation input, x or dy), as the op
  // before it in a pass leaves it in cache (calibration's cold timings); on a device backend a
  // kernel reads and rewrites it (a scale by 1) so that it sits in the device's cache.
  void touch_input() const;
  // Drops every buffer the executor runs ops on from the caches (Backend::flush_from_caches):
  // the op's own data cold, at the cost of its size. False where the backend cannot.
  bool flush_from_caches() const;

  struct State;

 private:
  void run_moe(const Op& op);  // an op of an MoE layer (runtime/moe_layer.h)

  std::unique_ptr<State> s_;
  ModelSpec model_;
  ShardLayout layout_;
};

}  // namespace ptdp
