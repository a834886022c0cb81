#!/usr/bin/env python3
"""examples_test.py — the README's examples/ files do what the README says (issue 34): thinking is
on by default, and `"thinking": false` (or vLLM's chat_template_kwargs.thinking) puts the answer in
`content` with no `reasoning_content`. `k3 run --chat examples/request.json` and `k3 batch --input
examples/in.jsonl` on the tiny model (make-tiny); the same request with the switch removed answers
in `reasoning_content` with an empty `content` (the default the README warns about).
Exit: 0 pass, 1 fail."""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_check import check, verdict  # noqa: E402

K3 = os.environ.get("K3_BIN", "build/k3")
EX = os.path.join(os.environ.get("K3_SRC", "."), "examples")


def run_chat(model, path):
    p = subprocess.run([K3, "run", "--model", model, "--chat", path, "--threads", "1"],
                       capture_output=True, text=True, timeout=120)
    check(p.returncode == 0, "run --chat %s: exit 0 (%s)" % (os.path.basename(path), p.stderr.strip()[-200:]))
    return json.loads(p.stdout) if p.returncode == 0 else {}


with tempfile.TemporaryDirectory(prefix="k3_examples_") as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True, timeout=120)
    m = run_chat(model, os.path.join(EX, "request.json"))
    check(m.get("content") and not m.get("reasoning_content"), "request.json: the answer is in content")
    req = json.load(open(os.path.join(EX, "request.json")))
    del req["thinking"]
    on = os.path.join(tmp, "thinking_on.json")
    json.dump(req, open(on, "w"))
    m = run_chat(model, on)
    check(m.get("reasoning_content") and m.get("content") == "",
          "without the switch: the answer is in reasoning_content, content empty (the default)")
    out = os.path.join(tmp, "out.jsonl")
    p = subprocess.run([K3, "batch", "--model", model, "--input", os.path.join(EX, "in.jsonl"), "--output", out,
                        "--threads", "1"], capture_output=True, text=True, timeout=300)
    check(p.returncode == 0, "batch examples/in.jsonl: exit 0 (%s)" % p.stderr.strip()[-200:])
    lines = {d["custom_id"]: d for d in map(json.loads, open(out))} if p.returncode == 0 else {}
    check(len(lines) == 3, "batch: one answer per line (%d)" % len(lines))
    for cid in ("colours", "vllm-style"):  # "thinking": false / chat_template_kwargs.thinking: false
        msg = lines.get(cid, {}).get("response", {}).get("body", {}).get("choices", [{}])[0].get("message", {})
        check(msg.get("content") and not msg.get("reasoning_content"), "batch %s: the answer is in content" % cid)
sys.exit(verdict("examples"))
