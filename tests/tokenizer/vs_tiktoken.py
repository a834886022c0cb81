#!/usr/bin/env python3
"""vs_tiktoken.py — k3's tokenizer against PyPI tiktoken (the independent reference).

For each configuration (vocabulary x pre-tokenizer pattern x chunking) it builds a
tiktoken.Encoding from tests/data/vocab/<name>.tiktoken with K3-style special tokens (the 256-slot
K3 block of spec/K3-CHAT.md §4.1 starting right after the last rank), generates >= 5,000 varied
strings from a printed seed, encodes them with tiktoken (text segments: disallowed_special=();
control segments: allowed_special="all"; with the Kimi chunking of §4.4 reproduced here from
tokenization_kimi.py where the configuration uses it) and with `k3 tokenize --jsonl` (one process
per configuration), and compares the ids segment by segment.

The K3 pattern is given to tiktoken in its ORIGINAL form (with `&&` class intersection, which
tiktoken's fancy-regex/regex supports — checked: it splits 中文English混合 into 中文|English|混合),
so k3's PCRE2 rewrite is checked against the original, not against itself.

Exit code: 0 pass, 1 mismatch, 77 skip (tiktoken not installed).
Env: K3_BIN (k3 binary), K3_TESTDATA (tests/data), K3_TEST_SEED (default 20261129),
     K3_TOK_N (strings per configuration, default 5000).
"""
import json
import os
import random
import subprocess
import sys
import tempfile
import time

try:
    import tiktoken
except ImportError:
    print("SKIP: python module tiktoken is not installed (pip install tiktoken)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_tiktoken import K3_PAT, k3_specials, load_ranks  # noqa: E402


# tokenization_kimi.py: TIKTOKEN_MAX_ENCODE_CHARS / MAX_NO_WHITESPACES_CHARS and its splitter.
def split_ws(s, max_len):
    cur_len = 0
    cur_space = s[0].isspace() if s else False
    start = 0
    for i in range(len(s)):
        sp = s[i].isspace()
        if cur_space ^ sp:
            cur_len = 1
            cur_space = sp
        else:
            cur_len += 1
            if cur_len > max_len:
                yield s[start:i]
                start = i
                cur_len = 1
    yield s[start:]


def ref_encode(enc, text, special, kimi):
    subs = [text]
    if kimi:
        subs = [x for i in range(0, len(text), 400_000) for x in split_ws(text[i:i + 400_000], 25_000)]
    out = []
    for s in subs:
        out += enc.encode(s, allowed_special="all") if special else enc.encode(s, disallowed_special=())
    return out


# ---- string generator ----------------------------------------------------------------------
WORDS = ("the quick brown fox jumps over lazy dog Hello World getUserName HTTPRequestHandler "
         "iPhone McDonald's naïve café résumé Straße ÆØÅ İstanbul ǅemal DŽungla ΣΊΣΥΦΟΣ Ωμέγα "
         "Привет мир Ёлка").split()
CJK = "你好世界中文混合漢字かなカタカナ한국어〇⺀⻳㐀𠀀𪚥"
ARABIC = "مرحبا بالعالم العربية ١٢٣ ﷺ"
HEBREW_HINDI_THAI = "שלום עולם नमस्ते दुनिया สวัสดีชาวโลก ಕನ್ನಡ"
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇫🇷", "🧑🏿‍🚀", "©", "™", "✔︎", "🫠"]
CODE = ["def f(x):\n    return x**2\n", "if (a && b) { return -1; }", "for i in range(10):\n\tprint(i)",
        "#include <stdio.h>\nint main(void){return 0;}", "<div class=\"x\">&amp;</div>",
        "SELECT * FROM t WHERE id='42';", "x = [1, 2, 3]  # comment", "λx.x→y", "a->b::c", "//!@#$%^&*()"]
CONTRACTIONS = ["don't", "I'M", "we're", "they've", "he'd", "she'll", "it's", "'S", "'ll", "'Re", "'ſ", "o'clock"]
MARKERS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]", "[BOS]", "<|media_pad|>",
           "<|reserved_token_{N}|>", "<|open", "|>", "<|", "[EOT]"]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2003", "\u0085", "\u200b", "\u2028", "\x0b",
          "\x0c", "\x1c", "\x1f", "\u202f"]
COMBINING = ["e\u0301", "a\u0308\u0323", "\u0915\u094d\u0937", "n\u0303", "\u0301", "Z\u0351\u0352\u0353"]
CONTROL = ["\x00", "\x01", "\x07", "\x1b[31m", "\x7f", "\u0080", "\u200d", "\ufeff", "\ufffd", "\U000e0001", "\uffff"]


def rand_cp(rng):
    while True:
        r = rng.random()
        if r < 0.3:
            c = rng.randint(0x20, 0x7e)
        elif r < 0.5:
            c = rng.randint(0x80, 0x7ff)
        elif r < 0.85:
            c = rng.randint(0x800, 0xffff)
        else:
            c = rng.randint(0x10000, 0x10ffff)
        if not (0xd800 <= c <= 0xdfff) and c != 0:
            return chr(c)


def gen_piece(rng, n_base):
    k = rng.randrange(14)
    if k == 0:
        return rng.choice(WORDS)
    if k == 1:
        return "".join(rng.choice(CJK) for _ in range(rng.randint(1, 8)))
    if k == 2:
        return ARABIC[rng.randrange(len(ARABIC)):][:rng.randint(1, 20)]
    if k == 3:
        return rng.choice(EMOJI)
    if k == 4:
        return rng.choice(CODE)
    if k == 5:
        return "".join(rng.choice(SPACES) for _ in range(rng.randint(1, 6)))
    if k == 6:
        return str(rng.randint(0, 10 ** rng.randint(1, 15)))
    if k == 7:
        return rng.choice(CONTRACTIONS)
    if k == 8:
        return rng.choice(WORDS) * rng.randint(2, 30)  # very long words
    if k == 9:
        return rng.choice(CONTROL)
    if k == 10:
        return HEBREW_HINDI_THAI[rng.randrange(len(HEBREW_HINDI_THAI)):][:rng.randint(1, 15)]
    if k == 11:
        return rng.choice(COMBINING)
    if k == 12:
        return rng.choice(MARKERS).replace("{N}", str(n_base + rng.randrange(256)))
    return "".join(rand_cp(rng) for _ in range(rng.randint(1, 6)))


def gen_string(rng, n_base):
    r = rng.random()
    if r < 0.02:  # pathological runs (exercise the 25,000-char chunking where enabled)
        unit = rng.choice(["a", " ", "ab", "\n", "é", "1", "!", "中", " \t"])
        return unit * rng.randint(100, 3000)
    n = rng.randint(1, 12)
    seps = ["", " ", "", "\n", ", "]
    return "".join(gen_piece(rng, n_base) + rng.choice(seps) for _ in range(n))


def run_config(name, k3_bin, vocab_path, ranks, k3_pattern, tk_pat, kimi, seed, n_strings, long_runs,
               model_dir=None, specials=None, min_distinct=1000):
    n_base = max(ranks.values()) + 1
    specials = specials or k3_specials(n_base)
    enc = tiktoken.Encoding(f"k3test_{name}", pat_str=tk_pat, mergeable_ranks=ranks,
                            special_tokens=specials)
    rng = random.Random(f"{seed}:{name}")
    cases = []
    for i in range(n_strings):
        s = gen_string(rng, n_base)
        special = rng.random() < 0.15  # some control segments (markers become special ids)
        if special and rng.random() < 0.5:
            s = rng.choice(MARKERS[:7]) + s + rng.choice(MARKERS[:7])
        cases.append((s, special))
    # fixed hard cases
    cases += [("", False), ("<|open|>", True), ("<|open|>", False), ("[EOS][BOS]<|sep|>x", True),
              ("<|media_begin|>image 640x480<|media_content|><|media_pad|><|media_end|>", True),
              ("a" * 48, False), ("a" * 49, False), ("ab" * 400, False), (" " * 1000 + "x", False),
              ("'s'S'ſ'K", False), ("x\u0085y", False), ("\r\n\r\n \n", False),
              ("a\x00b", False), ("\x00<|open|>\x00", True), ("\x00" * 50, False)]
    if long_runs:  # > 25,000 code points: only where the Kimi chunking bounds tiktoken's O(n^2) BPE
        cases += [("a" * 60_001, False), (" " * 30_000 + "b", False), ("é" * 26_000 + " x", False),
                  ("x" + " \t" * 20_000, False), (("ab " * 9000) + "c" * 26_000, True)]
    t0 = time.time()
    want = [ref_encode(enc, s, sp, kimi) for s, sp in cases]
    t_ref = time.time() - t0
    args = [k3_bin, "tokenize", "--pattern", k3_pattern, "--jsonl"]
    args += ["--model", model_dir] if model_dir else ["--vocab", vocab_path]
    if not kimi:
        args.append("--no-kimi-chunking")
    stdin = "".join(json.dumps({"text": s, "special": sp}) + "\n" for s, sp in cases)
    t0 = time.time()
    p = subprocess.run(args, input=stdin.encode(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t_k3 = time.time() - t0
    if p.returncode != 0:
        print(f"[{name}] k3 tokenize failed rc={p.returncode}: {p.stderr.decode(errors='replace')[:2000]}")
        return False
    got = [json.loads(l) for l in p.stdout.decode().splitlines()]
    if len(got) != len(cases):
        print(f"[{name}] k3 returned {len(got)} lines for {len(cases)} inputs")
        return False
    bad = 0
    n_ids = 0
    for (s, sp), w, g in zip(cases, want, got):
        n_ids += len(w)
        if w != g:
            bad += 1
            if bad <= 5:
                i = next((k for k in range(min(len(w), len(g))) if w[k] != g[k]), min(len(w), len(g)))
                print(f"[{name}] MISMATCH special={sp} text={s[:200]!r} (len {len(s)})\n"
                      f"   first diff at {i}: tiktoken {w[max(0, i - 2):i + 4]} k3 {g[max(0, i - 2):i + 4]}")
    # degenerate-input guard: the corpus must produce many distinct ids and use specials
    distinct = len({x for w in want for x in w})
    n_spec = sum(1 for w in want for x in w if x >= n_base)
    print(f"[{name}] {len(cases)} segments, {n_ids} ids ({distinct} distinct, {n_spec} special), "
          f"mismatches {bad}; tiktoken {t_ref:.2f}s, k3 (incl. start-up) {t_k3:.2f}s")
    if distinct < min_distinct or n_spec < 50:
        print(f"[{name}] corpus is degenerate")
        return False
    return bad == 0


def main():
    k3_bin = os.environ.get("K3_BIN", "build/k3")
    shared = os.environ.get("K3_TESTDATA", os.path.join(os.path.dirname(__file__), "..", "data"))
    seed = int(os.environ.get("K3_TEST_SEED", "20261129"))
    n = int(os.environ.get("K3_TOK_N", "5000"))
    print(f"vs_tiktoken: tiktoken {tiktoken.__version__}, seed {seed}, {n} strings per configuration")
    o200k = os.path.join(shared, "vocab/o200k_base.tiktoken")
    cl100k = os.path.join(shared, "vocab/cl100k_base.tiktoken")
    meta = {k: json.load(open(os.path.join(shared, f"vocab/{k}.meta.json"))) for k in ("o200k_base", "cl100k_base")}
    r_o, r_c = load_ranks(o200k), load_ranks(cl100k)
    configs = [
        ("o200k+k3pat+kimi", o200k, r_o, "k3", K3_PAT, True, True),
        ("cl100k+cl100kpat", cl100k, r_c, "cl100k", meta["cl100k_base"]["pat_str"], False, False),
        ("cl100k+k3pat+kimi", cl100k, r_c, "k3", K3_PAT, True, True),
        ("o200k+o200kpat", o200k, r_o, "o200k", meta["o200k_base"]["pat_str"], False, False),
    ]
    ok = True
    for name, path, ranks, kp, tp, kimi, long_runs in configs:
        ok &= run_config(name, k3_bin, path, ranks, kp, tp, kimi, seed, n, long_runs)
    # A model directory from `k3 make-tiny` (its own BPE vocabulary + tokenizer_config.json):
    # exercises --model, i.e. specials read from added_tokens_decoder.
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([k3_bin, "make-tiny", d, "--preset", "tiny"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if p.returncode != 0:
            print("[tiny-model] k3 make-tiny failed; cannot check --model:", p.stderr.decode(errors="replace")[-500:])
            ok = False
        else:
            ranks = load_ranks(os.path.join(d, "tiktoken.model"))
            cfg = json.load(open(os.path.join(d, "tokenizer_config.json")))
            sp = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
            ok &= run_config("tiny-model+k3pat+kimi", k3_bin, None, ranks, "k3", K3_PAT, True, seed, n, True,
                             model_dir=d, specials=sp, min_distinct=300)
    print("vs_tiktoken:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
