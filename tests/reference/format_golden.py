#!/usr/bin/env python3
"""format_golden.py — the independent check of k3's checkpoint format (issue 2).

Reads a tiny checkpoint written by `k3 make-tiny DIR --seed 7` with PyPI `safetensors` + `torch`,
dequantises a few routed experts with compressed-tensors' own MXFP4 decompressor
(MXFP4PackedCompressor.decompress: unpack_fp4_from_uint8 + decompress_mx_scale + dequantize) and
converts a few dense tensors (bf16 -> f32, f32 as stored). Writes tests/golden/format/:
  manifest.json  — seed, preset, sha256 of every shard read, and per tensor: file, shape, kind
  *.bin          — raw little-endian float32
The ctest `model_golden_format` re-makes the checkpoint with the same seed, checks the shard
hashes (a stale golden fails with "regenerate with ..."), decodes the same tensors with k3's code
and compares bit for bit. Regenerate (see tests/reference/README.md):
  python3 tests/reference/format_golden.py --k3 build/k3
"""
import argparse, hashlib, json, os, subprocess, sys, tempfile

import torch
from safetensors import safe_open
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

SEED = 7
PRE = "language_model.model.layers."
EXPERTS = [(1, 0), (1, 7), (1, 15), (6, 3), (6, 8), (6, 12)]
DENSE = [PRE + "0.mlp.gate_proj.weight", PRE + "3.self_attn.q_a_proj.weight",
         PRE + "2.self_attn.dt_bias", PRE + "0.self_attn.q_conv1d.weight",
         PRE + "4.block_sparse_moe.gate.weight", PRE + "5.block_sparse_moe.gate.e_score_correction_bias",
         "language_model.model.norm.weight"]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k3", help="k3 binary used to make the checkpoint (seed %d)" % SEED)
    ap.add_argument("--model", help="an existing `k3 make-tiny --seed 7` directory instead")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "golden", "format"))
    a = ap.parse_args()
    tmp = None
    if a.model:
        model = a.model
    else:
        if not a.k3:
            sys.exit("give --k3 BIN or --model DIR")
        tmp = tempfile.TemporaryDirectory()
        model = os.path.join(tmp.name, "tiny")
        subprocess.run([a.k3, "make-tiny", model, "--preset", "tiny", "--seed", str(SEED)], check=True)

    cfg = json.load(open(os.path.join(model, "config.json")))
    q = cfg["quantization_config"]
    assert q["format"] == "mxfp4-pack-quantized"
    wq = q["config_groups"]["group_0"]["weights"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=wq["num_bits"], type=wq["type"], strategy=wq["strategy"],
        group_size=wq["group_size"], symmetric=wq["symmetric"], dynamic=wq["dynamic"],
        scale_dtype=torch.uint8))
    index = json.load(open(os.path.join(model, "model.safetensors.index.json")))["weight_map"]

    def load(name):
        with safe_open(os.path.join(model, index[name]), framework="pt") as f:
            return f.get_tensor(name)

    os.makedirs(a.out, exist_ok=True)
    for fn in os.listdir(a.out):
        if fn.endswith(".bin"):
            os.remove(os.path.join(a.out, fn))
    shards = sorted(set(index.values()))
    man = {"preset": "tiny", "seed": SEED,
           "made_by": "k3 make-tiny DIR --preset tiny --seed %d" % SEED,
           "regenerate": "python3 tests/reference/format_golden.py --k3 BUILD/k3",
           "versions": {"torch": torch.__version__,
                        "compressed_tensors": __import__("compressed_tensors").__version__,
                        "safetensors": __import__("safetensors").__version__},
           "shards": {s: sha256(os.path.join(model, s)) for s in shards},
           "tensors": []}

    def emit(name, t, kind):
        t = t.to(torch.float32).contiguous()
        fn = "t%03d.bin" % len(man["tensors"])
        with open(os.path.join(a.out, fn), "wb") as f:
            f.write(t.numpy().astype("<f4").tobytes())
        man["tensors"].append({"name": name, "file": fn, "shape": list(t.shape), "kind": kind})

    for layer, e in EXPERTS:
        for w in ("w1", "w2", "w3"):
            base = "%s%d.block_sparse_moe.experts.%d.%s" % (PRE, layer, e, w)
            sd = {"weight_packed": load(base + ".weight_packed"),
                  "weight_scale": load(base + ".weight_scale")}
            out = MXFP4PackedCompressor.decompress(sd, scheme)
            emit(base, out["weight"], "mxfp4")
    for name in DENSE:
        t = load(name)
        emit(name, t, {torch.bfloat16: "bf16", torch.float32: "f32"}[t.dtype])
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(man, f, indent=1)
        f.write("\n")
    print("wrote %d tensors to %s" % (len(man["tensors"]), a.out))


if __name__ == "__main__":
    main()
