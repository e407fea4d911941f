// Exhaustive search over PTD-P configurations: every (t, cp, p, d, b, v, ep, etp, recompute,
// sequence parallel, distributed optimizer) that can run the model on the GPUs with the global
// batch (the rules of core/plan_rules.h, the ones `ptdp run` applies), pruned by memory and ranked
// by predicted iteration time.
//
// The result does not depend on the thread count: each configuration is priced independently
// and ties are broken by the configuration itself.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/cluster_spec.h"
#include "core/hardware_profile.h"
#include "core/model_spec.h"
#include "core/parallel_plan.h"
#include "planner/cost_model.h"

namespace ptdp {

struct SearchOptions {
  int64_t global_batch_size = 0;
  int top_k = 10;
  int threads = 0;  // 0: one per hardware thread
  std::vector<Recompute> recompute_modes = {Recompute::kNone, Recompute::kSelective,
                                            Recompute::kFull};
  // The module sets selective recomputation is tried with (--recompute-modules pins one; each
  // a RecomputeModule mask).
  std::vector<unsigned> selective_modules = {kRecomputeCoreAttn};
  // A selective candidate with the attention core alone that does not fit is tried again with
  // more modules (memory_saving_modules): in MoE models Megatron-Core's cheap memory savers (the
  // pre-MLP layernorm's output, the experts' activation, the shared experts), in dense models the
  // MLP (between core_attn and full recomputation). Off when --recompute-modules pins the set.
  bool try_memory_saving_modules = true;
  // Interleaving at p = 2 too. Megatron-LM asserts that the interleaved schedule without its
  // p2p overlap (--no-overlap-p2p-communication, which ptdp plan passes on) runs on more than
  // two pipeline ranks.
  bool interleave_two_stages = true;
  bool try_sequence_parallel = true;
  bool try_distributed_optimizer = true;
  // Megatron-FSDP's strategies tried besides DDP and the distributed optimizer, at p = 1 with
  // data-parallel replicas (ptdp plan --use-megatron-fsdp: optim_grads and optim_grads_params,
  // or the --data-parallel-sharding-strategy given); none by default.
  std::vector<FsdpSharding> fsdp_strategies;
  // Their gradients' type (--megatron-fsdp-main-grads-dtype): fp32, or 16 bits. The other
  // candidates keep defaults.fp32_grad_reduce.
  bool fsdp_fp32_grad_reduce = true;
  // The distributed optimizer in K instances (--num-distributed-optimizer-instances), tried
  // besides one instance where K divides a candidate's data-parallel ranks (and its experts')
  // into instances of two ranks or more. 1: not tried; 0 (auto): K = the nodes the
  // data-parallel group spans, one instance per node's part of it.
  int64_t optimizer_instances = 1;
  // With those instances, Megatron-FSDP's strategies across them (--outer-dp-sharding-strategy)
  // that the search tries: no_shard, and optim where the plan allows it.
  std::vector<FsdpSharding> fsdp_outer_strategies = {FsdpSharding::kNoShard, FsdpSharding::kOptim};
  bool try_interleaving = true;
  // Megatron's uneven splits (lighter first and last stages) besides the even one, and for
  // p that does not divide the layers (planner/search.cc stage_splits).
  bool try_uneven_stages = true;
  // With full recompute, also Megatron's block recompute with the fewest layers per chunk that
  // fit in memory (when not recomputing at all does not fit): less recomputation for the same
  // memory budget.
  bool try_block_recompute = true;
  int64_t max_tensor_parallel = 0;  // 0: no limit beyond the heads
  // Context parallelism (cp dividing the GPUs, 2 cp the sequence) up to max_context_parallel
  // (0: no limit), and for MoE models expert parallelism (ep dividing the experts) with the
  // expert tensor-parallel size t or 1.
  // cp is tried while each rank keeps at least min_context_tokens of the sequence: below that a
  // ring step's attention block is too small to hide the K/V transfer and every rank's GEMMs
  // thin out (a2a and the all-gather hide nothing to begin with), and Megatron-Core recommends
  // cp for long sequences only.
  bool try_context_parallel = true;
  int64_t max_context_parallel = 0;
  int64_t min_context_tokens = 2048;
  // How cp > 1 plans meet the other ranks' keys (--cp-comm-type pins one): each is priced and
  // the plan keeps the fastest that fits.
  std::vector<CpComm> cp_comms = {kCpComms.begin(), kCpComms.end()};
  bool try_expert_parallel = true;
  // Only this pipeline schedule (--pipeline-schedule): interleaved with v > 1 only, the others
  // with v = 1. Unset: 1f1b, or interleaved where v > 1.
  std::optional<Schedule> schedule;
  // Settings every candidate shares (taken from the user's flags).
  ParallelPlan defaults;
  // Called now and then from the searching threads with (done, total) units of work.
  std::function<void(int64_t, int64_t)> progress;
};

// The selective modules a memory-tight candidate is tried again with: core_attn with mlp in a
// dense model; with layernorm and moe_act in an MoE model, and shared_experts in one with shared
// experts.
unsigned memory_saving_modules(const ModelSpec& m);
// a2a+p2p's all-to-all sizes the search tries for a plan's cp, ascending: each A dividing cp
// (1 < A < cp) that divides each tensor-parallel rank's heads and query groups and whose group
// of t A GPUs fits in a node (Transformer Engine's design: the all-to-alls on the node's links,
// the ring, hidden behind the attention, across nodes).
std::vector<int64_t> hierarchical_cp_sizes(const ModelSpec& m, const ParallelPlan& p,
                                           int64_t gpus_per_node);
// Of those, the one ptdp plan takes for `p` (its cp, t and the rest): the fastest that fits,
// else the fastest; 0 when none is allowed.
int64_t fastest_hierarchical_cp(const CostModel& cost, const ModelSpec& m, const ParallelPlan& p);
// The largest of them (what with_cp_comm gives a plan that names no size); 0 when there is
// none.
int64_t natural_hierarchical_cp(const ModelSpec& m, const ParallelPlan& p, int64_t gpus_per_node);
// `p` with --cp-comm-type `type`: with a2a+p2p at cp > 1 the all-to-all size p has, or else the
// natural one; without it, no hierarchical sizes.
ParallelPlan with_cp_comm(ParallelPlan p, CpComm type, const ModelSpec& m, int64_t gpus_per_node);

struct RankedPlan {
  ParallelPlan plan;
  Prediction prediction;
};

struct SearchResult {
  std::vector<RankedPlan> top;              // best first
  int64_t evaluated = 0;                    // configurations priced (fit in memory)
  int64_t considered = 0;                   // all configurations enumerated, rejected ones included
  std::map<std::string, int64_t> rejected;  // reason -> count
  double seconds = 0;
};

// The ways the search lays num_layers over p pipeline stages: the even split (an empty
// vector) where p divides the layers and, with `uneven`, Megatron's uneven splits, in which
// the first and last stages hold fewer layers than the others (they also hold the embedding
// and the LM head) and every other stage holds the same number `mid`. For each mid from the
// smallest that leaves the ends no more than mid, up to two layers more, the ends share the
// rest as evenly as possible (both orders when it is odd), or one end is as full as the
// middle and the other takes the rest. p = 2 tries the halves and one layer either way.
std::vector<std::vector<int64_t>> stage_splits(int64_t num_layers, int64_t p, bool uneven);
// The interleaved layouts (ParallelPlan::layers_per_chunk, p * v chunks, v >= 2) that
// Megatron-Core's --account-for-embedding-in-pipeline-split and/or
// --account-for-loss-in-pipeline-split make: every chunk holds (layers + counted) / (p v)
// layers, the first and the last one fewer where they hold the embedding or the loss; with
// mtp_layers multi-token prediction modules, also those layouts that count each module as a
// layer of the last chunk (which may then hold none of the decoder's). Those where p v divides
// the slots and no chunk is left without a layer or a module; the search tries them
// (SearchOptions::try_uneven_stages with interleaving).
std::vector<std::vector<int64_t>> accounted_chunk_layouts(int64_t num_layers, int64_t p,
                                                          int64_t mtp_layers = 0);

SearchResult search_plans(const ModelSpec& m, const ClusterSpec& c, const HardwareProfile& h,
                          const SearchOptions& o);

// The main reason `loser` is slower than `winner`: the breakdown component that grew most,
// e.g. "pipeline bubble +0.42 s".
std::string loses_because(const Prediction& winner, const Prediction& loser);
// How plan `b` differs from `a`, e.g. "p 16->8, b 1->2, recompute full->selective".
std::string plan_difference(const ParallelPlan& a, const ParallelPlan& b);
// Short form used in tables: "t8 p16 d8 b1 v3 full sp do".
std::string plan_summary(const ParallelPlan& p);
// Layers per pipeline stage, or per model chunk with a layout: "even", or runs of equal ones
// such as "7+14x8+7".
std::string stage_split_summary(const ParallelPlan& p);

}  // namespace ptdp
