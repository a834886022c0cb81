/* test_ops.c — every op of kernels/k3_kernels.h, on every host backend:
 *   - ref against float64 (or hand-computed / exactly known) values;
 *   - cpu against ref (bit-identical where cpu runs the reference code, else both vs float64);
 *     the cpu backend runs the kernel table of one ISA (kernels/cpu/cpu_kern.h): the default
 *     one, or K3_ISA=avx512|avx2|scalar (ctest runs each ISA this CPU has; exit 77 = skip);
 *   - the determinism rule: cpu results are bit-identical for any T split (one token at a time,
 *     odd splits) and any thread count (cpu backends with 1, 2 and 4 threads);
 *   - the guard backend: every case runs once more on buffers from k3_backend_alloc +
 *     upload/download (PROT_NONE outside the guard's own ops, so the test never touches them)
 *     and must equal cpu bit for bit.
 * The test registry comes from K3_OP_LIST: an op without a test_<op> function here does not
 * compile. Inputs come from k3_rng with a printed seed.
 * usage: test_ops [OP...]   the named ops only (ctest's ops_gemv_*: the ops that read the decode
 * row order); none: every op. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h" /* k3_cpu_isa_supported */
#include "k3_test.h"
#include "tolerances.h"

#include <stdlib.h>
#include <string.h>

#include "k3_mxfp4.h"

static k3_rng g_rng;
static const uint64_t k_seed = 20240917;

#define FB(n) ((size_t)(n) * sizeof(float))

/* ---- the backends every case runs on ------------------------------------------------------- */
enum { B_REF, B_CPU1, B_CPU2, B_CPU4, B_GUARD, B_COUNT };
static k3_backend *g_be[B_COUNT];
static const char *const k_be_kind[B_COUNT] = {"ref", "cpu", "cpu", "cpu", "guard"};
static const char *const k_be_label[B_COUNT] = {"ref", "cpu/1t", "cpu/2t", "cpu/4t", "guard/3t"};
static const int k_be_threads[B_COUNT] = {1, 1, 2, 4, 3};
#define BE(b) g_be[b]

/* ---- host helpers -----------------------------------------------------------------------------
 */
static void fill_randn(float *x, int64_t n, float sd) {
    for (int64_t i = 0; i < n; i++) x[i] = sd * k3_rng_normal(&g_rng);
}
static int64_t rand_below(int64_t n) {
    return (int64_t)(k3_rng_u64(&g_rng) % (uint64_t)n);
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
    float *p = malloc(FB(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) p[i] = NAN;
    return p;
}
static float *fcopy(const float *src, int64_t n) {
    float *p = fa(n);
    if (n) memcpy(p, src, FB(n));
    return p;
}
static double *da(int64_t n) {
    return malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
}
static double sigd(double x) {
    return 1.0 / (1.0 + exp(-x));
}
static bool same_f(const float *a, const float *b, int64_t n) {
    return n == 0 || memcmp(a, b, FB(n)) == 0;
}
/* Every backend's copy of one output: ys[b]. */
static void ys_alloc(float **ys, int64_t n) {
    for (int b = 0; b < B_COUNT; b++) ys[b] = fa(n);
}
static void ys_free(float **ys) {
    for (int b = 0; b < B_COUNT; b++) free(ys[b]);
}
/* cpu with 2 and 4 threads and guard must equal cpu with 1 thread bit for bit. */
static void check_family(float *const *ys, int64_t n, const char *what) {
    for (int b = B_CPU2; b < B_COUNT; b++)
        K3_CHECK(same_f(ys[b], ys[B_CPU1], n), "%s: %s differs from cpu/1t (threads / guard)", what,
                 k_be_label[b]);
}
static void check_family_i32(int32_t *const *ys, int64_t n, const char *what) {
    for (int b = B_CPU2; b < B_COUNT; b++)
        K3_CHECK(memcmp(ys[b], ys[B_CPU1], (size_t)n * sizeof(int32_t)) == 0,
                 "%s: %s differs from cpu/1t (threads / guard)", what, k_be_label[b]);
}
/* cpu runs the reference code for this op: bit-identical to ref. */
static void check_cpu_is_ref(float *const *ys, int64_t n, const char *what) {
    K3_CHECK(same_f(ys[B_CPU1], ys[B_REF], n), "%s: cpu != ref", what);
}

/* ---- running an op on any backend ------------------------------------------------------------ */
/* Host-visible backends (ref, cpu) get the host pointers themselves. The others (guard) get
 * copies: every buffer argument is allocated with k3_backend_alloc and uploaded from its host
 * array before the op, and the op's outputs are downloaded back into the host arrays after it —
 * so a test reads every backend's results in host arrays and never touches guard memory. Host
 * metadata (idx, seg) is passed through, as the contract says. Aliased arguments (in-place ops)
 * map to one buffer. */
#define M_MAX 32
typedef struct {
    k3_backend *be;
    int n;
    void *dev[M_MAX];
    void *host[M_MAX];
    size_t bytes[M_MAX];
    bool out[M_MAX];
} mshl;

static void *m_buf(mshl *m, const void *host, size_t bytes, bool out) {
    if (!host) return NULL;
    if (k3_backend_host_visible(m->be)) return (void *)host;
    for (int i = 0; i < m->n; i++)
        if (m->host[i] == host) {
            K3_ASSERT(m->bytes[i] == bytes);
            m->out[i] = m->out[i] || out;
            return m->dev[i];
        }
    K3_ASSERT(m->n < M_MAX);
    void *d = NULL;
    K3_ASSERT(k3_backend_alloc(m->be, bytes, "test_ops argument", &d) == K3_OK);
    K3_ASSERT(k3_backend_upload(m->be, d, host, bytes) == K3_OK);
    m->dev[m->n] = d;
    m->host[m->n] = (void *)host;
    m->bytes[m->n] = bytes;
    m->out[m->n] = out;
    m->n++;
    return d;
}
static k3_tensor m_tensor(mshl *m, const k3_tensor *t) {
    k3_tensor d = *t;
    if (k3_backend_host_visible(m->be)) return d;
    int64_t n = k3_tensor_n_elems(t);
    size_t bytes = t->dtype == K3_DT_MXFP4 ? (size_t)n / 2 : (size_t)n * k3_dtype_size(t->dtype);
    d.data = m_buf(m, t->data, bytes, false);
    d.scale = t->scale ? m_buf(m, t->scale, (size_t)n / 32, false) : NULL;
    d.mem = m->be->mem;
    return d;
}
static k3_status m_done(mshl *m, k3_status st) {
    for (int i = 0; i < m->n; i++) {
        if (m->out[i])
            K3_ASSERT(k3_backend_download(m->be, m->host[i], m->dev[i], m->bytes[i]) == K3_OK);
        k3_backend_free(m->be, m->dev[i]);
    }
    return st;
}
static int64_t max_idx(const int64_t *idx, int64_t n) {
    int64_t m = -1;
    for (int64_t j = 0; j < n; j++) m = idx[j] > m ? idx[j] : m;
    return m;
}

static k3_status run_matmul(k3_backend *be, const float *x, int64_t T, const k3_tensor *W,
                            float *y) {
    mshl m = {.be = be};
    k3_tensor w = m_tensor(&m, W);
    const float *dx = m_buf(&m, x, FB(T * W->shape[1]), false);
    float *dy = m_buf(&m, y, FB(T * W->shape[0]), true);
    return m_done(&m, be->ops->matmul(be, dx, T, &w, dy));
}
static k3_status run_matmul_tn(k3_backend *be, const float *x, int64_t T, const k3_tensor *W,
                               float *y) {
    mshl m = {.be = be};
    k3_tensor w = m_tensor(&m, W);
    const float *dx = m_buf(&m, x, FB(T * W->shape[0]), false);
    float *dy = m_buf(&m, y, FB(T * W->shape[1]), true);
    return m_done(&m, be->ops->matmul_tn(be, dx, T, &w, dy));
}
static k3_status run_rmsnorm(k3_backend *be, const float *x, const float *w, int64_t T, int64_t n,
                             float eps, float *y) {
    mshl m = {.be = be};
    float *dy = m_buf(&m, y, FB(T * n), true);
    const float *dx = m_buf(&m, x, FB(T * n), false), *dw = m_buf(&m, w, FB(n), false);
    return m_done(&m, be->ops->rmsnorm(be, dx, dw, T, n, eps, dy));
}
static k3_status run_l2norm(k3_backend *be, const float *x, int64_t T, int64_t n, float eps,
                            float *y) {
    mshl m = {.be = be};
    float *dy = m_buf(&m, y, FB(T * n), true);
    const float *dx = m_buf(&m, x, FB(T * n), false);
    return m_done(&m, be->ops->l2norm(be, dx, T, n, eps, dy));
}
static k3_status run_silu(k3_backend *be, const float *x, int64_t n, float *y) {
    mshl m = {.be = be};
    float *dy = m_buf(&m, y, FB(n), true);
    const float *dx = m_buf(&m, x, FB(n), false);
    return m_done(&m, be->ops->silu(be, dx, n, dy));
}
static k3_status run_sigmoid(k3_backend *be, const float *x, int64_t n, float *y) {
    mshl m = {.be = be};
    float *dy = m_buf(&m, y, FB(n), true);
    const float *dx = m_buf(&m, x, FB(n), false);
    return m_done(&m, be->ops->sigmoid(be, dx, n, dy));
}
static k3_status run_situ(k3_backend *be, const float *g, const float *u, int64_t n, float beta,
                          float lin_beta, float *y) {
    mshl m = {.be = be};
    float *dy = m_buf(&m, y, FB(n), true);
    const float *dg = m_buf(&m, g, FB(n), false), *du = m_buf(&m, u, FB(n), false);
    return m_done(&m, be->ops->situ(be, dg, du, n, beta, lin_beta, dy));
}
static k3_status run_swiglu(k3_backend *be, const float *g, const float *u, int64_t n, float *y) {
    mshl m = {.be = be};
    float *dy = m_buf(&m, y, FB(n), true);
    const float *dg = m_buf(&m, g, FB(n), false), *du = m_buf(&m, u, FB(n), false);
    return m_done(&m, be->ops->swiglu(be, dg, du, n, dy));
}
static k3_status run_softmax(k3_backend *be, const float *x, int64_t T, int64_t n, float *y) {
    mshl m = {.be = be};
    float *dy = m_buf(&m, y, FB(T * n), true);
    const float *dx = m_buf(&m, x, FB(T * n), false);
    return m_done(&m, be->ops->softmax(be, dx, T, n, dy));
}
static k3_status run_add(k3_backend *be, const float *a, const float *b, int64_t n, float *y) {
    mshl m = {.be = be};
    float *dy = m_buf(&m, y, FB(n), true);
    const float *d_a = m_buf(&m, a, FB(n), false), *d_b = m_buf(&m, b, FB(n), false);
    return m_done(&m, be->ops->add(be, d_a, d_b, n, dy));
}
static k3_status run_mul(k3_backend *be, const float *a, const float *b, int64_t n, float *y) {
    mshl m = {.be = be};
    float *dy = m_buf(&m, y, FB(n), true);
    const float *d_a = m_buf(&m, a, FB(n), false), *d_b = m_buf(&m, b, FB(n), false);
    return m_done(&m, be->ops->mul(be, d_a, d_b, n, dy));
}
static k3_status run_fill(k3_backend *be, float *y, int64_t n, float v) {
    mshl m = {.be = be};
    float *dy = m_buf(&m, y, FB(n), true);
    return m_done(&m, be->ops->fill(be, dy, n, v));
}
static int64_t span2d(int64_t rows, int64_t stride, int64_t cols) {
    return rows > 0 && cols > 0 ? (rows - 1) * stride + cols : 0;
}
static k3_status run_copy2d(k3_backend *be, float *dst, int64_t dst_stride, const float *src,
                            int64_t src_stride, int64_t rows, int64_t cols) {
    mshl m = {.be = be};
    float *dd = m_buf(&m, dst, FB(span2d(rows, dst_stride, cols)), true);
    const float *ds = m_buf(&m, src, FB(span2d(rows, src_stride, cols)), false);
    return m_done(&m, be->ops->copy2d(be, dd, dst_stride, ds, src_stride, rows, cols));
}
static k3_status run_to_f32(k3_backend *be, const k3_tensor *t, int64_t n, float *dst) {
    mshl m = {.be = be};
    k3_tensor dt = m_tensor(&m, t);
    float *dd = m_buf(&m, dst, FB(n), true);
    return m_done(&m, be->ops->to_f32(be, &dt, n, dd));
}
static k3_status run_embed_rows(k3_backend *be, const k3_tensor *W, const int32_t *ids, int64_t T,
                                float *out) {
    mshl m = {.be = be};
    k3_tensor w = m_tensor(&m, W);
    const int32_t *di = m_buf(&m, ids, (size_t)T * sizeof(int32_t), false);
    float *dout = m_buf(&m, out, FB(T * W->shape[1]), true);
    return m_done(&m, be->ops->embed_rows(be, &w, di, T, dout));
}
static k3_status run_short_conv(k3_backend *be, const float *in, int64_t n, int64_t P, int K,
                                const float *w, float *state, float *out) {
    mshl m = {.be = be};
    const float *din = m_buf(&m, in, FB(n * P), false), *dw = m_buf(&m, w, FB(P * K), false);
    float *ds = m_buf(&m, state, FB((K - 1) * P), true), *dout = m_buf(&m, out, FB(n * P), true);
    return m_done(&m, be->ops->short_conv(be, din, n, P, K, dw, ds, dout));
}
static k3_status run_kda_gate(k3_backend *be, float *r, const float *dt_bias, const float *a_log,
                              int64_t T, int H, int dk, bool has_lb, float lb) {
    mshl m = {.be = be};
    const int64_t P = (int64_t)H * dk;
    float *dr = m_buf(&m, r, FB(T * P), true);
    const float *db = m_buf(&m, dt_bias, FB(P), false), *dal = m_buf(&m, a_log, FB(H), false);
    return m_done(&m, be->ops->kda_gate(be, dr, db, dal, T, H, dk, has_lb, lb));
}
static k3_status run_attnres_mix(k3_backend *be, const float *bank, int n_bank, const float *p,
                                 const float *w, int64_t T, int64_t D, float eps, float *out) {
    mshl m = {.be = be};
    float *dout = m_buf(&m, out, FB(T * D), true);
    const float *dbank = m_buf(&m, bank, FB(n_bank * T * D), false),
                *dp = m_buf(&m, p, FB(T * D), false), *dw = m_buf(&m, w, FB(D), false);
    return m_done(&m, be->ops->attnres_mix(be, dbank, n_bank, dp, dw, T, D, eps, dout));
}
/* KDA inputs like the layer makes them: q, k L2-normalised per head, g in (lo, hi), beta in
 * (0,1). */
typedef struct {
    int64_t n;
    int H, dk, dv;
    float *q, *k, *v, *g, *beta;
} kda_in;
static k3_status run_kda(k3_backend *be, const kda_in *in, int64_t t0, int64_t n, float scale,
                         float *S, float *o, int C, float *work) {
    mshl m = {.be = be};
    const int H = in->H, dk = in->dk, dv = in->dv;
    const int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    const float *q = m_buf(&m, in->q + t0 * sqk, FB(n * sqk), false),
                *k = m_buf(&m, in->k + t0 * sqk, FB(n * sqk), false),
                *v = m_buf(&m, in->v + t0 * svo, FB(n * svo), false),
                *g = m_buf(&m, in->g + t0 * sqk, FB(n * sqk), false),
                *beta = m_buf(&m, in->beta + t0 * H, FB(n * H), false);
    float *dS = m_buf(&m, S, FB((int64_t)H * dk * dv), true), *dO = m_buf(&m, o, FB(n * svo), true);
    if (C <= 0)
        return m_done(&m,
                      be->ops->kda_recurrent(be, q, k, v, g, beta, n, H, dk, dv, scale, dS, dO));
    float *dw =
        m_buf(&m, work, FB((int64_t)H * (int64_t)k3_kda_chunk_work_floats(C, dk, dv)), true);
    return m_done(&m,
                  be->ops->kda_chunked(be, q, k, v, g, beta, n, H, dk, dv, scale, dS, dO, C, dw));
}
static k3_status run_attn_latent(k3_backend *be, const float *qc, const float *cache, int64_t n_ctx,
                                 int H, int W, int Rkv, float scale, float *o_lat, float *work) {
    mshl m = {.be = be};
    const float *dq = m_buf(&m, qc, FB((int64_t)H * W), false),
                *dc = m_buf(&m, cache, FB(n_ctx * W), false);
    float *dO = m_buf(&m, o_lat, FB((int64_t)H * Rkv), true),
          *dw = m_buf(&m, work, FB((int64_t)H * n_ctx), true);
    return m_done(&m, be->ops->attn_latent(be, dq, dc, n_ctx, H, W, Rkv, scale, dO, dw));
}
static k3_status run_moe_topk(k3_backend *be, const float *scores, const float *bias, int64_t T,
                              int E, int K, int n_group, int topk_group, bool renorm, float scale,
                              float *work, int32_t *ids, float *w) {
    mshl m = {.be = be};
    const float *ds = m_buf(&m, scores, FB(T * E), false), *db = m_buf(&m, bias, FB(E), false);
    float *dwork = m_buf(&m, work, FB(T * E), true), *dw = m_buf(&m, w, FB(T * K), true);
    int32_t *di = m_buf(&m, ids, (size_t)(T * K) * sizeof(int32_t), true);
    return m_done(&m, be->ops->moe_topk(be, ds, db, T, E, K, n_group, topk_group, renorm, scale,
                                        dwork, di, dw));
}
static k3_status run_rows_gather(k3_backend *be, const float *src, int64_t width,
                                 const int64_t *idx, int64_t n, float *dst) {
    mshl m = {.be = be};
    const float *ds = m_buf(&m, src, FB((max_idx(idx, n) + 1) * width), false);
    float *dd = m_buf(&m, dst, FB(n * width), true);
    return m_done(&m, be->ops->rows_gather(be, ds, width, idx, n, dd));
}
static k3_status run_rows_scatter(k3_backend *be, const float *src, int64_t width,
                                  const int64_t *idx, int64_t n, float *dst) {
    mshl m = {.be = be};
    const float *ds = m_buf(&m, src, FB(n * width), false);
    float *dd = m_buf(&m, dst, FB((max_idx(idx, n) + 1) * width), true);
    return m_done(&m, be->ops->rows_scatter(be, ds, width, idx, n, dd));
}
static k3_status run_rows_wsum(k3_backend *be, const float *x, const float *w, const int64_t *seg,
                               int64_t seg_len, int64_t n_seg, int64_t width, float *y) {
    mshl m = {.be = be};
    int64_t rows = seg ? (n_seg >= 0 ? max_idx(seg, n_seg + 1) : 0) : n_seg * seg_len;
    rows = rows > 0 ? rows : 0;
    const float *dx = m_buf(&m, x, FB(rows * width), false), *dw = m_buf(&m, w, FB(rows), false);
    float *dy = m_buf(&m, y, FB(n_seg * width), true);
    return m_done(&m, be->ops->rows_wsum(be, dx, dw, seg, seg_len, n_seg, width, dy));
}

/* A random weight [out, in] of dtype dt (F32 / BF16 / MXFP4), in host memory. */
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
        float *p = malloc(FB(out * in));
        fill_randn(p, out * in, 0.3f);
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
/* The cpu matmul's per-element arithmetic as kernels/cpu/kern_tmpl.h documents it ("Reduction
 * order"), written out one lane at a time for an ISA of VL lanes, independently of the kernels:
 * vector k of the row (VL elements; an MXFP4 block's 32 in the unit's order) multiply-adds into
 * lane l of a0 (k even) or a1 (k odd); one VL-tail vector into a0; the last in % VL elements
 * into t in order (multiply, then add); then the lanes of a0 + a1 summed as the unit's hsum
 * does — lanes (i, i + VL/2), then halves again down to (0, 1) — plus t. fused: V_FMA is one
 * rounding (AVX2, AVX-512), two on the scalar unit. */
static void test_matmul_tn_order(void);
static float order_oracle(const float *x, const float *w, int64_t in, int VL, bool fused) {
    float a0[16] = {0}, a1[16] = {0}, v[16];
    const int64_t n_main = in - in % (2 * VL);
    int64_t i = 0;
    for (; i < n_main; i += VL)
        for (int l = 0; l < VL; l++) {
            float *a = (i / VL) % 2 ? a1 : a0;
            a[l] = fused ? fmaf(x[i + l], w[i + l], a[l]) : x[i + l] * w[i + l] + a[l];
        }
    if (i + VL <= in) {
        for (int l = 0; l < VL; l++)
            a0[l] = fused ? fmaf(x[i + l], w[i + l], a0[l]) : x[i + l] * w[i + l] + a0[l];
        i += VL;
    }
    float t = 0.0f;
    for (; i < in; i++) t += x[i] * w[i];
    for (int l = 0; l < VL; l++) v[l] = a0[l] + a1[l];
    for (int h = VL / 2; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) v[l] = v[l] + v[l + h];
    return v[0] + t;
}

/* Every cpu matmul output, decode (T < 4) and prefill tiles alike, is exactly order_oracle's
 * value: rows alone and in groups (out 1..30, the decode's 4- and 2-row groups, the prefill's
 * 6 × 4 tiles and their partial ends), rows with and without tails, rows of one prefill chunk
 * and of several (in > 1024), 1 and 4 threads. */
static void test_matmul_order(void) {
    const char *isa = k3_cpu_isa_name(BE(B_CPU1));
    const int VL = strcmp(isa, "avx512") == 0 ? 16 : strcmp(isa, "avx2") == 0 ? 8 : 1;
    const bool fused = VL > 1,
               xperm = VL == 16; /* AVX-512 takes a block's even then odd elements */
    const k3_dtype dts[3] = {K3_DT_F32, K3_DT_BF16, K3_DT_MXFP4};
    /* out 300 × in 2080 (F32 2.5 MB, BF16 1.2 MB, MXFP4 331 KB) is big enough that 4 threads
       split a decode call (two threads >= 128 KB each) into guided tasks */
    const int64_t ins[6] = {64, 1024, 2080, 1040, 1037, 48}, outs[5] = {1, 3, 7, 30, 300},
                  Ts[8] = {1, 2, 3, 4, 5, 6, 9, 70}; /* decode rows: 3 tokens at a time */
    int64_t n_checked = 0;
    for (int d = 0; d < 3; d++)
        for (int ii = 0; ii < 6; ii++) {
            const int64_t in = ins[ii];
            if (dts[d] == K3_DT_MXFP4 && in % 32) continue;
            for (int oi = 0; oi < 5; oi++) {
                const int64_t out = outs[oi];
                if (out == 300 && in != 2080) continue;
                wbuf w = make_w(dts[d], out, in);
                /* x and the weights in the unit's element order, once (rows of wo, tokens of xo) */
                float *x = fa(70 * in), *y = fa(70 * out), *xo = fa(70 * in), *wo = fa(out * in);
                fill_randn(x, 70 * in, 1.0f);
                for (int64_t e = 0; e < in; e++) {
                    int64_t src = e;
                    if (dts[d] == K3_DT_MXFP4 && xperm)
                        src = e - e % 32 + (e % 32 < 16 ? 2 * (e % 32) : 2 * (e % 32 - 16) + 1);
                    for (int64_t t = 0; t < 70; t++) xo[t * in + e] = x[t * in + src];
                    for (int64_t o = 0; o < out; o++) wo[o * in + e] = k3_tensor_get(&w.t, o, src);
                }
                for (int ti = 0; ti < 8; ti++) {
                    const int64_t T = Ts[ti];
                    /* 70 tokens (two 64-token blocks of a multi-chunk row, a partial tile):
                       rows of several chunks only, a few of them */
                    if (T == 70 && (in != 2080 || out != 30)) continue;
                    if (out == 300 && T > 3) continue; /* the big matrix: decode splits only */
                    for (int bi = 0; bi < 2; bi++) {
                        const int b = bi ? B_CPU4 : B_CPU1;
                        for (int64_t q = 0; q < T * out; q++) y[q] = NAN; /* no stale outputs */
                        K3_CHECK_OK(run_matmul(BE(b), x, T, &w.t, y));
                        for (int64_t t = 0; t < T; t++)
                            for (int64_t o = 0; o < out; o++) {
                                const float want =
                                    order_oracle(xo + t * in, wo + o * in, in, VL, fused);
                                const float got = y[t * out + o];
                                K3_CHECK(memcmp(&want, &got, 4) == 0,
                                         "matmul order (%s, %s in %lld out %lld T %lld, %s): "
                                         "y[%lld, %lld] = %.9g, the documented order gives %.9g",
                                         isa, k3_dtype_name(dts[d]), (long long)in, (long long)out,
                                         (long long)T, k_be_label[b], (long long)t, (long long)o,
                                         got, want);
                                n_checked++;
                            }
                    }
                }
                free(x), free(y), free(xo), free(wo);
                free_w(&w);
            }
        }
    K3_CHECK(n_checked > 10000, "matmul order: only %lld outputs checked", (long long)n_checked);
}

static void test_matmul(void) {
    test_matmul_order();
    test_matmul_tn_order();
    const k3_dtype dts[6] = {K3_DT_F32, K3_DT_BF16, K3_DT_MXFP4,
                             K3_DT_F32, K3_DT_BF16, K3_DT_MXFP4};
    const int64_t ins[6] = {77, 200, 96, 1116, 1116, 1088}, outs[6] = {301, 130, 250, 37, 37, 37};
    for (int d = 0; d < 6; d++) {
        /* T·out·in is above twice the cpu's per-task minimum (4 · 2^15 MACs, kernels/cpu/cpu.c)
           for every dtype, so the thread counts really split the rows; T = 70 is more than one
           64-token prefill block and ends in a partial tile, T = 12 is three 4-token tiles; out
           odd or not a multiple of 4 (row tails); the last three rows are longer than the cpu's
           prefill K chunk (1024), so a row is walked in chunks at T = 12 and in one pass at
           T = 1 — the same sums either way; in = 1116 leaves a VL-tail vector and a scalar tail
           on AVX-512 and AVX2 alike */
        const int64_t in = ins[d], out = outs[d], T = d < 3 ? 70 : 12;
        const char *dn = k3_dtype_name(dts[d]);
        wbuf w = make_w(dts[d], out, in);
        float *x = fa(T * in), *ys[B_COUNT], *y1 = fa(T * out);
        double *yd = da(T * out);
        fill_randn(x, T * in, 1.0f);
        for (int64_t t = 0; t < T; t++)
            for (int64_t o = 0; o < out; o++) {
                double s = 0;
                for (int64_t i = 0; i < in; i++)
                    s += (double)x[t * in + i] * k3_tensor_get(&w.t, o, i);
                yd[t * out + o] = s;
            }
        ys_alloc(ys, T * out);
        for (int b = 0; b < B_COUNT; b++) K3_CHECK_OK(run_matmul(BE(b), x, T, &w.t, ys[b]));
        double er = rel_l2_d(ys[B_REF], yd, T * out), ec = rel_l2_d(ys[B_CPU1], yd, T * out);
        K3_CHECK(er < K3_TOL_OP_REL_L2 && ec < K3_TOL_OP_REL_L2, "matmul %s: ref %.3g cpu %.3g", dn,
                 er, ec);
        K3_CHECK(nondegenerate(ys[B_REF], T * out), "matmul output degenerate");
        char what[64];
        snprintf(what, sizeof what, "matmul %s", dn);
        check_family(ys, T * out, what);
        /* determinism: one token at a time with 1 thread, and 5 + 7 tokens with 4 threads */
        for (int64_t t = 0; t < T; t++)
            K3_CHECK_OK(run_matmul(BE(B_CPU1), x + t * in, 1, &w.t, y1 + t * out));
        K3_CHECK(same_f(ys[B_CPU1], y1, T * out), "matmul %s: cpu result depends on T / threads",
                 dn);
        free(y1);
        y1 = fa(T * out);
        K3_CHECK_OK(run_matmul(BE(B_CPU4), x, 5, &w.t, y1));
        K3_CHECK_OK(run_matmul(BE(B_CPU4), x + 5 * in, T - 5, &w.t, y1 + 5 * out));
        K3_CHECK(same_f(ys[B_CPU1], y1, T * out), "matmul %s: 5 + 7 split differs", dn);
        /* a row view computes the same rows (also on the guard's copy of the weight) */
        k3_tensor rv;
        K3_CHECK_OK(k3_tensor_rows(&w.t, 3, 5, &rv));
        const int on[2] = {B_CPU2, B_GUARD};
        for (int i = 0; i < 2; i++) {
            K3_CHECK_OK(run_matmul(BE(on[i]), x, 1, &rv, y1));
            K3_CHECK(same_f(y1, ys[B_CPU1] + 3, 5), "row view differs (%s)", k_be_label[on[i]]);
        }
        free(x), free(y1), free(yd);
        ys_free(ys);
        free_w(&w);
    }
    /* bad dtype is an error, not a crash */
    k3_tensor bad = {.dtype = K3_DT_I32, .ndim = 2, .shape = {2, 2}};
    float xx[4] = {0}, yy[4];
    for (int b = 0; b < B_COUNT; b++)
        K3_CHECK_ERR(run_matmul(BE(b), xx, 1, &bad, yy), K3_ERR_SHAPE, "unsupported");
    /* MXFP4 hand case: codes 0x21 -> elements (1: 0.5, 2: 1.0), scale 128 -> ×2 */
    uint8_t packed[16] = {0x21}, sc[1] = {128};
    k3_tensor m = {.dtype = K3_DT_MXFP4, .ndim = 2, .shape = {1, 32}, .data = packed, .scale = sc};
    float xm[32] = {0}, ym[1];
    xm[0] = 3.0f, xm[1] = 5.0f;
    for (int b = 0; b < B_COUNT; b++) {
        ym[0] = NAN;
        K3_CHECK_OK(run_matmul(BE(b), xm, 1, &m, ym));
        K3_CHECK(ym[0] == 3.0f * 1.0f + 5.0f * 2.0f, "mxfp4 hand case (%s): %g", k_be_label[b],
                 ym[0]);
    }
    /* MXFP4 scales at the E8M0 edges (0: 2^-127, a subnormal; 1; 127; 255: +inf) in rows long
       enough for the cpu decode path's vector scale conversion (>= 16 blocks): each element
       within 1e-5 of its Σ|x·w| from ref (row 0: every scale 0; row 1: every scale 255, so
       0·inf = NaN there, as in ref), and the decode (T = 1) equals the prefill bit for bit */
    {
        const int64_t in = 1056, out = 9, T = 5; /* 33 blocks: a masked tail */
        wbuf w = make_w(K3_DT_MXFP4, out, in);
        const uint8_t edge[4] = {0, 1, 127, 150};
        for (int64_t i = 0; i < out * in / 32; i++)
            if (k3_rng_u64(&g_rng) % 3 == 0) w.scale[i] = edge[k3_rng_u64(&g_rng) % 4];
        for (int64_t i = 0; i < in / 32; i++) w.scale[i] = 0, w.scale[in / 32 + i] = 255;
        float *x = fa(T * in), *yr = fa(T * out), *yc = fa(T * out), *y1 = fa(out);
        fill_randn(x, T * in, 1.0f);
        K3_CHECK_OK(run_matmul(BE(B_REF), x, T, &w.t, yr));
        K3_CHECK_OK(run_matmul(BE(B_CPU2), x, T, &w.t, yc));
        for (int64_t t = 0; t < T; t++)
            for (int64_t o = 0; o < out; o++) {
                double mag = 0;
                for (int64_t i = 0; i < in; i++)
                    mag += fabs((double)x[t * in + i] * k3_tensor_get(&w.t, o, i));
                float r = yr[t * out + o], c = yc[t * out + o];
                K3_CHECK(o == 1 ? isnan(r) && isnan(c) : fabs((double)c - r) <= 1e-5 * mag + 1e-43,
                         "mxfp4 edge scales: row %lld token %lld: ref %g cpu %g", (long long)o,
                         (long long)t, r, c);
            }
        for (int64_t t = 0; t < T; t++) {
            K3_CHECK_OK(run_matmul(BE(B_CPU1), x + t * in, 1, &w.t, y1));
            K3_CHECK(same_f(y1, yc + t * out, out), "mxfp4 edge scales: T = 1 differs (token %lld)",
                     (long long)t);
        }
        free(x), free(yr), free(yc), free(y1);
        free_w(&w);
    }
}

/* matmul_group: items of every dtype, decode and prefill sizes, one with T = 0 and items that
 * read one x, against one matmul call per item on the same backend — bit for bit on every
 * backend (the cpu splits the rows of all items over its threads at once: 4 threads here, with
 * items big enough to be cut into several tasks). Errors: a bad item is named, n = 0 is a no-op.
 */
static void test_matmul_group(void) {
    enum { N = 6 };
    const k3_dtype dts[N] = {K3_DT_MXFP4, K3_DT_MXFP4, K3_DT_BF16,
                             K3_DT_F32,   K3_DT_BF16,  K3_DT_MXFP4};
    const int64_t outs[N] = {384, 200, 77, 130, 1030, 96}, ins[N] = {768, 768, 200, 96, 256, 1056};
    for (int pass = 0; pass < 2; pass++) {
        const int64_t Tmax = pass ? 70 : 3; /* decode (gemv) and prefill (tiles) */
        wbuf w[N];
        float *x[N], *y[N], *want[N];
        k3_mm mm[N];
        for (int i = 0; i < N; i++) {
            const int64_t T = i == 4 ? 0 : Tmax - i % 2; /* item 4: no tokens */
            w[i] = make_w(dts[i], outs[i], ins[i]);
            /* items 0 and 1 read one x (the gate and up of a MoE step) */
            x[i] = i == 1 ? x[0] : fa(Tmax * ins[i]);
            if (i != 1) fill_randn(x[i], Tmax * ins[i], 1.0f);
            y[i] = fa(Tmax * outs[i] + 1);
            want[i] = fa(Tmax * outs[i] + 1);
            mm[i] = (k3_mm){x[i], T, &w[i].t, y[i]};
        }
        for (int b = 0; b < B_COUNT; b++) {
            mshl m = {.be = BE(b)};
            k3_mm dm[N];
            k3_tensor dw[N];
            for (int i = 0; i < N; i++) {
                for (int64_t q = 0; q < Tmax * outs[i]; q++) /* no stale outputs */
                    y[i][q] = want[i][q] = NAN;
                y[i][Tmax * outs[i]] = want[i][Tmax * outs[i]] = 12345.0f; /* past the end */
                K3_CHECK_OK(run_matmul(BE(b), x[i], mm[i].T, &w[i].t, want[i]));
                dw[i] = m_tensor(&m, &w[i].t);
                dm[i] = (k3_mm){m_buf(&m, x[i], FB(Tmax * ins[i]), false), mm[i].T, &dw[i],
                                m_buf(&m, y[i], FB(Tmax * outs[i] + 1), true)};
            }
            K3_CHECK_OK(m_done(&m, BE(b)->ops->matmul_group(BE(b), dm, N)));
            for (int i = 0; i < N; i++)
                K3_CHECK(same_f(y[i], want[i], mm[i].T * outs[i] + (mm[i].T == 0)) &&
                             y[i][Tmax * outs[i]] == 12345.0f,
                         "matmul_group (%s, T %lld): item %d (%s %lldx%lld) differs from matmul",
                         k_be_label[b], (long long)Tmax, i, k3_dtype_name(dts[i]),
                         (long long)outs[i], (long long)ins[i]);
        }
        for (int i = 0; i < N; i++) {
            if (i != 1) free(x[i]);
            free(y[i]), free(want[i]);
            free_w(&w[i]);
        }
    }
    k3_tensor bad = {.dtype = K3_DT_I32, .ndim = 2, .shape = {2, 2}};
    float xx[4] = {0}, yy[4];
    k3_mm mb[1] = {{xx, 1, &bad, yy}};
    for (int b = 0; b < B_COUNT; b++) {
        K3_CHECK_ERR(BE(b)->ops->matmul_group(BE(b), mb, 1), K3_ERR_SHAPE, "matmul_group item 0");
        K3_CHECK_OK(BE(b)->ops->matmul_group(BE(b), mb, 0));
    }
}

static void test_matmul_tn(void) {
    const k3_dtype dts[3] = {K3_DT_F32, K3_DT_BF16, K3_DT_MXFP4};
    for (int d = 0; d < 3; d++) {
        /* T·out·in above the parallel threshold: threads split the columns */
        const int64_t out = 50, in = dts[d] == K3_DT_MXFP4 ? 96 : 70, T = 10;
        const char *dn = k3_dtype_name(dts[d]);
        wbuf w = make_w(dts[d], out, in);
        float *x = fa(T * out), *ys[B_COUNT], *y1 = fa(T * in);
        double *yd = da(T * in);
        fill_randn(x, T * out, 1.0f);
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < in; i++) {
                double s = 0;
                for (int64_t o = 0; o < out; o++)
                    s += (double)x[t * out + o] * k3_tensor_get(&w.t, o, i);
                yd[t * in + i] = s;
            }
        ys_alloc(ys, T * in);
        for (int b = 0; b < B_COUNT; b++) K3_CHECK_OK(run_matmul_tn(BE(b), x, T, &w.t, ys[b]));
        double er = rel_l2_d(ys[B_REF], yd, T * in), ec = rel_l2_d(ys[B_CPU1], yd, T * in);
        K3_CHECK(er < K3_TOL_OP_REL_L2 && ec < K3_TOL_OP_REL_L2, "matmul_tn %s: ref %.3g cpu %.3g",
                 dn, er, ec);
        K3_CHECK(nondegenerate(ys[B_REF], T * in), "matmul_tn output degenerate");
        char what[64];
        snprintf(what, sizeof what, "matmul_tn %s", dn);
        check_family(ys, T * in, what);
        for (int64_t t = 0; t < T; t++)
            K3_CHECK_OK(run_matmul_tn(BE(B_CPU1), x + t * out, 1, &w.t, y1 + t * in));
        K3_CHECK(same_f(ys[B_CPU1], y1, T * in), "matmul_tn %s depends on T", dn);
        K3_CHECK_OK(run_matmul_tn(BE(B_CPU4), x, 3, &w.t, y1));
        K3_CHECK_OK(run_matmul_tn(BE(B_CPU4), x + 3 * out, T - 3, &w.t, y1 + 3 * in));
        K3_CHECK(same_f(ys[B_CPU1], y1, T * in), "matmul_tn %s: 3 + 7 split differs", dn);
        free(x), free(y1), free(yd);
        ys_free(ys);
        free_w(&w);
    }
}

/* matmul_tn's documented order (kern_tmpl.h): y[t, c] is one multiply-add per term in o order
 * from 0 (fused on AVX2 / AVX-512, two roundings on the scalar unit), whatever the column split:
 * rows alone and 4 at a time with a leftover (out 1, 3, 7, 50), columns in one walk and in
 * several (in > 1024), with a tail, 1 and 4 threads, 1 and 3 tokens. */
static void test_matmul_tn_order(void) {
    const char *isa = k3_cpu_isa_name(BE(B_CPU1));
    const bool fused = strcmp(isa, "scalar") != 0;
    const k3_dtype dts[3] = {K3_DT_F32, K3_DT_BF16, K3_DT_MXFP4};
    const int64_t ins[3] = {70, 2080, 1100}, outs[4] = {1, 3, 7, 50};
    int64_t n_checked = 0;
    for (int d = 0; d < 3; d++)
        for (int ii = 0; ii < 3; ii++) {
            const int64_t in = ins[ii];
            if (dts[d] == K3_DT_MXFP4 && in % 32) continue;
            for (int oi = 0; oi < 4; oi++) {
                const int64_t out = outs[oi], T = 3;
                wbuf w = make_w(dts[d], out, in);
                float *x = fa(T * out), *y = fa(T * in);
                fill_randn(x, T * out, 1.0f);
                for (int bi = 0; bi < 2; bi++)
                    for (int64_t Tc = 1; Tc <= T; Tc += 2) {
                        for (int64_t q = 0; q < T * in; q++) y[q] = NAN;
                        K3_CHECK_OK(run_matmul_tn(BE(bi ? B_CPU4 : B_CPU1), x, Tc, &w.t, y));
                        for (int64_t t = 0; t < Tc; t++)
                            for (int64_t c = 0; c < in; c++) {
                                float a = 0.0f;
                                for (int64_t o = 0; o < out; o++) {
                                    const float xv = x[t * out + o], wv = k3_tensor_get(&w.t, o, c);
                                    a = fused ? fmaf(xv, wv, a) : xv * wv + a;
                                }
                                const float got = y[t * in + c];
                                n_checked++;
                                if (memcmp(&a, &got, 4) == 0) continue;
                                K3_CHECK(false,
                                         "matmul_tn order (%s, %s in %lld out %lld T %lld, %s): "
                                         "y[%lld, %lld] = %.9g, the documented order gives %.9g",
                                         isa, k3_dtype_name(dts[d]), (long long)in, (long long)out,
                                         (long long)Tc, k_be_label[bi ? B_CPU4 : B_CPU1],
                                         (long long)t, (long long)c, got, a);
                                goto next;
                            }
                    }
            next:
                free(x), free(y);
                free_w(&w);
            }
        }
    K3_CHECK(n_checked > 50000, "matmul_tn order: only %lld outputs checked", (long long)n_checked);
}

/* ---- rows / elementwise -------------------------------------------------------------------- */
/* Token counts for the row reductions (rmsnorm, l2norm, rmsnorm_rows, attnres_mix): the cpu runs
   VL tokens' chains in the vector lanes (16 on AVX-512, 8 on AVX2, 1 scalar) and the tokens left
   over one at a time, with the pool's tasks whole blocks of 16; below, at and past each VL, a
   tail, and a prefill. Every one must be ref's bits. */
static const int64_t k_rr_T[] = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 37, 64, 512};
/* rmsnorm (w given / NULL) or l2norm (l2) over k_rr_T × rows of n (a multiple of 16, one with a
   tail after whole vectors, one shorter than a vector): every cpu backend (1, 2, 4 threads) and
   guard bit-identical to ref, and in place on cpu/4t too. */
static void norm_sweep(bool l2) {
    static const int64_t ns[] = {128, 300, 5};
    const char *what = l2 ? "l2norm" : "rmsnorm";
    for (size_t ni = 0; ni < K3_ARRAY_LEN(ns); ni++)
        for (size_t ti = 0; ti < K3_ARRAY_LEN(k_rr_T); ti++)
            for (int wi = 0; wi < (l2 ? 1 : 2); wi++) {
                const int64_t n = ns[ni], T = k_rr_T[ti];
                float *x = fa(T * n), *w = fa(n), *ys[B_COUNT];
                fill_randn(x, T * n, 2.0f);
                fill_randn(w, n, 1.0f);
                const float *wp = wi ? NULL : w;
                ys_alloc(ys, T * n);
                for (int b = 0; b < B_COUNT; b++)
                    K3_CHECK_OK(l2 ? run_l2norm(BE(b), x, T, n, 1e-6f, ys[b])
                                   : run_rmsnorm(BE(b), x, wp, T, n, 1e-5f, ys[b]));
                for (int b = B_CPU1; b < B_COUNT; b++)
                    K3_CHECK(same_f(ys[b], ys[B_REF], T * n), "%s T=%lld n=%lld (w %s): %s != ref",
                             what, (long long)T, (long long)n, wp ? "given" : "NULL",
                             k_be_label[b]);
                K3_CHECK_OK(l2 ? run_l2norm(BE(B_CPU4), x, T, n, 1e-6f, x)
                               : run_rmsnorm(BE(B_CPU4), x, wp, T, n, 1e-5f, x));
                K3_CHECK(same_f(x, ys[B_REF], T * n), "%s T=%lld n=%lld in place != ref", what,
                         (long long)T, (long long)n);
                free(x), free(w);
                ys_free(ys);
            }
}
static void test_rmsnorm(void) {
    const int64_t T = 128, n = 300; /* T·n above the cpu's parallel threshold (2^15) */
    float *x = fa(T * n), *w = fa(n), *ys[B_COUNT], *y1 = fa(T * n);
    double *yd = da(T * n);
    fill_randn(x, T * n, 2.0f);
    fill_randn(w, n, 1.0f);
    for (int wi = 0; wi < 2; wi++) {
        const float *wp = wi ? NULL : w;
        for (int64_t t = 0; t < T; t++) {
            double ss = 0;
            for (int64_t i = 0; i < n; i++) ss += (double)x[t * n + i] * x[t * n + i];
            double r = 1.0 / sqrt(ss / n + 1e-5);
            for (int64_t i = 0; i < n; i++) yd[t * n + i] = (wp ? wp[i] : 1.0) * x[t * n + i] * r;
        }
        ys_alloc(ys, T * n);
        for (int b = 0; b < B_COUNT; b++)
            K3_CHECK_OK(run_rmsnorm(BE(b), x, wp, T, n, 1e-5f, ys[b]));
        K3_CHECK(rel_l2_d(ys[B_REF], yd, T * n) < K3_TOL_OP_REL_L2, "rmsnorm ref (w %s): %g",
                 wp ? "given" : "NULL", rel_l2_d(ys[B_REF], yd, T * n));
        check_cpu_is_ref(ys, T * n, "rmsnorm");
        check_family(ys, T * n, "rmsnorm");
        for (int64_t t = 0; t < T; t++)
            K3_CHECK_OK(run_rmsnorm(BE(B_CPU4), x + t * n, wp, 1, n, 1e-5f, y1 + t * n));
        K3_CHECK(same_f(y1, ys[B_CPU1], T * n), "rmsnorm depends on T");
        ys_free(ys);
    }
    /* hand case: x = (3, 4), w = 1, eps 0: rms = sqrt(12.5) */
    float hx[2] = {3, 4}, hy[2];
    for (int b = 0; b < B_COUNT; b++) {
        K3_CHECK_OK(run_rmsnorm(BE(b), hx, NULL, 1, 2, 0.0f, hy));
        K3_CHECK(fabsf(hy[0] - 3.0f / sqrtf(12.5f)) < 1e-6f &&
                     fabsf(hy[1] - 4.0f / sqrtf(12.5f)) < 1e-6f,
                 "rmsnorm hand (%s)", k_be_label[b]);
    }
    free(x), free(w), free(y1), free(yd);
    norm_sweep(false);
}

static void test_l2norm(void) {
    for (int b = 0; b < B_COUNT; b++) {
        float hx[4] = {3, 4, 0, 0}, hy[4];
        K3_CHECK_OK(run_l2norm(BE(b), hx, 2, 2, 1e-6f, hy));
        K3_CHECK(fabsf(hy[0] - 3.0f / sqrtf(25.000001f)) < 1e-7f && fabsf(hy[1] - 0.8f) < 1e-6f,
                 "l2norm hand (%s)", k_be_label[b]);
        K3_CHECK(hy[2] == 0.0f && hy[3] == 0.0f, "l2norm of zeros must be 0 (eps), got %g", hy[2]);
    }
    const int64_t T = 300, n = 128; /* above the parallel threshold */
    float *x = fa(T * n), *ys[B_COUNT], *y1 = fa(T * n);
    fill_randn(x, T * n, 1.0f);
    ys_alloc(ys, T * n);
    for (int b = 0; b < B_COUNT; b++) K3_CHECK_OK(run_l2norm(BE(b), x, T, n, 1e-6f, ys[b]));
    check_cpu_is_ref(ys, T * n, "l2norm");
    check_family(ys, T * n, "l2norm");
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)ys[B_REF][i] * ys[B_REF][i];
    K3_CHECK(fabs(ss - 1.0) < 1e-5, "l2norm row norm %g", ss);
    K3_CHECK_OK(run_l2norm(BE(B_CPU4), x, 7, n, 1e-6f, y1));
    K3_CHECK_OK(run_l2norm(BE(B_CPU4), x + 7 * n, T - 7, n, 1e-6f, y1 + 7 * n));
    K3_CHECK(same_f(y1, ys[B_CPU1], T * n), "l2norm depends on T");
    /* in place */
    float *xi = fcopy(x, T * n);
    K3_CHECK_OK(run_l2norm(BE(B_GUARD), xi, T, n, 1e-6f, xi));
    K3_CHECK(same_f(xi, ys[B_CPU1], T * n), "l2norm in place (guard)");
    free(x), free(y1), free(xi);
    ys_free(ys);
    norm_sweep(true);
}

static k3_status run_elementwise(k3_backend *be, int which, const float *g, const float *u,
                                 int64_t n, float *y) {
    switch (which) {
    case 0:
        return run_silu(be, g, n, y);
    case 1:
        return run_sigmoid(be, g, n, y);
    case 2:
        return run_situ(be, g, u, n, 4.0f, 25.0f, y);
    default:
        return run_swiglu(be, g, u, n, y);
    }
}
static void elementwise_case(const char *name, int which) {
    const int64_t n = 257;
    float *g = fa(n), *u = fa(n), *ys[B_COUNT], *y1 = fa(n);
    double *yd = da(n);
    fill_randn(g, n, 4.0f);
    fill_randn(u, n, 30.0f);
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
    ys_alloc(ys, n);
    for (int b = 0; b < B_COUNT; b++) {
        K3_CHECK_OK(run_elementwise(BE(b), which, g, u, n, ys[b]));
        K3_CHECK(rel_l2_d(ys[b], yd, n) < K3_TOL_OP_REL_L2, "%s (%s) vs float64: %g", name,
                 k_be_label[b], rel_l2_d(ys[b], yd, n));
    }
    check_family(ys, n, name);
    /* split 100 + 157, and in place (y aliases the first input) */
    K3_CHECK_OK(run_elementwise(BE(B_CPU4), which, g, u, 100, y1));
    K3_CHECK_OK(run_elementwise(BE(B_CPU4), which, g + 100, u + 100, n - 100, y1 + 100));
    K3_CHECK(same_f(y1, ys[B_CPU1], n), "%s: split differs", name);
    const int on[2] = {B_CPU2, B_GUARD};
    for (int i = 0; i < 2; i++) {
        memcpy(y1, g, FB(n));
        K3_CHECK_OK(run_elementwise(BE(on[i]), which, y1, u, n, y1));
        K3_CHECK(same_f(y1, ys[B_CPU1], n), "%s in place (%s)", name, k_be_label[on[i]]);
    }
    free(g), free(u), free(y1), free(yd);
    ys_free(ys);
}
/* The vectorised activations (exp/tanh polynomials in the cpu kernels) over their whole range:
 * g, u = ±10^k for k in [-8, 2] (through tanh's series/exp switch at 0.55, sigmoid's saturation
 * and exp's under/overflow), each element within K3_TOL_OP_REL_L2 of float64, with an absolute
 * floor of 1e-30: σ(x) = 1/(1 + e^-x) in fp32 is 0 once e^-x overflows (x < -88.7) — ref's
 * expf does it too — where float64 still has ~1e-39; NaN in gives NaN out. */
static void activation_sweep(const char *name, int which) {
    const int64_t n = 2001;
    float *g = fa(n), *u = fa(n), *y = fa(n);
    for (int64_t i = 0; i < n; i++) {
        double k = -8.0 + 10.0 * (double)(i / 2) / (double)(n / 2);
        g[i] = (float)((i % 2 ? -1.0 : 1.0) * pow(10.0, k));
        u[i] = (float)((i % 3 ? 1.0 : -1.0) * pow(10.0, 2.0 - k / 4.0));
    }
    g[n - 1] = NAN;
    for (int b = 0; b < B_COUNT; b++) {
        K3_CHECK_OK(run_elementwise(BE(b), which, g, u, n, y));
        int64_t bad = 0, worst = -1;
        double worst_e = 0;
        for (int64_t i = 0; i < n - 1; i++) {
            double gd = g[i], ud = u[i], want = 0;
            switch (which) {
            case 0:
                want = gd * sigd(gd);
                break;
            case 1:
                want = sigd(gd);
                break;
            case 2:
                want = 4.0 * tanh(gd / 4.0) * sigd(gd) * 25.0 * tanh(ud / 25.0);
                break;
            default:
                want = gd * sigd(gd) * ud;
                break;
            }
            double e = fabs(y[i] - want) / (fabs(want) + 1e-30 / K3_TOL_OP_REL_L2);
            if (!(e <= K3_TOL_OP_REL_L2)) bad++;
            if (!(e <= worst_e)) worst_e = e, worst = i;
        }
        K3_CHECK(bad == 0, "%s (%s) sweep: %lld elements off; worst %.3g at g=%g u=%g (y=%g)", name,
                 k_be_label[b], (long long)bad, worst_e, worst >= 0 ? g[worst] : 0.0,
                 worst >= 0 ? u[worst] : 0.0, worst >= 0 ? y[worst] : 0.0);
        K3_CHECK(isnan(y[n - 1]), "%s (%s): NaN in, %g out", name, k_be_label[b], y[n - 1]);
    }
    free(g), free(u), free(y);
}
static void test_silu(void) {
    elementwise_case("silu", 0);
    activation_sweep("silu", 0);
    float x = 1.0f, y;
    K3_CHECK_OK(run_silu(BE(B_CPU2), &x, 1, &y));
    K3_CHECK(fabsf(y - 0.7310585786f) < 1e-6f, "silu(1) = %g", y);
}
static void test_sigmoid(void) {
    elementwise_case("sigmoid", 1);
    activation_sweep("sigmoid", 1);
    float x[2] = {0.0f, -100.0f}, y[2];
    K3_CHECK_OK(run_sigmoid(BE(B_CPU2), x, 2, y));
    K3_CHECK(y[0] == 0.5f && y[1] >= 0.0f && y[1] < 1e-40f, "sigmoid hand");
}
static void test_situ(void) {
    elementwise_case("situ", 2);
    activation_sweep("situ", 2);
    /* hand case (K3-MODEL.md §4.1): g = 1, u = 2 -> 4 tanh(1/4) σ(1) · 25 tanh(2/25) */
    float g = 1.0f, u = 2.0f, y, y2;
    K3_CHECK_OK(run_situ(BE(B_CPU2), &g, &u, 1, 4.0f, 25.0f, &y));
    double want = 4.0 * tanh(0.25) * sigd(1.0) * 25.0 * tanh(0.08);
    K3_CHECK(fabs(y - want) < 1e-6, "situ(1,2) = %.9g want %.9g", y, want);
    /* lin_beta <= 0: the up branch is not capped */
    K3_CHECK_OK(run_situ(BE(B_CPU2), &g, &u, 1, 4.0f, 0.0f, &y2));
    K3_CHECK(fabs(y2 - 4.0 * tanh(0.25) * sigd(1.0) * 2.0) < 1e-6, "situ uncapped");
}
static void test_swiglu(void) {
    elementwise_case("swiglu", 3);
    activation_sweep("swiglu", 3);
}

static void test_softmax(void) {
    float x[6] = {1, 2, 3, 1000, 1000, -1000}, ys6[B_COUNT][6];
    double z = exp(-2.0) + exp(-1.0) + 1.0;
    for (int b = 0; b < B_COUNT; b++) {
        float *y = ys6[b];
        K3_CHECK_OK(run_softmax(BE(b), x, 2, 3, y));
        K3_CHECK(fabs(y[0] - exp(-2.0) / z) < 1e-7 && fabs(y[2] - 1.0 / z) < 1e-7,
                 "softmax hand (%s)", k_be_label[b]);
        K3_CHECK(y[3] == 0.5f && y[4] == 0.5f && y[5] == 0.0f,
                 "softmax large values (max-subtracted) (%s)", k_be_label[b]);
        K3_CHECK(memcmp(ys6[b], ys6[B_CPU1], sizeof ys6[b]) == 0 || b < B_CPU1,
                 "softmax %s != cpu/1t", k_be_label[b]);
    }
    /* random rows vs float64; in place; one row at a time */
    const int64_t T = 20, n = 100;
    float *xr = fa(T * n), *ys[B_COUNT], *y1 = fa(T * n);
    double *yd = da(T * n);
    fill_randn(xr, T * n, 3.0f);
    for (int64_t t = 0; t < T; t++) {
        double m = -1e300, s = 0;
        for (int64_t i = 0; i < n; i++) m = xr[t * n + i] > m ? xr[t * n + i] : m;
        for (int64_t i = 0; i < n; i++) s += (yd[t * n + i] = exp(xr[t * n + i] - m));
        for (int64_t i = 0; i < n; i++) yd[t * n + i] /= s;
    }
    ys_alloc(ys, T * n);
    for (int b = 0; b < B_COUNT; b++) K3_CHECK_OK(run_softmax(BE(b), xr, T, n, ys[b]));
    for (int b = 0; b < B_COUNT; b++)
        K3_CHECK(rel_l2_d(ys[b], yd, T * n) < K3_TOL_OP_REL_L2, "softmax (%s) vs float64: %g",
                 k_be_label[b], rel_l2_d(ys[b], yd, T * n));
    check_family(ys, T * n, "softmax");
    for (int64_t t = 0; t < T; t++)
        K3_CHECK_OK(run_softmax(BE(B_CPU4), xr + t * n, 1, n, y1 + t * n));
    K3_CHECK(same_f(y1, ys[B_CPU1], T * n), "softmax depends on T");
    memcpy(y1, xr, FB(T * n));
    K3_CHECK_OK(run_softmax(BE(B_GUARD), y1, T, n, y1));
    K3_CHECK(same_f(y1, ys[B_CPU1], T * n), "softmax in place (guard)");
    free(xr), free(y1), free(yd);
    ys_free(ys);
}

/* ---- element-wise, copies, decode ---------------------------------------------------------- */
/* add and mul: fp32 + and × are correctly rounded, and so is (float) of the exact double result
 * (53 >= 2·24 + 2 bits: double rounding is innocuous), so every backend must match it exactly. */
static void binary_case(const char *name, bool is_mul) {
    const int64_t n = 300001; /* > 4·2^15: the cpu splits it over its pool, with a ragged tail */
    float *a = fa(n), *b = fa(n), *want = fa(n), *ys[B_COUNT], *y1 = fa(n);
    fill_randn(a, n, 3.0f);
    fill_randn(b, n, 3.0f);
    a[0] = 1e30f, b[0] = 1.0f; /* absorbed */
    a[1] = -0.0f, b[1] = -0.0f;
    a[2] = 3e38f, b[2] = 3e38f; /* overflows to inf */
    for (int64_t i = 0; i < n; i++)
        want[i] = i == 2   ? INFINITY /* (float) of an out-of-range double is UB: written out */
                  : is_mul ? (float)((double)a[i] * (double)b[i])
                           : (float)((double)a[i] + (double)b[i]);
    ys_alloc(ys, n);
    for (int bk = 0; bk < B_COUNT; bk++) {
        K3_CHECK_OK(is_mul ? run_mul(BE(bk), a, b, n, ys[bk]) : run_add(BE(bk), a, b, n, ys[bk]));
        K3_CHECK(same_f(ys[bk], want, n), "%s (%s) != correctly rounded float64 result", name,
                 k_be_label[bk]);
    }
    /* (−0) + (−0) = −0, (−0)·(−0) = +0 */
    K3_CHECK(!signbit(ys[B_REF][1]) == is_mul && isinf(ys[B_REF][2]),
             "%s: -0 / overflow hand cases: %g %g", name, ys[B_REF][1], ys[B_REF][2]);
    check_family(ys, n, name);
    /* split 400 + 601 */
    K3_CHECK_OK(is_mul ? run_mul(BE(B_CPU4), a, b, 400, y1) : run_add(BE(B_CPU4), a, b, 400, y1));
    K3_CHECK_OK(is_mul ? run_mul(BE(B_CPU4), a + 400, b + 400, n - 400, y1 + 400)
                       : run_add(BE(B_CPU4), a + 400, b + 400, n - 400, y1 + 400));
    K3_CHECK(same_f(y1, want, n), "%s: split differs", name);
    /* in place: y aliases a, then y aliases b */
    const int on[2] = {B_CPU2, B_GUARD};
    for (int i = 0; i < 2; i++) {
        k3_backend *be = BE(on[i]);
        memcpy(y1, a, FB(n));
        K3_CHECK_OK(is_mul ? run_mul(be, y1, b, n, y1) : run_add(be, y1, b, n, y1));
        K3_CHECK(same_f(y1, want, n), "%s y = a in place (%s)", name, k_be_label[on[i]]);
        memcpy(y1, b, FB(n));
        K3_CHECK_OK(is_mul ? run_mul(be, a, y1, n, y1) : run_add(be, a, y1, n, y1));
        K3_CHECK(same_f(y1, want, n), "%s y = b in place (%s)", name, k_be_label[on[i]]);
    }
    free(a), free(b), free(want), free(y1);
    ys_free(ys);
}
static void test_add(void) {
    binary_case("add", false);
    float a[2] = {1.5f, -2.0f}, b[2] = {2.25f, 0.5f}, y[2];
    K3_CHECK_OK(run_add(BE(B_GUARD), a, b, 2, y));
    K3_CHECK(y[0] == 3.75f && y[1] == -1.5f, "add hand: %g %g", y[0], y[1]);
}
static void test_mul(void) {
    binary_case("mul", true);
    float a[2] = {1.5f, -2.0f}, b[2] = {2.25f, 0.5f}, y[2];
    K3_CHECK_OK(run_mul(BE(B_GUARD), a, b, 2, y));
    K3_CHECK(y[0] == 3.375f && y[1] == -1.0f, "mul hand: %g %g", y[0], y[1]);
}

static void test_fill(void) {
    const int64_t n = 1000, pad = 8;
    const float vs[3] = {1.5f, -0.0f, INFINITY};
    float *ys[B_COUNT];
    for (int vi = 0; vi < 3; vi++) {
        ys_alloc(ys, n + pad);
        for (int b = 0; b < B_COUNT; b++) {
            K3_CHECK_OK(run_fill(BE(b), ys[b], n, vs[vi]));
            bool ok = true;
            for (int64_t i = 0; i < n; i++)
                ok = ok && memcmp(&ys[b][i], &vs[vi], sizeof(float)) == 0; /* -0 stays -0 */
            for (int64_t i = n; i < n + pad; i++) ok = ok && isnan(ys[b][i]);
            K3_CHECK(ok, "fill %g (%s): wrong value or wrote past n", vs[vi], k_be_label[b]);
        }
        check_family(ys, n + pad, "fill");
        /* split 400 + 600 on 4 threads; n = 0 writes nothing */
        float *y1 = fa(n + pad);
        K3_CHECK_OK(run_fill(BE(B_CPU4), y1, 400, vs[vi]));
        K3_CHECK_OK(run_fill(BE(B_CPU4), y1 + 400, n - 400, vs[vi]));
        K3_CHECK_OK(run_fill(BE(B_CPU4), y1 + n, 0, 7.0f));
        K3_CHECK(same_f(y1, ys[B_CPU1], n + pad), "fill: split differs / n = 0 wrote");
        free(y1);
        ys_free(ys);
    }
}

static void test_copy2d(void) {
    /* 7 rows × 13 cols from a stride-20 source into a stride-16 destination: the 3 padding floats
       of every destination row and everything past the last row stay untouched */
    const int64_t rows = 7, cols = 13, ss = 20, ds = 16, nd = rows * ds + 5;
    float *src = fa(rows * ss), *ys[B_COUNT], *init = fa(nd), *y1 = fa(nd);
    fill_randn(src, rows * ss, 1.0f);
    src[0] = -0.0f;
    uint32_t payload = 0x7fc01234u; /* a NaN with a payload: copied bits, not values */
    memcpy(&src[ss + 1], &payload, 4);
    for (int64_t i = 0; i < nd; i++) init[i] = -1000.0f - (float)i;
    ys_alloc(ys, nd);
    for (int b = 0; b < B_COUNT; b++) {
        memcpy(ys[b], init, FB(nd));
        K3_CHECK_OK(run_copy2d(BE(b), ys[b], ds, src, ss, rows, cols));
        bool ok = true;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < ds; c++) {
                const float *want = c < cols ? &src[r * ss + c] : &init[r * ds + c];
                ok = ok && memcmp(&ys[b][r * ds + c], want, 4) == 0;
            }
        ok = ok && same_f(ys[b] + rows * ds, init + rows * ds, nd - rows * ds);
        K3_CHECK(ok, "copy2d (%s): wrong bits or wrote outside the rectangle", k_be_label[b]);
    }
    check_family(ys, nd, "copy2d");
    /* split 3 + 4 rows; 0 rows and 0 cols write nothing */
    memcpy(y1, init, FB(nd));
    K3_CHECK_OK(run_copy2d(BE(B_CPU4), y1, ds, src, ss, 3, cols));
    K3_CHECK_OK(run_copy2d(BE(B_CPU4), y1 + 3 * ds, ds, src + 3 * ss, ss, rows - 3, cols));
    K3_CHECK_OK(run_copy2d(BE(B_CPU4), y1, ds, src, ss, 0, cols));
    K3_CHECK_OK(run_copy2d(BE(B_CPU4), y1, ds, src, ss, rows, 0));
    K3_CHECK(same_f(y1, ys[B_CPU1], nd), "copy2d: split differs / empty copy wrote");
    /* one row: strides do not matter */
    for (int b = 0; b < B_COUNT; b++) {
        memcpy(y1, init, FB(nd));
        K3_CHECK_OK(run_copy2d(BE(b), y1, 0, src, 0, 1, cols));
        K3_CHECK(same_f(y1, src, cols) && same_f(y1 + cols, init + cols, nd - cols),
                 "copy2d one row (%s)", k_be_label[b]);
    }
    /* overlapping rows (stride < cols) and negative sizes are argument errors */
    for (int b = 0; b < B_COUNT; b++) {
        K3_CHECK_ERR(run_copy2d(BE(b), y1, 12, src, ss, 2, cols), K3_ERR_ARG, "copy2d");
        K3_CHECK_ERR(run_copy2d(BE(b), y1, ds, src, 12, 2, cols), K3_ERR_ARG, "copy2d");
        K3_CHECK_ERR(run_copy2d(BE(b), y1, ds, src, ss, -1, cols), K3_ERR_ARG, "copy2d");
    }
    free(src), free(init), free(y1);
    ys_free(ys);
}

/* f16 decoded independently of base/ (IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits). */
static double f16_ref(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return s ? -v : v;
}
static float bf16_ref(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static void test_to_f32(void) {
    /* every BF16 and every F16 bit pattern */
    const int64_t n = 65536;
    uint16_t *bits = malloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) bits[i] = (uint16_t)i;
    float *want = fa(n), *ys[B_COUNT], *y1 = fa(n);
    for (int f16 = 0; f16 < 2; f16++) {
        const char *dn = f16 ? "F16" : "BF16";
        k3_tensor t = {
            .dtype = f16 ? K3_DT_F16 : K3_DT_BF16, .ndim = 1, .shape = {n}, .data = bits};
        for (int64_t i = 0; i < n; i++)
            want[i] = f16 ? (float)f16_ref((uint16_t)i) : bf16_ref((uint16_t)i);
        ys_alloc(ys, n);
        for (int b = 0; b < B_COUNT; b++) {
            K3_CHECK_OK(run_to_f32(BE(b), &t, n, ys[b]));
            int64_t bad = 0;
            for (int64_t i = 0; i < n; i++) {
                bool ok = isnan(want[i]) ? isnan(ys[b][i])
                                         : memcmp(&ys[b][i], &want[i], sizeof(float)) == 0;
                bad += !ok;
            }
            K3_CHECK(bad == 0, "to_f32 %s (%s): %lld of 65536 patterns decode wrong", dn,
                     k_be_label[b], (long long)bad);
        }
        check_family(ys, n, "to_f32");
        /* split into two views */
        k3_tensor h0 = t, h1 = t;
        h0.shape[0] = 20000;
        h1.shape[0] = n - 20000;
        h1.data = bits + 20000;
        K3_CHECK_OK(run_to_f32(BE(B_CPU4), &h0, 20000, y1));
        K3_CHECK_OK(run_to_f32(BE(B_CPU4), &h1, n - 20000, y1 + 20000));
        K3_CHECK(same_f(y1, ys[B_CPU1], n), "to_f32 %s: split differs", dn);
        ys_free(ys);
    }
    /* F32 (2-D) is a bit copy; hand values */
    float f[6] = {1.0f, -2.5f, -0.0f, 3e38f, 1e-45f, 7.0f}, out[6];
    k3_tensor tf = {.dtype = K3_DT_F32, .ndim = 2, .shape = {2, 3}, .data = f};
    uint16_t hb[3] = {0x3fc0, 0xc000, 0x0001}, hh[3] = {0x3e00, 0xfbff, 0x0001};
    k3_tensor tb = {.dtype = K3_DT_BF16, .ndim = 1, .shape = {3}, .data = hb};
    k3_tensor th = {.dtype = K3_DT_F16, .ndim = 1, .shape = {3}, .data = hh};
    int32_t i32[2] = {1, 2};
    k3_tensor ti = {.dtype = K3_DT_I32, .ndim = 1, .shape = {2}, .data = i32};
    for (int b = 0; b < B_COUNT; b++) {
        K3_CHECK_OK(run_to_f32(BE(b), &tf, 6, out));
        K3_CHECK(memcmp(out, f, sizeof f) == 0, "to_f32 F32 (%s)", k_be_label[b]);
        K3_CHECK_OK(run_to_f32(BE(b), &tb, 3, out));
        K3_CHECK(out[0] == 1.5f && out[1] == -2.0f && out[2] == 0x1p-133f, "to_f32 BF16 hand (%s)",
                 k_be_label[b]);
        K3_CHECK_OK(run_to_f32(BE(b), &th, 3, out));
        K3_CHECK(out[0] == 1.5f && out[1] == -65504.0f && out[2] == 0x1p-24f,
                 "to_f32 F16 hand (%s)", k_be_label[b]);
        /* n must be the tensor's element count; other dtypes are errors */
        K3_CHECK_ERR(run_to_f32(BE(b), &tf, 5, out), K3_ERR_SHAPE, "elements");
        K3_CHECK_ERR(run_to_f32(BE(b), &ti, 2, out), K3_ERR_SHAPE, "I32");
    }
    free(bits), free(want), free(y1);
}

static void test_embed_rows(void) {
    const int64_t V = 50, D = 24, T = 17;
    int32_t ids[17] = {0, 49, 3, 3, 17, 0, 22, 49, 8, 1, 2, 44, 45, 30, 30, 30, 12};
    float *ys[B_COUNT], *y1 = fa(T * D), *want = fa(T * D);
    for (int d = 0; d < 2; d++) {
        wbuf w = make_w(d ? K3_DT_BF16 : K3_DT_F32, V, D);
        const char *dn = k3_dtype_name(w.t.dtype);
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < D; i++)
                want[t * D + i] = d ? bf16_ref(((const uint16_t *)w.mem)[ids[t] * D + i])
                                    : ((const float *)w.mem)[ids[t] * D + i];
        ys_alloc(ys, T * D);
        for (int b = 0; b < B_COUNT; b++) {
            K3_CHECK_OK(run_embed_rows(BE(b), &w.t, ids, T, ys[b]));
            K3_CHECK(same_f(ys[b], want, T * D), "embed_rows %s (%s) != the table's rows", dn,
                     k_be_label[b]);
        }
        check_family(ys, T * D, "embed_rows");
        K3_CHECK_OK(run_embed_rows(BE(B_CPU4), &w.t, ids, 8, y1));
        K3_CHECK_OK(run_embed_rows(BE(B_CPU4), &w.t, ids + 8, T - 8, y1 + 8 * D));
        K3_CHECK(same_f(y1, want, T * D), "embed_rows %s: split differs", dn);
        /* an id outside [0, V) is an argument error naming its position */
        int32_t bad[4] = {1, 2, 3, 4};
        for (int b = 0; b < B_COUNT; b++) {
            bad[2] = (int32_t)V;
            K3_CHECK_ERR(run_embed_rows(BE(b), &w.t, bad, 4, y1), K3_ERR_ARG, "position 2");
            bad[2] = 3, bad[0] = -1;
            K3_CHECK_ERR(run_embed_rows(BE(b), &w.t, bad, 4, y1), K3_ERR_ARG, "position 0");
            bad[0] = 1;
        }
        ys_free(ys);
        free_w(&w);
    }
    /* a table of another dtype is a shape error */
    wbuf mx = make_w(K3_DT_MXFP4, 4, 32);
    for (int b = 0; b < B_COUNT; b++)
        K3_CHECK_ERR(run_embed_rows(BE(b), &mx.t, ids, 1, y1), K3_ERR_SHAPE, "embed_rows");
    free_w(&mx);
    free(y1), free(want);
}

/* ---- KDA pieces ------------------------------------------------------------------------------ */
/* short_conv and attnres_mix at sizes the cpu splits over its pool (channels / tokens): every
   backend bit-identical to ref, outputs and state, whatever the thread count. */
static void short_conv_split_case(void) {
    const int64_t P = 300, n = 40; /* P·n·K above 2^15; 300 channels: blocks of 64 + a tail */
    const int K = 4;
    float *in = fa(n * P), *w = fa(P * K), *st0 = fa((K - 1) * P), *ys[B_COUNT], *ss[B_COUNT];
    fill_randn(in, n * P, 1.0f);
    fill_randn(w, P * K, 0.5f);
    fill_randn(st0, (K - 1) * P, 1.0f);
    ys_alloc(ys, n * P);
    ys_alloc(ss, (K - 1) * P);
    for (int b = 0; b < B_COUNT; b++) {
        memcpy(ss[b], st0, FB((K - 1) * P));
        K3_CHECK_OK(run_short_conv(BE(b), in, n, P, K, w, ss[b], ys[b]));
        K3_CHECK(same_f(ys[b], ys[B_REF], n * P) && same_f(ss[b], ss[B_REF], (K - 1) * P),
                 "short_conv split over the pool (%s) differs from ref", k_be_label[b]);
    }
    free(in), free(w), free(st0);
    ys_free(ys);
    ys_free(ss);
}
static void attnres_split_case(void) {
    const int64_t T = 37, D = 1024;
    const int nb = 3;
    float *bank = fa(nb * T * D), *p = fa(T * D), *w = fa(D), *ys[B_COUNT], *pin = fa(T * D);
    fill_randn(bank, nb * T * D, 1.0f);
    fill_randn(p, T * D, 1.0f);
    fill_randn(w, D, 0.1f);
    ys_alloc(ys, T * D);
    for (int b = 0; b < B_COUNT; b++) {
        K3_CHECK_OK(run_attnres_mix(BE(b), bank, nb, p, w, T, D, 1e-5f, ys[b]));
        K3_CHECK(same_f(ys[b], ys[B_REF], T * D), "attnres_mix split over the pool (%s) differs",
                 k_be_label[b]);
    }
    memcpy(pin, p, FB(T * D)); /* in place (out = p) on the 4-thread cpu */
    K3_CHECK_OK(run_attnres_mix(BE(B_CPU4), bank, nb, pin, w, T, D, 1e-5f, pin));
    K3_CHECK(same_f(pin, ys[B_REF], T * D), "attnres_mix in place split over the pool differs");
    free(bank), free(p), free(w), free(pin);
    ys_free(ys);
}
/* attnres_mix over k_rr_T × n_bank 0..8 (D a multiple of 16, or with a tail after whole
   vectors): every cpu backend and guard bit-identical to ref, and in place on cpu/4t. */
static void attnres_sweep(void) {
    for (int nb = 0; nb <= 8; nb++)
        for (size_t ti = 0; ti < K3_ARRAY_LEN(k_rr_T); ti++) {
            const int64_t T = k_rr_T[ti], D = nb % 2 ? 100 : 64;
            float *bank = fa((nb ? nb : 1) * T * D), *p = fa(T * D), *w = fa(D), *ys[B_COUNT];
            fill_randn(bank, nb * T * D, 1.0f);
            fill_randn(p, T * D, 2.0f);
            fill_randn(w, D, 0.5f);
            ys_alloc(ys, T * D);
            for (int b = 0; b < B_COUNT; b++)
                K3_CHECK_OK(run_attnres_mix(BE(b), bank, nb, p, w, T, D, 1e-5f, ys[b]));
            for (int b = B_CPU1; b < B_COUNT; b++)
                K3_CHECK(same_f(ys[b], ys[B_REF], T * D),
                         "attnres_mix T=%lld D=%lld n_bank=%d: %s != ref", (long long)T,
                         (long long)D, nb, k_be_label[b]);
            K3_CHECK_OK(run_attnres_mix(BE(B_CPU4), bank, nb, p, w, T, D, 1e-5f, p));
            K3_CHECK(same_f(p, ys[B_REF], T * D), "attnres_mix T=%lld n_bank=%d in place != ref",
                     (long long)T, nb);
            free(bank), free(p), free(w);
            ys_free(ys);
        }
}
static void test_short_conv(void) {
    const int64_t P = 6, n = 11;
    const int K = 4, km1 = K - 1;
    float *in = fa(n * P), *w = fa(P * K), *st0 = fa(km1 * P), *ys[B_COUNT], *ss[B_COUNT];
    double *od = da(n * P);
    fill_randn(in, n * P, 1.0f);
    fill_randn(w, P * K, 0.5f);
    fill_randn(st0, km1 * P, 1.0f);
    /* float64: ext = state ++ in; out[t, c] = Σ_j w[c, j]·ext[t + j][c]; new state = the last
       K-1 rows of ext */
    float *ext = fa((km1 + n) * P);
    memcpy(ext, st0, FB(km1 * P));
    memcpy(ext + km1 * P, in, FB(n * P));
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = 0; c < P; c++) {
            double s = 0;
            for (int j = 0; j < K; j++) s += (double)w[c * K + j] * ext[(t + j) * P + c];
            od[t * P + c] = s;
        }
    ys_alloc(ys, n * P);
    for (int b = 0; b < B_COUNT; b++) {
        ss[b] = fcopy(st0, km1 * P);
        K3_CHECK_OK(run_short_conv(BE(b), in, n, P, K, w, ss[b], ys[b]));
        K3_CHECK(same_f(ss[b], ext + n * P, km1 * P),
                 "short_conv (%s): state is not the last K-1 "
                 "inputs",
                 k_be_label[b]);
    }
    K3_CHECK(rel_l2_d(ys[B_REF], od, n * P) < K3_TOL_OP_REL_L2, "short_conv vs float64: %g",
             rel_l2_d(ys[B_REF], od, n * P));
    K3_CHECK(nondegenerate(ys[B_REF], n * P), "short_conv output degenerate");
    check_cpu_is_ref(ys, n * P, "short_conv");
    check_family(ys, n * P, "short_conv");
    /* state carry: calls of n1 + n2 + ... tokens == one call of n tokens, bit for bit (output
       and final state), including calls shorter than K-1 and empty calls */
    static const int64_t splits[][6] = {{3, 8},   {1, 10}, {1, 1, 9}, {2, 0, 9}, {1, 1, 1, 1, 1, 6},
                                        {5, 2, 4}};
    for (size_t si = 0; si < K3_ARRAY_LEN(splits); si++)
        for (int b = 0; b < B_COUNT; b++) {
            float *st = fcopy(st0, km1 * P), *o = fa(n * P);
            int64_t t0 = 0;
            for (int p = 0; p < 6 && t0 < n; p++) {
                int64_t m = splits[si][p];
                K3_CHECK_OK(run_short_conv(BE(b), in + t0 * P, m, P, K, w, st, o + t0 * P));
                t0 += m;
            }
            K3_CHECK(t0 == n && same_f(o, ys[b], n * P) && same_f(st, ss[b], km1 * P),
                     "short_conv split %zu (%s): pieces != one call", si, k_be_label[b]);
            free(st), free(o);
        }
    /* hand case: P = 1, K = 3, w = (1, 10, 100), state (1, 2); in (3), then (4):
       out = 1·1 + 10·2 + 100·3 = 321, state (2, 3); then 2 + 30 + 400 = 432, state (3, 4) */
    for (int b = 0; b < B_COUNT; b++) {
        float hw[3] = {1, 10, 100}, hs[2] = {1, 2}, x3 = 3, x4 = 4, o3, o4;
        K3_CHECK_OK(run_short_conv(BE(b), &x3, 1, 1, 3, hw, hs, &o3));
        K3_CHECK(o3 == 321.0f && hs[0] == 2.0f && hs[1] == 3.0f, "short_conv hand 1 (%s)",
                 k_be_label[b]);
        K3_CHECK_OK(run_short_conv(BE(b), &x4, 1, 1, 3, hw, hs, &o4));
        K3_CHECK(o4 == 432.0f && hs[0] == 3.0f && hs[1] == 4.0f, "short_conv hand 2 (%s)",
                 k_be_label[b]);
    }
    for (int b = 0; b < B_COUNT; b++) free(ss[b]);
    free(in), free(w), free(st0), free(ext), free(od);
    ys_free(ys);
    short_conv_split_case();
}

static void test_kda_gate(void) {
    /* T·H·dk = 8192: above the cpu's per-token parallel threshold */
    const int64_t T = 64;
    const int H = 4, dk = 32;
    const int64_t P = (int64_t)H * dk;
    float *r0 = fa(T * P), *dtb = fa(P), *alog = fa(H), *ys[B_COUNT], *y1 = fa(T * P);
    double *yd = da(T * P);
    fill_randn(r0, T * P, 3.0f);
    fill_randn(dtb, P, 1.0f);
    fill_randn(alog, H, 0.5f);
    for (int64_t i = 0; i < 40; i++) { /* both softplus branches: v > 20 and very negative */
        r0[rand_below(T * P)] = 30.0f;
        r0[rand_below(T * P)] = -30.0f;
    }
    for (int form = 0; form < 2; form++) {
        const bool lbf = form == 1;
        const float lb = -5.0f;
        for (int64_t t = 0; t < T; t++)
            for (int h = 0; h < H; h++) {
                double a = exp((double)alog[h]);
                for (int i = 0; i < dk; i++) {
                    int64_t c = (int64_t)h * dk + i;
                    double v = (double)r0[t * P + c] + dtb[c];
                    yd[t * P + c] = lbf ? lb * sigd(a * v) : -a * log1p(exp(v));
                }
            }
        ys_alloc(ys, T * P);
        for (int b = 0; b < B_COUNT; b++) {
            memcpy(ys[b], r0, FB(T * P));
            K3_CHECK_OK(run_kda_gate(BE(b), ys[b], dtb, alog, T, H, dk, lbf, lb));
        }
        K3_CHECK(rel_l2_d(ys[B_REF], yd, T * P) < K3_TOL_OP_REL_L2,
                 "kda_gate (%s form) vs float64: %g", lbf ? "lower-bound" : "softplus",
                 rel_l2_d(ys[B_REF], yd, T * P));
        K3_CHECK(all_finite(ys[B_REF], T * P) && nondegenerate(ys[B_REF], T * P),
                 "kda_gate output");
        for (int b = B_CPU1; b < B_COUNT; b++) /* cpu: a vector sigmoid in the lower-bound form */
            K3_CHECK(rel_l2_d(ys[b], yd, T * P) < K3_TOL_OP_REL_L2, "kda_gate (%s, %s) vs f64: %g",
                     k_be_label[b], lbf ? "lower-bound" : "softplus", rel_l2_d(ys[b], yd, T * P));
        if (!lbf) check_cpu_is_ref(ys, T * P, "kda_gate");
        check_family(ys, T * P, "kda_gate");
        /* one token at a time (the serial path) == one call (the pool) */
        memcpy(y1, r0, FB(T * P));
        for (int64_t t = 0; t < T; t++)
            K3_CHECK_OK(run_kda_gate(BE(B_CPU4), y1 + t * P, dtb, alog, 1, H, dk, lbf, lb));
        K3_CHECK(same_f(y1, ys[B_CPU1], T * P), "kda_gate depends on T");
        ys_free(ys);
    }
    /* hand: r = dt_bias = a_log = 0 -> a = 1: −softplus(0) = −ln 2, lb·σ(0) = lb/2; v = 30 > 20:
       softplus(v) = v exactly */
    for (int b = 0; b < B_COUNT; b++) {
        float r[2] = {0.0f, 30.0f}, z2[2] = {0, 0}, z1[1] = {0};
        K3_CHECK_OK(run_kda_gate(BE(b), r, z2, z1, 1, 1, 2, false, 0.0f));
        K3_CHECK(fabs(r[0] + log(2.0)) < K3_TOL_OP_REL_L2 * log(2.0) && r[1] == -30.0f,
                 "kda_gate softplus hand (%s): %.9g %.9g", k_be_label[b], r[0], r[1]);
        r[0] = 0.0f;
        K3_CHECK_OK(run_kda_gate(BE(b), r, z2, z1, 1, 1, 1, true, -5.0f));
        K3_CHECK(r[0] == -2.5f, "kda_gate lower-bound hand (%s): %g", k_be_label[b], r[0]);
    }
    free(r0), free(dtb), free(alog), free(y1), free(yd);
}

/* ---- AttnRes -------------------------------------------------------------------------------- */
static void test_attnres_mix(void) {
    const int64_t T = 3, D = 64;
    for (int nb = 0; nb <= 4; nb++) {
        float *bank = fa((nb ? nb : 1) * T * D), *p = fa(T * D), *w = fa(D), *ys[B_COUNT];
        double *yd = da(T * D);
        fill_randn(bank, nb * T * D, 1.0f);
        fill_randn(p, T * D, 3.0f);
        fill_randn(w, D, 0.5f);
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
        ys_alloc(ys, T * D);
        for (int b = 0; b < B_COUNT; b++)
            K3_CHECK_OK(run_attnres_mix(BE(b), bank, nb, p, w, T, D, 1e-5f, ys[b]));
        K3_CHECK(rel_l2_d(ys[B_REF], yd, T * D) < K3_TOL_OP_REL_L2, "attnres_mix n_bank=%d: %g", nb,
                 rel_l2_d(ys[B_REF], yd, T * D));
        check_cpu_is_ref(ys, T * D, "attnres_mix");
        check_family(ys, T * D, "attnres_mix");
        if (nb == 0) K3_CHECK(same_f(ys[B_REF], p, T * D), "mix of one source = itself");
        /* one token at a time (the bank re-laid out as [N, 1, D]) */
        float *bt = fa((nb ? nb : 1) * D), *y1 = fa(T * D);
        for (int64_t t = 0; t < T; t++) {
            for (int i = 0; i < nb; i++) memcpy(bt + i * D, bank + (i * T + t) * D, FB(D));
            K3_CHECK_OK(run_attnres_mix(BE(B_CPU4), bt, nb, p + t * D, w, 1, D, 1e-5f, y1 + t * D));
        }
        K3_CHECK(same_f(y1, ys[B_CPU1], T * D), "attnres_mix depends on T");
        /* in place (out aliases p), on cpu and on guard */
        float *pg = fcopy(p, T * D);
        K3_CHECK_OK(run_attnres_mix(BE(B_GUARD), bank, nb, pg, w, T, D, 1e-5f, pg));
        K3_CHECK(same_f(ys[B_CPU1], pg, T * D), "attnres in place (guard)");
        K3_CHECK_OK(run_attnres_mix(BE(B_CPU2), bank, nb, p, w, T, D, 1e-5f, p));
        K3_CHECK(same_f(ys[B_REF], p, T * D), "attnres in place");
        free(bank), free(p), free(w), free(yd), free(bt), free(y1), free(pg);
        ys_free(ys);
    }
    attnres_split_case();
    attnres_sweep();
}

/* ---- KDA ------------------------------------------------------------------------------------ */
static kda_in make_kda(int64_t n, int H, int dk, int dv, float g_lo, float g_hi) {
    kda_in in = {
        n, H, dk, dv, fa(n * H * dk), fa(n * H * dk), fa(n * H * dv), fa(n * H * dk), fa(n * H)};
    fill_randn(in.q, n * H * dk, 1.0f);
    fill_randn(in.k, n * H * dk, 1.0f);
    fill_randn(in.v, n * H * dv, 1.0f);
    K3_CHECK_OK(run_l2norm(BE(B_REF), in.q, n * H, dk, 1e-6f, in.q));
    K3_CHECK_OK(run_l2norm(BE(B_REF), in.k, n * H, dk, 1e-6f, in.k));
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
    /* dk not a multiple of a vector; dv = 83 > 64 columns: two column tasks per head, and on
       AVX-512 (AVX2) a 4-vector block, single vectors and 3 scalar tail columns */
    const int H = 3, dk = 20, dv = 83;
    const int64_t n = 40, nS = (int64_t)H * dk * dv, no = n * H * dv;
    kda_in in = make_kda(n, H, dk, dv, -5.0f, 0.0f);
    float scale = 1.0f / sqrtf((float)dk);
    float *ys[B_COUNT], *Ss[B_COUNT], *oc = fa(no), *Sc = calloc((size_t)nS, sizeof(float));
    double *M = calloc((size_t)nS, sizeof(double)), *od = da(no), *Sd = da(nS);
    kda_f64(&in, scale, M, od);
    for (int h = 0; h < H; h++) /* M = Sᵀ per head */
        for (int i = 0; i < dk; i++)
            for (int j = 0; j < dv; j++)
                Sd[((int64_t)h * dk + i) * dv + j] = M[((int64_t)h * dv + j) * dk + i];
    ys_alloc(ys, no);
    for (int b = 0; b < B_COUNT; b++) {
        Ss[b] = calloc((size_t)nS, sizeof(float));
        K3_CHECK_OK(run_kda(BE(b), &in, 0, n, scale, Ss[b], ys[b], 0, NULL));
        double eo = rel_l2_d(ys[b], od, no), es = rel_l2_d(Ss[b], Sd, nS);
        K3_CHECK(eo < K3_TOL_KDA_REL_L2 && es < K3_TOL_KDA_REL_L2,
                 "kda_recurrent (%s) vs f64: out %g state %g", k_be_label[b], eo, es);
    }
    K3_CHECK(nondegenerate(ys[B_REF], no), "kda output degenerate");
    check_family(ys, no, "kda_recurrent");
    check_family(Ss, nS, "kda_recurrent state");
    /* cpu: in pieces (state carried; calls of one token among them), must equal one call
       bitwise: a token's arithmetic does not depend on its place in a call */
    const int64_t pieces[5] = {17, 1, 1, 5, n - 24};
    for (int64_t p = 0, t0 = 0; p < 5; t0 += pieces[p++])
        K3_CHECK_OK(run_kda(BE(B_CPU4), &in, t0, pieces[p], scale, Sc, oc + t0 * H * dv, 0, NULL));
    K3_CHECK(same_f(ys[B_CPU1], oc, no) && same_f(Ss[B_CPU1], Sc, nS),
             "kda cpu in pieces != cpu in one call");
    /* hand case: dk = dv = 1, S0 = 0: S1 = β k v, o1 = scale·S1·q */
    for (int b = 0; b < B_COUNT; b++) {
        float q1 = 1, k1 = 1, v1 = 2, g1 = -1, b1 = 0.5f, S1 = 0, o1;
        kda_in h = {1, 1, 1, 1, &q1, &k1, &v1, &g1, &b1};
        K3_CHECK_OK(run_kda(BE(b), &h, 0, 1, 0.5f, &S1, &o1, 0, NULL));
        K3_CHECK(S1 == 1.0f && o1 == 0.5f, "kda hand (%s): S=%g o=%g", k_be_label[b], S1, o1);
    }
    free_kda(&in);
    for (int b = 0; b < B_COUNT; b++) free(Ss[b]);
    ys_free(ys);
    free(oc), free(Sc), free(M), free(od), free(Sd);
}

static void test_kda_chunked(void) {
    /* gates pressed against the lower bound (g in (-5, -4.5)) over 256 steps, chunk 16 and 64
       (|Γ| up to 320 inside a 64-chunk: only the difference form stays finite) */
    const int H = 2, dk = 32, dv = 16;
    const int64_t n = 256 + 7, nS = (int64_t)H * dk * dv, no = n * H * dv; /* ragged tail */
    const float g_ranges[2][2] = {{-5.0f, -4.5f}, {-0.2f, 0.0f}};
    for (int gr = 0; gr < 2; gr++) {
        kda_in in = make_kda(n, H, dk, dv, g_ranges[gr][0], g_ranges[gr][1]);
        float scale = 1.0f / sqrtf((float)dk);
        float *S0 = calloc((size_t)nS, sizeof(float)), *o0 = fa(no);
        K3_CHECK_OK(run_kda(BE(B_REF), &in, 0, n, scale, S0, o0, 0, NULL));
        const int Cs[3] = {16, 64, 5};
        for (int ci = 0; ci < 3; ci++) {
            const int C = Cs[ci];
            const int64_t nw = (int64_t)H * (int64_t)k3_kda_chunk_work_floats(C, dk, dv);
            float *work = fa(nw), *ys[B_COUNT], *Ss[B_COUNT];
            ys_alloc(ys, no);
            for (int bk = 0; bk < B_COUNT; bk++) {
                Ss[bk] = calloc((size_t)nS, sizeof(float));
                K3_CHECK_OK(run_kda(BE(bk), &in, 0, n, scale, Ss[bk], ys[bk], C, work));
                K3_CHECK(all_finite(ys[bk], no) && all_finite(Ss[bk], nS),
                         "kda_chunked C=%d: NaN/inf", C);
                double eo = k3_rel_l2(ys[bk], o0, (size_t)no),
                       es = k3_rel_l2(Ss[bk], S0, (size_t)nS);
                K3_CHECK(eo < K3_TOL_KDA_CHUNK_REL_L2 && es < K3_TOL_KDA_CHUNK_REL_L2,
                         "kda_chunked (%s) C=%d g~%g: out %.3g state %.3g vs recurrent",
                         k_be_label[bk], C, g_ranges[gr][0], eo, es);
            }
            /* cpu runs ref's whole chunks (its own recurrence only for the tail) */
            K3_CHECK(same_f(ys[B_CPU1], ys[B_REF], n / C * C * H * dv),
                     "kda_chunked C=%d: cpu != ref on the whole chunks", C);
            check_family(ys, no, "kda_chunked");
            check_family(Ss, nS, "kda_chunked state");
            /* split at a multiple of C (the same chunks): bit-identical */
            const int64_t n1 = 130 / C * C;
            float *S1 = calloc((size_t)nS, sizeof(float)), *o1 = fa(no);
            K3_CHECK_OK(run_kda(BE(B_CPU4), &in, 0, n1, scale, S1, o1, C, work));
            K3_CHECK_OK(run_kda(BE(B_CPU4), &in, n1, n - n1, scale, S1, o1 + n1 * H * dv, C, work));
            K3_CHECK(same_f(o1, ys[B_CPU1], no) && same_f(S1, Ss[B_CPU1], nS),
                     "kda_chunked C=%d: split at %lld differs", C, (long long)n1);
            for (int bk = 0; bk < B_COUNT; bk++) free(Ss[bk]);
            ys_free(ys);
            free(work), free(S1), free(o1);
        }
        free_kda(&in);
        free(S0), free(o0);
    }
}

/* ---- latent attention ---------------------------------------------------------------------- */
/* float64: o[j, h] = Σ_k softmax_k(scale·qc[j, h]·cache[k]) cache[k][0:Rkv], k <= pos0 + j. */
static void attn_causal_f64(const float *qc, const float *cache, int64_t pos0, int64_t n_q, int H,
                            int W, int Rkv, double scale, double *o) {
    double *s = da(pos0 + n_q);
    for (int64_t j = 0; j < n_q; j++)
        for (int h = 0; h < H; h++) {
            const float *q = qc + (j * H + h) * W;
            const int64_t n = pos0 + j + 1;
            double mx = -1e300, z = 0;
            for (int64_t k = 0; k < n; k++) {
                double d = 0;
                for (int i = 0; i < W; i++) d += (double)q[i] * cache[k * W + i];
                s[k] = d * scale;
                mx = s[k] > mx ? s[k] : mx;
            }
            for (int64_t k = 0; k < n; k++) z += (s[k] = exp(s[k] - mx));
            for (int i = 0; i < Rkv; i++) {
                double acc = 0;
                for (int64_t k = 0; k < n; k++) acc += s[k] / z * cache[k * W + i];
                o[(j * H + h) * Rkv + i] = acc;
            }
        }
    free(s);
}
static void test_attn_latent(void) {
    const int H = 4, Rkv = 24, dr = 8, W = Rkv + dr;
    const int64_t n_ctx = 300; /* five key blocks, the last one partial */
    float *qc = fa((int64_t)H * W), *cache = fa(n_ctx * W), *ys[B_COUNT],
          *oc = fa((int64_t)H * Rkv);
    float *work = fa((int64_t)H * n_ctx);
    double *od = da((int64_t)H * Rkv);
    fill_randn(qc, (int64_t)H * W, 1.0f);
    fill_randn(cache, n_ctx * W, 1.0f);
    float scale = 0.3f;
    attn_causal_f64(qc, cache, n_ctx - 1, 1, H, W, Rkv, scale, od); /* one query */
    ys_alloc(ys, (int64_t)H * Rkv);
    for (int b = 0; b < B_COUNT; b++)
        K3_CHECK_OK(run_attn_latent(BE(b), qc, cache, n_ctx, H, W, Rkv, scale, ys[b], work));
    for (int b = 0; b < B_COUNT; b++) /* cpu: the ISA's tiles (kernels/cpu/kern_attn.h) */
        K3_CHECK(rel_l2_d(ys[b], od, (int64_t)H * Rkv) < K3_TOL_OP_REL_L2,
                 "attn_latent (%s) vs f64 %g", k_be_label[b],
                 rel_l2_d(ys[b], od, (int64_t)H * Rkv));
    check_family(ys, (int64_t)H * Rkv, "attn_latent");
    /* one cached token: output = its latent */
    for (int b = 0; b < B_COUNT; b++) {
        K3_CHECK_OK(run_attn_latent(BE(b), qc, cache, 1, H, W, Rkv, scale, oc, work));
        K3_CHECK(same_f(oc, cache, Rkv), "attn over one token (%s)", k_be_label[b]);
    }
    free(qc), free(cache), free(oc), free(work), free(od);
    ys_free(ys);
}

/* attn_latent_causal: n_q queries from position pos0 over the prefix of the cache each owns. */
static k3_status run_attn_causal(k3_backend *be, const float *qc, const float *cache, int64_t pos0,
                                 int64_t n_q, int H, int W, int Rkv, float scale, float *o_lat,
                                 float *work) {
    mshl m = {.be = be};
    const float *dq = m_buf(&m, qc, FB(n_q * H * W), false),
                *dc = m_buf(&m, cache, FB((pos0 + n_q) * W), false);
    float *dO = m_buf(&m, o_lat, FB(n_q * H * Rkv), true),
          *dw = m_buf(&m, work, FB(k3_attn_latent_causal_work_floats(pos0 + n_q, H)), true);
    return m_done(&m, be->ops->attn_latent_causal(be, dq, dc, pos0, n_q, H, W, Rkv, scale, dO, dw));
}
static void test_attn_latent_causal(void) {
    /* Rkv not a multiple of any vector (60 = 3·16 + 12 = 7·8 + 4), contexts 38..209 (several key
       blocks, pos0 not on a block boundary), H = 5 (tiles cut between a query's heads); a second
       shape with many heads (H = 52 > one tile; decode: head groups); the third with scores
       spread wide (sd ~25: the running max moves and most terms underflow). The last two reach
       past the 256-key superblocks (kern_attn.h): contexts 231..560 and 1..600 (wide scores, so
       a later superblock's max can win the merge); a decode step there splits its superblocks
       over the pool at 2 and 4 threads, against one tile walking them at 1 thread. */
    static const struct {
        int H, Rkv, dr;
        int64_t pos0, n_q;
        float sd, scale;
    } cs[5] = {{5, 60, 12, 37, 172, 1.0f, 0.3f},
               {52, 24, 8, 70, 11, 1.0f, 0.25f},
               {3, 33, 7, 0, 130, 3.0f, 0.7f},
               {5, 60, 12, 230, 330, 1.0f, 0.3f},
               {3, 33, 7, 0, 600, 3.0f, 0.7f}};
    for (int ci = 0; ci < 5; ci++) {
        const int H = cs[ci].H, Rkv = cs[ci].Rkv, W = Rkv + cs[ci].dr;
        const int64_t pos0 = cs[ci].pos0, n_q = cs[ci].n_q, n_ctx = pos0 + n_q;
        const int64_t nq = n_q * H * W, no = n_q * H * Rkv, row = (int64_t)H * Rkv;
        const float scale = cs[ci].scale;
        float *qc = fa(nq), *cache = fa(n_ctx * W), *ys[B_COUNT], *oc = fa(no);
        float *work = fa((int64_t)k3_attn_latent_causal_work_floats(n_ctx, H));
        double *od = da(no);
        fill_randn(qc, nq, cs[ci].sd);
        fill_randn(cache, n_ctx * W, 1.0f);
        attn_causal_f64(qc, cache, pos0, n_q, H, W, Rkv, scale, od);
        ys_alloc(ys, no);
        for (int b = 0; b < B_COUNT; b++) {
            K3_CHECK_OK(
                run_attn_causal(BE(b), qc, cache, pos0, n_q, H, W, Rkv, scale, ys[b], work));
            K3_CHECK(all_finite(ys[b], no) && rel_l2_d(ys[b], od, no) < K3_TOL_OP_REL_L2,
                     "attn_latent_causal case %d (%s) vs f64 %g", ci, k_be_label[b],
                     rel_l2_d(ys[b], od, no));
        }
        K3_CHECK(nondegenerate(ys[B_REF], no), "attn_latent_causal output degenerate");
        check_family(ys, no, "attn_latent_causal"); /* threads 1/2/4 and guard */
        /* ref is attn_latent per query, bit for bit */
        for (int64_t j = 0; j < n_q; j++)
            K3_CHECK_OK(run_attn_latent(BE(B_REF), qc + j * H * W, cache, pos0 + j + 1, H, W, Rkv,
                                        scale, oc + j * row, work));
        K3_CHECK(same_f(oc, ys[B_REF], no), "ref attn_latent_causal != attn_latent per query");
        /* cpu: a query's bits depend only on its own context — one query at a time (decode, and
           through attn_latent), in uneven chunks, and as the tail of a call from position 0 */
        for (int b = B_CPU1; b <= B_CPU4; b++) {
            for (int64_t j = 0; j < n_q; j++)
                K3_CHECK_OK(run_attn_causal(BE(b), qc + j * H * W, cache, pos0 + j, 1, H, W, Rkv,
                                            scale, oc + j * row, work));
            K3_CHECK(same_f(oc, ys[B_CPU1], no), "case %d %s: decode != one call", ci,
                     k_be_label[b]);
            memset(oc, 0xff, FB(no));
            for (int64_t j = 0; j < n_q; j++)
                K3_CHECK_OK(run_attn_latent(BE(b), qc + j * H * W, cache, pos0 + j + 1, H, W, Rkv,
                                            scale, oc + j * row, work));
            K3_CHECK(same_f(oc, ys[B_CPU1], no), "case %d %s: attn_latent != one causal call", ci,
                     k_be_label[b]);
            memset(oc, 0xff, FB(no));
            const int64_t chunk[4] = {1, 13, 64, 3};
            for (int64_t j = 0, c = 0; j < n_q; j += chunk[c % 4], c++) {
                int64_t n = chunk[c % 4] < n_q - j ? chunk[c % 4] : n_q - j;
                K3_CHECK_OK(run_attn_causal(BE(b), qc + j * H * W, cache, pos0 + j, n, H, W, Rkv,
                                            scale, oc + j * row, work));
            }
            K3_CHECK(same_f(oc, ys[B_CPU1], no), "case %d %s: chunked != one call", ci,
                     k_be_label[b]);
        }
        if (pos0 > 0) { /* the whole prefill from 0: its last n_q queries are ours */
            float *qall = fa(n_ctx * H * W), *oall = fa(n_ctx * row);
            fill_randn(qall, pos0 * H * W, 1.0f);
            memcpy(qall + pos0 * H * W, qc, FB(nq));
            K3_CHECK_OK(
                run_attn_causal(BE(B_CPU2), qall, cache, 0, n_ctx, H, W, Rkv, scale, oall, work));
            K3_CHECK(same_f(oall + pos0 * row, ys[B_CPU1], no),
                     "case %d: prefill from 0 != the call from pos0", ci);
            free(qall), free(oall);
        }
        ys_free(ys);
        free(qc), free(cache), free(oc), free(work), free(od);
    }
    /* n_q = 0 touches nothing; shapes outside the contract are K3_ERR_ARG on every backend */
    float q[4] = {1, 2, 3, 4}, c[4] = {1, 2, 3, 4}, o[2] = {7, 7}, w[4];
    for (int b = 0; b < B_COUNT; b++) {
        if (b == B_GUARD) continue; /* host pointers only */
        K3_CHECK_OK(BE(b)->ops->attn_latent_causal(BE(b), q, c, 1, 0, 1, 4, 2, 1.0f, o, w));
        K3_CHECK(o[0] == 7 && o[1] == 7, "attn_latent_causal n_q = 0 wrote (%s)", k_be_label[b]);
        K3_CHECK_ERR(BE(b)->ops->attn_latent_causal(BE(b), q, c, -1, 1, 1, 4, 2, 1.0f, o, w),
                     K3_ERR_ARG, "pos0 -1");
        K3_CHECK_ERR(BE(b)->ops->attn_latent_causal(BE(b), q, c, 0, 1, 1, 4, 5, 1.0f, o, w),
                     K3_ERR_ARG, "Rkv 5");
        K3_CHECK_ERR(
            BE(b)->ops->attn_latent_causal(BE(b), q, c, 0, 1, 1, K3_ATTN_MAX_W + 1, 2, 1.0f, o, w),
            K3_ERR_ARG, "attn_latent_causal");
    }
}

/* ---- MoE routing ------------------------------------------------------------------------------
 */
/* The selection in float64, written independently of ref.c's repeated argmax: experts and
 * groups are ordered by (score descending, index ascending) with stable insertion sorts. */
#define TOPK_MAX_E 256
static void topk_f64(const float *s, const float *bias, int E, int K, int G, int TG, bool renorm,
                     double scale, int32_t *ids, double *w, int *cut_tie, int *group_cut_tie) {
    double b[TOPK_MAX_E], gs[TOPK_MAX_E];
    int gord[TOPK_MAX_E], ord[TOPK_MAX_E], n_ord = 0;
    bool keep[TOPK_MAX_E] = {false};
    const int gsz = E / G;
    K3_ASSERT(E <= TOPK_MAX_E);
    for (int e = 0; e < E; e++) b[e] = (double)s[e] + (bias ? (double)bias[e] : 0.0);
    for (int g = 0; g < G; g++) { /* the two largest biased scores of the group (ties count) */
        double m1 = -INFINITY, m2 = -INFINITY;
        for (int i = 0; i < gsz; i++) {
            double v = b[g * gsz + i];
            if (v > m1)
                m2 = m1, m1 = v;
            else if (v > m2)
                m2 = v;
        }
        gs[g] = gsz > 1 ? m1 + m2 : m1;
        int i = g;
        for (; i > 0 && gs[gord[i - 1]] < gs[g]; i--) gord[i] = gord[i - 1];
        gord[i] = g;
    }
    for (int j = 0; j < TG; j++) keep[gord[j]] = true;
    *group_cut_tie = TG < G && gs[gord[TG - 1]] == gs[gord[TG]];
    for (int e = 0; e < E; e++) {
        if (!keep[e / gsz]) continue;
        int i = n_ord++;
        for (; i > 0 && b[ord[i - 1]] < b[e]; i--) ord[i] = ord[i - 1];
        ord[i] = e;
    }
    *cut_tie = K < n_ord && b[ord[K - 1]] == b[ord[K]];
    double sum = 0;
    for (int k = 0; k < K; k++) {
        ids[k] = ord[k];
        sum += (w[k] = s[ord[k]]);
    }
    for (int k = 0; k < K; k++) w[k] = (renorm ? w[k] / (sum + 1e-20) : w[k]) * scale;
}

/* One token through every backend against hand-computed ids and weights. */
#define F(...) ((const float[]){__VA_ARGS__})
#define I(...) ((const int32_t[]){__VA_ARGS__})
static void topk_hand(const char *what, int E, int K, int G, int TG, bool renorm, float scale,
                      const float *s, const float *bias, const int32_t *want_ids,
                      const float *want_w) {
    for (int b = 0; b < B_COUNT; b++) {
        float work[8], w[3] = {NAN, NAN, NAN};
        int32_t ids[3] = {-1, -1, -1};
        K3_CHECK_OK(run_moe_topk(BE(b), s, bias, 1, E, K, G, TG, renorm, scale, work, ids, w));
        bool ok = true;
        for (int k = 0; k < K; k++) ok = ok && ids[k] == want_ids[k] && w[k] == want_w[k];
        K3_CHECK(ok, "moe_topk hand '%s' (%s): ids %d %d %d w %.9g %.9g %.9g", what, k_be_label[b],
                 ids[0], ids[1], ids[2], w[0], w[1], w[2]);
    }
}

static void test_moe_topk(void) {
    /* hand cases (exact binary fractions) */
    topk_hand("ties -> lower index", 4, 2, 1, 1, false, 1.0f, F(0.5f, 0.75f, 0.5f, 0.75f), NULL,
              I(1, 3), F(0.75f, 0.75f));
    const float third = (float)(1.0 / 3.0); /* 0.25f / 0.75f, correctly rounded */
    topk_hand("all tied", 4, 3, 1, 1, true, 1.0f, F(0.25f, 0.25f, 0.25f, 0.25f), NULL, I(0, 1, 2),
              F(third, third, third));
    /* group scores (sum of the two best) 0.9375, 1.0, 0.5, 0.25: the best expert's group loses */
    topk_hand("group by two best", 8, 2, 4, 1, true, 2.0f,
              F(0.875f, 0.0625f, 0.5f, 0.5f, 0.25f, 0.25f, 0.125f, 0.125f), NULL, I(2, 3),
              F(1.0f, 1.0f));
    /* group scores 0.75, 0.75, 0.75, 0.25: groups 0 and 1 win the tie; expert 4 (0.5) is out */
    topk_hand("group ties -> lower group", 8, 2, 4, 2, false, 1.0f,
              F(0.5f, 0.25f, 0.25f, 0.5f, 0.5f, 0.25f, 0.125f, 0.125f), NULL, I(0, 3),
              F(0.5f, 0.5f));
    /* the bias selects (0.75 > 0.5), the weight is the unbiased score */
    topk_hand("bias selects", 2, 1, 1, 1, true, 2.5f, F(0.5f, 0.25f), F(0.0f, 0.5f), I(1), F(2.5f));
    topk_hand("bias, no renorm", 2, 1, 1, 1, false, 2.5f, F(0.5f, 0.25f), F(0.0f, 0.5f), I(1),
              F(0.625f));
    topk_hand("no bias", 2, 1, 1, 1, true, 2.5f, F(0.5f, 0.25f), NULL, I(0), F(2.5f));

    /* random cases on a grid (scores k/32, bias m/64: every sum exact in fp32 and float64, so
       ties are exact and frequent) against the float64 selection */
    static const struct {
        int E, K, G, TG;
        bool bias, renorm;
        float scale;
    } cf[] = {
        {64, 6, 1, 1, false, true, 1.0f},  {64, 8, 8, 4, true, true, 2.5f},
        {64, 6, 8, 3, true, false, 1.5f},  {16, 3, 16, 4, true, true, 1.0f}, /* 1 expert/group */
        {64, 4, 4, 4, false, false, 1.0f},                                   /* all groups kept */
    };
    const int64_t T = 600; /* T·E above the cpu's per-token parallel threshold */
    for (size_t c = 0; c < K3_ARRAY_LEN(cf); c++) {
        const int E = cf[c].E, K = cf[c].K, G = cf[c].G, TG = cf[c].TG;
        float *s = fa(T * E), *bias = fa(E), *work = fa(T * E), *ws[B_COUNT], *w1 = fa(T * K);
        int32_t *ids[B_COUNT], *idd = malloc((size_t)(T * K) * sizeof(int32_t)),
                               *id1 = malloc((size_t)(T * K) * sizeof(int32_t));
        double *wd = da(T * K);
        for (int64_t i = 0; i < T * E; i++) s[i] = (float)(1 + rand_below(31)) / 32.0f;
        for (int e = 0; e < E; e++) bias[e] = (float)(rand_below(33) - 16) / 64.0f;
        const float *bp = cf[c].bias ? bias : NULL;
        int n_cut_ties = 0, n_group_ties = 0;
        for (int64_t t = 0; t < T; t++) {
            int ct, gt;
            topk_f64(s + t * E, bp, E, K, G, TG, cf[c].renorm, cf[c].scale, idd + t * K, wd + t * K,
                     &ct, &gt);
            n_cut_ties += ct, n_group_ties += gt;
        }
        ys_alloc(ws, T * K);
        for (int b = 0; b < B_COUNT; b++) {
            ids[b] = malloc((size_t)(T * K) * sizeof(int32_t));
            K3_CHECK_OK(run_moe_topk(BE(b), s, bp, T, E, K, G, TG, cf[c].renorm, cf[c].scale, work,
                                     ids[b], ws[b]));
        }
        int64_t bad_ids = 0, bad_w = 0;
        for (int64_t i = 0; i < T * K; i++) {
            bad_ids += ids[B_REF][i] != idd[i];
            bad_w += !cf[c].renorm && ws[B_REF][i] != (float)wd[i];
        }
        K3_CHECK(bad_ids == 0,
                 "moe_topk case %zu: %lld of %lld slots select another expert than "
                 "the float64 selection",
                 c, (long long)bad_ids, (long long)(T * K));
        if (cf[c].renorm)
            K3_CHECK(rel_l2_d(ws[B_REF], wd, T * K) < K3_TOL_OP_REL_L2,
                     "moe_topk case %zu weights vs float64: %g", c, rel_l2_d(ws[B_REF], wd, T * K));
        else
            K3_CHECK(bad_w == 0, "moe_topk case %zu: %lld weights != σ·scale (exact)", c,
                     (long long)bad_w);
        /* the grid must make the tie rules matter (else this case tests nothing about them) */
        K3_CHECK(n_cut_ties > T / 20 && (G == 1 || TG == G || n_group_ties > T / 50),
                 "moe_topk case %zu: only %d expert / %d group ties at the cut", c, n_cut_ties,
                 n_group_ties);
        check_cpu_is_ref(ws, T * K, "moe_topk w");
        K3_CHECK(memcmp(ids[B_CPU1], ids[B_REF], (size_t)(T * K) * sizeof(int32_t)) == 0,
                 "moe_topk ids: cpu != ref");
        check_family(ws, T * K, "moe_topk w");
        check_family_i32(ids, T * K, "moe_topk ids");
        /* one token at a time == one call */
        for (int64_t t = 0; t < T; t++)
            K3_CHECK_OK(run_moe_topk(BE(B_CPU1), s + t * E, bp, 1, E, K, G, TG, cf[c].renorm,
                                     cf[c].scale, work + t * E, id1 + t * K, w1 + t * K));
        K3_CHECK(same_f(w1, ws[B_CPU4], T * K) &&
                     memcmp(id1, ids[B_CPU4], (size_t)(T * K) * sizeof(int32_t)) == 0,
                 "moe_topk depends on T");
        /* a non-finite score fails only its token (issue 34): ids 0..K-1 and NaN weights there,
           every other token as before (also when the pool runs the tokens) */
        s[300 * E + 7] = NAN;
        s[500 * E + 2] = INFINITY;
        for (int b = 0; b < B_COUNT; b++) { /* against this backend's run without them */
            memcpy(id1, ids[b], (size_t)(T * K) * sizeof(int32_t));
            memcpy(w1, ws[b], (size_t)(T * K) * sizeof(float));
            K3_CHECK_OK(run_moe_topk(BE(b), s, bp, T, E, K, G, TG, cf[c].renorm, cf[c].scale, work,
                                     ids[b], ws[b]));
            int64_t wrong = 0;
            for (int64_t t = 0; t < T; t++)
                for (int k = 0; k < K; k++) {
                    const int64_t i = t * K + k;
                    wrong += t == 300 || t == 500 ? ids[b][i] != k || !isnan(ws[b][i])
                                                  : ids[b][i] != id1[i] || ws[b][i] != w1[i];
                }
            K3_CHECK(wrong == 0, "moe_topk backend %d: %lld slots wrong around 2 bad tokens", b,
                     (long long)wrong);
        }
        for (int b = 0; b < B_COUNT; b++) free(ids[b]);
        ys_free(ws);
        free(s), free(bias), free(work), free(w1), free(idd), free(id1), free(wd);
    }
    /* a non-finite bias makes the biased score non-finite (NaN weights); bad shapes are argument
       errors */
    float s4[8] = {0.5f, 0.25f, 0.75f, 0.125f, 0.5f, 0.5f, 0.5f, 0.5f},
          b4[4] = {0, 0, -INFINITY, 0}, work[8], w[8]; /* K <= 5 in the error cases */
    int32_t id[8];
    for (int b = 0; b < B_COUNT; b++) {
        K3_CHECK_OK(run_moe_topk(BE(b), s4, b4, 2, 4, 1, 1, 1, true, 1.0f, work, id, w));
        K3_CHECK(id[0] == 0 && id[1] == 0 && isnan(w[0]) && isnan(w[1]),
                 "moe_topk backend %d: a -inf bias: NaN weights", b);
        K3_CHECK_ERR(run_moe_topk(BE(b), s4, NULL, 1, 4, 5, 1, 1, true, 1.0f, work, id, w),
                     K3_ERR_ARG, "moe_topk");
        K3_CHECK_ERR(run_moe_topk(BE(b), s4, NULL, 1, 4, 1, 3, 1, true, 1.0f, work, id, w),
                     K3_ERR_ARG, "moe_topk");
        K3_CHECK_ERR(run_moe_topk(BE(b), s4, NULL, 1, 4, 2, 2, 3, true, 1.0f, work, id, w),
                     K3_ERR_ARG, "moe_topk");
        /* topk_group · group size < K: not enough experts survive the group cut */
        K3_CHECK_ERR(run_moe_topk(BE(b), s4, NULL, 1, 4, 3, 2, 1, true, 1.0f, work, id, w),
                     K3_ERR_ARG, "moe_topk");
    }
}

#undef F
#undef I

/* ---- rows -------------------------------------------------------------------------------------
 */
static void test_rows_gather(void) {
    const int64_t width = 37, n_src = 20, n = 7;
    const int64_t idx[7] = {3, 0, 19, 3, 7, 19, 11}; /* repeats allowed */
    float *src = fa(n_src * width), *ys[B_COUNT], *y1 = fa(n * width);
    fill_randn(src, n_src * width, 1.0f);
    ys_alloc(ys, n * width);
    for (int b = 0; b < B_COUNT; b++) {
        K3_CHECK_OK(run_rows_gather(BE(b), src, width, idx, n, ys[b]));
        bool ok = true;
        for (int64_t j = 0; j < n; j++)
            ok = ok && same_f(ys[b] + j * width, src + idx[j] * width, width);
        K3_CHECK(ok, "rows_gather (%s): dst[j] != src[idx[j]]", k_be_label[b]);
    }
    check_family(ys, n * width, "rows_gather");
    K3_CHECK_OK(run_rows_gather(BE(B_CPU4), src, width, idx, 2, y1));
    K3_CHECK_OK(run_rows_gather(BE(B_CPU4), src, width, idx + 2, n - 2, y1 + 2 * width));
    K3_CHECK_OK(run_rows_gather(BE(B_CPU4), src, width, idx, 0, y1));
    K3_CHECK(same_f(y1, ys[B_CPU1], n * width), "rows_gather: split differs / n = 0 wrote");
    free(src), free(y1);
    ys_free(ys);
    /* a prefill's size (the cpu backend splits the rows over its pool): 700 rows of 768 */
    const int64_t bw = 768, bn = 700, bsrc = 333;
    int64_t *bidx = malloc((size_t)bn * sizeof *bidx);
    float *bs = fa(bsrc * bw), *by = fa(bn * bw);
    fill_randn(bs, bsrc * bw, 1.0f);
    for (int64_t j = 0; j < bn; j++) bidx[j] = (j * 97 + 5) % bsrc;
    for (int b = 0; b < B_COUNT; b++) {
        memset(by, 0xff, FB(bn * bw)); /* NaN: a row left unwritten fails */
        K3_CHECK_OK(run_rows_gather(BE(b), bs, bw, bidx, bn, by));
        bool ok = true;
        for (int64_t j = 0; j < bn; j++) ok = ok && same_f(by + j * bw, bs + bidx[j] * bw, bw);
        K3_CHECK(ok, "rows_gather 700 x 768 (%s): dst[j] != src[idx[j]]", k_be_label[b]);
    }
    free(bidx), free(bs), free(by);
}

static void test_rows_scatter(void) {
    const int64_t width = 37, n_dst = 20, n = 6;
    const int64_t idx[6] = {12, 0, 19, 4, 7, 5}; /* distinct */
    float *src = fa(n * width), *init = fa(n_dst * width), *ys[B_COUNT], *y1 = fa(n_dst * width);
    fill_randn(src, n * width, 1.0f);
    fill_randn(init, n_dst * width, 1.0f);
    ys_alloc(ys, n_dst * width);
    for (int b = 0; b < B_COUNT; b++) {
        memcpy(ys[b], init, FB(n_dst * width));
        K3_CHECK_OK(run_rows_scatter(BE(b), src, width, idx, n, ys[b]));
        bool ok = true;
        for (int64_t r = 0; r < n_dst; r++) {
            const float *want = init + r * width;
            for (int64_t j = 0; j < n; j++)
                if (idx[j] == r) want = src + j * width;
            ok = ok && same_f(ys[b] + r * width, want, width);
        }
        K3_CHECK(ok, "rows_scatter (%s): dst[idx[j]] != src[j] or another row written",
                 k_be_label[b]);
    }
    check_family(ys, n_dst * width, "rows_scatter");
    memcpy(y1, init, FB(n_dst * width));
    K3_CHECK_OK(run_rows_scatter(BE(B_CPU4), src, width, idx, 4, y1));
    K3_CHECK_OK(run_rows_scatter(BE(B_CPU4), src + 4 * width, width, idx + 4, n - 4, y1));
    K3_CHECK_OK(run_rows_scatter(BE(B_CPU4), src, width, idx, 0, y1));
    K3_CHECK(same_f(y1, ys[B_CPU1], n_dst * width), "rows_scatter: split differs / n = 0 wrote");
    free(src), free(init), free(y1);
    ys_free(ys);
    /* a prefill's size (split over the pool): 700 rows of 768 into 900, the others untouched */
    const int64_t bw = 768, bn = 700, bdst = 900;
    int64_t *bidx = malloc((size_t)bn * sizeof *bidx);
    float *bs = fa(bn * bw), *binit = fa(bdst * bw), *by = fa(bdst * bw), *bwant = fa(bdst * bw);
    fill_randn(bs, bn * bw, 1.0f);
    fill_randn(binit, bdst * bw, 1.0f);
    memcpy(bwant, binit, FB(bdst * bw));
    for (int64_t j = 0; j < bn; j++) { /* distinct: 7 is coprime with 900 */
        bidx[j] = (j * 7 + 3) % bdst;
        memcpy(bwant + bidx[j] * bw, bs + j * bw, FB(bw));
    }
    for (int b = 0; b < B_COUNT; b++) {
        memcpy(by, binit, FB(bdst * bw));
        K3_CHECK_OK(run_rows_scatter(BE(b), bs, bw, bidx, bn, by));
        K3_CHECK(same_f(by, bwant, bdst * bw),
                 "rows_scatter 700 x 768 (%s): dst[idx[j]] != src[j] or another row written",
                 k_be_label[b]);
    }
    free(bidx), free(bs), free(binit), free(by), free(bwant);
}

/* rows_wsum's contract in fp32, written plainly: the first term initialises, then += in i
 * order. Used on data whose products w·x are exact, so it is the one correct answer whatever the
 * compiler does with a·b + c. reverse = the same sum in the opposite order (to show that the
 * data is order-sensitive). */
static void wsum_in_order(const float *x, const float *w, const int64_t *seg, int64_t seg_len,
                          int64_t n_seg, int64_t width, bool reverse, float *y) {
    for (int64_t j = 0; j < n_seg; j++) {
        const int64_t i0 = seg ? seg[j] : j * seg_len, i1 = seg ? seg[j + 1] : (j + 1) * seg_len;
        for (int64_t d = 0; d < width; d++) {
            float a = 0.0f;
            for (int64_t k = 0; k < i1 - i0; k++) {
                const int64_t i = reverse ? i1 - 1 - k : i0 + k;
                const float p = (w ? w[i] : 1.0f) * x[i * width + d];
                a = k == 0 ? p : a + p;
            }
            y[j * width + d] = a;
        }
    }
}
static void test_rows_wsum(void) {
    /* (a) ragged segments [2,5) [5,6) [6,11) [11,18) (the first row skipped) on continuous
       data, vs float64; weights given and NULL */
    {
        const int64_t seg[5] = {2, 5, 6, 11, 18}, n_seg = 4, width = 50, rows = 18;
        float *x = fa(rows * width), *w = fa(rows), *ys[B_COUNT];
        double *yd = da(n_seg * width);
        fill_randn(x, rows * width, 1.0f);
        fill_randn(w, rows, 1.0f);
        for (int wi = 0; wi < 2; wi++) {
            const float *wp = wi ? NULL : w;
            for (int64_t j = 0; j < n_seg; j++)
                for (int64_t d = 0; d < width; d++) {
                    double s = 0;
                    for (int64_t i = seg[j]; i < seg[j + 1]; i++)
                        s += (wp ? (double)wp[i] : 1.0) * x[i * width + d];
                    yd[j * width + d] = s;
                }
            ys_alloc(ys, n_seg * width);
            for (int b = 0; b < B_COUNT; b++)
                K3_CHECK_OK(run_rows_wsum(BE(b), x, wp, seg, 0, n_seg, width, ys[b]));
            K3_CHECK(rel_l2_d(ys[B_REF], yd, n_seg * width) < K3_TOL_OP_REL_L2,
                     "rows_wsum (w %s) vs float64: %g", wp ? "given" : "NULL",
                     rel_l2_d(ys[B_REF], yd, n_seg * width));
            check_cpu_is_ref(ys, n_seg * width, "rows_wsum");
            check_family(ys, n_seg * width, "rows_wsum");
            /* segments 0..1 and 2..3 in two calls (seg holds absolute row numbers) */
            float *y1 = fa(n_seg * width);
            K3_CHECK_OK(run_rows_wsum(BE(B_CPU4), x, wp, seg, 0, 2, width, y1));
            K3_CHECK_OK(run_rows_wsum(BE(B_CPU4), x, wp, seg + 2, 0, 2, width, y1 + 2 * width));
            K3_CHECK(same_f(y1, ys[B_CPU1], n_seg * width), "rows_wsum: split differs");
            free(y1);
            ys_free(ys);
        }
        free(x), free(w), free(yd);
    }
    /* (b) the order: uniform segments of 8 (seg NULL) and the same as a seg array, on values
       whose products are exact and whose sums round differently in every order (±2^24 next to
       small integers). n_seg·seg_len·width is above the parallel threshold. */
    {
        const int64_t n_seg = 64, L = 8, width = 128, rows = n_seg * L;
        static const float xv[8] = {16777216.0f, -16777216.0f, 8388608.0f, 1.0f,
                                    -1.0f,       3.0f,         0.75f,      -0.25f};
        static const float wv[5] = {1.0f, -1.0f, 2.0f, 0.5f, 3.0f};
        float *x = fa(rows * width), *w = fa(rows), *want = fa(n_seg * width),
              *rev = fa(n_seg * width), *ys[B_COUNT], *y1 = fa(n_seg * width);
        int64_t *seg = malloc((size_t)(n_seg + 1) * sizeof(int64_t));
        for (int64_t j = 0; j <= n_seg; j++) seg[j] = j * L;
        for (int64_t i = 0; i < rows * width; i++) x[i] = xv[rand_below(8)];
        for (int64_t i = 0; i < rows; i++) w[i] = wv[rand_below(5)];
        for (int wi = 0; wi < 2; wi++) {
            const float *wp = wi ? NULL : w;
            const char *wn = wp ? "given" : "NULL";
            wsum_in_order(x, wp, NULL, L, n_seg, width, false, want);
            wsum_in_order(x, wp, NULL, L, n_seg, width, true, rev);
            int64_t order_sensitive = 0;
            for (int64_t i = 0; i < n_seg * width; i++) order_sensitive += want[i] != rev[i];
            K3_CHECK(order_sensitive > n_seg * width / 20,
                     "rows_wsum order data: only %lld sums depend on the order",
                     (long long)order_sensitive);
            ys_alloc(ys, n_seg * width);
            for (int b = 0; b < B_COUNT; b++) {
                K3_CHECK_OK(run_rows_wsum(BE(b), x, wp, NULL, L, n_seg, width, ys[b]));
                K3_CHECK(same_f(ys[b], want, n_seg * width),
                         "rows_wsum uniform (w %s, %s): not the in-order sum", wn, k_be_label[b]);
                K3_CHECK_OK(run_rows_wsum(BE(b), x, wp, seg, 0, n_seg, width, y1));
                K3_CHECK(same_f(y1, want, n_seg * width),
                         "rows_wsum seg array (w %s, %s): not the in-order sum", wn, k_be_label[b]);
            }
            check_family(ys, n_seg * width, "rows_wsum uniform");
            /* 20 + 44 segments in two calls, on 1 thread */
            K3_CHECK_OK(run_rows_wsum(BE(B_CPU1), x, wp, NULL, L, 20, width, y1));
            K3_CHECK_OK(run_rows_wsum(BE(B_CPU1), x + 20 * L * width, wp ? wp + 20 * L : NULL, NULL,
                                      L, n_seg - 20, width, y1 + 20 * width));
            K3_CHECK(same_f(y1, want, n_seg * width), "rows_wsum uniform: split differs");
            ys_free(ys);
        }
        free(x), free(w), free(want), free(rev), free(y1), free(seg);
    }
    /* (c) the first term initialises (no 0 + ...): −0 stays −0; a one-row segment is a copy */
    {
        const int64_t seg[3] = {0, 1, 3};
        float x[3] = {-0.0f, -0.0f, -0.0f}, w[3] = {1.0f, 2.0f, 1.0f};
        for (int b = 0; b < B_COUNT; b++) {
            float y[2] = {NAN, NAN}, yw[2] = {NAN, NAN};
            K3_CHECK_OK(run_rows_wsum(BE(b), x, NULL, seg, 0, 2, 1, y));
            K3_CHECK_OK(run_rows_wsum(BE(b), x, w, seg, 0, 2, 1, yw));
            K3_CHECK(y[0] == 0.0f && signbit(y[0]) && signbit(y[1]) && signbit(yw[0]) &&
                         signbit(yw[1]),
                     "rows_wsum (%s): −0 sums must stay −0 (first term initialises): %g %g %g %g",
                     k_be_label[b], y[0], y[1], yw[0], yw[1]);
        }
    }
    /* (d) empty / reversed segments and a uniform length < 1 are argument errors */
    {
        const int64_t bad[4] = {0, 2, 2, 5}, rev[3] = {0, 3, 1};
        float x[5 * 2] = {0}, y[3 * 2];
        for (int b = 0; b < B_COUNT; b++) {
            K3_CHECK_ERR(run_rows_wsum(BE(b), x, NULL, bad, 0, 3, 2, y), K3_ERR_ARG, "segment 1");
            K3_CHECK_ERR(run_rows_wsum(BE(b), x, NULL, rev, 0, 2, 2, y), K3_ERR_ARG, "segment 1");
            K3_CHECK_ERR(run_rows_wsum(BE(b), x, NULL, NULL, 0, 3, 2, y), K3_ERR_ARG, "rows_wsum");
            K3_CHECK_OK(run_rows_wsum(BE(b), x, NULL, NULL, 0, 0, 2, y)); /* nothing to do */
        }
    }
}

/* the varlen ops (one call for a whole batch) and the routed experts op */
#include "test_ops_seqs.inc"
#include "test_ops_moe.inc"

/* The registry: one test per op of K3_OP_LIST (a missing test_<op> is a compile error). */
#define K3_OP_TEST(name, params, args) {#name, test_##name},
static const struct {
    const char *name;
    void (*fn)(void);
} k_tests[] = {K3_OP_LIST(K3_OP_TEST)};
#undef K3_OP_TEST
_Static_assert(sizeof(k_tests) / sizeof(k_tests[0]) == K3_OP_COUNT, "one test per op");

/* a cpu backend asked for with var=bad is refused, naming both; var is as it was afterwards */
static void check_env_refused(const char *var, const char *bad) {
    const char *was = getenv(var);
    char *saved = was ? strdup(was) : NULL, needle[64];
    snprintf(needle, sizeof needle, "%s='%s'", var, bad);
    setenv(var, bad, 1);
    k3_backend *nope = NULL;
    K3_CHECK_ERR(k3_backend_create("cpu", NULL, &nope), K3_ERR_ARG, needle);
    K3_CHECK(nope == NULL, "a failed create leaves *out NULL");
    if (saved)
        setenv(var, saved, 1);
    else
        unsetenv(var);
    free(saved);
}

/* argv: op names (none: every op). An unknown name fails the test rather than run nothing. */
static bool op_wanted(const char *name, int argc, char **argv) {
    for (int a = 1; a < argc; a++)
        if (strcmp(argv[a], name) == 0) return true;
    return argc < 2;
}

int main(int argc, char **argv) {
    printf("test_ops seed %llu\n", (unsigned long long)k_seed);
    for (int a = 1; a < argc; a++) {
        bool known = false;
        for (size_t i = 0; i < K3_ARRAY_LEN(k_tests); i++)
            known |= strcmp(argv[a], k_tests[i].name) == 0;
        K3_CHECK(known, "'%s' is not an op of K3_OP_LIST", argv[a]);
    }
    const char *isa = getenv("K3_ISA");
    if (isa && *isa && !k3_cpu_isa_supported(isa)) {
        printf("SKIP test_ops: K3_ISA=%s: this CPU does not support it\n", isa);
        return 77;
    }
    printf("cpu backend ISA: %s\n", isa && *isa ? isa : "default (cpuid)");
    k3_rng_seed(&g_rng, k_seed);
    for (int b = 0; b < B_COUNT; b++) {
        k3_backend_params p = {.n_threads = k_be_threads[b], .guard_reserve = (size_t)1 << 30};
        K3_CHECK_OK(k3_backend_create(k_be_kind[b], &p, &g_be[b]));
        if (!g_be[b]) return k3_test_done("ops");
        K3_CHECK(strcmp(g_be[b]->name, k_be_kind[b]) == 0 &&
                     k3_backend_threads(g_be[b]) == k_be_threads[b],
                 "backend %s: name %s, %d threads", k_be_label[b], g_be[b]->name,
                 k3_backend_threads(g_be[b]));
        K3_CHECK(k3_backend_host_visible(g_be[b]) == (b != B_GUARD), "%s host visibility",
                 k_be_label[b]);
        for (int op = 0; op < K3_OP_COUNT; op++)
            K3_CHECK(k3_backend_supports_op(g_be[b], op, K3_DT_COUNT), "%s does not run %s",
                     k_be_label[b], k3_op_name(op));
    }
    k3_backend *nope = NULL;
    K3_CHECK_ERR(k3_backend_create("x", NULL, &nope), K3_ERR_ARG, "unknown backend 'x'");
    /* the ISA in use is the one asked for; an unknown K3_ISA is an error naming it */
    K3_CHECK(!isa || !*isa || strcmp(k3_cpu_isa_name(BE(B_CPU1)), isa) == 0, "cpu ISA %s, asked %s",
             k3_cpu_isa_name(BE(B_CPU1)), isa);
    check_env_refused("K3_ISA", "avx9");
    /* the decode row order in use is the one asked for (kernels/cpu/isa.c); unknown: an error */
    const char *gemv = getenv("K3_GEMV");
    K3_CHECK(!gemv || !*gemv || strcmp(k3_cpu_gemv_name(BE(B_CPU1)), gemv) == 0,
             "decode rows %s, asked %s", k3_cpu_gemv_name(BE(B_CPU1)), gemv);
    check_env_refused("K3_GEMV", "zigzag");
    K3_CHECK(strcmp(k3_backend_host()->name, "cpu") == 0 &&
                 k3_backend_threads(k3_backend_host()) == 1,
             "host backend: one-thread cpu");
    K3_CHECK(strcmp(k3_op_name(K3_OP_matmul), "matmul") == 0 &&
                 strcmp(k3_op_name(K3_OP_rows_wsum), "rows_wsum") == 0 &&
                 strcmp(k3_op_name(K3_OP_COUNT), "?") == 0,
             "op names");
    for (size_t i = 0; i < K3_ARRAY_LEN(k_tests); i++) {
        if (!op_wanted(k_tests[i].name, argc, argv)) continue;
        int before = k3_t_fail;
        k_tests[i].fn();
        printf("  op %-14s %s\n", k_tests[i].name, k3_t_fail == before ? "ok" : "FAILED");
    }
    for (int b = 0; b < B_COUNT; b++) k3_backend_destroy(g_be[b]);
    return k3_test_done("ops");
}
