# Benchmarks are never pass/fail (STYLE.md §22): built here, run by hand.
#   build-forward/tests/bench_forward [--model DIR]... [--threads N] [--json FILE]
k3_add_test_exe(bench_forward ${CMAKE_CURRENT_LIST_DIR}/bench_forward.c ${CMAKE_CURRENT_LIST_DIR}/bench_limits.c)
#   build/tests/bench_kernels [--threads N] [--reps N] [--prefill T] [--json FILE]   (K3_ISA=... for one ISA)
k3_add_test_exe(bench_kernels ${CMAKE_CURRENT_LIST_DIR}/bench_kernels.c ${CMAKE_CURRENT_LIST_DIR}/bench_limits.c)
#   mpirun -np W build/tests/bench_engine --model DIR --pp S --ep E [--requests N --prompt P --gen G]
k3_add_test_exe(bench_engine ${CMAKE_CURRENT_LIST_DIR}/bench_engine.c)
