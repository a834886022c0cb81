/* comm — every byte between ranks, behind one function table (k3_comm_iface, comm_internal.h)
 * with no MPI or NCCL types in this header. Transports (k3_comm_create by name): "mpi"
 * (comm_mpi.c, host buffers; backend buffers the host cannot read are staged through host
 * memory) and "nccl" (comm_nccl.c, in a K3_NCCL build; `--comm nccl`, or `auto` with the cuda
 * backend): MPI stays its control plane (messages, world collectives, the fault exchange) and
 * NCCL carries the MoE exchange and the device payloads, the rows backend to backend in the
 * backend's stream. The emulation build links comm/nccl_emu (NCCL's calls over MPI) instead of
 * libnccl.
 *
 * Owns: the rank grid's communicators (world + one EP group per stage), typed messages for the
 * stage hand-off and the control plane (a versioned wire header that knows nothing of the model;
 * the caller's payload struct travels as opaque bytes), device payloads (k3_comm_send_dev), the
 * MoE dispatch/combine inside a stage's EP group (deduplicated rows, two combine modes, traffic
 * counters), the fault exchange and the coordinator's heartbeat (comm_fault.c), a few world
 * collectives (bcast, allgather, barrier) and abort. Every blocking wait polls (test + short
 * sleeps, never a busy spin) and fails with K3_ERR_COMM after the timeout, naming the peer (or EP
 * group) that did not answer. Must not: know what a layer, a token or a sequence is (payloads are
 * bytes, ints and floats), or make a failure fatal (it returns a status; the top level aborts).
 *
 * Sends are asynchronous: k3_comm_post copies the message into an internal slot and returns;
 * pending sends progress inside every other comm call, so two ranks that send to each other
 * before receiving never deadlock. Received messages stay valid until the next receive of the
 * same kind. Buffers grow to the largest message seen and are then reused (no steady-state
 * allocation); the MoE exchange's backend buffers are allocated with k3_backend_alloc, grow-only,
 * and freed by k3_comm_destroy. */
#ifndef K3_COMM_H
#define K3_COMM_H

#include <stddef.h>

#include "k3_base.h"
#include "k3_kernels.h" /* k3_backend: the MoE exchange reads and writes backend buffers */

typedef struct k3_comm k3_comm;

typedef struct k3_comm_params {
    int n_stages, n_lanes; /* the worker grid (rank = first_worker + stage * n_lanes + lane) */
    int first_worker;      /* 0: rank 0 is also (stage 0, lane 0); 1: dedicated coordinator */
    double timeout_s;      /* limit of every blocking wait (> 0) */
    /* more ranks on this node than it has cores: a waiting rank never polls fast, it sleeps at
       once (the rank it waits for may need its core) */
    bool oversubscribed;
} k3_comm_params;

/* Collective over the world: splits the EP groups. transport: "mpi", or "nccl" in a K3_NCCL build
 * (NULL: "mpi"; the names this build has are listed in the error for any other). World size must
 * equal first_worker + S x E. */
k3_status k3_comm_create(const char *transport, const k3_comm_params *p, k3_comm **out);
void k3_comm_destroy(k3_comm *c);                /* NULL-safe; frees the MoE backend buffers too */
const char *k3_comm_transport(const k3_comm *c); /* "mpi" or "nccl" */
int k3_comm_rank(const k3_comm *c);
int k3_comm_size(const k3_comm *c);
int k3_comm_stage(const k3_comm *c); /* -1 on a dedicated coordinator */
int k3_comm_lane(const k3_comm *c);  /* -1 on a dedicated coordinator */
void k3_comm_set_timeout(k3_comm *c, double timeout_s);
/* End the whole job now (MPI_Abort). Only the top level calls this, after logging the cause. */
_Noreturn void k3_comm_abort(k3_comm *c, int code);

/* ---- messages -------------------------------------------------------------------------- */
typedef enum k3_msg_kind {
    K3_MSG_BATCH = 1, /* coordinator -> stage 0 */
    K3_MSG_ACTIV,     /* stage s -> stage s+1 (same lane): the stage hand-off */
    K3_MSG_LOGITS,    /* last stage -> coordinator */
    K3_MSG_PROGRESS,  /* any rank -> rank 0: load progress */
    K3_MSG_STOP,      /* coordinator -> workers: end of the run */
    K3_MSG_FAULT,     /* any rank -> every rank: a fault report (k3_comm_blame; comm's own) */
    K3_MSG_BEAT,      /* coordinator -> workers: alive while idle (k3_comm_beat) */
    K3_MSG_KIND_COUNT
} k3_msg_kind;
#define K3_ANY_RANK (-1)

#define K3_MSG_MAGIC   0x534d334bu /* "K3MS" little-endian */
#define K3_MSG_VERSION 2           /* 2: no model fields in the header; typed meta bytes */
/* The wire header. Message = header | meta (n_meta_bytes, zero-padded to a multiple of 8) |
 * float f32[n_f32]. The meta bytes are the caller's own typed payload struct (it should carry its
 * own version and be _Static_assert-ed by its owner); comm checks only the lengths. */
typedef struct k3_comm_wire_hdr {
    uint32_t magic;       /* K3_MSG_MAGIC */
    uint16_t version;     /* K3_MSG_VERSION */
    uint16_t kind;        /* k3_msg_kind */
    uint64_t n_bytes;     /* whole message incl. this header */
    int64_t n_meta_bytes; /* meta bytes after the header (before padding) */
    int64_t n_f32;        /* floats after the padded meta */
    uint64_t seq;         /* the sender's message counter (for error reports) */
} k3_comm_wire_hdr;
_Static_assert(sizeof(k3_comm_wire_hdr) == 40,
               "k3_comm_wire_hdr is a wire struct: its size is part of version 2");
_Static_assert(offsetof(k3_comm_wire_hdr, n_bytes) == 8 &&
                   offsetof(k3_comm_wire_hdr, n_meta_bytes) == 16 &&
                   offsetof(k3_comm_wire_hdr, n_f32) == 24 && offsetof(k3_comm_wire_hdr, seq) == 32,
               "k3_comm_wire_hdr field offsets are part of version 2");

/* A received message (valid until the next receive of the same kind). */
typedef struct k3_comm_msg {
    k3_msg_kind kind;
    int src;              /* world rank of the sender */
    uint64_t seq;         /* the sender's message counter */
    const void *meta;     /* [n_meta_bytes], 8-byte aligned: the caller's typed payload */
    int64_t n_meta_bytes; /* exactly what the sender posted */
    const float *f32;     /* [n_f32], 8-byte aligned */
    int64_t n_f32;
    uint64_t n_bytes; /* the whole message on the wire, header and padding included */
} k3_comm_msg;

/* A piece of a message's float payload (messages are gathered from several pieces, e.g. the
 * hidden state and the bank, without a staging copy by the caller). Host memory. */
typedef struct k3_f32_seg {
    const float *p;
    int64_t n; /* floats */
} k3_f32_seg;
/* Queue a message (copied; returns at once): meta = n_meta_bytes opaque bytes (may be NULL when
 * 0), f32 = the segments concatenated. Host memory only. */
k3_status k3_comm_post(k3_comm *c, int peer, k3_msg_kind kind, const void *meta,
                       int64_t n_meta_bytes, const k3_f32_seg *seg, int n_seg);
/* Wait (with the timeout) for a message of `kind` from `peer` (or K3_ANY_RANK). The header is
 * checked (magic, version, kind, lengths) with errors naming the sender. */
k3_status k3_comm_wait(k3_comm *c, int peer, k3_msg_kind kind, k3_comm_msg *out);
/* Non-blocking: *got = false when nothing is waiting. */
k3_status k3_comm_poll(k3_comm *c, int peer, k3_msg_kind kind, k3_comm_msg *out, bool *got);
/* Wait until every queued send has completed. */
k3_status k3_comm_flush(k3_comm *c);
/* Sleep while waiting for k3 messages, progressing pending sends: for callers' own poll loops
 * (start with *backoff = 0, reset it to 0 after each arrival). A post from a rank of this node
 * ends the sleep at once (the node's doorbell); otherwise it lasts a few us at first, then grows
 * to 1 ms and on with the wait (to 100 ms when every rank is on this node, 20 ms otherwise, and
 * 0.5 ms while one of this rank's sends is in flight), so an idle rank costs next to no CPU. */
void k3_comm_idle(k3_comm *c, int *backoff);

/* ---- device payloads (the nccl transport) ------------------------------------------------
 * True when the transport moves backend (device) buffers between ranks itself: k3_comm_send_dev
 * / k3_comm_recv_dev then carry a message's floats backend to backend, and the message itself
 * (k3_comm_post) carries only its meta. False on mpi: the caller stages floats through host. */
bool k3_comm_device_payloads(const k3_comm *c);
/* n floats of backend memory x of be to / from world rank peer, in be's stream order, FIFO per
 * pair of ranks; on nccl each returns once the transfer is queued in be's stream (the caller's
 * next use of x is in that stream) and the transport's watcher thread times it (an event after it:
 * on the timeout it aborts every rank naming this one); elsewhere when it has completed. The sender
 * posts the message that announces the sizes before the transfer; the receiver waits for that
 * message, then receives. what names the transfer in a timeout. */
k3_status k3_comm_send_dev(k3_comm *c, k3_backend *be, int peer, const float *x, int64_t n,
                           const char *what);
k3_status k3_comm_recv_dev(k3_comm *c, k3_backend *be, int peer, float *x, int64_t n,
                           const char *what);

/* ---- MoE exchange inside this rank's stage EP group (collective over its E lanes) ----------
 * Items are the (token, expert) slot rows of the sender, in slot order; rows are its tokens. The
 * dispatch sends each source row ONCE to each lane that owns >= 1 of its items, with the items'
 * (tag, weight); the combine returns either one output per item (PER_ITEM: the owner's caller
 * writes each item's expert output; the source sums in slot order, bit-identical for every
 * split) or one pre-summed output per (row, lane) pair (PRESUM: the owner sums its items of the
 * row; fewer bytes when a row has several items on one lane).
 * Buffers named "backend" are k3_backend memory: comm reads them only through
 * k3_backend_download and writes them only through k3_backend_upload (host staging inside comm;
 * skipped when k3_backend_host_visible), or, on a transport with device payloads (nccl) and a
 * device backend, moves the rows backend to backend (packed with the backend's rows_gather).
 * Pointers named "host" are host memory. */
typedef enum { K3_COMBINE_PER_ITEM = 0, K3_COMBINE_PRESUM = 1 } k3_combine_mode;
const char *k3_combine_mode_name(k3_combine_mode m); /* "per-item", "presum" */

/* Sender side (host metadata). */
typedef struct k3_moe_route {
    int64_t n_rows;           /* source rows in x (tokens) */
    int64_t n_items;          /* items (T*K) */
    const int32_t *item_row;  /* [n_items] source row of item i, nondecreasing, in [0, n_rows) */
    const int32_t *item_lane; /* [n_items] destination lane (0..n_lanes-1 of this EP group) */
    const int32_t *item_tag;  /* [n_items] opaque int carried to the receiver (the expert id) */
    const float *item_w;      /* [n_items] float carried to the receiver (the routing weight) */
} k3_moe_route;

/* Receiver view, valid until the next dispatch (the buffers belong to comm). */
typedef struct k3_dispatch_view {
    int64_t n_rows; /* rows received: one per distinct (source lane, source row) */
    int64_t width;  /* floats per row */
    float *rows;    /* backend [n_rows, width]: by source lane ascending, then source row order */
    int64_t n_items;
    const int64_t *item_row;  /* host [n_items]: index into rows, nondecreasing */
    const int64_t *row_seg;   /* host [n_rows + 1]: items of row j are [row_seg[j], row_seg[j+1]) */
    const int32_t *item_tag;  /* host [n_items] */
    const float *item_w_host; /* host [n_items] */
    float *item_w;            /* backend [n_items] (uploaded copy of item_w_host) */
    float *out;               /* backend, the caller fills: PER_ITEM [n_items, width] (item order);
                                 PRESUM [n_rows, width] */
    k3_combine_mode mode;     /* the mode of this exchange */
} k3_dispatch_view;

/* Collective over the stage's EP group (every lane calls it; n_rows and n_items may be 0, x may
 * then be NULL). x: backend [n_rows, width]. Every lane must pass the same mode and width (checked:
 * all lanes fail with an error naming the lane that differs). A route that fails validation on one
 * lane makes every lane fail (nobody waits for the timeout). Fills *v. */
k3_status k3_comm_moe_dispatch(k3_comm *c, k3_backend *be, const float *x, int64_t width,
                               const k3_moe_route *r, k3_combine_mode mode, k3_dispatch_view *v);
/* Returns v->out to the sources (collective; follows k3_comm_moe_dispatch on every lane, with the
 * same backend). y is backend memory:
 *   PER_ITEM: y [n_items, width], row i = item i's output (the sender's item order);
 *   PRESUM:   y [n_pairs, width], pairs = the distinct (row, lane) of the sender's items ordered by
 *             row, then lane ascending; *pair_seg (host [n_rows + 1], valid until the next
 *             dispatch) = the pairs of each source row. pair_seg may be NULL in PER_ITEM mode,
 *             where *pair_seg is set to NULL. */
k3_status k3_comm_moe_combine(k3_comm *c, k3_backend *be, float *y, const int64_t **pair_seg);

/* The device-routed exchange (issue 45; docs/DESIGN.md §3a "dispatch layout"): true when the
 * transport moves backend buffers between lanes (nccl) and be's memory is not the host's. Then
 * k3_comm_moe_exchange_dev sends block e of send (blk floats at e·blk) to lane e and receives lane
 * e's block into recv at e·blk, backend to backend in be's stream order (collective over the EP
 * group; fixed sizes: no counts travel on the host). what names it in a timeout. */
bool k3_comm_moe_dev(const k3_comm *c, const k3_backend *be);
k3_status k3_comm_moe_exchange_dev(k3_comm *c, k3_backend *be, const float *send, float *recv,
                                   int64_t blk, bool combine, const char *what);

/* Cumulative MoE traffic of this rank: bytes this rank handed to the transport, including its own
 * lane's share (the collective copies it locally) and the metadata. Per dispatch:
 *   dispatch_bytes += n_pairs·width·4 + n_items·12 (row, tag, weight) + n_lanes·24 (counts header)
 *   dispatch_rows  += n_pairs (rows sent)
 * Per combine (rows this rank returns as an owner):
 *   PER_ITEM: combine_rows += n_items received;  PRESUM: combine_rows += n_rows received;
 *   combine_bytes += combine_rows·width·4
 * n_exchanges counts dispatches. */
typedef struct k3_comm_stats {
    uint64_t dispatch_bytes, combine_bytes, dispatch_rows, combine_rows, n_exchanges;
    uint64_t n_bell_wakes; /* message waits whose sleep a post from this node ended (comm_bell.c) */
    /* device -> host waits the transport makes itself (nccl: each wait on a stream's NCCL work,
     * however many polls it takes); `--op-stats` adds them to the backend's host syncs */
    uint64_t host_syncs;
} k3_comm_stats;
void k3_comm_get_stats(const k3_comm *c, k3_comm_stats *out);

/* ---- faults: a bounded exchange that agrees on the root cause -------------------------------
 * A blocking wait that times out, or that receives another rank's fault report (every wait loop
 * and every k3_comm_poll looks for one), returns K3_ERR_COMM and leaves k3_comm_fault_pending
 * true. The top level then calls k3_comm_blame: this rank sends its report (what it was doing,
 * whom it waited for, for how long) to every rank and collects the others' for a bounded window
 * (K3_FAULT_WINDOW_S). Ranks that send no report are silent (stopped, hung or dead). From the
 * reports every rank derives the same verdict: the silent ranks that others waited for are the
 * root cause (named with stage, lane and host); the waits of the ranks that answered are the
 * cascade. The lowest answering rank prints it; the others stay quiet so there is one line. */
#define K3_FAULT_WINDOW_S  1.5
#define K3_FAULT_GRACE_S   1.0 /* non-printers wait this long before aborting (the line first) */
#define K3_FAULT_MAX_WAITS 32  /* ranks one report can name as waited for (more are counted) */
/* What this rank is doing now, in a few words ("decode step 12, micro-batch 1"); shown in fault
 * reports. Copied into a fixed buffer; cheap enough for every step. */
void k3_comm_set_doing(k3_comm *c, const char *doing);
/* True after a comm call failed by a timeout or by another rank's fault report. */
bool k3_comm_fault_pending(const k3_comm *c);
/* A timeout the caller detected in its own loop above comm: waited = the ranks it waited for
 * (n may be 0: unknown), what = the wait ("logits of micro-batch 0 step 7"), waited_s. */
void k3_comm_note_timeout(k3_comm *c, const int *waited, int n, const char *what, double waited_s);
/* The exchange (see above; call once, then end the job). out gets the verdict line; *printer is
 * true on the one rank that should print it. Never blocks longer than K3_FAULT_WINDOW_S. */
void k3_comm_blame(k3_comm *c, char *out, size_t cap, bool *printer);
/* Coordinator: tell every worker it is alive (at most every min(timeout/3, K3_COMM_BEAT_S); cheap
 * to call often). Every comm wait on rank 0 also beats; call it while idle outside comm. A worker
 * that hears nothing from the coordinator for the timeout blames it, so the timeout must exceed
 * the longest stretch rank 0 computes without entering comm (its stage's longest forward step).
 * A worker calls it too (every comm wait does): it answers each beat of rank 0's with one of its
 * own, so k3_comm_silent_s(c, w) on rank 0 shows a worker that stopped while the job is idle. */
#define K3_COMM_BEAT_S 1.0
k3_status k3_comm_beat(k3_comm *c);
/* Seconds since the last message of any kind from world rank `peer` arrived here (since the
 * grid was created when none did). */
double k3_comm_silent_s(const k3_comm *c, int peer);
/* A vanished peer (SIGKILL, OOM kill, crash) gives no report: mpirun then ends the job with
 * SIGTERM. k3_comm_create installs a SIGTERM handler that, before the process dies, names every
 * rank on this node whose process is gone while it was still running (an MPI shared-memory
 * window holds each local rank's pid and state), with its stage, lane and host. A program with
 * its own SIGTERM handler (k3 serve) calls k3_comm_report_vanished from it: async-signal-safe,
 * returns true when some peer vanished (then exit at once rather than gracefully). */
bool k3_comm_report_vanished(void);

/* ---- world collectives (with the timeout) ---------------------------------------------- */
k3_status k3_comm_barrier(k3_comm *c);
k3_status k3_comm_bcast(k3_comm *c, int root, void *buf, size_t n_bytes);
k3_status k3_comm_allgather_u64(k3_comm *c, uint64_t v, uint64_t *all /* [world] */);

/* ---- process set-up (for commands that become distributed only when asked) --------------- */
/* True when started by an MPI launcher (mpirun, srun --mpi=pmix): OMPI_COMM_WORLD_SIZE, PMIX_RANK
 * or PMI_RANK is set. */
bool k3_comm_launched(void);
/* MPI_Init_thread (FUNNELED) with errors returned as codes, unless MPI is already initialised
 * (MPI also bootstraps the other transports). */
k3_status k3_comm_init(void);
/* MPI_Finalize if k3_comm_init initialised MPI. */
void k3_comm_finalize(void);

/* ---- before a grid exists (no handle): world rank/size and an agreement on a value ------ */
void k3_comm_world(int *rank, int *size); /* 0 / 1 when MPI is not initialised */
/* The maximum of v over the world (e.g. a status), waiting at most timeout_s. */
k3_status k3_comm_world_max(int v, int *max, double timeout_s);
/* Where every world rank runs, before a grid exists (collective over the world; every rank must
 * call it, also one whose set-up failed). node = the lowest world rank that shares memory with it
 * (MPI_Comm_split_type SHARED: the ranks of one node); host = its processor name (cut to
 * K3_HOST_BYTES - 1); v = the value that rank passed (e.g. its MemAvailable). A bounded
 * agreement first makes sure every rank has arrived, so the (blocking) split cannot hang on a
 * rank that never comes; the exchange itself waits at most timeout_s. Without MPI: one entry.
 * The map is then checked against reality: every rank placed on another rank's node must run on
 * its host name and see its node's POSIX shared memory, or every rank returns the same
 * K3_ERR_ARG naming the ranks and hosts (all[] is filled either way). */
#define K3_HOST_BYTES 48
typedef struct k3_comm_where {
    int32_t node;             /* lowest world rank on the same node */
    int32_t pid;              /* the rank's process id (the node map's shared-memory check) */
    uint64_t v;               /* the caller's value */
    char host[K3_HOST_BYTES]; /* NUL-terminated */
} k3_comm_where;
_Static_assert(sizeof(k3_comm_where) == 64, "k3_comm_where travels as 64 bytes per rank");
k3_status k3_comm_world_where(uint64_t v, k3_comm_where *all /* [world] */, double timeout_s);
/* Abort the world without a handle (see k3_comm_abort). */
_Noreturn void k3_comm_world_abort(int code);

#endif /* K3_COMM_H */
