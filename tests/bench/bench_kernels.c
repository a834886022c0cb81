/* bench_kernels.c — the cpu backend's kernels against this machine's measured limits (never
 * pass/fail; STYLE.md §22). First measures the STREAM triad bandwidth and the fp32 FMA peak
 * (bench_limits.h) for --threads threads, then times each op on the cpu backend (the ISA cpuid
 * picks, or K3_ISA=avx512|avx2|scalar) and reports GB/s (bytes it must move: weights, inputs,
 * outputs) and GFLOP/s, each as % of the triad and of the peak. Matmuls are timed at T = 1
 * (decode: weight streaming, bandwidth-bound) and T = --prefill tokens (compute-bound), with
 * weights larger than the caches. Every number is the median of --reps runs.
 * Prints a table; writes JSON (--json FILE, default bench_kernels.json).
 * --backend NAME times another backend on the same shapes (cuda: inputs and weights uploaded
 * once; each sample is 20 calls and one synchronise, divided by 20; the % columns stay relative
 * to this host's measured limits, scripts/device-check.sh puts the device's beside them).
 * Usage: bench_kernels [--backend cpu|cuda|...] [--threads N] [--reps N] [--prefill T]
 *                      [--json FILE] */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_limits.h"
#include "k3_kernels.h"
#include "k3_kernels_internal.h" /* k3_cpu_isa_name */

typedef struct {
    char name[48];
    double secs, bytes, flops;
} bench_row;

static k3_backend *g_be;
static k3_rng g_rng;

static void fill(float *x, int64_t n, float sd) {
    for (int64_t i = 0; i < n; i++) x[i] = sd * k3_rng_normal(&g_rng);
}

/* A weight [out, in] of dtype dt with random contents (MXFP4: random codes, scales near 2^0). */
static k3_tensor make_weight(k3_dtype dt, int64_t out, int64_t in, void **mem, uint8_t **scale) {
    k3_tensor t = {.dtype = dt, .ndim = 2, .shape = {out, in}, .mem = K3_MEM_HOST};
    size_t n = (size_t)(out * in);
    size_t bytes = dt == K3_DT_F32 ? n * 4 : dt == K3_DT_BF16 ? n * 2 : n / 2;
    uint8_t *p = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) p[i] = (uint8_t)k3_rng_u64(&g_rng);
    if (dt == K3_DT_BF16) /* normal bf16 (random bits would be mostly huge or subnormal) */
        for (size_t i = 0; i < n; i++) ((uint16_t *)p)[i] = k3_f32_to_bf16(k3_rng_normal(&g_rng));
    if (dt == K3_DT_F32)
        for (size_t i = 0; i < n; i++) ((float *)p)[i] = k3_rng_normal(&g_rng);
    *scale = NULL;
    if (dt == K3_DT_MXFP4) {
        *scale = malloc(n / 32);
        for (size_t i = 0; i < n / 32; i++) (*scale)[i] = (uint8_t)(120 + k3_rng_u64(&g_rng) % 8);
    }
    t.data = p;
    t.scale = *scale;
    *mem = p;
    return t;
}

static double weight_bytes(const k3_tensor *W) {
    double n = (double)(W->shape[0] * W->shape[1]);
    return W->dtype == K3_DT_F32 ? 4 * n : W->dtype == K3_DT_BF16 ? 2 * n : n / 2 + n / 32;
}

typedef enum {
    OP_MATMUL,
    OP_MATMUL_TN,
    OP_SILU,
    OP_SIGMOID,
    OP_SITU,
    OP_SWIGLU,
    OP_SOFTMAX
} op_kind;

static k3_status run_op(op_kind k, const k3_tensor *W, const float *x, int64_t T, int64_t n,
                        float *y) {
    switch (k) {
    case OP_MATMUL:
        return g_be->ops->matmul(g_be, x, T, W, y);
    case OP_MATMUL_TN:
        return g_be->ops->matmul_tn(g_be, x, T, W, y);
    case OP_SILU:
        return g_be->ops->silu(g_be, x, n, y);
    case OP_SIGMOID:
        return g_be->ops->sigmoid(g_be, x, n, y);
    case OP_SITU:
        return g_be->ops->situ(g_be, x, x + n, n, 4.0f, 25.0f, y);
    case OP_SWIGLU:
        return g_be->ops->swiglu(g_be, x, x + n, n, y);
    default:
        return g_be->ops->softmax(g_be, x, T, n / T, y);
    }
}

/* A host array in the backend's memory: itself on host backends, else an uploaded copy. */
static void *on_be(const void *host, size_t n_bytes) {
    if (k3_backend_host_visible(g_be) || !host) return (void *)host;
    void *d = NULL;
    K3_ASSERT(k3_backend_alloc(g_be, n_bytes, "bench_kernels buffer", &d) == K3_OK);
    K3_ASSERT(k3_backend_upload(g_be, d, host, n_bytes) == K3_OK);
    return d;
}
static void off_be(void *dev) {
    if (!k3_backend_host_visible(g_be)) k3_backend_free(g_be, dev);
}

/* Median time of reps calls (after one warm-up call); a device backend's sample is `inner` calls
 * and one synchronise (launches are asynchronous). */
static double time_op(op_kind k, const k3_tensor *W, const float *x, int64_t T, int64_t n, float *y,
                      int reps) {
    double t[64];
    const int inner = k3_backend_host_visible(g_be) ? 1 : 20;
    if (run_op(k, W, x, T, n, y) != K3_OK || k3_backend_sync(g_be) != K3_OK) return -1;
    for (int r = 0; r < reps && r < 64; r++) {
        double t0 = k3_now_s();
        for (int i = 0; i < inner; i++) (void)run_op(k, W, x, T, n, y);
        if (k3_backend_sync(g_be) != K3_OK) return -1;
        t[r] = (k3_now_s() - t0) / inner;
    }
    return bench_median(t, reps < 64 ? reps : 64);
}

int main(int argc, char **argv) {
    int threads = 2, reps = 7, prefill = 64;
    const char *json_path = "bench_kernels.json", *backend = "cpu";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench_kernels: %s needs a value\n", a);
            return 2;
        }
        if (strcmp(a, "--threads") == 0)
            threads = atoi(v);
        else if (strcmp(a, "--reps") == 0)
            reps = atoi(v);
        else if (strcmp(a, "--prefill") == 0)
            prefill = atoi(v);
        else if (strcmp(a, "--json") == 0)
            json_path = v;
        else if (strcmp(a, "--backend") == 0)
            backend = v;
        else {
            fprintf(stderr, "bench_kernels: unknown flag %s\n", a);
            return 2;
        }
        i++;
    }
    if (threads < 1 || threads > 64 || reps < 1 || prefill < 1) {
        fprintf(stderr, "bench_kernels: --threads in [1, 64], --reps and --prefill >= 1\n");
        return 2;
    }
    if (k3_backend_create(backend, &(k3_backend_params){.n_threads = threads}, &g_be) != K3_OK) {
        fprintf(stderr, "bench_kernels: %s\n", k3_last_error());
        return 1;
    }
    k3_rng_seed(&g_rng, 7);
    bench_limits lim;
    bench_measure_limits(threads, reps, 256, &lim);
    printf("bench_kernels: %s backend, ISA %s, %d threads; measured triad %.1f GB/s, fp32 FMA "
           "peak %.1f GFLOP/s (%s)\n",
           g_be->name, k3_cpu_isa_name(g_be), threads, lim.triad_gbs, lim.fma_gflops, lim.fma_isa);

    /* weights past the caches: 64 MB f32, 64 MB bf16, 34 MB MXFP4 */
    const struct {
        k3_dtype dt;
        int64_t out, in;
    } ws[3] = {{K3_DT_F32, 4096, 4096}, {K3_DT_BF16, 8192, 4096}, {K3_DT_MXFP4, 16384, 4096}};
    const int64_t n_ew = (int64_t)1 << 24; /* elementwise: 64 MB per array, past any L3 */
    const int64_t x_floats = K3_MAX((int64_t)prefill * 16384, 2 * n_ew);
    float *x = malloc((size_t)x_floats * 4), *y = malloc((size_t)x_floats * 4);
    fill(x, x_floats, 1.0f);
    float *xh = x, *yh = y;
    x = on_be(xh, (size_t)x_floats * 4), y = on_be(yh, (size_t)x_floats * 4);
    bench_row rows[32];
    int nr = 0;
    for (int d = 0; d < 3; d++) {
        void *mem;
        uint8_t *scale;
        k3_tensor W = make_weight(ws[d].dt, ws[d].out, ws[d].in, &mem, &scale);
        W.data = on_be(W.data, (size_t)weight_bytes(&W) -
                                   (scale ? (size_t)(ws[d].out * ws[d].in / 32) : 0));
        W.scale = on_be(scale, scale ? (size_t)(ws[d].out * ws[d].in / 32) : 0);
        W.mem = g_be->mem;
        double wb = weight_bytes(&W), in = (double)ws[d].in, out = (double)ws[d].out;
        const int64_t Ts[2] = {1, prefill};
        for (int ti = 0; ti < 2; ti++) {
            int64_t T = Ts[ti];
            bench_row *r = &rows[nr++];
            snprintf(r->name, sizeof r->name, "matmul %s %lldx%lld T=%lld", k3_dtype_name(W.dtype),
                     (long long)ws[d].out, (long long)ws[d].in, (long long)T);
            r->secs = time_op(OP_MATMUL, &W, x, T, 0, y, reps);
            r->bytes = wb + 4.0 * (double)T * (in + out);
            r->flops = 2.0 * (double)T * in * out;
        }
        if (ws[d].dt == K3_DT_BF16) { /* the absorbed-MLA product: y = x·W, x [1, out] */
            bench_row *r = &rows[nr++];
            snprintf(r->name, sizeof r->name, "matmul_tn %s %lldx%lld T=1", k3_dtype_name(W.dtype),
                     (long long)ws[d].out, (long long)ws[d].in);
            r->secs = time_op(OP_MATMUL_TN, &W, x, 1, 0, y, reps);
            r->bytes = wb + 4.0 * (in + out);
            r->flops = 2.0 * in * out;
        }
        if (W.data != mem) off_be(W.data), off_be(W.scale);
        free(mem);
        free(scale);
    }
    const struct {
        op_kind k;
        const char *name;
        int n_in;
        double flops_per; /* rough arithmetic per element (exp/tanh polynomials) */
    } ew[5] = {{OP_SILU, "silu", 1, 20},
               {OP_SIGMOID, "sigmoid", 1, 19},
               {OP_SITU, "situ", 2, 90},
               {OP_SWIGLU, "swiglu", 2, 21},
               {OP_SOFTMAX, "softmax 4096-wide rows", 1, 20}};
    for (int e = 0; e < 5; e++) {
        bench_row *r = &rows[nr++];
        snprintf(r->name, sizeof r->name, "%s n=%lld", ew[e].name, (long long)n_ew);
        r->secs = time_op(ew[e].k, NULL, x, n_ew / 4096, n_ew, y, reps);
        r->bytes = 4.0 * (double)n_ew * (ew[e].n_in + 1 + (ew[e].k == OP_SOFTMAX ? 2 : 0));
        r->flops = ew[e].flops_per * (double)n_ew;
    }

    cJSON *root = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(root, "ops");
    cJSON_AddStringToObject(root, "backend", g_be->name);
    cJSON_AddStringToObject(root, "isa", k3_cpu_isa_name(g_be));
    cJSON_AddNumberToObject(root, "threads", threads);
    cJSON_AddNumberToObject(root, "reps", reps);
    cJSON_AddNumberToObject(root, "triad_gbs", lim.triad_gbs);
    cJSON_AddNumberToObject(root, "fma_peak_gflops", lim.fma_gflops);
    cJSON_AddStringToObject(root, "fma_peak_isa", lim.fma_isa);
    printf("%-34s %10s %9s %8s %9s %8s\n", "op", "ms", "GB/s", "% triad", "GFLOP/s", "% peak");
    int rc = 0;
    for (int i = 0; i < nr; i++) {
        bench_row *r = &rows[i];
        if (r->secs < 0) {
            fprintf(stderr, "bench_kernels: %s: %s\n", r->name, k3_last_error());
            rc = 1;
            continue;
        }
        double gbs = r->bytes / r->secs / 1e9, gfl = r->flops / r->secs / 1e9;
        printf("%-34s %10.3f %9.2f %7.0f%% %9.2f %7.0f%%\n", r->name, 1e3 * r->secs, gbs,
               100.0 * gbs / lim.triad_gbs, gfl, 100.0 * gfl / lim.fma_gflops);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "op", r->name);
        cJSON_AddNumberToObject(o, "seconds", r->secs);
        cJSON_AddNumberToObject(o, "bytes", r->bytes);
        cJSON_AddNumberToObject(o, "flops", r->flops);
        cJSON_AddNumberToObject(o, "gbs", gbs);
        cJSON_AddNumberToObject(o, "triad_fraction", gbs / lim.triad_gbs);
        cJSON_AddNumberToObject(o, "gflops", gfl);
        cJSON_AddNumberToObject(o, "peak_fraction", gfl / lim.fma_gflops);
        cJSON_AddItemToArray(arr, o);
    }
    if (bench_write_json(root, json_path, "bench_kernels")) rc = 1;
    if (x != xh) off_be(x), off_be(y);
    free(xh), free(yh);
    k3_backend_destroy(g_be);
    return rc;
}
