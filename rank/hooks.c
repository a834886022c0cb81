/* hooks.c — failure of a rank (log naming rank, stage and lane, or the peer to blame, then abort
 * the job) and the K3_TEST_FAIL hooks the mpi tests use to kill or stall a rank on purpose. */
#include "rank_internal.h"

#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <unistd.h>

/* ---- failure ------------------------------------------------------------------------------ */
/* A comm fault (a timeout, or another rank's fault report): agree on the root cause with the
 * ranks that can still answer, print it once, end the job. This rank's own view is in the
 * cascade part of the line. */
static _Noreturn void die_agreed(rank_ctx *r) {
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

_Noreturn void rank_die(rank_ctx *r, k3_status s) {
    if (r->comm && k3_comm_fault_pending(r->comm)) die_agreed(r);
    if (r->stage >= 0)
        K3_LOGE("rank %d (stage %d, lane %d) failed: %s: %s", r->rank, r->stage, r->lane,
                k3_status_name(s), k3_last_error());
    else
        K3_LOGE("rank %d (coordinator) failed: %s: %s", r->rank, k3_status_name(s),
                k3_last_error());
    if (r->comm) k3_comm_abort(r->comm, 1);
    k3_comm_world_abort(1);
}

_Noreturn void rank_die_blame(rank_ctx *r, const char *fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    K3_LOGE("%s; noticed by rank %d, ending the job", msg, r->rank);
    if (r->comm) k3_comm_abort(r->comm, 1);
    k3_comm_world_abort(1);
}

/* K3_TEST_FORCE="id,id,...": parsed on rank 0 once the config is known; a bad list is refused
 * with a warning. */
void rank_hooks_parse_force(rank_ctx *r) {
    const char *t = r->o->test_force;
    if (!t || !*t || r->rank != 0) return;
    int n = 1;
    for (const char *p = t; *p; p++) n += *p == ',';
    if (k3_alloc((void **)&r->force, (size_t)n * sizeof *r->force, "K3_TEST_FORCE") != K3_OK)
        return;
    const char *p = t;
    for (int i = 0; i < n; i++) {
        char *end = NULL;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v >= r->cfg.vocab_size || (*end && *end != ',')) {
            K3_LOGW("K3_TEST_FORCE: token %d ('%.20s') is not an id of the vocabulary; ignored", i,
                    p);
            k3_free(r->force);
            r->force = NULL;
            return;
        }
        r->force[i] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    r->n_force = n;
    K3_LOGW("K3_TEST_FORCE: every request generates these %d tokens first (a test hook)", n);
}

void rank_hooks_parse(rank_ctx *r) {
    r->fail_load_rank = r->fail_decode_rank = r->fail_decode_step = r->fail_plan_rank = -1;
    r->stall_load_rank = r->kill_load_rank = -1;
    r->fail_signal = SIGKILL;
    const char *t = r->o->test_fail;
    if (!t || !*t) return;
    int a = -1, b = -1;
    if (sscanf(t, "load:%d", &a) == 1)
        r->fail_load_rank = a;
    else if (sscanf(t, "stall-load:%d", &a) == 1)
        r->stall_load_rank = a;
    else if (sscanf(t, "kill-load:%d", &a) == 1)
        r->kill_load_rank = a;
    else if (sscanf(t, "stop:%d:%d", &a, &b) == 2)
        r->fail_decode_rank = a, r->fail_decode_step = b, r->fail_signal = SIGSTOP;
    else if (sscanf(t, "plan:%d", &a) == 1)
        r->fail_plan_rank = a;
    else if (sscanf(t, "decode:%d:%d", &a, &b) == 2)
        r->fail_decode_rank = a, r->fail_decode_step = b;
    else if (sscanf(t, "hang:%d:%d", &a, &b) == 2)
        r->fail_decode_rank = a, r->fail_decode_step = b, r->fail_hang = true;
    else if (r->rank == 0)
        K3_LOGW("K3_TEST_FAIL='%s' not understood (load:R | stall-load:R | kill-load:R | plan:R | "
                "decode:R:N | stop:R:N | hang:R:N)",
                t);
}

void rank_hooks_maybe_die(rank_ctx *r, int count) {
    if (r->fail_decode_rank == r->rank && count == r->fail_decode_step && r->fail_hang) {
        K3_LOGE("rank %d: test hook K3_TEST_FAIL=hang:%d:%d: no longer answering", r->rank, r->rank,
                count);
        for (;;) pause(); /* the others must time out and end the job */
    }
    if (r->fail_decode_rank == r->rank && count == r->fail_decode_step) {
        bool stop = r->fail_signal == SIGSTOP;
        K3_LOGE("rank %d: test hook K3_TEST_FAIL=%s:%d:%d: %s myself with %s", r->rank,
                stop ? "stop" : "decode", r->rank, count, stop ? "stopping" : "killing",
                stop ? "SIGSTOP" : "SIGKILL");
        raise(r->fail_signal);
    }
}
