#!/usr/bin/env python3
"""batch_test.py — `k3 batch` end to end (owner: batch).

usage: batch_test.py input          (K3_BIN = the k3 binary; one process, no model load)
       batch_test.py lines          (one process, the tiny model)
       batch_test.py serve          (one process, the tiny model, and k3 serve)
  serve: (issue 47) 44 varied lines (n 2 and 3, echo + logprobs, prompt lists, 12 refused) through
         k3 batch and through k3 serve: every body equal, error bodies included (ids, timestamps
         and the prefix cache's cached_tokens aside), the same status; no source location.
       batch_test.py serve_mpi MPIEXEC   (the same file on 2 stages x 2 lanes and on one rank:
         every body equal)
       batch_test.py mpi MPIEXEC    (2 stages x 2 lanes under mpirun)
  lines: (issue 47) a line k3 serve refuses fails alone with serve's status and a message naming
         the key, no source location: another url (404), suffix, stream: true, best_of 2,
         echo on chat, a skip_special_tokens that is not a boolean; the others run (prompt_logprobs
         too, as serve answers it).
  input: malformed input lines (not JSON, no custom_id, a custom_id used twice, another method, a
         body that is not an object) fail the job before the model loads (another url fails its
         own line: lines): exit
         1, every bad line named by its number, no output file; a clean input next to them runs;
         an output file another job holds (flock) is refused; a usage error exits 2.
  mpi  : 200 chat requests (greedy, sampled without a seed, thinking on and off, short
         max_tokens) and 20 /v1/completions requests (text and id prompts, logprobs) on 2x2
         --deterministic write exactly one line per custom_id, each a valid chat.completion or
         text_completion (keys, usage sums) or, for the 4 requests that must fail, the status
         and OpenAI error body k3 serve would answer (its "code" is the status, as serve's):
         logit_bias -Infinity on every id (400, the engine's sampling error event), a prompt
         longer than --max-ctx (400), temperature -1 (400 naming the key), another model (404);
         the others complete; <|end_of_msg|> first gives finish_reason "stop"; logprobs (one
         entry per token, greedy = top 1, tops sorted) only when asked. A run SIGKILLed after about half the lines, plus a truncated last
         line, then run again: the file completes with no duplicate and no loss, and every result
         equals the uninterrupted run's (greedy and seeded sampling alike). A third run has
         nothing to do and leaves the file as it is. 24 of the requests on one process give the
         same messages as on 2x2.
Exit code only; prints one line per check."""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_check import check, verdict  # noqa: E402

K3 = os.environ.get("K3_BIN")


def line(cid, body, **kw):
    url = "/v1/completions" if cid.startswith("cmpl") else "/v1/chat/completions"
    d = {"custom_id": cid, "method": "POST", "url": url, "body": body}
    d.update(kw)
    return json.dumps(d)


def batch(args, mpi=None, np_=1, **kw):
    cmd = ([mpi, "-np", str(np_), "--oversubscribe"] if mpi else []) + [K3, "batch"] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=kw.get("timeout", 180))


def read_out(path):
    """custom_id -> parsed line; and the list of custom_ids in file order."""
    rows, order = {}, []
    with open(path) as f:
        for ln in f:
            o = json.loads(ln)
            order.append(o["custom_id"])
            rows[o["custom_id"]] = o
    return rows, order


def mode_input(tmp):
    model = os.path.join(tmp, "model")  # never loaded: validation comes first
    good = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    lines = [line("a", good),                                   # 1 ok
             "{not json",                                       # 2
             json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": good}),  # 3
             line("b", good, url="/v1/embeddings"),             # 4
             line("a", good),                                   # 5 duplicate of line 1
             line("c", good, method="GET"),                     # 6
             "",                                                # 7 blank: skipped
             line("d", [1, 2]),                                 # 8
             json.dumps([1, 2])]                                # 9
    inp, out = os.path.join(tmp, "bad.jsonl"), os.path.join(tmp, "bad.out.jsonl")
    with open(inp, "w") as f:
        f.write("\n".join(lines) + "\n")
    p = batch(["--model", model, "--input", inp, "--output", out])
    err = p.stderr
    want = {2: "invalid JSON", 3: "no custom_id", 5: "already used on line 1", 6: "method",
            8: "body", 9: "not a JSON object"}  # line 4 (another url) fails alone: mode_lines
    for n, needle in want.items():
        hit = [ln for ln in err.splitlines() if ("line %d:" % n) in ln]
        check(hit and needle in hit[0], "bad input line %d named (%s): %s" % (n, needle, hit[:1]))
    check(p.returncode == 1 and "line 1:" not in err and "line 7:" not in err and "line 4:" not in err,
          "good, blank and other-url lines are not named; exit %d" % p.returncode)
    check(not re.search(r"\.c:\d+", err), "no source locations in the messages: %s" % err[-200:])
    check(not os.path.exists(out), "no output file when the input is bad")
    p = batch(["--model", model, "--input", inp])
    check(p.returncode == 2 and "--output" in p.stderr, "no --output: usage error (exit %d)" % p.returncode)
    p = batch(["--model", model, "--input", inp, "--output", out, "--max-seqs", "0"])
    check(p.returncode == 2 and "--max-seqs" in p.stderr and len(p.stderr.strip().splitlines()) == 1,
          "--max-seqs 0: one line naming the flag, exit 2: %s" % p.stderr.strip()[:100])
    # an output file another job holds is refused (before the model loads)
    ok_in = os.path.join(tmp, "ok.jsonl")
    with open(ok_in, "w") as f:
        f.write(line("a", good) + "\n")
    import fcntl
    held = os.path.join(tmp, "held.jsonl")
    with open(held, "w") as h:
        fcntl.flock(h, fcntl.LOCK_EX)
        p = batch(["--model", model, "--input", ok_in, "--output", held])
    check(p.returncode == 1 and "another k3 batch" in p.stderr, "a locked output file is refused: %s"
          % p.stderr.strip()[-100:])
    p = batch(["--help"])
    check(p.returncode == 0 and "error body" in p.stdout and "--max-ctx" in p.stdout,
          "--help documents the error lines and the capacity flags")


def mode_lines(tmp):
    """Issue 47: a line k3 serve would refuse fails alone, with serve's status, the others run."""
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, stderr=subprocess.DEVNULL)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cmpl = {"prompt": "Once", "max_tokens": 2}
    lines = [line("ok", chat),
             line("emb", {"input": "x"}, url="/v1/embeddings"),
             line("cmpl-sfx", dict(cmpl, suffix="end")),
             line("stream", dict(chat, stream=True)),
             line("best", dict(chat, best_of=2)),
             line("plp", dict(chat, prompt_logprobs=1)),
             line("echo", dict(chat, echo=True)),
             line("cmpl-skip", dict(cmpl, skip_special_tokens="yes")),
             line("cmpl-ok", cmpl)]
    inp, out = os.path.join(tmp, "lines.jsonl"), os.path.join(tmp, "lines.out.jsonl")
    with open(inp, "w") as f:
        f.write("\n".join(lines) + "\n")
    p = batch(["--model", model, "--input", inp, "--output", out, "--threads", "1"])
    check(p.returncode == 0, "a file with refused lines runs (exit %d): %s" % (p.returncode, p.stderr[-300:]))
    rows, _ = read_out(out)
    want = {"emb": (404, "/v1/embeddings"), "cmpl-sfx": (400, "suffix"), "stream": (400, "stream"),
            "best": (400, "best_of"), "echo": (400, "echo"),
            "cmpl-skip": (400, "skip_special_tokens")}
    for cid, (status, key) in want.items():
        r = rows.get(cid, {}).get("response") or {}
        msg = ((r.get("body") or {}).get("error") or {}).get("message", "")
        check(r.get("status_code") == status and key in msg and not re.search(r"\.c:\d+", msg),
              "line %s: %d naming %s, no source location (%s %s)" % (cid, status, key, r.get("status_code"), msg[:120]))
    for cid in ("ok", "cmpl-ok", "plp"):  # prompt_logprobs: answered as serve answers it
        r = rows.get(cid, {}).get("response") or {}
        check(r.get("status_code") == 200, "line %s answered 200" % cid)
    plp = ((rows.get("plp", {}).get("response") or {}).get("body") or {}).get("prompt_logprobs")
    check(isinstance(plp, list) and plp[:1] == [None] and len(plp) > 1, "prompt_logprobs in the body")
    # --max-tokens: the max_tokens of a request that sets none (past serve's default of 16 for a
    # completion), on every choice of n; a request's own max_tokens wins
    with open(inp, "w") as f:
        f.write(line("cmpl-n", {"prompt": "Once", "n": 2, "seed": 1, "logprobs": 1, "ignore_eos": True}) + "\n")
        f.write(line("cmpl-own", {"prompt": "Once", "max_tokens": 2, "ignore_eos": True}) + "\n")
    out2 = os.path.join(tmp, "lines2.out.jsonl")
    p = batch(["--model", model, "--input", inp, "--output", out2, "--threads", "1", "--max-tokens", "20"])
    rows, _ = read_out(out2) if p.returncode == 0 else ({}, [])
    usage = lambda c: (((rows.get(c) or {}).get("response") or {}).get("body") or {}).get("usage", {})
    ch = (((rows.get("cmpl-n") or {}).get("response") or {}).get("body") or {}).get("choices", [])
    check(usage("cmpl-n").get("completion_tokens") == 40 and len(ch) == 2 and
          all(len(c["logprobs"]["tokens"]) == 20 for c in ch) and usage("cmpl-own").get("completion_tokens") == 2,
          "--max-tokens 20: 2 choices of 20 tokens (usage %s), a request's own max_tokens 2 kept (%s)"
          % (usage("cmpl-n"), usage("cmpl-own")))


def serve_lines():
    """The ~45 varied lines of the batch = serve comparison: (custom_id, body), seeded or greedy
    (an unseeded request samples with a fresh seed in serve)."""
    m = [{"role": "user", "content": "Name a colour."}]
    tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    L = []
    L += [("chat%d" % i, {"messages": m, "max_tokens": 4 + i, "seed": i, "temperature": 0.8}) for i in range(4)]
    L += [("chatoff%d" % i, {"messages": m, "max_tokens": 6, "seed": i, "chat_template_kwargs": {"thinking": False}}) for i in range(2)]
    L += [("lp%d" % i, {"messages": m, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}) for i in range(2)]
    L += [("tools%d" % i, {"messages": m, "max_tokens": 5, "seed": i, "tools": tool}) for i in range(2)]
    L += [("chatn%d" % n, {"messages": m, "max_tokens": 5, "seed": 7 + n, "n": n, "temperature": 0.9}) for n in (2, 3)]
    L += [("chatn2lp", {"messages": m, "max_tokens": 3, "seed": 1, "n": 2, "logprobs": True, "top_logprobs": 1}),
          ("chatn3off", {"messages": m, "max_tokens": 4, "seed": 2, "n": 3, "chat_template_kwargs": {"thinking": False}}),
          ("chatplp", {"messages": m, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1})]
    L += [("cmpl%d" % i, {"prompt": "Once upon", "max_tokens": 3 + i, "seed": i}) for i in range(3)]
    L += [("cmplids%d" % i, {"prompt": [5, 6, 7, 8 + i], "max_tokens": 3, "temperature": 0, "logprobs": 2}) for i in range(2)]
    L += [("cmplstop%d" % i, {"prompt": "a b c", "max_tokens": 8, "seed": i, "stop": ["e"]}) for i in range(2)]
    L += [("cmplskip%d" % i, {"prompt": "x", "max_tokens": 6, "seed": i, "skip_special_tokens": bool(i % 2)}) for i in range(2)]
    L += [("cmpln%d" % n, {"prompt": "Once upon", "max_tokens": 4, "seed": 3 + n, "n": n}) for n in (2, 3)]
    L += [("cmplecho", {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}),
          ("cmplecho0", {"prompt": [5, 6, 7, 9], "max_tokens": 0, "echo": True, "logprobs": 1}),
          ("cmplechotext", {"prompt": "a b", "max_tokens": 2, "seed": 4, "echo": True}),
          ("cmpllist", {"prompt": ["Once upon", "a b c", "x"], "max_tokens": 3, "seed": 5}),
          ("cmpllistids", {"prompt": [[5, 6, 7], [8, 9, 10, 11]], "max_tokens": 3, "seed": 6, "n": 2, "logprobs": 1}),
          ("cmpllistecho", {"prompt": ["Once", "upon a"], "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1, "n": 2})]
    L += [("bad-model", {"model": "gpt-4o", "messages": m}), ("bad-top", {"messages": m, "top_p": 5}),
          ("cmplbad-sfx", {"prompt": "x", "suffix": "y"}), ("bad-best", {"messages": m, "best_of": 3}),
          ("bad-ctx", {"messages": m, "max_tokens": 100000}), ("cmplbad-zero", {"prompt": "x", "max_tokens": 0}),
          ("bad-n", {"messages": m, "n": 0}), ("cmplbad-nlist", {"prompt": ["a"] * 50, "n": 3}),
          ("cmplbad-mix", {"prompt": ["a", 5]}), ("bad-echo", {"messages": m, "echo": True}),
          ("cmplbad-id", {"prompt": [5, 10 ** 9]}), ("emb", {"input": "x"})]
    return L


def norm(x):
    """A body without what differs between two runs: ids, timestamps, the prefix cache's hits."""
    if isinstance(x, dict):
        return {k: norm(v) for k, v in x.items() if k not in ("id", "created", "prompt_tokens_details")}
    return [norm(v) for v in x] if isinstance(x, list) else x


def write_lines(path, L):
    lines = [line(c, b, **({"url": "/v1/embeddings"} if c == "emb" else {})) for c, b in L]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def mode_serve(tmp):
    """Issue 47: one ~45-line file through `k3 batch` and each line's body through `k3 serve`:
    every body equal (ids, timestamps and usage.prompt_tokens_details aside: the prefix cache's
    hits depend on what ran before), refused lines' error bodies included, with equal status."""
    import urllib.request
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, stderr=subprocess.DEVNULL)
    L = serve_lines()
    inp, out = os.path.join(tmp, "cmp.jsonl"), os.path.join(tmp, "cmp.out.jsonl")
    lines = write_lines(inp, L)
    flags = ["--model", model, "--threads", "1", "--max-ctx", "4096", "--served-model-name", "k3-tiny"]
    p = batch(flags + ["--input", inp, "--output", out])
    check(p.returncode == 0, "k3 batch ran the file (exit %d) %s" % (p.returncode, p.stderr[-200:]))
    rows, _ = read_out(out) if os.path.exists(out) else ({}, [])
    log = tempfile.NamedTemporaryFile(delete=False)
    srv = subprocess.Popen([K3, "serve", "--port", "0"] + flags, stdout=subprocess.DEVNULL, stderr=log)
    port, t0 = None, time.time()
    while port is None and time.time() - t0 < 60 and srv.poll() is None:
        mt = re.search(r"listening on http://127\.0\.0\.1:(\d+)", open(log.name, errors="replace").read())
        port = int(mt.group(1)) if mt else None
        time.sleep(0.1)
    same, diff = 0, []
    try:
        for (cid, body), ln in zip(L, lines):
            url = json.loads(ln)["url"]
            rq = urllib.request.Request("http://127.0.0.1:%d%s" % (port, url), data=json.dumps(body).encode(),
                                        headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(rq, timeout=120) as r:
                    status, got = r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                status, got = e.code, json.loads(e.read())
            b = (rows.get(cid) or {}).get("response") or {}
            ok = status == b.get("status_code") and norm(got) == norm(b.get("body"))
            same += ok
            if not ok:
                diff.append((cid, status, b.get("status_code"), json.dumps(norm(got))[:200], json.dumps(norm(b.get("body")))[:200]))
    finally:
        srv.terminate()
        srv.wait(timeout=60)
        os.unlink(log.name)
    for d in diff[:6]:
        print("   differs:", d)
    n_ok = sum(1 for c, _ in L if ((rows.get(c) or {}).get("response") or {}).get("status_code") == 200)
    n_choices = sum(len(((rows.get(c) or {}).get("response") or {}).get("body", {}).get("choices", [])) for c, _ in L)
    check(not diff and n_ok >= 30, "%d lines: batch = serve for every one (%d bodies of 200 with %d choices, %d "
          "error bodies, all equal)" % (len(L), n_ok, n_choices, len(L) - n_ok))
    srcloc = [c for c, _ in L if re.search(r"\.c:\d+", json.dumps(rows.get(c)))]
    check(not srcloc, "no source location in any line (%s)" % srcloc[:3])


def mode_serve_mpi(tmp, mpi):
    """Issue 47: the same file through `mpirun -np 4 k3 batch --pp 2 --ep 2` and one rank
    (--deterministic both): every body equal, ids and timestamps aside."""
    model = os.path.join(tmp, "tiny")
    subprocess.run([K3, "make-tiny", model], check=True, stderr=subprocess.DEVNULL)
    L = serve_lines()
    inp = os.path.join(tmp, "cmp.jsonl")
    write_lines(inp, L)
    flags = ["--model", model, "--threads", "1", "--max-ctx", "4096", "--served-model-name", "k3-tiny",
             "--deterministic", "--input", inp]
    one, four = os.path.join(tmp, "one.jsonl"), os.path.join(tmp, "four.jsonl")
    p1 = batch(flags + ["--output", one])
    p4 = batch(flags + ["--output", four, "--pp", "2", "--ep", "2"], mpi=mpi, np_=4, timeout=240)
    check(p1.returncode == 0 and p4.returncode == 0, "1 rank and 2x2 ran the file (exit %d, %d) %s" %
          (p1.returncode, p4.returncode, (p4.stderr or p1.stderr)[-300:]))
    r1, _ = read_out(one) if p1.returncode == 0 else ({}, [])
    r4, _ = read_out(four) if p4.returncode == 0 else ({}, [])
    diff = [c for c, _ in L if c not in r1 or c not in r4 or
            r1[c]["response"]["status_code"] != r4[c]["response"]["status_code"] or
            norm(r1[c]["response"]["body"]) != norm(r4[c]["response"]["body"])]
    for c in diff[:4]:
        print("   differs:", c, json.dumps(norm((r1.get(c) or {}).get("response")))[:200],
              json.dumps(norm((r4.get(c) or {}).get("response")))[:200])
    check(len(r1) == len(L) and not diff, "%d lines: 2x2 = 1 rank for every body (differ: %s)" % (len(L), diff[:5]))


def requests(vocab, eom):
    """200 requests: 197 that complete ('eom' stops at once: <|end_of_msg|> biased up; 'logprobs'
    asks for logprobs), 3 that must fail (ids 'bias-inf', 'too-long', 'bad-temp')."""
    rows = []
    for i in range(195):
        body = {"model": "k3", "messages": [{"role": "user", "content": "question %d %s" % (i, "why " * (i % 5))}],
                "max_tokens": 2 + i % 4}
        if i % 7:
            body["thinking"] = False  # a short prompt; every 7th thinks (the long system prompt)
        if i % 4 == 1:
            body["temperature"] = 0.9  # sampled with the seed k3 batch derives from the custom_id
        else:
            body["temperature"] = 0
        if i % 11 == 3:
            body["max_completion_tokens"] = 3
        rows.append(("q%03d" % i, body))
    short = {"model": "k3", "messages": [{"role": "user", "content": "hi"}], "thinking": False, "max_tokens": 4}
    rows.insert(30, ("logprobs", dict(short, temperature=0, logprobs=True, top_logprobs=3)))
    rows.insert(10, ("eom", dict(short, logit_bias={str(eom): 100})))
    rows.insert(50, ("bias-inf", dict(short, logit_bias={str(t): float("-inf") for t in range(vocab)})))
    rows.insert(120, ("too-long", dict(short, messages=[{"role": "user", "content": "word " * 700}])))
    rows.insert(160, ("bad-temp", dict(short, temperature=-1)))
    rows.insert(170, ("bad-model", dict(short, model="gpt-4o")))
    for i in range(20):  # /v1/completions lines (custom_ids "cmpl..."), spread through the file
        body = {"model": "k3", "prompt": "once upon a time %d" % i if i % 2 else [5 + i, 6, 7, 8],
                "max_tokens": 3 + i % 3, "temperature": 0 if i % 3 else 0.8}
        if i % 5 == 2:
            body["logprobs"] = 2
        rows.insert(7 + 11 * i, ("cmpl%03d" % i, body))
    return rows


def kill_session(sid):
    """SIGKILL every process of session `sid` (mpirun started with start_new_session; Open MPI
    puts each rank in a process group of its own, so killpg would leave the ranks running)."""
    for _ in range(50):
        pids = []
        for d in os.listdir("/proc"):
            try:
                with open("/proc/%s/stat" % d) as f:
                    st = f.read()
                if int(st.rsplit(")", 1)[1].split()[3]) == sid and st.rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(d))
            except (ValueError, OSError, IndexError):
                pass
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


def valid_completion(o):
    try:
        r = o["response"]
        b = r["body"]
        c = b["choices"][0]
        u = b["usage"]
        text = o["custom_id"].startswith("cmpl")
        m = {"role": "assistant", "content": c["text"]} if text else c["message"]
        return (o["error"] is None and o["id"].startswith("batch_req_") and r["status_code"] == 200
                and r["request_id"] and b["object"] == ("text_completion" if text else "chat.completion")
                and b["id"].startswith("cmpl-" if text else "chatcmpl-")
                and isinstance(b["created"], int) and b["model"] == "k3" and len(b["choices"]) == 1
                and c["index"] == 0 and m["role"] == "assistant" and isinstance(m["content"], str)
                and c["finish_reason"] in ("stop", "length", "tool_calls") and "logprobs" in c
                and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
                and u["prompt_tokens"] > 0)
    except (KeyError, TypeError, IndexError):
        return False


def mode_mpi(tmp, mpi):
    model = os.path.join(tmp, "model")
    subprocess.run([K3, "make-tiny", model], check=True, stderr=subprocess.DEVNULL)
    vocab = json.load(open(os.path.join(model, "config.json")))["text_config"]["vocab_size"]
    added = json.load(open(os.path.join(model, "tokenizer_config.json")))["added_tokens_decoder"]
    eom = [int(i) for i, t in added.items() if t["content"] == "<|end_of_msg|>"][0]
    rows = requests(vocab, eom)
    inp = os.path.join(tmp, "in.jsonl")
    with open(inp, "w") as f:
        for cid, body in rows:
            f.write(line(cid, body) + "\n")
    cids = [c for c, _ in rows]
    common = ["--model", model, "--input", inp, "--pp", "2", "--ep", "2", "--deterministic", "--max-ctx", "512",
              "--comm-timeout", "60", "--progress-every", "1", "--served-model-name", "k3"]
    failing = ("bias-inf", "too-long", "bad-temp", "bad-model")

    # ---- uninterrupted
    full = os.path.join(tmp, "full.jsonl")
    t0 = time.time()
    p = batch(common + ["--output", full], mpi=mpi, np_=4)
    check(p.returncode == 0, "2x2 batch of %d requests: exit %d in %.1f s %s" % (len(rows), p.returncode,
                                                                          time.time() - t0, p.stderr[-600:] if p.returncode else ""))
    ref, order = read_out(full)
    check(sorted(order) == sorted(cids), "one line per custom_id (%d lines, %d distinct)" % (len(order), len(set(order))))
    bad = [c for c in cids if c not in failing and not valid_completion(ref.get(c, {}))]
    check(not bad, "every other line is a valid chat.completion or text_completion (invalid: %s)" % bad[:3])
    for c, status, code, needle in (("bias-inf", 400, 400, "logit_bias"),  # as serve: code = status
                                    ("too-long", 400, 400, "512"),
                                    ("bad-temp", 400, 400, "'temperature'"),
                                    ("bad-model", 404, 404, "gpt-4o")):
        e = ref.get(c, {})
        r = e.get("response") or {}
        err = (r.get("body") or {}).get("error") or {}
        check(e.get("error", 0) is None and r.get("status_code") == status and r.get("request_id")
              and err.get("code") == code and needle in err.get("message", "") and "type" in err,
              "%s -> status %d, error body %d naming %s: %s" % (c, status, code, needle, r))
    texts = [ref[c]["response"]["body"] for c in cids if c.startswith("cmpl") and valid_completion(ref[c])]
    check(len(texts) == 20 and all(b["usage"]["completion_tokens"] == len(b["choices"][0]["logprobs"]["tokens"])
                                   for b in texts if b["choices"][0]["logprobs"]),
          "20 /v1/completions lines answered as text_completion, logprobs one per token")
    check("217 ok, 4 failed, 0 skipped" in p.stderr and "completion tokens" in p.stderr and "tok/s" in p.stderr,
          "summary on stderr: %s" % [ln for ln in p.stderr.splitlines() if "batch:" in ln][:2])
    check("ETA" in p.stderr, "progress lines (requests done/total, tok/s, ETA) on stderr")
    fr = {ref[c]["response"]["body"]["choices"][0]["finish_reason"] for c in cids if valid_completion(ref.get(c, {}))}
    check(fr == {"length", "stop"}, "finish reasons seen: %s" % sorted(fr))
    m = ref["eom"]["response"]["body"] if valid_completion(ref["eom"]) else {}
    check(m and m["choices"][0]["finish_reason"] == "stop" and m["choices"][0]["message"]["content"] == ""
          and m["usage"]["completion_tokens"] == 1, "<|end_of_msg|> first: finish_reason stop, empty content, 1 token")

    lp = ref["logprobs"]["response"]["body"] if valid_completion(ref["logprobs"]) else {}
    content = lp["choices"][0]["logprobs"]["content"] if lp else []
    check(lp and len(content) == lp["usage"]["completion_tokens"] and all(
        len(t["top_logprobs"]) == 3 and t["logprob"] <= 0 and t["top_logprobs"][0]["token"] == t["token"]
        and t["top_logprobs"][0]["logprob"] == t["logprob"]
        and [x["logprob"] for x in t["top_logprobs"]] == sorted([x["logprob"] for x in t["top_logprobs"]], reverse=True)
        for t in content) and all(isinstance(b, int) and 0 <= b < 256 for t in content for b in t["bytes"]),
        "logprobs: one entry per token, greedy = top 1, 3 tops sorted, bytes: %s" % str(content[:1])[:160])
    check(all(ref[c]["response"]["body"]["choices"][0]["logprobs"] is None for c in cids
              if c != "logprobs" and not c.startswith("cmpl") and valid_completion(ref[c])), "logprobs null when not asked for")

    # ---- killed halfway, then resumed
    part = os.path.join(tmp, "part.jsonl")
    cmd = [mpi, "-np", "4", "--oversubscribe", K3, "batch"] + common + ["--output", part]
    pr = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    n_at_kill, t0 = 0, time.time()
    while time.time() - t0 < 120 and pr.poll() is None:
        if os.path.exists(part):
            with open(part, "rb") as f:
                n_at_kill = f.read().count(b"\n")
            if n_at_kill >= len(rows) // 2:
                break
        time.sleep(0.02)
    kill_session(pr.pid)  # mpirun and every rank at once, as a scheduler ends a job
    pr.wait()
    with open(part, "rb") as f:
        data = f.read()
    n_lines = data.count(b"\n")
    check(0 < n_lines < len(rows), "SIGKILL of mpirun after %d lines: %d lines written, not all" % (n_at_kill, n_lines))
    # a line cut short by the kill (as if the write was interrupted): it must not count
    with open(part, "ab") as f:
        f.write(b'{"id":"batch_req_0","custom_id":"q199","response":{"status_co')
    p = batch(common + ["--output", part], mpi=mpi, np_=4)
    check(p.returncode == 0 and "truncated last line" in p.stderr, "the resumed run exits 0 and cuts the truncated "
          "line (exit %d) %s" % (p.returncode, p.stderr[-400:] if p.returncode else ""))
    check(("%d already in" % n_lines) in p.stderr, "the resumed run skips the %d lines already there" % n_lines)
    got, order = read_out(part)
    check(len(order) == len(set(order)) == len(cids) and set(order) == set(cids),
          "resumed file: %d lines, %d distinct, %d requests: no duplicate, no loss" % (len(order), len(set(order)), len(cids)))
    def usage(o):  # the prefix cache's hits (cached_tokens) depend on what ran before: aside
        return {k: v for k, v in (o["response"]["body"].get("usage") or {}).items() if k != "prompt_tokens_details"}
    same = [c for c in cids if c in got and (got[c]["response"]["body"].get("error") == ref[c]["response"]["body"].get("error")
                                             and got[c]["response"]["body"].get("choices") == ref[c]["response"]["body"].get("choices")
                                             and usage(got[c]) == usage(ref[c]))]
    check(len(same) == len(cids), "resumed results equal the uninterrupted run's: %d of %d (differ: %s)"
          % (len(same), len(cids), [c for c in cids if c not in same][:3]))
    before = open(part, "rb").read()
    p = batch(common + ["--output", part], mpi=mpi, np_=4)
    check(p.returncode == 0 and open(part, "rb").read() == before and "0 to run" in p.stderr,
          "a complete file: nothing to run, unchanged (exit %d)" % p.returncode)

    # ---- one process gives the same messages (--deterministic) for a subset
    sub_in, sub_out = os.path.join(tmp, "sub.jsonl"), os.path.join(tmp, "sub.out.jsonl")
    with open(sub_in, "w") as f:
        for cid, body in rows[:24]:
            f.write(line(cid, body) + "\n")
    p = batch(["--model", model, "--input", sub_in, "--output", sub_out, "--deterministic", "--max-ctx", "512",
               "--served-model-name", "k3"])
    one, _ = read_out(sub_out) if p.returncode == 0 else ({}, [])
    diff = [c for c, _ in rows[:24] if c not in one or
            (one[c]["response"] or {}).get("body", {}).get("choices") != (ref[c]["response"] or {}).get("body", {}).get("choices")]
    check(p.returncode == 0 and not diff, "1 process = 2x2 for 24 requests (differ: %s)" % diff[:3])


def main():
    modes = ("input", "lines", "serve", "mpi", "serve_mpi")
    if len(sys.argv) < 2 or sys.argv[1] not in modes or (sys.argv[1] in ("mpi", "serve_mpi") and len(sys.argv) < 3):
        print(__doc__)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        if sys.argv[1] == "input":
            mode_input(tmp)
        elif sys.argv[1] == "lines":
            mode_lines(tmp)
        elif sys.argv[1] == "serve":
            mode_serve(tmp)
        elif sys.argv[1] == "serve_mpi":
            mode_serve_mpi(tmp, sys.argv[2])
        else:
            mode_mpi(tmp, sys.argv[2])
    return verdict("batch_test " + sys.argv[1])


if __name__ == "__main__":
    sys.exit(main())
