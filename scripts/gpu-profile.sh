#!/usr/bin/env bash
# Nsight Compute over the kernel benchmarks that are below issue 11's 70% of the copy bandwidth
# (docs/gpu.md, "What is left"): for each, a few launches after the warm-up, with the sections
# that say why a memory-bound kernel falls short (speed of light, occupancy, launch shape, warp
# stalls, memory workload), and one summary table. Run after scripts/gpu-check.sh (it reuses that
# build). ncu runs with --clock-control none, as these machines allow (KINDS.md of the device).
# Usage: scripts/gpu-profile.sh [build-dir]   (env: PROFILE_BENCHES, a space-separated list of
# benchmark names; NCU, the ncu to use)
# Output: <build-dir>/gpu-profile/<bench>.csv (ncu --csv --page details) and summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=$build/gpu-profile
bench=$build/bench/cuda_kernels_bench
ncu=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
[ -x "$bench" ] || { echo "gpu-profile: no $bench (run scripts/gpu-check.sh first)" >&2; exit 1; }
[ -x "$ncu" ] || { echo "gpu-profile: no ncu" >&2; exit 1; }
mkdir -p "$out"
benches=${PROFILE_BENCHES:-"BM_AddLayerNormBackward/768 BM_AddLayerNormBackward/4096
  BM_EmbeddingForward BM_EmbeddingBackward BM_MoeUnpermute BM_MoePermute BM_Rope
  BM_BiasGeluBackward BM_GradNorm BM_BiasGeluForward"}
for b in $benches; do
  name=${b//\//_}
  timeout --kill-after=10 120 "$ncu" --clock-control none --launch-skip 8 --launch-count 6 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --csv --page details \
    "$bench" --benchmark_filter="^$b(/manual_time)?\$" --benchmark_min_time=0.01 \
    >"$out/$name.csv" 2>"$out/$name.log"
  echo "gpu-profile: $b exit $?"
done
python3 - "$out" $benches <<'PY' | tee "$out/summary.txt"
import csv, os, sys
out, benches = sys.argv[1], sys.argv[2:]
want = ["Duration", "DRAM Throughput", "Memory Throughput", "Achieved Occupancy",
        "Registers Per Thread", "Block Size", "Grid Size", "Waves Per SM"]
print("%-34s %-40s %s" % ("benchmark", "kernel", "  ".join(want)))
for b in benches:
    path = os.path.join(out, b.replace("/", "_") + ".csv")
    rows = []
    try:
        lines = [l for l in open(path) if l.startswith('"')]  # ncu's own lines are not quoted
        rows = list(csv.DictReader(lines))
    except OSError:
        pass
    if not rows:
        print("%-34s NO PROFILE (see %s)" % (b, path.replace(".csv", ".log")))
        continue
    kernels = {}
    for r in rows:  # the last launch of each kernel name
        k = kernels.setdefault(r.get("Kernel Name", "?"), {})
        k[r.get("Metric Name", "")] = "%s %s" % (r.get("Metric Value", ""), r.get("Metric Unit", ""))
    for name, metrics in kernels.items():
        print("%-34s %-40s %s" % (b, name[:40], "  ".join(metrics.get(m, "-").strip() for m in want)))
PY
