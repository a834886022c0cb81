/* fuzz_parser.c — fuzz target for the chat module: output parser, renderer, canonical JSON.
 *
 * Input = 1 mode byte + payload.
 *  mode 0 (parser): payload bytes are events: 0xFE k is an escape (k % 14 < 6: the markers OPEN
 *    CLOSE SEP EOM STOP OTHER; else a tag word such as "call tool=\"t\"" so the machine reaches
 *    deep states); other bytes are body text in short runs (UTF-8 cut anywhere, 4-byte too).
 *    Checked: no crash/leak; the message JSON parses (valid JSON, valid UTF-8); deltas add up to
 *    the final reasoning and content; every complete call's streamed arguments equal the final.
 *  mode 1 (renderer): payload is a request; parse + render must not crash; on success the
 *    segments are non-empty, concatenate to the text, and the segments JSON parses.
 *  mode 2 (JSON): parse -> dump -> parse -> dump is a fixed point (canonical form).
 * Built two ways: clang + -DK3_LIBFUZZER (libFuzzer main), or a plain driver (main below) that
 * runs files given on the command line + N generated inputs from a printed seed (ctest "fuzz"). */
#include "k3_chat.h"
#include "k3_parser.h"

#include <stdio.h>
#include <stdlib.h>

#define FZ_CHECK(cond, what)                                                                       \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz_parser: check failed: %s (%s:%d)\n", what, __FILE__, __LINE__);  \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

static const char *TOOLS_JSON =
    "[{\"type\":\"function\",\"function\":{\"name\":\"t\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{"
    "\"i\":{\"type\":\"integer\"},\"s\":{\"type\":\"string\"},\"n\":{\"type\":[\"number\",\"null\"]"
    "},"
    "\"u\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]}}}}}]";
static k3_chat_json *g_tools;
static size_t g_complete_calls; /* driver statistic: the machine reached committed calls */

static const char *const WORDS[8] = {"think",
                                     "response",
                                     "tools",
                                     "call tool=\"t\" index=\"1\"",
                                     "argument key=\"i\" type=\"number\"",
                                     "argument key=\"s\"",
                                     "json type=\"object\"",
                                     "message role=\"assistant\""};

static bool eqbuf(const char *a, size_t n, const k3_chat_buf *b) {
    return n == b->n && (n == 0 || memcmp(a, b->p, n) == 0);
}

static void fuzz_parser(const uint8_t *d, size_t n, bool thinking) {
    if (!g_tools)
        FZ_CHECK(k3_chat_json_parse(TOOLS_JSON, strlen(TOOLS_JSON), "tools", &g_tools) == K3_OK,
                 "tools");
    k3_parser_opts o = {.thinking = thinking, .tools = g_tools};
    k3_parser *p = NULL;
    FZ_CHECK(k3_parser_create(&o, &p) == K3_OK, "create");
    k3_chat_buf r = {0}, c = {0}, args[16] = {{0}};
    k3_parser_delta dl;
    for (size_t i = 0; i <= n;) {
        if (i == n) {
            FZ_CHECK(k3_parser_finish(p) == K3_OK, "finish");
            i++;
        } else if (d[i] == 0xFE && i + 1 < n) { /* escape: a marker or a tag word */
            unsigned k = d[i + 1] % 14;
            if (k < 6) {
                FZ_CHECK(k3_parser_feed_marker(p, (k3_parser_marker)k) == K3_OK, "marker");
            } else {
                const char *w = WORDS[k - 6];
                FZ_CHECK(k3_parser_feed_text(p, w, strlen(w)) == K3_OK, "word");
            }
            i += 2;
        } else { /* body bytes in short runs: UTF-8 sequences get cut anywhere */
            size_t run = 1 + (d[i] & 3), k = 0;
            while (k < run && i + k < n && d[i + k] != 0xFE) k++;
            if (k == 0) k = 1; /* a trailing lone 0xFE is text */
            FZ_CHECK(k3_parser_feed_text(p, (const char *)d + i, k) == K3_OK, "text");
            i += k;
        }
        FZ_CHECK(k3_parser_take_delta(p, &dl) == K3_OK, "delta");
        k3_chat_buf_put(&r, dl.reasoning, dl.n_reasoning);
        k3_chat_buf_put(&c, dl.content, dl.n_content);
        for (size_t k = 0; k < dl.n_calls; k++)
            if (dl.calls[k].index < 16)
                k3_chat_buf_put(&args[dl.calls[k].index], dl.calls[k].args, dl.calls[k].n_args);
        k3_chat_buf dj = {0};
        FZ_CHECK(k3_parser_delta_json(&dl, &dj) == K3_OK, "delta json");
        k3_chat_json *v = NULL;
        FZ_CHECK(k3_chat_json_parse(dj.p, dj.n, "delta", &v) == K3_OK, "delta JSON is valid");
        k3_chat_json_free(v);
        k3_chat_buf_free(&dj);
    }
    k3_parser_message m;
    FZ_CHECK(k3_parser_message_view(p, &m) == K3_OK, "view");
    FZ_CHECK(eqbuf(m.reasoning, m.n_reasoning, &r), "reasoning deltas add up");
    FZ_CHECK(eqbuf(m.content, m.n_content, &c), "content deltas add up");
    g_complete_calls += m.n_calls;
    for (size_t k = 0; k < m.n_calls; k++) {
        size_t idx = (size_t)strtoul(m.calls[k].id + 5, NULL, 10);
        if (idx < 16)
            FZ_CHECK(eqbuf(m.calls[k].arguments, m.calls[k].n_arguments, &args[idx]),
                     "call deltas add up");
    }
    k3_chat_buf mj = {0};
    FZ_CHECK(k3_parser_message_json(p, &mj) == K3_OK, "message json");
    k3_chat_json *v = NULL;
    FZ_CHECK(k3_chat_json_parse(mj.p, mj.n, "message", &v) == K3_OK, "message JSON is valid");
    k3_chat_json_free(v);
    k3_chat_buf_free(&mj);
    k3_chat_buf_free(&r);
    k3_chat_buf_free(&c);
    for (int k = 0; k < 16; k++) k3_chat_buf_free(&args[k]);
    k3_parser_destroy(p);
}

static void fuzz_render(const uint8_t *d, size_t n) {
    k3_chat_request *req = NULL;
    if (k3_chat_request_parse((const char *)d, n, &req) != K3_OK) return;
    for (int gen = 0; gen < 2; gen++) {
        k3_chat_prompt pr;
        if (k3_chat_request_set_generation_prompt(req, gen) != K3_OK) continue;
        if (k3_chat_render(req, &pr) != K3_OK) continue;
        size_t prev = 0;
        for (size_t i = 0; i < pr.n_segs; i++) {
            FZ_CHECK(pr.seg_end[i] > prev && pr.seg_end[i] <= pr.n_bytes,
                     "segments non-empty, in order");
            prev = pr.seg_end[i];
        }
        FZ_CHECK(prev == pr.n_bytes, "segments cover the text");
        /* where the prompt ends: a closed prompt ends with <|end_of_msg|> (or is empty); a
         * generation prompt with the opener of think/response */
        k3_chat_prompt_end end = k3_chat_request_prompt_end(req);
        static const char eom[] = "<|end_of_msg|>";
        const char *opener =
            k3_chat_request_thinking(req) ? "<|open|>think<|sep|>" : "<|open|>response<|sep|>";
        size_t no = strlen(opener);
        if (end == K3_CHAT_ENDS_CLOSED)
            FZ_CHECK(pr.n_bytes == 0 ||
                         (pr.n_bytes >= sizeof eom - 1 &&
                          !memcmp(pr.text + pr.n_bytes - (sizeof eom - 1), eom, sizeof eom - 1)),
                     "a closed prompt ends with <|end_of_msg|>");
        else if (gen)
            FZ_CHECK(pr.n_bytes >= no && !memcmp(pr.text + pr.n_bytes - no, opener, no),
                     "the generation prompt ends with its opener");
        k3_chat_buf sj = {0};
        FZ_CHECK(k3_chat_prompt_segments_json(&pr, &sj) == K3_OK, "segments json");
        k3_chat_json *v = NULL;
        FZ_CHECK(k3_chat_json_parse(sj.p, sj.n, "segments", &v) == K3_OK, "segments JSON is valid");
        k3_chat_json_free(v);
        k3_chat_buf_free(&sj);
        k3_chat_prompt_free(&pr);
    }
    k3_chat_request_destroy(req);
}

static void fuzz_json(const uint8_t *d, size_t n) {
    k3_chat_json *a = NULL, *b = NULL;
    if (k3_chat_json_parse((const char *)d, n, "fuzz", &a) != K3_OK) return;
    for (int flags = 0; flags < 4; flags++) {
        k3_chat_buf x = {0}, y = {0};
        FZ_CHECK(k3_chat_json_dump(a, flags, &x) == K3_OK, "dump");
        FZ_CHECK(k3_chat_json_parse(x.p, x.n, "dumped", &b) == K3_OK, "dump parses");
        FZ_CHECK(k3_chat_json_dump(b, flags, &y) == K3_OK, "dump 2");
        FZ_CHECK(x.n == y.n && memcmp(x.p, y.p, x.n) == 0, "dump is a fixed point");
        k3_chat_json_free(b);
        k3_chat_buf_free(&x);
        k3_chat_buf_free(&y);
    }
    k3_chat_json_free(a);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    switch (data[0] % 4) {
    case 0:
    case 1:
        fuzz_parser(data + 1, size - 1, data[0] & 4);
        break;
    case 2:
        fuzz_render(data + 1, size - 1);
        break;
    default:
        fuzz_json(data + 1, size - 1);
        break;
    }
    return 0;
}

#ifndef K3_LIBFUZZER
/* ---- plain driver: generated inputs ------------------------------------------------------ */
static void put(k3_chat_buf *b, const char *s) {
    k3_chat_buf_puts(b, s);
}

static const char *pick(k3_rng *r, const char *const *v, size_t n) {
    return v[k3_rng_u64(r) % n];
}

/* A random JSON value (depth-limited) with Python-relevant lexemes. */
static void gen_value(k3_rng *r, k3_chat_buf *b, int depth) {
    static const char *const scalars[] = {"null",
                                          "true",
                                          "false",
                                          "0",
                                          "-0",
                                          "1.0",
                                          "1e5",
                                          "-1.5e-7",
                                          "123456789012345678901234567890",
                                          "NaN",
                                          "-Infinity",
                                          "\"\"",
                                          "\"x\"",
                                          "\"\\u00e9\\ud83e\\udd8a\"",
                                          "\"a\\\"b\\\\c\\n\"",
                                          "\"<|open|>\"",
                                          "\"&amp;\\\"\"",
                                          "\" \\t\"",
                                          "\"\\u0000\""};
    int k = (int)(k3_rng_u64(r) % (depth > 3 ? 1 : 4));
    if (k == 0) {
        put(b, pick(r, scalars, K3_ARRAY_LEN(scalars)));
        return;
    }
    static const char *const keys[] = {"\"a\"",       "\"B\"",    "\"id\"",   "\"URL\"",
                                       "\"_x\"",      "\"type\"", "\"name\"", "\"arguments\"",
                                       "\"content\"", "\"a\""};
    bool obj = k == 1 || k == 2;
    put(b, obj ? "{" : "[");
    int n = (int)(k3_rng_u64(r) % 4);
    for (int i = 0; i < n; i++) {
        if (i) put(b, ",");
        if (obj) {
            put(b, pick(r, keys, K3_ARRAY_LEN(keys)));
            put(b, ":");
        }
        gen_value(r, b, depth + 1);
    }
    put(b, obj ? "}" : "]");
}

/* Mode 0 inputs. A marker is the escape 0xFE k (k = k3_parser_marker); everything else is text. */
static void mark(k3_chat_buf *b, k3_parser_marker m) {
    uint8_t e[2] = {0xFE, (uint8_t)m};
    k3_chat_buf_put(b, e, 2);
}
static void tag(k3_chat_buf *b, k3_parser_marker m, const char *head) {
    mark(b, m);
    put(b, head);
    mark(b, K3_MARK_SEP);
}

static const char *const TEXTS[] = {
    "ab",       " 1",   "{\"a\": 1}", "\n",       ":",      "\xC3\xA9", "\xF0\x9F\xA6\x8A",
    "\xE2\x82", "\xFF", "null",       "<|open|>", "&quot;", "12.50",    "\""};

/* Random events: escapes and text pieces. */
static void gen_soup(k3_rng *r, k3_chat_buf *b) {
    size_t n = 1 + k3_rng_u64(r) % 200;
    for (size_t k = 0; k < n; k++) {
        uint64_t x = k3_rng_u64(r);
        if (x % 2 == 0) {
            uint8_t esc[2] = {0xFE, (uint8_t)(x >> 8)};
            k3_chat_buf_put(b, esc, 2);
        } else {
            put(b, TEXTS[(x >> 8) % K3_ARRAY_LEN(TEXTS)]);
        }
    }
}

/* A plausible K3 completion (reasoning, response, tools with typed args / json blocks), then
 * noise: random escapes or text spliced in, and truncation, so every state is reached. */
static void gen_completion(k3_rng *r, k3_chat_buf *b) {
    k3_chat_buf g = {0};
    static const char *const args[] = {"argument key=\"i\" type=\"number\"",
                                       "argument key=\"s\" type=\"string\"",
                                       "argument key=\"i\"",
                                       "argument key=\"n\"",
                                       "argument key=\"u\"",
                                       "argument key=\"zz\" type=\"object\"",
                                       "argument key=\"k&amp;&quot;\" type=\"boolean\"",
                                       "argument type=\"null\"",
                                       "json type=\"object\""};
    if (k3_rng_u64(r) % 4 == 0) tag(&g, K3_MARK_OPEN, "message role=\"assistant\" name=\"k\"");
    put(&g, TEXTS[k3_rng_u64(r) % K3_ARRAY_LEN(TEXTS)]);
    tag(&g, K3_MARK_CLOSE, "think");
    tag(&g, K3_MARK_OPEN, "response");
    put(&g, TEXTS[k3_rng_u64(r) % K3_ARRAY_LEN(TEXTS)]);
    tag(&g, K3_MARK_CLOSE, "response");
    if (k3_rng_u64(r) % 4) {
        tag(&g, K3_MARK_OPEN, "tools");
        int nc = 1 + (int)(k3_rng_u64(r) % 3);
        for (int c = 0; c < nc; c++) {
            tag(&g, K3_MARK_OPEN,
                k3_rng_u64(r) % 2 ? "call tool=\"t\" index=\"1\"" : "call tool=\"x&quot;\"");
            int na = (int)(k3_rng_u64(r) % 4);
            for (int a = 0; a < na; a++) {
                const char *h = args[k3_rng_u64(r) % K3_ARRAY_LEN(args)];
                tag(&g, K3_MARK_OPEN, h);
                int nt = (int)(k3_rng_u64(r) % 3);
                for (int t = 0; t < nt; t++) put(&g, TEXTS[k3_rng_u64(r) % K3_ARRAY_LEN(TEXTS)]);
                tag(&g, K3_MARK_CLOSE, strncmp(h, "json", 4) == 0 ? "json" : "argument");
            }
            tag(&g, K3_MARK_CLOSE, "call");
        }
        tag(&g, K3_MARK_CLOSE, "tools");
    }
    tag(&g, K3_MARK_CLOSE, "message");
    if (k3_rng_u64(r) % 2) mark(&g, K3_MARK_EOM);
    /* noise */
    int nn = (int)(k3_rng_u64(r) % 4);
    for (int i = 0; i < nn && g.n > 1; i++) {
        size_t at = k3_rng_u64(r) % g.n;
        if (at && (uint8_t)g.p[at - 1] == 0xFE) at--; /* keep escapes whole */
        k3_chat_buf t = {0};
        k3_chat_buf_put(&t, g.p, at);
        if (k3_rng_u64(r) % 2)
            mark(&t, (k3_parser_marker)(k3_rng_u64(r) % 6));
        else
            put(&t, TEXTS[k3_rng_u64(r) % K3_ARRAY_LEN(TEXTS)]);
        k3_chat_buf_put(&t, g.p + at, g.n - at);
        k3_chat_buf_free(&g);
        g = t;
    }
    size_t n = g.n;
    if (k3_rng_u64(r) % 4 == 0) n = k3_rng_u64(r) % (g.n + 1); /* truncation */
    k3_chat_buf_put(b, g.p, n);
    k3_chat_buf_free(&g);
}

/* A random chat request (mode 1), structurally close to real ones. */
static void gen_request(k3_rng *r, k3_chat_buf *b) {
    static const char *const roles[] = {"\"user\"",      "\"system\"", "\"assistant\"", "\"tool\"",
                                        "\"developer\"", "\"x\"",      "null"};
    static const char *const contents[] = {"\"hi\"",
                                           "null",
                                           "\"\"",
                                           "[{\"type\":\"text\",\"text\":\"a\"}]",
                                           "[{\"type\":\"image_url\"}]",
                                           "5",
                                           "[\"bad\"]",
                                           "\"<|sep|>\""};
    static const char *const args[] = {"{\"a\":1}", "\"{\\\"k\\\": [1, 2.0]}\"",
                                       "\"{bad\"",  "\"[1]\"",
                                       "null",      "\"  \"",
                                       "[1]",       "{\"s\":\"v\",\"n\":null,\"o\":{\"z\":1}}"};
    static const char *const ids[] = {"\"c1\"", "\"c2\"", "7", "null", "\"c1\""};
    put(b, "{\"messages\":[");
    int nm = (int)(k3_rng_u64(r) % 7);
    for (int i = 0; i < nm; i++) {
        if (i) put(b, ",");
        put(b, "{\"role\":");
        put(b, pick(r, roles, K3_ARRAY_LEN(roles)));
        put(b, ",\"content\":");
        put(b, pick(r, contents, K3_ARRAY_LEN(contents)));
        if (k3_rng_u64(r) % 3 == 0) {
            put(b, ",\"name\":");
            put(b, pick(r, ids, K3_ARRAY_LEN(ids)));
        }
        if (k3_rng_u64(r) % 3 == 0) {
            put(b, ",\"tool_call_id\":");
            put(b, pick(r, ids, K3_ARRAY_LEN(ids)));
        }
        if (k3_rng_u64(r) % 4 == 0) {
            put(b, ",\"reasoning_content\":");
            put(b, pick(r, contents, 3));
        }
        if (k3_rng_u64(r) % 3 == 0) {
            put(b, ",\"tool_calls\":[");
            int nc = (int)(k3_rng_u64(r) % 3);
            for (int c = 0; c < nc; c++) {
                if (c) put(b, ",");
                put(b, "{\"id\":");
                put(b, pick(r, ids, K3_ARRAY_LEN(ids)));
                put(b, ",\"function\":{\"name\":\"f\",\"arguments\":");
                put(b, pick(r, args, K3_ARRAY_LEN(args)));
                put(b, "}}");
            }
            put(b, "]");
        }
        if (k3_rng_u64(r) % 8 == 0) {
            put(b, ",\"tools\":");
            gen_value(r, b, 1);
        }
        put(b, "}");
    }
    put(b, "]");
    static const char *const extras[] = {
        ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{}}}]",
        ",\"tool_choice\":\"required\"",
        ",\"tool_choice\":\"none\"",
        ",\"tool_choice\":{\"a\":1}",
        ",\"response_format\":{\"type\":\"json_object\"}",
        ",\"response_format\":{\"type\":\"json_schema\"}",
        ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{\"b\":1,\"A\":"
        "2}}}",
        ",\"reasoning_effort\":\"none\"",
        ",\"thinking_effort\":\"medium\"",
        ",\"thinking\":false",
        ",\"chat_template_kwargs\":{\"enable_thinking\":false}",
        ",\"thinking\":\"x\"",
        ",\"add_generation_prompt\":false",
        ",\"add_generation_prompt\":null,\"thinking_effort\":null",
        ",\"continue_final_message\":true,\"add_generation_prompt\":false",
        ",\"continue_final_message\":true",
        ",\"continue_final_message\":3",
        ""};
    int ne = (int)(k3_rng_u64(r) % 3);
    for (int i = 0; i < ne; i++) put(b, pick(r, extras, K3_ARRAY_LEN(extras)));
    if (k3_rng_u64(r) % 4 == 0) {
        put(b, ",\"tools\":");
        gen_value(r, b, 0);
    }
    put(b, "}");
}

int main(int argc, char **argv) {
    long n_random = 2000;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--random") && i + 1 < argc)
            n_random = atol(argv[++i]);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 10);
        else {
            char *buf = NULL;
            size_t n = 0;
            if (k3_read_file(argv[i], &buf, &n) != K3_OK) {
                fprintf(stderr, "fuzz_parser: %s\n", k3_last_error());
                return 1;
            }
            LLVMFuzzerTestOneInput((const uint8_t *)buf, n);
            k3_free(buf);
        }
    }
    printf("fuzz_parser: seed %llu, %ld generated inputs\n", (unsigned long long)seed, n_random);
    k3_rng r;
    k3_rng_seed(&r, seed);
    k3_chat_buf b = {0};
    size_t n_rendered = 0;
    for (long i = 0; i < n_random; i++) {
        b.n = 0;
        uint8_t mode = (uint8_t)(k3_rng_u64(&r) & 0xFF);
        k3_chat_buf_put(&b, &mode, 1);
        if (mode % 4 <= 1) {
            if (k3_rng_u64(&r) % 4 == 0)
                gen_soup(&r, &b);
            else
                gen_completion(&r, &b);
        } else if (mode % 4 == 2) {
            gen_request(&r, &b);
            if (k3_rng_u64(&r) % 4 == 0 && b.n > 2) { /* mutate a byte */
                size_t at = 1 + k3_rng_u64(&r) % (b.n - 1);
                b.p[at] = (char)(k3_rng_u64(&r) & 0xFF);
            }
            k3_chat_request *req = NULL;
            if (k3_chat_request_parse(b.p + 1, b.n - 1, &req) == K3_OK) n_rendered++;
            k3_chat_request_destroy(req);
        } else {
            gen_value(&r, &b, 0);
        }
        LLVMFuzzerTestOneInput((const uint8_t *)b.p, b.n);
    }
    k3_chat_buf_free(&b);
    k3_chat_json_free(g_tools);
    printf("fuzz_parser: done, %zu requests parsed, %zu complete tool calls\n", n_rendered,
           g_complete_calls);
    /* generators that never reach a parseable request / a committed call would pass vacuously */
    return n_random < 100 || (n_rendered > 0 && g_complete_calls > 0) ? 0 : 1;
}
#endif
