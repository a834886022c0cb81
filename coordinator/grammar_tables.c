/* grammar_tables.c — the compiler's lookup tables, so no step of a compile is quadratic in the
 * schema: object members by key (an index built the first time a large object is searched), the
 * rule built per schema node, and the literal trie (enum, const, choices and JSON escapes share
 * their prefixes, so alternatives that agree on their first bytes stay one configuration).
 * All three are open-addressed hash tables owned by one compile (g_tables, grammar_internal.h). */
#include "grammar_internal.h"

#include <stdlib.h>

typedef struct g_slot {
    uint64_t h;    /* 0: empty */
    const void *p; /* object / schema node (NULL for trie entries) */
    int64_t a, v;  /* key position / kind / (state << 16 | sym); the value */
} g_slot;

struct g_tables {
    g_slot *s;
    int64_t n, cap;
};

static uint64_t mix(uint64_t h) {
    h ^= h >> 33, h *= 0xff51afd7ed558ccdull, h ^= h >> 33;
    return h | 1; /* never 0 */
}

static bool grow(g_tables *t) {
    int64_t nc = t->cap ? 2 * t->cap : 1024;
    g_slot *q = calloc((size_t)nc, sizeof *q);
    if (!q) return false;
    for (int64_t i = 0; i < t->cap; i++) {
        if (!t->s[i].h) continue;
        int64_t j = (int64_t)(t->s[i].h & (uint64_t)(nc - 1));
        while (q[j].h) j = (j + 1) & (nc - 1);
        q[j] = t->s[i];
    }
    free(t->s);
    t->s = q, t->cap = nc;
    return true;
}

/* The slot for (h, match), or the empty slot where it goes (NULL: out of memory). */
typedef bool (*g_match)(const g_slot *s, const void *ctx);
static g_slot *find(g_tables *t, uint64_t h, g_match m, const void *ctx) {
    if (2 * (t->n + 1) > t->cap && !grow(t)) return NULL;
    int64_t j = (int64_t)(h & (uint64_t)(t->cap - 1));
    while (t->s[j].h && !(t->s[j].h == h && m(&t->s[j], ctx))) j = (j + 1) & (t->cap - 1);
    return &t->s[j];
}

g_tables *g_tables_new(void) {
    return calloc(1, sizeof(g_tables));
}

void g_tables_free(g_tables *t) {
    if (t) free(t->s), free(t);
}

/* ---- object members ------------------------------------------------------------------------ */
typedef struct key_ctx {
    const k3_chat_json *o;
    const char *k;
    size_t n;
} key_ctx;
static bool key_match(const g_slot *s, const void *ctx) {
    const key_ctx *x = ctx;
    if (s->p != x->o || s->a < 0) return false;
    const k3_chat_json *k = x->o->keys[s->a];
    return k->n == x->n && !memcmp(k->s, x->k, x->n);
}
static bool idx_match(const g_slot *s, const void *ctx) {
    return s->p == ctx && s->a == -1;
}
static uint64_t key_hash(const k3_chat_json *o, const char *k, size_t n) {
    return mix(k3_hash_bytes(k, n, (uint64_t)(uintptr_t)o));
}

int64_t g_member(g_tables *t, const k3_chat_json *o, const char *k, size_t n, k3_status *err) {
    if (!o || o->kind != K3_JSON_OBJECT) return -1;
    if (o->n_items < 16) {
        for (size_t i = 0; i < o->n_items; i++)
            if (o->keys[i]->n == n && !memcmp(o->keys[i]->s, k, n)) return (int64_t)i;
        return -1;
    }
    uint64_t hi = mix((uint64_t)(uintptr_t)o * 31 + 7);
    g_slot *s = find(t, hi, idx_match, o);
    if (!s) goto nomem;
    if (!s->h) { /* index this object once; the first of equal keys wins, as a linear scan */
        *s = (g_slot){.h = hi, .p = o, .a = -1};
        t->n++;
        for (size_t i = 0; i < o->n_items; i++) {
            key_ctx x = {o, o->keys[i]->s, o->keys[i]->n};
            uint64_t h = key_hash(o, x.k, x.n);
            g_slot *e = find(t, h, key_match, &x);
            if (!e) goto nomem;
            if (!e->h) *e = (g_slot){.h = h, .p = o, .a = (int64_t)i}, t->n++;
        }
    }
    key_ctx x = {o, k, n};
    s = find(t, key_hash(o, k, n), key_match, &x);
    if (!s) goto nomem;
    return s->h ? s->a : -1;
nomem:
    if (*err == K3_OK) *err = K3_ERR(K3_ERR_NOMEM, "grammar tables");
    return -1;
}

/* ---- rules per schema node ----------------------------------------------------------------- */
typedef struct node_ctx {
    const void *p;
    int64_t kind;
} node_ctx;
static bool node_match(const g_slot *s, const void *ctx) {
    const node_ctx *x = ctx;
    return s->p == x->p && s->a == x->kind + 8; /* kinds -1..6 -> 7..14: never an index mark */
}

int32_t g_node_rule_get(g_tables *t, const void *node, int kind, int32_t rule, k3_status *err) {
    node_ctx x = {node, kind};
    uint64_t h = mix((uint64_t)(uintptr_t)node * 131 + (uint64_t)(kind + 8));
    g_slot *s = find(t, h, node_match, &x);
    if (!s) {
        if (*err == K3_OK) *err = K3_ERR(K3_ERR_NOMEM, "grammar tables");
        return -1;
    }
    if (s->h) return (int32_t)s->v;
    if (rule >= 0) *s = (g_slot){.h = h, .p = node, .a = kind + 8, .v = rule}, t->n++;
    return -1;
}

/* ---- literal trie -------------------------------------------------------------------------- */
static bool trie_match(const g_slot *s, const void *ctx) {
    return !s->p && s->a == *(const int64_t *)ctx;
}

int32_t g_trie_step(g_build *b, g_tables *t, int32_t from, uint16_t sym) {
    if (b->err != K3_OK) return from;
    int64_t key = (int64_t)from << 16 | sym;
    uint64_t h = mix((uint64_t)key * 0x9e3779b97f4a7c15ull);
    g_slot *s = find(t, h, trie_match, &key);
    if (!s) {
        b->err = K3_ERR(K3_ERR_NOMEM, "grammar tables");
        return from;
    }
    if (s->h) return (int32_t)s->v;
    int32_t to = gb_state(b);
    gb_sym(b, from, sym, sym, to);
    if (b->err == K3_OK) *s = (g_slot){.h = h, .a = key, .v = to}, t->n++;
    return to;
}

int32_t g_trie_bytes(g_build *b, g_tables *t, int32_t from, const char *p, size_t n) {
    for (size_t i = 0; i < n; i++) from = g_trie_step(b, t, from, (uint8_t)p[i]);
    return from;
}
