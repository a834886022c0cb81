"""storm_test.py — issue 43, "storms survive": the prefix cache, forks and cancels under the
reliability battery's storm, against the live server on the tiny model.

For each prefix-cache budget (--prefix-cache-tokens 64, 128, and the default), ROUNDS rounds
(K3_STORM_ROUNDS, default 15) of: 48 (K3_STORM_STREAMS) streamed chat requests over a few shared prefixes with n = 1-4,
a third of them closed after 1-5 SSE events, and 16 clients that send half a body and leave.
  * the server never faults (exit 0 at SIGTERM, no sanitizer report in its log);
  * every stream not cancelled answers 200 and ends with `data: [DONE]`;
  * 20 greedy prompts give the same text after the storm as before it;
  * afterwards vllm:num_requests_running / waiting, the cache usage and /v1/k3/status's
    running / waiting are back at 0.
"""
import json
import os
import random
import socket
import threading
import time

import pytest
import requests

from serve_test import KEY, Server, metric, metrics, model_dir  # noqa: F401 (the fixture)

ROUNDS = int(os.environ.get("K3_STORM_ROUNDS", "15"))
STREAMS = int(os.environ.get("K3_STORM_STREAMS", "48"))  # a round's streams (a third as many drop)
H = {"Authorization": "Bearer " + KEY}
PREFIXES = ["You are a terse assistant. Answer in one line. " * k for k in (1, 2, 3)] + [
    "System: the following is a conversation about colours, numbers and animals. " * k for k in (1, 2)] + [
    "Rules: be brief; never apologise; use plain words; avoid lists. " * 3]
QUESTIONS = ["Name three colours.", "Count to five.", "What is a cat?", "Say hello.", "Why is the sky blue?",
             "List two animals.", "What is 2+2?", "Spell red."]


def greedy(srv):
    out = []
    for i in range(20):
        msgs = [{"role": "system", "content": PREFIXES[i % len(PREFIXES)]},
                {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " (%d)" % i}]
        r = requests.post(srv.url + "/v1/chat/completions", headers=H, timeout=120,
                          json={"model": srv.name, "messages": msgs, "max_tokens": 12, "temperature": 0,
                                "ignore_eos": True})
        assert r.status_code == 200, r.text[:300]
        out.append(r.json()["choices"][0]["message"]["content"])
    return out


def stream(srv, rng, res):
    """One streamed request: res gets ('cancelled', None), ('ok', None) or ('bad', why)."""
    msgs = [{"role": "system", "content": rng.choice(PREFIXES)},
            {"role": "user", "content": rng.choice(QUESTIONS)}]
    body = {"model": srv.name, "messages": msgs, "stream": True, "n": rng.randint(1, 4),
            "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.8])}
    cancel_after = rng.randint(1, 5) if rng.random() < 1 / 3 else None
    try:
        r = requests.post(srv.url + "/v1/chat/completions", headers=H, json=body, stream=True, timeout=180)
        if r.status_code != 200:
            res.append(("bad", "status %d: %s" % (r.status_code, r.text[:200])))
            return
        events, last = 0, None
        for line in r.iter_lines():
            if not line:
                continue
            last = line
            events += 1
            if cancel_after is not None and events >= cancel_after:
                r.close()
                res.append(("cancelled", None))
                return
        if cancel_after is not None:  # ended before its cancel point: a normal end
            pass
        res.append(("ok", None) if last == b"data: [DONE]" else ("bad", "no [DONE]: last line %r" % last))
    except Exception as e:  # noqa: BLE001 (a reset or timeout is the finding)
        res.append(("bad", "%s: %s" % (type(e).__name__, e)))


def drop_mid_body(srv, rng):
    msgs = [{"role": "user", "content": rng.choice(PREFIXES) + rng.choice(QUESTIONS)}]
    body = json.dumps({"model": srv.name, "messages": msgs, "stream": True, "n": rng.randint(1, 4),
                       "max_tokens": 16}).encode()
    try:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) +
                  body[:rng.randint(1, len(body) - 1)])
        time.sleep(rng.random() * 0.3)
        s.close()
    except OSError:
        pass


def idle(srv, timeout=60):
    t0 = time.monotonic()
    while True:
        m = metrics(srv)
        for g in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            # metric() reads a missing series as 0: absent, it would pass the check below
            assert (g, (("model_name", srv.name),)) in m, "no %s{model_name=%s}" % (g, srv.name)
        st = requests.get(srv.url + "/v1/k3/status", headers=H, timeout=10).json()["now"]
        vals = {"running": metric(m, "vllm:num_requests_running", model_name=srv.name),
                "waiting": metric(m, "vllm:num_requests_waiting", model_name=srv.name),
                "kv_cache_usage_perc": metric(m, "vllm:kv_cache_usage_perc", model_name=srv.name),
                "status.running": st["running"], "status.waiting": st["waiting"]}
        if not any(vals.values()) or time.monotonic() - t0 > timeout:
            return vals
        time.sleep(0.2)


@pytest.mark.parametrize("budget", ["64", "128", "default"])
def test_storm(model_dir, budget):  # noqa: F811
    # --read-timeout 2: a stream that waits longer than that for a token is what ASan's slowness
    # showed (MHD closed it, silently, after 30 s): the keep-alive comments must keep it open.
    # Under ASan on a loaded machine one engine step can pass 2 s: K3_STORM_READ_TIMEOUT=10 there.
    extra = ["--api-key", KEY, "--deterministic", "--served-model-name", "k3-tiny", "--read-timeout",
             os.environ.get("K3_STORM_READ_TIMEOUT", "2")]
    if budget != "default":
        extra += ["--prefix-cache-tokens", budget]
    srv = Server(model_dir, extra=extra)
    rng = random.Random(43 + len(budget))
    try:
        before = greedy(srv)
        t0 = time.monotonic()
        n_ok = n_cancel = 0
        for rnd in range(ROUNDS):
            res = []
            ts = [threading.Thread(target=stream, args=(srv, random.Random(rng.random()), res)) for _ in range(STREAMS)]
            ts += [threading.Thread(target=drop_mid_body, args=(srv, random.Random(rng.random())))
                   for _ in range(STREAMS // 3)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            bad = [why for k, why in res if k == "bad"]
            n_ok += sum(k == "ok" for k, _ in res)
            n_cancel += sum(k == "cancelled" for k, _ in res)
            assert srv.proc.poll() is None, "round %d: the server died:\n%s" % (rnd, srv.text()[-3000:])
            assert not bad, "round %d: %d bad streams, e.g. %s\n%s" % (rnd, len(bad), bad[:3], srv.text()[-2000:])
            print("round %d: %.1f s" % (rnd, time.monotonic() - t0))
        print("storm (budget %s): %d rounds in %.1f s: %d streams ended with [DONE], %d cancelled" %
              (budget, ROUNDS, time.monotonic() - t0, n_ok, n_cancel))
        left = idle(srv)
        print("after the storm:", left)
        assert not any(left.values()), "counters not back at 0: %s" % left
        after = greedy(srv)
        diff = [(i, a, b) for i, (a, b) in enumerate(zip(before, after)) if a != b]
        assert not diff, "%d of 20 greedy outputs changed, e.g. %s" % (len(diff), diff[:3])
    finally:
        rc = srv.stop()
        log = srv.text()
        assert rc == 0, "exit %s:\n%s" % (rc, log[-3000:])
        assert "AddressSanitizer" not in log and "runtime error" not in log and "LeakSanitizer" not in log, log[-3000:]
