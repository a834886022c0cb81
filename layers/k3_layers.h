/* layers — the per-stage forward of Kimi-K3: embedding, KDA (§2), MLA (NoPE, absorbed, output
 * gate; §3), Attention Residuals (§1.2-1.3), dense SiTU/SwiGLU FFN (§4.2), the MoE layer through
 * experts/ (§4.3), final mix + norm + LM head (§5). K3-MODEL.md is the math.
 *
 * Owns: k3_stage (a contiguous range of layers [layer_begin, layer_end) plus the embedding when
 * first and the head when last: f32 copies of the small vectors, all scratch, sized at create);
 * k3_seq_state (one sequence of the stage: its slot in the slot pool, which holds its KDA conv and
 * recurrent state, its block table into the paged MLA latent cache, its position). Memory comes
 * from the stage's backend (weights, pools, scratch) and is allocated at k3_stage_create (or, for
 * a stage not sized by max_seqs, when k3_seq_state_create grows the pools); k3_stage_forward
 * never allocates. layers/ holds op calls and
 * bookkeeping only: every loop over activations is an op of the backend.
 * The MoE step is driven here, in phases: route and down-project; exchange through the comm
 * handle the stage was given (k3_comm_moe_dispatch); local experts; combine
 * (k3_comm_moe_combine); finish (weighted sum, latent norm, up-projection, shared experts).
 * Without a comm handle every expert is local. No call goes up into rank/.
 * Callers must not: share one k3_stage between threads concurrently, or create a k3_seq_state
 * while a forward of the same stage runs (it may grow the stage's pools).
 *
 * The step (docs/DESIGN.md §3a): k3_stage_forward lays the batch out once as a k3_seqs
 * descriptor (token offsets, positions, state slots, block tables) in one upload with the
 * token ids and the non-finite flags; every op that touches sequences takes it, so a step issues
 * a number of op calls that depends on the stage's layers only, not on how many sequences,
 * tokens or heads it carries. Without a comm handle its only device -> host read is the flags,
 * once at the end; with one, each MoE layer also reads its expert ids and weights once (the
 * exchange's route is built on the host).
 * Paged cache and slots: the MLA latent cache is a pool of blocks of K3_KV_BLOCK tokens per
 * stage, a sequence's positions mapped to blocks by its block table; blocks are taken as it grows
 * and returned when it ends (release, reset, destroy); a pool that runs out fails that forward
 * (K3_ERR_NOMEM naming the sequence) before it changes anything. KDA and short-conv states live
 * in a slot pool, one slot per sequence, indexed by the descriptor.
 *
 * Determinism: with the recurrent KDA form (the default, kda_chunk 0 or 1) every logit is
 * bit-identical for every split of a prompt into prefill chunks / decode steps, every batch
 * composition and every stage split (all reductions are per token, per head or per output
 * element — the kernels' determinism rule). The chunked (WY) KDA form (kda_chunk >= 2) is the
 * same math with other roundings: measured on the tiny preset, it moves layer-0 hidden states by
 * ~3e-7 and logits by ~2e-6 relative (the model amplifies fp32 rounding ~8x over 8 layers), so it
 * is opt-in. On CPU the recurrence is also the cheaper form (dk·dv per token and head). */
#ifndef K3_LAYERS_H
#define K3_LAYERS_H

#include "k3_base.h"
#include "k3_comm.h"
#include "k3_kernels.h"
#include "k3_model.h"

typedef struct k3_stage k3_stage; /* layers [layer_begin, layer_end) + embed/head if owned */
typedef struct k3_seq_state k3_seq_state; /* one sequence of the stage: its slot in the slot
                                             pool (KDA conv state [n_kda, 3 (q,k,v), K-1, P] and
                                             recurrent state [n_kda, H, dk, dv] fp32), its block
                                             table into the paged MLA latent cache, position */

#define K3_KDA_CHUNK_DEFAULT                                                                       \
    1 /* recurrent KDA (see "Determinism" above); 16 is the chunk llama.cpp uses */

typedef struct k3_stage_params {
    const k3_config *cfg;
    const k3_weights_view *w;
    k3_backend *be; /* where weights (already loaded there), states and scratch live; NULL =
                       the stage makes (and owns) a cpu backend of n_threads threads */
    int layer_begin, layer_end;
    bool first, last;   /* first: embeds token ids; last: final mix/norm/head */
    int64_t max_tokens; /* max tokens per forward call (sizes scratch) */
    int n_threads;      /* threads of the stage's own cpu backend (be == NULL); <= 0 = all */
    int kda_chunk;      /* KDA form: 0 = default (K3_KDA_CHUNK_DEFAULT), 1 = recurrent
                           everywhere (bit-identical across chunkings), C >= 2 = chunked
                           form on full chunks of C tokens of a run, recurrent tail */
    /* Expert parallelism: the comm handle of this rank (its stage's EP group) and the owner lane
       of every (layer, expert): expert_lane[layer·n_experts + e] in [0, n_lanes). comm NULL:
       every expert is local (single process, or one lane). */
    k3_comm *comm;
    const int32_t *expert_lane;
    int n_lanes;
    /* Combine mode: true = per-(token, expert) rows summed by the token's lane in slot order
       (bit-identical for every split); false = each owner pre-sums its experts per token (one
       row per (token, owner); less traffic; within K3_TOL_DISTRIBUTED_REL_L2 of it). */
    bool deterministic;
    /* The state pools ("Paged cache and slots" above). max_seqs > 0: max_seqs slots, sequences of
       up to max_ctx tokens, a paged MLA cache of kv_cache_tokens (0: max_seqs × max_ctx), all
       allocated here. max_seqs 0: each k3_seq_state_create grows them (a slot, its max_ctx). */
    int max_seqs;
    int64_t max_ctx;
    int64_t kv_cache_tokens;
    /* Prefix cache ("Prefix cache" below): snapshots of a slot's KDA + short-conv states the
       stage holds (allocated at create; needs max_seqs > 0). 0: none. */
    int n_snapshots;
    /* Captured decode steps (k3_stage_forward_graph; needs max_seqs > 0 and a backend with
       graphs): one more slot and one more cache block, kept out of the pools, for the pad rows. */
    bool graphs;
} k3_stage_params;

k3_status k3_stage_create(const k3_stage_params *p, k3_stage **out);
/* The last stage's logits to host memory with the step's one read (issue 45): with a host buffer
 * set ([max_tokens, V] floats), k3_stage_forward downloads the logits rows it computed into it
 * in the copy that reads the flags and the deferred checks (one host sync for all); then
 * k3_stage_logits_fetched is true until the next forward. NULL (the default): the caller reads
 * the logits itself. */
void k3_stage_set_logits_host(k3_stage *s, float *host);
bool k3_stage_logits_fetched(const k3_stage *s);
void k3_stage_destroy(k3_stage *s);
const k3_stage_params *k3_stage_get_params(const k3_stage *s);

/* A sequence of up to max_ctx tokens: takes a free slot (K3_ERR_STATE when none is left in a
   stage sized by max_seqs); its cache blocks are taken from the pool as it grows. */
k3_status k3_seq_state_create(const k3_stage *s, int64_t max_ctx, k3_seq_state **out);
void k3_seq_state_destroy(k3_seq_state *st); /* its blocks and slot back to the pools */
/* A new sequence in the same slot: blocks returned, position 0 (no op: the forward starts a
 * sequence at position 0 from zero KDA states). */
k3_status k3_seq_state_reset(k3_seq_state *st);
/* The sequence ended: its cache blocks go back to the pool (the slot stays; reset before reuse). */
void k3_seq_state_release(k3_seq_state *st);
/* The paged cache's blocks (K3_KV_BLOCK tokens each): free now, and in all. */
void k3_stage_cache_usage(const k3_stage *s, int *free_blocks, int *total_blocks);
int64_t k3_seq_state_pos(const k3_seq_state *st); /* tokens consumed so far */
int64_t k3_seq_state_max_ctx(const k3_seq_state *st);
size_t k3_seq_state_bytes(const k3_seq_state *st);

/* ---- Prefix cache (docs/DESIGN.md §3c; the index is the caller's, rank/prefix_cache.c) ------
 * A cache block is held by every sequence whose block table names it and, once cached, by the
 * prefix cache: it goes back to the free list when its last holder drops it, so a block a
 * running sequence reads is never freed. A sequence shares only full blocks below its position,
 * which it never writes again. A snapshot is a copy of a slot's KDA recurrent and short-conv
 * states (one range of each pool) taken when the sequence's position is a block boundary;
 * restoring it with the blocks below that boundary gives the state the sequence would have had
 * after prefilling those tokens, bit for bit (test_prefix). Stages without MLA layers have no
 * blocks (-1), stages without KDA layers empty snapshots; both still track positions. */
/* Block j of the sequence's table (-1 without MLA layers or past its blocks). */
int32_t k3_seq_state_block(const k3_seq_state *st, int j);
/* One more holder of block blk (the cache keeps it); K3_ERR_STATE if blk is not in use. */
k3_status k3_stage_block_hold(k3_stage *s, int32_t blk);
/* One holder less; the block goes back to the free list at 0. K3_ERR_STATE if not held. */
k3_status k3_stage_block_drop(k3_stage *s, int32_t blk);
/* Holders of blk (0: free); tests. */
int k3_stage_block_holders(const k3_stage *s, int32_t blk);
/* The sequence's KDA + short-conv states into snapshot snap (stream-ordered copies). */
k3_status k3_stage_snapshot(k3_stage *s, const k3_seq_state *st, int snap);
/* A freshly reset sequence (position 0, no blocks) starts at pos (a multiple of K3_KV_BLOCK):
   it holds blocks[0, pos / K3_KV_BLOCK) (may be NULL on a stage without MLA layers) and its
   states are copied from snapshot snap (ignored on a stage without KDA layers). */
k3_status k3_seq_state_restore(k3_seq_state *st, int64_t pos, const int32_t *blocks, int snap);
/* dst (a slot of the same stage) becomes a copy of src at src's position, for n > 1 choices of
   one prefill: dst's blocks are released, it holds src's full blocks (shared, read-only below the
   position), gets a fresh block with a copy of src's partial last block (copy-on-write: each
   writes its own tokens there; K3_ERR_NOMEM when the pool has none), and copies of src's KDA
   recurrent + short-conv states. Stream-ordered device copies (copy2d). */
k3_status k3_seq_state_fork(k3_seq_state *dst, const k3_seq_state *src);
int k3_stage_n_snapshots(const k3_stage *s);
size_t k3_stage_snapshot_bytes(const k3_stage *s); /* one snapshot */
/* The sequence's states into host memory: conv [n_kda, 3, K-1, P] then recurrent [n_kda, H, dk,
   dv] (k3_stage_snapshot_bytes of them); tests compare them bit for bit. */
k3_status k3_seq_state_read(const k3_seq_state *st, float *out);

/* A batch: n_seqs sequences, sequence i contributes n_tokens[i] >= 1 consecutive tokens (prefill
 * chunk or 1 for decode); tokens of all sequences are concatenated, T = Σ n_tokens. A sequence
 * appears at most once per batch. */
typedef struct k3_batch {
    int n_seqs;
    k3_seq_state **states;    /* [n_seqs] */
    const int32_t *n_tokens;  /* [n_seqs] */
    const int32_t *token_ids; /* [T]; used by the first stage only */
    /* out, may be NULL: per sequence, 0 or k3_nf_code(layer, op) of the first sub-block of this
     * stage whose output held a NaN or Inf in the sequence's rows (checked after the embedding,
     * every mixer, every FFN and the head; each sequence's rows, in order) */
    int32_t *nonfinite; /* [n_seqs] */
} k3_batch;

/* Where a non-finite activation first appeared: the sub-block that produced it. */
typedef enum k3_nf_op {
    K3_NF_EMBED = 1, /* the embedding rows */
    K3_NF_KDA,       /* a KDA mixer's output */
    K3_NF_MLA,       /* an MLA mixer's output */
    K3_NF_MOE,       /* a MoE FFN's output (router, experts, shared experts, combine) */
    K3_NF_DENSE,     /* a dense FFN's output */
    K3_NF_HEAD,      /* the logits (final AttnRes mix, norm, lm_head) */
    K3_NF_OP_COUNT
} k3_nf_op;
#define K3_NF_MAX_LAYER (1 << 20)
static inline int32_t k3_nf_code(int layer, k3_nf_op op) {
    return (int32_t)(((layer + 1) << 4) | (int)op); /* layer -1: the head; never 0 */
}
static inline int k3_nf_layer(int32_t code) {
    return (code >> 4) - 1;
}
static inline k3_nf_op k3_nf_op_of(int32_t code) {
    return (k3_nf_op)(code & 15);
}
/* "MLA attention output", "MoE FFN output", ... */
const char *k3_nf_op_name(k3_nf_op op);

/* The activation handed from stage to stage: current hidden/partial sum + the AttnRes bank. */
typedef struct k3_activ {
    int64_t T;
    int n_bank;  /* banked block states so far (0..k3_activ_max_bank(cfg)) */
    float *h;    /* [T, D] (backend memory) */
    float *bank; /* [max_bank, T, D] (slab i at bank + i·T·D), first n_bank valid */
} k3_activ;
int k3_activ_max_bank(const k3_config *cfg); /* ceil(n_layers / block_size), 0 without AttnRes */
/* Allocate h [max_tokens, D] and bank [max_bank, max_tokens, D] in be; T = n_bank = 0. */
k3_status k3_activ_alloc(k3_backend *be, k3_activ *a, const k3_config *cfg, int64_t max_tokens);
void k3_activ_free(k3_backend *be, k3_activ *a);

/* Run the stage's layers on the batch. First stage: reads token ids (host memory), writes
 * act->h (and bank). Other stages: read act (from the previous stage). Last stage: writes logits
 * (backend memory): all_logits ? [T, V] : [n_seqs, V] (each sequence's last token). Advances each
 * state's position. On error the states are left as they were before the call only for argument
 * errors (checked up front); a failure in the middle leaves them undefined (reset them). */
k3_status k3_stage_forward(k3_stage *s, const k3_batch *b, k3_activ *act, bool all_logits,
                           float *logits);
/* A decode step (every sequence 1 token, logits of each sequence's row) as a CUDA graph
 * (docs/DESIGN.md §5): the batch is padded to n_pad rows (b->n_seqs <= n_pad <= max_seqs) with
 * inert rows (token 0 at position 0 in the stage's pad slot and block: their rows are computed
 * and never read), its descriptor, flags and token ids are uploaded to the step buffer of n_pad
 * (fixed addresses), and the ops from the embedding (or the received activation, [n_pad, D] with
 * its bank) to the logits ([n_pad, V]) run as one graph: captured at the first step of n_pad and
 * launched, replayed at the later ones. Bit-identical to k3_stage_forward's rows (each row's ops
 * read only that row). A capture that fails (a host sync inside it, or inject_sync: a download
 * injected after the ops, the test hook) is dropped, the step runs eagerly, *fell_back is set
 * and n_pad is never captured again on this stage (eager from then on). act->T becomes n_pad.
 * With k3_stage_set_logits_host (last stage), the sequences' rows [n_seqs, V] are copied there
 * with the flags, behind the graph, and the step makes one host sync in all. */
k3_status k3_stage_forward_graph(k3_stage *s, const k3_batch *b, int n_pad, bool inject_sync,
                                 k3_activ *act, float *logits, bool *fell_back);
/* The MoE route of the next steps (docs/DESIGN.md §5, route decision): host true takes the
 * host-routed exchange even where the stage has the device route (cuda + nccl); false (the
 * default) the device route where it has one. Every lane of a stage must choose alike for a step
 * (the exchange calls differ); a captured step needs the device route. */
void k3_stage_set_moe_host(k3_stage *s, bool host);
/* A step in which this lane has no tokens: still take part in every MoE exchange of the stage
 * (the other lanes may route tokens to this lane's experts). No-op without a comm handle. */
k3_status k3_stage_idle_step(k3_stage *s);
k3_backend *k3_stage_backend(const k3_stage *s);

/* Optional debugging tap: after each layer l, a host copy of act->h [T, D] (per-layer golden
 * reports). */
typedef void (*k3_layer_tap)(void *ctx, int layer, const float *h, int64_t T, int64_t D);
k3_status k3_stage_set_tap(k3_stage *s, k3_layer_tap tap, void *ctx);

#endif /* K3_LAYERS_H */
