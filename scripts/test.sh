#!/usr/bin/env bash
# Builds ptdp and runs the whole test suite. Usage: scripts/test.sh [build-dir] [cmake args...]
# PTDP_CTEST_ARGS adds ctest arguments (CI's sanitizer pass leaves out tests that only wait);
# PTDP_TEST_JOBS sets how many tests run at once.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
scripts/build.sh "$@"
# One test more than cores: many tests spend part of their time launching ranks under mpirun or
# waiting on a peer (on 2 vCPUs the release suite took 471 s at -j2 and 411 s at -j3).
jobs=${PTDP_TEST_JOBS:-$(($(nproc) + 1))}
# shellcheck disable=SC2086
ctest --test-dir "$build" -j"$jobs" --output-on-failure ${PTDP_CTEST_ARGS:-}
