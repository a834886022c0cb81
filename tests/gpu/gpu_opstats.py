#!/usr/bin/env python3
"""gpu_opstats.py — `--op-stats` of the cuda backend with the nccl transport (issue 45; label
gpuemu in the emulation build, gpu on a device).

usage: gpu_opstats.py MPIEXEC   (K3_BIN = the k3 binary; a tiny model is made in a temp dir)
  mpirun -np 4 `k3 run --backend cuda --pp 2 --ep 2 --comm nccl --op-stats s.json`, 2 prompts:
    - every worker rank's decode and prefill carry ops_per_step, host_syncs_per_step,
      comm_host_syncs_per_step and graph_launches_per_step;
    - the transport's own waits are counted: each stage's decode has comm_host_syncs_per_step
      > 0 (the NCCL waits of its MoE exchanges and stage hand-offs) and <= host_syncs_per_step;
    - "comm" is "nccl", "routing" says where the route is built and "routing_note" says why.
  The same with --comm mpi: comm_host_syncs_per_step == 0 (its syncs are the backend's
  downloads), "comm" "mpi", a routing_note starting "mpi: ".
  1 x 1 (`k3 run --backend cuda --cuda-graphs off`: the eager step; gpu_graphs checks the
  captured one): a decode step's host syncs are the step's two reads (flags
  with the deferred checks, logits): moe_experts routes on the device and its check, the
  router's and the embedding's (moe_topk, embed_rows) are deferred and make none. With
  K3_TEST_ROUTE_ONE_EXPERT=3 (every slot to expert 3) the first MoE layer's expert 3 gets 32
  rows, over its capacity of 8 (one per token): the run fails naming layer, expert, capacity.
Exit code only (77 = skipped: no cuda build / device)."""
import json
import os
import re
import subprocess
import sys
import tempfile

K3 = os.environ.get("K3_BIN")
MPI = sys.argv[1] if len(sys.argv) > 1 else "mpirun"
fails = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        fails.append(msg)


def stats(tmp, model, comm, np_=4, extra=()):
    path = os.path.join(tmp, comm + str(np_) + ".json")
    grid = ["--pp", "2", "--ep", "2", "--comm", comm] if np_ > 1 else []
    cmd = ([MPI, "-np", str(np_), "--oversubscribe"] if np_ > 1 else []) + [
        K3, "run", "--model", model, "--backend", "cuda"] + grid + [
        "--prompt-ids", "1,2,3,4,5;9,8,7", "--n", "4", "--ignore-eos", "--op-stats", path] + list(
        extra)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    check(p.returncode == 0, "%s: exit %d %s" % (" ".join(cmd[-14:]), p.returncode,
                                                 p.stderr[-1500:]))
    if p.returncode != 0:
        return None
    with open(path) as f:
        return json.load(f)


def main():
    if not K3:
        print("FAIL: K3_BIN is not set")
        return 1
    v = subprocess.run([K3, "version"], capture_output=True, text=True)
    if "cuda" not in v.stdout + v.stderr or "nccl" not in v.stdout + v.stderr:
        print("SKIP: this k3 has no cuda backend or nccl transport")
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "tiny")
        subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
        keys = ["ops_per_step", "host_syncs_per_step", "comm_host_syncs_per_step",
                "graph_launches_per_step"]
        d = stats(tmp, model, "nccl")
        if d:
            check(d.get("comm") == "nccl" and d.get("routing") in ("host", "device")
                  and d.get("routing_note", "").startswith("nccl: "),
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
                    check(0 < x["comm_host_syncs_per_step"] <= x["host_syncs_per_step"],
                          "nccl r%d decode: the transport's waits counted: %s of %s host syncs"
                          % (e["rank"], x["comm_host_syncs_per_step"], x["host_syncs_per_step"]))
                    print("     r%d s%d e%d decode: ops %s, host syncs %s (transport %s), graph "
                          "launches %s" % (e["rank"], e["stage"], e["lane"], x["ops_per_step"],
                                           x["host_syncs_per_step"],
                                           x["comm_host_syncs_per_step"],
                                           x["graph_launches_per_step"]), flush=True)
        # the eager step's reads (with graphs on, a MoE layer's read fails the capture of a decode
        # step's first size, which then runs eagerly: gpu_graphs checks that path)
        d = stats(tmp, model, "nccl", 1, ["--cuda-graphs", "off"])
        if d:
            x = d["stages"][0]["decode"]
            check(x["steps"] > 0 and x["host_syncs_per_step"] == 2
                  and x["ops"].get("moe_experts", 0) > 0,
                  "1x1 decode: %s host syncs = 2 (flags + deferred checks, logits), none in its "
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
    print("gpu_opstats: %s" % ("FAIL (%d)" % len(fails) if fails else "ok"), flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
