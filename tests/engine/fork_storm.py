#!/usr/bin/env python3
"""fork_storm.py — drive test_fork_storm under mpirun (issue 42): families of n = 4 forking on a
full lane, and the reliability battery's repro (families of n = 4, max_tokens 1, over 10 shared
prefixes), with the prefix cache on and off, on a cache the two families fill exactly (768 tokens)
and on the battery's 2048, 1x1 and 2x2. Every run must pass its own checks.
usage: fork_storm.py TEST_BIN MPIEXEC   (K3_BIN = the k3 binary)"""
import os
import subprocess
import sys
import tempfile

K3 = os.environ["K3_BIN"]
test_bin, mpiexec = sys.argv[1], sys.argv[2]
runs = [(1, 1, "on", 768, 40), (1, 1, "off", 768, 40), (1, 1, "on", 2048, 200),
        (2, 2, "on", 2048, 40)]
fails = []
with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
    for S, E, mode, kv, n in runs:
        tag = f"{S}x{E} cache {mode} kv {kv} battery {n}"
        p = subprocess.run([mpiexec, "-np", str(S * E), "--oversubscribe", test_bin, str(S), str(E),
                            model, mode, str(kv), str(n)], capture_output=True, text=True,
                           timeout=400)
        print(tag + ":\n" + p.stdout.strip()[-1200:])
        if p.returncode != 0:
            fails.append(f"{tag}: rc {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-2000:]}")
for f in fails:
    print("FAIL", f)
if not fails:
    print(f"all {len(runs)} runs passed")
sys.exit(1 if fails else 0)
