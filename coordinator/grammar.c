/* grammar.c — the pushdown automaton at run time: builder primitives, epsilon removal, the
 * vocabulary trie, per-state token masks, the matcher and the compiled-grammar cache.
 *
 * Matching. A configuration is (state, stack): the state has symbol edges (closed: calls entered,
 * rule ends popped), the stack holds return states as nodes of a pool (ret, parent). A matcher
 * holds a small set of configurations (anyOf branches that still agree on their bytes).
 *
 * Masks (the xgrammar idea). For each state s, a walk of the vocabulary trie from (s, empty stack)
 * sorts every ordinary token into: accepted (some path consumes all its bytes inside the rules
 * entered from s), rejected (every path dies), or uncertain (a path reaches the end of s's own
 * rule with bytes left: what follows depends on the stack). The accepted set (a bitset, or a list
 * when short) and the uncertain list are computed once at compile. A step's mask is the union over
 * the live configurations of accepted[s] plus the uncertain tokens that the full matcher, with the
 * real stack, accepts; the four markers are tried directly. Every other special id is masked. */
#include "grammar_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ---- builder ------------------------------------------------------------------------------ */
static bool gb_grow(g_build *b, void **p, int64_t *cap, int64_t need, size_t elem) {
    if (b->err != K3_OK) return false;
    if (need <= *cap) return true;
    int64_t nc = *cap ? *cap * 2 : 256;
    while (nc < need) nc *= 2;
    void *q = realloc(*p, (size_t)nc * elem);
    if (!q) {
        b->err = K3_ERR(K3_ERR_NOMEM, "grammar builder");
        return false;
    }
    *p = q, *cap = nc;
    return true;
}

static _Thread_local bool (*thread_cancelled)(void *arg);
static _Thread_local void *thread_cancel_arg;

void k3_grammar_thread_cancel(bool (*cancelled)(void *arg), void *arg) {
    thread_cancelled = cancelled, thread_cancel_arg = arg;
}

bool g_limit_ok(g_limit *l, k3_status *err, uint32_t every) {
    if (*err != K3_OK) return false;
    if (!l || ++l->tick < every) return true;
    l->tick = 0;
    double now = k3_now_s();
    if (now - l->t0 > l->budget_s) {
        *err = K3_ERR(K3_ERR_ARG,
                      "%s: compiling its grammar took more than %g s (the compile budget, "
                      "--grammar-budget)",
                      l->what ? l->what : "schema", l->budget_s);
        return false;
    }
    if (l->cancelled && now >= l->next_poll) {
        l->next_poll = now + 0.05;
        if (l->cancelled(l->arg)) {
            *err = K3_ERR(K3_ERR_STATE, "grammar compile cancelled (the client left, or the "
                                        "server is stopping)");
            return false;
        }
    }
    return true;
}

int32_t gb_state(g_build *b) {
    if (b->n_states >= G_MAX_STATES) {
        if (b->err == K3_OK)
            b->err =
                K3_ERR(K3_ERR_ARG, "the grammar needs more than %d states (the state budget) at %s",
                       G_MAX_STATES, b->where[0] ? b->where : "the schema");
        return 0;
    }
    if (!g_limit_ok(b->lim, &b->err, 4096)) return 0;
    int64_t cap = b->cap_states;
    if (!gb_grow(b, (void **)&b->is_end, &cap, b->n_states + 1, 1)) return 0;
    b->cap_states = (int32_t)cap;
    b->is_end[b->n_states] = 0;
    return b->n_states++;
}

static void gb_edge(g_build *b, g_edge e) {
    if (!gb_grow(b, (void **)&b->e, &b->cap_e, b->n_e + 1, sizeof *b->e)) return;
    b->e[b->n_e++] = e;
}

void gb_sym(g_build *b, int32_t from, uint16_t lo, uint16_t hi, int32_t to) {
    gb_edge(b, (g_edge){.from = from, .to = to, .rule = -1, .lo = lo, .hi = hi, .kind = GE_SYM});
}

void gb_eps(g_build *b, int32_t from, int32_t to) {
    gb_edge(b, (g_edge){.from = from, .to = to, .rule = -1, .kind = GE_EPS});
}

void gb_call(g_build *b, int32_t from, int32_t rule, int32_t ret) {
    gb_edge(b, (g_edge){.from = from, .to = ret, .rule = rule, .kind = GE_CALL});
}

int32_t gb_rule(g_build *b) {
    int64_t cap = b->cap_rules;
    if (!gb_grow(b, (void **)&b->rule_start, &cap, b->n_rules + 1, sizeof(int32_t))) return 0;
    cap = b->cap_rules;
    if (!gb_grow(b, (void **)&b->rule_end, &cap, b->n_rules + 1, sizeof(int32_t))) return 0;
    b->cap_rules = (int32_t)cap;
    int32_t s = gb_state(b), t = gb_state(b);
    if (b->err != K3_OK) return 0;
    b->is_end[t] = 1;
    b->rule_start[b->n_rules] = s, b->rule_end[b->n_rules] = t;
    return b->n_rules++;
}

int32_t gb_lit(g_build *b, int32_t from, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        int32_t t = gb_state(b);
        gb_sym(b, from, (uint8_t)s[i], (uint8_t)s[i], t);
        from = t;
    }
    return from;
}

int32_t gb_utf8_char(g_build *b, int32_t from, const bool ascii_ok[128]) {
    int32_t to = gb_state(b), c1 = gb_state(b), c2 = gb_state(b), c3 = gb_state(b);
    for (int lo = 0; lo < 128;) { /* ASCII runs */
        if (!ascii_ok[lo]) {
            lo++;
            continue;
        }
        int hi = lo;
        while (hi + 1 < 128 && ascii_ok[hi + 1]) hi++;
        gb_sym(b, from, (uint16_t)lo, (uint16_t)hi, to);
        lo = hi + 1;
    }
    /* c1/c2/c3: 1, 2, 3 continuation bytes still to come */
    gb_sym(b, c1, 0x80, 0xBF, to);
    gb_sym(b, c2, 0x80, 0xBF, c1);
    gb_sym(b, c3, 0x80, 0xBF, c2);
    gb_sym(b, from, 0xC2, 0xDF, c1);
    int32_t e0 = gb_state(b), ed = gb_state(b), f0 = gb_state(b), f4 = gb_state(b);
    gb_sym(b, from, 0xE0, 0xE0, e0), gb_sym(b, e0, 0xA0, 0xBF, c1);
    gb_sym(b, from, 0xE1, 0xEC, c2), gb_sym(b, from, 0xEE, 0xEF, c2);
    gb_sym(b, from, 0xED, 0xED, ed), gb_sym(b, ed, 0x80, 0x9F, c1); /* no surrogates */
    gb_sym(b, from, 0xF0, 0xF0, f0), gb_sym(b, f0, 0x90, 0xBF, c2);
    gb_sym(b, from, 0xF1, 0xF3, c3);
    gb_sym(b, from, 0xF4, 0xF4, f4), gb_sym(b, f4, 0x80, 0x8F, c2);
    return to;
}

static void gb_free(g_build *b) {
    free(b->is_end), free(b->e), free(b->rule_start), free(b->rule_end);
    memset(b, 0, sizeof *b);
}

/* ---- vocabulary --------------------------------------------------------------------------- */
struct k3_grammar_vocab {
    int64_t n_vocab;
    int32_t mark_id[4]; /* ids of <|open|> <|close|> <|sep|> <|end_of_msg|> (-1: none) */
    /* token bytes: id -> blob[off[id] .. off[id + 1]) (empty: never allowed) */
    int64_t *off;
    uint8_t *blob;
    /* the trie in depth-first order; node i's subtree is nodes [i, end[i]) */
    int64_t n_nodes;
    uint8_t *byte;
    uint16_t *depth; /* root children have depth 1 */
    int32_t *tok;    /* the id ending at this node, or -1 */
    int32_t *dup;    /* (n_vocab) another id with the same bytes, or -1 */
    int32_t *end;
    int max_depth;
};

static const uint8_t *vblob;
static const int64_t *voff;
static int cmp_ids(const void *a, const void *b) { /* qsort has no context: set just before */
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    int64_t nx = voff[x + 1] - voff[x], ny = voff[y + 1] - voff[y];
    int c = memcmp(vblob + voff[x], vblob + voff[y], (size_t)(nx < ny ? nx : ny));
    if (c) return c;
    return nx < ny ? -1 : nx > ny ? 1 : (x > y) - (x < y);
}
static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER; /* guards vblob/voff for qsort */

void k3_grammar_vocab_destroy(k3_grammar_vocab *v) {
    if (!v) return;
    free(v->off), free(v->blob), free(v->byte), free(v->depth), free(v->tok), free(v->dup),
        free(v->end);
    free(v);
}

int64_t k3_grammar_vocab_size(const k3_grammar_vocab *v) {
    return v->n_vocab;
}

k3_status k3_grammar_vocab_create(const k3_tokenizer *t, int64_t n_vocab, k3_grammar_vocab **out) {
    *out = NULL;
    if (n_vocab <= 0 || n_vocab > INT32_MAX)
        return K3_ERR(K3_ERR_ARG, "grammar: vocabulary size %lld", (long long)n_vocab);
    k3_grammar_vocab *v = calloc(1, sizeof *v);
    if (!v) return K3_ERR(K3_ERR_NOMEM, "grammar vocabulary");
    v->n_vocab = n_vocab;
    k3_tok_ctrl c = k3_tok_control_ids(t);
    v->mark_id[0] = c.open, v->mark_id[1] = c.close, v->mark_id[2] = c.sep,
    v->mark_id[3] = c.end_of_msg;
    int64_t n_tok = k3_tok_n_vocab(t), total = 0;
    v->off = calloc((size_t)n_vocab + 1, sizeof *v->off);
    v->dup = malloc((size_t)n_vocab * sizeof *v->dup);
    int32_t *order = malloc((size_t)n_vocab * sizeof *order);
    k3_status st = v->off && v->dup && order ? K3_OK : K3_ERR(K3_ERR_NOMEM, "grammar vocabulary");
    for (int64_t id = 0; st == K3_OK && id < n_vocab; id++) {
        const char *p;
        size_t n = 0;
        v->dup[id] = -1;
        if (id < n_tok && !k3_tok_is_special(t, (int32_t)id) &&
            k3_tok_id_bytes(t, (int32_t)id, &p, &n) == K3_OK)
            total += (int64_t)n;
        else
            n = 0;
        v->off[id + 1] = v->off[id] + (int64_t)n;
    }
    if (st == K3_OK && !(v->blob = malloc((size_t)total + 1)))
        st = K3_ERR(K3_ERR_NOMEM, "grammar vocabulary bytes");
    int64_t n_order = 0;
    for (int64_t id = 0; st == K3_OK && id < n_vocab; id++) {
        int64_t n = v->off[id + 1] - v->off[id];
        if (!n) continue;
        const char *p;
        size_t nb;
        k3_tok_id_bytes(t, (int32_t)id, &p, &nb);
        memcpy(v->blob + v->off[id], p, (size_t)n);
        order[n_order++] = (int32_t)id;
    }
    if (st == K3_OK) {
        pthread_mutex_lock(&sort_mu);
        vblob = v->blob, voff = v->off;
        qsort(order, (size_t)n_order, sizeof *order, cmp_ids);
        pthread_mutex_unlock(&sort_mu);
        /* nodes: at most the total bytes */
        v->byte = malloc((size_t)total + 1);
        v->depth = malloc(((size_t)total + 1) * sizeof *v->depth);
        v->tok = malloc(((size_t)total + 1) * sizeof *v->tok);
        v->end = malloc(((size_t)total + 1) * sizeof *v->end);
        if (!v->byte || !v->depth || !v->tok || !v->end) st = K3_ERR(K3_ERR_NOMEM, "grammar trie");
    }
    int32_t path[65536]; /* node index at each depth of the current path */
    int64_t prev = -1;
    for (int64_t k = 0; st == K3_OK && k < n_order; k++) {
        int32_t id = order[k];
        const uint8_t *s = v->blob + v->off[id];
        int64_t n = v->off[id + 1] - v->off[id], lcp = 0;
        if (n > 65535) {
            st = K3_ERR(K3_ERR_ARG, "grammar: token %d has %lld bytes", id, (long long)n);
            break;
        }
        if (prev >= 0) {
            const uint8_t *q = v->blob + v->off[prev];
            int64_t m = v->off[prev + 1] - v->off[prev];
            while (lcp < n && lcp < m && s[lcp] == q[lcp]) lcp++;
            for (int64_t d = m; d > lcp; d--) v->end[path[d]] = (int32_t)v->n_nodes;
            if (lcp == n && lcp == m) { /* same bytes as the previous id */
                int32_t first = v->tok[path[n]];
                v->dup[id] = v->dup[first], v->dup[first] = id;
                prev = id;
                continue;
            }
        }
        for (int64_t d = lcp + 1; d <= n; d++) {
            int64_t i = v->n_nodes++;
            v->byte[i] = s[d - 1], v->depth[i] = (uint16_t)d, v->tok[i] = -1;
            path[d] = (int32_t)i;
        }
        v->tok[path[n]] = id;
        if (n > v->max_depth) v->max_depth = (int)n;
        prev = id;
    }
    if (st == K3_OK && prev >= 0)
        for (int64_t d = v->off[prev + 1] - v->off[prev]; d >= 1; d--)
            v->end[path[d]] = (int32_t)v->n_nodes;
    free(order);
    if (st != K3_OK) {
        k3_grammar_vocab_destroy(v);
        return st;
    }
    *out = v;
    return K3_OK;
}

/* ---- compiled grammar --------------------------------------------------------------------- */
typedef struct g_mask {
    uint64_t *bits;  /* (n_words) accepted ids, or NULL: the list below */
    int32_t *ids;    /* (n_ids) accepted ids when short */
    int32_t *unsure; /* (n_unsure) ids to check with the live stack */
    int32_t n_ids, n_unsure;
} g_mask;

struct k3_grammar {
    atomic_int refs;
    const k3_grammar_vocab *v;
    int32_t n_states, root;
    int32_t *eoff;    /* (n_states + 1) CSR of symbol/call edges */
    g_edge *edges;    /* SYM and CALL only, grouped by state */
    uint8_t *final;   /* a rule end is in the state's epsilon closure */
    uint8_t *has_sym; /* the state has symbol edges */
    int32_t *rule_start;
    int32_t n_rules;
    g_mask *mask; /* (n_states), for states with symbol edges that are reachable */
    int64_t n_words, n_masked, mask_bytes, bytes;
    double compile_s;
};

/* ---- configurations ------------------------------------------------------------------------ */
#define G_MAX_CFG  K3_GRAMMAR_MAX_CFG
#define G_MAX_WORK (1 << 20) /* closure steps of one advance (the nest check bounds them first) */

typedef struct g_cfg {
    int32_t s, stk; /* state; top stack node (-1: empty) */
} g_cfg;

typedef struct g_pool {
    int32_t *ret, *parent;
    int64_t n, cap;
} g_pool;

typedef struct g_set {
    g_cfg *c;
    int n, cap;
} g_set;

typedef struct g_run {
    const k3_grammar *g;
    g_pool pool;
    bool at_end;  /* a path reached the end of the bottom rule */
    int64_t work; /* closure steps of the current advance */
    g_cfg *todo;  /* the closure's explicit stack */
    int64_t cap_todo;
    g_limit *lim;  /* the compile's clock (NULL in a matcher) */
    k3_status err; /* out of memory, or a cap passed: the run stops (never drops a path) */
} g_run;

static void set_free(g_set *s) {
    free(s->c);
    memset(s, 0, sizeof *s);
}

static bool set_reserve(g_run *r, g_set *o, int n) {
    if (n <= o->cap) return true;
    if (n > G_MAX_CFG) {
        if (r->err == K3_OK)
            r->err = K3_ERR(K3_ERR_ARG,
                            "the grammar keeps more than %d alternatives alive at once (anyOf / "
                            "enum branches that share a prefix)",
                            G_MAX_CFG);
        return false;
    }
    int nc = o->cap ? 2 * o->cap : 16;
    while (nc < n) nc *= 2;
    if (nc > G_MAX_CFG) nc = G_MAX_CFG;
    g_cfg *q = realloc(o->c, (size_t)nc * sizeof *q);
    if (!q) {
        if (r->err == K3_OK) r->err = K3_ERR(K3_ERR_NOMEM, "grammar configurations");
        return false;
    }
    o->c = q, o->cap = nc;
    return true;
}

static int32_t pool_push(g_run *r, int32_t ret, int32_t parent) {
    g_pool *p = &r->pool;
    if (p->n == p->cap) {
        int64_t nc = p->cap ? 2 * p->cap : 1024;
        int32_t *a = realloc(p->ret, (size_t)nc * sizeof *a);
        if (a) p->ret = a;
        int32_t *b2 = a ? realloc(p->parent, (size_t)nc * sizeof *b2) : NULL;
        if (!a || !b2) {
            r->err = K3_ERR(K3_ERR_NOMEM, "grammar stacks");
            return -1;
        }
        p->parent = b2, p->cap = nc;
    }
    p->ret[p->n] = ret, p->parent[p->n] = parent;
    return (int32_t)p->n++;
}

static bool stk_equal(const g_pool *p, int32_t a, int32_t b) {
    while (a != b) {
        if (a < 0 || b < 0 || p->ret[a] != p->ret[b]) return false;
        a = p->parent[a], b = p->parent[b];
    }
    return true;
}

static void set_add(g_run *r, g_set *o, int32_t s, int32_t stk) {
    for (int i = 0; i < o->n; i++)
        if (o->c[i].s == s && stk_equal(&r->pool, o->c[i].stk, stk)) return;
    if (set_reserve(r, o, o->n + 1)) o->c[o->n++] = (g_cfg){s, stk};
}

static bool todo_push(g_run *r, int64_t *n, int32_t s, int32_t stk) {
    if (*n == r->cap_todo) {
        int64_t nc = r->cap_todo ? 2 * r->cap_todo : 256;
        g_cfg *q = realloc(r->todo, (size_t)nc * sizeof *q);
        if (!q) {
            if (r->err == K3_OK) r->err = K3_ERR(K3_ERR_NOMEM, "grammar closure");
            return false;
        }
        r->todo = q, r->cap_todo = nc;
    }
    r->todo[(*n)++] = (g_cfg){s, stk};
    return true;
}

/* Close state t over calls and rule ends, adding configurations with symbol edges to o. An
 * explicit stack: the depth of the calls never reaches the C stack. */
static void closure(g_run *r, g_set *o, int32_t t0, int32_t stk0) {
    const k3_grammar *g = r->g;
    int64_t n = 0;
    if (!todo_push(r, &n, t0, stk0)) return;
    while (n && r->err == K3_OK) {
        g_cfg cur = r->todo[--n];
        int32_t t = cur.s, stk = cur.stk;
        if (++r->work > G_MAX_WORK) {
            r->err = K3_ERR(K3_ERR_ARG,
                            "the grammar enters more than %d calls without "
                            "consuming input (a $ref/anyOf chain)",
                            G_MAX_WORK);
            return;
        }
        if (g->has_sym[t]) set_add(r, o, t, stk);
        if (g->final[t]) {
            if (stk < 0)
                r->at_end = true;
            else if (!todo_push(r, &n, r->pool.ret[stk], r->pool.parent[stk]))
                return;
        }
        for (int32_t k = g->eoff[t + 1] - 1; k >= g->eoff[t]; k--) {
            const g_edge *e = &g->edges[k];
            if (e->kind != GE_CALL) continue;
            int32_t nd = pool_push(r, e->to, stk);
            if (nd < 0 || !todo_push(r, &n, g->rule_start[e->rule], nd)) return;
        }
    }
}

static void advance(g_run *r, const g_set *in, uint16_t sym, g_set *o) {
    o->n = 0;
    r->at_end = false;
    r->work = 0;
    const k3_grammar *g = r->g;
    for (int i = 0; i < in->n; i++) {
        int32_t s = in->c[i].s;
        for (int32_t k = g->eoff[s]; k < g->eoff[s + 1]; k++) {
            const g_edge *e = &g->edges[k];
            if (e->kind == GE_SYM && sym >= e->lo && sym <= e->hi)
                closure(r, o, e->to, in->c[i].stk);
        }
    }
}

/* ---- per-state masks ------------------------------------------------------------------------ */
typedef struct g_ids {
    int32_t *p;
    int64_t n, cap;
} g_ids;
static bool ids_push(g_ids *v, int32_t id) {
    if (v->n == v->cap) {
        int64_t nc = v->cap ? 2 * v->cap : 256;
        int32_t *q = realloc(v->p, (size_t)nc * sizeof *q);
        if (!q) return false;
        v->p = q, v->cap = nc;
    }
    v->p[v->n++] = id;
    return true;
}

static bool push_tok(const k3_grammar_vocab *v, g_ids *a, int32_t id) {
    for (; id >= 0; id = v->dup[id])
        if (!ids_push(a, id)) return false;
    return true;
}

/* The trie walk from state s alone (see the top of the file). */
static k3_status state_mask(k3_grammar *g, int32_t s, g_set *lv, bool *ended, int64_t *mark,
                            g_run *r) {
    const k3_grammar_vocab *v = g->v;
    g_ids acc = {0}, uns = {0};
    bool ok = true;
    if (!set_reserve(r, &lv[0], 1)) return r->err;
    lv[0].n = 1, lv[0].c[0] = (g_cfg){s, -1};
    ended[0] = false;
    r->pool.n = 0;
    mark[0] = 0;
    for (int64_t i = 0; i < v->n_nodes && ok;) {
        if (!g_limit_ok(r->lim, &r->err, 4096)) {
            ok = false;
            break;
        }
        int d = v->depth[i];
        r->pool.n = mark[d - 1];
        advance(r, &lv[d - 1], v->byte[i], &lv[d]);
        mark[d] = r->pool.n;
        bool end_here = r->at_end, before = ended[d - 1];
        ended[d] = before || end_here;
        if (v->tok[i] >= 0) {
            if (lv[d].n || end_here)
                ok = push_tok(v, &acc, v->tok[i]);
            else if (before)
                ok = push_tok(v, &uns, v->tok[i]);
        }
        if (lv[d].n) {
            i++;
            continue;
        }
        if (ended[d]) /* every longer token leaves s's rule: the stack decides */
            for (int64_t j = i + 1; j < v->end[i] && ok; j++)
                if (v->tok[j] >= 0) ok = push_tok(v, &uns, v->tok[j]);
        i = v->end[i];
    }
    if (r->err != K3_OK) ok = false;
    g_mask *m = &g->mask[s];
    if (ok && acc.n > 256) {
        m->bits = calloc((size_t)g->n_words, sizeof *m->bits);
        ok = m->bits != NULL;
        for (int64_t k = 0; ok && k < acc.n; k++) m->bits[acc.p[k] >> 6] |= 1ull << (acc.p[k] & 63);
        free(acc.p);
        acc.p = NULL;
        g->mask_bytes += g->n_words * 8;
    } else {
        m->ids = acc.p, m->n_ids = (int32_t)acc.n;
        g->mask_bytes += acc.n * 4;
    }
    m->unsure = uns.p, m->n_unsure = (int32_t)uns.n;
    g->mask_bytes += uns.n * 4;
    if (!ok) return r->err != K3_OK ? r->err : K3_ERR(K3_ERR_NOMEM, "grammar masks");
    return K3_OK;
}

/* ---- compile ------------------------------------------------------------------------------- */
void k3_grammar_release(k3_grammar *g) {
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    for (int32_t s = 0; g->mask && s < g->n_states; s++)
        free(g->mask[s].bits), free(g->mask[s].ids), free(g->mask[s].unsure);
    free(g->mask), free(g->eoff), free(g->edges), free(g->final), free(g->has_sym),
        free(g->rule_start);
    free(g);
}

k3_grammar *k3_grammar_retain(k3_grammar *g) {
    atomic_fetch_add(&g->refs, 1);
    return g;
}

int64_t k3_grammar_vocab_size_of(const k3_grammar *g) {
    return g->v->n_vocab;
}

void k3_grammar_get_info(const k3_grammar *g, k3_grammar_info *out) {
    *out = (k3_grammar_info){.n_states = g->n_states,
                             .n_rules = g->n_rules,
                             .n_masked_states = g->n_masked,
                             .mask_bytes = g->mask_bytes,
                             .bytes = g->bytes,
                             .compile_s = g->compile_s};
}

static int cmp_edge(const void *a, const void *b) {
    const g_edge *x = a, *y = b;
    if (x->from != y->from) return x->from < y->from ? -1 : 1;
    return 0;
}

/* Epsilon removal: state s gets the SYM/CALL edges and finality of every state its epsilon
 * closure reaches. */
static k3_status finish(k3_grammar *g, g_build *b) {
    const int32_t N = b->n_states;
    qsort(b->e, (size_t)b->n_e, sizeof *b->e, cmp_edge);
    int32_t *first = calloc((size_t)N + 1, sizeof *first);
    int32_t *stack = malloc((size_t)N * sizeof *stack);
    int32_t *seen = malloc((size_t)N * sizeof *seen);
    g->final = calloc((size_t)N, 1);
    g->has_sym = calloc((size_t)N, 1);
    g->eoff = calloc((size_t)N + 1, sizeof *g->eoff);
    if (!first || !stack || !seen || !g->final || !g->has_sym || !g->eoff) {
        free(first), free(stack), free(seen);
        return K3_ERR(K3_ERR_NOMEM, "grammar");
    }
    for (int64_t k = 0; k < b->n_e; k++) first[b->e[k].from + 1]++;
    for (int32_t s = 0; s < N; s++) first[s + 1] += first[s];
    for (int32_t s = 0; s < N; s++) seen[s] = -1;
    g_edge *out = NULL;
    int64_t n_out = 0, cap = 0;
    k3_status st = K3_OK;
    for (int32_t s = 0; s < N && st == K3_OK; s++) {
        g->eoff[s] = (int32_t)n_out;
        if (!g_limit_ok(b->lim, &st, 1024)) break;
        int sp = 0;
        stack[sp++] = s, seen[s] = s;
        while (sp && st == K3_OK && g_limit_ok(b->lim, &st, 4096)) {
            int32_t u = stack[--sp];
            if (b->is_end[u]) g->final[s] = 1;
            for (int32_t k = first[u]; k < first[u + 1]; k++) {
                g_edge e = b->e[k];
                if (e.kind == GE_EPS) {
                    if (seen[e.to] != s) seen[e.to] = s, stack[sp++] = e.to;
                    continue;
                }
                if (n_out == cap) {
                    cap = cap ? 2 * cap : 1024;
                    g_edge *q = realloc(out, (size_t)cap * sizeof *q);
                    if (!q) {
                        st = K3_ERR(K3_ERR_NOMEM, "grammar edges");
                        break;
                    }
                    out = q;
                }
                e.from = s;
                out[n_out++] = e;
                if (e.kind == GE_SYM) g->has_sym[s] = 1;
            }
        }
    }
    g->eoff[N] = (int32_t)n_out;
    g->edges = out;
    free(first), free(stack), free(seen);
    return st;
}

/* Horn-clause closure over the edges: a state is marked when some edge out of it has all its
 * premises marked (SYM: its target; CALL: its return state and the called rule's start; with
 * calls_only, SYM edges never fire). `mark` starts with the final states. Linear. */
static k3_status horn(const k3_grammar *g, uint8_t *mark, bool calls_only, g_limit *lim) {
    const int32_t N = g->n_states;
    const int64_t E = g->eoff[N];
    int32_t *need = calloc((size_t)E + 1, sizeof *need),
            *first = calloc((size_t)N + 2, sizeof *first);
    int64_t *by = malloc(((size_t)2 * E + 1) * sizeof *by);
    int32_t *queue = malloc(((size_t)N + 1) * sizeof *queue);
    k3_status st = K3_OK;
    if (!need || !first || !by || !queue) st = K3_ERR(K3_ERR_NOMEM, "grammar check");
    for (int pass = 0; st == K3_OK && pass < 2; pass++) { /* premises indexed by state (CSR) */
        if (pass == 1)
            for (int32_t v = 0; v < N; v++) first[v + 2] += first[v + 1];
        for (int64_t k = 0; k < E && g_limit_ok(lim, &st, 65536); k++) {
            const g_edge *e = &g->edges[k];
            if (calls_only && e->kind != GE_CALL) continue;
            int32_t p[2] = {e->to, e->kind == GE_CALL ? g->rule_start[e->rule] : -1};
            if (p[1] == p[0]) p[1] = -1;
            for (int j = 0; j < 2; j++) {
                if (p[j] < 0) continue;
                if (pass == 0)
                    need[k]++, first[p[j] + 2]++;
                else
                    by[first[p[j] + 1]++] = k;
            }
        }
    }
    int32_t qn = 0;
    for (int32_t v = 0; st == K3_OK && v < N; v++)
        if (mark[v]) queue[qn++] = v;
    while (qn && g_limit_ok(lim, &st, 4096)) {
        int32_t v = queue[--qn];
        for (int32_t i = first[v]; i < first[v + 1]; i++) {
            const g_edge *e = &g->edges[by[i]];
            if (--need[by[i]] == 0 && !mark[e->from]) mark[e->from] = 1, queue[qn++] = e->from;
        }
    }
    free(need), free(first), free(by), free(queue);
    return st;
}

/* After epsilon removal: (1) drop the edges into states that can never complete (a branch that
 * must go through a self-reference forever), so no configuration is a dead end and no mask can be
 * empty while the grammar is incomplete; refuse a grammar that accepts nothing. (2) Refuse calls
 * entered without consuming input in a cycle (left recursion) or deeper than
 * K3_GRAMMAR_MAX_NEST, so every closure is bounded before a matcher runs. */
static k3_status trim(k3_grammar *g, g_limit *lim) {
    const int32_t N = g->n_states;
    uint8_t *prod = malloc((size_t)N), *nul = malloc((size_t)N);
    int32_t *depth = calloc((size_t)N, sizeof *depth), *stk = malloc((size_t)N * sizeof *stk);
    int64_t *pos = malloc((size_t)N * sizeof *pos);
    uint8_t *color = calloc((size_t)N, 1);
    k3_status st = K3_OK;
    if (!prod || !nul || !depth || !stk || !pos || !color) st = K3_ERR(K3_ERR_NOMEM, "grammar");
    if (st == K3_OK) memcpy(prod, g->final, (size_t)N), memcpy(nul, g->final, (size_t)N);
    if (st == K3_OK) st = horn(g, prod, false, lim);
    if (st == K3_OK && !prod[g->rule_start[g->root]])
        st = K3_ERR(K3_ERR_ARG,
                    "%s: the schema accepts no finite value (every value must go through a "
                    "self-reference that never ends, e.g. a required property whose $ref is its "
                    "own schema)",
                    lim->what);
    int64_t n = 0;
    for (int32_t u = 0; u < N && g_limit_ok(lim, &st, 4096);
         u++) { /* edges into productive states */
        int64_t k0 = g->eoff[u];
        g->eoff[u] = (int32_t)n;
        g->has_sym[u] = 0;
        for (int64_t k = k0; k < g->eoff[u + 1]; k++) {
            const g_edge *e = &g->edges[k];
            if (!prod[e->to] || (e->kind == GE_CALL && !prod[g->rule_start[e->rule]])) continue;
            g->edges[n++] = *e;
            if (e->kind == GE_SYM) g->has_sym[u] = 1;
        }
    }
    if (st == K3_OK) g->eoff[N] = (int32_t)n;
    if (st == K3_OK) st = horn(g, nul, true, lim);
    /* the graph of moves without input: u -> a called rule's start; u -> the return state when
     * the called rule can end at once. Depth-first, an explicit stack. */
    for (int32_t s0 = 0; st == K3_OK && s0 < N; s0++) {
        if (color[s0]) continue;
        int32_t sp = 0;
        stk[sp++] = s0, color[s0] = 1, pos[s0] = 2 * (int64_t)g->eoff[s0];
        while (sp && g_limit_ok(lim, &st, 4096)) {
            int32_t u = stk[sp - 1], v = -1;
            while (v < 0 && pos[u] < 2 * (int64_t)g->eoff[u + 1]) {
                const g_edge *e = &g->edges[pos[u] / 2];
                int half = (int)(pos[u]++ & 1);
                if (e->kind != GE_CALL) continue;
                v = half ? (nul[g->rule_start[e->rule]] ? e->to : -1) : g->rule_start[e->rule];
            }
            if (v < 0) { /* u is done */
                color[u] = 2, sp--;
                if (sp && depth[stk[sp - 1]] < depth[u] + 1) depth[stk[sp - 1]] = depth[u] + 1;
                continue;
            }
            if (color[v] == 1) {
                st = K3_ERR(K3_ERR_ARG,
                            "%s: the schema is left-recursive (a $ref/anyOf reaches itself "
                            "without any text between): it can never be generated",
                            lim->what);
            } else if (color[v] == 2) {
                if (depth[u] < depth[v] + 1) depth[u] = depth[v] + 1;
            } else {
                color[v] = 1, pos[v] = 2 * (int64_t)g->eoff[v], stk[sp++] = v;
            }
            if (st == K3_OK && depth[u] > K3_GRAMMAR_MAX_NEST)
                st = K3_ERR(K3_ERR_ARG,
                            "%s: $ref/anyOf nest more than %d deep without any text between "
                            "(the nesting budget)",
                            lim->what, K3_GRAMMAR_MAX_NEST);
        }
    }
    free(prod), free(nul), free(depth), free(stk), free(pos), free(color);
    return st;
}

k3_status k3_grammar_compile(const k3_grammar_vocab *v, const k3_grammar_spec *s,
                             k3_grammar **out) {
    *out = NULL;
    double t0 = k3_now_s();
    g_limit lim = {.t0 = t0,
                   .budget_s = s->budget_s > 0 ? s->budget_s : K3_GRAMMAR_BUDGET_S,
                   .cancelled = s->cancelled ? s->cancelled : thread_cancelled,
                   .arg = s->cancelled ? s->cancel_arg : thread_cancel_arg,
                   .what = s->what ? s->what : "schema"};
    g_build b = {.lim = &lim};
    int32_t root = g_build_spec(&b, s);
    if (b.err != K3_OK || root < 0) {
        k3_status st = b.err != K3_OK ? b.err : K3_ERR(K3_ERR_INTERNAL, "grammar: no root");
        gb_free(&b);
        return st;
    }
    k3_grammar *g = calloc(1, sizeof *g);
    if (!g) {
        gb_free(&b);
        return K3_ERR(K3_ERR_NOMEM, "grammar");
    }
    atomic_init(&g->refs, 1);
    g->v = v;
    g->n_states = b.n_states;
    g->n_rules = b.n_rules;
    g->root = root;
    g->rule_start = b.rule_start;
    b.rule_start = NULL;
    g->n_words = (v->n_vocab + 63) / 64;
    k3_status st = finish(g, &b);
    gb_free(&b);
    if (st == K3_OK) st = trim(g, &lim);
    /* masks for the states a configuration can rest in: reachable, with symbol edges */
    uint8_t *reach = st == K3_OK ? calloc((size_t)g->n_states, 1) : NULL;
    int32_t *todo = st == K3_OK ? malloc((size_t)g->n_states * sizeof *todo) : NULL;
    g->mask = st == K3_OK ? calloc((size_t)g->n_states, sizeof *g->mask) : NULL;
    if (st == K3_OK && (!reach || !todo || !g->mask)) st = K3_ERR(K3_ERR_NOMEM, "grammar");
    if (st == K3_OK) {
        int n = 0;
        todo[n++] = g->rule_start[root], reach[g->rule_start[root]] = 1;
        while (n && g_limit_ok(&lim, &st, 4096)) {
            int32_t u = todo[--n];
            for (int32_t k = g->eoff[u]; k < g->eoff[u + 1]; k++) {
                int32_t t2[2] = {g->edges[k].to, g->edges[k].kind == GE_CALL
                                                     ? g->rule_start[g->edges[k].rule]
                                                     : -1};
                for (int j = 0; j < 2; j++)
                    if (t2[j] >= 0 && !reach[t2[j]]) reach[t2[j]] = 1, todo[n++] = t2[j];
            }
        }
    }
    g_set *lv = NULL;
    bool *ended = NULL;
    int64_t *mark = NULL;
    g_run r = {.g = g, .lim = &lim};
    if (st == K3_OK) {
        lv = calloc((size_t)v->max_depth + 2, sizeof *lv);
        ended = malloc(((size_t)v->max_depth + 2) * sizeof *ended);
        mark = malloc(((size_t)v->max_depth + 2) * sizeof *mark);
        if (!lv || !ended || !mark) st = K3_ERR(K3_ERR_NOMEM, "grammar trie walk");
    }
    for (int32_t q = 0; st == K3_OK && q < g->n_states; q++)
        if (reach[q] && g->has_sym[q]) {
            st = state_mask(g, q, lv, ended, mark, &r);
            g->n_masked++;
        }
    for (int d = 0; lv && d < v->max_depth + 2; d++) set_free(&lv[d]);
    free(reach), free(todo), free(lv), free(ended), free(mark);
    free(r.pool.ret), free(r.pool.parent), free(r.todo);
    if (st != K3_OK) {
        k3_grammar_release(g);
        return st;
    }
    g->compile_s = k3_now_s() - t0;
    g->bytes = (int64_t)sizeof *g + g->mask_bytes +
               (int64_t)g->eoff[g->n_states] * (int64_t)sizeof *g->edges +
               (int64_t)g->n_states * (int64_t)(sizeof *g->eoff + 2 + sizeof *g->mask) +
               (int64_t)g->n_rules * (int64_t)sizeof *g->rule_start;
    *out = g;
    return K3_OK;
}

/* ---- matcher -------------------------------------------------------------------------------- */
struct k3_matcher {
    k3_grammar *g;
    g_run r;
    g_set cur;      /* live configurations; their stacks are pool nodes [0, base) */
    bool can_end;   /* the root rule is complete */
    int64_t base;   /* pool nodes of the live stacks */
    g_set tmp[2];   /* scratch */
    int32_t *remap; /* compaction scratch */
    int64_t cap_remap;
};

void k3_matcher_destroy(k3_matcher *m) {
    if (!m) return;
    k3_grammar_release(m->g);
    free(m->r.pool.ret), free(m->r.pool.parent), free(m->r.todo), free(m->remap);
    set_free(&m->cur), set_free(&m->tmp[0]), set_free(&m->tmp[1]);
    free(m);
}

k3_status k3_matcher_create(k3_grammar *g, k3_matcher **out) {
    *out = NULL;
    k3_matcher *m = calloc(1, sizeof *m);
    if (!m) return K3_ERR(K3_ERR_NOMEM, "grammar matcher");
    m->g = k3_grammar_retain(g);
    m->r.g = g;
    m->r.at_end = false;
    closure(&m->r, &m->cur, g->rule_start[g->root], -1);
    m->can_end = m->r.at_end;
    m->base = m->r.pool.n;
    if (m->r.err != K3_OK) {
        k3_status st = m->r.err;
        k3_matcher_destroy(m);
        return st;
    }
    *out = m;
    return K3_OK;
}

/* Copy the stacks of s into a fresh pool prefix (drops the nodes of dead paths). */
static k3_status compact(k3_matcher *m, g_set *s) {
    g_pool *p = &m->r.pool;
    if (m->cap_remap < p->n) {
        int32_t *q = realloc(m->remap, (size_t)p->n * sizeof *q);
        if (!q) return K3_ERR(K3_ERR_NOMEM, "grammar stacks");
        m->remap = q, m->cap_remap = p->n;
    }
    int64_t old_n = p->n;
    for (int64_t i = 0; i < old_n; i++) m->remap[i] = -1;
    /* nodes only point to older nodes: a pass in index order keeps parents before children */
    int64_t n = 0;
    for (int i = 0; i < s->n; i++)
        for (int32_t k = s->c[i].stk; k >= 0 && m->remap[k] == -1; k = p->parent[k])
            m->remap[k] = -2;
    for (int64_t i = 0; i < old_n; i++)
        if (m->remap[i] == -2) {
            int32_t par = p->parent[i];
            p->ret[n] = p->ret[i];
            p->parent[n] = par >= 0 ? m->remap[par] : -1;
            m->remap[i] = (int32_t)n++;
        }
    for (int i = 0; i < s->n; i++)
        if (s->c[i].stk >= 0) s->c[i].stk = m->remap[s->c[i].stk];
    p->n = n;
    return K3_OK;
}

/* Run syms from the live set into `o` (scratch nodes past base); false when every path died. */
static bool run_syms(k3_matcher *m, const uint16_t *syms, size_t n, g_set **o, bool *end) {
    g_set *a = &m->cur;
    *end = m->can_end && n == 0;
    for (size_t i = 0; i < n; i++) {
        g_set *b = &m->tmp[i & 1];
        advance(&m->r, a, syms[i], b);
        if (i + 1 == n) *end = m->r.at_end;
        if (!b->n && !(i + 1 == n && m->r.at_end)) return false;
        a = b;
    }
    *o = a;
    return true;
}

bool k3_matcher_accept_syms(k3_matcher *m, const uint16_t *syms, size_t n) {
    g_set *o = &m->cur;
    bool end;
    if (!run_syms(m, syms, n, &o, &end)) {
        m->r.pool.n = m->base;
        return false;
    }
    if (o != &m->cur) { /* the result becomes the live set; its old buffer, scratch */
        g_set t = m->cur;
        m->cur = *o, *o = t;
    }
    m->can_end = end;
    if (compact(m, &m->cur) != K3_OK) return false;
    m->base = m->r.pool.n;
    return true;
}

static bool try_token(k3_matcher *m, const g_cfg *c, int32_t id);
static int mark_index(const k3_grammar_vocab *v, int32_t id) {
    for (int k = 0; k < 4; k++)
        if (v->mark_id[k] == id && id >= 0) return k;
    return -1;
}

k3_status k3_matcher_accept(k3_matcher *m, int32_t id) {
    const k3_grammar_vocab *v = m->g->v;
    if (id < 0 || id >= v->n_vocab)
        return K3_ERR(K3_ERR_ARG, "grammar: id %d outside the vocabulary", id);
    int k = mark_index(v, id);
    uint16_t buf[256], *heap = NULL, *syms = buf;
    size_t n = 1;
    if (k >= 0) {
        buf[0] = (uint16_t)(K3_GSYM_OPEN + k);
    } else {
        n = (size_t)(v->off[id + 1] - v->off[id]);
        if (n > 256 && !(syms = heap = malloc(n * sizeof *heap)))
            return K3_ERR(K3_ERR_NOMEM, "grammar");
        for (size_t j = 0; j < n; j++) syms[j] = v->blob[v->off[id] + (int64_t)j];
    }
    bool ok = n > 0 && k3_matcher_accept_syms(m, syms, n);
    free(heap);
    if (m->r.err != K3_OK) return m->r.err;
    if (!ok) return K3_ERR(K3_ERR_ARG, "grammar: token %d is not allowed here", id);
    return K3_OK;
}

bool k3_matcher_allows(k3_matcher *m, int32_t id) {
    const k3_grammar_vocab *v = m->g->v;
    if (id < 0 || id >= v->n_vocab) return false;
    int k = mark_index(v, id);
    bool ok = false;
    if (k >= 0) {
        uint16_t sym = (uint16_t)(K3_GSYM_OPEN + k);
        g_set *o;
        bool end;
        ok = run_syms(m, &sym, 1, &o, &end);
    } else {
        for (int i = 0; i < m->cur.n && !ok; i++)
            ok = v->off[id + 1] > v->off[id] && try_token(m, &m->cur.c[i], id);
    }
    m->r.pool.n = m->base;
    return ok;
}

bool k3_matcher_can_end(const k3_matcher *m) {
    return m->can_end;
}

bool k3_matcher_done(const k3_matcher *m) {
    return m->can_end && m->cur.n == 0;
}

/* Does the live set accept all of token id's bytes? */
static bool try_token(k3_matcher *m, const g_cfg *c, int32_t id) {
    const k3_grammar_vocab *v = m->g->v;
    const uint8_t *p = v->blob + v->off[id];
    int64_t n = v->off[id + 1] - v->off[id];
    g_set *a = &m->tmp[0], *b = &m->tmp[1];
    if (!set_reserve(&m->r, a, 1)) return false;
    a->n = 1, a->c[0] = *c;
    bool ok = true;
    for (int64_t i = 0; i < n && ok; i++) {
        advance(&m->r, a, p[i], b);
        ok = b->n > 0 || (i + 1 == n && m->r.at_end);
        g_set *t = a;
        a = b, b = t;
    }
    m->r.pool.n = m->base;
    return ok;
}

k3_status k3_matcher_mask(k3_matcher *m, uint64_t *words) {
    const k3_grammar *g = m->g;
    const k3_grammar_vocab *v = g->v;
    memset(words, 0, (size_t)g->n_words * sizeof *words);
    for (int i = 0; i < m->cur.n; i++) {
        const g_mask *mk = &g->mask[m->cur.c[i].s];
        if (mk->bits)
            for (int64_t w = 0; w < g->n_words; w++) words[w] |= mk->bits[w];
        for (int32_t k = 0; k < mk->n_ids; k++) words[mk->ids[k] >> 6] |= 1ull << (mk->ids[k] & 63);
        for (int32_t k = 0; k < mk->n_unsure; k++) {
            int32_t id = mk->unsure[k];
            if (words[id >> 6] >> (id & 63) & 1) continue;
            if (try_token(m, &m->cur.c[i], id)) words[id >> 6] |= 1ull << (id & 63);
        }
    }
    for (int k = 0; k < 4; k++) {
        int32_t id = v->mark_id[k];
        if (id < 0 || id >= v->n_vocab) continue;
        uint16_t sym = (uint16_t)(K3_GSYM_OPEN + k);
        g_set *o;
        bool end;
        if (run_syms(m, &sym, 1, &o, &end)) words[id >> 6] |= 1ull << (id & 63);
        m->r.pool.n = m->base;
    }
    if (m->r.err != K3_OK) return m->r.err;
    return K3_OK;
}

/* ---- cache ---------------------------------------------------------------------------------- */
typedef struct g_entry {
    char *key;
    size_t n_key;
    k3_grammar *g;
    uint64_t used;
} g_entry;

struct k3_grammar_cache {
    k3_grammar_vocab *v;
    pthread_mutex_t mu;
    g_entry *e;
    int n, max;
    uint64_t clock;
    int64_t bytes, max_bytes; /* the kept grammars' bytes and their budget */
    double budget_s;          /* each compile's time budget */
};

void k3_grammar_cache_limits(k3_grammar_cache *c, int64_t max_bytes, double budget_s) {
    pthread_mutex_lock(&c->mu);
    c->max_bytes = max_bytes > 0 ? max_bytes : (int64_t)K3_GRAMMAR_CACHE_MB << 20;
    c->budget_s = budget_s > 0 ? budget_s : K3_GRAMMAR_BUDGET_S;
    pthread_mutex_unlock(&c->mu);
}

static void cache_drop(k3_grammar_cache *c, int i) { /* under mu */
    c->bytes -= c->e[i].g->bytes;
    free(c->e[i].key), k3_grammar_release(c->e[i].g);
    c->e[i] = c->e[--c->n];
}

k3_status k3_grammar_cache_create(k3_grammar_vocab *vocab, int max_entries,
                                  k3_grammar_cache **out) {
    *out = NULL;
    k3_grammar_cache *c = calloc(1, sizeof *c);
    if (!c) return K3_ERR(K3_ERR_NOMEM, "grammar cache");
    c->max = max_entries > 0 ? max_entries : 1;
    c->e = calloc((size_t)c->max, sizeof *c->e);
    if (!c->e) {
        free(c);
        return K3_ERR(K3_ERR_NOMEM, "grammar cache");
    }
    pthread_mutex_init(&c->mu, NULL);
    c->v = vocab;
    c->max_bytes = (int64_t)K3_GRAMMAR_CACHE_MB << 20;
    c->budget_s = K3_GRAMMAR_BUDGET_S;
    *out = c;
    return K3_OK;
}

void k3_grammar_cache_destroy(k3_grammar_cache *c) {
    if (!c) return;
    for (int i = 0; i < c->n; i++) free(c->e[i].key), k3_grammar_release(c->e[i].g);
    free(c->e);
    pthread_mutex_destroy(&c->mu);
    k3_grammar_vocab_destroy(c->v);
    free(c);
}

const k3_grammar_vocab *k3_grammar_cache_vocab(const k3_grammar_cache *c) {
    return c->v;
}

/* The spec as canonical text: equal specs give equal keys. */
static k3_status spec_key(const k3_grammar_spec *s, k3_chat_buf *k) {
    char head[96];
    snprintf(head, sizeof head, "%d %d %d %d %d|", s->bare, s->thinking, (int)s->content,
             (int)s->tools_mode, s->single_call);
    K3_TRY(k3_chat_buf_puts(k, head));
    if (s->schema) K3_TRY(k3_chat_json_dump(s->schema, K3_JSON_COMPACT, k));
    K3_TRY(k3_chat_buf_puts(k, "|"));
    if (s->regex) K3_TRY(k3_chat_json_dump_str(s->regex, strlen(s->regex), k));
    K3_TRY(k3_chat_buf_puts(k, "|"));
    if (s->choices) K3_TRY(k3_chat_json_dump(s->choices, K3_JSON_COMPACT, k));
    K3_TRY(k3_chat_buf_puts(k, "|"));
    if (s->tools && s->tools_mode != K3_GT_NONE)
        K3_TRY(k3_chat_json_dump(s->tools, K3_JSON_COMPACT, k));
    K3_TRY(k3_chat_buf_puts(k, "|"));
    if (s->tool_name) K3_TRY(k3_chat_json_dump_str(s->tool_name, strlen(s->tool_name), k));
    return K3_OK;
}

k3_status k3_grammar_cache_get(k3_grammar_cache *c, const k3_grammar_spec *s, k3_grammar **out,
                               bool *hit) {
    *out = NULL;
    *hit = false;
    k3_chat_buf key = {0};
    k3_status st = spec_key(s, &key);
    if (st != K3_OK) {
        k3_chat_buf_free(&key);
        return st;
    }
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->n; i++)
        if (c->e[i].n_key == key.n && !memcmp(c->e[i].key, key.p, key.n)) {
            c->e[i].used = ++c->clock;
            *out = k3_grammar_retain(c->e[i].g);
            *hit = true;
            break;
        }
    pthread_mutex_unlock(&c->mu);
    if (*hit) {
        k3_chat_buf_free(&key);
        return K3_OK;
    }
    /* compile outside the lock: two threads may compile one spec; the first insert wins */
    k3_grammar *g = NULL;
    k3_grammar_spec s2 = *s;
    pthread_mutex_lock(&c->mu);
    if (s2.budget_s <= 0) s2.budget_s = c->budget_s;
    pthread_mutex_unlock(&c->mu);
    /* the compile yields the CPU to the engine's steps: this thread's nice is raised meanwhile
       (restored after, where the process may lower it again) */
    const id_t tid = (id_t)syscall(SYS_gettid);
    errno = 0;
    const int nice0 = getpriority(PRIO_PROCESS, tid);
    const bool niced = errno == 0 && nice0 < K3_GRAMMAR_NICE &&
                       setpriority(PRIO_PROCESS, tid, K3_GRAMMAR_NICE) == 0;
    st = k3_grammar_compile(c->v, &s2, &g);
    if (niced) (void)setpriority(PRIO_PROCESS, tid, nice0);
    if (st != K3_OK) {
        k3_chat_buf_free(&key);
        return st;
    }
    pthread_mutex_lock(&c->mu);
    if (g->bytes > c->max_bytes) { /* used once, never kept */
        pthread_mutex_unlock(&c->mu);
        k3_chat_buf_free(&key);
        *out = g;
        return K3_OK;
    }
    while (c->n && (c->n == c->max || c->bytes + g->bytes > c->max_bytes)) {
        int lru = 0; /* evict the least recently used */
        for (int i = 1; i < c->n; i++)
            if (c->e[i].used < c->e[lru].used) lru = i;
        cache_drop(c, lru);
    }
    c->e[c->n++] =
        (g_entry){.key = key.p, .n_key = key.n, .g = k3_grammar_retain(g), .used = ++c->clock};
    c->bytes += g->bytes;
    pthread_mutex_unlock(&c->mu);
    *out = g;
    return K3_OK;
}
