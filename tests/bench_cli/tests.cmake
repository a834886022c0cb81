# tests/bench_cli — `k3 bench` end to end on the tiny model (owner: bench): pytest driving `k3 bench`
# (under mpirun for 2x2) and, for `k3 bench serve`, a `k3 serve` it starts; JSON checked against
# the committed schemas with PyPI jsonschema, /metrics with prometheus_client's parser
# (tests/requirements.txt). bench_cli_test.py says what each group checks.
find_program(K3_BENCH_PYTHON3 python3)
set(K3_BENCH_CLI_ENV ${K3_TEST_ENV_MPI} "K3_MPIEXEC=${MPIEXEC_EXECUTABLE}")
function(k3_bench_cli_test name group timeout)
  add_test(NAME ${name}
           COMMAND ${K3_BENCH_PYTHON3} -m pytest -q -x -p no:cacheprovider
                   ${CMAKE_CURRENT_LIST_DIR}/bench_cli_test.py -k ${group})
  set_tests_properties(${name} PROPERTIES LABELS "mpi" TIMEOUT ${timeout}
                       ENVIRONMENT "${K3_BENCH_CLI_ENV}")
endfunction()
k3_bench_cli_test(bench_cli_throughput "throughput" 120)
k3_bench_cli_test(bench_cli_pptg "pptg" 60)
k3_bench_cli_test(bench_cli_kernels "kernels" 120)
k3_bench_cli_test(bench_cli_load "load" 240)
k3_bench_cli_test(bench_cli_serve_2x2 "serve_2x2 or serve_errors" 120)
# issue 48: --plot FILE.svg of throughput (a sweep) and serve (against a 1 x 1 k3 serve), parsed
# with xml.etree and checked against the same run's JSON (plot_test.py)
add_test(NAME bench_cli_plot COMMAND ${K3_BENCH_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/plot_test.py)
set_tests_properties(bench_cli_plot PROPERTIES LABELS "mpi" TIMEOUT 120
                     ENVIRONMENT "${K3_BENCH_CLI_ENV}")
