// The sizes of a GptShard's parameter buffer, computed without building the shard, so that
// `ptdp run --dry-run` can report what each rank would hold before anything is allocated.
// The trainer checks on every real run that the shard it built has exactly these sizes
// (runtime/trainer.cc), so the two cannot drift apart silently.
#pragma once

#include <cstdint>
#include <vector>

#include "core/model_spec.h"
#include "runtime/gpt_model.h"

namespace ptdp {

// Floats of each parameter segment GptShard lays out for this layout (segment 0 the word
// embedding or its tied copy, segment 1 the rest), each padded to layout.segment_multiple as
// GptShard pads it. The layout must be valid (validate_shard_layout).
std::vector<int64_t> shard_segment_sizes(const ModelSpec& m, const ShardLayout& layout);

// Under Megatron-FSDP (layout.fsdp optim_grads or optim_grads_params, one stage of one chunk;
// runtime/fsdp.h) what the rank holds, in elements: the weights it keeps (its shard, and what
// stays whole) and its gradient shard, and at most, the layers' weights gathered at once and the
// fp32 gradient windows open or reducing at once (the tied word embedding's throughout, a part's
// while its backward pass runs, the part before it while its reduction is in flight).
struct FsdpHeld {
  int64_t weights = 0, gradients = 0, gathered = 0, gradient_windows = 0;
};
FsdpHeld fsdp_held(const ModelSpec& m, const ShardLayout& layout);

}  // namespace ptdp
