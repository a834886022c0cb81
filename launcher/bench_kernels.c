/* bench_kernels.c — `k3 bench kernels` (and tests/bench/bench_kernels): each kernel of a
 * backend against this machine's measured limits (bench_limits.c). Never pass/fail.
 *
 * Owns: the op list, its shapes, the bytes and FLOPs each op must move / do, and its timing.
 * First measures the triad bandwidth and the fp32 FMA peak with --threads threads, then times
 * each op (the cpu backend's ISA is the one cpuid picks, or K3_ISA=avx512|avx2|scalar) and
 * reports ms, GB/s (weights + inputs + outputs it must move), GFLOP/s, and each as % of the
 * triad and of the peak. Every number is the median of `reps` timed calls after `warmups`.
 * Shapes: each weight matrix and each elementwise array is `bytes` large (default 2 x L3,
 * bench_big_bytes: past the last-level cache, so a T = 1 matmul measures DRAM streaming); the
 * prefill matmuls (T = `prefill`, compute-bound) use the first eighth of the weight's rows, whose
 * size does not change a compute-bound time but whose FLOPs would (keeps the run short).
 * Contents are random bits with a bounded exponent (finite, neither huge nor subnormal; filling
 * ~2 GB with a normal RNG per element would take longer than the benchmark).
 * A device backend (--backend cuda): inputs and weights are uploaded once; each sample is 20
 * calls and one synchronise, divided by 20; GB/s and TFLOP/s are reported as % of the device's
 * HBM and dense bf16 tensor peaks (k3_backend_device_info), beside a device-to-device copy of the
 * elementwise array (copy2d: cudaMemcpy2DAsync) in the same run. Under the CUDA emulation each
 * op runs once on 1 MiB shapes (unless --size-mb) and its row holds counts only: the bytes and
 * FLOPs it must move and do, and the mma.m16n8k16 it ran.
 * On a host backend the MoE experts' own small matrices follow (expert_rows: small's MXFP4
 * shapes, cold over many copies and in cache).
 * Adding an op: a block in bench_kernels_run that fills a bench_op and calls add_row. */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>

#include "k3_kernels.h"

typedef struct {
    k3_backend *be;
    int reps, warmups;
    double *samples;     /* [reps] seconds of the last timed op */
    bool dev;            /* a device backend: its own peaks (info) instead of the host's limits */
    k3_device_info info; /* info.emulated: no timing, one call per op and its counts */
} kctx;

/* Random floats ±[2^-7, 2): sign and mantissa random, exponent in [120, 127]. */
static void fill_f32(k3_rng *r, float *x, int64_t n) {
    uint32_t *u = (uint32_t *)x;
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)k3_rng_u64(r);
        u[i] = (v & 0x807FFFFFu) | ((120u + ((v >> 23) & 7u)) << 23);
    }
}
/* The same for bf16, four values per random word. */
static void fill_bf16(k3_rng *r, uint16_t *x, int64_t n) {
    for (int64_t i = 0; i < n; i += 4) {
        uint64_t v = k3_rng_u64(r);
        for (int k = 0; k < 4 && i + k < n; k++, v >>= 16)
            x[i + k] = (uint16_t)((v & 0x807Fu) | ((120u + ((v >> 7) & 7u)) << 7));
    }
}
static void fill_bits(k3_rng *r, uint8_t *p, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = k3_rng_u64(r);
        memcpy(p + i, &v, 8);
    }
    for (; i < n; i++) p[i] = (uint8_t)k3_rng_u64(r);
}

static int64_t weight_data_bytes(k3_dtype dt, int64_t n) {
    return dt == K3_DT_F32 ? 4 * n : dt == K3_DT_BF16 ? 2 * n : n / 2;
}

/* A weight [out, in] of dtype dt with random contents (MXFP4: random codes, all finite; scales
 * 2^-7..2^0), in host memory. */
static k3_status make_weight(k3_rng *r, k3_dtype dt, int64_t out, int64_t in, k3_tensor *t) {
    memset(t, 0, sizeof *t);
    *t = (k3_tensor){.dtype = dt, .ndim = 2, .shape = {out, in}, .mem = K3_MEM_HOST};
    const int64_t n = out * in, nb = weight_data_bytes(dt, n);
    void *p = NULL;
    K3_TRY(k3_alloc_large(&p, (size_t)nb, "bench weight")); /* as the engine's weights */
    if (dt == K3_DT_F32)
        fill_f32(r, p, n);
    else if (dt == K3_DT_BF16)
        fill_bf16(r, p, n);
    else
        fill_bits(r, p, nb);
    t->data = p;
    if (dt == K3_DT_MXFP4) {
        uint8_t *s = NULL;
        k3_status st = k3_alloc_large((void **)&s, (size_t)(n / 32), "bench weight scales");
        if (st != K3_OK) {
            k3_free(p);
            return st;
        }
        for (int64_t i = 0; i < n / 32; i++) s[i] = (uint8_t)(120 + (k3_rng_u64(r) & 7));
        t->scale = s;
    }
    return K3_OK;
}

static double weight_bytes(const k3_tensor *W) {
    const double n = (double)(W->shape[0] * W->shape[1]);
    return W->dtype == K3_DT_F32 ? 4 * n : W->dtype == K3_DT_BF16 ? 2 * n : n / 2 + n / 32;
}

/* A host array in the backend's memory: itself on host backends, else an uploaded copy. */
static k3_status on_be(k3_backend *be, const void *host, size_t n_bytes, void **out) {
    *out = (void *)host;
    if (k3_backend_host_visible(be) || !host) return K3_OK;
    K3_TRY(k3_backend_alloc(be, n_bytes, "bench_kernels buffer", out));
    return k3_backend_upload(be, *out, host, n_bytes);
}
static void off_be(k3_backend *be, void *dev, const void *host) {
    if (dev && dev != host) k3_backend_free(be, dev);
}

/* ---- ops ------------------------------------------------------------------------------------ */
typedef enum {
    OP_MATMUL,
    OP_MATMUL_SET,
    OP_MATMUL_TN,
    OP_SILU,
    OP_SIGMOID,
    OP_SITU,
    OP_SWIGLU,
    OP_SOFTMAX,
    OP_COPY
} op_kind;

typedef struct {
    op_kind k;
    const k3_tensor *W; /* OP_MATMUL_SET: n weights, one matmul each, in this order */
    const float *x;
    int64_t T, n;
    float *y;
} bench_op;

static k3_status run_op(k3_backend *be, const bench_op *o) {
    switch (o->k) {
    case OP_MATMUL:
        return be->ops->matmul(be, o->x, o->T, o->W, o->y);
    case OP_MATMUL_SET:
        for (int64_t i = 0; i < o->n; i++) K3_TRY(be->ops->matmul(be, o->x, o->T, &o->W[i], o->y));
        return K3_OK;
    case OP_MATMUL_TN:
        return be->ops->matmul_tn(be, o->x, o->T, o->W, o->y);
    case OP_SILU:
        return be->ops->silu(be, o->x, o->n, o->y);
    case OP_SIGMOID:
        return be->ops->sigmoid(be, o->x, o->n, o->y);
    case OP_SITU:
        return be->ops->situ(be, o->x, o->x + o->n, o->n, 4.0f, 25.0f, o->y);
    case OP_SWIGLU:
        return be->ops->swiglu(be, o->x, o->x + o->n, o->n, o->y);
    case OP_COPY: /* one row: a device-to-device cudaMemcpy on cuda */
        return be->ops->copy2d(be, o->y, o->n, o->x, o->n, 1, o->n);
    default:
        return be->ops->softmax(be, o->x, o->T, o->n / o->T, o->y);
    }
}

/* Median seconds of k->reps samples (after k->warmups calls); a device backend's sample is
 * `inner` calls and one synchronise (launches are asynchronous). */
static k3_status time_op(kctx *k, const bench_op *o, double *median_s) {
    const int inner = k3_backend_host_visible(k->be) ? 1 : 20;
    for (int w = 0; w < k->warmups; w++) K3_TRY(run_op(k->be, o));
    K3_TRY(k3_backend_sync(k->be));
    for (int r = 0; r < k->reps; r++) {
        double t0 = k3_now_s();
        for (int i = 0; i < inner; i++) K3_TRY(run_op(k->be, o));
        K3_TRY(k3_backend_sync(k->be));
        k->samples[r] = (k3_now_s() - t0) / inner;
    }
    double *s = NULL;
    K3_TRY(k3_alloc((void **)&s, (size_t)k->reps * sizeof *s, "bench samples"));
    memcpy(s, k->samples, (size_t)k->reps * sizeof *s);
    bench_stats st;
    bench_stats_of(s, k->reps, &st);
    k3_free(s);
    *median_s = st.median;
    return K3_OK;
}

/* The CUDA emulation: one call, and what it must move and do, with the mma it ran (no time:
 * the emulator's speed says nothing of a device's) */
static k3_status add_counts(kctx *k, bench_report *rep, const char *name, const bench_op *o,
                            double bytes, double flops) {
    k3_device_info before, after;
    K3_TRY(k3_backend_device_info(k->be, &before));
    K3_TRY(run_op(k->be, o));
    K3_TRY(k3_backend_device_info(k->be, &after)); /* synchronises */
    bench_row *r;
    K3_TRY(bench_add_row(rep, &r));
    K3_TRY(bench_put_str(r, "op", "op", name));
    K3_TRY(bench_put_num(r, "bytes", "bytes", -1, bytes));
    K3_TRY(bench_put_num(r, "flops", "FLOPs", -1, flops));
    return bench_put_num(r, "mma", "mma.m16n8k16", -1, (double)(after.mma - before.mma));
}

/* Times op `o` and adds its row with the columns every timed row has: op, ms, seconds, bytes,
 * flops; *s its median seconds, *out the row for the caller's columns */
static k3_status timed_row(kctx *k, bench_report *rep, const char *name, const bench_op *o,
                           double bytes, double flops, double *s, bench_row **out) {
    K3_TRY(time_op(k, o, s));
    K3_LOGI("bench kernels: %s: %.3f ms", name, 1e3 * *s);
    bench_row *r;
    K3_TRY(bench_add_row(rep, &r));
    K3_TRY(bench_put_str(r, "op", "op", name));
    K3_TRY(bench_put_num(r, NULL, "ms", 3, 1e3 * *s));
    K3_TRY(bench_put_num(r, "seconds", NULL, 9, *s));
    K3_TRY(bench_put_num(r, "bytes", NULL, -1, bytes));
    K3_TRY(bench_put_num(r, "flops", NULL, -1, flops));
    *out = r;
    return K3_OK;
}

/* Time op `o` and add its row: on a host backend GB/s, % triad, GFLOP/s, % peak of this host's
 * limits; on a device GB/s and TFLOP/s as % of its HBM and tensor peaks; under the emulation
 * counts only (+ the raw numbers and the samples in JSON). */
static k3_status add_row(kctx *k, bench_report *rep, const bench_limits *lim, const char *name,
                         const bench_op *o, double bytes, double flops) {
    if (k->dev && k->info.emulated) return add_counts(k, rep, name, o, bytes, flops);
    double s = 0;
    bench_row *r;
    K3_TRY(timed_row(k, rep, name, o, bytes, flops, &s, &r));
    const double gbs = bytes / s / 1e9, gfl = flops / s / 1e9;
    if (k->dev) {
        const double tfl = gfl / 1e3;
        K3_TRY(bench_put_num(r, "gbs", "GB/s", 1, gbs));
        K3_TRY(bench_put_num(r, "hbm_fraction", "% HBM", 1,
                             k->info.hbm_gbs > 0 ? 100 * gbs / k->info.hbm_gbs : 0));
        K3_TRY(bench_put_num(r, "tflops", "TFLOP/s", 3, tfl));
        K3_TRY(bench_put_num(r, "tensor_fraction", "% tensor", 2,
                             k->info.tensor_tflops > 0 ? 100 * tfl / k->info.tensor_tflops : 0));
        return bench_put_arr(r, "samples_s", k->samples, k->reps);
    }
    const double tf = lim->triad_gbs > 0 ? gbs / lim->triad_gbs : 0,
                 pf = lim->fma_gflops > 0 ? gfl / lim->fma_gflops : 0;
    K3_TRY(bench_put_num(r, "gbs", "GB/s", 2, gbs));
    K3_TRY(bench_put_num(r, "triad_fraction", NULL, 4, tf));
    K3_TRY(bench_put_num(r, NULL, "% triad", 0, 100 * tf));
    K3_TRY(bench_put_num(r, "gflops", "GFLOP/s", 2, gfl));
    K3_TRY(bench_put_num(r, "peak_fraction", NULL, 4, pf));
    K3_TRY(bench_put_num(r, NULL, "% peak", 0, 100 * pf));
    return bench_put_arr(r, "samples_s", k->samples, k->reps);
}

/* The matmuls of one weight dtype: T = 1 over the whole weight (DRAM streaming), T = prefill
 * over its first eighth, and for bf16 the absorbed-MLA product matmul_tn at T = 1. */
static k3_status matmuls(kctx *k, bench_report *rep, const bench_limits *lim, k3_rng *rng,
                         k3_dtype dt, int64_t out, int64_t in, int64_t prefill, const float *x,
                         float *y) {
    k3_tensor Wh, W;
    K3_TRY(make_weight(rng, dt, out, in, &Wh));
    W = Wh;
    const size_t nd = (size_t)weight_data_bytes(dt, out * in);
    k3_status st = on_be(k->be, Wh.data, nd, &W.data);
    if (st == K3_OK) st = on_be(k->be, Wh.scale, (size_t)(out * in / 32), (void **)&W.scale);
    W.mem = k->be->mem;
    char name[96];
    for (int ti = 0; st == K3_OK && ti < 2; ti++) {
        const int64_t T = ti ? prefill : 1;
        k3_tensor Wp = W;
        if (ti) st = k3_tensor_rows(&W, 0, K3_MAX(out / 8, 64), &Wp);
        if (st != K3_OK) break;
        const double o = (double)Wp.shape[0], i = (double)in;
        snprintf(name, sizeof name, "matmul %s %lldx%lld T=%lld", k3_dtype_name(dt),
                 (long long)Wp.shape[0], (long long)in, (long long)T);
        bench_op op = {OP_MATMUL, &Wp, x, T, 0, y};
        st = add_row(k, rep, lim, name, &op, weight_bytes(&Wp) + 4.0 * (double)T * (i + o),
                     2.0 * (double)T * i * o);
    }
    if (st == K3_OK && dt == K3_DT_BF16) { /* y = x·W with x [1, out] */
        snprintf(name, sizeof name, "matmul_tn %s %lldx%lld T=1", k3_dtype_name(dt), (long long)out,
                 (long long)in);
        bench_op op = {OP_MATMUL_TN, &W, x, 1, 0, y};
        st = add_row(k, rep, lim, name, &op, weight_bytes(&W) + 4.0 * (double)(in + out),
                     2.0 * (double)in * (double)out);
    }
    off_be(k->be, W.data, Wh.data), off_be(k->be, W.scale, Wh.scale);
    k3_free(Wh.data), k3_free(Wh.scale);
    return st;
}

/* A MoE layer's experts as the `small` preset has them: MXFP4 [384, 768] (gate, up) and
 * [768, 384] (down), each its own small matrix, as the engine calls them. T = 1 over copies that
 * fill `bytes`, one call each in a scattered order (a decode step's experts: each matrix starts
 * cold, past the caches); T = 1 on one matrix again and again (in cache: the rate the MXFP4
 * decode itself allows); T = 64 on one matrix (a 512-token prompt gives each of 64 experts ~64
 * rows). Host backends only (a device has its own grouped expert kernel). */
#define EXP_N_MAX 4096
static k3_status expert_rows(kctx *k, bench_report *rep, const bench_limits *lim, k3_rng *rng,
                             int64_t bytes, const float *x, float *y) {
    static const int64_t shapes[2][2] = {{384, 768}, {768, 384}};
    k3_status st = K3_OK;
    for (int s = 0; st == K3_OK && s < 2; s++) {
        const int64_t out = shapes[s][0], in = shapes[s][1];
        const int64_t wbytes = out * in / 2 + out * in / 32;
        const int64_t n = K3_MAX((int64_t)1, K3_MIN((int64_t)EXP_N_MAX, bytes / wbytes));
        k3_tensor big, *W = NULL;
        st = make_weight(rng, K3_DT_MXFP4, n * out, in, &big);
        if (st != K3_OK) return st;
        st = k3_alloc((void **)&W, (size_t)n * sizeof *W, "bench experts");
        for (int64_t i = 0; st == K3_OK && i < n; i++) { /* copy j's place in the call order */
            const int64_t j = (i * 7919) % n;
            st = k3_tensor_rows(&big, j * out, out, &W[i]);
        }
        char name[96];
        for (int v = 0; st == K3_OK && v < 3; v++) {
            const int64_t T = v == 2 ? 64 : 1, calls = v == 0 ? n : 16;
            k3_tensor *Wv = W;
            k3_tensor rep16[16];
            if (v > 0) {
                for (int r = 0; r < 16; r++) rep16[r] = W[0];
                Wv = rep16;
            }
            if (v == 0)
                snprintf(name, sizeof name, "experts MXFP4 %lldx%lld T=1, %lld matrices",
                         (long long)out, (long long)in, (long long)n);
            else
                snprintf(name, sizeof name, "expert MXFP4 %lldx%lld T=%lld, in cache",
                         (long long)out, (long long)in, (long long)T);
            bench_op op = {OP_MATMUL_SET, Wv, x, T, calls, y};
            st = add_row(k, rep, lim, name, &op,
                         (double)calls * ((double)wbytes + 4.0 * (double)T * (double)(in + out)),
                         (double)calls * 2.0 * (double)T * (double)in * (double)out);
        }
        k3_free(W);
        k3_free(big.data), k3_free(big.scale);
    }
    return st;
}

static k3_status meta(bench_report *rep, const bench_kernels_opts *o, k3_backend *be, const kctx *k,
                      const bench_limits *lim, int64_t bytes) {
    bench_row *m = &rep->meta;
    K3_TRY(bench_meta_host(m));
    K3_TRY(bench_put_str(m, "backend", "backend", be->name));
    K3_TRY(bench_put_str(m, "isa", "ISA", k3_cpu_isa_name(be)));
    K3_TRY(bench_put_str(m, "gemv", "decode row order (K3_GEMV)", k3_cpu_gemv_name(be)));
    K3_TRY(bench_put_num(m, "threads", "threads", -1, o->threads));
    K3_TRY(bench_put_num(m, "repetitions", "repetitions (median)", -1, o->reps));
    K3_TRY(bench_put_num(m, "num_warmups", "warm-up calls", -1, o->warmups));
    K3_TRY(bench_put_num(m, "prefill", "prefill tokens (T)", -1, (double)o->prefill));
    K3_TRY(bench_put_num(m, "array_bytes", "bytes of each weight / array", -1, (double)bytes));
    K3_TRY(bench_put_num(m, "seed", "seed", -1, (double)o->seed));
    if (k->dev) {
        K3_TRY(bench_put_str(m, "device", "device", k->info.name));
        if (!k->info.emulated) {
            K3_TRY(bench_put_num(m, "hbm_gbs", "device HBM peak GB/s", 1, k->info.hbm_gbs));
            K3_TRY(bench_put_num(m, "tensor_tflops", "device dense bf16 tensor peak TFLOP/s", 1,
                                 k->info.tensor_tflops));
        }
        return K3_OK;
    }
    return bench_put_limits(m, lim);
}

k3_status bench_kernels_run(const bench_kernels_opts *o, bench_report *rep) {
    if (o->threads < 1 || o->threads > 256 || o->reps < 1 || o->reps > 1000 || o->prefill < 1 ||
        o->prefill > 65536 || o->warmups < 0)
        return K3_ERR(K3_ERR_ARG, "bench kernels: threads in [1, 256], repetitions in [1, 1000], "
                                  "prefill in [1, 65536], warm-ups >= 0");
    k3_backend *be = NULL;
    K3_TRY(k3_backend_create(o->backend ? o->backend : "cpu",
                             &(k3_backend_params){.n_threads = o->threads}, &be));
    kctx k = {.be = be, .reps = o->reps, .warmups = o->warmups};
    k.dev = k3_backend_device_info(be, &k.info) == K3_OK;
    k3_clear_error();
    /* the emulation runs each op once on small shapes: counts, not speed */
    const int64_t bytes = o->bytes > 0               ? o->bytes
                          : k.dev && k.info.emulated ? (int64_t)1 << 20
                                                     : bench_big_bytes();
    const int64_t in = 4096;
    /* rows of each weight: `bytes` of it, a multiple of 64 (at least 64) */
    const struct {
        k3_dtype dt;
        double bytes_per;
    } ws[3] = {{K3_DT_F32, 4}, {K3_DT_BF16, 2}, {K3_DT_MXFP4, 0.5 + 1.0 / 32}};
    int64_t outs[3], max_out = 0;
    for (int d = 0; d < 3; d++) {
        outs[d] = K3_MAX((int64_t)((double)bytes / (ws[d].bytes_per * (double)in)) / 64 * 64, 64);
        max_out = K3_MAX(max_out, outs[d]);
    }
    const int64_t n_ew = K3_MAX(bytes / 4 / 4096 * 4096, 4096); /* elementwise floats per array */
    const int64_t x_floats = K3_MAX(K3_MAX(o->prefill * in, o->prefill * max_out / 8 + 64),
                                    K3_MAX(K3_MAX(2 * n_ew, max_out), 64 * 768)),
                  y_floats = K3_MAX(K3_MAX(o->prefill * (max_out / 8 + 64), max_out),
                                    K3_MAX(n_ew, 64 * 768)); /* + expert_rows' */

    bench_limits lim;
    memset(&lim, 0, sizeof lim);
    k3_status st = K3_OK;
    if (k.dev) { /* the device's own peaks, not this host's limits */
        K3_LOGI("bench kernels: %s backend on %s", be->name, k.info.name);
    } else {
        st = bench_measure_limits(o->threads, K3_MIN(K3_MAX(o->reps, 5), 16), bytes, &lim);
        char how[400];
        bench_limits_describe(&lim, how, sizeof how);
        if (st == K3_OK)
            K3_LOGI("bench kernels: %s backend, ISA %s; %s", be->name, k3_cpu_isa_name(be), how);
    }
    if (st == K3_OK) st = meta(rep, o, be, &k, &lim, bytes);
    float *xh = NULL, *yh = NULL, *x = NULL, *y = NULL;
    if (st == K3_OK)
        st = k3_alloc((void **)&k.samples, (size_t)o->reps * sizeof(double), "samples");
    if (st == K3_OK) st = k3_alloc((void **)&xh, (size_t)x_floats * 4, "bench x");
    if (st == K3_OK) st = k3_calloc((void **)&yh, (size_t)y_floats * 4, "bench y");
    k3_rng rng;
    k3_rng_seed(&rng, o->seed);
    if (st == K3_OK) fill_f32(&rng, xh, x_floats);
    if (st == K3_OK) st = on_be(be, xh, (size_t)x_floats * 4, (void **)&x);
    if (st == K3_OK) st = on_be(be, yh, (size_t)y_floats * 4, (void **)&y);
    if (st == K3_OK && k.dev) { /* the reference: a device-to-device cudaMemcpy of n_ew floats */
        char name[96];
        snprintf(name, sizeof name, "copy d2d (cudaMemcpy) n=%lld", (long long)n_ew);
        bench_op op = {OP_COPY, NULL, x, 1, n_ew, y};
        st = add_row(&k, rep, &lim, name, &op, 8.0 * (double)n_ew, 0);
    }
    for (int d = 0; st == K3_OK && d < 3; d++)
        st = matmuls(&k, rep, &lim, &rng, ws[d].dt, outs[d], in, o->prefill, x, y);
    if (st == K3_OK && !k.dev) st = expert_rows(&k, rep, &lim, &rng, bytes, x, y);

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
    for (int e = 0; st == K3_OK && e < 5; e++) {
        char name[96];
        snprintf(name, sizeof name, "%s n=%lld", ew[e].name, (long long)n_ew);
        bench_op op = {ew[e].k, NULL, x, n_ew / 4096, n_ew, y};
        st = add_row(&k, rep, &lim, name, &op,
                     4.0 * (double)n_ew * (ew[e].n_in + 1 + (ew[e].k == OP_SOFTMAX ? 2 : 0)),
                     ew[e].flops_per * (double)n_ew);
    }
    off_be(be, x, xh), off_be(be, y, yh);
    k3_free(xh), k3_free(yh), k3_free(k.samples);
    k3_backend_destroy(be);
    return st;
}
