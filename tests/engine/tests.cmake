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

# rank 0's prefix-cache index alone: chained hits, snapshot points, LRU eviction (issue 31)
k3_add_test_exe(test_prefix_cache ${CMAKE_CURRENT_LIST_DIR}/test_prefix_cache.c)
target_include_directories(test_prefix_cache PRIVATE ${CMAKE_SOURCE_DIR}/rank)
add_test(NAME prefix_cache_index COMMAND test_prefix_cache)
set_tests_properties(prefix_cache_index PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)

# the prefix cache through the engine: the same tokens and logits with it on, off and evicting,
# on 1x1 and 2x2 with --deterministic; a 6-turn conversation hits every turn (issue 31)
k3_add_test_exe(test_prefix_engine ${CMAKE_CURRENT_LIST_DIR}/test_prefix_engine.c)
add_test(NAME engine_prefix_cache
         COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/prefix_engine.py
                 $<TARGET_FILE:test_prefix_engine> ${MPIEXEC_EXECUTABLE})
set_tests_properties(engine_prefix_cache PROPERTIES LABELS "mpi" TIMEOUT 600 ENVIRONMENT "${K3_TEST_ENV_MPI}")

# n > 1 choices fork one prefill: each choice bit-identical to its request alone, one prefill per
# family, cancellations and fallbacks, no block leaked; 1x1 and 2x2, cache on/off (issue 32)
k3_add_test_exe(test_fork_engine ${CMAKE_CURRENT_LIST_DIR}/test_fork_engine.c)
add_test(NAME engine_fork
         COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/fork_engine.py
                 $<TARGET_FILE:test_fork_engine> ${MPIEXEC_EXECUTABLE})
set_tests_properties(engine_fork PROPERTIES LABELS "mpi" TIMEOUT 900 ENVIRONMENT "${K3_TEST_ENV_MPI}")

# n = 4 families forking in one step on a full lane, and the battery's fork storm over shared
# prefixes: every choice completes, no fault, no block leaked (issue 42)
k3_add_test_exe(test_fork_storm ${CMAKE_CURRENT_LIST_DIR}/test_fork_storm.c)
add_test(NAME engine_fork_storm
         COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/fork_storm.py
                 $<TARGET_FILE:test_fork_storm> ${MPIEXEC_EXECUTABLE})
set_tests_properties(engine_fork_storm PROPERTIES LABELS "mpi" TIMEOUT 900 ENVIRONMENT "${K3_TEST_ENV_MPI}")

# a failed allocation at submit, in a step or at a fork fails only its request (issue 42)
k3_add_test_exe(test_alloc_faults ${CMAKE_CURRENT_LIST_DIR}/test_alloc_faults.c)
target_include_directories(test_alloc_faults PRIVATE ${CMAKE_SOURCE_DIR}/rank)
add_test(NAME engine_alloc_faults
         COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/alloc_faults.py $<TARGET_FILE:test_alloc_faults>)
set_tests_properties(engine_alloc_faults PROPERTIES LABELS "unit;sanitize" TIMEOUT 300 ENVIRONMENT "${K3_TEST_ENV_MPI}")

# the step message's one layout: random messages round-trip through encode and decode (issue 42)
k3_add_test_exe(test_step_wire ${CMAKE_CURRENT_LIST_DIR}/test_step_wire.c)
target_include_directories(test_step_wire PRIVATE ${CMAKE_SOURCE_DIR}/rank)
add_test(NAME step_wire COMMAND test_step_wire)
set_tests_properties(step_wire PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)

# blocks as tokens arrive: a small paged cache preempts, and the preempted requests are
# recomputed bit for bit (--deterministic), 1x1 and 2x2 (issue 42)
k3_add_test_exe(test_preempt ${CMAKE_CURRENT_LIST_DIR}/test_preempt.c)
add_test(NAME engine_preempt
         COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/preempt.py
                 $<TARGET_FILE:test_preempt> ${MPIEXEC_EXECUTABLE})
set_tests_properties(engine_preempt PROPERTIES LABELS "mpi" TIMEOUT 900 ENVIRONMENT "${K3_TEST_ENV_MPI}")
