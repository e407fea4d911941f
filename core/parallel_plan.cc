// ParallelPlan: enum names, stage sizes, validation against a model (the rules of
// core/plan_rules.h), the Megatron-LM flag line, and JSON I/O.
#include "core/parallel_plan.h"

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "core/error.h"
#include "core/json_reader.h"
#include "core/plan_rules.h"

namespace ptdp {

using nlohmann::json;

std::string to_string(Recompute r) {
  switch (r) {
    case Recompute::kNone:
      return "none";
    case Recompute::kSelective:
      return "selective";
    case Recompute::kFull:
      return "full";
  }
  return "?";
}

std::string to_string(Schedule s) {
  switch (s) {
    case Schedule::kGPipe:
      return "gpipe";
    case Schedule::k1F1B:
      return "1f1b";
    case Schedule::kInterleaved1F1B:
      return "interleaved";
    case Schedule::kZeroBubbleH1:
      return "zb-h1";
  }
  return "?";
}

std::string to_string(CpComm c) {
  switch (c) {
    case CpComm::kP2P:
      return "p2p";
    case CpComm::kAllGather:
      return "all_gather";
    case CpComm::kA2A:
      return "a2a";
    case CpComm::kA2AP2P:
      return "a2a+p2p";
  }
  return "?";
}

std::string to_string(FsdpSharding s) {
  switch (s) {
    case FsdpSharding::kOff:
      return "off";
    case FsdpSharding::kNoShard:
      return "no_shard";
    case FsdpSharding::kOptim:
      return "optim";
    case FsdpSharding::kOptimGrads:
      return "optim_grads";
    case FsdpSharding::kOptimGradsParams:
      return "optim_grads_params";
  }
  return "?";
}

std::string recompute_label(const ParallelPlan& p) {
  if (p.recompute == Recompute::kFull && p.recompute_layers > 0)
    return "block" + std::to_string(p.recompute_layers);
  if (p.recompute == Recompute::kSelective && p.recompute_modules != kRecomputeCoreAttn) {
    // "selective+mlp+moe_act"; without the attention core "selective(mlp,moe_act)"
    const bool core = p.recompute_modules & kRecomputeCoreAttn;
    std::string rest;
    for (const std::string& name :
         recompute_module_names(p.recompute_modules & ~kRecomputeCoreAttn))
      rest += (core ? "+" : rest.empty() ? "" : ",") + name;
    return core ? "selective" + rest : "selective(" + rest + ")";
  }
  return to_string(p.recompute);
}

namespace {

constexpr std::pair<unsigned, const char*> kRecomputeModuleNames[] = {
    {kRecomputeCoreAttn, "core_attn"},
    {kRecomputeMlp, "mlp"},
    {kRecomputeMoeAct, "moe_act"},
    {kRecomputeLayernorm, "layernorm"},
    {kRecomputeSharedExperts, "shared_experts"},
    {kRecomputeMoe, "moe"},
    {kRecomputeMlaUpProj, "mla_up_proj"}};

}  // namespace

std::vector<std::string> recompute_module_names(unsigned modules) {
  std::vector<std::string> out;
  for (const auto& [bit, name] : kRecomputeModuleNames)
    if (modules & bit) out.emplace_back(name);
  return out;
}

bool fp8_needs_current_scaling(const ParallelPlan& p) {
  return p.fp8 && p.recompute == Recompute::kSelective &&
         (p.recompute_modules & (kRecomputeMoeAct | kRecomputeLayernorm)) != 0;
}

std::string recompute_modules_string(unsigned modules) {
  std::string out;
  for (const std::string& name : recompute_module_names(modules))
    out += (out.empty() ? "" : " ") + name;
  return out;
}

unsigned recompute_modules_from_strings(const std::vector<std::string>& names,
                                        const std::string& field) {
  if (names.empty())
    throw InputError(
        field,
        "names no module (expected core_attn, mlp, moe_act, layernorm, shared_experts, moe and/or "
        "mla_up_proj)");
  unsigned modules = 0;
  for (const std::string& n : names) {
    unsigned bit = 0;
    for (const auto& [b, name] : kRecomputeModuleNames)
      if (n == name) bit = b;
    if (bit == 0)
      throw InputError(field, "'" + n +
                                  "' is not a module (expected core_attn, mlp, moe_act, "
                                  "layernorm, shared_experts, moe and/or mla_up_proj)");
    modules |= bit;
  }
  return modules;
}

namespace {

template <typename Values>
auto enum_from_string(const std::string& s, const Values& values, const std::string& field) {
  std::string expected;
  for (const auto e : values) {
    if (s == to_string(e)) return e;
    expected += (expected.empty() ? "" : ", ") + to_string(e);
  }
  throw InputError(field, "unknown value '" + s + "' (expected one of " + expected + ")");
}

constexpr auto kFsdpShardings = {FsdpSharding::kNoShard, FsdpSharding::kOptim,
                                 FsdpSharding::kOptimGrads, FsdpSharding::kOptimGradsParams};
constexpr auto kRecomputes = {Recompute::kNone, Recompute::kSelective, Recompute::kFull};
constexpr auto kSchedules = {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B,
                             Schedule::kZeroBubbleH1};
// Megatron-LM's --help spells all_gather "allgather"; both are read.
CpComm parse_cp_comm(const std::string& s, const std::string& field) {
  return enum_from_string(s == "allgather" ? "all_gather" : s, kCpComms, field);
}

}  // namespace

Recompute recompute_from_string(const std::string& s) {
  return enum_from_string(s, kRecomputes, "--recompute-granularity");
}

Schedule schedule_from_string(const std::string& s) {
  return enum_from_string(s, kSchedules, "--pipeline-schedule");
}

CpComm cp_comm_from_string(const std::string& s) {
  return parse_cp_comm(s, "--cp-comm-type");
}

FsdpSharding fsdp_sharding_from_string(const std::string& s) {
  return enum_from_string(s, kFsdpShardings, "--data-parallel-sharding-strategy");
}

int64_t ParallelPlan::layers_on_stage(const ModelSpec& m, int64_t r) const {
  if (r < 0 || r >= pipeline_parallel)
    throw std::out_of_range("layers_on_stage: no pipeline rank " + std::to_string(r));
  if (!layers_per_chunk.empty()) {
    int64_t sum = 0;
    for (size_t g = static_cast<size_t>(r); g < layers_per_chunk.size();
         g += static_cast<size_t>(pipeline_parallel))
      sum += layers_per_chunk[g];
    return sum;
  }
  if (!layers_per_stage.empty()) return layers_per_stage.at(static_cast<size_t>(r));
  return m.num_layers / pipeline_parallel;
}

int64_t ParallelPlan::layers_in_chunk(const ModelSpec& m, int64_t r, int64_t c) const {
  if (!layers_per_chunk.empty())
    return layers_per_chunk.at(static_cast<size_t>(c * pipeline_parallel + r));
  return layers_on_stage(m, r) / virtual_stages;
}

int64_t ParallelPlan::most_layers_in_a_chunk(const ModelSpec& m) const {
  int64_t most = 0;
  for (int64_t r = 0; r < pipeline_parallel; ++r)
    for (int64_t c = 0; c < virtual_stages; ++c) most = std::max(most, layers_in_chunk(m, r, c));
  return most;
}

int64_t ParallelPlan::first_layer_of_chunk(const ModelSpec& m, int64_t r, int64_t c) const {
  int64_t first = 0;
  for (int64_t g = 0; g < c * pipeline_parallel + r; ++g)
    first += layers_in_chunk(m, g % pipeline_parallel, g / pipeline_parallel);
  return first;
}

namespace {

constexpr const char* kLayoutFlag = "--pipeline-model-parallel-layout";

// The count after a '*' at s[star], and where it ends; nullopt when no digits follow.
std::optional<std::pair<int64_t, size_t>> repeat_count(const std::string& s, size_t star) {
  if (star >= s.size() || s[star] != '*') return std::nullopt;
  size_t end = star + 1;
  while (end < s.size() && std::isdigit(static_cast<unsigned char>(s[end]))) ++end;
  if (end == star + 1) return std::nullopt;
  if (end - star - 1 > 6)
    throw InputError(kLayoutFlag, "repeats more than 999999 times in '" + s + "'");
  return std::make_pair(std::stoll(s.substr(star + 1, end - star - 1)), end);
}

void append_repeated(std::string& out, const std::string& body, int64_t n) {
  if (static_cast<double>(n) * static_cast<double>(body.size()) + static_cast<double>(out.size()) >
      1e6)
    throw InputError(kLayoutFlag, "unrolls to more than a million characters");
  for (int64_t k = 0; k < n; ++k) out += body;
}

// Unrolls "(...)*n" (groups are not nested), then "x*n", as Megatron-Core's parser does.
std::string unroll_repeats(const std::string& s) {
  std::string groups;
  for (size_t i = 0; i < s.size();) {
    if (s[i] != '(') {
      groups += s[i++];
      continue;
    }
    const size_t close = s.find(')', i);
    // (Megatron-Core's pattern needs something inside the parentheses.)
    const auto count =
        close == std::string::npos || close == i + 1 ? std::nullopt : repeat_count(s, close + 1);
    if (!count) throw InputError(kLayoutFlag, "needs (...)*n for a group, in '" + s + "'");
    append_repeated(groups, s.substr(i + 1, close - i - 1), count->first);
    i = count->second;
  }
  std::string out;
  for (size_t i = 0; i < groups.size();) {
    if (const auto count = repeat_count(groups, i + 1)) {
      append_repeated(out, groups.substr(i, 1), count->first);
      i = count->second;
    } else {
      out += groups[i++];
    }
  }
  return out;
}

}  // namespace

PipelineLayout parse_pipeline_layout(const std::string& layout, int64_t pipeline_parallel) {
  if (pipeline_parallel < 1)
    throw InputError(kLayoutFlag, "needs pipeline-model-parallel-size >= 1");
  std::string s;
  for (char ch : layout)
    if (ch != ',') s += ch;  // commas are cosmetic; anything else is read (a space is refused)
  if (s.empty()) throw InputError(kLayoutFlag, "is empty");
  s = unroll_repeats(s);
  std::vector<std::string> stages(1);
  for (char ch : s) {
    if (ch == '|') {
      stages.emplace_back();
      continue;
    }
    if (ch != 't' && ch != 'E' && ch != 'L' && ch != 'm')
      throw InputError(kLayoutFlag, std::string("has '") + ch +
                                        "', not one of t (transformer layer), m (multi-token "
                                        "prediction), E (embedding), L (loss), |, (...)*n or x*n");
    stages.back() += ch;
  }
  const auto count = static_cast<int64_t>(stages.size());
  if (count % pipeline_parallel != 0)
    throw InputError(kLayoutFlag, "has " + std::to_string(count) +
                                      " stages, not a multiple of pipeline-model-parallel-size (" +
                                      std::to_string(pipeline_parallel) + ")");
  PipelineLayout out;
  out.virtual_stages = count / pipeline_parallel;
  for (int64_t g = 0; g < count; ++g) {
    const std::string& stage = stages[static_cast<size_t>(g)];
    int64_t layers = 0;
    for (size_t i = 0; i < stage.size(); ++i) {
      const char ch = stage[i];
      if (ch == 't' && out.mtp_layers > 0) {
        throw InputError(kLayoutFlag,
                         "places a transformer layer (t) after a multi-token prediction layer (m)");
      } else if (ch == 't') {
        ++layers;
      } else if (ch == 'm' && g != count - 1) {
        // (Megatron-Core also runs them in a chunk of their own on an earlier rank.)
        throw InputError(kLayoutFlag,
                         "places multi-token prediction layers (m) other than in the last stage, "
                         "where ptdp runs them");
      } else if (ch == 'm') {
        ++out.mtp_layers;
      } else if (ch == 'E' && !(g == 0 && i == 0)) {
        throw InputError(kLayoutFlag,
                         "places the embedding (E) other than first in the first stage");
      } else if (ch == 'L' && !(g == count - 1 && i + 1 == stage.size())) {
        throw InputError(kLayoutFlag, "places the loss (L) other than last in the last stage");
      }
    }
    out.layers_per_chunk.push_back(layers);
  }
  if (stages.front().empty() || stages.front()[0] != 'E')
    throw InputError(kLayoutFlag, "must begin with the embedding (E)");
  if (stages.back().empty() || stages.back().back() != 'L')
    throw InputError(kLayoutFlag, "must end with the loss (L)");
  return out;
}

std::string pipeline_layout_string(const std::vector<int64_t>& layers_per_chunk,
                                   int64_t mtp_layers) {
  const size_t n = layers_per_chunk.size();
  auto repeated = [](char ch, int64_t k) {
    return k > 2 ? std::string(1, ch) + "*" + std::to_string(k)
                 : std::string(static_cast<size_t>(std::max<int64_t>(k, 0)), ch);
  };
  auto stage = [&](size_t g) {
    std::string s = g == 0 ? "E" : "";
    s += repeated('t', layers_per_chunk[g]);
    if (g + 1 == n) s += repeated('m', mtp_layers) + "L";
    return s;
  };
  std::string out;
  for (size_t g = 0; g < n;) {
    size_t run = 1;
    if (g > 0)
      while (g + run + 1 < n && layers_per_chunk[g + run] == layers_per_chunk[g]) ++run;
    if (run > 1) {
      // Runs of two or more equal middle stages: "(S|)*k", the next stage following directly.
      out += "(" + stage(g) + "|)*" + std::to_string(run);
    } else {
      out += stage(g);
      if (g + 1 < n) out += "|";
    }
    g += run;
  }
  return out;
}

namespace {

bool uneven(const ParallelPlan& p) {
  for (int64_t n : p.layers_per_stage)
    if (n != p.layers_per_stage.front()) return true;
  return false;
}

// True when every stage but the first and the last holds the same number of layers.
bool only_ends_differ(const ParallelPlan& p) {
  const std::vector<int64_t>& n = p.layers_per_stage;
  for (size_t i = 2; i + 1 < n.size(); ++i)
    if (n[i] != n[1]) return false;
  return n.size() >= 2;
}

}  // namespace

void ParallelPlan::validate(const ModelSpec& m) const {
  check_plan(m, *this);
}

std::string ParallelPlan::megatron_flags(const ModelSpec& m, DType precision) const {
  std::ostringstream f;
  f << "--num-layers " << m.num_layers << " --hidden-size " << m.hidden_size
    << " --num-attention-heads " << m.num_attention_heads << " --seq-length " << m.seq_length
    << " --max-position-embeddings " << m.max_positions() << " --vocab-size " << m.vocab_size;
  // Megatron's --swiglu default FFN width is not 4h, so gated models always state it.
  if (m.ffn_hidden() != 4 * m.hidden_size || m.swiglu) f << " --ffn-hidden-size " << m.ffn_hidden();
  if (m.query_groups() != m.num_attention_heads)
    f << " --group-query-attention --num-query-groups " << m.query_groups();
  if (m.kv_channels > 0 && m.query_width() != m.hidden_size) f << " --kv-channels " << m.head_dim();
  if (m.qk_layernorm) f << " --qk-layernorm";
  if (m.add_qkv_bias && m.swiglu) f << " --add-qkv-bias";
  if (m.multi_latent_attention) {
    f << " --multi-latent-attention";
    if (m.q_lora_rank > 0) f << " --q-lora-rank " << m.q_lora_rank;
    f << " --kv-lora-rank " << m.kv_lora_rank << " --qk-head-dim " << m.qk_head_dim
      << " --qk-pos-emb-head-dim " << m.qk_pos_emb_head_dim << " --v-head-dim " << m.v_head_dim;
  }
  // ModelSpec's bias rule: gated models have no biases and use RMSNorm.
  if (m.swiglu) f << " --swiglu --disable-bias-linear --normalization RMSNorm";
  if (m.untie_embeddings_and_output_weights) f << " --untie-embeddings-and-output-weights";
  if (m.is_moe()) {
    f << " --num-experts " << m.num_experts << " --moe-router-topk " << m.moe_router_topk;
    if (m.moe_ffn_hidden() != m.ffn_hidden()) f << " --moe-ffn-hidden-size " << m.moe_ffn_hidden();
    if (m.moe_shared_expert_ffn_size > 0)
      f << " --moe-shared-expert-intermediate-size " << m.moe_shared_expert_ffn_size;
    if (m.moe_first_dense_layers > 0) {
      // Megatron's pattern form: "([0]*K+[1]*(L-K))" for a freq of 1.
      f << " --moe-layer-freq \"[";
      for (int64_t i = 0; i < m.num_layers; ++i) f << (i ? "," : "") << (m.is_moe_layer(i) ? 1 : 0);
      f << "]\"";
    } else if (m.moe_layer_freq != 1) {
      f << " --moe-layer-freq " << m.moe_layer_freq;
    }
    if (m.moe_capacity_factor > 0)
      f << " --moe-expert-capacity-factor " << m.moe_capacity_factor << " --moe-token-drop-policy "
        << (m.moe_drop_by_position ? "position" : "probs");
    f << " --moe-token-dispatcher-type alltoall --moe-grouped-gemm";
  }
  if (m.mtp_num_layers > 0) {
    f << " --mtp-num-layers " << m.mtp_num_layers;
    if (m.mtp_loss_scaling_factor != 0.1)
      f << " --mtp-loss-scaling-factor " << m.mtp_loss_scaling_factor;
  }
  f << " --tensor-model-parallel-size " << tensor_parallel << " --pipeline-model-parallel-size "
    << pipeline_parallel;
  if (context_parallel > 1) f << " --context-parallel-size " << context_parallel;
  if (context_parallel > 1 && cp_comm != CpComm::kP2P)
    f << " --cp-comm-type " << to_string(cp_comm);
  if (context_parallel > 1 && cp_comm == CpComm::kA2AP2P)
    f << " --hierarchical-context-parallel-sizes " << cp_a2a_size() << " " << cp_ring_size();
  if (expert_parallel > 1) f << " --expert-model-parallel-size " << expert_parallel;
  if (m.is_moe() && expert_tp() != tensor_parallel)
    f << " --expert-tensor-parallel-size " << expert_tp();
  // Megatron's first and last stage flags where only they differ; any other split, and every
  // per-chunk layout, as Megatron-Core's layout string (which sets v too).
  const int64_t p = pipeline_parallel;
  const bool layout = !layers_per_chunk.empty() || (uneven(*this) && !only_ends_differ(*this));
  if (layout) {
    f << " --pipeline-model-parallel-layout \""
      << pipeline_layout_string(layers_per_model_chunk(m, *this), m.mtp_num_layers) << "\"";
  } else if (uneven(*this)) {
    f << " --decoder-first-pipeline-num-layers " << layers_per_stage.front()
      << " --decoder-last-pipeline-num-layers " << layers_per_stage.back();
  }
  // (A layout's stages give v.)
  if (virtual_stages > 1 && !layout && uneven(*this))
    f << " --num-virtual-stages-per-pipeline-rank " << virtual_stages;
  else if (virtual_stages > 1 && !layout)
    f << " --num-layers-per-virtual-pipeline-stage " << m.num_layers / (p * virtual_stages);
  if (virtual_stages > 1 && microbatch_group_size() != p)
    f << " --microbatch-group-size-per-virtual-pipeline-stage " << microbatch_group_size();
  f << " --micro-batch-size " << micro_batch_size << " --global-batch-size " << global_batch_size;
  if (recompute == Recompute::kFull && recompute_layers > 0)
    f << " --recompute-granularity full --recompute-method block --recompute-num-layers "
      << recompute_layers;
  else if (recompute == Recompute::kFull)
    f << " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1";
  if (recompute == Recompute::kSelective) f << " --recompute-granularity selective";
  if (recompute == Recompute::kSelective && recompute_modules != kRecomputeCoreAttn)
    f << " --recompute-modules " << recompute_modules_string(recompute_modules);
  if (sequence_parallel) f << " --sequence-parallel";
  if (distributed_optimizer) f << " --use-distributed-optimizer";
  if (optimizer_instances > 1)
    f << " --num-distributed-optimizer-instances " << optimizer_instances;
  if (fsdp != FsdpSharding::kOff) {
    // Megatron-FSDP checkpoints only in its own format (Megatron-LM's argument check). Its
    // main gradients default to the model's dtype ("auto"); the plan's are priced in fp32
    // unless it reduces 16-bit gradients (ptdp's --fp16-grad-reduce).
    f << " --use-megatron-fsdp --data-parallel-sharding-strategy " << to_string(fsdp)
      << " --ckpt-format fsdp_dtensor";
    if (fp32_grad_reduce) f << " --megatron-fsdp-main-grads-dtype fp32";
    if (optimizer_instances > 1) f << " --outer-dp-sharding-strategy " << to_string(fsdp_outer);
  }
  if (overlap_grad_reduce) f << " --overlap-grad-reduce";
  if (overlap_param_gather && distributed_optimizer) f << " --overlap-param-gather";
  if (tp_comm_overlap && sequence_parallel) f << " --tp-comm-overlap";
  if (overlap_moe_ep_comm) f << " --overlap-moe-expert-parallel-comm";
  if (precision == DType::kBF16) f << " --bf16";
  if (precision == DType::kF16) f << " --fp16";
  if (fp8) f << " --fp8-format hybrid";
  if (fp8_needs_current_scaling(*this)) f << " --fp8-recipe tensorwise";
  if (virtual_stages > 1 && !overlap_p2p_comm) f << " --no-overlap-p2p-communication";
  if (fp32_grad_reduce) f << " --accumulate-allreduce-grads-in-fp32";
  if (!gradient_accumulation_fusion) f << " --no-gradient-accumulation-fusion";
  if (!m.learned_position_embeddings)
    f << " --position-embedding-type rope --rotary-base " << static_cast<int64_t>(m.rotary_base);
  // Megatron's defaults are 0.1 for both and no flash attention.
  if (m.attention_dropout != 0.1) f << " --attention-dropout " << m.attention_dropout;
  if (m.hidden_dropout != 0.1) f << " --hidden-dropout " << m.hidden_dropout;
  if (m.flash_attention) f << " --use-flash-attn";
  if (m.cross_entropy_fusion) f << " --cross-entropy-loss-fusion";
  return f.str();
}

std::string ParallelPlan::ptdp_flags() const {
  std::string f;
  if (!fp32_grad_reduce) f += " --fp16-grad-reduce";
  if (!scatter_gather_p2p) f += " --no-scatter-gather";
  const Schedule implied = virtual_stages > 1 ? Schedule::kInterleaved1F1B : Schedule::k1F1B;
  if (schedule != implied) f += " --pipeline-schedule " + to_string(schedule);
  return f.empty() ? f : f.substr(1);
}

std::vector<int64_t> megatron_stage_split(int64_t num_layers, int64_t p, int64_t first,
                                          int64_t last) {
  const char* first_flag = "--decoder-first-pipeline-num-layers";
  const char* last_flag = "--decoder-last-pipeline-num-layers";
  const char* flag = last > 0 ? last_flag : first_flag;
  if (first < 0 || last < 0)
    throw InputError(first < 0 ? first_flag : last_flag, "must be positive");
  const int64_t ends = (first > 0) + (last > 0);
  if (p < ends + 1 && !(p == ends && first + last == num_layers))
    throw InputError(flag, "needs pipeline-model-parallel-size > " + std::to_string(ends) +
                               " (or first + last = num_layers with p = 2)");
  const int64_t rest = num_layers - first - last;
  const int64_t middle_stages = p - ends;
  if (middle_stages == 0) return {first, last};
  if (rest < middle_stages || rest % middle_stages != 0)
    throw InputError(flag, "leaves " + std::to_string(rest) + " of " + std::to_string(num_layers) +
                               " layers for " + std::to_string(middle_stages) +
                               " other pipeline stages, which must share them evenly");
  std::vector<int64_t> split(static_cast<size_t>(p), rest / middle_stages);
  if (first > 0) split.front() = first;
  if (last > 0) split.back() = last;
  return split;
}

ParallelPlan plan_from_json(const json& j) {
  JsonObjectReader r(j, "plan");
  ParallelPlan p;
  r.read("tensor_parallel", p.tensor_parallel);
  r.read("pipeline_parallel", p.pipeline_parallel);
  r.read("data_parallel", p.data_parallel);
  r.read("context_parallel", p.context_parallel);
  std::string cp_comm = to_string(p.cp_comm);
  r.read("cp_comm_type", cp_comm);
  p.cp_comm = parse_cp_comm(cp_comm, r.field("cp_comm_type"));
  std::vector<int64_t> hierarchy;
  r.read("hierarchical_context_parallel_sizes", hierarchy);
  if (!hierarchy.empty()) {
    if (hierarchy.size() != 2 || hierarchy[0] < 1 || hierarchy[1] < 1)
      throw InputError(r.field("hierarchical_context_parallel_sizes"),
                       "must be two positive sizes [A, B], the all-to-all's and the ring's");
    if (hierarchy[0] * hierarchy[1] != p.context_parallel)
      throw InputError(r.field("hierarchical_context_parallel_sizes"),
                       "multiply to " + std::to_string(hierarchy[0] * hierarchy[1]) +
                           ", not context_parallel (" + std::to_string(p.context_parallel) + ")");
    p.hierarchical_cp = hierarchy[0];
  }
  r.read("expert_parallel", p.expert_parallel);
  r.read("expert_tensor_parallel", p.expert_tensor_parallel);
  r.read("micro_batch_size", p.micro_batch_size);
  r.read("global_batch_size", p.global_batch_size);
  r.read("virtual_stages", p.virtual_stages);
  r.read("microbatch_group", p.microbatch_group);
  std::string schedule = to_string(p.schedule), recompute = to_string(p.recompute);
  r.read("schedule", schedule);
  r.read("recompute", recompute);
  p.schedule = enum_from_string(schedule, kSchedules, r.field("schedule"));
  p.recompute = enum_from_string(recompute, kRecomputes, r.field("recompute"));
  r.read("recompute_layers", p.recompute_layers);
  if (r.member("recompute_modules")) {
    std::vector<std::string> modules;
    r.read("recompute_modules", modules);
    p.recompute_modules = recompute_modules_from_strings(modules, r.field("recompute_modules"));
  }
  r.read("sequence_parallel", p.sequence_parallel);
  r.read("distributed_optimizer", p.distributed_optimizer);
  r.read("distributed_optimizer_instances", p.optimizer_instances);
  std::string fsdp = to_string(p.fsdp);
  r.read("megatron_fsdp", fsdp);
  if (fsdp != "off") p.fsdp = enum_from_string(fsdp, kFsdpShardings, r.field("megatron_fsdp"));
  std::string outer = to_string(p.fsdp_outer);
  r.read("megatron_fsdp_outer", outer);
  p.fsdp_outer = enum_from_string(outer, kFsdpShardings, r.field("megatron_fsdp_outer"));
  r.read("overlap_grad_reduce", p.overlap_grad_reduce);
  r.read("overlap_param_gather", p.overlap_param_gather);
  r.read("tp_comm_overlap", p.tp_comm_overlap);
  r.read("overlap_moe_ep_comm", p.overlap_moe_ep_comm);
  r.read("fp8", p.fp8);
  r.read("fp32_grad_reduce", p.fp32_grad_reduce);
  r.read("scatter_gather_p2p", p.scatter_gather_p2p);
  r.read("overlap_p2p_comm", p.overlap_p2p_comm);
  r.read("gradient_accumulation_fusion", p.gradient_accumulation_fusion);
  r.read("layers_per_stage", p.layers_per_stage);
  r.read("layers_per_chunk", p.layers_per_chunk);
  r.reject_unknown_keys();
  return p;
}

json to_json(const ParallelPlan& p) {
  const std::vector<int64_t> hierarchy =
      p.hierarchical_cp > 0
          ? std::vector<int64_t>{p.hierarchical_cp, p.context_parallel / p.hierarchical_cp}
          : std::vector<int64_t>{};
  return json{{"tensor_parallel", p.tensor_parallel},
              {"pipeline_parallel", p.pipeline_parallel},
              {"data_parallel", p.data_parallel},
              {"context_parallel", p.context_parallel},
              {"cp_comm_type", to_string(p.cp_comm)},
              {"hierarchical_context_parallel_sizes", hierarchy},
              {"expert_parallel", p.expert_parallel},
              {"expert_tensor_parallel", p.expert_tensor_parallel},
              {"micro_batch_size", p.micro_batch_size},
              {"global_batch_size", p.global_batch_size},
              {"virtual_stages", p.virtual_stages},
              {"microbatch_group", p.microbatch_group},
              {"schedule", to_string(p.schedule)},
              {"recompute", to_string(p.recompute)},
              {"recompute_layers", p.recompute_layers},
              {"recompute_modules", recompute_module_names(p.recompute_modules)},
              {"sequence_parallel", p.sequence_parallel},
              {"distributed_optimizer", p.distributed_optimizer},
              {"distributed_optimizer_instances", p.optimizer_instances},
              {"megatron_fsdp", to_string(p.fsdp)},
              {"megatron_fsdp_outer", to_string(p.fsdp_outer)},
              {"overlap_grad_reduce", p.overlap_grad_reduce},
              {"overlap_param_gather", p.overlap_param_gather},
              {"tp_comm_overlap", p.tp_comm_overlap},
              {"overlap_moe_ep_comm", p.overlap_moe_ep_comm},
              {"fp8", p.fp8},
              {"fp32_grad_reduce", p.fp32_grad_reduce},
              {"scatter_gather_p2p", p.scatter_gather_p2p},
              {"overlap_p2p_comm", p.overlap_p2p_comm},
              {"gradient_accumulation_fusion", p.gradient_accumulation_fusion},
              {"layers_per_stage", p.layers_per_stage},
              {"layers_per_chunk", p.layers_per_chunk}};
}

}  // namespace ptdp
