/* comm_nccl.c — the NCCL transport of k3_comm ("nccl"; built with K3_NCCL). `--comm nccl` (or
 * auto with the cuda backend) selects it. Tested under mpirun in every CI run through the
 * emulation build (K3_CUDA_EMULATE: comm/nccl_emu, the NCCL API over MPI on host memory); not yet
 * run on a device.
 *
 * Layering: the MPI transport (comm_mpi.c) stays the control plane — messages, the world
 * collectives, the process set-up and the fault exchange — and this file replaces the data
 * plane: ep_alltoall (the count exchange) and ep_alltoallv (host words: the MoE item triples) run
 * as grouped ncclSend/ncclRecv on a per-stage communicator through staging buffers;
 * ep_alltoallv_dev (the MoE rows) and p2p_dev (the stage hand-off's activations, on the world
 * communicator) move backend buffers directly, queued in the backend's stream
 * (k3_backend_native_stream) so that they follow the kernels that wrote them. The transport object
 * is the MPI one (k3_comm_mpi_create) whose iface pointer is switched to a table here that embeds
 * the NCCL state (nccl_state, iface first) and forwards every other entry to the MPI functions.
 *
 * Set-up: local rank (OMPI_COMM_WORLD_LOCAL_RANK / SLURM_LOCALID / MPI_LOCALRANKID) → device
 * local % devices; rank 0 makes the unique id, MPI_Bcast (the MPI transport's bcast) gives it to
 * all; one world communicator (ncclCommInitRankConfig), then ncclCommSplit(color = stage, key =
 * lane) — the coordinator (stage −1) passes NCCL_SPLIT_NOCOLOR. Every communicator is
 * non-blocking (config.blocking = 0): each wait polls ncclCommGetAsyncError and the stream with
 * the comm's backoff sleep, listens for fault reports, and on the deadline notes the fault
 * naming the EP group and calls ncclCommAbort, so a dead peer never hangs a rank. The work a
 * step queues on the device (the device-routed MoE exchange, ep_alltoallv_dev_async, and the
 * stage hand-off, p2p_dev) is not waited for: only the enqueue is polled on the communicator,
 * and a watcher thread (nccl_watch) times an event recorded after it, aborting every rank with
 * a message naming this one on the timeout (issue 45: no host sync inside a step).
 * Buffers: the comm_moe.c protocol hands this transport host buffers (device_buffers = false),
 * so they are staged through pinned host and device buffers here (grow-only). Counts: int32 words
 * (ncclInt32) for ep_alltoall, 4-byte words (ncclUint32) for ep_alltoallv. */
#ifdef K3_HAVE_NCCL

#include "k3_comm.h"
#include "comm_internal.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

k3_status k3_comm_nccl_create(const k3_comm_params *p, k3_comm **out);

/* The watcher (issue 45): NCCL work queued with no wait (the device-routed MoE exchange, the
 * stage hand-off) is watched by this host thread on an event recorded after it, so the step's
 * thread never polls the stream. Each arm re-records the event and restarts the clock (a healthy
 * step keeps arming it); the thread queries the event every 2 ms while armed, and when it has not
 * completed within the comm's timeout it logs an error naming this rank, its EP group and the
 * work, and aborts every rank (a hung NCCL kernel never returns to the step's thread). */
typedef struct nccl_watch {
    pthread_t th;
    bool started, stop, armed;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    cudaEvent_t ev;
    uint64_t gen; /* arms so far: a query's answer counts only for the arm it followed */
    double t0;
    char what[64];
} nccl_watch;

typedef struct nccl_state {
    k3_comm_iface iface;      /* first: c->iface points here */
    const k3_comm_iface *mpi; /* the MPI transport's table (everything not overridden) */
    ncclComm_t world, ep;     /* ep: NULL on the coordinator */
    cudaStream_t stream;
    int device;
    void *hs, *hr, *ds, *dr; /* pinned host / device staging, send and receive */
    size_t cap_s, cap_r;     /* bytes of each pair */
    nccl_watch watch;
    k3_comm *c;
} nccl_state;

static nccl_state *N(k3_comm *c) {
    return (nccl_state *)(uintptr_t)c->iface;
}

#define NCCL_TRY(call)                                                                             \
    do {                                                                                           \
        ncclResult_t r_ = (call);                                                                  \
        if (r_ != ncclSuccess && r_ != ncclInProgress)                                             \
            return K3_ERR(K3_ERR_COMM, "%s: %s", #call, ncclGetErrorString(r_));                   \
    } while (0)
/* NCCL_TRY inside ncclGroupStart/End: a failed call ends the group before returning */
#define NCCL_GROUP_TRY(call)                                                                       \
    do {                                                                                           \
        ncclResult_t r_ = (call);                                                                  \
        if (r_ != ncclSuccess && r_ != ncclInProgress) {                                           \
            (void)ncclGroupEnd();                                                                  \
            return K3_ERR(K3_ERR_COMM, "%s: %s", #call, ncclGetErrorString(r_));                   \
        }                                                                                          \
    } while (0)
#define CUDA_TRY(call)                                                                             \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return K3_ERR(K3_ERR_DEVICE, "%s: %s", #call, cudaGetErrorString(e_));                 \
    } while (0)

/* Wait until comm has no pending operation (and, with a stream, the stream has drained); on the
 * deadline note the fault, abort the communicator and fail naming `what`. */
static k3_status nccl_wait(k3_comm *c, ncclComm_t *comm, cudaStream_t stream, const char *what) {
    const bool with_stream = stream != NULL;
    if (with_stream) __atomic_fetch_add(&c->stats.host_syncs, 1, __ATOMIC_RELAXED);
    const double t0 = k3_now_s();
    int backoff = 0;
    for (;;) {
        ncclResult_t a = ncclSuccess;
        if (*comm) NCCL_TRY(ncclCommGetAsyncError(*comm, &a));
        if (a != ncclSuccess && a != ncclInProgress)
            return K3_ERR(K3_ERR_COMM, "nccl: %s failed: %s", what, ncclGetErrorString(a));
        if (a == ncclSuccess) {
            cudaError_t q = with_stream ? cudaStreamQuery(stream) : cudaSuccess;
            if (q == cudaSuccess) return K3_OK;
            if (q != cudaErrorNotReady)
                return K3_ERR(K3_ERR_DEVICE, "nccl: %s: %s", what, cudaGetErrorString(q));
        }
        const double waited = k3_now_s() - t0;
        if (waited > c->timeout_s) {
            char g[128];
            comm_group_name(c, g, sizeof g);
            comm_note_wait(c, COMM_PEER_GROUP, what, waited);
            if (*comm) ncclCommAbort(*comm);
            *comm = NULL;
            return K3_ERR(K3_ERR_COMM, "nccl: %s in %s did not complete within %.0f s (aborted)",
                          what, g, c->timeout_s);
        }
        if (comm_fault_arrived(c)) return comm_fault_error(c, what);
        comm_sleep(c, &backoff);
    }
}

static void *watch_main(void *arg) {
    nccl_state *st = arg;
    nccl_watch *w = &st->watch;
    cudaSetDevice(st->device);
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        if (!w->armed) {
            pthread_cond_wait(&w->cv, &w->mu);
            continue;
        }
        const uint64_t gen = w->gen;
        pthread_mutex_unlock(&w->mu);
        const cudaError_t q = cudaEventQuery(w->ev);
        pthread_mutex_lock(&w->mu);
        if (gen != w->gen) continue; /* re-armed meanwhile: ask again */
        if (q == cudaSuccess) {
            w->armed = false;
            continue;
        }
        const double waited = k3_now_s() - w->t0;
        if (q != cudaErrorNotReady || waited > st->c->timeout_s) {
            char g[128], who[64];
            comm_group_name(st->c, g, sizeof g);
            comm_describe(st->c, st->c->rank, who, sizeof who);
            K3_LOGE("nccl watcher: %s in %s on %s %s (%.0f s, timeout %.0f s): aborting every rank",
                    w->what, g, who,
                    q != cudaErrorNotReady ? cudaGetErrorString(q) : "did not complete", waited,
                    st->c->timeout_s);
            pthread_mutex_unlock(&w->mu);
            k3_comm_world_abort(1);
            return NULL;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 2000000;
        if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

static k3_status watch_start(nccl_state *st) {
    nccl_watch *w = &st->watch;
    CUDA_TRY(cudaEventCreateWithFlags(&w->ev, cudaEventDisableTiming));
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    if (pthread_create(&w->th, NULL, watch_main, st) != 0)
        return K3_ERR(K3_ERR_COMM, "nccl: cannot start the watcher thread");
    w->started = true;
    return K3_OK;
}

static void watch_stop(nccl_state *st) {
    nccl_watch *w = &st->watch;
    if (w->started) {
        pthread_mutex_lock(&w->mu);
        w->stop = true;
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->th, NULL);
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
        w->started = false;
    }
    if (w->ev) cudaEventDestroy(w->ev);
    w->ev = NULL;
}

/* Arm the watcher on the work queued so far in stream s (no host sync). A stream in capture
 * records nothing real: the caller arms after the graph's launch instead. */
static k3_status watch_arm(nccl_state *st, cudaStream_t s, const char *what) {
    nccl_watch *w = &st->watch;
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (!w->started || cudaStreamIsCapturing(s, &cs) != cudaSuccess ||
        cs != cudaStreamCaptureStatusNone)
        return K3_OK;
    pthread_mutex_lock(&w->mu);
    const cudaError_t e = cudaEventRecord(w->ev, s);
    w->gen++;
    w->armed = e == cudaSuccess;
    w->t0 = k3_now_s();
    snprintf(w->what, sizeof w->what, "%s", what);
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    CUDA_TRY(e);
    return K3_OK;
}

/* After a group that queued work with no wait: the enqueue itself must finish (non-blocking
 * communicators may return ncclInProgress from the group end), polled host side on the
 * communicator only, never on the stream (no host sync); then the watcher takes the rest. */
static k3_status enqueue_done(k3_comm *c, ncclComm_t *comm, cudaStream_t s, const char *what) {
    const double t0 = k3_now_s();
    int backoff = 0;
    for (;;) {
        ncclResult_t a = ncclSuccess;
        if (*comm) NCCL_TRY(ncclCommGetAsyncError(*comm, &a));
        if (a == ncclSuccess) return watch_arm(N(c), s, what);
        if (a != ncclInProgress)
            return K3_ERR(K3_ERR_COMM, "nccl: %s failed: %s", what, ncclGetErrorString(a));
        const double waited = k3_now_s() - t0;
        if (waited > c->timeout_s) {
            char g[128];
            comm_group_name(c, g, sizeof g);
            comm_note_wait(c, COMM_PEER_GROUP, what, waited);
            if (*comm) ncclCommAbort(*comm);
            *comm = NULL;
            return K3_ERR(K3_ERR_COMM, "nccl: %s in %s did not complete within %.0f s (aborted)",
                          what, g, c->timeout_s);
        }
        if (comm_fault_arrived(c)) return comm_fault_error(c, what);
        comm_sleep(c, &backoff);
    }
}

/* Grow one pinned + device staging pair to >= n bytes. */
static k3_status stage_grow(void **h, void **d, size_t *cap, size_t n) {
    if (n <= *cap) return K3_OK;
    size_t want = *cap ? *cap : 4096;
    while (want < n) want *= 2;
    cudaFreeHost(*h);
    cudaFree(*d);
    *h = *d = NULL;
    *cap = 0;
    CUDA_TRY(cudaMallocHost(h, want));
    CUDA_TRY(cudaMalloc(d, want));
    *cap = want;
    return K3_OK;
}

/* The grouped exchange: to lane e send scount[e] elements at sdispl[e], from lane e receive
 * rcount[e] at rdispl[e] (elements of 4 bytes, type dt), through the staging buffers. */
static k3_status exchange(k3_comm *c, const void *send, const int64_t *scount,
                          const int64_t *sdispl, void *recv, const int64_t *rcount,
                          const int64_t *rdispl, ncclDataType_t dt, const char *what) {
    nccl_state *st = N(c);
    if (!st->ep) return K3_ERR(K3_ERR_STATE, "nccl: %s: this rank has no EP group", what);
    const int E = c->n_lanes;
    int64_t ns = 0, nr = 0; /* elements spanned */
    for (int e = 0; e < E; e++) {
        ns = scount[e] && sdispl[e] + scount[e] > ns ? sdispl[e] + scount[e] : ns;
        nr = rcount[e] && rdispl[e] + rcount[e] > nr ? rdispl[e] + rcount[e] : nr;
    }
    K3_TRY(stage_grow(&st->hs, &st->ds, &st->cap_s, (size_t)ns * 4));
    K3_TRY(stage_grow(&st->hr, &st->dr, &st->cap_r, (size_t)nr * 4));
    if (ns) {
        memcpy(st->hs, send, (size_t)ns * 4);
        CUDA_TRY(
            cudaMemcpyAsync(st->ds, st->hs, (size_t)ns * 4, cudaMemcpyHostToDevice, st->stream));
    }
    NCCL_TRY(ncclGroupStart());
    for (int e = 0; e < E; e++) { /* counts in elements of dt (4 bytes) */
        if (scount[e])
            NCCL_GROUP_TRY(ncclSend((const char *)st->ds + sdispl[e] * 4, (size_t)scount[e], dt, e,
                                    st->ep, st->stream));
        if (rcount[e])
            NCCL_GROUP_TRY(ncclRecv((char *)st->dr + rdispl[e] * 4, (size_t)rcount[e], dt, e,
                                    st->ep, st->stream));
    }
    NCCL_TRY(ncclGroupEnd());
    if (nr)
        CUDA_TRY(
            cudaMemcpyAsync(st->hr, st->dr, (size_t)nr * 4, cudaMemcpyDeviceToHost, st->stream));
    K3_TRY(nccl_wait(c, &st->ep, st->stream, what));
    if (nr) memcpy(recv, st->hr, (size_t)nr * 4);
    return K3_OK;
}

static k3_status nccl_ep_alltoall(k3_comm *c, const int32_t *send, int32_t *recv, int k,
                                  const char *what) {
    const int E = c->n_lanes;
    int64_t cnt[1024], dsp[1024];
    if (E > 1024) return K3_ERR(K3_ERR_ARG, "nccl: %d lanes (at most 1024)", E);
    for (int e = 0; e < E; e++) cnt[e] = k, dsp[e] = (int64_t)e * k;
    return exchange(c, send, cnt, dsp, recv, cnt, dsp, ncclInt32, what);
}

static k3_status nccl_ep_alltoallv(k3_comm *c, const void *send, const int64_t *scount,
                                   const int64_t *sdispl, void *recv, const int64_t *rcount,
                                   const int64_t *rdispl, const char *what) {
    return exchange(c, send, scount, sdispl, recv, rcount, rdispl, ncclUint32, what);
}

/* The stream a device transfer on be's buffers goes in: the backend's own (ordered after the
 * kernels that wrote them), else ours after a full backend sync. */
static k3_status dev_stream(k3_comm *c, k3_backend *be, cudaStream_t *s) {
    *s = (cudaStream_t)k3_backend_native_stream(be);
    if (*s) return K3_OK;
    K3_TRY(k3_backend_sync(be));
    *s = N(c)->stream;
    return K3_OK;
}

/* ep_alltoallv on backend buffers: no staging (counts in 4-byte words, sent as ncclUint32).
 * wait: polled to completion here (nccl_wait); else only enqueued (the device-routed exchange:
 * fixed sizes, its buffers used next in the same stream only), and the watcher times it. */
static k3_status ep_alltoallv_dev(k3_comm *c, k3_backend *be, const void *send,
                                  const int64_t *scount, const int64_t *sdispl, void *recv,
                                  const int64_t *rcount, const int64_t *rdispl, const char *what,
                                  bool wait) {
    nccl_state *st = N(c);
    if (!st->ep) return K3_ERR(K3_ERR_STATE, "nccl: %s: this rank has no EP group", what);
    cudaStream_t s;
    K3_TRY(dev_stream(c, be, &s));
    NCCL_TRY(ncclGroupStart());
    for (int e = 0; e < c->n_lanes; e++) {
        if (scount[e])
            NCCL_GROUP_TRY(ncclSend((const char *)send + sdispl[e] * 4, (size_t)scount[e],
                                    ncclUint32, e, st->ep, s));
        if (rcount[e])
            NCCL_GROUP_TRY(ncclRecv((char *)recv + rdispl[e] * 4, (size_t)rcount[e], ncclUint32, e,
                                    st->ep, s));
    }
    NCCL_TRY(ncclGroupEnd());
    return wait ? nccl_wait(c, &st->ep, s, what) : enqueue_done(c, &st->ep, s, what);
}
static k3_status nccl_ep_alltoallv_dev(k3_comm *c, k3_backend *be, const void *send,
                                       const int64_t *scount, const int64_t *sdispl, void *recv,
                                       const int64_t *rcount, const int64_t *rdispl,
                                       const char *what) {
    return ep_alltoallv_dev(c, be, send, scount, sdispl, recv, rcount, rdispl, what, true);
}
static k3_status nccl_ep_alltoallv_dev_async(k3_comm *c, k3_backend *be, const void *send,
                                             const int64_t *scount, const int64_t *sdispl,
                                             void *recv, const int64_t *rcount,
                                             const int64_t *rdispl, const char *what) {
    return ep_alltoallv_dev(c, be, send, scount, sdispl, recv, rcount, rdispl, what, false);
}

/* The stage hand-off: n_bytes of backend memory to / from world rank peer. */
static k3_status nccl_p2p_dev(k3_comm *c, k3_backend *be, int peer, bool send, void *buf,
                              size_t n_bytes, const char *what) {
    nccl_state *st = N(c);
    if (n_bytes == 0) return K3_OK;
    if (n_bytes % 4)
        return K3_ERR(K3_ERR_ARG, "nccl: %s: %zu bytes is not a whole number of words", what,
                      n_bytes);
    cudaStream_t s;
    K3_TRY(dev_stream(c, be, &s));
    NCCL_TRY(ncclGroupStart());
    if (send)
        NCCL_GROUP_TRY(ncclSend(buf, n_bytes / 4, ncclUint32, peer, st->world, s));
    else
        NCCL_GROUP_TRY(ncclRecv(buf, n_bytes / 4, ncclUint32, peer, st->world, s));
    NCCL_TRY(ncclGroupEnd());
    /* stream-ordered on both sides (the receiver's kernels follow in s, the sender's next writes
       of buf too): no wait, the watcher times it */
    return enqueue_done(c, &st->world, s, what);
}

static void nccl_release(nccl_state *st, bool abort) {
    watch_stop(st);
    if (st->ep) abort ? ncclCommAbort(st->ep) : ncclCommDestroy(st->ep);
    if (st->world) abort ? ncclCommAbort(st->world) : ncclCommDestroy(st->world);
    st->ep = st->world = NULL;
    if (st->stream) cudaStreamDestroy(st->stream);
    st->stream = NULL;
    cudaFreeHost(st->hs), cudaFreeHost(st->hr), cudaFree(st->ds), cudaFree(st->dr);
    st->hs = st->hr = st->ds = st->dr = NULL;
}

/* Free the NCCL state (abort: communicators that may be mid-operation or failed), then the MPI
 * transport under it. */
static void teardown(k3_comm *c, bool abort) {
    nccl_state *st = N(c);
    nccl_release(st, abort);
    c->iface = st->mpi;
    free(st);
    c->iface->destroy(c);
}
static void nccl_destroy(k3_comm *c) {
    teardown(c, false);
}

static void nccl_abort(k3_comm *c, int code) {
    if (c) {
        nccl_state *st = N(c);
        nccl_release(st, true);
        c->iface = st->mpi; /* st is left to the exit */
    }
    if (c) c->iface->abort(c, code);
}

static k3_status nccl_init(k3_comm *c, nccl_state *st) {
    int n_dev = 0;
    CUDA_TRY(cudaGetDeviceCount(&n_dev));
    st->device = k3_local_rank() % n_dev;
    CUDA_TRY(cudaSetDevice(st->device));
    CUDA_TRY(cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking));
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (c->rank == 0) NCCL_TRY(ncclGetUniqueId(&id));
    K3_TRY(c->iface->bcast(c, 0, &id, sizeof id)); /* MPI_Bcast over the world, bytes */
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    NCCL_TRY(ncclCommInitRankConfig(&st->world, c->size, id, c->rank, &cfg));
    K3_TRY(nccl_wait(c, &st->world, NULL, "NCCL world communicator set-up"));
    ncclConfig_t cfg2 = NCCL_CONFIG_INITIALIZER;
    cfg2.blocking = 0;
    NCCL_TRY(ncclCommSplit(st->world, c->stage >= 0 ? c->stage : NCCL_SPLIT_NOCOLOR,
                           c->lane >= 0 ? c->lane : 0, &st->ep, &cfg2));
    K3_TRY(nccl_wait(c, st->ep ? &st->ep : &st->world, NULL, "NCCL EP group split"));
    st->c = c;
    return watch_start(st);
}

k3_status k3_comm_nccl_create(const k3_comm_params *p, k3_comm **out) {
    K3_TRY(k3_comm_mpi_create(p, out));
    k3_comm *c = *out;
    nccl_state *st = calloc(1, sizeof *st);
    if (!st) {
        c->iface->destroy(c);
        *out = NULL;
        return K3_ERR(K3_ERR_NOMEM, "nccl transport state");
    }
    st->mpi = c->iface;
    st->iface = *c->iface;
    st->iface.name = "nccl";
    st->iface.destroy = nccl_destroy;
    st->iface.abort = nccl_abort;
    st->iface.ep_alltoall = nccl_ep_alltoall;
    st->iface.ep_alltoallv = nccl_ep_alltoallv;
    st->iface.ep_alltoallv_dev = nccl_ep_alltoallv_dev;
    st->iface.ep_alltoallv_dev_async = nccl_ep_alltoallv_dev_async;
    st->iface.p2p_dev = nccl_p2p_dev;
    st->iface.device_buffers = true;
    c->iface = &st->iface;
    k3_status s = nccl_init(c, st);
    if (s != K3_OK) {
        teardown(c, true);
        *out = NULL;
    }
    return s;
}

#else
typedef int k3_comm_nccl_unused; /* an empty translation unit is not ISO C */
#endif /* K3_HAVE_NCCL */
