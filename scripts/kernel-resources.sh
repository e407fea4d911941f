#!/usr/bin/env bash
# Registers, spills and static shared memory of every CUDA kernel, from ptxas (-Xptxas -v) on
# the build's own compile commands: no GPU needed. For each kernel it also gives the warps an SM
# can hold by registers alone (64K registers an SM on sm_80 and sm_90, allocated by the warp in
# units of 256), which bounds the bytes a memory-bound kernel keeps in flight (docs/gpu.md).
# Usage: scripts/kernel-resources.sh [build-dir] [kernel-name regex]
#   build-dir: a configured Ninja build with the CUDA kernels on (default: build)
# Prints one line a kernel and architecture: file, kernel, sm, registers, spill bytes (stores /
# loads), static shared bytes, warps an SM by registers.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
filter=${2:-.}
[ -f "$build/build.ninja" ] || { echo "kernel-resources: no Ninja build in $build" >&2; exit 2; }
objects=$(ninja -C "$build" -t targets all | grep -o '^[^:]*\.cu\.o' | sort -u || true)
[ -n "$objects" ] || { echo "kernel-resources: no CUDA objects in $build (CUDA off?)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for obj in $objects; do
  cmd=$(ninja -C "$build" -t commands "$obj" | tail -1)
  # The same compile, its object elsewhere, with ptxas's report.
  (cd "$build" && eval "${cmd/ -o $obj/ -o $tmp/x.o} -Xptxas -v") >"$tmp/log" 2>&1 || {
    echo "kernel-resources: compiling $obj failed:" >&2
    cat "$tmp/log" >&2
    exit 1
  }
  python3 - "$obj" "$filter" "$tmp/log" <<'PY'
import re, subprocess, sys
obj, pattern, log = sys.argv[1], sys.argv[2], sys.argv[3]
src = re.sub(r"^.*?/(cuda/[^/]+)\.o$", r"\1", obj)
kernel = arch = None
spill = "0/0"
for line in open(log):
    m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+\w*)'", line)
    if m:
        name = subprocess.run(["c++filt"], input=m.group(1), capture_output=True,
                              text=True).stdout.strip()
        name = re.sub(r"\(anonymous namespace\)::|ptdp::(kernels::cuda|cuda_fp32)::", "", name)
        kernel, arch, spill = re.sub(r"\(.*", "", name).replace("void ", ""), m.group(2), "0/0"
        continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and kernel:
        spill = "%s/%s" % m.groups()
    m = re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?", line)
    if m and kernel:
        regs = int(m.group(1))
        smem = re.search(r"(\d+) bytes smem", line)
        warps = min(64, 65536 // (((regs + 7) // 8 * 8) * 32)) if regs else 64
        if re.search(pattern, kernel):
            print("%-34s %-64s %-6s regs %3d  spill %-9s smem %6s  warps/SM %2d" % (
                src, kernel[:64], arch, regs, spill, smem.group(1) if smem else "0", warps))
        kernel = None
PY
done
