/* comm_internal.h — private to comm/: the transport function table (k3_comm_iface), the state
 * every transport shares (struct k3_comm, embedded first in each transport's own struct), and
 * the transport-neutral pieces the front end (comm.c) and the MoE protocol (comm_moe.c) use.
 * Nothing outside comm/ includes this.
 *
 * A transport moves bytes; the protocol above it (wire header checks, MoE deduplication, combine
 * modes, backend staging, counters) is written once in comm.c / comm_moe.c. A transport provides
 * messages (send gathered pieces / poll one kind), world collectives, and two EP-group
 * collectives: an alltoall of int32 words and an alltoallv whose counts are 4-byte words. With
 * device_buffers = false (mpi) the alltoallv buffers are host memory and comm_moe.c stages backend
 * buffers through host. A device transport (nccl: device_buffers = true) also has the two device
 * entries: ep_alltoallv_dev (the MoE rows, backend buffer to backend buffer) and p2p_dev (the
 * stage hand-off's floats); the counts and the item metadata stay host words. */
#ifndef K3_COMM_INTERNAL_H
#define K3_COMM_INTERNAL_H

#include "k3_comm.h"

/* One piece of an outgoing message (host bytes). */
typedef struct comm_piece {
    const void *p;
    size_t n_bytes;
} comm_piece;

typedef struct k3_comm_iface {
    const char *name;    /* "mpi" */
    bool device_buffers; /* false: ep_alltoallv buffers are host memory */
    /* Free the transport's resources and the object (the front end freed its own state). */
    void (*destroy)(k3_comm *c);
    /* End the job (does not return). c may be NULL. */
    void (*abort)(k3_comm *c, int code);
    /* Queue one message of n_bytes = the pieces concatenated, tag `kind`, to world rank peer. */
    k3_status (*send)(k3_comm *c, int peer, int kind, const comm_piece *pieces, int n_pieces,
                      size_t n_bytes);
    /* Receive one message of `kind` from peer (K3_ANY_RANK) if one is waiting: *bytes (owned by
     * the transport, 8-byte aligned, valid until the next poll of this kind), *n_bytes, *src. */
    k3_status (*poll)(k3_comm *c, int peer, int kind, const void **bytes, size_t *n_bytes, int *src,
                      bool *got);
    /* Progress pending sends; returns true while any is still in flight. */
    bool (*progress)(k3_comm *c);
    k3_status (*barrier)(k3_comm *c);
    k3_status (*bcast)(k3_comm *c, int root, void *buf, size_t n_bytes);
    k3_status (*allgather_u64)(k3_comm *c, uint64_t v, uint64_t *all);
    /* EP group of this rank's stage: send[e·k .. e·k+k) goes to lane e, recv[e·k ..) comes from
     * lane e (k int32 words per lane). `what` names the operation in a timeout. */
    k3_status (*ep_alltoall)(k3_comm *c, const int32_t *send, int32_t *recv, int k,
                             const char *what);
    /* Counts and displacements [n_lanes] in 4-byte words. */
    k3_status (*ep_alltoallv)(k3_comm *c, const void *send, const int64_t *scount,
                              const int64_t *sdispl, void *recv, const int64_t *rcount,
                              const int64_t *rdispl, const char *what);
    /* Optional (NULL on host transports): ep_alltoallv on backend buffers of be, queued in the
     * backend's stream order; returns when the exchange has completed. */
    k3_status (*ep_alltoallv_dev)(k3_comm *c, k3_backend *be, const void *send,
                                  const int64_t *scount, const int64_t *sdispl, void *recv,
                                  const int64_t *rcount, const int64_t *rdispl, const char *what);
    /* Optional (NULL: ep_alltoallv_dev): the same with no wait, for fixed-size exchanges whose
       buffers are next used in the backend's stream only (nccl: a watcher thread times it). */
    k3_status (*ep_alltoallv_dev_async)(k3_comm *c, k3_backend *be, const void *send,
                                        const int64_t *scount, const int64_t *sdispl, void *recv,
                                        const int64_t *rcount, const int64_t *rdispl,
                                        const char *what);
    /* Optional: n_bytes of backend memory to (send) or from world rank peer, in the backend's
     * stream order, FIFO per pair of ranks; nccl: queued, timed by its watcher thread (the
     * caller's next use of buf is in the backend's stream). */
    k3_status (*p2p_dev)(k3_comm *c, k3_backend *be, int peer, bool send, void *buf, size_t n_bytes,
                         const char *what);
} k3_comm_iface;

/* Words of the per-lane header of the MoE counts exchange: status (0 ok, 1 this lane's route is
 * bad), mode, width, rows, items, exchange number (low 31 bits). */
#define COMM_MOE_HDR_WORDS 6

/* The MoE exchange state (comm_moe.c): host arrays grow-only (capacities in elements), backend
 * buffers grow-only (capacities in bytes, owned by `be`). */
typedef struct comm_moe {
    bool dispatched;
    k3_combine_mode mode;
    int64_t width;
    uint32_t n_calls; /* header exchanges so far (the lanes' step check) */
    k3_backend *be;   /* owner of b_rows / b_w / b_out */
    /* per lane [E]: rows/items sent and received, word counts/displacements of the alltoallv */
    int64_t *s_rows, *s_items, *r_rows, *r_items, *scount, *sdispl, *rcount, *rdispl;
    int32_t *hdr_s, *hdr_r; /* [E, COMM_MOE_HDR_WORDS] */
    int64_t *mark, *cur;    /* [E] dedup scratch */
    int32_t *lanes;         /* [E] */
    /* sender */
    int64_t n_items, n_pairs;
    int64_t *item_pos;  /* [n_items] lane-local item index, then index in the return order */
    int64_t *item_prow; /* [n_items] lane-local row of the item's pair */
    int32_t *pair_lane; /* [n_pairs] */
    int64_t *pair_pos;  /* [n_pairs] lane-local row, then index in the return order */
    int64_t *pair_seg;  /* [n_rows + 1] */
    /* receiver */
    int64_t n_rows_r, n_items_r;
    int64_t *item_row; /* [n_items_r] */
    int64_t *row_seg;  /* [n_rows_r + 1] */
    int32_t *item_tag; /* [n_items_r] */
    float *item_wh;    /* [n_items_r] */
    /* host staging */
    uint32_t *sbuf, *rbuf; /* alltoallv buffers (4-byte words) */
    float *xh, *hh;        /* x download / y staging; received rows / out download */
    /* backend buffers; b_send / b_ret: the device path's packed rows out and rows back */
    float *b_rows, *b_w, *b_out, *b_send, *b_ret;
    size_t cap_b_rows, cap_b_w, cap_b_out, cap_b_send, cap_b_ret; /* bytes */
    bool dev;      /* this exchange moves rows on the device (ep_alltoallv_dev) */
    int64_t *gidx; /* device path: [n_pairs] the source row of each packed row */
    int64_t *rows_s, *rows_sd, *rows_r, *rows_rd; /* [E] device path: row words per lane */
    /* host capacities in elements */
    size_t cap_item_pos, cap_item_prow, cap_pair_lane, cap_pair_pos, cap_pair_seg, cap_item_row,
        cap_row_seg, cap_item_tag, cap_item_wh, cap_sbuf, cap_rbuf, cap_xh, cap_hh, cap_gidx;
} comm_moe;

/* A fault report (the meta bytes of a K3_MSG_FAULT message; comm_fault.c). */
#define COMM_FAULT_VERSION 1
enum { COMM_FAULT_NONE = 0, COMM_FAULT_TIMEOUT = 1, COMM_FAULT_NOTICE = 2 };
typedef struct comm_fault_report {
    uint32_t version; /* COMM_FAULT_VERSION */
    int32_t rank;
    int32_t reason;   /* COMM_FAULT_TIMEOUT: my own wait ran out; NOTICE: woken by a report */
    int32_t n_waited; /* ranks I waited for (may exceed K3_FAULT_MAX_WAITS: counted only) */
    double waited_s;  /* how long I had waited */
    int32_t waited[K3_FAULT_MAX_WAITS];
    int32_t notified_by; /* NOTICE: whose report arrived first; else -1 */
    int32_t pad_;
    char doing[96]; /* k3_comm_set_doing */
    char what[160]; /* the wait ("a MoE combine in the EP group of stage 1 (ranks 2-3)") */
} comm_fault_report;
_Static_assert(sizeof(comm_fault_report) == 416, "comm_fault_report is a wire struct");

/* Who a wait was for (comm_note_wait): a world rank >= 0, or one of these. */
enum { COMM_PEER_ANY = -1, COMM_PEER_GROUP = -2 };

struct k3_comm {
    const k3_comm_iface *iface;
    int rank, size, stage, lane, n_stages, n_lanes, first_worker;
    double timeout_s;
    uint64_t send_seq;
    k3_comm_stats stats;
    comm_moe moe;
    /* faults (comm_fault.c) */
    char doing[96];
    int fault;                   /* COMM_FAULT_* */
    int fault_from;              /* the sender of the last fault report received, -1 none */
    comm_fault_report mine;      /* this rank's report, filled when the fault is noted */
    comm_fault_report *reports;  /* [size] reports received (have[r]) */
    bool *have;                  /* [size] */
    double *heard;               /* [size] k3_now_s() of the last message from each rank */
    double t_beat;               /* the coordinator's last K3_MSG_BEAT */
    char (*host)[K3_HOST_BYTES]; /* [size] processor names (the transport fills them) */
    /* waits (comm.c, comm_bell.c) */
    bool oversub;       /* k3_comm_params.oversubscribed: never poll fast, sleep at once */
    uint32_t bell_seen; /* this rank's doorbell number before the poll that follows a sleep */
};

/* Transports: create the transport object (its struct embeds k3_comm first), fill the grid fields
 * and iface; the front end has validated p. */
k3_status k3_comm_mpi_create(const k3_comm_params *p, k3_comm **out);

/* Shared helpers (comm.c). */
/* Grow a host array to >= need elements (contents not kept). */
k3_status comm_grow(void **p, size_t *cap, size_t need, size_t elem, const char *what);
/* "rank 3 (stage 1, lane 0)", "rank 0 (coordinator)", "any rank". */
void comm_describe(const k3_comm *c, int world_rank, char *buf, size_t cap);
/* "the EP group of stage 1 (ranks 2-3)". */
void comm_group_name(const k3_comm *c, char *buf, size_t cap);
/* Sleep with backoff (10 us doubling to 500 us); progresses sends when c is not NULL. For waits on
 * MPI-internal traffic (collectives, pending sends), which rings no doorbell: a collective's
 * rounds need every member's progress, so these stay short polls (each one still a sleep). */
void comm_sleep(k3_comm *c, int *backoff);
/* Sleep while waiting for a k3 message (k3_comm_wait, k3_comm_idle): on this node's doorbell,
 * woken by a post from the node, with a timeout that grows with the wait (comm.c). */
void comm_idle(k3_comm *c, int *backoff);
/* The node's doorbells (comm_bell.c; process-wide). init is collective over the world (the first
 * k3_comm_create); off where MPI has no shared windows. ring: a k3 message was posted to
 * world_rank (no-op for a rank on another node). seen: this rank's number, taken before a poll;
 * sleep: until the number differs from seen or timeout_us passes; true when a post woke it (not
 * a timeout). */
void comm_bell_init(const k3_comm *c);
void comm_bell_fini(void);
bool comm_bell_on(void);
bool comm_bell_all_local(void);
void comm_bell_ring(int world_rank);
uint32_t comm_bell_seen(void);
bool comm_bell_sleep(uint32_t seen, int timeout_us);
#ifdef MPI_VERSION /* the files that include <mpi.h> first (comm_mpi.c, comm_bell.c) */
/* Set-up over MPI without Open MPI's polls (comm_mpi.c): meet = a nonblocking barrier whose wait
 * sleeps, before a blocking call that has no nonblocking form (a split, a shared window), then
 * Open MPI's yield on for that call (comm_mpi_blocking(false) after it); done = wait with sleeps
 * for a set-up collective that a nonblocking call (return code rc) started. Both false on
 * failure or after timeout_s. */
bool comm_mpi_meet(MPI_Comm comm, double timeout_s);
bool comm_mpi_done(int rc, MPI_Request *req, double timeout_s, const char *what);
#endif
/* Open MPI's sched_yield in idle progress calls: off in k3's own waits, Open MPI's choice (on when
 * oversubscribed) while on = true, around a blocking MPI call (comm_mpi.c). */
void comm_mpi_blocking(bool on);
/* Faults (comm_fault.c). Allocate the per-rank arrays (the transport fills host). */
k3_status comm_fault_init(k3_comm *c);
void comm_fault_free(k3_comm *c);
/* A wait timed out: note it as this rank's fault (peer: a rank or COMM_PEER_*). */
void comm_note_wait(k3_comm *c, int peer, const char *what, double waited_s);
/* Receive a waiting fault report, if any: stores it, notes the fault (NOTICE) and returns true.
 * Every wait loop calls it; the caller then fails with comm_fault_error. */
bool comm_fault_arrived(k3_comm *c);
k3_status comm_fault_error(const k3_comm *c, const char *what);
/* Free the MoE state (comm_moe.c). */
void comm_moe_free(k3_comm *c);

#endif /* K3_COMM_INTERNAL_H */
