#!/usr/bin/env bash
# Measures how long the other ranks of a 4-rank `ptdp run` (t=2, p=2, the tiny model) take to
# exit after rank 2 is stopped with SIGSTOP or SIGKILL, with mpirun's own abort-on-failure off
# and the default stall timeout (set PTDP_STALL_TIMEOUT_S to change it). docs/reliability.md.
# Usage: scripts/lose_a_rank.sh STOP|KILL [build-dir]
set -euo pipefail
sig=${1:?STOP or KILL}
build=${2:-build}
ptdp=$(realpath "$build/cli/ptdp")
work=$(mktemp -d)
export OMPI_MCA_btl_vader_single_copy_mechanism=none
mpirun --allow-run-as-root --oversubscribe --mca orte_abort_on_non_zero_status 0 -np 4 \
  "$ptdp" run --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
  --vocab-size 128 --global-batch-size 8 --micro-batch-size 2 --steps 1000000 \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --save "$work/marker" --save-interval 100000000 >"$work/log" 2>&1 &
job=$!
# The pid of rank $1 of this job (its command line names $work).
rank_pid() {
  for p in $(pgrep -f "$work/marker" || true); do
    if tr '\0' '\n' 2>/dev/null <"/proc/$p/environ" | grep -qx "OMPI_COMM_WORLD_RANK=$1" &&
      ! grep -q mpirun "/proc/$p/cmdline" 2>/dev/null; then echo "$p"; fi
  done
}
until [ "$(grep -c '^step' "$work/log" 2>/dev/null || echo 0)" -ge 3 ]; do sleep 0.1; done
victim=$(rank_pid 2)
kill "-$sig" "$victim"
t0=$(date +%s.%N)
while [ -n "$(rank_pid 0)$(rank_pid 1)$(rank_pid 3)" ]; do
  sleep 0.1
  if [ "$(echo "$(date +%s.%N) - $t0 > 120" | bc)" = 1 ]; then echo "still running after 120 s"; break; fi
done
echo "SIG$sig of rank 2: the other ranks exited after $(echo "$(date +%s.%N) - $t0" | bc) s"
grep 'ptdp: watchdog' "$work/log" || true
kill -9 "$victim" 2>/dev/null || true
wait "$job" || true
rm -rf "$work"
