/* layers_internal.h — private to layers/: the stage and sequence-state structs shared by
 * stage.c (create, AttnRes, FFN, embed/head, the layer loop), kda.c and mla.c. */
#ifndef K3_LAYERS_INTERNAL_H
#define K3_LAYERS_INTERNAL_H

#include "k3_layers.h"

/* f32 copies of a layer's small vectors (made at create; weights keep their stored dtype). */
typedef struct layer_vecs {
    float *input_norm, *post_norm; /* [D] */
    float *attn_res, *mlp_res;     /* [D] (NULL without AttnRes) */
    /* KDA */
    float *conv[3]; /* q, k, v: [P, K] */
    float *dt_bias; /* [P] */
    float *a_log;   /* [A] A_log (exp taken by the kda_gate op) */
    float *o_norm;  /* [dv] */
    /* MLA */
    float *q_a_norm;  /* [Rq] */
    float *kv_a_norm; /* [Rkv] */
} layer_vecs;

struct k3_stage {
    k3_stage_params p;
    const k3_config *c;
    const k3_weights_view *w;
    k3_backend *be; /* every buffer below except the host ones lives here */
    bool own_be;    /* made by the stage (params.be == NULL) */
    int64_t D, T_max;
    int kda_chunk;
    int slot[K3_MAX_LAYERS]; /* index among the stage's KDA or MLA layers (by mixer) */
    int n_kda, n_mla;
    layer_vecs *vec; /* [n_layers] (only the stage's layers filled) */
    float *vec_mem;
    float *final_norm, *out_res; /* [D] (last stage) */
    k3_layer_tap tap;
    void *tap_ctx;
    float *tap_buf; /* host [T_max, D] */

    /* scratch, sized for T_max tokens at create */
    float *xa, *xn, *y; /* [T, D] mix output, normed input, sublayer output */
    /* KDA */
    float *kq, *kk, *kv, *kqc, *kkc, *kvc, *kr, *kg, *ko; /* [T, P] each */
    float *kfa;                                           /* [T, R] */
    float *kbeta;                                         /* [T, H] */
    float *kwork;                                         /* [H, chunk work] */
    /* MLA */
    float *mcq;           /* [T, Rq] */
    float *mq;            /* [T, H·(dn+dr)] */
    float *mckv;          /* [T, Rkv+dr] */
    float *mhwork;        /* [T, max(dn, Rkv) + max(Rkv, dv)]: matmul_heads' staging */
    float *mqc;           /* [T, H, Rkv+dr] */
    float *molat;         /* [T, H, Rkv] */
    float *mattn, *mgate; /* [T, H·dv] */
    float *mwork;         /* [H, max_ctx] attention scratch (grown with the pools) */
    /* FFN */
    float *fg, *fu;     /* [T, F] */
    float *moe_scratch; /* k3_moe_scratch_floats(T) */
    /* the distributed MoE step (comm != NULL) */
    int32_t *moe_ids; /* [2, T_max, K]: a step's ids [T·K], then its weights [T·K] (float) */
    float *moe_r;     /* [T, Lw] latent rows */
    float *moe_comb;  /* [T·K, Lw] what the combine returns */
    float *moe_acc;   /* [T, Lw] weighted expert sum */
    float *moe_eo;    /* [n_lanes·T·K, Lw] received items' outputs (pre-sum mode) */
    float *moe_xs;    /* expert rows scratch for n_lanes·T·K rows */
    int64_t *moe_xh;  /* host: expert rows host scratch */
    int32_t *h_ids, *h_row, *h_lane; /* host routing metadata: [2, T·K] (ids, weight bits),
                                        [T·K], [T·K] */
    /* the device-routed MoE exchange (moe_ep.c; ep_on: built, used by the steps unless
       ep_host: k3_stage_set_moe_host, the round's route) */
    bool ep_on, ep_host;
    k3_moe_ep ep;
    int32_t *ep_dest, *ep_glob;        /* [n_layers, E], [n_layers, EL] (backend) */
    float *ep_send, *ep_recv, *ep_ret; /* [L, blk_rows, Lw] lane blocks each */
    float *ep_h;                       /* [EL·L·cap, I] */
    int32_t *ep_iwork, *ep_pos;        /* [2·EL + EL·L·cap], [T_max·K] */
    float *logits_host;  /* k3_stage_set_logits_host: the logits' host copy (NULL: none) */
    bool logits_fetched; /* the last forward downloaded them with its flags */
    /* head */
    float *hsel;     /* [T, D] rows that get logits */
    float *bank_sel; /* [max_bank, n_slots, D] the bank rows of each sequence's last token */

    /* The state pools (k3_layers.h "Paged cache and slots"). fixed: sized at create from the
       params; else grown by k3_seq_state_create (one slot and max_ctx of blocks each). */
    bool fixed;
    int n_slots;               /* slot pool capacity (= the most sequences of one batch) */
    bool *slot_used;           /* host [n_slots] */
    float *conv_pool;          /* [n_slots, n_kda, 3, K-1, P] */
    float *S_pool;             /* [n_slots, n_kda, H, dk, dv] */
    int64_t conv_slot, S_slot; /* floats of one slot in each pool */
    int n_blocks;              /* paged MLA cache blocks (0 without MLA layers) */
    int n_free;                /* free blocks: free_blk[0, n_free) */
    int32_t *free_blk;         /* host [n_blocks] */
    int32_t *blk_ref;          /* host [n_blocks] holders of each block: the sequences whose block
                                  table names it + the prefix cache (0: on the free list) */
    int n_snaps;               /* prefix-cache snapshots (params.n_snapshots; layers/prefix.c) */
    float *snap_pool;          /* [n_snaps, conv_slot + S_slot] a slot's states at a boundary */
    float *kv_pool;            /* [n_mla, n_blocks, K3_KV_BLOCK, Rkv + dr] */
    int max_blocks;            /* block table row: blocks of the longest sequence (max_ctx) */
    int64_t max_ctx;           /* the longest sequence a state may be created for */
    /* the step buffer, uploaded once a step: k3_seqs arrays [k3_seqs_floats(n_slots,
       max_blocks)] | non-finite flags [n_slots] | token ids [T_max] (int32); host mirror */
    int32_t *step_dev, *step_host;
    size_t step_ints;
    int32_t *h_ntok, *h_pos, *h_slot, *h_blk; /* host [n_slots] ×3, [n_slots, max_blocks] */
    int32_t *h_nf;                            /* host [n_slots] the flags read back */
    /* captured decode steps (params.graphs; layers/graph.c): the pad rows' slot and cache block
       (kept out of the pools: -1 without graphs), and per padded size n (index n, [n_slots]):
       the graph, the AttnRes slabs it starts and ends with, and whether its capture failed */
    int pad_slot, pad_blk;
    k3_backend_graph **graph;
    int *graph_bank_in, *graph_bank_out;
    bool *graph_off;
};

/* A sequence: its slot of the stage's slot pool and the paged cache blocks it holds. */
struct k3_seq_state {
    k3_stage *s;
    int slot;
    int64_t max_ctx, pos;
    int n_blk;    /* blocks held: positions [0, n_blk·K3_KV_BLOCK) */
    int32_t *blk; /* host [s->max_blocks] its block table */
};

/* A block the sequence or the cache stops naming: back on the free list when nobody holds it. */
void k3_layers_block_drop(k3_stage *s, int32_t blk);

/* KDA mixer over the batch (descriptor sq, in backend memory): x [T, D] (normed) -> y [T, D]. */
k3_status k3_layers_kda(k3_stage *s, int layer, const k3_seqs *sq, const float *x, float *y);
/* MLA mixer over the batch: x [T, D] -> y [T, D]; writes the paged latent cache. */
k3_status k3_layers_mla(k3_stage *s, int layer, const k3_seqs *sq, const float *x, float *y);

/* The step's descriptor of batch b (blocks taken, one upload): what k3_stage_forward does before
 * its layers, for tests that run a mixer alone. */
k3_status k3_layers_step_begin(k3_stage *s, const k3_batch *b, k3_seqs *sq);

/* A batch's checks before anything runs (sequences, tokens, ids, the activation): *T its tokens. */
k3_status k3_layers_check_batch(const k3_stage *s, const k3_batch *b, const k3_activ *act,
                                int64_t *T_out);
/* Blocks for every sequence's positions up to pos + n (all or none). */
k3_status k3_layers_take_blocks(k3_stage *s, const k3_batch *b);
/* Every op of a step after its upload (descriptor sq, flags and ids in the step buffer), from the
   embedding or the received activation to the logits: what a captured decode step holds. */
k3_status k3_layers_forward_ops(k3_stage *s, const k3_seqs *sq, bool nf, k3_activ *act,
                                bool all_logits, float *logits, int32_t *flags, const int32_t *ids);
/* Reserve the pad slot and block (pools_create, params.graphs) and free the graphs (destroy). */
k3_status k3_layers_graph_init(k3_stage *s);
void k3_layers_graph_free(k3_stage *s);
/* The device-routed MoE exchange of the stage (moe_ep.c): usable (nccl transport, a backend
 * with the moe_ep halves, K3_MOE_HOST_ROUTE unset), its buffers, its step (T may be 0). */
bool k3_layers_moe_ep_usable(const k3_stage *s);
k3_status k3_layers_moe_ep_create(k3_stage *s);
void k3_layers_moe_ep_free(k3_stage *s);
k3_status k3_layers_moe_ep_step(k3_stage *s, int l, const float *x, int64_t T, float *y);

/* Shape check of one weight: names layer and tensor on mismatch. d1 < 0: 1-D [d0]. */
k3_status k3_layers_need(const k3_tensor *t, int layer, const char *name, int64_t d0, int64_t d1);

#endif /* K3_LAYERS_INTERNAL_H */
