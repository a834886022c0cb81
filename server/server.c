/* server.c — the HTTP side of `k3 serve` (libmicrohttpd, one thread per connection) and rank 0's
 * engine loop (k3_server_run), joined by a mutex-guarded admission queue (see k3_server.h).
 *
 * Owns: routing, the bearer check, the body limit, admission (bounded by memory: 429 +
 * Retry-After when the admitted requests would hold more than max_queue_bytes, or when a
 * configured max_queue count is reached; 503 while shutting down), the waits of the HTTP threads (a
 * non-streamed request waits for its DONE; a stream's content reader waits for the next tokens),
 * client-disconnect detection (a failed write, or a peek on the socket every 200 ms of waiting:
 * the request is cancelled and its slot freed), the access log, the metrics counters and the
 * shutdown sequence (quiesce, grace, cancel, wait for the responses to end).
 * Invariants: only the thread in k3_server_run calls the engine; an sreq's token and logprob
 * arrays never move (sized by max_tokens at admission), so an HTTP thread reads entries below
 * n_gen without the lock; the released text may move (grown by the main thread) and is copied
 * under the lock. */
#include "k3_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <signal.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server_internal.h"

#define WAIT_SLICE_S   0.2  /* how often a waiting HTTP thread looks at its client's socket */
#define KEEP_ALIVE_MAX 10.0 /* the longest a stream stays silent (keep_alive_s) */
#define HALF_CLOSE_S   0.5  /* a FIN this soon after the request is a half-close, later a close */
#define STUCK_CLIENT_S 10   /* at shutdown, after the grace: how long responses may take to drain */
#define FAULT_DRAIN_S  3    /* after an engine fault: how long the open requests' errors may take */
#define PEER_LOST_DRAIN_S                                                                          \
    0.5 /* after mpirun's SIGTERM (a rank died): the errors' time, inside mpirun's grace */
#define HEALTH_SILENT_S                                                                            \
    5 /* /health: a rank unheard this long is down (idle workers answer 1 s beats) */

struct k3_server {
    k3_server_opts o;
    struct MHD_Daemon *d;
    int port;
    size_t max_body;
    int max_queue;          /* 0: no limit by count */
    size_t max_queue_bytes; /* the admitted requests' memory (sreq.n_bytes summed) */
    uint64_t nonce, counter;
    int64_t started;
    pthread_mutex_t mu;
    pthread_cond_t work;     /* the main thread waits here for requests */
    pthread_cond_t multi_cv; /* HTTP threads of requests with several choices wait here */
    /* under mu */
    sreq *head, *tail; /* admission queue */
    sreq **live;       /* (cap_live) submitted, waiting for their last event */
    int n_live, cap_live;
    size_t queued_bytes; /* sreq.n_bytes of the admitted requests */
    bool stopping;
    bool engine_down; /* the engine failed: open requests end with 503 */
    double silent_s;  /* the worker heard from least recently: silent this long (/health) */
    int silent_rank;
    int n_busy; /* connections with a model request whose response has not ended */
    srv_metrics m;
    srv_status status;                /* GET /v1/k3/status (status.c) */
    volatile sig_atomic_t *stop_flag; /* k3_server_run's */
    volatile bool watch_end;          /* the peer watcher ends */
    /* open connections per client address (under amu): see on_accept */
    pthread_mutex_t amu;
    struct srv_addr *addrs; /* (ADDR_SLOTS) */
    unsigned n_conn, limit, per_client;
    struct hdr_watch *watched; /* open connections, for the header deadline (under amu) */
    double t_scan;             /* the peer watcher's last scan of them */
};

/* ---- connections per address ------------------------------------------------------------------
 */
#define ADDR_SLOTS    4096
#define NEW_ADDR_ROOM 64 /* the last connections of the cap: only for addresses that hold few */
#define FEW_CONNS     4

typedef struct srv_addr {
    uint8_t key[17]; /* 4 or 6, then the address; 0: empty */
    unsigned n;
} srv_addr;

static bool addr_key(const struct sockaddr *a, uint8_t key[17]) {
    memset(key, 0, 17);
    if (a && a->sa_family == AF_INET) {
        key[0] = 4;
        memcpy(key + 1, &((const struct sockaddr_in *)a)->sin_addr, 4);
        return true;
    }
    if (a && a->sa_family == AF_INET6) {
        const uint8_t *b = ((const struct sockaddr_in6 *)a)->sin6_addr.s6_addr;
        static const uint8_t V4MAPPED[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (!memcmp(b, V4MAPPED, 12)) {
            key[0] = 4;
            memcpy(key + 1, b + 12, 4);
        } else {
            key[0] = 6;
            memcpy(key + 1, b, 16);
        }
        return true;
    }
    return false;
}

/* amu held: the address's slot (insert: a free one when it has none; NULL when the table is
 * full of addresses that hold connections). */
static srv_addr *addr_slot(k3_server *s, const uint8_t key[17], bool insert) {
    size_t h = (size_t)k3_hash_bytes(key, 17, K3_HASH_INIT) % ADDR_SLOTS;
    srv_addr *free_slot = NULL;
    for (size_t i = 0; i < ADDR_SLOTS; i++) {
        srv_addr *a = &s->addrs[(h + i) % ADDR_SLOTS];
        if (!memcmp(a->key, key, 17)) return a;
        if (!free_slot && a->n == 0) free_slot = a;
        if (!a->key[0]) break; /* never used: the address is not further on */
    }
    if (insert && free_slot) memcpy(free_slot->key, key, 17);
    return insert ? free_slot : NULL;
}

/* A new connection: refused when its address holds --max-connections-per-client, or when the
 * cap is nearly full and the address already holds more than a few (the last NEW_ADDR_ROOM
 * connections are kept for new addresses, so a few addresses cannot take them all: /health from
 * another one still gets through). */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t len) {
    (void)len;
    k3_server *s = cls;
    uint8_t key[17];
    if (!addr_key(addr, key)) return MHD_YES;
    pthread_mutex_lock(&s->amu);
    const srv_addr *a = addr_slot(s, key, false);
    const unsigned held = a ? a->n : 0;
    const bool ok =
        held < s->per_client && (s->n_conn + NEW_ADDR_ROOM < s->limit || held < FEW_CONNS);
    pthread_mutex_unlock(&s->amu);
    return ok ? MHD_YES : MHD_NO;
}

/* ---- the header deadline (--header-timeout) -------------------------------------------------
 * MHD's timeout is per read: a client that sends one header line a little more often than
 * --read-timeout would hold its connection forever. Each connection must deliver a request's
 * headers within --header-timeout of its opening (or of its previous response's end, on a
 * keep-alive connection); the peer watcher shuts the socket of one that does not, and MHD closes
 * it. A request's body and its response are --read-timeout's. */
typedef struct hdr_watch {
    MHD_socket fd;
    double since; /* waiting for headers since then; < 0: a request is being served */
    bool cut;     /* shut down: MHD closes it */
    struct hdr_watch *prev, *next;
} hdr_watch;

static double header_s(const k3_server *s) {
    return s->o.header_timeout_s > 0 ? s->o.header_timeout_s : 10;
}

/* The connection's headers came (since < 0) or its response ended (since = now). */
static void hdr_mark(k3_server *s, struct MHD_Connection *c, double since) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    hdr_watch *w = ci ? ci->socket_context : NULL;
    if (!w) return;
    pthread_mutex_lock(&s->amu);
    w->since = since;
    pthread_mutex_unlock(&s->amu);
}

/* The peer watcher, every HDR_SCAN_S: shut the connections past the deadline. Under amu, so a
 * connection's fd is not shut after MHD's CLOSED notification (it may be reused then). */
#define HDR_SCAN_S 0.25
static void hdr_scan(k3_server *s) {
    const double now = k3_now_s();
    if (now - s->t_scan < HDR_SCAN_S) return;
    s->t_scan = now;
    pthread_mutex_lock(&s->amu);
    for (hdr_watch *w = s->watched; w; w = w->next)
        if (!w->cut && w->since >= 0 && now - w->since > header_s(s)) {
            shutdown(w->fd, SHUT_RDWR);
            w->cut = true;
        }
    pthread_mutex_unlock(&s->amu);
}

static void hdr_track(k3_server *s, struct MHD_Connection *c, void **socket_ctx,
                      enum MHD_ConnectionNotificationCode code) {
    hdr_watch *w = *socket_ctx;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *fi =
            MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (!fi || k3_calloc((void **)&w, sizeof *w, "connection watch") != K3_OK) return;
        w->fd = fi->connect_fd, w->since = k3_now_s();
        pthread_mutex_lock(&s->amu);
        w->next = s->watched;
        if (w->next) w->next->prev = w;
        s->watched = w;
        pthread_mutex_unlock(&s->amu);
        *socket_ctx = w;
    } else if (w) {
        pthread_mutex_lock(&s->amu);
        if (w->prev) w->prev->next = w->next;
        if (w->next) w->next->prev = w->prev;
        if (s->watched == w) s->watched = w->next;
        pthread_mutex_unlock(&s->amu);
        k3_free(w);
        *socket_ctx = NULL;
    }
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_ctx,
                          enum MHD_ConnectionNotificationCode code) {
    k3_server *s = cls;
    hdr_track(s, c, socket_ctx, code);
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    uint8_t key[17];
    if (!ci || !addr_key(ci->client_addr, key)) return;
    pthread_mutex_lock(&s->amu);
    srv_addr *a = addr_slot(s, key, code == MHD_CONNECTION_NOTIFY_STARTED);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        if (a) a->n++;
        s->n_conn++;
    } else {
        if (a && a->n) a->n--;
        if (s->n_conn) s->n_conn--;
    }
    pthread_mutex_unlock(&s->amu);
}

/* One HTTP request (MHD's per-request pointer). */
typedef struct conn {
    k3_server *s;
    struct MHD_Connection *c;
    char method[8], path[256];
    char *body; /* (cap) */
    size_t n, cap;
    int status; /* a refusal decided while the body arrives (400, 401, 413), else 0 */
    bool close; /* answer, then close the connection (ambiguous framing) */
    double t0;
    sreq *q;          /* a model request (chat / completion), or NULL */
    int64_t n_prompt; /* for the access log */
    k3_chat_buf out;  /* streaming: bytes not yet handed to MHD */
    size_t out_off;
    bool end_sent;    /* streaming: the end of the stream went out */
    double t_sent;    /* streaming: when read_stream last gave MHD bytes (keep_alive_s) */
    bool half_closed; /* the client's FIN came with its request (it shut its write side, and still
                         reads the answer): only a reset means it left */
    double t_request; /* the whole request was read (its FIN within HALF_CLOSE_S: a half-close) */
} conn;

/* The client is gone: an error (a reset) on a non-blocking peek, or a FIN that came later than
 * HALF_CLOSE_S after its request (a client that closes, as a client timeout does). A client that
 * half-closes (sends its request, then shuts its write side, as curl and proxies may) has its FIN
 * there with the request: half_closed, and it still gets its answer. (The two send the same
 * FIN; only its timing tells them apart.) */
static int peek_client(struct MHD_Connection *c);
static bool client_gone(conn *k) {
    int p = peek_client(k->c);
    if (p == 1 && !k->half_closed && k3_now_s() - k->t_request < HALF_CLOSE_S)
        k->half_closed = true; /* the FIN came with the request: it still reads the answer */
    return p == 2 || (p == 1 && !k->half_closed);
}

/* ---- helpers --------------------------------------------------------------------------------- */
static const struct {
    const char *path;
    char method; /* 'G' GET (and HEAD), 'P' POST */
} routes[] = {{"/health", 'G'},
              {"/v1/models", 'G'},
              {"/metrics", 'G'},
              {"/tokenizer_info", 'G'},
              {"/version", 'G'},
              {"/tokenize", 'P'},
              {"/detokenize", 'P'},
              {"/v1/completions", 'P'},
              {"/v1/chat/completions", 'P'},
              {"/", 'G'},
              {"/ui", 'G'},
              {"/v1/k3/status", 'G'},
              {"/v1/responses", 'P'},
              {"/ping", 'G'},
              {"/v1/models/{id}", 'G'}};

/* GET /v1/models/{id}: the route's own entry */
static bool model_path(const char *path) {
    return strncmp(path, "/v1/models/", 11) == 0 && path[11];
}

/* Which method a path takes, or 0 for no such path. */
static char route_method(const char *path) {
    if (model_path(path)) return 'G';
    for (size_t i = 0; i < K3_ARRAY_LEN(routes); i++)
        if (strcmp(path, routes[i].path) == 0) return routes[i].method;
    return 0;
}

/* The route's own (static) name for the metrics; "other" for any other path. */
static const char *route_name(const char *path) {
    if (model_path(path)) return "/v1/models/{id}";
    for (size_t i = 0; i < K3_ARRAY_LEN(routes); i++)
        if (strcmp(path, routes[i].path) == 0) return routes[i].path;
    return "other";
}

static void timed_wait(pthread_cond_t *cv, pthread_mutex_t *mu, double seconds) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double ns = (double)ts.tv_nsec + seconds * 1e9;
    ts.tv_sec += (time_t)(ns / 1e9);
    ts.tv_nsec = (long)(ns - (double)(time_t)(ns / 1e9) * 1e9);
    pthread_cond_timedwait(cv, mu, &ts);
}

/* The client's socket: 0 open (nothing, or more bytes to read), 1 EOF (a FIN), 2 an error. */
static int peek_client(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return 0;
    char b;
    ssize_t r = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r == 0) return 1;
    return r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR ? 2 : 0;
}

/* CORS (--allowed-origins, off by default): the request's Origin when the list names it (or
 * holds "*"), else NULL. The list is comma-separated exact origins. */
static const char *cors_origin(const k3_server *s, struct MHD_Connection *c) {
    const char *list = s->o.allowed_origins;
    const char *org = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    if (!list || !*list || !org) return NULL;
    const size_t n = strlen(org);
    for (const char *p = list; *p;) {
        const size_t k = strcspn(p, ",");
        if ((k == 1 && *p == '*') || (k == n && strncmp(p, org, n) == 0)) return org;
        p += k + (p[k] == ',');
    }
    return NULL;
}

static void add_cors(const k3_server *s, struct MHD_Connection *c, struct MHD_Response *r) {
    const char *org = cors_origin(s, c);
    if (!org) return;
    MHD_add_response_header(r, "Access-Control-Allow-Origin", org);
    MHD_add_response_header(r, "Vary", "Origin");
}

/* Request framing that a proxy in front could read differently (request smuggling): a body
 * framed both by Content-Length and Transfer-Encoding, two Content-Length headers, or any
 * Transfer-Encoding: libmicrohttpd 0.9.75 takes bare-LF chunk lines and cannot be made strict
 * about them, so a body must come with one Content-Length (what OpenAI clients, curl and browsers
 * send). */
typedef struct framing {
    int n_length, n_transfer;
} framing;

static enum MHD_Result count_framing(void *cls, enum MHD_ValueKind kind, const char *key,
                                     const char *value) {
    framing *f = cls;
    (void)kind, (void)value;
    f->n_length += strcasecmp(key, "Content-Length") == 0;
    f->n_transfer += strcasecmp(key, "Transfer-Encoding") == 0;
    return MHD_YES;
}

static const char *framing_error(struct MHD_Connection *c) {
    framing f = {0};
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_framing, &f);
    if (f.n_length > 1 || (f.n_length && f.n_transfer))
        return "the request's body length is ambiguous (Content-Length twice, or with "
               "Transfer-Encoding)";
    if (f.n_transfer)
        return "Transfer-Encoding (chunked) request bodies are not accepted: send Content-Length";
    return NULL;
}

/* Equal without an early exit: the time does not depend on where the strings differ. */
static bool same_secret(const char *given, size_t n_given, const char *key) {
    size_t n_key = strlen(key);
    unsigned diff = (unsigned)(n_given != n_key);
    for (size_t i = 0; i < n_key; i++)
        diff |=
            (unsigned)(unsigned char)key[i] ^ (unsigned)(unsigned char)(i < n_given ? given[i] : 0);
    return diff == 0;
}

static bool authorized(const k3_server *s, struct MHD_Connection *c) {
    if (!s->o.api_key || !*s->o.api_key) return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return false;
    h += 7;
    while (*h == ' ') h++;
    return same_secret(h, strlen(h), s->o.api_key);
}

static void count_status(k3_server *s, const char *path, int status) {
    pthread_mutex_lock(&s->mu);
    srv_count_status(&s->m, route_name(path), status);
    pthread_mutex_unlock(&s->mu);
}

static enum MHD_Result send_body(conn *k, int status, const char *type, const char *body,
                                 size_t n) {
    struct MHD_Response *r =
        MHD_create_response_from_buffer(n, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (status == 429) MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, "1");
    if (status == 401) MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (k->close) MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    add_cors(k->s, k->c, r);
    enum MHD_Result ret = MHD_queue_response(k->c, (unsigned)status, r);
    MHD_destroy_response(r);
    k->status = status;
    count_status(k->s, k->path, status);
    return ret;
}

static enum MHD_Result send_json(conn *k, int status, const k3_chat_buf *b) {
    return send_body(k, status, "application/json", b->p ? b->p : "", b->n);
}

static enum MHD_Result send_error(conn *k, int status, const char *msg) {
    k3_chat_buf b = {0};
    if (srv_error_json(status, msg, &b) != K3_OK) {
        k3_chat_buf_free(&b);
        return MHD_NO;
    }
    enum MHD_Result r = send_json(k, status, &b);
    k3_chat_buf_free(&b);
    return r;
}

/* ---- requests and the main thread ------------------------------------------------------------ */
/* Drop one reference (mu held); frees the request at zero. */
static void unref(sreq *q) {
    if (--q->refs == 0) srv_sreq_free(q);
}

/* Hand a parsed request to the main thread. 200, or 429 / 503 when it is refused. */
static int admit(k3_server *s, sreq *head, double t_arrive) {
    pthread_mutex_lock(&s->mu);
    const int n = srv_n_choices(head);
    size_t bytes = 0;
    for (const sreq *q = head; q; q = q->sib) bytes += q->n_bytes;
    int st = s->stopping ? 503
             : (s->max_queue > 0 && n > s->max_queue) || bytes > s->max_queue_bytes
                 ? 413 /* never admitted, however long the client waits */
             : s->max_queue > 0 && s->m.admitted + n > s->max_queue ? 429
             : s->queued_bytes + bytes > s->max_queue_bytes         ? 429
                                                                    : 200;
    if (st == 200) {
        uint64_t h = k3_hash_bytes(&s->counter, sizeof s->counter, s->nonce);
        s->counter++;
        for (sreq *q = head; q; q = q->sib) { /* every choice is a request of the engine (the
                                                 copies of n > 1 fork their prompt's prefill) */
            snprintf(q->id, sizeof q->id, "%s%016llx",
                     q->responses           ? "resp_"
                     : q->kind == SREQ_CHAT ? "chatcmpl-"
                                            : "cmpl-",
                     (unsigned long long)h);
            q->created = (int64_t)time(NULL);
            q->t_arrive = t_arrive; /* the request's arrival: TTFT counts its parse and compile */
            q->refs = 2;
            if (s->tail)
                s->tail->next = q;
            else
                s->head = q;
            s->tail = q;
            s->m.admitted++;
        }
        s->queued_bytes += bytes;
        s->n_busy++;
        pthread_cond_signal(&s->work);
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* mu held: the request's last event (or its cancellation before admission). */
static void finish(k3_server *s, sreq *q) {
    q->done = true;
    q->t_done = k3_now_s();
    s->m.admitted--;
    s->queued_bytes -= q->n_bytes;
    srv_metrics_done(&s->m, q);
    pthread_cond_broadcast(q->multi ? &s->multi_cv : &q->cv);
    unref(q);
}

/* mu held: the prefix cache's counters for /metrics, from the engine's totals. */
static void prefix_counters(const k3_engine *e, srv_metrics *m) {
    k3_engine_stats es;
    k3_engine_get_stats(e, &es);
    m->prefix_on = es.prefix_cache;
    m->prefix_queries = es.prefix_queries, m->prefix_hits = es.prefix_hits;
    m->prefix_blocks = es.prefix_blocks, m->prefix_blocks_max = es.prefix_blocks_max;
    m->engine_prompt_tokens = es.prompt_tokens, m->forks = es.forks;
    m->preemptions = es.preemptions;
}

/* mu held: one engine event into its request's buffers (offline.c srv_take_event). */
static k3_status route(k3_server *s, const k3_event *ev) {
    sreq *q = (sreq *)(uintptr_t)ev->user;
    if (ev->kind == K3_EV_TOKEN) {
        const double now = k3_now_s();
        if (q->n_gen == 0) q->t_first = now;
        if (q->n_gen > 0) srv_hist_add(&s->m.itl, now - q->t_last);
        q->t_last = now;
    }
    K3_TRY(srv_take_event(q, ev));
    if (ev->kind == K3_EV_TOKEN) {
        pthread_cond_broadcast(q->multi ? &s->multi_cv : &q->cv);
        return K3_OK;
    }
    for (int i = 0; i < s->n_live; i++)
        if (s->live[i] == q) s->live[i] = s->live[--s->n_live];
    finish(s, q);
    return K3_OK;
}

/* mu held: queued requests into the engine; cancellations out of it. */
static k3_status admit_and_cancel(k3_server *s, k3_engine *e, bool cancel_all) {
    sreq *q;
    while ((q = s->head)) {
        s->head = q->next;
        if (!s->head) s->tail = NULL;
        q->next = NULL;
        if (q->cancel || cancel_all) {
            finish(s, q); /* never reached the engine: stop NONE, no tokens */
            continue;
        }
        if (s->n_live == s->cap_live) { /* grows with the queue, which memory bounds */
            int cap = s->cap_live ? 2 * s->cap_live : 256;
            sreq **l = realloc(s->live, (size_t)cap * sizeof *l);
            if (!l) return K3_ERR(K3_ERR_NOMEM, "table of %d live requests", cap);
            s->live = l, s->cap_live = cap;
        }
        k3_request rq;
        srv_engine_request(q, &rq); /* a copy of n > 1 forks its prompt's prefill */
        if (k3_engine_submit(e, &rq, &q->eng_id) != K3_OK) { /* this request alone fails */
            q->failed = true;
            q->error_kind = 0; /* not the request's fault: 500 */
            snprintf(q->error, sizeof q->error, "the engine refused the request: %s",
                     k3_last_error());
            finish(s, q);
            continue;
        }
        q->submitted = true;
        q->t_submit = k3_now_s();
        s->live[s->n_live++] = q;
    }
    for (int i = 0; i < s->n_live; i++) {
        q = s->live[i];
        if ((q->cancel || cancel_all) && !q->cancel_sent) {
            K3_TRY(k3_engine_cancel(e, q->eng_id));
            q->cancel_sent = true;
        }
    }
    return K3_OK;
}

/* mu held: every open request ends with `why` (a 503, or an SSE error event and [DONE]); the
 * HTTP threads get up to drain_s to write them (the job ends after this). */
static void fail_open(k3_server *s, const char *why, double drain_s) {
    s->stopping = true; /* a late request gets 503, not a reset */
    s->engine_down = true;
    /* the submitted requests, then those that never were (HTTP threads queued them while the
       step ran, unlocked: any number, so they are ended from the queue, not moved into live,
       whose room counts only the submitted ones) */
    for (int i = 0; i < s->n_live; i++) {
        s->live[i]->failed = true;
        snprintf(s->live[i]->error, sizeof s->live[i]->error, "%s", why);
        finish(s, s->live[i]);
    }
    s->n_live = 0;
    for (sreq *q; (q = s->head);) {
        s->head = q->next;
        q->next = NULL;
        q->failed = true;
        snprintf(q->error, sizeof q->error, "%s", why);
        finish(s, q);
    }
    s->tail = NULL;
    const double t0 = k3_now_s();
    while (s->n_busy > 0 && k3_now_s() - t0 < drain_s) timed_wait(&s->work, &s->mu, 0.02);
}

/* *stop == K3_SERVER_PEER_LOST: mpirun's SIGTERM after a rank of the job died (the signal
 * handler saw a vanished peer). The main thread may be blocked in a step waiting for that
 * rank: this thread tells every open request now, within mpirun's grace before its SIGKILL,
 * then ends the process with the SIGTERM's default action. */
static void *watch_peers(void *arg) {
    k3_server *s = arg;
    while (!s->watch_end) {
        if (*s->stop_flag == K3_SERVER_PEER_LOST) {
            pthread_mutex_lock(&s->mu);
            fail_open(s,
                      "a rank of the job died (killed, or lost with its node): the server is "
                      "going down",
                      PEER_LOST_DRAIN_S);
            K3_LOGE("k3 serve: a rank of the job died: the open requests were told (%d responses "
                    "still being written); ending",
                    s->n_busy);
            pthread_mutex_unlock(&s->mu);
            signal(SIGTERM, SIG_DFL);
            raise(SIGTERM);
        }
        hdr_scan(s);
        usleep(10000);
    }
    return NULL;
}

k3_status k3_server_run(k3_server *s, k3_engine *e, volatile sig_atomic_t *stop) {
    const double grace = s->o.grace_s > 0 ? s->o.grace_s : 10;
    double t_stop = -1;
    k3_status st = K3_OK;
    k3_engine_stats es;
    k3_engine_get_stats(e, &es);
    pthread_mutex_lock(&s->mu);
    s->m.n_ranks = K3_MIN(es.world, SRV_MAX_RANKS);
    for (int w = 0; w < s->m.n_ranks; w++) {
        uint64_t b = 0, pb = 0;
        double ls = 0;
        if (!k3_engine_rank_info(e, w, &s->m.rank_stage[w], &s->m.rank_lane[w], &b, &pb, &ls))
            s->m.rank_stage[w] = s->m.rank_lane[w] = -1;
    }
    srv_status_init(&s->status, e, k3_now_s());
    pthread_mutex_unlock(&s->mu);
    s->stop_flag = stop;
    pthread_t watcher;
    if (pthread_create(&watcher, NULL, watch_peers, s) != 0)
        return K3_ERR(K3_ERR_NOMEM, "k3 serve: cannot start the peer watcher thread");
    K3_LOGI("k3 serve: listening on http://%s:%d (model \"%s\", pid %d)",
            s->o.host ? s->o.host : "127.0.0.1", s->port, s->o.model_name, (int)getpid());
    while (st == K3_OK) {
        if (*stop == 1 && t_stop < 0) { /* K3_SERVER_PEER_LOST is the watcher's */
            t_stop = k3_now_s();
            MHD_socket fd = MHD_quiesce_daemon(s->d); /* no new connections */
            if (fd != MHD_INVALID_SOCKET) close(fd);
            pthread_mutex_lock(&s->mu);
            s->stopping = true;
            K3_LOGI("k3 serve: stopping: %d requests open, %.0f s to finish", s->m.admitted, grace);
            pthread_mutex_unlock(&s->mu);
        }
        const bool cancel_all = t_stop >= 0 && k3_now_s() - t_stop > grace;
        pthread_mutex_lock(&s->mu);
        s->silent_s = k3_engine_silent_s(e, &s->silent_rank);
        st = admit_and_cancel(s, e, cancel_all);
        const int pending = k3_engine_pending(e);
        s->m.pending = pending;
        k3_engine_load(e, &s->m.running, &s->m.waiting, &s->m.cache_usage);
        srv_status_tick(&s->status, &s->m, e, k3_now_s());
        /* a step still in flight when the last request ended is collected before idling: its
           lanes' step times reach /metrics now, not at the next request */
        if (st == K3_OK && pending == 0 && !k3_engine_in_flight(e)) {
            bool idle = t_stop >= 0 && s->n_busy == 0 && s->m.admitted == 0;
            if (!idle && t_stop >= 0 && s->m.admitted == 0 &&
                k3_now_s() - t_stop > grace + STUCK_CLIENT_S) {
                /* every request has ended; a client that does not read its last bytes must not
                   hold the job: the daemon's stop closes its connection */
                K3_LOGW("k3 serve: %d responses still being written %.0f s after the signal; "
                        "closing them",
                        s->n_busy, grace + STUCK_CLIENT_S);
                idle = true;
            }
            /* no step to run: tell the workers rank 0 is alive (rate-limited inside); without
               it they would end the job after --comm-timeout of quiet */
            if (!idle) st = k3_engine_heartbeat(e);
            if (!idle && st == K3_OK) timed_wait(&s->work, &s->mu, 0.05);
            pthread_mutex_unlock(&s->mu);
            if (idle || st != K3_OK) break;
            continue;
        }
        pthread_mutex_unlock(&s->mu);
        if (st != K3_OK) break;
        const k3_event *ev = NULL;
        int n = 0;
        const double t0 = k3_now_s();
        st = k3_engine_step(e, &ev, &n);
        pthread_mutex_lock(&s->mu);
        srv_hist_add(&s->m.step, k3_now_s() - t0);
        for (int w = 0; w < s->m.n_ranks; w++) /* every rank's step time, from the LOGITS */
            s->m.rank_ok[w] = k3_engine_rank_busy(e, w, &s->m.rank_busy_s[w], &s->m.rank_steps[w]);
        prefix_counters(e, &s->m);
        for (int i = 0; i < n && st == K3_OK; i++) st = route(s, &ev[i]);
        pthread_mutex_unlock(&s->mu);
    }
    if (st != K3_OK) {
        char why[512]; /* k3_last_error is this thread's: still the fault's after the wait */
        snprintf(why, sizeof why, "the engine failed (the server is going down): %.400s",
                 k3_last_error());
        pthread_mutex_lock(&s->mu);
        fail_open(s, why, FAULT_DRAIN_S);
        pthread_mutex_unlock(&s->mu);
    }
    s->watch_end = true;
    pthread_join(watcher, NULL);
    return st;
}

/* ---- HTTP threads: model requests ------------------------------------------------------------ */
/* The request's end from the HTTP side: cancel it when it is still running. */
static void release(conn *k) {
    if (!k->q) return;
    k3_server *s = k->s;
    pthread_mutex_lock(&s->mu);
    k->n_prompt = 0;
    srv_metrics_request(&s->m, k->q);
    for (sreq *q = k->q, *next; q; q = next) {
        next = q->sib;
        if (!q->done) {
            q->cancel = true;
            pthread_cond_signal(&s->work);
        }
        k->n_prompt += q->done && !q->sib_copy ? q->n_prompt : 0;
        unref(q);
    }
    s->n_busy--;
    k->q = NULL;
    pthread_mutex_unlock(&s->mu);
}

/* mu held: every choice of the request is done. */
static bool all_done(const sreq *head) {
    for (const sreq *q = head; q; q = q->sib)
        if (!q->done) return false;
    return true;
}

/* mu held: wait a slice for news of the request (one choice: its own condition). */
static void wait_news(k3_server *s, sreq *head) {
    timed_wait(head->multi ? &s->multi_cv : &head->cv, &s->mu, WAIT_SLICE_S);
}

/* Wait until the request is done; false when the client went away first. */
static bool wait_done(conn *k) {
    k3_server *s = k->s;
    pthread_mutex_lock(&s->mu);
    while (!all_done(k->q)) {
        wait_news(s, k->q);
        if (all_done(k->q)) break;
        pthread_mutex_unlock(&s->mu);
        bool gone = client_gone(k);
        pthread_mutex_lock(&s->mu);
        if (gone) break;
    }
    bool done = all_done(k->q);
    pthread_mutex_unlock(&s->mu);
    return done;
}

/* The request's own fault (400), the server's (500), or the engine is gone (503). */
static int engine_error_status(const k3_server *s, const sreq *q) {
    return s->engine_down ? 503 : srv_failed_status(q);
}

/* mu held: whether there is nothing new for the stream, in any of its choices. */
static bool nothing_new(const conn *k) {
    for (const sreq *q = k->q; q; q = q->sib) {
        const srv_stream *st = q->st;
        if (st->end_sent) continue;
        if (q->done || (q->kind == SREQ_CHAT && !st->role_sent)) return false;
        if (q->n_gen != st->n_fed || q->n_text != q->n_copy) return false;
    }
    return !all_done(k->q);
}

/* mu held: a snapshot of choice q's shared fields (its released text copied into q->text_copy:
 * the main thread may move q->text). */
static k3_status snapshot(sreq *q, srv_snapshot *snap) {
    if (q->n_text > q->cap_copy) {
        char *p = realloc(q->text_copy, q->n_text);
        if (!p) return K3_ERR(K3_ERR_NOMEM, "stream text");
        q->text_copy = p, q->cap_copy = q->n_text;
    }
    if (q->n_text > q->n_copy)
        memcpy(q->text_copy + q->n_copy, q->text + q->n_copy, q->n_text - q->n_copy);
    q->n_copy = q->n_text;
    *snap = (srv_snapshot){.toks = q->gen,
                           .lps = q->lp,
                           .n_gen = q->n_gen,
                           .text = q->text_copy,
                           .n_text = q->n_copy,
                           .done = q->done,
                           .failed = q->failed,
                           .stop = q->stop,
                           .n_prompt = q->n_prompt,
                           .error = q->error};
    return K3_OK;
}

/* A stream that waits (in the queue, behind a long prefill) sends an SSE comment this often: MHD
 * closes a connection with no traffic for --read-timeout, even while its reader blocks, so a
 * stream silent that long would end without an error or [DONE] (issue 43's storm under ASan). */
static double keep_alive_s(const k3_server *s) {
    const double t = s->o.idle_timeout_s > 0 ? s->o.idle_timeout_s : 30;
    return K3_MIN(t / 3, KEEP_ALIVE_MAX);
}

/* MHD's content reader of a stream: SSE bytes as they come; blocks (its own thread) until then.
 * Each choice has its own stream state (sreq.st); the end (usage, [DONE]) follows the last. */
static ssize_t read_stream(void *cls, uint64_t pos, char *buf, size_t max) {
    static const char ping[] = ": keep-alive\n\n";
    conn *k = cls;
    k3_server *s = k->s;
    for (;;) {
        if (k->out_off < k->out.n) {
            size_t n = K3_MIN(max, k->out.n - k->out_off);
            memcpy(buf, k->out.p + k->out_off, n);
            k->out_off += n;
            k->t_sent = k3_now_s();
            return (ssize_t)n;
        }
        k->out.n = k->out_off = 0;
        if (k->end_sent) return MHD_CONTENT_READER_END_OF_STREAM;
        pthread_mutex_lock(&s->mu);
        while (nothing_new(k)) {
            wait_news(s, k->q);
            if (!nothing_new(k)) break;
            pthread_mutex_unlock(&s->mu);
            bool gone = client_gone(k);
            pthread_mutex_lock(&s->mu);
            if (gone) {
                pthread_mutex_unlock(&s->mu);
                return MHD_CONTENT_READER_END_WITH_ERROR; /* the completion callback cancels */
            }
            if (k3_now_s() - k->t_sent >= keep_alive_s(s) && max >= sizeof ping - 1) {
                pthread_mutex_unlock(&s->mu);
                memcpy(buf, ping, sizeof ping - 1);
                k->t_sent = k3_now_s();
                return (ssize_t)(sizeof ping - 1);
            }
        }
        enum { SNAP_STACK = 8 };
        srv_snapshot stack[SNAP_STACK], *snap = stack;
        const int n = srv_n_choices(k->q);
        k3_status st = K3_OK;
        if (n > SNAP_STACK) st = k3_alloc((void **)&snap, (size_t)n * sizeof *snap, "snapshots");
        int i = 0;
        for (sreq *q = k->q; q && st == K3_OK; q = q->sib) st = snapshot(q, &snap[i++]);
        const bool done = all_done(k->q);
        pthread_mutex_unlock(&s->mu);
        i = 0;
        for (sreq *q = k->q; q && st == K3_OK; q = q->sib)
            st = srv_stream_chunks(&s->o, q, q->st, &snap[i++], &k->out);
        if (st == K3_OK && done) { /* every choice's fields are final now */
            st = srv_stream_end(&s->o, k->q, &k->out);
            k->end_sent = true;
        }
        if (snap != stack) k3_free(snap);
        if (st != K3_OK) {
            K3_LOGE("k3 serve: %s: %s", k->q->id, k3_last_error());
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
    }
}

/* A grammar compile on this thread stops when its client leaves or the server stops. */
static bool compile_cancelled(void *arg) {
    conn *k = arg;
    return __atomic_load_n(&k->s->stopping, __ATOMIC_RELAXED) || client_gone(k);
}

/* A chat or completion request; `responses`: a /v1/responses body (a chat request). */
static enum MHD_Result model_request(conn *k, sreq_kind kind, bool responses) {
    k3_server *s = k->s;
    char why[1024];
    sreq *q = NULL;
    const char *body = k->body ? k->body : "";
    k->t_request = k3_now_s();
    k->half_closed = peek_client(k->c) == 1;
    k3_grammar_thread_cancel(compile_cancelled, k);
    int st = responses ? srv_responses_parse(&s->o, body, k->n, &q, why, sizeof why)
                       : srv_parse(&s->o, kind, body, k->n, &q, why, sizeof why);
    k3_grammar_thread_cancel(NULL, NULL);
    if (st != 200) return send_error(k, st, why);
    for (sreq *c = q; c && q->stream && st == 200; c = c->sib)
        if (k3_calloc((void **)&c->st, sizeof *c->st, "stream state") != K3_OK) st = 500;
    if (st != 200) {
        srv_sreq_free_chain(q);
        return send_error(k, 500, "out of memory");
    }
    st = admit(s, q, k->t0);
    if (st != 200) {
        srv_sreq_free_chain(q);
        return send_error(k, st,
                          st == 429   ? "the server's request queue is full (--max-queue-bytes "
                                        "or --max-queue); retry later"
                          : st == 413 ? "the request needs more memory than the whole queue may "
                                        "hold (--max-queue-bytes) or more choices than "
                                        "--max-queue: it can never be admitted"
                                      : "the server is shutting down");
    }
    k->q = q;
    k->t_sent = k3_now_s();
    if (q->stream) {
        struct MHD_Response *r =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, read_stream, k, NULL);
        if (!r) return MHD_NO;
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        add_cors(s, k->c, r);
        enum MHD_Result ret = MHD_queue_response(k->c, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        k->status = 200;
        count_status(s, k->path, 200);
        return ret;
    }
    if (!wait_done(k)) return MHD_NO;      /* the client is gone: close; release() cancels */
    for (const sreq *c = q; c; c = c->sib) /* the first failed choice answers for the request */
        if (c->failed) return send_error(k, engine_error_status(s, c), c->error);
    k3_chat_buf b = {0};
    enum MHD_Result ret;
    if (srv_response(&s->o, q, &b) == K3_OK) {
        ret = send_json(k, 200, &b);
    } else {
        snprintf(why, sizeof why, "the response failed: %s", k3_last_error());
        ret = send_error(k, 500, why);
    }
    k3_chat_buf_free(&b);
    return ret;
}

/* ---- HTTP threads: routes -------------------------------------------------------------------- */
static enum MHD_Result get_route(conn *k) {
    k3_server *s = k->s;
    k3_chat_buf b = {0};
    enum MHD_Result ret;
    if (strcmp(k->path, "/health") == 0) {
        char why[160] = "";
        pthread_mutex_lock(&s->mu);
        if (s->engine_down)
            snprintf(why, sizeof why, "the engine failed");
        else if (s->silent_s > HEALTH_SILENT_S)
            snprintf(why, sizeof why, "rank %d has not answered for %.0f s", s->silent_rank,
                     s->silent_s);
        pthread_mutex_unlock(&s->mu);
        if (why[0]) return send_error(k, 503, why);
        return send_body(k, 200, "application/json", "{\"status\":\"ok\"}", 15);
    } else if (strcmp(k->path, "/ping") == 0) { /* vLLM's (SageMaker's) liveness probe */
        return send_body(k, 200, "application/json", "{}", 2);
    } else if (strcmp(k->path, "/v1/models") == 0 || model_path(k->path)) {
        const char *id = k->path[10] == '/' ? k->path + 11 : NULL;
        if (id && strcmp(id, s->o.model_name) != 0) {
            char why[400];
            snprintf(why, sizeof why, "the model '%.200s' does not exist", id);
            return send_error(k, 404, why);
        }
        ret = srv_models_json(&s->o, s->started, id != NULL, &b) == K3_OK ? send_json(k, 200, &b)
                                                                          : MHD_NO;
    } else if (strcmp(k->path, "/") == 0 || strcmp(k->path, "/ui") == 0) { /* the page */
        return send_body(k, 200, "text/html; charset=utf-8", k3_ui_html, k3_ui_html_len);
    } else if (strcmp(k->path, "/v1/k3/status") == 0) { /* its data (status.c): a snapshot */
        srv_status *st = NULL;
        if (k3_alloc((void **)&st, sizeof *st, "status snapshot") != K3_OK) return MHD_NO;
        pthread_mutex_lock(&s->mu);
        *st = s->status;
        const srv_metrics m = s->m;
        const bool down = s->engine_down;
        pthread_mutex_unlock(&s->mu);
        ret = srv_status_json(st, &m, &s->o, down, HEALTH_SILENT_S, k3_now_s(), &b) == K3_OK
                  ? send_json(k, 200, &b)
                  : MHD_NO;
        k3_free(st);
    } else if (strcmp(k->path, "/tokenizer_info") == 0 || strcmp(k->path, "/version") == 0) {
        ret = srv_info_json(&s->o, k->path, &b) == K3_OK ? send_json(k, 200, &b) : MHD_NO;
    } else {
        pthread_mutex_lock(&s->mu);
        srv_metrics m = s->m;
        pthread_mutex_unlock(&s->mu);
        ret = srv_metrics_text(&m, s->o.slots, &b) == K3_OK
                  ? send_body(k, 200, "text/plain; version=0.0.4", b.p, b.n)
                  : MHD_NO;
    }
    k3_chat_buf_free(&b);
    return ret;
}

static enum MHD_Result post_route(conn *k) {
    k3_server *s = k->s;
    if (strcmp(k->path, "/v1/chat/completions") == 0) return model_request(k, SREQ_CHAT, false);
    if (strcmp(k->path, "/v1/completions") == 0) return model_request(k, SREQ_COMPLETION, false);
    if (strcmp(k->path, "/v1/responses") == 0) return model_request(k, SREQ_CHAT, true);
    k3_chat_buf b = {0};
    const char *body = k->body ? k->body : "";
    int st = strcmp(k->path, "/tokenize") == 0 ? srv_tokenize(&s->o, body, k->n, &b)
                                               : srv_detokenize(&s->o, body, k->n, &b);
    enum MHD_Result ret = st == 500 && !b.n ? MHD_NO : send_json(k, st, &b);
    k3_chat_buf_free(&b);
    return ret;
}

/* A CORS preflight from an allowed origin: no key needed (browsers send none with it). */
static enum MHD_Result preflight(conn *k) {
    struct MHD_Response *r = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    const char *h =
        MHD_lookup_connection_value(k->c, MHD_HEADER_KIND, "Access-Control-Request-Headers");
    MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
    MHD_add_response_header(r, "Access-Control-Allow-Headers",
                            h ? h : "Authorization, Content-Type");
    MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    add_cors(k->s, k->c, r);
    enum MHD_Result ret = MHD_queue_response(k->c, 204, r);
    MHD_destroy_response(r);
    k->status = 204;
    count_status(k->s, k->path, 204);
    return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *n_upload, void **req_cls) {
    k3_server *s = cls;
    conn *k = *req_cls;
    if (!k) { /* headers only: set up, check the key and the declared length */
        if (k3_calloc((void **)&k, sizeof *k, "connection") != K3_OK) return MHD_NO;
        k->s = s, k->c = c, k->t0 = k3_now_s();
        hdr_mark(s, c, -1); /* the headers came in time */
        snprintf(k->method, sizeof k->method, "%s", method);
        snprintf(k->path, sizeof k->path, "%s", url);
        *req_cls = k;
        const char m = route_method(k->path);
        const char *bad = framing_error(c);
        if (bad) { /* answered now: the body is not read, the connection ends */
            k->close = true;
            return send_error(k, 400, bad);
        }
        if (m && strcmp(method, "OPTIONS") == 0 && cors_origin(s, c)) return preflight(k);
        /* vLLM's rule: the key guards the paths under /v1 only (its AuthenticationMiddleware);
           /health, /ping, /metrics, /version, /tokenize, /detokenize, /tokenizer_info and the
           page (/, /ui: it asks for the key itself) are open */
        const bool open = strncmp(k->path, "/v1", 3) != 0;
        if (m && !open && !authorized(s, c)) k->status = 401;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (!k->status && cl && strtoull(cl, NULL, 10) > s->max_body) k->status = 413;
        return MHD_YES;
    }
    if (*n_upload) { /* a piece of the body: kept up to the limit, then discarded */
        if (!k->status && k->n + *n_upload > s->max_body) k->status = 413;
        if (!k->status) {
            if (k->n + *n_upload + 1 > k->cap) {
                size_t cap = K3_MAX(2 * k->cap, k->n + *n_upload + 1);
                char *p = realloc(k->body, cap);
                if (!p) return MHD_NO;
                k->body = p, k->cap = cap;
            }
            memcpy(k->body + k->n, upload, *n_upload);
            k->n += *n_upload;
            k->body[k->n] = 0;
        }
        *n_upload = 0;
        return MHD_YES;
    }
    char why[160];
    const char m = route_method(k->path);
    if (!m) {
        snprintf(why, sizeof why, "no route %.60s", k->path);
        return send_error(k, 404, why);
    }
    if (k->status == 401) return send_error(k, 401, "a valid API key is required");
    if (k->status == 413) {
        snprintf(why, sizeof why, "the request body is larger than the limit of %zu bytes",
                 s->max_body);
        return send_error(k, 413, why);
    }
    const bool get = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0;
    if ((m == 'G') != get || (m == 'P' && strcmp(method, "POST") != 0)) {
        snprintf(why, sizeof why, "%.60s takes %s", k->path, m == 'G' ? "GET" : "POST");
        return send_error(k, 405, why);
    }
    return m == 'G' ? get_route(k) : post_route(k);
}

/* MHD: the request ended (response sent, or the client went away). One access log line. */
static void on_completed(void *cls, struct MHD_Connection *c, void **req_cls,
                         enum MHD_RequestTerminationCode toe) {
    conn *k = *req_cls;
    if (!k) return;
    char id[48] = "-";
    int64_t n_gen = 0;
    double ttft = -1;
    if (k->q) {
        pthread_mutex_lock(&k->s->mu);
        snprintf(id, sizeof id, "%s", k->q->id);
        n_gen = k->q->n_gen;
        ttft = k->q->n_gen ? k->q->t_first - k->q->t_arrive : -1;
        pthread_mutex_unlock(&k->s->mu);
    }
    release(k);
    hdr_mark(k->s, c, k3_now_s()); /* a keep-alive connection's next headers: a new deadline */
    const bool ok = toe == MHD_REQUEST_TERMINATED_COMPLETED_OK;
    k3_log(K3_LOG_INFO,
           "access id=%s method=%s path=%s status=%d%s prompt_tokens=%lld completion_tokens=%lld "
           "ttft_ms=%.1f total_ms=%.1f",
           id, k->method, k->path, k->status, ok ? "" : " aborted=1", (long long)k->n_prompt,
           (long long)n_gen, ttft >= 0 ? ttft * 1e3 : -1.0, (k3_now_s() - k->t0) * 1e3);
    k3_chat_buf_free(&k->out);
    free(k->body);
    k3_free(k);
    *req_cls = NULL;
}

/* ---- lifetime -------------------------------------------------------------------------------- */
k3_status k3_server_create(const k3_server_opts *o, k3_server **out) {
    k3_server *s = NULL;
    K3_TRY(k3_calloc((void **)&s, sizeof *s, "server"));
    s->o = *o;
    s->m.model_name = s->o.model_name;
    s->max_body = o->max_body_bytes ? o->max_body_bytes : (size_t)4 << 20;
    s->max_queue = o->max_queue > 0 ? o->max_queue : 0;
    s->max_queue_bytes = o->max_queue_bytes ? o->max_queue_bytes : (size_t)1 << 30;
    s->started = (int64_t)time(NULL);
    uint64_t t = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(k3_now_s() * 1e9);
    s->nonce = k3_hash_bytes(&t, sizeof t, K3_HASH_INIT);
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->amu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->multi_cv, NULL);
    if (k3_calloc((void **)&s->addrs, ADDR_SLOTS * sizeof *s->addrs, "connection table") != K3_OK) {
        k3_server_destroy(s);
        return K3_ERR(K3_ERR_NOMEM, "connection table");
    }
    const char *host = o->host ? o->host : "127.0.0.1";
    struct sockaddr_in6 a6 = {0};
    struct sockaddr_in a4 = {0};
    const struct sockaddr *sa = NULL;
    /* poll, not select: 1024 connections + the job's own descriptors pass FD_SETSIZE */
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC |
                     MHD_USE_POLL;
    if (inet_pton(AF_INET, host, &a4.sin_addr) == 1) {
        a4.sin_family = AF_INET;
        a4.sin_port = htons((uint16_t)o->port);
        sa = (const struct sockaddr *)&a4;
    } else if (inet_pton(AF_INET6, host, &a6.sin6_addr) == 1) {
        a6.sin6_family = AF_INET6;
        a6.sin6_port = htons((uint16_t)o->port);
        sa = (const struct sockaddr *)&a6;
        flags |= MHD_USE_IPv6;
    } else {
        k3_server_destroy(s);
        return K3_ERR(K3_ERR_ARG, "--host %s: not a numeric IPv4 or IPv6 address", host);
    }
    const unsigned timeout = (unsigned)(o->idle_timeout_s > 0 ? o->idle_timeout_s : 30);
    const unsigned limit = (unsigned)(o->max_connections > 0 ? o->max_connections : 1024);
    const unsigned per_client = (unsigned)(o->max_per_client > 0 ? o->max_per_client : 768);
    s->limit = limit, s->per_client = per_client;
    struct rlimit nf; /* a connection is a descriptor: lift a low soft limit up to the hard one */
    if (getrlimit(RLIMIT_NOFILE, &nf) == 0 && nf.rlim_cur != RLIM_INFINITY &&
        nf.rlim_cur < limit + 256 && nf.rlim_cur < nf.rlim_max) {
        nf.rlim_cur = K3_MIN(nf.rlim_max, (rlim_t)limit + 256);
        (void)setrlimit(RLIMIT_NOFILE, &nf);
    }
    /* strict: libmicrohttpd's own checks of the request line and headers (400); it still takes
       bare-LF chunk lines, so chunked bodies are refused in on_request (framing_error) */
    /* a socket the caller bound before loading: listen on it now (MHD wants it listening) */
    struct MHD_OptionItem given[] = {{MHD_OPTION_END, 0, NULL}, {MHD_OPTION_END, 0, NULL}};
    if (o->listen_fd > 0) {
        if (listen(o->listen_fd, 1024) != 0) {
            k3_server_destroy(s);
            return K3_ERR(K3_ERR_IO, "cannot listen on %s:%d: %s", host, o->port, strerror(errno));
        }
        given[0] = (struct MHD_OptionItem){MHD_OPTION_LISTEN_SOCKET, o->listen_fd, NULL};
    }
    s->d = MHD_start_daemon(flags, (uint16_t)o->port, on_accept, s, on_request, s, MHD_OPTION_ARRAY,
                            given, MHD_OPTION_SOCK_ADDR, sa, MHD_OPTION_NOTIFY_COMPLETED,
                            on_completed, s, MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
                            MHD_OPTION_CONNECTION_TIMEOUT, timeout, MHD_OPTION_CONNECTION_LIMIT,
                            limit, MHD_OPTION_PER_IP_CONNECTION_LIMIT, per_client,
                            MHD_OPTION_STRICT_FOR_CLIENT, 1, MHD_OPTION_END);
    if (!s->d) {
        k3_server_destroy(s);
        return K3_ERR(K3_ERR_IO, "cannot listen on %s:%d (in use, or not an address of this host)",
                      host, o->port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? (int)di->port : o->port;
    *out = s;
    return K3_OK;
}

int k3_server_port(const k3_server *s) {
    return s->port;
}

void k3_server_destroy(k3_server *s) {
    if (!s) return;
    if (s->d) MHD_stop_daemon(s->d); /* joins the connection threads */
    free(s->live);                   /* realloc'd as the queue grows */
    pthread_cond_destroy(&s->work);
    pthread_cond_destroy(&s->multi_cv);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->amu);
    k3_free(s->addrs);
    k3_free(s);
}
