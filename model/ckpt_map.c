/* ckpt_map.c — the shard files mapped instead of read (k3_load_sel.map, `--load-mmap`).
 *
 * A shard is mapped read-only and private at an address congruent to its file offsets modulo
 * 2 MB, advised MADV_HUGEPAGE: a file system whose page cache holds large folios (ext4 and xfs on
 * recent kernels) then maps each 2 MB of it with one page-table entry, as the read loader's
 * arena is (base.c, k3_alloc_large), so a decode step's weight sweep costs the same TLB misses.
 * The pages are the page cache's own: a warm load copies and zeroes nothing, and the ranks of a
 * node share them without a shared-memory region. k3_ckpt_map_populate faults a range in
 * (MADV_POPULATE_READ: reads it from the file when it is not cached, and reports I/O errors as
 * errors instead of SIGBUS later); k3_ckpt_map_pmd says how much of what is resident is mapped in
 * 2 MB entries (smaps FilePmdMapped), which the loader logs and the load bench prints.
 * Owns: the mappings. Does not own: the checkpoint (its sizes were checked at open, and are
 * checked again here against the file as it is now). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model_internal.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14 */
#endif
#define MAP_ALIGN ((size_t)2 << 20)

/* ---- SIGBUS on a mapped shard ----------------------------------------------------------------
 * A shard truncated (or its blocks lost) after the load turns a weight read into SIGBUS. The
 * mappings are registered here; the handler names the file and the offset on stderr in one line
 * and ends the rank with exit status 1 (no core dump): mpirun then ends the job. A SIGBUS
 * elsewhere gets the previous disposition. Overwriting a shard in place is not detectable this
 * way (MAP_PRIVATE pages read before the write keep the old bytes, later ones see the new): k3
 * promises nothing for a checkpoint changed while a --load-mmap job runs (docs/DESIGN.md §5). */
enum { BUS_MAPS = 256 };
static struct {
    _Atomic(uint8_t *) base;
    uint64_t n_bytes;
    char path[512];
} bus_maps[BUS_MAPS];
static pthread_mutex_t bus_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction bus_old;
static bool bus_installed;
static char bus_rank[16] = "0"; /* this process's MPI rank (read before any fault) */

static size_t put_s(char *o, size_t at, size_t cap, const char *s) {
    while (*s && at + 1 < cap) o[at++] = *s++;
    return at;
}
static size_t put_u(char *o, size_t at, size_t cap, uint64_t v) {
    char d[24];
    int n = 0;
    do d[n++] = (char)('0' + v % 10), v /= 10;
    while (v);
    while (n && at + 1 < cap) o[at++] = d[--n];
    return at;
}

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    (void)uc;
    const uint8_t *a = si ? (const uint8_t *)si->si_addr : NULL;
    for (int i = 0; a && i < BUS_MAPS; i++) {
        const uint8_t *b = atomic_load(&bus_maps[i].base);
        if (!b || a < b || a >= b + bus_maps[i].n_bytes) continue;
        char m[900];
        size_t n = put_s(m, 0, sizeof m, "[k3] rank ");
        n = put_s(m, n, sizeof m, bus_rank);
        n = put_s(m, n, sizeof m, " failed: SIGBUS reading the mapped checkpoint shard ");
        n = put_s(m, n, sizeof m, bus_maps[i].path);
        n = put_s(m, n, sizeof m, " at byte ");
        n = put_u(m, n, sizeof m, (uint64_t)(a - b));
        n = put_s(m, n, sizeof m, " of ");
        n = put_u(m, n, sizeof m, bus_maps[i].n_bytes);
        n = put_s(m, n, sizeof m,
                  ": the file shrank or lost blocks after the load (--load-mmap "
                  "needs the shards unchanged while the job runs)\n");
        ssize_t w = write(2, m, n);
        (void)w;
        struct rlimit no_core = {0, 0};
        (void)setrlimit(RLIMIT_CORE, &no_core);
        _exit(1);
    }
    sigaction(sig, &bus_old, NULL); /* not ours: the previous disposition, on the same fault */
}

static void bus_register(uint8_t *base, uint64_t n_bytes, const char *path) {
    pthread_mutex_lock(&bus_mu);
    if (!bus_installed) {
        const char *r = getenv("OMPI_COMM_WORLD_RANK");
        if (r) snprintf(bus_rank, sizeof bus_rank, "%.15s", r);
        struct sigaction sa = {0};
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO;
        sigemptyset(&sa.sa_mask);
        bus_installed = sigaction(SIGBUS, &sa, &bus_old) == 0;
    }
    for (int i = 0; i < BUS_MAPS; i++)
        if (!atomic_load(&bus_maps[i].base)) {
            bus_maps[i].n_bytes = n_bytes;
            snprintf(bus_maps[i].path, sizeof bus_maps[i].path, "%s", path);
            atomic_store(&bus_maps[i].base, base); /* published last: the handler reads base */
            break;
        }
    pthread_mutex_unlock(&bus_mu);
}

static void bus_unregister(const uint8_t *base) {
    pthread_mutex_lock(&bus_mu);
    for (int i = 0; i < BUS_MAPS; i++)
        if (atomic_load(&bus_maps[i].base) == base) atomic_store(&bus_maps[i].base, NULL);
    pthread_mutex_unlock(&bus_mu);
}

k3_status k3_ckpt_map_shard(const k3_ckpt *ck, int shard, k3_ckpt_map *out) {
    memset(out, 0, sizeof *out);
    const char *path = k3_ckpt_shard_path(ck, shard);
    const uint64_t size = k3_ckpt_shard_size(ck, shard);
    if (!path) return K3_ERR(K3_ERR_ARG, "k3_ckpt_map_shard: no shard %d", shard);
    int fd = -1;
    uint64_t now = 0;
    K3_TRY(k3_open_regular(path, 0, K3_ERR_IO, &fd, &now));
    if (now != size || size == 0 || size > SIZE_MAX - 2 * MAP_ALIGN) {
        close(fd);
        return K3_ERR(K3_ERR_IO, "%s: %llu bytes now, %llu when the checkpoint was opened", path,
                      (unsigned long long)now, (unsigned long long)size);
    }
    /* reserve size + 2 MB of address space, then map the file at its first 2 MB boundary */
    const size_t span = (size_t)size + MAP_ALIGN;
    uint8_t *res = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (res == MAP_FAILED) {
        close(fd);
        return K3_ERR(K3_ERR_NOMEM, "%s: cannot reserve %zu bytes of address space: %s", path, span,
                      strerror(errno));
    }
    uint8_t *at = (uint8_t *)(((uintptr_t)res + MAP_ALIGN - 1) & ~(uintptr_t)(MAP_ALIGN - 1));
    void *p = mmap(at, (size_t)size, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0);
    const int err = errno;
    close(fd); /* the mapping keeps the file */
    if (p == MAP_FAILED) {
        munmap(res, span);
        return K3_ERR(K3_ERR_IO, "%s: cannot map it: %s", path, strerror(err));
    }
#ifdef MADV_HUGEPAGE
    (void)madvise(at, (size_t)size, MADV_HUGEPAGE); /* advice only */
#endif
    out->base = at;
    out->n_bytes = size;
    out->reserve = res;
    out->reserve_bytes = span;
    bus_register(at, size, path);
    return K3_OK;
}

void k3_ckpt_unmap(k3_ckpt_map *m) {
    if (m && m->base) bus_unregister(m->base);
    if (m && m->reserve) munmap(m->reserve, m->reserve_bytes);
    if (m) memset(m, 0, sizeof *m);
}

k3_status k3_ckpt_map_populate(k3_ckpt *ck, int shard, const k3_ckpt_map *m, uint64_t off,
                               uint64_t n) {
    if (off > m->n_bytes || n > m->n_bytes - off)
        return K3_ERR(K3_ERR_ARG, "k3_ckpt_map_populate: bytes [%llu, +%llu) outside the map",
                      (unsigned long long)off, (unsigned long long)n);
    if (n == 0) return K3_OK;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t a = (uintptr_t)(m->base + off) & ~(page - 1);
    const uintptr_t e = (uintptr_t)(m->base + off + n);
    int err;
    do /* the whole range again after an interruption */
        err = madvise((void *)a, e - a, MADV_POPULATE_READ) == 0 ? 0 : errno;
    while (err == EINTR || err == EAGAIN);
    const char *path = k3_ckpt_shard_path(ck, shard);
    if (err == EINVAL)
        return K3_ERR(K3_ERR_IO,
                      "%s: this kernel cannot populate a mapping (MADV_POPULATE_READ, Linux 5.14); "
                      "load without --load-mmap",
                      path);
    if (err)
        return K3_ERR(K3_ERR_IO, "%s: bytes [%llu, %llu) could not be read into memory: %s%s", path,
                      (unsigned long long)off, (unsigned long long)(off + n), strerror(err),
                      err == EFAULT ? " (the file shrank?)" : "");
    return K3_OK;
}

typedef struct pop_job {
    k3_ckpt *ck;
    const k3_ckpt_map *maps;
    const k3_map_range *r;
    int64_t n;
    _Atomic int64_t next;
    _Atomic uint64_t done;
    uint64_t total; /* tensor bytes of all the ranges */
    atomic_bool stop;
    pthread_mutex_t mu;
    k3_status err; /* the first error, its message */
    char msg[1024];
} pop_job;

/* Take ranges until none is left or another thread failed; the caller's thread reports. */
static k3_status pop_work(pop_job *J, k3_status (*progress)(void *, uint64_t, uint64_t),
                          void *ctx) {
    k3_status st = K3_OK;
    while (st == K3_OK && !atomic_load(&J->stop)) {
        const int64_t i = atomic_fetch_add(&J->next, 1);
        if (i >= J->n) break;
        const k3_map_range *x = &J->r[i];
        st = k3_ckpt_map_populate(J->ck, x->shard, &J->maps[x->shard], x->off, x->n);
        const uint64_t d = atomic_fetch_add(&J->done, x->tensor_bytes) + x->tensor_bytes;
        if (st == K3_OK && progress) st = progress(ctx, d, J->total);
    }
    if (st != K3_OK) {
        pthread_mutex_lock(&J->mu);
        if (J->err == K3_OK) {
            J->err = st;
            k3_error_capture(J->msg, sizeof J->msg);
        }
        pthread_mutex_unlock(&J->mu);
        atomic_store(&J->stop, true);
    }
    return st;
}
static void *pop_thread(void *arg) {
    (void)pop_work(arg, NULL, NULL);
    return NULL;
}

k3_status k3_ckpt_map_populate_many(k3_ckpt *ck, const k3_ckpt_map *maps, const k3_map_range *r,
                                    int64_t n, int n_threads,
                                    k3_status (*progress)(void *ctx, uint64_t done, uint64_t total),
                                    void *ctx) {
    pop_job J = {.ck = ck, .maps = maps, .r = r, .n = n, .err = K3_OK};
    for (int64_t i = 0; i < n; i++) J.total += r[i].tensor_bytes;
    atomic_init(&J.next, 0);
    atomic_init(&J.done, 0);
    atomic_init(&J.stop, false);
    pthread_mutex_init(&J.mu, NULL);
    enum { MAX_THREADS = 64 };
    pthread_t th[MAX_THREADS];
    int started = 0;
    const int want = (int)K3_MIN((int64_t)K3_MIN(n_threads, MAX_THREADS), n) - 1;
    while (started < want && pthread_create(&th[started], NULL, pop_thread, &J) == 0) started++;
    (void)pop_work(&J, progress, ctx);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    pthread_mutex_destroy(&J.mu);
    if (J.err != K3_OK) return K3_ERR(J.err, "%s", J.msg);
    return progress ? progress(ctx, J.total, J.total) : K3_OK; /* all of it, at the end */
}

/* A "Name:   N kB" line's bytes, or -1 for another line. */
static int64_t smaps_kb(const char *line, const char *name) {
    const size_t k = strlen(name);
    if (strncmp(line, name, k) != 0) return -1;
    return (int64_t)strtoll(line + k, NULL, 10) * 1024;
}

k3_status k3_ckpt_map_pmd(const k3_ckpt_map *m, int n, uint64_t *rss, uint64_t *pmd) {
    *rss = *pmd = 0;
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return K3_ERR(K3_ERR_IO, "/proc/self/smaps: %s", strerror(errno));
    char line[256];
    bool in = false;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            in = false;
            for (int i = 0; i < n && !in; i++)
                in = m[i].base && lo < (uintptr_t)(m[i].base + m[i].n_bytes) &&
                     hi > (uintptr_t)m[i].base;
            continue;
        }
        int64_t v;
        if (in && (v = smaps_kb(line, "Rss:")) >= 0) *rss += (uint64_t)v;
        if (in && (v = smaps_kb(line, "FilePmdMapped:")) >= 0) *pmd += (uint64_t)v;
    }
    fclose(f);
    return K3_OK;
}
