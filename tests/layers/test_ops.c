/* test_ops.c — every op of kernels/k3_kernels.h: ref against float64 (or hand-computed) cases,
 * cpu against ref, and the determinism rule (cpu results bit-identical for any T split and any
 * thread count). The test registry comes from K3_OP_LIST: an op without a test_<op> function
 * here does not compile. Inputs come from k3_rng with a printed seed. */
#include "k3_kernels.h"
#include "k3_test.h"
#include "tolerances.h"

#include "k3_mxfp4.h"

static k3_rng g_rng;
static const uint64_t k_seed = 20240917;

static void fill(float *x, int64_t n, float sd) {
    for (int64_t i = 0; i < n; i++) x[i] = sd * k3_rng_normal(&g_rng);
}
static double rel_l2_d(const float *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += b[i] * b[i];
    }
    return sqrt(num) / (den > 0 ? sqrt(den) : 1e-300);
}
static bool all_finite(const float *a, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(a[i])) return false;
    return true;
}
static bool nondegenerate(const float *a, int64_t n) {
    float lo = a[0], hi = a[0];
    for (int64_t i = 0; i < n; i++) {
        lo = a[i] < lo ? a[i] : lo;
        hi = a[i] > hi ? a[i] : hi;
    }
    return hi - lo > 1e-3f;
}
static float *fa(int64_t n) { /* NaN-poisoned buffer */
    float *p = malloc((size_t)(n ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = NAN;
    return p;
}
static double sigd(double x) {
    return 1.0 / (1.0 + exp(-x));
}

/* A random weight [out, in] of dtype dt (F32 / BF16 / MXFP4). */
typedef struct {
    k3_tensor t;
    void *mem;
    uint8_t *scale;
} wbuf;
static wbuf make_w(k3_dtype dt, int64_t out, int64_t in) {
    wbuf w = {0};
    w.t.dtype = dt;
    w.t.ndim = 2;
    w.t.shape[0] = out;
    w.t.shape[1] = in;
    if (dt == K3_DT_F32) {
        float *p = malloc((size_t)(out * in) * sizeof(float));
        fill(p, out * in, 0.3f);
        w.mem = p;
    } else if (dt == K3_DT_BF16) {
        uint16_t *p = malloc((size_t)(out * in) * 2);
        for (int64_t i = 0; i < out * in; i++) p[i] = k3_f32_to_bf16(0.3f * k3_rng_normal(&g_rng));
        w.mem = p;
    } else {
        uint8_t *p = malloc((size_t)(out * in / 2));
        for (int64_t i = 0; i < out * in / 2; i++) p[i] = (uint8_t)(k3_rng_u64(&g_rng) & 0xff);
        w.scale = malloc((size_t)(out * in / 32));
        for (int64_t i = 0; i < out * in / 32; i++)
            w.scale[i] = (uint8_t)(120 + k3_rng_u64(&g_rng) % 6);
        w.mem = p;
        w.t.scale = w.scale;
    }
    w.t.data = w.mem;
    return w;
}
static void free_w(wbuf *w) {
    free(w->mem);
    free(w->scale);
}

/* ---- matmul -------------------------------------------------------------------------------- */
static void test_matmul(void) {
    const k3_ops *ref = k3_ops_ref(), *cpu = k3_ops_cpu();
    const k3_dtype dts[3] = {K3_DT_F32, K3_DT_BF16, K3_DT_MXFP4};
    const int64_t ins[3] = {77, 200, 96}, outs[3] = {45, 130, 70};
    for (int d = 0; d < 3; d++) {
        int64_t in = ins[d], out = outs[d], T = 9;
        wbuf w = make_w(dts[d], out, in);
        float *x = fa(T * in), *yr = fa(T * out), *yc = fa(T * out), *y1 = fa(T * out);
        double *yd = malloc((size_t)(T * out) * sizeof(double));
        fill(x, T * in, 1.0f);
        for (int64_t t = 0; t < T; t++)
            for (int64_t o = 0; o < out; o++) {
                double s = 0;
                for (int64_t i = 0; i < in; i++)
                    s += (double)x[t * in + i] * k3_tensor_get(&w.t, o, i);
                yd[t * out + o] = s;
            }
        K3_CHECK_OK(ref->matmul(x, T, &w.t, yr));
        k3_kernels_set_threads(2);
        K3_CHECK_OK(cpu->matmul(x, T, &w.t, yc));
        double er = rel_l2_d(yr, yd, T * out), ec = rel_l2_d(yc, yd, T * out);
        K3_CHECK(er < K3_TOL_OP_REL_L2 && ec < K3_TOL_OP_REL_L2, "matmul %s: ref %.3g cpu %.3g",
                 k3_dtype_name(dts[d]), er, ec);
        K3_CHECK(nondegenerate(yr, T * out), "matmul output degenerate");
        /* determinism: one token at a time and with 1 thread, bit-identical */
        k3_kernels_set_threads(1);
        for (int64_t t = 0; t < T; t++) K3_CHECK_OK(cpu->matmul(x + t * in, 1, &w.t, y1 + t * out));
        K3_CHECK(memcmp(yc, y1, (size_t)(T * out) * sizeof(float)) == 0,
                 "matmul %s: cpu result depends on T / threads", k3_dtype_name(dts[d]));
        /* a row view computes the same rows */
        k3_tensor rv;
        K3_CHECK_OK(k3_tensor_rows(&w.t, 3, 5, &rv));
        K3_CHECK_OK(cpu->matmul(x, 1, &rv, y1));
        K3_CHECK(memcmp(y1, yc + 3, 5 * sizeof(float)) == 0, "row view differs");
        free(x), free(yr), free(yc), free(y1), free(yd);
        free_w(&w);
    }
    k3_kernels_set_threads(2);
    /* bad dtype is an error, not a crash */
    k3_tensor bad = {.dtype = K3_DT_I32, .ndim = 2, .shape = {2, 2}};
    float xx[4] = {0}, yy[4];
    K3_CHECK_ERR(cpu->matmul(xx, 1, &bad, yy), K3_ERR_SHAPE, "unsupported");
    /* MXFP4 hand case: codes 0x21 -> elements (1: 0.5, 2: 1.0), scale 128 -> ×2 */
    uint8_t packed[16] = {0x21}, sc[1] = {128};
    k3_tensor m = {.dtype = K3_DT_MXFP4, .ndim = 2, .shape = {1, 32}, .data = packed, .scale = sc};
    float xm[32] = {0}, ym[1];
    xm[0] = 3.0f, xm[1] = 5.0f;
    K3_CHECK_OK(cpu->matmul(xm, 1, &m, ym));
    K3_CHECK(ym[0] == 3.0f * 1.0f + 5.0f * 2.0f, "mxfp4 hand case: %g", ym[0]);
}

static void test_matmul_tn(void) {
    const k3_ops *ref = k3_ops_ref(), *cpu = k3_ops_cpu();
    for (int d = 0; d < 2; d++) {
        int64_t out = 50, in = 70, T = 5;
        wbuf w = make_w(d ? K3_DT_BF16 : K3_DT_F32, out, in);
        float *x = fa(T * out), *yr = fa(T * in), *yc = fa(T * in), *y1 = fa(T * in);
        double *yd = malloc((size_t)(T * in) * sizeof(double));
        fill(x, T * out, 1.0f);
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < in; i++) {
                double s = 0;
                for (int64_t o = 0; o < out; o++)
                    s += (double)x[t * out + o] * k3_tensor_get(&w.t, o, i);
                yd[t * in + i] = s;
            }
        K3_CHECK_OK(ref->matmul_tn(x, T, &w.t, yr));
        K3_CHECK_OK(cpu->matmul_tn(x, T, &w.t, yc));
        for (int64_t t = 0; t < T; t++)
            K3_CHECK_OK(cpu->matmul_tn(x + t * out, 1, &w.t, y1 + t * in));
        K3_CHECK(rel_l2_d(yr, yd, T * in) < K3_TOL_OP_REL_L2 &&
                     rel_l2_d(yc, yd, T * in) < K3_TOL_OP_REL_L2,
                 "matmul_tn");
        K3_CHECK(memcmp(yc, y1, (size_t)(T * in) * sizeof(float)) == 0, "matmul_tn depends on T");
        free(x), free(yr), free(yc), free(y1), free(yd);
        free_w(&w);
    }
}

/* ---- rows / elementwise -------------------------------------------------------------------- */
static void test_rmsnorm(void) {
    int64_t T = 40, n = 300; /* T·n above the cpu's parallel threshold */
    float *x = fa(T * n), *w = fa(n), *yr = fa(T * n), *yc = fa(T * n);
    double *yd = malloc((size_t)(T * n) * sizeof(double));
    fill(x, T * n, 2.0f);
    fill(w, n, 1.0f);
    for (int64_t t = 0; t < T; t++) {
        double ss = 0;
        for (int64_t i = 0; i < n; i++) ss += (double)x[t * n + i] * x[t * n + i];
        double r = 1.0 / sqrt(ss / n + 1e-5);
        for (int64_t i = 0; i < n; i++) yd[t * n + i] = w[i] * x[t * n + i] * r;
    }
    k3_ops_ref()->rmsnorm(x, w, T, n, 1e-5f, yr);
    k3_ops_cpu()->rmsnorm(x, w, T, n, 1e-5f, yc);
    K3_CHECK(rel_l2_d(yr, yd, T * n) < K3_TOL_OP_REL_L2, "rmsnorm ref");
    K3_CHECK(memcmp(yr, yc, (size_t)(T * n) * sizeof(float)) == 0, "rmsnorm cpu != ref");
    /* hand case: x = (3, 4), w = 1, eps 0: rms = sqrt(12.5) */
    float hx[2] = {3, 4}, hy[2];
    k3_ops_cpu()->rmsnorm(hx, NULL, 1, 2, 0.0f, hy);
    K3_CHECK(fabsf(hy[0] - 3.0f / sqrtf(12.5f)) < 1e-6f &&
                 fabsf(hy[1] - 4.0f / sqrtf(12.5f)) < 1e-6f,
             "rmsnorm hand");
    free(x), free(w), free(yr), free(yc), free(yd);
}

static void test_l2norm(void) {
    float hx[4] = {3, 4, 0, 0}, hy[4];
    k3_ops_cpu()->l2norm(hx, 2, 2, 1e-6f, hy);
    K3_CHECK(fabsf(hy[0] - 3.0f / sqrtf(25.000001f)) < 1e-7f && fabsf(hy[1] - 0.8f) < 1e-6f,
             "l2norm hand");
    K3_CHECK(hy[2] == 0.0f && hy[3] == 0.0f, "l2norm of zeros must be 0 (eps), got %g", hy[2]);
    int64_t T = 64, n = 128;
    float *x = fa(T * n), *yr = fa(T * n), *yc = fa(T * n);
    fill(x, T * n, 1.0f);
    k3_ops_ref()->l2norm(x, T, n, 1e-6f, yr);
    k3_ops_cpu()->l2norm(x, T, n, 1e-6f, yc);
    K3_CHECK(memcmp(yr, yc, (size_t)(T * n) * sizeof(float)) == 0, "l2norm cpu != ref");
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)yr[i] * yr[i];
    K3_CHECK(fabs(ss - 1.0) < 1e-5, "l2norm row norm %g", ss);
    free(x), free(yr), free(yc);
}

static void elementwise_case(const char *name, int which) {
    const int64_t n = 257;
    float *g = fa(n), *u = fa(n), *yr = fa(n), *yc = fa(n);
    double *yd = malloc(n * sizeof(double));
    fill(g, n, 4.0f);
    fill(u, n, 30.0f);
    for (int64_t i = 0; i < n; i++) {
        double gd = g[i], ud = u[i];
        switch (which) {
        case 0:
            yd[i] = gd * sigd(gd);
            break;
        case 1:
            yd[i] = sigd(gd);
            break;
        case 2:
            yd[i] = 4.0 * tanh(gd / 4.0) * sigd(gd) * 25.0 * tanh(ud / 25.0);
            break;
        case 3:
            yd[i] = gd * sigd(gd) * ud;
            break;
        }
    }
    const k3_ops *ops[2] = {k3_ops_ref(), k3_ops_cpu()};
    float *ys[2] = {yr, yc};
    for (int b = 0; b < 2; b++) {
        switch (which) {
        case 0:
            ops[b]->silu(g, n, ys[b]);
            break;
        case 1:
            ops[b]->sigmoid(g, n, ys[b]);
            break;
        case 2:
            ops[b]->situ(g, u, n, 4.0f, 25.0f, ys[b]);
            break;
        case 3:
            ops[b]->swiglu(g, u, n, ys[b]);
            break;
        }
        K3_CHECK(rel_l2_d(ys[b], yd, n) < K3_TOL_OP_REL_L2, "%s (%s) vs float64: %g", name,
                 ops[b]->backend, rel_l2_d(ys[b], yd, n));
    }
    free(g), free(u), free(yr), free(yc), free(yd);
}
static void test_silu(void) {
    elementwise_case("silu", 0);
    float x = 1.0f, y;
    k3_ops_cpu()->silu(&x, 1, &y);
    K3_CHECK(fabsf(y - 0.7310585786f) < 1e-6f, "silu(1) = %g", y);
}
static void test_sigmoid(void) {
    elementwise_case("sigmoid", 1);
    float x[2] = {0.0f, -100.0f}, y[2];
    k3_ops_cpu()->sigmoid(x, 2, y);
    K3_CHECK(y[0] == 0.5f && y[1] >= 0.0f && y[1] < 1e-40f, "sigmoid hand");
}
static void test_situ(void) {
    elementwise_case("situ", 2);
    /* hand case (K3-MODEL.md §4.1): g = 1, u = 2 -> 4 tanh(1/4) σ(1) · 25 tanh(2/25) */
    float g = 1.0f, u = 2.0f, y, y2;
    k3_ops_cpu()->situ(&g, &u, 1, 4.0f, 25.0f, &y);
    double want = 4.0 * tanh(0.25) * sigd(1.0) * 25.0 * tanh(0.08);
    K3_CHECK(fabs(y - want) < 1e-6, "situ(1,2) = %.9g want %.9g", y, want);
    /* lin_beta <= 0: the up branch is not capped */
    k3_ops_cpu()->situ(&g, &u, 1, 4.0f, 0.0f, &y2);
    K3_CHECK(fabs(y2 - 4.0 * tanh(0.25) * sigd(1.0) * 2.0) < 1e-6, "situ uncapped");
}
static void test_swiglu(void) {
    elementwise_case("swiglu", 3);
}

static void test_softmax(void) {
    float x[6] = {1, 2, 3, 1000, 1000, -1000}, y[6];
    k3_ops_cpu()->softmax(x, 2, 3, y);
    double z = exp(-2.0) + exp(-1.0) + 1.0;
    K3_CHECK(fabs(y[0] - exp(-2.0) / z) < 1e-7 && fabs(y[2] - 1.0 / z) < 1e-7, "softmax hand");
    K3_CHECK(y[3] == 0.5f && y[4] == 0.5f && y[5] == 0.0f, "softmax large values (max-subtracted)");
    float r[6];
    k3_ops_ref()->softmax(x, 2, 3, r);
    K3_CHECK(memcmp(r, y, sizeof(r)) == 0, "softmax cpu != ref");
}

/* ---- AttnRes -------------------------------------------------------------------------------- */
static void test_attnres_mix(void) {
    const int64_t T = 3, D = 64;
    for (int nb = 0; nb <= 4; nb++) {
        float *bank = fa((nb ? nb : 1) * T * D), *p = fa(T * D), *w = fa(D), *yr = fa(T * D),
              *yc = fa(T * D);
        double *yd = malloc((size_t)(T * D) * sizeof(double));
        fill(bank, nb * T * D, 1.0f);
        fill(p, T * D, 3.0f);
        fill(w, D, 0.5f);
        for (int64_t t = 0; t < T; t++) {
            double s[8], m = -1e300, z = 0;
            for (int i = 0; i <= nb; i++) {
                const float *v = i < nb ? bank + (i * T + t) * D : p + t * D;
                double ss = 0, dot = 0;
                for (int64_t d = 0; d < D; d++) ss += (double)v[d] * v[d];
                double r = 1.0 / sqrt(ss / D + 1e-5);
                for (int64_t d = 0; d < D; d++) dot += v[d] * r * w[d];
                s[i] = dot;
                m = dot > m ? dot : m;
            }
            for (int i = 0; i <= nb; i++) z += (s[i] = exp(s[i] - m));
            for (int64_t d = 0; d < D; d++) {
                double acc = 0;
                for (int i = 0; i <= nb; i++)
                    acc += s[i] / z * (i < nb ? bank[(i * T + t) * D + d] : p[t * D + d]);
                yd[t * D + d] = acc;
            }
        }
        k3_ops_ref()->attnres_mix(bank, nb, p, w, T, D, 1e-5f, yr);
        k3_ops_cpu()->attnres_mix(bank, nb, p, w, T, D, 1e-5f, yc);
        K3_CHECK(rel_l2_d(yr, yd, T * D) < K3_TOL_OP_REL_L2, "attnres_mix n_bank=%d: %g", nb,
                 rel_l2_d(yr, yd, T * D));
        K3_CHECK(memcmp(yr, yc, (size_t)(T * D) * sizeof(float)) == 0, "attnres cpu != ref");
        if (nb == 0)
            K3_CHECK(memcmp(yr, p, (size_t)(T * D) * sizeof(float)) == 0,
                     "mix of one source = itself");
        /* in place (out aliases p) */
        k3_ops_cpu()->attnres_mix(bank, nb, p, w, T, D, 1e-5f, p);
        K3_CHECK(memcmp(yr, p, (size_t)(T * D) * sizeof(float)) == 0, "attnres in place");
        free(bank), free(p), free(w), free(yr), free(yc), free(yd);
    }
}

/* ---- KDA ------------------------------------------------------------------------------------ */
/* Inputs like the layer makes them: q, k L2-normalised per head, g in (LB, 0), beta in (0,1). */
typedef struct {
    int64_t n;
    int H, dk, dv;
    float *q, *k, *v, *g, *beta;
} kda_in;
static kda_in make_kda(int64_t n, int H, int dk, int dv, float g_lo, float g_hi) {
    kda_in in = {
        n, H, dk, dv, fa(n * H * dk), fa(n * H * dk), fa(n * H * dv), fa(n * H * dk), fa(n * H)};
    fill(in.q, n * H * dk, 1.0f);
    fill(in.k, n * H * dk, 1.0f);
    fill(in.v, n * H * dv, 1.0f);
    k3_ops_ref()->l2norm(in.q, n * H, dk, 1e-6f, in.q);
    k3_ops_ref()->l2norm(in.k, n * H, dk, 1e-6f, in.k);
    for (int64_t i = 0; i < n * H * dk; i++)
        in.g[i] = g_lo + (g_hi - g_lo) * (float)k3_rng_uniform(&g_rng);
    for (int64_t i = 0; i < n * H; i++) in.beta[i] = (float)k3_rng_uniform(&g_rng);
    return in;
}
static void free_kda(kda_in *in) {
    free(in->q), free(in->k), free(in->v), free(in->g), free(in->beta);
}

/* float64 recurrence in the transposed bookkeeping of §2.2 (M = Sᵀ [dv, dk]), output scaled
 * after the read — written independently of ref.c's S [dk, dv] loop order. */
static void kda_f64(const kda_in *in, float scale, double *M /* [H, dv, dk] */, double *o) {
    int H = in->H, dk = in->dk, dv = in->dv;
    for (int64_t t = 0; t < in->n; t++)
        for (int h = 0; h < H; h++) {
            const float *q = in->q + (t * H + h) * dk, *k = in->k + (t * H + h) * dk,
                        *g = in->g + (t * H + h) * dk, *v = in->v + (t * H + h) * dv;
            double b = in->beta[t * H + h];
            for (int j = 0; j < dv; j++) {
                double *Mj = M + ((int64_t)h * dv + j) * dk, dot = 0, oq = 0;
                for (int i = 0; i < dk; i++) {
                    Mj[i] *= exp((double)g[i]);
                    dot += Mj[i] * k[i];
                }
                double delta = b * (v[j] - dot);
                for (int i = 0; i < dk; i++) {
                    Mj[i] += delta * k[i];
                    oq += Mj[i] * q[i];
                }
                o[(t * H + h) * dv + j] = scale * oq;
            }
        }
}

static void test_kda_recurrent(void) {
    const int H = 3, dk = 16, dv = 8;
    const int64_t n = 40;
    kda_in in = make_kda(n, H, dk, dv, -5.0f, 0.0f);
    float scale = 1.0f / sqrtf((float)dk);
    float *S = calloc((size_t)H * dk * dv, sizeof(float)), *o = fa(n * H * dv),
          *oc = fa(n * H * dv);
    float *Sc = calloc((size_t)H * dk * dv, sizeof(float));
    double *M = calloc((size_t)H * dk * dv, sizeof(double)),
           *od = malloc((size_t)(n * H * dv) * sizeof(double));
    kda_f64(&in, scale, M, od);
    k3_ops_ref()->kda_recurrent(in.q, in.k, in.v, in.g, in.beta, n, H, dk, dv, scale, S, o);
    K3_CHECK(rel_l2_d(o, od, n * H * dv) < K3_TOL_KDA_REL_L2, "kda_recurrent ref vs f64: %g",
             rel_l2_d(o, od, n * H * dv));
    K3_CHECK(nondegenerate(o, n * H * dv), "kda output degenerate");
    /* cpu: in two pieces (state carried), must equal ref bitwise (same per-head code) */
    k3_ops_cpu()->kda_recurrent(in.q, in.k, in.v, in.g, in.beta, 17, H, dk, dv, scale, Sc, oc);
    int64_t o17 = 17 * H, d17 = 17 * (int64_t)H * dk, v17 = 17 * (int64_t)H * dv;
    k3_ops_cpu()->kda_recurrent(in.q + d17, in.k + d17, in.v + v17, in.g + d17, in.beta + o17,
                                n - 17, H, dk, dv, scale, Sc, oc + v17);
    K3_CHECK(memcmp(o, oc, (size_t)(n * H * dv) * sizeof(float)) == 0, "kda cpu pieces != ref");
    /* hand case: dk = dv = 1, S0 = 0: S1 = β k v, o1 = scale·S1·q */
    float q1 = 1, k1 = 1, v1 = 2, g1 = -1, b1 = 0.5f, S1 = 0, o1;
    k3_ops_cpu()->kda_recurrent(&q1, &k1, &v1, &g1, &b1, 1, 1, 1, 1, 0.5f, &S1, &o1);
    K3_CHECK(S1 == 1.0f && o1 == 0.5f, "kda hand: S=%g o=%g", S1, o1);
    free_kda(&in);
    free(S), free(o), free(oc), free(Sc), free(M), free(od);
}

static void test_kda_chunked(void) {
    /* gates pressed against the lower bound (g in (-5, -4.5)) over 256 steps, chunk 16 and 64
       (|Γ| up to 320 inside a 64-chunk: only the difference form stays finite) */
    const int H = 2, dk = 32, dv = 16;
    const int64_t n = 256 + 7; /* ragged tail */
    const float g_ranges[2][2] = {{-5.0f, -4.5f}, {-0.2f, 0.0f}};
    for (int gr = 0; gr < 2; gr++) {
        kda_in in = make_kda(n, H, dk, dv, g_ranges[gr][0], g_ranges[gr][1]);
        float scale = 1.0f / sqrtf((float)dk);
        float *S0 = calloc((size_t)H * dk * dv, sizeof(float)), *o0 = fa(n * H * dv);
        k3_ops_ref()->kda_recurrent(in.q, in.k, in.v, in.g, in.beta, n, H, dk, dv, scale, S0, o0);
        const int Cs[3] = {16, 64, 5};
        for (int ci = 0; ci < 3; ci++) {
            int C = Cs[ci];
            float *work = fa((int64_t)H * (int64_t)k3_kda_chunk_work_floats(C, dk, dv));
            const k3_ops *ops[2] = {k3_ops_ref(), k3_ops_cpu()};
            for (int bk = 0; bk < 2; bk++) {
                float *S = calloc((size_t)H * dk * dv, sizeof(float)), *o = fa(n * H * dv);
                ops[bk]->kda_chunked(in.q, in.k, in.v, in.g, in.beta, n, H, dk, dv, scale, S, o, C,
                                     work);
                K3_CHECK(all_finite(o, n * H * dv) && all_finite(S, (int64_t)H * dk * dv),
                         "kda_chunked C=%d: NaN/inf", C);
                double eo = k3_rel_l2(o, o0, (size_t)(n * H * dv)),
                       es = k3_rel_l2(S, S0, (size_t)H * dk * dv);
                K3_CHECK(eo < K3_TOL_KDA_CHUNK_REL_L2 && es < K3_TOL_KDA_CHUNK_REL_L2,
                         "kda_chunked (%s) C=%d g~%g: out %.3g state %.3g vs recurrent",
                         ops[bk]->backend, C, g_ranges[gr][0], eo, es);
                free(S), free(o);
            }
            free(work);
        }
        free_kda(&in);
        free(S0), free(o0);
    }
}

/* ---- latent attention ---------------------------------------------------------------------- */
static void test_attn_latent(void) {
    const int H = 4, Rkv = 24, dr = 8, W = Rkv + dr;
    const int64_t n_ctx = 300;
    float *qc = fa((int64_t)H * W), *cache = fa(n_ctx * W), * or = fa((int64_t)H * Rkv),
          *oc = fa((int64_t)H * Rkv);
    float *work = fa((int64_t)H * n_ctx);
    double *od = malloc((size_t)H * Rkv * sizeof(double));
    fill(qc, (int64_t)H * W, 1.0f);
    fill(cache, n_ctx * W, 1.0f);
    float scale = 0.3f;
    for (int h = 0; h < H; h++) {
        double *s = malloc((size_t)n_ctx * sizeof(double)), m = -1e300, z = 0;
        for (int64_t j = 0; j < n_ctx; j++) {
            double d = 0;
            for (int i = 0; i < W; i++) d += (double)qc[h * W + i] * cache[j * W + i];
            s[j] = d * scale;
            m = s[j] > m ? s[j] : m;
        }
        for (int64_t j = 0; j < n_ctx; j++) z += (s[j] = exp(s[j] - m));
        for (int i = 0; i < Rkv; i++) {
            double acc = 0;
            for (int64_t j = 0; j < n_ctx; j++) acc += s[j] / z * cache[j * W + i];
            od[h * Rkv + i] = acc;
        }
        free(s);
    }
    k3_ops_ref()->attn_latent(qc, cache, n_ctx, H, W, Rkv, scale, or, work);
    k3_ops_cpu()->attn_latent(qc, cache, n_ctx, H, W, Rkv, scale, oc, work);
    K3_CHECK(rel_l2_d(or, od, (int64_t)H * Rkv) < K3_TOL_OP_REL_L2, "attn_latent vs f64 %g",
             rel_l2_d(or, od, (int64_t)H * Rkv));
    K3_CHECK(memcmp(or, oc, (size_t)H * Rkv * sizeof(float)) == 0, "attn_latent cpu != ref");
    /* one cached token: output = its latent */
    k3_ops_cpu()->attn_latent(qc, cache, 1, H, W, Rkv, scale, oc, work);
    K3_CHECK(memcmp(oc, cache, (size_t)Rkv * sizeof(float)) == 0, "attn over one token");
    free(qc), free(cache), free(or), free(oc), free(work), free(od);
}

/* The registry: one test per op of K3_OP_LIST (a missing test_<op> is a compile error). */
#define K3_OP_TEST(name, ret, args) {#name, test_##name},
static const struct {
    const char *name;
    void (*fn)(void);
} k_tests[] = {K3_OP_LIST(K3_OP_TEST)};
#undef K3_OP_TEST
_Static_assert(sizeof(k_tests) / sizeof(k_tests[0]) == K3_OP_COUNT, "one test per op");

int main(void) {
    printf("test_ops seed %llu\n", (unsigned long long)k_seed);
    k3_rng_seed(&g_rng, k_seed);
    K3_CHECK(strcmp(k3_ops_default()->backend, "cpu") == 0, "default backend");
    K3_CHECK(k3_ops_by_name("ref") == k3_ops_ref() && k3_ops_by_name("x") == NULL, "by_name");
    for (size_t i = 0; i < K3_ARRAY_LEN(k_tests); i++) {
        int before = k3_t_fail;
        k_tests[i].fn();
        printf("  op %-14s %s\n", k_tests[i].name, k3_t_fail == before ? "ok" : "FAILED");
    }
    return k3_test_done("ops");
}
