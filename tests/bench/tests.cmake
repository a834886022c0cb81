# Benchmarks are never pass/fail (STYLE.md §22): built here, run by hand.
#   build-forward/tests/bench_forward [--model DIR]... [--threads N] [--json FILE]
k3_add_test_exe(bench_forward ${CMAKE_CURRENT_LIST_DIR}/bench_forward.c)
