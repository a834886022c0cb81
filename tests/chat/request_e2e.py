#!/usr/bin/env python3
"""request_e2e.py — issue 8 end to end: U+0000 is ordinary text, and the request keys
add_generation_prompt / continue_final_message reach `k3 run --chat` and the parser.

1. `k3 tokenize --jsonl`: "a\\u0000b" (a string line and a {"text", "special"} line) gives PyPI
   tiktoken's ids (o200k ranks + the K3 pattern), byte 0 as its own token.
2. A request with U+0000 in user content, in a tool call's arguments (a string value and a key),
   in a tool result: `k3 render` equals the K3 jinja template (jinja2) byte for byte, NULs
   included; --segments carries them as \\u0000; `k3 render --ids` on the tiny model encodes
   them (the id of byte 0 appears where each NUL is).
3. `k3 run --model TINY --chat` renders, runs and prints a valid assistant message for it.
4. `k3 parse` of a generation with NUL in reasoning, content, tool name, argument key and value:
   the message is valid JSON whose strings hold the NULs (json.loads), deltas add up
   (--stream-check): the NUL survives the round trip.
5. continue_final_message: `k3 render --ids` of the continued request ends inside `response`
   (or `think`), `k3 parse --request` starts there (text before any tag is content, or
   reasoning), and `k3 run --chat` runs it; add_generation_prompt false runs too.
Exit: 0 pass, 1 fail, 77 skip (tiktoken or jinja2 missing).
"""
import json
import os
import subprocess
import sys
import tempfile

try:
    import tiktoken  # noqa: F401
    import jinja2  # noqa: F401
except ImportError:
    print("SKIP: tiktoken / jinja2 not installed (pip install -r tests/requirements.txt)")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from k3_tiktoken import K3_PAT, load_ranks  # noqa: E402

K3 = os.environ.get("K3_BIN", "build/k3")
SHARED = os.environ.get("K3_TESTDATA", os.path.join(HERE, "..", "data"))
failures = checks = 0


def check(ok, what):
    global failures, checks
    checks += 1
    if not ok:
        failures += 1
        print("FAIL", what)


def k3(args, stdin=b""):
    p = subprocess.run([K3] + args, input=stdin, capture_output=True)
    return p.returncode, p.stdout, p.stderr.decode(errors="replace")


def main():
    import k3_jinja as vj  # the template + the request normalisation (shared with vs_jinja.py)
    vocab = os.path.join(SHARED, "vocab/o200k_base.tiktoken")
    enc = tiktoken.Encoding("k3_e2e", pat_str=K3_PAT, mergeable_ranks=load_ranks(vocab), special_tokens={})
    # 1. tokenize --jsonl
    rc, out, err = k3(["tokenize", "--vocab", vocab, "--jsonl"],
                      b'"a\\u0000b"\n{"text": "\\u0000\\u0000 x\\u0000", "special": false}\n')
    want = [enc.encode_ordinary("a\x00b"), enc.encode_ordinary("\x00\x00 x\x00")]
    got = [json.loads(x) for x in out.decode().splitlines()] if rc == 0 else None
    check(rc == 0 and got == want, f"tokenize --jsonl with \\u0000: {got} want {want} ({err.strip()})")

    with tempfile.TemporaryDirectory() as tmp:
        tiny = os.path.join(tmp, "tiny")
        rc, _, err = k3(["make-tiny", tiny])
        check(rc == 0, f"make-tiny: {err[-300:]}")
        tiny_ranks = load_ranks(os.path.join(tiny, "tiktoken.model"))
        tiny0 = tiny_ranks[b"\x00"]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"code": {"type": "string"}}}}}]
        req = {"messages": [
            {"role": "user", "content": "a\x00b"},
            {"role": "assistant", "content": "", "reasoning_content": "r\x00",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "f", "arguments": {"code": "x\x00y", "k\x00": 1}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "out\x00"},
            {"role": "user", "content": "again\x00"}], "tools": tools}
        body = json.dumps(req).encode()
        # 2. render = jinja, NULs included; segments; ids
        rc, out, err = k3(["render"], body)
        want_text = vj.jinja_render(req)
        n_nul = out.count(b"\x00")
        check(rc == 0 and out.decode() == want_text and n_nul == 6,
              f"render with U+0000 = jinja ({err.strip()}; {n_nul} NULs)")
        rc, out, err = k3(["render", "--segments"], body)
        segs = json.loads(out) if rc == 0 else []
        check(sum(s.count("\x00") for s, ctrl in segs if not ctrl) == 6 and b"\\u0000" in out,
              f"--segments carry the NULs ({err.strip()})")
        rc, out, err = k3(["render", "--ids", "--model", tiny], body)
        ids = [int(x) for x in out.split()] if rc == 0 else []
        check(ids.count(tiny0) >= 6, f"render --ids encodes each NUL as byte 0 ({ids.count(tiny0)} of 6; {err.strip()})")
        path = os.path.join(tmp, "nul.json")
        with open(path, "wb") as f:
            f.write(body)
        # 3. k3 run --chat
        rc, out, err = k3(["run", "--model", tiny, "--chat", path, "--n", "8"])
        msg = json.loads(out) if rc == 0 else {}
        check(rc == 0 and msg.get("role") == "assistant" and "finish_reason" in msg,
              f"run --chat with U+0000 in content and arguments: rc={rc} {err[-300:]}")
        # 4. parse: NUL in every field survives
        gen = ('think\x00x<|close|>think<|sep|><|open|>response<|sep|>c\x00d<|close|>response<|sep|>'
               '<|open|>tools<|sep|><|open|>call tool="f\x00g" index="1"<|sep|><|open|>argument key="co\x00de" '
               'type="string"<|sep|>v\x00w<|close|>argument<|sep|><|open|>argument key="n" type="number"<|sep|>'
               '7<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="f" index="2"<|sep|>'
               '<|open|>json type="object"<|sep|>{"q\x00": 1}<|close|>json<|sep|><|close|>call<|sep|>'
               '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
        rc, out, err = k3(["parse", "--model", tiny, "--request", path, "--stream-check"], gen.encode())
        m = json.loads(out) if rc == 0 else {}
        calls = m.get("tool_calls", [])
        ok = (rc == 0 and m.get("reasoning_content") == "think\x00x" and m.get("content") == "c\x00d"
              and len(calls) == 2 and calls[0]["function"]["name"] == "f\x00g"
              and json.loads(calls[0]["function"]["arguments"]) == {"co\x00de": "v\x00w", "n": 7}
              and calls[1]["function"]["arguments"] == '{"q\x00": 1}')
        check(ok, f"parse keeps U+0000 everywhere: rc={rc} {out[:300]!r} {err.strip()}")

        # 5. continue_final_message / add_generation_prompt through render, parse and run
        def write(name, r):
            pth = os.path.join(tmp, name)
            with open(pth, "w") as f:
                json.dump(r, f)
            return pth
        base = [{"role": "user", "content": "hi"}]
        cont_resp = {"messages": base + [{"role": "assistant", "content": "The ans", "reasoning_content": "Let me"}],
                     "continue_final_message": True, "add_generation_prompt": False}
        cont_think = {"messages": base + [{"role": "assistant", "content": "", "reasoning_content": "Let me"}],
                      "continue_final_message": True, "add_generation_prompt": False}
        for name, r, tail, fld in [("response", cont_resp, "<|open|>response<|sep|>The ans", "content"),
                                   ("think", cont_think, "<|open|>think<|sep|>Let me", "reasoning_content")]:
            rc, out, err = k3(["render"], json.dumps(r).encode())
            check(rc == 0 and out.decode().endswith(tail), f"continue ({name}): prompt ends {out[-60:]!r} {err.strip()}")
            pth = write(f"cont_{name}.json", r)
            rc, out, err = k3(["parse", "--model", tiny, "--request", pth, "--stream-check"],
                              b"wer<|close|>" + (b"response" if name == "response" else b"think") +
                              b"<|sep|><|close|>message<|sep|>")
            m = json.loads(out) if rc == 0 else {}
            check(m.get(fld) == "wer", f"continue ({name}): the parser starts in {name}: {out[:200]!r} {err.strip()}")
            rc, out, err = k3(["run", "--model", tiny, "--chat", pth, "--n", "6"])
            check(rc == 0 and json.loads(out).get("role") == "assistant",
                  f"run --chat continue ({name}): rc={rc} {err[-300:]}")
        pth = write("nogen.json", {"messages": base, "add_generation_prompt": False})
        rc, out, err = k3(["run", "--model", tiny, "--chat", pth, "--n", "6"])
        check(rc == 0 and json.loads(out).get("role") == "assistant", f"run --chat add_generation_prompt false: {err[-300:]}")
        pth = write("bad.json", {"messages": base + [{"role": "assistant", "content": "x"}],
                                 "continue_final_message": True})
        rc, out, err = k3(["run", "--model", tiny, "--chat", pth, "--n", "6"])
        check(rc == 1 and "add_generation_prompt" in err and "continue_final_message" in err,
              f"run --chat refuses continue + add_generation_prompt: rc={rc} {err[-300:]}")
    print(f"request_e2e: {checks} checks, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
