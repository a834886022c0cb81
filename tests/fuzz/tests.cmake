# Fuzz targets (tier "fuzz"). Each target builds two ways:
#  - a plain driver (its own main(): corpus files + N random inputs from a seed) with any compiler,
#    run by ctest as a short fuzz pass;
#  - a libFuzzer binary (-fsanitize=fuzzer,address,undefined), only when the compiler is clang.
# See tests/fuzz/README.md for the long runs. Sections: tokenizer (H5) first; chat/parser (H6) below.

# ---- tokenizer (owner: tokenizer, H5) ----
k3_add_test_exe(fuzz_tokenizer_driver ${CMAKE_CURRENT_LIST_DIR}/fuzz_tokenizer.c)
add_test(NAME fuzz_tokenizer_short COMMAND fuzz_tokenizer_driver --random 3000 --seed 1)
set_tests_properties(fuzz_tokenizer_short PROPERTIES LABELS "fuzz;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 300)
if(CMAKE_C_COMPILER_ID MATCHES "Clang")
  # The tokenizer sources are compiled into the target so libFuzzer sees their coverage.
  add_executable(fuzz_tokenizer ${CMAKE_CURRENT_LIST_DIR}/fuzz_tokenizer.c
                 ${CMAKE_SOURCE_DIR}/coordinator/tokenizer.c ${CMAKE_SOURCE_DIR}/coordinator/tokenizer_decode.c
                 ${CMAKE_SOURCE_DIR}/base/base.c ${CMAKE_SOURCE_DIR}/base/utf8.c)
  target_compile_definitions(fuzz_tokenizer PRIVATE K3_LIBFUZZER=1 _GNU_SOURCE)
  target_include_directories(fuzz_tokenizer PRIVATE ${CMAKE_SOURCE_DIR}/base ${CMAKE_SOURCE_DIR}/coordinator)
  target_compile_options(fuzz_tokenizer PRIVATE -g -O1 -fsanitize=fuzzer,address,undefined)
  target_link_options(fuzz_tokenizer PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(fuzz_tokenizer PRIVATE PkgConfig::PCRE2 PkgConfig::CJSON m)
endif()

# ---- chat / parser (owner: chat, H6) ----
k3_add_test_exe(fuzz_parser_driver ${CMAKE_CURRENT_LIST_DIR}/fuzz_parser.c)
add_test(NAME fuzz_parser_short COMMAND fuzz_parser_driver --random 20000 --seed 1)
set_tests_properties(fuzz_parser_short PROPERTIES LABELS "fuzz;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 300)
if(CMAKE_C_COMPILER_ID MATCHES "Clang")
  add_executable(fuzz_parser ${CMAKE_CURRENT_LIST_DIR}/fuzz_parser.c
                 ${CMAKE_SOURCE_DIR}/coordinator/chat_json.c ${CMAKE_SOURCE_DIR}/coordinator/chat_render.c
                 ${CMAKE_SOURCE_DIR}/coordinator/parser.c ${CMAKE_SOURCE_DIR}/coordinator/tokenizer.c
                 ${CMAKE_SOURCE_DIR}/coordinator/tokenizer_decode.c ${CMAKE_SOURCE_DIR}/base/base.c
                 ${CMAKE_SOURCE_DIR}/base/utf8.c)
  target_compile_definitions(fuzz_parser PRIVATE K3_LIBFUZZER=1 _GNU_SOURCE)
  target_include_directories(fuzz_parser PRIVATE ${CMAKE_SOURCE_DIR}/base ${CMAKE_SOURCE_DIR}/coordinator)
  target_compile_options(fuzz_parser PRIVATE -g -O1 -fsanitize=fuzzer,address,undefined)
  target_link_options(fuzz_parser PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(fuzz_parser PRIVATE PkgConfig::PCRE2 PkgConfig::CJSON m)
endif()

# ---- k3 serve's request parser (owner: serve) ----
k3_add_test_exe(fuzz_serve_request_driver ${CMAKE_CURRENT_LIST_DIR}/fuzz_serve_request.c)
add_test(NAME fuzz_serve_request_short COMMAND fuzz_serve_request_driver --random 10000 --seed 1)
set_tests_properties(fuzz_serve_request_short PROPERTIES LABELS "fuzz;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 300)
if(CMAKE_C_COMPILER_ID MATCHES "Clang")
  add_executable(fuzz_serve_request ${CMAKE_CURRENT_LIST_DIR}/fuzz_serve_request.c
                 ${CMAKE_SOURCE_DIR}/server/openai.c ${CMAKE_SOURCE_DIR}/server/responses.c
                 ${CMAKE_SOURCE_DIR}/client/chat_job.c
                 ${CMAKE_SOURCE_DIR}/client/chat_job_grammar.c ${CMAKE_SOURCE_DIR}/coordinator/grammar.c
                 ${CMAKE_SOURCE_DIR}/coordinator/grammar_schema.c ${CMAKE_SOURCE_DIR}/coordinator/grammar_tables.c
                 ${CMAKE_SOURCE_DIR}/coordinator/grammar_bounds.c ${CMAKE_SOURCE_DIR}/coordinator/grammar_check.c
                 ${CMAKE_SOURCE_DIR}/coordinator/chat_json.c ${CMAKE_SOURCE_DIR}/coordinator/chat_render.c
                 ${CMAKE_SOURCE_DIR}/coordinator/parser.c ${CMAKE_SOURCE_DIR}/coordinator/tokenizer.c
                 ${CMAKE_SOURCE_DIR}/coordinator/tokenizer_decode.c ${CMAKE_SOURCE_DIR}/base/base.c
                 ${CMAKE_SOURCE_DIR}/base/utf8.c)
  target_compile_definitions(fuzz_serve_request PRIVATE K3_LIBFUZZER=1 _GNU_SOURCE)
  target_include_directories(fuzz_serve_request PRIVATE ${CMAKE_SOURCE_DIR}/base ${CMAKE_SOURCE_DIR}/coordinator
                             ${CMAKE_SOURCE_DIR}/server ${CMAKE_SOURCE_DIR}/client ${CMAKE_SOURCE_DIR}/rank ${CMAKE_SOURCE_DIR}/partition
                             ${CMAKE_SOURCE_DIR}/model ${CMAKE_SOURCE_DIR}/kernels)
  target_compile_options(fuzz_serve_request PRIVATE -g -O1 -fsanitize=fuzzer,address,undefined)
  target_link_options(fuzz_serve_request PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(fuzz_serve_request PRIVATE PkgConfig::PCRE2 PkgConfig::CJSON Threads::Threads m)
endif()

# ---- grammar engine (owner: structured outputs) ----
# Long runs: build/fuzz_grammar -dict=tests/fuzz/grammar.dict ($ref / pattern / size tokens).
k3_add_test_exe(fuzz_grammar_driver ${CMAKE_CURRENT_LIST_DIR}/fuzz_grammar.c)
add_test(NAME fuzz_grammar_short COMMAND fuzz_grammar_driver --random 1500 --seed 1)
set_tests_properties(fuzz_grammar_short PROPERTIES LABELS "fuzz;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 300)
# libFuzzer build (clang): the coordinator sources it needs compiled in, for coverage.
set(K3_FUZZ_GRAMMAR_SRC grammar.c grammar_schema.c grammar_tables.c grammar_bounds.c grammar_check.c chat_json.c tokenizer.c tokenizer_decode.c)
list(TRANSFORM K3_FUZZ_GRAMMAR_SRC PREPEND ${CMAKE_SOURCE_DIR}/coordinator/)
if(CMAKE_C_COMPILER_ID MATCHES "Clang")
  add_executable(fuzz_grammar ${CMAKE_CURRENT_LIST_DIR}/fuzz_grammar.c ${K3_FUZZ_GRAMMAR_SRC}
                 ${CMAKE_SOURCE_DIR}/base/base.c ${CMAKE_SOURCE_DIR}/base/utf8.c)
  target_compile_definitions(fuzz_grammar PRIVATE K3_LIBFUZZER=1 _GNU_SOURCE)
  target_include_directories(fuzz_grammar PRIVATE ${CMAKE_SOURCE_DIR}/base ${CMAKE_SOURCE_DIR}/coordinator)
  set_target_properties(fuzz_grammar PROPERTIES COMPILE_OPTIONS "-g;-O1;-fsanitize=fuzzer,address,undefined"
                        LINK_OPTIONS "-fsanitize=fuzzer,address,undefined")
  target_link_libraries(fuzz_grammar PRIVATE PkgConfig::PCRE2 PkgConfig::CJSON Threads::Threads m)
endif()
