/* kern_kda.h — part of kern_tmpl.h (included there, once per ISA unit): KDA per head.
 *
 * The delta-rule recurrence of one head (K3-MODEL.md §2.2) over a range of value columns. The
 * columns of the state are independent: column j of S meets only u_j = (Sᵀk)_j, δ_j =
 * β(v_j − u_j) and o_j, so a block of KDA_NV·VL columns walks all n tokens on its own, its slice
 * of S (dk × 64 floats, 32 KiB at dk 128 on AVX-512) staying in L1 and u, δ, o in registers.
 *
 * One pass over the block per token: row i finishes token t (S_i += k_{t,i} δ_t; o_t +=
 * q_{t,i} S_i) and starts token t+1 (S_i ·= exp g_{t+1,i}; u_{t+1} += k_{t+1,i} S_i). The first
 * token of a call gets a start-only pass, the last a finish-only pass. Every element of S, u and o
 * sees the same operations in the same order either way (fma, fma, multiply, fma; u and o summed
 * over i ascending, one accumulator per column), so a sequence gives the same bits in one call or
 * token by token, and whatever the column range a thread got (the scalar tail columns of a SIMD
 * unit use fmaf: the same rounding as the vector lanes). Against ref: fused multiply-adds where
 * ref rounds the product, and v_exp for expf. */

#define KDA_NV 4 /* vectors per column block */

/* exp(g[i]) for rows [i0, i0 + VL) into eb (rows >= dk padded); returns the rows that exist. */
static inline int kda_exp_rows(const float *g, int i0, int dk, float *eb) {
    V_STORE(eb, v_exp(ld_pad(g, i0, dk)));
    return dk - i0 < VL ? dk - i0 : VL;
}

/* nv vectors of columns: S, v, o point at the block's first column (row 0, token 0). */
static inline __attribute__((always_inline)) void
kda_block(const int nv, const float *q, const float *k, const float *v, const float *g,
          const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb, int dk, int dv,
          float scale, float *S, float *o) {
    VEC u[KDA_NV], d[KDA_NV], ac[KDA_NV];
    float eb[VL];
    _Pragma("GCC unroll 4") for (int c = 0; c < nv; c++) u[c] = V_ZERO();
    for (int i0 = 0; i0 < dk; i0 += VL) { /* start token 0: decay, u = Sᵀk */
        const int nr = kda_exp_rows(g, i0, dk, eb);
        for (int r = 0; r < nr; r++) {
            float *Si = S + (int64_t)(i0 + r) * dv;
            const VEC e = V_SET1(eb[r]), kn = V_SET1(k[i0 + r]);
            _Pragma("GCC unroll 4") for (int c = 0; c < nv; c++) {
                VEC s = V_MUL(V_LOAD(Si + c * VL), e);
                u[c] = V_FMA(kn, s, u[c]);
                V_STORE(Si + c * VL, s);
            }
        }
    }
    for (int64_t t = 0; t < n; t++) {
        const float *qt = q + t * sqk, *kt = k + t * sqk, *vt = v + t * svo;
        const VEC b = V_SET1(beta[t * sb]);
        _Pragma("GCC unroll 4") for (int c = 0; c < nv; c++) {
            d[c] = V_MUL(b, V_SUB(V_LOAD(vt + c * VL), u[c])); /* δ */
            ac[c] = V_ZERO();
            u[c] = V_ZERO();
        }
        if (t + 2 < n) /* rows of a token are sqk floats apart (4 KiB and more): prefetch */
            for (int i = 0; i < dk; i += 16) {
                V_PREFETCH(g + (t + 2) * sqk + i);
                V_PREFETCH(k + (t + 2) * sqk + i);
                V_PREFETCH(q + (t + 1) * sqk + i);
            }
        if (t + 1 < n) { /* finish t, start t + 1 */
            const float *kn1 = kt + sqk, *gn = g + (t + 1) * sqk;
            for (int i0 = 0; i0 < dk; i0 += VL) {
                const int nr = kda_exp_rows(gn, i0, dk, eb);
                for (int r = 0; r < nr; r++) {
                    const int i = i0 + r;
                    float *Si = S + (int64_t)i * dv;
                    const VEC kk = V_SET1(kt[i]), qq = V_SET1(qt[i]), e = V_SET1(eb[r]),
                              kn = V_SET1(kn1[i]);
                    _Pragma("GCC unroll 4") for (int c = 0; c < nv; c++) {
                        VEC s = V_FMA(kk, d[c], V_LOAD(Si + c * VL));
                        ac[c] = V_FMA(qq, s, ac[c]);
                        s = V_MUL(s, e);
                        u[c] = V_FMA(kn, s, u[c]);
                        V_STORE(Si + c * VL, s);
                    }
                }
            }
        } else { /* finish the last token */
            for (int i = 0; i < dk; i++) {
                float *Si = S + (int64_t)i * dv;
                const VEC kk = V_SET1(kt[i]), qq = V_SET1(qt[i]);
                _Pragma("GCC unroll 4") for (int c = 0; c < nv; c++) {
                    VEC s = V_FMA(kk, d[c], V_LOAD(Si + c * VL));
                    ac[c] = V_FMA(qq, s, ac[c]);
                    V_STORE(Si + c * VL, s);
                }
            }
        }
        float *ot = o + t * svo;
        _Pragma("GCC unroll 4") for (int c = 0; c < nv; c++)
            V_STORE(ot + c * VL, V_MUL(V_SET1(scale), ac[c]));
    }
}

/* One column in scalar arithmetic, the same operations as a vector lane (the tail of dv % VL). */
static void kda_col(const float *q, const float *k, const float *v, const float *g,
                    const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb, int dk,
                    int dv, float scale, float *S, float *o) {
    float eb[VL], u = 0.0f;
    for (int i0 = 0; i0 < dk; i0 += VL) {
        const int nr = kda_exp_rows(g, i0, dk, eb);
        for (int r = 0; r < nr; r++) {
            float *s = S + (int64_t)(i0 + r) * dv;
            *s = *s * eb[r];
            u = V_SFMA(k[i0 + r], *s, u);
        }
    }
    for (int64_t t = 0; t < n; t++) {
        const float *qt = q + t * sqk, *kt = k + t * sqk;
        const float d = beta[t * sb] * (v[t * svo] - u);
        const bool more = t + 1 < n;
        float ac = 0.0f;
        u = 0.0f;
        for (int i0 = 0; i0 < dk; i0 += VL) {
            const int nr =
                more ? kda_exp_rows(g + (t + 1) * sqk, i0, dk, eb) : (dk - i0 < VL ? dk - i0 : VL);
            for (int r = 0; r < nr; r++) {
                const int i = i0 + r;
                float *s = S + (int64_t)i * dv;
                *s = V_SFMA(kt[i], d, *s);
                ac = V_SFMA(qt[i], *s, ac);
                if (more) {
                    *s = *s * eb[r];
                    u = V_SFMA(kt[sqk + i], *s, u);
                }
            }
        }
        o[t * svo] = scale * ac;
    }
}

/* KDA recurrence of one head for value columns [j0, j1) (see cpu_kern.h). */
static void kda_head(const float *q, const float *k, const float *v, const float *g,
                     const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb, int dk,
                     int dv, int j0, int j1, float scale, float *S, float *o) {
    int j = j0;
    for (; j + KDA_NV * VL <= j1; j += KDA_NV * VL)
        kda_block(KDA_NV, q, k, v + j, g, beta, n, sqk, svo, sb, dk, dv, scale, S + j, o + j);
    for (; j + VL <= j1; j += VL)
        kda_block(1, q, k, v + j, g, beta, n, sqk, svo, sb, dk, dv, scale, S + j, o + j);
    for (; j < j1; j++) kda_col(q, k, v + j, g, beta, n, sqk, svo, sb, dk, dv, scale, S + j, o + j);
}
