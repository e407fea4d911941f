#!/usr/bin/env bash
# scripts/gpu-session.sh without a GPU and without time: every stage is skipped for want of
# budget, the summary says so, the results folder still gets versions.txt, and a budget that is
# not a number is refused with status 2. (Its stages themselves run on a GPU machine only:
# docs/gpu.md.) Usage: gpu_session_test.sh <source-dir>
set -euo pipefail
src=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
log=$(BUDGET=30 OUT="$tmp/out" "$src/scripts/gpu-session.sh" "$tmp/build")
for stage in bench check loop; do
  grep -Eq "^  $stage +skipped: [0-9-]+ s left" <<<"$log" || {
    echo "no skipped $stage stage in:"
    echo "$log"
    exit 1
  }
done
grep -q "gpu-session: .* of a 30 s budget" <<<"$log"
[ -s "$tmp/out/versions.txt" ] || { echo "no versions.txt"; exit 1; }
rc=0
BUDGET=soon "$src/scripts/gpu-session.sh" "$tmp/build" >"$tmp/bad.log" 2>&1 || rc=$?
[ "$rc" = 2 ] || { echo "BUDGET=soon gave status $rc"; exit 1; }
grep -q "BUDGET" "$tmp/bad.log"
echo "gpu-session: control flow as expected"
