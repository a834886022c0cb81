#!/usr/bin/env python3
"""gpu_moe_ep.py — the device-routed expert-parallel MoE exchange (issue 45; label gpuemu in the
emulation build, gpu on a device). cuda + nccl, the tiny model made in a temp dir:
  1 x 4 (`mpirun -np 4 k3 run --ep 4 --comm nccl --op-stats`): a decode step's op count is the
      same with 1 sequence and with 16, for two different prompt sets (two routings), on every
      lane with decode steps, and each makes <= 1 host sync;
  capacity: 2 x 2 with K3_TEST_ROUTE_ONE_EXPERT=3 (every slot to expert 3), --max-batch-tokens 8
      and --max-seqs 2 (capacity min(8, max(ceil(8 x 4 x 2 / 16), min(8, 2))) = 4 rows per
      (sender, expert)), 4 prompts (2 a lane): the prefill round is host-routed (no capacity), so
      with --n 1 the run succeeds; with --n 2 the decode round's 2 tokens a lane give expert 3 8
      rows, and the run fails naming the layer, the expert and the capacity (never a silent
      drop), without hanging.
usage: gpu_moe_ep.py MPIEXEC   (K3_BIN = the k3 binary). Exit code only (77 = skipped)."""
import json
import os
import re
import subprocess
import sys

from k3_gpu_skip import run_on_tiny

K3 = os.environ.get("K3_BIN")
MPI = sys.argv[1] if len(sys.argv) > 1 else "mpirun"
fails = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        fails.append(msg)


def run(model, grid, prompts, extra, env=None, stats=None):
    cmd = [MPI, "-np", "4", "--oversubscribe", K3, "run", "--model", model, "--backend", "cuda",
           "--comm", "nccl"] + grid + ["--prompt-ids", prompts] + extra
    if stats:
        cmd += ["--op-stats", stats]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, **(env or {})))


def checks(tmp, model):
    sets = {"1 seq": "1,2,3",
            "16 seqs A": ";".join(",".join(str((i * 7 + j * 3) % 4000 + 1) for j in range(3))
                                  for i in range(16)),
            "16 seqs B": ";".join(",".join(str((i * 13 + j * 11) % 4000 + 5)
                                           for j in range(2 + i % 3)) for i in range(16))}
    ops = {}
    for name, prompts in sets.items():
        path = os.path.join(tmp, "s%d.json" % len(ops))
        p = run(model, ["--ep", "4"], prompts, ["--n", "3", "--ignore-eos"], stats=path)
        check(p.returncode == 0, "1x4 %s: exit %d %s" % (name, p.returncode, p.stderr[-800:]))
        if p.returncode:
            continue
        with open(path) as f:
            d = json.load(f)
        check(d.get("routing") == "device", "1x4 %s: routing %s" % (name, d.get("routing")))
        for e in d["stages"]:
            x = e["decode"]
            if not x["steps"]:
                continue
            ops.setdefault(name, set()).add(x["ops_per_step"])
            check(x["host_syncs_per_step"] <= 1, "1x4 %s r%d: %s host syncs a decode step"
                  % (name, e["rank"], x["host_syncs_per_step"]))
    counts = set().union(*ops.values()) if ops else set()
    check(len(ops) == len(sets) and len(counts) == 1,
          "1x4: decode ops per step the same for 1 and 16 sequences and both routings: %s"
          % ops)
    grid = ["--pp", "2", "--ep", "2", "--max-batch-tokens", "8", "--max-seqs", "2"]
    one = {"K3_TEST_ROUTE_ONE_EXPERT": "3"}
    p = run(model, grid, "1,2,3;9,8,7;4,5;6", ["--n", "1"], env=one)
    check(p.returncode == 0, "2x2, every slot to expert 3, prefill only (host-routed): exit %d "
          "%s" % (p.returncode, [l for l in p.stderr.splitlines() if " E] " in l][:1]))
    p = run(model, grid, "1,2,3;9,8,7;4,5;6", ["--n", "2"], env=one)
    check(p.returncode != 0 and re.search(r"layer 1: moe_experts: expert 3 received 8 rows, "
                                          r"over its capacity of 4 rows", p.stderr),
          "2x2, every slot to expert 3, a decode round: the overflow is named (exit %d) %s"
          % (p.returncode, [l for l in p.stderr.splitlines() if " E] " in l][:1]))


def main():
    return run_on_tiny("gpu_moe_ep", K3, checks, fails, nccl=True)


if __name__ == "__main__":
    sys.exit(main())
