/* comm — every byte between ranks, behind one interface with no MPI (or NCCL) types.
 *
 * Owns: the rank grid's communicators (world + one EP group per stage), typed messages for the
 * stage hand-off and the control plane (versioned wire header, checked on receipt), the MoE
 * dispatch/combine inside a stage's EP group, a few world collectives (bcast, allgather, barrier)
 * and abort. Every blocking wait polls (MPI_Test + short sleeps, never a busy spin) and fails
 * with K3_ERR_COMM after the timeout, naming the peer (or EP group) that did not answer.
 * Must not: know what a layer, a token or a sequence is (payloads are ints + floats), or make a
 * failure fatal (it returns a status; the top level aborts).
 *
 * Sends are asynchronous: k3_comm_send copies the message into an internal slot and returns;
 * pending sends progress inside every other comm call, so two ranks that send to each other
 * before receiving never deadlock. Received messages stay valid until the next receive of the
 * same kind. Buffers grow to the largest message seen and are then reused (no steady-state
 * allocation). Backends: MPI with host buffers (comm_mpi.c); NCCL later behind the same API. */
#ifndef K3_COMM_H
#define K3_COMM_H

#include "k3_base.h"

typedef struct k3_comm k3_comm;

typedef struct k3_comm_params {
    int n_stages, n_lanes; /* the worker grid (rank = first_worker + stage * n_lanes + lane) */
    int first_worker;      /* 0: rank 0 is also (stage 0, lane 0); 1: dedicated coordinator */
    double timeout_s;      /* limit of every blocking wait (> 0) */
} k3_comm_params;

/* Collective over the world: splits the EP groups. World size must equal first_worker + S x E. */
k3_status k3_comm_create_mpi(const k3_comm_params *p, k3_comm **out);
void k3_comm_destroy(k3_comm *c);
int k3_comm_rank(const k3_comm *c);
int k3_comm_size(const k3_comm *c);
int k3_comm_stage(const k3_comm *c); /* -1 on a dedicated coordinator */
int k3_comm_lane(const k3_comm *c);  /* -1 on a dedicated coordinator */
void k3_comm_set_timeout(k3_comm *c, double timeout_s);
/* End the whole job now (MPI_Abort). Only the top level calls this, after logging the cause. */
_Noreturn void k3_comm_abort(k3_comm *c, int code);

/* ---- messages -------------------------------------------------------------------------- */
typedef enum k3_msg_kind {
    K3_MSG_BATCH = 1, /* coordinator -> stage 0: which sequences, how many tokens, the ids */
    K3_MSG_ACTIV,     /* stage s -> stage s+1 (same lane): hidden state + AttnRes bank */
    K3_MSG_LOGITS,    /* last stage -> coordinator */
    K3_MSG_PROGRESS,  /* any rank -> rank 0: load progress */
    K3_MSG_STOP,      /* coordinator -> workers: end of the run */
    K3_MSG_KIND_COUNT
} k3_msg_kind;
#define K3_ANY_RANK (-1)

#define K3_MSG_MAGIC   0x534d334bu /* "K3MS" little-endian */
#define K3_MSG_VERSION 1
/* The wire header. Message = header | int32 meta[n_meta] (padded to 8 bytes) | float f32[n_f32]. */
typedef struct k3_msg_hdr {
    uint32_t magic;   /* K3_MSG_MAGIC */
    uint16_t version; /* K3_MSG_VERSION */
    uint16_t kind;    /* k3_msg_kind */
    uint64_t n_bytes; /* whole message incl. this header */
    int64_t T;        /* rows of the hidden state (tokens) */
    int32_t n_bank;   /* AttnRes banked states following h */
    int32_t n_meta;   /* int32 metadata entries */
    int64_t D;        /* row width (hidden size / vocab) */
    int64_t n_f32;    /* floats after the metadata */
    uint64_t seq;     /* the sender's message counter (for error reports) */
} k3_msg_hdr;
_Static_assert(sizeof(k3_msg_hdr) == 56,
               "k3_msg_hdr is a wire struct: its size is part of version 1");

typedef struct k3_msg {
    k3_msg_hdr hdr;
    int src;             /* world rank of the sender */
    const int32_t *meta; /* [n_meta] */
    const float *f32;    /* [n_f32] */
} k3_msg;

/* A piece of a message's float payload (messages are gathered from several pieces, e.g. the
 * hidden state and the bank, without a staging copy by the caller). */
typedef struct k3_f32_seg {
    const float *p;
    int64_t n; /* floats */
} k3_f32_seg;
/* Queue a message (copied; returns at once). hdr: kind, T, n_bank, D set by the caller; magic,
 * version, n_bytes, n_meta, n_f32 and seq are filled here. f32 = the segments concatenated. */
k3_status k3_comm_send(k3_comm *c, int peer, k3_msg_hdr hdr, const int32_t *meta, int32_t n_meta,
                       const k3_f32_seg *seg, int n_seg);
/* Wait (with the timeout) for a message of `kind` from `peer` (or K3_ANY_RANK). */
k3_status k3_comm_recv(k3_comm *c, int peer, k3_msg_kind kind, k3_msg *out);
/* Non-blocking: *got = false when nothing is waiting. */
k3_status k3_comm_try_recv(k3_comm *c, int peer, k3_msg_kind kind, k3_msg *out, bool *got);
/* Wait until every queued send has completed. */
k3_status k3_comm_flush(k3_comm *c);
/* Sleep a little (backoff) while progressing pending sends: for callers' own poll loops. */
void k3_comm_idle(k3_comm *c, int *backoff);

/* ---- MoE dispatch / combine inside this rank's stage EP group (collective over its E lanes) -- */
typedef struct k3_dispatch_view {
    int64_t n_recv;        /* rows this lane must compute */
    int64_t width;         /* floats per row (the latent width) */
    const float *rows;     /* [n_recv, width], grouped by source lane, in the source's slot order */
    const int32_t *src;    /* [n_recv] world rank that sent the row */
    const int32_t *slot;   /* [n_recv] the row's slot index at its source */
    const int32_t *expert; /* [n_recv] expert id */
    float *out;            /* [n_recv, width] the caller writes each row's expert output here */
} k3_dispatch_view;

/* Send row i of rows [n, width] (expert[i], owner lane dest_lane[i]) to its owner. Every lane of
 * the stage must call this (n may be 0). Fills *v with what this lane received. */
k3_status k3_comm_dispatch(k3_comm *c, const float *rows, int64_t n, int64_t width,
                           const int32_t *expert, const int32_t *dest_lane, k3_dispatch_view *v);
/* Return v->out rows to their sources; out [n, width] gets row i's output in slot order i.
 * Must follow k3_comm_dispatch on every lane of the stage. */
k3_status k3_comm_combine(k3_comm *c, float *out);

/* ---- world collectives (with the timeout) ---------------------------------------------- */
k3_status k3_comm_barrier(k3_comm *c);
k3_status k3_comm_bcast(k3_comm *c, int root, void *buf, size_t n_bytes);
k3_status k3_comm_allgather_u64(k3_comm *c, uint64_t v, uint64_t *all /* [world] */);

/* ---- process set-up (for commands that become distributed only when asked) --------------- */
/* True when started by an MPI launcher (mpirun, srun --mpi=pmix): OMPI_COMM_WORLD_SIZE, PMIX_RANK
 * or PMI_RANK is set. */
bool k3_comm_launched(void);
/* MPI_Init_thread (FUNNELED) with errors returned as codes, unless MPI is already initialised. */
k3_status k3_comm_init(void);
/* MPI_Finalize if k3_comm_init initialised MPI. */
void k3_comm_finalize(void);

/* ---- before a grid exists (no handle): world rank/size and an agreement on a value ------ */
void k3_comm_world(int *rank, int *size); /* 0 / 1 when MPI is not initialised */
/* The maximum of v over the world (e.g. a status), waiting at most timeout_s. */
k3_status k3_comm_world_max(int v, int *max, double timeout_s);
/* Abort the world without a handle (see k3_comm_abort). */
_Noreturn void k3_comm_world_abort(int code);

#endif /* K3_COMM_H */
