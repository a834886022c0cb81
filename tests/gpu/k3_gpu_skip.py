"""k3_gpu_skip.py — whether this k3 can run the gpu tests (standard library only).

`usable_reason(k3, nccl)` returns None when `k3 version` lists cuda among the backends usable here
(and, with nccl=True, nccl among the transports compiled), else the reason to print before exiting
77 (ctest's SKIP_RETURN_CODE). Read from the lines themselves: "cuda: not compiled in" elsewhere
in the text must not count as a cuda backend.
"""
import subprocess


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
