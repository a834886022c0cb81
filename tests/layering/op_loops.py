#!/usr/bin/env python3
"""op_loops.py — the step's op-count rule (docs/DESIGN.md §3a), checked on the sources.

A stage step issues a number of op calls that depends only on its layers: in layers/ and experts/
no loop over sequences, heads or tokens (or rows / items, which are tokens × slots) surrounds an
op call. A loop counts as such when its header names a batch size: n_seqs, n_tokens, T, Tc, H,
n_heads, n_items, n_rows, rows, the row tiles of a count (p0 < n, t0 < T, ...) or a token /
sequence index (t, i over b->...). An op call is `ops->NAME(`, `be->ops->NAME(` or `->ops->NAME(`;
a call of a function of these folders that itself issues ops (k3_moe_*, k3_layers_*) counts too.

Usage: op_loops.py [ROOT]            exit 0 = clean, 1 = a loop around an op call (file:line)
       op_loops.py --self-test [ROOT]  injects such a loop into a temporary copy of each folder
                                       and checks it is reported (the checker seen to fail)
"""
import os
import re
import shutil
import sys
import tempfile

FOLDERS = ("layers", "experts")
# a loop header that walks a batch: its bound or its counter names sequences, heads, tokens, rows
BATCH = re.compile(
    r"\b(n_seqs|n_tokens|T|Tc|H|n_heads|kda_n_heads|n_items|n_rows|rows|n_q|max_seqs)\b"
    r"|<\s*n\b|\bp0\b|\bt0\b|\bi\s*<\s*b->")
OPCALL = re.compile(r"(\bops->|->ops->)\w+\s*\(|\bk3_(moe|layers)_\w+\s*\(")


def strip_comments(src):
    """Comments and the insides of string and char literals blanked (lines kept): a ')' in a
    message such as "outside [0, %lld)" must not end a loop's statement for loop_body."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))
    src = re.sub(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', blank, src,
                 flags=re.S)
    return src


def loop_body(src, i):
    """src[i] is just after the for (...) header: the statement it governs (end index)."""
    while i < len(src) and src[i].isspace():
        i += 1
    if i < len(src) and src[i] == "{":
        depth = 0
        for j in range(i, len(src)):
            depth += src[j] == "{"
            depth -= src[j] == "}"
            if depth == 0:
                return j + 1
        return len(src)
    depth = 0  # one statement: up to its ';' at paren depth 0
    for j in range(i, len(src)):
        depth += src[j] == "("
        depth -= src[j] == ")"
        if src[j] == ";" and depth == 0:
            return j + 1
    return len(src)


def check_file(path):
    src = strip_comments(open(path, encoding="utf-8").read())
    bad = []
    for m in re.finditer(r"\b(for|while)\s*\(", src):
        depth, j = 0, m.end() - 1
        for j in range(m.end() - 1, len(src)):  # the header's closing paren
            depth += src[j] == "("
            depth -= src[j] == ")"
            if depth == 0:
                break
        header = src[m.end():j]
        if not BATCH.search(header):
            continue
        body = src[j + 1:loop_body(src, j + 1)]
        call = OPCALL.search(body)
        if call:
            line = src.count("\n", 0, m.start()) + 1
            bad.append(f"{path}:{line}: a loop over the batch ({header.strip()}) calls "
                       f"{call.group(0).rstrip('( ')}")
    return bad


def check(root):
    bad = []
    for folder in FOLDERS:
        d = os.path.join(root, folder)
        for name in sorted(os.listdir(d)):
            if name.endswith(".c"):
                bad += check_file(os.path.join(d, name))
    return bad


def self_test(root):
    ok = True
    injections = {
        "layers": "static void op_loop_probe(k3_backend *be, int n_seqs, float *y) {\n"
                  "    for (int i = 0; i < n_seqs; i++) be->ops->fill(be, y + i, 1, 0.0f);\n}\n",
        "experts": "static void op_loop_probe(k3_backend *be, int64_t T, float *y) {\n"
                   "    for (int64_t t = 0; t < T; t++) {\n"
                   "        K3_TRY(be->ops->fill(be, y + t, 1, 0.0f));\n    }\n}\n",
    }
    for folder, code in injections.items():
        with tempfile.TemporaryDirectory() as tmp:
            for f in FOLDERS:
                shutil.copytree(os.path.join(root, f), os.path.join(tmp, f))
            victim = sorted(n for n in os.listdir(os.path.join(tmp, folder)) if n.endswith(".c"))[0]
            with open(os.path.join(tmp, folder, victim), "a", encoding="utf-8") as fh:
                fh.write(code)
            found = [b for b in check(tmp) if victim in b]
            print(f"self-test {folder}/{victim}: {'caught' if found else 'MISSED'}")
            ok &= bool(found)
    return ok


def main():
    args = [a for a in sys.argv[1:] if a != "--self-test"]
    root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    if "--self-test" in sys.argv[1:]:
        if check(root):
            print("op_loops self-test: the tree itself is not clean")
            return 1
        return 0 if self_test(root) else 1
    bad = check(root)
    for b in bad:
        print(b)
    print(f"op_loops: {len(bad)} loop(s) over the batch around an op call in {', '.join(FOLDERS)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
