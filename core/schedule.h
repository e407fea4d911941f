// PipelineSchedule: what each pipeline rank does in one training iteration, in order.
//
// One generator serves the simulator (which replays the lists against op costs) and the runtime
// (which executes them). Each rank's list holds compute actions (forward, backward, and for
// zero-bubble schedules the backward split into input-gradient and weight-gradient parts),
// point-to-point actions, and the end-of-iteration gradient synchronisation and optimizer step.
//
// Point-to-point actions that Megatron-LM posts as one batched call carry `batched_with_next`
// on all but the last of the group; a rank posts the whole group, then waits for it. With
// `synchronous_p2p` (Megatron's GPipe/1F1B/interleaved, which synchronise after every batched
// call) the wait covers the group's sends and receives; otherwise only its receives.
//
// Chunks: with v virtual stages, pipeline rank r holds model chunks 0..v-1, chunk c being
// global stage c * p + r. A forward send leaves global stage s for stage s + 1 (the last rank
// wraps around to rank 0, next chunk); a backward send goes to stage s - 1. Send actions name
// the sender's chunk, receive actions the receiver's chunk, both the microbatch.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/parallel_plan.h"

namespace ptdp {

enum class ActionKind : uint8_t {
  kForward,
  kBackward,        // input and weight gradients together
  kBackwardInput,   // zero-bubble schedules: input gradients only (on the critical path)
  kBackwardWeight,  // zero-bubble schedules: weight gradients, deferrable
  kSendForward,
  kRecvForward,
  kSendBackward,
  kRecvBackward,
  kGradSync,       // data-parallel gradient reduction (waits for overlapped buckets)
  kEmbeddingSync,  // all-reduce of tied embedding gradients between first and last stage
  kOptimizerStep,  // gradient-norm all-reduce across the pipeline, then the local update
};

struct PipelineAction {
  ActionKind kind = ActionKind::kForward;
  bool batched_with_next = false;
  int32_t microbatch = -1;
  int32_t chunk = -1;
  // A steady-state forward of the combined 1F1B (ScheduleSpec::combined_1f1b): it and the
  // backward pass after it run as one step.
  bool combined_with_next = false;
};

bool is_compute(ActionKind k);
bool is_p2p(ActionKind k);
bool is_send(ActionKind k);

struct ScheduleSpec {
  Schedule kind = Schedule::k1F1B;
  int64_t pipeline_parallel = 1;
  int64_t microbatches = 1;
  int64_t virtual_stages = 1;
  // The interleaved schedule's microbatch group (ParallelPlan::microbatch_group; 0: p).
  int64_t microbatch_group = 0;
  // Megatron-Core's combined 1F1B (ParallelPlan::overlap_moe_ep_comm): one more warm-up
  // forward, so that every steady-state forward is followed by a backward of another
  // microbatch, the two run as one step (combined_step). 1F1B at p = 1, or interleaved.
  bool combined_1f1b = false;
  bool tied_embeddings = false;  // adds kEmbeddingSync on the first and last rank when p > 1

  int64_t group() const { return microbatch_group > 0 ? microbatch_group : pipeline_parallel; }
};

ScheduleSpec schedule_spec(const ParallelPlan& p, bool tied_embeddings);

struct PipelineSchedule {
  ScheduleSpec spec;
  bool synchronous_p2p = true;
  std::vector<std::vector<PipelineAction>> ranks;

  int64_t p() const { return spec.pipeline_parallel; }
  int64_t v() const { return spec.virtual_stages; }
  int64_t global_stage(int64_t rank, int64_t chunk) const { return chunk * p() + rank; }
  bool first_stage(int64_t rank, int64_t chunk) const { return global_stage(rank, chunk) == 0; }
  bool last_stage(int64_t rank, int64_t chunk) const {
    return global_stage(rank, chunk) == p() * v() - 1;
  }
};

// Whether list[i] is the forward pass of a combined step (spec.combined_1f1b): a steady-state
// forward, directly followed by the backward pass of another microbatch; the two run as one,
// each one's expert all-to-alls behind the other's kernels.
bool combined_step(const PipelineSchedule& s, const std::vector<PipelineAction>& list, size_t i);

// The forward passes (of model chunks) pipeline rank r runs before its first backward pass:
// GPipe all m; 1F1B and ZB-H1 min(p - r - 1, m); interleaved 2 (p - r - 1) + (v - 1) N, capped
// at m v, as Megatron-Core runs it since core 0.10 (SC'21's Megatron-LM ran every forward first
// whenever m == p); the combined 1F1B one more. The generator builds its lists with it; the memory
// model's in-flight activations and combined step count derive from it.
int64_t warmup_forwards(const ScheduleSpec& s, int64_t r);

// The interleaved schedule's forward order: virtual microbatch k runs (microbatch, chunk)
// order[k]; microbatches go in groups of N (ScheduleSpec::group), chunk 0 on a group's
// microbatches, then chunk 1 on the same ones, and so on. The backward order is the same with
// the chunks reversed (chunk v - 1 - c).
std::vector<std::pair<int64_t, int64_t>> interleaved_forward_order(const ScheduleSpec& s);
// The chunk of order[k] alone, without building the order.
int64_t interleaved_forward_chunk(const ScheduleSpec& s, int64_t k);
// The most weight rank r of the interleaved schedule holds at once, chunk c weighing
// chunk_weight[c] (its layers, say), from the orders and warm-up alone: what
// peak_weight_in_flight finds in the built lists, without building them (O(m v) time, no
// memory).
double interleaved_peak_in_flight(const ScheduleSpec& s, int64_t r,
                                  const std::vector<double>& chunk_weight);

// Throws InputError for an impossible spec (interleaving with fewer than p microbatches, or in
// groups that do not fit them, ...).
PipelineSchedule make_pipeline_schedule(const ScheduleSpec& spec);

// Replays the lists with unbounded buffers and checks that every forward precedes its backward
// (and weight-gradient part), every input is received before it is used, every send meets a
// receive of the same microbatch and chunk in order, each microbatch-chunk runs exactly once
// and the lists cannot deadlock. Throws std::logic_error naming the first violation.
void check_pipeline_schedule(const PipelineSchedule& s);

// Most microbatch-chunks whose activations rank r holds at once (forward done, backward, or
// for split schedules weight-gradient part, not yet done), in units of one chunk.
int64_t peak_chunks_in_flight(const PipelineSchedule& s, int64_t rank);
// The same with chunk c of the rank weighing chunk_weight[c] (its layers, say; empty: 1 each):
// the most weight held at once.
double peak_weight_in_flight(const PipelineSchedule& s, int64_t rank,
                             const std::vector<double>& chunk_weight);

// "F3.1" (forward of microbatch 3, chunk 1), "B", "Bi", "W", "sF", "rF", "sB", "rB", "sync",
// "emb", "opt"; a batched group is written "{sF3.0 rB1.0}".
std::string to_string(const PipelineAction& a);
std::string rank_to_string(const PipelineSchedule& s, int64_t rank);

}  // namespace ptdp
