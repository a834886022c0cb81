/* offline.c — `k3 serve`'s request path without HTTP, for `k3 batch` (launcher/cmd_batch.c): a
 * body -> the same parsed choices (openai.c srv_parse: n, prompt lists, echo, logprobs, every
 * refusal), the same engine requests (a copy of n > 1 forks its prompt's prefill), the same event
 * records, and the same response body or error body (srv_response, srv_error_json). A batch line
 * and a served request cannot drift apart: one parser and one writer.
 *
 * Owns: the engine request of a choice (srv_engine_request, also what server.c submits), one
 * event into a choice's buffers (srv_take_event, also server.c's), the status of a failed choice.
 * Does not own: HTTP, the queue, metrics (server.c), the wire format (openai.c). */
#include "server_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void srv_engine_request(const sreq *q, k3_request *rq) {
    const k3_job *j = &q->job;
    *rq = (k3_request){.ids = j->ids,
                       .n_ids = j->n_ids,
                       .max_tokens = (int)j->max_tokens,
                       .sampling = j->sp,
                       .logprobs = q->n_top < 0 ? 0 : K3_MAX(q->n_top, 1),
                       .ignore_eos = q->ignore_eos,
                       .prompt_logprobs = q->plp != NULL,
                       .prompt_top = K3_MAX(q->plp_top, q->echo ? q->n_top : 0),
                       .user = (uint64_t)(uintptr_t)q};
    /* a copy of n > 1 shares the prefill of its prompt's first choice (submitted just before
       it, still running): the engine forks its state */
    if (q->fork_src && q->fork_src->submitted && !q->fork_src->done)
        rq->fork = true, rq->fork_of = q->fork_src->eng_id;
}

static k3_status append_text(sreq *q, const char *t, size_t n) {
    if (n == 0) return K3_OK;
    if (q->n_text + n > q->cap_text) {
        size_t cap = K3_MAX(2 * q->cap_text, q->n_text + n + 256);
        char *p = realloc(q->text, cap);
        if (!p) return K3_ERR(K3_ERR_NOMEM, "response text (%zu bytes)", cap);
        q->text = p, q->cap_text = cap;
    }
    memcpy(q->text + q->n_text, t, n);
    q->n_text += n;
    return K3_OK;
}

k3_status srv_take_event(sreq *q, const k3_event *ev) {
    K3_TRY(append_text(q, ev->text, ev->n_text));
    q->queued_s = ev->queued_s;
    if (ev->prompt_lps && q->plp)
        memcpy(q->plp, ev->prompt_lps, (size_t)(q->job.n_ids - 1) * sizeof *q->plp);
    if (ev->kind == K3_EV_TOKEN) {
        if (q->n_gen == q->cap_gen)
            return K3_ERR(K3_ERR_INTERNAL, "%s: more tokens than max_tokens (%lld)", q->id,
                          (long long)q->cap_gen);
        q->gen[q->n_gen] = (sreq_tok){ev->token, q->n_text};
        if (q->lp) {
            sreq_lp *l = &q->lp[q->n_gen];
            l->logprob = ev->logprob;
            l->n_top = K3_MIN(ev->n_top, K3_EV_MAX_TOP);
            memcpy(l->top_ids, ev->top_ids, sizeof l->top_ids);
            memcpy(l->top_logprobs, ev->top_logprobs, sizeof l->top_logprobs);
        }
        q->n_gen++;
        return K3_OK;
    }
    q->n_prompt = ev->n_prompt;
    q->n_cached = ev->n_cached;
    if (ev->kind == K3_EV_DONE) {
        q->stop = ev->stop;
    } else {
        q->failed = true;
        q->error_kind = ev->error_kind;
        snprintf(q->error, sizeof q->error, "%s", ev->error ? ev->error : "engine error");
    }
    return K3_OK;
}

int srv_failed_status(const sreq *q) {
    return q->error_kind == K3_EVERR_REQUEST || q->error_kind == K3_EVERR_CONTEXT ||
                   q->error_kind == K3_EVERR_SAMPLING
               ? 400
               : 500;
}

/* ---- k3_server_req (k3_server.h) ------------------------------------------------------------ */
static int error_out(int status, const char *why, k3_chat_buf *err) {
    err->n = 0;
    return srv_error_json(status, why, err) == K3_OK ? status : 500;
}

/* --max-tokens of k3 batch: the max_tokens of a choice whose request sets none, within the
 * context as serve checks it; the token buffers follow. */
static int default_max_tokens(const k3_server_opts *o, sreq *q, int64_t max_tokens, char *why,
                              size_t n_why) {
    k3_job *j = &q->job;
    if (max_tokens <= 0 || j->from_req[K3_JOB_MAX_TOKENS]) return 200;
    j->max_tokens = max_tokens;
    if (j->n_ids + j->max_tokens > o->max_ctx) {
        snprintf(why, n_why,
                 "the prompt (%lld tokens) + max_tokens (%lld) exceeds the context limit of "
                 "%lld tokens (--max-ctx)",
                 (long long)j->n_ids, (long long)j->max_tokens, (long long)o->max_ctx);
        return 400;
    }
    if (max_tokens <= q->cap_gen) return 200;
    k3_free(q->gen), q->gen = NULL; /* nothing in them yet: parsed, not submitted */
    if (k3_alloc((void **)&q->gen, (size_t)max_tokens * sizeof *q->gen, "tokens") != K3_OK)
        return snprintf(why, n_why, "out of memory"), 500;
    if (q->lp) {
        k3_free(q->lp), q->lp = NULL;
        if (k3_alloc((void **)&q->lp, (size_t)max_tokens * sizeof *q->lp, "logprobs") != K3_OK)
            return snprintf(why, n_why, "out of memory"), 500;
    }
    q->cap_gen = max_tokens;
    return 200;
}

int k3_server_req_parse(const k3_server_opts *o, const char *path, const char *body, size_t n,
                        const k3_server_req_opts *ro, k3_server_req **out, k3_chat_buf *err) {
    char why[1024];
    *out = NULL;
    const bool chat = strcmp(path, "/v1/chat/completions") == 0;
    if (!chat && strcmp(path, "/v1/completions") != 0) {
        snprintf(why, sizeof why, "no route %.60s", path);
        return error_out(404, why, err);
    }
    sreq *head = NULL;
    int st = srv_parse(o, chat ? SREQ_CHAT : SREQ_COMPLETION, body, n, &head, why, sizeof why);
    if (st == 200 && k3_chat_json_truthy(k3_chat_json_get(head->job.doc, "stream"))) {
        snprintf(why, sizeof why,
                 "request key 'stream': true is not taken by k3 batch (each "
                 "line's response is one body)");
        st = 400;
    }
    const bool seeded = st == 200 && k3_chat_json_get(head->job.doc, "seed") &&
                        k3_chat_json_get(head->job.doc, "seed")->kind != K3_JSON_NULL;
    int c = 0;
    for (sreq *q = head; st == 200 && q; q = q->sib) {
        st = default_max_tokens(o, q, ro->max_tokens, why, sizeof why);
        c = q->sib_copy ? c + 1 : 0;
        if (!seeded) q->job.sp.seed = ro->seed + (uint64_t)c; /* a copy differs, as serve's */
        snprintf(q->id, sizeof q->id, "%s%016llx", chat ? "chatcmpl-" : "cmpl-",
                 (unsigned long long)ro->id);
        q->created = (int64_t)time(NULL);
    }
    if (st != 200) {
        srv_sreq_free_chain(head);
        return error_out(st, why, err);
    }
    *out = head;
    return 200;
}

int k3_server_req_choices(const k3_server_req *r) {
    return srv_n_choices(r);
}

static sreq *choice(k3_server_req *r, int i) {
    sreq *q = r;
    while (q && i-- > 0) q = q->sib;
    return q;
}

k3_status k3_server_req_submit(k3_server_req *r, int i, k3_engine *e, uint64_t user) {
    sreq *q = choice(r, i);
    if (!q) return K3_ERR(K3_ERR_INTERNAL, "choice %d of a request with fewer", i);
    k3_request rq;
    srv_engine_request(q, &rq);
    rq.user = user;
    if (k3_engine_submit(e, &rq, &q->eng_id) != K3_OK) { /* this choice alone fails: 500 */
        q->failed = q->done = true;
        q->error_kind = 0;
        snprintf(q->error, sizeof q->error, "the engine refused the request: %s", k3_last_error());
        return K3_OK;
    }
    q->submitted = true;
    return K3_OK;
}

k3_status k3_server_req_event(k3_server_req *r, int i, const k3_event *ev, bool *all_done) {
    sreq *q = choice(r, i);
    if (!q) return K3_ERR(K3_ERR_INTERNAL, "an event for choice %d of a request with fewer", i);
    K3_TRY(srv_take_event(q, ev));
    if (ev->kind != K3_EV_TOKEN) q->done = true;
    *all_done = true;
    for (const sreq *c = r; c; c = c->sib) *all_done = *all_done && c->done;
    return K3_OK;
}

int k3_server_req_response(const k3_server_opts *o, const k3_server_req *r, k3_chat_buf *out,
                           int64_t *n_prompt, int64_t *n_gen) {
    *n_prompt = *n_gen = 0;
    for (const sreq *q = r; q; q = q->sib) { /* the first failed choice answers for the request */
        if (q->failed) return error_out(srv_failed_status(q), q->error, out);
        if (!q->sib_copy) *n_prompt += q->n_prompt;
        *n_gen += q->n_gen;
    }
    out->n = 0;
    if (srv_response(o, r, out) == K3_OK) return 200;
    char why[1200];
    snprintf(why, sizeof why, "the response failed: %s", k3_last_error());
    return error_out(500, why, out);
}

void k3_server_req_free(k3_server_req *r) {
    srv_sreq_free_chain(r);
}
