/* prefix_cache.c — rank 0's index of a lane's prefix cache and the stages' application of its
 * ops (prefix_cache.h). The index allocates everything at create: the entries (their tokens
 * included), the hash buckets, the per-slot records and the op buffer; nothing grows while serving.
 * Invariants: an entry is in use (users > 0) only if its parent is; evicted entries are leaves
 * with no users; ops come out in the order the decisions were made. */
#include "prefix_cache.h"

#include <string.h>

typedef struct pc_entry {
    uint64_t hash;   /* of the parent's hash and the block's tokens */
    uint64_t lru;    /* stamp of the last hit or insertion that used it */
    int32_t parent;  /* entry of the block before (-1: the first block) */
    int32_t next;    /* next entry of the same bucket (-1: end) */
    int32_t users;   /* running sequences whose chain holds it */
    int32_t n_child; /* entries whose parent it is */
    int32_t snap;    /* snapshot at its end (-1: none) */
    bool used;
} pc_entry;

/* The chain of the sequence in a slot: the entries it uses, block by block. */
typedef struct pc_seq {
    int32_t *chain; /* [max_blocks] entry of each block it has cached or matched */
    int n;          /* blocks in chain: positions [0, n·K3_KV_BLOCK) */
    bool stop;      /* the cache had no room for a block: it caches no more */
    bool live;
} pc_seq;

struct rank_pcache {
    rank_pc_params p;
    pc_entry *e;     /* [n_entries] */
    int32_t *tok;    /* [n_entries, K3_KV_BLOCK] */
    int32_t *bucket; /* [n_buckets] first entry (-1: empty) */
    int n_buckets;   /* a power of two >= 2 n_entries */
    int32_t *free_e; /* [n_entries] unused entry ids */
    int n_free_e;
    int32_t *snap_of; /* [n_snaps] the entry holding each snapshot (-1: free) */
    pc_seq *seq;      /* [max_seqs] */
    /* the ops decided since the last take (wire.h rank_step sections), each list at its cap */
    int32_t *evicts;       /* [n_entries]: each entry at most once between two takes (an entry
                              inserted since is in use) */
    rank_step_hit *hits;   /* [max_seqs]: one per slot */
    int32_t *hit_ent;      /* [max_seqs * min(max_blocks, RANK_PC_MAX_HIT)] */
    rank_step_save *saves; /* [cap_saves]: the blocks a step completes */
    rank_step_snap *snaps; /* [max_seqs]: one per slot */
    int n_evicts, n_hits, n_hit_ent, n_saves, n_snaps, cap_saves, cap_hit_ent;
    int n_used;        /* entries with users > 0 */
    int64_t n_evicted; /* entries evicted so far */
    uint64_t tick;
};

static uint64_t block_hash(uint64_t parent, const int32_t *t) {
    uint64_t h = parent ^ 0x9e3779b97f4a7c15ull; /* FNV-1a over the parent's hash and the ids */
    for (int i = 0; i < K3_KV_BLOCK; i++) {
        uint32_t v = (uint32_t)t[i];
        for (int b = 0; b < 4; b++) h = (h ^ ((v >> (8 * b)) & 0xff)) * 0x100000001b3ull;
    }
    return h ^ (h >> 29);
}

k3_status rank_pc_create(const rank_pc_params *p, rank_pcache **out) {
    *out = NULL;
    if (p->n_entries < 1 || p->n_snaps < 1 || p->snap_every < 1 || p->max_seqs < 1 ||
        p->max_blocks < 1)
        return K3_ERR(K3_ERR_ARG, "prefix cache: %d entries, %d snapshots, every %d, %d slots",
                      p->n_entries, p->n_snaps, p->snap_every, p->max_seqs);
    rank_pcache *c;
    K3_TRY(k3_calloc((void **)&c, sizeof *c, "prefix cache"));
    c->p = *p;
    c->n_buckets = 16;
    while (c->n_buckets < 2 * p->n_entries) c->n_buckets *= 2;
    c->cap_saves = (int)(p->max_tokens / K3_KV_BLOCK) + p->max_seqs;
    c->cap_hit_ent = p->max_seqs * K3_MIN(p->max_blocks, RANK_PC_MAX_HIT);
    k3_status st = k3_calloc((void **)&c->e, (size_t)p->n_entries * sizeof *c->e, "cache entries");
    if (st == K3_OK)
        st = k3_alloc((void **)&c->tok, (size_t)p->n_entries * K3_KV_BLOCK * sizeof(int32_t),
                      "cache entry tokens");
    if (st == K3_OK)
        st = k3_alloc((void **)&c->bucket, (size_t)c->n_buckets * sizeof(int32_t), "cache buckets");
    if (st == K3_OK)
        st = k3_alloc((void **)&c->free_e, (size_t)p->n_entries * sizeof(int32_t), "cache free");
    if (st == K3_OK)
        st = k3_alloc((void **)&c->snap_of, (size_t)p->n_snaps * sizeof(int32_t), "cache snaps");
    if (st == K3_OK)
        st = k3_calloc((void **)&c->seq, (size_t)p->max_seqs * sizeof *c->seq, "cache slots");
    for (int i = 0; st == K3_OK && i < p->max_seqs; i++)
        st = k3_alloc((void **)&c->seq[i].chain, (size_t)p->max_blocks * sizeof(int32_t),
                      "cache slot chain");
    if (st == K3_OK)
        st = k3_alloc((void **)&c->evicts, (size_t)p->n_entries * sizeof *c->evicts, "cache ops");
    if (st == K3_OK)
        st = k3_alloc((void **)&c->hits, (size_t)p->max_seqs * sizeof *c->hits, "cache ops");
    if (st == K3_OK)
        st = k3_alloc((void **)&c->hit_ent, (size_t)c->cap_hit_ent * sizeof *c->hit_ent,
                      "cache ops");
    if (st == K3_OK)
        st = k3_alloc((void **)&c->saves, (size_t)c->cap_saves * sizeof *c->saves, "cache ops");
    if (st == K3_OK)
        st = k3_alloc((void **)&c->snaps, (size_t)p->max_seqs * sizeof *c->snaps, "cache ops");
    if (st != K3_OK) {
        rank_pc_destroy(c);
        return st;
    }
    for (int i = 0; i < c->n_buckets; i++) c->bucket[i] = -1;
    for (int i = 0; i < p->n_entries; i++) c->free_e[i] = p->n_entries - 1 - i;
    c->n_free_e = p->n_entries;
    for (int i = 0; i < p->n_snaps; i++) c->snap_of[i] = -1;
    *out = c;
    return K3_OK;
}

void rank_pc_destroy(rank_pcache *c) {
    if (!c) return;
    for (int i = 0; c->seq && i < c->p.max_seqs; i++) k3_free(c->seq[i].chain);
    k3_free(c->e), k3_free(c->tok), k3_free(c->bucket), k3_free(c->free_e), k3_free(c->snap_of);
    k3_free(c->seq), k3_free(c->evicts), k3_free(c->hits), k3_free(c->hit_ent);
    k3_free(c->saves), k3_free(c->snaps);
    k3_free(c);
}

/* Room for one more op in a list of cap (the caps count every op two takes can see). */
static k3_status op_room(int n, int cap, const char *what) {
    if (n >= cap) return K3_ERR(K3_ERR_INTERNAL, "prefix cache: more than %d %s ops", cap, what);
    return K3_OK;
}

static int32_t find(const rank_pcache *c, int32_t parent, const int32_t *t) {
    const uint64_t ph = parent >= 0 ? c->e[parent].hash : 0;
    const uint64_t h = block_hash(ph, t);
    for (int32_t i = c->bucket[h & (uint64_t)(c->n_buckets - 1)]; i >= 0; i = c->e[i].next)
        if (c->e[i].hash == h && c->e[i].parent == parent &&
            memcmp(c->tok + (size_t)i * K3_KV_BLOCK, t, K3_KV_BLOCK * sizeof(int32_t)) == 0)
            return i;
    return -1;
}

/* The longest chain of ids[0, n) ending in a snapshot with at least one token after it. */
static int match(const rank_pcache *c, const int32_t *ids, int64_t n, int32_t *chain) {
    int hit = 0, depth = 0;
    int32_t parent = -1;
    while ((int64_t)(depth + 1) * K3_KV_BLOCK < n) {
        int32_t x = find(c, parent, ids + (int64_t)depth * K3_KV_BLOCK);
        if (x < 0) break;
        if (chain) chain[depth] = x;
        depth++;
        if (c->e[x].snap >= 0) hit = depth;
        parent = x;
    }
    return hit;
}

int64_t rank_pc_lookup(const rank_pcache *c, const int32_t *ids, int64_t n, int *n_unused) {
    int32_t chain[RANK_PC_MAX_HIT];
    const int cap = (int)K3_MIN((int64_t)RANK_PC_MAX_HIT, (int64_t)c->p.max_blocks);
    int hit = match(c, ids, K3_MIN(n, (int64_t)cap * K3_KV_BLOCK), chain);
    int u = 0;
    for (int j = 0; j < hit; j++) u += c->e[chain[j]].users == 0;
    if (n_unused) *n_unused = u;
    return (int64_t)hit * K3_KV_BLOCK;
}

int rank_pc_blocks(const rank_pcache *c) {
    return c->p.n_entries - c->n_free_e;
}
int rank_pc_evictable(const rank_pcache *c) {
    return rank_pc_blocks(c) - c->n_used;
}
int64_t rank_pc_evictions(const rank_pcache *c) {
    return c->n_evicted;
}

static void use(rank_pcache *c, int32_t x) {
    if (c->e[x].users++ == 0) c->n_used++;
    c->e[x].lru = ++c->tick;
}

bool rank_pc_evict_one(rank_pcache *c) {
    int32_t best = -1;
    for (int32_t i = 0; i < c->p.n_entries; i++) {
        const pc_entry *x = &c->e[i];
        if (x->used && x->users == 0 && x->n_child == 0 && (best < 0 || x->lru < c->e[best].lru))
            best = i;
    }
    if (best < 0) return false;
    if (c->n_evicts >= c->p.n_entries) return false; /* cannot happen: the cap counts each entry */
    c->evicts[c->n_evicts++] = best;
    pc_entry *x = &c->e[best];
    int32_t *pp = &c->bucket[x->hash & (uint64_t)(c->n_buckets - 1)];
    while (*pp != best) pp = &c->e[*pp].next;
    *pp = x->next;
    if (x->parent >= 0) c->e[x->parent].n_child--;
    if (x->snap >= 0) c->snap_of[x->snap] = -1;
    memset(x, 0, sizeof *x);
    c->free_e[c->n_free_e++] = best;
    c->n_evicted++;
    return true;
}

k3_status rank_pc_begin(rank_pcache *c, int slot, const int32_t *ids, int64_t n, bool allow_hit,
                        int64_t *hit_tokens) {
    K3_ASSERT(slot >= 0 && slot < c->p.max_seqs && !c->seq[slot].live);
    pc_seq *q = &c->seq[slot];
    q->n = 0, q->stop = false, q->live = true;
    *hit_tokens = 0;
    if (!allow_hit) return K3_OK;
    const int64_t cap = K3_MIN((int64_t)c->p.max_blocks, (int64_t)RANK_PC_MAX_HIT) * K3_KV_BLOCK;
    int hit = match(c, ids, K3_MIN(n, cap), q->chain);
    if (hit == 0) return K3_OK;
    K3_TRY(op_room(c->n_hits, c->p.max_seqs, "hit"));
    K3_TRY(op_room(c->n_hit_ent + hit - 1, c->cap_hit_ent, "hit entry"));
    c->hits[c->n_hits++] =
        (rank_step_hit){.slot = slot, .snap = c->e[q->chain[hit - 1]].snap, .n_blocks = hit};
    memcpy(c->hit_ent + c->n_hit_ent, q->chain, (size_t)hit * sizeof *c->hit_ent);
    c->n_hit_ent += hit;
    for (int j = 0; j < hit; j++) use(c, q->chain[j]);
    q->n = hit;
    *hit_tokens = (int64_t)hit * K3_KV_BLOCK;
    return K3_OK;
}

/* A snapshot slot for entry x: a free one, or the least recently used entry's. */
static int take_snap(rank_pcache *c, int32_t x) {
    int best = -1;
    for (int s = 0; s < c->p.n_snaps; s++) {
        if (c->snap_of[s] < 0) {
            best = s;
            break;
        }
        if (best < 0 || c->e[c->snap_of[s]].lru < c->e[c->snap_of[best]].lru) best = s;
    }
    if (c->snap_of[best] >= 0) c->e[c->snap_of[best]].snap = -1;
    c->snap_of[best] = x;
    c->e[x].snap = best;
    return best;
}

/* A prompt's own snapshot points: its last block boundary before its last token (the deepest hit
   the same prompt can take: one token must run) and, when its length is a whole number of
   blocks, its end too (the next turn of a conversation continues from there). */
static bool snap_point(const rank_pcache *c, int64_t pos, int64_t P) {
    return pos > 0 && pos % K3_KV_BLOCK == 0 &&
           (pos % ((int64_t)c->p.snap_every * K3_KV_BLOCK) == 0 ||
            pos == (P - 1) / K3_KV_BLOCK * K3_KV_BLOCK || pos == P / K3_KV_BLOCK * K3_KV_BLOCK);
}

int64_t rank_pc_next_cut(const rank_pcache *c, int64_t fed, int64_t P) {
    const int64_t every = (int64_t)c->p.snap_every * K3_KV_BLOCK;
    int64_t cut = (fed / every + 1) * every, last = (P - 1) / K3_KV_BLOCK * K3_KV_BLOCK;
    if (last > fed && last < cut) cut = last;
    return cut < P ? cut : INT64_MAX;
}

k3_status rank_pc_advance(rank_pcache *c, int slot, const int32_t *prompt, int64_t P,
                          const int32_t *gen, int64_t to, int *moved) {
    pc_seq *q = &c->seq[slot];
    *moved = 0;
    K3_ASSERT(q->live);
    int32_t t[K3_KV_BLOCK];
    while (!q->stop && (int64_t)(q->n + 1) * K3_KV_BLOCK <= to && q->n < c->p.max_blocks) {
        const int j = q->n;
        for (int i = 0; i < K3_KV_BLOCK; i++) {
            int64_t pos = (int64_t)j * K3_KV_BLOCK + i;
            t[i] = pos < P ? prompt[pos] : gen[pos - P];
        }
        const int32_t parent = j > 0 ? q->chain[j - 1] : -1;
        int32_t x = find(c, parent, t);
        if (x < 0) { /* a new entry holds this sequence's own block j */
            if (c->n_free_e == 0 && !rank_pc_evict_one(c)) {
                q->stop = true; /* everything cached is in use: this sequence caches no more */
                break;
            }
            x = c->free_e[--c->n_free_e];
            pc_entry *e = &c->e[x];
            memset(e, 0, sizeof *e);
            e->used = true, e->parent = parent, e->snap = -1;
            e->hash = block_hash(parent >= 0 ? c->e[parent].hash : 0, t);
            memcpy(c->tok + (size_t)x * K3_KV_BLOCK, t, sizeof t);
            const size_t b = e->hash & (uint64_t)(c->n_buckets - 1);
            e->next = c->bucket[b];
            c->bucket[b] = x;
            if (parent >= 0) c->e[parent].n_child++;
            K3_TRY(op_room(c->n_saves, c->cap_saves, "save"));
            c->saves[c->n_saves++] = (rank_step_save){.slot = slot, .block = j, .entry = x};
            ++*moved;
        }
        use(c, x);
        q->chain[q->n++] = x;
    }
    /* a snapshot where this step ends, if that is a snapshot point the chain reaches */
    if (snap_point(c, to, P) && q->n == to / K3_KV_BLOCK && c->e[q->chain[q->n - 1]].snap < 0) {
        K3_TRY(op_room(c->n_snaps, c->p.max_seqs, "snapshot"));
        c->snaps[c->n_snaps++] =
            (rank_step_snap){.slot = slot, .snap = take_snap(c, q->chain[q->n - 1])};
    }
    return K3_OK;
}

void rank_pc_fork(rank_pcache *c, int parent, int child) {
    const pc_seq *a = &c->seq[parent];
    pc_seq *q = &c->seq[child];
    K3_ASSERT(a->live && q->live && q->n == 0);
    for (int j = 0; j < a->n; j++) use(c, a->chain[j]), q->chain[j] = a->chain[j];
    q->n = a->n, q->stop = a->stop;
}

int rank_pc_chain(const rank_pcache *c, int slot) {
    return c->seq[slot].live ? c->seq[slot].n : 0;
}

void rank_pc_end(rank_pcache *c, int slot) {
    pc_seq *q = &c->seq[slot];
    if (!q->live) return;
    for (int j = 0; j < q->n; j++)
        if (--c->e[q->chain[j]].users == 0) c->n_used--;
    q->n = 0, q->live = false;
}

void rank_pc_ops(const rank_pcache *c, rank_step *m) {
    m->n_evicts = c->n_evicts, m->evicts = c->evicts;
    m->n_hits = c->n_hits, m->hits = c->hits;
    m->n_hit_entries = c->n_hit_ent, m->hit_entries = c->hit_ent;
    m->n_saves = c->n_saves, m->saves = c->saves;
    m->n_snaps = c->n_snaps, m->snaps = c->snaps;
}
void rank_pc_ops_clear(rank_pcache *c) {
    c->n_evicts = c->n_hits = c->n_hit_ent = c->n_saves = c->n_snaps = 0;
}

/* ---- a stage applies the ops ------------------------------------------------------------------
 */
static bool bad_slot(const rank_pc_params *p, k3_seq_state *const *states, int slot) {
    return slot < 0 || slot >= p->max_seqs || !states[slot];
}

k3_status rank_pc_apply(k3_stage *st, const rank_pc_params *p, int32_t *entry_blk,
                        k3_seq_state *const *states, const rank_step *m, int phase,
                        const char *who) {
    if (!entry_blk && m->n_evicts + m->n_hits + m->n_hit_entries + m->n_saves + m->n_snaps > 0)
        return K3_ERR(K3_ERR_FORMAT, "prefix-cache ops from %s: the prefix cache is off", who);
    if (phase == RANK_PC_FORKS)
        for (int i = 0; i < m->n_forks; i++) {
            const rank_step_fork f = m->forks[i];
            if (bad_slot(p, states, f.parent) || bad_slot(p, states, f.child) ||
                f.parent == f.child)
                return K3_ERR(K3_ERR_FORMAT, "fork %d -> %d out of range (%d slots), from %s",
                              f.parent, f.child, p->max_seqs, who);
            K3_TRY(k3_seq_state_fork(states[f.child], states[f.parent]));
        }
    if (phase == RANK_PC_EVICTS)
        for (int i = 0; i < m->n_evicts; i++) {
            const int32_t x = m->evicts[i];
            if (x < 0 || x >= p->n_entries)
                return K3_ERR(K3_ERR_FORMAT, "eviction of entry %d of %d, from %s", x, p->n_entries,
                              who);
            if (entry_blk[x] < 0) continue;
            /* rank 0 evicts only entries no running sequence uses: the cache is the one holder
               left, so no block in use is ever freed (checked, not assumed) */
            if (k3_stage_block_holders(st, entry_blk[x]) != 1)
                return K3_ERR(K3_ERR_STATE,
                              "prefix cache: eviction of entry %d would free block %d that %d "
                              "holders still use (from %s)",
                              x, entry_blk[x], k3_stage_block_holders(st, entry_blk[x]), who);
            K3_TRY(k3_stage_block_drop(st, entry_blk[x]));
            entry_blk[x] = -1;
        }
    if (phase == RANK_PC_BEFORE) {
        int32_t blk[RANK_PC_MAX_HIT];
        int64_t k = 0;
        for (int i = 0; i < m->n_hits; i++) {
            const rank_step_hit h = m->hits[i];
            bool bad = bad_slot(p, states, h.slot) || h.snap < 0 || h.snap >= p->n_snaps ||
                       h.n_blocks < 1 || h.n_blocks > p->max_blocks ||
                       h.n_blocks > (int)K3_ARRAY_LEN(blk) || k + h.n_blocks > m->n_hit_entries;
            for (int j = 0; !bad && j < h.n_blocks; j++) {
                const int32_t x = m->hit_entries[k + j];
                bad = x < 0 || x >= p->n_entries;
                if (!bad) blk[j] = entry_blk[x];
            }
            if (bad)
                return K3_ERR(K3_ERR_FORMAT,
                              "prefix-cache hit (slot %d, snapshot %d, %d blocks) out of range, "
                              "from %s",
                              h.slot, h.snap, h.n_blocks, who);
            k += h.n_blocks;
            K3_TRY(k3_seq_state_restore(states[h.slot], (int64_t)h.n_blocks * K3_KV_BLOCK, blk,
                                        h.snap));
        }
        if (k != m->n_hit_entries)
            return K3_ERR(K3_ERR_FORMAT, "prefix-cache hits name %lld of %d entries, from %s",
                          (long long)k, m->n_hit_entries, who);
    }
    if (phase == RANK_PC_AFTER) {
        for (int i = 0; i < m->n_saves; i++) {
            const rank_step_save v = m->saves[i];
            if (bad_slot(p, states, v.slot) || v.block < 0 || v.block >= p->max_blocks ||
                v.entry < 0 || v.entry >= p->n_entries)
                return K3_ERR(K3_ERR_FORMAT,
                              "prefix-cache save (slot %d, block %d, entry %d) out of range, "
                              "from %s",
                              v.slot, v.block, v.entry, who);
            const int32_t b = k3_seq_state_block(states[v.slot], v.block);
            if (b >= 0) K3_TRY(k3_stage_block_hold(st, b));
            entry_blk[v.entry] = b;
        }
        for (int i = 0; i < m->n_snaps; i++) {
            const rank_step_snap v = m->snaps[i];
            if (bad_slot(p, states, v.slot) || v.snap < 0 || v.snap >= p->n_snaps)
                return K3_ERR(K3_ERR_FORMAT,
                              "prefix-cache snapshot (slot %d, snapshot %d) out of range, from %s",
                              v.slot, v.snap, who);
            K3_TRY(k3_stage_snapshot(st, states[v.slot], v.snap));
        }
    }
    return K3_OK;
}
