/* comm.c — the transport-neutral front end of k3_comm: the transport table ("mpi", and "nccl" in a
 * K3_HAVE_NCCL build) and creation by name, the public k3_comm_* functions as thin wrappers over
 * the transport's function table, the wire format of messages (header packing and the checks on
 * receipt, once for every transport), the waiting loops with their timeouts; every poll and wait
 * looks for a fault report first. The MoE protocol is in comm_moe.c, device payloads in
 * comm_dev.c, fault reports, the verdict and the heartbeat in comm_fault.c; the bytes move in the
 * transports: comm_mpi.c, and comm_nccl.c for the nccl data plane. Invariant: every blocking loop
 * here sleeps with backoff and ends at c->timeout_s with an error that names the peer and says
 * --comm-timeout. */
#include "k3_comm.h"
#include "comm_internal.h"

#include <limits.h>
#include <stdio.h>
#include <time.h>

/* ---- transports ------------------------------------------------------------------------- */
typedef struct transport {
    const char *name;
    k3_status (*create)(const k3_comm_params *p, k3_comm **out);
} transport;
#ifdef K3_HAVE_NCCL
k3_status k3_comm_nccl_create(const k3_comm_params *p, k3_comm **out); /* comm_nccl.c */
#endif
static const transport k_transports[] = {
    {"mpi", k3_comm_mpi_create},
#ifdef K3_HAVE_NCCL
    {"nccl", k3_comm_nccl_create},
#endif
};

k3_status k3_comm_create(const char *transport_name, const k3_comm_params *p, k3_comm **out) {
    *out = NULL;
    if (!p || p->n_stages < 1 || p->n_lanes < 1 || p->first_worker < 0 || p->first_worker > 1 ||
        !(p->timeout_s > 0))
        return K3_ERR(K3_ERR_ARG, "comm: bad grid %d x %d (first worker %d, timeout %g s)",
                      p ? p->n_stages : 0, p ? p->n_lanes : 0, p ? p->first_worker : 0,
                      p ? p->timeout_s : 0.0);
    const char *name = transport_name ? transport_name : "mpi";
    for (size_t i = 0; i < K3_ARRAY_LEN(k_transports); i++)
        if (strcmp(k_transports[i].name, name) == 0) {
            K3_TRY(k_transports[i].create(p, out));
            (*out)->oversub = p->oversubscribed;
            return K3_OK;
        }
    char have[64] = "";
    for (size_t i = 0, at = 0; i < K3_ARRAY_LEN(k_transports) && at < sizeof have; i++)
        at += (size_t)snprintf(have + at, sizeof have - at, "%s%s", i ? " " : "",
                               k_transports[i].name);
    return K3_ERR(K3_ERR_ARG, "comm: unknown transport '%s' (this build has: %s)", name, have);
}

void k3_comm_destroy(k3_comm *c) {
    if (!c) return;
    comm_moe_free(c);
    c->iface->destroy(c);
}

const char *k3_comm_transport(const k3_comm *c) {
    return c->iface->name;
}
int k3_comm_rank(const k3_comm *c) {
    return c->rank;
}
int k3_comm_size(const k3_comm *c) {
    return c->size;
}
int k3_comm_stage(const k3_comm *c) {
    return c->stage;
}
int k3_comm_lane(const k3_comm *c) {
    return c->lane;
}
void k3_comm_set_timeout(k3_comm *c, double t) {
    if (t > 0) c->timeout_s = t;
}
void k3_comm_get_stats(const k3_comm *c, k3_comm_stats *out) {
    *out = c->stats;
}

_Noreturn void k3_comm_abort(k3_comm *c, int code) {
    fflush(stdout);
    fflush(stderr);
    if (c) c->iface->abort(c, code);
    k3_comm_world_abort(code);
}

/* ---- shared helpers --------------------------------------------------------------------- */
k3_status comm_grow(void **p, size_t *cap, size_t need, size_t elem, const char *what) {
    if (need <= *cap && *p) return K3_OK;
    size_t n = K3_MAX(need, K3_MAX(*cap * 2, (size_t)16));
    void *q = NULL;
    K3_TRY(k3_alloc(&q, n * elem, what));
    k3_free(*p);
    *p = q;
    *cap = n;
    return K3_OK;
}

void comm_describe(const k3_comm *c, int r, char *buf, size_t cap) {
    if (r < 0) {
        snprintf(buf, cap, "any rank");
        return;
    }
    int w = r - c->first_worker;
    if (w < 0)
        snprintf(buf, cap, "rank %d (coordinator)", r);
    else
        snprintf(buf, cap, "rank %d (stage %d, lane %d)", r, w / c->n_lanes, w % c->n_lanes);
}

void comm_group_name(const k3_comm *c, char *buf, size_t cap) {
    int r0 = c->first_worker + c->stage * c->n_lanes;
    snprintf(buf, cap, "the EP group of stage %d (ranks %d-%d)", c->stage, r0, r0 + c->n_lanes - 1);
}

void comm_sleep(k3_comm *c, int *backoff) {
    if (c) c->iface->progress(c);
    /* rank 0 beats from every wait, not only from its scheduler loop: a coordinator that waits
       (e.g. in its own stage's MoE exchange) is alive, and must not be blamed for the wait */
    if (c && c->have) (void)k3_comm_beat(c); /* a worker answers rank 0's beats from here too */
    int us = *backoff <= 0 ? 10 : *backoff;
    struct timespec ts = {0, (long)us * 1000L};
    nanosleep(&ts, NULL);
    *backoff = K3_MIN(us * 2, 500);
}

/* The sleeps of a message wait (comm_idle), in us. Fast polls first (a decode step's hand-off
 * arrives within tens of us), then the doorbell: doubling to 1 ms, then growing with the wait.
 * When every rank is on this node every k3 message rings, so the sleep can grow fast and long
 * (it only bounds how soon rank 0's beats and the silence checks run); with peers on other nodes
 * it grows by 1/32 a sleep, so it overshoots a remote message by at most ~3% of the wait. */
enum {
    IDLE_POLL_US = 80,          /* nanosleep polls up to this; the doorbell past it */
    IDLE_STEP_US = 1000,        /* doubling up to here */
    IDLE_MAX_LOCAL_US = 100000, /* every rank on this node */
    IDLE_MAX_REMOTE_US = 20000, /* some rank on another node (its posts do not ring) */
    IDLE_MAX_SENDING_US = 500,  /* a send of ours in flight may need our progress (rendezvous) */
};

static int idle_next(const k3_comm *c, int us) {
    if (us <= 0) return c && c->oversub ? 2 * IDLE_POLL_US : 10;
    if (us < IDLE_STEP_US) return K3_MIN(us * 2, IDLE_STEP_US);
    if (comm_bell_all_local()) return K3_MIN(us * 2, IDLE_MAX_LOCAL_US);
    return K3_MIN(us + us / 32 + 1, IDLE_MAX_REMOTE_US);
}

void comm_idle(k3_comm *c, int *backoff) {
    const bool sending = c && c->iface->progress(c);
    if (c && c->have) (void)k3_comm_beat(c); /* as in comm_sleep */
    int us = idle_next(c, *backoff);
    *backoff = us;
    if (sending) us = K3_MIN(us, IDLE_MAX_SENDING_US);
    if (c && comm_bell_on() && us > IDLE_POLL_US) {
        if (comm_bell_sleep(c->bell_seen, us)) c->stats.n_bell_wakes++;
    } else {
        struct timespec ts = {us / 1000000, (long)(us % 1000000) * 1000L};
        nanosleep(&ts, NULL);
    }
    /* the number the next sleep compares: taken before the caller's next poll, so a post that
       lands after the poll and before that sleep still wakes it */
    if (c) c->bell_seen = comm_bell_seen();
}

void k3_comm_idle(k3_comm *c, int *backoff) {
    comm_idle(c, backoff);
}

static const char *kind_name(int k) {
    static const char *names[] = {"?",        "BATCH", "ACTIV", "LOGITS",
                                  "PROGRESS", "STOP",  "FAULT", "BEAT"};
    _Static_assert(K3_ARRAY_LEN(names) == K3_MSG_KIND_COUNT, "one name per message kind");
    return k > 0 && k < K3_MSG_KIND_COUNT ? names[k] : "?";
}

/* ---- messages: the version-2 wire ------------------------------------------------------- */
static size_t pad8(int64_t n_bytes) {
    return ((size_t)n_bytes + 7) & ~(size_t)7;
}

/* Queue header | meta | padding | the f32 segments. */
k3_status k3_comm_post(k3_comm *c, int peer, k3_msg_kind kind, const void *meta,
                       int64_t n_meta_bytes, const k3_f32_seg *seg, int n_seg) {
    enum { MAX_SEG = 16 };
    if (peer < 0 || peer >= c->size)
        return K3_ERR(K3_ERR_ARG, "comm post: peer %d not in the world of %d", peer, c->size);
    if (kind < 1 || kind >= K3_MSG_KIND_COUNT || n_meta_bytes < 0 || (n_meta_bytes > 0 && !meta) ||
        n_seg < 0 || n_seg > MAX_SEG || (n_seg > 0 && !seg))
        return K3_ERR(K3_ERR_ARG, "comm post: bad message (kind %d, %lld meta bytes, %d segments)",
                      kind, (long long)n_meta_bytes, n_seg);
    /* bound every term before adding, so no sum can wrap: the limit is INT_MAX bytes */
    int64_t n_f32 = 0;
    for (int i = 0; i < n_seg; i++) {
        if (seg[i].n < 0 || (seg[i].n > 0 && !seg[i].p))
            return K3_ERR(K3_ERR_ARG, "comm post: bad payload segment %d", i);
        if (seg[i].n > INT_MAX || n_f32 > INT_MAX) break; /* refused below */
        n_f32 += seg[i].n;
    }
    if (n_meta_bytes > INT_MAX || n_f32 > INT_MAX / (int64_t)sizeof(float))
        return K3_ERR(K3_ERR_COMM,
                      "comm post: a %s message with %lld meta bytes and %lld+ floats exceeds the "
                      "transport limit of %d bytes",
                      kind_name(kind), (long long)n_meta_bytes, (long long)n_f32, INT_MAX);
    size_t n_bytes = sizeof(k3_comm_wire_hdr) + pad8(n_meta_bytes) + (size_t)n_f32 * sizeof(float);
    if (n_bytes > (size_t)INT_MAX)
        return K3_ERR(K3_ERR_COMM,
                      "comm post: a %s message of %zu bytes exceeds the transport limit of %d "
                      "bytes",
                      kind_name(kind), n_bytes, INT_MAX);
    k3_comm_wire_hdr h = {.magic = K3_MSG_MAGIC,
                          .version = K3_MSG_VERSION,
                          .kind = (uint16_t)kind,
                          .n_bytes = n_bytes,
                          .n_meta_bytes = n_meta_bytes,
                          .n_f32 = n_f32,
                          .seq = c->send_seq};
    static const uint8_t zeros[8];
    comm_piece pc[MAX_SEG + 3];
    int np = 0;
    pc[np++] = (comm_piece){&h, sizeof h};
    if (n_meta_bytes) pc[np++] = (comm_piece){meta, (size_t)n_meta_bytes};
    if (pad8(n_meta_bytes) > (size_t)n_meta_bytes)
        pc[np++] = (comm_piece){zeros, pad8(n_meta_bytes) - (size_t)n_meta_bytes};
    for (int i = 0; i < n_seg; i++)
        if (seg[i].n) pc[np++] = (comm_piece){seg[i].p, (size_t)seg[i].n * sizeof(float)};
    K3_TRY(c->iface->send(c, peer, kind, pc, np, n_bytes));
    c->send_seq++;
    comm_bell_ring(peer); /* after the send is queued: the woken rank's poll finds it */
    return K3_OK;
}

static k3_status check_msg(const k3_comm *c, int kind, int src, const void *buf, size_t n_bytes,
                           k3_comm_msg *out) {
    char who[64];
    comm_describe(c, src, who, sizeof who);
    k3_comm_wire_hdr h;
    if (n_bytes < sizeof h)
        return K3_ERR(K3_ERR_FORMAT, "%s message from %s: %zu bytes, shorter than the header",
                      kind_name(kind), who, n_bytes);
    memcpy(&h, buf, sizeof h);
    if (h.magic != K3_MSG_MAGIC || h.version != K3_MSG_VERSION || h.kind != kind)
        return K3_ERR(K3_ERR_FORMAT,
                      "%s message from %s: bad header (magic %08x, version %u (want %d), kind %u)",
                      kind_name(kind), who, h.magic, h.version, K3_MSG_VERSION, h.kind);
    /* bound each field before the sum so a hostile header cannot overflow it */
    if (h.n_meta_bytes < 0 || h.n_f32 < 0 || h.n_meta_bytes > INT_MAX || h.n_f32 > INT_MAX ||
        h.n_bytes != (uint64_t)n_bytes ||
        h.n_bytes != sizeof h + pad8(h.n_meta_bytes) + (uint64_t)h.n_f32 * sizeof(float))
        return K3_ERR(K3_ERR_FORMAT,
                      "%s message %llu from %s: length %zu does not match the header (%llu "
                      "bytes, %lld meta bytes, %lld floats)",
                      kind_name(kind), (unsigned long long)h.seq, who, n_bytes,
                      (unsigned long long)h.n_bytes, (long long)h.n_meta_bytes, (long long)h.n_f32);
    const char *b = buf;
    *out = (k3_comm_msg){.kind = (k3_msg_kind)kind,
                         .src = src,
                         .seq = h.seq,
                         .meta = b + sizeof h,
                         .n_meta_bytes = h.n_meta_bytes,
                         .f32 = (const float *)(const void *)(b + sizeof h + pad8(h.n_meta_bytes)),
                         .n_f32 = h.n_f32,
                         .n_bytes = h.n_bytes};
    return K3_OK;
}

k3_status k3_comm_poll(k3_comm *c, int peer, k3_msg_kind kind, k3_comm_msg *out, bool *got) {
    *got = false;
    if (kind < 1 || kind >= K3_MSG_KIND_COUNT)
        return K3_ERR(K3_ERR_ARG, "comm poll: bad kind %d", kind);
    if (peer != K3_ANY_RANK && (peer < 0 || peer >= c->size))
        return K3_ERR(K3_ERR_ARG, "comm poll: peer %d not in the world of %d", peer, c->size);
    if (comm_fault_arrived(c)) return comm_fault_error(c, "comm poll");
    const void *bytes = NULL;
    size_t n_bytes = 0;
    int src = -1;
    bool have = false;
    K3_TRY(c->iface->poll(c, peer, kind, &bytes, &n_bytes, &src, &have));
    if (!have) return K3_OK;
    K3_TRY(check_msg(c, kind, src, bytes, n_bytes, out));
    *got = true;
    return K3_OK;
}

k3_status k3_comm_wait(k3_comm *c, int peer, k3_msg_kind kind, k3_comm_msg *out) {
    double t0 = k3_now_s();
    int backoff = 0;
    for (;;) {
        bool got;
        K3_TRY(k3_comm_poll(c, peer, kind, out, &got));
        if (got) return K3_OK;
        double waited = k3_now_s() - t0;
        if (waited > c->timeout_s) {
            char who[64], what[160];
            comm_describe(c, peer, who, sizeof who);
            snprintf(what, sizeof what, "a %s message from %s", kind_name(kind), who);
            comm_note_wait(c, peer >= 0 ? peer : COMM_PEER_ANY, what, waited);
            return K3_ERR(
                K3_ERR_COMM,
                "waiting for a %s message: no answer from %s within %.0f s (--comm-timeout)",
                kind_name(kind), who, c->timeout_s);
        }
        comm_idle(c, &backoff);
    }
}

k3_status k3_comm_flush(k3_comm *c) {
    double t0 = k3_now_s();
    int backoff = 0;
    while (c->iface->progress(c)) {
        if (comm_fault_arrived(c)) return comm_fault_error(c, "comm flush");
        if (k3_now_s() - t0 > c->timeout_s) {
            comm_note_wait(c, COMM_PEER_ANY, "sends to complete", k3_now_s() - t0);
            return K3_ERR(K3_ERR_COMM,
                          "comm flush: a send is still pending after %.0f s (--comm-timeout)",
                          c->timeout_s);
        }
        comm_sleep(c, &backoff);
    }
    return K3_OK;
}

/* ---- world collectives ------------------------------------------------------------------ */
k3_status k3_comm_barrier(k3_comm *c) {
    return c->iface->barrier(c);
}
k3_status k3_comm_bcast(k3_comm *c, int root, void *buf, size_t n_bytes) {
    if (root < 0 || root >= c->size)
        return K3_ERR(K3_ERR_ARG, "comm bcast: root %d not in the world of %d", root, c->size);
    return c->iface->bcast(c, root, buf, n_bytes);
}
k3_status k3_comm_allgather_u64(k3_comm *c, uint64_t v, uint64_t *all) {
    return c->iface->allgather_u64(c, v, all);
}
