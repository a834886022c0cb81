# tests/grammar — the grammar engine (coordinator/k3_grammar.h): verdicts against PyPI jsonschema
# and Python re, random walks through the masks, refusals; the constrained server end to end.
# grammar_schemas runs in the main build only (10 s; 60 s under ASan): fuzz_grammar_short is the
# engine's sanitize-tier run.
find_program(K3_PYTHON3 python3)
k3_add_test_exe(grammar_tool ${CMAKE_CURRENT_LIST_DIR}/grammar_tool.c)
add_test(NAME grammar_schemas COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_grammar.py $<TARGET_FILE:grammar_tool>)
set_tests_properties(grammar_schemas PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 600)
# issue 47: the JSON-Schema-Test-Suite's draft 2020-12 cases of the new keywords (jsts/) as bytes
# through the matcher: no invalid instance accepted, >= 90% of the verdicts right
add_test(NAME grammar_test_suite COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_suite_coverage.py $<TARGET_FILE:grammar_tool>)
set_tests_properties(grammar_test_suite PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
# The compiler's bounds (issue 43): $ref chains of 60,000, bounded repeats, 249-way enums, left
# recursion, the time budget: each refused or compiled in about a second (tests/grammar/grammar_bounds.py).
add_test(NAME grammar_bounds COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_grammar.py $<TARGET_FILE:grammar_tool> --bounds)
set_tests_properties(grammar_bounds PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
# End to end on the tiny model: 200 json_schema + 100 tool_choice=required requests through
# `k3 serve` with the openai client, the other keys, streaming, 400s, and `k3 batch`; on 2 x 2 the
# same sections with fewer requests (the split is what it checks; the counts are the 1 x 1 run's).
set(K3_GRAMMAR_ENV ${K3_TEST_ENV_MPI} "K3_MPIEXEC=${MPIEXEC_EXECUTABLE}")
add_test(NAME grammar_structured COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_structured.py)
set_tests_properties(grammar_structured PROPERTIES LABELS "unit" ENVIRONMENT "${K3_GRAMMAR_ENV}" TIMEOUT 900)
add_test(NAME grammar_structured_2x2 COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_structured.py
         --pp 2 --ep 2 --n-schema 6 --n-tools 4)
set_tests_properties(grammar_structured_2x2 PROPERTIES LABELS "mpi" ENVIRONMENT "${K3_GRAMMAR_ENV}" TIMEOUT 900)
# `k3 bench grammar` end to end (JSON against bench_grammar.schema.json; never a timing verdict).
add_test(NAME grammar_bench_cli COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/bench_grammar_cli.py)
set_tests_properties(grammar_bench_cli PROPERTIES LABELS "unit" ENVIRONMENT "${K3_GRAMMAR_ENV}" TIMEOUT 600)
