/* scheduler.c — the coordinator on rank 0: sequences on lanes, micro-batch groups (at least S in
 * flight when there are enough sequences), step messages, sampling and stop rules; and the event
 * loop that runs the coordinator and/or a worker on one thread. */
#include "rank_internal.h"

/* ---- coordinator -------------------------------------------------------------------------- */
static bool seq_active(const rank_ctx *r, const seq_run *q) {
    if (q->fed < q->P) return true;
    if (q->stop != K3_STOP_NONE) return false; /* a stopped sequence leaves the batch */
    return q->fed - q->P < q->n_gen && q->fed - q->P < r->o->n_new - 1;
}

static void coord_send_step(rank_ctx *r, int g) {
    group_run *gr = &r->groups[g];
    const int E = r->plan.n_lanes;
    const int n = r->o->n_prompts;
    bool any = false;
    for (int i = 0; i < n; i++) any |= r->seqs[i].group == g && seq_active(r, &r->seqs[i]);
    if (!any) {
        gr->done = true;
        return;
    }
    gr->step++;
    gr->pending = E;
    r->n_steps++;
    for (int e = 0; e < E; e++) {
        int32_t *mt = r->meta;
        int ns = 0;
        int64_t T = 0;
        mt[0] = g, mt[1] = gr->step, mt[2] = r->o->dump_logits != NULL;
        for (int i = 0; i < n; i++) {
            seq_run *q = &r->seqs[i];
            q->n_tok_step =
                q->group == g && q->lane == e && seq_active(r, q)
                    ? (q->fed < q->P
                           ? (r->o->chunk > 0 ? K3_MIN(r->o->chunk, q->P - q->fed) : q->P - q->fed)
                           : 1)
                    : 0;
            if (!q->n_tok_step) continue;
            mt[META_HDR + META_SEQ * ns] = i;
            mt[META_HDR + META_SEQ * ns + 1] = (int32_t)q->n_tok_step;
            ns++;
            T += q->n_tok_step;
        }
        mt[3] = ns;
        int32_t *tok = mt + META_HDR + META_SEQ * ns;
        for (int j = 0; j < ns; j++) {
            seq_run *q = &r->seqs[mt[META_HDR + META_SEQ * j]];
            for (int64_t t = 0; t < q->n_tok_step; t++) {
                int64_t pos = q->fed + t;
                *tok++ = pos < q->P ? q->prompt[pos] : q->gen[pos - q->P];
            }
            q->fed += q->n_tok_step;
            mt[META_HDR + META_SEQ * j + 2] = q->fed >= q->P && q->n_gen < r->o->n_new;
        }
        rank_post_step(r, k3_plan_rank(&r->plan, 0, e), K3_MSG_BATCH,
                       (k3_wire_step){.T = T, .n_meta = (int32_t)(META_HDR + META_SEQ * ns + T)},
                       mt, NULL, 0);
    }
}

/* Sample sequence q's next id from `logits` [V], record it, apply the stop rules. */
static void coord_sample(rank_ctx *r, seq_run *q, const float *logits) {
    int32_t id;
    RTRY(r, k3_sampler_sample(q->smp, logits, &id));
    q->gen[q->n_gen++] = id;
    k3_tok_bytes *emit = r->o->tok ? &q->text : NULL;
    RTRY(r, k3_sampler_accept(q->smp, id, emit, &q->stop));
    if (q->stop == K3_STOP_STRING) q->stop_string = k3_sampler_matched_stop(q->smp);
    if (q->stop == K3_STOP_NONE && q->n_gen == r->o->n_new)
        RTRY(r, k3_sampler_finish(q->smp, emit)); /* length: flush held text */
}

static void coord_on_logits(rank_ctx *r, const step_msg *m) {
    const int64_t V = r->cfg.vocab_size;
    const int32_t *mt = m->meta;
    if (m->h.n_meta < META_HDR)
        rank_die(r, K3_ERR(K3_ERR_FORMAT, "LOGITS from rank %d: %d meta", m->src, m->h.n_meta));
    int g = mt[0], stepi = mt[1], all = mt[2], ns = mt[3];
    if (g < 0 || g >= r->n_groups || stepi != r->groups[g].step || r->groups[g].pending <= 0 ||
        ns < 0 || m->h.n_meta != META_HDR + META_SEQ * ns)
        rank_die(r,
                 K3_ERR(K3_ERR_FORMAT,
                        "LOGITS from rank %d: group %d step %d (expected step %d), %d sequences",
                        m->src, g, stepi, g >= 0 && g < r->n_groups ? r->groups[g].step : -1, ns));
    int64_t T = 0, n_want = 0;
    for (int j = 0; j < ns; j++)
        T += mt[META_HDR + META_SEQ * j + 1], n_want += mt[META_HDR + META_SEQ * j + 2] != 0;
    int64_t R = all ? T : n_want;
    if (m->h.D != V || m->h.R != R || m->n_f32 != R * V)
        rank_die(r,
                 K3_ERR(K3_ERR_FORMAT, "LOGITS from rank %d: [%lld, %lld] rows, want [%lld, %lld]",
                        m->src, (long long)m->h.R, (long long)m->h.D, (long long)R, (long long)V));
    r->logits_bytes += m->n_bytes;
    r->n_logits_msgs++;
    if (!r->worker) rank_hooks_maybe_die(r, r->n_logits_msgs);
    int64_t row = 0;
    for (int j = 0; j < ns; j++) {
        int i = mt[META_HDR + META_SEQ * j], nt = mt[META_HDR + META_SEQ * j + 1];
        bool want = mt[META_HDR + META_SEQ * j + 2] != 0;
        if (i < 0 || i >= r->o->n_prompts)
            rank_die(r, K3_ERR(K3_ERR_FORMAT, "LOGITS: sequence %d", i));
        seq_run *q = &r->seqs[i];
        const float *last = NULL;
        if (all) {
            if (q->dump)
                memcpy(q->dump + q->dump_rows * V, m->f32 + row * V,
                       (size_t)(nt * V) * sizeof(float));
            q->dump_rows += nt;
            last = m->f32 + (row + nt - 1) * V;
            row += nt;
        } else if (want) {
            last = m->f32 + row * V;
            row++;
        }
        if (want != (q->fed >= q->P && q->n_gen < r->o->n_new))
            rank_die(r, K3_ERR(K3_ERR_FORMAT,
                               "LOGITS from rank %d: sequence %d: want=%d is out of step", m->src,
                               i, want));
        if (want) {
            for (int64_t v = 0; v < V; v++)
                if (last[v] != last[v])
                    rank_die(r, K3_ERR(K3_ERR_STATE, "sequence %d: NaN logit at vocab %lld", i,
                                       (long long)v));
            coord_sample(r, q, last);
        }
    }
    if (--r->groups[g].pending == 0) {
        bool all_first = true;
        for (int i = 0; i < r->o->n_prompts; i++)
            all_first &=
                r->seqs[i].fed >= r->seqs[i].P && (r->seqs[i].n_gen > 0 || r->o->n_new == 0);
        if (all_first && r->t_prefill_done == 0) r->t_prefill_done = k3_now_s();
        coord_send_step(r, g);
    }
}

static bool coord_done(const rank_ctx *r) {
    for (int g = 0; g < r->n_groups; g++)
        if (!r->groups[g].done) return false;
    return true;
}

void rank_coord_init(rank_ctx *r) {
    const k3_rank_opts *o = r->o;
    int n = o->n_prompts, E = r->plan.n_lanes;
    RTRY(r, k3_calloc((void **)&r->seqs, (size_t)n * sizeof *r->seqs, "sequences"));
    RTRY(r, k3_calloc((void **)&r->groups, (size_t)r->n_groups * sizeof *r->groups, "groups"));
    const int32_t *p = o->prompt_ids;
    int64_t maxT = 0;
    for (int i = 0; i < n; i++) {
        seq_run *q = &r->seqs[i];
        q->prompt = p;
        q->P = o->prompt_lens[i];
        p += q->P;
        q->lane = k3_plan_lane_of_seq(&r->plan, i);
        q->group = (i / E) % r->n_groups;
        maxT += q->P;
        RTRY(r, k3_calloc((void **)&q->gen, (size_t)K3_MAX(o->n_new, 1) * sizeof(int32_t),
                          "generated ids"));
        k3_sampler_params sp = o->sampling;
        sp.seed = k3_rank_seq_seed(o->sampling.seed, i);
        sp.stop_ids = r->stop_ids;
        sp.n_stop_ids = r->n_stop_ids;
        q->stop_string = -1;
        RTRY(r, k3_sampler_create(&q->smp, &sp, r->cfg.vocab_size, o->tok));
        if (o->dump_logits)
            RTRY(r, k3_alloc((void **)&q->dump,
                             (size_t)(q->P + o->n_new) * (size_t)r->cfg.vocab_size * sizeof(float),
                             "logits dump"));
    }
    r->meta_cap = META_HDR + META_SEQ * n + maxT;
    RTRY(r, k3_alloc((void **)&r->meta, (size_t)r->meta_cap * sizeof(int32_t), "step meta"));
}

void rank_coord_destroy(rank_ctx *r) {
    if (r->seqs)
        for (int i = 0; i < r->o->n_prompts; i++) {
            k3_free(r->seqs[i].gen), k3_free(r->seqs[i].dump);
            k3_sampler_destroy(r->seqs[i].smp);
            k3_tok_bytes_free(&r->seqs[i].text);
        }
    k3_free(r->seqs), k3_free(r->groups), k3_free(r->meta);
}

/* ---- the event loop: coordinator and/or worker on one thread ----------------------------- */
void rank_run_loop(rank_ctx *r) {
    double timeout = r->o->comm_timeout_s > 0 ? r->o->comm_timeout_s : 600;
    int in_peer = -1;
    k3_msg_kind in_kind = K3_MSG_BATCH;
    if (r->worker) {
        in_peer = r->stage == 0 ? 0 : k3_plan_rank(&r->plan, r->stage - 1, r->lane);
        in_kind = r->stage == 0 ? K3_MSG_BATCH : K3_MSG_ACTIV;
    }
    if (r->coord) {
        r->t_gen0 = k3_now_s();
        for (int g = 0; g < r->n_groups; g++) coord_send_step(r, g);
    }
    bool worker_live = r->worker, coord_live = r->coord, stop_sent = false;
    double last = k3_now_s();
    int backoff = 0;
    while (worker_live || coord_live) {
        bool progressed = false;
        step_msg m;
        bool got;
        if (coord_live) {
            rank_poll_step(r, K3_ANY_RANK, K3_MSG_LOGITS, &m, &got);
            if (got) {
                coord_on_logits(r, &m);
                progressed = true;
            }
            if (coord_done(r) && !stop_sent) {
                for (int w = 0; w < r->world; w++)
                    if (k3_plan_coords(&r->plan, w, NULL, NULL))
                        RTRY(r, k3_comm_post(r->comm, w, K3_MSG_STOP, NULL, 0, NULL, 0));
                stop_sent = true;
                coord_live = false;
                progressed = true;
            }
        }
        if (worker_live) {
            rank_poll_step(r, in_peer, in_kind, &m, &got);
            if (got) {
                rank_worker_step(r, &m);
                progressed = true;
            } else {
                k3_comm_msg stop;
                RTRY(r, k3_comm_poll(r->comm, 0, K3_MSG_STOP, &stop, &got));
                if (got) worker_live = false, progressed = true;
            }
        }
        if (progressed) {
            last = k3_now_s();
            backoff = 0;
            continue;
        }
        if (k3_now_s() - last > timeout) {
            if (coord_live) {
                int g = 0;
                while (g < r->n_groups && r->groups[g].done) g++;
                rank_die(r,
                         K3_ERR(K3_ERR_COMM,
                                "coordinator: no logits for micro-batch %d step %d (%d of %d lanes "
                                "of the last stage, "
                                "ranks %d-%d, missing) within %.0f s (--comm-timeout)",
                                g, g < r->n_groups ? r->groups[g].step : -1,
                                g < r->n_groups ? r->groups[g].pending : 0, r->plan.n_lanes,
                                k3_plan_rank(&r->plan, r->plan.n_stages - 1, 0),
                                k3_plan_rank(&r->plan, r->plan.n_stages - 1, r->plan.n_lanes - 1),
                                timeout));
            }
            rank_die(r, K3_ERR(K3_ERR_COMM,
                               "worker: no %s from rank %d within %.0f s (--comm-timeout)",
                               in_kind == K3_MSG_BATCH ? "batch" : "activation", in_peer, timeout));
        }
        k3_comm_idle(r->comm, &backoff);
    }
    RTRY(r, k3_comm_flush(r->comm));
}
