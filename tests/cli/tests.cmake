add_test(NAME cli COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/cli.sh)
set_tests_properties(cli PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
# issue 48: the first errors a user meets say the next step; docs/CLI.md is the generated reference
add_test(NAME cli_messages COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/messages.sh)
set_tests_properties(cli_messages PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
add_test(NAME cli_md COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/cli_md.sh)
set_tests_properties(cli_md PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 30)
