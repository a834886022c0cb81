/* base.c — status messages, logger, PRNG, small helpers. See k3_base.h.
 * The error buffer is thread-local; the log context is written once at start-up before any
 * threads exist and only read afterwards. */
#define _POSIX_C_SOURCE 200809L
#include "k3_base.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const status_names[K3_STATUS_COUNT] = {
    "ok",
    "bad argument",
    "I/O error",
    "format error",
    "config error",
    "missing",
    "shape/dtype mismatch",
    "out of memory",
    "communication error",
    "device error",
    "invalid state",
    "internal error",
};
_Static_assert(K3_ARRAY_LEN(status_names) == K3_STATUS_COUNT, "one name per status");

const char *k3_status_name(k3_status s) {
    return (s >= 0 && s < K3_STATUS_COUNT) ? status_names[s] : "unknown status";
}

static _Thread_local char err_buf[2048];

k3_status k3_set_error(k3_status s, const char *file, int line, const char *fmt, ...) {
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    char msg[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(err_buf, sizeof err_buf, "%s (%s:%d)", msg, base, line);
    return s;
}

const char *k3_last_error(void) {
    return err_buf;
}
void k3_clear_error(void) {
    err_buf[0] = 0;
}

_Noreturn void k3_assert_fail(const char *expr, const char *file, int line) {
    k3_log(K3_LOG_ERROR, "assertion failed: %s (%s:%d)", expr, file, line);
    abort();
}

/* ---- logger ---- */
static struct {
    int rank, stage, lane;
    k3_log_level level;
} log_ctx = {-1, -1, -1, K3_LOG_INFO};

void k3_log_set_rank(int rank, int stage, int lane) {
    log_ctx.rank = rank;
    log_ctx.stage = stage;
    log_ctx.lane = lane;
}
void k3_log_set_level(k3_log_level lvl) {
    log_ctx.level = lvl;
}

void k3_log(k3_log_level lvl, const char *fmt, ...) {
    if (lvl < log_ctx.level) return;
    static const char tag[] = "DIWE";
    char head[48], msg[4096];
    int n = snprintf(head, sizeof head, "[k3");
    if (log_ctx.rank >= 0) n += snprintf(head + n, sizeof head - (size_t)n, " r%02d", log_ctx.rank);
    if (log_ctx.stage >= 0) n += snprintf(head + n, sizeof head - (size_t)n, " s%d", log_ctx.stage);
    if (log_ctx.lane >= 0) n += snprintf(head + n, sizeof head - (size_t)n, " e%d", log_ctx.lane);
    snprintf(head + n, sizeof head - (size_t)n, " %c]", tag[lvl]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s %s\n", head, msg); /* one call: lines from ranks do not interleave */
}

/* ---- PRNG ---- */
static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
void k3_rng_seed(k3_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}
static inline uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}
uint64_t k3_rng_u64(k3_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}
double k3_rng_uniform(k3_rng *r) {
    return (double)(k3_rng_u64(r) >> 11) * 0x1.0p-53;
}
float k3_rng_normal(k3_rng *r) {
    double u1 = k3_rng_uniform(r), u2 = k3_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}
uint64_t k3_hash_bytes(const void *p, size_t n_bytes, uint64_t h) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n_bytes; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* ---- numbers ---- */
float k3_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- time / memory ---- */
int k3_local_rank(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                                       "MPI_LOCALRANKID"};
    for (size_t i = 0; i < K3_ARRAY_LEN(vars); i++) {
        const char *s = getenv(vars[i]);
        if (s && *s) return atoi(s);
    }
    return 0;
}

double k3_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

k3_status k3_alloc(void **out, size_t n_bytes, const char *what) {
    *out = NULL;
    if (n_bytes == 0) n_bytes = 1;
    size_t rounded = (n_bytes + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, rounded);
    if (!p) return K3_ERR(K3_ERR_NOMEM, "cannot allocate %zu bytes for %s", n_bytes, what);
    *out = p;
    return K3_OK;
}
k3_status k3_calloc(void **out, size_t n_bytes, const char *what) {
    K3_TRY(k3_alloc(out, n_bytes, what));
    memset(*out, 0, n_bytes);
    return K3_OK;
}
/* Buffers of K3_ALLOC_HUGE bytes or more go on 2 MB boundaries in whole 2 MB units, advised
 * MADV_HUGEPAGE: with transparent huge pages in their usual "madvise" mode the kernel backs them
 * with 2 MB pages. A decode step streams every weight once; on 4 KB pages that is a TLB miss per
 * 4 KB (~75k per token of the small preset), measured here ~10% of its decode time. Without THP
 * (or where madvise fails) the buffer is an ordinary one. */
#define K3_ALLOC_HUGE ((size_t)8 << 20)
#define K3_HUGE_PAGE  ((size_t)2 << 20)
k3_status k3_alloc_large(void **out, size_t n_bytes, const char *what) {
    if (n_bytes < K3_ALLOC_HUGE) return k3_alloc(out, n_bytes, what);
    *out = NULL;
    const size_t rounded = (n_bytes + K3_HUGE_PAGE - 1) & ~(K3_HUGE_PAGE - 1);
    void *p = NULL;
    if (rounded < n_bytes || posix_memalign(&p, K3_HUGE_PAGE, rounded) != 0 || !p)
        return K3_ERR(K3_ERR_NOMEM, "cannot allocate %zu bytes for %s", n_bytes, what);
#ifdef MADV_HUGEPAGE
    (void)madvise(p, rounded, MADV_HUGEPAGE); /* advice only: EINVAL without THP is fine */
#endif
    *out = p;
    return K3_OK;
}
k3_status k3_calloc_large(void **out, size_t n_bytes, const char *what) {
    K3_TRY(k3_alloc_large(out, n_bytes, what));
    memset(*out, 0, n_bytes);
    return K3_OK;
}
void k3_free(void *p) {
    free(p);
}

k3_status k3_open_regular(const char *path, int flags, k3_status missing, int *fd,
                          uint64_t *n_bytes) {
    *fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | flags);
    if (*fd < 0)
        return K3_ERR(errno == ENOENT ? missing : K3_ERR_IO, "%s: cannot open: %s", path,
                      strerror(errno));
    /* A directory opens fine and "seeks" to LONG_MAX, a FIFO blocks its reads: regular only. */
    struct stat sb;
    const int fl = fcntl(*fd, F_GETFL);
    if (fstat(*fd, &sb) != 0 || !S_ISREG(sb.st_mode) || fl < 0 ||
        fcntl(*fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        const bool reg = S_ISREG(sb.st_mode), dir = S_ISDIR(sb.st_mode);
        close(*fd);
        *fd = -1;
        if (reg) return K3_ERR(K3_ERR_IO, "%s: stat failed: %s", path, strerror(errno));
        return K3_ERR(K3_ERR_IO, "%s: not a regular file%s", path,
                      dir                    ? " (it is a directory)"
                      : S_ISFIFO(sb.st_mode) ? " (it is a FIFO)"
                                             : "");
    }
    if (n_bytes) *n_bytes = (uint64_t)sb.st_size;
    return K3_OK;
}

k3_status k3_read_file(const char *path, char **out, size_t *n_bytes) {
    *out = NULL;
    int fd;
    uint64_t size;
    K3_TRY(k3_open_regular(path, 0, K3_ERR_IO, &fd, &size));
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return K3_ERR(K3_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    struct stat sb = {.st_size = (off_t)size};
    if (sb.st_size > K3_READ_FILE_MAX) {
        fclose(f);
        return K3_ERR(K3_ERR_IO, "%s: %lld bytes is over the %lld-byte limit for this file", path,
                      (long long)sb.st_size, (long long)K3_READ_FILE_MAX);
    }
    long n = (long)sb.st_size;
    char *buf;
    k3_status s = k3_alloc((void **)&buf, (size_t)n + 1, path);
    if (s != K3_OK) {
        fclose(f);
        return s;
    }
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        k3_free(buf);
        goto io;
    }
    buf[n] = 0;
    fclose(f);
    *out = buf;
    if (n_bytes) *n_bytes = (size_t)n;
    return K3_OK;
io:
    fclose(f);
    return K3_ERR(K3_ERR_IO, "%s: read failed: %s", path, strerror(errno));
}
