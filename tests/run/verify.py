#!/usr/bin/env python3
"""verify.py — `k3 run --verify` (issue 11 item 3): after loading, each rank checks the bytes of
its own tensors. On a tiny checkpoint with one NaN put into a BF16 weight (and, separately, one
E8M0 scale of 0xFF in an MXFP4 expert), `k3 run --verify` must fail (exit != 0) naming the tensor,
the row and the file; on the good checkpoint it runs and prints what the check cost. Under mpirun
(2 stages x 2 lanes) only the ranks that own the tensor report it.
usage: verify.py MPIEXEC   (K3_BIN = the k3 binary)"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

K3 = os.environ["K3_BIN"]
MPI = sys.argv[1] if len(sys.argv) > 1 else "mpiexec"
fails = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        fails.append(msg)


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 8 + n, json.loads(f.read(n))


def poke(model, want, value):
    """Write `value` (bytes) over element 5 of the first tensor whose name ends with `want`."""
    for f in sorted(os.listdir(model)):
        if not f.endswith(".safetensors"):
            continue
        base, hdr = header(os.path.join(model, f))
        for name, meta in hdr.items():
            if name != "__metadata__" and name.endswith(want):
                off = base + meta["data_offsets"][0] + 5 * len(value)
                with open(os.path.join(model, f), "r+b") as fh:
                    fh.seek(off)
                    fh.write(value)
                return name, f
    raise SystemExit(f"no tensor ending with {want}")


def run(args, world=1):
    cmd = ([MPI, "-np", str(world), "--oversubscribe"] if world > 1 else []) + [K3, "run"] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


with tempfile.TemporaryDirectory() as tmp:
    good = os.path.join(tmp, "good")
    subprocess.run([K3, "make-tiny", good], check=True, capture_output=True)
    p = run(["--model", good, "--prompt-ids", "1,2,3", "--n", "2", "--verify"])
    check(p.returncode == 0 and "--verify: checked" in p.stderr and "GB/s" in p.stderr,
          "good checkpoint: --verify passes and reports its cost")
    cases = [("self_attn.q_proj.weight", b"\xc0\x7f", "NaN"),  # a BF16 NaN
             ("w1.weight_scale", b"\xff", "0xFF")]              # an E8M0 NaN scale
    for suffix, value, what in cases:
        bad = os.path.join(tmp, "bad")
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(good, bad)
        name, shard = poke(bad, suffix, value)
        for world, extra in ((1, []), (4, ["--pp", "2", "--ep", "2"])):
            p = run(["--model", bad, "--prompt-ids", "1,2,3", "--n", "2", "--verify",
                     "--comm-timeout", "30"] + extra, world)
            err = p.stderr
            check(p.returncode != 0 and name in err and shard in err and "row" in err,
                  f"{what} in {name} ({world} rank{'s' if world > 1 else ''}): exit {p.returncode}, "
                  f"names tensor, row and file")
            if p.returncode == 0 or name not in err:
                print(err[-1500:])
print("verify:", "FAIL" if fails else "PASS")
sys.exit(1 if fails else 0)
