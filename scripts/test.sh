#!/usr/bin/env bash
# test.sh — the whole test suite on a fresh Debian 12 machine (as root): installs what it needs,
# builds, and runs every tier:
#   1. build-cuda/  (nvcc + the toolkit's CUDA/NCCL headers, warnings as errors): compiles the
#                   kernels, the cuda backend, the nccl transport and the kernels' host-math test,
#                   nothing more (the gpu tier needs a device: scripts/device-check.sh); skipped
#                   without nvcc
#   2. clang-format check of every C/CUDA/C++ source
#   3. build-asan/  (ASan + UBSan, and the CUDA emulation: -DK3_CUDA=ON -DK3_CUDA_EMULATE=ON, so
#                   the same .cu sources run on host fibers and NCCL runs over MPI)
#                   ctest tiers sanitize and gpuemu (+ the kernels' host math, cuda_math)
#   4. build/       (warnings as errors)       ctest tiers unit, golden, mpi, fuzz
# Exit status 0 only if everything passed.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=$(nproc)

scripts/setup.sh build -DK3_WERROR=ON
# Python references for the tests (tiktoken, jinja2, numpy), and the independent PyTorch reference
# that experts_torch and reference_goldens_current run (torch, fla, compressed-tensors,
# safetensors; PyPI's torch is the CUDA build: ~2.9 GB download, ~5.7 GB installed, ~2.5 min on
# a fresh machine, see tests/reference/README.md). A failed install is fatal: the tests that need
# them would otherwise skip and prove nothing (under CI=true a skipped reference test fails).
PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check \
  -r tests/requirements.txt -r tests/reference/requirements.txt

# Order: the quick checks first (CUDA build, format), the sanitizer tier, then the main tiers, so
# the last ctest summary in the log is the one that counts the most tests. Each ctest run's result
# is also kept, and one total is printed at the end.
LOGDIR=$(mktemp -d)
total_run=0; total_skip=0
count() { # count LOG: add the tests a ctest log ran and skipped to the totals
  local ran skip
  ran=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\2/p' "$1" | tail -1)
  skip=$(grep -c -F '***Skipped' "$1" || true)
  total_run=$((total_run + ${ran:-0} - skip)); total_skip=$((total_skip + skip))
}

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "== CUDA + NCCL compile check (nvcc, the toolkit's headers, -Werror) =="
  cmake -S . -B build-cuda -DK3_CUDA=ON -DK3_NCCL=ON -DK3_WERROR=ON >/dev/null
  # the kernels (k3cuda), and the two C files that include the toolkit's cuda_runtime_api.h /
  # nccl.h, and the host-math test: what the emulation build compiles against its own headers
  if ! { cmake --build build-cuda -j"$JOBS" --target k3cuda &&
         make -C build-cuda kernels/cuda/backend_cuda.o comm/comm_nccl.o &&
         make -C build-cuda/tests gpu/test_cuda_math.o; } >"$LOGDIR/cuda-build.log" 2>&1; then
    cat "$LOGDIR/cuda-build.log"; exit 1
  fi
  echo "build-cuda: kernels/cuda/*.cu, backend_cuda.c, comm_nccl.c, test_cuda_math.cu compiled (-Werror)"
else
  echo "== CUDA compile check: skipped (no nvcc) =="
fi

echo "== clang-format check =="
scripts/format.sh --check

echo "== tiers: sanitize and gpuemu (ASan + UBSan; the CUDA kernels and NCCL emulated) =="
cmake -S . -B build-asan -DK3_SANITIZE=ON -DK3_WERROR=ON -DCMAKE_BUILD_TYPE=Debug \
  -DK3_CUDA=ON -DK3_CUDA_EMULATE=ON >/dev/null
if ! cmake --build build-asan -j"$JOBS" >"$LOGDIR/asan-build.log" 2>&1; then
  cat "$LOGDIR/asan-build.log"; exit 1
fi
build-asan/k3 version
ctest --test-dir build-asan -L sanitize --output-on-failure -j"$JOBS" | tee "$LOGDIR/sanitize.log"
count "$LOGDIR/sanitize.log"
# gpuemu: every cuda op vs ref, the emulation's own semantics, the nccl transport under mpirun,
# the whole model on cuda + nccl (1x1, 2x2, --deterministic, 93 layers, serve); cuda_math: the
# kernels' per-element math on the host. None of these may skip here.
ctest --test-dir build-asan -L gpuemu --output-on-failure -j"$JOBS" | tee "$LOGDIR/gpuemu.log"
count "$LOGDIR/gpuemu.log"
if grep -q -F '***Skipped' "$LOGDIR/gpuemu.log"; then
  echo "gpuemu: a test skipped in the emulation build"; exit 1
fi
ctest --test-dir build-asan -R '^cuda_math$' --output-on-failure | tee "$LOGDIR/cuda_math.log"
count "$LOGDIR/cuda_math.log"

echo "== tier: unit, golden, mpi, fuzz =="
ctest --test-dir build -L 'unit|golden|mpi|fuzz' --output-on-failure -j"$JOBS" | tee "$LOGDIR/main.log"
count "$LOGDIR/main.log"

echo "k3 tests: all tiers passed: $total_run tests ran and passed, $total_skip skipped"
rm -rf "$LOGDIR"
