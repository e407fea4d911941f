#!/usr/bin/env bash
# The CUDA kernels' emulated tests (every CUDA thread a host fiber, tests/cuda/emulated_cuda.h)
# under AddressSanitizer and UndefinedBehaviorSanitizer: a kernel that reads or writes past its
# buffer stops there (the emulated cudaMalloc poisons the bytes past each allocation), as
# compute-sanitizer's memcheck would stop it on a GPU. Needs nvcc's headers, not a GPU; without
# nvcc it says so and exits 0. Usage: scripts/emulated-asan.sh [build-dir] [target...]
# Targets: cuda_kernels_emulated_test (the default: kernels/cuda) and cuda_backend_emulated_test
# (the CUDA backend of ptdp run, with its runtime: some 5 minutes more to build on 2 cores).
# ORDERS: the thread orders to run (default "forward reverse"; CI runs "forward": out-of-bounds
# accesses rarely depend on it, and the release tests run both).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-emu-asan}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(cuda_kernels_emulated_test)
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "emulated-asan: no nvcc (CUDA's headers), so no emulated kernels to check"
  exit 0
fi
# -O1 -g1: line tables for the reports, and faster to compile than -O2 -g. gcc: the emulation's
# fiber switches are announced to ASan (__sanitizer_start_switch_fiber), which gcc's runtime has.
# No -march=native: with AVX-512, gcc 12's own avx512fintrin.h trips -Wuninitialized under ASan.
cmake -S . -B "$build" -G Ninja -DPTDP_SANITIZE=ON -DPTDP_CUDA=ON -DPTDP_WERROR=ON -DPTDP_NATIVE=OFF \
  -DPTDP_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
ninja -C "$build" -j2 "${targets[@]}"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
for t in "${targets[@]}"; do
  exe=$(find "$build/tests/cuda" -maxdepth 1 -name "$t" -type f)
  # Both thread orders, as ctest runs them (PTDP_EMULATION_ORDER); the backend's on the staged
  # data plane (no NCCL in the emulation).
  for order in ${ORDERS:-forward reverse}; do
    echo "emulated-asan: $t ($order order)"
    PTDP_EMULATION_ORDER=$order PTDP_DATA_PLANE=staged "$exe" --gtest_brief=1
  done
done
