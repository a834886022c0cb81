# tests/gpu — label "gpu": the cuda backend on a device (issue 15). Without one (no K3_CUDA build,
# no visible device, or ops not yet ported, as `k3 version` says) each test prints one SKIP line
# with the reason and CTest reports it skipped (return code 77). `ctest -L gpu` on a GPU machine.
find_program(K3_GPU_PYTHON3 python3)
add_test(NAME gpu_tiny COMMAND ${K3_GPU_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/gpu_tiny.py)
set_tests_properties(gpu_tiny PROPERTIES LABELS "gpu" TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "${K3_TEST_ENV}")
if(K3_CUDA)
  # The cuda kernels' math on the host (no device): nvcc compiles it, the CPU runs it against
  # kernels/ref. Unit tier, so it runs in every K3_CUDA build. (tests/gpu/test_cuda_math.cu)
  enable_language(CUDA)
  add_executable(test_cuda_math ${CMAKE_CURRENT_LIST_DIR}/test_cuda_math.cu)
  target_include_directories(test_cuda_math PRIVATE ${CMAKE_SOURCE_DIR}/tests ${CMAKE_SOURCE_DIR}/kernels/cuda)
  target_link_libraries(test_cuda_math PRIVATE k3lib)
  if(K3_WERROR)
    target_compile_options(test_cuda_math PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
  endif()
  add_test(NAME cuda_math COMMAND test_cuda_math)
  set_tests_properties(cuda_math PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
  # every op of the cuda backend vs ref on a device (skips with one line, 77, without one)
  k3_add_test_exe(test_cuda_ops ${CMAKE_CURRENT_LIST_DIR}/test_cuda_ops.c)
  add_test(NAME cuda_ops COMMAND test_cuda_ops)
  set_tests_properties(cuda_ops PROPERTIES LABELS "gpu" TIMEOUT 300 SKIP_RETURN_CODE 77
                       ENVIRONMENT "${K3_TEST_ENV}")
  if(K3_NCCL)
    # the nccl comm transport on one rank and one GPU (skips with one line, 77, without one)
    k3_add_test_exe(test_comm_nccl ${CMAKE_CURRENT_LIST_DIR}/test_comm_nccl.c)
    add_test(NAME comm_nccl_1rank COMMAND test_comm_nccl)
    set_tests_properties(comm_nccl_1rank PROPERTIES LABELS "gpu" TIMEOUT 120 SKIP_RETURN_CODE 77
                         ENVIRONMENT "${K3_TEST_ENV_MPI}")
  endif()
endif()
