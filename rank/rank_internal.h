/* rank_internal.h — private to rank/: the state of one rank (rank_ctx), the sequence and group
 * records of the scheduler, and the functions the role files share:
 *   setup.c      config, plan + hash agreement, loading with progress, k3_rank_run
 *   worker.c     the stage worker of a lane: BATCH/ACTIV in, forward, ACTIV/LOGITS out
 *   scheduler.c  the coordinator: sequences, micro-batch groups, steps, sampling, stops; the loop
 *   report.c     logits dump, the text and JSON report
 *   hooks.c      failure (die) and the K3_TEST_FAIL test hooks
 *   wire.c       the typed payloads of wire.h on comm's messages
 * Nothing outside rank/ includes this. */
#ifndef K3_RANK_INTERNAL_H
#define K3_RANK_INTERNAL_H

#include "k3_rank.h"

#include "k3_comm.h"
#include "k3_experts.h"
#include "k3_layers.h"
#include "wire.h"

#include <stdio.h>

typedef struct seq_run {
    const int32_t *prompt;
    int64_t P, fed; /* prompt length, tokens fed so far */
    int n_gen;
    int32_t *gen; /* [n_new] */
    int lane, group;
    int64_t n_tok_step; /* tokens of this sequence in its group's current step */
    float *dump;        /* [dump_rows, V] when dumping */
    int64_t dump_rows;
    k3_sampler *smp;   /* this sequence's sampler (seeded by k3_rank_seq_seed) */
    k3_stop_kind stop; /* set when a stop id / stop string ended the sequence */
    int stop_string;   /* which stop string, or -1 */
    k3_tok_bytes text; /* decoded text so far (with a tokenizer) */
} seq_run;

typedef struct group_run {
    int step;    /* current step id */
    int pending; /* LOGITS messages still expected for this step */
    bool done;
} group_run;

typedef struct rank_ctx {
    const k3_rank_opts *o;
    int rank, world, stage, lane;
    bool worker, coord;
    k3_config cfg;
    k3_plan plan;
    k3_comm *comm;
    int32_t *stop_ids; /* [n_stop_ids] the caller's + EOS ids unless ignore_eos (below V) */
    size_t n_stop_ids;
    /* test hooks */
    int fail_load_rank, fail_decode_rank, fail_decode_step, fail_plan_rank;
    bool fail_hang; /* "hang:R:N": stop answering instead of dying */
    /* worker */
    k3_ckpt *ck;
    k3_weights *w;
    const k3_weights_view *view;
    k3_stage *st;
    k3_seq_state **states; /* [n_prompts]; non-NULL for this lane's sequences */
    k3_backend *be;        /* the rank's kernel backend: weights, states, activations */
    k3_activ act;
    float *logits;    /* [max_tokens, V] on the last stage (backend memory) */
    float *h_logits;  /* host staging of logits (NULL: the backend is host-visible) */
    float *h_act;     /* host staging of h | bank for ACTIV (NULL: host-visible) */
    int32_t *lane_of; /* [n_layers * n_experts] owner lane of each (layer, expert) */
    int64_t max_tokens;
    int n_forward;
    k3_seq_state **bstates; /* [n_prompts] batch scratch */
    int32_t *bntok;         /* [n_prompts] */
    /* load */
    bool show_progress;
    FILE *tty; /* rank 0: where the bar goes (stderr, or /dev/tty under mpirun) */
    int last_pct_sent;
    int *pct; /* [world] rank 0: progress per rank */
    double load_s;
    uint64_t bytes_read;
    /* coordinator */
    int n_groups;
    seq_run *seqs;
    group_run *groups;
    int32_t *meta; /* message meta scratch */
    int64_t meta_cap;
    uint8_t *wire; /* k3_wire_step + int32 meta: the bytes of one outgoing step message */
    size_t wire_cap;
    uint64_t logits_bytes;
    int n_logits_msgs;
    uint64_t moe_dispatch_bytes, moe_combine_bytes; /* summed over the world */
    uint64_t n_steps;                               /* forward steps the coordinator sent */
    double t_gen0, t_prefill_done;
} rank_ctx;

/* ---- hooks.c: failure and test hooks ------------------------------------------------------- */
/* Log the failure naming this rank (stage, lane) and end the whole job. */
_Noreturn void rank_die(rank_ctx *r, k3_status s);
#define RTRY(r, expr)                                                                              \
    do {                                                                                           \
        k3_status s_ = (expr);                                                                     \
        if (s_ != K3_OK) rank_die((r), s_);                                                        \
    } while (0)
/* K3_TEST_FAIL: load:R, decode:R:N, hang:R:N, plan:R. */
void rank_hooks_parse(rank_ctx *r);
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
int rank_setup(rank_ctx *r); /* 0 ok, 2 usage error, 1 other error (agreed by every rank) */
void rank_load(rank_ctx *r);

/* ---- worker.c -------------------------------------------------------------------------------- */
void rank_worker_init(rank_ctx *r);
void rank_worker_destroy(rank_ctx *r);
void rank_worker_step(rank_ctx *r, const step_msg *m);

/* ---- scheduler.c ----------------------------------------------------------------------------- */
void rank_coord_init(rank_ctx *r);
void rank_coord_destroy(rank_ctx *r);
/* The event loop: coordinator and/or worker on one thread, until STOP. */
void rank_run_loop(rank_ctx *r);

/* ---- report.c -------------------------------------------------------------------------------- */
void rank_report(rank_ctx *r, const uint64_t *bytes, const uint64_t *load_us, double t_end);

#endif /* K3_RANK_INTERNAL_H */
