#!/usr/bin/env bash
# A GPU session of this project in one device call (docs/gpu.md, "What is left"): the build and
# the kernel benchmark (first: issue 11's open item is its figures), every GPU test and GPT-2 run
# with the summary table (scripts/gpu-check.sh), Nsight Compute over the kernels the benchmark
# finds under issue 11's 70% of the copy bandwidth (scripts/gpu-profile.sh), and the calibrate ->
# predict -> run -> reconcile loop (scripts/gpu-loop.sh). Each stage is bounded by what is left
# of one wall-clock budget, and every result is copied under $OUT at the end, also when a stage
# fails or the budget runs out. (A lent GPU goes back about 30 s after a call, and starting
# another costs minutes of the session's device time: one call should carry the session.)
# Usage: scripts/gpu-session.sh [build-dir]
# Environment: BUDGET (seconds for all of it, default 540), OUT (where the results go; default
# <build-dir>/session), TORCH (default 1: the PyTorch GPT-2 baseline in bf16; 0 to skip it),
# PROFILE=0 or LOOP=0 to skip those stages; the scripts' own variables pass through (JOBS,
# SANITIZE, STEPS, ...). The last lines printed are one summary of the stages.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build=${1:-build-gpu}
out=${OUT:-$build/session}
budget=${BUDGET:-540}
case "$budget" in '' | *[!0-9]*) echo "gpu-session: BUDGET must be a number of seconds" >&2; exit 2 ;; esac
mkdir -p "$out"
start=$(date +%s)
deadline=$((start + budget))
reserve=20 # seconds kept for copying the results
summary=()

left() { echo $((deadline - $(date +%s) - reserve)); }
# stage NAME MIN_SECONDS COMMAND...: runs COMMAND under what is left of the budget, if at least
# MIN_SECONDS are; its output goes to $out/NAME.log and, last lines, to the terminal.
stage() {
  local name=$1 need=$2 t0 rc have
  shift 2
  have=$(left)
  if [ "$have" -lt "$need" ]; then
    summary+=("$(printf '%-8s skipped: %s s left, %s needed' "$name" "$have" "$need")")
    return 0
  fi
  t0=$(date +%s)
  echo "gpu-session: $name (up to $have s)"
  timeout --kill-after=10 "$have" "$@" >"$out/$name.log" 2>&1
  rc=$?
  tail -n 40 "$out/$name.log"
  local verdict="exit $rc"
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && verdict="stopped at the budget (exit $rc)"
  summary+=("$(printf '%-8s %s in %s s' "$name" "$verdict" $(($(date +%s) - t0)))")
  return 0
}

# shellcheck disable=SC2317  # run by the EXIT trap
collect() {
  for d in gpu-check gpu-profile gpu-loop; do
    [ -d "$build/$d" ] && mkdir -p "$out/$d" && cp -r "$build/$d/." "$out/$d/" 2>/dev/null
  done
  {
    date -u +%Y-%m-%dT%H:%M:%SZ
    git rev-parse HEAD 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
    if command -v nvcc >/dev/null; then nvcc --version; else /usr/local/cuda/bin/nvcc --version; fi |
      tail -n 2
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>/dev/null
  } >"$out/versions.txt" 2>&1
}
trap collect EXIT

# The build and the kernel benchmark first: issue 11's open item is its figures.
stage bench 120 env BENCH_ONLY=1 JOBS="${JOBS:-$(nproc)}" scripts/gpu-check.sh "$build"
stage check 120 env BENCH=0 SANITIZE="${SANITIZE:-0}" TORCH="${TORCH:-1}" \
  TORCH_DTYPES="${TORCH_DTYPES:-bf16}" NCCL_DIAGNOSE="${NCCL_DIAGNOSE:-0}" \
  STAGE_TIMEOUT="${STAGE_TIMEOUT:-90}" scripts/gpu-check.sh "$build"

# The benchmarks under 70% of this run's copy bandwidth, for Nsight Compute (not the table
# gradient's comparison on text-like tokens, which no kernel can bring to the copy's rate).
flagged=$(python3 - "$build/gpu-check/bench.json" <<'PY' 2>/dev/null
import json, sys
benches = json.load(open(sys.argv[1]))["benchmarks"]
copy = next((b["bytes/s"] for b in benches if b["name"].startswith("BM_DeviceCopy") and "bytes/s" in b), None)
if copy:
    print(" ".join(b["name"].replace("/manual_time", "") for b in benches
                   if "bytes/s" in b and not b["name"].startswith("BM_DeviceCopy")
                   and not b["name"].startswith("BM_EmbeddingTableGradText")
                   and b["bytes/s"] < 0.7 * copy))
PY
)
if [ "${PROFILE:-1}" = 0 ]; then
  summary+=("profile  skipped: PROFILE=0")
elif [ -z "$flagged" ]; then
  summary+=("profile  skipped: no benchmark under 70% of the copy (or no bench.json)")
else
  stage profile 90 env PROFILE_BENCHES="$flagged" scripts/gpu-profile.sh "$build"
fi
if [ "${LOOP:-1}" = 0 ]; then
  summary+=("loop     skipped: LOOP=0")
else
  stage loop 150 env STEPS="${STEPS:-6}" scripts/gpu-loop.sh "$build"
fi

echo
echo "gpu-session: $(($(date +%s) - start)) s of a $budget s budget; results in $out"
for line in "${summary[@]}"; do echo "  $line"; done
[ -n "$flagged" ] && echo "  under 70% of the copy: $flagged"
exit 0
