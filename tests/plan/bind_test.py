#!/usr/bin/env python3
"""bind_test.py — hwloc binding at run time (host/bind.c): every rank reports one binding line at
start-up; one process takes every core (threads = cores); 4 ranks on this node split its cores
(more ranks than cores: each rank's share is every core, one thread each, and the run says it
is oversubscribed); a binding the launcher made that does not hold the share is kept (taskset);
--bind none binds nothing; `k3 plan` on a cpu site shows the same cores the run binds; a bad
--bind is a usage error.   usage: bind_test.py MPIEXEC   (K3_BIN = the k3 binary)"""
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

K3 = os.environ["K3_BIN"]
MPIEXEC = sys.argv[1] if len(sys.argv) > 1 else "mpirun"
fails = []
LINE = re.compile(r"bind: rank (\d+) \(local (\d+) of (\d+) on [^)]*\): (?:cores (\S+), NUMA (\S+), "
                  r"(\d+) threads?|none)")


last_err = [""]


def binds(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    last_err[0] = p.stderr
    if p.returncode != 0:
        fails.append(f"{' '.join(cmd[:6])}...: exit {p.returncode}: {p.stderr[-800:]}")
    got = {}
    for m in LINE.finditer(p.stderr):
        r = int(m[1])
        if r in got:
            fails.append(f"rank {r} reported its binding twice")
        got[r] = (int(m[2]), int(m[3]), m[4], int(m[6]) if m[6] else None)
    return got


def cores_of(spec):  # hwloc list syntax "0-3,8" -> set
    out = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


n_cores = len(os.sched_getaffinity(0))
with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
    run = [K3, "run", "--model", model, "--prompt-ids", "1,2,3", "--n", "2"]
    one = binds(run)
    if list(one) != [0] or cores_of(one[0][2]) != set(os.sched_getaffinity(0)) or one[0][3] != n_cores:
        fails.append(f"one process: {one}, want every core ({n_cores}) and {n_cores} threads")
    mpi = [MPIEXEC, "--oversubscribe", "-np", "4"]
    four = binds(mpi + run + ["--pp", "2", "--ep", "2"])
    four_err = last_err[0]
    print(f"{n_cores} cores; 4 ranks: {four}")
    if sorted(four) != [0, 1, 2, 3]:
        fails.append(f"4 ranks: binding lines of ranks {sorted(four)}")
    else:
        shares = [cores_of(four[r][2]) for r in range(4)]
        for r in range(4):
            loc, n_loc, _, thr = four[r]
            want_thr = 1 if n_cores < 4 else len(shares[r])
            if n_loc != 4 or thr != want_thr:
                fails.append(f"rank {r}: local {loc} of {n_loc}, {thr} threads for {len(shares[r])} cores")
        if n_cores < 4 and any(s != set(os.sched_getaffinity(0)) for s in shares):
            fails.append(f"more ranks than cores: each rank should have every core: {shares}")
        if n_cores < 4 and four_err.count("oversubscribed: waits sleep at once") != 4:
            fails.append("more ranks than cores: not every rank says it is oversubscribed")
        if n_cores >= 4 and any(a & b for i, a in enumerate(shares) for b in shares[i + 1:]):
            fails.append(f"enough cores, yet shares overlap: {shares}")
        if set().union(*shares) != set(os.sched_getaffinity(0)):
            fails.append(f"the shares do not cover the node's cores: {shares}")
        # `k3 plan` shows the cores the run binds, rank by rank
        plan = json.loads(subprocess.run(
            [K3, "plan", "--model", model, "--nodes", "1", "--gpus-per-node", "4", "--gpu", "cpu",
             "--pp", "2", "--ep", "2", "--json"], check=True, capture_output=True, text=True).stdout)
        for r in plan["ranks"]:
            if cores_of(r["cores"]) != shares[r["rank"]]:
                fails.append(f"plan says rank {r['rank']} gets cores {r['cores']}, the run bound {four[r['rank']][2]}")
    # issue 34: on several nodes the cores are this machine's, and the plan says so (text, JSON)
    multi = [K3, "plan", "--model", model, "--nodes", "2", "--gpus-per-node", "2", "--gpu", "cpu",
             "--pp", "2", "--ep", "2"]
    text = subprocess.run(multi, check=True, capture_output=True, text=True).stdout
    host = socket.gethostname()
    if "hwloc binds each local rank on this machine, %s, repeated for every node" % host not in text:
        fails.append("a 2-node plan does not say its cores are this machine's")
    js = json.loads(subprocess.run(multi + ["--json"], check=True, capture_output=True, text=True).stdout)
    if js.get("cores_numa_of_host") != host:
        fails.append(f"plan --json: cores_numa_of_host {js.get('cores_numa_of_host')!r}, want {host!r}")
    none = binds(mpi[:3] + ["2"] + run + ["--ep", "2", "--bind", "none"])
    if sorted(none) != [0, 1] or any(v[2] is not None for v in none.values()):
        fails.append(f"--bind none: {none}")
    # a launcher's binding that does not hold the share (all cores for one process) is kept
    if n_cores >= 2:
        kept = subprocess.run(["taskset", "-c", "1"] + run, capture_output=True, text=True)
        m = LINE.search(kept.stderr)
        if not (m and m[4] == "1" and m[6] == "1" and "binding, kept" in kept.stderr):
            fails.append(f"taskset -c 1: {m[0] if m else kept.stderr[-300:]}")
    p = subprocess.run(run + ["--bind", "numa"], capture_output=True, text=True)
    if p.returncode != 2 or "--bind" not in p.stderr:
        fails.append(f"--bind numa: exit {p.returncode}: {p.stderr.strip()}")
print("bind_test:", "PASS" if not fails else "FAIL: " + "; ".join(fails))
sys.exit(1 if fails else 0)
