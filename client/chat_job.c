/* chat_job.c — an OpenAI chat request as a generation job (see chat_job.h): prompt ids and
 * sampling parameters in, the assistant message out. Used by `k3 run --chat` and `k3 batch`.
 *
 * Merge rule, per setting: a flag given explicitly (settings.fixed) wins; otherwise the request's
 * key when present and not null; otherwise the flag's default. max_completion_tokens is read
 * after max_tokens and wins over it (OpenAI deprecated max_tokens for it).
 * Validation happens once, after the merge, on the value that will be used, so the message names
 * where that value came from: "--chat: request key 'top_p': 0 must be in (0, 1]" (K3_ERR_FORMAT,
 * a bad request) or "--top-p: 0 must be in (0, 1]" (K3_ERR_ARG, a usage error).
 * logit_bias: an object {"id": bias} (ids as decimal strings, OpenAI) with ids below the model's
 * vocab_size (settings.n_vocab); a bias must fit a float;
 * -Infinity (a ban) is passed on for the sampler to judge. seed: the JSON lexeme as an unsigned
 * 64-bit integer (never through a double). n: only 1. */
#include "chat_job.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "k3_parser.h"

/* ---- the prompt ---------------------------------------------------------------------------- */
/* What the renderer takes (it follows the official encoder) but a served request must not get
 * silently: tool-call arguments that are not JSON (the encoder keeps them as a raw block), image
 * parts (this K3 is text-only: the encoder would put a placeholder where the image was). Each
 * error names the key. (tool_choice is checked with the structured outputs: chat_job_grammar.c.) */
static k3_status check_served(const k3_chat_json *doc, const char *what) {
    const k3_chat_json *msgs = k3_chat_json_get(doc, "messages");
    for (size_t i = 0; msgs && msgs->kind == K3_JSON_ARRAY && i < msgs->n_items; i++) {
        const k3_chat_json *c = k3_chat_json_get(msgs->items[i], "content");
        for (size_t k = 0; c && c->kind == K3_JSON_ARRAY && k < c->n_items; k++) {
            const k3_chat_json *ty = k3_chat_json_get(c->items[k], "type");
            if (ty && ty->kind == K3_JSON_STRING && strncmp(ty->s, "image", 5) == 0)
                return K3_ERR(K3_ERR_FORMAT,
                              "%s: messages[%zu].content[%zu]: an image part; this model serves "
                              "text only",
                              what, i, k);
        }
        const k3_chat_json *calls = k3_chat_json_get(msgs->items[i], "tool_calls");
        for (size_t k = 0; calls && calls->kind == K3_JSON_ARRAY && k < calls->n_items; k++) {
            const k3_chat_json *a =
                k3_chat_json_get(k3_chat_json_get(calls->items[k], "function"), "arguments");
            k3_chat_json *parsed = NULL;
            if (!a || a->kind != K3_JSON_STRING || strspn(a->s, " \t\r\n") == a->n) continue;
            if (k3_chat_json_parse(a->s, a->n, "arguments", &parsed) != K3_OK)
                return K3_ERR(K3_ERR_FORMAT,
                              "%s: messages[%zu].tool_calls[%zu].function.arguments is not JSON",
                              what, i, k);
            k3_chat_json_free(parsed);
        }
    }
    return K3_OK;
}

k3_status k3_job_parse(k3_job *j, const char *text, size_t n_bytes, const char *what,
                       const k3_tokenizer *tok) {
    k3_status st = k3_chat_json_parse(text, n_bytes, what, &j->doc);
    if (st != K3_OK) return st; /* its message names `what` already */
    st = k3_chat_request_parse(text, n_bytes, &j->req);
    if (st == K3_ERR_NOMEM) return st; /* out of memory is the server's, not the request's */
    if (st != K3_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", k3_last_error());
        return K3_ERR(K3_ERR_FORMAT, "%s: %s", what, why);
    }
    K3_TRY(check_served(j->doc, what));
    K3_TRY(k3_job_grammar_check(j->doc, what)); /* a hostile schema: refused before rendering */
    const k3_chat_json *msgs = k3_chat_json_get(j->doc, "messages");
    if (msgs && msgs->kind == K3_JSON_ARRAY && msgs->n_items == 0)
        return K3_ERR(K3_ERR_FORMAT, "%s: messages is empty", what);
    k3_chat_prompt pr = {0};
    k3_tok_ids v = {0};
    st =
        k3_chat_render(j->req, &pr); /* as its add_generation_prompt / continue_final_message say */
    if (st == K3_OK) st = k3_chat_encode(&pr, tok, &v);
    if (st == K3_OK && v.n == 0) st = K3_ERR(K3_ERR_FORMAT, "%s: encodes to no tokens", what);
    if (st == K3_OK) st = k3_alloc((void **)&j->ids, v.n * sizeof(int32_t), "prompt");
    if (st == K3_OK) {
        memcpy(j->ids, v.ids, v.n * sizeof(int32_t));
        j->n_ids = (int64_t)v.n;
    } else if (st != K3_ERR_NOMEM) {
        char why[512];
        snprintf(why, sizeof why, "%s", k3_last_error());
        st = K3_ERR(K3_ERR_FORMAT, "%s: %s", what, why);
    }
    k3_chat_prompt_free(&pr);
    k3_tok_ids_free(&v);
    return st;
}

void k3_job_free(k3_job *j) {
    if (!j) return;
    k3_chat_json_free(j->doc);
    k3_chat_request_destroy(j->req);
    k3_chat_json_free(j->stop_doc);
    k3_free(j->ids), k3_free(j->bias), k3_free(j->stops);
    k3_grammar_release(j->grammar);
    memset(j, 0, sizeof *j);
}

/* ---- the request's sampling keys ------------------------------------------------------------ */
static bool json_num(const k3_chat_json *v, double *out) {
    if (!v) return false;
    if (v->kind == K3_JSON_INT)
        *out = strtod(v->s, NULL);
    else if (v->kind == K3_JSON_FLOAT)
        *out = v->f;
    else
        return false;
    return true;
}

bool k3_job_parse_u64(const char *s, uint64_t *out) {
    if (!s || *s < '0' || *s > '9') return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end) return false;
    *out = (uint64_t)v;
    return true;
}

bool k3_job_bias_ok(double b, bool allow_ban) {
    return (isfinite(b) && fabs(b) <= FLT_MAX) || (allow_ban && b == -INFINITY);
}

/* The request's OpenAI logit_bias: an object {"id": bias, ...}. */
static k3_status req_bias(k3_job *j, const k3_chat_json *v, const char *what) {
    if (v->kind != K3_JSON_OBJECT)
        return K3_ERR(K3_ERR_FORMAT, "%s: request key 'logit_bias' must be an object", what);
    K3_TRY(k3_alloc((void **)&j->bias, K3_MAX(v->n_items, 1) * sizeof *j->bias, "logit bias"));
    for (size_t i = 0; i < v->n_items; i++) {
        const char *key = v->keys[i]->s;
        uint64_t id = 0;
        double b = 0;
        if (!k3_job_parse_u64(key, &id) || id > INT32_MAX)
            return K3_ERR(K3_ERR_FORMAT, "%s: request key 'logit_bias': '%.40s' is not a token id",
                          what, key);
        if (!json_num(v->items[i], &b) || !k3_job_bias_ok(b, true))
            return K3_ERR(K3_ERR_FORMAT,
                          "%s: request key 'logit_bias': the bias of id %s is not a number "
                          "that fits a float",
                          what, key);
        j->bias[i] = (k3_logit_bias){(int32_t)id, (float)b};
    }
    j->n_bias = v->n_items;
    return K3_OK;
}

/* The request's seed: the JSON number lexeme as an unsigned 64-bit integer (never via double). */
static k3_status req_seed(const k3_chat_json *v, uint64_t *seed, const char *what) {
    if (v->kind == K3_JSON_INT && k3_job_parse_u64(v->s, seed)) return K3_OK;
    if (v->kind == K3_JSON_FLOAT && v->f >= 0 && v->f < 9007199254740992.0 && v->f == floor(v->f)) {
        *seed = (uint64_t)v->f; /* 5.0: exact below 2^53 */
        return K3_OK;
    }
    return K3_ERR(K3_ERR_FORMAT, "%s: request key 'seed' must be an integer in [0, 2^64)", what);
}

k3_status k3_job_stops_json(k3_job *j, const k3_chat_json *v, const char *what, k3_status bad) {
    if (v->kind == K3_JSON_STRING) {
        if (v->n == 0 || strlen(v->s) != v->n)
            return K3_ERR(bad, "%s: must be a non-empty string without NUL", what);
        K3_TRY(k3_alloc((void **)&j->stops, sizeof(char *), "stop strings"));
        j->stops[0] = v->s;
        j->n_stops = 1;
        return K3_OK;
    }
    if (v->kind != K3_JSON_ARRAY)
        return K3_ERR(bad, "%s: must be a string or an array of strings", what);
    K3_TRY(k3_alloc((void **)&j->stops, K3_MAX(v->n_items, 1) * sizeof(char *), "stop strings"));
    for (size_t i = 0; i < v->n_items; i++) {
        const k3_chat_json *e = v->items[i];
        if (e->kind != K3_JSON_STRING || e->n == 0 || strlen(e->s) != e->n)
            return K3_ERR(bad, "%s[%zu]: must be a non-empty string without NUL", what, i);
        j->stops[i] = e->s;
    }
    j->n_stops = v->n_items;
    return K3_OK;
}

/* Request key of each numeric setting (max_tokens: also max_completion_tokens, read after). */
static const char *const num_key[K3_JOB_N_NUM] = {
    [K3_JOB_TEMPERATURE] = "temperature",
    [K3_JOB_TOP_K] = "top_k",
    [K3_JOB_TOP_P] = "top_p",
    [K3_JOB_MIN_P] = "min_p",
    [K3_JOB_REPETITION_PENALTY] = "repetition_penalty",
    [K3_JOB_PRESENCE_PENALTY] = "presence_penalty",
    [K3_JOB_FREQUENCY_PENALTY] = "frequency_penalty",
    [K3_JOB_MAX_TOKENS] = "max_tokens",
};

/* The request's numeric key into num[i] unless the setting is fixed. */
static k3_status take_num(k3_job *j, const k3_job_settings *s, int i, const char *key, double *num,
                          const char *what) {
    const k3_chat_json *v = k3_chat_json_get(j->doc, key);
    if (!v || v->kind == K3_JSON_NULL || s->fixed[i]) return K3_OK;
    if (!json_num(v, &num[i]))
        return K3_ERR(K3_ERR_FORMAT, "%s: request key '%s' is not a number", what, key);
    j->from_req[i] = true;
    return K3_OK;
}

static k3_status take_request(k3_job *j, const k3_job_settings *s, double *num, uint64_t *seed,
                              const char *what) {
    for (int i = 0; i < K3_JOB_N_NUM; i++) K3_TRY(take_num(j, s, i, num_key[i], num, what));
    K3_TRY(take_num(j, s, K3_JOB_MAX_TOKENS, "max_completion_tokens", num, what));
    const k3_chat_json *v = k3_chat_json_get(j->doc, "seed");
    if (v && v->kind != K3_JSON_NULL && !s->seed_fixed) K3_TRY(req_seed(v, seed, what));
    v = k3_chat_json_get(j->doc, "n");
    if (v && v->kind != K3_JSON_NULL && !s->n_taken) {
        double nc = 0;
        if (!json_num(v, &nc) || nc != 1)
            return K3_ERR(K3_ERR_FORMAT,
                          "%s: request key 'n': only one choice (n = 1) is supported", what);
    }
    v = k3_chat_json_get(j->doc, "logit_bias");
    if (v && v->kind != K3_JSON_NULL && !s->bias_fixed) K3_TRY(req_bias(j, v, what));
    v = k3_chat_json_get(j->doc, "stop");
    if (v && v->kind != K3_JSON_NULL && !s->stop_fixed) {
        char w[160];
        snprintf(w, sizeof w, "%s: request key 'stop'", what);
        K3_TRY(k3_job_stops_json(j, v, w, K3_ERR_FORMAT));
    }
    return K3_OK;
}

/* Range of each numeric setting: [lo, hi], integer or not, and the rule as a message says it. */
static const struct {
    double lo, hi;
    bool integer;
    const char *rule;
} num_range[K3_JOB_N_NUM] = {
    [K3_JOB_TEMPERATURE] = {0, FLT_MAX, false, "must be finite and >= 0"},
    [K3_JOB_TOP_K] = {0, INT32_MAX, true, "must be an integer >= 0"},
    [K3_JOB_TOP_P] = {0, 1, false, "must be in (0, 1]"}, /* lo excluded: see check_num */
    [K3_JOB_MIN_P] = {0, 1, false, "must be in [0, 1]"},
    [K3_JOB_REPETITION_PENALTY] = {K3_SAMPLER_MIN_REPETITION_PENALTY, FLT_MAX, false,
                                   "must be finite and >= 1e-4"},
    [K3_JOB_PRESENCE_PENALTY] = {-FLT_MAX, FLT_MAX, false, "must be finite (fit a float)"},
    [K3_JOB_FREQUENCY_PENALTY] = {-FLT_MAX, FLT_MAX, false, "must be finite (fit a float)"},
    [K3_JOB_MAX_TOKENS] = {0, 1000000, true, "must be an integer in [0, 1000000]"},
};

static k3_status check_num(const k3_job *j, const k3_job_settings *s, int i, double v,
                           const char *what) {
    bool ok = v >= num_range[i].lo && v <= num_range[i].hi &&
              (!num_range[i].integer || v == floor(v)) && (i != K3_JOB_TOP_P || v > 0);
    if (ok) return K3_OK;
    if (j->from_req[i] || !s->flag[i]) {
        const char *key = num_key[i];
        const k3_chat_json *mct = k3_chat_json_get(j->doc, "max_completion_tokens");
        if (i == K3_JOB_MAX_TOKENS && mct && mct->kind != K3_JSON_NULL)
            key = "max_completion_tokens";
        return K3_ERR(K3_ERR_FORMAT, "%s: request key '%s': %g %s", what, key, v,
                      num_range[i].rule);
    }
    return K3_ERR(K3_ERR_ARG, "--%s: %g %s", s->flag[i], v, num_range[i].rule);
}

k3_status k3_job_sampling(k3_job *j, const k3_job_settings *s, const char *what) {
    double num[K3_JOB_N_NUM];
    memcpy(num, s->num, sizeof num);
    memset(j->from_req, 0, sizeof j->from_req);
    uint64_t seed = s->seed;
    if (j->doc) K3_TRY(take_request(j, s, num, &seed, what));
    for (int i = 0; i < K3_JOB_N_NUM; i++) K3_TRY(check_num(j, s, i, num[i], what));
    for (size_t i = 0; s->n_vocab > 0 && i < j->n_bias; i++) {
        if (j->bias[i].id < s->n_vocab) continue; /* ids are >= 0: parsed as unsigned */
        if (s->bias_fixed)
            return K3_ERR(K3_ERR_ARG,
                          "--logit-bias: id %d is outside the vocabulary (vocab_size "
                          "%lld)",
                          j->bias[i].id, (long long)s->n_vocab);
        return K3_ERR(K3_ERR_FORMAT,
                      "%s: request key 'logit_bias': id %d is outside the vocabulary (vocab_size "
                      "%lld)",
                      what, j->bias[i].id, (long long)s->n_vocab);
    }
    j->max_tokens = (int64_t)num[K3_JOB_MAX_TOKENS];
    j->sp = (k3_sampler_params){.temperature = (float)num[K3_JOB_TEMPERATURE],
                                .top_k = (int32_t)num[K3_JOB_TOP_K],
                                .top_p = (float)num[K3_JOB_TOP_P],
                                .min_p = (float)num[K3_JOB_MIN_P],
                                .repetition_penalty = (float)num[K3_JOB_REPETITION_PENALTY],
                                .presence_penalty = (float)num[K3_JOB_PRESENCE_PENALTY],
                                .frequency_penalty = (float)num[K3_JOB_FREQUENCY_PENALTY],
                                .logit_bias = j->bias,
                                .n_logit_bias = j->n_bias,
                                .seed = seed,
                                .stop_strings = j->stops,
                                .n_stop_strings = j->n_stops};
    k3_grammar_release(j->grammar);
    j->grammar = NULL;
    return s->defer_grammar ? K3_OK : k3_job_grammar(j, s->grammars, what);
}

/* ---- the assistant message ------------------------------------------------------------------ */
/* The feeder replays the sampler's text stream (the same detokenizer, so the same byte offsets as
 * the engine's emitted text) into the parser: markers go in as markers, text as text. Nothing past
 * byte `limit` of the stream reaches the parser: while generating, limit = the bytes the engine
 * has released (text that could still start a stop string is held back there, so it is held back
 * here too); at the end after a stop string limit = the text before the match, so neither the
 * stop string nor what follows (markers included) becomes reasoning / content / a call. With
 * ignore_eos, <|end_of_msg|> / [EOS] do not end the message (generation went on past them). */
typedef struct feed_mark {
    size_t start, end; /* the marker's own text in the stream */
    k3_parser_marker m;
} feed_mark;

struct k3_job_feed {
    const k3_tokenizer *tok;
    k3_tok_ctrl ctrl;
    bool ignore_eos, ended;
    k3_parser *p;
    k3_tok_stream *ts;
    k3_tok_bytes txt; /* the whole stream so far */
    feed_mark *marks; /* (n_marks, cap_marks) markers in stream order */
    size_t n_marks, cap_marks, next_mark;
    size_t fed;      /* stream bytes handed to the parser (or dropped) */
    size_t released; /* the engine's emitted text so far (sum of event n_text) */
};

k3_status k3_job_feed_create(const k3_job *j, const k3_tokenizer *tok, bool ignore_eos,
                             k3_job_feed **out) {
    k3_job_feed *f = NULL;
    K3_TRY(k3_calloc((void **)&f, sizeof *f, "chat feed"));
    f->tok = tok;
    f->ctrl = k3_tok_control_ids(tok);
    f->ignore_eos = ignore_eos;
    k3_status st = k3_parser_create_for(j->req, &f->p);
    if (st == K3_OK) st = k3_tok_stream_create(&f->ts, tok);
    if (st != K3_OK) {
        k3_job_feed_destroy(f);
        return st;
    }
    *out = f;
    return K3_OK;
}

void k3_job_feed_destroy(k3_job_feed *f) {
    if (!f) return;
    k3_parser_destroy(f->p);
    k3_tok_stream_destroy(f->ts);
    k3_tok_bytes_free(&f->txt);
    free(f->marks); /* grown with realloc */
    k3_free(f);
}

k3_parser *k3_job_feed_parser(k3_job_feed *f) {
    return f->p;
}

/* Hand the stream up to byte `limit` to the parser: text, then each marker whose text is wholly
 * below the limit. A marker that crosses the limit waits (or, at the end, is dropped). */
static k3_status advance(k3_job_feed *f, size_t limit) {
    limit = K3_MIN(limit, f->txt.n);
    for (;;) {
        const feed_mark *m = f->next_mark < f->n_marks ? &f->marks[f->next_mark] : NULL;
        size_t text_end = K3_MIN(m ? m->start : f->txt.n, limit);
        if (text_end > f->fed)
            K3_TRY(k3_parser_feed_text(f->p, f->txt.data + f->fed, text_end - f->fed));
        f->fed = K3_MAX(f->fed, text_end);
        if (!m || f->fed < m->start || m->end > limit) return K3_OK;
        K3_TRY(k3_parser_feed_marker(f->p, m->m));
        f->fed = m->end;
        f->next_mark++;
    }
}

k3_status k3_job_feed_token(k3_job_feed *f, int32_t id, size_t released) {
    if (f->ended) return K3_ERR(K3_ERR_STATE, "chat feed: a token after the end");
    size_t before = f->txt.n;
    K3_TRY(k3_tok_stream_push(f->ts, id, &f->txt));
    if (k3_tok_is_special(f->tok, id)) {
        const char *b;
        size_t nb = 0;
        K3_TRY(k3_tok_id_bytes(f->tok, id, &b, &nb));
        nb = K3_MIN(nb, f->txt.n - before); /* the marker's own text closes the chunk */
        const k3_tok_ctrl c = f->ctrl;
        k3_parser_marker m = id == c.open         ? K3_MARK_OPEN
                             : id == c.close      ? K3_MARK_CLOSE
                             : id == c.sep        ? K3_MARK_SEP
                             : id == c.end_of_msg ? K3_MARK_EOM
                             : id == c.eos        ? K3_MARK_STOP
                                                  : K3_MARK_OTHER;
        if (f->ignore_eos && (m == K3_MARK_EOM || m == K3_MARK_STOP)) m = K3_MARK_OTHER;
        if (f->n_marks == f->cap_marks) {
            size_t cap = K3_MAX(2 * f->cap_marks, 16);
            feed_mark *nm = realloc(f->marks, cap * sizeof *nm);
            if (!nm) return K3_ERR(K3_ERR_NOMEM, "chat feed: %zu markers", cap);
            f->marks = nm, f->cap_marks = cap;
        }
        f->marks[f->n_marks++] = (feed_mark){f->txt.n - nb, f->txt.n, m};
    }
    f->released = K3_MAX(f->released, released);
    return advance(f, f->released);
}

k3_status k3_job_feed_end(k3_job_feed *f, k3_stop_kind stop, size_t released) {
    if (f->ended) return K3_ERR(K3_ERR_STATE, "chat feed: ended twice");
    f->ended = true;
    K3_TRY(k3_tok_stream_finish(f->ts, &f->txt));
    f->released = K3_MAX(f->released, released);
    K3_TRY(advance(f, stop == K3_STOP_STRING ? f->released : SIZE_MAX));
    /* a stop string (or a stop id the markers did not show) ends the message like
     * <|end_of_msg|> would: finish_reason "stop" */
    if (stop != K3_STOP_NONE && !k3_parser_ended(f->p))
        K3_TRY(k3_parser_feed_marker(f->p, K3_MARK_EOM));
    return k3_parser_finish(f->p);
}

k3_status k3_job_message(const k3_job *j, const k3_tokenizer *tok, const k3_job_gen *g,
                         bool ignore_eos, k3_chat_buf *out) {
    k3_job_feed *f = NULL;
    K3_TRY(k3_job_feed_create(j, tok, ignore_eos, &f));
    k3_status st = K3_OK;
    /* the whole generation is known: everything but what follows a stop string is released */
    for (int64_t i = 0; i < g->n && st == K3_OK; i++)
        st = k3_job_feed_token(f, g->ids[i], g->stop == K3_STOP_STRING ? g->n_text : SIZE_MAX);
    if (st == K3_OK) st = k3_job_feed_end(f, g->stop, g->n_text);
    if (st == K3_OK) st = k3_parser_message_json(f->p, out);
    k3_job_feed_destroy(f);
    return st;
}

/* ---- logprobs -------------------------------------------------------------------------------- */
k3_status k3_job_logprobs_keys(const k3_chat_json *doc, const char *what, int *n_top) {
    const k3_chat_json *lp = k3_chat_json_get(doc, "logprobs"),
                       *top = k3_chat_json_get(doc, "top_logprobs");
    *n_top = -1;
    if (lp && lp->kind != K3_JSON_NULL && lp->kind != K3_JSON_BOOL)
        return K3_ERR(K3_ERR_FORMAT, "%s: request key 'logprobs' must be a boolean", what);
    const bool on = lp && lp->kind == K3_JSON_BOOL && lp->b;
    if (!top || top->kind == K3_JSON_NULL) {
        *n_top = on ? 0 : -1;
        return K3_OK;
    }
    uint64_t v = 0;
    if (top->kind != K3_JSON_INT || !k3_job_parse_u64(top->s, &v) || v > K3_JOB_MAX_TOP)
        return K3_ERR(K3_ERR_FORMAT, "%s: request key 'top_logprobs' must be an integer in [0, %d]",
                      what, K3_JOB_MAX_TOP);
    if (!on)
        return K3_ERR(K3_ERR_FORMAT, "%s: request key 'top_logprobs' needs \"logprobs\": true",
                      what);
    *n_top = (int)v;
    return K3_OK;
}

k3_status k3_job_logprob_entry(const k3_tokenizer *tok, int32_t id, float logprob,
                               k3_chat_buf *out) {
    const char *p = "";
    size_t n = 0;
    if (k3_tok_id_bytes(tok, id, &p, &n) != K3_OK) p = "", n = 0; /* an id past the vocab */
    k3_tok_bytes txt = {0};
    k3_status st = k3_tok_utf8_replace(p, n, &txt);
    if (st == K3_OK) st = k3_chat_buf_puts(out, "{\"token\":");
    if (st == K3_OK) st = k3_chat_json_dump_str(txt.data ? txt.data : "", txt.n, out);
    k3_tok_bytes_free(&txt);
    char f[40];
    k3_chat_json_float_repr(isfinite(logprob) ? K3_MAX((double)logprob, -9999.0) : -9999.0, f);
    if (st == K3_OK) st = k3_chat_buf_puts(out, ",\"logprob\":");
    if (st == K3_OK) st = k3_chat_buf_puts(out, f);
    if (st == K3_OK) st = k3_chat_buf_puts(out, ",\"bytes\":[");
    for (size_t i = 0; i < n && st == K3_OK; i++) {
        snprintf(f, sizeof f, "%s%u", i ? "," : "", (unsigned)(unsigned char)p[i]);
        st = k3_chat_buf_puts(out, f);
    }
    return st == K3_OK ? k3_chat_buf_puts(out, "]") : st;
}

/* ---- completion logprobs (OpenAI's legacy shape) ------------------------------------------- */
k3_status k3_job_token_str(const k3_tokenizer *tok, int32_t id, k3_chat_buf *out) {
    const char *p = "";
    size_t nb = 0;
    if (k3_tok_id_bytes(tok, id, &p, &nb) != K3_OK) p = "", nb = 0; /* an id past the vocab */
    k3_tok_bytes tb = {0};
    k3_status st = k3_tok_utf8_replace(p, nb, &tb);
    if (st == K3_OK) st = k3_chat_json_dump_str(tb.data ? tb.data : "", tb.n, out);
    k3_tok_bytes_free(&tb);
    return st;
}

k3_status k3_job_logprob_num(float lp, k3_chat_buf *out) {
    char f[40];
    k3_chat_json_float_repr(isfinite(lp) ? K3_MAX((double)lp, -9999.0) : -9999.0, f);
    return k3_chat_buf_puts(out, f);
}

k3_status k3_job_completion_logprobs(const k3_tokenizer *tok, const k3_job_lp_row *rows, int64_t n,
                                     k3_chat_buf *out) {
    static const char *const part[] = {"{\"tokens\":[", "],\"token_logprobs\":[",
                                       "],\"top_logprobs\":[", "],\"text_offset\":["};
    for (int f = 0; f < 4; f++) {
        K3_TRY(k3_chat_buf_puts(out, part[f]));
        for (int64_t t = 0; t < n; t++) {
            const k3_job_lp_row *w = &rows[t];
            if (t) K3_TRY(k3_chat_buf_puts(out, ","));
            if (f == 0) {
                K3_TRY(k3_job_token_str(tok, w->id, out));
            } else if (f == 3) {
                char o[32];
                snprintf(o, sizeof o, "%lld", (long long)w->offset);
                K3_TRY(k3_chat_buf_puts(out, o));
            } else if (isnan(w->logprob)) {
                K3_TRY(k3_chat_buf_puts(out, "null"));
            } else if (f == 1) {
                K3_TRY(k3_job_logprob_num(w->logprob, out));
            } else {
                K3_TRY(k3_chat_buf_puts(out, "{"));
                for (int k = 0; k < w->n_top; k++) {
                    if (k) K3_TRY(k3_chat_buf_puts(out, ","));
                    K3_TRY(k3_job_token_str(tok, w->top_ids[k], out));
                    K3_TRY(k3_chat_buf_puts(out, ":"));
                    K3_TRY(k3_job_logprob_num(w->top_lps[k], out));
                }
                K3_TRY(k3_chat_buf_puts(out, "}"));
            }
        }
    }
    return k3_chat_buf_puts(out, "]}");
}
