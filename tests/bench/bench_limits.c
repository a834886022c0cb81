/* bench_limits.c — the triad and FMA-peak probes of bench_limits.h. Threads are plain pthreads
 * (each owns a contiguous slice of the arrays, first-touched by itself); the FMA kernels are
 * compiled per ISA with target attributes and picked by cpuid, like the cpu backend's kernels. */
#include "bench_limits.h"

#include <cjson/cJSON.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double bench_median(const double *v, int n) {
    double s[64];
    if (n > 64) n = 64;
    if (n <= 0) return 0;
    memcpy(s, v, (size_t)n * sizeof *s);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && s[j - 1] > s[j]; j--) {
            double t = s[j];
            s[j] = s[j - 1];
            s[j - 1] = t;
        }
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

/* ---- triad ----------------------------------------------------------------------------------- */
typedef struct {
    float *a, *b, *c;
    size_t n;
    int reps;
    pthread_barrier_t *bar;
    double *t; /* [reps] per-rep time of this thread */
} triad_arg;

/* a = b + 3c with 256-bit vectors where the CPU has AVX (the default build targets plain x86-64,
 * whose scalar loop would measure the core, not the memory); n % 16 == 0. */
__attribute__((target("avx"))) static void triad_avx(float *a, const float *b, const float *c,
                                                     size_t n) {
    const __m256 s = _mm256_set1_ps(3.0f);
    for (size_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(
            a + i, _mm256_add_ps(_mm256_loadu_ps(b + i), _mm256_mul_ps(s, _mm256_loadu_ps(c + i))));
}
static void triad_kernel(float *a, const float *b, const float *c, size_t n) {
    if (__builtin_cpu_supports("avx")) {
        triad_avx(a, b, c, n);
        return;
    }
    for (size_t i = 0; i < n; i++) a[i] = b[i] + 3.0f * c[i];
}

static void *triad_thread(void *p) {
    triad_arg *t = p;
    for (size_t i = 0; i < t->n; i++) t->a[i] = 0.0f, t->b[i] = 1.0f, t->c[i] = 2.0f;
    for (int r = 0; r < t->reps; r++) {
        pthread_barrier_wait(t->bar);
        double t0 = now_s();
        triad_kernel(t->a, t->b, t->c, t->n);
        pthread_barrier_wait(t->bar);
        t->t[r] = now_s() - t0;
    }
    return NULL;
}

static double triad(int threads, int reps, int n_mb) {
    __builtin_cpu_init();
    size_t n = (size_t)n_mb * 1024 * 1024 / sizeof(float);
    n -= n % (size_t)(16 * threads);
    float *a = aligned_alloc(64, n * 4), *b = aligned_alloc(64, n * 4),
          *c = aligned_alloc(64, n * 4);
    double gbs = 0;
    if (a && b && c && reps <= 64) {
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, (unsigned)threads);
        pthread_t th[64];
        triad_arg args[64];
        double times[64][64];
        size_t per = n / (size_t)threads;
        for (int i = 0; i < threads; i++) {
            args[i] = (triad_arg){a + per * i, b + per * i, c + per * i, per, reps, &bar, times[i]};
            if (i) pthread_create(&th[i], NULL, triad_thread, &args[i]);
        }
        triad_thread(&args[0]);
        for (int i = 1; i < threads; i++) pthread_join(th[i], NULL);
        pthread_barrier_destroy(&bar);
        double g[64];
        for (int r = 0; r < reps; r++) {
            double tmax = 0;
            for (int i = 0; i < threads; i++) tmax = times[i][r] > tmax ? times[i][r] : tmax;
            g[r] = 3.0 * 4.0 * (double)(per * (size_t)threads) / tmax / 1e9;
        }
        gbs = bench_median(g + 1, reps - 1); /* the first rep also faults pages in */
    }
    free(a), free(b), free(c);
    return gbs;
}

/* ---- FMA peak: 12 independent chains per thread (covers 2 pipes × latency 4-6) -------------- */
#define FMA_ITERS 20000000L
#define FMA_BODY(VEC, SET1, FMA, ADD, STORE, LANES)                                                \
    VEC m = SET1(0.999999f), c = SET1(1e-7f);                                                      \
    VEC a0 = SET1(1), a1 = SET1(2), a2 = SET1(3), a3 = SET1(4), a4 = SET1(5), a5 = SET1(6);        \
    VEC a6 = SET1(7), a7 = SET1(8), a8 = SET1(9), a9 = SET1(10), a10 = SET1(11), a11 = SET1(12);   \
    for (long i = 0; i < iters; i++) {                                                             \
        a0 = FMA(a0, m, c), a1 = FMA(a1, m, c), a2 = FMA(a2, m, c), a3 = FMA(a3, m, c);            \
        a4 = FMA(a4, m, c), a5 = FMA(a5, m, c), a6 = FMA(a6, m, c), a7 = FMA(a7, m, c);            \
        a8 = FMA(a8, m, c), a9 = FMA(a9, m, c), a10 = FMA(a10, m, c), a11 = FMA(a11, m, c);        \
    }                                                                                              \
    VEC s = ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7)));                     \
    s = ADD(s, ADD(ADD(a8, a9), ADD(a10, a11)));                                                   \
    float o[LANES];                                                                                \
    STORE(o, s);                                                                                   \
    *sink = o[0];                                                                                  \
    return 12.0 * 2.0 * LANES * (double)iters;

__attribute__((target("avx512f"))) static double fma512(long iters, volatile float *sink) {
    FMA_BODY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_storeu_ps, 16)
}
__attribute__((target("avx2,fma"))) static double fma256(long iters, volatile float *sink) {
    FMA_BODY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_storeu_ps, 8)
}

typedef struct {
    int wide;
    double flops, secs;
    pthread_barrier_t *bar;
} fma_arg;
static void *fma_thread(void *p) {
    fma_arg *f = p;
    volatile float sink;
    pthread_barrier_wait(f->bar);
    double t0 = now_s();
    f->flops = f->wide == 2   ? fma512(FMA_ITERS, &sink)
               : f->wide == 1 ? fma256(FMA_ITERS, &sink)
                              : 0;
    f->secs = now_s() - t0;
    return NULL;
}

static double fma_peak(int threads, int reps, const char **isa) {
    __builtin_cpu_init();
    int wide = __builtin_cpu_supports("avx512f")                                 ? 2
               : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1
                                                                                 : 0;
    *isa = wide == 2 ? "avx512" : wide == 1 ? "avx2" : "none";
    if (!wide || reps > 64) return 0;
    double g[64];
    for (int r = 0; r < reps; r++) {
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, (unsigned)threads);
        pthread_t th[64];
        fma_arg a[64];
        for (int i = 0; i < threads; i++) {
            a[i] = (fma_arg){wide, 0, 0, &bar};
            if (i) pthread_create(&th[i], NULL, fma_thread, &a[i]);
        }
        fma_thread(&a[0]);
        double flops = a[0].flops, tmax = a[0].secs;
        for (int i = 1; i < threads; i++) {
            pthread_join(th[i], NULL);
            flops += a[i].flops;
            tmax = a[i].secs > tmax ? a[i].secs : tmax;
        }
        pthread_barrier_destroy(&bar);
        g[r] = flops / tmax / 1e9;
    }
    return bench_median(g, reps);
}

void bench_measure_limits(int threads, int reps, int n_mb, bench_limits *out) {
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (reps < 2) reps = 2;
    if (reps > 64) reps = 64;
    out->threads = threads;
    out->triad_gbs = triad(threads, reps, n_mb);
    out->fma_gflops = fma_peak(threads, reps, &out->fma_isa);
}

int bench_write_json(void *root, const char *path, const char *prog) {
    char *s = cJSON_Print(root);
    FILE *f = fopen(path, "w");
    int rc = 0;
    if (f && s) {
        fputs(s, f);
        fputc('\n', f);
        fclose(f);
        printf("wrote %s\n", path);
    } else {
        fprintf(stderr, "%s: cannot write %s\n", prog, path);
        if (f) fclose(f);
        rc = 1;
    }
    cJSON_free(s);
    cJSON_Delete(root);
    return rc;
}
