#!/usr/bin/env bash
# The whole loop on CPU ranks: measure this machine (ptdp calibrate), predict a small GPT with
# what was measured, train it for real on 2 MPI ranks (pipeline-parallel, p=2) with a trace,
# and reconcile the prediction with the measurement per op family, stage, bubble and memory.
# Until `ptdp calibrate` is in this build, the prediction uses examples/cpu-cluster.json and
# examples/cpu-profile.json, an UNCALIBRATED hand-written estimate (the script says so).
source "$(dirname "$0")/common.sh"
model=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 256)
plan=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --micro-batch-size 2
  --global-batch-size 8)
if "$PTDP" calibrate --help >/dev/null 2>&1; then
  "$PTDP" calibrate --backend cpu --quick --out "$OUT/machine.json"
  cluster=(--cluster "$OUT/machine.json")
  echo "== calibrated: $OUT/machine.json"
else
  cluster=(--cluster "$EXAMPLES/cpu-cluster.json" --profile "$EXAMPLES/cpu-profile.json")
  echo "== ptdp calibrate is not in this build: using the UNCALIBRATED estimate" \
    "examples/cpu-cluster.json + examples/cpu-profile.json"
fi
echo "== predict"
"$PTDP" predict "${model[@]}" "${plan[@]}" "${cluster[@]}" --num-gpus 2
echo "== run (2 CPU ranks, 4 steps; the first is the warm-up)"
mpirun_np 2 "$PTDP" run "${model[@]}" "${plan[@]}" --steps 4 --backend cpu \
  --trace "$OUT/run.trace.json" --json >"$OUT/run.json"
echo "== reconcile"
"$PTDP" reconcile --trace "$OUT/run.trace.json" "${cluster[@]}"
"$PTDP" reconcile --trace "$OUT/run.trace.json" "${cluster[@]}" --json >"$OUT/reconcile.json"
echo "files: $OUT/run.trace.json (open in ui.perfetto.dev), $OUT/reconcile.json"
