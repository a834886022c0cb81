# layers + kernels tests (owner: forward). Unit tier; also run under ASan+UBSan.
k3_add_test_exe(test_ops ${CMAKE_CURRENT_LIST_DIR}/test_ops.c)
# every op vs ref once per cpu kernel ISA (kernels/cpu/cpu_kern.h); an ISA this CPU lacks skips (77).
# The ISA cpuid picks is one of these three and never skips, so no separate run without K3_ISA:
# it was the same kernels and the same checks as ops_<that ISA> (cpuid's pick itself runs in
# every other test of the cpu backend).
foreach(isa avx512 avx2 scalar)
  add_test(NAME ops_${isa} COMMAND test_ops)
  set_tests_properties(ops_${isa} PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV};K3_ISA=${isa}"
                       TIMEOUT 120 SKIP_RETURN_CODE 77)
endforeach()
# both decode row orders (kernels/cpu/isa.c: the CPU's vendor picks one) on the native ISA, for
# the ops whose cpu code reads the order: those that reach cpu.c's matmul group and its mm_rows
# (matmul, matmul_group, matmul_heads: ref's loop of the backend's matmul, moe_experts: its
# matmul_group); every other op is the same code for both orders and runs in ops_<isa>. A new
# caller of the matmul group belongs in this list.
foreach(gemv seq rows)
  add_test(NAME ops_gemv_${gemv} COMMAND test_ops matmul matmul_group matmul_heads moe_experts)
  set_tests_properties(ops_gemv_${gemv} PROPERTIES LABELS "unit;sanitize"
                       ENVIRONMENT "${K3_TEST_ENV};K3_GEMV=${gemv}" TIMEOUT 120)
endforeach()
k3_add_test_exe(test_layers ${CMAKE_CURRENT_LIST_DIR}/test_layers.c)
add_test(NAME layers COMMAND test_layers)
set_tests_properties(layers PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
k3_add_test_exe(test_invariance ${CMAKE_CURRENT_LIST_DIR}/test_invariance.c)
add_test(NAME forward_invariance COMMAND test_invariance)
set_tests_properties(forward_invariance PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 300)
# the same invariances on the AVX2 kernels forced (bit-identity holds within one ISA)
add_test(NAME forward_invariance_avx2 COMMAND test_invariance)
set_tests_properties(forward_invariance_avx2 PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV};K3_ISA=avx2"
                     TIMEOUT 300)
k3_add_test_exe(test_guard ${CMAKE_CURRENT_LIST_DIR}/test_guard.c)
add_test(NAME forward_guard COMMAND test_guard)
set_tests_properties(forward_guard PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 300)
k3_add_test_exe(test_paged ${CMAKE_CURRENT_LIST_DIR}/test_paged.c)
add_test(NAME forward_paged COMMAND test_paged)
set_tests_properties(forward_paged PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 300)
# the prefix cache's stage side: KDA snapshot / restore bit for bit, block holders (issue 31)
k3_add_test_exe(test_prefix ${CMAKE_CURRENT_LIST_DIR}/test_prefix.c)
add_test(NAME prefix_snapshot COMMAND test_prefix cpu)
set_tests_properties(prefix_snapshot PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
if(K3_CUDA)
  add_test(NAME prefix_snapshot_cuda COMMAND test_prefix cuda)
  set_tests_properties(prefix_snapshot_cuda PROPERTIES LABELS "gpuemu" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 600
                       SKIP_RETURN_CODE 77)
endif()
