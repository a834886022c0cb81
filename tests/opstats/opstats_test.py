#!/usr/bin/env python3
"""opstats_test.py — `--op-stats FILE.json` end to end (k3 run, k3 bench throughput).

usage: opstats_test.py MODE [MPIEXEC]     (K3_BIN = the k3 binary)
  unit : one process on a tiny model:
         - `k3 run --backend guard --prompt-ids 1,2,3 --n 4 --op-stats s.json` exits 0 and the
           file has decode (3 steps: 4 tokens, the first from the prefill) and prefill (1 step),
           each with ops_per_step > 0 equal to the sum of its "ops", host syncs per step <= the
           max, host_device_bytes = h2d + d2h; no idle step; the top-level decode / prefill equal
           the one stage entry's; every op name is one of k3's;
         - `k3 bench throughput --backend guard ... --op-stats` writes the same shape;
         - --backend cpu (and ref) with --op-stats exits 2 with one line naming --op-stats and
           saying to use --backend guard, and writes no file;
         - an unwritable FILE fails the run (exit 1) naming it;
         - on `make-tiny --preset deep` (K3's 93 layers): a decode step issues the same op calls
           with 1 sequence and with 12, and at most 2 host syncs; a prefill step opening 1
           sequence and one opening 12 issue the same op calls.
  mpi  : mpirun -np 4 `k3 run --pp 2 --ep 2` with one prompt: one entry per worker rank with its
         (stage, lane) and layers; comm "mpi", routing "host" and a routing_note saying why; the lane without the sequence has idle steps and no decode
         steps; no top-level decode (several stages); --backend cpu is refused on every rank
         (exit 2, one line).
Exit code only; prints one line per check."""
import json
import os
import subprocess
import sys
import tempfile

K3 = os.environ.get("K3_BIN")
fails = []
OPS = None  # k3's op names, from a run (every op the guard backend counted must be a known name)


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        fails.append(msg)


def k3(args, mpi=None, np_=1, timeout=180):
    cmd = ([mpi, "-np", str(np_), "--oversubscribe"] if mpi else []) + [K3] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def phase_ok(name, ph, want_steps=None):
    """One phase object: the per-step figures agree with each other."""
    keys = ["steps", "ops_per_step", "host_syncs_per_step", "host_syncs_max_per_step",
            "comm_host_syncs_per_step", "graph_launches_per_step",
            "host_device_bytes_per_step", "h2d_bytes_per_step", "d2h_bytes_per_step", "ops"]
    missing = [k for k in keys if k not in ph]
    check(not missing, "%s: has every key (missing %s)" % (name, missing))
    if missing:
        return
    if want_steps is not None:
        check(ph["steps"] == want_steps, "%s: %s steps (want %s)" % (name, ph["steps"], want_steps))
    if ph["steps"] == 0:
        check(ph["ops_per_step"] == 0 and ph["ops"] == {}, "%s: no steps, no ops" % name)
        return
    s = sum(ph["ops"].values())
    check(ph["ops_per_step"] > 0 and abs(s - ph["ops_per_step"]) <= 1e-9 * max(1, s),
          "%s: ops_per_step %s > 0 = the sum of its ops %s" % (name, ph["ops_per_step"], s))
    check(ph["host_syncs_per_step"] <= ph["host_syncs_max_per_step"],
          "%s: host syncs per step %s <= max %s" % (name, ph["host_syncs_per_step"],
                                                   ph["host_syncs_max_per_step"]))
    check(0 <= ph["comm_host_syncs_per_step"] <= ph["host_syncs_per_step"],
          "%s: the transport's host syncs %s are part of the %s" % (
              name, ph["comm_host_syncs_per_step"], ph["host_syncs_per_step"]))
    check(ph["graph_launches_per_step"] == 0,
          "%s: no graph launches on guard (%s)" % (name, ph["graph_launches_per_step"]))
    hd = ph["h2d_bytes_per_step"] + ph["d2h_bytes_per_step"]
    check(abs(ph["host_device_bytes_per_step"] - hd) <= 1e-9 * max(1, hd),
          "%s: host_device_bytes = h2d + d2h" % name)
    check(ph["d2h_bytes_per_step"] > 0, "%s: the step downloaded something" % name)
    bad = [k for k in ph["ops"] if not k.isidentifier() or ph["ops"][k] <= 0]
    check(not bad, "%s: op names and counts are sane (%s)" % (name, bad))


def load(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        check(False, "%s: %s is JSON (%s)" % (what, path, e))
        return None


def refused(p, what):
    lines = [l for l in p.stderr.splitlines() if l.strip() and "[k3" not in l]
    op_lines = [l for l in lines if "--op-stats" in l]
    check(p.returncode == 2, "%s: exit %d (want 2)" % (what, p.returncode))
    check(len(op_lines) == 1 and "--backend guard" in op_lines[0],
          "%s: one line naming --op-stats and --backend guard: %s" % (what, op_lines))


def unit(tmp, model):
    s = os.path.join(tmp, "s.json")
    p = k3(["run", "--model", model, "--backend", "guard", "--prompt-ids", "1,2,3", "--n", "4",
            "--ignore-eos", "--op-stats", s])
    check(p.returncode == 0, "run --backend guard --op-stats: exit %d %s" % (p.returncode,
                                                                              p.stderr[-600:]))
    d = load(s, "run")
    if d:
        check(d.get("backend") == "guard", "backend is guard: %s" % d.get("backend"))
        st = d.get("stages", [])
        check(len(st) == 1, "one stage entry (%d)" % len(st))
        if st:
            e = st[0]
            check((e["rank"], e["stage"], e["lane"]) == (0, 0, 0), "entry is rank 0 (0, 0)")
            check(e["layers"][0] == 0 and e["layers"][1] > 0, "layers %s" % e["layers"])
            phase_ok("run decode", e["decode"], 3)
            phase_ok("run prefill", e["prefill"], 1)
            phase_ok("run idle", e["idle"], 0)
            check(d.get("decode") == e["decode"] and d.get("prefill") == e["prefill"],
                  "top-level decode / prefill equal the stage's (jq .decode.ops_per_step)")
            check("matmul" in e["decode"]["ops"] or "matmul_group" in e["decode"]["ops"],
                  "decode ran matmuls: %s" % sorted(e["decode"]["ops"]))
    b = os.path.join(tmp, "b.json")
    p = k3(["bench", "throughput", "--model", model, "--backend", "guard", "--input-len", "6",
            "--output-len", "3", "--num-prompts", "2", "--num-warmups", "0", "--op-stats", b])
    check(p.returncode == 0, "bench throughput --op-stats: exit %d %s" % (p.returncode,
                                                                         p.stderr[-600:]))
    d = load(b, "bench")
    if d:
        phase_ok("bench decode", d["stages"][0]["decode"])
        phase_ok("bench prefill", d["stages"][0]["prefill"])
        check(d["decode"]["steps"] > 0 and d["prefill"]["steps"] > 0,
              "bench: decode %s and prefill %s steps" % (d["decode"]["steps"],
                                                         d["prefill"]["steps"]))
    for be in ("cpu", "ref"):
        c = os.path.join(tmp, "c_%s.json" % be)
        p = k3(["run", "--model", model, "--backend", be, "--prompt-ids", "1,2,3", "--n", "2",
                "--op-stats", c])
        refused(p, "run --backend %s --op-stats" % be)
        check(not os.path.exists(c), "--backend %s: no file written" % be)
    p = k3(["run", "--model", model, "--backend", "guard", "--prompt-ids", "1,2", "--n", "1",
            "--op-stats", os.path.join(tmp, "no", "such", "dir.json")])
    check(p.returncode == 1 and "--op-stats" in p.stderr and "dir.json" in p.stderr,
          "an unwritable FILE: exit %d, named" % p.returncode)


def deep(tmp):
    """The step's op count does not depend on the batch (docs/DESIGN.md §3a): on the 93-layer
    `deep` preset a decode step issues the same number of op calls with 1 sequence and with 12,
    and reads back from the backend at most twice (the non-finite flags, the logits); a prefill
    step that opens 1 sequence and one that opens 12 issue the same op calls."""
    model = os.path.join(tmp, "deep")
    p = k3(["make-tiny", model, "--preset", "deep"])
    check(p.returncode == 0, "make-tiny --preset deep: exit %d %s" % (p.returncode, p.stderr[-400:]))
    if p.returncode != 0:
        return
    got, pre = {}, {}
    for n in (1, 12):  # 32 was checked by hand (docs/DESIGN.md): guard's mprotect per op is slow
        prompts = ";".join(",".join(str((i * 7 + j) % 3000 + 1) for j in range(3 + i % 5))
                           for i in range(n))
        f = os.path.join(tmp, "deep%d.json" % n)
        # a cache block (64 tokens) for every sequence, so that all n are in one prefill step and
        # the same 2 decode steps (the cache's default, --max-seqs x --max-ctx, held 3 blocks:
        # the 12 ran 3 at a time, in 4 prefill and 8 decode steps)
        p = k3(["run", "--model", model, "--backend", "guard", "--prompt-ids", prompts, "--n", "3",
                "--ignore-eos", "--max-seqs", str(n), "--max-ctx", "16", "--kv-cache-tokens",
                str(64 * n), "--max-batch-tokens", "96", "--op-stats", f], timeout=600)
        check(p.returncode == 0, "deep, %d sequences: exit %d %s" % (n, p.returncode,
                                                                     p.stderr[-600:]))
        d = load(f, "deep %d" % n)
        if d:
            check(d["prefill"]["steps"] == 1, "deep, %d sequences: one prefill step (%s)"
                  % (n, d["prefill"]["steps"]))
            phase_ok("deep %d decode" % n, d["decode"], 2)
            phase_ok("deep %d prefill" % n, d["prefill"], 1)
            got[n] = d["decode"]
            pre[n] = d["prefill"]
    if len(pre) == 2:  # no per-sequence op (the state resets of new sequences): one count
        a, b = pre[1], pre[12]
        check(a["ops_per_step"] == b["ops_per_step"] and a["ops"] == b["ops"],
              "deep: a prefill step's ops with 1 and 12 new sequences: %s and %s (%s)"
              % (a["ops_per_step"], b["ops_per_step"],
                 {k: (a["ops"].get(k), b["ops"].get(k)) for k in set(a["ops"]) | set(b["ops"])
                  if a["ops"].get(k) != b["ops"].get(k)}))
    if len(got) == 2:
        a, b = got[1], got[12]
        check(a["ops_per_step"] == b["ops_per_step"] and a["ops"] == b["ops"],
              "deep: a decode step's ops with 1 and 12 sequences: %s and %s"
              % (a["ops_per_step"], b["ops_per_step"]))
        check(max(a["host_syncs_max_per_step"], b["host_syncs_max_per_step"]) <= 2,
              "deep: at most 2 host syncs a decode step (%s, %s)"
              % (a["host_syncs_max_per_step"], b["host_syncs_max_per_step"]))


def mpi(tmp, model, mpiexec):
    m = os.path.join(tmp, "m.json")
    p = k3(["run", "--model", model, "--backend", "guard", "--pp", "2", "--ep", "2",
            "--prompt-ids", "1,2,3", "--n", "4", "--ignore-eos", "--op-stats", m],
           mpi=mpiexec, np_=4)
    check(p.returncode == 0, "mpirun -np 4 run --pp 2 --ep 2 --op-stats: exit %d %s"
          % (p.returncode, p.stderr[-800:]))
    d = load(m, "mpi run")
    if d:
        st = d.get("stages", [])
        check(sorted(e["rank"] for e in st) == [0, 1, 2, 3], "one entry per worker rank")
        check("decode" not in d, "no top-level decode with several stages")
        check(d.get("comm") == "mpi" and d.get("routing") == "host"
              and d.get("routing_note", "").startswith("mpi: "),
              "the mpi transport routes on the host and says why its counts differ: %s %s %s"
              % (d.get("comm"), d.get("routing"), d.get("routing_note")))
        coords = sorted((e["stage"], e["lane"]) for e in st)
        check(coords == [(0, 0), (0, 1), (1, 0), (1, 1)], "(stage, lane) of each: %s" % coords)
        by_stage = {e["stage"]: e["layers"] for e in st}
        if 0 in by_stage and 1 in by_stage:
            check(by_stage[0][0] == 0 and by_stage[0][1] == by_stage[1][0],
                  "stage layers are contiguous: %s" % by_stage)
        busy = [e for e in st if e["decode"]["steps"] > 0]
        idle = [e for e in st if e["decode"]["steps"] == 0]
        check(len(busy) == 2 and len(idle) == 2, "one lane ran the sequence, one idled")
        for e in busy:
            phase_ok("rank %d decode" % e["rank"], e["decode"], 3)
            phase_ok("rank %d prefill" % e["rank"], e["prefill"], 1)
        for e in idle:
            check(e["idle"]["steps"] > 0 and e["prefill"]["steps"] == 0,
                  "rank %d: %d idle steps, no prefill" % (e["rank"], e["idle"]["steps"]))
            phase_ok("rank %d idle" % e["rank"], e["idle"])
    c = os.path.join(tmp, "mc.json")
    p = k3(["run", "--model", model, "--backend", "cpu", "--pp", "2", "--ep", "2", "--prompt-ids",
            "1,2,3", "--n", "2", "--op-stats", c], mpi=mpiexec, np_=4)
    refused(p, "mpirun --backend cpu --op-stats")
    check(not os.path.exists(c), "mpirun --backend cpu: no file written")


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("unit", "mpi") or not K3:
        print("usage: K3_BIN=... opstats_test.py unit|mpi [MPIEXEC]", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "tiny")
        p = k3(["make-tiny", model])
        check(p.returncode == 0, "make-tiny: exit %d %s" % (p.returncode, p.stderr[-400:]))
        if p.returncode == 0:
            if sys.argv[1] == "unit":
                unit(tmp, model)
                deep(tmp)
            else:
                mpi(tmp, model, sys.argv[2] if len(sys.argv) > 2 else "mpirun")
    print("opstats_test %s: %d failed" % (sys.argv[1], len(fails)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
