/* fuzz_tokenizer.c — fuzz target for coordinator/k3_tokenizer.h (owner: tokenizer, H5).
 *
 * One input = a mode byte + text bytes. Properties checked (abort() on violation):
 *  - encode never crashes; it fails only with K3_ERR_ARG and only on invalid UTF-8;
 *  - valid UTF-8: decode(encode(s)) == s, with and without specials; a text segment
 *    (allow_special = false) yields no special id; every id decodes;
 *  - the streaming detokenizer (ids, and raw bytes in random splits) equals the whole decode, and
 *    every streamed chunk is valid UTF-8;
 *  - utf8_replace output is valid UTF-8 and a fixed point; regex pieces are ordered and in range.
 * Built two ways: with clang + -DK3_LIBFUZZER (libFuzzer provides main; see README.md), or as a
 * plain driver (main below) that runs the shared golden inputs + N random/mutated inputs from a
 * printed seed, so the gcc test suite has a short fuzz pass (ctest label "fuzz").
 * Vocabulary: $K3_FUZZ_VOCAB or $K3_TESTDATA/vocab/o200k_base.tiktoken (K3 layout specials). */
#include "k3_tokenizer.h"

#include <stdio.h>
#include <stdlib.h>

/* tests/data of the tree this was built from (tests/CMakeLists.txt), when K3_TESTDATA is unset */
#ifndef K3_TESTDATA_DEFAULT
#define K3_TESTDATA_DEFAULT "tests/data"
#endif

static k3_tokenizer *g_tok[3]; /* K3 pattern (kimi chunking), o200k pattern, cl100k pattern (raw) */

#define FUZZ_REQUIRE(cond, ...)                                                                    \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz_tokenizer: property violated: %s: ", #cond);                     \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

static void init_tokenizers(void) {
    if (g_tok[0]) return;
    char path[1024];
    const char *v = getenv("K3_FUZZ_VOCAB");
    if (v)
        snprintf(path, sizeof path, "%s", v);
    else
        snprintf(path, sizeof path, "%s/vocab/o200k_base.tiktoken",
                 getenv("K3_TESTDATA") ? getenv("K3_TESTDATA") : K3_TESTDATA_DEFAULT);
    const k3_tok_options opt[3] = {{.pattern = K3_TOK_PAT_K3},
                                   {.pattern = K3_TOK_PAT_O200K, .no_kimi_chunking = true},
                                   {.pattern = K3_TOK_PAT_CL100K, .no_kimi_chunking = true}};
    for (int i = 0; i < 3; i++)
        if (k3_tok_create_tiktoken(&g_tok[i], path, NULL, K3_TOK_K3_LAYOUT, &opt[i]) != K3_OK) {
            fprintf(stderr, "fuzz_tokenizer: cannot load %s: %s\n", path, k3_last_error());
            abort();
        }
}

static bool is_valid_utf8(const char *p, size_t n) {
    k3_tok_bytes r = {0};
    FUZZ_REQUIRE(k3_tok_utf8_replace(p, n, &r) == K3_OK, "replace");
    bool same = r.n == n && (n == 0 || !memcmp(r.data, p, n));
    k3_tok_bytes_free(&r);
    return same;
}

static void check_text(const k3_tokenizer *t, const char *text, size_t n, bool special,
                       uint8_t split_seed) {
    k3_tok_ids ids = {0};
    k3_status st = k3_tok_encode(t, text, n, special, &ids);
    bool valid = is_valid_utf8(text, n);
    if (!valid) {
        FUZZ_REQUIRE(st == K3_ERR_ARG, "invalid UTF-8 must be rejected with K3_ERR_ARG, got %s",
                     k3_status_name(st));
        FUZZ_REQUIRE(ids.n == 0, "no ids on failure");
        k3_tok_ids_free(&ids);
        return;
    }
    FUZZ_REQUIRE(st == K3_OK, "valid UTF-8 must encode: %s", k3_last_error());
    for (size_t i = 0; i < ids.n; i++) {
        FUZZ_REQUIRE(ids.ids[i] >= 0 && ids.ids[i] < k3_tok_n_vocab(t), "id %d in range",
                     ids.ids[i]);
        if (!special)
            FUZZ_REQUIRE(!k3_tok_is_special(t, ids.ids[i]), "text segment produced special id %d",
                         ids.ids[i]);
    }
    k3_tok_bytes dec = {0}, str = {0};
    FUZZ_REQUIRE(k3_tok_decode_bytes(t, ids.ids, ids.n, &dec) == K3_OK, "decode");
    FUZZ_REQUIRE(dec.n == n && (n == 0 || !memcmp(dec.data, text, n)),
                 "decode(encode(s)) != s (special=%d)", special);
    /* Streaming over ids equals the whole decode; each chunk is valid UTF-8. */
    k3_tok_stream *s = NULL;
    FUZZ_REQUIRE(k3_tok_stream_create(&s, t) == K3_OK, "stream");
    for (size_t i = 0; i < ids.n; i++) {
        size_t before = str.n;
        FUZZ_REQUIRE(k3_tok_stream_push(s, ids.ids[i], &str) == K3_OK, "push");
        FUZZ_REQUIRE(is_valid_utf8(str.data + before, str.n - before),
                     "stream chunk is not valid UTF-8");
    }
    FUZZ_REQUIRE(k3_tok_stream_finish(s, &str) == K3_OK, "finish");
    FUZZ_REQUIRE(str.n == n && (n == 0 || !memcmp(str.data, text, n)), "stream decode != s");
    k3_tok_stream_destroy(s);
    /* Regex pieces: ordered, non-overlapping, in range. */
    size_t *off = NULL, np = 0;
    FUZZ_REQUIRE(k3_tok_split(t, text, n, &off, &np) == K3_OK, "split");
    for (size_t i = 0; i < np; i++) {
        FUZZ_REQUIRE(off[2 * i] < off[2 * i + 1] && off[2 * i + 1] <= n, "piece %zu range", i);
        if (i) FUZZ_REQUIRE(off[2 * i] >= off[2 * i - 1], "pieces overlap");
    }
    free(off);
    (void)split_seed;
    k3_tok_bytes_free(&dec);
    k3_tok_bytes_free(&str);
    k3_tok_ids_free(&ids);
}

/* Arbitrary bytes through utf8_replace and a byte-split stream. */
static void check_bytes(const k3_tokenizer *t, const char *p, size_t n, uint8_t seed) {
    k3_tok_bytes whole = {0}, again = {0}, str = {0};
    FUZZ_REQUIRE(k3_tok_utf8_replace(p, n, &whole) == K3_OK, "replace");
    FUZZ_REQUIRE(k3_tok_utf8_replace(whole.data, whole.n, &again) == K3_OK, "replace 2");
    FUZZ_REQUIRE(again.n == whole.n && (whole.n == 0 || !memcmp(again.data, whole.data, whole.n)),
                 "replace output is not valid UTF-8");
    k3_tok_stream *s = NULL;
    FUZZ_REQUIRE(k3_tok_stream_create(&s, t) == K3_OK, "stream");
    size_t i = 0, step = (size_t)(seed % 5) + 1;
    while (i < n) {
        size_t k = K3_MIN(step, n - i);
        FUZZ_REQUIRE(k3_tok_stream_push_bytes(s, p + i, k, &str) == K3_OK, "push bytes");
        i += k;
        step = step % 7 + 1;
    }
    FUZZ_REQUIRE(k3_tok_stream_finish(s, &str) == K3_OK, "finish");
    FUZZ_REQUIRE(str.n == whole.n && (n == 0 || !memcmp(str.data, whole.data, whole.n)),
                 "byte-split stream != whole replace");
    k3_tok_stream_destroy(s);
    k3_tok_bytes_free(&whole);
    k3_tok_bytes_free(&again);
    k3_tok_bytes_free(&str);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    init_tokenizers();
    if (size == 0) return 0;
    uint8_t mode = data[0];
    const char *text = (const char *)data + 1;
    size_t n = size - 1;
    const k3_tokenizer *t = g_tok[mode % 3];
    check_text(t, text, n, (mode >> 2) & 1, mode);
    check_bytes(t, text, n, mode);
    return 0;
}

#ifndef K3_LIBFUZZER
/* ---- plain driver ------------------------------------------------------------------------- */
static const char *interesting[] = {"<|open|>",
                                    "<|close|>",
                                    "<|sep|>",
                                    "<|end_of_msg|>",
                                    "[EOS]",
                                    "<|reserved_token_200100|>",
                                    "'s",
                                    "'LL",
                                    "\xe4\xb8\xad\xe6\x96\x87",
                                    "\xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9",
                                    "\xcc\x81",
                                    " ",
                                    "\n",
                                    "\r\n",
                                    "\t",
                                    "\xc2\x85",
                                    "\xe3\x80\x80",
                                    "123456",
                                    "aaaa",
                                    "HTTP",
                                    "Request",
                                    "\xd9\x85\xd8\xb1",
                                    "\xed\x9f\xbf",
                                    "\xef\xbf\xbd",
                                    "\xf4\x8f\xbf\xbf",
                                    "\x00",
                                    "\x7f",
                                    "\xe2\x80\xa8"};

static size_t gen_input(k3_rng *r, uint8_t *buf, size_t cap) {
    size_t n = 0;
    buf[n++] = (uint8_t)k3_rng_u64(r);
    size_t target = (size_t)(k3_rng_u64(r) % (k3_rng_u64(r) % 8 == 0 ? cap - 1 : 64));
    int kind = (int)(k3_rng_u64(r) % 3);
    while (n < target) {
        uint64_t x = k3_rng_u64(r);
        if (kind == 0) { /* random bytes */
            buf[n++] = (uint8_t)x;
        } else { /* tokens from the interesting list, occasionally corrupted */
            const char *s = interesting[x % K3_ARRAY_LEN(interesting)];
            size_t l = strlen(s) ? strlen(s) : 1;
            for (size_t i = 0; i < l && n < target; i++) buf[n++] = (uint8_t)s[i];
            if (kind == 2 && x % 97 == 0 && n > 1)
                buf[n - 1 - (x >> 32) % (n - 1)] ^= (uint8_t)(x >> 8);
        }
    }
    return n;
}

int main(int argc, char **argv) {
    long n_random = 2000;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--random") && i + 1 < argc)
            n_random = atol(argv[++i]);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 10);
        else { /* a corpus file */
            char *buf = NULL;
            size_t n = 0;
            if (k3_read_file(argv[i], &buf, &n) != K3_OK) {
                fprintf(stderr, "fuzz_tokenizer: %s\n", k3_last_error());
                return 1;
            }
            LLVMFuzzerTestOneInput((const uint8_t *)buf, n);
            k3_free(buf);
        }
    }
    init_tokenizers();
    printf("fuzz_tokenizer: seed %llu, %ld random inputs\n", (unsigned long long)seed, n_random);
    k3_rng r;
    k3_rng_seed(&r, seed);
    enum { CAP = 4096 };
    uint8_t *buf = malloc(CAP);
    size_t total = 0, n_valid = 0;
    for (long i = 0; i < n_random; i++) {
        size_t n = gen_input(&r, buf, CAP);
        total += n;
        n_valid += n > 1 && is_valid_utf8((const char *)buf + 1, n - 1);
        LLVMFuzzerTestOneInput(buf, n);
    }
    free(buf);
    for (int i = 0; i < 3; i++) k3_tok_destroy(g_tok[i]);
    printf("fuzz_tokenizer: %ld inputs, %zu bytes, %zu valid UTF-8 (both kinds must occur): OK\n",
           n_random, total, n_valid);
    return n_valid > 0 && n_valid < (size_t)n_random ? 0 : 1;
}
#endif
