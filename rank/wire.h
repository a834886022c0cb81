/* wire.h — the typed payloads rank/ puts on the wire (comm/ carries them as opaque meta bytes
 * behind its own versioned header, so comm knows nothing of steps, tokens or the AttnRes bank).
 *
 * BATCH, ACTIV, LOGITS: one k3_wire_step (magic, version, kind, the meta's length), then the step
 * meta: int32 words described by one struct, rank_step (below): a header (group, step,
 * all_logits and the count of every section) and then each section, a typed array, in the order
 * of RANK_STEP_SECTIONS. rank_step_encode / rank_step_decode (wire.c) are the only code that
 * knows where a word sits. f32 = ACTIV: h [T, D] | bank [n_bank, T, D]; LOGITS: [R, V] |
 * [T_plp, K3_PLP_REC]; BATCH: none.
 * PROGRESS: one k3_wire_progress (the load heartbeat: workers -> rank 0, rank 0 -> every worker).
 * STOP: no payload. Bump K3_WIRE_VERSION on any change of these layouts; a receiver refuses another
 * version, naming the sender. */
#ifndef K3_RANK_WIRE_H
#define K3_RANK_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "k3_base.h"

#define K3_WIRE_MAGIC 0x5053334bu /* "K3SP" little-endian: a k3 step message */
#define K3_WIRE_VERSION                                                                            \
    12 /* 2: slots + OPEN/WANT flags; 3: the progress heartbeat; 4: NF flag;                       \
          5: per-stage busy time on ACTIV/LOGITS; 6: freed slots (paged cache);                    \
          7: prompt logprobs (PLP flag, targets, records); 8: prefix-cache ops;                    \
          9: the FORK op (n > 1 choices of one prefill), with the prefix cache off too;            \
          10: the typed step meta (rank_step sections; magic and length in the header);            \
          11: n_pad and graph_fell (captured decode steps) in the meta's header;                   \
          12: moe_host (the round's MoE route) in the meta's header */

typedef struct k3_wire_step {
    uint32_t magic;   /* K3_WIRE_MAGIC */
    uint32_t version; /* K3_WIRE_VERSION */
    uint32_t kind;    /* the k3_msg_kind it was made for */
    int32_t n_meta;   /* int32 words of the step meta after this struct (rank_step_words) */
    int64_t T;        /* tokens of the step */
    int64_t D;        /* floats per f32 row (hidden size; vocab size for LOGITS) */
    int64_t R;        /* f32 rows (ACTIV: T; LOGITS: rows sent; BATCH: 0) */
    int32_t n_bank;   /* ACTIV: AttnRes slabs after h */
    int32_t pad;      /* zero */
} k3_wire_step;
_Static_assert(sizeof(k3_wire_step) == 48 && offsetof(k3_wire_step, n_meta) == 12 &&
                   offsetof(k3_wire_step, T) == 16 && offsetof(k3_wire_step, n_bank) == 40,
               "k3_wire_step is a wire struct: its layout is part of K3_WIRE_VERSION 12");

/* Load states of a heartbeat. */
#define K3_LOAD_RUNNING 0 /* the sender is still reading its weights */
#define K3_LOAD_DONE    1 /* the sender has loaded (it keeps beating until K3_LOAD_ALL) */
#define K3_LOAD_ALL     2 /* rank 0 -> workers: every rank has loaded; the beats end */
typedef struct k3_wire_progress {
    uint32_t version;     /* K3_WIRE_VERSION */
    int32_t pct;          /* load progress of the sender, 0..100 */
    int32_t state;        /* K3_LOAD_* */
    int32_t pad;          /* zero */
    uint64_t done_bytes;  /* the sender's bytes read so far */
    uint64_t total_bytes; /* the sender's bytes to read */
} k3_wire_progress;
_Static_assert(sizeof(k3_wire_progress) == 32 && offsetof(k3_wire_progress, done_bytes) == 16,
               "k3_wire_progress is a wire struct: its layout is part of K3_WIRE_VERSION 12");

/* ---- the step meta ---------------------------------------------------------------------------
 * Per lane and step. The stages apply a message in this order: the freed slots (their cache
 * blocks back to the pool before the step takes any; a slot opened again later is reset anyway),
 * the prefix cache's evictions, the forks, the OPEN resets, the hits, the forward, then the saved
 * blocks and snapshots (docs/DESIGN.md §3c, §3d). No freed slot is named by a fork of the same
 * message (rank 0 holds such a slot until the message is sent). */
typedef struct rank_step_seq {
    int32_t slot;     /* on the lane */
    int32_t n_tokens; /* >= 1 */
    int32_t flags;    /* K3_WIRE_* below */
} rank_step_seq;
typedef struct rank_step_fork { /* the sequence in slot child becomes a copy of slot parent's */
    int32_t parent, child;
} rank_step_fork;
typedef struct rank_step_hit { /* the sequence just OPENed in slot starts at n_blocks blocks: */
    int32_t slot, snap;        /* the entries' blocks (the next n_blocks of hit_entries) and */
    int32_t n_blocks;          /* snapshot snap */
} rank_step_hit;
typedef struct rank_step_save { /* entry holds block `block` of the slot's sequence */
    int32_t slot, block, entry;
} rank_step_save;
typedef struct rank_step_snap { /* snapshot snap := the slot's states (at a block boundary) */
    int32_t slot, snap;
} rank_step_snap;

/* The sections, in wire order: name, element type. */
#define RANK_STEP_SECTIONS(X)                                                                      \
    X(seqs, rank_step_seq)   /* the lane's sequences in the step */                                \
    X(freed, int32_t)        /* slots whose sequences ended since the lane's last message */       \
    X(forks, rank_step_fork) /* n > 1 choices of one prefill (with the prefix cache off too) */    \
    X(evicts, int32_t)       /* prefix-cache entries whose blocks the cache drops */               \
    X(hits, rank_step_hit)                                                                         \
    X(hit_entries, int32_t) /* the hits' entries, hit after hit */                                 \
    X(saves, rank_step_save)                                                                       \
    X(snaps, rank_step_snap)                                                                       \
    X(tokens, int32_t)  /* BATCH: the step's token ids [T], sequence after sequence */             \
    X(busy_us, int32_t) /* ACTIV, LOGITS: each stage's forward microseconds [S] (0 downstream) */  \
    X(targets, int32_t) /* the PLP sequences' target ids, one per row (K3_WIRE_PLP) */

typedef struct rank_step {
    int32_t group, step, all_logits;
    /* Captured decode steps (docs/DESIGN.md §5, capture-decision protocol): n_pad > 0 is rank 0's
       decision that every stage of the lane runs this decode step as the CUDA graph of n_pad
       rows (captured at its first step of that size, replayed after): the batch padded to n_pad
       rows, ACTIV carrying all n_pad rows; 0: eager. graph_fell (ACTIV, LOGITS): some stage of
       the lane could not capture it and ran it eagerly (rank 0 stops choosing n_pad). */
    int32_t n_pad, graph_fell;
    /* The MoE route of the step's scheduling round (docs/DESIGN.md §5, route decision), rank 0's
       decision for every lane of the group alike (the lanes of a stage make the same exchange
       calls): 1: the host-routed exchange (a round with any prefill row: no capacity, counts
       of any size); 0: the device route where the stage has it (k3_stage_set_moe_host). A
       host-routed round has n_pad 0 on every lane (its host reads cannot be captured). */
    int32_t moe_host;
#define RANK_STEP_FIELD(name, type)                                                                \
    int32_t n_##name;                                                                              \
    const type *name;
    RANK_STEP_SECTIONS(RANK_STEP_FIELD)
#undef RANK_STEP_FIELD
} rank_step;

/* int32 words of m on the wire. */
int64_t rank_step_words(const rank_step *m);
/* m into out[rank_step_words(m)]. */
void rank_step_encode(const rank_step *m, int32_t *out);
/* in[n] into *m (its sections point into in): K3_ERR_FORMAT naming `who` when the header's counts
 * are negative or do not add up to n. The values are the receiver's to check. */
k3_status rank_step_decode(const int32_t *in, int64_t n, rank_step *m, const char *who);

/* Sequence flags. OPEN: a new sequence starts in this slot (the worker resets the slot's caches;
 * this is how workers learn of sequences — there is no separate message, so an OPEN can never
 * overtake or trail the step it belongs to). WANT: its last row of the step is sampled (the
 * last stage returns it). A sequence that ends is named in the next step's freed section. */
#define K3_WIRE_WANT 1
#define K3_WIRE_OPEN 2
/* NF: a NaN/Inf appeared in the sequence's activations in this step; the bits from
 * K3_WIRE_NF_SHIFT up hold k3_nf_code(layer, op) of the first sub-block that produced one (set by
 * the first stage that saw it, carried on by the next ones; the coordinator fails the request
 * naming it). */
#define K3_WIRE_NF       4
#define K3_WIRE_NF_SHIFT 8
/* PLP: prompt logprobs. The last stage computes logits for every row of the sequence in this step
 * (the step's rows are all computed when any sequence has the flag) and returns, for each, one
 * record of K3_PLP_REC floats after the [R, V] rows: [log p(target), its rank (1 + the ids with a
 * larger logit), top ids (exact in f32 below 2^24), their logprobs], log-softmax of the raw logits,
 * best first, ties lower id first. The target of a row is the prompt token after it (-1: none; its
 * logprob is NaN); the targets of the step's PLP sequences, in sequence order, ride in every
 * message's targets section (T_plp = their tokens). */
#define K3_WIRE_PLP 8
#define K3_PLP_TOP  20
#define K3_PLP_REC  (2 + 2 * K3_PLP_TOP)

#endif /* K3_RANK_WIRE_H */
