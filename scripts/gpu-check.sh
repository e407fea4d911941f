#!/usr/bin/env bash
# The CUDA kernels and the CUDA backend on a machine with an NVIDIA GPU (docs/gpu.md):
# configures ptdp with CUDA on (against .deps/ when scripts/prepare-deps.sh carried the packages
# there), builds the GPU tests, the kernel benchmark and ptdp, runs every GPU test, times each
# kernel and a GEMM, trains a GPT-2-124M-shaped model with `ptdp run --backend cuda` beside its
# `ptdp predict`, trains a small MoE model there against the CPU backend's losses, and prints
# one summary table. Exits non-zero if a test fails or is skipped (a skip there means the GPU was
# not visible) or a benchmark reports an error.
# The GPU tests also run under compute-sanitizer's memcheck and racecheck (shared-memory races),
# without the long-sequence test.
# Usage: scripts/gpu-check.sh [build-dir]   Environment: CUDA_ARCH (default: the GPU's compute
# capability, e.g. 90), JOBS (default: nproc), BENCH_FILTER (a --benchmark_filter regex; BENCH=0
# skips the benchmark and summarises the bench.json already there, BENCH_ONLY=1 builds, runs it
# alone and stops),
# SANITIZE=0 to skip compute-sanitizer, STAGE_TIMEOUT (default 300 s) bounds each program run,
# SANITIZE_TOOLS (default "memcheck racecheck"), TORCH=0 to skip the PyTorch baseline (TORCH_DTYPES,
# default "fp32 bf16", picks its precisions), BUILD_ONLY=1 to stop after the build, CURVE_CPU
# (below), MOE=0 to skip the MoE runs, MLA=0 the latent-attention runs, NCCL_DIAGNOSE=0 to skip the NCCL diagnosis when the NCCL tests fail (it takes about
# 2 minutes after a crash, at most about 10 after hangs).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
out=$build/gpu-check
jobs=${JOBS:-$(nproc)}

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  arch=${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)}
  # The cluster preset predict prices the GPT-2 runs on: the GPU's own (GPT2_CLUSTER overrides).
  if [ -z "${GPT2_CLUSTER:-}" ]; then
    case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
      *H200*) GPT2_CLUSTER=dgx-h200 ;;
      *B200*) GPT2_CLUSTER=dgx-b200 ;;
      *A100*) GPT2_CLUSTER=dgx-a100-80gb ;;
      *) GPT2_CLUSTER=dgx-h100 ;;
    esac
  fi
else
  echo "gpu-check: nvidia-smi not found" >&2
  arch=${CUDA_ARCH:-90}
fi
export GPT2_CLUSTER=${GPT2_CLUSTER:-dgx-h100}

# Warnings are CI's business (-DPTDP_WERROR=ON there); another host compiler on the GPU machine
# must not stop the check over a new warning.
args=(-DPTDP_CUDA=ON -DPTDP_WERROR=OFF -DCMAKE_CUDA_ARCHITECTURES="$arch")
if [ -d .deps/debs ]; then
  [ -d .deps/root ] || scripts/prepare-deps.sh --unpack
  args+=(-DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr")
fi
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || {
  echo "gpu-check: no nvcc on PATH or in /usr/local/cuda/bin" >&2
  exit 1
}
[ -n "${CUDACXX:-}" ] || command -v nvcc >/dev/null || export CUDACXX=/usr/local/cuda/bin/nvcc

start=$(date +%s)
mkdir -p "$build"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${args[@]}" >"$build/configure.log" 2>&1 || {
  cat "$build/configure.log" >&2
  exit 1
}
targets=(cpu_twins_test cuda_kernels_test cuda_kernels_bench cuda_backend_test ptdp)
# The NCCL data plane's tests, where CMake found NCCL beside CUDA.
# (Through a file: with pipefail, grep -q closing the pipe early can fail the whole test.)
ninja -C "$build" -t targets all >"$build/targets.txt"
if grep -q '^nccl_communicator_test:' "$build/targets.txt"; then
  targets+=(nccl_communicator_test nccl_smoke)
fi
ninja -C "$build" -j"$jobs" "${targets[@]}"
echo "gpu-check: built in $(($(date +%s) - start)) s"
# BUILD_ONLY=1: stop here (a device session that runs scripts/gpu-loop.sh first reuses the build).
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
mkdir -p "$out"

# Every program below runs under a bound: a hang in one is reported (timeout's status 124) and
# the rest still run.
stage() { timeout --kill-after=10 "${STAGE_TIMEOUT:-300}" "$@"; }
bench() {
  stage "$build/bench/cuda_kernels_bench" --benchmark_min_time=0.2 \
    --benchmark_filter="${BENCH_FILTER:-.}" --benchmark_out="$out/bench.json" \
    --benchmark_out_format=json >"$out/bench.log" 2>&1
}
# BENCH_ONLY=1: the kernel benchmark alone, then stop (scripts/gpu-session.sh runs it first).
if [ "${BENCH_ONLY:-0}" = 1 ]; then
  rc=0
  bench || rc=$?
  tail -n 60 "$out/bench.log"
  exit $rc
fi

# When the NCCL tests fail: each test in a process of its own (a crash ends only its own), then
# NCCL alone (tests/cuda/nccl_smoke.cc, no ptdp code) blocking and not, with and without a
# split, under the settings that turn off the NCCL paths a virtual machine may lack (cuMem,
# NVLink SHARP, peer-to-peer and shared memory); a backtrace of every thread at a crash.
# One line per run in nccl_diagnosis.txt, each run's output beside it. Each run has 60 s (ptdp's
# own waits give up after 60 s; the smoke program after 15), and the backtraces are taken only
# after a crash (under a hang, cuda-gdb's run would never return).
nccl_diagnose() {
  local d="$out/nccl_diagnosis" report="$out/nccl_diagnosis.txt" rc name env crashed=0
  mkdir -p "$d"
  : >"$report"
  for name in $("$build/tests/cuda/nccl_communicator_test" --gtest_list_tests |
    awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}'); do
    NCCL_DEBUG=INFO STAGE_TIMEOUT=70 stage "$build/tests/cuda/nccl_communicator_test" \
      --gtest_filter="$name" >"$d/$name.log" 2>&1
    rc=$?
    case $rc in 134 | 136 | 139) crashed=1 ;; esac
    echo "nccl_communicator_test $name: exit $rc" >>"$report"
  done
  local envs=("" "NCCL_CUMEM_ENABLE=0" "NCCL_NVLS_ENABLE=0" "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
    "NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1")
  local i=0 mode
  for env in "${envs[@]}"; do
    for mode in "blocking" "nonblocking" "blocking split" "nonblocking split"; do
      i=$((i + 1))
      # shellcheck disable=SC2086 # env and mode are word lists on purpose
      env NCCL_DEBUG=INFO $env timeout --kill-after=5 15 "$build/tests/cuda/nccl_smoke" $mode \
        >"$d/smoke-$i.log" 2>&1
      rc=$?
      case $rc in 134 | 136 | 139) crashed=1 ;; esac
      echo "${env:-(defaults)} nccl_smoke $mode: exit $rc ($(grep -h 'nccl_smoke: ' "$d/smoke-$i.log" | tail -1))" >>"$report"
    done
  done
  # PTDP_NCCL_BLOCKING=1: ptdp's communicator with NCCL's blocking calls.
  PTDP_NCCL_BLOCKING=1 NCCL_DEBUG=INFO STAGE_TIMEOUT=70 stage \
    "$build/tests/cuda/nccl_communicator_test" >"$d/ptdp-blocking.log" 2>&1
  echo "PTDP_NCCL_BLOCKING=1 nccl_communicator_test: exit $?" >>"$report"
  if [ "$crashed" = 1 ] && command -v cuda-gdb >/dev/null; then
    timeout --kill-after=5 120 cuda-gdb -batch -ex run -ex "thread apply all bt" \
      --args "$build/tests/cuda/nccl_smoke" nonblocking >"$d/smoke-gdb.log" 2>&1
    timeout --kill-after=5 120 cuda-gdb -batch -ex run -ex "thread apply all bt" \
      --args "$build/tests/cuda/nccl_communicator_test" >"$d/test-gdb.log" 2>&1
    echo "backtraces: nccl_diagnosis/smoke-gdb.log, nccl_diagnosis/test-gdb.log" >>"$report"
  fi
}

set +e
stage "$build/tests/cuda/cpu_twins_test" --gtest_output="json:$out/cpu_twins.json" >"$out/cpu_twins.log" 2>&1
stage "$build/tests/cuda/cuda_kernels_test" --gtest_output="json:$out/gpu_tests.json" >"$out/gpu_tests.log" 2>&1
stage "$build/tests/cuda/cuda_backend_test" --gtest_output="json:$out/backend_tests.json" >"$out/backend_tests.log" 2>&1
if [ -x "$build/tests/cuda/nccl_communicator_test" ]; then
  # NCCL says in its log what it tried (network, transports, version) before any failure.
  NCCL_DEBUG=${NCCL_DEBUG:-INFO} stage "$build/tests/cuda/nccl_communicator_test" --gtest_output="json:$out/nccl_tests.json" \
    >"$out/nccl_tests.log" 2>&1 || [ "${NCCL_DIAGNOSE:-1}" = 0 ] || nccl_diagnose
fi
# GPT-2-124M's shape (docs/gpu.md) on one GPU on the CUDA backend: fp32 with flash attention
# (no s x s scores kept, as PyTorch's scaled_dot_product_attention), the correctness baseline;
# then the mixed-precision run (--bf16: bf16 weights and activations, native bf16 GEMMs, fp32
# master weights; attention unfused, its batched GEMMs on bf16 tensor cores through
# PTDP_CUDA_MATH=bf16), which is what predict prices; and predict for that configuration.
gpt2_model=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
  --vocab-size 50304 --global-batch-size ${GPT2_BATCH:-8} --micro-batch-size ${GPT2_MICRO:-4}
  --cross-entropy-loss-fusion)
gpt2=("${gpt2_model[@]}" --use-flash-attn)
stage "$build/cli/ptdp" run "${gpt2[@]}" --steps ${GPT2_STEPS:-10} --backend cuda --json \
  >"$out/gpt2_run.json" 2>"$out/gpt2_run.log"
PTDP_CUDA_MATH=bf16 stage "$build/cli/ptdp" run "${gpt2_model[@]}" --bf16 --steps ${GPT2_STEPS:-10} \
  --backend cuda --json >"$out/gpt2_run_bf16.json" 2>"$out/gpt2_run_bf16.log"
# The fast path: --bf16 with flash attention, whose bf16 kernel (kernels/cuda/attention.h) runs
# natively behind the typed call, as do the norms and GELU.
stage "$build/cli/ptdp" run "${gpt2[@]}" --bf16 --steps ${GPT2_STEPS:-10} --backend cuda --json \
  >"$out/gpt2_run_bf16_flash.json" 2>"$out/gpt2_run_bf16_flash.log"
for config in unfused flash; do
  if [ $config = flash ]; then args=("${gpt2[@]}"); else args=("${gpt2_model[@]}"); fi
  stage "$build/cli/ptdp" predict "${args[@]}" --bf16 --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 1 --attention-dropout 0 --hidden-dropout 0 \
    --cluster "${GPT2_CLUSTER:-dgx-h100}" --num-gpus 1 --json >"$out/gpt2_predict_$config.json" \
    2>"$out/gpt2_predict_$config.log"
done
# The loss curve: a smaller GPT (vocabulary 50304 kept, so the cross-entropy and the embedding
# see GPT-2's row count) for 50 steps from one seed on the CPU backend, on the CUDA backend in
# fp32 and in --bf16 with flash attention; the summary compares each CUDA curve with the CPU's.
# CURVE_CPU=<file> takes the CPU curve from a run made elsewhere (the same command's --json
# output; the CPU backend is deterministic), sparing the GPU machine's time.
curve=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128
  --vocab-size 50304 --global-batch-size 4 --micro-batch-size 2 --use-flash-attn
  --steps ${CURVE_STEPS:-50} --seed 7 --json)
if [ -n "${CURVE_CPU:-}" ]; then
  cp "$CURVE_CPU" "$out/curve_cpu.json"
else
  stage "$build/cli/ptdp" run "${curve[@]}" --backend cpu >"$out/curve_cpu.json" \
    2>"$out/curve_cpu.log"
fi
stage "$build/cli/ptdp" run "${curve[@]}" --backend cuda >"$out/curve_cuda.json" \
  2>"$out/curve_cuda.log"
stage "$build/cli/ptdp" run "${curve[@]}" --backend cuda --bf16 >"$out/curve_cuda_bf16.json" \
  2>"$out/curve_cuda_bf16.log"
# MoE layers on the GPU (runtime/moe_layer.h: routing on the host from the downloaded logits,
# the row moves and expert GEMMs on the device): a small Mixtral-like model (8 experts, top-2,
# SwiGLU, grouped queries, rotary) on the CPU backend and on the CUDA backend in fp32 and --bf16;
# the summary compares the losses step by step. MOE=0 skips it.
moe=(--num-layers 4 --hidden-size 256 --num-attention-heads 8 --num-query-groups 2 --swiglu
  --ffn-hidden-size 512 --num-experts 8 --moe-router-topk 2 --position-embedding-type rope
  --normalization RMSNorm --untie-embeddings-and-output-weights --seq-length 128
  --vocab-size 32000 --global-batch-size 4 --micro-batch-size 2 --use-flash-attn
  --steps ${MOE_STEPS:-10} --seed 7 --json)
# <prefix> <ptdp run flags...>: the run on the CPU backend and on the CUDA backend in fp32 and
# --bf16, into $out/<prefix>_{cpu,cuda,cuda_bf16}.{json,log} (the summary's against_cpu).
on_three_backends() {
  local prefix=$1 be
  shift
  rm -f "$out/${prefix}"_*
  for be in cpu cuda cuda_bf16; do
    local extra=(--backend "${be%_bf16}")
    [ "$be" = cuda_bf16 ] && extra+=(--bf16)
    stage "$build/cli/ptdp" run "$@" "${extra[@]}" >"$out/${prefix}_$be.json" \
      2>"$out/${prefix}_$be.log"
  done
}
rm -f "$out"/moe_*
[ "${MOE:-1}" != 0 ] && on_three_backends moe "${moe[@]}"
# DeepSeek's multi-head latent attention on the GPU (a query latent, heads of 64 + 32 query/key
# and 64 value channels: the fused attention runs at 96 channels with V padded, widened to fp32
# since the bf16 kernels take 64 and 128) with MoE layers and a multi-token prediction module
# (DeepSeek-V3's: its masked loss finished run by run), against the CPU backend's losses.
# MLA=0 skips it.
mla=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --multi-latent-attention
  --q-lora-rank 128 --kv-lora-rank 64 --qk-head-dim 64 --qk-pos-emb-head-dim 32 --v-head-dim 64
  --swiglu --ffn-hidden-size 512 --num-experts 8 --moe-router-topk 2 --position-embedding-type rope
  --untie-embeddings-and-output-weights --seq-length 128 --vocab-size 32000
  --global-batch-size 4 --micro-batch-size 2 --use-flash-attn --steps ${MLA_STEPS:-10} --seed 7
  --mtp-num-layers 1 --json)
rm -f "$out"/mla_*
[ "${MLA:-1}" != 0 ] && on_three_backends mla "${mla[@]}"
# t = 2, p = 2 on this one GPU: four ranks under mpirun share it, so the data plane is MPI on
# host copies of device buffers (runtime/data_plane.h); the CUDA runs' losses are compared with
# the CPU backend's at the same layout. Needs mpirun and a ptdp built with MPI.
tp2pp2=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128
  --vocab-size 50304 --global-batch-size 8 --micro-batch-size 2 --use-flash-attn
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
  --steps ${TP2PP2_STEPS:-10} --seed 7 --json)
rm -f "$out"/tp2pp2_*
if command -v mpirun >/dev/null && ldd "$build/cli/ptdp" | grep -q libmpi; then
  mpi=(mpirun --oversubscribe -np 4)
  for be in cpu cuda cuda_bf16; do
    extra=(--backend "${be%_bf16}")
    [ "$be" = cuda_bf16 ] && extra+=(--bf16)
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 stage "${mpi[@]}" \
      "$build/cli/ptdp" run "${tp2pp2[@]}" "${extra[@]}" >"$out/tp2pp2_$be.json" \
      2>"$out/tp2pp2_$be.log"
  done
fi
# Context parallelism on this one GPU (two ranks, the MPI data plane on host copies): the
# attention's chunks against the keys before them run the flash kernels with sq < sk
# (runtime/context_parallel.h); losses against the CPU backend's at cp = 2, with the K/V
# gather (cp2_*) and with Ulysses' all-to-alls (cp2a2a_*, --cp-comm-type a2a); at cp = 4 with
# a2a+p2p 2 x 2 (cp4h_*: all-to-all pairs, a ring over them; four ranks). CP2=0 skips them.
cp2=(--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256
  --vocab-size 2048 --global-batch-size 4 --micro-batch-size 2
  --position-embedding-type rope --steps ${CP2_STEPS:-10} --seed 7 --json)
rm -f "$out"/cp2_* "$out"/cp2a2a_* "$out"/cp4h_*
if [ "${CP2:-1}" != 0 ] && command -v mpirun >/dev/null && ldd "$build/cli/ptdp" | grep -q libmpi
then
  for kind in cp2 cp2a2a cp4h; do
    for be in cpu cuda cuda_bf16; do
      extra=(--backend "${be%_bf16}")
      [ "$be" = cuda_bf16 ] && extra+=(--bf16)
      np=2
      case "$kind" in
        cp2) extra+=(--context-parallel-size 2) ;;
        cp2a2a) extra+=(--context-parallel-size 2 --cp-comm-type a2a) ;;
        cp4h) np=4
          extra+=(--context-parallel-size 4 --cp-comm-type a2a+p2p
            --hierarchical-context-parallel-sizes 2 2) ;;
      esac
      OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 stage mpirun --oversubscribe \
        -np "$np" "$build/cli/ptdp" run "${cp2[@]}" "${extra[@]}" >"$out/${kind}_$be.json" \
        2>"$out/${kind}_$be.log"
    done
  done
fi
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
rm -f "$out"/sanitizer-*.rc
if [ "${SANITIZE:-1}" != 0 ] && [ -x "$sanitizer" ]; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    stage "$sanitizer" --tool "$tool" --error-exitcode 1 "$build/tests/cuda/cuda_kernels_test" \
      --gtest_filter='-*LongSequence*' >"$out/sanitizer-$tool.log" 2>&1
    echo $? >"$out/sanitizer-$tool.rc"
  done
fi
[ "${BENCH:-1}" != 0 ] && bench  # BENCH=0: scripts/gpu-session.sh ran it first
# The same model in PyTorch on the same GPU, eager and compiled, in fp32 as the backend runs and
# in bf16 autocast (Megatron's arithmetic, the speed target).
if [ "${TORCH:-1}" != 0 ] && python3 -c "import torch" 2>/dev/null; then
  rm -f "$out/torch_gpt2.jsonl"
  for dtype in ${TORCH_DTYPES:-fp32 bf16}; do
    stage python3 scripts/torch_gpt2_baseline.py --dtype $dtype --batch ${GPT2_BATCH:-8} \
      --micro ${GPT2_MICRO:-4} --steps ${GPT2_STEPS:-10} >>"$out/torch_gpt2.jsonl" \
      2>>"$out/torch_gpt2.log"
  done
fi
set -e

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
fail = 0
rows = []
for f in ("cpu_twins.json", "gpu_tests.json", "backend_tests.json", "nccl_tests.json"):
    path = os.path.join(out, f)
    if f == "nccl_tests.json" and not os.path.exists(path.replace(".json", ".log")):
        rows.append((f, "not built (CMake found no NCCL)", ""))
        continue
    if not os.path.exists(path):
        rows.append((f, "NO RESULT (crashed? see the .log beside it)", ""))
        fail += 1
        continue
    for suite in json.load(open(path))["testsuites"]:
        for t in suite["testsuite"]:
            status = "FAILED" if t.get("failures") else ("SKIPPED" if t.get("result") == "SKIPPED" else "passed")
            if status != "passed":
                fail += 1
            rows.append((suite["name"] + "." + t["name"], status, t.get("time", "")))
for tool in ("memcheck", "racecheck"):
    rc = os.path.join(out, "sanitizer-%s.rc" % tool)
    if os.path.exists(rc):
        ok = open(rc).read().strip() == "0"
        fail += 0 if ok else 1
        rows.append(("compute-sanitizer --tool %s cuda_kernels_test" % tool,
                     "passed" if ok else "FAILED", "see sanitizer-%s.log" % tool))
print("\n%-72s %-8s %s" % ("test", "result", "time"))
for r in rows:
    print("%-72s %-8s %s" % r)
diagnosis = os.path.join(out, "nccl_diagnosis.txt")
if os.path.exists(diagnosis):
    print("\nNCCL diagnosis (exit 139: a segmentation fault; logs in nccl_diagnosis/):")
    print(open(diagnosis).read().rstrip())

path = os.path.join(out, "bench.json")
print("\n%-44s %12s %14s %14s" % ("kernel (bench/cuda_kernels_bench.cc)", "time", "bytes/s", "FLOP/s"))
if not os.path.exists(path):
    print("NO BENCHMARK RESULT (see bench.log)")
    fail += 1
else:
    def si(x):
        for unit, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
            if x >= f:
                return "%.1f %s" % (x / f, unit)
        return "%.3g" % x
    benches = json.load(open(path))["benchmarks"]
    # Issue 11's bar: a memory-bound kernel at 70% of the device-to-device copy of the same run.
    copy = next((b["bytes/s"] for b in benches
                 if b["name"].startswith("BM_DeviceCopy") and "bytes/s" in b), None)
    for b in benches:
        name = b["name"].replace("/manual_time", "")
        if b.get("error_occurred"):
            print("%-44s ERROR: %s" % (name, b.get("error_message", "")))
            fail += 1
            continue
        t = "%.3f %s" % (b["real_time"], b["time_unit"])
        bw = si(b["bytes/s"]) + "B/s" if "bytes/s" in b else ""
        fl = si(b["FLOP/s"]) + "FLOP/s" if "FLOP/s" in b else ""
        share = ""
        if copy and "bytes/s" in b and not name.startswith("BM_DeviceCopy"):
            share = "%5.1f%% of copy%s" % (100 * b["bytes/s"] / copy,
                                          "" if b["bytes/s"] >= 0.7 * copy else " (< 70%)")
        print("%-44s %12s %14s %14s  %s" % (name, t, bw, fl, share))
print()
for name, math in (("gpt2_run", "fp32, flash attention"),
                   ("gpt2_run_bf16", "--bf16 mixed precision, unfused attention"),
                   ("gpt2_run_bf16_flash", "--bf16 mixed precision, flash attention")):
    try:
        run = json.load(open(os.path.join(out, name + ".json")))
        times = run["step_time_s"][1:] or run["step_time_s"]
        step = sorted(times)[len(times) // 2]
        tokens = run["configuration"]["global_batch_size"] * 1024
        print("GPT-2-124M shape, ptdp run --backend cuda (%s): median step %.3f s, %.0f tokens/s, "
              "peak memory %.2f GiB, losses %s" % (math, step, tokens / step,
              run["peak_memory_gib"], ", ".join("%.3f" % l for l in run["losses"])))
    except Exception as e:  # noqa: BLE001 - report whatever went wrong and count it
        print("GPT-2-124M run (%s): NO RESULT (%s; see %s.log)" % (math, e, name))
        fail += 1
for config in ("unfused", "flash"):
    try:
        pred = json.load(open(os.path.join(out, "gpt2_predict_%s.json" % config)))
        print("ptdp predict, the --bf16 %s run's configuration on %s: %.3f s per step, %.0f "
              "tokens/s, memory %s" % (
                  config, os.environ.get("GPT2_CLUSTER", "dgx-h100"), pred["iteration_time_s"],
                  pred["tokens_per_s"], json.dumps(pred["memory"])[:300]))
    except Exception as e:  # noqa: BLE001
        print("ptdp predict (%s): NO RESULT (%s; see gpt2_predict_%s.log)" % (config, e, config))
def against_cpu(prefix, label):
    """The CUDA runs <prefix>_cuda and <prefix>_cuda_bf16 against <prefix>_cpu's losses, step by
    step: fp32 within 1e-3, bf16 within 3e-2 (relative). Returns the number of problems."""
    try:
        cpu = json.load(open(os.path.join(out, prefix + "_cpu.json")))["losses"]
    except Exception as e:  # noqa: BLE001
        print("%s: NO CPU RESULT (%s; see %s_cpu.log)" % (label, e, prefix))
        return 1
    problems = 0
    for name, tol in ((prefix + "_cuda", 1e-3), (prefix + "_cuda_bf16", 3e-2)):
        try:
            run = json.load(open(os.path.join(out, name + ".json")))
            gpu = run["losses"]
            worst = max(abs(g - c) / abs(c) for g, c in zip(gpu, cpu))
        except Exception as e:  # noqa: BLE001 (no file, no losses, or none in common)
            print("%s, %s: NO RESULT (%s; see %s.log)" % (label, name, e, name))
            problems += 1
            continue
        ok = len(gpu) == len(cpu) and worst <= tol
        problems += 0 if ok else 1
        print("%s (data plane %s), %s against the CPU backend: largest relative loss difference "
              "%.2e over %d steps (bound %.0e) %s; first/last loss cpu %.4f/%.4f gpu %.4f/%.4f" % (
                  label, run.get("data_plane"), name, worst, len(gpu), tol,
                  "passed" if ok else "FAILED", cpu[0], cpu[-1], gpu[0], gpu[-1]))
    return problems
fail += against_cpu("curve", "loss curve")
if os.path.exists(os.path.join(out, "moe_cpu.log")):
    fail += against_cpu("moe", "MoE model (8 experts, top-2)")
    try:
        run = json.load(open(os.path.join(out, "moe_cuda_bf16.json")))
        times = run["step_time_s"][1:] or run["step_time_s"]
        print("MoE model, --bf16 on the GPU: median step %.4f s, peak memory %.3f GiB" % (
            sorted(times)[len(times) // 2], run["peak_memory_gib"]))
    except Exception as e:  # noqa: BLE001
        print("MoE model, --bf16 on the GPU: NO RESULT (%s; see moe_cuda_bf16.log)" % e)
if os.path.exists(os.path.join(out, "mla_cpu.log")):
    fail += against_cpu("mla", "MLA + MoE + MTP model (DeepSeek-V3's shape)")
if os.path.exists(os.path.join(out, "tp2pp2_cpu.log")):
    fail += against_cpu("tp2pp2", "t=2 p=2 on one GPU")
else:
    print("t=2 p=2 on one GPU: not run (no mpirun, or ptdp built without MPI)")
if os.path.exists(os.path.join(out, "cp2_cpu.log")):
    fail += against_cpu("cp2", "cp=2 on one GPU")
    fail += against_cpu("cp2a2a", "cp=2 a2a (Ulysses) on one GPU")
    fail += against_cpu("cp4h", "cp=4 a2a+p2p 2x2 on one GPU")
else:
    print("cp=2 on one GPU: not run (CP2=0, no mpirun, or ptdp built without MPI)")
torch_path = os.path.join(out, "torch_gpt2.jsonl")
if os.path.exists(torch_path):
    for line in open(torch_path):
        t = json.loads(line)
        print("PyTorch %s %s (%s): median step %.3f s, %.0f tokens/s, MFU %.3f, peak %.2f GiB" % (
            t["torch"], t["mode"], t["dtype"], t["median_step_s"], t["tokens_per_s"], t["mfu"],
            t["peak_memory_gib"]))
print("\ngpu-check: %s" % ("all tests passed and every kernel was timed" if fail == 0 else "%d problem(s); logs in %s" % (fail, out)))
sys.exit(1 if fail else 0)
PY
