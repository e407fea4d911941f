#!/usr/bin/env bash
# GPT-2 124M's shape on one GPU: measure the GPU (ptdp calibrate --backend cuda --quick --bf16),
# plan the model for that one GPU with what was measured, train the best plan for real with the
# CUDA backend in Megatron's mixed precision (--bf16; --plan gives the parallel configuration,
# the precision is the flag's), and print the measured step next to the plan's prediction.
# NEEDS ptdp built with its CUDA backend and one GPU. Script only: CI does not run it.
source "$(dirname "$0")/common.sh"
# The model as ptdp run executes it (no dropout, the loss fused), so that predict prices what runs.
model=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
  --vocab-size 50304 --use-flash-attn --attention-dropout 0 --hidden-dropout 0
  --cross-entropy-loss-fusion)
echo "== calibrate (this GPU, --quick)"
"$PTDP" calibrate --backend cuda --quick --bf16 "${model[@]}" --out "$OUT/machine.json"
echo "== plan (1 GPU, global batch 8)"
"$PTDP" plan "${model[@]}" --cluster "$OUT/machine.json" --num-gpus 1 --global-batch-size 8 \
  --top 3 --out "$OUT/plans.json"
echo "== run the best plan (10 steps; the first is the warm-up)"
"$PTDP" run --plan "$OUT/plans.json" --bf16 --steps 10 --backend cuda --json >"$OUT/run.json"
python3 - "$OUT/plans.json" "$OUT/run.json" <<'PY'
import json, statistics, sys
plan = json.load(open(sys.argv[1]))["plans"][0]
run = json.load(open(sys.argv[2]))
step = statistics.median(run["step_time_s"][1:])
pred = plan["iteration_time_s"]
print(f"predicted step {pred:.4f} s, measured {step:.4f} s (median of steps 2..), "
      f"error {100 * (step - pred) / pred:+.1f}%")
print(f"predicted peak {plan['memory']['peak_gib']:.2f} GiB, measured "
      f"{run['peak_memory_gib']:.2f} GiB; {run['tokens_per_s']:.0f} tokens/s")
PY
echo "files: $OUT"
