/* grammar_bounds.c — JSON Schema's numeric bounds and string lengths as automaton fragments
 * (called by grammar_schema.c's typed()): the grammar itself enforces them, nothing is checked
 * after generation.
 *
 * Numbers. A number's magnitude is compared digit by digit with the bounds, aligned on 16
 * integer and 16 fraction digits (the longest the canonical shape writes): a state is (the
 * position, "equal to the lower bound so far", "equal to the upper bound so far", the residue
 * modulo multipleOf for integers, whether a fraction digit must follow). Each state is built once
 * and only when an accepting end is reachable from it, so a prefix the automaton takes can always
 * be completed. Negative numbers are '-' and a magnitude in the mirrored bounds. Bounded numbers
 * are written without an exponent (a subset of the canonical shape, so still sound). A bound with
 * more than 16 fraction digits is rounded inward; one past 1e16 in magnitude bounds nothing the
 * shape can write.
 * Strings. minLength / maxLength count code points, as JSON Schema does: each of the 1..1000
 * positions is one character (an unescaped UTF-8 character or one escape). */
#include "grammar_internal.h"

#include <stdio.h>
#include <stdlib.h>

#define NP 32 /* digit positions: 16 integer, 16 fraction */

/* A bound on a magnitude: digits [NP] (0-9), inclusive or not; unset: no bound. */
typedef struct mbound {
    bool set, excl;
    signed char d[NP];
} mbound;

/* A bound as the schema gives it, signed. */
typedef struct sbound {
    bool set, excl, neg, huge; /* huge: |value| >= 1e16 */
    signed char d[NP];
} sbound;

/* The decimal digits of a JSON number into b (sign, 16 + 16 aligned digits). Fraction digits past
 * 16 round toward the inside when `lower` (up) or not (down). */
static bool parse_bound(const k3_chat_json *v, bool lower, sbound *b) {
    char t[64];
    if (v->kind == K3_JSON_INT) {
        snprintf(t, sizeof t, "%s", v->s);
    } else if (v->kind == K3_JSON_FLOAT && v->f == v->f && v->f - v->f == 0) {
        k3_chat_json_float_repr(v->f, t);
    } else {
        return false;
    }
    const char *p = t;
    b->neg = *p == '-';
    p += b->neg;
    char mant[40];
    int n = 0, point = -1, exp = 0;
    for (; *p && *p != 'e' && *p != 'E'; p++) {
        if (*p == '.') {
            point = n;
        } else if (n < 39) {
            mant[n++] = *p;
        }
    }
    if (*p) exp = atoi(p + 1);
    if (point < 0) point = n;
    point += exp; /* the digits before the decimal point */
    memset(b->d, 0, sizeof b->d);
    bool lost = false, any = false;
    for (int i = 0; i < n; i++) {
        const int pos = 16 - point + i; /* aligned position of mant[i] */
        const int dig = mant[i] - '0';
        any |= dig != 0;
        if (pos < 0 && dig)
            b->huge = true;
        else if (pos >= NP && dig)
            lost = true;
        else if (pos >= 0 && pos < NP)
            b->d[pos] = (signed char)dig;
    }
    if (!any) b->neg = false;
    if (lost && !b->huge) {
        /* past 16 fraction digits: a lower bound on the magnitude rounds up, an upper one down */
        const bool up = lower != b->neg;
        if (up) {
            int i = NP - 1;
            while (i >= 0 && b->d[i] == 9) b->d[i--] = 0;
            if (i < 0)
                b->huge = true;
            else
                b->d[i]++;
        }
        b->excl = false;
    }
    return true;
}

typedef struct nb {
    g_build *b;
    mbound lo, hi;
    bool integer;
    int m;         /* multipleOf x 10^q (an integer), 1: none */
    int q;         /* multipleOf's fraction digits: a multiple has at most q of them */
    bool mult;     /* multipleOf given */
    int32_t *memo; /* [NP + 1][2][2][2][m]: 0 unbuilt, -1 dead, else state + 1 */
    int32_t end;
} nb;

/* May the magnitude end at position p (the digits from p on all 0) given the tight flags? */
static bool end_ok(const nb *s, int p, bool tl, bool th, int r) {
    if (s->mult) { /* value x 10^q = r x 10^(16 + q - p) must be a multiple of m */
        int64_t x = r;
        for (int i = p; i < 16 + s->q; i++) x = x * 10 % s->m;
        if (x != 0) return false;
    }
    if (tl) {
        bool zero = true;
        for (int i = p; i < NP; i++) zero &= s->lo.d[i] == 0;
        if (!zero || s->lo.excl) return false; /* below the lower bound, or equal to an excl. */
    }
    if (th) {
        bool zero = true;
        for (int i = p; i < NP; i++) zero &= s->hi.d[i] == 0;
        if (zero && s->hi.excl) return false;
    }
    return true;
}

/* Digit d at position p from flags (tl, th): the new flags, or false when out of bounds. */
static bool step(const nb *s, int p, int d, bool *tl, bool *th) {
    if (*tl && d < s->lo.d[p]) return false;
    if (*th && d > s->hi.d[p]) return false;
    *tl = *tl && d == s->lo.d[p];
    *th = *th && d == s->hi.d[p];
    return true;
}

/* The state after position p-1 (the next digit is at p); -1 when nothing can complete.
 * need: a fraction digit must come (just after '.'). */
static int32_t build(nb *s, int p, bool tl, bool th, int r, bool need) {
    int32_t *slot = &s->memo[((((size_t)p * 2 + tl) * 2 + th) * 2 + need) * (size_t)s->m + r];
    if (*slot) return *slot > 0 ? *slot - 1 : -1;
    *slot = -1; /* no cycles: positions only grow */
    int32_t st = -1;
    int32_t kids[10] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    bool any = false;
    for (int d = 0; d < 10 && p < NP; d++) {
        bool a = tl, b = th;
        if (p >= 16 && s->integer) break;
        if (s->mult && p >= 16 + s->q) break; /* no digits past multipleOf's */
        if (p == 16 && !need) break;          /* the fraction starts with '.' */
        if (!step(s, p, d, &a, &b)) continue;
        kids[d] = build(s, p + 1, a, b, p < 16 + s->q ? (r * 10 + d) % s->m : r, false);
        any |= kids[d] >= 0;
    }
    const bool can_end = p >= 16 && !need && end_ok(s, p, tl, th, r);
    int32_t dot = -1;
    if (p == 16 && !need && !s->integer && (!s->mult || s->q > 0))
        dot = build(s, 16, tl, th, r, true);
    if (!any && !can_end && dot < 0) return -1;
    st = gb_state(s->b);
    for (int d = 0; d < 10 && p < NP; d++)
        if (kids[d] >= 0) gb_sym(s->b, st, (uint16_t)('0' + d), (uint16_t)('0' + d), kids[d]);
    if (can_end) gb_eps(s->b, st, s->end);
    if (dot >= 0) gb_sym(s->b, st, '.', '.', dot);
    *slot = st + 1;
    return st;
}

/* A magnitude in [lo, hi] from `from` to s->end; false when none exists. */
static bool magnitude(nb *s, int32_t from) {
    bool live = false;
    for (int L = 1; L <= 16; L++) {
        const int p0 = 16 - L;
        bool tl = s->lo.set, th = s->hi.set, below = false;
        for (int i = 0; i < p0; i++) {
            if (s->lo.set && s->lo.d[i]) below = true; /* the lower bound has more digits */
            if (s->hi.set && s->hi.d[i]) th = false;   /* below the upper bound already */
        }
        if (below) continue;
        for (int d = L > 1 ? 1 : 0; d < 10; d++) {
            bool a = tl, b = th;
            if (!step(s, p0, d, &a, &b)) continue;
            int32_t k = build(s, p0 + 1, a, b, d % s->m, false);
            if (k >= 0)
                gb_sym(s->b, from, (uint16_t)('0' + d), (uint16_t)('0' + d), k), live = true;
        }
    }
    return live;
}

static void to_mbound(const sbound *b, bool on, mbound *m) {
    m->set = on && b->set && !b->huge;
    m->excl = b->excl;
    memcpy(m->d, b->d, sizeof m->d);
}

int32_t gb_bounded_number(g_build *b, int32_t from, bool integer, const k3_chat_json *const kw[5],
                          const char *path) {
    /* kw: minimum, exclusiveMinimum, maximum, exclusiveMaximum, multipleOf (each may be NULL) */
    static const char *const names[] = {"minimum", "exclusiveMinimum", "maximum",
                                        "exclusiveMaximum"};
    sbound lo = {0}, hi = {0};
    for (int i = 0; i < 4; i++) {
        if (!kw[i]) continue;
        sbound t = {.set = true, .excl = i == 1 || i == 3};
        if (!parse_bound(kw[i], i < 2, &t)) {
            b->err = K3_ERR(K3_ERR_ARG, "%s must be a number at %s", names[i], path);
            return from;
        }
        sbound *dst = i < 2 ? &lo : &hi;
        /* the tighter of minimum / exclusiveMinimum (maximum / ...): compare as numbers */
        const double tv = kw[i]->kind == K3_JSON_INT ? strtod(kw[i]->s, NULL) : kw[i]->f;
        const k3_chat_json *other = kw[i < 2 ? 1 - i : 5 - i];
        const double ov = !other                       ? 0
                          : other->kind == K3_JSON_INT ? strtod(other->s, NULL)
                                                       : other->f;
        const bool tighter = !dst->set || (i < 2 ? tv > ov : tv < ov) || (tv == ov && t.excl);
        if (tighter) *dst = t;
    }
    int m = 1, q = 0;
    if (kw[4]) { /* multipleOf = m / 10^q, m an integer in [1, 1000] */
        sbound t = {0};
        bool ok = parse_bound(kw[4], true, &t) && !t.neg && !t.huge;
        int64_t v = 0;
        for (int i = 0; ok && i < NP; i++)
            if (t.d[i]) q = K3_MAX(q, i - 15);
        for (int i = 0; ok && i < 16 + q; i++) v = v * 10 + t.d[i], ok = v <= 1000;
        if (!ok || v < 1) {
            b->err = K3_ERR(K3_ERR_ARG,
                            "multipleOf must be a positive number whose digits make an integer in "
                            "[1, 1000] (e.g. 5, 0.25, 1.5) at %s",
                            path);
            return from;
        }
        m = (int)v;
    }
    const int32_t end = gb_state(b);
    nb s = {.b = b, .integer = integer, .m = m, .q = q, .mult = kw[4] != NULL, .end = end};
    const size_t n_memo = (size_t)(NP + 1) * 8 * (size_t)m;
    if (k3_calloc((void **)&s.memo, n_memo * sizeof *s.memo, "number bounds") != K3_OK) {
        b->err = K3_ERR(K3_ERR_NOMEM, "grammar");
        return from;
    }
    bool live = false;
    /* v >= 0: the magnitude in [max(lo, 0), hi]; none when hi < 0 (or a huge lower bound) */
    if (!(hi.set && hi.neg) && !(lo.set && !lo.neg && lo.huge)) {
        to_mbound(&lo, !lo.neg, &s.lo);
        to_mbound(&hi, true, &s.hi);
        live |= magnitude(&s, from);
    }
    /* v < 0: '-' and the magnitude in [-hi (when hi < 0), -lo] */
    if (!lo.set || lo.neg) {
        memset(s.memo, 0, n_memo * sizeof *s.memo);
        bool hz = hi.set && !hi.huge; /* hi zero: -0 is 0, so an exclusive 0 needs u > 0 */
        for (int i = 0; i < NP; i++) hz &= hi.d[i] == 0;
        to_mbound(&hi, hi.neg || hz, &s.lo);
        to_mbound(&lo, true, &s.hi);
        if (!(hi.set && hi.neg && hi.huge)) {
            int32_t minus = gb_state(b);
            bool neg_live = magnitude(&s, minus);
            if (neg_live) gb_sym(b, from, '-', '-', minus);
            live |= neg_live;
        }
    }
    k3_free(s.memo);
    if (!live)
        b->err = K3_ERR(K3_ERR_ARG, "no %s satisfies the bounds at %s (within 16 digits)",
                        integer ? "integer" : "number", path);
    return end;
}

/* One JSON string character (one code point): an unescaped UTF-8 character or an escape. */
static void string_char(g_build *b, int32_t from, int32_t to) {
    bool ok[128];
    for (int c = 0; c < 128; c++) ok[c] = c >= 0x20 && c != '"' && c != '\\';
    gb_eps(b, gb_utf8_char(b, from, ok), to);
    int32_t esc = gb_lit(b, from, "\\", 1);
    static const char simple[] = "\"\\/bfnrt";
    for (const char *e = simple; *e; e++) gb_sym(b, esc, (uint16_t)*e, (uint16_t)*e, to);
    /* \uXXXX of a non-surrogate */
    int32_t u = gb_lit(b, esc, "u", 1), h1 = gb_state(b), h2 = gb_state(b), h3 = gb_state(b),
            d = gb_state(b);
    gb_sym(b, u, '0', '9', h1), gb_sym(b, u, 'a', 'c', h1), gb_sym(b, u, 'A', 'C', h1);
    gb_sym(b, u, 'e', 'f', h1), gb_sym(b, u, 'E', 'F', h1);
    gb_sym(b, u, 'd', 'd', d), gb_sym(b, u, 'D', 'D', d), gb_sym(b, d, '0', '7', h2);
    const int32_t hx[3] = {h1, h2, h3};
    for (int i = 0; i < 3; i++) {
        const int32_t nx = i < 2 ? hx[i + 1] : to;
        gb_sym(b, hx[i], '0', '9', nx), gb_sym(b, hx[i], 'a', 'f', nx),
            gb_sym(b, hx[i], 'A', 'F', nx);
    }
}

int32_t gb_bounded_string(g_build *b, int32_t from, int mn, int mx) {
    const int32_t r = gb_rule(b); /* one character, called at every position */
    string_char(b, b->rule_start[r], b->rule_end[r]);
    int32_t cur = gb_lit(b, from, "\"", 1), end = gb_state(b);
    for (int k = 0;; k++) { /* cur: k characters written */
        if (k >= mn) gb_eps(b, gb_lit(b, cur, "\"", 1), end);
        if (mx >= 0 && k >= mx) break;
        int32_t nx = gb_state(b);
        gb_call(b, cur, r, nx);
        if (mx < 0 && k >= mn) {
            gb_eps(b, nx, cur);
            break;
        }
        cur = nx;
        if (b->err != K3_OK) break;
    }
    return end;
}
