/* stage.c — the per-stage forward: stage/state lifetimes, the layer loop with Attention
 * Residuals (K3-MODEL.md §1.2-1.3) or a plain pre-norm residual (attn_res_block_size == 0),
 * the dense FFN, the MoE step (local, or driven through the comm handle: route + down,
 * dispatch, local experts, combine, finish), embedding, final mix + norm + LM head.
 *
 * Invariants: everything is allocated from the stage's backend in k3_stage_create /
 * k3_seq_state_create; the forward only validates the batch, then runs ops (no host loop touches
 * an activation, a cache or a weight: the guard backend proves it). AttnRes state of a token lives
 * in k3_activ (partial sum h + bank), so a stage boundary may fall anywhere. Weights are checked
 * (presence, dtype family, shape) once at create with errors naming the layer and tensor. */
#include "layers_internal.h"

#include <math.h>
#include <stdio.h>

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

k3_status k3_activ_alloc(k3_backend *be, k3_activ *a, const k3_config *cfg, int64_t max_tokens) {
    memset(a, 0, sizeof(*a));
    size_t td = (size_t)max_tokens * (size_t)cfg->hidden_size;
    K3_TRY(k3_backend_alloc(be, td * sizeof(float), "activation h", (void **)&a->h));
    int mb = k3_activ_max_bank(cfg);
    if (mb > 0) {
        k3_status st = k3_backend_alloc(be, (size_t)mb * td * sizeof(float), "AttnRes bank",
                                        (void **)&a->bank);
        if (st != K3_OK) {
            k3_backend_free(be, a->h);
            a->h = NULL;
            return st;
        }
    }
    return K3_OK;
}

void k3_activ_free(k3_backend *be, k3_activ *a) {
    if (!a) return;
    k3_backend_free(be, a->h);
    k3_backend_free(be, a->bank);
    memset(a, 0, sizeof(*a));
}

/* ---- create ------------------------------------------------------------------------------ */
static k3_status vec_f32(k3_backend *be, const k3_tensor *t, int64_t n, int layer, const char *name,
                         float **cursor, float **out) {
    K3_TRY(k3_layers_need(t, layer, name, n, -1));
    k3_status st = be->ops->to_f32(be, t, n, *cursor);
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
    K3_TRY(k3_backend_alloc(s->be, n * sizeof(float), "stage vectors", (void **)&s->vec_mem));
    K3_TRY(k3_calloc((void **)&s->vec, (size_t)c->n_layers * sizeof(layer_vecs),
                     "stage vector table"));
    float *cur = s->vec_mem;
    bool res = c->attn_res_block_size > 0;
    for (int l = s->p.layer_begin; l < s->p.layer_end; l++) {
        const k3_layer_w *lw = &s->w->layers[l];
        layer_vecs *v = &s->vec[l];
        K3_TRY(vec_f32(s->be, &lw->input_norm, D, l, "input_layernorm", &cur, &v->input_norm));
        K3_TRY(vec_f32(s->be, &lw->post_attn_norm, D, l, "post_attention_layernorm", &cur,
                       &v->post_norm));
        if (res) {
            K3_TRY(vec_f32(s->be, &lw->attn_res_score, D, l, "self_attention_res score", &cur,
                           &v->attn_res));
            K3_TRY(vec_f32(s->be, &lw->mlp_res_score, D, l, "mlp_res score", &cur, &v->mlp_res));
        }
        if (c->mixer[l] == K3_MIXER_KDA) {
            const k3_tensor *cv[3] = {&lw->q_conv, &lw->k_conv, &lw->v_conv};
            const char *cn[3] = {"q_conv1d", "k_conv1d", "v_conv1d"};
            for (int j = 0; j < 3; j++)
                K3_TRY(vec_f32(s->be, cv[j], P * K, l, cn[j], &cur, &v->conv[j]));
            K3_TRY(vec_f32(s->be, &lw->dt_bias, P, l, "dt_bias", &cur, &v->dt_bias));
            K3_TRY(vec_f32(s->be, &lw->o_norm, c->kda_head_dim, l, "o_norm", &cur, &v->o_norm));
            /* only the first kda_n_heads entries are used (K3 pads A_log to 128) */
            K3_TRY(vec_f32(s->be, &lw->a_log, c->kda_a_log_len, l, "A_log", &cur, &v->a_log));
        } else {
            if (c->q_lora_rank > 0)
                K3_TRY(vec_f32(s->be, &lw->q_a_norm, c->q_lora_rank, l, "q_a_layernorm", &cur,
                               &v->q_a_norm));
            K3_TRY(vec_f32(s->be, &lw->kv_a_norm, c->kv_lora_rank, l, "kv_a_layernorm", &cur,
                           &v->kv_a_norm));
        }
        K3_ASSERT((size_t)(cur - s->vec_mem) <= n);
    }
    if (s->p.last) {
        K3_TRY(vec_f32(s->be, &s->w->final_norm, D, -1, "model.norm", &cur, &s->final_norm));
        if (res)
            K3_TRY(vec_f32(s->be, &s->w->out_res_score, D, -1, "output_attn_res score", &cur,
                           &s->out_res));
    }
    return K3_OK;
}

static k3_status buf(k3_stage *s, void *p, size_t n_floats, const char *what) {
    return k3_backend_alloc(s->be, (n_floats ? n_floats : 1) * sizeof(float), what, (void **)p);
}
static k3_status hbuf(void *p, size_t n_bytes, const char *what) {
    return k3_calloc((void **)p, n_bytes ? n_bytes : 1, what);
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
    K3_TRY(buf(s, &s->xa, T * D, "scratch xa"));
    K3_TRY(buf(s, &s->xn, T * D, "scratch xn"));
    K3_TRY(buf(s, &s->y, T * D, "scratch y"));
    K3_TRY(buf(s, &s->hsel, T * D, "scratch head rows"));
    if (any_kda) {
        const size_t P = (size_t)c->kda_n_heads * (size_t)c->kda_head_dim;
        float **big[] = {&s->kq, &s->kk, &s->kv, &s->kqc, &s->kkc, &s->kvc, &s->kr, &s->kg, &s->ko};
        for (size_t i = 0; i < K3_ARRAY_LEN(big); i++) K3_TRY(buf(s, big[i], T * P, "KDA scratch"));
        size_t R = (size_t)c->kda_gate_rank;
        for (int l = s->p.layer_begin; l < s->p.layer_end; l++)
            if (s->w->layers[l].g_a.data) R = K3_MAX(R, (size_t)s->w->layers[l].g_a.shape[0]);
        K3_TRY(buf(s, &s->kfa, T * R, "KDA gate scratch"));
        K3_TRY(buf(s, &s->kbeta, T * (size_t)c->kda_n_heads, "KDA beta"));
        if (s->kda_chunk > 1)
            K3_TRY(buf(s, &s->kwork,
                       (size_t)c->kda_n_heads *
                           k3_kda_chunk_work_floats(s->kda_chunk, c->kda_head_dim, c->kda_head_dim),
                       "KDA chunk work"));
    }
    if (any_mla) {
        const size_t H = (size_t)c->n_heads, dn = (size_t)c->qk_nope_head_dim,
                     dr = (size_t)c->qk_rope_head_dim, dv = (size_t)c->v_head_dim,
                     Rkv = (size_t)c->kv_lora_rank, W = Rkv + dr;
        K3_TRY(buf(s, &s->mcq, T * (size_t)K3_MAX(c->q_lora_rank, 1), "MLA cq"));
        K3_TRY(buf(s, &s->mq, T * H * (dn + dr), "MLA q"));
        K3_TRY(buf(s, &s->mckv, T * W, "MLA ckv"));
        K3_TRY(buf(s, &s->mhwork, T * (K3_MAX(dn, Rkv) + K3_MAX(Rkv, dv)), "MLA per-head staging"));
        K3_TRY(buf(s, &s->mqc, T * H * W, "MLA absorbed q"));
        K3_TRY(buf(s, &s->molat, T * H * Rkv, "MLA latent out"));
        K3_TRY(buf(s, &s->mattn, T * H * dv, "MLA attn"));
        K3_TRY(buf(s, &s->mgate, T * H * dv, "MLA gate"));
    }
    if (any_dense) {
        K3_TRY(buf(s, &s->fg, T * (size_t)c->intermediate_size, "FFN gate"));
        K3_TRY(buf(s, &s->fu, T * (size_t)c->intermediate_size, "FFN up"));
    }
    if (any_moe) {
        const size_t K = (size_t)c->n_experts_per_tok, Lw = (size_t)k3_moe_row_width(c);
        K3_TRY(k3_moe_check_config(c));
        K3_TRY(buf(s, &s->moe_scratch, k3_moe_scratch_floats(c, (int64_t)T), "MoE scratch"));
        if (s->p.comm) {
            /* a lane receives at most n_lanes·T·K items (every lane's T tokens, K slots each) */
            const size_t TK = T * K, R = (size_t)s->p.n_lanes * TK;
            /* ids [TK] | weights [TK] in one buffer: the step reads both back in one copy */
            K3_TRY(buf(s, &s->moe_ids, 2 * TK, "MoE ids and weights"));
            K3_TRY(buf(s, &s->moe_r, T * Lw, "MoE latent rows"));
            K3_TRY(buf(s, &s->moe_comb, TK * Lw, "MoE combined rows"));
            K3_TRY(buf(s, &s->moe_acc, T * Lw, "MoE weighted sum"));
            K3_TRY(buf(s, &s->moe_eo, R * Lw, "MoE received item outputs"));
            K3_TRY(buf(s, &s->moe_xs, k3_moe_rows_scratch_floats(c, (int64_t)R),
                       "MoE expert scratch"));
            K3_TRY(hbuf(&s->moe_xh, k3_moe_rows_host_ints(c, (int64_t)R) * sizeof(int64_t),
                        "MoE expert host scratch"));
            K3_TRY(hbuf(&s->h_ids, 2 * TK * sizeof(int32_t), "MoE host ids and weights"));
            K3_TRY(hbuf(&s->h_row, TK * sizeof(int32_t), "MoE host rows"));
            K3_TRY(hbuf(&s->h_lane, TK * sizeof(int32_t), "MoE host lanes"));
            s->ep_on = k3_layers_moe_ep_usable(s);
            if (s->ep_on) K3_TRY(k3_layers_moe_ep_create(s));
        }
    }
    return K3_OK;
}

static k3_status pools_create(k3_stage *s);

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
    s->pad_slot = s->pad_blk = -1;
    s->c = c;
    s->w = p->w;
    s->be = p->be;
    s->D = c->hidden_size;
    s->T_max = p->max_tokens;
    s->kda_chunk = p->kda_chunk == 0 ? K3_KDA_CHUNK_DEFAULT : p->kda_chunk;
    k3_status st = K3_OK;
    if (!s->be) {
        k3_backend_params bp = {.n_threads = p->n_threads};
        st = k3_backend_create("cpu", &bp, &s->be);
        s->own_be = st == K3_OK;
    }
    for (int op = 0; st == K3_OK && op < K3_OP_COUNT; op++)
        if (!k3_backend_supports_op(s->be, op, K3_DT_COUNT))
            st = K3_ERR(K3_ERR_ARG, "stage: backend %s does not run op %s (needed by the forward)",
                        s->be->name, k3_op_name(op));
    if (st == K3_OK && p->comm && (p->n_lanes < 1 || !p->expert_lane))
        st = K3_ERR(K3_ERR_ARG, "stage: a comm handle needs n_lanes >= 1 and the expert lane map");
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
    if (st == K3_OK) st = pools_create(s);
    if (st != K3_OK) {
        k3_stage_destroy(s);
        return st;
    }
    *out = s;
    return K3_OK;
}

void k3_stage_destroy(k3_stage *s) {
    if (!s) return;
    k3_layers_graph_free(s);
    if (s->be) {
        float *bufs[] = {
            s->xa,          s->xn,     s->y,        s->hsel,     s->bank_sel, s->kq,     s->kk,
            s->kv,          s->kqc,    s->kkc,      s->kvc,      s->kr,       s->kg,     s->ko,
            s->kfa,         s->kbeta,  s->kwork,    s->mcq,      s->mq,       s->mckv,   s->mhwork,
            s->mqc,         s->molat,  s->mattn,    s->mgate,    s->mwork,    s->fg,     s->fu,
            s->moe_scratch, s->moe_r,  s->moe_comb, s->moe_acc,  s->moe_eo,   s->moe_xs, s->vec_mem,
            s->conv_pool,   s->S_pool, s->kv_pool,  s->snap_pool};
        for (size_t i = 0; i < K3_ARRAY_LEN(bufs); i++) k3_backend_free(s->be, bufs[i]);
        k3_backend_free(s->be, s->step_dev);
        k3_backend_free(s->be, s->moe_ids);
        k3_layers_moe_ep_free(s);
    }
    void *hosts[] = {s->moe_xh,  s->h_ids,     s->h_row,    s->h_lane,    s->tap_buf,
                     s->blk_ref, s->slot_used, s->free_blk, s->step_host, s->h_ntok,
                     s->h_pos,   s->h_slot,    s->h_blk,    s->h_nf};
    for (size_t i = 0; i < K3_ARRAY_LEN(hosts); i++) k3_free(hosts[i]);
    k3_free(s->vec);
    if (s->own_be) k3_backend_destroy(s->be);
    k3_free(s);
}

const k3_stage_params *k3_stage_get_params(const k3_stage *s) {
    return &s->p;
}

k3_status k3_stage_set_tap(k3_stage *s, k3_layer_tap tap, void *ctx) {
    if (tap && !s->tap_buf)
        K3_TRY(k3_calloc((void **)&s->tap_buf, (size_t)s->T_max * (size_t)s->D * sizeof(float),
                         "layer tap buffer"));
    s->tap = tap;
    s->tap_ctx = ctx;
    return K3_OK;
}

k3_backend *k3_stage_backend(const k3_stage *s) {
    return s->be;
}

/* ---- the state pools and sequence states ----------------------------------------------------
 * Slots (KDA recurrent + short-conv state of every KDA layer of the stage, slot-major so one
 * sequence's states are one contiguous range: a prefix-cache snapshot is one copy) and the paged
 * MLA latent cache (layer-major [n_mla, n_blocks, K3_KV_BLOCK, W]; a sequence's block table maps
 * its positions to blocks, allocated from the free list as it grows and returned when it ends).
 * A stage created with max_seqs sizes them once (what a serving rank does); without, each
 * k3_seq_state_create grows them by one slot and max_ctx of blocks (tests, benchmarks). */
static int blocks_of(int64_t n_tokens) {
    return (int)((n_tokens + K3_KV_BLOCK - 1) / K3_KV_BLOCK);
}
static int64_t kv_block_floats(const k3_stage *s) {
    return (int64_t)K3_KV_BLOCK * (s->c->kv_lora_rank + s->c->qk_rope_head_dim);
}

/* Backend buffer *p of old_n floats -> new_n floats (rows × old_row floats kept, each row now
   new_row floats apart: the kv pool's layers), contents copied. */
static k3_status regrow(k3_stage *s, float **p, int64_t rows, int64_t old_row, int64_t new_row,
                        const char *what) {
    if (new_row == old_row && *p) return K3_OK;
    float *q;
    K3_TRY(buf(s, &q, (size_t)(rows * new_row), what));
    if (*p && old_row > 0 && rows > 0)
        K3_TRY(s->be->ops->copy2d(s->be, q, new_row, *p, old_row, rows, old_row));
    k3_backend_free(s->be, *p);
    *p = q;
    return K3_OK;
}
static k3_status hregrow(void *pp, size_t old_bytes, size_t new_bytes, const char *what) {
    void **p = pp, *q;
    K3_TRY(hbuf(&q, new_bytes, what));
    if (*p) memcpy(q, *p, K3_MIN(old_bytes, new_bytes));
    k3_free(*p);
    *p = q;
    return K3_OK;
}

/* The pools to n_slots slots, n_blocks blocks, block tables of max_blocks, contexts up to
   max_ctx (never smaller than now). */
static k3_status pools_resize(k3_stage *s, int n_slots, int n_blocks, int max_blocks,
                              int64_t max_ctx) {
    const k3_config *c = s->c;
    const int os = s->n_slots, ob = s->n_blocks, omb = s->max_blocks;
    if (s->n_mla == 0) n_blocks = max_blocks = 0;
    const int64_t P = (int64_t)c->kda_n_heads * c->kda_head_dim;
    s->conv_slot = (int64_t)s->n_kda * 3 * K3_MAX(c->kda_conv_kernel - 1, 0) * P;
    s->S_slot = (int64_t)s->n_kda * P * c->kda_head_dim;
    if (n_slots > os) {
        if (s->conv_slot > 0)
            K3_TRY(regrow(s, &s->conv_pool, 1, os * s->conv_slot, n_slots * s->conv_slot,
                          "KDA conv state slots"));
        if (s->S_slot > 0)
            K3_TRY(regrow(s, &s->S_pool, 1, os * s->S_slot, n_slots * s->S_slot,
                          "KDA recurrent state slots"));
        K3_TRY(hregrow(&s->slot_used, (size_t)os, (size_t)n_slots, "slot table"));
        int32_t **h[] = {&s->h_ntok, &s->h_pos, &s->h_slot, &s->h_nf};
        for (size_t i = 0; i < K3_ARRAY_LEN(h); i++)
            K3_TRY(hregrow(h[i], 0, (size_t)n_slots * sizeof(int32_t), "batch scratch (host)"));
        s->n_slots = n_slots;
    }
    if (n_blocks > ob) {
        K3_TRY(regrow(s, &s->kv_pool, s->n_mla, ob * kv_block_floats(s),
                      n_blocks * kv_block_floats(s), "paged MLA latent cache"));
        K3_TRY(hregrow(&s->free_blk, (size_t)s->n_free * sizeof(int32_t),
                       (size_t)n_blocks * sizeof(int32_t), "cache free list"));
        K3_TRY(hregrow(&s->blk_ref, (size_t)ob * sizeof(int32_t),
                       (size_t)n_blocks * sizeof(int32_t), "cache block holders"));
        for (int b = n_blocks - 1; b >= ob; b--) s->free_blk[s->n_free++] = b;
        s->n_blocks = n_blocks;
    }
    s->max_blocks = K3_MAX(omb, max_blocks);
    if (n_slots > os || s->max_blocks > omb || !s->step_dev) {
        K3_TRY(hregrow(&s->h_blk, 0, (size_t)s->n_slots * (size_t)s->max_blocks * sizeof(int32_t),
                       "block tables (host)"));
        s->step_ints =
            k3_seqs_floats(s->n_slots, s->max_blocks) + (size_t)s->n_slots + (size_t)s->T_max;
        K3_TRY(hregrow(&s->step_host, 0, s->step_ints * sizeof(int32_t), "step buffer (host)"));
        k3_backend_free(s->be, s->step_dev);
        s->step_dev = NULL;
        K3_TRY(buf(s, &s->step_dev, s->step_ints, "step buffer (descriptor, flags, ids)"));
    }
    if (max_ctx > s->max_ctx) {
        if (s->n_mla > 0)
            K3_TRY(regrow(s, &s->mwork, 1, 0,
                          (int64_t)k3_attn_latent_causal_work_floats(max_ctx, c->n_heads),
                          "attention scratch"));
        s->max_ctx = max_ctx;
    }
    if (n_slots > os && k3_activ_max_bank(c) > 0)
        K3_TRY(regrow(s, &s->bank_sel, 1, 0, (int64_t)k3_activ_max_bank(c) * s->n_slots * s->D,
                      "last-token bank rows"));
    return K3_OK;
}

static k3_status pools_create(k3_stage *s) {
    const k3_stage_params *p = &s->p;
    if (p->max_seqs <= 0) return K3_OK; /* grown by k3_seq_state_create */
    if (p->max_ctx < 1)
        return K3_ERR(K3_ERR_ARG, "stage: max_seqs %d needs max_ctx >= 1", p->max_seqs);
    s->fixed = true;
    const int64_t cache_tokens =
        p->kv_cache_tokens > 0 ? p->kv_cache_tokens : (int64_t)p->max_seqs * p->max_ctx;
    if (blocks_of(cache_tokens) < 1 || cache_tokens / K3_KV_BLOCK > INT32_MAX / 2)
        return K3_ERR(K3_ERR_ARG, "stage: kv_cache_tokens %lld", (long long)cache_tokens);
    const int pad = p->graphs ? 1 : 0; /* the pad rows' slot and block (k3_layers_graph_init) */
    K3_TRY(pools_resize(s, p->max_seqs + pad, blocks_of(cache_tokens) + pad, blocks_of(p->max_ctx),
                        p->max_ctx));
    if (pad) K3_TRY(k3_layers_graph_init(s));
    if (p->n_snapshots < 0)
        return K3_ERR(K3_ERR_ARG, "stage: n_snapshots %d must be >= 0", p->n_snapshots);
    s->n_snaps = p->n_snapshots;
    const int64_t per = s->conv_slot + s->S_slot;
    if (s->n_snaps > 0 && per > 0)
        K3_TRY(buf(s, &s->snap_pool, (size_t)s->n_snaps * (size_t)per, "prefix-cache snapshots"));
    return K3_OK;
}

void k3_stage_cache_usage(const k3_stage *s, int *free_blocks, int *total_blocks) {
    if (free_blocks) *free_blocks = s->n_free;
    if (total_blocks) *total_blocks = s->n_blocks - (s->pad_blk >= 0);
}

static k3_status seq_state_zero(k3_seq_state *st);

k3_status k3_seq_state_create(const k3_stage *cs, int64_t max_ctx, k3_seq_state **out) {
    *out = NULL;
    if (max_ctx < 1) return K3_ERR(K3_ERR_ARG, "sequence state: max_ctx must be >= 1");
    k3_stage *s = (k3_stage *)cs; /* takes a slot (and may grow the pools: documented) */
    if (s->fixed && max_ctx > s->max_ctx)
        return K3_ERR(K3_ERR_ARG, "sequence state: max_ctx %lld > the stage's max_ctx %lld",
                      (long long)max_ctx, (long long)s->max_ctx);
    int slot = 0;
    while (slot < s->n_slots && s->slot_used[slot]) slot++;
    if (slot == s->n_slots && s->fixed)
        return K3_ERR(K3_ERR_STATE, "sequence state: all %d slots of the stage are in use",
                      s->n_slots - (s->pad_slot >= 0));
    if (!s->fixed) /* a slot (new or reused) and max_ctx of blocks more: never short */
        K3_TRY(pools_resize(s, K3_MAX(s->n_slots, slot + 1), s->n_blocks + blocks_of(max_ctx),
                            blocks_of(max_ctx), max_ctx));
    k3_seq_state *st;
    K3_TRY(k3_calloc((void **)&st, sizeof(*st), "sequence state"));
    st->s = s;
    st->slot = slot;
    st->max_ctx = max_ctx;
    k3_status e =
        hbuf(&st->blk, (size_t)K3_MAX(blocks_of(max_ctx), 1) * sizeof(int32_t), "block table");
    if (e == K3_OK) {
        s->slot_used[slot] = true;
        e = seq_state_zero(st);
    }
    if (e != K3_OK) {
        k3_seq_state_destroy(st);
        return e;
    }
    *out = st;
    return K3_OK;
}

void k3_seq_state_release(k3_seq_state *st) {
    k3_stage *s = st->s;
    for (int i = st->n_blk - 1; i >= 0; i--) k3_layers_block_drop(s, st->blk[i]);
    st->n_blk = 0;
}

void k3_seq_state_destroy(k3_seq_state *st) {
    if (!st) return;
    k3_seq_state_release(st);
    if (st->blk && st->slot < st->s->n_slots) st->s->slot_used[st->slot] = false;
    k3_free(st->blk);
    k3_free(st);
}

/* A new sequence's KDA state needs no reset op: short_conv_seqs and kda_seqs take a sequence at
 * position 0 from a zero state (kernels/k3_kernels.h), so a prefill step's op count does not
 * depend on how many sequences it opens (docs/DESIGN.md §3a). Reset returns the blocks and the
 * position; the slot is zeroed once, when it is created (its bytes are defined for snapshots). */
k3_status k3_seq_state_reset(k3_seq_state *st) {
    k3_seq_state_release(st); /* its pages back to the pool: the cache beyond pos is never read */
    st->pos = 0;
    return K3_OK;
}

static k3_status seq_state_zero(k3_seq_state *st) {
    k3_stage *s = st->s;
    k3_backend *be = s->be;
    if (s->conv_slot > 0)
        K3_TRY(be->ops->fill(be, s->conv_pool + (size_t)st->slot * (size_t)s->conv_slot,
                             s->conv_slot, 0.0f));
    if (s->S_slot > 0)
        K3_TRY(
            be->ops->fill(be, s->S_pool + (size_t)st->slot * (size_t)s->S_slot, s->S_slot, 0.0f));
    st->pos = 0;
    return K3_OK;
}

int64_t k3_seq_state_pos(const k3_seq_state *st) {
    return st->pos;
}
int64_t k3_seq_state_max_ctx(const k3_seq_state *st) {
    return st->max_ctx;
}
size_t k3_seq_state_bytes(const k3_seq_state *st) {
    const k3_stage *s = st->s;
    return (size_t)(s->conv_slot + s->S_slot +
                    (int64_t)blocks_of(st->max_ctx) * s->n_mla * kv_block_floats(s)) *
           sizeof(float);
}

/* ---- FFN ------------------------------------------------------------------------------------ */
static k3_status dense_ffn(k3_stage *s, int l, const float *x, int64_t T, float *y) {
    const k3_config *c = s->c;
    const k3_layer_w *lw = &s->w->layers[l];
    k3_backend *be = s->be;
    int64_t n = T * c->intermediate_size;
    const k3_mm gu[2] = {{x, T, &lw->gate_proj, s->fg}, {x, T, &lw->up_proj, s->fu}};
    K3_TRY(be->ops->matmul_group(be, gu, 2));
    if (c->act == K3_ACT_SWIGLU)
        K3_TRY(be->ops->swiglu(be, s->fg, s->fu, n, s->fg));
    else
        K3_TRY(be->ops->situ(be, s->fg, s->fu, n, c->situ_beta, c->situ_linear_beta, s->fg));
    return be->ops->matmul(be, s->fg, T, &lw->down_proj, y);
}

/* The distributed MoE step of layer l over T tokens (T may be 0: the lane only serves its
 * experts). Phases: route + down (T tokens) → dispatch (each token row once to each owner lane
 * of its experts) → local experts on the received items → [pre-sum per (token, owner)] →
 * combine → weighted sum in slot order (deterministic) or sum of the owners' pre-sums in lane
 * order → finish. */
static k3_status moe_step(k3_stage *s, int l, const float *x, int64_t T, float *y) {
    const k3_config *c = s->c;
    const k3_layer_w *lw = &s->w->layers[l];
    k3_backend *be = s->be;
    const int K = c->n_experts_per_tok;
    const int64_t Lw = k3_moe_row_width(c), n = T * K;
    const k3_combine_mode mode = s->p.deterministic ? K3_COMBINE_PER_ITEM : K3_COMBINE_PRESUM;
    /* the step's weights follow its ids: [n ids | n weights] at the start of moe_ids */
    float *wd = (float *)(void *)(s->moe_ids + n);
    if (T > 0) {
        K3_TRY(k3_moe_router(be, c, lw, x, T, s->moe_ids, wd, s->moe_scratch));
        K3_TRY(k3_moe_down(be, c, lw, x, T, s->moe_r));
        /* the layer's one host read: the route is built on the host (the MPI exchange's
           metadata); ids and weights come back in one copy */
        K3_TRY(k3_backend_download(be, s->h_ids, s->moe_ids, (size_t)(2 * n) * sizeof(int32_t)));
    }
    const int32_t *lane = s->p.expert_lane + (size_t)l * (size_t)c->n_experts;
    for (int64_t i = 0; i < n; i++) {
        if (s->h_ids[i] < 0 || s->h_ids[i] >= c->n_experts)
            return K3_ERR(K3_ERR_INTERNAL, "layer %d: MoE row %lld has expert %d", l, (long long)i,
                          s->h_ids[i]);
        s->h_row[i] = (int32_t)(i / K);
        s->h_lane[i] = lane[s->h_ids[i]];
    }
    k3_moe_route route = {.n_rows = T,
                          .n_items = n,
                          .item_row = s->h_row,
                          .item_lane = s->h_lane,
                          .item_tag = s->h_ids,
                          .item_w = (const float *)(const void *)(s->h_ids + n)};
    k3_dispatch_view v;
    K3_TRY(k3_comm_moe_dispatch(s->p.comm, be, s->moe_r, Lw, &route, mode, &v));
    if (v.n_items > 0) {
        float *item_out = mode == K3_COMBINE_PER_ITEM ? v.out : s->moe_eo;
        K3_TRY(k3_moe_expert_rows(be, c, lw, v.rows, v.item_row, v.item_tag, v.n_items, item_out,
                                  s->moe_xs, s->moe_xh));
        if (mode == K3_COMBINE_PRESUM) /* Σ over this owner's experts of each row, slot order */
            K3_TRY(be->ops->rows_wsum(be, item_out, v.item_w, v.row_seg, 0, v.n_rows, Lw, v.out));
    }
    const int64_t *pair_seg = NULL;
    K3_TRY(k3_comm_moe_combine(s->p.comm, be, s->moe_comb, &pair_seg));
    if (T == 0) return K3_OK;
    if (mode == K3_COMBINE_PER_ITEM)
        K3_TRY(be->ops->rows_wsum(be, s->moe_comb, wd, NULL, K, T, Lw, s->moe_acc));
    else
        K3_TRY(be->ops->rows_wsum(be, s->moe_comb, NULL, pair_seg, 0, T, Lw, s->moe_acc));
    return k3_moe_finish(be, c, lw, x, s->moe_acc, T, y, s->moe_scratch);
}

static k3_status moe_ffn(k3_stage *s, int l, const float *x, int64_t T, float *y) {
    if (!s->p.comm) return k3_moe_forward(s->be, s->c, &s->w->layers[l], x, T, y, s->moe_scratch);
    if (s->ep_on && !s->ep_host) return k3_layers_moe_ep_step(s, l, x, T, y);
    return moe_step(s, l, x, T, y);
}

void k3_stage_set_moe_host(k3_stage *s, bool host) {
    s->ep_host = host;
}

/* The idle lane's exchanges, its checks deferred as a step's are (one read at the end). */
k3_status k3_stage_idle_step(k3_stage *s) {
    if (!s->p.comm) return K3_OK;
    K3_TRY(k3_backend_errors_defer(s->be, true));
    k3_status st = K3_OK;
    for (int l = s->p.layer_begin; st == K3_OK && l < s->p.layer_end; l++)
        if (k3_config_is_moe(s->c, l)) {
            k3_backend_errors_layer(s->be, l);
            st = s->ep_on && !s->ep_host ? k3_layers_moe_ep_step(s, l, NULL, 0, NULL)
                                         : moe_step(s, l, NULL, 0, NULL);
        }
    if (st == K3_OK) st = k3_backend_errors_fetch(s->be);
    if (st == K3_OK) st = k3_backend_errors_verdict(s->be);
    const k3_status off = k3_backend_errors_defer(s->be, false);
    return st != K3_OK ? st : off;
}

/* ---- the forward ---------------------------------------------------------------------------- */
k3_status k3_layers_check_batch(const k3_stage *s, const k3_batch *b, const k3_activ *act,
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

/* ---- where a non-finite activation first appears (k3_batch.nonfinite) -------------------------
 * After each sub-block the nonfinite_rows op looks for NaN/Inf in the output rows of each
 * sequence not yet marked and marks it in a flag array on the backend (the step buffer); the
 * host reads the flags once, at the end of the step. */
const char *k3_nf_op_name(k3_nf_op op) {
    static const char *names[] = {"?",
                                  "embedding rows",
                                  "KDA attention output",
                                  "MLA attention output",
                                  "MoE FFN output",
                                  "dense FFN output",
                                  "logits (final norm + lm_head)"};
    _Static_assert(K3_ARRAY_LEN(names) == K3_NF_OP_COUNT, "one name per k3_nf_op");
    return op > 0 && op < K3_NF_OP_COUNT ? names[op] : "?";
}

/* An op's error inside layer l, with the layer in front ("layer 2: MoE router: ..."). */
static k3_status in_layer(k3_status st, int l) {
    if (st == K3_OK) return st;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", k3_last_error());
    return K3_ERR(st, "layer %d: %s", l, msg);
}

/* Blocks for every sequence's positions up to pos + n (none without MLA layers): all or none, so
   a pool that runs out leaves every state as it was and names the sequence. */
k3_status k3_layers_take_blocks(k3_stage *s, const k3_batch *b) {
    if (s->n_mla == 0) return K3_OK;
    int need = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        const k3_seq_state *st = b->states[i];
        need += blocks_of(st->pos + b->n_tokens[i]) - st->n_blk;
        if (need > s->n_free)
            return K3_ERR(K3_ERR_NOMEM,
                          "forward: the paged MLA cache is full: sequence %d (%lld + %d tokens) "
                          "would take block %d of %d (%d tokens each, --kv-cache-tokens)",
                          i, (long long)st->pos, b->n_tokens[i], s->n_blocks - s->n_free + need,
                          s->n_blocks, K3_KV_BLOCK);
    }
    for (int i = 0; i < b->n_seqs; i++) {
        k3_seq_state *st = b->states[i];
        while (st->n_blk < blocks_of(st->pos + b->n_tokens[i])) {
            const int32_t blk = s->free_blk[--s->n_free];
            s->blk_ref[blk] = 1;
            st->blk[st->n_blk++] = blk;
        }
    }
    return K3_OK;
}

/* The step buffer: the descriptor, the non-finite flags (-1: marked by an earlier stage) and the
   token ids, laid out on the host and uploaded in one copy. */
static k3_status upload_step(k3_stage *s, const k3_batch *b, int64_t T, k3_seqs *sq,
                             int32_t **flags, int32_t **ids) {
    K3_TRY(k3_layers_take_blocks(s, b));
    /* block table rows as wide as this batch's longest sequence needs, not max_ctx: what goes up
       each step grows with the contexts in the batch (a short batch under --max-ctx 1M is not
       16k blocks a row) */
    const int n = b->n_seqs;
    int mb = 0;
    for (int i = 0; i < n; i++) mb = K3_MAX(mb, b->states[i]->n_blk);
    K3_ASSERT(mb <= s->max_blocks);
    for (int i = 0; i < n; i++) {
        const k3_seq_state *st = b->states[i];
        s->h_ntok[i] = b->n_tokens[i];
        s->h_pos[i] = (int32_t)st->pos;
        s->h_slot[i] = st->slot;
        if (mb > 0) {
            memcpy(s->h_blk + (size_t)i * mb, st->blk, (size_t)st->n_blk * sizeof(int32_t));
            for (int j = st->n_blk; j < mb; j++) s->h_blk[(size_t)i * mb + j] = -1;
        }
    }
    const size_t nd = k3_seqs_floats(n, mb);
    K3_TRY(k3_seqs_build(n, s->h_ntok, s->h_pos, s->h_slot, mb > 0 ? s->h_blk : NULL, mb,
                         s->step_host, s->step_dev, sq));
    int32_t *hf = s->step_host + nd, *hi = hf + n;
    for (int i = 0; i < n; i++) hf[i] = b->nonfinite ? b->nonfinite[i] : 0;
    size_t n_ints = nd + (size_t)n;
    if (s->p.first && b->token_ids) {
        memcpy(hi, b->token_ids, (size_t)T * sizeof(int32_t));
        n_ints += (size_t)T;
    }
    *flags = s->step_dev + nd;
    *ids = s->step_dev + nd + n;
    return k3_backend_upload_async(s->be, s->step_dev, s->step_host, n_ints * sizeof(int32_t));
}

k3_status k3_layers_step_begin(k3_stage *s, const k3_batch *b, k3_seqs *sq) {
    int64_t T = 0;
    int32_t *flags, *ids;
    for (int i = 0; i < b->n_seqs; i++) T += b->n_tokens[i];
    return upload_step(s, b, T, sq, &flags, &ids);
}

static k3_status forward(k3_stage *s, const k3_batch *b, k3_activ *act, bool all_logits,
                         float *logits, bool *fetched);

/* The step with its error-word checks deferred to its end (k3_backend_errors_*: on cuda, the
   router's and the embedding's checks make no host sync of their own); their verdict follows the
   step's read of its flags. */
k3_status k3_stage_forward(k3_stage *s, const k3_batch *b, k3_activ *act, bool all_logits,
                           float *logits) {
    K3_TRY(k3_backend_errors_defer(s->be, true));
    bool fetched = false;
    k3_status st = forward(s, b, act, all_logits, logits, &fetched);
    if (st == K3_OK && !fetched) st = k3_backend_errors_fetch(s->be);
    if (st == K3_OK) st = k3_backend_errors_verdict(s->be);
    const k3_status off = k3_backend_errors_defer(s->be, false);
    return st != K3_OK ? st : off;
}

void k3_stage_set_logits_host(k3_stage *s, float *host) {
    s->logits_host = host;
}
bool k3_stage_logits_fetched(const k3_stage *s) {
    return s->logits_fetched;
}

static k3_status forward(k3_stage *s, const k3_batch *b, k3_activ *act, bool all_logits,
                         float *logits, bool *fetched) {
    s->logits_fetched = false;
    int64_t T = 0;
    K3_TRY(k3_layers_check_batch(s, b, act, &T));
    if (s->p.last && !logits)
        return K3_ERR(K3_ERR_ARG, "forward: last stage needs a logits buffer");
    k3_seqs sq;
    int32_t *flags, *ids;
    K3_TRY(upload_step(s, b, T, &sq, &flags, &ids));
    const bool nf = b->nonfinite != NULL;
    K3_TRY(k3_layers_forward_ops(s, &sq, nf, act, all_logits, logits, flags, ids));
    for (int i = 0; i < b->n_seqs; i++) b->states[i]->pos += b->n_tokens[i];
    if (s->p.last && s->logits_host) { /* read with the flags below: one host sync */
        const int64_t n_rows = all_logits ? T : b->n_seqs;
        K3_TRY(k3_backend_download_async(s->be, s->logits_host, logits,
                                         (size_t)(n_rows * s->c->vocab_size) * sizeof(float)));
        s->logits_fetched = true;
    }
    /* the step's one read of the flags (a sequence marked upstream keeps its -1) */
    if (nf) { /* the deferred checks come back with it */
        K3_TRY(k3_backend_errors_fetch(s->be));
        *fetched = true;
        K3_TRY(k3_backend_download(s->be, s->h_nf, flags, (size_t)b->n_seqs * sizeof(int32_t)));
        memcpy(b->nonfinite, s->h_nf, (size_t)b->n_seqs * sizeof(int32_t));
    } else if (s->logits_fetched) { /* the logits' read brings the deferred checks */
        K3_TRY(k3_backend_errors_fetch(s->be));
        *fetched = true;
        K3_TRY(k3_backend_sync(s->be));
    }
    return K3_OK;
}

k3_status k3_layers_forward_ops(k3_stage *s, const k3_seqs *sqp, bool nf, k3_activ *act,
                                bool all_logits, float *logits, int32_t *flags,
                                const int32_t *ids) {
    const k3_config *c = s->c;
    k3_backend *be = s->be;
    const k3_ops *ops = be->ops;
    const int64_t D = s->D, T = sqp->T;
    const int n_seqs = sqp->n_seqs;
    const k3_seqs sq = *sqp;
    const bool res = c->attn_res_block_size > 0;
    const float eps = c->rms_norm_eps;
#define NF_CHECK(y, layer, op)                                                                     \
    do {                                                                                           \
        if (nf)                                                                                    \
            K3_TRY(ops->nonfinite_rows(be, &sq, (y), D, false, k3_nf_code((layer), (op)), flags)); \
    } while (0)

    if (s->p.first) {
        act->T = T;
        act->n_bank = 0;
        K3_TRY(ops->embed_rows(be, &s->w->embed, ids, T, act->h));
        NF_CHECK(act->h, s->p.layer_begin, K3_NF_EMBED);
    }
    float *h = act->h;
    const int64_t slab = T * D;
    for (int l = s->p.layer_begin; l < s->p.layer_end; l++) {
        const layer_vecs *lv = &s->vec[l];
        const float *a = h;
        k3_backend_errors_layer(be, l); /* a deferred check's error names its layer */
        bool restart = false;
        if (res) {
            if (act->n_bank > 0) {
                K3_TRY(ops->attnres_mix(be, act->bank, act->n_bank, h, lv->attn_res, T, D, eps,
                                        s->xa));
                a = s->xa;
            }
            if (k3_config_is_block_start(c, l)) {
                if (act->n_bank >= k3_activ_max_bank(c))
                    return K3_ERR(K3_ERR_STATE, "layer %d: AttnRes bank full (%d)", l, act->n_bank);
                K3_TRY(ops->copy2d(be, act->bank + act->n_bank * slab, slab, h, slab, 1, slab));
                act->n_bank++;
                restart = true;
            }
        }
        K3_TRY(ops->rmsnorm(be, a, lv->input_norm, T, D, eps, s->xn));
        if (c->mixer[l] == K3_MIXER_KDA)
            K3_TRY(in_layer(k3_layers_kda(s, l, &sq, s->xn, s->y), l));
        else
            K3_TRY(in_layer(k3_layers_mla(s, l, &sq, s->xn, s->y), l));
        NF_CHECK(s->y, l, c->mixer[l] == K3_MIXER_KDA ? K3_NF_KDA : K3_NF_MLA);
        if (restart)
            K3_TRY(ops->copy2d(be, h, slab, s->y, slab, 1, slab));
        else
            K3_TRY(ops->add(be, h, s->y, slab, h));

        a = h;
        if (res && act->n_bank > 0) {
            K3_TRY(ops->attnres_mix(be, act->bank, act->n_bank, h, lv->mlp_res, T, D, eps, s->xa));
            a = s->xa;
        }
        K3_TRY(ops->rmsnorm(be, a, lv->post_norm, T, D, eps, s->xn));
        if (k3_config_is_moe(c, l))
            K3_TRY(in_layer(moe_ffn(s, l, s->xn, T, s->y), l));
        else
            K3_TRY(in_layer(dense_ffn(s, l, s->xn, T, s->y), l));
        NF_CHECK(s->y, l, k3_config_is_moe(c, l) ? K3_NF_MOE : K3_NF_DENSE);
        K3_TRY(ops->add(be, h, s->y, slab, h));
        if (s->tap) {
            K3_TRY(k3_backend_download(be, s->tap_buf, h, (size_t)slab * sizeof(float)));
            s->tap(s->tap_ctx, l, s->tap_buf, T, D);
        }
    }
    k3_backend_errors_layer(be, -1);
    if (s->p.last) {
        /* rows that get logits: all, or each sequence's last token (with its bank rows) */
        const bool mix = res && act->n_bank > 0;
        const int64_t n_rows = all_logits ? T : n_seqs;
        if (all_logits) {
            K3_TRY(ops->copy2d(be, s->hsel, slab, h, slab, 1, slab));
            if (mix)
                K3_TRY(ops->attnres_mix(be, act->bank, act->n_bank, s->hsel, s->out_res, T, D, eps,
                                        s->hsel));
        } else {
            K3_TRY(ops->rows_last(be, &sq, h, slab, 1, D, s->hsel));
            if (mix) {
                K3_TRY(ops->rows_last(be, &sq, act->bank, slab, act->n_bank, D, s->bank_sel));
                K3_TRY(ops->attnres_mix(be, s->bank_sel, act->n_bank, s->hsel, s->out_res, n_rows,
                                        D, eps, s->hsel));
            }
        }
        K3_TRY(ops->rmsnorm(be, s->hsel, s->final_norm, n_rows, D, eps, s->hsel));
        const k3_tensor *head = c->tie_word_embeddings ? &s->w->embed : &s->w->lm_head;
        K3_TRY(ops->matmul(be, s->hsel, n_rows, head, logits));
        if (nf)
            K3_TRY(ops->nonfinite_rows(be, &sq, logits, c->vocab_size, !all_logits,
                                       k3_nf_code(-1, K3_NF_HEAD), flags));
    }
#undef NF_CHECK
    return K3_OK;
}
