# Tokenizer benchmark (owner: tokenizer, H5): built, never run as a test (benchmarks are not pass/fail).
#   K3_TESTDATA=tests/data build-x/tests/bench_tokenizer [--mb 4] [--text FILE] [--json OUT]
k3_add_test_exe(bench_tokenizer ${CMAKE_SOURCE_DIR}/tests/bench/bench_tokenizer.c)
