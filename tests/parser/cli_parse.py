#!/usr/bin/env python3
"""cli_parse.py — `k3 parse` end to end on the 9 llama.cpp Kimi-K3 cases.

For each case of tests/data/fixtures/chat/k3-test-chat-cases.json: write the request (the case's
messages + tools, thinking on), run `k3 parse --vocab o200k_base.tiktoken --request R
--stream-check` with the generation on stdin, and compare the printed message with the
fixture's expected fields (arguments compared as parsed JSON, ids must be call_<n> and unique).
Also: a thinking-off request (reasoning_effort none) starts in the response; --deltas lines
concatenate to the final fields; a bad request file gives one clear error line.
Exit 0 pass, 1 fail.
"""
import json
import os
import subprocess
import sys
import tempfile

SHARED = os.environ.get("K3_TESTDATA", os.path.join(os.path.dirname(__file__), "..", "data"))
K3 = os.environ.get("K3_BIN") or sys.argv[1]
VOCAB = os.path.join(SHARED, "vocab/o200k_base.tiktoken")
fx = json.load(open(os.path.join(SHARED, "fixtures/chat/k3-test-chat-cases.json"), encoding="utf-8"))
failures = 0


def fail(msg):
    global failures
    failures += 1
    print("FAIL", msg)


def parse(gen, req, *flags):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        json.dump(req, f)
    try:
        p = subprocess.run([K3, "parse", "--vocab", VOCAB, "--request", f.name, *flags],
                           input=gen.encode(), capture_output=True)
    finally:
        os.unlink(f.name)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


for i, c in enumerate(fx["cases"], 1):
    tools = [fx["tool_definitions"][t] for t in c["options"]["tools"]]
    req = {"messages": c["options"]["messages"], "tools": tools}
    rc, out, err = parse(c["input"], req, "--stream-check")
    if rc != 0:
        fail(f"case {i}: rc={rc} {err.strip()}")
        continue
    m = json.loads(out)
    e = c["expected"]
    if m["content"] != e["content"] or m["reasoning_content"] != e["reasoning_content"]:
        fail(f"case {i}: content/reasoning {m['content']!r}/{m['reasoning_content']!r}")
    got = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in m["tool_calls"]]
    want = [(t["name"], json.loads(t["arguments"])) for t in e["tool_calls"]]
    if got != want:
        fail(f"case {i}: tool calls {got} != {want}")
    ids = [t["id"] for t in m["tool_calls"]]
    if len(set(ids)) != len(ids) or not all(x.startswith("call_") for x in ids):
        fail(f"case {i}: ids {ids}")
    want_finish = "tool_calls" if want else ("length" if i == 4 else "stop")
    if m["finish_reason"] != want_finish:
        fail(f"case {i}: finish_reason {m['finish_reason']} != {want_finish}")

# thinking off from the request: the completion starts in the response
rc, out, err = parse("Hi<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
                     {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none"})
m = json.loads(out) if rc == 0 else {}
if m.get("content") != "Hi" or "reasoning_content" in m or m.get("finish_reason") != "stop":
    fail(f"thinking off: {out!r} {err!r}")

# --deltas: the printed deltas concatenate to the final message
gen = fx["cases"][5]["input"]
rc, out, err = parse(gen, {"messages": [], "tools": [fx["tool_definitions"]["special_function_tool"]]}, "--deltas")
lines = [json.loads(x) for x in out.splitlines()]
final, deltas = lines[-1], lines[:-1]
r = "".join(d.get("reasoning_content", "") for d in deltas)
ct = "".join(d.get("content", "") for d in deltas)
args = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []))
if len(deltas) < 5 or r != final["reasoning_content"] or ct != final["content"] or \
        args != final["tool_calls"][0]["function"]["arguments"]:
    fail(f"--deltas do not add up: {deltas}")

# --stream-check with a call that never closed (a new call opened first): its deltas were sent
# but the final message leaves it out; the complete calls must still be matched to their streamed
# calls in order (by position, skipping the dropped one), not by parsing the call id.
CALL = '<|open|>call tool="special_function" index="{i}"<|sep|><|open|>argument key="arg1" type="number"<|sep|>{v}<|close|>argument<|sep|>'
gen = ("r<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|>"
       + CALL.format(i=1, v=1) + CALL.format(i=2, v=2) + "<|close|>call<|sep|>"
       + CALL.format(i=3, v=3) + "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>")
rc, out, err = parse(gen, {"messages": [], "tools": [fx["tool_definitions"]["special_function_tool"]]}, "--stream-check")
m = json.loads(out) if rc == 0 else {}
got = [(t["id"], json.loads(t["function"]["arguments"])) for t in m.get("tool_calls", [])]
if rc != 0 or len(got) != 2 or got[0][1] != {"arg1": 2} or got[1][1] != {"arg1": 3} or got[0][0] == got[1][0]:
    fail(f"stream-check with a dropped call: rc={rc} {got} {err.strip()!r}")

# --model and --vocab together: a usage error, like `k3 tokenize`
p = subprocess.run([K3, "parse", "--model", "/tmp", "--vocab", VOCAB], input=b"x", capture_output=True)
if p.returncode != 2 or b"exactly one of --model DIR or --vocab FILE" not in p.stderr:
    fail(f"parse --model + --vocab: rc={p.returncode} {p.stderr!r}")

# errors: one clear line
for gen, req, needle in [("x", {"messages": 3}, "messages"), ("x", {"messages": [], "thinking_effort": "medium"}, "medium")]:
    rc, out, err = parse(gen, req)
    if rc != 1 or needle not in err or err.count("\n") != 1:
        fail(f"error case {req}: rc={rc} {err!r}")
p = subprocess.run([K3, "parse"], input=b"x", capture_output=True)
if p.returncode != 2:
    fail("parse without a tokenizer must be a usage error")

print(f"cli_parse: {failures} failed")
sys.exit(1 if failures else 0)
