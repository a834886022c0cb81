"""test_grammar.py — the grammar engine (coordinator/k3_grammar.h) against independent verdicts:
PyPI `jsonschema` for JSON Schema, Python `re.fullmatch` for regexes.

For each schema: instances generated valid, and mutated (a key dropped, a value of another type,
an enum value broken, an array too long / short), serialized as the grammar generates JSON (keys
in schema order, separators "," ":" or ", " ": "): the matcher's verdict must EQUAL jsonschema's.
Random byte edits and extra keys: accepted => valid (the grammar generates a subset). Then random
walks through the masks (random logits among the allowed ids, a random model): every output must
parse and validate, and at every 7th step the mask must equal the matcher's per-id verdict.
Unsupported keywords must be refused, naming the keyword. Seed printed; usage:
    python3 test_grammar.py GRAMMAR_TOOL [--bounds]
(--bounds: only the compiler's bounds, grammar_bounds.py.)
"""
import base64
import json
import os
import random
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_check import check, verdict  # noqa: E402

import jsonschema  # noqa: E402

SEED = int(os.environ.get("K3_SEED", "1234"))
rng = random.Random(SEED)
print("seed", SEED)

ADDR = {"type": "object", "properties": {
    "street": {"type": "string"}, "city": {"type": "string"},
    "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$", "examples": ["12345", "12345-6789"]},
    "country": {"type": "string", "enum": ["US", "FR", "DE", "JP"]}},
    "required": ["street", "city", "country"], "additionalProperties": False}

SCHEMAS = [
    # an OpenAI strict-mode style extraction schema
    {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string", "format": "email", "examples": ["a.b@example.com"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
     "required": ["name", "age", "email", "tags"], "additionalProperties": False},
    # nested objects, optional fields, enums
    {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$", "examples": ["ABC-1234"]},
        "shipping": ADDR, "billing": ADDR,
        "status": {"enum": ["pending", "shipped", "delivered", None]},
        "total": {"type": "number"}, "gift": {"type": "boolean"}},
     "required": ["order_id", "shipping", "status", "total"], "additionalProperties": False},
    # arrays of objects with bounds
    {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer"},
                "price": {"type": ["number", "null"]}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    # anyOf, const, $defs + recursive $ref
    {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
        "required": ["value"], "additionalProperties": False}},
     "type": "object", "properties": {
         "kind": {"const": "tree"}, "root": {"$ref": "#/$defs/node"},
         "meta": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}},
     "required": ["kind", "root"], "additionalProperties": False},
    # formats, free-form object, string arrays with minItems
    {"type": "object", "properties": {
        "id": {"type": "string", "format": "uuid", "examples": ["123e4567-e89b-42d3-a456-426614174000"]},
        "day": {"type": "string", "format": "date", "examples": ["2024-02-28", "1999-12-31"]},
        "at": {"type": "string", "format": "date-time", "examples": ["2024-05-01T12:30:00Z"]},
        "ip": {"type": "string", "format": "ipv4", "examples": ["192.168.1.10"]},
        "extra": {"type": "object"},
        "notes": {"type": "array", "items": {"type": "string"}, "minItems": 2}},
     "required": ["id", "day", "notes"]},
    # top-level array, top-level enum, bare types
    {"type": "array", "items": {"type": "number"}, "maxItems": 6},
    {"enum": ["red", "green", "blue", 3, True]},
    {"type": ["string", "integer"]},
    {},
]

BAD = [  # unsupported keyword -> refused, naming it
    ({"type": "number", "multipleOf": 12345}, "multipleOf"),  # digits past 1000 (issue 47)
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
    ({"oneOf": [{"type": "string"}]}, "oneOf"),
    ({"type": "object", "patternProperties": {"a": {}}}, "patternProperties"),
    ({"type": "string", "format": "hostname"}, "hostname"),
    ({"type": "string", "pattern": "(?=a)b"}, "(?"),
    ({"type": "string", "pattern": "\\bword"}, "\\b"),
]


def resolve(s, root):
    while isinstance(s, dict) and "$ref" in s:
        s = root["$defs"][s["$ref"].split("/")[-1]]
    return s


def rand_str():
    alphabet = "abcXYZ 019_-\"\\/\n\t\u00e9\u4e2d\U0001f600<|>&"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))


def gen(s, root, depth=0):
    """A valid instance, keys in schema order."""
    s = resolve(s, root)
    if s is True or s == {}:
        return rng.choice([1, "x", None, [1, 2], {"k": "v"}, 2.5, False])
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return rng.choice(s["enum"])
    if "anyOf" in s:
        return gen(rng.choice(s["anyOf"]), root, depth)
    t = s.get("type")
    if isinstance(t, list):
        t = rng.choice(t)
    if t is None:
        t = "object" if "properties" in s else "string"
    if t == "string":
        return rng.choice(s["examples"]) if "examples" in s else rand_str()
    if t == "integer":
        return rng.randint(-10**6, 10**6)
    if t == "number":
        return rng.choice([rng.randint(-999, 999), round(rng.uniform(-1e4, 1e4), 3)])
    if t == "boolean":
        return rng.random() < 0.5
    if t == "null":
        return None
    if t == "array":
        lo, hi = s.get("minItems", 0), s.get("maxItems", 4)
        if depth > 3:
            hi = lo
        return [gen(s.get("items", {}), root, depth + 1) for _ in range(rng.randint(lo, min(hi, lo + 3)))]
    out = {}
    req = s.get("required", [])
    for k, v in s.get("properties", {}).items():
        if k in req or rng.random() < 0.6:
            out[k] = gen(v, root, depth + 1)
    if not s.get("properties"):
        for _ in range(rng.randint(0, 2)):
            out["k%d" % rng.randint(0, 9)] = gen({}, root, depth + 1)
    return out


def dump(v):
    seps = rng.choice([(",", ":"), (", ", ": ")])
    return json.dumps(v, ensure_ascii=False, separators=seps)


def mutate(v, root, s):
    """A structural change in schema order (exact agreement expected)."""
    v = json.loads(json.dumps(v))
    paths = []

    def walk(x, p):
        paths.append(p)
        if isinstance(x, dict):
            for k in x:
                walk(x[k], p + [k])
        elif isinstance(x, list):
            for i, y in enumerate(x):
                walk(y, p + [i])
    walk(v, [])
    p = rng.choice(paths)
    kind = rng.choice(["retype", "drop", "dup_item"])
    if not p:
        return rng.choice([None, 5, "s", [], {}])
    parent = v
    for k in p[:-1]:
        parent = parent[k]
    if kind == "drop" and isinstance(parent, dict):
        del parent[p[-1]]
    elif kind == "dup_item" and isinstance(parent, list):
        parent.append(parent[p[-1]])
    else:
        parent[p[-1]] = rng.choice([None, 7, -2.5, "zz", True, [], {}, [1], {"q": 1}])
    return v


def main():
    tool = sys.argv[1]
    lines = open(os.path.join(os.environ.get("K3_TESTDATA", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")), "vocab", "o200k_base.tiktoken")).read().splitlines()
    vocab = tempfile.NamedTemporaryFile("w", suffix=".tiktoken", delete=False)
    vocab.write("\n".join(lines[:6000]) + "\n")  # the first 6000 ranks: every byte, common merges
    vocab.close()
    p = subprocess.Popen([tool, vocab.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(req):
        p.stdin.write(json.dumps(req) + "\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    if "--bounds" in sys.argv:  # the compiler's bounds only (grammar_bounds.py)
        import grammar_bounds
        tool_p = [p]

        def ask_or_died(req):  # a crash is an answer too (and the next case gets a fresh tool)
            try:
                tool_p[0].stdin.write(json.dumps(req) + "\n")
                tool_p[0].stdin.flush()
                line = tool_p[0].stdout.readline()
                if line:
                    return json.loads(line)
            except (BrokenPipeError, ValueError):
                pass
            rc = tool_p[0].wait()
            tool_p[0] = subprocess.Popen([tool, vocab.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
            return {"error": "grammar_tool died (exit %d)" % rc}

        grammar_bounds.run(ask_or_died)
        p = tool_p[0]
        p.stdin.close()
        p.wait()
        os.unlink(vocab.name)
        return verdict("grammar_bounds")

    for si, s in enumerate(SCHEMAS):
        exact, loose = [], []
        for _ in range(40):
            v = gen(s, s)
            exact.append(dump(v))
            exact.append(dump(mutate(v, s, s)))
            t = dump(v)
            if t:
                i = rng.randrange(len(t))
                loose.append(t[:i] + rng.choice("{}[]\",:0a \\") + t[i + 1:])
                loose.append(t[:i])
            if isinstance(v, dict):
                w = dict(v)
                w["zz_extra"] = 1
                loose.append(dump(w))
        r = ask({"op": "check", "spec": {"schema": s}, "instances": exact + loose})
        if not check("verdicts" in r, "schema %d compiles (%s)" % (si, r.get("error", ""))):
            continue
        val = jsonschema.Draft202012Validator(s, format_checker=jsonschema.FormatChecker())
        bad_exact = bad_loose = 0
        n_valid = 0
        for i, (text, got) in enumerate(zip(exact + loose, r["verdicts"])):
            ok = val.is_valid(json.loads(text)) if _loads_ok(text) else False
            n_valid += ok
            if i < len(exact) and got != ok:
                bad_exact += 1
                if bad_exact <= 3:
                    print("   mismatch: grammar %s jsonschema %s: %r" % (got, ok, text))
            if i >= len(exact) and got and not ok:
                bad_loose += 1
                print("   unsound: grammar accepts an invalid %r" % text)
        check(bad_exact == 0, "schema %d: %d canonical instances, grammar == jsonschema (%d mismatches)"
              % (si, len(exact), bad_exact))
        check(bad_loose == 0, "schema %d: %d edited instances, accepted => valid" % (si, len(loose)))
        check(0 < n_valid < len(exact) + len(loose), "schema %d: instances not degenerate (%d valid)" % (si, n_valid))
        w = ask({"op": "walk", "spec": {"schema": s}, "n": 6, "seed": si + SEED, "max": 3000})
        outs = w.get("outputs", [])
        done = [o for o in outs if o is not None]
        invalid = [o for o in done if not (_loads_ok(o) and val.is_valid(json.loads(o)))]
        for o in invalid[:3]:
            print("   walk output invalid: %r" % o)
        check(len(done) >= 4 and not invalid, "schema %d: %d/%d random walks complete, all valid"
              % (si, len(done), len(outs)))
        check(w.get("mask_errors") == 0, "schema %d: mask == per-id matcher verdict (%s differ)"
              % (si, w.get("mask_errors")))

    for s, kw in BAD:
        r = ask({"op": "check", "spec": {"schema": s}, "instances": []})
        check("error" in r and kw in r["error"], "refused naming %r: %s" % (kw, r.get("error")))

    # regexes against Python's re.fullmatch
    pats = ["[a-c]+x?", "(ab|cd){2,3}", "\\d{3}-\\d{2}", "[^0-9\"]*z", "a.b", "(?:x|y)*\\.[A-F]{1,2}$", "^q(w|e)+r?$"]
    for pat in pats:
        alpha = "abcdxyzqwer0129-.AF\"\n"
        cands = ["".join(rng.choice(alpha) for _ in range(rng.randint(0, 7))) for _ in range(300)]
        w = ask({"op": "walk", "spec": {"regex": pat}, "n": 8, "seed": SEED, "max": 200})
        cands += [o for o in w.get("outputs", []) if o is not None]
        r = ask({"op": "check", "spec": {"regex": pat}, "instances": cands})
        want = [re.fullmatch(pat, c) is not None for c in cands]
        diff = [c for c, a, b in zip(cands, r.get("verdicts", []), want) if a != b]
        check("verdicts" in r and not diff and any(want), "regex %r: %d strings agree with re.fullmatch %s"
              % (pat, len(cands), diff[:3]))
        check(w.get("mask_errors") == 0, "regex %r: masks agree" % pat)

    # the K3 envelope: thinking, then tool calls of the tools' schemas
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}]
    w = ask({"op": "walk", "spec": {"envelope": True, "thinking": True, "no_content": True, "tools": tools,
                                    "tool_choice": "required"}, "n": 3, "seed": SEED, "max": 400})
    check(w.get("mask_errors") == 0, "envelope: masks agree (%s)" % w.get("error", ""))
    p.stdin.close()
    p.wait()
    os.unlink(vocab.name)
    return verdict("test_grammar")


def _loads_ok(t):
    try:
        json.loads(t)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
