#!/usr/bin/env python3
"""k3_reference.py — the independent PyTorch reference of the Kimi-K3 text forward pass, and the
generator/checker of the forward goldens in tests/golden/forward/ (format: FORMAT.md there).

Owns: reading a native K3 checkpoint (config.json + safetensors shards) with `safetensors`,
dequantising the routed experts with compressed-tensors' own MXFP4PackedCompressor, the forward
of spec/K3-MODEL.md §1–§5 written from the spec alone (never from k3's C sources), and the
goldens (logits, per-layer hidden states, greedy continuations, manifest with sha256s).
Precision: float64 everywhere. The KDA delta-rule core is fla's own `naive_recurrent_kda`,
executed in float64 (see _TorchFloat64); it is cross-checked against fla's `naive_chunk_kda`,
against a float64 transcription of the spec recurrence, and against stock fp32 fla.

Usage (see tests/reference/README.md):
  python3 tests/reference/k3_reference.py --k3 BUILD/k3            # make-tiny, write goldens
  python3 tests/reference/k3_reference.py --model DIR               # an existing checkpoint
  python3 tests/reference/k3_reference.py --k3 BUILD/k3 --check     # recompute and compare
"""
import argparse
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
    import einops  # noqa: F401  (fla's naive.py needs it)
    import safetensors  # noqa: F401
    import compressed_tensors  # noqa: F401
    _MISSING = None if importlib.util.find_spec("fla") else "No module named 'fla'"
except ImportError as _e:
    _MISSING = str(_e)
if _MISSING:
    # ctest sets K3_REF_SKIP_MISSING=1: skipped (77) with a loud line, or failed under CI=true
    # (tests/k3_skip.py); run by hand, a missing package is an error.
    if os.environ.get("K3_REF_SKIP_MISSING") == "1":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from k3_skip import skip
        skip("reference_goldens_current", f"missing python package ({_MISSING})")
    print(f"k3_reference: missing python package ({_MISSING}); "
          "pip install -r tests/reference/requirements.txt", file=sys.stderr)
    sys.exit(1)

torch.set_grad_enabled(False)
DT = torch.float64

# ---------------------------------------------------------------------------------------------
# conventions (documented in FORMAT.md; the C side must match them)
L2NORM_EPS = 1e-6          # fla l2norm: x * rsqrt(sum(x^2) + 1e-6), used for KDA q and k
MLA_NORM_EPS = 1e-6        # q_a_layernorm / kv_a_layernorm (K3-MODEL.md §3.2, §11.1)
ROUTER_RENORM_EPS = 1e-20  # w / (sum(w) + 1e-20) (K3-MODEL.md §4.3)
PREFIX = "language_model."
# --check: recomputed vs committed goldens (tests/tolerances.h, read by tests/k3_tolerances.py)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_tolerances import TOL as _TOL  # noqa: E402

GOLDEN_REGEN_TOL = _TOL["K3_TOL_GOLDEN_REGEN_REL_L2"]
N_GREEDY = 32
PROMPT_SEED = 20261129
PROMPT_LENGTHS = [("short", 5), ("medium", 40), ("long", 150)]


# ---------------------------------------------------------------------------------------------
# fla (KDA core). fla's naive kernels cast every input with `.to(torch.float)` (fp32). To keep
# the goldens float64 while still running fla's OWN code, naive.py is loaded a second time from
# its file with a `torch` namespace in which `torch.float` means float64 (every other name is the
# real torch). The stock fp32 functions are kept for the cross-check.
class _TorchFloat64:
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _fla_naive_path():
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the fla package (flash-linear-attention) is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")


def _load_naive_module(path, name, torch_ns):
    s = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(s)
    s.loader.exec_module(m)
    if torch_ns is not None:
        m.torch = torch_ns  # the functions look `torch` up in their module globals at call time
    return m


def _load_fla_naive():
    path = _fla_naive_path()
    try:
        import fla
        version = getattr(fla, "__version__", "?")
    except Exception:  # pragma: no cover - importing fla may want Triton/GPU on some machines
        version = "?(naive.py loaded from file)"
    m32 = _load_naive_module(path, "fla_kda_naive_fp32", None)
    m64 = _load_naive_module(path, "fla_kda_naive_fp64", _TorchFloat64())
    return m64.naive_recurrent_kda, m64.naive_chunk_kda, m32.naive_recurrent_kda, version, path


def _load_fla_gate():
    try:
        from fla.ops.kda.gate import naive_kda_lowerbound_gate
        return naive_kda_lowerbound_gate
    except Exception:  # pragma: no cover
        return None


(naive_recurrent_kda, naive_chunk_kda, naive_recurrent_kda_fp32, FLA_VERSION,
 FLA_NAIVE_PATH) = _load_fla_naive()
fla_lowerbound_gate = _load_fla_gate()


# ---------------------------------------------------------------------------------------------
# config
class Cfg:
    """Every shape and switch of the text model, read from config.json (text_config)."""

    def __init__(self, path):
        with open(path) as f:
            top = json.load(f)
        c = top.get("text_config", top)
        self.raw = c

        def req(key, src=c):
            if key not in src:
                raise SystemExit(f"error: {path}: missing key text_config.{key}")
            return src[key]

        self.V = int(req("vocab_size"))
        self.D = int(req("hidden_size"))
        self.L = int(req("num_hidden_layers"))
        self.eps = float(req("rms_norm_eps"))
        self.tie = bool(c.get("tie_word_embeddings", False))
        self.block = int(req("attn_res_block_size"))
        if self.block <= 0:
            raise SystemExit(f"error: {path}: attn_res_block_size={self.block}: only the AttnRes "
                             "(K3) residual is implemented in the reference")
        # MLA
        self.H = int(req("num_attention_heads"))
        self.q_lora = int(c.get("q_lora_rank") or 0)
        self.kv_lora = int(req("kv_lora_rank"))
        self.dn = int(req("qk_nope_head_dim"))
        self.dr = int(req("qk_rope_head_dim"))
        self.dv = int(req("v_head_dim"))
        self.mla_gate = bool(c.get("mla_use_output_gate", False))
        if not c.get("mla_use_nope", True):
            raise SystemExit(f"error: {path}: mla_use_nope=false (RoPE MLA) is not K3")
        # KDA
        la = req("linear_attn_config")
        full = [int(i) - 1 for i in req("full_attn_layers", la)]  # 1-based in config.json
        self.is_mla = [l in full for l in range(self.L)]
        if "kda_layers" in la:
            kda = sorted(int(i) - 1 for i in la["kda_layers"])
            if kda != [l for l in range(self.L) if not self.is_mla[l]]:
                raise SystemExit(f"error: {path}: linear_attn_config.kda_layers and "
                                 "full_attn_layers do not partition the layers")
        self.kH = int(req("num_heads", la))
        self.kdk = int(req("head_dim", la))
        self.kconv = int(req("short_conv_kernel_size", la))
        lb = la.get("gate_lower_bound")
        self.lower_bound = None if lb is None else float(lb)
        self.full_rank_gate = bool(la.get("use_full_rank_gate", False))
        if not self.full_rank_gate:
            raise SystemExit(f"error: {path}: use_full_rank_gate=false (Kimi-Linear g_a/g_b) "
                             "is not implemented in the reference")
        # FFN
        act = c.get("hidden_act", "situ")
        if act != "situ":
            raise SystemExit(f"error: {path}: hidden_act={act!r}: reference implements 'situ'")
        self.situ_beta = float(req("activation_situ_beta"))
        lbeta = c.get("activation_situ_linear_beta")
        self.situ_lbeta = 0.0 if lbeta is None else float(lbeta)
        self.F = int(req("intermediate_size"))
        self.first_dense = int(req("first_k_dense_replace"))
        self.moe_freq = int(c.get("moe_layer_freq", 1))
        self.E = int(req("num_experts"))
        self.topk = int(req("num_experts_per_token"))
        self.n_shared = int(c.get("num_shared_experts", 0))
        self.I = int(req("moe_intermediate_size"))
        self.latent = int(c.get("routed_expert_hidden_size") or 0)
        self.latent_norm = bool(c.get("latent_moe_use_norm", False))
        self.renorm = bool(c.get("moe_renormalize", True))
        self.rsf = float(c.get("routed_scaling_factor", 1.0))
        self.n_group = int(c.get("num_expert_group") or 1)
        self.topk_group = int(c.get("topk_group") or 1)
        rf = c.get("moe_router_activation_func", "sigmoid")
        if rf != "sigmoid":
            raise SystemExit(f"error: {path}: moe_router_activation_func={rf!r}: only sigmoid")
        self.qcfg = c.get("quantization_config") or top.get("quantization_config")

    def is_moe(self, l):
        # DeepSeek/Kimi rule: layer >= first_k_dense_replace and layer % moe_layer_freq == 0
        return self.E > 0 and l >= self.first_dense and l % max(self.moe_freq, 1) == 0

    def summary(self):
        return {
            "vocab_size": self.V, "hidden_size": self.D, "n_layers": self.L,
            "mla_layers": [l for l in range(self.L) if self.is_mla[l]],
            "moe_layers": [l for l in range(self.L) if self.is_moe(l)],
            "attn_res_block_size": self.block, "n_heads": self.H, "q_lora_rank": self.q_lora,
            "kv_lora_rank": self.kv_lora, "qk_nope_head_dim": self.dn,
            "qk_rope_head_dim": self.dr, "v_head_dim": self.dv, "kda_n_heads": self.kH,
            "kda_head_dim": self.kdk, "kda_conv_kernel": self.kconv,
            "kda_gate_lower_bound": self.lower_bound, "intermediate_size": self.F,
            "n_experts": self.E, "n_experts_per_tok": self.topk,
            "n_shared_experts": self.n_shared, "moe_intermediate_size": self.I,
            "latent_size": self.latent, "n_group": self.n_group, "topk_group": self.topk_group,
            "rms_norm_eps": self.eps,
        }


# ---------------------------------------------------------------------------------------------
# checkpoint
def shard_files(model_dir):
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            wm = json.load(f)["weight_map"]
        return sorted(set(wm.values())), "model.safetensors.index.json"
    if os.path.exists(os.path.join(model_dir, "model.safetensors")):
        return ["model.safetensors"], None
    raise SystemExit(f"error: {model_dir}: no model.safetensors.index.json or model.safetensors")


def load_tensors(model_dir):
    from safetensors import safe_open
    files, _ = shard_files(model_dir)
    out = {}
    for fn in files:
        with safe_open(os.path.join(model_dir, fn), framework="pt") as f:
            for k in f.keys():
                if k in out:
                    raise SystemExit(f"error: tensor {k} appears in two shards")
                out[k] = f.get_tensor(k)
    return out


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_hashes(model_dir):
    files, idx = shard_files(model_dir)
    names = ["config.json"] + ([idx] if idx else []) + files
    return {n: sha256_file(os.path.join(model_dir, n)) for n in names}


class Weights:
    """Name lookup with the language_model. prefix; float64 copies; MXFP4 experts dequantised by
    compressed-tensors."""

    def __init__(self, cfg, tensors):
        self.cfg = cfg
        self.t = tensors
        self.used = set()
        self._cache = {}
        self.mxfp4_checked = 0

    def raw(self, name):
        full = PREFIX + name
        if full not in self.t:
            raise SystemExit(f"error: checkpoint has no tensor {full}")
        self.used.add(full)
        return self.t[full]

    def has(self, name):
        return (PREFIX + name) in self.t

    def f(self, name, shape=None):
        if name not in self._cache:
            x = self.raw(name).to(DT)
            if shape is not None and tuple(x.shape) != tuple(shape):
                raise SystemExit(f"error: tensor {PREFIX + name}: shape {tuple(x.shape)}, "
                                 f"expected {tuple(shape)}")
            self._cache[name] = x
        return self._cache[name]

    def expert(self, l, e, which, shape):
        """Routed expert matrix `which` (w1/w2/w3) as float64 [out, in]."""
        key = f"model.layers.{l}.block_sparse_moe.experts.{e}.{which}"
        if key in self._cache:
            return self._cache[key]
        if self.has(key + ".weight_packed"):
            packed = self.raw(key + ".weight_packed")
            scale = self.raw(key + ".weight_scale")
            w = mxfp4_decompress(packed, scale)
            if self.mxfp4_checked < 4:  # cross-check compressed-tensors vs the spec §7.1 table
                check_mxfp4_against_spec(packed, scale, w, PREFIX + key)
                self.mxfp4_checked += 1
        else:
            w = self.raw(key + ".weight")
        w = w.to(DT)
        if tuple(w.shape) != tuple(shape):
            raise SystemExit(f"error: expert {PREFIX + key}: shape {tuple(w.shape)}, "
                             f"expected {tuple(shape)}")
        self._cache[key] = w
        return w


_MXFP4_SCHEME = None


def mxfp4_decompress(packed, scale):
    """compressed-tensors' own mxfp4-pack-quantized decompression (E2M1 nibbles, E8M0 scale)."""
    global _MXFP4_SCHEME
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    if _MXFP4_SCHEME is None:
        args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32,
                                symmetric=True, dynamic=False, scale_dtype=torch.uint8)
        _MXFP4_SCHEME = QuantizationScheme(targets=["Linear"], weights=args)
    out = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale},
                                           _MXFP4_SCHEME)
    return out["weight"]


def check_mxfp4_against_spec(packed, scale, w, name):
    """Self-check only (the goldens use compressed-tensors' result): K3-MODEL.md §7.1 says
    low nibble = even element, E2M1 table, scale 2^(e-127)."""
    tab = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=DT)
    p = packed.to(torch.int64)
    codes = torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1)
    val = tab[codes & 7] * torch.where((codes & 8) != 0, -1.0, 1.0).to(DT)
    sc = torch.pow(torch.tensor(2.0, dtype=DT), scale.to(DT) - 127.0)
    val = val * sc.repeat_interleave(32, dim=1)
    if not torch.equal(val, w.to(DT)):
        raise SystemExit(f"error: {name}: compressed-tensors MXFP4 decode disagrees with the "
                         "spec §7.1 layout")


# ---------------------------------------------------------------------------------------------
# math helpers (K3-MODEL.md preamble)
def rmsnorm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def situ(g, u, beta, lbeta):
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    b = lbeta * torch.tanh(u / lbeta) if lbeta > 0 else u
    return a * b


def attnres_mix(sources, w, eps):
    """§1.3: scores on RMS-normalised sources against w = res_norm ⊙ res_proj, softmax over the
    sources (depth), weighted sum of the RAW sources. sources: list of [T, D]."""
    v = torch.stack(sources, 0)                                     # [N+1, T, D]
    vn = v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)
    s = (vn * w).sum(-1)                                            # [N+1, T]
    a = torch.softmax(s, dim=0)
    return (a[..., None] * v).sum(0)                                # [T, D]


def res_score(W, name):
    D = W.cfg.D
    n = W.f(f"{name}_norm.weight", (D,))
    p = W.f(f"{name}_proj.weight", (1, D))
    return n * p[0]


# ---------------------------------------------------------------------------------------------
# KDA (§2)
def kda_spec_recurrence_f64(q, k, v, g, beta, scale):
    """Self-check only: §2.2 recurrence transcribed literally in float64 (S in R^{dk x dv})."""
    T, H, dk = q.shape
    dv = v.shape[-1]
    S = torch.zeros(H, dk, dv, dtype=DT)
    o = torch.zeros(T, H, dv, dtype=DT)
    for t in range(T):
        S = S * torch.exp(g[t])[:, :, None]
        kt = k[t]
        pred = torch.einsum("hk,hkv->hv", kt, S)
        S = S + beta[t][:, None, None] * kt[:, :, None] * (v[t] - pred)[:, None, :]
        o[t] = scale * torch.einsum("hk,hkv->hv", q[t], S)
    return o


def kda_layer(W, l, x, stats):
    c = W.cfg
    T, D = x.shape
    H, dk, K = c.kH, c.kdk, c.kconv
    P = H * dk
    pre = f"model.layers.{l}.self_attn."

    def proj_conv(name):
        y = x @ W.f(pre + f"{name}_proj.weight", (P, D)).T                      # [T, P]
        w = W.f(pre + f"{name}_conv1d.weight", (P, 1, K))                      # depthwise
        # causal depthwise conv: out[t,c] = sum_j w[c,0,j] * y[t-(K-1)+j, c], y[<0] = 0
        yc = F.conv1d(y.T[None], w, padding=K - 1, groups=P)[0, :, :T].T
        return F.silu(yc).reshape(T, H, dk)

    q, k, v = proj_conv("q"), proj_conv("k"), proj_conv("v")
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)

    R = W.raw(pre + "f_a_proj.weight").shape[0]
    r = (x @ W.f(pre + "f_a_proj.weight", (R, D)).T) @ W.f(pre + "f_b_proj.weight", (P, R)).T
    r = r + W.f(pre + "dt_bias", (P,))
    r = r.reshape(T, H, dk)
    a_log = W.f(pre + "A_log")
    if a_log.numel() < H:
        raise SystemExit(f"error: {PREFIX + pre}A_log has {a_log.numel()} < {H} heads")
    a_log = a_log.reshape(-1)[:H]
    if c.lower_bound is not None:
        g = c.lower_bound * torch.sigmoid(torch.exp(a_log)[:, None] * r)
    else:
        g = -torch.exp(a_log)[:, None] * F.softplus(r)
    if fla_lowerbound_gate is not None and c.lower_bound is not None:
        g_fla = fla_lowerbound_gate(r.reshape(T, H, dk), a_log, None, c.lower_bound,
                                    output_dtype=DT)
        stats["gate_vs_fla_max_abs"] = max(stats.get("gate_vs_fla_max_abs", 0.0),
                                           float((g - g_fla).abs().max()))
    beta = torch.sigmoid(x @ W.f(pre + "b_proj.weight", (H, D)).T)                 # [T, H]

    scale = dk ** -0.5
    args = (q[None], k[None], v[None], g[None], beta[None])
    if stats.get("kda_core") == "fla_fp32":  # sensitivity probe only (see compute_goldens)
        o, _ = naive_recurrent_kda_fp32(*args, scale=scale)
    else:                                   # the goldens: fla's naive recurrence in float64
        o, _ = naive_recurrent_kda(*args, scale=scale)
    o = o[0].to(DT)                                                                 # [T, H, dk]

    # self-checks: fla chunked (64, zero-padded tail), the float64 spec transcription, and
    # the stock fp32 fla kernel, all against the float64 fla recurrence used for the goldens
    if stats.get("selfcheck", True):
        BT = 64
        Tp = ((T + BT - 1) // BT) * BT
        pad = lambda z: F.pad(z, [0, 0] * (z.dim() - 1) + [0, Tp - T])  # noqa: E731
        oc, _ = naive_chunk_kda(pad(q)[None], pad(k)[None], pad(v)[None], pad(g)[None],
                                F.pad(beta, [0, 0, 0, Tp - T])[None], scale=scale, chunk_size=BT)
        oc = oc[0, :T].to(DT)
        o_spec = kda_spec_recurrence_f64(q, k, v, g, beta, scale)
        o32, _ = naive_recurrent_kda_fp32(*args, scale=scale)
        o32 = o32[0].to(DT)
        nrm = float(o.norm())
        for key, other in (("kda_chunk64_vs_recurrent_rel", oc),
                           ("kda_spec_f64_vs_fla_f64_rel", o_spec),
                           ("kda_fla_fp32_vs_fla_f64_rel", o32)):
            stats[key] = max(stats.get(key, 0.0), float((other - o).norm()) / nrm)

    G = (x @ W.f(pre + "g_proj.weight", (P, D)).T).reshape(T, H, dk)
    on = rmsnorm(o, W.f(pre + "o_norm.weight", (dk,)), c.eps) * torch.sigmoid(G)
    return on.reshape(T, P) @ W.f(pre + "o_proj.weight", (D, P)).T


# ---------------------------------------------------------------------------------------------
# MLA (§3), non-absorbed
def mla_layer(W, l, x, gate=True):
    c = W.cfg
    T, D = x.shape
    H, dn, dr, dv, Rkv = c.H, c.dn, c.dr, c.dv, c.kv_lora
    pre = f"model.layers.{l}.self_attn."
    if c.q_lora > 0:
        cq = rmsnorm(x @ W.f(pre + "q_a_proj.weight", (c.q_lora, D)).T,
                     W.f(pre + "q_a_layernorm.weight", (c.q_lora,)), MLA_NORM_EPS)
        q = cq @ W.f(pre + "q_b_proj.weight", (H * (dn + dr), c.q_lora)).T
    else:
        q = x @ W.f(pre + "q_proj.weight", (H * (dn + dr), D)).T
    q = q.reshape(T, H, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    ckv = x @ W.f(pre + "kv_a_proj_with_mqa.weight", (Rkv + dr, D)).T
    cl = rmsnorm(ckv[:, :Rkv], W.f(pre + "kv_a_layernorm.weight", (Rkv,)), MLA_NORM_EPS)
    k_pe = ckv[:, Rkv:]                                                           # [T, dr]
    kv = (cl @ W.f(pre + "kv_b_proj.weight", (H * (dn + dv), Rkv)).T).reshape(T, H, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    scale = 1.0 / math.sqrt(dn + dr)
    s = torch.einsum("thd,shd->hts", q_nope, k_nope) + torch.einsum("thd,sd->hts", q_pe, k_pe)
    s = s * scale
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    a = torch.einsum("hts,shd->thd", p, v).reshape(T, H * dv)
    if c.mla_gate and gate:
        a = a * torch.sigmoid(x @ W.f(pre + "g_proj.weight", (H * dv, D)).T)
    return a @ W.f(pre + "o_proj.weight", (D, H * dv)).T


# ---------------------------------------------------------------------------------------------
# FFN (§4)
def dense_ffn(W, l, x):
    c = W.cfg
    pre = f"model.layers.{l}.mlp."
    g = x @ W.f(pre + "gate_proj.weight", (c.F, c.D)).T
    u = x @ W.f(pre + "up_proj.weight", (c.F, c.D)).T
    return situ(g, u, c.situ_beta, c.situ_lbeta) @ W.f(pre + "down_proj.weight", (c.D, c.F)).T


def route(c, s, bias):
    """Sigmoid scores s [T,E] (unbiased), bias [E] -> (idx [T,k], weights [T,k], margin [T]).
    Grouped top-k general rule: group score = sum of the top-2 biased scores of each group,
    keep topk_group groups, mask the rest to -inf; then torch.topk over the biased scores."""
    T, E = s.shape
    sb = s + bias
    if c.n_group > 1:
        gs = sb.reshape(T, c.n_group, E // c.n_group).topk(2, dim=-1).values.sum(-1)
        keep = gs.topk(c.topk_group, dim=-1).indices
        gmask = torch.zeros(T, c.n_group, dtype=torch.bool)
        gmask.scatter_(1, keep, True)
        emask = gmask[:, :, None].expand(T, c.n_group, E // c.n_group).reshape(T, E)
        sb = sb.masked_fill(~emask, float("-inf"))
    top = sb.topk(min(c.topk + 1, E), dim=-1)
    idx = top.indices[:, :c.topk]
    if E > c.topk:
        margin = top.values[:, c.topk - 1] - top.values[:, c.topk]
    else:
        margin = torch.full((T,), float("inf"), dtype=DT)
    w = s.gather(1, idx)
    if c.renorm:
        w = w / (w.sum(-1, keepdim=True) + ROUTER_RENORM_EPS)
    w = w * c.rsf
    return idx, w, margin


def moe_ffn(W, l, x, stats):
    c = W.cfg
    T, D = x.shape
    pre = f"model.layers.{l}.block_sparse_moe."
    logits = x @ W.f(pre + "gate.weight", (c.E, D)).T
    s = torch.sigmoid(logits)
    idx, w, margin = route(c, s, W.f(pre + "gate.e_score_correction_bias", (c.E,)))
    if c.renorm:
        err = float((w.sum(-1) - c.rsf).abs().max())
        stats["router_weight_sum_err"] = max(stats.get("router_weight_sum_err", 0.0), err)
    stats["min_router_margin"] = min(stats.get("min_router_margin", float("inf")),
                                     float(margin.min()))
    Ld = c.latent if c.latent > 0 else D
    if c.latent > 0:
        r = x @ W.f(pre + "routed_expert_down_proj.weight", (Ld, D)).T
    else:
        r = x
    y = torch.zeros(T, Ld, dtype=DT)
    for e in sorted(set(idx.reshape(-1).tolist())):
        rows, slot = (idx == e).nonzero(as_tuple=True)
        w1 = W.expert(l, e, "w1", (c.I, Ld))
        w3 = W.expert(l, e, "w3", (c.I, Ld))
        w2 = W.expert(l, e, "w2", (Ld, c.I))
        re_ = r[rows]
        out = situ(re_ @ w1.T, re_ @ w3.T, c.situ_beta, c.situ_lbeta) @ w2.T
        y.index_add_(0, rows, w[rows, slot][:, None] * out)
    if c.latent > 0:
        if c.latent_norm:
            y = rmsnorm(y, W.f(pre + "routed_expert_norm.weight", (Ld,)), c.eps)
        y = y @ W.f(pre + "routed_expert_up_proj.weight", (D, Ld)).T
    if c.n_shared > 0:
        S = c.n_shared * c.I
        sp = pre + "shared_experts."
        g = x @ W.f(sp + "gate_proj.weight", (S, D)).T
        u = x @ W.f(sp + "up_proj.weight", (S, D)).T
        y = y + situ(g, u, c.situ_beta, c.situ_lbeta) @ W.f(sp + "down_proj.weight", (D, S)).T
    return y


# ---------------------------------------------------------------------------------------------
# the model (§1.2, §5)
def forward(W, ids, stats):
    """ids: list of ints. Returns (logits [T,V] float64, hidden [L,T,D] float64)."""
    c = W.cfg
    emb = W.f("model.embed_tokens.weight", (c.V, c.D))
    h = emb[torch.tensor(ids, dtype=torch.long)]
    T = h.shape[0]
    blocks = []
    hidden = torch.zeros(c.L, T, c.D, dtype=DT)
    for l in range(c.L):
        lp = f"model.layers.{l}."
        p = h
        a = p if not blocks else attnres_mix(blocks + [p], res_score(W, lp + "self_attention_res"),
                                             c.eps)
        if l % c.block == 0:
            blocks.append(p)
            p = None
        xin = rmsnorm(a, W.f(lp + "input_layernorm.weight", (c.D,)), c.eps)
        y = mla_layer(W, l, xin) if c.is_mla[l] else kda_layer(W, l, xin, stats)
        if "capture" in stats:
            stats["capture"][("mixer", l)] = (xin, y)
        p = y if p is None else p + y
        m = attnres_mix(blocks + [p], res_score(W, lp + "mlp_res"), c.eps)
        xf = rmsnorm(m, W.f(lp + "post_attention_layernorm.weight", (c.D,)), c.eps)
        z = moe_ffn(W, l, xf, stats) if c.is_moe(l) else dense_ffn(W, l, xf)
        if "capture" in stats:
            stats["capture"][("ffn", l)] = (xf, z)
        p = p + z
        h = p
        hidden[l] = h
    h = attnres_mix(blocks + [h], res_score(W, "model.output_attn_res"), c.eps)
    h = rmsnorm(h, W.f("model.norm.weight", (c.D,)), c.eps)
    head = emb if c.tie else W.f("lm_head.weight", (c.V, c.D))
    return h @ head.T, hidden


def greedy(W, ids, n):
    out, margins = [], []
    cur = list(ids)
    for _ in range(n):
        logits, _ = forward(W, cur, {"selfcheck": False})
        last = logits[-1]
        nxt = int(torch.argmax(last))
        top2 = last.topk(2).values
        out.append(nxt)
        margins.append(float(top2[0] - top2[1]))
        cur.append(nxt)
    return out, margins


# ---------------------------------------------------------------------------------------------
# layer-level cross-check against Hugging Face transformers' Kimi-Linear modules (a second,
# independent implementation of KDA, MLA and the grouped sigmoid router). Kimi-Linear lacks the
# K3 parts, which are patched in: the lower-bound gate (checked against fla separately), the
# full-rank output gate (g_a := identity, g_b := g_proj), and the MLA output gate (compared
# without it). HF computes these in fp32 internally -> agreement ~1e-6, not 1e-15.
def crosscheck_hf(W, captures):
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as hf
        from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    except Exception as e:  # pragma: no cover - transformers is optional
        return {"skipped": f"transformers kimi_linear not importable: {e}"}
    import logging
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # use HF's torch code paths, not fla's Triton kernels (hub-kernel wrappers keep __wrapped__)
    for n in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
              "causal_conv1d_fn", "causal_conv1d_update"):
        fn = getattr(hf, n)
        setattr(hf, n, getattr(fn, "__wrapped__", fn))
    c = W.cfg
    hc = KimiLinearConfig(
        vocab_size=c.V, hidden_size=c.D, num_hidden_layers=c.L, num_attention_heads=c.H,
        num_key_value_heads=c.H, q_lora_rank=c.q_lora or None, kv_lora_rank=c.kv_lora,
        qk_rope_head_dim=c.dr, v_head_dim=c.dv, qk_nope_head_dim=c.dn,
        num_expert_group=c.n_group, topk_group=c.topk_group, num_experts_per_token=c.topk,
        moe_renormalize=c.renorm, routed_scaling_factor=c.rsf, num_experts=c.E,
        hidden_act="silu", rms_norm_eps=c.eps, linear_head_dim=c.kdk, linear_num_heads=c.kH,
        linear_conv_kernel_dim=c.kconv, moe_intermediate_size=c.I,
        num_shared_experts=max(c.n_shared, 1), pad_token_id=None, bos_token_id=None,
        eos_token_id=None,
        layer_types=["full_attention" if c.is_mla[l] else "linear_attention"
                     for l in range(c.L)],
        mlp_layer_types=["sparse" if c.is_moe(l) else "dense" for l in range(c.L)])
    hc._attn_implementation = "eager"

    def setw(lin, t):
        lin.weight.data = t.clone().to(DT)

    class K3Gate(torch.nn.Module):  # K3 lower-bound decay gate (spec §2.2)
        def __init__(self, pre):
            super().__init__()
            self.pre = pre

        def forward(self, x):
            P, R = c.kH * c.kdk, W.raw(self.pre + "f_a_proj.weight").shape[0]
            r = (x @ W.f(self.pre + "f_a_proj.weight", (R, c.D)).T) \
                @ W.f(self.pre + "f_b_proj.weight", (P, R)).T + W.f(self.pre + "dt_bias", (P,))
            r = r.reshape(*x.shape[:-1], c.kH, c.kdk)
            a_log = W.f(self.pre + "A_log").reshape(-1)[:c.kH]
            return c.lower_bound * torch.sigmoid(torch.exp(a_log)[:, None] * r)

    res = {"kda_layer_rel": 0.0, "mla_layer_rel_without_output_gate": 0.0,
           "router_same_experts": True, "router_weight_max_abs": 0.0}
    for (kind, l), (x, y) in sorted(captures.items()):
        pre = f"model.layers.{l}.self_attn."
        if kind == "mixer" and not c.is_mla[l]:
            if c.lower_bound is None:
                continue
            m = hf.KimiLinearDeltaAttention(hc, l).to(DT)
            for n in "qkv":
                setw(getattr(m, f"{n}_proj"), W.f(pre + f"{n}_proj.weight"))
            m.conv1d.weight.data = torch.cat([W.f(pre + f"{n}_conv1d.weight") for n in "qkv"])
            m.forget_gate = K3Gate(pre)
            setw(m.b_proj, W.f(pre + "b_proj.weight"))
            m.g_a_proj = torch.nn.Identity()
            m.g_b_proj = torch.nn.Linear(c.D, c.kH * c.kdk, bias=False).to(DT)
            setw(m.g_b_proj, W.f(pre + "g_proj.weight"))
            m.o_norm.weight.data = W.f(pre + "o_norm.weight").clone()
            m.o_norm.variance_epsilon = c.eps
            setw(m.o_proj, W.f(pre + "o_proj.weight"))
            yh = m(x[None])[0].to(DT)
            res["kda_layer_rel"] = max(res["kda_layer_rel"], float((yh - y).norm() / y.norm()))
        elif kind == "mixer":
            m = hf.KimiLinearAttention(hc, l).to(DT)
            if c.q_lora:
                setw(m.q_a_proj, W.f(pre + "q_a_proj.weight"))
                m.q_a_layernorm.weight.data = W.f(pre + "q_a_layernorm.weight").clone()
                setw(m.q_b_proj, W.f(pre + "q_b_proj.weight"))
            else:
                setw(m.q_proj, W.f(pre + "q_proj.weight"))
            setw(m.kv_a_proj_with_mqa, W.f(pre + "kv_a_proj_with_mqa.weight"))
            m.kv_a_layernorm.weight.data = W.f(pre + "kv_a_layernorm.weight").clone()
            setw(m.kv_b_proj, W.f(pre + "kv_b_proj.weight"))
            setw(m.o_proj, W.f(pre + "o_proj.weight"))
            T = x.shape[0]
            mask = torch.zeros(1, 1, T, T, dtype=DT).masked_fill(
                torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
            yh = m(x[None], attention_mask=mask)[0][0].to(DT)
            mine = mla_layer(W, l, x, gate=False)
            res["mla_layer_rel_without_output_gate"] = max(
                res["mla_layer_rel_without_output_gate"], float((yh - mine).norm() / mine.norm()))
        elif kind == "ffn" and c.is_moe(l):
            bp = f"model.layers.{l}.block_sparse_moe."
            rt = hf.KimiLinearTopkRouter(hc)
            rt.weight.data = W.f(bp + "gate.weight").to(torch.float32)
            rt.e_score_correction_bias.data = W.f(bp + "gate.e_score_correction_bias").float()
            _, wh, ih = rt(x.to(torch.float32))
            s = torch.sigmoid(x @ W.f(bp + "gate.weight").T)
            idx, w, _ = route(c, s, W.f(bp + "gate.e_score_correction_bias"))
            oh, om = ih.sort(-1), idx.sort(-1)
            same = torch.equal(oh.values, om.values)
            res["router_same_experts"] = res["router_same_experts"] and same
            if same:
                d = (wh.gather(1, oh.indices).to(DT) - w.gather(1, om.indices)).abs().max()
                res["router_weight_max_abs"] = max(res["router_weight_max_abs"], float(d))
    return res


# ---------------------------------------------------------------------------------------------
# goldens
def make_prompts(V, seed):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randint(0, V, (n,), generator=g).tolist() for name, n in PROMPT_LENGTHS}


# Bounds on the self-checks (exceeding one is an error). float64 vs float64 (fla chunk vs fla
# recurrence, spec transcription vs fla): a few hundred roundings of 1.1e-16 -> 1e-12 is loose.
# fp32 fla vs float64: unit roundoff 6e-8 times a modest growth over <= 200 steps -> 1e-5.
SELF_CHECK_BOUNDS = {
    "kda_chunk64_vs_recurrent_rel": 1e-12,
    "kda_spec_f64_vs_fla_f64_rel": 1e-12,
    "kda_fla_fp32_vs_fla_f64_rel": 1e-5,
    "gate_vs_fla_max_abs": 1e-5,      # fla's gate computes in fp32; |g| <= 5 -> 5 * 6e-8 * few
    "router_weight_sum_err": 1e-12,
}


def check_self_checks(name, stats):
    bad = [f"{k}={stats[k]:.3g} > {b:g}" for k, b in SELF_CHECK_BOUNDS.items()
           if k in stats and not stats[k] <= b]
    missing = [k for k in ("kda_chunk64_vs_recurrent_rel", "kda_spec_f64_vs_fla_f64_rel",
                           "router_weight_sum_err") if k not in stats]
    if bad or missing:
        raise SystemExit(f"error: prompt {name}: reference self-check failed: {bad} "
                         f"missing: {missing}")


# HF's Kimi-Linear modules compute the delta rule, norms and router in fp32: a 2e-7-relative
# KDA core error (measured: kda_fla_fp32_vs_fla_f64_rel) grows through o_norm/o_proj -> 1e-5.
HF_BOUNDS = {"kda_layer_rel": 1e-5, "mla_layer_rel_without_output_gate": 1e-5,
             "router_weight_max_abs": 1e-5}


def check_hf(name, r):
    if "skipped" in r:
        print(f"[ref] warning: HF cross-check skipped: {r['skipped']}", file=sys.stderr)
        return
    bad = [f"{k}={r[k]:.3g} > {b:g}" for k, b in HF_BOUNDS.items() if not r[k] <= b]
    if not r["router_same_experts"]:
        bad.append("router picked different experts than HF KimiLinearTopkRouter")
    if bad:
        raise SystemExit(f"error: prompt {name}: HF transformers cross-check failed: {bad}")


def check_not_degenerate(name, logits, hidden):
    problems = []
    if not torch.isfinite(logits).all() or not torch.isfinite(hidden).all():
        problems.append("non-finite values")
    if float(logits.std()) <= 0:
        problems.append("logits std == 0")
    am = logits.argmax(-1)
    if logits.shape[0] > 1 and len(set(am.tolist())) < 2:
        problems.append("same argmax at every position")
    if float(hidden.abs().max()) == 0:
        problems.append("hidden states all zero")
    if problems:
        raise SystemExit(f"error: prompt {name}: degenerate reference output: {problems}")


def run_checkpoint(model_dir):
    cfg = Cfg(os.path.join(model_dir, "config.json"))
    W = Weights(cfg, load_tensors(model_dir))
    return cfg, W


def compute_goldens(model_dir, prompt_seed, n_greedy):
    cfg, W = run_checkpoint(model_dir)
    prompts = make_prompts(cfg.V, prompt_seed)
    results = []
    for name, _ in PROMPT_LENGTHS:
        ids = prompts[name]
        stats = {"selfcheck": True, "capture": {}}
        logits, hidden = forward(W, ids, stats)
        hfc = crosscheck_hf(W, stats.pop("capture"))
        check_not_degenerate(name, logits, hidden)
        gen, margins = greedy(W, ids, n_greedy)
        stats.pop("selfcheck")
        check_self_checks(name, stats)
        check_hf(name, hfc)
        stats["hf_transformers_kimi_linear"] = hfc
        # sensitivity probe: the same forward with only the KDA core in fp32 (stock fla) — how
        # far fp32 rounding in one op moves the logits of this model (guides C tolerances)
        l32, h32 = forward(W, ids, {"selfcheck": False, "kda_core": "fla_fp32"})
        stats["probe_logits_rel_if_kda_core_fp32"] = rel_l2(l32.numpy(), logits.numpy())
        stats["probe_hidden_rel_if_kda_core_fp32"] = rel_l2(h32.numpy(), hidden.numpy())
        results.append(dict(name=name, ids=ids, logits=logits, hidden=hidden, greedy=gen,
                            greedy_margin=margins, stats=stats))
        print(f"[ref] {name}: T={len(ids)} logits std={float(logits.std()):.4g} "
              f"distinct argmax={len(set(logits.argmax(-1).tolist()))} "
              f"greedy={gen[:8]}... min greedy margin={min(margins, default=0):.3g} stats={stats}",
              file=sys.stderr)
    # every tensor of the checkpoint must have been used by the forward (else a name is wrong)
    unused = sorted(set(W.t) - W.used)
    # legitimately unused: experts never routed to; layer 0's attention-side AttnRes pair (the
    # mix is skipped at layer 0, nothing is banked yet: K3-MODEL.md §1.2 notes)
    unused = [u for u in unused if ".experts." not in u
              and not u.startswith(PREFIX + "model.layers.0.self_attention_res_")]
    if unused:
        raise SystemExit(f"error: checkpoint tensors not used by the reference: {unused[:10]}")
    return cfg, results


def rel_l2(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def versions():
    import safetensors
    import compressed_tensors
    return {"torch": torch.__version__, "fla": FLA_VERSION,
            "compressed_tensors": getattr(compressed_tensors, "__version__", "?"),
            "safetensors": safetensors.__version__, "numpy": np.__version__}


def write_goldens(out_dir, model_dir, cfg, results, preset, seed, prompt_seed):
    os.makedirs(out_dir, exist_ok=True)
    man = {
        "format_version": 1,
        "preset": preset, "seed": seed,
        "make_tiny_command": f"k3 make-tiny DIR --preset {preset} --seed {seed}",
        "files_sha256": checkpoint_hashes(model_dir),
        "config": cfg.summary(),
        "reference": dict(dtype="float64 everywhere; "
                                "KDA core = fla naive_recurrent_kda run in float64",
                          l2norm_eps=L2NORM_EPS, mla_norm_eps=MLA_NORM_EPS,
                          router_renorm_eps=ROUTER_RENORM_EPS, topk="torch.topk",
                          kda_scale="dk^-0.5 applied to q inside naive_recurrent_kda",
                          **versions()),
        "prompt_seed": prompt_seed,
        "n_greedy": N_GREEDY,
        "prompts": [],
    }
    for r in results:
        name = r["name"]
        np.save(os.path.join(out_dir, f"{name}.logits.npy"),
                r["logits"].numpy().astype("<f4"), allow_pickle=False)
        np.save(os.path.join(out_dir, f"{name}.hidden.npy"),
                r["hidden"].numpy().astype("<f4"), allow_pickle=False)
        st = dict(r["stats"])
        man["prompts"].append({
            "name": name, "n_tokens": len(r["ids"]), "ids": r["ids"],
            "logits_file": f"{name}.logits.npy", "hidden_file": f"{name}.hidden.npy",
            "argmax": r["logits"].argmax(-1).tolist(),
            "greedy": r["greedy"], "greedy_margin": r["greedy_margin"],
            "min_router_margin": st.pop("min_router_margin", None),
            "self_check": st,
        })
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(man, f, indent=1)
        f.write("\n")


def check_goldens(out_dir, model_dir, cfg, results):
    with open(os.path.join(out_dir, "manifest.json")) as f:
        man = json.load(f)
    bad = []
    hashes = checkpoint_hashes(model_dir)
    if hashes != man["files_sha256"]:
        bad.append("checkpoint sha256 differs from manifest (stale golden or different writer): "
                   + ", ".join(k for k in set(hashes) | set(man["files_sha256"])
                               if hashes.get(k) != man["files_sha256"].get(k)))
    by_name = {p["name"]: p for p in man["prompts"]}
    for r in results:
        p = by_name.get(r["name"])
        if p is None:
            bad.append(f"{r['name']}: missing in manifest")
            continue
        if p["ids"] != r["ids"]:
            bad.append(f"{r['name']}: prompt ids differ")
        lg = np.load(os.path.join(out_dir, p["logits_file"]))
        hd = np.load(os.path.join(out_dir, p["hidden_file"]))
        el, eh = rel_l2(r["logits"].numpy(), lg), rel_l2(r["hidden"].numpy(), hd)
        print(f"[check] {r['name']}: logits rel-L2 {el:.3g}, hidden rel-L2 {eh:.3g}, "
              f"greedy {'same' if p['greedy'] == r['greedy'] else 'DIFFERENT'}", file=sys.stderr)
        # goldens are stored in fp32; the bound is derived in tests/tolerances.h
        if el > GOLDEN_REGEN_TOL or eh > GOLDEN_REGEN_TOL:
            bad.append(f"{r['name']}: logits rel-L2 {el:.3g} / hidden rel-L2 {eh:.3g} > "
                       f"{GOLDEN_REGEN_TOL:g} (K3_TOL_GOLDEN_REGEN_REL_L2)")
        if p["greedy"] != r["greedy"]:
            bad.append(f"{r['name']}: greedy continuation differs")
    if bad:
        for b in bad:
            print(f"error: {b}", file=sys.stderr)
        return 1
    print("[check] goldens match", file=sys.stderr)
    return 0


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.normpath(os.path.join(here, "..", "golden", "forward"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="existing checkpoint directory (made by k3 make-tiny)")
    src.add_argument("--k3", help="k3 binary: run `k3 make-tiny TMP --preset P --seed S` first")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt-seed", type=int, default=PROMPT_SEED)
    ap.add_argument("--out", default=default_out, help=f"golden folder (default {default_out})")
    ap.add_argument("--check", action="store_true",
                    help="recompute and compare with the goldens in --out (writes nothing)")
    ap.add_argument("--n-greedy", type=int, default=N_GREEDY)
    a = ap.parse_args(argv)
    print(f"[ref] prompt seed {a.prompt_seed}, preset {a.preset}, seed {a.seed}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="k3ref-") as tmp:
        model_dir = a.model
        if a.k3:
            model_dir = os.path.join(tmp, "tiny")
            cmd = [a.k3, "make-tiny", model_dir, "--preset", a.preset, "--seed", str(a.seed)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"error: {' '.join(cmd)} failed (rc {r.returncode}): "
                                 f"{r.stderr.strip()}")
        cfg, results = compute_goldens(model_dir, a.prompt_seed, a.n_greedy)
        if a.check:
            return check_goldens(a.out, model_dir, cfg, results)
        write_goldens(a.out, model_dir, cfg, results, a.preset, a.seed, a.prompt_seed)
        print(f"[ref] goldens written to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
