/* config.c — config.json -> k3_config (parse + validate), the presets, config.json writer.
 *
 * Reads the real K3 layout (top-level `model_type: kimi_k3` with the text model under
 * `text_config`, `quantization_config` at the top) and flat Kimi-Linear-style configs with the
 * same code (spec/K3-MODEL.md §6.1). Every missing or invalid value is K3_ERR_CONFIG naming the
 * key ("config.json: text_config.linear_attn_config.full_attn_layers[3]: ..."); nothing is
 * clamped. The text is held strictly (k3_json_parse_strict: no NUL, UTF-8, no key twice, nothing
 * after the object). Every key k3 reads is bounded, including those the forward does not use
 * but that say what the model is (max_position_embeddings >= 1, num_nextn_predict_layers >= 0,
 * topk_method, use_grouped_topk). Layer lists are 1-based in the file and 0-based in
 * k3_config.mixer[].
 *
 * One value is not in config.json: the stored length of KDA `A_log` (K3 stores 128 for 96 heads,
 * zero-padded). Parsing gives the next power of two >= heads (right for K3); k3_config_load then
 * reads the real length from the checkpoint header when a checkpoint is present. */
#include "k3_config_json.h"
#include "k3_model.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "model_internal.h"

/* k3's bound on max_position_embeddings (K3: 2^20); the other bounds are by k3_config_validate */
#define K3_CFG_MAX_POSITIONS ((int64_t)1 << 40)

/* ---- typed getters that name the key ------------------------------------------------------ */
typedef struct {
    const char *path; /* file name for messages */
    const char *ctx;  /* "text_config." or "" */
} keyctx;

static k3_status missing(const keyctx *k, const char *key) {
    return K3_ERR(K3_ERR_CONFIG, "%s: %s%s: missing", k->path, k->ctx, key);
}

static k3_status get_num(const keyctx *k, const cJSON *o, const char *key, bool required,
                         double def, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v)) {
        if (required) return missing(k, key);
        *out = def;
        return K3_OK;
    }
    if (!cJSON_IsNumber(v))
        return K3_ERR(K3_ERR_CONFIG, "%s: %s%s: expected a number", k->path, k->ctx, key);
    if (!isfinite(v->valuedouble))
        return K3_ERR(K3_ERR_CONFIG, "%s: %s%s: not finite", k->path, k->ctx, key);
    *out = v->valuedouble;
    return K3_OK;
}

static k3_status get_int(const keyctx *k, const cJSON *o, const char *key, bool required,
                         int64_t def, int64_t *out) {
    double d;
    K3_TRY(get_num(k, o, key, required, (double)def, &d));
    if (d != floor(d) || fabs(d) > 9.0e15)
        return K3_ERR(K3_ERR_CONFIG, "%s: %s%s: expected an integer, got %g", k->path, k->ctx, key,
                      d);
    *out = (int64_t)d;
    return K3_OK;
}

/* An int that must fit `int` and be >= lo. */
static k3_status get_i(const keyctx *k, const cJSON *o, const char *key, bool required, int def,
                       int lo, int *out) {
    int64_t v;
    K3_TRY(get_int(k, o, key, required, def, &v));
    if (v < lo || v > 1000000000)
        return K3_ERR(K3_ERR_CONFIG, "%s: %s%s: %lld is out of range (must be in %d..1000000000)",
                      k->path, k->ctx, key, (long long)v, lo);
    *out = (int)v;
    return K3_OK;
}

static k3_status get_bool(const keyctx *k, const cJSON *o, const char *key, bool required, bool def,
                          bool *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v)) {
        if (required) return missing(k, key);
        *out = def;
        return K3_OK;
    }
    if (!cJSON_IsBool(v))
        return K3_ERR(K3_ERR_CONFIG, "%s: %s%s: expected true or false", k->path, k->ctx, key);
    *out = cJSON_IsTrue(v);
    return K3_OK;
}

/* NULL when absent; error when present but not a string. */
static k3_status get_str(const keyctx *k, const cJSON *o, const char *key, const char **out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    *out = NULL;
    if (!v || cJSON_IsNull(v)) return K3_OK;
    if (!cJSON_IsString(v))
        return K3_ERR(K3_ERR_CONFIG, "%s: %s%s: expected a string", k->path, k->ctx, key);
    *out = v->valuestring;
    return K3_OK;
}

/* A 1-based layer list -> marks[] (0-based). */
static k3_status get_layer_list(const keyctx *k, const cJSON *o, const char *key, int n_layers,
                                int8_t *marks, bool *present) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    *present = v != NULL && !cJSON_IsNull(v);
    if (!*present) return K3_OK;
    if (!cJSON_IsArray(v))
        return K3_ERR(K3_ERR_CONFIG, "%s: %s%s: expected a list of 1-based layer numbers", k->path,
                      k->ctx, key);
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble))
            return K3_ERR(K3_ERR_CONFIG, "%s: %s%s[%d]: expected an integer", k->path, k->ctx, key,
                          i);
        double d = e->valuedouble;
        if (d < 1 || d > n_layers)
            return K3_ERR(K3_ERR_CONFIG,
                          "%s: %s%s[%d]: layer %g is outside 1..%d (the lists are 1-based)",
                          k->path, k->ctx, key, i, d, n_layers);
        if (marks[(int)d - 1])
            return K3_ERR(K3_ERR_CONFIG, "%s: %s%s[%d]: layer %g listed twice", k->path, k->ctx,
                          key, i, d);
        marks[(int)d - 1] = 1;
        i++;
    }
    return K3_OK;
}

static int next_pow2(int n) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
}

static k3_status parse_quant(const char *path, const cJSON *q, k3_config *c) {
    keyctx k = {path, "quantization_config."};
    if (!cJSON_IsObject(q))
        return K3_ERR(K3_ERR_CONFIG, "%s: quantization_config: expected an object", path);
    const char *method, *fmt;
    K3_TRY(get_str(&k, q, "quant_method", &method));
    K3_TRY(get_str(&k, q, "format", &fmt));
    if (!method) return missing(&k, "quant_method");
    if (strcmp(method, "compressed-tensors") != 0)
        return K3_ERR(K3_ERR_CONFIG,
                      "%s: quantization_config.quant_method: '%s' is not supported (only "
                      "compressed-tensors)",
                      path, method);
    if (!fmt) return missing(&k, "format");
    if (strcmp(fmt, "mxfp4-pack-quantized") != 0)
        return K3_ERR(K3_ERR_CONFIG,
                      "%s: quantization_config.format: '%s' is not supported (only "
                      "mxfp4-pack-quantized)",
                      path, fmt);
    const cJSON *groups = cJSON_GetObjectItemCaseSensitive(q, "config_groups");
    if (groups) {
        const cJSON *g;
        cJSON_ArrayForEach(g, groups) {
            const cJSON *w = cJSON_GetObjectItemCaseSensitive(g, "weights");
            if (!w) continue;
            keyctx kw = {path, "quantization_config.config_groups.*.weights."};
            int64_t bits, gs;
            const char *type;
            K3_TRY(get_int(&kw, w, "num_bits", false, 4, &bits));
            K3_TRY(get_int(&kw, w, "group_size", false, 32, &gs));
            K3_TRY(get_str(&kw, w, "type", &type));
            if (bits != 4)
                return K3_ERR(K3_ERR_CONFIG, "%s: %snum_bits: %lld (MXFP4 needs 4)", path, kw.ctx,
                              (long long)bits);
            if (gs != 32)
                return K3_ERR(K3_ERR_CONFIG, "%s: %sgroup_size: %lld (MXFP4 needs 32)", path,
                              kw.ctx, (long long)gs);
            if (type && strcmp(type, "float") != 0)
                return K3_ERR(K3_ERR_CONFIG, "%s: %stype: '%s' (MXFP4 needs float)", path, kw.ctx,
                              type);
        }
    }
    c->experts_mxfp4 = true;
    return K3_OK;
}

static k3_status parse_obj(const cJSON *top, const char *path, k3_config *c) {
    if (!cJSON_IsObject(top))
        return K3_ERR(K3_ERR_CONFIG, "%s: expected a JSON object at the top level", path);
    memset(c, 0, sizeof *c);
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(top, "text_config");
    keyctx k = {path, ""};
    if (tc) {
        if (!cJSON_IsObject(tc))
            return K3_ERR(K3_ERR_CONFIG, "%s: text_config: expected an object", path);
        k.ctx = "text_config.";
        snprintf(c->tensor_prefix, sizeof c->tensor_prefix, "language_model.");
    } else {
        tc = top;
    }

    int64_t v64;
    double d;
    K3_TRY(get_int(&k, tc, "vocab_size", true, 0, &c->vocab_size));
    if (c->vocab_size < 1) /* before eos_token_id is checked against it */
        return K3_ERR(K3_ERR_CONFIG, "%s: %svocab_size: %lld must be >= 1", path, k.ctx,
                      (long long)c->vocab_size);
    K3_TRY(get_int(&k, tc, "hidden_size", true, 0, &c->hidden_size));
    K3_TRY(get_i(&k, tc, "num_hidden_layers", true, 0, 1, &c->n_layers));
    if (c->n_layers > K3_MAX_LAYERS)
        return K3_ERR(K3_ERR_CONFIG, "%s: %snum_hidden_layers: %d exceeds k3's limit of %d", path,
                      k.ctx, c->n_layers, K3_MAX_LAYERS);
    K3_TRY(get_num(&k, tc, "rms_norm_eps", true, 0, &d));
    c->rms_norm_eps = (float)d;
    c->mla_norm_eps = 1e-6f; /* HF q_a/kv_a layernorm eps (spec §3, §11.1); not a config key */
    {
        /* NoPE: no position table reads it, but it is the trained context (the engine's bound on
         * --max-ctx); absent = unknown (0), given = at least one position */
        const cJSON *mp = cJSON_GetObjectItemCaseSensitive(tc, "max_position_embeddings");
        if (mp && !cJSON_IsNull(mp)) {
            K3_TRY(get_int(&k, tc, "max_position_embeddings", true, 0, &v64));
            if (v64 < 1 || v64 > K3_CFG_MAX_POSITIONS)
                return K3_ERR(K3_ERR_CONFIG,
                              "%s: %smax_position_embeddings: %lld is out of range (must be in "
                              "1..%lld)",
                              path, k.ctx, (long long)v64, (long long)K3_CFG_MAX_POSITIONS);
            c->max_position_embeddings = v64;
        }
        /* multi-token-prediction layers are not run; their count must still be a count */
        K3_TRY(get_int(&k, tc, "num_nextn_predict_layers", false, 0, &v64));
        if (v64 < 0)
            return K3_ERR(K3_ERR_CONFIG, "%s: %snum_nextn_predict_layers: %lld must be >= 0", path,
                          k.ctx, (long long)v64);
    }
    K3_TRY(get_bool(&k, tc, "tie_word_embeddings", false, false, &c->tie_word_embeddings));
    {
        const cJSON *eos = cJSON_GetObjectItemCaseSensitive(tc, "eos_token_id");
        if (eos && !cJSON_IsNull(eos))
            K3_TRY(get_int(&k, tc, "eos_token_id", true, 0, &v64));
        else {
            keyctx kt = {path, ""};
            K3_TRY(get_int(&kt, top, "eos_token_id", true, 0, &v64));
        }
        if (v64 < 0 || v64 >= c->vocab_size)
            return K3_ERR(K3_ERR_CONFIG, "%s: %seos_token_id: %lld is not a token id (vocab %lld)",
                          path, k.ctx, (long long)v64, (long long)c->vocab_size);
        c->eos_token_id = (int)v64;
    }
    K3_TRY(get_i(&k, tc, "attn_res_block_size", false, 0, 0, &c->attn_res_block_size));

    /* MLA */
    K3_TRY(get_i(&k, tc, "num_attention_heads", true, 0, 1, &c->n_heads));
    {
        int kvh;
        K3_TRY(get_i(&k, tc, "num_key_value_heads", false, c->n_heads, 1, &kvh));
        if (kvh != c->n_heads)
            return K3_ERR(K3_ERR_CONFIG,
                          "%s: %snum_key_value_heads: %d != num_attention_heads %d (MLA needs "
                          "equal counts)",
                          path, k.ctx, kvh, c->n_heads);
    }
    K3_TRY(get_i(&k, tc, "q_lora_rank", false, 0, 0, &c->q_lora_rank));
    K3_TRY(get_i(&k, tc, "kv_lora_rank", true, 0, 1, &c->kv_lora_rank));
    K3_TRY(get_i(&k, tc, "qk_nope_head_dim", true, 0, 1, &c->qk_nope_head_dim));
    K3_TRY(get_i(&k, tc, "qk_rope_head_dim", true, 0, 0, &c->qk_rope_head_dim));
    K3_TRY(get_i(&k, tc, "v_head_dim", true, 0, 1, &c->v_head_dim));
    {
        bool nope;
        K3_TRY(get_bool(&k, tc, "mla_use_nope", false, true, &nope));
        if (!nope)
            return K3_ERR(K3_ERR_CONFIG,
                          "%s: %smla_use_nope: false (MLA with RoPE) is not supported", path,
                          k.ctx);
    }
    K3_TRY(get_bool(&k, tc, "mla_use_output_gate", false, false, &c->mla_use_output_gate));

    /* KDA */
    const cJSON *la = cJSON_GetObjectItemCaseSensitive(tc, "linear_attn_config");
    if (!la || cJSON_IsNull(la)) return missing(&k, "linear_attn_config");
    if (!cJSON_IsObject(la))
        return K3_ERR(K3_ERR_CONFIG, "%s: %slinear_attn_config: expected an object", path, k.ctx);
    char lctx[64];
    snprintf(lctx, sizeof lctx, "%slinear_attn_config.", k.ctx);
    keyctx kl = {path, lctx};
    int8_t full[K3_MAX_LAYERS] = {0}, kda[K3_MAX_LAYERS] = {0};
    bool have_full, have_kda;
    K3_TRY(get_layer_list(&kl, la, "full_attn_layers", c->n_layers, full, &have_full));
    K3_TRY(get_layer_list(&kl, la, "kda_layers", c->n_layers, kda, &have_kda));
    if (!have_full) return missing(&kl, "full_attn_layers");
    for (int l = 0; l < c->n_layers; l++) {
        if (have_kda && full[l] && kda[l])
            return K3_ERR(K3_ERR_CONFIG, "%s: %skda_layers: layer %d is also in full_attn_layers",
                          path, lctx, l + 1);
        if (have_kda && !full[l] && !kda[l])
            return K3_ERR(K3_ERR_CONFIG,
                          "%s: %skda_layers: layer %d is in neither kda_layers nor "
                          "full_attn_layers",
                          path, lctx, l + 1);
        c->mixer[l] = full[l] ? K3_MIXER_MLA : K3_MIXER_KDA;
    }
    K3_TRY(get_i(&kl, la, "num_heads", true, 0, 1, &c->kda_n_heads));
    K3_TRY(get_i(&kl, la, "head_dim", true, 0, 1, &c->kda_head_dim));
    K3_TRY(get_i(&kl, la, "short_conv_kernel_size", true, 0, 1, &c->kda_conv_kernel));
    {
        const cJSON *lb = cJSON_GetObjectItemCaseSensitive(la, "gate_lower_bound");
        c->kda_has_lower_bound = lb && !cJSON_IsNull(lb);
        if (c->kda_has_lower_bound) {
            K3_TRY(get_num(&kl, la, "gate_lower_bound", true, 0, &d));
            if (!(d < 0))
                return K3_ERR(K3_ERR_CONFIG, "%s: %sgate_lower_bound: %g must be negative", path,
                              lctx, d);
            c->kda_gate_lower_bound = (float)d;
        }
    }
    K3_TRY(get_bool(&kl, la, "use_full_rank_gate", false, false, &c->kda_full_rank_gate));
    c->kda_gate_rank = c->kda_head_dim; /* f_a/f_b (and g_a/g_b) rank = head_dim in K3 and KL */
    c->kda_a_log_len = next_pow2(c->kda_n_heads);

    /* FFN */
    const char *act;
    K3_TRY(get_str(&k, tc, "hidden_act", &act));
    if (!act) return missing(&k, "hidden_act");
    if (strcmp(act, "situ") == 0) {
        c->act = K3_ACT_SITU;
        K3_TRY(get_num(&k, tc, "activation_situ_beta", true, 0, &d));
        if (!(d > 0))
            return K3_ERR(K3_ERR_CONFIG, "%s: %sactivation_situ_beta: %g must be > 0", path, k.ctx,
                          d);
        c->situ_beta = (float)d;
        K3_TRY(get_num(&k, tc, "activation_situ_linear_beta", false, 0, &d));
        c->situ_linear_beta = (float)d;
    } else if (strcmp(act, "silu") == 0) {
        c->act = K3_ACT_SWIGLU;
    } else {
        return K3_ERR(K3_ERR_CONFIG, "%s: %shidden_act: '%s' is not supported (situ or silu)", path,
                      k.ctx, act);
    }
    K3_TRY(get_int(&k, tc, "intermediate_size", true, 0, &c->intermediate_size));
    K3_TRY(get_i(&k, tc, "first_k_dense_replace", false, 0, 0, &c->first_k_dense_replace));
    K3_TRY(get_i(&k, tc, "moe_layer_freq", false, 1, 1, &c->moe_layer_freq));
    K3_TRY(get_i(&k, tc, "num_experts", false, 0, 0, &c->n_experts));
    if (c->n_experts > 0) {
        K3_TRY(get_i(&k, tc, "num_experts_per_token", true, 0, 1, &c->n_experts_per_tok));
        K3_TRY(get_i(&k, tc, "num_shared_experts", false, 0, 0, &c->n_shared_experts));
        K3_TRY(get_i(&k, tc, "moe_intermediate_size", true, 0, 1, &c->moe_intermediate_size));
        K3_TRY(get_i(&k, tc, "routed_expert_hidden_size", false, 0, 0, &c->latent_size));
        K3_TRY(get_bool(&k, tc, "latent_moe_use_norm", false, c->latent_size > 0,
                        &c->latent_moe_use_norm));
        K3_TRY(get_bool(&k, tc, "moe_renormalize", false, true, &c->moe_renormalize));
        K3_TRY(get_num(&k, tc, "routed_scaling_factor", false, 1.0, &d));
        c->routed_scaling_factor = (float)d;
        K3_TRY(get_i(&k, tc, "num_expert_group", false, 1, 1, &c->n_group));
        K3_TRY(get_i(&k, tc, "topk_group", false, 1, 1, &c->topk_group));
        const char *fn;
        K3_TRY(get_str(&k, tc, "moe_router_activation_func", &fn));
        if (fn && strcmp(fn, "sigmoid") != 0)
            return K3_ERR(K3_ERR_CONFIG,
                          "%s: %smoe_router_activation_func: '%s' is not supported (sigmoid)", path,
                          k.ctx, fn);
        /* the router k3 runs: sigmoid scores + correction bias, grouped top-k (spec §4.3) */
        const char *tm;
        K3_TRY(get_str(&k, tc, "topk_method", &tm));
        if (tm && strcmp(tm, "noaux_tc") != 0)
            return K3_ERR(K3_ERR_CONFIG, "%s: %stopk_method: '%s' is not supported (noaux_tc)",
                          path, k.ctx, tm);
        bool grouped;
        K3_TRY(get_bool(&k, tc, "use_grouped_topk", false, true, &grouped));
        if (!grouped && c->n_group != 1)
            return K3_ERR(K3_ERR_CONFIG,
                          "%s: %suse_grouped_topk: false with num_expert_group %d (k3 always "
                          "groups; give 1 group)",
                          path, k.ctx, c->n_group);
    }

    const cJSON *q = cJSON_GetObjectItemCaseSensitive(top, "quantization_config");
    if (!q) q = cJSON_GetObjectItemCaseSensitive(tc, "quantization_config");
    if (q && !cJSON_IsNull(q)) K3_TRY(parse_quant(path, q, c));
    return k3_config_validate(c, path);
}

/* Upper bounds (k3's limits, not the format's). They keep every tensor's element and byte count
 * far inside int64 (largest product: heads x head dims x rank x 2 bytes <= 2^62) and the catalogue
 * small enough to list in memory; the 64-bit totals are still computed with overflow checks. */
/* hidden, head dims, ranks, intermediate sizes, head counts */
#define K3_CFG_MAX_DIM              (1 << 20)
#define K3_CFG_MAX_VOCAB            2147483647 /* token ids are int32 */
#define K3_CFG_MAX_EXPERTS          32767      /* the plan stores expert lanes as int16 */
#define K3_CFG_MAX_EXPERT_INSTANCES (1 << 18)  /* MoE layers x experts (K3: 92 x 896 = 82432) */

k3_status k3_config_validate(const k3_config *c, const char *path) {
    const char *x = c->tensor_prefix[0] ? "text_config." : "";
#define BAD(...) return K3_ERR(K3_ERR_CONFIG, __VA_ARGS__)
#define MAXD(val, key)                                                                             \
    if ((int64_t)(val) > K3_CFG_MAX_DIM)                                                           \
    BAD("%s: %s" key ": %lld exceeds k3's limit of %d", path, x, (long long)(val), K3_CFG_MAX_DIM)
    if (c->vocab_size > K3_CFG_MAX_VOCAB)
        BAD("%s: %svocab_size: %lld exceeds k3's limit of %d (token ids are int32)", path, x,
            (long long)c->vocab_size, K3_CFG_MAX_VOCAB);
    MAXD(c->hidden_size, "hidden_size");
    MAXD(c->intermediate_size, "intermediate_size");
    MAXD(c->n_heads, "num_attention_heads");
    MAXD(c->q_lora_rank, "q_lora_rank");
    MAXD(c->kv_lora_rank, "kv_lora_rank");
    MAXD(c->qk_nope_head_dim, "qk_nope_head_dim");
    MAXD(c->qk_rope_head_dim, "qk_rope_head_dim");
    MAXD(c->v_head_dim, "v_head_dim");
    MAXD(c->kda_n_heads, "linear_attn_config.num_heads");
    MAXD(c->kda_head_dim, "linear_attn_config.head_dim");
    MAXD(c->kda_gate_rank, "linear_attn_config.head_dim (gate rank)");
    MAXD(c->kda_a_log_len, "linear_attn_config A_log length");
    MAXD(c->moe_intermediate_size, "moe_intermediate_size");
    MAXD(c->latent_size, "routed_expert_hidden_size");
    MAXD(c->attn_res_block_size, "attn_res_block_size");
    MAXD((int64_t)c->n_shared_experts * c->moe_intermediate_size,
         "num_shared_experts x moe_intermediate_size");
#undef MAXD
    if (c->n_experts > K3_CFG_MAX_EXPERTS)
        BAD("%s: %snum_experts: %d exceeds k3's limit of %d", path, x, c->n_experts,
            K3_CFG_MAX_EXPERTS);
    if (c->n_experts < 0) BAD("%s: %snum_experts: %d must be >= 0", path, x, c->n_experts);
    if (c->vocab_size <= 0)
        BAD("%s: %svocab_size: %lld must be > 0", path, x, (long long)c->vocab_size);
    if (c->hidden_size <= 0)
        BAD("%s: %shidden_size: %lld must be > 0", path, x, (long long)c->hidden_size);
    if (c->n_layers < 1 || c->n_layers > K3_MAX_LAYERS)
        BAD("%s: %snum_hidden_layers: %d is outside 1..%d", path, x, c->n_layers, K3_MAX_LAYERS);
    if (!(c->rms_norm_eps > 0) || !(c->rms_norm_eps < 1))
        BAD("%s: %srms_norm_eps: %g must be in (0, 1)", path, x, (double)c->rms_norm_eps);
    if (c->eos_token_id < 0 || c->eos_token_id >= c->vocab_size)
        BAD("%s: %seos_token_id: %d is not a token id", path, x, c->eos_token_id);
    if (c->attn_res_block_size < 0)
        BAD("%s: %sattn_res_block_size: %d must be >= 0", path, x, c->attn_res_block_size);
    bool any_mla = false, any_kda = false, any_moe = false, any_dense = false;
    for (int l = 0; l < c->n_layers; l++) {
        if (c->mixer[l] == K3_MIXER_MLA)
            any_mla = true;
        else if (c->mixer[l] == K3_MIXER_KDA)
            any_kda = true;
        else
            BAD("%s: layer %d: invalid mixer", path, l);
        if (k3_config_is_moe(c, l))
            any_moe = true;
        else
            any_dense = true;
    }
    if (any_moe) {
        int64_t n_moe = 0;
        for (int l = 0; l < c->n_layers; l++) n_moe += k3_config_is_moe(c, l);
        if (n_moe * c->n_experts > K3_CFG_MAX_EXPERT_INSTANCES)
            BAD("%s: %snum_experts: %d experts x %lld MoE layers = %lld exceeds k3's limit of %d "
                "expert instances",
                path, x, c->n_experts, (long long)n_moe, (long long)(n_moe * c->n_experts),
                K3_CFG_MAX_EXPERT_INSTANCES);
    }
    if (any_mla) {
        if (c->n_heads < 1) BAD("%s: %snum_attention_heads: %d must be >= 1", path, x, c->n_heads);
        if (c->kv_lora_rank < 1)
            BAD("%s: %skv_lora_rank: %d must be >= 1", path, x, c->kv_lora_rank);
        if (c->q_lora_rank < 0) BAD("%s: %sq_lora_rank: %d must be >= 0", path, x, c->q_lora_rank);
        if (c->qk_nope_head_dim < 1 || c->qk_rope_head_dim < 0 || c->v_head_dim < 1)
            BAD("%s: %sqk_nope_head_dim/qk_rope_head_dim/v_head_dim: %d/%d/%d invalid", path, x,
                c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim);
    }
    if (any_kda) {
        if (c->kda_n_heads < 1 || c->kda_head_dim < 1)
            BAD("%s: %slinear_attn_config.num_heads/head_dim: %d/%d must be >= 1", path, x,
                c->kda_n_heads, c->kda_head_dim);
        if (c->kda_conv_kernel < 1 || c->kda_conv_kernel > 64)
            BAD("%s: %slinear_attn_config.short_conv_kernel_size: %d is outside 1..64", path, x,
                c->kda_conv_kernel);
        if (c->kda_has_lower_bound &&
            (!(c->kda_gate_lower_bound < 0) || !isfinite(c->kda_gate_lower_bound)))
            BAD("%s: %slinear_attn_config.gate_lower_bound: %g must be negative and finite", path,
                x, c->kda_gate_lower_bound);
        if (c->kda_gate_rank < 1)
            BAD("%s: %slinear_attn_config.head_dim: gate rank %d invalid", path, x,
                c->kda_gate_rank);
        if (c->kda_a_log_len < c->kda_n_heads)
            BAD("%s: A_log length %d < %slinear_attn_config.num_heads %d", path, c->kda_a_log_len,
                x, c->kda_n_heads);
    }
    if (c->max_position_embeddings < 0 || c->max_position_embeddings > K3_CFG_MAX_POSITIONS)
        BAD("%s: %smax_position_embeddings: %lld is outside 1..%lld (0 = not given)", path, x,
            (long long)c->max_position_embeddings, (long long)K3_CFG_MAX_POSITIONS);
    /* the float keys: finite as floats too (a finite double like 1e300 becomes inf) */
    if (c->act == K3_ACT_SITU && (!(c->situ_beta > 0) || !isfinite(c->situ_beta)))
        BAD("%s: %sactivation_situ_beta: %g must be > 0 and finite", path, x, (double)c->situ_beta);
    if (c->act == K3_ACT_SITU && !isfinite(c->situ_linear_beta))
        BAD("%s: %sactivation_situ_linear_beta: %g is not finite as a float", path, x,
            (double)c->situ_linear_beta);
    if (c->act != K3_ACT_SITU && c->act != K3_ACT_SWIGLU) BAD("%s: %shidden_act: invalid", path, x);
    if (c->first_k_dense_replace < 0 || c->first_k_dense_replace > c->n_layers)
        BAD("%s: %sfirst_k_dense_replace: %d is outside 0..%d", path, x, c->first_k_dense_replace,
            c->n_layers);
    if (c->moe_layer_freq < 1)
        BAD("%s: %smoe_layer_freq: %d must be >= 1", path, x, c->moe_layer_freq);
    if (any_dense && c->intermediate_size < 1)
        BAD("%s: %sintermediate_size: %lld must be >= 1 (there are dense layers)", path, x,
            (long long)c->intermediate_size);
    if (any_moe) {
        int64_t lat = c->latent_size > 0 ? c->latent_size : c->hidden_size;
        if (c->n_experts_per_tok < 1 || c->n_experts_per_tok > c->n_experts)
            BAD("%s: %snum_experts_per_token: %d is outside 1..num_experts (%d)", path, x,
                c->n_experts_per_tok, c->n_experts);
        if (c->n_shared_experts < 0) BAD("%s: %snum_shared_experts: must be >= 0", path, x);
        if (c->moe_intermediate_size < 1)
            BAD("%s: %smoe_intermediate_size: %d must be >= 1", path, x, c->moe_intermediate_size);
        if (c->latent_size < 0) BAD("%s: %srouted_expert_hidden_size: must be >= 0", path, x);
        if (c->n_group < 1 || c->n_experts % c->n_group != 0)
            BAD("%s: %snum_expert_group: %d does not divide num_experts %d", path, x, c->n_group,
                c->n_experts);
        if (c->topk_group < 1 || c->topk_group > c->n_group)
            BAD("%s: %stopk_group: %d is outside 1..num_expert_group (%d)", path, x, c->topk_group,
                c->n_group);
        if ((int64_t)c->n_experts_per_tok > (int64_t)c->topk_group * (c->n_experts / c->n_group))
            BAD("%s: %snum_experts_per_token: %d > topk_group x experts per group (%d x %d)", path,
                x, c->n_experts_per_tok, c->topk_group, c->n_experts / c->n_group);
        if (!(c->routed_scaling_factor > 0) || !isfinite(c->routed_scaling_factor))
            BAD("%s: %srouted_scaling_factor: %g must be > 0", path, x,
                (double)c->routed_scaling_factor);
        if (c->experts_mxfp4 && (lat % 32 != 0 || c->moe_intermediate_size % 32 != 0))
            BAD("%s: %srouted_expert_hidden_size/moe_intermediate_size: %lld/%d must be multiples "
                "of 32 for MXFP4 experts",
                path, x, (long long)lat, c->moe_intermediate_size);
    }
#undef BAD
    return K3_OK;
}

k3_status k3_config_parse(const char *json_text, const char *path, k3_config *out) {
    if (!path) path = "config.json";
    if (!json_text || !out) return K3_ERR(K3_ERR_ARG, "k3_config_parse: NULL argument");
    cJSON *top = NULL;
    K3_TRY(k3_json_parse_strict(json_text, strlen(json_text), path, "the config", "invalid JSON",
                                "", K3_ERR_CONFIG, &top));
    k3_status s = parse_obj(top, path, out);
    cJSON_Delete(top);
    return s;
}

k3_status k3_config_load(const char *dir, k3_config *out) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text = NULL;
    size_t n = 0;
    k3_status s = k3_read_file(path, &text, &n);
    if (s != K3_OK) {
        /* keep k3_read_file's reason (no such file, permission, size), without its repeated
         * path prefix and its (file:line) suffix */
        char why[512];
        const char *e = k3_last_error();
        size_t pl = strlen(path);
        if (strncmp(e, path, pl) == 0 && strncmp(e + pl, ": ", 2) == 0) e += pl + 2;
        snprintf(why, sizeof why, "%s", e);
        char *at = strrchr(why, '(');
        if (at && at > why && at[-1] == ' ' && strchr(at, ':') && why[strlen(why) - 1] == ')')
            at[-1] = 0;
        return K3_ERR(s, "%s: cannot read the model config: %s", path, why);
    }
    const char *nul = memchr(text, 0, n); /* the parser would stop there */
    s = nul ? K3_ERR(K3_ERR_CONFIG, "%s: a NUL byte at offset %zu (a text file holds none)", path,
                     (size_t)(nul - text))
            : k3_config_parse(text, path, out);
    k3_free(text);
    K3_TRY(s);
    /* The stored A_log length is only in the checkpoint (K3 pads 96 -> 128). */
    for (int l = 0; l < out->n_layers; l++) {
        if (out->mixer[l] != K3_MIXER_KDA) continue;
        char name[192];
        snprintf(name, sizeof name, "%smodel.layers.%d.self_attn.A_log", out->tensor_prefix, l);
        int64_t shape[K3_MAX_DIMS];
        int ndim = 0;
        if (k3_st_peek_shape(dir, name, shape, &ndim) == K3_OK && ndim == 1) {
            if (shape[0] < out->kda_n_heads)
                return K3_ERR(K3_ERR_SHAPE, "%s: tensor %s has %lld entries < %d KDA heads", dir,
                              name, (long long)shape[0], out->kda_n_heads);
            out->kda_a_log_len = (int)shape[0];
        }
        k3_clear_error();
        break;
    }
    return K3_OK;
}

uint64_t k3_config_hash(const k3_config *c) {
    return k3_hash_bytes(c, sizeof *c, K3_HASH_INIT);
}

/* ---- presets ------------------------------------------------------------------------------ */
static void set_mla_layers(k3_config *c, const int *one_based, int n) {
    for (int l = 0; l < c->n_layers; l++) c->mixer[l] = K3_MIXER_KDA;
    for (int i = 0; i < n; i++) c->mixer[one_based[i] - 1] = K3_MIXER_MLA;
}

/* K3's layer schedule (spec §6.1): 93 layers, MLA at every 4th layer and the last (one-based),
 * AttnRes blocks of 12 (the k3 preset, and the deep preset on the tiny's widths). */
static void set_k3_schedule(k3_config *c) {
    c->n_layers = 93;
    c->attn_res_block_size = 12;
    int mla[24];
    for (int i = 0; i < 23; i++) mla[i] = 4 * (i + 1);
    mla[23] = 93;
    set_mla_layers(c, mla, 24);
}

void k3_preset_config(k3_preset p, k3_config *c) {
    memset(c, 0, sizeof *c);
    snprintf(c->tensor_prefix, sizeof c->tensor_prefix, "language_model.");
    c->rms_norm_eps = 1e-5f;
    c->mla_norm_eps = 1e-6f;
    c->tie_word_embeddings = false;
    c->mla_use_output_gate = true;
    c->kda_has_lower_bound = true;
    c->kda_gate_lower_bound = -5.0f;
    c->kda_full_rank_gate = true;
    c->act = K3_ACT_SITU;
    c->situ_beta = 4.0f;
    c->situ_linear_beta = 25.0f;
    c->first_k_dense_replace = 1;
    c->moe_layer_freq = 1;
    c->latent_moe_use_norm = true;
    c->moe_renormalize = true;
    c->routed_scaling_factor = 1.0f;
    c->experts_mxfp4 = true;
    c->kda_conv_kernel = 4;
    c->max_position_embeddings = 1048576; /* K3's (spec §6.1); the tiny and small say the same */
    if (p == K3_PRESET_DEEP) {            /* the tiny's widths, below; K3's layer schedule */
        k3_preset_config(K3_PRESET_TINY, c);
        set_k3_schedule(c);
        return;
    }
    if (p == K3_PRESET_K3) {
        c->vocab_size = 163840;
        c->hidden_size = 7168;
        c->eos_token_id = 163586;
        set_k3_schedule(c);
        c->n_heads = 96;
        c->q_lora_rank = 1536;
        c->kv_lora_rank = 512;
        c->qk_nope_head_dim = 128;
        c->qk_rope_head_dim = 64;
        c->v_head_dim = 128;
        c->kda_n_heads = 96;
        c->kda_head_dim = 128;
        c->kda_gate_rank = 128;
        c->kda_a_log_len = 128;
        c->intermediate_size = 33792;
        c->n_experts = 896;
        c->n_experts_per_tok = 16;
        c->n_shared_experts = 2;
        c->moe_intermediate_size = 3072;
        c->latent_size = 3584;
        c->n_group = 1;
        c->topk_group = 1;
    } else if (p == K3_PRESET_SMALL) {
        /* CPU benchmark: decode reads >= 200 MB of weights per token (k3 inspect prints it). */
        c->vocab_size = 32768 + 256;
        c->hidden_size = 1024;
        c->n_layers = 12;
        c->eos_token_id = 32768 + 2;
        c->attn_res_block_size = 4;
        static const int mla[] = {4, 8, 11, 12};
        set_mla_layers(c, mla, 4);
        c->n_heads = 8;
        c->q_lora_rank = 256;
        c->kv_lora_rank = 128;
        c->qk_nope_head_dim = 64;
        c->qk_rope_head_dim = 32;
        c->v_head_dim = 64;
        c->kda_n_heads = 8;
        c->kda_head_dim = 128;
        c->kda_gate_rank = 128;
        c->kda_a_log_len = 16;
        c->intermediate_size = 4096;
        c->n_experts = 64;
        c->n_experts_per_tok = 8;
        c->n_shared_experts = 1;
        c->moe_intermediate_size = 384;
        c->latent_size = 768;
        c->n_group = 8;
        c->topk_group = 4;
    } else { /* tiny: exactly the numbers of issue 2 */
        c->vocab_size = 3840 + 256;
        c->hidden_size = 128;
        c->n_layers = 8;
        c->eos_token_id = 3840 + 2; /* <|end_of_msg|> = special block + 2 */
        c->attn_res_block_size = 3;
        static const int mla[] = {4, 7, 8};
        set_mla_layers(c, mla, 3);
        c->n_heads = 4;
        c->q_lora_rank = 64;
        c->kv_lora_rank = 32;
        c->qk_nope_head_dim = 16;
        c->qk_rope_head_dim = 8;
        c->v_head_dim = 16;
        c->kda_n_heads = 4;
        c->kda_head_dim = 32;
        c->kda_gate_rank = 32;
        c->kda_a_log_len = 8;
        c->intermediate_size = 256;
        c->n_experts = 16;
        c->n_experts_per_tok = 4;
        c->n_shared_experts = 1;
        c->moe_intermediate_size = 64;
        c->latent_size = 96;
        c->n_group = 4;
        c->topk_group = 2;
    }
}

k3_status k3_preset_parse(const char *name, k3_preset *out) {
    if (name && strcmp(name, "tiny") == 0)
        *out = K3_PRESET_TINY;
    else if (name && strcmp(name, "small") == 0)
        *out = K3_PRESET_SMALL;
    else if (name && strcmp(name, "k3") == 0)
        *out = K3_PRESET_K3;
    else if (name && strcmp(name, "deep") == 0)
        *out = K3_PRESET_DEEP;
    else
        return K3_ERR(K3_ERR_ARG, "unknown preset '%s' (tiny, small, deep or k3)",
                      name ? name : "");
    return K3_OK;
}

/* ---- config.json writer -------------------------------------------------------------------- */
/* The shortest decimal that reads back as the same float (1e-5f prints as 1e-05, not
 * 9.99999974737875e-06). */
static double fd(float f) {
    char b[40];
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(b, sizeof b, "%.*g", prec, (double)f);
        double d = strtod(b, NULL);
        if ((float)d == f) return d;
    }
    return (double)f;
}

static cJSON *layer_list(const k3_config *c, k3_mixer m) {
    cJSON *a = cJSON_CreateArray();
    for (int l = 0; l < c->n_layers; l++)
        if (c->mixer[l] == m) cJSON_AddItemToArray(a, cJSON_CreateNumber(l + 1));
    return a;
}

cJSON *k3_config_json(const k3_config *c) {
    cJSON *tc = cJSON_CreateObject();
    if (!tc) return NULL;
    cJSON_AddStringToObject(tc, "model_type", "kimi_linear");
    cJSON_AddNumberToObject(tc, "vocab_size", (double)c->vocab_size);
    cJSON_AddNumberToObject(tc, "hidden_size", (double)c->hidden_size);
    cJSON_AddNumberToObject(tc, "intermediate_size", (double)c->intermediate_size);
    cJSON_AddNumberToObject(tc, "num_hidden_layers", c->n_layers);
    cJSON_AddNumberToObject(tc, "num_attention_heads", c->n_heads);
    cJSON_AddNumberToObject(tc, "num_key_value_heads", c->n_heads);
    if (c->q_lora_rank > 0)
        cJSON_AddNumberToObject(tc, "q_lora_rank", c->q_lora_rank);
    else
        cJSON_AddNullToObject(tc, "q_lora_rank");
    cJSON_AddNumberToObject(tc, "kv_lora_rank", c->kv_lora_rank);
    cJSON_AddNumberToObject(tc, "qk_nope_head_dim", c->qk_nope_head_dim);
    cJSON_AddNumberToObject(tc, "qk_rope_head_dim", c->qk_rope_head_dim);
    cJSON_AddNumberToObject(tc, "v_head_dim", c->v_head_dim);
    cJSON_AddBoolToObject(tc, "mla_use_nope", true);
    cJSON_AddBoolToObject(tc, "mla_use_output_gate", c->mla_use_output_gate);
    cJSON *la = cJSON_AddObjectToObject(tc, "linear_attn_config");
    cJSON_AddItemToObject(la, "full_attn_layers", layer_list(c, K3_MIXER_MLA));
    cJSON_AddItemToObject(la, "kda_layers", layer_list(c, K3_MIXER_KDA));
    cJSON_AddNumberToObject(la, "num_heads", c->kda_n_heads);
    cJSON_AddNumberToObject(la, "head_dim", c->kda_head_dim);
    cJSON_AddNumberToObject(la, "short_conv_kernel_size", c->kda_conv_kernel);
    if (c->kda_has_lower_bound)
        cJSON_AddNumberToObject(la, "gate_lower_bound", fd(c->kda_gate_lower_bound));
    cJSON_AddBoolToObject(la, "use_full_rank_gate", c->kda_full_rank_gate);
    if (c->act == K3_ACT_SITU) {
        cJSON_AddStringToObject(tc, "hidden_act", "situ");
        cJSON_AddNumberToObject(tc, "activation_situ_beta", fd(c->situ_beta));
        cJSON_AddNumberToObject(tc, "activation_situ_linear_beta", fd(c->situ_linear_beta));
    } else {
        cJSON_AddStringToObject(tc, "hidden_act", "silu");
    }
    if (c->attn_res_block_size > 0)
        cJSON_AddNumberToObject(tc, "attn_res_block_size", c->attn_res_block_size);
    cJSON_AddNumberToObject(tc, "first_k_dense_replace", c->first_k_dense_replace);
    cJSON_AddNumberToObject(tc, "moe_layer_freq", c->moe_layer_freq);
    cJSON_AddNumberToObject(tc, "num_experts", c->n_experts);
    cJSON_AddNumberToObject(tc, "num_experts_per_token", c->n_experts_per_tok);
    cJSON_AddNumberToObject(tc, "num_shared_experts", c->n_shared_experts);
    cJSON_AddNumberToObject(tc, "moe_intermediate_size", c->moe_intermediate_size);
    if (c->latent_size > 0) {
        cJSON_AddNumberToObject(tc, "routed_expert_hidden_size", c->latent_size);
        cJSON_AddBoolToObject(tc, "latent_moe_use_norm", c->latent_moe_use_norm);
    }
    cJSON_AddStringToObject(tc, "moe_router_activation_func", "sigmoid");
    cJSON_AddBoolToObject(tc, "moe_renormalize", c->moe_renormalize);
    cJSON_AddNumberToObject(tc, "routed_scaling_factor", fd(c->routed_scaling_factor));
    cJSON_AddStringToObject(tc, "topk_method", "noaux_tc");
    cJSON_AddBoolToObject(tc, "use_grouped_topk", true);
    cJSON_AddNumberToObject(tc, "num_expert_group", c->n_group);
    cJSON_AddNumberToObject(tc, "topk_group", c->topk_group);
    cJSON_AddNumberToObject(tc, "rms_norm_eps", fd(c->rms_norm_eps));
    if (c->max_position_embeddings > 0)
        cJSON_AddNumberToObject(tc, "max_position_embeddings", (double)c->max_position_embeddings);
    cJSON_AddNumberToObject(tc, "num_nextn_predict_layers", 0);
    cJSON_AddBoolToObject(tc, "tie_word_embeddings", c->tie_word_embeddings);
    cJSON_AddNumberToObject(tc, "eos_token_id", c->eos_token_id);
    return tc;
}

k3_status k3_config_to_json(const k3_config *c, char **out_json) {
    cJSON *tc = k3_config_json(c);
    if (!tc) return K3_ERR(K3_ERR_NOMEM, "config.json: out of memory");
    cJSON *q = NULL;
    if (c->experts_mxfp4) {
        q = cJSON_CreateObject();
        cJSON_AddStringToObject(q, "quant_method", "compressed-tensors");
        cJSON_AddStringToObject(q, "format", "mxfp4-pack-quantized");
        cJSON_AddStringToObject(q, "quantization_status", "compressed");
        cJSON *g0 = cJSON_AddObjectToObject(cJSON_AddObjectToObject(q, "config_groups"), "group_0");
        cJSON *tg = cJSON_AddArrayToObject(g0, "targets");
        cJSON_AddItemToArray(tg, cJSON_CreateString("Linear"));
        cJSON *w = cJSON_AddObjectToObject(g0, "weights");
        cJSON_AddNumberToObject(w, "num_bits", 4);
        cJSON_AddStringToObject(w, "type", "float");
        cJSON_AddStringToObject(w, "strategy", "group");
        cJSON_AddNumberToObject(w, "group_size", 32);
        cJSON_AddBoolToObject(w, "symmetric", true);
        cJSON_AddBoolToObject(w, "dynamic", false);
        cJSON_AddStringToObject(w, "scale_dtype", "torch.uint8");
        cJSON_AddNullToObject(g0, "input_activations");
        cJSON_AddNullToObject(g0, "output_activations");
        cJSON_AddStringToObject(g0, "format", "mxfp4-pack-quantized");
        cJSON *ig = cJSON_AddArrayToObject(q, "ignore");
        static const char *const ign[] = {"lm_head",
                                          "re:.*self_attn.*",
                                          "re:.*shared_experts.*",
                                          "re:.*mlp\\.(gate|up|down)_proj.*",
                                          "re:.*block_sparse_moe\\.gate$",
                                          "re:.*routed_expert_(down|up)_proj.*",
                                          "re:vision_tower.*",
                                          "re:mm_projector.*"};
        for (size_t i = 0; i < K3_ARRAY_LEN(ign); i++)
            cJSON_AddItemToArray(ig, cJSON_CreateString(ign[i]));
    }

    cJSON *root;
    if (c->tensor_prefix[0]) {
        root = cJSON_CreateObject();
        cJSON *ar = cJSON_AddArrayToObject(root, "architectures");
        cJSON_AddItemToArray(ar, cJSON_CreateString("KimiK3ForConditionalGeneration"));
        cJSON_AddStringToObject(root, "model_type", "kimi_k3");
        cJSON_AddItemToObject(root, "text_config", tc);
        if (q) cJSON_AddItemToObject(root, "quantization_config", q);
        cJSON_AddNumberToObject(root, "eos_token_id", c->eos_token_id);
        cJSON_AddBoolToObject(root, "tie_word_embeddings", c->tie_word_embeddings);
    } else {
        root = tc;
        cJSON *ar = cJSON_AddArrayToObject(root, "architectures");
        cJSON_AddItemToArray(ar, cJSON_CreateString("KimiLinearForCausalLM"));
        if (q) cJSON_AddItemToObject(root, "quantization_config", q);
    }
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    if (!s) return K3_ERR(K3_ERR_NOMEM, "config.json: cannot print");
    size_t n = strlen(s);
    k3_status st = k3_alloc((void **)out_json, n + 2, "config.json text");
    if (st == K3_OK) {
        memcpy(*out_json, s, n);
        (*out_json)[n] = '\n';
        (*out_json)[n + 1] = 0;
    }
    cJSON_free(s);
    return st;
}
