#!/usr/bin/env python3
"""gpu_opstats.py — `--op-stats` of the cuda backend with the nccl transport (issue 45; label
gpuemu in the emulation build, gpu on a device).

usage: gpu_opstats.py MPIEXEC   (K3_BIN = the k3 binary; a tiny model is made in a temp dir)
  mpirun -np 4 `k3 run --backend cuda --pp 2 --ep 2 --comm nccl --op-stats s.json`, 2 prompts:
    - every worker rank's decode and prefill carry ops_per_step, host_syncs_per_step,
      comm_host_syncs_per_step and graph_launches_per_step;
    - routed on the device (issue 45): every stage's decode makes <= 1 host sync (the step's one
      read: flags, deferred checks, and the logits on the last stage) and no NCCL wait on the
      stream (comm_host_syncs_per_step 0: a watcher thread times the NCCL work);
    - "comm" is "nccl", "routing" "device" and "routing_note" says why (decode rounds on the
      device, prefill rounds host-routed).
    - its logits (dumped; no --deterministic: the pre-summed combine of the host-routed
      prefill) are within K3_TOL_DISTRIBUTED_REL_L2 (rel-L2) of `k3 run --backend cpu` on one
      rank, and its greedy tokens identical (gpu_model.py's 2x2 runs --deterministic).
  The same with K3_MOE_HOST_ROUTE=1 (the host-routed exchange): routing "host", and the
  transport's own waits are counted (stage 0: 0 < comm_host_syncs_per_step <= host syncs).
  The same with --comm mpi: comm_host_syncs_per_step == 0 (its syncs are the backend's
  downloads), "comm" "mpi", a routing_note starting "mpi: ".
  1 x 1 (`k3 run --backend cuda`): a decode step's host sync is the step's one read (flags with
  the deferred checks and the logits): moe_experts routes on the device and its check, the
  router's and the embedding's (moe_topk, embed_rows) are deferred and make none. With
  K3_TEST_ROUTE_ONE_EXPERT=3 (every slot to expert 3) the first MoE layer's expert 3 gets 32
  rows, over its capacity of 8 (one per token): the run fails naming layer, expert, capacity.
Exit code only (77 = skipped: no cuda build / device)."""
import json
import os
import re
import subprocess
import sys

import numpy as np

from k3_gpu_skip import run_on_tiny

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_tolerances import TOL  # noqa: E402

K3 = os.environ.get("K3_BIN")
MPI = sys.argv[1] if len(sys.argv) > 1 else "mpirun"
PROMPTS = "1,2,3,4,5;9,8,7"
DIST_TOL = TOL["K3_TOL_DISTRIBUTED_REL_L2"]
fails = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        fails.append(msg)


def stats(tmp, model, comm, np_=4, env=None, tag="", dump=None):
    """--op-stats of a cuda run (with dump: its logits too, and its --json as "json")."""
    path = os.path.join(tmp, comm + str(np_) + tag + ".json")
    grid = ["--pp", "2", "--ep", "2", "--comm", comm] if np_ > 1 else []
    cmd = ([MPI, "-np", str(np_), "--oversubscribe"] if np_ > 1 else []) + [
        K3, "run", "--model", model, "--backend", "cuda"] + grid + [
        "--prompt-ids", PROMPTS, "--n", "4", "--ignore-eos", "--op-stats", path]
    cmd += ["--dump-logits", dump, "--json"] if dump else []
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, **(env or {})))
    check(p.returncode == 0, "%s: exit %d %s" % (" ".join(cmd[-14:]), p.returncode,
                                                 p.stderr[-1500:]))
    if p.returncode != 0:
        return None
    with open(path) as f:
        d = json.load(f)
    if dump:
        d["json"] = json.loads(p.stdout)
    return d


def cpu_ref(tmp, model):
    """`k3 run --backend cpu` on one rank: (logits, greedy tokens) or None."""
    npy = os.path.join(tmp, "cpu.npy")
    p = subprocess.run([K3, "run", "--model", model, "--backend", "cpu", "--prompt-ids", PROMPTS,
                        "--n", "4", "--ignore-eos", "--dump-logits", npy, "--json"],
                       capture_output=True, text=True, timeout=240)
    check(p.returncode == 0, "cpu reference: exit %d %s" % (p.returncode, p.stderr[-1500:]))
    if p.returncode != 0:
        return None
    return np.load(npy), [o["generated_ids"] for o in json.loads(p.stdout)["results"]]


def checks(tmp, model):
    keys = ["ops_per_step", "host_syncs_per_step", "comm_host_syncs_per_step",
            "graph_launches_per_step"]
    # nccl + cuda: routed on the device; the step's one read is its only host sync
    npy = os.path.join(tmp, "nccl4.npy")
    d = stats(tmp, model, "nccl", dump=npy)
    ref = cpu_ref(tmp, model)
    if d and ref:
        # without --deterministic (the pre-summed combine in the host-routed prefill rounds)
        got, want = np.load(npy).astype(np.float64), ref[0].astype(np.float64)
        r = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)) \
            if got.shape == want.shape else float("inf")
        check(r <= DIST_TOL, "nccl 2x2 vs cpu: logits rel-L2 %.3g (limit %g)" % (r, DIST_TOL))
        toks = [o["generated_ids"] for o in d["json"]["results"]]
        check(toks == ref[1], "nccl 2x2 vs cpu: greedy tokens identical")
    if d:
        check(d.get("comm") == "nccl" and d.get("routing") == "device"
              and d.get("routing_note", "").startswith("nccl: decode rounds routed on the "
                                                       "device")
              and "Prefill rounds" in d.get("routing_note", "")
              and "host-routed" in d.get("routing_note", ""),
              "nccl: comm, routing and its note: %s %s" % (d.get("comm"), d.get("routing")))
        for stage in (0, 1):
            busy = [e for e in d["stages"] if e["stage"] == stage and e["decode"]["steps"]]
            check(len(busy) > 0, "nccl: stage %d has decode steps" % stage)
            for e in busy:
                for ph in ("decode", "prefill"):
                    x = e[ph]
                    check(all(k in x for k in keys), "nccl r%d %s: has %s" % (e["rank"], ph,
                                                                              keys))
                x = e["decode"]
                check(x["host_syncs_per_step"] <= 1 and x["comm_host_syncs_per_step"] == 0,
                      "nccl r%d decode: %s host syncs (<= 1: the step's one read), %s of them "
                      "NCCL waits (0: a watcher thread times them)"
                      % (e["rank"], x["host_syncs_per_step"], x["comm_host_syncs_per_step"]))
                print("     r%d s%d e%d decode: ops %s, host syncs %s (transport %s), graph "
                      "launches %s" % (e["rank"], e["stage"], e["lane"], x["ops_per_step"],
                                       x["host_syncs_per_step"],
                                       x["comm_host_syncs_per_step"],
                                       x["graph_launches_per_step"]), flush=True)
    # K3_MOE_HOST_ROUTE=1: the host-routed exchange, whose NCCL waits poll and are counted
    d = stats(tmp, model, "nccl", env={"K3_MOE_HOST_ROUTE": "1"}, tag="host")
    if d:
        check(d.get("routing") == "host", "nccl, K3_MOE_HOST_ROUTE=1: routing host")
        for e in d["stages"]:
            x = e["decode"]
            if x["steps"] and e["stage"] == 0:
                check(0 < x["comm_host_syncs_per_step"] <= x["host_syncs_per_step"],
                      "nccl host-routed r%d decode: the transport's waits counted: %s of %s "
                      "host syncs" % (e["rank"], x["comm_host_syncs_per_step"],
                                      x["host_syncs_per_step"]))
    d = stats(tmp, model, "nccl", 1)
    if d:
        x = d["stages"][0]["decode"]
        check(x["steps"] > 0 and x["host_syncs_per_step"] == 1
              and x["ops"].get("moe_experts", 0) > 0,
              "1x1 decode: %s host syncs = 1 (flags + deferred checks + logits), none in its "
              "%s moe_experts, %s moe_topk, %s embed_rows (routed on the device, checks "
              "deferred)" % (x["host_syncs_per_step"], x["ops"].get("moe_experts", 0),
                             x["ops"].get("moe_topk", 0), x["ops"].get("embed_rows", 0)))
    # the capacity of the device route: every slot to expert 3 (K3_TEST_ROUTE_ONE_EXPERT)
    # overflows the first MoE layer's; the step fails naming layer, expert and capacity
    p = subprocess.run([K3, "run", "--model", model, "--backend", "cuda", "--prompt-ids",
                        "1,2,3,4,5;9,8,7", "--n", "2"], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, K3_TEST_ROUTE_ONE_EXPERT="3"))
    check(p.returncode != 0 and re.search(r"layer 1: moe_experts: expert 3 received 32 rows, "
                                          r"over its capacity of 8 rows", p.stderr),
          "1x1, every slot to expert 3: the overflow is named (exit %d) %s"
          % (p.returncode, p.stderr.strip().splitlines()[-1:] if p.stderr else ""))
    d = stats(tmp, model, "mpi")
    if d:
        check(d.get("comm") == "mpi" and d.get("routing") == "host"
              and d.get("routing_note", "").startswith("mpi: "),
              "mpi: comm, routing and why its counts differ")
        for e in d["stages"]:
            check(e["decode"]["comm_host_syncs_per_step"] == 0,
                  "mpi r%d: no transport waits on a stream" % e["rank"])


def main():
    return run_on_tiny("gpu_opstats", K3, checks, fails, nccl=True)


if __name__ == "__main__":
    sys.exit(main())
