/* run.c — `k3 run` as a client of the engine (k3_run.h): the prompts of the command line
 * are submitted at once; the events give the tokens (and the logits for --dump-logits); the
 * results print as id lines + text, or one JSON object, and stream to a terminal as they come.
 * The engine opens with the caller's k3_engine_opts unchanged: capacity, grid and backend are
 * the shared engine flags' (launcher/engine_args.h), with the engine's defaults, as in every
 * other client. Usage errors (prompt ids outside the vocabulary, bad sampling parameters) are
 * checked on every rank before the engine opens, so every rank agrees on exit code 2. */
#include "k3_engine_test.h"
#include "k3_run.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "k3_comm.h"
#include "k3_model.h"

/* ---- prompts ------------------------------------------------------------------------------ */
k3_status k3_run_parse_prompts(const char *text, int32_t **ids, int64_t **lens, int *n_prompts) {
    *ids = NULL;
    *lens = NULL;
    *n_prompts = 0;
    size_t n = strlen(text);
    int np = 1;
    for (size_t i = 0; i < n; i++) np += text[i] == ';';
    K3_TRY(k3_alloc((void **)ids, (n / 2 + 2) * sizeof(int32_t), "prompt ids"));
    k3_status st = k3_calloc((void **)lens, (size_t)np * sizeof(int64_t), "prompt lengths");
    if (st != K3_OK) {
        k3_free(*ids);
        *ids = NULL;
        return st;
    }
    const char *p = text;
    int k = 0;
    int64_t tot = 0;
    while (1) {
        while (*p == ' ') p++;
        if (*p == ';' || *p == 0) {
            if ((*lens)[k] == 0) {
                st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d is empty", k + 1);
                goto fail;
            }
            if (*p == 0) break;
            k++;
            p++;
            continue;
        }
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d, id %lld: '%.12s' is not a token id",
                        k + 1, (long long)(*lens)[k] + 1, p);
            goto fail;
        }
        (*ids)[tot++] = (int32_t)v;
        (*lens)[k]++;
        p = end;
        while (*p == ' ') p++;
        if (*p == ',') {
            p++;
            while (*p == ' ') p++;
            if (*p == ';' || *p == 0) {
                st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d ends with ','", k + 1);
                goto fail;
            }
        } else if (*p != ';' && *p != 0) {
            st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d: unexpected '%c'", k + 1, *p);
            goto fail;
        }
    }
    *n_prompts = k + 1;
    return K3_OK;
fail:
    k3_free(*ids), k3_free(*lens);
    *ids = NULL, *lens = NULL;
    return st;
}

/* ---- results ------------------------------------------------------------------------------ */
uint64_t k3_run_seq_seed(uint64_t seed, int index) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * ((uint64_t)(uint32_t)index + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

const char *k3_run_finish_reason(k3_stop_kind stop) {
    return stop == K3_STOP_NONE ? "length" : "stop";
}

void k3_run_result_free(k3_run_result *res) {
    if (!res) return;
    for (int i = 0; i < res->n_seqs; i++) k3_free(res->seqs[i].gen), k3_free(res->seqs[i].text);
    k3_free(res->seqs);
    res->seqs = NULL;
    res->n_seqs = 0;
}

static k3_status write_npy(const char *path, const float *data, int64_t rows, int64_t cols) {
    char hdr[128];
    int n = snprintf(hdr, sizeof hdr,
                     "{'descr': '<f4', 'fortran_order': False, 'shape': (%lld, %lld), }",
                     (long long)rows, (long long)cols);
    int total = 10 + n + 1;
    int pad = (64 - total % 64) % 64;
    FILE *f = fopen(path, "wb");
    if (!f) return K3_ERR(K3_ERR_IO, "--dump-logits %s: %s", path, strerror(errno));
    uint16_t hl = (uint16_t)(n + pad + 1);
    unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
    bool ok = fwrite(magic, 1, 8, f) == 8 && fwrite(&hl, 2, 1, f) == 1 &&
              fwrite(hdr, 1, (size_t)n, f) == (size_t)n;
    for (int i = 0; i < pad && ok; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    ok = ok && fwrite(data, sizeof(float), (size_t)(rows * cols), f) == (size_t)(rows * cols);
    ok = (fclose(f) == 0) && ok;
    return ok ? K3_OK : K3_ERR(K3_ERR_IO, "--dump-logits %s: write failed", path);
}

static cJSON *ids_json(const int32_t *p, int64_t n) {
    cJSON *a = cJSON_CreateArray();
    for (int64_t i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(p[i]));
    return a;
}

typedef struct run_seq {
    int64_t id;
    const int32_t *prompt;
    int64_t P;
    int32_t *gen;
    int n_gen;
    k3_stop_kind stop;
    int stop_string;
    k3_tok_bytes text;
    float *dump; /* [P + n_new, V] with --dump-logits */
    int64_t dump_rows;
    bool done;
    char *error;
} run_seq;

/* Checks every rank makes the same way before the engine opens (exit 2 on all of them). */
static k3_status validate(const k3_engine_opts *eo, const k3_run_opts *o, int64_t *vocab) {
    if (o->n_prompts < 1 || o->n_new < 0)
        return K3_ERR(K3_ERR_ARG, "run: need at least one prompt and --n >= 0");
    k3_config cfg;
    K3_TRY(k3_config_load(eo->model_dir, &cfg));
    *vocab = cfg.vocab_size;
    int64_t tot = 0;
    for (int i = 0; i < o->n_prompts; i++)
        for (int64_t t = 0; t < o->prompt_lens[i]; t++, tot++)
            if (o->prompt_ids[tot] < 0 || o->prompt_ids[tot] >= cfg.vocab_size)
                return K3_ERR(K3_ERR_ARG,
                              "prompt %d: id %d at position %lld is not below vocab_size %lld",
                              i + 1, o->prompt_ids[tot], (long long)t, (long long)cfg.vocab_size);
    for (size_t i = 0; i < o->sampling.n_stop_ids; i++)
        if (o->sampling.stop_ids[i] < 0 || o->sampling.stop_ids[i] >= cfg.vocab_size)
            return K3_ERR(K3_ERR_ARG, "stop id %d is outside the vocabulary (vocab_size %lld)",
                          o->sampling.stop_ids[i], (long long)cfg.vocab_size);
    k3_sampler *probe = NULL; /* bad sampling parameters are a usage error every rank sees */
    k3_status st = k3_sampler_create(&probe, &o->sampling, cfg.vocab_size, eo->tok);
    k3_sampler_destroy(probe);
    return st;
}

typedef struct rank_row {
    int stage, lane;
    uint64_t bytes_read, plan_weight_bytes;
    double load_s;
} rank_row;

/* Throughput against the weights: decode GB/s = the weight bytes one token reads
 * (k3_config_count's bytes_active: non-expert weights, top-k experts, one embedding row) x decode
 * tok/s (with several sequences in a step the weights are read once for all, so this can pass
 * the bandwidth); prefill GFLOP/s = weight FLOPs / prefill time, 2 x active params per prompt
 * token less the embedding row and the LM head, + the LM head once per prompt (attention is not
 * counted: tests/bench/bench_forward counts it). */
typedef struct run_perf {
    bool ok;
    double bytes_per_token, decode_gbs, prefill_flops, prefill_gflops;
    double triad_frac, peak_frac; /* 0 without measured limits */
} run_perf;

static run_perf perf_of(const k3_engine_opts *eo, const k3_run_opts *o, double pre, double dec,
                        int64_t n_prompt_tok, int64_t n_dec) {
    run_perf p = {0};
    k3_config c;
    k3_config_counts cc;
    if (k3_config_load(eo->model_dir, &c) != K3_OK || k3_config_count(&c, &cc) != K3_OK) {
        k3_clear_error();
        return p;
    }
    const double D = (double)c.hidden_size, L = (double)c.vocab_size * D;
    const double body = (double)cc.params_active - D - (c.tie_word_embeddings ? 0 : L);
    p.ok = true;
    p.bytes_per_token = (double)cc.bytes_active;
    p.decode_gbs = dec > 0 ? p.bytes_per_token * (double)n_dec / dec / 1e9 : 0;
    p.prefill_flops = 2 * body * (double)n_prompt_tok + 2 * L * o->n_prompts;
    p.prefill_gflops = pre > 0 ? p.prefill_flops / pre / 1e9 : 0;
    if (o->limit_triad_gbs > 0) p.triad_frac = p.decode_gbs / o->limit_triad_gbs;
    if (o->limit_fma_gflops > 0) p.peak_frac = p.prefill_gflops / o->limit_fma_gflops;
    return p;
}

static void perf_json(cJSON *tm, const k3_run_opts *o, const run_perf *p) {
    if (!p->ok) return;
    cJSON_AddNumberToObject(tm, "decode_bytes_per_token", p->bytes_per_token);
    cJSON_AddNumberToObject(tm, "decode_gbs", p->decode_gbs);
    cJSON_AddNumberToObject(tm, "prefill_weight_flops", p->prefill_flops);
    cJSON_AddNumberToObject(tm, "prefill_gflops", p->prefill_gflops);
    if (o->limit_threads <= 0) return;
    cJSON_AddNumberToObject(tm, "limits_threads", o->limit_threads);
    cJSON_AddNumberToObject(tm, "triad_gbs", o->limit_triad_gbs);
    cJSON_AddNumberToObject(tm, "fma_peak_gflops", o->limit_fma_gflops);
    cJSON_AddNumberToObject(tm, "triad_fraction", p->triad_frac);
    cJSON_AddNumberToObject(tm, "peak_fraction", p->peak_frac);
}

static void perf_log(const k3_run_opts *o, const run_perf *p) {
    if (!p->ok) return;
    char tr[96] = "", pk[96] = "";
    if (o->limit_triad_gbs > 0)
        snprintf(tr, sizeof tr, " = %.0f%% of the measured triad %.1f GB/s", 100 * p->triad_frac,
                 o->limit_triad_gbs);
    if (o->limit_fma_gflops > 0)
        snprintf(pk, sizeof pk, " = %.0f%% of the measured fp32 FMA peak %.1f GFLOP/s",
                 100 * p->peak_frac, o->limit_fma_gflops);
    K3_LOGI("decode %.2f GB/s of weights (%.1f MB a token)%s; prefill %.2f GFLOP/s of weight "
            "FLOPs%s%s",
            p->decode_gbs, p->bytes_per_token / 1e6, tr, p->prefill_gflops, pk,
            o->limit_threads > 0 ? "" : " (--bench-limits: as % of this machine's limits)");
}

static void print_json(const k3_engine_opts *eo, const k3_run_opts *o, const run_seq *s,
                       const k3_engine_stats *es, const rank_row *ranks, double load_s, double pre,
                       double dec, int64_t n_prompt_tok, int64_t n_dec) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "prompt_ids", ids_json(s[0].prompt, s[0].P));
    cJSON_AddItemToObject(root, "generated_ids", ids_json(s[0].gen, s[0].n_gen));
    if (eo->tok) cJSON_AddStringToObject(root, "text", s[0].text.data ? s[0].text.data : "");
    cJSON_AddStringToObject(root, "finish_reason", k3_run_finish_reason(s[0].stop));
    cJSON *res = cJSON_AddArrayToObject(root, "results");
    for (int i = 0; i < o->n_prompts; i++) {
        cJSON *it = cJSON_CreateObject();
        cJSON_AddItemToObject(it, "prompt_ids", ids_json(s[i].prompt, s[i].P));
        cJSON_AddItemToObject(it, "generated_ids", ids_json(s[i].gen, s[i].n_gen));
        if (eo->tok) cJSON_AddStringToObject(it, "text", s[i].text.data ? s[i].text.data : "");
        cJSON_AddStringToObject(it, "finish_reason", k3_run_finish_reason(s[i].stop));
        cJSON_AddItemToArray(res, it);
    }
    cJSON *tm = cJSON_AddObjectToObject(root, "timings");
    cJSON_AddNumberToObject(tm, "load_s", load_s);
    cJSON_AddNumberToObject(tm, "prefill_s", pre);
    cJSON_AddNumberToObject(tm, "decode_s", dec);
    cJSON_AddNumberToObject(tm, "prefill_tok_s", pre > 0 ? n_prompt_tok / pre : 0);
    cJSON_AddNumberToObject(tm, "decode_tok_s", dec > 0 ? n_dec / dec : 0);
    run_perf perf = perf_of(eo, o, pre, dec, n_prompt_tok, n_dec);
    perf_json(tm, o, &perf);
    cJSON *d = cJSON_AddObjectToObject(root, "dist");
    cJSON_AddNumberToObject(d, "world", es->world);
    cJSON_AddNumberToObject(d, "pp", es->pp);
    cJSON_AddNumberToObject(d, "ep", es->ep);
    cJSON_AddStringToObject(d, "coordinator", es->dedicated ? "dedicated" : "shared");
    cJSON_AddBoolToObject(d, "deterministic", eo->deterministic);
    char hx[24];
    snprintf(hx, sizeof hx, "%016llx", (unsigned long long)es->plan_hash);
    cJSON_AddStringToObject(d, "plan_hash", hx);
    cJSON_AddNumberToObject(d, "micro_batches", es->micro_batches);
    cJSON_AddNumberToObject(d, "max_seqs", es->max_seqs);
    cJSON_AddNumberToObject(d, "max_ctx", (double)es->max_ctx);
    cJSON_AddNumberToObject(d, "max_batch_tokens", (double)es->max_batch_tokens);
    cJSON_AddNumberToObject(d, "logits_bytes", (double)es->logits_bytes);
    cJSON_AddNumberToObject(d, "logits_messages", es->logits_messages);
    cJSON_AddStringToObject(d, "combine", eo->deterministic ? "per-item" : "presum");
    cJSON_AddStringToObject(d, "comm", eo->comm ? eo->comm : "mpi");
    cJSON_AddNumberToObject(d, "moe_dispatch_bytes", (double)es->moe_dispatch_bytes);
    cJSON_AddNumberToObject(d, "moe_combine_bytes", (double)es->moe_combine_bytes);
    cJSON_AddNumberToObject(d, "steps", (double)es->steps);
    cJSON_AddNumberToObject(d, "moe_bytes_per_step",
                            es->steps ? (double)(es->moe_dispatch_bytes + es->moe_combine_bytes) /
                                            (double)es->steps
                                      : 0.0);
    cJSON *st = cJSON_AddArrayToObject(d, "stages");
    for (int k = 0; k < es->pp && k < 64; k++) {
        cJSON *a = cJSON_CreateArray();
        cJSON_AddItemToArray(a, cJSON_CreateNumber(es->stages[2 * k]));
        cJSON_AddItemToArray(a, cJSON_CreateNumber(es->stages[2 * k + 1]));
        cJSON_AddItemToArray(st, a);
    }
    cJSON *rk = cJSON_AddArrayToObject(d, "ranks");
    for (int i = 0; i < es->world; i++) {
        const rank_row *w = &ranks[i];
        cJSON *it = cJSON_CreateObject();
        cJSON_AddNumberToObject(it, "rank", i);
        cJSON_AddNumberToObject(it, "stage", w->stage);
        cJSON_AddNumberToObject(it, "lane", w->lane);
        cJSON_AddNumberToObject(it, "bytes_read", (double)w->bytes_read);
        cJSON_AddNumberToObject(it, "plan_weight_bytes", (double)w->plan_weight_bytes);
        cJSON_AddNumberToObject(it, "load_s", w->load_s);
        if (i < 256) { /* memory at close (k3_engine_stats) */
            cJSON_AddNumberToObject(it, "rss_bytes", (double)es->rss_bytes[i]);
            cJSON_AddNumberToObject(it, "peak_rss_bytes", (double)es->hwm_bytes[i]);
            cJSON_AddNumberToObject(it, "pss_bytes", (double)es->pss_bytes[i]);
        }
        cJSON_AddItemToArray(rk, it);
    }
    char *txt = cJSON_PrintUnformatted(root);
    if (txt) printf("%s\n", txt);
    cJSON_free(txt);
    cJSON_Delete(root);
}

/* Rank 0: submit every prompt, step until all are done; fills s[]. *t_in = when the last prompt
 * was in (its first token, or its end without one: with continuous batching, later prompts are
 * prefilled while earlier ones decode), *n_gen_in = tokens generated by then. Returns 1 when a
 * request failed (its error printed), 0 otherwise. */
static int drive(k3_engine *e, const k3_engine_opts *eo, const k3_run_opts *o, run_seq *s,
                 int64_t V, bool stream, double *t_in, int64_t *n_gen_in) {
    int n_in = 0;
    int64_t n_gen_all = 0;
    for (int i = 0; i < o->n_prompts; i++) {
        k3_request rq = {.ids = s[i].prompt,
                         .n_ids = s[i].P,
                         .max_tokens = o->n_new,
                         .sampling = o->sampling,
                         .ignore_eos = o->ignore_eos,
                         .keep_logits = o->dump_logits != NULL,
                         .all_logits = o->dump_logits != NULL,
                         .user = (uint64_t)i};
        rq.sampling.seed = k3_run_seq_seed(o->sampling.seed, i);
        if (k3_engine_submit(e, &rq, &s[i].id) != K3_OK) {
            fprintf(stderr, "k3 run: prompt %d: %s\n", i + 1, k3_last_error());
            return 1;
        }
    }
    int left = o->n_prompts, failed = 0;
    while (left > 0) {
        const k3_event *ev;
        int n;
        if (k3_engine_step(e, &ev, &n) != K3_OK) {
            if (k3_engine_failed(e)) k3_engine_abort(e); /* the job ends, the rank named */
            fprintf(stderr, "k3 run: %s\n", k3_last_error());
            return 1;
        }
        if (n == 0 && k3_engine_pending(e) == 0) break;
        for (int k = 0; k < n; k++) {
            run_seq *q = &s[ev[k].user];
            if (ev[k].prompt_logits && q->dump) {
                memcpy(q->dump, ev[k].prompt_logits,
                       (size_t)(ev[k].n_prompt_rows * V) * sizeof(float));
                q->dump_rows = ev[k].n_prompt_rows;
            }
            if (ev[k].n_text) {
                if (eo->tok && k3_tok_bytes_append(&q->text, ev[k].text, ev[k].n_text) != K3_OK)
                    return 1;
                if (stream) {
                    fwrite(ev[k].text, 1, ev[k].n_text, stdout);
                    fflush(stdout);
                }
            }
            if ((ev[k].kind == K3_EV_TOKEN && q->n_gen == 0) ||
                (ev[k].kind != K3_EV_TOKEN && q->n_gen == 0 && !q->done)) {
                n_gen_all += ev[k].kind == K3_EV_TOKEN;
                if (++n_in == o->n_prompts) *t_in = k3_now_s(), *n_gen_in = n_gen_all;
            } else if (ev[k].kind == K3_EV_TOKEN) {
                n_gen_all++;
            }
            if (ev[k].kind == K3_EV_TOKEN) {
                /* the dump holds every consumed row: a token's row after the first one */
                if (q->dump && q->n_gen > 0 && ev[k].logits) {
                    memcpy(q->dump + q->dump_rows * V, ev[k].logits, (size_t)V * sizeof(float));
                    q->dump_rows++;
                }
                q->gen[q->n_gen++] = ev[k].token;
            } else if (ev[k].kind == K3_EV_DONE) {
                q->stop = ev[k].stop;
                q->stop_string = ev[k].stop_string;
                q->done = true;
                left--;
            } else {
                fprintf(stderr, "k3 run: prompt %d: %s\n", (int)ev[k].user + 1, ev[k].error);
                q->done = true;
                failed = 1;
                left--;
            }
        }
    }
    return failed;
}

int k3_run_generate(const k3_engine_opts *eo, const k3_run_opts *o) {
    int rank = 0, world = 1;
    k3_comm_world(&rank, &world);
    int64_t V = 0;
    k3_status vs = validate(eo, o, &V);
    int local = vs == K3_OK ? 0 : (vs == K3_ERR_ARG ? 1 : 2), worst = 0;
    if (k3_comm_world_max(local, &worst, eo->comm_timeout_s > 0 ? eo->comm_timeout_s : 600) !=
        K3_OK)
        k3_comm_world_abort(1);
    if (local == 2 || (local == 1 && rank == 0)) fprintf(stderr, "k3 run: %s\n", k3_last_error());
    if (worst) return worst == 1 ? 2 : 1;
    k3_engine *e = NULL;
    k3_status ost = k3_engine_open_test(eo, k3_engine_test_from_env(), &e);
    if (ost != K3_OK && e) k3_engine_abort(e); /* a fatal fault: the job ends, the rank named */
    if (ost != K3_OK) return ost == K3_ERR_ARG ? 2 : 1;
    if (!k3_engine_is_coordinator(e)) {
        if (k3_engine_serve(e) != K3_OK) k3_engine_abort(e); /* serves, then closes */
        return 0;
    }
    int rc = 0;
    run_seq *s = calloc((size_t)o->n_prompts, sizeof *s);
    rc = s ? 0 : 1;
    const int32_t *p = o->prompt_ids;
    for (int i = 0; i < o->n_prompts && !rc; i++) {
        s[i].prompt = p;
        s[i].P = o->prompt_lens[i];
        p += s[i].P;
        s[i].stop_string = -1;
        s[i].gen = calloc((size_t)K3_MAX(o->n_new, 1), sizeof(int32_t));
        if (!s[i].gen) rc = 1;
        if (o->dump_logits && !rc) {
            s[i].dump = malloc((size_t)(s[i].P + o->n_new) * (size_t)V * sizeof(float));
            if (!s[i].dump) rc = 1;
        }
    }
    bool stream = !rc && o->n_prompts == 1 && eo->tok && !o->json && !o->quiet && isatty(1);
    double t0 = k3_now_s(), t_in = 0;
    int64_t n_gen_in = 0;
    if (!rc) rc = drive(e, eo, o, s, V, stream, &t_in, &n_gen_in);
    double t_end = k3_now_s();
    rank_row *ranks = calloc((size_t)world, sizeof *ranks);
    for (int i = 0; ranks && i < world; i++)
        k3_engine_rank_info(e, i, &ranks[i].stage, &ranks[i].lane, &ranks[i].bytes_read,
                            &ranks[i].plan_weight_bytes, &ranks[i].load_s);
    k3_engine_stats es;
    if (k3_engine_close(e, &es) != K3_OK) k3_engine_abort(e);
    e = NULL;
    if (!rc && es.op_stats_rc) rc = 1; /* --op-stats FILE not written (printed) */
    if (!rc && o->dump_logits) {
        int64_t rows = 0;
        for (int i = 0; i < o->n_prompts; i++) rows += s[i].dump_rows;
        float *all = malloc((size_t)K3_MAX(rows, 1) * (size_t)V * sizeof(float));
        int64_t off = 0;
        for (int i = 0; all && i < o->n_prompts; i++) {
            memcpy(all + off * V, s[i].dump, (size_t)(s[i].dump_rows * V) * sizeof(float));
            off += s[i].dump_rows;
        }
        k3_status ws = all ? write_npy(o->dump_logits, all, rows, V)
                           : K3_ERR(K3_ERR_NOMEM, "logits dump of %lld rows", (long long)rows);
        free(all);
        if (ws != K3_OK) {
            fprintf(stderr, "k3 run: %s\n", k3_last_error());
            rc = 1;
        }
    }
    int64_t n_prompt_tok = 0, n_gen_tok = 0;
    for (int i = 0; i < o->n_prompts; i++) n_prompt_tok += s[i].P, n_gen_tok += s[i].n_gen;
    /* prefill: until every prompt is in (later prompts overlap the decode of earlier ones);
       decode: the rest, and the tokens generated in it */
    double pre = (t_in > 0 ? t_in : t_end) - t0, dec = t_end - (t_in > 0 ? t_in : t_end);
    int64_t n_dec = t_in > 0 ? n_gen_tok - n_gen_in : 0;
    if (!rc && o->result) {
        k3_run_result *res = o->result;
        res->seqs = calloc((size_t)o->n_prompts, sizeof *res->seqs);
        res->n_seqs = res->seqs ? o->n_prompts : 0;
        for (int i = 0; i < res->n_seqs; i++) {
            k3_run_seq_result *d = &res->seqs[i];
            d->gen = s[i].gen;
            s[i].gen = NULL;
            d->n_gen = s[i].n_gen;
            d->stop = s[i].stop;
            d->stop_string = s[i].stop_string;
            if (eo->tok) {
                d->text = malloc(s[i].text.n + 1);
                if (d->text) {
                    if (s[i].text.n) memcpy(d->text, s[i].text.data, s[i].text.n);
                    d->text[s[i].text.n] = 0;
                    d->n_text = s[i].text.n;
                }
            }
        }
    }
    if (rc) {
        /* nothing more to print */
    } else if (o->quiet) {
        K3_LOGI("load %.2f s, prefill %.3f s, decode %.3f s", es.load_s, pre, dec);
    } else if (o->json) {
        if (ranks) print_json(eo, o, s, &es, ranks, es.load_s, pre, dec, n_prompt_tok, n_dec);
    } else {
        /* per prompt: one line of ids, then (with a tokenizer) the decoded text */
        if (stream) printf("\n");
        for (int i = 0; i < o->n_prompts; i++) {
            for (int k = 0; k < s[i].n_gen; k++) printf("%s%d", k ? "," : "", s[i].gen[k]);
            printf("\n");
            if (eo->tok && !stream) printf("%s\n", s[i].text.data ? s[i].text.data : "");
        }
        K3_LOGI("load %.2f s, prefill %.3f s (%.1f tok/s), decode %.3f s (%.1f tok/s), logits %.2f "
                "MB in %d messages",
                es.load_s, pre, pre > 0 ? n_prompt_tok / pre : 0.0, dec,
                dec > 0 ? n_dec / dec : 0.0, es.logits_bytes / 1e6, es.logits_messages);
        run_perf perf = perf_of(eo, o, pre, dec, n_prompt_tok, n_dec);
        perf_log(o, &perf);
        if (es.ep > 1)
            K3_LOGI(
                "MoE exchange (%s combine): dispatch %llu B, combine %llu B, %.0f B per step "
                "(%lld steps)",
                eo->deterministic ? "deterministic per-item" : "pre-summed",
                (unsigned long long)es.moe_dispatch_bytes, (unsigned long long)es.moe_combine_bytes,
                es.steps ? (double)(es.moe_dispatch_bytes + es.moe_combine_bytes) / (double)es.steps
                         : 0.0,
                (long long)es.steps);
    }
    fflush(stdout);
    for (int i = 0; s && i < o->n_prompts; i++) {
        free(s[i].gen), free(s[i].dump);
        k3_tok_bytes_free(&s[i].text);
    }
    free(s);
    free(ranks);
    return rc;
}
