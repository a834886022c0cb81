# Benchmarks are never pass/fail (STYLE.md §22): built here, run by hand.
# The limits (triad, FMA peak) and the kernels' op list live in the library (launcher/bench_limits.c,
# launcher/bench_kernels.c: `k3 bench kernels` runs the same); scripts/bench-cpu.sh runs the set.
#   build/tests/bench_forward [--model DIR | --preset P]... [--threads N] [--prompt N] [--reps N]
#                             [--chunk C] [--json FILE] [--profile 1]  (each op's share of decode)
k3_add_test_exe(bench_forward ${CMAKE_CURRENT_LIST_DIR}/bench_forward.c)
#   build/tests/bench_kernels [--threads N] [--reps N] [--prefill T] [--size-mb MB] [--json FILE]
k3_add_test_exe(bench_kernels ${CMAKE_CURRENT_LIST_DIR}/bench_kernels.c)
#   mpirun -np W build/tests/bench_engine --model DIR --pp S --ep E [--requests N --prompt P --gen G]
k3_add_test_exe(bench_engine ${CMAKE_CURRENT_LIST_DIR}/bench_engine.c)
