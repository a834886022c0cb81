"""test_suite_coverage.py — the grammar against the JSON-Schema-Test-Suite's cases of the keywords
issue 47 added and of the date and uuid formats (owner: grammar).

Usage: test_suite_coverage.py GRAMMAR_TOOL  (K3_BIN: the k3 binary, for a tiny model's vocabulary)
The vendored files (tests/grammar/jsts/, MIT, see its README) hold schemas, each with valid and
invalid instances. For each schema the grammar compiles it or refuses it with a clear error (a
400 in the server); each instance's compact JSON text is fed as bytes through the matcher
(grammar_tool's "check"): a valid instance must be accepted, an invalid one rejected. Printed: a
table of keyword x (schemas, refused, instances, correct, rejected valid (a subset miss), accepted
invalid). The test fails when an invalid instance is accepted (the grammar would be unsound) or
when fewer than 90% of the instances get the right verdict (refused schemas count as misses).
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

K3 = os.environ.get("K3_BIN", "k3")
HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    tool = sys.argv[1]
    d = tempfile.mkdtemp(prefix="k3_jsts_")
    model = os.path.join(d, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True, timeout=300)
    p = subprocess.Popen([tool, os.path.join(model, "tiktoken.model")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)

    def ask(req):
        p.stdin.write(json.dumps(req) + "\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    rows, total, right, unsound = [], 0, 0, []
    for path in sorted(glob.glob(os.path.join(HERE, "jsts", "*.json"))):
        kw = os.path.basename(path)[:-5]
        with open(path) as f:
            cases = json.load(f)
        n_schema = n_refused = n = ok = miss = bad = 0
        for case in cases:
            n_schema += 1
            data = [json.dumps(t["data"], separators=(",", ":"), ensure_ascii=False)
                    for t in case["tests"]]
            r = ask({"op": "check", "spec": {"schema": case["schema"]}, "instances": data})
            n += len(data)
            if "error" in r:
                n_refused += 1
                assert r["error"] and "(" not in r["error"][:1], r
                print("   refused %-18s %-45s %s" % (kw, case["description"][:45], r["error"][:90]))
                continue
            for t, text, v in zip(case["tests"], data, r["verdicts"]):
                if v == t["valid"]:
                    ok += 1
                elif t["valid"]:
                    miss += 1
                    print("   subset  %-18s %-45s rejects valid %s" % (kw, case["description"][:45], text[:40]))
                else:
                    bad += 1
                    unsound.append((kw, case["description"], text))
        rows.append((kw, n_schema, n_refused, n, ok, miss, bad))
        total += n
        right += ok
    p.stdin.close()
    p.wait()
    print("| keyword | schemas | refused | instances | right | valid rejected | invalid accepted |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| `%s` | %d | %d | %d | %d (%.0f%%) | %d | %d |" % (r[0], r[1], r[2], r[3], r[4],
                                                              100.0 * r[4] / r[3], r[5], r[6]))
    print("| all | %d | %d | %d | %d (%.1f%%) | | %d |" % (
        sum(r[1] for r in rows), sum(r[2] for r in rows), total, right, 100.0 * right / total,
        len(unsound)))
    fails = 0
    if unsound:
        fails += 1
        print("FAIL invalid instances accepted: %s" % unsound)
    if right < 0.9 * total:
        fails += 1
        print("FAIL %d of %d instances right (< 90%%)" % (right, total))
    print("test_suite_coverage: %s" % ("ok" if not fails else "%d failed" % fails))
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
