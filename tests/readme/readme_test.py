#!/usr/bin/env python3
"""readme_test.py — every code block of README.md, run in order as printed, exits 0 (issue 48).

The blocks run with bash (-e -o pipefail) in a scratch folder that holds what the repository root
holds for them: build/ (the folder of $K3_BIN), examples/, scripts/ and slurm/ as links; the
tiny model is made there by the first block. Open MPI's root and oversubscription variables that
the other tests set are removed, so the mpirun lines must carry their flags themselves (the
README says they work as root and with fewer cores than ranks). Port 8000 is replaced by a free
port, so that tests running at the same time do not collide. A block after a line
`<!-- readme-test: skip: REASON -->` is not run (the README's Quick start is the demo and this
suite themselves; the Slurm block needs a cluster, and tests/slurm submits the same scripts under a
real Slurm). Each block runs in its own process group, killed at its end (a server it left behind
cannot outlive it), with a time limit.

Env: K3_BIN, K3_SRC; K3_README (default $K3_SRC/README.md). Exit 0 pass, 1 fail, 77 skip (the
openai package is missing from this python: the serve block uses it)."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

SRC = os.environ["K3_SRC"]
BIN = os.environ["K3_BIN"]
README = os.environ.get("K3_README", os.path.join(SRC, "README.md"))
LIMIT_S = 240


def blocks(text):
    """(line number, code, skip reason or None) of every ```sh block."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        if lines[i].strip() in ("```sh", "```bash"):
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            m = re.match(r"\s*<!-- readme-test: skip: (.*) -->", prev)
            out.append((i + 1, "\n".join(lines[i + 1:j]), m.group(1) if m else None))
            i = j
        i += 1
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    try:
        import openai  # noqa: F401  (the serve block's SDK call)
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":  # a skip must not hide the blocks in CI
            print("readme: FAIL: cannot run under CI=true: the openai package is not installed for",
                  sys.executable)
            return 1
        print("readme: SKIP: the openai package is not installed for", sys.executable,
              "(this test did NOT run)")
        return 77
    text = open(README).read()
    found = blocks(text)
    if not found:
        print("readme: FAIL: no ```sh blocks in", README)
        return 1
    work = tempfile.mkdtemp(prefix="k3-readme-")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
                        "OMPI_MCA_rmaps_base_oversubscribe")}
    # `python3` and `pip` of the block are this python's (the test references' environment)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_ROOT_USER_ACTION"] = "ignore"
    port = str(free_port())
    fails = ran = 0
    try:
        os.symlink(os.path.dirname(os.path.abspath(BIN)), os.path.join(work, "build"))
        for d in ("examples", "scripts", "slurm"):
            os.symlink(os.path.join(SRC, d), os.path.join(work, d))
        for line, code, skip in found:
            if skip:
                print(f"readme: block at line {line}: not run ({skip})")
                continue
            code = re.sub(r"\b8000\b", port, code)
            p = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", code], cwd=work, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
            try:
                out, _ = p.communicate(timeout=LIMIT_S)
                rc = p.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
                os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
            try:
                os.killpg(p.pid, signal.SIGKILL)  # anything the block left running
            except ProcessLookupError:
                pass
            ran += 1
            if rc != 0:
                fails += 1
                print(f"readme: FAIL: block at line {line} exited {rc}:\n{code}\n--- output (tail):")
                print("\n".join(out.splitlines()[-25:]))
            else:
                print(f"readme: block at line {line}: exit 0")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"readme: {ran - fails} of {ran} blocks ran and exited 0, {len(found) - ran} not run")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
