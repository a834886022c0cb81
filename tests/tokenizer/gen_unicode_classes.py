#!/usr/bin/env python3
"""gen_unicode_classes.py — writes coordinator/tokenizer_unicode.h: the Unicode property classes of
the pre-tokenizer patterns (spec/K3-CHAT.md §4.2) as explicit PCRE2 code point ranges.

Why: tiktoken (the reference) matches \\p{L}, \\p{N}, \\p{M}, \\p{Lu}, ... and Script=Han with the
Unicode tables of Rust's regex crate, Unicode 16.0 in tiktoken 0.14, while Debian 12's PCRE2 10.42
has Unicode 14.0 tables: 9,272 letters, 120 numbers, 93 marks and 4,815 Han ideographs assigned in
15.0-16.0 (Kawi, CJK Extensions H and I, Garay, Kaktovik numerals, ...) are "unassigned" to it.
PCRE2 stays the matcher; only the class contents come from here. Script=Han means the Script
property, not Script_Extensions (PCRE2 >= 10.40 matches a bare \\p{Han} against the latter, which
adds 、。〆・ ...).

Data source: the Unicode Character Database 16.0.0 (General_Category, Script, DerivedAge) read
through PyPI `unicodedataplus==16.0.0.post1`, whose tables are generated from UCD 16.0.0. Nothing
is derived from tiktoken: tests/tokenizer/unicode_sweep.py proves the result against it.
White_Space is not generated (25 code points, unchanged since Unicode 6.3; tokenizer.c spells it).

tokenizer.c uses three spellings of each class (all exact where they are used):
  BASE      PCRE2's own \\p{..} (one table lookup a character) for text without a code point of
            K3_UC_DIFF_RANGES: the code points assigned after BASE_VERSION (14.0) that belong to a
            class. Where PCRE2's tables are of a version in [14.0, 16.0] the two definitions agree on
            every other code point, and a regex only looks at the characters of its subject.
  ADDED     PCRE2's \\p{..} plus K3_UCADD_* (the class members assigned after 14.0), for text that
            holds such a code point (rare: scripts and ideographs new in 15.0-16.0).
  EXPLICIT  the whole classes K3_UC_* as ranges: for a PCRE2 of any other Unicode version. A class
            of ~1,000 ranges is a linear compare chain in PCRE2's JIT (~10x slower on CJK text).
Premise of BASE/ADDED, checked here against the installed PCRE2 when its tables are 14.0: for every
class, PCRE2's class + the additions == the 16.0 class (no code point left a class between 14.0
and 16.0).

Class bodies (each goes inside [...] or [^...]):
  K3_UC_LN  L | N        K3_UC_L  L        K3_UC_N  N        K3_UC_HAN  Script=Han
  K3_UC_UPPER  Lu|Lt|Lm|Lo|M     K3_UC_LOWER  Ll|Lm|Lo|M     (o200k)
  K3_UC_UPPER_NOHAN / K3_UC_LOWER_NOHAN  the same minus Script=Han (K3's `[... && [^\\p{Han}]]`)
  K3_UCADD_LN, _L, _N, _HAN, _UPPER, _LOWER   the members assigned after 14.0

usage: python3 tests/tokenizer/gen_unicode_classes.py [OUT]   (default coordinator/tokenizer_unicode.h)
       python3 tests/tokenizer/gen_unicode_classes.py --check  (exit 1 if the committed file is stale)
"""
import os
import sys

try:
    import unicodedataplus as ucd
except ImportError:
    print("SKIP: python module unicodedataplus is not installed (pip install -r tests/requirements.txt)")
    sys.exit(77)

UNICODE_VERSION = "16.0.0"
BASE_VERSION = "14.0"  # Unicode of Debian 12's PCRE2 10.42
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.normpath(os.path.join(HERE, "..", "..", "coordinator", "tokenizer_unicode.h"))


def scalar_values():
    return (c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)


def ranges(cps):
    """Code points -> sorted [(lo, hi)]; a range may bridge the surrogates (valid UTF-8 never holds
    one), so PCRE2 gets fewer ranges."""
    out = []
    for c in sorted(cps):
        if out and (out[-1][1] + 1 == c or (out[-1][1] == 0xD7FF and c == 0xE000)):
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def wrap(items, indent="    ", width=92):
    lines, cur = [], ""
    for it in items:
        if cur and len(cur) + len(it) > width:
            lines.append(cur)
            cur = ""
        cur += it
    if cur:
        lines.append(cur)
    return lines


def class_macro(name, comment, cps):
    """#define NAME "\\x{41}-\\x{5A}..." (C source of PCRE2 escapes)."""
    rs = ranges(cps)
    esc = [f"\\\\x{{{lo:X}}}" if lo == hi else f"\\\\x{{{lo:X}}}-\\\\x{{{hi:X}}}" for lo, hi in rs]
    body = " \\\n".join(f'    "{ln}"' for ln in wrap(esc)) if esc else '    ""'
    return f"/* {comment}: {len(cps)} code points, {len(rs)} ranges */\n#define {name} \\\n{body}\n"


def table_macro(name, comment, cps):
    """#define NAME {0x897, 0x897}, {...}  (an initializer of uint32_t [][2])"""
    rs = ranges(cps)
    items = [f"{{0x{lo:X}, 0x{hi:X}}}, " for lo, hi in rs]
    body = " \\\n".join(f"    {ln.rstrip()}" for ln in wrap(items))
    return f"/* {comment}: {len(cps)} code points, {len(rs)} ranges */\n#define {name} \\\n{body}\n"


def verify_with_pcre2(checks):
    """When the installed PCRE2 has Unicode BASE_VERSION tables: [PCRE2 class + additions] must be
    exactly the 16.0 class for every scalar value. Skipped (with a note) otherwise."""
    import ctypes
    try:
        lib = ctypes.CDLL("libpcre2-8.so.0")
    except OSError:
        print("gen_unicode_classes: libpcre2-8 not found; the BASE/ADDED premise is not checked here")
        return
    buf = ctypes.create_string_buffer(64)
    lib.pcre2_config_8(ctypes.c_uint32(10), buf)  # PCRE2_CONFIG_UNICODE_VERSION
    ver = buf.value.decode()
    if not ver.startswith(BASE_VERSION + "."):
        print(f"gen_unicode_classes: PCRE2 has Unicode {ver}, not {BASE_VERSION}: premise not checked here")
        return
    lib.pcre2_compile_8.restype = ctypes.c_void_p
    lib.pcre2_compile_8.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.POINTER(ctypes.c_int),
                                    ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p]
    lib.pcre2_match_data_create_from_pattern_8.restype = ctypes.c_void_p
    lib.pcre2_match_data_create_from_pattern_8.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.pcre2_match_8.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                  ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p]
    utf_ucp, anchored = 0x00080000 | 0x00020000, 0x80000000
    subjects = [(c, chr(c).encode()) for c in scalar_values()]
    for props, want, add in checks:
        body = props + "".join(f"\\x{{{lo:X}}}-\\x{{{hi:X}}}" for lo, hi in ranges(add))
        pat = f"[{body}]".encode()
        err, off = ctypes.c_int(), ctypes.c_size_t()
        code = lib.pcre2_compile_8(pat, len(pat), utf_ucp, ctypes.byref(err), ctypes.byref(off), None)
        if not code:
            sys.exit(f"gen_unicode_classes: PCRE2 cannot compile [{props} + additions] (error {err.value})")
        md = lib.pcre2_match_data_create_from_pattern_8(code, None)
        got = {c for c, b in subjects if lib.pcre2_match_8(code, b, len(b), 0, anchored, md, None) >= 0}
        if got != want:
            bad = sorted(got ^ want)
            sys.exit(f"gen_unicode_classes: PCRE2 {ver} [{props}] + additions differs from Unicode "
                     f"{UNICODE_VERSION} at {len(bad)} code points, first U+{bad[0]:04X}")
    print(f"gen_unicode_classes: PCRE2 (Unicode {ver}) classes + additions == the Unicode {UNICODE_VERSION} classes")


def build(verify=True):
    if ucd.unidata_version != UNICODE_VERSION:
        sys.exit(f"gen_unicode_classes: unicodedataplus has Unicode {ucd.unidata_version}, want "
                 f"{UNICODE_VERSION} (pip install unicodedataplus==16.0.0.post1)")
    base = tuple(int(x) for x in BASE_VERSION.split("."))
    gc, han, new = {}, set(), set()
    for c in scalar_values():
        ch = chr(c)
        gc[c] = ucd.category(ch)
        if ucd.script(ch) == "Han":
            han.add(c)
        age = ucd.age(ch)  # DerivedAge: "1.1" .. "16.0", or "Unassigned"
        if age[:1].isdigit() and tuple(int(x) for x in age.split(".")) > base:
            new.add(c)

    def cat(*cats):
        return {c for c, g in gc.items() if g in cats or g[0] in cats}

    L, N, M = cat("L"), cat("N"), cat("M")
    upper = cat("Lu", "Lt", "Lm", "Lo") | M
    lower = cat("Ll", "Lm", "Lo") | M
    after = f"assigned after Unicode {BASE_VERSION}"
    classes = [
        ("K3_UC_LN", "General_Category L or N", L | N),
        ("K3_UC_L", "General_Category L (letters)", L),
        ("K3_UC_N", "General_Category N (numbers)", N),
        ("K3_UC_HAN", "Script=Han (the Script property, not Script_Extensions)", han),
        ("K3_UC_UPPER", "Lu | Lt | Lm | Lo | M", upper),
        ("K3_UC_LOWER", "Ll | Lm | Lo | M", lower),
        ("K3_UC_UPPER_NOHAN", "(Lu | Lt | Lm | Lo | M) minus Script=Han", upper - han),
        ("K3_UC_LOWER_NOHAN", "(Ll | Lm | Lo | M) minus Script=Han", lower - han),
        ("K3_UCADD_LN", "L | N " + after, (L | N) & new),
        ("K3_UCADD_L", "L " + after, L & new),
        ("K3_UCADD_N", "N " + after, N & new),
        ("K3_UCADD_HAN", "Script=Han " + after, han & new),
        ("K3_UCADD_UPPER", "Lu | Lt | Lm | Lo | M " + after, upper & new),
        ("K3_UCADD_LOWER", "Ll | Lm | Lo | M " + after, lower & new),
    ]
    diff = (L | N | M | han) & new
    if verify:
        verify_with_pcre2([(r"\p{L}\p{N}", L | N, L & new | N & new), (r"\p{L}", L, L & new),
                           (r"\p{N}", N, N & new), (r"\p{sc:Han}", han, han & new),
                           (r"\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}", upper, upper & new),
                           (r"\p{Ll}\p{Lm}\p{Lo}\p{M}", lower, lower & new)])
    head = f"""/* tokenizer_unicode.h — GENERATED by tests/tokenizer/gen_unicode_classes.py; do not edit.
 *
 * The Unicode classes of the pre-tokenizer patterns (spec/K3-CHAT.md §4.2) as PCRE2 code point
 * ranges, from the Unicode Character Database {UNICODE_VERSION} (General_Category, Script,
 * DerivedAge; read through PyPI unicodedataplus==16.0.0.post1). {UNICODE_VERSION} is the Unicode
 * version of the Rust regex crate in tiktoken 0.14, the reference; Debian 12's PCRE2 10.42 has
 * 14.0 tables. Script=Han is the Script property (PCRE2 >= 10.40 matches a bare \p{{Han}}
 * against Script_Extensions). K3_UC_* / K3_UCADD_* are class BODIES for [...] / [^...]; ranges
 * may bridge the surrogates (never in valid UTF-8). Which spelling tokenizer.c uses where: the
 * generator's docstring. Private to coordinator/tokenizer.c; proven against tiktoken by
 * tests/tokenizer/unicode_sweep.py. Byte-exact (gen_unicode_classes.py --check), not formatted. */
#ifndef K3_TOKENIZER_UNICODE_H
#define K3_TOKENIZER_UNICODE_H
/* clang-format off */

#define K3_UC_UNICODE_VERSION "{UNICODE_VERSION}"
/* PCRE2 tables of a version in [K3_UC_BASE_VERSION, K3_UC_UNICODE_VERSION] differ from the
 * classes below only at the code points of K3_UC_DIFF_RANGES; adding K3_UCADD_* makes them equal. */
#define K3_UC_BASE_VERSION "{BASE_VERSION}"

"""
    body = "\n".join(class_macro(n, c, s) for n, c, s in classes)
    body += "\n" + table_macro("K3_UC_DIFF_RANGES", "L | N | M | Script=Han " + after +
                               " (sorted {lo, hi} pairs)", diff)
    return head + body + "/* clang-format on */\n\n#endif /* K3_TOKENIZER_UNICODE_H */\n"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--check":
        text = build(verify=False)
        cur = open(DEFAULT_OUT, encoding="utf-8").read() if os.path.exists(DEFAULT_OUT) else ""
        if cur != text:
            print(f"{DEFAULT_OUT} is stale: run python3 tests/tokenizer/gen_unicode_classes.py")
            return 1
        print(f"{DEFAULT_OUT} is up to date (Unicode {UNICODE_VERSION})")
        return 0
    text = build()
    out = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {out} ({len(text)} bytes, Unicode {UNICODE_VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
