/* comm_mpi.c — the MPI backend of k3_comm (host buffers).
 *
 * Owns: MPI_COMM_WORLD use for messages (tag = message kind, MPI_Improbe + MPI_Mrecv so a probed
 * message cannot be stolen), one EP communicator per stage from MPI_Comm_split(color = stage,
 * key = lane), the MoE dispatch (MPI_Ialltoall of per-lane row counts, then MPI_Ialltoallv of the
 * rows and of their (source rank, slot, expert) metadata) and the combine (the reverse
 * MPI_Ialltoallv). Every wait is MPI_Test in a loop with sleeps that back off from 10 us to
 * 500 us (no busy spin: on an oversubscribed node a spinning rank steals the core of the rank it
 * waits for) and a deadline naming the peer.
 * Count units are stated at every MPI call site. Messages above INT_MAX bytes are rejected with a
 * clear error (not chunked yet). */
#include "k3_comm.h"

#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef struct send_slot {
    MPI_Request req;
    void *buf;
    size_t cap;
    bool busy;
} send_slot;

struct k3_comm {
    MPI_Comm world, ep;
    int rank, size, stage, lane, n_stages, n_lanes, first_worker;
    double timeout_s;
    send_slot *slots;
    int n_slots;
    uint64_t send_seq;
    void *rbuf[K3_MSG_KIND_COUNT];
    size_t rcap[K3_MSG_KIND_COUNT];
    /* dispatch / combine (row counts per lane, [E]) */
    int *scount, *sdispl, *rcount, *rdispl, *fill;
    int64_t n_send, n_recv, width, *pos;                 /* pos[i]: send-buffer row of slot i */
    float *send_rows, *recv_rows, *recv_out, *back_rows; /* [rows, width] */
    int32_t *send_meta, *recv_meta;                      /* [rows, 3] */
    int32_t *recv_src, *recv_slot, *recv_expert;         /* [rows] */
    size_t cap_pos, cap_send_rows, cap_back_rows, cap_send_meta; /* capacities in elements */
    size_t cap_recv_rows, cap_recv_out, cap_recv_meta, cap_src, cap_slot, cap_expert;
    bool dispatched;
    MPI_Datatype row_t, meta_t;
    int64_t row_t_width;
};

static const char *kind_name(int k) {
    static const char *names[] = {"?", "BATCH", "ACTIV", "LOGITS", "PROGRESS", "STOP"};
    return k > 0 && k < K3_MSG_KIND_COUNT ? names[k] : "?";
}

static k3_status mpi_err(int rc, const char *what, const char *file, int line) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "code %d", rc);
    return k3_set_error(K3_ERR_COMM, file, line, "%s: %s", what, msg);
}
#define MPI_TRY(call)                                                                              \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ != MPI_SUCCESS) return mpi_err(rc_, #call, __FILE__, __LINE__);                    \
    } while (0)

/* Describe a world rank for error messages: "rank 3 (stage 1, lane 0)". */
static void describe(const k3_comm *c, int r, char *buf, size_t cap) {
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

static k3_status grow(void **p, size_t *cap, size_t need, size_t elem, const char *what) {
    if (need <= *cap && *p) return K3_OK;
    size_t n = K3_MAX(need, K3_MAX(*cap * 2, (size_t)16));
    void *q = NULL;
    K3_TRY(k3_alloc(&q, n * elem, what));
    k3_free(*p);
    *p = q;
    *cap = n;
    return K3_OK;
}

/* ---- create / destroy --------------------------------------------------------------------- */
k3_status k3_comm_create_mpi(const k3_comm_params *p, k3_comm **out) {
    *out = NULL;
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) return K3_ERR(K3_ERR_STATE, "k3_comm_create_mpi: MPI is not initialised");
    if (p->n_stages < 1 || p->n_lanes < 1 || p->first_worker < 0 || p->first_worker > 1 ||
        !(p->timeout_s > 0))
        return K3_ERR(K3_ERR_ARG,
                      "k3_comm_create_mpi: bad grid %d x %d (first worker %d, timeout %g s)",
                      p->n_stages, p->n_lanes, p->first_worker, p->timeout_s);
    k3_comm *c = NULL;
    K3_TRY(k3_calloc((void **)&c, sizeof *c, "k3_comm"));
    c->world = MPI_COMM_WORLD;
    c->ep = MPI_COMM_NULL;
    c->row_t = c->meta_t = MPI_DATATYPE_NULL;
    MPI_Comm_rank(c->world, &c->rank);
    MPI_Comm_size(c->world, &c->size);
    c->n_stages = p->n_stages;
    c->n_lanes = p->n_lanes;
    c->first_worker = p->first_worker;
    c->timeout_s = p->timeout_s;
    if (c->size != p->first_worker + p->n_stages * p->n_lanes) {
        k3_status st = K3_ERR(K3_ERR_ARG, "comm: world size %d != %d + %d x %d", c->size,
                              p->first_worker, p->n_stages, p->n_lanes);
        k3_free(c);
        return st;
    }
    int w = c->rank - c->first_worker;
    c->stage = w >= 0 ? w / c->n_lanes : -1;
    c->lane = w >= 0 ? w % c->n_lanes : -1;
    int E = c->n_lanes;
    k3_status st = K3_OK;
    int **arrs[] = {&c->scount, &c->sdispl, &c->rcount, &c->rdispl, &c->fill};
    for (size_t i = 0; i < K3_ARRAY_LEN(arrs) && st == K3_OK; i++)
        st = k3_calloc((void **)arrs[i], (size_t)E * sizeof(int), "comm lane counts");
    if (st != K3_OK) {
        k3_comm_destroy(c);
        return st;
    }
    /* Collective over the world; a dedicated coordinator joins no EP group. */
    int rc = MPI_Comm_split(c->world, c->stage >= 0 ? c->stage : MPI_UNDEFINED, c->lane, &c->ep);
    if (rc != MPI_SUCCESS) {
        st = mpi_err(rc, "MPI_Comm_split (EP groups)", __FILE__, __LINE__);
        k3_comm_destroy(c);
        return st;
    }
    /* meta: one (source rank, slot, expert) triple per row */
    MPI_Type_contiguous(3, MPI_INT32_T, &c->meta_t);
    MPI_Type_commit(&c->meta_t);
    *out = c;
    return K3_OK;
}

void k3_comm_destroy(k3_comm *c) {
    if (!c) return;
    for (int i = 0; i < c->n_slots; i++) {
        if (c->slots[i].busy) { /* a send still in flight at teardown: cancel rather than hang */
            MPI_Cancel(&c->slots[i].req);
            MPI_Request_free(&c->slots[i].req);
        }
        k3_free(c->slots[i].buf);
    }
    k3_free(c->slots);
    for (int k = 0; k < K3_MSG_KIND_COUNT; k++) k3_free(c->rbuf[k]);
    k3_free(c->scount), k3_free(c->sdispl), k3_free(c->rcount), k3_free(c->rdispl),
        k3_free(c->fill);
    k3_free(c->pos);
    k3_free(c->send_rows), k3_free(c->recv_rows), k3_free(c->recv_out), k3_free(c->back_rows);
    k3_free(c->send_meta), k3_free(c->recv_meta), k3_free(c->recv_src), k3_free(c->recv_slot),
        k3_free(c->recv_expert);
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) {
        if (c->row_t != MPI_DATATYPE_NULL) MPI_Type_free(&c->row_t);
        if (c->meta_t != MPI_DATATYPE_NULL) MPI_Type_free(&c->meta_t);
        if (c->ep != MPI_COMM_NULL) MPI_Comm_free(&c->ep);
    }
    k3_free(c);
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

_Noreturn void k3_comm_abort(k3_comm *c, int code) {
    fflush(stdout);
    fflush(stderr);
    int inited = 0, size = 1;
    MPI_Initialized(&inited);
    if (inited) MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (!inited || size == 1)
        _exit(code); /* nobody else to stop (a singleton's MPI_Abort can linger) */
    MPI_Abort(c ? c->world : MPI_COMM_WORLD, code);
    abort(); /* MPI_Abort does not return; keep the compiler and the contract honest */
}

/* ---- progress and waiting ----------------------------------------------------------------- */
static void progress_sends(k3_comm *c) {
    for (int i = 0; i < c->n_slots; i++) {
        if (!c->slots[i].busy) continue;
        int done = 0;
        MPI_Test(&c->slots[i].req, &done, MPI_STATUS_IGNORE);
        if (done) c->slots[i].busy = false;
    }
}

void k3_comm_idle(k3_comm *c, int *backoff) {
    progress_sends(c);
    int us = *backoff <= 0 ? 10 : *backoff;
    struct timespec ts = {0, (long)us * 1000L};
    nanosleep(&ts, NULL);
    *backoff = us * 2 > 500 ? 500 : us * 2;
}

/* Wait for one request with the deadline; `what` and `peer` name it in the error. */
static k3_status wait_req(k3_comm *c, MPI_Request *req, const char *what, const char *peer) {
    double t0 = k3_now_s();
    int backoff = 0;
    for (;;) {
        int done = 0;
        MPI_TRY(MPI_Test(req, &done, MPI_STATUS_IGNORE));
        if (done) return K3_OK;
        if (k3_now_s() - t0 > c->timeout_s) {
            /* No MPI_Cancel: cancelling a nonblocking collective is erroneous in MPI, and a
             * timeout is fatal anyway (the caller aborts the job, which frees everything). */
            return K3_ERR(K3_ERR_COMM, "%s: no answer from %s within %.0f s (--comm-timeout)", what,
                          peer, c->timeout_s);
        }
        k3_comm_idle(c, &backoff);
    }
}

/* ---- messages ----------------------------------------------------------------------------- */
static size_t meta_bytes(int32_t n_meta) {
    return ((size_t)n_meta * 4 + 7) & ~(size_t)7;
}

k3_status k3_comm_send(k3_comm *c, int peer, k3_msg_hdr hdr, const int32_t *meta, int32_t n_meta,
                       const k3_f32_seg *seg, int n_seg) {
    int64_t n_f32 = 0;
    for (int i = 0; i < n_seg; i++) {
        if (seg[i].n < 0 || (seg[i].n > 0 && !seg[i].p))
            return K3_ERR(K3_ERR_ARG, "comm send: bad payload segment %d", i);
        n_f32 += seg[i].n;
    }
    if (peer < 0 || peer >= c->size)
        return K3_ERR(K3_ERR_ARG, "comm send: peer %d not in the world", peer);
    if (hdr.kind < 1 || hdr.kind >= K3_MSG_KIND_COUNT || n_meta < 0 || n_f32 < 0)
        return K3_ERR(K3_ERR_ARG, "comm send: bad message (kind %d, %d meta, %lld floats)",
                      hdr.kind, n_meta, (long long)n_f32);
    size_t n_bytes = sizeof hdr + meta_bytes(n_meta) + (size_t)n_f32 * sizeof(float);
    if (n_bytes > (size_t)INT_MAX)
        return K3_ERR(K3_ERR_COMM,
                      "comm send: a %s message of %zu bytes exceeds the MPI limit of %d bytes",
                      kind_name(hdr.kind), n_bytes, INT_MAX);
    progress_sends(c);
    send_slot *s = NULL;
    for (int i = 0; i < c->n_slots && !s; i++)
        if (!c->slots[i].busy) s = &c->slots[i];
    if (!s) {
        send_slot *ns = NULL;
        K3_TRY(k3_calloc((void **)&ns, (size_t)(c->n_slots + 1) * sizeof *ns, "comm send slots"));
        if (c->n_slots) memcpy(ns, c->slots, (size_t)c->n_slots * sizeof *ns);
        k3_free(c->slots);
        c->slots = ns;
        s = &c->slots[c->n_slots++];
    }
    K3_TRY(grow(&s->buf, &s->cap, n_bytes, 1, "comm send buffer"));
    hdr.magic = K3_MSG_MAGIC;
    hdr.version = K3_MSG_VERSION;
    hdr.n_bytes = n_bytes;
    hdr.n_meta = n_meta;
    hdr.n_f32 = n_f32;
    hdr.seq = c->send_seq++;
    char *b = s->buf;
    memcpy(b, &hdr, sizeof hdr);
    if (n_meta) memcpy(b + sizeof hdr, meta, (size_t)n_meta * 4);
    char *dst = b + sizeof hdr + meta_bytes(n_meta);
    for (int i = 0; i < n_seg; i++) {
        if (seg[i].n) memcpy(dst, seg[i].p, (size_t)seg[i].n * sizeof(float));
        dst += (size_t)seg[i].n * sizeof(float);
    }
    /* count unit: bytes (the whole message) */
    MPI_TRY(MPI_Isend(s->buf, (int)n_bytes, MPI_BYTE, peer, hdr.kind, c->world, &s->req));
    s->busy = true;
    return K3_OK;
}

static k3_status check_msg(k3_comm *c, int kind, int src, const char *buf, int n_bytes,
                           k3_msg *out) {
    char who[64];
    describe(c, src, who, sizeof who);
    k3_msg_hdr h;
    if (n_bytes < (int)sizeof h)
        return K3_ERR(K3_ERR_FORMAT, "%s message from %s: %d bytes, shorter than the header",
                      kind_name(kind), who, n_bytes);
    memcpy(&h, buf, sizeof h);
    if (h.magic != K3_MSG_MAGIC || h.version != K3_MSG_VERSION || h.kind != kind)
        return K3_ERR(K3_ERR_FORMAT,
                      "%s message from %s: bad header (magic %08x, version %u, kind %u)",
                      kind_name(kind), who, h.magic, h.version, h.kind);
    if (h.n_meta < 0 || h.n_f32 < 0 || h.n_bytes != (uint64_t)n_bytes ||
        h.n_bytes != sizeof h + meta_bytes(h.n_meta) + (uint64_t)h.n_f32 * sizeof(float))
        return K3_ERR(
            K3_ERR_FORMAT,
            "%s message %llu from %s: length %d does not match the header (%llu bytes, %d meta, "
            "%lld floats)",
            kind_name(kind), (unsigned long long)h.seq, who, n_bytes, (unsigned long long)h.n_bytes,
            h.n_meta, (long long)h.n_f32);
    out->hdr = h;
    out->src = src;
    out->meta = (const int32_t *)(buf + sizeof h);
    out->f32 = (const float *)(buf + sizeof h + meta_bytes(h.n_meta));
    return K3_OK;
}

k3_status k3_comm_try_recv(k3_comm *c, int peer, k3_msg_kind kind, k3_msg *out, bool *got) {
    *got = false;
    if (kind < 1 || kind >= K3_MSG_KIND_COUNT)
        return K3_ERR(K3_ERR_ARG, "comm recv: bad kind %d", kind);
    progress_sends(c);
    int flag = 0;
    MPI_Message m;
    MPI_Status st;
    MPI_TRY(MPI_Improbe(peer < 0 ? MPI_ANY_SOURCE : peer, kind, c->world, &flag, &m, &st));
    if (!flag) return K3_OK;
    int n_bytes = 0;
    MPI_TRY(MPI_Get_count(&st, MPI_BYTE, &n_bytes)); /* count unit: bytes */
    k3_status s =
        grow(&c->rbuf[kind], &c->rcap[kind], (size_t)K3_MAX(n_bytes, 1), 1, "comm recv buffer");
    if (s != K3_OK) {
        MPI_Mrecv(NULL, 0, MPI_BYTE, &m, MPI_STATUS_IGNORE); /* cannot happen often; drain */
        return s;
    }
    MPI_TRY(
        MPI_Mrecv(c->rbuf[kind], n_bytes, MPI_BYTE, &m, MPI_STATUS_IGNORE)); /* count unit: bytes */
    K3_TRY(check_msg(c, kind, st.MPI_SOURCE, c->rbuf[kind], n_bytes, out));
    *got = true;
    return K3_OK;
}

k3_status k3_comm_recv(k3_comm *c, int peer, k3_msg_kind kind, k3_msg *out) {
    double t0 = k3_now_s();
    int backoff = 0;
    for (;;) {
        bool got;
        K3_TRY(k3_comm_try_recv(c, peer, kind, out, &got));
        if (got) return K3_OK;
        if (k3_now_s() - t0 > c->timeout_s) {
            char who[64];
            describe(c, peer, who, sizeof who);
            return K3_ERR(
                K3_ERR_COMM,
                "waiting for a %s message: no answer from %s within %.0f s (--comm-timeout)",
                kind_name(kind), who, c->timeout_s);
        }
        k3_comm_idle(c, &backoff);
    }
}

k3_status k3_comm_flush(k3_comm *c) {
    double t0 = k3_now_s();
    int backoff = 0;
    for (;;) {
        progress_sends(c);
        int busy = -1;
        for (int i = 0; i < c->n_slots && busy < 0; i++)
            if (c->slots[i].busy) busy = i;
        if (busy < 0) return K3_OK;
        if (k3_now_s() - t0 > c->timeout_s)
            return K3_ERR(K3_ERR_COMM,
                          "comm flush: a send is still pending after %.0f s (--comm-timeout)",
                          c->timeout_s);
        k3_comm_idle(c, &backoff);
    }
}

/* ---- MoE dispatch / combine --------------------------------------------------------------- */
static void group_name(const k3_comm *c, char *buf, size_t cap) {
    int r0 = c->first_worker + c->stage * c->n_lanes;
    snprintf(buf, cap, "the EP group of stage %d (ranks %d-%d)", c->stage, r0, r0 + c->n_lanes - 1);
}

k3_status k3_comm_dispatch(k3_comm *c, const float *rows, int64_t n, int64_t width,
                           const int32_t *expert, const int32_t *dest_lane, k3_dispatch_view *v) {
    memset(v, 0, sizeof *v);
    if (c->ep == MPI_COMM_NULL)
        return K3_ERR(K3_ERR_STATE, "comm dispatch on a rank without a stage");
    if (n < 0 || width < 1 || n > INT_MAX / 2)
        return K3_ERR(K3_ERR_ARG, "comm dispatch: bad shape [%lld, %lld]", (long long)n,
                      (long long)width);
    const int E = c->n_lanes;
    char grp[96];
    group_name(c, grp, sizeof grp);
    if (c->row_t == MPI_DATATYPE_NULL || c->row_t_width != width) {
        if (c->row_t != MPI_DATATYPE_NULL) MPI_Type_free(&c->row_t);
        MPI_TRY(MPI_Type_contiguous((int)width, MPI_FLOAT, &c->row_t)); /* one row = width floats */
        MPI_TRY(MPI_Type_commit(&c->row_t));
        c->row_t_width = width;
    }
    /* counts per destination lane, then a stable placement (slot order within a lane) */
    for (int e = 0; e < E; e++) c->scount[e] = 0;
    for (int64_t i = 0; i < n; i++) {
        if (dest_lane[i] < 0 || dest_lane[i] >= E || expert[i] < 0)
            return K3_ERR(K3_ERR_ARG, "comm dispatch: row %lld has lane %d / expert %d (E = %d)",
                          (long long)i, dest_lane[i], expert[i], E);
        c->scount[dest_lane[i]]++;
    }
    for (int e = 0, acc = 0; e < E; e++) c->sdispl[e] = acc, acc += c->scount[e], c->fill[e] = 0;
    size_t n1 = (size_t)K3_MAX(n, 1), w = (size_t)width;
    K3_TRY(grow((void **)&c->pos, &c->cap_pos, n1, sizeof(int64_t), "dispatch positions"));
    K3_TRY(grow((void **)&c->send_rows, &c->cap_send_rows, n1 * w, sizeof(float),
                "dispatch send rows"));
    K3_TRY(grow((void **)&c->back_rows, &c->cap_back_rows, n1 * w, sizeof(float), "combine rows"));
    K3_TRY(
        grow((void **)&c->send_meta, &c->cap_send_meta, n1 * 3, sizeof(int32_t), "dispatch meta"));
    for (int64_t i = 0; i < n; i++) {
        int d = dest_lane[i];
        int64_t p = c->sdispl[d] + c->fill[d]++;
        c->pos[i] = p;
        memcpy(c->send_rows + p * width, rows + i * width, (size_t)width * sizeof(float));
        c->send_meta[p * 3 + 0] = c->rank;
        c->send_meta[p * 3 + 1] = (int32_t)i;
        c->send_meta[p * 3 + 2] = expert[i];
    }
    MPI_Request req;
    /* count unit: rows (one int per lane) */
    MPI_TRY(MPI_Ialltoall(c->scount, 1, MPI_INT, c->rcount, 1, MPI_INT, c->ep, &req));
    K3_TRY(wait_req(c, &req, "MoE dispatch (row counts)", grp));
    int64_t nr = 0;
    for (int e = 0; e < E; e++) {
        if (c->rcount[e] < 0)
            return K3_ERR(K3_ERR_COMM, "MoE dispatch: lane %d announced %d rows", e, c->rcount[e]);
        c->rdispl[e] = (int)nr;
        nr += c->rcount[e];
        if (nr > INT_MAX / 2)
            return K3_ERR(K3_ERR_COMM, "MoE dispatch: %lld rows received", (long long)nr);
    }
    size_t r1 = (size_t)K3_MAX(nr, 1);
    K3_TRY(grow((void **)&c->recv_rows, &c->cap_recv_rows, r1 * w, sizeof(float),
                "dispatch recv rows"));
    K3_TRY(
        grow((void **)&c->recv_out, &c->cap_recv_out, r1 * w, sizeof(float), "dispatch outputs"));
    K3_TRY(grow((void **)&c->recv_meta, &c->cap_recv_meta, r1 * 3, sizeof(int32_t),
                "dispatch recv meta"));
    K3_TRY(grow((void **)&c->recv_src, &c->cap_src, r1, sizeof(int32_t), "dispatch src"));
    K3_TRY(grow((void **)&c->recv_slot, &c->cap_slot, r1, sizeof(int32_t), "dispatch slot"));
    K3_TRY(grow((void **)&c->recv_expert, &c->cap_expert, r1, sizeof(int32_t), "dispatch expert"));
    MPI_Request rq[2];
    /* count unit: rows (row_t = width floats) */
    MPI_TRY(MPI_Ialltoallv(c->send_rows, c->scount, c->sdispl, c->row_t, c->recv_rows, c->rcount,
                           c->rdispl, c->row_t, c->ep, &rq[0]));
    /* count unit: rows (meta_t = 3 int32: source rank, slot, expert) */
    MPI_TRY(MPI_Ialltoallv(c->send_meta, c->scount, c->sdispl, c->meta_t, c->recv_meta, c->rcount,
                           c->rdispl, c->meta_t, c->ep, &rq[1]));
    K3_TRY(wait_req(c, &rq[0], "MoE dispatch (rows)", grp));
    K3_TRY(wait_req(c, &rq[1], "MoE dispatch (metadata)", grp));
    for (int e = 0; e < E; e++) {
        int src_rank = c->first_worker + c->stage * E + e;
        for (int j = c->rdispl[e]; j < c->rdispl[e] + c->rcount[e]; j++) {
            const int32_t *m = c->recv_meta + (int64_t)j * 3;
            if (m[0] != src_rank || m[1] < 0 || m[2] < 0)
                return K3_ERR(
                    K3_ERR_COMM,
                    "MoE dispatch: row %d from lane %d carries (rank %d, slot %d, expert %d)", j, e,
                    m[0], m[1], m[2]);
            c->recv_src[j] = m[0];
            c->recv_slot[j] = m[1];
            c->recv_expert[j] = m[2];
        }
    }
    c->n_send = n;
    c->n_recv = nr;
    c->width = width;
    c->dispatched = true;
    v->n_recv = nr;
    v->width = width;
    v->rows = c->recv_rows;
    v->src = c->recv_src;
    v->slot = c->recv_slot;
    v->expert = c->recv_expert;
    v->out = c->recv_out;
    return K3_OK;
}

k3_status k3_comm_combine(k3_comm *c, float *out) {
    if (!c->dispatched) return K3_ERR(K3_ERR_STATE, "comm combine without a dispatch");
    c->dispatched = false;
    char grp[96];
    group_name(c, grp, sizeof grp);
    MPI_Request req;
    /* count unit: rows (row_t = width floats); the reverse of the dispatch */
    MPI_TRY(MPI_Ialltoallv(c->recv_out, c->rcount, c->rdispl, c->row_t, c->back_rows, c->scount,
                           c->sdispl, c->row_t, c->ep, &req));
    K3_TRY(wait_req(c, &req, "MoE combine", grp));
    for (int64_t i = 0; i < c->n_send; i++)
        memcpy(out + i * c->width, c->back_rows + c->pos[i] * c->width,
               (size_t)c->width * sizeof(float));
    return K3_OK;
}

/* ---- world collectives -------------------------------------------------------------------- */
k3_status k3_comm_barrier(k3_comm *c) {
    MPI_Request req;
    MPI_TRY(MPI_Ibarrier(c->world, &req));
    return wait_req(c, &req, "barrier", "some rank of the world");
}

k3_status k3_comm_bcast(k3_comm *c, int root, void *buf, size_t n_bytes) {
    if (n_bytes > (size_t)INT_MAX) return K3_ERR(K3_ERR_ARG, "bcast of %zu bytes", n_bytes);
    char who[64];
    describe(c, root, who, sizeof who);
    MPI_Request req;
    MPI_TRY(MPI_Ibcast(buf, (int)n_bytes, MPI_BYTE, root, c->world, &req)); /* count unit: bytes */
    return wait_req(c, &req, "bcast", who);
}

k3_status k3_comm_allgather_u64(k3_comm *c, uint64_t v, uint64_t *all) {
    MPI_Request req;
    /* count unit: one uint64 per rank */
    MPI_TRY(MPI_Iallgather(&v, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, c->world, &req));
    return wait_req(c, &req, "allgather", "some rank of the world");
}

/* ---- process set-up ----------------------------------------------------------------------- */
bool k3_comm_launched(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK");
}

/* Set once by k3_comm_init on the main thread before any other comm call; read by finalize. */
static bool g_we_initialised;

k3_status k3_comm_init(void) {
    int inited = 0;
    MPI_Initialized(&inited);
    if (inited) return K3_OK;
    int provided = 0;
    MPI_TRY(MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided));
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    g_we_initialised = true;
    return K3_OK;
}

void k3_comm_finalize(void) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (g_we_initialised && !fin) MPI_Finalize();
    g_we_initialised = false;
}

/* ---- no handle ---------------------------------------------------------------------------- */
void k3_comm_world(int *rank, int *size) {
    int inited = 0;
    MPI_Initialized(&inited);
    *rank = 0;
    *size = 1;
    if (!inited) return;
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, size);
}

k3_status k3_comm_world_max(int v, int *max, double timeout_s) {
    int inited = 0;
    MPI_Initialized(&inited);
    *max = v;
    if (!inited) return K3_OK;
    MPI_Request req;
    /* count unit: one int */
    MPI_TRY(MPI_Iallreduce(&v, max, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD, &req));
    k3_comm tmp = {.timeout_s = timeout_s, .world = MPI_COMM_WORLD};
    return wait_req(&tmp, &req, "agreement (allreduce)", "some rank of the world");
}

_Noreturn void k3_comm_world_abort(int code) {
    k3_comm_abort(NULL, code);
}
