"""plot_test.py — `k3 bench throughput|serve --plot FILE.svg` (launcher/bench_plot.c), read back.

The SVG is parsed with xml.etree and checked against the same run's --output-json: the panels
"throughput" and "latency"; the expected series (throughput: total and output tok/s per input x
output length, one point per --max-concurrency; latency: TTFT, ITL and E2EL at p50 / p90 / p99,
per sweep point) with their point counts; every series' data-values equal to the JSON's numbers;
every drawn coordinate finite and inside the view box; the drawing monotone in the data (a larger
value is higher on the page, a larger concurrency further right); one circle per point. `k3 bench
serve` against a 1 x 1 `k3 serve` on the tiny model the same way: a --max-concurrency sweep (a
point per value) and one run at a --request-rate (its point at the rate); --help lists --plot.
Environment: K3_BIN (the k3 binary).
"""
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

K3 = os.environ.get("K3_BIN", "k3")
NS = {"s": "http://www.w3.org/2000/svg"}


def run(args, timeout=120):
    r = subprocess.run([K3] + args, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (args, r.stderr[-3000:])
    return r


def pairs(s):
    return [tuple(float(v) for v in p.split(",")) for p in s.split()]


def read_svg(path):
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg", root.tag
    vb = [float(v) for v in root.get("viewBox").split()]
    assert vb[:2] == [0, 0] and vb[2] > 0 and vb[3] > 0, vb
    panels = {}
    for g in root.findall("s:g", NS):
        assert g.get("class") == "panel"
        series = {}
        for pl in g.findall("s:polyline", NS):
            assert pl.get("class") == "series"
            name = pl.get("data-series")
            assert name not in series, "series %r twice" % name
            pts, vals = pairs(pl.get("points")), pairs(pl.get("data-values"))
            assert len(pts) == len(vals), name
            for x, y in pts:
                assert math.isfinite(x) and math.isfinite(y), (name, x, y)
                assert 0 <= x <= vb[2] and 0 <= y <= vb[3], (name, x, y, vb)
            series[name] = (pts, vals)
        n_circles = len(g.findall("s:circle", NS))
        assert n_circles == sum(len(p) for p, _ in series.values()), g.get("id")
        assert len(g.findall("s:line[@class='axis']", NS)) == 2
        assert g.findall("s:text[@class='tick']", NS), "no tick labels"
        # monotone: over the whole panel, a larger value is drawn higher (smaller y), and x
        # grows with the data's x
        allp = [(v, p) for pts, vals in series.values() for p, v in zip(pts, vals)]
        for (va, pa) in allp:
            for (vb_, pb) in allp:
                if va[1] > vb_[1] + 1e-9:
                    assert pa[1] <= pb[1] + 1e-6, (g.get("id"), va, pa, vb_, pb)
                if va[0] > vb_[0] + 1e-9:
                    assert pa[0] >= pb[0] - 1e-6, (g.get("id"), va, pa, vb_, pb)
        panels[g.get("id")] = series
    assert set(panels) == {"throughput", "latency"}, panels.keys()
    return panels


def close(a, b):
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-300)


def check_latency(lat, name, row):
    pts, vals = lat[name]
    assert [v[0] for v in vals] == [50, 90, 99], (name, vals)
    m = name.split()[0].lower()
    for (_, y), k in zip(vals, ("median", "p90", "p99")):
        assert close(y, row["%s_%s_ms" % (k, m)]), (name, k, y, row)
    ys = [v[1] for v in vals]
    assert ys == sorted(ys), (name, ys)  # percentiles grow


def test_throughput(model, d):
    svg, js = os.path.join(d, "tp.svg"), os.path.join(d, "tp.json")
    ins, concs = [6, 12], [1, 2, 4]
    run(["bench", "throughput", "--model", model, "--threads", "1", "--input-len",
         ",".join(map(str, ins)), "--output-len", "4", "--max-concurrency",
         ",".join(map(str, concs)), "--num-prompts", "4", "--num-warmups", "1", "--plot", svg,
         "--output-json", js])
    res = json.load(open(js))["results"]
    p = read_svg(svg)
    tp, lat = p["throughput"], p["latency"]
    want = set()
    for i in ins:
        for kind, key in (("total", "tokens_per_second"), ("output", "output_tokens_per_second")):
            name = "%s tok/s (in %d, out 4)" % (kind, i)
            want.add(name)
            pts, vals = tp[name]
            rows = [r for r in res if r["input_len"] == i]
            assert [v[0] for v in vals] == concs, (name, vals)
            assert all(close(v[1], r[key]) for v, r in zip(vals, rows)), (name, vals)
    assert set(tp) == want, tp.keys()
    assert len(lat) == 3 * len(res), lat.keys()
    for r in res:
        for m in ("TTFT", "ITL", "E2EL"):
            check_latency(lat, "%s (c %d, in %d, out 4)" % (m, r["max_concurrency"], r["input_len"]), r)
    print("throughput plot: %d + %d series" % (len(tp), len(lat)))


def test_serve(model, d):
    log = tempfile.NamedTemporaryFile(prefix="k3_plot_serve_", suffix=".txt", delete=False)
    proc = subprocess.Popen([K3, "serve", "--model", model, "--port", "0", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        port = None
        t0 = time.time()
        while time.time() - t0 < 60 and proc.poll() is None and not port:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", open(log.name).read())
            port = m and int(m.group(1))
            time.sleep(0.1)
        assert port, open(log.name).read()[-2000:]
        base = ["bench", "serve", "--base-url", "http://127.0.0.1:%d" % port, "--input-len", "8",
                "--output-len", "5", "--num-prompts", "6"]
        svg, js = os.path.join(d, "sv.svg"), os.path.join(d, "sv.json")
        run(base + ["--max-concurrency", "1,3", "--plot", svg, "--output-json", js])
        svg1, js1 = os.path.join(d, "sv1.svg"), os.path.join(d, "sv1.json")
        run(base + ["--request-rate", "50", "--plot", svg1, "--output-json", js1])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        os.unlink(log.name)
    # a sweep of --max-concurrency: a point per value, latencies per run
    res = json.load(open(js))["results"]
    assert [r["max_concurrency"] for r in res] == [1, 3], res
    for r in res:  # each run counted afresh (the requests are reset between runs)
        assert r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 30, r
        assert r["output_lens"] == [5] * 6 and r["total_input_tokens"] == 48, r
    p = read_svg(svg)
    tp, lat = p["throughput"], p["latency"]
    assert set(tp) == {"total tok/s (in 8, out 5)", "output tok/s (in 8, out 5)"}, tp.keys()
    for name, key in (("total", "total_token_throughput"), ("output", "output_throughput")):
        vals = tp["%s tok/s (in 8, out 5)" % name][1]
        assert [v[0] for v in vals] == [1, 3], vals
        assert all(close(v[1], r[key]) for v, r in zip(vals, res)), (name, vals)
    assert len(lat) == 6, lat.keys()
    for r in res:
        for m in ("TTFT", "ITL", "E2EL"):
            check_latency(lat, "%s (c %d, in 8, out 5)" % (m, r["max_concurrency"]), r)
    # one run at a request rate: its one point at the rate
    r = json.load(open(js1))
    p = read_svg(svg1)
    tp, lat = p["throughput"], p["latency"]
    for name, key in (("total", "total_token_throughput"), ("output", "output_throughput")):
        (x, y), = tp["%s tok/s (in 8, out 5)" % name][1]
        assert x == 50 and close(y, r[key]), (name, x, y, r[key])
    assert set(lat) == {"TTFT", "ITL", "E2EL"}, lat.keys()
    for m in lat:
        check_latency(lat, m, r)
    print("serve plot: %d + %d series" % (len(tp), len(lat)))


def main():
    d = tempfile.mkdtemp(prefix="k3_plot_")
    model = os.path.join(d, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, capture_output=True, timeout=120)
    h = run(["bench", "--help"]).stdout + run(["bench", "--help"]).stderr
    assert "--plot" in h and "FILE.svg" in h, h
    test_throughput(model, d)
    test_serve(model, d)


if __name__ == "__main__":
    main()
    sys.exit(0)
