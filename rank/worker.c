/* worker.c — the stage worker of a lane, and the wire protocol of a step.
 *
 * Wire usage (all messages through comm/, tag = kind; payload layouts and K3_WIRE_VERSION in
 * wire.h; each message's meta is one k3_wire_step, then int32s):
 *   BATCH  coordinator -> (stage 0, lane e): [group, step, all_logits, n_seqs, n_free,
 *          (slot, n_tokens, flags) x n_seqs, freed slot x n_free, token ids x T]; flags: OPEN (a
 *          new sequence in the slot: reset it), WANT (its last row is sampled), NF
 *   ACTIV  (s, e) -> (s+1, e): the same prefix, then the busy microseconds of each of the lane's
 *          S stages in this step; f32 = h [T, D] | bank [n_bank, T, D]
 *   LOGITS (S-1, e) -> coordinator: meta as ACTIV; f32 = [R, V] with R = T (all_logits) or the
 *          number of sequences with WANT (those the coordinator samples from)
 *   STOP   coordinator -> every worker, after the last logits arrived.
 * The freed slots are sequences that ended: each stage returns their cache blocks to its pool
 * before the step. A NaN/Inf in a sequence's rows sets its NF flag with the first sub-block that
 * produced one (k3_nf_code), carried on to the coordinator, which fails that request alone.
 * With a transport that has device payloads (nccl) and a device backend, ACTIV carries only its
 * meta and the floats follow it backend to backend (k3_comm_send_dev / recv_dev), so activations
 * never cross to the host between stages.
 * Every lane of a stage receives the same sequence of (group, step) messages (possibly with no
 * sequences), so the lanes' MoE collectives line up; a lane with no tokens still serves its
 * experts at each MoE layer (k3_stage_idle_step). The stage drives the MoE step itself through
 * the comm handle it is given; rank only builds the lane map and moves messages. Activations,
 * caches and logits live in the rank's backend; they cross to host memory only by
 * k3_backend_download/upload at a message boundary. The loop allocates nothing per step: buffers
 * are sized from the plan's max_tokens up front (comm buffers grow to the largest message once).
 */
#include "rank_internal.h"

/* ---- worker ------------------------------------------------------------------------------- */
void rank_worker_init(rank_ctx *r) {
    const k3_engine_opts *o = r->o;
    const k3_config *c = &r->cfg;
    int S = r->plan.n_stages, E = r->plan.n_lanes;
    const bool moe_remote = E > 1;
    if (moe_remote) { /* the owner lane of every (layer, expert) of this stage */
        RTRY(r, k3_calloc((void **)&r->lane_of,
                          (size_t)c->n_layers * (size_t)K3_MAX(c->n_experts, 1) * sizeof(int32_t),
                          "expert lane map"));
        for (int l = r->plan.stage_begin[r->stage]; l < r->plan.stage_begin[r->stage + 1]; l++)
            if (k3_config_is_moe(c, l))
                for (int x = 0; x < c->n_experts; x++)
                    r->lane_of[(size_t)l * (size_t)c->n_experts + (size_t)x] =
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
                          .expert_lane = r->lane_of,
                          .n_lanes = E,
                          .deterministic = o->deterministic,
                          .max_seqs = r->max_seqs,
                          .max_ctx = r->max_ctx,
                          .kv_cache_tokens = (int64_t)r->kv_blocks * K3_KV_BLOCK};
    RTRY(r, k3_stage_create(&sp, &r->st));
    /* the lane's sequence slots: allocated once, reset when a new sequence opens in them */
    const size_t ns = (size_t)r->max_seqs;
    RTRY(r, k3_calloc((void **)&r->states, ns * sizeof *r->states, "sequence slots"));
    RTRY(r, k3_calloc((void **)&r->bstates, ns * sizeof *r->bstates, "batch states"));
    RTRY(r, k3_calloc((void **)&r->bntok, ns * sizeof *r->bntok, "batch tokens"));
    RTRY(r, k3_calloc((void **)&r->bnf, ns * sizeof *r->bnf, "batch non-finite marks"));
    RTRY(r, k3_calloc((void **)&r->wmeta,
                      (META_PREFIX(ns, ns) + (size_t)r->plan.n_stages) * sizeof *r->wmeta,
                      "step meta (out)"));
    for (int i = 0; i < r->max_seqs; i++)
        RTRY(r, k3_seq_state_create(r->st, r->max_ctx, &r->states[i]));
    r->serving = true;
    r->in_peer = r->stage == 0 ? 0 : k3_plan_rank(&r->plan, r->stage - 1, r->lane);
    r->in_kind = r->stage == 0 ? K3_MSG_BATCH : K3_MSG_ACTIV;
    RTRY(r, k3_activ_alloc(r->be, &r->act, c, r->max_tokens));
    const size_t TD = (size_t)r->max_tokens * (size_t)c->hidden_size;
    const bool host = k3_backend_host_visible(r->be);
    r->dev_act = !host && k3_comm_device_payloads(r->comm);
    if (r->stage == S - 1) {
        size_t nb = (size_t)r->max_tokens * (size_t)c->vocab_size * sizeof(float);
        RTRY(r, k3_backend_alloc(r->be, nb, "logits", (void **)&r->logits));
        if (!host) RTRY(r, k3_alloc((void **)&r->h_logits, nb, "logits (host)"));
    } else if (!host && !r->dev_act) {
        RTRY(r,
             k3_alloc((void **)&r->h_act, TD * (size_t)(1 + k3_activ_max_bank(c)) * sizeof(float),
                      "activation staging (host)"));
    }
}

void rank_worker_destroy(rank_ctx *r) {
    if (r->states)
        for (int i = 0; i < r->max_seqs; i++) k3_seq_state_destroy(r->states[i]);
    k3_free(r->states), k3_free(r->bstates), k3_free(r->bntok), k3_free(r->bnf), k3_free(r->wmeta);
    if (r->be) {
        k3_activ_free(r->be, &r->act);
        k3_backend_free(r->be, r->logits);
    }
    k3_free(r->h_logits), k3_free(r->h_act), k3_free(r->lane_of);
    k3_stage_destroy(r->st);
    k3_weights_destroy(r->w);
    k3_ckpt_destroy(r->ck);
    /* r->be outlives the comm handle (its MoE buffers are the backend's): see k3_engine_close */
}

/* Process one BATCH/ACTIV message and send the result on. */
void rank_worker_step(rank_ctx *r, const step_msg *m) {
    const int S = r->plan.n_stages, D = (int)r->cfg.hidden_size;
    const int64_t V = r->cfg.vocab_size;
    const int32_t *mt = m->meta;
    char who[32];
    snprintf(who, sizeof who, "rank %d", m->src);
    if (m->h.n_meta < META_HDR)
        rank_die(r, K3_ERR(K3_ERR_FORMAT, "step message from %s: %d meta", who, m->h.n_meta));
    rank_opstats_begin(r);
    int group = mt[0], stepi = mt[1], all_logits = mt[2], n_seqs = mt[3], n_free = mt[4];
    if (n_seqs < 0 || n_seqs > r->max_seqs || n_free < 0 || n_free > r->max_seqs ||
        m->h.n_meta < META_PREFIX(n_seqs, n_free))
        rank_die(r, K3_ERR(K3_ERR_FORMAT, "step message from %s: %d sequences, %d freed, %d meta",
                           who, n_seqs, n_free, m->h.n_meta));
    /* sequences that ended: their cache blocks back to the pool before this step takes any */
    for (int i = 0; i < n_free; i++) {
        int slot = mt[META_HDR + META_SEQ * n_seqs + i];
        if (slot < 0 || slot >= r->max_seqs)
            rank_die(r, K3_ERR(K3_ERR_FORMAT, "step %d of group %d from %s: freed slot %d of %d",
                               stepi, group, who, slot, r->max_seqs));
        k3_seq_state_release(r->states[slot]);
    }
    int64_t T = 0;
    for (int i = 0; i < n_seqs; i++) {
        int slot = mt[META_HDR + META_SEQ * i], nt = mt[META_HDR + META_SEQ * i + 1],
            flags = mt[META_HDR + META_SEQ * i + 2];
        if (slot < 0 || slot >= r->max_seqs || nt < 1)
            rank_die(r, K3_ERR(K3_ERR_FORMAT,
                               "step %d of group %d from %s: slot %d (%d tokens) is not a slot of "
                               "lane %d (%d slots)",
                               stepi, group, who, slot, nt, r->lane, r->max_seqs));
        for (int j = 0; j < i; j++)
            if (r->bstates[j] == r->states[slot])
                rank_die(r, K3_ERR(K3_ERR_FORMAT, "step %d of group %d from %s: slot %d twice",
                                   stepi, group, who, slot));
        if (flags & K3_WIRE_OPEN) RTRY(r, k3_seq_state_reset(r->states[slot])); /* a new sequence */
        r->bstates[i] = r->states[slot];
        r->bntok[i] = nt;
        T += nt;
    }
    if (T > r->max_tokens)
        rank_die(r, K3_ERR(K3_ERR_STATE, "step with %lld tokens > planned %lld", (long long)T,
                           (long long)r->max_tokens));
    const int32_t *tokens = NULL;
    if (r->stage == 0) {
        if (m->h.n_meta != META_PREFIX(n_seqs, n_free) + T || m->h.T != T || m->n_f32 != 0)
            rank_die(r, K3_ERR(K3_ERR_FORMAT, "BATCH from %s: %d meta, %lld floats for %lld tokens",
                               who, m->h.n_meta, (long long)m->n_f32, (long long)T));
        tokens = mt + META_PREFIX(n_seqs, n_free);
    } else {
        if (m->h.n_meta != META_PREFIX(n_seqs, n_free) + S)
            rank_die(r,
                     K3_ERR(K3_ERR_FORMAT, "ACTIV from %s: %d meta for %d sequences and %d stages",
                            who, m->h.n_meta, n_seqs, S));
        if (m->h.T != T || m->h.D != D || m->h.n_bank < 0 ||
            m->h.n_bank > k3_activ_max_bank(&r->cfg) ||
            m->n_f32 != (r->dev_act ? 0 : T * D * (1 + (int64_t)m->h.n_bank)))
            rank_die(r,
                     K3_ERR(K3_ERR_FORMAT,
                            "ACTIV from %s: T %lld D %lld bank %d floats %lld (want T %lld D %d)",
                            who, (long long)m->h.T, (long long)m->h.D, m->h.n_bank,
                            (long long)m->n_f32, (long long)T, D));
        r->act.T = T;
        r->act.n_bank = m->h.n_bank;
        if (r->dev_act) { /* h, then the bank slabs, backend to backend from the sender */
            RTRY(r, k3_comm_recv_dev(r->comm, r->be, m->src, r->act.h, T * D,
                                     "activations from the previous stage"));
            RTRY(r, k3_comm_recv_dev(r->comm, r->be, m->src, r->act.bank, T * D * m->h.n_bank,
                                     "the attention-residual bank from the previous stage"));
        } else {
            /* the message is host memory; the bank slabs follow h: [1 + n_bank, T, D] */
            RTRY(r, k3_backend_upload(r->be, r->act.h, m->f32, (size_t)(T * D) * sizeof(float)));
            if (m->h.n_bank)
                RTRY(r, k3_backend_upload(r->be, r->act.bank, m->f32 + T * D,
                                          (size_t)(T * D * m->h.n_bank) * sizeof(float)));
        }
    }
    r->n_forward++;
    char doing[96];
    snprintf(doing, sizeof doing, "forward step %d (%s, micro-batch %d, %lld tokens)", r->n_forward,
             T > n_seqs ? "prefill" : "decode", group, (long long)T);
    k3_comm_set_doing(r->comm, doing);
    rank_hooks_maybe_die(r, r->n_forward);
    double t_busy = k3_now_s();
    if (n_seqs > 0) {
        for (int i = 0; i < n_seqs; i++) /* marked by an earlier stage: keep its origin */
            r->bnf[i] = (mt[META_HDR + META_SEQ * i + 2] & K3_WIRE_NF) ? -1 : 0;
        k3_batch b = {.n_seqs = n_seqs,
                      .states = r->bstates,
                      .n_tokens = r->bntok,
                      .token_ids = tokens,
                      .nonfinite = r->bnf};
        RTRY(r, k3_stage_forward(r->st, &b, &r->act, all_logits != 0,
                                 r->stage == S - 1 ? r->logits : NULL));
        /* the first non-finite activation of a sequence travels on in its flags (wire.h) */
        memcpy(r->wmeta, mt, (size_t)META_PREFIX(n_seqs, n_free) * sizeof *mt);
        mt = r->wmeta;
        for (int i = 0; i < n_seqs; i++) {
            if (r->bnf[i] <= 0) continue;
            int32_t *fl = &r->wmeta[META_HDR + META_SEQ * i + 2];
            *fl = (*fl & (K3_WIRE_NF - 1)) | K3_WIRE_NF | (r->bnf[i] << K3_WIRE_NF_SHIFT);
            int layer = k3_nf_layer(r->bnf[i]);
            char where[32] = "";
            if (layer >= 0) snprintf(where, sizeof where, "layer %d, ", layer);
            K3_LOGW("non-finite values (NaN/Inf) first appear in %s%s, for the sequence in slot %d "
                    "of lane %d (micro-batch %d, step %d); its request fails",
                    where, k3_nf_op_name(k3_nf_op_of(r->bnf[i])), r->wmeta[META_HDR + META_SEQ * i],
                    r->lane, group, stepi);
        }
    } else {
        /* no sequences of this lane in the step: still serve our experts at every MoE layer */
        r->act.T = 0;
        r->act.n_bank = 0;
        RTRY(r, k3_stage_idle_step(r->st));
    }
    const double dt = k3_now_s() - t_busy;
    snprintf(doing, sizeof doing, "waiting after its forward step %d", r->n_forward);
    k3_comm_set_doing(r->comm, doing);
    r->busy_s += dt; /* time in the forward (and its MoE exchanges) */
    /* out meta = the sequences | the busy time of each stage of this lane for this step (us):
       upstream stages' from the ACTIV, this stage's own (wire.h) */
    const int n_meta_seq = META_PREFIX(n_seqs, n_free), n_meta_out = n_meta_seq + S;
    if (mt != r->wmeta) memcpy(r->wmeta, mt, (size_t)n_meta_seq * sizeof *mt);
    mt = r->wmeta;
    int32_t *busy_us = r->wmeta + n_meta_seq;
    if (r->stage > 0)
        memcpy(busy_us, m->meta + n_meta_seq, (size_t)S * sizeof *busy_us);
    else
        memset(busy_us, 0, (size_t)S * sizeof *busy_us);
    busy_us[r->stage] = (int32_t)K3_MIN(dt * 1e6, (double)INT32_MAX);
    if (r->stage == S - 1) {
        int64_t R = all_logits ? T : 0;
        float *lg = r->logits;
        if (r->h_logits) { /* logits cross to host memory here, and only here */
            int64_t rows = all_logits ? T : n_seqs;
            RTRY(r, k3_backend_download(r->be, r->h_logits, r->logits,
                                        (size_t)(rows * V) * sizeof(float)));
            lg = r->h_logits;
        }
        if (!all_logits) /* keep only the rows the coordinator samples from */
            for (int i = 0; i < n_seqs; i++)
                if (mt[META_HDR + META_SEQ * i + 2] & K3_WIRE_WANT) {
                    if (R != i) memmove(lg + R * V, lg + (int64_t)i * V, (size_t)V * sizeof(float));
                    R++;
                }
        rank_post_step(r, 0, K3_MSG_LOGITS,
                       (k3_wire_step){.T = T, .D = V, .R = R, .n_meta = n_meta_out}, mt,
                       &(k3_f32_seg){lg, R * V}, 1);
    } else {
        int64_t nb = n_seqs ? r->act.n_bank : 0;
        k3_f32_seg seg[2] = {{r->act.h, T * D}, {r->act.bank, T * D * nb}};
        if (r->h_act && !r->dev_act) { /* h | bank to host memory for the wire */
            RTRY(r,
                 k3_backend_download(r->be, r->h_act, r->act.h, (size_t)(T * D) * sizeof(float)));
            if (nb)
                RTRY(r, k3_backend_download(r->be, r->h_act + T * D, r->act.bank,
                                            (size_t)(T * D * nb) * sizeof(float)));
            seg[0].p = r->h_act;
            seg[1].p = r->h_act + T * D;
        }
        const int next = k3_plan_rank(&r->plan, r->stage + 1, r->lane);
        const k3_wire_step h = {
            .T = T, .D = D, .R = T, .n_bank = (int32_t)nb, .n_meta = n_meta_out};
        if (r->dev_act) { /* the meta first (it announces the sizes), then the floats */
            rank_post_step(r, next, K3_MSG_ACTIV, h, mt, NULL, 0);
            RTRY(r, k3_comm_send_dev(r->comm, r->be, next, r->act.h, T * D,
                                     "activations to the next stage"));
            RTRY(r, k3_comm_send_dev(r->comm, r->be, next, r->act.bank, T * D * nb,
                                     "the attention-residual bank to the next stage"));
        } else {
            rank_post_step(r, next, K3_MSG_ACTIV, h, mt, seg, 2);
        }
    }
    rank_opstats_end(r, T, n_seqs);
}

/* ---- serving --------------------------------------------------------------------------------- */
bool rank_worker_poll(rank_ctx *r) {
    if (!r->serving) return false;
    step_msg m;
    bool got;
    rank_poll_step(r, r->in_peer, r->in_kind, &m, &got);
    if (got) {
        rank_worker_step(r, &m);
        return true;
    }
    k3_comm_msg stop;
    RTRY(r, k3_comm_poll(r->comm, 0, K3_MSG_STOP, &stop, &got));
    if (got) {
        r->serving = false;
        return true;
    }
    k3_comm_msg beat; /* the coordinator's heartbeat: only its arrival time matters */
    do RTRY(r, k3_comm_poll(r->comm, 0, K3_MSG_BEAT, &beat, &got));
    while (got);
    return false;
}

/* Between requests a worker may idle for hours, so it waits for steps without a limit, but not
 * for the coordinator: rank 0 beats while idle (k3_comm_beat), and a worker that hears nothing
 * from it for --comm-timeout starts the fault exchange. A rank that stalls in the middle of a
 * step is caught by the coordinator's --comm-timeout and by the MoE collectives' own timeouts;
 * a fault report from any rank interrupts the wait here too. */
void rank_worker_serve(rank_ctx *r) {
    int backoff = 0;
    const double timeout = r->o->comm_timeout_s > 0 ? r->o->comm_timeout_s : 600;
    while (r->serving) {
        if (rank_worker_poll(r)) {
            backoff = 0;
            continue;
        }
        double silent = k3_comm_silent_s(r->comm, 0);
        if (silent > timeout) {
            int coord = 0;
            k3_comm_note_timeout(r->comm, &coord, 1, "a step or a heartbeat from the coordinator",
                                 silent);
            rank_die(r, K3_ERR(K3_ERR_COMM,
                               "no step or heartbeat from the coordinator (rank 0) within %.0f s "
                               "(--comm-timeout)",
                               timeout));
        }
        k3_comm_idle(r->comm, &backoff);
    }
}
