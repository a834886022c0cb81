"""bench_grammar_cli.py — `k3 bench grammar` works end to end (not a timing verdict): with the
o200k ranks cut to K3's 163,840 ids and the tiny model's decode step beside it, the table is
printed, the JSON validates against bench_grammar.schema.json (PyPI jsonschema), the decode step
was measured; a missing --vocab is a usage error (2) and a flag of another mode is refused."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from k3_check import check, verdict  # noqa: E402

import jsonschema  # noqa: E402

K3 = os.environ.get("K3_BIN", "k3")


def main():
    d = tempfile.mkdtemp(prefix="k3_bench_grammar_")
    model, out = os.path.join(d, "tiny"), os.path.join(d, "g.json")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True, timeout=120)
    vocab = os.path.join(os.environ.get("K3_TESTDATA", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")), "vocab", "o200k_base.tiktoken")
    p = subprocess.run([K3, "bench", "grammar", "--vocab", vocab, "--model", model, "--output-json", out],
                       capture_output=True, text=True, timeout=600)
    check(p.returncode == 0, "k3 bench grammar exits 0 (%s)" % p.stderr[-300:])
    check("| case | states |" in p.stdout and "decode step of" in p.stdout, "the table and the decode step")
    j = json.load(open(out)) if os.path.exists(out) else {}
    try:
        jsonschema.validate(j, json.load(open(os.path.join(HERE, "bench_grammar.schema.json"))))
        ok = True
    except jsonschema.ValidationError as e:
        ok = False
        print("   ", e.message)
    check(ok, "--output-json validates against bench_grammar.schema.json")
    check(j.get("decode_step_ms", 0) > 0, "the tiny model's decode step was measured")
    p = subprocess.run([K3, "bench", "grammar"], capture_output=True, text=True, timeout=60)
    check(p.returncode == 2 and "--vocab" in p.stderr, "no --vocab: usage error naming it")
    p = subprocess.run([K3, "bench", "grammar", "--vocab", vocab, "--base-url", "http://x"],
                       capture_output=True, text=True, timeout=60)
    check(p.returncode == 2 and "--base-url" in p.stderr, "a flag of another mode is refused")
    return verdict("bench_grammar_cli")


if __name__ == "__main__":
    sys.exit(main())
