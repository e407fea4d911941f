#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz/ (clang, -DPTDP_FUZZ=ON, in build-fuzz) and runs
# each for the given time, as many at once as there are cores (PTDP_FUZZ_JOBS). Usage:
#   scripts/fuzz.sh [seconds-per-harness] [harness...]      (default 30 s, every harness)
# The growing corpus is kept in build-fuzz/corpus/<harness> (seeded from tests/fuzz/corpus),
# findings in build-fuzz/findings/<harness>/, logs in build-fuzz/fuzz-logs/. Exits non-zero on
# any finding. PTDP_FUZZ_FLAGS adds libFuzzer flags (e.g. "-runs=1000000", which then bounds a
# run together with the time); PTDP_FUZZ_BUILD names another build directory.
# Reproduce a finding: build-fuzz/tests/fuzz/fuzz_<harness> build-fuzz/findings/<harness>/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
shift || true
all=(model_json hf_config cluster_json profile_json plan_json plan_file token_file checkpoint run_trace
  cli_args)
harnesses=("$@")
[ ${#harnesses[@]} -eq 0 ] && harnesses=("${all[@]}")
build=${PTDP_FUZZ_BUILD:-build-fuzz}

# The largest input worth trying per harness: a few times its largest seed.
max_len() {
  case "$1" in
    cli_args) echo 2048 ;;
    plan_file | profile_json) echo 16384 ;;
    run_trace) echo 49152 ;;
    *) echo 8192 ;;
  esac
}

# A build directory already configured with PTDP_FUZZ=ON (such as a clang sanitizer build of
# the whole project with its tests, docs/reliability.md) is used as it is.
if ! grep -qs '^PTDP_FUZZ:BOOL=ON' "$build/CMakeCache.txt"; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
    -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
    -DPTDP_FUZZ=ON -DPTDP_BUILD_TESTS=OFF -DPTDP_BUILD_BENCH=OFF >/dev/null
fi
targets=()
for h in "${harnesses[@]}"; do targets+=("fuzz_$h"); done
ninja -C "$build" -j2 "${targets[@]}"

# No allocation stack traces: they are most of the time of CLI11's many small allocations
# (a finding is reproduced with the default by running its input alone).
export ASAN_OPTIONS=${ASAN_OPTIONS:-malloc_context_size=0}
mkdir -p "$build/fuzz-logs"
# One harness: its status line, the time and, on a finding, the log's tail.
fuzz_one() {
  local h=$1 corpus="$build/corpus/$1" findings="$build/findings/$1" log="$build/fuzz-logs/$1.log"
  mkdir -p "$corpus" "$findings"
  local rc=0
  # shellcheck disable=SC2086
  "$build/tests/fuzz/fuzz_$h" "$corpus" "tests/fuzz/corpus/$h" -max_total_time="$seconds" \
    -max_len="$(max_len "$h")" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$findings/" ${PTDP_FUZZ_FLAGS:-} >"$log" 2>&1 || rc=$?
  {
    echo "== $h: ${seconds} s"
    [ "$rc" -ne 0 ] && tail -n 40 "$log"
    # The last status line (executions, cov: edges, ft: features, corpus), and the time.
    grep -E '^#[0-9]+' "$log" | tail -n 1 || true
    grep -E '^Done [0-9]+ runs' "$log" || true
  }
  return "$rc"
}
# PTDP_FUZZ_JOBS harnesses at a time (default: the number of cores), each a single process.
jobs=${PTDP_FUZZ_JOBS:-$(nproc)}
failed=()
pids=()
names=()
wait_one() {
  if ! wait "${pids[0]}"; then failed+=("${names[0]}"); fi
  pids=("${pids[@]:1}")
  names=("${names[@]:1}")
}
for h in "${harnesses[@]}"; do
  [ ${#pids[@]} -ge "$jobs" ] && wait_one
  fuzz_one "$h" >"$build/fuzz-logs/$h.summary" &
  pids+=($!)
  names+=("$h")
done
while [ ${#pids[@]} -gt 0 ]; do wait_one; done
for h in "${harnesses[@]}"; do cat "$build/fuzz-logs/$h.summary"; done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: findings in ${failed[*]} (inputs under $build/findings/, logs under $build/fuzz-logs/)"
  exit 1
fi
echo "fuzz: no findings in ${harnesses[*]}"
