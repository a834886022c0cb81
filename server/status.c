/* status.c — GET /v1/k3/status: what rank 0 knows of the running cluster, as JSON for the page at
 * / (server/ui/index.html), and the history of its live counters that the page charts.
 *
 * Owns: the cluster view (set once when k3_server_run starts: every rank's stage and lane, host,
 * node, device, the plan's memory for it), the live per-rank health (how long since rank 0 heard
 * from each rank: a step's LOGITS or an idle heartbeat's answer; down past HEALTH_SILENT_S as
 * /health says), and a ring of one sample a second over the last SRV_STATUS_N seconds: requests
 * running and waiting, generated tokens per second (the engine's own count, every token as it
 * is made), TTFT and ITL p50 / p90 / p99 over the last SRV_STATUS_WINDOW seconds, and the paged
 * cache's and the prefix cache's use. The percentiles come from the /metrics histograms' growth
 * over the window, interpolated inside a bucket as Prometheus' histogram_quantile does, so they
 * are what a Grafana panel over /metrics shows (coarse where the buckets are).
 * The fields live in the server (server_internal.h: srv_status, under its mutex); this file fills
 * and prints them. */
#include "server_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>

void srv_status_init(srv_status *st, const k3_engine *e, double now) {
    k3_engine_stats es;
    k3_engine_get_stats(e, &es);
    st->t_start = st->t_tick = now;
    st->world = es.world, st->pp = es.pp, st->ep = es.ep, st->dedicated = es.dedicated;
    st->max_seqs = es.max_seqs, st->max_ctx = es.max_ctx;
    st->gen_last = es.gen_tokens;
    st->n_ranks = K3_MIN(es.world, SRV_MAX_RANKS);
    for (int w = 0; w < st->n_ranks; w++) {
        k3_engine_rank_view v;
        srv_rank_status *r = &st->ranks[w];
        if (!k3_engine_rank_view_of(e, w, &v)) v.stage = v.lane = -1;
        r->stage = v.stage, r->lane = v.lane, r->node = v.node, r->local = v.local;
        snprintf(r->host, sizeof r->host, "%s", v.host ? v.host : "");
        r->mem_weights = v.mem.weights, r->mem_caches = v.mem.caches;
        r->mem_buffers = v.mem.buffers, r->mem_workspace = v.mem.workspace;
    }
}

/* The q-quantile (0..1) of the observations in a histogram; NAN when it holds none. */
static double quantile(const uint64_t *count, double q) {
    uint64_t n = 0;
    for (int b = 0; b <= SRV_N_BUCKETS; b++) n += count[b];
    if (n == 0) return NAN;
    const double rank = q * (double)n;
    uint64_t cum = 0;
    for (int b = 0; b <= SRV_N_BUCKETS; b++) {
        if (count[b] == 0 || (double)(cum + count[b]) < rank) {
            cum += count[b];
            continue;
        }
        if (b == SRV_N_BUCKETS)
            return srv_hist_bounds[SRV_N_BUCKETS - 1]; /* +Inf: the last bound */
        const double lo = b ? srv_hist_bounds[b - 1] : 0, hi = srv_hist_bounds[b];
        return lo + (hi - lo) * (rank - (double)cum) / (double)count[b];
    }
    return srv_hist_bounds[SRV_N_BUCKETS - 1];
}

/* The window's growth of a histogram: now minus the snapshot SRV_STATUS_WINDOW ticks ago. */
static void window(const srv_hist *now, const srv_hist *then, uint64_t *out) {
    for (int b = 0; b <= SRV_N_BUCKETS; b++) out[b] = now->count[b] - then->count[b];
}

void srv_status_tick(srv_status *st, const srv_metrics *m, const k3_engine *e, double now) {
    if (now - st->t_tick < 1.0) return;
    for (int w = 0; w < st->n_ranks; w++) {
        k3_engine_rank_view v;
        if (k3_engine_rank_view_of(e, w, &v))
            st->ranks[w].silent_s = v.silent_s, st->ranks[w].rss = v.rss;
    }
    k3_engine_stats es;
    k3_engine_get_stats(e, &es);
    const double dt = now - st->t_tick;
    const int at = st->n_snap % (SRV_STATUS_WINDOW + 1);
    const int old = st->n_snap >= SRV_STATUS_WINDOW
                        ? (st->n_snap - SRV_STATUS_WINDOW) % (SRV_STATUS_WINDOW + 1)
                        : -1;
    st->ttft_snap[at] = m->ttft, st->itl_snap[at] = m->itl;
    st->n_snap++;
    const srv_hist zero = {0};
    uint64_t ttft[SRV_N_BUCKETS + 1], itl[SRV_N_BUCKETS + 1];
    window(&m->ttft, old >= 0 ? &st->ttft_snap[old] : &zero, ttft);
    window(&m->itl, old >= 0 ? &st->itl_snap[old] : &zero, itl);
    srv_sample *s = &st->ring[st->n_ring % SRV_STATUS_N];
    st->n_ring++;
    *s = (srv_sample){.t = now - st->t_start,
                      .running = m->running,
                      .waiting = m->waiting + K3_MAX(m->admitted - m->pending, 0),
                      .tok_s = (double)(es.gen_tokens - st->gen_last) / dt,
                      .kv = m->cache_usage,
                      .prefix = m->prefix_blocks_max > 0
                                    ? (double)m->prefix_blocks / (double)m->prefix_blocks_max
                                    : 0};
    const double qs[3] = {0.5, 0.9, 0.99};
    for (int i = 0; i < 3; i++)
        s->ttft[i] = quantile(ttft, qs[i]), s->itl[i] = quantile(itl, qs[i]);
    st->gen_last = es.gen_tokens;
    st->t_tick = now;
}

/* A number, or null when it is not finite (no observation in the window). */
static void add_num(cJSON *o, const char *k, double v) {
    if (isfinite(v))
        cJSON_AddNumberToObject(o, k, v);
    else
        cJSON_AddNullToObject(o, k);
}

static cJSON *series(cJSON *o, const char *k) {
    cJSON *a = cJSON_CreateArray();
    cJSON_AddItemToObject(o, k, a);
    return a;
}

static void push(cJSON *a, double v) {
    cJSON_AddItemToArray(a, isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateNull());
}

static cJSON *cluster_json(const srv_status *st, const k3_server_opts *o, double silent_limit) {
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "world", st->world);
    cJSON_AddNumberToObject(c, "pp", st->pp);
    cJSON_AddNumberToObject(c, "ep", st->ep);
    cJSON_AddBoolToObject(c, "dedicated_coordinator", st->dedicated);
    cJSON_AddStringToObject(c, "backend", o->backend ? o->backend : "cpu");
    cJSON_AddStringToObject(c, "comm", o->comm ? o->comm : "mpi");
    cJSON_AddNumberToObject(c, "max_seqs", st->max_seqs);
    cJSON_AddNumberToObject(c, "max_ctx", (double)st->max_ctx);
    cJSON *ranks = cJSON_AddArrayToObject(c, "ranks");
    const bool cuda = o->backend && strcmp(o->backend, "cuda") == 0;
    for (int w = 0; w < st->n_ranks; w++) {
        const srv_rank_status *r = &st->ranks[w];
        cJSON *x = cJSON_CreateObject();
        cJSON_AddNumberToObject(x, "rank", w);
        cJSON_AddStringToObject(x, "role",
                                r->stage < 0 ? "coordinator"
                                : w == 0     ? "coordinator + stage"
                                             : "stage");
        if (r->stage >= 0) {
            cJSON_AddNumberToObject(x, "stage", r->stage);
            cJSON_AddNumberToObject(x, "lane", r->lane);
        } else {
            cJSON_AddNullToObject(x, "stage");
            cJSON_AddNullToObject(x, "lane");
        }
        cJSON_AddStringToObject(x, "host", r->host);
        cJSON_AddNumberToObject(x, "node", r->node);
        char dev[32];
        snprintf(dev, sizeof dev, cuda ? "cuda (local rank %d)" : "cpu", r->local);
        cJSON_AddStringToObject(x, "device", dev);
        cJSON_AddNumberToObject(x, "silent_s", r->silent_s);
        cJSON_AddStringToObject(x, "health", r->silent_s > silent_limit ? "silent" : "ok");
        cJSON *mem = cJSON_AddObjectToObject(x, "memory");
        cJSON_AddNumberToObject(mem, "weights", (double)r->mem_weights);
        cJSON_AddNumberToObject(mem, "caches", (double)r->mem_caches);
        cJSON_AddNumberToObject(mem, "buffers", (double)r->mem_buffers);
        cJSON_AddNumberToObject(mem, "workspace", (double)r->mem_workspace);
        cJSON_AddNumberToObject(
            mem, "planned",
            (double)(r->mem_weights + r->mem_caches + r->mem_buffers + r->mem_workspace));
        if (r->rss) cJSON_AddNumberToObject(mem, "rss", (double)r->rss); /* rank 0's own, now */
        cJSON_AddItemToArray(ranks, x);
    }
    return c;
}

k3_status srv_status_json(const srv_status *st, const srv_metrics *m, const k3_server_opts *o,
                          bool engine_down, double silent_limit, double now, k3_chat_buf *out) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return K3_ERR(K3_ERR_NOMEM, "status JSON");
    cJSON_AddStringToObject(j, "model", o->model_name ? o->model_name : "");
    cJSON_AddStringToObject(j, "version", o->version ? o->version : "unknown");
    const bool loading = st->t_start == 0; /* the engine loop has not started yet */
    cJSON_AddNumberToObject(j, "uptime_s", loading ? 0 : now - st->t_start);
    cJSON_AddStringToObject(j, "engine", engine_down ? "failed" : loading ? "loading" : "ok");
    cJSON_AddItemToObject(j, "cluster", cluster_json(st, o, silent_limit));
    cJSON *n = cJSON_AddObjectToObject(j, "now");
    cJSON_AddNumberToObject(n, "running", m->running);
    cJSON_AddNumberToObject(n, "waiting", m->waiting + K3_MAX(m->admitted - m->pending, 0));
    cJSON_AddNumberToObject(n, "slots", o->slots);
    cJSON_AddNumberToObject(n, "kv_cache_usage", m->cache_usage);
    cJSON_AddBoolToObject(n, "prefix_cache", m->prefix_on);
    add_num(n, "prefix_cache_usage",
            m->prefix_blocks_max > 0 ? (double)m->prefix_blocks / (double)m->prefix_blocks_max
                                     : NAN);
    add_num(n, "prefix_cache_hit_rate",
            m->prefix_queries > 0 ? (double)m->prefix_hits / (double)m->prefix_queries : NAN);
    cJSON_AddNumberToObject(n, "requests_completed", (double)(m->n_stop + m->n_length));
    cJSON_AddNumberToObject(n, "requests_failed", (double)m->n_failed);
    cJSON_AddNumberToObject(n, "requests_cancelled", (double)m->n_cancelled);
    cJSON_AddNumberToObject(n, "prompt_tokens", (double)m->prompt_tokens);
    cJSON_AddNumberToObject(n, "generation_tokens", (double)m->generation_tokens);
    cJSON *h = cJSON_AddObjectToObject(j, "history");
    cJSON_AddNumberToObject(h, "interval_s", 1);
    cJSON_AddNumberToObject(h, "window_s", SRV_STATUS_WINDOW);
    cJSON *t = series(h, "t"), *run = series(h, "running"), *wait = series(h, "waiting");
    cJSON *tok = series(h, "tok_s"), *kv = series(h, "kv_cache_usage");
    cJSON *pc = series(h, "prefix_cache_usage");
    static const char *const names[2][3] = {{"ttft_p50", "ttft_p90", "ttft_p99"},
                                            {"itl_p50", "itl_p90", "itl_p99"}};
    cJSON *lat[2][3];
    for (int a = 0; a < 2; a++)
        for (int i = 0; i < 3; i++) lat[a][i] = series(h, names[a][i]);
    const int64_t first = K3_MAX(st->n_ring - SRV_STATUS_N, 0);
    for (int64_t k = first; k < st->n_ring; k++) {
        const srv_sample *s = &st->ring[k % SRV_STATUS_N];
        push(t, s->t), push(run, s->running), push(wait, s->waiting), push(tok, s->tok_s);
        push(kv, s->kv), push(pc, s->prefix);
        for (int i = 0; i < 3; i++) push(lat[0][i], s->ttft[i]), push(lat[1][i], s->itl[i]);
    }
    char *txt = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!txt) return K3_ERR(K3_ERR_NOMEM, "status JSON");
    k3_status r = k3_chat_buf_puts(out, txt);
    cJSON_free(txt);
    return r;
}
