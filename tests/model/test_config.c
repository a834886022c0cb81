/* test_config.c — config.json parsing/validation, presets, the catalogue.
 * The K3 text below is transcribed from spec/K3-MODEL.md §6.1 (the released config); the
 * expected layer lists and tensor/parameter counts are worked out by hand in the comments. */
#include <cjson/cJSON.h>

#include "k3_model.h"
#include "k3_test.h"

static const char *k3_json =
    "{\"architectures\":[\"KimiK3ForConditionalGeneration\"],\"model_type\":\"kimi_k3\","
    "\"quantization_config\":{\"quant_method\":\"compressed-tensors\",\"format\":\"mxfp4-pack-"
    "quantized\","
    " \"config_groups\":{\"group_0\":{\"weights\":{\"num_bits\":4,\"type\":\"float\",\"strategy\":"
    "\"group\","
    "  \"group_size\":32,\"symmetric\":true,\"dynamic\":false,\"scale_dtype\":\"torch.uint8\"}}},"
    " \"ignore\":[\"re:.*shared_experts.*\"]},"
    "\"text_config\":{\"model_type\":\"kimi_linear\",\"vocab_size\":163840,\"hidden_size\":7168,"
    " \"intermediate_size\":33792,\"num_hidden_layers\":93,\"num_attention_heads\":96,"
    " \"num_key_value_heads\":96,\"q_lora_rank\":1536,\"kv_lora_rank\":512,\"qk_nope_head_dim\":"
    "128,"
    " \"qk_rope_head_dim\":64,\"v_head_dim\":128,\"mla_use_nope\":true,\"mla_use_output_gate\":"
    "true,"
    " \"linear_attn_config\":{\"full_attn_layers\":[4,8,12,16,20,24,28,32,36,40,44,48,52,56,60,64,"
    "68,"
    "   "
    "72,76,80,84,88,92,93],\"kda_layers\":[1,2,3,5,6,7,9,10,11,13,14,15,17,18,19,21,22,23,25,26,27,"
    "   "
    "29,30,31,33,34,35,37,38,39,41,42,43,45,46,47,49,50,51,53,54,55,57,58,59,61,62,63,65,66,67,69,"
    "70,"
    "   71,73,74,75,77,78,79,81,82,83,85,86,87,89,90,91],\"num_heads\":96,\"head_dim\":128,"
    "   \"short_conv_kernel_size\":4,\"gate_lower_bound\":-5.0,\"use_full_rank_gate\":true},"
    " \"hidden_act\":\"situ\",\"activation_situ_beta\":4.0,\"activation_situ_linear_beta\":25.0,"
    " \"attn_res_block_size\":12,\"first_k_dense_replace\":1,\"moe_layer_freq\":1,\"num_experts\":"
    "896,"
    " \"num_experts_per_token\":16,\"num_shared_experts\":2,\"moe_intermediate_size\":3072,"
    " \"routed_expert_hidden_size\":3584,\"latent_moe_use_norm\":true,"
    " \"moe_router_activation_func\":\"sigmoid\",\"moe_renormalize\":true,\"routed_scaling_"
    "factor\":1.0,"
    " \"topk_method\":\"noaux_tc\",\"use_grouped_topk\":true,\"num_expert_group\":1,\"topk_group\":"
    "1,"
    " \"rms_norm_eps\":1e-5,\"max_position_embeddings\":1048576,\"num_nextn_predict_layers\":0,"
    " \"tie_word_embeddings\":false,\"eos_token_id\":163586}}";

/* A flat Kimi-Linear-style config (no text_config, softplus gate, SwiGLU, no AttnRes, no q LoRA,
 * low-rank output gate, experts on D in BF16). */
static const char *kl_json =
    "{\"architectures\":[\"KimiLinearForCausalLM\"],\"model_type\":\"kimi_linear\",\"vocab_size\":"
    "1000,"
    "\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":4,\"num_attention_heads\":"
    "2,"
    "\"num_key_value_heads\":2,\"q_lora_rank\":null,\"kv_lora_rank\":16,\"qk_nope_head_dim\":8,"
    "\"qk_rope_head_dim\":4,\"v_head_dim\":8,\"mla_use_nope\":true,"
    "\"linear_attn_config\":{\"full_attn_layers\":[4],\"kda_layers\":[1,2,3],\"num_heads\":2,"
    " \"head_dim\":16,\"short_conv_kernel_size\":4},\"hidden_act\":\"silu\",\"first_k_dense_"
    "replace\":1,"
    "\"moe_layer_freq\":1,\"num_experts\":8,\"num_experts_per_token\":2,\"num_shared_experts\":1,"
    "\"moe_intermediate_size\":32,\"moe_renormalize\":true,\"routed_scaling_factor\":2.5,"
    "\"num_expert_group\":1,\"topk_group\":1,\"rms_norm_eps\":1e-5,\"tie_word_embeddings\":false,"
    "\"eos_token_id\":999}";

typedef void (*mutate_fn)(cJSON *tc, cJSON *top);
static cJSON *tc_of(cJSON *top) {
    return cJSON_GetObjectItem(top, "text_config");
}

static k3_status parse_mutated(void (*m)(cJSON *tc, cJSON *top), k3_config *c) {
    cJSON *top = cJSON_Parse(k3_json);
    m(tc_of(top), top);
    char *s = cJSON_PrintUnformatted(top);
    cJSON_Delete(top);
    k3_status st = k3_config_parse(s, "config.json", c);
    cJSON_free(s);
    return st;
}

static cJSON *la(cJSON *tc) {
    return cJSON_GetObjectItem(tc, "linear_attn_config");
}
static void m_no_hidden(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_DeleteItemFromObject(tc, "hidden_size");
}
static void m_str_hidden(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "hidden_size", cJSON_CreateString("big"));
}
static void m_layers0(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "num_hidden_layers", cJSON_CreateNumber(0));
}
static void m_full94(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_AddItemToArray(cJSON_GetObjectItem(la(tc), "full_attn_layers"), cJSON_CreateNumber(94));
}
static void m_full0(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInArray(cJSON_GetObjectItem(la(tc), "full_attn_layers"), 0,
                             cJSON_CreateNumber(0));
}
static void m_kda_dup(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_AddItemToArray(cJSON_GetObjectItem(la(tc), "kda_layers"), cJSON_CreateNumber(4));
}
static void m_kda_gap(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_DeleteItemFromArray(cJSON_GetObjectItem(la(tc), "kda_layers"), 0);
}
static void m_topk(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "num_experts_per_token", cJSON_CreateNumber(1000));
}
static void m_act(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "hidden_act", cJSON_CreateString("gelu"));
}
static void m_qfmt(cJSON *tc, cJSON *t) {
    (void)tc;
    cJSON_ReplaceItemInObject(cJSON_GetObjectItem(t, "quantization_config"), "format",
                              cJSON_CreateString("nvfp4-pack-quantized"));
}
static void m_eps(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "rms_norm_eps", cJSON_CreateNumber(-1));
}
static void m_topkg(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "topk_group", cJSON_CreateNumber(2));
}
static void m_eos(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "eos_token_id", cJSON_CreateNumber(999999));
}
static void m_group(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "num_expert_group", cJSON_CreateNumber(5));
}
static void m_inter(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "moe_intermediate_size", cJSON_CreateNumber(3070));
}
static void m_situ(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_DeleteItemFromObject(tc, "activation_situ_beta");
}
static void m_lb(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(la(tc), "gate_lower_bound", cJSON_CreateNumber(2));
}
static void m_frac(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "kv_lora_rank", cJSON_CreateNumber(511.5));
}
static void m_nolin(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_DeleteItemFromObject(tc, "linear_attn_config");
}
static void m_bits(cJSON *tc, cJSON *t) {
    (void)tc;
    cJSON *w = cJSON_GetObjectItem(
        cJSON_GetObjectItem(
            cJSON_GetObjectItem(cJSON_GetObjectItem(t, "quantization_config"), "config_groups"),
            "group_0"),
        "weights");
    cJSON_ReplaceItemInObject(w, "num_bits", cJSON_CreateNumber(8));
}

/* Upper bounds (review: no bounds meant int64 overflow in the catalogue and minute-long
 * catalogue walks). Each names the key and the limit. */
static void m_hidden_2p50(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "hidden_size", cJSON_CreateNumber(1125899906842624.0));
}
static void m_kda_hd_1e9(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(la(tc), "head_dim", cJSON_CreateNumber(1e9));
}
static void m_experts_1e9(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "num_experts", cJSON_CreateNumber(1e9));
}
static void m_experts_32768(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "num_experts", cJSON_CreateNumber(32768));
}
static void m_experts_32000(cJSON *tc, cJSON *t) { /* 92 MoE layers x 32000 > 2^18 instances */
    (void)t;
    cJSON_ReplaceItemInObject(tc, "num_experts", cJSON_CreateNumber(32000));
}
static void m_vocab_2p31(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "vocab_size", cJSON_CreateNumber(2147483648.0));
}
static void m_inter_big(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "intermediate_size", cJSON_CreateNumber(1048577));
}
static void m_qlora_big(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "q_lora_rank", cJSON_CreateNumber(1048577));
}

static void bound_cases(void) {
    struct {
        mutate_fn m;
        const char *needle;
    } big[] = {
        {m_hidden_2p50, "text_config.hidden_size: 1125899906842624 exceeds k3's limit of 1048576"},
        {m_kda_hd_1e9,
         "text_config.linear_attn_config.head_dim: 1000000000 exceeds k3's limit of 1048576"},
        {m_experts_1e9, "text_config.num_experts: 1000000000 exceeds k3's limit of 32767"},
        {m_experts_32768, "num_experts: 32768 exceeds k3's limit of 32767"},
        {m_experts_32000, "exceeds k3's limit of 262144 expert instances"},
        {m_vocab_2p31, "text_config.vocab_size: 2147483648 exceeds k3's limit of 2147483647"},
        {m_inter_big, "text_config.intermediate_size: 1048577 exceeds k3's limit"},
        {m_qlora_big, "text_config.q_lora_rank: 1048577 exceeds k3's limit"},
    };
    k3_config c;
    for (size_t i = 0; i < K3_ARRAY_LEN(big); i++)
        K3_CHECK_ERR(parse_mutated(big[i].m, &c), K3_ERR_CONFIG, big[i].needle);

    /* At the limits every single tensor still fits int64, but the totals do not: the count
     * must say so instead of wrapping (signed overflow is UB; UBSan would flag it too). */
    k3_preset_config(K3_PRESET_TINY, &c);
    c.hidden_size = 1 << 20;
    c.kda_n_heads = 1 << 20;
    c.kda_head_dim = c.kda_gate_rank = 1 << 20;
    c.kda_a_log_len = 1 << 20;
    K3_CHECK_OK(k3_config_validate(&c, "limits"));
    k3_config_counts k;
    memset(&k, 0x5a, sizeof k);
    K3_CHECK_ERR(k3_config_count(&c, &k), K3_ERR_CONFIG, "overflows a 64-bit integer");
    K3_CHECK(k.params_total == 0 && k.n_tensors == 0, "counts zeroed on overflow");
    /* one tensor at the limits: 2^40 x 2^20 BF16 = 2^61 bytes, exact */
    k3_tensor_spec sp = {.dtype = K3_DT_BF16, .ndim = 2, .shape = {(int64_t)1 << 40, 1 << 20}};
    K3_CHECK(k3_tensor_spec_bytes(&sp) == (int64_t)1 << 61, "2^61 bytes");
    sp.shape[1] = (int64_t)1 << 23; /* 2^64 bytes */
    K3_CHECK(k3_tensor_spec_bytes(&sp) == -1, "spec bytes overflow -> -1, got %lld",
             (long long)k3_tensor_spec_bytes(&sp));

    /* the largest expert count k3 takes is counted at once (was: a >60 s catalogue walk for
     * 1e9 experts); 8 MoE layers x 32767 experts = 262136 instances */
    k3_preset_config(K3_PRESET_TINY, &c);
    c.n_experts = 32767;
    c.n_group = 32767;
    c.topk_group = 4;
    c.n_experts_per_tok = 4;
    K3_CHECK_OK(k3_config_validate(&c, "many experts"));
    double t0 = k3_now_s();
    K3_CHECK_OK(k3_config_count(&c, &k));
    double dt = k3_now_s() - t0;
    int64_t moe = 0;
    for (int l = 0; l < c.n_layers; l++) moe += k3_config_is_moe(&c, l);
    K3_CHECK(k.n_tensors > moe * 32767 * 6, "tensors %lld", (long long)k.n_tensors);
    K3_CHECK(dt < 10.0, "count took %.1f s", dt);

    /* a missing config keeps the cause (k3_read_file's reason) */
    K3_CHECK_ERR(k3_config_load("/nonexistent-k3-dir", &c), K3_ERR_IO,
                 "/nonexistent-k3-dir/config.json: cannot read the model config: cannot open: "
                 "No such file or directory");
}

/* issue 11: every key k3 reads is bounded, and the text is held strictly */
static void m_mpe0(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "max_position_embeddings", cJSON_CreateNumber(0));
}
static void m_mpe_frac(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "max_position_embeddings", cJSON_CreateNumber(4096.5));
}
static void m_mtp_neg(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "num_nextn_predict_layers", cJSON_CreateNumber(-1));
}
static void m_topk_method(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(tc, "topk_method", cJSON_CreateString("greedy"));
}
static void m_ungrouped(cJSON *tc, cJSON *t) { /* 8 groups of 112, but grouping said off */
    (void)t;
    cJSON_ReplaceItemInObject(tc, "num_expert_group", cJSON_CreateNumber(8));
    cJSON_ReplaceItemInObject(tc, "use_grouped_topk", cJSON_CreateFalse());
}
static void m_situ_inf(cJSON *tc, cJSON *t) { /* a finite double, inf as a float */
    (void)t;
    cJSON_ReplaceItemInObject(tc, "activation_situ_beta", cJSON_CreateNumber(1e300));
}
static void m_lb_inf(cJSON *tc, cJSON *t) {
    (void)t;
    cJSON_ReplaceItemInObject(la(tc), "gate_lower_bound", cJSON_CreateNumber(-1e300));
}

static void strict_cases(void) {
    struct {
        mutate_fn m;
        const char *needle;
    } bad[] = {
        {m_mpe0, "text_config.max_position_embeddings: 0 must be >= 1"},
        {m_mpe_frac, "text_config.max_position_embeddings: expected an integer"},
        {m_mtp_neg, "text_config.num_nextn_predict_layers: -1 must be >= 0"},
        {m_topk_method, "text_config.topk_method: 'greedy' is not supported"},
        {m_ungrouped, "text_config.use_grouped_topk: false with num_expert_group 8"},
        {m_situ_inf, "text_config.activation_situ_beta"},
        {m_lb_inf, "text_config.linear_attn_config.gate_lower_bound"},
    };
    k3_config c;
    for (size_t i = 0; i < K3_ARRAY_LEN(bad); i++)
        K3_CHECK_ERR(parse_mutated(bad[i].m, &c), K3_ERR_CONFIG, bad[i].needle);
    /* text edits of the K3 config: each names the key */
    struct {
        const char *from, *to, *needle;
    } txt[] = {
        {"\"max_position_embeddings\"", "\"max_position_embeddings\\u0000x\"",
         "text_config.max_position_embeddings\\u0000x (byte"},
        {"\"hidden_act\":\"situ\"", "\"hidden_act\":\"situ\\u0000x\"",
         "text_config.hidden_act (its value)"},
        {"\"v_head_dim\"", "\"v_head_dim\xff\"", "text_config.v_head_dim\\xff (byte"},
        {"\"v_head_dim\"", "\"v_head\tdim\"", "the key holds the control byte 0x09"},
        {"\"v_head_dim\":128,", "\"v_head_dim\":128,\"v_head_dim\":64,",
         "text_config.v_head_dim: the key appears twice"},
        {"\"eos_token_id\":163586}}", "\"eos_token_id\":163586}} x", "after the JSON value"},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(txt); i++) {
        const char *at = strstr(k3_json, txt[i].from);
        K3_CHECK(at != NULL, "fixture holds %s", txt[i].from);
        if (!at) continue;
        size_t n0 = (size_t)(at - k3_json), nf = strlen(txt[i].from), nt = strlen(txt[i].to);
        char *s = malloc(strlen(k3_json) + nt + 1);
        memcpy(s, k3_json, n0);
        memcpy(s + n0, txt[i].to, nt);
        strcpy(s + n0 + nt, at + nf);
        K3_CHECK_ERR(k3_config_parse(s, "config.json", &c), K3_ERR_CONFIG, txt[i].needle);
        free(s);
    }
    /* absent max_position_embeddings is "not given" (0); K3's is read */
    K3_CHECK_OK(k3_config_parse(k3_json, "config.json", &c));
    K3_CHECK(c.max_position_embeddings == 1048576, "max_position_embeddings %lld",
             (long long)c.max_position_embeddings);
    K3_CHECK_OK(k3_config_parse(kl_json, "kl.json", &c));
    K3_CHECK(c.max_position_embeddings == 0, "absent max_position_embeddings -> 0");
}

int main(void) {
    k3_config c, p;
    bound_cases();
    strict_cases();
    K3_CHECK_OK(k3_config_parse(k3_json, "config.json", &c));
    K3_CHECK(c.n_layers == 93 && c.hidden_size == 7168 && c.vocab_size == 163840, "dims");
    int n_mla = 0;
    for (int l = 0; l < 93; l++) n_mla += c.mixer[l] == K3_MIXER_MLA;
    K3_CHECK(n_mla == 24, "24 MLA layers, got %d", n_mla);
    K3_CHECK(c.mixer[0] == K3_MIXER_KDA && c.mixer[3] == K3_MIXER_MLA &&
                 c.mixer[4] == K3_MIXER_KDA && c.mixer[91] == K3_MIXER_MLA &&
                 c.mixer[92] == K3_MIXER_MLA && c.mixer[90] == K3_MIXER_KDA,
             "0-based layer kinds (MLA 3, 91, 92)");
    K3_CHECK(c.eos_token_id == 163586 && c.experts_mxfp4 && c.latent_size == 3584 &&
                 c.kda_has_lower_bound && c.kda_gate_lower_bound == -5.0f && c.kda_full_rank_gate &&
                 c.act == K3_ACT_SITU && c.situ_linear_beta == 25.0f &&
                 c.attn_res_block_size == 12 && c.kda_a_log_len == 128 &&
                 strcmp(c.tensor_prefix, "language_model.") == 0,
             "K3 fields");
    K3_CHECK(!k3_config_is_moe(&c, 0) && k3_config_is_moe(&c, 1) && k3_config_is_moe(&c, 92),
             "moe");
    K3_CHECK(k3_config_is_block_start(&c, 0) && k3_config_is_block_start(&c, 84) &&
                 !k3_config_is_block_start(&c, 83),
             "block starts");
    k3_preset_config(K3_PRESET_K3, &p);
    K3_CHECK(k3_config_hash(&c) == k3_config_hash(&p), "parsed K3 config == K3 preset");

    /* catalogue of the real K3: 5 globals + 6 x 93 (norms, AttnRes) + 14 x 69 KDA + 8 x 24 MLA
     * + 3 dense + 8 x 92 (router, bias, latent x3, shared x3) + 896 x 6 x 92 experts = 497052 */
    int64_t n = k3_catalog(&c, NULL, 0);
    K3_CHECK(n == 5 + 6 * 93 + 14 * 69 + 8 * 24 + 3 + 8 * 92 + 896 * 6 * 92, "K3 tensors %lld",
             (long long)n);
    k3_config_counts k;
    K3_CHECK_OK(k3_config_count(&c, &k));
    /* spec §0: ≈2.78T total, ≈104B active, checkpoint ≈1.56 TB */
    K3_CHECK(k.params_total > 2.77e12 && k.params_total < 2.79e12, "total %lld",
             (long long)k.params_total);
    K3_CHECK(k.params_active > 103e9 && k.params_active < 105e9, "active %lld",
             (long long)k.params_active);
    K3_CHECK(k.bytes_total > 1.55e12 && k.bytes_total < 1.57e12, "bytes %lld",
             (long long)k.bytes_total);
    {
        k3_tensor_spec *s = malloc((size_t)n * sizeof *s);
        k3_catalog(&c, s, n);
        int found = 0;
        for (int64_t i = 0; i < n; i++) {
            if (strcmp(
                    s[i].name,
                    "language_model.model.layers.3.block_sparse_moe.experts.0.w2.weight_scale") ==
                0)
                found += s[i].dtype == K3_DT_U8 && s[i].shape[0] == 3584 && s[i].shape[1] == 96;
            if (strcmp(s[i].name, "language_model.model.layers.0.self_attn.A_log") == 0)
                found += s[i].dtype == K3_DT_F32 && s[i].shape[0] == 128;
            if (strcmp(s[i].name, "language_model.model.layers.92.self_attn.kv_b_proj.weight") == 0)
                found += s[i].shape[0] == 24576 && s[i].shape[1] == 512;
            if (strcmp(s[i].name, "language_model.lm_head.weight") == 0) found++;
        }
        K3_CHECK(found == 4, "named K3 tensors with real shapes (%d of 4)", found);
        free(s);
    }

    /* Kimi-Linear style */
    K3_CHECK_OK(k3_config_parse(kl_json, "kl.json", &c));
    K3_CHECK(!c.kda_has_lower_bound && c.act == K3_ACT_SWIGLU && c.attn_res_block_size == 0 &&
                 !c.kda_full_rank_gate && c.latent_size == 0 && !c.experts_mxfp4 &&
                 c.q_lora_rank == 0 && !c.mla_use_output_gate && c.tensor_prefix[0] == 0 &&
                 c.mixer[3] == K3_MIXER_MLA,
             "Kimi-Linear fields");
    {
        int64_t m = k3_catalog(&c, NULL, 0);
        k3_tensor_spec *s = malloc((size_t)m * sizeof *s);
        k3_catalog(&c, s, m);
        int found = 0;
        for (int64_t i = 0; i < m; i++) {
            if (strcmp(s[i].name, "model.layers.1.block_sparse_moe.experts.7.w1.weight") == 0)
                found += s[i].dtype == K3_DT_BF16 && s[i].shape[0] == 32 && s[i].shape[1] == 64;
            if (strcmp(s[i].name, "model.layers.0.self_attn.g_a_proj.weight") == 0)
                found += s[i].shape[0] == 16 && s[i].shape[1] == 64;
            if (strcmp(s[i].name, "model.layers.0.self_attn.g_b_proj.weight") == 0)
                found += s[i].shape[0] == 32 && s[i].shape[1] == 16;
            if (strcmp(s[i].name, "model.layers.3.self_attn.q_proj.weight") == 0)
                found += s[i].shape[0] == 2 * 12 && s[i].shape[1] == 64;
            if (strstr(s[i].name, "res_norm") || strstr(s[i].name, "routed_expert")) found = -100;
        }
        K3_CHECK(found == 4, "Kimi-Linear catalogue names (%d of 4)", found);
        free(s);
    }

    /* every bad value is rejected with its key's name */
    struct {
        mutate_fn m;
        const char *needle;
    } bad[] = {
        {m_no_hidden, "text_config.hidden_size: missing"},
        {m_str_hidden, "text_config.hidden_size: expected a number"},
        {m_layers0, "num_hidden_layers"},
        {m_full94, "full_attn_layers[24]"},
        {m_full0, "1-based"},
        {m_kda_dup, "kda_layers"},
        {m_kda_gap, "layer 1 is in neither"},
        {m_topk, "num_experts_per_token"},
        {m_act, "hidden_act"},
        {m_qfmt, "quantization_config.format"},
        {m_eps, "rms_norm_eps"},
        {m_topkg, "topk_group"},
        {m_eos, "eos_token_id"},
        {m_group, "num_expert_group"},
        {m_inter, "moe_intermediate_size"},
        {m_situ, "activation_situ_beta: missing"},
        {m_lb, "gate_lower_bound"},
        {m_frac, "kv_lora_rank: expected an integer"},
        {m_nolin, "linear_attn_config: missing"},
        {m_bits, "num_bits"},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(bad); i++)
        K3_CHECK_ERR(parse_mutated(bad[i].m, &c), K3_ERR_CONFIG, bad[i].needle);
    K3_CHECK_ERR(k3_config_parse("{\"text_config\": [1,", "x.json", &c), K3_ERR_CONFIG,
                 "x.json: invalid JSON");

    /* presets round-trip through config.json (A_log length comes from the checkpoint) */
    for (int pi = 0; pi < 2; pi++) {
        k3_preset_config(pi == 0 ? K3_PRESET_TINY : K3_PRESET_SMALL, &p);
        K3_CHECK_OK(k3_config_validate(&p, "preset"));
        char *js = NULL;
        K3_CHECK_OK(k3_config_to_json(&p, &js));
        K3_CHECK_OK(k3_config_parse(js, "preset.json", &c));
        K3_CHECK(strstr(js, "\"rms_norm_eps\":\t1e-05") != NULL, "eps printed as 1e-05");
        k3_free(js);
        c.kda_a_log_len = p.kda_a_log_len;
        K3_CHECK(k3_config_hash(&c) == k3_config_hash(&p), "preset %d round trip", pi);
    }
    /* tiny: exactly the shape */
    k3_preset_config(K3_PRESET_TINY, &p);
    K3_CHECK(p.hidden_size == 128 && p.n_layers == 8 && p.mixer[3] == K3_MIXER_MLA &&
                 p.mixer[6] == K3_MIXER_MLA && p.mixer[7] == K3_MIXER_MLA &&
                 p.mixer[5] == K3_MIXER_KDA && p.n_experts == 16 && p.n_experts_per_tok == 4 &&
                 p.n_group == 4 && p.topk_group == 2 && p.vocab_size == 4096 &&
                 p.eos_token_id == 3842 && p.kda_a_log_len == 8,
             "tiny preset");
    K3_CHECK_OK(k3_config_count(&p, &k));
    k3_preset_config(K3_PRESET_SMALL, &p);
    K3_CHECK_OK(k3_config_count(&p, &k));
    K3_CHECK(k.bytes_active >= 200000000, "small reads >= 200 MB per token (%lld)",
             (long long)k.bytes_active);
    return k3_test_done("model_config");
}
