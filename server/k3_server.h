/* k3_server — the OpenAI-compatible HTTP server of `k3 serve`, on rank 0 (libmicrohttpd).
 *
 * Owns: the HTTP daemon (its threads, one per connection), the routes (/v1/chat/completions,
 * /v1/completions, /v1/models, /health, /tokenize, /detokenize, /metrics; the status page at / and
 * /ui with its data at /v1/k3/status: server/status.c, server/ui/index.html), the bearer check, the
 * limits (body bytes, message count, context, queue), OpenAI-style error objects, the SSE stream,
 * the Prometheus metrics and the access log.
 * Does not own: generation (rank/k3_engine.h), the OpenAI chat request <-> generation job layer
 * (client/chat_job.h, shared with `k3 run --chat` and `k3 batch`), the flags
 * (launcher/cmd_serve.c), MPI.
 *
 * Threads. The HTTP threads parse, render and tokenize a request (the tokenizer is thread-safe),
 * then hand it to rank 0's main thread through a mutex-guarded queue; only the main thread
 * (k3_server_run) calls the engine, so no MPI call ever happens on an HTTP thread. Events go back
 * into per-request buffers (allocated at admission, sized by max_tokens) and wake the request's
 * thread, which writes the response or the SSE chunks. A client that goes away (a failed write,
 * or its socket closed while it waits) cancels its request, which frees its slot.
 * Callers must not: call k3_server_run from a thread other than the one that steps the engine. */
#ifndef K3_SERVER_H
#define K3_SERVER_H

#include <signal.h>

#include "k3_chat.h"
#include "k3_engine.h"
#include "k3_tokenizer.h"

typedef struct k3_server k3_server;

typedef struct k3_server_opts {
    const char *host; /* numeric IPv4/IPv6 address to bind; NULL = 127.0.0.1 */
    int port;         /* 0 = any free port (k3_server_port says which) */
    int listen_fd; /* > 0: a socket already bound to host:port (k3 serve binds it before the model
                      loads); k3_server_create listens on it and owns it. 0: bind here */
    const char *api_key;    /* NULL or "": no auth; else `Authorization: Bearer KEY` on /v1/ routes,
                               /tokenize and /detokenize (checked in constant time) */
    const char *model_name; /* the id in /v1/models and in every response */
    const k3_tokenizer *tok;
    int64_t n_vocab;            /* the model's vocab_size (logit_bias and prompt ids below it) */
    int64_t max_ctx;            /* the engine's tokens per sequence: prompt + max_tokens */
    int slots;                  /* sequence slots of all lanes (metrics: running vs waiting) */
    size_t max_body_bytes;      /* a longer body is refused with 413 (0 = 4 MiB) */
    int max_messages;           /* messages per chat request (0 = 2048) */
    int max_queue;              /* requests admitted (running + waiting); more get 429 (0: no
                                   limit by count: max_queue_bytes bounds the queue) */
    size_t max_queue_bytes;     /* memory the admitted requests may hold (their buffers here and
                                   in the engine: ids, tokens, sampler state, logprobs); a request
                                   past it gets 429 (0 = 1 GiB) */
    int max_connections;        /* open connections (0 = 1024) */
    double idle_timeout_s;      /* a connection moving no bytes this long is closed (0 = 30) */
    double header_timeout_s;    /* a request's headers must all come within this (0 = 10) */
    double grace_s;             /* at shutdown: in-flight requests may finish this long (0 = 10) */
    const char *tokenizer_info; /* GET /tokenizer_info (vLLM's): the model's tokenizer_config.json
                                   text, or NULL (then eos / bos from the tokenizer) */
    const char *version;        /* GET /version: {"version": ...}; NULL = "unknown" */

    k3_grammar_cache *grammars; /* structured outputs (client/chat_job.h k3_job_grammar) */
    /* issue 34: slow or browser clients */
    int max_per_client;          /* open connections from one client address (0 = 32) */
    const char *allowed_origins; /* CORS: comma-separated origins or "*"; NULL = no CORS */
    /* issue 48: the status page (GET /v1/k3/status) names them */
    const char *backend; /* the engine's kernel backend; NULL = "cpu" */
    const char *comm;    /* its transport between ranks; NULL = "mpi" */
} k3_server_opts;

/* Bind and start the HTTP threads. Requests are queued until k3_server_run steps the engine. */
k3_status k3_server_create(const k3_server_opts *o, k3_server **out);
int k3_server_port(const k3_server *s);
/* Rank 0's main thread: admit queued requests into the engine, step it, route its events, until
 * *stop becomes non-zero (a signal handler sets it); then stop accepting, let in-flight requests
 * finish within grace_s, cancel the rest and return once every response has ended. The engine is
 * still open afterwards (the caller closes it). */
/* *stop: 1 = stop gracefully (SIGINT/SIGTERM); K3_SERVER_PEER_LOST = mpirun's SIGTERM after a
 * rank died: every open request gets its error at once, then the process ends by SIGTERM. */
#define K3_SERVER_PEER_LOST 2
k3_status k3_server_run(k3_server *s, k3_engine *e, volatile sig_atomic_t *stop);
void k3_server_destroy(k3_server *s); /* NULL-safe; stops the daemon */

/* The request parser alone, as the HTTP threads run it on a body (the fuzz target drives it):
 * path ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize") + body -> 200 when
 * the request would be admitted, else the HTTP status (400, 404, 413) with the error message in
 * why. Needs no engine; o->tok may be a small vocabulary. */
int k3_server_check_request(const k3_server_opts *o, const char *path, const char *body,
                            size_t n_bytes, char *why, size_t n_why);

/* One request through serve's path without HTTP (`k3 batch`, server/offline.c): the same
 * parser (n, prompt lists, echo, logprobs, every refusal), the same engine requests (a copy of
 * n > 1 forks its prompt's prefill), the same response or error body. Only "stream": true is
 * refused here (one body a request). */
typedef struct sreq k3_server_req;
typedef struct k3_server_req_opts {
    uint64_t seed;      /* the seed of a request that sets none (choice copy c: seed + c) */
    uint64_t id;        /* the response's id: "chatcmpl-" / "cmpl-" + 16 hex digits of it */
    int64_t max_tokens; /* > 0: max_tokens of a request that sets none (else serve's default) */
} k3_server_req_opts;
/* path ("/v1/chat/completions" or "/v1/completions") + body -> 200 and *out, or the HTTP status
 * serve answers with its error body ({"error": {...}}) in err. */
int k3_server_req_parse(const k3_server_opts *o, const char *path, const char *body, size_t n,
                        const k3_server_req_opts *ro, k3_server_req **out, k3_chat_buf *err);
int k3_server_req_choices(const k3_server_req *r);
/* Submit choice i, in order (a copy forks the first choice of its prompt); its events carry
 * `user`. An engine refusal fails that choice alone. */
k3_status k3_server_req_submit(k3_server_req *r, int i, k3_engine *e, uint64_t user);
/* An engine event of choice i; *all_done once every choice has ended. */
k3_status k3_server_req_event(k3_server_req *r, int i, const k3_event *ev, bool *all_done);
/* Every choice ended: 200 and serve's response body, or the status and error body serve answers
 * (the first failed choice's). *n_prompt, *n_gen: the usage's counts. */
int k3_server_req_response(const k3_server_opts *o, const k3_server_req *r, k3_chat_buf *out,
                           int64_t *n_prompt, int64_t *n_gen);
void k3_server_req_free(k3_server_req *r); /* NULL-safe */

#endif /* K3_SERVER_H */
