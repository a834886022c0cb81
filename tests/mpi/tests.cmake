# tests/mpi — partition (pure), comm under mpirun, the distributed run (splits, bytes, failures).
k3_add_test_exe(test_partition ${CMAKE_CURRENT_LIST_DIR}/test_partition.c)
add_test(NAME partition COMMAND test_partition)
set_tests_properties(partition PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)

# comm under mpirun: (stages, lanes, first_worker) grids incl. a dedicated coordinator
k3_add_test_exe(test_comm ${CMAKE_CURRENT_LIST_DIR}/test_comm.c)
foreach(grid "4;2;2;0" "3;1;3;0" "5;2;2;1" "2;2;1;0")
  list(GET grid 0 np)
  list(GET grid 1 S)
  list(GET grid 2 E)
  list(GET grid 3 F)
  add_test(NAME comm_np${np}_s${S}_e${E}_f${F}
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe ${MPIEXEC_PREFLAGS}
                   $<TARGET_FILE:test_comm> ${S} ${E} ${F} 1234)
  # also in the sanitize tier; Open MPI's own allocations are not ours to leak-check (ENVIRONMENT.md)
  set_tests_properties(comm_np${np}_s${S}_e${E}_f${F} PROPERTIES LABELS "mpi;sanitize" TIMEOUT 60
                       ENVIRONMENT "${K3_TEST_ENV_MPI}")
endforeach()

# issue 46: waits do not sched_yield (test_comm.c, 4.), on a node that Open MPI sees oversubscribed
# whatever its cores (1 slot, 2 ranks): it yields in idle progress calls there. test_comm exports
# its counting sched_yield so that Open MPI's calls reach it.
target_link_options(test_comm PRIVATE -Wl,--export-dynamic-symbol=sched_yield)
add_test(NAME comm_yield
         COMMAND ${MPIEXEC_EXECUTABLE} -H localhost:1 --oversubscribe ${MPIEXEC_NUMPROC_FLAG} 2
                 ${MPIEXEC_PREFLAGS} $<TARGET_FILE:test_comm> 2 1 0 1234)
set_tests_properties(comm_yield PROPERTIES LABELS "mpi" TIMEOUT 60 ENVIRONMENT "${K3_TEST_ENV_MPI}")

# the distributed `k3 run` end to end (python3 + numpy drive mpirun; see dist_run.py)
find_program(K3_PYTHON3 python3)
# splits and fail also run in the sanitize tier (K3_BIN is then the ASan build's k3); there splits
# takes 6 of its 9 grids (mode splits-sanitize: every path once; the main tier runs all 9)
foreach(mode splits bytes fail load)
  set(arg ${mode})
  if(K3_SANITIZE AND mode STREQUAL "splits")
    set(arg splits-sanitize)
  endif()
  add_test(NAME dist_${mode}
           COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/dist_run.py ${arg} ${MPIEXEC_EXECUTABLE})
  set(labels "mpi")
  if(NOT mode STREQUAL "bytes")
    set(labels "mpi;sanitize")
  endif()
  set_tests_properties(dist_${mode} PROPERTIES LABELS "${labels}" TIMEOUT 480
                       ENVIRONMENT "${K3_TEST_ENV_MPI}")
endforeach()
# the splits (bit-identical with --deterministic) once more on the AVX2 kernels forced
add_test(NAME dist_splits_avx2
         COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/dist_run.py splits ${MPIEXEC_EXECUTABLE})
set_tests_properties(dist_splits_avx2 PROPERTIES LABELS "mpi" TIMEOUT 480
                     ENVIRONMENT "${K3_TEST_ENV_MPI};K3_ISA=avx2")

# k3 plan (no MPI): the real K3 over 4 x 8, and a request the grid cannot satisfy
add_test(NAME plan_cli_k3 COMMAND $<TARGET_FILE:k3> plan --preset k3 --pp 4 --ep 8)
set_tests_properties(plan_cli_k3 PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "world 32 = 4 stages x 8 lanes.*71-92")
add_test(NAME plan_cli_bad_world COMMAND $<TARGET_FILE:k3> plan --preset tiny --world 5 --pp 2 --ep 2)
set_tests_properties(plan_cli_bad_world PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "--pp 2 x --ep 2 = 4 ranks, but the world has 5")

k3_add_test_exe(test_run_prompts ${CMAKE_CURRENT_LIST_DIR}/test_run_prompts.c)
add_test(NAME run_prompts COMMAND test_run_prompts)
set_tests_properties(run_prompts PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)

# chaos: SIGKILL and SIGSTOP of one rank in every phase (load, prefill, decode, batch) and role
# (coordinator, first, middle, last stage) on 6 ranks (3 stages x 2 lanes): every process gone
# within --comm-timeout + 5 s, the signalled rank named with its stage and lane as the root cause,
# no other rank blamed. ~2 min on 2 cores; not in the sanitize tier (timing-bound).
add_test(NAME chaos COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/chaos.py ${MPIEXEC_EXECUTABLE})
set_tests_properties(chaos PROPERTIES LABELS "mpi" TIMEOUT 600 ENVIRONMENT "${K3_TEST_ENV_MPI}")
# one read per node of a stage's dense weights: bytes read and node memory (Pss) of 1 x 4 on the
# small preset, shared vs --load-private (tests/mpi/load_share.py)
add_test(NAME load_share COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/load_share.py ${MPIEXEC_EXECUTABLE})
set_tests_properties(load_share PROPERTIES LABELS "mpi" TIMEOUT 600 ENVIRONMENT "${K3_TEST_ENV_MPI}")
# issue 43: the node's /dev/shm object of a stage's dense weights: a /dev/shm too small is found at
# open (private copies, a warning naming it); rank 0 killed during the load leaves nothing behind
add_test(NAME load_shm COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/shm_test.py ${MPIEXEC_EXECUTABLE})
set_tests_properties(load_shm PROPERTIES LABELS "mpi" TIMEOUT 300 ENVIRONMENT "${K3_TEST_ENV_MPI}")
# issue 34 finding 10: the whole job suspended during the load for 2 x --comm-timeout, then
# resumed: no rank blames another for the time it was itself stopped; the run ends with exit 0.
add_test(NAME suspend_resume COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/suspend_resume.py
                                     ${MPIEXEC_EXECUTABLE})
set_tests_properties(suspend_resume PROPERTIES LABELS "mpi" TIMEOUT 120 ENVIRONMENT "${K3_TEST_ENV_MPI}")

# issue 46: an idle 2 x 2 `k3 serve` uses < 2% of a core in all (waits sleep on the node's
# doorbell, comm/comm_bell.c), and still answers a request after 10 s of idleness.
add_test(NAME serve_idle_cpu COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/idle_cpu.py
                                     ${MPIEXEC_EXECUTABLE})
set_tests_properties(serve_idle_cpu PROPERTIES LABELS "mpi" TIMEOUT 60 ENVIRONMENT "${K3_TEST_ENV_MPI}")
