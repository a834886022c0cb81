# Tokenizer tests (coordinator/k3_tokenizer.h). Owner: tokenizer (H5).
k3_add_test_exe(test_tokenizer ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer.c)
add_test(NAME tokenizer_unit COMMAND test_tokenizer)
set_tests_properties(tokenizer_unit PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
# The default spelling of the pattern's Unicode classes splits like the EXPLICIT one (~20 s).
add_test(NAME tokenizer_spellings COMMAND test_tokenizer --spellings)
set_tests_properties(tokenizer_spellings PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 300)

# k3 vs PyPI tiktoken on >= 5,000 generated strings per configuration (exit 77 = tiktoken missing).
find_program(K3_PYTHON3 python3)
add_test(NAME tokenizer_vs_tiktoken COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/vs_tiktoken.py)
set_tests_properties(tokenizer_vs_tiktoken PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}"
                     TIMEOUT 300 SKIP_RETURN_CODE 77)

# `k3 tokenize` input/error handling: wrong --model, invalid --jsonl lines, failed stdin reads.
add_test(NAME tokenizer_cli COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/cli_tokenize.sh)
set_tests_properties(tokenizer_cli PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)

# base/k3_utf8.h: the one strict UTF-8 decoder (roundtrip of every scalar value, Table 3-7,
# CPython replacement vectors, NUL, str.isspace).
k3_add_test_exe(test_utf8 ${CMAKE_CURRENT_LIST_DIR}/test_utf8.c)
add_test(NAME tokenizer_utf8 COMMAND test_utf8)
set_tests_properties(tokenizer_utf8 PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)

# Issue 8: every scalar value U+0000..U+10FFFF in 7 contexts (+ Script != Script_Extensions pairs,
# category boundaries) vs PyPI tiktoken, for the K3, o200k and cl100k patterns, with the official
# ranks and with a vocabulary that makes the pre-tokenizer's pieces visible (6 k3 processes,
# ~2 min on 2 idle cores). Exit 77 = tiktoken or unicodedataplus missing.
add_test(NAME tokenizer_unicode_sweep COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/unicode_sweep.py)
set_tests_properties(tokenizer_unicode_sweep PROPERTIES LABELS "golden" ENVIRONMENT "${K3_TEST_ENV}"
                     TIMEOUT 1200 SKIP_RETURN_CODE 77)
# coordinator/tokenizer_unicode.h is what tests/tokenizer/gen_unicode_classes.py writes from the
# UCD 16.0 (exit 77 = unicodedataplus missing).
add_test(NAME tokenizer_unicode_tables COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/gen_unicode_classes.py --check)
set_tests_properties(tokenizer_unicode_tables PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}"
                     TIMEOUT 120 SKIP_RETURN_CODE 77)
