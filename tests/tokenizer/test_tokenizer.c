/* test_tokenizer.c — unit tests of coordinator/k3_tokenizer.h.
 *
 * 1. The 74 regex-piece cases of tests/data/fixtures/tokenizer/k3-tokenizer-golden.json (pieces
 * made by tiktoken/fancy-regex with the original K3 pat_str) against k3_tok_split with the K3
 * pattern.
 * 2. BPE on a hand-made vocabulary with hand-computed merges (lowest rank first, leftmost on ties),
 *    on both the short-piece scan path and the long-piece heap path.
 * 3. Special tokens: longest match, never produced from text segments, lookup by content,
 *    tokenizer_config.json loading; K3 layout ids.
 * 4. Errors: malformed rank files and invalid UTF-8 give K3_ERR_* naming file:line / offset.
 * 5. Decoding: Python errors="replace" cases (expected strings computed with CPython), streaming
 *    equals whole decoding and never emits broken UTF-8.
 * 6. No quadratic blow-up: encoding time of 1 MiB vs 256 KiB (ratio bound, not absolute speed).
 * 7. (--spellings, a ctest of its own) The spellings of the Unicode classes
 * (coordinator/tokenizer.c): for every scalar value in several contexts, the default tokenizer
 * (BASE for text without a code point assigned after Unicode 14.0 in a class, ADDED for text with
 * one, on a PCRE2 with 14.0-16.0 tables) splits exactly like EXPLICIT (the whole classes as
 * ranges), for the K3, o200k and cl100k patterns (planes 4-13, all unassigned in Unicode 16.0,
 * sampled: one block in 16). tests/tokenizer/unicode_sweep.py proves the default against tiktoken;
 * this carries it to EXPLICIT, the spelling used with a PCRE2 of any other Unicode version. Needs
 * K3_TESTDATA (ctest sets it). */
#include <time.h>

#include "k3_test.h"
#include "k3_tokenizer.h"
#include "k3_utf8.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_tmp[256];

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        exit(1);
    }
    fputs(text, f);
    fclose(f);
}

static void b64(const uint8_t *p, size_t n, char *out) {
    static const char *A = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t w = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) |
                     (i + 2 < n ? p[i + 2] : 0);
        out[o++] = A[w >> 18 & 63];
        out[o++] = A[w >> 12 & 63];
        out[o++] = i + 1 < n ? A[w >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? A[w & 63] : '=';
    }
    out[o] = 0;
}

/* Hand vocabulary: byte b has rank b; 256 "ab", 257 "cd", 258 "abcd", 259 "bc", 260 "aa". */
static const char *extra_tokens[] = {"ab", "cd", "abcd", "bc", "aa"};

static void write_hand_vocab(const char *path, int skip_byte) {
    FILE *f = fopen(path, "wb");
    char enc[64];
    for (int b = 0; b < 256; b++) {
        if (b == skip_byte) continue;
        uint8_t c = (uint8_t)b;
        b64(&c, 1, enc);
        fprintf(f, "%s %d\n", enc, b);
    }
    for (int i = 0; i < 5; i++) {
        b64((const uint8_t *)extra_tokens[i], strlen(extra_tokens[i]), enc);
        fprintf(f, "%s %d\n", enc, 256 + i);
    }
    fclose(f);
}

static bool ids_eq(const k3_tok_ids *v, const int32_t *want, size_t n) {
    if (v->n != n) return false;
    for (size_t i = 0; i < n; i++)
        if (v->ids[i] != want[i]) return false;
    return true;
}

static void print_ids(const char *what, const k3_tok_ids *v) {
    fprintf(stderr, "%s:", what);
    for (size_t i = 0; i < v->n && i < 40; i++) fprintf(stderr, " %d", v->ids[i]);
    fprintf(stderr, "\n");
}

#define CHECK_ENC(t, text, special, ...)                                                           \
    do {                                                                                           \
        const int32_t want_[] = {__VA_ARGS__};                                                     \
        k3_tok_ids v_ = {0};                                                                       \
        K3_CHECK_OK(k3_tok_encode(t, text, strlen(text), special, &v_));                           \
        bool ok_ = ids_eq(&v_, want_, K3_ARRAY_LEN(want_));                                        \
        K3_CHECK(ok_, "encode(\"%s\", %d)", text, (int)(special));                                 \
        if (!ok_) print_ids("  got", &v_);                                                         \
        k3_tok_ids_free(&v_);                                                                      \
    } while (0)

static void test_hand_bpe(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/hand.tiktoken", g_tmp);
    write_hand_vocab(path, -1);
    const k3_tok_special sp[] = {{"<s>", 300}, {"<s>>", 301}, {"<|open|>", 302}};
    k3_tokenizer *t = NULL;
    K3_CHECK_OK(k3_tok_create_tiktoken(&t, path, sp, 3, NULL));
    if (!t) return;
    K3_CHECK(k3_tok_n_ranks(t) == 261 && k3_tok_n_vocab(t) == 303, "ranks %lld vocab %lld",
             (long long)k3_tok_n_ranks(t), (long long)k3_tok_n_vocab(t));
    CHECK_ENC(t, "abcd", false, 258);       /* the whole piece is a token */
    CHECK_ENC(t, "abcde", false, 258, 'e'); /* ab -> cd -> abcd */
    CHECK_ENC(t, "aaa", false, 260, 'a');   /* tie: leftmost pair merges first */
    CHECK_ENC(t, "bcd", false, 'b', 257);   /* cd (257) ranks below bc (259) */
    CHECK_ENC(t, "xbcdx", false, 'x', 'b', 257, 'x');
    /* Long pieces go through the heap path (> 48 bytes): same rules. */
    {
        char a100[102];
        memset(a100, 'a', 101);
        a100[101] = 0;
        k3_tok_ids v = {0};
        K3_CHECK_OK(k3_tok_encode(t, a100, 101, false, &v));
        bool ok = v.n == 51 && v.ids[50] == 'a';
        for (size_t i = 0; ok && i < 50; i++) ok = v.ids[i] == 260;
        K3_CHECK(ok, "101 x 'a' -> 50 x 260 + 'a'");
        k3_tok_ids_free(&v);
        char s[101];
        for (int i = 0; i < 20; i++) memcpy(s + 5 * i, "abcde", 5);
        s[100] = 0;
        K3_CHECK_OK(k3_tok_encode(t, s, 100, false, &v));
        ok = v.n == 40;
        for (size_t i = 0; ok && i < 40; i++) ok = v.ids[i] == (i % 2 ? 'e' : 258);
        K3_CHECK(ok, "20 x abcde -> 20 x (258, 'e')");
        if (!ok) print_ids("  got", &v);
        k3_tok_ids_free(&v);
    }
    /* Specials: longest match, only when allowed. */
    CHECK_ENC(t, "a<s>>b", true, 'a', 301, 'b');
    CHECK_ENC(t, "a<s>b", true, 'a', 300, 'b');
    CHECK_ENC(t, "a<s>>b", false, 'a', '<', 's', '>', '>', 'b'); /* pieces a | <s | >> | b */
    CHECK_ENC(t, "<|open|><|open|>", true, 302, 302);
    CHECK_ENC(t, "<|open|>", false, '<', '|', 'o', 'p', 'e', 'n', '|', '>');
    CHECK_ENC(t, "", true, );
    {
        size_t *off = NULL, np = 0;
        K3_CHECK_OK(k3_tok_split(t, "a<s>>b", 6, &off, &np));
        K3_CHECK(np == 4 && off[1] == 1 && off[3] == 3 && off[5] == 5 && off[7] == 6,
                 "pieces of a<s>>b");
        free(off);
    }
    K3_CHECK(k3_tok_special_id(t, "<s>>") == 301 && k3_tok_special_id(t, "<s>>>") == -1,
             "special lookup");
    K3_CHECK(k3_tok_is_special(t, 300) && !k3_tok_is_special(t, 97) && !k3_tok_is_special(t, 299),
             "is_special");
    k3_tok_ctrl c = k3_tok_control_ids(t);
    K3_CHECK(c.open == 302 && c.close == -1 && c.end_of_msg == -1, "control ids by content");
    /* NUL is an ordinary character (encode takes a length). */
    {
        k3_tok_ids v = {0};
        K3_CHECK_OK(k3_tok_encode(t, "a\0b", 3, false, &v));
        const int32_t w[] = {'a', 0, 'b'};
        K3_CHECK(ids_eq(&v, w, 3), "NUL inside text");
        k3_tok_ids_free(&v);
    }
    /* Invalid UTF-8 is rejected, naming the offset; the output is left as it was. */
    {
        k3_tok_ids v = {0};
        K3_CHECK_OK(k3_tok_encode(t, "ab", 2, false, &v));
        K3_CHECK_ERR(k3_tok_encode(t,
                                   "ab\xff"
                                   "cd",
                                   5, false, &v),
                     K3_ERR_ARG, "byte offset 2");
        K3_CHECK_ERR(k3_tok_encode(t, "x\xed\xa0\x80", 4, true, &v), K3_ERR_ARG, "byte offset 1");
        K3_CHECK_ERR(k3_tok_encode(t, "\xc3", 1, true, &v), K3_ERR_ARG, "not valid UTF-8");
        K3_CHECK(v.n == 1 && v.ids[0] == 256, "failed encode leaves the output untouched");
        k3_tok_segment segs[] = {{"ab", 2, false}, {"<s>", 3, true}, {"<s>", 3, false}};
        K3_CHECK_OK(k3_tok_encode_segments(t, segs, 3, &v));
        const int32_t w[] = {256, 256, 300, '<', 's', '>'};
        K3_CHECK(ids_eq(&v, w, 6), "encode_segments = concat of per-segment encodings");
        k3_tok_ids_free(&v);
    }
    {
        const char *b;
        size_t nb;
        K3_CHECK(k3_tok_id_bytes(t, 258, &b, &nb) == K3_OK && nb == 4 && !memcmp(b, "abcd", 4),
                 "id bytes");
        K3_CHECK(k3_tok_id_bytes(t, 301, &b, &nb) == K3_OK && nb == 4 && !memcmp(b, "<s>>", 4),
                 "special bytes");
        K3_CHECK_ERR(k3_tok_id_bytes(t, 299, &b, &nb), K3_ERR_ARG, "299");
        K3_CHECK_ERR(k3_tok_id_bytes(t, -1, &b, &nb), K3_ERR_ARG, "-1");
    }
    k3_tok_destroy(t);
    k3_tok_destroy(NULL);
}

static void test_load_errors(void) {
    char path[1024], dir[512];
    k3_tokenizer *t = NULL;
    snprintf(path, sizeof path, "%s/bad.tiktoken", g_tmp);
    K3_CHECK_ERR(k3_tok_create_tiktoken(&t, "/nonexistent/x.tiktoken", NULL, 0, NULL), K3_ERR_IO,
                 "/nonexistent/x.tiktoken");
    write_file(path, "YQ== 0\n!!!! 1\n");
    K3_CHECK_ERR(k3_tok_create_tiktoken(&t, path, NULL, 0, NULL), K3_ERR_FORMAT,
                 "bad.tiktoken:2: bad base64");
    write_file(path, "YQ== 0\nYg== x\n");
    K3_CHECK_ERR(k3_tok_create_tiktoken(&t, path, NULL, 0, NULL), K3_ERR_FORMAT,
                 "bad.tiktoken:2: bad rank");
    write_file(path, "YQ== 0\nYg==\n");
    K3_CHECK_ERR(k3_tok_create_tiktoken(&t, path, NULL, 0, NULL), K3_ERR_FORMAT,
                 "bad.tiktoken:2: expected");
    write_file(path, "YQ== 0\nYg== 0\n");
    K3_CHECK_ERR(k3_tok_create_tiktoken(&t, path, NULL, 0, NULL), K3_ERR_FORMAT,
                 "rank 0 appears twice");
    write_file(path, "");
    K3_CHECK_ERR(k3_tok_create_tiktoken(&t, path, NULL, 0, NULL), K3_ERR_FORMAT, "no tokens");
    write_hand_vocab(path, 0x41);
    K3_CHECK_ERR(k3_tok_create_tiktoken(&t, path, NULL, 0, NULL), K3_ERR_FORMAT,
                 "single byte 0x41");
    write_hand_vocab(path, -1);
    const k3_tok_special clash[] = {{"<x>", 97}};
    K3_CHECK_ERR(k3_tok_create_tiktoken(&t, path, clash, 1, NULL), K3_ERR_ARG, "collides");
    const k3_tok_special dup[] = {{"<x>", 300}, {"<x>", 301}};
    K3_CHECK_ERR(k3_tok_create_tiktoken(&t, path, dup, 2, NULL), K3_ERR_FORMAT, "defined twice");
    const k3_tok_special dupid[] = {{"<x>", 300}, {"<y>", 300}};
    K3_CHECK_ERR(k3_tok_create_tiktoken(&t, path, dupid, 2, NULL), K3_ERR_ARG, "given twice");
    K3_CHECK(t == NULL, "no tokenizer on failure");
    /* Model directory with tokenizer_config.json. */
    snprintf(dir, sizeof dir, "%s/model", g_tmp);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/tiktoken.model", dir);
    write_hand_vocab(path, -1);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    write_file(path,
               "{\"added_tokens_decoder\": {\"261\": {\"content\": \"[EOS]\", \"special\": true},"
               "\"262\": {\"content\": \"<|end_of_msg|>\"}, \"263\": {\"content\": \"<|open|>\"},"
               "\"264\": {\"content\": \"<|close|>\"}, \"265\": {\"content\": \"<|sep|>\"}}}");
    K3_CHECK_OK(k3_tok_create_model_dir(&t, dir, NULL));
    if (t) {
        k3_tok_ctrl c = k3_tok_control_ids(t);
        K3_CHECK(c.eos == 261 && c.end_of_msg == 262 && c.open == 263 && c.close == 264 &&
                     c.sep == 265,
                 "control ids from tokenizer_config.json");
        CHECK_ENC(t, "<|open|>ab<|sep|>", true, 263, 256, 265);
        k3_tok_destroy(t);
        t = NULL;
    }
    write_file(path, "{\"added_tokens_decoder\": {\"x1\": {\"content\": \"[EOS]\"}}}");
    K3_CHECK_ERR(k3_tok_create_model_dir(&t, dir, NULL), K3_ERR_FORMAT, "key 'x1'");
    write_file(path, "{\"added_tokens_decoder\": {\"300\": {\"contents\": \"[EOS]\"}}}");
    K3_CHECK_ERR(k3_tok_create_model_dir(&t, dir, NULL), K3_ERR_FORMAT, "[\"300\"].content");
    write_file(path, "{\"added_tokens_decoder\": [}");
    K3_CHECK_ERR(k3_tok_create_model_dir(&t, dir, NULL), K3_ERR_FORMAT,
                 "tokenizer_config.json: not valid JSON");
    k3_tok_pattern p;
    K3_CHECK_ERR(k3_tok_pattern_from_name("gpt2", &p), K3_ERR_ARG, "gpt2");
}

/* The golden pre-tokenizer pieces (K3 regex) + K3 layout checks on the o200k vocabulary. */
static void test_golden_pieces(const k3_tokenizer *t) {
    char path[1024];
    snprintf(path, sizeof path, "%s/fixtures/tokenizer/k3-tokenizer-golden.json", k3_test_data());
    char *buf = NULL;
    size_t n = 0;
    K3_CHECK_OK(k3_read_file(path, &buf, &n));
    if (!buf) return;
    cJSON *root = cJSON_Parse(buf);
    k3_free(buf);
    const cJSON *cases = cJSON_GetObjectItem(root, "cases"), *c;
    int n_with = 0, n_ok = 0;
    cJSON_ArrayForEach(c, cases) {
        const cJSON *in = cJSON_GetObjectItem(c, "input"),
                    *pieces = cJSON_GetObjectItem(c, "pieces");
        if (!pieces) continue;
        n_with++;
        size_t *off = NULL, np = 0;
        const char *s = in->valuestring;
        K3_CHECK_OK(k3_tok_split(t, s, strlen(s), &off, &np));
        bool ok = (int)np == cJSON_GetArraySize(pieces);
        for (size_t i = 0; ok && i < np; i++) {
            const char *want = cJSON_GetArrayItem(pieces, (int)i)->valuestring;
            ok = strlen(want) == off[2 * i + 1] - off[2 * i] &&
                 !memcmp(want, s + off[2 * i], strlen(want));
        }
        if (ok) n_ok++;
        K3_CHECK(ok, "golden pieces of \"%s\"", s);
        free(off);
    }
    cJSON_Delete(root);
    K3_CHECK(n_with == 74 && n_ok == 74, "%d of %d golden piece cases pass (want 74)", n_ok,
             n_with);
    /* K3 layout at N = max rank + 1 (§4.1): named slots and reserved names. */
    int64_t N = k3_tok_n_ranks(t);
    k3_tok_ctrl ctl = k3_tok_control_ids(t);
    K3_CHECK(ctl.eos == N + 1 && ctl.end_of_msg == N + 2 && ctl.open == N + 3 &&
                 ctl.close == N + 4 && ctl.sep == N + 5,
             "K3 control ids at N+1..N+5");
    char name[64];
    snprintf(name, sizeof name, "<|reserved_token_%lld|>", (long long)(N + 8));
    K3_CHECK(k3_tok_special_id(t, name) == N + 8, "%s", name);
    K3_CHECK(k3_tok_special_id(t, "<|media_pad|>") == N + 21 &&
                 k3_tok_special_id(t, "[PAD]") == N + 255 && k3_tok_n_vocab(t) == N + 256,
             "K3 layout");
}

static void test_decode(const k3_tokenizer *t) {
    /* bytes -> CPython bytes.decode("utf-8", "replace"), expected values computed with CPython. */
    static const struct {
        const char *in;
        size_t n;
        const char *want;
    } rep[] = {
        {"\xe4\xbd", 2, "\xef\xbf\xbd"},
        {"\xed\xa0\x80", 3, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"},
        {"\xf0\x9f\x98"
         "a",
         4,
         "\xef\xbf\xbd"
         "a"},
        {"\xff\xfe", 2, "\xef\xbf\xbd\xef\xbf\xbd"},
        {"\xc0\xaf", 2, "\xef\xbf\xbd\xef\xbf\xbd"},
        {"\xe0\x80\x80", 3, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"},
        {"\xf4\x90\x80\x80", 4, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"},
        {"a\xf0\x9f\x98\x80"
         "b",
         6,
         "a\xf0\x9f\x98\x80"
         "b"},
        {"\xe2\x82", 2, "\xef\xbf\xbd"},
        {"\xc3", 1, "\xef\xbf\xbd"},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(rep); i++) {
        k3_tok_bytes out = {0};
        K3_CHECK_OK(k3_tok_utf8_replace(rep[i].in, rep[i].n, &out));
        K3_CHECK(out.n == strlen(rep[i].want) && !memcmp(out.data, rep[i].want, out.n),
                 "replace case %zu", i);
        k3_tok_bytes_free(&out);
        /* Streaming one byte at a time gives the same text. */
        k3_tok_stream *s = NULL;
        K3_CHECK_OK(k3_tok_stream_create(&s, t));
        for (size_t k = 0; k < rep[i].n; k++)
            K3_CHECK_OK(k3_tok_stream_push_bytes(s, rep[i].in + k, 1, &out));
        K3_CHECK_OK(k3_tok_stream_finish(s, &out));
        K3_CHECK(out.n == strlen(rep[i].want) && !memcmp(out.data, rep[i].want, out.n),
                 "stream case %zu", i);
        k3_tok_bytes_free(&out);
        k3_tok_stream_destroy(s);
    }
    /* Round trip and streaming over real ids: multi-byte characters split across tokens. */
    /* Grusse, a ZWJ family emoji, CJK + English, Arabic, U+2A6A5, e + U+0301, <|open|>, the
     * rainbow flag (ZWJ + VS16): valid UTF-8 spelled in bytes. */
    const char *text = "Gr\xc3\xbc\xc3\x9f"
                       "e \xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d"
                       "\xf0\x9f\x91\xa7\xe2\x80\x8d\xf0\x9f\x91\xa6 \xe4\xb8\xad"
                       "\xe6\x96\x87"
                       "English\xe6\xb7\xb7\xe5\x90\x88 \xd9\x85\xd8\xb1\xd8\xad"
                       "\xd8\xa8\xd8\xa7 \xf0\xaa\x9a\xa5 e\xcc\x81 <|open|> \xf0"
                       "\x9f\x8f\xb3\xef\xb8\x8f\xe2\x80\x8d\xf0\x9f\x8c\x88";
    for (int special = 0; special < 2; special++) {
        k3_tok_ids ids = {0};
        K3_CHECK_OK(k3_tok_encode(t, text, strlen(text), special, &ids));
        k3_tok_bytes whole = {0}, streamed = {0};
        K3_CHECK_OK(k3_tok_decode(t, ids.ids, ids.n, &whole));
        K3_CHECK(whole.n == strlen(text) && !memcmp(whole.data, text, whole.n),
                 "decode(encode(s)) == s");
        k3_tok_stream *s = NULL;
        K3_CHECK_OK(k3_tok_stream_create(&s, t));
        int n_partial = 0;
        for (size_t i = 0; i < ids.n; i++) {
            size_t before = streamed.n;
            K3_CHECK_OK(k3_tok_stream_push(s, ids.ids[i], &streamed));
            k3_tok_bytes chk = {0};
            K3_CHECK_OK(k3_tok_utf8_replace(streamed.data + before, streamed.n - before, &chk));
            K3_CHECK(chk.n == streamed.n - before, "stream chunk %zu is valid UTF-8", i);
            k3_tok_bytes_free(&chk);
            const char *b;
            size_t nb;
            k3_tok_id_bytes(t, ids.ids[i], &b, &nb);
            if (streamed.n - before != nb) n_partial++;
        }
        K3_CHECK_OK(k3_tok_stream_finish(s, &streamed));
        K3_CHECK(streamed.n == whole.n && !memcmp(streamed.data, whole.data, whole.n),
                 "stream == decode");
        K3_CHECK(n_partial > 0, "the text must split characters across tokens (non-degenerate)");
        k3_tok_stream_destroy(s);
        k3_tok_bytes_free(&whole);
        k3_tok_bytes_free(&streamed);
        k3_tok_ids_free(&ids);
    }
}

/* CPU time of this thread: unlike wall time it does not grow when other processes share the
 * cores (the suite runs tests in parallel on 2 cores), so the ratio below measures the algorithm.
 */
static double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double time_encode(const k3_tokenizer *t, const char *s, size_t n, size_t *n_ids) {
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        k3_tok_ids v = {0};
        double t0 = thread_cpu_s();
        k3_status st = k3_tok_encode(t, s, n, false, &v);
        double dt = thread_cpu_s() - t0;
        K3_CHECK(st == K3_OK, "encode %zu bytes: %s", n, k3_last_error());
        *n_ids = v.n;
        k3_tok_ids_free(&v);
        if (dt < best) best = dt;
    }
    return best;
}

/* Quadratic behaviour shows as a x16 time ratio for x4 input; linear / n log n as ~x4-5. */
static void test_no_quadratic(const k3_tokenizer *t, const char *label) {
    size_t big = 1 << 20, small = big / 4;
    char *s = malloc(big + 1);
    k3_rng rng;
    k3_rng_seed(&rng, 1234);
    for (int kind = 0; kind < 2; kind++) {
        if (kind == 0) {
            memset(s, 'a', big);
        } else { /* random printable ASCII letters/punctuation without spaces: long regex pieces */
            for (size_t i = 0; i < big; i++) s[i] = (char)('!' + k3_rng_u64(&rng) % 94);
        }
        size_t ids_small, ids_big;
        double ts = time_encode(t, s, small, &ids_small), tb = time_encode(t, s, big, &ids_big);
        double ratio = tb / (ts > 1e-4 ? ts : 1e-4);
        printf("  %s %s: 256 KiB %.3fs, 1 MiB %.3fs (x%.1f), %.1f MB/s\n", label,
               kind ? "random ASCII" : "'a' run", ts, tb, ratio, big / tb / 1e6);
        K3_CHECK(ratio < 8.0, "%s: 4x input took %.1fx time (quadratic?)", label, ratio);
        K3_CHECK(ids_big > ids_small && ids_small > 1000, "non-degenerate token counts");
    }
    free(s);
}

/* Blocks of 64 code points, each in 6 contexts that show membership in every class (a+c: lower
 * letters, A+c: letters, 中+c: Han, 1c2: numbers, c+\n: letters/numbers/space, !!+c: L|N as
 * the end of a punctuation run), split by the
 * default and the EXPLICIT tokenizer: the piece offsets must be equal. Blocks keep BASE and ADDED
 * apart (a block without a new code point uses BASE). */
static void test_spellings(const char *path) {
    static const char *const names[] = {"k3", "o200k", "cl100k"};
    char *text = malloc(64 * 6 * 16);
    long n_blocks = 0, n_diff = 0;
    for (int pat = 0; pat < 3; pat++) {
        k3_tok_options oa = {.pattern = (k3_tok_pattern)pat};
        k3_tok_options ob = {.pattern = (k3_tok_pattern)pat, .explicit_unicode_classes = true};
        k3_tokenizer *a = NULL, *b = NULL;
        K3_CHECK_OK(k3_tok_create_tiktoken(&a, path, NULL, 0, &oa));
        K3_CHECK_OK(k3_tok_create_tiktoken(&b, path, NULL, 0, &ob));
        if (!a || !b) break;
        K3_CHECK(k3_tok_explicit_classes(b), "explicit_unicode_classes is honoured");
        if (pat == 0)
            printf("  default spelling: %s\n",
                   k3_tok_explicit_classes(a) ? "EXPLICIT (PCRE2 tables of another Unicode version)"
                                              : "BASE + ADDED");
        for (uint32_t start = 0; start < 0x110000; start += 64) {
            if (start >= 0x40000 && start < 0xE0000 && (start / 64) % 16) continue;
            size_t n = 0;
            for (uint32_t cp = start; cp < start + 64; cp++) {
                if (cp >= 0xD800 && cp <= 0xDFFF) continue;
                uint8_t c[4];
                size_t l = k3_utf8_put(cp, c);
                static const char *const pre[] = {"a", "A", "\xE4\xB8\xAD", "1", "", "!!"};
                static const char *const post[] = {"", "", "", "2", "\n", ""};
                for (int k = 0; k < 6; k++) {
                    memcpy(text + n, pre[k], strlen(pre[k]));
                    n += strlen(pre[k]);
                    memcpy(text + n, c, l);
                    n += l;
                    memcpy(text + n, post[k], strlen(post[k]));
                    n += strlen(post[k]);
                }
            }
            size_t *pa = NULL, *pb = NULL, na = 0, nb = 0;
            k3_status sa = k3_tok_split(a, text, n, &pa, &na);
            k3_status sb = k3_tok_split(b, text, n, &pb, &nb);
            n_blocks++;
            if (sa != K3_OK || sb != K3_OK || na != nb || memcmp(pa, pb, 2 * na * sizeof *pa)) {
                if (n_diff++ < 5)
                    fprintf(stderr, "  %s: block U+%04X: %zu vs %zu pieces\n", names[pat],
                            (unsigned)start, na, nb);
            }
            free(pa);
            free(pb);
        }
        k3_tok_destroy(a);
        k3_tok_destroy(b);
    }
    free(text);
    K3_CHECK(n_blocks == 3 * (0x40000 / 64 + 0xA0000 / 64 / 16 + 0x30000 / 64),
             "every block was split (%ld)", n_blocks);
    K3_CHECK(n_diff == 0, "%ld blocks split differently by the default and the EXPLICIT spelling",
             n_diff);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--spellings") == 0) { /* its own ctest: ~20 s */
        char vocab[1024];
        snprintf(vocab, sizeof vocab, "%s/vocab/o200k_base.tiktoken", k3_test_data());
        test_spellings(vocab);
        return k3_test_done("tokenizer-spellings");
    }
    snprintf(g_tmp, sizeof g_tmp, "/tmp/k3_test_tok_%d", (int)getpid());
    mkdir(g_tmp, 0755);
    test_hand_bpe();
    test_load_errors();
    char path[1024];
    snprintf(path, sizeof path, "%s/vocab/o200k_base.tiktoken", k3_test_data());
    k3_tokenizer *t = NULL;
    K3_CHECK_OK(k3_tok_create_tiktoken(&t, path, NULL, K3_TOK_K3_LAYOUT, NULL));
    if (t) {
        test_golden_pieces(t);
        test_decode(t);
        test_no_quadratic(t, "kimi-chunked");
        k3_tok_destroy(t);
    }
    k3_tok_options raw = {.no_kimi_chunking = true};
    K3_CHECK_OK(k3_tok_create_tiktoken(&t, path, NULL, K3_TOK_K3_LAYOUT, &raw));
    if (t) {
        test_no_quadratic(t, "unchunked");
        k3_tok_destroy(t);
    }
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_tmp);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_tmp);
    return k3_test_done("tokenizer");
}
