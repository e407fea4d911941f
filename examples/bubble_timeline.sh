#!/usr/bin/env bash
# A pipeline bubble timeline: GPT-3 175B with t=8, p=8 on 64 A100s and 8 microbatches per
# replica, 1F1B against interleaved 1F1B (v=2), simulated and drawn as SVG (open in a browser)
# and as Chrome traces (ui.perfetto.dev).
source "$(dirname "$0")/common.sh"
common=(--model gpt3-175b --cluster dgx-a100-80gb --num-gpus 64 --global-batch-size 8
  --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --micro-batch-size 1)
"$PTDP" simulate "${common[@]}" --svg "$OUT/1f1b.svg" --trace "$OUT/1f1b.trace.json"
"$PTDP" simulate "${common[@]}" --num-layers-per-virtual-pipeline-stage 6 \
  --svg "$OUT/interleaved.svg" --trace "$OUT/interleaved.trace.json"
echo "timelines: $OUT/1f1b.svg $OUT/interleaved.svg"
