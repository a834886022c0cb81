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
 * the per-row softmax updates are lane-wise; superblocks of ATT_SB keys (absolute too) each run
 * their own online softmax and merge in ascending order (below), so a decode step may run its
 * superblocks as parallel tasks and merge them after. A key at or past the row's n_ctx (the tile
 * reaches the longest row's context) gets score −inf and p = 0 exactly: it changes neither m, nor l
 * (l + 0), nor O (fma(0, v, o) = o for a finite cache), so a block past a row's context is an
 * exact no-op (α = exp(0) = 1). The cache is read only below the tile's longest context. */

#define ATT_KB        64    /* keys per block; blocks start at multiples of ATT_KB (absolute) */
#define ATT_ROWS      48    /* (query, head) rows per tile at most: a multiple of every VL */
#define ATT_QT_FLOATS 32768 /* the transposed queries of a tile: W·rows (W <= K3_ATTN_MAX_W) */
/* Row k of a cache, contiguous (blk NULL) or paged (k3_kernels.h k3_seqs: row k of the sequence
 * is row k % K3_KV_BLOCK of block blk[k / K3_KV_BLOCK]); a key block lies within one page. */
#define ATT_KROW(cache, blk, k, W)                                                                 \
    ((blk) ? (cache) + ((int64_t)(blk)[(k) / K3_KV_BLOCK] * K3_KV_BLOCK + (k) % K3_KV_BLOCK) * (W) \
           : (cache) + (int64_t)(k) * (W))
_Static_assert(K3_KV_BLOCK % ATT_KB == 0, "a key block never straddles two cache pages");
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

/* Superblocks: a row's keys are taken ATT_SB at a time, at absolute boundaries [0, SB),
 * [SB, 2SB), ... Each superblock gets its own online softmax (att_part: running max m, sum l and
 * unnormalised output o from m = −inf), and the partials are merged in ascending order into the
 * row's running (M, L, O) (att_merge). The first superblock's partial is the running state
 * itself, so a context of at most ATT_SB keys is computed exactly as one online softmax. The
 * order is fixed by the row's context alone: a tile walking its superblocks one after another
 * and a decode step whose superblocks run as separate tasks, merged afterwards by the caller
 * (cpu_attn.c), give the same bits. */
#define ATT_SB 256 /* keys per superblock: a multiple of ATT_KB */
_Static_assert(ATT_SB % ATT_KB == 0, "superblocks are whole key blocks");

/* The keys of the next block, a group at a time while the group of this one is scored: each
 * group's keys (ATT_NK rows of W floats) are read as ATT_NK short streams, too short for the
 * hardware prefetcher, so from DRAM every line cost a full miss (decode at 8k context: the
 * scores ran at ~4 GB/s of keys per thread). Into L2 (locality 2), so this block's keys stay in L1
 * for P·V; only below end (the superblock's last key). */
static inline void att_prefetch(const float *p, const float *end, int n) {
    const char *c = (const char *)p, *e = (const char *)(p + n);
    if ((const char *)end < e) e = (const char *)end;
    for (; c < e; c += 64) __builtin_prefetch(c, 0, 2);
}

/* queries transposed: row r of element i at qt[i·rp + r] (rows R..rp zero) */
static void att_qt(const float *const *qs, int R, int rp, int W, float *qt) {
    for (int i = 0; i < W; i++) {
        for (int r = 0; r < R; r++) qt[i * rp + r] = qs[r][i];
        for (int r = R; r < rp; r++) qt[i * rp + r] = 0.0f;
    }
}

/* The partial of keys [k0s, k1s) (k0s a multiple of ATT_SB, k1s <= k0s + ATT_SB) for R <= rp
 * rows with contexts nctx[r] (R <= ATT_ROWS): os[r] [Rkv] = Σ_k p_k·cache[k, 0:Rkv], m [rp] the
 * running max, l [rp] the running sum, block after block (K3-MODEL.md §3.2's softmax, online).
 * A row with nctx[r] <= k0s has no key here: its partial is meaningless (att_merge skips it).
 * qt: att_qt's transposed queries; st [ATT_KB·rp] scratch. */
static void att_part(const float *qt, const int64_t *nctx, float *const *os, int R, int rp,
                     const float *cache, const int32_t *blk, int W, int Rkv, float scale,
                     int64_t k0s, int64_t k1s, float *st, float *m, float *l) {
    for (int r = 0; r < rp; r++) m[r] = -INFINITY, l[r] = 0.0f;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < Rkv; c++) os[r][c] = 0.0f;
    float al[ATT_ROWS];
    const int nv = rp / VL, cmain = Rkv - Rkv % VL;
    const VEC vscale = V_SET1(scale), vlow = V_SET1(-3.0e38f);
    { /* the first block at once */
        const float *kb0 = ATT_KROW(cache, blk, k0s, W);
        att_prefetch(kb0, kb0 + (k1s - k0s < ATT_KB ? k1s - k0s : ATT_KB) * W, ATT_KB * W);
    }
    for (int64_t k0 = k0s; k0 < k1s; k0 += ATT_KB) {
        const int nk = (int)(k1s - k0 < ATT_KB ? k1s - k0 : ATT_KB);
        const float *kb = ATT_KROW(cache, blk, k0, W);
        /* the next block (another page of a paged cache), for the prefetch */
        const float *nb = k0 + ATT_KB < k1s ? ATT_KROW(cache, blk, k0 + ATT_KB, W) : NULL;
        const float *nb_end =
            nb ? nb + (k1s - k0 - ATT_KB < ATT_KB ? k1s - k0 - ATT_KB : ATT_KB) * W : NULL;
        /* scores of the block (row vectors 3 at a time, keys ATT_NK at a time) */
        for (int v = 0; v < nv;) {
            const int rv = nv - v >= 3 ? 3 : 1;
            int u = 0;
            for (; u + ATT_NK <= nk; u += ATT_NK) {
                if (v == 0 && nb) att_prefetch(nb + u * W, nb_end, ATT_NK * W);
                (rv == 3 ? att_sc_r3kn : att_sc_r1kn)(qt + v * VL, rp, kb + u * W, W,
                                                      st + u * rp + v * VL);
            }
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
}

/* Merges the partial (m, l, op) of the superblock from key k0s into the running (M, L, os) of
 * rows r < R (M, L, m, l: rp lanes): M' = max(M, m), a = exp(M − M'), b = exp(m − M'),
 * L = L·a + l·b, O = O·a + op·b (one fma per element). Rows with nctx[r] <= k0s are left as
 * they are (nctx NULL: every row has keys there). */
static void att_merge(const int64_t *nctx, int64_t k0s, int R, int rp, float *M, float *L,
                      float *const *os, const float *m, const float *l, const float *const *op,
                      int Rkv) {
    float a[ATT_ROWS], b[ATT_ROWS], Mn[ATT_ROWS], Ln[ATT_ROWS];
    for (int v = 0; v < rp / VL; v++) {
        const VEC mo = V_LOAD(M + v * VL), ms = V_LOAD(m + v * VL), mn = V_MAX(mo, ms);
        const VEC va = v_exp(V_SUB(mo, mn)), vb = v_exp(V_SUB(ms, mn));
        V_STORE(a + v * VL, va);
        V_STORE(b + v * VL, vb);
        V_STORE(Mn + v * VL, mn);
        V_STORE(Ln + v * VL, V_FMA(V_LOAD(L + v * VL), va, V_MUL(V_LOAD(l + v * VL), vb)));
    }
    const int cmain = Rkv - Rkv % VL;
    for (int r = 0; r < R; r++) {
        if (nctx && nctx[r] <= k0s) continue;
        M[r] = Mn[r], L[r] = Ln[r];
        const VEC va = V_SET1(a[r]), vb = V_SET1(b[r]);
        int c = 0;
        for (; c < cmain; c += VL)
            V_STORE(os[r] + c, V_FMA(V_LOAD(os[r] + c), va, V_MUL(V_LOAD(op[r] + c), vb)));
        for (; c < Rkv; c++) os[r][c] = V_SFMA(os[r][c], a[r], op[r][c] * b[r]);
    }
}

/* os[r] /= L[r], the end of every row */
static void att_final(float *const *os, const float *L, int R, int Rkv) {
    const int cmain = Rkv - Rkv % VL;
    for (int r = 0; r < R; r++) {
        const VEC vl = V_SET1(L[r]);
        int c = 0;
        for (; c < cmain; c += VL) V_STORE(os[r] + c, V_DIV(V_LOAD(os[r] + c), vl));
        for (; c < Rkv; c++) os[r][c] /= L[r];
    }
}

/* One tile of R <= rp rows (R <= ATT_ROWS): queries qs[r] [W], contexts nctx[r] >= 1, outputs
 * os[r] [Rkv], superblock after superblock. qt [W·rp], st [ATT_KB·rp], opb [rp·Rkv] (the later
 * superblocks' partials) are the caller's scratch. */
static void att_tile(const float *const *qs, const int64_t *nctx, float *const *os, int R, int rp,
                     const float *cache, const int32_t *blk, int W, int Rkv, float scale, float *qt,
                     float *st, float *opb) {
    float M[ATT_ROWS], L[ATT_ROWS], m[ATT_ROWS], l[ATT_ROWS];
    float *op[ATT_ROWS];
    int64_t kmax = 0;
    for (int r = 0; r < R; r++) kmax = nctx[r] > kmax ? nctx[r] : kmax;
    for (int r = 0; r < R; r++) op[r] = opb + (int64_t)r * Rkv;
    att_qt(qs, R, rp, W, qt);
    att_part(qt, nctx, os, R, rp, cache, blk, W, Rkv, scale, 0, kmax < ATT_SB ? kmax : ATT_SB, st,
             M, L);
    for (int64_t k0s = ATT_SB; k0s < kmax; k0s += ATT_SB) {
        att_part(qt, nctx, op, R, rp, cache, blk, W, Rkv, scale, k0s,
                 kmax - k0s < ATT_SB ? kmax : k0s + ATT_SB, st, m, l);
        att_merge(nctx, k0s, R, rp, M, L, os, m, l, (const float *const *)op, Rkv);
    }
    att_final(os, L, R, Rkv);
}

/* attn_latent_causal on the rows (query j, head h), j in [j0, j1), h in [h0, h1), in that
 * order, tiles of up to ATT_ROWS rows (fewer when W is large: the transposed queries stay
 * within ATT_QT_FLOATS). qc [n_q, H, W], o_lat [n_q, H, Rkv]; query j's context pos0 + j + 1. */
static void attn_rows(const float *qc, const float *cache, const int32_t *blk, int64_t pos0,
                      int64_t j0, int64_t j1, int h0, int h1, int H, int W, int Rkv, float scale,
                      float *o_lat) {
    float qt[ATT_QT_FLOATS], st[ATT_KB * ATT_ROWS], opb[ATT_QT_FLOATS]; /* rp·Rkv <= rp·W */
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
                att_tile(qs, nctx, os, R, rp, cache, blk, W, Rkv, scale, qt, st, opb);
                R = 0;
            }
        }
    if (R > 0)
        att_tile(qs, nctx, os, R, (R + VL - 1) / VL * VL, cache, blk, W, Rkv, scale, qt, st, opb);
}

/* A decode step by superblocks (cpu_attn.c runs the superblocks as tasks): heads [h0, h1)
 * (h1 − h0 <= ATT_ROWS, (h1 − h0)·W within ATT_QT_FLOATS once rounded to whole vectors) of one
 * query qc [H, W] over the superblock of keys from k0s of a context of n_ctx: o [h1 − h0, Rkv]
 * (o may be the running output when k0s = 0), m, l [h1 − h0]. attn_rows' bits once merged
 * (attn_merge) in superblock order and finished (attn_final). */
static void attn_part(const float *qc, const float *cache, const int32_t *blk, int64_t n_ctx,
                      int h0, int h1, int W, int Rkv, float scale, int64_t k0s, float *o, float *m,
                      float *l) {
    float qt[ATT_QT_FLOATS], st[ATT_KB * ATT_ROWS], mm[ATT_ROWS], ll[ATT_ROWS];
    const float *qs[ATT_ROWS] = {0}; /* (initialised: gcc cannot see that R >= 1) */
    float *os[ATT_ROWS] = {0};
    int64_t nctx[ATT_ROWS] = {0};
    const int R = h1 - h0, rp = (R + VL - 1) / VL * VL;
    for (int r = 0; r < R; r++)
        qs[r] = qc + (int64_t)(h0 + r) * W, os[r] = o + (int64_t)r * Rkv, nctx[r] = n_ctx;
    att_qt(qs, R, rp, W, qt);
    att_part(qt, nctx, os, R, rp, cache, blk, W, Rkv, scale, k0s,
             n_ctx - k0s < ATT_SB ? n_ctx : k0s + ATT_SB, st, mm, ll);
    for (int r = 0; r < R; r++) m[r] = mm[r], l[r] = ll[r];
}
/* att_merge of R <= ATT_ROWS rows, each with keys in the superblock: the partial (m, l, op
 * [R, Rkv]) into the running (M, L, o [R, Rkv]). */
static void attn_merge(int R, float *M, float *L, float *o, const float *m, const float *l,
                       const float *op, int Rkv) {
    float Mv[ATT_ROWS] = {0}, Lv[ATT_ROWS] = {0}, mv[ATT_ROWS] = {0}, lv[ATT_ROWS] = {0};
    float *os[ATT_ROWS] = {0};
    const float *ops[ATT_ROWS] = {0};
    const int rp = (R + VL - 1) / VL * VL;
    for (int r = 0; r < R; r++) {
        Mv[r] = M[r], Lv[r] = L[r], mv[r] = m[r], lv[r] = l[r];
        os[r] = o + (int64_t)r * Rkv, ops[r] = op + (int64_t)r * Rkv;
    }
    att_merge(NULL, 0, R, rp, Mv, Lv, os, mv, lv, ops, Rkv);
    for (int r = 0; r < R; r++) M[r] = Mv[r], L[r] = Lv[r];
}
/* o [R, Rkv] /= L[r] */
static void attn_final(int R, float *o, const float *L, int Rkv) {
    float *os[ATT_ROWS];
    for (int r0 = 0; r0 < R; r0 += ATT_ROWS) {
        const int n = R - r0 < ATT_ROWS ? R - r0 : ATT_ROWS;
        for (int r = 0; r < n; r++) os[r] = o + (int64_t)(r0 + r) * Rkv;
        att_final(os, L + r0, n, Rkv);
    }
}
