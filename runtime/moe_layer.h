// The MoE layer of a GptShard (Megatron-Core's MoELayer with the all-to-all token dispatcher):
// it replaces the MLP of each layer i with ModelSpec::is_moe_layer(i).
//
// Forward, per rank, on the n_local tokens it holds outside the tensor-parallel blocks (the
// sequence-parallel slice; Megatron requires sequence parallelism for MoE when t > 1):
//   kRouter        logits = x Wr^T, Wr [E, h] replicated on the tensor-parallel ranks, no bias
//   kRouterTopk    the top-k logits of each token, then a softmax over those k (no pre-softmax);
//                  with a capacity factor c each expert keeps its ceil(c * n_local * k / E)
//                  highest-probability assignments of this rank's tokens, the rest are dropped
//   kMoePermute    each (token, expert) assignment as one row, grouped by expert
//   kMoeDispatch   counts (each rank's for every expert, which also give the group's load),
//                  then rows, all-to-all over the expert-parallel group (variable sizes);
//                  the received blocks sorted by local expert (ep > 1: without expert
//                  parallelism the permuted rows are the experts' rows, and neither this nor
//                  kMoeCombine runs, as the op list has neither)
//   kMoeDispatchAllGather  etp > 1: every expert-tensor rank's rows gathered (all-to-all of
//                  the same block to every peer), sorted by local expert again
//   kExpertFc1, kExpertActivation, kExpertFc2  each of the E / ep local experts, an MLP of the
//                  model's kind (GELU with biases, or SwiGLU without) of width moe_ffn / etp
//   kMoeCombineReduceScatter  etp > 1: each peer's rows back to it, partial sums added
//   kMoeCombine    the rows all-to-all back to the ranks they came from
//   kMoeUnpermute  each token's output: the probability-weighted sum of its expert rows
// Shared experts (moe_shared_expert_ffn_size) are the layer's dense MLP ops at that width, run
// on every token; the routed output is added to theirs. No auxiliary load-balancing loss (as
// Megatron's default --moe-aux-loss-coeff 0). The backward ops mirror these in reverse.
//
// Where it runs: the router's and the experts' GEMMs, the activations and the row moves
// (Backend::gather_rows, gather_add_rows, row_dots) on the backend; the routing decisions (top-k
// and its softmax, capacity, the permutation, the all-to-alls' counts) on the host, from the
// router's logits (n_local x E, downloaded) and the probabilities' gradients (n_local x k,
// downloaded). The routed rows are bf16 in a bf16 model (moved, exchanged and computed as
// Megatron-Core's are: bf16 storage, fp32 arithmetic inside each kernel), else fp32.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/layer_ops.h"
#include "core/model_spec.h"
#include "runtime/communicator.h"
#include "runtime/shard_context.h"
#include "runtime/tensor.h"

namespace ptdp {

struct MoeLayerParams {  // offsets into the flat buffers; -1 when absent
  int64_t router = -1;
  std::vector<int64_t> fc1_w, fc1_b, fc2_w, fc2_b;  // per local expert
};

struct MoeDims {
  int64_t experts = 0, local_experts = 0, topk = 1;
  int64_t ffe = 0;  // one expert's FFN width on this rank (moe_ffn_hidden / etp)
  int64_t ep = 1, ep_rank = 0, etp = 1, etp_rank = 0;
  double capacity_factor = 0;     // 0: dropless
  bool drop_by_position = false;  // over capacity, keep the first tokens (else the most probable)
  bool fc1_gated = false;         // SwiGLU experts: FC1 rows [gate | up]
  bool shared = false;            // shared experts run as the layer's dense MLP ops
  int64_t shared_ffl = 0;         // their width on this rank (moe_shared_expert_ffn_size / t)
  int64_t fc1_width() const;      // rows of one expert's FC1 weight on this rank
};

// What one MoE layer keeps between its forward and backward pass (and its backward scratch).
struct MoeActs {
  // The routing, in host memory (the row moves' index arrays come from it).
  std::vector<int32_t> chosen, expert;  // [n_local * k]: the top-k; expert -1 when dropped
  std::vector<float> prob, dprob;       // [n_local * k]
  std::vector<int64_t> slot_of_row;     // permuted row -> token * k + slot
  std::vector<int64_t> token_of_row;    // permuted row -> token
  std::vector<int64_t> row_of;          // [n_local * k]: each token's rows, ascending, then -1
  std::vector<float> row_prob;          // [n_local * k]: their probabilities (0 for -1)
  std::vector<int64_t> counts;          // rows per expert (all E), this rank's tokens
  std::vector<int64_t> recv;            // [ep source][local expert] rows received
  std::vector<int64_t> gathered;        // [etp source][local expert] rows after the gather
  int64_t rows = 0;                     // this rank's routed rows
  // In the backend's memory: the router's logits and their gradients in fp32, the rows in the
  // routed type (bf16 in a bf16 model, else fp32).
  Buffer logits{DType::kF32}, dlogits{DType::kF32};
  Buffer permuted, x, fc1, act, y, combined;
  Buffer d_y, d_act, d_pre, d_x;
  // An op frees the inputs no later op reads (a run's memory); the op executor, which runs one
  // op many times on the same inputs (runtime/op_executor.h), keeps them.
  bool keep_inputs = false;
};

// Registers an MoE layer's parameters on this rank (runtime/moe_params.cc): the router [E, h]
// (replicated on the tensor-parallel ranks; a sequence-parallel partial gradient when `sp`) and
// the E / ep local experts (segment 2: global expert ep_rank * E / ep + e, columns etp_rank of
// each FFN), with hashed initial values of the global element (kernels/cpu/init.h). `add`
// registers one parameter with its initial values and returns its index; the result holds
// those indices.
using AddParameter = std::function<int64_t(ParamInfo, std::function<void(float*)>)>;
MoeLayerParams add_moe_parameters(const ModelSpec& m, const ShardLayout& l, bool sp, uint64_t seed,
                                  const std::string& prefix, const AddParameter& add);

// What an expert-parallel group's ranks compute in one MoE layer: the routed rows of its
// busiest rank's experts and the mean over its ranks.
struct ExpertLoad {
  double busiest = 0, mean = 0;
};
// From every rank's routed rows per expert, `counts` [ep source][experts] (rank r holds experts
// r E/ep .. (r+1) E/ep - 1).
ExpertLoad expert_load_of(const std::vector<int64_t>& counts, int64_t ep, int64_t experts);

// The MoE layer's communicators and dimensions on this rank.
class MoeContext {
 public:
  MoeContext(const ModelSpec& m, const MoeDims& dims);
  // ep: the expert-parallel group; etp: the expert-tensor group (null: a group of one, only
  // when that size is 1).
  void set_groups(Communicator* ep, Communicator* etp);
  const MoeDims& dims() const { return dims_; }
  Communicator& ep();
  Communicator& etp();
  // The load of the routings this rank dispatched (each dispatch adds one): the busiest
  // expert-parallel rank's rows over the mean, summed over them; 1 without expert parallelism
  // (one rank computes every routed row), 0 before any dispatch.
  void add_load(const ExpertLoad& l);
  double measured_load() const;

 private:
  MoeDims dims_;
  ExpertLoad load_sum_;
  std::unique_ptr<Communicator> own_ep_, own_etp_;
  Communicator *ep_ = nullptr, *etp_ = nullptr;
};

// The routed rows' element type in a model of type `model`: bf16 in a bf16 model (as
// Megatron-Core moves and computes them), else fp32 (an fp16 model's are widened, as its other
// calls are).
DType moe_routed_type(DType model);

MoeDims moe_dims(const ModelSpec& m, int64_t t, int64_t ep, int64_t ep_rank, int64_t etp,
                 int64_t etp_rank);

bool is_moe_op(OpId id);
// --recompute-modules moe: drops what an MoE layer's forward pass kept of its routed path (the
// router's logits and the rows in the backend's memory), which its recomputation writes again.
void release_routed(MoeActs& A);
// An MoE layer's programs from the dense layer's: the MLP ops stay for the shared experts (or
// go, without them) and the routed ops are inserted before the closing bias-dropout-add
// (forward, recomputation) and before the post-attention layernorm's backward.
std::vector<OpId> moe_forward_program(const std::vector<OpId>& dense, const MoeDims& d);
std::vector<OpId> moe_backward_program(const std::vector<OpId>& dense, const MoeDims& d);

// The experts' outputs in this rank's permuted order, which kMoeUnpermute reads: after the
// combine, or the experts' own rows without expert parallelism (no all-to-all runs then).
inline Buffer& combined_rows(const MoeDims& d, MoeActs& A) {
  return d.ep > 1 ? A.combined : A.y;
}

// x: the post-attention layernorm's output [n_local, h]; out: the MLP output [n_local, h]
// (the shared experts' when they ran first, added to).
void moe_forward_op(ShardContext& c, MoeContext& mc, OpId op, const MoeLayerParams& W,
                    const Buffer& x, Buffer& out, MoeActs& A);
// d_out: the gradient of the layer's MLP output [n_local, h]; d_x: the gradient of x, added to
// when the shared experts wrote it, else written.
void moe_backward_op(ShardContext& c, MoeContext& mc, OpId op, const MoeLayerParams& W,
                     const Buffer& x, const Buffer& d_out, Buffer& d_x, MoeActs& A);

}  // namespace ptdp
