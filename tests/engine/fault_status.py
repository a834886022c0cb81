#!/usr/bin/env python3
"""fault_status.py — a fault comes back through the engine API as a status, and the client ends
the job with the one-line message (test_fault_status.c is the client). On a tiny model under
mpirun:
  none      2x2, no hook: every rank exits 0;
  load:1    2x2: rank 1's k3_engine_open returns an I/O error; its line names rank 1; the job ends non-zero;
  hang:1:3  2x1, --comm-timeout 3: rank 1 stops answering at its 3rd step; rank 0's
            k3_engine_step returns a communication error after the timeout; the message names rank 1; the job ends
            within 30 s.
usage: fault_status.py TEST_BIN MPIEXEC   (K3_BIN = the k3 binary)"""
import os
import re
import subprocess
import sys
import tempfile
import time

K3 = os.environ["K3_BIN"]
test_bin, mpiexec = sys.argv[1], sys.argv[2]
fails = []


def check(cond, msg):
    if not cond:
        fails.append(msg)
    return cond


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
    # (tag, hook, S, E, the fault line rank 0 or the failing rank prints, the rank to be named)
    cases = [("none", None, 2, 2, None, None),
             ("load:1", "load:1", 2, 2, r"fault: k3_engine_open returned I/O error, failed=1", 1),
             ("hang:1:3", "hang:1:3", 2, 1, r"fault: k3_engine_step returned communication error, failed=1", 1)]
    for tag, hook, S, E, line, named in cases:
        env = dict(os.environ)
        env.pop("K3_TEST_FAIL", None)
        if hook:
            env["K3_TEST_FAIL"] = hook
        t0 = time.monotonic()
        try:
            p = subprocess.run([mpiexec, "-np", str(S * E), "--oversubscribe", test_bin, str(S),
                                str(E), model, "3"], capture_output=True, text=True, timeout=60,
                               env=env)
        except subprocess.TimeoutExpired:
            check(False, f"{tag}: the job did not end within 60 s")
            continue
        dt = time.monotonic() - t0
        text = p.stdout + p.stderr
        if line is None:
            check(p.returncode == 0 and p.stdout.count("no fault") == S * E,
                  f"{tag}: rc {p.returncode}, stdout:\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
        else:
            check(p.returncode != 0, f"{tag}: exit code 0")
            check(re.search(line, p.stdout) is not None,
                  f"{tag}: no '{line}' on stdout:\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
            check(re.search(rf"\brank {named}\b", p.stderr) is not None,
                  f"{tag}: no message names rank {named}:\n{p.stderr[-1500:]}")
            check(dt < 30, f"{tag}: took {dt:.1f} s")
        print(f"{tag}: rc {p.returncode} in {dt:.1f} s; "
              f"{[l for l in p.stdout.splitlines() if l.startswith('fault:')]}", flush=True)
for f in fails:
    print("FAIL", f)
sys.exit(1 if fails else 0)
