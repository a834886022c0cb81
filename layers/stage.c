/* stage.c — the per-stage forward: stage/state lifetimes, the layer loop with Attention
 * Residuals (K3-MODEL.md §1.2-1.3) or a plain pre-norm residual (attn_res_block_size == 0),
 * the dense FFN, the MoE layer (experts/ compute, or the exchange hook), embedding, final
 * mix + norm + LM head.
 *
 * Invariants: everything is allocated in k3_stage_create / k3_seq_state_create; the forward
 * only validates the batch, then runs. AttnRes state of a token lives in k3_activ (partial sum
 * h + bank), so a stage boundary may fall anywhere. Weights are checked (presence, dtype
 * family, shape) once at create with errors naming the layer and tensor. */
#include "layers_internal.h"

#include <math.h>

#include "k3_experts.h"

/* ---- checks ------------------------------------------------------------------------------ */
k3_status k3_layers_need(const k3_tensor *t, int layer, const char *name, int64_t d0, int64_t d1) {
    if (!t->data) return K3_ERR(K3_ERR_MISSING, "layer %d: tensor %s is not loaded", layer, name);
    bool ok = d1 < 0 ? (k3_tensor_n_elems(t) == d0)
                     : (t->ndim == 2 && t->shape[0] == d0 && t->shape[1] == d1);
    if (!ok)
        return K3_ERR(K3_ERR_SHAPE,
                      "layer %d: tensor %s has shape [%lld%s%lld], expected [%lld%s%lld]", layer,
                      name, (long long)t->shape[0], t->ndim > 1 ? ", " : "",
                      t->ndim > 1 ? (long long)t->shape[1] : 0LL, (long long)d0,
                      d1 >= 0 ? ", " : "", d1 >= 0 ? (long long)d1 : 0LL);
    if (d1 >= 0 && t->dtype != K3_DT_F32 && t->dtype != K3_DT_BF16 && t->dtype != K3_DT_MXFP4)
        return K3_ERR(K3_ERR_SHAPE, "layer %d: tensor %s has dtype %s (F32, BF16, MXFP4 supported)",
                      layer, name, k3_dtype_name(t->dtype));
    return K3_OK;
}

int k3_activ_max_bank(const k3_config *cfg) {
    if (cfg->attn_res_block_size <= 0) return 0;
    return (cfg->n_layers + cfg->attn_res_block_size - 1) / cfg->attn_res_block_size;
}

k3_status k3_activ_alloc(k3_activ *a, const k3_config *cfg, int64_t max_tokens) {
    memset(a, 0, sizeof(*a));
    size_t td = (size_t)max_tokens * (size_t)cfg->hidden_size;
    K3_TRY(k3_calloc((void **)&a->h, td * sizeof(float), "activation h"));
    int mb = k3_activ_max_bank(cfg);
    if (mb > 0) {
        k3_status st =
            k3_calloc((void **)&a->bank, (size_t)mb * td * sizeof(float), "AttnRes bank");
        if (st != K3_OK) {
            k3_free(a->h);
            a->h = NULL;
            return st;
        }
    }
    return K3_OK;
}

void k3_activ_free(k3_activ *a) {
    if (!a) return;
    k3_free(a->h);
    k3_free(a->bank);
    memset(a, 0, sizeof(*a));
}

/* ---- create ------------------------------------------------------------------------------ */
static k3_status vec_f32(const k3_tensor *t, int64_t n, int layer, const char *name, float **cursor,
                         float **out) {
    K3_TRY(k3_layers_need(t, layer, name, n, -1));
    k3_status st = k3_tensor_to_f32(t, *cursor, n);
    if (st != K3_OK) return K3_ERR(st, "layer %d: tensor %s: %s", layer, name, k3_last_error());
    *out = *cursor;
    *cursor += n;
    return K3_OK;
}

static k3_status check_layer(const k3_stage *s, int l) {
    const k3_config *c = s->c;
    const k3_layer_w *lw = &s->w->layers[l];
    const int64_t D = c->hidden_size;
    if (!lw->present) return K3_ERR(K3_ERR_MISSING, "layer %d is not loaded on this rank", l);
    if (c->mixer[l] == K3_MIXER_KDA) {
        int64_t P = (int64_t)c->kda_n_heads * c->kda_head_dim;
        int R = c->kda_gate_rank;
        K3_TRY(k3_layers_need(&lw->q_proj, l, "q_proj", P, D));
        K3_TRY(k3_layers_need(&lw->k_proj, l, "k_proj", P, D));
        K3_TRY(k3_layers_need(&lw->v_proj, l, "v_proj", P, D));
        K3_TRY(k3_layers_need(&lw->f_a, l, "f_a_proj", R, D));
        K3_TRY(k3_layers_need(&lw->f_b, l, "f_b_proj", P, R));
        K3_TRY(k3_layers_need(&lw->b_proj, l, "b_proj", c->kda_n_heads, D));
        if (c->kda_full_rank_gate) {
            K3_TRY(k3_layers_need(&lw->g_proj, l, "g_proj", P, D));
        } else {
            K3_TRY(k3_layers_need(&lw->g_a, l, "g_a_proj", lw->g_a.shape[0], D));
            K3_TRY(k3_layers_need(&lw->g_b, l, "g_b_proj", P, lw->g_a.shape[0]));
        }
        K3_TRY(k3_layers_need(&lw->o_proj, l, "o_proj", D, P));
        if (c->kda_a_log_len < c->kda_n_heads)
            return K3_ERR(K3_ERR_SHAPE, "layer %d: A_log has %d entries < %d heads", l,
                          c->kda_a_log_len, c->kda_n_heads);
    } else {
        int H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim;
        if (c->q_lora_rank > 0) {
            K3_TRY(k3_layers_need(&lw->q_a_proj, l, "q_a_proj", c->q_lora_rank, D));
            K3_TRY(k3_layers_need(&lw->q_b_proj, l, "q_b_proj", (int64_t)H * (dn + dr),
                                  c->q_lora_rank));
        } else {
            K3_TRY(k3_layers_need(&lw->q_proj_mla, l, "q_proj", (int64_t)H * (dn + dr), D));
        }
        K3_TRY(k3_layers_need(&lw->kv_a_proj, l, "kv_a_proj_with_mqa", c->kv_lora_rank + dr, D));
        K3_TRY(k3_layers_need(&lw->kv_b_proj, l, "kv_b_proj", (int64_t)H * (dn + dv),
                              c->kv_lora_rank));
        if (lw->kv_b_proj.dtype == K3_DT_MXFP4)
            return K3_ERR(K3_ERR_SHAPE, "layer %d: kv_b_proj as MXFP4 is not supported", l);
        if (c->mla_use_output_gate)
            K3_TRY(k3_layers_need(&lw->g_proj, l, "g_proj", (int64_t)H * dv, D));
        K3_TRY(k3_layers_need(&lw->o_proj, l, "o_proj", D, (int64_t)H * dv));
    }
    if (k3_config_is_moe(c, l)) {
        K3_TRY(k3_layers_need(&lw->router, l, "gate (router)", c->n_experts, D));
        if (!lw->experts) return K3_ERR(K3_ERR_MISSING, "layer %d: no expert table", l);
    } else {
        int64_t F = c->intermediate_size;
        K3_TRY(k3_layers_need(&lw->gate_proj, l, "mlp.gate_proj", F, D));
        K3_TRY(k3_layers_need(&lw->up_proj, l, "mlp.up_proj", F, D));
        K3_TRY(k3_layers_need(&lw->down_proj, l, "mlp.down_proj", D, F));
    }
    return K3_OK;
}

static k3_status make_vecs(k3_stage *s) {
    const k3_config *c = s->c;
    const int64_t D = s->D, P = (int64_t)c->kda_n_heads * c->kda_head_dim;
    const int K = c->kda_conv_kernel;
    /* upper bound of floats over the stage's layers */
    size_t per = (size_t)(4 * D + 3 * P * K + P + c->kda_n_heads + c->kda_head_dim +
                          c->q_lora_rank + c->kv_lora_rank);
    size_t n = per * (size_t)(s->p.layer_end - s->p.layer_begin) + 2 * (size_t)D;
    K3_TRY(k3_calloc((void **)&s->vec_mem, n * sizeof(float), "stage vectors"));
    K3_TRY(k3_calloc((void **)&s->vec, (size_t)c->n_layers * sizeof(layer_vecs),
                     "stage vector table"));
    float *cur = s->vec_mem;
    bool res = c->attn_res_block_size > 0;
    for (int l = s->p.layer_begin; l < s->p.layer_end; l++) {
        const k3_layer_w *lw = &s->w->layers[l];
        layer_vecs *v = &s->vec[l];
        K3_TRY(vec_f32(&lw->input_norm, D, l, "input_layernorm", &cur, &v->input_norm));
        K3_TRY(vec_f32(&lw->post_attn_norm, D, l, "post_attention_layernorm", &cur, &v->post_norm));
        if (res) {
            K3_TRY(
                vec_f32(&lw->attn_res_score, D, l, "self_attention_res score", &cur, &v->attn_res));
            K3_TRY(vec_f32(&lw->mlp_res_score, D, l, "mlp_res score", &cur, &v->mlp_res));
        }
        if (c->mixer[l] == K3_MIXER_KDA) {
            const k3_tensor *cv[3] = {&lw->q_conv, &lw->k_conv, &lw->v_conv};
            const char *cn[3] = {"q_conv1d", "k_conv1d", "v_conv1d"};
            for (int j = 0; j < 3; j++) K3_TRY(vec_f32(cv[j], P * K, l, cn[j], &cur, &v->conv[j]));
            K3_TRY(vec_f32(&lw->dt_bias, P, l, "dt_bias", &cur, &v->dt_bias));
            K3_TRY(vec_f32(&lw->o_norm, c->kda_head_dim, l, "o_norm", &cur, &v->o_norm));
            float *alog;
            K3_TRY(k3_layers_need(&lw->a_log, l, "A_log", c->kda_a_log_len, -1));
            K3_TRY(vec_f32(&lw->a_log, c->kda_a_log_len, l, "A_log", &cur, &alog));
            /* only the first kda_n_heads entries are used (K3 pads A_log to 128); exp in place */
            for (int h = 0; h < c->kda_n_heads; h++) alog[h] = expf(alog[h]);
            v->a_exp = alog;
        } else {
            if (c->q_lora_rank > 0)
                K3_TRY(
                    vec_f32(&lw->q_a_norm, c->q_lora_rank, l, "q_a_layernorm", &cur, &v->q_a_norm));
            K3_TRY(
                vec_f32(&lw->kv_a_norm, c->kv_lora_rank, l, "kv_a_layernorm", &cur, &v->kv_a_norm));
        }
        K3_ASSERT((size_t)(cur - s->vec_mem) <= n);
    }
    if (s->p.last) {
        K3_TRY(vec_f32(&s->w->final_norm, D, -1, "model.norm", &cur, &s->final_norm));
        if (res)
            K3_TRY(
                vec_f32(&s->w->out_res_score, D, -1, "output_attn_res score", &cur, &s->out_res));
    }
    return K3_OK;
}

static k3_status buf(float **p, size_t n_floats, const char *what) {
    return k3_calloc((void **)p, (n_floats ? n_floats : 1) * sizeof(float), what);
}

static k3_status make_scratch(k3_stage *s) {
    const k3_config *c = s->c;
    const size_t T = (size_t)s->T_max, D = (size_t)s->D;
    bool any_kda = false, any_mla = false, any_dense = false, any_moe = false;
    for (int l = s->p.layer_begin; l < s->p.layer_end; l++) {
        if (c->mixer[l] == K3_MIXER_KDA)
            any_kda = true;
        else
            any_mla = true;
        if (k3_config_is_moe(c, l))
            any_moe = true;
        else
            any_dense = true;
    }
    K3_TRY(buf(&s->xa, T * D, "scratch xa"));
    K3_TRY(buf(&s->xn, T * D, "scratch xn"));
    K3_TRY(buf(&s->y, T * D, "scratch y"));
    K3_TRY(buf(&s->hsel, T * D, "scratch head rows"));
    K3_TRY(buf(&s->bank1, (size_t)k3_activ_max_bank(c) * D, "scratch bank rows of one token"));
    if (any_kda) {
        const size_t P = (size_t)c->kda_n_heads * (size_t)c->kda_head_dim;
        float **big[] = {&s->kq, &s->kk, &s->kv, &s->kqc, &s->kkc, &s->kvc, &s->kr, &s->kg, &s->ko};
        for (size_t i = 0; i < K3_ARRAY_LEN(big); i++) K3_TRY(buf(big[i], T * P, "KDA scratch"));
        size_t R = (size_t)c->kda_gate_rank;
        for (int l = s->p.layer_begin; l < s->p.layer_end; l++)
            if (s->w->layers[l].g_a.data) R = K3_MAX(R, (size_t)s->w->layers[l].g_a.shape[0]);
        K3_TRY(buf(&s->kfa, T * R, "KDA gate scratch"));
        K3_TRY(buf(&s->kbeta, T * (size_t)c->kda_n_heads, "KDA beta"));
        if (s->kda_chunk > 1)
            K3_TRY(buf(&s->kwork,
                       (size_t)c->kda_n_heads *
                           k3_kda_chunk_work_floats(s->kda_chunk, c->kda_head_dim, c->kda_head_dim),
                       "KDA chunk work"));
    }
    if (any_mla) {
        const size_t H = (size_t)c->n_heads, dn = (size_t)c->qk_nope_head_dim,
                     dr = (size_t)c->qk_rope_head_dim, dv = (size_t)c->v_head_dim,
                     Rkv = (size_t)c->kv_lora_rank, W = Rkv + dr;
        K3_TRY(buf(&s->mcq, T * (size_t)K3_MAX(c->q_lora_rank, 1), "MLA cq"));
        K3_TRY(buf(&s->mq, T * H * (dn + dr), "MLA q"));
        K3_TRY(buf(&s->mckv, T * W, "MLA ckv"));
        K3_TRY(buf(&s->mtmp_in, T * K3_MAX(dn, Rkv), "MLA head in"));
        K3_TRY(buf(&s->mtmp_out, T * K3_MAX(Rkv, dv), "MLA head out"));
        K3_TRY(buf(&s->mqc, T * H * W, "MLA absorbed q"));
        K3_TRY(buf(&s->molat, T * H * Rkv, "MLA latent out"));
        K3_TRY(buf(&s->mattn, T * H * dv, "MLA attn"));
        K3_TRY(buf(&s->mgate, T * H * dv, "MLA gate"));
    }
    if (any_dense) {
        K3_TRY(buf(&s->fg, T * (size_t)c->intermediate_size, "FFN gate"));
        K3_TRY(buf(&s->fu, T * (size_t)c->intermediate_size, "FFN up"));
    }
    if (any_moe) {
        const size_t K = (size_t)c->n_experts_per_tok, Lw = (size_t)k3_moe_row_width(c);
        K3_TRY(k3_moe_check_config(c));
        K3_TRY(buf(&s->moe_scratch, k3_moe_scratch_floats(c, (int64_t)T), "MoE scratch"));
        K3_TRY(buf(&s->moe_rows, T * K * Lw, "MoE rows"));
        K3_TRY(buf(&s->moe_out, T * K * Lw, "MoE expert outputs"));
        K3_TRY(buf(&s->moe_w, T * K, "MoE weights"));
        K3_TRY(k3_calloc((void **)&s->moe_ids, T * K * sizeof(int32_t), "MoE ids"));
    }
    return K3_OK;
}

k3_status k3_stage_create(const k3_stage_params *p, k3_stage **out) {
    *out = NULL;
    if (!p || !p->cfg || !p->w) return K3_ERR(K3_ERR_ARG, "stage: cfg and weights are required");
    const k3_config *c = p->cfg;
    if (p->layer_begin < 0 || p->layer_end > c->n_layers || p->layer_begin > p->layer_end)
        return K3_ERR(K3_ERR_ARG, "stage: layer range [%d, %d) outside [0, %d)", p->layer_begin,
                      p->layer_end, c->n_layers);
    if (p->max_tokens < 1)
        return K3_ERR(K3_ERR_ARG, "stage: max_tokens must be >= 1 (got %lld)",
                      (long long)p->max_tokens);
    if (p->kda_chunk < 0) return K3_ERR(K3_ERR_ARG, "stage: kda_chunk must be >= 0");
    if (k3_activ_max_bank(c) > 63)
        return K3_ERR(K3_ERR_CONFIG, "stage: more than 63 AttnRes blocks");
    k3_stage *s;
    K3_TRY(k3_calloc((void **)&s, sizeof(*s), "stage"));
    s->p = *p;
    s->c = c;
    s->w = p->w;
    s->ops = p->ops ? p->ops : k3_ops_default();
    s->D = c->hidden_size;
    s->T_max = p->max_tokens;
    s->kda_chunk = p->kda_chunk == 0 ? K3_KDA_CHUNK_DEFAULT : p->kda_chunk;
    if (p->n_threads > 0) k3_kernels_set_threads(p->n_threads);
    k3_status st = K3_OK;
    if (p->first && !s->w->embed.data)
        st = K3_ERR(K3_ERR_MISSING, "first stage: embedding not loaded");
    if (st == K3_OK && p->first &&
        (s->w->embed.ndim != 2 || s->w->embed.shape[0] != c->vocab_size ||
         s->w->embed.shape[1] != s->D))
        st = K3_ERR(K3_ERR_SHAPE, "embed_tokens has the wrong shape (want [%lld, %lld])",
                    (long long)c->vocab_size, (long long)s->D);
    if (st == K3_OK && p->last) {
        const k3_tensor *head = c->tie_word_embeddings ? &s->w->embed : &s->w->lm_head;
        st = k3_layers_need(head, -1,
                            c->tie_word_embeddings ? "embed_tokens (tied head)" : "lm_head",
                            c->vocab_size, s->D);
    }
    for (int l = p->layer_begin; st == K3_OK && l < p->layer_end; l++) {
        s->slot[l] = c->mixer[l] == K3_MIXER_KDA ? s->n_kda++ : s->n_mla++;
        st = check_layer(s, l);
    }
    if (st == K3_OK) st = make_vecs(s);
    if (st == K3_OK) st = make_scratch(s);
    if (st != K3_OK) {
        k3_stage_destroy(s);
        return st;
    }
    *out = s;
    return K3_OK;
}

void k3_stage_destroy(k3_stage *s) {
    if (!s) return;
    float *bufs[] = {s->xa,       s->xn,      s->y,       s->hsel,     s->bank1, s->kq,
                     s->kk,       s->kv,      s->kqc,     s->kkc,      s->kvc,   s->kr,
                     s->kg,       s->ko,      s->kfa,     s->kbeta,    s->kwork, s->mcq,
                     s->mq,       s->mckv,    s->mtmp_in, s->mtmp_out, s->mqc,   s->molat,
                     s->mattn,    s->mgate,   s->mwork,   s->fg,       s->fu,    s->moe_scratch,
                     s->moe_rows, s->moe_out, s->moe_w};
    for (size_t i = 0; i < K3_ARRAY_LEN(bufs); i++) k3_free(bufs[i]);
    k3_free(s->moe_ids);
    k3_free(s->vec_mem);
    k3_free(s->vec);
    k3_free(s);
}

const k3_stage_params *k3_stage_get_params(const k3_stage *s) {
    return &s->p;
}

void k3_stage_set_tap(k3_stage *s, k3_layer_tap tap, void *ctx) {
    s->tap = tap;
    s->tap_ctx = ctx;
}

/* ---- sequence state ------------------------------------------------------------------------ */
k3_status k3_seq_state_create(const k3_stage *cs, int64_t max_ctx, k3_seq_state **out) {
    *out = NULL;
    if (max_ctx < 1) return K3_ERR(K3_ERR_ARG, "sequence state: max_ctx must be >= 1");
    k3_stage *s = (k3_stage *)cs; /* may grow the attention scratch (documented in the header) */
    const k3_config *c = s->c;
    k3_seq_state *st;
    K3_TRY(k3_calloc((void **)&st, sizeof(*st), "sequence state"));
    st->s = s;
    st->max_ctx = max_ctx;
    size_t P = (size_t)c->kda_n_heads * (size_t)c->kda_head_dim;
    size_t n_mla =
        (size_t)s->n_mla * (size_t)max_ctx * (size_t)(c->kv_lora_rank + c->qk_rope_head_dim);
    size_t n_conv = (size_t)s->n_kda * 3 * (size_t)K3_MAX(c->kda_conv_kernel - 1, 0) * P;
    size_t n_S = (size_t)s->n_kda * P * (size_t)c->kda_head_dim;
    k3_status e = K3_OK;
    if (n_mla) e = k3_calloc((void **)&st->mla, n_mla * sizeof(float), "MLA latent cache");
    if (e == K3_OK && n_conv)
        e = k3_calloc((void **)&st->conv, n_conv * sizeof(float), "KDA conv state");
    if (e == K3_OK && n_S)
        e = k3_calloc((void **)&st->S, n_S * sizeof(float), "KDA recurrent state");
    if (e == K3_OK && s->n_mla > 0 && max_ctx > s->mwork_ctx) {
        float *w;
        e = k3_calloc((void **)&w, (size_t)c->n_heads * (size_t)max_ctx * sizeof(float),
                      "attention scratch");
        if (e == K3_OK) {
            k3_free(s->mwork);
            s->mwork = w;
            s->mwork_ctx = max_ctx;
        }
    }
    if (e != K3_OK) {
        k3_seq_state_destroy(st);
        return e;
    }
    st->n_bytes = (n_mla + n_conv + n_S) * sizeof(float);
    *out = st;
    return K3_OK;
}

void k3_seq_state_destroy(k3_seq_state *st) {
    if (!st) return;
    k3_free(st->mla);
    k3_free(st->conv);
    k3_free(st->S);
    k3_free(st);
}

void k3_seq_state_reset(k3_seq_state *st) {
    const k3_config *c = st->s->c;
    size_t P = (size_t)c->kda_n_heads * (size_t)c->kda_head_dim;
    if (st->conv)
        memset(st->conv, 0,
               (size_t)st->s->n_kda * 3 * (size_t)(c->kda_conv_kernel - 1) * P * sizeof(float));
    if (st->S) memset(st->S, 0, (size_t)st->s->n_kda * P * (size_t)c->kda_head_dim * sizeof(float));
    st->pos = 0; /* the MLA cache beyond pos is never read */
}

int64_t k3_seq_state_pos(const k3_seq_state *st) {
    return st->pos;
}
int64_t k3_seq_state_max_ctx(const k3_seq_state *st) {
    return st->max_ctx;
}
size_t k3_seq_state_bytes(const k3_seq_state *st) {
    return st->n_bytes;
}

/* ---- FFN ------------------------------------------------------------------------------------ */
static k3_status dense_ffn(k3_stage *s, int l, const float *x, int64_t T, float *y) {
    const k3_config *c = s->c;
    const k3_layer_w *lw = &s->w->layers[l];
    int64_t n = T * c->intermediate_size;
    K3_TRY(s->ops->matmul(x, T, &lw->gate_proj, s->fg));
    K3_TRY(s->ops->matmul(x, T, &lw->up_proj, s->fu));
    if (c->act == K3_ACT_SWIGLU)
        s->ops->swiglu(s->fg, s->fu, n, s->fg);
    else
        s->ops->situ(s->fg, s->fu, n, c->situ_beta, c->situ_linear_beta, s->fg);
    return s->ops->matmul(s->fg, T, &lw->down_proj, y);
}

static k3_status moe_ffn(k3_stage *s, int l, const float *x, int64_t T, const k3_moe_exchange *ex,
                         float *y) {
    const k3_config *c = s->c;
    const k3_layer_w *lw = &s->w->layers[l];
    if (!ex || !ex->run) return k3_moe_forward(s->ops, c, lw, x, T, y, s->moe_scratch);
    const int K = c->n_experts_per_tok;
    const int64_t Lw = k3_moe_row_width(c), n = T * K;
    K3_TRY(k3_moe_route(s->ops, c, lw, x, T, s->moe_ids, s->moe_w, s->moe_scratch));
    K3_TRY(k3_moe_down(s->ops, c, lw, x, T, s->moe_rows));
    k3_moe_expand_rows(s->moe_rows, T, K, Lw, s->moe_rows);
    k3_status st = ex->run(ex->ctx, l, s->moe_rows, s->moe_ids, n, s->moe_out);
    if (st != K3_OK) return st;
    return k3_moe_finish(s->ops, c, lw, x, s->moe_w, s->moe_out, T, y, s->moe_scratch);
}

/* ---- the forward ---------------------------------------------------------------------------- */
static k3_status check_batch(const k3_stage *s, const k3_batch *b, const k3_activ *act,
                             int64_t *T_out) {
    if (!b || b->n_seqs < 1 || !b->states || !b->n_tokens)
        return K3_ERR(K3_ERR_ARG, "forward: empty batch");
    int64_t T = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        const k3_seq_state *st = b->states[i];
        if (!st || st->s != s)
            return K3_ERR(K3_ERR_ARG, "forward: sequence %d has no state of this stage", i);
        if (b->n_tokens[i] < 1)
            return K3_ERR(K3_ERR_ARG, "forward: sequence %d has %d tokens (>= 1)", i,
                          b->n_tokens[i]);
        if (st->pos + b->n_tokens[i] > st->max_ctx)
            return K3_ERR(K3_ERR_STATE,
                          "forward: sequence %d would reach %lld tokens > its max_ctx %lld", i,
                          (long long)(st->pos + b->n_tokens[i]), (long long)st->max_ctx);
        for (int j = 0; j < i; j++)
            if (b->states[j] == st)
                return K3_ERR(K3_ERR_ARG, "forward: sequence state %d appears twice", i);
        T += b->n_tokens[i];
    }
    if (T > s->T_max)
        return K3_ERR(K3_ERR_ARG, "forward: batch has %lld tokens > max_tokens %lld", (long long)T,
                      (long long)s->T_max);
    if (!act || !act->h) return K3_ERR(K3_ERR_ARG, "forward: no activation buffer");
    if (s->c->attn_res_block_size > 0 && !act->bank)
        return K3_ERR(K3_ERR_ARG, "forward: no AttnRes bank buffer");
    if (!s->p.first && (act->T != T))
        return K3_ERR(K3_ERR_ARG, "forward: activation has T=%lld, batch has %lld",
                      (long long)act->T, (long long)T);
    if (s->p.first) {
        if (!b->token_ids) return K3_ERR(K3_ERR_ARG, "forward: first stage needs token ids");
        for (int64_t t = 0; t < T; t++)
            if (b->token_ids[t] < 0 || b->token_ids[t] >= s->c->vocab_size)
                return K3_ERR(K3_ERR_ARG, "forward: token id %d at position %lld outside [0, %lld)",
                              b->token_ids[t], (long long)t, (long long)s->c->vocab_size);
    }
    *T_out = T;
    return K3_OK;
}

k3_status k3_stage_forward(k3_stage *s, const k3_batch *b, k3_activ *act, const k3_moe_exchange *ex,
                           bool all_logits, float *logits) {
    const k3_config *c = s->c;
    const k3_ops *ops = s->ops;
    const int64_t D = s->D;
    int64_t T = 0;
    K3_TRY(check_batch(s, b, act, &T));
    const bool res = c->attn_res_block_size > 0;
    const float eps = c->rms_norm_eps;

    if (s->p.first) {
        act->T = T;
        act->n_bank = 0;
        for (int64_t t = 0; t < T; t++) {
            k3_tensor row;
            K3_TRY(k3_tensor_rows(&s->w->embed, b->token_ids[t], 1, &row));
            K3_TRY(k3_tensor_to_f32(&row, act->h + t * D, D));
        }
    }
    float *h = act->h;
    const int64_t slab = T * D;
    for (int l = s->p.layer_begin; l < s->p.layer_end; l++) {
        const layer_vecs *lv = &s->vec[l];
        const float *a = h;
        bool restart = false;
        if (res) {
            if (act->n_bank > 0) {
                ops->attnres_mix(act->bank, act->n_bank, h, lv->attn_res, T, D, eps, s->xa);
                a = s->xa;
            }
            if (k3_config_is_block_start(c, l)) {
                if (act->n_bank >= k3_activ_max_bank(c))
                    return K3_ERR(K3_ERR_STATE, "layer %d: AttnRes bank full (%d)", l, act->n_bank);
                memcpy(act->bank + act->n_bank * slab, h, (size_t)slab * sizeof(float));
                act->n_bank++;
                restart = true;
            }
        }
        ops->rmsnorm(a, lv->input_norm, T, D, eps, s->xn);
        if (c->mixer[l] == K3_MIXER_KDA)
            K3_TRY(k3_layers_kda(s, l, b, s->xn, s->y));
        else
            K3_TRY(k3_layers_mla(s, l, b, s->xn, s->y));
        if (restart)
            memcpy(h, s->y, (size_t)slab * sizeof(float));
        else
            for (int64_t e = 0; e < slab; e++) h[e] += s->y[e];

        a = h;
        if (res && act->n_bank > 0) {
            ops->attnres_mix(act->bank, act->n_bank, h, lv->mlp_res, T, D, eps, s->xa);
            a = s->xa;
        }
        ops->rmsnorm(a, lv->post_norm, T, D, eps, s->xn);
        if (k3_config_is_moe(c, l))
            K3_TRY(moe_ffn(s, l, s->xn, T, ex, s->y));
        else
            K3_TRY(dense_ffn(s, l, s->xn, T, s->y));
        for (int64_t e = 0; e < slab; e++) h[e] += s->y[e];
        if (s->tap) s->tap(s->tap_ctx, l, h, T, D);
    }
    for (int i = 0; i < b->n_seqs; i++) b->states[i]->pos += b->n_tokens[i];

    if (s->p.last) {
        if (!logits) return K3_ERR(K3_ERR_ARG, "forward: last stage needs a logits buffer");
        /* rows that get logits: all, or each sequence's last token */
        int64_t n_rows = 0;
        if (all_logits) {
            memcpy(s->hsel, h, (size_t)slab * sizeof(float));
            n_rows = T;
        } else {
            int64_t t0 = 0;
            for (int i = 0; i < b->n_seqs; i++) {
                t0 += b->n_tokens[i];
                memcpy(s->hsel + n_rows * D, h + (t0 - 1) * D, (size_t)D * sizeof(float));
                n_rows++;
            }
        }
        if (res && act->n_bank > 0) {
            if (all_logits) {
                ops->attnres_mix(act->bank, act->n_bank, s->hsel, s->out_res, T, D, eps, s->hsel);
            } else {
                /* the bank slabs are [n_bank, T, D]: mix each selected token on its own (T = 1
                   views need contiguous sources, so stage them in bank1 [n_bank, D]) */
                int64_t t0 = 0;
                for (int i = 0; i < b->n_seqs; i++) {
                    t0 += b->n_tokens[i];
                    for (int j = 0; j < act->n_bank; j++)
                        memcpy(s->bank1 + j * D, act->bank + j * slab + (t0 - 1) * D,
                               (size_t)D * sizeof(float));
                    ops->attnres_mix(s->bank1, act->n_bank, s->hsel + i * D, s->out_res, 1, D, eps,
                                     s->hsel + i * D);
                }
            }
        }
        ops->rmsnorm(s->hsel, s->final_norm, n_rows, D, eps, s->hsel);
        const k3_tensor *head = c->tie_word_embeddings ? &s->w->embed : &s->w->lm_head;
        K3_TRY(ops->matmul(s->hsel, n_rows, head, logits));
    }
    return K3_OK;
}
