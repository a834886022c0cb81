/* test_comm_nccl.c — the NCCL transport of k3_comm (comm/comm_nccl.c) under mpirun on n ranks:
 * `test_comm_nccl`.
 * Label gpu on a device build, gpuemu in the emulation build (K3_CUDA_EMULATE: the NCCL stand-in
 * over MPI, comm/nccl_emu), where it runs on any number of ranks without a GPU.
 * 1. creation: the world communicator (an MPI_Bcast unique id), ncclCommSplit into the EP group
 *    of 1 x n, and 1 x (n-1) behind a dedicated coordinator (NCCL_SPLIT_NOCOLOR); an unknown
 *    transport is refused naming the transports this build has. (The MoE dispatch and combine on
 *    nccl, element by element in both modes: tests/mpi/test_comm.c with TRANSPORT nccl, which
 *    tests/gpu/tests.cmake registers beside this test.)
 * 2. (stand-in only) its API directly: argument/usage errors, a NOCOLOR split, a ring exchange, and
 *    on a blocking communicator a receive nobody sends fails at the deadline (sticky; abort at
 *    once). Then one rank posts no sends (K3_NCCL_EMU_TEST_DROP_SENDS): every rank's dispatch
 *    fails within the timeout with an error naming the EP group, instead of hanging. A ring
 *    exchange captured in a CUDA graph moves nothing at capture and the current words at each
 *    launch; a captured group that mixes streams is refused.
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

enum { W = 7 }; /* row width of the silent-lane dispatch */

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

/* A ring exchange captured in a CUDA graph (the emulator's capture): nothing moves at the group's
 * end; each launch of the graph moves the words the send buffer holds then. A group that mixes a
 * capturing stream with another is refused. */
static void test_standin_capture(int rank, int size) {
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (rank == 0) K3_CHECK(ncclGetUniqueId(&id) == ncclSuccess, "unique id");
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t w = NULL;
    K3_CHECK(ncclCommInitRankConfig(&w, size, id, rank, NULL) == ncclSuccess && w, "init");
    if (!w) MPI_Abort(MPI_COMM_WORLD, 1);
    cudaStream_t s = NULL, other = NULL;
    K3_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "stream");
    K3_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking) == cudaSuccess, "stream");
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    int32_t out[5], in[5];
    for (int i = 0; i < 5; i++) out[i] = -1, in[i] = -7;
    K3_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess, "begin");
    ncclGroupStart();
    ncclSend(out, 5, ncclInt32, next, w, s);
    ncclRecv(in, 5, ncclInt32, prev, w, s);
    K3_CHECK(ncclGroupEnd() == ncclSuccess, "a group in a capture is recorded");
    ncclGroupStart();
    ncclSend(out, 5, ncclInt32, next, w, s);
    ncclRecv(in, 5, ncclInt32, prev, w, other);
    K3_CHECK(ncclGroupEnd() == ncclInvalidUsage, "a group mixing streams in a capture");
    cudaGraph_t g = NULL;
    cudaGraphExec_t x = NULL;
    K3_CHECK(cudaStreamEndCapture(s, &g) == cudaSuccess && g, "end capture");
    K3_CHECK(in[0] == -7, "nothing moved during the capture (%d)", in[0]);
    K3_CHECK(cudaGraphInstantiate(&x, g, 0) == cudaSuccess, "instantiate");
    for (int rep = 0; rep < 3; rep++) {
        for (int i = 0; i < 5; i++) out[i] = rank * 1000 + rep * 10 + i;
        K3_CHECK(cudaGraphLaunch(x, s) == cudaSuccess, "launch %d", rep);
        int bad = 0;
        for (int i = 0; i < 5; i++) bad += in[i] != prev * 1000 + rep * 10 + i;
        K3_CHECK(bad == 0, "launch %d: %d wrong words from rank %d (in[0] %d)", rep, bad, prev,
                 in[0]);
    }
    ncclResult_t a = ncclInternalError;
    K3_CHECK(ncclCommGetAsyncError(w, &a) == ncclSuccess && a == ncclSuccess, "no async error");
    cudaGraphExecDestroy(x);
    cudaGraphDestroy(g);
    cudaStreamDestroy(s);
    cudaStreamDestroy(other);
    K3_CHECK(ncclCommDestroy(w) == ncclSuccess, "destroy");
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
    for (int j = 0; j < W; j++) x[j] = (float)(100 * k3_comm_lane(c) + j);
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
    if (rank == 0) printf("test_comm_nccl: %d ranks\n", size);

    k3_comm_params prm = {.n_stages = 1, .n_lanes = size, .first_worker = 0, .timeout_s = 60};
    k3_comm *c = NULL;
    K3_CHECK_ERR(k3_comm_create("carrier-pigeon", &prm, &c), K3_ERR_ARG,
                 "(this build has: mpi nccl)");
    for (int F = 0; F <= (size >= 2); F++) { /* 1 x n, then 1 x (n-1) behind a coordinator */
        prm = (k3_comm_params){
            .n_stages = 1, .n_lanes = size - F, .first_worker = F, .timeout_s = 60};
        K3_CHECK_OK(k3_comm_create("nccl", &prm, &c));
        if (!c) MPI_Abort(MPI_COMM_WORLD, 1); /* the others would wait in the collectives */
        K3_CHECK(strcmp(k3_comm_transport(c), "nccl") == 0, "transport %s", k3_comm_transport(c));
        K3_CHECK(rank < F ? k3_comm_stage(c) == -1
                          : k3_comm_stage(c) == 0 && k3_comm_lane(c) == rank - F,
                 "rank %d: stage %d lane %d", rank, k3_comm_stage(c), k3_comm_lane(c));
        K3_CHECK(k3_comm_device_payloads(c), "nccl without device payloads");
        K3_CHECK_OK(k3_comm_barrier(c));
        k3_comm_destroy(c);
        c = NULL;
    }
#ifdef K3_NCCL_EMULATE
    test_standin_api(rank, size);
    test_standin_capture(rank, size);
    test_silent_lane(size);
#endif

    int fails = k3_t_fail, total = 0;
    MPI_Allreduce(&fails, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (total && !fails) k3_t_fail = 1; /* one verdict on all ranks */
    int rc = rank == 0 ? k3_test_done("comm_nccl") : (k3_t_fail ? 1 : 0);
    MPI_Finalize();
    return rc;
}
