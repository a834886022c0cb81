#!/usr/bin/env python3
"""bench-cache-chat.py — issue 42's acceptance for blocks as tokens arrive, on the small model:
`k3 serve --max-ctx 131072 --kv-cache-tokens 65536` (a paged cache of half of one full context)
takes N concurrent chat requests (default 64) with no max_tokens and about 200 prompt tokens each,
temperature 0, ended as real chats end (a stop list of common punctuation, since the model is
random). Checks: all complete, at least N/2 run at once (/metrics vllm:num_requests_running,
polled), and each greedy text equals the same request run alone afterwards. Prints the numbers
(peak running, preemptions, wall times, finish reasons, completion tokens); exit 1 on a failed
check.
usage: scripts/bench-cache-chat.py [--model DIR] [--k3 build/k3] [--n 64] [--max-seqs 64]"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="/tmp/k3-small")
ap.add_argument("--k3", default="build/k3")
ap.add_argument("--n", type=int, default=64)
ap.add_argument("--max-seqs", type=int, default=64)
ap.add_argument("--max-ctx", type=int, default=131072)
ap.add_argument("--kv-cache-tokens", type=int, default=65536)
ap.add_argument("--words", type=int, default=120, help="prompt words (~200 tokens)")
a = ap.parse_args()
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
if not os.path.isdir(a.model):
    subprocess.run([a.k3, "make-tiny", a.model, "--preset", "small"], check=True, env=env)
STOP = [".", ",", "!", "?", ";", ":", "\n"]
log = tempfile.NamedTemporaryFile(prefix="k3_cache_chat_", suffix=".log", delete=False)
cmd = [a.k3, "serve", "--model", a.model, "--port", "0", "--deterministic", "--max-ctx",
       str(a.max_ctx), "--kv-cache-tokens", str(a.kv_cache_tokens), "--max-seqs", str(a.max_seqs)]
proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
url = None
t0 = time.time()
while time.time() - t0 < 600 and proc.poll() is None and not url:
    m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", open(log.name, errors="replace").read())
    url = m.group(1) if m else None
    time.sleep(0.2)
if not url:
    sys.exit("the server did not start:\n" + open(log.name, errors="replace").read()[-3000:])


def post(path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=7200) as r:
        return json.loads(r.read())


def metric(name):
    t = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
    m = re.search(r"^%s\{[^}]*\} ([0-9.e+]+)$" % re.escape(name), t, re.M)
    return float(m.group(1)) if m else 0.0


words = ("the of and to in is it that was for on are with as his they be at one have this from "
         "or had by word but what some we can out other were all there when up use your how said "
         "an each she which do their time if will way about many then them write would like so "
         "these her long make thing see him two has look more day could go come did number sound "
         "no most people my over know water than call first who may down side been now find").split()
rng = random.Random(42)
prompts = [" ".join(rng.choice(words) for _ in range(a.words)) for _ in range(a.n)]


def chat(p):
    return post("/v1/chat/completions", {"messages": [{"role": "user", "content": p}],
                                         "temperature": 0, "stop": STOP, "thinking": False})


got, peak, done = [None] * a.n, [0.0], threading.Event()


def poll():
    while not done.is_set():
        try:
            peak[0] = max(peak[0], metric("vllm:num_requests_running"))
        except OSError:
            pass
        time.sleep(0.2)


def one(i):
    try:
        got[i] = chat(prompts[i])
    except Exception as e:  # noqa: BLE001 (reported below)
        got[i] = {"error": repr(e)}


w = threading.Thread(target=poll)
w.start()
t1 = time.time()
ts = [threading.Thread(target=one, args=(i,)) for i in range(a.n)]
for t in ts:
    t.start()
for t in ts:
    t.join()
t_conc = time.time() - t1
done.set()
w.join()
fails = [i for i, g in enumerate(got) if not g or "choices" not in g]
t2 = time.time()
same = 0
for i, p in enumerate(prompts):
    if i in fails:
        continue
    alone = chat(p)
    same += alone["choices"][0]["message"]["content"] == got[i]["choices"][0]["message"]["content"]
t_alone = time.time() - t2
pre = metric("vllm:num_preemptions_total")
ok = [g for g in got if g and "choices" in g]
res = {"n": a.n, "completed": len(ok), "peak_running": peak[0], "preemptions": pre,
       "same_text_alone": same, "concurrent_s": round(t_conc, 1), "alone_s": round(t_alone, 1),
       "prompt_tokens": [g["usage"]["prompt_tokens"] for g in ok][:4],
       "completion_tokens": sorted(g["usage"]["completion_tokens"] for g in ok),
       "finish_reasons": sorted({g["choices"][0]["finish_reason"] for g in ok}),
       "errors": [got[i] for i in fails][:3]}
print(json.dumps(res, indent=1))
proc.terminate()
proc.wait(timeout=120)
good = len(ok) == a.n and peak[0] >= a.n / 2 and same == a.n
print("PASS" if good else "FAIL")
sys.exit(0 if good else 1)
