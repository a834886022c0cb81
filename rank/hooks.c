/* hooks.c — the fatal fault of a rank (recorded on its way up, then rank_abort: the one line
 * naming rank, stage and lane, or the peer to blame, and the end of the job) and the test hooks
 * of k3_engine_test.h: K3_TEST_FAIL, which the mpi tests use to kill or stall a rank on purpose,
 * and K3_TEST_FORCE. */
#include "k3_engine_test.h"
#include "rank_internal.h"

#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct rank_hooks {
    int fail_load_rank, fail_decode_rank, fail_decode_step, fail_plan_rank;
    bool fail_hang;      /* "hang:R:N": stop answering instead of dying */
    int fail_signal;     /* decode:R:N SIGKILL, stop:R:N SIGSTOP */
    int kill_load_rank;  /* "kill-load:R": SIGKILL itself half-way through the load */
    int stall_load_rank; /* "stall-load:R": SIGSTOP itself half-way through the load */
    int32_t *force;      /* [n_force] K3_TEST_FORCE: the first tokens of every request (rank 0) */
    int n_force;
    int alloc_site;  /* "alloc:SITE:N": the site whose N-th allocation fails (-1) */
    int64_t alloc_n; /* N (from 1) */
    int64_t alloc_count[RANK_ALLOC_SITES]; /* allocations so far at each site */
    int graph_sync_rank; /* "graph-sync:R": a host sync inside rank R's captured steps (-1) */
};

static const char *const alloc_site_name[RANK_ALLOC_SITES] = {"submit", "step", "fork"};

/* ---- faults ------------------------------------------------------------------------------- */
k3_status rank_fail(rank_ctx *r, k3_status s) {
    if (s != K3_OK && r->fault == K3_OK) {
        r->fault = s;
        snprintf(r->fault_msg, sizeof r->fault_msg, "%s", k3_last_error());
    }
    return s;
}

k3_status rank_blame(rank_ctx *r, const char *fmt, ...) {
    char msg[sizeof r->fault_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    k3_status s = K3_ERR(K3_ERR_COMM, "%s", msg);
    if (r->fault == K3_OK) {
        r->fault = s;
        r->fault_blame = true;
        snprintf(r->fault_msg, sizeof r->fault_msg, "%s", msg);
    }
    return s;
}

/* A comm fault (a timeout, or another rank's fault report): agree on the root cause with the
 * ranks that can still answer, print it once, end the job. This rank's own view is in the
 * cascade part of the line. */
static _Noreturn void abort_agreed(rank_ctx *r) {
    char verdict[4096];
    bool printer = true;
    k3_comm_blame(r->comm, verdict, sizeof verdict, &printer);
    if (printer) {
        K3_LOGE("%s", verdict);
    } else { /* the printer aborts right after its line: give it the time to write it */
        double t0 = k3_now_s();
        int backoff = 0;
        while (k3_now_s() - t0 < K3_FAULT_GRACE_S) k3_comm_idle(r->comm, &backoff);
    }
    k3_comm_abort(r->comm, 1);
}

_Noreturn void rank_abort(rank_ctx *r) {
    if (r->fault == K3_OK) rank_fail(r, K3_ERR(K3_ERR_INTERNAL, "aborted without a fault"));
    if (r->fault_blame) {
        K3_LOGE("%s; noticed by rank %d, ending the job", r->fault_msg, r->rank);
    } else {
        if (r->comm && k3_comm_fault_pending(r->comm)) abort_agreed(r);
        if (r->stage >= 0)
            K3_LOGE("rank %d (stage %d, lane %d) failed: %s: %s", r->rank, r->stage, r->lane,
                    k3_status_name(r->fault), r->fault_msg);
        else
            K3_LOGE("rank %d (coordinator) failed: %s: %s", r->rank, k3_status_name(r->fault),
                    r->fault_msg);
    }
    if (r->comm) k3_comm_abort(r->comm, 1);
    k3_comm_world_abort(1);
}

/* ---- the test hooks (k3_engine_test.h) ------------------------------------------------------ */
const k3_engine_test *k3_engine_test_from_env(void) {
    static k3_engine_test t;
    t.fail = getenv("K3_TEST_FAIL");
    t.force = getenv("K3_TEST_FORCE");
    return (t.fail && *t.fail) || (t.force && *t.force) ? &t : NULL;
}

k3_status rank_hooks_create(rank_ctx *r, const char *t) {
    struct rank_hooks *h;
    K3_TRY(k3_calloc((void **)&h, sizeof *h, "test hooks"));
    r->hooks = h;
    h->fail_load_rank = h->fail_decode_rank = h->fail_decode_step = h->fail_plan_rank = -1;
    h->stall_load_rank = h->kill_load_rank = -1;
    h->fail_signal = SIGKILL;
    h->alloc_site = -1;
    h->graph_sync_rank = -1;
    if (!t || !*t) return K3_OK;
    int a = -1, b = -1;
    char site[16];
    long long n = 0;
    if (sscanf(t, "alloc:%15[a-z]:%lld", site, &n) == 2 && n >= 1) {
        for (int i = 0; i < RANK_ALLOC_SITES; i++)
            if (strcmp(site, alloc_site_name[i]) == 0) h->alloc_site = i, h->alloc_n = n;
        if (h->alloc_site < 0 && r->rank == 0)
            K3_LOGW("K3_TEST_FAIL='%s': no allocation site '%s' (submit | step | fork)", t, site);
    } else if (sscanf(t, "load:%d", &a) == 1)
        h->fail_load_rank = a;
    else if (sscanf(t, "stall-load:%d", &a) == 1)
        h->stall_load_rank = a;
    else if (sscanf(t, "kill-load:%d", &a) == 1)
        h->kill_load_rank = a;
    else if (sscanf(t, "stop:%d:%d", &a, &b) == 2)
        h->fail_decode_rank = a, h->fail_decode_step = b, h->fail_signal = SIGSTOP;
    else if (sscanf(t, "plan:%d", &a) == 1)
        h->fail_plan_rank = a;
    else if (sscanf(t, "decode:%d:%d", &a, &b) == 2)
        h->fail_decode_rank = a, h->fail_decode_step = b;
    else if (sscanf(t, "hang:%d:%d", &a, &b) == 2)
        h->fail_decode_rank = a, h->fail_decode_step = b, h->fail_hang = true;
    else if (sscanf(t, "graph-sync:%d", &a) == 1)
        h->graph_sync_rank = a;
    else if (r->rank == 0)
        K3_LOGW("K3_TEST_FAIL='%s' not understood (load:R | stall-load:R | kill-load:R | plan:R | "
                "decode:R:N | stop:R:N | hang:R:N | alloc:SITE:N | graph-sync:R)",
                t);
    return K3_OK;
}

bool rank_hooks_graph_sync(const rank_ctx *r) {
    return r->hooks && r->hooks->graph_sync_rank == r->rank;
}

void rank_hooks_destroy(rank_ctx *r) {
    if (!r->hooks) return;
    k3_free(r->hooks->force);
    k3_free(r->hooks);
    r->hooks = NULL;
}

/* K3_TEST_FORCE="id,id,...": parsed on rank 0 once the config is known; a bad list is refused
 * with a warning. */
k3_status rank_hooks_force(rank_ctx *r, const char *t) {
    struct rank_hooks *h = r->hooks;
    if (!t || !*t || r->rank != 0) return K3_OK;
    int n = 1;
    for (const char *p = t; *p; p++) n += *p == ',';
    K3_TRY(k3_alloc((void **)&h->force, (size_t)n * sizeof *h->force, "K3_TEST_FORCE"));
    const char *p = t;
    for (int i = 0; i < n; i++) {
        char *end = NULL;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v >= r->cfg.vocab_size || (*end && *end != ',')) {
            K3_LOGW("K3_TEST_FORCE: token %d ('%.20s') is not an id of the vocabulary; ignored", i,
                    p);
            k3_free(h->force);
            h->force = NULL;
            return K3_OK;
        }
        h->force[i] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    h->n_force = n;
    K3_LOGW("K3_TEST_FORCE: every request generates these %d tokens first (a test hook)", n);
    return K3_OK;
}

bool rank_hooks_forced(const rank_ctx *r, int n_gen, int32_t *id) {
    const struct rank_hooks *h = r->hooks;
    if (n_gen >= h->n_force) return false;
    *id = h->force[n_gen];
    return true;
}

void rank_hooks_step(rank_ctx *r, int count) {
    const struct rank_hooks *h = r->hooks;
    if (h->fail_decode_rank != r->rank || count != h->fail_decode_step) return;
    if (h->fail_hang) {
        K3_LOGE("rank %d: test hook K3_TEST_FAIL=hang:%d:%d: no longer answering", r->rank, r->rank,
                count);
        for (;;) pause(); /* the others must time out and end the job */
    }
    bool stop = h->fail_signal == SIGSTOP;
    K3_LOGE("rank %d: test hook K3_TEST_FAIL=%s:%d:%d: %s myself with %s", r->rank,
            stop ? "stop" : "decode", r->rank, count, stop ? "stopping" : "killing",
            stop ? "SIGSTOP" : "SIGKILL");
    raise(h->fail_signal);
}

k3_status rank_hooks_load_begin(rank_ctx *r) {
    if (r->hooks->fail_load_rank != r->rank) return K3_OK;
    return K3_ERR(K3_ERR_IO, "test hook K3_TEST_FAIL=load:%d: failing the load on purpose",
                  r->rank);
}

void rank_hooks_load_progress(rank_ctx *r, uint64_t done, uint64_t total) {
    struct rank_hooks *h = r->hooks;
    if (h->stall_load_rank == r->rank && 2 * done >= total) {
        h->stall_load_rank = -1;
        K3_LOGE("rank %d: test hook K3_TEST_FAIL=stall-load:%d: stopping myself (SIGSTOP) at "
                "%.2f of %.2f MB",
                r->rank, r->rank, done / 1e6, total / 1e6);
        fflush(stderr);
        raise(SIGSTOP);
    }
    if (h->kill_load_rank == r->rank && 2 * done >= total) {
        K3_LOGE("rank %d: test hook K3_TEST_FAIL=kill-load:%d: killing myself (SIGKILL) at "
                "%.2f of %.2f MB",
                r->rank, r->rank, done / 1e6, total / 1e6);
        fflush(stderr);
        raise(SIGKILL);
    }
}

uint64_t rank_hooks_plan_hash(const rank_ctx *r, uint64_t hash) {
    return r->hooks->fail_plan_rank == r->rank ? hash ^ 1 : hash;
}

bool rank_hooks_alloc_fails(rank_ctx *r, rank_alloc_site site) {
    struct rank_hooks *h = r->hooks;
    if (!h || h->alloc_site != (int)site) return false;
    if (++h->alloc_count[site] != h->alloc_n) return false;
    K3_LOGW("test hook K3_TEST_FAIL=alloc:%s:%lld: failing this allocation", alloc_site_name[site],
            (long long)h->alloc_n);
    return true;
}

k3_status rank_alloc(rank_ctx *r, rank_alloc_site site, void **p, size_t n, bool zero,
                     const char *what) {
    *p = NULL;
    if (rank_hooks_alloc_fails(r, site))
        return K3_ERR(K3_ERR_NOMEM, "out of memory: %s (%zu bytes; test hook)", what, n);
    return zero ? k3_calloc(p, n, what) : k3_alloc(p, n, what);
}
