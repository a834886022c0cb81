/* cmd_inspect.c — `k3 inspect DIR [--json]` / `k3 inspect --preset k3`: what a checkpoint is.
 *
 * Prints the config summary, the layer kinds (K = KDA, M = MLA; lower case = dense FFN), total
 * and active parameter counts, bytes by dtype, "active bytes/token" (what one decoded token
 * reads), the shards (name, size, tensor count), then checks every tensor the config implies
 * (k3_ckpt_verify) and lists the problems (the first 1000; n_problems / the stderr line give the
 * real count); exit 1 if there are any. --json prints the same as one JSON object on stdout; its
 * "config" is config.json's text_config from the one writer (k3_config_json) + the derived values.
 * --preset k3 summarises the real K3 config without a checkpoint.
 * --verify also reads every tensor (k3_ckpt_scan: streaming, bounded memory) and lists each
 * non-finite F32/BF16/F16 value and each E8M0 scale of 0xFF by file, tensor and row; progress
 * with GB/s on stderr, and the bytes checked and the GB/s on stdout ("verify" in --json). */
#include "k3_launcher.h"
#include "k3_config_json.h"
#include "k3_model.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static const k3_flag flags[] = {
    {"json", K3_FLAG_BOOL, NULL, NULL, "print one JSON object on stdout"},
    {"preset", K3_FLAG_STR, "NAME", NULL, "summarise a preset's config (tiny, small, k3); no DIR"},
    {"verify", K3_FLAG_BOOL, NULL, NULL,
     "also read every tensor: non-finite F32/BF16 values and E8M0 0xFF scales, by tensor and row"},
};

typedef struct probs {
    cJSON *arr;
    int64_t n;
} probs;
static void add_problem(void *ctx, const char *msg) {
    probs *p = ctx;
    p->n++;
    if (cJSON_GetArraySize(p->arr) < 1000) cJSON_AddItemToArray(p->arr, cJSON_CreateString(msg));
}

/* --verify: problems go to the inspect list, progress to stderr (a line redrawn 4 times a second
 * on a terminal, else one line every 10 s). */
typedef struct vctx {
    probs *p;
    double t0, last;
    bool tty;
} vctx;
static void on_verify_problem(void *ctx, const char *msg) {
    add_problem(((vctx *)ctx)->p, msg);
}
static k3_status on_verify_progress(void *ctx, uint64_t done, uint64_t total) {
    vctx *v = ctx;
    double now = k3_now_s();
    if (done == total || now - v->last < (v->tty ? 0.25 : 10.0)) return K3_OK; /* the end */
    v->last = now;
    fprintf(stderr, "%sk3 inspect: verify %.2f of %.2f GB (%.0f%%), %.2f GB/s%s",
            v->tty ? "\r" : "", (double)done / 1e9, (double)total / 1e9,
            100.0 * (double)done / (double)total, (double)done / 1e9 / K3_MAX(now - v->t0, 1e-9),
            v->tty ? "" : "\n");
    return K3_OK;
}

/* Read every tensor of ck and check the values; adds "verify" to root and prints the summary
 * (one line on stderr; the text output prints it before the verdict). Returns 1 on any problem or a
 * failed read. */
static int verify_values(k3_ckpt *ck, probs *p, cJSON *root) {
    vctx v = {.p = p, .t0 = k3_now_s(), .last = k3_now_s(), .tty = isatty(2)};
    k3_scan_opts o = {.progress = on_verify_progress, .report = on_verify_problem, .ctx = &v};
    k3_scan_result r;
    k3_status st = k3_ckpt_scan(ck, &o, &r);
    if (st != K3_OK) add_problem(p, k3_last_error());
    double gbs = (double)r.n_bytes / 1e9 / K3_MAX(r.seconds, 1e-9);
    cJSON *vj = cJSON_AddObjectToObject(root, "verify");
    cJSON_AddNumberToObject(vj, "bytes", (double)r.n_bytes);
    cJSON_AddNumberToObject(vj, "tensors", (double)r.n_tensors);
    cJSON_AddNumberToObject(vj, "seconds", r.seconds);
    cJSON_AddNumberToObject(vj, "gb_per_s", gbs);
    cJSON_AddNumberToObject(vj, "bad_values", (double)r.n_bad_values);
    cJSON_AddNumberToObject(vj, "bad_tensors", (double)r.n_bad_tensors);
    cJSON_AddBoolToObject(vj, "complete", st == K3_OK);
    char line[256];
    snprintf(line, sizeof line,
             "%llu bytes of %lld tensors checked in %.2f s (%.2f GB/s)%s: %lld bad values in %lld "
             "tensors",
             (unsigned long long)r.n_bytes, (long long)r.n_tensors, r.seconds, gbs,
             st == K3_OK ? "" : " (stopped by a read error)", (long long)r.n_bad_values,
             (long long)r.n_bad_tensors);
    fprintf(stderr, "%sk3 inspect: verify: %s\n", v.tty ? "\r\033[K" : "", line);
    cJSON_AddStringToObject(vj, "summary", line);
    return st == K3_OK && r.n_reports == 0 ? 0 : 1;
}

static void layer_string(const k3_config *c, char *out, size_t cap) {
    size_t n = 0;
    for (int l = 0; l < c->n_layers && n + 3 < cap; l++) {
        char k = c->mixer[l] == K3_MIXER_MLA ? 'M' : 'K';
        if (!k3_config_is_moe(c, l)) k = (char)(k - 'A' + 'a');
        if (l) out[n++] = ' ';
        out[n++] = k;
    }
    out[n] = 0;
}

/* The config as config.json spells it (k3_config_json, the one writer) plus what inspect derives:
 * layer kinds, counts, bytes. NULL (k3_last_error says why) when the counts cannot be computed. */
static cJSON *summary(const k3_config *c) {
    k3_config_counts k;
    if (k3_config_count(c, &k) != K3_OK) return NULL;
    cJSON *o = k3_config_json(c);
    if (!o) {
        K3_ERR(K3_ERR_NOMEM, "inspect: out of memory");
        return NULL;
    }
    char ls[4 * K3_MAX_LAYERS];
    layer_string(c, ls, sizeof ls);
    cJSON_AddStringToObject(o, "layers", ls);
    int nm = 0, nmoe = 0;
    for (int l = 0; l < c->n_layers; l++) {
        nm += c->mixer[l] == K3_MIXER_MLA;
        nmoe += k3_config_is_moe(c, l);
    }
    cJSON_AddNumberToObject(o, "n_kda", c->n_layers - nm);
    cJSON_AddNumberToObject(o, "n_mla", nm);
    cJSON_AddNumberToObject(o, "n_dense", c->n_layers - nmoe);
    cJSON_AddNumberToObject(o, "n_moe", nmoe);
    cJSON_AddStringToObject(o, "experts", c->experts_mxfp4 ? "mxfp4" : "bf16");
    cJSON_AddStringToObject(o, "kda_gate", c->kda_has_lower_bound ? "lower_bound" : "softplus");
    cJSON_AddNumberToObject(o, "n_tensors", (double)k.n_tensors);
    cJSON_AddNumberToObject(o, "params_total", (double)k.params_total);
    cJSON_AddNumberToObject(o, "params_active", (double)k.params_active);
    cJSON_AddNumberToObject(o, "bytes_total", (double)k.bytes_total);
    cJSON_AddNumberToObject(o, "active_bytes_per_token", (double)k.bytes_active);
    cJSON *bd = cJSON_AddObjectToObject(o, "bytes_by_dtype");
    for (int d = 0; d < 8 && d < K3_DT_COUNT; d++)
        if (k.bytes_by_dtype[d])
            cJSON_AddNumberToObject(bd, k3_dtype_name((k3_dtype)d), (double)k.bytes_by_dtype[d]);
    return o;
}

/* The summary lines read the config from `c` (the JSON omits keys a config does not use, e.g.
 * routed_expert_hidden_size without a latent) and the derived values from `s`. */
static void print_text(const k3_config *c, const cJSON *s, const cJSON *shards,
                       const cJSON *problems) {
#define N(key) cJSON_GetObjectItem(s, key)->valuedouble
    printf("config   vocab %lld, hidden %lld, %d layers (%.0f KDA, %.0f MLA; %.0f dense, %.0f "
           "MoE)\n",
           (long long)c->vocab_size, (long long)c->hidden_size, c->n_layers, N("n_kda"), N("n_mla"),
           N("n_dense"), N("n_moe"));
    printf("layers   %s   (K KDA, M MLA; lower case = dense FFN)\n",
           cJSON_GetObjectItem(s, "layers")->valuestring);
    printf("moe      %d experts, top-%d, groups %d/%d, %d shared, latent %d, %s experts\n",
           c->n_experts, c->n_experts_per_tok, c->n_group, c->topk_group, c->n_shared_experts,
           c->latent_size, cJSON_GetObjectItem(s, "experts")->valuestring);
    printf("misc     act %s, KDA gate %s, AttnRes block %d, eos %d\n",
           c->act == K3_ACT_SITU ? "situ" : "swiglu",
           cJSON_GetObjectItem(s, "kda_gate")->valuestring, c->attn_res_block_size,
           c->eos_token_id);
    printf("params   %.0f total, %.0f active per token, %.0f tensors\n", N("params_total"),
           N("params_active"), N("n_tensors"));
    printf("bytes    %.0f total (%.2f GB); active bytes/token %.0f (%.1f MB)\n", N("bytes_total"),
           N("bytes_total") / 1e9, N("active_bytes_per_token"), N("active_bytes_per_token") / 1e6);
    const cJSON *d;
    cJSON_ArrayForEach(d, cJSON_GetObjectItem(s, "bytes_by_dtype"))
        printf("dtype    %-5s %.0f bytes\n", d->string, d->valuedouble);
#undef N
    const cJSON *sh;
    cJSON_ArrayForEach(sh, shards) printf("shard    %s  %.0f bytes  %.0f tensors\n",
                                          cJSON_GetObjectItem(sh, "name")->valuestring,
                                          cJSON_GetObjectItem(sh, "bytes")->valuedouble,
                                          cJSON_GetObjectItem(sh, "tensors")->valuedouble);
    const cJSON *p;
    cJSON_ArrayForEach(p, problems) printf("problem  %s\n", p->valuestring);
}

static int run_inspect(const k3_args *a) {
    bool json = k3_args_bool(a, "json"), verify = k3_args_bool(a, "verify");
    const char *preset = k3_args_str(a, "preset");
    k3_config c;
    cJSON *root = cJSON_CreateObject(), *shards = cJSON_CreateArray(), *pr = cJSON_CreateArray();
    probs p = {pr, 0}; /* p.n: every problem; pr holds at most the first 1000 */
    int rc = 0;
    if (preset) {
        k3_preset pre;
        if (a->n_pos > 0 || verify || k3_preset_parse(preset, &pre) != K3_OK) {
            fprintf(stderr,
                    "k3 inspect: --preset %s: give tiny, small or k3, and no DIR or --verify\n",
                    preset);
            cJSON_Delete(root);
            cJSON_Delete(shards);
            cJSON_Delete(pr);
            return 2;
        }
        k3_preset_config(pre, &c);
        cJSON_AddStringToObject(root, "preset", preset);
    } else {
        if (a->n_pos != 1) {
            fprintf(stderr, "k3 inspect: give a checkpoint DIR (or --preset NAME)\n");
            cJSON_Delete(root);
            cJSON_Delete(shards);
            cJSON_Delete(pr);
            return 2;
        }
        const char *dir = a->pos[0];
        cJSON_AddStringToObject(root, "dir", dir);
        if (k3_config_load(dir, &c) != K3_OK) {
            fprintf(stderr, "k3 inspect: %s\n", k3_last_error());
            cJSON_Delete(root);
            cJSON_Delete(shards);
            cJSON_Delete(pr);
            return 1;
        }
        k3_ckpt *ck = NULL;
        if (k3_ckpt_open(dir, &ck) != K3_OK) {
            add_problem(&p, k3_last_error());
            rc = 1;
        } else {
            for (int s = 0; s < k3_ckpt_n_shards(ck); s++) {
                cJSON *o = cJSON_CreateObject();
                const char *path = k3_ckpt_shard_path(ck, s), *base = strrchr(path, '/');
                int64_t nt = 0;
                for (int64_t i = 0; i < k3_ckpt_n_tensors(ck); i++)
                    nt += k3_ckpt_tensor_at(ck, i)->shard == s;
                cJSON_AddStringToObject(o, "name", base ? base + 1 : path);
                cJSON_AddNumberToObject(o, "bytes", (double)k3_ckpt_shard_size(ck, s));
                cJSON_AddNumberToObject(o, "tensors", (double)nt);
                cJSON_AddItemToArray(shards, o);
            }
            if (k3_ckpt_verify(ck, &c, add_problem, &p) > 0) rc = 1;
            if (verify && verify_values(ck, &p, root)) rc = 1;
            k3_ckpt_destroy(ck);
        }
    }
    cJSON *sum = summary(&c);
    if (!sum) {
        fprintf(stderr, "k3 inspect: %s\n", k3_last_error());
        cJSON_Delete(root);
        cJSON_Delete(shards);
        cJSON_Delete(pr);
        return 1;
    }
    cJSON_AddItemToObject(root, "config", sum);
    cJSON_AddItemToObject(root, "shards", shards);
    cJSON_AddItemToObject(root, "problems", pr);
    cJSON_AddNumberToObject(root, "n_problems", (double)p.n);
    cJSON_AddBoolToObject(root, "ok", rc == 0);
    if (json) {
        char *s = cJSON_PrintUnformatted(root);
        if (s) printf("%s\n", s);
        cJSON_free(s);
    } else {
        print_text(&c, cJSON_GetObjectItem(root, "config"), shards, pr);
        const cJSON *vs = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "verify"), "summary");
        if (cJSON_IsString(vs)) printf("verify   %s\n", vs->valuestring);
        printf("verdict  %s\n", rc == 0 ? "OK" : "PROBLEMS FOUND");
    }
    if (rc != 0) {
        int listed = cJSON_GetArraySize(pr);
        fprintf(stderr, "k3 inspect: %lld problem%s%s, first: %s\n", (long long)p.n,
                p.n == 1 ? "" : "s", p.n > listed ? " (the first 1000 listed)" : "",
                listed ? cJSON_GetArrayItem(pr, 0)->valuestring : "?");
    }
    cJSON_Delete(root);
    return rc;
}

const k3_command k3_cmd_inspect = {
    .name = "inspect",
    .positional = "[DIR]",
    .min_pos = 0,
    .max_pos = 1,
    .summary = "summarise a checkpoint and check it against its config",
    .flags = flags,
    .n_flags = (int)K3_ARRAY_LEN(flags),
    .run = run_inspect,
};
