#!/usr/bin/env bash
# Carried build dependencies, for a machine that has nvcc, cmake and ninja but neither the Debian
# packages ptdp builds against nor a network (the GPU machine of docs/gpu.md).
#   scripts/prepare-deps.sh           here (Debian 12, online): apt-get download the packages'
#                                     .debs into .deps/debs (git-ignored; ~15 MB)
#   scripts/prepare-deps.sh --unpack  there: dpkg -x them into .deps/root (no root needed); then
#                                     configure with -DCMAKE_PREFIX_PATH=$PWD/.deps/root/usr
#   scripts/prepare-deps.sh --check   here: download, unpack, and configure ptdp with the
#                                     system's /usr ignored, so .deps alone must satisfy it
# scripts/gpu-check.sh calls --unpack itself when .deps/debs exists.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-download}
deps=$PWD/.deps
# Header-only or static, except Google Benchmark's shared library (libbenchmark1debian), which
# the build tree's RPATH finds. MPI is optional and left out: the GPU check needs no mpirun.
pkgs=(nlohmann-json3-dev libeigen3-dev libboost1.74-dev libcli11-dev libgtest-dev libgmock-dev
      googletest libbenchmark-dev libbenchmark1debian)

download() {
  mkdir -p "$deps/debs"
  if ! (cd "$deps/debs" && apt-get download "${pkgs[@]}" >/dev/null); then
    echo "prepare-deps: apt-get download failed (run apt-get update first?)" >&2
    exit 1
  fi
  echo "prepare-deps: $(ls "$deps/debs" | wc -l) packages in .deps/debs ($(du -sh "$deps/debs" | cut -f1))"
}

# dpkg -x, or where there is no dpkg (or PREPARE_DEPS_NO_DPKG=1) the same by hand: a .deb is an
# ar archive whose data.tar.* member holds the files.
extract() {
  if command -v dpkg >/dev/null && [ -z "${PREPARE_DEPS_NO_DPKG:-}" ]; then
    dpkg -x "$1" "$2"
    return
  fi
  local member
  member=$(ar t "$1" | grep '^data\.tar')
  case "$member" in
    *.xz) ar p "$1" "$member" | tar -xJ -C "$2" ;;
    *.zst) ar p "$1" "$member" | tar --zstd -x -C "$2" ;;
    *.gz) ar p "$1" "$member" | tar -xz -C "$2" ;;
    *) ar p "$1" "$member" | tar -x -C "$2" ;;
  esac
}

unpack() {
  shopt -s nullglob
  local debs=("$deps"/debs/*.deb)
  if [ ${#debs[@]} -eq 0 ]; then
    echo "prepare-deps: no .debs in .deps/debs; run scripts/prepare-deps.sh where apt works" >&2
    exit 1
  fi
  rm -rf "$deps/root.tmp"
  mkdir -p "$deps/root.tmp"
  for f in "${debs[@]}"; do extract "$f" "$deps/root.tmp"; done
  rm -rf "$deps/root"
  mv "$deps/root.tmp" "$deps/root"
  echo "prepare-deps: unpacked into .deps/root; use -DCMAKE_PREFIX_PATH=$deps/root/usr"
}

check() {
  local build=$deps/check-build
  rm -rf "$build"
  # CMAKE_IGNORE_PREFIX_PATH hides the installed packages under /usr from every find_package.
  cmake -S . -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$deps/root/usr" -DCMAKE_IGNORE_PREFIX_PATH=/usr \
    -DPTDP_CUDA=OFF >"$deps/check.log" 2>&1 || {
    cat "$deps/check.log" >&2
    echo "prepare-deps: configure against .deps failed" >&2
    exit 1
  }
  local bad=0
  for v in nlohmann_json_DIR CLI11_DIR Boost_DIR Eigen3_DIR GTest_DIR benchmark_DIR; do
    local dir
    dir=$(grep "^$v:" "$build/CMakeCache.txt" | cut -d= -f2-)
    echo "prepare-deps: $v = $dir"
    case "$dir" in "$deps"/root/*) ;; *) bad=1 ;; esac
  done
  [ $bad -eq 0 ] || { echo "prepare-deps: a package was found outside .deps" >&2; exit 1; }
  echo "prepare-deps: configure with .deps alone succeeded"
}

case "$mode" in
  download) download ;;
  --unpack) unpack ;;
  --check) download; unpack; check ;;
  *) echo "usage: scripts/prepare-deps.sh [--unpack | --check]" >&2; exit 2 ;;
esac
