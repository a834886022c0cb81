/* bench_limits.c — this machine's limits, measured (never assumed): the STREAM triad bandwidth
 * and the fp32 FMA peak for n threads (bench.h). `k3 bench kernels`, `k3 run --bench-limits` and
 * tests/bench/bench_forward report their numbers as fractions of these.
 *
 * Owns: the two probes and how they are taken. Threads are plain pthreads (each owns a
 * contiguous slice of the arrays and first-touches it); the FMA kernels are compiled per ISA
 * with target attributes and picked by cpuid, like the cpu backend's kernels.
 * Robustness: on a shared machine interference only ever slows a probe down, so the bound is the
 * BEST of its trials (the median is reported beside it; the triad runs 2 x `trials`, its trials
 * being short and noisier). A triad trial streams three arrays of `array_bytes` each (default
 * 2 x L3, so it measures DRAM, not the cache); an FMA trial runs
 * 12 independent FMA chains per thread for at least BENCH_FMA_TRIAL_S seconds of that thread's
 * CPU time, and its rate is Σ over threads of FLOPs / the thread's CPU time: what the cores do
 * while they run, which time-slicing by other processes on a shared machine does not lower (the
 * wall-clock rate is kept beside it). One untimed triad pass faults the pages in. */
#include "bench.h"

#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BENCH_FMA_TRIAL_S 0.2
#define BENCH_MAX_THREADS 256
#define BENCH_MAX_TRIALS  32 /* of the FMA probe; the triad runs twice as many */

int64_t bench_big_bytes(void) {
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return 2 * (l3 > 0 ? (int64_t)l3 : (int64_t)256 << 20);
}

/* ---- triad ----------------------------------------------------------------------------------- */
typedef struct {
    float *a, *b, *c;
    size_t n;
    int trials; /* + 1 untimed pass first */
    pthread_barrier_t *bar;
    double *t;  /* [trials] per-trial time of this thread: triad */
    double *tr; /* [trials] the same: read (Σ b + c) */
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
/* Σ (b + c) with 4 vector accumulators: a read-only stream (a matmul's weights are read-only;
 * the triad's stores cost bandwidth a decode does not spend). */
__attribute__((target("avx"))) static float read_avx(const float *b, const float *c, size_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i < n; i += 16) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(b + i));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(b + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_loadu_ps(c + i));
        s3 = _mm256_add_ps(s3, _mm256_loadu_ps(c + i + 8));
    }
    float o[8];
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    return o[0];
}
static float read_kernel(const float *b, const float *c, size_t n) {
    if (__builtin_cpu_supports("avx")) return read_avx(b, c, n);
    float s = 0;
    for (size_t i = 0; i < n; i++) s += b[i] + c[i];
    return s;
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
    for (int r = -1; r < t->trials; r++) {
        pthread_barrier_wait(t->bar);
        double t0 = k3_now_s();
        triad_kernel(t->a, t->b, t->c, t->n);
        pthread_barrier_wait(t->bar);
        if (r >= 0) t->t[r] = k3_now_s() - t0;
    }
    volatile float sink = 0;
    for (int r = 0; r < t->trials; r++) {
        pthread_barrier_wait(t->bar);
        double t0 = k3_now_s();
        sink += read_kernel(t->b, t->c, t->n);
        pthread_barrier_wait(t->bar);
        t->tr[r] = k3_now_s() - t0;
    }
    (void)sink;
    return NULL;
}

/* g[trials]: GB/s of each triad trial (3 x 4 bytes per element: no write-allocate counted);
 * gr[trials]: of each read trial (2 x 4 bytes per element). */
static k3_status triad(int threads, int trials, int64_t array_bytes, double *g, double *gr) {
    size_t n = (size_t)array_bytes / sizeof(float);
    n -= n % (size_t)(16 * threads);
    if (n == 0)
        return K3_ERR(K3_ERR_ARG, "bench limits: triad arrays of %lld bytes are too small",
                      (long long)array_bytes);
    /* on 2 MB pages where THP allows, as the weights (k3_alloc_large): the bound is the one
       the engine's own buffers can reach */
    float *a = NULL, *b = NULL, *c = NULL;
    if (k3_alloc_large((void **)&a, n * 4, "triad array a") != K3_OK ||
        k3_alloc_large((void **)&b, n * 4, "triad array b") != K3_OK ||
        k3_alloc_large((void **)&c, n * 4, "triad array c") != K3_OK)
        k3_clear_error(); /* reported below as one message */
    double(*times)[2 * BENCH_MAX_TRIALS] = calloc((size_t)threads, sizeof *times);
    double(*rtimes)[2 * BENCH_MAX_TRIALS] = calloc((size_t)threads, sizeof *rtimes);
    triad_arg *args = calloc((size_t)threads, sizeof *args);
    pthread_t *th = calloc((size_t)threads, sizeof *th);
    k3_status st = K3_OK;
    if (!a || !b || !c || !times || !rtimes || !args || !th)
        st = K3_ERR(K3_ERR_NOMEM, "bench limits: triad arrays of 3 x %lld bytes",
                    (long long)(n * 4));
    if (st == K3_OK) {
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, (unsigned)threads);
        size_t per = n / (size_t)threads;
        int started = 1;
        for (int i = 0; i < threads; i++) {
            args[i] = (triad_arg){.a = a + per * i,
                                  .b = b + per * i,
                                  .c = c + per * i,
                                  .n = per,
                                  .trials = trials,
                                  .bar = &bar,
                                  .t = times[i],
                                  .tr = rtimes[i]};
            if (i && pthread_create(&th[i], NULL, triad_thread, &args[i]) == 0) started++;
        }
        K3_ASSERT(started == threads); /* a barrier of `threads` would never open otherwise */
        triad_thread(&args[0]);
        for (int i = 1; i < threads; i++) pthread_join(th[i], NULL);
        pthread_barrier_destroy(&bar);
        for (int r = 0; r < trials; r++) {
            double tmax = 0, rmax = 0;
            for (int i = 0; i < threads; i++)
                tmax = K3_MAX(tmax, times[i][r]), rmax = K3_MAX(rmax, rtimes[i][r]);
            g[r] = 3.0 * 4.0 * (double)(per * (size_t)threads) / tmax / 1e9;
            gr[r] = 2.0 * 4.0 * (double)(per * (size_t)threads) / rmax / 1e9;
        }
    }
    k3_free(a), k3_free(b), k3_free(c), free(times), free(rtimes), free(args), free(th);
    return st;
}

/* ---- FMA peak: 12 independent chains per thread (covers 2 pipes x latency 4-6) -------------- */
#define FMA_BLOCK 1000000L
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
    double flops, secs, cpu_s;
    pthread_barrier_t *bar;
} fma_arg;

static double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Blocks of FMA_BLOCK iterations until this thread has run BENCH_FMA_TRIAL_S of CPU time. */
static void *fma_thread(void *p) {
    fma_arg *f = p;
    volatile float sink;
    pthread_barrier_wait(f->bar);
    const double t0 = k3_now_s(), c0 = thread_cpu_s();
    double c = c0;
    f->flops = 0;
    while (c - c0 < BENCH_FMA_TRIAL_S) {
        f->flops += f->wide == 2 ? fma512(FMA_BLOCK, &sink) : fma256(FMA_BLOCK, &sink);
        c = thread_cpu_s();
    }
    f->secs = k3_now_s() - t0;
    f->cpu_s = c - c0;
    return NULL;
}

/* g[r]: Σ FLOPs / CPU time of trial r; gw[r]: Σ FLOPs / the slowest thread's wall time. */
static void fma_peak(int threads, int trials, int wide, double *g, double *gw) {
    fma_arg *a = calloc((size_t)threads, sizeof *a);
    pthread_t *th = calloc((size_t)threads, sizeof *th);
    K3_ASSERT(a && th);
    for (int r = 0; r < trials; r++) {
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, (unsigned)threads);
        int started = 1;
        for (int i = 0; i < threads; i++) {
            a[i] = (fma_arg){.wide = wide, .bar = &bar};
            if (i && pthread_create(&th[i], NULL, fma_thread, &a[i]) == 0) started++;
        }
        K3_ASSERT(started == threads);
        fma_thread(&a[0]);
        double flops = a[0].flops, tmax = a[0].secs, rate = a[0].flops / a[0].cpu_s;
        for (int i = 1; i < threads; i++) {
            pthread_join(th[i], NULL);
            flops += a[i].flops;
            tmax = K3_MAX(tmax, a[i].secs);
            rate += a[i].flops / a[i].cpu_s;
        }
        pthread_barrier_destroy(&bar);
        g[r] = rate / 1e9;
        gw[r] = flops / tmax / 1e9;
    }
    free(a), free(th);
}

static void best_median(double *v, int n, double *best, double *median) {
    bench_stats s;
    bench_stats_of(v, n, &s); /* sorts */
    *best = v[n - 1];
    *median = s.median;
}

/* The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled ("unknown" without it). */
static void thp_mode(char *out, size_t n) {
    snprintf(out, n, "unknown");
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return;
    char line[128], *a, *b;
    if (fgets(line, sizeof line, f) && (a = strchr(line, '[')) && (b = strchr(a, ']'))) {
        *b = 0;
        snprintf(out, n, "%s", a + 1);
    }
    fclose(f);
}

k3_status bench_measure_limits(int threads, int trials, int64_t array_bytes, bench_limits *out) {
    memset(out, 0, sizeof *out);
    if (threads < 1 || threads > BENCH_MAX_THREADS || trials < 1 || trials > BENCH_MAX_TRIALS)
        return K3_ERR(K3_ERR_ARG, "bench limits: threads in [1, %d], trials in [1, %d]",
                      BENCH_MAX_THREADS, BENCH_MAX_TRIALS);
    if (array_bytes <= 0) array_bytes = bench_big_bytes();
    __builtin_cpu_init();
    out->threads = threads;
    out->trials = trials;
    out->triad_trials = 2 * trials;
    out->triad_bytes = array_bytes;
    out->fma_trial_s = BENCH_FMA_TRIAL_S;
    thp_mode(out->thp, sizeof out->thp);
    double g[2 * BENCH_MAX_TRIALS], gr[2 * BENCH_MAX_TRIALS], gw[BENCH_MAX_TRIALS], unused;
    K3_TRY(triad(threads, out->triad_trials, array_bytes, g, gr));
    best_median(g, out->triad_trials, &out->triad_gbs, &out->triad_gbs_median);
    best_median(gr, out->triad_trials, &out->read_gbs, &out->read_gbs_median);
    int wide = __builtin_cpu_supports("avx512f")                                 ? 2
               : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1
                                                                                 : 0;
    out->fma_isa = wide == 2 ? "avx512" : wide == 1 ? "avx2" : "none";
    if (!wide) return K3_OK; /* no FMA unit to measure: the peak stays 0 (printed as such) */
    fma_peak(threads, trials, wide, g, gw);
    best_median(g, trials, &out->fma_gflops, &out->fma_gflops_median);
    best_median(gw, trials, &out->fma_gflops_wall, &unused);
    return K3_OK;
}

void bench_limits_describe(const bench_limits *l, char *buf, size_t n) {
    snprintf(buf, n,
             "%d threads: triad %.1f GB/s (best of %d trials over 3 arrays of %.0f MB, 2 MB pages "
             "advised, THP %s; median %.1f; a read-only stream %.1f), fp32 FMA peak %.1f GFLOP/s "
             "(%s, best of %d trials of "
             "%.1f s of each thread's CPU time; median %.1f; by wall clock %.1f)",
             l->threads, l->triad_gbs, l->triad_trials, (double)l->triad_bytes / 1e6, l->thp,
             l->triad_gbs_median, l->read_gbs, l->fma_gflops, l->fma_isa, l->trials, l->fma_trial_s,
             l->fma_gflops_median, l->fma_gflops_wall);
}

k3_status bench_put_limits(bench_row *m, const bench_limits *l) {
    char how[400];
    bench_limits_describe(l, how, sizeof how);
    K3_TRY(bench_put_str(m, "limits", "measured limits", how));
    K3_TRY(bench_put_num(m, "limits_threads", NULL, -1, l->threads));
    K3_TRY(bench_put_num(m, "limits_trials", NULL, -1, l->trials));
    K3_TRY(bench_put_num(m, "triad_trials", NULL, -1, l->triad_trials));
    K3_TRY(bench_put_num(m, "triad_gbs", NULL, 2, l->triad_gbs));
    K3_TRY(bench_put_num(m, "triad_gbs_median", NULL, 2, l->triad_gbs_median));
    K3_TRY(bench_put_num(m, "read_gbs", NULL, 2, l->read_gbs));
    K3_TRY(bench_put_num(m, "read_gbs_median", NULL, 2, l->read_gbs_median));
    K3_TRY(bench_put_num(m, "triad_array_bytes", NULL, -1, (double)l->triad_bytes));
    K3_TRY(bench_put_num(m, "fma_peak_gflops", NULL, 2, l->fma_gflops));
    K3_TRY(bench_put_num(m, "fma_peak_gflops_median", NULL, 2, l->fma_gflops_median));
    K3_TRY(bench_put_num(m, "fma_peak_gflops_wall", NULL, 2, l->fma_gflops_wall));
    K3_TRY(bench_put_str(m, "thp", NULL, l->thp));
    K3_TRY(bench_put_num(m, "fma_trial_s", NULL, 2, l->fma_trial_s));
    return bench_put_str(m, "fma_peak_isa", NULL, l->fma_isa);
}
