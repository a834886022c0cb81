/* rank_internal.h — private to rank/: what every role of a rank shares (rank_ctx) and the
 * functions the role files call on each other. Each role keeps its own state in a struct that
 * only its file sees (tests/layering/module_graph.py checks where each is defined):
 *   engine.c     the engine API (k3_engine.h): open, serve, submit, step, cancel, close, stats;
 *                the world's totals gathered at open and close (struct k3_engine)
 *   setup.c      config, capacity, plan + agreement, memory check, binding; the load with its
 *                heartbeat and progress bar (struct rank_load: lives only during the load)
 *   worker.c     the stage worker of a lane: decode a step message, upload, forward, send
 *                (struct rank_worker)
 *   scheduler.c  the coordinator: requests, slots, micro-batch groups, steps, sampling, events
 *                (struct rank_coord)
 *   opstats.c    --op-stats: the backend's counters per worker step (struct rank_opstats)
 *   hooks.c      fatal faults (record, then rank_abort) and the K3_TEST_FAIL / K3_TEST_FORCE
 *                hooks (struct rank_hooks)
 *   wire.c       the typed payloads of wire.h on comm's messages
 * Faults: every function that can fail returns k3_status; RTRY records the first fatal fault of
 * the rank (rank_fail) on its way up, the engine API returns it, and the client ends the job with
 * k3_engine_abort (rank_abort: the one line naming the rank, or the peer the ranks agree on).
 * Nothing outside rank/ includes this. */
#ifndef K3_RANK_INTERNAL_H
#define K3_RANK_INTERNAL_H

#include "k3_engine.h"
#include "k3_bind.h"

#include "k3_comm.h"
#include "k3_experts.h"
#include "k3_layers.h"
#include "prefix_cache.h"
#include "wire.h"

#include <stdio.h>

struct rank_worker;  /* worker.c */
struct rank_coord;   /* scheduler.c */
struct rank_opstats; /* opstats.c */
struct rank_hooks;   /* hooks.c */

typedef struct rank_ctx {
    k3_engine_opts o_; /* the engine options (copied at open) */
    const k3_engine_opts *o;
    int rank, world, stage, lane; /* stage, lane: -1 on a dedicated coordinator */
    bool worker, coord;
    k3_config cfg;
    k3_plan plan;
    k3_comm *comm;
    k3_comm_where *where; /* [world] node, host and MemAvailable of every rank (set-up) */
    bool oversub;         /* more ranks on this rank's node than cores (bind_rank) */
    /* capacity (setup.c, from the options and the engine's defaults) */
    int max_seqs;
    int64_t max_ctx, max_tokens, chunk; /* max_tokens: per forward step of a lane */
    int kv_blocks;                      /* paged cache blocks of every stage of a lane */
    bool pc_on;                         /* the prefix cache (--no-prefix-cache: off) */
    rank_pc_params pc;                  /* its sizes, the same on every rank (setup.c) */
    /* what the load made (setup.c), the worker's to use; be outlives comm (k3_engine_close) */
    k3_backend *be; /* the rank's kernel backend: weights, states, activations */
    k3_ckpt *ck;
    k3_weights *w;
    const k3_weights_view *view;
    uint64_t bytes_read;
    double load_s;
    /* node sharing (setup.c, rank_share_dense): the stage's dense weights in node memory, read
       by the lowest rank of the stage on the node; NULL: the rank holds its own */
    void *dense;
    uint64_t dense_bytes;
    bool dense_reader;
    uint64_t dense_skipped; /* checkpoint bytes of the plan this rank does not read (shared) */
    bool dense_device;      /* dense is backend memory, filled from the reader over comm */
    FILE *tty;              /* rank 0: where the load bar goes (stderr, or /dev/tty under mpirun) */
    /* the roles, each private to its file */
    struct rank_hooks *hooks; /* always */
    struct rank_worker *wk;   /* worker ranks */
    struct rank_coord *co;    /* rank 0 */
    struct rank_opstats *ops; /* worker ranks with --op-stats */
    /* wire.c: the bytes of one outgoing step message (k3_wire_step + the encoded rank_step) */
    uint8_t *wire;
    size_t wire_cap;
    /* the first fatal fault (hooks.c); the engine takes no step after it */
    k3_status fault;
    bool fault_blame; /* fault_msg names a peer as the cause (rank_blame) */
    char fault_msg[2048];
} rank_ctx;

/* The wait limit of --comm-timeout (<= 0: 600 s). */
static inline double rank_comm_timeout(const rank_ctx *r) {
    return r->o->comm_timeout_s > 0 ? r->o->comm_timeout_s : 600;
}
/* The prefix of set-up error lines (k3_engine_opts.name, default "k3"). */
static inline const char *rank_cmd_name(const rank_ctx *r) {
    return r->o && r->o->name ? r->o->name : "k3";
}

/* ---- hooks.c: faults and test hooks ------------------------------------------------------- */
/* Record s as this rank's fatal fault (the first one kept, with k3_last_error()) and return it. */
k3_status rank_fail(rank_ctx *r, k3_status s);
/* A fault whose cause is a peer: fmt says who and what; rank_abort adds who noticed. Returns
 * K3_ERR_COMM. */
k3_status rank_blame(rank_ctx *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* End the whole job for the recorded fault: with a comm fault pending, agree on the root cause
 * with the ranks that can still answer and print it once; else log "rank R (stage S, lane E)
 * failed: status: cause" (or the blame line); then abort every rank. */
_Noreturn void rank_abort(rank_ctx *r);
#define RTRY(r, expr)                                                                              \
    do {                                                                                           \
        k3_status s_ = (expr);                                                                     \
        if (s_ != K3_OK) return rank_fail((r), s_);                                                \
    } while (0)
/* K3_TEST_FAIL (k3_engine_test.h): load:R, stall-load:R, kill-load:R, decode:R:N (SIGKILL at
 * step N), stop:R:N (SIGSTOP at step N), hang:R:N, plan:R, alloc:SITE:N, graph-sync:R (a host
 * sync inside every capture of rank R: the capture fails, the step runs eagerly). A worker counts
 * its forward steps, a dedicated coordinator the logits messages it received. */
k3_status rank_hooks_create(rank_ctx *r, const char *test_fail);
/* K3_TEST_FORCE (after the set-up: ids are checked against the vocabulary). */
k3_status rank_hooks_force(rank_ctx *r, const char *test_force);
void rank_hooks_destroy(rank_ctx *r);
/* graph-sync:R names this rank. */
bool rank_hooks_graph_sync(const rank_ctx *r);
/* Die or hang now if the decode hook names this rank and count. */
void rank_hooks_step(rank_ctx *r, int count);
/* The load hooks: fail (load:R) before reading; stop or kill itself half-way (done/total). */
k3_status rank_hooks_load_begin(rank_ctx *r);
void rank_hooks_load_progress(rank_ctx *r, uint64_t done, uint64_t total);
/* plan:R: this rank's plan hash, altered when the hook names it. */
uint64_t rank_hooks_plan_hash(const rank_ctx *r, uint64_t hash);
/* K3_TEST_FAIL=alloc:SITE:N: rank 0's N-th allocation at SITE fails (submit: a request's own
 * memory at k3_engine_submit; step: a request's event data in a step; fork: a family's share when
 * a request forks). Each site fails only its request, with a clear error; the engine goes on. */
typedef enum {
    RANK_ALLOC_SUBMIT = 0,
    RANK_ALLOC_STEP,
    RANK_ALLOC_FORK,
    RANK_ALLOC_SITES
} rank_alloc_site;
bool rank_hooks_alloc_fails(rank_ctx *r, rank_alloc_site site);
/* k3_alloc (zero: k3_calloc) of n bytes at a site the hook can fail (K3_ERR_NOMEM naming what). */
k3_status rank_alloc(rank_ctx *r, rank_alloc_site site, void **p, size_t n, bool zero,
                     const char *what);
/* K3_TEST_FORCE: the forced token of position n_gen of every request; false past the list. */
bool rank_hooks_forced(const rank_ctx *r, int n_gen, int32_t *id);

/* ---- wire.c ---------------------------------------------------------------------------------- */
/* A received step message, checked against wire.h and decoded. */
typedef struct step_msg {
    k3_wire_step h;
    int src;
    char who[32];     /* "rank N": the sender, for errors */
    rank_step st;     /* the meta (its sections point into the message) */
    const float *f32; /* [n_f32] */
    int64_t n_f32;
    uint64_t n_bytes; /* on the wire, header included */
} step_msg;
/* Post a step message: h's sizes (T, D, R, n_bank) with the meta m (its magic, version, kind and
 * length are filled in here). */
k3_status rank_post_step(rank_ctx *r, int peer, k3_msg_kind kind, k3_wire_step h,
                         const rank_step *m, const k3_f32_seg *seg, int n_seg);
k3_status rank_poll_step(rank_ctx *r, int peer, k3_msg_kind kind, step_msg *out, bool *got);

/* ---- setup.c --------------------------------------------------------------------------------- */
/* Set-up before anything collective: K3_OK, K3_ERR_ARG for a usage error every rank agrees on
 * (rank 0 printed it), another status for an error every rank agreed on (printed); a fault
 * after that is recorded (rank_fail) and returned too, with r->fault set. */
k3_status rank_setup(rank_ctx *r);
/* Collective, before the load: the host ranks of one stage on one node map one shared region for
 * the stage's dense weights (the lowest of them reads it); a group that cannot is left alone. */
k3_status rank_share_dense(rank_ctx *r);
/* After the load (collective): device groups copy the reader's dense region to the others. */
k3_status rank_spread_dense(rank_ctx *r);
/* The load, with the heartbeat, the bar and --load-timeout. */
k3_status rank_load(rank_ctx *r);
k3_status rank_load_drain(rank_ctx *r); /* take stray beats (after the barrier that ends open) */

/* ---- worker.c -------------------------------------------------------------------------------- */
k3_status rank_worker_init(rank_ctx *r);
void rank_worker_destroy(rank_ctx *r);
/* Worker ranks: serve until STOP. */
k3_status rank_worker_serve(rank_ctx *r);
/* One poll of this rank's worker input; *did true when a step was processed or STOP arrived. */
k3_status rank_worker_poll(rank_ctx *r, bool *did);
/* At close, every request ended: release every slot's blocks and count the stage's blocks still
 * held by something other than a prefix-cache entry (0 unless blocks leaked; 0 off a worker). */
int64_t rank_worker_leaked_blocks(rank_ctx *r);
/* What the worker did so far: forward steps and the seconds inside them. */
void rank_worker_busy(const rank_ctx *r, int *n_forward, double *busy_s);
/* log-softmax of row [V]: the log of its normaliser (computed in double), and the n best ids
 * (best first, ties lower id first) in ids[n]. The last stage's prompt logprobs and the
 * coordinator's sampled-token logprobs share it. */
double rank_log_softmax_top(const float *row, int64_t V, int n, int32_t *ids);

/* ---- opstats.c: --op-stats ------------------------------------------------------------------ */
/* k3_engine_open, before the set-up: --op-stats with a backend that does not count is a usage
   error every rank agrees on (rank 0 prints it): K3_ERR_ARG. */
k3_status rank_opstats_agree(rank_ctx *r);
/* After the worker's backend exists: read its counters once. */
k3_status rank_opstats_init(rank_ctx *r);
void rank_opstats_destroy(rank_ctx *r);
/* First and last statements of a worker step (no-ops without --op-stats). */
k3_status rank_opstats_begin(rank_ctx *r);
k3_status rank_opstats_end(rank_ctx *r, int64_t T, int n_seqs);
/* The step being counted ran eagerly because its capture failed (graph_fallbacks). */
void rank_opstats_fallback(rank_ctx *r);
/* Collective, at close: every worker rank's totals to rank 0, which writes the JSON file.
 *rc: 0, or 1 on rank 0 when the file could not be written (printed). */
k3_status rank_opstats_write(rank_ctx *r, int *rc);

/* ---- scheduler.c ----------------------------------------------------------------------------- */
k3_status rank_coord_init(rank_ctx *r);
void rank_coord_destroy(rank_ctx *r);
k3_status rank_coord_submit(rank_ctx *r, const k3_request *rq, int64_t *id);
k3_status rank_coord_cancel(rank_ctx *r, int64_t id);
/* Every request ends (k3_engine_close): cancelled, their events dropped. */
void rank_coord_cancel_all(rank_ctx *r);
/* Progress until at least one event is ready or nothing is left (coordinator, + its worker). */
k3_status rank_coord_step(rank_ctx *r, const k3_event **events, int *n_events);
int rank_coord_pending(const rank_ctx *r);
void rank_coord_load(const rank_ctx *r, int *running, int *waiting, double *cache_usage);
/* A step whose logits some lane still owes (every request may have ended: a step returns with the
 * first lane's events). */
bool rank_coord_in_flight(const rank_ctx *r);
/* The coordinator's part of k3_engine_stats (micro_batches, tokens, steps, logits). */
void rank_coord_stats(const rank_ctx *r, k3_engine_stats *out);
/* k3_engine_rank_busy: worker rank w's forward seconds and steps, from the LOGITS so far. */
bool rank_coord_rank_busy(const rank_ctx *r, int w, double *busy_s, uint64_t *steps);

#endif /* K3_RANK_INTERNAL_H */
