#!/usr/bin/env python3
"""batch_compile_test.py — issue 43: a slow grammar compile in `k3 batch` on 2 stages.

usage: batch_compile_test.py MPIEXEC   (K3_BIN = the k3 binary)
`mpirun -np 2 k3 batch --pp 2 --comm-timeout 2 --grammar-budget 4` with a line whose grammar
takes longer than both to compile and a $ref chain of 60,000: the job completes (exit 0), those
two lines are invalid_request lines naming the budget and the $ref chain, and the other lines
are answered, those behind the slow line too, while it compiles (on the prep thread, off the
step thread: it is written last). (Before: rank 1 declared rank 0 dead after 2 s of
silence and the job ended with no line written; the $ref line crashed the job.)
Exit code only; prints one line per check."""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_check import check, verdict  # noqa: E402

K3 = os.environ.get("K3_BIN")


def main():
    mpi = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "tiny")
        subprocess.run([K3, "make-tiny", model], check=True, capture_output=True, timeout=120)
        slow = {"type": "object", "properties": {"p%d" % i: {"type": "string", "pattern": "^[a-z]{0,60}$"}
                                                 for i in range(2200)}}
        defs = {"d%d" % i: {"$ref": "#/$defs/d%d" % (i + 1)} for i in range(59999)}
        defs["d59999"] = {"type": "string"}
        inp, out = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
        with open(inp, "w") as f:
            for i in range(6):
                body = {"messages": [{"role": "user", "content": "hi %d" % i}], "max_tokens": 8}
                if i == 2:
                    body["guided_json"] = slow
                if i == 4:
                    body["guided_json"] = {"$defs": defs, "$ref": "#/$defs/d0"}
                f.write(json.dumps({"custom_id": "r%d" % i, "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + "\n")
        p = subprocess.run([mpi, "-np", "2", "--oversubscribe", K3, "batch", "--model", model, "--pp", "2",
                            "--threads", "1", "--comm-timeout", "2", "--grammar-budget", "4", "--input", inp,
                            "--output", out], capture_output=True, text=True, timeout=120)
        rows, order = {}, []
        if os.path.exists(out):
            for ln in open(out):
                o = json.loads(ln)
                rows[o["custom_id"]] = o
                order.append(o["custom_id"])
        check(p.returncode == 0, "the job completes (exit %d): %s" % (p.returncode, p.stderr[-600:]))
        msg = lambda c: json.dumps((rows.get(c) or {}).get("error") or (rows.get(c) or {}).get("response") or {})
        check("--grammar-budget" in msg("r2"), "the slow line fails alone, naming the budget: %s" % msg("r2")[:200])
        check("$ref" in msg("r4"), "the $ref chain fails alone, naming it: %s" % msg("r4")[:200])
        ok = [c for c in ("r0", "r1", "r3", "r5")
              if (rows.get(c) or {}).get("response", {}) and rows[c]["response"].get("status_code") == 200]
        check(len(ok) == 4, "the other 4 lines answered (%s)" % ok)
        # the compile runs off the step thread: the lines after the slow one are answered while
        # it compiles (before: they waited for it, so r2's line came before r3's and r5's)
        check("r2" in order and order[-1] == "r2", "the slow line is written last, after the "
              "lines behind it were answered: %s" % order)
    return verdict("batch_compile_test")


if __name__ == "__main__":
    sys.exit(main())
