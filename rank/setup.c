/* setup.c — what a rank does before the first step: config, capacity, the plan and the agreement
 * on it, the memory check, and partial loading with an aggregate progress bar. */
#include "rank_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

/* ---- set-up ------------------------------------------------------------------------------- */
/* Refuse a plan this rank cannot hold before allocating anything: a huge --n or prompt sizes
 * every sequence's caches for its whole context up front, and an OOM kill names nobody. */
static k3_status check_memory(const rank_ctx *r, const k3_plan_req *req) {
    const k3_rank_mem *m = &r->plan.mem[r->rank];
    uint64_t need = m->weights + m->caches + m->buffers;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return K3_OK; /* unknown: nothing to compare against */
    uint64_t have = (uint64_t)pages * (uint64_t)page;
    if (need <= have) return K3_OK;
    return K3_ERR(K3_ERR_NOMEM,
                  "rank %d needs %.2f GB (weights %.2f, caches %.2f for %d sequence slots of "
                  "%lld tokens (--max-seqs, --max-ctx), buffers %.2f) but this machine has %.2f GB",
                  r->rank, need / 1e9, m->weights / 1e9, m->caches / 1e9, req->max_seqs_per_lane,
                  (long long)req->max_ctx, m->buffers / 1e9, have / 1e9);
}

/* Usage-type problems are identical on every rank: all return 2, rank 0 prints. Others: agree on
 * the worst status so nobody hangs in the next collective. */
int rank_setup(rank_ctx *r) {
    const k3_engine_opts *o = r->o;
    k3_status st = K3_OK;
    char *map = NULL;
    r->max_seqs = o->max_seqs > 0 ? o->max_seqs : K3_ENGINE_DEFAULT_MAX_SEQS;
    r->max_ctx = o->max_ctx > 0 ? o->max_ctx : K3_ENGINE_DEFAULT_MAX_CTX;
    r->max_tokens =
        o->max_batch_tokens > 0 ? o->max_batch_tokens : K3_ENGINE_DEFAULT_MAX_BATCH_TOKENS;
    r->chunk = o->chunk > 0 ? K3_MIN(o->chunk, r->max_tokens) : r->max_tokens;
    if (o->max_seqs < 0 || o->max_ctx < 0 || o->max_batch_tokens < 0 || o->chunk < 0 ||
        o->micro_batches < 0 || o->micro_batches > 1024)
        st = K3_ERR(K3_ERR_ARG, "--max-seqs, --max-ctx, --max-batch-tokens, --chunk and "
                                "--micro-batches (<= 1024) must be >= 0");
    if (st == K3_OK) st = k3_config_load(o->model_dir, &r->cfg);
    r->base_stops[0] = r->cfg.eos_token_id;
    r->base_stops[1] = r->base_stops[2] = -1;
    if (st == K3_OK && o->tok) {
        k3_tok_ctrl c = k3_tok_control_ids(o->tok);
        r->base_stops[1] = c.end_of_msg;
        r->base_stops[2] = c.eos;
    }
    for (int i = 0; i < 3; i++)
        if (r->base_stops[i] >= r->cfg.vocab_size) r->base_stops[i] = -1;
    if (st == K3_OK && o->expert_map_path) {
        size_t nb;
        st = k3_read_file(o->expert_map_path, &map, &nb);
    }
    if (st == K3_OK) {
        k3_plan_req req = {.world = r->world,
                           .pp = o->pp,
                           .ep = o->ep,
                           .coord = o->coord,
                           .expert_map = map,
                           .expert_map_name = o->expert_map_path,
                           .max_ctx = r->max_ctx,
                           .max_seqs_per_lane = r->max_seqs,
                           .max_tokens = r->max_tokens};
        st = k3_plan_make(&r->cfg, &req, &r->plan);
        if (st == K3_OK) st = check_memory(r, &req);
    }
    k3_free(map);
    /* agree before anything collective: 0 ok, 1 usage error, 2 other error */
    int local = st == K3_OK ? 0 : (st == K3_ERR_ARG ? 1 : 2), worst = 0;
    k3_status st2 =
        k3_comm_world_max(local, &worst, o->comm_timeout_s > 0 ? o->comm_timeout_s : 600);
    if (st2 != K3_OK) rank_die(r, st2);
    /* a usage error is the same on every rank: rank 0 prints it; other errors each rank prints */
    if (local == 2 || (local == 1 && r->rank == 0))
        fprintf(stderr, "%s: %s\n", rank_cmd_name(r), k3_last_error());
    if (local == 2 && r->world > 1) K3_LOGE("rank %d failed during set-up (see above)", r->rank);
    if (worst) return worst == 1 ? 2 : 1;
    return 0;
}

/* ---- loading ------------------------------------------------------------------------------ */
static bool expert_owned(void *ctx, int layer, int expert) {
    rank_ctx *r = ctx;
    return k3_plan_owner_lane(&r->plan, layer, expert) == r->lane;
}

static void draw_progress(rank_ctx *r) {
    double have = 0, tot = 0;
    int done = 0;
    for (int i = 0; i < r->world; i++) {
        double w = (double)r->plan.mem[i].weights;
        have += w * r->pct[i] / 100.0;
        tot += w;
        done += r->pct[i] >= 100;
    }
    double f = tot > 0 ? have / tot : 1;
    char bar[41];
    int n = (int)(f * 40 + 0.5);
    for (int i = 0; i < 40; i++) bar[i] = i < n ? '#' : ' ';
    bar[40] = 0;
    fprintf(r->tty, "\r[k3] loading [%s] %3.0f%%  %.1f of %.1f MB, %d/%d ranks done", bar, f * 100,
            have / 1e6, tot / 1e6, done, r->world);
    fflush(r->tty);
}

static bool poll_progress(rank_ctx *r) { /* true when some rank reported */
    bool any = false;
    for (;;) {
        k3_comm_msg m;
        bool got = false;
        RTRY(r, k3_comm_poll(r->comm, K3_ANY_RANK, K3_MSG_PROGRESS, &m, &got));
        if (!got) return any;
        k3_wire_progress wp;
        if (m.n_meta_bytes == (int64_t)sizeof wp && m.src >= 0 && m.src < r->world) {
            memcpy(&wp, m.meta, sizeof wp);
            if (wp.version == K3_WIRE_VERSION) r->pct[m.src] = K3_MAX(r->pct[m.src], wp.pct);
        }
        any = true;
    }
}

void rank_send_progress(rank_ctx *r, int pct) {
    if (r->rank == 0) {
        r->pct[0] = pct;
        poll_progress(r);
        draw_progress(r);
        return;
    }
    k3_wire_progress wp = {.version = K3_WIRE_VERSION, .pct = pct};
    RTRY(r, k3_comm_post(r->comm, 0, K3_MSG_PROGRESS, &wp, sizeof wp, NULL, 0));
}

static void on_progress(void *ctx, uint64_t done, uint64_t total) {
    rank_ctx *r = ctx;
    if (!r->show_progress || total == 0) return;
    int pct = (int)(100.0 * (double)done / (double)total);
    pct = pct >= 100 ? 100 : pct / 25 * 25; /* a few reports per rank keep it cheap */
    if (pct > r->last_pct_sent) {
        r->last_pct_sent = pct;
        rank_send_progress(r, pct);
    }
}

void rank_load(rank_ctx *r) {
    double t0 = k3_now_s();
    if (r->worker) {
        if (r->fail_load_rank == r->rank)
            rank_die(r, K3_ERR(K3_ERR_IO,
                               "test hook K3_TEST_FAIL=load:%d: failing the load on purpose",
                               r->rank));
        RTRY(r, k3_ckpt_open(r->o->model_dir, &r->ck));
        int S = r->plan.n_stages;
        k3_backend_params bp = {.n_threads =
                                    r->o->n_threads > 0 ? r->o->n_threads : (r->world > 1 ? 1 : 0)};
        RTRY(r, k3_backend_create(r->o->backend ? r->o->backend : "cpu", &bp, &r->be));
        k3_load_sel sel = {.be = r->be,
                           .layer_begin = r->plan.stage_begin[r->stage],
                           .layer_end = r->plan.stage_begin[r->stage + 1],
                           .embed = r->stage == 0,
                           .head = r->stage == S - 1,
                           .expert_owned = expert_owned,
                           .ctx = r,
                           .progress = on_progress};
        RTRY(r, k3_weights_load(r->ck, &r->cfg, &sel, &r->w));
        r->view = k3_weights_get(r->w);
        r->bytes_read = k3_ckpt_bytes_read(r->ck);
        /* the loader must have honoured the plan: own experts present, others absent */
        for (int l = sel.layer_begin; l < sel.layer_end; l++) {
            const k3_layer_w *lw = &r->view->layers[l];
            if (!lw->present)
                rank_die(r, K3_ERR(K3_ERR_INTERNAL, "layer %d of my stage was not loaded", l));
            if (!k3_config_is_moe(&r->cfg, l)) continue;
            for (int x = 0; x < r->cfg.n_experts; x++) {
                bool own = k3_plan_owner_lane(&r->plan, l, x) == r->lane;
                const k3_expert_w *ew = &lw->experts[x];
                bool loaded = ew->w1.data && ew->w2.data && ew->w3.data;
                if (loaded != own || (ew->present && !loaded))
                    rank_die(r, K3_ERR(K3_ERR_INTERNAL,
                                       "layer %d expert %d: loaded=%d but the plan says owned=%d",
                                       l, x, loaded, own));
            }
        }
        if (r->show_progress && r->last_pct_sent < 100) {
            r->last_pct_sent = 100;
            rank_send_progress(r, 100);
        }
    }
    r->load_s = k3_now_s() - t0;
    if (r->worker)
        K3_LOGI("loaded %.2f MB in %.2f s (%.2f GB/s); plan: %.2f MB", r->bytes_read / 1e6,
                r->load_s, r->load_s > 0 ? r->bytes_read / 1e9 / r->load_s : 0.0,
                r->plan.mem[r->rank].weights / 1e6);
    if (r->rank == 0 && r->show_progress) { /* wait for everyone's last report */
        r->pct[0] = 100 * r->worker + 100 * !r->worker;
        double t1 = k3_now_s();
        int backoff = 0;
        for (;;) {
            bool changed = poll_progress(r);
            int done = 0;
            for (int i = 0; i < r->world; i++)
                done += r->pct[i] >= 100 || !k3_plan_coords(&r->plan, i, NULL, NULL);
            if (changed || done == r->world) draw_progress(r);
            if (done == r->world) break;
            if (k3_now_s() - t1 > (r->o->comm_timeout_s > 0 ? r->o->comm_timeout_s : 600))
                rank_die(r, K3_ERR(K3_ERR_COMM,
                                   "load progress: some rank did not finish loading in time"));
            k3_comm_idle(r->comm, &backoff);
        }
        fprintf(r->tty, "\n");
        fflush(r->tty);
    }
}
