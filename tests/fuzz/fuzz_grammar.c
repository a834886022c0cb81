/* fuzz_grammar.c — fuzz target for the grammar engine (coordinator/k3_grammar.h).
 *
 * Input = 1 mode byte + a spec text + 0x00 + steering bytes.
 *  mode % 3 == 0: the spec text is a JSON Schema; 1: a regex; 2: a JSON Schema under the K3
 *  envelope with a required tool call whose parameters it is.
 * The spec compiles or is refused (K3_ERR_ARG with a message); a compiled grammar is walked: each
 * steering byte picks one allowed id; at steps the mask is compared with k3_matcher_allows for
 * every id (they must agree), a refused id must be refused by accept, and a bare JSON walk that
 * completes must be valid JSON (k3's own reader).
 * Checked: no crash, leak or sanitizer report; mask == per-id verdict; accepted JSON parses.
 * The vocabulary: the 256 bytes plus short JSON-ish merges, the K3 specials after them (a small
 * file written at start). Built two ways, like the other targets (tests/fuzz/README.md). */
#include "k3_grammar.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define FZ_CHECK(cond, what)                                                                       \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz_grammar: check failed: %s (%s:%d)\n", what, __FILE__, __LINE__); \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

static k3_tokenizer *g_tok;
static k3_grammar_vocab *g_vocab;
static size_t g_compiled, g_completed;

static const char *const MERGES[] = {"\":",  "\",",   "{\"",      "\"}", "[\"", "\"]", "true",
                                     "null", "false", "12",       "00",  "ab",  "\\n", "\\u",
                                     "e+",   ", ",    "\": ",     "},{", "]}",  "<|",  "|>",
                                     "type", "call",  "argument", NULL};

static void b64(const unsigned char *s, size_t n, FILE *f) {
    static const char T[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (size_t i = 0; i < n; i += 3) {
        unsigned v = (unsigned)s[i] << 16 | (i + 1 < n ? (unsigned)s[i + 1] << 8 : 0) |
                     (i + 2 < n ? s[i + 2] : 0);
        fputc(T[v >> 18 & 63], f), fputc(T[v >> 12 & 63], f);
        fputc(i + 1 < n ? T[v >> 6 & 63] : '=', f), fputc(i + 2 < n ? T[v & 63] : '=', f);
    }
}

static void setup(void) {
    if (g_vocab) return;
    char path[] = "/tmp/k3_fuzz_grammar_XXXXXX";
    int fd = mkstemp(path);
    FZ_CHECK(fd >= 0, "temp vocabulary");
    FILE *f = fdopen(fd, "w");
    int rank = 0;
    for (int b = 0; b < 256; b++, rank++) {
        unsigned char c = (unsigned char)b;
        b64(&c, 1, f);
        fprintf(f, " %d\n", rank);
    }
    for (int i = 0; MERGES[i]; i++, rank++) {
        b64((const unsigned char *)MERGES[i], strlen(MERGES[i]), f);
        fprintf(f, " %d\n", rank);
    }
    fclose(f);
    FZ_CHECK(k3_tok_create_tiktoken(&g_tok, path, NULL, K3_TOK_K3_LAYOUT, NULL) == K3_OK, "vocab");
    unlink(path);
    FZ_CHECK(k3_grammar_vocab_create(g_tok, k3_tok_n_vocab(g_tok), &g_vocab) == K3_OK, "index");
}

static void walk(k3_grammar *g, const uint8_t *steer, size_t n, bool bare_json) {
    const int64_t V = k3_grammar_vocab_size(g_vocab);
    uint64_t mask[64];
    FZ_CHECK((V + 63) / 64 <= 64, "vocabulary fits the mask");
    k3_matcher *m = NULL;
    FZ_CHECK(k3_matcher_create(g, &m) == K3_OK, "matcher");
    k3_tok_bytes text = {0};
    for (size_t i = 0; i < n && i < 400; i++) {
        FZ_CHECK(k3_matcher_mask(m, mask) == K3_OK, "mask");
        int32_t allowed[1024];
        int n_allowed = 0;
        for (int64_t id = 0; id < V; id++) {
            bool bit = mask[id >> 6] >> (id & 63) & 1;
            if (i % 5 == 0) FZ_CHECK(bit == k3_matcher_allows(m, (int32_t)id), "mask == allows");
            if (bit && n_allowed < 1024) allowed[n_allowed++] = (int32_t)id;
        }
        if (!n_allowed) break;
        int32_t id = allowed[steer[i] % n_allowed];
        if (steer[i] == 0xFF) { /* try a refused id: accept must refuse it and change nothing */
            for (int64_t x = 0; x < V; x++)
                if (!(mask[x >> 6] >> (x & 63) & 1)) {
                    FZ_CHECK(k3_matcher_accept(m, (int32_t)x) != K3_OK, "refused id refused");
                    break;
                }
        }
        FZ_CHECK(k3_matcher_accept(m, id) == K3_OK, "allowed id accepted");
        const char *p;
        size_t nb;
        FZ_CHECK(k3_tok_id_bytes(g_tok, id, &p, &nb) == K3_OK, "bytes");
        FZ_CHECK(k3_tok_bytes_append(&text, p, nb) == K3_OK, "text");
        if (k3_matcher_done(m)) break;
    }
    if (bare_json && k3_matcher_can_end(m) && text.n) {
        k3_chat_json *v = NULL;
        FZ_CHECK(k3_chat_json_parse(text.data, text.n, "walk", &v) == K3_OK,
                 "accepted JSON parses");
        k3_chat_json_free(v);
        g_completed++;
    }
    k3_tok_bytes_free(&text);
    k3_matcher_destroy(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    setup();
    if (size < 2) return 0;
    int mode = data[0] % 3;
    const uint8_t *spec = data + 1, *z = memchr(spec, 0, size - 1);
    size_t n_spec = z ? (size_t)(z - spec) : size - 1;
    const uint8_t *steer = z ? z + 1 : data + size;
    size_t n_steer = (size_t)(data + size - steer);
    char *text = malloc(n_spec + 1);
    FZ_CHECK(text != NULL, "alloc");
    memcpy(text, spec, n_spec), text[n_spec] = 0;
    k3_chat_json *schema = NULL, *tools = NULL;
    k3_grammar_spec s = {.bare = mode != 2, .what = "fuzz"};
    bool ok = true;
    if (mode == 1) {
        s.content = K3_GC_REGEX, s.regex = text;
    } else {
        ok = k3_chat_json_parse(text, n_spec, "schema", &schema) == K3_OK;
        s.content = K3_GC_JSON, s.schema = schema;
        if (ok && mode == 2) {
            k3_chat_buf b = {0};
            k3_chat_buf_puts(
                &b, "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":");
            k3_chat_buf_put(&b, text, n_spec);
            k3_chat_buf_puts(&b, "}}]");
            ok = k3_chat_json_parse(b.p, b.n, "tools", &tools) == K3_OK;
            k3_chat_buf_free(&b);
            s.content = K3_GC_NONE, s.schema = NULL, s.tools = tools, s.tools_mode = K3_GT_REQUIRED;
        }
    }
    k3_grammar *g = NULL;
    if (ok && k3_grammar_compile(g_vocab, &s, &g) == K3_OK) {
        g_compiled++;
        walk(g, steer, n_steer, mode == 0);
        k3_grammar_release(g);
    } else {
        FZ_CHECK(!ok || k3_last_error()[0], "a refusal says why");
    }
    k3_chat_json_free(schema);
    k3_chat_json_free(tools);
    free(text);
    return 0;
}

#ifndef K3_LIBFUZZER
#include "fuzz_driver.h"

/* Random schemas from pieces, random regexes, random steering. */
static void gen_schema(k3_rng *r, k3_chat_buf *b, int depth) {
    static const char *const LEAF[] = {"{\"type\":\"string\"}",
                                       "{\"type\":\"integer\"}",
                                       "{\"type\":\"number\"}",
                                       "{\"type\":\"boolean\"}",
                                       "{\"type\":\"null\"}",
                                       "{\"enum\":[\"a\",1,null,true]}",
                                       "{\"const\":\"x\\\"y\"}",
                                       "{\"type\":[\"string\",\"null\"]}",
                                       "{\"type\":\"string\",\"pattern\":\"^[a-c]{1,3}$\"}",
                                       "{\"type\":\"string\",\"format\":\"date\"}",
                                       "{}",
                                       "{\"type\":\"object\"}",
                                       "{\"minimum\":1}",
                                       "{\"$ref\":\"#\"}",
                                       "{\"type\":\"array\"}"};
    uint64_t k = k3_rng_u64(r) % (depth > 2 ? 1 : 4);
    if (k == 0) {
        k3_chat_buf_puts(b, LEAF[k3_rng_u64(r) % (sizeof LEAF / sizeof LEAF[0])]);
    } else if (k == 1) {
        k3_chat_buf_puts(b, "{\"type\":\"object\",\"properties\":{");
        int n = (int)(k3_rng_u64(r) % 4);
        for (int i = 0; i < n; i++) {
            char key[32];
            snprintf(key, sizeof key, "%s\"k%d\":", i ? "," : "", i);
            k3_chat_buf_puts(b, key);
            gen_schema(r, b, depth + 1);
        }
        k3_chat_buf_puts(b, k3_rng_u64(r) % 2 ? "},\"required\":[\"k0\"]" : "}");
        k3_chat_buf_puts(b, k3_rng_u64(r) % 2 ? ",\"additionalProperties\":false}" : "}");
    } else if (k == 2) {
        k3_chat_buf_puts(b, "{\"type\":\"array\",\"maxItems\":3,\"items\":");
        gen_schema(r, b, depth + 1);
        k3_chat_buf_puts(b, "}");
    } else {
        k3_chat_buf_puts(b, "{\"anyOf\":[");
        gen_schema(r, b, depth + 1);
        k3_chat_buf_puts(b, ",");
        gen_schema(r, b, depth + 1);
        k3_chat_buf_puts(b, "]}");
    }
}

int main(int argc, char **argv) {
    long n_random = 300;
    uint64_t seed = 1;
    if (!fuzz_driver_args(argc, argv, "fuzz_grammar", &n_random, &seed, LLVMFuzzerTestOneInput))
        return 1;
    static const char *const RX[] = {"[a-z]+", "(ab|c)*d?",  "\\d{2,4}-x",      "[^\"\\\\]{0,3}",
                                     "a.b|c",  "(?:x|y){3}", "\\w+@\\w+\\.com", "(a|(b|c)+)*",
                                     "(",      "[z-a]",      "a{2,1}",          "\\p{L}",
                                     "x\\by"};
    k3_rng r;
    k3_rng_seed(&r, seed);
    k3_chat_buf b = {0};
    for (long i = 0; i < n_random; i++) {
        b.n = 0;
        uint8_t mode = (uint8_t)(k3_rng_u64(&r) % 3);
        k3_chat_buf_put(&b, &mode, 1);
        if (mode == 1)
            k3_chat_buf_puts(&b, RX[k3_rng_u64(&r) % (sizeof RX / sizeof RX[0])]);
        else
            gen_schema(&r, &b, 0);
        if (k3_rng_u64(&r) % 8 == 0 && b.n > 2) /* mutate a byte of the spec */
            b.p[1 + k3_rng_u64(&r) % (b.n - 1)] = (char)(k3_rng_u64(&r) & 0x7F);
        uint8_t zero = 0;
        k3_chat_buf_put(&b, &zero, 1);
        size_t n_steer = 20 + k3_rng_u64(&r) % 200;
        for (size_t k = 0; k < n_steer; k++) {
            uint8_t x = (uint8_t)(k3_rng_u64(&r) & 0xFF);
            k3_chat_buf_put(&b, &x, 1);
        }
        LLVMFuzzerTestOneInput((const uint8_t *)b.p, b.n);
    }
    k3_chat_buf_free(&b);
    k3_grammar_vocab_destroy(g_vocab);
    k3_tok_destroy(g_tok);
    printf("fuzz_grammar: %zu specs compiled, %zu JSON walks completed\n", g_compiled, g_completed);
    return n_random < 100 || (g_compiled > 0 && g_completed > 0) ? 0 : 1;
}
#endif
