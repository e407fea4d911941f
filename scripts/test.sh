#!/usr/bin/env bash
# Builds ptdp and runs the whole test suite. Usage: scripts/test.sh [build-dir] [cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
scripts/build.sh "$@"
ctest --test-dir "$build" -j2 --output-on-failure
