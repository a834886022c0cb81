#!/usr/bin/env python3
"""load_share.py — one read per node of a stage's dense weights (issue 30, deliverable 2).

`mpirun -np 4 k3 run --pp 1 --ep 4` on the `small` preset (one node), once as it is (the four
lanes share stage 0's dense weights: one rank reads them into node memory, the others map them)
and once with --load-private (each rank reads and holds its own copy). From `--json`'s per-rank
figures it checks, against the checkpoint's own headers (read here with safetensors' format, not
through k3):
  * shared: the bytes read by the node = the unique bytes (every tensor once: the whole file's
    tensors, since 1 x 4 loads everything); private: unique + 3 x the dense bytes;
  * the node's memory (the sum of the ranks' Pss at close, which counts a shared page once) is
    lower by 3 x the dense bytes, within 15%;
  * the generated ids are the same;
  * (two real nodes of two ranks: tests/cluster, case load)
  * --load-mmap: each rank maps its own tensors (bytes read = total + 3 x dense, as private), but
    the pages are the page cache's, held once by the node: its Pss is lower than private's by
    3 x the dense bytes, within 15%, and the generated ids are the same.
usage: load_share.py MPIEXEC   (K3_BIN = the k3 binary)"""
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile

K3 = os.environ["K3_BIN"]
mpiexec = sys.argv[1]
fails = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        fails.append(msg)


def header_bytes(model):
    """(all tensor bytes, dense bytes = all but the routed experts) from the shard headers."""
    total = dense = 0
    for path in glob.glob(os.path.join(model, "*.safetensors")):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h = json.loads(f.read(n))
        for name, t in h.items():
            if name == "__metadata__":
                continue
            b = t["data_offsets"][1] - t["data_offsets"][0]
            total += b
            if ".experts." not in name:
                dense += b
    return total, dense


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "small")
    subprocess.run([K3, "make-tiny", model, "--preset", "small"], check=True, capture_output=True)
    total, dense = header_bytes(model)
    print(f"checkpoint: {total / 1e6:.1f} MB, dense (non-expert) {dense / 1e6:.1f} MB")
    runs = {}
    for mode in ("shared", "private", "mmap"):
        args = [mpiexec, "-np", "4", "--oversubscribe"]
        args += [K3, "run", "--model", model, "--prompt-ids", "1,2,3,4", "--n", "3", "--pp", "1",
                 "--ep", "4", "--max-ctx", "64", "--max-seqs", "2", "--json"]
        args += ["--load-private"] if mode == "private" else []
        args += ["--load-mmap"] if mode == "mmap" else []
        p = subprocess.run(args, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            check(False, f"{mode}: exit {p.returncode}\n{p.stderr[-2000:]}")
            continue
        out = json.loads(p.stdout)
        ranks = out["dist"]["ranks"]
        runs[mode] = {"read": sum(r["bytes_read"] for r in ranks),
                      "pss": sum(r["pss_bytes"] for r in ranks),
                      "ids": [r["generated_ids"] for r in out["results"]]}
        print(f"{mode}: read {runs[mode]['read'] / 1e6:.1f} MB, node Pss {runs[mode]['pss'] / 1e6:.1f} MB")
    if "private" in runs:
        q = runs["private"]
        check(q["read"] == total + 3 * dense,
              f"private: each lane read the dense weights ({q['read']} = {total} + 3 x {dense})")
        for name, k, want, what in (
                ("shared", 3, total, "the node read every byte once"),
                ("mmap", 3, total + 3 * dense, "each lane mapped its own tensors, the node holds them once")):
            if name not in runs:
                continue
            r = runs[name]
            check(r["read"] == want, f"{name}: {what} ({r['read']} = {want})")
            saved = q["pss"] - r["pss"]
            check(abs(saved - k * dense) <= 0.15 * k * dense,
                  f"{name}: node memory lower than private by {saved / 1e6:.1f} MB, "
                  f"{k} x dense = {k * dense / 1e6:.1f} MB (15%)")
            check(r["ids"] == q["ids"], f"{name}: the same generated ids as private")
print(f"load_share: {len(fails)} failed")
sys.exit(1 if fails else 0)
