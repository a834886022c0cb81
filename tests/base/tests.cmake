k3_add_test_exe(test_base ${CMAKE_CURRENT_LIST_DIR}/test_base.c)
add_test(NAME base COMMAND test_base)
set_tests_properties(base PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
