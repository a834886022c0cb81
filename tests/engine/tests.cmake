# tests/engine — the engine API under mpirun: batch invariance with random arrivals on 1x1, 2x2,
# 4x1 and a dedicated 2x2 (each request bit-identical alone vs sharing steps; one digest for all
# splits with --deterministic), and requests that fail alone.
k3_add_test_exe(test_arrivals ${CMAKE_CURRENT_LIST_DIR}/test_arrivals.c)
find_program(K3_PYTHON3 python3)
add_test(NAME engine_arrivals
         COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/arrivals.py $<TARGET_FILE:test_arrivals>
                 ${MPIEXEC_EXECUTABLE})
set_tests_properties(engine_arrivals PROPERTIES LABELS "mpi" TIMEOUT 900 ENVIRONMENT "${K3_TEST_ENV_MPI}")

# A fault inside a step comes back through the engine API as a status; the client ends the job.
k3_add_test_exe(test_fault_status ${CMAKE_CURRENT_LIST_DIR}/test_fault_status.c)
add_test(NAME engine_fault_status
         COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/fault_status.py
                 $<TARGET_FILE:test_fault_status> ${MPIEXEC_EXECUTABLE})
set_tests_properties(engine_fault_status PROPERTIES LABELS "mpi" TIMEOUT 300
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
