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
  set_tests_properties(comm_np${np}_s${S}_e${E}_f${F} PROPERTIES LABELS "mpi" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
endforeach()
