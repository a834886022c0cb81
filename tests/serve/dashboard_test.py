"""dashboard_test.py — every panel query of vLLM's Grafana dashboard returns data from `k3 serve`'s
/metrics after some traffic (owner: serve; issue 47).

Run by ctest through pytest (tests/serve/tests.cmake):  python3 -m pytest dashboard_test.py -k d1x1
The queries are the `expr` of every target of the 12 panels of vLLM's dashboard
(examples/online_serving/prometheus_grafana/grafana.json in vllm-project/vllm, commit 004f771f),
written here as they stand. A small PromQL evaluator (the subset those queries use: selectors
with label matchers and a range, rate, increase, sum by, histogram_quantile, `/`) runs them over
two scrapes taken before and after the traffic: rate = the increase over the seconds between
them. A query returns data when its result vector is not empty and every value is a number
(not NaN: a histogram_quantile or a ratio over a histogram that saw nothing is NaN, and Grafana
draws nothing). The scrapes go through prometheus_client's parser.
"""
import math
import os
import re
import sys
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_test import KEY, MSG, Server, model_dir  # noqa: E402,F401 (model_dir: a fixture)

NAME = "k3-tiny"
RI = "$__rate_interval"
Q = "{model_name=\"$model_name\"}"

PANELS = {
    "E2E Request Latency": [
        "histogram_quantile(%s, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket%s[%s])))"
        % (p, Q, RI) for p in ("0.99", "0.95", "0.9", "0.5")] + [
        "rate(vllm:e2e_request_latency_seconds_sum%s[%s])\n/\n"
        "rate(vllm:e2e_request_latency_seconds_count%s[%s])" % (Q, RI, Q, RI)],
    "Token Throughput": [
        "rate(vllm:prompt_tokens_total%s[%s])" % (Q, RI),
        "rate(vllm:generation_tokens_total%s[%s])" % (Q, RI)],
    "Time Per Output Token Latency": [
        "histogram_quantile(%s, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket%s[%s])))"
        % (p, Q, RI) for p in ("0.99", "0.95", "0.9", "0.5")] + [
        "rate(vllm:time_per_output_token_seconds_sum%s[%s])\n/\n"
        "rate(vllm:time_per_output_token_seconds_count%s[%s])" % (Q, RI, Q, RI)],
    "Scheduler State": [
        "vllm:num_requests_running%s" % Q,
        "vllm:num_requests_waiting%s" % Q],
    "Time To First Token Latency": [
        "histogram_quantile(%s, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket%s[%s])))"
        % (p, Q, RI) for p in ("0.99", "0.95", "0.9", "0.5")] + [
        "rate(vllm:time_to_first_token_seconds_sum%s[%s])\n/\n"
        "rate(vllm:time_to_first_token_seconds_count%s[%s])" % (Q, RI, Q, RI)],
    "Cache Utilization": ["vllm:gpu_cache_usage_perc%s" % Q],
    "Request Prompt Length": [
        "sum by(le) (increase(vllm:request_prompt_tokens_bucket%s[%s]))" % (Q, RI)],
    "Request Generation Length": [
        "sum by(le) (increase(vllm:request_generation_tokens_bucket%s[%s]))" % (Q, RI)],
    "Finish Reason": [
        "sum by(finished_reason) (increase(vllm:request_success_total%s[%s]))" % (Q, RI)],
    "Queue Time": ["rate(vllm:request_queue_time_seconds_sum%s[%s])" % (Q, RI)],
    "Requests Prefill and Decode Time": [
        "rate(vllm:request_prefill_time_seconds_sum%s[%s])" % (Q, RI),
        "rate(vllm:request_decode_time_seconds_sum%s[%s])" % (Q, RI)],
    "Max Generation Token in Sequence Group": [
        "rate(vllm:request_max_num_generation_tokens_sum%s[%s])" % (Q, RI)],
}


# ---- a PromQL subset ------------------------------------------------------------------------
def scrape(url):
    text = requests.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out, time.time()


TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)|(?P<str>\"[^\"]*\")"
                   r"|(?P<range>\[[^\]]+\])|(?P<op>[(){},=/]))")


def tokens(expr):
    pos, out = 0, []
    expr = expr.strip()
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        assert m, "cannot read %r at %d" % (expr, pos)
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(expr) and expr[pos].isspace():
            pos += 1
    return out


class Eval:
    """Instant vectors are {labels tuple: value}; a range selector is (samples now, samples
    before, seconds)."""

    def __init__(self, before, after, model):
        (self.b, tb), (self.a, ta) = before, after
        self.dt = ta - tb
        self.vars = {"$model_name": model}

    def run(self, expr):
        self.t, self.i = tokens(expr), 0
        v = self.binary()
        assert self.i == len(self.t), "trailing tokens in %r" % expr
        return v

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else (None, None)

    def take(self, want=None):
        k, v = self.t[self.i]
        assert want is None or v == want, "expected %r, got %r" % (want, v)
        self.i += 1
        return v

    def binary(self):
        left = self.unary()
        while self.peek()[1] == "/":
            self.take("/")
            right = self.unary()
            left = {k: (left[k] / right[k] if right[k] else math.nan) for k in left if k in right}
        return left

    def unary(self):
        kind, v = self.peek()
        if kind == "num":
            return float(self.take())
        name = self.take()
        if name == "sum":
            self.take("by")
            self.take("(")
            by = [self.take()]
            while self.peek()[1] == ",":
                self.take(",")
                by.append(self.take())
            self.take(")")
            self.take("(")
            inner = self.binary()
            self.take(")")
            out = {}
            for labels, x in inner.items():
                key = tuple((k, v) for k, v in labels if k in by)
                out[key] = out.get(key, 0.0) + x
            return out
        if name in ("rate", "increase"):
            self.take("(")
            now, then = self.selector(self.take(), ranged=True)
            self.take(")")
            inc = {k: now[k] - then.get(k, 0.0) for k in now}
            return inc if name == "increase" else {k: x / self.dt for k, x in inc.items()}
        if name == "histogram_quantile":
            self.take("(")
            q = self.unary()
            self.take(",")
            buckets = self.binary()
            self.take(")")
            return quantile(q, buckets)
        return self.selector(name, ranged=False)

    def selector(self, name, ranged):
        want = {}
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                k = self.take()
                self.take("=")
                want[k] = self.vars.get(self.take()[1:-1], None) or self.t[self.i - 1][1][1:-1]
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        if self.peek()[0] == "range":
            self.take()
        else:
            assert not ranged, "rate/increase need a range selector"

        def pick(samples):
            return {labels: v for (n, labels), v in samples.items()
                    if n == name and all(dict(labels).get(k) == x for k, x in want.items())}
        return (pick(self.a), pick(self.b)) if ranged else pick(self.a)


def quantile(q, buckets):
    """Prometheus' histogram_quantile over one set of cumulative `le` buckets (grouped by le)."""
    rows = sorted((float(dict(k)["le"]), v) for k, v in buckets.items())
    if not rows:
        return {}
    total = rows[-1][1]
    if total == 0 or math.isnan(total):
        return {(): math.nan}
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in rows:
        if c >= rank:
            if math.isinf(le):
                return {(): prev_le}
            return {(): prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)}
        prev_le, prev_c = le, c
    return {(): rows[-2][0]}


# ---- the test --------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["d1x1"])
def srv(request, model_dir):
    s = Server(model_dir, 1, 1, extra=["--api-key", KEY, "--max-seqs", "4",
                                       "--served-model-name", NAME])
    yield s
    assert s.stop() == 0, s.text()[-2000:]


def test_every_panel_returns_data(srv):
    assert sum(len(q) for q in PANELS.values()) == 27 and len(PANELS) == 12
    before = scrape(srv.url)
    time.sleep(0.2)
    c = srv.client()
    for i in range(3):
        c.chat.completions.create(model=NAME, messages=MSG, max_tokens=6 + i, seed=i)
        c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=5, n=2, seed=i)
        list(c.chat.completions.create(model=NAME, messages=MSG, max_tokens=4, stream=True))
    # the per-request histograms are written when the response has ended on the server's side
    # (its HTTP thread lets go of the request), a moment after the client has read it
    t0 = time.time()
    while True:
        after = scrape(srv.url)
        ev = Eval(before, after, NAME)
        n = ev.run("increase(vllm:request_params_n_count{model_name=\"k3-tiny\"}[1m])")
        if list(n.values()) == [9.0] or time.time() - t0 > 5:
            break
        time.sleep(0.05)
    empty = []
    for title, queries in PANELS.items():
        for q in queries:
            v = ev.run(q)
            if not v or any(math.isnan(x) for x in v.values()):
                empty.append((title, q, v))
    for e in empty:
        print("no data:", e)
    assert not empty, "%d of 27 panel queries return no data" % len(empty)
    # the count histograms hold what the traffic made: 9 requests, 12 choices
    assert ev.run("sum by(le) (increase(vllm:request_params_n_bucket{model_name=\"k3-tiny\"}[1m]))")
    n = ev.run("increase(vllm:request_params_n_count{model_name=\"k3-tiny\"}[1m])")
    g = ev.run("increase(vllm:request_generation_tokens_count{model_name=\"k3-tiny\"}[1m])")
    m = ev.run("increase(vllm:request_max_num_generation_tokens_sum{model_name=\"k3-tiny\"}[1m])")
    assert list(n.values()) == [9.0] and list(g.values()) == [12.0]
    assert list(m.values())[0] >= 3 * (6 + 5 + 1)
