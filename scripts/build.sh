#!/usr/bin/env bash
# Configures and builds ptdp. Usage: scripts/build.sh [build-dir] [cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}; shift || true
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
ninja -C "$build" -j2
