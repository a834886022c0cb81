# tests/gpu — label "gpu": the cuda backend on a device (issue 15). Without one (no K3_CUDA build,
# no visible device, or ops not yet ported, as `k3 version` says) each test prints one SKIP line
# with the reason and CTest reports it skipped (return code 77). `ctest -L gpu` on a GPU machine.
# In the emulation build (K3_CUDA_EMULATE: the same kernels on host fibers, NCCL over MPI) the
# same tests carry the label "gpuemu" and always run: `ctest -L gpuemu`, in every CI run.
if(K3_CUDA_EMULATE)
  set(K3_GPU_LABEL gpuemu)
else()
  set(K3_GPU_LABEL gpu)
endif()
find_program(K3_GPU_PYTHON3 python3)
add_test(NAME gpu_tiny COMMAND ${K3_GPU_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/gpu_tiny.py)
set_tests_properties(gpu_tiny PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")   # k3 run initialises MPI: no leak check
# the whole model on cuda (+ nccl under mpirun): 1x1 and 2x2 vs cpu, --deterministic splits
# bit-identical, the 93-layer schedule, one `k3 serve` request (tests/gpu/gpu_model.py)
add_test(NAME gpu_model COMMAND ${K3_GPU_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/gpu_model.py
                                ${MPIEXEC_EXECUTABLE})
# (TIMEOUT: 762 s measured in the ASan emulation build on a loaded 2-core machine, deep's MoE on the
# emulated tensor cores with 3 activation terms)
set_tests_properties(gpu_model PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 1500 SKIP_RETURN_CODE 77
                     ENVIRONMENT "${K3_TEST_ENV_MPI}")
# --op-stats of cuda + nccl (and mpi) at 2x2: the transport's waits and graph launches counted
add_test(NAME gpu_opstats COMMAND ${K3_GPU_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/gpu_opstats.py
                                  ${MPIEXEC_EXECUTABLE})
set_tests_properties(gpu_opstats PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 300
                     SKIP_RETURN_CODE 77 ENVIRONMENT "${K3_TEST_ENV_MPI}")
# decode steps as CUDA graphs: on vs off byte-identical at 1x1, 1x2 and 2x2 (cuda + nccl), one
# graph launch and <= 1 host sync a decode step, an injected host sync failing the capture
# (tests/gpu/gpu_graphs.py; ~50 s in the ASan emulation build)
add_test(NAME gpu_graphs COMMAND ${K3_GPU_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/gpu_graphs.py
                                 ${MPIEXEC_EXECUTABLE})
set_tests_properties(gpu_graphs PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 300
                     SKIP_RETURN_CODE 77 ENVIRONMENT "${K3_TEST_ENV_MPI}")
# the device-routed MoE exchange: 1x4 op counts independent of batch and routing, the capacity
# overflow named (tests/gpu/gpu_moe_ep.py)
add_test(NAME gpu_moe_ep COMMAND ${K3_GPU_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/gpu_moe_ep.py
                                 ${MPIEXEC_EXECUTABLE})
set_tests_properties(gpu_moe_ep PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 300
                     SKIP_RETURN_CODE 77 ENVIRONMENT "${K3_TEST_ENV_MPI}")
# a skewed prompt (16 identical tokens, over the device route's capacity) on 2x2 cuda + nccl:
# prefill host-routed, the run succeeds byte-identical to 1x1 (tests/gpu/gpu_moe_skew.py)
add_test(NAME gpu_moe_skew COMMAND ${K3_GPU_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/gpu_moe_skew.py
                                   ${MPIEXEC_EXECUTABLE})
set_tests_properties(gpu_moe_skew PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 300
                     SKIP_RETURN_CODE 77 ENVIRONMENT "${K3_TEST_ENV_MPI}")
if(K3_CUDA_EMULATE AND NOT K3_SANITIZE)
  # issue 44's acceptance: small --pp 2 --ep 2 on cuda + nccl (tensor-core MoE, split activations)
  # vs plain cpu, 3 prompts x 16 tokens (tests/gpu/gpu_small.py). 7-14 minutes even without
  # sanitizers (the emulated small model), so only in the plain emulation build.
  add_test(NAME gpu_small COMMAND ${K3_GPU_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/gpu_small.py
                                  ${MPIEXEC_EXECUTABLE})
  set_tests_properties(gpu_small PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 1800 COST 900
                       SKIP_RETURN_CODE 77 ENVIRONMENT "${K3_TEST_ENV_MPI}")
endif()
if(K3_CUDA_EMULATE)
  # A device load holds the staging in host memory, not the weights: the small preset's peak RSS
  # less the emulated device's bytes stays below the weights (tests/gpu/test_load_rss.c).
  k3_add_test_exe(test_load_rss ${CMAKE_CURRENT_LIST_DIR}/test_load_rss.c)
  add_test(NAME gpu_load_rss COMMAND test_load_rss ${CMAKE_CURRENT_BINARY_DIR}/load_rss_small)
  set_tests_properties(gpu_load_rss PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 300
                       ENVIRONMENT "${K3_TEST_ENV}")
endif()
if(K3_CUDA)
  # The cuda kernels' math on the host (no device): nvcc compiles it, the CPU runs it against
  # kernels/ref. Unit tier, so it runs in every K3_CUDA build. (tests/gpu/test_cuda_math.cu)
  if(K3_CUDA_EMULATE)   # the host C++ compiler, as for the kernels themselves
    set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/test_cuda_math.cu PROPERTIES
                                LANGUAGE CXX COMPILE_OPTIONS "-xc++;-std=c++17;-Wno-unknown-pragmas")
  else()
    enable_language(CUDA)
  endif()
  add_executable(test_cuda_math ${CMAKE_CURRENT_LIST_DIR}/test_cuda_math.cu)
  target_include_directories(test_cuda_math PRIVATE ${CMAKE_SOURCE_DIR}/tests ${CMAKE_SOURCE_DIR}/kernels/cuda)
  target_link_libraries(test_cuda_math PRIVATE k3lib)
  if(K3_WERROR)
    target_compile_options(test_cuda_math PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
  endif()
  add_test(NAME cuda_math COMMAND test_cuda_math)
  set_tests_properties(cuda_math PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
  # the layout oracle of the tensor-core primitives (kernels/cuda/k3c_mma.cuh): ldmatrix + mma
  # bit for bit against C on exact inputs, the dequant helpers, and (emulation) each emulator
  # check on an injected bug. On a device it proves the emulated fragment maps (device-check.sh
  # runs it first); without one it skips (77).
  if(K3_CUDA_EMULATE)
    set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/test_cuda_mma.cu PROPERTIES
                                LANGUAGE CXX COMPILE_OPTIONS "-xc++;-std=c++17;-Wno-unknown-pragmas")
  endif()
  add_executable(test_cuda_mma ${CMAKE_CURRENT_LIST_DIR}/test_cuda_mma.cu)
  target_include_directories(test_cuda_mma PRIVATE ${CMAKE_SOURCE_DIR}/kernels/cuda ${CMAKE_SOURCE_DIR}/tests)
  target_link_libraries(test_cuda_mma PRIVATE k3lib)   # k3cuda, and the ref backend
  if(K3_CUDA_EMULATE)
    target_compile_options(test_cuda_mma PRIVATE -Wall -Wextra -Wshadow $<$<BOOL:${K3_WERROR}>:-Werror>)
  elseif(K3_WERROR)
    target_compile_options(test_cuda_mma PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
  endif()
  add_test(NAME cuda_mma COMMAND test_cuda_mma)
  set_tests_properties(cuda_mma PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 120 SKIP_RETURN_CODE 77
                       ENVIRONMENT "${K3_TEST_ENV}")
  # a captured step of the cuda backend: replay = direct run bytes; a host sync inside fails
  k3_add_test_exe(test_cuda_step_graph ${CMAKE_CURRENT_LIST_DIR}/test_cuda_step_graph.c)
  add_test(NAME cuda_step_graph COMMAND test_cuda_step_graph)
  set_tests_properties(cuda_step_graph PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 60
                       SKIP_RETURN_CODE 77 ENVIRONMENT "${K3_TEST_ENV}")
  # the dense BF16 tensor-core GEMM (kernels/cuda/matmul_mma.cu) vs ref in both precisions,
  # decode (swap-AB) and prefill tiles, mma counts, and the matmul op on tensor cores
  if(K3_CUDA_EMULATE)
    set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/test_cuda_gemm.cu PROPERTIES
                                LANGUAGE CXX COMPILE_OPTIONS "-xc++;-std=c++17;-Wno-unknown-pragmas")
  endif()
  add_executable(test_cuda_gemm ${CMAKE_CURRENT_LIST_DIR}/test_cuda_gemm.cu)
  target_include_directories(test_cuda_gemm PRIVATE ${CMAKE_SOURCE_DIR}/kernels/cuda ${CMAKE_SOURCE_DIR}/tests)
  target_link_libraries(test_cuda_gemm PRIVATE k3lib)
  if(K3_CUDA_EMULATE)
    target_compile_options(test_cuda_gemm PRIVATE -Wall -Wextra -Wshadow $<$<BOOL:${K3_WERROR}>:-Werror>)
  elseif(K3_WERROR)
    target_compile_options(test_cuda_gemm PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
  endif()
  add_test(NAME cuda_gemm COMMAND test_cuda_gemm)
  set_tests_properties(cuda_gemm PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 120 SKIP_RETURN_CODE 77
                       ENVIRONMENT "${K3_TEST_ENV}")
  # every op of the cuda backend vs ref on a device (skips with one line, 77, without one)
  k3_add_test_exe(test_cuda_ops ${CMAKE_CURRENT_LIST_DIR}/test_cuda_ops.c)
  target_include_directories(test_cuda_ops PRIVATE ${CMAKE_SOURCE_DIR}/kernels/cuda)   # k3_cuda_moe.h
  add_test(NAME cuda_ops COMMAND test_cuda_ops)
  set_tests_properties(cuda_ops PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 600 SKIP_RETURN_CODE 77
                       ENVIRONMENT "${K3_TEST_ENV}")
  if(K3_NCCL)
    # the nccl comm transport under mpirun on 1 and 3 ranks: creation (EP split, a NOCOLOR
    # coordinator) and (stand-in only) its API and a silent lane failing within the timeout. A
    # device build needs a GPU per rank (skips with one line, 77, without); the emulation build
    # runs it on the NCCL stand-in over MPI (comm/nccl_emu).
    k3_add_test_exe(test_comm_nccl ${CMAKE_CURRENT_LIST_DIR}/test_comm_nccl.c)
    foreach(np 1 3)
      add_test(NAME comm_nccl_${np}rank
               COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe
                       ${MPIEXEC_PREFLAGS} $<TARGET_FILE:test_comm_nccl>)
      set_tests_properties(comm_nccl_${np}rank PROPERTIES LABELS "${K3_GPU_LABEL}" TIMEOUT 120
                           SKIP_RETURN_CODE 77 ENVIRONMENT "${K3_TEST_ENV_MPI}")
    endforeach()
    # the whole comm test (tests/mpi/test_comm.c: messages, MoE dispatch + combine element by
    # element in both modes, counters, errors, timeouts) on the nccl transport, cpu and cuda
    # backends (cuda: the rows packed and moved on the device). One GPU per rank on a device.
    if(K3_CUDA_EMULATE)
      set(k3_nccl_grids "3 1 3 0" "5 2 2 1")
    else()
      set(k3_nccl_grids "1 1 1 0")
    endif()
    foreach(grid ${k3_nccl_grids})
      separate_arguments(g UNIX_COMMAND "${grid}")
      list(GET g 0 np)
      list(GET g 1 S)
      list(GET g 2 E)
      list(GET g 3 F)
      add_test(NAME comm_nccl_np${np}_s${S}_e${E}_f${F}
               COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe
                       ${MPIEXEC_PREFLAGS} $<TARGET_FILE:test_comm> ${S} ${E} ${F} 1234 cpu,cuda nccl)
      set_tests_properties(comm_nccl_np${np}_s${S}_e${E}_f${F} PROPERTIES LABELS "${K3_GPU_LABEL}"
                           TIMEOUT 180 ENVIRONMENT "${K3_TEST_ENV_MPI}")
    endforeach()
  endif()
endif()
# test_cuda_emu: the emulation's own semantics (issue 28)
if(K3_CUDA_EMULATE)
  # barriers, warp primitives, shared memory, atomics, reported errors and the runtime API of
  # kernels/cuda/emu, against host-computed values; links k3cuda only (the runtime + kernels)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/test_cuda_emu.cu PROPERTIES
                              LANGUAGE CXX COMPILE_OPTIONS "-xc++;-std=c++17;-Wno-unknown-pragmas")
  add_executable(test_cuda_emu ${CMAKE_CURRENT_LIST_DIR}/test_cuda_emu.cu)
  target_include_directories(test_cuda_emu PRIVATE ${CMAKE_SOURCE_DIR}/kernels/cuda)
  target_compile_options(test_cuda_emu PRIVATE -Wall -Wextra -Wshadow $<$<BOOL:${K3_WERROR}>:-Werror>)
  target_link_libraries(test_cuda_emu PRIVATE k3cuda)
  add_test(NAME cuda_emu COMMAND test_cuda_emu)
  set_tests_properties(cuda_emu PROPERTIES LABELS "gpuemu" TIMEOUT 120 ENVIRONMENT "${K3_TEST_ENV}")
  # device memory in its own address range and asynchronous streams, each check on an injected
  # bug (issue 44; kernels/cuda/emu/emu_devmem.cpp, emu_streams.cpp)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/test_emu_checks.cu PROPERTIES
                              LANGUAGE CXX COMPILE_OPTIONS "-xc++;-std=c++17;-Wno-unknown-pragmas")
  add_executable(test_emu_checks ${CMAKE_CURRENT_LIST_DIR}/test_emu_checks.cu)
  target_include_directories(test_emu_checks PRIVATE ${CMAKE_SOURCE_DIR}/kernels/cuda ${CMAKE_SOURCE_DIR}/tests)
  target_compile_options(test_emu_checks PRIVATE -Wall -Wextra -Wshadow $<$<BOOL:${K3_WERROR}>:-Werror>)
  target_link_libraries(test_emu_checks PRIVATE k3lib)
  add_test(NAME emu_checks COMMAND test_emu_checks)
  set_tests_properties(emu_checks PROPERTIES LABELS "gpuemu" TIMEOUT 120 ENVIRONMENT "${K3_TEST_ENV}")
endif()
# test_cuda_graph: the emulation's CUDA graphs (issue 45): record / replay, and what a capture
# forbids failing with a k3emu line
if(K3_CUDA_EMULATE)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/test_cuda_graph.cu PROPERTIES
                              LANGUAGE CXX COMPILE_OPTIONS "-xc++;-std=c++17;-Wno-unknown-pragmas")
  add_executable(test_cuda_graph ${CMAKE_CURRENT_LIST_DIR}/test_cuda_graph.cu)
  target_include_directories(test_cuda_graph PRIVATE ${CMAKE_SOURCE_DIR}/kernels/cuda)
  target_compile_options(test_cuda_graph PRIVATE -Wall -Wextra -Wshadow $<$<BOOL:${K3_WERROR}>:-Werror>)
  target_link_libraries(test_cuda_graph PRIVATE k3cuda)
  add_test(NAME cuda_graph COMMAND test_cuda_graph)
  set_tests_properties(cuda_graph PROPERTIES LABELS "gpuemu" TIMEOUT 60 ENVIRONMENT "${K3_TEST_ENV}")
endif()
