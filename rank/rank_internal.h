/* rank_internal.h — private to rank/: the state of one rank (rank_ctx), the sequence and group
 * records of the scheduler, and the functions the role files share:
 *   engine.c     the engine API (k3_engine.h): open, serve, submit, step, cancel, close
 *   setup.c      config, plan + hash agreement, loading with progress
 *   worker.c     the stage worker of a lane: BATCH/ACTIV in, forward, ACTIV/LOGITS out
 *   scheduler.c  the coordinator: requests, slots, micro-batch groups, steps, sampling, events
 *   run.c        `k3 run` as a client of the engine: prompts in, ids/text/JSON/.npy out
 *   hooks.c      failure (die) and the K3_TEST_FAIL test hooks
 *   wire.c       the typed payloads of wire.h on comm's messages
 * Nothing outside rank/ includes this. */
#ifndef K3_RANK_INTERNAL_H
#define K3_RANK_INTERNAL_H

#include "k3_engine.h"
#include "k3_bind.h"

#include "k3_comm.h"
#include "k3_experts.h"
#include "k3_layers.h"
#include "wire.h"

#include <stdio.h>

/* One request on the coordinator (scheduler.c). */
typedef enum { RQ_QUEUED = 0, RQ_RUNNING, RQ_ENDED } rq_state;
typedef struct req_run {
    int64_t id;
    uint64_t user;
    rq_state state;
    int32_t *prompt; /* [P] (copied) */
    int64_t P, fed;  /* prompt length, tokens fed so far (prompt, then generated) */
    int max_tokens;
    int n_gen;
    int32_t *gen; /* [max_tokens] */
    int lane, group, slot;
    int blk_resv;       /* paged cache blocks reserved on its lane: prompt + max_tokens */
    bool opened;        /* its first step (the OPEN flag) was sent */
    int64_t n_tok_step; /* tokens in its group's current step */
    k3_sampler *smp;
    k3_stop_kind stop;
    int stop_string;
    int logprobs;
    bool keep_logits, all_logits, cancel;
    float *prompt_logits; /* all_logits: [P, V] */
    int64_t prompt_rows;
    k3_tok_bytes text; /* text emitted so far (deltas are its new bytes) */
    size_t text_sent;
    char *error; /* a request that can never run: reported by the next step */
    k3_error_kind error_kind;
} req_run;

typedef struct ev_block {
    char *data;
    size_t size, used;
} ev_block;

typedef struct group_run {
    int step;    /* current step id */
    int pending; /* LOGITS messages still expected for its step in flight (0: idle) */
} group_run;

typedef struct rank_ctx {
    k3_engine_opts o_; /* the engine options (copied at open) */
    const k3_engine_opts *o;
    int rank, world, stage, lane;
    bool worker, coord;
    k3_config cfg;
    k3_plan plan;
    k3_comm *comm;
    k3_comm_where *where;  /* [world] node, host and MemAvailable of every rank (set-up) */
    int32_t base_stops[3]; /* EOS of the config, <|end_of_msg|>, [EOS] (-1: none) */
    /* test hooks */
    int fail_load_rank, fail_decode_rank, fail_decode_step, fail_plan_rank;
    bool fail_hang;     /* "hang:R:N": stop answering instead of dying */
    int fail_signal;    /* decode:R:N SIGKILL, stop:R:N SIGSTOP */
    int kill_load_rank; /* "kill-load:R": SIGKILL itself half-way through the load */
    int32_t *force;     /* [n_force] K3_TEST_FORCE: the first tokens of every request (rank 0) */
    int n_force;
    /* capacity */
    int max_seqs;
    int64_t max_ctx, max_tokens, chunk; /* max_tokens: per forward step of a lane */
    /* worker */
    k3_ckpt *ck;
    k3_weights *w;
    const k3_weights_view *view;
    k3_stage *st;
    k3_seq_state **states; /* [max_seqs] this lane's slots */
    k3_backend *be;        /* the rank's kernel backend: weights, states, activations */
    k3_activ act;
    float *logits;    /* [max_tokens, V] on the last stage (backend memory) */
    float *h_logits;  /* host staging of logits (NULL: the backend is host-visible) */
    float *h_act;     /* host staging of h | bank for ACTIV (NULL: host-visible, or dev_act) */
    bool dev_act;     /* ACTIV floats go backend to backend (k3_comm_send_dev: nccl) */
    int32_t *lane_of; /* [n_layers * n_experts] owner lane of each (layer, expert) */
    int n_forward;
    double busy_s;          /* time inside forward steps */
    double busy_final[256]; /* every rank's busy_s, gathered at close */
    k3_seq_state **bstates; /* [max_seqs] batch scratch */
    int32_t *bntok;         /* [max_seqs] */
    int32_t *bnf;           /* [max_seqs] k3_batch.nonfinite */
    int32_t *wmeta;         /* [META_HDR + META_SEQ * max_seqs] the meta this worker sends on */
    bool serving;           /* worker loop live (no STOP yet) */
    int in_peer;            /* where this worker's steps come from */
    k3_msg_kind in_kind;
    /* load */
    FILE *tty; /* rank 0: where the bar goes (stderr, or /dev/tty under mpirun) */
    int *pct;  /* [world] load progress per rank (rank 0 hears every rank, workers rank 0) */
    /* the load heartbeat (setup.c): what each peer last reported, and when */
    int *hb_state;              /* [world] K3_LOAD_* */
    uint64_t *hb_bytes;         /* [world] bytes read so far */
    double *seen;               /* [world] k3_now_s() of the last beat */
    uint64_t hb_done, hb_total; /* this rank's own load */
    double hb_sent, t_load0, load_timeout_s;
    int stall_load_rank; /* test hook "stall-load:R": SIGSTOP itself half-way through the load */
    double load_s;
    uint64_t bytes_read, bytes_read_total;
    uint64_t *bytes_read_all, *load_us_all; /* [world], gathered at open */
    const k3_ckpt_tensor **read_list;       /* --verify: the tensors this rank read */
    int64_t n_read, cap_read;
    double load_s_max;
    /* coordinator */
    int n_groups;
    group_run *groups;
    req_run **reqs; /* every request not yet reported ended, by submit order */
    int n_reqs, cap_reqs;
    int64_t next_id;
    req_run **slot_req; /* [E * max_seqs] the running request in each (lane, slot) */
    int kv_blocks;      /* paged cache blocks of every stage of a lane (--kv-cache-tokens) */
    int *lane_blk_free; /* [E] blocks not reserved by a running request */
    int32_t *pend_free; /* [E * max_seqs] slots ended since the lane's last step */
    int *n_pend_free;   /* [E] */
    int32_t *meta;      /* message meta scratch */
    int64_t meta_cap;
    float *row; /* [V] scratch (logprobs) */
    /* events of the current k3_engine_step */
    k3_event *ev;
    int n_ev, cap_ev;
    struct ev_block *ev_mem; /* memory the events point into, rewound at the next step */
    int n_ev_mem, cap_ev_mem, ev_cur;
    double last_progress; /* coordinator: when a message last arrived */
    uint8_t *wire;        /* k3_wire_step + int32 meta: the bytes of one outgoing step message */
    size_t wire_cap;
    uint64_t logits_bytes;
    int n_logits_msgs;
    int64_t prompt_tokens, gen_tokens;
    uint64_t n_steps;     /* forward steps the coordinator sent */
    double *rank_busy_s;  /* [world] forward time of each rank so far (from the LOGITS) */
    uint64_t *rank_steps; /* [world] its steps counted there */
    uint64_t moe_dispatch_bytes, moe_combine_bytes; /* world sums, at close */
    /* --op-stats (opstats.c, worker ranks): the backend's counters when the current step began,
       and each step's difference summed by phase (index: RANK_OPS_DECODE, _PREFILL, _IDLE) */
    k3_op_stats ops_begin;
    struct {
        uint64_t steps, host_syncs_max; /* steps of the phase; the most host syncs in one */
        k3_op_stats sum;
    } ops_phase[3];
} rank_ctx;

struct k3_engine {
    rank_ctx r;
};

/* ---- hooks.c: failure and test hooks ------------------------------------------------------- */
/* Log the failure naming this rank (stage, lane) and end the whole job. */
_Noreturn void rank_die(rank_ctx *r, k3_status s);
/* Log one line naming a peer as the cause (fmt says who and what; the line adds who noticed) and
 * end the whole job. */
_Noreturn void rank_die_blame(rank_ctx *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
#define RTRY(r, expr)                                                                              \
    do {                                                                                           \
        k3_status s_ = (expr);                                                                     \
        if (s_ != K3_OK) rank_die((r), s_);                                                        \
    } while (0)
/* K3_TEST_FAIL: load:R, stall-load:R, kill-load:R, decode:R:N (SIGKILL at step N), stop:R:N
 * (SIGSTOP at step N), hang:R:N, plan:R. A worker counts its forward steps, a dedicated
 * coordinator the logits messages it received. */
void rank_hooks_parse(rank_ctx *r);
/* K3_TEST_FORCE (after the set-up: ids are checked against the vocabulary). */
void rank_hooks_parse_force(rank_ctx *r);
/* Die or hang now if the decode hook names this rank and count. */
void rank_hooks_maybe_die(rank_ctx *r, int count);

/* ---- wire.c ---------------------------------------------------------------------------------- */
/* A received step message, checked against wire.h. */
typedef struct step_msg {
    k3_wire_step h;
    int src;
    const int32_t *meta; /* [h.n_meta] */
    const float *f32;    /* [n_f32] */
    int64_t n_f32;
    uint64_t n_bytes; /* on the wire, header included */
} step_msg;
void rank_post_step(rank_ctx *r, int peer, k3_msg_kind kind, k3_wire_step h, const int32_t *meta,
                    const k3_f32_seg *seg, int n_seg);
void rank_poll_step(rank_ctx *r, int peer, k3_msg_kind kind, step_msg *out, bool *got);

/* ---- setup.c --------------------------------------------------------------------------------- */
int rank_setup(rank_ctx *r);       /* 0 ok, 2 usage error, 1 other error (agreed by every rank) */
void rank_load(rank_ctx *r);       /* the load, with the heartbeat and --load-timeout */
void rank_load_drain(rank_ctx *r); /* take stray beats (after the barrier that ends open) */
/* The prefix of set-up error lines (k3_engine_opts.name, default "k3"). */
static inline const char *rank_cmd_name(const rank_ctx *r) {
    return r->o && r->o->name ? r->o->name : "k3";
}

/* ---- worker.c -------------------------------------------------------------------------------- */
void rank_worker_init(rank_ctx *r);
void rank_worker_destroy(rank_ctx *r);
void rank_worker_step(rank_ctx *r, const step_msg *m);

/* ---- opstats.c: --op-stats ------------------------------------------------------------------ */
/* A worker step's phase: every sequence one token (decode), some sequence more (prefill), no
   sequence of this lane in the step (idle: it only serves its experts). */
enum { RANK_OPS_DECODE, RANK_OPS_PREFILL, RANK_OPS_IDLE, RANK_OPS_PHASES };
_Static_assert(RANK_OPS_PHASES == 3, "rank_ctx.ops_phase has one entry per phase");
/* k3_engine_open, before the set-up: --op-stats with a backend that does not count is a usage
   error every rank agrees on (rank 0 prints it). Returns 0 or 2. */
int rank_opstats_agree(rank_ctx *r);
/* After the worker's backend exists: read its counters once (ends the job if it cannot). */
void rank_opstats_init(rank_ctx *r);
/* First and last statements of rank_worker_step (no-ops without --op-stats). */
void rank_opstats_begin(rank_ctx *r);
void rank_opstats_end(rank_ctx *r, int64_t T, int n_seqs);
/* Collective, at close: every worker rank's totals to rank 0, which writes the JSON file.
   Returns 0, or 1 on rank 0 when the file could not be written (printed). */
int rank_opstats_write(rank_ctx *r);

/* ---- scheduler.c ----------------------------------------------------------------------------- */
void rank_coord_init(rank_ctx *r);
void rank_coord_destroy(rank_ctx *r);
k3_status rank_coord_submit(rank_ctx *r, const k3_request *rq, int64_t *id);
k3_status rank_coord_cancel(rank_ctx *r, int64_t id);
/* Progress until at least one event is ready or nothing is left (coordinator, + its worker). */
void rank_coord_step(rank_ctx *r);
int rank_coord_pending(const rank_ctx *r);
/* A step whose logits some lane still owes (every request may have ended: a step returns with the
 * first lane's events). */
bool rank_coord_in_flight(const rank_ctx *r);
/* Worker ranks: serve until STOP. */
void rank_worker_serve(rank_ctx *r);
/* One poll of this rank's worker input; true when a step was processed or STOP arrived. */
bool rank_worker_poll(rank_ctx *r);

#endif /* K3_RANK_INTERNAL_H */
