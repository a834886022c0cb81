#!/usr/bin/env python3
"""bench-fork.py — issue 32's `n` > 1 fork, measured: the time to finish one `/v1/completions`
request with n choices (default 4, max_tokens 16, ignore_eos, seeded sampling) on a prompt of
random token ids (default 1000), against two `k3 serve` binaries one after the other — BEFORE (each
choice its own prefill) and AFTER (one prefill, the state forked) — on the same model and split.
Each repetition takes a new prompt (no prefix-cache hit between them), then an n = 1 request of
the same length gives the one-prefill floor. Prints a table and, with --output-json, the numbers;
reports whether both binaries gave the same choices (they must, with --deterministic: a forked
choice equals its request alone). A benchmark: the times are reported, never judged.
usage: scripts/bench-fork.py --before /work/main/build/k3 [--after build/k3] [--model /tmp/small]
       [--topology 1x1] [--prompt-len 1000] [--n 4] [--max-tokens 16] [--repeat 3] [--output-json F]
       [-- extra serve flags]"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("--before", required=True)
ap.add_argument("--after", default="build/k3")
ap.add_argument("--model", default="/tmp/small")
ap.add_argument("--topology", default="1x1")
ap.add_argument("--prompt-len", type=int, default=1000)
ap.add_argument("--n", type=int, default=4)
ap.add_argument("--max-tokens", type=int, default=16)
ap.add_argument("--repeat", type=int, default=3)
ap.add_argument("--output-json")
ap.add_argument("extra", nargs="*")
a = ap.parse_args()
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_orte_allowed_exit_without_sync="1")
PP, EP = map(int, a.topology.split("x"))


def start(k3):
    """The server of binary k3: (process, base url, rank 0's pid)."""
    log = tempfile.NamedTemporaryFile(prefix="k3_fork_bench_", suffix=".log", delete=False).name
    argv = [k3, "serve", "--model", a.model, "--port", "0", "--pp", str(PP), "--ep", str(EP),
            "--deterministic", "--served-model-name", "m"] + a.extra
    argv = (["mpirun", "-np", str(PP * EP), "--oversubscribe"] if PP * EP > 1 else []) + argv
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=ENV)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+) \(model \"[^\"]*\", pid (\d+)\)",
                          open(log, errors="replace").read())
        if found:
            return proc, found.group(1), int(found.group(2))
        time.sleep(0.2)
    sys.exit(f"{k3}: the server did not start:\n" + open(log, errors="replace").read()[-3000:])


def timed(url, ids, n):
    body = {"model": "m", "prompt": ids, "n": n, "max_tokens": a.max_tokens, "seed": 7,
            "temperature": 1.0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    d = json.load(urllib.request.urlopen(req, timeout=3600))
    return time.perf_counter() - t0, [c["text"] for c in d["choices"]]


prompts = [[random.Random(r).randrange(300, 30000) for _ in range(a.prompt_len)]
           for r in range(a.repeat)]
res = {}
for label, k3 in (("before", a.before), ("after", a.after)):
    proc, url, pid = start(k3)
    try:
        timed(url, [5, 6, 7], 1)  # warm-up
        runs = [timed(url, p, a.n) for p in prompts]
        floor = [timed(url, [x + 1 for x in p], 1)[0] for p in prompts]
    finally:
        os.kill(pid, 15)
        proc.wait(timeout=120)
    res[label] = {"n_s": [t for t, _ in runs], "median_n_s": statistics.median(t for t, _ in runs),
                  "median_n1_s": statistics.median(floor), "texts": [x for _, x in runs]}
same = res["before"]["texts"] == res["after"]["texts"]
print(f"model {a.model}, {a.topology}, prompt {a.prompt_len} tokens, n {a.n}, max_tokens "
      f"{a.max_tokens}, serve flags {' '.join(a.extra) or '-'}")
print(f"| binary | n = {a.n}: median s (each) | n = 1: median s |")
print("|---|---|---|")
for label in ("before", "after"):
    r = res[label]
    print(f"| {label} | {r['median_n_s']:.2f} ({', '.join(f'{t:.2f}' for t in r['n_s'])}) | "
          f"{r['median_n1_s']:.2f} |")
print(f"speed-up {res['before']['median_n_s'] / res['after']['median_n_s']:.2f}x; "
      f"the same choices from both: {same}")
if a.output_json:
    json.dump({"args": vars(a), "results": res, "same_choices": same}, open(a.output_json, "w"),
              indent=1)
