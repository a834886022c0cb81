"""k3_skip.py — how a Python test that needs the independent reference stack skips.

A test that cannot run (PyTorch, fla, compressed-tensors or safetensors missing) proves nothing,
so it must never pass quietly: outside CI it prints one loud line and exits 77 (ctest's
SKIP_RETURN_CODE: reported as skipped, visible in the summary); under CI=true (how CI runs
.ci/run) the same line says FAIL and it exits 1, so a CI machine without the reference stack
fails the suite instead of skipping (scripts/test.sh installs tests/reference/requirements.txt).
Standard library only: it runs before the imports it reports on.
"""
import os
import sys

SKIP = 77


def skip(test, reason):
    """Skip `test` (exit 77), or fail it (exit 1) under CI=true; never returns."""
    hint = "pip install -r tests/reference/requirements.txt"
    if os.environ.get("CI", "").lower() == "true":
        print(f"FAIL {test}: the reference test cannot run under CI=true: {reason} ({hint})",
              file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"SKIPPED {test}: {reason} — this reference test did NOT run ({hint})",
          file=sys.stderr, flush=True)
    sys.exit(SKIP)
