#!/usr/bin/env python3
"""chaos.py — one rank killed (SIGKILL) or stopped (SIGSTOP) in every phase and every role.

usage: chaos.py MPIEXEC [--only PHASE:ROLE]   (K3_BIN = the k3 binary; a tiny model is made here)

Grid: 6 ranks, --pp 3 --ep 2, shared coordinator. Roles (the rank signalled):
  coordinator  rank 0 (also stage 0, lane 0)
  first        rank 1 (stage 0, lane 1)
  middle       rank 2 (stage 1, lane 0)
  last         rank 5 (stage 2, lane 1)
Phases: load (half-way through the rank's weights), prefill (its first forward step), decode (its
12th step, after every prompt is in), batch (`k3 batch`, its 10th step). The signal is real: the
rank sends it to itself at that point (K3_TEST_FAIL=kill-load|stall-load|decode|stop), exactly as
`kill -9` / `kill -STOP` from outside would land there.

A case passes when, for both signals:
  - mpirun exits non-zero, and every process of the job is gone within --comm-timeout + 5 s of
    the signal (the hook's own log line marks the moment; nothing is left: pgrep);
  - a line names the signalled rank with its stage and lane as the cause: "root cause: rank R
    (stage s, lane l" (SIGSTOP: the ranks' agreed verdict), "rank R (stage s, lane l, ...)
    vanished" (SIGKILL: the survivors' SIGTERM handlers), or "rank R (stage s, lane l, host ...)
    made no load progress" (SIGSTOP during the load: the load heartbeat);
  - no line names another rank as the root cause.
Prints one line per case and "chaos: N/16 cases passed"; exit 0 only when 16/16.
A case's two jobs (SIGKILL, SIGSTOP) run at the same time, each on its own copy of the model (the
path is what `pgrep -f` finds a job's processes by): the SIGSTOP job spends its --comm-timeout
waiting, and k3's waits sleep (comm_sleep), so the SIGKILL job runs in that time.
"""
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

K3 = os.environ.get("K3_BIN")
TIMEOUT = 4  # --comm-timeout (s)
BOUND = TIMEOUT + 5  # every process gone within this many seconds of the signal
S, E = 3, 2
ROLES = {"coordinator": 0, "first": 1, "middle": 2, "last": 5}
PHASES = ["load", "prefill", "decode", "batch"]


def coords(rank):
    return rank // E, rank % E


def hook(phase, sig, rank):
    if phase == "load":
        return f"kill-load:{rank}" if sig == "KILL" else f"stall-load:{rank}"
    step = {"prefill": 1, "decode": 12, "batch": 10}[phase]
    return f"{'decode' if sig == 'KILL' else 'stop'}:{rank}:{step}"


def leftovers(marker):
    p = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return [x for x in p.stdout.split() if x.strip()]


def kill_all(marker):
    for pid in leftovers(marker):
        try:
            os.kill(int(pid), 9)
        except OSError:
            pass


def run_case(mpiexec, models, tmp, phase, role, sig):
    model = models[sig]
    rank = ROLES[role]
    st, ln = coords(rank)
    h = hook(phase, sig, rank)
    common = ["--model", model, "--pp", str(S), "--ep", str(E), "--comm-timeout", str(TIMEOUT)]
    if phase == "batch":
        inp, out = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, f"out-{role}-{sig}.jsonl")
        cmd = [mpiexec, "-np", str(S * E), "--oversubscribe", K3, "batch", "--input", inp, "--output", out]
    else:
        prompts = ";".join(",".join(str(1 + (i * 7 + j) % 500) for j in range(16)) for i in range(2))
        cmd = [mpiexec, "-np", str(S * E), "--oversubscribe", K3, "run", "--prompt-ids", prompts, "--n", "24",
               "--chunk", "8", "--ignore-eos"]
    env = dict(os.environ, K3_TEST_FAIL=h)
    t_start = time.monotonic()
    p = subprocess.Popen(cmd + common, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines, t_sig = [], [None]

    def reader():
        for line in p.stderr:
            lines.append(line.rstrip("\n"))
            if t_sig[0] is None and "test hook K3_TEST_FAIL" in line:
                t_sig[0] = time.monotonic()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        rc = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        kill_all(model)
        rc = None
    t_end = time.monotonic()
    th.join(timeout=5)
    # every process gone within BOUND of the signal: mpirun may return while the ranks it
    # killed are still exiting (seen once in CI, on a loaded 2-core box), so poll up to the bound
    deadline = (t_sig[0] if t_sig[0] is not None else t_end) + BOUND
    left = leftovers(model)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = leftovers(model)
    if left:
        kill_all(model)
    text = "\n".join(lines)
    errs = []
    if rc is None:
        errs.append("the job did not end within 60 s")
    elif rc == 0:
        errs.append("exit code 0")
    if t_sig[0] is None:
        errs.append("the hook never fired")
    elif t_end - t_sig[0] > BOUND:
        errs.append(f"ended {t_end - t_sig[0]:.1f} s after the signal (bound {BOUND} s)")
    if left:
        errs.append(f"processes left {BOUND} s after the signal: {left}")
    who = rf"rank {rank} \(stage {st}, lane {ln}\b"
    named = [x for x in lines if re.search(who, x) and
             ("root cause" in x or "vanished" in x or "made no load progress" in x)]
    if not named:
        errs.append(f"no line names rank {rank} (stage {st}, lane {ln}) as the cause")
    for x in lines:
        if "root cause" in x and not re.search(rf"root cause: rank {rank} \(", x):
            errs.append(f"another root cause: {x[:200]}")
        m = re.search(r"rank (\d+) \([^)]*\) vanished", x)
        if m and int(m.group(1)) != rank:
            errs.append(f"a line says rank {m.group(1)} vanished: {x[:200]}")
    dt = (t_end - t_sig[0]) if t_sig[0] else t_end - t_start
    return errs, dt, text


def main():
    if len(sys.argv) < 2 or not K3:
        sys.exit("usage: K3_BIN=... chaos.py MPIEXEC [--only PHASE:ROLE]")
    mpiexec = sys.argv[1]
    only = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--only" else None
    with tempfile.TemporaryDirectory(prefix="k3-chaos-") as tmp:
        models = {sig: os.path.join(tmp, "tiny-chaos-" + sig) for sig in ("KILL", "STOP")}
        for model in models.values():
            subprocess.run([K3, "make-tiny", model], check=True, capture_output=True)
        with open(os.path.join(tmp, "in.jsonl"), "w") as f:
            for i in range(6):
                body = {"messages": [{"role": "user", "content": f"chaos request {i}: say something long"}],
                        "max_tokens": 24, "temperature": 0}
                f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": body}) + "\n")
        passed = total = 0
        for phase in PHASES:
            for role in ROLES:
                if only and only != f"{phase}:{role}":
                    continue
                total += 1
                bad = []
                info = []
                with concurrent.futures.ThreadPoolExecutor(2) as ex:
                    jobs = {sig: ex.submit(run_case, mpiexec, models, tmp, phase, role, sig)
                            for sig in ("KILL", "STOP")}
                for sig, job in jobs.items():
                    errs, dt, text = job.result()
                    info.append(f"SIG{sig} {dt:.1f} s")
                    if errs:
                        bad.append((sig, errs, text))
                tag = f"{phase:8s} {role:11s} rank {ROLES[role]}"
                if bad:
                    print(f"FAIL {tag}: " + "; ".join(f"SIG{s}: {', '.join(e)}" for s, e, _ in bad), flush=True)
                    for s, e, text in bad:
                        print(f"---- SIG{s} stderr (last 2500 chars) ----\n{text[-2500:]}\n----", flush=True)
                else:
                    passed += 1
                    print(f"ok   {tag} ({', '.join(info)})", flush=True)
        print(f"chaos: {passed}/{total} cases passed")
        sys.exit(0 if passed == total else 1)


if __name__ == "__main__":
    main()
