#!/usr/bin/env python3
"""dist_run.py — end-to-end checks of the distributed `k3 run` (ctest label "mpi").

usage: dist_run.py MODE MPIEXEC  (MODE: splits | splits-sanitize | bytes | fail | load)   (K3_BIN = the k3 binary; a tiny model is made in a temp dir)
  (every run passes --ignore-eos: the checks compare exactly N_NEW tokens)
  splits : for (S,E) in (1,1) (2,1) (1,2) (2,2) (4,1) (1,4) (3,1) + dedicated (2,2):
           batch 1 and batch 3 ("A;B;C"), greedy, 32 new tokens, prefill chunk 5;
           --deterministic: the dumped logits are BIT-identical to the single-process runs
           (`k3 run` without mpirun, one prompt at a time; the batch-3 dump is the prompts' dumps
           concatenated); without it: rel-L2 <= K3_TOL_DISTRIBUTED_REL_L2 and identical greedy tokens,
           and (E > 1) fewer MoE combine bytes than --deterministic with the same dispatch bytes;
           (1,1) and (2,2) also run on the guard backend, bit-identical; the batch-1 runs load with
           --load-mmap (the files mapped, not read), bit-identical to the read singles.
  splits-sanitize : the same runs and checks on 6 of the grids, the sanitizer tier's copy (the
           main tier runs all 9): (1,1) (2,2) (3,1) (1,4) + dedicated (2,2) + the map's (2,2); the
           three left out, (2,1) (1,2) (4,1), are smaller cases of the same code (a first and a
           last stage; two lanes; middle stages: (3,1) has one).
  bytes  : per-rank bytes read (from --json) equal the bytes computed HERE from the safetensors
           headers for the tensors that rank must read (its lane's contiguous experts; the dense
           tensors of its stage — its layers, embedding on stage 0, head on the last stage — only
           on the lowest rank of the stage, which reads them for the node, or on every rank with
           --load-private) — so no rank read another rank's experts — and their sum is every
           tensor once (one node), or the plan's sum with --load-private.
  fail   : K3_TEST_FAIL=load:K and decode:K:N on rank K of 4 (and a dedicated coordinator):
           every rank exits non-zero within 30 s, the output names rank K, no process is left;
           hang:K:N (rank K stops answering): the waiting ranks time out and end
           the job, naming the timeout (--comm-timeout 5); plan:K (rank K derives another plan):
           the job refuses to start, naming rank K.
  load   : K3_TEST_FAIL=stall-load:K on 4 ranks (S=2, E=2), --comm-timeout 5: rank K stops itself
           (a real SIGSTOP) half-way through its load; the job must end within 10 s of the stop
           (asserted on mpirun's whole wall time, which includes ~1 s of start-up and load before
           the stop, plus MPI_Abort's teardown: limit 10 + 2 s), stderr names rank K with its
           stage, lane and host as the rank that made no load progress, no process is left.
           K = 1 (first stage), 3 (last stage), 0 (coordinator, first stage), and 4 (last stage)
           behind a dedicated coordinator (world 5). Then --load-timeout
           3 with --comm-timeout 60: rank 0 names the stalled rank as not done in time. Then the
           memory check: --max-seqs sized at --max-ctx 2^20 (from `k3 plan --json`) so that each rank alone needs at
           most half of MemAvailable but the 4 ranks of this node together need more than it:
           refused before loading (exit 1, within 10 s), the message names the host and all 4
           ranks with their sizes.
"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

K3 = os.environ.get("K3_BIN")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_tolerances import TOL  # noqa: E402

REL_L2_TOL = TOL["K3_TOL_DISTRIBUTED_REL_L2"]  # tests/tolerances.h
PROMPTS = [
    list(range(1, 21)),
    [100, 200, 300],
    [7] * 40 + [3000, 3001, 3002, 5],
]
N_NEW = 32
CHUNK = 5
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg, flush=True)


def ids_arg(prompts):
    return ";".join(",".join(str(t) for t in p) for p in prompts)


def run(cmd, timeout=120, env=None):
    e = dict(os.environ)
    if env:
        e.update(env)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    return p, time.time() - t0


def mpirun(mpiexec, np_, args, **kw):
    return run([mpiexec, "-np", str(np_), "--oversubscribe", K3, "run"] + args, **kw)


def load_npy(path):
    return np.load(path)


def make_model(tmp):
    model = os.path.join(tmp, "tiny")
    p, _ = run([K3, "make-tiny", model])
    if p.returncode != 0:
        print(p.stdout, p.stderr)
        sys.exit("k3 make-tiny failed")
    return model


def singles(model, tmp):
    """Single-process reference: one `k3 run` per prompt (no mpirun)."""
    ref_logits, ref_tokens = [], []
    for i, pr in enumerate(PROMPTS):
        out = os.path.join(tmp, f"ref{i}.npy")
        p, _ = run([K3, "run", "--model", model, "--prompt-ids", ids_arg([pr]), "--n", str(N_NEW),
                    "--chunk", str(CHUNK), "--dump-logits", out, "--json", "--ignore-eos"])
        if p.returncode != 0:
            print(p.stdout, p.stderr)
            sys.exit("single-process k3 run failed")
        ref_tokens.append(json.loads(p.stdout)["generated_ids"])
        ref_logits.append(load_npy(out))
        check(ref_logits[-1].shape[0] == len(pr) + N_NEW - 1, f"reference {i}: {ref_logits[-1].shape} rows")
    return ref_logits, ref_tokens


def mode_splits(mpiexec, tmp, sanitize=False):
    model = make_model(tmp)
    ref_logits, ref_tokens = singles(model, tmp)
    # an irregular expert map: lanes alternate, and on the first MoE layer lane 1 owns nothing
    n_exp = json.load(open(os.path.join(model, "config.json")))["text_config"]["num_experts"]
    map_path = os.path.join(tmp, "map.txt")
    with open(map_path, "w") as f:
        f.write("# test map\n* " + " ".join(str((x // 3) % 2) for x in range(n_exp)) + "\n")
        f.write("1 " + " ".join("0" for _ in range(n_exp)) + "\n")
    grids = [(1, 1, "shared"), (2, 1, "shared"), (1, 2, "shared"), (2, 2, "shared"), (4, 1, "shared"),
             (1, 4, "shared"), (3, 1, "shared"), (2, 2, "dedicated"), (2, 2, "map")]
    if sanitize:  # every path once under ASan: no (2,1) (1,2) (4,1), see the usage above
        grids = [g for g in grids if g[:2] not in ((2, 1), (1, 2), (4, 1))]
    for S, E, coord in grids:
        use_map = coord == "map"
        coord = "shared" if use_map else coord
        world = S * E + (coord == "dedicated")
        # (batch, deterministic, dump, backend): without a dump the last stage sends only the rows
        # sampled; the guard backend (memory host code cannot touch) must give the cpu's bits
        runs = [(1, True, True, "cpu mmap"), (3, True, True, "cpu"), (3, False, True, "cpu"),
                (3, True, False, "cpu")]
        if (S, E, coord, use_map) in ((1, 1, "shared", False), (2, 2, "shared", False)):
            runs.append((3, True, True, "guard"))
        moe = {}  # deterministic? -> (dispatch bytes, combine bytes) of the batch-3 dump run
        for batch, det, dump, backend in runs:
            out = os.path.join(tmp, "dist.npy")
            args = ["--model", model, "--prompt-ids", ids_arg(PROMPTS[:batch]), "--n", str(N_NEW), "--chunk",
                    str(CHUNK), "--pp", str(S), "--ep", str(E), "--coordinator", coord,
                    "--json", "--ignore-eos", "--comm-timeout", "60"] + (["--deterministic"] if det else [])
            args += ["--expert-map", map_path] if use_map else []
            args += ["--dump-logits", out] if dump else []
            args += ["--backend", backend.split()[0]] + (["--load-mmap"] if "mmap" in backend else [])
            p, dt = mpirun(mpiexec, world, args)
            tag = f"S={S} E={E} {coord}{' +map' if use_map else ''} batch={batch} det={det} dump={dump} {backend}"
            if p.returncode != 0:
                check(False, f"{tag}: rc {p.returncode}\n{p.stderr[-2000:]}")
                continue
            j = json.loads(p.stdout.strip().splitlines()[-1])
            if not dump:
                toks = [r["generated_ids"] for r in j["results"]]
                check(toks == ref_tokens[:batch], f"{tag}: greedy tokens differ")
                print(f"ok {tag} ({dt:.1f} s)", flush=True)
                continue
            got = load_npy(out)
            want = np.concatenate(ref_logits[:batch], axis=0)
            check(got.shape == want.shape, f"{tag}: logits shape {got.shape} vs {want.shape}")
            if got.shape != want.shape:
                continue
            toks = [r["generated_ids"] for r in j["results"]]
            check(toks == ref_tokens[:batch], f"{tag}: greedy tokens differ")
            if det:
                same = got.tobytes() == want.tobytes()
                check(same, f"{tag}: logits not bit-identical (max |diff| {np.abs(got - want).max():.3g})")
            else:
                rel = float(np.linalg.norm((got - want).astype(np.float64)) /
                            np.linalg.norm(want.astype(np.float64)))
                check(rel <= REL_L2_TOL, f"{tag}: rel-L2 {rel:.3g} > {REL_L2_TOL}")
            check(j["dist"]["micro_batches"] == max(1, S), f"{tag}: micro-batches")
            if batch == 3 and backend == "cpu":
                moe[det] = (j["dist"]["moe_dispatch_bytes"], j["dist"]["moe_combine_bytes"])
            print(f"ok {tag} ({dt:.1f} s)", flush=True)
        if E > 1 and len(moe) == 2:  # the pre-summed combine moves fewer bytes, dispatch the same
            (d_det, c_det), (d_pre, c_pre) = moe[True], moe[False]
            check(d_det == d_pre and d_det > 0, f"S={S} E={E}: dispatch bytes {d_det} vs {d_pre}")
            check(0 < c_pre < c_det, f"S={S} E={E}: pre-summed combine {c_pre} B not below per-item {c_det} B")
            print(f"ok S={S} E={E} {coord}: MoE combine {c_pre} B pre-summed vs {c_det} B per-item", flush=True)


def st_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def mode_bytes(mpiexec, tmp):
    model = make_model(tmp)
    cfg = json.load(open(os.path.join(model, "config.json")))
    tc = cfg.get("text_config", cfg)
    n_layers, n_exp = tc["num_hidden_layers"], tc["num_experts"]
    sizes = {}
    for f in os.listdir(model):
        if f.endswith(".safetensors"):
            for name, meta in st_header(os.path.join(model, f)).items():
                if name != "__metadata__":
                    sizes[name] = meta["data_offsets"][1] - meta["data_offsets"][0]
    # node sharing (the default): the lowest rank of each stage reads the stage's dense tensors into
    # node memory, its other lanes read only their experts; --load-private: every rank reads all
    # of its tensors, as the plan counts them
    for S, E, coord, private in [(2, 2, "shared", False), (1, 4, "shared", False),
                                 (2, 1, "dedicated", False), (2, 2, "shared", True)]:
        world = S * E + (coord == "dedicated")
        p, _ = mpirun(mpiexec, world, ["--model", model, "--prompt-ids", ids_arg(PROMPTS), "--n", "4", "--pp", str(S),
                                       "--ep", str(E), "--coordinator", coord, "--json"]
                      + (["--load-private"] if private else []))
        tag = f"bytes S={S} E={E} {coord}" + (" --load-private" if private else "")
        if p.returncode != 0:
            check(False, f"{tag}: rc {p.returncode}\n{p.stderr[-2000:]}")
            continue
        d = json.loads(p.stdout.strip().splitlines()[-1])["dist"]
        stages = d["stages"]
        total_read = 0
        first_of_stage = {}
        for rk in d["ranks"]:
            if rk["stage"] >= 0:
                first_of_stage.setdefault(rk["stage"], rk["rank"])
        for rk in d["ranks"]:
            s, e = rk["stage"], rk["lane"]
            reader = private or (s >= 0 and first_of_stage[s] == rk["rank"])
            want = 0
            if s >= 0:
                lb, le = stages[s]
                for name, nb in sizes.items():
                    x = re.search(r"\.experts\.(\d+)\.", name)
                    if not x and not reader:
                        continue  # a dense tensor another lane of the stage reads for the node
                    m = re.search(r"\.layers\.(\d+)\.", name)
                    if m:
                        l = int(m.group(1))
                        if not (lb <= l < le):
                            continue
                        if x and int(x.group(1)) // (n_exp // E) != e:
                            continue  # another lane's expert
                        want += nb
                    elif "embed_tokens" in name:
                        want += nb if s == 0 else 0
                    else:  # final norm, output AttnRes, lm_head
                        want += nb if s == S - 1 else 0
            check(rk["bytes_read"] == want, f"{tag}: rank {rk['rank']} read {rk['bytes_read']} bytes, "
                                            f"its tensors are {want}")
            if reader:
                check(rk["bytes_read"] == rk["plan_weight_bytes"], f"{tag}: rank {rk['rank']} read "
                                                                   f"{rk['bytes_read']}, plan {rk['plan_weight_bytes']}")
            total_read += rk["bytes_read"]
        plan_sum = sum(r["plan_weight_bytes"] for r in d["ranks"])
        if private or E == 1:
            check(total_read == plan_sum, f"{tag}: sum read {total_read} vs plan {plan_sum}")
        else:  # one node: every tensor of the checkpoint read exactly once
            check(total_read == sum(sizes.values()), f"{tag}: sum read {total_read} vs the "
                                                     f"checkpoint's {sum(sizes.values())}")
        print(f"ok {tag}", flush=True)


def leftovers(marker):
    p = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return [x for x in p.stdout.split() if x.strip()]


def mode_fail(mpiexec, tmp):
    model = make_model(tmp)
    cases = [("load:2", 2, 4, 2, 2, "shared"), ("decode:3:12", 3, 4, 2, 2, "shared"),
             ("decode:1:20", 1, 4, 4, 1, "shared"), ("decode:0:15", 0, 5, 2, 2, "dedicated"),
             ("load:4", 4, 5, 2, 2, "dedicated"), ("hang:2:8", None, 4, 4, 1, "shared"),
             ("plan:1", 1, 4, 2, 2, "shared")]
    for hook, k, world, S, E, coord in cases:
        # a hung rank is noticed by the --comm-timeout of whoever waits for it (5 s here)
        args = ["--model", model, "--prompt-ids", ids_arg(PROMPTS), "--n", str(N_NEW), "--pp", str(S), "--ep", str(E),
                "--coordinator", coord, "--comm-timeout", "5" if hook.startswith("hang") else "20"]
        tag = f"K3_TEST_FAIL={hook} world={world} S={S} E={E} {coord}"
        try:
            p, dt = mpirun(mpiexec, world, args, timeout=60, env={"K3_TEST_FAIL": hook})
        except subprocess.TimeoutExpired:
            check(False, f"{tag}: the job did not end within 60 s")
            continue
        text = p.stdout + p.stderr
        check(p.returncode != 0, f"{tag}: exit code 0")
        check(dt < 30, f"{tag}: took {dt:.1f} s")
        if k is not None:
            check(re.search(rf"\brank {k}\b", text) is not None, f"{tag}: no message names rank {k}:\n{text[-1500:]}")
        else:
            check("--comm-timeout" in text, f"{tag}: no timeout message:\n{text[-1500:]}")
        time.sleep(0.5)
        left = leftovers(model)
        check(not left, f"{tag}: processes left behind: {left}")
        print(f"ok {tag} ({dt:.1f} s, rc {p.returncode})", flush=True)


def meminfo_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def mode_load(mpiexec, tmp):
    model = make_model(tmp)
    base = ["--model", model, "--prompt-ids", ids_arg(PROMPTS), "--n", "4", "--pp", "2", "--ep", "2"]
    limit = 10 + 2  # the 10 s, + 2 s for mpirun's start-up before the stop and its teardown
    stall = "made no load progress"
    cases = [("stall-load:1", 1, 0, 1, 4, ["--comm-timeout", "5"], stall),
             ("stall-load:3", 3, 1, 1, 4, ["--comm-timeout", "5"], stall),
             ("stall-load:0", 0, 0, 0, 4, ["--comm-timeout", "5"], stall),
             ("stall-load:4", 4, 1, 1, 5, ["--comm-timeout", "5", "--coordinator", "dedicated"], stall),
             ("stall-load:2", 2, 1, 0, 4, ["--comm-timeout", "60", "--load-timeout", "3"],
              "longer than --load-timeout 3 s")]
    for hook, k, st, ln, world, extra, what in cases:
        tag = f"K3_TEST_FAIL={hook} world={world} {' '.join(extra)}"
        try:
            p, dt = mpirun(mpiexec, world, base + extra, timeout=60, env={"K3_TEST_FAIL": hook})
        except subprocess.TimeoutExpired:
            check(False, f"{tag}: the job did not end within 60 s")
            for pid in leftovers(model):  # our own ranks, one of them stopped: do not leave them
                try:
                    os.kill(int(pid), 9)
                except OSError:
                    pass
            continue
        check(p.returncode != 0, f"{tag}: exit code 0")
        check(dt < limit, f"{tag}: took {dt:.1f} s (limit {limit} s)")
        named = [ln_ for ln_ in p.stderr.splitlines() if what in ln_]
        want = rf"\brank {k} \(stage {st}, lane {ln}, host [^)]+\)"
        check(any(re.search(want, x) for x in named),
              f"{tag}: no line names rank {k} (stage {st}, lane {ln}, host) with '{what}':\n{p.stderr[-2000:]}")
        time.sleep(0.5)
        left = leftovers(model)
        check(not left, f"{tag}: processes left behind: {left}")
        print(f"ok {tag} ({dt:.1f} s, rc {p.returncode})", flush=True)
    # memory per node: one rank alone fits, the node's 4 ranks together do not. The context stays
    # within the model's max_position_embeddings (2^20); the sequence slots per lane scale the need.
    avail = meminfo_available()
    ctx = 1 << 20
    cap = ["--max-batch-tokens", "64"]
    p, _ = run([K3, "plan", "--model", model, "--pp", "2", "--ep", "2", "--max-ctx", str(ctx), "--max-seqs", "1",
                "--json"] + cap)
    ranks = json.loads(p.stdout)["ranks"]
    per_seq = [r["cache_bytes"] for r in ranks]  # cache bytes of one slot per lane, per rank
    seqs = max(1, int(0.5 * avail / max(per_seq)))  # the biggest rank needs about half of MemAvailable alone
    need = sum(x * seqs for x in per_seq)
    check(need > avail, f"memory: the 4 ranks would need {need / 1e9:.1f} GB, not above {avail / 1e9:.1f} GB")
    tag = f"memory --max-ctx {ctx} --max-seqs {seqs}"
    p, dt = mpirun(mpiexec, 4, base + ["--comm-timeout", "5", "--max-ctx", str(ctx), "--max-seqs", str(seqs)] + cap,
                   timeout=60)
    err = p.stderr
    check(p.returncode == 1, f"{tag}: rc {p.returncode}, want 1:\n{err[-2000:]}")
    check(dt < 10, f"{tag}: took {dt:.1f} s")
    check("memory: the 4 ranks on host" in err and "MemAvailable" in err and "margin" in err,
          f"{tag}: no per-node memory message:\n{err[-2000:]}")
    for k in range(4):
        check(re.search(rf"rank {k} \(stage \d, lane \d\) [0-9.]+ GB", err) is not None,
              f"{tag}: the message does not list rank {k} with its size")
    check("loaded" not in err, f"{tag}: some rank loaded before the refusal")
    check(not leftovers(model), f"{tag}: processes left behind")
    print(f"ok {tag} ({dt:.1f} s, rc {p.returncode})", flush=True)


def main():
    if len(sys.argv) != 3 or not K3:
        sys.exit(__doc__)
    mode, mpiexec = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix=f"k3-mpi-{mode}-")
    try:
        {"splits": mode_splits, "splits-sanitize": lambda m, t: mode_splits(m, t, sanitize=True),
         "bytes": mode_bytes, "fail": mode_fail, "load": mode_load}[mode](mpiexec, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"dist_run {mode}: {len(failures)} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
