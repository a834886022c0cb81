# README.md's code blocks, run in order as printed on the tiny model (issue 48): a README line that
# fails as printed fails CI. Slow parts: make-tiny, a 2 x 2 mpirun, one k3 serve (~30 s in all).
find_program(K3_RUN_PYTHON3 python3)
add_test(NAME readme_blocks COMMAND ${K3_RUN_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/readme_test.py)
set_tests_properties(readme_blocks PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}"
                     TIMEOUT 300 SKIP_RETURN_CODE 77)
# The quick start's scripts/demo.sh as printed, in a copy of the tree with no build/ (it builds
# its own: ~1 min of the CI's CPU), issue 48.
add_test(NAME readme_demo COMMAND ${K3_RUN_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/demo_test.py)
set_tests_properties(readme_demo PROPERTIES LABELS "mpi" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 400
                     COST 300)
