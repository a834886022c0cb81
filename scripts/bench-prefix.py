#!/usr/bin/env python3
"""bench-prefix.py — issue 31's TTFT acceptance for the prefix cache, on the small model:
16 requests that share a 2048-token system prompt and differ in their last 64 tokens, one at a
time (greedy, --deterministic), against `k3 serve` with the prefix cache and with
--no-prefix-cache, on 1 rank and on 2x2; both servers of a topology run during the same run
(benched one after the other). Reports the median TTFT of requests 2-16 of each and their ratio
(a table on stdout, --output-json), and checks that both servers give the same greedy text for
the same prompts (exit 1 if not). A benchmark: the ratio is reported, never judged.
usage: scripts/bench-prefix.py [--model DIR] [--k3 build/k3] [--topologies 1x1,2x2]
                               [--prefix 2048] [--suffix 64] [--output-len 8] [--output-json F]"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="/tmp/k3-small")
ap.add_argument("--k3", default="build/k3")
ap.add_argument("--topologies", default="1x1,2x2")
ap.add_argument("--prefix", type=int, default=2048)
ap.add_argument("--suffix", type=int, default=64)
ap.add_argument("--output-len", type=int, default=8)
ap.add_argument("--num-prompts", type=int, default=16)
ap.add_argument("--output-json")
a = ap.parse_args()
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_orte_allowed_exit_without_sync="1")
if not os.path.isdir(a.model):
    subprocess.run([a.k3, "make-tiny", a.model, "--preset", "small"], check=True, env=env)


def serve(pp, ep, extra):
    log = tempfile.NamedTemporaryFile(prefix="k3_prefix_serve_", suffix=".log", delete=False)
    cmd = [a.k3, "serve", "--model", a.model, "--port", "0", "--pp", str(pp), "--ep", str(ep),
           "--deterministic"] + extra
    if pp * ep > 1:
        cmd = ["mpirun", "-np", str(pp * ep), "--oversubscribe"] + cmd
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
    t0 = time.time()
    while time.time() - t0 < 600:
        text = open(log.name, errors="replace").read()
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+) \(model \"[^\"]*\", pid (\d+)\)", text)
        if m:
            return p, "http://127.0.0.1:" + m.group(1), int(m.group(2)), log.name
        if p.poll() is not None:
            sys.exit("the server did not start:\n" + text[-3000:])
        time.sleep(0.2)
    sys.exit("the server did not start in 600 s")


def bench(url, out):
    r = subprocess.run([a.k3, "bench", "serve", "--base-url", url, "--tokenizer", a.model,
                        "--random-prefix-len", str(a.prefix), "--input-len", str(a.suffix),
                        "--output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
                        "--max-concurrency", "1", "--num-warmups", "0", "--seed", "31",
                        "--request-timeout", "3600", "--output-json", out],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit("bench serve failed:\n" + r.stderr[-3000:])
    return json.load(open(out))


def complete(url, ids, model):
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": a.output_len, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    d = json.load(urllib.request.urlopen(req, timeout=3600))
    return d["choices"][0]["text"], d["usage"]["prompt_tokens_details"]["cached_tokens"]


rows, ok = [], True
tmp = tempfile.mkdtemp(prefix="k3_prefix_bench_")
for topo in a.topologies.split(","):
    pp, ep = map(int, topo.split("x"))
    servers = {"cache": serve(pp, ep, []), "no-cache": serve(pp, ep, ["--no-prefix-cache"])}
    res = {}
    try:
        for name, (p, url, pid, log) in servers.items():
            d = bench(url, os.path.join(tmp, f"{topo}-{name}.json"))
            t = d["ttfts"][1:]
            res[name] = {"median_ttft_2_16_ms": statistics.median(t) * 1e3,
                         "ttft_1_ms": d["ttfts"][0] * 1e3, "hit_rate": d["prefix_cache_hit_rate"],
                         "cached_lens": d["cached_lens"]}
            model = d["model_id"]
        # the same prompts to both: the same greedy text (the second one hits on the cache server)
        ids = [300 + i % 2000 for i in range(a.prefix)] + [7] * a.suffix
        texts = {n: [complete(s[1], ids, model), complete(s[1], ids[:-1] + [9], model)]
                 for n, s in servers.items()}
        same = [x[0] for x in texts["cache"]] == [x[0] for x in texts["no-cache"]]
        ok &= same
    finally:
        for p, url, pid, log in servers.values():
            os.kill(pid, 15)
            p.wait(timeout=120)
    ratio = res["no-cache"]["median_ttft_2_16_ms"] / res["cache"]["median_ttft_2_16_ms"]
    rows.append({"topology": topo, "cache": res["cache"], "no_cache": res["no-cache"],
                 "ttft_ratio": ratio, "same_text": same,
                 "cached_tokens_check": [x[1] for x in texts["cache"]]})
print("| topology | median TTFT 2-16, cache (ms) | no cache (ms) | ratio | hit rate | first (ms) | same text |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['topology']} | {r['cache']['median_ttft_2_16_ms']:.1f} | "
          f"{r['no_cache']['median_ttft_2_16_ms']:.1f} | {r['ttft_ratio']:.1f}x | "
          f"{r['cache']['hit_rate']:.3f} | {r['cache']['ttft_1_ms']:.1f} | {r['same_text']} |")
if a.output_json:
    json.dump({"model": a.model, "prefix": a.prefix, "suffix": a.suffix, "rows": rows},
              open(a.output_json, "w"), indent=1)
sys.exit(0 if ok else 1)
