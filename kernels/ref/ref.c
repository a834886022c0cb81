/* ref.c — the reference backend: plain, obviously-correct C that DEFINES every op's semantics
 * (kernels/k3_kernels.h). Single-threaded, fp32 with sequential reductions in index order.
 * Everything else (cpu/, cuda/) is tested against these functions.
 * Owns nothing but code; never allocates (callers pass scratch). */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <math.h>

/* ---- weights ------------------------------------------------------------------------------ */
static k3_status check_w(const k3_tensor *W, const char *op) {
    if (W->ndim != 2) return K3_ERR(K3_ERR_SHAPE, "%s: weight is %d-D, want 2-D [out, in]", op, W->ndim);
    if (W->dtype != K3_DT_F32 && W->dtype != K3_DT_BF16 && W->dtype != K3_DT_MXFP4)
        return K3_ERR(K3_ERR_SHAPE, "%s: weight dtype %s unsupported (F32, BF16, MXFP4)", op,
                      k3_dtype_name(W->dtype));
    if (W->dtype == K3_DT_MXFP4 && (W->shape[1] % 32 != 0 || !W->scale))
        return K3_ERR(K3_ERR_SHAPE, "%s: MXFP4 weight with in=%lld not a multiple of 32 or no scale",
                      op, (long long)W->shape[1]);
    return K3_OK;
}

static k3_status ref_matmul(const float *x, int64_t T, const k3_tensor *W, float *y) {
    K3_TRY(check_w(W, "matmul"));
    int64_t out = W->shape[0], in = W->shape[1];
    for (int64_t o = 0; o < out; o++)
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * in;
            float acc = 0.0f;
            for (int64_t i = 0; i < in; i++) acc += xt[i] * k3_tensor_get(W, o, i);
            y[t * out + o] = acc;
        }
    return K3_OK;
}

static k3_status ref_matmul_tn(const float *x, int64_t T, const k3_tensor *W, float *y) {
    K3_TRY(check_w(W, "matmul_tn"));
    int64_t out = W->shape[0], in = W->shape[1];
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < in; i++) {
            float acc = 0.0f;
            for (int64_t o = 0; o < out; o++) acc += x[t * out + o] * k3_tensor_get(W, o, i);
            y[t * in + i] = acc;
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

static inline float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

static void ref_silu(const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * sigm(x[i]);
}
static void ref_sigmoid(const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = sigm(x[i]);
}
static void ref_situ(const float *g, const float *u, int64_t n, float beta, float lin_beta, float *y) {
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

void k3_ref_kda_head_chunked(const float *q, const float *k, const float *v, const float *g,
                             const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb,
                             int dk, int dv, float scale, float *S, float *o, int C, float *work) {
    float *G = work;                       /* [C, dk] Γ, cumulative log decay */
    float *qs = G + (size_t)C * dk;        /* [C, dk] scale·q */
    float *Wm = qs + (size_t)C * dk;       /* [C, dk] W = T̃ (exp Γ ⊙ K) */
    float *U = Wm + (size_t)C * dk;        /* [C, dv] U, then V' */
    float *Ob = U + (size_t)C * dv;        /* [C, dv] output block */
    float *A = Ob + (size_t)C * dv;        /* [C, C] A, then T̃ */
    float *Aqk = A + (size_t)C * C;        /* [C, C] */
    float *eG = Aqk + (size_t)C * C;       /* [dk] exp(Γ_last) */
    int64_t t0 = 0;
    for (; C > 1 && t0 + C <= n; t0 += C) {
        /* Γ and scaled q */
        for (int i = 0; i < C; i++) {
            const float *gi = g + (t0 + i) * sqk, *qi = q + (t0 + i) * sqk;
            for (int d = 0; d < dk; d++) {
                G[i * dk + d] = (i ? G[(i - 1) * dk + d] : 0.0f) + gi[d];
                qs[i * dk + d] = qi[d] * scale;
            }
        }
        /* 1. A[i,j] = β_i Σ_d k_i k_j exp(Γ_i − Γ_j), j < i ; Aqk for j ≤ i. exp of a difference ≤ 0. */
        for (int i = 0; i < C; i++) {
            const float *ki = k + (t0 + i) * sqk;
            float bi = beta[(t0 + i) * sb];
            for (int j = 0; j < C; j++) {
                A[i * C + j] = 0.0f;
                Aqk[i * C + j] = 0.0f;
                if (j > i) continue;
                const float *kj = k + (t0 + j) * sqk;
                float a = 0.0f, aq = 0.0f;
                for (int d = 0; d < dk; d++) {
                    float e = expf(G[i * dk + d] - G[j * dk + d]);
                    a += ki[d] * kj[d] * e;
                    aq += qs[i * dk + d] * kj[d] * e;
                }
                if (j < i) A[i * C + j] = bi * a;
                Aqk[i * C + j] = aq;
            }
        }
        /* 2. T = (I + A)^-1 by forward substitution (in place, row by row: rows < i already hold T),
              then T̃[i,j] = T[i,j] β_j. Row i of T: T[i,j] = −Σ_{m=j}^{i−1} A[i,m] T[m,j], T[i,i] = 1. */
        for (int i = 0; i < C; i++) {
            float row[1024];
            K3_ASSERT(C <= 1024);
            for (int j = 0; j < i; j++) {
                float s = 0.0f;
                for (int m = j; m < i; m++) s += A[i * C + m] * (m == j ? 1.0f : A[m * C + j]);
                row[j] = -s;
            }
            for (int j = 0; j < i; j++) A[i * C + j] = row[j];
        }
        for (int i = 0; i < C; i++)
            for (int j = 0; j <= i; j++)
                A[i * C + j] = (j == i ? 1.0f : A[i * C + j]) * beta[(t0 + j) * sb];
        /* 3. W = T̃ (exp Γ ⊙ K), U = T̃ V */
        for (int i = 0; i < C; i++) {
            for (int d = 0; d < dk; d++) {
                float s = 0.0f;
                for (int j = 0; j <= i; j++) s += A[i * C + j] * expf(G[j * dk + d]) * k[(t0 + j) * sqk + d];
                Wm[i * dk + d] = s;
            }
            for (int e = 0; e < dv; e++) {
                float s = 0.0f;
                for (int j = 0; j <= i; j++) s += A[i * C + j] * v[(t0 + j) * svo + e];
                U[i * dv + e] = s;
            }
        }
        /* 4. V' = U − W S ; O = (qs ⊙ exp Γ) S + Aqk V' */
        for (int i = 0; i < C; i++)
            for (int e = 0; e < dv; e++) {
                float s = 0.0f, so = 0.0f;
                for (int d = 0; d < dk; d++) {
                    s += Wm[i * dk + d] * S[(int64_t)d * dv + e];
                    so += qs[i * dk + d] * expf(G[i * dk + d]) * S[(int64_t)d * dv + e];
                }
                U[i * dv + e] -= s;
                Ob[i * dv + e] = so;
            }
        for (int i = 0; i < C; i++)
            for (int e = 0; e < dv; e++) {
                float s = Ob[i * dv + e];
                for (int j = 0; j <= i; j++) s += Aqk[i * C + j] * U[j * dv + e];
                o[(t0 + i) * svo + e] = s;
            }
        /* S ← diag(exp Γ_last) S + Σ_j (exp(Γ_last − Γ_j) ⊙ k_j) V'_jᵀ */
        const float *Gl = G + (size_t)(C - 1) * dk;
        for (int d = 0; d < dk; d++) eG[d] = expf(Gl[d]);
        for (int d = 0; d < dk; d++) {
            float *Sd = S + (int64_t)d * dv;
            for (int e = 0; e < dv; e++) {
                float s = eG[d] * Sd[e];
                for (int j = 0; j < C; j++)
                    s += expf(Gl[d] - G[j * dk + d]) * k[(t0 + j) * sqk + d] * U[j * dv + e];
                Sd[e] = s;
            }
        }
    }
    if (t0 < n)
        k3_ref_kda_head_recurrent(q + t0 * sqk, k + t0 * sqk, v + t0 * svo, g + t0 * sqk,
                                  beta + t0 * sb, n - t0, sqk, svo, sb, dk, dv, scale, S, o + t0 * svo);
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
