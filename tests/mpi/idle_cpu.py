#!/usr/bin/env python3
"""idle_cpu.py — an idle `k3 serve` gives its cores back (issue 46): 4 ranks (2 x 2) on this
machine, listening with no request, use < 2% of one core in all over 10 s (mpirun included).

A waiting rank sleeps on its node's doorbell (comm/comm_bell.c) instead of polling: before, the
three workers polled every <= 500 us and the job used ~10% of a core doing nothing. The CPU time is
read from /proc (utime + stime of mpirun and every rank): it counts what the processes ran, not
wall time, so a loaded machine does not move it much. Then one request is answered, so the
sleeping ranks still wake for work.
usage: idle_cpu.py MPIEXEC   (K3_BIN = the k3 binary). Exit: 0 pass, 1 fail."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_check import check, verdict  # noqa: E402

K3 = os.environ["K3_BIN"]
MPI = sys.argv[1] if len(sys.argv) > 1 else "mpiexec"
WINDOW_S = 10.0
LIMIT = 0.02  # of one core, all processes together
HZ = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid):
    try:
        f = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])  # utime, stime
    except OSError:
        return 0


def children(pid):
    try:
        return [int(x) for x in open("/proc/%d/task/%d/children" % (pid, pid)).read().split()]
    except OSError:
        return []


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


with tempfile.TemporaryDirectory(prefix="k3_idle_") as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True, timeout=120)
    port = free_port()
    log = open(os.path.join(tmp, "log.txt"), "w+")
    p = subprocess.Popen([MPI, "-np", "4", "--oversubscribe", K3, "serve", "--model", model, "--pp", "2",
                          "--ep", "2", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
    try:
        t0, up = time.time(), False
        while time.time() - t0 < 120 and p.poll() is None and not up:
            time.sleep(0.2)
            log.seek(0)
            up = "listening" in log.read()
        check(up, "k3 serve 2 x 2 is listening")
        if up:
            time.sleep(2.0)  # past the start-up's own work
            pids = [p.pid] + children(p.pid)
            check(len(pids) == 5, "mpirun and 4 ranks (%s)" % pids)
            a = sum(cpu_ticks(x) for x in pids)
            w0 = time.time()
            time.sleep(WINDOW_S)
            b = sum(cpu_ticks(x) for x in pids)
            share = (b - a) / HZ / (time.time() - w0)
            check(share < LIMIT, "idle job used %.2f%% of a core over %.0f s (limit %.0f%%)"
                  % (100 * share, WINDOW_S, 100 * LIMIT))
            body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}).encode()
            req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, data=body,
                                         headers={"Content-Type": "application/json"})
            t1 = time.time()
            out = json.load(urllib.request.urlopen(req, timeout=60))
            check(out["usage"]["completion_tokens"] == 4,
                  "a request after the idle window is answered (%.2f s)" % (time.time() - t1))
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    log.seek(0)
    errors = [ln for ln in log.read().splitlines() if " E] " in ln]
    check(not errors, "no error lines in the job's log%s" % ("".join("\n  " + e for e in errors[:10])))
sys.exit(verdict("idle_cpu"))
