"""test_structured.py — structured outputs end to end on the tiny random model (its unconstrained
output is gibberish), with the official `openai` client against `k3 serve`, and `k3 batch`.

  python3 test_structured.py [--pp S --ep E] [--n-schema N --n-tools M] [--preset small]

Checks: N json_schema requests over varied real-world schemas (tests/grammar/test_grammar.py's)
all return content that PyPI `jsonschema` validates; M tool_choice "required" requests over 5
tools return typed tool_calls (through our parser) whose arguments validate against their
function's parameters; a named tool_choice calls exactly that function, once;
parallel_tool_calls false gives one call; tool_choice "none" gives no call; json_object gives a
JSON object; guided_regex / guided_choice / structured_outputs match; streaming deltas add up to
the non-streamed message; an unsupported keyword is a 400 naming it; `k3 batch` and `k3 run
--chat` do the same for a few requests. Thinking is off in most requests (a random model would
think until max_tokens); a second server with the K3_TEST_FORCE hook (first token <|close|>)
runs thinking-on requests, whose reasoning is then empty. A logit_bias on the two string-closing
ids stands in for a trained model's habit of ending strings (see below).
"""
import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from k3_check import check, verdict  # noqa: E402
from test_grammar import SCHEMAS  # noqa: E402

import jsonschema  # noqa: E402
import openai  # noqa: E402

K3 = os.environ.get("K3_BIN", "k3")
MPI = os.environ.get("K3_MPIEXEC", "mpirun")
rng = random.Random(int(os.environ.get("K3_SEED", "7")))

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"},
                                         "max_results": {"type": ["integer", "null"]},
                                         "safe": {"type": "boolean"}},
        "required": ["query"]}}},
    {"type": "function", "function": {"name": "create_event", "parameters": {
        "type": "object", "properties": {
            "title": {"type": "string"},
            "attendees": {"type": "array", "items": {"type": "object", "properties": {
                "email": {"type": "string", "format": "email"}, "optional": {"type": "boolean"}},
                "required": ["email"], "additionalProperties": False}, "maxItems": 3},
            "start": {"type": "string", "format": "date-time"}},
        "required": ["title", "start"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run_sql", "parameters": {
        "$defs": {"lim": {"type": "integer"}},
        "type": "object", "properties": {"sql": {"type": "string"}, "limit": {"$ref": "#/$defs/lim"},
                                         "params": {"type": "object"}},
        "required": ["sql"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Server:
    def __init__(self, model, pp, ep, extra=(), env=None):
        self.log = tempfile.NamedTemporaryFile(prefix="k3_grammar_serve_", suffix=".txt", delete=False)
        cmd = [K3, "serve", "--model", model, "--port", "0", "--threads", "1", "--pp", str(pp),
               "--ep", str(ep), "--max-ctx", "4096"] + list(extra)
        if pp * ep > 1:
            cmd = [MPI, "-np", str(pp * ep), "--oversubscribe"] + cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log,
                                     env=dict(os.environ, **(env or {})))
        t0, self.port = time.time(), None
        while time.time() - t0 < 120 and self.proc.poll() is None and not self.port:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+) \(model \"([^\"]*)\", pid (\d+)\)",
                          open(self.log.name, errors="replace").read())
            if m:
                self.port, self.pid = int(m.group(1)), int(m.group(3))
            time.sleep(0.1)
        assert self.port, open(self.log.name, errors="replace").read()[-3000:]
        self.client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % self.port, api_key="x",
                                    max_retries=0, timeout=600)

    def stop(self):
        os.kill(self.pid, 15)
        rc = self.proc.wait(timeout=60)
        os.unlink(self.log.name)
        return rc


def msgs(text):
    return [{"role": "user", "content": text}]


def think_kw(i):
    return {"chat_template_kwargs": {"thinking": False}} if i % 4 else {}


def schema_request(c, i, s):
    kw = think_kw(i)
    if kw == {}:  # thinking on: a random model thinks until max_tokens; a forced early close
        kw = {"chat_template_kwargs": {"thinking": False}}
    r = c.chat.completions.create(
        model="tiny", messages=msgs("json %d" % i), max_tokens=3000, seed=i,
        response_format={"type": "json_schema", "json_schema": {"name": "s%d" % i, "strict": True, "schema": s}},
        extra_body=kw)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--n-schema", type=int, default=200)
    ap.add_argument("--n-tools", type=int, default=100)
    ap.add_argument("--preset", default="tiny", help="k3 make-tiny --preset (tiny, small)")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="k3_grammar_")
    model = os.path.join(d, "tiny")
    subprocess.run([K3, "make-tiny", model, "--preset", a.preset], check=True, capture_output=True, timeout=600)
    srv = Server(model, a.pp, a.ep)
    c = srv.client
    # A random model almost never picks the one token that ends a string (`"`, or <|close|> for a
    # raw tool-argument string) among thousands the mask allows, and runs into max_tokens. A
    # logit_bias on those two ids stands in for a trained model's habit of closing strings; it
    # cannot make any token valid that the mask refuses (a masked id stays -inf), so validity is
    # still the grammar's alone. K3_GRAMMAR_NO_BIAS=1 runs without it (many requests then end at
    # max_tokens inside a string, finish_reason "length").
    import requests
    ids = [requests.post("http://127.0.0.1:%d/tokenize" % srv.port, json={"prompt": '"'}, timeout=30).json()["tokens"]]
    added = json.load(open(os.path.join(model, "tokenizer_config.json")))["added_tokens_decoder"]
    ids += [[int(k) for k, v in added.items() if v["content"] == "<|close|>"]]
    bias = {str(i[0]): 6 for i in ids if len(i) == 1}
    check(len(bias) == 2, "the string-closing ids %s" % bias)
    orig = c.chat.completions.create

    def create(**kw):
        if not os.environ.get("K3_GRAMMAR_NO_BIAS"):
            kw.setdefault("logit_bias", bias)
        return orig(**kw)
    c.chat.completions.create = create
    try:
        # ---- json_schema: N requests over varied schemas ----
        jobs = [(i, SCHEMAS[i % len(SCHEMAS)]) for i in range(a.n_schema)]
        bad, lengths = [], 0
        with cf.ThreadPoolExecutor(16) as ex:
            for (i, s), r in zip(jobs, ex.map(lambda js: schema_request(c, *js), jobs)):
                ch = r.choices[0]
                lengths += ch.finish_reason == "length"
                try:
                    jsonschema.validate(json.loads(ch.message.content), s,
                                        format_checker=jsonschema.FormatChecker())
                except Exception as e:  # noqa: BLE001
                    bad.append((i, ch.finish_reason, str(e)[:200], ch.message.content[:200]))
        for b in bad[:5]:
            print("   invalid:", b)
        check(not bad, "%d json_schema requests over %d schemas: every content validates (%d invalid, "
              "%d hit max_tokens)" % (len(jobs), len(SCHEMAS), len(bad), lengths))

        # ---- tool_choice required over 5 tools ----
        def tool_req(i):
            return c.chat.completions.create(model="tiny", messages=msgs("call %d" % i), max_tokens=3000,
                                             seed=1000 + i, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=bool(i % 2), extra_body=think_kw(1))
        bad, names, n_calls, multi = [], set(), 0, 0
        with cf.ThreadPoolExecutor(16) as ex:
            for i, r in enumerate(ex.map(tool_req, range(a.n_tools))):
                ch = r.choices[0]
                calls = ch.message.tool_calls or []
                if not calls or ch.finish_reason != "tool_calls" or (i % 2 == 0 and len(calls) != 1):
                    bad.append((i, ch.finish_reason, len(calls), ch.message.content))
                    continue
                multi += len(calls) > 1
                for tc in calls:
                    names.add(tc.function.name)
                    n_calls += 1
                    try:
                        jsonschema.validate(json.loads(tc.function.arguments), PARAMS[tc.function.name],
                                            format_checker=jsonschema.FormatChecker())
                    except Exception as e:  # noqa: BLE001
                        bad.append((i, tc.function.name, tc.function.arguments[:200], str(e)[:200]))
        for b in bad[:5]:
            print("   bad tool call:", b)
        check(not bad, "%d tool_choice=required requests: %d typed calls, arguments validate (%d bad)"
              % (a.n_tools, n_calls, len(bad)))
        if a.n_tools >= 50:  # enough draws that a tool the grammar could not reach would show
            check(len(names) == 5, "every tool was called at least once (%s)" % sorted(names))
        print("   responses with several calls (parallel_tool_calls true): %d" % multi)

        # ---- named tool, none, json_object, guided_* ----
        r = c.chat.completions.create(model="tiny", messages=msgs("x"), max_tokens=2000, tools=TOOLS,
                                      tool_choice={"type": "function", "function": {"name": "create_event"}},
                                      extra_body=think_kw(1))
        calls = r.choices[0].message.tool_calls or []
        check(len(calls) == 1 and calls[0].function.name == "create_event",
              "named tool_choice: exactly one call of that function")
        r = c.chat.completions.create(model="tiny", messages=msgs("x"), max_tokens=60, tools=TOOLS,
                                      tool_choice="none", seed=3, extra_body=think_kw(1))
        check(not r.choices[0].message.tool_calls, "tool_choice none: no tool call")
        r = c.chat.completions.create(model="tiny", messages=msgs("x"), max_tokens=3000, seed=4,
                                      response_format={"type": "json_object"}, extra_body=think_kw(1))
        check(isinstance(json.loads(r.choices[0].message.content), dict), "json_object: a JSON object")
        for body, test in [({"guided_regex": "[a-z]{3}-[0-9]{2,4}"}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2,4}", t)),
                           ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
                           ({"structured_outputs": {"choice": ["A", "B"]}}, lambda t: t in ("A", "B")),
                           ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}}}},
                            lambda t: all(isinstance(x, int) for x in json.loads(t))),
                           ({"guided_json": json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}},
                                                        "required": ["a"]})},
                            lambda t: isinstance(json.loads(t)["a"], bool))]:
            r = c.chat.completions.create(model="tiny", messages=msgs("x"), max_tokens=2000, seed=5,
                                          extra_body=dict(body, **think_kw(1)))
            t = r.choices[0].message.content
            check(bool(test(t)), "%s: %r" % (list(body)[0], t[:80]))

        # ---- streaming = non-streaming (same seed) ----
        s = SCHEMAS[1]
        kw = dict(model="tiny", messages=msgs("stream"), max_tokens=3000, seed=11, extra_body=think_kw(1),
                  response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": s}})
        whole = c.chat.completions.create(**kw).choices[0].message.content
        parts = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw)
                        if ch.choices)
        check(parts == whole and jsonschema.Draft202012Validator(s).is_valid(json.loads(parts)),
              "streamed deltas add up to the same valid JSON")

        # ---- refusals ----
        for schema, kw_name in [({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
                                ({"type": "string", "format": "hostname"}, "hostname")]:
            try:
                c.chat.completions.create(model="tiny", messages=msgs("x"), max_tokens=5, response_format={
                    "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
                check(False, "unsupported %s refused" % kw_name)
            except openai.BadRequestError as e:
                check(e.status_code == 400 and kw_name in str(e), "400 naming %r: %s" % (kw_name, str(e)[:160]))
        try:
            c.chat.completions.create(model="tiny", messages=msgs("x"), max_tokens=5, extra_body={"guided_grammar": "x"})
            check(False, "guided_grammar refused")
        except openai.BadRequestError as e:
            check("guided_grammar" in str(e), "400 naming guided_grammar")
    finally:
        check(srv.stop() == 0, "the server exits 0")

    # ---- thinking on: the test hook makes every request's first token <|close|> (a random model
    # would think until max_tokens); the grammar then forces think<|sep|><|open|>response<|sep|>
    # and constrains the answer only ----
    srv = Server(model, a.pp, a.ep, env={"K3_TEST_FORCE": str(ids[1][0])})
    orig = srv.client.chat.completions.create
    try:
        bad = 0
        for i in range(10):
            s = SCHEMAS[i % len(SCHEMAS)]
            r = orig(model="tiny", messages=msgs("t%d" % i), max_tokens=3000, seed=i, logit_bias=bias,
                     response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": s}})
            m = r.choices[0].message
            ok = getattr(m, "reasoning_content", None) == "" and \
                jsonschema.Draft202012Validator(s).is_valid(json.loads(m.content))
            r = orig(model="tiny", messages=msgs("t%d" % i), max_tokens=2500, seed=i, logit_bias=bias,
                     tools=TOOLS, tool_choice="required")
            m = r.choices[0].message
            ok &= bool(m.tool_calls) and all(jsonschema.Draft202012Validator(PARAMS[t.function.name]).is_valid(
                json.loads(t.function.arguments)) for t in m.tool_calls)
            bad += not ok
        check(bad == 0, "thinking on: 10 json_schema + 10 tool requests hold, reasoning_content reported "
              "(%d bad)" % bad)
    finally:
        check(srv.stop() == 0, "the thinking server exits 0")

    # ---- k3 batch: the same keys through the batch file ----
    inp, out = os.path.join(d, "in.jsonl"), os.path.join(d, "out.jsonl")
    with open(inp, "w") as f:
        for i in range(6):
            body = {"messages": msgs("b%d" % i), "max_tokens": 3000, "seed": i, "logit_bias": bias,
                    "chat_template_kwargs": {"thinking": False}}
            if i % 2:
                body.update(tools=TOOLS, tool_choice="required")
            else:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[i]}}
            f.write(json.dumps({"custom_id": "c%d" % i, "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    cmd = [K3, "batch", "--model", model, "--input", inp, "--output", out, "--threads", "1",
           "--pp", str(a.pp), "--ep", str(a.ep)]
    if a.pp * a.ep > 1:
        cmd = [MPI, "-np", str(a.pp * a.ep), "--oversubscribe"] + cmd
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    ok = p.returncode == 0
    for line in open(out) if ok else []:
        o = json.loads(line)
        i = int(o["custom_id"][1:])
        m = o["response"]["body"]["choices"][0]["message"]
        if i % 2:
            ok &= bool(m.get("tool_calls")) and all(jsonschema.Draft202012Validator(PARAMS[t["function"]["name"]]).is_valid(
                json.loads(t["function"]["arguments"])) for t in m["tool_calls"])
        else:
            ok &= jsonschema.Draft202012Validator(SCHEMAS[i]).is_valid(json.loads(m["content"]))
    check(ok, "k3 batch: 6 lines, schemas and required tool calls hold (%s)" % p.stderr[-300:])

    # ---- k3 run --chat: the same through the one-shot client ----
    req = os.path.join(d, "req.json")
    ok = True
    for i, body in enumerate([{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[2]}}},
                              {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}]):
        json.dump(dict(body, messages=msgs("r%d" % i), max_tokens=3000, seed=i, logit_bias=bias,
                       chat_template_kwargs={"thinking": False}), open(req, "w"))
        cmd = [K3, "run", "--model", model, "--chat", req, "--threads", "1", "--pp", str(a.pp), "--ep", str(a.ep)]
        if a.pp * a.ep > 1:
            cmd = [MPI, "-np", str(a.pp * a.ep), "--oversubscribe"] + cmd
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        m = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else {}
        if i == 0:
            ok &= jsonschema.Draft202012Validator(SCHEMAS[2]).is_valid(json.loads(m.get("content") or "null"))
        else:
            calls = m.get("tool_calls") or []
            ok &= len(calls) == 1 and calls[0]["function"]["name"] == "get_weather" and \
                jsonschema.Draft202012Validator(PARAMS["get_weather"]).is_valid(json.loads(calls[0]["function"]["arguments"]))
    check(ok, "k3 run --chat: a json_schema and a named tool call hold")
    return verdict("test_structured")


if __name__ == "__main__":
    sys.exit(main())
