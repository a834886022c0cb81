#!/usr/bin/env python3
"""arrivals.py — drive test_arrivals under mpirun for the splits of the issue (1x1, 2x2, 4x1, a
dedicated 2x2, and 2x2 with a paged cache of 384 tokens a lane), each with --deterministic, on a tiny model made by `k3 make-tiny`. Every run must
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
# the last: a paged cache of 384 tokens a lane (6 blocks) instead of 6 slots x 320: requests
# also wait for cache blocks, with the same results
splits = [(1, 1, "shared", None), (2, 2, "shared", None), (4, 1, "shared", None),
          (2, 2, "dedicated", None), (2, 2, "shared", 384)]
fails = []
with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
    digests = {}
    for S, E, coord, kv in splits:
        world = S * E + (coord == "dedicated")
        p = subprocess.run([mpiexec, "-np", str(world), "--oversubscribe", test_bin, str(S), str(E), coord,
                            model, "20261130", "det"] + ([str(kv)] if kv else []),
                           capture_output=True, text=True, timeout=600)
        tag = f"{S}x{E} {coord}" + (f" kv {kv}" if kv else "")
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
