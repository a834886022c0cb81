/* make_tiny.c — `k3 make-tiny`: a deterministic random K3 checkpoint in the released layout.
 *
 * Writes config.json (k3_config_to_json), model.safetensors.index.json, M >= 3 shards
 * model-0000N-of-0000M.safetensors holding the catalogue in order (the six tensors of one MXFP4
 * expert never straddle shards), and the tokenizer: tiktoken.model trained by k3's own BPE on the
 * embedded corpus (tiny/data/tiny_corpus.txt) and tokenizer_config.json with K3's 256-slot
 * special block placed right after the mergeable ranks.
 * Every tensor draws from its own k3_rng stream seeded by hash(seed, tensor name), so the bytes
 * of one tensor do not depend on the order or on other tensors; same seed -> same files.
 * Scales keep activations O(1): projections N(0, 1/fan_in) (std fan_in^-1/2), norms 1 + 0.05 N,
 * dt_bias = softplus^-1(dt), dt ~ logU[1e-3, 0.1], A_log = log U[1, 16] (zero past the heads),
 * router bias 0.02 N, AttnRes res_proj std D^-1/2 (scores ~ N(0, 1)), MXFP4 experts random codes
 * with E8M0 scales base ± 2 where base makes the expert outputs O(0.1-1) (see expert_base_exp). */
#include "k3_tiny.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

extern const char k3_tiny_corpus[]; /* tiny_corpus.c, generated from tiny/data/ */
extern const size_t k3_tiny_corpus_len;

typedef struct gen {
    const k3_config *c;
    uint64_t seed_hash;
} gen;

/* N(0, 1)-like from 4 x 16-bit uniforms (Irwin-Hall; cheap, deterministic, |x| <= 2 sqrt 3). */
static float fast_normal(k3_rng *r) {
    uint64_t u = k3_rng_u64(r);
    double s = (double)(u & 0xffff) + (double)((u >> 16) & 0xffff) + (double)((u >> 32) & 0xffff) +
               (double)(u >> 48);
    return (float)((s / 65536.0 - 2.0) * 1.7320508075688772);
}

/* E8M0 centre for a random-code MXFP4 matrix with fan_in inputs: uniform random E2M1 codes have
 * RMS sqrt(68.5/8) ≈ 2.93, so a row dot an O(1) input has RMS 2.93 sqrt(fan_in) 2^(e-127);
 * pick e so that is ≈ 1. (127 ± 2 as first suggested would give outputs of 10-50.) */
static int expert_base_exp(int64_t fan_in) {
    double want = 1.0 / (2.926 * sqrt((double)fan_in));
    return 127 + (int)lround(log2(want));
}

static k3_status fill(void *ctx, const k3_tensor_spec *s, void *dst) {
    const gen *g = ctx;
    const k3_config *c = g->c;
    k3_rng r;
    k3_rng_seed(&r, k3_hash_bytes(s->name, strlen(s->name), g->seed_hash));
    int64_t n = 1;
    for (int i = 0; i < s->ndim; i++) n *= s->shape[i];
    uint16_t *bf = dst;
    float *f = dst;
    uint8_t *u8 = dst;
    switch (s->role) {
    case K3_R_EXP_W1_PACKED:
    case K3_R_EXP_W2_PACKED:
    case K3_R_EXP_W3_PACKED:
        for (int64_t i = 0; i < n; i += 8) {
            uint64_t u = k3_rng_u64(&r);
            for (int64_t j = 0; j < 8 && i + j < n; j++) u8[i + j] = (uint8_t)(u >> (8 * j));
        }
        return K3_OK;
    case K3_R_EXP_W1_SCALE:
    case K3_R_EXP_W2_SCALE:
    case K3_R_EXP_W3_SCALE: {
        int64_t fan_in = s->shape[1] * 32;
        int base = expert_base_exp(fan_in);
        for (int64_t i = 0; i < n; i++) u8[i] = (uint8_t)(base - 2 + (int)(k3_rng_u64(&r) % 5));
        return K3_OK;
    }
    case K3_R_KDA_QCONV:
    case K3_R_KDA_KCONV:
    case K3_R_KDA_VCONV: {
        float sd = 1.0f / sqrtf((float)c->kda_conv_kernel);
        for (int64_t i = 0; i < n; i++) f[i] = sd * fast_normal(&r);
        return K3_OK;
    }
    case K3_R_KDA_DT_BIAS:
        for (int64_t i = 0; i < n; i++) {
            double dt = exp(log(1e-3) + (log(0.1) - log(1e-3)) * k3_rng_uniform(&r));
            f[i] = (float)(dt + log(-expm1(-dt))); /* softplus^-1(dt) */
        }
        return K3_OK;
    case K3_R_KDA_A_LOG:
        for (int64_t i = 0; i < n; i++)
            f[i] = i < c->kda_n_heads ? (float)log(1.0 + 15.0 * k3_rng_uniform(&r)) : 0.0f;
        return K3_OK;
    case K3_R_KDA_O_NORM:
        for (int64_t i = 0; i < n; i++) f[i] = 1.0f + 0.05f * fast_normal(&r);
        return K3_OK;
    case K3_R_ROUTER_BIAS:
        for (int64_t i = 0; i < n; i++) f[i] = 0.02f * fast_normal(&r);
        return K3_OK;
    case K3_R_INPUT_NORM:
    case K3_R_POST_NORM:
    case K3_R_ATTN_RES_NORM:
    case K3_R_MLP_RES_NORM:
    case K3_R_OUT_RES_NORM:
    case K3_R_FINAL_NORM:
    case K3_R_MLA_QA_NORM:
    case K3_R_MLA_KVA_NORM:
    case K3_R_LAT_NORM:
        for (int64_t i = 0; i < n; i++) bf[i] = k3_f32_to_bf16(1.0f + 0.05f * fast_normal(&r));
        return K3_OK;
    default:
        break;
    }
    if (s->dtype != K3_DT_BF16 || s->ndim != 2)
        return K3_ERR(K3_ERR_INTERNAL, "make-tiny: no generator for %s", s->name);
    /* matrices [out, in]: std in^-1/2; the embedding rows are O(1) */
    float sd = s->role == K3_R_EMBED ? 1.0f : 1.0f / sqrtf((float)s->shape[1]);
    for (int64_t i = 0; i < n; i++) bf[i] = k3_f32_to_bf16(sd * fast_normal(&r));
    return K3_OK;
}

/* ---- files ---------------------------------------------------------------------------------- */
static k3_status write_text(const char *dir, const char *name, const char *text, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return K3_ERR(K3_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    size_t w = fwrite(text, 1, n, f);
    if (fclose(f) != 0 || w != n) return K3_ERR(K3_ERR_IO, "%s: write failed", path);
    return K3_OK;
}

static k3_status write_json(const char *dir, const char *name, cJSON *root) {
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    if (!s) return K3_ERR(K3_ERR_NOMEM, "%s: cannot print JSON", name);
    size_t n = strlen(s);
    k3_status st = write_text(dir, name, s, n);
    cJSON_free(s);
    return st;
}

static int spec_name_cmp(const void *a, const void *b) {
    return strcmp((*(const k3_tensor_spec *const *)a)->name,
                  (*(const k3_tensor_spec *const *)b)->name);
}

static void b64(const uint8_t *p, int64_t n, char *out) {
    static const char t[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    int64_t o = 0;
    for (int64_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16;
        if (i + 1 < n) v |= (uint32_t)p[i + 1] << 8;
        if (i + 2 < n) v |= p[i + 2];
        out[o++] = t[(v >> 18) & 63];
        out[o++] = t[(v >> 12) & 63];
        out[o++] = i + 1 < n ? t[(v >> 6) & 63] : '=';
        out[o++] = i + 2 < n ? t[v & 63] : '=';
    }
    out[o] = 0;
}

/* K3's special block (K3-CHAT.md §4.1), by offset from its first id. */
typedef struct {
    int off;
    const char *content;
    bool special;
} special_tok;
static const special_tok k3_specials[] = {
    {0, "[BOS]", true},
    {1, "[EOS]", true},
    {2, "<|end_of_msg|>", true},
    {3, "<|open|>", false},
    {4, "<|close|>", false},
    {5, "<|sep|>", false},
    {6, "[start_header_id]", true},
    {7, "[end_header_id]", true},
    {9, "[EOT]", true},
    {18, "<|media_begin|>", true},
    {19, "<|media_content|>", true},
    {20, "<|media_end|>", true},
    {21, "<|media_pad|>", true},
    {65, "<osagent_mode>", true},
    {254, "[UNK]", true},
    {255, "[PAD]", true},
};

static k3_status write_tokenizer(const char *dir, const k3_config *c) {
    int n_ranks = (int)c->vocab_size - 256;
    if (n_ranks < 256)
        return K3_ERR(K3_ERR_CONFIG, "make-tiny: vocab_size %lld leaves < 256 mergeable ranks",
                      (long long)c->vocab_size);
    k3_bpe_vocab v = {0};
    K3_TRY(k3_bpe_train(k3_tiny_corpus, k3_tiny_corpus_len, n_ranks, &v));
    size_t cap = 64, len = 0;
    for (int r = 0; r < v.n; r++) cap += (size_t)(v.off[r + 1] - v.off[r]) * 4 / 3 + 24;
    char *text = NULL;
    k3_status st = k3_alloc((void **)&text, cap, "tiktoken.model");
    char *enc = NULL;
    if (st == K3_OK) st = k3_alloc((void **)&enc, 4096, "base64");
    for (int r = 0; st == K3_OK && r < v.n; r++) {
        int64_t tl = v.off[r + 1] - v.off[r];
        if (tl > 3000) {
            st = K3_ERR(K3_ERR_INTERNAL, "token %d too long", r);
            break;
        }
        b64(v.bytes + v.off[r], tl, enc);
        len += (size_t)snprintf(text + len, cap - len, "%s %d\n", enc, r);
    }
    if (st == K3_OK) st = write_text(dir, "tiktoken.model", text, len);
    k3_free(text);
    k3_free(enc);
    k3_bpe_vocab_free(&v);
    K3_TRY(st);

    cJSON *root = cJSON_CreateObject();
    cJSON *dec = cJSON_AddObjectToObject(root, "added_tokens_decoder");
    cJSON *extra = cJSON_CreateArray();
    for (int off = 0; off < 256; off++) {
        char content[64], key[32];
        bool special = true;
        int id = n_ranks + off;
        snprintf(content, sizeof content, "<|reserved_token_%d|>", id);
        for (size_t i = 0; i < K3_ARRAY_LEN(k3_specials); i++)
            if (k3_specials[i].off == off) {
                snprintf(content, sizeof content, "%s", k3_specials[i].content);
                special = k3_specials[i].special;
                cJSON_AddItemToArray(extra, cJSON_CreateString(content));
            }
        snprintf(key, sizeof key, "%d", id);
        cJSON *e = cJSON_AddObjectToObject(dec, key);
        cJSON_AddStringToObject(e, "content", content);
        cJSON_AddBoolToObject(e, "lstrip", false);
        cJSON_AddBoolToObject(e, "normalized", false);
        cJSON_AddBoolToObject(e, "rstrip", false);
        cJSON_AddBoolToObject(e, "single_word", false);
        cJSON_AddBoolToObject(e, "special", special);
    }
    cJSON_AddItemToObject(root, "additional_special_tokens", extra);
    cJSON_AddStringToObject(root, "bos_token", "[BOS]");
    cJSON_AddStringToObject(root, "eos_token", "[EOS]");
    cJSON_AddStringToObject(root, "unk_token", "[UNK]");
    cJSON_AddStringToObject(root, "pad_token", "[PAD]");
    cJSON_AddStringToObject(root, "tokenizer_class", "TikTokenTokenizer");
    cJSON_AddNumberToObject(root, "model_max_length", 1048576);
    return write_json(dir, "tokenizer_config.json", root);
}

k3_status k3_make_tiny(const char *dir, k3_preset p, uint64_t seed) {
    return k3_make_tiny_dense(dir, p, seed, false);
}

k3_status k3_make_tiny_dense(const char *dir, k3_preset p, uint64_t seed, bool dense) {
    if (p == K3_PRESET_K3)
        return K3_ERR(K3_ERR_ARG,
                      "make-tiny: only the tiny, small and deep presets can be generated");
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return K3_ERR(K3_ERR_IO, "%s: cannot create the directory: %s", dir, strerror(errno));
    k3_config c;
    k3_preset_config(p, &c);
    if (dense) c.first_k_dense_replace = c.n_layers; /* every FFN dense: no MoE layer */
    K3_TRY(k3_config_validate(&c, "make-tiny preset"));
    char *cj = NULL;
    K3_TRY(k3_config_to_json(&c, &cj));
    k3_status st = write_text(dir, "config.json", cj, strlen(cj));
    k3_free(cj);
    K3_TRY(st);

    int64_t n = k3_catalog(&c, NULL, 0);
    k3_tensor_spec *specs = NULL;
    const k3_tensor_spec **sorted = NULL;
    K3_TRY(k3_alloc((void **)&specs, (size_t)n * sizeof *specs, "catalogue"));
    k3_catalog(&c, specs, n);
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) total += k3_tensor_spec_bytes(&specs[i]);
    int m = (int)K3_MAX(3, (total >> 28) + 1); /* >= 3 shards, <= ~256 MiB each */
    /* cut points at group boundaries (an MXFP4 expert's 6 tensors form one group) */
    int64_t cut[64];
    int nc = 0;
    int64_t acc = 0;
    cut[nc++] = 0;
    for (int64_t i = 0; i < n && nc < m; i++) {
        bool boundary =
            i > 0 &&
            !(specs[i].kind == K3_TK_EXPERT && specs[i - 1].kind == K3_TK_EXPERT &&
              specs[i].expert == specs[i - 1].expert && specs[i].layer == specs[i - 1].layer);
        if (boundary && acc >= total * nc / m && i > cut[nc - 1]) cut[nc++] = i;
        acc += k3_tensor_spec_bytes(&specs[i]);
    }
    if (nc < m) {
        k3_free(specs);
        return K3_ERR(K3_ERR_INTERNAL, "make-tiny: cannot split %lld tensors into %d shards",
                      (long long)n, m);
    }
    cut[nc] = n;
    gen g = {&c, k3_hash_bytes(&seed, sizeof seed, K3_HASH_INIT)};
    char path[4096];
    cJSON *idx = cJSON_CreateObject();
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(idx, "metadata"), "total_size", (double)total);
    cJSON *wm = cJSON_AddObjectToObject(idx, "weight_map");
    char **shard_of = NULL;
    st = k3_calloc((void **)&shard_of, (size_t)n * sizeof *shard_of, "shard map");
    if (st == K3_OK) st = k3_alloc((void **)&sorted, (size_t)n * sizeof *sorted, "sorted names");
    char shard_names[64][48];
    for (int s = 0; st == K3_OK && s < m; s++) {
        snprintf(shard_names[s], sizeof shard_names[s], "model-%05d-of-%05d.safetensors", s + 1, m);
        snprintf(path, sizeof path, "%s/%s", dir, shard_names[s]);
        st = k3_st_write_shard(path, specs + cut[s], cut[s + 1] - cut[s], fill, &g);
        for (int64_t i = cut[s]; i < cut[s + 1]; i++) shard_of[i] = shard_names[s];
    }
    if (st == K3_OK) {
        /* weight_map sorted by name, as Hugging Face writes it */
        for (int64_t i = 0; i < n; i++) sorted[i] = &specs[i];
        qsort(sorted, (size_t)n, sizeof *sorted, spec_name_cmp);
        for (int64_t i = 0; i < n; i++)
            cJSON_AddStringToObject(wm, sorted[i]->name, shard_of[sorted[i] - specs]);
        st = write_json(dir, "model.safetensors.index.json", idx);
        idx = NULL;
    }
    cJSON_Delete(idx);
    k3_free(shard_of);
    k3_free(sorted);
    k3_free(specs);
    K3_TRY(st);
    return write_tokenizer(dir, &c);
}
