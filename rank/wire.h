/* wire.h — the typed payloads rank/ puts on the wire (comm/ carries them as opaque meta bytes
 * behind its own versioned header, so comm knows nothing of steps, tokens or the AttnRes bank).
 *
 * BATCH, ACTIV, LOGITS: one k3_wire_step, then int32 meta[n_meta] =
 *   [group, step, all_logits, n_seqs, n_free, n_pc, (slot, n_tokens, flags) x n_seqs, freed slot x
 * n_free, prefix-cache op words x n_pc, (BATCH) token ids x T | (ACTIV, LOGITS) busy us x S]; f32 =
 * ACTIV: h [T, D] | bank [n_bank, T, D]; LOGITS: [R, V] | [T_plp, K3_PLP_REC]; BATCH: none. Every
 * message's meta ends with the T_plp target ids of its PLP sequences (K3_WIRE_PLP below).
 * PROGRESS: one k3_wire_progress (the load heartbeat: workers -> rank 0, rank 0 -> every worker).
 * STOP: no payload. Bump K3_WIRE_VERSION on any change of these layouts; a receiver refuses another
 * version, naming the sender. */
#ifndef K3_RANK_WIRE_H
#define K3_RANK_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define K3_WIRE_VERSION                                                                            \
    9 /* 2: slots + OPEN/WANT flags; 3: the progress heartbeat; 4: NF flag;                        \
         5: per-stage busy time on ACTIV/LOGITS; 6: freed slots (paged cache);                     \
         7: prompt logprobs (PLP flag, targets, records); 8: prefix-cache ops;                     \
         9: the FORK op (n > 1 choices of one prefill), with the prefix cache off too */

typedef struct k3_wire_step {
    uint32_t version; /* K3_WIRE_VERSION */
    uint32_t kind;    /* the k3_msg_kind it was made for */
    int64_t T;        /* tokens of the step */
    int64_t D;        /* floats per f32 row (hidden size; vocab size for LOGITS) */
    int64_t R;        /* f32 rows (ACTIV: T; LOGITS: rows sent; BATCH: 0) */
    int32_t n_bank;   /* ACTIV: AttnRes slabs after h */
    int32_t n_meta;   /* int32 entries after this struct */
} k3_wire_step;
_Static_assert(sizeof(k3_wire_step) == 40 && offsetof(k3_wire_step, T) == 8 &&
                   offsetof(k3_wire_step, n_bank) == 32 && offsetof(k3_wire_step, n_meta) == 36,
               "k3_wire_step is a wire struct: its layout is part of K3_WIRE_VERSION 3");

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
               "k3_wire_progress is a wire struct: its layout is part of K3_WIRE_VERSION 3");

#define META_HDR 6 /* group, step, all_logits, n_seqs, n_free, n_pc */
#define META_SEQ 3 /* per sequence: slot (on the lane), n_tokens, flags */
/* The int32s before a message's tail (token ids, or the stages' busy times): the header, the
 * sequences, then n_free slots whose sequences ended (each stage returns their cache blocks to
 * its pool before the step; a slot opened again later is reset anyway), then n_pc words of
 * prefix-cache ops for the lane (rank/prefix_cache.h: every stage applies them, in order; FORK
 * ops, which copy a sequence into a new slot, come with the prefix cache off too, applied first).
 */
#define META_PREFIX(n_seqs, n_free, n_pc) (META_HDR + META_SEQ * (n_seqs) + (n_free) + (n_pc))
/* Meta of a message: META_HDR | META_SEQ per sequence | then BATCH: the T token ids; ACTIV and
 * LOGITS: S int32, the microseconds each stage of the lane spent in its forward of this step
 * (the stages downstream of the sender still 0). The coordinator gets every rank's step time from
 * the LOGITS without another message. */
/* Sequence flags. OPEN: a new sequence starts in this slot (the worker resets the slot's caches;
 * this is how workers learn of sequences — there is no separate message, so an OPEN can never
 * overtake or trail the step it belongs to). WANT: its last row of the step is sampled (the
 * last stage returns it). A sequence that ends is named in the next step's freed slots
 * (META_PREFIX). */
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
 * logprob is NaN); the targets of the step's PLP sequences, in sequence order, end every message's
 * meta (T_plp = their tokens). */
#define K3_WIRE_PLP 8
#define K3_PLP_TOP  20
#define K3_PLP_REC  (2 + 2 * K3_PLP_TOP)

#endif /* K3_RANK_WIRE_H */
