/* comm_bell.c — the node's doorbells: a rank that waits for a k3 message sleeps in the kernel
 * instead of polling, and the rank that posts the message wakes it.
 *
 * MPI has no wait that sleeps: a blocking receive polls (Open MPI spins, or sched_yields under
 * oversubscription), and so did k3's loops (sleeps of 10..500 us). An idle 2 x 2 `k3 serve` spent
 * ~10% of a core on it, and 4 ranks on 2 cores took cycles from the rank they waited for. So each
 * rank of a node has a 64-byte slot in a node-wide MPI shared-memory window: a sequence number,
 * bumped by every k3_comm_post to that rank from the same node, and a count of sleepers. A waiting
 * rank takes the sequence before it polls (comm_bell_seen), and if the poll finds nothing sleeps
 * on it with FUTEX_WAIT and a timeout (comm_bell_sleep): a post in between changes the number, so
 * no wake-up is lost (the kernel compares it before sleeping, and the poster wakes sleepers after
 * bumping it). Messages from other nodes do not ring: the timeout bounds how late they are seen,
 * and comm.c keeps it short while any peer is on another node. MPI-internal traffic (collectives,
 * rendezvous fragments) does not ring either: those waits keep polling (comm_sleep).
 *
 * Process-wide, like the vanished-peer window of comm_mpi.c: made at the first k3_comm_create
 * (collective over the world), freed by k3_comm_finalize; an MPI without shared windows leaves it
 * off (comm_bell_on() false) and waits poll as before. The slots are written only with atomics. */
#include <mpi.h> /* first: comm_internal.h declares its MPI helpers when MPI_VERSION is known */

#include "comm_internal.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct bell_slot {
    _Atomic uint32_t seq;      /* bumped by every post to this rank from its node */
    _Atomic uint32_t sleepers; /* > 0 while the rank is (about to be) in FUTEX_WAIT */
    char pad_[56];
} bell_slot;
_Static_assert(sizeof(bell_slot) == 64, "one cache line a rank: posters do not share a line");

static bell_slot *g_bells; /* [node size] the node's slots (NULL: off) */
static int *g_local_of;    /* [world] a rank's slot on this node, -1 on another node */
static int g_me = -1, g_world;
static bool g_all_local; /* every rank of the world is on this node */
static MPI_Win g_bwin = MPI_WIN_NULL;
static MPI_Comm g_bnode = MPI_COMM_NULL;
static double g_timeout_s = 600; /* the first comm's --comm-timeout, for the meet in fini */

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    /* not FUTEX_PRIVATE_FLAG: the word is shared between processes */
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

void comm_bell_init(const k3_comm *c) {
    if (g_bells) return;
    int me = 0, n = 1, ok = 1;
    g_timeout_s = c->timeout_s;
    comm_mpi_meet(MPI_COMM_WORLD, c->timeout_s); /* the splits and windows: comm_mpi.c */
    int rc =
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &g_bnode);
    comm_mpi_blocking(false);
    if (rc != MPI_SUCCESS) return;
    MPI_Comm_rank(g_bnode, &me);
    MPI_Comm_size(g_bnode, &n);
    int *world_of = calloc((size_t)n, sizeof *world_of);
    int *local_of = malloc((size_t)c->size * sizeof *local_of);
    bell_slot *mine = NULL, *base = NULL;
    MPI_Aint sz = 0;
    int du = 0;
    ok = world_of && local_of;
    /* count unit: bytes, one bell_slot per local rank */
    comm_mpi_meet(g_bnode, c->timeout_s);
    if (ok)
        ok = MPI_Win_allocate_shared((MPI_Aint)sizeof(bell_slot), (int)sizeof(bell_slot),
                                     MPI_INFO_NULL, g_bnode, &mine, &g_bwin) == MPI_SUCCESS;
    comm_mpi_blocking(false);
    if (ok) ok = MPI_Win_shared_query(g_bwin, 0, &sz, &du, &base) == MPI_SUCCESS;
    if (ok) {
        atomic_store(&mine->seq, 0);
        atomic_store(&mine->sleepers, 0);
    }
    /* every rank of the node agrees (and this is the barrier that publishes the zeroed slots);
       count unit: one int per rank */
    int okall = 0;
    MPI_Request req;
    if (!comm_mpi_done(MPI_Iallreduce(&ok, &okall, 1, MPI_INT, MPI_MIN, g_bnode, &req), &req,
                       c->timeout_s, "doorbells (allreduce)"))
        okall = 0;
    if (okall &&
        !comm_mpi_done(MPI_Iallgather(&c->rank, 1, MPI_INT, world_of, 1, MPI_INT, g_bnode, &req),
                       &req, c->timeout_s, "doorbells (allgather)"))
        okall = 0;
    if (!okall) {
        free(world_of), free(local_of);
        if (g_bwin != MPI_WIN_NULL) {
            comm_mpi_blocking(true);
            MPI_Win_free(&g_bwin);
            comm_mpi_blocking(false);
        }
        MPI_Comm_free(&g_bnode);
        return;
    }
    for (int r = 0; r < c->size; r++) local_of[r] = -1;
    for (int i = 0; i < n; i++)
        if (world_of[i] >= 0 && world_of[i] < c->size) local_of[world_of[i]] = i;
    free(world_of);
    g_local_of = local_of;
    g_world = c->size;
    g_me = me;
    g_all_local = n == c->size;
    g_bells = base;
}

void comm_bell_fini(void) {
    if (!g_bells) return;
    g_bells = NULL;
    if (g_bwin != MPI_WIN_NULL) {
        comm_mpi_meet(g_bnode, g_timeout_s);
        MPI_Win_free(&g_bwin);
        comm_mpi_blocking(false);
    }
    if (g_bnode != MPI_COMM_NULL) MPI_Comm_free(&g_bnode);
    free(g_local_of);
    g_local_of = NULL;
}

bool comm_bell_on(void) {
    return g_bells != NULL;
}

bool comm_bell_all_local(void) {
    return g_bells && g_all_local;
}

void comm_bell_ring(int world_rank) {
    if (!g_bells || world_rank < 0 || world_rank >= g_world) return;
    const int i = g_local_of[world_rank];
    if (i < 0) return;
    bell_slot *b = &g_bells[i];
    /* seq_cst on both sides: a sleeper counted before our bump is woken; one counted after it
       sees the new number in FUTEX_WAIT's compare and does not sleep */
    atomic_fetch_add(&b->seq, 1);
    if (atomic_load(&b->sleepers) > 0) futex(&b->seq, FUTEX_WAKE, INT_MAX, NULL);
}

uint32_t comm_bell_seen(void) {
    return g_bells ? atomic_load(&g_bells[g_me].seq) : 0;
}

bool comm_bell_sleep(uint32_t seen, int timeout_us) {
    if (!g_bells) return false;
    bell_slot *b = &g_bells[g_me];
    struct timespec ts = {timeout_us / 1000000, (long)(timeout_us % 1000000) * 1000L};
    atomic_fetch_add(&b->sleepers, 1);
    /* woken: rung since the poll (no sleep at all), woken by FUTEX_WAKE, or rung between the
       load and the kernel's compare (EAGAIN); a timeout or a signal (EINTR) is not a ring */
    bool woken = atomic_load(&b->seq) != seen;
    if (!woken) woken = futex(&b->seq, FUTEX_WAIT, seen, &ts) == 0 || errno == EAGAIN;
    atomic_fetch_sub(&b->sleepers, 1);
    return woken && atomic_load(&b->seq) != seen; /* a spurious wake-up changed nothing */
}
