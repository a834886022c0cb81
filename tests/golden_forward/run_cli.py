#!/usr/bin/env python3
"""`k3 run` end to end against the forward goldens (tests/golden/forward/, made by the
independent PyTorch reference): for each golden prompt, `k3 run --prompt-ids ... --n 32
--dump-logits F.npy --json --ignore-eos [--chunk C]` (exactly 32 tokens: no stop at EOS) must print the reference's 32 greedy ids, and the dumped
.npy (read with numpy: checks the header k3 writes) must hold [T + 31, V] float32 rows whose
first T rows match the golden logits to rel-L2 <= K3_TOL_GOLDEN_LOGITS_REL_L2 (tests/tolerances.h) at every position.
Also: bad flags exit 2 with one clear line. Exit code only; prints a summary."""
import json, os, subprocess, sys, tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_tolerances import TOL as _TOL  # noqa: E402

TOL = _TOL["K3_TOL_GOLDEN_LOGITS_REL_L2"]  # tests/tolerances.h

def main():
    k3 = os.environ["K3_BIN"]
    gdir = os.path.join(os.environ["K3_SRC"], "tests", "golden", "forward")
    man = json.load(open(os.path.join(gdir, "manifest.json")))
    fails = 0
    with tempfile.TemporaryDirectory(prefix="k3-run-cli-") as tmp:
        model = os.path.join(tmp, "model")
        subprocess.run([k3, "make-tiny", model, "--preset", man["preset"], "--seed", str(man["seed"])],
                       check=True, stderr=subprocess.DEVNULL)
        for p in man["prompts"]:
            ids, greedy = p["ids"], p["greedy"]
            want = np.load(os.path.join(gdir, p["logits_file"]))
            for chunk in (0, 7):
                npy = os.path.join(tmp, "%s.%d.npy" % (p["name"], chunk))
                r = subprocess.run([k3, "run", "--model", model, "--prompt-ids", ",".join(map(str, ids)),
                                    "--n", str(len(greedy)), "--chunk", str(chunk), "--dump-logits", npy,
                                    "--json", "--ignore-eos"], capture_output=True, text=True)
                if r.returncode != 0:
                    print("FAIL %s chunk %d: exit %d: %s" % (p["name"], chunk, r.returncode, r.stderr.strip()))
                    fails += 1
                    continue
                out = json.loads(r.stdout)
                got = np.load(npy)
                T, V = want.shape
                ok_shape = got.dtype == np.float32 and got.shape == (T + len(greedy) - 1, V)
                rel = [float(np.linalg.norm(got[t] - want[t]) / np.linalg.norm(want[t])) for t in range(T)] \
                    if ok_shape else [float("inf")]
                ok = (out["generated_ids"] == greedy and out["prompt_ids"] == ids and ok_shape
                      and max(rel) <= TOL and out["timings"]["prefill_tok_s"] > 0)
                # the dumped decode rows must pick the next greedy token
                if ok_shape:
                    ok = ok and [int(np.argmax(got[T - 1 + i])) for i in range(len(greedy))] == greedy
                print("%s %-6s chunk %d: greedy %s, npy %s, worst position rel-L2 %.2e" % (
                    "ok  " if ok else "FAIL", p["name"], chunk,
                    "identical" if out["generated_ids"] == greedy else "DIFFERS",
                    "shape ok" if ok_shape else "bad shape %s" % (got.shape,), max(rel)))
                fails += 0 if ok else 1
        # usage errors: exit 2, one line naming the problem
        for args, needle in ((["--model", model], "--prompt"), (["--model", model, "--prompt-ids", "1,x"], "--prompt-ids"),
                             (["--model", model, "--prompt-ids", "1", "--backend", "gpu9"], "--backend"),
                             (["--model", model, "--prompt-ids", "999999"], "vocab_size")):
            r = subprocess.run([k3, "run"] + args, capture_output=True, text=True)
            ok = r.returncode == 2 and needle in r.stderr
            print("%s usage error %s -> exit %d: %s" % ("ok  " if ok else "FAIL", " ".join(args[2:]), r.returncode,
                                                     r.stderr.strip().splitlines()[0] if r.stderr.strip() else ""))
            fails += 0 if ok else 1
        r = subprocess.run([k3, "run", "--model", os.path.join(tmp, "nope"), "--prompt-ids", "1"], capture_output=True, text=True)
        ok = r.returncode == 1 and "nope" in r.stderr
        print("%s missing model dir -> exit %d" % ("ok  " if ok else "FAIL", r.returncode))
        fails += 0 if ok else 1
    print("run_cli: %d failed" % fails)
    return 1 if fails else 0

if __name__ == "__main__":
    sys.exit(main())
