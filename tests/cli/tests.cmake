add_test(NAME cli COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/cli.sh)
set_tests_properties(cli PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
