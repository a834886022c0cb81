/* cmd_batch.c — `k3 batch --model DIR --input IN.jsonl --output OUT.jsonl`: an OpenAI Batch API
 * file of chat and completions requests through the engine (rank/k3_engine.h) on any S x E,
 * resumable; each line answered as `k3 serve` answers its body.
 *
 * Owns: the batch file formats, the validation of the input, the resume of the output, feeding
 * the engine (a bounded window of requests in flight), one output line per request as soon as
 * every choice of it ends, the progress line and the summary; two prep threads parse the lines
 * (and compile their grammars) ahead of the step loop. Only rank 0 reads and writes files
 * and tokenizes; the other ranks serve the engine. Does not own: a body -> choices, engine
 * requests and the response or error body (serve's own code, without HTTP: k3_server_req_* in
 * server/k3_server.h), the engine flags (engine_args.h).
 *
 * Input: one JSON object a line, {"custom_id": "<unique non-empty string>", "method": "POST",
 * "url": "/v1/chat/completions" | "/v1/completions", "body": {<request>}}; blank lines are
 * skipped. The body is what `k3 serve` takes at that url (n, echo, prompt lists, logprobs,
 * prompt_logprobs, tools, structured outputs ...); "stream": true alone is refused (one body a
 * line). A line that is not such an object (not JSON, no custom_id, a custom_id used before,
 * another method, a url that is not a string, no body object) fails the whole job before the
 * model loads, every bad line named (the OpenAI batch validation): such a line cannot get an
 * output line. Another url fails its own line (serve's 404).
 * Output: one line per request, in the order requests finish:
 *   {"id": "batch_req_<hex>", "custom_id": ..., "response": {"status_code": S, "request_id":
 *    "req_<hex>", "body": B}, "error": null}
 * with S and B serve's answer to the body: 200 and a chat.completion / text_completion (every
 * choice, the usage summed as serve sums it), or serve's status and error body {"error":
 * {"message", "type", "param": null, "code": S}} (a refused key, another model: 404, a context
 * overflow, the engine's error event: the first failed choice answers). The job goes on; failed
 * lines are results too (readers tell them by response.status_code, as in OpenAI's batches).
 * Request defaults are serve's (OpenAI's); --max-tokens is the max_tokens of a request that
 * sets none; the seed of a request without one comes from --seed and its custom_id (copy c of
 * n: + c), so a rerun or a resume samples the same tokens.
 * Resume: custom_ids already in OUT are skipped (error lines included: delete them to retry); a
 * truncated last line (a killed run) is cut off first; new lines are appended. OUT is locked
 * (flock) while a job writes it. */
#include "k3_launcher.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "chat_job.h"
#include "engine_args.h"
#include "k3_engine_test.h"
#include "k3_comm.h"
#include "k3_model.h"
#include "k3_run.h"
#include "k3_server.h"

static const k3_flag flags[] = {
    {"model", K3_FLAG_STR, "DIR", NULL, "checkpoint directory (config.json + safetensors)"},
    {"input", K3_FLAG_STR, "IN.jsonl", NULL,
     "requests, one a line: {\"custom_id\", \"method\": \"POST\", \"url\": "
     "\"/v1/chat/completions\" or \"/v1/completions\", \"body\": {request}}; a malformed line "
     "(named) fails the job before the model loads. A body is what `k3 serve` takes at that url "
     "(n, echo, prompt lists, logprobs, tools ...), answered by the same code; only "
     "\"stream\": true is refused"},
    {"output", K3_FLAG_STR, "OUT.jsonl", NULL,
     "results, one a line as each request finishes: {\"id\", \"custom_id\", \"response\": "
     "{\"status_code\": 200, \"request_id\", \"body\": chat.completion | text_completion}, "
     "\"error\": null}; a failed request: serve's status_code (400 / 404 / 500; e.g. a prompt "
     "+ max_tokens past --max-ctx: 400) and serve's error body {\"error\": {\"message\", "
     "\"type\", \"param\", \"code\": the status}}. Appended to: custom_ids already there "
     "(failed ones too) are skipped, so a killed job run again completes the file"},
    {"served-model-name", K3_FLAG_STR, "NAME", NULL,
     "the model name of the responses; a line whose body names another model fails alone "
     "(404), as `k3 serve` answers it (default: the basename of --model)"},
    {"max-tokens", K3_FLAG_INT, "N", NULL,
     "max_tokens of a request that sets neither max_tokens nor max_completion_tokens (default: "
     "the rest of --max-ctx)"},
    {"grammar-budget", K3_FLAG_FLOAT, "SEC", "10",
     "structured outputs: a line whose grammar takes longer to compile fails alone "
     "(invalid_request naming this budget); the workers' heartbeat goes on meanwhile"},
    {"seed", K3_FLAG_STR, "S", "0",
     "a request without a seed samples with one derived from S and its custom_id (same tokens "
     "on a rerun or resume)"},
    {"progress-every", K3_FLAG_FLOAT, "SEC", "10",
     "seconds between progress lines when stderr is not a terminal (on a terminal: one "
     "updating line)"},
    K3_ENGINE_FLAGS,
};

/* ---- state ---------------------------------------------------------------------------------- */
typedef struct in_line {
    int64_t off, len; /* the line's bytes in the input text */
    int64_t lineno;   /* 1-based */
    char *cid;        /* (n_cid + 1) custom_id bytes, NUL-terminated (may hold NUL) */
    size_t n_cid;
    bool done; /* already in the output */
} in_line;

/* A request in the engine: its choices (serve's parsed request, server/k3_server.h). */
typedef struct live {
    int64_t line; /* index into b->lines; -1: a free entry */
    k3_server_req *r;
} live;

/* The prep threads: a line whose grammar takes long to compile holds one; the others go on
 * with the lines behind it. */
#define PREP_THREADS 2

/* A line parsed (its grammar compiled) by a prep thread, for the step loop to start. */
typedef struct prepared {
    int64_t line;
    int status;       /* serve's: 200, or the error answer in err */
    k3_server_req *r; /* status 200 */
    k3_chat_buf err;  /* status != 200 */
    k3_status st;     /* not K3_OK: I/O or memory (the job fails) */
} prepared;

typedef struct batch {
    const k3_args *a;
    const char *in_path, *out_path;
    char *in_text;
    in_line *lines;
    int64_t n_lines;
    uint64_t *set; /* open addressing over lines: line index + 1, 0 = empty; (set_cap) */
    size_t set_cap;
    int64_t *todo; /* (n_todo) line indexes still to run, in input order */
    int64_t n_todo, next;
    int out_fd;
    k3_tokenizer *tok;
    k3_engine *e;
    live *live; /* (cap_live) */
    int n_live, cap_live;
    int64_t max_ctx;
    int64_t n_vocab; /* the model's vocab_size (logit_bias ids); 0: the config did not load */
    k3_grammar_cache *grammars; /* structured outputs of the requests */
    k3_server_opts so;          /* serve's request path: the model name, tokenizer, limits */
    char model_name[256];
    uint64_t nonce, seed;
    bool max_tokens_flag;
    /* counters */
    int64_t n_ok, n_failed, n_skipped, prompt_tokens, completion_tokens;
    double t_start, t_gen, t_end, t_progress, progress_every;
    bool tty, progress_shown;
    k3_engine_stats final; /* at close: each rank's busy time */
    /* the prep thread: parses the lines (and compiles their grammars) ahead of the step loop, so
       a long compile never delays a step or a heartbeat. Under pmu: next, the ring, the flags. */
    pthread_t prep[PREP_THREADS];
    int n_prep, n_prep_alive, n_parsing; /* started, not yet ended, parsing a line now */
    bool prep_on, prep_done, prep_stop;
    pthread_mutex_t pmu;
    pthread_cond_t pcv;
    prepared *ring; /* (cap_live) */
    int r_head, r_n;
} batch;

/* "message (file.c:123)" -> "message": the output file is for users, not for a debugger. */
static void strip_where(char *s) {
    size_t n = strlen(s);
    while (n > 4 && s[n - 1] == ')') {
        char *open = strrchr(s, '(');
        if (!open || open == s || open[-1] != ' ' || !strchr(open, ':')) break;
        const char *c = strrchr(open, ':');
        bool digits = c[1] >= '0' && c[1] <= '9';
        for (const char *p = c + 1; p < s + n - 1; p++) digits = digits && *p >= '0' && *p <= '9';
        if (!digits || !memchr(open, '.', (size_t)(c - open))) break;
        open[-1] = 0;
        n = strlen(s);
    }
}

/* The last error as the user reads it: without the source location k3_set_error adds. */
static const char *user_error(void) {
    static char m[1600];
    snprintf(m, sizeof m, "%s", k3_last_error());
    strip_where(m);
    return m;
}

/* ---- custom_id set -------------------------------------------------------------------------- */
static uint64_t cid_hash(const char *s, size_t n) {
    return k3_hash_bytes(s, n, K3_HASH_INIT);
}

/* The line holding custom_id s, or -1. With insert >= 0, adds that line when absent. */
static int64_t set_find(batch *b, const char *s, size_t n, int64_t insert) {
    size_t mask = b->set_cap - 1, i = (size_t)cid_hash(s, n) & mask;
    for (; b->set[i]; i = (i + 1) & mask) {
        const in_line *L = &b->lines[b->set[i] - 1];
        if (L->n_cid == n && memcmp(L->cid, s, n) == 0) return (int64_t)(b->set[i] - 1);
    }
    if (insert >= 0) b->set[i] = (uint64_t)insert + 1;
    return -1;
}

/* ---- input ---------------------------------------------------------------------------------- */
static bool blank(const char *p, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (p[i] != ' ' && p[i] != '\t' && p[i] != '\r') return false;
    return true;
}

/* Why line L is not a batch request (NULL when it is); the custom_id into L. */
static const char *check_line(const k3_chat_json *d, in_line *L) {
    if (d->kind != K3_JSON_OBJECT) return "not a JSON object";
    const k3_chat_json *cid = k3_chat_json_get(d, "custom_id");
    if (!cid) return "no custom_id";
    if (cid->kind != K3_JSON_STRING || cid->n == 0) return "custom_id must be a non-empty string";
    const k3_chat_json *m = k3_chat_json_get(d, "method"), *u = k3_chat_json_get(d, "url");
    if (!k3_chat_json_is_str(m, "POST")) return "method must be \"POST\"";
    if (!u || u->kind != K3_JSON_STRING) /* another url fails its own line, as serve's 404 */
        return "url must be a string (\"/v1/chat/completions\" or \"/v1/completions\")";
    const k3_chat_json *body = k3_chat_json_get(d, "body");
    if (!body || body->kind != K3_JSON_OBJECT) return "body must be a JSON object (a request)";
    if (k3_alloc((void **)&L->cid, cid->n + 1, "custom_id") != K3_OK) return "out of memory";
    memcpy(L->cid, cid->s, cid->n + 1);
    L->n_cid = cid->n;
    return NULL;
}

/* Index and check every line; prints each bad line (the first 20) and fails when any. */
static k3_status read_input(batch *b) {
    size_t n = 0;
    K3_TRY(k3_read_file(b->in_path, &b->in_text, &n));
    int64_t n_nl = 1;
    for (size_t i = 0; i < n; i++) n_nl += b->in_text[i] == '\n';
    K3_TRY(k3_calloc((void **)&b->lines, (size_t)n_nl * sizeof *b->lines, "input lines"));
    b->set_cap = 64;
    while (b->set_cap < 2 * (size_t)n_nl) b->set_cap *= 2;
    K3_TRY(k3_calloc((void **)&b->set, b->set_cap * sizeof *b->set, "custom_id set"));
    int64_t n_bad = 0, lineno = 0;
    for (size_t off = 0; off < n;) {
        const char *p = b->in_text + off, *nl = memchr(p, '\n', n - off);
        int64_t len = nl ? nl - p : (int64_t)(n - off);
        lineno++;
        size_t here = off;
        off += (size_t)len + 1;
        if (blank(p, len)) continue;
        in_line *L = &b->lines[b->n_lines];
        *L = (in_line){.off = (int64_t)here, .len = len, .lineno = lineno};
        char what[64], why[256];
        snprintf(what, sizeof what, "line %lld", (long long)lineno);
        k3_chat_json *d = NULL;
        const char *bad = NULL;
        if (k3_chat_json_parse(p, (size_t)len, what, &d) != K3_OK) {
            const char *m = k3_last_error(); /* "line N: invalid JSON: ..." */
            size_t nw = strlen(what);
            snprintf(why, sizeof why, "%s",
                     strncmp(m, what, nw) == 0 && m[nw] == ':' ? m + nw + 2 : m);
            strip_where(why);
            bad = why;
        } else {
            bad = check_line(d, L);
        }
        k3_chat_json_free(d);
        int64_t prev = bad ? -1 : set_find(b, L->cid, L->n_cid, b->n_lines);
        if (prev >= 0) {
            snprintf(why, sizeof why, "custom_id \"%.60s\" is already used on line %lld", L->cid,
                     (long long)b->lines[prev].lineno);
            bad = why;
            k3_free(L->cid);
            L->cid = NULL;
        }
        if (bad) {
            if (n_bad++ < 20)
                fprintf(stderr, "k3 batch: %s line %lld: %s\n", b->in_path, (long long)lineno, bad);
            continue;
        }
        b->n_lines++;
    }
    if (n_bad > 20)
        fprintf(stderr, "k3 batch: %s: ... %lld bad lines in all\n", b->in_path, (long long)n_bad);
    if (n_bad)
        return K3_ERR(K3_ERR_FORMAT, "%s: %lld bad line%s (named above); nothing was run",
                      b->in_path, (long long)n_bad, n_bad > 1 ? "s" : "");
    return K3_OK;
}

/* ---- output: resume, then append ------------------------------------------------------------ */
static k3_status read_fd(int fd, const char *path, char **out, size_t *n) {
    struct stat sb;
    if (fstat(fd, &sb) != 0) return K3_ERR(K3_ERR_IO, "%s: %s", path, strerror(errno));
    K3_TRY(k3_alloc((void **)out, (size_t)sb.st_size + 1, path));
    size_t got = 0;
    while (got < (size_t)sb.st_size) {
        ssize_t r = pread(fd, *out + got, (size_t)sb.st_size - got, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return K3_ERR(K3_ERR_IO, "%s: read failed: %s", path, strerror(errno));
        got += (size_t)r;
    }
    (*out)[got] = 0;
    *n = got;
    return K3_OK;
}

/* Open (create) OUT, lock it, cut a truncated last line, mark the custom_ids it holds. */
static k3_status open_output(batch *b) {
    const char *path = b->out_path;
    b->out_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (b->out_fd < 0) return K3_ERR(K3_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (flock(b->out_fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK)
            return K3_ERR(K3_ERR_IO, "%s: another k3 batch is writing it", path);
        K3_LOGW("%s: cannot lock it (%s); make sure no other job writes it", path, strerror(errno));
    }
    struct stat so, si;
    if (fstat(b->out_fd, &so) == 0 && stat(b->in_path, &si) == 0 && so.st_dev == si.st_dev &&
        so.st_ino == si.st_ino)
        return K3_ERR(K3_ERR_ARG, "--output %s is the input file", path);
    if (!S_ISREG(so.st_mode)) return K3_ERR(K3_ERR_IO, "%s: not a regular file", path);
    char *text = NULL;
    size_t n = 0;
    K3_TRY(read_fd(b->out_fd, path, &text, &n));
    size_t keep = n;
    while (keep > 0 && text[keep - 1] != '\n') keep--;
    k3_status st = K3_OK;
    if (keep < n) {
        K3_LOGW("%s: cut a truncated last line (%zu bytes) left by an interrupted run", path,
                n - keep);
        if (ftruncate(b->out_fd, (off_t)keep) != 0)
            st = K3_ERR(K3_ERR_IO, "%s: cannot truncate: %s", path, strerror(errno));
    }
    int64_t lineno = 0, unknown = 0;
    for (size_t off = 0; off < keep && st == K3_OK;) {
        const char *p = text + off, *nl = memchr(p, '\n', keep - off);
        size_t len = (size_t)(nl - p);
        off += len + 1;
        lineno++;
        if (blank(p, (int64_t)len)) continue;
        k3_chat_json *d = NULL;
        const k3_chat_json *cid = NULL;
        if (k3_chat_json_parse(p, len, "output", &d) == K3_OK)
            cid = k3_chat_json_get(d, "custom_id");
        if (!cid || cid->kind != K3_JSON_STRING) {
            st = K3_ERR(K3_ERR_FORMAT,
                        "%s line %lld: not an output line of a batch (no custom_id); not "
                        "appending to this file",
                        path, (long long)lineno);
        } else {
            int64_t i = set_find(b, cid->s, cid->n, -1);
            if (i < 0)
                unknown++;
            else if (!b->lines[i].done)
                b->lines[i].done = true, b->n_skipped++;
        }
        k3_chat_json_free(d);
    }
    k3_free(text);
    if (unknown)
        K3_LOGW("%s: %lld line%s with a custom_id not in %s (kept)", path, (long long)unknown,
                unknown > 1 ? "s" : "", b->in_path);
    if (st == K3_OK && lseek(b->out_fd, 0, SEEK_END) < 0)
        st = K3_ERR(K3_ERR_IO, "%s: %s", path, strerror(errno));
    return st;
}

static k3_status write_line(batch *b, const k3_chat_buf *line) {
    size_t done = 0;
    while (done < line->n) {
        ssize_t w = write(b->out_fd, line->p + done, line->n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return K3_ERR(K3_ERR_IO, "%s: write failed: %s", b->out_path, strerror(errno));
        done += (size_t)w;
    }
    return K3_OK;
}

/* {"id":"batch_req_<hex>","custom_id":... */
static k3_status put_head(const batch *b, const in_line *L, k3_chat_buf *o) {
    char t[64];
    snprintf(t, sizeof t, "{\"id\":\"batch_req_%016llx\",\"custom_id\":",
             (unsigned long long)k3_run_seq_seed(b->nonce ^ cid_hash(L->cid, L->n_cid), 1));
    K3_TRY(k3_chat_buf_puts(o, t));
    return k3_chat_json_dump_str(L->cid, L->n_cid, o);
}

/* A request's result line: serve's status and body (a response, or its {"error": {...}}), in
 * OpenAI's batch output shape (see the top). */
static k3_status write_result(batch *b, const in_line *L, int status, const k3_chat_buf *body) {
    char t[160];
    k3_chat_buf o = {0};
    k3_status st = put_head(b, L, &o);
    snprintf(t, sizeof t,
             ",\"response\":{\"status_code\":%d,\"request_id\":\"req_%016llx\",\"body\":", status,
             (unsigned long long)k3_run_seq_seed(b->nonce ^ cid_hash(L->cid, L->n_cid), 2));
    if (st == K3_OK) st = k3_chat_buf_puts(&o, t);
    if (st == K3_OK) st = k3_chat_buf_put(&o, body->p ? body->p : "{}", body->p ? body->n : 2);
    if (st == K3_OK) st = k3_chat_buf_puts(&o, "},\"error\":null}\n");
    if (st == K3_OK) st = write_line(b, &o);
    k3_chat_buf_free(&o);
    if (status == 200)
        b->n_ok++;
    else
        b->n_failed++;
    return st;
}

/* ---- feeding the engine --------------------------------------------------------------------- */
static live *free_live(batch *b) {
    for (int i = 0; i < b->cap_live; i++)
        if (b->live[i].line < 0) return &b->live[i];
    return NULL;
}

static void end_live(batch *b, live *q) {
    k3_server_req_free(q->r);
    memset(q, 0, sizeof *q);
    q->line = -1;
    b->n_live--;
}

/* An event's tag: the live entry and the choice (at most 256 choices a request: serve's limit is
 * lower). */
#define CHOICE_BITS 8

/* The prep thread's compiles stop when the job ends early. */
static bool prep_cancelled(void *arg) {
    return __atomic_load_n(&((batch *)arg)->prep_stop, __ATOMIC_RELAXED);
}

/* Parse line li as serve does (the prep thread): p->r, or serve's error answer in p->err. */
static void parse_line(batch *b, int64_t li, prepared *p) {
    const in_line *L = &b->lines[li];
    *p = (prepared){.line = li, .status = 500};
    k3_chat_json *d = NULL;
    k3_chat_buf body = {0};
    p->st = k3_chat_json_parse(b->in_text + L->off, (size_t)L->len, "line", &d);
    if (p->st != K3_OK) return;
    const k3_chat_json *u = k3_chat_json_get(d, "url");
    p->st = k3_chat_json_dump(k3_chat_json_get(d, "body"), K3_JSON_COMPACT, &body);
    const uint64_t h = b->nonce ^ cid_hash(L->cid, L->n_cid);
    const k3_server_req_opts ro = {.seed = k3_run_seq_seed(b->seed ^ cid_hash(L->cid, L->n_cid), 0),
                                   .id = k3_run_seq_seed(h, 3),
                                   .max_tokens =
                                       b->max_tokens_flag ? k3_args_int(b->a, "max-tokens") : 0};
    if (p->st == K3_OK)
        p->status = k3_server_req_parse(&b->so, u->s, body.p, body.n, &ro, &p->r, &p->err);
    k3_chat_json_free(d);
    k3_chat_buf_free(&body);
}

static void *prep_main(void *arg) {
    batch *b = arg;
    k3_grammar_thread_cancel(prep_cancelled, b);
    pthread_mutex_lock(&b->pmu);
    while (!b->prep_stop && b->next < b->n_todo) {
        if (b->r_n + b->n_parsing >= b->cap_live) {
            pthread_cond_wait(&b->pcv, &b->pmu);
            continue;
        }
        const int64_t li = b->todo[b->next++];
        b->n_parsing++;
        pthread_mutex_unlock(&b->pmu);
        prepared p;
        parse_line(b, li, &p);
        pthread_mutex_lock(&b->pmu);
        b->n_parsing--;
        b->ring[(b->r_head + b->r_n++) % b->cap_live] = p;
        pthread_cond_broadcast(&b->pcv);
        if (p.st != K3_OK) break; /* the step loop fails the job with it */
    }
    if (--b->n_prep_alive == 0) b->prep_done = true;
    pthread_cond_broadcast(&b->pcv);
    pthread_mutex_unlock(&b->pmu);
    k3_grammar_thread_cancel(NULL, NULL);
    return NULL;
}

static void prepared_free(prepared *p) {
    k3_server_req_free(p->r);
    k3_chat_buf_free(&p->err);
}

/* Start a prepared line: submit its choices, or write serve's error answer. Fails only for I/O
 * and memory. */
static k3_status start_line(batch *b, prepared *p) {
    if (p->st != K3_OK || p->status != 200) {
        k3_status st =
            p->st == K3_OK ? write_result(b, &b->lines[p->line], p->status, &p->err) : p->st;
        prepared_free(p);
        return st;
    }
    live *q = free_live(b);
    K3_ASSERT(q != NULL);
    q->line = p->line, q->r = p->r;
    b->n_live++;
    const int n = k3_server_req_choices(q->r);
    K3_ASSERT(n <= 1 << CHOICE_BITS);
    for (int i = 0; i < n; i++)
        K3_TRY(k3_server_req_submit(q->r, i, b->e,
                                    ((uint64_t)(q - b->live) << CHOICE_BITS) | (uint64_t)i));
    return K3_OK;
}

/* The next prepared line, if one is ready (wait_s > 0: waits that long for one); *all_done when
 * the prep thread has handed out every line. */
static bool take_prepared(batch *b, prepared *out, double wait_s, bool *all_done) {
    pthread_mutex_lock(&b->pmu);
    if (b->r_n == 0 && !b->prep_done && wait_s > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        const long ns = ts.tv_nsec + (long)(wait_s * 1e9);
        ts.tv_sec += ns / 1000000000L, ts.tv_nsec = ns % 1000000000L;
        pthread_cond_timedwait(&b->pcv, &b->pmu, &ts);
    }
    const bool got = b->r_n > 0;
    if (got) {
        *out = b->ring[b->r_head];
        b->r_head = (b->r_head + 1) % b->cap_live, b->r_n--;
        pthread_cond_broadcast(&b->pcv);
    }
    *all_done = b->prep_done && b->r_n == 0;
    pthread_mutex_unlock(&b->pmu);
    return got;
}

static void prep_end(batch *b) {
    if (!b->prep_on) return;
    pthread_mutex_lock(&b->pmu);
    __atomic_store_n(&b->prep_stop, true, __ATOMIC_RELAXED);
    pthread_cond_broadcast(&b->pcv);
    pthread_mutex_unlock(&b->pmu);
    for (int i = 0; i < b->n_prep; i++) pthread_join(b->prep[i], NULL);
    for (; b->r_n > 0; b->r_n--, b->r_head = (b->r_head + 1) % b->cap_live)
        prepared_free(&b->ring[b->r_head]);
    pthread_cond_destroy(&b->pcv);
    pthread_mutex_destroy(&b->pmu);
    b->prep_on = false;
}

static k3_status on_event(batch *b, const k3_event *ev) {
    const uint64_t li = ev->user >> CHOICE_BITS;
    if (li >= (uint64_t)b->cap_live || b->live[li].line < 0)
        return K3_ERR(K3_ERR_INTERNAL, "engine event for an unknown request (tag %llu)",
                      (unsigned long long)ev->user);
    live *q = &b->live[li];
    bool done = false;
    K3_TRY(k3_server_req_event(q->r, (int)(ev->user & ((1u << CHOICE_BITS) - 1)), ev, &done));
    if (!done) return K3_OK;
    k3_chat_buf out = {0};
    int64_t n_prompt = 0, n_gen = 0;
    const int status = k3_server_req_response(&b->so, q->r, &out, &n_prompt, &n_gen);
    k3_status st = write_result(b, &b->lines[q->line], status, &out);
    k3_chat_buf_free(&out);
    b->prompt_tokens += n_prompt;
    b->completion_tokens += n_gen;
    end_live(b, q);
    return st;
}

/* ---- progress -------------------------------------------------------------------------------- */
static void fmt_eta(double s, char *out, size_t n) {
    if (!(s >= 0) || s > 1e8) {
        snprintf(out, n, "?");
        return;
    }
    long t = (long)(s + 0.5);
    snprintf(out, n, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
}

static void progress(batch *b, bool last) {
    double now = k3_now_s();
    if (!last && now - b->t_progress < (b->tty ? 0.25 : b->progress_every)) return;
    if (last && !b->tty) return;
    b->t_progress = now;
    int64_t done = b->n_ok + b->n_failed, total = b->n_todo;
    double el = now - b->t_gen, tps = el > 0 ? (double)b->completion_tokens / el : 0;
    char eta[32];
    fmt_eta(done ? el * (double)(total - done) / (double)done : -1, eta, sizeof eta);
    if (b->tty) {
        fprintf(stderr, "\r\033[Kk3 batch: %lld/%lld requests (%lld failed), %.1f tok/s, ETA %s%s",
                (long long)done, (long long)total, (long long)b->n_failed, tps, eta,
                last ? "\n" : "");
        b->progress_shown = !last;
    } else {
        K3_LOGI("%lld/%lld requests (%lld failed), %.1f tok/s, ETA %s", (long long)done,
                (long long)total, (long long)b->n_failed, tps, eta);
    }
}

static void summary(const batch *b) {
    double now = k3_now_s(), gen = b->t_gen > 0 ? (b->t_end > 0 ? b->t_end : now) - b->t_gen : 0;
    K3_LOGI("batch: %lld requests: %lld ok, %lld failed, %lld skipped (already in %s)",
            (long long)b->n_lines, (long long)b->n_ok, (long long)b->n_failed,
            (long long)b->n_skipped, b->out_path);
    K3_LOGI("batch: prompt tokens %lld, completion tokens %lld; wall %.2f s (generation %.2f s); "
            "%.1f completion tok/s, %.1f total tok/s",
            (long long)b->prompt_tokens, (long long)b->completion_tokens, now - b->t_start, gen,
            gen > 0 ? (double)b->completion_tokens / gen : 0.0,
            gen > 0 ? (double)(b->prompt_tokens + b->completion_tokens) / gen : 0.0);
    if (b->final.world < 1 || gen <= 0) return;
    char busy[1024];
    int n = 0;
    for (int r = 0; r < b->final.world && r < 256 && n < (int)sizeof busy - 16; r++)
        n += snprintf(busy + n, sizeof busy - (size_t)n, "%s r%d %.0f%%", r ? "," : "", r,
                      100.0 * b->final.busy_s[r] / gen);
    K3_LOGI("batch: busy (time in forward steps / generation wall):%s", busy);
}

/* Rank 0: submit and step until every line is written. */
static k3_status drive_lines(batch *b) {
    k3_engine_stats es;
    k3_engine_get_stats(b->e, &es);
    b->max_ctx = es.max_ctx;
    b->so = (k3_server_opts){.model_name = b->model_name,
                             .tok = b->tok,
                             .n_vocab = b->n_vocab,
                             .max_ctx = b->max_ctx,
                             .grammars = b->grammars};
    /* in flight: every slot busy plus as many waiting, so a freed slot is refilled at once */
    b->cap_live = (int)K3_MIN(K3_MAX(2 * (int64_t)es.max_seqs * es.ep, 64), 4096);
    K3_TRY(k3_calloc((void **)&b->live, (size_t)b->cap_live * sizeof *b->live, "requests"));
    for (int i = 0; i < b->cap_live; i++) b->live[i].line = -1;
    K3_TRY(k3_calloc((void **)&b->ring, (size_t)b->cap_live * sizeof *b->ring, "parsed lines"));
    pthread_mutex_init(&b->pmu, NULL);
    pthread_cond_init(&b->pcv, NULL);
    b->prep_on = true;
    pthread_mutex_lock(&b->pmu);
    for (; b->n_prep < PREP_THREADS; b->n_prep++, b->n_prep_alive++)
        if (pthread_create(&b->prep[b->n_prep], NULL, prep_main, b) != 0) break;
    const bool none = b->n_prep == 0;
    pthread_mutex_unlock(&b->pmu);
    if (none) return K3_ERR(K3_ERR_NOMEM, "k3 batch: cannot start a thread to parse the lines");
    b->t_gen = b->t_progress = k3_now_s();
    bool all_in = false;
    while (!all_in || b->n_live > 0) {
        prepared p;
        /* idle (every line parsed so far has ended): wait for the prep thread, heartbeat going */
        const double wait_s = b->n_live == 0 ? 0.05 : 0;
        while (b->n_live < b->cap_live && take_prepared(b, &p, wait_s, &all_in))
            K3_TRY(start_line(b, &p));
        if (b->n_live == 0) {
            (void)k3_engine_heartbeat(b->e); /* a failure shows at the next step */
            continue;
        }
        const k3_event *ev;
        int n = 0;
        K3_TRY(k3_engine_step(b->e, &ev, &n));
        if (n == 0 && k3_engine_pending(b->e) == 0)
            return K3_ERR(K3_ERR_INTERNAL, "the engine has no work but %d requests are open",
                          b->n_live);
        for (int k = 0; k < n; k++) K3_TRY(on_event(b, &ev[k]));
        progress(b, false);
    }
    progress(b, true);
    b->t_end = k3_now_s();
    return K3_OK;
}

static k3_status drive(batch *b) {
    k3_status st = drive_lines(b);
    prep_end(b); /* a compile still running (the job failed) stops now */
    return st;
}

/* Rank 0 before the engine opens: flags, the input, the output, the tokenizer. */
static k3_status prepare(batch *b) {
    const k3_args *a = b->a;
    if (b->max_tokens_flag) {
        int64_t v = k3_args_int(a, "max-tokens");
        if (v < 1 || v > 1000000)
            return K3_ERR(K3_ERR_ARG, "--max-tokens: %lld must be in [1, 1000000]", (long long)v);
    }
    if (!k3_job_parse_u64(k3_args_str(a, "seed"), &b->seed))
        return K3_ERR(K3_ERR_ARG, "--seed: '%s' must be an integer in [0, 2^64)",
                      k3_args_str(a, "seed"));
    if (!(b->progress_every > 0)) return K3_ERR(K3_ERR_ARG, "--progress-every must be > 0");
    K3_TRY(read_input(b));
    K3_TRY(open_output(b));
    K3_TRY(k3_calloc((void **)&b->todo, (size_t)K3_MAX(b->n_lines, 1) * sizeof(int64_t), "todo"));
    for (int64_t i = 0; i < b->n_lines; i++)
        if (!b->lines[i].done) b->todo[b->n_todo++] = i;
    K3_LOGI("%s: %lld requests, %lld already in %s, %lld to run", b->in_path, (long long)b->n_lines,
            (long long)b->n_skipped, b->out_path, (long long)b->n_todo);
    if (b->n_todo == 0) return K3_OK;
    K3_TRY(k3_tok_create_model_dir(&b->tok, k3_args_str(a, "model"), NULL));
    /* vocab_size for the requests' logit_bias ids (a 400 line naming the key);
     * a config that does not load fails the engine's open, which says why */
    k3_config cfg;
    if (k3_config_load(k3_args_str(a, "model"), &cfg) == K3_OK)
        b->n_vocab = cfg.vocab_size;
    else
        k3_clear_error();
    if (b->n_vocab > 0) K3_TRY(k3_job_grammar_cache(b->tok, b->n_vocab, &b->grammars));
    const double budget_s = k3_args_float(a, "grammar-budget");
    if (!(budget_s > 0 && budget_s <= 3600))
        return K3_ERR(K3_ERR_ARG, "--grammar-budget must be in (0, 3600] seconds");
    if (b->grammars) k3_grammar_cache_limits(b->grammars, 0, budget_s);
    const char *m = k3_args_str(a, "model");
    size_t n = strlen(m);
    while (n > 1 && m[n - 1] == '/') n--;
    size_t s = n;
    while (s > 0 && m[s - 1] != '/') s--;
    snprintf(b->model_name, sizeof b->model_name, "%.*s", (int)(n - s), m + s);
    if (k3_args_has(a, "served-model-name"))
        snprintf(b->model_name, sizeof b->model_name, "%s", k3_args_str(a, "served-model-name"));
    uint64_t t = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    b->nonce = k3_run_seq_seed(k3_hash_bytes(&t, sizeof t, K3_HASH_INIT), 7);
    return K3_OK;
}

static void batch_free(batch *b) {
    prep_end(b); /* before the lines and the grammar cache it uses */
    k3_free(b->ring);
    for (int i = 0; b->live && i < b->cap_live; i++)
        if (b->live[i].line >= 0) end_live(b, &b->live[i]);
    for (int64_t i = 0; b->lines && i < b->n_lines; i++) k3_free(b->lines[i].cid);
    k3_free(b->live), k3_free(b->lines), k3_free(b->set), k3_free(b->todo), k3_free(b->in_text);
    k3_grammar_cache_destroy(b->grammars); /* after the jobs: they hold its grammars */
    k3_tok_destroy(b->tok);
    if (b->out_fd >= 0) close(b->out_fd); /* also releases the lock */
}

/* ---- the command ---------------------------------------------------------------------------- */
static int run_batch(const k3_args *a) {
    if (k3_comm_init() != K3_OK) {
        fprintf(stderr, "k3 batch: %s\n", user_error());
        return 1;
    }
    int rank = 0, world = 1;
    k3_comm_world(&rank, &world);
    k3_log_set_rank(rank, -1, -1); /* the engine adds (stage, lane) at open */
    k3_engine_opts eo = {.name = "k3 batch"};
    int rc = k3_engine_args(a, rank == 0, &eo);
    if (rc == 0) k3_engine_backend_say(a, rank == 0);
    if (rc == 0 &&
        (!k3_args_has(a, "model") || !k3_args_has(a, "input") || !k3_args_has(a, "output"))) {
        if (rank == 0)
            fprintf(stderr, "k3 batch: --model DIR, --input IN.jsonl and --output OUT.jsonl are "
                            "required\n");
        rc = 2;
    }
    if (rc) {
        k3_comm_finalize();
        return rc;
    }
    batch b = {.a = a,
               .in_path = k3_args_str(a, "input"),
               .out_path = k3_args_str(a, "output"),
               .out_fd = -1,
               .max_tokens_flag = k3_args_has(a, "max-tokens"),
               .progress_every = k3_args_float(a, "progress-every"),
               .t_start = k3_now_s(),
               .tty = isatty(2)};
    /* rank 0 decides whether there is a job: 0 run, 1 failed, 2 usage, 3 nothing to run */
    int verdict = 0;
    if (rank == 0) {
        k3_status st = prepare(&b);
        verdict = st == K3_OK ? (b.n_todo ? 0 : 3) : st == K3_ERR_ARG ? 2 : 1;
        if (st != K3_OK) fprintf(stderr, "k3 batch: %s\n", user_error());
    }
    int agreed = verdict;
    if (k3_comm_world_max(verdict, &agreed, eo.comm_timeout_s) != K3_OK) {
        fprintf(stderr, "k3 batch: rank %d: %s\n", rank, user_error());
        k3_comm_world_abort(1);
    }
    if (agreed) {
        if (agreed == 3 && rank == 0) summary(&b);
        batch_free(&b);
        k3_comm_finalize();
        return agreed == 3 ? 0 : agreed;
    }
    eo.model_dir = k3_args_str(a, "model");
    eo.tok = b.tok;
    eo.progress = true;
    k3_status ost = k3_engine_open_test(&eo, k3_engine_test_from_env(), &b.e);
    if (ost != K3_OK && b.e) k3_engine_abort(b.e); /* a fatal fault: the job ends, rank named */
    rc = ost == K3_OK ? 0 : ost == K3_ERR_ARG ? 2 : 1;
    if (rc == 0 && !k3_engine_is_coordinator(b.e)) {
        if (k3_engine_serve(b.e) != K3_OK) k3_engine_abort(b.e); /* serves, then closes */
    } else if (rc == 0) {
        k3_status st = drive(&b);
        if (k3_engine_failed(b.e)) { /* the lines written so far are kept */
            if (fsync(b.out_fd) != 0 && errno != EINVAL)
                K3_LOGW("%s: fsync: %s", b.out_path, strerror(errno));
            k3_engine_abort(b.e);
        }
        if (b.progress_shown) fprintf(stderr, "\n");
        if (st != K3_OK)
            fprintf(stderr,
                    "k3 batch: %s (the lines written so far are kept; run again to "
                    "finish)\n",
                    user_error());
        if (k3_engine_close(b.e, &b.final) != K3_OK) k3_engine_abort(b.e);
        if (st == K3_OK && fsync(b.out_fd) != 0 && errno != EINVAL)
            K3_LOGW("%s: fsync: %s", b.out_path, strerror(errno));
        summary(&b);
        rc = st == K3_OK ? 0 : 1;
    }
    batch_free(&b);
    k3_comm_finalize();
    return rc;
}

const k3_command k3_cmd_batch = {
    .name = "batch",
    .positional = "",
    .min_pos = 0,
    .max_pos = 0,
    .summary = "an OpenAI Batch API file (/v1/chat/completions and /v1/completions lines) -> one "
               "result line each, resumable "
               "(one process, or every rank under mpirun)",
    .flags = flags,
    .n_flags = (int)K3_ARRAY_LEN(flags),
    .run = run_batch,
};
