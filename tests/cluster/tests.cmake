# tests/cluster — k3 across nodes made of Linux namespaces on this machine (README.md): one case a
# test, each making and removing its own cluster, one at a time (they share the link names).
# Needs root (namespaces, veths); skipped with the reason elsewhere, failed under CI=true.
foreach(case det det4 partition kill killucx stop load nodemap slow serve batch)
  add_test(NAME cluster_${case}
           COMMAND ${K3_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/cluster_test.py ${case})
  set_tests_properties(cluster_${case} PROPERTIES LABELS "cluster" TIMEOUT 150
                       RESOURCE_LOCK k3_cluster SKIP_RETURN_CODE 77 ENVIRONMENT "${K3_TEST_ENV_MPI}")
endforeach()
