/* test_config_keys.c — the config key table (model/config_keys.h) against the parser, the writer
 * and validation, row by row.
 *
 * The base is the tiny preset written by k3_config_to_json (every key present). For each row:
 * the key appears once in the table and once in the written config.json; a required key,
 * removed, is "missing" naming it; a bounded number just outside each bound is refused naming
 * the key, the value and the bound, and the bound itself is accepted (or, where a rule that ties
 * keys together refuses it, refused by that rule, listed below). Every preset, and a flat
 * Kimi-Linear-style config, goes parse -> write -> parse to the same k3_config and the same
 * text. A few bounds are pinned here from the spec and k3's limits, so that a wrong bound in the
 * table fails. */
#include <cjson/cJSON.h>
#include <math.h>

#include "config_keys.h"
#include "k3_model.h"
#include "k3_test.h"

static const k3_config_key *rows;
static int n_rows;

static const k3_config_key *row(int obj, const char *key) {
    for (int i = 0; i < n_rows; i++)
        if (rows[i].obj == obj && strcmp(rows[i].key, key) == 0) return &rows[i];
    return NULL;
}

/* The object that holds `obj`'s keys in the K3 layout. */
static cJSON *obj_of(cJSON *top, int obj) {
    cJSON *tc = cJSON_GetObjectItem(top, "text_config");
    cJSON *q = cJSON_GetObjectItem(top, "quantization_config");
    cJSON *g = cJSON_GetObjectItem(cJSON_GetObjectItem(q, "config_groups"), "group_0");
    switch (obj) {
    case K3_CO_TOP:
        return top;
    case K3_CO_TEXT:
        return tc;
    case K3_CO_LINEAR:
        return cJSON_GetObjectItem(tc, "linear_attn_config");
    case K3_CO_QUANT:
        return q;
    case K3_CO_QGROUP:
        return g;
    default:
        return cJSON_GetObjectItem(g, "weights");
    }
}

static const char *prefix(int obj) {
    static const char *p[] = {"",
                              "text_config.",
                              "text_config.linear_attn_config.",
                              "quantization_config.",
                              "quantization_config.config_groups.*.",
                              "quantization_config.config_groups.*.weights."};
    return p[obj];
}

static char *base_json;

/* Parse the base with one edit: `v` replaces the row's value (NULL: the key is removed). */
static k3_status parse_edit(const k3_config_key *r, cJSON *v, k3_config *c) {
    cJSON *top = cJSON_Parse(base_json);
    cJSON *o = obj_of(top, r->obj);
    if (v)
        cJSON_ReplaceItemInObjectCaseSensitive(o, r->key, v);
    else
        cJSON_DeleteItemFromObjectCaseSensitive(o, r->key);
    if (!v && r->obj == K3_CO_TEXT && strcmp(r->key, "eos_token_id") == 0)
        cJSON_DeleteItemFromObjectCaseSensitive(top, r->key); /* read from the top too */
    char *s = cJSON_PrintUnformatted(top);
    cJSON_Delete(top);
    k3_status st = k3_config_parse(s, "config.json", c);
    cJSON_free(s);
    return st;
}

static void fmt_num(const k3_config_key *r, double v, char *out, size_t n) {
    if (r->type == K3_CK_FLOAT)
        snprintf(out, n, "%g", v);
    else
        snprintf(out, n, "%lld", (long long)v);
}

/* Bounds refused by a rule that ties keys together, on the tiny preset's values (hi = 1: the
 * upper bound). The parse must fail naming the rule, not the bound. */
static const struct {
    const char *key;
    int hi;
    const char *rule;
} tied[] = {
    {"vocab_size", 0, "eos_token_id: 3842 is not a token id"},
    {"intermediate_size", 0, "there are dense layers"},
    {"num_hidden_layers", 0, "full_attn_layers[0]: layer 4 is outside 1..1"},
    {"num_hidden_layers", 1, "layer 9 is in neither"},
    {"num_attention_heads", 0, "num_key_value_heads: 4 != num_attention_heads 1"},
    {"num_attention_heads", 1, "num_key_value_heads: 4 != num_attention_heads 1048576"},
    {"num_key_value_heads", 0, "num_key_value_heads: 1 != num_attention_heads 4"},
    {"num_key_value_heads", 1, "num_key_value_heads: 1048576 != num_attention_heads 4"},
    {"first_k_dense_replace", 1, "first_k_dense_replace: 256 is outside 0..num_hidden_layers"},
    {"num_experts", 1, "num_expert_group: 4 does not divide num_experts 32767"},
    {"num_experts_per_token", 1, "num_experts_per_token: 32767 is outside 1..num_experts (16)"},
    {"num_shared_experts", 1, "num_shared_experts x moe_intermediate_size"},
    {"moe_intermediate_size", 0, "must be multiples of 32"},
    {"num_expert_group", 0, "topk_group: 2 is outside 1..num_expert_group (1)"},
    {"num_expert_group", 1, "num_expert_group: 32767 does not divide num_experts 16"},
    {"topk_group", 1, "topk_group: 32767 is outside 1..num_expert_group (4)"},
    {"eos_token_id", 1, "eos_token_id: 2147483646 is not a token id"},
};

static const char *tied_rule(const k3_config_key *r, int hi) {
    for (size_t i = 0; i < K3_ARRAY_LEN(tied); i++)
        if (strcmp(tied[i].key, r->key) == 0 && tied[i].hi == hi) return tied[i].rule;
    return NULL;
}

/* One bound of a numeric row: just outside is refused naming key, value and bound; the bound
 * (or, for an open float bound, the nearest float inside) is accepted. */
static void check_bound(const k3_config_key *r, int hi) {
    double b = hi ? r->hi : r->lo;
    bool open = hi ? (r->flags & K3_CK_HI_OPEN) : (r->flags & K3_CK_LO_OPEN);
    double out, in;
    if (r->type == K3_CK_FLOAT) {
        out = open ? b : nextafter(b, hi ? HUGE_VAL : -HUGE_VAL);
        in = open ? (double)nextafterf((float)b, hi ? -HUGE_VALF : HUGE_VALF) : b;
    } else {
        out = hi ? b + 1 : b - 1;
        in = b;
    }
    char vs[64], bs[64], needle[256];
    fmt_num(r, out, vs, sizeof vs);
    fmt_num(r, b, bs, sizeof bs);
    k3_config c;
    k3_clear_error();
    k3_status st = parse_edit(r, cJSON_CreateNumber(out), &c);
    snprintf(needle, sizeof needle, "%s%s: %s ", prefix(r->obj), r->key, vs);
    const char *e = k3_last_error();
    K3_CHECK(st == K3_ERR_CONFIG && strstr(e, needle) && strstr(e + strlen(needle), bs),
             "%s = %s (outside %s): '%s'", r->key, vs, bs, e);
    const char *rule = tied_rule(r, hi);
    if (rule)
        K3_CHECK_ERR(parse_edit(r, cJSON_CreateNumber(in), &c), K3_ERR_CONFIG, rule);
    else
        K3_CHECK_OK(parse_edit(r, cJSON_CreateNumber(in), &c));
}

static bool bounded(const k3_config_key *r) {
    return (r->type == K3_CK_INT || r->type == K3_CK_I64 || r->type == K3_CK_FLOAT) &&
           !(r->flags & (K3_CK_CONST | K3_CK_NOREAD));
}

/* parse -> write -> parse gives the same config and the same text; `want` (when given) is the
 * config the first parse must give. */
static void round_trip(const k3_config *want, const char *what) {
    char *j1 = NULL, *j2 = NULL;
    k3_config c1, c2;
    K3_CHECK_OK(k3_config_to_json(want, &j1));
    K3_CHECK_OK(k3_config_parse(j1, what, &c1));
    K3_CHECK_OK(k3_config_to_json(&c1, &j2));
    K3_CHECK_OK(k3_config_parse(j2, what, &c2));
    K3_CHECK(memcmp(&c1, &c2, sizeof c1) == 0, "%s: parse(write(parse)) == parse", what);
    K3_CHECK(j1 && j2 && strcmp(j1, j2) == 0, "%s: the same text written twice", what);
    k3_config w = *want;
    w.kda_a_log_len = c1.kda_a_log_len; /* from the checkpoint, not config.json */
    K3_CHECK(memcmp(&w, &c1, sizeof w) == 0, "%s: parse(write(config)) == config", what);
    k3_free(j1);
    k3_free(j2);
}

int main(void) {
    rows = k3_config_keys(&n_rows);
    K3_CHECK(n_rows > 40, "%d rows", n_rows);

    /* the table itself: each key once in its object; fields of the row's type; defaults and
     * constants inside the bounds */
    for (int i = 0; i < n_rows; i++) {
        const k3_config_key *r = &rows[i];
        for (int j = 0; j < i; j++)
            K3_CHECK(rows[j].obj != r->obj || strcmp(rows[j].key, r->key) != 0,
                     "%s%s appears twice", prefix(r->obj), r->key);
        int want = r->type == K3_CK_INT     ? (int)sizeof(int)
                   : r->type == K3_CK_I64   ? (int)sizeof(int64_t)
                   : r->type == K3_CK_FLOAT ? (int)sizeof(float)
                   : r->type == K3_CK_BOOL  ? (int)sizeof(bool)
                                            : r->size;
        K3_CHECK(r->off < 0 || r->size == want, "%s: field of %d bytes for its type", r->key,
                 r->size);
        K3_CHECK(!(r->flags & K3_CK_REQ) || !(r->flags & K3_CK_NOREAD), "%s", r->key);
        K3_CHECK(r->type != K3_CK_STR || !(r->flags & K3_CK_CONST) || r->str, "%s", r->key);
        K3_CHECK(r->lo <= r->hi, "%s: lo <= hi", r->key);
        if (r->type == K3_CK_INT)
            K3_CHECK(r->lo >= -2147483647.0 - 1 && r->hi <= 2147483647.0, "%s fits int", r->key);
        if (bounded(r) && !(r->flags & (K3_CK_REQ | K3_CK_OMIT0 | K3_CK_NULL0 | K3_CK_SPECIAL)))
            K3_CHECK(r->def >= r->lo && r->def <= r->hi, "%s: default %g inside the bounds", r->key,
                     r->def);
    }
    /* bounds pinned from the spec and k3's limits */
    static const struct {
        int obj;
        const char *key;
        double lo, hi;
    } pin[] = {
        {K3_CO_TEXT, "vocab_size", 1, 2147483647.0},
        {K3_CO_TEXT, "hidden_size", 1, 1 << 20},
        {K3_CO_TEXT, "num_hidden_layers", 1, K3_MAX_LAYERS},
        {K3_CO_TEXT, "num_experts", 0, 32767},
        {K3_CO_TEXT, "max_position_embeddings", 1, 1099511627776.0},
        {K3_CO_TEXT, "rms_norm_eps", 0, 1},
        {K3_CO_LINEAR, "short_conv_kernel_size", 1, 64},
        {K3_CO_LINEAR, "head_dim", 1, 1 << 20},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(pin); i++) {
        const k3_config_key *r = row(pin[i].obj, pin[i].key);
        K3_CHECK(r && r->lo == pin[i].lo && r->hi == pin[i].hi, "%s: bounds %g..%g", pin[i].key,
                 r ? r->lo : 0, r ? r->hi : 0);
    }

    /* the base: the tiny preset as written; every key of text_config and linear_attn_config is
     * a row, and every row of theirs is written */
    k3_config p;
    k3_preset_config(K3_PRESET_TINY, &p);
    K3_CHECK_OK(k3_config_to_json(&p, &base_json));
    cJSON *top = cJSON_Parse(base_json);
    for (int obj = K3_CO_TOP; obj <= K3_CO_QWEIGHTS; obj++) {
        const cJSON *e;
        if (obj != K3_CO_TOP) cJSON_ArrayForEach(e, obj_of(top, obj)) {
                bool known = row(obj, e->string) != NULL;
                if (obj >= K3_CO_QUANT) continue; /* HF's keys k3 does not read */
                K3_CHECK(known, "written key %s%s is not in the table", prefix(obj), e->string);
            }
        for (int i = 0; i < n_rows; i++)
            if (rows[i].obj == obj)
                K3_CHECK(cJSON_GetObjectItemCaseSensitive(obj_of(top, obj), rows[i].key),
                         "%s%s is written", prefix(obj), rows[i].key);
    }
    cJSON_Delete(top);

    int n_req = 0, n_bounds = 0;
    k3_config c;
    for (int i = 0; i < n_rows; i++) {
        const k3_config_key *r = &rows[i];
        if (r->flags & K3_CK_REQ) {
            char needle[192];
            /* eos_token_id, missing from both, is reported at the top level (its fallback) */
            bool eos = strcmp(r->key, "eos_token_id") == 0;
            snprintf(needle, sizeof needle, "%s%s: missing", eos ? ": " : prefix(r->obj), r->key);
            K3_CHECK_ERR(parse_edit(r, NULL, &c), K3_ERR_CONFIG, needle);
            n_req++;
        }
        if (!bounded(r)) continue;
        for (int hi = 0; hi < 2; hi++)
            if (isfinite(hi ? r->hi : r->lo)) {
                check_bound(r, hi);
                n_bounds++;
            }
    }
    K3_CHECK(n_req >= 18 && n_bounds >= 50, "%d required keys, %d bounds walked", n_req, n_bounds);

    /* round trips: every preset, and a flat Kimi-Linear-style config (no text_config, BF16
     * experts on D, SwiGLU, softplus gate, no q LoRA, no AttnRes, no max_position_embeddings) */
    static const k3_preset presets[] = {K3_PRESET_TINY, K3_PRESET_SMALL, K3_PRESET_DEEP,
                                        K3_PRESET_K3};
    for (size_t i = 0; i < K3_ARRAY_LEN(presets); i++) {
        k3_preset_config(presets[i], &p);
        round_trip(&p, "preset.json");
    }
    k3_preset_config(K3_PRESET_TINY, &p);
    memset(p.tensor_prefix, 0, sizeof p.tensor_prefix);
    p.experts_mxfp4 = false;
    p.act = K3_ACT_SWIGLU;
    p.situ_beta = p.situ_linear_beta = 0;
    p.kda_has_lower_bound = false;
    p.kda_gate_lower_bound = 0;
    p.latent_size = 0;
    p.latent_moe_use_norm = false;
    p.q_lora_rank = 0;
    p.attn_res_block_size = 0;
    p.max_position_embeddings = 0;
    p.tie_word_embeddings = true;
    round_trip(&p, "flat.json");

    k3_free(base_json);
    return k3_test_done("model_config_keys");
}
