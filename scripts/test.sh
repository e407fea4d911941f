#!/usr/bin/env bash
# Builds ptdp (if needed) and runs the whole test suite. Usage: scripts/test.sh [build-dir] [cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}; shift || true
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
ninja -C "$build" -j2
ctest --test-dir "$build" -j2 --output-on-failure
