/* config.c — config.json -> k3_config (parse + validate), the presets, config.json writer.
 *
 * One table of keys (CK_ROWS below; its row type is config_keys.h) drives all three: each row
 * holds the key, the object that holds it, its type, its k3_config field, its bounds and its
 * default. The parser and the writer walk the rows in order (the order config.json is printed
 * in); k3_config_validate checks every field against its row's bounds, then the rules that tie
 * keys together. Keys with their own structure (layer lists, the activation name, an alias at
 * the top level, the quantization block) are SPECIAL rows read by small dedicated code below;
 * their names still come from the table.
 *
 * Reads the real K3 layout (top-level `model_type: kimi_k3` with the text model under
 * `text_config`, `quantization_config` at the top) and flat Kimi-Linear-style configs with the
 * same code (spec/K3-MODEL.md §6.1). Every missing or invalid value is K3_ERR_CONFIG naming the
 * key ("config.json: text_config.linear_attn_config.full_attn_layers[3]: ..."); nothing is
 * clamped. The text is held strictly (k3_json_parse_strict: no NUL, UTF-8, no key twice, nothing
 * after the object). Every key k3 reads is bounded, including those the forward does not use
 * but that say what the model is. Layer lists are 1-based in the file and 0-based in
 * k3_config.mixer[].
 *
 * One value is not in config.json: the stored length of KDA `A_log` (K3 stores 128 for 96 heads,
 * zero-padded). Parsing gives the next power of two >= heads (right for K3); k3_config_load then
 * reads the real length from the checkpoint header when a checkpoint is present. */
#include "k3_config_json.h"
#include "config_keys.h"
#include "k3_model.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <errno.h>
#include <stddef.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>

#include "model_internal.h"

/* Upper bounds (k3's limits, not the format's). They keep every tensor's element and byte count
 * far inside int64 (largest product: heads x head dims x rank x 2 bytes <= 2^62) and the catalogue
 * small enough to list in memory; the 64-bit totals are still computed with overflow checks. */
#define K3_CFG_MAX_DIM              (1 << 20)  /* hidden, head dims, ranks, sizes, head counts */
#define K3_CFG_MAX_VOCAB            2147483647 /* token ids are int32 */
#define K3_CFG_MAX_EXPERTS          32767      /* the plan stores expert lanes as int16 */
#define K3_CFG_MAX_EXPERT_INSTANCES (1 << 18)  /* MoE layers x experts (K3: 92 x 896 = 82432) */
#define K3_CFG_MAX_POSITIONS        ((int64_t)1 << 40) /* K3: 2^20 */
#define K3_CFG_MAX_INT              1000000000         /* a count with no tighter limit: fits int */
#define K3_CFG_MAX_CONV             64                 /* KDA short-conv taps (K3: 4) */

/* ---- the key table -------------------------------------------------------------------------- */
/* X(id, object, "key", type, field, flags, when, lo, hi, default, const string, why)
 * Bounds are inclusive (floats: unless LO_OPEN/HI_OPEN); NO = no bound. `why` is appended to
 * limit and unsupported-value errors. The rows are in the writer's order; the parser reads them
 * in the same order, so a key that another's check or default needs comes first (vocab_size
 * before eos_token_id, num_hidden_layers before the layer lists, num_experts before the MoE
 * keys). */
#define NO      HUGE_VAL
#define FLD(f)  (int)offsetof(k3_config, f), (int)sizeof(((k3_config *)0)->f)
#define NOF     -1, 0
#define MAXD    K3_CFG_MAX_DIM
#define TOP     K3_CO_TOP
#define TEXT    K3_CO_TEXT
#define LIN     K3_CO_LINEAR
#define QNT     K3_CO_QUANT
#define QGRP    K3_CO_QGROUP
#define QW      K3_CO_QWEIGHTS
#define REQ     K3_CK_REQ
#define CONST   K3_CK_CONST
#define NOREAD  K3_CK_NOREAD
#define OMIT0   K3_CK_OMIT0
#define NULL0   K3_CK_NULL0
#define SPECIAL K3_CK_SPECIAL
#define LO_OPEN K3_CK_LO_OPEN
#define HI_OPEN K3_CK_HI_OPEN
/* clang-format off */
#define CK_ROWS(X)                                                                                 \
  /* SPECIAL: optional nesting; its presence sets the tensor prefix */                             \
  X(TEXT_CONFIG, TOP, "text_config", OBJ, NOF, SPECIAL, ALL, -NO, NO, 0, NULL, NULL)                \
  /* written for HF tools; k3 reads the keys whatever the model type */                            \
  X(MODEL_TYPE, TEXT, "model_type", STR, NOF, NOREAD | CONST, ALL, -NO, NO, 0, "kimi_linear", NULL) \
  X(VOCAB_SIZE, TEXT, "vocab_size", I64, FLD(vocab_size), REQ, ALL, 1, K3_CFG_MAX_VOCAB, 0, NULL,   \
    "token ids are int32")                                                                         \
  X(HIDDEN_SIZE, TEXT, "hidden_size", I64, FLD(hidden_size), REQ, ALL, 1, MAXD, 0, NULL, NULL)      \
  /* >= 1 when a layer is dense (a rule in k3_config_validate) */                                  \
  X(INTERMEDIATE_SIZE, TEXT, "intermediate_size", I64, FLD(intermediate_size), REQ, ALL, 0, MAXD,   \
    0, NULL, NULL)                                                                                 \
  X(NUM_HIDDEN_LAYERS, TEXT, "num_hidden_layers", INT, FLD(n_layers), REQ, ALL, 1, K3_MAX_LAYERS,  \
    0, NULL, NULL)                                                                                 \
  X(NUM_ATTENTION_HEADS, TEXT, "num_attention_heads", INT, FLD(n_heads), REQ, ALL, 1, MAXD, 0,     \
    NULL, NULL)                                                                                    \
  /* SPECIAL: no field; defaults to and must equal num_attention_heads */                          \
  X(NUM_KEY_VALUE_HEADS, TEXT, "num_key_value_heads", INT, NOF, SPECIAL, ALL, 1, MAXD, 0, NULL,    \
    "MLA needs equal counts")                                                                      \
  /* null or 0 = no q LoRA (q_proj directly) */                                                    \
  X(Q_LORA_RANK, TEXT, "q_lora_rank", INT, FLD(q_lora_rank), NULL0, ALL, 0, MAXD, 0, NULL, NULL)    \
  X(KV_LORA_RANK, TEXT, "kv_lora_rank", INT, FLD(kv_lora_rank), REQ, ALL, 1, MAXD, 0, NULL, NULL)   \
  X(QK_NOPE_HEAD_DIM, TEXT, "qk_nope_head_dim", INT, FLD(qk_nope_head_dim), REQ, ALL, 1, MAXD, 0,  \
    NULL, NULL)                                                                                    \
  X(QK_ROPE_HEAD_DIM, TEXT, "qk_rope_head_dim", INT, FLD(qk_rope_head_dim), REQ, ALL, 0, MAXD, 0,  \
    NULL, NULL)                                                                                    \
  X(V_HEAD_DIM, TEXT, "v_head_dim", INT, FLD(v_head_dim), REQ, ALL, 1, MAXD, 0, NULL, NULL)         \
  X(MLA_USE_NOPE, TEXT, "mla_use_nope", BOOL, NOF, CONST, ALL, -NO, NO, 1, NULL,                   \
    "MLA with RoPE is not implemented")                                                            \
  X(MLA_USE_OUTPUT_GATE, TEXT, "mla_use_output_gate", BOOL, FLD(mla_use_output_gate), 0, ALL, -NO, \
    NO, 0, NULL, NULL)                                                                             \
  X(LINEAR_ATTN_CONFIG, TEXT, "linear_attn_config", OBJ, NOF, REQ, ALL, -NO, NO, 0, NULL, NULL)     \
  /* SPECIAL: 1-based layer lists -> mixer[]; every layer in exactly one when both are given */   \
  X(FULL_ATTN_LAYERS, LIN, "full_attn_layers", LIST, FLD(mixer), REQ | SPECIAL, ALL, -NO, NO, 0,    \
    NULL, NULL)                                                                                    \
  X(KDA_LAYERS, LIN, "kda_layers", LIST, FLD(mixer), SPECIAL, ALL, -NO, NO, 0, NULL, NULL)          \
  X(KDA_NUM_HEADS, LIN, "num_heads", INT, FLD(kda_n_heads), REQ, ALL, 1, MAXD, 0, NULL, NULL)       \
  X(KDA_HEAD_DIM, LIN, "head_dim", INT, FLD(kda_head_dim), REQ, ALL, 1, MAXD, 0, NULL, NULL)        \
  X(SHORT_CONV_KERNEL_SIZE, LIN, "short_conv_kernel_size", INT, FLD(kda_conv_kernel), REQ, ALL, 1, \
    K3_CFG_MAX_CONV, 0, NULL, NULL)                                                                \
  /* SPECIAL: presence sets kda_has_lower_bound (absent = the Kimi-Linear softplus gate) */        \
  X(GATE_LOWER_BOUND, LIN, "gate_lower_bound", FLOAT, FLD(kda_gate_lower_bound),                   \
    SPECIAL | HI_OPEN, LB, -NO, 0, 0, NULL, NULL)                                                  \
  X(USE_FULL_RANK_GATE, LIN, "use_full_rank_gate", BOOL, FLD(kda_full_rank_gate), 0, ALL, -NO, NO, \
    0, NULL, NULL)                                                                                 \
  /* SPECIAL: an enum (act_names) */                                                               \
  X(HIDDEN_ACT, TEXT, "hidden_act", STR, FLD(act), REQ | SPECIAL, ALL, -NO, NO, 0, NULL, NULL)      \
  X(SITU_BETA, TEXT, "activation_situ_beta", FLOAT, FLD(situ_beta), REQ | LO_OPEN, SITU, 0, NO, 0, \
    NULL, NULL)                                                                                    \
  /* <= 0: the up branch is not capped */                                                          \
  X(SITU_LINEAR_BETA, TEXT, "activation_situ_linear_beta", FLOAT, FLD(situ_linear_beta), 0, SITU,  \
    -NO, NO, 0, NULL, NULL)                                                                        \
  /* 0 = no AttnRes (Kimi-Linear: plain pre-norm residual) */                                      \
  X(ATTN_RES_BLOCK_SIZE, TEXT, "attn_res_block_size", INT, FLD(attn_res_block_size), OMIT0, ALL, 0,\
    MAXD, 0, NULL, NULL)                                                                           \
  /* <= num_hidden_layers (a rule) */                                                              \
  X(FIRST_K_DENSE_REPLACE, TEXT, "first_k_dense_replace", INT, FLD(first_k_dense_replace), 0, ALL, \
    0, K3_MAX_LAYERS, 0, NULL, NULL)                                                               \
  X(MOE_LAYER_FREQ, TEXT, "moe_layer_freq", INT, FLD(moe_layer_freq), 0, ALL, 1, K3_CFG_MAX_INT,   \
    1, NULL, NULL)                                                                                 \
  X(NUM_EXPERTS, TEXT, "num_experts", INT, FLD(n_experts), 0, ALL, 0, K3_CFG_MAX_EXPERTS, 0, NULL, \
    NULL)                                                                                          \
  /* <= num_experts, <= topk_group x experts per group (rules) */                                  \
  X(NUM_EXPERTS_PER_TOKEN, TEXT, "num_experts_per_token", INT, FLD(n_experts_per_tok), REQ, MOE, 1,\
    K3_CFG_MAX_EXPERTS, 0, NULL, NULL)                                                             \
  X(NUM_SHARED_EXPERTS, TEXT, "num_shared_experts", INT, FLD(n_shared_experts), 0, MOE, 0, MAXD,   \
    0, NULL, NULL)                                                                                 \
  X(MOE_INTERMEDIATE_SIZE, TEXT, "moe_intermediate_size", INT, FLD(moe_intermediate_size), REQ,    \
    MOE, 1, MAXD, 0, NULL, NULL)                                                                   \
  /* 0 = no latent (experts on the hidden size) */                                                 \
  X(ROUTED_EXPERT_HIDDEN_SIZE, TEXT, "routed_expert_hidden_size", INT, FLD(latent_size), OMIT0,    \
    MOE, 0, MAXD, 0, NULL, NULL)                                                                   \
  /* SPECIAL: read under MOE; its default is routed_expert_hidden_size > 0 */                     \
  X(LATENT_MOE_USE_NORM, TEXT, "latent_moe_use_norm", BOOL, FLD(latent_moe_use_norm), SPECIAL,     \
    LATENT, -NO, NO, 0, NULL, NULL)                                                                \
  X(MOE_ROUTER_ACTIVATION_FUNC, TEXT, "moe_router_activation_func", STR, NOF, CONST, MOE, -NO, NO, \
    0, "sigmoid", NULL)                                                                            \
  X(MOE_RENORMALIZE, TEXT, "moe_renormalize", BOOL, FLD(moe_renormalize), 0, MOE, -NO, NO, 1, NULL,\
    NULL)                                                                                          \
  X(ROUTED_SCALING_FACTOR, TEXT, "routed_scaling_factor", FLOAT, FLD(routed_scaling_factor),       \
    LO_OPEN, MOE, 0, NO, 1, NULL, NULL)                                                            \
  /* the router k3 runs: sigmoid scores + correction bias, grouped top-k (spec §4.3) */            \
  X(TOPK_METHOD, TEXT, "topk_method", STR, NOF, CONST, MOE, -NO, NO, 0, "noaux_tc", NULL)           \
  /* SPECIAL: false is fine with one group (checked after num_expert_group is read) */            \
  X(USE_GROUPED_TOPK, TEXT, "use_grouped_topk", BOOL, NOF, SPECIAL, MOE, -NO, NO, 1, NULL,         \
    "k3 always groups; give 1 group")                                                              \
  /* divides num_experts (a rule) */                                                               \
  X(NUM_EXPERT_GROUP, TEXT, "num_expert_group", INT, FLD(n_group), 0, MOE, 1, K3_CFG_MAX_EXPERTS,  \
    1, NULL, NULL)                                                                                 \
  /* <= num_expert_group (a rule) */                                                               \
  X(TOPK_GROUP, TEXT, "topk_group", INT, FLD(topk_group), 0, MOE, 1, K3_CFG_MAX_EXPERTS, 1, NULL,  \
    NULL)                                                                                          \
  X(RMS_NORM_EPS, TEXT, "rms_norm_eps", FLOAT, FLD(rms_norm_eps), REQ | LO_OPEN | HI_OPEN, ALL, 0, \
    1, 0, NULL, NULL)                                                                              \
  /* NoPE: no position table reads it, but it is the trained context (the engine's bound on      \
   * --max-ctx); absent = not given (0) */                                                         \
  X(MAX_POSITION_EMBEDDINGS, TEXT, "max_position_embeddings", I64, FLD(max_position_embeddings),   \
    OMIT0, ALL, 1, (double)K3_CFG_MAX_POSITIONS, 0, NULL, NULL)                                    \
  /* multi-token-prediction layers are not run; their count must still be a count (written 0) */  \
  X(NUM_NEXTN_PREDICT_LAYERS, TEXT, "num_nextn_predict_layers", I64, NOF, 0, ALL, 0,               \
    K3_CFG_MAX_INT, 0, NULL, NULL)                                                                 \
  /* also written at the top level of the K3 layout (read from text_config) */                    \
  X(TIE_WORD_EMBEDDINGS, TEXT, "tie_word_embeddings", BOOL, FLD(tie_word_embeddings), 0, ALL, -NO, \
    NO, 0, NULL, NULL)                                                                             \
  /* SPECIAL: text_config's, else the top level's; < vocab_size */                                 \
  X(EOS_TOKEN_ID, TEXT, "eos_token_id", INT, FLD(eos_token_id), REQ | SPECIAL, ALL, 0,             \
    K3_CFG_MAX_VOCAB - 1, 0, NULL, NULL)                                                           \
  /* SPECIAL: at the top (or in text_config); presence = MXFP4 routed experts. The writer adds   \
   * keys HF tools expect that k3 does not read (k3_config_to_json). */                            \
  X(QUANTIZATION_CONFIG, TOP, "quantization_config", OBJ, FLD(experts_mxfp4), SPECIAL, ALL, -NO,   \
    NO, 0, NULL, NULL)                                                                             \
  X(QUANT_METHOD, QNT, "quant_method", STR, NOF, REQ | CONST, ALL, -NO, NO, 0,                     \
    "compressed-tensors", NULL)                                                                    \
  X(QUANT_FORMAT, QNT, "format", STR, NOF, REQ | CONST, ALL, -NO, NO, 0, "mxfp4-pack-quantized",   \
    NULL)                                                                                          \
  /* SPECIAL: a map of groups with any names */                                                   \
  X(CONFIG_GROUPS, QNT, "config_groups", OBJ, NOF, SPECIAL, ALL, -NO, NO, 0, NULL, NULL)            \
  X(QUANT_WEIGHTS, QGRP, "weights", OBJ, NOF, SPECIAL, ALL, -NO, NO, 0, NULL, NULL)                 \
  X(NUM_BITS, QW, "num_bits", I64, NOF, CONST, ALL, -NO, NO, 4, NULL, "MXFP4")                      \
  X(QUANT_TYPE, QW, "type", STR, NOF, CONST, ALL, -NO, NO, 0, "float", "MXFP4")                     \
  X(GROUP_SIZE, QW, "group_size", I64, NOF, CONST, ALL, -NO, NO, 32, NULL, "MXFP4")
/* clang-format on */

#define CK_ID(id, ...) CK_##id,
enum { CK_ROWS(CK_ID) CK_N };
#undef CK_ID
#define CK_ROW(id, obj, key, type, field, flags, when, lo, hi, def, str, why)                      \
    {key, obj, K3_CK_##type, K3_CW_##when, flags, field, lo, hi, def, str, why},
static const k3_config_key keys[CK_N] = {CK_ROWS(CK_ROW)};
#undef CK_ROW

const k3_config_key *k3_config_keys(int *n_rows) {
    if (n_rows) *n_rows = CK_N;
    return keys;
}

/* The one spelling of a key, for messages and dedicated code. */
#define K(id) (keys[CK_##id].key)

static const struct {
    const char *name;
    k3_act act;
} act_names[] = {{"situ", K3_ACT_SITU}, {"silu", K3_ACT_SWIGLU}};

/* The message prefix of the keys in object `obj`: "text_config.linear_attn_config." etc. */
static void obj_ctx(bool nested, int obj, char *out, size_t n) {
    const char *t = nested ? K(TEXT_CONFIG) : NULL;
    switch (obj) {
    case K3_CO_TEXT:
        snprintf(out, n, "%s%s", t ? t : "", t ? "." : "");
        break;
    case K3_CO_LINEAR:
        snprintf(out, n, "%s%s%s.", t ? t : "", t ? "." : "", K(LINEAR_ATTN_CONFIG));
        break;
    case K3_CO_QUANT:
        snprintf(out, n, "%s.", K(QUANTIZATION_CONFIG));
        break;
    case K3_CO_QGROUP:
        snprintf(out, n, "%s.%s.*.", K(QUANTIZATION_CONFIG), K(CONFIG_GROUPS));
        break;
    case K3_CO_QWEIGHTS:
        snprintf(out, n, "%s.%s.*.%s.", K(QUANTIZATION_CONFIG), K(CONFIG_GROUPS), K(QUANT_WEIGHTS));
        break;
    default:
        out[0] = 0;
    }
}

/* "path: ctx key: <message>" */
static k3_status key_err(const char *path, const char *ctx, const k3_config_key *r, const char *fmt,
                         ...) {
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return K3_ERR(K3_ERR_CONFIG, "%s: %s%s: %s", path, ctx, r->key, msg);
}

static bool is_int(const k3_config_key *r) {
    return r->type == K3_CK_INT || r->type == K3_CK_I64;
}

/* " (why)" or "" */
static const char *why_of(const k3_config_key *r, char *buf, size_t n) {
    if (!r->why) return "";
    snprintf(buf, n, " (%s)", r->why);
    return buf;
}

/* The row's bounds on a value (parsed or a field's): one message for the parser and
 * k3_config_validate. */
static k3_status check_bounds(const char *path, const char *ctx, const k3_config_key *r, double v) {
    char w[128];
    if (is_int(r)) {
        if (v < r->lo)
            return key_err(path, ctx, r, "%lld must be >= %lld", (long long)v, (long long)r->lo);
        if (v > r->hi)
            return key_err(path, ctx, r, "%lld exceeds k3's limit of %lld%s", (long long)v,
                           (long long)r->hi, why_of(r, w, sizeof w));
        return K3_OK;
    }
    if (r->type != K3_CK_FLOAT) return K3_OK;
    bool lo_ok = (r->flags & K3_CK_LO_OPEN) ? v > r->lo : v >= r->lo;
    bool hi_ok = (r->flags & K3_CK_HI_OPEN) ? v < r->hi : v <= r->hi;
    if (lo_ok && hi_ok) return K3_OK;
    if (isfinite(r->lo) && isfinite(r->hi))
        return key_err(path, ctx, r, "%g must be in %c%g, %g%c", v,
                       (r->flags & K3_CK_LO_OPEN) ? '(' : '[', r->lo, r->hi,
                       (r->flags & K3_CK_HI_OPEN) ? ')' : ']');
    if (!lo_ok)
        return key_err(path, ctx, r, "%g must be %s %g", v,
                       (r->flags & K3_CK_LO_OPEN) ? ">" : ">=", r->lo);
    return key_err(path, ctx, r, "%g must be %s %g", v,
                   (r->flags & K3_CK_HI_OPEN) ? "<" : "<=", r->hi);
}

/* A float row's value must be finite as a float too (a finite double like 1e300 becomes inf). */
static k3_status check_float(const char *path, const char *ctx, const k3_config_key *r, double v) {
    if (r->type == K3_CK_FLOAT && !isfinite((float)v))
        return key_err(path, ctx, r, "%g is not finite as a float", v);
    return K3_OK;
}

static double field_num(const k3_config *c, const k3_config_key *r) {
    const char *p = (const char *)c + r->off;
    switch (r->type) {
    case K3_CK_INT:
        return *(const int *)p;
    case K3_CK_I64:
        return (double)*(const int64_t *)p;
    case K3_CK_FLOAT:
        return *(const float *)p;
    case K3_CK_BOOL:
        return *(const bool *)p;
    default:
        return 0;
    }
}

static void set_field(k3_config *c, const k3_config_key *r, double v) {
    if (r->off < 0) return;
    char *p = (char *)c + r->off;
    switch (r->type) {
    case K3_CK_INT:
        *(int *)p = (int)v;
        break;
    case K3_CK_I64:
        *(int64_t *)p = (int64_t)v;
        break;
    case K3_CK_FLOAT:
        *(float *)p = (float)v;
        break;
    case K3_CK_BOOL:
        *(bool *)p = v != 0;
        break;
    default:
        break;
    }
}

/* ---- the parser ----------------------------------------------------------------------------- */
typedef struct {
    const char *path;
    bool nested;                                    /* the K3 layout (text_config) */
    const cJSON *obj[K3_CO_QWEIGHTS + 1];           /* the objects the rows live in, as found */
    char ctx[K3_CO_QWEIGHTS + 1][96];               /* their message prefixes */
    int8_t full[K3_MAX_LAYERS], kda[K3_MAX_LAYERS]; /* the layer lists, 0-based marks */
    bool have_full, grouped;
} pstate;

static const cJSON *item(const cJSON *o, const k3_config_key *r) {
    const cJSON *v = o ? cJSON_GetObjectItemCaseSensitive(o, r->key) : NULL;
    return v && !cJSON_IsNull(v) ? v : NULL;
}

/* A numeric row's value from `o` (ctx: its prefix): *present = false and the default when it is
 * absent or null. Type, bounds and the one supported value (CONST) are checked. */
static k3_status read_num(const pstate *p, const char *ctx, const k3_config_key *r, const cJSON *o,
                          double *out, bool *present) {
    const cJSON *v = item(o, r);
    *present = v != NULL;
    *out = r->def;
    if (!v) return (r->flags & K3_CK_REQ) ? key_err(p->path, ctx, r, "missing") : K3_OK;
    if (!cJSON_IsNumber(v)) return key_err(p->path, ctx, r, "expected a number");
    double d = v->valuedouble;
    if (!isfinite(d)) return key_err(p->path, ctx, r, "not finite");
    if (is_int(r) && (d != floor(d) || fabs(d) > 9.0e15))
        return key_err(p->path, ctx, r, "expected an integer, got %g", d);
    char w[128];
    if ((r->flags & K3_CK_CONST) && d != r->def)
        return key_err(p->path, ctx, r, "%g is not supported (only %g%s)", d, r->def,
                       why_of(r, w, sizeof w));
    K3_TRY(check_bounds(p->path, ctx, r, d));
    K3_TRY(check_float(p->path, ctx, r, d));
    *out = d;
    return K3_OK;
}

static k3_status read_bool(const pstate *p, const char *ctx, const k3_config_key *r, const cJSON *o,
                           bool def, bool *out) {
    const cJSON *v = item(o, r);
    *out = def;
    if (!v) return (r->flags & K3_CK_REQ) ? key_err(p->path, ctx, r, "missing") : K3_OK;
    if (!cJSON_IsBool(v)) return key_err(p->path, ctx, r, "expected true or false");
    *out = cJSON_IsTrue(v);
    char w[128];
    if ((r->flags & K3_CK_CONST) && *out != (r->def != 0))
        return key_err(p->path, ctx, r, "%s is not supported%s", *out ? "true" : "false",
                       why_of(r, w, sizeof w));
    return K3_OK;
}

/* NULL when absent (missing when required); an error when present but not a string, or not
 * the one supported value (CONST). */
static k3_status read_str(const pstate *p, const char *ctx, const k3_config_key *r, const cJSON *o,
                          const char **out) {
    const cJSON *v = item(o, r);
    *out = NULL;
    if (!v) return (r->flags & K3_CK_REQ) ? key_err(p->path, ctx, r, "missing") : K3_OK;
    if (!cJSON_IsString(v)) return key_err(p->path, ctx, r, "expected a string");
    if ((r->flags & K3_CK_CONST) && strcmp(v->valuestring, r->str) != 0)
        return key_err(p->path, ctx, r, "'%s' is not supported (only %s%s%s)", v->valuestring,
                       r->str, r->why ? "; " : "", r->why ? r->why : "");
    *out = v->valuestring;
    return K3_OK;
}

/* A plain row: read, check, store. */
static k3_status read_row(const pstate *p, const k3_config_key *r, const cJSON *o, k3_config *c) {
    const char *ctx = p->ctx[r->obj];
    if (r->type == K3_CK_BOOL) {
        bool b;
        K3_TRY(read_bool(p, ctx, r, o, r->def != 0, &b));
        set_field(c, r, b);
        return K3_OK;
    }
    if (r->type == K3_CK_STR) {
        const char *s;
        return read_str(p, ctx, r, o, &s);
    }
    double d;
    bool present;
    K3_TRY(read_num(p, ctx, r, o, &d, &present));
    set_field(c, r, d);
    return K3_OK;
}

/* A 1-based layer list -> marks[] (0-based). */
static k3_status read_layer_list(const pstate *p, const k3_config_key *r, int n_layers,
                                 int8_t *marks, bool *present) {
    const char *ctx = p->ctx[r->obj];
    const cJSON *v = item(p->obj[r->obj], r);
    *present = v != NULL;
    if (!v) return K3_OK;
    if (!cJSON_IsArray(v))
        return key_err(p->path, ctx, r, "expected a list of 1-based layer numbers");
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble))
            return K3_ERR(K3_ERR_CONFIG, "%s: %s%s[%d]: expected an integer", p->path, ctx, r->key,
                          i);
        double d = e->valuedouble;
        if (d < 1 || d > n_layers)
            return K3_ERR(K3_ERR_CONFIG,
                          "%s: %s%s[%d]: layer %g is outside 1..%d (the lists are 1-based)",
                          p->path, ctx, r->key, i, d, n_layers);
        if (marks[(int)d - 1])
            return K3_ERR(K3_ERR_CONFIG, "%s: %s%s[%d]: layer %g listed twice", p->path, ctx,
                          r->key, i, d);
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

/* The rows of one quantization object (QUANT or QWEIGHTS), in table order. */
static k3_status read_quant_rows(pstate *p, int obj, const cJSON *o, k3_config *c) {
    p->obj[obj] = o;
    for (int i = 0; i < CK_N; i++) {
        const k3_config_key *r = &keys[i];
        if (r->obj != obj) continue;
        if (i == CK_CONFIG_GROUPS) {
            const cJSON *groups = item(o, r), *g;
            if (!groups) continue;
            cJSON_ArrayForEach(g, groups) {
                const cJSON *w = cJSON_IsObject(g) ? item(g, &keys[CK_QUANT_WEIGHTS]) : NULL;
                if (w) K3_TRY(read_quant_rows(p, K3_CO_QWEIGHTS, w, c));
            }
            continue;
        }
        K3_TRY(read_row(p, r, o, c));
    }
    return K3_OK;
}

/* The SPECIAL rows of text_config and the top level (see the table's comments for why). */
static k3_status read_special(pstate *p, int id, k3_config *c) {
    const k3_config_key *r = &keys[id];
    const char *ctx = p->ctx[r->obj];
    const cJSON *o = p->obj[r->obj];
    double d;
    bool present;
    switch (id) {
    case CK_TEXT_CONFIG: /* read before the walk */
        return K3_OK;
    case CK_NUM_KEY_VALUE_HEADS:
        K3_TRY(read_num(p, ctx, r, o, &d, &present));
        if (present && d != c->n_heads)
            return key_err(p->path, ctx, r, "%d != %s %d (%s)", (int)d, K(NUM_ATTENTION_HEADS),
                           c->n_heads, r->why);
        return K3_OK;
    case CK_FULL_ATTN_LAYERS:
        K3_TRY(read_layer_list(p, r, c->n_layers, p->full, &p->have_full));
        return p->have_full ? K3_OK : key_err(p->path, ctx, r, "missing");
    case CK_KDA_LAYERS: {
        bool have_kda;
        K3_TRY(read_layer_list(p, r, c->n_layers, p->kda, &have_kda));
        for (int l = 0; l < c->n_layers; l++) {
            if (have_kda && p->full[l] && p->kda[l])
                return key_err(p->path, ctx, r, "layer %d is also in %s", l + 1,
                               K(FULL_ATTN_LAYERS));
            if (have_kda && !p->full[l] && !p->kda[l])
                return key_err(p->path, ctx, r, "layer %d is in neither %s nor %s", l + 1, r->key,
                               K(FULL_ATTN_LAYERS));
            c->mixer[l] = p->full[l] ? K3_MIXER_MLA : K3_MIXER_KDA;
        }
        return K3_OK;
    }
    case CK_GATE_LOWER_BOUND:
        c->kda_has_lower_bound = item(o, r) != NULL;
        return c->kda_has_lower_bound ? read_row(p, r, o, c) : K3_OK;
    case CK_HIDDEN_ACT: {
        const char *act;
        K3_TRY(read_str(p, ctx, r, o, &act));
        for (size_t i = 0; i < K3_ARRAY_LEN(act_names); i++)
            if (strcmp(act, act_names[i].name) == 0) {
                c->act = act_names[i].act;
                return K3_OK;
            }
        return key_err(p->path, ctx, r, "'%s' is not supported (situ or silu)", act);
    }
    case CK_LATENT_MOE_USE_NORM:
        if (c->n_experts <= 0) return K3_OK;
        return read_bool(p, ctx, r, o, c->latent_size > 0, &c->latent_moe_use_norm);
    case CK_USE_GROUPED_TOPK:
        return read_bool(p, ctx, r, o, true, &p->grouped);
    case CK_EOS_TOKEN_ID:
        if (!item(o, r)) { /* the top level's */
            ctx = "";
            o = p->obj[K3_CO_TOP];
        }
        K3_TRY(read_num(p, ctx, r, o, &d, &present));
        if (d >= c->vocab_size)
            return key_err(p->path, p->ctx[r->obj], r, "%lld is not a token id (%s %lld)",
                           (long long)d, K(VOCAB_SIZE), (long long)c->vocab_size);
        set_field(c, r, d);
        return K3_OK;
    case CK_QUANTIZATION_CONFIG: {
        const cJSON *q = cJSON_GetObjectItemCaseSensitive(o, r->key);
        if (!q) q = cJSON_GetObjectItemCaseSensitive(p->obj[K3_CO_TEXT], r->key);
        if (!q || cJSON_IsNull(q)) return K3_OK;
        if (!cJSON_IsObject(q)) return key_err(p->path, "", r, "expected an object");
        K3_TRY(read_quant_rows(p, K3_CO_QUANT, q, c));
        c->experts_mxfp4 = true;
        return K3_OK;
    }
    default:
        return K3_ERR(K3_ERR_INTERNAL, "config key %s: no reader", r->key);
    }
}

static k3_status parse_obj(const cJSON *top, const char *path, k3_config *c) {
    if (!cJSON_IsObject(top))
        return K3_ERR(K3_ERR_CONFIG, "%s: expected a JSON object at the top level", path);
    memset(c, 0, sizeof *c);
    pstate st = {.path = path, .grouped = true}, *p = &st;
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(top, K(TEXT_CONFIG));
    if (tc && !cJSON_IsObject(tc))
        return key_err(path, "", &keys[CK_TEXT_CONFIG], "expected an object");
    p->nested = tc != NULL;
    if (tc) snprintf(c->tensor_prefix, sizeof c->tensor_prefix, "language_model.");
    p->obj[K3_CO_TOP] = top;
    p->obj[K3_CO_TEXT] = tc ? tc : top;
    for (int o = 0; o <= K3_CO_QWEIGHTS; o++) obj_ctx(p->nested, o, p->ctx[o], sizeof p->ctx[o]);
    c->mla_norm_eps = 1e-6f; /* HF q_a/kv_a layernorm eps (spec §3, §11.1); not a config key */

    k3_status s = K3_OK;
    for (int i = 0; i < CK_N && s == K3_OK; i++) {
        const k3_config_key *r = &keys[i];
        if (r->flags & K3_CK_NOREAD) continue;
        if (r->obj >= K3_CO_QUANT) continue; /* read under quantization_config */
        if (r->when == K3_CW_MOE && c->n_experts <= 0) continue;
        if (r->when == K3_CW_SITU && c->act != K3_ACT_SITU) continue;
        if (r->flags & K3_CK_SPECIAL) {
            s = read_special(p, i, c);
        } else if (r->type == K3_CK_OBJ) { /* linear_attn_config */
            const cJSON *v = item(p->obj[r->obj], r);
            if (!v)
                s = key_err(path, p->ctx[r->obj], r, "missing");
            else if (!cJSON_IsObject(v))
                s = key_err(path, p->ctx[r->obj], r, "expected an object");
            p->obj[K3_CO_LINEAR] = v;
        } else {
            s = read_row(p, r, p->obj[r->obj], c);
        }
    }
    if (s == K3_OK && c->n_experts > 0 && !p->grouped && c->n_group != 1)
        s = key_err(path, p->ctx[K3_CO_TEXT], &keys[CK_USE_GROUPED_TOPK], "false with %s %d (%s)",
                    K(NUM_EXPERT_GROUP), c->n_group, keys[CK_USE_GROUPED_TOPK].why);
    c->kda_gate_rank = c->kda_head_dim; /* f_a/f_b (and g_a/g_b) rank = head_dim in K3 and KL */
    c->kda_a_log_len = next_pow2(c->kda_n_heads);
    K3_TRY(s);
    return k3_config_validate(c, path);
}

/* ---- validation ----------------------------------------------------------------------------- */
static bool row_applies(const k3_config *c, const k3_config_key *r) {
    switch (r->when) {
    case K3_CW_MOE:
        return c->n_experts > 0;
    case K3_CW_SITU:
        return c->act == K3_ACT_SITU;
    case K3_CW_LB:
        return c->kda_has_lower_bound;
    case K3_CW_LATENT:
        return c->latent_size > 0;
    default:
        return true;
    }
}

k3_status k3_config_validate(const k3_config *c, const char *path) {
    bool nested = c->tensor_prefix[0] != 0;
    char ctx[K3_CO_QWEIGHTS + 1][96];
    for (int o = 0; o <= K3_CO_QWEIGHTS; o++) obj_ctx(nested, o, ctx[o], sizeof ctx[o]);
    /* every field against its row's bounds */
    for (int i = 0; i < CK_N; i++) {
        const k3_config_key *r = &keys[i];
        if (r->off < 0 || !(is_int(r) || r->type == K3_CK_FLOAT) || !row_applies(c, r)) continue;
        double v = field_num(c, r);
        if ((r->flags & K3_CK_OMIT0) && v == 0) continue;
        K3_TRY(check_bounds(path, ctx[r->obj], r, v));
        K3_TRY(check_float(path, ctx[r->obj], r, v));
    }

    /* the rules that tie keys together, and the derived values */
    const char *x = ctx[K3_CO_TEXT], *xl = ctx[K3_CO_LINEAR];
#define BAD(...) return K3_ERR(K3_ERR_CONFIG, __VA_ARGS__)
    if ((int64_t)c->n_shared_experts * c->moe_intermediate_size > K3_CFG_MAX_DIM)
        BAD("%s: %s%s x %s: %lld exceeds k3's limit of %d", path, x, K(NUM_SHARED_EXPERTS),
            K(MOE_INTERMEDIATE_SIZE), (long long)c->n_shared_experts * c->moe_intermediate_size,
            K3_CFG_MAX_DIM);
    if (c->kda_gate_rank < 1 || c->kda_gate_rank > K3_CFG_MAX_DIM)
        BAD("%s: %s%s: gate rank %d is outside 1..%d", path, xl, K(KDA_HEAD_DIM), c->kda_gate_rank,
            K3_CFG_MAX_DIM);
    if (c->kda_a_log_len > K3_CFG_MAX_DIM)
        BAD("%s: %s A_log length: %d exceeds k3's limit of %d", path, xl, c->kda_a_log_len,
            K3_CFG_MAX_DIM);
    if (c->kda_a_log_len < c->kda_n_heads)
        BAD("%s: A_log length %d < %s%s %d", path, c->kda_a_log_len, xl, K(KDA_NUM_HEADS),
            c->kda_n_heads);
    if (c->eos_token_id >= c->vocab_size)
        BAD("%s: %s%s: %d is not a token id (%s %lld)", path, x, K(EOS_TOKEN_ID), c->eos_token_id,
            K(VOCAB_SIZE), (long long)c->vocab_size);
    if (c->act != K3_ACT_SITU && c->act != K3_ACT_SWIGLU)
        BAD("%s: %s%s: invalid", path, x, K(HIDDEN_ACT));
    bool any_moe = false, any_dense = false;
    for (int l = 0; l < c->n_layers; l++) {
        if (c->mixer[l] != K3_MIXER_MLA && c->mixer[l] != K3_MIXER_KDA)
            BAD("%s: layer %d: invalid mixer", path, l);
        if (k3_config_is_moe(c, l))
            any_moe = true;
        else
            any_dense = true;
    }
    if (c->first_k_dense_replace > c->n_layers)
        BAD("%s: %s%s: %d is outside 0..%s (%d)", path, x, K(FIRST_K_DENSE_REPLACE),
            c->first_k_dense_replace, K(NUM_HIDDEN_LAYERS), c->n_layers);
    if (any_dense && c->intermediate_size < 1)
        BAD("%s: %s%s: %lld must be >= 1 (there are dense layers)", path, x, K(INTERMEDIATE_SIZE),
            (long long)c->intermediate_size);
    if (any_moe) {
        int64_t n_moe = 0;
        for (int l = 0; l < c->n_layers; l++) n_moe += k3_config_is_moe(c, l);
        if (n_moe * c->n_experts > K3_CFG_MAX_EXPERT_INSTANCES)
            BAD("%s: %s%s: %d experts x %lld MoE layers = %lld exceeds k3's limit of %d "
                "expert instances",
                path, x, K(NUM_EXPERTS), c->n_experts, (long long)n_moe,
                (long long)(n_moe * c->n_experts), K3_CFG_MAX_EXPERT_INSTANCES);
        int64_t lat = c->latent_size > 0 ? c->latent_size : c->hidden_size;
        if (c->n_experts_per_tok > c->n_experts)
            BAD("%s: %s%s: %d is outside 1..%s (%d)", path, x, K(NUM_EXPERTS_PER_TOKEN),
                c->n_experts_per_tok, K(NUM_EXPERTS), c->n_experts);
        if (c->n_experts % c->n_group != 0)
            BAD("%s: %s%s: %d does not divide %s %d", path, x, K(NUM_EXPERT_GROUP), c->n_group,
                K(NUM_EXPERTS), c->n_experts);
        if (c->topk_group > c->n_group)
            BAD("%s: %s%s: %d is outside 1..%s (%d)", path, x, K(TOPK_GROUP), c->topk_group,
                K(NUM_EXPERT_GROUP), c->n_group);
        if ((int64_t)c->n_experts_per_tok > (int64_t)c->topk_group * (c->n_experts / c->n_group))
            BAD("%s: %s%s: %d > %s x experts per group (%d x %d)", path, x,
                K(NUM_EXPERTS_PER_TOKEN), c->n_experts_per_tok, K(TOPK_GROUP), c->topk_group,
                c->n_experts / c->n_group);
        if (c->experts_mxfp4 && (lat % 32 != 0 || c->moe_intermediate_size % 32 != 0))
            BAD("%s: %s%s/%s: %lld/%d must be multiples of 32 for MXFP4 experts", path, x,
                K(ROUTED_EXPERT_HIDDEN_SIZE), K(MOE_INTERMEDIATE_SIZE), (long long)lat,
                c->moe_intermediate_size);
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
    struct stat sb;
    if (stat(path, &sb) != 0 && errno == ENOENT && stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode))
        return K3_ERR(K3_ERR_MISSING, "not a K3 checkpoint: no config.json in %s", dir);
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

/* The text_config and linear_attn_config rows, in table order. A row with no field writes its
 * one value (its default); MOE rows are written whatever num_experts is. */
cJSON *k3_config_json(const k3_config *c) {
    cJSON *o[K3_CO_QWEIGHTS + 1] = {0};
    o[K3_CO_TEXT] = cJSON_CreateObject();
    if (!o[K3_CO_TEXT]) return NULL;
    for (int i = 0; i < CK_N; i++) {
        const k3_config_key *r = &keys[i];
        cJSON *dst = o[r->obj];
        if (r->obj != K3_CO_TEXT && r->obj != K3_CO_LINEAR) continue;
        if (r->when != K3_CW_MOE && !row_applies(c, r)) continue;
        double v = r->off >= 0 ? field_num(c, r) : r->def;
        if ((r->flags & K3_CK_OMIT0) && v == 0) continue;
        switch (i) { /* the SPECIAL rows the writer knows */
        case CK_NUM_KEY_VALUE_HEADS:
            cJSON_AddNumberToObject(dst, r->key, c->n_heads);
            continue;
        case CK_FULL_ATTN_LAYERS:
        case CK_KDA_LAYERS:
            cJSON_AddItemToObject(
                dst, r->key, layer_list(c, i == CK_FULL_ATTN_LAYERS ? K3_MIXER_MLA : K3_MIXER_KDA));
            continue;
        case CK_HIDDEN_ACT:
            for (size_t a = 0; a < K3_ARRAY_LEN(act_names); a++)
                if (act_names[a].act == c->act)
                    cJSON_AddStringToObject(dst, r->key, act_names[a].name);
            continue;
        default:
            break;
        }
        switch (r->type) {
        case K3_CK_OBJ:
            o[K3_CO_LINEAR] = cJSON_AddObjectToObject(dst, r->key);
            break;
        case K3_CK_STR:
            cJSON_AddStringToObject(dst, r->key, r->str);
            break;
        case K3_CK_BOOL:
            cJSON_AddBoolToObject(dst, r->key, v != 0);
            break;
        case K3_CK_FLOAT:
            cJSON_AddNumberToObject(dst, r->key, fd((float)v));
            break;
        default:
            if ((r->flags & K3_CK_NULL0) && v == 0)
                cJSON_AddNullToObject(dst, r->key);
            else
                cJSON_AddNumberToObject(dst, r->key, v);
            break;
        }
    }
    return o[K3_CO_TEXT];
}

/* The quantization_config block. The keys k3 reads come from the table; the rest are written
 * for HF tools (compressed-tensors) and never read: quantization_status, targets, strategy,
 * symmetric, dynamic, scale_dtype, the activations, the group's format and ignore. */
static cJSON *quant_json(void) {
    cJSON *q = cJSON_CreateObject();
    cJSON_AddStringToObject(q, K(QUANT_METHOD), keys[CK_QUANT_METHOD].str);
    cJSON_AddStringToObject(q, K(QUANT_FORMAT), keys[CK_QUANT_FORMAT].str);
    cJSON_AddStringToObject(q, "quantization_status", "compressed");
    cJSON *g0 = cJSON_AddObjectToObject(cJSON_AddObjectToObject(q, K(CONFIG_GROUPS)), "group_0");
    cJSON *tg = cJSON_AddArrayToObject(g0, "targets");
    cJSON_AddItemToArray(tg, cJSON_CreateString("Linear"));
    cJSON *w = cJSON_AddObjectToObject(g0, K(QUANT_WEIGHTS));
    cJSON_AddNumberToObject(w, K(NUM_BITS), keys[CK_NUM_BITS].def);
    cJSON_AddStringToObject(w, K(QUANT_TYPE), keys[CK_QUANT_TYPE].str);
    cJSON_AddStringToObject(w, "strategy", "group");
    cJSON_AddNumberToObject(w, K(GROUP_SIZE), keys[CK_GROUP_SIZE].def);
    cJSON_AddBoolToObject(w, "symmetric", true);
    cJSON_AddBoolToObject(w, "dynamic", false);
    cJSON_AddStringToObject(w, "scale_dtype", "torch.uint8");
    cJSON_AddNullToObject(g0, "input_activations");
    cJSON_AddNullToObject(g0, "output_activations");
    cJSON_AddStringToObject(g0, "format", keys[CK_QUANT_FORMAT].str);
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
    return q;
}

k3_status k3_config_to_json(const k3_config *c, char **out_json) {
    cJSON *tc = k3_config_json(c);
    if (!tc) return K3_ERR(K3_ERR_NOMEM, "config.json: out of memory");
    cJSON *q = c->experts_mxfp4 ? quant_json() : NULL;

    /* the layout around text_config (architectures, the top model_type) is not read */
    cJSON *root;
    if (c->tensor_prefix[0]) {
        root = cJSON_CreateObject();
        cJSON *ar = cJSON_AddArrayToObject(root, "architectures");
        cJSON_AddItemToArray(ar, cJSON_CreateString("KimiK3ForConditionalGeneration"));
        cJSON_AddStringToObject(root, "model_type", "kimi_k3");
        cJSON_AddItemToObject(root, K(TEXT_CONFIG), tc);
        if (q) cJSON_AddItemToObject(root, K(QUANTIZATION_CONFIG), q);
        /* the K3 release repeats these two at the top */
        cJSON_AddNumberToObject(root, K(EOS_TOKEN_ID), c->eos_token_id);
        cJSON_AddBoolToObject(root, K(TIE_WORD_EMBEDDINGS), c->tie_word_embeddings);
    } else {
        root = tc;
        cJSON *ar = cJSON_AddArrayToObject(root, "architectures");
        cJSON_AddItemToArray(ar, cJSON_CreateString("KimiLinearForCausalLM"));
        if (q) cJSON_AddItemToObject(root, K(QUANTIZATION_CONFIG), q);
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
