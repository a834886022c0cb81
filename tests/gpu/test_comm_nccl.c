/* test_comm_nccl.c — the NCCL transport of k3_comm (comm/comm_nccl.c) on one rank and one GPU
 * (label gpu): creation (world communicator from an MPI_Bcast unique id, ncclCommSplit into the
 * EP group), then one MoE dispatch + combine through it on the cpu backend, checked element by
 * element (the payload encodes row and column; the combine returns item i's row scaled by i+1).
 * NCCL refuses two ranks on one GPU, so the multi-rank cases need >= 2 GPUs (not here yet).
 * Without a device it prints one SKIP line and exits 77. */
#include "k3_comm.h"
#include "k3_kernels.h"
#include "k3_test.h"
#include "gpu/k3_gpu_test.h"

#include <mpi.h>
#include <string.h>

int main(int argc, char **argv) {
    if (k3_gpu_skip()) return 77;
    MPI_Init(&argc, &argv);
    k3_comm_params prm = {.n_stages = 1, .n_lanes = 1, .first_worker = 0, .timeout_s = 60};
    k3_comm *c = NULL;
    K3_CHECK_OK(k3_comm_create("nccl", &prm, &c));
    if (!c) {
        MPI_Finalize();
        return k3_test_done("comm_nccl");
    }
    K3_CHECK(strcmp(k3_comm_transport(c), "nccl") == 0, "transport %s", k3_comm_transport(c));
    enum { W = 8, R = 3, I = 5 };
    float x[R * W], wts[I] = {0.5f, 0.25f, 1.0f, 2.0f, -1.0f};
    for (int r = 0; r < R; r++)
        for (int d = 0; d < W; d++) x[r * W + d] = (float)(100 * r + d);
    const int32_t item_row[I] = {0, 0, 1, 2, 2}, item_lane[I] = {0, 0, 0, 0, 0};
    const int32_t item_tag[I] = {10, 11, 12, 13, 14};
    k3_moe_route route = {.n_rows = R,
                          .n_items = I,
                          .item_row = item_row,
                          .item_lane = item_lane,
                          .item_tag = item_tag,
                          .item_w = wts};
    k3_backend *be = k3_backend_host();
    k3_dispatch_view v;
    K3_CHECK_OK(k3_comm_moe_dispatch(c, be, x, W, &route, K3_COMBINE_PER_ITEM, &v));
    K3_CHECK(v.n_rows == R && v.n_items == I && v.width == W, "view %lld rows %lld items",
             (long long)v.n_rows, (long long)v.n_items);
    if (v.n_rows == R && v.n_items == I) {
        K3_CHECK(memcmp(v.rows, x, sizeof x) == 0, "dispatched rows differ");
        bool meta = true;
        for (int i = 0; i < I; i++)
            meta &= v.item_row[i] == item_row[i] && v.item_tag[i] == item_tag[i] &&
                    v.item_w_host[i] == wts[i];
        K3_CHECK(meta, "dispatched item metadata differs");
        for (int i = 0; i < I; i++)
            for (int d = 0; d < W; d++)
                v.out[i * W + d] = (float)(i + 1) * v.rows[v.item_row[i] * W + d];
        float y[I * W];
        memset(y, 0, sizeof y);
        K3_CHECK_OK(k3_comm_moe_combine(c, be, y, NULL));
        bool ok = true;
        for (int i = 0; i < I; i++)
            for (int d = 0; d < W; d++)
                ok &= y[i * W + d] == (float)(i + 1) * x[item_row[i] * W + d];
        K3_CHECK(ok, "combined outputs differ");
    }
    k3_comm_destroy(c);
    MPI_Finalize();
    return k3_test_done("comm_nccl");
}
