#!/usr/bin/env python3
"""preempt.py — drive test_preempt under mpirun (issue 42): 16 long generations with a paged cache
that never runs out (4096 tokens a lane) and with one that forces preemption (1024 and 640
tokens), 1x1 and 2x2, prefix cache on and off, --deterministic. Every run passes its own checks;
the small caches must preempt (preemptions > 0); every run prints the same digest of every token
and logits row (a preempted request is recomputed bit for bit).
usage: preempt.py TEST_BIN MPIEXEC   (K3_BIN = the k3 binary)"""
import os
import re
import subprocess
import sys
import tempfile

K3 = os.environ["K3_BIN"]
test_bin, mpiexec = sys.argv[1], sys.argv[2]
runs = [(1, 1, "on", 4096), (1, 1, "on", 1024), (1, 1, "off", 640), (2, 2, "on", 1024)]
fails, digests = [], {}
with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
    for S, E, mode, kv in runs:
        tag = f"{S}x{E} cache {mode} kv {kv}"
        p = subprocess.run([mpiexec, "-np", str(S * E), "--oversubscribe", test_bin, str(S), str(E),
                            model, mode, str(kv)], capture_output=True, text=True, timeout=600)
        print(tag + ":\n" + p.stdout.strip()[-600:])
        d = re.search(r"digest ([0-9a-f]+)", p.stdout)
        n = re.search(r"preemptions (\d+)", p.stdout)
        if p.returncode != 0 or not d or not n:
            fails.append(f"{tag}: rc {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-2000:]}")
            continue
        digests[tag] = d.group(1)
        if kv < 4096 and int(n.group(1)) == 0:
            fails.append(f"{tag}: no request was preempted")
if len(set(digests.values())) > 1:
    fails.append(f"digests differ: {digests}")
for f in fails:
    print("FAIL", f)
if not fails:
    print(f"all {len(runs)} runs passed; digest {set(digests.values())}")
sys.exit(1 if fails else 0)
