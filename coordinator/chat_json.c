/* chat_json.c — a small JSON DOM with Python `json` semantics, and the canonical writer.
 *
 * Owns: k3_chat_buf, k3_chat_json_parse/dump/free and the Python float repr (§5.4).
 * Why not cJSON: cJSON stores numbers as double (big ints lose digits, `1.0` and `1` become
 * the same), drops strings with `\u0000`, and keeps no distinction Python keeps. The prompt
 * bytes (and so the prefix cache and the model's distribution) depend on exactly these.
 * Semantics mirrored from CPython's json module: whitespace is ` \t\n\r`; numbers follow
 * `-?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?`, an int when there is no fraction/exponent; NaN,
 * Infinity, -Infinity are accepted; raw control characters inside strings are rejected
 * (strict=True); duplicate object keys keep the first position and the last value.
 * Deviations (clear errors instead of odd Python objects): invalid UTF-8, lone surrogates,
 * nesting deeper than K3_JSON_MAX_DEPTH. */
#include "k3_chat.h"
#include "k3_utf8.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define K3_JSON_MAX_DEPTH      500
#define K3_JSON_MAX_INT_DIGITS 4300 /* CPython's int_max_str_digits default */

/* ---- buffer -------------------------------------------------------------------------- */
k3_status k3_chat_buf_put(k3_chat_buf *b, const void *s, size_t n_bytes) {
    if (b->n + n_bytes + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n_bytes + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p)
            return K3_ERR(K3_ERR_NOMEM, "out of memory growing a text buffer to %zu bytes", cap);
        b->p = p;
        b->cap = cap;
    }
    if (n_bytes) memcpy(b->p + b->n, s, n_bytes);
    b->n += n_bytes;
    b->p[b->n] = 0;
    return K3_OK;
}

k3_status k3_chat_buf_puts(k3_chat_buf *b, const char *s) {
    return k3_chat_buf_put(b, s, strlen(s));
}

void k3_chat_buf_free(k3_chat_buf *b) {
    if (!b) return;
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

/* ---- DOM ----------------------------------------------------------------------------- */
void k3_chat_json_free(k3_chat_json *v) {
    if (!v) return;
    for (size_t i = 0; i < v->n_items; i++) {
        k3_chat_json_free(v->items[i]);
        if (v->keys) k3_chat_json_free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->s);
    free(v);
}

const k3_chat_json *k3_chat_json_get(const k3_chat_json *obj, const char *key) {
    return k3_chat_json_get_n(obj, key, strlen(key));
}

const k3_chat_json *k3_chat_json_get_n(const k3_chat_json *obj, const char *key, size_t n) {
    if (!obj || obj->kind != K3_JSON_OBJECT) return NULL;
    for (size_t i = 0; i < obj->n_items; i++)
        if (obj->keys[i]->n == n && memcmp(obj->keys[i]->s, key, n) == 0) return obj->items[i];
    return NULL;
}

bool k3_chat_json_truthy(const k3_chat_json *v) {
    if (!v) return false;
    switch (v->kind) {
    case K3_JSON_NULL:
        return false;
    case K3_JSON_BOOL:
        return v->b;
    case K3_JSON_INT:
        return !(v->n == 1 && v->s[0] == '0');
    case K3_JSON_FLOAT:
        return v->f != 0.0; /* NaN is truthy in Python too */
    case K3_JSON_STRING:
        return v->n > 0;
    default:
        return v->n_items > 0;
    }
}

bool k3_chat_json_is_str(const k3_chat_json *v, const char *s) {
    return v && v->kind == K3_JSON_STRING && v->n == strlen(s) && memcmp(v->s, s, v->n) == 0;
}

/* ---- reader -------------------------------------------------------------------------- */
typedef struct jreader {
    const char *p, *end, *start;
    const char *what;
} jreader;

static k3_status jerr(const jreader *r, const char *msg) {
    return K3_ERR(K3_ERR_FORMAT, "%s: invalid JSON: %s at byte %td", r->what, msg, r->p - r->start);
}

static void skip_ws(jreader *r) {
    while (r->p < r->end && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r'))
        r->p++;
}

static k3_status new_node(k3_json_kind kind, k3_chat_json **out) {
    k3_chat_json *v = calloc(1, sizeof *v);
    if (!v) return K3_ERR(K3_ERR_NOMEM, "out of memory allocating a JSON node");
    v->kind = kind;
    *out = v;
    return K3_OK;
}

static k3_status put_utf8(k3_chat_buf *b, uint32_t cp) {
    uint8_t u[4];
    return k3_chat_buf_put(b, u, k3_utf8_put(cp, u));
}

static int hex4(const char *p) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

static k3_status read_string(jreader *r, k3_chat_json **out) {
    r->p++; /* opening quote */
    k3_chat_buf b = {0};
    k3_status s = K3_OK;
    for (;;) {
        if (r->p >= r->end) {
            s = jerr(r, "unterminated string");
            break;
        }
        unsigned char c = (unsigned char)*r->p;
        if (c == '"') {
            r->p++;
            break;
        }
        if (c < 0x20) {
            s = jerr(r, "control character in string");
            break;
        }
        if (c != '\\') {
            int n = k3_utf8_next((const uint8_t *)r->p, (size_t)(r->end - r->p), NULL);
            if (n <= 0) {
                s = jerr(r, "invalid UTF-8");
                break;
            }
            if ((s = k3_chat_buf_put(&b, r->p, (size_t)n))) break;
            r->p += n;
            continue;
        }
        if (r->end - r->p < 2) {
            s = jerr(r, "unterminated escape");
            break;
        }
        char e = r->p[1];
        const char *simple = NULL;
        switch (e) {
        case '"':
            simple = "\"";
            break;
        case '\\':
            simple = "\\";
            break;
        case '/':
            simple = "/";
            break;
        case 'b':
            simple = "\b";
            break;
        case 'f':
            simple = "\f";
            break;
        case 'n':
            simple = "\n";
            break;
        case 'r':
            simple = "\r";
            break;
        case 't':
            simple = "\t";
            break;
        default:
            break;
        }
        if (simple) {
            if ((s = k3_chat_buf_put(&b, simple, 1))) break;
            r->p += 2;
            continue;
        }
        if (e != 'u') {
            s = jerr(r, "invalid escape");
            break;
        }
        int cp = r->end - r->p >= 6 ? hex4(r->p + 2) : -1;
        if (cp < 0) {
            s = jerr(r, "invalid \\u escape");
            break;
        }
        r->p += 6;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            int lo =
                (r->end - r->p >= 6 && r->p[0] == '\\' && r->p[1] == 'u') ? hex4(r->p + 2) : -1;
            if (lo < 0xDC00 || lo > 0xDFFF) {
                s = jerr(r, "lone surrogate in \\u escape");
                break;
            }
            r->p += 6;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            s = jerr(r, "lone surrogate in \\u escape");
            break;
        }
        if ((s = put_utf8(&b, (uint32_t)cp))) break;
    }
    if (s == K3_OK) s = new_node(K3_JSON_STRING, out);
    if (s != K3_OK) {
        k3_chat_buf_free(&b);
        return s;
    }
    if (!b.p && (s = k3_chat_buf_put(&b, "", 0))) {
        free(*out);
        *out = NULL;
        return s;
    }
    (*out)->s = b.p;
    (*out)->n = b.n;
    return K3_OK;
}

static bool is_digit(char c) {
    return c >= '0' && c <= '9';
}

static k3_status read_number(jreader *r, k3_chat_json **out) {
    const char *b = r->p, *p = r->p;
    if (p < r->end && *p == '-') p++;
    if (p >= r->end || !is_digit(*p)) return jerr(r, "invalid number");
    if (*p == '0')
        p++;
    else
        while (p < r->end && is_digit(*p)) p++;
    bool is_float = false;
    if (p + 1 < r->end && *p == '.' && is_digit(p[1])) {
        is_float = true;
        p++;
        while (p < r->end && is_digit(*p)) p++;
    }
    if (p < r->end && (*p == 'e' || *p == 'E')) {
        const char *q = p + 1;
        if (q < r->end && (*q == '+' || *q == '-')) q++;
        if (q < r->end && is_digit(*q)) {
            is_float = true;
            p = q;
            while (p < r->end && is_digit(*p)) p++;
        }
    }
    size_t n = (size_t)(p - b);
    K3_TRY(new_node(is_float ? K3_JSON_FLOAT : K3_JSON_INT, out));
    char *s = malloc(n + 1);
    if (!s) {
        free(*out);
        *out = NULL;
        return K3_ERR(K3_ERR_NOMEM, "out of memory reading a number");
    }
    memcpy(s, b, n);
    s[n] = 0;
    if (is_float) {
        (*out)->f = strtod(s, NULL); /* correctly rounded, overflow -> inf like float() */
        free(s);
    } else {
        if (n - (b[0] == '-') > K3_JSON_MAX_INT_DIGITS) {
            free(s);
            free(*out);
            *out = NULL;
            return jerr(r, "integer has more than 4300 digits");
        }
        if (strcmp(s, "-0") == 0) {
            s[0] = '0';
            s[1] = 0;
            n = 1;
        } /* int("-0") == 0 */
        (*out)->s = s;
        (*out)->n = n;
    }
    r->p = p;
    return K3_OK;
}

static bool lit(jreader *r, const char *w) {
    size_t n = strlen(w);
    if ((size_t)(r->end - r->p) < n || memcmp(r->p, w, n) != 0) return false;
    r->p += n;
    return true;
}

static k3_status push_item(k3_chat_json *v, k3_chat_json *key, k3_chat_json *item) {
    if ((v->n_items & (v->n_items - 1)) == 0) { /* grow at powers of two */
        size_t cap = v->n_items ? v->n_items * 2 : 4;
        k3_chat_json **it = realloc(v->items, cap * sizeof *it);
        if (!it) return K3_ERR(K3_ERR_NOMEM, "out of memory growing a JSON container");
        v->items = it;
        if (key) {
            k3_chat_json **ks = realloc(v->keys, cap * sizeof *ks);
            if (!ks) return K3_ERR(K3_ERR_NOMEM, "out of memory growing a JSON object");
            v->keys = ks;
        }
    }
    v->items[v->n_items] = item;
    if (key) v->keys[v->n_items] = key;
    v->n_items++;
    return K3_OK;
}

static k3_status read_value(jreader *r, int depth, k3_chat_json **out);

/* The duplicate-key check while an object is read. A scan of the members so far made n keys cost
 * n^2/2 compares (a 1 MB body of 100k keys: a minute of CPU); above KEYIDX_FROM members an
 * open-addressing hash of member indices keeps it linear. The hash is seeded per object from the
 * clock and an address and its bits mixed down (fmix64), so a client cannot send keys made to
 * collide in the table's low bits. */
#define KEYIDX_FROM 16
typedef struct keyidx {
    size_t *slot; /* (cap) member index + 1; 0 = empty; cap a power of two, at most half full */
    size_t cap;
    uint64_t seed;
} keyidx;

static size_t key_hash(const keyidx *x, const k3_chat_json *key) {
    uint64_t h = k3_hash_bytes(key->s, key->n, x->seed);
    h ^= h >> 33, h *= 0xff51afd7ed558ccdull, h ^= h >> 33, h *= 0xc4ceb9fe1a85ec53ull;
    return (size_t)(h ^ (h >> 33));
}

static bool same_key(const k3_chat_json *a, const k3_chat_json *b) {
    return a->n == b->n && memcmp(a->s, b->s, a->n) == 0;
}

/* The slot that holds `key` among v's members, or the empty slot where it would go. */
static size_t keyidx_probe(const keyidx *x, const k3_chat_json *v, const k3_chat_json *key) {
    size_t h = key_hash(x, key) & (x->cap - 1);
    while (x->slot[h] && !same_key(v->keys[x->slot[h] - 1], key)) h = (h + 1) & (x->cap - 1);
    return h;
}

/* The index of v's member named `key`, or v->n_items; keeps the index ready for one more. */
static k3_status find_key(keyidx *x, const k3_chat_json *v, const k3_chat_json *key, size_t *at) {
    *at = v->n_items;
    if (v->n_items < KEYIDX_FROM) {
        for (size_t i = 0; i < v->n_items; i++)
            if (same_key(v->keys[i], key)) *at = i;
        return K3_OK;
    }
    if (2 * (v->n_items + 1) > x->cap) { /* (re)build from the members so far */
        size_t cap = x->cap ? 2 * x->cap : 4 * KEYIDX_FROM;
        while (2 * (v->n_items + 1) > cap) cap *= 2;
        size_t *slot = calloc(cap, sizeof *slot);
        if (!slot) return K3_ERR(K3_ERR_NOMEM, "out of memory indexing a JSON object");
        free(x->slot);
        const double t = k3_now_s();
        *x = (keyidx){slot, cap, x->seed ? x->seed : k3_hash_bytes(&t, sizeof t, (uintptr_t)slot)};
        for (size_t i = 0; i < v->n_items; i++) x->slot[keyidx_probe(x, v, v->keys[i])] = i + 1;
    }
    const size_t h = keyidx_probe(x, v, key);
    if (x->slot[h])
        *at = x->slot[h] - 1;
    else
        x->slot[h] = v->n_items + 1; /* the caller appends it there */
    return K3_OK;
}

static k3_status read_container(jreader *r, int depth, bool is_obj, k3_chat_json **out) {
    if (depth >= K3_JSON_MAX_DEPTH) return jerr(r, "nesting too deep");
    K3_TRY(new_node(is_obj ? K3_JSON_OBJECT : K3_JSON_ARRAY, out));
    k3_chat_json *v = *out;
    char close = is_obj ? '}' : ']';
    r->p++;
    skip_ws(r);
    if (r->p < r->end && *r->p == close) {
        r->p++;
        return K3_OK;
    }
    k3_status s = K3_OK;
    keyidx idx = {0};
    for (;;) {
        k3_chat_json *key = NULL, *item = NULL;
        if (is_obj) {
            skip_ws(r);
            if (r->p >= r->end || *r->p != '"') {
                s = jerr(r, "expected a property name");
                break;
            }
            if ((s = read_string(r, &key))) break;
            skip_ws(r);
            if (r->p >= r->end || *r->p != ':') {
                k3_chat_json_free(key);
                s = jerr(r, "expected ':'");
                break;
            }
            r->p++;
        }
        if ((s = read_value(r, depth + 1, &item))) {
            k3_chat_json_free(key);
            break;
        }
        size_t dup = v->n_items;
        if (is_obj && (s = find_key(&idx, v, key, &dup))) {
            k3_chat_json_free(key);
            k3_chat_json_free(item);
            break;
        }
        if (dup < v->n_items) { /* Python dict: keep the first position, take the last value */
            k3_chat_json_free(v->items[dup]);
            v->items[dup] = item;
            k3_chat_json_free(key);
        } else if ((s = push_item(v, key, item))) {
            k3_chat_json_free(key);
            k3_chat_json_free(item);
            break;
        }
        skip_ws(r);
        if (r->p < r->end && *r->p == ',') {
            r->p++;
            continue;
        }
        if (r->p < r->end && *r->p == close) {
            r->p++;
            break;
        }
        s = jerr(r, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
        break;
    }
    free(idx.slot);
    if (s) {
        k3_chat_json_free(v);
        *out = NULL;
    }
    return s;
}

static k3_status read_value(jreader *r, int depth, k3_chat_json **out) {
    skip_ws(r);
    if (r->p >= r->end) return jerr(r, "unexpected end of input");
    char c = *r->p;
    if (c == '{') return read_container(r, depth, true, out);
    if (c == '[') return read_container(r, depth, false, out);
    if (c == '"') return read_string(r, out);
    if (c == '-' || is_digit(c)) {
        if (c == '-' && r->end - r->p >= 9 && memcmp(r->p, "-Infinity", 9) == 0) {
            r->p += 9;
            K3_TRY(new_node(K3_JSON_FLOAT, out));
            (*out)->f = -INFINITY;
            return K3_OK;
        }
        return read_number(r, out);
    }
    if (lit(r, "null")) return new_node(K3_JSON_NULL, out);
    if (lit(r, "true") || lit(r, "false")) {
        K3_TRY(new_node(K3_JSON_BOOL, out));
        (*out)->b = r->p[-1] == 'e' && r->p[-2] == 'u';
        return K3_OK;
    }
    if (lit(r, "NaN") || lit(r, "Infinity")) {
        K3_TRY(new_node(K3_JSON_FLOAT, out));
        (*out)->f = r->p[-1] == 'N' ? NAN : INFINITY;
        return K3_OK;
    }
    return jerr(r, "expected a value");
}

k3_status k3_chat_json_parse(const char *text, size_t n_bytes, const char *what,
                             k3_chat_json **out) {
    *out = NULL;
    jreader r = {.p = text, .end = text + n_bytes, .start = text, .what = what ? what : "JSON"};
    /* Raw bytes outside strings must be JSON syntax (ASCII); inside strings read_string checks
     * UTF-8, so one pass suffices. */
    K3_TRY(read_value(&r, 0, out));
    skip_ws(&r);
    if (r.p != r.end) {
        k3_chat_json_free(*out);
        *out = NULL;
        return jerr(&r, "extra data after the value");
    }
    return K3_OK;
}

/* ---- writer -------------------------------------------------------------------------- */
void k3_chat_json_float_repr(double f, char out[32]) {
    if (isnan(f)) {
        strcpy(out, "NaN");
        return;
    }
    if (isinf(f)) {
        strcpy(out, f < 0 ? "-Infinity" : "Infinity");
        return;
    }
    if (f == 0.0) {
        strcpy(out, signbit(f) ? "-0.0" : "0.0");
        return;
    }
    /* Shortest digit string that round-trips (what repr / dtoa mode 0 produces). */
    char buf[48];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*e", p - 1, f);
        if (strtod(buf, NULL) == f) break;
    }
    const char *q = buf;
    bool neg = *q == '-';
    if (neg) q++;
    char dig[24];
    int nd = 0;
    for (; *q && *q != 'e'; q++)
        if (*q != '.') dig[nd++] = *q;
    int e10 = atoi(q + 1);
    while (nd > 1 && dig[nd - 1] == '0') nd--;
    dig[nd] = 0;
    int decpt = e10 + 1; /* value = 0.DIGITS x 10^decpt */
    char *o = out;
    if (neg) *o++ = '-';
    if (decpt > -4 && decpt <= 16) { /* Python: exponent form iff decpt <= -4 or decpt > 16 */
        if (decpt <= 0) {
            *o++ = '0';
            *o++ = '.';
            for (int i = 0; i < -decpt; i++) *o++ = '0';
            memcpy(o, dig, (size_t)nd);
            o += nd;
        } else if (decpt >= nd) {
            memcpy(o, dig, (size_t)nd);
            o += nd;
            for (int i = nd; i < decpt; i++) *o++ = '0';
            *o++ = '.';
            *o++ = '0';
        } else {
            memcpy(o, dig, (size_t)decpt);
            o += decpt;
            *o++ = '.';
            memcpy(o, dig + decpt, (size_t)(nd - decpt));
            o += nd - decpt;
        }
        *o = 0;
    } else {
        *o++ = dig[0];
        if (nd > 1) {
            *o++ = '.';
            memcpy(o, dig + 1, (size_t)(nd - 1));
            o += nd - 1;
        }
        int ae = e10 < 0 ? -e10 : e10; /* |e10| <= 324 for a double */
        *o++ = 'e';
        *o++ = e10 < 0 ? '-' : '+';
        if (ae >= 100) *o++ = (char)('0' + ae / 100);
        *o++ = (char)('0' + ae / 10 % 10);
        *o++ = (char)('0' + ae % 10);
        *o = 0;
    }
}

k3_status k3_chat_json_dump_str(const char *s, size_t n_bytes, k3_chat_buf *out) {
    K3_TRY(k3_chat_buf_put(out, "\"", 1));
    size_t run = 0; /* bytes copied verbatim in one go */
    for (size_t i = 0; i < n_bytes; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        K3_TRY(k3_chat_buf_put(out, s + run, i - run));
        run = i + 1;
        char esc[8];
        switch (c) {
        case '"':
            strcpy(esc, "\\\"");
            break;
        case '\\':
            strcpy(esc, "\\\\");
            break;
        case '\n':
            strcpy(esc, "\\n");
            break;
        case '\r':
            strcpy(esc, "\\r");
            break;
        case '\t':
            strcpy(esc, "\\t");
            break;
        case '\b':
            strcpy(esc, "\\b");
            break;
        case '\f':
            strcpy(esc, "\\f");
            break;
        default:
            snprintf(esc, sizeof esc, "\\u%04x", c);
            break;
        }
        K3_TRY(k3_chat_buf_puts(out, esc));
    }
    K3_TRY(k3_chat_buf_put(out, s + run, n_bytes - run));
    return k3_chat_buf_put(out, "\"", 1);
}

typedef struct keyref {
    const k3_chat_json *key;
    size_t idx;
} keyref;

static int key_cmp(const void *pa, const void *pb) {
    const k3_chat_json *a = ((const keyref *)pa)->key, *b = ((const keyref *)pb)->key;
    size_t n = K3_MIN(a->n, b->n);
    int c = n ? memcmp(a->s, b->s, n) : 0; /* UTF-8 byte order == code point order */
    if (c) return c;
    return a->n < b->n ? -1 : a->n > b->n;
}

k3_status k3_chat_json_dump(const k3_chat_json *v, int flags, k3_chat_buf *out) {
    const char *item_sep = (flags & K3_JSON_COMPACT) ? "," : ", ";
    const char *key_sep = (flags & K3_JSON_COMPACT) ? ":" : ": ";
    switch (v->kind) {
    case K3_JSON_NULL:
        return k3_chat_buf_puts(out, "null");
    case K3_JSON_BOOL:
        return k3_chat_buf_puts(out, v->b ? "true" : "false");
    case K3_JSON_INT:
        return k3_chat_buf_put(out, v->s, v->n);
    case K3_JSON_FLOAT: {
        char f[32];
        k3_chat_json_float_repr(v->f, f);
        return k3_chat_buf_puts(out, f);
    }
    case K3_JSON_STRING:
        return k3_chat_json_dump_str(v->s, v->n, out);
    case K3_JSON_ARRAY:
        K3_TRY(k3_chat_buf_puts(out, "["));
        for (size_t i = 0; i < v->n_items; i++) {
            if (i) K3_TRY(k3_chat_buf_puts(out, item_sep));
            K3_TRY(k3_chat_json_dump(v->items[i], flags, out));
        }
        return k3_chat_buf_puts(out, "]");
    case K3_JSON_OBJECT: {
        /* Keys are unique (the reader merges duplicates), so an unstable sort is fine. */
        keyref *ord = malloc((v->n_items + 1) * sizeof *ord);
        if (!ord) return K3_ERR(K3_ERR_NOMEM, "out of memory sorting JSON keys");
        for (size_t i = 0; i < v->n_items; i++) ord[i] = (keyref){v->keys[i], i};
        if (flags & K3_JSON_SORT_KEYS) qsort(ord, v->n_items, sizeof *ord, key_cmp);
        k3_status s = k3_chat_buf_puts(out, "{");
        for (size_t i = 0; s == K3_OK && i < v->n_items; i++) {
            if (i) s = k3_chat_buf_puts(out, item_sep);
            if (!s) s = k3_chat_json_dump(ord[i].key, flags, out);
            if (!s) s = k3_chat_buf_puts(out, key_sep);
            if (!s) s = k3_chat_json_dump(v->items[ord[i].idx], flags, out);
        }
        free(ord);
        K3_TRY(s);
        return k3_chat_buf_puts(out, "}");
    }
    }
    return K3_ERR(K3_ERR_INTERNAL, "bad JSON node kind %d", (int)v->kind);
}
