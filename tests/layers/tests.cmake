# layers + kernels tests (owner: forward). Unit tier; also run under ASan+UBSan.
k3_add_test_exe(test_ops ${CMAKE_CURRENT_LIST_DIR}/test_ops.c)
add_test(NAME ops COMMAND test_ops)
set_tests_properties(ops PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
