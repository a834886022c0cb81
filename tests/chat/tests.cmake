# tests/chat — the K3 segment builder and canonical JSON (coordinator/k3_chat.h). Owner: chat (H6).
# vs_jinja.py: `k3 render` vs the K3 template rendered by jinja2 (+ documented divergences);
# exit 77 = jinja2 missing.
find_program(K3_PYTHON3 python3)
add_test(NAME chat_vs_jinja COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/vs_jinja.py)
set_tests_properties(chat_vs_jinja PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}"
                     TIMEOUT 300 SKIP_RETURN_CODE 77)
# `k3 render --ids` (segment-wise encoding) vs PyPI tiktoken (o200k ranks + K3 regex + K3 specials).
add_test(NAME chat_render_ids COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/render_ids.py)
set_tests_properties(chat_render_ids PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}"
                     TIMEOUT 120 SKIP_RETURN_CODE 77)
# The JSON reader/writer, request normalisation and segment API (C).
k3_add_test_exe(test_chat ${CMAKE_CURRENT_LIST_DIR}/test_chat.c)
add_test(NAME chat_unit COMMAND test_chat)
set_tests_properties(chat_unit PROPERTIES LABELS "unit;sanitize" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
# Issue 8 end to end: U+0000 through tokenize --jsonl, render (= jinja), render --ids, run --chat
# and parse; add_generation_prompt / continue_final_message through render, parse and run --chat.
add_test(NAME chat_request_e2e COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/request_e2e.py)
set_tests_properties(chat_request_e2e PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV_MPI}"
                     TIMEOUT 180 SKIP_RETURN_CODE 77)
# Issue 11 item 4: bad requests (tool parameters / response_format schema not objects, tool
# names with control-token text, logit_bias ids outside the vocabulary) through `k3 run --chat`
# (exit 1, one line naming the key) and `k3 batch` (invalid_request lines) on the tiny model.
add_test(NAME chat_request_errors COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/request_errors.py)
set_tests_properties(chat_request_errors PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV_MPI}"
                     TIMEOUT 180)
# Issue 34: the README's examples/request.json and examples/in.jsonl (thinking off: the answer in
# content) through k3 run --chat and k3 batch, and the thinking-on default they document.
add_test(NAME chat_examples COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/examples_test.py)
set_tests_properties(chat_examples PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 120)
