/* fuzz_serve_request.c — fuzz target of `k3 serve`'s request parser (owner: serve):
 * k3_server_check_request, what the HTTP threads run on every body before anything can reach the
 * engine (JSON, key types, the chat template and tokenizer, sampling keys, prompt ids, the limits).
 *
 * Input = 1 route byte (chat, completions, tokenize, detokenize, an unknown path) + the body.
 * Checked: no crash or sanitizer report; the answer is 200 or a 4xx (400, 404, 413) — never a 5xx
 * except out of memory — and a refusal always carries a message.
 * Built two ways (tests/fuzz/README.md): with clang + -DK3_LIBFUZZER (libFuzzer's main), or as a
 * plain driver that runs FILES and N random inputs from a seed: valid requests of every route,
 * mutated (byte flips, truncation, splices of JSON fragments, wrong-typed values, huge numbers,
 * invalid UTF-8). The driver fails when no input is accepted or none refused (a vacuous pass).
 * Vocabulary: $K3_FUZZ_VOCAB or $K3_TESTDATA/vocab/o200k_base.tiktoken (K3 layout specials). */
#include <stdio.h>
#include <stdlib.h>

#include "k3_server.h"

/* tests/data of the tree this was built from (tests/CMakeLists.txt), when K3_TESTDATA is unset */
#ifndef K3_TESTDATA_DEFAULT
#define K3_TESTDATA_DEFAULT "tests/data"
#endif

static const char *const routes[] = {"/v1/chat/completions", "/v1/completions", "/tokenize",
                                     "/detokenize", "/v1/nothing"};

static k3_tokenizer *g_tok;
static k3_server_opts g_o;
static long g_accepted, g_refused;

static void setup(void) {
    if (g_tok) return;
    char path[4096];
    const char *v = getenv("K3_FUZZ_VOCAB");
    if (v)
        snprintf(path, sizeof path, "%s", v);
    else
        snprintf(path, sizeof path, "%s/vocab/o200k_base.tiktoken",
                 getenv("K3_TESTDATA") ? getenv("K3_TESTDATA") : K3_TESTDATA_DEFAULT);
    if (k3_tok_create_tiktoken(&g_tok, path, NULL, K3_TOK_K3_LAYOUT, NULL) != K3_OK) {
        fprintf(stderr, "fuzz_serve_request: %s\n", k3_last_error());
        abort();
    }
    g_o = (k3_server_opts){.model_name = "fuzz",
                           .tok = g_tok,
                           .n_vocab = k3_tok_n_vocab(g_tok),
                           .max_ctx = 4096,
                           .max_body_bytes = 1 << 20,
                           .max_messages = 64};
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    setup();
    if (size < 1) return 0;
    const char *path = routes[data[0] % K3_ARRAY_LEN(routes)];
    char why[1024] = "";
    int st = k3_server_check_request(&g_o, path, (const char *)data + 1, size - 1, why, sizeof why);
    const bool ok =
        st == 200 || st == 400 || st == 404 || st == 413 || (st == 500 && strstr(why, "memory"));
    if (!ok || (st != 200 && !why[0])) {
        fprintf(stderr, "fuzz_serve_request: %s: status %d, message '%s'\n", path, st, why);
        abort();
    }
    st == 200 ? g_accepted++ : g_refused++;
    return 0;
}

#ifndef K3_LIBFUZZER
/* ---- the plain driver ------------------------------------------------------------------------ */
static const char *const seeds[] = {
    "\x00{\"model\":\"fuzz\",\"messages\":[{\"role\":\"system\",\"content\":\"be "
    "brief\"},{\"role\":"
    "\"user\",\"content\":\"hi\"}],\"max_tokens\":8,\"temperature\":0.7,\"top_p\":0.9,\"seed\":3,"
    "\"stop\":[\"x\"],\"logprobs\":true,\"top_logprobs\":2,\"stream\":true,\"stream_options\":{"
    "\"include_usage\":true}}",
    "\x00{\"messages\":[{\"role\":\"user\",\"content\":\"w?\"},{\"role\":\"assistant\",\"content\":"
    "\"\",\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"f\","
    "\"arguments\":\"{\\\"a\\\":1}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":"
    "\"2\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{"
    "\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}}}],\"tool_choice\":"
    "\"auto\",\"chat_template_kwargs\":{\"thinking\":false},\"logit_bias\":{\"5\":-3}}",
    "\x01{\"prompt\":\"hello there\",\"max_tokens\":4,\"logprobs\":2,\"echo\":false}",
    "\x01{\"prompt\":[1,2,3,4],\"max_tokens\":2,\"stream\":true}",
    "\x02{\"prompt\":\"tokenize me\"}",
    "\x02{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}",
    "\x03{\"tokens\":[10,20,30]}",
};
static const char *const frags[] = {"{",
                                    "}",
                                    "[",
                                    "]",
                                    ",",
                                    ":",
                                    "\"",
                                    "null",
                                    "true",
                                    "-1",
                                    "1e999",
                                    "99999999999999999999999",
                                    "\"\\ud800\"",
                                    "\xff\xfe",
                                    "\xc3",
                                    "0.5",
                                    "\"messages\"",
                                    "\"max_tokens\"",
                                    "\"role\"",
                                    "\"tools\"",
                                    "[[[[[[[[",
                                    "\"prompt\"",
                                    "{}",
                                    "\"temperature\":\"x\"",
                                    "\"n\":2",
                                    "\"stop\":5",
                                    "\"tokens\":[-1]"};

static void mutate(k3_rng *r, const char *seed, size_t n_seed, char *out, size_t *n) {
    size_t len = n_seed;
    memcpy(out, seed, len);
    if (k3_rng_u64(r) % 8 == 0) out[0] = (char)(k3_rng_u64(r) % 256); /* another route */
    int edits = 1 + (int)(k3_rng_u64(r) % 6);
    for (int e = 0; e < edits; e++) {
        size_t at = 1 + (len > 1 ? k3_rng_u64(r) % (len - 1) : 0);
        switch (k3_rng_u64(r) % 4) {
        case 0: /* flip a byte */
            if (at < len) out[at] ^= (char)(1u << (k3_rng_u64(r) % 8));
            break;
        case 1: /* truncate */
            len = at;
            break;
        case 2: { /* splice a fragment in */
            const char *f = frags[k3_rng_u64(r) % K3_ARRAY_LEN(frags)];
            size_t nf = strlen(f);
            if (len + nf >= 4096) break;
            memmove(out + at + nf, out + at, len - at);
            memcpy(out + at, f, nf);
            len += nf;
            break;
        }
        default: /* drop a span */
            if (at < len) {
                const size_t want = (size_t)(k3_rng_u64(r) % 16); /* K3_MIN evaluates twice */
                size_t k = K3_MIN(len - at, want);
                memmove(out + at, out + at + k, len - at - k);
                len -= k;
            }
        }
    }
    *n = len;
}

int main(int argc, char **argv) {
    long n_random = 2000;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--random") == 0 && i + 1 < argc) {
            n_random = atol(argv[++i]);
        } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
            seed = strtoull(argv[++i], NULL, 10);
        } else {
            char *buf = NULL;
            size_t n = 0;
            if (k3_read_file(argv[i], &buf, &n) != K3_OK) {
                fprintf(stderr, "fuzz_serve_request: %s\n", k3_last_error());
                return 1;
            }
            LLVMFuzzerTestOneInput((const uint8_t *)buf, n);
            k3_free(buf);
        }
    }
    setup();
    printf("fuzz_serve_request: seed %llu, %ld random inputs\n", (unsigned long long)seed,
           n_random);
    static char out[4096];
    k3_rng r;
    k3_rng_seed(&r, seed);
    for (size_t i = 0; i < K3_ARRAY_LEN(seeds); i++) /* the seeds themselves (route byte 0..3) */
        LLVMFuzzerTestOneInput((const uint8_t *)seeds[i], strlen(seeds[i] + 1) + 1);
    const long accepted_seeds = g_accepted;
    for (long k = 0; k < n_random; k++) {
        const char *s = seeds[k3_rng_u64(&r) % K3_ARRAY_LEN(seeds)];
        size_t n = 0;
        mutate(&r, s, strlen(s + 1) + 1, out, &n);
        LLVMFuzzerTestOneInput((const uint8_t *)out, n);
    }
    printf("fuzz_serve_request: %ld accepted (%ld of %zu seeds), %ld refused\n", g_accepted,
           accepted_seeds, K3_ARRAY_LEN(seeds), g_refused);
    k3_tok_destroy(g_tok);
    /* not vacuous: every seed is a valid request, and mutations must be refused too */
    if (accepted_seeds != (long)K3_ARRAY_LEN(seeds) || g_refused == 0) {
        fprintf(stderr,
                "fuzz_serve_request: a vacuous pass (seeds accepted %ld of %zu, %ld "
                "refused)\n",
                accepted_seeds, K3_ARRAY_LEN(seeds), g_refused);
        return 1;
    }
    return 0;
}
#endif
