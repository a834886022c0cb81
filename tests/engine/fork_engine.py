#!/usr/bin/env python3
"""fork_engine.py — drive test_fork_engine under mpirun (issue 32): n > 1 choices fork one prefill.
Runs 1x1 and 2x2 (--deterministic) with the prefix cache on and off, with chunked KDA (16), and
with a paged cache of 9 blocks a lane (the prefix cache must evict to make room for forks).
Every run must pass its own checks (each forked choice bit-identical to its request alone, one
prefill per family, no block left reserved or leaked) and the runs of one KDA form must print the
same digest of every token and logits row.
usage: fork_engine.py TEST_BIN MPIEXEC   (K3_BIN = the k3 binary)"""
import os
import re
import subprocess
import sys
import tempfile

K3 = os.environ["K3_BIN"]
test_bin, mpiexec = sys.argv[1], sys.argv[2]
runs = [(1, 1, "on", "0"), (1, 1, "off", "0"), (2, 2, "on", "0"), (2, 2, "off", "0"),
        (1, 1, "off", "16"), (2, 2, "on", "16"),
        (1, 1, "on", "0", "576"), (2, 2, "on", "0", "576")]  # 9 blocks a lane: evictions
fails, digests = [], {}
with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
    for S, E, mode, chunk, *kv in runs:
        tag = f"{S}x{E} cache {mode} kda_chunk {chunk}" + (f" kv {kv[0]}" if kv else "")
        p = subprocess.run([mpiexec, "-np", str(S * E), "--oversubscribe", test_bin, str(S), str(E),
                            model, mode, chunk] + kv, capture_output=True, text=True, timeout=300)
        print(tag + ":\n" + p.stdout.strip()[-1200:])
        m = re.search(r"digest ([0-9a-f]+)", p.stdout)
        if p.returncode != 0 or not m:
            fails.append(f"{tag}: rc {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-2000:]}")
            continue
        digests.setdefault(chunk, {})[tag] = m.group(1)
for chunk, d in digests.items():
    if len(set(d.values())) > 1:
        fails.append(f"kda_chunk {chunk}: digests differ: {d}")
for f in fails:
    print("FAIL", f)
if not fails:
    print(f"all {len(runs)} runs passed; digests {digests}")
sys.exit(1 if fails else 0)
