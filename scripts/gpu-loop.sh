#!/usr/bin/env bash
# Calibrate -> predict -> run -> reconcile on one GPU (issue: calibrate and reconcile, its GPU
# half; docs/calibration.md): measures this GPU with `ptdp calibrate --backend cuda`, then for
# three single-GPU plans of different shapes predicts the step time and peak memory with that
# machine file, trains each for real with `ptdp run --backend cuda --trace`, reconciles, and
# prints one table of predicted against measured. Run after scripts/gpu-check.sh (it reuses
# that build; else it builds ptdp).
#
# Usage: scripts/gpu-loop.sh [build-dir]   (env: STEPS, default 6; QUICK=0 for a full
# calibration; CALIBRATE_RANKS, default 1; PRECISION, default bf16 (Megatron's mixed precision,
# what the memory model counts: calibrate, predict and run all with --bf16), or fp32)
# Output: <build-dir>/gpu-loop/: machine.json (commit it as examples/machines/<gpu>.json),
# and per plan predict, run, trace and reconcile JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out="$build/gpu-loop"
ptdp="$build/cli/ptdp"
if [ ! -x "$ptdp" ]; then
  deps=()
  if [ -d .deps/debs ] && [ ! -d /usr/include/eigen3 ]; then
    scripts/prepare-deps.sh --unpack
    deps=(-DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr")
  fi
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPTDP_CUDA=ON "${deps[@]}" \
    >/dev/null
  ninja -C "$build" -j"${JOBS:-$(nproc)}" ptdp
fi
mkdir -p "$out"
steps=${STEPS:-6}
quick=--quick
[ "${QUICK:-1}" = 0 ] && quick=
precision=(--bf16)
case "${PRECISION:-bf16}" in
  bf16) ;;
  fp32) precision=() ;;
  *) echo "gpu-loop: PRECISION must be bf16 or fp32" >&2; exit 2 ;;
esac

gpt2=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
  --vocab-size 50304 --use-flash-attn --attention-dropout 0 --hidden-dropout 0 --cross-entropy-loss-fusion)
# Three shapes: GPT-2 124M at b = 4; GPT-2 350M's (24 x 1024) at b = 2 with selective
# recompute; GPT-2 124M at s = 2048, b = 1, full recompute.
plans=(
  "gpt2-124m|${gpt2[*]} --global-batch-size 8 --micro-batch-size 4"
  "gpt2-350m|--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 50304 --use-flash-attn --attention-dropout 0 --hidden-dropout 0 --cross-entropy-loss-fusion --global-batch-size 4 --micro-batch-size 2 --recompute-granularity selective"
  "gpt2-124m-s2048|--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 2048 --vocab-size 50304 --use-flash-attn --attention-dropout 0 --hidden-dropout 0 --cross-entropy-loss-fusion --global-batch-size 4 --micro-batch-size 1 --recompute-granularity full"
)

# BACKEND=cpu TINY=1: the same loop on CPU with small shapes, to check the script anywhere.
backend=${BACKEND:-cuda}
if [ "${TINY:-0}" = 1 ]; then
  gpt2=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 256
    --use-flash-attn --attention-dropout 0 --hidden-dropout 0)
  plans=("tiny-b4|${gpt2[*]} --global-batch-size 8 --micro-batch-size 4"
    "tiny-selective|${gpt2[*]} --global-batch-size 4 --micro-batch-size 2 --recompute-granularity selective"
    "tiny-full|${gpt2[*]} --global-batch-size 4 --micro-batch-size 1 --recompute-granularity full")
fi

start=$(date +%s)
ranks=${CALIBRATE_RANKS:-1}
launch=()
[ "$ranks" -gt 1 ] && launch=(mpirun --oversubscribe -np "$ranks")
echo "gpu-loop: calibrate --backend $backend $quick ${precision[*]}"
"${launch[@]}" "$ptdp" calibrate --backend "$backend" $quick "${precision[@]}" "${gpt2[@]}" \
  --out "$out/machine.json" \
  >"$out/calibrate.log" 2>&1 || {
  tail -20 "$out/calibrate.log" >&2
  exit 1
}
echo "gpu-loop: calibrated in $(($(date +%s) - start)) s"

set +e
for entry in "${plans[@]}"; do
  name=${entry%%|*}
  read -r -a flags <<<"${entry#*|}"
  one=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "${precision[@]}")
  "$ptdp" predict "${flags[@]}" "${one[@]}" --cluster "$out/machine.json" --num-gpus 1 --json \
    >"$out/$name.predict.json" 2>"$out/$name.predict.log"
  "$ptdp" run "${flags[@]}" "${one[@]}" --steps "$steps" --backend "$backend" \
    --cluster "$out/machine.json" --trace "$out/$name.trace.json" --json \
    >"$out/$name.run.json" 2>"$out/$name.run.log"
  "$ptdp" reconcile --trace "$out/$name.trace.json" --cluster "$out/machine.json" --json \
    >"$out/$name.reconcile.json" 2>"$out/$name.reconcile.log"
  "$ptdp" reconcile --trace "$out/$name.trace.json" --cluster "$out/machine.json" \
    >"$out/$name.reconcile.txt" 2>&1
done
set -e

python3 - "$out" "${plans[@]}" <<'PY'
import json, os, sys
out, plans = sys.argv[1], [p.split("|")[0] for p in sys.argv[2:]]
machine_file = json.load(open(os.path.join(out, "machine.json")))
m, fits = machine_file["machine"], machine_file.get("fits", {})
print(f"machine: {m.get('device')}, driver {m.get('cuda_driver')}, runtime {m.get('cuda_runtime')}, "
      f"data plane {m.get('data_plane')}, {m.get('date')}")
cache = fits.get("cache", {})
if "host_op_us_mean" in fits or cache:
    print(f"host issue {fits.get('host_op_us_mean', float('nan')):.2f} us an op (mean); cold factors: "
          f"GEMMs {cache.get('gemm_cold_factor_mean', float('nan')):.3f}, memory-bound "
          + ", ".join(f"{k} {v:.3f}" for k, v in sorted(cache.get("memory_cold_factor", {}).items())))
print(f"{'plan':18} {'pred step s':>11} {'meas step s':>11} {'err':>7} {'pred GiB':>9} {'meas GiB':>9} {'err':>7}  largest contributor")
fail = 0
for name in plans:
    path = os.path.join(out, name + ".reconcile.json")
    try:
        r = json.load(open(path))
    except Exception:
        print(f"{name:18} NO RESULT (see {name}.run.log and {name}.reconcile.log)")
        fail += 1
        continue
    it, mem = r["iteration"], r["peak_memory"]
    lc = r.get("largest_contributor") or {}
    def pct(x):
        return "n/a" if x is None else f"{100 * x:+.1f}%"
    print(f"{name:18} {it['predicted_s']:11.4f} {it['measured_s']:11.4f} {pct(it['relative_error']):>7} "
          f"{mem['predicted_bytes'] / 2**30:9.3f} {mem['measured_bytes'] / 2**30:9.3f} "
          f"{pct(mem['relative_error']):>7}  stage {lc.get('stage')} {lc.get('name')}")
sys.exit(1 if fail else 0)
PY
