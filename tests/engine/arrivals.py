#!/usr/bin/env python3
"""arrivals.py — drive test_arrivals under mpirun for the splits of the issue (1x1, 2x2, 4x1, a
dedicated 2x2), each with --deterministic, on a tiny model made by `k3 make-tiny`. Every run must
pass its own check (each request bit-identical alone vs with random arrivals) and every split must
print the same digest (tokens + logits of all requests): a sequence's result depends neither on
what shares its steps nor on the split.
usage: arrivals.py TEST_BIN MPIEXEC   (K3_BIN = the k3 binary)"""
import os
import re
import subprocess
import sys
import tempfile

K3 = os.environ["K3_BIN"]
test_bin, mpiexec = sys.argv[1], sys.argv[2]
splits = [(1, 1, "shared"), (2, 2, "shared"), (4, 1, "shared"), (2, 2, "dedicated")]
fails = []
with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
    digests = {}
    for S, E, coord in splits:
        world = S * E + (coord == "dedicated")
        p = subprocess.run([mpiexec, "-np", str(world), "--oversubscribe", test_bin, str(S), str(E), coord,
                            model, "20261130", "det"], capture_output=True, text=True, timeout=600)
        tag = f"{S}x{E} {coord}"
        print(p.stdout.strip()[-1500:])
        m = re.search(r"digest ([0-9a-f]+)", p.stdout)
        if p.returncode != 0 or not m:
            fails.append(f"{tag}: rc {p.returncode}\n{p.stderr[-2000:]}")
            continue
        digests[tag] = m.group(1)
    if len(set(digests.values())) > 1:
        fails.append(f"digests differ between splits: {digests}")
    elif len(digests) == len(splits):
        print(f"all {len(splits)} splits: the same digest {next(iter(digests.values()))}")
for f in fails:
    print("FAIL", f)
sys.exit(1 if fails else 0)
