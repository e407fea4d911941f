#include "planner/op_breakdown.h"

#include <cmath>

#include "core/schedule.h"

namespace ptdp {

OpFamily op_family(OpId id) {
  switch (id) {
    case OpId::kQkv:
    case OpId::kAttnProj:
    case OpId::kAttnProjDgrad:
    case OpId::kAttnProjWgrad:
    case OpId::kQkvDgrad:
    case OpId::kQkvWgrad:
    case OpId::kQDownProj:
    case OpId::kKvDownProj:
    case OpId::kQUpProj:
    case OpId::kKvUpProj:
    case OpId::kQDownProjDgrad:
    case OpId::kQDownProjWgrad:
    case OpId::kKvDownProjDgrad:
    case OpId::kKvDownProjWgrad:
    case OpId::kQUpProjDgrad:
    case OpId::kQUpProjWgrad:
    case OpId::kKvUpProjDgrad:
    case OpId::kKvUpProjWgrad:
      return OpFamily::kAttentionGemm;
    case OpId::kFc1:
    case OpId::kFc2:
    case OpId::kFc2Dgrad:
    case OpId::kFc2Wgrad:
    case OpId::kFc1Dgrad:
    case OpId::kFc1Wgrad:
      return OpFamily::kMlpGemm;
    case OpId::kRotaryEmbedding:
    case OpId::kAttnScores:
    case OpId::kAttnSoftmax:
    case OpId::kAttnDropout:
    case OpId::kAttnContext:
    case OpId::kAttnScoresRecompute:
    case OpId::kAttnContextDprobs:
    case OpId::kAttnContextDv:
    case OpId::kAttnDropoutBackward:
    case OpId::kAttnSoftmaxBackward:
    case OpId::kAttnScoresDq:
    case OpId::kAttnScoresDk:
    case OpId::kRotaryEmbeddingBackward:
      return OpFamily::kAttentionCore;
    case OpId::kInputLayernorm:
    case OpId::kQkLayernorm:
    case OpId::kPostAttentionLayernorm:
    case OpId::kPostAttentionLayernormBackward:
    case OpId::kQkLayernormBackward:
    case OpId::kLatentLayernorm:
    case OpId::kLatentLayernormBackward:
    case OpId::kInputLayernormBackward:
      return OpFamily::kNorm;
    case OpId::kAttnBiasDropoutAdd:
    case OpId::kBiasGelu:
    case OpId::kSwiglu:
    case OpId::kMlpBiasDropoutAdd:
    case OpId::kMlpBiasDropoutAddBackward:
    case OpId::kBiasGeluBackward:
    case OpId::kSwigluBackward:
    case OpId::kAttnBiasDropoutAddBackward:
    case OpId::kWeightGradAccumulate:
      return OpFamily::kElementwise;
    case OpId::kAttnAllGather:
    case OpId::kAttnAllReduce:
    case OpId::kAttnReduceScatter:
    case OpId::kMlpAllGather:
    case OpId::kMlpAllReduce:
    case OpId::kMlpReduceScatter:
    case OpId::kMlpReduceScatterBackward:
    case OpId::kFc1InputGradAllReduce:
    case OpId::kMlpAllGatherBackward:
    case OpId::kAttnReduceScatterBackward:
    case OpId::kQkvInputGradAllReduce:
    case OpId::kLatentInputGradAllReduce:
    case OpId::kAttnAllGatherBackward:
    case OpId::kAttnInputRegather:
    case OpId::kMlpInputRegather:
    case OpId::kEmbeddingAllReduce:
    case OpId::kEmbeddingReduceScatter:
    case OpId::kEmbeddingGradAllGather:
    case OpId::kLmHeadAllGather:
    case OpId::kCrossEntropyAllGather:
    case OpId::kLmHeadGradReduceScatter:
    case OpId::kLmHeadInputGradAllReduce:
    case OpId::kMtpProjAllGather:
    case OpId::kMtpProjOutputAllGather:
    case OpId::kMtpProjInputGradReduce:
    case OpId::kMtpProjOutputScatterBackward:
      return OpFamily::kTensorComm;
    case OpId::kWordEmbeddingLookup:
    case OpId::kEmbeddingPositionDropout:
    case OpId::kEmbeddingDropoutBackward:
    case OpId::kWordEmbeddingGradScatterAdd:
    case OpId::kEmbeddingGradAccumulate:
    case OpId::kFinalLayernorm:
    case OpId::kLmHead:
    case OpId::kCrossEntropy:
    case OpId::kCrossEntropyBackward:
    case OpId::kLmHeadDgrad:
    case OpId::kLmHeadWgrad:
    case OpId::kFinalLayernormBackward:
    case OpId::kOutputGradAccumulate:
    // A multi-token prediction module's norms and projection, outside its transformer layer.
    case OpId::kMtpNorms:
    case OpId::kMtpEhProj:
    case OpId::kMtpEhProjDgrad:
    case OpId::kMtpEhProjWgrad:
    case OpId::kMtpNormsBackward:
      return OpFamily::kEmbeddingHead;
    case OpId::kCpKvExchange:
    case OpId::kCpKvExchangeBackward:
    case OpId::kCpOutAllToAll:
    case OpId::kCpOutAllToAllBackward:
      return OpFamily::kContextComm;
    case OpId::kRouter:
    case OpId::kRouterTopk:
    case OpId::kMoePermute:
    case OpId::kMoeUnpermute:
    case OpId::kMoeUnpermuteBackward:
    case OpId::kMoePermuteBackward:
    case OpId::kRouterTopkBackward:
    case OpId::kRouterDgrad:
    case OpId::kRouterWgrad:
      return OpFamily::kMoeRouting;
    case OpId::kExpertFc1:
    case OpId::kExpertFc2:
    case OpId::kExpertFc2Dgrad:
    case OpId::kExpertFc2Wgrad:
    case OpId::kExpertFc1Dgrad:
    case OpId::kExpertFc1Wgrad:
      return OpFamily::kExpertGemm;
    case OpId::kExpertActivation:
    case OpId::kExpertActivationBackward:
      return OpFamily::kElementwise;
    case OpId::kMoeDispatch:
    case OpId::kMoeDispatchAllGather:
    case OpId::kMoeCombineReduceScatter:
    case OpId::kMoeCombine:
    case OpId::kMoeCombineBackward:
    case OpId::kMoeCombineReduceScatterBackward:
    case OpId::kMoeDispatchAllGatherBackward:
    case OpId::kMoeDispatchBackward:
      return OpFamily::kExpertComm;
  }
  return OpFamily::kElementwise;
}

namespace {

constexpr std::string_view kFamilyNames[kNumOpFamilies] = {
    "attention_gemm", "mlp_gemm",     "attention_core", "norm",        "elementwise",
    "tp_comm",        "cp_comm",      "moe_routing",    "expert_gemm", "ep_comm",
    "embedding_head", "pipeline_p2p", "dp_grad_sync",   "optimizer"};

}  // namespace

std::string_view family_name(OpFamily f) {
  return kFamilyNames[static_cast<size_t>(f)];
}

std::optional<OpFamily> parse_family(std::string_view name) {
  for (int i = 0; i < kNumOpFamilies; ++i)
    if (kFamilyNames[i] == name) return static_cast<OpFamily>(i);
  return std::nullopt;
}

double FamilyTimes::family(OpFamily f) const {
  double t = 0;
  for (double x : s[static_cast<size_t>(f)]) t += x;
  return t;
}

double FamilyTimes::total() const {
  double t = 0;
  for (int f = 0; f < kNumOpFamilies; ++f) t += family(static_cast<OpFamily>(f));
  return t;
}

namespace {

// `times` passes of the forward and backward lists, `recomputed` of the recompute list (fewer
// with block recompute).
void add_ops(const CostModel& cost, const ParallelPlan& p, const PassOps& ops, double times,
             double recomputed, FamilyTimes& out) {
  // Priced as CostModel::predict prices them: each op's exposed time (tp-comm-overlap).
  for (const auto* list : {&ops.forward, &ops.backward, &ops.recompute}) {
    const std::vector<double> t = cost.exposed_times(*list, p);
    const double n = list == &ops.recompute ? recomputed : times;
    for (size_t i = 0; i < list->size(); ++i)
      out.at(op_family((*list)[i].id), (*list)[i].role) += t[i] * n;
  }
}

}  // namespace

PredictedBreakdown predict_breakdown(const CostModel& cost, const ParallelPlan& p) {
  const ModelSpec& m = cost.model();
  const Prediction pred = cost.predict(p);
  PredictedBreakdown out;
  out.iteration = pred.iteration_time_s;
  out.peak_memory_bytes = pred.memory.peak;
  const LayerShape shape = cost.priced_layer_shape(p);  // the device's activation type
  const PassOps layer = transformer_layer_ops(m, shape);
  const PassOps moe = m.is_moe() ? moe_layer_ops(m, shape) : PassOps{};
  const PassOps embed = embedding_ops(m, shape);
  const PassOps head = lm_head_ops(m, shape);
  const double mb = static_cast<double>(p.num_microbatches());
  const PipelineSchedule schedule =
      make_pipeline_schedule(schedule_spec(p, m.last_stage_shares_word_embedding()));
  const double p2p =
      p.pipeline_parallel > 1 ? cost.comm().p2p_time(cost.activation_message_bytes(p), p) : 0.0;
  for (int64_t r = 0; r < p.pipeline_parallel; ++r) {
    StagePrediction st;
    st.stage = r;
    FamilyTimes& f = st.families;
    const int64_t moe_layers = cost.moe_layers_on_stage(p, r);
    const int64_t dense_layers = p.layers_on_stage(m, r) - moe_layers;
    const RecomputedLayers rec = p.recompute_layers > 0
                                     ? recomputed_on_stage(m, p, r)
                                     : RecomputedLayers{dense_layers + moe_layers, moe_layers};
    add_ops(cost, p, layer, mb * static_cast<double>(dense_layers),
            mb * static_cast<double>(rec.layers - rec.moe), f);
    if (moe_layers > 0)
      add_ops(cost, p, moe, mb * static_cast<double>(moe_layers), mb * static_cast<double>(rec.moe),
              f);
    if (r == 0) add_ops(cost, p, embed, mb, mb, f);
    if (r == p.pipeline_parallel - 1) add_ops(cost, p, head, mb, mb, f);
    if (r == p.pipeline_parallel - 1 && m.mtp_num_layers > 0) {
      // Each multi-token prediction module: its embedding lookup, projection, layer and head
      // (CostModel::add_mtp).
      const double n = mb * static_cast<double>(m.mtp_num_layers);
      const bool block = p.recompute == Recompute::kFull && p.recompute_layers > 0;
      for (const PassOps* part : {&embed, &head}) add_ops(cost, p, *part, n, n, f);
      add_ops(cost, p, mtp_projection_ops(m, shape), n, n, f);
      add_ops(cost, p, m.mtp_layer_is_moe() ? moe : layer, n, block ? 0.0 : n, f);
    }
    for (const PipelineAction& a : schedule.ranks[static_cast<size_t>(r)])
      if (is_p2p(a.kind) && !a.batched_with_next) ++st.p2p_calls;
    f.at(OpFamily::kPipelineP2p, OpRole::kForward) = static_cast<double>(st.p2p_calls) * p2p;
    const double experts = cost.expert_parameters_on_stage(p, r);
    const double dense = cost.parameters_on_stage(p, r) - experts;
    // What the stage exposes of it (--overlap-grad-reduce, --overlap-param-gather), as predict
    // prices the most loaded stage's.
    double dp = cost.exposed_gradient_sync_time(p, dense + experts, experts,
                                                pred.stages[static_cast<size_t>(r)]);
    // Megatron-FSDP's per-microbatch gathers and reductions (p = 1).
    dp += mb * pred.stages[static_cast<size_t>(r)].dp_comm();
    if (r == 0 || r == p.pipeline_parallel - 1) dp += cost.embedding_sync_time(p);
    dp += cost.sequence_parallel_grad_sync_time(p, r);
    f.at(OpFamily::kDataParallel, OpRole::kForward) = dp;
    f.at(OpFamily::kOptimizer, OpRole::kForward) = cost.optimizer_time(p, dense, experts);
    st.bubble = out.iteration - f.total();
    // A stage with no wait (p = 1) leaves only the rounding of the sum: no bubble.
    if (std::abs(st.bubble) <= 1e-9 * out.iteration) st.bubble = 0;
    out.stages.push_back(st);
  }
  return out;
}

}  // namespace ptdp
