// Writes the seeds of tests/fuzz/corpus that ptdp's own code produces, in each harness's input
// format: checkpoint/ (shards written by write_checkpoint_shard), token_file/ (files written by
// tokenize_file) and plan_json/ (plans written by to_json). Usage: write_seeds CORPUS_DIR.
// tests/fuzz/make_corpus.sh runs it and adds the preset and test JSON files.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/parallel_plan.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "tests/fuzz/fuzz_support.h"

using namespace ptdp;
namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: write_seeds CORPUS_DIR\n");
    return 2;
  }
  const fs::path corpus = argv[1];
  const fs::path tmp =
      fs::temp_directory_path() / ("ptdp_write_seeds_" + std::to_string(::getpid()));
  fs::create_directories(tmp);

  // Checkpoints: the harness's layout, a few arrays; step 3 named by `latest`.
  const nlohmann::json layout = nlohmann::json::parse(fuzz::kCheckpointLayout);
  const std::vector<float> a = {1.5f, -2.0f, 0.25f}, b = {}, c = {3.0f, 4.0f, 5.0f, 6.0f, 7.0f};
  write_checkpoint_shard(tmp.string(), 0, 0, layout, {a, b, c});
  write_checkpoint_shard((tmp / "empty").string(), 0, 0, layout, {});  // rank 0's, as read
  const std::string whole = read_file(checkpoint_file(tmp.string(), 0, 0));
  const std::string body = whole.substr(0, whole.size() - sizeof(uint64_t));
  write_file(corpus / "checkpoint/shard_as_written", std::string(1, '\0') + whole);
  write_file(corpus / "checkpoint/shard_checksum_appended", std::string(1, '\1') + body);
  write_file(corpus / "checkpoint/shard_and_latest", std::string(1, '\x23') + "0\n" + body);
  const std::string empty = read_file(checkpoint_file((tmp / "empty").string(), 0, 0));
  write_file(corpus / "checkpoint/no_arrays",
             std::string(1, '\x01') + empty.substr(0, empty.size() - sizeof(uint64_t)));

  // Token files: vocabulary and sequence length (uint16 each, minus one), then the tokens.
  write_file(tmp / "text.txt", "The quick brown fox jumps over the lazy dog.\n");
  tokenize_file((tmp / "text.txt").string(), (tmp / "tokens.bin").string());
  const std::string tokens = read_file(tmp / "tokens.bin");
  write_file(corpus / "token_file/bytes_vocab256_seq8",
             std::string("\xff\x00\x07\x00", 4) + tokens);
  write_file(corpus / "token_file/vocab65536_seq1", std::string("\xff\xff\x00\x00", 4) + tokens);
  write_file(corpus / "token_file/vocab257_seq44", std::string("\x00\x01\x2b\x00", 4) + tokens);

  // Plans: the default, interleaved with sequence parallelism, an uneven split, cp and ep.
  ParallelPlan p;
  write_file(corpus / "plan_json/default.json", to_json(p).dump(2));
  p.tensor_parallel = 8;
  p.pipeline_parallel = 16;
  p.data_parallel = 8;
  p.micro_batch_size = 1;
  p.global_batch_size = 1536;
  p.virtual_stages = 3;
  p.schedule = Schedule::kInterleaved1F1B;
  p.recompute = Recompute::kSelective;
  p.sequence_parallel = true;
  p.distributed_optimizer = true;
  write_file(corpus / "plan_json/gpt3_interleaved.json", to_json(p).dump(2));
  ParallelPlan u;
  u.pipeline_parallel = 2;
  u.global_batch_size = 4;
  u.layers_per_stage = {1, 1};
  u.recompute = Recompute::kFull;
  write_file(corpus / "plan_json/uneven_toy.json", to_json(u).dump(2));
  // A pipeline layout: chunks of 1, 0, 0 and 1 layers over p = 2, v = 2.
  ParallelPlan l = u;
  l.layers_per_stage.clear();
  l.layers_per_chunk = {1, 0, 0, 1};
  l.virtual_stages = 2;
  l.schedule = Schedule::kInterleaved1F1B;
  write_file(corpus / "plan_json/layout_toy.json", to_json(l).dump(2));
  // Context and expert parallelism (valid for Mixtral 8x7B), with FP8 and p2p overlap.
  ParallelPlan e;
  e.tensor_parallel = 2;
  e.context_parallel = 2;
  e.data_parallel = 4;
  e.expert_parallel = 4;
  e.expert_tensor_parallel = 1;
  e.sequence_parallel = true;
  e.global_batch_size = 64;
  e.fp8 = true;
  e.overlap_p2p_comm = true;
  write_file(corpus / "plan_json/moe_cp_ep.json", to_json(e).dump(2));
  // Megatron-FSDP's optim_grads_params at p = 1.
  ParallelPlan z;
  z.data_parallel = 8;
  z.global_batch_size = 64;
  z.distributed_optimizer = true;
  z.fsdp = FsdpSharding::kOptimGradsParams;
  write_file(corpus / "plan_json/megatron_fsdp.json", to_json(z).dump(2));

  fs::remove_all(tmp);
  return 0;
}
