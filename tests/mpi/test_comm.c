/* test_comm.c — k3_comm under mpirun: `test_comm S E FIRST_WORKER [SEED]`.
 * 1. messages: every rank sends a large (rendezvous-sized) ACTIV message to the next rank BEFORE
 *    receiving from the previous one (async sends must not deadlock); payloads encode (source
 *    rank, index) and the header fields are checked; a corrupt header is rejected.
 * 2. MoE dispatch/combine in each stage's EP group: rows encode (source rank, slot, column), an
 *    irregular expert -> lane map with an expert nobody routes to and a lane owning nothing,
 *    one lane with zero rows; receivers check each row against its (src, slot, expert) metadata
 *    and that they own the expert; combine(dispatch(x)) must return f(x) in slot order bit for bit,
 *    and the top-k weighted sums match a local computation.
 * 3. a receive that never comes times out after --comm-timeout naming the silent peer.
 * One verdict on all ranks (MPI_Allreduce of the failure count). */
#include "k3_comm.h"
#include "k3_test.h"

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static float enc(int rank, int64_t slot, int64_t col) {
    return (float)(rank * 1000003 + slot * 131 + col) * 0.25f; /* exact in fp32 for our sizes */
}
static float f_expert(float x, int expert) {
    return x * (float)(expert + 1) + 0.5f;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    int S = argc > 1 ? atoi(argv[1]) : 1, E = argc > 2 ? atoi(argv[2]) : 1,
        F = argc > 3 ? atoi(argv[3]) : 0;
    uint64_t seed = argc > 4 ? strtoull(argv[4], NULL, 10) : 1234;
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (rank == 0)
        printf("test_comm: S=%d E=%d first_worker=%d seed=%llu\n", S, E, F,
               (unsigned long long)seed);
    k3_comm *c = NULL;
    K3_CHECK_OK(k3_comm_create_mpi(
        &(k3_comm_params){.n_stages = S, .n_lanes = E, .first_worker = F, .timeout_s = 60}, &c));
    if (!c) {
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    K3_CHECK(k3_comm_rank(c) == rank && k3_comm_size(c) == size, "rank/size");
    int stage = k3_comm_stage(c), lane = k3_comm_lane(c);
    K3_CHECK(rank < F ? stage == -1 : (stage == (rank - F) / E && lane == (rank - F) % E),
             "grid (%d,%d)", stage, lane);

    /* ---- 1. messages around a ring, sends before receives ---- */
    {
        const int64_t T = 300, D = 256; /* 300 KB + bank: far above the eager limit */
        const int nb = 2;
        int64_t nf = T * D * (1 + nb);
        float *buf = malloc((size_t)nf * sizeof(float));
        for (int64_t i = 0; i < nf; i++) buf[i] = enc(rank, i, 0);
        int32_t meta[3] = {rank, 7, -rank};
        bool got = true;
        k3_msg m;
        K3_CHECK_OK(k3_comm_try_recv(c, K3_ANY_RANK, K3_MSG_ACTIV, &m, &got));
        K3_CHECK(!got, "a message before anyone sent");
        K3_CHECK_OK(k3_comm_barrier(c)); /* nobody sends before everyone has checked */
        int next = (rank + 1) % size, prev = (rank + size - 1) % size;
        for (int rep = 0; rep < 3; rep++) /* several in flight at once */
            K3_CHECK_OK(k3_comm_send(
                c, next, (k3_msg_hdr){.kind = K3_MSG_ACTIV, .T = T, .n_bank = nb, .D = D}, meta, 3,
                &(k3_f32_seg){buf, nf}, 1));
        for (int rep = 0; rep < 3; rep++) {
            K3_CHECK_OK(k3_comm_recv(c, prev, K3_MSG_ACTIV, &m));
            K3_CHECK(m.src == prev && m.hdr.T == T && m.hdr.n_bank == nb && m.hdr.D == D &&
                         m.hdr.n_f32 == nf && m.hdr.n_meta == 3,
                     "header from %d: T %lld bank %d D %lld", m.src, (long long)m.hdr.T,
                     m.hdr.n_bank, (long long)m.hdr.D);
            K3_CHECK(m.meta[0] == prev && m.meta[1] == 7 && m.meta[2] == -prev, "meta %d %d %d",
                     m.meta[0], m.meta[1], m.meta[2]);
            int64_t bad = 0;
            for (int64_t i = 0; i < nf; i++) bad += m.f32[i] != enc(prev, i, 0);
            K3_CHECK(bad == 0, "%lld wrong floats from rank %d", (long long)bad, prev);
        }
        K3_CHECK_OK(k3_comm_flush(c));
        free(buf);
        /* a corrupt header (raw MPI message on the BATCH tag) is rejected, naming the sender */
        if (size > 1) {
            char junk[64] = {0};
            MPI_Request rq;
            if (rank == 0)
                MPI_Isend(junk, sizeof junk, MPI_BYTE, 1, K3_MSG_BATCH, MPI_COMM_WORLD, &rq);
            if (rank == 1)
                K3_CHECK_ERR(k3_comm_recv(c, 0, K3_MSG_BATCH, &m), K3_ERR_FORMAT, "from rank 0");
            if (rank == 0) MPI_Wait(&rq, MPI_STATUS_IGNORE);
            /* a good header whose length disagrees with the bytes received */
            k3_msg_hdr h = {.magic = K3_MSG_MAGIC,
                            .version = K3_MSG_VERSION,
                            .kind = K3_MSG_BATCH,
                            .n_bytes = sizeof h + 8,
                            .n_f32 = 2};
            if (rank == 0) MPI_Isend(&h, sizeof h, MPI_BYTE, 1, K3_MSG_BATCH, MPI_COMM_WORLD, &rq);
            if (rank == 1)
                K3_CHECK_ERR(k3_comm_recv(c, 0, K3_MSG_BATCH, &m), K3_ERR_FORMAT,
                             "does not match the header");
            if (rank == 0) MPI_Wait(&rq, MPI_STATUS_IGNORE);
        }
    }

    /* ---- 2. dispatch / combine ---- */
    if (stage >= 0) {
        k3_rng rng;
        k3_rng_seed(&rng, seed * 7919 + (uint64_t)rank);
        const int X = 11, K = 3, W = 5; /* experts, top-k, row width */
        int owner[11];
        /* E >= 3: lane E-1 owns nothing; E == 2: alternate so rows really get permuted */
        for (int x = 0; x < X; x++) owner[x] = E >= 3 ? (x * 7 + 3) % (E - 1) : x % E;
        for (int round = 0; round < 4; round++) {
            int64_t T =
                (lane == 0 && round % 2 == 1) ? 0 : (int64_t)(1 + k3_rng_u64(&rng) % 9) + lane;
            int64_t n = T * K;
            float *rows = malloc((size_t)K3_MAX(n, 1) * W * sizeof(float));
            float *out = malloc((size_t)K3_MAX(n, 1) * W * sizeof(float));
            int32_t *ex = malloc((size_t)K3_MAX(n, 1) * sizeof(int32_t)),
                    *dl = malloc((size_t)K3_MAX(n, 1) * sizeof(int32_t));
            for (int64_t i = 0; i < n; i++) {
                ex[i] = (int32_t)(k3_rng_u64(&rng) %
                                  (uint64_t)(X - 1)); /* expert X-1 never routed to */
                dl[i] = owner[ex[i]];
                for (int j = 0; j < W; j++) rows[i * W + j] = enc(rank, i, j);
            }
            for (int64_t i = 0; i < n * W; i++) out[i] = NAN;
            k3_dispatch_view v;
            K3_CHECK_OK(k3_comm_dispatch(c, rows, n, W, ex, dl, &v));
            int64_t bad = 0;
            for (int64_t j = 0; j < v.n_recv; j++) {
                int src = v.src[j], slot = v.slot[j], x = v.expert[j];
                bad += (x < 0 || x >= X || owner[x] != lane);
                bad += src < F + stage * E || src >= F + (stage + 1) * E;
                for (int k = 0; k < W; k++) {
                    bad += v.rows[j * W + k] != enc(src, slot, k);
                    v.out[j * W + k] = f_expert(v.rows[j * W + k], x);
                }
            }
            K3_CHECK(bad == 0, "round %d: %lld bad received rows/metadata", round, (long long)bad);
            if (E >= 3 && lane == E - 1)
                K3_CHECK(v.n_recv == 0, "lane %d owns nothing but got %lld rows", lane,
                         (long long)v.n_recv);
            K3_CHECK_OK(k3_comm_combine(c, out));
            bad = 0;
            for (int64_t i = 0; i < n; i++)
                for (int j = 0; j < W; j++)
                    bad += out[i * W + j] != f_expert(rows[i * W + j], ex[i]);
            K3_CHECK(bad == 0, "round %d: combine(dispatch(x)) differs in %lld values", round,
                     (long long)bad);
            /* weighted per-token sums in slot order equal the local computation */
            double worst = 0;
            for (int64_t t = 0; t < T; t++)
                for (int j = 0; j < W; j++) {
                    float a = 0, b = 0;
                    for (int k = 0; k < K; k++) {
                        float w = 1.0f / (float)(k + 2);
                        a += w * out[(t * K + k) * W + j];
                        b += w * f_expert(rows[(t * K + k) * W + j], ex[t * K + k]);
                    }
                    worst = fmax(worst, fabs((double)a - b));
                }
            K3_CHECK(worst == 0, "round %d: weighted sums differ by %g", round, worst);
            free(rows), free(out), free(ex), free(dl);
        }
    } else {
        k3_dispatch_view v;
        K3_CHECK_ERR(k3_comm_dispatch(c, NULL, 0, 4, NULL, NULL, &v), K3_ERR_STATE,
                     "without a stage");
    }

    /* ---- 3. timeouts name the silent peer ---- */
    K3_CHECK_OK(k3_comm_barrier(c));
    if (rank == 0 && size > 1) {
        k3_comm_set_timeout(c, 1.0);
        k3_msg m;
        double t0 = k3_now_s();
        char want[64];
        if (F == 1)
            snprintf(want, sizeof want, "rank %d (stage %d, lane %d)", size - 1, (size - 2) / E,
                     (size - 2) % E);
        else
            snprintf(want, sizeof want, "rank %d (stage %d, lane %d)", size - 1, (size - 1) / E,
                     (size - 1) % E);
        K3_CHECK_ERR(k3_comm_recv(c, size - 1, K3_MSG_STOP, &m), K3_ERR_COMM, want);
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
