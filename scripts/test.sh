#!/usr/bin/env bash
# test.sh — the whole test suite on a fresh Debian 12 machine (as root): installs what it needs,
# builds, and runs every tier:
#   1. build/       (warnings as errors)       ctest tiers unit, golden, mpi, fuzz
#   2. build-asan/  (ASan + UBSan)             ctest tier sanitize
#   3. build-cuda/  (CUDA + NCCL build: the kernels' host-math test and the gpu tier, which skips
#                   without a device; the whole step is skipped
#                   without nvcc)
#   4. clang-format check of every C/CUDA source
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

echo "== tier: unit, golden, mpi, fuzz =="
ctest --test-dir build -L 'unit|golden|mpi|fuzz' --output-on-failure -j"$JOBS"

echo "== tier: sanitize (ASan + UBSan) =="
cmake -S . -B build-asan -DK3_SANITIZE=ON -DK3_WERROR=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build-asan -j"$JOBS"
ctest --test-dir build-asan -L sanitize --output-on-failure -j"$JOBS"

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "== CUDA + NCCL build: the kernels' host-math test and the gpu tier (skips without a device) =="
  cmake -S . -B build-cuda -DK3_CUDA=ON -DK3_NCCL=ON -DK3_WERROR=ON >/dev/null
  cmake --build build-cuda -j"$JOBS"
  build-cuda/k3 version
  # label gpu: runs on a machine with a usable device; elsewhere each test skips with its reason
  ctest --test-dir build-cuda -R cuda_math --output-on-failure
  ctest --test-dir build-cuda -L gpu --output-on-failure
else
  echo "== CUDA configuration: skipped (no nvcc) =="
fi

echo "== clang-format check =="
scripts/format.sh --check
echo "k3 tests: all tiers passed"
