/* comm_mpi.c — the MPI transport of k3_comm (host buffers), and the process set-up that every
 * transport shares (MPI also bootstraps NCCL).
 *
 * Owns: MPI_COMM_WORLD use for messages (tag = message kind, MPI_Improbe + MPI_Imrecv so a probed
 * message cannot be stolen; sends are MPI_Isend from per-message slots that progress in every
 * call), one EP communicator per stage from MPI_Comm_split(color = stage, key = lane), and the EP
 * collectives the MoE protocol (comm_moe.c) is built on: MPI_Ialltoall of int32 words and
 * MPI_Ialltoallv counted in 4-byte words. Every wait is MPI_Test in a loop with sleeps that back
 * off from 10 us to 500 us (no busy spin: on an oversubscribed node a spinning rank steals the
 * core of the rank it waits for) and a deadline naming the peer or the EP group. Waits for k3's own
 * messages sleep on the node's doorbell (comm_bell.c). Does not: interpret message bytes (comm.c
 * checks the wire header) or know backends. Count units are stated at every MPI call site. Messages
 * above INT_MAX bytes and exchanges above INT_MAX words are rejected with a clear error (not
 * chunked yet). */
#include <mpi.h> /* first: comm_internal.h declares its MPI helpers when MPI_VERSION is known */

#include "k3_comm.h"
#include "comm_internal.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct send_slot {
    MPI_Request req;
    void *buf;
    size_t cap;
    bool busy;
} send_slot;

typedef struct mpi_comm {
    k3_comm base; /* first: a k3_comm * is a mpi_comm * */
    MPI_Comm world, ep;
    send_slot *slots;
    int n_slots;
    void *rbuf[K3_MSG_KIND_COUNT]; /* one receive buffer per kind (8-byte aligned) */
    size_t rcap[K3_MSG_KIND_COUNT];
    int *scnt, *sdsp, *rcnt, *rdsp; /* [E] alltoallv counts/displacements in words */
} mpi_comm;

static mpi_comm *M(k3_comm *c) {
    return (mpi_comm *)c;
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

/* Wait for one request until timeout_s; `what` and `peer` name it in the error, peer_code says
 * whom it waited for (a world rank or COMM_PEER_*) in the fault report. c (may be NULL)
 * progresses pending sends and listens for other ranks' fault reports while waiting. */
static k3_status wait_req(k3_comm *c, double timeout_s, MPI_Request *req, const char *what,
                          const char *peer, int peer_code) {
    double t0 = k3_now_s();
    int backoff = 0;
    for (;;) {
        int done = 0;
        MPI_TRY(MPI_Test(req, &done, MPI_STATUS_IGNORE));
        if (done) return K3_OK;
        /* No MPI_Cancel below: cancelling a nonblocking collective is erroneous in MPI, and a
         * fault is fatal anyway (the caller aborts the job, which frees everything). */
        if (comm_fault_arrived(c)) return comm_fault_error(c, what);
        double waited = k3_now_s() - t0;
        if (waited > timeout_s) {
            char w[160];
            snprintf(w, sizeof w, "%s with %s", what, peer);
            comm_note_wait(c, peer_code, w, waited);
            return K3_ERR(K3_ERR_COMM, "%s: no answer from %s within %.0f s (--comm-timeout)", what,
                          peer, timeout_s);
        }
        comm_sleep(c, &backoff);
    }
}

/* Open MPI's blocking calls poll until every member has arrived. The few that k3 makes have no
 * nonblocking form (a communicator split, a shared window, freeing one: set-up and teardown), and
 * each is entered only after a nonblocking barrier whose wait sleeps: every member is then there,
 * and the call polls for its own rounds only, with Open MPI's yield on (comm_mpi_blocking); the
 * caller turns it off again after the call. Best effort: false when the barrier failed (the
 * caller goes on to its call, as before). */
bool comm_mpi_meet(MPI_Comm comm, double timeout_s) {
    MPI_Request req;
    bool ok =
        MPI_Ibarrier(comm, &req) == MPI_SUCCESS &&
        wait_req(NULL, timeout_s, &req, "set-up (barrier)", "some rank", COMM_PEER_ANY) == K3_OK;
    comm_mpi_blocking(true);
    return ok;
}

/* A set-up collective started with a nonblocking call (rc its return code), then waited for with
 * sleeps: true when it completed. */
bool comm_mpi_done(int rc, MPI_Request *req, double timeout_s, const char *what) {
    return rc == MPI_SUCCESS &&
           wait_req(NULL, timeout_s, req, what, "some rank", COMM_PEER_ANY) == K3_OK;
}

/* ---- vanished peers ------------------------------------------------------------------------
 * A SIGKILLed or crashed rank sends no fault report; mpirun notices the dead process and ends the
 * job by sending SIGTERM to the others (then SIGKILL after odls_base_sigkill_timeout, 1 s). In that
 * second, each survivor's SIGTERM handler names the ranks of its node whose process is gone while
 * their state still says running. The states live in an MPI shared-memory window of the node (one
 * slot per local rank: pid, state), so a rank that exits on purpose (abort, close, SIGTERM) first
 * marks itself leaving and is never mistaken for a vanished one. Process-wide: made at the first
 * k3_comm_create, freed by k3_comm_finalize.
 * A rank alone on its node has no such neighbour, and a node can die whole, so the ranks of
 * other nodes are watched by rank 0 over a TCP connection each (their peer sockets; rank 1
 * watches a rank 0 alone on its node), and the window names only the ranks of rank 0's node. The
 * kernel closes a dead process's sockets, so the watcher's SIGTERM handler finds EOF on the
 * connection of a rank that vanished; a rank that leaves on purpose first sends one byte ('L')
 * on its connection, like its state in the window. One line per vanished rank either way. */
enum { PEER_RUNNING = 1, PEER_LEAVING = 2 };
typedef struct node_slot {
    volatile int32_t pid;
    volatile int32_t state;
} node_slot;
static node_slot *g_slots; /* [g_n_local] this node's window (NULL: none) */
static int g_n_local, g_my_local;
static MPI_Win g_win = MPI_WIN_NULL;
static MPI_Comm g_node = MPI_COMM_NULL;
static double g_fini_timeout_s = 600; /* the first comm's --comm-timeout, for the meet at the end */
static char (*g_desc)[128];           /* [g_n_local] "rank 2 (stage 1, lane 0, host vm, pid 77)" */
static char g_prefix[40];             /* "[k3 r01 s0 e1 E] " */

static int g_peer_fd = -1;   /* a lone rank: its connection to its watcher */
static int *g_watch_fd;      /* [g_n_watch] the watcher: its connections to the lone ranks */
static char (*g_wdesc)[128]; /* [g_n_watch] their descriptions */
static int g_n_watch;
static bool g_window_names = true;     /* false: rank 0 watches this node's ranks over sockets */
static volatile sig_atomic_t *g_named; /* [g_n_watch] 1: named or left (the watch thread) */
static pthread_t g_watch_thread;
static int g_wake[2] = {-1, -1}; /* a pipe that ends the watch thread */

static void mark_leaving(void) {
    if (g_slots) g_slots[g_my_local].state = PEER_LEAVING;
    if (g_peer_fd >= 0) { /* async-signal-safe; a second 'L' is harmless (the watcher peeks) */
        const char b = 'L';
        ssize_t k = send(g_peer_fd, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
        (void)k;
    }
}

static size_t cat(char *dst, size_t n, size_t cap, const char *src) { /* async-signal-safe */
    while (*src && n + 1 < cap) dst[n++] = *src++;
    dst[n] = 0;
    return n;
}

static void say_vanished(const char *desc) { /* async-signal-safe */
    char line[512];
    size_t n = cat(line, 0, sizeof line, g_prefix);
    n = cat(line, n, sizeof line, desc);
    n = cat(line, n, sizeof line,
            " vanished: its process is gone (killed or crashed) while the job ran; the "
            "launcher is ending the job\n");
    ssize_t wr = write(STDERR_FILENO, line, n);
    (void)wr;
}

bool k3_comm_report_vanished(void) {
    if (!g_slots && g_peer_fd < 0 && !g_n_watch) return false;
    mark_leaving();
    bool any = false;
    for (int i = 0; g_slots && g_window_names && i < g_n_local; i++) {
        if (i == g_my_local || g_slots[i].state != PEER_RUNNING || g_slots[i].pid <= 0) continue;
        if (kill((pid_t)g_slots[i].pid, 0) == 0 || errno != ESRCH) continue;
        say_vanished(g_desc[i]);
        any = true;
    }
    /* a rank of another node: EOF (or a reset) without its 'L' first */
    for (int i = 0; i < g_n_watch; i++) {
        if (g_named[i]) continue; /* the watch thread named it (or saw it leave) */
        char b = 0;
        ssize_t k = recv(g_watch_fd[i], &b, 1, MSG_DONTWAIT | MSG_PEEK);
        if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            say_vanished(g_wdesc[i]);
            any = true;
        }
    }
    return any;
}

static void on_term(int sig) {
    int saved = errno;
    k3_comm_report_vanished();
    errno = saved;
    signal(sig, SIG_DFL);
    raise(sig);
}

/* "rank 2 (stage 1, lane 0, host vm, pid 77)": how the SIGTERM handler names a vanished rank. */
static void describe_rank(const k3_comm *c, int r, int pid, char *buf, size_t cap) {
    int w = r - c->first_worker;
    if (w < 0)
        snprintf(buf, cap, "rank %d (coordinator, host %s, pid %d)", r, c->host[r], pid);
    else
        snprintf(buf, cap, "rank %d (stage %d, lane %d, host %s, pid %d)", r, w / c->n_lanes,
                 w % c->n_lanes, c->host[r], pid);
}

/* The prefix of the handler's lines, and the handler itself (on_term). */
static void handle_term(const k3_comm *c) {
    if (c->stage >= 0)
        snprintf(g_prefix, sizeof g_prefix, "[k3 r%02d s%d e%d E] ", c->rank, c->stage, c->lane);
    else
        snprintf(g_prefix, sizeof g_prefix, "[k3 r%02d E] ", c->rank);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
}

/* Collective over the world (inside the first k3_comm_create). Best effort: without the window
 * (an MPI without shared-memory windows) the SIGTERM handler simply names nobody. */
static void watch_node(const k3_comm *c) {
    if (g_slots) return;
    int me = 0, n = 1;
    g_fini_timeout_s = c->timeout_s;
    comm_mpi_meet(MPI_COMM_WORLD, c->timeout_s);
    int rc =
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &g_node);
    comm_mpi_blocking(false);
    if (rc != MPI_SUCCESS) return;
    MPI_Comm_rank(g_node, &me);
    MPI_Comm_size(g_node, &n);
    node_slot *mine = NULL, *base = NULL;
    MPI_Aint sz = 0;
    int du = 0;
    int *world_of = calloc((size_t)n, sizeof *world_of);
    char(*desc)[128] = calloc((size_t)n, sizeof *desc);
    /* count unit: bytes, one node_slot per local rank */
    comm_mpi_meet(g_node, c->timeout_s);
    int ok = world_of && desc &&
             MPI_Win_allocate_shared((MPI_Aint)sizeof(node_slot), (int)sizeof(node_slot),
                                     MPI_INFO_NULL, g_node, &mine, &g_win) == MPI_SUCCESS;
    comm_mpi_blocking(false);
    if (ok) ok = MPI_Win_shared_query(g_win, 0, &sz, &du, &base) == MPI_SUCCESS;
    if (ok) {
        mine->pid = (int32_t)getpid();
        mine->state = PEER_RUNNING;
    }
    /* count unit: one int (world rank) per local rank; also the barrier that publishes the slots */
    int okall = 0;
    MPI_Request req;
    if (!comm_mpi_done(MPI_Iallreduce(&ok, &okall, 1, MPI_INT, MPI_MIN, g_node, &req), &req,
                       c->timeout_s, "node window (allreduce)"))
        okall = 0;
    if (okall &&
        !comm_mpi_done(MPI_Iallgather(&c->rank, 1, MPI_INT, world_of, 1, MPI_INT, g_node, &req),
                       &req, c->timeout_s, "node window (allgather)"))
        okall = 0;
    if (!okall) {
        free(world_of), free(desc);
        return;
    }
    for (int i = 0; i < n; i++)
        describe_rank(c, world_of[i], (int)base[i].pid, desc[i], sizeof desc[i]);
    free(world_of);
    g_desc = desc;
    g_n_local = n;
    g_my_local = me;
    g_slots = base;
    handle_term(c);
}

/* A connection to host:port within timeout_s, or -1. */
static int dial(const char *host, int port, double timeout_s) {
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    if (getaddrinfo(host, ps, &hints, &ai) != 0) return -1;
    int fd = -1;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        int rc = connect(fd, a->ai_addr, a->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            int err = 0;
            socklen_t el = sizeof err;
            rc = poll(&pf, 1, (int)(timeout_s * 1000)) == 1 &&
                         getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) == 0 && err == 0
                     ? 0
                     : -1;
        }
        if (rc != 0) close(fd), fd = -1;
    }
    freeaddrinfo(ai);
    return fd;
}

/* Collective over the world (after watch_node): the peer sockets. Rank 0 watches every rank on
 * another node (up to K3_WATCH_MAX), rank 1 a rank 0 alone on its node; the window names the
 * ranks of rank 0's node, and those of a node whose ranks rank 0 could not reach. Best effort: a
 * rank that cannot be reached by its host name is not watched (a warning says so; the launcher
 * still ends the job, and a survivor of its node names it). */
/* The watch thread (rank 0, or rank 1 for a lone rank 0): names a watched rank the moment its
 * connection closes without its 'L'. Open MPI's ob1 may end a survivor itself (_exit) when it
 * finds a TCP peer dead, before k3 sees an error or mpirun's SIGTERM comes; so the line cannot
 * wait for the SIGTERM handler. It makes no MPI call. */
static void *watch_main(void *arg) {
    (void)arg;
    struct pollfd *pf = calloc((size_t)g_n_watch + 1, sizeof *pf);
    if (!pf) return NULL;
    for (int i = 0; i < g_n_watch; i++)
        pf[i] = (struct pollfd){.fd = g_watch_fd[i], .events = POLLIN};
    pf[g_n_watch] = (struct pollfd){.fd = g_wake[0], .events = POLLIN};
    for (;;) {
        if (poll(pf, (nfds_t)g_n_watch + 1, -1) < 0 && errno != EINTR) break;
        if (pf[g_n_watch].revents) break; /* unwatch */
        for (int i = 0; i < g_n_watch; i++) {
            if (!pf[i].revents) continue;
            char b = 0;
            ssize_t k = recv(pf[i].fd, &b, 1, MSG_DONTWAIT | MSG_PEEK);
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
            if (!(k == 1 && b == 'L') && !g_named[i]) say_vanished(g_wdesc[i]);
            g_named[i] = 1;
            pf[i].fd = -1; /* named, or left on purpose: no more to learn */
        }
    }
    free(pf);
    return NULL;
}

enum { K3_WATCH_MAX = 512 };
static void watch_remote(const k3_comm *c) {
    int lead = c->rank;
    MPI_Request req;
    if (g_node == MPI_COMM_NULL || c->size < 2 ||
        !comm_mpi_done(MPI_Iallreduce(&c->rank, &lead, 1, MPI_INT, MPI_MIN, g_node, &req), &req,
                       c->timeout_s, "node lead (allreduce)"))
        return;
    /* every rank listens on an ephemeral port of every address; the unwatched close it */
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_ANY_INIT};
    socklen_t al = sizeof a;
    int lfd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0), port = 0;
    if (lfd >= 0 && (bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, 4) != 0 ||
                     getsockname(lfd, (struct sockaddr *)&a, &al) != 0))
        close(lfd), lfd = -1;
    if (lfd >= 0) port = ntohs(a.sin6_port);
    /* count unit: 3 ints a rank (port, pid, the lowest rank of its node) */
    int mine[3] = {port, (int)getpid(), lead};
    int *all = calloc((size_t)c->size * 3, sizeof *all);
    int *fds = calloc((size_t)c->size, sizeof *fds);
    char(*desc)[128] = calloc((size_t)c->size, sizeof *desc);
    int ok = all && fds && desc &&
             comm_mpi_done(MPI_Iallgather(mine, 3, MPI_INT, all, 3, MPI_INT, MPI_COMM_WORLD, &req),
                           &req, c->timeout_s, "peer sockets (allgather)");
    int n0 = 0; /* ranks on rank 0's node */
    for (int r = 0; ok && r < c->size; r++) n0 += all[3 * r + 2] == all[2];
    int n = 0;
    for (int r = 0; ok && r < c->size; r++) {
        const bool watched = r == 0 ? n0 == 1 : all[3 * r + 2] != all[2];
        if (!watched || all[3 * r] <= 0 || c->rank != (r == 0 ? 1 : 0)) continue;
        if (n == K3_WATCH_MAX) {
            K3_LOGW("comm: rank %d watches %d ranks of other nodes at most; rank %d and later "
                    "are named only by a survivor of their node",
                    c->rank, K3_WATCH_MAX, r);
            break;
        }
        int fd = dial(c->host[r], all[3 * r], K3_MIN(c->timeout_s, 5.0));
        if (fd < 0) {
            K3_LOGW("comm: cannot reach rank %d on host %s at %s:%d to watch it: if it dies, a "
                    "survivor of its node or only the launcher will say so",
                    r, c->host[r], c->host[r], all[3 * r]);
            continue;
        }
        describe_rank(c, r, all[3 * r + 1], desc[n], sizeof desc[n]);
        fds[n++] = fd;
    }
    /* a watched rank takes its watcher's connection (already in the backlog when it was made) */
    int dialed = n, got = 0;
    if (!comm_mpi_done(MPI_Iallreduce(&dialed, &got, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD, &req),
                       &req, c->timeout_s, "peer sockets (allreduce)"))
        got = 0;
    const bool me_watched = ok && (c->rank == 0 ? n0 == 1 : all[3 * c->rank + 2] != all[2]);
    if (lfd >= 0 && got > 0 && me_watched) {
        struct pollfd pf = {.fd = lfd, .events = POLLIN};
        if (poll(&pf, 1, 2000) == 1) g_peer_fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    }
    if (lfd >= 0) close(lfd);
    /* the window names this node's ranks unless rank 0 watches them over their sockets */
    g_window_names = !(me_watched && g_peer_fd >= 0 && c->rank != 0);
    free(all);
    if (n == 0) {
        free(fds), free(desc);
        return;
    }
    g_named = calloc((size_t)n, sizeof *g_named);
    if (!g_named || pipe2(g_wake, O_CLOEXEC) != 0) {
        for (int i = 0; i < n; i++) close(fds[i]);
        free(fds), free(desc), free((void *)g_named);
        g_named = NULL;
        return;
    }
    g_watch_fd = fds;
    g_wdesc = desc;
    g_n_watch = n;
    if (pthread_create(&g_watch_thread, NULL, watch_main, NULL) != 0) {
        close(g_wake[0]), close(g_wake[1]);
        g_wake[0] = g_wake[1] = -1; /* the SIGTERM handler still names them */
    }
    if (!g_slots) handle_term(c); /* no window here: the handler still has ranks to name */
}

static void unwatch_lone(void) {
    mark_leaving();
    if (g_wake[1] >= 0) { /* end the watch thread first: it reads the arrays below */
        ssize_t k = write(g_wake[1], "x", 1);
        (void)k;
        pthread_join(g_watch_thread, NULL);
        close(g_wake[0]), close(g_wake[1]);
        g_wake[0] = g_wake[1] = -1;
    }
    for (int i = 0; i < g_n_watch; i++) close(g_watch_fd[i]);
    g_n_watch = 0;
    free(g_watch_fd), free(g_wdesc), free((void *)g_named);
    g_watch_fd = NULL, g_wdesc = NULL, g_named = NULL;
    if (g_peer_fd >= 0) close(g_peer_fd);
    g_peer_fd = -1;
}

static void unwatch_node(void) {
    unwatch_lone();
    if (!g_slots) return;
    mark_leaving();
    g_slots = NULL;
    signal(SIGTERM, SIG_DFL);
    if (g_win != MPI_WIN_NULL) {
        comm_mpi_meet(g_node, g_fini_timeout_s);
        MPI_Win_free(&g_win);
        comm_mpi_blocking(false);
    }
    if (g_node != MPI_COMM_NULL) MPI_Comm_free(&g_node);
    free(g_desc);
    g_desc = NULL;
}

/* Open MPI's yield. When the node is oversubscribed, Open MPI calls sched_yield in every progress
 * call that finds nothing (mpi_yield_when_idle). k3's own waits test and sleep (wait_req,
 * comm_idle), so there the yields only cost: under Linux's EEVDF a yield moves the rank's deadline
 * a slice back, behind every busy process of its core, and 4 ranks on 2 cores beside 2 busy loops
 * ran a 16-request batch ~20 s instead of ~1 s (docs/PERFORMANCE.md). So k3 turns it off at
 * the first k3_comm_create, and back to Open MPI's choice around the few blocking calls of set-up
 * and teardown (splits, shared windows, MPI_Finalize), where polling ranks must let the late ones
 * run (comm_mpi_blocking). Through opal_progress_set_yield_when_idle, found with dlsym: another
 * MPI, or a user who set OMPI_MCA_mpi_yield_when_idle, keeps its own behaviour. */
typedef bool (*set_yield_fn)(bool);
static set_yield_fn g_set_yield; /* NULL: not Open MPI, or the user's setting stands */
static bool g_yield_default;     /* Open MPI's own choice (true when oversubscribed) */

static void yield_init(void) {
    static bool checked;
    if (checked) return;
    checked = true;
    if (getenv("OMPI_MCA_mpi_yield_when_idle")) return;
    void *sym = dlsym(RTLD_DEFAULT, "opal_progress_set_yield_when_idle");
    if (!sym) return;
    memcpy(&g_set_yield, &sym, sizeof g_set_yield); /* a data pointer to a function pointer */
    g_yield_default = g_set_yield(false);           /* returns the previous setting */
}

void comm_mpi_blocking(bool on) {
    if (g_set_yield) g_set_yield(on ? g_yield_default : false);
}

/* ---- the transport functions -------------------------------------------------------------- */
static bool mpi_progress(k3_comm *c) {
    mpi_comm *m = M(c);
    bool any = false;
    for (int i = 0; i < m->n_slots; i++) {
        if (!m->slots[i].busy) continue;
        int done = 0;
        MPI_Test(&m->slots[i].req, &done, MPI_STATUS_IGNORE);
        if (done)
            m->slots[i].busy = false;
        else
            any = true;
    }
    return any;
}

static k3_status mpi_send(k3_comm *c, int peer, int kind, const comm_piece *pc, int n_pieces,
                          size_t n_bytes) {
    mpi_comm *m = M(c);
    if (n_bytes > (size_t)INT_MAX)
        return K3_ERR(K3_ERR_COMM, "comm send: %zu bytes exceed the MPI limit of %d bytes", n_bytes,
                      INT_MAX);
    mpi_progress(c);
    send_slot *s = NULL;
    for (int i = 0; i < m->n_slots && !s; i++)
        if (!m->slots[i].busy) s = &m->slots[i];
    if (!s) {
        send_slot *ns = NULL;
        K3_TRY(k3_calloc((void **)&ns, (size_t)(m->n_slots + 1) * sizeof *ns, "comm send slots"));
        if (m->n_slots) memcpy(ns, m->slots, (size_t)m->n_slots * sizeof *ns);
        k3_free(m->slots);
        m->slots = ns;
        s = &m->slots[m->n_slots++];
    }
    K3_TRY(comm_grow(&s->buf, &s->cap, K3_MAX(n_bytes, 1), 1, "comm send buffer"));
    char *b = s->buf;
    size_t off = 0;
    for (int i = 0; i < n_pieces; i++) {
        if (pc[i].n_bytes) memcpy(b + off, pc[i].p, pc[i].n_bytes);
        off += pc[i].n_bytes;
    }
    K3_ASSERT(off == n_bytes);
    /* count unit: bytes (the whole message) */
    MPI_TRY(MPI_Isend(s->buf, (int)n_bytes, MPI_BYTE, peer, kind, m->world, &s->req));
    s->busy = true;
    return K3_OK;
}

/* The receive of a probed message (MPI_Imrecv, not MPI_Mrecv: a blocking receive polls inside Open
 * MPI, unbounded where a large message's rendezvous needs its sleeping sender). The message is
 * here, and even a large one completes within a few tests where the receiver copies it, so tests
 * without a sleep first, for up to RECV_SPIN_US: a sleep's wake-up costs more on a loaded core
 * (2-rank decode 9% slower when the first test missed and slept). Oversubscribed: one test (the
 * sender may need this core). Then wait_req's sleeps. Without c: that wait must not poll for
 * fault reports or beats, which could land in the buffer it fills. */
enum { RECV_SPIN_US = 200 };
static k3_status recv_wait(const k3_comm *c, MPI_Request *req, int src) {
    const double t_end = k3_now_s() + (c->oversub ? 0 : RECV_SPIN_US * 1e-6);
    do {
        int done = 0;
        MPI_TRY(MPI_Test(req, &done, MPI_STATUS_IGNORE));
        if (done) return K3_OK;
    } while (k3_now_s() < t_end);
    return wait_req(NULL, c->timeout_s, req, "a message's receive", "its sender", src);
}

static k3_status mpi_poll(k3_comm *c, int peer, int kind, const void **bytes, size_t *n_bytes,
                          int *src, bool *got) {
    mpi_comm *m = M(c);
    *got = false;
    mpi_progress(c);
    int flag = 0;
    MPI_Message msg;
    MPI_Status st;
    MPI_TRY(MPI_Improbe(peer < 0 ? MPI_ANY_SOURCE : peer, kind, m->world, &flag, &msg, &st));
    if (!flag) return K3_OK;
    int n = 0;
    MPI_TRY(MPI_Get_count(&st, MPI_BYTE, &n)); /* count unit: bytes */
    k3_status s =
        comm_grow(&m->rbuf[kind], &m->rcap[kind], (size_t)K3_MAX(n, 1), 1, "comm recv buffer");
    MPI_Request req;
    if (s != K3_OK) {
        /* drain (truncates) and report; count unit: bytes */
        if (MPI_Imrecv(NULL, 0, MPI_BYTE, &msg, &req) == MPI_SUCCESS)
            (void)recv_wait(c, &req, st.MPI_SOURCE);
        return s;
    }
    MPI_TRY(MPI_Imrecv(m->rbuf[kind], n, MPI_BYTE, &msg, &req)); /* count unit: bytes */
    K3_TRY(recv_wait(c, &req, st.MPI_SOURCE));
    *bytes = m->rbuf[kind];
    *n_bytes = (size_t)n;
    *src = st.MPI_SOURCE;
    if (c->heard && st.MPI_SOURCE >= 0 && st.MPI_SOURCE < c->size)
        c->heard[st.MPI_SOURCE] = k3_now_s();
    *got = true;
    return K3_OK;
}

static k3_status mpi_barrier(k3_comm *c) {
    MPI_Request req;
    MPI_TRY(MPI_Ibarrier(M(c)->world, &req));
    return wait_req(c, c->timeout_s, &req, "barrier", "some rank of the world", COMM_PEER_ANY);
}

static k3_status mpi_bcast(k3_comm *c, int root, void *buf, size_t n_bytes) {
    if (n_bytes > (size_t)INT_MAX) return K3_ERR(K3_ERR_ARG, "bcast of %zu bytes", n_bytes);
    char who[64];
    comm_describe(c, root, who, sizeof who);
    MPI_Request req;
    /* count unit: bytes */
    MPI_TRY(MPI_Ibcast(buf, (int)n_bytes, MPI_BYTE, root, M(c)->world, &req));
    return wait_req(c, c->timeout_s, &req, "bcast", who, root);
}

static k3_status mpi_allgather_u64(k3_comm *c, uint64_t v, uint64_t *all) {
    MPI_Request req;
    /* count unit: one uint64 per rank */
    MPI_TRY(MPI_Iallgather(&v, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, M(c)->world, &req));
    return wait_req(c, c->timeout_s, &req, "allgather", "some rank of the world", COMM_PEER_ANY);
}

static k3_status mpi_ep_alltoall(k3_comm *c, const int32_t *send, int32_t *recv, int k,
                                 const char *what) {
    mpi_comm *m = M(c);
    if (m->ep == MPI_COMM_NULL) return K3_ERR(K3_ERR_STATE, "%s on a rank without a stage", what);
    char grp[96];
    comm_group_name(c, grp, sizeof grp);
    MPI_Request req;
    /* count unit: k int32 words per lane */
    MPI_TRY(MPI_Ialltoall(send, k, MPI_INT32_T, recv, k, MPI_INT32_T, m->ep, &req));
    return wait_req(c, c->timeout_s, &req, what, grp, COMM_PEER_GROUP);
}

static k3_status mpi_ep_alltoallv(k3_comm *c, const void *send, const int64_t *scount,
                                  const int64_t *sdispl, void *recv, const int64_t *rcount,
                                  const int64_t *rdispl, const char *what) {
    mpi_comm *m = M(c);
    if (m->ep == MPI_COMM_NULL) return K3_ERR(K3_ERR_STATE, "%s on a rank without a stage", what);
    char grp[96];
    comm_group_name(c, grp, sizeof grp);
    for (int e = 0; e < c->n_lanes; e++) {
        if (scount[e] < 0 || rcount[e] < 0 || sdispl[e] < 0 || rdispl[e] < 0 ||
            scount[e] + sdispl[e] > INT_MAX || rcount[e] + rdispl[e] > INT_MAX)
            return K3_ERR(K3_ERR_COMM,
                          "%s in %s: lane %d's block (%lld words sent at %lld, %lld received at "
                          "%lld) exceeds the MPI limit of %d words",
                          what, grp, e, (long long)scount[e], (long long)sdispl[e],
                          (long long)rcount[e], (long long)rdispl[e], INT_MAX);
        m->scnt[e] = (int)scount[e];
        m->sdsp[e] = (int)sdispl[e];
        m->rcnt[e] = (int)rcount[e];
        m->rdsp[e] = (int)rdispl[e];
    }
    static uint32_t dummy; /* never written: every count is 0 when a buffer is NULL */
    MPI_Request req;
    /* count unit: 4-byte words */
    MPI_TRY(MPI_Ialltoallv(send ? send : &dummy, m->scnt, m->sdsp, MPI_UINT32_T,
                           recv ? recv : &dummy, m->rcnt, m->rdsp, MPI_UINT32_T, m->ep, &req));
    return wait_req(c, c->timeout_s, &req, what, grp, COMM_PEER_GROUP);
}

static void mpi_destroy(k3_comm *c) {
    mpi_comm *m = M(c);
    for (int i = 0; i < m->n_slots; i++) {
        if (m->slots[i].busy) { /* a send still in flight at teardown: cancel rather than hang */
            MPI_Cancel(&m->slots[i].req);
            MPI_Request_free(&m->slots[i].req);
        }
        k3_free(m->slots[i].buf);
    }
    k3_free(m->slots);
    for (int k = 0; k < K3_MSG_KIND_COUNT; k++) k3_free(m->rbuf[k]);
    k3_free(m->scnt), k3_free(m->sdsp), k3_free(m->rcnt), k3_free(m->rdsp);
    comm_fault_free(c);
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin && m->ep != MPI_COMM_NULL) MPI_Comm_free(&m->ep);
    k3_free(m);
}

static void mpi_abort(k3_comm *c, int code) {
    k3_comm_world_abort(code);
    (void)c;
}

static const k3_comm_iface k_mpi_iface = {
    .name = "mpi",
    .device_buffers = false,
    .destroy = mpi_destroy,
    .abort = mpi_abort,
    .send = mpi_send,
    .poll = mpi_poll,
    .progress = mpi_progress,
    .barrier = mpi_barrier,
    .bcast = mpi_bcast,
    .allgather_u64 = mpi_allgather_u64,
    .ep_alltoall = mpi_ep_alltoall,
    .ep_alltoallv = mpi_ep_alltoallv,
};

k3_status k3_comm_mpi_create(const k3_comm_params *p, k3_comm **out) {
    *out = NULL;
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) return K3_ERR(K3_ERR_STATE, "comm (mpi): MPI is not initialised");
    mpi_comm *m = NULL;
    K3_TRY(k3_calloc((void **)&m, sizeof *m, "k3_comm (mpi)"));
    k3_comm *c = &m->base;
    c->iface = &k_mpi_iface;
    m->world = MPI_COMM_WORLD;
    m->ep = MPI_COMM_NULL;
    MPI_Comm_rank(m->world, &c->rank);
    MPI_Comm_size(m->world, &c->size);
    c->n_stages = p->n_stages;
    c->n_lanes = p->n_lanes;
    c->first_worker = p->first_worker;
    c->timeout_s = p->timeout_s;
    if (c->size != p->first_worker + p->n_stages * p->n_lanes) {
        k3_status st = K3_ERR(K3_ERR_ARG, "comm: world size %d != %d + %d x %d", c->size,
                              p->first_worker, p->n_stages, p->n_lanes);
        k3_free(m);
        return st;
    }
    yield_init();
    int w = c->rank - c->first_worker;
    c->stage = w >= 0 ? w / c->n_lanes : -1;
    c->lane = w >= 0 ? w % c->n_lanes : -1;
    /* Collective over the world, before anything that can fail on one rank alone (it would leave
     * the others blocked in the split); a dedicated coordinator joins no EP group. */
    k3_status st = K3_OK;
    comm_mpi_meet(m->world, c->timeout_s);
    int rc = MPI_Comm_split(m->world, c->stage >= 0 ? c->stage : MPI_UNDEFINED, c->lane, &m->ep);
    comm_mpi_blocking(false);
    if (rc != MPI_SUCCESS) st = mpi_err(rc, "MPI_Comm_split (EP groups)", __FILE__, __LINE__);
    int **arrs[] = {&m->scnt, &m->sdsp, &m->rcnt, &m->rdsp};
    for (size_t i = 0; i < K3_ARRAY_LEN(arrs) && st == K3_OK; i++)
        st = k3_calloc((void **)arrs[i], (size_t)c->n_lanes * sizeof(int), "comm lane counts");
    if (st == K3_OK) st = comm_fault_init(c);
    /* agree first: a rank whose set-up failed above must not leave the others in the host-name
       collective below (count unit: one int) */
    int bad = st != K3_OK, any_bad = 0;
    MPI_Request req;
    k3_status sa =
        MPI_Iallreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, m->world, &req) == MPI_SUCCESS
            ? wait_req(NULL, c->timeout_s, &req, "comm set-up (allreduce)",
                       "some rank of the world", COMM_PEER_ANY)
            : K3_ERR(K3_ERR_COMM, "MPI_Iallreduce (comm set-up) failed");
    if (st == K3_OK && sa != K3_OK) st = sa;
    if (st == K3_OK && any_bad)
        st = K3_ERR(K3_ERR_COMM, "comm set-up failed on another rank (see its message)");
    /* every rank's host name, for fault reports */
    char host[K3_HOST_BYTES] = {0};
    int len = 0;
    char name[MPI_MAX_PROCESSOR_NAME];
    if (MPI_Get_processor_name(name, &len) == MPI_SUCCESS && len > 0)
        snprintf(host, sizeof host, "%.*s", len, name);
    else if (gethostname(host, sizeof host - 1) != 0)
        snprintf(host, sizeof host, "?");
    /* count unit: bytes, K3_HOST_BYTES per rank */
    if (st == K3_OK)
        st = MPI_Iallgather(host, K3_HOST_BYTES, MPI_BYTE, c->host, K3_HOST_BYTES, MPI_BYTE,
                            m->world, &req) == MPI_SUCCESS
                 ? wait_req(c, c->timeout_s, &req, "host names (allgather)",
                            "some rank of the world", COMM_PEER_ANY)
                 : K3_ERR(K3_ERR_COMM, "MPI_Iallgather (host names) failed");
    if (st != K3_OK) {
        mpi_destroy(c);
        return st;
    }
    for (int i = 0; i < c->size; i++) c->host[i][K3_HOST_BYTES - 1] = 0;
    const bool first = !g_slots && g_node == MPI_COMM_NULL;
    watch_node(c);
    comm_bell_init(c);
    if (first) watch_remote(c);
    *out = c;
    return K3_OK;
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
    if (!fin) {
        unwatch_node();
        comm_bell_fini();
        comm_mpi_blocking(true); /* MPI_Finalize's own waits */
    }
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
    return wait_req(NULL, timeout_s, &req, "agreement (allreduce)", "some rank of the world",
                    COMM_PEER_ANY);
}

/* The lowest world rank of this rank's node (the ranks sharing its memory). */
static k3_status node_lead(int rank, double timeout_s, int *lead) {
    MPI_Comm node = MPI_COMM_NULL;
    comm_mpi_blocking(true); /* k3_comm_world_where met the others just before */
    int rc = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    comm_mpi_blocking(false);
    if (rc != MPI_SUCCESS) return mpi_err(rc, "MPI_Comm_split_type (node)", __FILE__, __LINE__);
    MPI_Request req;
    *lead = rank;
    /* count unit: one int (the lowest world rank of the node) */
    rc = MPI_Iallreduce(&rank, lead, 1, MPI_INT, MPI_MIN, node, &req);
    k3_status st = rc == MPI_SUCCESS ? wait_req(NULL, timeout_s, &req, "node split (allreduce)",
                                                "some rank of this node", COMM_PEER_ANY)
                                     : mpi_err(rc, "MPI_Iallreduce (node)", __FILE__, __LINE__);
    MPI_Comm_free(&node);
    return st;
}

/* The node map must match reality: the ranks it puts on one node share that node's memory (they
 * share dense weights through POSIX shared memory and a window). Each node's lowest rank makes a
 * shared-memory object; every other rank of the node must see it, and run on the same host name.
 * Collective; every rank gets the same answer, so a wrong map is refused by all, naming the ranks
 * and their hosts. */
static k3_status check_node_map(const k3_comm_where *all, int size, int rank, double timeout_s) {
    const k3_comm_where *me = &all[rank];
    char name[64];
    snprintf(name, sizeof name, "/k3-node-%d-%d", (int)all[me->node].pid, me->node);
    int fd = -1, ok = 1, dummy = 0;
    if (me->node == rank) {
        fd = shm_open(name, O_CREAT | O_RDWR, 0600);
        if (fd < 0) ok = -1; /* cannot check: not the map's fault */
    }
    /* the objects exist before anyone looks; on any failure the object is still removed below */
    k3_status st = k3_comm_world_max(0, &dummy, timeout_s);
    if (st == K3_OK && me->node != rank) {
        int f = shm_open(name, O_RDONLY, 0);
        ok = f >= 0 && strcmp(me->host, all[me->node].host) == 0;
        if (f >= 0) close(f);
    }
    int *oks = st == K3_OK ? calloc((size_t)size, sizeof *oks) : NULL;
    if (st == K3_OK && !oks) st = K3_ERR(K3_ERR_NOMEM, "node map check: out of memory");
    MPI_Request req;
    /* count unit: one int per rank */
    if (st == K3_OK)
        st = MPI_Iallgather(&ok, 1, MPI_INT, oks, 1, MPI_INT, MPI_COMM_WORLD, &req) == MPI_SUCCESS
                 ? wait_req(NULL, timeout_s, &req, "node map check (allgather)",
                            "some rank of the world", COMM_PEER_ANY)
                 : K3_ERR(K3_ERR_COMM, "MPI_Iallgather (node map check) failed");
    if (fd >= 0) {
        close(fd);
        shm_unlink(name);
    }
    char bad[768] = "";
    size_t at = 0;
    int n_bad = 0;
    for (int i = 0; st == K3_OK && i < size; i++)
        if (oks[i] == 0) {
            if (at < sizeof bad)
                at += (size_t)snprintf(bad + at, sizeof bad - at, "%srank %d (host %s)",
                                       n_bad ? ", " : "", i, all[i].host);
            n_bad++;
        }
    free(oks);
    K3_TRY(st);
    if (n_bad == 0) return K3_OK;
    int first = -1; /* the first rank refused, for the node it was told it shares */
    for (int i = 0; i < size && first < 0; i++)
        if (all[i].node != i && strcmp(all[i].host, all[all[i].node].host) != 0) first = i;
    return K3_ERR(K3_ERR_ARG,
                  "node map: %s placed on the node of rank %d (host %s) by the launcher, but %s "
                  "not share its memory (another host, or another /dev/shm): the launcher's node "
                  "map disagrees with where the ranks run (check the hostfile, --map-by and the "
                  "node names)",
                  bad, first >= 0 ? all[first].node : 0,
                  first >= 0 ? all[all[first].node].host : "?", n_bad == 1 ? "it does" : "they do");
}

k3_status k3_comm_world_where(uint64_t v, k3_comm_where *all, double timeout_s) {
    int inited = 0, rank = 0, size = 1;
    MPI_Initialized(&inited);
    k3_comm_where me = {.node = 0, .v = v};
    if (inited) MPI_Comm_rank(MPI_COMM_WORLD, &rank), MPI_Comm_size(MPI_COMM_WORLD, &size);
    me.node = rank;
    if (inited) {
        char name[MPI_MAX_PROCESSOR_NAME];
        int len = 0;
        if (MPI_Get_processor_name(name, &len) == MPI_SUCCESS && len > 0)
            snprintf(me.host, sizeof me.host, "%.*s", len, name);
    }
    if (!me.host[0] && gethostname(me.host, sizeof me.host - 1) != 0)
        snprintf(me.host, sizeof me.host, "?");
    if (!inited || size == 1) {
        all[0] = me;
        return K3_OK;
    }
    int dummy = 0;
    K3_TRY(k3_comm_world_max(0, &dummy, timeout_s)); /* everyone is here: the split cannot hang */
    /* K3_TEST_NODE_MAP=one (tests only): every rank claims rank 0's node, a map that disagrees
       with reality on several nodes, which the check below must refuse */
    const char *lie = getenv("K3_TEST_NODE_MAP");
    if (lie && strcmp(lie, "one") == 0)
        me.node = 0;
    else
        K3_TRY(node_lead(rank, timeout_s, &me.node));
    me.pid = (int32_t)getpid();
    MPI_Request req;
    /* count unit: bytes, sizeof(k3_comm_where) per rank */
    MPI_TRY(MPI_Iallgather(&me, (int)sizeof me, MPI_BYTE, all, (int)sizeof me, MPI_BYTE,
                           MPI_COMM_WORLD, &req));
    K3_TRY(wait_req(NULL, timeout_s, &req, "node map (allgather)", "some rank of the world",
                    COMM_PEER_ANY));
    for (int i = 0; i < size; i++) all[i].host[K3_HOST_BYTES - 1] = 0;
    return check_node_map(all, size, rank, timeout_s);
}

_Noreturn void k3_comm_world_abort(int code) {
    fflush(stdout);
    fflush(stderr);
    int inited = 0, size = 1;
    MPI_Initialized(&inited);
    if (inited) MPI_Comm_size(MPI_COMM_WORLD, &size);
    mark_leaving(); /* on purpose: the others' SIGTERM handlers must not call this rank vanished */
    if (!inited || size == 1)
        _exit(code); /* nobody else to stop (a singleton's MPI_Abort can linger) */
    MPI_Abort(MPI_COMM_WORLD, code);
    abort(); /* MPI_Abort does not return; keep the compiler and the contract honest */
}
