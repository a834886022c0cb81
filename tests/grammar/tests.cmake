# tests/grammar — the grammar engine (coordinator/k3_grammar.h): verdicts against PyPI jsonschema
# and Python re, random walks through the masks, refusals; the constrained server end to end.
find_program(K3_PYTHON3 python3)
k3_add_test_exe(grammar_tool ${CMAKE_CURRENT_LIST_DIR}/grammar_tool.c)
add_test(NAME grammar_schemas COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_grammar.py $<TARGET_FILE:grammar_tool>)
set_tests_properties(grammar_schemas PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 600)
