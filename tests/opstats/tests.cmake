# tests/opstats — `--op-stats`: the guard backend's counters (test_guard_stats.c) and the JSON
# file of `k3 run` / `k3 bench throughput` on one process and under mpirun (opstats_test.py).
k3_add_test_exe(test_guard_stats ${CMAKE_CURRENT_LIST_DIR}/test_guard_stats.c)
add_test(NAME guard_stats COMMAND test_guard_stats)
set_tests_properties(guard_stats PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}"
                     TIMEOUT 60)
find_program(K3_OPSTATS_PYTHON3 python3)
add_test(NAME op_stats COMMAND ${K3_OPSTATS_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/opstats_test.py unit)
# the deep preset's two guard runs (1 and 12 sequences, each one prefill and two decode steps)
# are most of its time: mprotect per op and per upload
set_tests_properties(op_stats PROPERTIES LABELS "unit" TIMEOUT 600 ENVIRONMENT "${K3_TEST_ENV_MPI}")
add_test(NAME op_stats_mpi
         COMMAND ${K3_OPSTATS_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/opstats_test.py mpi ${MPIEXEC_EXECUTABLE})
set_tests_properties(op_stats_mpi PROPERTIES LABELS "mpi" TIMEOUT 300 ENVIRONMENT "${K3_TEST_ENV_MPI}")
