# layering — the module graph of DESIGN.md §1 read from the #include lines of every module
# folder: a forbidden edge (kernels → model, layers → rank, ...), a cycle, or MPI/CUDA outside
# their folders fails. The self-test injects such includes into a temporary copy and checks that
# each one is caught (the checker seen to fail, STYLE.md §18).
add_test(NAME module_graph COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/module_graph.py ${CMAKE_SOURCE_DIR})
set_tests_properties(module_graph PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
add_test(NAME module_graph_self_test
         COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/module_graph.py --self-test ${CMAKE_SOURCE_DIR})
set_tests_properties(module_graph_self_test PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
# the step's op-count rule (docs/DESIGN.md §3a): no loop over sequences, heads or tokens around an
# op call in layers/ or experts/; the self-test injects one such loop per folder and must catch it
add_test(NAME op_loops COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/op_loops.py ${CMAKE_SOURCE_DIR})
set_tests_properties(op_loops PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
add_test(NAME op_loops_self_test
         COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/op_loops.py --self-test ${CMAKE_SOURCE_DIR})
set_tests_properties(op_loops_self_test PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
# docs/DESIGN.md §1: the module table names exactly the project's folders (top-level folders,
# K3_MODULES, deeper source folders); the self-test feeds it a table with a folder left out and
# one made up, and must see both named
add_test(NAME design_modules COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/design_modules.py ${CMAKE_SOURCE_DIR})
set_tests_properties(design_modules PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
add_test(NAME design_modules_self_test
         COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/design_modules.py --self-test ${CMAKE_SOURCE_DIR})
set_tests_properties(design_modules_self_test PROPERTIES LABELS "unit" ENVIRONMENT "${K3_TEST_ENV}" TIMEOUT 60)
