/* nccl_emu.c — the NCCL stand-in (nccl.h) over MPI on host buffers: the emulation build links it
 * instead of libnccl, so comm/comm_nccl.c runs under mpirun in CI. Owns nothing of k3's: it knows
 * MPI and the NCCL API only.
 *
 * Communicators: init = MPI_Comm_idup(MPI_COMM_WORLD) (nranks and rank must be MPI's), then an
 * MPI_Iallreduce checks that every rank got the same unique id; split = an MPI_Iallgather of
 * (color, key), so every rank is known to have arrived, then MPI_Comm_split (NOCOLOR:
 * MPI_UNDEFINED, *newcomm = NULL). Both wait at most the deadline, so a rank that never comes is an
 * error (ncclRemoteError), not a hang. Groups: ncclSend/ncclRecv are collected (outside a group
 * each call is its own group); at the outermost ncclGroupEnd the receives, then the sends, are
 * posted as MPI_Irecv/MPI_Isend of bytes (tag TAG, 1 GiB pieces; MPI's non-overtaking order matches
 * them as NCCL matches its p2p), and ncclGroupEnd polls MPI_Testall with short sleeps until all are
 * complete. It must not return earlier: the emulated stream runs the caller's next operation
 * (comm_nccl.c's device-to-host copy of the received rows) at once, so "enqueued after the group"
 * must mean "after the data". The deadline (K3_NCCL_EMU_TIMEOUT_S, default 120 s): a blocking
 * communicator cancels what is pending, is marked failed (ncclRemoteError, sticky) and ncclGroupEnd
 * returns that error. A non-blocking one (config.blocking = 0, as comm_nccl.c makes them) returns
 * ncclInProgress with the operations still pending, as NCCL's non-blocking mode does:
 * ncclCommGetAsyncError says ncclInProgress while they are, so the caller's own timeout decides and
 * names what hung (then ncclCommAbort); if they complete after all, the caller's stream has already
 * read the buffers, so that is a sticky ncclSystemError, never silent stale data. Device buffers
 * live in the emulator's own address range, closed to the host outside device work: a group end
 * first waits for every stream (their operations before it are its inputs) and holds the device
 * with the range open while MPI moves the bytes (k3emu_device_open / _close), as do the calls
 * that test or cancel what a late group left pending. Test hook:
 * K3_NCCL_EMU_TEST_DROP_SENDS=R — world rank R's communicators created while it is set post no
 * sends (their peers' receives then never complete); one line on stderr says so.
 * Stream capture (CUDA graphs, kernels/cuda/emu/emu_graph.cpp): a group whose operations are on a
 * capturing stream (one stream per group) is not run at its end but recorded as a host-work node
 * of the capture, with a copy of its operation list; each launch of the graph runs it as a group
 * (its errors then are the communicators' sticky state), as NCCL's kernels run at each launch of
 * a captured graph. */
#include "nccl.h"

#include <mpi.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TAG             0x6b33                       /* "k3"; <= 32767, the least MPI_TAG_UB */
#define PIECE_BYTES     ((size_t)1 << 30)            /* one MPI message at most (counts are int) */
#define DEFAULT_TIMEOUT 120.0                        /* s: K3_NCCL_EMU_TIMEOUT_S unset or invalid */
static const char k_id_magic[16] = "k3-nccl-emu-id"; /* the unique id's first bytes */

struct k3nccl_comm {
    MPI_Comm mpi; /* our own communicator (a dup or a split): p2p on it cannot meet k3's */
    int rank, size;
    int blocking;       /* config.blocking (1 unless 0 was asked) */
    double timeout_s;   /* K3_NCCL_EMU_TIMEOUT_S at creation */
    bool drop_sends;    /* the test hook */
    ncclResult_t state; /* sticky: ncclSuccess, ncclInProgress (late ops pending) or the error */
    bool late;          /* a group end returned at the deadline with req[] still pending */
    bool in_group;      /* scratch of run_group */
    MPI_Request *req;   /* [n_req] posted, not yet complete */
    bool *is_recv;      /* [n_req] */
    int n_req, cap_req;
};

typedef struct op {
    bool recv;
    ncclComm_t comm;
    void *buf;
    size_t n_bytes;
    int peer;
    cudaStream_t stream;
} op;

/* The calling thread's group (NCCL's group state is per thread too). */
static _Thread_local struct {
    int depth;
    op *ops;
    int n, cap;
    ncclResult_t err; /* the first error of a call inside the group: the group end returns it */
} g_group;

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess:
        return "no error";
    case ncclUnhandledCudaError:
        return "CUDA call failed";
    case ncclSystemError:
        return "system error (NCCL stand-in: an MPI call failed, or a peer's data arrived after "
               "the deadline K3_NCCL_EMU_TIMEOUT_S, when the stream had already used the buffer)";
    case ncclInternalError:
        return "internal error";
    case ncclInvalidArgument:
        return "invalid argument";
    case ncclInvalidUsage:
        return "invalid usage";
    case ncclRemoteError:
        return "remote error (NCCL stand-in: a peer did not take part within "
               "K3_NCCL_EMU_TIMEOUT_S)";
    case ncclInProgress:
        return "operation in progress";
    default:
        return "unknown result";
    }
}

/* ---- helpers ------------------------------------------------------------------------------ */
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double env_timeout(void) {
    const char *s = getenv("K3_NCCL_EMU_TIMEOUT_S");
    char *end = NULL;
    double t = s ? strtod(s, &end) : 0;
    return s && end != s && *end == '\0' && t > 0 ? t : DEFAULT_TIMEOUT;
}

static void nap(int *us) {
    struct timespec ts = {0, (long)*us * 1000L};
    nanosleep(&ts, NULL);
    *us = *us * 2 > 1000 ? 1000 : *us * 2;
}

/* Poll n requests until all are complete (*done) or the deadline. Returns an MPI error code. */
static int test_until(MPI_Request *r, int n, double deadline, bool *done) {
    int us = 5;
    for (;;) {
        int flag = 0;
        int rc = MPI_Testall(n, r, &flag, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) return rc;
        *done = flag != 0;
        if (*done || now_s() > deadline) return MPI_SUCCESS;
        nap(&us);
    }
}

static size_t type_bytes(ncclDataType_t t) {
    switch (t) {
    case ncclInt8:
    case ncclUint8:
        return 1;
    case ncclFloat16:
    case ncclBfloat16:
        return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
        return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
        return 8;
    default:
        return 0;
    }
}

static ncclResult_t config_blocking(const ncclConfig_t *cfg, int dflt, int *blocking) {
    *blocking = dflt;
    if (!cfg) return ncclSuccess;
    if (cfg->size != sizeof(ncclConfig_t) || cfg->magic != K3_NCCL_EMU_CONFIG_MAGIC)
        return ncclInvalidArgument; /* not made with NCCL_CONFIG_INITIALIZER */
    if (cfg->blocking == NCCL_CONFIG_UNDEF_INT) return ncclSuccess;
    if (cfg->blocking != 0 && cfg->blocking != 1) return ncclInvalidArgument;
    *blocking = cfg->blocking;
    return ncclSuccess;
}

static ncclResult_t comm_new(MPI_Comm mpi, int blocking, ncclComm_t *out) {
    ncclComm_t c = calloc(1, sizeof *c);
    if (!c) return ncclSystemError;
    MPI_Comm_set_errhandler(mpi, MPI_ERRORS_RETURN);
    c->mpi = mpi;
    MPI_Comm_rank(mpi, &c->rank);
    MPI_Comm_size(mpi, &c->size);
    c->blocking = blocking;
    c->timeout_s = env_timeout();
    c->state = ncclSuccess;
    const char *drop = getenv("K3_NCCL_EMU_TEST_DROP_SENDS");
    int wr = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    if (drop && *drop && atoi(drop) == wr) {
        c->drop_sends = true;
        fprintf(stderr,
                "nccl stand-in: test hook K3_NCCL_EMU_TEST_DROP_SENDS: world rank %d posts "
                "no sends on this communicator\n",
                wr);
    }
    *out = c;
    return ncclSuccess;
}

/* Cancel and free every pending request (never blocks). */
static void drop_pending(ncclComm_t c) {
    k3emu_device_open(); /* MPI may still touch the device buffers of what it cancels */
    for (int i = 0; i < c->n_req; i++)
        if (c->req[i] != MPI_REQUEST_NULL) {
            MPI_Cancel(&c->req[i]);
            MPI_Request_free(&c->req[i]);
        }
    c->n_req = 0;
    c->late = false;
    k3emu_device_close();
}

/* Complete what a late group left pending, if it has completed by now. */
static void progress(ncclComm_t c) {
    if (c->n_req == 0) return;
    int flag = 0;
    k3emu_device_open(); /* MPI writes into device buffers */
    const int rc = MPI_Testall(c->n_req, c->req, &flag, MPI_STATUSES_IGNORE);
    k3emu_device_close();
    if (rc != MPI_SUCCESS) {
        drop_pending(c);
        c->state = ncclSystemError;
        return;
    }
    if (!flag) return;
    c->n_req = 0;
    if (c->late) c->state = ncclSystemError; /* the stream went on before the data was there */
    c->late = false;
}

static ncclResult_t add_req(ncclComm_t c, MPI_Request r, bool recv) {
    if (c->n_req == c->cap_req) {
        int cap = c->cap_req ? 2 * c->cap_req : 16;
        MPI_Request *q = realloc(c->req, (size_t)cap * sizeof *q);
        if (q) c->req = q;
        bool *b = realloc(c->is_recv, (size_t)cap * sizeof *b);
        if (b) c->is_recv = b;
        if (!q || !b) return ncclSystemError;
        c->cap_req = cap;
    }
    c->req[c->n_req] = r;
    c->is_recv[c->n_req++] = recv;
    return ncclSuccess;
}

/* ---- communicators ------------------------------------------------------------------------ */
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (!id) return ncclInvalidArgument;
    memset(id, 0, sizeof *id);
    memcpy(id->internal, k_id_magic, sizeof k_id_magic);
    uint64_t nonce = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    if (!f || fread(&nonce, sizeof nonce, 1, f) != 1)
        nonce = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15u ^ (uint64_t)getpid();
    if (f) fclose(f);
    memcpy(id->internal + sizeof k_id_magic, &nonce, sizeof nonce);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config) {
    if (!comm) return ncclInvalidArgument;
    *comm = NULL;
    int blocking = 1;
    ncclResult_t r = config_blocking(config, 1, &blocking);
    if (r != ncclSuccess) return r;
    if (memcmp(id.internal, k_id_magic, sizeof k_id_magic) != 0) return ncclInvalidArgument;
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (!inited || finalized) return ncclInvalidUsage; /* the stand-in bootstraps over MPI */
    int wsize = 0, wrank = -1;
    MPI_Comm_size(MPI_COMM_WORLD, &wsize);
    MPI_Comm_rank(MPI_COMM_WORLD, &wrank);
    if (nranks != wsize || rank != wrank) return ncclInvalidArgument;
    const double deadline = now_s() + env_timeout();
    MPI_Comm dup = MPI_COMM_NULL;
    MPI_Request rq = MPI_REQUEST_NULL;
    bool done = false;
    if (MPI_Comm_idup(MPI_COMM_WORLD, &dup, &rq) != MPI_SUCCESS ||
        test_until(&rq, 1, deadline, &done) != MPI_SUCCESS)
        return ncclSystemError;
    if (!done) return ncclRemoteError; /* a rank never came (the pending idup is left) */
    MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
    /* every rank must hold the same id: max(nonce) and max(~nonce) agree with its own */
    uint64_t nonce, v[2], m[2] = {0, 0};
    memcpy(&nonce, id.internal + sizeof k_id_magic, sizeof nonce);
    v[0] = nonce, v[1] = ~nonce;
    if (MPI_Iallreduce(v, m, 2, MPI_UINT64_T, MPI_MAX, dup, &rq) != MPI_SUCCESS ||
        test_until(&rq, 1, deadline, &done) != MPI_SUCCESS)
        return ncclSystemError;
    if (!done) return ncclRemoteError;
    if (m[0] != v[0] || m[1] != v[1]) {
        MPI_Comm_free(&dup);
        return ncclInvalidArgument; /* ranks were given different unique ids */
    }
    r = comm_new(dup, blocking, comm);
    if (r != ncclSuccess) MPI_Comm_free(&dup);
    return r;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config) {
    if (!newcomm) return ncclInvalidArgument;
    *newcomm = NULL;
    if (!comm || (color < 0 && color != NCCL_SPLIT_NOCOLOR)) return ncclInvalidArgument;
    int blocking = comm->blocking;
    ncclResult_t r = config_blocking(config, comm->blocking, &blocking);
    if (r != ncclSuccess) return r;
    progress(comm);
    if (comm->state != ncclSuccess)
        return comm->state == ncclInProgress ? ncclInvalidUsage : comm->state;
    /* everyone arrives first (bounded), so the blocking MPI_Comm_split cannot wait for a rank
       that never comes */
    int mine[2] = {color, key};
    int *all = malloc((size_t)comm->size * 2 * sizeof *all);
    if (!all) return ncclSystemError;
    MPI_Request rq = MPI_REQUEST_NULL;
    bool done = false;
    if (MPI_Iallgather(mine, 2, MPI_INT, all, 2, MPI_INT, comm->mpi, &rq) != MPI_SUCCESS ||
        test_until(&rq, 1, now_s() + comm->timeout_s, &done) != MPI_SUCCESS) {
        comm->state = ncclSystemError;
        free(all);
        return ncclSystemError;
    }
    if (!done) { /* the collective stays pending on comm: it is broken (all stays allocated) */
        comm->state = ncclRemoteError;
        return ncclRemoteError;
    }
    int n_new = 0;
    for (int i = 0; i < comm->size; i++)
        n_new += color != NCCL_SPLIT_NOCOLOR && all[2 * i] == color;
    free(all);
    MPI_Comm nm = MPI_COMM_NULL;
    if (MPI_Comm_split(comm->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &nm) !=
        MPI_SUCCESS) {
        comm->state = ncclSystemError;
        return ncclSystemError;
    }
    if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
    int n = 0;
    MPI_Comm_size(nm, &n);
    if (n != n_new) {
        MPI_Comm_free(&nm);
        return ncclInternalError;
    }
    r = comm_new(nm, blocking, newcomm);
    if (r != ncclSuccess) MPI_Comm_free(&nm);
    return r;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    if (!comm || !asyncError) return ncclInvalidArgument;
    progress(comm);
    *asyncError = comm->state;
    return ncclSuccess;
}

/* Remove comm's operations from this thread's open group (it is going away). */
static void forget_ops(ncclComm_t comm) {
    int k = 0;
    for (int i = 0; i < g_group.n; i++)
        if (g_group.ops[i].comm != comm) g_group.ops[k++] = g_group.ops[i];
    g_group.n = k;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    drop_pending(comm);
    forget_ops(comm);
    /* the MPI communicator is dropped, not freed: MPI_Comm_free is collective, and an abort
       happens exactly when a peer may never come */
    free(comm->req);
    free(comm->is_recv);
    free(comm);
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    progress(comm);
    if (comm->n_req || comm->state != ncclSuccess) return ncclCommAbort(comm);
    forget_ops(comm);
    MPI_Comm_free(&comm->mpi);
    free(comm->req);
    free(comm->is_recv);
    free(comm);
    return ncclSuccess;
}

/* ---- groups and point-to-point ------------------------------------------------------------ */
/* Post the group's receives, then its sends, and wait (see the file comment). */
static ncclResult_t run_group(void) {
    ncclComm_t cs[64];
    int n_cs = 0;
    ncclResult_t r = ncclSuccess;
    for (int i = 0; i < g_group.n; i++) { /* the communicators involved, each ready */
        ncclComm_t c = g_group.ops[i].comm;
        if (c->in_group) continue;
        if (n_cs == (int)(sizeof cs / sizeof cs[0])) {
            r = ncclInvalidUsage; /* more communicators in one group than k3 could use */
            break;
        }
        c->in_group = true;
        cs[n_cs++] = c;
        progress(c);
        if (c->state != ncclSuccess) {
            r = c->state == ncclInProgress ? ncclInvalidUsage : c->state;
            break;
        }
    }
    const bool posting = r == ncclSuccess; /* every comm ready, none with requests pending */
    for (int pass = 0; pass < 2 && r == ncclSuccess; pass++) /* receives first, then sends */
        for (int i = 0; i < g_group.n && r == ncclSuccess; i++) {
            const op *o = &g_group.ops[i];
            if (o->recv != (pass == 0) || (!o->recv && o->comm->drop_sends)) continue;
            for (size_t at = 0; at < o->n_bytes && r == ncclSuccess; at += PIECE_BYTES) {
                size_t n = o->n_bytes - at < PIECE_BYTES ? o->n_bytes - at : PIECE_BYTES;
                MPI_Request q = MPI_REQUEST_NULL;
                int rc = o->recv ? MPI_Irecv((char *)o->buf + at, (int)n, MPI_BYTE, o->peer, TAG,
                                             o->comm->mpi, &q)
                                 : MPI_Isend((char *)o->buf + at, (int)n, MPI_BYTE, o->peer, TAG,
                                             o->comm->mpi, &q);
                r = rc == MPI_SUCCESS ? add_req(o->comm, q, o->recv) : ncclSystemError;
                if (rc == MPI_SUCCESS && r != ncclSuccess) {
                    MPI_Cancel(&q);
                    MPI_Request_free(&q);
                }
            }
            if (r != ncclSuccess) o->comm->state = r;
        }
    /* wait for all, polling every communicator, until the earliest deadline */
    double deadline = now_s();
    double t = 0;
    for (int k = 0; k < n_cs; k++) t = k == 0 || cs[k]->timeout_s < t ? cs[k]->timeout_s : t;
    deadline += t;
    int us = 5;
    while (r == ncclSuccess) {
        bool all = true;
        for (int k = 0; k < n_cs && r == ncclSuccess; k++) {
            ncclComm_t c = cs[k];
            if (!c->n_req) continue;
            int flag = 0;
            if (MPI_Testall(c->n_req, c->req, &flag, MPI_STATUSES_IGNORE) != MPI_SUCCESS)
                r = c->state = ncclSystemError; /* e.g. a message longer than the receive */
            else if (flag)
                c->n_req = 0;
            all &= flag != 0;
        }
        if (r != ncclSuccess || all) break;
        if (now_s() > deadline) { /* see the file comment */
            for (int k = 0; k < n_cs; k++) {
                ncclComm_t c = cs[k];
                if (!c->n_req) continue;
                if (c->blocking) {
                    drop_pending(c);
                    c->state = ncclRemoteError;
                    r = ncclRemoteError;
                } else {
                    c->late = true;
                    c->state = ncclInProgress;
                }
            }
            if (r == ncclSuccess) r = ncclInProgress;
            break;
        }
        nap(&us);
    }
    if (posting && r != ncclSuccess && r != ncclInProgress) /* nothing of this group lingers */
        for (int k = 0; k < n_cs; k++)
            if (cs[k]->n_req) {
                drop_pending(cs[k]);
                if (cs[k]->state == ncclSuccess || cs[k]->state == ncclInProgress) cs[k]->state = r;
            }
    for (int k = 0; k < n_cs; k++) cs[k]->in_group = false;
    for (int i = 0; i < g_group.n; i++) g_group.ops[i].comm->in_group = false;
    return r;
}

ncclResult_t ncclGroupStart(void) {
    if (g_group.depth == 0) {
        g_group.n = 0;
        g_group.err = ncclSuccess;
    }
    g_group.depth++;
    return ncclSuccess;
}

/* A group recorded by a stream capture: its operations, run as a group at each graph launch. */
typedef struct captured_group {
    int n;
    op ops[];
} captured_group;

static void replay_group(void *p) {
    const captured_group *cg = p;
    const int depth = g_group.depth, n = g_group.n, cap = g_group.cap;
    op *ops = g_group.ops;
    const ncclResult_t err = g_group.err;
    g_group.ops = (op *)cg->ops, g_group.n = g_group.cap = cg->n;
    (void)run_group(); /* a failure is the communicators' sticky state (ncclCommGetAsyncError) */
    g_group.ops = ops, g_group.n = n, g_group.cap = cap, g_group.depth = depth, g_group.err = err;
}

/* The group's stream when it is in a capture (NULL when none is): every operation on that one
   stream, else ncclInvalidUsage (the stand-in records one stream per group). */
static ncclResult_t group_capture(cudaStream_t *s) {
    *s = NULL;
    for (int i = 0; i < g_group.n; i++) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(g_group.ops[i].stream, &cs) != cudaSuccess)
            return ncclUnhandledCudaError;
        if (cs != cudaStreamCaptureStatusNone) *s = g_group.ops[i].stream;
    }
    if (!*s) return ncclSuccess;
    for (int i = 0; i < g_group.n; i++)
        if (g_group.ops[i].stream != *s) {
            fprintf(stderr, "k3 nccl stand-in: a group in a stream capture mixes streams\n");
            return ncclInvalidUsage;
        }
    return ncclSuccess;
}

/* Record the group as one node of its stream's capture (k3emu_stream_host_work): the data moves
   at each launch of the graph, as NCCL's kernels do in a captured graph. */
static ncclResult_t capture_group(cudaStream_t s) {
    captured_group *cg = malloc(sizeof *cg + (size_t)g_group.n * sizeof(op));
    if (!cg) return ncclSystemError;
    cg->n = g_group.n;
    memcpy(cg->ops, g_group.ops, (size_t)g_group.n * sizeof(op));
    return k3emu_stream_host_work(s, replay_group, cg, free) == cudaSuccess
               ? ncclSuccess
               : ncclUnhandledCudaError;
}

ncclResult_t ncclGroupEnd(void) {
    if (g_group.depth <= 0) return ncclInvalidUsage;
    if (--g_group.depth > 0) return ncclSuccess;
    cudaStream_t cap = NULL;
    ncclResult_t r = g_group.err != ncclSuccess ? g_group.err : group_capture(&cap);
    if (r == ncclSuccess && cap) {
        r = capture_group(cap);
    } else if (r == ncclSuccess) { /* device work: after the streams' work, the range open */
        k3emu_device_open();
        r = run_group();
        k3emu_device_close();
    }
    g_group.n = 0;
    g_group.err = ncclSuccess;
    return r;
}

static ncclResult_t enqueue(bool recv, const void *buf, size_t count, ncclDataType_t dt, int peer,
                            ncclComm_t comm, cudaStream_t stream) {
    const size_t es = type_bytes(dt);
    ncclResult_t r = ncclSuccess;
    if (!comm || !es || peer < 0 || peer >= comm->size || (count && !buf) || count > SIZE_MAX / es)
        r = ncclInvalidArgument;
    else if (progress(comm), comm->state != ncclSuccess) /* in progress: wait for it first */
        r = comm->state == ncclInProgress ? ncclInvalidUsage : comm->state;
    if (r == ncclSuccess && count) { /* a zero count is no operation, on both sides alike */
        if (g_group.n == g_group.cap) {
            int cap = g_group.cap ? 2 * g_group.cap : 64;
            op *p = realloc(g_group.ops, (size_t)cap * sizeof *p);
            if (!p) r = ncclSystemError;
            if (p) g_group.ops = p, g_group.cap = cap;
        }
        if (r == ncclSuccess)
            g_group.ops[g_group.n++] = (op){.recv = recv,
                                            .comm = comm,
                                            .buf = (void *)(uintptr_t)buf,
                                            .n_bytes = count * es,
                                            .peer = peer,
                                            .stream = stream};
    }
    if (g_group.depth > 0) {
        if (r != ncclSuccess && g_group.err == ncclSuccess) g_group.err = r;
        return r;
    }
    if (r != ncclSuccess) { /* outside a group: nothing was queued for a later group */
        g_group.n = 0;
        return r;
    }
    g_group.depth = 1; /* its own group */
    return ncclGroupEnd();
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
    /* in a stream capture the group becomes a node of the graph (ncclGroupEnd) */
    return enqueue(false, sendbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
    return enqueue(true, recvbuff, count, datatype, peer, comm, stream);
}
