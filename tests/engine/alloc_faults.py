#!/usr/bin/env python3
"""alloc_faults.py — drive test_alloc_faults (issue 42): the N-th allocation at each site (submit,
step, fork; K3_TEST_FAIL=alloc:SITE:N) fails; exactly one request fails, with an error that says
out of memory, every other request gives the tokens of the run without the hook, the engine
never faults, and nothing is left reserved or leaked.
usage: alloc_faults.py TEST_BIN   (K3_BIN = the k3 binary)"""
import os
import subprocess
import sys
import tempfile

K3 = os.environ["K3_BIN"]
test_bin = sys.argv[1]
specs = ["alloc:submit:%d" % n for n in (1, 2, 3, 4, 5, 8, 12, 17, 23, 30)] + \
        ["alloc:step:%d" % n for n in (1, 2, 5, 9, 14)] + ["alloc:fork:%d" % n for n in (1, 2)]
fails = []


def run(model, spec):
    p = subprocess.run([test_bin, model, spec], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("req ")]
    return p, lines


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
    p, ref = run(model, "none")
    if p.returncode != 0 or any(" fail " in ln for ln in ref):
        sys.exit("the run without a hook failed: rc %d\n%s\n%s" % (p.returncode, p.stdout, p.stderr[-2000:]))
    for spec in specs:
        p, got = run(model, spec)
        failed = [ln for ln in got if " fail " in ln]
        print("%s: rc %d, %s" % (spec, p.returncode, failed))
        if p.returncode != 0 or len(got) != len(ref):
            fails.append("%s: rc %d\n%s\n%s" % (spec, p.returncode, p.stdout, p.stderr[-2000:]))
            continue
        if len(failed) != 1 or "out of memory" not in failed[0]:
            fails.append("%s: want one request failed with out of memory, got %s" % (spec, failed))
        for a, b in zip(got, ref):
            if " fail " not in a and a != b:
                fails.append("%s: %r differs from the run without the hook %r" % (spec, a, b))
for f in fails:
    print("FAIL", f)
if not fails:
    print("all %d hooked runs failed exactly one request" % len(specs))
sys.exit(1 if fails else 0)
