#!/usr/bin/env python3
"""plan_rss.py — `k3 plan`'s per-rank memory prediction for the tiny model on 2 x 2 against what
`k3 run` really grows to: each rank's peak RSS in a run that fills every sequence slot (64 per
lane, each prompt as long as --max-ctx allows, so every cache page is touched) less its peak RSS
in the same job refused in set-up before it allocates anything (a --max-ctx beyond the model:
MPI, the config, the host exchange and the binding are all that ran). Every rank must be within
10% of k3_rank_mem_total (weights + caches + comm buffers + workspace).
usage: plan_rss.py MPIEXEC   (K3_BIN = the k3 binary)"""
import json
import os
import random
import re
import subprocess
import sys
import tempfile

K3 = os.environ["K3_BIN"]
MPIEXEC = sys.argv[1] if len(sys.argv) > 1 else "mpirun"
SEQS, CTX, TOKENS, P = 64, 111, 256, 110  # slots per lane, tokens per slot, per step, prompt
# The wrapper outlives mpirun's SIGTERM of the job (k3's abort of a refused run): a Python
# handler, not SIG_IGN, so k3 (exec'd with the default action) still dies of it, and the wrapper
# prints its child's peak before it goes.
WRAP = """import os, resource, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: None)
p = subprocess.run(sys.argv[1:])
print(f"RSS rank {os.environ.get('OMPI_COMM_WORLD_RANK')} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}", file=sys.stderr)
sys.exit(p.returncode)
"""


def ranks_rss(args, want_rc):
    """Peak RSS (bytes) of each rank of `mpirun -np 4 k3 run ARGS` (a wrapper reads the child's)."""
    cmd = [MPIEXEC, "--oversubscribe", "-np", "4", sys.executable, wrap, K3, "run", *args]
    # a run that must fail: mpirun must not kill the other ranks at the first non-zero exit, or a
    # wrapper killed before it printed loses that rank's line (seen in CI: ranks [0, 1, 3]). The
    # refused job still ends by k3's abort of every rank, which can take a wrapper with it before
    # it prints (the wrapper now outlives the SIGTERM; SIGKILL could still come first): such a run
    # measured nothing, and is made again (at most 3 times).
    env = dict(os.environ, OMPI_MCA_orte_abort_non_zero_exit="0") if want_rc else None
    for attempt in range(3 if want_rc else 1):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
        if (p.returncode != 0) != (want_rc != 0):
            print(p.stderr[-3000:])
            sys.exit(f"FAIL: k3 run exited {p.returncode}, want {want_rc}")
        rss = {int(m[0]): int(m[1]) * 1024 for m in re.findall(r"RSS rank (\d+) (\d+)", p.stderr)}
        if sorted(rss) == [0, 1, 2, 3]:
            return rss
        print(f"run {attempt + 1}: RSS lines of ranks {sorted(rss)} only (a wrapper was killed)")
    print(p.stderr[-3000:])
    sys.exit(f"FAIL: RSS of ranks {sorted(rss)}")


with tempfile.TemporaryDirectory() as tmp:
    wrap = os.path.join(tmp, "rss.py")
    open(wrap, "w").write(WRAP)
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
    seed = 7
    print(f"seed {seed}")
    rng = random.Random(seed)
    # 2 lanes x SEQS prompts of P ids (short ids: the whole list is one argument < 128 KB)
    prompts = ";".join(",".join(str(rng.randrange(10, 1000)) for _ in range(P)) for _ in range(2 * SEQS))
    cap = ["--max-seqs", str(SEQS), "--max-ctx", str(CTX), "--max-batch-tokens", str(TOKENS)]
    grid = ["--model", model, "--pp", "2", "--ep", "2"]
    plan = json.loads(subprocess.run([K3, "plan", *grid, *cap, "--json"], check=True,
                                     capture_output=True, text=True).stdout)
    pred = {r["rank"]: r["memory"]["total"] for r in plan["ranks"]}
    # the baseline: the same job refused in set-up (a --max-ctx beyond the model's positions),
    # after MPI, the config, the host exchange and the binding, before any allocation
    base = ranks_rss([*grid, "--prompt-ids", "1,2", "--n", "1", "--max-seqs", str(SEQS),
                      "--max-ctx", str(1 << 30)], 2)
    full = ranks_rss([*grid, *cap, "--prompt-ids", prompts, "--n", "1"], 0)
    fails = []
    print(" rank  predicted MB  RSS growth MB   diff")
    for r in range(4):
        grow = full[r] - base[r]
        d = (grow - pred[r]) / pred[r]
        print(f" {r:4d}  {pred[r] / 1e6:12.2f}  {grow / 1e6:13.2f}  {d * 100:+5.1f}%")
        if abs(d) > 0.10:
            fails.append(f"rank {r}: {d * 100:+.1f}%")
    # not degenerate: the prediction is far above what the baseline run held
    if min(pred.values()) < 10e6:
        fails.append("the predicted need is too small to measure")
print("plan_rss:", "PASS" if not fails else "FAIL: " + "; ".join(fails))
sys.exit(1 if fails else 0)
