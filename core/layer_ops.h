// The layer op list: one transformer layer (and the embedding, LM head and optimizer step)
// as the operations one GPU executes, derived from (model, t, b, sequence parallel, recompute).
//
// The same list is priced by the cost model, benchmarked by the calibrator and executed by the
// runtime, so all three name the same ops: each op carries an identity (OpId) that the runtime
// dispatches on, the role it plays in the pass (forward, input gradient B, weight gradient W,
// recompute) and the element type it reads and writes. Shapes are per GPU (already divided by
// t). Activations have the shape's activation type (16-bit on GPUs, fp32 on the CPU backend);
// `bytes` counts every byte a memory-bound op reads and writes; for a collective `bytes` is
// the full (unsharded-by-the-collective) buffer, as nccl-tests counts it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/model_spec.h"
#include "core/parallel_plan.h"

namespace ptdp {

enum class OpKind { kGemm, kMemory, kCollective };
enum class Collective { kAllReduce, kAllGather, kReduceScatter, kSendRecv, kAllToAll };
// kContext: the cp ranks of a context-parallel ring; kExpert: the ep ranks an MoE layer's
// tokens are exchanged among; kExpertTensor: the etp ranks sharing each expert's weights.
enum class CommGroup { kTensor, kPipeline, kData, kEmbedding, kContext, kExpert, kExpertTensor };

std::string to_string(Collective c);

// Every op that appears in a list. Backward ops are named for what they compute: a GEMM
// C = A B has a dgrad (dA) and a wgrad (dB, a weight gradient); the attention GEMMs have no
// weights, so their backward GEMMs are named for the inputs they differentiate (dQ, dK, dV,
// d probabilities) and all of them are input-gradient work.
enum class OpId : uint8_t {
  // transformer layer, forward (full recomputation repeats these)
  kInputLayernorm,
  kAttnAllGather,
  kQkv,
  kQkLayernorm,  // --qk-layernorm: each head's query and key normalised (before the rotation)
  // Multi-head latent attention (in place of kQkv): the down projections of the rank's tokens
  // (whole weights on every tensor-parallel rank), the latents' norms, and the column-parallel
  // up projections (kQUpProj is linear_q_proj without a query latent)
  kQDownProj,
  kKvDownProj,
  kLatentLayernorm,
  kQUpProj,
  kKvUpProj,
  kRotaryEmbedding,
  kAttnScores,
  kAttnSoftmax,
  kAttnDropout,
  kAttnContext,
  kAttnProj,
  kAttnAllReduce,
  kAttnReduceScatter,
  kAttnBiasDropoutAdd,
  kPostAttentionLayernorm,
  kMlpAllGather,
  kFc1,
  kBiasGelu,
  kSwiglu,
  kFc2,
  kMlpAllReduce,
  kMlpReduceScatter,
  kMlpBiasDropoutAdd,
  // transformer layer, backward
  kMlpBiasDropoutAddBackward,
  kMlpReduceScatterBackward,
  kFc2Dgrad,
  kFc2Wgrad,
  kBiasGeluBackward,
  kSwigluBackward,
  // With sequence parallelism a column-parallel GEMM keeps its input's rows only (Megatron's
  // LinearWithGradAccumulationAndAsyncCommunication): they are all-gathered again for its weight
  // gradient, behind its input-gradient GEMM.
  kMlpInputRegather,
  kFc1Dgrad,
  kFc1InputGradAllReduce,
  kFc1Wgrad,
  kMlpAllGatherBackward,
  kPostAttentionLayernormBackward,
  kAttnBiasDropoutAddBackward,
  kAttnReduceScatterBackward,
  kAttnProjDgrad,
  kAttnProjWgrad,
  // A fused (flash) attention's backward recomputes the scores first: the scores GEMM again,
  // named apart so that what runs the fused backward kernel has an op of its own.
  kAttnScoresRecompute,
  kAttnContextDprobs,
  kAttnContextDv,
  kAttnDropoutBackward,
  kAttnSoftmaxBackward,
  kAttnScoresDq,
  kAttnScoresDk,
  kRotaryEmbeddingBackward,
  kQkLayernormBackward,
  kKvUpProjDgrad,
  kKvUpProjWgrad,
  kQUpProjDgrad,
  kQUpProjWgrad,
  kLatentInputGradAllReduce,  // without sequence parallelism: the latents' gradient (MLA)
  kLatentLayernormBackward,
  kKvDownProjDgrad,
  kKvDownProjWgrad,
  kQDownProjDgrad,
  kQDownProjWgrad,
  kAttnInputRegather,  // (as kMlpInputRegather, for the QKV projection's input)
  kQkvDgrad,
  kQkvInputGradAllReduce,
  kQkvWgrad,
  kAttnAllGatherBackward,
  kInputLayernormBackward,
  kWeightGradAccumulate,
  // embedding (first pipeline stage)
  kWordEmbeddingLookup,
  kEmbeddingAllReduce,
  kEmbeddingReduceScatter,
  kEmbeddingPositionDropout,
  kEmbeddingDropoutBackward,
  kEmbeddingGradAllGather,
  kWordEmbeddingGradScatterAdd,
  kEmbeddingGradAccumulate,
  // final layernorm, LM head and loss (last pipeline stage)
  kFinalLayernorm,
  kLmHeadAllGather,
  kLmHead,
  kCrossEntropy,
  kCrossEntropyAllGather,
  kCrossEntropyBackward,
  kLmHeadDgrad,
  kLmHeadWgrad,
  kLmHeadGradReduceScatter,
  kLmHeadInputGradAllReduce,
  kFinalLayernormBackward,
  kOutputGradAccumulate,
  // context parallelism (a transformer layer's attention on cp ranks): the ring's K and V
  // blocks, one send/recv per step (cp - 1 steps); backward passes K, V and their gradients
  kCpKvExchange,
  kCpKvExchangeBackward,
  // a2a (Ulysses): kCpKvExchange is the all-to-all of Q, K and V (sequence for heads), this the
  // all-to-all of the attention's output back (heads for sequence); backward, their gradients'
  kCpOutAllToAll,
  kCpOutAllToAllBackward,
  // MoE layer (replaces the MLP of an MoE layer), forward
  kRouter,                // GEMM: tokens x hidden -> expert logits
  kRouterTopk,            // softmax over experts and top-k selection
  kMoePermute,            // copy each token once per chosen expert, grouped by expert
  kMoeDispatch,           // all-to-all of the routed tokens over the expert-parallel group
  kMoeDispatchAllGather,  // etp > 1: tokens all-gathered over the expert-tensor group
  kExpertFc1,             // grouped GEMM over the rank's local experts
  kExpertActivation,      // GELU or SwiGLU of the experts
  kExpertFc2,
  kMoeCombineReduceScatter,  // etp > 1: partial outputs reduce-scattered back
  kMoeCombine,               // all-to-all back to the tokens' ranks
  kMoeUnpermute,             // weighted sum of each token's k expert outputs
  // MoE layer, backward
  kMoeUnpermuteBackward,
  kMoeCombineBackward,
  kMoeCombineReduceScatterBackward,
  kExpertFc2Dgrad,
  kExpertFc2Wgrad,
  kExpertActivationBackward,
  kExpertFc1Dgrad,
  kExpertFc1Wgrad,
  kMoeDispatchAllGatherBackward,
  kMoeDispatchBackward,
  kMoePermuteBackward,
  kRouterTopkBackward,
  kRouterDgrad,
  kRouterWgrad,
  // Multi-token prediction (ModelSpec::mtp_num_layers; last pipeline stage, mtp_projection_ops),
  // forward: the embedding's and the hidden state's norms and their concatenation, the 2h input
  // all-gathered over the sequence (SP), eh_proj (column-parallel), its h / t outputs
  // all-gathered over the tensor-parallel ranks; backward in reverse
  kMtpNorms,
  kMtpProjAllGather,
  kMtpEhProj,
  kMtpProjOutputAllGather,
  kMtpEhProjDgrad,
  kMtpEhProjWgrad,
  kMtpProjInputGradReduce,
  kMtpNormsBackward,
  // With sequence parallelism the gathered output is cut back to the rank's tokens; backward,
  // the gradient is all-gathered over the sequence.
  kMtpProjOutputScatterBackward,
};
inline constexpr int kNumOpIds = static_cast<int>(OpId::kMtpProjOutputScatterBackward) + 1;

// "qkv", "attn_scores_dk", ...: the name reports, traces and calibration files use.
std::string_view op_name(OpId id);
// Sequence parallelism's second all-gather of a column-parallel GEMM's input, for its weight
// gradient (kAttnInputRegather, kMlpInputRegather).
inline bool is_input_regather(OpId id) {
  return id == OpId::kAttnInputRegather || id == OpId::kMlpInputRegather;
}

// The attention core's GEMMs over (query, key) pairs, forward and backward (scores, context
// and their gradients; not the fused attention's recomputed scores): those a causal mask
// halves.
constexpr bool is_attention_pair_gemm(OpId id) {
  return id == OpId::kAttnScores || id == OpId::kAttnContext || id == OpId::kAttnContextDprobs ||
         id == OpId::kAttnContextDv || id == OpId::kAttnScoresDq || id == OpId::kAttnScoresDk;
}

// What an op contributes to its pass. A zero-bubble schedule defers exactly the kWeightGrad ops
// of a backward pass (W); the kInputGrad ops (B) are what the previous stage waits for.
enum class OpRole : uint8_t { kForward, kInputGrad, kWeightGrad, kRecompute };
std::string to_string(OpRole r);

struct Op {
  OpId id = OpId::kInputLayernorm;
  OpRole role = OpRole::kForward;
  OpKind kind = OpKind::kMemory;
  DType dtype = DType::kBF16;  // elements read and written; a collective's elements on the wire
  // Part of a fused kernel (a flash attention's core, and its backward): the kernel runs on
  // one op of the group and the shapes say what it computes. A calibrated profile prices these
  // from HardwareProfile::fused_ops.
  bool fused = false;
  // GEMM: `batch` independent products C[m x n] = A[m x k] * B[k x n].
  int64_t m = 0, n = 0, k = 0, batch = 1;
  double bytes = 0;  // memory op: bytes moved; collective: buffer bytes
  Collective collective = Collective::kAllReduce;
  CommGroup group = CommGroup::kTensor;

  std::string_view name() const { return op_name(id); }
  double flops() const { return kind == OpKind::kGemm ? 2.0 * m * n * k * batch : 0.0; }
};

// Ops of one pass, in execution order.
struct PassOps {
  std::vector<Op> forward;
  std::vector<Op> backward;   // input and weight gradients
  std::vector<Op> recompute;  // forward work redone before the backward pass (may be empty)
};

struct LayerShape {
  int64_t tensor_parallel = 1;
  int64_t micro_batch = 1;
  bool sequence_parallel = false;
  Recompute recompute = Recompute::kNone;
  unsigned recompute_modules = kRecomputeCoreAttn;  // with selective (ParallelPlan's)
  // Without fused gradient accumulation each weight gradient is added to the main gradient
  // buffer (of main_grad_bytes per element) by a separate memory-bound pass.
  bool fused_grad_accumulation = true;
  double main_grad_bytes = 4;
  // Element type of activations and weights as the GEMMs and kernels read them.
  DType activation_dtype = DType::kBF16;
  // Context parallelism: a rank holds s / cp of each sequence; its queries attend to all s keys,
  // whose K and V blocks come round the cp ranks' ring (or as cp_comm says).
  int64_t context_parallel = 1;
  CpComm cp_comm = CpComm::kP2P;
  int64_t hierarchical_cp = 0;  // a2a+p2p: the all-to-all's ranks A (ParallelPlan's)
  // MoE layers: experts over expert_parallel ranks, each over expert_tensor_parallel ranks;
  // expert_load is the token count of the busiest rank's experts as a multiple of the fair
  // share (1: perfectly balanced routing).
  int64_t expert_parallel = 1;
  int64_t expert_tensor_parallel = 1;
  double expert_load = 1.0;
  // Fused (flash) attention where the model asks for it (--use-flash-attn) or context
  // parallelism needs it; false: Megatron's unfused softmax path whatever the model says (what
  // ptdp run's CPU kernels execute).
  bool fused_attention = true;
  // FP8 training (--fp8-format): Transformer Engine's FP8 linear layers save their inputs for the
  // backward pass as FP8, a byte an element (the activation memory; the op list prices the
  // GEMMs from the plan).
  bool fp8 = false;
};

LayerShape layer_shape(const ParallelPlan& p);

PassOps transformer_layer_ops(const ModelSpec& m, const LayerShape& s);
// An MoE layer (model.is_moe()): the same attention, then router, dispatch, the rank's experts,
// combine and the shared experts in place of the MLP.
PassOps moe_layer_ops(const ModelSpec& m, const LayerShape& s);
PassOps embedding_ops(const ModelSpec& m, const LayerShape& s);  // first pipeline stage
PassOps lm_head_ops(const ModelSpec& m, const LayerShape& s);    // last stage, loss included
// One multi-token prediction module's own ops (Megatron-Core's MultiTokenPredictionLayer): its
// norms, concatenation and eh_proj, and their collectives. The module also runs the embedding's
// lookup (embedding_ops), a transformer layer (the decoder's last layer's kind) and the final
// norm, output layer and loss (lm_head_ops).
PassOps mtp_projection_ops(const ModelSpec& m, const LayerShape& s);
// The vocabulary-parallel cross-entropy exchanges, per token, this rank's (max logit, sum of
// exponentials, target logit) as fp32 by an all-gather over the tensor-parallel group.
inline constexpr int64_t kCrossEntropyStatsPerToken = 3;

// Activation bytes one layer keeps for its backward pass, per microbatch (Korthikanti et al.
// 2022, Table 2, generalised to GQA and gated MLPs; equals s b h (34 + 5 a s / h) for GPT).
double layer_activation_bytes(const ModelSpec& m, const LayerShape& s);
// What a layer's backward pass holds at once beyond that, its activations' gradients as autograd
// frees them (and ptdp run's LayerGrads): the incoming and outgoing gradient of the layer, and
// the larger of its MLP's (or an MoE layer's experts') and its attention's working set, where
// the unfused attention's gradient of the scores (b a s_q s / t elements) is the largest part.
double layer_backward_working_bytes(const ModelSpec& m, const LayerShape& s, bool moe_layer);
// The same for an MoE layer: the attention's, plus the router's input and, per routed token,
// the permuted input, the expert activations and output.
double moe_layer_activation_bytes(const ModelSpec& m, const LayerShape& s);

}  // namespace ptdp
