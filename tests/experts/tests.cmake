# experts/ — moe_topk ties, router, expert rows, whole latent MoE layer (ref, cpu; guard == cpu).
k3_add_test_exe(test_experts ${CMAKE_CURRENT_LIST_DIR}/test_experts.c)
add_test(NAME experts COMMAND test_experts)
set_tests_properties(experts PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
add_test(NAME experts_tiny COMMAND test_experts tiny)
set_tests_properties(experts_tiny PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
# vs the independent PyTorch reference (tests/reference/k3_reference.py), layer by layer
add_test(NAME experts_torch COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/moe_vs_torch.py $<TARGET_FILE:test_experts>)
set_tests_properties(experts_torch PROPERTIES LABELS "golden" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 300
                     SKIP_RETURN_CODE 77)
