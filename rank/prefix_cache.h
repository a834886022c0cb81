/* prefix_cache.h — private to rank/: the prefix cache (docs/DESIGN.md §3c). Rank 0 keeps one
 * index per lane (rank_pcache) and decides every hit, insertion, snapshot and eviction; it writes
 * each decision as an op into the lane's next step message (wire.h rank_step sections), and every
 * stage of the lane applies the ops to its own blocks and snapshots (rank_pc_apply), in message
 * order, so all stages agree without another message.
 *
 * An entry is one full block of K3_KV_BLOCK tokens whose prefix is cached: its parent entry (the
 * block before it; -1 for the first), its tokens (compared on lookup, so a hit means the whole
 * prefix matches, not just a hash), the running sequences that use it, an LRU stamp and maybe a
 * snapshot (the KDA + short-conv states at its end). Blocks are chained by a hash that covers the
 * parent's hash. A new sequence takes the longest cached chain that ends in a snapshot and leaves
 * at least one prompt token to run. Eviction takes the least recently used entry no running
 * sequence uses; since a sequence uses the whole chain above each entry it uses, such an entry's
 * descendants are unused too, and leaves go first (an entry with children is never evicted), so
 * no chain ever points at a reused entry. Snapshots are evicted on their own (LRU) when their pool
 * is full: a restore copies one, so nothing holds it.
 * Snapshot points: every `snap_every` blocks, the last block boundary before a prompt's last token
 * (the same prompt again hits there) and the prompt's end when it is a whole number of blocks (the
 * next turn of a conversation finds its whole history); the scheduler ends prefill chunks there
 * (rank_pc_next_cut), since a snapshot is taken at the end of a step. */
#ifndef K3_RANK_PREFIX_CACHE_H
#define K3_RANK_PREFIX_CACHE_H

#include "k3_base.h"
#include "k3_layers.h"
#include "wire.h"

#include <stdbool.h>
#include <stdint.h>

/* The ops, sections of a step message (wire.h rank_step): before the forward, evictions (the
 * cache drops an entry's block) and hits (the sequence just OPENed in a slot starts at n blocks:
 * their entries' blocks and a snapshot); after it, saves (an entry holds block j of the slot's
 * sequence) and snapshots (a snapshot := the slot's states, at a block boundary). Forks (the
 * sequence in slot child becomes a copy of the one in slot parent: k3_seq_state_fork) are a
 * section of their own, written by the scheduler, which runs with the prefix cache off too
 * (rank_pc_fork is the index's side of it). */
/* rank_pc_apply's phases: evictions (after the freed slots), forks (after the evictions, before
 * the OPEN resets), before the forward (hits), after it (saves, snapshots). */
enum { RANK_PC_EVICTS = 0, RANK_PC_FORKS, RANK_PC_BEFORE, RANK_PC_AFTER };

typedef struct rank_pc_params {
    int n_entries;      /* blocks the cache may hold (--prefix-cache-tokens / K3_KV_BLOCK) */
    int n_snaps;        /* snapshot pool of each stage */
    int snap_every;     /* blocks between periodic snapshots */
    int max_seqs;       /* slots of the lane */
    int max_blocks;     /* blocks of the longest sequence (max_ctx) */
    int64_t max_tokens; /* tokens of one step of the lane */
} rank_pc_params;
/* The longest hit, in blocks (a HIT op's length). */
#define RANK_PC_MAX_HIT 4096

typedef struct rank_pcache rank_pcache;
k3_status rank_pc_create(const rank_pc_params *p, rank_pcache **out);
void rank_pc_destroy(rank_pcache *c);

/* The hit a new sequence of ids[0, n) would get now, in tokens (a multiple of K3_KV_BLOCK, at
 * most n - 1), and how many entries of that chain no running sequence uses (they stop being
 * evictable when it starts). No side effects. */
int64_t rank_pc_lookup(const rank_pcache *c, const int32_t *ids, int64_t n, int *n_unused);
/* Entries held (each holds one block of the lane) and how many of them could be evicted now. */
int rank_pc_blocks(const rank_pcache *c);
int rank_pc_evictable(const rank_pcache *c);
int64_t rank_pc_evictions(const rank_pcache *c); /* entries evicted so far */
/* Evict the least recently used unused entry (an EVICT op); false when none is left. */
bool rank_pc_evict_one(rank_pcache *c);

/* A sequence starts in slot: with allow_hit, it takes the hit rank_pc_lookup gives (a HIT op;
 * its entries are used until rank_pc_end). *hit_tokens: where its prefill starts. */
k3_status rank_pc_begin(rank_pcache *c, int slot, const int32_t *ids, int64_t n, bool allow_hit,
                        int64_t *hit_tokens);
/* The step about to be sent feeds the slot's sequence up to position `to` (tokens: the prompt
 * [P] then the generated ids): every block it completes joins the cache (SAVE) or the existing
 * entry of the same prefix, and at a snapshot point `to` the last entry gets a snapshot (SNAP).
 * *moved: the sequence's own blocks the cache now holds (its reservation shrinks by as many). */
k3_status rank_pc_advance(rank_pcache *c, int slot, const int32_t *prompt, int64_t P,
                          const int32_t *gen, int64_t to, int *moved);
/* The sequence in slot child is forked from the one in slot parent (the child just begun, with
 * no hit): it uses the parent's chain, and caches no more than the parent would.
 * Writes no op (the scheduler writes the FORK op, which also runs without a prefix cache). */
void rank_pc_fork(rank_pcache *c, int parent, int child);
/* Blocks of the slot's sequence the cache holds (its chain). */
int rank_pc_chain(const rank_pcache *c, int slot);
/* The slot's sequence ended: the entries it used may be evicted again. */
void rank_pc_end(rank_pcache *c, int slot);
/* Where the prefill of a sequence at fed (prompt P) should end its chunk: the next snapshot point
 * after fed, or INT64_MAX when none is left in the prompt. */
int64_t rank_pc_next_cut(const rank_pcache *c, int64_t fed, int64_t P);
/* The ops decided since the last take into m's evicts, hits, hit_entries, saves and snaps (they
 * point into the cache until rank_pc_ops_clear), for the lane's next message. */
void rank_pc_ops(const rank_pcache *c, rank_step *m);
void rank_pc_ops_clear(rank_pcache *c);

/* A stage applies a message's ops in phases (rank/worker.c): RANK_PC_EVICTS after the freed
 * slots, RANK_PC_FORKS next (the forks section: with or without a prefix cache), before the OPEN
 * resets; RANK_PC_BEFORE (hits) after those, before the forward; RANK_PC_AFTER after it (saves,
 * snapshots). entry_blk [n_entries]: the stage's block of each entry (-1: none or no MLA layers
 * here; NULL without a prefix cache: then only forks are allowed); states [max_seqs] by slot. Ops
 * out of range are K3_ERR_FORMAT naming `who`. */
k3_status rank_pc_apply(k3_stage *st, const rank_pc_params *p, int32_t *entry_blk,
                        k3_seq_state *const *states, const rank_step *m, int phase,
                        const char *who);

#endif /* K3_RANK_PREFIX_CACHE_H */
