#!/usr/bin/env bash
# test.sh — the whole test suite on a fresh Debian 12 machine (as root): installs what it needs,
# builds, and runs every tier. CI's command (.ci/run).
#   scripts/test.sh           everything below; measured on an idle 2-core machine: ~8 min of pip
#                             the first time (a 6.3 GB venv) + ~17 min of tests; 10 GB free disk
#   scripts/test.sh --quick   the quick tier (label quick: unit, golden and mpi tests on the tiny
#                             model; tests/CMakeLists.txt lists them): build/ only, the references
#                             without PyTorch (~1 GB); under 5 min once they are installed
# The first seconds check what it needs (Debian's packages, or root to install them; free disk;
# nvcc, optional) and name what is missing before anything long starts.
# The tiers of the full run:
#   1. build-cuda/  (nvcc + the toolkit's CUDA/NCCL headers, warnings as errors): compiles the
#                   kernels, the cuda backend, the nccl transport and the kernels' host-math test,
#                   nothing more (the gpu tier needs a device: scripts/device-check.sh); skipped
#                   without nvcc
#   2. clang-format check of every C/CUDA/C++ source
#   3. build-asan/  (ASan + UBSan, and the CUDA emulation: -DK3_CUDA=ON -DK3_CUDA_EMULATE=ON, so
#                   the same .cu sources run on host fibers and NCCL runs over MPI)
#                   ctest tiers sanitize and gpuemu, in one run (+ the kernels' host math, cuda_math)
#   4. build/       (scripts/setup.sh's one configuration, the demo's: warnings as errors)
#                   ctest tiers unit, golden, mpi, fuzz, cluster (namespace nodes: tests/cluster)
# The Python references live in a virtual environment this script makes, build/venv (Debian's
# python3 refuses `pip install` outside one: PEP 668); the tests run with it first on PATH.
# Every step runs even when an earlier one failed (a failed build skips only its own tiers), so
# one run shows every failure; the last line counts the tests passed and failed, and the exit
# status is 0 only if everything passed.
set -uo pipefail
cd "$(dirname "$0")/.."
JOBS=$(nproc)
QUICK=0
case "${1:-}" in
  --quick) QUICK=1 ;;
  "") ;;
  *) echo "usage: scripts/test.sh [--quick]   (--quick: the quick tier, under 5 min)"; exit 2 ;;
esac

# ---- what it costs, and what it needs: said in the first seconds, before anything long -------
if [ $QUICK = 1 ]; then
  echo "k3 tests --quick: expect under 5 min (measured 4 min 12 s on a loaded 2-core machine: the"
  echo "  build ~2 min, the quick tier ~2 min;"
  echo "  the first run also pip-installs the references without PyTorch, ~1 GB); needs ~2 GB free"
  need_gb=2
else
  echo "k3 tests: expect ~25 min on an idle 2-core machine: ~8 min of pip the first time (PyTorch"
  echo "  and the references, a 6.3 GB virtual environment in build/venv), then ~17 min of tests"
  echo "  (more on a loaded machine); needs ~10 GB free disk. Contributors: scripts/test.sh --quick"
  need_gb=10
fi
problems=()
if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
  problems+=("not a Debian system (no dpkg/apt-get): install by hand what scripts/setup.sh lists")
elif ! missing=$(scripts/setup.sh --check); then
  if [ "$(id -u)" = 0 ]; then
    echo "k3 tests: will install:$missing"
  else
    problems+=("missing packages:$missing — run as root (it installs them) or apt-get install them")
  fi
fi
[ -x build/venv/bin/python3 ] || [ "$(id -u)" = 0 ] || dpkg-query -W python3-venv >/dev/null 2>&1 ||
  problems+=("python3-venv is needed for build/venv")
free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
venv_gb=0
[ -d build/venv ] && venv_gb=$(du -sk build/venv | awk '{print int($1 / 1048576)}')
if [ -n "$free_kb" ] && [ $((free_kb / 1048576 + venv_gb)) -lt $need_gb ]; then
  problems+=("$((free_kb / 1048576)) GB free here, and this run needs ~$need_gb GB")
fi
if [ $QUICK = 1 ]; then
  : # no CUDA compile check in the quick tier
elif command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "k3 tests: nvcc found: the CUDA compile check runs"
else
  echo "k3 tests: no nvcc: the CUDA compile check is skipped (optional; the CUDA emulation tier runs)"
fi
if [ ${#problems[@]} -gt 0 ]; then
  for p in "${problems[@]}"; do echo "k3 tests: cannot run: $p"; done
  exit 1
fi

scripts/setup.sh build || { echo "k3 tests: the build failed; nothing ran"; exit 1; }

# Python references for the tests (tiktoken, jinja2, numpy, openai, ...), and the independent
# PyTorch reference that experts_torch and reference_goldens_current run (torch, fla,
# compressed-tensors, safetensors; PyPI's torch is the CUDA build: ~2.9 GB download; the venv
# measured 6.3 GB and 7 min 50 s on a fresh 2-core machine, see tests/reference/README.md), into
# build/venv (kept between runs: a second run only checks the versions; --quick skips PyTorch). A failed install is fatal: the tests that
# need them would otherwise skip and prove nothing (under CI=true a skipped reference test fails).
VENV=$PWD/build/venv
if [ ! -x "$VENV/bin/python3" ] && ! python3 -m venv "$VENV"; then
  echo "k3 tests: cannot make the virtual environment $VENV (Debian: apt-get install python3-venv)"
  exit 1
fi
REQS=(-r tests/requirements.txt)
[ $QUICK = 1 ] || REQS+=(-r tests/reference/requirements.txt) # PyTorch: not for the quick tier
if ! PIP_ROOT_USER_ACTION=ignore "$VENV/bin/python3" -m pip install -q --disable-pip-version-check \
       "${REQS[@]}"; then
  echo "k3 tests: pip could not install the test references into $VENV"; exit 1
fi
export PATH="$VENV/bin:$PATH"
cmake -S . -B build -DK3_TEST_PYTHON="$VENV/bin/python3" >/dev/null

if [ $QUICK = 1 ]; then
  echo "== the quick tier (label quick) =="
  t0=$SECONDS
  ctest --test-dir build -L quick --output-on-failure -j"$JOBS"; rc=$?
  echo "k3 tests --quick: $([ $rc = 0 ] && echo passed || echo FAILED) in $((SECONDS - t0)) s of tests;" \
       "the full run is scripts/test.sh"
  exit $rc
fi

# Order: the quick checks first (CUDA build, format), the sanitizer tier, then the main tiers.
# Each ctest run's log is kept; the totals are summed from them at the end.
LOGDIR=$(mktemp -d)
n_pass=0; n_fail=0; n_skip=0; failed=()
tally() { # tally LOG STEP: add a ctest log's passed / failed / skipped tests to the totals
  local log=$1 step=$2 total nfail skip
  total=$(sed -n 's/.*tests passed, \([0-9]*\) tests\{0,1\} failed out of \([0-9]*\).*/\2/p' "$log" | tail -1)
  nfail=$(sed -n 's/.*tests passed, \([0-9]*\) tests\{0,1\} failed out of \([0-9]*\).*/\1/p' "$log" | tail -1)
  skip=$(grep -c -F '***Skipped' "$log" || true)
  if [ -z "$total" ]; then # ctest itself did not finish (no summary line)
    failed+=("$step: no ctest summary"); return
  fi
  n_pass=$((n_pass + total - nfail - skip)); n_fail=$((n_fail + nfail)); n_skip=$((n_skip + skip))
  # the names ctest lists under "The following tests FAILED:" (timeouts say so there)
  while read -r line; do failed+=("$step: $line"); done < <(sed -n '/The following tests FAILED:/,$ s/^[[:space:]]*[0-9]* - //p' "$log")
}
step_failed() { failed+=("$1"); echo "k3 tests: FAILED: $1"; }

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "== CUDA + NCCL compile check (nvcc, the toolkit's headers, -Werror) =="
  cmake -S . -B build-cuda -DK3_CUDA=ON -DK3_NCCL=ON -DK3_WERROR=ON >/dev/null
  # the kernels (k3cuda), and the two C files that include the toolkit's cuda_runtime_api.h /
  # nccl.h, and the host-math test: what the emulation build compiles against its own headers
  if { cmake --build build-cuda -j"$JOBS" --target k3cuda &&
       make -C build-cuda kernels/cuda/backend_cuda.o comm/comm_nccl.o &&
       make -C build-cuda/tests gpu/test_cuda_math.o gpu/test_cuda_mma.o; } >"$LOGDIR/cuda-build.log" 2>&1; then
    echo "build-cuda: kernels/cuda/*.cu, backend_cuda.c, comm_nccl.c, test_cuda_math.cu, test_cuda_mma.cu compiled (-Werror)"
  else
    cat "$LOGDIR/cuda-build.log"; step_failed "the CUDA compile check"
  fi
else
  echo "== CUDA compile check: skipped (no nvcc) =="
fi

echo "== clang-format check =="
scripts/format.sh --check || step_failed "the clang-format check"

echo "== tiers: sanitize and gpuemu (ASan + UBSan; the CUDA kernels and NCCL emulated) =="
# -O1 (ASan's own advice for speed; the checks are the same): at -O0 this tier's tests ran ~1.4x as
# long (8 of its longest, back to back: 326 s of test time at -O0, 229 s at -O1)
cmake -S . -B build-asan -DK3_SANITIZE=ON -DK3_WERROR=ON -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_FLAGS_DEBUG="-g -O1" -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" \
  -DK3_CUDA=ON -DK3_CUDA_EMULATE=ON -DK3_TEST_PYTHON="$VENV/bin/python3" >/dev/null
if cmake --build build-asan -j"$JOBS" >"$LOGDIR/asan-build.log" 2>&1; then
  build-asan/k3 version
  # sanitize and gpuemu in one ctest run, so that the long emulated tests overlap the short
  # sanitizer ones (two runs each ended with one core idle). gpuemu: every cuda op vs ref, the
  # emulation's own semantics, the nccl transport under mpirun, the whole model on cuda + nccl
  # (1x1, 2x2, --deterministic, 93 layers, serve); cuda_math: the kernels' per-element math on the
  # host. None of the gpuemu tests may skip here.
  ctest --test-dir build-asan -L 'sanitize|gpuemu' --output-on-failure -j"$JOBS" | tee "$LOGDIR/asan.log"
  tally "$LOGDIR/asan.log" "sanitize+gpuemu"
  while read -r t; do
    if grep -q -E "Test +#[0-9]+: $t [.]* *[*]{3}Skipped" "$LOGDIR/asan.log"; then
      step_failed "gpuemu: $t skipped in the emulation build"
    fi
  done < <(ctest --test-dir build-asan -N -L gpuemu | sed -n 's/^ *Test *#[0-9]*: //p')
  ctest --test-dir build-asan -R '^cuda_math$' --output-on-failure | tee "$LOGDIR/cuda_math.log"
  tally "$LOGDIR/cuda_math.log" cuda_math
else
  tail -n 60 "$LOGDIR/asan-build.log"; step_failed "the build-asan build (its tiers did not run)"
fi

echo "== tier: unit, golden, mpi, fuzz, cluster =="
ctest --test-dir build -L 'unit|golden|mpi|fuzz|cluster' --output-on-failure -j"$JOBS" | tee "$LOGDIR/main.log"
tally "$LOGDIR/main.log" main
rm -rf "$LOGDIR"

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "k3 tests: all tiers passed: $n_pass passed, 0 failed, $n_skip skipped"
  exit 0
fi
echo "k3 tests: FAILED: $n_pass passed, $n_fail failed, $n_skip skipped; what failed:"
for f in "${failed[@]}"; do echo "  $f"; done
exit 1
