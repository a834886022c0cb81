#!/usr/bin/env python3
"""corrupt_corpus.py — a corpus of corrupt K3 checkpoints, and k3 inspect run on each (issue 11).

Makes the tiny checkpoint (`k3 make-tiny`), then one directory per corruption: the shard headers
(length field, JSON, UTF-8, NUL, dtypes, shapes, offsets, names, keys, layout), the index, the
config keys, and the tensor data (NaN/Inf in F32/BF16, E8M0 scales of 0xFF). Each variant holds
hard links to the files it leaves alone and a fresh copy of the one it changes. Then it runs
`k3 inspect DIR` on every variant (`k3 inspect --verify DIR` when the corruption is in the data,
which only reading the values can show) and requires, of each one: exit status 1 (refused; not 0,
not a crash), and an output that names the file and the tensor or key, as listed with the variant
(the needles are written here from the corruption, never taken from k3's output). Prints a table
and exits 1 if any variant was accepted or not named.
Issue 34: `k3 run` makes inspect's checks at open, so every variant inspect refuses without
--verify must also be refused by `k3 run` on it (any non-zero exit, within 60 s; the "run"
column), and `k3 run` on the good checkpoint must succeed.

    python3 tests/model/corrupt_corpus.py --k3 build/k3            # make, run, table
    python3 tests/model/corrupt_corpus.py --k3 build/k3 --keep DIR # keep the corpus in DIR
    python3 tests/model/corrupt_corpus.py --k3 build/k3 --list     # the variants and needles

Only the Python standard library; deterministic (no randomness: every change is at a named place).
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

P = "language_model.model."
S1, S2, S3 = ("model-%05d-of-00003.safetensors" % i for i in (1, 2, 3))
IDX = "model.safetensors.index.json"
CFG = "config.json"


def run_rc(k3, d):
    """`k3 run` on a checkpoint: its exit status, or "hang" after 60 s."""
    try:
        return subprocess.run([k3, "run", "--model", d, "--prompt-ids", "1,2", "--n", "1", "--threads", "1",
                               "--max-ctx", "8", "--load-timeout", "30"], capture_output=True, timeout=60).returncode
    except subprocess.TimeoutExpired:
        return "hang"


# ---- reading and writing the pieces of a checkpoint ------------------------------------------
def read_shard(path):
    """(header bytes as stored, incl. padding; data bytes)"""
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    return b[8:8 + n], b[8 + n:]


def write_shard(path, header, data, pad=True, length=None):
    if pad:
        header = header.rstrip(b" ")
        header += b" " * (-len(header) % 8)
    n = len(header) if length is None else length
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + header + data)


def header_json(header):
    return json.loads(header.decode("utf-8"))


def dump(obj):
    return json.dumps(obj, separators=(",", ":")).encode()


class Variant:
    """One corrupt copy: `src` the good checkpoint, `d` its own directory."""

    def __init__(self, src, d):
        self.src, self.d = src, d
        os.makedirs(d)
        for name in os.listdir(src):
            os.link(os.path.join(src, name), os.path.join(d, name))

    def own(self, name):
        """The path of `name` in the variant, as a copy of its own (never write through a link)."""
        p = os.path.join(self.d, name)
        tmp = p + ".tmp"
        shutil.copyfile(p, tmp)
        os.replace(tmp, p)
        return p

    def shard_of(self, tensor):
        return json.load(open(os.path.join(self.src, IDX)))["weight_map"][tensor]

    # header edits
    def header_raw(self, shard, fn, pad=True):
        p = self.own(shard)
        h, d = read_shard(p)
        write_shard(p, fn(h.rstrip(b" ")), d, pad=pad)

    def header_obj(self, shard, fn):
        def edit(h):
            o = header_json(h)
            fn(o)
            return dump(o)
        self.header_raw(shard, edit)

    def entry(self, tensor, fn):
        self.header_obj(self.shard_of(tensor), lambda o: fn(o[tensor]))

    def length(self, shard, fn):
        p = self.own(shard)
        b = bytearray(open(p, "rb").read())
        b[:8] = struct.pack("<Q", fn(struct.unpack("<Q", b[:8])[0]))
        open(p, "wb").write(b)

    # file edits
    def raw(self, name, fn):
        p = self.own(name)
        with open(p, "rb") as f:
            b = f.read()
        with open(p, "wb") as f:
            f.write(fn(b))

    def obj(self, name, fn):
        p = self.own(name)
        o = json.load(open(p))
        fn(o)
        json.dump(o, open(p, "w"), indent=1)

    def text_config(self, fn):
        self.obj(CFG, lambda o: fn(o["text_config"]))

    def index_map(self, fn):
        self.obj(IDX, lambda o: fn(o["weight_map"]))

    def append_tensor(self, shard, name):
        """A valid extra F32 [4] tensor at the end of the shard's data, listed in the index."""
        p = self.own(shard)
        h, d = read_shard(p)
        o = header_json(h)
        o[name] = {"dtype": "F32", "shape": [4], "data_offsets": [len(d), len(d) + 16]}
        write_shard(p, dump(o), d + struct.pack("<4f", 1, 2, 3, 4))
        self.index_map(lambda w: w.__setitem__(name, shard))

    def rename(self, old, new, in_index=True):
        shard = self.shard_of(old)
        self.header_raw(shard, lambda h: h.replace(b'"%s"' % old.encode(), b'"%s"' % new.encode()))
        if in_index:
            self.raw(IDX, lambda t: t.replace(b'"%s"' % old.encode(), b'"%s"' % new.encode()))

    # data edits
    def poke(self, tensor, elem, value):
        """Overwrite element `elem` of tensor with `value` (bytes of one element)."""
        shard = self.shard_of(tensor)
        p = self.own(shard)
        h, _ = read_shard(p)
        e = header_json(h)[tensor]
        size = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1}[e["dtype"]]
        assert len(value) == size
        with open(p, "r+b") as f:
            f.seek(8 + len(h) + e["data_offsets"][0] + elem * size)
            f.write(value)

    def fill(self, tensor, value):
        shard = self.shard_of(tensor)
        p = self.own(shard)
        h, _ = read_shard(p)
        e = header_json(h)[tensor]
        b, en = e["data_offsets"]
        with open(p, "r+b") as f:
            f.seek(8 + len(h) + b)
            f.write(value * ((en - b) // len(value)))


def last_tensor(src, shard):
    h, _ = read_shard(os.path.join(src, shard))
    o = header_json(h)
    return max((k for k in o if k != "__metadata__"), key=lambda k: o[k]["data_offsets"][1])


def first_tensor(src, shard):
    h, _ = read_shard(os.path.join(src, shard))
    o = header_json(h)
    return min((k for k in o if k != "__metadata__"), key=lambda k: o[k]["data_offsets"][0])


BF16_NAN, BF16_PINF, BF16_NINF = struct.pack("<H", 0x7FC0), struct.pack("<H", 0x7F80), struct.pack("<H", 0xFF80)
F32_NAN, F32_PINF, F32_NINF = struct.pack("<f", float("nan")), struct.pack("<f", float("inf")), struct.pack("<f", float("-inf"))


# ---- the corpus --------------------------------------------------------------------------------
def corpus(src):
    """[(name, part, verify, needles, mutate(variant))]: needles name the file and the tensor/key."""
    Q = P + "layers.1.self_attn.q_proj.weight"  # BF16 [128, 128], shard 1
    DT = P + "layers.1.self_attn.dt_bias"  # F32 [128], shard 1
    ALOG = P + "layers.2.self_attn.A_log"  # F32 [8]
    KCONV = P + "layers.0.self_attn.k_conv1d.weight"  # F32 [128, 1, 4]
    EMB = P + "embed_tokens.weight"  # BF16 [4096, 128], shard 1
    HEAD = "language_model.lm_head.weight"  # BF16, shard 3
    SC = P + "layers.3.block_sparse_moe.experts.5.w2.weight_scale"  # E8M0 [96, 2], shard 2
    SC_LAST = P + "layers.7.block_sparse_moe.experts.15.w1.weight_scale"  # E8M0 [64, 3]
    PACKED = P + "layers.3.block_sparse_moe.experts.5.w2.weight_packed"  # U8 [96, 32]
    ROUTER = P + "layers.2.block_sparse_moe.gate.weight"  # BF16 [16, 128]
    BIAS = P + "layers.4.block_sparse_moe.gate.e_score_correction_bias"  # F32 [16]
    SHARED = P + "layers.5.block_sparse_moe.shared_experts.down_proj.weight"  # BF16
    NORM = P + "layers.6.input_layernorm.weight"  # BF16 [128]
    FAQ = P + "layers.1.self_attn.f_a_proj.weight"  # BF16 [32, 128]
    OPROJ = P + "layers.3.self_attn.o_proj.weight"  # BF16 (MLA)
    l2 = last_tensor(src, S2)
    l3 = last_tensor(src, S3)
    f2 = first_tensor(src, S2)
    sq = "model-00001-of-00003.safetensors"
    assert json.load(open(os.path.join(src, IDX)))["weight_map"][Q] == sq

    def ins(after, text):  # insert raw header text right after the bytes `after`
        return lambda h: h.replace(after, after + text, 1)

    def tc(key, value):
        return lambda v: v.text_config(lambda t: t.__setitem__(key, value))

    def la(key, value):
        return lambda v: v.text_config(lambda t: t["linear_attn_config"].__setitem__(key, value))

    def setk(key, value):
        return lambda e: e.__setitem__(key, value)

    def delk(key):
        return lambda e: e.pop(key)

    qk = b'"%s":{' % Q.encode()
    C = []
    wm = json.load(open(os.path.join(src, IDX)))["weight_map"]

    def add(name, part, needles, fn, verify=False):
        if verify:  # a data variant names the shard of its tensor (needles[0])
            needles = [wm[needles[0]]] + needles
        C.append((name, part, verify, needles, fn))

    # -- the shard header: the 8-byte length --------------------------------------------------
    add("len-short-1", "length", [S2, l2], lambda v: v.length(S2, lambda n: n - 1))  # issue 11
    add("len-short-9", "length", [S2, "header"], lambda v: v.length(S2, lambda n: n - 9))
    add("len-long-1", "length", [S2, "header"], lambda v: v.length(S2, lambda n: n + 1))
    add("len-long-64", "length", [S2, "header"], lambda v: v.length(S2, lambda n: n + 64))
    add("len-past-eof", "length", [S1, "header length"], lambda v: v.length(S1, lambda n: 1 << 24))
    add("len-over-limit", "length", [S1, "header length"], lambda v: v.length(S1, lambda n: 1 << 40))
    add("len-zero", "length", [S3, "header"], lambda v: v.length(S3, lambda n: 0))
    add("len-one", "length", [S3, "header"], lambda v: v.length(S3, lambda n: 1))
    add("file-7-bytes", "length", [S3, "header length"], lambda v: v.raw(S3, lambda b: b[:7]))
    # -- the data section's extent -------------------------------------------------------------
    add("junk-4k-after-last", "layout", [S3, l3], lambda v: v.raw(S3, lambda b: b + bytes(range(256)) * 16))  # issue 11
    add("junk-1-after-last", "layout", [S2, l2], lambda v: v.raw(S2, lambda b: b + b"\0"))
    add("truncated-1", "layout", [S2, l2], lambda v: v.raw(S2, lambda b: b[:-1]))
    add("truncated-half", "layout", [S1, "tensor " + P], lambda v: v.raw(S1, lambda b: b[:len(b) // 2]))
    add("hole-first-tensor-dropped", "layout", [S2, "hole before tensor"],
        lambda v: v.header_obj(S2, lambda o: o.pop(f2)))
    add("hole-mid", "layout", [sq, Q], lambda v: v.entry(Q, lambda e: e.__setitem__(
        "data_offsets", [e["data_offsets"][0] + 2, e["data_offsets"][1] + 2])))
    add("overlap", "layout", [sq, FAQ], lambda v: v.header_obj(sq, lambda o: o[FAQ].__setitem__(
        "data_offsets", list(o[Q]["data_offsets"][:1]) + [o[Q]["data_offsets"][0] + 32 * 128 * 2])))
    add("empty-inside-tensor", "layout", [sq, "x.empty"], lambda v: v.header_obj(sq, lambda o: o.__setitem__(
        "x.empty", {"dtype": "F32", "shape": [0], "data_offsets": [o[Q]["data_offsets"][0] + 2] * 2})))
    add("tensor-added-past-end", "layout", [S3, "x.extra"], lambda v: v.header_obj(S3, lambda o: o.__setitem__(
        "x.extra", {"dtype": "U8", "shape": [4], "data_offsets": [o[l3]["data_offsets"][1], o[l3]["data_offsets"][1] + 4]})))
    # -- the header JSON and its strings -------------------------------------------------------
    add("name-nul-junk", "strings", [sq, Q + "\\u0000junk"],
        lambda v: v.header_raw(sq, lambda h: h.replace(qk, b'"%s\\u0000junk":{' % Q.encode())))  # issue 11
    add("name-invalid-utf8", "strings", [sq, "self_attn.q_\\xffroj"],
        lambda v: v.header_raw(sq, lambda h: h.replace(qk, qk.replace(b"q_proj", b"q_\xffroj"))))  # issue 11
    add("name-overlong-utf8", "strings", [sq, "layers.1.self_attn.q\\xc0\\xafproj"],
        lambda v: v.header_raw(sq, lambda h: h.replace(qk, qk.replace(b"q_proj", b"q\xc0\xafproj"))))
    add("name-surrogate-utf8", "strings", [sq, "q\\xed\\xa0\\x80proj"],
        lambda v: v.header_raw(sq, lambda h: h.replace(qk, qk.replace(b"q_proj", b"q\xed\xa0\x80proj"))))
    add("name-truncated-utf8", "strings", [sq, "q\\xe2\\x82proj"],
        lambda v: v.header_raw(sq, lambda h: h.replace(qk, qk.replace(b"q_proj", b"q\xe2\x82proj"))))
    add("name-raw-nul", "strings", [sq, "self_attn.q\\x00proj"],
        lambda v: v.header_raw(sq, lambda h: h.replace(qk, qk.replace(b"q_proj", b"q\x00proj"))))
    add("name-raw-tab", "strings", [sq, "q\\x09proj"],
        lambda v: v.header_raw(sq, lambda h: h.replace(qk, qk.replace(b"q_proj", b"q\tproj"))))
    add("name-lone-surrogate-escape", "strings", [sq, "header"],
        lambda v: v.header_raw(sq, lambda h: h.replace(qk, qk.replace(b"q_proj", b"q\\ud800proj"))))
    add("dtype-nul-suffix", "strings", [sq, Q + ".dtype"], lambda v: v.entry(Q, setk("dtype", "BF16\0x")))
    add("dtype-invalid-utf8", "strings", [sq, Q + ".dtype"],
        lambda v: v.header_raw(sq, lambda h: h.replace(qk + b'"dtype":"BF16"', qk + b'"dtype":"BF\xff6"')))
    add("metadata-value-nul", "strings", [S2, "__metadata__.format"],
        lambda v: v.header_obj(S2, lambda o: o["__metadata__"].__setitem__("format", "pt\0")))
    add("metadata-not-string", "strings", [S2, "__metadata__.format"],
        lambda v: v.header_obj(S2, lambda o: o["__metadata__"].__setitem__("format", 3)))
    add("metadata-not-object", "strings", [S2, "__metadata__"],
        lambda v: v.header_obj(S2, lambda o: o.__setitem__("__metadata__", "pt")))
    add("duplicate-tensor", "json", [sq, Q + ": the key appears twice"],
        lambda v: v.header_raw(sq, ins(b"{", qk + b'"dtype":"BF16","shape":[0],"data_offsets":[0,0]},')))
    add("duplicate-entry-key", "json", [sq, Q + ".dtype: the key appears twice"],
        lambda v: v.header_raw(sq, ins(qk, b'"dtype":"F32",')))
    add("entry-unknown-key", "json", [sq, Q, "unknown key 'strides'"], lambda v: v.entry(Q, setk("strides", [128, 1])))
    add("entry-not-object", "json", [sq, Q], lambda v: v.header_obj(sq, lambda o: o.__setitem__(Q, [1, 2])))
    add("header-is-array", "json", [S3, "header"], lambda v: v.header_raw(S3, lambda h: b"[" + h[1:-1] + b"]"))
    add("header-syntax", "json", [S3, "header is not valid JSON"], lambda v: v.header_raw(S3, lambda h: h[:-1]))
    add("header-leading-space", "json", [S3, "header begins with byte 0x20"],
        lambda v: v.header_raw(S3, lambda h: b" " + h))
    add("header-trailing-text", "json", [S3, "after the JSON value"], lambda v: v.header_raw(S3, lambda h: h + b"x"))
    add("header-trailing-nul-pad", "json", [S2, "after the JSON value"],
        lambda v: v.header_raw(S2, lambda h: h + b"\0" * (8 - len(h) % 8 or 8), pad=False))
    add("header-two-objects", "json", [S3, "after the JSON value"], lambda v: v.header_raw(S3, lambda h: h + b"{}"))
    # -- dtype, shape, data_offsets --------------------------------------------------------------
    add("dtype-unknown", "entry", [sq, Q, "unknown dtype"], lambda v: v.entry(Q, setk("dtype", "Q4_K")))
    add("dtype-lowercase", "entry", [sq, Q, "unknown dtype"], lambda v: v.entry(Q, setk("dtype", "bf16")))
    add("dtype-not-string", "entry", [sq, Q], lambda v: v.entry(Q, setk("dtype", 16)))
    add("dtype-missing", "entry", [sq, Q], lambda v: v.entry(Q, delk("dtype")))
    add("dtype-bf16-as-f16", "entry", [sq, Q, "F16"], lambda v: v.entry(Q, setk("dtype", "F16")))
    add("dtype-f32-as-i32", "entry", [sq, DT, "I32"], lambda v: v.entry(DT, setk("dtype", "I32")))
    add("dtype-bf16-as-f32", "entry", [sq, Q, "data_offsets span"], lambda v: v.entry(Q, setk("dtype", "F32")))
    add("dtype-scale-as-bf16", "entry", [S2, SC, "data_offsets span"], lambda v: v.entry(SC, setk("dtype", "BF16")))
    add("shape-transposed", "entry", [sq, FAQ, "expected BF16 [32, 128]"], lambda v: v.entry(FAQ, setk("shape", [128, 32])))
    add("shape-reshaped", "entry", [sq, Q, "expected BF16 [128, 128]"], lambda v: v.entry(Q, setk("shape", [64, 256])))
    add("shape-3d", "entry", [sq, Q, "expected BF16 [128, 128]"], lambda v: v.entry(Q, setk("shape", [2, 64, 128])))
    add("shape-plus-one", "entry", [sq, Q, "data_offsets span"], lambda v: v.entry(Q, setk("shape", [129, 128])))
    add("shape-negative", "entry", [sq, Q, "shape[0]"], lambda v: v.entry(Q, setk("shape", [-128, -128])))
    add("shape-fraction", "entry", [sq, Q, "shape[1]"], lambda v: v.entry(Q, setk("shape", [128, 127.5])))
    add("shape-string", "entry", [sq, Q, "shape[0]"], lambda v: v.entry(Q, setk("shape", ["128", 128])))
    add("shape-not-array", "entry", [sq, Q], lambda v: v.entry(Q, setk("shape", 16384)))
    add("shape-too-many-dims", "entry", [sq, Q, "dimensions"], lambda v: v.entry(Q, setk("shape", [1, 1, 1, 1, 1, 1, 1, 1, 128, 128])))
    add("shape-overflow", "entry", [sq, Q, "overflows"], lambda v: v.entry(Q, setk("shape", [1 << 40, 1 << 40, 1 << 20])))
    add("offsets-end-plus-2", "entry", [sq, Q, "data_offsets span"],
        lambda v: v.entry(Q, lambda e: e.__setitem__("data_offsets", [e["data_offsets"][0], e["data_offsets"][1] + 2])))
    add("offsets-reversed", "entry", [sq, Q, "data_offsets"],
        lambda v: v.entry(Q, lambda e: e.__setitem__("data_offsets", e["data_offsets"][::-1])))
    add("offsets-three", "entry", [sq, Q, "data_offsets"], lambda v: v.entry(Q, lambda e: e["data_offsets"].append(0)))
    add("offsets-negative", "entry", [sq, Q, "data_offsets"],
        lambda v: v.entry(Q, lambda e: e.__setitem__("data_offsets", [-2, e["data_offsets"][1] - e["data_offsets"][0] - 2])))
    add("offsets-fraction", "entry", [sq, Q, "data_offsets"],
        lambda v: v.entry(Q, lambda e: e.__setitem__("data_offsets", [e["data_offsets"][0] + 0.5, e["data_offsets"][1] + 0.5])))
    add("offsets-missing", "entry", [sq, Q], lambda v: v.entry(Q, delk("data_offsets")))
    add("offsets-huge", "entry", [sq, Q, "data_offsets"],
        lambda v: v.entry(Q, lambda e: e.__setitem__("data_offsets", [1 << 60, (1 << 60) + 32768])))
    # -- names: the catalogue and the index ---------------------------------------------------
    add("tensor-renamed", "names", [Q], lambda v: v.rename(Q, Q.replace("q_proj", "q_prob")))
    add("tensor-renamed-case", "names", [Q], lambda v: v.rename(Q, Q.replace("q_proj", "Q_proj")))
    add("tensor-renamed-header-only", "names", [IDX, Q], lambda v: v.rename(Q, Q.replace("q_proj", "q_prob"), in_index=False))
    add("tensor-extra", "names", [S3, "x.extra"], lambda v: (v.header_obj(S3, lambda o: (
        o.__setitem__("x.extra", {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}))),
        v.index_map(lambda w: w.__setitem__("x.extra", S3))))
    add("tensor-extra-data", "names", [S2, "x.extra2"], lambda v: v.append_tensor(S2, "x.extra2"))  # issue 34
    add("tensor-no-prefix", "names", [Q], lambda v: v.rename(Q, Q[len("language_model."):]))
    # issue 34: a config that drops tensors the files still hold (run used to load these anyway)
    add("config-tied-embeddings", "config", [S3, HEAD, "unexpected"], tc("tie_word_embeddings", True))
    add("config-attn-res-0", "config", [S1, "self_attention_res_norm", "unexpected"], tc("attn_res_block_size", 0))
    add("index-wrong-shard", "index", [IDX, HEAD], lambda v: v.index_map(lambda w: w.__setitem__(HEAD, S1)))
    add("index-missing-entry", "index", [S1, Q, "not listed"], lambda v: v.index_map(lambda w: w.pop(Q)))
    add("index-unknown-shard", "index", ["model-00004-of-00003.safetensors"],
        lambda v: v.index_map(lambda w: w.__setitem__(HEAD, "model-00004-of-00003.safetensors")))
    add("index-path-escape", "index", [IDX, HEAD], lambda v: v.index_map(lambda w: w.__setitem__(HEAD, "../" + S3)))
    add("index-key-nul", "index", [IDX, "weight_map." + Q + "\\u0000x"],
        lambda v: v.raw(IDX, lambda t: t.replace(b'"%s"' % Q.encode(), b'"%s\\u0000x"' % Q.encode())))
    add("index-value-nul", "index", [IDX, "weight_map." + Q + " (its value)"],
        lambda v: v.index_map(lambda w: w.__setitem__(Q, S1 + "\0x")))
    add("index-duplicate-key", "index", [IDX, "weight_map." + Q + ": the key appears twice"],
        lambda v: v.raw(IDX, lambda t: t.replace(b'"weight_map":\t{', b'"weight_map":\t{"%s": "%s",' % (Q.encode(), S2.encode()))))
    add("index-trailing-text", "index", [IDX, "after the JSON value"], lambda v: v.raw(IDX, lambda t: t + b"]"))
    add("index-syntax", "index", [IDX, "invalid JSON"], lambda v: v.raw(IDX, lambda t: t[:-3]))
    add("index-no-weight-map", "index", [IDX, "weight_map"], lambda v: v.obj(IDX, lambda o: o.pop("weight_map")))
    add("index-empty-weight-map", "index", [IDX, "weight_map"], lambda v: v.obj(IDX, lambda o: o.__setitem__("weight_map", {})))
    add("shard-deleted", "index", [S2, "cannot open shard"], lambda v: os.unlink(os.path.join(v.d, S2)))
    # -- config.json keys ------------------------------------------------------------------------
    add("max-position-0", "config", [CFG, "text_config.max_position_embeddings"], tc("max_position_embeddings", 0))  # issue 11
    add("max-position-negative", "config", [CFG, "text_config.max_position_embeddings"], tc("max_position_embeddings", -4096))
    add("max-position-string", "config", [CFG, "text_config.max_position_embeddings"], tc("max_position_embeddings", "1M"))
    add("mtp-layers-negative", "config", [CFG, "text_config.num_nextn_predict_layers"], tc("num_nextn_predict_layers", -1))
    add("topk-method", "config", [CFG, "text_config.topk_method"], tc("topk_method", "greedy"))
    add("grouped-topk-off", "config", [CFG, "text_config.use_grouped_topk"], tc("use_grouped_topk", False))
    add("vocab-zero", "config", [CFG, "text_config.vocab_size"], tc("vocab_size", 0))
    add("eos-outside-vocab", "config", [CFG, "eos_token_id"], tc("eos_token_id", 4096))
    add("experts-per-token-0", "config", [CFG, "text_config.num_experts_per_token"], tc("num_experts_per_token", 0))
    add("rms-eps-zero", "config", [CFG, "text_config.rms_norm_eps"], tc("rms_norm_eps", 0))
    add("situ-beta-inf-as-float", "config", [CFG, "text_config.activation_situ_beta"], tc("activation_situ_beta", 1e300))
    add("gate-lower-bound-positive", "config", [CFG, "text_config.linear_attn_config.gate_lower_bound"], la("gate_lower_bound", 1.0))
    add("conv-kernel-0", "config", [CFG, "text_config.linear_attn_config.short_conv_kernel_size"], la("short_conv_kernel_size", 0))
    add("kda-layer-also-mla", "config", [CFG, "text_config.linear_attn_config.kda_layers"], la("kda_layers", [1, 2, 3, 4, 5, 6]))
    add("layers-9", "config", [IDX, "missing tensor " + P + "layers.8."], lambda v: v.text_config(lambda t: (
        t.__setitem__("num_hidden_layers", 9), t["linear_attn_config"]["kda_layers"].append(9))))
    add("hidden-256", "config", [S1, EMB, "expected BF16 [4096, 256]"], tc("hidden_size", 256))
    add("heads-string", "config", [CFG, "text_config.num_attention_heads"], tc("num_attention_heads", "4"))
    add("hidden-act-gelu", "config", [CFG, "text_config.hidden_act"], tc("hidden_act", "gelu"))
    add("moe-inter-not-32", "config", [CFG, "moe_intermediate_size"], tc("moe_intermediate_size", 48))
    add("quant-format", "config", [CFG, "quantization_config.format"],
        lambda v: v.obj(CFG, lambda o: o["quantization_config"].__setitem__("format", "nvfp4-pack-quantized")))
    add("config-key-nul", "config", [CFG, "text_config.max_position_embeddings\\u0000x"],
        lambda v: v.raw(CFG, lambda t: t.replace(b'"max_position_embeddings"', b'"max_position_embeddings\\u0000x"')))
    add("config-key-invalid-utf8", "config", [CFG, "text_config.v_head\\xffdim"],
        lambda v: v.raw(CFG, lambda t: t.replace(b'"v_head_dim"', b'"v_head\xffdim"')))
    add("config-duplicate-key", "config", [CFG, "text_config.hidden_size: the key appears twice"],
        lambda v: v.raw(CFG, lambda t: t.replace(b'"hidden_size":\t128,', b'"hidden_size":\t128, "hidden_size": 256,')))
    add("config-trailing-text", "config", [CFG, "after the JSON value"], lambda v: v.raw(CFG, lambda t: t + b"}"))
    add("config-raw-nul", "config", [CFG, "NUL byte"], lambda v: v.raw(CFG, lambda t: t + b"\0{}"))
    add("config-syntax", "config", [CFG, "invalid JSON"], lambda v: v.raw(CFG, lambda t: t.replace(b":", b"", 1)))
    # -- tensor data (k3 inspect --verify) -----------------------------------------------------------
    add("bf16-nan", "data", [Q, "row 5"], lambda v: v.poke(Q, 5 * 128 + 7, BF16_NAN), True)  # issue 11
    add("bf16-pinf-embedding", "data", [EMB, "row 4095"], lambda v: v.poke(EMB, 4095 * 128 + 127, BF16_PINF), True)
    add("bf16-ninf-head", "data", [HEAD, "row 0"], lambda v: v.poke(HEAD, 3, BF16_NINF), True)
    add("f32-nan-dt-bias", "data", [DT, "element 17"], lambda v: v.poke(DT, 17, F32_NAN), True)
    add("f32-inf-a-log", "data", [ALOG, "element 0"], lambda v: v.poke(ALOG, 0, F32_PINF), True)
    add("f32-ninf-conv", "data", [KCONV, "row 9"], lambda v: v.poke(KCONV, 9 * 4 + 3, F32_NINF), True)
    add("e8m0-ff-one-expert", "data", [SC, "row 40", "0xFF"], lambda v: v.poke(SC, 40 * 2 + 1, b"\xff"), True)  # issue 11
    add("e8m0-ff-last-expert", "data", [SC_LAST, "row 63"], lambda v: v.poke(SC_LAST, 63 * 3 + 2, b"\xff"), True)
    add("bf16-nan-router", "data", [ROUTER, "row 15"], lambda v: v.poke(ROUTER, 15 * 128, BF16_NAN), True)
    add("f32-inf-router-bias", "data", [BIAS, "element 15"], lambda v: v.poke(BIAS, 15, F32_PINF), True)
    add("bf16-nan-shared-expert", "data", [SHARED, "row 1"], lambda v: v.poke(SHARED, 64 + 1, BF16_NAN), True)
    add("bf16-inf-norm", "data", [NORM, "element 64"], lambda v: v.poke(NORM, 64, BF16_PINF), True)
    add("bf16-nan-mla-o-proj", "data", [OPROJ, "row 2"], lambda v: v.poke(OPROJ, 2 * 64 + 5, BF16_NAN), True)
    add("bf16-all-nan", "data", [FAQ, "in 32 rows in all"], lambda v: v.fill(FAQ, BF16_NAN), True)
    add("e8m0-all-ff", "data", [SC, "in 96 rows in all"], lambda v: v.fill(SC, b"\xff"), True)
    return C, PACKED


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k3", default=os.environ.get("K3_BIN"), help="the k3 binary (default $K3_BIN)")
    ap.add_argument("--keep", metavar="DIR", help="build the corpus in DIR (must not exist) and keep it")
    ap.add_argument("--list", action="store_true", help="list the variants and exit")
    a = ap.parse_args()
    if not a.k3:
        ap.error("give --k3 or set K3_BIN")
    root = a.keep or tempfile.mkdtemp(prefix="k3-corpus-")
    if a.keep:
        os.makedirs(root)
    try:
        good = os.path.join(root, "good")
        t0 = time.time()
        subprocess.run([a.k3, "make-tiny", good], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if a.list:
            C, _ = corpus(good)
            for name, part, verify, needles, _ in C:
                print("%-28s %-8s %-8s %s" % (name, part, "--verify" if verify else "", needles))
            print("%d variants" % len(C))
            return 0
        ok = subprocess.run([a.k3, "inspect", "--verify", good], capture_output=True, text=True)
        if ok.returncode != 0:
            print("FAIL the good checkpoint is refused:\n" + ok.stderr)
            return 1
        if run_rc(a.k3, good) != 0:
            print("FAIL k3 run refuses the good checkpoint")
            return 1
        C, packed = corpus(good)
        names = [c[0] for c in C]
        assert len(set(names)) == len(names), "variant names repeat"
        # a 0xFF byte of packed MXFP4 nibbles is two valid codes: the good control must pass
        controls = [("packed-ff-is-valid", lambda v: v.poke(packed, 0, b"\xff"))]
        rows, bad = [], 0
        for name, fn in controls:
            v = Variant(good, os.path.join(root, "ok-" + name))
            fn(v)
            r = subprocess.run([a.k3, "inspect", "--verify", v.d], capture_output=True, text=True, timeout=60)
            if r.returncode != 0:
                bad += 1
                print("FAIL control %s refused: %s" % (name, r.stderr.strip().splitlines()[-1:]))
        t_gen = 0.0
        for i, (name, part, verify, needles, fn) in enumerate(C):
            tg = time.time()
            v = Variant(good, os.path.join(root, "%03d-%s" % (i, name)))
            fn(v)
            t_gen += time.time() - tg
            cmd = [a.k3, "inspect"] + (["--verify"] if verify else []) + [v.d]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, errors="replace")
                rc, out = r.returncode, r.stdout + r.stderr
            except subprocess.TimeoutExpired:
                rc, out = "hang", ""
            missing = [n for n in needles if n not in out]
            verdict = "refused" if rc == 1 and not missing else ("ACCEPTED" if rc == 0 else "FAIL")
            run = "-" if verify else run_rc(a.k3, v.d)  # the data corruptions need --verify
            if run in (0, "hang") or (isinstance(run, int) and run < 0):
                verdict = "RUN-ACCEPTED" if run == 0 else "RUN-FAIL"
            bad += verdict != "refused"
            first = next((ln for ln in r.stderr.splitlines() if ln.startswith("k3 inspect:") and "verify:" not in ln), "") \
                if rc != "hang" else "(no answer in 60 s)"
            first = first.replace(root + "/", "").replace("k3 inspect: ", "")
            rows.append((i, name, part, "verify" if verify else "", str(rc), verdict, missing, first, str(run)))
        print("%-3s %-28s %-8s %-6s %-3s %-4s %-8s %s" % ("#", "variant", "part", "mode", "rc", "run", "verdict",
                                                          "error (first line)"))
        for i, name, part, mode, rc, verdict, missing, first, run in rows:
            print("%-3d %-28s %-8s %-6s %-3s %-4s %-8s %s" % (i, name, part, mode, rc, run, verdict, first[:150]))
            if missing:
                print("      output lacks: %s" % missing)
        parts = {}
        for row in rows:
            parts.setdefault(row[2], [0, 0])
            parts[row[2]][0] += 1
            parts[row[2]][1] += row[5] == "refused"
        print("by part: " + ", ".join("%s %d/%d" % (p, n[1], n[0]) for p, n in parts.items()))
        n_ok = sum(r[5] == "refused" for r in rows)
        n_acc = sum(r[5] == "ACCEPTED" for r in rows)
        print("corpus: %d variants, %d refused naming the file and the tensor or key, %d accepted, %d other failures; "
              "%.1f s (%.1f s making variants)" % (len(rows), n_ok, n_acc, len(rows) - n_ok - n_acc, time.time() - t0, t_gen))
        if len(rows) < 80:
            print("FAIL the corpus has %d variants (issue 11 asks for at least 80)" % len(rows))
            bad += 1
        return 1 if bad else 0
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
