/* grammar_schema.c — what the automaton is built from: JSON Schema (a subset), regular
 * expressions (a subset), literal choices, and the K3 answer envelope (thinking, response, tool
 * calls in K3's XTML syntax, spec/K3-CHAT.md §2).
 *
 * JSON text is generated in one canonical shape, a subset of what the schema allows: objects list
 * their declared properties in schema order (optional ones may be left out), no whitespace except
 * one optional space after ':' and ','; integers have at most 16 digits, fractions at most 16,
 * exponents at most 2 (so a random model cannot run on forever inside one number); strings are
 * valid UTF-8, with \uXXXX escapes of non-surrogates only. A subset is always sound: whatever
 * the automaton accepts validates against the schema (tests/grammar checks it against jsonschema).
 *
 * Refused with K3_ERR_ARG naming the keyword and where it sits: every keyword outside the list in
 * kw_ok(), a format outside fmt_regex(), and regex constructs outside the subset of rx_atom(). */
#include "grammar_internal.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct g_ref { /* a rule whose body is still to build (the worklist: no recursion) */
    const k3_chat_json *node, *root;
    int kind; /* -1: the node's value; 5 / 6: its object / array form */
    int32_t rule;
    char *path;
} g_ref;

typedef struct g_cx {
    g_build *b;
    const k3_chat_json *root;                     /* the schema $ref resolves against */
    int32_t r_string, r_number, r_integer, r_any; /* shared rules (-1: not built yet) */
    g_ref *refs;                                  /* rules whose bodies are still to build */
    int n_refs, cap_refs;
    g_tables *tab;
    const char *what;
} g_cx;

static bool failed(g_cx *c) {
    return c->b->err != K3_OK;
}

static void fail(g_cx *c, const char *path, const char *fmt, const char *arg) {
    if (failed(c)) return;
    char msg[256];
    snprintf(msg, sizeof msg, fmt, arg);
    c->b->err = K3_ERR(K3_ERR_ARG, "%s at %s", msg, path);
}

static void subpath(char *out, size_t n, const char *path, const char *key) {
    snprintf(out, n, "%.400s.%.60s", path, key);
}

static int32_t lit(g_cx *c, int32_t from, const char *s) {
    return gb_lit(c->b, from, s, strlen(s));
}

static int32_t mark(g_cx *c, int32_t from, int sym) {
    int32_t t = gb_state(c->b);
    gb_sym(c->b, from, (uint16_t)sym, (uint16_t)sym, t);
    return t;
}

/* An optional single space. */
static int32_t ws_opt(g_cx *c, int32_t from) {
    int32_t t = gb_state(c->b);
    gb_eps(c->b, from, t);
    gb_sym(c->b, from, ' ', ' ', t);
    return t;
}

static int32_t call(g_cx *c, int32_t from, int32_t rule) {
    int32_t t = gb_state(c->b);
    gb_call(c->b, from, rule, t);
    return t;
}

/* ---- regular expressions -------------------------------------------------------------------- */
typedef enum { RX_SET, RX_LIT, RX_CAT, RX_ALT, RX_REP } rx_kind;
typedef struct rx {
    rx_kind k;
    bool set[128]; /* RX_SET: ASCII bytes */
    bool nonascii; /* RX_SET: any non-ASCII character too ('.') */
    char lit[4];   /* RX_LIT: one UTF-8 character */
    int n_lit;
    struct rx **kid; /* RX_CAT / RX_ALT / RX_REP (one) */
    int n_kid, cap_kid;
    int min, max; /* RX_REP; max -1: unbounded */
} rx;

typedef struct rx_parser {
    const char *s;
    size_t i, n;
    const char *path;
    g_cx *c;
    int depth;
} rx_parser;

static void rx_free(rx *r) {
    if (!r) return;
    for (int i = 0; i < r->n_kid; i++) rx_free(r->kid[i]);
    free(r->kid);
    free(r);
}

static rx *rx_new(rx_parser *p, rx_kind k) {
    rx *r = calloc(1, sizeof *r);
    if (!r && !failed(p->c)) p->c->b->err = K3_ERR(K3_ERR_NOMEM, "regex");
    if (r) r->k = k;
    return r;
}

static bool rx_add(rx_parser *p, rx *r, rx *kid) {
    if (!kid) return false;
    if (r->n_kid == r->cap_kid) {
        int nc = r->cap_kid ? 2 * r->cap_kid : 4;
        rx **q = realloc(r->kid, (size_t)nc * sizeof *q);
        if (!q) {
            rx_free(kid);
            if (!failed(p->c)) p->c->b->err = K3_ERR(K3_ERR_NOMEM, "regex");
            return false;
        }
        r->kid = q, r->cap_kid = nc;
    }
    r->kid[r->n_kid++] = kid;
    return true;
}

static void rx_err(rx_parser *p, const char *what) {
    char m[160];
    snprintf(m, sizeof m, "unsupported regex construct %s (at offset %zu of the pattern)", what,
             p->i);
    fail(p->c, p->path, "%s", m);
}

static void set_range(rx *r, int lo, int hi) {
    for (int b = lo; b <= hi && b < 128; b++) r->set[b] = true;
}

/* \d \w \s and their negations into r (ASCII only: the negations then match a subset of what
 * Python's re matches, which keeps generation sound). */
static bool class_escape(rx *r, char e) {
    bool tmp[128] = {0};
    char lower = (char)(e | 0x20);
    if (lower == 'd') {
        for (int b = '0'; b <= '9'; b++) tmp[b] = true;
    } else if (lower == 'w') {
        for (int b = 0; b < 128; b++)
            tmp[b] = (b >= '0' && b <= '9') || (b >= 'a' && b <= 'z') || (b >= 'A' && b <= 'Z') ||
                     b == '_';
    } else if (lower == 's') {
        tmp[' '] = tmp['\t'] = tmp['\n'] = tmp['\r'] = tmp['\f'] = tmp['\v'] = true;
    } else {
        return false;
    }
    bool neg = e >= 'A' && e <= 'Z';
    for (int b = 0; b < 128; b++)
        if (tmp[b] != neg) r->set[b] = true;
    return true;
}

static int hexv(char ch) {
    return ch >= '0' && ch <= '9'   ? ch - '0'
           : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
           : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10
                                    : -1;
}

/* A single-character escape after '\': its byte, or -1 (then rx_err was called). */
static int simple_escape(rx_parser *p) {
    char e = p->s[p->i++];
    switch (e) {
    case 'n':
        return '\n';
    case 't':
        return '\t';
    case 'r':
        return '\r';
    case 'f':
        return '\f';
    case 'v':
        return '\v';
    case 'x':
        if (p->i + 2 <= p->n && hexv(p->s[p->i]) >= 0 && hexv(p->s[p->i + 1]) >= 0) {
            int v = hexv(p->s[p->i]) * 16 + hexv(p->s[p->i + 1]);
            p->i += 2;
            if (v < 128) return v;
        }
        rx_err(p, "\\x (outside ASCII)");
        return -1;
    default:
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9') ||
            (unsigned char)e >= 0x80) {
            char w[8] = {'\\', e, 0};
            rx_err(p, w);
            return -1;
        }
        return (unsigned char)e; /* an escaped punctuation character */
    }
}

static rx *rx_alt(rx_parser *p);

static rx *rx_class(rx_parser *p) {
    rx *r = rx_new(p, RX_SET);
    if (!r) return NULL;
    bool neg = p->i < p->n && p->s[p->i] == '^';
    if (neg) p->i++;
    bool first = true;
    while (p->i < p->n && (p->s[p->i] != ']' || first)) {
        first = false;
        int lo;
        if (p->s[p->i] == '\\') {
            p->i++;
            if (p->i >= p->n) break;
            if (class_escape(r, p->s[p->i])) {
                p->i++;
                continue;
            }
            if ((lo = simple_escape(p)) < 0) break;
        } else if ((unsigned char)p->s[p->i] >= 0x80) {
            rx_err(p, "(a non-ASCII character in a class)");
            break;
        } else {
            lo = (unsigned char)p->s[p->i++];
        }
        int hi = lo;
        if (p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
            p->i++;
            if (p->s[p->i] == '\\') {
                p->i++;
                if (p->i >= p->n || (hi = simple_escape(p)) < 0) break;
            } else if ((unsigned char)p->s[p->i] >= 0x80) {
                rx_err(p, "(a non-ASCII character in a class)");
                break;
            } else {
                hi = (unsigned char)p->s[p->i++];
            }
            if (hi < lo) {
                rx_err(p, "(a reversed class range)");
                break;
            }
        }
        set_range(r, lo, hi);
    }
    if (!failed(p->c) && (p->i >= p->n || p->s[p->i] != ']')) rx_err(p, "(an unclosed '[')");
    p->i++;
    if (failed(p->c)) {
        rx_free(r);
        return NULL;
    }
    if (neg)
        for (int b = 0; b < 128; b++) r->set[b] = !r->set[b];
    return r;
}

static rx *rx_atom(rx_parser *p) {
    char ch = p->s[p->i];
    if (ch == '(') {
        p->i++;
        if (p->i < p->n && p->s[p->i] == '?') {
            if (p->i + 1 < p->n && p->s[p->i + 1] == ':') {
                p->i += 2;
            } else if (p->i + 2 < p->n && (p->s[p->i + 1] == '<' || p->s[p->i + 1] == 'P') &&
                       p->s[p->i + 2] != '=' && p->s[p->i + 2] != '!') {
                while (p->i < p->n && p->s[p->i] != '>') p->i++; /* a named group */
                p->i++;
            } else {
                rx_err(p, "(?... (lookaround, flags)");
                return NULL;
            }
        }
        if (++p->depth > 100) {
            rx_err(p, "(nesting deeper than 100)");
            return NULL;
        }
        rx *r = rx_alt(p);
        p->depth--;
        if (r && (p->i >= p->n || p->s[p->i] != ')')) {
            rx_err(p, "(an unclosed '(')");
            rx_free(r);
            return NULL;
        }
        p->i++;
        return r;
    }
    rx *r = rx_new(p, RX_SET);
    if (!r) return NULL;
    if (ch == '[') {
        p->i++;
        rx_free(r);
        return rx_class(p);
    }
    if (ch == '.') {
        p->i++;
        set_range(r, 0, 127);
        r->set['\n'] = false;
        r->nonascii = true;
        return r;
    }
    if (ch == '\\') {
        p->i++;
        if (p->i >= p->n) {
            rx_err(p, "(a trailing '\\')");
        } else if (class_escape(r, p->s[p->i])) {
            p->i++;
            return r;
        } else {
            int b = simple_escape(p);
            if (b >= 0) {
                r->set[b] = true;
                return r;
            }
        }
        rx_free(r);
        return NULL;
    }
    if (ch == '*' || ch == '+' || ch == '?' || ch == '{' || ch == ')' || ch == '^' || ch == '$') {
        char w[8] = {'\'', ch, '\'', 0};
        rx_err(p, w);
        rx_free(r);
        return NULL;
    }
    unsigned char u = (unsigned char)ch;
    if (u < 0x80) {
        r->set[u] = true;
        p->i++;
        return r;
    }
    int len = u >= 0xF0 ? 4 : u >= 0xE0 ? 3 : u >= 0xC0 ? 2 : 1;
    if (len == 1 || p->i + (size_t)len > p->n) {
        rx_err(p, "(invalid UTF-8)");
        rx_free(r);
        return NULL;
    }
    r->k = RX_LIT;
    memcpy(r->lit, p->s + p->i, (size_t)len);
    r->n_lit = len;
    p->i += (size_t)len;
    return r;
}

static bool rx_num(rx_parser *p, int *v) {
    if (p->i >= p->n || p->s[p->i] < '0' || p->s[p->i] > '9') return false;
    long x = 0;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9' && x <= 100000)
        x = x * 10 + (p->s[p->i++] - '0');
    *v = (int)x;
    return true;
}

static rx *rx_repeat(rx_parser *p) {
    rx *a = rx_atom(p);
    while (a && p->i < p->n) {
        char ch = p->s[p->i];
        int mn, mx;
        if (ch == '*') {
            mn = 0, mx = -1, p->i++;
        } else if (ch == '+') {
            mn = 1, mx = -1, p->i++;
        } else if (ch == '?') {
            mn = 0, mx = 1, p->i++;
        } else if (ch == '{') {
            size_t save = p->i++;
            if (!rx_num(p, &mn)) { /* a literal '{' as Python reads it */
                p->i = save;
                break;
            }
            mx = mn;
            if (p->i < p->n && p->s[p->i] == ',') {
                p->i++;
                if (!rx_num(p, &mx)) mx = -1;
            }
            if (p->i >= p->n || p->s[p->i] != '}') {
                rx_err(p, "(a malformed {n,m})");
                rx_free(a);
                return NULL;
            }
            p->i++;
            if ((mx >= 0 && mx < mn) || mn > 1000 || mx > 1000) {
                rx_err(p, "(a repeat count above 1000 or min > max)");
                rx_free(a);
                return NULL;
            }
        } else {
            break;
        }
        if (p->i < p->n && p->s[p->i] == '?') p->i++; /* lazy: the same language */
        if (p->i < p->n && p->s[p->i] == '+') {
            rx_err(p, "(a possessive quantifier)");
            rx_free(a);
            return NULL;
        }
        rx *r = rx_new(p, RX_REP);
        if (!r || !rx_add(p, r, a)) {
            rx_free(r);
            return NULL;
        }
        r->min = mn, r->max = mx;
        a = r;
    }
    return a;
}

static rx *rx_alt(rx_parser *p) {
    rx *alt = rx_new(p, RX_ALT);
    if (!alt) return NULL;
    for (;;) {
        rx *cat = rx_new(p, RX_CAT);
        if (!cat || !rx_add(p, alt, cat)) break;
        while (p->i < p->n && p->s[p->i] != '|' && p->s[p->i] != ')') {
            if (p->s[p->i] == '$' && p->i + 1 == p->n && p->depth == 0) {
                p->i++; /* an end anchor: the match is whole anyway */
                break;
            }
            if (!rx_add(p, cat, rx_repeat(p))) break;
        }
        if (failed(p->c)) break;
        if (p->i < p->n && p->s[p->i] == '|') {
            p->i++;
            continue;
        }
        break;
    }
    if (failed(p->c)) {
        rx_free(alt);
        return NULL;
    }
    return alt;
}

/* How one ASCII byte is written: raw, or (json) escaped inside a JSON string. */
static int32_t emit_byte(g_cx *c, int32_t from, int b, bool json, int32_t to) {
    if (!json || (b >= 0x20 && b != '"' && b != '\\')) {
        gb_sym(c->b, from, (uint16_t)b, (uint16_t)b, to);
        return to;
    }
    char e[8];
    const char *sh = b == '"'    ? "\\\""
                     : b == '\\' ? "\\\\"
                     : b == '\n' ? "\\n"
                     : b == '\t' ? "\\t"
                     : b == '\r' ? "\\r"
                     : b == '\b' ? "\\b"
                     : b == '\f' ? "\\f"
                                 : NULL;
    if (!sh) snprintf(e, sizeof e, "\\u%04x", b), sh = e;
    gb_eps(c->b, g_trie_bytes(c->b, c->tab, from, sh, strlen(sh)), to); /* escapes share '\\' */
    return to;
}

static int32_t rx_emit(g_cx *c, int32_t from, const rx *r, bool json) {
    if (failed(c)) return from;
    switch (r->k) {
    case RX_SET: {
        int32_t to = gb_state(c->b);
        bool direct[128];
        for (int b = 0; b < 128; b++)
            direct[b] = r->set[b] && (!json || (b >= 0x20 && b != '"' && b != '\\'));
        if (r->nonascii) {
            int32_t t = gb_utf8_char(c->b, from, direct);
            gb_eps(c->b, t, to);
        } else {
            for (int lo = 0; lo < 128;) {
                if (!direct[lo]) {
                    lo++;
                    continue;
                }
                int hi = lo;
                while (hi + 1 < 128 && direct[hi + 1]) hi++;
                gb_sym(c->b, from, (uint16_t)lo, (uint16_t)hi, to);
                lo = hi + 1;
            }
        }
        for (int b = 0; b < 128; b++)
            if (r->set[b] && !direct[b]) emit_byte(c, from, b, json, to);
        return to;
    }
    case RX_LIT:
        return gb_lit(c->b, from, r->lit, (size_t)r->n_lit);
    case RX_CAT:
        for (int i = 0; i < r->n_kid; i++) from = rx_emit(c, from, r->kid[i], json);
        return from;
    case RX_ALT: {
        int32_t to = gb_state(c->b);
        for (int i = 0; i < r->n_kid; i++) gb_eps(c->b, rx_emit(c, from, r->kid[i], json), to);
        return to;
    }
    case RX_REP: {
        for (int i = 0; i < r->min; i++) from = rx_emit(c, from, r->kid[0], json);
        if (r->max < 0) {
            int32_t loop = gb_state(c->b);
            gb_eps(c->b, from, loop);
            gb_eps(c->b, rx_emit(c, loop, r->kid[0], json), loop);
            return loop;
        }
        /* x{min,max} = x^min (x (x (...)?)?)?: each optional copy may end the repeat (one shared
         * exit), so after any prefix one copy is live, not every later one */
        int32_t out = gb_state(c->b);
        for (int i = r->min; i < r->max && !failed(c); i++) {
            gb_eps(c->b, from, out);
            from = rx_emit(c, from, r->kid[0], json);
        }
        gb_eps(c->b, from, out);
        return out;
    }
    }
    return from;
}

/* A whole-match of `pattern` (Python re syntax, subset) from `from`; json: inside a JSON string. */
static int32_t regex(g_cx *c, int32_t from, const char *pat, bool json, const char *path) {
    rx_parser p = {.s = pat, .n = strlen(pat), .path = path, .c = c};
    if (p.n && pat[0] == '^') p.i++;
    rx *r = rx_alt(&p);
    if (r && p.i < p.n) rx_err(&p, "(an unmatched ')')");
    int32_t t = r && !failed(c) ? rx_emit(c, from, r, json) : from;
    rx_free(r);
    return t;
}

/* ---- JSON values --------------------------------------------------------------------------- */
static int32_t json_string_rule(g_cx *c) {
    if (c->r_string >= 0) return c->r_string;
    int32_t r = gb_rule(c->b), s = c->b->rule_start[r], e = c->b->rule_end[r];
    c->r_string = r;
    int32_t body = lit(c, s, "\"");
    bool ok[128];
    for (int b = 0; b < 128; b++) ok[b] = b >= 0x20 && b != '"' && b != '\\';
    gb_eps(c->b, gb_utf8_char(c->b, body, ok), body);
    int32_t esc = lit(c, body, "\\");
    gb_sym(c->b, esc, '"', '"', body), gb_sym(c->b, esc, '\\', '\\', body);
    gb_sym(c->b, esc, '/', '/', body), gb_sym(c->b, esc, 'b', 'b', body);
    gb_sym(c->b, esc, 'f', 'f', body), gb_sym(c->b, esc, 'n', 'n', body);
    gb_sym(c->b, esc, 'r', 'r', body), gb_sym(c->b, esc, 't', 't', body);
    /* \uXXXX of a non-surrogate (k3's JSON reader, like a strict one, refuses lone surrogates) */
    int32_t u = lit(c, esc, "u"), h1 = gb_state(c->b), h2 = gb_state(c->b), h3 = gb_state(c->b),
            d = gb_state(c->b);
    gb_sym(c->b, u, '0', '9', h1), gb_sym(c->b, u, 'a', 'c', h1), gb_sym(c->b, u, 'A', 'C', h1);
    gb_sym(c->b, u, 'e', 'f', h1), gb_sym(c->b, u, 'E', 'F', h1);
    gb_sym(c->b, u, 'd', 'd', d), gb_sym(c->b, u, 'D', 'D', d), gb_sym(c->b, d, '0', '7', h2);
    int32_t hx[3] = {h1, h2, h3};
    for (int i = 0; i < 3; i++) {
        int32_t to = i < 2 ? hx[i + 1] : body;
        gb_sym(c->b, hx[i], '0', '9', to), gb_sym(c->b, hx[i], 'a', 'f', to),
            gb_sym(c->b, hx[i], 'A', 'F', to);
    }
    gb_eps(c->b, lit(c, body, "\""), e);
    return r;
}

/* After the digit that reached `d`: up to n more digits, then `out`. */
static void more_digits(g_cx *c, int32_t d, int n, int32_t out) {
    gb_eps(c->b, d, out);
    for (int i = 0; i < n; i++) {
        int32_t nx = gb_state(c->b);
        gb_sym(c->b, d, '0', '9', nx);
        gb_eps(c->b, nx, out);
        d = nx;
    }
}

/* -?(0|[1-9][0-9]{0,15}) then, for numbers, (\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})? */
static int32_t number_rule(g_cx *c, bool integer) {
    int32_t *slot = integer ? &c->r_integer : &c->r_number;
    if (*slot >= 0) return *slot;
    int32_t r = gb_rule(c->b), s = c->b->rule_start[r], e = c->b->rule_end[r];
    *slot = r;
    int32_t sg = gb_state(c->b), ip = gb_state(c->b);
    gb_eps(c->b, s, sg), gb_sym(c->b, s, '-', '-', sg);
    gb_sym(c->b, sg, '0', '0', ip);
    int32_t d = gb_state(c->b);
    gb_sym(c->b, sg, '1', '9', d);
    more_digits(c, d, 15, ip);
    gb_eps(c->b, ip, e);
    if (integer) return r;
    int32_t fr = lit(c, ip, "."), f = gb_state(c->b);
    gb_sym(c->b, fr, '0', '9', f);
    int32_t fe = gb_state(c->b);
    more_digits(c, f, 15, fe);
    gb_eps(c->b, fe, e);
    int32_t ex = gb_state(c->b), es = gb_state(c->b), e1 = gb_state(c->b), e2 = gb_state(c->b);
    gb_sym(c->b, ip, 'e', 'e', ex), gb_sym(c->b, ip, 'E', 'E', ex);
    gb_sym(c->b, fe, 'e', 'e', ex), gb_sym(c->b, fe, 'E', 'E', ex);
    gb_eps(c->b, ex, es), gb_sym(c->b, ex, '+', '+', es), gb_sym(c->b, ex, '-', '-', es);
    gb_sym(c->b, es, '0', '9', e1), gb_sym(c->b, e1, '0', '9', e2);
    gb_eps(c->b, e1, e), gb_eps(c->b, e2, e);
    return r;
}

static int32_t any_rule(g_cx *c);

/* '{' [ kv (',' ws kv)* ] '}' with kv = string ':' ws value; value: a rule. */
static int32_t free_object(g_cx *c, int32_t from, int32_t value_rule) {
    int32_t o = lit(c, from, "{"), end = gb_state(c->b);
    gb_eps(c->b, lit(c, o, "}"), end);
    int32_t kv = call(c, o, json_string_rule(c));
    kv = call(c, ws_opt(c, lit(c, kv, ":")), value_rule);
    gb_eps(c->b, lit(c, kv, "}"), end);
    int32_t more = call(c, ws_opt(c, lit(c, kv, ",")), json_string_rule(c));
    more = call(c, ws_opt(c, lit(c, more, ":")), value_rule);
    gb_eps(c->b, more, kv);
    return end;
}

static int32_t free_array(g_cx *c, int32_t from, int32_t item_rule, int mn, int mx) {
    int32_t a = lit(c, from, "["), end = gb_state(c->b);
    if (mn == 0) gb_eps(c->b, lit(c, a, "]"), end);
    if (mx == 0) return end;
    int32_t cur = call(c, a, item_rule);
    for (int k = 1;; k++) { /* cur: k items written */
        if (k >= mn) gb_eps(c->b, lit(c, cur, "]"), end);
        if (mx >= 0 && k >= mx) break;
        int32_t nx = call(c, ws_opt(c, lit(c, cur, ",")), item_rule);
        if (mx < 0 && k >= mn) {
            gb_eps(c->b, nx, cur);
            break;
        }
        cur = nx;
        if (failed(c)) break;
    }
    return end;
}

static int32_t any_rule(g_cx *c) {
    if (c->r_any >= 0) return c->r_any;
    int32_t r = gb_rule(c->b), s = c->b->rule_start[r], e = c->b->rule_end[r];
    c->r_any = r;
    gb_eps(c->b, call(c, s, json_string_rule(c)), e);
    gb_eps(c->b, call(c, s, number_rule(c, false)), e);
    gb_eps(c->b, lit(c, s, "true"), e);
    gb_eps(c->b, lit(c, s, "false"), e);
    gb_eps(c->b, lit(c, s, "null"), e);
    gb_eps(c->b, free_object(c, s, r), e);
    gb_eps(c->b, free_array(c, s, r, 0, -1), e);
    return r;
}

/* Keywords that only annotate (ignored) and keywords this compiler enforces. */
static bool kw_annotation(const char *k) {
    static const char *const A[] = {"title", "description", "default",    "examples", "$schema",
                                    "$id",   "$comment",    "deprecated", "readOnly", "writeOnly",
                                    "$defs", "definitions", "strict",     NULL};
    for (int i = 0; A[i]; i++)
        if (!strcmp(k, A[i])) return true;
    return false;
}
static bool kw_ok(const char *k) {
    static const char *const K[] = {"type",
                                    "properties",
                                    "required",
                                    "additionalProperties",
                                    "enum",
                                    "const",
                                    "anyOf",
                                    "items",
                                    "minItems",
                                    "maxItems",
                                    "pattern",
                                    "format",
                                    "$ref",
                                    "minimum",
                                    "maximum",
                                    "exclusiveMinimum",
                                    "exclusiveMaximum",
                                    "multipleOf",
                                    "minLength",
                                    "maxLength",
                                    "prefixItems",
                                    "uniqueItems",
                                    NULL};
    for (int i = 0; K[i]; i++)
        if (!strcmp(k, K[i])) return true;
    return kw_annotation(k);
}

static const char *fmt_regex(const char *f) {
#define G_DATE                                                                                     \
    "[1-9][0-9]{3}-(0[13578]-(0[1-9]|[12][0-9]|3[01])|1[02]-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-" \
    "(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
#define G_TIME                                                                                     \
    "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9]" \
    ")"
#define G_OCT "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
    static const char *const F[][2] = {
        {"date", G_DATE},
        {"time", G_TIME},
        {"date-time", G_DATE "T" G_TIME},
        {"uuid", "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"},
        {"ipv4", G_OCT "\\." G_OCT "\\." G_OCT "\\." G_OCT},
        {"email", "[a-zA-Z0-9._+-]{1,32}@[a-zA-Z0-9-]{1,32}(\\.[a-zA-Z0-9-]{1,16}){1,3}"},
        {"uri", "https?://[a-z0-9-]{1,32}(\\.[a-z0-9-]{1,16}){0,3}(/[a-zA-Z0-9._~-]{1,32}){0,4}"},
    };
    for (size_t i = 0; i < sizeof F / sizeof F[0]; i++)
        if (!strcmp(f, F[i][0])) return F[i][1];
    return NULL;
}

/* Resolve "#", "#/$defs/X", "#/definitions/X" (JSON pointer into the root schema). */
static const k3_chat_json *resolve_ref(g_cx *c, const k3_chat_json *ref, const char *path) {
    if (!ref || ref->kind != K3_JSON_STRING || ref->s[0] != '#') {
        fail(c, path, "unsupported $ref '%s' (only local '#/...' references)",
             ref && ref->kind == K3_JSON_STRING ? ref->s : "?");
        return NULL;
    }
    const k3_chat_json *n = g_pointer(c->tab, c->root, ref->s, &c->b->err);
    if (!n) fail(c, path, "$ref '%s' does not resolve", ref->s);
    return n;
}

/* A rule for a schema node (built once per node: recursion through $ref ends here). */
static int32_t value(g_cx *c, int32_t from, const k3_chat_json *sch, const char *path);
static int32_t tuple(g_cx *c, int32_t from, const k3_chat_json *sch, const k3_chat_json *pre,
                     int mn, int mx, const char *path);
static int32_t typed(g_cx *c, int32_t from, const k3_chat_json *sch, int t, const char *path);
static int32_t node_rule(g_cx *c, const k3_chat_json *sch, int kind, const char *path) {
    int32_t r = g_node_rule_get(c->tab, sch, kind, -1, &c->b->err);
    if (r >= 0 || failed(c)) return r >= 0 ? r : 0;
    if (c->n_refs == c->cap_refs) {
        int nc = c->cap_refs ? 2 * c->cap_refs : 16;
        g_ref *q = realloc(c->refs, (size_t)nc * sizeof *q);
        if (!q) {
            c->b->err = K3_ERR(K3_ERR_NOMEM, "grammar");
            return 0;
        }
        c->refs = q, c->cap_refs = nc;
    }
    r = gb_rule(c->b);
    char *pc = strdup(path);
    if (!pc && !failed(c)) c->b->err = K3_ERR(K3_ERR_NOMEM, "grammar");
    g_node_rule_get(c->tab, sch, kind, r, &c->b->err);
    if (failed(c)) {
        free(pc);
        return 0;
    }
    c->refs[c->n_refs++] = (g_ref){sch, c->root, kind, r, pc};
    return r;
}

/* Build the bodies of the rules node_rule() handed out, until none is left. */
static void build_rules(g_cx *c) {
    while (c->n_refs) {
        g_ref w = c->refs[--c->n_refs];
        const k3_chat_json *root = c->root;
        c->root = w.root;
        int32_t s0 = c->b->rule_start[w.rule];
        if (!failed(c))
            gb_eps(c->b,
                   w.kind < 0 ? value(c, s0, w.node, w.path) : typed(c, s0, w.node, w.kind, w.path),
                   c->b->rule_end[w.rule]);
        c->root = root;
        free(w.path);
    }
}

static int json_type_index(const char *t) {
    static const char *const T[] = {"string", "number", "integer", "boolean",
                                    "null",   "object", "array",   NULL};
    for (int i = 0; T[i]; i++)
        if (!strcmp(t, T[i])) return i;
    return -1;
}

/* Does JSON value v have JSON Schema type t (index of json_type_index)? */
static bool value_has_type(const k3_chat_json *v, int t) {
    switch (t) {
    case 0:
        return v->kind == K3_JSON_STRING;
    case 1:
        return v->kind == K3_JSON_INT || v->kind == K3_JSON_FLOAT;
    case 2:
        return v->kind == K3_JSON_INT ||
               (v->kind == K3_JSON_FLOAT && v->f == (double)(long long)v->f);
    case 3:
        return v->kind == K3_JSON_BOOL;
    case 4:
        return v->kind == K3_JSON_NULL;
    case 5:
        return v->kind == K3_JSON_OBJECT;
    case 6:
        return v->kind == K3_JSON_ARRAY;
    }
    return false;
}

/* The types a schema's "type" allows, as bits of json_type_index; all when absent. */
static unsigned schema_types(g_cx *c, const k3_chat_json *sch, const char *path) {
    const k3_chat_json *t = k3_chat_json_get(sch, "type");
    if (!t) return 0x7f;
    unsigned m = 0;
    const k3_chat_json *one[1] = {t};
    const k3_chat_json *const *list =
        t->kind == K3_JSON_ARRAY ? (const k3_chat_json *const *)t->items : one;
    size_t n = t->kind == K3_JSON_ARRAY ? t->n_items : 1;
    for (size_t i = 0; i < n; i++) {
        int k = list[i]->kind == K3_JSON_STRING ? json_type_index(list[i]->s) : -1;
        if (k < 0) {
            fail(c, path, "unsupported type %s",
                 list[i]->kind == K3_JSON_STRING ? list[i]->s : "(not a string)");
            return 0;
        }
        m |= 1u << k;
    }
    if (!m) fail(c, path, "%s", "an empty type list");
    return m;
}

static int json_int(g_cx *c, const k3_chat_json *sch, const char *key, int dflt, const char *path) {
    const k3_chat_json *v = k3_chat_json_get(sch, key);
    if (!v) return dflt;
    if (v->kind == K3_JSON_FLOAT && v->f >= 0 && v->f <= 1000 && v->f == (double)(int)v->f)
        return (int)v->f; /* 2.0: an integer written as a float (JSON Schema takes it) */
    if (v->kind != K3_JSON_INT || v->s[0] == '-' || strlen(v->s) > 4) {
        fail(c, path, "%s must be an integer in [0, 1000] here", key);
        return dflt;
    }
    int x = atoi(v->s);
    if (x > 1000) fail(c, path, "%s must be an integer in [0, 1000] here", key);
    return x;
}

/* Literal JSON of each value (enum / const), compact. */
static int32_t literals(g_cx *c, int32_t from, const k3_chat_json *const *vals, size_t n,
                        unsigned types, const char *path) {
    int32_t end = gb_state(c->b);
    size_t used = 0;
    for (size_t i = 0; i < n && !failed(c); i++) {
        bool ok = false;
        for (int t = 0; t < 7; t++) ok |= (types >> t & 1) && value_has_type(vals[i], t);
        if (!ok) continue;
        k3_chat_buf b = {0};
        if (k3_chat_json_dump(vals[i], K3_JSON_COMPACT, &b) != K3_OK) {
            c->b->err = K3_ERR(K3_ERR_NOMEM, "grammar");
            break;
        }
        gb_eps(c->b, g_trie_bytes(c->b, c->tab, from, b.p, b.n), end);
        k3_chat_buf_free(&b);
        used++;
    }
    if (!used) fail(c, path, "%s", "enum/const has no value the schema's type allows");
    return end;
}

/* Which properties are required (np flags, to free; NULL after a refusal): one indexed lookup per
 * name, so `required` x `properties` is linear. Every required name must be a declared property. */
static uint8_t *required_flags(g_cx *c, const k3_chat_json *props, const k3_chat_json *req,
                               const char *path) {
    size_t np = props && props->kind == K3_JSON_OBJECT ? props->n_items : 0;
    uint8_t *f = calloc(np + 1, 1);
    if (!f) {
        if (!failed(c)) c->b->err = K3_ERR(K3_ERR_NOMEM, "grammar");
        return NULL;
    }
    for (size_t i = 0; req && req->kind == K3_JSON_ARRAY && i < req->n_items && !failed(c); i++) {
        const k3_chat_json *r = req->items[i];
        if (r->kind != K3_JSON_STRING) {
            fail(c, path, "%s", "required must list strings");
            break;
        }
        int64_t at = g_member(c->tab, props, r->s, r->n, &c->b->err);
        if (at < 0)
            fail(c, path, "required property '%s' is not in properties (not supported)", r->s);
        else
            f[at] = 1;
    }
    if (failed(c)) free(f), f = NULL;
    return f;
}

static int32_t object(g_cx *c, int32_t from, const k3_chat_json *sch, const char *path) {
    const k3_chat_json *props = k3_chat_json_get(sch, "properties"),
                       *req = k3_chat_json_get(sch, "required"),
                       *addl = k3_chat_json_get(sch, "additionalProperties");
    char sub[512];
    if (props && props->kind != K3_JSON_OBJECT) fail(c, path, "%s", "properties must be an object");
    if (req && req->kind != K3_JSON_ARRAY) fail(c, path, "%s", "required must be an array");
    if (failed(c)) return from;
    size_t np = props ? props->n_items : 0;
    uint8_t *is_req = required_flags(c, props, req, path);
    if (!is_req) return from;
    if (np == 0 && !(addl && addl->kind == K3_JSON_BOOL && !addl->b)) {
        free(is_req);
        int32_t vr;
        if (addl && addl->kind == K3_JSON_OBJECT) {
            subpath(sub, sizeof sub, path, "additionalProperties");
            vr = node_rule(c, addl, -1, sub);
        } else {
            vr = any_rule(c);
        }
        return free_object(c, from, vr);
    }
    /* Declared properties in order. A_i: nothing written yet before property i; B_i: something
     * was. Optional properties may be skipped. Each value is built once (V_i). */
    int32_t A = lit(c, from, "{"), B = gb_state(c->b);
    for (size_t i = 0; i < np && !failed(c); i++) {
        const k3_chat_json *key = props->keys[i];
        bool required = is_req[i];
        k3_chat_buf kj = {0};
        if (k3_chat_json_dump_str(key->s, key->n, &kj) != K3_OK ||
            k3_chat_buf_puts(&kj, ":") != K3_OK) {
            c->b->err = K3_ERR(K3_ERR_NOMEM, "grammar");
            break;
        }
        int32_t V = gb_state(c->b);
        gb_eps(c->b, gb_lit(c->b, A, kj.p, kj.n), V);
        gb_eps(c->b, gb_lit(c->b, ws_opt(c, lit(c, B, ",")), kj.p, kj.n), V);
        k3_chat_buf_free(&kj);
        snprintf(sub, sizeof sub, "%.300s.properties.%.150s", path, key->s);
        int32_t after = value(c, ws_opt(c, V), props->items[i], sub);
        int32_t A2 = gb_state(c->b), B2 = gb_state(c->b);
        gb_eps(c->b, after, B2);
        if (!required) gb_eps(c->b, A, A2), gb_eps(c->b, B, B2);
        A = A2, B = B2;
    }
    free(is_req);
    int32_t end = gb_state(c->b);
    gb_eps(c->b, lit(c, B, "}"), end);
    gb_eps(c->b, lit(c, A, "}"), end); /* only reachable when every property is optional */
    return end;
}

/* prefixItems: the prefix items in order (the array may end after any of them, or before a `false`
 * one), then what `items` allows (false: nothing more; absent: any values), within minItems /
 * maxItems. */
static int32_t tuple(g_cx *c, int32_t from, const k3_chat_json *sch, const k3_chat_json *pre,
                     int mn, int mx, const char *path) {
    char sub[512];
    const k3_chat_json *items = k3_chat_json_get(sch, "items");
    if (pre->kind != K3_JSON_ARRAY || pre->n_items > 1000) {
        fail(c, path, "%s", "prefixItems must be an array of at most 1000 schemas");
        return from;
    }
    const int k = (int)pre->n_items;
    if (mx >= 0 && mx < k) {
        fail(c, path, "%s", "maxItems below the number of prefixItems (not supported)");
        return from;
    }
    int32_t cur = lit(c, from, "["), end = gb_state(c->b);
    for (int i = 0; i < k && !failed(c); i++) { /* cur: i items written */
        if (i >= mn) gb_eps(c->b, lit(c, cur, "]"), end);
        const k3_chat_json *it = pre->items[i];
        if (it->kind == K3_JSON_BOOL && !it->b) { /* no item can stand here: the array ends */
            if (i < mn) fail(c, path, "%s", "minItems above what prefixItems allows");
            return end;
        }
        if (i) cur = ws_opt(c, lit(c, cur, ","));
        snprintf(sub, sizeof sub, "%.400s.prefixItems[%d]", path, i);
        cur = value(c, cur, it, sub);
    }
    const bool no_more = items && items->kind == K3_JSON_BOOL && !items->b;
    if (k >= mn) gb_eps(c->b, lit(c, cur, "]"), end);
    if (no_more || (mx >= 0 && mx == k)) {
        if (k < mn) fail(c, path, "%s", "minItems above what prefixItems and items allow");
        return end;
    }
    subpath(sub, sizeof sub, path, "items");
    const int32_t ir = items ? node_rule(c, items, -1, sub) : any_rule(c);
    for (int n = k; !failed(c);) { /* cur: n items written */
        if (mx >= 0 && n >= mx) break;
        int32_t nx = call(c, n == 0 ? cur : ws_opt(c, lit(c, cur, ",")), ir);
        n++;
        if (n >= mn) gb_eps(c->b, lit(c, nx, "]"), end);
        if (mx < 0 && n >= mn) { /* any number more */
            gb_eps(c->b, call(c, ws_opt(c, lit(c, nx, ",")), ir), nx);
            break;
        }
        cur = nx;
    }
    return end;
}

static int32_t typed(g_cx *c, int32_t from, const k3_chat_json *sch, int t, const char *path) {
    char sub[512];
    switch (t) {
    case 0: {
        const k3_chat_json *pat = k3_chat_json_get(sch, "pattern"),
                           *fmt = k3_chat_json_get(sch, "format");
        if (pat && fmt) {
            fail(c, path, "%s", "pattern together with format (not supported)");
            return from;
        }
        const char *rxs = NULL;
        if (pat) {
            if (pat->kind != K3_JSON_STRING || strlen(pat->s) != pat->n) {
                fail(c, path, "%s", "pattern must be a string");
                return from;
            }
            rxs = pat->s;
        } else if (fmt) {
            rxs = fmt->kind == K3_JSON_STRING ? fmt_regex(fmt->s) : NULL;
            if (!rxs) {
                fail(c, path, "unsupported format '%s'",
                     fmt->kind == K3_JSON_STRING ? fmt->s : "?");
                return from;
            }
        }
        const bool len = k3_chat_json_get(sch, "minLength") || k3_chat_json_get(sch, "maxLength");
        if (len && rxs) {
            fail(c, path, "%s",
                 "minLength/maxLength together with pattern or format (not supported)");
            return from;
        }
        if (len) {
            int mn = json_int(c, sch, "minLength", 0, path),
                mx = json_int(c, sch, "maxLength", -1, path);
            if (mx >= 0 && mx < mn) fail(c, path, "%s", "maxLength below minLength");
            return failed(c) ? from : gb_bounded_string(c->b, from, mn, mx);
        }
        if (!rxs) return call(c, from, json_string_rule(c));
        subpath(sub, sizeof sub, path, pat ? "pattern" : "format");
        return lit(c, regex(c, lit(c, from, "\""), rxs, true, sub), "\"");
    }
    case 1:
    case 2: {
        static const char *const NK[5] = {"minimum", "exclusiveMinimum", "maximum",
                                          "exclusiveMaximum", "multipleOf"};
        const k3_chat_json *kw[5];
        bool bounded = false;
        for (int i = 0; i < 5; i++) bounded |= (kw[i] = k3_chat_json_get(sch, NK[i])) != NULL;
        if (bounded) return gb_bounded_number(c->b, from, t == 2, kw, path);
        return call(c, from, number_rule(c, t == 2));
    }
    case 3: {
        int32_t end = gb_state(c->b);
        gb_eps(c->b, lit(c, from, "true"), end);
        gb_eps(c->b, lit(c, from, "false"), end);
        return end;
    }
    case 4:
        return lit(c, from, "null");
    case 5:
        return object(c, from, sch, path);
    case 6: {
        const k3_chat_json *items = k3_chat_json_get(sch, "items");
        int mn = json_int(c, sch, "minItems", 0, path), mx = json_int(c, sch, "maxItems", -1, path);
        if (mx >= 0 && mx < mn) fail(c, path, "%s", "maxItems below minItems");
        if (items && items->kind == K3_JSON_ARRAY) {
            fail(c, path, "%s", "items as an array (tuple validation) is not supported");
            return from;
        }
        if (k3_chat_json_truthy(k3_chat_json_get(sch, "uniqueItems"))) {
            fail(c, path, "%s",
                 "uniqueItems true is not supported (the grammar cannot compare "
                 "items); leave it out or use uniqueItems false");
            return from;
        }
        const k3_chat_json *pre = k3_chat_json_get(sch, "prefixItems");
        if (pre) return tuple(c, from, sch, pre, mn, mx, path);
        subpath(sub, sizeof sub, path, "items");
        int32_t ir = items ? node_rule(c, items, -1, sub) : any_rule(c);
        return free_array(c, from, ir, mn, mx);
    }
    }
    return from;
}

/* Check the keywords of a schema object; false after a refusal. */
static bool check_keywords(g_cx *c, const k3_chat_json *sch, const char *path) {
    for (size_t i = 0; i < sch->n_items; i++)
        if (!kw_ok(sch->keys[i]->s)) {
            fail(c, path, "unsupported JSON Schema keyword '%s'", sch->keys[i]->s);
            return false;
        }
    return true;
}

/* Keywords other than annotations, beside `except`. */
static const char *other_keyword(const k3_chat_json *sch, const char *except) {
    for (size_t i = 0; i < sch->n_items; i++)
        if (!kw_annotation(sch->keys[i]->s) && strcmp(sch->keys[i]->s, except))
            return sch->keys[i]->s;
    return NULL;
}

/* A schema object whose keywords are all supported (else refused, false). */
static bool schema_ok(g_cx *c, const k3_chat_json *sch, const char *path) {
    if (sch->kind != K3_JSON_OBJECT) {
        fail(c, path, "%s", "a schema must be an object or a boolean");
        return false;
    }
    return check_keywords(c, sch, path);
}

/* The node sch's $ref names; NULL (refused) when it does not resolve or other constraints
 * stand beside it. */
static const k3_chat_json *ref_target(g_cx *c, const k3_chat_json *sch, const k3_chat_json *ref,
                                      const char *path) {
    const char *o = other_keyword(sch, "$ref");
    if (o) fail(c, path, "'%s' beside $ref (not supported)", o);
    const k3_chat_json *t = resolve_ref(c, ref, path);
    return failed(c) ? NULL : t;
}

/* Without "type": the type the keywords present imply (object, array or string keywords), T_ANY
 * when there are none; 0 (refused) when they mix types. */
#define T_ANY   (0x7fu & ~(1u << 2)) /* every type; number covers integer */
#define T_TYPED (1u << 7)            /* with T_ANY: build each type from the schema's keywords */
static unsigned inferred_types(g_cx *c, const k3_chat_json *sch, const char *path) {
    bool obj = k3_chat_json_get(sch, "properties") || k3_chat_json_get(sch, "required") ||
               k3_chat_json_get(sch, "additionalProperties");
    bool arr = k3_chat_json_get(sch, "items") || k3_chat_json_get(sch, "minItems") ||
               k3_chat_json_get(sch, "maxItems");
    bool str = k3_chat_json_get(sch, "pattern") || k3_chat_json_get(sch, "format");
    if (obj + arr + str > 1) {
        fail(c, path, "%s", "keywords of several types without \"type\" (not supported)");
        return 0;
    }
    if (obj || arr || str) return obj ? 1u << 5 : arr ? 1u << 6 : 1u;
    /* the keywords of issue 47 constrain their own type and leave the others free, as JSON Schema
       reads them: every type, each built with the keywords that apply to it (T_TYPED: not the
       shared any-value rule) */
    static const char *const K[] = {"minimum",          "maximum",     "exclusiveMinimum",
                                    "exclusiveMaximum", "multipleOf",  "minLength",
                                    "maxLength",        "prefixItems", "uniqueItems"};
    for (size_t i = 0; i < sizeof K / sizeof K[0]; i++)
        if (k3_chat_json_get(sch, K[i])) return T_ANY | T_TYPED;
    return T_ANY;
}

static int32_t value(g_cx *c, int32_t from, const k3_chat_json *sch, const char *path) {
    char sub[512];
    if (failed(c)) return from;
    if (sch->kind == K3_JSON_BOOL) {
        if (!sch->b) fail(c, path, "%s", "the schema false (nothing validates)");
        return call(c, from, any_rule(c));
    }
    if (!schema_ok(c, sch, path)) return from;
    snprintf(c->b->where, sizeof c->b->where, "%s", path);
    const k3_chat_json *ref = k3_chat_json_get(sch, "$ref"), *any = k3_chat_json_get(sch, "anyOf");
    if (ref) {
        const k3_chat_json *t = ref_target(c, sch, ref, path);
        for (int hops = 0; t && t->kind == K3_JSON_OBJECT && !failed(c); hops++) {
            const k3_chat_json *r2 = k3_chat_json_get(t, "$ref"); /* a $ref to a $ref: follow */
            if (!r2 || other_keyword(t, "$ref")) break;
            if (hops >= K3_GRAMMAR_MAX_NEST) {
                char n[16];
                snprintf(n, sizeof n, "%d", K3_GRAMMAR_MAX_NEST);
                fail(c, path,
                     "a chain of more than %s $ref (or a cycle of them): the nesting budget", n);
                return from;
            }
            ref = r2;
            t = ref_target(c, t, ref, path);
        }
        return t ? call(c, from, node_rule(c, t, -1, ref->s)) : from;
    }
    if (any) {
        const char *o = other_keyword(sch, "anyOf");
        if (o) fail(c, path, "'%s' beside anyOf (not supported)", o);
        if (any->kind != K3_JSON_ARRAY || !any->n_items)
            fail(c, path, "%s", "anyOf must be a non-empty array");
        int32_t end = gb_state(c->b);
        for (size_t i = 0; i < any->n_items && !failed(c); i++) {
            snprintf(sub, sizeof sub, "%.400s.anyOf[%zu]", path, i);
            gb_eps(c->b, value(c, from, any->items[i], sub), end);
        }
        return end;
    }
    unsigned types = schema_types(c, sch, path);
    const k3_chat_json *en = k3_chat_json_get(sch, "enum"), *cst = k3_chat_json_get(sch, "const");
    if (en || cst) {
        if (en && (en->kind != K3_JSON_ARRAY || !en->n_items))
            fail(c, path, "%s", "enum must be a non-empty array");
        if (failed(c)) return from;
        return en ? literals(c, from, (const k3_chat_json *const *)en->items, en->n_items, types,
                             path)
                  : literals(c, from, &cst, 1, types, path);
    }
    if (!k3_chat_json_get(sch, "type")) {
        types = inferred_types(c, sch, path);
        if (!types) return from;
        if (types == T_ANY) return call(c, from, any_rule(c));
    }
    int32_t end = gb_state(c->b);
    for (int t = 0; t < 7 && !failed(c); t++)
        if (types >> t & 1) /* objects and arrays: a rule of their own, shared by every use */
            gb_eps(c->b,
                   t >= 5 ? call(c, from, node_rule(c, sch, t, path))
                          : typed(c, from, sch, t, path),
                   end);
    return end;
}

/* ---- tool calls in K3's XTML syntax (spec/K3-CHAT.md §2) ------------------------------------ */
/* Attribute text: & and " escaped as the renderer does. */
static int32_t attr_lit(g_cx *c, int32_t from, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        from = s[i] == '&'   ? lit(c, from, "&amp;")
               : s[i] == '"' ? lit(c, from, "&quot;")
                             : gb_lit(c->b, from, s + i, 1);
    return from;
}

/* `type="T"<|sep|>` then the value as the parser reads it (§3.3), for one schema; -> after it. */
static int32_t xtml_value(g_cx *c, int32_t from, const k3_chat_json *sch, const char *path,
                          int depth);

static int32_t xtml_typed(g_cx *c, int32_t from, const k3_chat_json *sch, int t, const char *path) {
    static const char *const ATTR[7] = {"string", "number", "number", "boolean",
                                        "null",   "object", "array"};
    char head[32];
    snprintf(head, sizeof head, "%s\"", ATTR[t]);
    int32_t v = mark(c, lit(c, from, head), K3_GSYM_SEP);
    if (t != 0) return t >= 5 ? call(c, v, node_rule(c, sch, t, path)) : typed(c, v, sch, t, path);
    /* a string is written raw (not quoted, not escaped), ended by the <|close|> marker */
    const k3_chat_json *pat = k3_chat_json_get(sch, "pattern"),
                       *fmt = k3_chat_json_get(sch, "format");
    if (pat || fmt) {
        const char *rxs = pat && pat->kind == K3_JSON_STRING   ? pat->s
                          : fmt && fmt->kind == K3_JSON_STRING ? fmt_regex(fmt->s)
                                                               : NULL;
        if (!rxs || (pat && fmt)) {
            fail(c, path, "%s", "unsupported pattern/format");
            return v;
        }
        return regex(c, v, rxs, false, path);
    }
    bool all[128];
    for (int b = 0; b < 128; b++) all[b] = true;
    int32_t loop = gb_state(c->b);
    gb_eps(c->b, v, loop);
    gb_eps(c->b, gb_utf8_char(c->b, loop, all), loop);
    return loop;
}

static int32_t xtml_value(g_cx *c, int32_t from, const k3_chat_json *sch, const char *path,
                          int depth) {
    char sub[512];
    if (failed(c)) return from;
    if (depth > 32) {
        fail(c, path, "%s", "$ref/anyOf nesting deeper than 32 at a tool argument");
        return from;
    }
    int32_t end = gb_state(c->b);
    if (sch->kind == K3_JSON_BOOL || (sch->kind == K3_JSON_OBJECT && !sch->n_items)) {
        if (sch->kind == K3_JSON_BOOL && !sch->b) fail(c, path, "%s", "the schema false");
        for (int t = 0; t < 7; t++)
            if (t != 2)
                gb_eps(c->b, xtml_typed(c, from, &(k3_chat_json){.kind = K3_JSON_OBJECT}, t, path),
                       end);
        return end;
    }
    if (!schema_ok(c, sch, path)) return from;
    const k3_chat_json *ref = k3_chat_json_get(sch, "$ref"), *any = k3_chat_json_get(sch, "anyOf");
    if (ref) {
        const k3_chat_json *t = ref_target(c, sch, ref, path);
        return t ? xtml_value(c, from, t, ref->s, depth + 1) : from;
    }
    if (any) {
        if (any->kind != K3_JSON_ARRAY || !any->n_items || other_keyword(sch, "anyOf")) {
            fail(c, path, "%s", "anyOf must be a non-empty array, alone");
            return from;
        }
        for (size_t i = 0; i < any->n_items; i++) {
            snprintf(sub, sizeof sub, "%.400s.anyOf[%zu]", path, i);
            gb_eps(c->b, xtml_value(c, from, any->items[i], sub, depth + 1), end);
        }
        return end;
    }
    unsigned types = schema_types(c, sch, path);
    const k3_chat_json *en = k3_chat_json_get(sch, "enum"), *cst = k3_chat_json_get(sch, "const");
    if (en || cst) { /* strings raw, the rest as JSON, each under its own type attribute */
        const k3_chat_json *const *vals = en ? (const k3_chat_json *const *)en->items : &cst;
        size_t n = en ? (en->kind == K3_JSON_ARRAY ? en->n_items : 0) : 1;
        if (!n) fail(c, path, "%s", "enum must be a non-empty array");
        size_t used = 0;
        for (size_t i = 0; i < n && !failed(c); i++) {
            const k3_chat_json *v = vals[i];
            bool ok = false;
            for (int t = 0; t < 7; t++) ok |= (types >> t & 1) && value_has_type(v, t);
            if (!ok) continue;
            used++;
            const char *a = v->kind == K3_JSON_STRING   ? "string"
                            : v->kind == K3_JSON_BOOL   ? "boolean"
                            : v->kind == K3_JSON_NULL   ? "null"
                            : v->kind == K3_JSON_OBJECT ? "object"
                            : v->kind == K3_JSON_ARRAY  ? "array"
                                                        : "number";
            char head[32];
            snprintf(head, sizeof head, "%s\"", a);
            int32_t s = g_trie_bytes(c->b, c->tab, from, head, strlen(head));
            s = g_trie_step(c->b, c->tab, s, K3_GSYM_SEP);
            if (v->kind == K3_JSON_STRING) {
                gb_eps(c->b, g_trie_bytes(c->b, c->tab, s, v->s, v->n), end);
            } else {
                k3_chat_buf b = {0};
                if (k3_chat_json_dump(v, K3_JSON_COMPACT, &b) == K3_OK)
                    gb_eps(c->b, g_trie_bytes(c->b, c->tab, s, b.p, b.n), end);
                k3_chat_buf_free(&b);
            }
        }
        if (!used && !failed(c)) fail(c, path, "%s", "enum/const has no value the type allows");
        return end;
    }
    if (!k3_chat_json_get(sch, "type") && !(types = inferred_types(c, sch, path))) return from;
    if ((types & 6u) == 6u) types &= ~(1u << 2); /* number covers integer */
    for (int t = 0; t < 7 && !failed(c); t++)
        if (types >> t & 1) gb_eps(c->b, xtml_typed(c, from, sch, t, path), end);
    return end;
}

/* <|open|>argument key="K" type="...<|sep|>VALUE<|close|>argument<|sep|> */
static int32_t xtml_arg(g_cx *c, int32_t from, const char *key, size_t n_key,
                        const k3_chat_json *sch, const char *path) {
    int32_t s = lit(c, mark(c, from, K3_GSYM_OPEN), "argument key=\"");
    if (key) {
        s = attr_lit(c, s, key, n_key);
    } else { /* any key: attribute characters other than " and & (which would need escapes) */
        bool ok[128];
        for (int b = 0; b < 128; b++) ok[b] = b >= 0x20 && b != '"' && b != '&';
        int32_t loop = gb_state(c->b);
        gb_eps(c->b, gb_utf8_char(c->b, s, ok), loop);
        gb_eps(c->b, gb_utf8_char(c->b, loop, ok), loop);
        s = loop;
    }
    s = xtml_value(c, lit(c, s, "\" type=\""), sch, path, 0);
    return mark(c, lit(c, mark(c, s, K3_GSYM_CLOSE), "argument"), K3_GSYM_SEP);
}

/* The body of a call: an argument element per property (declared order, optional ones may be
 * left out), or any arguments for a free-form object. */
static int32_t xtml_args(g_cx *c, int32_t from, const k3_chat_json *params, const char *path,
                         int depth) {
    char sub[512];
    if (!params || params->kind == K3_JSON_NULL) return from; /* no parameters: no arguments */
    if (depth > 32) {
        fail(c, path, "%s", "a chain of more than 32 $ref (or a cycle) at a function's parameters");
        return from;
    }
    if (params->kind != K3_JSON_OBJECT) {
        fail(c, path, "%s", "parameters must be an object");
        return from;
    }
    if (!check_keywords(c, params, path)) return from;
    const k3_chat_json *ref = k3_chat_json_get(params, "$ref");
    if (ref) {
        const k3_chat_json *t = resolve_ref(c, ref, path);
        return t && t != params ? xtml_args(c, from, t, ref->s, depth + 1) : from;
    }
    const k3_chat_json *ty = k3_chat_json_get(params, "type");
    if (ty && !k3_chat_json_is_str(ty, "object"))
        fail(c, path, "%s", "parameters must have type object");
    static const char *const NOT_HERE[] = {"anyOf", "enum", "const", "items", NULL};
    for (int i = 0; NOT_HERE[i]; i++)
        if (k3_chat_json_get(params, NOT_HERE[i]))
            fail(c, path, "'%s' on a function's parameters (not supported)", NOT_HERE[i]);
    const k3_chat_json *props = k3_chat_json_get(params, "properties"),
                       *req = k3_chat_json_get(params, "required"),
                       *addl = k3_chat_json_get(params, "additionalProperties");
    if (failed(c)) return from;
    size_t np = props && props->kind == K3_JSON_OBJECT ? props->n_items : 0;
    uint8_t *is_req = required_flags(c, props, req, path);
    if (!is_req) return from;
    if (np == 0 && !(addl && addl->kind == K3_JSON_BOOL && !addl->b)) {
        free(is_req);
        int32_t loop = gb_state(c->b);
        gb_eps(c->b, from, loop);
        static const k3_chat_json ANY = {.kind = K3_JSON_BOOL, .b = true};
        subpath(sub, sizeof sub, path, "additionalProperties");
        gb_eps(c->b,
               xtml_arg(c, loop, NULL, 0, addl && addl->kind == K3_JSON_OBJECT ? addl : &ANY, sub),
               loop);
        return loop;
    }
    for (size_t i = 0; i < np && !failed(c); i++) {
        const k3_chat_json *key = props->keys[i];
        snprintf(sub, sizeof sub, "%.300s.properties.%.150s", path, key->s);
        int32_t next = xtml_arg(c, from, key->s, key->n, props->items[i], sub);
        if (!is_req[i]) gb_eps(c->b, from, next);
        from = next;
    }
    free(is_req);
    return from;
}

/* <|open|>call tool="NAME" index="N"<|sep|>ARGS<|close|>call<|sep|> for each allowed tool. */
static int32_t tool_call(g_cx *c, int32_t from, const k3_grammar_spec *s) {
    char path[512];
    int32_t end = gb_state(c->b), head = lit(c, mark(c, from, K3_GSYM_OPEN), "call tool=\"");
    int n = 0;
    for (size_t i = 0; s->tools && i < s->tools->n_items && !failed(c); i++) {
        const k3_chat_json *t = s->tools->items[i], *fn = k3_chat_json_get(t, "function");
        const k3_chat_json *name = k3_chat_json_get(fn ? fn : t, "name");
        if (!name || name->kind != K3_JSON_STRING) continue;
        if (s->tool_name && strcmp(s->tool_name, name->s)) continue;
        n++;
        int32_t a = lit(c, attr_lit(c, head, name->s, name->n), "\" index=\"");
        if (s->single_call) {
            a = lit(c, a, "1");
        } else { /* [1-9][0-9]{0,2}: the parser numbers calls by their order */
            int32_t d1 = gb_state(c->b), d2 = gb_state(c->b), d3 = gb_state(c->b);
            gb_sym(c->b, a, '1', '9', d1), gb_sym(c->b, d1, '0', '9', d2),
                gb_sym(c->b, d2, '0', '9', d3);
            gb_eps(c->b, d2, d3), gb_eps(c->b, d1, d3);
            a = d3;
        }
        a = mark(c, lit(c, a, "\""), K3_GSYM_SEP);
        snprintf(path, sizeof path, "tools[%zu].function.parameters", i);
        const k3_chat_json *root = c->root; /* a tool's $ref resolves in its parameters */
        c->root = k3_chat_json_get(fn ? fn : t, "parameters");
        a = xtml_args(c, a, c->root, path, 0);
        c->root = root;
        gb_eps(c->b, mark(c, lit(c, mark(c, a, K3_GSYM_CLOSE), "call"), K3_GSYM_SEP), end);
    }
    if (!n && !failed(c))
        fail(c, "tools", "no function named '%s' among the tools",
             s->tool_name ? s->tool_name : "(any)");
    return end;
}

static int32_t tools_section(g_cx *c, int32_t from, const k3_grammar_spec *s) {
    int32_t a = mark(c, lit(c, mark(c, from, K3_GSYM_OPEN), "tools"), K3_GSYM_SEP);
    int32_t calls = tool_call(c, a, s);
    if (!s->single_call) gb_eps(c->b, tool_call(c, calls, s), calls); /* one or more */
    return mark(c, lit(c, mark(c, calls, K3_GSYM_CLOSE), "tools"), K3_GSYM_SEP);
}

static int32_t content(g_cx *c, int32_t from, const k3_grammar_spec *s) {
    const char *what = s->what ? s->what : "schema";
    switch (s->content) {
    case K3_GC_FREE: {
        int32_t loop = gb_state(c->b);
        gb_eps(c->b, from, loop);
        gb_sym(c->b, loop, 0, 255, loop);
        return loop;
    }
    case K3_GC_NONE:
        return from;
    case K3_GC_JSON:
        if (!s->schema) return free_object(c, from, any_rule(c));
        return value(c, from, s->schema, what);
    case K3_GC_REGEX:
        if (!s->regex) break;
        return regex(c, from, s->regex, false, what);
    case K3_GC_CHOICE: {
        int32_t end = gb_state(c->b);
        if (!s->choices || s->choices->kind != K3_JSON_ARRAY || !s->choices->n_items) break;
        for (size_t i = 0; i < s->choices->n_items; i++) {
            const k3_chat_json *v = s->choices->items[i];
            if (v->kind != K3_JSON_STRING) {
                fail(c, what, "%s", "choices must be strings");
                return from;
            }
            gb_eps(c->b, g_trie_bytes(c->b, c->tab, from, v->s, v->n), end);
        }
        return end;
    }
    }
    fail(c, what, "%s", "a regex or a non-empty list of choices is missing");
    return from;
}

int32_t g_build_spec(g_build *b, const k3_grammar_spec *s) {
    g_cx c = {.b = b,
              .root = s->schema,
              .r_string = -1,
              .r_number = -1,
              .r_integer = -1,
              .r_any = -1,
              .what = s->what,
              .tab = g_tables_new()};
    if (!c.tab) {
        b->err = K3_ERR(K3_ERR_NOMEM, "grammar tables");
        return -1;
    }
    int32_t root = gb_rule(b), cur = b->rule_start[root];
    if (!s->bare && s->thinking) { /* free thinking, ended by <|close|>think<|sep|> */
        int32_t th = gb_state(b);
        gb_eps(b, cur, th);
        gb_sym(b, th, 0, 255, th);
        cur = mark(&c, lit(&c, mark(&c, th, K3_GSYM_CLOSE), "think"), K3_GSYM_SEP);
        cur = mark(&c, lit(&c, mark(&c, cur, K3_GSYM_OPEN), "response"), K3_GSYM_SEP);
    }
    cur = content(&c, cur, s);
    build_rules(&c);
    if (!s->bare) {
        cur = mark(&c, lit(&c, mark(&c, cur, K3_GSYM_CLOSE), "response"), K3_GSYM_SEP);
        if (s->tools_mode == K3_GT_REQUIRED) {
            cur = tools_section(&c, cur, s);
        } else if (s->tools_mode == K3_GT_ANY && s->tools && s->tools->n_items) {
            int32_t t = tools_section(&c, cur, s);
            gb_eps(b, cur, t);
            cur = t;
        }
        cur = mark(&c, lit(&c, mark(&c, cur, K3_GSYM_CLOSE), "message"), K3_GSYM_SEP);
        cur = mark(&c, cur, K3_GSYM_EOM);
    }
    build_rules(&c); /* the tools' parameter rules */
    gb_eps(b, cur, b->rule_end[root]);
    for (int i = 0; i < c.n_refs; i++) free(c.refs[i].path);
    free(c.refs);
    g_tables_free(c.tab);
    return b->err == K3_OK ? root : -1;
}
