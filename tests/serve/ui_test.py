"""ui_test.py — the page `k3 serve` shows at / (server/ui/index.html), in a real headless Chromium.

Starts a 2 x 2 `k3 serve` on the tiny model under mpirun, with --api-key and --allowed-origins,
and Debian's chromium driven through the DevTools protocol over --remote-debugging-pipe (standard
library only: no WebDriver, no websocket package). Checks: / and /ui load without the key; the
page asks for the key (the status endpoint answers 401 without it), takes it once and keeps it
across a reload; the rank table shows the 4 ranks (stages x lanes, every one healthy); after a
few requests the generated-tok/s chart has points above its zero line, and /v1/k3/status holds
together (ranks, memory, ordered percentiles, counters equal to /metrics); a chat sent through
the playground streams (several chunks, then [DONE]) into reasoning_content with thinking on and
into content with it off.

Chromium: installed here from Debian's packages when missing and running as root (as
tests/slurm/slurm_test.sh does with its packages); otherwise skipped (exit 77) with the reason,
except under CI=true, where a missing browser fails the test.
Environment: K3_BIN (the k3 binary), K3_MPIEXEC (mpirun).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import requests

K3 = os.environ.get("K3_BIN", "k3")
MPI = os.environ.get("K3_MPIEXEC", "mpirun")
KEY = "sk-k3-ui-key"
ORIGIN = "http://example.test"


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing chromium (Debian)", flush=True)
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=600", "update", "-q"],
                       stdout=subprocess.DEVNULL, check=False)
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-q",
                        "chromium"], stdout=subprocess.DEVNULL, check=False,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        return shutil.which("chromium")
    return None


def skip(reason):
    if os.environ.get("CI", "").lower() == "true":
        print("FAIL ui_test: cannot run under CI=true: " + reason, file=sys.stderr, flush=True)
        sys.exit(1)
    print("SKIPPED ui_test: " + reason + " (this test did NOT run)", file=sys.stderr, flush=True)
    sys.exit(77)


class Browser:
    """Headless Chromium; CDP messages are NUL-terminated JSON on fds 3 (in) and 4 (out)."""

    def __init__(self, exe):
        self.dir = tempfile.mkdtemp(prefix="k3_ui_chromium_")
        to_r, to_w = os.pipe()      # we write commands, chromium reads fd 3
        from_r, from_w = os.pipe()  # chromium writes fd 4, we read

        def fds():
            os.dup2(to_r, 3)
            os.dup2(from_w, 4)

        args = [exe, "--headless=new", "--remote-debugging-pipe", "--no-sandbox",
                "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions",
                "--user-data-dir=" + self.dir, "about:blank"]
        # close_fds off: Python would close fds 3 and 4 after preexec_fn made them
        self.proc = subprocess.Popen(args, preexec_fn=fds, close_fds=False,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self.w, self.r = os.fdopen(to_w, "wb"), os.fdopen(from_r, "rb")
        self.buf, self.n = b"", 0
        t = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=t, flatten=True)["sessionId"]

    def call(self, method, session=None, **params):
        self.n += 1
        msg = {"id": self.n, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        self.w.write(json.dumps(msg).encode() + b"\0")
        self.w.flush()
        while True:
            while b"\0" not in self.buf:
                chunk = os.read(self.r.fileno(), 65536)
                assert chunk, "chromium closed its DevTools pipe"
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            m = json.loads(raw)
            if m.get("id") == self.n:
                assert "error" not in m, "%s: %s" % (method, m["error"])
                return m["result"]

    def js(self, expr):
        """The value of a JavaScript expression in the page (promises awaited)."""
        r = self.call("Runtime.evaluate", self.session, expression=expr, returnByValue=True,
                      awaitPromise=True)
        assert "exceptionDetails" not in r, "%s: %s" % (expr, r["exceptionDetails"])
        return r["result"].get("value")

    def goto(self, url):
        self.call("Page.navigate", self.session, url=url)

    def wait(self, expr, timeout, what):
        t0 = time.time()
        while time.time() - t0 < timeout:
            try:
                if self.js(expr):
                    return
            except AssertionError:
                pass  # the page is still loading
            time.sleep(0.2)
        raise AssertionError("timed out (%d s) waiting for %s; page text:\n%s"
                             % (timeout, what, self.js("document.body ? document.body.innerText : ''")))

    def close(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_server(model):
    log = tempfile.NamedTemporaryFile(prefix="k3_ui_serve_", suffix=".txt", delete=False)
    cmd = [MPI, "-np", "4", "--oversubscribe", K3, "serve", "--model", model, "--port", "0",
           "--threads", "1", "--pp", "2", "--ep", "2", "--max-seqs", "4", "--api-key", KEY,
           "--allowed-origins", ORIGIN, "--served-model-name", "k3-tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    t0 = time.time()
    while time.time() - t0 < 60 and proc.poll() is None:
        with open(log.name, errors="replace") as f:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+) .*pid (\d+)\)", f.read())
        if m:
            return proc, log.name, int(m.group(1)), int(m.group(2))
        time.sleep(0.1)
    with open(log.name, errors="replace") as f:
        raise AssertionError("the server did not start:\n" + f.read()[-3000:])


def load(url, stop):
    """Chat requests, one after another, until stop is set."""
    h = {"Authorization": "Bearer " + KEY}
    body = {"model": "k3-tiny", "max_tokens": 12, "messages": [{"role": "user", "content": "hi"}]}
    while not stop.is_set():
        r = requests.post(url + "/v1/chat/completions", json=body, headers=h, timeout=30)
        assert r.status_code == 200, r.text


def check_status(url):
    """GET /v1/k3/status after the load: the cluster, and a history whose numbers hold together."""
    h = {"Authorization": "Bearer " + KEY}
    # a request's TTFT joins the histograms when it ends: the sample after the last one holds it
    t0 = time.time()
    while True:
        st = requests.get(url + "/v1/k3/status", headers=h, timeout=10).json()
        if any(v is not None for v in st["history"]["ttft_p50"]) or time.time() - t0 > 5:
            break
        time.sleep(0.25)
    c = st["cluster"]
    assert (c["world"], c["pp"], c["ep"], c["backend"], c["comm"]) == (4, 2, 2, "cpu", "mpi"), c
    assert sorted((r["stage"], r["lane"]) for r in c["ranks"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in c["ranks"]:
        m = r["memory"]
        assert r["health"] == "ok" and 0 <= r["silent_s"] < 5, r
        assert m["planned"] == m["weights"] + m["caches"] + m["buffers"] + m["workspace"] > 0, r
    assert c["ranks"][0]["memory"]["rss"] > 0
    hist = st["history"]
    n = len(hist["t"])
    assert n >= 2 and all(len(v) == n for k, v in hist.items() if isinstance(v, list)), hist
    assert hist["t"] == sorted(hist["t"])
    assert max(hist["tok_s"]) > 0 and min(hist["tok_s"]) >= 0
    for m in ("ttft", "itl"):
        seen = 0
        for a, b_, c_ in zip(*(hist["%s_p%s" % (m, q)] for q in ("50", "90", "99"))):
            if a is not None:
                assert 0 < a <= b_ <= c_, (m, a, b_, c_)
                seen += 1
        assert seen, "no %s percentiles in the history" % m
    assert all(0 <= v <= 1 for v in hist["kv_cache_usage"] + hist["prefix_cache_usage"])
    # the counters agree with /metrics (the same books)
    met = requests.get(url + "/metrics", timeout=10).text
    done = sum(float(x) for x in re.findall(
        r'vllm:request_success_total\{[^}]*finished_reason="(?:stop|length)"\} (\S+)', met))
    assert st["now"]["requests_completed"] == done > 0, (st["now"], done)


def main():
    exe = find_chromium()
    if not exe:
        skip("no chromium (apt-get install chromium, as root)")
    t_start = time.time()
    d = tempfile.mkdtemp(prefix="k3_ui_")
    model = os.path.join(d, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True, timeout=120)
    proc, log, port, pid = start_server(model)
    url = "http://127.0.0.1:%d" % port
    b = None
    try:
        # the page itself needs no key; its data does
        for path in ("/", "/ui"):
            r = requests.get(url + path, timeout=10)
            assert r.status_code == 200 and "text/html" in r.headers["Content-Type"], (path, r)
            assert "/v1/k3/status" in r.text and "<script>" in r.text
            assert not re.search(r"<script[^>]+src=|<link[^>]+href=\"?https?:", r.text), \
                "the page must load nothing from outside"
        assert requests.get(url + "/v1/k3/status", timeout=10).status_code == 401
        # CORS as the other routes: an allowed origin is echoed
        r = requests.get(url + "/v1/k3/status", headers={"Origin": ORIGIN,
                         "Authorization": "Bearer " + KEY}, timeout=10)
        assert r.status_code == 200 and r.headers.get("Access-Control-Allow-Origin") == ORIGIN
        b = Browser(exe)
        b.call("Page.enable", b.session)
        b.goto(url + "/")
        b.wait("getComputedStyle(document.getElementById('keybox')).display === 'block'", 15,
               "the page to ask for the API key")
        b.js("document.getElementById('key').value = %s; document.getElementById('key-save').click(); 1"
             % json.dumps(KEY))
        b.wait("document.querySelectorAll('#ranks tbody tr').length === 4", 15, "4 rank rows")
        rows = b.js("[...document.querySelectorAll('#ranks tbody tr')].map(r => [...r.cells].map(c => c.textContent))")
        assert [r[0] for r in rows] == ["0", "1", "2", "3"], rows
        assert sorted((r[2], r[3]) for r in rows) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], rows
        assert all(r[6] == "ok" for r in rows), rows
        assert b.js("document.querySelectorAll('#grid td.ok').length") == 4
        # asked once: a reload keeps the key
        b.goto(url + "/ui")
        b.wait("document.querySelectorAll('#ranks tbody tr').length === 4", 15, "4 rank rows after a reload")
        assert b.js("getComputedStyle(document.getElementById('keybox')).display") == "none"
        # a few requests: the tok/s chart gets points above its zero line (y < 134 in the view box)
        stop = threading.Event()
        th = threading.Thread(target=load, args=(url, stop))
        th.start()
        try:
            b.wait("(() => { const p = document.querySelector('#chart-toks polyline');"
                   " if (!p) return false; const ys = p.getAttribute('points').split(' ')"
                   ".map(s => +s.split(',')[1]); return ys.length >= 2 && Math.min(...ys) < 134; })()",
                   20, "a tok/s chart with points above zero")
        finally:
            stop.set()
            th.join()
        n_pts = b.js("document.querySelector('#chart-toks polyline').getAttribute('points').split(' ').length")
        assert n_pts >= 2, n_pts
        check_status(url)
        # the playground: one streamed chat with thinking on (the tiny model never closes its
        # thinking: every token is reasoning_content), then one with it off (all content)
        got = {}
        for think in (True, False):
            b.js("document.getElementById('pg-status').dataset.done = '';"
                 "document.getElementById('pg-thinking').checked = %s;"
                 "document.getElementById('pg-max').value = 24;"
                 "document.getElementById('pg-send').click(); 1" % ("true" if think else "false"))
            b.wait("document.getElementById('pg-status').dataset.done === '1'", 20,
                   "the playground's [DONE]")
            got[think] = b.js("({r: document.getElementById('pg-reasoning').textContent,"
                              " c: document.getElementById('pg-content').textContent,"
                              " s: document.getElementById('pg-status').textContent})")
        assert got[True]["r"] and not got[True]["c"], got
        assert got[False]["c"] and not got[False]["r"], got
        n_chunks = int(re.search(r"\((\d+) chunks", got[True]["s"]).group(1))
        assert n_chunks >= 2, got  # streamed, not one answer
        got = got[True]
        print("ui_test: 4 ranks, %d chart points, playground %d chunks (%d + %d chars), %.1f s"
              % (n_pts, n_chunks, len(got["r"]), len(got["c"]), time.time() - t_start))
    finally:
        if b:
            b.close()
        if proc.poll() is None:
            os.kill(pid, 15)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "hung"
        with open(log, errors="replace") as f:
            text = f.read()
        os.unlink(log)
        shutil.rmtree(d, ignore_errors=True)
    assert rc == 0, "shutdown: exit %s\n%s" % (rc, text[-2000:])


if __name__ == "__main__":
    main()
