# Sampler tests (coordinator/k3_sampler.h). Owner: tokenizer (H5).
k3_add_test_exe(test_sampler ${CMAKE_CURRENT_LIST_DIR}/test_sampler.c)
add_test(NAME sampler_unit COMMAND test_sampler)
set_tests_properties(sampler_unit PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
