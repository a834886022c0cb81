/* openai.c — the OpenAI wire format of `k3 serve`: request bodies -> generation jobs, and jobs'
 * tokens -> chat.completion / text_completion bodies and their SSE chunks; /v1/models,
 * /tokenize, /detokenize and the error objects.
 *
 * Owns: the validation of a body before it can reach the engine (JSON, key types, the model name
 * (another one: 404, as OpenAI and vLLM answer), the message
 * count, prompt ids inside the vocabulary, prompt + max_tokens within the context), the
 * response and chunk layouts. Does not own: the chat template, sampling keys and the message
 * parser (client/chat_job.h), HTTP (server.c).
 * Chat defaults are OpenAI's (temperature 1, top_p 1; max_tokens = the rest of the context);
 * /v1/completions takes a prompt string (encoded without specials, as `k3 run --prompt`), a list
 * of ids, or a one-element list of either; its max_tokens defaults to 16 (OpenAI's). vLLM's
 * "return_token_ids": true adds "prompt_token_ids" and choices[0].token_ids (non-streamed); its
 * "ignore_eos": true generates past <|end_of_msg|> / [EOS] (max_tokens ends the request).
 * Streaming, chat: a first chunk with the role, then one chunk per batch of parser deltas
 * (reasoning_content / content / tool_calls, a call's id and name first, then its argument
 * fragments), each carrying the logprobs of the tokens it consumed, then a chunk with an empty
 * delta and finish_reason; with stream_options.include_usage every chunk has "usage": null and a
 * last chunk with no choices carries it; then `data: [DONE]`. */
#include "server_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static k3_status puts_(k3_chat_buf *o, const char *s) {
    return k3_chat_buf_puts(o, s);
}

static k3_status put_str(k3_chat_buf *o, const char *s, size_t n) {
    return k3_chat_json_dump_str(s, n, o);
}

static k3_status put_i64(k3_chat_buf *o, int64_t v) {
    char t[32];
    snprintf(t, sizeof t, "%lld", (long long)v);
    return puts_(o, t);
}

/* ---- errors ---------------------------------------------------------------------------------- */
/* Every error body leaves out the source location k3_set_error adds (an engine event's error
 * included). */
k3_status srv_error_json(int status, const char *why, k3_chat_buf *out) {
    char message[1600];
    snprintf(message, sizeof message, "%s", why);
    srv_strip_where(message);
    const char *type = status == 401   ? "authentication_error"
                       : status == 404 ? "not_found_error"
                       : status == 429 ? "rate_limit_error"
                       : status >= 500 ? "server_error"
                                       : "invalid_request_error";
    K3_TRY(puts_(out, "{\"error\":{\"message\":"));
    K3_TRY(put_str(out, message, strlen(message)));
    K3_TRY(puts_(out, ",\"type\":"));
    K3_TRY(put_str(out, type, strlen(type)));
    K3_TRY(puts_(out, ",\"param\":null,\"code\":"));
    K3_TRY(put_i64(out, status));
    return puts_(out, "}}");
}

void srv_strip_where(char *s) {
    for (;;) {
        size_t n = strlen(s);
        if (n < 5 || s[n - 1] != ')') return;
        char *open = strrchr(s, '(');
        if (!open || open == s || open[-1] != ' ' || !strstr(open, ".c:")) return;
        open[-1] = 0;
    }
}

static int fail(char *why, size_t n_why, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail(char *why, size_t n_why, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, n_why, fmt, ap);
    va_end(ap);
    srv_strip_where(why);
    return status;
}

/* ---- request parsing ------------------------------------------------------------------------- */
static const k3_chat_json *key(const k3_chat_json *d, const char *k) {
    const k3_chat_json *v = k3_chat_json_get(d, k);
    return v && v->kind != K3_JSON_NULL ? v : NULL;
}

/* Keys whose type the job layer does not check, checked here: the name and the expected kind. */
static int check_types(const k3_chat_json *d, char *why, size_t n_why) {
    static const struct {
        const char *key;
        k3_json_kind kind;
    } typed[] = {
        {"model", K3_JSON_STRING},          {"stream", K3_JSON_BOOL},
        {"stream_options", K3_JSON_OBJECT}, {"return_token_ids", K3_JSON_BOOL},
        {"user", K3_JSON_STRING},           {"echo", K3_JSON_BOOL},
        {"ignore_eos", K3_JSON_BOOL},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(typed); i++) {
        const k3_chat_json *v = key(d, typed[i].key);
        if (v && v->kind != typed[i].kind)
            return fail(why, n_why, 400, "request key '%s' must be a %s", typed[i].key,
                        typed[i].kind == K3_JSON_STRING ? "string"
                        : typed[i].kind == K3_JSON_BOOL ? "boolean"
                                                        : "object");
    }
    const k3_chat_json *so = key(d, "stream_options"), *iu = key(so, "include_usage");
    if (iu && iu->kind != K3_JSON_BOOL)
        return fail(why, n_why, 400,
                    "request key 'stream_options.include_usage' must be a boolean");
    if (so && !k3_chat_json_truthy(key(d, "stream")))
        return fail(why, n_why, 400, "request key 'stream_options' is only allowed with stream");
    return 200;
}

/* echo (completions) and vLLM's prompt_logprobs (both endpoints): they ask for the prompt's
 * logprobs, which the last stage computes from the prefill's rows (k3_request.prompt_logprobs). */
static int prompt_lp_keys(sreq *q, char *why, size_t n_why) {
    const k3_chat_json *d = q->job.doc, *echo = key(d, "echo"), *v = key(d, "prompt_logprobs");
    q->echo = echo && echo->b;
    if (q->echo && q->kind == SREQ_CHAT)
        return fail(why, n_why, 400, "request key 'echo' is only taken by /v1/completions");
    uint64_t n = 0;
    if (v && (v->kind != K3_JSON_INT || !k3_job_parse_u64(v->s, &n) || n > K3_JOB_MAX_TOP))
        return fail(why, n_why, 400, "request key 'prompt_logprobs' must be an integer in [0, %d]",
                    K3_JOB_MAX_TOP);
    q->plp_top = v ? (int)n : -1;
    return 200;
}

/* Ids of a JSON array, each in [0, n_vocab). */
static int take_ids(const k3_server_opts *o, const k3_chat_json *a, k3_job *j, const char *what,
                    char *why, size_t n_why) {
    if (a->n_items == 0) return fail(why, n_why, 400, "%s: the prompt is empty", what);
    if (k3_alloc((void **)&j->ids, a->n_items * sizeof(int32_t), "prompt ids") != K3_OK)
        return fail(why, n_why, 500, "out of memory");
    for (size_t i = 0; i < a->n_items; i++) {
        const k3_chat_json *v = a->items[i];
        uint64_t id = 0;
        if (v->kind != K3_JSON_INT || !k3_job_parse_u64(v->s, &id) || id >= (uint64_t)o->n_vocab)
            return fail(why, n_why, 400, "%s[%zu]: not a token id in [0, %lld)", what, i,
                        (long long)o->n_vocab);
        j->ids[i] = (int32_t)id;
    }
    j->n_ids = (int64_t)a->n_items;
    return 200;
}

/* How many prompts a completion request holds: a string or a list of ids is one; a list of
 * strings or of id lists is one per item. */
static size_t n_prompts(const k3_chat_json *p) {
    if (!p || p->kind != K3_JSON_ARRAY || p->n_items == 0) return 1;
    const k3_json_kind k = p->items[0]->kind;
    return k == K3_JSON_STRING || k == K3_JSON_ARRAY ? p->n_items : 1;
}

/* A completion prompt: a string, ids, or item `i` of a list of either. `specials`: special-token
 * text in a string is the special token (as HF and vLLM tokenize it: /tokenize); else plain text
 * (a completion's prompt, as `k3 run --prompt`). */
static int completion_prompt(const k3_server_opts *o, const k3_chat_json *p, int i, bool specials,
                             k3_job *j, char *why, size_t n_why) {
    if (!p) return fail(why, n_why, 400, "request key 'prompt' is required");
    char what[64] = "request key 'prompt'";
    if (n_prompts(p) > 1 ||
        (p->kind == K3_JSON_ARRAY && p->n_items == 1 &&
         (p->items[0]->kind == K3_JSON_STRING || p->items[0]->kind == K3_JSON_ARRAY))) {
        p = p->items[i];
        snprintf(what, sizeof what, "request key 'prompt'[%d]", i);
        if (p->kind != K3_JSON_STRING && p->kind != K3_JSON_ARRAY)
            return fail(why, n_why, 400,
                        "%s must be a string or a list of token ids, as the first prompt is", what);
    }
    if (p->kind == K3_JSON_ARRAY) return take_ids(o, p, j, what, why, n_why);
    if (p->kind != K3_JSON_STRING)
        return fail(why, n_why, 400,
                    "request key 'prompt' must be a string, a list of token ids, or a list of "
                    "either (one prompt each)");
    k3_tok_ids v = {0};
    if (k3_tok_encode(o->tok, p->s, p->n, specials, &v) != K3_OK) {
        int st = fail(why, n_why, 400, "%s: %s", what, k3_last_error());
        k3_tok_ids_free(&v);
        return st;
    }
    int st = v.n ? 200 : fail(why, n_why, 400, "%s encodes to no tokens", what);
    if (st == 200 && k3_alloc((void **)&j->ids, v.n * sizeof(int32_t), "prompt") != K3_OK)
        st = fail(why, n_why, 500, "out of memory");
    if (st == 200) memcpy(j->ids, v.ids, v.n * sizeof(int32_t)), j->n_ids = (int64_t)v.n;
    k3_tok_ids_free(&v);
    return st;
}

/* /v1/completions' "logprobs": an integer 0-20 (the top entries per token); -1 when absent. */
static int completion_logprobs(const k3_chat_json *d, int *n_top, char *why, size_t n_why) {
    const k3_chat_json *v = key(d, "logprobs");
    uint64_t n = 0;
    *n_top = -1;
    if (!v) return 200;
    if (v->kind != K3_JSON_INT || !k3_job_parse_u64(v->s, &n) || n > K3_JOB_MAX_TOP)
        return fail(why, n_why, 400, "request key 'logprobs' must be an integer in [0, %d]",
                    K3_JOB_MAX_TOP);
    *n_top = (int)n;
    return 200;
}

static int parse_job(const k3_server_opts *o, sreq *q, const char *body, size_t n, char *why,
                     size_t n_why) {
    k3_job *j = &q->job;
    const int max_messages = o->max_messages > 0 ? o->max_messages : 2048;
    k3_status ps = k3_chat_json_parse(body, n, "request", &j->doc);
    if (ps != K3_OK) /* out of memory while parsing: the server's failure (5xx) */
        return fail(why, n_why, ps == K3_ERR_NOMEM ? 500 : 400, "%s", k3_last_error());
    if (j->doc->kind != K3_JSON_OBJECT)
        return fail(why, n_why, 400, "the request body must be a JSON object");
    int st = check_types(j->doc, why, n_why);
    if (st != 200) return st;
    const k3_chat_json *model = key(j->doc, "model");
    if (model && o->model_name && !k3_chat_json_is_str(model, o->model_name))
        return fail(why, n_why, 404, "the model '%.100s' does not exist (this server serves '%s')",
                    model->s, o->model_name);
    if (q->kind == SREQ_CHAT) {
        const k3_chat_json *m = key(j->doc, "messages");
        if (!m || m->kind != K3_JSON_ARRAY)
            return fail(why, n_why, 400, "request key 'messages' must be an array");
        if (m->n_items > (size_t)max_messages)
            return fail(why, n_why, 400,
                        "request key 'messages': %zu messages, more than the "
                        "limit of %d",
                        m->n_items, max_messages);
        /* a hostile schema ($ref chain, size) is refused on this first parse, before the body is
           parsed again and rendered */
        k3_status gc = k3_job_grammar_check(j->doc, "request");
        if (gc != K3_OK)
            return fail(why, n_why, gc == K3_ERR_NOMEM ? 500 : 400, "%s", k3_last_error());
        k3_chat_json_free(j->doc); /* k3_job_parse keeps its own */
        j->doc = NULL;
        k3_status js = k3_job_parse(j, body, n, "request", o->tok);
        if (js != K3_OK)
            return fail(why, n_why, js == K3_ERR_NOMEM ? 500 : 400, "%s", k3_last_error());
        if (k3_job_logprobs_keys(j->doc, "request", &q->n_top) != K3_OK)
            return fail(why, n_why, 400, "%s", k3_last_error());
    } else {
        const k3_chat_json *sfx = key(j->doc, "suffix"); /* insertion: no FIM in K3's format */
        if (sfx && sfx->kind != K3_JSON_NULL && !(sfx->kind == K3_JSON_STRING && sfx->n == 0))
            return fail(why, n_why, 400, "request key 'suffix' is not supported by this model");
        st = completion_prompt(o, k3_chat_json_get(j->doc, "prompt"), q->prompt_i, false, j, why,
                               n_why);
        if (st != 200) return st;
        st = completion_logprobs(j->doc, &q->n_top, why, n_why);
        if (st != 200) return st;
    }
    k3_job_settings s = {.num = {[K3_JOB_TEMPERATURE] = 1,
                                 [K3_JOB_TOP_P] = 1,
                                 [K3_JOB_REPETITION_PENALTY] = 1,
                                 [K3_JOB_MAX_TOKENS] = q->kind == SREQ_COMPLETION ? 16 : 0},
                         .n_vocab = o->n_vocab,
                         .grammars = o->grammars,
                         .n_taken = true,
                         .defer_grammar = true};
    const k3_chat_json *seed = key(j->doc, "seed");
    uint64_t t = (uint64_t)k3_now_s() * 1000003u ^ (uint64_t)(uintptr_t)q;
    s.seed = seed ? 0 : k3_hash_bytes(&t, sizeof t, K3_HASH_INIT); /* unseeded: a fresh one */
    if (k3_job_sampling(j, &s, "request") != K3_OK)
        return fail(why, n_why, 400, "%s", k3_last_error());
    /* vLLM's skip_special_tokens (default true): a completion's text leaves special tokens out
       (a chat's text is the parser's, which reads the control tokens itself) */
    const k3_chat_json *skip = key(j->doc, "skip_special_tokens");
    if (skip && skip->kind != K3_JSON_NULL && skip->kind != K3_JSON_BOOL)
        return fail(why, n_why, 400, "request key 'skip_special_tokens' must be true or false");
    j->sp.skip_special =
        q->kind == SREQ_COMPLETION && (!skip || skip->kind == K3_JSON_NULL || skip->b);
    st = prompt_lp_keys(q, why, n_why);
    if (st != 200) return st;
    /* max_tokens 0 is only a prefill: useful for the prompt's logprobs (lm-eval's loglikelihood) */
    if (j->from_req[K3_JOB_MAX_TOKENS] && j->max_tokens == 0 && !q->echo && q->plp_top < 0)
        return fail(why, n_why, 400, "request key '%s': 0 must be >= 1",
                    key(j->doc, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens");
    if (j->n_ids >= o->max_ctx)
        return fail(why, n_why, 400,
                    "the prompt has %lld tokens; the context limit (--max-ctx) is %lld tokens, "
                    "prompt + completion",
                    (long long)j->n_ids, (long long)o->max_ctx);
    if (q->kind == SREQ_CHAT && !j->from_req[K3_JOB_MAX_TOKENS])
        j->max_tokens = o->max_ctx - j->n_ids; /* the rest of the context */
    if (j->n_ids + j->max_tokens > o->max_ctx)
        return fail(why, n_why, 400,
                    "the prompt (%lld tokens) + max_tokens (%lld) exceeds the context limit of "
                    "%lld tokens (--max-ctx)",
                    (long long)j->n_ids, (long long)j->max_tokens, (long long)o->max_ctx);
    k3_status gs = k3_job_grammar(j, o->grammars, "request"); /* compiled after the cheap checks */
    if (gs != K3_OK) return fail(why, n_why, gs == K3_ERR_NOMEM ? 500 : 400, "%s", k3_last_error());
    q->stream = k3_chat_json_truthy(key(j->doc, "stream"));
    q->include_usage = k3_chat_json_truthy(key(key(j->doc, "stream_options"), "include_usage"));
    q->return_token_ids = k3_chat_json_truthy(key(j->doc, "return_token_ids"));
    q->ignore_eos = k3_chat_json_truthy(key(j->doc, "ignore_eos"));
    return 200;
}

void srv_sreq_free(sreq *q) {
    if (!q) return;
    if (q->st) srv_stream_free(q->st);
    k3_free(q->st), free(q->text_copy);
    k3_job_free(&q->job);
    k3_chat_json_free(q->resp_doc);
    k3_free(q->gen), k3_free(q->lp), k3_free(q->plp), free(q->text);
    pthread_cond_destroy(&q->cv);
    k3_free(q);
}

void srv_sreq_free_chain(sreq *q) {
    while (q) {
        sreq *next = q->sib;
        srv_sreq_free(q);
        q = next;
    }
}

size_t srv_request_bytes(const k3_server_opts *o, const sreq *q, size_t body_bytes) {
    const size_t ids = (size_t)q->job.n_ids, gen = (size_t)q->cap_gen;
    size_t n = sizeof *q + body_bytes + 2 * ids * sizeof(int32_t) + gen * sizeof *q->gen;
    n += gen * sizeof(int32_t) + (size_t)o->n_vocab * 24;     /* the engine: tokens, sampler */
    if (q->lp) n += gen * (sizeof *q->lp + sizeof(k3_event)); /* logprobs here and in events */
    if (q->plp) n += 2 * ids * sizeof *q->plp;                /* prompt logprobs, both sides */
    return n;
}

int srv_n_choices(const sreq *q) {
    int n = 0;
    for (; q; q = q->sib) n++;
    return n;
}

/* One choice: prompt i of a list, copy c of n (a seeded request's copy c samples with seed + c,
 * so the copies differ and the whole response repeats). */
static int parse_choice(const k3_server_opts *o, sreq_kind kind, const char *body, size_t n, int i,
                        int c, sreq **out, char *why, size_t n_why) {
    sreq *q = NULL;
    *out = NULL;
    if (k3_calloc((void **)&q, sizeof *q, "request") != K3_OK)
        return fail(why, n_why, 500, "out of memory");
    pthread_cond_init(&q->cv, NULL);
    q->kind = kind;
    q->prompt_i = i;
    q->n_top = q->plp_top = -1;
    int st = parse_job(o, q, body, n, why, n_why);
    if (st == 200 && c > 0 && key(q->job.doc, "seed")) q->job.sp.seed += (uint64_t)c;
    q->sib_copy = c > 0;
    if (st == 200) {
        q->cap_gen = K3_MAX(q->job.max_tokens, 1);
        const bool plp = (q->echo && q->n_top >= 0) || q->plp_top >= 0;
        if (k3_alloc((void **)&q->gen, (size_t)q->cap_gen * sizeof *q->gen, "tokens") != K3_OK ||
            (q->n_top >= 0 &&
             k3_alloc((void **)&q->lp, (size_t)q->cap_gen * sizeof *q->lp, "logprobs") != K3_OK) ||
            (plp &&
             k3_calloc((void **)&q->plp, (size_t)K3_MAX(q->job.n_ids - 1, 1) * sizeof *q->plp,
                       "prompt logprobs") != K3_OK))
            st = fail(why, n_why, 500, "out of memory");
    }
    if (st != 200) {
        srv_sreq_free(q);
        return st;
    }
    *out = q;
    return 200;
}

/* "n" (choices per prompt) and "best_of" (refused: k3 returns every sample it makes). */
static int choice_keys(const k3_chat_json *d, int *n_choices, char *why, size_t n_why) {
    const k3_chat_json *n = key(d, "n"), *best = key(d, "best_of");
    uint64_t v = 1;
    if (n &&
        (n->kind != K3_JSON_INT || !k3_job_parse_u64(n->s, &v) || v < 1 || v > SRV_MAX_CHOICES))
        return fail(why, n_why, 400, "request key 'n' must be an integer in [1, %d]",
                    SRV_MAX_CHOICES);
    *n_choices = (int)v;
    if (best && !(best->kind == K3_JSON_INT && strcmp(best->s, "1") == 0))
        return fail(why, n_why, 400,
                    "request key 'best_of' is not supported (k3 does not rank samples); ask for "
                    "n choices instead");
    return 200;
}

int srv_parse(const k3_server_opts *o, sreq_kind kind, const char *body, size_t n, sreq **out,
              char *why, size_t n_why) {
    sreq *head = NULL;
    *out = NULL;
    int st = parse_choice(o, kind, body, n, 0, 0, &head, why, n_why);
    if (st != 200) return st;
    int n_copies = 1;
    st = choice_keys(head->job.doc, &n_copies, why, n_why);
    const size_t n_p = kind == SREQ_COMPLETION ? n_prompts(key(head->job.doc, "prompt")) : 1;
    if (st == 200 && n_p * (size_t)n_copies > SRV_MAX_CHOICES)
        st = fail(why, n_why, 400, "%zu prompts x n %d = %zu choices, more than %d", n_p, n_copies,
                  n_p * (size_t)n_copies, SRV_MAX_CHOICES);
    const size_t n_ch = n_p * (size_t)n_copies, one = srv_request_bytes(o, head, n);
    if (st == 200 && o->max_queue_bytes && one > o->max_queue_bytes / n_ch) /* before the copies */
        st = fail(why, n_why, 413,
                  "the request's %zu choices need about %zu bytes, more than the whole queue may "
                  "hold (--max-queue-bytes %zu): it can never be admitted",
                  n_ch, one * n_ch, o->max_queue_bytes);
    sreq *last = head, *first = head; /* first: copy 0 of the current prompt */
    for (size_t k = 1; st == 200 && k < n_p * (size_t)n_copies; k++) {
        st = parse_choice(o, kind, body, n, (int)(k / (size_t)n_copies),
                          (int)(k % (size_t)n_copies), &last->sib, why, n_why);
        if (st == 200) last = last->sib, last->index = (int)k;
        if (st == 200 && k % (size_t)n_copies == 0) first = last;
        if (st == 200 && k % (size_t)n_copies != 0) last->fork_src = first;
    }
    if (st != 200) {
        srv_sreq_free_chain(head);
        return st;
    }
    for (sreq *q = head; q; q = q->sib)
        q->multi = head->sib != NULL, q->n_bytes = srv_request_bytes(o, q, n);
    *out = head;
    return 200;
}

int k3_server_check_request(const k3_server_opts *o, const char *path, const char *body,
                            size_t n_bytes, char *why, size_t n_why) {
    const size_t max_body = o->max_body_bytes ? o->max_body_bytes : (size_t)4 << 20;
    if (n_bytes > max_body)
        return fail(why, n_why, 413, "the body has %zu bytes, more than the limit of %zu", n_bytes,
                    max_body);
    k3_chat_buf out = {0};
    int st = 404;
    if (strcmp(path, "/tokenize") == 0) {
        st = srv_tokenize(o, body, n_bytes, &out);
    } else if (strcmp(path, "/detokenize") == 0) {
        st = srv_detokenize(o, body, n_bytes, &out);
    } else if (strcmp(path, "/v1/responses") == 0) {
        sreq *q = NULL;
        st = srv_responses_parse(o, body, n_bytes, &q, why, n_why);
        srv_sreq_free_chain(q);
        return st;
    } else if (strcmp(path, "/v1/chat/completions") == 0 || strcmp(path, "/v1/completions") == 0) {
        sreq *q = NULL;
        st = srv_parse(o, path[4] == 'c' && path[5] == 'h' ? SREQ_CHAT : SREQ_COMPLETION, body,
                       n_bytes, &q, why, n_why);
        srv_sreq_free_chain(q);
        return st;
    } else {
        return fail(why, n_why, 404, "no route %.200s", path);
    }
    if (st != 200) snprintf(why, n_why, "%s", out.p ? out.p : "");
    k3_chat_buf_free(&out);
    return st;
}

/* ---- response bodies ------------------------------------------------------------------------- */
static k3_status put_head(const k3_server_opts *o, const sreq *q, const char *object,
                          k3_chat_buf *out) {
    K3_TRY(puts_(out, "{\"id\":"));
    K3_TRY(put_str(out, q->id, strlen(q->id)));
    K3_TRY(puts_(out, ",\"object\":"));
    K3_TRY(put_str(out, object, strlen(object)));
    K3_TRY(puts_(out, ",\"created\":"));
    K3_TRY(put_i64(out, q->created));
    K3_TRY(puts_(out, ",\"model\":"));
    K3_TRY(put_str(out, o->model_name, strlen(o->model_name)));
    return puts_(out, ",\"choices\":[");
}

/* usage, with OpenAI's prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache
   served (docs/DESIGN.md §3c). */
static k3_status put_usage(int64_t n_prompt, int64_t n_gen, int64_t n_cached, k3_chat_buf *out) {
    char t[224];
    snprintf(t, sizeof t,
             "{\"prompt_tokens\":%lld,\"completion_tokens\":%lld,\"total_tokens\":%lld,"
             "\"prompt_tokens_details\":{\"cached_tokens\":%lld}}",
             (long long)n_prompt, (long long)n_gen, (long long)(n_prompt + n_gen),
             (long long)n_cached);
    return puts_(out, t);
}

/* Chat logprobs entries of tokens [a, b): {"token","logprob","bytes","top_logprobs":[..]}. */
static k3_status put_chat_lp(const k3_server_opts *o, const sreq *q, const sreq_tok *toks,
                             const sreq_lp *lps, int64_t a, int64_t b, k3_chat_buf *out) {
    for (int64_t t = a; t < b; t++) {
        if (t > a) K3_TRY(puts_(out, ","));
        K3_TRY(k3_job_logprob_entry(o->tok, toks[t].id, lps[t].logprob, out));
        K3_TRY(puts_(out, ",\"top_logprobs\":["));
        for (int k = 0; k < K3_MIN(lps[t].n_top, q->n_top); k++) {
            if (k) K3_TRY(puts_(out, ","));
            K3_TRY(k3_job_logprob_entry(o->tok, lps[t].top_ids[k], lps[t].top_logprobs[k], out));
            K3_TRY(puts_(out, "}"));
        }
        K3_TRY(puts_(out, "]}"));
    }
    return K3_OK;
}

typedef k3_job_lp_row lp_row;

/* A token's text as a JSON string, and a logprob as OpenAI writes it (client/chat_job.h). */
static k3_status put_token(const k3_server_opts *o, int32_t id, k3_chat_buf *out) {
    return k3_job_token_str(o->tok, id, out);
}

static k3_status put_lp(float lp, k3_chat_buf *out) {
    return k3_job_logprob_num(lp, out);
}

/* Rows of the echoed prompt into rows[0, n_ids): the first
 * token has no logprob; the others come from the last stage (sreq.plp). */
static void prompt_rows(const k3_server_opts *o, const sreq *q, lp_row *rows) {
    int64_t off = 0;
    for (int64_t i = 0; i < q->job.n_ids; i++) {
        const k3_prompt_lp *p = i && q->plp ? &q->plp[i - 1] : NULL;
        rows[i] = (lp_row){.id = q->job.ids[i],
                           .logprob = p ? p->logprob : NAN,
                           .n_top = p ? K3_MIN(p->n_top, K3_MAX(q->n_top, 0)) : 0,
                           .top_ids = p ? p->top_ids : NULL,
                           .top_lps = p ? p->top_logprobs : NULL,
                           .offset = off};
        const char *b = "";
        size_t nb = 0;
        if (k3_tok_id_bytes(o->tok, q->job.ids[i], &b, &nb) == K3_OK) off += (int64_t)nb;
    }
}

/* Completion logprobs of generated tokens [a, b), after `prompt` echoed rows (NULL: none, else
 * [n_prompt]); text offsets from `base` (the echoed prompt's bytes). */
static k3_status put_completion_lp(const k3_server_opts *o, const sreq *q, const sreq_tok *toks,
                                   const sreq_lp *lps, int64_t a, int64_t b, const lp_row *prompt,
                                   int64_t n_prompt, int64_t base, k3_chat_buf *out) {
    lp_row *rows = NULL;
    const int64_t n = n_prompt + (b - a);
    K3_TRY(k3_alloc((void **)&rows, (size_t)K3_MAX(n, 1) * sizeof *rows, "logprob rows"));
    if (n_prompt) memcpy(rows, prompt, (size_t)n_prompt * sizeof *rows);
    for (int64_t t = a; t < b; t++)
        rows[n_prompt + t - a] = (lp_row){.id = toks[t].id,
                                          .logprob = lps[t].logprob,
                                          .n_top = K3_MIN(lps[t].n_top, q->n_top),
                                          .top_ids = lps[t].top_ids,
                                          .top_lps = lps[t].top_logprobs,
                                          .offset = base + (int64_t)(t ? toks[t - 1].text_end : 0)};
    k3_status st = k3_job_completion_logprobs(o->tok, rows, n, out);
    k3_free(rows);
    return st;
}

/* The echoed prompt: its text and, with logprobs, its rows (*rows: [n_ids], the caller frees). */
static k3_status echo_prompt(const k3_server_opts *o, const sreq *q, k3_tok_bytes *text,
                             lp_row **rows, int64_t *n_bytes) {
    K3_TRY(k3_tok_decode(o->tok, q->job.ids, (size_t)q->job.n_ids, text));
    K3_TRY(k3_alloc((void **)rows, (size_t)q->job.n_ids * sizeof **rows, "prompt logprob rows"));
    prompt_rows(o, q, *rows);
    *n_bytes = (int64_t)text->n; /* the offsets of what follows count the text as sent */
    return K3_OK;
}

/* vLLM's prompt_logprobs: [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...], each
 * position's own token first, then its top entries. */
static k3_status put_prompt_logprobs(const k3_server_opts *o, const sreq *q, k3_chat_buf *out) {
    K3_TRY(puts_(out, "[null"));
    for (int64_t i = 1; i < q->job.n_ids; i++) {
        const k3_prompt_lp *p = &q->plp[i - 1];
        K3_TRY(puts_(out, ",{"));
        for (int k = -1; k < K3_MIN(p->n_top, q->plp_top); k++) {
            const int32_t id = k < 0 ? q->job.ids[i] : p->top_ids[k];
            if (k >= 0 && id == q->job.ids[i]) continue; /* the key is there already */
            if (k >= 0) K3_TRY(puts_(out, ","));
            K3_TRY(puts_(out, "\""));
            K3_TRY(put_i64(out, id));
            K3_TRY(puts_(out, "\":{\"logprob\":"));
            K3_TRY(put_lp(k < 0 ? p->logprob : p->top_logprobs[k], out));
            K3_TRY(puts_(out, ",\"rank\":"));
            K3_TRY(put_i64(out, k < 0 ? p->rank : k + 1));
            K3_TRY(puts_(out, ",\"decoded_token\":"));
            K3_TRY(put_token(o, id, out));
            K3_TRY(puts_(out, "}"));
        }
        K3_TRY(puts_(out, "}"));
    }
    return puts_(out, "]");
}

/* The message of a parser: {"role","content","reasoning_content"?,"tool_calls"?}. */
static k3_status put_message(k3_parser *p, k3_chat_buf *out) {
    k3_parser_message m;
    K3_TRY(k3_parser_message_view(p, &m));
    K3_TRY(puts_(out, "{\"role\":\"assistant\",\"content\":"));
    K3_TRY(put_str(out, m.content, m.n_content));
    if (m.has_reasoning) {
        K3_TRY(puts_(out, ",\"reasoning_content\":"));
        K3_TRY(put_str(out, m.reasoning, m.n_reasoning));
    }
    /* a call cut at max_tokens comes last, as the stream's deltas carried it (vLLM's way) */
    k3_parser_call cut;
    const bool has_cut = k3_parser_cut_call(p, &cut);
    const size_t n = m.n_calls + has_cut;
    if (n) K3_TRY(puts_(out, ",\"tool_calls\":["));
    for (size_t i = 0; i < n; i++) {
        const k3_parser_call *c = i < m.n_calls ? &m.calls[i] : &cut;
        K3_TRY(puts_(out, i ? ",{\"id\":" : "{\"id\":"));
        K3_TRY(put_str(out, c->id, strlen(c->id)));
        K3_TRY(puts_(out, ",\"type\":\"function\",\"function\":{\"name\":"));
        K3_TRY(put_str(out, c->name, c->n_name));
        K3_TRY(puts_(out, ",\"arguments\":"));
        K3_TRY(put_str(out, c->arguments, c->n_arguments));
        K3_TRY(puts_(out, "}}"));
    }
    if (n) K3_TRY(puts_(out, "]"));
    return puts_(out, "}");
}

static const char *completion_finish(k3_stop_kind stop) {
    return stop == K3_STOP_NONE ? "length" : "stop";
}

static k3_status put_ids(const sreq_tok *toks, int64_t n, k3_chat_buf *out) {
    K3_TRY(puts_(out, "["));
    for (int64_t i = 0; i < n; i++) {
        if (i) K3_TRY(puts_(out, ","));
        K3_TRY(put_i64(out, toks[i].id));
    }
    return puts_(out, "]");
}

/* Feed tokens [st->n_fed, s->n_gen) to the chat parser (and end it when s->done). */
k3_status srv_feed_chat(const sreq *q, srv_stream *st, const srv_snapshot *s,
                        const k3_tokenizer *tok) {
    if (!st->feed) K3_TRY(k3_job_feed_create(&q->job, tok, q->ignore_eos, &st->feed));
    for (; st->n_fed < s->n_gen; st->n_fed++)
        K3_TRY(k3_job_feed_token(st->feed, s->toks[st->n_fed].id, s->toks[st->n_fed].text_end));
    if (s->done && !s->failed) K3_TRY(k3_job_feed_end(st->feed, s->stop, s->n_text));
    return K3_OK;
}

/* A completion choice's "text" and "logprobs" (echo: the prompt's first), and vLLM's
 * "prompt_logprobs" when asked. */
static k3_status completion_body(const k3_server_opts *o, const sreq *q, k3_chat_buf *out) {
    k3_tok_bytes pt = {0};
    lp_row *prow = NULL;
    int64_t base = 0;
    k3_chat_buf txt = {0};
    k3_status r = q->echo ? echo_prompt(o, q, &pt, &prow, &base) : K3_OK;
    if (r == K3_OK && pt.n) r = k3_chat_buf_put(&txt, pt.data, pt.n);
    if (r == K3_OK && q->n_text) r = k3_chat_buf_put(&txt, q->text, q->n_text);
    if (r == K3_OK) r = puts_(out, "\"text\":");
    if (r == K3_OK) r = put_str(out, txt.p ? txt.p : "", txt.n);
    if (r == K3_OK) r = puts_(out, ",\"logprobs\":");
    if (r == K3_OK)
        r = q->lp ? put_completion_lp(o, q, q->gen, q->lp, 0, q->n_gen, prow,
                                      prow ? q->job.n_ids : 0, base, out)
                  : puts_(out, "null");
    if (r == K3_OK && q->plp_top >= 0) r = puts_(out, ",\"prompt_logprobs\":");
    if (r == K3_OK && q->plp_top >= 0) r = put_prompt_logprobs(o, q, out);
    k3_tok_bytes_free(&pt);
    k3_free(prow);
    k3_chat_buf_free(&txt);
    return r;
}

/* One choice of a response: {"index", "message" | "text", "logprobs", "finish_reason", ...}. */
static k3_status put_choice(const k3_server_opts *o, const sreq *q, k3_chat_buf *out) {
    K3_TRY(puts_(out, "{\"index\":"));
    K3_TRY(put_i64(out, q->index));
    K3_TRY(puts_(out, ","));
    const char *finish = completion_finish(q->stop);
    if (q->kind == SREQ_CHAT) {
        srv_stream st = {0};
        const srv_snapshot s = {
            .toks = q->gen, .n_gen = q->n_gen, .n_text = q->n_text, .done = true, .stop = q->stop};
        k3_status r = srv_feed_chat(q, &st, &s, o->tok);
        k3_parser_message m = {0};
        if (r == K3_OK) r = puts_(out, "\"message\":");
        if (r == K3_OK) r = put_message(k3_job_feed_parser(st.feed), out);
        if (r == K3_OK) r = k3_parser_message_view(k3_job_feed_parser(st.feed), &m);
        if (r == K3_OK && m.finish_reason) finish = m.finish_reason;
        if (r == K3_OK) r = puts_(out, ",\"logprobs\":");
        if (r == K3_OK && q->lp) {
            r = puts_(out, "{\"content\":[");
            if (r == K3_OK) r = put_chat_lp(o, q, q->gen, q->lp, 0, q->n_gen, out);
            if (r == K3_OK) r = puts_(out, "],\"refusal\":null}");
        } else if (r == K3_OK) {
            r = puts_(out, "null");
        }
        if (r == K3_OK) r = puts_(out, ",\"finish_reason\":");
        if (r == K3_OK) r = put_str(out, finish, strlen(finish));
        srv_stream_free(&st);
        K3_TRY(r);
    } else {
        K3_TRY(completion_body(o, q, out));
        K3_TRY(puts_(out, ",\"finish_reason\":"));
        K3_TRY(put_str(out, finish, strlen(finish)));
    }
    if (q->return_token_ids) {
        K3_TRY(puts_(out, ",\"token_ids\":"));
        K3_TRY(put_ids(q->gen, q->n_gen, out));
    }
    return puts_(out, "}");
}

/* The usage of a request: each prompt counted once (as OpenAI counts n > 1), every choice's
 * completion tokens, and the prompt tokens its prefix-cache hit served (the prompt's). */
static void usage_sums(const sreq *head, int64_t *n_prompt, int64_t *n_gen, int64_t *n_cached) {
    *n_prompt = *n_gen = *n_cached = 0;
    for (const sreq *q = head; q; q = q->sib) {
        if (!q->sib_copy) *n_prompt += q->n_prompt, *n_cached += q->n_cached;
        *n_gen += q->n_gen;
    }
}

k3_status srv_response(const k3_server_opts *o, const sreq *q, k3_chat_buf *out) {
    if (q->responses) return srv_responses_body(o, q, out);
    const bool chat = q->kind == SREQ_CHAT;
    K3_TRY(put_head(o, q, chat ? "chat.completion" : "text_completion", out));
    for (const sreq *c = q; c; c = c->sib) {
        if (c != q) K3_TRY(puts_(out, ","));
        K3_TRY(put_choice(o, c, out));
    }
    int64_t n_prompt, n_gen, n_cached;
    usage_sums(q, &n_prompt, &n_gen, &n_cached);
    K3_TRY(puts_(out, "],\"usage\":"));
    K3_TRY(put_usage(n_prompt, n_gen, n_cached, out));
    if (chat && q->plp_top >= 0) { /* vLLM puts a chat request's at the top level */
        K3_TRY(puts_(out, ",\"prompt_logprobs\":"));
        K3_TRY(put_prompt_logprobs(o, q, out));
    }
    if (q->return_token_ids) {
        K3_TRY(puts_(out, ",\"prompt_token_ids\":["));
        for (int64_t i = 0; i < q->job.n_ids; i++) {
            if (i) K3_TRY(puts_(out, ","));
            K3_TRY(put_i64(out, q->job.ids[i]));
        }
        K3_TRY(puts_(out, "]"));
    }
    return puts_(out, "}");
}

/* ---- streaming ------------------------------------------------------------------------------- */
/* One SSE chunk: "data: {head, choices:[{index:0, <choice>, finish_reason}]<, usage:null>}\n\n"
 * where `choice` is written by the caller between the two calls. */
static k3_status chunk_open(const k3_server_opts *o, const sreq *q, k3_chat_buf *out) {
    K3_TRY(puts_(out, "data: "));
    K3_TRY(put_head(o, q, q->kind == SREQ_CHAT ? "chat.completion.chunk" : "text_completion", out));
    K3_TRY(puts_(out, "{\"index\":"));
    K3_TRY(put_i64(out, q->index));
    return puts_(out, ",");
}

static k3_status chunk_close(const sreq *q, const char *finish, k3_chat_buf *out) {
    K3_TRY(puts_(out, ",\"finish_reason\":"));
    K3_TRY(finish ? put_str(out, finish, strlen(finish)) : puts_(out, "null"));
    K3_TRY(puts_(out, "}]"));
    if (q->include_usage) K3_TRY(puts_(out, ",\"usage\":null"));
    return puts_(out, "}\n\n");
}

/* The logprobs of tokens [a, b) as a chunk's "logprobs" value. */
static k3_status chunk_lp(const k3_server_opts *o, const sreq *q, const srv_stream *st,
                          const srv_snapshot *s, int64_t a, int64_t b, k3_chat_buf *out) {
    K3_TRY(puts_(out, ",\"logprobs\":"));
    if (!s->lps || a == b) return puts_(out, "null");
    if (q->kind != SREQ_CHAT)
        return put_completion_lp(o, q, s->toks, s->lps, a, b, NULL, 0, st->echo_base, out);
    K3_TRY(puts_(out, "{\"content\":["));
    K3_TRY(put_chat_lp(o, q, s->toks, s->lps, a, b, out));
    return puts_(out, "],\"refusal\":null}");
}

static k3_status chat_chunks(const k3_server_opts *o, const sreq *q, srv_stream *st,
                             const srv_snapshot *s, k3_chat_buf *out) {
    if (!st->role_sent) {
        K3_TRY(chunk_open(o, q, out));
        K3_TRY(puts_(out, "\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null"));
        K3_TRY(chunk_close(q, NULL, out));
        st->role_sent = true;
    }
    if (s->failed) return K3_OK;
    K3_TRY(srv_feed_chat(q, st, s, o->tok));
    k3_parser *p = k3_job_feed_parser(st->feed);
    k3_parser_delta d;
    K3_TRY(k3_parser_take_delta(p, &d));
    /* tokens that made no delta yet (held text, markers) give their logprobs to the next chunk */
    const bool news = !k3_parser_delta_empty(&d);
    if (news) {
        K3_TRY(chunk_open(o, q, out));
        K3_TRY(puts_(out, "\"delta\":"));
        K3_TRY(k3_parser_delta_json(&d, out));
        K3_TRY(chunk_lp(o, q, st, s, st->n_lp, s->n_gen, out));
        K3_TRY(chunk_close(q, NULL, out));
        st->n_lp = s->n_gen;
    }
    if (!s->done) return K3_OK;
    k3_parser_message m;
    K3_TRY(k3_parser_message_view(p, &m));
    const char *finish = m.finish_reason ? m.finish_reason : completion_finish(s->stop);
    K3_TRY(chunk_open(o, q, out));
    K3_TRY(puts_(out, "\"delta\":{}"));
    K3_TRY(chunk_lp(o, q, st, s, st->n_lp, s->n_gen, out));
    st->n_lp = s->n_gen;
    return chunk_close(q, finish, out);
}

/* The echoed prompt as a stream's first chunk, once its logprobs are in (with the first token). */
static k3_status echo_chunk(const k3_server_opts *o, const sreq *q, srv_stream *st,
                            const srv_snapshot *s, k3_chat_buf *out) {
    k3_tok_bytes pt = {0};
    lp_row *prow = NULL;
    k3_status r = echo_prompt(o, q, &pt, &prow, &st->echo_base);
    if (r == K3_OK) r = chunk_open(o, q, out);
    if (r == K3_OK) r = puts_(out, "\"text\":");
    if (r == K3_OK) r = put_str(out, pt.data ? pt.data : "", pt.n);
    if (r == K3_OK) r = puts_(out, ",\"logprobs\":");
    if (r == K3_OK)
        r = s->lps ? put_completion_lp(o, q, NULL, NULL, 0, 0, prow, q->job.n_ids, 0, out)
                   : puts_(out, "null");
    if (r == K3_OK) r = chunk_close(q, NULL, out);
    k3_tok_bytes_free(&pt);
    k3_free(prow);
    st->echo_sent = true;
    return r;
}

static k3_status completion_chunks(const k3_server_opts *o, const sreq *q, srv_stream *st,
                                   const srv_snapshot *s, k3_chat_buf *out) {
    if (s->failed) return K3_OK;
    if (q->echo && !st->echo_sent && (s->n_gen > 0 || s->done))
        K3_TRY(echo_chunk(o, q, st, s, out));
    const bool news = s->n_text > st->text_seen;
    if (!news && !s->done) return K3_OK;
    K3_TRY(chunk_open(o, q, out));
    K3_TRY(puts_(out, "\"text\":"));
    K3_TRY(put_str(out, s->text + st->text_seen, s->n_text - st->text_seen));
    K3_TRY(chunk_lp(o, q, st, s, st->n_lp, s->n_gen, out));
    K3_TRY(chunk_close(q, s->done ? completion_finish(s->stop) : NULL, out));
    st->text_seen = s->n_text;
    st->n_fed = st->n_lp = s->n_gen;
    return K3_OK;
}

k3_status srv_stream_chunks(const k3_server_opts *o, const sreq *q, srv_stream *st,
                            const srv_snapshot *s, k3_chat_buf *out) {
    if (st->end_sent) return K3_OK;
    if (q->responses) {
        K3_TRY(srv_responses_chunks(o, q, st, s, out));
        st->end_sent = s->done;
        return K3_OK;
    }
    K3_TRY(q->kind == SREQ_CHAT ? chat_chunks(o, q, st, s, out)
                                : completion_chunks(o, q, st, s, out));
    st->end_sent = s->done; /* this choice's chunks are all out */
    return K3_OK;
}

k3_status srv_stream_end(const k3_server_opts *o, const sreq *head, k3_chat_buf *out) {
    if (head->responses) return srv_responses_end(o, head, out);
    const sreq *bad = head;
    while (bad && !bad->failed) bad = bad->sib;
    if (bad) {
        k3_chat_buf e = {0};
        k3_status r = srv_error_json(500, bad->error, &e);
        if (r == K3_OK) r = puts_(out, "data: ");
        if (r == K3_OK) r = k3_chat_buf_put(out, e.p, e.n);
        if (r == K3_OK) r = puts_(out, "\n\n");
        k3_chat_buf_free(&e);
        K3_TRY(r);
    } else if (head->include_usage) {
        int64_t n_prompt, n_gen, n_cached;
        usage_sums(head, &n_prompt, &n_gen, &n_cached);
        K3_TRY(puts_(out, "data: "));
        K3_TRY(put_head(
            o, head, head->kind == SREQ_CHAT ? "chat.completion.chunk" : "text_completion", out));
        K3_TRY(puts_(out, "],\"usage\":"));
        K3_TRY(put_usage(n_prompt, n_gen, n_cached, out));
        K3_TRY(puts_(out, "}\n\n"));
    }
    return puts_(out, "data: [DONE]\n\n");
}

void srv_stream_free(srv_stream *st) {
    k3_job_feed_destroy(st->feed);
    srv_responses_stream_free(st->rs);
    memset(st, 0, sizeof *st);
}

/* ---- models, tokenize, detokenize ------------------------------------------------------------ */
k3_status srv_models_json(const k3_server_opts *o, int64_t created, bool one, k3_chat_buf *out) {
    K3_TRY(puts_(out, one ? "{\"id\":" : "{\"object\":\"list\",\"data\":[{\"id\":"));
    K3_TRY(put_str(out, o->model_name, strlen(o->model_name)));
    K3_TRY(puts_(out, ",\"object\":\"model\",\"created\":"));
    K3_TRY(put_i64(out, created));
    K3_TRY(puts_(out, ",\"owned_by\":\"k3\",\"root\":"));
    K3_TRY(put_str(out, o->model_name, strlen(o->model_name)));
    K3_TRY(puts_(out, ",\"max_model_len\":"));
    K3_TRY(put_i64(out, o->max_ctx));
    return puts_(out, one ? "}" : "}]}");
}

k3_status srv_info_json(const k3_server_opts *o, const char *path, k3_chat_buf *out) {
    if (strcmp(path, "/version") == 0) {
        K3_TRY(puts_(out, "{\"version\":"));
        const char *v = o->version ? o->version : "unknown";
        K3_TRY(put_str(out, v, strlen(v)));
        return puts_(out, "}");
    }
    /* the tokenizer's config as its file says it (vLLM returns the tokenizer's init kwargs) */
    k3_chat_json *d = NULL;
    const char *t = o->tokenizer_info;
    if (t && k3_chat_json_parse(t, strlen(t), "tokenizer_config.json", &d) == K3_OK &&
        d->kind == K3_JSON_OBJECT) {
        k3_chat_json_free(d);
        K3_TRY(puts_(out, t));
        return K3_OK;
    }
    k3_chat_json_free(d);
    k3_tok_ctrl c = k3_tok_control_ids(o->tok);
    K3_TRY(puts_(out, "{\"tokenizer_class\":\"TikTokenTokenizer\""));
    const char *p = "";
    size_t nb = 0;
    if (c.eos >= 0 && k3_tok_id_bytes(o->tok, c.eos, &p, &nb) == K3_OK) {
        K3_TRY(puts_(out, ",\"eos_token\":"));
        K3_TRY(put_str(out, p, nb));
    }
    K3_TRY(puts_(out, ",\"model_max_length\":"));
    K3_TRY(put_i64(out, o->max_ctx));
    return puts_(out, "}");
}

static int error_body(int status, const char *why, k3_chat_buf *out) {
    out->n = 0;
    return srv_error_json(status, why, out) == K3_OK ? status : 500; /* it strips the location */
}

/* vLLM's /tokenize: {"prompt": text} or a chat request ({"messages": [...], ...}) ->
 * {"count", "max_model_len", "tokens"} (+ "token_strs" with return_token_strs). A prompt's
 * special-token text is the special token, as HF's tokenizer and vLLM read it (lm-eval takes
 * BOS as /tokenize("[BOS]")[0]); add_special_tokens (vLLM's, default true for a prompt) adds
 * nothing for K3, whose tokenizer adds no BOS / EOS (its HF tokenizer adds none either). */
int srv_tokenize(const k3_server_opts *o, const char *body, size_t n, k3_chat_buf *out) {
    char why[1024];
    sreq *q = NULL;
    k3_chat_json *d = NULL;
    if (k3_chat_json_parse(body, n, "request", &d) != K3_OK)
        return error_body(400, k3_last_error(), out);
    const bool chat = k3_chat_json_get(d, "messages") != NULL;
    static const char *const flags[] = {"add_special_tokens", "return_token_strs"};
    for (size_t i = 0; i < K3_ARRAY_LEN(flags); i++) {
        const k3_chat_json *f = key(d, flags[i]);
        if (f && f->kind != K3_JSON_BOOL) {
            snprintf(why, sizeof why, "request key '%s' must be true or false", flags[i]);
            k3_chat_json_free(d);
            return error_body(400, why, out);
        }
    }
    const bool strs = k3_chat_json_truthy(key(d, "return_token_strs"));
    k3_chat_json_free(d);
    k3_job j = {0};
    int st = 200;
    if (chat) {
        if (k3_job_parse(&j, body, n, "request", o->tok) != K3_OK)
            st = error_body(400, k3_last_error(), out);
    } else {
        if (k3_calloc((void **)&q, sizeof *q, "request") != K3_OK)
            return error_body(500, "oom", out);
        if (k3_chat_json_parse(body, n, "request", &q->job.doc) != K3_OK)
            st = error_body(400, k3_last_error(), out);
        if (st == 200) {
            st = completion_prompt(o, k3_chat_json_get(q->job.doc, "prompt"), 0, true, &q->job, why,
                                   sizeof why);
            if (st != 200) st = error_body(st, why, out);
        }
        j = q->job;
        memset(&q->job, 0, sizeof q->job);
        k3_free(q);
    }
    if (st == 200) {
        k3_status r = puts_(out, "{\"count\":");
        if (r == K3_OK) r = put_i64(out, j.n_ids);
        if (r == K3_OK) r = puts_(out, ",\"max_model_len\":");
        if (r == K3_OK) r = put_i64(out, o->max_ctx);
        if (r == K3_OK) r = puts_(out, ",\"tokens\":[");
        for (int64_t i = 0; i < j.n_ids && r == K3_OK; i++) {
            if (i) r = puts_(out, ",");
            if (r == K3_OK) r = put_i64(out, j.ids[i]);
        }
        if (r == K3_OK) r = puts_(out, "]");
        if (r == K3_OK && strs) r = puts_(out, ",\"token_strs\":[");
        for (int64_t i = 0; strs && i < j.n_ids && r == K3_OK; i++) {
            if (i) r = puts_(out, ",");
            if (r == K3_OK) r = put_token(o, j.ids[i], out);
        }
        if (r == K3_OK && strs) r = puts_(out, "]");
        if (r == K3_OK) r = puts_(out, "}");
        if (r != K3_OK) st = error_body(500, k3_last_error(), out);
    }
    k3_job_free(&j);
    return st;
}

/* vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}. */
int srv_detokenize(const k3_server_opts *o, const char *body, size_t n, k3_chat_buf *out) {
    char why[1024];
    k3_chat_json *d = NULL;
    if (k3_chat_json_parse(body, n, "request", &d) != K3_OK)
        return error_body(400, k3_last_error(), out);
    const k3_chat_json *t = k3_chat_json_get(d, "tokens");
    k3_job j = {0};
    int st = t && t->kind == K3_JSON_ARRAY
                 ? take_ids(o, t, &j, "request key 'tokens'", why, sizeof why)
                 : fail(why, sizeof why, 400, "request key 'tokens' must be a list of token ids");
    if (st != 200) st = error_body(st, why, out);
    k3_tok_bytes txt = {0};
    if (st == 200 && k3_tok_decode(o->tok, j.ids, (size_t)j.n_ids, &txt) != K3_OK)
        st = error_body(400, k3_last_error(), out);
    if (st == 200 &&
        (puts_(out, "{\"prompt\":") != K3_OK ||
         put_str(out, txt.data ? txt.data : "", txt.n) != K3_OK || puts_(out, "}") != K3_OK))
        st = error_body(500, k3_last_error(), out);
    k3_tok_bytes_free(&txt);
    k3_job_free(&j);
    k3_chat_json_free(d);
    return st;
}
