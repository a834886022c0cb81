# scripts/test.sh's first seconds: its cost, and what it needs named before anything runs (issue 48)
add_test(NAME test_sh_preflight COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/preflight.sh)
set_tests_properties(test_sh_preflight PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
