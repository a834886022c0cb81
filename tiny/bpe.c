/* bpe.c — k3's own byte-level BPE trainer for the make-tiny tokenizer (tiktoken.model).
 *
 * Ranks 0..255 are the single bytes in GPT-2 order (printable '!'..'~', '¡'..'¬', '®'..'ÿ',
 * then the remaining bytes ascending — the order of tiktoken's byte tokens). The corpus is
 * pre-split with the K3 pattern (K3-CHAT.md §4.2, PCRE2 UTF|UCP rewrite); identical pieces are
 * counted once with a weight. Each step merges the adjacent pair with the highest weighted count;
 * ties go to the lowest merged byte sequence (memcmp order, shorter prefix first), then lowest
 * left id, then lowest right id, so training is deterministic. A merge whose bytes already are
 * a token (reachable by two splits) is applied without a new rank.
 * If the corpus runs out of pairs before n_ranks (the small preset's 32768 on a ~200 KB corpus),
 * the remaining ranks are filled with token+byte concatenations in (token rank, byte rank) order
 * that are not yet in the vocabulary: valid tiktoken entries that encoding simply never produces
 * by merging, only by a whole-piece match.
 * Pair counts are maintained incrementally (only words containing the merged pair are revisited)
 * with a lazily invalidated max-heap, so tiny (3840 ranks) trains well under a second. */
#include "k3_tiny.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdlib.h>

static const char k3_pat[] =
    "\\p{Han}+|[^\\r\\n\\p{L}\\p{N}]?(?:(?!\\p{Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])*(?:(?"
    "!\\p{Han})[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N"
    "}]?(?:(?!\\p{Han})[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])+(?:(?!\\p{Han})[\\p{Ll}\\p{Lm}\\p{"
    "Lo}\\p{M}])*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\t\\n\\x0B\\x0C\\r\\x20\\x{85}\\"
    "x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}\\p{L}\\p{N}"
    "]+[\\r\\n]*|[\\t\\n\\x0B\\x0C\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\"
    "x{2029}\\x{202F}\\x{205F}\\x{3000}]*[\\r\\n]+|[\\t\\n\\x0B\\x0C\\r\\x20\\x{85}\\x{A0}\\x{1"
    "680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}]+(?![^\\t\\n\\x0B\\x0"
    "C\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x"
    "{3000}])|[\\t\\n\\x0B\\x0C\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2"
    "029}\\x{202F}\\x{205F}\\x{3000}]+";

void k3_bpe_byte_order(uint8_t rank_to_byte[256]) {
    bool used[256] = {false};
    int n = 0;
    for (int b = '!'; b <= '~'; b++) rank_to_byte[n++] = (uint8_t)b, used[b] = true;
    for (int b = 0xA1; b <= 0xAC; b++) rank_to_byte[n++] = (uint8_t)b, used[b] = true;
    for (int b = 0xAE; b <= 0xFF; b++) rank_to_byte[n++] = (uint8_t)b, used[b] = true;
    for (int b = 0; b < 256; b++)
        if (!used[b]) rank_to_byte[n++] = (uint8_t)b;
}

/* ---- a growable byte-string set: bytes -> id ------------------------------------------------ */
typedef struct strset {
    uint8_t *bytes;
    int64_t n_bytes, cap_bytes;
    int64_t *off; /* [n + 1] */
    int n, cap;
    int *ht; /* [ht_cap] id or -1 */
    size_t ht_cap;
} strset;

static uint64_t hb(const uint8_t *p, int64_t n) {
    return k3_hash_bytes(p, (size_t)n, K3_HASH_INIT);
}

static k3_status ss_grow_ht(strset *s) {
    size_t cap = s->ht_cap ? s->ht_cap * 2 : 1024;
    int *ht = malloc(cap * sizeof *ht);
    if (!ht) return K3_ERR(K3_ERR_NOMEM, "BPE table");
    for (size_t i = 0; i < cap; i++) ht[i] = -1;
    for (int id = 0; id < s->n; id++) {
        size_t i = (size_t)hb(s->bytes + s->off[id], s->off[id + 1] - s->off[id]) & (cap - 1);
        while (ht[i] >= 0) i = (i + 1) & (cap - 1);
        ht[i] = id;
    }
    free(s->ht);
    s->ht = ht;
    s->ht_cap = cap;
    return K3_OK;
}

static int ss_find(const strset *s, const uint8_t *p, int64_t n) {
    if (!s->ht_cap) return -1;
    size_t i = (size_t)hb(p, n) & (s->ht_cap - 1);
    for (;;) {
        int id = s->ht[i];
        if (id < 0) return -1;
        if (s->off[id + 1] - s->off[id] == n && memcmp(s->bytes + s->off[id], p, (size_t)n) == 0)
            return id;
        i = (i + 1) & (s->ht_cap - 1);
    }
}

/* Add two byte runs concatenated; returns the id (existing or new) in *id. */
static k3_status ss_add2(strset *s, const uint8_t *a, int64_t na, const uint8_t *b, int64_t nb,
                         int *id, bool *added) {
    int64_t n = na + nb;
    if (s->n_bytes + n > s->cap_bytes) {
        /* a/b may point into our own buffer: keep them as offsets across the realloc */
        uintptr_t base = (uintptr_t)s->bytes, end = base + (uintptr_t)s->cap_bytes;
        int64_t ao = s->bytes && (uintptr_t)a >= base && (uintptr_t)a < end
                         ? (int64_t)((uintptr_t)a - base)
                         : -1;
        int64_t bo = s->bytes && (uintptr_t)b >= base && (uintptr_t)b < end
                         ? (int64_t)((uintptr_t)b - base)
                         : -1;
        int64_t cap = K3_MAX(s->cap_bytes * 2, s->n_bytes + n + 4096);
        uint8_t *nbuf = realloc(s->bytes, (size_t)cap);
        if (!nbuf) return K3_ERR(K3_ERR_NOMEM, "BPE bytes");
        if (ao >= 0) a = nbuf + ao;
        if (bo >= 0) b = nbuf + bo;
        s->bytes = nbuf;
        s->cap_bytes = cap;
    }
    uint8_t *dst = s->bytes + s->n_bytes;
    if (na) memmove(dst, a, (size_t)na);
    if (nb) memmove(dst + na, b, (size_t)nb);
    int found = ss_find(s, dst, n);
    *added = found < 0;
    if (found >= 0) {
        *id = found;
        return K3_OK;
    }
    if (s->n + 2 > s->cap) {
        int cap = s->cap ? s->cap * 2 : 1024;
        int64_t *no = realloc(s->off, (size_t)(cap + 1) * sizeof *no);
        if (!no) return K3_ERR(K3_ERR_NOMEM, "BPE offsets");
        s->off = no;
        s->cap = cap;
    }
    if (s->n == 0) s->off[0] = 0;
    s->n_bytes += n;
    s->off[s->n + 1] = s->n_bytes;
    *id = s->n++;
    if ((size_t)s->n * 2 > s->ht_cap) return ss_grow_ht(s);
    size_t i = (size_t)hb(dst, n) & (s->ht_cap - 1);
    while (s->ht[i] >= 0) i = (i + 1) & (s->ht_cap - 1);
    s->ht[i] = *id;
    return K3_OK;
}

static void ss_free(strset *s) {
    free(s->bytes);
    free(s->off);
    free(s->ht);
    memset(s, 0, sizeof *s);
}

/* ---- words, pairs, heap -------------------------------------------------------------------- */
typedef struct word {
    int64_t count;
    int *sym;
    int n;
} word;
typedef struct pair {
    int a, b;
    int64_t count;
    int *words;
    int n_words, cap_words;
} pair;
typedef struct hent {
    int64_t count;
    int pair;
} hent;

typedef struct trainer {
    strset vocab;
    word *words;
    int n_words;
    pair *pairs;
    int n_pairs, cap_pairs;
    int *pht; /* pair hash: index or -1 */
    size_t pht_cap;
    hent *heap;
    int64_t n_heap, cap_heap;
} trainer;

static uint64_t pkey(int a, int b) {
    return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
}
static size_t phash(uint64_t k) {
    return (size_t)((k * 0x9E3779B97F4A7C15ull) >> 20);
}

static k3_status pht_grow(trainer *t) {
    size_t cap = t->pht_cap ? t->pht_cap * 2 : 4096;
    int *ht = malloc(cap * sizeof *ht);
    if (!ht) return K3_ERR(K3_ERR_NOMEM, "BPE pair table");
    for (size_t i = 0; i < cap; i++) ht[i] = -1;
    for (int p = 0; p < t->n_pairs; p++) {
        size_t i = phash(pkey(t->pairs[p].a, t->pairs[p].b)) & (cap - 1);
        while (ht[i] >= 0) i = (i + 1) & (cap - 1);
        ht[i] = p;
    }
    free(t->pht);
    t->pht = ht;
    t->pht_cap = cap;
    return K3_OK;
}

static k3_status pair_get(trainer *t, int a, int b, int *out) {
    if ((size_t)(t->n_pairs + 1) * 2 > t->pht_cap) K3_TRY(pht_grow(t));
    uint64_t k = pkey(a, b);
    size_t i = phash(k) & (t->pht_cap - 1);
    for (;;) {
        int p = t->pht[i];
        if (p < 0) break;
        if (t->pairs[p].a == a && t->pairs[p].b == b) {
            *out = p;
            return K3_OK;
        }
        i = (i + 1) & (t->pht_cap - 1);
    }
    if (t->n_pairs == t->cap_pairs) {
        int cap = t->cap_pairs ? t->cap_pairs * 2 : 4096;
        pair *np = realloc(t->pairs, (size_t)cap * sizeof *np);
        if (!np) return K3_ERR(K3_ERR_NOMEM, "BPE pairs");
        t->pairs = np;
        t->cap_pairs = cap;
    }
    int p = t->n_pairs++;
    t->pairs[p] = (pair){a, b, 0, NULL, 0, 0};
    t->pht[i] = p;
    *out = p;
    return K3_OK;
}

static k3_status pair_add_word(pair *p, int w) {
    if (p->n_words && p->words[p->n_words - 1] == w) return K3_OK;
    if (p->n_words == p->cap_words) {
        int cap = p->cap_words ? p->cap_words * 2 : 4;
        int *nw = realloc(p->words, (size_t)cap * sizeof *nw);
        if (!nw) return K3_ERR(K3_ERR_NOMEM, "BPE pair words");
        p->words = nw;
        p->cap_words = cap;
    }
    p->words[p->n_words++] = w;
    return K3_OK;
}

/* heap order: count desc, then merged bytes asc, then a asc, then b asc */
static int merged_cmp(const trainer *t, int p, int q) {
    const strset *v = &t->vocab;
    const pair *x = &t->pairs[p], *y = &t->pairs[q];
    const uint8_t *xs[2] = {v->bytes + v->off[x->a], v->bytes + v->off[x->b]};
    const uint8_t *ys[2] = {v->bytes + v->off[y->a], v->bytes + v->off[y->b]};
    int64_t xn[2] = {v->off[x->a + 1] - v->off[x->a], v->off[x->b + 1] - v->off[x->b]};
    int64_t yn[2] = {v->off[y->a + 1] - v->off[y->a], v->off[y->b + 1] - v->off[y->b]};
    int64_t xl = xn[0] + xn[1], yl = yn[0] + yn[1];
    for (int64_t i = 0; i < xl && i < yl; i++) {
        uint8_t cx = i < xn[0] ? xs[0][i] : xs[1][i - xn[0]];
        uint8_t cy = i < yn[0] ? ys[0][i] : ys[1][i - yn[0]];
        if (cx != cy) return cx < cy ? -1 : 1;
    }
    if (xl != yl) return xl < yl ? -1 : 1;
    if (x->a != y->a) return x->a < y->a ? -1 : 1;
    return x->b < y->b ? -1 : (x->b > y->b);
}

static bool before(const trainer *t, const hent *x, const hent *y) {
    if (x->count != y->count) return x->count > y->count;
    return merged_cmp(t, x->pair, y->pair) < 0;
}

static k3_status heap_push(trainer *t, int p) {
    if (t->pairs[p].count <= 0) return K3_OK;
    if (t->n_heap == t->cap_heap) {
        int64_t cap = t->cap_heap ? t->cap_heap * 2 : 4096;
        hent *nh = realloc(t->heap, (size_t)cap * sizeof *nh);
        if (!nh) return K3_ERR(K3_ERR_NOMEM, "BPE heap");
        t->heap = nh;
        t->cap_heap = cap;
    }
    int64_t i = t->n_heap++;
    t->heap[i] = (hent){t->pairs[p].count, p};
    while (i > 0) {
        int64_t up = (i - 1) / 2;
        if (!before(t, &t->heap[i], &t->heap[up])) break;
        hent tmp = t->heap[i];
        t->heap[i] = t->heap[up];
        t->heap[up] = tmp;
        i = up;
    }
    return K3_OK;
}

static hent heap_pop(trainer *t) {
    hent top = t->heap[0];
    t->heap[0] = t->heap[--t->n_heap];
    int64_t i = 0;
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < t->n_heap && before(t, &t->heap[l], &t->heap[m])) m = l;
        if (r < t->n_heap && before(t, &t->heap[r], &t->heap[m])) m = r;
        if (m == i) break;
        hent tmp = t->heap[i];
        t->heap[i] = t->heap[m];
        t->heap[m] = tmp;
        i = m;
    }
    return top;
}

/* ---- pre-tokenisation ---------------------------------------------------------------------- */
static k3_status split_corpus(trainer *t, const char *text, size_t n,
                              const uint8_t byte_rank[256]) {
    int err;
    PCRE2_SIZE eoff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)k3_pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                   &err, &eoff, NULL);
    if (!re)
        return K3_ERR(K3_ERR_INTERNAL, "K3 pre-tokenizer pattern: PCRE2 error %d at %zu", err,
                      (size_t)eoff);
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* optional speed-up; the interpreter works */
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    uint32_t opts = 0; /* the first match validates the whole UTF-8 subject, later ones skip it */
    strset pieces = {0};
    int64_t *counts = NULL;
    int64_t cap_counts = 0;
    k3_status st = K3_OK;
    PCRE2_SIZE at = 0;
    while (at < n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)text, n, at, opts, md, NULL);
        opts = PCRE2_NO_UTF_CHECK;
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            st = K3_ERR(K3_ERR_FORMAT,
                        "tokenizer corpus: PCRE2 match error %d at byte %zu "
                        "(invalid UTF-8?)",
                        rc, (size_t)at);
            break;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (ov[1] == ov[0]) {
            at = ov[1] + 1;
            continue;
        }
        int id;
        bool added;
        if ((st = ss_add2(&pieces, (const uint8_t *)text + ov[0], (int64_t)(ov[1] - ov[0]), NULL, 0,
                          &id, &added)) != K3_OK)
            break;
        if (id >= cap_counts) {
            int64_t cap = K3_MAX(cap_counts * 2, 1024);
            int64_t *nc = realloc(counts, (size_t)cap * sizeof *nc);
            if (!nc) {
                st = K3_ERR(K3_ERR_NOMEM, "BPE counts");
                break;
            }
            memset(nc + cap_counts, 0, (size_t)(cap - cap_counts) * sizeof *nc);
            counts = nc;
            cap_counts = cap;
        }
        counts[id]++;
        at = ov[1];
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    if (st == K3_OK) {
        t->n_words = pieces.n;
        t->words = calloc((size_t)K3_MAX(pieces.n, 1), sizeof *t->words);
        if (!t->words) st = K3_ERR(K3_ERR_NOMEM, "BPE words");
        for (int w = 0; st == K3_OK && w < pieces.n; w++) {
            int64_t len = pieces.off[w + 1] - pieces.off[w];
            t->words[w].count = counts[w];
            t->words[w].n = (int)len;
            t->words[w].sym = malloc((size_t)len * sizeof(int));
            if (!t->words[w].sym) {
                st = K3_ERR(K3_ERR_NOMEM, "BPE word");
                break;
            }
            for (int64_t i = 0; i < len; i++)
                t->words[w].sym[i] = byte_rank[pieces.bytes[pieces.off[w] + i]];
        }
    }
    free(counts);
    ss_free(&pieces);
    return st;
}

static void trainer_free(trainer *t) {
    for (int w = 0; w < t->n_words; w++) free(t->words[w].sym);
    free(t->words);
    for (int p = 0; p < t->n_pairs; p++) free(t->pairs[p].words);
    free(t->pairs);
    free(t->pht);
    free(t->heap);
    ss_free(&t->vocab);
}

/* The pairs whose count changed during one merge (each listed once). */
typedef struct touchset {
    int *list;
    int n, cap_list;
    uint32_t *stamp; /* [cap_stamp] epoch of the last listing */
    int cap_stamp;
    uint32_t epoch;
} touchset;

static k3_status touch(touchset *ts, int p) {
    if (p >= ts->cap_stamp) {
        int cap = K3_MAX(ts->cap_stamp * 2, p + 4096);
        uint32_t *ns = realloc(ts->stamp, (size_t)cap * sizeof *ns);
        if (!ns) return K3_ERR(K3_ERR_NOMEM, "BPE touch stamps");
        memset(ns + ts->cap_stamp, 0, (size_t)(cap - ts->cap_stamp) * sizeof *ns);
        ts->stamp = ns;
        ts->cap_stamp = cap;
    }
    if (ts->stamp[p] == ts->epoch) return K3_OK;
    ts->stamp[p] = ts->epoch;
    if (ts->n == ts->cap_list) {
        int cap = ts->cap_list ? ts->cap_list * 2 : 1024;
        int *nl = realloc(ts->list, (size_t)cap * sizeof *nl);
        if (!nl) return K3_ERR(K3_ERR_NOMEM, "BPE touch list");
        ts->list = nl;
        ts->cap_list = cap;
    }
    ts->list[ts->n++] = p;
    return K3_OK;
}

/* Merge (a, b) -> c in every word that holds it; update the pair counts. */
static k3_status apply_merge(trainer *t, int pa, int c, touchset *ts) {
    int a = t->pairs[pa].a, b = t->pairs[pa].b;
    /* the word list may grow while we walk it (a word gains pair (a,b) again only if c
     * overlaps — it cannot, c is new in that word), so walk a snapshot of its length */
    int nw = t->pairs[pa].n_words;
    for (int k = 0; k < nw; k++) {
        int wi = t->pairs[pa].words[k];
        word *w = &t->words[wi];
        bool has = false;
        for (int i = 0; i + 1 < w->n && !has; i++) has = w->sym[i] == a && w->sym[i + 1] == b;
        if (!has) continue;
        for (int i = 0; i + 1 < w->n; i++) {
            int p;
            K3_TRY(pair_get(t, w->sym[i], w->sym[i + 1], &p));
            t->pairs[p].count -= w->count;
            K3_TRY(touch(ts, p));
        }
        int o = 0;
        for (int i = 0; i < w->n; i++) {
            if (i + 1 < w->n && w->sym[i] == a && w->sym[i + 1] == b) {
                w->sym[o++] = c;
                i++;
            } else {
                w->sym[o++] = w->sym[i];
            }
        }
        w->n = o;
        for (int i = 0; i + 1 < w->n; i++) {
            int p;
            K3_TRY(pair_get(t, w->sym[i], w->sym[i + 1], &p));
            t->pairs[p].count += w->count;
            K3_TRY(pair_add_word(&t->pairs[p], wi));
            K3_TRY(touch(ts, p));
        }
    }
    return K3_OK;
}

k3_status k3_bpe_train(const char *text, size_t n_bytes, int n_ranks, k3_bpe_vocab *out) {
    memset(out, 0, sizeof *out);
    if (n_ranks < 256) return K3_ERR(K3_ERR_ARG, "BPE: %d ranks < 256 byte tokens", n_ranks);
    trainer t;
    memset(&t, 0, sizeof t);
    uint8_t order[256], byte_rank[256];
    k3_bpe_byte_order(order);
    for (int r = 0; r < 256; r++) byte_rank[order[r]] = (uint8_t)r;
    k3_status st = K3_OK;
    for (int r = 0; r < 256 && st == K3_OK; r++) {
        int id;
        bool added;
        st = ss_add2(&t.vocab, &order[r], 1, NULL, 0, &id, &added);
    }
    if (st == K3_OK) st = split_corpus(&t, text, n_bytes, byte_rank);
    for (int wi = 0; st == K3_OK && wi < t.n_words; wi++) {
        word *w = &t.words[wi];
        for (int i = 0; st == K3_OK && i + 1 < w->n; i++) {
            int p;
            st = pair_get(&t, w->sym[i], w->sym[i + 1], &p);
            if (st == K3_OK) {
                t.pairs[p].count += w->count;
                st = pair_add_word(&t.pairs[p], wi);
            }
        }
    }
    for (int p = 0; st == K3_OK && p < t.n_pairs; p++) st = heap_push(&t, p);
    touchset ts = {0};
    while (st == K3_OK && t.vocab.n < n_ranks && t.n_heap > 0) {
        hent h = heap_pop(&t);
        pair *pp = &t.pairs[h.pair];
        if (h.count != pp->count || pp->count <= 0) continue; /* stale */
        const strset *v = &t.vocab;
        int c;
        bool added;
        st = ss_add2(&t.vocab, v->bytes + v->off[pp->a], v->off[pp->a + 1] - v->off[pp->a],
                     v->bytes + v->off[pp->b], v->off[pp->b + 1] - v->off[pp->b], &c, &added);
        if (st != K3_OK) break;
        ts.epoch++;
        ts.n = 0;
        st = apply_merge(&t, h.pair, c, &ts);
        for (int i = 0; st == K3_OK && i < ts.n; i++) st = heap_push(&t, ts.list[i]);
    }
    free(ts.list);
    free(ts.stamp);
    /* filler ranks when the corpus is exhausted (documented above) */
    for (int i = 0; st == K3_OK && t.vocab.n < n_ranks && i < t.vocab.n; i++) {
        for (int r = 0; st == K3_OK && r < 256 && t.vocab.n < n_ranks; r++) {
            int id;
            bool added;
            int64_t li = t.vocab.off[i + 1] - t.vocab.off[i];
            if (li > 64) break;
            st = ss_add2(&t.vocab, t.vocab.bytes + t.vocab.off[i], li, &order[r], 1, &id, &added);
        }
    }
    if (st == K3_OK && t.vocab.n < n_ranks)
        st = K3_ERR(K3_ERR_INTERNAL, "BPE: could only make %d of %d ranks", t.vocab.n, n_ranks);
    if (st == K3_OK) {
        out->n = n_ranks;
        out->bytes = t.vocab.bytes;
        out->off = t.vocab.off;
        t.vocab.bytes = NULL;
        t.vocab.off = NULL;
    }
    trainer_free(&t);
    return st;
}

void k3_bpe_vocab_free(k3_bpe_vocab *v) {
    if (!v) return;
    free(v->bytes);
    free(v->off);
    memset(v, 0, sizeof *v);
}
