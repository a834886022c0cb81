/* k3_engine — the one API every client of the distributed model goes through (`k3 run`,
 * `k3 batch`, `k3 serve`, `k3 bench`): requests arrive and leave while the ranks stay loaded
 * (continuous batching).
 *
 * Roles. Every rank calls k3_engine_open (collective: plan, hash agreement, load, slots). Rank 0
 * is the coordinator: only it accepts requests (k3_engine_submit), runs steps (k3_engine_step)
 * and receives events. Every other rank calls k3_engine_serve, which returns when rank 0 calls
 * k3_engine_close. With a shared coordinator rank 0 is also (stage 0, lane 0) and serves its
 * stage inside k3_engine_step. Only rank 0 tokenizes; workers learn of sequences from the step
 * messages (a sequence's first step carries the OPEN flag, which resets its slot).
 *
 * Slots. Sizes come from the plan, not from the requests: each lane holds max_seqs sequence
 * slots (KDA and short-conv state per slot, allocated once at open and reused) and a paged MLA
 * latent cache of kv_cache_tokens tokens in blocks of K3_KV_BLOCK, shared by the lane's
 * sequences (docs/DESIGN.md §3a); one forward step of a lane carries at most max_batch_tokens
 * tokens. Rank 0 reserves a request's blocks (prompt + max tokens) when it joins: a request that
 * does not fit now waits in a FIFO queue; one longer than max_ctx, or larger than a lane's whole
 * cache, is refused with an error event for that request alone.
 *
 * Steps. M micro-batch groups (default S, at least 1) circulate through the pipeline; whenever
 * group g's logits are back, its next step is formed: decode rows of its sequences first (one token
 * each), then prefill chunks (at most `chunk` tokens per sequence, within the step's token budget),
 * and new requests join (least-loaded lane with a free slot). A finished sequence leaves and frees
 * its slot at once.
 *
 * Determinism. A sequence's logits never depend on what shares its steps or when it joined
 * (the kernels' determinism rule + per-sequence state): its tokens and logits are bit-identical to
 * running it alone on the same split, and with --deterministic to every split.
 *
 * Errors belong to their request: a bad request (an id outside the vocabulary, too long, bad
 * sampling parameters), a non-finite logit or a sampler error ends that request with an error
 * event and the job goes on.
 *
 * Faults. A fault of a rank (a lost or silent peer, a failed load, a broken message, a device
 * error) is fatal for the job: the call that met it returns its status and the engine takes no
 * more steps (k3_engine_failed). The client then ends the job with k3_engine_abort, which prints
 * the one line naming the failed rank (or the peer the ranks agree was the cause) and aborts every
 * rank: no rank exits alone. The library itself never exits or aborts. */
#ifndef K3_ENGINE_H
#define K3_ENGINE_H

#include "k3_partition.h"
#include "k3_sampler.h"
#include "k3_tokenizer.h"

typedef struct k3_engine k3_engine;

typedef struct k3_engine_opts {
    const char *model_dir;
    int pp, ep; /* stages S, lanes E (world = S x E [+ 1 dedicated coordinator]) */
    k3_coord_mode coord;
    const char *expert_map_path; /* NULL = contiguous expert ranges */
    bool deterministic;          /* per-(token, expert) combine: bit-identical for every split */
    double comm_timeout_s;       /* every blocking wait; <= 0 means 600 */
    double load_timeout_s;       /* the whole load; <= 0: K3_LOAD_TIMEOUT_FLOOR_S + the largest
                                    rank's planned bytes at K3_LOAD_TIMEOUT_MIN_BPS */
    int n_threads;               /* cpu threads per rank; <= 0: the cores of the rank's binding
                                    (--bind none: 1 when world > 1, else all) */
    const char *bind;            /* "auto" (NULL): bind each rank to its share of its node's
                                    cores (k3_bind_apply); "none": leave the process as it is */
    int kda_chunk;               /* k3_stage_params.kda_chunk (0 = default) */
    const char *backend;         /* kernel backend (k3_backend_create); NULL = "cpu" */
    const char *comm;            /* transport between ranks (k3_comm_create): "mpi" or "nccl"
                                    (device buffers: with the cuda backend); NULL = "mpi" */
    /* capacity (0 = the default named) */
    int max_seqs;             /* sequence slots per lane (default 8) */
    int64_t max_ctx;          /* tokens per sequence: prompt + generated (default 4096) */
    int64_t max_batch_tokens; /* tokens per forward step of one lane (default 512) */
    int64_t chunk;            /* prefill tokens per sequence per step (default max_batch_tokens) */
    int micro_batches;        /* groups in flight through the pipeline (default S) */
    int64_t kv_cache_tokens;  /* paged MLA cache of a lane, tokens (default max_seqs x max_ctx):
                                 a request waits until its prompt + max_tokens fit */
    bool no_prefix_cache;     /* the prefix cache is on unless this is set (docs/DESIGN.md
                                 §3c: shared MLA blocks + KDA snapshots) */
    int64_t prefix_cache_tokens; /* tokens of a lane's paged cache the prefix cache may hold
                                    (0: all of kv_cache_tokens; never more) */
    const k3_tokenizer *tok;     /* rank 0, borrowed, may be NULL: text deltas + stop strings */
    bool progress;               /* load progress bar on rank 0's terminal */
    const char *name;            /* prefix of set-up error lines ("k3 batch"); NULL = "k3" */
    int load_readers;  /* reads in flight per rank while loading (k3_load_sel.n_readers; 0 = the
                          default K3_LOAD_READERS_DEFAULT) */
    bool load_direct;  /* O_DIRECT reads where the file system allows them (k3_load_sel.direct) */
    bool load_mmap;    /* host backends: map the shard files instead of reading them
                          (k3_load_sel.map; no node-sharing region: the page cache is shared) */
    bool load_private; /* every rank reads its own copy of its stage's dense weights; default:
                          host ranks of one stage on one node share one copy in node memory, and
                          device ranks (nccl) get theirs from one reader (k3_load_sel.dense) */
    bool verify;       /* after loading, check the rank's own tensors for non-finite values and E8M0
                          0xFF scales (k3_ckpt_scan); a problem ends the job naming tensor, row, file */
    bool no_cuda_graphs;  /* --cuda-graphs off: every decode step eager (default: on the cuda
                             backend, a decode step is a CUDA graph captured once per padded batch
                             size and replayed; docs/DESIGN.md §5) */
    const char *op_stats; /* NULL, or a JSON file rank 0 writes at close: each worker rank's
                             backend op calls, host syncs and host<->device bytes per forward
                             step, by phase (decode, prefill, idle; rank/opstats.c). Needs a
                             backend that counts (guard, cuda): open refuses others (exit 2) */
} k3_engine_opts;

/* Defaults of the capacity fields. */
#define K3_ENGINE_DEFAULT_MAX_SEQS         8
#define K3_ENGINE_DEFAULT_MAX_CTX          4096
#define K3_ENGINE_DEFAULT_MAX_BATCH_TOKENS 512
/* The default --load-timeout: a floor plus the largest rank's planned weight bytes read at a
 * stated minimum bandwidth (a slow shared file system still passes; a hung one is caught). */
#define K3_LOAD_TIMEOUT_FLOOR_S 60.0
#define K3_LOAD_TIMEOUT_MIN_BPS 50e6

/* Collective. K3_OK with *out set. Otherwise:
 * - K3_ERR_ARG, *out NULL: a usage error every rank agrees on (rank 0 printed it; exit 2);
 * - another status, *out NULL: a set-up error every rank agreed on (printed; exit 1);
 * - another status, *out set: a fatal fault after the agreement (e.g. while loading): the
 *   client must end the job with k3_engine_abort(*out). */
k3_status k3_engine_open(const k3_engine_opts *o, k3_engine **out);
bool k3_engine_is_coordinator(const k3_engine *e);
/* Ranks other than 0: serve steps until rank 0 closes the engine, then take part in the close
 * (k3_engine_close, collective) and free the engine. A status other than K3_OK is a fatal fault:
 * the engine is not freed and the client ends the job (k3_engine_abort). */
k3_status k3_engine_serve(k3_engine *e);
/* Collective. Rank 0: finish the steps in flight (their events are dropped), tell every rank to
 * stop; then every rank sums the MoE traffic over the world into *final (may be NULL; filled on
 * rank 0) and frees everything (other ranks: inside k3_engine_serve). A status
 * other than K3_OK is a fatal fault: e is not freed, the client ends the job (k3_engine_abort). */
typedef struct k3_engine_stats k3_engine_stats;
k3_status k3_engine_close(k3_engine *e, k3_engine_stats *final);
/* A fatal fault was met: the engine takes no more steps; the job must end (k3_engine_abort). */
bool k3_engine_failed(const k3_engine *e);
/* End the whole job for the engine's fatal fault: agree on the root cause with the ranks that
 * can still answer, print it once (naming the rank), abort every rank (exit code 1). Any rank. */
_Noreturn void k3_engine_abort(k3_engine *e);

/* A request (rank 0). Everything is copied at submit. */
typedef struct k3_request {
    const int32_t *ids; /* prompt ids [n_ids], n_ids >= 1 */
    int64_t n_ids;
    int max_tokens;             /* new tokens at most (>= 0; 0 = only prefill) */
    k3_sampler_params sampling; /* per request: seed, penalties, logit_bias, stop strings */
    bool ignore_eos;            /* no stop at EOS / <|end_of_msg|> / [EOS] */
    int logprobs;               /* 0: none; n > 0: the chosen token's logprob + the top n */
    bool keep_logits;           /* events carry the logits row each token was sampled from */
    bool all_logits;            /* + the logits of every prompt position (dumps; costly) */
    bool prompt_logprobs;       /* every prompt token's logprob (k3_prompt_lp; raw logits) */
    int prompt_top;             /* with prompt_logprobs: the top n at each position, n <= 20 */
    uint64_t user;              /* the caller's tag, returned in every event */
    /* n > 1 choices of one prompt: with fork set, this request shares the prefill of request
       fork_of (an engine id from an earlier submit, with the same prompt ids and the same
       all_logits / prompt_logprobs settings, max_tokens >= 1 both): it waits until that
       prefill's last logits come back, samples its own first token from that same row (with its
       own sampler: seed, penalties), and goes on from a copy of the state (docs/DESIGN.md §3d).
       Its tokens and logits are those it would have had alone. When the fork cannot be made
       (fork_of ended, already sampled, differs; no slot or blocks on its lane then) it runs its
       own prefill instead: never an error. */
    bool fork;
    int64_t fork_of;
} k3_request;

/* Why a request failed (ERROR events), so clients can map it (HTTP status, batch error code). */
typedef enum k3_error_kind {
    K3_EVERR_REQUEST = 1, /* invalid request: ids outside the vocabulary, empty prompt, logprobs */
    K3_EVERR_CONTEXT,     /* prompt + max_tokens longer than max_ctx */
    K3_EVERR_SAMPLING,    /* sampling parameters refused, or the sampler failed on a row */
    K3_EVERR_NUMERIC,     /* a non-finite logit */
    K3_EVERR_RESOURCE,    /* the engine ran out of memory for this request (not its fault) */
} k3_error_kind;

typedef enum k3_event_kind {
    K3_EV_TOKEN = 1, /* one generated token (and its text delta, logprobs, logits) */
    K3_EV_DONE,      /* the request finished: finish reason; the last event of the request */
    K3_EV_ERROR,     /* the request failed: message; the last event of the request */
} k3_event_kind;

#define K3_EV_MAX_TOP 20
/* One prompt token's logprob (k3_request.prompt_logprobs): log p(token | the tokens before it),
 * the log-softmax of the raw logits (no sampler processing, as vLLM's prompt_logprobs), and the
 * top n at its position, best first. The last stage computes them from the prefill's own logits
 * rows (wire.h, K3_WIRE_PLP), so they are what the model computed on this split. */
typedef struct k3_prompt_lp {
    float logprob;
    int32_t rank; /* 1 + the ids with a larger logit */
    int n_top;
    int32_t top_ids[K3_EV_MAX_TOP];
    float top_logprobs[K3_EV_MAX_TOP];
} k3_prompt_lp;

typedef struct k3_event {
    k3_event_kind kind;
    int64_t id;    /* the engine's request id (from submit) */
    uint64_t user; /* the request's tag */
    /* TOKEN */
    int32_t token;
    const char *text; /* new text (UTF-8, cut at character boundaries; stop strings held back) */
    size_t n_text;
    float logprob;                  /* log p(token) after the sampler's processing; NAN if off */
    int n_top;                      /* top logprobs (request.logprobs) */
    int32_t top_ids[K3_EV_MAX_TOP]; /* best first */
    float top_logprobs[K3_EV_MAX_TOP];
    const float *logits;        /* keep_logits: [V] the row the token was sampled from */
    const float *prompt_logits; /* all_logits, first TOKEN event (or DONE with max_tokens 0):
                                   [n_prompt_rows, V] */
    int64_t n_prompt_rows;
    const k3_prompt_lp *prompt_lps; /* prompt_logprobs, when prompt_logits would come:
                                       [n_prompt - 1], entry i for prompt token i + 1 */
    /* DONE (text: what was held back for a possible stop string, flushed at the end) */
    k3_stop_kind stop; /* K3_STOP_NONE: length limit (or cancelled) */
    int stop_string;   /* index when stop == K3_STOP_STRING, else -1 */
    int64_t n_prompt;  /* prompt tokens */
    int64_t n_gen;     /* generated tokens */
    double queued_s;   /* seconds from submit until it got a slot (0 while it has none) */
    int64_t n_cached;  /* prompt tokens served from the prefix cache (not run again) */
    /* ERROR */
    const char *error;
    k3_error_kind error_kind;
} k3_event;

/* Rank 0: queue a request. A request that can never run (too long, ids outside the vocabulary,
 * bad sampling parameters) is still accepted: its first step() reports an ERROR event for it, so
 * every outcome arrives as events. *id gets its engine id. */
k3_status k3_engine_submit(k3_engine *e, const k3_request *rq, int64_t *id);
/* Rank 0: end a request; its DONE event (stop = K3_STOP_NONE, n_gen so far) comes next step. */
k3_status k3_engine_cancel(k3_engine *e, int64_t id);
/* Rank 0, while idle (no step for a while, e.g. a server waiting for requests): tell the workers
 * the coordinator is alive. Call it at least every --comm-timeout / 3 (cheap: rate-limited inside;
 * k3_engine_step also beats). A worker that hears nothing from rank 0 for --comm-timeout ends the
 * job naming it, so a stopped coordinator cannot leave the workers waiting forever. */
k3_status k3_engine_heartbeat(k3_engine *e);
/* Rank 0: how long the worker heard from least recently has been silent, and which (*rank; -1
 * and 0 s in a world of one). Workers answer rank 0's heartbeat (k3_comm_beat) while idle, and a
 * step that returns counts as word from every rank, so a stopped worker shows within a few
 * seconds of idling. For a server's /health. */
double k3_engine_silent_s(const k3_engine *e, int *rank);
/* Rank 0: make progress until at least one event is ready or nothing is left to do. The events
 * (and their text, logits and error strings) are valid until the next step. A status other than
 * K3_OK is a fatal fault (k3_engine_abort); a request's own failure is an ERROR event. */
k3_status k3_engine_step(k3_engine *e, const k3_event **events, int *n_events);
/* Rank 0: requests queued + running. */
int k3_engine_pending(const k3_engine *e);
/* Rank 0, for metrics: requests in a slot, requests waiting for one, and the share of the paged
 * cache's blocks reserved by running requests (all lanes; 0..1). */
void k3_engine_load(const k3_engine *e, int *running, int *waiting, double *cache_usage);
/* Rank 0: a step is still in flight though every request may have ended (a step returns with the
 * first lane's events; another lane's logits of that step, and the step times they carry for
 * k3_engine_rank_busy, arrive later). k3_engine_step collects it without waiting for requests. */
bool k3_engine_in_flight(const k3_engine *e);

/* What the run moved and took (rank 0). moe_* are the world's sums, filled by k3_engine_close. */
struct k3_engine_stats {
    int world, pp, ep, micro_batches, max_seqs;
    bool dedicated;
    uint64_t plan_hash;
    int64_t max_ctx, max_batch_tokens;
    int64_t prompt_tokens, gen_tokens, steps;
    /* the prefix cache (as vLLM counts it: prompt tokens of the requests that started, and how
       many of them were found cached), and its blocks now held / at most, over all lanes */
    bool prefix_cache;
    int64_t prefix_queries, prefix_hits;
    int64_t prefix_blocks, prefix_blocks_max, prefix_evictions;
    /* forks (k3_request.fork): made, and run as their own prefill instead */
    int64_t forks, fork_fallbacks;
    int64_t preemptions; /* running requests whose blocks were taken back (recomputed later) */
    /* the paged cache on rank 0's books, all lanes: blocks, and those reserved now by running
       requests and the prefills their forks share (0 once every request ended) */
    int64_t kv_blocks, kv_blocks_reserved;
    /* filled by k3_engine_close: blocks that every stage still held after its slots were
       released, less those the prefix cache holds, summed over the world (0: nothing leaked) */
    int64_t kv_blocks_leaked;
    uint64_t logits_bytes;
    int logits_messages;
    double load_s;       /* the slowest rank's load */
    uint64_t bytes_read; /* checkpoint bytes read by all ranks */
    uint64_t plan_bytes; /* weights the plan assigns to all ranks */
    uint64_t moe_dispatch_bytes, moe_combine_bytes;
    int stages[2 * 64]; /* [s*2], [s*2+1]: layers [begin, end) of stage s (s < 64) */
    double busy_s[256]; /* time in forward steps per rank (rank < 256), at close */
    /* each rank's memory at close (k3_proc_memory: resident, peak, proportional: a node's Pss
       add up to its memory even where ranks share pages) */
    uint64_t rss_bytes[256], hwm_bytes[256], pss_bytes[256];
    int op_stats_rc; /* 0, or 1 when k3_engine_opts.op_stats could not be written (printed) */
};
void k3_engine_get_stats(const k3_engine *e, k3_engine_stats *out);
/* Rank r's (stage, lane) and bytes read, for reports (rank 0; false past the world). */
bool k3_engine_rank_info(const k3_engine *e, int rank, int *stage, int *lane, uint64_t *bytes_read,
                         uint64_t *plan_weight_bytes, double *load_s);
/* Rank 0, live: the seconds worker rank r has spent inside forward steps (its MoE exchanges
 * included) and how many steps, as the LOGITS messages reported them so far (each carries the
 * step time of every stage of its lane). False for a rank that runs no stage or past the world.
 * The pipeline bubble is 1 - busy / wall; k3_engine_close gathers the exact totals into
 * *final's busy_s. */
bool k3_engine_rank_busy(const k3_engine *e, int rank, double *busy_s, uint64_t *steps);
/* Rank 0, live, for the server's status page: where rank r runs and how it is heard. */
typedef struct k3_engine_rank_view {
    int stage, lane;  /* -1: the rank runs no stage (a dedicated coordinator) */
    int node, local;  /* the lowest world rank on its node; its index among that node's ranks */
    const char *host; /* its processor name (valid while the engine is open) */
    double silent_s;  /* since rank 0 last heard from it (0 for rank 0) */
    k3_rank_mem mem;  /* the plan's memory for it (weights, caches, buffers, workspace) */
    uint64_t rss;     /* resident bytes now: rank 0's own (k3_proc_memory); 0 for the others */
} k3_engine_rank_view;
bool k3_engine_rank_view_of(const k3_engine *e, int rank, k3_engine_rank_view *out);

#endif /* K3_ENGINE_H */
