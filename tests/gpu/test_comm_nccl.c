/* test_comm_nccl.c — the NCCL transport of k3_comm (comm/comm_nccl.c) under mpirun on n ranks:
 * `test_comm_nccl [SEED] [BACKENDS]` (BACKENDS: comma-separated, default "cpu,cuda").
 * Label gpu on a device build, gpuemu in the emulation build (K3_CUDA_EMULATE: the NCCL stand-in
 * over MPI, comm/nccl_emu), where it runs on any number of ranks without a GPU.
 * 1. creation: the world communicator (an MPI_Bcast unique id), ncclCommSplit into the EP groups
 *    (a dedicated coordinator passes NCCL_SPLIT_NOCOLOR); an unknown transport is refused naming
 *    the transports this build has.
 * 2. MoE dispatch + combine on the grids 1 x n (every rank a lane) and, for n >= 2, 1 x (n-1)
 *    behind a dedicated coordinator, in PER_ITEM and PRESUM, on each backend: every lane sends
 *    rows to every lane including itself (row 0 has an item on each lane), rows whose items go to
 *    several lanes, rows with several items on one lane, rows without items. Each lane rebuilds
 *    every sender's route from the printed seed, so receivers check rows (payload = (source lane,
 *    row, column)), item rows, tags, weights, row_seg and the uploaded weights element by element;
 *    senders check the combine element by element (PER_ITEM: each item's output in its slot;
 *    PRESUM: per-(row, lane) sums in (row, lane ascending) order with pair_seg), bit for bit.
 * 3. (stand-in only) its API directly: argument/usage errors, a NOCOLOR split, a ring exchange, and
 *    on a blocking communicator a receive nobody sends fails at the deadline (sticky; abort at
 *    once). Then one rank posts no sends (K3_NCCL_EMU_TEST_DROP_SENDS): every rank's dispatch
 *    fails within the timeout with an error naming the EP group, instead of hanging.
 * One verdict on all ranks (MPI_Allreduce of the failure count). Without a device (device build)
 * it prints one SKIP line and exits 77; a device build also needs a GPU per rank. */
#include "k3_comm.h"
#include "k3_kernels.h"
#include "k3_test.h"
#include "gpu/k3_gpu_test.h"

#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#ifdef K3_NCCL_EMULATE
#include <nccl.h> /* the stand-in (comm/nccl_emu), tested directly too */
#endif

enum { W = 7, K = 3, X = 13, ROUNDS = 4 }; /* row width (odd), items of a multi row, tags */

static float enc(int lane, int64_t row, int64_t col) {
    return (float)(lane * 1000003 + row * 131 + col) * 0.25f; /* exact in fp32 for our sizes */
}
static float f_expert(float x, int tag) {
    return x * (float)(tag + 1) + 0.5f;
}

typedef struct route_t {
    int64_t T, n;
    int32_t *row, *lane, *tag;
    float *w;
} route_t;

/* The route of source lane `src` (every lane rebuilds every sender's). Row 0 has one item on every
 * lane plus a second on the sender's own; the others: no item, one item, K items on one lane, or
 * K items on random lanes. */
static void make_route(uint64_t seed, int round, int src, int E, route_t *rt) {
    k3_rng rng;
    k3_rng_seed(&rng, seed * 1000003u + (uint64_t)round * 131u + (uint64_t)src);
    rt->T = 3 + (int64_t)(k3_rng_u64(&rng) % 6) + src;
    int64_t cap = rt->T * (K + E + 1);
    rt->row = malloc((size_t)cap * sizeof(int32_t));
    rt->lane = malloc((size_t)cap * sizeof(int32_t));
    rt->tag = malloc((size_t)cap * sizeof(int32_t));
    rt->w = malloc((size_t)cap * sizeof(float));
    rt->n = 0;
    for (int64_t t = 0; t < rt->T; t++) {
        uint64_t kind = t == 0 ? 9 : k3_rng_u64(&rng) % 8;
        int k = kind == 9 ? E + 1 : kind == 0 ? 0 : kind == 1 ? 1 : K;
        int lane1 = (int)(k3_rng_u64(&rng) % (uint64_t)E);
        for (int j = 0; j < k; j++) {
            int ln = kind == 9   ? (j < E ? j : src)
                     : kind <= 3 ? lane1 /* 1 item, or K items on one lane */
                                 : (int)(k3_rng_u64(&rng) % (uint64_t)E);
            rt->row[rt->n] = (int32_t)t;
            rt->lane[rt->n] = ln;
            rt->tag[rt->n] = (int32_t)(k3_rng_u64(&rng) % X);
            rt->w[rt->n] = (float)k3_rng_uniform(&rng) + 0.25f;
            rt->n++;
        }
    }
}
static void route_free(route_t *rt) {
    free(rt->row), free(rt->lane), free(rt->tag), free(rt->w);
}

/* The pre-sum of one (row, lane): items [a, b) in slot order, only those on lane e (lane NULL:
 * all). The owner and the checker call this same function, so PRESUM must be bit-identical. */
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

static float *up(k3_backend *be, const float *host, int64_t n) {
    void *p = NULL;
    K3_CHECK_OK(k3_backend_alloc(be, (size_t)K3_MAX(n, 1) * sizeof(float), "test buffer", &p));
    if (p && n) K3_CHECK_OK(k3_backend_upload(be, p, host, (size_t)n * sizeof(float)));
    return p;
}
static void down(k3_backend *be, float *host, const float *dev, int64_t n) {
    if (n) K3_CHECK_OK(k3_backend_download(be, host, dev, (size_t)n * sizeof(float)));
}

/* One exchange, checked on both sides. Adds to stats[0] the rows received with >= 2 items, to
 * stats[1] the source rows whose items went to >= 2 lanes (the routes must not be degenerate). */
static void moe_round(k3_comm *c, k3_backend *be, int n_lanes, uint64_t seed, int round,
                      k3_combine_mode mode, int64_t stats[2]) {
    const int lane = k3_comm_lane(c);
    const bool per_item = mode == K3_COMBINE_PER_ITEM;
    route_t *rt = calloc((size_t)n_lanes, sizeof *rt);
    for (int e = 0; e < n_lanes; e++) make_route(seed, round, e, n_lanes, &rt[e]);
    const route_t *me = &rt[lane];
    float *xh = malloc((size_t)me->T * W * sizeof(float));
    for (int64_t t = 0; t < me->T; t++)
        for (int j = 0; j < W; j++) xh[t * W + j] = enc(lane, t, j);
    float *x = up(be, xh, me->T * W);
    k3_moe_route r = {.n_rows = me->T,
                      .n_items = me->n,
                      .item_row = me->row,
                      .item_lane = me->lane,
                      .item_tag = me->tag,
                      .item_w = me->w};
    k3_dispatch_view v;
    memset(&v, 0, sizeof v);
    k3_status st = k3_comm_moe_dispatch(c, be, x, W, &r, mode, &v);
    K3_CHECK_OK(st);
    if (st != K3_OK) goto out;

    /* ---- receiver: the deduplicated rows and their items, by source lane, then row order */
    int64_t n_rows = 0, n_items = 0, bad = 0;
    float *rows = malloc((size_t)K3_MAX(v.n_rows, 1) * W * sizeof(float));
    down(be, rows, v.rows, v.n_rows * W);
    for (int s = 0; s < n_lanes; s++)
        for (int64_t i = 0, t = 0; t < rt[s].T; t++) {
            int64_t a = i, cnt = 0;
            while (i < rt[s].n && rt[s].row[i] == t) cnt += rt[s].lane[i++] == lane;
            if (!cnt) continue;
            stats[0] += cnt >= 2;
            if (n_rows < v.n_rows) {
                bad += v.row_seg[n_rows] != n_items;
                for (int j = 0; j < W; j++) bad += rows[n_rows * W + j] != enc(s, t, j);
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
             "round %d lane %d (%s): got %lld rows / %lld items, want %lld / %lld", round, lane,
             k3_combine_mode_name(mode), (long long)v.n_rows, (long long)v.n_items,
             (long long)n_rows, (long long)n_items);
    if (v.n_rows == n_rows) bad += v.row_seg[n_rows] != n_items;
    K3_CHECK(bad == 0, "round %d lane %d (%s): %lld wrong rows / items / segments", round, lane,
             k3_combine_mode_name(mode), (long long)bad);
    float *wd = malloc((size_t)K3_MAX(v.n_items, 1) * sizeof(float));
    down(be, wd, v.item_w, v.n_items);
    bad = 0;
    for (int64_t i = 0; i < v.n_items; i++) bad += wd[i] != v.item_w_host[i];
    K3_CHECK(bad == 0, "round %d lane %d: %lld uploaded weights differ", round, lane,
             (long long)bad);
    free(wd);

    /* ---- owner: the outputs, written to v.out */
    int64_t n_out = per_item ? v.n_items : v.n_rows;
    float *outh = malloc((size_t)K3_MAX(n_out, 1) * W * sizeof(float));
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
    for (int64_t i = 0, t = 0; t < me->T; t++) { /* rows split over several lanes */
        int64_t a = i;
        while (i < me->n && me->row[i] == t) i++;
        bool split = false;
        for (int64_t k = a + 1; k < i; k++) split |= me->lane[k] != me->lane[a];
        stats[1] += split;
    }
    int64_t n_y = per_item ? me->n : n_pairs;
    float *yh = malloc((size_t)K3_MAX(n_y, 1) * W * sizeof(float));
    for (int64_t i = 0; i < n_y * W; i++) yh[i] = NAN;
    float *y = up(be, yh, n_y * W);
    const int64_t *pair_seg = NULL;
    K3_CHECK_OK(k3_comm_moe_combine(c, be, y, per_item ? NULL : &pair_seg));
    down(be, yh, y, n_y * W);
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
            for (int e = 0; e < n_lanes; e++) { /* lanes ascending */
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
    k3_backend_free(be, y);
    free(rows), free(outh), free(yh);
out:
    k3_backend_free(be, x);
    free(xh);
    for (int e = 0; e < n_lanes; e++) route_free(&rt[e]);
    free(rt);
}

/* The grid 1 x E behind F coordinators, on each backend of the list. */
static void test_grid(int E, int F, uint64_t seed, const char *backends) {
    k3_comm_params prm = {.n_stages = 1, .n_lanes = E, .first_worker = F, .timeout_s = 60};
    char list[128];
    snprintf(list, sizeof list, "%s", backends);
    for (char *save = NULL, *name = strtok_r(list, ",", &save); name;
         name = strtok_r(NULL, ",", &save)) {
        k3_backend *be = NULL;
        K3_CHECK_OK(k3_backend_create(name, &(k3_backend_params){.n_threads = 1}, &be));
        k3_comm *c = NULL;
        K3_CHECK_OK(k3_comm_create("nccl", &prm, &c));
        if (!c) MPI_Abort(MPI_COMM_WORLD, 1); /* the others would wait in the collectives */
        K3_CHECK(strcmp(k3_comm_transport(c), "nccl") == 0, "transport %s", k3_comm_transport(c));
        int rank = k3_comm_rank(c);
        K3_CHECK(rank < F ? k3_comm_stage(c) == -1
                          : k3_comm_stage(c) == 0 && k3_comm_lane(c) == rank - F,
                 "rank %d: stage %d lane %d", rank, k3_comm_stage(c), k3_comm_lane(c));
        int64_t stats[2] = {0, 0}, all[2] = {0, 0};
        if (k3_comm_stage(c) == 0 && be)
            for (int round = 0; round < ROUNDS; round++) {
                moe_round(c, be, E, seed, round, K3_COMBINE_PER_ITEM, stats);
                moe_round(c, be, E, seed, round, K3_COMBINE_PRESUM, stats);
            }
        MPI_Allreduce(stats, all, 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
        if (be) /* not degenerate: rows with several items on one lane, rows over several lanes */
            K3_CHECK(all[0] > 0 && (E < 2 || all[1] > 0),
                     "%s, 1 x %d: %lld multi-item rows, %lld split rows", name, E,
                     (long long)all[0], (long long)all[1]);
        K3_CHECK_OK(k3_comm_barrier(c));
        k3_comm_destroy(c); /* frees comm's buffers of this backend before it goes */
        k3_backend_destroy(be);
    }
}

#ifdef K3_NCCL_EMULATE
/* The stand-in's own API (blocking communicators, which comm_nccl.c does not use): argument and
 * usage errors, a split with NCCL_SPLIT_NOCOLOR, a ring exchange, and a receive nobody sends,
 * which fails at the deadline with a sticky error; abort returns at once. */
static void test_standin_api(int rank, int size) {
    setenv("K3_NCCL_EMU_TIMEOUT_S", "0.5", 1);
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (rank == 0) K3_CHECK(ncclGetUniqueId(&id) == ncclSuccess, "unique id");
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t w = NULL, s = NULL;
    K3_CHECK(ncclCommInitRankConfig(&w, size + 1, id, rank, NULL) == ncclInvalidArgument && !w,
             "a world of %d ranks accepted", size + 1);
    K3_CHECK(ncclCommInitRankConfig(&w, size, id, rank, NULL) == ncclSuccess && w, "init");
    if (!w) MPI_Abort(MPI_COMM_WORLD, 1);
    K3_CHECK(ncclCommSplit(w, rank % 2 ? NCCL_SPLIT_NOCOLOR : 7, -rank, &s, NULL) == ncclSuccess &&
                 (rank % 2 ? s == NULL : s != NULL),
             "split: rank %d got %p", rank, (void *)s);
    K3_CHECK(ncclCommDestroy(s) == ncclSuccess, "destroy the split");
    int32_t out[5], in[5] = {0, 0, 0, 0, 0};
    K3_CHECK(ncclGroupEnd() == ncclInvalidUsage, "a group end without a start");
    K3_CHECK(ncclSend(out, 5, ncclInt32, size, w, NULL) == ncclInvalidArgument, "peer %d", size);
    K3_CHECK(ncclSend(out, 5, (ncclDataType_t)99, 0, w, NULL) == ncclInvalidArgument, "a type");
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    for (int i = 0; i < 5; i++) out[i] = rank * 100 + i;
    ncclGroupStart();
    ncclSend(out, 5, ncclInt32, next, w, NULL);
    ncclRecv(in, 5, ncclInt32, prev, w, NULL);
    K3_CHECK(ncclGroupEnd() == ncclSuccess, "ring group");
    int bad = 0;
    for (int i = 0; i < 5; i++) bad += in[i] != prev * 100 + i;
    K3_CHECK(bad == 0, "ring: %d wrong words from rank %d", bad, prev);
    MPI_Barrier(MPI_COMM_WORLD); /* nobody's ring send is still on its way */
    double t0 = k3_now_s();
    ncclResult_t r = ncclRecv(in, 1, ncclInt32, rank, w, NULL), a = ncclSuccess;
    double dt = k3_now_s() - t0;
    K3_CHECK(r == ncclRemoteError && dt > 0.4 && dt < 10, "a receive nobody sends: %s after %.2f s",
             ncclGetErrorString(r), dt);
    K3_CHECK(strstr(ncclGetErrorString(r), "K3_NCCL_EMU_TIMEOUT_S") != NULL, "error string");
    K3_CHECK(ncclCommGetAsyncError(w, &a) == ncclSuccess && a == ncclRemoteError, "sticky: %s",
             ncclGetErrorString(a));
    K3_CHECK(ncclSend(out, 1, ncclInt32, next, w, NULL) == ncclRemoteError, "a failed comm sends");
    t0 = k3_now_s();
    K3_CHECK(ncclCommAbort(w) == ncclSuccess && k3_now_s() - t0 < 0.5, "abort");
    unsetenv("K3_NCCL_EMU_TIMEOUT_S");
}

/* One rank posts no sends: every rank fails within the timeout naming the EP group. */
static void test_silent_lane(int size) {
    char drop[16];
    snprintf(drop, sizeof drop, "%d", size - 1);
    setenv("K3_NCCL_EMU_TIMEOUT_S", "1", 1);
    setenv("K3_NCCL_EMU_TEST_DROP_SENDS", drop, 1);
    k3_comm_params prm = {.n_stages = 1, .n_lanes = size, .first_worker = 0, .timeout_s = 60};
    k3_comm *c = NULL;
    K3_CHECK_OK(k3_comm_create("nccl", &prm, &c)); /* the hook drops p2p sends, not set-up */
    unsetenv("K3_NCCL_EMU_TEST_DROP_SENDS");
    unsetenv("K3_NCCL_EMU_TIMEOUT_S");
    if (!c) MPI_Abort(MPI_COMM_WORLD, 1);
    k3_comm_set_timeout(c, 2.0);
    float x[W];
    for (int j = 0; j < W; j++) x[j] = enc(k3_comm_lane(c), 0, j);
    int32_t row[1] = {0}, ln[1] = {0}, tag[1] = {1};
    float w[1] = {1.0f};
    k3_moe_route r = {
        .n_rows = 1, .n_items = 1, .item_row = row, .item_lane = ln, .item_tag = tag, .item_w = w};
    k3_dispatch_view v;
    const double t0 = k3_now_s();
    K3_CHECK_ERR(k3_comm_moe_dispatch(c, k3_backend_host(), x, W, &r, K3_COMBINE_PER_ITEM, &v),
                 K3_ERR_COMM, "the EP group of stage 0");
    const double dt = k3_now_s() - t0;
    if (k3_comm_rank(c) == 0) fprintf(stderr, "(the expected error) %s\n", k3_last_error());
    K3_CHECK(dt < 20, "the failed dispatch took %.1f s (stand-in 1 s + comm timeout 2 s)", dt);
    K3_CHECK(k3_comm_fault_pending(c), "no fault noted");
    k3_comm_destroy(c);
}
#endif

int main(int argc, char **argv) {
    if (k3_gpu_skip()) return 77;
    MPI_Init(&argc, &argv);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 10) : 1234;
    const char *backends = argc > 2 ? argv[2] : "cpu,cuda";
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
#ifndef K3_NCCL_EMULATE /* NCCL refuses two ranks on one GPU */
    int n_dev = k3_backend_cuda_devices(NULL, 0);
    if (size > n_dev) {
        if (rank == 0) printf("SKIP: %d ranks but %d CUDA devices\n", size, n_dev);
        MPI_Finalize();
        return 77;
    }
#endif
    if (rank == 0)
        printf("test_comm_nccl: %d ranks, seed %llu, backends %s\n", size, (unsigned long long)seed,
               backends);

    k3_comm_params prm = {.n_stages = 1, .n_lanes = size, .first_worker = 0, .timeout_s = 60};
    k3_comm *c = NULL;
    K3_CHECK_ERR(k3_comm_create("carrier-pigeon", &prm, &c), K3_ERR_ARG,
                 "(this build has: mpi nccl)");
    test_grid(size, 0, seed, backends);
    if (size >= 2) test_grid(size - 1, 1, seed + 1, backends);
#ifdef K3_NCCL_EMULATE
    test_standin_api(rank, size);
    test_silent_lane(size);
#endif

    int fails = k3_t_fail, total = 0;
    MPI_Allreduce(&fails, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (total && !fails) k3_t_fail = 1; /* one verdict on all ranks */
    int rc = rank == 0 ? k3_test_done("comm_nccl") : (k3_t_fail ? 1 : 0);
    MPI_Finalize();
    return rc;
}
