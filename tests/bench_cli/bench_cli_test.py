"""bench_cli_test.py — `k3 bench` end to end on the tiny model (owner: bench).

Run by ctest through pytest (tests/bench_cli/tests.cmake):  python3 -m pytest bench_cli_test.py -k GROUP
Environment: K3_BIN (the k3 binary), K3_MPIEXEC (mpirun, for the 2x2 groups).
Benchmarks are never pass/fail on their numbers (STYLE.md §22): these tests check the outputs'
form and the exact counts a run must have, never a speed.

Groups (pytest -k):
  throughput_1x1 / throughput_2x2 : `k3 bench throughput` sweeps input len x output len x
      concurrency; the JSON validates against bench_throughput.schema.json; one result per sweep
      point; with ignore_eos the token counts are exactly num_prompts x len; the rates agree with
      the counts and elapsed_time; the CSV and the markdown table carry the same runs; the plan
      (pp, ep, world) is the one launched.
  pptg          : `k3 bench -p .. -n .. -r ..` (llama-bench's flags): rows pp<N> / tg<N>, the
      samples per repetition, mean and stddev recomputed from them; JSON valid against
      bench_pptg.schema.json; a flag of another mode is refused (exit 2).
  serve_2x2     : `k3 bench serve` against `k3 serve` (2x2) on the tiny model; the JSON validates
      against bench_serve.schema.json and its token counts (warm-up requests included, reported
      apart) equal the deltas of the server's /metrics counters over the run.
  kernels       : `k3 bench kernels` at small sizes (--size-mb, --prefill): the JSON validates
      against bench_kernels.schema.json; the MoE experts' rows (small's MXFP4 shapes over copies
      that fill --size-mb, and in cache at T = 1 and 64) count their calls' bytes and FLOPs;
      every op is there once with repetitions samples, its
      seconds their median, GB/s and GFLOP/s and the fractions of the measured limits agree with
      the bytes, FLOPs and seconds; the table and the CSV have the same ops; model flags are
      refused (exit 2). And `k3 run`'s summary: decode GB/s and prefill GFLOP/s agree with the
      weight bytes / FLOPs and the times it reports.
  load_1x1 / load_1x2 : `k3 bench load` alone and under mpirun -np 2 (--ep 2): the JSON validates
      against bench_load.schema.json; a serial (1 reader) and a parallel load, warm (and cold where
      the page cache could be dropped); each rank read exactly its plan's weight bytes; a node's
      unique bytes are every tensor of the checkpoint (summed from the shards' safetensors headers
      here) and, with both lanes on one node, less than the bytes read (each lane reads the dense
      weights); GB/s and % of raw agree with the bytes, seconds and raw rates; peak RSS > 0; the
      table and the CSV have one row per load. load_usage: flags of other modes and bad values are
      usage errors (exit 2) naming the flag.
"""
import csv
import json
import os
import re
import signal
import struct
import statistics
import subprocess
import tempfile
import time

import jsonschema
import numpy
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

K3 = os.environ.get("K3_BIN", "k3")
MPI = os.environ.get("K3_MPIEXEC", "mpirun")
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def model_dir():
    d = tempfile.mkdtemp(prefix="k3_bench_")
    m = os.path.join(d, "tiny")
    subprocess.run([K3, "make-tiny", m], check=True, capture_output=True, timeout=120)
    return m


def schema(name):
    with open(os.path.join(HERE, name)) as f:
        return json.load(f)


def k3(args, np=1, timeout=120):
    cmd = [K3] + args
    if np > 1:
        cmd = [MPI, "-np", str(np), "--oversubscribe"] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return r


def md_rows(text):
    """The data rows of the markdown table on stdout (cells as strings)."""
    lines = [l for l in text.splitlines() if l.startswith("|")]
    assert len(lines) >= 2 and set(lines[1].replace("|", "").replace(":", "")) <= {"-"}, text
    return [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:]]


# ---- throughput --------------------------------------------------------------------------------
@pytest.mark.parametrize("grid", [(1, 1), (2, 2)], ids=["throughput_1x1", "throughput_2x2"])
def test_throughput(model_dir, grid, tmp_path):
    pp, ep = grid
    ins, outs, concs, n = [8, 24], [3, 5], [2, 5], 5
    js, cs = tmp_path / "tp.json", tmp_path / "tp.csv"
    r = k3(["bench", "throughput", "--model", model_dir, "--pp", str(pp), "--ep", str(ep),
            "--threads", "1", "--input-len", ",".join(map(str, ins)),
            "--output-len", ",".join(map(str, outs)),
            "--max-concurrency", ",".join(map(str, concs)), "--num-prompts", str(n),
            "--num-warmups", "2", "--seed", "7", "--output-json", str(js), "--output-csv", str(cs)],
           np=pp * ep)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(js.read_text())
    jsonschema.validate(d, schema("bench_throughput.schema.json"))
    assert (d["pp"], d["ep"], d["world"]) == (pp, ep, pp * ep)
    assert d["num_warmups"] == 2 and d["seed"] == 7
    res = d["results"]
    want = [(i, o, c) for i in ins for o in outs for c in concs]
    assert [(x["input_len"], x["output_len"], x["max_concurrency"]) for x in res] == want
    for x in res:
        i, o = x["input_len"], x["output_len"]
        assert x["num_requests"] == n
        assert x["total_input_tokens"] == n * i  # random prompts of exactly input_len ids
        assert x["total_output_tokens"] == n * o  # ignore_eos: exactly output_len each
        assert x["total_num_tokens"] == n * (i + o)
        t = x["elapsed_time"]
        rel = lambda a, b: abs(a - b) <= 1e-9 * max(abs(b), 1)
        assert rel(x["requests_per_second"], n / t)
        assert rel(x["tokens_per_second"], n * (i + o) / t)
        assert rel(x["input_tokens_per_second"], n * i / t)
        assert rel(x["output_tokens_per_second"], n * o / t)
        assert rel(x["tokens_per_second_per_rank"], n * (i + o) / t / (pp * ep))
    # several points: no flat copy at the top level
    assert "elapsed_time" not in d
    # the CSV: one line per point, the same numbers
    rows = list(csv.DictReader(cs.open()))
    assert len(rows) == len(res)
    for row, x in zip(rows, res):
        assert int(row["total_output_tokens"]) == x["total_output_tokens"]
        assert abs(float(row["elapsed_time"]) - x["elapsed_time"]) <= 1e-12 * x["elapsed_time"]
        assert row["git_commit"] == d["git_commit"] and int(row["world"]) == pp * ep
    # the table on stdout: one row per point
    table = md_rows(r.stdout)
    assert [(int(c[0]), int(c[1]), int(c[2])) for c in table] == want


def test_throughput_one_point_flat(model_dir, tmp_path):
    """One sweep point: vLLM's keys also at the top level (where vLLM's readers look)."""
    js = tmp_path / "tp.json"
    r = k3(["bench", "throughput", "--model", model_dir, "--threads", "1", "--input-len", "6",
            "--output-len", "4", "--num-prompts", "3", "--num-warmups", "0",
            "--output-json", str(js)])
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(js.read_text())
    jsonschema.validate(d, schema("bench_throughput.schema.json"))
    for k in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second",
              "tokens_per_second"):
        assert d[k] == d["results"][0][k]
    assert d["total_num_tokens"] == 3 * (6 + 4)


def test_throughput_usage_errors(model_dir):
    for args in (["--base-url", "http://x"],  # a serve flag
                 ["--input-len", "8,x"], ["--output-len", "0"],
                 ["--input-len", "4000", "--output-len", "200"],  # over --max-ctx 4096
                 ["-p", "8"]):  # a pp/tg flag
        r = k3(["bench", "throughput", "--model", model_dir] + args)
        assert r.returncode == 2, (args, r.stderr)
        assert "k3 bench" in r.stderr


# ---- pp / tg -------------------------------------------------------------------------------------
def test_pptg(model_dir, tmp_path):
    js, cs = tmp_path / "pt.json", tmp_path / "pt.csv"
    r = k3(["bench", "--model", model_dir, "--threads", "1", "-p", "16,32", "-n", "8", "-r", "3",
            "--output-json", str(js), "--output-csv", str(cs)])
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(js.read_text())
    jsonschema.validate(d, schema("bench_pptg.schema.json"))
    res = d["results"]
    assert [x["test"] for x in res] == ["pp16", "pp32", "tg8"]
    assert [(x["n_prompt"], x["n_gen"]) for x in res] == [(16, 0), (32, 0), (0, 8)]
    for x in res:
        ns, ts = x["samples_ns"], x["samples_ts"]
        assert len(ns) == len(ts) == 3
        tokens = x["n_prompt"] or x["n_gen"]
        for a, b in zip(ns, ts):
            assert abs(b - tokens / (a * 1e-9)) <= 1e-6 * b
        assert abs(x["avg_ts"] - statistics.mean(ts)) <= 1e-9 * x["avg_ts"]
        assert abs(x["stddev_ts"] - statistics.stdev(ts)) <= 1e-6 * max(x["stddev_ts"], 1e-9)
        assert abs(x["avg_ns"] - statistics.mean(ns)) <= 1e-9 * x["avg_ns"]
    table = md_rows(r.stdout)
    assert [c[5] for c in table] == ["pp16", "pp32", "tg8"]
    for c, x in zip(table, res):
        assert re.fullmatch(r"[0-9.]+ ± [0-9.]+", c[6]), c
        assert abs(float(c[6].split()[0]) - x["avg_ts"]) <= 0.006
    assert len(list(csv.DictReader(cs.open()))) == 3
    # a serve flag in the pp/tg mode is a usage error
    r = k3(["bench", "--model", model_dir, "--request-rate", "3"])
    assert r.returncode == 2 and "--request-rate does not apply" in r.stderr


# ---- kernels ------------------------------------------------------------------------------------
def test_kernels(tmp_path):
    js, cs = tmp_path / "kn.json", tmp_path / "kn.csv"
    r = k3(["bench", "kernels", "--threads", "1", "-r", "3", "--num-warmups", "0", "--size-mb", "2",
            "--prefill", "4", "--output-json", str(js), "--output-csv", str(cs)])
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(js.read_text())
    jsonschema.validate(d, schema("bench_kernels.schema.json"))
    assert (d["threads"], d["repetitions"], d["prefill"], d["array_bytes"]) == (1, 3, 4, 2 << 20)
    assert d["limits_threads"] == 1 and d["triad_array_bytes"] == 2 << 20
    assert d["triad_gbs"] >= d["triad_gbs_median"] and d["fma_peak_gflops"] >= d["fma_peak_gflops_median"]
    assert "best of" in d["limits"]
    res = d["results"]
    ops = [x["op"] for x in res]
    assert len(set(ops)) == len(ops)
    for kind in ("matmul F32", "matmul BF16", "matmul_tn BF16", "matmul MXFP4", "silu", "sigmoid",
                 "situ", "swiglu", "softmax"):
        assert any(o.startswith(kind) for o in ops), (kind, ops)
    assert sum(o.endswith("T=4") for o in ops) == 3 and sum(o.endswith("T=1") for o in ops) == 4
    # the MoE experts' own matrices (small's shapes): over copies filling --size-mb, and in cache
    for out, inn in ((384, 768), (768, 384)):
        wb = out * inn // 2 + out * inn // 32
        n = (2 << 20) // wb
        many = [x for x in res if x["op"] == f"experts MXFP4 {out}x{inn} T=1, {n} matrices"]
        assert len(many) == 1 and many[0]["flops"] == n * 2 * out * inn, (out, inn, ops)
        assert many[0]["bytes"] == n * (wb + 4 * (inn + out))
        for T in (1, 64):
            one = [x for x in res if x["op"] == f"expert MXFP4 {out}x{inn} T={T}, in cache"]
            assert len(one) == 1 and one[0]["flops"] == 16 * 2 * T * out * inn, (out, inn, T, ops)
    rel = lambda a, b, e=1e-9: abs(a - b) <= e * max(abs(b), 1e-30)
    for x in res:
        assert len(x["samples_s"]) == 3
        assert rel(x["seconds"], statistics.median(x["samples_s"]))
        assert rel(x["gbs"], x["bytes"] / x["seconds"] / 1e9)
        assert rel(x["gflops"], x["flops"] / x["seconds"] / 1e9)
        assert rel(x["triad_fraction"], x["gbs"] / d["triad_gbs"], 1e-6)
        if d["fma_peak_gflops"] > 0:
            assert rel(x["peak_fraction"], x["gflops"] / d["fma_peak_gflops"], 1e-6)
    table = md_rows(r.stdout)
    assert [c[0] for c in table] == ops
    assert [row["op"] for row in csv.DictReader(cs.open())] == ops
    for args in (["--model", "x"], ["--prefill", "0"], ["-p", "8"], ["--pp", "2"]):
        r = k3(["bench", "kernels"] + args)
        assert r.returncode == 2 and "k3 bench" in r.stderr, (args, r.stderr)


def test_kernels_run_summary(model_dir):
    """`k3 run`'s summary against the weights: decode GB/s = weight bytes per token x decode tok/s,
    prefill GFLOP/s = weight FLOPs / prefill time, in --json's timings and on stderr (without
    --bench-limits no % and no limits; the probes are measured only when asked)."""
    r = k3(["run", "--model", model_dir, "--prompt-ids", "1,2,3,4,5,6,7,8,9,10", "--n", "6",
            "--ignore-eos", "--threads", "1", "--json"])
    assert r.returncode == 0, r.stderr[-3000:]
    t = json.loads(r.stdout)["timings"]
    rel = lambda a, b: abs(a - b) <= 1e-9 * max(abs(b), 1e-30)
    assert t["decode_bytes_per_token"] > 0 and t["prefill_weight_flops"] > 0
    assert rel(t["decode_gbs"], t["decode_bytes_per_token"] * t["decode_tok_s"] / 1e9)
    assert rel(t["prefill_gflops"], t["prefill_weight_flops"] / t["prefill_s"] / 1e9)
    assert "triad_gbs" not in t and "peak_fraction" not in t
    r = k3(["run", "--model", model_dir, "--prompt-ids", "1,2,3,4,5,6,7,8,9,10", "--n", "6",
            "--ignore-eos", "--threads", "1"])
    assert r.returncode == 0 and re.search(r"decode [0-9.]+ GB/s of weights .* prefill [0-9.]+ "
                                           r"GFLOP/s of weight FLOPs", r.stderr), r.stderr[-2000:]


# ---- load ----------------------------------------------------------------------------------------
def checkpoint_tensor_bytes(model_dir, experts=True):
    """Bytes of every tensor in the shards (experts=False: all but the routed experts'), from
    their safetensors headers (not from k3)."""
    total = 0
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0]
                     for k, t in header.items()
                     if k != "__metadata__" and (experts or ".experts." not in k))
    return total


@pytest.mark.parametrize("ep,private", [(1, False), (2, False), (2, True)],
                         ids=["load_1x1", "load_1x2", "load_1x2_private"])
def test_load(model_dir, ep, private, tmp_path):
    js, cs = tmp_path / "ld.json", tmp_path / "ld.csv"
    r = k3(["bench", "load", "--model", model_dir, "--pp", "1", "--ep", str(ep), "--threads", "1",
            "--output-json", str(js), "--output-csv", str(cs)]
           + (["--load-private", "-r", "2"] if private else []), np=ep)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(js.read_text())
    reps = 2 if private else 3  # warm rounds: --repetitions, default 3
    assert d["raw"]["warm_repetitions"] == reps
    jsonschema.validate(d, schema("bench_load.schema.json"))
    assert (d["mode"], d["pp"], d["ep"], d["world"], d["nodes"]) == ("load", 1, ep, ep, 1)
    raw = d["raw"]
    assert raw["warm_gbs"] > 0 and raw["bytes"] > 0
    cold_ok = raw["cold_gbs"] is not None
    assert cold_ok or "still cached" in raw["cold_note"] or raw["cold_note"], raw
    loads = d["loads"]
    want = [("serial", "warm"), ("parallel", "warm"), ("mmap", "warm")] + (
        [("serial", "cold"), ("parallel", "cold"), ("mmap", "cold")] if cold_ok else [])
    assert [(x["loader"], x["cache"]) for x in loads] == want
    total = checkpoint_tensor_bytes(model_dir)
    rel = lambda a, b: abs(a - b) <= 1e-9 * max(abs(b), 1e-30)
    for x in loads:
        assert x["readers"] == (1 if x["loader"] == "serial" else d["parallel_readers"])
        assert x["repetitions"] == (1 if x["cache"] == "cold" else reps)
        assert x["seconds_min"] <= x["seconds"] <= x["seconds_max"]
        ranks, nodes = x["ranks"], x["nodes"]
        assert [k["rank"] for k in ranks] == list(range(ep))
        assert [(k["stage"], k["lane"]) for k in ranks] == [(0, e) for e in range(ep)]
        mapped = x["loader"] == "mmap"  # every rank maps its own tensors (the page cache holds
        for k in ranks:  # them once); else rank 0 reads the dense weights for the node, unless private
            if private or mapped or k["rank"] == 0:
                assert k["bytes_read"] == k["plan_weight_bytes"] > 0, k
            else:
                assert 0 < k["bytes_read"] < k["plan_weight_bytes"], k
            assert k["peak_rss_bytes"] > 0 and k["node"] == 0
        assert x["bytes_read"] == sum(k["bytes_read"] for k in ranks)
        assert x["seconds"] == max(k["load_s"] for k in ranks) > 0
        assert rel(x["gbs"], x["bytes_read"] / x["seconds"] / 1e9)
        raw_rate = raw["cold_gbs"] if x["cache"] == "cold" else raw["warm_gbs"]
        assert rel(x["pct_of_raw"], 100 * x["gbs"] / raw_rate)
        if x["cache"] == "warm":  # against the same reads into fresh memory
            assert rel(x["pct_of_fresh"], 100 * x["gbs"] / raw["fresh_gbs"])
        else:
            assert x["pct_of_fresh"] is None
        assert x["peak_rss_max_bytes"] == max(k["peak_rss_bytes"] for k in ranks)
        assert len(nodes) == 1
        n = nodes[0]
        assert (n["node"], n["ranks"], n["bytes_read"]) == (0, ep, x["bytes_read"])
        assert n["peak_rss_sum_bytes"] == sum(k["peak_rss_bytes"] for k in ranks)
        # every tensor is read on the one node, once as unique bytes
        assert n["unique_bytes"] == x["unique_bytes"] == total, (n, total)
        assert n["bytes_read"] >= n["unique_bytes"]
        if ep == 1 or not (private or mapped):  # one read per node of the dense weights
            assert n["bytes_read"] == n["unique_bytes"]
        else:  # --load-private: both lanes read the stage's dense weights
            assert n["unique_bytes"] < n["bytes_read"]
    main, *subs = r.stdout.split("\n### ")  # the loads, then a ranks and a nodes table each
    assert [c[0] for c in md_rows(main)] == [f"{a} {b}" for a, b in want]
    assert [t.split("\n")[0] for t in subs] == [f"{k}: {a} {b}" for a, b in want
                                                for k in ("ranks", "nodes")]
    assert all(len(md_rows(t)) == (ep if t.startswith("ranks") else 1) for t in subs)
    rows = list(csv.DictReader(cs.open()))
    assert [(row["loader"], row["cache"]) for row in rows] == want
    assert "ranks" not in rows[0] and int(rows[0]["bytes_read"]) == loads[0]["bytes_read"]


def test_load_usage(model_dir):
    for args, flag in ((["--seed", "3"], "--seed"), (["--op-stats", "x"], "--op-stats"),
                       (["--load-readers", "999"], "--load-readers"), (["--pp", "2"], "--pp"),
                       (["-p", "8"], "--n-prompt"), (["-r", "0"], "--repetitions"),
                       (["--repetitions", "17"], "--repetitions")):
        r = k3(["bench", "load", "--model", model_dir] + args)
        assert r.returncode == 2 and flag in r.stderr, (args, r.stderr)
    r = k3(["bench", "load"])
    assert r.returncode == 2 and "--model" in r.stderr, r.stderr
    r = k3(["bench", "load", "--help"])
    assert r.returncode == 0 and re.search(r"--load-readers N .*\[.*load\]", r.stdout), r.stdout


# ---- serve ---------------------------------------------------------------------------------------
class Server:
    """`k3 serve` under mpirun on --port 0; rank 0's port and pid come from its 'listening' log
    line (as tests/serve does it), then /health must answer 200."""

    def __init__(self, model, pp, ep):
        self.log = tempfile.NamedTemporaryFile(prefix="k3_bench_srv_", suffix=".txt", delete=False)
        cmd = [MPI, "-np", str(pp * ep), "--oversubscribe", K3, "serve", "--model", model,
               "--port", "0", "--threads", "1", "--pp", str(pp), "--ep", str(ep)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        t0, self.url, self.pid = time.time(), None, None
        while time.time() - t0 < 120 and self.proc.poll() is None and not self.url:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+) \(model \"[^\"]*\", pid (\d+)\)",
                          self.text())
            if m:
                self.url, self.pid = m.group(1), int(m.group(2))
            time.sleep(0.1)
        assert self.url, "the server did not start:\n" + self.text()[-3000:]
        while requests.get(self.url + "/health", timeout=10).status_code != 200:
            assert time.time() - t0 < 120, "no /health"
            time.sleep(0.1)

    def text(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def metrics(self):
        r = requests.get(self.url + "/metrics", timeout=10)
        assert r.status_code == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(r.text) for s in fam.samples}

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = "hung"
        os.unlink(self.log.name)
        return rc


@pytest.fixture(scope="module")
def server_2x2(model_dir):
    s = Server(model_dir, 2, 2)
    yield s
    assert s.stop() == 0


def counters(srv, endpoint):
    m = srv.metrics()

    def get(name, **lb):  # every series also carries model_name
        return sum(v for (n, labels), v in m.items()
                   if n == name and all(dict(labels).get(k) == x for k, x in lb.items()))
    return (get("vllm:prompt_tokens_total"), get("vllm:generation_tokens_total"),
            get("k3_requests_total", endpoint=endpoint, status="200"))


@pytest.mark.parametrize("endpoint,extra", [
    ("/v1/completions", ["--request-rate", "40", "--max-concurrency", "3", "--num-warmups", "2"]),
    ("/v1/chat/completions", ["--num-warmups", "1"]),
], ids=["serve_2x2_completions", "serve_2x2_chat"])
def test_serve(server_2x2, model_dir, endpoint, extra, tmp_path):
    # chat: the K3 template's own tokens (~190 with thinking on) count in --input-len
    srv, n, il, ol = server_2x2, 7, (12 if endpoint == "/v1/completions" else 230), 5
    js, cs = tmp_path / "sv.json", tmp_path / "sv.csv"
    before = counters(srv, endpoint)
    r = k3(["bench", "serve", "--base-url", srv.url, "--endpoint", endpoint, "--tokenizer", model_dir,
            "--input-len", str(il), "--output-len", str(ol), "--num-prompts", str(n), "--seed", "5",
            "--output-json", str(js), "--output-csv", str(cs)] + extra)
    assert r.returncode == 0, r.stderr[-3000:]
    after = counters(srv, endpoint)
    d = json.loads(js.read_text())
    jsonschema.validate(d, schema("bench_serve.schema.json"))
    warm = int(extra[extra.index("--num-warmups") + 1])
    assert d["model_id"] == "tiny" and d["num_warmups"] == warm and d["endpoint"] == endpoint
    assert d["completed"] == n and d["failed"] == 0 and d["num_prompts"] == n
    # the token counts are the server's own: equal to its /metrics counters over the run
    assert after[0] - before[0] == d["total_input_tokens"] + d["warmup_input_tokens"]
    assert after[1] - before[1] == d["total_output_tokens"] + d["warmup_output_tokens"]
    assert after[2] - before[2] == n + warm
    # ignore_eos: exactly output_len each; prompts of exactly input_len tokens on both endpoints
    # (chat: one-token words of the model's tokenizer, less the template's tokens)
    assert d["output_lens"] == [ol] * n and d["total_output_tokens"] == n * ol
    assert d["warmup_output_tokens"] == warm * ol
    assert d["input_lens"] == [il] * n and d["total_input_tokens"] == n * il
    if endpoint == "/v1/completions":
        assert d["request_rate"] == 40 and d["max_concurrency"] == 3
    else:
        assert d["request_rate"] == "inf" and d["max_concurrency"] is None
    assert sum(d["input_lens"]) == d["total_input_tokens"]
    dur = d["duration"]
    assert abs(d["request_throughput"] - n / dur) <= 1e-9 * d["request_throughput"]
    assert abs(d["output_throughput"] - n * ol / dur) <= 1e-9 * d["output_throughput"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert d["median_%s_ms" % m] <= d["p90_%s_ms" % m] <= d["p99_%s_ms" % m]
        assert d["mean_%s_ms" % m] > 0
    assert d["mean_ttft_ms"] < d["mean_e2el_ms"] <= dur * 1e3
    # the statistics of the per-request TTFTs, as numpy computes them (vLLM uses numpy)
    t = numpy.array(d["ttfts"]) * 1e3
    for key, want in (("mean", t.mean()), ("median", numpy.median(t)), ("std", t.std()),
                      ("p90", numpy.percentile(t, 90)), ("p99", numpy.percentile(t, 99))):
        assert abs(d["%s_ttft_ms" % key] - want) <= 1e-6 * max(want, 1e-3), key
    # the flat keys equal results[0]; the CSV has the run
    assert all(d[k] == v for k, v in d["results"][0].items())
    row = list(csv.DictReader(cs.open()))
    assert len(row) == 1 and int(row[0]["total_output_tokens"]) == n * ol
    assert "| completed | %d |" % n in r.stdout


def test_serve_2x2_prefix(server_2x2, model_dir, tmp_path):
    """--random-prefix-len (issue 31): 4 prompts of one 128-token prefix + 12 tokens each, one at a
    time: every request after the first finds the prefix in the server's cache (2 blocks of 64),
    and the report's cached tokens and hit rate are the server's usage."""
    js = tmp_path / "svp.json"
    r = k3(["bench", "serve", "--base-url", server_2x2.url, "--tokenizer", model_dir,
            "--random-prefix-len", "128", "--input-len", "12", "--output-len", "3",
            "--num-prompts", "4", "--max-concurrency", "1", "--num-warmups", "0", "--seed", "9",
            "--output-json", str(js)])
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(js.read_text())
    jsonschema.validate(d, schema("bench_serve.schema.json"))
    assert d["input_lens"] == [140] * 4 and d["random_prefix_len"] == 128
    assert d["cached_lens"] == [0, 128, 128, 128] and d["total_cached_tokens"] == 384
    assert abs(d["prefix_cache_hit_rate"] - 384 / 560) < 1e-4


def test_serve_errors(server_2x2):
    r = k3(["bench", "serve", "--num-prompts", "2"])
    assert r.returncode == 2 and "--base-url URL is required" in r.stderr
    r = k3(["bench", "serve", "--base-url", server_2x2.url, "--pp", "2"])  # an engine flag
    assert r.returncode == 2 and "--pp does not apply" in r.stderr
    # a model the server does not serve: every request fails (HTTP 404), named, exit 1
    r = k3(["bench", "serve", "--base-url", server_2x2.url, "--model", "nope", "--num-prompts", "2",
            "--num-warmups", "0", "--input-len", "4", "--output-len", "2"])
    assert r.returncode == 1 and "HTTP 404" in r.stderr and "2 of 2 requests failed" in r.stderr
