# experts/ — router, grouped top-k, expert rows, whole latent MoE layer, dispatch permutation.
k3_add_test_exe(test_experts ${CMAKE_CURRENT_LIST_DIR}/test_experts.c)
add_test(NAME experts COMMAND test_experts)
set_tests_properties(experts PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
