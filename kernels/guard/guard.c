/* guard.c — the guard test backend: the cpu ops, on memory that host code cannot touch.
 *
 * Owns: one reserved address range (mmap PROT_NONE, MAP_NORESERVE) from which every buffer is
 * carved (page aligned, bump allocation, never reused), and the op wrappers. An op, an upload or
 * a download opens the used part of the range (PROT_READ|PROT_WRITE), runs, and closes it again
 * (PROT_NONE). So any code outside kernels/ that reads or writes an activation, a cache or a
 * weight directly — a host loop left in layers/ or experts/, a memcpy in rank/ — takes SIGSEGV
 * under test, exactly where a device backend would have read garbage. Results are the cpu
 * backend's, bit for bit (same op code, same thread pool rules).
 * It also counts (k3_op_stats, `k3 run --op-stats`): op calls by op, bytes each way, and host
 * syncs (download, synchronize, event_sync: the reads a device backend makes the host wait for;
 * download_async is not one, the event_sync after it is). Counters are atomics, so ops called
 * from several threads are safe; reading them (op_stats) counts nothing.
 * Not for production: every op costs two mprotect calls. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <pthread.h>
#include <sys/mman.h>

#define GUARD_PAGE         4096
#define GUARD_DEFAULT_SIZE ((size_t)16 << 30)

typedef struct guard_ctx {
    k3_cpu_ctx cpu; /* first: k3_cpu_pool(be) works on the guard backend too */
    k3_backend *inner;
    uint8_t *base;
    size_t reserved, used;
    pthread_mutex_t mu;
    int open_depth;
    k3_op_stats stats; /* updated with __atomic builtins only */
} guard_ctx;

/* An event of the guard backend: copies are immediate, so it only exists (and is counted). */
typedef struct guard_event {
    uint64_t n_records;
} guard_event;

static void count(uint64_t *c, uint64_t n) {
    __atomic_fetch_add(c, n, __ATOMIC_RELAXED);
}

static guard_ctx *G(k3_backend *be) {
    return (guard_ctx *)be->ctx;
}

/* mprotect of the guard's own reservation: failing means the address space is not what the
 * guard made it, so the process stops (K3_ASSERT's message). The call is made here, never inside
 * the assert's condition. */
static void protect(void *p, size_t n, int prot) {
    const int rc = mprotect(p, n, prot);
    K3_ASSERT(rc == 0);
}
static void guard_open(k3_backend *be) {
    guard_ctx *g = G(be);
    pthread_mutex_lock(&g->mu);
    if (g->open_depth++ == 0 && g->used) protect(g->base, g->used, PROT_READ | PROT_WRITE);
    pthread_mutex_unlock(&g->mu);
}
static void guard_close(k3_backend *be) {
    guard_ctx *g = G(be);
    pthread_mutex_lock(&g->mu);
    if (--g->open_depth == 0 && g->used) protect(g->base, g->used, PROT_NONE);
    pthread_mutex_unlock(&g->mu);
}

/* Each op: open, run the cpu op with the inner cpu backend, close. The parameter `be` is
 * shadowed on purpose inside so that the forwarded argument list can be used as written. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wshadow"
#define GUARD_OP(name, params, args)                                                               \
    static k3_status guard_##name params {                                                         \
        k3_backend *outer_ = be;                                                                   \
        count(&G(outer_)->stats.calls[K3_OP_##name], 1);                                           \
        guard_open(outer_);                                                                        \
        k3_status st_;                                                                             \
        {                                                                                          \
            k3_backend *be = G(outer_)->inner;                                                     \
            st_ = be->ops->name args;                                                              \
        }                                                                                          \
        guard_close(outer_);                                                                       \
        return st_;                                                                                \
    }
K3_OP_LIST(GUARD_OP)
#undef GUARD_OP
#pragma GCC diagnostic pop

#define GUARD_FIELD(name, params, args) .name = guard_##name,
static const k3_ops k_guard_ops = {K3_OP_LIST(GUARD_FIELD)};
#undef GUARD_FIELD

static k3_status g_alloc(k3_backend *be, size_t n, void **out) {
    guard_ctx *g = G(be);
    size_t sz = (n + GUARD_PAGE - 1) / GUARD_PAGE * GUARD_PAGE;
    if (!sz) sz = GUARD_PAGE;
    pthread_mutex_lock(&g->mu);
    k3_status st = K3_OK;
    if (sz > g->reserved - g->used) {
        st = K3_ERR(K3_ERR_NOMEM, "guard backend: %zu bytes requested, %zu of %zu reserved left", n,
                    g->reserved - g->used, g->reserved);
    } else {
        *out = g->base + g->used;
        g->used += sz;
        /* fresh anonymous pages are zero; an open range must cover the new buffer too */
        if (g->open_depth > 0) protect(*out, sz, PROT_READ | PROT_WRITE);
    }
    pthread_mutex_unlock(&g->mu);
    return st;
}
static void g_free(k3_backend *be, void *p) {
    /* never reused: a stale pointer keeps faulting (the pages stay PROT_NONE) */
}
static k3_status g_upload(k3_backend *be, void *dst, const void *src, size_t n) {
    count(&G(be)->stats.h2d_bytes, n);
    guard_open(be);
    if (n) memcpy(dst, src, n);
    guard_close(be);
    return K3_OK;
}
/* a device -> host read the host waits for: a host sync */
static k3_status g_download(k3_backend *be, void *dst, const void *src, size_t n) {
    count(&G(be)->stats.d2h_bytes, n);
    count(&G(be)->stats.host_syncs, 1);
    guard_open(be);
    if (n) memcpy(dst, src, n);
    guard_close(be);
    return K3_OK;
}
static k3_status g_sync(k3_backend *be) {
    count(&G(be)->stats.host_syncs, 1);
    return K3_OK;
}
/* The stream-ordered forms copy now (nothing is queued on a host backend); a download_async is
   no host sync by itself (the event_sync that waits for it is). */
static k3_status g_upload_async(k3_backend *be, void *dst, const void *src, size_t n) {
    return g_upload(be, dst, src, n);
}
static k3_status g_download_async(k3_backend *be, void *dst, const void *src, size_t n) {
    count(&G(be)->stats.d2h_bytes, n);
    guard_open(be);
    if (n) memcpy(dst, src, n);
    guard_close(be);
    return K3_OK;
}
static k3_status g_event_create(k3_backend *be, k3_backend_event **out) {
    guard_event *ev;
    K3_TRY(k3_calloc((void **)&ev, sizeof *ev, "guard event"));
    *out = (k3_backend_event *)ev; /* opaque to callers; only this file looks inside */
    return K3_OK;
}
static k3_status g_event_record(k3_backend *be, k3_backend_event *ev) {
    ((guard_event *)ev)->n_records++;
    return K3_OK;
}
static k3_status g_event_sync(k3_backend *be, k3_backend_event *ev) {
    count(&G(be)->stats.host_syncs, 1);
    return K3_OK;
}
static void g_event_destroy(k3_backend *be, k3_backend_event *ev) {
    k3_free(ev);
}
static k3_status g_op_stats(const k3_backend *be, k3_op_stats *out) {
    const guard_ctx *g = be->ctx;
    for (int i = 0; i < K3_OP_COUNT; i++)
        out->calls[i] = __atomic_load_n(&g->stats.calls[i], __ATOMIC_RELAXED);
    out->host_syncs = __atomic_load_n(&g->stats.host_syncs, __ATOMIC_RELAXED);
    out->h2d_bytes = __atomic_load_n(&g->stats.h2d_bytes, __ATOMIC_RELAXED);
    out->d2h_bytes = __atomic_load_n(&g->stats.d2h_bytes, __ATOMIC_RELAXED);
    return K3_OK;
}
static bool g_supports(const k3_backend *be, int op, k3_dtype wt) {
    const k3_backend *in = ((const guard_ctx *)be->ctx)->inner;
    return in->mem_->supports_op(in, op, wt);
}
static k3_status g_memory(const k3_backend *be, size_t *fr, size_t *tot) {
    const guard_ctx *g = be->ctx;
    *tot = g->reserved;
    *fr = g->reserved - g->used;
    return K3_OK;
}
static void g_destroy(k3_backend *be) {
    guard_ctx *g = G(be);
    if (g) {
        if (g->base) munmap(g->base, g->reserved);
        k3_backend_destroy(g->inner);
        pthread_mutex_destroy(&g->mu);
        k3_free(g);
    }
    k3_free(be);
}
static const k3_backend_iface k_guard_iface = {
    .alloc = g_alloc,
    .free = g_free,
    .upload = g_upload,
    .download = g_download,
    .synchronize = g_sync,
    .supports_op = g_supports,
    .memory = g_memory,
    .destroy = g_destroy,
    .upload_async = g_upload_async,
    .download_async = g_download_async,
    .event_create = g_event_create,
    .event_record = g_event_record,
    .event_sync = g_event_sync,
    .event_destroy = g_event_destroy,
    .op_stats = g_op_stats,
};

k3_status k3_backend_create_guard(const k3_backend_params *p, k3_backend **out) {
    *out = NULL;
    k3_backend *be;
    K3_TRY(k3_calloc((void **)&be, sizeof *be, "guard backend"));
    be->name = "guard";
    be->mem = K3_MEM_GUARD;
    be->ops = &k_guard_ops;
    be->mem_ = &k_guard_iface;
    guard_ctx *g;
    k3_status st = k3_calloc((void **)&g, sizeof *g, "guard backend context");
    if (st != K3_OK) {
        k3_free(be);
        return st;
    }
    be->ctx = g;
    pthread_mutex_init(&g->mu, NULL);
    st = k3_backend_create_cpu(p, &g->inner);
    if (st == K3_OK) {
        g->cpu.pool = k3_cpu_pool(g->inner);
        g->reserved = p && p->guard_reserve ? p->guard_reserve : GUARD_DEFAULT_SIZE;
        g->reserved = (g->reserved + GUARD_PAGE - 1) / GUARD_PAGE * GUARD_PAGE;
        void *m =
            mmap(NULL, g->reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED)
            st = K3_ERR(K3_ERR_NOMEM, "guard backend: cannot reserve %zu bytes of address space",
                        g->reserved);
        else
            g->base = m;
    }
    if (st != K3_OK) {
        g_destroy(be);
        return st;
    }
    *out = be;
    return K3_OK;
}
