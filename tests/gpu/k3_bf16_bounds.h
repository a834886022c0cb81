/* k3_bf16_bounds.h — the element-wise bounds the cuda tests hold the bf16 tensor-core kernels to
 * (tests/tolerances.h derives them): mla_check for the MLA of kernels/cuda/mla_mma.cu, and
 * kda_mma_check for the chunk-16 KDA prefill of kernels/cuda/kda.cu (head_mma). Host code,
 * float64; each returns the number of elements past their bound and raises *worst to the largest
 * |got − want| / bound it saw. */
#ifndef K3_BF16_BOUNDS_H
#define K3_BF16_BOUNDS_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tolerances.h"

/* The tensor-core MLA's bound (tests/tolerances.h, K3_TOL_MLA_BF16_*) for one query: got, want
   [H, Rkv]; qc [H, W]; rows [n, W] its context. rounded: want was computed (ref) from qc and rows
   rounded to bf16, which are what is passed here, so only the kernel's own arithmetic counts;
   else from the fp32 values, and bf16's input rounding counts too. terms 3 or 4: the split
   operands (K3_TOL_MLA_SPLIT_IN; rounded must be false). The weights p_j and the
   score magnitudes come from a float64 evaluation. Returns the elements past their bound; *worst
   = the largest |got − want| / bound seen. */
static int64_t mla_check(const float *got, const float *want, const float *qc, const float *rows,
                         int64_t n, int H, int W, int Rkv, float scale, bool rounded, int terms,
                         double *worst) {
    double *p = malloc((size_t)n * sizeof(double));
    int64_t bad = 0;
    for (int h = 0; h < H; h++) {
        double amax = 0, m = -INFINITY, z = 0;
        for (int64_t j = 0; j < n; j++) {
            double sc = 0, a = 0;
            for (int i = 0; i < W; i++) {
                const double x = (double)qc[h * W + i] * rows[j * W + i];
                sc += x, a += fabs(x);
            }
            p[j] = sc * scale, a *= scale;
            amax = a > amax ? a : amax, m = p[j] > m ? p[j] : m;
        }
        for (int64_t j = 0; j < n; j++) z += p[j] = exp(p[j] - m);
        const double sides = K3_TOL_MLA_BF16_SIDES, u = K3_FP32_U;
        double ds, ep, rel;
        if (terms >= 3) { /* split operands: fp32-grade */
            ds = sides * (3.0 * W + 3) * u * amax + K3_TOL_MLA_SPLIT_IN * amax;
            ep = 1.01 * ds + 32 * u;
            rel = 2 * ep / (1 - ep) + sides * (3.0 * (double)n + 32) * u + K3_TOL_MLA_SPLIT_IN;
        } else {
            ds = sides * (W + 3) * u * amax;
            if (!rounded) ds += K3_TOL_MLA_BF16_IN * amax;
            ep = K3_TOL_BF16_U + 1.01 * ds + 32 * u;
            rel = 2 * ep / (1 - ep) + (rounded ? 0 : K3_TOL_BF16_U) + sides * (double)(n + 32) * u;
        }
        for (int e = 0; e < Rkv; e++) {
            double wsum = 0;
            for (int64_t j = 0; j < n; j++) wsum += p[j] / z * fabs(rows[j * W + e]);
            const double bound = rel * wsum + 1e-30;
            const double d = fabs((double)got[h * Rkv + e] - want[h * Rkv + e]);
            bad += !(d <= bound);
            if (d / bound > *worst || isnan(d)) *worst = isnan(d) ? INFINITY : d / bound;
        }
    }
    free(p);
    return bad;
}

/* The chunk-16 tensor-core KDA (kda.cu head_mma) against ref, element by element: a float64 run
   of the same chunk algebra that carries, next to the values, a first-order bound of the error the
   kernel's bf16 operands can cause (tests/tolerances.h K3_TOL_KDA_MMA_*): per chunk, with
   magnitudes |X|·|Y| of each product, W = QL·S and U = KL·S (both operands rounded: 2u_b, and the
   state's error E carried in: |QL|·E), Δ = T·β(V − U) with T = (I + βA)⁻¹ (E_Δ = |T|·β·E_U + u_b
   |Δ| for Δ's own rounding), o = scale(W + B·Δ) (2u_b on |B||Δ| for B's and Δ's rounding),
   S' = Λ S + KRᵀ Δ (E' = Λ E + 2u_b |KR|ᵀ|Δ| + |KR|ᵀ E_Δ); every magnitude term also carries
   K3_TOL_KDA_MMA_SLACK for the fp32 sums, exps and ref's own rounding. The ragged tail runs the
   recurrence (fp32 on both sides): E' = D E + |k| β |k|ᵀ D E + slack. Returns the elements of o
   and S past their bound; *worst = max |got − want| / bound. q, k, v, g, beta, S0: the op's
   inputs (one head h of H); o, S: ref's and the kernel's. */
static int64_t kda_mma_check(const float *q, const float *k, const float *v, const float *g,
                             const float *beta, int64_t n, int H, int dk, int dv, float scale,
                             const float *S0, const float *want_o, const float *want_S,
                             const float *got_o, const float *got_S, double *worst) {
    const double ub = K3_TOL_BF16_U, sl = K3_TOL_KDA_MMA_SLACK;
    const size_t nS = (size_t)dk * dv;
    double *S = malloc(nS * 8), *E = malloc(nS * 8), *Sn = malloc(nS * 8), *En = malloc(nS * 8);
    double *G = malloc((size_t)16 * dk * 8), *U = malloc((size_t)16 * dv * 8);
    double *aU = malloc((size_t)16 * dv * 8), *EU = malloc((size_t)16 * dv * 8);
    double *W = malloc((size_t)16 * dv * 8), *aW = malloc((size_t)16 * dv * 8);
    double *D = malloc((size_t)16 * dv * 8), *ED = malloc((size_t)16 * dv * 8);
    int64_t bad = 0;
#define KX(a, t, i) ((double)(a)[((t)*H + h) * dk + (i)])
#define VX(a, t, j) ((a)[((t)*H + h) * dv + (j)])
#define CHECK_EL(gv, wv, b)                                                                        \
    do {                                                                                           \
        const double d_ = fabs((double)(gv) - (wv)), b_ = (b) + 1e-30;                             \
        bad += !(d_ <= b_);                                                                        \
        if (isnan(d_) || d_ / b_ > *worst) *worst = isnan(d_) ? INFINITY : d_ / b_;                \
    } while (0)
    for (int h = 0; h < H; h++) {
        for (size_t e = 0; e < nS; e++) S[e] = S0[h * nS + e], E[e] = 0;
        int64_t t0 = 0;
        for (; t0 + 16 <= n; t0 += 16) {
            for (int i = 0; i < dk; i++)
                for (int t = 0; t < 16; t++)
                    G[t * dk + i] = (t ? G[(t - 1) * dk + i] : 0) + KX(g, t0 + t, i);
            double A[16][16] = {{0}}, B[16][16] = {{0}}, T[16][16] = {{0}}, bt[16];
            for (int t = 0; t < 16; t++) {
                bt[t] = beta[(t0 + t) * H + h];
                for (int sx = 0; sx <= t; sx++) {
                    double a = 0, b = 0;
                    for (int i = 0; i < dk; i++) {
                        const double f = KX(k, t0 + sx, i) * exp(G[t * dk + i] - G[sx * dk + i]);
                        a += KX(k, t0 + t, i) * f, b += KX(q, t0 + t, i) * f;
                    }
                    A[t][sx] = sx < t ? a : 0, B[t][sx] = b;
                }
            }
            /* T = (I + βA)⁻¹, lower triangular with a unit diagonal */
            for (int c = 0; c < 16; c++) {
                T[c][c] = 1;
                for (int t = c + 1; t < 16; t++) {
                    double x = 0;
                    for (int sx = c; sx < t; sx++) x -= bt[t] * A[t][sx] * T[sx][c];
                    T[t][c] = x;
                }
            }
            for (int t = 0; t < 16; t++)
                for (int j = 0; j < dv; j++) {
                    double u = 0, au = 0, eu = 0, w = 0, aw = 0, ew = 0;
                    for (int i = 0; i < dk; i++) {
                        const double el = exp(G[t * dk + i]), kl = KX(k, t0 + t, i) * el;
                        const double ql = KX(q, t0 + t, i) * el, sv = S[i * dv + j];
                        u += kl * sv, au += fabs(kl * sv), eu += fabs(kl) * E[i * dv + j];
                        w += ql * sv, aw += fabs(ql * sv), ew += fabs(ql) * E[i * dv + j];
                    }
                    U[t * dv + j] = u, aU[t * dv + j] = au,
                               EU[t * dv + j] = (2 * ub + sl) * au + eu;
                    W[t * dv + j] = w, aW[t * dv + j] = (2 * ub + sl) * aw + ew;
                }
            for (int j = 0; j < dv; j++)
                for (int t = 0; t < 16; t++) {
                    double d = 0, ed = 0;
                    for (int c = 0; c <= t; c++) {
                        d += T[t][c] * bt[c] * (VX(v, t0 + c, j) - U[c * dv + j]);
                        ed += fabs(T[t][c]) * bt[c] * EU[c * dv + j];
                    }
                    D[t * dv + j] = d, ED[t * dv + j] = ed + (ub + sl) * fabs(d);
                }
            for (int t = 0; t < 16; t++)
                for (int j = 0; j < dv; j++) {
                    double o = W[t * dv + j], bd = 0, ebd = 0;
                    for (int sx = 0; sx <= t; sx++) {
                        o += B[t][sx] * D[sx * dv + j], bd += fabs(B[t][sx] * D[sx * dv + j]);
                        ebd += fabs(B[t][sx]) * ED[sx * dv + j];
                    }
                    const double bound = scale * (aW[t * dv + j] + (2 * ub + sl) * bd + ebd);
                    CHECK_EL(VX(got_o, t0 + t, j), VX(want_o, t0 + t, j), bound);
                    (void)o;
                }
            for (int i = 0; i < dk; i++) {
                const double lam = exp(G[15 * dk + i]);
                for (int j = 0; j < dv; j++) {
                    double sv = lam * S[i * dv + j], a = fabs(sv), ea = lam * E[i * dv + j];
                    for (int sx = 0; sx < 16; sx++) {
                        const double kr = KX(k, t0 + sx, i) * exp(G[15 * dk + i] - G[sx * dk + i]);
                        sv += kr * D[sx * dv + j], a += fabs(kr * D[sx * dv + j]);
                        ea += fabs(kr) * ED[sx * dv + j];
                    }
                    Sn[i * dv + j] = sv, En[i * dv + j] = ea + (2 * ub + sl) * a;
                }
            }
            memcpy(S, Sn, nS * 8), memcpy(E, En, nS * 8);
        }
        for (; t0 < n; t0++) { /* the tail: the recurrence, fp32 on both sides */
            const double b = beta[t0 * H + h];
            double *dE = D; /* β|k|ᵀ D E per column */
            for (int i = 0; i < dk; i++) {
                const double e = exp(KX(g, t0, i));
                for (int j = 0; j < dv; j++) S[i * dv + j] *= e, E[i * dv + j] *= e;
            }
            for (int j = 0; j < dv; j++) {
                double u = 0, au = 0, eu = 0;
                for (int i = 0; i < dk; i++) {
                    u += KX(k, t0, i) * S[i * dv + j], au += fabs(KX(k, t0, i) * S[i * dv + j]);
                    eu += fabs(KX(k, t0, i)) * E[i * dv + j];
                }
                const double d = b * (VX(v, t0, j) - u);
                dE[j] = b * (eu + sl * au);
                for (int i = 0; i < dk; i++) {
                    S[i * dv + j] += KX(k, t0, i) * d;
                    E[i * dv + j] += fabs(KX(k, t0, i)) * dE[j] + sl * fabs(S[i * dv + j]);
                }
                double o = 0, ao = 0, eo = 0;
                for (int i = 0; i < dk; i++) {
                    o += KX(q, t0, i) * S[i * dv + j], ao += fabs(KX(q, t0, i) * S[i * dv + j]);
                    eo += fabs(KX(q, t0, i)) * E[i * dv + j];
                }
                (void)o;
                CHECK_EL(VX(got_o, t0, j), VX(want_o, t0, j), scale * (eo + sl * ao));
            }
        }
        for (size_t e = 0; e < nS; e++)
            CHECK_EL(got_S[h * nS + e], want_S[h * nS + e], E[e] + sl * fabs(S[e]));
    }
#undef KX
#undef VX
#undef CHECK_EL
    free(S), free(E), free(Sn), free(En), free(G), free(U), free(aU), free(EU), free(W), free(aW);
    free(D), free(ED);
    return bad;
}

#endif /* K3_BF16_BOUNDS_H */
