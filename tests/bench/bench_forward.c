/* bench_forward.c — single-process forward throughput (never pass/fail; STYLE.md §22).
 *
 * For each model (--model DIR, repeatable; default: the tiny and small presets written with
 * k3_make_tiny into temp dirs): prefill tokens/s (one call of --prompt tokens) and decode
 * tokens/s (--decode steps of one token), best of --reps runs, cpu backend, --threads threads;
 * plus the weight bytes one decoded token reads (k3_config_count: non-expert weights + top-k
 * experts of every MoE layer + one embedding row) and the implied GB/s as % of this machine's
 * STREAM triad for --threads threads, and the prefill's weight FLOPs (2 · active parameters per
 * token; attention not counted) as % of its fp32 FMA peak — both measured at start
 * (bench_limits.h), no constants.
 * Prints a table; writes JSON (--json FILE, default bench_forward.json).
 * Usage: bench_forward [--model DIR]... [--threads N] [--prompt N] [--decode N] [--reps N]
 *                      [--json FILE] [--kda-chunk C] */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>

#include "k3_layers.h"
#include "k3_model.h"
#include "layers/tiny_model.h"

#include "bench_limits.h"

typedef struct {
    double prefill_tok_s, decode_tok_s, decode_gbs, bytes_per_token, flops_per_token;
} bench_res;

static k3_backend *g_be;

static k3_status bench_one(const tiny_model *m, int n_prompt, int n_decode, int reps, int kda_chunk,
                           bench_res *r) {
    const k3_config *c = &m->cfg;
    k3_stage_params sp = {.cfg = c,
                          .w = m->view,
                          .be = g_be,
                          .layer_begin = 0,
                          .layer_end = c->n_layers,
                          .first = true,
                          .last = true,
                          .max_tokens = n_prompt,
                          .kda_chunk = kda_chunk};
    k3_stage *s = NULL;
    k3_seq_state *st = NULL;
    k3_activ act = {0};
    float *logits = NULL;
    int32_t *ids = NULL;
    k3_status e = k3_stage_create(&sp, &s);
    if (e == K3_OK) e = k3_seq_state_create(s, n_prompt + n_decode, &st);
    if (e == K3_OK) e = k3_activ_alloc(g_be, &act, c, n_prompt);
    if (e == K3_OK) e = k3_alloc((void **)&logits, sizeof(float) * (size_t)c->vocab_size, "logits");
    if (e == K3_OK)
        e = k3_alloc((void **)&ids, sizeof(int32_t) * (size_t)(n_prompt + n_decode), "ids");
    k3_rng rng;
    k3_rng_seed(&rng, 99);
    for (int i = 0; e == K3_OK && i < n_prompt + n_decode; i++)
        ids[i] = (int32_t)(k3_rng_u64(&rng) % (uint64_t)c->vocab_size);
    double best_p = 1e30, best_d = 1e30;
    for (int rep = 0; e == K3_OK && rep < reps; rep++) {
        e = k3_seq_state_reset(st);
        if (e != K3_OK) break;
        int32_t n = n_prompt;
        k3_batch b = {.n_seqs = 1, .states = &st, .n_tokens = &n, .token_ids = ids};
        double t0 = k3_now_s();
        e = k3_stage_forward(s, &b, &act, false, logits);
        double t1 = k3_now_s();
        for (int i = 0; e == K3_OK && i < n_decode; i++) {
            int32_t one = 1;
            k3_batch d = {
                .n_seqs = 1, .states = &st, .n_tokens = &one, .token_ids = ids + n_prompt + i};
            e = k3_stage_forward(s, &d, &act, false, logits);
        }
        double t2 = k3_now_s();
        best_p = K3_MIN(best_p, t1 - t0);
        best_d = K3_MIN(best_d, t2 - t1);
    }
    k3_config_counts cc;
    if (e == K3_OK) e = k3_config_count(c, &cc);
    if (e == K3_OK) {
        r->prefill_tok_s = n_prompt / best_p;
        r->decode_tok_s = n_decode / best_d;
        r->bytes_per_token = (double)cc.bytes_active;
        r->flops_per_token = 2.0 * (double)cc.params_active;
        r->decode_gbs = r->bytes_per_token * r->decode_tok_s / 1e9;
    }
    k3_free(ids);
    k3_free(logits);
    k3_activ_free(g_be, &act);
    k3_seq_state_destroy(st);
    k3_stage_destroy(s);
    return e;
}

int main(int argc, char **argv) {
    const char *models[8];
    int n_models = 0, threads = 2, n_prompt = 128, n_decode = 32, reps = 3, kda_chunk = 0;
    const char *json_path = "bench_forward.json";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench_forward: %s needs a value\n", a);
            return 2;
        }
        if (strcmp(a, "--model") == 0 && n_models < 8)
            models[n_models++] = v;
        else if (strcmp(a, "--threads") == 0)
            threads = atoi(v);
        else if (strcmp(a, "--prompt") == 0)
            n_prompt = atoi(v);
        else if (strcmp(a, "--decode") == 0)
            n_decode = atoi(v);
        else if (strcmp(a, "--reps") == 0)
            reps = atoi(v);
        else if (strcmp(a, "--kda-chunk") == 0)
            kda_chunk = atoi(v);
        else if (strcmp(a, "--json") == 0)
            json_path = v;
        else {
            fprintf(stderr, "bench_forward: unknown flag %s\n", a);
            return 2;
        }
        i++;
    }
    if (threads < 1 || n_prompt < 1 || n_decode < 1 || reps < 1) {
        fprintf(stderr, "bench_forward: --threads, --prompt, --decode, --reps must be >= 1\n");
        return 2;
    }
    if (k3_backend_create("cpu", &(k3_backend_params){.n_threads = threads}, &g_be) != K3_OK) {
        fprintf(stderr, "bench_forward: %s\n", k3_last_error());
        return 1;
    }
    const char *presets[2] = {"tiny", "small"};
    int n_runs = n_models ? n_models : 2;
    bench_limits lim;
    bench_measure_limits(threads, 5, 256, &lim);
    double roof = lim.triad_gbs;
    printf("measured with %d threads: triad %.1f GB/s, fp32 FMA peak %.1f GFLOP/s (%s)\n", threads,
           lim.triad_gbs, lim.fma_gflops, lim.fma_isa);
    cJSON *root = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(root, "results");
    cJSON_AddNumberToObject(root, "threads", threads);
    cJSON_AddNumberToObject(root, "prompt_tokens", n_prompt);
    cJSON_AddNumberToObject(root, "decode_tokens", n_decode);
    cJSON_AddNumberToObject(root, "triad_gbs", lim.triad_gbs);
    cJSON_AddNumberToObject(root, "fma_peak_gflops", lim.fma_gflops);
    cJSON_AddStringToObject(root, "backend", g_be->name);
    printf("%-28s %8s %12s %8s %12s %12s %10s %8s\n", "model", "layers", "prefill t/s", "% peak",
           "decode t/s", "MB/token", "GB/s", "% triad");
    int rc = 0;
    for (int i = 0; i < n_runs; i++) {
        tiny_model m;
        memset(&m, 0, sizeof m);
        k3_status e;
        char label[300];
        if (n_models) {
            e = tiny_open_dir(&m, models[i]);
            snprintf(label, sizeof label, "%s", models[i]);
        } else {
            char tmpl[] = "/tmp/k3-bench-XXXXXX";
            if (!mkdtemp(tmpl)) return 1;
            k3_preset p;
            k3_preset_parse(presets[i], &p);
            e = k3_make_tiny(tmpl, p, 1);
            if (e == K3_OK) e = tiny_open_dir(&m, tmpl);
            m.own_dir = true;
            snprintf(label, sizeof label, "%s (preset)", presets[i]);
        }
        bench_res r = {0};
        if (e == K3_OK) e = bench_one(&m, n_prompt, n_decode, reps, kda_chunk, &r);
        if (e != K3_OK) {
            fprintf(stderr, "bench_forward: %s: %s\n", label, k3_last_error());
            rc = 1;
        } else {
            double pf_gflops = r.prefill_tok_s * r.flops_per_token / 1e9;
            printf("%-28s %8d %12.1f %7.0f%% %12.1f %12.1f %10.2f %7.0f%%\n", label, m.cfg.n_layers,
                   r.prefill_tok_s, 100.0 * pf_gflops / lim.fma_gflops, r.decode_tok_s,
                   r.bytes_per_token / 1e6, r.decode_gbs, 100.0 * r.decode_gbs / roof);
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "model", label);
            cJSON_AddNumberToObject(o, "n_layers", m.cfg.n_layers);
            cJSON_AddNumberToObject(o, "hidden_size", (double)m.cfg.hidden_size);
            cJSON_AddNumberToObject(o, "prefill_tok_s", r.prefill_tok_s);
            cJSON_AddNumberToObject(o, "decode_tok_s", r.decode_tok_s);
            cJSON_AddNumberToObject(o, "decode_bytes_per_token", r.bytes_per_token);
            cJSON_AddNumberToObject(o, "decode_gbs", r.decode_gbs);
            cJSON_AddNumberToObject(o, "triad_fraction", r.decode_gbs / roof);
            cJSON_AddNumberToObject(o, "prefill_gflops", pf_gflops);
            cJSON_AddNumberToObject(o, "peak_fraction", pf_gflops / lim.fma_gflops);
            cJSON_AddItemToArray(arr, o);
        }
        tiny_close(&m);
    }
    if (bench_write_json(root, json_path, "bench_forward")) rc = 1;
    k3_backend_destroy(g_be);
    return rc;
}
