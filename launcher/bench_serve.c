/* bench_serve.c — `k3 bench serve --base-url URL`: vLLM's online benchmark against a running
 * OpenAI-compatible server (`k3 serve` or any other), with vLLM's result keys.
 *
 * Owns: the workload (random prompts from a seeded stream: token ids through /v1/completions,
 * or text through /v1/chat/completions, made of --input-len tokens of the model's tokenizer
 * (--tokenizer): words that are one token each, less the chat template's own tokens when the
 * server's /tokenize says how many; Poisson arrivals at --request-rate, or all at once;
 * at most --max-concurrency in flight; a comma list of them sweeps: one timed run and one
 * result row each, the warm-ups once before the first), the HTTP client (libcurl's multi interface,
 * one thread, one easy handle per request in flight), the SSE reader and the latency metrics. Every
 * request streams with stream_options.include_usage, greedy with ignore_eos; its token counts are
 * the server's own usage chunk (never counted from chunks). A chunk counts as a token arrival when
 * it carries text (completions: "text"; chat: a content, reasoning_content or tool_calls delta);
 * TTFT is the first arrival, ITL the gaps between arrivals, TPOT (e2e - TTFT) / (completion_tokens
 * - 1), E2EL the whole request. With --random-prefix-len N every prompt starts with the same N
 * random tokens (vLLM's random dataset with a prefix): the server's
 * usage.prompt_tokens_details.cached_tokens gives each request's prefix-cache hit, reported as
 * total_cached_tokens and prefix_cache_hit_rate. Warm-up requests (--num-warmups) run to completion
 * before the clock starts; their tokens are reported apart (warmup_input_tokens,
 * warmup_output_tokens) so that the totals can be checked against the server's own counters. */
#include "bench.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "k3_chat.h"
#include "k3_model.h"
#include "k3_tokenizer.h"

typedef struct sreq {
    char *body; /* request JSON */
    int64_t n_body;
    bool warm;
    CURL *h;
    k3_chat_buf line;   /* the SSE line being read */
    char err_body[512]; /* the start of a non-SSE answer (an error object) */
    size_t n_err_body;
    double t_start, t_first, t_last, t_end;
    k3_chat_buf itl; /* doubles: gaps between token arrivals, seconds */
    int64_t prompt_tokens, completion_tokens, cached_tokens;
    bool usage, done_marker, ok;
    char error[300];
} sreq;

typedef struct serve_bench {
    const char *base_url, *endpoint;
    char model[256];
    char auth[512]; /* "Authorization: Bearer ..." or "" */
    bool chat;
    int64_t n, warmups, in_len, out_len, conc, n_vocab;
    int64_t concs[16]; /* --max-concurrency C[,C]: one timed run per value (a sweep) */
    int n_conc;
    int64_t prefix_len; /* --random-prefix-len */
    int32_t *prefix;    /* [prefix_len] the ids every prompt starts with */
    double rate;        /* requests/s; INFINITY = all at once */
    double timeout_s;
    uint64_t seed;
    sreq *q; /* (n + warmups): warm-ups first */
    /* chat: words of one token each (" alpha"), and the tokens the template adds to a message */
    char **words;
    int64_t n_words, overhead;
} serve_bench;

/* ---- the SSE stream -------------------------------------------------------------------------- */
static bool has_text(const cJSON *choice, bool chat) {
    if (!chat) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(choice, "text");
        return cJSON_IsString(t) && t->valuestring[0];
    }
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(choice, "delta");
    static const char *const keys[] = {"content", "reasoning_content"};
    for (size_t i = 0; i < K3_ARRAY_LEN(keys); i++) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(d, keys[i]);
        if (cJSON_IsString(t) && t->valuestring[0]) return true;
    }
    return cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(d, "tool_calls")) > 0;
}

/* One complete line of the stream. */
static void on_line(sreq *r, bool chat, const char *line, size_t n, double now) {
    if (n >= 5 && memcmp(line, "data:", 5) != 0) return; /* comments, event names */
    if (n < 5) {
        size_t room = sizeof r->err_body - 1 - r->n_err_body, k = K3_MIN(n, room);
        memcpy(r->err_body + r->n_err_body, line, k); /* not SSE: keep it for the error */
        r->n_err_body += k;
        return;
    }
    const char *p = line + 5;
    while (*p == ' ') p++;
    if (strcmp(p, "[DONE]") == 0) {
        r->done_marker = true;
        return;
    }
    cJSON *d = cJSON_Parse(p);
    if (!d) {
        snprintf(r->error, sizeof r->error, "a stream chunk is not JSON: %.120s", p);
        cJSON_Delete(d);
        return;
    }
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(d, "error");
    if (e && !cJSON_IsNull(e)) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(e, "message");
        snprintf(r->error, sizeof r->error, "error in the stream: %.200s",
                 cJSON_IsString(m) ? m->valuestring : "?");
    }
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(d, "choices"), 0);
    if (ch && has_text(ch, chat)) {
        const double gap = now - r->t_last;
        if (r->t_first == 0)
            r->t_first = now;
        else if (k3_chat_buf_put(&r->itl, &gap, sizeof gap) != K3_OK)
            snprintf(r->error, sizeof r->error, "%s", k3_last_error());
        r->t_last = now;
    }
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(d, "usage");
    if (cJSON_IsObject(u)) {
        const cJSON *pt = cJSON_GetObjectItemCaseSensitive(u, "prompt_tokens"),
                    *ct = cJSON_GetObjectItemCaseSensitive(u, "completion_tokens");
        if (cJSON_IsNumber(pt) && cJSON_IsNumber(ct)) {
            r->prompt_tokens = (int64_t)pt->valuedouble;
            r->completion_tokens = (int64_t)ct->valuedouble;
            r->usage = true;
        }
        const cJSON *cd = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(u, "prompt_tokens_details"), "cached_tokens");
        r->cached_tokens = cJSON_IsNumber(cd) ? (int64_t)cd->valuedouble : 0;
    }
    cJSON_Delete(d);
}

typedef struct write_ctx {
    sreq *r;
    bool chat;
} write_ctx;

static size_t on_bytes(char *data, size_t size, size_t nmemb, void *user) {
    write_ctx *w = user;
    sreq *r = w->r;
    const size_t n = size * nmemb;
    const double now = k3_now_s();
    for (size_t i = 0; i < n; i++) {
        if (data[i] != '\n') {
            if (k3_chat_buf_put(&r->line, &data[i], 1) != K3_OK) return 0; /* aborts */
            continue;
        }
        size_t len = r->line.n;
        if (len && r->line.p[len - 1] == '\r') len--;
        if (r->line.p) r->line.p[len] = 0;
        on_line(r, w->chat, r->line.p ? r->line.p : "", len, now);
        r->line.n = 0;
    }
    return n;
}

/* ---- requests ----------------------------------------------------------------------------------
 */
static k3_status make_body(const serve_bench *b, k3_rng *rng, sreq *r) {
    cJSON *o = cJSON_CreateObject();
    bool ok = o && cJSON_AddStringToObject(o, "model", b->model);
    int32_t *ids = NULL;
    const int64_t len = b->prefix_len + b->in_len; /* the shared prefix, then its own tokens */
    k3_status st = k3_alloc((void **)&ids, (size_t)len * sizeof(int32_t), "prompt");
    if (st == K3_OK) {
        if (b->prefix_len) memcpy(ids, b->prefix, (size_t)b->prefix_len * sizeof(int32_t));
        bench_random_ids(rng, b->chat ? b->n_words : b->n_vocab, ids + b->prefix_len, b->in_len);
    }
    if (ok && st == K3_OK && b->chat) { /* len - overhead words, one token each */
        k3_chat_buf text = {0};
        for (int64_t i = 0; st == K3_OK && i < len - b->overhead; i++)
            st = k3_chat_buf_puts(&text, b->words[ids[i]]);
        cJSON *msgs = st == K3_OK ? cJSON_AddArrayToObject(o, "messages") : NULL,
              *m = cJSON_CreateObject();
        ok = msgs && m && cJSON_AddItemToArray(msgs, m) &&
             cJSON_AddStringToObject(m, "role", "user") &&
             cJSON_AddStringToObject(m, "content", text.p ? text.p : "");
        k3_chat_buf_free(&text);
    } else if (ok && st == K3_OK) {
        cJSON *p = cJSON_AddArrayToObject(o, "prompt");
        ok = p != NULL;
        for (int64_t i = 0; ok && i < len; i++)
            ok = cJSON_AddItemToArray(p, cJSON_CreateNumber(ids[i]));
    }
    k3_free(ids);
    cJSON *so = NULL;
    ok = ok && st == K3_OK && cJSON_AddNumberToObject(o, "max_tokens", (double)b->out_len) &&
         cJSON_AddNumberToObject(o, "temperature", 0) && cJSON_AddTrueToObject(o, "ignore_eos") &&
         cJSON_AddTrueToObject(o, "stream") &&
         (so = cJSON_AddObjectToObject(o, "stream_options")) != NULL &&
         cJSON_AddTrueToObject(so, "include_usage");
    char *text = ok ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    if (st != K3_OK) return st;
    if (!text) return K3_ERR(K3_ERR_NOMEM, "bench serve: building a request body");
    r->n_body = (int64_t)strlen(text);
    st = k3_alloc((void **)&r->body, (size_t)r->n_body + 1, "request body");
    if (st == K3_OK) memcpy(r->body, text, (size_t)r->n_body + 1);
    free(text);
    return st;
}

typedef struct flight {
    sreq *r;
    write_ctx w;
    struct curl_slist *hdr;
} flight;

static k3_status start(const serve_bench *b, CURLM *m, flight *f, sreq *r) {
    char url[2048];
    snprintf(url, sizeof url, "%s%s", b->base_url, b->endpoint);
    f->r = r;
    f->w = (write_ctx){r, b->chat};
    f->hdr = curl_slist_append(NULL, "Content-Type: application/json");
    if (f->hdr && b->auth[0]) f->hdr = curl_slist_append(f->hdr, b->auth);
    r->h = curl_easy_init();
    if (!r->h || !f->hdr) return K3_ERR(K3_ERR_NOMEM, "bench serve: libcurl handle");
    curl_easy_setopt(r->h, CURLOPT_URL, url);
    curl_easy_setopt(r->h, CURLOPT_POSTFIELDS, r->body);
    curl_easy_setopt(r->h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)r->n_body);
    curl_easy_setopt(r->h, CURLOPT_HTTPHEADER, f->hdr);
    curl_easy_setopt(r->h, CURLOPT_WRITEFUNCTION, on_bytes);
    curl_easy_setopt(r->h, CURLOPT_WRITEDATA, &f->w);
    curl_easy_setopt(r->h, CURLOPT_PRIVATE, f);
    curl_easy_setopt(r->h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(r->h, CURLOPT_TIMEOUT_MS, (long)(b->timeout_s * 1e3));
    r->t_start = k3_now_s();
    if (curl_multi_add_handle(m, r->h) != CURLM_OK)
        return K3_ERR(K3_ERR_STATE, "bench serve: curl_multi_add_handle failed");
    return K3_OK;
}

static void finish(CURLM *m, CURLMsg *msg) {
    flight *f = NULL;
    curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&f);
    sreq *r = f->r;
    r->t_end = k3_now_s();
    long code = 0;
    curl_easy_getinfo(r->h, CURLINFO_RESPONSE_CODE, &code);
    if (r->line.n) { /* a last line without its newline (k3_chat_buf keeps a NUL after it) */
        on_line(r, f->w.chat, r->line.p, r->line.n, r->t_end);
        r->line.n = 0;
    }
    if (msg->data.result != CURLE_OK)
        snprintf(r->error, sizeof r->error, "%s", curl_easy_strerror(msg->data.result));
    else if (code != 200)
        snprintf(r->error, sizeof r->error, "HTTP %ld: %.*s", code, (int)r->n_err_body,
                 r->err_body);
    else if (!r->error[0] && (!r->done_marker || !r->usage))
        snprintf(r->error, sizeof r->error, "the stream ended without %s",
                 r->usage ? "data: [DONE]" : "a usage chunk (stream_options.include_usage)");
    r->ok = !r->error[0];
    curl_multi_remove_handle(m, r->h);
    curl_easy_cleanup(r->h);
    curl_slist_free_all(f->hdr);
    r->h = NULL;
    f->r = NULL;
}

/* Run q[0..n) (arrival times at[i] seconds after the start; NULL = all at once), at most conc in
 * flight. Returns when all have ended; *t_end_s = the last end. */
static k3_status run_phase(const serve_bench *b, sreq *q, int64_t n, const double *at, double *t0_s,
                           double *t_end_s) {
    CURLM *m = curl_multi_init();
    flight *fl = NULL;
    const int64_t cap = K3_MIN(b->conc, n);
    k3_status st = m ? k3_calloc((void **)&fl, (size_t)K3_MAX(cap, 1) * sizeof *fl, "requests")
                     : K3_ERR(K3_ERR_NOMEM, "bench serve: curl_multi_init");
    int64_t next = 0, ended = 0, live = 0;
    const double t0 = k3_now_s();
    while (st == K3_OK && ended < n) {
        const double now = k3_now_s() - t0;
        while (st == K3_OK && next < n && live < cap && (!at || at[next] <= now)) {
            int64_t slot = 0;
            while (fl[slot].r) slot++;
            st = start(b, m, &fl[slot], &q[next++]);
            live++;
        }
        int running = 0;
        if (st == K3_OK && curl_multi_perform(m, &running) != CURLM_OK)
            st = K3_ERR(K3_ERR_STATE, "bench serve: curl_multi_perform failed");
        CURLMsg *msg;
        int left;
        while (st == K3_OK && (msg = curl_multi_info_read(m, &left)) != NULL)
            if (msg->msg == CURLMSG_DONE) finish(m, msg), ended++, live--;
        if (st != K3_OK || ended == n) break;
        /* sleep until a socket is ready, the next arrival, or 50 ms */
        double wait_ms = 50;
        if (at && next < n && live < cap)
            wait_ms = K3_MIN(wait_ms, K3_MAX(0, (at[next] - (k3_now_s() - t0)) * 1e3));
        if (curl_multi_poll(m, NULL, 0, (int)wait_ms, NULL) != CURLM_OK)
            st = K3_ERR(K3_ERR_STATE, "bench serve: curl_multi_poll failed");
    }
    *t0_s = t0;
    *t_end_s = k3_now_s();
    for (int64_t i = 0; fl && i < cap; i++)
        if (fl[i].r) { /* after an error: drop what is still in flight */
            curl_multi_remove_handle(m, fl[i].r->h);
            curl_easy_cleanup(fl[i].r->h);
            curl_slist_free_all(fl[i].hdr);
        }
    k3_free(fl);
    if (m) curl_multi_cleanup(m);
    return st;
}

/* ---- set-up -------------------------------------------------------------------------------------
 */
static size_t to_buf(char *data, size_t size, size_t nmemb, void *user) {
    k3_chat_buf *o = user;
    return k3_chat_buf_put(o, data, size * nmemb) == K3_OK ? size * nmemb : 0;
}

/* One blocking request to the server: GET (post NULL) or POST of a JSON body; the parsed answer
 * when it is HTTP 200 JSON, else NULL with *why saying what went wrong. The caller frees it. */
static cJSON *http_json(const serve_bench *b, const char *url, const char *post, const char **why) {
    CURL *h = curl_easy_init();
    struct curl_slist *hdr =
        post ? curl_slist_append(NULL, "Content-Type: application/json") : NULL;
    if (b->auth[0]) hdr = curl_slist_append(hdr, b->auth);
    k3_chat_buf o = {0};
    *why = "libcurl handle";
    if (!h) return NULL;
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    if (post) curl_easy_setopt(h, CURLOPT_POSTFIELDS, post);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, to_buf);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &o);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(b->timeout_s * 1e3));
    CURLcode rc = curl_easy_perform(h);
    long code = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(h);
    curl_slist_free_all(hdr);
    cJSON *d = rc == CURLE_OK && code == 200 && o.p ? cJSON_ParseWithLength(o.p, o.n) : NULL;
    *why = rc != CURLE_OK ? curl_easy_strerror(rc) : code != 200 ? "not HTTP 200" : "not JSON";
    k3_chat_buf_free(&o);
    return d;
}

/* --model absent: the first model the server lists. */
static k3_status server_model(serve_bench *b) {
    char url[2048];
    snprintf(url, sizeof url, "%s/v1/models", b->base_url);
    const char *why;
    cJSON *d = http_json(b, url, NULL, &why);
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(d, "data"), 0), "id");
    k3_status st = K3_OK;
    if (cJSON_IsString(id))
        snprintf(b->model, sizeof b->model, "%s", id->valuestring);
    else
        st = K3_ERR(K3_ERR_IO, "GET %s: %s (give --model NAME)", url,
                    d ? "no data[0].id in the answer" : why);
    cJSON_Delete(d);
    return st;
}

/* Words that are one token each of the model's tokenizer: a space and 2+ lowercase letters that
 * encode to exactly their own id. A chat prompt of them has as many tokens as words (the
 * pre-tokenizer cuts before each space, and each piece is one token). */
static k3_status one_token_words(serve_bench *b, const char *dir) {
    k3_tokenizer *tok = NULL;
    K3_TRY(k3_tok_create_model_dir(&tok, dir, NULL));
    k3_status st = K3_OK;
    int64_t cap = 0;
    for (int64_t id = 0; id < b->n_vocab && st == K3_OK; id++) {
        const char *p;
        size_t n;
        if (k3_tok_id_bytes(tok, (int32_t)id, &p, &n) != K3_OK) {
            k3_clear_error();
            continue;
        }
        bool ok = n >= 3 && p[0] == ' ';
        for (size_t i = 1; ok && i < n; i++) ok = p[i] >= 'a' && p[i] <= 'z';
        k3_tok_ids v = {0};
        ok = ok && k3_tok_encode(tok, p, n, false, &v) == K3_OK && v.n == 1 && v.ids[0] == id;
        k3_tok_ids_free(&v);
        if (!ok) continue;
        if (b->n_words == cap) {
            cap = cap ? 2 * cap : 256;
            char **w = realloc(b->words, (size_t)cap * sizeof *w);
            if (!w) st = K3_ERR(K3_ERR_NOMEM, "word list");
            if (w) b->words = w;
        }
        if (st == K3_OK && !(b->words[b->n_words] = strndup(p, n)))
            st = K3_ERR(K3_ERR_NOMEM, "word list");
        if (st == K3_OK) b->n_words++;
    }
    k3_tok_destroy(tok);
    if (st == K3_OK && b->n_words < 16)
        st = K3_ERR(K3_ERR_ARG,
                    "--tokenizer %s: only %lld one-token words; chat prompts of an "
                    "exact length need more",
                    dir, (long long)b->n_words);
    return st;
}

/* The tokens the chat template adds around a message, from the server's /tokenize (vLLM's and
 * k3's take a chat request): 0 with a note when the server has no such route. */
static k3_status template_overhead(serve_bench *b) {
    char url[2048], body[512];
    snprintf(url, sizeof url, "%s/tokenize", b->base_url);
    snprintf(body, sizeof body,
             "{\"model\":\"%.200s\",\"messages\":[{\"role\":\"user\",\"content\":\"\"}]}",
             b->model);
    const char *why;
    cJSON *d = http_json(b, url, body, &why);
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(d, "count");
    b->overhead = cJSON_IsNumber(c) ? (int64_t)c->valuedouble : 0;
    if (!cJSON_IsNumber(c))
        K3_LOGW("bench serve: %s does not count a chat request's tokens (%s); --input-len counts "
                "the message's tokens, not the chat template's",
                url, d ? "no count" : why);
    cJSON_Delete(d);
    if (b->overhead >= b->in_len)
        return K3_ERR(K3_ERR_ARG, "--input-len %lld: the chat template alone has %lld tokens",
                      (long long)b->in_len, (long long)b->overhead);
    return K3_OK;
}

static k3_status single(const k3_args *a, const char *flag, int64_t lo, int64_t *out) {
    int n = 0;
    K3_TRY(bench_parse_list(flag, k3_args_str(a, flag), lo, 1 << 24, out, 1, &n));
    return K3_OK;
}

static k3_status setup(const k3_args *a, serve_bench *b) {
    b->base_url = k3_args_str(a, "base-url");
    b->endpoint = k3_args_str(a, "endpoint");
    if (!b->base_url) return K3_ERR(K3_ERR_ARG, "--base-url URL is required");
    if (strncmp(b->base_url, "http://", 7) != 0 && strncmp(b->base_url, "https://", 8) != 0)
        return K3_ERR(K3_ERR_ARG, "--base-url: '%s' is not an http:// or https:// URL",
                      b->base_url);
    if (strcmp(b->endpoint, "/v1/completions") != 0 &&
        strcmp(b->endpoint, "/v1/chat/completions") != 0)
        return K3_ERR(K3_ERR_ARG, "--endpoint: '%s' is not /v1/completions or /v1/chat/completions",
                      b->endpoint);
    b->chat = strstr(b->endpoint, "chat") != NULL;
    K3_TRY(single(a, "input-len", 1, &b->in_len));
    K3_TRY(single(a, "output-len", 1, &b->out_len));
    b->n = k3_args_int(a, "num-prompts");
    b->warmups = k3_args_int(a, "num-warmups");
    if (b->n < 1 || b->n > 1000000 || b->warmups < 0 || b->warmups > 1000)
        return K3_ERR(K3_ERR_ARG, "--num-prompts must be in [1, 10^6], --num-warmups in [0, 1000]");
    b->conc = b->concs[0] = b->n + b->warmups;
    b->n_conc = 1;
    if (k3_args_has(a, "max-concurrency"))
        K3_TRY(bench_parse_list("max-concurrency", k3_args_str(a, "max-concurrency"), 1, 1 << 24,
                                b->concs, (int)K3_ARRAY_LEN(b->concs), &b->n_conc));
    b->conc = b->concs[0];
    const char *rate = k3_args_str(a, "request-rate");
    char *end;
    b->rate = strcmp(rate, "inf") == 0 ? INFINITY : strtod(rate, &end);
    if (!(b->rate > 0) || (isfinite(b->rate) && *end))
        return K3_ERR(K3_ERR_ARG, "--request-rate: '%s' must be a number > 0 or inf", rate);
    b->timeout_s = k3_args_float(a, "request-timeout");
    if (!(b->timeout_s > 0)) return K3_ERR(K3_ERR_ARG, "--request-timeout must be > 0");
    if (k3_args_int(a, "seed") < 0) return K3_ERR(K3_ERR_ARG, "--seed must be >= 0");
    b->seed = (uint64_t)k3_args_int(a, "seed");
    const char *key =
        k3_args_has(a, "api-key") ? k3_args_str(a, "api-key") : getenv("OPENAI_API_KEY");
    if (key && *key) snprintf(b->auth, sizeof b->auth, "Authorization: Bearer %s", key);
    b->n_vocab = 1000;
    if (k3_args_has(a, "tokenizer")) {
        k3_config cfg;
        K3_TRY(k3_config_load(k3_args_str(a, "tokenizer"), &cfg));
        b->n_vocab = cfg.vocab_size;
    }
    if (k3_args_has(a, "model"))
        snprintf(b->model, sizeof b->model, "%s", k3_args_str(a, "model"));
    else
        K3_TRY(server_model(b));
    if (b->chat && !k3_args_has(a, "tokenizer"))
        return K3_ERR(K3_ERR_ARG, "--endpoint /v1/chat/completions needs --tokenizer DIR (the "
                                  "model's tokenizer) for prompts of --input-len tokens");
    if (b->chat) K3_TRY(one_token_words(b, k3_args_str(a, "tokenizer")));
    if (b->chat) K3_TRY(template_overhead(b));
    b->prefix_len = k3_args_int(a, "random-prefix-len");
    if (b->prefix_len < 0 || b->prefix_len > (1 << 24))
        return K3_ERR(K3_ERR_ARG, "--random-prefix-len must be in [0, 2^24]");
    K3_TRY(k3_calloc((void **)&b->q, (size_t)(b->n + b->warmups) * sizeof *b->q, "requests"));
    k3_rng rng;
    if (b->prefix_len) { /* its own stream: the prompts' tails are the same with or without it */
        K3_TRY(k3_alloc((void **)&b->prefix, (size_t)b->prefix_len * sizeof(int32_t), "prefix"));
        k3_rng_seed(&rng, b->seed ^ 0x7072656669780000ull);
        bench_random_ids(&rng, b->chat ? b->n_words : b->n_vocab, b->prefix, b->prefix_len);
    }
    k3_rng_seed(&rng, b->seed);
    for (int64_t i = 0; i < b->n + b->warmups; i++) {
        b->q[i].warm = i < b->warmups;
        K3_TRY(make_body(b, &rng, &b->q[i]));
    }
    return K3_OK;
}

/* ---- the report --------------------------------------------------------------------------------
 */
/* Per-request series of the timed requests (seconds; lin/lout/ttfts for every request, in order,
 * 0 where one failed; ttft/tpot/e2e/itl over the completed ones). */
typedef struct series {
    double *lin, *lout, *ttfts, *ttft, *tpot, *e2e, *itl, *lcached;
    int64_t n_ok, n_tpot, n_itl, cached;
    int64_t in, out, w_in, w_out; /* tokens: timed requests, warm-ups */
} series;

static k3_status put_row(const serve_bench *b, double d, series *s, bench_row *x) {
    K3_TRY(bench_put_num(x, "num_prompts", "requests", -1, (double)b->n));
    if (isfinite(b->rate))
        K3_TRY(bench_put_num(x, "request_rate", "request rate (req/s)", 2, b->rate));
    else
        K3_TRY(bench_put_str(x, "request_rate", "request rate (req/s)", "inf")); /* as vLLM */
    K3_TRY(bench_put_num(x, "burstiness", NULL, 1, 1.0));                        /* Poisson */
    if (b->conc < b->n + b->warmups)
        K3_TRY(bench_put_num(x, "max_concurrency", "max concurrency", -1, (double)b->conc));
    else
        K3_TRY(bench_put_null(x, "max_concurrency", "max concurrency"));
    K3_TRY(bench_put_num(x, "input_len", "input len", -1, (double)b->in_len));
    K3_TRY(bench_put_num(x, "output_len", "output len", -1, (double)b->out_len));
    K3_TRY(bench_put_num(x, "duration", "duration (s)", 3, d));
    K3_TRY(bench_put_num(x, "completed", "completed", -1, (double)s->n_ok));
    K3_TRY(bench_put_num(x, "failed", "failed", -1, (double)(b->n - s->n_ok)));
    K3_TRY(bench_put_num(x, "total_input_tokens", "input tokens", -1, (double)s->in));
    K3_TRY(bench_put_num(x, "total_output_tokens", "output tokens", -1, (double)s->out));
    K3_TRY(bench_put_num(x, "warmup_input_tokens", NULL, -1, (double)s->w_in));
    K3_TRY(bench_put_num(x, "warmup_output_tokens", NULL, -1, (double)s->w_out));
    K3_TRY(bench_put_num(x, "request_throughput", "request throughput (req/s)", 2,
                         (double)s->n_ok / d));
    K3_TRY(
        bench_put_num(x, "output_throughput", "output throughput (tok/s)", 1, (double)s->out / d));
    K3_TRY(bench_put_num(x, "total_token_throughput", "total throughput (tok/s)", 1,
                         (double)(s->in + s->out) / d));
    K3_TRY(bench_put_arr(x, "input_lens", s->lin, b->n));
    K3_TRY(bench_put_arr(x, "output_lens", s->lout, b->n));
    K3_TRY(bench_put_arr(x, "ttfts", s->ttfts, b->n));
    K3_TRY(bench_put_ms_stats(x, "ttft", s->ttft, s->n_ok));
    /* the prefix cache next to TTFT: the server's cached prompt tokens (usage) */
    K3_TRY(bench_put_num(x, "random_prefix_len", "shared prefix len", -1, (double)b->prefix_len));
    K3_TRY(bench_put_num(x, "total_cached_tokens", "cached prompt tokens", -1, (double)s->cached));
    K3_TRY(bench_put_num(x, "prefix_cache_hit_rate", "prefix cache hit rate", 4,
                         s->in > 0 ? (double)s->cached / (double)s->in : 0.0));
    K3_TRY(bench_put_arr(x, "cached_lens", s->lcached, b->n));
    K3_TRY(bench_put_ms_stats(x, "tpot", s->tpot, s->n_tpot));
    K3_TRY(bench_put_ms_stats(x, "itl", s->itl, s->n_itl));
    return bench_put_ms_stats(x, "e2el", s->e2e, s->n_ok);
}

/* A request's outcome cleared for another timed run (its body is kept). */
static void reset(sreq *r) {
    r->line.n = 0, r->itl.n = 0, r->n_err_body = 0;
    r->t_start = r->t_first = r->t_last = r->t_end = 0;
    r->prompt_tokens = r->completion_tokens = r->cached_tokens = 0;
    r->usage = r->done_marker = r->ok = false;
    r->error[0] = 0;
}

static k3_status report_meta(const serve_bench *b, bench_row *m) {
    K3_TRY(bench_meta_host(m));
    K3_TRY(bench_put_str(m, "backend", "backend", b->chat ? "openai-chat" : "openai"));
    K3_TRY(bench_put_str(m, "base_url", "base URL", b->base_url));
    K3_TRY(bench_put_str(m, "endpoint", "endpoint", b->endpoint));
    K3_TRY(bench_put_str(m, "model_id", "model", b->model));
    K3_TRY(bench_put_num(m, "seed", "seed", -1, (double)b->seed));
    return bench_put_num(m, "num_warmups", "warm-up requests", -1, (double)b->warmups);
}

/* The metadata (with `meta`: the first run) and one row for the run just made. */
static k3_status report(const serve_bench *b, double d, bench_report *rep, bool meta) {
    bench_row *row;
    if (meta) K3_TRY(report_meta(b, &rep->meta));
    K3_TRY(bench_add_row(rep, &row));
    const sreq *q = b->q + b->warmups;
    const int64_t n = b->n;
    series s = {0};
    for (int64_t i = 0; i < b->warmups; i++)
        s.w_in += b->q[i].prompt_tokens, s.w_out += b->q[i].completion_tokens;
    int64_t n_itl = 0;
    for (int64_t i = 0; i < n; i++) n_itl += q[i].ok ? (int64_t)(q[i].itl.n / sizeof(double)) : 0;
    double *buf = NULL;
    K3_TRY(k3_alloc((void **)&buf, (size_t)(7 * n + n_itl + 1) * sizeof(double), "metrics"));
    s.lin = buf, s.lout = s.lin + n, s.ttfts = s.lout + n, s.ttft = s.ttfts + n;
    s.tpot = s.ttft + n, s.e2e = s.tpot + n, s.lcached = s.e2e + n, s.itl = s.lcached + n;
    for (int64_t i = 0; i < n; i++) {
        const sreq *r = &q[i];
        s.lin[i] = (double)r->prompt_tokens, s.lout[i] = (double)r->completion_tokens;
        s.ttfts[i] = r->ok && r->t_first > 0 ? r->t_first - r->t_start : 0;
        s.lcached[i] = (double)r->cached_tokens;
        if (!r->ok) continue;
        s.in += r->prompt_tokens, s.out += r->completion_tokens, s.cached += r->cached_tokens;
        const double e2e = r->t_end - r->t_start;
        s.ttft[s.n_ok] = s.ttfts[i], s.e2e[s.n_ok++] = e2e;
        if (r->completion_tokens > 1)
            s.tpot[s.n_tpot++] = (e2e - s.ttfts[i]) / (double)(r->completion_tokens - 1);
        if (r->itl.n) memcpy(s.itl + s.n_itl, r->itl.p, r->itl.n);
        s.n_itl += (int64_t)(r->itl.n / sizeof(double));
    }
    k3_status st = put_row(b, d, &s, row);
    k3_free(buf);
    return st;
}

static void serve_free(serve_bench *b) {
    for (int64_t i = 0; b->q && i < b->n + b->warmups; i++)
        k3_free(b->q[i].body), k3_chat_buf_free(&b->q[i].line), k3_chat_buf_free(&b->q[i].itl);
    k3_free(b->q), k3_free(b->prefix);
    for (int64_t i = 0; i < b->n_words; i++) free(b->words[i]);
    free(b->words);
}

int bench_serve(const k3_args *a) {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        fprintf(stderr, "k3 bench serve: curl_global_init failed\n");
        return 1;
    }
    serve_bench b = {0};
    bench_report rep = {.mode = "serve", .vertical = true};
    k3_status st = setup(a, &b);
    int rc = st == K3_ERR_ARG ? 2 : 1;
    double t0 = 0, t1 = 0, w0, w1;
    if (st == K3_OK && b.warmups) {
        K3_LOGI("bench serve: %lld warm-up request(s)", (long long)b.warmups);
        st = run_phase(&b, b.q, b.warmups, NULL, &w0, &w1);
        for (int64_t i = 0; st == K3_OK && i < b.warmups; i++)
            if (!b.q[i].ok)
                st = K3_ERR(K3_ERR_IO, "warm-up request %lld: %s", (long long)i, b.q[i].error);
    }
    double *at = NULL;
    if (st == K3_OK && isfinite(b.rate)) { /* Poisson arrivals: exponential gaps, seeded */
        st = k3_alloc((void **)&at, (size_t)b.n * sizeof(double), "arrivals");
        k3_rng rng;
        k3_rng_seed(&rng, b.seed ^ 0x9e3779b97f4a7c15ull);
        double t = 0;
        for (int64_t i = 0; st == K3_OK && i < b.n; i++)
            at[i] = t, t += -log(1.0 - k3_rng_uniform(&rng)) / b.rate;
    }
    int64_t failed = 0;
    rep.vertical = b.n_conc == 1; /* a sweep: a row per concurrency */
    for (int c = 0; st == K3_OK && c < b.n_conc; c++) {
        b.conc = b.concs[c];
        for (int64_t i = 0; i < b.n; i++) reset(&b.q[b.warmups + i]);
        K3_LOGI("bench serve: %lld requests to %s%s (model %s), at most %lld in flight",
                (long long)b.n, b.base_url, b.endpoint, b.model, (long long)b.conc);
        st = run_phase(&b, b.q + b.warmups, b.n, at, &t0, &t1);
        for (int64_t i = 0; st == K3_OK && i < b.n; i++)
            if (!b.q[b.warmups + i].ok && failed++ < 3)
                K3_LOGW("bench serve: request %lld failed: %s", (long long)i,
                        b.q[b.warmups + i].error);
        if (st == K3_OK) st = report(&b, t1 - t0, &rep, c == 0);
    }
    if (st == K3_OK)
        st = bench_report_write(&rep, k3_args_str(a, "output-json"), k3_args_str(a, "output-csv"));
    if (st == K3_OK && k3_args_has(a, "plot")) st = bench_plot_svg(&rep, k3_args_str(a, "plot"));
    if (st == K3_OK && failed)
        st = K3_ERR(K3_ERR_IO, "%lld of %lld requests failed (the first ones are named above)",
                    (long long)failed, (long long)(b.n * b.n_conc));
    if (st != K3_OK)
        fprintf(stderr, "k3 bench serve: %s\n", k3_last_error());
    else
        rc = 0;
    k3_free(at);
    bench_report_free(&rep);
    serve_free(&b);
    curl_global_cleanup();
    return rc;
}
