#!/usr/bin/env python3
"""nonfinite.py — a non-finite activation at run time is named by its layer and op (issue 11
item 3). On a tiny checkpoint with one BF16 NaN written into one weight (no --verify, so the load
accepts it), `k3 run` must fail the request with a message naming the layer and the sub-block
whose output first held the NaN, and the rank (stage, lane) that computed it:
  layers.3.self_attn.o_proj.weight (MLA)                 -> "layer 3, MLA attention output"
  layers.1.self_attn.o_proj.weight (KDA)                 -> "layer 1, KDA attention output"
  layers.5.block_sparse_moe.shared_experts.down_proj     -> "layer 5, MoE FFN output"
  lm_head.weight (the last stage's logits; no layer)     -> "logits (final norm + lm_head)"
  layers.5.block_sparse_moe.gate.e_score_correction_bias (an F32 NaN: every router score is
    non-finite; it used to end the whole job as an internal error) -> "layer 5, MoE FFN output"
on 1 rank, and under mpirun with 2 stages x 2 lanes (layer 5 is on stage 1 there). The good
checkpoint runs clean (no such line).
usage: nonfinite.py MPIEXEC   (K3_BIN = the k3 binary)"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

K3 = os.environ["K3_BIN"]
MPI = sys.argv[1] if len(sys.argv) > 1 else "mpiexec"
BF16_NAN = b"\xc0\x7f"
F32_NAN = b"\x00\x00\xc0\x7f"
fails = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        fails.append(msg)


def poke(model, name, value, elem=5):
    for f in sorted(os.listdir(model)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(model, f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            hdr = json.loads(fh.read(n))
        if name in hdr:
            with open(os.path.join(model, f), "r+b") as fh:
                fh.seek(8 + n + hdr[name]["data_offsets"][0] + elem * len(value))
                fh.write(value)
            return
    raise SystemExit(f"no tensor {name}")


def run(model, world=1, extra=()):
    # --max-ctx 8 (the longest prompt + --n): the plan's layer costs count the MLA cache at
    # --max-ctx, so the 2-stage split below (layers 0-4 | 5-7) is the one of this capacity (the
    # engine's default 4096 puts layer 5 on stage 0)
    cmd = ([MPI, "-np", str(world), "--oversubscribe"] if world > 1 else []) + [K3, "run", "--model", model,
                                                                              "--prompt-ids", "1,2,3,4;5,6",
                                                                              "--n", "4", "--max-ctx", "8"] + list(extra)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


P = "language_model.model."
CASES = [(P + "layers.3.self_attn.o_proj.weight", 3, "MLA attention output"),
         (P + "layers.1.self_attn.o_proj.weight", 1, "KDA attention output"),
         (P + "layers.5.block_sparse_moe.shared_experts.down_proj.weight", 5, "MoE FFN output"),
         ("language_model.lm_head.weight", None, "logits (final norm + lm_head)"),
         (P + "layers.5.block_sparse_moe.gate.e_score_correction_bias", 5, "MoE FFN output", F32_NAN)]

with tempfile.TemporaryDirectory() as tmp:
    good = os.path.join(tmp, "good")
    subprocess.run([K3, "make-tiny", good], check=True, capture_output=True)
    p = run(good)
    check(p.returncode == 0 and "non-finite" not in p.stderr, "good checkpoint: runs, no non-finite line")
    for i, (tensor, layer, op, *nan) in enumerate(CASES):
        bad = os.path.join(tmp, f"bad{i}")
        shutil.copytree(good, bad)
        poke(bad, tensor, nan[0] if nan else BF16_NAN)
        for world, extra in ((1, []), (4, ["--pp", "2", "--ep", "2"])):
            tag = f"NaN in {tensor}, {'1 rank' if world == 1 else '2x2'}"
            p = run(bad, world, extra)
            err = p.stderr
            at = f"layer {layer}, " if layer is not None else ""
            want = rf"non-finite activation \(NaN/Inf\): first in {re.escape(at + op)} \(rank \d+: stage (\d+), lane \d+\)"
            m = re.search(want, err)
            check(p.returncode != 0 and m is not None, f"{tag}: the request fails naming {at}{op}"
                  + ("" if m else f"\n{err[-1500:]}"))
            if m and world > 1:
                # the 2-stage plan of the tiny model: layers 0-4 | 5-7 and the head
                want_stage = 0 if layer is not None and layer < 5 else 1
                check(int(m.group(1)) == want_stage, f"{tag}: names stage {want_stage} (got {m.group(1)})")

print(f"nonfinite: {len(fails)} failures")
sys.exit(1 if fails else 0)
