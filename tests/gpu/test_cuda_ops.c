/* test_cuda_ops.c — every op of kernels/k3_kernels.h on the cuda backend against kernels/ref
 * (label gpu). Inputs from k3_rng with a printed seed; every device buffer is allocated with a
 * guard band of sentinel NaN-payload floats on each side (checked bit for bit after the op) and
 * every output starts poisoned with NaN; results come back through download only. Tolerances are
 * tests/tolerances.h's: the op bound for fp32 reductions in another order, the KDA bounds for the
 * two KDA forms; copies, gathers and the router's ids must be exact. Also: the determinism rule
 * (a second run is bit-identical; token 0 alone equals token 0 of a batch) and the two errors
 * whose contract names the culprit (a non-finite router score, an embedding id out of range).
 * The varlen ops (rmsnorm_rows .. moe_experts) run one batch descriptor (two decode tokens and two
 * prefill pieces, shuffled slots and cache blocks) against the cpu backend, and each is also
 * checked bit for bit against the cuda ops its contract names (rmsnorm, matmul / matmul_tn per
 * head, attn_latent per token, kda_chunked / kda_recurrent per sequence, matmul -> act -> matmul
 * -> rows_wsum per row; MXFP4 moe_experts runs on the tensor cores instead: element by element
 * against float64 within the derived bound, the masked layout + slot-order combine of
 * k3_cuda_moe.h alike, and an emulated mma count > 0); then the counters, async copies and
 * events. Four cuda backends: the default (the tensor-core MLA with split hi + lo operands, the
 * fp32 KDA), one with K3_CUDA_MMA=1 (the bf16 tensor-core MLA and chunk-16 KDA), both held to the
 * element-wise bounds of gpu/k3_bf16_bounds.h with their mma counts, one with K3_CUDA_MMA=0 (the
 * fp32 MLA kernels) and one with K3_CUDA_KDA_STATE=bf16 (the KDA state stored in bf16).
 * Without a device it prints one SKIP line and exits 77. The registry comes from K3_OP_LIST:
 * an op without a test_<op> here does not compile. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"
#include "k3_mxfp4.h"
#include "k3_test.h"
#include "tolerances.h"
#include "gpu/k3_bf16_bounds.h"
#include "gpu/k3_gpu_test.h"
#include "k3_cuda_moe.h"
#ifdef K3_CUDA_EMULATE
#include <cuda_runtime_api.h> /* k3emu_mma_count */
#endif

#include <stdlib.h>
#include <string.h>

static k3_rng g_rng;
static const uint64_t k_seed = 20261201;
static k3_backend *g_ref, *g_cpu, *g_cu; /* the varlen ops compare with cpu */
/* g_cu runs the opt-in tensor-core kernels (K3_CUDA_MMA=1: bf16 MLA for W <= 640, KDA prefill at
   chunk 16); g_cu32 is the default backend (split-operand MLA, fp32 KDA) and g_cuf the opt-out
   (K3_CUDA_MMA=0: fp32 MLA), swapped in as g_cu by the cases that check those paths (g_mma tells
   the KDA checks which one runs, g_mla_terms the MLA checks: 1 bf16, 3 split, 0 the fp32 kernel).
 */
static k3_backend *g_cu32, *g_cuf;
static int g_mla_terms = 1;
static k3_backend *g_cub; /* K3_CUDA_KDA_STATE=bf16 (kda_bf16_case) */
static bool g_mma = true;

#define GUARD    64          /* floats of guard band on each side of a device buffer */
#define SENTINEL 0x7fc0de5du /* a NaN payload no kernel writes */
#define MAXB     4096
static struct {
    void *base;
    size_t n_bytes; /* payload */
} g_bufs[MAXB];
static int g_nb;

/* ---- device buffers with guard bands ------------------------------------------------------- */
static void *dput(const void *host, size_t n_bytes) {
    size_t pad = GUARD * 4, nb = (n_bytes + 3) / 4 * 4, total = nb + 2 * pad;
    uint32_t *h = malloc(total);
    for (size_t i = 0; i < total / 4; i++) h[i] = SENTINEL;
    if (host) memcpy((char *)h + pad, host, n_bytes);
    void *d = NULL;
    K3_ASSERT(k3_backend_alloc(g_cu, total, "test_cuda_ops buffer", &d) == K3_OK);
    K3_ASSERT(k3_backend_upload(g_cu, d, h, total) == K3_OK);
    /* landed before another backend's stream (g_cub, g_cu32) reads it: streams are ordered
       only within themselves (the emulator's streams run asynchronously, as a device's do) */
    K3_ASSERT(k3_backend_sync(g_cu) == K3_OK);
    free(h);
    K3_ASSERT(g_nb < MAXB);
    g_bufs[g_nb].base = d;
    g_bufs[g_nb].n_bytes = nb;
    g_nb++;
    return (char *)d + pad;
}
static float *dpoison(int64_t n) { /* NaN-filled output */
    float *h = malloc((size_t)(n > 0 ? n : 1) * 4);
    for (int64_t i = 0; i < n; i++) h[i] = NAN;
    float *d = dput(h, (size_t)n * 4);
    free(h);
    return d;
}
static float *dcopy(const float *h, int64_t n) {
    return dput(h, (size_t)n * 4);
}
static void dget(void *host, const void *dev, size_t n_bytes) {
    if (g_cub) K3_ASSERT(k3_backend_sync(g_cub) == K3_OK); /* its kernels may have written dev */
    if (g_cu32) K3_ASSERT(k3_backend_sync(g_cu32) == K3_OK);
    K3_ASSERT(k3_backend_sync(g_cu) == K3_OK);
    K3_ASSERT(k3_backend_download(g_cu, host, dev, n_bytes) == K3_OK);
}
/* Check every guard band and free every buffer of the case. */
static void dfree_all(const char *what) {
    if (g_cub) K3_ASSERT(k3_backend_sync(g_cub) == K3_OK);
    if (g_cu32) K3_ASSERT(k3_backend_sync(g_cu32) == K3_OK);
    K3_ASSERT(k3_backend_sync(g_cu) == K3_OK);
    for (int b = 0; b < g_nb; b++) {
        size_t pad = GUARD * 4, total = g_bufs[b].n_bytes + 2 * pad;
        uint32_t *h = malloc(total);
        K3_ASSERT(k3_backend_download(g_cu, h, g_bufs[b].base, total) == K3_OK);
        int bad = 0;
        for (size_t i = 0; i < GUARD; i++)
            bad += (h[i] != SENTINEL) + (h[(pad + g_bufs[b].n_bytes) / 4 + i] != SENTINEL);
        K3_CHECK(bad == 0, "%s: %d guard floats of buffer %d overwritten", what, bad, b);
        free(h);
        k3_backend_free(g_cu, g_bufs[b].base);
    }
    g_nb = 0;
}

/* ---- host helpers ---------------------------------------------------------------------------- */
static float *randn(int64_t n, float sd) {
    float *x = malloc((size_t)(n > 0 ? n : 1) * 4);
    for (int64_t i = 0; i < n; i++) x[i] = sd * k3_rng_normal(&g_rng);
    return x;
}
static float *hnan(int64_t n) {
    float *x = malloc((size_t)(n > 0 ? n : 1) * 4);
    for (int64_t i = 0; i < n; i++) x[i] = NAN;
    return x;
}
static float *hget(const float *dev, int64_t n) {
    float *h = hnan(n);
    dget(h, dev, (size_t)n * 4);
    return h;
}
static bool all_finite(const float *a, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(a[i])) return false;
    return true;
}
/* got (device result, downloaded) vs want (ref) within tol; frees got. */
static void cmp(float *got, const float *want, int64_t n, double tol, const char *what) {
    double r = k3_rel_l2(got, want, (size_t)n);
    K3_CHECK(all_finite(got, n) && r <= tol, "%s: cuda vs ref rel-L2 %g (tol %g)%s", what, r, tol,
             all_finite(got, n) ? "" : ", non-finite output");
    free(got);
}
static void cmp_exact(float *got, const float *want, int64_t n, const char *what) {
    K3_CHECK(n == 0 || memcmp(got, want, (size_t)n * 4) == 0, "%s: cuda != ref (exact)", what);
    free(got);
}

/* x rounded to bf16 and back (round to nearest even: the tensor-core kernels' input rounding) */
static float *bf16_round(const float *x, int64_t n) {
    float *r = hnan(n);
    for (int64_t i = 0; i < n; i++) r[i] = k3_bf16_to_f32(k3_f32_to_bf16(x[i]));
    return r;
}
#ifdef K3_CUDA_EMULATE
unsigned long long k3emu_mma_count(const char *kernel); /* kernels/cuda/emu/cuda_runtime_api.h */
#endif

/* ---- weights --------------------------------------------------------------------------------- */
typedef struct {
    k3_tensor host, dev;
    void *data;
    uint8_t *scale;
} wt;
static wt make_w(k3_dtype dt, int64_t out, int64_t in) {
    wt w = {0};
    int64_t n = out * in;
    size_t bytes = dt == K3_DT_F32     ? (size_t)n * 4
                   : dt == K3_DT_MXFP4 ? (size_t)n / 2
                                       : (size_t)n * 2;
    w.data = malloc(bytes);
    if (dt == K3_DT_F32)
        for (int64_t i = 0; i < n; i++) ((float *)w.data)[i] = k3_rng_normal(&g_rng);
    else if (dt == K3_DT_BF16)
        for (int64_t i = 0; i < n; i++)
            ((uint16_t *)w.data)[i] = k3_f32_to_bf16(k3_rng_normal(&g_rng));
    else if (dt == K3_DT_F16) /* halves in [-2, 2): sign, exponent 14..15, random mantissa */
        for (int64_t i = 0; i < n; i++)
            ((uint16_t *)w.data)[i] = (uint16_t)((k3_rng_u64(&g_rng) & 0x83ffu) | (0x38u << 8) |
                                                 ((k3_rng_u64(&g_rng) & 1u) << 10));
    else {
        for (size_t i = 0; i < bytes; i++) ((uint8_t *)w.data)[i] = (uint8_t)k3_rng_u64(&g_rng);
        w.scale = malloc((size_t)n / 32);
        for (int64_t i = 0; i < n / 32; i++) w.scale[i] = (uint8_t)(122 + k3_rng_u64(&g_rng) % 8);
    }
    w.host = (k3_tensor){.dtype = dt,
                         .ndim = 2,
                         .shape = {out, in},
                         .data = w.data,
                         .scale = w.scale,
                         .mem = K3_MEM_HOST};
    w.dev = w.host;
    w.dev.data = dput(w.data, bytes);
    w.dev.scale = w.scale ? dput(w.scale, (size_t)n / 32) : NULL;
    w.dev.mem = K3_MEM_DEVICE;
    return w;
}
static void free_w(wt *w) {
    free(w->data);
    free(w->scale);
}

/* ---- one test per op ------------------------------------------------------------------------- */
static void mm_case(bool tn, k3_dtype dt, int64_t out, int64_t in, int64_t T) {
    char what[96];
    snprintf(what, sizeof what, "%s %s [%lld, %lld] T=%lld", tn ? "matmul_tn" : "matmul",
             k3_dtype_name(dt), (long long)out, (long long)in, (long long)T);
    wt w = make_w(dt, out, in);
    int64_t nx = T * (tn ? out : in), ny = T * (tn ? in : out), row = tn ? in : out;
    float *x = randn(nx, 1.0f), *want = hnan(ny);
    float *dx = dcopy(x, nx), *dy = dpoison(ny), *dy1 = dpoison(row), *dy2 = dpoison(ny);
    if (tn) {
        K3_CHECK_OK(g_ref->ops->matmul_tn(g_ref, x, T, &w.host, want));
        K3_CHECK_OK(g_cu->ops->matmul_tn(g_cu, dx, T, &w.dev, dy));
        K3_CHECK_OK(g_cu->ops->matmul_tn(g_cu, dx, 1, &w.dev, dy1));
        K3_CHECK_OK(g_cu->ops->matmul_tn(g_cu, dx, T, &w.dev, dy2));
    } else {
        K3_CHECK_OK(g_ref->ops->matmul(g_ref, x, T, &w.host, want));
        K3_CHECK_OK(g_cu->ops->matmul(g_cu, dx, T, &w.dev, dy));
        K3_CHECK_OK(g_cu->ops->matmul(g_cu, dx, 1, &w.dev, dy1));
        K3_CHECK_OK(g_cu->ops->matmul(g_cu, dx, T, &w.dev, dy2));
    }
    float *got = hget(dy, ny), *got1 = hget(dy1, row), *got2 = hget(dy2, ny);
    K3_CHECK(memcmp(got1, got, (size_t)row * 4) == 0, "%s: token 0 alone != token 0 of T", what);
    K3_CHECK(memcmp(got2, got, (size_t)ny * 4) == 0, "%s: a second run differs", what);
    free(got1), free(got2);
    cmp(got, want, ny, K3_TOL_OP_REL_L2, what);
    dfree_all(what);
    free(x), free(want), free_w(&w);
}
static void test_matmul(void) {
    const k3_dtype dts[3] = {K3_DT_F32, K3_DT_BF16, K3_DT_MXFP4};
    for (int d = 0; d < 3; d++) {
        mm_case(false, dts[d], 300, 1088, 1);
        mm_case(false, dts[d], 300, 1088, 19);
    }
    mm_case(false, K3_DT_F32, 40, 1101, 3); /* scalar (unaligned-length) paths */
    mm_case(false, K3_DT_BF16, 40, 1100, 3);
}
/* matmul_group: three items (MXFP4, BF16, F32; two share x) equal one matmul call each on the
 * device, bit for bit; a bad item is named. */
static void test_matmul_group(void) {
    const k3_dtype dts[3] = {K3_DT_MXFP4, K3_DT_BF16, K3_DT_F32};
    const int64_t outs[3] = {300, 130, 77}, ins[3] = {1088, 1088, 200}, T = 5;
    wt w[3];
    float *x0 = randn(T * 1088, 1.0f), *x2 = randn(T * 200, 1.0f);
    float *dx0 = dcopy(x0, T * 1088), *dx2 = dcopy(x2, T * 200), *dy[3], *dw1[3];
    k3_mm mm[3];
    for (int i = 0; i < 3; i++) {
        w[i] = make_w(dts[i], outs[i], ins[i]);
        dy[i] = dpoison(T * outs[i]), dw1[i] = dpoison(T * outs[i]);
        mm[i] = (k3_mm){i == 2 ? dx2 : dx0, T, &w[i].dev, dy[i]};
        K3_CHECK_OK(g_cu->ops->matmul(g_cu, mm[i].x, T, &w[i].dev, dw1[i]));
    }
    K3_CHECK_OK(g_cu->ops->matmul_group(g_cu, mm, 3));
    for (int i = 0; i < 3; i++) {
        float *got = hget(dy[i], T * outs[i]), *want = hget(dw1[i], T * outs[i]);
        K3_CHECK(memcmp(got, want, (size_t)(T * outs[i]) * 4) == 0,
                 "matmul_group item %d (%s) != its matmul", i, k3_dtype_name(dts[i]));
        free(got), free(want);
    }
    k3_tensor bad = {.dtype = K3_DT_I32, .ndim = 2, .shape = {2, 2}};
    k3_mm mb[1] = {{dx0, 1, &bad, dy[0]}};
    K3_CHECK_ERR(g_cu->ops->matmul_group(g_cu, mb, 1), K3_ERR_SHAPE, "matmul_group item 0");
    dfree_all("matmul_group");
    for (int i = 0; i < 3; i++) free_w(&w[i]);
    free(x0), free(x2);
}
static void test_matmul_tn(void) {
    const k3_dtype dts[3] = {K3_DT_F32, K3_DT_BF16, K3_DT_MXFP4};
    for (int d = 0; d < 3; d++) mm_case(true, dts[d], 200, 544, 9);
}
static void norm_case(int l2, bool with_w) {
    const int64_t T = 7, n = 1000;
    float *x = randn(T * n, 2.0f), *w = randn(n, 1.0f), *want = hnan(T * n);
    float *dx = dcopy(x, T * n), *dw = with_w ? dcopy(w, n) : NULL, *dy = dpoison(T * n);
    if (l2) {
        K3_CHECK_OK(g_ref->ops->l2norm(g_ref, x, T, n, 1e-6f, want));
        K3_CHECK_OK(g_cu->ops->l2norm(g_cu, dx, T, n, 1e-6f, dy));
    } else {
        K3_CHECK_OK(g_ref->ops->rmsnorm(g_ref, x, with_w ? w : NULL, T, n, 1e-6f, want));
        K3_CHECK_OK(g_cu->ops->rmsnorm(g_cu, dx, dw, T, n, 1e-6f, dy));
    }
    cmp(hget(dy, T * n), want, T * n, K3_TOL_OP_REL_L2, l2 ? "l2norm" : "rmsnorm");
    dfree_all("norm");
    free(x), free(w), free(want);
}
static void test_rmsnorm(void) {
    norm_case(0, true);
    norm_case(0, false);
}
static void test_l2norm(void) {
    norm_case(1, false);
}
/* pointwise ops, out of place and in place (y aliases the first input) */
static void pw_case(int op, const char *name) {
    const int64_t n = 100003;
    float *a = randn(n, 3.0f), *b = randn(n, 3.0f), *want = hnan(n);
    for (int inplace = 0; inplace < 2; inplace++) {
        float *da = dcopy(a, n), *db = dcopy(b, n), *dy = inplace ? da : dpoison(n);
        k3_backend *be[2] = {g_ref, g_cu};
        for (int i = 0; i < 2; i++) {
            const float *pa = i ? da : a, *pb = i ? db : b;
            float *py = i ? dy : want;
            k3_backend *B = be[i];
            switch (op) {
            case 0:
                K3_CHECK_OK(B->ops->silu(B, pa, n, py));
                break;
            case 1:
                K3_CHECK_OK(B->ops->sigmoid(B, pa, n, py));
                break;
            case 2:
                K3_CHECK_OK(B->ops->situ(B, pa, pb, n, 4.0f, 2.5f, py));
                break;
            case 3:
                K3_CHECK_OK(B->ops->swiglu(B, pa, pb, n, py));
                break;
            case 4:
                K3_CHECK_OK(B->ops->add(B, pa, pb, n, py));
                break;
            default:
                K3_CHECK_OK(B->ops->mul(B, pa, pb, n, py));
                break;
            }
        }
        if (op >= 4)
            cmp_exact(hget(dy, n), want, n, name);
        else
            cmp(hget(dy, n), want, n, K3_TOL_OP_REL_L2, name);
        dfree_all(name);
    }
    free(a), free(b), free(want);
}
static void test_silu(void) {
    pw_case(0, "silu");
}
static void test_sigmoid(void) {
    pw_case(1, "sigmoid");
}
static void test_situ(void) {
    pw_case(2, "situ");
}
static void test_swiglu(void) {
    pw_case(3, "swiglu");
}
static void test_add(void) {
    pw_case(4, "add");
}
static void test_mul(void) {
    pw_case(5, "mul");
}
static void test_softmax(void) {
    const int64_t T = 5, n = 3001;
    float *x = randn(T * n, 4.0f), *want = hnan(T * n);
    float *dx = dcopy(x, T * n), *dy = dpoison(T * n);
    K3_CHECK_OK(g_ref->ops->softmax(g_ref, x, T, n, want));
    K3_CHECK_OK(g_cu->ops->softmax(g_cu, dx, T, n, dy));
    cmp(hget(dy, T * n), want, T * n, K3_TOL_OP_REL_L2, "softmax");
    K3_CHECK_OK(g_cu->ops->softmax(g_cu, dx, T, n, dx)); /* in place */
    cmp(hget(dx, T * n), want, T * n, K3_TOL_OP_REL_L2, "softmax in place");
    dfree_all("softmax");
    free(x), free(want);
}
static void test_fill(void) {
    const int64_t n = 70001;
    float *dy = dpoison(n), *want = hnan(n);
    for (int64_t i = 0; i < n; i++) want[i] = -1.25f;
    K3_CHECK_OK(g_cu->ops->fill(g_cu, dy, n, -1.25f));
    cmp_exact(hget(dy, n), want, n, "fill");
    dfree_all("fill");
    free(want);
}
static void test_copy2d(void) {
    const int64_t rows = 37, cols = 101, ss = 130, ds = 111;
    float *src = randn(rows * ss, 1.0f), *want = hnan(rows * ds);
    float *dsrc = dcopy(src, rows * ss), *ddst = dpoison(rows * ds);
    K3_CHECK_OK(g_ref->ops->copy2d(g_ref, want, ds, src, ss, rows, cols));
    K3_CHECK_OK(g_cu->ops->copy2d(g_cu, ddst, ds, dsrc, ss, rows, cols));
    float *got = hget(ddst, rows * ds);
    bool same = true;
    for (int64_t r = 0; r < rows; r++) same &= memcmp(got + r * ds, want + r * ds, cols * 4) == 0;
    K3_CHECK(same, "copy2d: cuda != ref");
    free(got);
    K3_CHECK_ERR(g_cu->ops->copy2d(g_cu, ddst, 5, dsrc, ss, rows, cols), K3_ERR_ARG, "copy2d");
    dfree_all("copy2d");
    free(src), free(want);
}
static void test_to_f32(void) {
    const k3_dtype dts[3] = {K3_DT_F32, K3_DT_BF16, K3_DT_F16};
    for (int d = 0; d < 3; d++) {
        wt w = make_w(dts[d], 3, 333);
        const int64_t n = 999;
        float *want = hnan(n), *dy = dpoison(n);
        K3_CHECK_OK(g_ref->ops->to_f32(g_ref, &w.host, n, want));
        K3_CHECK_OK(g_cu->ops->to_f32(g_cu, &w.dev, n, dy));
        cmp_exact(hget(dy, n), want, n, "to_f32");
        dfree_all("to_f32");
        free(want), free_w(&w);
    }
}
static void test_embed_rows(void) {
    const int64_t V = 50, D = 130, T = 9;
    wt w = make_w(K3_DT_BF16, V, D);
    int32_t ids[9];
    for (int t = 0; t < T; t++) ids[t] = (int32_t)(k3_rng_u64(&g_rng) % V);
    ids[3] = ids[4]; /* a repeated id */
    float *want = hnan(T * D), *dy = dpoison(T * D);
    int32_t *dids = dput(ids, sizeof ids);
    K3_CHECK_OK(g_ref->ops->embed_rows(g_ref, &w.host, ids, T, want));
    K3_CHECK_OK(g_cu->ops->embed_rows(g_cu, &w.dev, dids, T, dy));
    cmp_exact(hget(dy, T * D), want, T * D, "embed_rows");
    ids[2] = (int32_t)V; /* out of range at position 2 (and 6 below): the first is named */
    ids[6] = -1;
    int32_t *dbad = dput(ids, sizeof ids);
    K3_CHECK_ERR(g_cu->ops->embed_rows(g_cu, &w.dev, dbad, T, dy), K3_ERR_ARG, "position 2");
    dfree_all("embed_rows");
    free(want), free_w(&w);
}
static void test_short_conv(void) {
    const int64_t P = 300;
    const int K = 4;
    const int64_t ns[3] = {9, 2, 1};
    for (int c = 0; c < 3; c++) {
        int64_t n = ns[c];
        float *in = randn(n * P, 1.0f), *w = randn(P * K, 0.5f), *st = randn((K - 1) * P, 1.0f);
        float *want = hnan(n * P);
        float *din = dcopy(in, n * P), *dw = dcopy(w, P * K), *dst = dcopy(st, (K - 1) * P);
        float *dout = dpoison(n * P);
        K3_CHECK_OK(g_ref->ops->short_conv(g_ref, in, n, P, K, w, st, want));
        K3_CHECK_OK(g_cu->ops->short_conv(g_cu, din, n, P, K, dw, dst, dout));
        cmp(hget(dout, n * P), want, n * P, K3_TOL_OP_REL_L2, "short_conv out");
        cmp_exact(hget(dst, (K - 1) * P), st, (K - 1) * P, "short_conv state");
        dfree_all("short_conv");
        free(in), free(w), free(st), free(want);
    }
}
static void test_kda_gate(void) {
    const int64_t T = 11;
    const int H = 4, dk = 64;
    const int64_t P = (int64_t)H * dk;
    for (int lb = 0; lb < 2; lb++) {
        float *r = randn(T * P, 2.0f), *dtb = randn(P, 0.5f), *al = randn(H, 0.5f);
        float *dr = dcopy(r, T * P), *ddtb = dcopy(dtb, P), *dal = dcopy(al, H);
        K3_CHECK_OK(g_ref->ops->kda_gate(g_ref, r, dtb, al, T, H, dk, lb != 0, -5.0f));
        K3_CHECK_OK(g_cu->ops->kda_gate(g_cu, dr, ddtb, dal, T, H, dk, lb != 0, -5.0f));
        cmp(hget(dr, T * P), r, T * P, K3_TOL_OP_REL_L2, "kda_gate");
        dfree_all("kda_gate");
        free(r), free(dtb), free(al);
    }
}
static void test_attnres_mix(void) {
    const int64_t T = 6, D = 1000;
    const int ns[2] = {0, 7};
    for (int c = 0; c < 2; c++) {
        int N = ns[c];
        float *bank = randn((int64_t)N * T * D, 1.0f), *p = randn(T * D, 1.0f);
        float *w = randn(D, 0.3f), *want = hnan(T * D);
        float *db = dcopy(bank, (int64_t)N * T * D), *dp = dcopy(p, T * D), *dw = dcopy(w, D);
        float *dy = dpoison(T * D);
        K3_CHECK_OK(g_ref->ops->attnres_mix(g_ref, bank, N, p, w, T, D, 1e-6f, want));
        K3_CHECK_OK(g_cu->ops->attnres_mix(g_cu, db, N, dp, dw, T, D, 1e-6f, dy));
        cmp(hget(dy, T * D), want, T * D, K3_TOL_OP_REL_L2, "attnres_mix");
        K3_CHECK_OK(g_cu->ops->attnres_mix(g_cu, db, N, dp, dw, T, D, 1e-6f, dp)); /* out = p */
        cmp(hget(dp, T * D), want, T * D, K3_TOL_OP_REL_L2, "attnres_mix in place");
        K3_CHECK_ERR(g_cu->ops->attnres_mix(g_cu, db, 64, dp, dw, T, D, 1e-6f, dy), K3_ERR_ARG,
                     "attnres_mix");
        dfree_all("attnres_mix");
        free(bank), free(p), free(w), free(want);
    }
}
/* KDA inputs as the layer feeds them: q, k L2-normed per head, log decay < 0, β in [0, 1) */
static void kda_case(bool chunked, int64_t n, int H, int dk, int dv, int C) {
    const int64_t nqk = n * H * dk, nv = n * H * dv, nS = (int64_t)H * dk * dv;
    float *q = randn(nqk, 1.0f), *k = randn(nqk, 1.0f), *v = randn(nv, 1.0f);
    float *g = randn(nqk, 1.0f), *beta = randn(n * H, 1.0f), *S = randn(nS, 0.5f);
    for (int64_t i = 0; i < nqk; i++) g[i] = -0.3f * fabsf(g[i]) - 0.01f;
    for (int64_t i = 0; i < n * H; i++) beta[i] = (float)k3_rng_uniform(&g_rng);
    float *qk[2] = {q, k};
    for (int a = 0; a < 2; a++)
        for (int64_t r = 0; r < n * H; r++) {
            float ss = 0;
            for (int i = 0; i < dk; i++) ss += qk[a][r * dk + i] * qk[a][r * dk + i];
            for (int i = 0; i < dk; i++) qk[a][r * dk + i] /= sqrtf(ss);
        }
    float *dq = dcopy(q, nqk), *dk_ = dcopy(k, nqk), *dv_ = dcopy(v, nv), *dg = dcopy(g, nqk);
    float *db = dcopy(beta, n * H), *dS = dcopy(S, nS), *dO = dpoison(nv), *want = hnan(nv);
    float *S0 = malloc((size_t)nS * 4);
    memcpy(S0, S, (size_t)nS * 4);
    const float scale = 1.0f / sqrtf((float)dk);
    if (chunked) {
        size_t wf = k3_kda_chunk_work_floats(C, dk, dv) * (size_t)H;
        float *work = hnan((int64_t)wf), *dwork = dpoison((int64_t)wf);
        K3_CHECK_OK(g_ref->ops->kda_chunked(g_ref, q, k, v, g, beta, n, H, dk, dv, scale, S, want,
                                            C, work));
        K3_CHECK_OK(g_cu->ops->kda_chunked(g_cu, dq, dk_, dv_, dg, db, n, H, dk, dv, scale, dS, dO,
                                           C, dwork));
        free(work);
    } else {
        K3_CHECK_OK(
            g_ref->ops->kda_recurrent(g_ref, q, k, v, g, beta, n, H, dk, dv, scale, S, want));
        K3_CHECK_OK(
            g_cu->ops->kda_recurrent(g_cu, dq, dk_, dv_, dg, db, n, H, dk, dv, scale, dS, dO));
    }
    double tol = chunked ? K3_TOL_KDA_CHUNK_REL_L2 : K3_TOL_KDA_REL_L2;
    if (chunked && C == 16 && g_mma) { /* the tensor-core form: its bf16 bound */
        float *go = hget(dO, nv), *gs = hget(dS, nS);
        double worst = 0;
        const int64_t bad =
            kda_mma_check(q, k, v, g, beta, n, H, dk, dv, scale, S0, want, S, go, gs, &worst);
        printf(
            "    kda_chunked C 16 n %lld dk %d dv %d: o rel-L2 %.3g, S rel-L2 %.3g vs ref; worst "
            "%.3g of the bound\n",
            (long long)n, dk, dv, k3_rel_l2(go, want, (size_t)nv), k3_rel_l2(gs, S, (size_t)nS),
            worst);
        K3_CHECK(bad == 0 && all_finite(go, nv),
                 "kda_chunked C 16: %lld elements past the bf16 "
                 "bound (worst %.3g of it)",
                 (long long)bad, worst);
        free(go), free(gs);
#ifdef K3_CUDA_EMULATE
        K3_CHECK(k3emu_mma_count("chunked_kernel") > 0, "kda_chunked C 16: no mma ran");
#endif
        dfree_all("kda");
        free(q), free(k), free(v), free(g), free(beta), free(S), free(S0), free(want);
        return;
    }
    cmp(hget(dO, nv), want, nv, tol, chunked ? "kda_chunked o" : "kda_recurrent o");
    cmp(hget(dS, nS), S, nS, tol, chunked ? "kda_chunked S" : "kda_recurrent S");
    dfree_all("kda");
    free(q), free(k), free(v), free(g), free(beta), free(S), free(S0), free(want);
}
/* The opt-in bf16 KDA state (K3_CUDA_KDA_STATE=bf16: g_cub; head h's dk·dv bf16 at the start of
   its fp32 region), K3's head shape 128 x 128, H = 2:
   (1) one decode step from a bf16 state: o as the fp32 recurrence (K3_TOL_KDA_REL_L2; o is
   computed before the state is rounded), and each new state element within one bf16 rounding of
   ref's: |S − S_ref| <= 2^-8·|S_ref| + K3_TOL_KDA_REL_L2·max|S_ref| (K3_TOL_BF16_U);
   (2) what it costs: 63 more decode steps, one call each (a rounding of the state per step),
   against the fp32 recurrence: o's rel-L2 printed, and bounded by its worst case 64·2^-8 (each
   step's rounding moves the state by <= 2^-8 relative and the recurrence does not expand it:
   decay <= 1, I − βkkᵀ with β <= 1 and |k| = 1);
   (3) chunk 16 (32 tokens, no tail) from the same bf16 state: o bit for bit the fp32-state
   tensor-core run's (g_cu) and the stored state its bf16 rounding; (4) chunk 64: a clear error. */
static void kda_bf16_case(void) {
    const int H = 2, dk = 128, dv = 128, n = 64;
    const int64_t nqk = (int64_t)n * H * dk, nv = (int64_t)n * H * dv, nS = (int64_t)H * dk * dv;
    float *q = randn(nqk, 1.0f), *k = randn(nqk, 1.0f), *v = randn(nv, 1.0f);
    float *g = randn(nqk, 1.0f), *beta = randn((int64_t)n * H, 1.0f);
    for (int64_t i = 0; i < nqk; i++) g[i] = -0.3f * fabsf(g[i]) - 0.01f;
    for (int64_t i = 0; i < n * H; i++) beta[i] = (float)k3_rng_uniform(&g_rng);
    float *qk[2] = {q, k};
    for (int a = 0; a < 2; a++)
        for (int64_t r = 0; r < (int64_t)n * H; r++) {
            float ss = 0;
            for (int i = 0; i < dk; i++) ss += qk[a][r * dk + i] * qk[a][r * dk + i];
            for (int i = 0; i < dk; i++) qk[a][r * dk + i] /= sqrtf(ss);
        }
    float *S0 = randn(nS, 0.5f), *S = bf16_round(S0, nS), *want = hnan(nv);
    uint16_t *Sb = calloc((size_t)nS * 2, 2); /* the fp32 layout: head h at 2·h·dk·dv */
    for (int h = 0; h < H; h++)
        for (int64_t e = 0; e < (int64_t)dk * dv; e++)
            Sb[2 * h * dk * dv + e] = k3_f32_to_bf16(S[h * dk * dv + e]);
    float *dq = dcopy(q, nqk), *dk_ = dcopy(k, nqk), *dv_ = dcopy(v, nv), *dg = dcopy(g, nqk);
    float *db = dcopy(beta, (int64_t)n * H), *dO = dpoison(nv);
    float *dS = dput(Sb, (size_t)nS * 4);
    const float scale = 1.0f / sqrtf((float)dk);
    /* (1) one step */
    K3_CHECK_OK(g_ref->ops->kda_recurrent(g_ref, q, k, v, g, beta, 1, H, dk, dv, scale, S, want));
    K3_CHECK_OK(
        g_cub->ops->kda_recurrent(g_cub, dq, dk_, dv_, dg, db, 1, H, dk, dv, scale, dS, dO));
    cmp(hget(dO, (int64_t)H * dv), want, (int64_t)H * dv, K3_TOL_KDA_REL_L2, "kda bf16 state o");
    dget(Sb, dS, (size_t)nS * 4);
    double smax = 0;
    for (int64_t i = 0; i < nS; i++) smax = fabs(S[i]) > smax ? fabs(S[i]) : smax;
    int64_t bad = 0;
    for (int h = 0; h < H; h++)
        for (int64_t e = 0; e < (int64_t)dk * dv; e++) {
            const double x = S[h * dk * dv + e];
            bad += !(fabs(k3_bf16_to_f32(Sb[2 * h * dk * dv + e]) - x) <=
                     K3_TOL_BF16_U * fabs(x) + K3_TOL_KDA_REL_L2 * smax);
        }
    K3_CHECK(bad == 0, "kda bf16 state: %lld state elements past one bf16 rounding of ref's",
             (long long)bad);
    /* (2) 63 more steps, one call each, from that state; ref in fp32 from its own state */
    for (int t = 1; t < n; t++) {
        const int64_t oq = (int64_t)t * H * dk, ov = (int64_t)t * H * dv;
        K3_CHECK_OK(g_cub->ops->kda_recurrent(g_cub, dq + oq, dk_ + oq, dv_ + ov, dg + oq,
                                              db + t * H, 1, H, dk, dv, scale, dS, dO + ov));
    }
    K3_CHECK_OK(g_ref->ops->kda_recurrent(g_ref, q + H * dk, k + H * dk, v + H * dv, g + H * dk,
                                          beta + H, n - 1, H, dk, dv, scale, S, want + H * dv));
    float *got = hget(dO, nv);
    const double r = k3_rel_l2(got, want, (size_t)nv), lim = n * K3_TOL_BF16_U;
    printf("    kda bf16 state: o over %d decode steps vs the fp32 state: rel-L2 %.3g (worst case "
           "%.3g)\n",
           n, r, lim);
    K3_CHECK(all_finite(got, nv) && r <= lim, "kda bf16 state: rel-L2 %g over %d steps (bound %g)",
             r, n, lim);
    free(got);
    /* (3) chunk 16 over 32 tokens: the bf16 state against the fp32 one, from the same values */
    const int64_t nc = (int64_t)32 * H * dv, wf = (int64_t)k3_kda_chunk_work_floats(16, dk, dv) * H;
    for (int h = 0; h < H; h++)
        for (int64_t e = 0; e < (int64_t)dk * dv; e++)
            Sb[2 * h * dk * dv + e] = k3_f32_to_bf16(S[h * dk * dv + e]);
    float *Sr = bf16_round(S, nS);
    float *dSb = dput(Sb, (size_t)nS * 4), *dSf = dcopy(Sr, nS), *dwork = dpoison(wf);
    float *dOb = dpoison(nc), *dOf = dpoison(nc);
    K3_CHECK_OK(g_cub->ops->kda_chunked(g_cub, dq, dk_, dv_, dg, db, 32, H, dk, dv, scale, dSb, dOb,
                                        16, dwork));
    K3_CHECK_OK(g_cu->ops->kda_chunked(g_cu, dq, dk_, dv_, dg, db, 32, H, dk, dv, scale, dSf, dOf,
                                       16, dwork));
    float *ob = hget(dOb, nc), *of = hget(dOf, nc), *sf = hget(dSf, nS);
    dget(Sb, dSb, (size_t)nS * 4);
    int64_t diff = 0;
    for (int h = 0; h < H; h++)
        for (int64_t e = 0; e < (int64_t)dk * dv; e++)
            diff += Sb[2 * h * dk * dv + e] != k3_f32_to_bf16(sf[h * dk * dv + e]);
    K3_CHECK(memcmp(ob, of, (size_t)nc * 4) == 0 && diff == 0,
             "kda bf16 state, chunk 16: o differs from the fp32 state's, or %lld state elements "
             "are not its bf16 rounding",
             (long long)diff);
    free(ob), free(of), free(sf), free(Sr);
    /* (4) a chunk the bf16 state has no kernel for */
    K3_CHECK_ERR(g_cub->ops->kda_chunked(g_cub, dq, dk_, dv_, dg, db, 32, H, dk, dv, scale, dSb,
                                         dOb, 64, dwork),
                 K3_ERR_ARG, "chunk 64");
    dfree_all("kda bf16 state");
    free(q), free(k), free(v), free(g), free(beta), free(S0), free(S), free(want), free(Sb);
}
static void test_kda_recurrent(void) {
    kda_case(false, 1, 4, 128, 128, 0); /* decode (the streaming kernel) */
    kda_case(false, 40, 3, 64, 96, 0);  /* prefill by the recurrence (streaming too) */
    kda_case(false, 3, 2, 40, 30, 0);   /* dv % 4 != 0: the column-per-thread kernel */
    kda_bf16_case();
}
static void test_kda_chunked(void) {
    kda_case(true, 150, 2, 128, 128, 64); /* two chunks and a ragged tail of 22 */
    kda_case(true, 20, 2, 32, 48, 64);    /* only a tail */
    kda_case(true, 150, 2, 128, 128, 16); /* tensor cores: 9 chunks and a tail of 6 */
    kda_case(true, 37, 3, 64, 48, 16);
    kda_case(true, 35, 4, 32, 32, 16); /* the tiny model's KDA heads */
}
/* attn_latent: W <= 640 on tensor cores (bf16 bound, mla_check), a wider row on the fp32 kernel
   (the op bound); 777 positions take 4 splits and the combine */
static void test_attn_latent(void) {
    const int Hs[3] = {8, 8, 3}, Rs[3] = {512, 512, 700}, Ws[3] = {576, 576, 720};
    const int64_t ns[3] = {1, 777, 40};
    for (int c = 0; c < 3; c++) {
        const int H = Hs[c], Rkv = Rs[c], W = Ws[c];
        const int64_t n_ctx = ns[c];
        float *qc = randn((int64_t)H * W, 1.0f), *cache = randn(n_ctx * W, 1.0f);
        float *qr = bf16_round(qc, (int64_t)H * W), *cr = bf16_round(cache, n_ctx * W);
        float *work = hnan(H * n_ctx), *want = hnan((int64_t)H * Rkv);
        float *want_r = hnan((int64_t)H * Rkv);
        float *dq = dcopy(qc, (int64_t)H * W), *dc = dcopy(cache, n_ctx * W);
        float *dw = dpoison(H * n_ctx), *dy = dpoison((int64_t)H * Rkv);
        const float scale = 1.0f / sqrtf((float)W);
        K3_CHECK_OK(g_ref->ops->attn_latent(g_ref, qc, cache, n_ctx, H, W, Rkv, scale, want, work));
        K3_CHECK_OK(g_ref->ops->attn_latent(g_ref, qr, cr, n_ctx, H, W, Rkv, scale, want_r, work));
        K3_CHECK_OK(g_cu->ops->attn_latent(g_cu, dq, dc, n_ctx, H, W, Rkv, scale, dy, dw));
        float *got = hget(dy, (int64_t)H * Rkv);
        if (W <= 640) { /* g_cu: the tensor-core kernel */
            double w1 = 0, w2 = 0;
            const int64_t b1 =
                mla_check(got, want_r, qr, cr, n_ctx, H, W, Rkv, scale, true, 1, &w1);
            const int64_t b2 =
                mla_check(got, want, qc, cache, n_ctx, H, W, Rkv, scale, false, 1, &w2);
            K3_CHECK(b1 == 0 && b2 == 0,
                     "attn_latent n %lld: %lld / %lld elements past the bf16 bound (worst %.3g of "
                     "it vs bf16 inputs, %.3g vs fp32)",
                     (long long)n_ctx, (long long)b1, (long long)b2, w1, w2);
            printf("    attn_latent n %lld: vs fp32 ref rel-L2 %.3g, worst %.3g of the bound\n",
                   (long long)n_ctx, k3_rel_l2(got, want, (size_t)H * Rkv), w2);
            free(got);
        } else
            cmp(got, want, (int64_t)H * Rkv, K3_TOL_OP_REL_L2, "attn_latent fp32");
        dfree_all("attn_latent");
        free(qc), free(cache), free(qr), free(cr), free(work), free(want), free(want_r);
    }
}
static void test_attn_latent_causal(void) {
    /* a prefill chunk of 70 queries after 40 cached tokens (pos0 = 40): each query over its own
       prefix, against ref */
    const int H = 4, Rkv = 512, W = 576;
    const int64_t pos0 = 40, n_q = 70, n_ctx = pos0 + n_q;
    const int64_t nq = n_q * H * W, no = n_q * H * Rkv;
    float *qc = randn(nq, 1.0f), *cache = randn(n_ctx * W, 1.0f);
    float *work = hnan(H * n_ctx), *want = hnan(no);
    float *dq = dcopy(qc, nq), *dc = dcopy(cache, n_ctx * W);
    float *dw = dpoison(H * n_ctx), *dy = dpoison(no);
    const float scale = 1.0f / sqrtf((float)W);
    K3_CHECK_OK(
        g_ref->ops->attn_latent_causal(g_ref, qc, cache, pos0, n_q, H, W, Rkv, scale, want, work));
    K3_CHECK_OK(g_cu->ops->attn_latent_causal(g_cu, dq, dc, pos0, n_q, H, W, Rkv, scale, dy, dw));
    float *got = hget(dy, no);
    double worst = 0;
    int64_t bad = 0;
    for (int64_t j = 0; j < n_q; j++)
        bad += mla_check(got + j * H * Rkv, want + j * H * Rkv, qc + j * H * W, cache, pos0 + j + 1,
                         H, W, Rkv, scale, false, 1, &worst);
    K3_CHECK(bad == 0, "attn_latent_causal: %lld elements past the bf16 bound (worst %.3g of it)",
             (long long)bad, worst);
    free(got);
    dfree_all("attn_latent_causal");
    free(qc), free(cache), free(work), free(want);
}
static void test_moe_topk(void) {
    const int64_t T = 33;
    const int E = 64, K = 6, G = 8, TG = 4;
    float *s = hnan(T * E), *bias = randn(E, 0.01f);
    for (int64_t i = 0; i < T * E; i++) s[i] = (float)(k3_rng_u64(&g_rng) % 8) / 8.0f; /* ties */
    for (int b = 0; b < 2; b++) {
        const float *bp = b ? bias : NULL;
        float *work = hnan(T * E), *w = hnan(T * K);
        int32_t ids[33 * 6], got_ids[33 * 6];
        float *ds = dcopy(s, T * E), *dbias = b ? dcopy(bias, E) : NULL, *dwork = dpoison(T * E);
        float *dw = dpoison(T * K);
        int32_t *dids = dput(NULL, sizeof ids);
        K3_CHECK_OK(g_ref->ops->moe_topk(g_ref, s, bp, T, E, K, G, TG, true, 2.5f, work, ids, w));
        K3_CHECK_OK(
            g_cu->ops->moe_topk(g_cu, ds, dbias, T, E, K, G, TG, true, 2.5f, dwork, dids, dw));
        dget(got_ids, dids, sizeof got_ids);
        K3_CHECK(memcmp(got_ids, ids, sizeof ids) == 0, "moe_topk (bias %d): ids differ", b);
        cmp(hget(dw, T * K), w, T * K, K3_TOL_OP_REL_L2, "moe_topk weights");
        dfree_all("moe_topk");
        free(work), free(w);
    }
    /* non-finite: token 4's expert 9 is NaN, token 7's expert 2 inf: as ref, those two tokens
       get experts 0..K-1 with NaN weights (each fails alone), the others their selection */
    s[4 * E + 9] = NAN;
    s[7 * E + 2] = INFINITY;
    float *ds = dcopy(s, T * E), *dwork = dpoison(T * E), *dw = dpoison(T * K);
    int32_t *dids = dput(NULL, (size_t)T * K * 4), ids[33 * 6], got_ids[33 * 6];
    float *work = hnan(T * E), *w = hnan(T * K);
    K3_CHECK_OK(g_ref->ops->moe_topk(g_ref, s, NULL, T, E, K, G, TG, true, 1.0f, work, ids, w));
    K3_CHECK_OK(g_cu->ops->moe_topk(g_cu, ds, NULL, T, E, K, G, TG, true, 1.0f, dwork, dids, dw));
    dget(got_ids, dids, sizeof got_ids);
    float *got_w = hget(dw, T * K);
    int wrong = 0;
    for (int64_t i = 0; i < T * K; i++) {
        const bool bad_tok = i / K == 4 || i / K == 7;
        wrong += got_ids[i] != ids[i] ||
                 (bad_tok && (got_ids[i] != i % K || got_w[i] == got_w[i] || w[i] == w[i]));
    }
    K3_CHECK(wrong == 0, "moe_topk non-finite: %d slots differ from ref's NaN-weight rule", wrong);
    free(work), free(w), free(got_w);
    K3_CHECK_ERR(g_cu->ops->moe_topk(g_cu, ds, NULL, T, E, 65, G, TG, true, 1.0f, dwork, dids, dw),
                 K3_ERR_ARG, "moe_topk");
    dfree_all("moe_topk errors");
    free(s), free(bias);
}
static void rows_case(bool scatter) {
    const int64_t width = 257, n_src = 40, n = 25;
    int64_t idx[25];
    bool used[40] = {0};
    for (int j = 0; j < n; j++) { /* distinct (scatter needs it) */
        int64_t r;
        do r = (int64_t)(k3_rng_u64(&g_rng) % n_src);
        while (used[r]);
        used[r] = true;
        idx[j] = r;
    }
    int64_t ns = scatter ? n : n_src, nd = scatter ? n_src : n;
    float *src = randn(ns * width, 1.0f), *want = hnan(nd * width);
    float *dsrc = dcopy(src, ns * width), *ddst = dcopy(want, nd * width);
    if (scatter) {
        K3_CHECK_OK(g_ref->ops->rows_scatter(g_ref, src, width, idx, n, want));
        K3_CHECK_OK(g_cu->ops->rows_scatter(g_cu, dsrc, width, idx, n, ddst));
    } else {
        K3_CHECK_OK(g_ref->ops->rows_gather(g_ref, src, width, idx, n, want));
        K3_CHECK_OK(g_cu->ops->rows_gather(g_cu, dsrc, width, idx, n, ddst));
    }
    /* NaN rows untouched by scatter compare bit for bit too (same NaN bits on both sides) */
    cmp_exact(hget(ddst, nd * width), want, nd * width, scatter ? "rows_scatter" : "rows_gather");
    dfree_all("rows");
    free(src), free(want);
}
static void test_rows_gather(void) {
    rows_case(false);
}
static void test_rows_scatter(void) {
    rows_case(true);
}
static void test_rows_wsum(void) {
    const int64_t width = 700, rows = 24;
    int64_t seg[6] = {0, 3, 4, 11, 20, 24};
    float *x = randn(rows * width, 1.0f), *w = randn(rows, 1.0f);
    float *dx = dcopy(x, rows * width), *dw = dcopy(w, rows);
    for (int uni = 0; uni < 2; uni++)
        for (int wt_ = 0; wt_ < 2; wt_++) {
            int64_t n_seg = uni ? 6 : 5;
            float *want = hnan(n_seg * width), *dy = dpoison(n_seg * width);
            K3_CHECK_OK(g_ref->ops->rows_wsum(g_ref, x, wt_ ? w : NULL, uni ? NULL : seg, 4, n_seg,
                                              width, want));
            K3_CHECK_OK(g_cu->ops->rows_wsum(g_cu, dx, wt_ ? dw : NULL, uni ? NULL : seg, 4, n_seg,
                                             width, dy));
            cmp(hget(dy, n_seg * width), want, n_seg * width, K3_TOL_OP_REL_L2, "rows_wsum");
            free(want);
        }
    int64_t bad[3] = {0, 2, 2};
    K3_CHECK_ERR(g_cu->ops->rows_wsum(g_cu, dx, NULL, bad, 0, 2, width, dx), K3_ERR_ARG,
                 "segment 1");
    dfree_all("rows_wsum");
    free(x), free(w);
}

/* ---- varlen ops: cuda against the cpu backend on the same batch ------------------------------ */
/* A batch descriptor twice: its host view for the cpu backend (arrays in host memory) and its
   device view for cuda (uploaded into a guarded device buffer). */
typedef struct {
    k3_seqs h, d;
    void *hb;
} seqs_pair;
static seqs_pair make_seqs(int n, const int32_t *ntok, const int32_t *pos, const int32_t *slot,
                           const int32_t *blocks, int mb) {
    seqs_pair p;
    const size_t nb = k3_seqs_floats(n, mb) * 4;
    void *h2 = malloc(nb);
    p.hb = malloc(nb);
    K3_CHECK_OK(k3_seqs_build(n, ntok, pos, slot, blocks, mb, p.hb, p.hb, &p.h));
    void *d = dput(NULL, nb);
    K3_CHECK_OK(k3_seqs_build(n, ntok, pos, slot, blocks, mb, h2, d, &p.d));
    K3_ASSERT(k3_backend_upload(g_cu, d, h2, nb) == K3_OK);
    free(h2);
    return p;
}
/* The step the varlen tests share: two decode tokens, a prefill of 70 from position 0 (a full
   chunk of 64 and a tail), a prefill piece of 5 at 130; slots and cache blocks shuffled. */
#define SQ_N      4
#define SQ_MB     3  /* blocks per sequence: max_ctx 135 */
#define SQ_BLOCKS 16 /* blocks of the cache pool */
#define SQ_SLOTS  4
static seqs_pair std_seqs(void) {
    static const int32_t ntok[SQ_N] = {1, 70, 5, 1}, pos[SQ_N] = {10, 0, 130, 63};
    static const int32_t slot[SQ_N] = {2, 0, 3, 1};
    static const int32_t blocks[SQ_N * SQ_MB] = {9, 4, 14, 1, 12, 6, 3, 15, 0, 7, 11, 2};
    return make_seqs(SQ_N, ntok, pos, slot, blocks, SQ_MB);
}
/* rows × n floats of a at row stride s, contiguous (malloc) */
static float *rows_of(const float *a, int64_t rows, int64_t n, int64_t s) {
    float *r = hnan(rows * n);
    for (int64_t t = 0; t < rows; t++) memcpy(r + t * n, a + t * s, (size_t)n * 4);
    return r;
}
static int64_t count_nan(const float *a, int64_t n) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) c += isnan(a[i]);
    return c;
}

static void test_rmsnorm_rows(void) {
    const int64_t T = 6, n = 1000, xs = 1100, ys = 1030;
    float *x = randn(T * xs, 2.0f), *w = randn(n, 1.0f), *want = hnan(T * ys);
    float *xc = rows_of(x, T, n, xs);
    float *dx = dcopy(x, T * xs), *dw = dcopy(w, n), *dy = dpoison(T * ys);
    float *dxc = dcopy(xc, T * n), *dyc = dpoison(T * n);
    K3_CHECK_OK(g_cpu->ops->rmsnorm_rows(g_cpu, x, xs, w, T, n, 1e-6f, want, ys));
    K3_CHECK_OK(g_cu->ops->rmsnorm_rows(g_cu, dx, xs, dw, T, n, 1e-6f, dy, ys));
    K3_CHECK_OK(g_cu->ops->rmsnorm(g_cu, dxc, dw, T, n, 1e-6f, dyc));
    float *got = hget(dy, T * ys), *gr = rows_of(got, T, n, ys), *wr = rows_of(want, T, n, ys);
    K3_CHECK(count_nan(got, T * ys) == T * (ys - n), "rmsnorm_rows: wrote outside its rows");
    float *flat = hget(dyc, T * n);
    K3_CHECK(memcmp(flat, gr, (size_t)(T * n) * 4) == 0, "rmsnorm_rows: not rmsnorm's bits");
    free(flat);
    K3_CHECK_OK(g_cu->ops->rmsnorm_rows(g_cu, dx, xs, dw, T, n, 1e-6f, dx, xs)); /* in place */
    float *ip = hget(dx, T * xs), *ipr = rows_of(ip, T, n, xs);
    K3_CHECK(memcmp(ipr, gr, (size_t)(T * n) * 4) == 0, "rmsnorm_rows in place differs");
    cmp(gr, wr, T * n, K3_TOL_OP_REL_L2, "rmsnorm_rows vs cpu");
    K3_CHECK_ERR(g_cu->ops->rmsnorm_rows(g_cu, dx, 10, dw, T, n, 1e-6f, dy, ys), K3_ERR_ARG,
                 "rmsnorm_rows");
    dfree_all("rmsnorm_rows");
    free(x), free(w), free(want), free(xc), free(got), free(wr), free(ip), free(ipr);
}

/* matmul_heads on unaligned strided views, against cpu (rel-L2) and bit for bit against H cuda
   matmul / matmul_tn calls on contiguous copies (the contract) */
static void heads_case(k3_dtype dt, bool trans) {
    const int H = 4;
    const int64_t T = 5, r0 = 3, rh = 40, nr = 32, in = 96, out = r0 + (H - 1) * rh + nr + 2;
    const int64_t xl = trans ? nr : in, yl = trans ? in : nr; /* a head's x and y row */
    const int64_t xh = xl + 2, xt = H * xh + 6, yh = yl + 1, yt = H * yh + 2;
    const int64_t nx = (T - 1) * xt + (H - 1) * xh + xl, ny = (T - 1) * yt + (H - 1) * yh + yl;
    char what[80];
    snprintf(what, sizeof what, "matmul_heads %s%s", k3_dtype_name(dt), trans ? " trans" : "");
    wt w = make_w(dt, out, in);
    float *x = randn(nx, 1.0f), *want = hnan(ny), *work = hnan(T * (in + nr));
    float *dx = dcopy(x, nx), *dy = dpoison(ny), *dwork = dpoison(T * (in + nr));
    K3_CHECK_OK(g_cpu->ops->matmul_heads(g_cpu, x, xt, xh, T, H, &w.host, r0, rh, nr, trans, want,
                                         yt, yh, work));
    K3_CHECK_OK(g_cu->ops->matmul_heads(g_cu, dx, xt, xh, T, H, &w.dev, r0, rh, nr, trans, dy, yt,
                                        yh, dwork));
    float *got = hget(dy, ny);
    K3_CHECK(count_nan(got, ny) == ny - T * H * yl, "%s: wrote outside its rows", what);
    float *g = hnan(T * H * yl), *wv = hnan(T * H * yl);
    for (int h = 0; h < H; h++) {
        for (int64_t t = 0; t < T; t++) {
            memcpy(g + (h * T + t) * yl, got + t * yt + h * yh, (size_t)yl * 4);
            memcpy(wv + (h * T + t) * yl, want + t * yt + h * yh, (size_t)yl * 4);
        }
        k3_tensor view;
        K3_CHECK_OK(k3_tensor_rows(&w.dev, r0 + h * rh, nr, &view));
        float *xc = hnan(T * xl);
        for (int64_t t = 0; t < T; t++) memcpy(xc + t * xl, x + t * xt + h * xh, (size_t)xl * 4);
        float *dxc = dcopy(xc, T * xl), *dyc = dpoison(T * yl);
        if (trans)
            K3_CHECK_OK(g_cu->ops->matmul_tn(g_cu, dxc, T, &view, dyc));
        else
            K3_CHECK_OK(g_cu->ops->matmul(g_cu, dxc, T, &view, dyc));
        float *one = hget(dyc, T * yl);
        K3_CHECK(memcmp(one, g + h * T * yl, (size_t)(T * yl) * 4) == 0,
                 "%s: head %d is not its matmul's bits", what, h);
        free(one), free(xc);
    }
    cmp(g, wv, T * H * yl, K3_TOL_OP_REL_L2, what);
    dfree_all(what);
    free(x), free(want), free(work), free(got), free(wv), free_w(&w);
}
static void test_matmul_heads(void) {
    for (int tr = 0; tr < 2; tr++) {
        heads_case(K3_DT_F32, tr != 0);
        heads_case(K3_DT_BF16, tr != 0);
        heads_case(K3_DT_MXFP4, tr != 0);
    }
    wt w = make_w(K3_DT_BF16, 10, 64);
    float *dx = dpoison(64), *dy = dpoison(64);
    K3_CHECK_ERR(
        g_cu->ops->matmul_heads(g_cu, dx, 64, 8, 1, 2, &w.dev, 0, 6, 5, false, dy, 5, 5, NULL),
        K3_ERR_SHAPE, "matmul_heads");
    dfree_all("matmul_heads errors");
    free_w(&w);
}

static void test_kv_write(void) {
    const int W = 72;
    seqs_pair sq = std_seqs();
    const int64_t T = sq.h.T, nc = (int64_t)SQ_BLOCKS * K3_KV_BLOCK * W;
    float *src = randn(T * W, 1.0f), *cache = randn(nc, 1.0f);
    float *dsrc = dcopy(src, T * W), *dcache = dcopy(cache, nc);
    K3_CHECK_OK(g_cpu->ops->kv_write(g_cpu, &sq.h, src, W, cache));
    K3_CHECK_OK(g_cu->ops->kv_write(g_cu, &sq.d, dsrc, W, dcache));
    cmp_exact(hget(dcache, nc), cache, nc, "kv_write");
    dfree_all("kv_write");
    free(src), free(cache), free(sq.hb);
}

/* g_coherent: inputs whose bf16 remainders all have one sign — x = m·(b + 0.375·2^-7), b a bf16 in
   [1, 2), so lo = x − bf16(x) = 0.375 ulp·m > 0 — where dropping a split product moves every
   score and output coherently (~2^-9 of it), far past K3_TOL_MLA_SPLIT_IN's bound; random signs
   would average such a bug away below a worst-case bound. */
static bool g_coherent;
static void coherent_lo(float *x, int64_t n, float m) {
    for (int64_t i = 0; i < n; i++)
        x[i] = m * (1.0f + (float)(k3_rng_u64(&g_rng) % 128) / 128.0f + 0.375f / 128.0f);
}
/* attn_paged vs cpu, and each token bit for bit cuda attn_latent over a contiguous copy of its
   sequence's rows 0..p (the contract) */
static void paged_case(int n, const int32_t *ntok, const int32_t *pos, int mb, int n_blocks, int H,
                       int W, int Rkv, const char *what) {
    int32_t *blocks = malloc((size_t)n * mb * 4), slot[8];
    for (int b = 0; b < n * mb; b++) blocks[b] = (int32_t)((b * 7 + 3) % n_blocks); /* distinct */
    for (int i = 0; i < n; i++) slot[i] = i;
    seqs_pair sq = make_seqs(n, ntok, pos, slot, blocks, mb);
    const int64_t T = sq.h.T, nc = (int64_t)n_blocks * K3_KV_BLOCK * W, nq = T * H * W;
    const int64_t no = T * H * Rkv;
    const size_t wf = k3_attn_latent_causal_work_floats(sq.h.max_ctx, H);
    float *qc = randn(nq, 1.0f), *cache = randn(nc, 1.0f), *want = hnan(no), *work = hnan(wf);
    if (g_coherent) coherent_lo(qc, nq, 0.0625f), coherent_lo(cache, nc, 1.0f);
    float *dq = dcopy(qc, nq), *dc = dcopy(cache, nc), *dy = dpoison(no), *dw = dpoison(wf);
    const float scale = 1.0f / sqrtf((float)W);
    float *qr = bf16_round(qc, nq), *cr = bf16_round(cache, nc), *want_r = hnan(no);
    K3_CHECK_OK(g_cpu->ops->attn_paged(g_cpu, &sq.h, qc, cache, H, W, Rkv, scale, want, work));
    K3_CHECK_OK(g_ref->ops->attn_paged(g_ref, &sq.h, qr, cr, H, W, Rkv, scale, want_r, work));
#ifdef K3_CUDA_EMULATE
    const unsigned long long mma0 = k3emu_mma_count("mla_split_kernel");
#endif
    K3_CHECK_OK(g_cu->ops->attn_paged(g_cu, &sq.d, dq, dc, H, W, Rkv, scale, dy, dw));
    float *got = hget(dy, no);
#ifdef K3_CUDA_EMULATE /* the tensor-core instruction count of the op */
    const unsigned long long mma = k3emu_mma_count("mla_split_kernel") - mma0;
    printf("    %s: %llu mma.m16n8k16 in mla_split_kernel\n", what, mma);
    K3_CHECK(W > 640 || !g_mla_terms || mma > 0, "%s: no tensor-core instruction ran", what);
#endif
    int bad = 0;
    int64_t bb = 0;
    double worst = 0, worst_r = 0;
    for (int i = 0, t = 0; i < n; i++) {
        const int64_t n_ctx = pos[i] + ntok[i];
        float *cont = hnan(n_ctx * W);
        for (int64_t p = 0; p < n_ctx; p++)
            memcpy(cont + p * W, cache + k3_seqs_kv_row(&sq.h, i, p) * W, (size_t)W * 4);
        float *dcont = dcopy(cont, n_ctx * W), *d1 = dpoison((int64_t)H * Rkv);
        float *cont_r = bf16_round(cont, n_ctx * W);
        for (int j = 0; j < ntok[i]; j++, t++) {
            K3_CHECK_OK(g_cu->ops->attn_latent(g_cu, dq + (int64_t)t * H * W, dcont, pos[i] + j + 1,
                                               H, W, Rkv, scale, d1, dw));
            float *one = hget(d1, (int64_t)H * Rkv);
            bad += memcmp(one, got + (int64_t)t * H * Rkv, (size_t)H * Rkv * 4) != 0;
            free(one);
            if (W > 640 || !g_mla_terms) continue; /* the fp32 kernel: the op bound below */
            const int64_t o = (int64_t)t * H * Rkv, oq = (int64_t)t * H * W, nj = pos[i] + j + 1;
            if (g_mla_terms == 1) /* bf16: the kernel's own arithmetic on the rounded inputs */
                bb += mla_check(got + o, want_r + o, qr + oq, cont_r, nj, H, W, Rkv, scale, true, 1,
                                &worst_r);
            bb += mla_check(got + o, want + o, qc + oq, cont, nj, H, W, Rkv, scale, false,
                            g_mla_terms, &worst);
        }
        free(cont), free(cont_r);
    }
    K3_CHECK(bad == 0, "%s: %d tokens differ from attn_latent on a contiguous copy", what, bad);
    if (W > 640 || !g_mla_terms)
        cmp(got, want, no, K3_TOL_OP_REL_L2, what);
    else {
        K3_CHECK(bb == 0,
                 "%s: %lld elements past the bf16 bound (worst %.3g of it vs bf16 inputs, %.3g "
                 "vs fp32)",
                 what, (long long)bb, worst_r, worst);
        printf("    %s: vs fp32 cpu rel-L2 %.3g; worst %.3g (bf16 inputs) and %.3g (fp32) of the "
               "bound\n",
               what, k3_rel_l2(got, want, (size_t)no), worst_r, worst);
        free(got);
    }
    dfree_all(what);
    free(blocks), free(qc), free(cache), free(want), free(work), free(sq.hb);
    free(qr), free(cr), free(want_r);
}
static void test_attn_paged(void) {
    static const int32_t ntok[SQ_N] = {1, 70, 5, 1}, pos[SQ_N] = {10, 0, 130, 63};
    paged_case(SQ_N, ntok, pos, SQ_MB, SQ_BLOCKS, 4, 576, 512, "attn_paged");
    /* a context past the scores a block keeps (8192): recomputed per tile */
    static const int32_t ntok2[2] = {1, 3}, pos2[2] = {8299, 5};
    paged_case(2, ntok2, pos2, 130, 300, 2, 80, 64, "attn_paged long");
    /* decode only (every token alone; 21 heads: a partial second head tile), a context of 600
       (3 splits and the combine), and a row past the tensor-core width (the fp32 kernel) */
    static const int32_t ntok3[3] = {1, 1, 1}, pos3[3] = {599, 0, 64};
    paged_case(3, ntok3, pos3, 10, 30, 21, 576, 512, "attn_paged decode");
    static const int32_t ntok4[2] = {2, 1}, pos4[2] = {3, 300};
    paged_case(2, ntok4, pos4, 5, 12, 2, 720, 700, "attn_paged wide");
    /* the default backend: split operands on tensor cores (the mma count > 0, decode included),
       within K3_TOL_MLA_SPLIT_IN's bound of fp32 ref; the opt-out: the fp32 kernel at K3's width */
    k3_backend *mma_be = g_cu;
    g_cu = g_cu32, g_mma = false, g_mla_terms = 3;
    paged_case(SQ_N, ntok, pos, SQ_MB, SQ_BLOCKS, 4, 576, 512, "attn_paged split");
    paged_case(3, ntok3, pos3, 10, 30, 21, 576, 512, "attn_paged decode split");
    g_coherent = true;
    paged_case(3, ntok3, pos3, 10, 30, 21, 576, 512, "attn_paged decode split coherent");
    g_coherent = false;
    g_cu = g_cuf, g_mla_terms = 0;
    paged_case(SQ_N, ntok, pos, SQ_MB, SQ_BLOCKS, 4, 576, 512, "attn_paged fp32");
    g_cu = mma_be, g_mma = true, g_mla_terms = 1;
}

static void test_short_conv_seqs(void) {
    const int64_t P = 300;
    const int K = 4;
    const int64_t ss = (K - 1) * P + 7, ns = SQ_SLOTS * ss;
    seqs_pair sq = std_seqs();
    const int64_t T = sq.h.T;
    float *in = randn(T * P, 1.0f), *w = randn(P * K, 0.5f), *st = randn(ns, 1.0f);
    float *want = hnan(T * P);
    float *din = dcopy(in, T * P), *dw = dcopy(w, P * K), *dst = dcopy(st, ns);
    float *dout = dpoison(T * P);
    K3_CHECK_OK(g_cpu->ops->short_conv_seqs(g_cpu, &sq.h, in, P, K, w, st, ss, want));
    K3_CHECK_OK(g_cu->ops->short_conv_seqs(g_cu, &sq.d, din, P, K, dw, dst, ss, dout));
    cmp(hget(dout, T * P), want, T * P, K3_TOL_OP_REL_L2, "short_conv_seqs out");
    cmp_exact(hget(dst, ns), st, ns, "short_conv_seqs state");
    dfree_all("short_conv_seqs");
    free(in), free(w), free(st), free(want), free(sq.hb);
}

/* kda_seqs vs cpu, and bit for bit the cuda kda_chunked / kda_recurrent of each sequence on its
   own rows and state (the contract) */
static void kda_seqs_case(int C) {
    const int H = 2, dk = 64, dv = 48;
    seqs_pair sq = std_seqs();
    const int64_t T = sq.h.T, nqk = T * H * dk, nv = T * H * dv;
    const int64_t Ss = (int64_t)H * dk * dv + 16, nS = SQ_SLOTS * Ss;
    float *q = randn(nqk, 1.0f), *k = randn(nqk, 1.0f), *v = randn(nv, 1.0f);
    float *g = randn(nqk, 1.0f), *beta = randn(T * H, 1.0f), *S = randn(nS, 0.5f);
    for (int64_t i = 0; i < nqk; i++) g[i] = -0.3f * fabsf(g[i]) - 0.01f;
    for (int64_t i = 0; i < T * H; i++) beta[i] = (float)k3_rng_uniform(&g_rng);
    float *qk[2] = {q, k};
    for (int a = 0; a < 2; a++)
        for (int64_t r = 0; r < T * H; r++) {
            float ss = 0;
            for (int i = 0; i < dk; i++) ss += qk[a][r * dk + i] * qk[a][r * dk + i];
            for (int i = 0; i < dk; i++) qk[a][r * dk + i] /= sqrtf(ss);
        }
    const size_t wf = (C >= 2 ? k3_kda_chunk_work_floats(C, dk, dv) : 1) * (size_t)H;
    float *S0 = malloc((size_t)nS * 4), *want = hnan(nv), *work = hnan((int64_t)wf);
    memcpy(S0, S, (size_t)nS * 4);
    float *dq = dcopy(q, nqk), *dk_ = dcopy(k, nqk), *dv_ = dcopy(v, nv), *dg = dcopy(g, nqk);
    float *db = dcopy(beta, T * H), *dS = dcopy(S0, nS), *dS1 = dcopy(S0, nS);
    float *dO = dpoison(nv), *dO1 = dpoison(nv), *dwork = dpoison((int64_t)wf);
    const float scale = 1.0f / sqrtf((float)dk);
    K3_CHECK_OK(g_cpu->ops->kda_seqs(g_cpu, &sq.h, q, k, v, g, beta, H, dk, dv, scale, S, Ss, want,
                                     C, work));
    K3_CHECK_OK(g_cu->ops->kda_seqs(g_cu, &sq.d, dq, dk_, dv_, dg, db, H, dk, dv, scale, dS, Ss, dO,
                                    C, dwork));
    const int32_t *t0 = sq.h.tok0;
    for (int i = 0; i < SQ_N; i++) {
        const int64_t a = t0[i], n = t0[i + 1] - t0[i];
        const int64_t oq = a * H * dk, ov = a * H * dv, os = sq.h.slot[i] * Ss;
        if (sq.h.pos[i] == 0) /* the contract: a sequence at position 0 starts from S = 0 */
            K3_CHECK_OK(g_cu->ops->fill(g_cu, dS1 + os, (int64_t)H * dk * dv, 0.0f));
        if (C >= 2 && n >= C)
            K3_CHECK_OK(g_cu->ops->kda_chunked(g_cu, dq + oq, dk_ + oq, dv_ + ov, dg + oq,
                                               db + a * H, n, H, dk, dv, scale, dS1 + os, dO1 + ov,
                                               C, dwork));
        else
            K3_CHECK_OK(g_cu->ops->kda_recurrent(g_cu, dq + oq, dk_ + oq, dv_ + ov, dg + oq,
                                                 db + a * H, n, H, dk, dv, scale, dS1 + os,
                                                 dO1 + ov));
    }
    float *got = hget(dO, nv), *gotS = hget(dS, nS), *one = hget(dO1, nv), *oneS = hget(dS1, nS);
    K3_CHECK(memcmp(got, one, (size_t)nv * 4) == 0 && memcmp(gotS, oneS, (size_t)nS * 4) == 0,
             "kda_seqs (C %d): not the per-sequence ops' bits", C);
    free(one), free(oneS);
    if (C == 16 && g_mma) /* the tensor-core form: kda_case bounds its ops against ref */
        free(got), free(gotS);
    else {
        cmp(got, want, nv, K3_TOL_KDA_CHUNK_REL_L2, C ? "kda_seqs o (chunked)" : "kda_seqs o");
        cmp(gotS, S, nS, K3_TOL_KDA_CHUNK_REL_L2, C ? "kda_seqs S (chunked)" : "kda_seqs S");
    }
    dfree_all("kda_seqs");
    free(q), free(k), free(v), free(g), free(beta), free(S), free(S0), free(want), free(work);
    free(sq.hb);
}
static void test_kda_seqs(void) {
    kda_seqs_case(64); /* the 70-token prefill: a chunk and a tail; the rest recurrent */
    kda_seqs_case(0);  /* every sequence by the recurrence */
    kda_seqs_case(16); /* tensor cores: 4 chunks and a tail of 6, the 5-token piece recurrent */
}

/* non-finite rows: sequence 1 holds a NaN, sequence 2 an Inf but was flagged before (left as it
   is), 0 and 3 are finite; then the per-sequence rows form */
static void test_nonfinite_rows(void) {
    const int64_t D = 130;
    seqs_pair sq = std_seqs();
    for (int per = 0; per < 2; per++) {
        const int64_t rows = per ? SQ_N : sq.h.T, ny = rows * D;
        float *y = randn(ny, 1.0f);
        int32_t flags[SQ_N] = {0, 0, 7, 0}, got_f[SQ_N];
        if (per) {
            y[1 * D + 5] = NAN;
            y[2 * D + 9] = INFINITY;
        } else {
            y[(sq.h.tok0[1] + 40) * D + 5] = NAN;
            y[(sq.h.tok0[2] + 2) * D + 9] = INFINITY;
        }
        float *dy = dcopy(y, ny);
        int32_t *dflags = dput(flags, sizeof flags);
        K3_CHECK_OK(g_cpu->ops->nonfinite_rows(g_cpu, &sq.h, y, D, per != 0, 3, flags));
        K3_CHECK_OK(g_cu->ops->nonfinite_rows(g_cu, &sq.d, dy, D, per != 0, 3, dflags));
        dget(got_f, dflags, sizeof got_f);
        K3_CHECK(memcmp(got_f, flags, sizeof flags) == 0 && flags[1] == 3 && flags[0] == 0 &&
                     flags[2] == 7,
                 "nonfinite_rows (per_seq %d): flags %d %d %d %d, cpu %d %d %d %d", per, got_f[0],
                 got_f[1], got_f[2], got_f[3], flags[0], flags[1], flags[2], flags[3]);
        cmp_exact(hget(dy, ny), y, ny, "nonfinite_rows");
        dfree_all("nonfinite_rows");
        free(y);
    }
    free(sq.hb);
}

static void test_rows_last(void) {
    const int64_t D = 130;
    const int n_slab = 3;
    seqs_pair sq = std_seqs();
    const int64_t slab = sq.h.T * D + 9, ns = n_slab * slab, nd = (int64_t)n_slab * SQ_N * D;
    float *src = randn(ns, 1.0f), *want = hnan(nd);
    float *dsrc = dcopy(src, ns), *ddst = dpoison(nd);
    K3_CHECK_OK(g_cpu->ops->rows_last(g_cpu, &sq.h, src, slab, n_slab, D, want));
    K3_CHECK_OK(g_cu->ops->rows_last(g_cu, &sq.d, dsrc, slab, n_slab, D, ddst));
    cmp_exact(hget(ddst, nd), want, nd, "rows_last");
    dfree_all("rows_last");
    free(src), free(want), free(sq.hb);
}

/* The bound of one cuda moe_experts output element with MXFP4 experts (the tensor-core form:
   x and h split into g_moe_terms bf16 terms at the GEMMs' inputs, exact weights, fp32 accumulation)
   against the float64 evaluation of the same weights, derived from tests/tolerances.h: each GEMM
   output is off by at most c·Σ|w·in| (c = K3_TOL_SPLIT_GEMM_REL(terms, n), n its inner width;
   terms 1: K3_TOL_BF16_ACT_REL + (2.01)·n·u) plus what its
   input's error carries (Σ|w|·Δin); act(g, u) = a(g)·b(u) carries Δg, Δu by its Lipschitz
   constants (|b'| <= 1, |b(u)| <= |u|, |a'| <= La: SiLU 1.0998, SiTU 1 + beta/4) plus 8 u·|h| for
   libm; the weighted sum adds Σ|w_k|·Δy_k and K·u·Σ|w_k y_k|. */
static int g_moe_terms = 3; /* the activation terms the cuda backend runs (K3_CUDA_MMA_TERMS) */
static double act_f64(double g, double u, double beta, double lin) {
    const double sg = 1.0 / (1.0 + exp(-g));
    if (beta < 0) return g * sg * u;
    return beta * tanh(g / beta) * sg * (lin > 0 ? lin * tanh(u / lin) : u);
}
typedef struct {
    double v, d; /* the float64 value and the bound of the cuda result's distance to it */
} moe_ref_v;
static double mx(const wt *m, int64_t row, int64_t col) {
    const int64_t in = m->host.shape[1];
    return k3_mxfp4_get((const uint8_t *)m->data + row * (in / 2), m->scale + row * (in / 32), col);
}
/* item i's hidden row: h [I] = act(W1 x, W3 x) in float64 and dh [I] its bound */
static void moe_ref_hidden(const wt m[3], const float *x, int64_t Lw, int64_t I, float beta,
                           float lin, double *h, double *dh) {
    const double c1 = K3_TOL_SPLIT_GEMM_REL(g_moe_terms, Lw);
    const double La = beta < 0 ? 1.0998 : 1.0 + beta / 4.0;
    for (int64_t j = 0; j < I; j++) {
        double g = 0, u = 0, ag = 0, au = 0;
        for (int64_t k = 0; k < Lw; k++) {
            const double a = mx(&m[0], j, k) * x[k], b = mx(&m[1], j, k) * x[k];
            g += a, u += b, ag += fabs(a), au += fabs(b);
        }
        const double dg = c1 * ag, du = c1 * au;
        h[j] = act_f64(g, u, beta, lin);
        const double a = beta < 0 ? fabs(g / (1 + exp(-g))) : fabs(act_f64(g, 1.0, beta, 0));
        const double b = beta < 0 || lin <= 0 ? fabs(u) : fabs(lin * tanh(u / lin));
        dh[j] = La * dg * (b + du) + a * du + 8 * K3_FP32_U * fabs(h[j]) + 1e-30;
    }
}
/* its output element o from h, dh */
static moe_ref_v moe_ref_out(const wt *w2, const double *h, const double *dh, int64_t I,
                             int64_t o) {
    const double c2 = K3_TOL_SPLIT_GEMM_REL(g_moe_terms, I);
    double y = 0, dy = 0, ay = 0;
    for (int64_t j = 0; j < I; j++) {
        const double w = mx(w2, o, j);
        y += w * h[j], dy += fabs(w) * dh[j], ay += fabs(w) * (fabs(h[j]) + dh[j]);
    }
    return (moe_ref_v){y, dy + c2 * ay};
}

/* got [T or n, Lw] vs the float64 MoE output, element by element within the bf16 bound; frees got
 */
static void moe_bound_check(float *got, const wt (*m)[3], const int32_t *ids, const float *src,
                            const float *w, int64_t T, int64_t K, int64_t Lw, int64_t I, float beta,
                            float lin, const char *what) {
    const int64_t nr = w ? T : T * K, per = w ? K : 1;
    double *h = malloc((size_t)(per * I) * sizeof *h), *dh = malloc((size_t)(per * I) * sizeof *dh);
    int bad = 0;
    double worst = 0;
    for (int64_t r = 0; r < nr; r++) {
        for (int64_t k = 0; k < per; k++) {
            const int64_t i = r * per + k;
            moe_ref_hidden(m[ids[i]], src + (i / K) * Lw, Lw, I, beta, lin, h + k * I, dh + k * I);
        }
        for (int64_t o = 0; o < Lw; o++) {
            double v = 0, d = 0, aw = 0;
            for (int64_t k = 0; k < per; k++) {
                const int64_t i = r * per + k;
                const moe_ref_v it = moe_ref_out(&m[ids[i]][2], h + k * I, dh + k * I, I, o);
                const double wk = w ? w[i] : 1.0;
                v += wk * it.v, d += fabs(wk) * it.d, aw += fabs(wk * it.v);
            }
            d += (double)K * K3_FP32_U * aw;
            const double err = fabs((double)got[r * Lw + o] - v);
            bad += !(err <= d);
            worst = err / d > worst ? err / d : worst;
        }
    }
    K3_CHECK(bad == 0, "%s, %d term(s): %d of %lld elements outside the bound (worst %.3g of it)",
             what, g_moe_terms, bad, (long long)(nr * Lw), worst);
    printf("  %s, %d term(s): worst |cuda - f64| %.3g of the bound\n", what, g_moe_terms, worst);
    free(h), free(dh), free(got);
}

/* moe_experts: a table of structs with one expert not on this rank; vs cpu, and bit for bit the
   cuda matmul -> act -> matmul chain per row (+ rows_wsum for the weighted form) for BF16
   experts; MXFP4 experts run on the tensor cores (an mma count > 0 in the emulation) and are
   checked element by element against float64 within the bound above; the errors */
typedef struct {
    k3_tensor w1, w3, w2;
    int other; /* the stride is the struct's, not three tensors' */
} expert_row;
#define MOE_E    6
#define MOE_MAXN 120 /* slot rows: 40 tokens of 3 */
static void moe_case(k3_dtype dt, bool weighted, bool situ_act, int64_t T) {
    const int64_t Lw = 64, I = 96, K = 3, n = T * K;
    const int E = MOE_E, missing = 4;
    const float beta = situ_act ? 4.0f : -1.0f, lin = situ_act ? 2.5f : 0.0f;
    char what[80];
    snprintf(what, sizeof what, "moe_experts %s%s%s T %lld", k3_dtype_name(dt),
             weighted ? " weighted" : "", situ_act ? " situ" : "", (long long)T);
    wt m[MOE_E][3];
    expert_row th[MOE_E], td[MOE_E];
    for (int e = 0; e < E; e++) {
        memset(&th[e], 0, sizeof th[e]), memset(&td[e], 0, sizeof td[e]);
        if (e == missing) continue;
        m[e][0] = make_w(dt, I, Lw), m[e][1] = make_w(dt, I, Lw), m[e][2] = make_w(dt, Lw, I);
        th[e] = (expert_row){m[e][0].host, m[e][1].host, m[e][2].host, e};
        td[e] = (expert_row){m[e][0].dev, m[e][1].dev, m[e][2].dev, e};
    }
    int32_t ids[MOE_MAXN] = {0};
    for (int64_t i = 0; i < n; i++) { /* a token's slots name distinct experts, as the router's */
        bool dup = true;
        while (dup) {
            ids[i] = (int32_t)(k3_rng_u64(&g_rng) % (E - 1));
            if (ids[i] >= missing) ids[i]++;
            dup = false;
            for (int64_t j = i - i % K; j < i; j++) dup = dup || ids[j] == ids[i];
        }
    }
    const int64_t no = (weighted ? T : n) * Lw;
    const size_t wf = k3_moe_experts_work_floats(Lw, I, n, E);
    float *src = randn(T * Lw, 1.0f), *w = randn(n, 0.5f), *want = hnan(no), *work = hnan(wf);
    float *dsrc = dcopy(src, T * Lw), *dwt = dcopy(w, n), *dout = dpoison(no), *dwork = dpoison(wf);
    int32_t *dids = dput(ids, sizeof ids);
    const size_t es = sizeof(expert_row);
#ifdef K3_CUDA_EMULATE
    const unsigned long long mma0 = k3emu_mma_count(NULL);
#endif
    K3_CHECK_OK(g_cpu->ops->moe_experts(g_cpu, src, K, NULL, ids, weighted ? w : NULL, n, E,
                                        &th[0].w1, &th[0].w3, &th[0].w2, es, beta, lin, want,
                                        work));
    K3_CHECK_OK(g_cu->ops->moe_experts(g_cu, dsrc, K, NULL, dids, weighted ? dwt : NULL, n, E,
                                       &td[0].w1, &td[0].w3, &td[0].w2, es, beta, lin, dout,
                                       dwork));
#ifdef K3_CUDA_EMULATE
    K3_CHECK(k3_backend_sync(g_cu) == K3_OK &&
                 (k3emu_mma_count(NULL) > mma0) == (dt == K3_DT_MXFP4),
             "%s: %llu tensor-core mma (want > 0 for MXFP4 experts only)", what,
             k3emu_mma_count(NULL) - mma0);
#endif
    /* the chain on this backend */
    float *dg = dpoison(n * I), *du = dpoison(n * I), *ditem = dpoison(n * Lw);
    float *dsum = dpoison(T * Lw);
    for (int64_t i = 0; i < n; i++) {
        K3_CHECK_OK(g_cu->ops->matmul(g_cu, dsrc + (i / K) * Lw, 1, &td[ids[i]].w1, dg + i * I));
        K3_CHECK_OK(g_cu->ops->matmul(g_cu, dsrc + (i / K) * Lw, 1, &td[ids[i]].w3, du + i * I));
    }
    if (situ_act)
        K3_CHECK_OK(g_cu->ops->situ(g_cu, dg, du, n * I, beta, lin, dg));
    else
        K3_CHECK_OK(g_cu->ops->swiglu(g_cu, dg, du, n * I, dg));
    for (int64_t i = 0; i < n; i++)
        K3_CHECK_OK(g_cu->ops->matmul(g_cu, dg + i * I, 1, &td[ids[i]].w2, ditem + i * Lw));
    K3_CHECK_OK(g_cu->ops->rows_wsum(g_cu, ditem, dwt, NULL, K, T, Lw, dsum));
    float *got = hget(dout, no), *chain = hget(weighted ? dsum : ditem, no);
    if (dt != K3_DT_MXFP4) {
        /* BF16: matmul runs on tensor cores (matmul_mma.cu, 3 bf16 planes of x: an fp32 GEMM of
         * another summation order) while moe_experts' BF16 experts are the CUDA-core kernel, so
         * they agree within one fp32 op's bound, not bit for bit */
        if (dt == K3_DT_BF16) {
            const double r = k3_rel_l2(got, chain, (size_t)no);
            K3_CHECK(all_finite(got, no) && r <= K3_TOL_OP_REL_L2,
                     "%s: rel-L2 %g from matmul -> act -> matmul%s (tol %g)", what, r,
                     weighted ? " -> rows_wsum" : "", K3_TOL_OP_REL_L2);
        } else
            K3_CHECK(memcmp(got, chain, (size_t)no * 4) == 0,
                     "%s: not the bits of matmul -> act -> matmul%s", what,
                     weighted ? " -> rows_wsum" : "");
        cmp(got, want, no, K3_TOL_OP_REL_L2, what);
    } else {
        moe_bound_check(got, m, ids, src, weighted ? w : NULL, T, K, Lw, I, beta, lin, what);
        /* the masked layout (k3_cuda_moe.h) on the same rows: capacity the largest count + 3
           (rows past the counts NaN, never read), then the slot-order combine */
        int32_t cnt[MOE_E] = {0}, pos[MOE_MAXN] = {0};
        int64_t cap = 0;
        for (int64_t i = 0; i < n; i++) cap = ++cnt[ids[i]] > cap ? cnt[ids[i]] : cap;
        cap += 3;
        float *xm = hnan(E * cap * Lw), *ones = malloc((size_t)n * 4);
        memset(cnt, 0, sizeof cnt);
        for (int64_t i = 0; i < n; i++) {
            pos[i] = (int32_t)(ids[i] * cap + cnt[ids[i]]++);
            memcpy(xm + pos[i] * Lw, src + (i / K) * Lw, (size_t)Lw * 4);
            ones[i] = 1.0f;
        }
        float *dxm = dcopy(xm, E * cap * Lw), *dh = dpoison(E * cap * I);
        float *dy = dpoison(E * cap * Lw), *dmo = dpoison(no), *d1 = dcopy(ones, n);
        int32_t *dcnt = dput(cnt, sizeof cnt), *dpos = dput(pos, sizeof pos);
        K3_CHECK_OK(k3_cuda_moe_experts_masked(g_cu, dxm, dcnt, cap, E, &td[0].w1, &td[0].w3,
                                               &td[0].w2, es, beta, lin, dh, dy));
        K3_CHECK_OK(k3_cuda_moe_combine(g_cu, dy, dpos, weighted ? dwt : d1, weighted ? T : n,
                                        weighted ? (int)K : 1, Lw, dmo));
        char mwhat[100];
        snprintf(mwhat, sizeof mwhat, "%s (masked)", what);
        moe_bound_check(hget(dmo, no), m, ids, src, weighted ? w : NULL, T, K, Lw, I, beta, lin,
                        mwhat);
        free(xm), free(ones);
    }
    free(chain);
    if (dt == K3_DT_MXFP4 && weighted) {
        /* the device route's capacity (one item of each token an expert: T rows): every slot to
           expert 1 is T·K rows, named, never dropped */
        int32_t one[MOE_MAXN];
        for (int64_t i = 0; i < n; i++) one[i] = 1;
        int32_t *done = dput(one, sizeof one);
        char msg[96];
        snprintf(msg, sizeof msg, "expert 1 received %lld rows, over its capacity of %lld rows",
                 (long long)n, (long long)T);
        K3_CHECK_ERR(g_cu->ops->moe_experts(g_cu, dsrc, K, NULL, done, dwt, n, E, &td[0].w1,
                                            &td[0].w3, &td[0].w2, es, beta, lin, dout, dwork),
                     K3_ERR_STATE, msg);
    }
    /* row 5 needs the missing expert; then row 2 an id out of range (the first is named; the
       unweighted form's out holds n rows: the device route runs before its check is read) */
    ids[5] = missing;
    int32_t *dbad = dput(ids, sizeof ids);
    float *dall = dpoison(n * Lw);
    K3_CHECK_ERR(g_cu->ops->moe_experts(g_cu, dsrc, K, NULL, dbad, NULL, n, E, &td[0].w1, &td[0].w3,
                                        &td[0].w2, es, beta, lin, dall, dwork),
                 K3_ERR_MISSING, "row 5 needs expert 4");
    ids[2] = E;
    int32_t *dbad2 = dput(ids, sizeof ids);
    K3_CHECK_ERR(g_cu->ops->moe_experts(g_cu, dsrc, K, NULL, dbad2, NULL, n, E, &td[0].w1,
                                        &td[0].w3, &td[0].w2, es, beta, lin, dall, dwork),
                 K3_ERR_ARG, "row 2 has expert id 6");
    dfree_all(what);
    for (int e = 0; e < E; e++)
        if (e != missing)
            for (int j = 0; j < 3; j++) free_w(&m[e][j]);
    free(src), free(w), free(want), free(work);
}
/* K3_CUDA_MMA_TERMS=4: moe_experts fails with K3_ERR_ARG naming the variable */
static void moe_terms_refused(void) {
    const int64_t Lw = 64, I = 96;
    wt m[3] = {make_w(K3_DT_MXFP4, I, Lw), make_w(K3_DT_MXFP4, I, Lw), make_w(K3_DT_MXFP4, Lw, I)};
    expert_row td = {m[0].dev, m[1].dev, m[2].dev, 0};
    const int32_t ids[1] = {0};
    const size_t wf = k3_moe_experts_work_floats(Lw, I, 1, 1);
    float *src = randn(Lw, 1.0f), *dsrc = dcopy(src, Lw), *dout = dpoison(Lw);
    float *dwork = dpoison(wf);
    int32_t *dids = dput(ids, sizeof ids);
    K3_CHECK_ERR(g_cu->ops->moe_experts(g_cu, dsrc, 1, NULL, dids, NULL, 1, 1, &td.w1, &td.w3,
                                        &td.w2, sizeof td, -1.0f, 0.0f, dout, dwork),
                 K3_ERR_ARG, "K3_CUDA_MMA_TERMS=4");
    dfree_all("moe_experts terms");
    for (int j = 0; j < 3; j++) free_w(&m[j]);
    free(src);
}
/* MXFP4 experts with 1 activation term (K3_CUDA_MMA_TERMS=1: plain bf16) and the default (3,
   the variable unset), each within its own bound; a bad K3_CUDA_MMA_TERMS is an error naming it */
static void test_moe_experts(void) {
    const char *was = getenv("K3_CUDA_MMA_TERMS");
    char *keep = was ? strdup(was) : NULL;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 0)
            setenv("K3_CUDA_MMA_TERMS", "1", 1), g_moe_terms = 1;
        else
            unsetenv("K3_CUDA_MMA_TERMS"), g_moe_terms = K3_CUDA_MOE_TERMS;
        moe_case(K3_DT_MXFP4, false, false, 7); /* <= 8 rows an expert: swap-AB */
        moe_case(K3_DT_MXFP4, true, true, 7);
        moe_case(K3_DT_MXFP4, true, false, 40); /* ~24 rows an expert: the 16-row tiles */
    }
    moe_case(K3_DT_BF16, true, false, 7);
    setenv("K3_CUDA_MMA_TERMS", "4", 1);
    moe_terms_refused();
    if (keep)
        setenv("K3_CUDA_MMA_TERMS", keep, 1);
    else
        unsetenv("K3_CUDA_MMA_TERMS");
    free(keep);
}

/* The counters: an op call, an upload and a download are counted; events and async copies run. */
static void test_op_stats_events(void) {
    k3_op_stats a, b;
    K3_CHECK_OK(k3_backend_op_stats(g_cu, &a));
    float h[100], back[100];
    for (int i = 0; i < 100; i++) h[i] = (float)i;
    float *d = dpoison(100);
    k3_backend_event *ev = NULL;
    K3_CHECK_OK(k3_backend_event_create(g_cu, &ev));
    K3_CHECK(ev != NULL, "cuda: no event");
    K3_CHECK_OK(k3_backend_upload_async(g_cu, d, h, sizeof h));
    K3_CHECK_OK(g_cu->ops->fill(g_cu, d + 50, 50, 2.0f));
    K3_CHECK_OK(k3_backend_download_async(g_cu, back, d, sizeof back));
    K3_CHECK_OK(k3_backend_event_record(g_cu, ev));
    K3_CHECK_OK(k3_backend_event_sync(g_cu, ev));
    bool ok = true;
    for (int i = 0; i < 100; i++) ok &= back[i] == (i < 50 ? (float)i : 2.0f);
    K3_CHECK(ok, "upload_async -> fill -> download_async -> event: wrong values");
    K3_CHECK_OK(k3_backend_op_stats(g_cu, &b));
    K3_CHECK(b.calls[K3_OP_fill] == a.calls[K3_OP_fill] + 1 &&
                 b.h2d_bytes - a.h2d_bytes >= sizeof h &&
                 b.d2h_bytes - a.d2h_bytes >= sizeof back && b.host_syncs - a.host_syncs >= 1,
             "op_stats: fill %llu -> %llu, h2d +%llu, d2h +%llu, syncs +%llu",
             (unsigned long long)a.calls[K3_OP_fill], (unsigned long long)b.calls[K3_OP_fill],
             (unsigned long long)(b.h2d_bytes - a.h2d_bytes),
             (unsigned long long)(b.d2h_bytes - a.d2h_bytes),
             (unsigned long long)(b.host_syncs - a.host_syncs));
    k3_backend_event_destroy(g_cu, ev);
    dfree_all("op_stats");
}

#define K3_OP_TEST(name, params, args) {#name, test_##name},
static const struct {
    const char *name;
    void (*fn)(void);
} k_tests[] = {K3_OP_LIST(K3_OP_TEST)};
#undef K3_OP_TEST
_Static_assert(sizeof(k_tests) / sizeof(k_tests[0]) == K3_OP_COUNT, "one test per op");

int main(void) {
    if (k3_gpu_skip()) return 77;
    printf("test_cuda_ops seed %llu\n", (unsigned long long)k_seed);
    k3_rng_seed(&g_rng, k_seed);
    K3_CHECK_OK(k3_backend_create("ref", NULL, &g_ref));
    K3_CHECK_OK(k3_backend_create("cpu", NULL, &g_cpu));
    K3_CHECK_OK(k3_backend_create("cuda", NULL, &g_cu32));
    setenv("K3_CUDA_MMA", "1", 1); /* read when a cuda backend is created */
    K3_CHECK_OK(k3_backend_create("cuda", NULL, &g_cu));
    setenv("K3_CUDA_MMA", "0", 1);
    K3_CHECK_OK(k3_backend_create("cuda", NULL, &g_cuf));
    unsetenv("K3_CUDA_MMA");
    setenv("K3_CUDA_KDA_STATE", "bf16", 1);
    K3_CHECK_OK(k3_backend_create("cuda", NULL, &g_cub));
    unsetenv("K3_CUDA_KDA_STATE");
    if (!g_ref || !g_cpu || !g_cu || !g_cu32 || !g_cuf || !g_cub) return k3_test_done("cuda_ops");
    K3_CHECK(k3_backend_cuda_ops_done() == K3_OP_COUNT, "cuda implements %d of %d ops",
             k3_backend_cuda_ops_done(), K3_OP_COUNT);
    for (size_t i = 0; i < K3_ARRAY_LEN(k_tests); i++) {
        fprintf(stderr, "  op %s ...\n", k_tests[i].name); /* unbuffered: names a crash */
        int before = k3_t_fail;
        double t0 = k3_now_s();
        k_tests[i].fn();
        printf("  op %-14s %s (%.2f s)\n", k_tests[i].name, k3_t_fail == before ? "ok" : "FAILED",
               k3_now_s() - t0);
        fflush(stdout); /* a device fault aborts the process: keep the lines before it */
    }
    test_op_stats_events();
    k3_backend_destroy(g_cu);
    k3_backend_destroy(g_cu32);
    k3_backend_destroy(g_cuf);
    k3_backend_destroy(g_cub);
    k3_backend_destroy(g_cpu);
    k3_backend_destroy(g_ref);
    return k3_test_done("cuda_ops");
}
