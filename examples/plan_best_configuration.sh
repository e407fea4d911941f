#!/usr/bin/env bash
# The best PTD-P configuration for a model on a cluster: GPT-3 175B on 1024 A100s (the SC'21
# setting), the top three plans ranked by predicted throughput, and the best as a plan file
# that `ptdp run --plan` and `ptdp predict` accept.
source "$(dirname "$0")/common.sh"
"$PTDP" plan --model gpt3-175b --cluster dgx-a100-80gb --num-gpus 1024 \
  --global-batch-size 1536 --top 3 --out "$OUT/plans.json"
echo "plan file: $OUT/plans.json"
