#!/usr/bin/env bash
# Predicts published H100/B200 measurements of long-context (context-parallel) and MoE
# (expert-parallel) training runs, each with the layout its source gives, and prints measured,
# predicted and the error (measured - predicted) / predicted. The figures are in
# docs/validation.md ("Long context and MoE"). Usage: scripts/validate_modern.sh [ptdp binary]
#
# Sources (the layouts as published; where a field is missing the choice made is noted):
#  [L3]  Llama Team, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4 and section 3.3.2:
#        405B, BF16, H100, model TFLOPs/GPU. MBS and the interleaving depth are not given: b = 1,
#        v = 1 with the paper's one-fewer-layer first and last stages (7 + 14 x 8 + 7). The
#        128K row prints DP = 4; 16384 GPUs and 16M tokens per batch need DP = 8 (used). The
#        paper does not say how it counts the attention's FLOPs: every pair is counted here
#        (tflops_all), the convention its 128K row is consistent with (docs/validation.md).
#  [N1]  NVIDIA NeMo docs/source/performance/performance_summary.md (container 24.07), DGX-H100,
#        FP8, tokens/s/GPU.
#  [MB]  NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (container 26.04.01),
#        DGX-H100, FP8, tokens/s/GPU. Its split of 126 layers over p8 x v8 is not given: here
#        v = 1 with first and last stages of 15 layers.
#  [MZ]  yanring/Megatron-MoE-ModelZoo best_practice/mixtral/run_mixtral_8x22B.sh: H100, BF16,
#        dropless, alltoall dispatcher, "around 445 TFLOPS" (approximate, as the script says;
#        Megatron-LM's logged TFLOP/s, so the attention's pairs counted causally).
#  [N2]  NeMo Framework performance page (container 25.02), DGX-B200, FP8, tokens/s/GPU.
#  [MF]  NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (container 25.09),
#        DGX-H100, FP8 (per-tensor current scaling), tokens/s/GPU, with Megatron-FSDP ("FSDP 8":
#        the sharding group is all 8 GPUs; the benchmark harness sets optim_grads_params). Its
#        main-gradient type is not given: fp32 (ptdp's default) is used.
#  [MQ]  NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (container 26.02.01), DGX-H100,
#        FP8 (tensorwise current scaling), tokens/s/GPU, dropless with the token distribution
#        force-balanced among the experts (--moe-expert-load 1), no recomputation. The recipes
#        (Megatron-Bridge scripts/performance, Qwen3 configs) use the alltoall dispatcher and
#        overlap the expert all-to-alls with the other microbatch's compute
#        (--overlap-moe-expert-parallel-comm). The 235B recipe counts the embedding and the loss
#        as pipeline layers (--account-for-embedding-in-pipeline-split and
#        --account-for-loss-in-pipeline-split) at v = 4: chunks of 2, 30 x 3 and 2 layers, as
#        given here (until 2026-11-29's fourth session ptdp could not express them, and the row
#        ran at v = 1 without the overlap).
#  [MD]  NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (container 25.09),
#        DGX-H100, "DeepSeekV3 (dropless)": 1024 GPUs, GBS 8192, MBS 1, s 4096, TP2 PP8 VP4 EP64,
#        1297 tokens/s/GPU (338 model TFLOP/s/GPU). The table states no precision: its footnote's
#        FP8 quantization granularities for H100 and the recipe's FP8 options point to FP8
#        (tensorwise current scaling here). The recipe (Megatron-Bridge v0.1.0rc4
#        scripts/performance, deepseek_v3_llm_pretrain): ETP 1, force-balanced routing
#        (--moe-expert-load 1), selective recompute of mla_up_proj and mlp, one multi-token
#        prediction layer (the deepseek-v3 preset's), DeepEP's dispatcher with the expert
#        all-to-alls overlapped (--overlap-moe-expert-parallel-comm) and the layout
#        "Et|(tt|)*30mL" (32 virtual stages of 1, 2 x 30 and 0 layers, the MTP layer and the loss
#        in the last), as given here (until 2026-11-29's fourth session the row ran at v = 1 with
#        each rank's layers of that layout, 7 + 6 x 8 + 6, without the overlap or the MTP layer).
# Recompute is not stated by the other sources: none is used (Megatron's default).
set -uo pipefail
cd "$(dirname "$0")/.."
P=${1:-build/cli/ptdp}
# metric: tokens (tokens/s per GPU), tflops (model TFLOP/s per GPU with the attention's pairs
# counted causally, as Megatron-LM logs them) or tflops_all (every pair, SC'21's equation 3).
row() {  # name cluster gpus metric(tokens|tflops|tflops_all) measured predict-flags...
  local name=$1 cluster=$2 gpus=$3 metric=$4 measured=$5
  shift 5
  local out
  local profile=()
  # H100_PROFILE=<machine file or profile>: the H100 rows priced with it (e.g. the measured
  # examples/machines/h100-sxm-80gb.json) instead of the estimated h100-sxm profile.
  [ "$cluster" = dgx-h100 ] && [ -n "${H100_PROFILE:-}" ] && profile=(--profile "$H100_PROFILE")
  [ "$cluster" = dgx-h100 ] && [ -n "${H100_GEMM:-}" ] && profile+=(--gemm-from "$H100_GEMM")
  if ! out=$("$P" predict --cluster "$cluster" --num-gpus "$gpus" "$@" "${profile[@]}" --json 2>&1); then
    printf '%-40s %s\n' "$name" "$out"
    return
  fi
  python3 - "$name" "$metric" "$measured" "$gpus" "$out" <<'PY'
import json, sys
name, metric, measured, gpus, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
j = json.loads(out)
pred = {"tokens": j["tokens_per_s"] / gpus, "tflops": j["model_tflops_per_gpu"],
        "tflops_all": j["model_tflops_per_gpu_all_pairs"]}[metric]
print("%-40s %-6s measured %8.1f  predicted %8.1f  error %+6.1f%%  memory %5.1f GiB%s" % (
    name, metric, measured, pred, 100 * (measured - pred) / pred, j["memory"]["peak_gib"],
    "" if j["fits"] else " (does not fit)"))
PY
}
L405="--model llama3-405b --sequence-parallel --use-distributed-optimizer --micro-batch-size 1"
SPLIT7="--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7"
# shellcheck disable=SC2086
{
row "[L3] llama3-405b 8192 H100 s8k t8 p16" dgx-h100 8192 tflops_all 430 $L405 $SPLIT7 \
  --global-batch-size 2048 --seq-length 8192 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
row "[L3] llama3-405b 16384 H100 s8k t8 p16" dgx-h100 16384 tflops_all 400 $L405 $SPLIT7 \
  --global-batch-size 2048 --seq-length 8192 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
row "[L3] llama3-405b 16384 H100 s128k cp16" dgx-h100 16384 tflops_all 380 $L405 $SPLIT7 \
  --global-batch-size 128 --seq-length 131072 --tensor-model-parallel-size 8 \
  --context-parallel-size 16 --pipeline-model-parallel-size 16
row "[N1] llama3-8b 8 H100 fp8 cp2" dgx-h100 8 tokens 12273 --model llama3-8b --fp8-format hybrid \
  --global-batch-size 128 --seq-length 8192 --tensor-model-parallel-size 1 --context-parallel-size 2 \
  --pipeline-model-parallel-size 1 --micro-batch-size 1 --use-distributed-optimizer
row "[MF] llama3-8b 8 H100 fp8 fsdp" dgx-h100 8 tokens 14079 --model llama3-8b --fp8-format hybrid \
  --global-batch-size 128 --seq-length 8192 --tensor-model-parallel-size 1 \
  --pipeline-model-parallel-size 1 --micro-batch-size 1 --use-megatron-fsdp \
  --data-parallel-sharding-strategy optim_grads_params
row "[N1] llama3-70b 64 H100 fp8 t4 cp2 p4 v5" dgx-h100 64 tokens 1524 --model llama3-70b \
  --fp8-format hybrid --global-batch-size 128 --seq-length 8192 --tensor-model-parallel-size 4 \
  --context-parallel-size 2 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 5 \
  --micro-batch-size 1 --sequence-parallel --use-distributed-optimizer
row "[MB] llama3.1-405b 1024 H100 fp8 cp2" dgx-h100 1024 tokens 328 --model llama3-405b \
  --fp8-format hybrid --global-batch-size 1536 --seq-length 8192 --tensor-model-parallel-size 8 \
  --context-parallel-size 2 --pipeline-model-parallel-size 8 --decoder-first-pipeline-num-layers 15 \
  --decoder-last-pipeline-num-layers 15 --micro-batch-size 1 --sequence-parallel --use-distributed-optimizer
row "[MZ] mixtral-8x22b 128 H100 ep8" dgx-h100 128 tflops 445 --model mixtral-8x22b \
  --global-batch-size 256 --seq-length 4096 --tensor-model-parallel-size 2 \
  --pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 7 \
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 --micro-batch-size 1 \
  --sequence-parallel --use-distributed-optimizer
row "[MQ] qwen3-30b-a3b 16 H100 fp8 p2 v12 ep8" dgx-h100 16 tokens 9058 --model qwen3-30b-a3b \
  --fp8-format hybrid --fp8-recipe tensorwise --global-batch-size 1024 --seq-length 4096 \
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
  --num-layers-per-virtual-pipeline-stage 2 --expert-model-parallel-size 8 --micro-batch-size 1 \
  --use-distributed-optimizer --moe-expert-load 1 --overlap-moe-expert-parallel-comm
row "[MQ] qwen3-235b-a22b 256 H100 fp8 t2 p8 ep32" dgx-h100 256 tokens 1611 --model qwen3-235b-a22b \
  --fp8-format hybrid --fp8-recipe tensorwise --global-batch-size 8192 --seq-length 4096 \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 \
  --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split \
  --num-virtual-stages-per-pipeline-rank 4 \
  --expert-model-parallel-size 32 --expert-tensor-parallel-size 1 --micro-batch-size 1 \
  --sequence-parallel --use-distributed-optimizer --moe-expert-load 1 \
  --overlap-moe-expert-parallel-comm
row "[MD] deepseek-v3 1024 H100 fp8 t2 p8 ep64" dgx-h100 1024 tokens 1297 --model deepseek-v3 \
  --fp8-format hybrid --fp8-recipe tensorwise --global-batch-size 8192 --seq-length 4096 \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 \
  --pipeline-model-parallel-layout 'Et|(tt|)*30mL' \
  --expert-model-parallel-size 64 --expert-tensor-parallel-size 1 --micro-batch-size 1 \
  --sequence-parallel --use-distributed-optimizer --moe-expert-load 1 \
  --recompute-granularity selective --recompute-modules mla_up_proj mlp \
  --overlap-moe-expert-parallel-comm
row "[N2] mixtral-8x7b 64 B200 fp8 ep8" dgx-b200 64 tokens 15457 --model mixtral-8x7b \
  --fp8-format hybrid --global-batch-size 256 --seq-length 4096 --tensor-model-parallel-size 1 \
  --pipeline-model-parallel-size 1 --expert-model-parallel-size 8 --micro-batch-size 2 \
  --use-distributed-optimizer
row "[N2] mixtral-8x22b 256 B200 fp8 s64k cp8" dgx-b200 256 tokens 2232 --model mixtral-8x22b \
  --fp8-format hybrid --global-batch-size 64 --seq-length 65536 --tensor-model-parallel-size 2 \
  --context-parallel-size 8 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 14 \
  --expert-model-parallel-size 8 --micro-batch-size 1 --sequence-parallel --use-distributed-optimizer
}
