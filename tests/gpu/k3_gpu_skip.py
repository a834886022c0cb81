"""k3_gpu_skip.py — whether this k3 can run the gpu tests, and their common start (standard
library only).

`usable_reason(k3, nccl)` returns None when `k3 version` lists cuda among the backends usable here
(and, with nccl=True, nccl among the transports compiled), else the reason to print before exiting
77 (ctest's SKIP_RETURN_CODE). Read from the lines themselves: "cuda: not compiled in" elsewhere
in the text must not count as a cuda backend. `run_on_tiny` is a test's whole frame: the gate, a
tiny model in a temp dir, the checks, the verdict line and the exit code.
"""
import os
import subprocess
import tempfile


def usable_reason(k3, nccl=False):
    v = subprocess.run([k3, "version"], capture_output=True, text=True).stdout
    lines = v.splitlines()
    usable = [l for l in lines if l.startswith("backends usable here:")]
    if not usable or "cuda" not in usable[0].split(":", 1)[1].split(";")[0].split():
        return "the cuda backend is not usable here: " + (usable[0] if usable else v.strip())
    comm = [l for l in lines if l.startswith("transports compiled:")]
    if nccl and (not comm or "nccl" not in comm[0].split(":", 1)[1].split()):
        return "this k3 has no nccl transport: " + (comm[0] if comm else v.strip())
    return None


def gate(k3, nccl=False):
    """The exit code a test returns before it starts (1: K3_BIN unset, 77: skipped), or None."""
    if not k3:
        print("FAIL: K3_BIN is not set")
        return 1
    why = usable_reason(k3, nccl)
    if why:
        print("SKIP: " + why)
        return 77
    return None


def make_tiny(k3, tmp, *args):
    """`k3 make-tiny` into tmp/tiny (args: its flags); returns the model's directory."""
    model = os.path.join(tmp, "tiny")
    subprocess.run([k3, "make-tiny", model, *args], check=True, capture_output=True)
    return model


def run_on_tiny(name, k3, body, fails, nccl=False, tiny_args=()):
    """A gpu test's frame: gate (1 or 77 before anything), then body(tmp, model) on a fresh tiny
    model (make_tiny with tiny_args) in a temp dir; prints `name: ok` or `name: FAIL (n)` and
    returns the exit code (fails: the list the test's checks append to)."""
    rc = gate(k3, nccl)
    if rc is not None:
        return rc
    with tempfile.TemporaryDirectory() as tmp:
        body(tmp, make_tiny(k3, tmp, *tiny_args))
    print("%s: %s" % (name, "FAIL (%d)" % len(fails) if fails else "ok"), flush=True)
    return 1 if fails else 0
