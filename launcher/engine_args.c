/* engine_args.c — K3_ENGINE_FLAGS -> k3_engine_opts, validated (see engine_args.h).
 * Rejects, never clamps (STYLE.md §16): each bad value is a usage error naming its flag. Limits
 * against memory are the engine's (it checks the slots against the plan at open). */
#include "engine_args.h"

#include "k3_kernels.h"

#include <stdio.h>

static int bad(const k3_args *a, bool print, const char *flag, const char *rule) {
    if (print)
        fprintf(stderr, "k3 %s: --%s: '%s' %s\n", a->cmd->name, flag, k3_args_str(a, flag), rule);
    return 2;
}

/* The integer flags and their ranges: the one statement of each bound (k3_engine_args checks
 * them; `k3 plan` sizes with the same capacity flags through k3_engine_flag_range). */
static const struct {
    const char *flag;
    int64_t lo, hi;
} ranges[] = {
    {"pp", 1, 4096},
    {"ep", 1, 4096},
    {"threads", 0, 1024},
    {"kda-chunk", 0, 1024},
    {"max-seqs", 1, (int64_t)1 << 20},
    {"max-ctx", 1, (int64_t)1 << 30},
    {"kv-cache-tokens", 0, (int64_t)1 << 40},
    {"prefix-cache-tokens", 0, (int64_t)1 << 40},
    {"max-batch-tokens", 1, (int64_t)1 << 24},
    {"chunk", 0, (int64_t)1 << 30},
    {"micro-batches", 0, 1024},
    {"load-readers", 0, 256},
};

bool k3_engine_flag_range(const char *flag, int64_t *lo, int64_t *hi) {
    for (size_t i = 0; i < K3_ARRAY_LEN(ranges); i++)
        if (strcmp(flag, ranges[i].flag) == 0) {
            *lo = ranges[i].lo, *hi = ranges[i].hi;
            return true;
        }
    return false;
}

/* "must be in [lo, hi]", a large power of two written 2^k rather than in decimal. */
static void range_rule(int64_t lo, int64_t hi, char *out, size_t n) {
    int k = 0;
    while (k < 62 && ((int64_t)1 << k) < hi) k++;
    if (k >= 16 && ((int64_t)1 << k) == hi)
        snprintf(out, n, "must be in [%lld, 2^%d]", (long long)lo, k);
    else
        snprintf(out, n, "must be in [%lld, %lld]", (long long)lo, (long long)hi);
}

bool k3_engine_backend_ok(const char *name) {
    static const char *const names[] = {"auto", "cpu", "ref", "guard", "cuda"};
    for (size_t i = 0; i < K3_ARRAY_LEN(names); i++)
        if (strcmp(name, names[i]) == 0) return true;
    return false;
}

const char *k3_engine_backend_pick(const char *name, bool print) {
    char why[200];
    const char *b = k3_backend_resolve(name, why, sizeof why);
#ifdef K3_HAVE_CUDA /* only a build that could have taken cuda says what it took and why */
    if (print && strcmp(name, "auto") == 0)
        K3_LOGI("--backend auto: %s", why[0] ? why : "cuda (a device is visible)");
#else
    (void)print;
#endif
    return b;
}

void k3_engine_backend_say(const k3_args *a, bool print) {
    (void)k3_engine_backend_pick(k3_args_str(a, "backend"), print);
}

const char *k3_engine_transports(void) {
#ifdef K3_HAVE_NCCL
    return "mpi nccl";
#else
    return "mpi";
#endif
}

const char *k3_engine_nccl_kind(void) {
#if defined(K3_NCCL_EMULATE)
    return "NCCL stand-in over MPI, emulated";
#elif defined(K3_HAVE_NCCL)
    return "libnccl, not yet run on a device";
#else
    return "";
#endif
}

int k3_engine_comm_arg(const k3_args *a, const char *backend, bool print, const char **out) {
    const char *name = k3_args_str(a, "comm");
    const bool cuda = backend && strcmp(backend, "cuda") == 0;
#ifdef K3_HAVE_NCCL
    const bool have_nccl = true;
#else
    const bool have_nccl = false;
#endif
    char be[64]; /* "the backend is cpu" / "--backend auto picked cpu" */
    snprintf(be, sizeof be, "%s %s",
             strcmp(k3_args_str(a, "backend"), "auto") == 0 ? "--backend auto picked"
                                                            : "the backend is",
             backend ? backend : "cpu");
    if (strcmp(name, "auto") == 0) { /* the engine logs the transport it opened ("comm: ...") */
        *out = cuda && have_nccl ? "nccl" : "mpi";
        return 0;
    }
    if (strcmp(name, "mpi") == 0) {
        *out = "mpi";
        return 0;
    }
    if (strcmp(name, "nccl") != 0) return bad(a, print, "comm", "is not auto, mpi or nccl");
    if (!have_nccl) {
        if (print)
            fprintf(stderr,
                    "k3 %s: --comm: 'nccl' needs a build with the nccl transport (cmake "
                    "-DK3_CUDA=ON -DK3_NCCL=ON, or -DK3_CUDA_EMULATE=ON); this build has: %s\n",
                    a->cmd->name, k3_engine_transports());
        return 2;
    }
    if (!cuda) {
        if (print)
            fprintf(stderr,
                    "k3 %s: --comm: 'nccl' moves the MoE rows as device buffers and needs "
                    "--backend cuda, but %s\n",
                    a->cmd->name, be);
        return 2;
    }
    *out = "nccl";
    return 0;
}

int k3_engine_bind_arg(const k3_args *a, bool print, const char **mode) {
    const char *m = k3_args_str(a, "bind");
    if (strcmp(m, "auto") != 0 && strcmp(m, "none") != 0)
        return bad(a, print, "bind", "is not auto or none");
    *mode = m;
    return 0;
}

int k3_engine_args(const k3_args *a, bool print, k3_engine_opts *o) {
    for (size_t i = 0; i < K3_ARRAY_LEN(ranges); i++) {
        int64_t v = k3_args_int(a, ranges[i].flag);
        if (v < ranges[i].lo || v > ranges[i].hi) {
            char rule[64];
            range_rule(ranges[i].lo, ranges[i].hi, rule, sizeof rule);
            return bad(a, print, ranges[i].flag, rule);
        }
    }
    if (!(k3_args_float(a, "comm-timeout") > 0))
        return bad(a, print, "comm-timeout", "must be > 0");
    if (!(k3_args_float(a, "load-timeout") >= 0))
        return bad(a, print, "load-timeout", "must be >= 0 (0 = derived from the plan)");
    const char *backend = k3_args_str(a, "backend");
    if (!k3_engine_backend_ok(backend))
        return bad(a, print, "backend", "is not auto, cpu, ref, guard or cuda");
    k3_coord_mode cm = K3_COORD_SHARED;
    if (k3_coord_mode_parse(k3_args_str(a, "coordinator"), &cm) != K3_OK)
        return bad(a, print, "coordinator", "is not shared or dedicated");
    o->pp = (int)k3_args_int(a, "pp");
    o->ep = (int)k3_args_int(a, "ep");
    o->coord = cm;
    o->expert_map_path = k3_args_str(a, "expert-map");
    o->deterministic = k3_args_bool(a, "deterministic");
    o->comm_timeout_s = k3_args_float(a, "comm-timeout");
    o->load_timeout_s = k3_args_float(a, "load-timeout");
    o->n_threads = (int)k3_args_int(a, "threads");
    o->kda_chunk = (int)k3_args_int(a, "kda-chunk");
    o->backend = k3_engine_backend_pick(backend, false); /* said by k3_engine_backend_say */
    o->max_seqs = (int)k3_args_int(a, "max-seqs");
    o->max_ctx = k3_args_int(a, "max-ctx");
    o->kv_cache_tokens = k3_args_int(a, "kv-cache-tokens");
    o->no_prefix_cache = k3_args_bool(a, "no-prefix-cache");
    o->prefix_cache_tokens = k3_args_int(a, "prefix-cache-tokens");
    o->max_batch_tokens = k3_args_int(a, "max-batch-tokens");
    o->chunk = k3_args_int(a, "chunk");
    o->micro_batches = (int)k3_args_int(a, "micro-batches");
    o->verify = k3_args_bool(a, "verify");
    o->load_readers = (int)k3_args_int(a, "load-readers");
    o->load_direct = k3_args_bool(a, "load-direct");
    o->load_private = k3_args_bool(a, "load-private");
    o->load_mmap = k3_args_bool(a, "load-mmap");
    const char *graphs = k3_args_str(a, "cuda-graphs");
    if (strcmp(graphs, "on") != 0 && strcmp(graphs, "off") != 0)
        return bad(a, print, "cuda-graphs", "is not on or off");
    o->no_cuda_graphs = strcmp(graphs, "off") == 0;
    if (print && k3_args_has(a, "cuda-graphs") && strcmp(o->backend, "cuda") != 0)
        K3_LOGI("--cuda-graphs %s: ignored: the backend is %s (graphs are a cuda feature)", graphs,
                o->backend);
    if (o->load_mmap && o->load_direct) /* a mapped load reads nothing through O_DIRECT */
        K3_LOGW("--load-direct has no effect with --load-mmap (the shards are mapped, not read)");
    int rc = k3_engine_comm_arg(a, o->backend, print, &o->comm);
    return rc ? rc : k3_engine_bind_arg(a, print, &o->bind);
}
