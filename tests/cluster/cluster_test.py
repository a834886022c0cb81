#!/usr/bin/env python3
"""cluster_test.py — k3 across namespace nodes (ctest label "cluster"; tests/cluster/README.md).

usage: cluster_test.py CASE   (K3_BIN = the k3 binary; run as root)
Each case makes its cluster with up.sh, runs k3 under mpirun.sh (mpirun on the login node, an
orted per node through the nsenter rsh agent), removes it with down.sh, and fails if anything is
left (check-clean.sh: no link, node process or state directory). A tiny model is made in a
directory every node sees (under the build tree; each node has its own /tmp and /dev/shm).
  det       2 nodes x 2 ranks, --pp 2 --ep 2 --deterministic: the dumped logits are byte-identical
            to one process (`k3 run` outside the cluster), over ob1/tcp and over UCX/tcp
            (--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any); node2's veth sent
            at least the logits' bytes (the last stage is on node2, rank 0 on node1); each node
            read its stage's dense weights once (the ranks' bytes_read per node = the node's
            unique bytes, from the load lines).
  det4      4 nodes x 1 rank, --pp 2 --ep 2 --deterministic: byte-identical, ob1/tcp.
  partition 2 nodes x 2 ranks, --comm-timeout 10: node2's port is set down 4 s into a long run;
            mpirun returns non-zero within 45 s of the cut, and stderr has k3's verdict naming a
            rank of node2 with "host node2".
  kill      4 nodes x 1 rank: SIGKILL of rank 2 (alone on node3) during decode; a k3 line names
            "rank 2 (stage 1, lane 0, host node3" ... "vanished" within 30 s of the kill. Then
            2 nodes x 2 ranks: SIGKILL of both ranks of node2 (a node whose processes all die)
            names rank 2 and rank 3, each once; SIGKILL of rank 3 alone names it once.
  killucx   the lone-rank SIGKILL of `kill` (4 x 1, rank 2 on node3) over UCX/tcp (--mca pml ucx
            --mca pml_ucx_tls any --mca pml_ucx_devices any): named vanished within 30 s.
  stop      4 nodes x 1 rank, --comm-timeout 10: SIGSTOP of rank 2 (alone on node3) during decode;
            mpirun returns non-zero 9-40 s after the stop, every "root cause:" line names rank 2
            (stage 1, lane 0, host node3) (the ranks' agreed timeout verdict), none says "vanished".
  load      2 nodes x 2 ranks, 1 x 4 (one stage): each node reads the stage's dense tensors once.
            `k3 run --json`: the ranks read every tensor once plus the dense tensors once more
            (total + dense, from the shard headers); `k3 bench load`: 2 nodes of 2 ranks, each
            node's bytes read = its unique bytes, the job's = total + dense (the mmap loader:
            each rank maps its own, total + 3 x dense). (Was K3_TEST_NODE_RANKS on one host.)
  nodemap   4 nodes x 1 rank told they share one node (K3_TEST_NODE_MAP=one): refused at open,
            exit 2 within 30 s, naming ranks 1-3 with their hosts and rank 0's host.
  slow      2 nodes x 1 rank, --ep 2 (every MoE layer's exchange crosses the link): `k3 bench
            throughput` with 0, 1 and 5 ms added to every frame of node2's link (slow.sh: a
            user-space forwarder, no netem here), beside `k3 plan --link-latency-us` for the same
            site; prints the table. Checks: tok/s falls with the delay, and the measured time
            added by the delay is at least 0.8 x the model's (the model must not promise more
            than the link gives). Then 5% loss on the link: the run still ends with exit 0.
  serve     2 nodes x 2 ranks, `k3 serve --pp 2 --ep 2 --deterministic --host 0.0.0.0` (rank 0 on
            node1), and the openai client run on node2 (through rsh.sh) against node1's address:
            greedy completions of two prompts equal those of `k3 serve` in one process.
  batch     `k3 batch --deterministic --pp 2 --ep 2` on 2 nodes x 2 ranks and on 4 nodes x 1 rank,
            ob1/tcp, a 5-line file (completions: ids with logprobs, text, a prompt list; chat with
            top_logprobs, chat with a system message and thinking off; temperature 0): every
            response body equals one process's (ids, timestamps, the prefix cache's hits aside).
Where namespaces cannot be made (up.sh exits 2) the case is skipped with up.sh's reason, or,
under CI=true, fails.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
K3 = os.environ.get("K3_BIN") or sys.exit("K3_BIN is not set")
WORK = os.path.join(os.path.dirname(os.path.abspath(K3)), "cluster-work")
UCX = ["--mca", "pml", "ucx", "--mca", "pml_ucx_tls", "any", "--mca", "pml_ucx_devices", "any"]
OB1 = ["--mca", "pml", "ob1"]
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg, flush=True)
    return cond


def ok(n0, msg):
    """Print msg as an ok line only when no check failed since len(failures) was n0."""
    if len(failures) == n0:
        print("ok " + msg, flush=True)


def sh(script, *args, timeout=60):
    return subprocess.run([os.path.join(HERE, script)] + [str(a) for a in args],
                          capture_output=True, text=True, timeout=timeout)


def up(n, slots):
    p = sh("up.sh", n, slots)
    if p.returncode == 2:
        why = p.stderr.strip()
        if os.environ.get("CI", "").lower() == "true":
            print(f"FAIL cluster: the cluster tier cannot run under CI=true: {why}", flush=True)
            sys.exit(1)
        print(f"SKIPPED cluster: {why} — the cluster tier did NOT run", flush=True)
        sys.exit(77)
    if p.returncode != 0:
        print(p.stdout, p.stderr)
        sys.exit("up.sh failed")


def down():
    p = sh("down.sh")
    check(p.returncode == 0, f"down.sh left something behind: {p.stderr.strip()}")


def link_bytes(dev, what):
    with open(f"/sys/class/net/{dev}/statistics/{what}") as f:
        return int(f.read())


def model():
    path = os.path.join(WORK, "tiny")
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(WORK, exist_ok=True)
        p = subprocess.run([K3, "make-tiny", path], capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"k3 make-tiny failed: {p.stderr}")
    return path


PROMPTS = "1,2,3,4,5,6,7,8,9,10;300,301,302"


def single(m, out):
    """The reference: one process, no MPI; the prompts one at a time, dumps concatenated."""
    blobs = []
    for i, pr in enumerate(PROMPTS.split(";")):
        o = f"{out}.{i}.npy"
        p = subprocess.run([K3, "run", "--model", m, "--prompt-ids", pr, "--n", "12", "--ignore-eos",
                            "--deterministic", "--dump-logits", o], capture_output=True, text=True,
                           timeout=60)
        if p.returncode != 0:
            sys.exit(f"single-process k3 run failed: {p.stderr[-2000:]}")
        blobs.append(o)
    return blobs


def npy_payload(path):
    """The raw float bytes of a .npy (header skipped), to compare dumps byte for byte."""
    with open(path, "rb") as f:
        b = f.read()
    hl = int.from_bytes(b[8:10], "little") if b[6] == 1 else int.from_bytes(b[8:12], "little")
    return b[(10 if b[6] == 1 else 12) + hl:]


def cluster_run(np_, per_node, args, mca, timeout=120, **kw):
    cmd = [os.path.join(HERE, "mpirun.sh"), "-np", str(np_), "--map-by", f"ppr:{per_node}:node"] + mca
    cmd += [K3, "run"] + args
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def case_det(n_nodes, per_node, fabrics):
    m = model()
    ref = os.path.join(WORK, "ref")
    want = b"".join(npy_payload(x) for x in single(m, ref))
    up(n_nodes, per_node)
    try:
        for name, mca in fabrics:
            out = os.path.join(WORK, "dist-" + name.replace("/", "-") + ".npy")
            if os.path.exists(out):
                os.unlink(out)
            # the last stage's nodes (node2, or node3 and node4): their bridge ports receive what
            # they send, the logits to rank 0 on node1 among it
            last = [f"k3c{i}" for i in range(n_nodes // 2 + 1, n_nodes + 1)]
            tx0 = sum(link_bytes(d, "rx_bytes") for d in last)
            t0 = time.time()
            p = cluster_run(n_nodes * per_node, per_node,
                            ["--model", m, "--prompt-ids", PROMPTS, "--n", "12", "--ignore-eos",
                             "--deterministic", "--pp", "2", "--ep", "2", "--dump-logits", out,
                             "--json", "--comm-timeout", "30"], mca)
            so, se = p.communicate(timeout=120)
            tag = f"{n_nodes} nodes x {per_node} ranks, {name}"
            n0 = len(failures)
            if not check(p.returncode == 0, f"{tag}: rc {p.returncode}\n{se[-3000:]}"):
                continue
            check("vanished" not in se, f"{tag}: a rank named vanished in a run that ended well:\n" +
                  "\n".join(x for x in se.splitlines() if "vanished" in x))
            got = npy_payload(out)
            check(got == want, f"{tag}: logits not byte-identical to one process "
                               f"({len(got)} vs {len(want)} bytes)")
            sent = sum(link_bytes(d, "rx_bytes") for d in last) - tx0
            check(sent >= len(want), f"{tag}: the last stage's nodes sent {sent} B over their links, "
                                     f"less than the {len(want)} B of logits they owe rank 0")
            hosts = {r: h for r, h in re.findall(r"bind: rank (\d+) \(local \d+ of \d+ on (\S+)\)", se)}
            check(len(set(hosts.values())) == n_nodes, f"{tag}: ranks ran on {sorted(set(hosts.values()))}")
            if per_node == 2:  # each node read its stage's dense weights once
                check(se.count("(I read them)") == n_nodes and
                      se.count("(shared, read by another rank)") == n_nodes,
                      f"{tag}: dense weights not read once per node:\n" +
                      "\n".join(x for x in se.splitlines() if "dense weights" in x))
            ok(n0, f"{tag}: byte-identical, the last stage's nodes sent {sent} B "
                   f"({time.time() - t0:.1f} s)")
    finally:
        down()


LONG = ["--prompt-ids", "1,2,3;4,5,6;7,8,9;10,11,12", "--n", "4000", "--ignore-eos"]


def case_partition():
    m = model()
    n0 = len(failures)
    up(2, 2)
    try:
        p = cluster_run(4, 2, ["--model", m, "--pp", "2", "--ep", "2", "--comm-timeout", "10"] + LONG,
                        OB1)
        time.sleep(4)
        check(p.poll() is None, "the run ended before the cut")
        subprocess.run(["ip", "link", "set", "k3c2", "down"], check=True)
        t_cut = time.time()
        try:
            so, se = p.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            check(False, f"mpirun still running 45 s after node2's link was cut:\n{se[-3000:]}")
            return
        dt = time.time() - t_cut
        check(p.returncode != 0, "mpirun returned 0 after a partition")
        line = next((x for x in se.splitlines() if "root cause:" in x), "")
        check(re.search(r"rank [23] \(stage 1, lane \d, host node2\)", line),
              f"no k3 verdict naming a rank of node2 and its host:\n{se[-3000:]}")
        ok(n0, f"partition: mpirun returned {p.returncode} {dt:.1f} s after the cut; {line[:200]}")
    finally:
        subprocess.run(["ip", "link", "set", "k3c2", "up"])
        down()


def kill_on(n_nodes, per_node, node, want, what, mca=OB1):
    """A long 2 x 2 run on n_nodes nodes; SIGKILL the ranks `want` (all on `node`, found by their
    OMPI_COMM_WORLD_RANK); mpirun must return non-zero within 30 s, and each rank be named
    vanished with its stage, lane and host exactly once."""
    m = model()
    n0 = len(failures)
    up(n_nodes, per_node)
    try:
        p = cluster_run(4, per_node, ["--model", m, "--pp", "2", "--ep", "2", "--comm-timeout", "60"]
                        + LONG, mca)
        time.sleep(4)
        check(p.poll() is None, f"{what}: the run ended before the kill")
        ranks = "|".join(str(r) for r in want)
        k = sh("rsh.sh", node, "for p in $(pgrep -x k3); do tr '\\0' '\\n' < /proc/$p/environ | "
               f"grep -Eqx 'OMPI_COMM_WORLD_RANK=({ranks})' && kill -9 $p && echo killed; done")
        check("killed" in k.stdout, f"{what}: nothing to kill on {node}: {k.stderr}")
        t_kill = time.time()
        try:
            so, se = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # p.kill() makes the return code non-zero: fail here
            p.kill()
            so, se = p.communicate()
            check(False, f"{what}: mpirun still running 30 s after the kill:\n{se[-3000:]}")
        dt = time.time() - t_kill
        check(p.returncode != 0, f"{what}: mpirun returned 0 after a rank was killed")
        lines = [x for x in se.splitlines() if x.startswith("[k3") and "vanished" in x]
        for r in want:
            pat = rf"rank {r} \(stage {r // 2}, lane {r % 2}, host {node}, pid \d+\) vanished"
            n = sum(1 for x in lines if re.search(pat, x))
            check(n == 1, f"{what}: rank {r} named {n} times, not once:\n" + "\n".join(lines) +
                  f"\n{se[-2000:]}")
        check(len(lines) == len(want), f"{what}: {len(lines)} vanished lines:\n" + "\n".join(lines) +
              "\n" + "\n".join(x for x in se.splitlines() if " I]" not in x)[-3000:])
        ok(n0, f"{what}: mpirun returned {p.returncode} {dt:.1f} s after the kill; " +
           " | ".join(x[:120] for x in lines))
    finally:
        down()


def case_kill():
    kill_on(4, 1, "node3", [2], "rank 2 alone on node3")
    kill_on(2, 2, "node2", [2, 3], "a node whose ranks all die")
    kill_on(2, 2, "node2", [3], "one rank of a node of two")


def case_stop():
    """4 nodes x 1 rank, --comm-timeout 10: SIGSTOP of rank 2 (alone on node3) during decode; the
    ranks' agreed timeout verdict names rank 2 no sooner than --comm-timeout after the stop, and
    mpirun returns non-zero within --comm-timeout + 30 s."""
    m = model()
    n0 = len(failures)
    up(4, 1)
    try:
        p = cluster_run(4, 1, ["--model", m, "--pp", "2", "--ep", "2", "--comm-timeout", "10"]
                        + LONG, OB1)
        time.sleep(4)
        check(p.poll() is None, "stop: the run ended before the stop")
        k = sh("rsh.sh", "node3", "for p in $(pgrep -x k3); do tr '\\0' '\\n' < /proc/$p/environ | "
               "grep -qx 'OMPI_COMM_WORLD_RANK=2' && kill -STOP $p && echo stopped; done")
        check("stopped" in k.stdout, f"stop: nothing to stop on node3: {k.stderr}")
        t_stop = time.time()
        try:
            so, se = p.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            check(False, f"stop: mpirun still running 40 s after rank 2 was stopped:\n{se[-3000:]}")
            return
        dt = time.time() - t_stop
        check(p.returncode != 0, "stop: mpirun returned 0 after a rank was stopped")
        check(dt >= 9, f"stop: mpirun returned {dt:.1f} s after the stop, before --comm-timeout 10")
        roots = [x for x in se.splitlines() if "root cause:" in x]
        pat = r"root cause: rank 2 \(stage 1, lane 0, host node3\)"
        check(roots and all(re.search(pat, x) for x in roots),
              "stop: no verdict naming rank 2 (stage 1, lane 0, host node3) alone:\n" +
              "\n".join(roots) + f"\n{se[-3000:]}")
        check("vanished" not in se, "stop: a rank named vanished, none died:\n" +
              "\n".join(x for x in se.splitlines() if "vanished" in x))
        ok(n0, f"stop: mpirun returned {p.returncode} {dt:.1f} s after the stop; "
               f"{roots[0][:200] if roots else ''}")
    finally:
        down()


BATCH = [("cmpl-ids", "/v1/completions", {"prompt": [1, 2, 3, 4, 5], "max_tokens": 10,
                                           "logprobs": 2}),
         ("cmpl-text", "/v1/completions", {"prompt": "hello there", "max_tokens": 8}),
         ("cmpl-two", "/v1/completions", {"prompt": [[300, 301, 302], [7, 8, 9, 10]],
                                           "max_tokens": 6}),
         ("chat-1", "/v1/chat/completions",
          {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 10,
           "logprobs": True, "top_logprobs": 2}),
         ("chat-2", "/v1/chat/completions",
          {"messages": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8,
           "thinking": False})]


def norm(x):
    """A body without what differs between two runs: ids, timestamps, the prefix cache's hits."""
    if isinstance(x, dict):
        return {k: norm(v) for k, v in x.items()
                if k not in ("id", "created", "prompt_tokens_details")}
    return [norm(v) for v in x] if isinstance(x, list) else x


def batch_bodies(path):
    """custom_id -> (status, normalised body) of a `k3 batch` output file."""
    out = {}
    with open(path) as f:
        for ln in f:
            o = json.loads(ln)
            out[o["custom_id"]] = (o["response"]["status_code"], norm(o["response"]["body"]))
    return out


def case_batch():
    """`k3 batch --deterministic` on 2 nodes x 2 ranks (--pp 2 --ep 2) and 4 nodes x 1 rank,
    ob1/tcp: every response body (completions and chat, greedy) equal to one process's (ids
    aside)."""
    m = model()
    inp = os.path.join(WORK, "batch-in.jsonl")
    with open(inp, "w") as f:
        for cid, url, body in BATCH:
            f.write(json.dumps({"custom_id": cid, "method": "POST", "url": url,
                                "body": dict(body, temperature=0)}) + "\n")
    flags = ["--model", m, "--threads", "1", "--deterministic", "--input", inp]
    one = os.path.join(WORK, "batch-one.jsonl")
    for f in (one,):
        if os.path.exists(f):
            os.unlink(f)
    p = subprocess.run([K3, "batch"] + flags + ["--output", one], capture_output=True, text=True,
                       timeout=120)
    if p.returncode != 0:
        sys.exit(f"single-process k3 batch failed: {p.stderr[-2000:]}")
    want = batch_bodies(one)
    if not check(len(want) == len(BATCH) and all(s == 200 for s, _ in want.values()),
                 f"one process: {len(want)} lines, statuses {[s for s, _ in want.values()]}"):
        return
    for n_nodes, per_node in ((2, 2), (4, 1)):
        tag = f"batch on {n_nodes} nodes x {per_node} ranks, ob1/tcp"
        out = os.path.join(WORK, f"batch-{n_nodes}x{per_node}.jsonl")
        if os.path.exists(out):
            os.unlink(out)
        up(n_nodes, per_node)
        try:
            t0 = time.time()
            cmd = [os.path.join(HERE, "mpirun.sh"), "-np", "4", "--map-by", f"ppr:{per_node}:node"]
            cmd += OB1 + [K3, "batch", "--pp", "2", "--ep", "2", "--comm-timeout", "30",
                          "--output", out] + flags
            q = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if not check(q.returncode == 0, f"{tag}: rc {q.returncode}\n{q.stderr[-3000:]}"):
                continue
            hosts = set(re.findall(r"bind: rank \d+ \(local \d+ of \d+ on (\S+)\)", q.stderr))
            check(len(hosts) == n_nodes, f"{tag}: ranks ran on {sorted(hosts)}")
            got = batch_bodies(out)
            diff = [c for c, _, _ in BATCH if got.get(c) != want[c]]
            for c in diff[:3]:
                print(f"   {c}: {json.dumps(got.get(c))[:300]}\n   one process: "
                      f"{json.dumps(want[c])[:300]}", flush=True)
            if check(not diff and len(got) == len(BATCH),
                     f"{tag}: bodies differ from one process's: {diff} ({len(got)} lines)"):
                print(f"ok {tag}: {len(got)} bodies equal to one process's "
                      f"({time.time() - t0:.1f} s)", flush=True)
        finally:
            down()


def shard_bytes(model_dir, experts=True):
    """Bytes of every tensor in the shards (experts=False: all but the routed experts'), from their
    safetensors headers (not from k3)."""
    total = 0
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with open(os.path.join(model_dir, name), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            total += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items()
                         if k != "__metadata__" and (experts or ".experts." not in k))
    return total


def case_load():
    m = model()
    total, dense = shard_bytes(m), shard_bytes(m, experts=False)
    up(2, 2)
    try:
        p = cluster_run(4, 2, ["--model", m, "--pp", "1", "--ep", "4", "--prompt-ids", "1,2,3",
                               "--n", "3", "--json", "--comm-timeout", "30"], OB1)
        so, se = p.communicate(timeout=120)
        n0 = len(failures)
        if check(p.returncode == 0, f"run: rc {p.returncode}\n{se[-3000:]}"):
            read = sum(r["bytes_read"] for r in json.loads(so)["dist"]["ranks"])
            check(read == total + dense, f"run: the ranks read {read} B, not every tensor once and "
                                         f"the dense ones once more per node ({total} + {dense})")
            ok(n0, f"run: 2 nodes read {read} B = {total} + {dense} (dense once per node)")
        js = os.path.join(WORK, "load.json")
        cmd = [os.path.join(HERE, "mpirun.sh"), "-np", "4", "--map-by", "ppr:2:node"] + OB1
        cmd += [K3, "bench", "load", "--model", m, "--ep", "4", "--threads", "1", "-r", "1",
                "--output-json", js]
        b = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        n0 = len(failures)
        if check(b.returncode == 0, f"bench load: rc {b.returncode}\n{b.stderr[-3000:]}"):
            d = json.load(open(js))
            check(d["nodes"] == 2, f"bench load: {d['nodes']} nodes")
            for x in d["loads"]:
                check([n["ranks"] for n in x["nodes"]] == [2, 2], f"{x['loader']}: ranks per node")
                if x["loader"] == "mmap":  # each rank maps its own (the page cache shares them)
                    check(x["bytes_read"] == total + 3 * dense, f"mmap: {x['bytes_read']} B")
                    continue
                for n in x["nodes"]:
                    check(n["bytes_read"] == n["unique_bytes"] > 0, f"{x['loader']}: node {n}")
                check(x["bytes_read"] == x["unique_bytes"] == total + dense,
                      f"{x['loader']}: {x['bytes_read']} B read, {x['unique_bytes']} unique, "
                      f"want {total} + {dense}")
            ok(n0, f"bench load: per node bytes read = unique bytes ({len(d['loads'])} loaders)")
    finally:
        down()


def case_nodemap():
    m = model()
    up(4, 1)
    try:
        cmd = [os.path.join(HERE, "mpirun.sh"), "-np", "4", "--map-by", "ppr:1:node", "-x",
               "K3_TEST_NODE_MAP=one"] + OB1 + [K3, "run", "--model", m, "--pp", "2", "--ep", "2",
                                                "--prompt-ids", "1,2,3", "--n", "3"]
        t0, n0 = time.time(), len(failures)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        dt = time.time() - t0
        check(p.returncode == 2, f"a false node map: rc {p.returncode} (want 2)\n{p.stderr[-2000:]}")
        check(dt < 30, f"refused after {dt:.1f} s")
        want = ("node map: rank 1 (host node2), rank 2 (host node3), rank 3 (host node4) placed on "
                "the node of rank 0 (host node1)")
        check(want in p.stderr, f"no refusal naming the ranks and hosts:\n{p.stderr[-2000:]}")
        check(p.stderr.count("node map:") == 1, "the refusal is printed more than once")
        ok(n0, f"nodemap: refused in {dt:.1f} s")
    finally:
        down()


def bench(tag, out_len=32):
    js = os.path.join(WORK, f"tp-{tag}.json")
    cmd = [os.path.join(HERE, "mpirun.sh"), "-np", "2", "--map-by", "ppr:1:node"] + OB1
    cmd += [K3, "bench", "throughput", "--model", model(), "--ep", "2", "--input-len", "16",
            "--output-len", str(out_len), "--num-prompts", "8", "--threads", "1",
            "--comm-timeout", "60", "--output-json", js]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if not check(p.returncode == 0, f"bench throughput ({tag}): rc {p.returncode}\n{p.stderr[-2000:]}"):
        return None
    return json.load(open(js))


def predict(us):
    """k3 plan's decode and prefill tok/s for this run: 2 cpu nodes of 1 rank, 1 x 2, 4 sequences
    a lane (8 requests over 2 lanes)."""
    p = subprocess.run([K3, "plan", "--model", model(), "--gpu", "cpu", "--nodes", "2",
                        "--gpus-per-node", "1", "--pp", "1", "--ep", "2", "--max-seqs", "4",
                        "--link-latency-us", str(us), "--json"], capture_output=True, text=True)
    if not check(p.returncode == 0, f"k3 plan --link-latency-us {us}: {p.stderr}"):
        return None
    return json.loads(p.stdout)["prediction"]


def case_slow():
    up(2, 1)
    try:
        rows = []
        for ms in (0, 1, 5):
            subprocess.run([os.path.join(HERE, "slow.sh"), "node2", str(ms)], check=True)
            d, pr = bench(f"{ms}ms"), predict(ms * 1000 if ms else 20)
            if d is None or pr is None:
                return
            # predicted elapsed: one prefill step of 128 tokens, then 31 decode steps of 8 tokens
            t_pred = 128 / pr["prefill_tok_s"] + 31 * 8 / pr["decode_tok_s"]
            rows.append((ms, d["elapsed_time"], d["output_tokens_per_second"], t_pred,
                         8 * 31 / t_pred))
        print("| added delay | measured s | measured output tok/s | predicted s | predicted decode "
              "tok/s | measured - 0 ms | predicted - 0 ms |")
        print("|---|---|---|---|---|---|---|")
        for ms, t, tok, tp, ptok in rows:
            print(f"| {ms} ms | {t:.2f} | {tok:.1f} | {tp:.3f} | {ptok:.1f} | {t - rows[0][1]:.2f} | "
                  f"{tp - rows[0][3]:.2f} |", flush=True)
        for a, b in zip(rows, rows[1:]):
            check(b[2] < a[2], f"{b[0]} ms: {b[2]:.1f} tok/s, not below {a[0]} ms's {a[2]:.1f}")
        for ms, t, _, tp, _ in rows[1:]:
            got, want = t - rows[0][1], tp - rows[0][3]
            check(got >= 0.8 * want, f"{ms} ms: the delay added {got:.2f} s, the model {want:.2f} s")
        subprocess.run([os.path.join(HERE, "slow.sh"), "node2", "0", "5"], check=True)
        d = bench("loss5", out_len=16)
        if d is not None:
            print(f"ok 5% loss: {d['elapsed_time']:.2f} s, {d['output_tokens_per_second']:.1f} "
                  "output tok/s", flush=True)
    finally:
        down()


CLIENT = """
import json, sys
from openai import OpenAI
c = OpenAI(base_url=sys.argv[1] + "/v1", api_key="x")
out = []
for p in ([1, 2, 3, 4, 5], [300, 301, 302]):
    r = c.completions.create(model=sys.argv[2], prompt=p, max_tokens=12, temperature=0)
    out.append(r.choices[0].text)
print(json.dumps(out))
"""


def serve_answers(cmd, client_node, host):
    """Start `k3 serve` (cmd), wait for its port, run CLIENT (on client_node through rsh.sh, or
    here), stop the server; the client's answers."""
    log = open(os.path.join(WORK, "serve.log"), "w+")
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    try:
        port, t0 = None, time.time()
        while port is None and time.time() - t0 < 60 and p.poll() is None:
            time.sleep(0.3)
            log.seek(0)
            mm = re.search(r"listening on http://[^:]+:(\d+) ", log.read())
            port = mm.group(1) if mm else None
        if not check(port is not None, "k3 serve did not start:\n" + open(log.name).read()[-2000:]):
            return None
        py = os.path.join(os.path.dirname(sys.executable), "python3")
        script = os.path.join(WORK, "client.py")
        with open(script, "w") as f:
            f.write(CLIENT)
        args = [py, script, f"http://{host}:{port}", "tiny"]
        c = (sh("rsh.sh", client_node, " ".join(args)) if client_node else
             subprocess.run(args, capture_output=True, text=True, timeout=60))
        if not check(c.returncode == 0, f"the openai client failed: {c.stderr[-2000:]}"):
            return None
        return json.loads(c.stdout.strip().splitlines()[-1])
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def case_serve():
    m = model()
    flags = ["--model", m, "--port", "0", "--threads", "1", "--deterministic"]
    want = serve_answers([K3, "serve"] + flags, None, "127.0.0.1")
    up(2, 2)
    try:
        got = serve_answers([os.path.join(HERE, "mpirun.sh"), "-np", "4", "--map-by", "ppr:2:node"] +
                            OB1 + [K3, "serve", "--pp", "2", "--ep", "2", "--host", "0.0.0.0"] + flags,
                            "node2", "node1")
        if want is not None and got is not None:
            if check(got == want, f"serve across nodes: {got} vs one process {want}"):
                print(f"ok serve: the client on node2 got {got} from node1, as from one process",
                      flush=True)
    finally:
        down()


def main():
    case = sys.argv[1] if len(sys.argv) > 1 else ""
    if os.geteuid() != 0:  # namespaces need root here; up.sh says so too, but without the noise
        up(1, 1)
    sh("down.sh")  # a run killed earlier may have left its cluster
    if case == "det":
        case_det(2, 2, [("ob1/tcp", OB1), ("UCX/tcp", UCX)])
    elif case == "det4":
        case_det(4, 1, [("ob1/tcp", OB1)])
    elif case == "partition":
        case_partition()
    elif case == "kill":
        case_kill()
    elif case == "killucx":
        kill_on(4, 1, "node3", [2], "rank 2 alone on node3, UCX/tcp", UCX)
    elif case == "stop":
        case_stop()
    elif case == "batch":
        case_batch()
    elif case == "load":
        case_load()
    elif case == "nodemap":
        case_nodemap()
    elif case == "slow":
        case_slow()
    elif case == "serve":
        case_serve()
    else:
        sys.exit(f"unknown case '{case}' (det, det4, partition, kill, killucx, stop, load, "
                 "nodemap, slow, serve, batch)")
    p = sh("check-clean.sh")
    check(p.returncode == 0, f"left behind after the case: {p.stderr.strip()}")
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("all ok")


if __name__ == "__main__":
    main()
