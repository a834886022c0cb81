#!/usr/bin/env python3
"""prefix_engine.py — drive test_prefix_engine under mpirun (issue 31): the prefix cache on and
off on 1x1 and 2x2 (--deterministic), and on under a budget of 3 blocks a lane (it must evict
while requests run; a stage refuses to free a block a running sequence holds, which ends the job).
Every run must pass its own checks (hits where expected, the engine's counters equal to the
requests' cached tokens) and print the same digest of every token and logits row; the runs with
the cache on must have hits.
usage: prefix_engine.py TEST_BIN MPIEXEC   (K3_BIN = the k3 binary)"""
import os
import re
import subprocess
import sys
import tempfile

K3 = os.environ["K3_BIN"]
test_bin, mpiexec = sys.argv[1], sys.argv[2]
runs = [(1, 1, "on", []), (1, 1, "off", []), (2, 2, "on", []), (2, 2, "off", []),
        (1, 1, "on", ["192"]), (2, 2, "on", ["192", "1280"])]
fails, digests = [], {}
with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
    for S, E, mode, extra in runs:
        tag = f"{S}x{E} cache {mode}" + (f" budget {' '.join(extra)}" if extra else "")
        p = subprocess.run([mpiexec, "-np", str(S * E), "--oversubscribe", test_bin, str(S), str(E),
                            model, mode] + extra, capture_output=True, text=True, timeout=300)
        print(tag + ":\n" + p.stdout.strip()[-1200:])
        m = re.search(r"digest ([0-9a-f]+)", p.stdout)
        h = re.search(r"hits (\d+) of (\d+) prompt tokens looked up, (\d+) evictions", p.stdout)
        if p.returncode != 0 or not m or not h:
            fails.append(f"{tag}: rc {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-2000:]}")
            continue
        if mode == "on" and int(h.group(1)) == 0:
            fails.append(f"{tag}: no prefix-cache hits")
        if extra and int(h.group(3)) == 0:
            fails.append(f"{tag}: a budget of {extra[0]} tokens evicted nothing")
        digests[tag] = m.group(1)
if len(set(digests.values())) > 1:
    fails.append(f"digests differ: {digests}")
elif len(digests) == len(runs):
    print(f"all {len(runs)} runs: the same digest {next(iter(digests.values()))}")
for f in fails:
    print("FAIL", f)
sys.exit(1 if fails else 0)
