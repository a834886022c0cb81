/* cpu.c — the cpu backend: SIMD (AVX2+FMA when built with them, scalar otherwise) and the
 * persistent pool of pool.c. Semantics are ref/'s; results differ from ref only by summation
 * order inside a dot product (8-lane partial sums), and are bit-reproducible on their own:
 *
 * Determinism: y[t,o] of matmul is one dot product whose lane assignment and final reduction
 * depend only on `in` — the same code path computes it whether the call has 1 token or 512,
 * and threads split over output rows (matmul), columns (matmul_tn), heads (KDA, attention) or
 * tokens (norms), never inside one reduction.
 * Ops that are not bottlenecks reuse the reference code (per head / per row) from the workers. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <math.h>

#include "k3_mxfp4.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define K3_CPU_AVX2 1
#endif

/* Work below this many multiply-adds runs on the calling thread only. */
#define K3_CPU_PAR_MIN_MACS (1 << 15)
#define K3_CPU_MAX_NT       4 /* tokens per micro-tile */

/* ---- dot-product micro kernels: NT tokens × one weight row ------------------------------- */
#ifdef K3_CPU_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi); /* 4 */
    __m128 sh = _mm_movehl_ps(lo, lo);
    lo = _mm_add_ps(lo, sh); /* 2 */
    sh = _mm_shuffle_ps(lo, lo, 1);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}
static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* Dot-product micro kernels: out[u] = Σ_i x_u[i] w[i] for one weight row and 1 or 4 tokens.
 * The 4-token kernel shares each weight load between 4 tokens (prefill); the 1-token kernel is
 * the decode path. Both do EXACTLY the same arithmetic per token — lanes: elements of each
 * 16-block go to accumulators a0 (first 8) and a1 (next 8); one 8-block tail into a0; scalar
 * tail t in index order; result hsum8(a0 + a1) + t — so a token's result never depends on which
 * kernel (i.e. on T) computed it. Accumulators are named variables (no arrays) so they stay in
 * registers. */
#define FOR1(M)  M(0)
#define FOR4(M)  M(0) M(1) M(2) M(3)
#define XDECL(u) const float *x##u = x[u];
#ifdef K3_CPU_AVX2
#define ACC_DECL(u)                                                                                \
    __m256 a0_##u = _mm256_setzero_ps(), a1_##u = _mm256_setzero_ps();                             \
    float t_##u = 0.0f;
#define ACC_16(u)                                                                                  \
    a0_##u = _mm256_fmadd_ps(_mm256_loadu_ps(x##u + i), w0, a0_##u);                               \
    a1_##u = _mm256_fmadd_ps(_mm256_loadu_ps(x##u + i + 8), w1, a1_##u);
#define ACC_8(u)   a0_##u = _mm256_fmadd_ps(_mm256_loadu_ps(x##u + i), w0, a0_##u);
#define ACC_OUT(u) out[u] = hsum8(_mm256_add_ps(a0_##u, a1_##u)) + t_##u;
#define SIMD_LOOPS(FORN, LOADW)                                                                    \
    for (; i + 16 <= n; i += 16) {                                                                 \
        __m256 w0 = LOADW(i), w1 = LOADW(i + 8);                                                   \
        FORN(ACC_16)                                                                               \
    }                                                                                              \
    for (; i + 8 <= n; i += 8) {                                                                   \
        __m256 w0 = LOADW(i);                                                                      \
        FORN(ACC_8)                                                                                \
    }
#define LOADW_F32(j)  _mm256_loadu_ps(w + (j))
#define LOADW_BF16(j) load_bf16x8(w + (j))
#else
#define ACC_DECL(u) float t_##u = 0.0f;
#define ACC_OUT(u)  out[u] = t_##u;
#define SIMD_LOOPS(FORN, LOADW)
#endif
#define ACC_S(u)       t_##u += x##u[i] * wi;
#define SCALAR_F32(j)  w[j]
#define SCALAR_BF16(j) k3_bf16_to_f32(w[j])

#define DEF_DOT(NAME, WT, FORN, LOADW, SCALARW)                                                    \
    static void NAME(const WT *w, const float *const *x, int64_t n, float *out) {                  \
        FORN(XDECL)                                                                                \
        FORN(ACC_DECL)                                                                             \
        int64_t i = 0;                                                                             \
        SIMD_LOOPS(FORN, LOADW)                                                                    \
        for (; i < n; i++) {                                                                       \
            float wi = SCALARW(i);                                                                 \
            FORN(ACC_S)                                                                            \
        }                                                                                          \
        FORN(ACC_OUT)                                                                              \
    }
DEF_DOT(dot1_f32, float, FOR1, LOADW_F32, SCALAR_F32)
DEF_DOT(dot4_f32, float, FOR4, LOADW_F32, SCALAR_F32)
DEF_DOT(dot1_bf16, uint16_t, FOR1, LOADW_BF16, SCALAR_BF16)
DEF_DOT(dot4_bf16, uint16_t, FOR4, LOADW_BF16, SCALAR_BF16)

/* MXFP4 row: codes [n/2] bytes (low nibble = even element), e8m0 [n/32]. Per 32-block: the
 * codes map through a byte LUT to ggml's doubled E2M1 integers k (vpshufb), the 32 products
 * x·k are summed in-block (p0: elements 0..15, p1: 16..31) and the block joins the token's
 * accumulators as a0 += p0·d, a1 += p1·d with d = 2^(e−128) (k·d = E2M1·2^(e−127), the value
 * k3_mxfp4_get defines; scaling by a power of two is exact, so only the summation order differs
 * from ref). Same arithmetic for 1 and 4 tokens. */
#ifdef K3_CPU_AVX2
#define ACC_MX(u)                                                                                  \
    {                                                                                              \
        __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(x##u + i), wv0);                                 \
        __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(x##u + i + 16), wv2);                            \
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(x##u + i + 8), wv1, p0);                              \
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(x##u + i + 24), wv3, p1);                             \
        a0_##u = _mm256_fmadd_ps(p0, vs, a0_##u);                                                  \
        a1_##u = _mm256_fmadd_ps(p1, vs, a1_##u);                                                  \
    }
#define DEF_DOT_MX(NAME, FORN)                                                                     \
    static void NAME(const uint8_t *codes, const uint8_t *e8, const float *const *x, int64_t n,    \
                     float *out) {                                                                 \
        FORN(XDECL)                                                                                \
        FORN(ACC_DECL)                                                                             \
        const __m128i lut =                                                                        \
            _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);                \
        const __m128i m4 = _mm_set1_epi8(0x0f);                                                    \
        for (int64_t b = 0; b < n / 32; b++) {                                                     \
            __m128i raw = _mm_loadu_si128((const __m128i *)(codes + b * 16));                      \
            __m128i vlo = _mm_shuffle_epi8(lut, _mm_and_si128(raw, m4));                           \
            __m128i vhi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), m4));        \
            __m128i e0 = _mm_unpacklo_epi8(vlo, vhi), e1 = _mm_unpackhi_epi8(vlo, vhi);            \
            __m256 wv0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e0));                             \
            __m256 wv1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e0, 8)));          \
            __m256 wv2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e1));                             \
            __m256 wv3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e1, 8)));          \
            __m256 vs = _mm256_set1_ps(k3_e8m0_to_f32_half_ggml(e8[b]));                           \
            const int64_t i = b * 32;                                                              \
            FORN(ACC_MX)                                                                           \
        }                                                                                          \
        FORN(ACC_OUT)                                                                              \
    }
#else
#define ACC_MXS(u)                                                                                 \
    for (int j = 0; j < 32; j++) t_##u += x##u[b * 32 + j] * wbuf[j];
#define DEF_DOT_MX(NAME, FORN)                                                                     \
    static void NAME(const uint8_t *codes, const uint8_t *e8, const float *const *x, int64_t n,    \
                     float *out) {                                                                 \
        FORN(XDECL)                                                                                \
        FORN(ACC_DECL)                                                                             \
        float wbuf[32];                                                                            \
        for (int64_t b = 0; b < n / 32; b++) {                                                     \
            k3_mxfp4_decode_row(codes + b * 16, e8 + b, 32, wbuf);                                 \
            FORN(ACC_MXS)                                                                          \
        }                                                                                          \
        FORN(ACC_OUT)                                                                              \
    }
#endif
DEF_DOT_MX(dot1_mx, FOR1)
DEF_DOT_MX(dot4_mx, FOR4)

/* Decode (one token): two weight rows at once — four independent FMA chains instead of two hide
 * the FMA latency; each row's arithmetic is exactly dot1's (a0/a1 lanes, 8-tail, scalar tail). */
#ifdef K3_CPU_AVX2
#define DEF_DOT_R2(NAME, WT, LOADF, SCALARF)                                                       \
    static void NAME(const WT *wa, const WT *wb, const float *x0, int64_t n, float *oa,            \
                     float *ob) {                                                                  \
        __m256 a0a = _mm256_setzero_ps(), a1a = a0a, a0b = a0a, a1b = a0a;                         \
        float ta = 0.0f, tb = 0.0f;                                                                \
        int64_t i = 0;                                                                             \
        for (; i + 16 <= n; i += 16) {                                                             \
            __m256 xv0 = _mm256_loadu_ps(x0 + i), xv1 = _mm256_loadu_ps(x0 + i + 8);               \
            a0a = _mm256_fmadd_ps(xv0, LOADF(wa + i), a0a);                                        \
            a1a = _mm256_fmadd_ps(xv1, LOADF(wa + i + 8), a1a);                                    \
            a0b = _mm256_fmadd_ps(xv0, LOADF(wb + i), a0b);                                        \
            a1b = _mm256_fmadd_ps(xv1, LOADF(wb + i + 8), a1b);                                    \
        }                                                                                          \
        for (; i + 8 <= n; i += 8) {                                                               \
            __m256 xv0 = _mm256_loadu_ps(x0 + i);                                                  \
            a0a = _mm256_fmadd_ps(xv0, LOADF(wa + i), a0a);                                        \
            a0b = _mm256_fmadd_ps(xv0, LOADF(wb + i), a0b);                                        \
        }                                                                                          \
        for (; i < n; i++) {                                                                       \
            ta += x0[i] * SCALARF(wa[i]);                                                          \
            tb += x0[i] * SCALARF(wb[i]);                                                          \
        }                                                                                          \
        *oa = hsum8(_mm256_add_ps(a0a, a1a)) + ta;                                                 \
        *ob = hsum8(_mm256_add_ps(a0b, a1b)) + tb;                                                 \
    }
#define SCALAR_ID(v) (v)
DEF_DOT_R2(dot1x2_f32, float, _mm256_loadu_ps, SCALAR_ID)
DEF_DOT_R2(dot1x2_bf16, uint16_t, load_bf16x8, k3_bf16_to_f32)
#define K3_CPU_HAVE_R2 1
#endif

/* One weight row against nt <= 4 tokens: the 4-token kernel for full tiles, else 1 at a time. */
static inline void row_dot(const k3_tensor *W, int64_t o, const float *const *xs, int nt,
                           float *out) {
    int64_t in = W->shape[1];
    switch (W->dtype) {
    case K3_DT_F32: {
        const float *w = (const float *)W->data + o * in;
        if (nt == 4)
            dot4_f32(w, xs, in, out);
        else
            for (int u = 0; u < nt; u++) dot1_f32(w, xs + u, in, out + u);
        break;
    }
    case K3_DT_BF16: {
        const uint16_t *w = (const uint16_t *)W->data + o * in;
        if (nt == 4)
            dot4_bf16(w, xs, in, out);
        else
            for (int u = 0; u < nt; u++) dot1_bf16(w, xs + u, in, out + u);
        break;
    }
    default: {
        const uint8_t *c = (const uint8_t *)W->data + o * (in / 2), *e = W->scale + o * (in / 32);
        if (nt == 4)
            dot4_mx(c, e, xs, in, out);
        else
            for (int u = 0; u < nt; u++) dot1_mx(c, e, xs + u, in, out + u);
        break;
    }
    }
}

typedef struct {
    const float *x;
    int64_t T;
    const k3_tensor *W;
    float *y;
    int64_t rows_per_task;
} mm_job;

/* Rows of one task are walked in blocks of K3_CPU_ROW_BLOCK (a few KB of weights, cache
 * resident) and every token tile meets a block before the next block is read, so a weight row
 * leaves memory once per call whatever T is. Loop order never changes a result. */
#define K3_CPU_ROW_BLOCK 16
static void mm_task(void *ctx, int64_t task) {
    const mm_job *j = ctx;
    int64_t out = j->W->shape[0], in = j->W->shape[1];
    int64_t o0 = task * j->rows_per_task, o1 = K3_MIN(out, o0 + j->rows_per_task);
    for (int64_t ob = o0; ob < o1; ob += K3_CPU_ROW_BLOCK) {
        int64_t oe = K3_MIN(o1, ob + K3_CPU_ROW_BLOCK);
        for (int64_t t0 = 0; t0 < j->T; t0 += K3_CPU_MAX_NT) {
            int nt = (int)K3_MIN((int64_t)K3_CPU_MAX_NT, j->T - t0);
            const float *xs[K3_CPU_MAX_NT];
            for (int u = 0; u < nt; u++) xs[u] = j->x + (t0 + u) * in;
            int64_t o = ob;
#ifdef K3_CPU_HAVE_R2
            if (nt == 1 && j->W->dtype != K3_DT_MXFP4) /* decode: row pairs */
                for (; o + 2 <= oe; o += 2) {
                    float *y0 = j->y + t0 * out + o;
                    if (j->W->dtype == K3_DT_BF16) {
                        const uint16_t *w = (const uint16_t *)j->W->data + o * in;
                        dot1x2_bf16(w, w + in, xs[0], in, y0, y0 + 1);
                    } else {
                        const float *w = (const float *)j->W->data + o * in;
                        dot1x2_f32(w, w + in, xs[0], in, y0, y0 + 1);
                    }
                }
#endif
            for (; o < oe; o++) {
                float r[K3_CPU_MAX_NT];
                row_dot(j->W, o, xs, nt, r);
                for (int u = 0; u < nt; u++) j->y[(t0 + u) * out + o] = r[u];
            }
        }
    }
}

static k3_status cpu_matmul(k3_backend *be, const float *x, int64_t T, const k3_tensor *W,
                            float *y) {
    K3_TRY(k3_kernels_check_weight(W, "matmul"));
    int64_t out = W->shape[0], in = W->shape[1];
    if (T <= 0 || out <= 0) return K3_OK;
    mm_job j = {.x = x, .T = T, .W = W, .y = y, .rows_per_task = out};
    int64_t macs = T * out * in;
    int nth = k3_pool_threads(k3_cpu_pool(be));
    if (macs >= K3_CPU_PAR_MIN_MACS && nth > 1) {
        /* ~4 tasks per thread for balance; rows per task a multiple of 4. Task boundaries never
           change any result (each y[t,o] is computed whole by one task). */
        int64_t n_tasks = K3_MIN(out, (int64_t)nth * 4);
        j.rows_per_task = (out + n_tasks - 1) / n_tasks;
        j.rows_per_task = (j.rows_per_task + 3) & ~(int64_t)3;
    }
    int64_t n_tasks = (out + j.rows_per_task - 1) / j.rows_per_task;
    k3_pool_run(k3_cpu_pool(be), n_tasks, mm_task, &j);
    return K3_OK;
}

/* y[t, i] = Σ_o x[t,o] W[o,i] with o ascending for every element; tasks split over columns. */
typedef struct {
    const float *x;
    int64_t T;
    const k3_tensor *W;
    float *y;
    int64_t cols_per_task;
} mmtn_job;

static void mmtn_task(void *ctx, int64_t task) {
    const mmtn_job *j = ctx;
    int64_t out = j->W->shape[0], in = j->W->shape[1];
    int64_t c0 = task * j->cols_per_task, c1 = K3_MIN(in, c0 + j->cols_per_task);
    for (int64_t t = 0; t < j->T; t++) {
        float *yt = j->y + t * in;
        for (int64_t c = c0; c < c1; c++) yt[c] = 0.0f;
        for (int64_t o = 0; o < out; o++) {
            float xo = j->x[t * out + o];
            if (j->W->dtype == K3_DT_F32) {
                const float *w = (const float *)j->W->data + o * in;
                for (int64_t c = c0; c < c1; c++) yt[c] = fmaf(xo, w[c], yt[c]);
            } else if (j->W->dtype == K3_DT_BF16) {
                const uint16_t *w = (const uint16_t *)j->W->data + o * in;
                for (int64_t c = c0; c < c1; c++) yt[c] = fmaf(xo, k3_bf16_to_f32(w[c]), yt[c]);
            } else {
                for (int64_t c = c0; c < c1; c++)
                    yt[c] = fmaf(xo, k3_tensor_get(j->W, o, c), yt[c]);
            }
        }
    }
}

static k3_status cpu_matmul_tn(k3_backend *be, const float *x, int64_t T, const k3_tensor *W,
                               float *y) {
    K3_TRY(k3_kernels_check_weight(W, "matmul_tn"));
    int64_t out = W->shape[0], in = W->shape[1];
    if (T <= 0 || in <= 0) return K3_OK;
    mmtn_job j = {.x = x, .T = T, .W = W, .y = y, .cols_per_task = in};
    int nth = k3_pool_threads(k3_cpu_pool(be));
    if (T * out * in >= K3_CPU_PAR_MIN_MACS && nth > 1) {
        int64_t n_tasks = K3_MIN((in + 31) / 32, (int64_t)nth * 2);
        j.cols_per_task = ((in + n_tasks - 1) / n_tasks + 31) & ~(int64_t)31;
    }
    k3_pool_run(k3_cpu_pool(be), (in + j.cols_per_task - 1) / j.cols_per_task, mmtn_task, &j);
    return K3_OK;
}

/* ---- row ops: reuse ref per row block from the pool --------------------------------------- */
typedef struct {
    const float *x;
    const float *w;
    int64_t n;
    float eps;
    float *y;
    bool l2;
} norm_job;
static void norm_task(void *ctx, int64_t t) {
    const norm_job *j = ctx;
    if (j->l2)
        k3_ref_ops.l2norm(NULL, j->x + t * j->n, 1, j->n, j->eps, j->y + t * j->n);
    else
        k3_ref_ops.rmsnorm(NULL, j->x + t * j->n, j->w, 1, j->n, j->eps, j->y + t * j->n);
}
static k3_status cpu_rmsnorm(k3_backend *be, const float *x, const float *w, int64_t T, int64_t n,
                             float eps, float *y) {
    norm_job j = {x, w, n, eps, y, false};
    if (T * n < K3_CPU_PAR_MIN_MACS) {
        return k3_ref_ops.rmsnorm(be, x, w, T, n, eps, y);
    }
    k3_pool_run(k3_cpu_pool(be), T, norm_task, &j);
    return K3_OK;
}
static k3_status cpu_l2norm(k3_backend *be, const float *x, int64_t T, int64_t n, float eps,
                            float *y) {
    norm_job j = {x, NULL, n, eps, y, true};
    if (T * n < K3_CPU_PAR_MIN_MACS) {
        return k3_ref_ops.l2norm(be, x, T, n, eps, y);
    }
    k3_pool_run(k3_cpu_pool(be), T, norm_task, &j);
    return K3_OK;
}

/* ---- KDA and latent attention: per head on the pool --------------------------------------- */
typedef struct {
    const float *q, *k, *v, *g, *beta;
    int64_t n;
    int H, dk, dv, C;
    float scale;
    float *S, *o, *work;
} kda_job;
static void kda_task(void *ctx, int64_t h) {
    const kda_job *j = ctx;
    int64_t sqk = (int64_t)j->H * j->dk, svo = (int64_t)j->H * j->dv;
    float *S = j->S + h * j->dk * j->dv;
    if (j->C > 1)
        k3_ref_kda_head_chunked(j->q + h * j->dk, j->k + h * j->dk, j->v + h * j->dv,
                                j->g + h * j->dk, j->beta + h, j->n, sqk, svo, j->H, j->dk, j->dv,
                                j->scale, S, j->o + h * j->dv, j->C,
                                j->work + (size_t)h * k3_kda_chunk_work_floats(j->C, j->dk, j->dv));
    else
        k3_ref_kda_head_recurrent(j->q + h * j->dk, j->k + h * j->dk, j->v + h * j->dv,
                                  j->g + h * j->dk, j->beta + h, j->n, sqk, svo, j->H, j->dk, j->dv,
                                  j->scale, S, j->o + h * j->dv);
}
static k3_status cpu_kda_recurrent(k3_backend *be, const float *q, const float *k, const float *v,
                                   const float *g, const float *beta, int64_t n, int H, int dk,
                                   int dv, float scale, float *S, float *o) {
    K3_TRY(k3_kernels_check_kda(dk, dv, 1));
    kda_job j = {q, k, v, g, beta, n, H, dk, dv, 0, scale, S, o, NULL};
    k3_pool_run(k3_cpu_pool(be), H, kda_task, &j);
    return K3_OK;
}
static k3_status cpu_kda_chunked(k3_backend *be, const float *q, const float *k, const float *v,
                                 const float *g, const float *beta, int64_t n, int H, int dk,
                                 int dv, float scale, float *S, float *o, int C, float *work) {
    K3_TRY(k3_kernels_check_kda(dk, dv, C));
    kda_job j = {q, k, v, g, beta, n, H, dk, dv, C, scale, S, o, work};
    k3_pool_run(k3_cpu_pool(be), H, kda_task, &j);
    return K3_OK;
}

typedef struct {
    const float *qc, *cache;
    int64_t n_ctx;
    int W, Rkv;
    float scale;
    float *o, *work;
} lat_job;
static void lat_task(void *ctx, int64_t h) {
    const lat_job *j = ctx;
    k3_ref_attn_latent_head(j->qc + h * j->W, j->cache, j->n_ctx, j->W, j->Rkv, j->scale,
                            j->o + h * j->Rkv, j->work + h * j->n_ctx);
}
static k3_status cpu_attn_latent(k3_backend *be, const float *qc, const float *cache, int64_t n_ctx,
                                 int H, int W, int Rkv, float scale, float *o_lat, float *work) {
    lat_job j = {qc, cache, n_ctx, W, Rkv, scale, o_lat, work};
    if (n_ctx * H * W < K3_CPU_PAR_MIN_MACS) {
        for (int h = 0; h < H; h++) lat_task(&j, h);
        return K3_OK;
    }
    k3_pool_run(k3_cpu_pool(be), H, lat_task, &j);
    return K3_OK;
}

/* elementwise ops are a negligible share of time: the reference code */
static k3_status cpu_silu(k3_backend *be, const float *x, int64_t n, float *y) {
    return k3_ref_ops.silu(be, x, n, y);
}
static k3_status cpu_sigmoid(k3_backend *be, const float *x, int64_t n, float *y) {
    return k3_ref_ops.sigmoid(be, x, n, y);
}
static k3_status cpu_situ(k3_backend *be, const float *g, const float *u, int64_t n, float beta,
                          float lin_beta, float *y) {
    return k3_ref_ops.situ(be, g, u, n, beta, lin_beta, y);
}
static k3_status cpu_swiglu(k3_backend *be, const float *g, const float *u, int64_t n, float *y) {
    return k3_ref_ops.swiglu(be, g, u, n, y);
}
static k3_status cpu_softmax(k3_backend *be, const float *x, int64_t T, int64_t n, float *y) {
    return k3_ref_ops.softmax(be, x, T, n, y);
}
static k3_status cpu_attnres_mix(k3_backend *be, const float *bank, int n_bank, const float *p,
                                 const float *w, int64_t T, int64_t D, float eps, float *out) {
    return k3_ref_ops.attnres_mix(be, bank, n_bank, p, w, T, D, eps, out);
}

static k3_status cpu_add(k3_backend *be, const float *a, const float *b, int64_t n, float *y) {
    return k3_ref_ops.add(be, a, b, n, y);
}
static k3_status cpu_mul(k3_backend *be, const float *a, const float *b, int64_t n, float *y) {
    return k3_ref_ops.mul(be, a, b, n, y);
}
static k3_status cpu_fill(k3_backend *be, float *y, int64_t n, float v) {
    return k3_ref_ops.fill(be, y, n, v);
}
static k3_status cpu_copy2d(k3_backend *be, float *dst, int64_t dst_stride, const float *src,
                            int64_t src_stride, int64_t rows, int64_t cols) {
    return k3_ref_ops.copy2d(be, dst, dst_stride, src, src_stride, rows, cols);
}
static k3_status cpu_to_f32(k3_backend *be, const k3_tensor *t, int64_t n, float *dst) {
    return k3_ref_ops.to_f32(be, t, n, dst);
}
static k3_status cpu_embed_rows(k3_backend *be, const k3_tensor *W, const int32_t *ids, int64_t T,
                                float *out) {
    return k3_ref_ops.embed_rows(be, W, ids, T, out);
}
static k3_status cpu_short_conv(k3_backend *be, const float *in, int64_t n, int64_t P, int K,
                                const float *w, float *state, float *out) {
    return k3_ref_ops.short_conv(be, in, n, P, K, w, state, out);
}

/* kda_gate and moe_topk: per token on the pool (each token's outputs are its own). */
typedef struct {
    float *r;
    const float *dt_bias, *a_log;
    int64_t T;
    int H, dk;
    bool lb_form;
    float lb;
} gate_job;
static void gate_task(void *ctx, int64_t t) {
    const gate_job *j = ctx;
    k3_ref_kda_gate_rows(j->r, j->dt_bias, j->a_log, t, t + 1, j->H, j->dk, j->lb_form, j->lb);
}
static k3_status cpu_kda_gate(k3_backend *be, float *r, const float *dt_bias, const float *a_log,
                              int64_t T, int H, int dk, bool has_lower_bound, float lower_bound) {
    gate_job j = {r, dt_bias, a_log, T, H, dk, has_lower_bound, lower_bound};
    if (T * H * dk < K3_CPU_PAR_MIN_MACS / 8) {
        k3_ref_kda_gate_rows(r, dt_bias, a_log, 0, T, H, dk, has_lower_bound, lower_bound);
        return K3_OK;
    }
    k3_pool_run(k3_cpu_pool(be), T, gate_task, &j);
    return K3_OK;
}

typedef struct {
    const float *scores, *bias;
    int E, K, G, topk_group;
    bool renorm;
    float scale;
    float *work, *w;
    int32_t *ids;
    k3_status *st; /* [T] */
} topk_job;
static void topk_task(void *ctx, int64_t t) {
    const topk_job *j = ctx;
    j->st[t] = k3_ref_moe_topk_rows(j->scores, j->bias, t, t + 1, j->E, j->K, j->G, j->topk_group,
                                    j->renorm, j->scale, j->work, j->ids, j->w);
}
static k3_status cpu_moe_topk(k3_backend *be, const float *scores, const float *bias, int64_t T,
                              int E, int K, int n_group, int topk_group, bool renorm, float scale,
                              float *work, int32_t *ids, float *w) {
    K3_TRY(k3_kernels_check_topk(E, K, n_group, topk_group));
    /* Small batches (and every error path: the first failing token, as ref reports it) run on
       the caller; large ones per token on the pool with the statuses kept on the stack in
       tiles, so an error still names the first bad token. */
    enum { TILE = 256 };
    k3_status st[TILE];
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        int64_t n = K3_MIN((int64_t)TILE, T - t0);
        if (n * E < K3_CPU_PAR_MIN_MACS / 8) {
            K3_TRY(k3_ref_moe_topk_rows(scores, bias, t0, t0 + n, E, K, n_group, topk_group, renorm,
                                        scale, work, ids, w));
            continue;
        }
        topk_job j = {
            scores + t0 * E, bias,         E, K, n_group, topk_group, renorm, scale, work + t0 * E,
            w + t0 * K,      ids + t0 * K, st};
        k3_pool_run(k3_cpu_pool(be), n, topk_task, &j);
        for (int64_t i = 0; i < n; i++)
            if (st[i] != K3_OK) /* redo serially from this tile for the message of the first */
                return k3_ref_moe_topk_rows(scores, bias, t0, t0 + n, E, K, n_group, topk_group,
                                            renorm, scale, work, ids, w);
    }
    return K3_OK;
}

static k3_status cpu_rows_gather(k3_backend *be, const float *src, int64_t width,
                                 const int64_t *idx, int64_t n, float *dst) {
    return k3_ref_ops.rows_gather(be, src, width, idx, n, dst);
}
static k3_status cpu_rows_scatter(k3_backend *be, const float *src, int64_t width,
                                  const int64_t *idx, int64_t n, float *dst) {
    return k3_ref_ops.rows_scatter(be, src, width, idx, n, dst);
}

typedef struct {
    const float *x, *w;
    const int64_t *seg;
    int64_t seg_len, width;
    float *y;
} wsum_job;
static void wsum_task(void *ctx, int64_t j) {
    const wsum_job *q = ctx;
    k3_ref_rows_wsum_seg(q->x, q->w, q->seg, q->seg_len, j, q->width, q->y);
}
static k3_status cpu_rows_wsum(k3_backend *be, const float *x, const float *w, const int64_t *seg,
                               int64_t seg_len, int64_t n_seg, int64_t width, float *y) {
    K3_TRY(k3_kernels_check_seg(seg, seg_len, n_seg));
    wsum_job j = {x, w, seg, seg_len, width, y};
    int64_t rows = seg ? (n_seg > 0 ? seg[n_seg] - seg[0] : 0) : n_seg * seg_len;
    if (rows * width < K3_CPU_PAR_MIN_MACS) {
        for (int64_t s = 0; s < n_seg; s++) wsum_task(&j, s);
        return K3_OK;
    }
    k3_pool_run(k3_cpu_pool(be), n_seg, wsum_task, &j);
    return K3_OK;
}

#define CPU_OP(name, params, args) .name = cpu_##name,
const k3_ops k3_cpu_ops = {K3_OP_LIST(CPU_OP)};
#undef CPU_OP
