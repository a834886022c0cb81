/* comm_fault.c — faults that end a job, named once and agreed on: the fault reports every wait
 * loop listens for, the bounded exchange of k3_comm_blame and its verdict, and the coordinator's
 * idle heartbeat. Transport-neutral: reports travel as ordinary K3_MSG_FAULT messages.
 *
 * Why an exchange: when one rank stops, every rank that depends on it times out in turn, each
 * naming the peer it waited for, which is often a healthy rank that was itself waiting (a
 * cascade). Only the ranks together know who is silent. The window is short and bounded, so a
 * fault still ends the job within --comm-timeout + a few seconds. */
#include "k3_comm.h"
#include "comm_internal.h"

#include <stdarg.h>
#include <stdio.h>

k3_status comm_fault_init(k3_comm *c) {
    size_t n = (size_t)c->size;
    K3_TRY(k3_calloc((void **)&c->reports, n * sizeof *c->reports, "comm fault reports"));
    K3_TRY(k3_calloc((void **)&c->have, n * sizeof *c->have, "comm fault reports"));
    K3_TRY(k3_calloc((void **)&c->heard, n * sizeof *c->heard, "comm last heard"));
    K3_TRY(k3_calloc((void **)&c->host, n * sizeof *c->host, "comm host names"));
    double now = k3_now_s();
    for (size_t i = 0; i < n; i++) c->heard[i] = now;
    c->t_beat = now;
    c->fault_from = -1;
    snprintf(c->doing, sizeof c->doing, "setting up");
    return K3_OK;
}

void comm_fault_free(k3_comm *c) {
    k3_free(c->reports), k3_free(c->have), k3_free(c->heard), k3_free(c->host);
    c->reports = NULL, c->have = NULL, c->heard = NULL, c->host = NULL;
}

void k3_comm_set_doing(k3_comm *c, const char *doing) {
    if (c) snprintf(c->doing, sizeof c->doing, "%s", doing ? doing : "");
}

bool k3_comm_fault_pending(const k3_comm *c) {
    return c && c->fault != COMM_FAULT_NONE;
}

double k3_comm_silent_s(const k3_comm *c, int peer) {
    if (!c || peer < 0 || peer >= c->size || !c->heard) return 0;
    return k3_now_s() - c->heard[peer];
}

/* Fill this rank's report (the first fault wins: a later one is its consequence). */
static void note(k3_comm *c, int reason, const int *waited, int n, const char *what,
                 double waited_s, int notified_by) {
    if (c->fault != COMM_FAULT_NONE) return;
    c->fault = reason;
    comm_fault_report *m = &c->mine;
    memset(m, 0, sizeof *m);
    m->version = COMM_FAULT_VERSION;
    m->rank = c->rank;
    m->reason = reason;
    m->n_waited = n > 0 ? n : 0;
    for (int i = 0; i < n && i < K3_FAULT_MAX_WAITS; i++) m->waited[i] = waited[i];
    m->waited_s = waited_s;
    m->notified_by = notified_by;
    snprintf(m->doing, sizeof m->doing, "%s", c->doing);
    snprintf(m->what, sizeof m->what, "%s", what ? what : "");
}

void k3_comm_note_timeout(k3_comm *c, const int *waited, int n, const char *what, double waited_s) {
    if (c) note(c, COMM_FAULT_TIMEOUT, waited, n, what, waited_s, -1);
}

void comm_note_wait(k3_comm *c, int peer, const char *what, double waited_s) {
    if (!c) return;
    int w[K3_FAULT_MAX_WAITS], n = 0;
    if (peer >= 0) {
        w[n++] = peer;
    } else if (peer == COMM_PEER_GROUP && c->stage >= 0) {
        int r0 = c->first_worker + c->stage * c->n_lanes;
        for (int e = 0; e < c->n_lanes; e++)
            if (r0 + e != c->rank) {
                if (n < K3_FAULT_MAX_WAITS) w[n] = r0 + e;
                n++;
            }
    }
    note(c, COMM_FAULT_TIMEOUT, w, n, what, waited_s, -1);
}

static bool store_report(k3_comm *c, int src, const void *bytes, size_t n_bytes) {
    if (src < 0 || src >= c->size || src == c->rank) return false;
    if (n_bytes != sizeof(k3_comm_wire_hdr) + sizeof(comm_fault_report)) return false;
    comm_fault_report rep;
    memcpy(&rep, (const char *)bytes + sizeof(k3_comm_wire_hdr), sizeof rep);
    if (rep.version != COMM_FAULT_VERSION || rep.rank != src) return false;
    rep.doing[sizeof rep.doing - 1] = 0;
    rep.what[sizeof rep.what - 1] = 0;
    if (rep.n_waited < 0) rep.n_waited = 0;
    c->reports[src] = rep;
    c->have[src] = true;
    c->heard[src] = k3_now_s();
    c->fault_from = src;
    return true;
}

bool comm_fault_arrived(k3_comm *c) {
    if (!c || !c->have) return false;
    const void *bytes = NULL;
    size_t n_bytes = 0;
    int src = -1;
    bool got = false;
    if (c->iface->poll(c, K3_ANY_RANK, K3_MSG_FAULT, &bytes, &n_bytes, &src, &got) != K3_OK || !got)
        return false;
    if (!store_report(c, src, bytes, n_bytes)) return false;
    note(c, COMM_FAULT_NOTICE, NULL, 0, "", 0, src);
    return true;
}

k3_status comm_fault_error(const k3_comm *c, const char *what) {
    char who[64];
    comm_describe(c, c->fault_from, who, sizeof who);
    return K3_ERR(K3_ERR_COMM, "%s: interrupted by a fault report from %s", what, who);
}

k3_status k3_comm_beat(k3_comm *c) {
    if (!c || c->size == 1 || !c->heard) return K3_OK;
    /* take the beats that arrived (their arrival time is all they carry: heard[]); a worker
       answers rank 0's, so that rank 0 knows every worker is alive while idle (/health) */
    bool got = false, any = false;
    do {
        k3_comm_msg m;
        K3_TRY(k3_comm_poll(c, K3_ANY_RANK, K3_MSG_BEAT, &m, &got));
        any |= got;
    } while (got);
    if (c->rank != 0) return any ? k3_comm_post(c, 0, K3_MSG_BEAT, NULL, 0, NULL, 0) : K3_OK;
    double now = k3_now_s();
    if (now - c->t_beat < K3_MIN(c->timeout_s / 3, K3_COMM_BEAT_S)) return K3_OK;
    c->t_beat = now;
    for (int w = 1; w < c->size; w++) K3_TRY(k3_comm_post(c, w, K3_MSG_BEAT, NULL, 0, NULL, 0));
    return K3_OK;
}

/* ---- the verdict -------------------------------------------------------------------------- */
typedef struct sbuf {
    char *p;
    size_t cap, n;
} sbuf;

static void put(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sbuf *b, const char *fmt, ...) {
    if (b->n + 1 >= b->cap) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(b->p + b->n, b->cap - b->n, fmt, ap);
    va_end(ap);
    if (k > 0) b->n = K3_MIN(b->n + (size_t)k, b->cap - 1);
}

/* "rank 2 (stage 1, lane 0, host vm)" */
static void put_rank(sbuf *b, const k3_comm *c, int r) {
    int w = r - c->first_worker;
    if (w < 0)
        put(b, "rank %d (coordinator, host %s)", r, c->host[r]);
    else
        put(b, "rank %d (stage %d, lane %d, host %s)", r, w / c->n_lanes, w % c->n_lanes,
            c->host[r]);
}

static void put_waits(sbuf *b, const comm_fault_report *rep) {
    int n = K3_MIN(rep->n_waited, K3_FAULT_MAX_WAITS);
    for (int i = 0; i < n; i++) put(b, "%s%d", i ? "," : "", rep->waited[i]);
    if (rep->n_waited > n) put(b, ",+%d", rep->n_waited - n);
}

enum { MAX_LISTED = 8 }; /* cascade entries written out; the rest are counted */

void k3_comm_blame(k3_comm *c, char *out, size_t cap, bool *printer) {
    *printer = true;
    sbuf b = {out, cap, 0};
    if (cap) out[0] = 0;
    if (!c || !c->have) {
        put(&b, "a rank failed before the grid existed");
        return;
    }
    if (c->fault == COMM_FAULT_NONE) note(c, COMM_FAULT_TIMEOUT, NULL, 0, "", 0, -1);
    /* Every other rank reported before this one even started: they have judged without it, so
       this rank was the silent one (e.g. stopped, then resumed by the launcher's SIGCONT as it
       ends the job). Its view would contradict theirs: stay quiet. */
    while (comm_fault_arrived(c)) {
    }
    int n_before = 0;
    for (int r = 0; r < c->size; r++) n_before += r != c->rank && c->have[r];
    if (c->size > 1 && n_before == c->size - 1) {
        *printer = false;
        put(&b, "rank %d: the others judged the fault without this rank (it was silent)", c->rank);
        return;
    }
    c->reports[c->rank] = c->mine;
    c->have[c->rank] = true;
    for (int r = 0; r < c->size; r++) /* best effort: a dead peer's send never completes */
        if (r != c->rank) (void)k3_comm_post(c, r, K3_MSG_FAULT, &c->mine, sizeof c->mine, NULL, 0);
    double t_end = k3_now_s() + K3_MIN(K3_FAULT_WINDOW_S, c->timeout_s);
    int backoff = 0, n_have = 0;
    for (;;) {
        while (comm_fault_arrived(c)) {
        }
        n_have = 0;
        for (int r = 0; r < c->size; r++) n_have += c->have[r];
        if (n_have == c->size || k3_now_s() > t_end) break;
        comm_sleep(c, &backoff);
    }
    int lowest = c->rank;
    for (int r = 0; r < c->size; r++)
        if (c->have[r]) {
            lowest = r;
            break;
        }
    *printer = lowest == c->rank;

    /* the root: silent ranks, those that someone waited for first */
    int n_silent = 0, n_root = 0;
    for (int r = 0; r < c->size; r++) {
        if (c->have[r]) continue;
        n_silent++;
        int owed = -1; /* the rank that waited for it most specifically: what r was due to do */
        for (int q = 0; q < c->size; q++)
            if (c->have[q])
                for (int i = 0; i < K3_MIN(c->reports[q].n_waited, K3_FAULT_MAX_WAITS); i++)
                    if (c->reports[q].waited[i] == r &&
                        (owed < 0 || c->reports[q].n_waited < c->reports[owed].n_waited))
                        owed = q;
        if (owed < 0) continue;
        put(&b, n_root ? "; " : "root cause: ");
        put_rank(&b, c, r);
        put(&b, ", last message here %.1f s ago", k3_comm_silent_s(c, r));
        if (c->reports[owed].what[0])
            put(&b, ", due in %s (awaited by rank %d)", c->reports[owed].what, owed);
        n_root++;
    }
    if (n_silent > 0 && n_root == 0) /* nobody named them, but they did not answer either */
        for (int r = 0; r < c->size; r++)
            if (!c->have[r]) {
                put(&b, n_root ? "; " : "root cause: ");
                put_rank(&b, c, r);
                put(&b, ", last message here %.1f s ago", k3_comm_silent_s(c, r));
                n_root++;
            }
    if (n_root > 0) {
        put(&b, " — stopped answering: stopped, hung or dead (no fault report within %.1f s)",
            K3_MIN(K3_FAULT_WINDOW_S, c->timeout_s));
    } else {
        put(&b, "root cause: every rank answered the fault exchange; the first to time out was ");
        int first = -1;
        for (int r = 0; r < c->size && first < 0; r++)
            if (c->have[r] && c->reports[r].reason == COMM_FAULT_TIMEOUT) first = r;
        if (first >= 0)
            put_rank(&b, c, first);
        else
            put(&b, "unknown");
    }
    /* the cascade: each answering rank that waited, and what it did */
    put(&b, ". Cascade (--comm-timeout %.0f s):", c->timeout_s);
    int listed = 0, more = 0;
    for (int r = 0; r < c->size; r++) {
        if (!c->have[r]) continue;
        const comm_fault_report *rep = &c->reports[r];
        if (listed == MAX_LISTED) {
            more++;
            continue;
        }
        listed++;
        put(&b, " ");
        put_rank(&b, c, r);
        if (rep->reason == COMM_FAULT_TIMEOUT) {
            put(&b, " timed out after %.1f s", rep->waited_s);
            if (rep->what[0]) put(&b, " waiting for %s", rep->what);
            if (rep->n_waited > 0) {
                put(&b, " [ranks ");
                put_waits(&b, rep);
                put(&b, "]");
            }
        } else {
            put(&b, " was woken by rank %d's report", rep->notified_by);
        }
        if (rep->doing[0]) put(&b, " (doing: %s)", rep->doing);
        put(&b, ";");
    }
    if (more) put(&b, " and %d more ranks;", more);
    if (b.n > 0 && out[b.n - 1] == ';') out[b.n - 1] = '.';
}
