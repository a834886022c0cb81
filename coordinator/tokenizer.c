/* tokenizer.c — loading and encoding of the k3 tokenizer (spec/K3-CHAT.md §4.1–4.6).
 *
 * Owns: the rank file parser (base64 + rank per line), the bytes -> rank hash map, the special
 * token table and its byte trie (longest match), the PCRE2 pre-tokenizer (compiled once, JIT;
 * its Unicode classes are those of tiktoken's Unicode 16.0, see "PCRE2 spellings" below), the
 * Kimi chunking of §4.4, and BPE per piece.
 * Does not own: decoding / UTF-8 replacement / streaming (tokenizer_decode.c).
 * Invariants: the tokenizer is immutable after create; every encode call uses its own scratch
 * (match data, BPE arrays), so encoding is thread-safe. Input must be valid UTF-8 (checked once
 * per call, k3_utf8; the same pass picks the regex spelling; PCRE2 then runs with
 * PCRE2_NO_UTF_CHECK so a long text is not re-validated per match). U+0000 is ordinary text.
 * BPE: pieces up to BPE_SCAN_MAX bytes use tiktoken's min-scan; longer pieces use a linked list +
 * binary heap keyed by (rank, start) with lazy invalidation — the same merge order (lowest rank,
 * leftmost on ties) in O(n log n). */
#include "k3_tokenizer.h"
#include "tokenizer_internal.h"
#include "tokenizer_unicode.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

/* PCRE2 spellings of the pre-tokenizer patterns (spec/K3-CHAT.md §4.2). o200k / cl100k are
 * tiktoken's pat_str (tests/data/vocab/<name>.meta.json). The Unicode classes must be the
 * reference's (tiktoken 0.14: Rust regex, Unicode 16.0), not PCRE2's: Debian 12's PCRE2 10.42 has
 * Unicode 14.0 tables, and a bare \p{Han} there means Script_Extensions (、。〆・ ... would be Han,
 * so "。\n" split in two). tokenizer_unicode.h (generated from the UCD) makes three exact
 * spellings: BASE      PCRE2's own \p{..}, \p{sc:Han}: for text without a code point of
 *             K3_UC_DIFF_RANGES (class members assigned after 14.0), when PCRE2's tables are of a
 *             version in [K3_UC_BASE_VERSION, K3_UC_UNICODE_VERSION]: there PCRE2's classes differ
 *             from 16.0's only at those code points, and a regex only sees its subject's
 *             characters;
 *   ADDED     the same + K3_UCADD_* (the members assigned after 14.0): text with such a code
 *             point. The extra ranges cost ~2x in regex time on ASCII text (PCRE2's JIT tests a
 *             class's ranges one by one after its property lookups), hence BASE for the rest;
 *   EXPLICIT  the whole classes as ranges (K3_UC_*), for a PCRE2 of another Unicode version (or
 *             k3_tok_options.explicit_unicode_classes): exact everywhere, ~10x slower on CJK text.
 * K3's class intersections `[... && [^\p{Han}]]`: a lookahead in BASE/ADDED, the precomputed set
 * differences K3_UC_*_NOHAN in EXPLICIT. \s is the White_Space set spelled out (PCRE2's UCP \s
 * lacks U+0085; White_Space is unchanged since Unicode 6.3), \S its complement. */
#define WS                                                                                         \
    "\\t\\n\\x0B\\x0C\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{"     \
    "202F}\\x{205F}\\x{3000}"
#define WS_RUNS         "|[" WS "]*[\\r\\n]+|[" WS "]+(?![^" WS "])|[" WS "]+"
#define CONTRACTIONS_CI "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
#define CONTRACTIONS_CS "('s|'S|'t|'T|'re|'rE|'Re|'RE|'ve|'vE|'Ve|'VE|'m|'M|'ll|'lL|'Ll|'LL|'d|'D)"
/* Class bodies: LN = L|N, L, N, HAN = Script=Han; UP / LO = an atom matching one character of
 * [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] / [\p{Ll}\p{Lm}\p{Lo}\p{M}] (K3: minus Han). */
#define PAT_K3(LN, N, HAN, UP, LO)                                                                 \
    "[" HAN "]+|[^\\r\\n" LN "]?" UP "*" LO "+" CONTRACTIONS_CI "|[^\\r\\n" LN "]?" UP "+" LO      \
    "*" CONTRACTIONS_CI "|[" N "]{1,3}| ?[^" WS LN "]+[\\r\\n]*" WS_RUNS
#define PAT_O200K(LN, N, UP, LO)                                                                   \
    "[^\\r\\n" LN "]?" UP "*" LO "+" CONTRACTIONS_CS "?|[^\\r\\n" LN "]?" UP "+" LO                \
    "*" CONTRACTIONS_CS "?|[" N "]{1,3}| ?[^" WS LN "]+[\\r\\n/]*" WS_RUNS
#define PAT_CL100K(LN, L, N)                                                                       \
    CONTRACTIONS_CS "|[^\\r\\n" LN "]?[" L "]+|[" N "]{1,3}| ?[^" WS LN "]+[\\r\\n]*" WS_RUNS
/* BASE (A = "") and ADDED (A = the K3_UCADD_ macro) class bodies */
#define P_LN(A)  "\\p{L}\\p{N}" A
#define P_HAN(A) "\\p{sc:Han}" A
#define P_UP(A)  "\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}" A
#define P_LO(A)  "\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}" A
enum { SP_BASE, SP_ADDED, SP_EXPLICIT };
/* [pattern][spelling] */
static const char *const PATTERNS[3][3] = {
    [K3_TOK_PAT_K3] = {PAT_K3(P_LN(""), "\\p{N}", P_HAN(""), "(?:(?!\\p{sc:Han})[" P_UP("") "])",
                              "(?:(?!\\p{sc:Han})[" P_LO("") "])"),
                       PAT_K3(P_LN(K3_UCADD_LN), "\\p{N}" K3_UCADD_N, P_HAN(K3_UCADD_HAN),
                              "(?:(?![" P_HAN(K3_UCADD_HAN) "])[" P_UP(K3_UCADD_UPPER) "])",
                              "(?:(?![" P_HAN(K3_UCADD_HAN) "])[" P_LO(K3_UCADD_LOWER) "])"),
                       PAT_K3(K3_UC_LN, K3_UC_N, K3_UC_HAN, "[" K3_UC_UPPER_NOHAN "]",
                              "[" K3_UC_LOWER_NOHAN "]")},
    [K3_TOK_PAT_O200K] = {PAT_O200K(P_LN(""), "\\p{N}", "[" P_UP("") "]", "[" P_LO("") "]"),
                          PAT_O200K(P_LN(K3_UCADD_LN), "\\p{N}" K3_UCADD_N,
                                    "[" P_UP(K3_UCADD_UPPER) "]", "[" P_LO(K3_UCADD_LOWER) "]"),
                          PAT_O200K(K3_UC_LN, K3_UC_N, "[" K3_UC_UPPER "]", "[" K3_UC_LOWER "]")},
    [K3_TOK_PAT_CL100K] = {PAT_CL100K(P_LN(""), "\\p{L}", "\\p{N}"),
                           PAT_CL100K(P_LN(K3_UCADD_LN), "\\p{L}" K3_UCADD_L, "\\p{N}" K3_UCADD_N),
                           PAT_CL100K(K3_UC_LN, K3_UC_L, K3_UC_N)},
};
/* Class members assigned after K3_UC_BASE_VERSION: where BASE and the reference differ. */
static const uint32_t DIFF_RANGES[][2] = {K3_UC_DIFF_RANGES};

/* "14.0.0" -> 14000000 (major, minor, update; 0 for an unparsable string). */
static long unicode_version_num(const char *v) {
    long part[3] = {0, 0, 0};
    for (int i = 0; i < 3 && *v; i++) {
        char *end;
        part[i] = strtol(v, &end, 10);
        if (end == v) return 0;
        v = *end == '.' ? end + 1 : end;
    }
    return part[0] * 1000000 + part[1] * 1000 + part[2];
}

/* BASE / ADDED are exact iff PCRE2's tables are of a version in [base, target]. */
static bool pcre2_unicode_fits(void) {
    char v[32] = "";
    if (pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, v) < 0) return false;
    long n = unicode_version_num(v);
    return n >= unicode_version_num(K3_UC_BASE_VERSION) &&
           n <= unicode_version_num(K3_UC_UNICODE_VERSION);
}

/* cp is in DIFF_RANGES (binary search; all ranges lie above U+0800). */
static bool is_diff_cp(uint32_t cp) {
    size_t lo = 0, hi = K3_ARRAY_LEN(DIFF_RANGES);
    if (cp < DIFF_RANGES[0][0]) return false;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < DIFF_RANGES[mid][0])
            hi = mid;
        else if (cp > DIFF_RANGES[mid][1])
            lo = mid + 1;
        else
            return true;
    }
    return false;
}

/* Kimi chunking constants (tokenization_kimi.py): TIKTOKEN_MAX_ENCODE_CHARS,
 * MAX_NO_WHITESPACES_CHARS. */
#define KIMI_MAX_ENCODE_CHARS 400000
#define KIMI_MAX_RUN_CHARS    25000
/* Pieces up to this many bytes use the plain min-scan BPE (faster for short pieces). */
#define BPE_SCAN_MAX 48
/* Bounds that make a hostile file an error instead of a huge allocation. */
#define TOK_MAX_ID          (1 << 26)
#define TOK_MAX_TOKEN_BYTES (1 << 20)

k3_status k3_tok_pattern_from_name(const char *name, k3_tok_pattern *out) {
    if (!name) return K3_ERR(K3_ERR_ARG, "pattern name is NULL");
    if (!strcmp(name, "k3"))
        *out = K3_TOK_PAT_K3;
    else if (!strcmp(name, "o200k"))
        *out = K3_TOK_PAT_O200K;
    else if (!strcmp(name, "cl100k"))
        *out = K3_TOK_PAT_CL100K;
    else
        return K3_ERR(K3_ERR_ARG, "unknown pattern '%s' (expected k3, o200k or cl100k)", name);
    return K3_OK;
}

/* ---- growable outputs ---------------------------------------------------------------------- */
void k3_tok_ids_free(k3_tok_ids *v) {
    if (!v) return;
    free(v->ids);
    memset(v, 0, sizeof *v);
}

void k3_tok_bytes_free(k3_tok_bytes *b) {
    if (!b) return;
    free(b->data);
    memset(b, 0, sizeof *b);
}

static k3_status ids_push(k3_tok_ids *v, int32_t id) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        int32_t *p = realloc(v->ids, cap * sizeof *p);
        if (!p) return K3_ERR(K3_ERR_NOMEM, "token id buffer: %zu ids", cap);
        v->ids = p;
        v->cap = cap;
    }
    v->ids[v->n++] = id;
    return K3_OK;
}

k3_status k3_tok_bytes_reserve(k3_tok_bytes *b, size_t extra) {
    if (b->data && b->n + extra + 1 <= b->cap) return K3_OK;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + extra + 1) cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p) return K3_ERR(K3_ERR_NOMEM, "text buffer: %zu bytes", cap);
    b->data = p;
    b->cap = cap;
    return K3_OK;
}

k3_status k3_tok_bytes_append(k3_tok_bytes *b, const char *p, size_t n) {
    K3_TRY(k3_tok_bytes_reserve(b, n));
    if (n) memcpy(b->data + b->n, p, n);
    b->n += n;
    b->data[b->n] = 0;
    return K3_OK;
}

/* ---- UTF-8 ------------------------------------------------------------------------------- */
/* Validate the whole text once (k3_utf8, Python's strict rules); *diff = it holds a code point of
 * DIFF_RANGES (the ADDED spelling is needed). Without an ADDED spelling (EXPLICIT) there is
 * nothing to choose: the code points are not looked up. */
static k3_status utf8_validate(const k3_tokenizer *t, const char *text, size_t n, bool *diff) {
    const uint8_t *s = (const uint8_t *)text;
    size_t i = 0;
    *diff = false;
    bool look = t->re_added != NULL;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        int len = k3_utf8_next(s + i, n - i, &cp);
        if (len <= 0)
            return K3_ERR(K3_ERR_ARG, "text is not valid UTF-8 at byte offset %zu (byte 0x%02x)", i,
                          s[i]);
        if (look && len >= 3 && !*diff) *diff = is_diff_cp(cp);
        i += (size_t)len;
    }
    return K3_OK;
}

/* Decode one code point of valid UTF-8 at s[0..n); returns its length. */
static size_t utf8_cp(const uint8_t *s, size_t n, uint32_t *cp) {
    int len = k3_utf8_next(s, n, cp);
    K3_ASSERT(len > 0); /* the text was validated */
    return (size_t)len;
}

/* ---- hash map bytes -> rank -------------------------------------------------------------- */
static uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xff51afd7ed558ccdull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xbf58476d1ce4e5b9ull;
        h ^= h >> 31;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    for (size_t i = 0; i < n; i++) w |= (uint64_t)p[i] << (8 * i);
    h = (h ^ w) * 0x94d049bb133111ebull;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    return h;
}

/* Rank of bytes p[0..n), or -1. */
static inline int32_t rank_lookup(const k3_tokenizer *t, const uint8_t *p, size_t n) {
    size_t mask = t->map_cap - 1;
    size_t i = (size_t)hash_bytes(p, n) & mask;
    for (;;) {
        int32_t r = t->map[i];
        if (r < 0) return -1;
        if ((size_t)t->rank_len[r] == n && !memcmp(t->arena + t->rank_off[r], p, n)) return r;
        i = (i + 1) & mask;
    }
}

/* ---- loading ----------------------------------------------------------------------------- */
static int b64val(uint8_t c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Decode standard base64 (with '=' padding) into out (capacity >= 3 * n / 4). Returns the byte
 * count, or -1 on a malformed string. */
static int64_t b64decode(const char *s, size_t n, uint8_t *out) {
    if (n % 4 != 0) return -1;
    int64_t o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4];
        int pad = 0;
        for (int k = 0; k < 4; k++) {
            uint8_t c = (uint8_t)s[i + k];
            if (c == '=' && i + 4 == n && k >= 2) {
                v[k] = 0;
                pad++;
                continue;
            }
            if (pad) return -1; /* data after '=' */
            v[k] = b64val(c);
            if (v[k] < 0) return -1;
        }
        uint32_t w = ((uint32_t)v[0] << 18) | ((uint32_t)v[1] << 12) | ((uint32_t)v[2] << 6) |
                     (uint32_t)v[3];
        out[o++] = (uint8_t)(w >> 16);
        if (pad < 2) out[o++] = (uint8_t)(w >> 8);
        if (pad < 1) out[o++] = (uint8_t)w;
    }
    return o;
}

static k3_status load_ranks(k3_tokenizer *t, const char *path) {
    char *buf = NULL;
    size_t n = 0;
    K3_TRY(k3_read_file(path, &buf, &n));
    k3_status st = K3_OK;
    /* Pass 1: count lines and bytes. Base64 text >= decoded bytes, so n bounds the arena. */
    size_t n_lines = 0;
    for (size_t i = 0; i < n; i++) n_lines += buf[i] == '\n';
    n_lines++;
    int32_t *ranks = malloc(n_lines * sizeof *ranks);
    uint32_t *offs = malloc(n_lines * sizeof *offs);
    int32_t *lens = malloc(n_lines * sizeof *lens);
    t->arena = malloc(n + 1);
    if (!ranks || !offs || !lens || !t->arena) {
        st = K3_ERR(K3_ERR_NOMEM, "%s: rank table for %zu lines", path, n_lines);
        goto done;
    }
    size_t n_tok = 0, line = 0, pos = 0;
    int64_t max_rank = -1;
    while (pos < n) {
        line++;
        size_t eol = pos;
        while (eol < n && buf[eol] != '\n') eol++;
        size_t end = eol;
        if (end > pos && buf[end - 1] == '\r') end--;
        if (end > pos) { /* blank lines are skipped */
            size_t sp = pos;
            while (sp < end && buf[sp] != ' ') sp++;
            if (sp == end || sp == pos) {
                st = K3_ERR(K3_ERR_FORMAT, "%s:%zu: expected '<base64> <rank>'", path, line);
                goto done;
            }
            int64_t r = 0;
            size_t d = sp + 1;
            if (d == end) {
                st = K3_ERR(K3_ERR_FORMAT, "%s:%zu: missing rank", path, line);
                goto done;
            }
            for (; d < end; d++) {
                if (buf[d] < '0' || buf[d] > '9' || r > TOK_MAX_ID) {
                    st = K3_ERR(K3_ERR_FORMAT, "%s:%zu: bad rank (not a number below %d)", path,
                                line, TOK_MAX_ID);
                    goto done;
                }
                r = r * 10 + (buf[d] - '0');
            }
            if (r >= TOK_MAX_ID) {
                st = K3_ERR(K3_ERR_FORMAT, "%s:%zu: rank %lld too large", path, line, (long long)r);
                goto done;
            }
            int64_t nb = b64decode(buf + pos, sp - pos, (uint8_t *)t->arena + t->n_arena);
            if (nb <= 0) {
                st = K3_ERR(K3_ERR_FORMAT, "%s:%zu: bad base64 token", path, line);
                goto done;
            }
            ranks[n_tok] = (int32_t)r;
            offs[n_tok] = (uint32_t)t->n_arena;
            lens[n_tok] = (int32_t)nb;
            t->n_arena += (size_t)nb;
            n_tok++;
            if (r > max_rank) max_rank = r;
        }
        pos = eol + 1;
    }
    if (n_tok == 0) {
        st = K3_ERR(K3_ERR_FORMAT, "%s: no tokens", path);
        goto done;
    }
    t->n_ranks = max_rank + 1;
    t->rank_off = malloc((size_t)t->n_ranks * sizeof *t->rank_off);
    t->rank_len = malloc((size_t)t->n_ranks * sizeof *t->rank_len);
    t->map_cap = 1;
    while (t->map_cap < 2 * n_tok) t->map_cap <<= 1;
    t->map = malloc(t->map_cap * sizeof *t->map);
    if (!t->rank_off || !t->rank_len || !t->map) {
        st = K3_ERR(K3_ERR_NOMEM, "%s: rank index", path);
        goto done;
    }
    for (int64_t r = 0; r < t->n_ranks; r++) t->rank_len[r] = -1;
    for (size_t i = 0; i < t->map_cap; i++) t->map[i] = -1;
    for (size_t k = 0; k < n_tok; k++) {
        int32_t r = ranks[k];
        if (t->rank_len[r] >= 0) {
            st = K3_ERR(K3_ERR_FORMAT, "%s: rank %d appears twice", path, r);
            goto done;
        }
        const uint8_t *p = (const uint8_t *)t->arena + offs[k];
        t->rank_off[r] = offs[k];
        t->rank_len[r] = lens[k];
        size_t mask = t->map_cap - 1, i = (size_t)hash_bytes(p, (size_t)lens[k]) & mask;
        for (;;) {
            int32_t o = t->map[i];
            if (o < 0) break;
            if (t->rank_len[o] == lens[k] &&
                !memcmp(t->arena + t->rank_off[o], p, (size_t)lens[k])) {
                st = K3_ERR(K3_ERR_FORMAT, "%s: the same bytes have ranks %d and %d", path, o, r);
                goto done;
            }
            i = (i + 1) & mask;
        }
        t->map[i] = r;
    }
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        t->byte_rank[b] = rank_lookup(t, &c, 1);
        if (t->byte_rank[b] < 0) {
            st = K3_ERR(K3_ERR_FORMAT,
                        "%s: no token for the single byte 0x%02x (byte-level BPE needs all 256)",
                        path, b);
            goto done;
        }
    }
done:
    free(ranks);
    free(offs);
    free(lens);
    k3_free(buf);
    return st;
}

/* ---- special tokens ---------------------------------------------------------------------- */
/* Named slots of the K3 block (§4.1), as offsets from the first special id. */
static const struct {
    int off;
    const char *name;
} k3_named_specials[] = {
    {0, "[BOS]"},
    {1, "[EOS]"},
    {2, "<|end_of_msg|>"},
    {3, "<|open|>"},
    {4, "<|close|>"},
    {5, "<|sep|>"},
    {6, "[start_header_id]"},
    {7, "[end_header_id]"},
    {9, "[EOT]"},
    {18, "<|media_begin|>"},
    {19, "<|media_content|>"},
    {20, "<|media_end|>"},
    {21, "<|media_pad|>"},
    {65, "<osagent_mode>"},
    {254, "[UNK]"},
    {255, "[PAD]"},
};

void k3_tok_specials_free(k3_tok_special *sp, size_t n) {
    if (!sp) return;
    for (size_t i = 0; i < n; i++) free((char *)sp[i].content);
    free(sp);
}

const char *k3_tok_k3_special_in(const char *s, size_t n_bytes) {
    static const char reserved[] = "<|reserved_token_";
    const char *first = NULL, *at = s + n_bytes;
    for (size_t k = 0; k < K3_ARRAY_LEN(k3_named_specials); k++) {
        const char *hit =
            memmem(s, n_bytes, k3_named_specials[k].name, strlen(k3_named_specials[k].name));
        if (hit && hit < at) first = k3_named_specials[k].name, at = hit;
    }
    const char *hit = memmem(s, n_bytes, reserved, sizeof reserved - 1);
    if (hit && hit < at) first = "<|reserved_token_N|>";
    return first;
}

k3_status k3_tok_k3_specials(int32_t base, k3_tok_special **out, size_t *n_out) {
    *out = NULL;
    *n_out = 0;
    if (base < 0 || base > TOK_MAX_ID - K3_TOK_N_K3_SPECIALS)
        return K3_ERR(K3_ERR_ARG, "special-token base id %d out of range", base);
    k3_tok_special *sp = calloc(K3_TOK_N_K3_SPECIALS, sizeof *sp);
    if (!sp) return K3_ERR(K3_ERR_NOMEM, "K3 special tokens");
    for (int i = 0; i < K3_TOK_N_K3_SPECIALS; i++) {
        char name[64];
        const char *c = NULL;
        for (size_t k = 0; k < K3_ARRAY_LEN(k3_named_specials); k++)
            if (k3_named_specials[k].off == i) c = k3_named_specials[k].name;
        if (!c) {
            snprintf(name, sizeof name, "<|reserved_token_%d|>", base + i);
            c = name;
        }
        sp[i].id = base + i;
        sp[i].content = strdup(c);
        if (!sp[i].content) {
            k3_tok_specials_free(sp, K3_TOK_N_K3_SPECIALS);
            return K3_ERR(K3_ERR_NOMEM, "K3 special tokens");
        }
    }
    *out = sp;
    *n_out = K3_TOK_N_K3_SPECIALS;
    return K3_OK;
}

static k3_status trie_add(k3_tokenizer *t, size_t *cap, size_t special) {
    const uint8_t *s = (const uint8_t *)t->specials[special].content;
    size_t n = t->special_len[special];
    int32_t node = 0;
    for (size_t k = 0; k < n; k++) {
        int32_t c = t->trie[node].first_child;
        while (c >= 0 && t->trie[c].byte != s[k]) c = t->trie[c].next_sibling;
        if (c < 0) {
            if (t->n_trie == *cap) {
                size_t nc = *cap * 2;
                tok_trie_node *p = realloc(t->trie, nc * sizeof *p);
                if (!p) return K3_ERR(K3_ERR_NOMEM, "special-token trie");
                t->trie = p;
                *cap = nc;
            }
            c = (int32_t)t->n_trie++;
            t->trie[c] = (tok_trie_node){.first_child = -1,
                                         .next_sibling = t->trie[node].first_child,
                                         .special = -1,
                                         .byte = s[k]};
            t->trie[node].first_child = c;
        }
        node = c;
    }
    if (t->trie[node].special >= 0)
        return K3_ERR(K3_ERR_FORMAT, "special token '%s' is defined twice (ids %d and %d)",
                      t->specials[special].content, t->specials[t->trie[node].special].id,
                      t->specials[special].id);
    t->trie[node].special = (int32_t)special;
    return K3_OK;
}

static k3_status set_specials(k3_tokenizer *t, const k3_tok_special *sp, size_t n) {
    t->specials = calloc(n ? n : 1, sizeof *t->specials);
    t->special_len = calloc(n ? n : 1, sizeof *t->special_len);
    if (!t->specials || !t->special_len) return K3_ERR(K3_ERR_NOMEM, "special tokens");
    int64_t n_vocab = t->n_ranks;
    for (size_t i = 0; i < n; i++) {
        if (!sp[i].content || !sp[i].content[0])
            return K3_ERR(K3_ERR_ARG, "special token #%zu (id %d) has empty content", i, sp[i].id);
        if (sp[i].id < 0 || sp[i].id >= TOK_MAX_ID)
            return K3_ERR(K3_ERR_ARG, "special token '%s' has id %d out of range", sp[i].content,
                          sp[i].id);
        if (sp[i].id < t->n_ranks && t->rank_len[sp[i].id] >= 0)
            return K3_ERR(K3_ERR_ARG, "special token '%s' id %d collides with an ordinary rank",
                          sp[i].content, sp[i].id);
        t->specials[i].id = sp[i].id;
        t->specials[i].content = strdup(sp[i].content);
        if (!t->specials[i].content) return K3_ERR(K3_ERR_NOMEM, "special tokens");
        t->special_len[i] = strlen(sp[i].content);
        t->n_specials = i + 1;
        if (sp[i].id + 1 > n_vocab) n_vocab = sp[i].id + 1;
    }
    t->n_vocab = n_vocab;
    t->id_special = malloc((size_t)n_vocab * sizeof *t->id_special);
    size_t cap = 256;
    t->trie = malloc(cap * sizeof *t->trie);
    if (!t->id_special || !t->trie) return K3_ERR(K3_ERR_NOMEM, "special-token index");
    for (int64_t i = 0; i < n_vocab; i++) t->id_special[i] = -1;
    t->trie[0] = (tok_trie_node){.first_child = -1, .next_sibling = -1, .special = -1, .byte = 0};
    t->n_trie = 1;
    for (size_t i = 0; i < n; i++) {
        if (t->id_special[t->specials[i].id] >= 0)
            return K3_ERR(K3_ERR_ARG, "special id %d is given twice ('%s' and '%s')",
                          t->specials[i].id, t->specials[t->id_special[t->specials[i].id]].content,
                          t->specials[i].content);
        t->id_special[t->specials[i].id] = (int32_t)i;
        K3_TRY(trie_add(t, &cap, i));
    }
    t->ctrl.open = k3_tok_special_id(t, "<|open|>");
    t->ctrl.close = k3_tok_special_id(t, "<|close|>");
    t->ctrl.sep = k3_tok_special_id(t, "<|sep|>");
    t->ctrl.end_of_msg = k3_tok_special_id(t, "<|end_of_msg|>");
    t->ctrl.eos = k3_tok_special_id(t, "[EOS]");
    return K3_OK;
}

/* ---- create / destroy -------------------------------------------------------------------- */
static k3_status compile_one(const char *pat, pcre2_code **re, bool *jit, bool report) {
    int err = 0;
    PCRE2_SIZE off = 0;
    *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err, &off,
                        NULL);
    if (!*re) {
        if (!report) return K3_ERR_INTERNAL; /* the caller falls back to EXPLICIT, no message */
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return K3_ERR(K3_ERR_INTERNAL, "pre-tokenizer pattern does not compile at offset %zu: %s",
                      (size_t)off, (const char *)msg);
    }
    *jit = pcre2_jit_compile(*re, PCRE2_JIT_COMPLETE) == 0;
    return K3_OK;
}

static k3_status compile_pattern(k3_tokenizer *t, k3_tok_pattern p, bool force_explicit) {
    if ((unsigned)p >= K3_ARRAY_LEN(PATTERNS))
        return K3_ERR(K3_ERR_ARG, "unknown pre-tokenizer pattern %d", (int)p);
    /* BASE + ADDED need PCRE2 tables of a fitting version (and \p{sc:..}: PCRE2 >= 10.40; an
     * older library does not compile them and gets EXPLICIT). */
    if (!force_explicit && pcre2_unicode_fits() &&
        compile_one(PATTERNS[p][SP_BASE], &t->re, &t->jit, false) == K3_OK &&
        compile_one(PATTERNS[p][SP_ADDED], &t->re_added, &t->jit_added, false) == K3_OK)
        return K3_OK;
    if (t->re) pcre2_code_free(t->re);
    t->re = NULL;
    t->explicit_classes = true;
    return compile_one(PATTERNS[p][SP_EXPLICIT], &t->re, &t->jit, true);
}

bool k3_tok_explicit_classes(const k3_tokenizer *t) {
    return t->explicit_classes;
}

void k3_tok_destroy(k3_tokenizer *t) {
    if (!t) return;
    free(t->arena);
    free(t->rank_off);
    free(t->rank_len);
    free(t->map);
    if (t->specials)
        for (size_t i = 0; i < t->n_specials; i++) free((char *)t->specials[i].content);
    free(t->specials);
    free(t->special_len);
    free(t->id_special);
    free(t->trie);
    if (t->re) pcre2_code_free(t->re);
    if (t->re_added) pcre2_code_free(t->re_added);
    free(t);
}

k3_status k3_tok_create_tiktoken(k3_tokenizer **out, const char *path,
                                 const k3_tok_special *specials, size_t n_specials,
                                 const k3_tok_options *opts) {
    *out = NULL;
    k3_tok_options o = opts ? *opts : (k3_tok_options){0};
    k3_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return K3_ERR(K3_ERR_NOMEM, "tokenizer");
    t->kimi_chunking = !o.no_kimi_chunking;
    k3_status st = load_ranks(t, path);
    if (st == K3_OK) st = compile_pattern(t, o.pattern, o.explicit_unicode_classes);
    if (st == K3_OK) {
        if (!specials && n_specials == K3_TOK_K3_LAYOUT) {
            k3_tok_special *sp = NULL;
            size_t n = 0;
            st = k3_tok_k3_specials((int32_t)t->n_ranks, &sp, &n);
            if (st == K3_OK) st = set_specials(t, sp, n);
            k3_tok_specials_free(sp, n);
        } else {
            st = set_specials(t, specials, specials ? n_specials : 0);
        }
    }
    if (st != K3_OK) {
        k3_tok_destroy(t);
        return st;
    }
    *out = t;
    return K3_OK;
}

/* tokenizer_config.json: added_tokens_decoder = {"<id>": {"content": "...", ...}, ...}. */
static k3_status read_added_tokens(const char *path, k3_tok_special **out, size_t *n_out) {
    char *buf = NULL;
    size_t n = 0;
    *out = NULL;
    *n_out = 0;
    K3_TRY(k3_read_file(path, &buf, &n));
    cJSON *root = cJSON_ParseWithLength(buf, n);
    k3_free(buf);
    if (!root) return K3_ERR(K3_ERR_FORMAT, "%s: not valid JSON", path);
    k3_status st = K3_OK;
    const cJSON *dec = cJSON_GetObjectItemCaseSensitive(root, "added_tokens_decoder");
    if (!cJSON_IsObject(dec)) {
        st = K3_ERR(K3_ERR_FORMAT, "%s: no object 'added_tokens_decoder'", path);
        goto done;
    }
    size_t cnt = (size_t)cJSON_GetArraySize(dec);
    k3_tok_special *sp = calloc(cnt ? cnt : 1, sizeof *sp);
    if (!sp) {
        st = K3_ERR(K3_ERR_NOMEM, "%s: special tokens", path);
        goto done;
    }
    size_t k = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, dec) {
        char *end = NULL;
        long id = strtol(it->string, &end, 10);
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(it, "content");
        if (!it->string[0] || *end || id < 0 || id >= TOK_MAX_ID) {
            st = K3_ERR(K3_ERR_FORMAT, "%s: added_tokens_decoder key '%s' is not a token id", path,
                        it->string);
            break;
        }
        if (!cJSON_IsString(c) || !c->valuestring[0]) {
            st = K3_ERR(K3_ERR_FORMAT, "%s: added_tokens_decoder[\"%s\"].content missing or empty",
                        path, it->string);
            break;
        }
        sp[k].id = (int32_t)id;
        sp[k].content = strdup(c->valuestring);
        if (!sp[k].content) {
            st = K3_ERR(K3_ERR_NOMEM, "%s: special tokens", path);
            break;
        }
        k++;
    }
    if (st != K3_OK) {
        k3_tok_specials_free(sp, k);
        goto done;
    }
    *out = sp;
    *n_out = k;
done:
    cJSON_Delete(root);
    return st;
}

k3_status k3_tok_create_model_dir(k3_tokenizer **out, const char *dir, const k3_tok_options *opts) {
    *out = NULL;
    char vocab[4096], cfg[4096];
    if (snprintf(vocab, sizeof vocab, "%s/tiktoken.model", dir) >= (int)sizeof vocab ||
        snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir) >= (int)sizeof cfg)
        return K3_ERR(K3_ERR_ARG, "model directory path too long: %s", dir);
    /* One clear error for a wrong directory, before any warning about its files. */
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return K3_ERR(errno == ENOENT ? K3_ERR_MISSING : K3_ERR_IO,
                      "%s: cannot open the model directory: %s", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return K3_ERR(K3_ERR_ARG, "%s: not a directory (give the model directory)", dir);
    char model_cfg[4096];
    snprintf(model_cfg, sizeof model_cfg, "%s/config.json", dir);
    if (stat(vocab, &sb) != 0 && errno == ENOENT && stat(model_cfg, &sb) != 0)
        return K3_ERR(K3_ERR_MISSING, "not a K3 checkpoint: no config.json in %s", dir);
    FILE *f = fopen(cfg, "rb");
    if (!f) {
        K3_LOGW("%s not found: using the K3 special-token layout past the last rank", cfg);
        return k3_tok_create_tiktoken(out, vocab, NULL, K3_TOK_K3_LAYOUT, opts);
    }
    fclose(f);
    k3_tok_special *sp = NULL;
    size_t n = 0;
    K3_TRY(read_added_tokens(cfg, &sp, &n));
    k3_status st = k3_tok_create_tiktoken(out, vocab, sp, n, opts);
    k3_tok_specials_free(sp, n);
    return st;
}

/* ---- queries ----------------------------------------------------------------------------- */
int64_t k3_tok_n_vocab(const k3_tokenizer *t) {
    return t->n_vocab;
}
int64_t k3_tok_n_ranks(const k3_tokenizer *t) {
    return t->n_ranks;
}

int32_t k3_tok_special_id(const k3_tokenizer *t, const char *content) {
    for (size_t i = 0; i < t->n_specials; i++)
        if (!strcmp(t->specials[i].content, content)) return t->specials[i].id;
    return -1;
}

bool k3_tok_is_special(const k3_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && t->id_special[id] >= 0;
}

k3_tok_ctrl k3_tok_control_ids(const k3_tokenizer *t) {
    return t->ctrl;
}

k3_status k3_tok_id_bytes(const k3_tokenizer *t, int32_t id, const char **bytes, size_t *n_bytes) {
    if (id >= 0 && id < t->n_ranks && t->rank_len[id] >= 0) {
        *bytes = t->arena + t->rank_off[id];
        *n_bytes = (size_t)t->rank_len[id];
        return K3_OK;
    }
    if (id >= 0 && id < t->n_vocab && t->id_special[id] >= 0) {
        *bytes = t->specials[t->id_special[id]].content;
        *n_bytes = t->special_len[t->id_special[id]];
        return K3_OK;
    }
    return K3_ERR(K3_ERR_ARG, "token id %d is not in the vocabulary (n_vocab %lld)", id,
                  (long long)t->n_vocab);
}

/* ---- encoding ---------------------------------------------------------------------------- */
/* Per-call scratch: PCRE2 match state and the BPE work arrays (grown as needed, never shrunk). */
typedef struct heap_ent {
    int32_t rank;
    uint32_t start; /* byte offset of the left part; ties break to the leftmost */
    uint32_t ver;   /* the left part's version when pushed (stale entries are skipped) */
} heap_ent;

typedef struct tok_scratch {
    const pcre2_code *re; /* the spelling for the current text (t->re or t->re_added) */
    bool jit;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jstack;
    size_t cap;     /* capacity (in bytes of piece) of the arrays below */
    uint32_t *next; /* (cap + 1) start of the next part; piece length for the last */
    uint32_t *prev; /* (cap) start of the previous part; UINT32_MAX for the first */
    uint32_t *ver;  /* (cap) version of the part starting here */
    int32_t *prank; /* (cap) rank of (part, next part) merged; -1 = not mergeable */
    heap_ent *heap; /* (3 cap): n initial pairs + at most 2 pushes per merge */
} tok_scratch;

static void scratch_free(tok_scratch *s) {
    if (s->md) pcre2_match_data_free(s->md);
    if (s->mctx) pcre2_match_context_free(s->mctx);
    if (s->jstack) pcre2_jit_stack_free(s->jstack);
    free(s->next);
    free(s->prev);
    free(s->ver);
    free(s->prank);
    free(s->heap);
    memset(s, 0, sizeof *s);
}

static k3_status scratch_init(tok_scratch *s, const k3_tokenizer *t) {
    memset(s, 0, sizeof *s);
    s->re = t->re;
    s->jit = t->jit;
    /* BASE and ADDED have the same groups, so one match data serves both. */
    s->md = pcre2_match_data_create_from_pattern(t->re, NULL);
    s->mctx = pcre2_match_context_create(NULL);
    if (!s->md || !s->mctx) {
        scratch_free(s);
        return K3_ERR(K3_ERR_NOMEM, "pre-tokenizer match data");
    }
    /* Long pieces (runs of letters) need deep backtracking state: lift the interpreter limits
     * (the chunking of §4.4 bounds runs anyway). */
    pcre2_set_match_limit(s->mctx, UINT32_MAX);
    pcre2_set_depth_limit(s->mctx, UINT32_MAX);
    return K3_OK;
}

static k3_status scratch_grow(tok_scratch *s, size_t n) {
    if (n <= s->cap) return K3_OK;
    size_t cap = s->cap ? s->cap : 256;
    while (cap < n) cap *= 2;
    if (cap > UINT32_MAX / 2) return K3_ERR(K3_ERR_ARG, "text piece of %zu bytes is too long", n);
    free(s->next);
    free(s->prev);
    free(s->ver);
    free(s->prank);
    free(s->heap);
    s->next = malloc((cap + 1) * sizeof *s->next);
    s->prev = malloc(cap * sizeof *s->prev);
    s->ver = malloc(cap * sizeof *s->ver);
    s->prank = malloc(cap * sizeof *s->prank);
    s->heap = malloc(cap * 3 * sizeof *s->heap);
    s->cap = cap;
    if (!s->next || !s->prev || !s->ver || !s->prank || !s->heap) {
        s->cap = 0;
        return K3_ERR(K3_ERR_NOMEM, "BPE scratch for a %zu-byte piece", n);
    }
    return K3_OK;
}

static inline bool heap_less(heap_ent a, heap_ent b) {
    return a.rank < b.rank || (a.rank == b.rank && a.start < b.start);
}

static void heap_push(heap_ent *h, size_t *n, heap_ent e) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(e, h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
}

static heap_ent heap_pop(heap_ent *h, size_t *n) {
    heap_ent top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && heap_less(h[c + 1], h[c])) c++;
        if (!heap_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

/* Rank of the merge of the part at `a` with its successor, or -1. */
static inline int32_t pair_rank(const k3_tokenizer *t, const uint8_t *p, const uint32_t *next,
                                uint32_t n, uint32_t a) {
    uint32_t b = next[a];
    if (b >= n) return -1;
    return rank_lookup(t, p + a, next[b] - a);
}

/* BPE of one piece (§4.3), ids appended. */
static k3_status bpe_piece(const k3_tokenizer *t, tok_scratch *s, const uint8_t *p, size_t len,
                           k3_tok_ids *out) {
    if (len == 0) return K3_OK;
    if (len == 1) return ids_push(out, t->byte_rank[p[0]]);
    int32_t whole = rank_lookup(t, p, len);
    if (whole >= 0) return ids_push(out, whole);
    K3_TRY(scratch_grow(s, len));
    uint32_t n = (uint32_t)len;
    uint32_t *next = s->next, *prev = s->prev;
    for (uint32_t i = 0; i < n; i++) {
        next[i] = i + 1;
        prev[i] = i == 0 ? UINT32_MAX : i - 1;
    }
    next[n] = n;
    if (len <= BPE_SCAN_MAX) {
        /* tiktoken's loop: find the lowest-ranked adjacent pair (leftmost on ties), merge. */
        int32_t *pr = s->prank;
        for (uint32_t i = 0; i < n; i = next[i]) pr[i] = pair_rank(t, p, next, n, i);
        for (;;) {
            int32_t best = INT32_MAX;
            uint32_t bi = UINT32_MAX;
            for (uint32_t i = 0; i < n; i = next[i])
                if (pr[i] >= 0 && pr[i] < best) {
                    best = pr[i];
                    bi = i;
                }
            if (bi == UINT32_MAX) break;
            uint32_t b = next[bi];
            next[bi] = next[b];
            if (next[b] < n) prev[next[b]] = bi;
            pr[bi] = pair_rank(t, p, next, n, bi);
            if (prev[bi] != UINT32_MAX) pr[prev[bi]] = pair_rank(t, p, next, n, prev[bi]);
        }
    } else {
        uint32_t *ver = s->ver;
        heap_ent *h = s->heap;
        size_t nh = 0;
        for (uint32_t i = 0; i < n; i++) {
            ver[i] = 0;
            int32_t r = pair_rank(t, p, next, n, i);
            if (r >= 0) heap_push(h, &nh, (heap_ent){r, i, 0});
        }
        while (nh) {
            heap_ent e = heap_pop(h, &nh);
            /* Stale if the left part was merged away or changed since the push. */
            if (e.ver != ver[e.start] || ver[e.start] == UINT32_MAX) continue;
            uint32_t a = e.start, b = next[a];
            ver[b] = UINT32_MAX; /* b is absorbed */
            next[a] = next[b];
            if (next[b] < n) prev[next[b]] = a;
            ver[a]++;
            int32_t r = pair_rank(t, p, next, n, a);
            if (r >= 0) heap_push(h, &nh, (heap_ent){r, a, ver[a]});
            if (prev[a] != UINT32_MAX) {
                uint32_t q = prev[a];
                ver[q]++;
                r = pair_rank(t, p, next, n, q);
                if (r >= 0) heap_push(h, &nh, (heap_ent){r, q, ver[q]});
            }
        }
    }
    for (uint32_t i = 0; i < n; i = next[i]) {
        int32_t r = rank_lookup(t, p + i, next[i] - i);
        K3_ASSERT(r >= 0);
        K3_TRY(ids_push(out, r));
    }
    return K3_OK;
}

/* One regex match at `off` of subject[0..n): returns 1 with [*ms, *me), 0 if none, <0 error. */
static int regex_next(const k3_tokenizer *t, tok_scratch *s, const uint8_t *subj, size_t n,
                      size_t off, size_t *ms, size_t *me) {
    int rc;
    for (int attempt = 0;; attempt++) {
        if (s->jit && attempt < 2)
            rc = pcre2_jit_match(s->re, subj, n, off, 0, s->md, s->mctx);
        else
            rc =
                pcre2_match(s->re, subj, n, off, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, s->md, s->mctx);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && attempt == 0) {
            /* Deep backtracking on a long piece: give JIT a large stack and retry once;
             * the interpreter (heap frames) is the last resort. */
            if (!s->jstack) s->jstack = pcre2_jit_stack_create(1 << 16, 1 << 28, NULL);
            if (s->jstack) pcre2_jit_stack_assign(s->mctx, NULL, s->jstack);
            continue;
        }
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && attempt == 1) continue;
        break;
    }
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) return rc;
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(s->md);
    *ms = ov[0];
    *me = ov[1];
    return 1;
}

/* The spelling for a text: ADDED when it holds a code point of DIFF_RANGES (and BASE/ADDED are in
 * use), else `re` (BASE, or EXPLICIT for everything). */
static void scratch_pick(tok_scratch *s, const k3_tokenizer *t, bool diff) {
    bool added = diff && t->re_added;
    s->re = added ? t->re_added : t->re;
    s->jit = added ? t->jit_added : t->jit;
}

/* Regex split + BPE of a text run with no specials (tiktoken's _encode_ordinary on a slice:
 * text that no alternative matches is skipped, as tiktoken's find_iter does). */
static k3_status encode_ordinary(const k3_tokenizer *t, tok_scratch *s, const uint8_t *p, size_t n,
                                 k3_tok_ids *out) {
    size_t off = 0;
    while (off < n) {
        size_t ms, me;
        int rc = regex_next(t, s, p, n, off, &ms, &me);
        if (rc == 0) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return K3_ERR(K3_ERR_INTERNAL, "pre-tokenizer match failed at byte %zu: %s", off,
                          (const char *)msg);
        }
        if (me == ms) { /* cannot happen with our patterns; step one code point to be safe */
            uint32_t cp;
            off = ms + utf8_cp(p + ms, n - ms, &cp);
            continue;
        }
        K3_TRY(bpe_piece(t, s, p + ms, me - ms, out));
        off = me;
    }
    return K3_OK;
}

/* Longest special token starting at p[0..n); returns its index or -1, *len its byte length. */
static int32_t special_at(const k3_tokenizer *t, const uint8_t *p, size_t n, size_t *len) {
    int32_t node = 0, best = -1;
    for (size_t k = 0; k < n; k++) {
        int32_t c = t->trie[node].first_child;
        while (c >= 0 && t->trie[c].byte != p[k]) c = t->trie[c].next_sibling;
        if (c < 0) break;
        node = c;
        if (t->trie[node].special >= 0) {
            best = t->trie[node].special;
            *len = k + 1;
        }
    }
    return best;
}

/* One sub-chunk: specials (if allowed) split it, the rest is regex + BPE. */
static k3_status encode_chunk(const k3_tokenizer *t, tok_scratch *s, const uint8_t *p, size_t n,
                              bool allow_special, k3_tok_ids *out) {
    if (!allow_special || t->n_specials == 0) return encode_ordinary(t, s, p, n, out);
    size_t start = 0, i = 0;
    while (i < n) {
        size_t len = 0;
        int32_t sp = t->trie[0].first_child >= 0 ? special_at(t, p + i, n - i, &len) : -1;
        if (sp < 0) {
            i++;
            continue;
        }
        K3_TRY(encode_ordinary(t, s, p + start, i - start, out));
        K3_TRY(ids_push(out, t->specials[sp].id));
        i += len;
        start = i;
    }
    return encode_ordinary(t, s, p + start, n - start, out);
}

/* §4.4: cut every 400,000 code points, then cut runs of > 25,000 whitespace / non-whitespace code
 * points (Python str.isspace); each sub-piece is encoded on its own. */
static k3_status encode_kimi_chunks(const k3_tokenizer *t, tok_scratch *s, const uint8_t *p,
                                    size_t n, bool allow_special, k3_tok_ids *out) {
    size_t pos = 0;
    while (pos < n) {
        /* One 400k-code-point chunk [pos, cend). */
        size_t cend = pos, ncp = 0;
        while (cend < n && ncp < KIMI_MAX_ENCODE_CHARS) {
            uint32_t cp;
            cend += utf8_cp(p + cend, n - cend, &cp);
            ncp++;
        }
        /* _split_whitespaces_or_nonwhitespaces(chunk, 25000). */
        size_t slice_start = pos, run = 0, i = pos;
        bool run_space = false;
        if (pos < cend) {
            uint32_t cp;
            utf8_cp(p + pos, n - pos, &cp);
            run_space = k3_py_isspace(cp);
        }
        while (i < cend) {
            uint32_t cp;
            size_t l = utf8_cp(p + i, n - i, &cp);
            bool sp = k3_py_isspace(cp);
            if (sp != run_space) {
                run = 1;
                run_space = sp;
            } else if (++run > KIMI_MAX_RUN_CHARS) {
                K3_TRY(encode_chunk(t, s, p + slice_start, i - slice_start, allow_special, out));
                slice_start = i;
                run = 1;
            }
            i += l;
        }
        K3_TRY(encode_chunk(t, s, p + slice_start, cend - slice_start, allow_special, out));
        pos = cend;
    }
    return K3_OK;
}

static k3_status encode_with(const k3_tokenizer *t, tok_scratch *s, const char *text, size_t n,
                             bool allow_special, k3_tok_ids *out) {
    if (n && !text) return K3_ERR(K3_ERR_ARG, "text is NULL");
    bool diff;
    K3_TRY(utf8_validate(t, text, n, &diff));
    if (n == 0) return K3_OK;
    scratch_pick(s, t, diff);
    if (t->kimi_chunking)
        return encode_kimi_chunks(t, s, (const uint8_t *)text, n, allow_special, out);
    return encode_chunk(t, s, (const uint8_t *)text, n, allow_special, out);
}

k3_status k3_tok_encode(const k3_tokenizer *t, const char *text, size_t n_bytes, bool allow_special,
                        k3_tok_ids *out) {
    tok_scratch s;
    K3_TRY(scratch_init(&s, t));
    size_t n0 = out->n;
    k3_status st = encode_with(t, &s, text, n_bytes, allow_special, out);
    if (st != K3_OK) out->n = n0;
    scratch_free(&s);
    return st;
}

k3_status k3_tok_encode_segments(const k3_tokenizer *t, const k3_tok_segment *segs, size_t n_segs,
                                 k3_tok_ids *out) {
    tok_scratch s;
    K3_TRY(scratch_init(&s, t));
    size_t n0 = out->n;
    k3_status st = K3_OK;
    for (size_t i = 0; i < n_segs && st == K3_OK; i++) {
        st = encode_with(t, &s, segs[i].text, segs[i].n_bytes, segs[i].allow_special, out);
        if (st != K3_OK) st = K3_ERR(st, "segment %zu: %s", i, k3_last_error());
    }
    if (st != K3_OK) out->n = n0;
    scratch_free(&s);
    return st;
}

k3_status k3_tok_split(const k3_tokenizer *t, const char *text, size_t n_bytes, size_t **offsets,
                       size_t *n_pieces) {
    *offsets = NULL;
    *n_pieces = 0;
    if (n_bytes && !text) return K3_ERR(K3_ERR_ARG, "text is NULL");
    bool diff;
    K3_TRY(utf8_validate(t, text, n_bytes, &diff));
    tok_scratch s;
    K3_TRY(scratch_init(&s, t));
    scratch_pick(&s, t, diff);
    size_t cap = 0, np = 0, off = 0;
    size_t *v = NULL;
    k3_status st = K3_OK;
    while (off < n_bytes) {
        size_t ms, me;
        int rc = regex_next(t, &s, (const uint8_t *)text, n_bytes, off, &ms, &me);
        if (rc == 0) break;
        if (rc < 0) {
            st = K3_ERR(K3_ERR_INTERNAL, "pre-tokenizer match failed at byte %zu (pcre2 %d)", off,
                        rc);
            break;
        }
        if (np == cap) {
            cap = cap ? cap * 2 : 32;
            size_t *nv = realloc(v, cap * 2 * sizeof *nv);
            if (!nv) {
                st = K3_ERR(K3_ERR_NOMEM, "piece offsets");
                break;
            }
            v = nv;
        }
        v[2 * np] = ms;
        v[2 * np + 1] = me;
        np++;
        if (me == ms) {
            uint32_t cp;
            me = ms + utf8_cp((const uint8_t *)text + ms, n_bytes - ms, &cp);
        }
        off = me;
    }
    scratch_free(&s);
    if (st != K3_OK) {
        free(v);
        return st;
    }
    *offsets = v;
    *n_pieces = np;
    return K3_OK;
}
