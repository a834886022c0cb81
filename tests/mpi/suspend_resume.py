#!/usr/bin/env python3
"""suspend_resume.py — a rank that was itself stopped blames nobody for the silence (issue 34,
finding 10: a resumed rank 1 blamed a healthy rank 0 for "no load progress").

The whole job is suspended during the load for longer than --comm-timeout, as a VM pause or a
`kill -STOP` of every rank does: rank 1 stops itself half-way through its load
(K3_TEST_FAIL=stall-load:1), the test then stops every other rank, waits 2 x --comm-timeout and
resumes them all. Every rank's own clock jumped past the timeout, so none may name another: the
load must go on and the run end with exit 0, with no "made no load progress" line. (Before, the
first rank to look blamed its peer for the time it had itself been stopped.)
usage: suspend_resume.py MPIEXEC   (K3_BIN = the k3 binary). Exit: 0 pass, 1 fail."""
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_check import check, verdict  # noqa: E402

K3 = os.environ["K3_BIN"]
MPI = sys.argv[1] if len(sys.argv) > 1 else "mpiexec"
TMO = 2.0


def state(pid):
    try:
        return open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


with tempfile.TemporaryDirectory(prefix="k3_suspend_") as tmp:
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True, timeout=120)
    log = open(os.path.join(tmp, "log.txt"), "w+")
    p = subprocess.Popen([MPI, "-np", "2", "--oversubscribe", K3, "run", "--model", model, "--pp", "2",
                          "--prompt-ids", "1,2,3", "--n", "4", "--threads", "1", "--comm-timeout", str(TMO)],
                         stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ, K3_TEST_FAIL="stall-load:1"))
    ranks, stopped = [], None
    t0 = time.time()
    while time.time() - t0 < 60 and p.poll() is None and stopped is None:
        try:
            ranks = [int(x) for x in open("/proc/%d/task/%d/children" % (p.pid, p.pid)).read().split()]
        except OSError:
            ranks = []
        stopped = next((r for r in ranks if state(r) == "T"), None)
        time.sleep(0.005)
    check(stopped is not None and len(ranks) == 2, "rank 1 stopped itself in its load (ranks %s)" % ranks)
    if stopped is not None:
        others = [r for r in ranks if r != stopped]
        for r in others:
            os.kill(r, signal.SIGSTOP)  # the rest of the job is suspended too
        time.sleep(2 * TMO)
        for r in others + [stopped]:
            os.kill(r, signal.SIGCONT)
    try:
        rc = p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = "hang"
    log.seek(0)
    err = log.read()
    check(rc == 0, "the job resumed and finished: exit %s\n%s" % (rc, err[-1500:]))
    check("made no load progress" not in err and "root cause" not in err,
          "nobody is blamed for the time it was itself stopped")
sys.exit(verdict("suspend_resume"))
