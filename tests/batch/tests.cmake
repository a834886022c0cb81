# tests/batch — `k3 batch` end to end (owner: batch): the input validation and the output lock
# without loading a model ("unit"), and 200 chat requests on 2 stages x 2 lanes under mpirun
# ("mpi"): one valid line per custom_id, error lines for requests that fail alone, a run killed
# halfway and resumed equal to an uninterrupted one; one 44-line file through batch and serve
# with equal bodies ("unit"), and through batch on 2x2 and on one rank ("mpi"). See batch_test.py.
find_program(K3_BATCH_PYTHON3 python3)
add_test(NAME batch_input COMMAND ${K3_BATCH_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/batch_test.py input)
set_tests_properties(batch_input PROPERTIES LABELS "unit;sanitize" TIMEOUT 60
                     ENVIRONMENT "${K3_TEST_ENV_MPI}") # it starts MPI: see K3_TEST_ENV_MPI
add_test(NAME batch_lines COMMAND ${K3_BATCH_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/batch_test.py lines)
set_tests_properties(batch_lines PROPERTIES LABELS "unit" TIMEOUT 120
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
add_test(NAME batch_serve COMMAND ${K3_BATCH_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/batch_test.py serve)
set_tests_properties(batch_serve PROPERTIES LABELS "unit" TIMEOUT 180
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
add_test(NAME batch_mpi
         COMMAND ${K3_BATCH_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/batch_test.py mpi ${MPIEXEC_EXECUTABLE})
# not in the sanitize tier: under ASan it takes ~220 s on 2 cores, the tier's long pole; the same
# engine and chat paths run under ASan in dist_splits, run_gen and chat_request_e2e
set_tests_properties(batch_mpi PROPERTIES LABELS "mpi" TIMEOUT 300
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
# issue 43: a slow grammar compile on rank 0 under --pp 2 keeps the heartbeat going; the job
# completes with that line failing alone (batch_compile_test.py, ~10 s)
add_test(NAME batch_slow_compile
         COMMAND ${K3_BATCH_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/batch_compile_test.py ${MPIEXEC_EXECUTABLE})
set_tests_properties(batch_slow_compile PROPERTIES LABELS "mpi" TIMEOUT 120
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
add_test(NAME batch_serve_mpi
         COMMAND ${K3_BATCH_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/batch_test.py serve_mpi ${MPIEXEC_EXECUTABLE})
set_tests_properties(batch_serve_mpi PROPERTIES LABELS "mpi" TIMEOUT 300
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
