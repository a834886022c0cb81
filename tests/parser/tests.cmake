# tests/parser — the K3 output parser (coordinator/k3_parser.h). Owner: chat (H6).
# The 9 llama.cpp cases, random-split streaming, §3.6 extras, §3.3 type rules, UTF-8.
k3_add_test_exe(test_parser ${CMAKE_CURRENT_LIST_DIR}/test_parser.c)
add_test(NAME parser COMMAND test_parser)
set_tests_properties(parser PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
# `k3 parse` end to end on the 9 fixture cases (+ --stream-check, --deltas, thinking off, errors).
find_program(K3_PYTHON3 python3)
add_test(NAME parser_cli COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/cli_parse.py)
set_tests_properties(parser_cli PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
