#!/usr/bin/env bash
# Installs what ptdp needs on Debian 12 (bookworm). Needs root (or sudo).
set -euo pipefail
pkgs=(build-essential cmake ninja-build nlohmann-json3-dev libeigen3-dev libboost-graph-dev
      libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev libopenmpi-dev openmpi-bin clang-format
      clang libclang-rt-14-dev lld)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
