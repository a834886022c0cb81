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

static k3_status ref_matmul(const float *x, int64_t T, const k3_tensor *W, float *y) {
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

static k3_status ref_matmul_tn(const float *x, int64_t T, const k3_tensor *W, float *y) {
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
static void ref_rmsnorm(const float *x, const float *w, int64_t T, int64_t n, float eps, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * n;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) ss += xt[i] * xt[i];
        float r = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) y[t * n + i] = (w ? w[i] : 1.0f) * (xt[i] * r);
    }
}

static void ref_l2norm(const float *x, int64_t T, int64_t n, float eps, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * n;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) ss += xt[i] * xt[i];
        float r = 1.0f / sqrtf(ss + eps);
        for (int64_t i = 0; i < n; i++) y[t * n + i] = xt[i] * r;
    }
}

static inline float sigm(float x) {
    return 1.0f / (1.0f + expf(-x));
}

static void ref_silu(const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * sigm(x[i]);
}
static void ref_sigmoid(const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = sigm(x[i]);
}
static void ref_situ(const float *g, const float *u, int64_t n, float beta, float lin_beta,
                     float *y) {
    for (int64_t i = 0; i < n; i++) {
        float a = beta * tanhf(g[i] / beta) * sigm(g[i]);
        float b = lin_beta > 0.0f ? lin_beta * tanhf(u[i] / lin_beta) : u[i];
        y[i] = a * b;
    }
}
static void ref_swiglu(const float *g, const float *u, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = g[i] * sigm(g[i]) * u[i];
}
static void ref_softmax(const float *x, int64_t T, int64_t n, float *y) {
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
}

/* ---- AttnRes ------------------------------------------------------------------------------ */
#define K3_MAX_SOURCES 64
static void ref_attnres_mix(const float *bank, int n_bank, const float *p, const float *w,
                            int64_t T, int64_t D, float eps, float *out) {
    K3_ASSERT(n_bank + 1 <= K3_MAX_SOURCES);
    for (int64_t t = 0; t < T; t++) {
        float s[K3_MAX_SOURCES], m = -INFINITY;
        for (int i = 0; i <= n_bank; i++) {
            const float *v = i < n_bank ? bank + ((int64_t)i * T + t) * D : p + t * D;
            float ss = 0.0f, dot = 0.0f;
            for (int64_t d = 0; d < D; d++) ss += v[d] * v[d];
            float r = 1.0f / sqrtf(ss / (float)D + eps);
            for (int64_t d = 0; d < D; d++) dot += (v[d] * r) * w[d];
            s[i] = dot;
            m = dot > m ? dot : m;
        }
        float z = 0.0f;
        for (int i = 0; i <= n_bank; i++) {
            s[i] = expf(s[i] - m);
            z += s[i];
        }
        for (int i = 0; i <= n_bank; i++) s[i] /= z;
        /* out may alias p: accumulate per element with p read before the write */
        for (int64_t d = 0; d < D; d++) {
            float acc = 0.0f;
            for (int i = 0; i < n_bank; i++) acc += s[i] * bank[((int64_t)i * T + t) * D + d];
            acc += s[n_bank] * p[t * D + d];
            out[t * D + d] = acc;
        }
    }
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

static void ref_kda_recurrent(const float *q, const float *k, const float *v, const float *g,
                              const float *beta, int64_t n, int H, int dk, int dv, float scale,
                              float *S, float *o) {
    int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    for (int h = 0; h < H; h++)
        k3_ref_kda_head_recurrent(q + h * dk, k + h * dk, v + h * dv, g + h * dk, beta + h, n, sqk,
                                  svo, H, dk, dv, scale, S + (int64_t)h * dk * dv, o + h * dv);
}

static void ref_kda_chunked(const float *q, const float *k, const float *v, const float *g,
                            const float *beta, int64_t n, int H, int dk, int dv, float scale,
                            float *S, float *o, int C, float *work) {
    int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    size_t wf = k3_kda_chunk_work_floats(C, dk, dv);
    for (int h = 0; h < H; h++)
        k3_ref_kda_head_chunked(q + h * dk, k + h * dk, v + h * dv, g + h * dk, beta + h, n, sqk,
                                svo, H, dk, dv, scale, S + (int64_t)h * dk * dv, o + h * dv, C,
                                work + (size_t)h * wf);
}

/* ---- latent attention --------------------------------------------------------------------- */
void k3_ref_attn_latent_head(const float *qc, const float *cache, int64_t n_ctx, int W, int Rkv,
                             float scale, float *o, float *work) {
    float m = -INFINITY;
    for (int64_t j = 0; j < n_ctx; j++) {
        const float *c = cache + j * W;
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
        const float *c = cache + j * W;
        for (int i = 0; i < Rkv; i++) o[i] += p * c[i];
    }
}

static void ref_attn_latent(const float *qc, const float *cache, int64_t n_ctx, int H, int W,
                            int Rkv, float scale, float *o_lat, float *work) {
    for (int h = 0; h < H; h++)
        k3_ref_attn_latent_head(qc + (int64_t)h * W, cache, n_ctx, W, Rkv, scale,
                                o_lat + (int64_t)h * Rkv, work + (int64_t)h * n_ctx);
}

static const k3_ops k_ref_ops = {
    .backend = "ref",
    .matmul = ref_matmul,
    .matmul_tn = ref_matmul_tn,
    .rmsnorm = ref_rmsnorm,
    .l2norm = ref_l2norm,
    .silu = ref_silu,
    .sigmoid = ref_sigmoid,
    .situ = ref_situ,
    .swiglu = ref_swiglu,
    .softmax = ref_softmax,
    .attnres_mix = ref_attnres_mix,
    .kda_recurrent = ref_kda_recurrent,
    .kda_chunked = ref_kda_chunked,
    .attn_latent = ref_attn_latent,
};

const k3_ops *k3_ops_ref(void) {
    return &k_ref_ops;
}
