/* ref.c — the reference backend: plain, obviously-correct C that DEFINES every op's semantics
 * (kernels/k3_kernels.h). Single-threaded, sequential reductions in index order; the long dot
 * products of matmul/matmul_tn accumulate in double (the reference should be the most accurate
 * backend: fp32 sequential sums of 256 terms alone moved tiny-model logits by ~2e-5), everything
 * else (norms, KDA state, attention) is fp32 like the cpu backend.
 * Everything else (cpu/, cuda/) is tested against these functions.
 * Owns nothing but code; never allocates (callers pass scratch). */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <math.h>

/* ---- weights ------------------------------------------------------------------------------ */

static k3_status ref_matmul(k3_backend *be, const float *x, int64_t T, const k3_tensor *W,
                            float *y) {
    K3_TRY(k3_kernels_check_weight(W, "matmul"));
    int64_t out = W->shape[0], in = W->shape[1];
    for (int64_t o = 0; o < out; o++)
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * in;
            double acc = 0.0;
            for (int64_t i = 0; i < in; i++) acc += (double)xt[i] * k3_tensor_get(W, o, i);
            y[t * out + o] = (float)acc;
        }
    return K3_OK;
}

static k3_status ref_matmul_group(k3_backend *be, const k3_mm *mm, int n) {
    K3_TRY(k3_kernels_check_group(mm, n));
    for (int i = 0; i < n; i++) K3_TRY(ref_matmul(be, mm[i].x, mm[i].T, mm[i].W, mm[i].y));
    return K3_OK;
}

static k3_status ref_matmul_tn(k3_backend *be, const float *x, int64_t T, const k3_tensor *W,
                               float *y) {
    K3_TRY(k3_kernels_check_weight(W, "matmul_tn"));
    int64_t out = W->shape[0], in = W->shape[1];
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < in; i++) {
            double acc = 0.0;
            for (int64_t o = 0; o < out; o++)
                acc += (double)x[t * out + o] * k3_tensor_get(W, o, i);
            y[t * in + i] = (float)acc;
        }
    return K3_OK;
}

/* ---- elementwise / rows ------------------------------------------------------------------- */
static k3_status ref_rmsnorm(k3_backend *be, const float *x, const float *w, int64_t T, int64_t n,
                             float eps, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * n;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) ss += xt[i] * xt[i];
        float r = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) y[t * n + i] = (w ? w[i] : 1.0f) * (xt[i] * r);
    }
    return K3_OK;
}

static k3_status ref_l2norm(k3_backend *be, const float *x, int64_t T, int64_t n, float eps,
                            float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * n;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) ss += xt[i] * xt[i];
        float r = 1.0f / sqrtf(ss + eps);
        for (int64_t i = 0; i < n; i++) y[t * n + i] = xt[i] * r;
    }
    return K3_OK;
}

static inline float sigm(float x) {
    return 1.0f / (1.0f + expf(-x));
}

static k3_status ref_silu(k3_backend *be, const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * sigm(x[i]);
    return K3_OK;
}
static k3_status ref_sigmoid(k3_backend *be, const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = sigm(x[i]);
    return K3_OK;
}
static k3_status ref_situ(k3_backend *be, const float *g, const float *u, int64_t n, float beta,
                          float lin_beta, float *y) {
    for (int64_t i = 0; i < n; i++) {
        float a = beta * tanhf(g[i] / beta) * sigm(g[i]);
        float b = lin_beta > 0.0f ? lin_beta * tanhf(u[i] / lin_beta) : u[i];
        y[i] = a * b;
    }
    return K3_OK;
}
static k3_status ref_swiglu(k3_backend *be, const float *g, const float *u, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = g[i] * sigm(g[i]) * u[i];
    return K3_OK;
}
static k3_status ref_softmax(k3_backend *be, const float *x, int64_t T, int64_t n, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * n;
        float *yt = y + t * n;
        float m = -INFINITY;
        for (int64_t i = 0; i < n; i++) m = xt[i] > m ? xt[i] : m;
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            yt[i] = expf(xt[i] - m);
            s += yt[i];
        }
        for (int64_t i = 0; i < n; i++) yt[i] /= s;
    }
    return K3_OK;
}

/* ---- AttnRes ------------------------------------------------------------------------------ */
#define K3_MAX_SOURCES 64
void k3_ref_attnres_softmax(float *s, int n) {
    float m = -INFINITY, z = 0.0f;
    for (int i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
    for (int i = 0; i < n; i++) {
        s[i] = expf(s[i] - m);
        z += s[i];
    }
    for (int i = 0; i < n; i++) s[i] /= z;
}
void k3_ref_attnres_mix_rows(const float *bank, int n_bank, const float *p, const float *w,
                             int64_t T, int64_t D, float eps, float *out, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        float s[K3_MAX_SOURCES];
        for (int i = 0; i <= n_bank; i++) {
            const float *v = i < n_bank ? bank + ((int64_t)i * T + t) * D : p + t * D;
            float ss = 0.0f, dot = 0.0f;
            for (int64_t d = 0; d < D; d++) ss += v[d] * v[d];
            float r = 1.0f / sqrtf(ss / (float)D + eps);
            for (int64_t d = 0; d < D; d++) dot += (v[d] * r) * w[d];
            s[i] = dot;
        }
        k3_ref_attnres_softmax(s, n_bank + 1);
        /* out may alias p: accumulate per element with p read before the write */
        for (int64_t d = 0; d < D; d++) {
            float acc = 0.0f;
            for (int i = 0; i < n_bank; i++) acc += s[i] * bank[((int64_t)i * T + t) * D + d];
            acc += s[n_bank] * p[t * D + d];
            out[t * D + d] = acc;
        }
    }
}
k3_status k3_ref_attnres_check(int n_bank) {
    if (n_bank < 0 || n_bank + 1 > K3_MAX_SOURCES)
        return K3_ERR(K3_ERR_ARG, "attnres_mix: %d banked sources (0..%d)", n_bank,
                      K3_MAX_SOURCES - 1);
    return K3_OK;
}
static k3_status ref_attnres_mix(k3_backend *be, const float *bank, int n_bank, const float *p,
                                 const float *w, int64_t T, int64_t D, float eps, float *out) {
    K3_TRY(k3_ref_attnres_check(n_bank));
    k3_ref_attnres_mix_rows(bank, n_bank, p, w, T, D, eps, out, 0, T);
    return K3_OK;
}

/* ---- KDA ---------------------------------------------------------------------------------- */
void k3_ref_kda_head_recurrent(const float *q, const float *k, const float *v, const float *g,
                               const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb,
                               int dk, int dv, float scale, float *S, float *o) {
    for (int64_t t = 0; t < n; t++) {
        const float *qt = q + t * sqk, *kt = k + t * sqk, *gt = g + t * sqk, *vt = v + t * svo;
        float b = beta[t * sb];
        float *ot = o + t * svo;
        /* decay rows, then u = Sᵀk (u accumulates into ot as scratch) */
        for (int j = 0; j < dv; j++) ot[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float e = expf(gt[i]);
            float *Si = S + (int64_t)i * dv;
            for (int j = 0; j < dv; j++) {
                Si[j] *= e;
                ot[j] += kt[i] * Si[j];
            }
        }
        for (int j = 0; j < dv; j++) ot[j] = b * (vt[j] - ot[j]); /* δ */
        /* S += k δᵀ, o = scale · Sᵀ q  (δ read from ot, o written after the loop) */
        float oj[1024];
        K3_ASSERT(dv <= 1024);
        for (int j = 0; j < dv; j++) oj[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *Si = S + (int64_t)i * dv;
            for (int j = 0; j < dv; j++) {
                Si[j] += kt[i] * ot[j];
                oj[j] += qt[i] * Si[j];
            }
        }
        for (int j = 0; j < dv; j++) ot[j] = scale * oj[j];
    }
}

/* The chunked form. Intra-chunk math runs in double (the triangular solve of (I + A) amplifies
 * fp32 rounding ~10×; double keeps chunked within ~1e-7 of the recurrence, which the prefill
 * chunk-invariance bound needs); the state S stays fp32 between chunks, like the recurrence.
 * Every decay factor is exp of a difference <= 0 (§2.4 overflow rule): exp(Γ_i − Γ_j), i >= j,
 * exp(Γ_i) and exp(Γ_last − Γ_j) — never exp(−Γ). */
void k3_ref_kda_head_chunked(const float *q, const float *k, const float *v, const float *g,
                             const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb,
                             int dk, int dv, float scale, float *S, float *o, int C, float *work) {
    double *G = (double *)work;       /* [C, dk] Γ, cumulative log decay */
    double *eG = G + (size_t)C * dk;  /* [C, dk] exp(Γ_i) */
    double *eL = eG + (size_t)C * dk; /* [C, dk] exp(Γ_last − Γ_j) */
    double *Wm = eL + (size_t)C * dk; /* [C, dk] W = T̃ (exp Γ ⊙ K) */
    double *U = Wm + (size_t)C * dk;  /* [C, dv] U, then V' */
    double *Ob = U + (size_t)C * dv;  /* [C, dv] output block */
    double *A = Ob + (size_t)C * dv;  /* [C, C] A, then T̃ */
    double *Aqk = A + (size_t)C * C;  /* [C, C] */
    int64_t t0 = 0;
    for (; C > 1 && t0 + C <= n; t0 += C) {
        for (int i = 0; i < C; i++) {
            const float *gi = g + (t0 + i) * sqk;
            for (int d = 0; d < dk; d++) {
                G[i * dk + d] = (i ? G[(i - 1) * dk + d] : 0.0) + (double)gi[d];
                eG[i * dk + d] = exp(G[i * dk + d]);
            }
        }
        const double *Gl = G + (size_t)(C - 1) * dk;
        for (int j = 0; j < C; j++)
            for (int d = 0; d < dk; d++) eL[j * dk + d] = exp(Gl[d] - G[j * dk + d]);
        /* 1. A[i,j] = β_i Σ_d k_i k_j exp(Γ_i − Γ_j) (j < i); Aqk[i,j] = Σ_d scale·q_i k_j exp(·)
         * (j <= i) */
        for (int i = 0; i < C; i++) {
            const float *ki = k + (t0 + i) * sqk, *qi = q + (t0 + i) * sqk;
            double bi = beta[(t0 + i) * sb];
            for (int j = 0; j < C; j++) {
                A[i * C + j] = 0.0;
                Aqk[i * C + j] = 0.0;
                if (j > i) continue;
                const float *kj = k + (t0 + j) * sqk;
                double a = 0.0, aq = 0.0;
                for (int d = 0; d < dk; d++) {
                    double e = exp(G[i * dk + d] - G[j * dk + d]) * (double)kj[d];
                    a += (double)ki[d] * e;
                    aq += (double)qi[d] * e;
                }
                if (j < i) A[i * C + j] = bi * a;
                Aqk[i * C + j] = (double)scale * aq;
            }
        }
        /* 2. T = (I + A)^-1 by forward substitution, row by row in place (rows < i hold T):
              T[i,j] = −Σ_{m=j}^{i−1} A[i,m] T[m,j], T[i,i] = 1; then T̃[i,j] = T[i,j] β_j. */
        for (int i = 0; i < C; i++) {
            double row[1024];
            K3_ASSERT(C <= 1024);
            for (int j = 0; j < i; j++) {
                double s = 0.0;
                for (int m = j; m < i; m++) s += A[i * C + m] * (m == j ? 1.0 : A[m * C + j]);
                row[j] = -s;
            }
            for (int j = 0; j < i; j++) A[i * C + j] = row[j];
        }
        for (int i = 0; i < C; i++)
            for (int j = 0; j <= i; j++)
                A[i * C + j] = (j == i ? 1.0 : A[i * C + j]) * (double)beta[(t0 + j) * sb];
        /* 3. W = T̃ (exp Γ ⊙ K), U = T̃ V */
        for (int i = 0; i < C; i++) {
            for (int d = 0; d < dk; d++) Wm[i * dk + d] = 0.0;
            for (int e = 0; e < dv; e++) U[i * dv + e] = 0.0;
            for (int j = 0; j <= i; j++) {
                double t = A[i * C + j];
                const float *kj = k + (t0 + j) * sqk, *vj = v + (t0 + j) * svo;
                for (int d = 0; d < dk; d++) Wm[i * dk + d] += t * eG[j * dk + d] * (double)kj[d];
                for (int e = 0; e < dv; e++) U[i * dv + e] += t * (double)vj[e];
            }
        }
        /* 4. V' = U − W S ; O = (scale·q ⊙ exp Γ) S + Aqk V' */
        for (int i = 0; i < C; i++) {
            const float *qi = q + (t0 + i) * sqk;
            for (int e = 0; e < dv; e++) Ob[i * dv + e] = 0.0;
            for (int d = 0; d < dk; d++) {
                double w = Wm[i * dk + d], qe = (double)scale * (double)qi[d] * eG[i * dk + d];
                const float *Sd = S + (int64_t)d * dv;
                for (int e = 0; e < dv; e++) {
                    U[i * dv + e] -= w * (double)Sd[e];
                    Ob[i * dv + e] += qe * (double)Sd[e];
                }
            }
        }
        for (int i = 0; i < C; i++) {
            for (int j = 0; j <= i; j++) {
                double a = Aqk[i * C + j];
                for (int e = 0; e < dv; e++) Ob[i * dv + e] += a * U[j * dv + e];
            }
            for (int e = 0; e < dv; e++) o[(t0 + i) * svo + e] = (float)Ob[i * dv + e];
        }
        /* S ← diag(exp Γ_last) S + Σ_j (exp(Γ_last − Γ_j) ⊙ k_j) V'_jᵀ   (stored back in fp32) */
        for (int d = 0; d < dk; d++) {
            float *Sd = S + (int64_t)d * dv;
            double el = exp(Gl[d]);
            for (int e = 0; e < dv; e++)
                Ob[e] = el * (double)Sd[e]; /* Ob row 0 reused as scratch */
            for (int j = 0; j < C; j++) {
                double kk = eL[j * dk + d] * (double)k[(t0 + j) * sqk + d];
                for (int e = 0; e < dv; e++) Ob[e] += kk * U[j * dv + e];
            }
            for (int e = 0; e < dv; e++) Sd[e] = (float)Ob[e];
        }
    }
    if (t0 < n)
        k3_ref_kda_head_recurrent(q + t0 * sqk, k + t0 * sqk, v + t0 * svo, g + t0 * sqk,
                                  beta + t0 * sb, n - t0, sqk, svo, sb, dk, dv, scale, S,
                                  o + t0 * svo);
}

static k3_status ref_kda_recurrent(k3_backend *be, const float *q, const float *k, const float *v,
                                   const float *g, const float *beta, int64_t n, int H, int dk,
                                   int dv, float scale, float *S, float *o) {
    K3_TRY(k3_kernels_check_kda(dk, dv, 1));
    int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    for (int h = 0; h < H; h++)
        k3_ref_kda_head_recurrent(q + h * dk, k + h * dk, v + h * dv, g + h * dk, beta + h, n, sqk,
                                  svo, H, dk, dv, scale, S + (int64_t)h * dk * dv, o + h * dv);
    return K3_OK;
}

static k3_status ref_kda_chunked(k3_backend *be, const float *q, const float *k, const float *v,
                                 const float *g, const float *beta, int64_t n, int H, int dk,
                                 int dv, float scale, float *S, float *o, int C, float *work) {
    K3_TRY(k3_kernels_check_kda(dk, dv, C));
    int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    size_t wf = k3_kda_chunk_work_floats(C, dk, dv);
    for (int h = 0; h < H; h++)
        k3_ref_kda_head_chunked(q + h * dk, k + h * dk, v + h * dv, g + h * dk, beta + h, n, sqk,
                                svo, H, dk, dv, scale, S + (int64_t)h * dk * dv, o + h * dv, C,
                                work + (size_t)h * wf);
    return K3_OK;
}

k3_status k3_kernels_check_kda(int dk, int dv, int C) {
    if (dk < 1 || dv < 1 || dv > 1024 || C < 1 || C > 1024)
        return K3_ERR(K3_ERR_ARG, "KDA: head dims dk=%d dv=%d (dv <= 1024), chunk %d (1..1024)", dk,
                      dv, C);
    return K3_OK;
}

/* ---- latent attention --------------------------------------------------------------------- */
void k3_ref_attn_latent_head(const float *qc, const float *cache, const int32_t *blk, int64_t n_ctx,
                             int W, int Rkv, float scale, float *o, float *work) {
    /* row j: contiguous, or row j % K3_KV_BLOCK of page blk[j / K3_KV_BLOCK] */
#define REF_ROW(j)                                                                                 \
    (cache + (blk ? (int64_t)blk[(j) / K3_KV_BLOCK] * K3_KV_BLOCK + (j) % K3_KV_BLOCK : (j)) * W)
    float m = -INFINITY;
    for (int64_t j = 0; j < n_ctx; j++) {
        const float *c = REF_ROW(j);
        float s = 0.0f;
        for (int i = 0; i < W; i++) s += qc[i] * c[i];
        work[j] = s * scale;
        m = work[j] > m ? work[j] : m;
    }
    float z = 0.0f;
    for (int64_t j = 0; j < n_ctx; j++) {
        work[j] = expf(work[j] - m);
        z += work[j];
    }
    for (int i = 0; i < Rkv; i++) o[i] = 0.0f;
    for (int64_t j = 0; j < n_ctx; j++) {
        float p = work[j] / z;
        const float *c = REF_ROW(j);
        for (int i = 0; i < Rkv; i++) o[i] += p * c[i];
    }
#undef REF_ROW
}

static k3_status ref_attn_latent(k3_backend *be, const float *qc, const float *cache, int64_t n_ctx,
                                 int H, int W, int Rkv, float scale, float *o_lat, float *work) {
    K3_TRY(k3_kernels_check_attn("attn_latent", 0, n_ctx, H, W, Rkv));
    for (int h = 0; h < H; h++)
        k3_ref_attn_latent_head(qc + (int64_t)h * W, cache, NULL, n_ctx, W, Rkv, scale,
                                o_lat + (int64_t)h * Rkv, work + (int64_t)h * n_ctx);
    return K3_OK;
}

/* The definition: attn_latent per query over its own prefix of the cache. */
static k3_status ref_attn_latent_causal(k3_backend *be, const float *qc, const float *cache,
                                        int64_t pos0, int64_t n_q, int H, int W, int Rkv,
                                        float scale, float *o_lat, float *work) {
    K3_TRY(k3_kernels_check_attn("attn_latent_causal", pos0, n_q, H, W, Rkv));
    for (int64_t j = 0; j < n_q; j++)
        K3_TRY(ref_attn_latent(be, qc + j * H * W, cache, pos0 + j + 1, H, W, Rkv, scale,
                               o_lat + j * H * Rkv, work));
    return K3_OK;
}

k3_status k3_kernels_check_attn(const char *op, int64_t pos0, int64_t n_q, int H, int W, int Rkv) {
    if (pos0 < 0 || n_q < 0 || H < 1 || Rkv < 1 || Rkv > W || W > K3_ATTN_MAX_W)
        return K3_ERR(K3_ERR_ARG,
                      "%s: pos0 %lld, %lld queries/rows, H %d, Rkv %d, W %d (need pos0, n >= 0, "
                      "H >= 1, 1 <= Rkv <= W <= %d)",
                      op, (long long)pos0, (long long)n_q, H, Rkv, W, K3_ATTN_MAX_W);
    return K3_OK;
}

/* ---- element-wise, copies, decode ---------------------------------------------------------- */
static k3_status ref_add(k3_backend *be, const float *a, const float *b, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = a[i] + b[i];
    return K3_OK;
}
static k3_status ref_mul(k3_backend *be, const float *a, const float *b, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = a[i] * b[i];
    return K3_OK;
}
static k3_status ref_fill(k3_backend *be, float *y, int64_t n, float v) {
    for (int64_t i = 0; i < n; i++) y[i] = v;
    return K3_OK;
}
static k3_status ref_copy2d(k3_backend *be, float *dst, int64_t dst_stride, const float *src,
                            int64_t src_stride, int64_t rows, int64_t cols) {
    if (rows < 0 || cols < 0 || (rows > 1 && (dst_stride < cols || src_stride < cols)))
        return K3_ERR(K3_ERR_ARG, "copy2d: %lld x %lld with strides %lld / %lld", (long long)rows,
                      (long long)cols, (long long)dst_stride, (long long)src_stride);
    for (int64_t r = 0; r < rows; r++)
        memcpy(dst + r * dst_stride, src + r * src_stride, (size_t)cols * sizeof(float));
    return K3_OK;
}
static k3_status ref_to_f32(k3_backend *be, const k3_tensor *t, int64_t n, float *dst) {
    return k3_tensor_to_f32(t, dst, n);
}
static k3_status ref_embed_rows(k3_backend *be, const k3_tensor *W, const int32_t *ids, int64_t T,
                                float *out) {
    if (W->ndim != 2 || (W->dtype != K3_DT_F32 && W->dtype != K3_DT_BF16 && W->dtype != K3_DT_F16))
        return K3_ERR(K3_ERR_SHAPE, "embed_rows: embedding must be a 2-D F32/BF16/F16 table");
    const int64_t D = W->shape[1];
    for (int64_t t = 0; t < T; t++) {
        if (ids[t] < 0 || ids[t] >= W->shape[0])
            return K3_ERR(K3_ERR_ARG, "embed_rows: token id %d at position %lld outside [0, %lld)",
                          ids[t], (long long)t, (long long)W->shape[0]);
        k3_tensor row;
        K3_TRY(k3_tensor_rows(W, ids[t], 1, &row));
        K3_TRY(k3_tensor_to_f32(&row, out + t * D, D));
    }
    return K3_OK;
}

/* ---- KDA pieces ---------------------------------------------------------------------------- */
void k3_ref_short_conv_cols(const float *in, int64_t n, int64_t P, int K, const float *w,
                            const float *state, float *out, int64_t c0, int64_t c1) {
    for (int64_t t = 0; t < n; t++) {
        float *o = out + t * P;
        for (int64_t c = c0; c < c1; c++) {
            float acc = 0.0f;
            for (int j = 0; j < K; j++) {
                int64_t idx = t - (K - 1) + j;
                float v = idx >= 0 ? in[idx * P + c] : state[(idx + (K - 1)) * P + c];
                acc += w[c * K + j] * v;
            }
            o[c] = acc;
        }
    }
}
void k3_ref_short_conv_state(const float *in, int64_t n, int64_t P, int K, float *state) {
    /* new state: the window of the last K-1 inputs */
    int km1 = K - 1;
    if (km1 <= 0) return;
    if (n >= km1) {
        memcpy(state, in + (n - km1) * P, (size_t)km1 * (size_t)P * sizeof(float));
    } else {
        int64_t keep = km1 - n; /* oldest rows shift up */
        memmove(state, state + n * P, (size_t)keep * (size_t)P * sizeof(float));
        memcpy(state + keep * P, in, (size_t)n * (size_t)P * sizeof(float));
    }
}
static k3_status ref_short_conv(k3_backend *be, const float *in, int64_t n, int64_t P, int K,
                                const float *w, float *state, float *out) {
    k3_ref_short_conv_cols(in, n, P, K, w, state, out, 0, P);
    k3_ref_short_conv_state(in, n, P, K, state);
    return K3_OK;
}

/* PyTorch softplus (beta 1, threshold 20). */
static inline float softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}
void k3_ref_kda_gate_rows(float *r, const float *dt_bias, const float *a_log, int64_t t0,
                          int64_t t1, int H, int dk, bool has_lower_bound, float lower_bound) {
    const int64_t P = (int64_t)H * dk;
    for (int64_t t = t0; t < t1; t++) {
        float *rt = r + t * P;
        for (int h = 0; h < H; h++) {
            float a = expf(a_log[h]);
            for (int i = 0; i < dk; i++) {
                int64_t ch = (int64_t)h * dk + i;
                float v = rt[ch] + dt_bias[ch];
                rt[ch] = has_lower_bound ? lower_bound * (1.0f / (1.0f + expf(-a * v)))
                                         : -a * softplus(v);
            }
        }
    }
}
static k3_status ref_kda_gate(k3_backend *be, float *r, const float *dt_bias, const float *a_log,
                              int64_t T, int H, int dk, bool has_lower_bound, float lower_bound) {
    k3_ref_kda_gate_rows(r, dt_bias, a_log, 0, T, H, dk, has_lower_bound, lower_bound);
    return K3_OK;
}

/* ---- MoE routing and rows ------------------------------------------------------------------ */
/* Index of the largest v[i] over i in [0, n) with allowed[i]; ties -> lowest index. */
static int argmax_lowest(const float *v, int n, const unsigned char *allowed) {
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (!allowed[i]) continue;
        if (best < 0 || v[i] > v[best]) best = i;
    }
    return best;
}

k3_status k3_ref_moe_topk_rows(const float *scores, const float *bias, int64_t t0, int64_t t1,
                               int E, int K, int G, int topk_group, bool renorm, float scale,
                               float *work, int32_t *ids_all, float *w_all) {
    const int gsz = E / G;
    unsigned char gkeep[K3_MOE_TOPK_MAX_GROUPS];
    float gscore[K3_MOE_TOPK_MAX_GROUPS];
    for (int64_t t = t0; t < t1; t++) {
        const float *s = scores + t * E;
        float *b = work + t * E;
        for (int e = 0; e < E; e++) b[e] = bias ? s[e] + bias[e] : s[e];
        /* A non-finite score (bad weights, a NaN bias, a NaN input row) is the token's fault, not
           the step's: experts 0..K-1 with NaN weights make its MoE output NaN, and the step's
           non-finite check fails that sequence alone (k3_nf_op MoE). */
        bool bad = false;
        for (int e = 0; e < E && !bad; e++) bad = !isfinite(s[e]) || !isfinite(b[e]);
        if (bad) {
            for (int k = 0; k < K; k++) ids_all[t * K + k] = k, w_all[t * K + k] = NAN;
            continue;
        }
        /* group scores: sum of the two best biased scores of each group (one if gsz == 1) */
        for (int g = 0; g < G; g++) {
            const float *bg = b + (int64_t)g * gsz;
            int i1 = 0;
            for (int i = 1; i < gsz; i++)
                if (bg[i] > bg[i1]) i1 = i;
            int i2 = -1;
            for (int i = 0; i < gsz; i++)
                if (i != i1 && (i2 < 0 || bg[i] > bg[i2])) i2 = i;
            gscore[g] = i2 < 0 ? bg[i1] : bg[i1] + bg[i2];
            gkeep[g] = 0;
        }
        if (G > 1) {
            unsigned char avail[K3_MOE_TOPK_MAX_GROUPS];
            memset(avail, 1, (size_t)G);
            for (int j = 0; j < topk_group; j++) {
                int g = argmax_lowest(gscore, G, avail);
                avail[g] = 0;
                gkeep[g] = 1;
            }
        } else {
            gkeep[0] = 1;
        }
        /* top-K of the biased scores among experts of kept groups; ties -> lower expert index;
           a taken expert becomes -inf in the work row */
        int32_t *ids = ids_all + t * K;
        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                if (!gkeep[e / gsz] || isinf(b[e])) continue;
                if (best < 0 || b[e] > b[best]) best = e;
            }
            if (best < 0) /* cannot happen when K <= kept experts (checked) and scores are finite */
                return K3_ERR(K3_ERR_INTERNAL, "MoE router: ran out of experts at token %lld",
                              (long long)t);
            ids[k] = best;
            b[best] = -INFINITY;
        }
        float *w = w_all + t * K;
        float sum = 0.0f;
        for (int k = 0; k < K; k++) {
            w[k] = s[ids[k]];
            sum += w[k];
        }
        if (renorm) {
            float den = sum + 1e-20f;
            for (int k = 0; k < K; k++) w[k] = w[k] / den;
        }
        for (int k = 0; k < K; k++) w[k] *= scale;
    }
    return K3_OK;
}

k3_status k3_kernels_check_topk(int E, int K, int G, int topk_group) {
    if (E <= 0 || K <= 0 || K > E || G <= 0 || G > K3_MOE_TOPK_MAX_GROUPS || E % G != 0 ||
        topk_group <= 0 || topk_group > G || (int64_t)topk_group * (E / G) < K)
        return K3_ERR(K3_ERR_ARG,
                      "moe_topk: E=%d K=%d n_group=%d topk_group=%d is not a valid selection", E, K,
                      G, topk_group);
    return K3_OK;
}

static k3_status ref_moe_topk(k3_backend *be, const float *scores, const float *bias, int64_t T,
                              int E, int K, int n_group, int topk_group, bool renorm, float scale,
                              float *work, int32_t *ids, float *w) {
    K3_TRY(k3_kernels_check_topk(E, K, n_group, topk_group));
    return k3_ref_moe_topk_rows(scores, bias, 0, T, E, K, n_group, topk_group, renorm, scale, work,
                                ids, w);
}

static k3_status ref_rows_gather(k3_backend *be, const float *src, int64_t width,
                                 const int64_t *idx, int64_t n, float *dst) {
    for (int64_t j = 0; j < n; j++)
        memcpy(dst + j * width, src + idx[j] * width, (size_t)width * sizeof(float));
    return K3_OK;
}
static k3_status ref_rows_scatter(k3_backend *be, const float *src, int64_t width,
                                  const int64_t *idx, int64_t n, float *dst) {
    for (int64_t j = 0; j < n; j++)
        memcpy(dst + idx[j] * width, src + j * width, (size_t)width * sizeof(float));
    return K3_OK;
}

void k3_ref_rows_wsum_seg(const float *x, const float *w, const int64_t *seg, int64_t seg_len,
                          int64_t j, int64_t width, float *y) {
    float *a = y + j * width;
    const int64_t i0 = seg ? seg[j] : j * seg_len, i1 = seg ? seg[j + 1] : (j + 1) * seg_len;
    const float *x0 = x + i0 * width;
    if (w)
        for (int64_t d = 0; d < width; d++) a[d] = w[i0] * x0[d];
    else
        for (int64_t d = 0; d < width; d++) a[d] = x0[d];
    for (int64_t i = i0 + 1; i < i1; i++) {
        const float *xi = x + i * width;
        if (w) {
            const float wi = w[i];
            for (int64_t d = 0; d < width; d++) a[d] += wi * xi[d];
        } else {
            for (int64_t d = 0; d < width; d++) a[d] += xi[d];
        }
    }
}
k3_status k3_kernels_check_seg(const int64_t *seg, int64_t seg_len, int64_t n_seg) {
    if (!seg && seg_len < 1 && n_seg > 0)
        return K3_ERR(K3_ERR_ARG, "rows_wsum: uniform segments of %lld rows", (long long)seg_len);
    for (int64_t j = 0; seg && j < n_seg; j++)
        if (seg[j + 1] <= seg[j])
            return K3_ERR(K3_ERR_ARG, "rows_wsum: segment %lld is empty or reversed [%lld, %lld)",
                          (long long)j, (long long)seg[j], (long long)seg[j + 1]);
    return K3_OK;
}
static k3_status ref_rows_wsum(k3_backend *be, const float *x, const float *w, const int64_t *seg,
                               int64_t seg_len, int64_t n_seg, int64_t width, float *y) {
    K3_TRY(k3_kernels_check_seg(seg, seg_len, n_seg));
    for (int64_t j = 0; j < n_seg; j++) k3_ref_rows_wsum_seg(x, w, seg, seg_len, j, width, y);
    return K3_OK;
}

/* the varlen ops (ref_seqs.c, ref_moe.c) */
#define ref_rmsnorm_rows           k3_ref_rmsnorm_rows
#define ref_matmul_heads           k3_ref_matmul_heads
#define ref_kv_write               k3_ref_kv_write
#define ref_attn_paged             k3_ref_attn_paged
#define ref_short_conv_seqs        k3_ref_short_conv_seqs
#define ref_kda_seqs               k3_ref_kda_seqs
#define ref_nonfinite_rows         k3_ref_nonfinite_rows
#define ref_rows_last              k3_ref_rows_last
#define ref_moe_experts            k3_ref_moe_experts
#define REF_OP(name, params, args) .name = ref_##name,
const k3_ops k3_ref_ops = {K3_OP_LIST(REF_OP)};
#undef REF_OP
