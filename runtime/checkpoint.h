// Sharded checkpoints: every rank writes its own file (its parameters and optimizer states)
// under DIR/step_NNNNNNN/, then rank 0 points DIR/latest at the step. Each file is written to
// a temporary name, ends with a checksum of everything before it, and is renamed into place;
// `latest` moves only after every rank's file is in place, so a crash at any moment leaves the
// previous checkpoint whole.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

namespace ptdp {

struct CheckpointShard {
  int64_t step = 0;                        // training steps completed
  nlohmann::json layout;                   // what must match to load it (model, t, p, d, ...)
  std::vector<std::vector<float>> arrays;  // parameters, optimizer states, ...
};

std::string checkpoint_step_dir(const std::string& dir, int64_t step);
std::string checkpoint_file(const std::string& dir, int64_t step, int64_t rank);

// Writes this rank's file atomically; throws InputError("--save", ...) naming the path and the
// system's reason (e.g. "No space left on device") on I/O errors, leaving no partial file.
void write_checkpoint_shard(const std::string& dir, int64_t rank, int64_t step,
                            const nlohmann::json& layout,
                            const std::vector<std::span<const float>>& arrays);
// Rank 0, after every rank wrote its shard: DIR/latest := step (atomically).
void write_latest(const std::string& dir, int64_t step);
// Rank 0, after write_latest(dir, latest): removes the step directories older than `latest`
// except the keep - 1 most recent (with `latest`, `keep` checkpoints remain). Directories of
// steps after `latest` (a save that did not complete) are left alone. Returns the steps removed.
std::vector<int64_t> prune_checkpoints(const std::string& dir, int64_t latest, int64_t keep);
// The step DIR/latest names; InputError("--load", ...) if there is none.
int64_t read_latest(const std::string& dir);
// Reads and verifies (checksum, layout equal to `expected`) rank's file of `step`;
// InputError("--load", ...) naming the problem (missing, corrupt, another layout).
CheckpointShard read_checkpoint_shard(const std::string& dir, int64_t rank, int64_t step,
                                      const nlohmann::json& expected);

}  // namespace ptdp
