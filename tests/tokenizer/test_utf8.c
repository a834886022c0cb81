/* test_utf8.c — unit tests of base/k3_utf8.h, the one strict UTF-8 decoder (coordinator/ uses it
 * for tokenizer input validation, the detokenizer's and parser's U+FFFD replacement, and the JSON
 * reader).
 *
 * 1. Every scalar value: k3_utf8_put -> k3_utf8_next gives the code point and length back, every
 *    proper prefix is "incomplete" (0), k3_utf8_valid_prefix takes it whole.
 * 2. Every lead byte x every second byte: the classification equals the rows of the Unicode
 *    standard's Table 3-7 (well-formed byte sequences), written here as data.
 * 3. Surrogates, overlongs, > U+10FFFF, stray continuation bytes: invalid with the maximal-subpart
 *    length; replacement (k3_tok_utf8_replace) equals CPython's bytes.decode("utf-8", "replace")
 *    on vectors computed with CPython 3.11.
 * 4. U+0000 is an ordinary character everywhere (valid_prefix does not stop at it).
 * 5. k3_py_isspace equals Python's str.isspace over all scalar values (the set, from CPython). */
#include "k3_test.h"
#include "k3_tokenizer.h"
#include "k3_utf8.h"

/* Table 3-7: lead range, second-byte range, length. Continuation bytes after the second are
 * always 80..BF. */
static const struct {
    uint8_t lo, hi, b1_lo, b1_hi;
    int len;
} TABLE_3_7[] = {
    {0x00, 0x7F, 0, 0, 1},       {0xC2, 0xDF, 0x80, 0xBF, 2}, {0xE0, 0xE0, 0xA0, 0xBF, 3},
    {0xE1, 0xEC, 0x80, 0xBF, 3}, {0xED, 0xED, 0x80, 0x9F, 3}, {0xEE, 0xEF, 0x80, 0xBF, 3},
    {0xF0, 0xF0, 0x90, 0xBF, 4}, {0xF1, 0xF3, 0x80, 0xBF, 4}, {0xF4, 0xF4, 0x80, 0x8F, 4},
};

static void test_roundtrip(void) {
    long bad = 0;
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF) continue;
        uint8_t b[4];
        size_t n = k3_utf8_put(cp, b);
        uint32_t got = 0xFFFFFFFF;
        int r = k3_utf8_next(b, n, &got);
        size_t want_n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
        if (n != want_n || r != (int)n || got != cp || k3_utf8_valid_prefix(b, n) != n) bad++;
        for (size_t k = 1; k < n; k++)
            if (k3_utf8_next(b, k, NULL) != 0 || k3_utf8_valid_prefix(b, k) != 0) bad++;
    }
    K3_CHECK(bad == 0, "%ld scalar values do not round-trip", bad);
}

static void test_table(void) {
    long bad = 0;
    for (int b0 = 0; b0 < 256; b0++) {
        int row = -1;
        for (size_t i = 0; i < K3_ARRAY_LEN(TABLE_3_7); i++)
            if (b0 >= TABLE_3_7[i].lo && b0 <= TABLE_3_7[i].hi) row = (int)i;
        for (int b1 = 0; b1 < 256; b1++) {
            uint8_t s[4] = {(uint8_t)b0, (uint8_t)b1, 0x80, 0x80};
            int want;
            if (row < 0)
                want = -1; /* not a lead byte */
            else if (TABLE_3_7[row].len == 1)
                want = 1;
            else if (b1 < TABLE_3_7[row].b1_lo || b1 > TABLE_3_7[row].b1_hi)
                want = -1; /* the lead byte alone is the maximal subpart */
            else
                want = TABLE_3_7[row].len;
            int got = k3_utf8_next(s, 4, NULL);
            if (got != want) {
                if (bad < 5) fprintf(stderr, "  %02X %02X: got %d want %d\n", b0, b1, got, want);
                bad++;
            }
        }
    }
    K3_CHECK(bad == 0, "%ld byte pairs classified against Table 3-7", bad);
    /* a bad third / fourth byte: the subpart is what came before it */
    const uint8_t e3[] = {0xE1, 0x80, 0x41}, f4[] = {0xF1, 0x80, 0x80, 0xC0};
    K3_CHECK(k3_utf8_next(e3, 3, NULL) == -2, "E1 80 41 -> -2");
    K3_CHECK(k3_utf8_next(f4, 4, NULL) == -3, "F1 80 80 C0 -> -3");
}

/* bytes.decode("utf-8", "replace").encode() in CPython 3.11 */
static const struct {
    const char *in;
    size_t n_in;
    const char *want;
} PY_REPLACE[] = {
    {"a\xF1\x80\x80\xE1\x80\xC2"
     "b\x80"
     "c\x80\xBF"
     "d",
     13,
     "a\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"
     "b\xEF\xBF\xBD"
     "c\xEF\xBF\xBD\xEF\xBF\xBD"
     "d"},
    {"\xC0\xAF", 2, "\xEF\xBF\xBD\xEF\xBF\xBD"},
    {"\xE0\x80\xAF", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
    {"\xED\xA0\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
    {"\xF4\x90\x80\x80", 4, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
    {"\xF0\x9F\x98", 3, "\xEF\xBF\xBD"},
    {"\xE2\x82", 2, "\xEF\xBF\xBD"},
    {"\xEF\xBF\xBD\xF4\x8F\xBF\xBF", 7, "\xEF\xBF\xBD\xF4\x8F\xBF\xBF"},
    {"\xF5\x80", 2, "\xEF\xBF\xBD\xEF\xBF\xBD"},
    {"\xE0\xA0\x80\xEE\x80", 5, "\xE0\xA0\x80\xEF\xBF\xBD"},
};

static void test_python_replace(void) {
    for (size_t i = 0; i < K3_ARRAY_LEN(PY_REPLACE); i++) {
        k3_tok_bytes out = {0};
        K3_CHECK_OK(k3_tok_utf8_replace(PY_REPLACE[i].in, PY_REPLACE[i].n_in, &out));
        size_t wn = strlen(PY_REPLACE[i].want);
        K3_CHECK(out.n == wn && memcmp(out.data, PY_REPLACE[i].want, wn) == 0,
                 "replace vector %zu differs from CPython", i);
        k3_tok_bytes_free(&out);
    }
}

static void test_nul(void) {
    const uint8_t s[] = {'a', 0, 'b', 0xC3, 0xA9, 0};
    uint32_t cp = 1;
    K3_CHECK(k3_utf8_next(s + 1, 5, &cp) == 1 && cp == 0, "U+0000 is one valid character");
    K3_CHECK(k3_utf8_valid_prefix(s, sizeof s) == sizeof s, "valid_prefix runs past NUL");
    k3_tok_bytes out = {0};
    K3_CHECK_OK(k3_tok_utf8_replace((const char *)s, sizeof s, &out));
    K3_CHECK(out.n == sizeof s && memcmp(out.data, s, sizeof s) == 0, "NUL survives replacement");
    k3_tok_bytes_free(&out);
}

static void test_isspace(void) {
    /* {c for c in range(0x110000) if chr(c).isspace()} in CPython 3.11 */
    static const uint32_t py[] = {0x09,   0x0A,   0x0B,   0x0C,   0x0D,   0x1C,   0x1D,   0x1E,
                                  0x1F,   0x20,   0x85,   0xA0,   0x1680, 0x2000, 0x2001, 0x2002,
                                  0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200A,
                                  0x2028, 0x2029, 0x202F, 0x205F, 0x3000};
    long bad = 0;
    size_t k = 0;
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        bool want = k < K3_ARRAY_LEN(py) && py[k] == cp;
        if (want) k++;
        if (k3_py_isspace(cp) != want) bad++;
    }
    K3_CHECK(bad == 0, "%ld code points disagree with Python str.isspace", bad);
}

int main(void) {
    test_roundtrip();
    test_table();
    test_python_replace();
    test_nul();
    test_isspace();
    return k3_test_done("utf8");
}
