/* setup.c — what a rank does before the first step: prompts, config, stop ids, the plan and the
 * agreement on it, the memory check, partial loading with an aggregate progress bar; and
 * k3_rank_run, which strings the roles together. */
#include "rank_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

/* ---- prompts ------------------------------------------------------------------------------ */
k3_status k3_rank_parse_prompts(const char *text, int32_t **ids, int64_t **lens, int *n_prompts) {
    *ids = NULL;
    *lens = NULL;
    *n_prompts = 0;
    size_t n = strlen(text);
    int np = 1;
    for (size_t i = 0; i < n; i++) np += text[i] == ';';
    K3_TRY(k3_alloc((void **)ids, (n / 2 + 2) * sizeof(int32_t), "prompt ids"));
    k3_status st = k3_calloc((void **)lens, (size_t)np * sizeof(int64_t), "prompt lengths");
    if (st != K3_OK) {
        k3_free(*ids);
        *ids = NULL;
        return st;
    }
    const char *p = text;
    int k = 0;
    int64_t tot = 0;
    while (1) {
        while (*p == ' ') p++;
        if (*p == ';' || *p == 0) {
            if ((*lens)[k] == 0) {
                st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d is empty", k + 1);
                goto fail;
            }
            if (*p == 0) break;
            k++;
            p++;
            continue;
        }
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d, id %lld: '%.12s' is not a token id",
                        k + 1, (long long)(*lens)[k] + 1, p);
            goto fail;
        }
        (*ids)[tot++] = (int32_t)v;
        (*lens)[k]++;
        p = end;
        while (*p == ' ') p++;
        if (*p == ',') {
            p++;
            while (*p == ' ') p++;
            if (*p == ';' || *p == 0) {
                st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d ends with ','", k + 1);
                goto fail;
            }
        } else if (*p != ';' && *p != 0) {
            st = K3_ERR(K3_ERR_ARG, "--prompt-ids: prompt %d: unexpected '%c'", k + 1, *p);
            goto fail;
        }
    }
    *n_prompts = k + 1;
    return K3_OK;
fail:
    k3_free(*ids), k3_free(*lens);
    *ids = NULL, *lens = NULL;
    return st;
}

/* ---- set-up ------------------------------------------------------------------------------- */
static int ceil_div(int a, int b) {
    return (a + b - 1) / b;
}

/* Stop ids: the caller's, then (unless ignore_eos) config eos_token_id and the tokenizer's
 * <|end_of_msg|> and [EOS]; duplicates and ids outside the logits (>= vocab_size) dropped. */
static k3_status build_stops(rank_ctx *r) {
    const k3_rank_opts *o = r->o;
    size_t cap = o->sampling.n_stop_ids + 3;
    K3_TRY(k3_alloc((void **)&r->stop_ids, cap * sizeof(int32_t), "stop ids"));
    int32_t cand[3] = {-1, -1, -1};
    if (!o->ignore_eos) {
        cand[0] = r->cfg.eos_token_id;
        if (o->tok) {
            k3_tok_ctrl c = k3_tok_control_ids(o->tok);
            cand[1] = c.end_of_msg;
            cand[2] = c.eos;
        }
    }
    for (size_t i = 0; i < cap; i++) {
        int32_t id =
            i < o->sampling.n_stop_ids ? o->sampling.stop_ids[i] : cand[i - o->sampling.n_stop_ids];
        if (i < o->sampling.n_stop_ids && (id < 0 || id >= r->cfg.vocab_size))
            return K3_ERR(K3_ERR_ARG, "stop id %d is outside the vocabulary (vocab_size %lld)", id,
                          (long long)r->cfg.vocab_size);
        if (id < 0 || id >= r->cfg.vocab_size) continue;
        bool dup = false;
        for (size_t k = 0; k < r->n_stop_ids; k++) dup |= r->stop_ids[k] == id;
        if (!dup) r->stop_ids[r->n_stop_ids++] = id;
    }
    return K3_OK;
}

uint64_t k3_rank_seq_seed(uint64_t seed, int index) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * ((uint64_t)(uint32_t)index + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

const char *k3_rank_finish_reason(k3_stop_kind stop) {
    return stop == K3_STOP_NONE ? "length" : "stop";
}

void k3_rank_result_free(k3_rank_result *res) {
    if (!res) return;
    for (int i = 0; i < res->n_seqs; i++) k3_free(res->seqs[i].gen), k3_free(res->seqs[i].text);
    k3_free(res->seqs);
    res->seqs = NULL;
    res->n_seqs = 0;
}

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
                  "rank %d needs %.2f GB (weights %.2f, caches %.2f for %d sequences of up to "
                  "%lld tokens (prompt + --n), buffers %.2f) but this machine has %.2f GB",
                  r->rank, need / 1e9, m->weights / 1e9, m->caches / 1e9, req->max_seqs_per_lane,
                  (long long)req->max_ctx, m->buffers / 1e9, have / 1e9);
}

/* Usage-type problems are identical on every rank: all return 2, rank 0 prints. Others: agree on
 * the worst status so nobody hangs in the next collective. */
int rank_setup(rank_ctx *r) {
    const k3_rank_opts *o = r->o;
    k3_status st = K3_OK;
    char *map = NULL;
    if (o->n_prompts < 1 || o->n_new < 0 || o->chunk < 0)
        st = K3_ERR(K3_ERR_ARG, "run: need at least one prompt, --n >= 0 and --chunk >= 0");
    if (st == K3_OK) st = k3_config_load(o->model_dir, &r->cfg);
    int64_t tot = 0;
    for (int i = 0; i < o->n_prompts && st == K3_OK; i++)
        for (int64_t t = 0; t < o->prompt_lens[i] && st == K3_OK; t++, tot++)
            if (o->prompt_ids[tot] < 0 || o->prompt_ids[tot] >= r->cfg.vocab_size)
                st = K3_ERR(K3_ERR_ARG,
                            "prompt %d: id %d at position %lld is not below vocab_size %lld", i + 1,
                            o->prompt_ids[tot], (long long)t, (long long)r->cfg.vocab_size);
    if (st == K3_OK) st = build_stops(r);
    if (st == K3_OK) { /* bad sampling parameters are a usage error every rank sees */
        k3_sampler *probe = NULL;
        k3_sampler_params sp = o->sampling;
        sp.stop_ids = r->stop_ids;
        sp.n_stop_ids = r->n_stop_ids;
        st = k3_sampler_create(&probe, &sp, r->cfg.vocab_size, o->tok);
        k3_sampler_destroy(probe);
    }
    if (st == K3_OK && o->expert_map_path) {
        size_t nb;
        st = k3_read_file(o->expert_map_path, &map, &nb);
    }
    int64_t maxP = 0;
    for (int i = 0; i < o->n_prompts; i++) maxP = K3_MAX(maxP, o->prompt_lens[i]);
    int E = K3_MAX(o->ep, 1), S = K3_MAX(o->pp, 1);
    r->n_groups = K3_MAX(1, K3_MIN(S, ceil_div(o->n_prompts, E)));
    /* the most sequences one lane has in one group */
    int most = 0;
    for (int e = 0; e < E; e++)
        for (int g = 0; g < r->n_groups; g++) {
            int n = 0;
            for (int i = 0; i < o->n_prompts; i++)
                n += (i % E == e) && ((i / E) % r->n_groups == g);
            most = K3_MAX(most, n);
        }
    int64_t step = o->chunk > 0 ? K3_MIN(o->chunk, maxP) : maxP;
    r->max_tokens = K3_MAX(1, (int64_t)most * K3_MAX(step, 1));
    if (st == K3_OK) {
        k3_plan_req req = {.world = r->world,
                           .pp = o->pp,
                           .ep = o->ep,
                           .coord = o->coord,
                           .expert_map = map,
                           .expert_map_name = o->expert_map_path,
                           .max_ctx = maxP + o->n_new,
                           .max_seqs_per_lane = ceil_div(o->n_prompts, E),
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
        fprintf(stderr, "k3 run: %s\n", k3_last_error());
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

/* ---- entry -------------------------------------------------------------------------------- */
int k3_rank_run(const k3_rank_opts *o) {
    rank_ctx r_, *r = &r_;
    memset(r, 0, sizeof *r);
    r->o = o;
    r->stage = r->lane = -1;
    k3_comm_world(&r->rank, &r->world);
    rank_hooks_parse(r);
    int rc = rank_setup(r);
    if (rc) {
        k3_plan_free(&r->plan);
        k3_free(r->stop_ids);
        return rc;
    }
    r->worker = k3_plan_coords(&r->plan, r->rank, &r->stage, &r->lane);
    r->coord = r->rank == 0;
    k3_log_set_rank(r->rank, r->stage, r->lane);
    double tmo = o->comm_timeout_s > 0 ? o->comm_timeout_s : 600;
    RTRY(r, k3_comm_create("mpi",
                           &(k3_comm_params){.n_stages = r->plan.n_stages,
                                             .n_lanes = r->plan.n_lanes,
                                             .first_worker = r->plan.first_worker,
                                             .timeout_s = tmo},
                           &r->comm));
    /* every rank derived the plan itself; they must agree */
    uint64_t *all = NULL, *bytes = NULL, *load_us = NULL;
    RTRY(r, k3_calloc((void **)&all, (size_t)r->world * sizeof(uint64_t), "plan hashes"));
    RTRY(r, k3_calloc((void **)&bytes, (size_t)r->world * sizeof(uint64_t), "bytes read"));
    RTRY(r, k3_calloc((void **)&load_us, (size_t)r->world * sizeof(uint64_t), "load times"));
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
        K3_LOGI("%d prompt%s, %d micro-batch%s in flight, %s combine", o->n_prompts,
                o->n_prompts > 1 ? "s" : "", r->n_groups, r->n_groups > 1 ? "es" : "",
                o->deterministic ? "deterministic (per-item)" : "pre-summed");
    }
    /* the bar: on rank 0's terminal; under mpirun stderr is a pipe, but /dev/tty may be ours */
    if (r->rank == 0)
        r->tty = isatty(2) ? stderr : (k3_comm_launched() ? fopen("/dev/tty", "w") : NULL);
    int tty = r->tty != NULL;
    int any_tty = 0;
    RTRY(r, k3_comm_world_max(tty, &any_tty, tmo));
    r->show_progress = any_tty != 0;
    if (r->show_progress && r->rank == 0)
        RTRY(r, k3_calloc((void **)&r->pct, (size_t)r->world * sizeof(int), "progress"));
    rank_load(r);
    /* other ranks may still be loading (a real checkpoint takes minutes): wait longer here */
    k3_comm_set_timeout(r->comm, K3_MAX(tmo, 3600.0));
    RTRY(r, k3_comm_allgather_u64(r->comm, r->bytes_read, bytes));
    k3_comm_set_timeout(r->comm, tmo);
    RTRY(r, k3_comm_allgather_u64(r->comm, (uint64_t)(r->load_s * 1e6), load_us));
    if (r->rank == 0) {
        uint64_t sum = 0, plan_sum = 0;
        for (int i = 0; i < r->world; i++) sum += bytes[i], plan_sum += r->plan.mem[i].weights;
        double ls = 0;
        for (int i = 0; i < r->world; i++) ls = K3_MAX(ls, load_us[i] / 1e6);
        K3_LOGI("all ranks loaded %.2f MB in %.2f s (%.2f GB/s aggregate); plan %.2f MB", sum / 1e6,
                ls, ls > 0 ? sum / 1e9 / ls : 0.0, plan_sum / 1e6);
        if (sum != plan_sum)
            K3_LOGW("bytes read (%llu) differ from the plan (%llu)", (unsigned long long)sum,
                    (unsigned long long)plan_sum);
    }
    if (r->worker) rank_worker_init(r);
    if (r->coord) rank_coord_init(r);
    RTRY(r, k3_comm_barrier(r->comm));
    rank_run_loop(r);
    double t_end = k3_now_s();
    { /* MoE traffic of the whole world (both combine modes report it, to be compared) */
        k3_comm_stats cs;
        k3_comm_get_stats(r->comm, &cs);
        RTRY(r, k3_comm_allgather_u64(r->comm, cs.dispatch_bytes, all));
        for (int i = 0; i < r->world; i++) r->moe_dispatch_bytes += all[i];
        RTRY(r, k3_comm_allgather_u64(r->comm, cs.combine_bytes, all));
        for (int i = 0; i < r->world; i++) r->moe_combine_bytes += all[i];
    }
    if (r->coord) rank_report(r, bytes, load_us, t_end);
    fflush(stdout);
    RTRY(r, k3_comm_barrier(r->comm));
    if (r->worker) {
        k3_comm_stats cs;
        k3_comm_get_stats(r->comm, &cs);
        K3_LOGD("forward steps %d, MoE rows sent %llu (dispatch) + %llu (combine)", r->n_forward,
                (unsigned long long)cs.dispatch_rows, (unsigned long long)cs.combine_rows);
    }
    rank_coord_destroy(r);
    rank_worker_destroy(r);
    k3_free(all), k3_free(bytes), k3_free(load_us), k3_free(r->pct);
    if (r->tty && r->tty != stderr) fclose(r->tty);
    k3_comm_destroy(r->comm);
    k3_backend_destroy(r->be);
    k3_plan_free(&r->plan);
    k3_free(r->stop_ids);
    k3_free(r->wire);
    return 0;
}
