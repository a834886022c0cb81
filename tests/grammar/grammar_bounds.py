"""grammar_bounds.py — the compiler's bounds (issue 43), run by test_grammar.py --bounds through
grammar_tool: schemas that used to crash, stall or silently drop alternatives must now compile
fast or be refused fast, naming what is wrong.

Each case: a spec, how it must end (compile / error containing a phrase) and a wall-time bound.
"""
import json
import re
import time

from k3_check import check


def ref_chain(n, wrap):
    """$defs d0..d(n-1), d(i) referring to d(i+1) through `wrap`; the last a string."""
    defs = {"d%d" % i: wrap({"$ref": "#/$defs/d%d" % (i + 1)}) for i in range(n - 1)}
    defs["d%d" % (n - 1)] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def run(ask):
    def timed(req):  # CPU seconds of the tool's parse + compile (the machine may be loaded)
        t0 = time.monotonic()
        r = ask(req)
        return r, r.get("compile_cpu_s", time.monotonic() - t0)

    def refused(name, spec, phrase, limit_s=1.0):
        r, dt = timed({"op": "check", "spec": spec, "instances": ["\"x\""]})
        err = r.get("error", "")
        check(phrase in err and dt < limit_s,
              "%s: refused in %.2f CPU s (< %.1f) naming '%s' (got: %s)" % (name, dt, limit_s, phrase, err[:160] or r))

    n = 60000
    refused("$ref chain of 60,000", {"schema": ref_chain(n, lambda r: r)}, "$ref")
    refused("$ref chain of 60,000 through anyOf",
            {"schema": ref_chain(n, lambda r: {"anyOf": [r, {"type": "null"}]})}, "budget")
    refused("$ref chain of 60,000 through properties",
            {"schema": ref_chain(n, lambda r: {"type": "object", "properties": {"a": r}})}, "budget")
    tool = {"type": "function", "function": {"name": "f", "parameters": ref_chain(n, lambda r: r)}}
    refused("$ref chain of 60,000 in a tool's parameters",
            {"envelope": True, "tools": [tool], "tool_choice": "required"}, "$ref")
    chain = ref_chain(n, lambda r: r)
    tool2 = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": chain["$defs"], "properties": {"x": {"$ref": "#/$defs/d0"}}}}}
    refused("$ref chain of 60,000 in a tool's argument",
            {"envelope": True, "tools": [tool2], "tool_choice": "required"}, "$ref")
    refused("$ref cycle", {"schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                      "$ref": "#/$defs/a"}}, "$ref")
    refused("left-recursive anyOf",
            {"schema": {"$defs": {"e": {"anyOf": [{"$ref": "#/$defs/e"}, {"type": "integer"}]}},
                        "$ref": "#/$defs/e"}}, "left-recursive")
    refused("a required self-reference",
            {"schema": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}},
            "no finite value")
    props = {"p%d" % i: {"type": "integer"} for i in range(80000)}
    refused("required x properties, 80,000",
            {"schema": {"type": "object", "properties": props, "required": list(props) + ["missing"]}},
            "'missing'", 2.0)
    refused("a repeat of repeats", {"schema": {"type": "string", "pattern": "^(a{0,1000}){0,1000}$"}},
            "state budget")
    big = {"type": "object", "properties": {"p%d" % i: {"type": "string", "pattern": "^[a-z]{0,20}$"}
                                            for i in range(1000)}}
    refused("the time budget", {"schema": big, "budget_s": 0.05}, "--grammar-budget")

    # bounded repeats: one live copy at a time, so the compile is fast and the walk right
    for hi in (30, 60):
        spec = {"schema": {"type": "object", "properties": {"s": {"type": "string", "pattern": "^.{0,%d}$" % hi}},
                           "required": ["s"], "additionalProperties": False}}
        _, dt = timed({"op": "check", "spec": spec, "instances": []})
        r = ask({"op": "walk", "spec": spec, "n": 3, "seed": 5, "max": 200})
        outs = r.get("outputs") or []
        ok = bool(outs) and all(o is not None and len(json.loads(o)["s"]) <= hi and "\n" not in json.loads(o)["s"]
                                for o in outs)
        check(ok and r.get("mask_errors", 1) == 0 and dt < 1.0,
              "pattern ^.{0,%d}$: compiled in %.2f CPU s (< 1), outputs valid (%s)" % (hi, dt, r.get("error", "")))

    # alternatives that share a prefix: every one can still be produced
    codes = ["C%03d" % i for i in range(249)]
    r, dt = timed({"op": "check", "spec": {"schema": {"enum": codes}}, "instances": [json.dumps(c) for c in codes]})
    v = r.get("verdicts") or []
    check(len(v) == 249 and all(v), "enum of 249 codes: %d of 249 accepted (%s)" % (sum(v), r.get("error", "")))
    choices = ["choice-%d" % i for i in range(300)]
    r, _ = timed({"op": "check", "spec": {"choice": choices}, "instances": choices})
    v = r.get("verdicts") or []
    check(len(v) == 300 and all(v), "guided_choice of 300: %d of 300 accepted" % sum(v))
    alts = [{"type": "object", "properties": {"k": {"const": i}}, "required": ["k"], "additionalProperties": False}
            for i in range(200)]
    inst = ['{"k":%d}' % i for i in range(200)]
    r, _ = timed({"op": "check", "spec": {"schema": {"anyOf": alts}}, "instances": inst})
    v = r.get("verdicts") or []
    check(len(v) == 200 and all(v), "anyOf of 200 objects: %d of 200 accepted (%s)" % (sum(v), r.get("error", "")))
    # an optional self-reference still compiles and generates
    r, _ = timed({"op": "walk", "spec": {"schema": {"type": "object", "properties": {"a": {"$ref": "#"}},
                                                    "additionalProperties": False}},
                  "n": 3, "seed": 2, "max": 200})
    check(r.get("mask_errors", 1) == 0 and all(o is None or re.fullmatch(r'[{}":a, ]*', o) for o in r.get("outputs", [])),
          "an optional self-reference generates (%s)" % r.get("error", ""))
