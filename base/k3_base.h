/* base — the few things every module shares: status codes and error context, the logger,
 * a deterministic PRNG, bf16/fp helpers, monotonic time.
 *
 * Owns: k3_status and the thread-local error message; the process-wide log context (rank,
 * stage, lane) set once at start-up by the launcher.
 * Callers must not: print errors themselves below the top level (return a status instead),
 * or use rand()/time() for anything a test depends on (use k3_rng).
 * Invariant: a function that returns K3_OK leaves the error message untouched. */
#ifndef K3_BASE_H
#define K3_BASE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ---- status ---------------------------------------------------------------------------- */
typedef enum k3_status {
    K3_OK = 0,
    K3_ERR_ARG,      /* bad flag / argument / request                        */
    K3_ERR_IO,       /* open/read/write failed                                */
    K3_ERR_FORMAT,   /* a file is malformed (JSON, safetensors header, ...)   */
    K3_ERR_CONFIG,   /* config.json value missing or invalid                  */
    K3_ERR_MISSING,  /* a tensor or file that must exist does not             */
    K3_ERR_SHAPE,    /* dtype or shape mismatch                               */
    K3_ERR_NOMEM,    /* allocation failed                                     */
    K3_ERR_COMM,     /* MPI/NCCL failure or timeout                           */
    K3_ERR_DEVICE,   /* CUDA failure                                          */
    K3_ERR_STATE,    /* API misuse, capacity exhausted                        */
    K3_ERR_INTERNAL, /* a bug                                                 */
    K3_STATUS_COUNT
} k3_status;

const char *k3_status_name(k3_status s);

/* Record an error: formats "file:line: message" into the thread-local buffer and returns `s`.
 * Use through K3_ERR so file/line are filled in. */
k3_status k3_set_error(k3_status s, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define K3_ERR(status, ...) k3_set_error((status), __FILE__, __LINE__, __VA_ARGS__)
/* The last recorded message of this thread ("" if none). */
const char *k3_last_error(void);
void k3_clear_error(void);

#define K3_TRY(expr)                                                                               \
    do {                                                                                           \
        k3_status k3_try_s_ = (expr);                                                              \
        if (k3_try_s_ != K3_OK) return k3_try_s_;                                                  \
    } while (0)

/* Asserts stay on in release builds; the expression must have no side effects. */
#define K3_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (!(cond)) k3_assert_fail(#cond, __FILE__, __LINE__);                                    \
    } while (0)
_Noreturn void k3_assert_fail(const char *expr, const char *file, int line);

/* ---- logging --------------------------------------------------------------------------- */
/* "[k3 r03 s1 e2 W] message" on stderr. stdout carries only results. */
typedef enum { K3_LOG_DEBUG = 0, K3_LOG_INFO, K3_LOG_WARN, K3_LOG_ERROR } k3_log_level;
void k3_log_set_rank(int rank, int stage, int lane); /* -1 = unknown / not applicable */
void k3_log_set_level(k3_log_level lvl);
void k3_log(k3_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define K3_LOGD(...) k3_log(K3_LOG_DEBUG, __VA_ARGS__)
#define K3_LOGI(...) k3_log(K3_LOG_INFO, __VA_ARGS__)
#define K3_LOGW(...) k3_log(K3_LOG_WARN, __VA_ARGS__)
#define K3_LOGE(...) k3_log(K3_LOG_ERROR, __VA_ARGS__)

/* ---- PRNG (xoshiro256**, seeded by splitmix64) ------------------------------------------ */
typedef struct k3_rng {
    uint64_t s[4];
} k3_rng;
void k3_rng_seed(k3_rng *r, uint64_t seed);
uint64_t k3_rng_u64(k3_rng *r);
double k3_rng_uniform(k3_rng *r); /* [0, 1), 53 random bits */
float k3_rng_normal(k3_rng *r);   /* N(0,1), Box-Muller */
/* A stable 64-bit hash (FNV-1a) — for seeding per-tensor streams and plan hashes. */
uint64_t k3_hash_bytes(const void *p, size_t n_bytes, uint64_t h);
#define K3_HASH_INIT 0xcbf29ce484222325ull

/* ---- numbers --------------------------------------------------------------------------- */
/* bf16 <-> f32. f32->bf16 rounds to nearest even; NaN stays NaN. */
static inline float k3_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t k3_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
float k3_f16_to_f32(uint16_t h);

/* ---- time / memory --------------------------------------------------------------------- */
double k3_now_s(void); /* monotonic seconds */
/* This process's rank on its node, from the launcher's environment (OMPI_COMM_WORLD_LOCAL_RANK,
 * SLURM_LOCALID, MPI_LOCALRANKID; 0 when none is set): which local device a rank takes. */
int k3_local_rank(void);
/* Allocation helpers that set a K3_ERR_NOMEM message naming `what`. 64-byte aligned. */
k3_status k3_alloc(void **out, size_t n_bytes, const char *what);
k3_status k3_calloc(void **out, size_t n_bytes, const char *what);
/* The same for large buffers that are streamed (weights, benchmark arrays): from 8 MB up, 2 MB
 * aligned and advised MADV_HUGEPAGE (base.c). Freed with k3_free. */
k3_status k3_alloc_large(void **out, size_t n_bytes, const char *what);
k3_status k3_calloc_large(void **out, size_t n_bytes, const char *what);
void k3_free(void *p);
/* Read a whole (small) regular file into a NUL-terminated buffer; caller frees with k3_free.
 * Directories, devices and files over K3_READ_FILE_MAX are errors naming the path. */
#define K3_READ_FILE_MAX ((int64_t)1 << 32)
k3_status k3_read_file(const char *path, char **out, size_t *n_bytes);
/* open(path, O_RDONLY | O_CLOEXEC | flags) of a regular file only, never blocking in open: a FIFO
 * (or a device) would hang open() until a writer came, past every timeout, so it is opened
 * non-blocking, checked with fstat and refused. *fd, and its size in *n_bytes (may be NULL).
 * A path that does not exist is `missing` (K3_ERR_MISSING or K3_ERR_IO, as the caller reports it);
 * any other failure K3_ERR_IO. */
k3_status k3_open_regular(const char *path, int flags, k3_status missing, int *fd,
                          uint64_t *n_bytes);

#define K3_MIN(a, b)    ((a) < (b) ? (a) : (b))
#define K3_MAX(a, b)    ((a) > (b) ? (a) : (b))
#define K3_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#endif /* K3_BASE_H */
