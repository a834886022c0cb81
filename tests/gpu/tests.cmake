# tests/gpu — label "gpu": the cuda backend on a device (issue 15). Without one (no K3_CUDA build,
# no visible device, or ops not yet ported, as `k3 version` says) each test prints one SKIP line
# with the reason and CTest reports it skipped (return code 77). `ctest -L gpu` on a GPU machine.
find_program(K3_GPU_PYTHON3 python3)
add_test(NAME gpu_tiny COMMAND ${K3_GPU_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/gpu_tiny.py)
set_tests_properties(gpu_tiny PROPERTIES LABELS "gpu" TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "${K3_TEST_ENV}")
