#!/usr/bin/env bash
# Regenerates the seed corpus tests/fuzz/corpus/<harness>/ from the project's own valid inputs:
# the preset JSON files, Hugging Face configs as tests/core_test.cc reads them, plans written by
# `ptdp plan --out`, and what tests/fuzz/write_seeds.cc writes with ptdp's code (checkpoint
# shards, token files, plan JSON). Usage: tests/fuzz/make_corpus.sh [build-dir] (default
# build-fuzz, which must hold cli/ptdp and tests/fuzz/write_seeds: `ninja ptdp ptdp_fuzz`).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-fuzz}
corpus=tests/fuzz/corpus
export ASAN_OPTIONS=detect_leaks=0
rm -rf "$corpus"
mkdir -p "$corpus"/{model_json,hf_config,cluster_json,profile_json,plan_json,plan_file,token_file,checkpoint,run_trace,cli_args}

cp core/presets/models/*.json "$corpus/model_json/"
cp core/presets/clusters/*.json "$corpus/cluster_json/"
cp core/presets/profiles/*.json "$corpus/profile_json/"
# A machine file of `mpirun -np 2 ptdp calibrate --quick` (its measurements cut to two of each)
# and its measured profile, so that fuzzing covers the machine-file fields.
cp tests/fuzz/seeds/machine.json "$corpus/cluster_json/"
cp tests/fuzz/seeds/measured_profile.json "$corpus/profile_json/"
cat > "$corpus/hf_config/llama3_8b.json" <<'JSON'
{"_name_or_path": "meta-llama/Meta-Llama-3-8B", "architectures": ["LlamaForCausalLM"],
 "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
 "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
 "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
 "rope_scaling": null, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "vocab_size": 128256}
JSON
cat > "$corpus/hf_config/gpt_neox.json" <<'JSON'
{"model_type": "gpt_neox", "hidden_act": "gelu", "hidden_size": 2048, "num_hidden_layers": 24,
 "num_attention_heads": 16, "vocab_size": 50304, "max_position_embeddings": 2048,
 "tie_word_embeddings": false}
JSON
# MoE configs (DeepSeek and Qwen-MoE fields).
cp examples/models/deepseek-moe-16b.config.json "$corpus/hf_config/deepseek_moe.json"
cp examples/models/qwen1.5-moe-a2.7b.config.json "$corpus/hf_config/qwen_moe.json"
cp "$corpus"/hf_config/*.json "$corpus/model_json/"

"$build/tests/fuzz/write_seeds" "$corpus"

# `ptdp plan --out` files; the harness's first byte is --plan-index (0: none, 1: all, k+1: k).
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$build/cli/ptdp" plan --model gpt-1.7b --num-gpus 16 --global-batch-size 64 --top 3 \
  --out "$tmp/gpt.json" >/dev/null
"$build/cli/ptdp" plan --model llama3-8b --num-gpus 8 --global-batch-size 32 --top 2 \
  --out "$tmp/llama.json" >/dev/null
{ printf '\0'; cat "$tmp/gpt.json"; } > "$corpus/plan_file/gpt_best"
{ printf '\1'; cat "$tmp/gpt.json"; } > "$corpus/plan_file/gpt_all"
{ printf '\3'; cat "$tmp/llama.json"; } > "$corpus/plan_file/llama_second"
{ printf '\0'; cat "$corpus/plan_json/gpt3_interleaved.json"; } > "$corpus/plan_file/one_plan"

# `ptdp run --trace` files: one rank, and two pipeline stages under mpirun.
tiny=(--hidden-size 16 --num-attention-heads 2 --seq-length 8 --vocab-size 32
  --global-batch-size 1 --micro-batch-size 1 --steps 2)
"$build/cli/ptdp" run "${tiny[@]}" --num-layers 1 --cluster dgx-a100-80gb \
  --trace "$corpus/run_trace/one_layer.json" >/dev/null
OMPI_MCA_btl_vader_single_copy_mechanism=none mpirun --allow-run-as-root --oversubscribe -np 2 \
  "$build/cli/ptdp" run "${tiny[@]}" --num-layers 2 --pipeline-model-parallel-size 2 \
  --trace "$corpus/run_trace/two_stages.json" </dev/null >/dev/null

# Command lines, one argument per line (README.md's commands, preset names for files).
i=0
while IFS= read -r line; do
  i=$((i + 1))
  tr ' ' '\n' <<< "$line" > "$corpus/cli_args/command_$i"
done <<'ARGS'
plan --model gpt3-175b --num-gpus 1024 --global-batch-size 1536 --train-tokens 300e9 --top 10 --json
plan --model gpt-1.7b --cluster dgx-h100 --num-gpus 64 --global-batch-size 512 --tensor-model-parallel-size 2 --simulate-top 5
predict --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --vocab-size 51200 --cluster dgx-a100-80gb --num-gpus 1024 --global-batch-size 1536 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --micro-batch-size 1 --num-layers-per-virtual-pipeline-stage 3 --recompute-granularity selective --sequence-parallel --use-distributed-optimizer --json
simulate --model gpt3-175b --num-gpus 1024 --global-batch-size 1536 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --micro-batch-size 1 --pipeline-schedule zb-h1 --full --slow-rank 3:1.5
run --model llama2-7b --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --vocab-size 256 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --micro-batch-size 2 --global-batch-size 4 --steps 3 --seed 1 --data synthetic --dry-run --memory-limit-gib 1
run --plan plans.json --plan-index all --dry-run --json
reconcile --trace run.json --cluster machine.json --profile a100-80gb --json
tokenize input.txt tokens.bin
predict --model llama3-70b --profile h100-sxm --cluster dgx-h100 --num-gpus 64 --global-batch-size 128 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --micro-batch-size 1 --fp16-grad-reduce --no-scatter-gather --no-gradient-accumulation-fusion --overlap-grad-reduce --swiglu --untie-embeddings-and-output-weights --num-query-groups 8 --ffn-hidden-size 28672
predict --model qwen3-235b-a22b --cluster dgx-h100 --num-gpus 256 --global-batch-size 8192 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 --pipeline-model-parallel-layout Ett|(t*3|)*30ttL --expert-model-parallel-size 32 --expert-tensor-parallel-size 1 --micro-batch-size 1 --sequence-parallel --overlap-moe-expert-parallel-comm --json
ARGS
du -sh "$corpus"
