#!/usr/bin/env python3
"""request_errors.py — issue 11 item 4 end to end: requests are validated before they are
rendered, and a request error exits 1 (`k3 run --chat`) or gives an invalid_request error line
(`k3 batch`), naming the key, on the tiny model (make-tiny).

Bad requests, each through both commands:
  * tools[i].function.parameters a string, an array, a number;
  * response_format json_schema: .schema a string / an array, missing;
  * a tool name with control-token text (<|open|>, [EOS], <|im_end|>) in tools, in an assistant's
    tool_calls, in a tool result;
  * a logit_bias id at vocab_size and far past it (the sampler used to refuse it: exit 2, no
    key named; in batch an engine_error line); in run --chat also a bias of -Infinity, which the
    sampler refuses (batch gives the engine's error line for it: tests/batch).
`k3 run --chat`: exit 1, exactly one stderr line naming the key, nothing on stdout.
`k3 batch`: the job succeeds; each bad line gets {"response": {"status_code": 400, "body":
{"error": {"code": 400, "message": <naming the key>}}}, "error": null} (a failed
request as an HTTP answer, as the OpenAI batch output carries it); the good lines (logit_bias id vocab_size - 1,
an object schema, null parameters, a name with brackets that is no special token) complete.
Exit: 0 pass, 1 fail.
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_check import check, verdict  # noqa: E402

K3 = os.environ.get("K3_BIN", "build/k3")


def tool(name, **fn):
    return {"type": "function", "function": dict(name=name, **fn)}


def main():
    with tempfile.TemporaryDirectory(prefix="k3_reqerr_") as tmp:
        run_all(tmp)
    return verdict("request_errors")


def run_all(tmp):
    model = os.path.join(tmp, "model")
    subprocess.run([K3, "make-tiny", model], check=True, stderr=subprocess.DEVNULL)
    vocab = json.load(open(os.path.join(model, "config.json")))["text_config"]["vocab_size"]
    base = {"messages": [{"role": "user", "content": "hi"}], "thinking": False, "max_tokens": 2}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f<|open|>", "arguments": "{}"}}]}
    bad = [  # (name, body, the key the error must name)
        ("par-str", dict(base, tools=[tool("f", parameters='{"type": "object"}')]), "tools[0].function.parameters"),
        ("par-arr", dict(base, tools=[tool("f", parameters=[{"type": "object"}])]), "tools[0].function.parameters"),
        ("par-num", dict(base, tools=[tool("f", parameters={}), tool("g", parameters=7)]),
         "tools[1].function.parameters"),
        ("schema-str", dict(base, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}),
         "response_format.json_schema.schema"),
        ("schema-arr", dict(base, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": []}}),
         "response_format.json_schema.schema"),
        ("schema-none", dict(base, response_format={"type": "json_schema"}), "response_format.json_schema"),
        ("name-open", dict(base, tools=[tool("get<|open|>weather", parameters={})]), "tools[0].function.name"),
        ("name-eos", dict(base, tools=[tool("f[EOS]")]), "tools[0].function.name"),
        ("name-k2", dict(base, tools=[tool("f<|im_end|>")]), "tools[0].function.name"),
        ("name-call", dict(base, messages=[base["messages"][0], call, {"role": "user", "content": "go"}]),
         "messages[1].tool_calls[0].function.name"),
        ("name-result", dict(base, messages=[base["messages"][0], {"role": "assistant", "content": "x"},
                                             {"role": "tool", "name": "t[BOS]", "content": "r"}]), "messages[2].name"),
        ("bias-vocab", dict(base, logit_bias={str(vocab): 1}), "'logit_bias'"),
        ("bias-far", dict(base, logit_bias={"5": 1, "999999": -100}), "'logit_bias'"),
    ]
    # run --chat only: -Infinity (a ban) is the sampler's to judge; it refuses it, and run says
    # so as a request error naming the key (batch: the engine's error line, tests/batch)
    bad_run = [("bias-inf", dict(base, logit_bias={"5": float("-inf")}), "'logit_bias'")]
    good = [
        ("bias-last", dict(base, logit_bias={str(vocab - 1): 1})),
        ("schema-ok", dict(base, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}})),
        ("par-null", dict(base, tools=[tool("a[b]|c", parameters=None)])),
    ]

    # ---- k3 run --chat: exit 1, one stderr line naming the key
    for name, body, key in bad + bad_run:
        path = os.path.join(tmp, name + ".json")
        with open(path, "w") as f:
            json.dump(body, f)
        p = subprocess.run([K3, "run", "--model", model, "--chat", path], capture_output=True, text=True,
                           timeout=120)
        lines = p.stderr.strip().splitlines()
        check(p.returncode == 1 and len(lines) == 1 and key in lines[0] and not p.stdout,
              "run --chat %s: exit %d (want 1), one line naming %s: %r" % (name, p.returncode, key, p.stderr[-300:]))
    for name, body in good:
        path = os.path.join(tmp, name + ".json")
        with open(path, "w") as f:
            json.dump(body, f)
        p = subprocess.run([K3, "run", "--model", model, "--chat", path], capture_output=True, text=True,
                           timeout=120)
        check(p.returncode == 0 and p.stdout.startswith("{"), "run --chat %s accepted: exit %d %r"
              % (name, p.returncode, p.stderr[-300:]))
    # the flag names itself (a usage error, exit 2)
    p = subprocess.run([K3, "run", "--model", model, "--prompt-ids", "1,2", "--logit-bias", "%d:1" % vocab],
                       capture_output=True, text=True, timeout=120)
    check(p.returncode == 2 and "--logit-bias" in p.stderr and len(p.stderr.strip().splitlines()) == 1,
          "--logit-bias %d: exit %d (want 2) naming the flag: %r" % (vocab, p.returncode, p.stderr[-300:]))

    # ---- k3 batch: an invalid_request line naming the key for each bad body; the rest complete
    inp, out = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
    with open(inp, "w") as f:
        for name, body in [(n, b) for n, b, _ in bad] + good:
            f.write(json.dumps({"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    p = subprocess.run([K3, "batch", "--model", model, "--input", inp, "--output", out], capture_output=True,
                       text=True, timeout=180)
    check(p.returncode == 0, "batch: exit %d %r" % (p.returncode, p.stderr[-400:]))
    got = {}
    if os.path.exists(out):
        for ln in open(out):
            o = json.loads(ln)
            got[o["custom_id"]] = o
    for name, _, key in bad:
        o = got.get(name, {})
        r = o.get("response") or {}
        e = (r.get("body") or {}).get("error") or {}
        check(o.get("error", 0) is None and r.get("status_code") == 400 and
              e.get("code") == 400 and key in e.get("message", ""),
              "batch %s: an invalid_request line naming %s: %s" % (name, key, e or o))
    for name, _ in good:
        o = got.get(name, {})
        check(o.get("error", 0) is None and o.get("response", {}).get("status_code") == 200,
              "batch %s completes: %s" % (name, o.get("error", "no line")))


if __name__ == "__main__":
    sys.exit(main())
