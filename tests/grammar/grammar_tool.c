/* grammar_tool.c — the grammar engine driven by tests/grammar/test_grammar.py (one JSON request a
 * line on stdin, one JSON answer a line on stdout).
 *
 *   {"op":"check","spec":SPEC,"instances":[str,...]}  -> {"verdicts":[bool,...]} : the bytes of
 *       each instance through the matcher (bare content: accepted = complete), and
 *       "compile_cpu_s" (the request's parse + compile in thread CPU seconds; errors carry it too)
 *   {"op":"walk","spec":SPEC,"n":N,"seed":S,"max":M}  -> {"outputs":[str|null,...],
 *       "mask_errors":K} : N generations, each id drawn from the mask with random logits (a random
 *       model); every step the mask is compared with k3_matcher_allows for every id (K = the ids
 *       where the two differ); null = not complete within M tokens
 *   any error -> {"error": message}
 * SPEC = {"schema":..} | {"regex":..} | {"choice":[..]} | {"json_object":true}, plus for the K3
 * envelope "envelope":true, "thinking", "tools", "tool_choice":"required"|"none"|NAME,
 * "single_call", "budget_s" (the compile's time budget). Envelope walks print their output with
 * markers as <|open|> etc. text. argv[1]: a .tiktoken vocabulary (with the K3 specials after its
 * ranks). */
#include "k3_grammar.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static const k3_chat_json *get(const k3_chat_json *o, const char *k) {
    return k3_chat_json_get(o, k);
}

static k3_status spec_of(const k3_chat_json *j, k3_grammar_spec *s) {
    *s = (k3_grammar_spec){.what = "schema", .bare = !k3_chat_json_truthy(get(j, "envelope"))};
    const k3_chat_json *v;
    if ((v = get(j, "schema")))
        s->content = K3_GC_JSON, s->schema = v;
    else if ((v = get(j, "regex")) && v->kind == K3_JSON_STRING)
        s->content = K3_GC_REGEX, s->regex = v->s;
    else if ((v = get(j, "choice")))
        s->content = K3_GC_CHOICE, s->choices = v;
    else if (get(j, "json_object"))
        s->content = K3_GC_JSON;
    else if (get(j, "no_content"))
        s->content = K3_GC_NONE;
    s->thinking = k3_chat_json_truthy(get(j, "thinking"));
    s->tools = get(j, "tools");
    s->single_call = k3_chat_json_truthy(get(j, "single_call"));
    const k3_chat_json *bs = get(j, "budget_s"); /* the compile's time budget */
    if (bs && bs->kind == K3_JSON_FLOAT) s->budget_s = bs->f;
    if (bs && bs->kind == K3_JSON_INT) s->budget_s = atof(bs->s);
    const k3_chat_json *tc = get(j, "tool_choice");
    s->tools_mode = K3_GT_ANY;
    if (k3_chat_json_is_str(tc, "required"))
        s->tools_mode = K3_GT_REQUIRED;
    else if (k3_chat_json_is_str(tc, "none"))
        s->tools_mode = K3_GT_NONE;
    else if (tc && tc->kind == K3_JSON_STRING)
        s->tools_mode = K3_GT_REQUIRED, s->tool_name = tc->s, s->single_call = true;
    return K3_OK;
}

static uint64_t rng_next(uint64_t *x) {
    *x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
    return *x;
}

static double compile_cpu_s; /* the last request's parse + compile, in thread CPU seconds */
static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void put_err(void) {
    k3_chat_buf b = {0};
    const char *m = k3_last_error();
    k3_chat_json_dump_str(m, strlen(m), &b);
    printf("{\"error\":%s,\"compile_cpu_s\":%.4f}\n", b.p, compile_cpu_s);
    k3_chat_buf_free(&b);
}

static k3_status walk(k3_grammar *g, const k3_tokenizer *tok, int64_t V, const k3_chat_json *j,
                      k3_chat_buf *out) {
    const k3_chat_json *nj = get(j, "n"), *sj = get(j, "seed"), *mj = get(j, "max");
    int n = nj ? atoi(nj->s) : 10, maxt = mj ? atoi(mj->s) : 2000;
    uint64_t seed = sj ? strtoull(sj->s, NULL, 10) : 1, x = seed * 2654435761u + 1;
    int64_t W = (V + 63) / 64, mask_errors = 0;
    uint64_t *mask = malloc((size_t)W * 8);
    if (!mask) return K3_ERR(K3_ERR_NOMEM, "mask");
    k3_chat_buf_puts(out, "{\"outputs\":[");
    for (int r = 0; r < n; r++) {
        k3_matcher *m = NULL;
        K3_TRY(k3_matcher_create(g, &m));
        k3_tok_bytes text = {0};
        bool done = false;
        for (int t = 0; t < maxt && !done; t++) {
            K3_TRY(k3_matcher_mask(m, mask));
            /* brute force every few steps: the mask equals the matcher's own verdict per id */
            if (t % 7 == 0)
                for (int64_t id = 0; id < V; id++)
                    mask_errors +=
                        ((mask[id >> 6] >> (id & 63)) & 1) != k3_matcher_allows(m, (int32_t)id);
            /* a random model: the best of random logits among the allowed ids */
            int64_t best = -1;
            uint64_t bv = 0;
            for (int64_t id = 0; id < V; id++)
                if (mask[id >> 6] >> (id & 63) & 1) {
                    uint64_t v = rng_next(&x);
                    if (best < 0 || v > bv) best = id, bv = v;
                }
            if (best < 0) break; /* nothing allowed: complete (bare) */
            K3_TRY(k3_matcher_accept(m, (int32_t)best));
            const char *p;
            size_t nb;
            K3_TRY(k3_tok_id_bytes(tok, (int32_t)best, &p, &nb));
            K3_TRY(k3_tok_bytes_append(&text, p, nb));
            /* bare content ends when it may: with probability 1/4 once complete */
            if (k3_matcher_done(m) || (k3_matcher_can_end(m) && rng_next(&x) % 4 == 0)) done = true;
        }
        if (!done && k3_matcher_can_end(m)) done = true;
        if (r) k3_chat_buf_puts(out, ",");
        if (done) {
            k3_tok_bytes fixed = {0};
            K3_TRY(k3_tok_utf8_replace(text.data ? text.data : "", text.n, &fixed));
            k3_chat_json_dump_str(fixed.data ? fixed.data : "", fixed.n, out);
            k3_tok_bytes_free(&fixed);
        } else {
            k3_chat_buf_puts(out, "null");
        }
        k3_tok_bytes_free(&text);
        k3_matcher_destroy(m);
    }
    char tail[64];
    snprintf(tail, sizeof tail, "],\"mask_errors\":%lld}", (long long)mask_errors);
    k3_chat_buf_puts(out, tail);
    free(mask);
    return K3_OK;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: grammar_tool VOCAB.tiktoken < requests.jsonl\n");
        return 2;
    }
    k3_tokenizer *tok = NULL;
    k3_grammar_vocab *v = NULL;
    k3_grammar_cache *cache = NULL;
    if (k3_tok_create_tiktoken(&tok, argv[1], NULL, K3_TOK_K3_LAYOUT, NULL) != K3_OK ||
        k3_grammar_vocab_create(tok, k3_tok_n_vocab(tok), &v) != K3_OK ||
        k3_grammar_cache_create(v, 16, &cache) != K3_OK) {
        fprintf(stderr, "grammar_tool: %s\n", k3_last_error());
        return 1;
    }
    const int64_t V = k3_tok_n_vocab(tok);
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, stdin)) > 0) {
        k3_chat_json *j = NULL;
        k3_grammar *g = NULL;
        k3_grammar_spec s;
        bool hit;
        double c0 = cpu_now();
        bool compiled = k3_chat_json_parse(line, (size_t)n, "request", &j) == K3_OK &&
                        spec_of(get(j, "spec"), &s) == K3_OK &&
                        k3_grammar_cache_get(cache, &s, &g, &hit) == K3_OK;
        compile_cpu_s = cpu_now() - c0;
        if (!compiled) {
            put_err();
        } else if (k3_chat_json_is_str(get(j, "op"), "check")) {
            const k3_chat_json *in = get(j, "instances");
            printf("{\"verdicts\":[");
            for (size_t i = 0; in && i < in->n_items; i++) {
                k3_matcher *m = NULL;
                bool ok = k3_matcher_create(g, &m) == K3_OK;
                uint16_t *syms = malloc((in->items[i]->n + 1) * sizeof *syms);
                for (size_t k = 0; syms && k < in->items[i]->n; k++)
                    syms[k] = (uint8_t)in->items[i]->s[k];
                ok = ok && syms && k3_matcher_accept_syms(m, syms, in->items[i]->n) &&
                     k3_matcher_can_end(m);
                printf("%s%s", i ? "," : "", ok ? "true" : "false");
                free(syms);
                k3_matcher_destroy(m);
            }
            printf("],\"compile_cpu_s\":%.4f}\n", compile_cpu_s);
        } else {
            k3_chat_buf out = {0};
            if (walk(g, tok, V, j, &out) == K3_OK)
                printf("%s\n", out.p);
            else
                put_err();
            k3_chat_buf_free(&out);
        }
        fflush(stdout);
        k3_grammar_release(g);
        k3_chat_json_free(j);
    }
    free(line);
    k3_grammar_cache_destroy(cache);
    k3_tok_destroy(tok);
    return 0;
}
