#!/usr/bin/env bash
# The same loop on GPUs. NEEDS ptdp built with its CUDA backend (`ptdp run --backend cuda`) and
# `ptdp calibrate`, and one GPU per rank (GPUS, default 2). Script only: CI does not run it.
source "$(dirname "$0")/common.sh"
gpus=${GPUS:-2}
# The model as ptdp run executes it (no dropout, the loss fused), so that predict prices what runs.
model=(--model gpt-1.7b --num-layers 8
  --attention-dropout 0 --hidden-dropout 0 --cross-entropy-loss-fusion)
plan=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --micro-batch-size 2
  --global-batch-size 16 --bf16)  # Megatron's mixed precision, calibrated as such
# Calibrate on the ranks the run uses, so that the collectives over them are measured.
mpirun_np "$gpus" "$PTDP" calibrate --backend cuda --quick --bf16 "${model[@]}" \
  --out "$OUT/machine.json"
"$PTDP" predict "${model[@]}" "${plan[@]}" --cluster "$OUT/machine.json" --num-gpus "$gpus"
mpirun_np "$gpus" "$PTDP" run "${model[@]}" "${plan[@]}" --steps 6 --backend cuda \
  --trace "$OUT/run.trace.json" --cluster "$OUT/machine.json" --json >"$OUT/run.json"
"$PTDP" reconcile --trace "$OUT/run.trace.json"
