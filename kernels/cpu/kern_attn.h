/* kern_attn.h — part of kern_tmpl.h (included there, once per ISA unit): latent attention
 * (attn_latent / attn_latent_causal, K3-MODEL.md §3.2), flash-style: a tile of (query, head)
 * rows walks the latent cache in blocks of ATT_KB rows with an online softmax (running max m,
 * running sum l, the output accumulator rescaled by exp(m_old − m_new) when the max moves).
 * The cache is one "KV head" shared by every head (MQA-like), so a tile of up to ATT_ROWS rows
 * (several heads × several queries) meets each key block while it is in L1/L2, as a GEMM tile:
 *   scores S[k, r] = Σ_i qc[r, i]·cache[k, i]       (rows r in vector lanes, the key broadcast)
 *   O[r, :] = O[r, :]·α_r + Σ_k P[k, r]·cache[k, 0:Rkv]   (columns in lanes, P broadcast)
 *
 * Determinism (the rule of k3_kernels.h, and what makes prefill = chunked prefill = decode):
 * a row's result depends only on its query, its context length n_ctx and the cache. Key blocks
 * have ABSOLUTE boundaries (cache rows [0, KB), [KB, 2KB), ...), whatever rows share the tile;
 * every score is one fma chain over i ascending from 0 (the same in every lane and in every
 * micro-tile shape), every output element one chain (·α, then fma over k ascending) per block;
 * the per-row softmax updates are lane-wise. A key at or past the row's n_ctx (the tile reaches
 * the longest row's context) gets score −inf and p = 0 exactly: it changes neither m, nor l
 * (l + 0), nor O (fma(0, v, o) = o for a finite cache), so a block past a row's context is an
 * exact no-op (α = exp(0) = 1). The cache is read only below the tile's longest context. */

#define ATT_KB        64    /* keys per block; blocks start at multiples of ATT_KB (absolute) */
#define ATT_ROWS      48    /* (query, head) rows per tile at most: a multiple of every VL */
#define ATT_QT_FLOATS 32768 /* the transposed queries of a tile: W·rows (W <= K3_ATTN_MAX_W) */
_Static_assert(ATT_ROWS % VL == 0, "tile rows are whole vectors");
_Static_assert(K3_ATTN_MAX_W *VL <= ATT_QT_FLOATS, "one vector of rows fits any W");

/* Scores of RV row vectors × NK keys: st[u·rp + v·VL ..] = Σ_i qt[i·rp + v·VL ..]·k[u·W + i]. */
#define DEF_ATT_SC(NAME, RV, NK)                                                                   \
    static void NAME(const float *qt, int rp, const float *k, int W, float *st) {                  \
        VEC a[RV][NK];                                                                             \
        _Pragma("GCC unroll 8") for (int v = 0; v < RV; v++)                                       \
            _Pragma("GCC unroll 8") for (int u = 0; u < NK; u++) a[v][u] = V_ZERO();               \
        for (int i = 0; i < W; i++) {                                                              \
            VEC q[RV];                                                                             \
            _Pragma("GCC unroll 8") for (int v = 0; v < RV; v++) q[v] =                            \
                V_LOAD(qt + i * rp + v * VL);                                                      \
            _Pragma("GCC unroll 8") for (int u = 0; u < NK; u++) {                                 \
                const VEC kb = V_SET1(k[u * W + i]);                                               \
                _Pragma("GCC unroll 8") for (int v = 0; v < RV; v++) a[v][u] =                     \
                    V_FMA(q[v], kb, a[v][u]);                                                      \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int v = 0; v < RV; v++)                                       \
            _Pragma("GCC unroll 8") for (int u = 0; u < NK; u++)                                   \
                V_STORE(st + u * rp + v * VL, a[v][u]);                                            \
    }
/* Register tiles: 3 row vectors × ATT_NK keys of scores, ATT_NR rows × ATT_CV column vectors
 * of O (AVX-512's 32 registers take twice AVX2's 16). */
#if VL >= 16
#define ATT_NK 8
#define ATT_NR 6
#define ATT_CV 4
#else
#define ATT_NK 4
#define ATT_NR 4
#define ATT_CV 3
#endif
DEF_ATT_SC(att_sc_r3kn, 3, ATT_NK)
DEF_ATT_SC(att_sc_r1kn, 1, ATT_NK)
DEF_ATT_SC(att_sc_r3k1, 3, 1)
DEF_ATT_SC(att_sc_r1k1, 1, 1)

/* NR rows × CV column vectors of O from column c: o = o·α, then o = fma(p_k, v_k, o) over the
 * block's keys k ascending (st: P of the first row, row stride 1, key stride rp). */
#define DEF_ATT_PV(NAME, NR, CV)                                                                   \
    static void NAME(float *const *os, const float *al, const float *st, int rp, const float *vr,  \
                     int W, int nk, int c) {                                                       \
        VEC a[NR][CV];                                                                             \
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {                                     \
            const VEC s = V_SET1(al[r]);                                                           \
            _Pragma("GCC unroll 8") for (int u = 0; u < CV; u++) a[r][u] =                         \
                V_MUL(V_LOAD(os[r] + c + u * VL), s);                                              \
        }                                                                                          \
        for (int k = 0; k < nk; k++) {                                                             \
            VEC v[CV];                                                                             \
            _Pragma("GCC unroll 8") for (int u = 0; u < CV; u++) v[u] =                            \
                V_LOAD(vr + k * W + c + u * VL);                                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {                                 \
                const VEC p = V_SET1(st[k * rp + r]);                                              \
                _Pragma("GCC unroll 8") for (int u = 0; u < CV; u++) a[r][u] =                     \
                    V_FMA(p, v[u], a[r][u]);                                                       \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++)                                       \
            _Pragma("GCC unroll 8") for (int u = 0; u < CV; u++)                                   \
                V_STORE(os[r] + c + u * VL, a[r][u]);                                              \
    }
DEF_ATT_PV(att_pv_rncn, ATT_NR, ATT_CV)
DEF_ATT_PV(att_pv_r1cn, 1, ATT_CV)
DEF_ATT_PV(att_pv_rnc1, ATT_NR, 1)
DEF_ATT_PV(att_pv_r1c1, 1, 1)

/* One tile of R <= rp rows (R <= ATT_ROWS): queries qs[r] [W], contexts nctx[r] >= 1, outputs
 * os[r] [Rkv]. qt [W·rp], st [ATT_KB·rp] are the caller's scratch. */
static void att_tile(const float *const *qs, const int64_t *nctx, float *const *os, int R, int rp,
                     const float *cache, int W, int Rkv, float scale, float *qt, float *st) {
    float m[ATT_ROWS], l[ATT_ROWS], al[ATT_ROWS];
    int64_t kmax = 0;
    for (int r = 0; r < R; r++) kmax = nctx[r] > kmax ? nctx[r] : kmax;
    for (int i = 0; i < W; i++) { /* queries transposed: row r of element i at qt[i·rp + r] */
        for (int r = 0; r < R; r++) qt[i * rp + r] = qs[r][i];
        for (int r = R; r < rp; r++) qt[i * rp + r] = 0.0f;
    }
    for (int r = 0; r < rp; r++) m[r] = -INFINITY, l[r] = 0.0f;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < Rkv; c++) os[r][c] = 0.0f;
    const int nv = rp / VL, cmain = Rkv - Rkv % VL;
    const VEC vscale = V_SET1(scale), vlow = V_SET1(-3.0e38f);
    for (int64_t k0 = 0; k0 < kmax; k0 += ATT_KB) {
        const int nk = (int)(kmax - k0 < ATT_KB ? kmax - k0 : ATT_KB);
        const float *kb = cache + k0 * W;
        /* scores of the block (row vectors 3 at a time, keys ATT_NK at a time) */
        for (int v = 0; v < nv;) {
            const int rv = nv - v >= 3 ? 3 : 1;
            int u = 0;
            for (; u + ATT_NK <= nk; u += ATT_NK)
                (rv == 3 ? att_sc_r3kn : att_sc_r1kn)(qt + v * VL, rp, kb + u * W, W,
                                                      st + u * rp + v * VL);
            for (; u < nk; u++)
                (rv == 3 ? att_sc_r3k1 : att_sc_r1k1)(qt + v * VL, rp, kb + u * W, W,
                                                      st + u * rp + v * VL);
            v += rv;
        }
        /* keys at or past a row's context: −inf (only near the tile's diagonal) */
        for (int r = 0; r < R; r++)
            for (int64_t k = nctx[r] > k0 ? nctx[r] : k0; k < k0 + nk; k++)
                st[(k - k0) * rp + r] = -INFINITY;
        /* online softmax, lane-wise over rows: m' = max(m, max_k s), α = exp(m − m'),
           p_k = exp(s_k − m') (0 for −inf), l' = l·α + Σ_k p_k (k ascending) */
        for (int v = 0; v < nv; v++) {
            VEC mx = V_SET1(-INFINITY);
            for (int k = 0; k < nk; k++) {
                const VEC s = V_MUL(V_LOAD(st + k * rp + v * VL), vscale);
                V_STORE(st + k * rp + v * VL, s);
                mx = V_MAX(mx, s);
            }
            const VEC mo = V_LOAD(m + v * VL), mn = V_MAX(mo, mx);
            VEC ls = V_ZERO();
            for (int k = 0; k < nk; k++) {
                const VEC s = V_LOAD(st + k * rp + v * VL);
                const VEC p = V_SEL_LT(s, vlow, V_ZERO(), v_exp(V_SUB(s, mn)));
                V_STORE(st + k * rp + v * VL, p);
                ls = V_ADD(ls, p);
            }
            const VEC a = v_exp(V_SUB(mo, mn)); /* block 0: exp(−inf) ~ 0, times l = 0, O = 0 */
            V_STORE(m + v * VL, mn);
            V_STORE(al + v * VL, a);
            V_STORE(l + v * VL, V_FMA(V_LOAD(l + v * VL), a, ls));
        }
        /* O = O·α + P·V (ATT_NR rows × ATT_CV vectors at a time, then the column tail) */
        for (int r = 0; r < R;) {
            const int nr = R - r >= ATT_NR ? ATT_NR : 1;
            int c = 0;
            for (; c + ATT_CV * VL <= cmain; c += ATT_CV * VL)
                (nr > 1 ? att_pv_rncn : att_pv_r1cn)(os + r, al + r, st + r, rp, kb, W, nk, c);
            for (; c < cmain; c += VL)
                (nr > 1 ? att_pv_rnc1 : att_pv_r1c1)(os + r, al + r, st + r, rp, kb, W, nk, c);
            for (int q = r; q < r + nr; q++)
                for (c = cmain; c < Rkv; c++) {
                    float o = os[q][c] * al[q];
                    for (int k = 0; k < nk; k++) o = V_SFMA(st[k * rp + q], kb[k * W + c], o);
                    os[q][c] = o;
                }
            r += nr;
        }
    }
    for (int r = 0; r < R; r++) {
        const VEC vl = V_SET1(l[r]);
        int c = 0;
        for (; c < cmain; c += VL) V_STORE(os[r] + c, V_DIV(V_LOAD(os[r] + c), vl));
        for (; c < Rkv; c++) os[r][c] /= l[r];
    }
}

/* attn_latent_causal on the rows (query j, head h), j in [j0, j1), h in [h0, h1), in that
 * order, tiles of up to ATT_ROWS rows (fewer when W is large: the transposed queries stay
 * within ATT_QT_FLOATS). qc [n_q, H, W], o_lat [n_q, H, Rkv]; query j's context pos0 + j + 1. */
static void attn_rows(const float *qc, const float *cache, int64_t pos0, int64_t j0, int64_t j1,
                      int h0, int h1, int H, int W, int Rkv, float scale, float *o_lat) {
    float qt[ATT_QT_FLOATS], st[ATT_KB * ATT_ROWS];
    int rp = ATT_QT_FLOATS / W / VL * VL;
    rp = rp > ATT_ROWS ? ATT_ROWS : rp;
    const float *qs[ATT_ROWS];
    float *os[ATT_ROWS];
    int64_t nctx[ATT_ROWS];
    int R = 0;
    for (int64_t j = j0; j < j1; j++)
        for (int h = h0; h < h1; h++) {
            qs[R] = qc + (j * H + h) * W;
            os[R] = o_lat + (j * H + h) * Rkv;
            nctx[R] = pos0 + j + 1;
            if (++R == rp) {
                att_tile(qs, nctx, os, R, rp, cache, W, Rkv, scale, qt, st);
                R = 0;
            }
        }
    if (R > 0) att_tile(qs, nctx, os, R, (R + VL - 1) / VL * VL, cache, W, Rkv, scale, qt, st);
}
