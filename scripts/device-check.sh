#!/usr/bin/env bash
# device-check.sh — the one run a device session makes (issue 15): builds the CUDA + NCCL
# configuration with warnings as errors, runs the gpu tier — the same tests the CI runs as gpuemu
# on the emulated device (every cuda op vs ref, the nccl transport under mpirun, gpu_model.py: the
# model on cuda vs cpu, 2x2 on nccl, --deterministic splits, the 93-layer schedule, one serve
# request; the multi-rank nccl checks need one GPU per rank and say so when they skip) — and the
# host-math unit test of the kernels (after, first of all, the tensor-core layout oracle
# cuda_mma, issue 44), times the kernel benchmark (`k3 bench kernels --backend cuda`: each
# kernel beside a device-to-device cudaMemcpy) and on cpu over the same shapes, and prints ONE
# table: each test's verdict, then per kernel the achieved GB/s and TFLOP/s as % of the device's
# HBM and dense bf16 tensor peaks (from its attributes; else the H200's 4.8 TB/s and 989 TFLOP/s)
# and beside cpu. Budget: under 8 minutes on one H200 with 16 cores (each stage has a timeout).
#
# Usage: scripts/device-check.sh            (BUILD=dir to use another build folder; default
#                                            build-cuda, reused when it exists)
# Exit status:
#   0   every stage ran on a device and every test passed (benchmarks are never pass/fail, but a
#       benchmark that fails to run is a failure);
#   1   something failed: the build, a test, a benchmark run (the table says which);
#   77  built, but no CUDA device is visible: the gpu tests skipped (each says why) and the
#       benchmarks were not run — nothing was verified on a device.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-cuda}
JOBS=$(nproc)
T0=$(date +%s)
say() { printf '[device-check %4ds] %s\n' $(($(date +%s) - T0)) "$*"; }
die() {
  say "FAILED: $*"
  exit 1
}

say "configure + build $BUILD (-DK3_CUDA=ON -DK3_NCCL=ON -DK3_WERROR=ON, -j$JOBS)"
mkdir -p "$BUILD"
LOG=$(cd "$BUILD" && pwd)/device-check
timeout 120 cmake -S . -B "$BUILD" -DK3_CUDA=ON -DK3_NCCL=ON -DK3_WERROR=ON >"$BUILD/configure.log" 2>&1 ||
  { tail -30 "$BUILD/configure.log"; die "configure (log: $BUILD/configure.log)"; }
timeout 300 cmake --build "$BUILD" -j"$JOBS" >"$BUILD/build.log" 2>&1 ||
  { grep -E -B2 -A8 'error|Error' "$BUILD/build.log" | tail -60; die "build (log: $BUILD/build.log)"; }
mkdir -p "$LOG"
"$BUILD/k3" version | sed 's/^/    /'
if "$BUILD/k3" version | grep -q '^backends usable here:.* cuda *$'; then
  DEVICE=1
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | sed 's/^/    GPU: /'
else
  DEVICE=0
fi

# First: the layout oracle of the tensor-core primitives (tests/gpu/test_cuda_mma.cu, the same
# test the emulation runs as gpuemu). It proves the emulated mma / ldmatrix fragment maps equal
# the hardware's; if it fails, every tensor-core result of the emulation build is suspect.
say "layout oracle first: ctest -R '^cuda_mma\$' (ldmatrix + mma bit for bit vs C)"
timeout 60 ctest --test-dir "$BUILD" -R '^cuda_mma$' --output-on-failure \
  --output-junit "$LOG/oracle.xml" >"$LOG/oracle.log" 2>&1
ORACLE_RC=$?
grep -E '^FAIL|checks passed|^SKIP' "$LOG/oracle.log" | sed 's/^/    /'
[ "$ORACLE_RC" = 0 ] || say "LAYOUT ORACLE FAILED: the emulated fragment maps differ from this device's"

say "tests: ctest -L gpu, and the kernels' host math (-R cuda_math)"
timeout 360 ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 300 \
  --output-junit "$LOG/gpu.xml" >"$LOG/gpu.log" 2>&1
GPU_RC=$?
timeout 60 ctest --test-dir "$BUILD" -L unit -R cuda_math --output-on-failure \
  --output-junit "$LOG/unit.xml" >"$LOG/unit.log" 2>&1
UNIT_RC=$?
grep -E 'cuda vs cpu|op .*FAILED|^FAIL' "$LOG/gpu.log" | sed 's/^/    /'
[ "$GPU_RC" = 0 ] || tail -40 "$LOG/gpu.log" | sed 's/^/    | /'

BENCH_RC=0
if [ "$DEVICE" = 1 ]; then
  # after the oracle and the tests: each kernel as % of this device's HBM and tensor peaks,
  # beside a device-to-device cudaMemcpy in the same run (issue 44)
  say "benchmarks: k3 bench kernels --backend cuda, then cpu (same shapes)"
  timeout 150 "$BUILD/k3" bench kernels --backend cuda --threads "$JOBS" --repetitions 9 \
    --output-json "$LOG/bench_cuda.json" >"$LOG/bench_cuda.log" 2>&1 || BENCH_RC=1
  timeout 200 "$BUILD/tests/bench_kernels" --backend cpu --threads "$JOBS" --reps 5 \
    --json "$LOG/bench_cpu.json" >"$LOG/bench_cpu.log" 2>&1 || BENCH_RC=1
fi

# Last (least essential, slowest): the op test under compute-sanitizer memcheck (out-of-bounds
# and misaligned device accesses the result checks might not see). A timeout is reported, not
# failed; errors found are a failure.
MEMCHECK=""
if [ "$DEVICE" = 1 ]; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ -x "$SAN" ]; then
    say "compute-sanitizer memcheck of test_cuda_ops (<= 150 s)"
    (cd "$BUILD/tests" && timeout 150 "$SAN" --tool memcheck --error-exitcode 99 ./test_cuda_ops) \
      >"$LOG/memcheck.log" 2>&1
    case $? in
      0) MEMCHECK="passed" ;;
      124) MEMCHECK="TIMEOUT after 150 s (no verdict)" ;;
      *) MEMCHECK="FAILED"; tail -30 "$LOG/memcheck.log" | sed 's/^/    | /' ;;
    esac
  else
    MEMCHECK="not run (no compute-sanitizer)"
  fi
fi
export MEMCHECK

# One table: test verdicts (from CTest's JUnit files) and the kernels vs the H200 and vs cpu.
python3 - "$LOG" "$DEVICE" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET
log, device = sys.argv[1], sys.argv[2] == "1"
HBM_GBS, BF16_TFLOPS = 4800.0, 989.0  # the H200's, unless the bench read the device's own
print()
print(f"{'test':<34} verdict")
for f in ("oracle.xml", "unit.xml", "gpu.xml"):
    p = os.path.join(log, f)
    if not os.path.exists(p):
        print(f"{f:<34} NOT RUN (no JUnit file)")
        continue
    for tc in ET.parse(p).getroot().iter("testcase"):
        st = tc.get("status", "")
        if tc.find("failure") is not None or st == "fail":
            v = "FAILED"
        elif tc.find("skipped") is not None or st in ("notrun", "disabled"):
            out = tc.findtext("system-out") or ""
            why = [l for l in out.splitlines() if l.startswith("SKIP")]
            v = "skipped" + (f" ({why[0]})" if why else "")
        else:
            v = "passed"
        print(f"{tc.get('name', '?'):<34} {v}")
if os.environ.get("MEMCHECK"):
    print(f"{'cuda_ops (compute-sanitizer)':<34} {os.environ['MEMCHECK']}")
def rows(name):
    p = os.path.join(log, name)
    if not os.path.exists(p):
        return {}
    return {o["op"]: o for o in json.load(open(p)).get("results", [])}
cu, cpu = rows("bench_cuda.json"), rows("bench_cpu.json")
try:
    m = json.load(open(os.path.join(log, "bench_cuda.json"))).get("meta", {})
    HBM_GBS = m.get("hbm_gbs") or HBM_GBS
    BF16_TFLOPS = m.get("tensor_tflops") or BF16_TFLOPS
    print(f"device: {m.get('device', '?')}: HBM {HBM_GBS:.0f} GB/s, dense bf16 {BF16_TFLOPS:.0f} TFLOP/s")
except (OSError, ValueError):
    pass
print()
if not device:
    print("kernels: not benchmarked (no CUDA device visible)")
    sys.exit(0)
print(f"{'kernel (cuda)':<34} {'ms':>8} {'GB/s':>8} {'%HBM':>6} {'TFLOP/s':>8} {'%bf16pk':>7} "
      f"{'cpu ms':>9} {'x cpu':>7}")
for op, o in cu.items():
    gbs, tfl = o["bytes"] / o["seconds"] / 1e9, o["flops"] / o["seconds"] / 1e12
    c = cpu.get(op)
    cms = f"{1e3 * c['seconds']:9.3f}" if c else f"{'-':>9}"
    sp = f"{c['seconds'] / o['seconds']:6.1f}x" if c else f"{'-':>7}"
    print(f"{op:<34} {1e3 * o['seconds']:8.3f} {gbs:8.1f} {100 * gbs / HBM_GBS:5.1f}% "
          f"{tfl:8.3f} {100 * tfl / BF16_TFLOPS:6.2f}% {cms} {sp}")
print("note: 'copy d2d' is a device-to-device cudaMemcpy (the bandwidth a kernel can hope for);"
      " BF16 matmuls run on tensor cores (matmul_mma.cu, 3 bf16 planes of x: 3x the mma of the"
      " FLOPs counted), F32 / MXFP4 on CUDA cores; each weight is 2 x the host's L3"
      " (--size-mb), past the 50 MB L2 when that L3 is >= 25 MB.")
EOF

say "done in $(($(date +%s) - T0)) s (logs: $LOG/)"
FAIL=""
[ "$ORACLE_RC" = 0 ] || FAIL="$FAIL layout-oracle(cuda_mma)"
[ "$UNIT_RC" = 0 ] || FAIL="$FAIL cuda_math(unit)"
[ "$GPU_RC" = 0 ] || FAIL="$FAIL gpu-tests"
[ "$BENCH_RC" = 0 ] || FAIL="$FAIL benchmarks(see $LOG/bench_*.log)"
[ "$MEMCHECK" != FAILED ] || FAIL="$FAIL compute-sanitizer(see $LOG/memcheck.log)"
[ -z "$FAIL" ] || die "$FAIL"
if [ "$DEVICE" != 1 ]; then
  say "NO CUDA DEVICE visible here: built and skipped only; nothing was verified on a device (exit 77)"
  exit 77
fi
say "PASSED on the device"
exit 0
