"""abandon_test.py — issue 43 against the live server on the tiny model: no single request can
kill or stall it, and nobody's abandoned work runs on.

  * a $ref chain of 60,000 in response_format: 400 in under a second, and the next request served;
  * a client that leaves during a slow grammar compile: the compile stops (the server's CPU goes
    idle within a second and a half);
  * 40 non-streamed requests closed with a FIN (what a client timeout does): cancelled within a
    second (their queue bytes and slots freed), so the next 4-token request is admitted and fast;
  * a request whose memory can never fit --max-queue-bytes: 413, not 429.
"""
import json
import socket
import threading
import time

import requests

from serve_test import KEY, Server, model_dir  # noqa: F401 (the fixture)

MSG = [{"role": "user", "content": "Name three colours."}]
H = {"Authorization": "Bearer " + KEY}


def cpu_s(pid):
    with open("/proc/%d/stat" % pid) as f:
        f = f.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / 100.0  # utime + stime, in clock ticks of 10 ms


def chat(srv, body, timeout=60):
    return requests.post(srv.url + "/v1/chat/completions", headers=H, timeout=timeout,
                         json=dict({"model": srv.name, "messages": MSG}, **body))


def ref_chain(n):
    defs = {"d%d" % i: {"$ref": "#/$defs/d%d" % (i + 1)} for i in range(n - 1)}
    defs["d%d" % (n - 1)] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_abandon_all(model_dir):  # noqa: F811
    srv = Server(model_dir, extra=["--api-key", KEY, "--max-seqs", "2", "--max-queue-bytes", str(1 << 22),
                                   "--grammar-budget", "120"])
    try:
        # one schema: a 400 at once, and the server goes on
        for key, body in (("response_format", {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": ref_chain(60000)}}}), ("guided_json", {"guided_json": ref_chain(60000)}),
                          ("tools", {"tool_choice": "required", "tools": [{"type": "function", "function": {
                              "name": "f", "parameters": ref_chain(60000)}}]})):
            data = json.dumps(dict({"model": srv.name, "messages": MSG, "max_tokens": 4}, **body))
            c0, t0 = cpu_s(srv.pid), time.monotonic()  # (the client's JSON encoding not timed)
            r = requests.post(srv.url + "/v1/chat/completions", timeout=60, data=data,
                              headers=dict(H, **{"Content-Type": "application/json"}))
            dt, dc = time.monotonic() - t0, cpu_s(srv.pid) - c0
            print("ref chain in %s: %d in %.2f s (%.2f CPU s): %s" % (key, r.status_code, dt, dc, r.text[:200]))
            # refused by the structural check before the prompt (which shows response_format's
            # schema) is rendered and tokenized: the 400 names $ref and the nesting budget. The
            # acceptance is < 1 s; the server's CPU is what this machine's load cannot inflate
            # (0.1-0.2 s; rendering and tokenizing it cost 0.8-2.3 s), the wall gets a margin
            assert r.status_code == 400 and dc < 1.0 and dt < 3.0
            assert "$ref" in r.text and "1000" in r.text and "nesting budget" in r.text
            assert chat(srv, {"max_tokens": 4}).status_code == 200

        # a slow compile whose client leaves: stopped within a second or so
        big = {"type": "object", "properties": {"p%d" % i: {"type": "string", "pattern": "^[a-z]{0,40}$"}
                                                for i in range(3000)}}
        body = json.dumps({"model": srv.name, "messages": MSG, "max_tokens": 4, "guided_json": big}).encode()
        ca = cpu_s(srv.pid)
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        t0 = time.monotonic()  # the compile is running (a FIN 0.5 s after the request is a close)
        while cpu_s(srv.pid) - ca < 0.15 and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        time.sleep(0.7)
        c0 = cpu_s(srv.pid)
        assert c0 - ca > 0.15, "the compile did not start (%.2f CPU s)" % (c0 - ca)
        s.close()
        time.sleep(1.0)
        c1 = cpu_s(srv.pid)
        time.sleep(1.5)
        c2 = cpu_s(srv.pid)
        print("compile: %.2f CPU s before the close; %.2f s in the 1.5 s after the first second" % (c0 - ca, c2 - c1))
        assert c2 - c1 < 0.1, "the compile went on after its client left"

        # 40 abandoned requests (FIN after 1 s): cancelled, and the next request is fast
        long = json.dumps({"model": srv.name, "messages": MSG, "max_tokens": 3000, "ignore_eos": True}).encode()
        socks = []

        def one():
            k = socket.create_connection(("127.0.0.1", srv.port))
            k.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                      b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(long) + long)
            socks.append(k)
        ts = [threading.Thread(target=one) for _ in range(40)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        time.sleep(1.0)  # (a FIN within 0.5 s of the request is a half-close: the answer is read)
        [k.close() for k in socks]
        time.sleep(1.0)  # noticed within a second: cancelled, their slots and queue bytes freed
        t1 = time.monotonic()
        r = chat(srv, {"max_tokens": 4, "ignore_eos": True})
        next_s = time.monotonic() - t1
        print("40 abandoned, 1 s later: the next request got %d in %.2f s" % (r.status_code, next_s))
        assert r.status_code == 200 and next_s < 1.0

        # never admissible: 413
        r = chat(srv, {"max_tokens": 3000, "n": 128, "logprobs": True, "top_logprobs": 20})
        print("n=128: %d %s" % (r.status_code, r.text[:160]))
        assert r.status_code == 413
    finally:
        assert srv.stop() == 0, srv.text()[-2000:]


def test_abandon_compile_beside_stream(model_dir):  # noqa: F811
    """A slow grammar compile (its request's own HTTP thread, never the step thread) in flight
    while another stream decodes: the stream's tokens keep coming (no gap of a second over the 2 s
    compile; it would be one 2 s gap if the compile ran on the step thread or held a lock a step
    needs). A parse runs at nice 10, so the engine's steps come first for the CPU."""
    srv = Server(model_dir, extra=["--api-key", KEY, "--grammar-budget", "2", "--max-ctx", "32768"])
    try:
        big = {"type": "object", "properties": {"p%d" % i: {"type": "string", "pattern": "^[a-z]{0,40}$"}
                                                for i in range(2200)}}
        stamps, result = [], {}
        t_compile = [None, None]

        def streamer():
            r = requests.post(srv.url + "/v1/chat/completions", headers=H, stream=True, timeout=120, json={
                "model": srv.name, "messages": MSG, "max_tokens": 30000, "ignore_eos": True, "stream": True})
            for ln in r.iter_lines():
                if ln.startswith(b"data: {"):
                    stamps.append(time.monotonic())

        def compiler():
            t_compile[0] = time.monotonic()
            r = chat(srv, {"max_tokens": 2, "guided_json": big}, timeout=120)
            t_compile[1] = time.monotonic()
            result["status"], result["text"] = r.status_code, r.text[:200]

        ts = threading.Thread(target=streamer)
        ts.start()
        t0 = time.monotonic()
        while (len(stamps) < 40 or time.monotonic() - stamps[0] < 2.5) and time.monotonic() - t0 < 60:
            time.sleep(0.05)  # the stream at its steady pace (2.5 s after its first token)
        tc = threading.Thread(target=compiler)
        tc.start()
        tc.join()
        ts.join()

        def rate(a, b):
            return sum(a <= x <= b for x in stamps) / (b - a)
        during = [x for x in stamps if t_compile[0] <= x <= t_compile[1]]
        gap = max((y - x for x, y in zip(during, during[1:])), default=float("inf"))
        r0, r1 = rate(t_compile[0] - 1.5, t_compile[0]), rate(t_compile[0], t_compile[1])
        print("compile: %d in %.2f s (%s); the stream: %.0f tokens/s before, %.0f during, longest gap "
              "%.0f ms" % (result["status"], t_compile[1] - t_compile[0], result["text"][:90], r0, r1, gap * 1e3))
        assert result["status"] == 400 and "--grammar-budget" in result["text"]  # it ran its 2 s
        assert stamps[-1] > t_compile[1], "the stream ended before the compile did"
        # (the rates are printed, not compared: on 2 loaded cores they vary 10x from run to run)
        # A stream that waits for the compile shows one gap of the whole compile (its 2 s budget,
        # wall clock); a stream beside it had gaps of 15-85 ms here, and 1.42 s once with two test
        # suites on these 2 cores: the limit sits between (the gap is measured, never the rate)
        assert gap < 0.75 * (t_compile[1] - t_compile[0]) and len(during) >= 20, \
            "the stream stalled during the compile"
    finally:
        assert srv.stop() == 0, srv.text()[-2000:]


def test_abandon_slowloris_addresses(model_dir):  # noqa: F811
    """1,100 slow connections (headers that never end) from 3 addresses: /health from a 4th
    answers 15 of 15 (the last connections of the cap are kept for new addresses)."""
    srv = Server(model_dir, extra=["--api-key", KEY, "--read-timeout", "60"])
    held = []
    try:
        for i in range(1100):
            s = socket.socket()
            s.settimeout(5)
            try:
                s.bind(("127.0.0.%d" % (2 + i % 3), 0))
                s.connect(("127.0.0.1", srv.port))
                s.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                pass
            held.append(s)
        time.sleep(0.5)
        ok = 0
        for _ in range(15):
            s = socket.socket()
            s.settimeout(3)
            out = b""
            try:
                s.bind(("127.0.0.5", 0))
                s.connect(("127.0.0.1", srv.port))
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                while True:
                    b = s.recv(65536)
                    if not b:
                        break
                    out += b
            except OSError:
                pass
            s.close()
            ok += out.startswith(b"HTTP/1.1 200")
        print("/health from a 4th address during 1,100 slow connections from 3: %d of 15" % ok)
        assert ok == 15
    finally:
        for s in held:
            s.close()
        assert srv.stop() == 0, srv.text()[-2000:]


def test_abandon_truncated_mapped_shard(model_dir, tmp_path):  # noqa: F811
    """A shard truncated after a --load-mmap load: the rank's one line names the file and the
    offset, and it exits 1 (a fault, not a SIGBUS death with a core)."""
    import glob
    import shutil
    d = str(tmp_path / "tiny")
    shutil.copytree(model_dir, d)
    srv = Server(d, extra=["--api-key", KEY, "--load-mmap"])
    for f in glob.glob(d + "/*.safetensors"):
        with open(f, "r+b") as h:
            h.truncate(4096)
    try:
        chat(srv, {"max_tokens": 4}, timeout=20)
    except requests.RequestException:
        pass
    rc = srv.proc.wait(timeout=30)
    log = srv.text()
    print("exit %s; %s" % (rc, [x for x in log.splitlines() if "SIGBUS" in x]))
    assert rc == 1 and "SIGBUS reading the mapped checkpoint shard " + d in log and " at byte " in log


def test_ranklost_every_client_told(model_dir):  # noqa: F811
    """SIGKILL of a worker under serve on 2 x 2 with 6 streams and 2 plain requests in flight:
    rank 0 answers every open request with an error (503 body, or an SSE error event) before
    mpirun ends it, and a request sent after the kill gets a 503 or is refused (never hangs).
    Open MPI's SIGTERM-to-SIGKILL period is set to 5 s, as slurm/site.env sets it."""
    import os
    import signal as sg
    srv = Server(model_dir, pp=2, ep=2, extra=["--api-key", KEY], env={"OMPI_MCA_odls_base_sigkill_timeout": "5"})
    results = {}

    def stream(i):
        try:
            with requests.post(srv.url + "/v1/chat/completions", headers=H, stream=True, timeout=30,
                               json={"model": srv.name, "messages": MSG, "max_tokens": 3000,
                                     "ignore_eos": True, "stream": True}) as r:
                text = ""
                for chunk in r.iter_content(None):
                    text += chunk.decode(errors="replace")
                results[i] = "error" if '"error"' in text else "eof"
        except requests.RequestException as e:
            results[i] = "exc %s" % type(e).__name__

    def plain(i):
        try:
            r = chat(srv, {"max_tokens": 3000, "ignore_eos": True}, timeout=30)
            results[i] = "error" if r.status_code >= 500 and '"error"' in r.text else "status %d" % r.status_code
        except requests.RequestException as e:
            results[i] = "exc %s" % type(e).__name__
    ts = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    ts += [threading.Thread(target=plain, args=(i,)) for i in range(6, 8)]
    [t.start() for t in ts]
    time.sleep(2.0)
    me = os.getpid()
    workers = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) in (srv.pid, me):
            continue
        try:
            cmd = open("/proc/%s/cmdline" % p, "rb").read().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"/k3") and b"serve" in cmd and model_dir.encode() in cmd:
            workers.append(int(p))
    assert workers, "no worker rank found"
    os.kill(workers[0], sg.SIGKILL)
    time.sleep(0.3)
    try:
        r = chat(srv, {"max_tokens": 4}, timeout=10)
        results[8] = "error" if r.status_code == 503 else "status %d" % r.status_code
    except requests.RequestException as e:
        results[8] = "refused %s" % type(e).__name__
    [t.join(timeout=40) for t in ts]
    srv.proc.wait(timeout=60)
    told = sum(1 for v in results.values() if v == "error")
    print("SIGKILL of rank pid %d: %d of 9 clients got an error body: %s" % (workers[0], told, results))
    # every request open at the kill is told; the one sent after it gets a 503 or is refused
    assert all(results.get(i) == "error" for i in range(8)), "%s\n%s" % (results, srv.text()[-1500:])
    assert results[8] == "error" or results[8].startswith("refused"), results
