#!/usr/bin/env python3
"""long_prompt.py — a prompt of ~4M tokens (a 6 MB chat request) whose caches and step buffers
cannot fit this machine is refused up front (issue 11, "the 1M-token prompt"): `k3 run --chat`
exits 1 within seconds with one line that names the model's max_position_embeddings and
--max-ctx (or, for a model that allows so many positions, the node's memory, the flags that size
the need (--max-ctx, --max-batch-tokens, --chunk) and the rank), and never grows (max RSS well
under 1 GB). The per-node memory refusal itself is tested by dist_load.
Skipped (77) on a machine with more than 48 GB available, where the prompt could fit.
usage: long_prompt.py   (K3_BIN = the k3 binary)"""
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

K3 = os.environ["K3_BIN"]
avail = 0
with open("/proc/meminfo") as f:
    for line in f:
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
if avail > 48 << 30:
    print(f"SKIP: {avail / 2**30:.0f} GB available: the long prompt could fit here")
    sys.exit(77)
with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
    req = os.path.join(tmp, "long.json")
    with open(req, "w") as f:
        json.dump({"messages": [{"role": "user", "content": "ab cd " * 1_000_000}], "max_tokens": 1}, f)
    # capacity for this one prompt (k3 run takes the engine's defaults, 4096 tokens a sequence,
    # which would refuse it as a request longer than --max-ctx, after the load): a sequence and a
    # step as long as the prompt, so the engine must refuse the sizes up front
    cap = ["--max-seqs", "1", "--max-ctx", str(1 << 22), "--max-batch-tokens", str(1 << 22)]
    t0 = time.time()
    p = subprocess.run([K3, "run", "--model", model, "--chat", req, *cap], capture_output=True, text=True,
                       timeout=120)
    dt = time.time() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    err = p.stderr.strip()
    lines = [l for l in err.splitlines() if not l.startswith("[k3 ")]
    # refused by the memory check (it names the flags that size the need and the rank), or, first,
    # because it is longer than the model's max_position_embeddings (2^20 for the tiny model)
    by_memory = "memory:" in err and "--chunk" in err and "rank 0" in err
    by_positions = "exceeds the model's max_position_embeddings 1048576" in err
    ok = (p.returncode == 1 and len(lines) == 1 and "--max-ctx" in err and (by_memory or by_positions)
          and dt < 30 and rss_mb < 1024)
    print(f"exit {p.returncode} in {dt:.1f} s, max RSS {rss_mb:.0f} MB: {lines[:1]}")
    print("long_prompt:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)
