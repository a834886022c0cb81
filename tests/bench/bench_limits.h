/* bench_limits.h — this machine's limits, measured (never assumed): the STREAM triad bandwidth
 * and the fp32 FMA peak, for n threads; and the helpers the benchmarks share (median, JSON out).
 * bench_forward and bench_kernels report their numbers as a fraction of these limits.
 * Benchmarks only (never pass/fail, STYLE.md §22). */
#ifndef K3_BENCH_LIMITS_H
#define K3_BENCH_LIMITS_H

typedef struct {
    int threads;
    double triad_gbs;  /* a[i] = b[i] + s·c[i], 3 × 4 bytes per element (no write-allocate) */
    double fma_gflops; /* independent fp32 FMA chains in registers, widest ISA the CPU has */
    const char *fma_isa;
} bench_limits;

/* Median of `reps` runs each; triad arrays of 3 × n_mb MB (well past the caches). */
void bench_measure_limits(int threads, int reps, int n_mb, bench_limits *out);
/* Print `root` as JSON to path (cJSON *; frees it); "wrote PATH" on stdout, or a message naming
 * prog on stderr. Returns 0, or 1 when the file cannot be written. */
int bench_write_json(void *root, const char *path, const char *prog);
/* Median of n doubles (sorts a copy of at most 64). */
double bench_median(const double *v, int n);

#endif /* K3_BENCH_LIMITS_H */
