# tests/plan — `k3 plan` on sites (owner: plan): DISTRIBUTED.md §0's memory arithmetic, the
# site flags, --slurm, --site FILE (plan_spec.py); the tiny model's per-rank memory prediction
# against the RSS growth of `k3 run` under 2 x 2 (plan_rss.py).
find_program(K3_PLAN_PYTHON3 python3)
add_test(NAME plan_spec COMMAND ${K3_PLAN_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/plan_spec.py)
set_tests_properties(plan_spec PROPERTIES LABELS "unit" TIMEOUT 120 ENVIRONMENT "${K3_TEST_ENV}")
add_test(NAME plan_rss
         COMMAND ${K3_PLAN_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/plan_rss.py ${MPIEXEC_EXECUTABLE})
set_tests_properties(plan_rss PROPERTIES LABELS "mpi" TIMEOUT 240 ENVIRONMENT "${K3_TEST_ENV_MPI}")
# hwloc binding at run time (host/bind.c): one line per rank, shares of the node's cores, threads
# = cores bound, --bind none, `k3 plan` shows the cores the run binds
add_test(NAME plan_bind
         COMMAND ${K3_PLAN_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/bind_test.py ${MPIEXEC_EXECUTABLE})
set_tests_properties(plan_bind PROPERTIES LABELS "mpi" TIMEOUT 120 ENVIRONMENT "${K3_TEST_ENV_MPI}")
# the plan's sizes against the engine's allocations, byte for byte (guard backend, page slack)
k3_add_test_exe(test_plan_sizes ${CMAKE_CURRENT_LIST_DIR}/test_plan_sizes.c)
add_test(NAME plan_sizes COMMAND test_plan_sizes)
set_tests_properties(plan_sizes PROPERTIES LABELS "unit" TIMEOUT 120 ENVIRONMENT "${K3_TEST_ENV}")
