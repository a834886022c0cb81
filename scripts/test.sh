#!/usr/bin/env bash
# test.sh — the whole test suite on a fresh Debian 12 machine (as root): installs what it needs,
# builds, and runs every tier:
#   1. build-cuda/  (CUDA + NCCL build: the kernels' host-math test and the gpu tier, which skips
#                   without a device; the whole step is skipped without nvcc)
#   2. clang-format check of every C/CUDA source
#   3. build-asan/  (ASan + UBSan)             ctest tier sanitize
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
  echo "== CUDA + NCCL build: the kernels' host-math test and the gpu tier (skips without a device) =="
  cmake -S . -B build-cuda -DK3_CUDA=ON -DK3_NCCL=ON -DK3_WERROR=ON >/dev/null
  if ! cmake --build build-cuda -j"$JOBS" >"$LOGDIR/cuda-build.log" 2>&1; then
    cat "$LOGDIR/cuda-build.log"; exit 1
  fi
  echo "build-cuda: built ($(grep -c 'Built target' "$LOGDIR/cuda-build.log") targets, -Werror)"
  build-cuda/k3 version
  ctest --test-dir build-cuda -R cuda_math --output-on-failure | tee "$LOGDIR/cuda_math.log"
  count "$LOGDIR/cuda_math.log"
  # label gpu: runs on a machine with a usable device; elsewhere each test skips with its reason
  ctest --test-dir build-cuda -L gpu --output-on-failure | tee "$LOGDIR/gpu.log"
  count "$LOGDIR/gpu.log"
else
  echo "== CUDA configuration: skipped (no nvcc) =="
fi

echo "== clang-format check =="
scripts/format.sh --check

echo "== tier: sanitize (ASan + UBSan) =="
cmake -S . -B build-asan -DK3_SANITIZE=ON -DK3_WERROR=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
if ! cmake --build build-asan -j"$JOBS" >"$LOGDIR/asan-build.log" 2>&1; then
  cat "$LOGDIR/asan-build.log"; exit 1
fi
ctest --test-dir build-asan -L sanitize --output-on-failure -j"$JOBS" | tee "$LOGDIR/sanitize.log"
count "$LOGDIR/sanitize.log"

echo "== tier: unit, golden, mpi, fuzz =="
ctest --test-dir build -L 'unit|golden|mpi|fuzz' --output-on-failure -j"$JOBS" | tee "$LOGDIR/main.log"
count "$LOGDIR/main.log"

echo "k3 tests: all tiers passed: $total_run tests ran and passed, $total_skip skipped (the gpu tier without a device)"
rm -rf "$LOGDIR"
