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
    float *nf_buf;  /* host [max(T_max * D, V)]: the non-finite check (k3_batch.nonfinite) */

    /* scratch, sized for T_max tokens at create */
    float *xa, *xn, *y; /* [T, D] mix output, normed input, sublayer output */
    int32_t *ids;       /* [T] token ids (first stage) */
    /* KDA */
    float *kq, *kk, *kv, *kqc, *kkc, *kvc, *kr, *kg, *ko; /* [T, P] each */
    float *kfa;                                           /* [T, R] */
    float *kbeta;                                         /* [T, H] */
    float *kwork;                                         /* [H, chunk work] */
    /* MLA */
    float *mcq;                /* [T, Rq] */
    float *mq;                 /* [T, H·(dn+dr)] */
    float *mckv;               /* [T, Rkv+dr] */
    float *mtmp_in, *mtmp_out; /* [T, max(dn, Rkv)], [T, max(Rkv, dv)] per-head staging */
    float *mqc;                /* [T, H, Rkv+dr] */
    float *molat;              /* [T, H, Rkv] */
    float *mattn, *mgate;      /* [T, H·dv] */
    float *mwork; /* [H, max_ctx] attention probabilities (grown by seq_state_create) */
    int64_t mwork_ctx;
    /* FFN */
    float *fg, *fu;        /* [T, F] */
    float *moe_scratch;    /* k3_moe_scratch_floats(T) */
    int64_t *moe_hscratch; /* host: k3_moe_host_ints(T) */
    /* the distributed MoE step (comm != NULL) */
    int32_t *moe_ids; /* [T, K] */
    float *moe_w;     /* [T, K] */
    float *moe_r;     /* [T, Lw] latent rows */
    float *moe_comb;  /* [T·K, Lw] what the combine returns */
    float *moe_acc;   /* [T, Lw] weighted expert sum */
    float *moe_eo;    /* [n_lanes·T·K, Lw] received items' outputs (pre-sum mode) */
    float *moe_xs;    /* expert rows scratch for n_lanes·T·K rows */
    int64_t *moe_xh;  /* host: expert rows host scratch */
    int32_t *h_ids, *h_row, *h_lane; /* host [T·K] routing metadata */
    float *h_w;                      /* host [T·K] */
    /* head */
    float *hsel;  /* [T, D] rows that get logits */
    float *bank1; /* [max_bank, D] one token's bank rows (final mix of last tokens) */
};

struct k3_seq_state {
    const k3_stage *s;
    int64_t max_ctx, pos;
    float *mla;  /* [n_mla, max_ctx, Rkv+dr] (backend memory) */
    float *conv; /* [n_kda, 3, K-1, P] */
    float *S;    /* [n_kda, H, dk, dv] */
    size_t n_bytes;
};

/* KDA mixer over the batch: x [T, D] (normed) -> y [T, D]. */
k3_status k3_layers_kda(k3_stage *s, int layer, const k3_batch *b, const float *x, float *y);
/* MLA mixer over the batch: x [T, D] -> y [T, D]; writes the latent cache. */
k3_status k3_layers_mla(k3_stage *s, int layer, const k3_batch *b, const float *x, float *y);

/* Shape check of one weight: names layer and tensor on mismatch. d1 < 0: 1-D [d0]. */
k3_status k3_layers_need(const k3_tensor *t, int layer, const char *name, int64_t d0, int64_t d1);

#endif /* K3_LAYERS_INTERNAL_H */
