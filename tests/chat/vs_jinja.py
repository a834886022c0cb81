#!/usr/bin/env python3
"""vs_jinja.py — `k3 render` against the K3 chat template rendered by Python jinja2.

Oracle: tests/data/fixtures/chat/Kimi-K3.llama.cpp-pr26185.jinja (a hand port of Moonshot's official
encoding_k3.py, byte-identical to it on the features covered here, spec/K3-CHAT.md §0) rendered
with jinja2 the way HF transformers does (sandboxed env, trim_blocks, lstrip_blocks, loopcontrols,
HF-style `tojson`, `raise_exception`, `strftime_now`).

Before jinja sees a request, this script applies the request normalisation that the official
encoder / server performs and the template does not (written here independently of the C code):
  * thinking switches (§5.1): thinking = ctk.thinking ?? ctk.enable_thinking ?? thinking ?? True;
    reasoning_effort == "none" => off; effort = ctk.thinking_effort ?? thinking_effort ??
    reasoning_effort ?? "max";
  * tool-call arguments (§1.2): None/blank -> {}, str -> json.loads (object used; parse failure ->
    raw json block; non-object -> error);
  * role developer -> system (k3 request policy).
Documented divergences (k3 follows the official encoder; each has its own check below, which
asserts the official behaviour AND that the raw template really differs):
  D1 key order of the tools / schema JSON: Python sorted (code point) vs jinja dictsort
     (case-insensitive): checked against the template with json_sorted replaced by
     tojson(sort_keys=True, separators=(",", ":")).
  D2 thinking_effort "medium": official asserts {low, high, max}; the later ggml-org template
     accepts it. k3 rejects it.
  D3 arguments string that parses to a non-object ("[1, 2]"): official error; template renders a
     raw json block.
  D4 arguments given as a JSON string: official parses it into argument tags; the raw template
     renders a raw json block.
  D5 role developer: the encoder drops unknown roles; k3 renders it as system (policy).
  D6 segments: per-segment encoding (§4.6): user text that contains "<|open|>" stays a text
     segment; only structural markers are control segments.
  D7 malformed requests (k3 policy): a message that is not an object, a non-string role, tools
     that are not a list of {"function": {"name": ...}}, an image_url that is not an object or a
     string are errors naming the field and index (the encoder skips or renders them); unknown
     string roles are skipped like the encoder, with a warning on stderr.
  D8 request validation (issue 11, k3 policy): tool `parameters` that is not an object, a
     json_schema response format whose schema is not an object (or is missing: the encoder
     renders `null`), and a tool name holding control-token text (a K3 special token, "<|", "|>")
     are errors naming the key; the template renders them as written.
Exit: 0 pass, 1 fail, 77 skip (jinja2 missing).
"""
import json
import os
import subprocess
import sys

try:
    import jinja2  # noqa: F401  (k3_jinja needs it)
except ImportError:
    print("vs_jinja: jinja2 not installed, skipping")
    sys.exit(77)

SHARED = os.environ.get("K3_TESTDATA", os.path.join(os.path.dirname(__file__), "..", "data"))
K3 = os.environ.get("K3_BIN") or (sys.argv[1] if len(sys.argv) > 1 else None)
if not K3:
    print("vs_jinja: set K3_BIN or pass the k3 binary")
    sys.exit(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k3_jinja import (MARKERS, T_GG, T_OFFICIAL, T_PR, TemplateError, jinja_render,  # noqa: E402
                      normalise)


def k3(req_text, *flags):
    p = subprocess.run([K3, "render", *flags], input=req_text.encode(), capture_output=True)
    return p.returncode, p.stdout.decode("utf-8", "surrogateescape"), p.stderr.decode(errors="replace")


failures = 0
n_checked = 0


def fail(name, msg):
    global failures
    failures += 1
    print(f"FAIL {name}: {msg}")


def check_segments(name, req_text, text):
    """D6 + granularity: segments concatenate to the text; control segments are markers (or the
    image placeholder); the marker positions in the text are exactly the control segments, unless
    they lie inside a text segment (user-typed marker text)."""
    rc, out, err = k3(req_text, "--segments")
    if rc != 0:
        return fail(name, f"--segments failed: {err}")
    segs = json.loads(out)
    if "".join(s for s, _ in segs) != text:
        return fail(name, "segments do not concatenate to the rendered text")
    for s, c in segs:
        if s == "":
            return fail(name, "empty segment")
        if c and s not in MARKERS + ["<|kimi_image_placeholder|>"]:
            return fail(name, f"control segment {s!r} is not a marker")
        if not c and any(m == s for m in MARKERS):
            # a text segment that is exactly a marker can only come from user/model text
            if s not in req_text:
                return fail(name, f"marker {s!r} rendered as text")
    return segs


def case(name, req, raw=None, expect_error=None):
    """Render with jinja (after normalisation) and k3; compare bytes (or both must fail)."""
    global n_checked
    n_checked += 1
    text = raw if raw is not None else json.dumps(req, ensure_ascii=False)
    if req is None:
        req = json.loads(raw)
    try:
        want, jerr = jinja_render(req), None
    except TemplateError as e:
        want, jerr = None, str(e)
    rc, got, err = k3(text)
    if expect_error is not None or jerr is not None:
        if rc == 0:
            return fail(name, f"k3 rendered but the reference fails ({jerr})")
        if jerr is None:
            return fail(name, "k3 failed but the reference renders")
        if expect_error and expect_error not in err:
            return fail(name, f"error {err.strip()!r} lacks {expect_error!r}")
        if "\n" in err.strip() or not err.startswith("k3 render: "):
            return fail(name, f"error is not one clear line: {err!r}")
        return
    if rc != 0:
        return fail(name, f"k3 failed: {err.strip()}")
    if got != want:
        i = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want)))
        return fail(name, f"differs at char {i}:\n  k3:    {got[max(0, i - 60):i + 60]!r}\n"
                          f"  jinja: {want[max(0, i - 60):i + 60]!r}")
    check_segments(name, text, got)


U = lambda c, **kw: {"role": "user", "content": c, **kw}
S = lambda c, **kw: {"role": "system", "content": c, **kw}
A = lambda c, **kw: {"role": "assistant", "content": c, **kw}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City"},
                                                            "days": {"type": "integer"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Web search",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "opts": {"type": "object"}},
                         "required": ["q"]}}}
CALLS = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
         {"id": "c2", "type": "function", "function": {"name": "search", "arguments": {
             "q": "Tokyo weather", "opts": {"lang": "en", "n": [1, 2]}, "safe": True, "x": None}}}]
TOOLCONV = [S("You are Kimi."), U("Weather in Paris and Tokyo?", name="alice"),
            A("Checking.", reasoning_content="Need two calls.", tool_calls=CALLS),
            {"role": "tool", "tool_call_id": "c2", "content": "Tokyo: rain"},
            {"role": "tool", "tool_call_id": "c1", "content": "Paris: sun"},
            A("Paris sunny, Tokyo rainy.", reasoning_content="Summarize."), U("Thanks")]

# ---- the comparison cases -------------------------------------------------------------------
case("user only, defaults", {"messages": [U("hi")]})
case("thinking off: ctk.thinking", {"messages": [U("hi")], "chat_template_kwargs": {"thinking": False}})
case("thinking off: ctk.enable_thinking", {"messages": [U("hi")], "chat_template_kwargs": {"enable_thinking": False}})
case("thinking off: top-level", {"messages": [U("hi")], "thinking": False})
case("thinking off: reasoning_effort none", {"messages": [U("hi")], "reasoning_effort": "none"})
case("reasoning_effort low", {"messages": [U("hi")], "reasoning_effort": "low"})
case("thinking_effort high", {"messages": [U("hi")], "thinking_effort": "high", "reasoning_effort": "low"})
case("ctk.thinking beats top-level", {"messages": [U("hi")], "thinking": False, "chat_template_kwargs": {"thinking": True}})
case("ctk.thinking_effort", {"messages": [U("hi")], "chat_template_kwargs": {"thinking_effort": "low"}})
case("none beats ctk thinking", {"messages": [U("hi")], "reasoning_effort": "none", "chat_template_kwargs": {"thinking": True}})
case("multi-turn with reasoning", {"messages": [S("Be brief."), U("2+2?"), A("4", reasoning_content="easy"), U("and 3+3?")]})
case("named messages", {"messages": [S("sys", name="policy"), U("hey", name="bob"), A("yo", name="kimi"), U("x", name="")]})
case("spec §1.7 tools, results out of order", {"messages": TOOLCONV, "tools": [WEATHER, SEARCH]})
case("same, thinking off", {"messages": TOOLCONV, "tools": [WEATHER, SEARCH], "thinking": False})
case("unmatched tool ids: as given, names by order", {"messages": [
    U("go"), A("", tool_calls=CALLS), {"role": "tool", "tool_call_id": "zz", "content": "a"},
    {"role": "tool", "tool_call_id": "c1", "content": "b"}]})
case("tool results by name, no ids", {"messages": [
    U("go"), A(None, tool_calls=CALLS), {"role": "tool", "name": "custom", "content": "a"},
    {"role": "tool", "content": "b"}]})
case("tool result with `tool` key", {"messages": [U("go"), {"role": "tool", "tool": "t1", "content": "x"}]})
case("duplicate call ids: first wins", {"messages": [
    U("go"), A("", tool_calls=[{"id": "d", "function": {"name": "f1", "arguments": {}}},
                                {"id": "d", "function": {"name": "f2", "arguments": {}}},
                                {"id": "e", "function": {"name": "f3", "arguments": {}}}]),
    {"role": "tool", "tool_call_id": "e", "content": "E"}, {"role": "tool", "tool_call_id": "d", "content": "D1"},
    {"role": "tool", "tool_call_id": "d", "content": "D2"}]})
case("numeric ids match as str()", {"messages": [
    U("go"), A("", tool_calls=[{"id": 7, "function": {"name": "f", "arguments": {}}},
                                {"id": "8", "function": {"name": "g", "arguments": {}}}]),
    {"role": "tool", "tool_call_id": 8, "content": "G"}, {"role": "tool", "tool_call_id": "7", "content": "F"}]})
case("arguments as JSON strings", {"messages": [U("go"), A("", tool_calls=[
    {"id": "a", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [true, null], \"c\": \"x\"}"}},
    {"id": "b", "function": {"name": "g", "arguments": "  "}},
    {"id": "c", "function": {"name": "h", "arguments": None}},
    {"id": "d", "function": {"name": "k"}}])]})
case("raw json block + attribute escaping", {"messages": [U("go"), A("", tool_calls=[
    {"id": "a", "function": {"name": "we\"ird&name", "arguments": "{not json"}}]),
    {"role": "tool", "content": "r"}]})
case("flat tool call (no function wrapper)", {"messages": [U("go"), A("", tool_calls=[{"name": "flat", "arguments": {"k": 1}}])]})
case("argument value types (raw lexemes)", None, raw='{"messages":[{"role":"user","content":"go"},'
     '{"role":"assistant","content":"","tool_calls":[{"id":"a","function":{"name":"f","arguments":'
     '{"f1":1.0,"f2":1e5,"f3":-0.0,"f4":1.5e-7,"f5":1e16,"f6":123456789.125,"big":123456789012345678901234567890,'
     '"neg":-0,"f7":1234567890123456.0,"f8":0.0001,"f9":0.00001234,"f10":1e400,"f11":-1e-400,"nested":{"z":[1,{"y":"ü \\"q\\"\\n"}],"a":{}},"arr":[],"uni":"日本語 é","t":true,"f":false,"n":null,'
     '"esc":"tab\\there\\u0001","dup":1,"dup":2}}}]}]}')
case("arguments string with floats", {"messages": [U("go"), A("", tool_calls=[
    {"id": "a", "function": {"name": "f", "arguments": "{\"x\": 1e5, \"y\": 2.50, \"z\": [1E-5, 10000000000000000.0]}"}}])]})
case("dynamic tools on a system message", {"messages": [S("ignored", tools=[SEARCH]), U("q")], "tools": [WEATHER]})
case("tool_choice required", {"messages": [U("q")], "tools": [WEATHER], "tool_choice": "required"})
case("tool_choice none", {"messages": [U("q")], "tools": [WEATHER], "tool_choice": "none"})
case("tool_choice object: no message", {"messages": [U("q")], "tools": [WEATHER],
                                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
case("tool_choice auto", {"messages": [U("q")], "tools": [WEATHER], "tool_choice": "auto"})
case("response_format json_object", {"messages": [U("q")], "response_format": {"type": "json_object"}})
SCHEMA = {"type": "object", "properties": {"b": {"type": "number", "minimum": 1.0}, "a": {"type": "string"}}, "required": ["a"]}
case("json_schema .schema", {"messages": [U("q")], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
case("json_schema .json_schema fallback", {"messages": [U("q")], "response_format": {"type": "json_schema", "json_schema": {"json_schema": SCHEMA}}})
case("json_schema wrapper itself", {"messages": [U("q")], "response_format": {"type": "json_schema", "json_schema": SCHEMA}})
case("response_format text", {"messages": [U("q")], "response_format": {"type": "text"}})
case("content parts + image", {"messages": [
    U([{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": " ok"}]),
    A([{"type": "text", "text": "seen"}]), U([{"type": "image"}, {"type": "input_text", "text": "2"}])]})
case("reasoning: whitespace-only dropped, `reasoning` key", {"messages": [
    U("a"), A("b", reasoning_content="  \n "), U("c"), A("d", reasoning="r2"), U("e"),
    A("f", reasoning_content="", reasoning="r3"), U("g"), A("h", reasoning_content=" keep spaces ")]})
case("marker text typed by the user", {"messages": [U("<|open|>tools<|sep|> & \"q\" <b>"), A("<|end_of_msg|>")]})
case("unknown roles skipped", {"messages": [U("a"), {"role": "narrator", "content": "zzz"}, U("b")]})
case("developer -> system (normalised)", {"messages": [{"role": "developer", "content": "rules"}, U("b")]})
case("tools: unicode, floats, escapes", None, raw='{"messages":[{"role":"user","content":"q"}],"tools":'
     '[{"type":"function","function":{"name":"f","description":"ünï \\u0007 \\"x\\" \\\\ /",'
     '"parameters":{"type":"object","properties":{"n":{"type":"number","minimum":1.0,"maximum":1e5,"default":-0.0}}}}}]}')
case("empty conversation with tools", {"messages": [], "tools": [SEARCH]})
case("tool index resets per assistant", {"messages": [
    U("a"), A("", tool_calls=[CALLS[0]]), {"role": "tool", "tool_call_id": "c1", "content": "1"},
    U("b"), {"role": "tool", "content": "late"},
    A("", tool_calls=[CALLS[1]]), {"role": "tool", "tool_call_id": "c2", "content": "2"}]})
case("tool_calls empty list", {"messages": [U("a"), A("x", tool_calls=[]), {"role": "tool", "name": "n", "content": "y"}]})
# errors that the reference raises too
case("effort bogus -> error", {"messages": [U("hi")], "thinking_effort": "extreme"}, expect_error="extreme")
case("list arguments -> error", {"messages": [U("a"), A("", tool_calls=[{"function": {"name": "f", "arguments": [1]}}])]},
     expect_error="arguments")
case("tool without name -> error", {"messages": [U("a"), {"role": "tool", "content": "x"}]}, expect_error="tool name")
case("message without role -> error", {"messages": [{"content": "x"}]}, expect_error="role")
case("call without name -> error", {"messages": [U("a"), A("", tool_calls=[{"function": {"arguments": {}}}])]},
     expect_error="function name")


def k3_ok(name, req):
    rc, got, err = k3(json.dumps(req, ensure_ascii=False))
    if rc != 0:
        fail(name, f"k3 failed: {err.strip()}")
        return None
    return got


# Randomised values (seeded): floats from random bit patterns, big ints, random unicode keys
# (mixed case, so the reference is the code-point-sorted template of D1).
import random
import struct


def rand_value(rng, depth=0):
    k = rng.randrange(9 if depth < 3 else 5)
    if k == 0:
        while True:
            f = struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0]
            if f == f and f not in (float("inf"), float("-inf")):
                return f
    if k == 1:
        return rng.choice([0.1, 1.0, 0.5, 1e22, 1e21, 123.456, 5e-324, 1.7976931348623157e308,
                           rng.uniform(-1e6, 1e6), rng.randrange(-10**6, 10**6) / 100.0])
    if k == 2:
        return rng.randrange(-10**30, 10**30)
    if k == 3:
        return "".join(chr(rng.choice([rng.randrange(0x20), rng.randrange(0x20, 0x80),
                                        rng.randrange(0xA0, 0xD7FF), rng.randrange(0x10000, 0x10FFFF)]))
                       for _ in range(rng.randrange(6)))
    if k == 4:
        return rng.choice([True, False, None])
    if k in (5, 6):
        return [rand_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["a", "B", "_", "id", "URL", "é", "Z9", "\u00e9t\u00e9", "k\u0001", "日本", "😀"]
    return {rng.choice(keys): rand_value(rng, depth + 1) for _ in range(rng.randrange(5))}


for seed in range(1, 7):
    rng = random.Random(seed)
    # parameters and the schema must be objects (D8): a random non-object goes one level down
    par, sch = rand_value(rng, 1) or {"x": 1}, rand_value(rng, 1)
    par, sch = par if isinstance(par, dict) else {"v": par}, sch if isinstance(sch, dict) else {"v": sch}
    tools = [{"type": "function", "function": {"name": f"t{seed}", "parameters": par}}]
    args = {f"a{i}": rand_value(rng) for i in range(8)}
    req = {"messages": [U("q"), A("", tool_calls=[{"id": "1", "function": {"name": "f", "arguments": args}}])],
           "tools": tools, "response_format": {"type": "json_schema", "json_schema": {"schema": sch}}}
    n_checked += 1
    got = k3_ok(f"random seed {seed}", req)
    if got is not None and got != T_OFFICIAL.render(**normalise(req)):
        fail(f"random seed {seed}", "differs from the official-order template")


# Float repr stress: 3000 doubles from random bit patterns + boundary values as argument values
# (json.dumps default separators) — k3's shortest round-trip repr vs Python's.
rng = random.Random(1234)
floats = [0.1, 0.2, 0.3, 1/3, 2/3, 1e16, 1e15, 9999999999999998.0, 1e-4, 1e-5, 5e-324, 2.2250738585072014e-308,
          1.7976931348623157e308, 4.35, 0.000123, 123e20, 1e22, 1e23, 9007199254740993.0, -0.0]
while len(floats) < 3000:
    f = struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0]
    if f == f and abs(f) != float("inf"):
        floats.append(f)
    floats.append(rng.uniform(-1000, 1000))
req = {"messages": [U("q"), A("", tool_calls=[{"function": {"name": "f", "arguments": {"v": floats}}}])]}
n_checked += 1
got = k3_ok("float repr stress", req)
if got is not None and got != jinja_render(req):
    fail("float repr stress", "differs from Python repr")


# ---- documented divergences -----------------------------------------------------------------
# D1: key order. Official (Python sorted) vs dictsort (case-insensitive).
d1 = {"messages": [U("q")], "tools": [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"id": {"type": "string"}, "URL": {"type": "string"}, "_x": {"type": "integer"}}}}}],
    "response_format": {"type": "json_schema", "json_schema": {"schema": {"b": 1, "B": 2, "a": 3, "_": 4}}}}
got = k3_ok("D1", d1)
official = T_OFFICIAL.render(**normalise(d1))
if got is not None:
    n_checked += 1
    if got != official:
        fail("D1", "k3 does not use code-point key order")
    if official == T_PR.render(**normalise(d1)):
        fail("D1", "divergence case does not diverge (template unchanged?)")
    if '"URL":{"type":"string"},"_x"' not in got or '{"B":2,"_":4,"a":3,"b":1}' not in got:
        fail("D1", "expected code-point order URL < _x < id, B < _ < a < b")

# D2: medium is rejected by k3 (official); the ggml-org template accepts it.
n_checked += 1
rc, _, err = k3(json.dumps({"messages": [U("hi")], "reasoning_effort": "medium"}))
if rc == 0 or "medium" not in err:
    fail("D2", f"k3 should reject medium with a clear error (rc={rc}, {err!r})")
if "thinking_effort=medium" not in T_GG.render(**normalise({"messages": [U("hi")], "reasoning_effort": "medium"})):
    fail("D2", "the ggml-org template should accept medium (divergence vanished?)")

# D3: arguments string parsing to a non-object: official error; the template renders a block.
n_checked += 1
d3 = {"messages": [U("a"), A("", tool_calls=[{"function": {"name": "f", "arguments": "[1, 2]"}}])]}
rc, _, err = k3(json.dumps(d3))
if rc == 0 or "not an object" not in err:
    fail("D3", f"k3 should reject non-object arguments (rc={rc}, {err!r})")
if "<|open|>json type=\"object\"<|sep|>[1, 2]" not in jinja_render(d3, parse_args=False):
    fail("D3", "template no longer renders the raw block (divergence vanished?)")

# D4: a JSON-string arguments value becomes argument tags (official), not a raw block (template).
n_checked += 1
d4 = {"messages": [U("a"), A("", tool_calls=[{"function": {"name": "f", "arguments": "{\"k\": \"v\"}"}}])]}
got = k3_ok("D4", d4)
if got is not None:
    if '<|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|>' not in got:
        fail("D4", "k3 did not parse the arguments string")
    if "<|open|>json" not in jinja_render(d4, parse_args=False):
        fail("D4", "template parses argument strings now (divergence vanished?)")

# D5: developer is rendered as system by k3; the raw template drops it.
n_checked += 1
d5 = {"messages": [{"role": "developer", "content": "rules"}, U("b")]}
got = k3_ok("D5", d5)
if got is not None:
    if '<|open|>message role="system"<|sep|>rules<|close|>message' not in got:
        fail("D5", "developer not rendered as system")
    if "rules" in jinja_render(d5, map_developer=False):
        fail("D5", "template renders developer now (divergence vanished?)")

# D6: user-typed marker text is a text segment; the spec §1.7 segment granularity.
n_checked += 1
rc, out, err = k3(json.dumps({"messages": [U("x<|open|>y", name="al\"ice")]}), "--segments")
segs = json.loads(out) if rc == 0 else []
if ["x<|open|>y", False] not in segs:
    fail("D6", "user text with marker text is not one text segment")
if segs[:14] != [["<|open|>", True], ["message", False], [" role", False], ["=\"", False], ["system", False],
                 ["\"", False], [" type", False], ["=\"", False], ["thinking-effort", False], ["\"", False],
                 ["<|sep|>", True], [segs[11][0], False], ["<|close|>", True], ["message", False]]:
    fail("D6", f"first 14 segments differ from spec §1.7: {segs[:14]}")
want_user = [["<|open|>", True], ["message", False], [" role", False], ["=\"", False], ["user", False], ["\"", False],
             [" name", False], ["=\"", False], ["al&quot;ice", False], ["\"", False], ["<|sep|>", True],
             ["x<|open|>y", False], ["<|close|>", True], ["message", False], ["<|sep|>", True], ["<|end_of_msg|>", True]]
if segs[16:32] != want_user:
    fail("D6", f"user message segments: {segs[16:32]}")

# Bad input: one clear line, never a crash.
for bad, needle in [("{", "invalid JSON"), ("[]", "object"), ('{"messages": 3}', "messages"),
                    ('{"messages": [], "thinking": "yes"}', "thinking"), (b'{"messages": ["\xff"]}', "UTF-8"),
                    ('{"messages": [{"role": "user", "content": 5}]}', "content")]:
    n_checked += 1
    p = subprocess.run([K3, "render"], input=bad if isinstance(bad, bytes) else bad.encode(), capture_output=True)
    e = p.stderr.decode(errors="replace")
    if p.returncode != 1 or needle not in e or e.count("\n") != 1:
        fail(f"bad input {bad!r}", f"rc={p.returncode} stderr={e!r}")

# D7: malformed requests are one clear error line naming the field and index (exit 1), although
# the template renders them (skips the non-mapping, dumps the bad tools as JSON, ...).
for bad, needle in [
        ({"messages": [1]}, "messages[0] must be an object"),
        ({"messages": [U("a"), "not a mapping"]}, "messages[1] must be an object"),
        ({"messages": [{"role": 5, "content": "a"}]}, "messages[0].role must be a string"),
        ({"messages": [U("a")], "tools": 5}, "tools must be a list"),
        ({"messages": [U("a")], "tools": [5]}, "tools[0] must be an object"),
        ({"messages": [U("a")], "tools": [WEATHER, {"type": "function"}]}, 'tools[1] has no "function" object'),
        ({"messages": [U("a")], "tools": [{"type": "function", "function": {"description": "x"}}]},
         "tools[0].function.name"),
        ({"messages": [U([{"type": "image_url", "image_url": 5}])]}, "messages[0].content[0].image_url")]:
    n_checked += 1
    rc, _, err = k3(json.dumps(bad))
    if rc != 1 or needle not in err or err.count("\n") != 1 or not err.startswith("k3 render: "):
        fail("D7", f"{bad}: rc={rc} stderr={err!r} (want one line with {needle!r})")
n_checked += 1
try:
    jinja_render({"messages": [U("a"), "not a mapping"]})
except TemplateError as e:
    fail("D7", f"the template rejects a non-mapping message now (divergence vanished?): {e}")
n_checked += 1
rc, out, err = k3(json.dumps({"messages": [U("a"), {"role": "narrator", "content": "zzz"}]}))
if rc != 0 or "zzz" in out or "unknown role 'narrator'" not in err or "messages[1]" not in err:
    fail("D7", f"unknown role: rc={rc} stderr={err!r}")

# D8: request validation before rendering (issue 11): one clear line naming the key, exit 1,
# although the template renders each of these as written (checked for the first of each kind).
def tool(name, **fn):
    return {"type": "function", "function": dict(name=name, **fn)}


def rf_schema(js):
    return {"type": "json_schema", "json_schema": js}


D8 = [({"messages": [U("a")], "tools": [tool("f", parameters="{\"type\": \"object\"}")]},
       "tools[0].function.parameters must be a JSON object", True),
      ({"messages": [U("a")], "tools": [WEATHER, tool("f", parameters=[{"type": "object"}])]},
       "tools[1].function.parameters must be a JSON object", False),
      ({"messages": [U("a")], "tools": [tool("f", parameters=3)]}, "tools[0].function.parameters", False),
      ({"messages": [U("a")], "tools": [tool("f", parameters=True)]}, "tools[0].function.parameters", False),
      ({"messages": [S("s", tools=[tool("g", parameters="x")]), U("a")]},
       "messages[0].tools[0].function.parameters", False),
      ({"messages": [U("a")], "response_format": rf_schema({"name": "x", "schema": "{}"})},
       "response_format.json_schema.schema must be a JSON object", True),
      ({"messages": [U("a")], "response_format": rf_schema({"name": "x", "schema": [1]})},
       "response_format.json_schema.schema", False),
      ({"messages": [U("a")], "response_format": rf_schema({"name": "x", "schema": None})},
       "response_format.json_schema.schema", False),
      ({"messages": [U("a")], "response_format": rf_schema({"json_schema": 5})},
       "response_format.json_schema.json_schema", False),
      ({"messages": [U("a")], "response_format": rf_schema("x")}, "response_format.json_schema must", False),
      ({"messages": [U("a")], "response_format": {"type": "json_schema"}}, "response_format.json_schema is missing",
       True),
      ({"messages": [U("a")], "response_format": "json_schema"}, "response_format.json_schema is missing", False),
      ({"messages": [U("a")], "tools": [tool("get<|open|>x", parameters={})]},
       "tools[0].function.name holds control-token text '<|open|>'", True),
      ({"messages": [U("a")], "tools": [WEATHER, tool("f[EOS]")]}, "tools[1].function.name holds control-token text '[EOS]'",
       False),
      ({"messages": [U("a")], "tools": [tool("f<|im_end|>")]}, "control-token text '<|'", False),
      ({"messages": [U("a")], "tools": [tool("f|>")]}, "control-token text '|>'", False),
      ({"messages": [U("a")], "tools": [tool("x<|reserved_token_163600|>")]}, "<|reserved_token_N|>", False),
      ({"messages": [U("a")], "tools": [tool("<osagent_mode>")]}, "'<osagent_mode>'", False),
      ({"messages": [S("s", tools=[tool("a<|end_of_msg|>")]), U("a")]},
       "messages[0].tools[0].function.name holds control-token text '<|end_of_msg|>'", False),
      ({"messages": [U("a"), A("", tool_calls=[{"id": "1", "function": {"name": "f<|sep|>", "arguments": {}}}])]},
       "messages[1].tool_calls[0].function.name holds control-token text '<|sep|>'", True),
      ({"messages": [U("a"), A(""), {"role": "tool", "name": "t[BOS]", "content": "r"}]},
       "messages[2].name holds control-token text '[BOS]'", True)]
for bad, needle, vs_template in D8:
    n_checked += 1
    rc, _, err = k3(json.dumps(bad))
    if rc != 1 or needle not in err or err.count("\n") != 1 or not err.startswith("k3 render: "):
        fail("D8", f"{bad}: rc={rc} stderr={err!r} (want one line with {needle!r})")
    if vs_template:
        try:
            jinja_render(bad)
        except TemplateError as e:
            fail("D8", f"the template rejects {bad} now (divergence vanished?): {e}")
# accepted: absent or null parameters, an object schema from each of the three places, names
# with brackets or bars that are no special token
for good in ({"messages": [U("a")], "tools": [tool("f"), tool("g", parameters=None)]},
             {"messages": [U("a")], "tools": [tool("a[b]|c<d>")]},
             {"messages": [U("a")], "response_format": rf_schema({"json_schema": {}})},
             {"messages": [U("a")], "response_format": rf_schema({"type": "object"})}):
    n_checked += 1
    rc, _, err = k3(json.dumps(good))
    if rc != 0:
        fail("D8", f"{good} refused: {err.strip()}")

# render flags: --model / --vocab without --ids are harmless (a one-line note, the same text);
# with --ids exactly one of them (exit 2, one line)
VOCAB = os.path.join(SHARED, "vocab/o200k_base.tiktoken")
_, plain, _ = k3(json.dumps({"messages": [U("a")]}))
for flags in (["--model", "/tmp"], ["--vocab", VOCAB]):
    n_checked += 1
    rc, out, err = k3(json.dumps({"messages": [U("a")]}), *flags)
    if rc != 0 or out != plain or "not needed without --ids" not in err or err.count("\n") != 1:
        fail("render flags", f"{flags}: rc={rc} stderr={err!r} (want the text and a one-line note)")
for flags, needle in [(["--ids", "--model", "/tmp", "--vocab", VOCAB], "exactly one of --model DIR or --vocab FILE"),
                      (["--ids"], "exactly one of")]:
    n_checked += 1
    rc, _, err = k3(json.dumps({"messages": [U("a")]}), *flags)
    if rc != 2 or needle not in err or err.count("\n") != 1:
        fail("render flags", f"{flags}: rc={rc} stderr={err!r}")

# ---- issue 8: request keys -------------------------------------------------------------------
# add_generation_prompt: false (vLLM's key) is byte-identical to the template rendered with it,
# thinking on and off, with and without a final assistant turn; null = the default (true).
for think in (True, False):
    for msgs in ([U("hi")], [S("sys"), U("hi"), A("hello", reasoning_content="r")],
                 {"messages": TOOLCONV, "tools": [WEATHER, SEARCH]}):
        req = dict(msgs) if isinstance(msgs, dict) else {"messages": msgs}
        req.update({"add_generation_prompt": False, "thinking": think})
        case(f"add_generation_prompt false, thinking {think}, {len(req['messages'])} messages", req)
case("add_generation_prompt true", {"messages": [U("hi")], "add_generation_prompt": True})
case("add_generation_prompt null = true", {"messages": [U("hi")], "add_generation_prompt": None})
case("add_generation_prompt false + tool_choice + response_format",
     {"messages": [U("q"), A("a")], "tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}, "add_generation_prompt": False})
n_checked += 1
rc, out, err = k3(json.dumps({"messages": [U("hi"), A("x")]}), "--no-generation-prompt")
_, out2, _ = k3(json.dumps({"messages": [U("hi"), A("x")], "add_generation_prompt": False}))
if rc != 0 or out != out2 or out != jinja_render({"messages": [U("hi"), A("x")], "add_generation_prompt": False}):
    fail("--no-generation-prompt", "differs from add_generation_prompt false")
# thinking_effort null means the default (spec §5.1 `??`): max, or the next key in the chain
case("thinking_effort null = max", {"messages": [U("hi")], "thinking_effort": None})
case("thinking_effort null -> reasoning_effort", {"messages": [U("hi")], "thinking_effort": None,
                                                   "reasoning_effort": "low"})
case("ctk.thinking_effort null -> top-level", {"messages": [U("hi")], "thinking_effort": "high",
                                                "chat_template_kwargs": {"thinking_effort": None}})
case("thinking null = on", {"messages": [U("hi")], "thinking": None})
n_checked += 1
if k3(json.dumps({"messages": [U("hi")], "thinking_effort": None}))[1] != k3(json.dumps({"messages": [U("hi")]}))[1]:
    fail("thinking_effort null", "differs from no thinking_effort")

# continue_final_message (vLLM's key): the final assistant message stays open in the §1.8 form
# (inferred; the template has no such form, so the expected text is written out here): the
# history as the template renders it without a generation prompt, then the message opener,
# `think` + reasoning, and with content: close `think`, open `response` + content.
HIST = [S("sys"), U("hi")]
hist = jinja_render({"messages": HIST, "add_generation_prompt": False})
hist_off = jinja_render({"messages": HIST, "add_generation_prompt": False, "thinking": False})
OPEN = '<|open|>message role="assistant"<|sep|>'
for name, last, think, want in [
        ("reasoning + content", A("The ans", reasoning_content="Let me"), True,
         hist + OPEN + "<|open|>think<|sep|>Let me<|close|>think<|sep|><|open|>response<|sep|>The ans"),
        ("reasoning only", A("", reasoning_content="Let me"), True, hist + OPEN + "<|open|>think<|sep|>Let me"),
        ("content null, no reasoning", A(None), True, hist + OPEN + "<|open|>think<|sep|>"),
        ("content, no reasoning", A("Sure"), True,
         hist + OPEN + "<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>Sure"),
        ("thinking off", A("Sure", reasoning_content="dropped"), False,
         hist_off + OPEN + "<|open|>response<|sep|>Sure"),
        ("named, parts", A([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], name="k"), True,
         hist + '<|open|>message role="assistant" name="k"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
                '<|open|>response<|sep|>ab')]:
    n_checked += 1
    req = {"messages": HIST + [last], "continue_final_message": True, "add_generation_prompt": False,
           "thinking": think}
    rc, out, err = k3(json.dumps(req))
    if rc != 0 or out != want:
        fail(f"continue_final_message: {name}", f"rc={rc} {err.strip()}\n  got:  {out[-160:]!r}\n  want: {want[-160:]!r}")
# the internal system messages of §1.2 steps 4-5 come before the continued message
n_checked += 1
req = {"messages": HIST + [A("x")], "tools": [WEATHER], "tool_choice": "required", "continue_final_message": True,
       "add_generation_prompt": False, "thinking": False}
rc, out, err = k3(json.dumps(req))
tc = jinja_render({"messages": HIST, "tools": [WEATHER], "tool_choice": "required", "add_generation_prompt": False,
                   "thinking": False})
if rc != 0 or out != tc + OPEN + "<|open|>response<|sep|>x":
    fail("continue_final_message + tool_choice", f"rc={rc} {err.strip()} {out[-200:]!r}")
# refusals: one clear line naming the keys
for req, needle in [
        ({"messages": [U("a"), A("b")], "continue_final_message": True},
         '"continue_final_message": true cannot be combined with "add_generation_prompt": true'),
        ({"messages": [U("a"), A("b")], "continue_final_message": True, "add_generation_prompt": True},
         '"add_generation_prompt": false'),
        ({"messages": [U("a")], "continue_final_message": True, "add_generation_prompt": False},
         "needs an assistant message last"),
        ({"messages": [U("a"), A("", tool_calls=CALLS)], "continue_final_message": True,
          "add_generation_prompt": False}, "has tool_calls"),
        ({"messages": [U("a")], "add_generation_prompt": "yes"}, '"add_generation_prompt" must be true or false'),
        ({"messages": [U("a")], "continue_final_message": 1}, '"continue_final_message" must be true or false')]:
    n_checked += 1
    rc, _, err = k3(json.dumps(req))
    if rc != 1 or needle not in err or err.count("\n") != 1 or not err.startswith("k3 render: "):
        fail("request keys", f"{req}: rc={rc} stderr={err!r} (want one line with {needle!r})")
n_checked += 1
rc, _, err = k3(json.dumps({"messages": [U("a"), A("b")], "continue_final_message": True}), "--no-generation-prompt")
if rc != 0:
    fail("request keys", f"--no-generation-prompt makes continue_final_message valid: rc={rc} {err!r}")

print(f"vs_jinja: {n_checked} checks, {failures} failed")
sys.exit(1 if failures else 0)
