/* bench_tokenizer.c — encode throughput of the k3 tokenizer vs PyPI tiktoken on the same text.
 * Not pass/fail (STYLE.md §22): prints a table and writes JSON.
 *
 * usage: bench_tokenizer [--vocab FILE.tiktoken] [--text FILE] [--mb N] [--seed S] [--json OUT]
 * Without --text it generates N MB (default 4) of mixed text (English-like prose, code, CJK,
 * digits, whitespace runs) from a seeded k3_rng. tiktoken is timed by `python3` on the same file
 * (same vocabulary, same pattern, K3 specials) when tiktoken is importable; otherwise "n/a".
 * Both sides encode the whole text as one ordinary segment (no specials) with the K3 pattern and
 * WITHOUT the Kimi 400k/25k chunking (raw tiktoken semantics), so the id counts must agree. */
#include "k3_tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* tests/data of the tree this was built from (tests/CMakeLists.txt), when K3_TESTDATA is unset */
#ifndef K3_TESTDATA_DEFAULT
#define K3_TESTDATA_DEFAULT "tests/data"
#endif

static const char *words[] = {"the",    "of",         "and",         "to",    "in",        "is",
                              "that",   "for",        "it",          "with",  "as",        "was",
                              "on",     "model",      "token",       "Kimi",  "attention", "expert",
                              "layer",  "HTTPServer", "getUserName", "don't", "we're",     "naïve",
                              "Straße", "München",    "résumé",      "über"};
static const char *code = "for (int i = 0; i < n; i++) {\n    sum += a[i] * b[i];\n}\n";
static const char *cjk[] = {"你好", "世界", "模型", "注意力", "专家", "日本語", "한국어"};

static size_t gen_text(char *buf, size_t cap, uint64_t seed) {
    k3_rng r;
    k3_rng_seed(&r, seed);
    size_t n = 0;
    while (n + 128 < cap) {
        uint64_t x = k3_rng_u64(&r);
        int kind = (int)(x % 100);
        const char *s;
        char num[32];
        if (kind < 70)
            s = words[(x >> 8) % K3_ARRAY_LEN(words)];
        else if (kind < 75)
            s = code;
        else if (kind < 85)
            s = cjk[(x >> 8) % K3_ARRAY_LEN(cjk)];
        else if (kind < 92) {
            snprintf(num, sizeof num, "%llu", (unsigned long long)((x >> 16) % 100000));
            s = num;
        } else if (kind < 96)
            s = ".\n";
        else
            s = ", ";
        size_t l = strlen(s);
        memcpy(buf + n, s, l);
        n += l;
        if (kind < 70 || kind >= 85) buf[n++] = ' ';
    }
    buf[n] = 0;
    return n;
}

static const char *py =
    "import sys,time,base64,tiktoken\n"
    "vocab,textf=sys.argv[1],sys.argv[2]\n"
    "r={}\n"
    "for l in open(vocab,'rb'):\n"
    "  if l.strip():\n"
    "    b,k=l.split(); r[base64.b64decode(b)]=int(k)\n"
    "P='|'.join([r'[\\p{Han}]+',r\"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^"
    "\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?\","
    "r\"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{"
    "Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?\","
    "r'\\p{N}{1,3}',r' ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*',r'\\s*[\\r\\n]+',r'\\s+(?!\\S)',r'\\s+'])\n"
    "e=tiktoken.Encoding('k3bench',pat_str=P,mergeable_ranks=r,special_tokens={})\n"
    "t=open(textf,encoding='utf-8').read(); nb=len(t.encode())\n"
    "best=1e9\n"
    "for _ in range(3):\n"
    "  t0=time.perf_counter(); ids=e.encode_ordinary(t); best=min(best,time.perf_counter()-t0)\n"
    "print(nb/best/1e6, len(ids))\n";

int main(int argc, char **argv) {
    const char *vocab = NULL, *text_path = NULL, *json_path = "bench_tokenizer.json";
    double mb = 4;
    uint64_t seed = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--vocab"))
            vocab = argv[i + 1];
        else if (!strcmp(argv[i], "--text"))
            text_path = argv[i + 1];
        else if (!strcmp(argv[i], "--mb"))
            mb = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed"))
            seed = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--json"))
            json_path = argv[i + 1];
        else {
            fprintf(stderr, "bench_tokenizer: unknown flag %s\n", argv[i]);
            return 2;
        }
    }
    char vbuf[1024];
    if (!vocab) {
        snprintf(vbuf, sizeof vbuf, "%s/vocab/o200k_base.tiktoken",
                 getenv("K3_TESTDATA") ? getenv("K3_TESTDATA") : K3_TESTDATA_DEFAULT);
        vocab = vbuf;
    }
    char *text = NULL;
    size_t n = 0;
    if (text_path) {
        if (k3_read_file(text_path, &text, &n) != K3_OK) {
            fprintf(stderr, "bench_tokenizer: %s\n", k3_last_error());
            return 1;
        }
    } else {
        size_t cap = (size_t)(mb * 1e6) + 256;
        text = malloc(cap);
        if (!text) return 1;
        n = gen_text(text, cap, seed);
    }
    k3_tokenizer *t = NULL;
    double t0 = k3_now_s();
    const k3_tok_options raw = {.pattern = K3_TOK_PAT_K3, .no_kimi_chunking = true};
    if (k3_tok_create_tiktoken(&t, vocab, NULL, K3_TOK_K3_LAYOUT, &raw) != K3_OK) {
        fprintf(stderr, "bench_tokenizer: %s\n", k3_last_error());
        return 1;
    }
    double t_load = k3_now_s() - t0, best = 1e30;
    k3_tok_ids ids = {0};
    for (int rep = 0; rep < 3; rep++) {
        ids.n = 0;
        t0 = k3_now_s();
        if (k3_tok_encode(t, text, n, false, &ids) != K3_OK) {
            fprintf(stderr, "bench_tokenizer: %s\n", k3_last_error());
            return 1;
        }
        double dt = k3_now_s() - t0;
        if (dt < best) best = dt;
    }
    double k3_mbs = n / best / 1e6;
    /* tiktoken on the same bytes */
    char tmp[] = "/tmp/k3_bench_tok_XXXXXX";
    int fd = mkstemp(tmp);
    double tk_mbs = -1;
    long tk_ids = -1;
    if (fd >= 0 && write(fd, text, n) == (ssize_t)n) {
        close(fd);
        char pyf[] = "/tmp/k3_bench_tok_py_XXXXXX";
        int pfd = mkstemp(pyf);
        if (pfd >= 0 && write(pfd, py, strlen(py)) == (ssize_t)strlen(py)) {
            close(pfd);
            char cmd[4096];
            snprintf(cmd, sizeof cmd, "python3 %s '%s' '%s' 2>/dev/null", pyf, vocab, tmp);
            FILE *p = popen(cmd, "r");
            if (p) {
                if (fscanf(p, "%lf %ld", &tk_mbs, &tk_ids) != 2) tk_mbs = -1;
                pclose(p);
            }
        }
        unlink(pyf);
    }
    unlink(tmp);
    printf("tokenizer encode throughput (%.2f MB text, seed %llu, K3 pattern, vocab %s)\n", n / 1e6,
           (unsigned long long)seed, vocab);
    printf("  %-10s %10s %12s\n", "impl", "MB/s", "ids");
    printf("  %-10s %10.2f %12zu   (vocab load %.2fs)\n", "k3", k3_mbs, ids.n, t_load);
    if (tk_mbs > 0)
        printf("  %-10s %10.2f %12ld%s\n", "tiktoken", tk_mbs, tk_ids,
               tk_ids == (long)ids.n ? "" : "  (id count differs!)");
    else
        printf("  %-10s %10s\n", "tiktoken", "n/a");
    FILE *jf = fopen(json_path, "w");
    if (jf) {
        fprintf(
            jf,
            "{\"bench\":\"tokenizer\",\"bytes\":%zu,\"seed\":%llu,\"k3_mb_s\":%.3f,\"k3_ids\":%zu,"
            "\"tiktoken_mb_s\":%.3f,\"tiktoken_ids\":%ld}\n",
            n, (unsigned long long)seed, k3_mbs, ids.n, tk_mbs, tk_ids);
        fclose(jf);
    }
    k3_tok_ids_free(&ids);
    k3_tok_destroy(t);
    if (text_path)
        k3_free(text);
    else
        free(text);
    return 0;
}
