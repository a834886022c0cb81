/* server_internal.h — what server.c (HTTP + the engine loop), openai.c (request parsing and
 * response bodies) and metrics.c share. Not for other modules.
 *
 * Lifetimes. An sreq is made by an HTTP thread (openai.c: parsed, buffers sized by max_tokens),
 * queued for the main thread, and referenced by both (refs): the HTTP thread drops its reference
 * when the response has ended, the main thread when the engine's last event for it arrived (or
 * when it was cancelled before admission). Fields under "shared" are read and written only with
 * the server's mutex held; the rest is fixed before the request is queued, or belongs to the HTTP
 * thread alone. */
#ifndef K3_SERVER_INTERNAL_H
#define K3_SERVER_INTERNAL_H

#include <pthread.h>

#include "chat_job.h"
#include "k3_server.h"

typedef enum sreq_kind { SREQ_CHAT, SREQ_COMPLETION } sreq_kind;

#define SRV_MAX_CHOICES 128 /* choices of one request: prompts x n */

/* One generated token as the HTTP thread needs it. */
typedef struct sreq_tok {
    int32_t id;
    size_t text_end; /* the engine's released text after this token (bytes, cumulative) */
} sreq_tok;

/* A token's logprobs (only when the request asked). */
typedef struct sreq_lp {
    float logprob;
    int n_top;
    int32_t top_ids[K3_EV_MAX_TOP];
    float top_logprobs[K3_EV_MAX_TOP];
} sreq_lp;

typedef struct sreq {
    /* fixed once queued */
    sreq_kind kind;
    struct sreq *sib; /* the next choice of the same HTTP request (n > 1, a prompt list), or NULL;
                         the first choice (the head) stands for the request */
    int index;        /* its choice index: prompt * n + copy, as OpenAI numbers them */
    int prompt_i;     /* completions: which prompt of a list */
    bool sib_copy;    /* a copy after the first of its prompt (n > 1): its prompt is not counted
                         again in the usage */
    struct sreq *fork_src; /* a copy: the first choice of its prompt, whose prefill the engine
                              forks for it (k3_request.fork) */
    bool multi;            /* one of several choices: events also wake the server's multi_cv */
    size_t n_bytes;        /* what it holds while admitted (here and in the engine): the queue's
                              memory bound counts it (srv_request_bytes) */
    bool stream, include_usage, return_token_ids, ignore_eos;
    int n_top;      /* chat: top_logprobs (-1: logprobs off); completions: logprobs (-1: off) */
    bool echo;      /* completions: the prompt (and its logprobs) before the completion */
    bool responses; /* /v1/responses (responses.c): a chat request written as a response */
    k3_chat_json *resp_doc; /* /v1/responses: the original body (echoed settings), owned */
    int plp_top;            /* vLLM's prompt_logprobs (-1: off) */
    k3_prompt_lp *plp; /* [job.n_ids - 1] every prompt token's logprob after the first (echo with
                          logprobs, or prompt_logprobs), filled before the first token arrives */
    k3_job job;
    char id[48];
    int64_t created;
    pthread_cond_t cv;
    /* shared (server mutex) */
    int refs;
    struct sreq *next; /* the admission queue */
    bool submitted, cancel, cancel_sent, done, failed;
    int64_t eng_id;
    sreq_tok *gen; /* (cap_gen) */
    sreq_lp *lp;   /* (cap_gen) or NULL */
    int64_t n_gen, cap_gen;
    char *text; /* (cap_text) the engine's released text */
    size_t n_text, cap_text;
    k3_stop_kind stop;
    int64_t n_prompt;
    int64_t n_cached; /* prompt tokens the prefix cache served (usage.prompt_tokens_details) */
    char error[512];
    k3_error_kind error_kind;
    double t_arrive, t_first, t_done;
    double t_submit; /* handed to the engine */
    double t_last;   /* its last token's arrival (inter-token latency) */
    double queued_s; /* the engine's wait for a slot (k3_event.queued_s) */
    /* the HTTP thread's alone: its stream of this choice (and a copy of the released text) */
    struct srv_stream *st;
    char *text_copy; /* (cap_copy) */
    size_t n_copy, cap_copy;
} sreq;

/* Prometheus histogram with fixed bucket bounds (seconds). */
#define SRV_N_BUCKETS 14
typedef struct srv_hist {
    uint64_t count[SRV_N_BUCKETS + 1]; /* per bucket; the last is +Inf */
    double sum;
    uint64_t n;
} srv_hist;
/* Its buckets' upper bounds in seconds (metrics.c; /metrics and status.c's percentiles); the last
 * bucket (+Inf) is implicit. */
extern const double srv_hist_bounds[SRV_N_BUCKETS];

/* A histogram of counts (tokens, n) with the 1-2-5 bounds vLLM uses for them: 1, 2, 5, 10, ...,
 * 5e5, 1e6 (the last bucket +Inf). */
#define SRV_N_CBUCKETS 19
typedef struct srv_chist {
    uint64_t count[SRV_N_CBUCKETS + 1];
    double sum;
    uint64_t n;
} srv_chist;

#define SRV_N_STATUS  64  /* distinct (endpoint, status) pairs counted */
#define SRV_MAX_RANKS 256 /* ranks whose step time /metrics lists */
typedef struct srv_metrics {
    const char *model_name;                /* the model_name label of every series */
    const char *status_path[SRV_N_STATUS]; /* a static route name ("/v1/models", "other") */
    int status_code[SRV_N_STATUS];
    uint64_t status_count[SRV_N_STATUS];
    /* finished requests (every choice counts; a copy's prompt once, as the usage does): */
    uint64_t prompt_tokens, generation_tokens;              /* completed (stop / length) */
    uint64_t n_stop, n_length, n_cancelled, n_failed;       /* by how they ended */
    uint64_t cancelled_prompt_tokens, cancelled_gen_tokens; /* cancelled: counted apart */
    srv_hist ttft, tpot, itl, e2e, queue, prefill, decode, inference, step;
    /* vLLM's per-request counts: prompt tokens (a prompt once for its n choices) and generated
       tokens of completed choices; per HTTP request once every choice ended: the most tokens
       one of its choices generated, and its n */
    srv_chist prompt_len, gen_len, max_gen, params_n;
    int pending;          /* engine: queued + running (after the last step) */
    int running, waiting; /* engine: in a slot, waiting for one (k3_engine_load) */
    double cache_usage;   /* engine: share of the paged cache's blocks reserved */
    int admitted;         /* requests admitted, not yet done */
    /* per worker rank (k3_engine_rank_busy, copied after each step): forward time, steps */
    int n_ranks;                 /* entries below (world, at most SRV_MAX_RANKS) */
    bool rank_ok[SRV_MAX_RANKS]; /* false: the rank runs no stage (a dedicated coordinator) */
    int rank_stage[SRV_MAX_RANKS], rank_lane[SRV_MAX_RANKS];
    double rank_busy_s[SRV_MAX_RANKS];
    uint64_t rank_steps[SRV_MAX_RANKS];
    /* the prefix cache (k3_engine_stats after each step): on, tokens looked up and found, blocks */
    bool prefix_on;
    int64_t prefix_queries, prefix_hits, prefix_blocks, prefix_blocks_max;
    /* the engine's own: prompt tokens it ran through the model (k3_engine_stats.prompt_tokens:
       prefix-cache hits and the forked copies of n > 1 not counted), forks made */
    int64_t engine_prompt_tokens, forks;
    int64_t preemptions; /* running requests whose cache blocks were taken back (recomputed) */
} srv_metrics;

/* ---- openai.c ----------------------------------------------------------------------------- */
/* Parse a body for `path` into a new sreq (refs 0, buffers allocated). Returns the HTTP status:
 * 200 with *out set, or 4xx with an OpenAI error message in why. */
int srv_parse(const k3_server_opts *o, sreq_kind kind, const char *body, size_t n, sreq **out,
              char *why, size_t n_why);
void srv_sreq_free(sreq *q);       /* NULL-safe */
void srv_sreq_free_chain(sreq *q); /* q and its siblings; NULL-safe */
/* The memory a parsed request holds while admitted: its buffers here, and in the engine its
 * prompt and token copies and its sampler's per-vocabulary arrays (k3_sampler: ~24 bytes an id),
 * its logprob records. An estimate from sizes, used to bound the queue by memory. */
size_t srv_request_bytes(const k3_server_opts *o, const sreq *q, size_t body_bytes);
int srv_n_choices(const sreq *q); /* q and its siblings */
/* The non-streamed response body of a finished request (every choice done, none failed). */
k3_status srv_response(const k3_server_opts *o, const sreq *q, k3_chat_buf *out);

/* Streaming: the HTTP thread's progress through a request. */
typedef struct srv_stream {
    k3_job_feed *feed; /* chat */
    int64_t n_fed;     /* tokens given to the parser (completions: turned into chunks) */
    int64_t n_lp;      /* tokens whose logprobs went out (they ride on the next chunk) */
    size_t text_seen;  /* completions: released text already sent */
    bool role_sent, end_sent;
    bool echo_sent;         /* completions with echo: the prompt went out (the first chunk) */
    int64_t echo_base;      /* its text's bytes: the completion's text offsets start there */
    struct srv_rstream *rs; /* /v1/responses: its items and events (responses.c) */
} srv_stream;
/* Append the SSE events for tokens [st->n_fed, n_gen) (a snapshot of q's shared fields taken
 * under the mutex: toks, lps, text) and, when `done`, the finish chunk, the usage chunk and
 * `data: [DONE]`. */
typedef struct srv_snapshot {
    const sreq_tok *toks;
    const sreq_lp *lps;
    int64_t n_gen;
    const char *text; /* (n_text) the released text (a copy the HTTP thread owns) */
    size_t n_text;
    bool done, failed;
    k3_stop_kind stop;
    int64_t n_prompt;
    const char *error;
} srv_snapshot;
k3_status srv_stream_chunks(const k3_server_opts *o, const sreq *q, srv_stream *st,
                            const srv_snapshot *s, k3_chat_buf *out);
/* The end of a stream once every choice is done: the error of the first failed choice, or the
 * usage chunk (summed over the choices) when asked; then `data: [DONE]`. */
k3_status srv_stream_end(const k3_server_opts *o, const sreq *head, k3_chat_buf *out);
void srv_stream_free(srv_stream *st);
/* Feed tokens [st->n_fed, s->n_gen) of a chat choice to its parser (and end it when s->done). */
k3_status srv_feed_chat(const sreq *q, srv_stream *st, const srv_snapshot *s,
                        const k3_tokenizer *tok);

/* ---- offline.c: the request path without HTTP (also server.c's) --------------------------- */
/* The engine request of a choice (its tag: the sreq; a copy of n > 1 forks its prompt's first
 * choice when that one is submitted and running). */
void srv_engine_request(const sreq *q, k3_request *rq);
/* One engine event into q's buffers: text, token, logprobs, prompt logprobs, the end. */
k3_status srv_take_event(sreq *q, const k3_event *ev);
/* A failed choice's status: 400 (the request's fault: the engine's request, context or
 * sampling error) or 500. */
int srv_failed_status(const sreq *q);

/* ---- responses.c: POST /v1/responses ------------------------------------------------------ */
typedef struct srv_rstream srv_rstream;
/* A Responses body -> a chat sreq (responses set, resp_doc owned), or 4xx with why. */
int srv_responses_parse(const k3_server_opts *o, const char *body, size_t n, sreq **out, char *why,
                        size_t n_why);
k3_status srv_responses_body(const k3_server_opts *o, const sreq *q, k3_chat_buf *out);
k3_status srv_responses_chunks(const k3_server_opts *o, const sreq *q, srv_stream *st,
                               const srv_snapshot *s, k3_chat_buf *out);
k3_status srv_responses_end(const k3_server_opts *o, const sreq *q, k3_chat_buf *out);
void srv_responses_stream_free(srv_rstream *rs); /* NULL-safe */

/* "message (file.c:123)" -> "message" (in place): errors are for clients, not for a debugger. */
void srv_strip_where(char *s);
/* {"error": {"message", "type", "param": null, "code"}} for an HTTP status. */
k3_status srv_error_json(int status, const char *message, k3_chat_buf *out);
/* GET /tokenizer_info and /version (vLLM's): the body for `path`. */
k3_status srv_info_json(const k3_server_opts *o, const char *path, k3_chat_buf *out);
/* GET /v1/models (the list), or with `one` GET /v1/models/{id} (the model object alone) */
k3_status srv_models_json(const k3_server_opts *o, int64_t created, bool one, k3_chat_buf *out);
/* POST /tokenize and /detokenize: the status and the body (a result or an error object). */
int srv_tokenize(const k3_server_opts *o, const char *body, size_t n, k3_chat_buf *out);
int srv_detokenize(const k3_server_opts *o, const char *body, size_t n, k3_chat_buf *out);

/* ---- metrics.c ---------------------------------------------------------------------------- */
void srv_hist_add(srv_hist *h, double seconds);
/* mu held: a request's end into the counters and histograms (completed, cancelled or failed). */
void srv_metrics_done(srv_metrics *m, const sreq *q);
/* mu held, by the HTTP thread that still holds every choice: once all of them have ended, the
 * request's most generated tokens among its choices and its n (choices per prompt). */
void srv_metrics_request(srv_metrics *m, const sreq *head);
/* `path`: a string that outlives the metrics (the route table's, or "other"). */
void srv_count_status(srv_metrics *m, const char *path, int status);
/* Prometheus text exposition (format 0.0.4) of a snapshot of the metrics. */
k3_status srv_metrics_text(const srv_metrics *m, int slots, k3_chat_buf *out);

/* ---- status.c: GET /v1/k3/status (the page's data) --------------------------------------- */
#define SRV_STATUS_N      600 /* samples kept, one a second: the last 10 minutes */
#define SRV_STATUS_WINDOW 10  /* seconds of requests that a sample's latency percentiles cover */
typedef struct srv_sample {
    double t; /* seconds since the server started */
    double running, waiting, tok_s, kv, prefix;
    double ttft[3], itl[3]; /* p50, p90, p99 over the window (NAN: none in it) */
} srv_sample;
typedef struct srv_rank_status {
    int stage, lane, node, local; /* stage -1: no stage (a dedicated coordinator) */
    char host[48];
    double silent_s;
    uint64_t mem_weights, mem_caches, mem_buffers, mem_workspace; /* the plan's */
    uint64_t rss; /* resident bytes (rank 0's own; 0 for the others: not known live) */
} srv_rank_status;
typedef struct srv_status {
    double t_start, t_tick;
    int world, pp, ep, max_seqs, n_ranks;
    bool dedicated;
    int64_t max_ctx, gen_last;
    srv_rank_status ranks[SRV_MAX_RANKS];
    srv_hist ttft_snap[SRV_STATUS_WINDOW + 1], itl_snap[SRV_STATUS_WINDOW + 1];
    int64_t n_snap, n_ring;
    srv_sample ring[SRV_STATUS_N];
} srv_status;
/* The cluster as the engine knows it (k3_server_run's start, mu held). */
void srv_status_init(srv_status *st, const k3_engine *e, double now);
/* mu held, from the engine loop: every rank's silence now, and a sample once a second. */
void srv_status_tick(srv_status *st, const srv_metrics *m, const k3_engine *e, double now);
/* The JSON body of GET /v1/k3/status from a snapshot (taken under mu). */
k3_status srv_status_json(const srv_status *st, const srv_metrics *m, const k3_server_opts *o,
                          bool engine_down, double silent_limit, double now, k3_chat_buf *out);

/* ---- the page at / and /ui: server/ui/index.html as a C array (server/ui/embed.cmake) ---- */
extern const char k3_ui_html[];
extern const unsigned long k3_ui_html_len;

#endif /* K3_SERVER_INTERNAL_H */
