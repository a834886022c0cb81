#!/usr/bin/env python3
"""moe_vs_torch.py — k3's latent MoE layers (experts/) against the independent PyTorch reference
(tests/reference/k3_reference.py: float64, compressed-tensors' own MXFP4 decode, written from the
spec without reading k3's C code), one MoE layer at a time on random inputs, so a convention
mismatch (router, grouped top-k, latent norm, SiTU, MXFP4 layout, shared experts) is named by
layer and quantity instead of showing up as a whole-model drift.

Usage: moe_vs_torch.py TEST_EXPERTS_BIN   (env K3_BIN = the k3 binary, K3_SRC = the repo root)
It makes the tiny checkpoint with `k3 make-tiny --preset tiny --seed 1`, runs
`TEST_EXPERTS_BIN dump MODEL OUT` (k3_moe_forward with the default backend, float32), and
compares. Exit code 0 = pass.
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_skip import skip  # noqa: E402
from k3_tolerances import TOL  # noqa: E402  (tests/tolerances.h, derived there)

try:  # the reference stack (tests/reference/requirements.txt)
    import numpy as np
    import torch  # noqa: F401
    import einops  # noqa: F401
    import safetensors  # noqa: F401
    import compressed_tensors  # noqa: F401
    import importlib.util
    if importlib.util.find_spec("fla") is None:
        raise ImportError("No module named 'fla'")
except ImportError as e:  # skipped (77) with a loud line; FAIL under CI=true (tests/k3_skip.py)
    skip("experts_torch", f"missing python package ({e})")

TOL_REL_L2 = TOL["K3_TOL_MOE_F64_REL_L2"]    # one MoE layer, fp32 vs float64
NEAR_TIE = TOL["K3_TOL_ROUTER_NEAR_TIE"]     # biased-score gaps below this may flip in fp32: skipped
T = 48


def main():
    if len(sys.argv) != 2:
        print("usage: moe_vs_torch.py TEST_EXPERTS_BIN", file=sys.stderr)
        return 2
    test_bin = sys.argv[1]
    k3_bin = os.environ.get("K3_BIN")
    src = os.environ.get("K3_SRC")
    if not k3_bin or not src:
        print("error: K3_BIN and K3_SRC must be set (ctest sets them)", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(src, "tests", "reference"))
    import k3_reference as R  # its packages were checked above: an ImportError here is a bug

    fails = 0
    with tempfile.TemporaryDirectory(prefix="k3_moe_torch_") as tmp:
        model = os.path.join(tmp, "model")
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        subprocess.run([k3_bin, "make-tiny", model, "--preset", "tiny", "--seed", "1"], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run([test_bin, "dump", model, out], check=True)
        cfg, W = R.run_checkpoint(model)
        D, K, E = cfg.D, cfg.topk, cfg.E
        layers = sorted(int(f[2:-4]) for f in os.listdir(out) if f.startswith("x_"))
        if not layers:
            print("FAIL: the dump wrote no MoE layer")
            return 1
        for l in layers:
            x = np.fromfile(os.path.join(out, f"x_{l}.f32"), dtype="<f4").reshape(T, D)
            y = np.fromfile(os.path.join(out, f"y_{l}.f32"), dtype="<f4").reshape(T, D)
            ids = np.fromfile(os.path.join(out, f"ids_{l}.i32"), dtype="<i4").reshape(T, K)
            xt = torch.from_numpy(x.astype(np.float64))
            stats = {}
            y_ref = R.moe_ffn(W, l, xt, stats).numpy()
            # the reference's routing, and every gap that decides it (group boundary, top-k
            # boundary, slot order), to tell a real mismatch from an fp32 near-tie
            pre = f"model.layers.{l}.block_sparse_moe."
            s = torch.sigmoid(xt @ W.f(pre + "gate.weight", (E, D)).T)
            bias = W.f(pre + "gate.e_score_correction_bias", (E,))
            idx, _, _ = R.route(cfg, s, bias)
            sb = (s + bias).numpy()
            ok_tok = []
            amb = bad = 0
            for t in range(T):
                v = np.sort(sb[t])[::-1]
                gaps = np.diff(v[: min(K + 1, E)])
                near = gaps.size > 0 and float(np.min(np.abs(gaps))) < NEAR_TIE
                same = list(ids[t]) == [int(i) for i in idx[t]]
                if same:
                    ok_tok.append(t)
                elif near or cfg.n_group > 1:
                    # with groups, a near-tie of group scores can also flip; check it
                    g = sb[t].reshape(cfg.n_group, -1)
                    gs = np.sort(np.sort(g, axis=1)[:, ::-1][:, :2].sum(1))[::-1]
                    gnear = cfg.n_group > 1 and float(np.min(np.abs(np.diff(gs)))) < NEAR_TIE
                    if near or gnear:
                        amb += 1
                    else:
                        bad += 1
                        print(f"  layer {l} token {t}: k3 slots {list(ids[t])} vs reference "
                              f"{[int(i) for i in idx[t]]}")
                else:
                    bad += 1
                    print(f"  layer {l} token {t}: k3 slots {list(ids[t])} vs reference "
                          f"{[int(i) for i in idx[t]]}")
            a, b = y[ok_tok].astype(np.float64), y_ref[ok_tok]
            rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))
            rms = float(np.sqrt(np.mean(b * b))) if b.size else 0.0
            used = len(set(ids.reshape(-1).tolist()))
            verdict = "ok"
            if bad or rel > TOL_REL_L2 or amb > 2 or rms < 1e-2 or used < min(E, 8):
                verdict = "FAIL"
                fails += 1
            print(f"layer {l}: rel-L2 k3 vs torch {rel:.3g} (tol {TOL_REL_L2}), {bad} routing "
                  f"mismatches, {amb} near-ties skipped, output rms {rms:.3g}, {used} experts used: "
                  f"{verdict}")
    print(f"moe_vs_torch: {len(layers) - fails} layers ok, {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
