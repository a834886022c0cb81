"""cache_test.py — `k3 serve` when the paged cache is smaller than the requests' contexts (issue
42: blocks as tokens arrive, preemption). Run by ctest through pytest (tests/serve/tests.cmake):
python3 -m pytest cache_test.py -k cache_chat. Environment as serve_test.py.

  cache_chat : a 1x1 server on the tiny model, --deterministic, --max-ctx 4096 and a paged cache
      of half of one context (--kv-cache-tokens 2048), 16 slots: 16 concurrent chat requests with
      no max_tokens (so each may take the rest of the context: before, each reserved that and the
      cache held none of them) and ~100 prompt tokens, ended as real chats end (a stop list of
      common punctuation), temperature 0, streamed. All complete, at least 8 run at once (had
      their first token before another one ended), and each text equals the same request run
      alone. (Before, each reserved its whole context, more than the cache, and was refused.)
      The scaled-down form of the issue's acceptance on `small` (64 requests, --max-ctx 131072,
      --kv-cache-tokens 65536: scripts/bench-cache-chat.py).
"""
import json
import random
import threading
import time

import pytest
import requests

from serve_test import Server, model_dir  # noqa: F401 (the fixture)

STOP = [".", ",", "!", "?", ";", ":", "\n"]
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def prompts(n, seed=42):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(n)]


def chat(srv, text):
    """Streamed: (text, finish reason, time of the first token, time of the end)."""
    r = requests.post(srv.url + "/v1/chat/completions", timeout=600, stream=True, json={
        "messages": [{"role": "user", "content": text}], "temperature": 0, "stop": STOP,
        "thinking": False,
        "stream": True})
    assert r.status_code == 200, r.text[:500]
    out, reason, t_first = "", None, None
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ch = json.loads(line[6:])["choices"]
        if not ch:
            continue
        if t_first is None:
            t_first = time.time()
        out += ch[0]["delta"].get("content") or ""
        reason = ch[0].get("finish_reason") or reason
    return out, reason, t_first, time.time()


def test_cache_chat_concurrent_default_max_tokens(model_dir):  # noqa: F811
    srv = Server(model_dir, extra=["--deterministic", "--max-ctx", "4096", "--kv-cache-tokens",
                                   "2048", "--max-seqs", "16"])
    try:
        ps = prompts(16)
        got = [None] * len(ps)

        def one(i):
            got[i] = chat(srv, ps[i])

        ts = [threading.Thread(target=one, args=(i,)) for i in range(len(ps))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(600)
        assert all(g is not None and g[1] for g in got), "some requests did not complete"
        # requests that had their first token while another one had not ended yet
        peak = max(sum(g[2] <= h[2] < g[3] for g in got) for h in got)
        assert peak >= 8, "at most %d requests ran at once" % peak
        for i, p in enumerate(ps):
            alone = chat(srv, p)
            assert got[i][0] == alone[0], "request %d: %r alone, %r with the others" % (
                i, alone[0], got[i][0])
        print("peak running %d; finish reasons %s; text lengths %s" % (
            peak, sorted({g[1] for g in got}), sorted(len(g[0]) for g in got)))
    finally:
        assert srv.stop() == 0, srv.text()[-2000:]
