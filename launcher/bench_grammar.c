/* bench_grammar.c — `k3 bench grammar --model VOCAB.tiktoken|DIR`: the structured-output grammar's costs at a
 * full vocabulary: compile time per schema (cold, then a cache hit), and the mask time per
 * decode step (median, p99 in µs) along random walks (random logits among the allowed ids), for
 * real tool schemas and response formats. The vocabulary is the file's ranks plus the K3
 * specials, padded to --vocab ids (default 163,840, K3's). A markdown table on stdout and
 * --output-json. Compare with the model's decode step time (`k3 bench -p 1 -n 32`). */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "chat_job.h"
#include "k3_grammar.h"

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static const char *const CASES[][2] = {
    {"tools: weather+search+calendar (required)",
     "{\"tool_choice\":\"required\",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
     "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":"
     "\"integer\"},\"unit\":{\"enum\":[\"c\",\"f\"]}},\"required\":[\"city\"]}}},{\"type\":\"function\","
     "\"function\":{\"name\":\"search\",\"parameters\":{\"type\":\"object\",\"properties\":{\"q\":{\"type\":"
     "\"string\"},\"n\":{\"type\":[\"integer\",\"null\"]}},\"required\":[\"q\"]}}},{\"type\":\"function\","
     "\"function\":{\"name\":\"create_event\",\"parameters\":{\"type\":\"object\",\"properties\":{\"title\":"
     "{\"type\":\"string\"},\"start\":{\"type\":\"string\",\"format\":\"date-time\"},\"attendees\":{\"type\":"
     "\"array\",\"items\":{\"type\":\"object\",\"properties\":{\"email\":{\"type\":\"string\"}},\"required\":"
     "[\"email\"]}}},\"required\":[\"title\",\"start\"]}}}]}"},
    {"json_schema: order (nested, enums, arrays)",
     "{\"schema\":{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{3}-[0-9]{4}$\"},"
     "\"items\":{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{\"sku\":{\"type\":\"string\"},"
     "\"qty\":{\"type\":\"integer\"},\"price\":{\"type\":\"number\"}},\"required\":[\"sku\",\"qty\"]}},"
     "\"status\":{\"enum\":[\"pending\",\"shipped\"]},\"note\":{\"type\":[\"string\",\"null\"]}},"
     "\"required\":[\"id\",\"items\",\"status\"]}}"},
    {"json_object", "{\"json_object\":true}"},
    {"regex: [a-z]+@[a-z]+\\.com", "{\"regex\":\"[a-z]+@[a-z]+\\\\.com\"}"},
};

int bench_grammar(const k3_args *a) {
    const char *mdl = k3_args_str(a, "model");
    if (!mdl || !*mdl) {
        fprintf(stderr, "k3 bench grammar: --model VOCAB.tiktoken (or a model directory) is required\n");
        return 2;
    }
    char path[4096];
    size_t nm = strlen(mdl);
    snprintf(path, sizeof path, "%s%s", mdl,
             nm > 9 && !strcmp(mdl + nm - 9, ".tiktoken") ? "" : "/tiktoken.model");
    const int64_t V = 163840;
    /* K3's layout: ranks [0, 163584) then 256 specials; a larger rank file (o200k) is cut */
    char tmp[] = "/tmp/k3_bench_grammar_XXXXXX";
    int fd = mkstemp(tmp);
    FILE *in = fopen(path, "r"), *o = fd >= 0 ? fdopen(fd, "w") : NULL;
    char line[1024];
    while (in && o && fgets(line, sizeof line, in)) {
        const char *sp = strchr(line, ' ');
        if (sp && atoll(sp + 1) < V - K3_TOK_N_K3_SPECIALS) fputs(line, o);
    }
    if (in) fclose(in);
    if (o) fclose(o);
    snprintf(path, sizeof path, "%s", tmp);
    k3_tokenizer *tok = NULL;
    k3_grammar_cache *cache = NULL;
    if (k3_tok_create_tiktoken(&tok, path, NULL, K3_TOK_K3_LAYOUT, NULL) != K3_OK ||
        k3_tok_n_vocab(tok) > V || k3_job_grammar_cache(tok, V, &cache) != K3_OK) {
        fprintf(stderr, "k3 bench grammar: %s\n", k3_last_error());
        k3_tok_destroy(tok);
        unlink(tmp);
        return 1;
    }
    unlink(tmp);
    const int STEPS = 256;
    uint64_t *mask = malloc((size_t)(V + 63) / 64 * 8);
    double *t = malloc((size_t)STEPS * 8 * sizeof *t);
    k3_chat_buf js = {0};
    k3_chat_buf_puts(&js, "{\"vocab\":163840,\"cases\":[");
    printf("| case | states | masked states | mask MB | compile ms | cache hit µs | steps | mask µs median | mask µs p99 |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    uint64_t x = 88172645463325252ull;
    for (size_t c = 0; c < sizeof CASES / sizeof CASES[0]; c++) {
        k3_chat_json *j = NULL;
        k3_chat_json_parse(CASES[c][1], strlen(CASES[c][1]), "case", &j);
        const k3_chat_json *tc = k3_chat_json_get(j, "tool_choice");
        k3_grammar_spec s = {.thinking = false, .what = "bench", .tools = k3_chat_json_get(j, "tools")};
        s.content = tc ? K3_GC_NONE : K3_GC_JSON;
        s.tools_mode = tc ? K3_GT_REQUIRED : K3_GT_NONE;
        s.schema = k3_chat_json_get(j, "schema");
        if (k3_chat_json_get(j, "regex")) s.content = K3_GC_REGEX, s.regex = k3_chat_json_get(j, "regex")->s;
        k3_grammar *g = NULL, *g2 = NULL;
        bool hit;
        double t0 = k3_now_s();
        if (k3_grammar_cache_get(cache, &s, &g, &hit) != K3_OK) {
            fprintf(stderr, "k3 bench grammar: %s\n", k3_last_error());
            return 1;
        }
        double t_compile = k3_now_s() - t0;
        t0 = k3_now_s();
        k3_grammar_cache_get(cache, &s, &g2, &hit);
        double t_hit = k3_now_s() - t0;
        k3_grammar_release(g2);
        int n = 0;
        for (int walk = 0; walk < 8 && n < STEPS * 8; walk++) {
            k3_matcher *m = NULL;
            k3_matcher_create(g, &m);
            for (int step = 0; step < STEPS && n < STEPS * 8; step++) {
                double ts = k3_now_s();
                k3_matcher_mask(m, mask);
                t[n++] = (k3_now_s() - ts) * 1e6;
                int64_t best = -1;
                uint64_t bv = 0;
                for (int64_t id = 0; id < V; id++)
                    if (mask[id >> 6] >> (id & 63) & 1) {
                        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                        if (best < 0 || x > bv) best = id, bv = x;
                    }
                if (best < 0 || k3_matcher_accept(m, (int32_t)best) != K3_OK || k3_matcher_done(m))
                    break;
            }
            k3_matcher_destroy(m);
        }
        qsort(t, (size_t)n, sizeof *t, cmp_d);
        k3_grammar_info gi;
        k3_grammar_get_info(g, &gi);
        double med = t[n / 2], p99 = t[(int)(0.99 * (n - 1))];
        printf("| %s | %lld | %lld | %.1f | %.1f | %.1f | %d | %.1f | %.1f |\n", CASES[c][0],
               (long long)gi.n_states, (long long)gi.n_masked_states, gi.mask_bytes / 1e6,
               t_compile * 1e3, t_hit * 1e6, n, med, p99);
        char row[512];
        snprintf(row, sizeof row,
                 "%s{\"case\":\"%zu\",\"states\":%lld,\"masked_states\":%lld,\"mask_bytes\":%lld,"
                 "\"compile_ms\":%.3f,\"cache_hit_us\":%.3f,\"steps\":%d,\"mask_us_median\":%.3f,"
                 "\"mask_us_p99\":%.3f}",
                 c ? "," : "", c, (long long)gi.n_states, (long long)gi.n_masked_states,
                 (long long)gi.mask_bytes, t_compile * 1e3, t_hit * 1e6, n, med, p99);
        k3_chat_buf_puts(&js, row);
        k3_grammar_release(g);
        k3_chat_json_free(j);
    }
    k3_chat_buf_puts(&js, "]}");
    const char *out = k3_args_str(a, "output-json");
    if (out && *out) {
        FILE *f = fopen(out, "w");
        if (f) fprintf(f, "%s\n", js.p), fclose(f);
    }
    k3_chat_buf_free(&js);
    free(mask), free(t);
    k3_grammar_cache_destroy(cache);
    k3_tok_destroy(tok);
    return 0;
}
