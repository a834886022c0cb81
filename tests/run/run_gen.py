#!/usr/bin/env python3
"""run_gen.py — `k3 run` generation end to end: sampling, stops, text, --chat (owner: run).

usage: run_gen.py MODE [MPIEXEC]     (K3_BIN = the k3 binary, K3_SRC = the repo root)
  unit : one process (the MPI singleton world of one):
         - temperature 0 (and --greedy) reproduce the forward goldens' greedy ids (made by the
           independent PyTorch reference); --top-k 1 at temperature 1 is greedy too;
         - same --seed -> same tokens, another seed -> other tokens (temperature 1); with
           --top-k 5 every sampled id is among the 5 largest logits of its dumped row (numpy);
           prompt i of a batch samples like prompt i alone (seed from seed + index);
         - EOS: --logit-bias EOS:100 stops after 1 token (finish_reason "stop", empty text);
           with --ignore-eos it generates exactly N; a stop string cuts the text before it and
           ends only its own sequence of a batch (the other one runs to N);
         - text: --prompt / --json "text" equals the ids decoded by PyPI tiktoken (ranks from the
           model's tiktoken.model, specials from tokenizer_config.json) with errors="replace";
         - --chat: tools + thinking on -> the message keys (reasoning_content present); thinking
           off -> none; request max_tokens honoured, an explicit --n wins; EOS -> "stop";
           a bad request exits 1 with one line naming the key; --chat + --prompt exits 2;
         - usage errors exit 2 with one line naming the flag.
  mpi  : sampling (temperature 1, seeded) of a batch of 3 under mpirun --pp 2 --ep 2
         --deterministic gives the same tokens as the single-process run; --chat under mpirun
         prints the same message as in one process; an EOS stop under mpirun ends every rank.
Exit code only; prints one line per check."""
import base64
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

K3 = os.environ.get("K3_BIN")
fails = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        fails.append(msg)


def k3run(args, mpi=None, np_=1, timeout=120):
    cmd = ([mpi, "-np", str(np_), "--oversubscribe"] if mpi else []) + [K3, "run"] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def jrun(model, args, **kw):
    p = k3run(["--model", model, "--json"] + args, **kw)
    if p.returncode != 0:
        check(False, "k3 run %s: exit %d: %s" % (" ".join(args), p.returncode, p.stderr[-800:]))
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def decoder(model):
    """ids -> text with the model's ranks + specials, like Python's bytes.decode("replace")."""
    ranks = {}
    for line in open(os.path.join(model, "tiktoken.model"), "rb"):
        if line.strip():
            tok, r = line.split()
            ranks[int(r)] = base64.b64decode(tok)
    added = json.load(open(os.path.join(model, "tokenizer_config.json")))["added_tokens_decoder"]
    for i, v in added.items():
        ranks[int(i)] = v["content"].encode()
    try:  # cross-check the rank table with tiktoken itself when installed
        import tiktoken.load
        bpe = tiktoken.load.load_tiktoken_bpe(os.path.join(model, "tiktoken.model"))
        assert all(ranks[r] == b for b, r in bpe.items())
    except ImportError:
        pass
    return lambda ids: b"".join(ranks[i] for i in ids).decode("utf-8", errors="replace")


def write(tmp, name, obj):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        json.dump(obj, f)
    return path


CHAT = {"messages": [{"role": "system", "content": "You are helpful."},
                     {"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}],
        "tool_choice": "auto", "thinking": True, "max_tokens": 12, "temperature": 0.8, "seed": 5}


def npy_rows(path):
    return np.load(path).shape[0]


def mode_unit(tmp):
    gdir = os.path.join(os.environ["K3_SRC"], "tests", "golden", "forward")
    man = json.load(open(os.path.join(gdir, "manifest.json")))
    model = os.path.join(tmp, "model")
    subprocess.run([K3, "make-tiny", model, "--preset", man["preset"], "--seed", str(man["seed"])],
                   check=True, stderr=subprocess.DEVNULL)
    cfg = json.load(open(os.path.join(model, "config.json")))
    eos = cfg.get("text_config", cfg)["eos_token_id"]
    dec = decoder(model)
    g = man["prompts"][0]
    ids, greedy, N = ",".join(map(str, g["ids"])), g["greedy"], len(g["greedy"])

    # ---- greedy = the reference's greedy ids
    for extra in (["--temperature", "0"], ["--greedy"], ["--temperature", "1", "--top-k", "1", "--seed", "9"],
                  ["--temperature", "1e-39"]):  # 1/t overflows a float: the greedy limit, not NaN -> id 0
        j = jrun(model, ["--prompt-ids", ids, "--n", str(N), "--ignore-eos"] + extra)
        check(j is not None and j["generated_ids"] == greedy, "%s = the golden greedy ids" % " ".join(extra))

    # ---- seeds
    def sample(seed, prompts=ids, n=N, extra=()):
        j = jrun(model, ["--prompt-ids", prompts, "--n", str(n), "--ignore-eos", "--temperature", "1",
                         "--seed", str(seed)] + list(extra))
        return j
    a, b, c = sample(7), sample(7), sample(8)
    if a and b and c:
        check(a["generated_ids"] == b["generated_ids"], "same seed -> same tokens")
        check(a["generated_ids"] != c["generated_ids"], "another seed -> other tokens")
        check(a["generated_ids"] != greedy, "temperature 1 is not greedy")
        check(a["finish_reason"] == "length" and len(a["generated_ids"]) == N, "--ignore-eos: exactly N")
    big = 2 ** 53
    s53, s53p1, smax = sample(big), sample(big + 1), sample(2 ** 64 - 1)
    check(s53 is not None and s53p1 is not None and smax is not None and
          s53["generated_ids"] != s53p1["generated_ids"], "--seed 2^53+1 and 2^53 differ (no double rounding)")
    npy = os.path.join(tmp, "k5.npy")
    j = sample(3, extra=["--top-k", "5", "--dump-logits", npy])
    if j:
        L, T = np.load(npy), len(g["ids"])
        ok = all(int(t) in set(np.argsort(-L[T - 1 + i], kind="stable")[:5].tolist())
                 for i, t in enumerate(j["generated_ids"]))
        check(ok and j["generated_ids"] != greedy, "--top-k 5: every id is in the top 5 of its logits row")
    prompts = ids + ";5,6,7;9,9"
    bat = sample(7, prompts)
    if bat and a:
        check(bat["results"][0]["generated_ids"] == a["generated_ids"], "batch prompt 0 samples like the single run")
        one = sample(7, "5,6,7")
        check(one is not None and bat["results"][1]["generated_ids"] != one["generated_ids"],
              "prompt 1 of a batch has its own seed (differs from the same prompt alone)")

    # ---- EOS and stop strings
    j = jrun(model, ["--prompt-ids", ids, "--n", "8", "--logit-bias", "%d:100" % eos])
    check(j is not None and j["generated_ids"] == [eos] and j["finish_reason"] == "stop" and j["text"] == "",
          "EOS at step 1 stops the run (ids [%d], finish stop, empty text)" % eos)
    j = jrun(model, ["--prompt-ids", ids, "--n", "8", "--logit-bias", "%d:100" % eos, "--ignore-eos"])
    check(j is not None and j["generated_ids"] == [eos] * 8 and j["finish_reason"] == "length",
          "--ignore-eos generates exactly N (8 x EOS)")
    full = jrun(model, ["--prompt-ids", prompts, "--n", str(N), "--ignore-eos"])
    if full:
        t0, t1 = full["results"][0]["text"], full["results"][1]["text"]
        four = dec(full["results"][0]["generated_ids"][:4])
        stop = next((t0[k:k + 3] for k in range(len(four), len(t0) - 3)
                     if "\ufffd" not in t0[k:k + 3] and t0[k:k + 3].strip() and t0[k:k + 3] not in t1), None)
        check(stop is not None, "found a stop string in prompt 0's text only: %r" % stop)
        if stop:
            j = jrun(model, ["--prompt-ids", prompts, "--n", str(N), "--ignore-eos", "--stop", stop])
            if j:
                r0, r1 = j["results"][0], j["results"][1]
                g0 = full["results"][0]["generated_ids"]
                check(r0["finish_reason"] == "stop" and r0["text"] == t0[:t0.find(stop)] and
                      r0["generated_ids"] == g0[:len(r0["generated_ids"])] and len(r0["generated_ids"]) < N,
                      "--stop %r cuts prompt 0 before the match (%d ids)" % (stop, len(r0["generated_ids"])))
                check(r1 == full["results"][1], "the other sequence of the batch runs on to N unchanged")
            j = jrun(model, ["--prompt-ids", ids, "--n", str(N), "--ignore-eos", "--stop", json.dumps(["\x01zz", stop])])
            check(j is not None and j["finish_reason"] == "stop" and j["text"] == t0[:t0.find(stop)],
                  "--stop as a JSON array of strings")

    # ---- text
    p = k3run(["--model", model, "--prompt", "The weather in Paris is", "--n", "10", "--ignore-eos"])
    lines = p.stdout.split("\n")
    if p.returncode == 0 and len(lines) >= 2:
        gen = [int(x) for x in lines[0].split(",")]
        check("\n".join(lines[1:]).rstrip("\n") == dec(gen).rstrip("\n") and len(gen) == 10,
              "--prompt: plain output = ids line + their text (tiktoken ranks)")
    else:
        check(False, "--prompt plain run: exit %d %s" % (p.returncode, p.stderr[-500:]))
    j = jrun(model, ["--prompt", "The weather in Paris is", "--n", "10", "--ignore-eos", "--temperature", "1"])
    check(j is not None and j["text"] == dec(j["generated_ids"]) and j["text"] != "", "--json text = decoded ids")

    # ---- chat
    on = write(tmp, "on.json", CHAT)
    off = write(tmp, "off.json", dict(CHAT, thinking=False))
    for path, think in ((on, True), (off, False)):
        p = k3run(["--model", model, "--chat", path])
        try:
            m = json.loads(p.stdout)
        except ValueError:
            m = None
        ok = (p.returncode == 0 and m is not None and m["role"] == "assistant" and isinstance(m["content"], str)
              and isinstance(m.get("tool_calls", []), list) and m["finish_reason"] in ("length", "stop", "tool_calls")
              and (("reasoning_content" in m) if think else not m.get("reasoning_content")))
        check(ok, "--chat thinking %s: %s" % ("on" if think else "off", p.stdout.strip()[:160] or p.stderr[-300:]))
    rows = {}
    for name, req, extra in (("5", dict(CHAT, max_tokens=5), []), ("9", dict(CHAT, max_tokens=9), []),
                             ("9n3", dict(CHAT, max_tokens=9), ["--n", "3"]),
                             ("mct", dict(CHAT, max_completion_tokens=7), [])):
        npy = os.path.join(tmp, "c%s.npy" % name)
        p = k3run(["--model", model, "--chat", write(tmp, "r%s.json" % name, req), "--ignore-eos",
                   "--dump-logits", npy] + extra)
        rows[name] = npy_rows(npy) if p.returncode == 0 else -1
    check(rows["9"] - rows["5"] == 4 and rows["5"] - rows["9n3"] == 2 and rows["mct"] - rows["5"] == 2,
          "--chat: request max_tokens / max_completion_tokens honoured, an explicit --n wins (%s)" % rows)
    p = k3run(["--model", model, "--chat", off, "--logit-bias", "%d:100" % eos])
    check(p.returncode == 0 and json.loads(p.stdout or "{}").get("finish_reason") == "stop"
          and json.loads(p.stdout)["content"] == "", "--chat: <|end_of_msg|> -> finish_reason stop")
    # a stop string in --chat: neither it nor what follows reaches reasoning / content
    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
    p = k3run(["--model", model, "--chat", write(tmp, "hi.json", hi), "--ignore-eos"])
    m = json.loads(p.stdout) if p.returncode == 0 else {}
    fld = "reasoning_content" if m.get("reasoning_content") else "content"
    txt = m.get(fld, "")
    k = next((k for k in range(6, len(txt) - 2) if "\ufffd" not in txt[k:k + 2] and txt[k:k + 2].strip()
              and txt[k:k + 2] not in txt[:k + 1]), None)
    check(k is not None, "found a chat stop string: %r" % (txt[k:k + 2] if k else None))
    if k is not None:
        stop = txt[k:k + 2]
        for how, req, extra in (("request stop", dict(hi, stop=stop), []),
                                ("--stop JSON array", hi, ["--stop", json.dumps(["\x01zz", stop])])):
            p = k3run(["--model", model, "--chat", write(tmp, "hs.json", req), "--ignore-eos"] + extra)
            m2 = json.loads(p.stdout) if p.returncode == 0 else {}
            check(m2.get(fld) == txt[:k] and stop not in m2.get("content", "") + m2.get("reasoning_content", "")
                  and m2.get("finish_reason") == "stop",
                  "--chat %s %r: the message ends before it: %r" % (how, stop, str(m2.get(fld))[-20:]))
    # --chat --ignore-eos: <|end_of_msg|> / EOS do not end the message; the length limit -> "length"
    p = k3run(["--model", model, "--chat", off, "--logit-bias", "%d:100" % eos, "--ignore-eos", "--n", "4"])
    check(p.returncode == 0 and json.loads(p.stdout or "{}").get("finish_reason") == "length",
          "--chat --ignore-eos at the length limit -> finish_reason length: %s" % p.stdout.strip()[-60:])
    # the request's logit_bias is honoured; an explicit --logit-bias wins
    lb = write(tmp, "lb.json", dict(CHAT, thinking=False, logit_bias={str(eos): 100}, max_tokens=5))
    p = k3run(["--model", model, "--chat", lb])
    check(p.returncode == 0 and json.loads(p.stdout or "{}").get("finish_reason") == "stop"
          and json.loads(p.stdout)["content"] == "", "--chat: request logit_bias {EOS: 100} stops at once")
    p = k3run(["--model", model, "--chat", lb, "--logit-bias", "%d:-100" % eos])
    check(p.returncode == 0 and json.loads(p.stdout or "{}").get("finish_reason") == "length",
          "--chat: an explicit --logit-bias wins over the request's: %s" % p.stdout.strip()[-60:])
    # request seeds are uint64 (never through a double)
    def chat_seed(seed_req, seed_flag=None):
        r = dict(CHAT, thinking=False, temperature=1, max_tokens=12)
        if seed_req is not None:
            r["seed"] = seed_req
        path = os.path.join(tmp, "seed.json")
        with open(path, "w") as f:
            f.write(json.dumps(r))  # Python ints serialise exactly
        p = k3run(["--model", model, "--chat", path] + (["--seed", str(seed_flag)] if seed_flag is not None else []))
        return p.stdout if p.returncode == 0 else "exit %d: %s" % (p.returncode, p.stderr.strip())
    r1, f1, f0 = chat_seed(big + 1), chat_seed(None, big + 1), chat_seed(None, big)
    check(r1 == f1 and r1 != f0, "--chat: request seed 2^53+1 = --seed 2^53+1 != --seed 2^53")
    rm, fm = chat_seed(2 ** 64 - 1), chat_seed(None, 2 ** 64 - 1)
    check(rm == fm and rm.startswith("{"), "--chat: request seed 2^64-1 accepted (= --seed 2^64-1): %s" % rm[:80])
    for name, req, needle in (("empty", {"messages": []}, "messages is empty"),
                              ("n2", dict(CHAT, n=2), "'n'"), ("t-1", dict(CHAT, temperature=-1), "'temperature'"),
                              ("seedneg", dict(CHAT, seed=-1), "'seed'"),
                              ("lbbad", dict(CHAT, logit_bias={"x": 1}), "logit_bias"),
                              ("nan", dict(CHAT, max_tokens="5"), "'max_tokens'")):
        p = k3run(["--model", model, "--chat", write(tmp, "b%s.json" % name, req)])
        check(p.returncode == 1 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1 and not p.stdout,
              "bad request (%s) -> exit 1 naming %s: %s" % (name, needle, p.stderr.strip()[:120]))
    p = k3run(["--model", model, "--chat", write(tmp, "n1.json", dict(CHAT, n=1, max_tokens=2))])
    check(p.returncode == 0, "--chat: request n = 1 is accepted")
    bad = write(tmp, "bad.json", {"messages": [{"role": "user", "content": 5}]})
    p = k3run(["--model", model, "--chat", bad])
    check(p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "content" in p.stderr and not p.stdout,
          "bad request -> exit 1, one line: %s" % p.stderr.strip())
    p = k3run(["--model", model, "--chat", os.path.join(tmp, "missing.json")])
    check(p.returncode == 1 and "missing.json" in p.stderr, "missing request file -> exit 1 naming it")
    p = k3run(["--model", model, "--chat", on, "--prompt", "hi"])
    check(p.returncode == 2 and "--chat" in p.stderr, "--chat + --prompt -> exit 2")

    # ---- usage errors
    for args, needle in ((["--greedy", "--temperature", "1"], "--greedy"), (["--top-p", "0"], "--top-p"),
                         (["--logit-bias", "5=1"], "--logit-bias"), (["--logit-bias", "999999:1"], "--logit-bias"),
                         (["--stop", ""], "--stop"), (["--temperature", "-1"], "--temperature"),
                         (["--min-p", "2"], "--min-p"), (["--n", "-1"], "--n"),
                         (["--stop", r'["\n\n"'], "--stop"), (["--logit-bias", "5:1e40"], "--logit-bias"),
                         (["--repetition-penalty", "1e-40"], "--repetition-penalty"),
                         (["--temperature", "1e39"], "--temperature"), (["--seed", "-1"], "--seed"),
                         (["--seed", "18446744073709551616"], "--seed")):
        p = k3run(["--model", model, "--prompt-ids", "1,2"] + args)
        check(p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1,
              "usage error %s -> exit %d: %s" % (" ".join(args), p.returncode, p.stderr.strip()[:120]))


    p = k3run(["--help"])
    check("stop strings still apply" in p.stdout + p.stderr, "--ignore-eos help says stop strings still apply")


def mode_mpi(tmp, mpi):
    model = os.path.join(tmp, "model")
    subprocess.run([K3, "make-tiny", model], check=True, stderr=subprocess.DEVNULL)
    prompts = "1,2,3,4,5,6,7,8;100,200,300;7,7,7,7,7,3000"
    common = ["--prompt-ids", prompts, "--n", "12", "--temperature", "1", "--top-p", "0.9", "--seed", "42",
              "--ignore-eos", "--chunk", "3", "--deterministic"]
    one = jrun(model, common)
    for S, E in ((2, 2), (3, 1), (1, 2)):
        j = jrun(model, common + ["--pp", str(S), "--ep", str(E), "--comm-timeout", "60"], mpi=mpi, np_=S * E)
        check(one is not None and j is not None and [r["generated_ids"] for r in j["results"]] ==
              [r["generated_ids"] for r in one["results"]], "sampled tokens under mpirun S=%d E=%d = one process" % (S, E))
    chat = write(tmp, "chat.json", CHAT)
    p1 = k3run(["--model", model, "--chat", chat, "--deterministic"])
    p2 = k3run(["--model", model, "--chat", chat, "--deterministic", "--pp", "2"], mpi=mpi, np_=2)
    check(p1.returncode == 0 and p2.returncode == 0 and p1.stdout == p2.stdout and p2.stdout.startswith("{"),
          "--chat under mpirun -np 2 prints the same message as one process")
    eos = json.load(open(os.path.join(model, "config.json"))).get("text_config", {}).get("eos_token_id", 0)
    j = jrun(model, ["--prompt-ids", prompts, "--n", "8", "--logit-bias", "%d:100" % eos, "--pp", "2", "--ep", "2"],
             mpi=mpi, np_=4)
    check(j is not None and all(r["generated_ids"] == [eos] and r["finish_reason"] == "stop" for r in j["results"]),
          "EOS under mpirun (2 x 2): every sequence stops after 1 token, the job ends")


def main():
    if len(sys.argv) < 2 or not K3 or (sys.argv[1] == "mpi" and len(sys.argv) < 3):
        sys.exit(__doc__)
    with tempfile.TemporaryDirectory(prefix="k3-run-gen-") as tmp:
        if sys.argv[1] == "unit":
            mode_unit(tmp)
        else:
            mode_mpi(tmp, sys.argv[2])
    print("run_gen %s: %d failed" % (sys.argv[1], len(fails)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
