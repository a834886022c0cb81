# tests/run — `k3 run` generation end to end (owner: run): sampling, EOS / stop strings, text,
# --chat; one process ("unit") and under mpirun ("mpi"). See run_gen.py.
find_program(K3_RUN_PYTHON3 python3)
add_test(NAME run_gen COMMAND ${K3_RUN_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/run_gen.py unit)
set_tests_properties(run_gen PROPERTIES LABELS "unit;sanitize" TIMEOUT 240
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
add_test(NAME run_gen_mpi
         COMMAND ${K3_RUN_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/run_gen.py mpi ${MPIEXEC_EXECUTABLE})
set_tests_properties(run_gen_mpi PROPERTIES LABELS "mpi;sanitize" TIMEOUT 240
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
# `k3 run --verify`: a NaN weight / an E8M0 0xFF scale is named by tensor, row and file, on 1 rank
# and on 2 x 2 (only the owning ranks scan it); the good checkpoint passes and shows the cost
add_test(NAME run_verify
         COMMAND ${K3_RUN_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/verify.py ${MPIEXEC_EXECUTABLE})
set_tests_properties(run_verify PROPERTIES LABELS "mpi" TIMEOUT 300 ENVIRONMENT "${K3_TEST_ENV_MPI}")
# a ~4M-token prompt is refused up front by the memory check, naming the flags that size it
add_test(NAME run_long_prompt COMMAND ${K3_RUN_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/long_prompt.py)
set_tests_properties(run_long_prompt PROPERTIES LABELS "unit" TIMEOUT 120 SKIP_RETURN_CODE 77
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
# a NaN weight met at run time (no --verify): the request fails naming the layer and the sub-block
# whose output first held the NaN, and the rank (stage, lane); 1 rank and 2 x 2
add_test(NAME run_nonfinite
         COMMAND ${K3_RUN_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/nonfinite.py ${MPIEXEC_EXECUTABLE})
set_tests_properties(run_nonfinite PROPERTIES LABELS "mpi;sanitize" TIMEOUT 300
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
