#!/usr/bin/env python3
"""gpu_moe_skew.py — a skewed prompt on the device-routed MoE exchange (issue 45 follow-up; label
gpuemu in the emulation build, gpu on a device). cuda + nccl, the tiny model made in a temp dir,
--max-batch-tokens 16, --deterministic:
  2 x 2 (`mpirun -np 4 k3 run --pp 2 --ep 2 --comm nccl`) with a prompt of 16 copies of one id
  (every token picks the same K experts: 16 rows to each of them, over the capacity rule's
  min(16, ceil(16 x 4 x 2 / 16)) = 8 rows) and a second ordinary prompt: the run succeeds (the
  prefill round is host-routed, the decode rounds device-routed; never an overflow abort), and its
  logits dump is byte-identical to 1 x 1 cuda's; --op-stats says routing "device" with decode
  graph_launches_per_step 1 and <= 1 host sync on every stage.
  A full decode batch of identical sequences: 20 copies of a 2-token prompt, --max-seqs 16,
  --max-batch-tokens 32 and K3_MOE_CAPACITY_FACTOR=1 (10 sequences a lane, prefilled in one
  round; every decode token of a lane picks the same K experts: 10 rows each, over the rule's
  min(32, ceil(32 x 4 x 1 / 16)) = 8): the device route's capacity is at least min(T_max,
  max_seqs) = 16 rows, so the decode rounds never overflow: exit 0, byte-identical to 1 x 1,
  every decode step one graph launch and no capture fallback (each lane's first device-routed
  step is captured: its expert tables were built at create, not in the host-routed prefill).
usage: gpu_moe_skew.py MPIEXEC   (K3_BIN = the k3 binary). Exit code only (77 = skipped)."""
import filecmp
import json
import os
import subprocess
import sys

from k3_gpu_skip import run_on_tiny

K3 = os.environ.get("K3_BIN")
MPI = sys.argv[1] if len(sys.argv) > 1 else "mpirun"
PROMPTS = ",".join(["7"] * 16) + ";1,2,3"
fails = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        fails.append(msg)


def run(tmp, model, tag, grid, prompts=PROMPTS, extra=(), env=None):
    npy, js = os.path.join(tmp, tag + ".npy"), os.path.join(tmp, tag + ".json")
    pre = [MPI, "-np", "4", "--oversubscribe"] if grid else []
    cmd = pre + [K3, "run", "--model", model, "--backend", "cuda"] + grid + [
        "--prompt-ids", prompts, "--n", "4", "--ignore-eos", "--deterministic",
        "--dump-logits", npy, "--op-stats", js] + list(extra or ["--max-batch-tokens", "16"])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, **(env or {})))
    err = [l for l in p.stderr.splitlines() if " E] " in l][:2] or p.stderr[-600:]
    check(p.returncode == 0, "%s: exit %d %s" % (tag, p.returncode, err if p.returncode else ""))
    if p.returncode != 0:
        return None
    with open(js) as f:
        return npy, json.load(f)


def checks(tmp, model):
    one = run(tmp, model, "1x1", [])
    two = run(tmp, model, "2x2", ["--pp", "2", "--ep", "2", "--comm", "nccl"])
    check(one is not None and two is not None and filecmp.cmp(one[0], two[0], shallow=False),
          "2x2 nccl, 16 identical tokens: logits byte-identical to 1x1 cuda")
    if two:
        d = two[1]
        check(d.get("routing") == "device", "2x2: routing %s" % d.get("routing"))
        for e in d["stages"]:
            x = e["decode"]
            if not x["steps"]:
                continue
            check(x["graph_launches_per_step"] == 1 and x["host_syncs_per_step"] <= 1,
                  "2x2 r%d: decode %s graph launches, %s host syncs a step" % (
                      e["rank"], x["graph_launches_per_step"], x["host_syncs_per_step"]))
    same, big = ";".join(["7,7"] * 20), ["--max-seqs", "16", "--max-batch-tokens", "32"]
    one = run(tmp, model, "1x1 batch", [], same, big)
    two = run(tmp, model, "2x2 batch", ["--pp", "2", "--ep", "2", "--comm", "nccl"], same, big,
              {"K3_MOE_CAPACITY_FACTOR": "1"})
    check(one is not None and two is not None and filecmp.cmp(one[0], two[0], shallow=False),
          "2x2 nccl, 20 identical sequences: logits byte-identical to 1x1 cuda")
    if two:  # each lane's first device-routed step captured (its expert tables built before)
        for e in two[1]["stages"]:
            x = e["decode"]
            check(x["graph_fallbacks"] == 0 and (not x["steps"]
                                                 or x["graph_launches_per_step"] == 1),
                  "2x2 batch r%d: decode %s graph launches a step, %s fallbacks" % (
                      e["rank"], x["graph_launches_per_step"], x["graph_fallbacks"]))


def main():
    return run_on_tiny("gpu_moe_skew", K3, checks, fails, nccl=True)


if __name__ == "__main__":
    sys.exit(main())
