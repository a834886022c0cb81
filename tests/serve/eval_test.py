"""eval_test.py — `k3 serve` as evaluation harnesses drive it (owner: serve; issue 32).

Run by ctest through pytest (tests/serve/tests.cmake):  python3 -m pytest eval_test.py -k GROUP
Environment as serve_test.py (K3_BIN, K3_MPIEXEC).

Groups (pytest -k), each on 1x1 (e1x1) and 2x2 (e2x2, --deterministic):
  prompt_lp : echo + logprobs with max_tokens 0 (OpenAI's legacy shape: the first token's logprob
      null) and vLLM's prompt_logprobs, for prompts longer than a prefill chunk: every logprob
      equals the log-softmax (float64 numpy) of `k3 run --dump-logits` at that position within
      1e-5, the top entries are numpy's top ids, the ranks numpy's; 2x2 answers bit for bit what
      1x1 answers.
  choices   : the openai SDK: n=3 gives 3 choices indexed 0..2 (a seeded request repeats), a list
      of 4 prompts gives 4 choices in order, each what the prompt alone gives; a streamed n=2
      request carries both indices and puts together the non-streamed choices; best_of: 400;
      n > 1 forks one prefill (test_choices_fork_one_prefill: the engine's prompt-token counter
      grows once, every choice equals its n = 1 request with seed + c, cancellation frees all).
  info      : GET /version, GET /tokenizer_info (the model's tokenizer_config.json, as vLLM
      returns its tokenizer's config; open, as vLLM guards only the paths under /v1).
  rolling   : (issue 47) lm-eval `loglikelihood_rolling` on documents longer than its window,
      once with the remote tokenizer (GET /tokenizer_info + /tokenize, no key given to lm-eval but
      OPENAI_API_KEY) and once with a local HF tokenizer built from the model's tiktoken file
      (tokenizers' own BPE, checked against tiktoken): every document's loglikelihood is equal;
      /tokenize reads special-token text as the special token ("[EOS]" -> one id), as HF does.
  metrics   : /metrics parses with prometheus_client, every series has model_name; after a mix of
      requests (chat, streamed, n=2, a prompt list, echo) vllm:prompt_tokens_total and
      vllm:generation_tokens_total grew by exactly the responses' usage; a cancelled stream is
      counted apart (finished_reason abort, k3_cancelled_*); the vLLM histograms count them.
  queue     : (e1x1 only) one slot and 300 concurrent requests: every one answered 200 (the queue is
      bounded by memory, not a count); with --max-queue-bytes 1 MiB the same burst gets 429s
      naming the flag, and every request is answered.
  lm_eval   : lm-evaluation-harness from PyPI (`local-completions`, the remote tokenizer through
      GET /tokenizer_info + /tokenize) on a multiple-choice task in local files, --batch_size 4
      (prompt lists): every example's loglikelihood equals the dump's log-softmax summed over its
      continuation within 1e-5; a generate_until task runs too. Skipped (fails under CI=true)
      without lm_eval.
"""
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import pytest
import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_test import KEY, Server, metrics, model_dir  # noqa: E402,F401 (model_dir: a fixture)

K3 = os.environ.get("K3_BIN", "k3")
NAME = "k3-tiny"
CHUNK = 16  # --chunk of the servers: the prompts below span several prefill chunks
TOL = 1e-5  # the bound; the values travel as float32 (rel 6e-8) in shortest decimal form


def start(model, topo):
    pp, ep = (1, 1) if topo == "e1x1" else (2, 2)
    return Server(model, pp, ep, extra=["--api-key", KEY, "--deterministic", "--max-seqs", "4",
                                        "--chunk", str(CHUNK), "--served-model-name", NAME])


@pytest.fixture(scope="module", params=["e1x1", "e2x2"])
def srv(request, model_dir):
    s = start(model_dir, request.param)
    s.topology = request.param
    yield s
    assert s.stop() == 0, s.text()[-2000:]


def post(srv, path, body):
    r = requests.post(srv.url + path, json=body, headers={"Authorization": "Bearer " + KEY},
                      timeout=120)
    return r.status_code, r.json()


def dump_logprobs(model, prompts, tmp):
    """log-softmax (float64) of `k3 run --dump-logits` for each prompt: [P, V] each."""
    f = os.path.join(tmp, "dump.npy")
    subprocess.run([K3, "run", "--model", model, "--threads", "1", "--n", "1", "--prompt-ids",
                    ";".join(",".join(map(str, p)) for p in prompts), "--dump-logits", f],
                   check=True, capture_output=True, timeout=300)
    rows = np.load(f).astype(np.float64)
    assert rows.shape[0] == sum(len(p) for p in prompts), rows.shape
    assert np.isfinite(rows).all() and rows.std() > 0  # not degenerate
    out, off = [], 0
    for p in prompts:
        x = rows[off:off + len(p)]
        m = x.max(axis=1, keepdims=True)
        out.append(x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
        off += len(p)
    return out


def prompts_for_test(seed, n_vocab):
    rng = np.random.default_rng(seed)
    print("prompt seed", seed)
    # 3 tokens (one chunk), 40 (three chunks of 16), 17 (a chunk + 1)
    return [rng.integers(0, n_vocab, size=n).tolist() for n in (3, 40, 17)]


def n_vocab(model):
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    return (c.get("text_config") or c)["vocab_size"]


# ---- prompt logprobs --------------------------------------------------------------------------
def echo_requests(srv, prompts):
    """For each prompt: the echo response and the prompt_logprobs response (both max_tokens 0)."""
    out = []
    for p in prompts:
        st, e = post(srv, "/v1/completions", {"model": NAME, "prompt": p, "echo": True,
                                              "logprobs": 5, "max_tokens": 0})
        assert st == 200, e
        st, v = post(srv, "/v1/completions", {"model": NAME, "prompt": p, "prompt_logprobs": 5,
                                              "max_tokens": 0})
        assert st == 200, v
        out.append((e, v))
    return out


def check_against_dump(prompts, answers, ref):
    for p, (e, v), lp in zip(prompts, answers, ref):
        ch = e["choices"][0]
        L = ch["logprobs"]
        # an echo request runs its whole prompt: never a prefix-cache hit
        assert e["usage"] == {"prompt_tokens": len(p), "completion_tokens": 0,
                              "total_tokens": len(p), "prompt_tokens_details": {"cached_tokens": 0}}
        assert len(L["tokens"]) == len(L["token_logprobs"]) == len(L["top_logprobs"]) == len(p)
        assert L["token_logprobs"][0] is None and L["top_logprobs"][0] is None
        assert L["text_offset"] == sorted(L["text_offset"]) and L["text_offset"][0] == 0
        assert ch["text"].startswith(L["tokens"][0])  # echo: the prompt's text comes back
        want = np.array([lp[i - 1][p[i]] for i in range(1, len(p))])
        got = np.array(L["token_logprobs"][1:], dtype=np.float64)
        assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()
        pl = v["choices"][0]["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(p)
        for i in range(1, len(p)):
            row = lp[i - 1]
            top = np.argsort(-row, kind="stable")[:5]
            d = {int(k): x for k, x in pl[i].items()}
            assert abs(d[p[i]]["logprob"] - row[p[i]]) <= TOL
            assert d[p[i]]["rank"] == 1 + int((row > row[p[i]]).sum())
            for r, t in enumerate(top):
                assert abs(d[int(t)]["logprob"] - row[t]) <= TOL
                assert d[int(t)]["rank"] == r + 1 or int(t) == p[i]
            # the echo's top entries are the same values
            assert sorted(L["top_logprobs"][i].values(), reverse=True) == pytest.approx(
                [row[t] for t in top][:len(L["top_logprobs"][i])], abs=TOL)


ANSWERS = {}


def test_prompt_lp_matches_dump_logits(srv, model_dir, tmp_path):
    prompts = prompts_for_test(32, n_vocab(model_dir))
    answers = echo_requests(srv, prompts)
    check_against_dump(prompts, answers, dump_logprobs(model_dir, prompts, str(tmp_path)))
    ANSWERS[srv.topology] = [(e["choices"][0]["logprobs"], v["choices"][0]["prompt_logprobs"])
                             for e, v in answers]
    if srv.topology == "e2x2" and "e1x1" in ANSWERS:  # --deterministic: every split bit-identical
        assert ANSWERS["e2x2"] == ANSWERS["e1x1"]


def test_prompt_lp_with_generation_and_stream(srv, model_dir):
    p = prompts_for_test(33, n_vocab(model_dir))[1]
    body = {"model": NAME, "prompt": p, "echo": True, "logprobs": 2, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    st, full = post(srv, "/v1/completions", body)
    assert st == 200, full
    L = full["choices"][0]["logprobs"]
    assert len(L["tokens"]) == len(p) + 4 and full["usage"]["completion_tokens"] == 4
    st, alone = post(srv, "/v1/completions", dict(body, echo=False))
    assert L["token_logprobs"][len(p):] == alone["choices"][0]["logprobs"]["token_logprobs"]
    assert full["choices"][0]["text"].endswith(alone["choices"][0]["text"])
    # a step that computes every row for one request (PLP) still samples the others from their
    # own last rows: both at once give what each gives alone
    plain = {"model": NAME, "prompt": p[::-1], "max_tokens": 6, "temperature": 0,
             "ignore_eos": True, "logprobs": 1}
    _, plain_alone = post(srv, "/v1/completions", plain)
    got = {}
    ts = [threading.Thread(target=lambda k=k, b=b: got.__setitem__(k, post(srv, "/v1/completions", b)))
          for k, b in (("echo", body), ("plain", plain))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert got["echo"][1]["choices"][0]["logprobs"] == L
    assert got["plain"][1]["choices"][0] == plain_alone["choices"][0]
    # streamed: the prompt comes first, then the completion; together the same logprobs
    c = srv.client()
    toks, lps = [], []
    sdk = {k: v for k, v in body.items() if k != "ignore_eos"}
    for k in c.completions.create(stream=True, extra_body={"ignore_eos": True}, **sdk):
        for ch in k.choices:
            if ch.logprobs:
                toks += ch.logprobs.tokens
                lps += ch.logprobs.token_logprobs
    assert toks == L["tokens"] and lps == L["token_logprobs"]


def test_prompt_lp_refusals(srv):
    for body, what in [({"prompt": "a", "echo": True, "messages": None, "max_tokens": 0,
                         "prompt_logprobs": 21}, "prompt_logprobs"),
                       ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
                       ({"prompt": "a", "prompt_logprobs": "3"}, "prompt_logprobs")]:
        st, e = post(srv, "/v1/completions", dict(body, model=NAME))
        assert st == 400 and what in e["error"]["message"], e
    st, e = post(srv, "/v1/chat/completions",
                 {"model": NAME, "messages": [{"role": "user", "content": "x"}], "echo": True})
    assert st == 400 and "echo" in e["error"]["message"]
    # chat takes prompt_logprobs (at the top level, as vLLM answers)
    st, r = post(srv, "/v1/chat/completions", {"model": NAME, "max_tokens": 1, "prompt_logprobs": 0,
                                               "messages": [{"role": "user", "content": "x"}]})
    assert st == 200 and len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]


# ---- n and prompt lists -------------------------------------------------------------------------
def test_choices_n_and_prompt_lists(srv):
    c = srv.client()
    r = c.completions.create(model=NAME, prompt="Hello there", n=3, max_tokens=6, seed=11,
                             temperature=1.0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.text for ch in r.choices}) > 1  # three samples, not one copied
    again = c.completions.create(model=NAME, prompt="Hello there", n=3, max_tokens=6, seed=11,
                                 temperature=1.0)
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]
    one = c.completions.create(model=NAME, prompt="Hello there", max_tokens=1)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert r.usage.completion_tokens == 18  # 3 x 6 (the tiny model rarely stops this early)
    prompts = ["The cat", "A dog and", [5, 6, 7, 8, 9], "Once"]
    r = c.completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    total = 0
    for i, p in enumerate(prompts):
        one = c.completions.create(model=NAME, prompt=p, max_tokens=5, temperature=0)
        assert r.choices[i].text == one.choices[0].text, i
        total += one.usage.prompt_tokens
    assert r.usage.prompt_tokens == total
    # lists x n: index = prompt * n + copy
    r = c.completions.create(model=NAME, prompt=prompts[:2], n=2, max_tokens=2, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy copies of one prompt agree


def test_choices_stream_n2(srv):
    c = srv.client()
    kw = dict(model=NAME, max_tokens=8, n=2, seed=5, temperature=1.0)
    msgs = [{"role": "user", "content": "Name a colour."}]
    full = c.chat.completions.create(messages=msgs, **kw)
    got, usage = {}, None
    for k in c.chat.completions.create(messages=msgs, stream=True,
                                       stream_options={"include_usage": True}, **kw):
        usage = k.usage or usage
        for ch in k.choices:
            d = got.setdefault(ch.index, {"content": "", "reasoning": ""})
            d["content"] += ch.delta.content or ""
            d["reasoning"] += getattr(ch.delta, "reasoning_content", None) or ""
    assert sorted(got) == [0, 1]
    for ch in full.choices:
        assert got[ch.index]["content"] == ch.message.content
        assert got[ch.index]["reasoning"] == (ch.message.reasoning_content or "")
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    # completions, streamed n=2: both indices
    idx = {ch.index for k in c.completions.create(model=NAME, prompt="Hi", n=2, max_tokens=3,
                                                  stream=True) for ch in k.choices}
    assert idx == {0, 1}


def test_choices_fork_one_prefill(srv, model_dir):
    """n > 1 forks one prefill: the engine runs the prompt once (k3_engine_prompt_tokens_total grows
    by its length, k3_forks_total by n - 1), and each choice c is exactly (tokens, text, logprobs)
    what the same request with n = 1 and seed + c gives, for prompts ending on a block boundary
    (128), mid-block (165, the copied block) and over two prefill chunks (300); echo + logprobs
    give every choice the same prompt logprobs; a client that leaves a streamed n = 3 request
    cancels its choices and every reserved block comes back."""
    c = srv.client()
    rng = np.random.default_rng(3232)
    hi = min(n_vocab(model_dir) - 256, 4000)
    kw = dict(model=NAME, max_tokens=6, temperature=1.0, logprobs=2)

    def choice_of(ch):
        return ch.text, ch.logprobs.tokens, ch.logprobs.token_logprobs

    for P in (128, 165, 300):
        ids = rng.integers(10, hi, size=P).tolist()
        before = scrape(srv)
        r = c.completions.create(prompt=ids, n=3, seed=21, **kw)
        after = scrape(srv)
        d = lambda name: after.get((name, ()), 0) - before.get((name, ()), 0)  # noqa: E731
        assert d("k3_engine_prompt_tokens_total") == P, P  # one prefill for the 3 choices
        assert d("k3_forks_total") == 2, P
        assert d("vllm:prompt_tokens_total") == P == r.usage.prompt_tokens  # as usage counts it
        for i, ch in enumerate(r.choices):
            one = c.completions.create(prompt=ids, seed=21 + i, **kw)
            assert choice_of(ch) == choice_of(one.choices[0]), (P, i)
    # echo + logprobs + n: the prompt's logprobs (computed once) in every choice
    ids = rng.integers(10, hi, size=70).tolist()
    r = c.completions.create(prompt=ids, n=2, seed=4, echo=True, **kw)
    one = c.completions.create(prompt=ids, seed=4, echo=True, **kw)
    assert r.choices[0].logprobs.token_logprobs[:70] == r.choices[1].logprobs.token_logprobs[:70]
    assert r.choices[0].logprobs.token_logprobs[0] is None
    assert choice_of(r.choices[0]) == choice_of(one.choices[0])
    # a client leaving a streamed n = 3 request: every choice cancelled, no block kept
    body = {"model": NAME, "prompt": ids, "n": 3, "max_tokens": 400, "stream": True,
            "ignore_eos": True, "seed": 9}
    with requests.post(srv.url + "/v1/completions", json=body, stream=True, timeout=60,
                       headers={"Authorization": "Bearer " + KEY}) as h:
        seen = set()
        for line in h.iter_lines():
            if line.startswith(b"data: {"):
                seen |= {ch["index"] for ch in json.loads(line[6:])["choices"]}
            if len(seen) == 3:
                break
    deadline = time.time() + 20
    while True:
        m = scrape(srv)
        if m[("vllm:num_requests_running", ())] == 0 and m[("vllm:kv_cache_usage_perc", ())] == 0:
            break
        assert time.time() < deadline, "blocks still reserved after the client left"
        time.sleep(0.2)
    r2 = c.completions.create(prompt=ids, n=2, seed=4, echo=True, **kw)  # the server goes on
    assert [choice_of(x) for x in r2.choices] == [choice_of(x) for x in r.choices]


def test_choices_refusals(srv):
    c = srv.client()
    with pytest.raises(openai.BadRequestError, match="best_of"):
        c.completions.create(model=NAME, prompt="x", best_of=2, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="'n'"):
        c.completions.create(model=NAME, prompt="x", n=0, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"'prompt'\[1\]"):
        c.completions.create(model=NAME, prompt=["x", 5], max_tokens=1)


def test_info_routes(srv, model_dir):
    # vLLM's GET /version (open, as /health) and GET /tokenizer_info (the tokenizer's config)
    r = requests.get(srv.url + "/version", timeout=10)
    assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]
    r = requests.get(srv.url + "/tokenizer_info", headers={"Authorization": "Bearer " + KEY},
                     timeout=10)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        assert r.status_code == 200 and r.json() == json.load(f)
    # vLLM's rule: the API key guards the paths under /v1 only, so lm-eval's probe of
    # /tokenizer_info (sent without OPENAI_API_KEY) is answered
    assert requests.get(srv.url + "/tokenizer_info", timeout=10).status_code == 200


# ---- metrics -------------------------------------------------------------------------------------
def scrape(srv):
    """/metrics through prometheus_client's parser (serve_test.metrics): model_name on every
    series, then dropped from the keys."""
    out = {}
    for (name, labels), v in metrics(srv).items():
        assert ("model_name", NAME) in labels, (name, labels)
        out[(name, tuple(x for x in labels if x[0] != "model_name"))] = v
    return out


def test_metrics_token_counters_equal_usage(srv):
    before = scrape(srv)
    c = srv.client()
    usage = []  # (prompt, completion) of every completed response
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    usage.append(r.usage)
    r = c.completions.create(model=NAME, prompt="Hello", n=2, max_tokens=4, seed=1)
    usage.append(r.usage)
    r = c.completions.create(model=NAME, prompt=["a b", "c d e"], max_tokens=3, temperature=0)
    usage.append(r.usage)
    r = c.completions.create(model=NAME, prompt=[5, 6, 7, 8], max_tokens=1, echo=True, logprobs=1)
    usage.append(r.usage)
    u = None
    for k in c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Yo"}],
                                       max_tokens=6, stream=True, stream_options={"include_usage": True}):
        u = k.usage or u
    usage.append(u)
    # a stream the client leaves: cancelled, counted apart
    body = {"model": NAME, "prompt": "x", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with requests.post(srv.url + "/v1/completions", json=body, stream=True, timeout=60,
                       headers={"Authorization": "Bearer " + KEY}) as h:
        for i, _ in enumerate(h.iter_lines()):
            if i >= 6:
                break
    deadline = time.time() + 20
    while True:
        after = scrape(srv)
        d = lambda name, *lb: after.get((name, lb), 0) - before.get((name, lb), 0)  # noqa: E731
        if d("vllm:request_success_total", ("finished_reason", "abort")) >= 1 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert d("vllm:prompt_tokens_total") == sum(x.prompt_tokens for x in usage)
    assert d("vllm:generation_tokens_total") == sum(x.completion_tokens for x in usage)
    done = d("vllm:request_success_total", ("finished_reason", "stop")) + \
        d("vllm:request_success_total", ("finished_reason", "length"))
    assert done == 7  # choices: 1 + 2 + 2 + 1 + 1
    assert d("vllm:request_success_total", ("finished_reason", "abort")) == 1
    assert d("k3_cancelled_prompt_tokens_total") >= 1 and d("k3_cancelled_generation_tokens_total") >= 1
    for h in ("e2e_request_latency", "request_queue_time", "request_inference_time"):
        assert d("vllm:%s_seconds_count" % h) == 7, h
    assert d("vllm:time_to_first_token_seconds_count") == 7
    assert d("vllm:inter_token_latency_seconds_count") > 0
    for g in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert (g, ()) in after
    assert after[("vllm:num_requests_running", ())] == 0 and after[("vllm:kv_cache_usage_perc", ())] == 0


# ---- queueing -------------------------------------------------------------------------------------
def burst(srv, n, body):
    codes, errors = [], []
    lock = threading.Lock()

    def one():
        try:
            r = requests.post(srv.url + "/v1/completions", json=body, timeout=300,
                              headers={"Authorization": "Bearer " + KEY})
            with lock:
                codes.append(r.status_code)
                if r.status_code != 200:
                    errors.append(r.json()["error"]["message"])
        except requests.RequestException as e:
            with lock:
                codes.append(str(e))
    ts = [threading.Thread(target=one) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return codes, errors


def test_queue_hundreds_queued(model_dir):
    body = {"model": NAME, "prompt": "count to three", "max_tokens": 2}
    s = Server(model_dir, extra=["--api-key", KEY, "--max-seqs", "1", "--served-model-name", NAME])
    try:
        codes, _ = burst(s, 300, body)
        assert codes.count(200) == 300, sorted(set(map(str, codes)))
    finally:
        assert s.stop() == 0
    s = Server(model_dir, extra=["--api-key", KEY, "--max-seqs", "1", "--served-model-name", NAME,
                                 "--max-queue-bytes", str(1 << 20)])
    try:
        codes, errors = burst(s, 60, dict(body, max_tokens=32, ignore_eos=True))
        assert len(codes) == 60 and set(codes) <= {200, 429}, set(map(str, codes))
        assert codes.count(429) > 0 and codes.count(200) > 0
        assert all("--max-queue-bytes" in e for e in errors)
    finally:
        assert s.stop() == 0


# ---- lm-evaluation-harness ------------------------------------------------------------------------
MC = [{"q": "The sky is", "choices": [" blue", " green", " loud"], "label": 0},
      {"q": "Two plus two is", "choices": [" four", " five"], "label": 0},
      {"q": "Cats like to ", "choices": ["sleep", "fly", "swim", "read"], "label": 0},
      {"q": "Water is", "choices": [" wet", " dry"], "label": 0},
      {"q": "Paris is in", "choices": [" France", " Peru", " the sea"], "label": 0}]
GEN = [{"q": q} for q in ["Once upon a time", "The cat", "Hello", "In the beginning", "My name is"]]


def write_tasks(d):
    for name, docs in (("mc", MC), ("gen", GEN)):
        with open(os.path.join(d, name + ".jsonl"), "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in docs)
    with open(os.path.join(d, "k3_mc.yaml"), "w") as f:
        f.write("task: k3_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                "    test: %s/mc.jsonl\ntest_split: test\noutput_type: multiple_choice\n"
                "doc_to_text: \"{{q}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
                "metric_list:\n  - metric: acc\n" % d)
    with open(os.path.join(d, "k3_gen.yaml"), "w") as f:
        f.write("task: k3_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                "    test: %s/gen.jsonl\ntest_split: test\noutput_type: generate_until\n"
                "doc_to_text: \"{{q}}\"\ndoc_to_target: \"\"\ngeneration_kwargs:\n"
                "  until: [\"\\n\"]\n  max_gen_toks: 8\nmetric_list:\n  - metric: exact_match\n" % d)


def encode_pair(srv, context, continuation):
    """lm-eval's TemplateLM._encode_pair with the server's /tokenize (its remote tokenizer)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]

    def enc(t):
        st, r = post(srv, "/tokenize", {"prompt": t, "add_special_tokens": False})
        assert st == 200, r
        return r["tokens"]

    whole, ctx = enc(context + continuation), enc(context)
    return whole, len(ctx)


def need_lm_eval():
    """Skip without lm_eval (a failure under CI=true)."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("lm_eval is not installed (tests/requirements.txt)")


def test_lm_eval_local_completions(srv, model_dir, tmp_path):
    need_lm_eval()
    d = str(tmp_path)
    write_tasks(d)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OPENAI_API_KEY=KEY,
               TOKENIZERS_PARALLELISM="false")
    args = ("base_url=%s/v1/completions,model=%s,tokenizer_backend=remote,auth_token=%s,"
            "num_concurrent=1,max_retries=1,tokenized_requests=True" % (srv.url, NAME, KEY))
    p = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions",
                        "--model_args", args, "--include_path", d, "--tasks", "k3_mc,k3_gen",
                        "--batch_size", "4", "--output_path", os.path.join(d, "out"),
                        "--log_samples"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    samples = {}
    for root, _, files in os.walk(os.path.join(d, "out")):
        for fn in files:
            if fn.startswith("samples_"):
                task = fn[len("samples_"):].rsplit("_", 1)[0]
                with open(os.path.join(root, fn)) as f:
                    samples[task] = [json.loads(line) for line in f]
    assert len(samples["k3_gen"]) == len(GEN)
    assert all(isinstance(s["resps"][0][0], str) for s in samples["k3_gen"])
    mc = samples["k3_mc"]
    assert len(mc) == len(MC)
    cases = []  # (lm-eval's loglikelihood, token ids, context length)
    for s in mc:
        args = [s["arguments"]["gen_args_%d" % i] for i in range(len(s["arguments"]))]
        for arg, resp in zip(args, s["resps"]):
            ctx, cont = arg["arg_0"], arg["arg_1"]
            whole, ctxlen = encode_pair(srv, ctx, cont)
            cases.append((float(resp[0][0]), whole, ctxlen))
    assert len(cases) == sum(len(x["choices"]) for x in MC)
    ref = dump_logprobs(model_dir, [w for _, w, _ in cases], d)
    worst = 0.0
    for (ll, whole, ctxlen), lp in zip(cases, ref):
        want = sum(lp[i - 1][whole[i]] for i in range(ctxlen, len(whole)))
        worst = max(worst, abs(ll - want))
    print("lm-eval loglikelihoods vs --dump-logits: %d cases, worst |diff| %.2e" % (len(cases),
                                                                                     worst))
    assert worst <= TOL


ROLLING = [{"text": t} for t in [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "In the beginning was the word, and the word was with the model; numbers 1234567 and [EOS] too.",
    "Héllo wörld, 你好, 12 + 34 = 46.\n\nA second paragraph follows here, with more words in it.",
]]


def local_hf_tokenizer(model_dir, out):
    """An HF fast tokenizer of the model's tiktoken file (tokenizers' BPE with K3's pattern and
    its special block), checked against tiktoken on a few strings."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import tiktoken
    from k3_tiktoken import K3_PAT, k3_specials
    from tiktoken.load import load_tiktoken_bpe
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        added = json.load(f)["added_tokens_decoder"]
    specials = k3_specials(min(int(k) for k in added))
    vocab = os.path.join(model_dir, "tiktoken.model")
    names = sorted(specials, key=specials.get)  # one block of ids right after the ranks
    t = PreTrainedTokenizerFast(tokenizer_object=TikTokenConverter(vocab_file=vocab,
                                                                   pattern=K3_PAT).converted())
    t.add_special_tokens({"additional_special_tokens": names})
    t.add_special_tokens({"bos_token": "[BOS]", "eos_token": "[EOS]"})
    t.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids(names) == [specials[n] for n in names]
    enc = tiktoken.Encoding("k3", pat_str=K3_PAT, mergeable_ranks=load_tiktoken_bpe(vocab),
                            special_tokens=specials)
    for d in ROLLING:
        assert tok.encode(d["text"]) == enc.encode(d["text"], allowed_special="all")
    return tok


def run_rolling(srv, d, backend):
    with open(os.path.join(d, "rolling.jsonl"), "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in ROLLING)
    with open(os.path.join(d, "k3_rolling.yaml"), "w") as f:
        f.write("task: k3_rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                "    test: %s/rolling.jsonl\ntest_split: test\noutput_type: loglikelihood_rolling\n"
                "doc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\nmetric_list:\n"
                "  - metric: word_perplexity\n" % d)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OPENAI_API_KEY=KEY,
               TOKENIZERS_PARALLELISM="false")
    args = ("base_url=%s/v1/completions,model=%s,%s,num_concurrent=1,max_retries=1,"
            "tokenized_requests=True,max_length=24" % (srv.url, NAME, backend))
    out = os.path.join(d, "out_" + backend.split(",")[0].split("=")[1])
    p = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions",
                        "--model_args", args, "--include_path", d, "--tasks", "k3_rolling",
                        "--batch_size", "2", "--output_path", out, "--log_samples"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    for root, _, files in os.walk(out):
        for fn in files:
            if fn.startswith("samples_k3_rolling"):
                with open(os.path.join(root, fn)) as f:
                    docs = [json.loads(line) for line in f]
                return {x["doc_id"]: float(np.ravel(x["resps"][0])[0]) for x in docs}
    raise AssertionError("no samples from lm-eval in " + out)


def test_rolling_remote_equals_local(srv, model_dir, tmp_path):
    if srv.topology != "e1x1":  # a tokenizer question: one topology is enough (lm-eval is slow)
        pytest.skip("run on e1x1")
    need_lm_eval()
    d = str(tmp_path)
    tok = local_hf_tokenizer(model_dir, os.path.join(d, "hf"))
    for text in ("[EOS]", "[BOS]", "a[EOS]b <|open|>"):
        r = requests.post(srv.url + "/tokenize", json={"prompt": text}, timeout=10)
        assert r.status_code == 200 and r.json()["tokens"] == tok.encode(text), (text, r.text)
    r = requests.post(srv.url + "/tokenize", json={"prompt": "[EOS]x", "return_token_strs": True},
                      timeout=10).json()
    assert r["token_strs"][0] == "[EOS]" and len(r["token_strs"]) == r["count"] == 2
    remote = run_rolling(srv, d, "tokenizer_backend=remote")
    local = run_rolling(srv, d, "tokenizer_backend=huggingface,tokenizer=%s" % os.path.join(d, "hf"))
    print("lm-eval loglikelihood_rolling: remote %s, local %s" % (remote, local))
    assert len(remote) == len(ROLLING) and remote == local
