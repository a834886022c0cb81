/* cmd_serve.c — `k3 serve --model DIR`: the OpenAI-compatible HTTP server (server/k3_server.h)
 * on rank 0, the engine (rank/k3_engine.h) on every rank, under mpirun on any S x E or alone.
 *
 * Owns: the flags, the API key (--api-key, else $K3_API_KEY), the served model name (default:
 * the basename of --model), the signal handling and the order of start and shutdown. Does not
 * own: HTTP, the wire format, generation.
 * Start: rank 0 binds the port (a busy port fails before anything loads) -> flags agreed on
 * every rank -> the engine opens (collective: plan, load) -> rank 0 listens and serves; the others
 * serve the engine's steps. /health answers only once the model is loaded (until then a connection
 * is refused).
 * Shutdown: SIGINT or SIGTERM sets a flag on each rank; rank 0 stops accepting, lets in-flight
 * requests finish for --shutdown-grace seconds, cancels the rest, closes the engine (which
 * releases every other rank) and every rank exits 0. */
#include "k3_launcher.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bench.h" /* k3_build_version */
#include "engine_args.h"
#include "k3_engine_test.h"
#include "k3_comm.h"
#include "k3_kernels.h" /* k3_host_memory */
#include "k3_model.h"
#include "chat_job.h"
#include "k3_server.h"

static const k3_flag flags[] = {
    {"model", K3_FLAG_STR, "DIR", NULL, "checkpoint directory (config.json + safetensors)"},
    {"host", K3_FLAG_STR, "ADDR", "127.0.0.1",
     "numeric IPv4 or IPv6 address to listen on (0.0.0.0: every interface)"},
    {"port", K3_FLAG_INT, "PORT", "8000", "TCP port (0: any free port, logged at start)"},
    {"api-key", K3_FLAG_STR, "KEY", NULL,
     "require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize (default: "
     "$K3_API_KEY; neither: no key)"},
    {"served-model-name", K3_FLAG_STR, "NAME", NULL,
     "the model id in /v1/models and responses (default: the basename of --model)"},
    {"max-body-bytes", K3_FLAG_INT, "N", "4194304", "a larger request body gets 413"},
    {"max-messages", K3_FLAG_INT, "N", "2048", "messages per chat request (more: 400)"},
    {"max-queue", K3_FLAG_INT, "N", "0",
     "requests admitted at once, running + waiting (more: 429 with Retry-After); 0: no limit by "
     "count, --max-queue-bytes bounds the queue"},
    {"max-queue-bytes", K3_FLAG_INT, "B", "0",
     "memory the admitted requests may hold on rank 0 (prompts, token buffers, sampler state, "
     "logprobs; estimated from their sizes); a request past it gets 429 with Retry-After (0: a "
     "tenth of MemAvailable at start, at least 256 MiB)"},
    {"max-connections-per-client", K3_FLAG_INT, "N", "768",
     "open connections from one client address (more are refused; 1024 in all, so one client at "
     "a load tool's 512 concurrent requests, with the connections its pool opens while old ones "
     "close, leaves 256 for the others and /health)"},
    {"read-timeout", K3_FLAG_FLOAT, "SEC", "30",
     "a connection that sends nothing (or reads nothing of its response) for this long is closed"},
    {"header-timeout", K3_FLAG_FLOAT, "SEC", "10",
     "a request's headers must all arrive within this long of the connection's opening (or of "
     "the previous response's end on a keep-alive connection), however steadily they trickle; "
     "else the connection is closed (--read-timeout is per read)"},
    {"allowed-origins", K3_FLAG_STR, "LIST", NULL,
     "CORS for browser clients: comma-separated origins (or *) whose pages may call the API; "
     "preflight OPTIONS needs no key (default: no CORS headers)"},
    {"grammar-budget", K3_FLAG_FLOAT, "SEC", "10",
     "structured outputs: a grammar whose compile takes longer gets 400 naming this budget (a "
     "compile also stops when its client leaves)"},
    {"shutdown-grace", K3_FLAG_FLOAT, "SEC", "10",
     "on SIGINT/SIGTERM, in-flight requests may finish this long before they are cancelled"},
    K3_ENGINE_FLAGS,
};

static volatile sig_atomic_t stop_flag;
static volatile sig_atomic_t
    serving; /* rank 0 is in k3_server_run (its watcher ends the process) */

static void on_signal(int sig) {
    /* mpirun's SIGTERM after a peer died: name it; rank 0's server tells every open request and
       ends the process at once (its watcher thread); the other ranks go at once */
    if (sig == SIGTERM && k3_comm_report_vanished()) {
        if (serving) {
            stop_flag = K3_SERVER_PEER_LOST;
            return;
        }
        signal(sig, SIG_DFL);
        raise(sig);
    }
    if (stop_flag != K3_SERVER_PEER_LOST) stop_flag = 1;
}

/* Every rank: SIGINT/SIGTERM end the job through rank 0's close, never by killing one rank (the
 * other ranks only note the signal: they leave k3_engine_serve when rank 0 closes). */
static void install_signals(void) {
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN); /* a client that went away is a failed write, not a death */
}

/* Bind host:port before the model loads, so that a busy port fails in a moment and not after a
 * load of minutes; the socket listens (and answers) only once the engine is open. */
static k3_status bind_port(const char *host, int port, int *fd_out) {
    struct sockaddr_storage ss = {0};
    socklen_t len;
    struct sockaddr_in *a4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET, a4->sin_port = htons((uint16_t)port), len = sizeof *a4;
    } else if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6, a6->sin6_port = htons((uint16_t)port), len = sizeof *a6;
    } else {
        return K3_ERR(K3_ERR_ARG, "--host %s: not a numeric IPv4 or IPv6 address", host);
    }
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0), on = 1;
    if (fd == 0) { /* 0 means "none" to k3_server_opts: stdin was closed */
        fd = fcntl(0, F_DUPFD_CLOEXEC, 1);
        close(0);
    }
    if (fd < 0) return K3_ERR(K3_ERR_IO, "cannot make a socket: %s", strerror(errno));
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on); /* as libmicrohttpd does */
    if (ss.ss_family == AF_INET6) (void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &on, sizeof on);
    if (bind(fd, (struct sockaddr *)&ss, len) != 0) {
        int e = errno;
        close(fd);
        return K3_ERR(K3_ERR_IO,
                      "cannot bind %s:%d: %s; nothing was loaded (pick another --port, or "
                      "--port 0 for any free one)",
                      host, port, strerror(e));
    }
    *fd_out = fd;
    return K3_OK;
}

/* Rank 0 before the engine opens: flags into the server options, the port, the tokenizer. */
static k3_status prepare(const k3_args *a, k3_server_opts *so, k3_tokenizer **tok, char *name,
                         size_t n_name) {
    const int64_t port = k3_args_int(a, "port"), body = k3_args_int(a, "max-body-bytes"),
                  msgs = k3_args_int(a, "max-messages"), queue = k3_args_int(a, "max-queue");
    if (port < 0 || port > 65535)
        return K3_ERR(K3_ERR_ARG, "--port: %lld must be in [0, 65535]", (long long)port);
    if (body < 1024 || body > ((int64_t)1 << 30))
        return K3_ERR(K3_ERR_ARG, "--max-body-bytes: %lld must be in [1024, 2^30]",
                      (long long)body);
    if (msgs < 1 || msgs > 1000000)
        return K3_ERR(K3_ERR_ARG, "--max-messages: %lld must be in [1, 1000000]", (long long)msgs);
    if (queue < 0 || queue > 1000000)
        return K3_ERR(K3_ERR_ARG, "--max-queue: %lld must be in [0, 1000000]", (long long)queue);
    int64_t qbytes = k3_args_int(a, "max-queue-bytes");
    if (qbytes != 0 && (qbytes < ((int64_t)1 << 20) || qbytes > ((int64_t)1 << 50)))
        return K3_ERR(K3_ERR_ARG, "--max-queue-bytes: %lld must be 0 or in [2^20, 2^50]",
                      (long long)qbytes);
    size_t avail = 0, total = 0;
    if (qbytes == 0) /* the default: a tenth of the host's available memory, at least 256 MiB */
        qbytes = K3_MAX(k3_host_memory(&avail, &total) == K3_OK ? (int64_t)(avail / 10) : 0,
                        (int64_t)256 << 20);
    const int64_t per_client = k3_args_int(a, "max-connections-per-client");
    if (per_client < 1 || per_client > 1023)
        return K3_ERR(K3_ERR_ARG, "--max-connections-per-client: %lld must be in [1, 1023]",
                      (long long)per_client);
    const double read_s = k3_args_float(a, "read-timeout");
    if (!(read_s >= 1 && read_s <= 86400))
        return K3_ERR(K3_ERR_ARG, "--read-timeout must be in [1, 86400] seconds");
    const double header_s = k3_args_float(a, "header-timeout");
    if (!(header_s >= 1 && header_s <= 86400))
        return K3_ERR(K3_ERR_ARG, "--header-timeout must be in [1, 86400] seconds");
    const char *origins = k3_args_str(a, "allowed-origins"); /* echoed in a header: no CR/LF */
    for (const char *p = origins; p && *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            return K3_ERR(K3_ERR_ARG,
                          "--allowed-origins: a control character (0x%02x) at offset %td: origins "
                          "are comma-separated, e.g. https://ui.example:3000",
                          (unsigned char)*p, p - origins);
    const double budget_s = k3_args_float(a, "grammar-budget");
    if (!(budget_s > 0 && budget_s <= 3600))
        return K3_ERR(K3_ERR_ARG, "--grammar-budget must be in (0, 3600] seconds");
    if (!(k3_args_float(a, "shutdown-grace") >= 0))
        return K3_ERR(K3_ERR_ARG, "--shutdown-grace must be >= 0");
    const char *m = k3_args_str(a, "model");
    if (k3_args_has(a, "served-model-name")) {
        snprintf(name, n_name, "%s", k3_args_str(a, "served-model-name"));
    } else {
        size_t n = strlen(m);
        while (n > 1 && m[n - 1] == '/') n--;
        size_t s = n;
        while (s > 0 && m[s - 1] != '/') s--;
        snprintf(name, n_name, "%.*s", (int)(n - s), m + s);
    }
    const char *key = k3_args_has(a, "api-key") ? k3_args_str(a, "api-key") : getenv("K3_API_KEY");
    *so = (k3_server_opts){.host = k3_args_str(a, "host"),
                           .port = (int)port,
                           .api_key = key && *key ? key : NULL,
                           .model_name = name,
                           .max_body_bytes = (size_t)body,
                           .max_messages = (int)msgs,
                           .max_queue = (int)queue,
                           .max_queue_bytes = (size_t)qbytes,
                           .max_per_client = (int)per_client,
                           .idle_timeout_s = read_s,
                           .header_timeout_s = header_s,
                           .allowed_origins = k3_args_str(a, "allowed-origins"),
                           .grace_s = k3_args_float(a, "shutdown-grace")};
    K3_TRY(bind_port(so->host, so->port, &so->listen_fd));
    K3_TRY(k3_tok_create_model_dir(tok, m, NULL));
    k3_config cfg;
    K3_TRY(k3_config_load(m, &cfg));
    so->n_vocab = cfg.vocab_size;
    so->tok = *tok;
    K3_TRY(k3_job_grammar_cache(*tok, cfg.vocab_size, &so->grammars));
    k3_grammar_cache_limits(so->grammars, 0, budget_s);
    return K3_OK;
}

/* The model's tokenizer_config.json (GET /tokenizer_info), or NULL where it has none. */
static char *read_tokenizer_config(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *t = NULL;
    size_t n = 0, cap = 0, got;
    do {
        if (n + 4096 + 1 > cap) {
            char *p = realloc(t, cap = 2 * cap + 8192);
            if (!p) break;
            t = p;
        }
        got = fread(t + n, 1, cap - n - 1, f);
        n += got;
    } while (got > 0);
    fclose(f);
    if (t) t[n] = 0;
    return t;
}

/* Each rank's time in forward steps over the serving time (the engine gathers it at close). */
static void busy_summary(const k3_engine_stats *f, double wall_s) {
    if (f->world < 1 || wall_s <= 0) return;
    char busy[1024];
    int n = 0;
    for (int r = 0; r < f->world && r < 256 && n < (int)sizeof busy - 16; r++)
        n += snprintf(busy + n, sizeof busy - (size_t)n, "%s r%d %.1f s (%.0f%%)", r ? "," : "", r,
                      f->busy_s[r], 100.0 * f->busy_s[r] / wall_s);
    K3_LOGI("k3 serve: %lld prompt + %lld generated tokens in %lld steps; time in forward steps "
            "per rank:%s",
            (long long)f->prompt_tokens, (long long)f->gen_tokens, (long long)f->steps, busy);
}

static int run_serve(const k3_args *a) {
    if (k3_comm_init() != K3_OK) {
        fprintf(stderr, "k3 serve: %s\n", k3_last_error());
        return 1;
    }
    int rank = 0, world = 1;
    k3_comm_world(&rank, &world);
    k3_log_set_rank(rank, -1, -1);
    k3_engine_opts eo = {.name = "k3 serve"};
    int rc = k3_engine_args(a, rank == 0, &eo);
    if (rc == 0) k3_engine_backend_say(a, rank == 0);
    if (rc == 0 && !k3_args_has(a, "model")) {
        if (rank == 0) fprintf(stderr, "k3 serve: --model DIR is required\n");
        rc = 2;
    }
    if (rc) {
        k3_comm_finalize();
        return rc;
    }
    k3_server_opts so = {0};
    k3_tokenizer *tok = NULL;
    char name[256] = "";
    int verdict = 0; /* rank 0 decides: 0 serve, 1 failed, 2 usage */
    if (rank == 0) {
        k3_status st = prepare(a, &so, &tok, name, sizeof name);
        verdict = st == K3_OK ? 0 : st == K3_ERR_ARG ? 2 : 1;
        if (st != K3_OK) fprintf(stderr, "k3 serve: %s\n", k3_last_error());
    }
    int agreed = verdict;
    if (k3_comm_world_max(verdict, &agreed, eo.comm_timeout_s) != K3_OK) {
        fprintf(stderr, "k3 serve: rank %d: %s\n", rank, k3_last_error());
        k3_comm_world_abort(1);
    }
    if (agreed) {
        if (so.listen_fd > 0) close(so.listen_fd);
        k3_grammar_cache_destroy(so.grammars);
        k3_tok_destroy(tok);
        k3_comm_finalize();
        return agreed;
    }
    eo.model_dir = k3_args_str(a, "model");
    eo.tok = tok;
    char *tok_info = rank == 0 ? read_tokenizer_config(eo.model_dir) : NULL;
    so.tokenizer_info = tok_info;
    so.version = k3_build_version;
    so.backend = eo.backend, so.comm = eo.comm;
    eo.progress = true;
    k3_engine *e = NULL;
    k3_status ost = k3_engine_open_test(&eo, k3_engine_test_from_env(), &e);
    if (ost != K3_OK && e) k3_engine_abort(e); /* a fatal fault: the job ends, the rank named */
    rc = ost == K3_OK ? 0 : ost == K3_ERR_ARG ? 2 : 1;
    /* after the open: the comm layer installs its own SIGTERM handler (it names vanished peers
     * and dies); a server ends through rank 0's orderly close instead */
    if (rc == 0) install_signals();
    if (rc == 0 && !k3_engine_is_coordinator(e)) {
        if (k3_engine_serve(e) != K3_OK) k3_engine_abort(e); /* serves, then closes */
    } else if (rc == 0) {
        const double t_open = k3_now_s();
        k3_engine_stats es;
        k3_engine_get_stats(e, &es);
        so.max_ctx = es.max_ctx;
        so.slots = es.max_seqs * es.ep;
        k3_server *srv = NULL;
        k3_status st = k3_server_create(&so, &srv);
        if (st == K3_OK) so.listen_fd = 0; /* the server's now: its daemon closes it */
        serving = st == K3_OK;
        if (st == K3_OK) st = k3_server_run(srv, e, &stop_flag);
        serving = 0;
        if (k3_engine_failed(e)) k3_engine_abort(e); /* the job ends, the failed rank named */
        if (st != K3_OK) fprintf(stderr, "k3 serve: %s\n", k3_last_error());
        const double t_serve = k3_now_s() - t_open;
        k3_engine_stats fin = {0};
        if (k3_engine_close(e, &fin) != K3_OK) k3_engine_abort(e); /* releases the other ranks */
        k3_server_destroy(srv); /* joins the HTTP threads: their requests have ended */
        busy_summary(&fin, t_serve);
        if (st == K3_OK) K3_LOGI("k3 serve: stopped");
        rc = st == K3_OK ? 0 : 1;
    }
    if (so.listen_fd > 0) close(so.listen_fd); /* bound, but no server took it */
    k3_grammar_cache_destroy(so.grammars);     /* after the server: its jobs hold grammars */
    k3_tok_destroy(tok);
    free(tok_info);
    k3_comm_finalize();
    return rc;
}

const k3_command k3_cmd_serve = {
    .name = "serve",
    .positional = "",
    .min_pos = 0,
    .max_pos = 0,
    .summary = "an OpenAI-compatible HTTP server (chat, completions, models, tokenize, metrics) "
               "on rank 0; every rank under mpirun runs the model",
    .flags = flags,
    .n_flags = (int)K3_ARRAY_LEN(flags),
    .run = run_serve,
};
