/* catalog.c — the one list of tensors a k3_config implies (names, stored dtypes, shapes).
 *
 * make-tiny writes exactly this list, inspect/verify checks a checkpoint against it and the
 * loader maps each entry to a k3_layer_w field through its role. Names follow the released K3
 * checkpoint (spec/K3-MODEL.md §2.1, §3.1, §4.3, §5, verified against real safetensors
 * headers); flat Kimi-Linear-style configs use no "language_model." prefix, the low-rank
 * g_a_proj/g_b_proj output gate and BF16 experts `experts.{e}.w1.weight`.
 * Order: embedding, then per layer its non-expert tensors followed by its experts (the six
 * tensors of one MXFP4 expert consecutive), then the head side. Stable across calls. */
#include "k3_model.h"

#include <stdio.h>

int64_t k3_tensor_spec_bytes(const k3_tensor_spec *s) {
    int64_t n = (int64_t)k3_dtype_size(s->dtype);
    for (int i = 0; i < s->ndim; i++)
        if (s->shape[i] < 0 || __builtin_mul_overflow(n, s->shape[i], &n)) return -1;
    return n;
}

/* Running totals of k3_config_count (filled while the catalogue streams by). */
typedef struct counting {
    k3_config_counts *o;
    int64_t exp_p, exp_b; /* all routed-expert params / bytes */
    const char *overflow; /* the first total that overflowed, or NULL */
} counting;

typedef struct {
    const k3_config *c;
    k3_tensor_spec *out;
    int64_t cap, n;
    int layer, expert;
    k3_tensor_kind kind;
    counting *cnt; /* k3_config_count: accumulate instead of (or besides) listing */
} cat;

static void acc(counting *t, int64_t *sum, int64_t v, const char *what) {
    if (!t->overflow && __builtin_add_overflow(*sum, v, sum)) t->overflow = what;
}

/* Logical parameters of one tensor (an MXFP4 packed tensor counts 2 per byte, its scale 0). */
static int64_t role_params(k3_role role, int64_t elems, bool *ovf) {
    switch (role) {
    case K3_R_EXP_W1_PACKED:
    case K3_R_EXP_W2_PACKED:
    case K3_R_EXP_W3_PACKED: {
        int64_t p;
        if (__builtin_mul_overflow(elems, 2, &p)) *ovf = true;
        return p;
    }
    case K3_R_EXP_W1_SCALE:
    case K3_R_EXP_W2_SCALE:
    case K3_R_EXP_W3_SCALE:
        return 0;
    default:
        return elems;
    }
}

static void count_one(cat *k, k3_role role, k3_dtype dt, int ndim, const int64_t *d) {
    counting *t = k->cnt;
    k3_config_counts *o = t->o;
    const k3_config *c = k->c;
    bool ovf = false;
    int64_t elems = 1, b;
    for (int i = 0; i < ndim; i++) ovf |= __builtin_mul_overflow(elems, d[i], &elems);
    int64_t p = role_params(role, elems, &ovf);
    ovf |= __builtin_mul_overflow(elems, (int64_t)k3_dtype_size(dt), &b);
    if (ovf && !t->overflow) t->overflow = "a tensor's size";
    if (t->overflow) return;
    acc(t, &o->params_total, p, "params_total");
    acc(t, &o->bytes_total, b, "bytes_total");
    if ((unsigned)dt < 8) acc(t, &o->bytes_by_dtype[dt], b, "bytes_by_dtype");
    if (k->kind == K3_TK_EXPERT) {
        acc(t, &t->exp_p, p, "expert params");
        acc(t, &t->exp_b, b, "expert bytes");
    } else if (role == K3_R_EMBED) {
        acc(t, &o->params_active, c->hidden_size, "params_active"); /* one row is looked up */
        acc(t, &o->bytes_active, c->vocab_size > 0 ? b / c->vocab_size : 0, "bytes_active");
    } else {
        acc(t, &o->params_active, p, "params_active");
        acc(t, &o->bytes_active, b, "bytes_active");
    }
}

static void add(cat *k, k3_role role, k3_dtype dt, const char *fmt_suffix, int ndim, int64_t d0,
                int64_t d1, int64_t d2) {
    if (k->out && k->n < k->cap) {
        k3_tensor_spec *s = &k->out[k->n];
        memset(s, 0, sizeof *s);
        const char *p = k->c->tensor_prefix;
        if (k->kind == K3_TK_GLOBAL)
            snprintf(s->name, sizeof s->name, "%s%s", p, fmt_suffix);
        else if (k->kind == K3_TK_LAYER)
            snprintf(s->name, sizeof s->name, "%smodel.layers.%d.%s", p, k->layer, fmt_suffix);
        else
            snprintf(s->name, sizeof s->name, "%smodel.layers.%d.block_sparse_moe.experts.%d.%s", p,
                     k->layer, k->expert, fmt_suffix);
        s->dtype = dt;
        s->ndim = ndim;
        s->shape[0] = d0;
        s->shape[1] = d1;
        s->shape[2] = d2;
        s->kind = k->kind;
        s->layer = k->kind == K3_TK_GLOBAL ? -1 : k->layer;
        s->expert = k->kind == K3_TK_EXPERT ? k->expert : -1;
        s->first_stage = role == K3_R_EMBED;
        s->role = role;
    }
    if (k->cnt) count_one(k, role, dt, ndim, (const int64_t[3]){d0, d1, d2});
    k->n++;
}

#define BF  K3_DT_BF16
#define F32 K3_DT_F32

static void kda_tensors(cat *k) {
    const k3_config *c = k->c;
    int64_t D = c->hidden_size, P = (int64_t)c->kda_n_heads * c->kda_head_dim;
    int64_t R = c->kda_gate_rank, K = c->kda_conv_kernel;
    add(k, K3_R_KDA_Q, BF, "self_attn.q_proj.weight", 2, P, D, 0);
    add(k, K3_R_KDA_K, BF, "self_attn.k_proj.weight", 2, P, D, 0);
    add(k, K3_R_KDA_V, BF, "self_attn.v_proj.weight", 2, P, D, 0);
    add(k, K3_R_KDA_QCONV, F32, "self_attn.q_conv1d.weight", 3, P, 1, K);
    add(k, K3_R_KDA_KCONV, F32, "self_attn.k_conv1d.weight", 3, P, 1, K);
    add(k, K3_R_KDA_VCONV, F32, "self_attn.v_conv1d.weight", 3, P, 1, K);
    add(k, K3_R_KDA_FA, BF, "self_attn.f_a_proj.weight", 2, R, D, 0);
    add(k, K3_R_KDA_FB, BF, "self_attn.f_b_proj.weight", 2, P, R, 0);
    add(k, K3_R_KDA_DT_BIAS, F32, "self_attn.dt_bias", 1, P, 0, 0);
    add(k, K3_R_KDA_A_LOG, F32, "self_attn.A_log", 1, c->kda_a_log_len, 0, 0);
    add(k, K3_R_KDA_B, BF, "self_attn.b_proj.weight", 2, c->kda_n_heads, D, 0);
    if (c->kda_full_rank_gate) {
        add(k, K3_R_KDA_G, BF, "self_attn.g_proj.weight", 2, P, D, 0);
    } else {
        add(k, K3_R_KDA_GA, BF, "self_attn.g_a_proj.weight", 2, R, D, 0);
        add(k, K3_R_KDA_GB, BF, "self_attn.g_b_proj.weight", 2, P, R, 0);
    }
    add(k, K3_R_KDA_O_NORM, F32, "self_attn.o_norm.weight", 1, c->kda_head_dim, 0, 0);
    add(k, K3_R_KDA_O, BF, "self_attn.o_proj.weight", 2, D, P, 0);
}

static void mla_tensors(cat *k) {
    const k3_config *c = k->c;
    int64_t D = c->hidden_size, H = c->n_heads;
    int64_t qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
    if (c->q_lora_rank > 0) {
        add(k, K3_R_MLA_QA, BF, "self_attn.q_a_proj.weight", 2, c->q_lora_rank, D, 0);
        add(k, K3_R_MLA_QA_NORM, BF, "self_attn.q_a_layernorm.weight", 1, c->q_lora_rank, 0, 0);
        add(k, K3_R_MLA_QB, BF, "self_attn.q_b_proj.weight", 2, H * qk, c->q_lora_rank, 0);
    } else {
        add(k, K3_R_MLA_Q, BF, "self_attn.q_proj.weight", 2, H * qk, D, 0);
    }
    add(k, K3_R_MLA_KVA, BF, "self_attn.kv_a_proj_with_mqa.weight", 2,
        c->kv_lora_rank + c->qk_rope_head_dim, D, 0);
    add(k, K3_R_MLA_KVA_NORM, BF, "self_attn.kv_a_layernorm.weight", 1, c->kv_lora_rank, 0, 0);
    add(k, K3_R_MLA_KVB, BF, "self_attn.kv_b_proj.weight", 2,
        H * (c->qk_nope_head_dim + c->v_head_dim), c->kv_lora_rank, 0);
    if (c->mla_use_output_gate)
        add(k, K3_R_MLA_G, BF, "self_attn.g_proj.weight", 2, H * c->v_head_dim, D, 0);
    add(k, K3_R_MLA_O, BF, "self_attn.o_proj.weight", 2, D, H * c->v_head_dim, 0);
}

static void expert_tensors(cat *k) {
    const k3_config *c = k->c;
    int64_t L = c->latent_size > 0 ? c->latent_size : c->hidden_size;
    int64_t I = c->moe_intermediate_size;
    if (c->experts_mxfp4) {
        add(k, K3_R_EXP_W1_PACKED, K3_DT_U8, "w1.weight_packed", 2, I, L / 2, 0);
        add(k, K3_R_EXP_W1_SCALE, K3_DT_U8, "w1.weight_scale", 2, I, L / 32, 0);
        add(k, K3_R_EXP_W2_PACKED, K3_DT_U8, "w2.weight_packed", 2, L, I / 2, 0);
        add(k, K3_R_EXP_W2_SCALE, K3_DT_U8, "w2.weight_scale", 2, L, I / 32, 0);
        add(k, K3_R_EXP_W3_PACKED, K3_DT_U8, "w3.weight_packed", 2, I, L / 2, 0);
        add(k, K3_R_EXP_W3_SCALE, K3_DT_U8, "w3.weight_scale", 2, I, L / 32, 0);
    } else {
        add(k, K3_R_EXP_W1, BF, "w1.weight", 2, I, L, 0);
        add(k, K3_R_EXP_W2, BF, "w2.weight", 2, L, I, 0);
        add(k, K3_R_EXP_W3, BF, "w3.weight", 2, I, L, 0);
    }
}

static int64_t catalog_walk(const k3_config *c, k3_tensor_spec *out, int64_t cap, counting *cnt) {
    cat k = {.c = c, .out = out, .cap = out ? cap : 0, .kind = K3_TK_GLOBAL, .cnt = cnt};
    int64_t D = c->hidden_size, V = c->vocab_size;
    bool ar = c->attn_res_block_size > 0;
    add(&k, K3_R_EMBED, BF, "model.embed_tokens.weight", 2, V, D, 0);
    for (int l = 0; l < c->n_layers; l++) {
        k.kind = K3_TK_LAYER;
        k.layer = l;
        add(&k, K3_R_INPUT_NORM, BF, "input_layernorm.weight", 1, D, 0, 0);
        add(&k, K3_R_POST_NORM, BF, "post_attention_layernorm.weight", 1, D, 0, 0);
        if (ar) {
            add(&k, K3_R_ATTN_RES_NORM, BF, "self_attention_res_norm.weight", 1, D, 0, 0);
            add(&k, K3_R_ATTN_RES_PROJ, BF, "self_attention_res_proj.weight", 2, 1, D, 0);
            add(&k, K3_R_MLP_RES_NORM, BF, "mlp_res_norm.weight", 1, D, 0, 0);
            add(&k, K3_R_MLP_RES_PROJ, BF, "mlp_res_proj.weight", 2, 1, D, 0);
        }
        if (c->mixer[l] == K3_MIXER_KDA)
            kda_tensors(&k);
        else
            mla_tensors(&k);
        if (!k3_config_is_moe(c, l)) {
            int64_t F = c->intermediate_size;
            add(&k, K3_R_FFN_GATE, BF, "mlp.gate_proj.weight", 2, F, D, 0);
            add(&k, K3_R_FFN_UP, BF, "mlp.up_proj.weight", 2, F, D, 0);
            add(&k, K3_R_FFN_DOWN, BF, "mlp.down_proj.weight", 2, D, F, 0);
            continue;
        }
        int64_t E = c->n_experts, L = c->latent_size;
        add(&k, K3_R_ROUTER, BF, "block_sparse_moe.gate.weight", 2, E, D, 0);
        add(&k, K3_R_ROUTER_BIAS, F32, "block_sparse_moe.gate.e_score_correction_bias", 1, E, 0, 0);
        if (L > 0) {
            add(&k, K3_R_LAT_DOWN, BF, "block_sparse_moe.routed_expert_down_proj.weight", 2, L, D,
                0);
            add(&k, K3_R_LAT_NORM, BF, "block_sparse_moe.routed_expert_norm.weight", 1, L, 0, 0);
            add(&k, K3_R_LAT_UP, BF, "block_sparse_moe.routed_expert_up_proj.weight", 2, D, L, 0);
        }
        if (c->n_shared_experts > 0) {
            int64_t S = (int64_t)c->n_shared_experts * c->moe_intermediate_size;
            add(&k, K3_R_SH_GATE, BF, "block_sparse_moe.shared_experts.gate_proj.weight", 2, S, D,
                0);
            add(&k, K3_R_SH_UP, BF, "block_sparse_moe.shared_experts.up_proj.weight", 2, S, D, 0);
            add(&k, K3_R_SH_DOWN, BF, "block_sparse_moe.shared_experts.down_proj.weight", 2, D, S,
                0);
        }
        k.kind = K3_TK_EXPERT;
        for (int e = 0; e < c->n_experts; e++) {
            k.expert = e;
            expert_tensors(&k);
        }
    }
    k.kind = K3_TK_GLOBAL;
    add(&k, K3_R_FINAL_NORM, BF, "model.norm.weight", 1, D, 0, 0);
    if (ar) {
        add(&k, K3_R_OUT_RES_NORM, BF, "model.output_attn_res_norm.weight", 1, D, 0, 0);
        add(&k, K3_R_OUT_RES_PROJ, BF, "model.output_attn_res_proj.weight", 2, 1, D, 0);
    }
    if (!c->tie_word_embeddings) add(&k, K3_R_LM_HEAD, BF, "lm_head.weight", 2, V, D, 0);
    return k.n;
}

int64_t k3_catalog(const k3_config *c, k3_tensor_spec *out, int64_t cap) {
    return catalog_walk(c, out, cap, NULL);
}

k3_status k3_config_count(const k3_config *c, k3_config_counts *o) {
    memset(o, 0, sizeof *o);
    counting t = {.o = o};
    o->n_tensors = catalog_walk(c, NULL, 0, &t);
    /* top-k of n_experts per token (every MoE layer has the same expert shapes) */
    if (!t.overflow && c->n_experts > 0) {
        int64_t p, b;
        if (__builtin_mul_overflow(t.exp_p / c->n_experts, (int64_t)c->n_experts_per_tok, &p) ||
            __builtin_mul_overflow(t.exp_b / c->n_experts, (int64_t)c->n_experts_per_tok, &b))
            t.overflow = "active expert totals";
        else {
            acc(&t, &o->params_active, p, "params_active");
            acc(&t, &o->bytes_active, b, "bytes_active");
        }
    }
    if (t.overflow) {
        memset(o, 0, sizeof *o);
        return K3_ERR(K3_ERR_CONFIG,
                      "config: %s overflows a 64-bit integer (the config is too large)",
                      t.overflow);
    }
    return K3_OK;
}
