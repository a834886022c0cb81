/* test_comm.c — k3_comm under mpirun: `test_comm S E FIRST_WORKER [SEED] [BACKENDS] [TRANSPORT]`
 * (BACKENDS: comma-separated k3 backends for the MoE exchange, default "cpu,guard"; TRANSPORT:
 * "mpi" (default) or "nccl": tests/gpu registers the nccl runs, on cpu and cuda, where the cuda
 * backend takes the transport's device path).
 * 1. messages (k3_comm_post/wait/poll): every rank posts large (rendezvous-sized) ACTIV messages
 *    with a typed meta struct to the next rank BEFORE receiving from the previous one (async sends
 *    must not deadlock); payloads encode (source rank, index); odd meta sizes are padded; corrupt
 *    headers (junk, a wrong length, version 1) are rejected naming the sender.
 * 2. k3_comm_moe_dispatch/combine on each backend (guard: the buffers are PROT_NONE outside the
 *    backend, so a host access inside comm faults), both combine modes, random routes that every
 *    rank regenerates for every lane of its stage (so each receiver knows exactly what it must
 *    get): lanes that own no expert, rows whose items all go to one lane, rows without items,
 *    lanes with no rows and lanes with rows but no items. Receivers check the deduplicated rows,
 *    items, row_seg, tags and weights; PER_ITEM returns each item's output to its slot; PRESUM
 *    returns the per-(row, lane) sums in (row, lane ascending) order with pair_seg; the traffic
 *    counters equal the documented formula and PRESUM returns fewer bytes than PER_ITEM. Every
 *    lane fails together on a combine-mode or width mismatch and on one lane's bad route, and the
 *    group stays in step afterwards.
 * 3. a receive that never comes times out after --comm-timeout naming the silent peer.
 * 4. waits give the core back (issue 46): a rank that waits 300 ms for a late peer, for a message
 *    (k3_comm_wait) and in a collective (k3_comm_barrier), is woken by the post and calls
 *    sched_yield (interposed here and counted) fewer than 10 times: Open MPI yields in every idle
 *    progress call when oversubscribed, and each yield queues the rank behind every busy process
 *    of its core. The test `comm_yield` runs this oversubscribed on any machine.
 * One verdict on all ranks (MPI_Allreduce of the failure count). */
#include "k3_comm.h"
#include "k3_test.h"

#include <mpi.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* sched_yield, interposed: this binary exports it (tests/mpi/tests.cmake), so Open MPI's calls
 * come here; counted, then made. */
static atomic_long g_yields;
int sched_yield(void) {
    atomic_fetch_add(&g_yields, 1);
    return (int)syscall(SYS_sched_yield);
}

static float enc(int rank, int64_t slot, int64_t col) {
    return (float)(rank * 1000003 + slot * 131 + col) * 0.25f; /* exact in fp32 for our sizes */
}
static float f_expert(float x, int expert) {
    return x * (float)(expert + 1) + 0.5f;
}

/* ---- 1. messages ------------------------------------------------------------------------- */
typedef struct test_payload { /* a caller-defined typed payload (as rank's would be) */
    uint32_t version;
    int32_t n_bank;
    int64_t T, D;
    int32_t ids[3];
} test_payload;

static void test_messages(k3_comm *c, int rank, int size) {
    const int64_t T = 300, D = 256; /* 300 KB + bank: far above the eager limit */
    const int nb = 2;
    int64_t nh = T * D, nf = T * D * (1 + nb);
    float *buf = malloc((size_t)nf * sizeof(float));
    for (int64_t i = 0; i < nf; i++) buf[i] = enc(rank, i, 0);
    bool got = true;
    k3_comm_msg m;
    K3_CHECK_OK(k3_comm_poll(c, K3_ANY_RANK, K3_MSG_ACTIV, &m, &got));
    K3_CHECK(!got, "a message before anyone sent");
    K3_CHECK_OK(k3_comm_barrier(c)); /* nobody sends before everyone has checked */
    int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    for (int rep = 0; rep < 3; rep++) { /* several in flight at once, two segments each */
        test_payload p = {.version = 7, .n_bank = nb, .T = T, .D = D, .ids = {rank, rep, -rank}};
        k3_f32_seg seg[2] = {{buf, nh}, {buf + nh, nf - nh}};
        K3_CHECK_OK(k3_comm_post(c, next, K3_MSG_ACTIV, &p, sizeof p, seg, 2));
    }
    uint64_t seq0 = 0;
    for (int rep = 0; rep < 3; rep++) {
        K3_CHECK_OK(k3_comm_wait(c, prev, K3_MSG_ACTIV, &m));
        test_payload p = {0};
        K3_CHECK(m.kind == K3_MSG_ACTIV && m.src == prev && m.n_meta_bytes == (int64_t)sizeof p &&
                     m.n_f32 == nf,
                 "message from %d: kind %d, %lld meta bytes, %lld floats", m.src, m.kind,
                 (long long)m.n_meta_bytes, (long long)m.n_f32);
        K3_CHECK(((uintptr_t)m.meta % 8) == 0 && ((uintptr_t)m.f32 % 8) == 0, "alignment");
        if (m.n_meta_bytes == (int64_t)sizeof p) memcpy(&p, m.meta, sizeof p);
        K3_CHECK(p.version == 7 && p.n_bank == nb && p.T == T && p.D == D && p.ids[0] == prev &&
                     p.ids[1] == rep && p.ids[2] == -prev,
                 "payload v%u bank %d T %lld D %lld ids %d %d %d", p.version, p.n_bank,
                 (long long)p.T, (long long)p.D, p.ids[0], p.ids[1], p.ids[2]);
        if (rep == 0) seq0 = m.seq;
        K3_CHECK(m.seq == seq0 + (uint64_t)rep, "seq %llu after %llu", (unsigned long long)m.seq,
                 (unsigned long long)seq0);
        int64_t bad = 0;
        for (int64_t i = 0; i < K3_MIN(m.n_f32, nf); i++) bad += m.f32[i] != enc(prev, i, 0);
        K3_CHECK(bad == 0, "%lld wrong floats from rank %d", (long long)bad, prev);
    }
    /* an odd meta size (13 bytes: padded to 16 on the wire), no floats; then one with no meta */
    const char odd[13] = "k3 meta bytes";
    K3_CHECK_OK(k3_comm_post(c, next, K3_MSG_BATCH, odd, sizeof odd, NULL, 0));
    K3_CHECK_OK(k3_comm_post(c, next, K3_MSG_BATCH, NULL, 0, &(k3_f32_seg){buf, 3}, 1));
    K3_CHECK_OK(k3_comm_wait(c, prev, K3_MSG_BATCH, &m));
    K3_CHECK(m.n_meta_bytes == 13 && memcmp(m.meta, odd, 13) == 0 && m.n_f32 == 0 &&
                 m.n_bytes == sizeof(k3_comm_wire_hdr) + 16,
             "odd meta: %lld bytes, %llu on the wire", (long long)m.n_meta_bytes,
             (unsigned long long)m.n_bytes);
    K3_CHECK_OK(k3_comm_wait(c, prev, K3_MSG_BATCH, &m));
    K3_CHECK(m.n_meta_bytes == 0 && m.n_f32 == 3 && m.f32[2] == enc(prev, 2, 0) &&
                 m.n_bytes == sizeof(k3_comm_wire_hdr) + 12,
             "no meta");
    K3_CHECK_OK(k3_comm_flush(c));
    free(buf);
    /* corrupt headers are rejected, naming the sender (raw MPI messages on the BATCH tag) */
    if (size > 1) {
        char junk[64] = {0};
        MPI_Request rq;
        if (rank == 0) MPI_Isend(junk, sizeof junk, MPI_BYTE, 1, K3_MSG_BATCH, MPI_COMM_WORLD, &rq);
        if (rank == 1)
            K3_CHECK_ERR(k3_comm_wait(c, 0, K3_MSG_BATCH, &m), K3_ERR_FORMAT, "from rank 0");
        if (rank == 0) MPI_Wait(&rq, MPI_STATUS_IGNORE);
        /* a good header whose length disagrees with the bytes received */
        k3_comm_wire_hdr h = {.magic = K3_MSG_MAGIC,
                              .version = K3_MSG_VERSION,
                              .kind = K3_MSG_BATCH,
                              .n_bytes = sizeof h + 8,
                              .n_f32 = 2};
        if (rank == 0) MPI_Isend(&h, sizeof h, MPI_BYTE, 1, K3_MSG_BATCH, MPI_COMM_WORLD, &rq);
        if (rank == 1)
            K3_CHECK_ERR(k3_comm_wait(c, 0, K3_MSG_BATCH, &m), K3_ERR_FORMAT,
                         "does not match the header");
        if (rank == 0) MPI_Wait(&rq, MPI_STATUS_IGNORE);
        /* a version-1 sender */
        h = (k3_comm_wire_hdr){
            .magic = K3_MSG_MAGIC, .version = 1, .kind = K3_MSG_BATCH, .n_bytes = sizeof h};
        if (rank == 0) MPI_Isend(&h, sizeof h, MPI_BYTE, 1, K3_MSG_BATCH, MPI_COMM_WORLD, &rq);
        if (rank == 1)
            K3_CHECK_ERR(k3_comm_wait(c, 0, K3_MSG_BATCH, &m), K3_ERR_FORMAT, "version 1 (want 2)");
        if (rank == 0) MPI_Wait(&rq, MPI_STATUS_IGNORE);
    }
    K3_CHECK_ERR(k3_comm_post(c, size, K3_MSG_BATCH, NULL, 0, NULL, 0), K3_ERR_ARG,
                 "not in the world");
}

/* ---- 2. the MoE exchange ----------------------------------------------------------------- */
enum { X = 13, K = 4, W = 6 }; /* experts, max items per row, row width */

typedef struct route_t {
    int64_t T, n;
    int32_t row[64 * K], lane[64 * K], tag[64 * K];
    float w[64 * K];
} route_t;

/* The expert -> lane map: E >= 3: lane E-1 owns nothing; the last expert is nobody's choice. */
static int owner_of(int x, int E) {
    return E >= 3 ? (x * 7 + 3) % (E - 1) : x % E;
}

/* The route of source lane `src` in round `round` (every rank of the stage can rebuild it). */
static void make_route(uint64_t seed, int stage, int round, int src, int E, route_t *rt) {
    k3_rng rng;
    k3_rng_seed(&rng,
                seed * 1000003u + (uint64_t)stage * 7919u + (uint64_t)round * 131u + (uint64_t)src);
    rt->T = (int64_t)(k3_rng_u64(&rng) % 40) + 1 + src;
    if (src == 0 && round % 3 == 1) rt->T = 0;  /* a lane with no rows */
    bool no_items = src == 1 && round % 3 == 2; /* a lane with rows but no items */
    rt->n = 0;
    for (int64_t t = 0; t < rt->T; t++) {
        uint64_t kind = k3_rng_u64(&rng) % 10;
        int k = kind == 0 ? 0 : (kind == 1 ? 1 : K); /* rows without items, with one item */
        if (no_items) k = 0;
        int lane1 = -1; /* kind 2..4: all items of the row on one lane */
        if (kind >= 2 && kind <= 4) lane1 = owner_of((int)(k3_rng_u64(&rng) % (X - 1)), E);
        for (int j = 0; j < k; j++) {
            int x;
            do x = (int)(k3_rng_u64(&rng) % (X - 1));
            while (lane1 >= 0 && owner_of(x, E) != lane1);
            rt->row[rt->n] = (int32_t)t;
            rt->lane[rt->n] = owner_of(x, E);
            rt->tag[rt->n] = x;
            rt->w[rt->n] = (float)k3_rng_uniform(&rng) + 0.25f;
            rt->n++;
        }
    }
}

/* The pre-sum of one (row, lane): items [a, b) of a route in slot order, only those on lane e.
 * The receiver and the checker call this same function, so PRESUM must be bit-identical. */
static void presum_row(const float *x, const int32_t *tag, const float *w, const int32_t *lane,
                       int64_t a, int64_t b, int e, float *out) {
    bool first = true;
    for (int64_t i = a; i < b; i++) {
        if (lane && lane[i] != e) continue;
        for (int j = 0; j < W; j++) {
            float v = w[i] * f_expert(x[j], tag[i]);
            out[j] = first ? v : out[j] + v;
        }
        first = false;
    }
}

static float *be_alloc_up(k3_backend *be, const float *host, int64_t n) {
    void *p = NULL;
    K3_CHECK_OK(k3_backend_alloc(be, (size_t)K3_MAX(n, 1) * sizeof(float), "test buffer", &p));
    if (p && n) K3_CHECK_OK(k3_backend_upload(be, p, host, (size_t)n * sizeof(float)));
    return p;
}
static void be_down(k3_backend *be, float *host, const float *dev, int64_t n) {
    if (n) K3_CHECK_OK(k3_backend_download(be, host, dev, (size_t)n * sizeof(float)));
}

/* One exchange of round `round` in `mode` on backend be, checked on both sides. Returns this
 * lane's combine bytes; *multi = whether it received a row with >= 2 items. */
static uint64_t moe_round(k3_comm *c, k3_backend *be, int E, int F, uint64_t seed, int round,
                          k3_combine_mode mode, bool *multi) {
    const int stage = k3_comm_stage(c), lane = k3_comm_lane(c);
    const bool per_item = mode == K3_COMBINE_PER_ITEM;
    route_t *rt = calloc((size_t)E, sizeof *rt); /* every lane's route: rt[lane] is ours */
    for (int e = 0; e < E; e++) make_route(seed, stage, round, e, E, &rt[e]);
    const route_t *me = &rt[lane];
    const int my_rank = F + stage * E + lane;
    /* x [T, W] encodes (rank, row, column), in backend memory */
    float *xh = malloc((size_t)K3_MAX(me->T, 1) * W * sizeof(float));
    for (int64_t t = 0; t < me->T; t++)
        for (int j = 0; j < W; j++) xh[t * W + j] = enc(my_rank, t, j);
    float *x = be_alloc_up(be, xh, me->T * W);
    k3_moe_route r = {.n_rows = me->T,
                      .n_items = me->n,
                      .item_row = me->row,
                      .item_lane = me->lane,
                      .item_tag = me->tag,
                      .item_w = me->w};
    k3_comm_stats s0, s1, s2;
    k3_comm_get_stats(c, &s0);
    k3_dispatch_view v;
    K3_CHECK_OK(k3_comm_moe_dispatch(c, be, me->T ? x : NULL, W, &r, mode, &v));
    k3_comm_get_stats(c, &s1);

    /* ---- receiver: exactly the deduplicated rows and their items, in the documented order */
    int64_t n_rows = 0, n_items = 0, bad = 0;
    *multi = false;
    for (int s = 0; s < E; s++)
        for (int64_t i = 0, t = 0; t < rt[s].T; t++) {
            int64_t a = i, cnt = 0;
            while (i < rt[s].n && rt[s].row[i] == t) cnt += rt[s].lane[i++] == lane;
            if (!cnt) continue;
            *multi |= cnt >= 2;
            if (n_rows < v.n_rows) {
                bad += v.row_seg[n_rows] != n_items;
                float rowh[W];
                be_down(be, rowh, v.rows + n_rows * W, W);
                for (int j = 0; j < W; j++) bad += rowh[j] != enc(F + stage * E + s, t, j);
            }
            for (int64_t k = a; k < i; k++) {
                if (rt[s].lane[k] != lane) continue;
                if (n_items < v.n_items)
                    bad += v.item_row[n_items] != n_rows || v.item_tag[n_items] != rt[s].tag[k] ||
                           v.item_w_host[n_items] != rt[s].w[k];
                n_items++;
            }
            n_rows++;
        }
    K3_CHECK(v.n_rows == n_rows && v.n_items == n_items && v.width == W && v.mode == mode,
             "round %d lane %d: got %lld rows / %lld items, want %lld / %lld", round, lane,
             (long long)v.n_rows, (long long)v.n_items, (long long)n_rows, (long long)n_items);
    if (v.n_rows == n_rows) bad += v.row_seg[n_rows] != n_items;
    K3_CHECK(bad == 0, "round %d lane %d (%s): %lld wrong rows/items/segments", round, lane,
             k3_combine_mode_name(mode), (long long)bad);
    if (E >= 3 && lane == E - 1)
        K3_CHECK(v.n_rows == 0 && v.n_items == 0, "lane %d owns nothing but got %lld rows", lane,
                 (long long)v.n_rows);
    /* the uploaded weights equal the host copy */
    float *wd = malloc((size_t)K3_MAX(v.n_items, 1) * sizeof(float));
    be_down(be, wd, v.item_w, v.n_items);
    bad = 0;
    for (int64_t i = 0; i < v.n_items; i++) bad += wd[i] != v.item_w_host[i];
    K3_CHECK(bad == 0, "round %d: %lld uploaded weights differ", round, (long long)bad);
    free(wd);

    /* ---- owner: compute the outputs on the host, write them to v.out */
    int64_t n_out = per_item ? v.n_items : v.n_rows;
    float *rows = malloc((size_t)K3_MAX(v.n_rows, 1) * W * sizeof(float));
    float *outh = malloc((size_t)K3_MAX(n_out, 1) * W * sizeof(float));
    be_down(be, rows, v.rows, v.n_rows * W);
    if (per_item)
        for (int64_t i = 0; i < v.n_items; i++)
            for (int j = 0; j < W; j++)
                outh[i * W + j] = f_expert(rows[v.item_row[i] * W + j], v.item_tag[i]);
    else
        for (int64_t j = 0; j < v.n_rows; j++)
            presum_row(rows + j * W, v.item_tag, v.item_w_host, NULL, v.row_seg[j],
                       v.row_seg[j + 1], 0, outh + j * W);
    if (n_out) K3_CHECK_OK(k3_backend_upload(be, v.out, outh, (size_t)(n_out * W) * sizeof(float)));

    /* ---- sender: y poisoned with NaN, then the combine */
    int64_t n_pairs = 0;
    for (int64_t i = 0; i < me->n; i++) { /* distinct (row, lane) */
        bool seen = false;
        for (int64_t k = i - 1; k >= 0 && me->row[k] == me->row[i] && !seen; k--)
            seen = me->lane[k] == me->lane[i];
        n_pairs += !seen;
    }
    int64_t n_y = per_item ? me->n : n_pairs;
    float *yh = malloc((size_t)K3_MAX(n_y, 1) * W * sizeof(float));
    for (int64_t i = 0; i < n_y * W; i++) yh[i] = NAN;
    float *y = be_alloc_up(be, yh, n_y * W);
    const int64_t *pair_seg = NULL;
    K3_CHECK_OK(k3_comm_moe_combine(c, be, y, per_item ? NULL : &pair_seg));
    k3_comm_get_stats(c, &s2);
    be_down(be, yh, y, n_y * W);
    bad = 0;
    if (per_item) {
        for (int64_t i = 0; i < me->n; i++)
            for (int j = 0; j < W; j++)
                bad += yh[i * W + j] != f_expert(xh[me->row[i] * W + j], me->tag[i]);
    } else {
        K3_CHECK(pair_seg != NULL, "presum: no pair_seg");
        int64_t p = 0;
        for (int64_t i = 0, t = 0; t < me->T && pair_seg; t++) {
            int64_t a = i;
            while (i < me->n && me->row[i] == t) i++;
            bad += pair_seg[t] != p;
            for (int e = 0; e < E; e++) { /* lanes ascending */
                bool has = false;
                for (int64_t k = a; k < i; k++) has |= me->lane[k] == e;
                if (!has) continue;
                float want[W];
                presum_row(xh + t * W, me->tag, me->w, me->lane, a, i, e, want);
                for (int j = 0; j < W && p < n_y; j++) bad += yh[p * W + j] != want[j];
                p++;
            }
        }
        if (pair_seg) bad += pair_seg[me->T] != n_pairs || p != n_pairs;
    }
    K3_CHECK(bad == 0, "round %d lane %d (%s): combine returned %lld wrong values", round, lane,
             k3_combine_mode_name(mode), (long long)bad);

    /* ---- the counters equal the formula (k3_comm.h) */
    uint64_t want_d = (uint64_t)(n_pairs * W * 4 + me->n * 12 + E * 24);
    uint64_t want_c = (uint64_t)((per_item ? v.n_items : v.n_rows) * W * 4);
    K3_CHECK(s1.dispatch_bytes - s0.dispatch_bytes == want_d &&
                 s1.dispatch_rows - s0.dispatch_rows == (uint64_t)n_pairs &&
                 s1.n_exchanges == s0.n_exchanges + 1,
             "round %d: dispatch counted %llu bytes / %llu rows, want %llu / %lld", round,
             (unsigned long long)(s1.dispatch_bytes - s0.dispatch_bytes),
             (unsigned long long)(s1.dispatch_rows - s0.dispatch_rows), (unsigned long long)want_d,
             (long long)n_pairs);
    K3_CHECK(s2.combine_bytes - s1.combine_bytes == want_c &&
                 s2.combine_rows - s1.combine_rows == want_c / (W * 4) &&
                 s2.dispatch_bytes == s1.dispatch_bytes,
             "round %d: combine counted %llu bytes, want %llu", round,
             (unsigned long long)(s2.combine_bytes - s1.combine_bytes), (unsigned long long)want_c);
    k3_backend_free(be, x);
    k3_backend_free(be, y);
    free(xh), free(yh), free(rows), free(outh), free(rt);
    return want_c;
}

/* Every lane fails together, and the group is still in step afterwards. */
static void moe_errors(k3_comm *c, k3_backend *be, int E, int F, uint64_t seed) {
    const int lane = k3_comm_lane(c);
    float xh[2 * W] = {0};
    float *x = be_alloc_up(be, xh, 2 * W);
    int32_t row[2] = {0, 1}, ln[2] = {0, E - 1}, tag[2] = {3, 4};
    float w[2] = {0.5f, 0.25f};
    k3_moe_route r = {
        .n_rows = 2, .n_items = 2, .item_row = row, .item_lane = ln, .item_tag = tag, .item_w = w};
    k3_dispatch_view v;
    K3_CHECK_ERR(k3_comm_moe_combine(c, be, x, NULL), K3_ERR_STATE,
                 "without a k3_comm_moe_dispatch");
    if (E >= 2) {
        /* lane 0 asks for PRESUM, the others PER_ITEM: everyone fails, naming the mode */
        k3_combine_mode m = lane == 0 ? K3_COMBINE_PRESUM : K3_COMBINE_PER_ITEM;
        K3_CHECK_ERR(k3_comm_moe_dispatch(c, be, x, W, &r, m, &v), K3_ERR_ARG, "combine mode");
        /* lane E-1 uses another width */
        K3_CHECK_ERR(
            k3_comm_moe_dispatch(c, be, x, lane == E - 1 ? W - 1 : W, &r, K3_COMBINE_PER_ITEM, &v),
            K3_ERR_ARG, "row width");
        /* lane E-1 routes to a lane that does not exist: it names its item, the others name it */
        int32_t ln_bad[2] = {0, lane == E - 1 ? E : E - 1};
        k3_moe_route rb = r;
        rb.item_lane = ln_bad;
        if (lane == E - 1)
            K3_CHECK_ERR(k3_comm_moe_dispatch(c, be, x, W, &rb, K3_COMBINE_PRESUM, &v), K3_ERR_ARG,
                         "item 1 goes to lane");
        else
            K3_CHECK_ERR(k3_comm_moe_dispatch(c, be, x, W, &rb, K3_COMBINE_PRESUM, &v), K3_ERR_COMM,
                         "rejected its own input");
        /* rows out of order on lane 0 */
        int32_t row_bad[2] = {1, 0};
        rb = r;
        rb.item_row = lane == 0 ? row_bad : row;
        K3_CHECK(k3_comm_moe_dispatch(c, be, x, W, &rb, K3_COMBINE_PER_ITEM, &v) != K3_OK,
                 "rows out of order accepted");
        K3_CHECK(lane != 0 || strstr(k3_last_error(), "nondecreasing"), "%s", k3_last_error());
    }
    k3_backend_free(be, x);
    /* still in step: a full exchange works */
    bool multi;
    moe_round(c, be, E, F, seed + 99, 0, K3_COMBINE_PRESUM, &multi);
}

static void test_moe(k3_comm *c, k3_backend *be, int E, int F, uint64_t seed, MPI_Comm ep) {
    uint64_t n_multi = 0;
    for (int round = 0; round < 6; round++) {
        bool multi_a = false, multi_b = false;
        uint64_t per = moe_round(c, be, E, F, seed, round, K3_COMBINE_PER_ITEM, &multi_a);
        uint64_t pre = moe_round(c, be, E, F, seed, round, K3_COMBINE_PRESUM, &multi_b);
        /* PRESUM returns one row per received row, PER_ITEM one per item */
        K3_CHECK(multi_a == multi_b && (multi_a ? pre < per : pre == per),
                 "round %d: presum %llu bytes vs per-item %llu (multi %d)", round,
                 (unsigned long long)pre, (unsigned long long)per, multi_a);
        /* over the group: rows with several items on one lane make presum strictly cheaper */
        uint64_t sums[3] = {per, pre, multi_a}, all[3] = {0, 0, 0};
        MPI_Allreduce(sums, all, 3, MPI_UINT64_T, MPI_SUM, ep);
        K3_CHECK(
            all[2] ? all[1] < all[0] : all[1] == all[0],
            "round %d: presum moved %llu bytes, per-item %llu (%llu lanes with multi-item rows)",
            round, (unsigned long long)all[1], (unsigned long long)all[0],
            (unsigned long long)all[2]);
        n_multi += all[2];
    }
    K3_CHECK(n_multi > 0, "no round had a row with several items on one lane (degenerate routes)");
    moe_errors(c, be, E, F, seed);
}

/* The node's doorbell (comm_bell.c): rank 1 waits for a message that rank 0 posts 300 ms later,
 * long after rank 1's wait has gone from polls to sleeps of tens of ms. The post must end that
 * sleep (a FUTEX_WAKE, counted in n_bell_wakes), not its timeout: a missing wake-up would leave
 * the count unchanged. Every rank of this test is on one node, so the doorbell is on. Then every
 * rank but 0 waits in a barrier that rank 0 joins 300 ms late. No wait may yield (header, 4.). */
static void test_bell(k3_comm *c, int rank, int size) {
    if (size < 2) return;
    enum { MAX_YIELDS = 10 }; /* the old waits: one a poll, hundreds in 300 ms */
    const struct timespec late = {0, 300 * 1000 * 1000L};
    K3_CHECK_OK(k3_comm_barrier(c));
    k3_comm_stats s0, s1;
    k3_comm_get_stats(c, &s0);
    const int32_t word = 0x6b33;
    if (rank == 0) {
        nanosleep(&late, NULL);
        K3_CHECK_OK(k3_comm_post(c, 1, K3_MSG_PROGRESS, &word, sizeof word, NULL, 0));
        K3_CHECK_OK(k3_comm_flush(c));
    } else if (rank == 1) {
        k3_comm_msg m;
        double t0 = MPI_Wtime();
        long y0 = atomic_load(&g_yields);
        K3_CHECK_OK(k3_comm_wait(c, 0, K3_MSG_PROGRESS, &m));
        long yields = atomic_load(&g_yields) - y0;
        K3_CHECK(m.n_meta_bytes == sizeof word && *(const int32_t *)m.meta == word, "bell message");
        k3_comm_get_stats(c, &s1);
        K3_CHECK(s1.n_bell_wakes > s0.n_bell_wakes,
                 "the post woke rank 1's sleep (%llu doorbell wake-ups, waited %.0f ms)",
                 (unsigned long long)(s1.n_bell_wakes - s0.n_bell_wakes), (MPI_Wtime() - t0) * 1e3);
        K3_CHECK(yields < MAX_YIELDS,
                 "rank 1 waited %.0f ms for a message and called sched_yield %ld times",
                 (MPI_Wtime() - t0) * 1e3, yields);
    }
    K3_CHECK_OK(k3_comm_barrier(c));
    if (rank == 0) nanosleep(&late, NULL);
    double t0 = MPI_Wtime();
    long y0 = atomic_load(&g_yields);
    K3_CHECK_OK(k3_comm_barrier(c));
    long yields = atomic_load(&g_yields) - y0;
    K3_CHECK(rank == 0 || yields < MAX_YIELDS,
             "rank %d waited %.0f ms in a barrier for rank 0 and called sched_yield %ld times",
             rank, (MPI_Wtime() - t0) * 1e3, yields);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    int S = argc > 1 ? atoi(argv[1]) : 1, E = argc > 2 ? atoi(argv[2]) : 1,
        F = argc > 3 ? atoi(argv[3]) : 0;
    uint64_t seed = argc > 4 ? strtoull(argv[4], NULL, 10) : 1234;
    const char *backends = argc > 5 ? argv[5] : "cpu,guard";
    const char *tr = argc > 6 ? argv[6] : "mpi";
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (rank == 0)
        printf("test_comm: S=%d E=%d first_worker=%d seed=%llu backends=%s transport=%s\n", S, E, F,
               (unsigned long long)seed, backends, tr);
    k3_comm_params prm = {.n_stages = S, .n_lanes = E, .first_worker = F, .timeout_s = 60};
    k3_comm *c = NULL;
    K3_CHECK_ERR(k3_comm_create("carrier-pigeon", &prm, &c), K3_ERR_ARG, "unknown transport");
    K3_CHECK_OK(k3_comm_create(tr, &prm, &c));
    if (!c) MPI_Abort(MPI_COMM_WORLD, 1);
    K3_CHECK(k3_comm_rank(c) == rank && k3_comm_size(c) == size, "rank/size");
    K3_CHECK(strcmp(k3_comm_transport(c), tr) == 0, "transport %s", k3_comm_transport(c));
    int stage = k3_comm_stage(c), lane = k3_comm_lane(c);
    K3_CHECK(rank < F ? stage == -1 : (stage == (rank - F) / E && lane == (rank - F) % E),
             "grid (%d,%d)", stage, lane);

    /* the test's own view of the EP groups (to sum the groups' traffic) */
    MPI_Comm ep = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, stage >= 0 ? stage : MPI_UNDEFINED, lane, &ep);

    test_messages(c, rank, size);
    test_bell(c, rank, size);
    if (stage >= 0) {
        /* each backend in turn on the same handle (comm re-allocates with the new backend) */
        char list[128];
        snprintf(list, sizeof list, "%s", backends);
        for (char *save = NULL, *name = strtok_r(list, ",", &save); name;
             name = strtok_r(NULL, ",", &save)) {
            k3_backend *be = NULL;
            K3_CHECK_OK(k3_backend_create(
                name, &(k3_backend_params){.n_threads = 1, .guard_reserve = (size_t)1 << 28}, &be));
            if (!be) continue; /* the failure is counted; every lane of the group skips alike */
            test_moe(c, be, E, F, seed, ep);
            k3_comm_destroy(c); /* free comm's buffers of this backend before it goes */
            c = NULL;
            K3_CHECK_OK(k3_comm_create(tr, &prm, &c));
            k3_backend_destroy(be);
            if (!c) MPI_Abort(MPI_COMM_WORLD, 1);
        }
    } else {
        k3_dispatch_view v;
        K3_CHECK_ERR(k3_comm_moe_dispatch(c, k3_backend_host(), NULL, 4, &(k3_moe_route){0},
                                          K3_COMBINE_PER_ITEM, &v),
                     K3_ERR_STATE, "without a stage");
        /* the workers re-create their handle once per backend (collective over the world) */
        char list[128];
        snprintf(list, sizeof list, "%s", backends);
        for (char *save = NULL, *name = strtok_r(list, ",", &save); name;
             name = strtok_r(NULL, ",", &save)) {
            k3_comm_destroy(c);
            c = NULL;
            K3_CHECK_OK(k3_comm_create(tr, &prm, &c));
            if (!c) MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }

    /* ---- 3. timeouts name the silent peer ---- */
    K3_CHECK_OK(k3_comm_barrier(c));
    if (rank == 0 && size > 1) {
        k3_comm_set_timeout(c, 1.0);
        k3_comm_msg m;
        double t0 = k3_now_s();
        char want[64];
        snprintf(want, sizeof want, "rank %d (stage %d, lane %d)", size - 1, (size - 1 - F) / E,
                 (size - 1 - F) % E);
        K3_CHECK_ERR(k3_comm_wait(c, size - 1, K3_MSG_STOP, &m), K3_ERR_COMM, want);
        double dt = k3_now_s() - t0;
        K3_CHECK(dt >= 0.9 && dt < 5, "timeout took %.2f s", dt);
        K3_CHECK(strstr(k3_last_error(), "--comm-timeout") != NULL, "%s", k3_last_error());
        k3_comm_set_timeout(c, 60);
    }
    K3_CHECK_OK(k3_comm_barrier(c));
    uint64_t all[64] = {0};
    K3_CHECK_OK(k3_comm_allgather_u64(c, (uint64_t)rank * 3, all));
    for (int r = 0; r < size && r < 64; r++)
        K3_CHECK(all[r] == (uint64_t)r * 3, "allgather[%d]", r);
    char msg[16] = {0};
    if (rank == 0) snprintf(msg, sizeof msg, "hello k3");
    K3_CHECK_OK(k3_comm_bcast(c, 0, msg, sizeof msg));
    K3_CHECK(strcmp(msg, "hello k3") == 0, "bcast got '%s'", msg);

    k3_comm_destroy(c);
    if (ep != MPI_COMM_NULL) MPI_Comm_free(&ep);
    int fails = k3_t_fail, total = 0;
    MPI_Allreduce(&fails, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (total && !fails) k3_t_fail = 1; /* one verdict on all ranks */
    int rc = 0;
    if (rank == 0)
        rc = k3_test_done("comm");
    else
        rc = k3_t_fail ? 1 : 0;
    MPI_Finalize();
    return rc;
}
