/* engine.c — the engine API (k3_engine.h): open (collective: plan, hash agreement, load, slots),
 * serve (worker ranks), submit / cancel / step (rank 0), close (collective), and the stats.
 * The roles themselves live in setup.c, worker.c and scheduler.c. */
#include "rank_internal.h"

#include <stdlib.h>
#include <unistd.h>

int k3_engine_open(const k3_engine_opts *o, k3_engine **out) {
    *out = NULL;
    k3_engine *e = calloc(1, sizeof *e);
    if (!e) {
        fprintf(stderr, "%s: out of memory\n", o->name ? o->name : "k3");
        return 1;
    }
    rank_ctx *r = &e->r;
    r->o_ = *o;
    r->o = &r->o_;
    r->stage = r->lane = -1;
    k3_comm_world(&r->rank, &r->world);
    rank_hooks_parse(r);
    int rc = rank_opstats_agree(r); /* --op-stats needs a backend that counts */
    if (!rc) rc = rank_setup(r);
    if (rc) {
        k3_free(r->where);
        k3_plan_free(&r->plan);
        free(e);
        return rc;
    }
    r->worker = k3_plan_coords(&r->plan, r->rank, &r->stage, &r->lane);
    r->coord = r->rank == 0;
    k3_log_set_rank(r->rank, r->stage, r->lane);
    rank_hooks_parse_force(r);
    double tmo = o->comm_timeout_s > 0 ? o->comm_timeout_s : 600;
    RTRY(r, k3_comm_create(o->comm ? o->comm : "mpi",
                           &(k3_comm_params){.n_stages = r->plan.n_stages,
                                             .n_lanes = r->plan.n_lanes,
                                             .first_worker = r->plan.first_worker,
                                             .timeout_s = tmo},
                           &r->comm));
    /* every rank derived the plan itself; they must agree */
    uint64_t *all = NULL;
    RTRY(r, k3_calloc((void **)&all, (size_t)r->world * sizeof(uint64_t), "plan hashes"));
    if (r->fail_plan_rank == r->rank) r->plan.hash ^= 1; /* test hook: a rank with another plan */
    RTRY(r, k3_comm_allgather_u64(r->comm, r->plan.hash, all));
    for (int i = 0; i < r->world; i++)
        if (all[i] != r->plan.hash)
            rank_die(
                r,
                K3_ERR(K3_ERR_STATE,
                       "plan hash differs: rank %d has %016llx, rank %d has %016llx (different "
                       "config.json or expert map?)",
                       r->rank, (unsigned long long)r->plan.hash, i, (unsigned long long)all[i]));
    if (r->rank == 0 && r->world > 1) { /* a world of one is the plain single-process run */
        char table[16384];
        k3_plan_format(&r->plan, &r->cfg, table, sizeof table);
        fprintf(stderr, "%s", table);
    }
    if (r->rank == 0) {
        const char *tr = k3_comm_transport(r->comm);
#ifdef K3_NCCL_EMULATE
        const bool emu = strcmp(tr, "nccl") == 0;
#else
        const bool emu = false;
#endif
        K3_LOGI("comm: %s%s", tr, emu ? " (NCCL stand-in over MPI, emulated)" : "");
    }
    if (r->rank == 0)
        K3_LOGI("slots: %d sequences of %lld tokens per lane, %lld tokens per step (prefill "
                "chunks of %lld), %d micro-batch%s, %s combine",
                r->max_seqs, (long long)r->max_ctx, (long long)r->max_tokens, (long long)r->chunk,
                o->micro_batches > 0 ? o->micro_batches : K3_MAX(1, r->plan.n_stages), "es",
                o->deterministic ? "deterministic (per-item)" : "pre-summed");
    /* the bar: on rank 0's terminal; under mpirun stderr is a pipe, but /dev/tty may be ours */
    if (r->rank == 0 && o->progress)
        r->tty = isatty(2) ? stderr : (k3_comm_launched() ? fopen("/dev/tty", "w") : NULL);
    /* every rank has loaded when it returns (heartbeat, --load-timeout): the usual limit again */
    rank_load(r);
    k3_comm_set_doing(r->comm, "idle (between steps)");
    RTRY(r, k3_comm_allgather_u64(r->comm, r->bytes_read, all));
    uint64_t *load_us = NULL;
    RTRY(r, k3_calloc((void **)&load_us, (size_t)r->world * sizeof(uint64_t), "load times"));
    RTRY(r, k3_comm_allgather_u64(r->comm, (uint64_t)(r->load_s * 1e6), load_us));
    r->bytes_read_all = all;
    r->load_us_all = load_us;
    if (r->rank == 0) {
        uint64_t sum = 0, plan_sum = 0;
        for (int i = 0; i < r->world; i++) sum += all[i], plan_sum += r->plan.mem[i].weights;
        for (int i = 0; i < r->world; i++) r->load_s_max = K3_MAX(r->load_s_max, load_us[i] / 1e6);
        r->bytes_read_total = sum;
        K3_LOGI("all ranks loaded %.2f MB in %.2f s (%.2f GB/s aggregate); plan %.2f MB", sum / 1e6,
                r->load_s_max, r->load_s_max > 0 ? sum / 1e9 / r->load_s_max : 0.0, plan_sum / 1e6);
        if (sum != plan_sum)
            K3_LOGW("bytes read (%llu) differ from the plan (%llu)", (unsigned long long)sum,
                    (unsigned long long)plan_sum);
    }
    if (r->worker) rank_worker_init(r);
    if (r->worker) rank_opstats_init(r);
    if (r->coord) rank_coord_init(r);
    RTRY(r, k3_comm_barrier(r->comm));
    rank_load_drain(r);
    *out = e;
    return 0;
}

bool k3_engine_is_coordinator(const k3_engine *e) {
    return e->r.coord;
}

k3_status k3_engine_serve(k3_engine *e) {
    rank_ctx *r = &e->r;
    if (r->coord) return K3_ERR(K3_ERR_STATE, "engine: rank 0 steps, it does not serve");
    if (r->worker) rank_worker_serve(r);
    return K3_OK;
}

static k3_status need_coord(const rank_ctx *r, const char *what) {
    return r->coord ? K3_OK
                    : K3_ERR(K3_ERR_STATE, "engine: %s on rank %d (only rank 0 takes requests)",
                             what, r->rank);
}

k3_status k3_engine_submit(k3_engine *e, const k3_request *rq, int64_t *id) {
    K3_TRY(need_coord(&e->r, "submit"));
    return rank_coord_submit(&e->r, rq, id);
}

k3_status k3_engine_cancel(k3_engine *e, int64_t id) {
    K3_TRY(need_coord(&e->r, "cancel"));
    return rank_coord_cancel(&e->r, id);
}

k3_status k3_engine_step(k3_engine *e, const k3_event **events, int *n_events) {
    *events = NULL;
    *n_events = 0;
    K3_TRY(need_coord(&e->r, "step"));
    rank_coord_step(&e->r);
    *events = e->r.ev;
    *n_events = e->r.n_ev;
    return K3_OK;
}

k3_status k3_engine_heartbeat(k3_engine *e) {
    K3_TRY(need_coord(&e->r, "heartbeat"));
    return k3_comm_beat(e->r.comm);
}

bool k3_engine_rank_busy(const k3_engine *e, int rank, double *busy_s, uint64_t *steps) {
    const rank_ctx *r = &e->r;
    if (!r->coord || !r->rank_busy_s || rank < 0 || rank >= r->world ||
        (r->plan.first_worker == 1 && rank == 0))
        return false;
    *busy_s = r->rank_busy_s[rank];
    *steps = r->rank_steps[rank];
    return true;
}

int k3_engine_pending(const k3_engine *e) {
    return e->r.coord ? rank_coord_pending(&e->r) : 0;
}

bool k3_engine_in_flight(const k3_engine *e) {
    return e->r.coord && rank_coord_in_flight(&e->r);
}

void k3_engine_get_stats(const k3_engine *e, k3_engine_stats *out) {
    const rank_ctx *r = &e->r;
    memset(out, 0, sizeof *out);
    out->world = r->world;
    out->pp = r->plan.n_stages;
    out->ep = r->plan.n_lanes;
    out->micro_batches = r->n_groups;
    out->max_seqs = r->max_seqs;
    out->dedicated = r->plan.coord == K3_COORD_DEDICATED;
    out->plan_hash = r->plan.hash;
    out->max_ctx = r->max_ctx;
    out->max_batch_tokens = r->max_tokens;
    out->prompt_tokens = r->prompt_tokens;
    out->gen_tokens = r->gen_tokens;
    out->steps = (int64_t)r->n_steps;
    out->logits_bytes = r->logits_bytes;
    out->logits_messages = r->n_logits_msgs;
    out->load_s = r->load_s_max;
    out->bytes_read = r->bytes_read_total;
    for (int i = 0; i < r->world; i++) out->plan_bytes += r->plan.mem[i].weights;
    for (int s = 0; s < r->plan.n_stages && s < 64; s++) {
        out->stages[2 * s] = r->plan.stage_begin[s];
        out->stages[2 * s + 1] = r->plan.stage_begin[s + 1];
    }
    out->moe_dispatch_bytes = r->moe_dispatch_bytes;
    out->moe_combine_bytes = r->moe_combine_bytes;
    for (int i = 0; i < r->world && i < 256; i++) out->busy_s[i] = r->busy_final[i];
}

bool k3_engine_rank_info(const k3_engine *e, int rank, int *stage, int *lane, uint64_t *bytes_read,
                         uint64_t *plan_weight_bytes, double *load_s) {
    const rank_ctx *r = &e->r;
    if (rank < 0 || rank >= r->world) return false;
    *stage = *lane = -1;
    k3_plan_coords(&r->plan, rank, stage, lane);
    *bytes_read = r->bytes_read_all ? r->bytes_read_all[rank] : 0;
    *plan_weight_bytes = r->plan.mem[rank].weights;
    *load_s = r->load_us_all ? r->load_us_all[rank] / 1e6 : 0;
    return true;
}

void k3_engine_close(k3_engine *e, k3_engine_stats *final) {
    if (!e) return;
    rank_ctx *r = &e->r;
    if (r->coord) {
        /* finish what is in flight (events dropped), then stop every worker */
        while (k3_engine_pending(e) > 0) {
            for (int i = 0; i < r->n_reqs; i++)
                if (r->reqs[i]->state != RQ_ENDED) r->reqs[i]->cancel = true;
            rank_coord_step(r);
        }
        for (int w = 0; w < r->world; w++)
            if (w != r->rank && k3_plan_coords(&r->plan, w, NULL, NULL))
                RTRY(r, k3_comm_post(r->comm, w, K3_MSG_STOP, NULL, 0, NULL, 0));
        r->serving = false;
    }
    { /* MoE traffic of the whole world (both combine modes report it, to be compared) */
        k3_comm_stats cs;
        k3_comm_get_stats(r->comm, &cs);
        uint64_t *all = r->bytes_read_all;
        RTRY(r, k3_comm_allgather_u64(r->comm, cs.dispatch_bytes, all));
        for (int i = 0; i < r->world; i++) r->moe_dispatch_bytes += all[i];
        RTRY(r, k3_comm_allgather_u64(r->comm, cs.combine_bytes, all));
        for (int i = 0; i < r->world; i++) r->moe_combine_bytes += all[i];
        RTRY(r, k3_comm_allgather_u64(r->comm, (uint64_t)(r->busy_s * 1e6), all));
        for (int i = 0; i < r->world && i < 256; i++) r->busy_final[i] = all[i] / 1e6;
        if (r->worker)
            K3_LOGD("forward steps %d, MoE rows sent %llu (dispatch) + %llu (combine)",
                    r->n_forward, (unsigned long long)cs.dispatch_rows,
                    (unsigned long long)cs.combine_rows);
    }
    const int ops_rc = rank_opstats_write(r); /* collective with --op-stats; rank 0 writes */
    if (final && r->coord) {
        k3_engine_get_stats(e, final);
        final->op_stats_rc = ops_rc;
    }
    RTRY(r, k3_comm_flush(r->comm));
    RTRY(r, k3_comm_barrier(r->comm));
    if (r->coord) rank_coord_destroy(r);
    rank_worker_destroy(r);
    k3_free(r->pct), k3_free(r->hb_state), k3_free(r->hb_bytes), k3_free(r->seen);
    k3_free(r->bytes_read_all), k3_free(r->load_us_all), k3_free(r->where);
    if (r->tty && r->tty != stderr) fclose(r->tty);
    k3_comm_destroy(r->comm);
    k3_backend_destroy(r->be);
    k3_plan_free(&r->plan);
    k3_free(r->wire);
    free(e);
}
