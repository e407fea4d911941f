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

}  // namespace ptdp
