"""serve_test.py — `k3 serve` end to end with the official `openai` Python client (owner: serve).

Run by ctest through pytest (tests/serve/tests.cmake):  python3 -m pytest serve_test.py -k GROUP
Environment: K3_BIN (the k3 binary), K3_MPIEXEC (mpirun, for the 2x2 groups), K3_SERVE_REPLAY (the
serve_replay helper), K3_TESTDATA (fixtures), K3_SERVE_SOAK_S (the soak's seconds, default 30).

Groups (pytest -k):
  api_1x1 / api_2x2 : one server per topology (tiny model, --deterministic, an API key): chat
      streamed and not (the streamed message put together equals the non-streamed one for the
      same seed; role delta first, usage chunk, [DONE] last), reasoning on and off, stop strings,
      max_tokens -> finish_reason "length", usage, logprobs (greedy = top 1, sorted), completions
      (text and ids), models, tokenize/detokenize, metrics (prometheus_client's parser; deltas
      match the requests made), 401 without / with a wrong key, a client that disconnects
      mid-stream (its request is cancelled: generation stops, the slot frees), greedy output ==
      `k3 run --prompt-ids` on the rendered prompt token for token, shutdown by SIGTERM (1x1:
      SIGINT) with every rank exiting 0.
  live_tool_calls   : the same tool-call cases from the live 1x1 server, the engine made to write
                      the completion's tokens (K3_TEST_FORCE): message and stream typed equal
  replay            : tool calls (the tiny random model never writes one): the K3 completions of
      tests/data/fixtures/chat go through the server's real request parser, response writer and SSE
      writer (serve_replay), and the official client's types parse them: typed arguments come
      back as the same JSON values, the streamed calls put together equal the non-streamed ones.
  limits            : a server with one slot and --max-queue 2: 429 + Retry-After; 200 malformed
      requests (truncated JSON, wrong types, huge numbers, invalid UTF-8, 10 MB bodies, bad
      routes and methods) all get a 4xx with an OpenAI error object, and /health still answers;
      SIGTERM with a stream in flight: cancelled after --shutdown-grace, the stream still ends
      with [DONE], no new connections, exit 0.
  stuck             : a client that never reads its stream (the server's send buffer full) does
      not hold the server at shutdown.
  soak              : 16 concurrent streaming clients for K3_SERVE_SOAK_S seconds on 2x2: no
      error, every stream ends with [DONE]; rank 0's RSS after the run within 10% of after the
      warm-up.
"""
import atexit
import json
import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

K3 = os.environ.get("K3_BIN", "k3")
MPI = os.environ.get("K3_MPIEXEC", "mpirun")
KEY = "sk-k3-test-key"
HERE = os.path.dirname(os.path.abspath(__file__))


# ---- the server ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def model_dir():
    d = tempfile.mkdtemp(prefix="k3_serve_")
    m = os.path.join(d, "tiny")
    subprocess.run([K3, "make-tiny", m], check=True, capture_output=True, timeout=120)
    return m


class Server:
    """`k3 serve` on --port 0; rank 0's pid and port come from its 'listening' log line."""

    def __init__(self, model, pp=1, ep=1, extra=(), env=None):
        self.np = pp * ep
        self.log = tempfile.NamedTemporaryFile(prefix="k3_serve_log_", suffix=".txt", delete=False)
        atexit.register(os.unlink, self.log.name)
        cmd = [K3, "serve", "--model", model, "--port", "0", "--threads", "1", "--pp", str(pp),
               "--ep", str(ep)] + list(extra)
        if self.np > 1:
            cmd = [MPI, "-np", str(self.np), "--oversubscribe"] + cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log,
                                     env=dict(os.environ, **(env or {})))
        t0 = time.time()
        self.port = self.pid = None
        while time.time() - t0 < 120 and self.proc.poll() is None:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+) \(model \"([^\"]*)\", pid (\d+)\)",
                          self.text())
            if m:
                self.port, self.name, self.pid = int(m.group(1)), m.group(2), int(m.group(3))
                break
            time.sleep(0.1)
        assert self.port, "the server did not start:\n" + self.text()[-3000:]
        self.url = "http://127.0.0.1:%d" % self.port

    def text(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def client(self, key=KEY, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def rss_kb(self):
        with open("/proc/%d/status" % self.pid) as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))

    def stop(self, sig=signal.SIGTERM, timeout=60):
        """Signal rank 0; the exit code of the whole job (mpirun's with several ranks)."""
        if self.proc.poll() is None:
            os.kill(self.pid, sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "hung"


def metrics(srv):
    r = requests.get(srv.url + "/metrics", timeout=10)
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(m, name, **labels):
    labels.setdefault("model_name", "k3-tiny")  # every series carries it (vLLM's label)
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


MSG = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module", params=["1x1", "2x2"], ids=["api_1x1", "api_2x2"])
def srv(request, model_dir):
    pp, ep = (1, 1) if request.param == "1x1" else (2, 2)
    s = Server(model_dir, pp, ep, extra=["--api-key", KEY, "--deterministic", "--max-seqs", "4",
                                         "--served-model-name", "k3-tiny"])
    s.topology = request.param
    yield s
    rc = s.stop(signal.SIGINT if request.param == "1x1" else signal.SIGTERM)
    log = s.text()
    assert rc == 0, "shutdown: exit %s\n%s" % (rc, log[-2000:])
    assert "k3 serve: stopped" in log


# ---- chat ------------------------------------------------------------------------------------
def test_chat_nonstream(srv):
    c = srv.client()
    r = c.chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=8, temperature=0)
    ch = r.choices[0]
    assert r.object == "chat.completion" and r.model == "k3-tiny" and r.id.startswith("chatcmpl-")
    assert ch.message.role == "assistant" and isinstance(ch.message.content, str)
    assert isinstance(ch.message.reasoning_content, str)  # thinking is on by default
    assert ch.finish_reason in ("length", "stop")
    u = r.usage
    assert u.prompt_tokens > 10 and 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert ch.logprobs is None


def collect_stream(stream):
    """Put the chunks together as a client does; the message and the chunk list."""
    msg = {"role": None, "content": "", "reasoning_content": "", "tool_calls": {}}
    chunks = list(stream)
    finish, usage = None, None
    for k in chunks:
        if k.usage is not None:
            usage = k.usage
        for ch in k.choices:
            d = ch.delta
            msg["role"] = msg["role"] or d.role
            msg["content"] += d.content or ""
            msg["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                t = msg["tool_calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                t["id"] = t["id"] or tc.id
                t["name"] += (tc.function.name or "") if tc.function else ""
                t["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    return msg, chunks, finish, usage


def test_chat_stream_equals_nonstream(srv):
    c = srv.client()
    kw = dict(model="k3-tiny", messages=MSG, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    full = c.chat.completions.create(**kw)
    msg, chunks, finish, usage = collect_stream(
        c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(k.object == "chat.completion.chunk" and k.id == chunks[0].id for k in chunks)
    assert chunks[-1].choices == [] and usage is not None  # the usage chunk comes last
    assert all(k.usage is None for k in chunks[:-1])
    m = full.choices[0].message
    assert msg["content"] == m.content
    assert msg["reasoning_content"] == m.reasoning_content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert len(chunks) >= 3


def test_stream_raw_sse_ends_with_done(srv):
    body = {"model": "k3-tiny", "messages": MSG, "max_tokens": 6, "stream": True}
    with requests.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=60,
                       headers={"Authorization": "Bearer " + KEY}) as r:
        assert r.status_code == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = r.raw.read().decode("utf-8")
    # SSE lines end at \n only (str.splitlines would also split at U+2028 etc. inside JSON strings)
    assert raw.endswith("\n\n")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("length", "stop") and last["choices"][0]["delta"] == {}
    assert "usage" not in last  # no include_usage: no usage key at all


def test_reasoning_on_off(srv):
    c = srv.client()
    on = c.chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=6, temperature=0)
    off = c.chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=6, temperature=0,
                                    extra_body={"chat_template_kwargs": {"thinking": False}})
    off2 = c.chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=6, temperature=0,
                                     reasoning_effort="none")
    assert isinstance(on.choices[0].message.reasoning_content, str)
    for r in (off, off2):
        assert getattr(r.choices[0].message, "reasoning_content", None) is None
        assert isinstance(r.choices[0].message.content, str)
    # thinking off renders another prompt (the `response` opener, no effort line)
    assert off.usage.prompt_tokens != on.usage.prompt_tokens


def test_max_tokens_length(srv):
    c = srv.client()
    r = c.chat.completions.create(model="k3-tiny", messages=MSG, max_completion_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_stop_string(srv):
    c = srv.client()
    base = dict(model="k3-tiny", prompt="The colour of the sky is", max_tokens=16, temperature=0)
    full = c.completions.create(**base)
    text = full.choices[0].text
    # a stop string from the middle of the greedy text: the answer is what came before it
    cut = next((i for i in range(3, len(text) - 2) if text[i:i + 2].strip() and text[i:i + 2].isprintable()),
               None)
    assert cut is not None, "degenerate greedy text %r" % text
    stop = text[cut:cut + 2]
    first = text.index(stop)
    r = c.completions.create(stop=[stop], **base)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:first]
    # chat: the same rule on the message content
    off = {"chat_template_kwargs": {"thinking": False}}
    fc = c.chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=16, temperature=0,
                                   extra_body=off).choices[0].message.content
    assert len(fc) > 6, "degenerate greedy content %r" % fc
    s2 = fc[3:5]
    r2 = c.chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=16, temperature=0,
                                   stop=s2, extra_body=off)
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == fc[:fc.index(s2)]


def test_logprobs(srv):
    c = srv.client()
    r = c.chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=6, temperature=0,
                                  logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    for e in lp:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    # streamed: the chunks' logprobs add up to the same entries
    _, chunks, _, _ = collect_stream(c.chat.completions.create(
        model="k3-tiny", messages=MSG, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
        stream=True))
    streamed = [e for k in chunks for ch in k.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in lp]


def test_completions(srv):
    c = srv.client()
    r = c.completions.create(model="k3-tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    ch = r.choices[0]
    assert r.object == "text_completion" and isinstance(ch.text, str)
    assert r.usage.completion_tokens == len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs)
    assert all(len(t) == 2 for t in ch.logprobs.top_logprobs)
    ids = requests.post(srv.url + "/tokenize", json={"prompt": "Hello"},
                        headers={"Authorization": "Bearer " + KEY}).json()["tokens"]
    r2 = c.completions.create(model="k3-tiny", prompt=ids, max_tokens=5, temperature=0)
    assert r2.choices[0].text == ch.text and r2.usage.prompt_tokens == len(ids)
    text = "".join(k.choices[0].text for k in c.completions.create(
        model="k3-tiny", prompt="Hello", max_tokens=5, temperature=0, stream=True) if k.choices)
    assert text == ch.text
    d = requests.post(srv.url + "/detokenize", json={"tokens": ids},
                      headers={"Authorization": "Bearer " + KEY}).json()
    assert d["prompt"] == "Hello"


def test_models(srv):
    ms = srv.client().models.list().data
    assert [m.id for m in ms] == ["k3-tiny"] and ms[0].object == "model"


def test_auth(srv):
    for key in ("wrong-key", "sk-k3-test-kez", KEY + "x"):
        with pytest.raises(openai.AuthenticationError):
            srv.client(key=key).chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        srv.client().chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
    r = requests.post(srv.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert requests.get(srv.url + "/v1/models").status_code == 401
    assert requests.get(srv.url + "/health").status_code == 200  # health and metrics stay open


def test_metrics(srv):
    before = metrics(srv)
    r = srv.client().chat.completions.create(model="k3-tiny", messages=MSG, max_tokens=5, temperature=0)
    ranks = [(0, 0, 0)] if srv.topology == "1x1" else [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    steps = lambda m, w, st, ln: metric(m, "k3_rank_step_seconds_count",  # noqa: E731
                                        rank=str(w), stage=str(st), lane=str(ln))
    # a lane's step times arrive in its LOGITS, which may still be in flight when the response is
    # done: read /metrics again (up to 3 s) until every rank has reported the request's steps
    deadline = time.time() + 3
    while True:
        after = metrics(srv)
        if time.time() > deadline or all(steps(after, *k) - steps(before, *k) >= r.usage.completion_tokens
                                          for k in ranks):
            break
        time.sleep(0.05)
    d = lambda name, **lb: metric(after, name, **lb) - metric(before, name, **lb)  # noqa: E731
    assert d("k3_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert d("vllm:generation_tokens_total") == r.usage.completion_tokens
    assert d("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert d("vllm:time_to_first_token_seconds_count") == 1
    assert d("vllm:e2e_request_latency_seconds_count") == 1
    assert d("vllm:time_per_output_token_seconds_count") == (1 if r.usage.completion_tokens > 1 else 0)
    assert metric(after, "k3_step_seconds_count", rank="0") > 0
    # every worker rank's step time, labelled with its stage and lane: the stages of one lane
    # report together (in that lane's LOGITS), and the request's steps add to every rank. (Lanes
    # may differ by the step in flight when /metrics is read: read again above.)
    counts = {}
    for w, st, ln in ranks:
        lb = dict(rank=str(w), stage=str(st), lane=str(ln))
        counts.setdefault(ln, set()).add(metric(after, "k3_rank_step_seconds_count", **lb))
        assert d("k3_rank_step_seconds_count", **lb) >= r.usage.completion_tokens, (w, counts)
        assert metric(after, "k3_rank_step_seconds_sum", **lb) > 0
    assert all(len(c) == 1 for c in counts.values()), counts
    for g in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert (g, (("model_name", "k3-tiny"),)) in after
    # one access log line for the request: id, status, tokens, TTFT, total time
    pat = (r"access id=%s method=POST path=/v1/chat/completions status=200 prompt_tokens=%d "
           r"completion_tokens=%d ttft_ms=[0-9.]+ total_ms=[0-9.]+\n" %
           (re.escape(r.id), r.usage.prompt_tokens, r.usage.completion_tokens))
    t0 = time.time()
    while not re.search(pat, srv.text()) and time.time() - t0 < 5:
        time.sleep(0.1)
    assert len(re.findall(pat, srv.text())) == 1, pat


def test_prefix_cache(srv):
    """The prefix cache (issue 31): a 200-token prefix shared by 4 prompts of ids is found by every
    request after the first (3 full blocks of 64: usage.prompt_tokens_details.cached_tokens 192,
    streamed and not), the same prompt again gives the same greedy text from the cache, and the
    /metrics counters grow by exactly the prompt tokens sent and the cached tokens reported."""
    c = srv.client()
    rng = random.Random(31)
    shared = [rng.randrange(1000, 3000) for _ in range(200)]
    before = metrics(srv)
    sent = cached = 0
    texts = []
    for i in range(4):
        ids = shared + [rng.randrange(1000, 3000) for _ in range(20)]
        r = c.completions.create(model="k3-tiny", prompt=ids, max_tokens=4, temperature=0)
        ct = r.usage.prompt_tokens_details.cached_tokens
        assert r.usage.prompt_tokens == len(ids) and ct == (0 if i == 0 else 192), (i, r.usage)
        sent, cached = sent + len(ids), cached + ct
        texts.append((ids, r.choices[0].text))
    ids, text0 = texts[0]  # the first prompt again, now from the cache
    chunks = list(c.completions.create(model="k3-tiny", prompt=ids, max_tokens=4, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    u = chunks[-1].usage
    assert u.prompt_tokens_details.cached_tokens == 192 and u.prompt_tokens == len(ids)
    assert "".join(k.choices[0].text for k in chunks if k.choices) == text0
    sent, cached = sent + len(ids), cached + 192
    after = metrics(srv)
    d = {k: metric(after, k) - metric(before, k)
         for k in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}
    assert d == {"vllm:prefix_cache_queries_total": sent, "vllm:prefix_cache_hits_total": cached}, d
    assert 0 < metric(after, "k3_prefix_cache_usage_ratio") <= 1


def test_disconnect_cancels(srv):
    before = metrics(srv)
    body = {"model": "k3-tiny", "messages": MSG, "max_tokens": 3000, "stream": True,
            "ignore_eos": True}
    with requests.Session() as h:
        with h.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=60,
                    headers={"Authorization": "Bearer " + KEY}) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith(b"data: ")
                if n >= 4:
                    break  # leave mid-stream: closing the response closes the socket
    t0 = time.time()
    while time.time() - t0 < 20:
        m = metrics(srv)
        aborted = dict(finished_reason="abort")
        if metric(m, "vllm:request_success_total", **aborted) > metric(before, "vllm:request_success_total", **aborted):
            break
        time.sleep(0.2)
    # a cancelled request's tokens are counted apart from the completed requests'
    gen = metric(m, "k3_cancelled_generation_tokens_total") - metric(before, "k3_cancelled_generation_tokens_total")
    assert metric(m, "vllm:generation_tokens_total") == metric(before, "vllm:generation_tokens_total")
    assert metric(m, "vllm:num_requests_running") == 0, "the request still runs"
    assert 3 <= gen < 3000, "generation went on after the disconnect (%d tokens)" % gen
    assert re.search(r"access id=chatcmpl-\S+ method=POST path=/v1/chat/completions status=200 aborted=1",
                     srv.text())


def test_greedy_equals_k3_run(srv, model_dir):
    h = {"Authorization": "Bearer " + KEY}
    ids = requests.post(srv.url + "/tokenize", json={"messages": MSG}, headers=h).json()["tokens"]
    r = requests.post(srv.url + "/v1/chat/completions", headers=h, json={
        "messages": MSG, "max_tokens": 12, "temperature": 0, "return_token_ids": True}).json()
    assert r["prompt_token_ids"] == ids
    p = subprocess.run([K3, "run", "--model", model_dir, "--prompt-ids", ",".join(map(str, ids)),
                        "--n", "12", "--json", "--deterministic", "--threads", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    gen = json.loads(p.stdout)["generated_ids"]
    assert r["choices"][0]["token_ids"] == gen and len(gen) >= 1


# ---- tool calls through the wire writer (replay) ---------------------------------------------
def replay_cases():
    shared = os.environ.get("K3_TESTDATA", os.path.join(HERE, "..", "data"))
    with open(os.path.join(shared, "fixtures", "chat", "k3-test-chat-cases.json")) as f:
        d = json.load(f)
    return [(c, d["tool_definitions"]) for c in d["cases"] if c["expected"].get("tool_calls")]


@pytest.mark.parametrize("case,tools", replay_cases(), ids=lambda v: v["comment"][:40] if isinstance(v, dict) and "comment" in v else "")
def test_replay_tool_calls(case, tools, model_dir, tmp_path):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    o = case["options"]
    thinking = o["reasoning_format"] != "COMMON_REASONING_FORMAT_NONE"
    body = {"model": "replay", "messages": o["messages"], "tools": [tools[t] for t in o["tools"]],
            "max_tokens": 4096, "chat_template_kwargs": {"thinking": thinking}}
    (tmp_path / "req.json").write_text(json.dumps(body))
    (tmp_path / "comp.txt").write_text(case["input"])
    out = str(tmp_path / "out")
    p = subprocess.run([os.environ["K3_SERVE_REPLAY"], model_dir, str(tmp_path / "req.json"),
                        str(tmp_path / "comp.txt"), out], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    full = ChatCompletion.model_validate_json(open(out + ".json").read())
    m, exp = full.choices[0].message, case["expected"]
    assert full.choices[0].finish_reason == "tool_calls"
    assert (m.content or "") == exp["content"]
    if thinking:
        assert m.reasoning_content == exp["reasoning_content"]
    got = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls]
    want = [(t["name"], json.loads(t["arguments"])) for t in exp["tool_calls"]]
    assert got == want
    # typed: the same JSON types, not only equal values (1 is an int, "print('hey')" a string)
    assert [[type(v) for v in a.values()] for _, a in got] == [[type(v) for v in a.values()] for _, a in want]
    assert all(t.type == "function" and t.id for t in m.tool_calls)
    assert len({t.id for t in m.tool_calls}) == len(m.tool_calls)
    # the stream: SSE events, each chunk a ChatCompletionChunk; put together = the message
    raw = open(out + ".sse").read()
    events = [e for e in raw.split("\n\n") if e]
    assert raw.endswith("\n\n") and events[-1] == "data: [DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(e[len("data: "):]) for e in events[:-1]]
    msg, _, finish, _ = collect_stream(chunks)
    assert msg["role"] == "assistant" and finish == "tool_calls"
    assert msg["content"] == (m.content or "")
    calls = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    assert [(c["id"], c["name"], c["arguments"]) for c in calls] == \
        [(t.id, t.function.name, t.function.arguments) for t in m.tool_calls]


# ---- tool calls from the live server (the engine forced to write them) -----------------------
# A random tiny model never writes a tool call by itself. The test hook K3_TEST_FORCE makes the
# engine emit given token ids first (rank 0's sampler takes them instead of sampling): the ids of
# a real K3 completion from the fixtures, tokenized by `k3 tokenize` with the model's vocabulary. Everything else
# is the live path: engine events -> output parser -> JSON / SSE -> the official client's types.
@pytest.mark.parametrize("case,tools", replay_cases(), ids=lambda v: v["comment"][:40] if isinstance(v, dict) and "comment" in v else "")
def test_live_tool_calls(case, tools, model_dir):
    o = case["options"]
    thinking = o["reasoning_format"] != "COMMON_REASONING_FORMAT_NONE"
    # the fixture's completion stops at the message's close tag; a model then writes
    # <|end_of_msg|> (K3-CHAT.md), which ends the request. Control tokens as single ids: k3 tokenize.
    p = subprocess.run([K3, "tokenize", "--model", model_dir, "--json", case["input"] + "<|end_of_msg|>"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    ids = json.loads(p.stdout)["ids"]
    s = Server(model_dir, extra=["--served-model-name", "k3-tiny"],
               env={"K3_TEST_FORCE": ",".join(map(str, ids))})
    try:
        args = dict(model="k3-tiny", messages=o["messages"], tools=[tools[t] for t in o["tools"]],
                    max_tokens=len(ids) + 8, temperature=0,
                    extra_body={"chat_template_kwargs": {"thinking": thinking}})
        r = s.client(key="none").chat.completions.create(**args)
        m, exp = r.choices[0].message, case["expected"]
        assert r.choices[0].finish_reason == "tool_calls", (r, s.text()[-2000:])
        assert r.usage.completion_tokens == len(ids)  # the forced tokens, the last one ended it
        assert (m.content or "") == exp["content"]
        if thinking:
            assert getattr(m, "reasoning_content", None) == exp["reasoning_content"]
        got = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls]
        want = [(t["name"], json.loads(t["arguments"])) for t in exp["tool_calls"]]
        assert got == want
        assert [[type(v) for v in a.values()] for _, a in got] == \
            [[type(v) for v in a.values()] for _, a in want]  # typed: 1 stays an int
        msg, _, finish, _ = collect_stream(s.client(key="none").chat.completions.create(stream=True, **args))
        assert finish == "tool_calls" and msg["content"] == (m.content or "")
        calls = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == got
    finally:
        assert s.stop() == 0


# ---- limits, malformed requests, 429 ----------------------------------------------------------
def malformed_requests(rng):
    """(method, path, body bytes, content type) of 200 bad requests, every kind several times."""
    good = json.dumps({"model": "m", "messages": MSG, "max_tokens": 4}).encode()
    chat = "/v1/chat/completions"
    kinds = [
        lambda: ("POST", chat, good[:rng.randrange(1, len(good) - 1)]),             # truncated JSON
        lambda: ("POST", chat, b"{\"messages\": " + json.dumps(rng.choice(
            [5, "hi", None, {"a": 1}, [1, 2], [{"role": 7}], [{"role": "user", "content": 5}]])).encode() + b"}"),
        lambda: ("POST", chat, json.dumps({"messages": MSG, rng.choice(
            ["temperature", "top_p", "max_tokens", "seed", "n", "top_k", "stream", "logprobs",
             "stop", "logit_bias", "stream_options", "tools", "top_logprobs"]): rng.choice(
            ["x", [1], {"a": 1}, -5, 10 ** 400])}).encode()),  # wrong types
        lambda: ("POST", chat, b'{"messages":' + json.dumps(MSG).encode() + b',"max_tokens":'
                 + str(10 ** rng.randrange(20, 400)).encode() + b"}"),             # huge numbers
        lambda: ("POST", chat, b'{"messages":[{"role":"user","content":"\\xff\\xfe' +
                 bytes([rng.randrange(128, 256)]) + b'"}]}'),                      # invalid UTF-8
        lambda: ("POST", "/v1/completions", b'{"prompt":[' + b",".join(
            str(rng.choice([-1, 10 ** 12, 2 ** 31])).encode() for _ in range(3)) + b"]}"),
        lambda: ("POST", "/v1/completions", b'{"prompt":"' + b"\xc3" + b'"}'),
        lambda: ("POST", "/tokenize", b"[1,2"),
        lambda: ("POST", "/detokenize", b'{"tokens":["a"]}'),
        lambda: ("GET", chat, b""),                                                   # wrong method
        lambda: ("POST", "/v1/nothing", b"{}"),                                       # no route
        lambda: ("POST", chat, b'{"messages":' + json.dumps(MSG).encode() +
                 b',"max_tokens":100000000}'),                                        # > context
        lambda: ("POST", chat, json.dumps({"messages": [{"role": "user", "content": "x"}] * 3000}).encode()),
        lambda: ("POST", chat, b"[" * 100000 + b"]" * 100000),                        # deep nesting
        lambda: ("POST", chat, b""),
    ]
    out = [kinds[i % len(kinds)]() for i in range(197)]
    big = b'{"messages":[{"role":"user","content":"' + b"a" * (10 << 20) + b'"}]}'
    out += [("POST", chat, big), ("POST", "/v1/completions", big), ("POST", "/tokenize", big)]
    return out


@pytest.fixture(scope="module")
def small_srv(model_dir):
    s = Server(model_dir, extra=["--max-seqs", "1", "--max-queue", "2", "--max-ctx", "512",
                                 "--max-messages", "2048"])
    yield s
    assert s.stop(signal.SIGINT) == 0


def test_limits_malformed(small_srv):
    rng = random.Random(12)
    reqs = malformed_requests(rng)
    assert len(reqs) == 200
    bad = []
    for method, path, body in reqs:
        r = requests.request(method, small_srv.url + path, data=body, timeout=60,
                             headers={"Content-Type": "application/json"})
        ok = 400 <= r.status_code < 500
        if ok and r.content:
            e = r.json()["error"]
            ok = isinstance(e["message"], str) and e["type"].endswith("_error")
        if not ok:
            bad.append((path, body[:80], r.status_code, r.text[:200]))
        assert requests.get(small_srv.url + "/health", timeout=10).status_code == 200
    assert not bad, bad[:5]
    big = [r for r in reqs if len(r[2]) > (4 << 20)]
    assert len(big) == 3
    # the limits name themselves
    r = requests.post(small_srv.url + "/v1/chat/completions", timeout=30,
                      json={"messages": MSG, "max_tokens": 100000})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    r = requests.post(small_srv.url + "/v1/chat/completions", timeout=30, data=reqs[-3][2])
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_limits_queue_full_429(small_srv):
    """One slot, two admitted: of 6 long requests at once, some get 429 with Retry-After."""
    body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True}
    res = []

    def go():
        r = requests.post(small_srv.url + "/v1/completions", json=body, timeout=120)
        res.append((r.status_code, r.headers.get("Retry-After"), r.json()))

    ts = [threading.Thread(target=go) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    codes = sorted(c for c, _, _ in res)
    assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    for c, ra, j in res:
        if c == 429:
            assert ra == "1" and j["error"]["type"] == "rate_limit_error"
        else:
            assert j["usage"]["completion_tokens"] == 400


# ---- soak: 16 concurrent streams on 2x2 --------------------------------------------------------
def test_soak_16_streams(model_dir):
    seconds = float(os.environ.get("K3_SERVE_SOAK_S", "30"))
    s = Server(model_dir, 2, 2, extra=["--max-seqs", "8"])
    errors, done, total = [], [0], [0]
    lock = threading.Lock()

    def stream_once(rng):
        body = {"messages": [{"role": "user", "content": "tell me %d" % rng.randrange(1000)}],
                "max_tokens": rng.randrange(4, 24), "stream": True, "temperature": 0.8,
                "stream_options": {"include_usage": True}}
        with requests.post(s.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
            raw = r.raw.read().decode("utf-8")
        ev = [e for e in raw.split("\n\n") if e]
        if r.status_code != 200 or not ev or ev[-1] != "data: [DONE]":
            raise RuntimeError("status %d, last event %r" % (r.status_code, ev[-1:]))
        usage = json.loads(ev[-2][6:])["usage"]
        if usage["completion_tokens"] > body["max_tokens"]:
            raise RuntimeError("usage %r" % usage)

    def client(i, until):
        rng = random.Random(i)
        while time.time() < until:
            try:
                stream_once(rng)
                with lock:
                    done[0] += 1
            except Exception as e:  # noqa: BLE001 — every failure is counted
                with lock:
                    errors.append(repr(e))
            with lock:
                total[0] += 1

    def run(sec):
        until = time.time() + sec
        ts = [threading.Thread(target=client, args=(i, until)) for i in range(16)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    try:
        run(min(5.0, seconds / 4))  # warm-up: every slot and buffer size in use once
        rss_warm = s.rss_kb()
        n_warm = done[0]
        run(seconds)
        rss_end = s.rss_kb()
    finally:
        rc = s.stop()
    print("soak: %d streams after warm-up, %d errors; RSS %d kB after warm-up, %d kB after"
          % (done[0] - n_warm, len(errors), rss_warm, rss_end))
    assert not errors, errors[:5]
    assert done[0] - n_warm >= 16
    assert abs(rss_end - rss_warm) <= 0.10 * rss_warm, (rss_warm, rss_end)
    assert rc == 0


def test_limits_shutdown_grace(model_dir):
    """SIGTERM with a long stream in flight: no new connections, the stream is cancelled after
    --shutdown-grace and still ends properly (finish_reason, [DONE]), the server exits 0. The
    stream asks for 64000 tokens: 4000 (the tiny model at ~3000 tok/s) ended within the 2 s of
    sleep + grace in one CI run, uncancelled."""
    s = Server(model_dir, extra=["--shutdown-grace", "1", "--max-ctx", "65536"])
    body = {"prompt": "hi", "max_tokens": 64000, "ignore_eos": True, "stream": True}
    got = {}

    def go():
        with requests.post(s.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            got["raw"] = r.raw.read().decode("utf-8")

    t = threading.Thread(target=go)
    t.start()
    time.sleep(1.0)
    t0 = time.time()
    os.kill(s.pid, signal.SIGTERM)
    t.join(timeout=60)
    rc = s.proc.wait(timeout=60)
    took = time.time() - t0
    ev = [e for e in got.get("raw", "").split("\n\n") if e]
    assert ev and ev[-1] == "data: [DONE]", ev[-2:]
    last = json.loads(ev[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"
    n_text = sum(len(json.loads(e[6:])["choices"][0]["text"]) for e in ev[:-1])
    assert n_text > 0
    assert rc == 0 and took < 30, (rc, took)
    assert "stopping: 1 requests open" in s.text()
    m = re.search(r"path=/v1/completions status=200 prompt_tokens=\d+ completion_tokens=(\d+)", s.text())
    assert m and 0 < int(m.group(1)) < 64000, "not cancelled at the end of the grace period"
    with pytest.raises(requests.ConnectionError):
        requests.get(s.url + "/health", timeout=5)


def tx_queue(local_port, remote_port):
    """Bytes the kernel holds unsent on the server's socket (local_port -> remote_port), or -1."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            p = line.split()
            if int(p[1].split(":")[1], 16) == local_port and int(p[2].split(":")[1], 16) == remote_port:
                return int(p[4].split(":")[0], 16)
    return -1


def test_stuck_client(model_dir):
    """A client that never reads its stream cannot hold the server at shutdown: after the grace
    its request is cancelled, and 10 s later its connection is closed; exit 0."""
    s = Server(model_dir, extra=["--shutdown-grace", "1", "--max-ctx", "16384"])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", s.port))
    body = json.dumps({"prompt": "hi", "max_tokens": 16000, "ignore_eos": True, "stream": True,
                       "logprobs": 20}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: k3\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    # wait until the server's send buffer is full and stays full: its writer blocks
    me, last, t0 = sock.getsockname()[1], -2, time.time()
    while time.time() - t0 < 60:
        time.sleep(1)
        q = tx_queue(s.port, me)
        if q > 0 and q == last:
            break
        last = q
    assert q > 0 and q == last, "the server's writer never blocked (send queue %d)" % q
    t0 = time.time()
    os.kill(s.pid, signal.SIGTERM)
    rc = s.proc.wait(timeout=90)
    took = time.time() - t0
    sock.close()
    assert rc == 0 and took < 40, (rc, took)
    assert "responses still being written" in s.text()
