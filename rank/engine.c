/* engine.c — the engine API (k3_engine.h): open (collective: plan, hash agreement, load, slots),
 * serve (worker ranks), submit / cancel / step (rank 0), close (collective), the stats, and the
 * end of a job after a fatal fault (k3_engine_abort). The roles themselves live in setup.c,
 * worker.c and scheduler.c; this file owns only the world's totals it gathers. */
#include "k3_engine_test.h"
#include "rank_internal.h"

#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

struct k3_engine {
    rank_ctx r;
    uint64_t *bytes_read_all, *load_us_all;         /* [world], gathered at open */
    uint64_t bytes_read_total;                      /* rank 0: the world's sum */
    double load_s_max;                              /* rank 0: the slowest rank's load */
    uint64_t moe_dispatch_bytes, moe_combine_bytes; /* world sums, at close */
    double busy_final[256];                         /* every rank's forward time, at close */
    double t_step;                                  /* rank 0: when a step last returned */
    uint64_t rss[256], hwm[256], pss[256];          /* every rank's memory, at close */
    int64_t kv_leaked;                              /* the world's leaked cache blocks, at close */
};

static void engine_free(k3_engine *e) {
    rank_ctx *r = &e->r;
    if (r->coord) rank_coord_destroy(r);
    rank_worker_destroy(r);
    rank_opstats_destroy(r);
    rank_hooks_destroy(r);
    k3_free(e->bytes_read_all), k3_free(e->load_us_all), k3_free(r->where);
    if (r->tty && r->tty != stderr) fclose(r->tty);
    k3_comm_destroy(r->comm);
    k3_weights_destroy(r->w);
    if (r->dense && r->dense_device)
        k3_backend_free(r->be, r->dense);
    else if (r->dense)
        munmap(r->dense, r->dense_bytes); /* the node's shared copy: after the weights */
    k3_ckpt_destroy(r->ck);
    k3_backend_destroy(r->be); /* after comm: its MoE buffers are the backend's */
    k3_plan_free(&r->plan);
    k3_free(r->wire);
    free(e);
}

/* Everything after the set-up's agreement: a failure here is a fatal fault of this rank. */
static k3_status open_world(k3_engine *e, const k3_engine_test *t) {
    rank_ctx *r = &e->r;
    const k3_engine_opts *o = r->o;
    RTRY(r, rank_hooks_force(r, t ? t->force : NULL));
    RTRY(r, k3_comm_create(o->comm ? o->comm : "mpi",
                           &(k3_comm_params){.n_stages = r->plan.n_stages,
                                             .n_lanes = r->plan.n_lanes,
                                             .first_worker = r->plan.first_worker,
                                             .timeout_s = rank_comm_timeout(r),
                                             .oversubscribed = r->oversub},
                           &r->comm));
    /* every rank derived the plan itself; they must agree */
    uint64_t *all = NULL, *load_us = NULL;
    RTRY(r, k3_calloc((void **)&all, (size_t)r->world * sizeof(uint64_t), "plan hashes"));
    e->bytes_read_all = all;
    const uint64_t hash = rank_hooks_plan_hash(r, r->plan.hash); /* plan:R: another plan */
    RTRY(r, k3_comm_allgather_u64(r->comm, hash, all));
    for (int i = 0; i < r->world; i++)
        if (all[i] != hash)
            RTRY(r, K3_ERR(K3_ERR_STATE,
                           "plan hash differs: rank %d has %016llx, rank %d has %016llx (different "
                           "config.json or expert map?)",
                           r->rank, (unsigned long long)hash, i, (unsigned long long)all[i]));
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
        K3_LOGI("slots: %d sequences of %lld tokens per lane, %lld tokens per step (prefill "
                "chunks of %lld), %d micro-batch%s, %s combine",
                r->max_seqs, (long long)r->max_ctx, (long long)r->max_tokens, (long long)r->chunk,
                o->micro_batches > 0 ? o->micro_batches : K3_MAX(1, r->plan.n_stages), "es",
                o->deterministic ? "deterministic (per-item)" : "pre-summed");
    }
    /* the bar: on rank 0's terminal; under mpirun stderr is a pipe, but /dev/tty may be ours */
    if (r->rank == 0 && o->progress)
        r->tty = isatty(2) ? stderr : (k3_comm_launched() ? fopen("/dev/tty", "w") : NULL);
    RTRY(r, rank_share_dense(r)); /* one copy of a stage's dense weights per node */
    /* every rank has loaded when it returns (heartbeat, --load-timeout): the usual limit again */
    RTRY(r, rank_load(r));
    RTRY(r, rank_spread_dense(r)); /* device groups: the reader's dense region to the others */
    k3_comm_set_doing(r->comm, "idle (between steps)");
    RTRY(r, k3_calloc((void **)&load_us, (size_t)r->world * sizeof(uint64_t), "load times"));
    RTRY(r, k3_comm_allgather_u64(r->comm, r->dense_skipped, load_us)); /* node sharing */
    uint64_t skipped = 0;
    for (int i = 0; i < r->world; i++) skipped += load_us[i];
    RTRY(r, k3_comm_allgather_u64(r->comm, r->bytes_read, all));
    e->load_us_all = load_us;
    RTRY(r, k3_comm_allgather_u64(r->comm, (uint64_t)(r->load_s * 1e6), load_us));
    if (r->rank == 0) {
        uint64_t sum = 0, plan_sum = 0;
        for (int i = 0; i < r->world; i++) sum += all[i], plan_sum += r->plan.mem[i].weights;
        for (int i = 0; i < r->world; i++) e->load_s_max = K3_MAX(e->load_s_max, load_us[i] / 1e6);
        e->bytes_read_total = sum;
        K3_LOGI("all ranks loaded %.2f MB in %.2f s (%.2f GB/s aggregate); plan %.2f MB%s",
                sum / 1e6, e->load_s_max, e->load_s_max > 0 ? sum / 1e9 / e->load_s_max : 0.0,
                plan_sum / 1e6, skipped ? " (dense weights read once per node and stage)" : "");
        if (sum != plan_sum - skipped)
            K3_LOGW("bytes read (%llu) differ from the plan (%llu, less %llu shared within nodes)",
                    (unsigned long long)sum, (unsigned long long)plan_sum,
                    (unsigned long long)skipped);
    }
    if (r->worker) RTRY(r, rank_worker_init(r));
    if (r->worker) RTRY(r, rank_opstats_init(r));
    if (r->coord) RTRY(r, rank_coord_init(r));
    RTRY(r, k3_comm_barrier(r->comm));
    return rank_load_drain(r);
}

k3_status k3_engine_open_test(const k3_engine_opts *o, const k3_engine_test *t, k3_engine **out) {
    *out = NULL;
    k3_engine *e = calloc(1, sizeof *e);
    if (!e) {
        fprintf(stderr, "%s: out of memory\n", o->name ? o->name : "k3");
        return K3_ERR(K3_ERR_NOMEM, "engine");
    }
    rank_ctx *r = &e->r;
    r->o_ = *o;
    r->o = &r->o_;
    r->stage = r->lane = -1;
    k3_comm_world(&r->rank, &r->world);
    k3_status st = rank_hooks_create(r, t ? t->fail : NULL);
    if (st == K3_OK) st = rank_opstats_agree(r); /* --op-stats needs a backend that counts */
    if (st == K3_OK) st = rank_setup(r);
    if (st != K3_OK && r->fault == K3_OK) { /* agreed by every rank (printed): nothing to end */
        k3_free(r->where);
        k3_plan_free(&r->plan);
        rank_hooks_destroy(r);
        free(e);
        return st;
    }
    *out = e; /* from here on a failure is a fatal fault: the client ends the job */
    if (st != K3_OK) return st;
    r->worker = k3_plan_coords(&r->plan, r->rank, &r->stage, &r->lane);
    r->coord = r->rank == 0;
    k3_log_set_rank(r->rank, r->stage, r->lane);
    return rank_fail(r, open_world(e, t));
}

k3_status k3_engine_open(const k3_engine_opts *o, k3_engine **out) {
    return k3_engine_open_test(o, NULL, out);
}

bool k3_engine_is_coordinator(const k3_engine *e) {
    return e->r.coord;
}

bool k3_engine_failed(const k3_engine *e) {
    return e->r.fault != K3_OK;
}

_Noreturn void k3_engine_abort(k3_engine *e) {
    rank_abort(&e->r);
}

/* A call after a fatal fault: the fault again (the engine takes no more steps). */
static k3_status usable(const rank_ctx *r) {
    return r->fault == K3_OK ? K3_OK : K3_ERR(r->fault, "%s", r->fault_msg);
}

k3_status k3_engine_serve(k3_engine *e) {
    rank_ctx *r = &e->r;
    if (r->coord) return K3_ERR(K3_ERR_STATE, "engine: rank 0 steps, it does not serve");
    K3_TRY(usable(r));
    if (r->worker) K3_TRY(rank_fail(r, rank_worker_serve(r)));
    return k3_engine_close(e, NULL);
}

static k3_status need_coord(const rank_ctx *r, const char *what) {
    if (!r->coord)
        return K3_ERR(K3_ERR_STATE, "engine: %s on rank %d (only rank 0 takes requests)", what,
                      r->rank);
    return usable(r);
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
    K3_TRY(rank_fail(&e->r, rank_coord_step(&e->r, events, n_events)));
    e->t_step = k3_now_s();
    return K3_OK;
}

double k3_engine_silent_s(const k3_engine *e, int *rank) {
    const rank_ctx *r = &e->r;
    double worst = 0;
    *rank = -1;
    if (!r->coord || !r->comm) return 0;
    for (int w = 1; w < r->world; w++) {
        const double s = k3_comm_silent_s(r->comm, w);
        if (s > worst) worst = s, *rank = w;
    }
    return K3_MIN(worst, k3_now_s() - e->t_step);
}

k3_status k3_engine_heartbeat(k3_engine *e) {
    K3_TRY(need_coord(&e->r, "heartbeat"));
    return rank_fail(&e->r, k3_comm_beat(e->r.comm));
}

bool k3_engine_rank_busy(const k3_engine *e, int rank, double *busy_s, uint64_t *steps) {
    const rank_ctx *r = &e->r;
    if (!r->coord || rank < 0 || rank >= r->world || (r->plan.first_worker == 1 && rank == 0))
        return false;
    return rank_coord_rank_busy(r, rank, busy_s, steps);
}

bool k3_engine_rank_view_of(const k3_engine *e, int rank, k3_engine_rank_view *out) {
    const rank_ctx *r = &e->r;
    memset(out, 0, sizeof *out);
    if (!r->coord || rank < 0 || rank >= r->world) return false;
    out->stage = out->lane = -1;
    k3_plan_coords(&r->plan, rank, &out->stage, &out->lane);
    out->node = r->where ? r->where[rank].node : 0;
    for (int w = 0; w < rank && r->where; w++) out->local += r->where[w].node == out->node;
    out->host = r->where ? r->where[rank].host : "";
    if (rank != r->rank && r->comm)
        out->silent_s = K3_MIN(k3_comm_silent_s(r->comm, rank), k3_now_s() - e->t_step);
    out->mem = r->plan.mem[rank];
    if (rank == r->rank) {
        uint64_t hwm = 0, pss = 0;
        k3_proc_memory(&out->rss, &hwm, &pss);
    }
    return true;
}

int k3_engine_pending(const k3_engine *e) {
    return e->r.coord ? rank_coord_pending(&e->r) : 0;
}

void k3_engine_load(const k3_engine *e, int *running, int *waiting, double *cache_usage) {
    *running = *waiting = 0;
    *cache_usage = 0;
    if (e->r.coord) rank_coord_load(&e->r, running, waiting, cache_usage);
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
    out->max_seqs = r->max_seqs;
    out->dedicated = r->plan.coord == K3_COORD_DEDICATED;
    out->plan_hash = r->plan.hash;
    out->max_ctx = r->max_ctx;
    out->max_batch_tokens = r->max_tokens;
    if (r->coord) rank_coord_stats(r, out);
    out->load_s = e->load_s_max;
    out->bytes_read = e->bytes_read_total;
    for (int i = 0; i < r->world; i++) out->plan_bytes += r->plan.mem[i].weights;
    for (int s = 0; s < r->plan.n_stages && s < 64; s++) {
        out->stages[2 * s] = r->plan.stage_begin[s];
        out->stages[2 * s + 1] = r->plan.stage_begin[s + 1];
    }
    out->moe_dispatch_bytes = e->moe_dispatch_bytes;
    out->moe_combine_bytes = e->moe_combine_bytes;
    out->kv_blocks_leaked = e->kv_leaked;
    for (int i = 0; i < r->world && i < 256; i++) {
        out->busy_s[i] = e->busy_final[i];
        out->rss_bytes[i] = e->rss[i], out->hwm_bytes[i] = e->hwm[i], out->pss_bytes[i] = e->pss[i];
    }
}

bool k3_engine_rank_info(const k3_engine *e, int rank, int *stage, int *lane, uint64_t *bytes_read,
                         uint64_t *plan_weight_bytes, double *load_s) {
    const rank_ctx *r = &e->r;
    if (rank < 0 || rank >= r->world) return false;
    *stage = *lane = -1;
    k3_plan_coords(&r->plan, rank, stage, lane);
    *bytes_read = e->bytes_read_all ? e->bytes_read_all[rank] : 0;
    *plan_weight_bytes = r->plan.mem[rank].weights;
    *load_s = e->load_us_all ? e->load_us_all[rank] / 1e6 : 0;
    return true;
}

/* The collective part of close: stop the workers, sum the world's traffic and times, --op-stats. */
static k3_status close_world(k3_engine *e, k3_engine_stats *final) {
    rank_ctx *r = &e->r;
    K3_TRY(usable(r));
    if (r->coord) {
        /* finish what is in flight (events dropped), then stop every worker */
        while (k3_engine_pending(e) > 0) {
            rank_coord_cancel_all(r);
            const k3_event *ev;
            int n_ev;
            K3_TRY(rank_coord_step(r, &ev, &n_ev));
        }
        for (int w = 0; w < r->world; w++)
            if (w != r->rank && k3_plan_coords(&r->plan, w, NULL, NULL))
                RTRY(r, k3_comm_post(r->comm, w, K3_MSG_STOP, NULL, 0, NULL, 0));
    }
    { /* MoE traffic of the whole world (both combine modes report it, to be compared) */
        k3_comm_stats cs;
        k3_comm_get_stats(r->comm, &cs);
        uint64_t *all = e->bytes_read_all;
        int n_forward = 0;
        double busy_s = 0;
        rank_worker_busy(r, &n_forward, &busy_s);
        RTRY(r, k3_comm_allgather_u64(r->comm, cs.dispatch_bytes, all));
        for (int i = 0; i < r->world; i++) e->moe_dispatch_bytes += all[i];
        RTRY(r, k3_comm_allgather_u64(r->comm, cs.combine_bytes, all));
        for (int i = 0; i < r->world; i++) e->moe_combine_bytes += all[i];
        RTRY(r, k3_comm_allgather_u64(r->comm, (uint64_t)(busy_s * 1e6), all));
        for (int i = 0; i < r->world && i < 256; i++) e->busy_final[i] = all[i] / 1e6;
        /* every request ended: each stage's blocks are the prefix cache's, or leaked */
        RTRY(r, k3_comm_allgather_u64(r->comm, (uint64_t)rank_worker_leaked_blocks(r), all));
        for (int i = 0; i < r->world; i++) e->kv_leaked += (int64_t)all[i];
        uint64_t mem[3];
        k3_proc_memory(&mem[0], &mem[1], &mem[2]);
        uint64_t *dst[3] = {e->rss, e->hwm, e->pss};
        for (int k = 0; k < 3; k++) {
            RTRY(r, k3_comm_allgather_u64(r->comm, mem[k], all));
            for (int i = 0; i < r->world && i < 256; i++) dst[k][i] = all[i];
        }
        if (r->worker)
            K3_LOGD("forward steps %d, MoE rows sent %llu (dispatch) + %llu (combine)", n_forward,
                    (unsigned long long)cs.dispatch_rows, (unsigned long long)cs.combine_rows);
    }
    int ops_rc = 0;
    RTRY(r, rank_opstats_write(r, &ops_rc)); /* collective with --op-stats; rank 0 writes */
    if (final && r->coord) {
        k3_engine_get_stats(e, final);
        final->op_stats_rc = ops_rc;
    }
    RTRY(r, k3_comm_flush(r->comm));
    RTRY(r, k3_comm_barrier(r->comm));
    return K3_OK;
}

k3_status k3_engine_close(k3_engine *e, k3_engine_stats *final) {
    if (!e) return K3_OK;
    K3_TRY(rank_fail(&e->r, close_world(e, final)));
    engine_free(e);
    return K3_OK;
}
