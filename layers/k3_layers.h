/* layers — the per-stage forward of Kimi-K3: embedding, KDA (§2), MLA (NoPE, absorbed, output
 * gate; §3), Attention Residuals (§1.2-1.3), dense SiTU/SwiGLU FFN (§4.2), the MoE layer through
 * experts/ (§4.3), final mix + norm + LM head (§5). K3-MODEL.md is the math.
 *
 * Owns: k3_stage (a contiguous range of layers [layer_begin, layer_end) plus the embedding when
 * first and the head when last: f32 copies of the small vectors, all scratch, sized at create);
 * k3_seq_state (one sequence's caches for the stage's layers: MLA latent cache, KDA conv and
 * recurrent state, position). Memory is allocated at create; k3_stage_forward never allocates.
 * Callers must not: call MPI here (the MoE exchange hook is how experts elsewhere are reached),
 * share one k3_stage between threads concurrently, or create a k3_seq_state while a forward of
 * the same stage runs (it may grow the stage's attention scratch).
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
#include "k3_kernels.h"
#include "k3_model.h"

typedef struct k3_stage k3_stage; /* layers [layer_begin, layer_end) + embed/head if owned */
typedef struct k3_seq_state k3_seq_state; /* one sequence's caches for the stage's layers:
                                             MLA latent cache [n_mla, T_max, kv_lora+rope], KDA conv
                                             state [n_kda, 3 (q,k,v), K-1, P] and recurrent state
                                             [n_kda, H, dk, dv] fp32, position count */

#define K3_KDA_CHUNK_DEFAULT                                                                       \
    1 /* recurrent KDA (see "Determinism" above); 16 is the chunk llama.cpp uses */

typedef struct k3_stage_params {
    const k3_config *cfg;
    const k3_weights_view *w;
    const k3_ops *ops; /* NULL = k3_ops_default() */
    int layer_begin, layer_end;
    bool first, last;   /* first: embeds token ids; last: final mix/norm/head */
    int64_t max_tokens; /* max tokens per forward call (sizes scratch) */
    int n_threads;      /* cpu pool threads (k3_kernels_set_threads); <= 0 = leave as is */
    int kda_chunk;      /* KDA form: 0 = default (K3_KDA_CHUNK_DEFAULT), 1 = recurrent
                           everywhere (bit-identical across chunkings), C >= 2 = chunked
                           form on full chunks of C tokens of a run, recurrent tail */
} k3_stage_params;

k3_status k3_stage_create(const k3_stage_params *p, k3_stage **out);
void k3_stage_destroy(k3_stage *s);
const k3_stage_params *k3_stage_get_params(const k3_stage *s);

k3_status k3_seq_state_create(const k3_stage *s, int64_t max_ctx, k3_seq_state **out);
void k3_seq_state_destroy(k3_seq_state *st);
void k3_seq_state_reset(k3_seq_state *st);
int64_t k3_seq_state_pos(const k3_seq_state *st); /* tokens consumed so far */
int64_t k3_seq_state_max_ctx(const k3_seq_state *st);
size_t k3_seq_state_bytes(const k3_seq_state *st);

/* A batch: n_seqs sequences, sequence i contributes n_tokens[i] >= 1 consecutive tokens (prefill
 * chunk or 1 for decode); tokens of all sequences are concatenated, T = Σ n_tokens. A sequence
 * appears at most once per batch. */
typedef struct k3_batch {
    int n_seqs;
    k3_seq_state **states;    /* [n_seqs] */
    const int32_t *n_tokens;  /* [n_seqs] */
    const int32_t *token_ids; /* [T]; used by the first stage only */
} k3_batch;

/* The activation handed from stage to stage: current hidden/partial sum + the AttnRes bank. */
typedef struct k3_activ {
    int64_t T;
    int n_bank;  /* banked block states so far (0..k3_activ_max_bank(cfg)) */
    float *h;    /* [T, D] */
    float *bank; /* [max_bank, T, D] (slab i at bank + i·T·D), first n_bank valid */
} k3_activ;
int k3_activ_max_bank(const k3_config *cfg); /* ceil(n_layers / block_size), 0 without AttnRes */
/* Allocate h [max_tokens, D] and bank [max_bank, max_tokens, D]; T = n_bank = 0. */
k3_status k3_activ_alloc(k3_activ *a, const k3_config *cfg, int64_t max_tokens);
void k3_activ_free(k3_activ *a);

/* MoE exchange hook: at each MoE layer, after routing and the latent down-projection, the stage
 * hands the n = T·K rows (slot order t*K + k) of latent vectors [n, L] and their expert ids [n]
 * to `run`, which must fill out[n, L] with the UNWEIGHTED expert outputs (wherever the experts
 * live). NULL hook = compute locally (all experts present: the single-process path). */
typedef struct k3_moe_exchange {
    k3_status (*run)(void *ctx, int layer, const float *rows, const int32_t *expert, int64_t n,
                     float *out);
    void *ctx;
} k3_moe_exchange;

/* Run the stage's layers on the batch. First stage: reads token ids, writes act->h (and bank).
 * Other stages: read act (from the previous stage). Last stage: writes logits:
 * all_logits ? [T, V] : [n_seqs, V] (each sequence's last token). Advances each state's
 * position. On error the states are left as they were before the call only for argument errors
 * (checked up front); a failure in the middle leaves them undefined (reset them). */
k3_status k3_stage_forward(k3_stage *s, const k3_batch *b, k3_activ *act, const k3_moe_exchange *ex,
                           bool all_logits, float *logits);

/* Optional debugging tap: after each layer l, copy act->h [T, D] (for per-layer golden reports). */
typedef void (*k3_layer_tap)(void *ctx, int layer, const float *h, int64_t T, int64_t D);
void k3_stage_set_tap(k3_stage *s, k3_layer_tap tap, void *ctx);

#endif /* K3_LAYERS_H */
