#!/usr/bin/env bash
# The CUDA kernels on a machine with an NVIDIA GPU (docs/gpu.md): configures ptdp with CUDA on
# (against .deps/ when scripts/prepare-deps.sh carried the packages there), builds the GPU tests
# and the kernel benchmark, runs every GPU test, times each kernel and a GEMM, and prints one
# summary table. Exits non-zero if a test fails or is skipped (a skip there means the GPU was
# not visible) or a benchmark reports an error.
# The GPU tests also run under compute-sanitizer's memcheck and racecheck (shared-memory races),
# without the long-sequence test.
# Usage: scripts/gpu-check.sh [build-dir]   Environment: CUDA_ARCH (default: the GPU's compute
# capability, e.g. 90), JOBS (default: nproc), BENCH_FILTER (a --benchmark_filter regex),
# SANITIZE=0 to skip compute-sanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=$build/gpu-check
jobs=${JOBS:-$(nproc)}

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  arch=${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)}
else
  echo "gpu-check: nvidia-smi not found" >&2
  arch=${CUDA_ARCH:-90}
fi

# Warnings are CI's business (-DPTDP_WERROR=ON there); another host compiler on the GPU machine
# must not stop the check over a new warning.
args=(-DPTDP_CUDA=ON -DPTDP_WERROR=OFF -DCMAKE_CUDA_ARCHITECTURES="$arch")
if [ -d .deps/debs ]; then
  [ -d .deps/root ] || scripts/prepare-deps.sh --unpack
  args+=(-DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr")
fi
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || {
  echo "gpu-check: no nvcc on PATH or in /usr/local/cuda/bin" >&2
  exit 1
}
[ -n "${CUDACXX:-}" ] || command -v nvcc >/dev/null || export CUDACXX=/usr/local/cuda/bin/nvcc

start=$(date +%s)
mkdir -p "$build"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${args[@]}" >"$build/configure.log" 2>&1 || {
  cat "$build/configure.log" >&2
  exit 1
}
ninja -C "$build" -j"$jobs" cpu_twins_test cuda_kernels_test cuda_kernels_bench
echo "gpu-check: built in $(($(date +%s) - start)) s"
mkdir -p "$out"

set +e
"$build/tests/cuda/cpu_twins_test" --gtest_output="json:$out/cpu_twins.json" >"$out/cpu_twins.log" 2>&1
"$build/tests/cuda/cuda_kernels_test" --gtest_output="json:$out/gpu_tests.json" >"$out/gpu_tests.log" 2>&1
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
rm -f "$out"/sanitizer-*.rc
if [ "${SANITIZE:-1}" != 0 ] && [ -x "$sanitizer" ]; then
  for tool in memcheck racecheck; do
    "$sanitizer" --tool "$tool" --error-exitcode 1 "$build/tests/cuda/cuda_kernels_test" \
      --gtest_filter='-*LongSequence*' >"$out/sanitizer-$tool.log" 2>&1
    echo $? >"$out/sanitizer-$tool.rc"
  done
fi
"$build/bench/cuda_kernels_bench" --benchmark_min_time=0.2 \
  --benchmark_filter="${BENCH_FILTER:-.}" --benchmark_out="$out/bench.json" \
  --benchmark_out_format=json >"$out/bench.log" 2>&1
set -e

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
fail = 0
rows = []
for f in ("cpu_twins.json", "gpu_tests.json"):
    path = os.path.join(out, f)
    if not os.path.exists(path):
        rows.append((f, "NO RESULT (crashed? see the .log beside it)", ""))
        fail += 1
        continue
    for suite in json.load(open(path))["testsuites"]:
        for t in suite["testsuite"]:
            status = "FAILED" if t.get("failures") else ("SKIPPED" if t.get("result") == "SKIPPED" else "passed")
            if status != "passed":
                fail += 1
            rows.append((suite["name"] + "." + t["name"], status, t.get("time", "")))
for tool in ("memcheck", "racecheck"):
    rc = os.path.join(out, "sanitizer-%s.rc" % tool)
    if os.path.exists(rc):
        ok = open(rc).read().strip() == "0"
        fail += 0 if ok else 1
        rows.append(("compute-sanitizer --tool %s cuda_kernels_test" % tool,
                     "passed" if ok else "FAILED", "see sanitizer-%s.log" % tool))
print("\n%-72s %-8s %s" % ("test", "result", "time"))
for r in rows:
    print("%-72s %-8s %s" % r)

path = os.path.join(out, "bench.json")
print("\n%-44s %12s %14s %14s" % ("kernel (bench/cuda_kernels_bench.cc)", "time", "bytes/s", "FLOP/s"))
if not os.path.exists(path):
    print("NO BENCHMARK RESULT (see bench.log)")
    fail += 1
else:
    def si(x):
        for unit, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
            if x >= f:
                return "%.1f %s" % (x / f, unit)
        return "%.3g" % x
    for b in json.load(open(path))["benchmarks"]:
        name = b["name"].replace("/manual_time", "")
        if b.get("error_occurred"):
            print("%-44s ERROR: %s" % (name, b.get("error_message", "")))
            fail += 1
            continue
        t = "%.3f %s" % (b["real_time"], b["time_unit"])
        bw = si(b["bytes/s"]) + "B/s" if "bytes/s" in b else ""
        fl = si(b["FLOP/s"]) + "FLOP/s" if "FLOP/s" in b else ""
        print("%-44s %12s %14s %14s" % (name, t, bw, fl))
print("\ngpu-check: %s" % ("all tests passed and every kernel was timed" if fail == 0 else "%d problem(s); logs in %s" % (fail, out)))
sys.exit(1 if fail else 0)
PY
