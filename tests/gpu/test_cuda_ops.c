/* test_cuda_ops.c — every op of kernels/k3_kernels.h on the cuda backend against kernels/ref
 * (label gpu). Inputs from k3_rng with a printed seed; every device buffer is allocated with a
 * guard band of sentinel NaN-payload floats on each side (checked bit for bit after the op) and
 * every output starts poisoned with NaN; results come back through download only. Tolerances are
 * tests/tolerances.h's: the op bound for fp32 reductions in another order, the KDA bounds for the
 * two KDA forms; copies, gathers and the router's ids must be exact. Also: the determinism rule
 * (a second run is bit-identical; token 0 alone equals token 0 of a batch) and the two errors
 * whose contract names the culprit (a non-finite router score, an embedding id out of range).
 * Without a device it prints one SKIP line and exits 77. The registry comes from K3_OP_LIST:
 * an op without a test_<op> here does not compile. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"
#include "k3_test.h"
#include "tolerances.h"
#include "gpu/k3_gpu_test.h"

#include <stdlib.h>
#include <string.h>

static k3_rng g_rng;
static const uint64_t k_seed = 20261201;
static k3_backend *g_ref, *g_cu;

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
    K3_ASSERT(k3_backend_sync(g_cu) == K3_OK);
    K3_ASSERT(k3_backend_download(g_cu, host, dev, n_bytes) == K3_OK);
}
/* Check every guard band and free every buffer of the case. */
static void dfree_all(const char *what) {
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
    cmp(hget(dO, nv), want, nv, tol, chunked ? "kda_chunked o" : "kda_recurrent o");
    cmp(hget(dS, nS), S, nS, tol, chunked ? "kda_chunked S" : "kda_recurrent S");
    dfree_all("kda");
    free(q), free(k), free(v), free(g), free(beta), free(S), free(want);
}
static void test_kda_recurrent(void) {
    kda_case(false, 1, 4, 128, 128, 0); /* decode */
    kda_case(false, 40, 3, 64, 96, 0);  /* prefill by the recurrence */
}
static void test_kda_chunked(void) {
    kda_case(true, 150, 2, 128, 128, 64); /* two chunks and a ragged tail of 22 */
    kda_case(true, 20, 2, 32, 48, 64);    /* only a tail */
}
static void test_attn_latent(void) {
    const int H = 8, Rkv = 512, W = 576;
    const int64_t ns[2] = {1, 777};
    for (int c = 0; c < 2; c++) {
        int64_t n_ctx = ns[c];
        float *qc = randn((int64_t)H * W, 1.0f), *cache = randn(n_ctx * W, 1.0f);
        float *work = hnan(H * n_ctx), *want = hnan((int64_t)H * Rkv);
        float *dq = dcopy(qc, (int64_t)H * W), *dc = dcopy(cache, n_ctx * W);
        float *dw = dpoison(H * n_ctx), *dy = dpoison((int64_t)H * Rkv);
        const float scale = 1.0f / sqrtf((float)W);
        K3_CHECK_OK(g_ref->ops->attn_latent(g_ref, qc, cache, n_ctx, H, W, Rkv, scale, want, work));
        K3_CHECK_OK(g_cu->ops->attn_latent(g_cu, dq, dc, n_ctx, H, W, Rkv, scale, dy, dw));
        cmp(hget(dy, (int64_t)H * Rkv), want, (int64_t)H * Rkv, K3_TOL_OP_REL_L2, "attn_latent");
        dfree_all("attn_latent");
        free(qc), free(cache), free(work), free(want);
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
    cmp(hget(dy, no), want, no, K3_TOL_OP_REL_L2, "attn_latent_causal");
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
    /* non-finite: token 4's expert 9 is NaN, token 7's expert 2 inf: token 4 is named */
    s[4 * E + 9] = NAN;
    s[7 * E + 2] = INFINITY;
    float *ds = dcopy(s, T * E), *dwork = dpoison(T * E), *dw = dpoison(T * K);
    int32_t *dids = dput(NULL, (size_t)T * K * 4);
    K3_CHECK_ERR(g_cu->ops->moe_topk(g_cu, ds, NULL, T, E, K, G, TG, true, 1.0f, dwork, dids, dw),
                 K3_ERR_INTERNAL, "token 4, expert 9");
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
    K3_CHECK_OK(k3_backend_create("cuda", NULL, &g_cu));
    if (!g_ref || !g_cu) return k3_test_done("cuda_ops");
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
    k3_backend_destroy(g_cu);
    k3_backend_destroy(g_ref);
    return k3_test_done("cuda_ops");
}
