# The C golden test of the forward pass (owner: forward): k3 vs tests/golden/forward/ made by the
# independent PyTorch reference (tests/reference/k3_reference.py).
k3_add_test_exe(test_golden_forward ${CMAKE_CURRENT_LIST_DIR}/test_golden_forward.c)
add_test(NAME golden_forward COMMAND test_golden_forward)
set_tests_properties(golden_forward PROPERTIES LABELS "golden" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 600)
# the same goldens on the cpu backend's AVX2 kernels forced (kernels/cpu/cpu_kern.h; the default run
# above takes the CPU's best ISA; a CPU without AVX2 fails naming K3_ISA, none of ENVIRONMENT.md's lacks it)
add_test(NAME golden_forward_avx2 COMMAND test_golden_forward)
set_tests_properties(golden_forward_avx2 PROPERTIES LABELS "golden" ENVIRONMENT "${K3_TEST_ENV};K3_ISA=avx2"
                     TIMEOUT 600)
# `k3 run` end to end (greedy ids + the dumped .npy logits) against the same goldens.
add_test(NAME golden_run_cli COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/run_cli.py)
set_tests_properties(golden_run_cli PROPERTIES LABELS "golden" ENVIRONMENT "${K3_TEST_ENV_MPI}" TIMEOUT 300)
