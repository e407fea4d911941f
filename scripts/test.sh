#!/usr/bin/env bash
# Builds ptdp and runs the whole test suite. Usage: scripts/test.sh [build-dir] [cmake args...]
# PTDP_CTEST_ARGS adds ctest arguments (CI's sanitizer pass leaves out tests that only wait).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
scripts/build.sh "$@"
# shellcheck disable=SC2086
ctest --test-dir "$build" -j2 --output-on-failure ${PTDP_CTEST_ARGS:-}
