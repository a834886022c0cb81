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
"""
import csv
import json
import os
import re
import statistics
import subprocess
import tempfile

import jsonschema
import pytest

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
