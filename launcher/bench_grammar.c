/* bench_grammar.c — `k3 bench grammar --vocab FILE.tiktoken [--model DIR]`: what structured
 * outputs cost per decode step at K3's vocabulary size, beside the model's own decode step.
 *
 * The vocabulary: the file's first 163,584 ranks + the 256 K3 specials = 163,840 ids (o200k_base
 * stands in for K3's). For real tool schemas and response formats: compile time (cold, then a
 * cache hit), the grammar's size, and along random walks (random logits, greedy: a random model)
 * the time of the matcher's mask and of the sampler's whole step with the grammar and without it
 * (median, p99, µs). With --model, the decode step time of that checkpoint on this machine (one
 * sequence, greedy, the median gap between tokens) is printed beside it. A markdown table on
 * stdout, --output-json. */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "chat_job.h"
#include "engine_args.h"
#include "k3_comm.h"
#include "k3_grammar.h"

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Name, then the spec as JSON: tool_choice + tools, or schema / json_object / regex. */
static const char *const CASES[][2] = {
    {"tools: weather, search, calendar (required)",
     "{\"tool_choice\":\"required\",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":"
     "\"get_weather\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":"
     "\"string\"},\"days\":{\"type\":\"integer\"},\"unit\":{\"enum\":[\"c\",\"f\"]}},\"required\":["
     "\"city\"]}}},{\"type\":\"function\",\"function\":{\"name\":\"search\",\"parameters\":{"
     "\"type\":"
     "\"object\",\"properties\":{\"q\":{\"type\":\"string\"},\"n\":{\"type\":[\"integer\",\"null\"]"
     "}},"
     "\"required\":[\"q\"]}}},{\"type\":\"function\",\"function\":{\"name\":\"create_event\","
     "\"parameters\":{\"type\":\"object\",\"properties\":{\"title\":{\"type\":\"string\"},"
     "\"start\":{"
     "\"type\":\"string\",\"format\":\"date-time\"},\"attendees\":{\"type\":\"array\",\"items\":{"
     "\"type\":\"object\",\"properties\":{\"email\":{\"type\":\"string\"}},\"required\":[\"email\"]"
     "}}},"
     "\"required\":[\"title\",\"start\"]}}}]}"},
    {"json_schema: order (nested, enums, arrays)",
     "{\"schema\":{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"string\",\"pattern\":"
     "\"^[A-Z]{3}-[0-9]{4}$\"},\"items\":{\"type\":\"array\",\"items\":{\"type\":\"object\","
     "\"properties\":{\"sku\":{\"type\":\"string\"},\"qty\":{\"type\":\"integer\"},\"price\":{"
     "\"type\":\"number\"}},\"required\":[\"sku\",\"qty\"]}},\"status\":{\"enum\":[\"pending\","
     "\"shipped\"]},\"note\":{\"type\":[\"string\",\"null\"]}},\"required\":[\"id\",\"items\","
     "\"status\"]}}"},
    {"json_object", "{\"json_object\":true}"},
    {"regex: [a-z]+@[a-z]+\\.com", "{\"regex\":\"[a-z]+@[a-z]+\\\\.com\"}"},
};
#define N_CASES ((int)(sizeof CASES / sizeof CASES[0]))
#define STEPS   1024 /* timed steps per case (walks of at most 256) */

typedef struct g_row {
    k3_grammar_info gi;
    double compile_ms, hit_us, mask[2], with[2], without[2]; /* [median, p99] */
    int steps;
} g_row;

static void stats(double *t, int n, double out[2]) {
    qsort(t, (size_t)n, sizeof *t, cmp_d);
    out[0] = n ? t[n / 2] : 0;
    out[1] = n ? t[(int)(0.99 * (n - 1))] : 0;
}

static k3_status spec_of(const k3_chat_json *j, k3_grammar_spec *s) {
    const k3_chat_json *tc = k3_chat_json_get(j, "tool_choice"), *rx = k3_chat_json_get(j, "regex");
    *s = (k3_grammar_spec){.what = "bench",
                           .tools = k3_chat_json_get(j, "tools"),
                           .content = tc ? K3_GC_NONE : K3_GC_JSON,
                           .tools_mode = tc ? K3_GT_REQUIRED : K3_GT_NONE,
                           .schema = k3_chat_json_get(j, "schema")};
    if (rx) s->content = K3_GC_REGEX, s->regex = rx->s;
    return K3_OK;
}

/* One case: compile, cache hit, walks. */
static k3_status run_case(k3_grammar_cache *cache, int c, int64_t V, float *logits, g_row *row) {
    k3_chat_json *j = NULL;
    K3_TRY(k3_chat_json_parse(CASES[c][1], strlen(CASES[c][1]), "case", &j));
    k3_grammar_spec s;
    spec_of(j, &s);
    k3_grammar *g = NULL, *g2 = NULL;
    bool hit;
    double t0 = k3_now_s();
    k3_status st = k3_grammar_cache_get(cache, &s, &g, &hit);
    row->compile_ms = (k3_now_s() - t0) * 1e3;
    t0 = k3_now_s();
    if (st == K3_OK) st = k3_grammar_cache_get(cache, &s, &g2, &hit);
    row->hit_us = (k3_now_s() - t0) * 1e6;
    k3_grammar_release(g2);
    double *tm = malloc(3 * STEPS * sizeof *tm);
    uint64_t *mask = malloc((size_t)(V + 63) / 64 * 8);
    if (st == K3_OK && (!tm || !mask)) st = K3_ERR(K3_ERR_NOMEM, "bench grammar");
    k3_rng r;
    k3_rng_seed(&r, 1234 + (uint64_t)c);
    int n = 0;
    while (st == K3_OK && n < STEPS) {
        k3_sampler *sg = NULL, *sp = NULL;
        k3_matcher *m = NULL;
        k3_sampler_params pg = {.temperature = 0, .grammar = g}, pp = {.temperature = 0};
        st = k3_sampler_create(&sg, &pg, V, NULL);
        if (st == K3_OK) st = k3_sampler_create(&sp, &pp, V, NULL);
        if (st == K3_OK) st = k3_matcher_create(g, &m);
        for (int step = 0; st == K3_OK && step < 256 && n < STEPS; step++) {
            for (int64_t i = 0; i < V; i++) logits[i] = (float)k3_rng_uniform(&r);
            int32_t id, id2;
            double a = k3_now_s();
            st = k3_matcher_mask(m, mask);
            double b = k3_now_s();
            if (st == K3_OK) st = k3_sampler_sample(sg, logits, &id);
            double cc = k3_now_s();
            if (st == K3_OK) st = k3_sampler_sample(sp, logits, &id2);
            double d = k3_now_s();
            tm[n] = (b - a) * 1e6, tm[STEPS + n] = (cc - b) * 1e6,
            tm[2 * STEPS + n] = (d - cc) * 1e6;
            n++;
            k3_stop_kind stop;
            if (st == K3_OK) st = k3_sampler_accept(sg, id, NULL, &stop);
            if (st == K3_OK) st = k3_matcher_accept(m, id);
            if (st != K3_OK || k3_matcher_done(m)) break;
        }
        k3_sampler_destroy(sg), k3_sampler_destroy(sp), k3_matcher_destroy(m);
    }
    if (st == K3_OK) {
        k3_grammar_get_info(g, &row->gi);
        row->steps = n;
        stats(tm, n, row->mask);
        stats(tm + STEPS, n, row->with);
        stats(tm + 2 * STEPS, n, row->without);
    }
    free(tm), free(mask);
    k3_grammar_release(g);
    k3_chat_json_free(j);
    return st;
}

/* The decode step of a checkpoint here: one sequence, greedy, the median gap between tokens. */
static k3_status decode_step(const k3_args *a, double *ms) {
    k3_engine_opts eo = {.name = "k3 bench grammar"};
    if (k3_engine_args(a, true, &eo) != 0) return K3_ERR(K3_ERR_ARG, "engine flags");
    eo.model_dir = k3_args_str(a, "model");
    k3_engine *e = NULL;
    K3_TRY(k3_engine_open(&eo, &e));
    int32_t ids[16];
    for (int i = 0; i < 16; i++) ids[i] = 100 + i;
    k3_request rq = {.ids = ids, .n_ids = 16, .max_tokens = 40, .ignore_eos = true};
    int64_t id;
    double t[64], last = 0;
    int n = 0;
    k3_status st = k3_engine_submit(e, &rq, &id);
    while (st == K3_OK && k3_engine_pending(e)) {
        const k3_event *ev;
        int nev;
        st = k3_engine_step(e, &ev, &nev);
        for (int i = 0; st == K3_OK && i < nev; i++)
            if (ev[i].kind == K3_EV_TOKEN) {
                double now = k3_now_s();
                if (last > 0 && n < 64) t[n++] = (now - last) * 1e3; /* the first gap is prefill */
                last = now;
            } else if (ev[i].kind == K3_EV_ERROR) {
                st = K3_ERR(K3_ERR_STATE, "decode: %s", ev[i].error);
            }
    }
    if (k3_engine_failed(e)) k3_engine_abort(e);
    k3_engine_stats fin;
    if (k3_engine_close(e, &fin) != K3_OK) k3_engine_abort(e);
    qsort(t, (size_t)n, sizeof *t, cmp_d);
    *ms = n ? t[n / 2] : 0;
    return st;
}

/* The rank file cut to K3's layout: ranks [0, 163584) in a temporary file (*tmp). */
static k3_status cut_vocab(const char *path, int64_t n_ranks, char *tmp) {
    int fd = mkstemp(tmp);
    FILE *in = fopen(path, "r"), *o = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!in || !o) {
        if (in) fclose(in);
        if (o) fclose(o);
        return K3_ERR(K3_ERR_IO, "--vocab %s: cannot read it (or write %s)", path, tmp);
    }
    char line[1024];
    while (fgets(line, sizeof line, in)) {
        const char *sp = strchr(line, ' ');
        if (sp && atoll(sp + 1) < n_ranks) fputs(line, o);
    }
    fclose(in);
    fclose(o);
    return K3_OK;
}

int bench_grammar(const k3_args *a) {
    const char *vpath = k3_args_str(a, "vocab"), *model = k3_args_str(a, "model");
    if (!vpath) {
        fprintf(stderr, "k3 bench grammar: --vocab FILE.tiktoken is required\n");
        return 2;
    }
    const int64_t V = 163840;
    char tmp[] = "/tmp/k3_bench_grammar_XXXXXX";
    k3_tokenizer *tok = NULL;
    k3_grammar_cache *cache = NULL;
    float *logits = malloc((size_t)V * sizeof *logits);
    g_row rows[N_CASES];
    memset(rows, 0, sizeof rows);
    double step_ms = 0;
    k3_status st =
        logits ? cut_vocab(vpath, V - K3_TOK_N_K3_SPECIALS, tmp) : K3_ERR(K3_ERR_NOMEM, "logits");
    if (st == K3_OK) st = k3_tok_create_tiktoken(&tok, tmp, NULL, K3_TOK_K3_LAYOUT, NULL);
    unlink(tmp);
    if (st == K3_OK && k3_tok_n_vocab(tok) != V)
        st = K3_ERR(K3_ERR_ARG,
                    "--vocab %s: %lld ids with the K3 specials, not %lld (too few ranks)", vpath,
                    (long long)k3_tok_n_vocab(tok), (long long)V);
    double t0 = k3_now_s();
    if (st == K3_OK) st = k3_job_grammar_cache(tok, V, &cache);
    double index_ms = (k3_now_s() - t0) * 1e3;
    for (int c = 0; st == K3_OK && c < N_CASES; c++) st = run_case(cache, c, V, logits, &rows[c]);
    if (st == K3_OK && model) {
        st = k3_comm_init(); /* a world of one without mpirun */
        int rank = 0, world = 1;
        k3_comm_world(&rank, &world);
        if (st == K3_OK && world != 1)
            st = K3_ERR(K3_ERR_ARG, "run k3 bench grammar as one process (not under mpirun)");
        if (st == K3_OK) st = decode_step(a, &step_ms);
        k3_comm_finalize();
    }
    if (st != K3_OK) {
        fprintf(stderr, "k3 bench grammar: %s\n", k3_last_error());
    } else {
        printf("vocabulary: %lld ids (trie built in %.0f ms)%s", (long long)V, index_ms,
               model ? "" : "\n");
        if (model) printf("; decode step of %s here: %.2f ms (median of 39)\n", model, step_ms);
        printf("\n| case | states | masked states | masks MB | compile ms | cache hit µs | steps | "
               "mask µs median | mask µs p99 | sample µs with grammar (median / p99) | sample µs "
               "without (median / p99) |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
        k3_chat_buf js = {0};
        char buf[1024];
        snprintf(buf, sizeof buf,
                 "{\"vocab\":%lld,\"trie_ms\":%.3f,\"decode_step_ms\":%.4f,\"cases\":[",
                 (long long)V, index_ms, step_ms);
        k3_chat_buf_puts(&js, buf);
        for (int c = 0; c < N_CASES; c++) {
            const g_row *w = &rows[c];
            printf("| %s | %lld | %lld | %.1f | %.1f | %.1f | %d | %.1f | %.1f | %.0f / %.0f | "
                   "%.0f / %.0f |\n",
                   CASES[c][0], (long long)w->gi.n_states, (long long)w->gi.n_masked_states,
                   w->gi.mask_bytes / 1e6, w->compile_ms, w->hit_us, w->steps, w->mask[0],
                   w->mask[1], w->with[0], w->with[1], w->without[0], w->without[1]);
            k3_chat_buf_puts(&js, c ? ",{\"case\":" : "{\"case\":");
            k3_chat_json_dump_str(CASES[c][0], strlen(CASES[c][0]), &js);
            snprintf(buf, sizeof buf,
                     ",\"states\":%lld,\"masked_states\":%lld,\"mask_bytes\":%lld,\"compile_ms\":"
                     "%.3f,\"cache_hit_us\":%.3f,\"steps\":%d,\"mask_us_median\":%.3f,"
                     "\"mask_us_p99\":%.3f,\"sample_us_grammar_median\":%.3f,"
                     "\"sample_us_grammar_p99\":%.3f,\"sample_us_plain_median\":%.3f,"
                     "\"sample_us_plain_p99\":%.3f}",
                     (long long)w->gi.n_states, (long long)w->gi.n_masked_states,
                     (long long)w->gi.mask_bytes, w->compile_ms, w->hit_us, w->steps, w->mask[0],
                     w->mask[1], w->with[0], w->with[1], w->without[0], w->without[1]);
            k3_chat_buf_puts(&js, buf);
        }
        k3_chat_buf_puts(&js, "]}\n");
        const char *out = k3_args_str(a, "output-json");
        FILE *f = out ? fopen(out, "w") : NULL;
        if (out && !f) st = K3_ERR(K3_ERR_IO, "--output-json %s: cannot write it", out);
        if (f) fputs(js.p, f), fclose(f);
        if (st != K3_OK) fprintf(stderr, "k3 bench grammar: %s\n", k3_last_error());
        k3_chat_buf_free(&js);
    }
    free(logits);
    k3_grammar_cache_destroy(cache);
    k3_tok_destroy(tok);
    return st == K3_OK ? 0 : 1;
}
