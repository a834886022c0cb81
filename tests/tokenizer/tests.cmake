# Tokenizer tests (coordinator/k3_tokenizer.h). Owner: tokenizer (H5).
k3_add_test_exe(test_tokenizer ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer.c)
add_test(NAME tokenizer_unit COMMAND test_tokenizer)
set_tests_properties(tokenizer_unit PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)

# k3 vs PyPI tiktoken on >= 5,000 generated strings per configuration (exit 77 = tiktoken missing).
find_program(K3_PYTHON3 python3)
add_test(NAME tokenizer_vs_tiktoken COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/vs_tiktoken.py)
set_tests_properties(tokenizer_vs_tiktoken PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}"
                     TIMEOUT 300 SKIP_RETURN_CODE 77)

# `k3 tokenize` input/error handling: wrong --model, invalid --jsonl lines, failed stdin reads.
add_test(NAME tokenizer_cli COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/cli_tokenize.sh)
set_tests_properties(tokenizer_cli PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
