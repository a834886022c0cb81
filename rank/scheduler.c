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

/* One request on the coordinator. */
typedef enum { RQ_QUEUED = 0, RQ_RUNNING, RQ_ENDED } rq_state;
/* The full prompt blocks a prefill and its forks share on a lane (those the prefix cache does not
 * hold): reserved once, returned when the last of them ends. */
typedef struct fork_share {
    int blocks, users;
} fork_share;
typedef struct req_run {
    int64_t id;
    uint64_t user;
    rq_state state;
    int32_t *prompt; /* [P] (copied) */
    int64_t P, fed;  /* prompt length, tokens fed so far (prompt, then generated) */
    int max_tokens;
    int n_gen;
    int32_t *gen; /* [max_tokens] */
    int lane, group, slot;
    int blk_resv;       /* paged cache blocks reserved on its lane: those of `cover`, less
                           those the prefix cache holds (its hit, then blocks it cached) and
                           those its fork family shares */
    int cover;          /* blocks of its context the books cover: [0, cover * 64) positions;
                           grows as its tokens arrive (blocks_cover) */
    int64_t cached;     /* prompt tokens its prefix-cache hit skipped */
    bool opened;        /* its first step (the OPEN flag) was sent */
    int64_t n_tok_step; /* tokens in its group's current step */
    k3_sampler *smp;
    k3_stop_kind stop;
    int stop_string;
    int logprobs;
    bool keep_logits, all_logits, cancel;
    float *prompt_logits; /* all_logits: [P, V] */
    int64_t prompt_rows;
    bool plp;                  /* prompt logprobs: its prefill steps carry K3_WIRE_PLP */
    int plp_top;               /* top n kept per prompt position */
    k3_prompt_lp *plp_lps;     /* [P - 1]: entry i for prompt token i + 1 */
    double t_submit, queued_s; /* when submitted; how long it waited for its slot */
    k3_tok_bytes text;         /* text emitted so far (deltas are its new bytes) */
    size_t text_sent;
    bool refused; /* a request that can never run: reported by the next step (why) */
    k3_error_kind error_kind;
    char why[400]; /* the text of its ERROR event (the event points here until the next step) */
    struct req_run *fork_src; /* queued fork: the request whose prefill it waits for (or NULL) */
    fork_share *share;        /* running: the shared prompt blocks of its family (or NULL) */
} req_run;

typedef struct ev_block {
    char *data;
    size_t size, used;
} ev_block;

typedef struct group_run {
    int step;    /* current step id */
    int pending; /* LOGITS messages still expected for its step in flight (0: idle) */
} group_run;

/* The coordinator's state (rank 0). */
struct rank_coord {
    int32_t base_stops[3]; /* EOS of the config, <|end_of_msg|>, [EOS] (-1: none) */
    int n_groups;
    group_run *groups;
    req_run **reqs; /* every request not yet reported ended, by submit order */
    int n_reqs, cap_reqs;
    int64_t next_id;
    req_run **slot_req;       /* [E * max_seqs] the running request in each (lane, slot) */
    int *lane_blk_free;       /* [E] blocks not reserved by a running request */
    int32_t *pend_free;       /* [E * max_seqs] slots ended since the lane's last step */
    int *n_pend_free;         /* [E] */
    rank_step_seq *step_seqs; /* [max_seqs] scratch of a message: its sequences, */
    int32_t *step_tokens;     /* [max_tokens] token ids */
    int32_t *step_targets;    /* [max_tokens] and prompt-logprob targets */
    float *row;               /* [V] scratch (logprobs) */
    /* events of the current k3_engine_step */
    k3_event *ev;
    int n_ev, cap_ev;
    ev_block *ev_mem; /* memory the events point into, rewound at the next step */
    int n_ev_mem, cap_ev_mem, ev_cur;
    double last_progress; /* when a message last arrived */
    uint64_t logits_bytes;
    int n_logits_msgs;
    int64_t prompt_tokens, gen_tokens;
    uint64_t n_steps;            /* forward steps sent */
    rank_pcache **pc;            /* [E] each lane's prefix-cache index (NULL: --no-prefix-cache) */
    int64_t pc_queries, pc_hits; /* prompt tokens looked up, found (vLLM's counters) */
    rank_step_fork *fork_ops;    /* [E, max_seqs] the forks for the lanes' next
                                    messages (rank/prefix_cache.h) */
    int *n_fork_ops;             /* [E] */
    int *slot_hold;              /* [E * max_seqs] blocks of a request that ended while an unsent
                                    FORK op names its slot (-1: none): the stages free them only
                                    after that op, so the books take them back, and the slot is
                                    free again, once the lane's next message is sent */
    req_run **kids;              /* [max_seqs] scratch: the forks of one prefill */
    int64_t n_forks, n_fork_fallbacks;
    int64_t n_preempt;    /* running requests preempted (their blocks freed, recomputed later) */
    double *rank_busy_s;  /* [world] forward time of each rank so far (from the LOGITS) */
    uint64_t *rank_steps; /* [world] its steps counted there */
    bool graphs;          /* decode steps are captured (a cuda backend, --cuda-graphs on) */
    bool *graph_off;      /* [max_seqs + 1] padded sizes a stage could not capture: eager now */
};

/* The capture decision of a lane's step (docs/DESIGN.md §5): a decode step (every sequence one
   token, no prompt rows wanted) runs as the graph of the ladder size n_pad (the next power of two,
   at most max_seqs) unless a stage could not capture that size; 0: eager. Every stage of the lane
   reads it from the message, so all capture or replay the same step. */
static int32_t graph_rows(const rank_ctx *r, const rank_step *m) {
    if (!r->co->graphs || m->n_seqs < 1 || m->all_logits) return 0;
    for (int j = 0; j < m->n_seqs; j++)
        if (m->seqs[j].n_tokens != 1 || (m->seqs[j].flags & K3_WIRE_PLP)) return 0;
    int n = 1;
    while (n < m->n_seqs) n *= 2;
    n = K3_MIN(n, r->max_seqs);
    return n <= r->max_tokens && !r->co->graph_off[n] ? n : 0;
}

/* The MoE route of group g's round (docs/DESIGN.md §5, route decision), before any lane's message
   is built: the device route only when every lane's step is a decode step (each of its sequences
   one token, no prompt rows wanted: graph_rows' test; a lane without sequences counts as one).
   Such a round gives each expert at most one row per token, within the capacity of every
   sender's lane block; a round with any prefill row is host-routed on every lane (a prompt of
   identical tokens would send all its rows to the same K experts, past any fixed capacity), and
   runs eagerly there (n_pad 0: the lanes of a stage make the same exchange calls). */
static bool round_moe_host(const rank_ctx *r, int g, int E) {
    for (size_t i = 0; i < (size_t)E * (size_t)r->max_seqs; i++) { /* as the messages pick them */
        const req_run *q = r->co->slot_req[i];
        if (!q || q->group != g || q->n_tok_step == 0) continue;
        if (q->n_tok_step != 1 || (q->plp && q->fed < q->P) || (q->all_logits && q->fed < q->P))
            return true;
    }
    return false;
}

/* ---- events ------------------------------------------------------------------------------- */
/* Event data (text deltas, logits rows) comes from blocks that are kept and reused: clearing the
 * events only rewinds them, so a step allocates nothing once the blocks have grown. */
#define EV_BLOCK (256 * 1024)
static k3_status ev_alloc(rank_ctx *r, size_t n, void **out) {
    if (rank_hooks_alloc_fails(r, RANK_ALLOC_STEP))
        return K3_ERR(K3_ERR_NOMEM, "event data (%zu bytes; test hook)", n);
    n = (n + 63) & ~(size_t)63; /* 64-byte aligned pieces (float rows) */
    for (; r->co->ev_cur < r->co->n_ev_mem; r->co->ev_cur++) {
        ev_block *b = &r->co->ev_mem[r->co->ev_cur];
        if (b->size - b->used >= n) {
            *out = b->data + b->used;
            b->used += n;
            return K3_OK;
        }
    }
    if (r->co->n_ev_mem == r->co->cap_ev_mem) {
        int cap = r->co->cap_ev_mem ? 2 * r->co->cap_ev_mem : 16;
        ev_block *m = realloc(r->co->ev_mem, (size_t)cap * sizeof *m);
        if (!m) return K3_ERR(K3_ERR_NOMEM, "event memory table");
        r->co->ev_mem = m, r->co->cap_ev_mem = cap;
    }
    ev_block *b = &r->co->ev_mem[r->co->n_ev_mem];
    b->size = n > EV_BLOCK ? n : EV_BLOCK;
    b->used = n;
    K3_TRY(k3_alloc((void **)&b->data, b->size, "event data"));
    r->co->ev_cur = r->co->n_ev_mem++;
    *out = b->data;
    return K3_OK;
}

static k3_status ev_push(rank_ctx *r, k3_event_kind kind, const req_run *q, k3_event **out) {
    if (r->co->n_ev == r->co->cap_ev) {
        int cap = r->co->cap_ev ? 2 * r->co->cap_ev : 64;
        k3_event *e = realloc(r->co->ev, (size_t)cap * sizeof *e);
        if (!e) RTRY(r, K3_ERR(K3_ERR_NOMEM, "event table"));
        r->co->ev = e, r->co->cap_ev = cap;
    }
    k3_event *e = &r->co->ev[r->co->n_ev++];
    memset(e, 0, sizeof *e);
    e->kind = kind;
    e->id = q->id;
    e->user = q->user;
    e->logprob = NAN;
    e->stop_string = -1;
    e->n_prompt = q->P;
    e->n_gen = q->n_gen;
    e->queued_s = q->queued_s;
    e->n_cached = q->cached;
    *out = e;
    return K3_OK;
}

/* New text of q since the last event, copied into event memory (*t NULL when none). Fails
 * (K3_ERR_NOMEM, not recorded as a fault) when event memory cannot grow: the caller fails q. */
static k3_status ev_text(rank_ctx *r, req_run *q, char **t, size_t *n) {
    *t = NULL;
    *n = q->text.n - q->text_sent;
    if (!*n) return K3_OK;
    K3_TRY(ev_alloc(r, *n + 1, (void **)t));
    memcpy(*t, q->text.data + q->text_sent, *n);
    (*t)[*n] = 0;
    q->text_sent = q->text.n;
    return K3_OK;
}

static void ev_prompt_logits(k3_event *e, req_run *q) {
    if (q->plp) e->prompt_lps = q->plp_lps; /* owned by q, like the logits below */
    if (!q->all_logits || !q->prompt_logits) return;
    e->prompt_logits = q->prompt_logits; /* owned by q, freed with it after the next step */
    e->n_prompt_rows = q->prompt_rows;
}

static void free_req(req_run *q) {
    if (!q) return;
    k3_free(q->prompt), k3_free(q->gen), k3_free(q->prompt_logits);
    k3_free(q->plp_lps);
    k3_sampler_destroy(q->smp);
    k3_tok_bytes_free(&q->text);
    k3_free(q);
}

/* Lane e's forks for its next message (rank_coord.fork_ops). */
static rank_step_fork *lane_forks(const rank_ctx *r, int e) {
    return r->co->fork_ops + (size_t)e * (size_t)r->max_seqs;
}

/* Slot s of lane e ends on the books: its blocks back to the lane, its prefix-cache entries
 * evictable again, and the lane's next message frees it on the stages. */
static void slot_release(rank_ctx *r, int e, int s, int blocks) {
    struct rank_coord *C = r->co;
    C->lane_blk_free[e] += blocks;
    if (C->pc) rank_pc_end(C->pc[e], s);
    int32_t *pf = C->pend_free + (size_t)e * r->max_seqs;
    for (int k = 0; k < C->n_pend_free[e]; k++)
        if (pf[k] == s) return;
    if (C->n_pend_free[e] < r->max_seqs) pf[C->n_pend_free[e]++] = s;
}

/* Whether an unsent FORK op of lane e names slot s (as parent or child). */
static bool fork_names(const rank_ctx *r, int e, int s) {
    const rank_step_fork *fk = lane_forks(r, e);
    for (int k = 0; k < r->co->n_fork_ops[e]; k++)
        if (fk[k].parent == s || fk[k].child == s) return true;
    return false;
}

/* A slot is taken while a request runs in it or its ended request's blocks are held. */
static bool slot_taken(const rank_ctx *r, int e, int s) {
    const size_t i = (size_t)e * r->max_seqs + (size_t)s;
    return r->co->slot_req[i] != NULL || r->co->slot_hold[i] >= 0;
}

/* q leaves its slot on the books: the blocks it held there, its own and (the last of a fork
 * family) the family's shared prompt blocks, for the caller to release or hold. */
static int leave_slot(rank_ctx *r, req_run *q) {
    r->co->slot_req[(size_t)q->lane * (size_t)r->max_seqs + (size_t)q->slot] = NULL;
    int blocks = q->blk_resv;
    q->blk_resv = 0;
    if (q->share && --q->share->users == 0) { /* the last of a family: its prompt blocks */
        blocks += q->share->blocks;
        k3_free(q->share);
    }
    q->share = NULL;
    return blocks;
}

/* The request leaves: its slot is free for the next one (no message: OPEN resets it). A request
 * named by a FORK op the lane has not been sent yet: a fork (child) that ended before its copy was
 * made drops its op (the stages never make it); the blocks of a parent (or of a family's shared
 * prompt blocks) stay held until the lane's next message applied the forks that copy them, and
 * only then return to the books (release_holds): the stages still hold them during those forks,
 * so no fork of the same message may be counted on them. */
static void end_req(rank_ctx *r, req_run *q) {
    struct rank_coord *C = r->co;
    if (q->state == RQ_RUNNING && q->slot >= 0) {
        const int e = q->lane, ms = r->max_seqs;
        const int blocks = leave_slot(r, q);
        rank_step_fork *fk = lane_forks(r, e);
        int parent = -1;
        for (int k = 0; k < C->n_fork_ops[e]; k++)
            if (fk[k].child == q->slot) { /* an unsent fork: never made */
                parent = fk[k].parent;
                memmove(fk + k, fk + k + 1, (size_t)(C->n_fork_ops[e] - k - 1) * sizeof *fk);
                C->n_fork_ops[e]--;
                break;
            }
        if (fork_names(r, e, q->slot)) /* a parent whose forks are not sent yet */
            C->slot_hold[(size_t)e * ms + (size_t)q->slot] = blocks;
        else
            slot_release(r, e, q->slot, blocks);
        const size_t pi = (size_t)e * ms + (size_t)parent;
        if (parent >= 0 && C->slot_hold[pi] >= 0 && !fork_names(r, e, parent)) {
            slot_release(r, e, parent, C->slot_hold[pi]); /* its last unsent fork is gone */
            C->slot_hold[pi] = -1;
        }
    }
    q->state = RQ_ENDED;
    for (int i = 0; i < C->n_reqs; i++) /* forks still waiting for its prefill: their own */
        if (C->reqs[i]->fork_src == q) C->reqs[i]->fork_src = NULL, C->n_fork_fallbacks++;
}

/* The lane's message with its FORK ops was sent: the slots held for them end on the books. */
static void release_holds(rank_ctx *r, int e) {
    for (int s = 0; s < r->max_seqs; s++) {
        int *h = &r->co->slot_hold[(size_t)e * r->max_seqs + (size_t)s];
        if (*h >= 0) slot_release(r, e, s, *h), *h = -1;
    }
}

/* Paged cache blocks of a request's whole context, prompt + max_tokens (what it can ever need;
 * check_request refuses one that a lane cannot hold). */
static int blocks_needed(const req_run *q) {
    return (int)((q->P + (int64_t)q->max_tokens + K3_KV_BLOCK - 1) / K3_KV_BLOCK);
}

/* The blocks that positions [0, upto) take (never past its whole context): what the books cover
 * for a request whose tokens have arrived up to there. */
static int blocks_cover(const req_run *q, int64_t upto) {
    return (int)K3_MIN((int64_t)blocks_needed(q), (upto + K3_KV_BLOCK - 1) / K3_KV_BLOCK);
}

static k3_status fail_req(rank_ctx *r, req_run *q, k3_error_kind kind, const char *why);

/* q could not get memory for its events (ev_alloc): it fails alone. */
static k3_status fail_nomem(rank_ctx *r, req_run *q) {
    char why[sizeof q->why];
    snprintf(why, sizeof why, "out of memory for the request's event data: %.300s",
             k3_last_error());
    return fail_req(r, q, K3_EVERR_RESOURCE, why);
}

static k3_status finish_req(rank_ctx *r, req_run *q) {
    if (q->stop == K3_STOP_NONE && q->smp && q->n_gen > 0) {
        /* length (or cancel): flush text held back for a possible stop string */
        RTRY(r, k3_sampler_finish(q->smp, r->o->tok ? &q->text : NULL));
    }
    char *t;
    size_t nt;
    if (ev_text(r, q, &t, &nt) != K3_OK) return fail_nomem(r, q);
    k3_event *e;
    RTRY(r, ev_push(r, K3_EV_DONE, q, &e));
    e->stop = q->stop;
    e->stop_string = q->stop == K3_STOP_STRING ? q->stop_string : -1;
    e->text = t, e->n_text = nt;
    if (q->n_gen == 0) ev_prompt_logits(e, q);
    end_req(r, q);
    return K3_OK;
}

/* q ends with an ERROR event; its text lives in q (no allocation: an out-of-memory request can
   still be told). */
static k3_status fail_req(rank_ctx *r, req_run *q, k3_error_kind kind, const char *why) {
    k3_event *e;
    RTRY(r, ev_push(r, K3_EV_ERROR, q, &e));
    e->error_kind = kind;
    if (why != q->why) snprintf(q->why, sizeof q->why, "%s", why);
    e->error = q->why;
    end_req(r, q);
    return K3_OK;
}

/* ---- submit / cancel ---------------------------------------------------------------------- */
static req_run *find_req(const rank_ctx *r, int64_t id) {
    for (int i = 0; i < r->co->n_reqs; i++)
        if (r->co->reqs[i]->id == id) return r->co->reqs[i];
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
    /* admission counts the prompt, not max_tokens: a sequence takes blocks as its tokens arrive
       (one that outgrows its lane's whole cache fails then, in grow) */
    if (rq->n_ids + 1 > (int64_t)r->kv_blocks * K3_KV_BLOCK) {
        *kind = K3_EVERR_CONTEXT;
        snprintf(buf, n,
                 "the prompt (%lld tokens) and its first token need more paged cache than a lane "
                 "has (%lld tokens, --kv-cache-tokens)",
                 (long long)rq->n_ids, (long long)r->kv_blocks * K3_KV_BLOCK);
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
    if (rq->prompt_logprobs && V > (1 << 24)) /* the records carry ids as exact floats */
        return "prompt logprobs need a vocabulary below 2^24 ids";
    if (rq->prompt_logprobs && (rq->prompt_top < 0 || rq->prompt_top > K3_EV_MAX_TOP)) {
        snprintf(buf, n, "prompt logprobs: top %d outside [0, %d]", rq->prompt_top, K3_EV_MAX_TOP);
        return buf;
    }
    return NULL;
}

/* The request whose prefill q may share (k3_request.fork): one that has not sampled yet, with the
 * same prompt and prompt outputs; NULL: q runs its own prefill. */
static req_run *fork_parent(rank_ctx *r, const req_run *q, int64_t id) {
    req_run *p = find_req(r, id);
    if (!p || p == q || p->state == RQ_ENDED || p->refused || p->fork_src || p->n_gen > 0 ||
        p->max_tokens < 1 || q->max_tokens < 1 || p->P != q->P ||
        memcmp(p->prompt, q->prompt, (size_t)q->P * sizeof(int32_t)) != 0 ||
        p->all_logits != q->all_logits || p->plp != q->plp || p->plp_top != q->plp_top) {
        r->co->n_fork_fallbacks++;
        return NULL;
    }
    return p;
}

/* q's own memory (prompt, generated ids, prompt logits and logprobs) and its sampler; bad: why
 * the request can never run (its sampling refused), or NULL. A failed allocation returns
 * K3_ERR_NOMEM (the caller's request fails; nothing is queued). */
static k3_status build_req(rank_ctx *r, const k3_request *rq, req_run *q, char *why, size_t n_why,
                           const char **bad, k3_error_kind *kind) {
    const size_t V = (size_t)r->cfg.vocab_size;
    K3_TRY(rank_alloc(r, RANK_ALLOC_SUBMIT, (void **)&q->prompt, (size_t)q->P * sizeof(int32_t),
                      false, "the request's prompt"));
    memcpy(q->prompt, rq->ids, (size_t)q->P * sizeof(int32_t));
    K3_TRY(rank_alloc(r, RANK_ALLOC_SUBMIT, (void **)&q->gen,
                      (size_t)K3_MAX(q->max_tokens, 1) * sizeof(int32_t), false,
                      "the request's generated ids"));
    if (q->all_logits)
        K3_TRY(rank_alloc(r, RANK_ALLOC_SUBMIT, (void **)&q->prompt_logits,
                          (size_t)q->P * V * sizeof(float), false, "the request's prompt logits"));
    if (q->plp)
        K3_TRY(rank_alloc(r, RANK_ALLOC_SUBMIT, (void **)&q->plp_lps,
                          (size_t)K3_MAX(q->P - 1, 1) * sizeof *q->plp_lps, true,
                          "the request's prompt logprobs"));
    /* stop ids: the request's, then (unless ignore_eos) EOS, <|end_of_msg|>, [EOS] */
    int32_t stops[64 + 3];
    size_t ns = 0;
    for (size_t i = 0; i < rq->sampling.n_stop_ids && ns < 64; i++)
        stops[ns++] = rq->sampling.stop_ids[i];
    for (int i = 0; i < 3 && !rq->ignore_eos; i++)
        if (r->co->base_stops[i] >= 0) stops[ns++] = r->co->base_stops[i];
    k3_sampler_params sp = rq->sampling;
    sp.stop_ids = stops;
    sp.n_stop_ids = ns;
    if (rq->sampling.n_stop_ids > 64) {
        *bad = "more than 64 stop ids";
    } else if (k3_sampler_create(&q->smp, &sp, r->cfg.vocab_size, r->o->tok) != K3_OK) {
        snprintf(why, n_why, "sampling: %s", k3_last_error());
        *bad = why;
        *kind = K3_EVERR_SAMPLING;
    }
    return K3_OK;
}

/* The request is built in full before it joins the queue: a failure leaves nothing behind. */
k3_status rank_coord_submit(rank_ctx *r, const k3_request *rq, int64_t *id) {
    *id = -1;
    if (r->co->n_reqs == r->co->cap_reqs) {
        int cap = r->co->cap_reqs ? 2 * r->co->cap_reqs : 64;
        req_run **a = rank_hooks_alloc_fails(r, RANK_ALLOC_SUBMIT)
                          ? NULL
                          : realloc(r->co->reqs, (size_t)cap * sizeof *a);
        if (!a) return K3_ERR(K3_ERR_NOMEM, "submit: out of memory for the request table");
        r->co->reqs = a, r->co->cap_reqs = cap;
    }
    req_run *q;
    K3_TRY(rank_alloc(r, RANK_ALLOC_SUBMIT, (void **)&q, sizeof *q, true, "the request"));
    q->lane = q->group = q->slot = -1;
    q->stop_string = -1;
    q->max_tokens = rq->max_tokens;
    q->logprobs = rq->logprobs;
    q->keep_logits = rq->keep_logits;
    q->all_logits = rq->all_logits;
    q->plp = rq->prompt_logprobs;
    q->plp_top = rq->prompt_top;
    q->P = rq->n_ids > 0 ? rq->n_ids : 0;
    q->t_submit = k3_now_s();
    q->user = rq->user;
    char why[256];
    k3_error_kind kind;
    const char *bad = check_request(r, rq, why, sizeof why, &kind);
    if (!bad) {
        k3_status st = build_req(r, rq, q, why, sizeof why, &bad, &kind);
        if (st != K3_OK) { /* out of memory: this request fails, the engine goes on */
            char msg[sizeof q->why];
            snprintf(msg, sizeof msg, "%.300s", k3_last_error());
            free_req(q);
            return K3_ERR(st, "submit: %s", msg);
        }
    }
    q->id = r->co->next_id++;
    *id = q->id;
    if (bad) {
        snprintf(q->why, sizeof q->why, "%s", bad);
        q->refused = true;
        q->error_kind = kind;
        q->state = RQ_ENDED; /* reported by the next step */
    } else {
        q->state = RQ_QUEUED;
        if (rq->fork) q->fork_src = fork_parent(r, q, rq->fork_of);
    }
    r->co->reqs[r->co->n_reqs++] = q;
    return K3_OK;
}

k3_status rank_coord_cancel(rank_ctx *r, int64_t id) {
    req_run *q = find_req(r, id);
    if (!q || q->state == RQ_ENDED)
        return K3_ERR(K3_ERR_ARG, "cancel: request %lld is not queued or running", (long long)id);
    q->cancel = true;
    return K3_OK;
}

void rank_coord_load(const rank_ctx *r, int *running, int *waiting, double *cache_usage) {
    int64_t free = 0;
    for (int i = 0; i < r->co->n_reqs; i++) {
        *running += r->co->reqs[i]->state == RQ_RUNNING;
        *waiting += r->co->reqs[i]->state == RQ_QUEUED;
    }
    for (int e = 0; e < r->plan.n_lanes; e++) /* cached blocks in use count, evictable ones not */
        free += r->co->lane_blk_free[e] -
                (r->co->pc ? rank_pc_blocks(r->co->pc[e]) - rank_pc_evictable(r->co->pc[e]) : 0);
    const double all = (double)r->kv_blocks * r->plan.n_lanes;
    *cache_usage = all > 0 ? 1.0 - (double)free / all : 0;
}

int rank_coord_pending(const rank_ctx *r) {
    int n = 0;
    for (int i = 0; i < r->co->n_reqs; i++) /* a refused one too: the next step reports it */
        n += r->co->reqs[i]->state != RQ_ENDED || r->co->reqs[i]->refused;
    return n;
}

/* ---- steps -------------------------------------------------------------------------------- */
/* Tokens q can feed now (0: none): the rest of its prompt, or its last sampled token. */
static int64_t want_tokens(const rank_ctx *r, const req_run *q) {
    if (q->state != RQ_RUNNING || q->cancel) return 0;
    if (q->fed < q->P) return q->P + q->n_gen - q->fed; /* a preempted one: its tokens too */
    if (q->stop != K3_STOP_NONE || q->n_gen >= q->max_tokens) return 0;
    return q->P + q->n_gen - q->fed; /* 1 in decode; more when it recomputes after preemption */
}

static int lane_running(const rank_ctx *r, int e) {
    int n = 0;
    for (int s = 0; s < r->max_seqs; s++) n += slot_taken(r, e, s);
    return n;
}

/* ---- the prefix cache (prefix_cache.h): rank 0 decides, the lane's next message carries it ----
 */
/* A prefill chunk of n tokens from q->fed, cut at the next snapshot point (taken at a step's end).
 */
static int64_t pc_cut(const rank_ctx *r, const req_run *q, int64_t n) {
    if (!r->co->pc || q->fed >= q->P) return n;
    const int64_t cut = rank_pc_next_cut(r->co->pc[q->lane], q->fed, q->P);
    return cut - q->fed < n ? cut - q->fed : n;
}

/* A request that wants the logits of its prompt positions (all_logits, prompt logprobs) runs its
 * whole prompt: it takes no hit (it still caches what it runs). */
static bool pc_may_hit(const req_run *q) {
    return !q->all_logits && !q->plp;
}

/* Whether lane e has room for `need` new blocks: those no request reserved, less what the cache
 * holds and cannot evict (entries in use, and the unused ones a hit is about to use). */
static bool pc_fits(const rank_ctx *r, int e, int need, int hit_unused) {
    int64_t room = r->co->lane_blk_free[e];
    if (r->co->pc)
        room -= rank_pc_blocks(r->co->pc[e]) - rank_pc_evictable(r->co->pc[e]) + hit_unused;
    return room >= need;
}

/* The cache of lane e evicts until `need` blocks are free of it (pc_fits said they can be). */
static void pc_make_room(rank_ctx *r, int e, int need) {
    rank_pcache *pc = r->co->pc[e];
    while (r->co->lane_blk_free[e] - rank_pc_blocks(pc) < need && rank_pc_evict_one(pc)) {
    }
}

/* q joins lane e: it takes its hit (prefill starts there) and the cache evicts what its blocks
 * need. Returns the blocks it reserves. */
static k3_status pc_join(rank_ctx *r, req_run *q, int e, int *need) {
    rank_pcache *pc = r->co->pc[e];
    RTRY(r, rank_pc_begin(pc, q->slot, q->prompt, q->P, pc_may_hit(q), &q->cached));
    q->cover = blocks_cover(q, q->P + q->n_gen);
    *need = q->cover - (int)(q->cached / K3_KV_BLOCK);
    pc_make_room(r, e, *need);
    q->fed = q->cached;
    r->co->pc_queries += q->P;
    r->co->pc_hits += q->cached;
    return K3_OK;
}

/* The blocks q completes in the step being formed join the cache (its reservation shrinks by
 * the blocks the cache now holds for it). */
static k3_status pc_advance(rank_ctx *r, req_run *q) {
    int moved;
    RTRY(r, rank_pc_advance(r->co->pc[q->lane], q->slot, q->prompt, q->P, q->gen,
                            q->fed + q->n_tok_step, &moved));
    q->blk_resv -= moved;
    r->co->lane_blk_free[q->lane] += moved;
    return K3_OK;
}

/* ---- forks: n > 1 choices of one prefill -------------------------------------------------- */
/* The prefill of p just returned its last logits (p has not sampled yet): its queued forks join
 * its lane and group in free slots, from a copy of its state (a FORK op in the lane's next
 * message, applied before that message's frees and OPEN resets), already past the prompt; they
 * sample from p's row (the caller). A fork with no slot or blocks there runs its own prefill.
 * Blocks: each fork reserves its context less the full prompt blocks, which the family shares
 * (one reservation, moved out of p's, returned when the last of them ends). */
static k3_status fork_children(rank_ctx *r, req_run *p, req_run **kids, int *n_kids) {
    struct rank_coord *C = r->co;
    const int e = p->lane;
    const int full = (int)(p->P / K3_KV_BLOCK);
    rank_pcache *pc = C->pc ? C->pc[e] : NULL;
    *n_kids = 0;
    for (int i = 0; i < C->n_reqs; i++) {
        req_run *q = C->reqs[i];
        if (q->state != RQ_QUEUED || q->fork_src != p) continue;
        q->fork_src = NULL;
        if (q->cancel) continue;                           /* the queue ends it */
        const int need = blocks_cover(q, q->P + 1) - full; /* its first token's block */
        int slot = 0;
        while (slot < r->max_seqs && slot_taken(r, e, slot)) slot++;
        if (slot == r->max_seqs || !pc_fits(r, e, need, 0) || C->n_fork_ops[e] >= r->max_seqs) {
            C->n_fork_fallbacks++; /* its own prefill, when the queue reaches it */
            continue;
        }
        if (!p->share) { /* the prompt blocks only the family holds move to the share */
            if (rank_alloc(r, RANK_ALLOC_FORK, (void **)&p->share, sizeof *p->share, true,
                           "the share of a forked family") != K3_OK) {
                char why[sizeof q->why];
                snprintf(why, sizeof why, "out of memory forking choice of request %lld: %.300s",
                         (long long)p->id, k3_last_error());
                RTRY(r, fail_req(r, q, K3_EVERR_RESOURCE, why));
                continue;
            }
            p->share->blocks = full - (pc ? rank_pc_chain(pc, p->slot) : 0);
            p->share->users = 1;
            p->blk_resv -= p->share->blocks;
        }
        p->share->users++;
        q->share = p->share;
        C->slot_req[(size_t)e * r->max_seqs + slot] = q;
        q->state = RQ_RUNNING;
        q->queued_s = k3_now_s() - q->t_submit;
        q->lane = e, q->slot = slot, q->group = p->group;
        q->opened = true; /* the FORK op opens it */
        q->fed = q->P;
        q->cached = p->cached;
        if (pc) {
            int64_t hit;
            RTRY(r, rank_pc_begin(pc, slot, q->prompt, q->P, false, &hit));
            rank_pc_fork(pc, p->slot, slot);
            pc_make_room(r, e, need);
        }
        C->lane_blk_free[e] -= need;
        q->blk_resv = need;
        q->cover = full + need;
        lane_forks(r, e)[C->n_fork_ops[e]++] = (rank_step_fork){.parent = p->slot, .child = slot};
        int32_t *pf = C->pend_free + (size_t)e * r->max_seqs; /* the fork replaces the free */
        for (int k = 0; k < C->n_pend_free[e]; k++)
            if (pf[k] == slot) pf[k--] = pf[--C->n_pend_free[e]];
        if (q->plp)
            memcpy(q->plp_lps, p->plp_lps, (size_t)K3_MAX(q->P - 1, 1) * sizeof *q->plp_lps);
        if (q->all_logits && q->prompt_logits && p->prompt_logits) {
            memcpy(q->prompt_logits, p->prompt_logits,
                   (size_t)p->prompt_rows * (size_t)r->cfg.vocab_size * sizeof(float));
            q->prompt_rows = p->prompt_rows;
        }
        kids[(*n_kids)++] = q;
        C->n_forks++;
    }
    return K3_OK;
}

/* q's tokens leave this step: back to its lane's budget. */
static void unstep(req_run *q, int64_t *bud, int64_t *total) {
    bud[q->lane] += q->n_tok_step;
    *total -= q->n_tok_step;
    q->n_tok_step = 0;
}

/* Running request v gives its blocks back and waits in the queue again (its place by submit
 * order: ahead of later arrivals); it is recomputed from its prompt and the tokens it generated
 * (want_tokens), the prefix cache's hits first. The stages free its slot with the lane's next
 * message. Its sampler keeps its state, so what it samples next is what it would have. */
static void preempt(rank_ctx *r, req_run *v, int64_t *bud, int64_t *total) {
    struct rank_coord *C = r->co;
    unstep(v, bud, total);
    slot_release(r, v->lane, v->slot, leave_slot(r, v));
    v->cover = 0;
    v->state = RQ_QUEUED;
    v->lane = v->group = v->slot = -1;
    v->fed = v->cached = 0;
    v->opened = false;
    C->n_preempt++;
}

/* q's tokens of this step need its books to cover fed + n_tok_step: take the blocks, preempting
 * the latest-arrived request of the group on its lane (never one a pending fork names, nor one
 * with a step in flight: only group g's) while the lane has no room. */
static k3_status grow(rank_ctx *r, req_run *q, int g, int64_t *bud, int64_t *total) {
    struct rank_coord *C = r->co;
    const int e = q->lane;
    for (;;) {
        const int need = blocks_cover(q, q->fed + q->n_tok_step) - q->cover;
        if (need <= 0) return K3_OK;
        if (q->cover + need > r->kv_blocks) { /* alone it would not fit: it ends here */
            unstep(q, bud, total);
            char why[200];
            snprintf(why, sizeof why,
                     "the sequence reached %lld tokens, its lane's whole paged cache "
                     "(--kv-cache-tokens)",
                     (long long)r->kv_blocks * K3_KV_BLOCK);
            return fail_req(r, q, K3_EVERR_CONTEXT, why);
        }
        if (pc_fits(r, e, need, 0)) {
            if (C->pc) pc_make_room(r, e, need);
            C->lane_blk_free[e] -= need;
            q->blk_resv += need;
            q->cover += need;
            return K3_OK;
        }
        req_run *v = NULL;
        for (int i = C->n_reqs - 1; i >= 0 && !v; i--) {
            req_run *c = C->reqs[i];
            if (c->state == RQ_RUNNING && c->group == g && c->lane == e &&
                !fork_names(r, e, c->slot))
                v = c;
        }
        if (!v) { /* nothing to preempt now: it sits this step out */
            unstep(q, bud, total);
            return K3_OK;
        }
        preempt(r, v, bud, total);
        if (v == q) return K3_OK;
    }
}

/* Form and send group g's next step; *sent false when it has nothing to do (it stays idle). */
static k3_status send_step(rank_ctx *r, int g, bool *sent) {
    *sent = false;
    const int E = r->plan.n_lanes;
    group_run *gr = &r->co->groups[g];
    /* cancelled running requests of this idle group end now */
    for (int i = 0; i < r->co->n_reqs; i++) {
        req_run *q = r->co->reqs[i];
        if (q->state == RQ_RUNNING && q->group == g && q->cancel) RTRY(r, finish_req(r, q));
    }
    enum { LANES_STACK = 64 };
    int64_t budget[LANES_STACK];
    int64_t *bud = E <= LANES_STACK ? budget : NULL;
    if (!bud) RTRY(r, k3_alloc((void **)&bud, (size_t)E * sizeof *bud, "lane budgets"));
    for (int e = 0; e < E; e++) bud[e] = r->max_tokens;
    int64_t total = 0;
    for (int i = 0; i < r->co->n_reqs; i++) r->co->reqs[i]->n_tok_step = 0;
    /* decode rows first, then prefill chunks, in request order */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < r->co->n_reqs; i++) {
            req_run *q = r->co->reqs[i];
            if (q->state != RQ_RUNNING || q->group != g) continue;
            bool decode = q->fed >= q->P;
            if (decode != (pass == 0)) continue;
            int64_t n = pc_cut(r, q, K3_MIN(K3_MIN(want_tokens(r, q), r->chunk), bud[q->lane]));
            q->n_tok_step = n;
            bud[q->lane] -= n;
            total += n;
        }
    /* the blocks the step's tokens need, oldest request first; one that cannot get them preempts
       the latest to arrive on its lane (itself, when that is it) */
    for (int i = 0; i < r->co->n_reqs; i++) {
        req_run *q = r->co->reqs[i];
        if (q->state != RQ_RUNNING || q->group != g || q->n_tok_step == 0) continue;
        RTRY(r, grow(r, q, g, bud, &total));
    }
    /* queued requests join (FIFO): the least-loaded lane with a free slot and budget left */
    for (int i = 0; i < r->co->n_reqs; i++) {
        req_run *q = r->co->reqs[i];
        if (q->state != RQ_QUEUED) continue;
        if (q->cancel) {
            RTRY(r, finish_req(r, q));
            continue;
        }
        if (q->fork_src) continue; /* waits for its parent's prefill (fork_children) */
        int best = -1, best_n = 0;
        int64_t best_hit = 0;
        int need = blocks_cover(q, q->P + q->n_gen); /* its prompt (and any tokens it had) */
        for (int e = 0; e < E; e++) { /* the longest cached prefix, then the least load */
            int n = lane_running(r, e), unused = 0;
            if (bud[e] < 1 || n >= r->max_seqs) continue;
            const int64_t hit = r->co->pc && pc_may_hit(q)
                                    ? rank_pc_lookup(r->co->pc[e], q->prompt, q->P, &unused)
                                    : 0;
            if (!pc_fits(r, e, need - (int)(hit / K3_KV_BLOCK), unused)) continue;
            if (best < 0 || hit > best_hit || (hit == best_hit && n < best_n))
                best = e, best_n = n, best_hit = hit;
        }
        if (best < 0) break; /* strict FIFO: later requests wait behind this one */
        int slot = 0;
        while (slot_taken(r, best, slot)) slot++;
        r->co->slot_req[(size_t)best * r->max_seqs + slot] = q;
        q->state = RQ_RUNNING;
        q->queued_s = k3_now_s() - q->t_submit;
        q->lane = best, q->slot = slot, q->group = g, q->opened = false;
        if (r->co->pc) RTRY(r, pc_join(r, q, best, &need));
        r->co->lane_blk_free[best] -= need;
        q->blk_resv = need;
        int64_t n = pc_cut(r, q, K3_MIN(K3_MIN(q->P - q->fed, r->chunk), bud[best]));
        q->n_tok_step = n;
        bud[best] -= n;
        total += n;
    }
    if (bud != budget) k3_free(bud);
    if (total == 0) return K3_OK;
    gr->step++;
    gr->pending = E;
    r->co->n_steps++;
    struct rank_coord *C = r->co;
    const bool moe_host = round_moe_host(r, g, E);
    for (int e = 0; e < E; e++) {
        rank_step m = {.group = g, .step = gr->step, .moe_host = moe_host};
        rank_step_seq *seqs = C->step_seqs;
        int ns = 0;
        int64_t T = 0;
        for (int s = 0; s < r->max_seqs; s++) {
            req_run *q = C->slot_req[(size_t)e * r->max_seqs + s];
            if (!q || q->group != g || q->n_tok_step == 0) continue;
            int flags = q->opened ? 0 : K3_WIRE_OPEN;
            q->opened = true;
            if (q->fed + q->n_tok_step == q->P + q->n_gen && q->n_gen < q->max_tokens)
                flags |= K3_WIRE_WANT; /* every token it has is in: its next one is sampled */
            if (q->plp && q->fed < q->P) flags |= K3_WIRE_PLP; /* a prefill chunk: prompt rows */
            m.all_logits |= q->all_logits && q->fed < q->P;
            seqs[ns++] =
                (rank_step_seq){.slot = s, .n_tokens = (int32_t)q->n_tok_step, .flags = flags};
            T += q->n_tok_step;
        }
        m.n_seqs = ns, m.seqs = seqs;
        m.n_freed = C->n_pend_free[e], m.freed = C->pend_free + (size_t)e * r->max_seqs;
        for (int j = 0; j < ns && C->pc; j++)
            RTRY(r, pc_advance(r, C->slot_req[(size_t)e * r->max_seqs + seqs[j].slot]));
        m.n_forks = C->n_fork_ops[e], m.forks = lane_forks(r, e);
        if (C->pc) rank_pc_ops(C->pc[e], &m);
        int32_t *tok = C->step_tokens, *tgt = C->step_targets; /* PLP targets: one per row */
        for (int j = 0; j < ns; j++) {
            req_run *q = C->slot_req[(size_t)e * r->max_seqs + seqs[j].slot];
            const bool plp = seqs[j].flags & K3_WIRE_PLP;
            for (int64_t t = 0; t < q->n_tok_step; t++) {
                int64_t pos = q->fed + t;
                *tok++ = pos < q->P ? q->prompt[pos] : q->gen[pos - q->P];
                if (plp) *tgt++ = pos + 1 < q->P ? q->prompt[pos + 1] : -1;
            }
            q->fed += q->n_tok_step;
            C->prompt_tokens += K3_MAX(0, K3_MIN(q->fed, q->P) - (q->fed - q->n_tok_step));
        }
        m.n_tokens = (int32_t)T, m.tokens = C->step_tokens;
        m.n_targets = (int32_t)(tgt - C->step_targets), m.targets = C->step_targets;
        m.n_pad = moe_host ? 0 : graph_rows(r, &m);
        RTRY(r, rank_post_step(r, k3_plan_rank(&r->plan, 0, e), K3_MSG_BATCH,
                               (k3_wire_step){.T = T}, &m, NULL, 0));
        C->n_pend_free[e] = 0, C->n_fork_ops[e] = 0; /* sent */
        if (C->pc) rank_pc_ops_clear(C->pc[e]);
        release_holds(r, e); /* this message applies the forks they were held for */
    }
    *sent = true;
    return K3_OK;
}

/* ---- logits -> tokens --------------------------------------------------------------------- */
/* log-softmax of the sampler's processed logits (bias, penalties): the chosen id's logprob and
 * the top n. */
static k3_status logprobs(rank_ctx *r, req_run *q, const float *logits, k3_event *e) {
    const int64_t V = r->cfg.vocab_size;
    RTRY(r, k3_sampler_process_logits(q->smp, logits, r->co->row));
    const int n = q->logprobs > 0 ? (int)K3_MIN((int64_t)q->logprobs, V) : 0;
    const double lz = rank_log_softmax_top(r->co->row, V, n, e->top_ids);
    e->logprob = (float)((double)r->co->row[e->token] - lz);
    e->n_top = n;
    for (int k = 0; k < n; k++)
        e->top_logprobs[k] = (float)((double)r->co->row[e->top_ids[k]] - lz);
    return K3_OK;
}

/* The prompt logprob records of q's nt rows of a step (wire.h) into q->plp_lps. */
static void take_plp(req_run *q, const float *rec, int64_t nt) {
    const int64_t p0 = q->fed - nt; /* position of the step's first row */
    for (int64_t t = 0; t < nt; t++, rec += K3_PLP_REC) {
        if (p0 + t + 1 >= q->P) continue; /* its target is not a prompt token */
        k3_prompt_lp *lp = &q->plp_lps[p0 + t];
        lp->logprob = rec[0];
        lp->rank = (int32_t)rec[1];
        lp->n_top = q->plp_top;
        for (int k = 0; k < q->plp_top; k++) {
            lp->top_ids[k] = (int32_t)rec[2 + k];
            lp->top_logprobs[k] = rec[2 + K3_PLP_TOP + k];
        }
    }
}

/* The row is finite: the last stage checked it (k3_batch.nonfinite) and a non-finite row came
 * back as the NF flag, which failed its request before this. */
static k3_status sample(rank_ctx *r, req_run *q, const float *logits) {
    const int64_t V = r->cfg.vocab_size;
    int32_t id;
    if (rank_hooks_forced(r, q->n_gen, &id)) { /* test hook K3_TEST_FORCE */
    } else if (k3_sampler_sample(q->smp, logits, &id) != K3_OK) {
        char why[300];
        snprintf(why, sizeof why, "sampling failed: %s", k3_last_error());
        return fail_req(r, q, K3_EVERR_SAMPLING, why);
    }
    k3_event ev = {.token = id, .logprob = NAN};
    if (q->logprobs > 0)
        RTRY(r, logprobs(r, q, logits, &ev)); /* before accept: this row's history */
    q->gen[q->n_gen++] = id;
    r->co->gen_tokens++;
    if (k3_sampler_accept(q->smp, id, r->o->tok ? &q->text : NULL, &q->stop) != K3_OK) {
        char why[300];
        snprintf(why, sizeof why, "sampling failed: %s", k3_last_error());
        return fail_req(r, q, K3_EVERR_SAMPLING, why);
    }
    if (q->stop == K3_STOP_STRING) q->stop_string = k3_sampler_matched_stop(q->smp);
    float *row = NULL; /* the event's memory first: without it the request fails alone */
    char *t = NULL;
    size_t nt = 0;
    if ((q->keep_logits && ev_alloc(r, (size_t)V * sizeof(float), (void **)&row) != K3_OK) ||
        ev_text(r, q, &t, &nt) != K3_OK)
        return fail_nomem(r, q);
    k3_event *e;
    RTRY(r, ev_push(r, K3_EV_TOKEN, q, &e));
    e->token = id;
    e->logprob = ev.logprob;
    e->n_top = ev.n_top;
    memcpy(e->top_ids, ev.top_ids, sizeof e->top_ids);
    memcpy(e->top_logprobs, ev.top_logprobs, sizeof e->top_logprobs);
    if (row) memcpy(row, logits, (size_t)V * sizeof(float));
    e->logits = row;
    if (q->n_gen == 1) ev_prompt_logits(e, q);
    e->text = t, e->n_text = nt;
    if (q->stop != K3_STOP_NONE || q->n_gen >= q->max_tokens)
        RTRY(r, finish_req(r, q)); /* DONE carries the text held back for a stop string, if any */
    return K3_OK;
}

static k3_status on_logits(rank_ctx *r, const step_msg *m) {
    const int64_t V = r->cfg.vocab_size;
    const rank_step *mt = &m->st;
    int src_stage = -1, e = -1;
    k3_plan_coords(&r->plan, m->src, &src_stage, &e);
    const int g = mt->group, stepi = mt->step, all = mt->all_logits, ns = mt->n_seqs;
    if (src_stage != r->plan.n_stages - 1 || g < 0 || g >= r->co->n_groups ||
        stepi != r->co->groups[g].step || r->co->groups[g].pending <= 0 ||
        mt->n_busy_us != r->plan.n_stages)
        RTRY(r,
             K3_ERR(K3_ERR_FORMAT,
                    "LOGITS from rank %d (stage %d): group %d step %d (expected step %d), %d "
                    "sequences, %d busy times",
                    m->src, src_stage, g, stepi,
                    g >= 0 && g < r->co->n_groups ? r->co->groups[g].step : -1, ns, mt->n_busy_us));
    if (mt->n_pad > 0 && mt->n_pad <= r->max_seqs && mt->graph_fell &&
        !r->co->graph_off[mt->n_pad]) {
        r->co->graph_off[mt->n_pad] = true; /* every rank runs that size eagerly from now on */
        K3_LOGW("a stage of lane %d could not capture a decode step of %d rows as a CUDA graph: "
                "steps of that size run eagerly from now on",
                e, mt->n_pad);
    }
    int64_t T = 0, n_want = 0, n_plp = 0;
    for (int j = 0; j < ns; j++) {
        const int nt = mt->seqs[j].n_tokens, fl = mt->seqs[j].flags;
        if (nt < 1) /* the rows below are found by these counts */
            RTRY(r, K3_ERR(K3_ERR_FORMAT, "LOGITS from rank %d: sequence %d of %d tokens", m->src,
                           j, nt));
        T += nt, n_want += (fl & K3_WIRE_WANT) != 0, n_plp += (fl & K3_WIRE_PLP) ? nt : 0;
    }
    int64_t R = all ? T : n_want;
    if (m->h.D != V || m->h.R != R || m->n_f32 != R * V + n_plp * K3_PLP_REC ||
        mt->n_targets != n_plp)
        RTRY(r, K3_ERR(K3_ERR_FORMAT,
                       "LOGITS from rank %d: [%lld, %lld] rows + %lld floats, want [%lld, %lld] + "
                       "%lld prompt logprob records",
                       m->src, (long long)m->h.R, (long long)m->h.D,
                       (long long)(m->n_f32 - m->h.R * m->h.D), (long long)R, (long long)V,
                       (long long)n_plp));
    const float *plp_rec = m->f32 + R * V;
    r->co->logits_bytes += m->n_bytes;
    r->co->n_logits_msgs++;
    const int32_t *busy_us = mt->busy_us; /* per stage of lane e (wire.h) */
    for (int s = 0; s < r->plan.n_stages; s++) {
        int w = k3_plan_rank(&r->plan, s, e);
        r->co->rank_busy_s[w] += busy_us[s] * 1e-6;
        r->co->rank_steps[w]++;
    }
    if (!r->worker) rank_hooks_step(r, r->co->n_logits_msgs);
    int64_t row = 0;
    for (int j = 0; j < ns; j++) {
        const int slot = mt->seqs[j].slot, nt = mt->seqs[j].n_tokens, fl = mt->seqs[j].flags;
        const bool want = (fl & K3_WIRE_WANT) != 0;
        req_run *q = slot >= 0 && slot < r->max_seqs
                         ? r->co->slot_req[(size_t)e * r->max_seqs + (size_t)slot]
                         : NULL;
        if (!q || q->group != g)
            RTRY(r, K3_ERR(K3_ERR_FORMAT, "LOGITS from rank %d: lane %d slot %d is not in use",
                           m->src, e, slot));
        if (nt > q->fed) /* more rows than it was sent: its prompt rows would land before 0 */
            RTRY(r, K3_ERR(K3_ERR_FORMAT, "LOGITS from rank %d: %d rows for slot %d, fed %lld",
                           m->src, nt, slot, (long long)q->fed));
        const float *last = NULL;
        if (fl & K3_WIRE_PLP) {
            take_plp(q, plp_rec, nt);
            plp_rec += (int64_t)nt * K3_PLP_REC;
        }
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
            RTRY(r, finish_req(r, q));
            continue;
        }
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
            RTRY(r, fail_req(r, q, K3_EVERR_NUMERIC, why));
            continue;
        }
        if (want) {
            int n_kids = 0;
            if (q->n_gen == 0) RTRY(r, fork_children(r, q, r->co->kids, &n_kids));
            RTRY(r, sample(r, q, last));
            for (int k = 0; k < n_kids; k++) RTRY(r, sample(r, r->co->kids[k], last));
        } else if (q->max_tokens == 0 && q->fed >= q->P)
            RTRY(r, finish_req(r, q)); /* prefill only: done when the prompt is in */
    }
    r->co->groups[g].pending--;
    return K3_OK;
}

/* ---- the loop ----------------------------------------------------------------------------- */
static k3_status coord_create(rank_ctx *r, struct rank_coord *C) {
    const int E = r->plan.n_lanes;
    /* stop ids of every request unless ignore_eos: EOS of the config, <|end_of_msg|>, [EOS] */
    C->base_stops[0] = r->cfg.eos_token_id;
    C->base_stops[1] = C->base_stops[2] = -1;
    if (r->o->tok) {
        k3_tok_ctrl c = k3_tok_control_ids(r->o->tok);
        C->base_stops[1] = c.end_of_msg;
        C->base_stops[2] = c.eos;
    }
    for (int i = 0; i < 3; i++)
        if (C->base_stops[i] >= r->cfg.vocab_size) C->base_stops[i] = -1;
    C->n_groups = r->o->micro_batches > 0 ? r->o->micro_batches : K3_MAX(1, r->plan.n_stages);
    RTRY(r, k3_calloc((void **)&C->groups, (size_t)C->n_groups * sizeof *C->groups, "groups"));
    RTRY(r, k3_calloc((void **)&C->slot_req, (size_t)E * (size_t)r->max_seqs * sizeof *C->slot_req,
                      "slot table"));
    if (r->pc_on) {
        RTRY(r, k3_calloc((void **)&C->pc, (size_t)E * sizeof *C->pc, "prefix caches"));
        for (int e = 0; e < E; e++) RTRY(r, rank_pc_create(&r->pc, &C->pc[e]));
    }
    RTRY(r, k3_calloc((void **)&C->lane_blk_free, (size_t)E * sizeof(int), "lane cache blocks"));
    RTRY(r, k3_calloc((void **)&C->n_pend_free, (size_t)E * sizeof(int), "lane freed slots"));
    RTRY(r, k3_calloc((void **)&C->pend_free, (size_t)E * (size_t)r->max_seqs * sizeof(int32_t),
                      "lane freed slot lists"));
    for (int e = 0; e < E; e++) C->lane_blk_free[e] = r->kv_blocks;
    RTRY(r, k3_calloc((void **)&C->fork_ops, (size_t)E * (size_t)r->max_seqs * sizeof *C->fork_ops,
                      "fork ops"));
    RTRY(r, k3_calloc((void **)&C->n_fork_ops, (size_t)E * sizeof(int), "lane fork ops"));
    RTRY(r, k3_alloc((void **)&C->slot_hold, (size_t)E * (size_t)r->max_seqs * sizeof(int),
                     "slot holds"));
    for (int i = 0; i < E * r->max_seqs; i++) C->slot_hold[i] = -1;
    RTRY(r, k3_calloc((void **)&C->kids, (size_t)r->max_seqs * sizeof *C->kids, "fork scratch"));
    RTRY(r, k3_alloc((void **)&C->step_seqs, (size_t)r->max_seqs * sizeof *C->step_seqs,
                     "step sequences"));
    RTRY(r, k3_alloc((void **)&C->step_tokens, (size_t)r->max_tokens * sizeof(int32_t),
                     "step token ids"));
    RTRY(r, k3_alloc((void **)&C->step_targets, (size_t)r->max_tokens * sizeof(int32_t),
                     "step prompt-logprob targets"));
    RTRY(r, k3_alloc((void **)&C->row, (size_t)r->cfg.vocab_size * sizeof(float), "logprob row"));
    RTRY(r, k3_calloc((void **)&C->rank_busy_s, (size_t)r->world * sizeof *C->rank_busy_s,
                      "per-rank busy time"));
    RTRY(r, k3_calloc((void **)&C->rank_steps, (size_t)r->world * sizeof *C->rank_steps,
                      "per-rank steps"));
    C->last_progress = k3_now_s();
    return K3_OK;
}

k3_status rank_coord_init(rank_ctx *r) {
    RTRY(r, k3_calloc((void **)&r->co, sizeof *r->co, "coordinator"));
    r->co->graphs = !r->o->no_cuda_graphs && r->o->backend && strcmp(r->o->backend, "cuda") == 0;
    RTRY(r, k3_calloc((void **)&r->co->graph_off, (size_t)r->max_seqs + 1, "captured sizes"));
    return coord_create(r, r->co);
}

/* Free what the previous step's events pointed to, and the requests they ended. */
static void clear_events(struct rank_coord *C) {
    for (int i = 0; i < C->n_ev_mem; i++) C->ev_mem[i].used = 0;
    C->ev_cur = 0;
    C->n_ev = 0;
    int k = 0;
    for (int i = 0; i < C->n_reqs; i++) {
        req_run *q = C->reqs[i];
        if (q->state == RQ_ENDED && !q->refused)
            free_req(q);
        else
            C->reqs[k++] = q;
    }
    C->n_reqs = k;
}

void rank_coord_destroy(rank_ctx *r) {
    struct rank_coord *C = r->co;
    if (!C) return;
    clear_events(C);
    for (int i = 0; i < C->n_reqs; i++) free_req(C->reqs[i]);
    for (int i = 0; i < C->n_ev_mem; i++) k3_free(C->ev_mem[i].data);
    free(C->reqs), free(C->ev), free(C->ev_mem);
    k3_free(C->groups), k3_free(C->slot_req), k3_free(C->row);
    k3_free(C->step_seqs), k3_free(C->step_tokens), k3_free(C->step_targets);
    k3_free(C->lane_blk_free), k3_free(C->n_pend_free), k3_free(C->pend_free);
    k3_free(C->rank_busy_s), k3_free(C->rank_steps), k3_free(C->graph_off);
    k3_free(C->fork_ops), k3_free(C->n_fork_ops), k3_free(C->slot_hold), k3_free(C->kids);
    for (int e = 0; C->pc && e < r->plan.n_lanes; e++) rank_pc_destroy(C->pc[e]);
    k3_free(C->pc);
    k3_free(C);
    r->co = NULL;
}

void rank_coord_cancel_all(rank_ctx *r) {
    for (int i = 0; i < r->co->n_reqs; i++)
        if (r->co->reqs[i]->state != RQ_ENDED) r->co->reqs[i]->cancel = true;
}

bool rank_coord_in_flight(const rank_ctx *r) {
    for (int g = 0; g < r->co->n_groups; g++)
        if (r->co->groups[g].pending > 0) return true;
    return false;
}

void rank_coord_stats(const rank_ctx *r, k3_engine_stats *out) {
    const struct rank_coord *C = r->co;
    out->micro_batches = C->n_groups;
    out->prompt_tokens = C->prompt_tokens;
    out->gen_tokens = C->gen_tokens;
    out->steps = (int64_t)C->n_steps;
    out->logits_bytes = C->logits_bytes;
    out->logits_messages = C->n_logits_msgs;
    out->prefix_cache = C->pc != NULL;
    out->prefix_queries = C->pc_queries;
    out->prefix_hits = C->pc_hits;
    out->prefix_blocks = out->prefix_blocks_max = out->prefix_evictions = 0;
    out->forks = C->n_forks, out->fork_fallbacks = C->n_fork_fallbacks;
    out->preemptions = C->n_preempt;
    out->kv_blocks = (int64_t)r->kv_blocks * r->plan.n_lanes;
    out->kv_blocks_reserved = out->kv_blocks;
    for (int e = 0; e < r->plan.n_lanes; e++) out->kv_blocks_reserved -= C->lane_blk_free[e];
    for (int e = 0; C->pc && e < r->plan.n_lanes; e++) {
        out->prefix_blocks += rank_pc_blocks(C->pc[e]);
        out->prefix_evictions += rank_pc_evictions(C->pc[e]);
        out->prefix_blocks_max += r->pc.n_entries;
    }
}

bool rank_coord_rank_busy(const rank_ctx *r, int w, double *busy_s, uint64_t *steps) {
    if (!r->co || !r->co->rank_busy_s) return false;
    *busy_s = r->co->rank_busy_s[w];
    *steps = r->co->rank_steps[w];
    return true;
}

/* The coordinator waited --comm-timeout for logits: start the fault exchange (it finds the root
 * cause) and return the fault. */
static k3_status logits_timeout(rank_ctx *r, double timeout) {
    const struct rank_coord *C = r->co;
    int g = 0;
    while (g < C->n_groups && C->groups[g].pending == 0) g++;
    /* the lanes of the last stage owe the logits */
    int waited[K3_FAULT_MAX_WAITS], n = 0;
    for (int e = 0; e < r->plan.n_lanes; e++) {
        if (n < K3_FAULT_MAX_WAITS) waited[n] = k3_plan_rank(&r->plan, r->plan.n_stages - 1, e);
        n++;
    }
    char what[160];
    snprintf(what, sizeof what, "the logits of micro-batch %d step %d (%d of %d lanes missing)", g,
             C->groups[g].step, C->groups[g].pending, r->plan.n_lanes);
    k3_comm_note_timeout(r->comm, waited, n, what, k3_now_s() - C->last_progress);
    return rank_fail(
        r, K3_ERR(K3_ERR_COMM,
                  "coordinator: no logits for micro-batch %d step %d (%d of %d lanes of the last "
                  "stage, ranks %d-%d, missing) within %.0f s (--comm-timeout)",
                  g, C->groups[g].step, C->groups[g].pending, r->plan.n_lanes,
                  k3_plan_rank(&r->plan, r->plan.n_stages - 1, 0),
                  k3_plan_rank(&r->plan, r->plan.n_stages - 1, r->plan.n_lanes - 1), timeout));
}

k3_status rank_coord_step(rank_ctx *r, const k3_event **events, int *n_events) {
    struct rank_coord *C = r->co;
    *events = NULL;
    *n_events = 0;
    clear_events(C);
    /* room for every event this call can make (each request: at most a TOKEN and its end), so
       that ending a request never needs memory */
    if (C->cap_ev < 2 * C->n_reqs + 16) {
        const int cap = 2 * C->n_reqs + 64;
        k3_event *ev = realloc(C->ev, (size_t)cap * sizeof *ev);
        if (!ev) RTRY(r, K3_ERR(K3_ERR_NOMEM, "event table of %d", cap));
        C->ev = ev, C->cap_ev = cap;
    }
    for (int i = 0; i < C->n_reqs; i++) { /* requests refused at submit */
        req_run *q = C->reqs[i];
        if (q->refused) {
            q->refused = false;
            RTRY(r, fail_req(r, q, q->error_kind, q->why));
        }
    }
    const double timeout = rank_comm_timeout(r);
    int backoff = 0;
    for (;;) {
        RTRY(r, k3_comm_beat(r->comm)); /* rate-limited inside: every --comm-timeout / 3 */
        bool progressed = false, did = false;
        step_msg m;
        bool got;
        RTRY(r, rank_poll_step(r, K3_ANY_RANK, K3_MSG_LOGITS, &m, &got));
        if (got) {
            RTRY(r, on_logits(r, &m));
            progressed = true;
        }
        if (r->worker) RTRY(r, rank_worker_poll(r, &did));
        progressed |= did;
        for (int g = 0; g < C->n_groups; g++) {
            bool sent = false;
            if (C->groups[g].pending == 0) RTRY(r, send_step(r, g, &sent));
            progressed |= sent;
        }
        if (progressed) {
            C->last_progress = k3_now_s();
            backoff = 0;
        }
        /* nothing in flight and no events: if requests wait, no step could take them (cannot
           happen: an idle group always admits the queue head); otherwise there is nothing to do */
        if (C->n_ev > 0 || !rank_coord_in_flight(r)) break;
        if (progressed) continue;
        if (k3_now_s() - C->last_progress > timeout) return logits_timeout(r, timeout);
        k3_comm_idle(r->comm, &backoff);
    }
    *events = C->ev;
    *n_events = C->n_ev;
    return K3_OK;
}
