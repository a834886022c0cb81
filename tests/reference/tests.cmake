# tests/reference — the independent PyTorch reference (owner: reference). The committed forward
# goldens must be what the reference computes today for the checkpoint k3 make-tiny writes today:
# re-make the tiny checkpoint, recompute every prompt (float64, ~2 min on 2 cores) and compare
# with tests/golden/forward/ (sha256 of the checkpoint, logits/hidden rel-L2 <= 1e-6, greedy ids).
# Skipped (77, one loud line) when the python packages of requirements.txt are not installed;
# under CI=true that is a failure instead (tests/k3_skip.py). scripts/test.sh installs them.
add_test(NAME reference_goldens_current
         COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/k3_reference.py --k3 $<TARGET_FILE:k3> --check)
set_tests_properties(reference_goldens_current PROPERTIES LABELS "golden"
                     ENVIRONMENT "${K3_TEST_ENV};K3_REF_SKIP_MISSING=1" TIMEOUT 900
                     SKIP_RETURN_CODE 77)
