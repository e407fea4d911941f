// GptShard: the part of a GPT model that one rank holds, sharded as Megatron-LM shards it, and
// its forward and backward passes.
//
// Tensor parallelism: QKV and FC1 are column-parallel (each rank holds heads/t heads and ffn/t
// columns), the attention projection and FC2 row-parallel; the word embedding and the LM head
// are vocabulary-parallel (each rank holds a contiguous 1/t of the vocabulary, cross-entropy
// reduced over the tensor-parallel group). With sequence parallelism, layernorms, dropout-adds
// and the embedding's position add run on a 1/t slice of the sequence, entered by all-gather
// and left by reduce-scatter. Pipeline parallelism: the rank holds v chunks of consecutive
// layers (chunk c is global stage c * p + rank); the first stage adds the embedding, the last
// the final layernorm, LM head and loss; with tied embeddings the last stage keeps a copy of
// the word embedding whose gradient the trainer all-reduces with the first stage's. Multi-token
// prediction modules (DeepSeek-V3's, as Megatron-Core runs them) follow the head on the last
// stage: each looks the inputs rolled one further up in the word embedding (the tied copy, or
// a copy of its own kept the same way), normalises them and the previous hidden state,
// projects the two (eh_proj, column-parallel 2h -> h) into a layer of the decoder's last
// layer's kind, and scores its final norm's output with the shared output layer against the
// targets rolled one further, the positions rolled past the end masked.
//
// The passes are not hand-written sequences: each transformer layer executes the op list of
// core/layer_ops.h (transformer_layer_ops, embedding_ops, lm_head_ops) for this rank's shape,
// dispatching on each op's OpId to one kernel or collective (runtime/transformer_layer.cc,
// runtime/embedding_head.cc), so the cost model prices exactly the ops that run here; an op
// the runtime cannot execute is an error at construction. Kernels run on a Backend
// (runtime/backend.h); with a trace attached, the shard records every op it executes. Recomputation
// follows the same lists: after its forward pass a layer keeps what the recompute mode stores, and
// before its backward pass runs the list's recompute ops (all of the forward for full, the
// attention core for selective).
//
// Activations are [b, s, h] row-major (sequence-parallel slices [b, s/t, h]); weights are
// [out, in] like Megatron's. Initial values are a hash of (seed, parameter name, global
// element index), so every layout of the same model starts from the same weights.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/layer_ops.h"
#include "core/model_spec.h"
#include "core/parallel_plan.h"
#include "runtime/backend.h"
#include "runtime/communicator.h"
#include "runtime/device_buffer.h"
#include "runtime/flat_map.h"
#include "runtime/tensor.h"

namespace ptdp {

class OpTimer;
class MegatronFsdp;

struct ShardLayout {
  int64_t t = 1, tp = 0;        // tensor-parallel size and this rank's index
  int64_t p = 1, pp = 0;        // pipeline-parallel size and this rank's index
  int64_t cp = 1, cp_rank = 0;  // context-parallel size and index (runtime/context_parallel.h)
  // The context-parallel ranks of a heads all-to-all: 1 (p2p: the K/V ring alone), cp (a2a:
  // Ulysses' all-to-alls alone) or A of a2a+p2p (all-to-alls within groups of A adjacent ranks,
  // then the ring over the cp / A groups).
  int64_t cp_a2a_size = 1;
  int64_t v = 1;  // model chunks per pipeline rank
  int64_t micro_batch = 1;
  bool sequence_parallel = false;
  Recompute recompute = Recompute::kNone;
  int64_t recompute_layers = 0;  // full recompute of each chunk's first N layers only (0: all)
  // With selective: what it recomputes (ParallelPlan::recompute_modules), as a layer of each
  // kind runs it (layer_recompute_modules: an MoE layer's mlp bit is its shared experts').
  unsigned recompute_modules = kRecomputeCoreAttn;
  unsigned recompute_modules_of(bool moe_layer) const {
    return layer_recompute_modules(recompute_modules, moe_layer);
  }
  // The recompute mode of layer l (from 0) of a model chunk.
  Recompute recompute_of(int64_t l) const {
    return recompute == Recompute::kFull && recompute_layers > 0 && l >= recompute_layers
               ? Recompute::kNone
               : recompute;
  }
  // Layers of each global stage (size p * v); empty: even split.
  std::vector<int64_t> layers_per_stage;
  // Parameters are laid out so that each segment's length is a multiple of this (the
  // data-parallel size), for the distributed optimizer's reduce-scatter.
  int64_t segment_multiple = 1;
  // MoE models (runtime/moe_layer.h, runtime/expert_groups.h): this rank's place in the expert
  // grid, and the multiple of the routed experts' segment (the expert-data-parallel size with
  // the distributed optimizer).
  int64_t ep = 1, ep_rank = 0, etp = 1, etp_rank = 0;
  int64_t expert_segment_multiple = 1;
  // Weights and activations: fp32, or bf16 (--bf16, Megatron's mixed precision: weight
  // gradients stay fp32 and the optimizer keeps fp32 master weights, runtime/grad_sync.h).
  DType dtype = DType::kF32;
  // Megatron-FSDP (runtime/fsdp.h): optim_grads holds only this rank's shard of the gradients,
  // optim_grads_params also of the decoder layers' weights; the shards are the distributed
  // optimizer's, this rank's the shard_rank-th of segment_multiple (the routed experts' the
  // expert_shard_rank-th of expert_segment_multiple). Other values hold everything.
  FsdpSharding fsdp = FsdpSharding::kOff;
  int64_t shard_rank = 0, expert_shard_rank = 0;
};

// The shape of the op lists this layout executes: activations of the layout's dtype, weight
// gradients accumulated in place in fp32.
LayerShape runtime_layer_shape(const ModelSpec& m, const ShardLayout& s);

// Throws InputError naming the flag when the model cannot be sharded so (t must divide heads,
// query groups and, with sequence parallelism, the sequence; layers must split evenly, ...).
void validate_shard_layout(const ModelSpec& m, const ShardLayout& s);

struct ParamInfo {
  std::string name;            // "layers.3.qkv.weight" (global layer index)
  int64_t offset = 0;          // in the flat parameter buffer
  int64_t size = 0;            // elements on this rank (vocabulary padding included)
  int64_t real_size = 0;       // elements that are model parameters (padding excluded)
  int segment = 1;             // 0: word embedding (first stage, and the last stage's tied copy)
  bool decay = true;           // weight decay applies (not to biases and norms)
  bool tp_replicated = false;  // identical on every tensor-parallel rank
  bool sp_partial = false;     // with sequence parallelism its gradient is partial per TP rank
  // Its gradient is partial per TP rank with or without sequence parallelism: --qk-layernorm's
  // norms, applied to each rank's own heads.
  bool tp_partial = false;
  bool tied_copy = false;  // the last stage's copy of the word embedding
  // A routed expert's weight (segment 2): its gradient is reduced over the expert-data-parallel
  // group; tp_replicated then means identical on the expert-tensor-parallel ranks.
  bool expert = false;
};

// One op as the shard executed it: its identity, the role it played (a weight gradient when it
// accumulated into a weight's gradient in the backward pass), and what it ran: a collective's
// kind and buffer bytes (as the op list counts them), or a GEMM's shape.
struct ExecutedOp {
  OpId id = OpId::kInputLayernorm;
  OpRole role = OpRole::kForward;
  OpKind kind = OpKind::kMemory;
  Collective collective = Collective::kAllReduce;
  CommGroup group = CommGroup::kTensor;
  double bytes = 0;
  int64_t m = 0, n = 0, k = 0, batch = 0;
};

// Segments of the flat buffers: 0 the word embedding, 1 every other dense parameter, and for MoE
// models 2 the routed experts.
struct Segment {
  int64_t offset = 0, size = 0;  // size is a multiple of ShardLayout::segment_multiple
};
// The part of [lo, hi) (inside segment `s`) in each of its `blocks` contiguous equal blocks, in
// block order: what each rank's shard of the segment holds of the range.
std::vector<size_t> block_counts(const Segment& s, int64_t blocks, int64_t lo, int64_t hi);

class GptShard {
 public:
  // backend: where the kernels run (null: a CPU backend of the shard's own).
  GptShard(const ModelSpec& m, const ShardLayout& layout, Communicator* tensor_group, uint64_t seed,
           Backend* backend = nullptr);
  ~GptShard();
  GptShard(const GptShard&) = delete;
  GptShard& operator=(const GptShard&) = delete;

  const ModelSpec& model() const { return model_; }
  const ShardLayout& layout() const { return layout_; }
  int64_t num_chunks() const { return layout_.v; }
  bool first_stage(int64_t chunk) const;
  bool last_stage(int64_t chunk) const;
  int64_t global_stage(int64_t chunk) const { return chunk * layout_.p + layout_.pp; }
  // Floats of the activation (and its gradient) crossing a pipeline-stage boundary.
  int64_t boundary_elements() const;
  // Tokens of one microbatch: b sequences of s + 1 (inputs are the first s, targets the last s;
  // with context parallelism the shard takes its 2 of the 2 cp chunks of each).
  int64_t tokens_per_microbatch() const;

  // A chunk is executed in parts: the embedding (first stage), each layer, the final norm with
  // the LM head (last stage). A PartHook is called with each range [lo, hi) of params() and
  // grads() that holds a part's parameters: one per segment the part has parameters in (the
  // word embedding and its tied copy are segment 0, routed experts segment 2), in segment order.
  using PartHook = std::function<void(int64_t lo, int64_t hi)>;
  // Forward of microbatch `mb` on `chunk`. tokens: the microbatch's tokens (read on the first
  // and the last stage); input: the received activation (null on the first stage). Writes the
  // output activation (not on the last stage) and returns the mean loss on the last stage
  // (0 elsewhere). Keeps what the backward pass needs until backward(chunk, mb). With `before`,
  // calls it before each part runs: --overlap-param-gather waits there for the part's
  // parameters.
  double forward(int64_t chunk, int64_t mb, const int32_t* tokens, const Buffer* input,
                 Buffer* output, const PartHook* before = nullptr);
  // Backward of microbatch `mb` on `chunk`: grad_output is the received gradient (null on the
  // last stage, whose gradient is that of loss_scale * loss); writes grad_input (not on the
  // first stage). Accumulates into grads(). With `ready`, calls it after each part (the head,
  // each layer, the embedding) once its kernels are queued. On a chunk's last backward pass of
  // a step the part's gradients are then final: --overlap-grad-reduce starts their reduction
  // there.
  void backward(int64_t chunk, int64_t mb, const Buffer* grad_output, Buffer* grad_input,
                double loss_scale, const PartHook* ready = nullptr);
  // Zero-bubble schedules (zb-h1, Qi et al. 2023): backward_input is backward without the
  // layers' weight-gradient GEMMs (the ops of role kWeightGrad in the layer op list), keeping
  // what they read; backward_weight(chunk, mb) runs them later and calls `ready` for each part as
  // backward does. The LM head's and the embedding's weight gradients stay in the input pass
  // (deferring the head's would keep the logits' gradient, b s V / t floats, until then).
  // Dense models only.
  void backward_input(int64_t chunk, int64_t mb, const Buffer* grad_output, Buffer* grad_input,
                      double loss_scale);
  void backward_weight(int64_t chunk, int64_t mb, const PartHook* ready = nullptr);
  // Every part's ranges, chunk by chunk in the order of the forward pass.
  std::vector<std::pair<int64_t, int64_t>> part_ranges() const;
  // Multi-token prediction (ModelSpec::mtp_num_layers, on the last stage's last chunk): the sum
  // of the modules' losses (each unweighted, a mean over its targets) over the forward passes
  // since the last call; forward returns the main model's loss alone, as Megatron reports it.
  double take_mtp_loss();

  // The flat arrays of every parameter of this rank's model shard (of the layout's dtype: fp32
  // or bf16) and of their gradients (fp32), flat_size() elements each; ParamInfo::offset and
  // size give each parameter's place. params() and grads() are the buffers in the backend's
  // memory that hold them: all of them, one to one, except under Megatron-FSDP (ShardLayout::
  // fsdp), where they hold what param_map() and grad_map() say and param_at and grad_at find.
  DeviceBuffer& params() { return params_; }
  DeviceBuffer& grads() { return grads_; }
  int64_t flat_size() const { return flat_size_; }
  FlatMap& param_map() { return param_map_; }
  FlatMap& grad_map() { return grad_map_; }
  Ptr param_at(int64_t off) const { return param_map_.at(off); }
  float* grad_at(int64_t off) const { return grad_map_.at(off).f(); }
  // [lo, hi) of the flat arrays: this rank's shard of segment `seg` under the distributed
  // optimizer's sharding (ShardLayout::segment_multiple shards; the whole segment with one).
  std::pair<int64_t, int64_t> own_shard(size_t seg) const;
  // The part of [lo, hi) (inside segment `seg`) in each rank's shard of it, in rank order.
  std::vector<size_t> shard_counts(size_t seg, int64_t lo, int64_t hi) const;
  // Each part's ranges of `chunk` (as part_ranges, per part: 0 the embedding, 1 + l layer l,
  // then the head and each MTP module), and whether a part is a Megatron-FSDP unit (a decoder
  // layer: its weights are gathered for its passes under optim_grads_params).
  const std::vector<std::vector<std::pair<int64_t, int64_t>>>& parts(int64_t chunk) const;
  bool fsdp_unit(int64_t chunk, int64_t part) const;
  // Megatron-FSDP: `fsdp` maps each part's windows around its passes (null: none). One stage
  // of one chunk only.
  void set_fsdp(MegatronFsdp* fsdp);
  const std::vector<ParamInfo>& param_infos() const { return infos_; }
  const std::vector<Segment>& segments() const { return segments_; }
  // Parameters of the whole model held here without padding or tied copies.
  int64_t real_parameters() const;
  Backend& backend();
  // The context-parallel group (layout().cp ranks); needed before a pass when cp > 1. With
  // a2a+p2p (1 < cp_a2a_size < cp) also this rank's all-to-all group (its cp_a2a_size adjacent
  // ranks) and its ring (the cp / cp_a2a_size ranks at its place in the other groups).
  void set_context_group(Communicator* group, Communicator* a2a_group = nullptr,
                         Communicator* ring_group = nullptr);
  // MoE models: the expert-parallel and expert-tensor-parallel groups of this rank (null: a
  // group of one; required where that size is above 1, before the first pass).
  void set_expert_groups(Communicator* ep, Communicator* etp);
  // MoE models: the busiest expert-parallel rank's routed rows over the group's mean, over the
  // routings dispatched so far (MoeContext::measured_load; 1 at ep = 1); 0 for a dense model or
  // before a dispatch.
  double expert_load() const;
  // Appends every op executed from now on to `sink` (null: stop recording).
  void trace_ops(std::vector<ExecutedOp>* sink);
  // Times every op executed from now on (runtime/op_timer.h; null: stop timing).
  void time_ops(OpTimer* timer);

  struct Impl;

 private:
  void backward_pass(int64_t chunk, int64_t mb, const Buffer* grad_output, Buffer* grad_input,
                     double loss_scale, const PartHook* ready, bool defer);

  ModelSpec model_;
  ShardLayout layout_;
  std::unique_ptr<Impl> impl_;  // owns the backend when the shard made its own
  DeviceBuffer params_, grads_;
  FlatMap param_map_, grad_map_;
  int64_t flat_size_ = 0;
  std::vector<ParamInfo> infos_;
  std::vector<Segment> segments_;
};

}  // namespace ptdp
