/* worker.c — the stage worker of a lane, and the wire protocol of a step.
 *
 * Wire usage (all messages through comm/, tag = kind; payload layouts and K3_WIRE_VERSION in
 * wire.h; each message's meta is one k3_wire_step, then a rank_step, encoded and decoded only in
 * wire.c):
 *   BATCH  coordinator -> (stage 0, lane e): the step's sequences (slot, n_tokens, flags), freed
 *          slots, forks, prefix-cache ops and token ids; flags: OPEN (a new sequence in the slot:
 *          reset it), WANT (its last row is sampled), NF, PLP
 *   ACTIV  (s, e) -> (s+1, e): the same sequences and ops (no token ids), and the busy
 *          microseconds of each of the lane's S stages in this step; f32 = h [T, D] | bank
 *          [n_bank, T, D]
 *   LOGITS (S-1, e) -> coordinator: meta as ACTIV; f32 = [R, V] with R = T (all_logits) or the
 *          number of sequences with WANT (those the coordinator samples from), then one prompt
 *          logprob record per row of a PLP sequence (wire.h)
 * Every message carries the target ids of its PLP sequences' rows, stage to stage to the last
 * one, which needs them for the records.
 *   STOP   coordinator -> every worker, after the last logits arrived.
 * The freed slots are sequences that ended: each stage returns their cache blocks to its pool
 * before the step, then the prefix cache's evictions, then the forks (n > 1 choices of one
 * prefill: a child slot becomes a copy of its parent's, shared full blocks, a copied partial
 * block and KDA states). The other prefix-cache ops (rank/prefix_cache.h): hits before the
 * forward (after the OPEN resets), saved blocks and snapshots after it. A NaN/Inf in a sequence's
 * rows sets its NF flag with the first sub-block that produced one (k3_nf_code), carried on to the
 * coordinator, which fails that request alone. With a transport that has device payloads (nccl) and
 * a device backend, ACTIV carries only its meta and the floats follow it backend to backend
 * (k3_comm_send_dev / recv_dev), so activations never cross to the host between stages. Every lane
 * of a stage receives the same sequence of (group, step) messages (possibly with no sequences), so
 * the lanes' MoE collectives line up; a lane with no tokens still serves its experts at each MoE
 * layer (k3_stage_idle_step). Every message names its round's MoE route (moe_host, rank 0's
 * decision for every lane alike: host-routed with any prefill row), set on the stage before its
 * forward (k3_stage_set_moe_host). The stage drives the MoE step itself through the comm handle it
 * is given; rank only builds the lane map and moves messages. Activations, caches and logits live
 * in the rank's backend; they cross to host memory only by k3_backend_download/upload at a message
 * boundary. The loop allocates nothing per step: buffers are sized from the plan's max_tokens up
 * front (comm buffers grow to the largest message once). A step is four steps: decode the message
 * (check it, free the ended slots, bind the sequences), upload (the activations in), forward, send
 * (the activations or the logits on).
 */
#include "rank_internal.h"

#include <math.h>

/* The worker of a lane: its stage, sequence slots, activations and step scratch. */
struct rank_worker {
    k3_stage *st;
    k3_seq_state **states; /* [max_seqs] this lane's slots */
    k3_activ act;
    float *logits;    /* [max_tokens, V] on the last stage (backend memory) */
    float *h_logits;  /* host staging of logits (NULL: the backend is host-visible) */
    float *plp;       /* [max_tokens, K3_PLP_REC] prompt logprob records (last stage) */
    float *h_act;     /* host staging of h | bank for ACTIV (NULL: host-visible, or dev_act) */
    bool dev_act;     /* ACTIV floats go backend to backend (k3_comm_send_dev: nccl) */
    bool graphs;      /* the stage captures decode steps (--cuda-graphs on, a cuda backend) */
    int32_t *lane_of; /* [n_layers * n_experts] owner lane of each (layer, expert) */
    int n_forward;
    double busy_s;          /* time inside forward steps */
    k3_seq_state **bstates; /* [max_seqs] batch scratch */
    int32_t *bntok;         /* [max_seqs] */
    int32_t *bnf;           /* [max_seqs] k3_batch.nonfinite */
    rank_step_seq *wseqs;   /* [max_seqs] the sequences sent on (their NF flags this stage's) */
    int32_t *wbusy;         /* [S] the busy times sent on */
    int32_t *pc_blk;        /* [pc.n_entries] this stage's block of each prefix-cache entry (-1) */
    bool serving;           /* no STOP yet */
    int in_peer;            /* where this worker's steps come from */
    k3_msg_kind in_kind;
};

/* One step as its message decoded it. */
typedef struct wstep {
    const step_msg *m;
    const rank_step *in; /* the received meta */
    const char *who;     /* "rank N": the sender, for errors */
    int64_t T;           /* tokens of this lane in the step */
    int64_t rows;        /* rows of the activation: T, or n_pad in a captured decode step */
    bool fell;           /* this stage could not capture the step (it ran eagerly) */
    int64_t n_tgt;       /* rows of its PLP sequences (their target ids ride in the meta) */
    double busy_s;       /* this stage's forward time */
} wstep;

/* ---- set-up ------------------------------------------------------------------------------- */
static k3_status worker_create(rank_ctx *r, struct rank_worker *w) {
    const k3_engine_opts *o = r->o;
    const k3_config *c = &r->cfg;
    int S = r->plan.n_stages, E = r->plan.n_lanes;
    const bool moe_remote = E > 1;
    if (moe_remote) { /* the owner lane of every (layer, expert) of this stage */
        RTRY(r, k3_calloc((void **)&w->lane_of,
                          (size_t)c->n_layers * (size_t)K3_MAX(c->n_experts, 1) * sizeof(int32_t),
                          "expert lane map"));
        for (int l = r->plan.stage_begin[r->stage]; l < r->plan.stage_begin[r->stage + 1]; l++)
            if (k3_config_is_moe(c, l))
                for (int x = 0; x < c->n_experts; x++)
                    w->lane_of[(size_t)l * (size_t)c->n_experts + (size_t)x] =
                        k3_plan_owner_lane(&r->plan, l, x);
    }
    k3_stage_params sp = {.cfg = c,
                          .w = r->view,
                          .be = r->be,
                          .layer_begin = r->plan.stage_begin[r->stage],
                          .layer_end = r->plan.stage_begin[r->stage + 1],
                          .first = r->stage == 0,
                          .last = r->stage == S - 1,
                          .max_tokens = r->max_tokens,
                          .kda_chunk = o->kda_chunk,
                          .comm = moe_remote ? r->comm : NULL,
                          .expert_lane = w->lane_of,
                          .n_lanes = E,
                          .deterministic = o->deterministic,
                          .max_seqs = r->max_seqs,
                          .max_ctx = r->max_ctx,
                          .kv_cache_tokens = (int64_t)r->kv_blocks * K3_KV_BLOCK,
                          .n_snapshots = r->pc_on ? r->pc.n_snaps : 0,
                          .graphs = !o->no_cuda_graphs && k3_backend_has_graphs(r->be)};
    RTRY(r, k3_stage_create(&sp, &w->st));
    w->graphs = sp.graphs;
    if (r->pc_on) {
        RTRY(r, k3_alloc((void **)&w->pc_blk, (size_t)r->pc.n_entries * sizeof(int32_t),
                         "prefix-cache blocks"));
        for (int i = 0; i < r->pc.n_entries; i++) w->pc_blk[i] = -1;
    }
    /* the lane's sequence slots: allocated once, reset when a new sequence opens in them */
    const size_t ns = (size_t)r->max_seqs;
    RTRY(r, k3_calloc((void **)&w->states, ns * sizeof *w->states, "sequence slots"));
    RTRY(r, k3_calloc((void **)&w->bstates, ns * sizeof *w->bstates, "batch states"));
    RTRY(r, k3_calloc((void **)&w->bntok, ns * sizeof *w->bntok, "batch tokens"));
    RTRY(r, k3_calloc((void **)&w->bnf, ns * sizeof *w->bnf, "batch non-finite marks"));
    RTRY(r, k3_calloc((void **)&w->wseqs, ns * sizeof *w->wseqs, "step sequences (out)"));
    RTRY(r, k3_calloc((void **)&w->wbusy, (size_t)r->plan.n_stages * sizeof *w->wbusy,
                      "step busy times (out)"));
    for (int i = 0; i < r->max_seqs; i++)
        RTRY(r, k3_seq_state_create(w->st, r->max_ctx, &w->states[i]));
    w->serving = true;
    w->in_peer = r->stage == 0 ? 0 : k3_plan_rank(&r->plan, r->stage - 1, r->lane);
    w->in_kind = r->stage == 0 ? K3_MSG_BATCH : K3_MSG_ACTIV;
    RTRY(r, k3_activ_alloc(r->be, &w->act, c, r->max_tokens));
    const size_t TD = (size_t)r->max_tokens * (size_t)c->hidden_size;
    const bool host = k3_backend_host_visible(r->be);
    w->dev_act = !host && k3_comm_device_payloads(r->comm);
    if (r->stage == S - 1) {
        size_t nb = (size_t)r->max_tokens * (size_t)c->vocab_size * sizeof(float);
        RTRY(r, k3_backend_alloc(r->be, nb, "logits", (void **)&w->logits));
        RTRY(r, k3_alloc((void **)&w->plp, (size_t)r->max_tokens * K3_PLP_REC * sizeof(float),
                         "prompt logprobs"));
        if (!host) RTRY(r, k3_alloc((void **)&w->h_logits, nb, "logits (host)"));
        if (w->h_logits) k3_stage_set_logits_host(w->st, w->h_logits);
    } else if (!host && !w->dev_act) {
        RTRY(r,
             k3_alloc((void **)&w->h_act, TD * (size_t)(1 + k3_activ_max_bank(c)) * sizeof(float),
                      "activation staging (host)"));
    }
    return K3_OK;
}

k3_status rank_worker_init(rank_ctx *r) {
    RTRY(r, k3_calloc((void **)&r->wk, sizeof *r->wk, "worker"));
    return worker_create(r, r->wk);
}

void rank_worker_destroy(rank_ctx *r) {
    struct rank_worker *w = r->wk;
    if (!w) return;
    if (w->states)
        for (int i = 0; i < r->max_seqs; i++) k3_seq_state_destroy(w->states[i]);
    k3_free(w->states), k3_free(w->bstates), k3_free(w->bntok), k3_free(w->bnf), k3_free(w->wseqs);
    k3_free(w->wbusy);
    if (r->be) {
        k3_activ_free(r->be, &w->act);
        k3_backend_free(r->be, w->logits);
    }
    k3_free(w->h_logits), k3_free(w->h_act), k3_free(w->lane_of), k3_free(w->plp);
    k3_free(w->pc_blk);
    k3_stage_destroy(w->st);
    k3_free(w);
    r->wk = NULL;
}

void rank_worker_busy(const rank_ctx *r, int *n_forward, double *busy_s) {
    *n_forward = r->wk ? r->wk->n_forward : 0;
    *busy_s = r->wk ? r->wk->busy_s : 0;
}

int64_t rank_worker_leaked_blocks(rank_ctx *r) {
    struct rank_worker *w = r->wk;
    if (!w || !w->st || !w->states) return 0;
    for (int i = 0; i < r->max_seqs; i++)
        if (w->states[i]) k3_seq_state_release(w->states[i]);
    int free_b = 0, total = 0;
    k3_stage_cache_usage(w->st, &free_b, &total);
    int64_t held = total - free_b;
    for (int i = 0; w->pc_blk && i < r->pc.n_entries; i++) held -= w->pc_blk[i] >= 0;
    return held;
}

/* ---- a step ------------------------------------------------------------------------------- */
/* Check the message against this lane, free the slots of ended sequences, bind the step's
 * sequences to their slots (an OPEN one is reset). */
static k3_status step_decode(rank_ctx *r, const step_msg *m, wstep *s) {
    struct rank_worker *w = r->wk;
    const int S = r->plan.n_stages, D = (int)r->cfg.hidden_size;
    const rank_step *in = &m->st;
    s->m = m;
    s->in = in;
    s->who = m->who;
    s->n_tgt = 0;
    const char *who = s->who;
    const int group = in->group, stepi = in->step, n_seqs = in->n_seqs;
    if (n_seqs > r->max_seqs || in->n_freed > r->max_seqs || in->n_forks > r->max_seqs ||
        in->n_busy_us != (r->stage == 0 ? 0 : S) || (r->stage > 0 && in->n_tokens != 0))
        RTRY(r, K3_ERR(K3_ERR_FORMAT,
                       "step %d of group %d from %s: %d sequences, %d freed, %d forks, %d busy "
                       "times, %d token ids (lane of %d slots, %d stages)",
                       stepi, group, who, n_seqs, in->n_freed, in->n_forks, in->n_busy_us,
                       in->n_tokens, r->max_seqs, S));
    /* sequences that ended: their cache blocks back to the pool before this step takes any, and
       the cache's evictions, so that a fork finds the blocks rank 0 counted for it; then the
       forks (a slot a fork names is never freed in the same message: rank 0 holds it) */
    for (int i = 0; i < in->n_freed; i++) {
        const int32_t f = in->freed[i];
        bool named = false;
        for (int k = 0; k < in->n_forks; k++)
            named |= in->forks[k].parent == f || in->forks[k].child == f;
        if (f < 0 || f >= r->max_seqs || named)
            RTRY(r, K3_ERR(K3_ERR_FORMAT, "step %d of group %d from %s: freed slot %d (of %d)%s",
                           stepi, group, who, f, r->max_seqs,
                           named ? ", which a fork of the step names" : ""));
        k3_seq_state_release(w->states[f]);
    }
    for (int phase = RANK_PC_EVICTS; phase <= RANK_PC_FORKS; phase++)
        RTRY(r, rank_pc_apply(w->st, &r->pc, w->pc_blk, w->states, in, phase, who));
    int64_t T = 0;
    for (int i = 0; i < n_seqs; i++) {
        const rank_step_seq q = in->seqs[i];
        if (q.slot < 0 || q.slot >= r->max_seqs || q.n_tokens < 1)
            RTRY(r, K3_ERR(K3_ERR_FORMAT,
                           "step %d of group %d from %s: slot %d (%d tokens) is not a slot of "
                           "lane %d (%d slots)",
                           stepi, group, who, q.slot, q.n_tokens, r->lane, r->max_seqs));
        for (int j = 0; j < i; j++)
            if (w->bstates[j] == w->states[q.slot])
                RTRY(r, K3_ERR(K3_ERR_FORMAT, "step %d of group %d from %s: slot %d twice", stepi,
                               group, who, q.slot));
        if (q.flags & K3_WIRE_OPEN) RTRY(r, k3_seq_state_reset(w->states[q.slot])); /* new */
        w->bstates[i] = w->states[q.slot];
        w->bntok[i] = q.n_tokens;
        T += q.n_tokens;
        if (q.flags & K3_WIRE_PLP) s->n_tgt += q.n_tokens;
    }
    s->T = T;
    s->rows = T;
    if (in->moe_host != 0 && in->moe_host != 1)
        RTRY(r, K3_ERR(K3_ERR_FORMAT, "step %d of group %d from %s: MoE route word %d (0 or 1)",
                       stepi, group, who, in->moe_host));
    if (in->n_pad != 0 && in->moe_host) /* a host-routed round reads its route: never captured */
        RTRY(r, K3_ERR(K3_ERR_FORMAT,
                       "step %d of group %d from %s: a captured step of %d rows in a host-routed "
                       "round",
                       stepi, group, who, in->n_pad));
    if (in->n_pad != 0) { /* rank 0's decision: a captured decode step of n_pad rows */
        bool decode = !in->all_logits && n_seqs >= 1 && T == n_seqs && s->n_tgt == 0;
        if (!decode || in->n_pad < n_seqs || in->n_pad > r->max_seqs || in->n_pad > r->max_tokens ||
            !w->graphs)
            RTRY(r, K3_ERR(K3_ERR_FORMAT,
                           "step %d of group %d from %s: a captured step of %d rows for %d "
                           "sequences of %lld tokens (%s; %d slots, graphs %s)",
                           stepi, group, who, in->n_pad, n_seqs, (long long)T,
                           decode ? "decode" : "not a decode step", r->max_seqs,
                           w->graphs ? "on" : "off on this rank"));
        s->rows = in->n_pad;
    }
    /* hits: after the OPEN resets, before the forward */
    RTRY(r, rank_pc_apply(w->st, &r->pc, w->pc_blk, w->states, in, RANK_PC_BEFORE, who));
    if (T > r->max_tokens)
        RTRY(r, K3_ERR(K3_ERR_STATE, "step with %lld tokens > planned %lld", (long long)T,
                       (long long)r->max_tokens));
    if (in->n_targets != s->n_tgt)
        RTRY(r, K3_ERR(K3_ERR_FORMAT, "step from %s: %d prompt-logprob targets for %lld rows", who,
                       in->n_targets, (long long)s->n_tgt));
    if (r->stage == 0) {
        if (in->n_tokens != T || m->h.T != T || m->n_f32 != 0)
            RTRY(r,
                 K3_ERR(K3_ERR_FORMAT, "BATCH from %s: %d token ids, %lld floats for %lld tokens",
                        who, in->n_tokens, (long long)m->n_f32, (long long)T));
    } else if (m->h.T != s->rows || m->h.D != D || m->h.n_bank < 0 ||
               m->h.n_bank > k3_activ_max_bank(&r->cfg) ||
               m->n_f32 != (w->dev_act ? 0 : s->rows * D * (1 + (int64_t)m->h.n_bank))) {
        RTRY(r, K3_ERR(K3_ERR_FORMAT,
                       "ACTIV from %s: T %lld D %lld bank %d floats %lld (want T %lld D %d)", who,
                       (long long)m->h.T, (long long)m->h.D, m->h.n_bank, (long long)m->n_f32,
                       (long long)s->rows, D));
    }
    return K3_OK;
}

/* The previous stage's activations (h | bank) into the backend. Stage 0 has token ids only. */
static k3_status step_upload(rank_ctx *r, const wstep *s) {
    struct rank_worker *w = r->wk;
    const step_msg *m = s->m;
    if (r->stage == 0) return K3_OK;
    const int64_t TD = s->rows * r->cfg.hidden_size;
    w->act.T = s->rows;
    w->act.n_bank = m->h.n_bank;
    if (w->dev_act) { /* h, then the bank slabs, backend to backend from the sender */
        RTRY(r, k3_comm_recv_dev(r->comm, r->be, m->src, w->act.h, TD,
                                 "activations from the previous stage"));
        RTRY(r, k3_comm_recv_dev(r->comm, r->be, m->src, w->act.bank, TD * m->h.n_bank,
                                 "the attention-residual bank from the previous stage"));
        return K3_OK;
    }
    /* the message is host memory; the bank slabs follow h: [1 + n_bank, T, D] */
    RTRY(r, k3_backend_upload(r->be, w->act.h, m->f32, (size_t)TD * sizeof(float)));
    if (m->h.n_bank)
        RTRY(r, k3_backend_upload(r->be, w->act.bank, m->f32 + TD,
                                  (size_t)(TD * m->h.n_bank) * sizeof(float)));
    return K3_OK;
}

/* The stage's layers over the step's sequences (or, with none of this lane, its experts' share
 * of every MoE exchange); a sequence's first non-finite activation goes into its flags. */
static k3_status step_forward(rank_ctx *r, wstep *s) {
    struct rank_worker *w = r->wk;
    const int S = r->plan.n_stages, n_seqs = s->in->n_seqs;
    const rank_step *in = s->in;
    w->n_forward++;
    char doing[96];
    snprintf(doing, sizeof doing, "forward step %d (%s, micro-batch %d, %lld tokens)", w->n_forward,
             s->T > n_seqs ? "prefill" : "decode", in->group, (long long)s->T);
    k3_comm_set_doing(r->comm, doing);
    rank_hooks_step(r, w->n_forward);
    k3_stage_set_moe_host(w->st, in->moe_host != 0); /* the round's MoE route (rank 0's) */
    double t_busy = k3_now_s();
    if (n_seqs > 0) {
        memcpy(w->wseqs, in->seqs, (size_t)n_seqs * sizeof *w->wseqs); /* sent on */
        for (int i = 0; i < n_seqs; i++) /* marked by an earlier stage: keep its origin */
            w->bnf[i] = (in->seqs[i].flags & K3_WIRE_NF) ? -1 : 0;
        k3_batch b = {.n_seqs = n_seqs,
                      .states = w->bstates,
                      .n_tokens = w->bntok,
                      .token_ids = in->tokens,
                      .nonfinite = w->bnf};
        if (in->n_pad > 0) { /* a captured decode step (replayed, or captured now) */
            RTRY(r, k3_stage_forward_graph(w->st, &b, in->n_pad, rank_hooks_graph_sync(r), &w->act,
                                           r->stage == S - 1 ? w->logits : NULL, &s->fell));
            if (s->fell) rank_opstats_fallback(r);
        } else {
            RTRY(r, k3_stage_forward(w->st, &b, &w->act, in->all_logits != 0 || s->n_tgt > 0,
                                     r->stage == S - 1 ? w->logits : NULL));
        }
        /* the first non-finite activation of a sequence travels on in its flags (wire.h) */
        for (int i = 0; i < n_seqs; i++) {
            if (w->bnf[i] <= 0) continue;
            int32_t *fl = &w->wseqs[i].flags;
            *fl = (*fl & ~K3_WIRE_NF & ((1 << K3_WIRE_NF_SHIFT) - 1)) | K3_WIRE_NF |
                  (w->bnf[i] << K3_WIRE_NF_SHIFT);
            int layer = k3_nf_layer(w->bnf[i]);
            char where[32] = "";
            if (layer >= 0) snprintf(where, sizeof where, "layer %d, ", layer);
            K3_LOGW("non-finite values (NaN/Inf) first appear in %s%s, for the sequence in slot %d "
                    "of lane %d (micro-batch %d, step %d); its request fails",
                    where, k3_nf_op_name(k3_nf_op_of(w->bnf[i])), w->wseqs[i].slot, r->lane,
                    in->group, in->step);
        }
    } else {
        /* no sequences of this lane in the step: still serve our experts at every MoE layer */
        w->act.T = 0;
        w->act.n_bank = 0;
        RTRY(r, k3_stage_idle_step(w->st));
    }
    s->busy_s = k3_now_s() - t_busy;
    snprintf(doing, sizeof doing, "waiting after its forward step %d", w->n_forward);
    k3_comm_set_doing(r->comm, doing);
    w->busy_s += s->busy_s; /* time in the forward (and its MoE exchanges) */
    return K3_OK;
}

double rank_log_softmax_top(const float *row, int64_t V, int n, int32_t *ids) {
    double m = -INFINITY, z = 0;
    for (int64_t v = 0; v < V; v++) m = row[v] > m ? row[v] : m;
    for (int64_t v = 0; v < V; v++) z += exp((double)row[v] - m);
    int have = 0; /* the best n by insertion into a short sorted list: O(V n) */
    for (int64_t v = 0; v < V && n > 0; v++) {
        float x = row[v];
        if (have == n && !(x > row[ids[n - 1]])) continue; /* ties: lower id first */
        int k = have < n ? have++ : n - 1;
        while (k > 0 && x > row[ids[k - 1]]) {
            ids[k] = ids[k - 1];
            k--;
        }
        ids[k] = (int32_t)v;
    }
    return m + log(z);
}

/* The prompt logprob records of the PLP sequences' rows (wire.h), from the step's rows [T, V]. */
static void plp_records(rank_ctx *r, const wstep *s, const float *lg) {
    const int64_t V = r->cfg.vocab_size;
    const int n = (int)K3_MIN((int64_t)K3_PLP_TOP, V);
    int64_t row = 0, k = 0;
    for (int i = 0; i < s->in->n_seqs; i++) {
        const int nt = s->in->seqs[i].n_tokens;
        if (s->in->seqs[i].flags & K3_WIRE_PLP)
            for (int t = 0; t < nt; t++, k++) {
                const float *x = lg + (row + t) * V;
                float *rec = r->wk->plp + k * K3_PLP_REC;
                int32_t ids[K3_PLP_TOP];
                const double lz = rank_log_softmax_top(x, V, n, ids);
                const int32_t tg = s->in->targets[k];
                const bool ok = tg >= 0 && tg < V;
                int64_t above = 0;
                for (int64_t v = 0; ok && v < V; v++) above += x[v] > x[tg];
                rec[0] = ok ? (float)((double)x[tg] - lz) : NAN;
                rec[1] = ok ? (float)(above + 1) : NAN;
                for (int j = 0; j < K3_PLP_TOP; j++) {
                    rec[2 + j] = j < n ? (float)ids[j] : -1.0f;
                    rec[2 + K3_PLP_TOP + j] = j < n ? (float)((double)x[ids[j]] - lz) : NAN;
                }
            }
        row += nt;
    }
}

/* The last stage's LOGITS: every row (all_logits) or the rows the coordinator samples from,
 * then the prompt logprob records. With PLP sequences every row was computed, so a sequence's
 * sampled row is its last one, not its index. */
static k3_status send_logits(rank_ctx *r, const wstep *s, const rank_step *out) {
    struct rank_worker *w = r->wk;
    const int64_t V = r->cfg.vocab_size, T = s->T;
    const bool all = s->in->all_logits != 0, every = all || s->n_tgt > 0; /* rows: T, or n_seqs */
    int64_t R = all ? T : 0;
    float *lg = w->logits;
    if (w->h_logits) { /* logits cross to host memory here (or with a captured step's flags) */
        int64_t rows = every ? T : out->n_seqs;
        if (!k3_stage_logits_fetched(w->st)) /* else read with the step's flags */
            RTRY(r, k3_backend_download(r->be, w->h_logits, w->logits,
                                        (size_t)(rows * V) * sizeof(float)));
        lg = w->h_logits;
    }
    if (s->n_tgt) plp_records(r, s, lg); /* before the rows below move */
    if (!all)                            /* keep only the rows the coordinator samples from */
        for (int64_t i = 0, end = 0; i < out->n_seqs; i++) {
            end += out->seqs[i].n_tokens;
            int64_t src = every ? end - 1 : i;
            if (out->seqs[i].flags & K3_WIRE_WANT) {
                if (R != src) memmove(lg + R * V, lg + src * V, (size_t)V * sizeof(float));
                R++;
            }
        }
    const k3_f32_seg seg[2] = {{lg, R * V}, {w->plp, s->n_tgt * K3_PLP_REC}};
    return rank_post_step(r, 0, K3_MSG_LOGITS, (k3_wire_step){.T = T, .D = V, .R = R}, out, seg,
                          s->n_tgt ? 2 : 1);
}

/* The step on: the logits rows the coordinator samples from (last stage), or h | bank to the
 * next stage; the meta carries each stage's busy time. */
static k3_status step_send(rank_ctx *r, const wstep *s) {
    struct rank_worker *w = r->wk;
    const int S = r->plan.n_stages, D = (int)r->cfg.hidden_size;
    /* out meta = the received one, with this stage's NF flags, no token ids, and the busy time
       of each stage of this lane for this step (us): upstream stages' from the ACTIV, this
       stage's own */
    rank_step out = *s->in;
    out.seqs = w->wseqs;
    out.graph_fell = s->in->graph_fell || s->fell;
    out.n_tokens = 0, out.tokens = NULL;
    if (r->stage > 0)
        memcpy(w->wbusy, s->in->busy_us, (size_t)S * sizeof *w->wbusy);
    else
        memset(w->wbusy, 0, (size_t)S * sizeof *w->wbusy);
    w->wbusy[r->stage] = (int32_t)K3_MIN(s->busy_s * 1e6, (double)INT32_MAX);
    out.n_busy_us = S, out.busy_us = w->wbusy;
    if (r->stage == S - 1) return send_logits(r, s, &out);
    const int64_t T_rows = s->rows; /* a captured step sends its pad rows too */
    int64_t nb = out.n_seqs ? w->act.n_bank : 0;
    k3_f32_seg seg[2] = {{w->act.h, T_rows * D}, {w->act.bank, T_rows * D * nb}};
    if (w->h_act && !w->dev_act) { /* h | bank to host memory for the wire */
        RTRY(r,
             k3_backend_download(r->be, w->h_act, w->act.h, (size_t)(T_rows * D) * sizeof(float)));
        if (nb)
            RTRY(r, k3_backend_download(r->be, w->h_act + T_rows * D, w->act.bank,
                                        (size_t)(T_rows * D * nb) * sizeof(float)));
        seg[0].p = w->h_act;
        seg[1].p = w->h_act + T_rows * D;
    }
    const int next = k3_plan_rank(&r->plan, r->stage + 1, r->lane);
    const k3_wire_step h = {.T = T_rows, .D = D, .R = T_rows, .n_bank = (int32_t)nb};
    if (!w->dev_act) return rank_post_step(r, next, K3_MSG_ACTIV, h, &out, seg, 2);
    /* the meta first (it announces the sizes), then the floats */
    RTRY(r, rank_post_step(r, next, K3_MSG_ACTIV, h, &out, NULL, 0));
    RTRY(r, k3_comm_send_dev(r->comm, r->be, next, w->act.h, T_rows * D,
                             "activations to the next stage"));
    RTRY(r, k3_comm_send_dev(r->comm, r->be, next, w->act.bank, T_rows * D * nb,
                             "the attention-residual bank to the next stage"));
    return K3_OK;
}

/* Process one BATCH/ACTIV message and send the result on. */
static k3_status worker_step(rank_ctx *r, const step_msg *m) {
    wstep s = {0};
    RTRY(r, rank_opstats_begin(r));
    RTRY(r, step_decode(r, m, &s));
    RTRY(r, step_upload(r, &s));
    RTRY(r, step_forward(r, &s));
    /* saved blocks and snapshots: the states are at the step's end now */
    RTRY(r, rank_pc_apply(r->wk->st, &r->pc, r->wk->pc_blk, r->wk->states, s.in, RANK_PC_AFTER,
                          s.who));
    RTRY(r, step_send(r, &s));
    return rank_opstats_end(r, s.T, s.in->n_seqs);
}

/* ---- serving --------------------------------------------------------------------------------- */
k3_status rank_worker_poll(rank_ctx *r, bool *did) {
    struct rank_worker *w = r->wk;
    *did = false;
    if (!w->serving) return K3_OK;
    step_msg m;
    bool got;
    RTRY(r, rank_poll_step(r, w->in_peer, w->in_kind, &m, &got));
    if (got) {
        *did = true;
        return worker_step(r, &m);
    }
    k3_comm_msg stop;
    RTRY(r, k3_comm_poll(r->comm, 0, K3_MSG_STOP, &stop, &got));
    if (got) {
        w->serving = false;
        *did = true;
        return K3_OK;
    }
    /* the coordinator's heartbeat: its arrival time matters, and the answer (rank 0's /health) */
    RTRY(r, k3_comm_beat(r->comm));
    return K3_OK;
}

/* Between requests a worker may idle for hours, so it waits for steps without a limit, but not
 * for the coordinator: rank 0 beats while idle (k3_comm_beat), and a worker that hears nothing
 * from it for --comm-timeout starts the fault exchange. A rank that stalls in the middle of a
 * step is caught by the coordinator's --comm-timeout and by the MoE collectives' own timeouts;
 * a fault report from any rank interrupts the wait here too. */
k3_status rank_worker_serve(rank_ctx *r) {
    int backoff = 0;
    const double timeout = rank_comm_timeout(r);
    while (r->wk->serving) {
        bool did;
        RTRY(r, rank_worker_poll(r, &did));
        if (did) {
            backoff = 0;
            continue;
        }
        double silent = k3_comm_silent_s(r->comm, 0);
        if (silent > timeout) {
            int coord = 0;
            k3_comm_note_timeout(r->comm, &coord, 1, "a step or a heartbeat from the coordinator",
                                 silent);
            RTRY(r, K3_ERR(K3_ERR_COMM,
                           "no step or heartbeat from the coordinator (rank 0) within %.0f s "
                           "(--comm-timeout)",
                           timeout));
        }
        k3_comm_idle(r->comm, &backoff);
    }
    return K3_OK;
}
