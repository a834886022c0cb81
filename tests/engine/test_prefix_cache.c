/* test_prefix_cache.c — rank 0's prefix-cache index (rank/prefix_cache.h), alone:
 *  - a chain inserted block by block is found again only for the same whole prefix (a prompt
 *    that differs in its first block finds nothing, even with the same later blocks), and a hit
 *    ends at the deepest snapshot with at least one prompt token after it;
 *  - snapshot points: every snap_every blocks and the last block boundary of the prompt; the
 *    chunk cut lands on them;
 *  - eviction under a small budget: least recently used first, leaves before their parents, never
 *    an entry a running sequence uses (filling the budget with in-use entries stops caching
 *    instead), and the eviction ops name exactly the entries dropped;
 *  - the ops a stage applies (rank_pc_apply) are checked for range.
 * Token ids come from a printed seed. */
#include "k3_test.h"
#include "prefix_cache.h"

#include <string.h>

enum { B = K3_KV_BLOCK, SLOTS = 4, MAXB = 16 };

enum { OP_EVICT, OP_HIT, OP_SAVE, OP_SNAP };
/* Ops of a kind decided since the last take, and the last one's entry (EVICT) or slot. */
static int count_ops(const rank_pcache *c, int kind, int32_t *last_arg) {
    rank_step m = {0};
    rank_pc_ops(c, &m);
    const int n = kind == OP_EVICT  ? m.n_evicts
                  : kind == OP_HIT  ? m.n_hits
                  : kind == OP_SAVE ? m.n_saves
                                    : m.n_snaps;
    if (last_arg && n > 0)
        *last_arg = kind == OP_EVICT  ? m.evicts[n - 1]
                    : kind == OP_HIT  ? m.hits[n - 1].slot
                    : kind == OP_SAVE ? m.saves[n - 1].slot
                                      : m.snaps[n - 1].slot;
    return n;
}

int main(void) {
    const uint64_t seed = 31;
    printf("test_prefix_cache seed %llu\n", (unsigned long long)seed);
    k3_rng rng;
    k3_rng_seed(&rng, seed);
    int32_t a[10 * B], b[10 * B];
    for (int i = 0; i < 10 * B; i++) a[i] = (int32_t)(k3_rng_u64(&rng) % 30000);
    memcpy(b, a, sizeof a);
    b[3] ^= 1; /* b differs from a in its first block only */
    rank_pc_params p = {.n_entries = 6,
                        .n_snaps = 2,
                        .snap_every = 2,
                        .max_seqs = SLOTS,
                        .max_blocks = MAXB,
                        .max_tokens = 8 * B};
    rank_pcache *c;
    K3_CHECK_OK(rank_pc_create(&p, &c));
    if (k3_t_fail) return k3_test_done("prefix_cache");
    int64_t hit;
    int moved, unused;
    /* the snapshot points of a 5.5-block prompt: block 2, 4 (every 2) and 5 (its last boundary) */
    const int64_t P = 5 * B + 30;
    K3_CHECK(rank_pc_next_cut(c, 0, P) == 2 * B && rank_pc_next_cut(c, 2 * B, P) == 4 * B &&
                 rank_pc_next_cut(c, 4 * B, P) == 5 * B &&
                 rank_pc_next_cut(c, 5 * B, P) == INT64_MAX,
             "cuts %lld %lld %lld", (long long)rank_pc_next_cut(c, 0, P),
             (long long)rank_pc_next_cut(c, 2 * B, P), (long long)rank_pc_next_cut(c, 4 * B, P));
    /* sequence 0 (slot 0) prefills a in cuts: 5 blocks saved, snapshots at 2, 4, 5 (2 slots:
       the oldest, at 2, is taken for 5) */
    K3_CHECK_OK(rank_pc_begin(c, 0, a, P, true, &hit));
    K3_CHECK(hit == 0, "empty cache hit %lld", (long long)hit);
    int64_t fed = 0, saved = 0;
    while (fed < P) {
        int64_t to = K3_MIN(rank_pc_next_cut(c, fed, P), P);
        K3_CHECK_OK(rank_pc_advance(c, 0, a, P, NULL, to, &moved));
        saved += moved, fed = to;
    }
    K3_CHECK(saved == 5 && rank_pc_blocks(c) == 5 && count_ops(c, OP_SAVE, NULL) == 5 &&
                 count_ops(c, OP_SNAP, NULL) == 3 && rank_pc_evictable(c) == 0,
             "saved %lld, %d blocks, %d SAVE, %d SNAP", (long long)saved, rank_pc_blocks(c),
             count_ops(c, OP_SAVE, NULL), count_ops(c, OP_SNAP, NULL));
    rank_pc_ops_clear(c);
    /* a (longer: 8 blocks) finds 5 blocks: snapshot at 5; the first 5 blocks of a exactly: 4
       (one token must be left to run); b finds nothing */
    K3_CHECK(rank_pc_lookup(c, a, 8 * B, &unused) == 5 * B && unused == 0, "a: %lld",
             (long long)rank_pc_lookup(c, a, 8 * B, NULL));
    K3_CHECK(rank_pc_lookup(c, a, 5 * B, NULL) == 4 * B, "a[0, 5 blocks): %lld",
             (long long)rank_pc_lookup(c, a, 5 * B, NULL));
    K3_CHECK(rank_pc_lookup(c, b, 8 * B, NULL) == 0, "b (other first block) hit %lld",
             (long long)rank_pc_lookup(c, b, 8 * B, NULL));
    /* sequence 0 ends: all 5 evictable; sequence 1 takes the hit of 5 blocks (a HIT op) */
    rank_pc_end(c, 0);
    K3_CHECK(rank_pc_evictable(c) == 5, "evictable %d", rank_pc_evictable(c));
    K3_CHECK_OK(rank_pc_begin(c, 1, a, 8 * B, true, &hit));
    int32_t hslot = -1;
    K3_CHECK(hit == 5 * B && count_ops(c, OP_HIT, &hslot) == 1 && hslot == 1 &&
                 rank_pc_evictable(c) == 0,
             "hit %lld, evictable %d", (long long)hit, rank_pc_evictable(c));
    /* it grows to 8 blocks: one more fits the budget of 6, then everything is in use: stop */
    K3_CHECK_OK(rank_pc_advance(c, 1, a, 8 * B + 1, NULL, 8 * B, &moved));
    K3_CHECK(moved == 1 && rank_pc_blocks(c) == 6 && !rank_pc_evict_one(c), "moved %d blocks %d",
             moved, rank_pc_blocks(c));
    rank_pc_ops_clear(c);
    /* sequence 2 on b (unused nothing): no room, nothing evicted, nothing saved */
    K3_CHECK_OK(rank_pc_begin(c, 2, b, 3 * B + 1, true, &hit));
    K3_CHECK_OK(rank_pc_advance(c, 2, b, 3 * B + 1, NULL, 3 * B, &moved));
    K3_CHECK(hit == 0 && moved == 0 && count_ops(c, OP_EVICT, NULL) == 0,
             "in-use entries evicted: %d", count_ops(c, OP_EVICT, NULL));
    rank_pc_end(c, 2);
    /* sequence 1 ends: sequence 3 on b evicts the LRU leaf (a's block 5, the deepest) first,
       never a parent before its child */
    rank_pc_end(c, 1);
    rank_pc_ops_clear(c);
    K3_CHECK_OK(rank_pc_begin(c, 3, b, 2 * B + 1, true, &hit));
    K3_CHECK_OK(rank_pc_advance(c, 3, b, 2 * B + 1, NULL, 2 * B, &moved));
    int32_t ev = -1;
    K3_CHECK(moved == 2 && count_ops(c, OP_EVICT, &ev) == 2 && rank_pc_blocks(c) == 6,
             "moved %d evicted %d", moved, count_ops(c, OP_EVICT, NULL));
    /* a now hits 4 blocks (its blocks 5 and 6 went: leaves first; the snapshot at 4 remains) */
    K3_CHECK(rank_pc_lookup(c, a, 8 * B, NULL) == 4 * B, "a after eviction: %lld",
             (long long)rank_pc_lookup(c, a, 8 * B, NULL));
    rank_pc_end(c, 3);
    /* ops out of range are refused by a stage before they touch anything */
    const rank_step_save bad_save = {.slot = SLOTS};
    k3_seq_state *states[SLOTS] = {0};
    int32_t eb[6];
    const rank_step m_save = {.n_saves = 1, .saves = &bad_save};
    K3_CHECK_ERR(rank_pc_apply(NULL, &p, eb, states, &m_save, RANK_PC_AFTER, "test"), K3_ERR_FORMAT,
                 "out of range");
    const rank_step_hit empty_hit = {.slot = 0, .snap = 0, .n_blocks = 0};
    const rank_step m_hit = {.n_hits = 1, .hits = &empty_hit};
    K3_CHECK_ERR(rank_pc_apply(NULL, &p, eb, states, &m_hit, RANK_PC_BEFORE, "test"), K3_ERR_FORMAT,
                 "out of range");
    const rank_step_hit short_hit = {.slot = 0, .snap = 0, .n_blocks = 2};
    const int32_t one_entry = 0;
    const rank_step m_short = {
        .n_hits = 1, .hits = &short_hit, .n_hit_entries = 1, .hit_entries = &one_entry};
    K3_CHECK_ERR(rank_pc_apply(NULL, &p, eb, states, &m_short, RANK_PC_BEFORE, "test"),
                 K3_ERR_FORMAT, "out of range");
    const int32_t bad_evict = 6;
    const rank_step m_evict = {.n_evicts = 1, .evicts = &bad_evict};
    K3_CHECK_ERR(rank_pc_apply(NULL, &p, eb, states, &m_evict, RANK_PC_EVICTS, "test"),
                 K3_ERR_FORMAT, "eviction of entry 6");
    K3_CHECK_ERR(rank_pc_apply(NULL, &p, NULL, states, &m_evict, RANK_PC_EVICTS, "test"),
                 K3_ERR_FORMAT, "the prefix cache is off");
    rank_pc_destroy(c);
    return k3_test_done("prefix_cache");
}
