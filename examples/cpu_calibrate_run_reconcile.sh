#!/usr/bin/env bash
# The whole loop on CPU ranks: measure this machine on 2 MPI ranks (ptdp calibrate: the model's
# kernels, memory bandwidth, and the collectives over both ranks), predict a small GPT with what
# was measured, train it for real on the same 2 ranks (pipeline-parallel, p=2) with a trace, and
# reconcile the prediction with the measurement per op family, stage, bubble and memory.
source "$(dirname "$0")/common.sh"
# The model as ptdp run executes it (no dropout, the loss fused), so that predict prices what runs.
model=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 256
  --attention-dropout 0 --hidden-dropout 0 --cross-entropy-loss-fusion)
plan=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --micro-batch-size 2
  --global-batch-size 8)
echo "== calibrate (2 CPU ranks, --quick)"
mpirun_np 2 "$PTDP" calibrate --backend cpu --quick "${model[@]}" --out "$OUT/machine.json"
cluster=(--cluster "$OUT/machine.json")
echo "== predict"
"$PTDP" predict "${model[@]}" "${plan[@]}" "${cluster[@]}" --num-gpus 2
echo "== run (2 CPU ranks, 4 steps; the first is the warm-up)"
mpirun_np 2 "$PTDP" run "${model[@]}" "${plan[@]}" --steps 4 --backend cpu \
  --trace "$OUT/run.trace.json" --json >"$OUT/run.json"
echo "== reconcile"
"$PTDP" reconcile --trace "$OUT/run.trace.json" "${cluster[@]}"
"$PTDP" reconcile --trace "$OUT/run.trace.json" "${cluster[@]}" --json >"$OUT/reconcile.json"
echo "files: $OUT/run.trace.json (open in ui.perfetto.dev), $OUT/reconcile.json"
