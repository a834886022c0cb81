/* scheduler.c — the coordinator on rank 0: requests, sequence slots on lanes, micro-batch groups,
 * step messages, sampling, stop rules and the events of k3_engine_step (k3_engine.h).
 *
 * Invariants:
 * - A running request belongs to one (lane, slot) and one group for its whole life; it is in at
 *   most one step in flight (its group's), so its next token can always be fed.
 * - Every lane receives every step of a group (possibly with no sequences), in the order rank 0
 *   posts them, so the lanes' MoE collectives line up.
 * - A group's next step is formed only when all E logits messages of its previous step are back:
 *   decode rows first, then prefill chunks (at most `chunk` tokens per sequence) within the
 *   lane's token budget, then queued requests join (FIFO) on the least-loaded lane with a free
 *   slot and budget left.
 * - A request's events come in order: TOKEN* then exactly one DONE or ERROR. */
#include "rank_internal.h"

#include <math.h>
#include <stdlib.h>

/* ---- events ------------------------------------------------------------------------------- */
/* Event data (text deltas, logits rows) comes from blocks that are kept and reused: clearing the
 * events only rewinds them, so a step allocates nothing once the blocks have grown. */
#define EV_BLOCK (256 * 1024)
static void *ev_alloc(rank_ctx *r, size_t n) {
    n = (n + 63) & ~(size_t)63; /* 64-byte aligned pieces (float rows) */
    for (; r->ev_cur < r->n_ev_mem; r->ev_cur++) {
        ev_block *b = &r->ev_mem[r->ev_cur];
        if (b->size - b->used >= n) {
            void *p = b->data + b->used;
            b->used += n;
            return p;
        }
    }
    if (r->n_ev_mem == r->cap_ev_mem) {
        int cap = r->cap_ev_mem ? 2 * r->cap_ev_mem : 16;
        ev_block *m = realloc(r->ev_mem, (size_t)cap * sizeof *m);
        if (!m) rank_die(r, K3_ERR(K3_ERR_NOMEM, "event memory table"));
        r->ev_mem = m, r->cap_ev_mem = cap;
    }
    ev_block *b = &r->ev_mem[r->n_ev_mem];
    b->size = n > EV_BLOCK ? n : EV_BLOCK;
    b->used = n;
    RTRY(r, k3_alloc((void **)&b->data, b->size, "event data"));
    r->ev_cur = r->n_ev_mem++;
    return b->data;
}

static k3_event *ev_push(rank_ctx *r, k3_event_kind kind, const req_run *q) {
    if (r->n_ev == r->cap_ev) {
        int cap = r->cap_ev ? 2 * r->cap_ev : 64;
        k3_event *e = realloc(r->ev, (size_t)cap * sizeof *e);
        if (!e) rank_die(r, K3_ERR(K3_ERR_NOMEM, "event table"));
        r->ev = e, r->cap_ev = cap;
    }
    k3_event *e = &r->ev[r->n_ev++];
    memset(e, 0, sizeof *e);
    e->kind = kind;
    e->id = q->id;
    e->user = q->user;
    e->logprob = NAN;
    e->stop_string = -1;
    e->n_prompt = q->P;
    e->n_gen = q->n_gen;
    return e;
}

/* New text of q since the last event: copied into event memory. */
static void ev_text(rank_ctx *r, k3_event *e, req_run *q) {
    size_t n = q->text.n - q->text_sent;
    if (!n) return;
    char *t = ev_alloc(r, n + 1);
    memcpy(t, q->text.data + q->text_sent, n);
    t[n] = 0;
    e->text = t;
    e->n_text = n;
    q->text_sent = q->text.n;
}

static void ev_prompt_logits(rank_ctx *r, k3_event *e, req_run *q) {
    if (!q->all_logits || !q->prompt_logits) return;
    e->prompt_logits = q->prompt_logits; /* owned by q, freed with it after the next step */
    e->n_prompt_rows = q->prompt_rows;
}

static void free_req(req_run *q) {
    if (!q) return;
    k3_free(q->prompt), k3_free(q->gen), k3_free(q->prompt_logits), k3_free(q->error);
    k3_sampler_destroy(q->smp);
    k3_tok_bytes_free(&q->text);
    k3_free(q);
}

/* The request leaves: its slot is free for the next one (no message: OPEN resets it). */
static void end_req(rank_ctx *r, req_run *q) {
    if (q->state == RQ_RUNNING && q->slot >= 0) {
        r->slot_req[(size_t)q->lane * (size_t)r->max_seqs + (size_t)q->slot] = NULL;
        /* its blocks are free for the next request here; the stages hear of it with the lane's
           next step (a slot opened again in that step is reset anyway) */
        r->lane_blk_free[q->lane] += q->blk_resv;
        q->blk_resv = 0;
        if (r->n_pend_free[q->lane] < r->max_seqs)
            r->pend_free[(size_t)q->lane * r->max_seqs + (size_t)r->n_pend_free[q->lane]++] =
                q->slot;
    }
    q->state = RQ_ENDED;
}

/* Paged cache blocks a request reserves on its lane: its whole context, prompt + max_tokens. */
static int blocks_needed(const req_run *q) {
    return (int)((q->P + (int64_t)q->max_tokens + K3_KV_BLOCK - 1) / K3_KV_BLOCK);
}

static void finish_req(rank_ctx *r, req_run *q) {
    if (q->stop == K3_STOP_NONE && q->smp && q->n_gen > 0) {
        /* length (or cancel): flush text held back for a possible stop string */
        RTRY(r, k3_sampler_finish(q->smp, r->o->tok ? &q->text : NULL));
    }
    k3_event *e = ev_push(r, K3_EV_DONE, q);
    e->stop = q->stop;
    e->stop_string = q->stop == K3_STOP_STRING ? q->stop_string : -1;
    ev_text(r, e, q);
    if (q->n_gen == 0) ev_prompt_logits(r, e, q);
    end_req(r, q);
}

static void fail_req(rank_ctx *r, req_run *q, k3_error_kind kind, const char *why) {
    k3_event *e = ev_push(r, K3_EV_ERROR, q);
    e->error_kind = kind;
    size_t n = strlen(why);
    char *t = ev_alloc(r, n + 1);
    memcpy(t, why, n + 1);
    e->error = t;
    end_req(r, q);
}

/* ---- submit / cancel ---------------------------------------------------------------------- */
static req_run *find_req(const rank_ctx *r, int64_t id) {
    for (int i = 0; i < r->n_reqs; i++)
        if (r->reqs[i]->id == id) return r->reqs[i];
    return NULL;
}

/* Why a request can never run (NULL when it can). Message into buf. */
static const char *check_request(rank_ctx *r, const k3_request *rq, char *buf, size_t n,
                                 k3_error_kind *kind) {
    *kind = K3_EVERR_REQUEST;
    const int64_t V = r->cfg.vocab_size;
    if (rq->n_ids < 1) return "the prompt is empty";
    if (rq->max_tokens < 0) return "max_tokens must be >= 0";
    for (int64_t t = 0; t < rq->n_ids; t++)
        if (rq->ids[t] < 0 || rq->ids[t] >= V) {
            snprintf(buf, n, "prompt id %d at position %lld is outside the vocabulary (%lld)",
                     rq->ids[t], (long long)t, (long long)V);
            return buf;
        }
    const int64_t ctx = rq->n_ids + (int64_t)rq->max_tokens;
    if ((ctx + K3_KV_BLOCK - 1) / K3_KV_BLOCK > r->kv_blocks) {
        *kind = K3_EVERR_CONTEXT;
        snprintf(buf, n,
                 "prompt (%lld tokens) + max_tokens (%d) needs more paged cache than a lane has "
                 "(%lld tokens, --kv-cache-tokens)",
                 (long long)rq->n_ids, rq->max_tokens, (long long)r->kv_blocks * K3_KV_BLOCK);
        return buf;
    }
    if (rq->n_ids + (int64_t)rq->max_tokens > r->max_ctx) {
        *kind = K3_EVERR_CONTEXT;
        snprintf(buf, n,
                 "prompt (%lld tokens) + max_tokens (%d) exceeds the context of %lld tokens "
                 "(--max-ctx)",
                 (long long)rq->n_ids, rq->max_tokens, (long long)r->max_ctx);
        return buf;
    }
    for (size_t i = 0; i < rq->sampling.n_stop_ids; i++)
        if (rq->sampling.stop_ids[i] < 0 || rq->sampling.stop_ids[i] >= V) {
            snprintf(buf, n, "stop id %d is outside the vocabulary (vocab_size %lld)",
                     rq->sampling.stop_ids[i], (long long)V);
            return buf;
        }
    if (rq->logprobs < 0 || rq->logprobs > K3_EV_MAX_TOP) {
        snprintf(buf, n, "logprobs %d outside [0, %d]", rq->logprobs, K3_EV_MAX_TOP);
        return buf;
    }
    return NULL;
}

k3_status rank_coord_submit(rank_ctx *r, const k3_request *rq, int64_t *id) {
    if (r->n_reqs == r->cap_reqs) {
        int cap = r->cap_reqs ? 2 * r->cap_reqs : 64;
        req_run **a = realloc(r->reqs, (size_t)cap * sizeof *a);
        if (!a) return K3_ERR(K3_ERR_NOMEM, "request table");
        r->reqs = a, r->cap_reqs = cap;
    }
    req_run *q;
    K3_TRY(k3_calloc((void **)&q, sizeof *q, "request"));
    q->id = r->next_id++;
    q->user = rq->user;
    q->lane = q->group = q->slot = -1;
    q->stop_string = -1;
    q->max_tokens = rq->max_tokens;
    q->logprobs = rq->logprobs;
    q->keep_logits = rq->keep_logits;
    q->all_logits = rq->all_logits;
    q->P = rq->n_ids > 0 ? rq->n_ids : 0;
    r->reqs[r->n_reqs++] = q;
    *id = q->id;
    char why[256];
    k3_error_kind kind;
    const char *bad = check_request(r, rq, why, sizeof why, &kind);
    k3_status st = K3_OK;
    if (!bad) {
        st = k3_alloc((void **)&q->prompt, (size_t)q->P * sizeof(int32_t), "prompt");
        if (st == K3_OK) memcpy(q->prompt, rq->ids, (size_t)q->P * sizeof(int32_t));
        if (st == K3_OK)
            st = k3_alloc((void **)&q->gen, (size_t)K3_MAX(q->max_tokens, 1) * sizeof(int32_t),
                          "generated ids");
        if (st == K3_OK && q->all_logits)
            st =
                k3_alloc((void **)&q->prompt_logits,
                         (size_t)q->P * (size_t)r->cfg.vocab_size * sizeof(float), "prompt logits");
        if (st != K3_OK) return st; /* out of memory: the caller's problem, not the request's */
        /* stop ids: the request's, then (unless ignore_eos) EOS, <|end_of_msg|>, [EOS] */
        int32_t stops[64 + 3];
        size_t ns = 0;
        for (size_t i = 0; i < rq->sampling.n_stop_ids && ns < 64; i++)
            stops[ns++] = rq->sampling.stop_ids[i];
        for (int i = 0; i < 3 && !rq->ignore_eos; i++)
            if (r->base_stops[i] >= 0) stops[ns++] = r->base_stops[i];
        k3_sampler_params sp = rq->sampling;
        sp.stop_ids = stops;
        sp.n_stop_ids = ns;
        if (rq->sampling.n_stop_ids > 64) {
            bad = "more than 64 stop ids";
        } else if (k3_sampler_create(&q->smp, &sp, r->cfg.vocab_size, r->o->tok) != K3_OK) {
            snprintf(why, sizeof why, "sampling: %s", k3_last_error());
            bad = why;
            kind = K3_EVERR_SAMPLING;
        }
    }
    if (bad) {
        size_t nb = strlen(bad) + 1;
        K3_TRY(k3_alloc((void **)&q->error, nb, "request error text"));
        memcpy(q->error, bad, nb);
        q->error_kind = kind;
        q->state = RQ_ENDED; /* reported by the next step */
        return K3_OK;
    }
    q->state = RQ_QUEUED;
    return K3_OK;
}

k3_status rank_coord_cancel(rank_ctx *r, int64_t id) {
    req_run *q = find_req(r, id);
    if (!q || q->state == RQ_ENDED)
        return K3_ERR(K3_ERR_ARG, "cancel: request %lld is not queued or running", (long long)id);
    q->cancel = true;
    return K3_OK;
}

int rank_coord_pending(const rank_ctx *r) {
    int n = 0;
    for (int i = 0; i < r->n_reqs; i++) n += r->reqs[i]->state != RQ_ENDED;
    return n;
}

/* ---- steps -------------------------------------------------------------------------------- */
/* Tokens q can feed now (0: none): the rest of its prompt, or its last sampled token. */
static int64_t want_tokens(const rank_ctx *r, const req_run *q) {
    if (q->state != RQ_RUNNING || q->cancel) return 0;
    if (q->fed < q->P) return q->P - q->fed;
    if (q->stop != K3_STOP_NONE || q->n_gen >= q->max_tokens) return 0;
    return q->fed - q->P < q->n_gen ? 1 : 0;
}

static int lane_running(const rank_ctx *r, int e) {
    int n = 0;
    for (int s = 0; s < r->max_seqs; s++) n += r->slot_req[(size_t)e * r->max_seqs + s] != NULL;
    return n;
}

/* Form and send group g's next step; false when it has nothing to do (it stays idle). */
static bool send_step(rank_ctx *r, int g) {
    const int E = r->plan.n_lanes;
    group_run *gr = &r->groups[g];
    /* cancelled running requests of this idle group end now */
    for (int i = 0; i < r->n_reqs; i++) {
        req_run *q = r->reqs[i];
        if (q->state == RQ_RUNNING && q->group == g && q->cancel) finish_req(r, q);
    }
    enum { LANES_STACK = 64 };
    int64_t budget[LANES_STACK];
    int64_t *bud = E <= LANES_STACK ? budget : NULL;
    if (!bud) RTRY(r, k3_alloc((void **)&bud, (size_t)E * sizeof *bud, "lane budgets"));
    for (int e = 0; e < E; e++) bud[e] = r->max_tokens;
    int64_t total = 0;
    for (int i = 0; i < r->n_reqs; i++) r->reqs[i]->n_tok_step = 0;
    /* decode rows first, then prefill chunks, in request order */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < r->n_reqs; i++) {
            req_run *q = r->reqs[i];
            if (q->state != RQ_RUNNING || q->group != g) continue;
            bool decode = q->fed >= q->P;
            if (decode != (pass == 0)) continue;
            int64_t n = K3_MIN(K3_MIN(want_tokens(r, q), r->chunk), bud[q->lane]);
            q->n_tok_step = n;
            bud[q->lane] -= n;
            total += n;
        }
    /* queued requests join (FIFO): the least-loaded lane with a free slot and budget left */
    for (int i = 0; i < r->n_reqs; i++) {
        req_run *q = r->reqs[i];
        if (q->state != RQ_QUEUED) continue;
        if (q->cancel) {
            finish_req(r, q);
            continue;
        }
        int best = -1, best_n = 0;
        const int need = blocks_needed(q);
        for (int e = 0; e < E; e++) {
            if (bud[e] < 1 || r->lane_blk_free[e] < need) continue;
            int n = lane_running(r, e);
            if (n >= r->max_seqs) continue;
            if (best < 0 || n < best_n) best = e, best_n = n;
        }
        if (best < 0) break; /* strict FIFO: later requests wait behind this one */
        int slot = 0;
        while (r->slot_req[(size_t)best * r->max_seqs + slot]) slot++;
        r->slot_req[(size_t)best * r->max_seqs + slot] = q;
        r->lane_blk_free[best] -= need;
        q->blk_resv = need;
        q->state = RQ_RUNNING;
        q->lane = best, q->slot = slot, q->group = g, q->opened = false;
        int64_t n = K3_MIN(K3_MIN(q->P, r->chunk), bud[best]);
        q->n_tok_step = n;
        bud[best] -= n;
        total += n;
    }
    if (bud != budget) k3_free(bud);
    if (total == 0) return false;
    gr->step++;
    gr->pending = E;
    r->n_steps++;
    for (int e = 0; e < E; e++) {
        int32_t *mt = r->meta;
        int ns = 0;
        int64_t T = 0;
        bool all = false;
        for (int s = 0; s < r->max_seqs; s++) {
            req_run *q = r->slot_req[(size_t)e * r->max_seqs + s];
            if (!q || q->group != g || q->n_tok_step == 0) continue;
            int flags = q->opened ? 0 : K3_WIRE_OPEN;
            q->opened = true;
            if (q->fed + q->n_tok_step >= q->P && q->n_gen < q->max_tokens) flags |= K3_WIRE_WANT;
            all |= q->all_logits && q->fed < q->P;
            mt[META_HDR + META_SEQ * ns] = s;
            mt[META_HDR + META_SEQ * ns + 1] = (int32_t)q->n_tok_step;
            mt[META_HDR + META_SEQ * ns + 2] = flags;
            ns++;
            T += q->n_tok_step;
        }
        const int nf = r->n_pend_free[e];
        memcpy(mt + META_HDR + META_SEQ * ns, r->pend_free + (size_t)e * r->max_seqs,
               (size_t)nf * sizeof(int32_t));
        r->n_pend_free[e] = 0;
        mt[0] = g, mt[1] = gr->step, mt[2] = all, mt[3] = ns, mt[4] = nf;
        int32_t *tok = mt + META_PREFIX(ns, nf);
        for (int j = 0; j < ns; j++) {
            req_run *q = r->slot_req[(size_t)e * r->max_seqs + mt[META_HDR + META_SEQ * j]];
            for (int64_t t = 0; t < q->n_tok_step; t++) {
                int64_t pos = q->fed + t;
                *tok++ = pos < q->P ? q->prompt[pos] : q->gen[pos - q->P];
            }
            q->fed += q->n_tok_step;
            r->prompt_tokens += K3_MAX(0, K3_MIN(q->fed, q->P) - (q->fed - q->n_tok_step));
        }
        rank_post_step(r, k3_plan_rank(&r->plan, 0, e), K3_MSG_BATCH,
                       (k3_wire_step){.T = T, .n_meta = (int32_t)(META_PREFIX(ns, nf) + T)}, mt,
                       NULL, 0);
    }
    return true;
}

/* ---- logits -> tokens --------------------------------------------------------------------- */
/* log-softmax of the sampler's processed logits (bias, penalties): the chosen id's logprob and
 * the top n. */
static void logprobs(rank_ctx *r, req_run *q, const float *logits, k3_event *e) {
    const int64_t V = r->cfg.vocab_size;
    RTRY(r, k3_sampler_process_logits(q->smp, logits, r->row));
    double m = -INFINITY, z = 0;
    for (int64_t v = 0; v < V; v++) m = r->row[v] > m ? r->row[v] : m;
    for (int64_t v = 0; v < V; v++) z += exp((double)r->row[v] - m);
    double lz = m + log(z);
    e->logprob = (float)((double)r->row[e->token] - lz);
    if (q->logprobs > 0) { /* the best n by insertion into a short sorted list: O(V n) */
        int n = (int)K3_MIN((int64_t)q->logprobs, V), have = 0;
        for (int64_t v = 0; v < V; v++) {
            float x = r->row[v];
            if (have == n && !(x > r->row[e->top_ids[n - 1]])) continue; /* ties: lower id first */
            int k = have < n ? have++ : n - 1;
            while (k > 0 && x > r->row[e->top_ids[k - 1]]) {
                e->top_ids[k] = e->top_ids[k - 1];
                k--;
            }
            e->top_ids[k] = (int32_t)v;
        }
        e->n_top = n;
        for (int k = 0; k < n; k++)
            e->top_logprobs[k] = (float)((double)r->row[e->top_ids[k]] - lz);
    }
}

/* The row is finite: the last stage checked it (k3_batch.nonfinite) and a non-finite row came
 * back as the NF flag, which failed its request before this. */
static void sample(rank_ctx *r, req_run *q, const float *logits) {
    const int64_t V = r->cfg.vocab_size;
    int32_t id;
    if (q->n_gen < r->n_force) /* test hook K3_TEST_FORCE */
        id = r->force[q->n_gen];
    else if (k3_sampler_sample(q->smp, logits, &id) != K3_OK) {
        char why[300];
        snprintf(why, sizeof why, "sampling failed: %s", k3_last_error());
        fail_req(r, q, K3_EVERR_SAMPLING, why);
        return;
    }
    k3_event ev = {.token = id, .logprob = NAN};
    if (q->logprobs > 0) logprobs(r, q, logits, &ev); /* before accept: the history of this row */
    q->gen[q->n_gen++] = id;
    r->gen_tokens++;
    if (k3_sampler_accept(q->smp, id, r->o->tok ? &q->text : NULL, &q->stop) != K3_OK) {
        char why[300];
        snprintf(why, sizeof why, "sampling failed: %s", k3_last_error());
        fail_req(r, q, K3_EVERR_SAMPLING, why);
        return;
    }
    if (q->stop == K3_STOP_STRING) q->stop_string = k3_sampler_matched_stop(q->smp);
    k3_event *e = ev_push(r, K3_EV_TOKEN, q);
    e->token = id;
    e->logprob = ev.logprob;
    e->n_top = ev.n_top;
    memcpy(e->top_ids, ev.top_ids, sizeof e->top_ids);
    memcpy(e->top_logprobs, ev.top_logprobs, sizeof e->top_logprobs);
    if (q->keep_logits) {
        float *row = ev_alloc(r, (size_t)V * sizeof(float));
        memcpy(row, logits, (size_t)V * sizeof(float));
        e->logits = row;
    }
    if (q->n_gen == 1) ev_prompt_logits(r, e, q);
    ev_text(r, e, q);
    if (q->stop != K3_STOP_NONE || q->n_gen >= q->max_tokens)
        finish_req(r, q); /* DONE carries the text held back for a stop string, if any */
}

static void on_logits(rank_ctx *r, const step_msg *m) {
    const int64_t V = r->cfg.vocab_size;
    const int32_t *mt = m->meta;
    int src_stage = -1, e = -1;
    k3_plan_coords(&r->plan, m->src, &src_stage, &e);
    if (m->h.n_meta < META_HDR || src_stage != r->plan.n_stages - 1)
        rank_die(r, K3_ERR(K3_ERR_FORMAT, "LOGITS from rank %d (stage %d): %d meta", m->src,
                           src_stage, m->h.n_meta));
    int g = mt[0], stepi = mt[1], all = mt[2], ns = mt[3], nf = mt[4];
    if (g < 0 || g >= r->n_groups || stepi != r->groups[g].step || r->groups[g].pending <= 0 ||
        ns < 0 || nf < 0 || m->h.n_meta != META_PREFIX(ns, nf) + r->plan.n_stages)
        rank_die(r,
                 K3_ERR(K3_ERR_FORMAT,
                        "LOGITS from rank %d: group %d step %d (expected step %d), %d sequences",
                        m->src, g, stepi, g >= 0 && g < r->n_groups ? r->groups[g].step : -1, ns));
    int64_t T = 0, n_want = 0;
    for (int j = 0; j < ns; j++)
        T += mt[META_HDR + META_SEQ * j + 1],
            n_want += (mt[META_HDR + META_SEQ * j + 2] & K3_WIRE_WANT) != 0;
    int64_t R = all ? T : n_want;
    if (m->h.D != V || m->h.R != R || m->n_f32 != R * V)
        rank_die(r,
                 K3_ERR(K3_ERR_FORMAT, "LOGITS from rank %d: [%lld, %lld] rows, want [%lld, %lld]",
                        m->src, (long long)m->h.R, (long long)m->h.D, (long long)R, (long long)V));
    r->logits_bytes += m->n_bytes;
    r->n_logits_msgs++;
    const int32_t *busy_us = mt + META_PREFIX(ns, nf); /* per stage of lane e (wire.h) */
    for (int s = 0; s < r->plan.n_stages; s++) {
        int w = k3_plan_rank(&r->plan, s, e);
        r->rank_busy_s[w] += busy_us[s] * 1e-6;
        r->rank_steps[w]++;
    }
    if (!r->worker) rank_hooks_maybe_die(r, r->n_logits_msgs);
    int64_t row = 0;
    for (int j = 0; j < ns; j++) {
        int slot = mt[META_HDR + META_SEQ * j], nt = mt[META_HDR + META_SEQ * j + 1];
        bool want = (mt[META_HDR + META_SEQ * j + 2] & K3_WIRE_WANT) != 0;
        req_run *q = slot >= 0 && slot < r->max_seqs
                         ? r->slot_req[(size_t)e * r->max_seqs + (size_t)slot]
                         : NULL;
        if (!q || q->group != g)
            rank_die(r, K3_ERR(K3_ERR_FORMAT, "LOGITS from rank %d: lane %d slot %d is not in use",
                               m->src, e, slot));
        const float *last = NULL;
        if (all) {
            int64_t p0 = q->fed - nt; /* position of this step's first row */
            for (int64_t t = 0; t < nt && q->prompt_logits; t++)
                if (p0 + t < q->P) {
                    memcpy(q->prompt_logits + (p0 + t) * V, m->f32 + (row + t) * V,
                           (size_t)V * sizeof(float));
                    q->prompt_rows = K3_MAX(q->prompt_rows, p0 + t + 1);
                }
            last = m->f32 + (row + nt - 1) * V;
            row += nt;
        } else if (want) {
            last = m->f32 + row * V;
            row++;
        }
        if (q->cancel) {
            finish_req(r, q);
            continue;
        }
        int fl = mt[META_HDR + META_SEQ * j + 2];
        if (fl & K3_WIRE_NF) { /* its state holds NaN/Inf now: what follows would be noise */
            int32_t code = fl >> K3_WIRE_NF_SHIFT;
            int layer = k3_nf_layer(code), st = r->plan.n_stages - 1;
            for (int s = 0; layer >= 0 && s < r->plan.n_stages; s++)
                if (layer >= r->plan.stage_begin[s] && layer < r->plan.stage_begin[s + 1]) st = s;
            char why[200], at[32] = "";
            if (layer >= 0) snprintf(at, sizeof at, "layer %d, ", layer);
            snprintf(why, sizeof why,
                     "non-finite activation (NaN/Inf): first in %s%s (rank %d: stage %d, lane %d)",
                     at, k3_nf_op_name(k3_nf_op_of(code)), k3_plan_rank(&r->plan, st, e), st, e);
            fail_req(r, q, K3_EVERR_NUMERIC, why);
            continue;
        }
        if (want)
            sample(r, q, last);
        else if (q->max_tokens == 0 && q->fed >= q->P)
            finish_req(r, q); /* prefill only: done when the prompt is in */
    }
    r->groups[g].pending--;
}

/* ---- the loop ----------------------------------------------------------------------------- */
void rank_coord_init(rank_ctx *r) {
    const int E = r->plan.n_lanes;
    r->n_groups = r->o->micro_batches > 0 ? r->o->micro_batches : K3_MAX(1, r->plan.n_stages);
    RTRY(r, k3_calloc((void **)&r->groups, (size_t)r->n_groups * sizeof *r->groups, "groups"));
    RTRY(r, k3_calloc((void **)&r->slot_req, (size_t)E * (size_t)r->max_seqs * sizeof *r->slot_req,
                      "slot table"));
    r->meta_cap = META_PREFIX((int64_t)r->max_seqs, (int64_t)r->max_seqs) + r->max_tokens;
    RTRY(r, k3_calloc((void **)&r->lane_blk_free, (size_t)E * sizeof(int), "lane cache blocks"));
    RTRY(r, k3_calloc((void **)&r->n_pend_free, (size_t)E * sizeof(int), "lane freed slots"));
    RTRY(r, k3_calloc((void **)&r->pend_free, (size_t)E * (size_t)r->max_seqs * sizeof(int32_t),
                      "lane freed slot lists"));
    for (int e = 0; e < E; e++) r->lane_blk_free[e] = r->kv_blocks;
    RTRY(r, k3_alloc((void **)&r->meta, (size_t)r->meta_cap * sizeof(int32_t), "step meta"));
    RTRY(r, k3_alloc((void **)&r->row, (size_t)r->cfg.vocab_size * sizeof(float), "logprob row"));
    RTRY(r, k3_calloc((void **)&r->rank_busy_s, (size_t)r->world * sizeof *r->rank_busy_s,
                      "per-rank busy time"));
    RTRY(r, k3_calloc((void **)&r->rank_steps, (size_t)r->world * sizeof *r->rank_steps,
                      "per-rank steps"));
    r->last_progress = k3_now_s();
}

/* Free what the previous step's events pointed to, and the requests they ended. */
static void clear_events(rank_ctx *r) {
    for (int i = 0; i < r->n_ev_mem; i++) r->ev_mem[i].used = 0;
    r->ev_cur = 0;
    r->n_ev = 0;
    int k = 0;
    for (int i = 0; i < r->n_reqs; i++) {
        req_run *q = r->reqs[i];
        if (q->state == RQ_ENDED && !q->error)
            free_req(q);
        else
            r->reqs[k++] = q;
    }
    r->n_reqs = k;
}

void rank_coord_destroy(rank_ctx *r) {
    clear_events(r);
    for (int i = 0; i < r->n_reqs; i++) free_req(r->reqs[i]);
    for (int i = 0; i < r->n_ev_mem; i++) k3_free(r->ev_mem[i].data);
    free(r->reqs), free(r->ev), free(r->ev_mem);
    r->reqs = NULL, r->ev = NULL, r->ev_mem = NULL;
    r->n_reqs = r->cap_reqs = r->n_ev = r->cap_ev = r->n_ev_mem = r->cap_ev_mem = 0;
    k3_free(r->groups), k3_free(r->slot_req), k3_free(r->meta), k3_free(r->row);
    r->groups = NULL, r->slot_req = NULL, r->meta = NULL, r->row = NULL;
    k3_free(r->lane_blk_free), k3_free(r->n_pend_free), k3_free(r->pend_free);
    r->lane_blk_free = r->n_pend_free = NULL, r->pend_free = NULL;
    k3_free(r->rank_busy_s), k3_free(r->rank_steps), k3_free(r->force);
    r->rank_busy_s = NULL, r->rank_steps = NULL, r->force = NULL;
    r->n_force = 0;
}

bool rank_coord_in_flight(const rank_ctx *r) {
    for (int g = 0; g < r->n_groups; g++)
        if (r->groups[g].pending > 0) return true;
    return false;
}

void rank_coord_step(rank_ctx *r) {
    clear_events(r);
    for (int i = 0; i < r->n_reqs; i++) { /* requests refused at submit */
        req_run *q = r->reqs[i];
        if (q->error) {
            fail_req(r, q, q->error_kind, q->error);
            k3_free(q->error);
            q->error = NULL;
        }
    }
    const double timeout = r->o->comm_timeout_s > 0 ? r->o->comm_timeout_s : 600;
    int backoff = 0;
    for (;;) {
        RTRY(r, k3_comm_beat(r->comm)); /* rate-limited inside: every --comm-timeout / 3 */
        bool progressed = false;
        step_msg m;
        bool got;
        rank_poll_step(r, K3_ANY_RANK, K3_MSG_LOGITS, &m, &got);
        if (got) {
            on_logits(r, &m);
            progressed = true;
        }
        if (r->worker && rank_worker_poll(r)) progressed = true;
        for (int g = 0; g < r->n_groups; g++)
            if (r->groups[g].pending == 0 && send_step(r, g)) progressed = true;
        if (progressed) {
            r->last_progress = k3_now_s();
            backoff = 0;
        }
        if (r->n_ev > 0) return;
        if (!rank_coord_in_flight(r)) {
            /* nothing in flight: if requests wait, no step could take them (cannot happen: an
               idle group always admits the queue head); otherwise there is nothing to do */
            return;
        }
        if (progressed) continue;
        if (k3_now_s() - r->last_progress > timeout) {
            int g = 0;
            while (g < r->n_groups && r->groups[g].pending == 0) g++;
            /* the lanes of the last stage owe the logits; the fault exchange finds the root */
            int waited[K3_FAULT_MAX_WAITS], n = 0;
            for (int e = 0; e < r->plan.n_lanes; e++) {
                if (n < K3_FAULT_MAX_WAITS)
                    waited[n] = k3_plan_rank(&r->plan, r->plan.n_stages - 1, e);
                n++;
            }
            char what[160];
            snprintf(what, sizeof what,
                     "the logits of micro-batch %d step %d (%d of %d lanes missing)", g,
                     r->groups[g].step, r->groups[g].pending, r->plan.n_lanes);
            k3_comm_note_timeout(r->comm, waited, n, what, k3_now_s() - r->last_progress);
            rank_die(r, K3_ERR(K3_ERR_COMM,
                               "coordinator: no logits for micro-batch %d step %d (%d of %d lanes "
                               "of the last stage, ranks %d-%d, missing) within %.0f s "
                               "(--comm-timeout)",
                               g, r->groups[g].step, r->groups[g].pending, r->plan.n_lanes,
                               k3_plan_rank(&r->plan, r->plan.n_stages - 1, 0),
                               k3_plan_rank(&r->plan, r->plan.n_stages - 1, r->plan.n_lanes - 1),
                               timeout));
        }
        k3_comm_idle(r->comm, &backoff);
    }
}
