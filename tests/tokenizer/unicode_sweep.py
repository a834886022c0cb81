#!/usr/bin/env python3
"""unicode_sweep.py — k3's tokenizer against PyPI tiktoken over ALL of Unicode (issue 8).

Cases. Every scalar value U+0000..U+10FFFF (surrogates excluded) in 8 contexts:
    alone | before "\\n" | after a Latin letter | after a Han ideograph | between digits |
    after a space | a run of three copies of itself | after a punctuation run "!!" (the only one
    of these where a letter's or number's membership in [^\\s\\p{L}\\p{N}] shows: elsewhere the
    letter/number alternatives take it first)
plus every code point whose Script differs from its Script_Extensions (e.g. U+3001 、 U+3002 。
U+3006 〆 U+30FB ・, which PCRE2 >= 10.40 puts in a bare \\p{Han}) next to Han, Latin and a newline
(8 contexts), and every General_Category boundary: each pair of adjacent code points (c-1, c) whose
categories differ, as a 2-character string in both orders. Unicode data: UCD 16.0 (unicodedataplus).

Configurations, each ONE `k3 tokenize --jsonl --no-kimi-chunking` process:
  o200k+k3pat, o200k+o200kpat, cl100k+cl100kpat   the official ranks (tests/data/vocab) with the K3
      pattern (tiktoken gets the ORIGINAL pattern with its `&&` intersections, tests/k3_tiktoken.py)
      and tiktoken's own o200k / cl100k pat_str (tests/data/vocab/*.meta.json);
  pieces+k3pat, pieces+o200kpat, pieces+cl100kpat  a made-up vocabulary that makes the
      pre-tokenizer's pieces visible in the ids: the 256 bytes plus one token for every pair
      (end of a character, start of a character), so BPE joins two adjacent characters whenever they
      are in one piece, and never across pieces. With the real ranks most piece differences are
      hidden (the BPE of rare characters is the same bytes either way): there, k3 with PCRE2 10.42's
      own Unicode 14.0 classes differed in only 20 strings, while the pieces differed at 9,392
      letters and numbers assigned in Unicode 15.0-16.0.

Batching: the cases of a configuration are sent as lines of ~1,000 cases joined by the special token
`[EOT]` (tiktoken: encode(allowed_special="all"); k3: specials allowed). Both tokenizers encode the
text between two special tokens on its own (the regex never sees past it), exactly as if each case
were a separate string, and the [EOT] ids split the output back into cases. tiktoken is called
through its Rust core per line (its thread-pool batch API costs ~30 us a string).

On a difference it prints the first differing code point (U+XXXX and its Unicode name) with the
context and both id lists; 0 differences are required.
Seen to fail (the fix broken on purpose, see the commit message): with the old bare `\\p{Han}`
(Script_Extensions) in the K3 pattern, o200k+k3pat reports first
  U+3001 IDEOGRAPHIC COMMA, context before \\n: '、\\n': tiktoken [19344] k3 [1395,198]
and with PCRE2's own Unicode 14.0 classes, cl100k+cl100kpat reports first
  U+1D2C0 KAKTOVIK NUMERAL ZERO, context after a space: ' 𝋀': tiktoken [220,57352,233,222] k3 [82350,233,222]
and the pieces configurations report U+0897 ARABIC PEPET (a mark new in 16.0) and ~9,400 more.

Unicode versions: tiktoken 0.14's regex crate classifies by Unicode 16.0, and k3's classes
(coordinator/tokenizer_unicode.h) are 16.0. The test first checks that tiktoken really uses 16.0
(U+1C89, a 16.0 letter, is a letter; U+A7CE, a 17.0 one, is not) and fails with that message
otherwise: another tiktoken needs regenerated classes, not a hunt for differing code points.

Exit: 0 pass, 1 differences (or k3 failed), 77 skip (tiktoken or unicodedataplus missing).
Env: K3_BIN, K3_TESTDATA; K3_SWEEP_CONFIGS (comma list of the names above, default all);
K3_SWEEP_DUMP=FILE (every differing case, tab-separated, for analysis); K3_SWEEP_REPORT=N (default 5).
"""
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

try:
    import tiktoken
except ImportError:
    print("SKIP: python module tiktoken is not installed (pip install -r tests/requirements.txt)")
    sys.exit(77)
try:
    import unicodedataplus as ucd  # UCD 16.0: General_Category, Script, Script_Extensions, names
except ImportError:
    print("SKIP: python module unicodedataplus is not installed (pip install -r tests/requirements.txt)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from k3_tiktoken import K3_PAT, k3_specials, load_ranks  # noqa: E402

UNICODE_VERSION = "16.0.0"  # of coordinator/tokenizer_unicode.h = tiktoken 0.14's regex crate
SEP = "[EOT]"  # a K3 special token: cases never contain it, nor a prefix of it after one of theirs
BATCH = 1000   # cases per line (a multiple of the 8 contexts)

CONTEXTS = [
    ("alone", lambda c: c),
    ("before \\n", lambda c: c + "\n"),
    ("after Latin 'a'", lambda c: "a" + c),
    ("after Han '中'", lambda c: "中" + c),
    ("between digits", lambda c: "1" + c + "2"),
    ("after a space", lambda c: " " + c),
    ("run of 3", lambda c: c * 3),
    ("after a punctuation run '!!'", lambda c: "!!" + c),  # L|N membership: does it end the run?
]
SCX_CONTEXTS = [
    ("scx: after Han", lambda c: "中" + c), ("scx: before Han", lambda c: c + "中"),
    ("scx: after Latin", lambda c: "a" + c), ("scx: before Latin", lambda c: c + "a"),
    ("scx: before \\n", lambda c: c + "\n"), ("scx: Han + it + \\n", lambda c: "中" + c + "\n"),
    ("scx: Latin + it + \\n", lambda c: "a" + c + "\n"), ("scx: twice", lambda c: c + c),
]


def scalar_values():
    return [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]


class Cases:
    """All cases, in order: the scalar values (code point major, 7 contexts each), then the
    Script != Script_Extensions pairs, then the category boundaries. case(i) -> (cp, label, text)."""

    def __init__(self):
        self.cps = scalar_values()
        scx_table = ucd.property_value_aliases["script"]  # long name -> [short names]
        self.scx = [c for c in self.cps if ucd.script_extensions(chr(c)) != scx_table[ucd.script(chr(c))][:1]]
        self.gc = []
        prev = None
        for c in self.cps:
            g = ucd.category(chr(c))
            if prev is not None and prev[0] == c - 1 and prev[1] != g:
                self.gc.append((c, prev[1], g))
            prev = (c, g)
        self.n_main = len(self.cps) * len(CONTEXTS)
        self.n_scx = len(self.scx) * len(SCX_CONTEXTS)
        self.n = self.n_main + self.n_scx + 2 * len(self.gc)

    def case(self, i):
        if i < self.n_main:
            cp = self.cps[i // len(CONTEXTS)]
            label, f = CONTEXTS[i % len(CONTEXTS)]
            return cp, label, f(chr(cp))
        i -= self.n_main
        if i < self.n_scx:
            cp = self.scx[i // len(SCX_CONTEXTS)]
            label, f = SCX_CONTEXTS[i % len(SCX_CONTEXTS)]
            return cp, label, f(chr(cp))
        i -= self.n_scx
        cp, g0, g1 = self.gc[i // 2]
        if i % 2 == 0:
            return cp, f"category boundary U+{cp - 1:04X} {g0} | U+{cp:04X} {g1}", chr(cp - 1) + chr(cp)
        return cp, f"category boundary reversed: U+{cp:04X} {g1} | U+{cp - 1:04X} {g0}", chr(cp) + chr(cp - 1)

    def batch(self, b):
        """The text of line b: its cases joined by SEP (fast path for the main region)."""
        lo, hi = b * BATCH, min(self.n, (b + 1) * BATCH)
        if hi <= self.n_main and lo % len(CONTEXTS) == 0 and hi % len(CONTEXTS) == 0:
            parts = []
            for cp in self.cps[lo // len(CONTEXTS):hi // len(CONTEXTS)]:
                c = chr(cp)
                parts += (c, c + "\n", "a" + c, "中" + c, "1" + c + "2", " " + c, c + c + c, "!!" + c)
            return SEP.join(parts)
        return SEP.join(self.case(i)[2] for i in range(lo, hi))

    def n_batches(self):
        return (self.n + BATCH - 1) // BATCH


def pieces_vocab(path):
    """The 256 bytes + every (end of a character, start of a character) byte pair, so that BPE
    merges two adjacent characters only if the pre-tokenizer put them in one piece. Pairs that
    start a multi-byte character rank first: in "!!" + c, (!, lead byte of c) merges before (!, !),
    so "!!c" as one piece and "!!" | "c" give different ids."""
    import base64
    ends = list(range(0x00, 0x80)) + list(range(0x80, 0xC0))    # ASCII or a continuation byte
    starts = list(range(0xC2, 0xF5)) + list(range(0x00, 0x80))  # a lead byte, or ASCII
    toks = [bytes([b]) for b in range(256)] + [bytes([x, y]) for y in starts for x in ends]
    with open(path, "wb") as f:
        for r, t in enumerate(toks):
            f.write(base64.b64encode(t) + b" %d\n" % r)
    return {t: r for r, t in enumerate(toks)}


def describe(cp):
    name = ucd.name(chr(cp), "")
    return f"U+{cp:04X} " + (name if name else f"(no name, category {ucd.category(chr(cp))})")


def check_unicode_version():
    """tiktoken's regex must classify by Unicode 16.0, the version of k3's classes."""
    probe = tiktoken.Encoding("sweep_probe", pat_str=r"\p{L}", mergeable_ranks={bytes([b]): b for b in range(256)},
                              special_tokens={})
    new16 = probe.encode_ordinary("\u1c89")  # CYRILLIC CAPITAL LETTER TJE (16.0)
    new17 = probe.encode_ordinary("\ua7ce")  # a Latin capital letter of 17.0
    if not new16 or new17:
        print(f"FAIL: tiktoken {tiktoken.__version__} does not classify by Unicode {UNICODE_VERSION} "
              f"(U+1C89 a letter: {bool(new16)}, U+A7CE a letter: {bool(new17)}); k3's classes are "
              f"Unicode {UNICODE_VERSION}: pin tiktoken==0.14.0 (tests/requirements.txt) or regenerate "
              "coordinator/tokenizer_unicode.h (tests/tokenizer/gen_unicode_classes.py) for its version")
        return False
    return True


def run_config(name, k3_bin, vocab, ranks, k3_pattern, tk_pat, cases, lines, dump, n_report):
    specials = k3_specials(max(ranks.values()) + 1)
    enc = tiktoken.Encoding(f"sweep_{name}", pat_str=tk_pat, mergeable_ranks=ranks, special_tokens=specials)
    sep_id = specials[SEP]
    allowed = set(specials)
    args = [k3_bin, "tokenize", "--vocab", vocab, "--pattern", k3_pattern, "--jsonl", "--no-kimi-chunking"]
    t0 = time.time()
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = [], []

    def writer():
        try:
            for i in range(0, len(lines), 64):
                p.stdin.write(b"".join(lines[i:i + 64]))
        except BrokenPipeError:
            pass
        finally:
            try:
                p.stdin.close()
            except BrokenPipeError:
                pass

    threads = [threading.Thread(target=writer), threading.Thread(target=lambda: out.append(p.stdout.read())),
               threading.Thread(target=lambda: err.append(p.stderr.read()))]
    for t in threads:
        t.start()
    encode = enc._core_bpe.encode  # releases the GIL: two threads use both cores beside k3

    def ref(b):
        return json.dumps(encode(cases.batch(b), allowed), separators=(",", ":"))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        want = list(pool.map(ref, range(cases.n_batches()), chunksize=16))
    t_ref = time.time() - t0
    for t in threads:
        t.join()
    rc = p.wait()
    t_all = time.time() - t0
    if rc != 0:
        print(f"[{name}] FAIL: k3 tokenize exited {rc}: {err[0].decode(errors='replace')[:1000]}")
        return False
    got = out[0].decode().split("\n")
    if got and got[-1] == "":
        got.pop()
    print(f"[{name}] {cases.n} cases in {len(want)} lines: tiktoken {t_ref:.1f}s, all {t_all:.1f}s")
    if got == want:
        return True
    if len(got) != len(want):
        print(f"[{name}] FAIL: k3 printed {len(got)} lines for {len(want)}")
    n_bad = 0
    dump_f = open(dump, "a", encoding="utf-8") if dump else None
    for b, (w, g) in enumerate(zip(want, got)):
        if w == g:
            continue
        ws, gs = split_ids(json.loads(w), sep_id), split_ids(json.loads(g), sep_id)
        if len(ws) != len(gs):
            print(f"[{name}] line {b}: k3 split into {len(gs)} cases, tiktoken {len(ws)}")
        for j, (wi, gi) in enumerate(zip(ws, gs)):
            if wi == gi:
                continue
            n_bad += 1
            cp, label, text = cases.case(b * BATCH + j)
            if n_bad <= n_report:
                print(f"[{name}] DIFF{' (first)' if n_bad == 1 else ''} {describe(cp)}, context {label}: "
                      f"{text!r}: tiktoken {wi} k3 {gi}")
            if dump_f:
                dump_f.write(f"{name}\t{cp:04X}\t{label}\t{ucd.category(chr(cp))}\t{ucd.age(chr(cp))}\t"
                             f"{text!r}\t{wi}\t{gi}\n")
    if dump_f:
        dump_f.close()
    print(f"[{name}] FAIL: {n_bad} of {cases.n} cases differ")
    return False


def split_ids(ids, sep_id):
    out, cur = [], []
    for x in ids:
        if x == sep_id:
            out.append(cur)
            cur = []
        else:
            cur.append(x)
    out.append(cur)
    return out


def main():
    k3_bin = os.environ.get("K3_BIN", "build/k3")
    shared = os.environ.get("K3_TESTDATA", os.path.join(os.path.dirname(__file__), "..", "data"))
    names = ["o200k+k3pat", "o200k+o200kpat", "cl100k+cl100kpat", "pieces+k3pat", "pieces+o200kpat",
             "pieces+cl100kpat"]
    want_cfgs = os.environ.get("K3_SWEEP_CONFIGS", ",".join(names)).split(",")
    unknown = [c for c in want_cfgs if c not in names]
    if unknown:
        print(f"unicode_sweep: unknown configuration(s) {unknown}; known: {names}")
        return 1
    dump = os.environ.get("K3_SWEEP_DUMP")
    n_report = int(os.environ.get("K3_SWEEP_REPORT", "5"))
    if dump:
        open(dump, "w").close()
    if ucd.unidata_version != UNICODE_VERSION:
        print(f"SKIP: unicodedataplus has Unicode {ucd.unidata_version}, the sweep's case lists want "
              f"{UNICODE_VERSION} (pip install -r tests/requirements.txt)")
        return 77
    if not check_unicode_version():
        return 1
    t0 = time.time()
    cases = Cases()
    print(f"unicode_sweep: tiktoken {tiktoken.__version__}, Unicode {UNICODE_VERSION}: {cases.n} cases per "
          f"configuration ({len(cases.cps)} scalar values x {len(CONTEXTS)} contexts, {len(cases.scx)} code "
          f"points with Script != Script_Extensions x {len(SCX_CONTEXTS)}, {len(cases.gc)} category boundaries "
          f"x 2)")
    lines = [(json.dumps(cases.batch(b), ensure_ascii=False) + "\n").encode() for b in range(cases.n_batches())]
    meta = {k: json.load(open(os.path.join(shared, f"vocab/{k}.meta.json"))) for k in ("o200k_base", "cl100k_base")}
    pats = {"k3pat": ("k3", K3_PAT), "o200kpat": ("o200k", meta["o200k_base"]["pat_str"]),
            "cl100kpat": ("cl100k", meta["cl100k_base"]["pat_str"])}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        vocabs = {"o200k": os.path.join(shared, "vocab/o200k_base.tiktoken"),
                  "cl100k": os.path.join(shared, "vocab/cl100k_base.tiktoken"),
                  "pieces": os.path.join(tmp, "pieces.tiktoken")}
        loaded = {}
        for name in names:
            if name not in want_cfgs:
                continue
            v, pat = name.split("+")
            if v not in loaded:
                loaded[v] = pieces_vocab(vocabs[v]) if v == "pieces" else load_ranks(vocabs[v])
            kp, tp = pats[pat]
            ok &= run_config(name, k3_bin, vocabs[v], loaded[v], kp, tp, cases, lines, dump, n_report)
    print(f"unicode_sweep: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
