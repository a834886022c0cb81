/* kern_gemv.h — part of kern_tmpl.h (included there, once per ISA unit): the decode matmul,
 * y[t, o] for the products k3_cpu_gemv_path gives it (T < 4; on AVX-512 MXFP4 T < MX_GEMV_T and
 * F32/BF16 T < GV_TMAX, those 3 tokens at a time: gemv_rows_t), rows [o0, o1). Pure weight
 * streaming: each row is read once (3 tokens at a time: once per 3, the row group in L1), the
 * accumulators in registers for the whole row, no scratch to clear. F32/BF16 rows go GV_R side
 * by side (more independent loads in flight) with a software prefetch of the next group of rows
 * on every stream, or, with the backend's gemv_seq (k3_cpu_ctx; isa.c: AMD's pick), as a few
 * streams each in memory order, for the hardware prefetcher alone (gemv_seq). MXFP4 rows always go
 * GV_RM side by side.
 *
 * Same per-element arithmetic as gemm_rows (the reduction-order rule in kern_tmpl.h's header:
 * vector k of the row into a(k % 2), the VL-tail vector and the scalar tail by finish()), so a
 * token's result never depends on T or on the rows a thread got. MXFP4: each block decodes in
 * registers as mx32 does: with the unit's scaled tables (MX_TAB, AVX-512) each block's table is
 * read by its E8M0 byte; otherwise the rows' scales are converted once per row into a small
 * array first (a broadcast from memory per block instead of a scalar conversion with branches).
 * x is copied once into mx32's element order (mx_xperm) for the whole call. */

#if VL == 16
#define GV_R 8 /* F32/BF16 rows side by side: 8 × (a0, a1) + 2 x, inside 32 zmm */
/* MXFP4 rows: 4. With 2, rows of 768 spent ~26% of their time in the fold after each group;
   4 halve that (+10% GB/s measured, in L2 and from DRAM). */
#define GV_RM 4
#elif VL == 8
#define GV_R  2 /* 16 ymm */
#define GV_RM 2
#else
#define GV_R  1
#define GV_RM 1
#endif
/* Prefetch distance: the same place in the next group of rows (R rows on), at least GV_PF bytes
   ahead. Measured on DRAM-resident BF16: rows of 1024 (2 KB) 10.3 -> 12.8 GB/s against a fixed
   4 KB, rows of 4096 14.1 -> 15.0 GB/s (one thread; the read-only stream there: 15.8). */
#define GV_PF 4096
/* gemv_seq's streams (rows in memory order) prefetch this far ahead in each stream. On the Zen 5
   EPYC VM (rows of 1024 BF16 from DRAM; its two vCPUs by turns on one and on two memory paths: a
   2-thread triad of ~50 or ~80 GB/s): 2 threads 75-82 -> 85-88 GB/s on the fast path, small's
   2-thread decode +5% (7 of 8 interleaved rounds), 1 thread within its noise (median +2%, 6
   rounds) and the slow path +1%. */
#define GV_SPF 4096
/* MXFP4 rows folded at once (with MX_TAB): a fold of 4 rows of 768 was ~7% of their time */
#define GV_MXF        VL
#define GV_MAX_BLOCKS 1024 /* MXFP4 rows up to 32768 elements take this path */

/* out[b] = mx_scale(e[b]) for b < nb, vectorised (bits e << 23; e = 0: 2^-127, a subnormal;
 * e = 255: +inf, k3_e8m0_to_f32's decode). */
static inline void mx_scales(const uint8_t *e, int64_t nb, float *out) {
    int64_t b = 0;
#if VL == 16
    const __m512i sub = _mm512_set1_epi32(0x00400000), inf = _mm512_set1_epi32(0x7f800000);
    for (; b < nb; b += 16) { /* the last 1..16 under a mask (rows of 384 have 12 blocks) */
        const __mmask16 m = nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - b)) - 1);
        __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, e + b));
        __m512i bits = _mm512_slli_epi32(v, 23);
        bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(v, _mm512_setzero_si512()), sub);
        bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(255)), inf);
        _mm512_mask_storeu_ps(out + b, m, _mm512_castsi512_ps(bits));
    }
#elif VL == 8
    const __m256i sub = _mm256_set1_epi32(0x00400000), inf = _mm256_set1_epi32(0x7f800000);
    for (; b + 8 <= nb; b += 8) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(e + b)));
        __m256i bits = _mm256_slli_epi32(v, 23);
        bits = _mm256_blendv_epi8(bits, sub, _mm256_cmpeq_epi32(v, _mm256_setzero_si256()));
        bits = _mm256_blendv_epi8(bits, inf, _mm256_cmpeq_epi32(v, _mm256_set1_epi32(255)));
        _mm256_storeu_ps(out + b, _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f)));
    }
#endif
    for (; b < nb; b++) out[b] = mx_scale(e[b]);
}

/* R rows (ld elements apart) × one token over the row's [0, n_main): acc[r] = (a0, a1). PF: 0 no
 * software prefetch, 1 the same place in the next group of rows (GV_PF), 2 GV_SPF bytes on in
 * each row's own stream (gemv_seq's, whose rows follow one another in memory). */
#define DEF_GV(NAME, WT, LDW, R, PF)                                                               \
    static void NAME(const WT *w, int64_t ld, const float *x, int64_t n_main, VEC *acc) {          \
        VEC a0[R], a1[R];                                                                          \
        const int64_t pfd =                                                                        \
            PF == 2 ? (int64_t)GV_SPF : K3_MAX((int64_t)GV_PF, R * ld * (int64_t)sizeof(WT));      \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) a0[r] = V_ZERO(), a1[r] = V_ZERO();    \
        for (int64_t i = 0; i < n_main; i += 2 * VL) {                                             \
            VEC x0 = V_LOAD(x + i), x1 = V_LOAD(x + i + VL);                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                  \
                for (int pf = 0; PF && pf < (int)sizeof(WT) * 2 * VL; pf += 64)                    \
                    V_PREFETCH((const char *)(w + r * ld + i) + pfd + pf);                         \
                a0[r] = V_FMA(x0, LDW(w + r * ld + i), a0[r]);                                     \
                a1[r] = V_FMA(x1, LDW(w + r * ld + i + VL), a1[r]);                                \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[2 * r] = a0[r],                    \
                                                                    acc[2 * r + 1] = a1[r];        \
    }
DEF_GV(gv_f32_r, float, ldw_f32, GV_R, 1)
DEF_GV(gv_f32_1, float, ldw_f32, 1, 1)
DEF_GV(gv_f32_s, float, ldw_f32, 1, 0)
DEF_GV(gv_bf16_r, uint16_t, ldw_bf16, GV_R, 1)
DEF_GV(gv_bf16_1, uint16_t, ldw_bf16, 1, 1)
DEF_GV(gv_bf16_s, uint16_t, ldw_bf16, 1, 0)
/* One token's sums of rows [o, o + R) (at[2·r] = a0, at[2·r + 1] = a1) to yt[0 .. R): a whole
 * group of Rg rows without a row tail folded at once by hsum_v, else row by row by finish0 /
 * finish (the same bits). Called with Rg constant. */
#define GV_FOLD_MAX 8
_Static_assert(GV_R <= GV_FOLD_MAX && GV_RM <= GV_FOLD_MAX, "gv_fold's group");
static inline __attribute__((always_inline)) void gv_fold(const k3_tensor *W, const VEC *at, int R,
                                                          const int Rg, int64_t o, const float *xt,
                                                          int64_t n_main, float *yt) {
    if (n_main == W->shape[1] && R == Rg) {
        VEC v[GV_FOLD_MAX];
        _Pragma("GCC unroll 8") for (int r = 0; r < Rg; r++) v[r] = V_ADD(at[2 * r], at[2 * r + 1]);
        V_STOREN(yt, hsum_v(v, Rg), Rg);
    } else {
        for (int r = 0; r < R; r++)
            yt[r] = n_main == W->shape[1] ? finish0(at[2 * r], at[2 * r + 1])
                                          : finish(W, o + r, xt, n_main, at[2 * r], at[2 * r + 1]);
    }
}
/* The accumulators of R rows × NT tokens (a0, a1 each), zeroed, and stored to acc at
 * [(u·R + r)·2] (a0) and + 1 (a1) — the layout the folds read. */
#define GVT_ZERO(R, NT)                                                                            \
    VEC a0[R][NT], a1[R][NT];                                                                      \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                            \
        _Pragma("GCC unroll 4") for (int u = 0; u < NT; u++) a0[r][u] = V_ZERO(),                  \
                                                             a1[r][u] = V_ZERO();
#define GVT_STORE(R, NT)                                                                           \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                            \
        _Pragma("GCC unroll 4") for (int u = 0; u < NT; u++)                                       \
            acc[(u * R + r) * 2] = a0[r][u],                                                       \
                              acc[(u * R + r) * 2 + 1] = a1[r][u];
/* GV_T rows (ld elements apart) × NT tokens (token u's x at x + u·ldx) over [0, n_main): each
 * weight vector loaded (BF16: widened) once for the NT tokens. Accumulator (r, u) meets the terms
 * of DEF_GV's row in its order. acc[(u·R + r)·2] = a0, + 1 = a1. For F32/BF16 products of 4 to
 * GV_TMAX - 1 tokens (a decode batch's dense matmuls), where the prefill path's panels stall on
 * the weights they widen from DRAM with too few tokens to hide it. */
#define DEF_GVT(NAME, WT, LDW, R, NT)                                                              \
    static void NAME(const WT *w, int64_t ld, const float *x, int64_t ldx, int64_t n_main,         \
                     VEC *acc) {                                                                   \
        const int64_t pfd = K3_MAX((int64_t)GV_PF, R * ld * (int64_t)sizeof(WT));                  \
        GVT_ZERO(R, NT)                                                                            \
        for (int64_t i = 0; i < n_main; i += 2 * VL) {                                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                  \
                for (int pf = 0; pf < (int)sizeof(WT) * 2 * VL; pf += 64)                          \
                    V_PREFETCH((const char *)(w + r * ld + i) + pfd + pf);                         \
                const VEC w0 = LDW(w + r * ld + i), w1 = LDW(w + r * ld + i + VL);                 \
                _Pragma("GCC unroll 4") for (int u = 0; u < NT; u++) {                             \
                    a0[r][u] = V_FMA(V_LOAD(x + u * ldx + i), w0, a0[r][u]);                       \
                    a1[r][u] = V_FMA(V_LOAD(x + u * ldx + i + VL), w1, a1[r][u]);                  \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        GVT_STORE(R, NT)                                                                           \
    }
#if GV_TMAX > 4
#if VL == 16
#define GV_T 4 /* rows side by side: 4 × 3 tokens × (a0, a1) = 24 of the 32 zmm */
#else
#define GV_T 2 /* 2 × 3 × 2 = 12 of the 16 ymm */
#endif
_Static_assert(GV_T <= GV_FOLD_MAX, "gv_fold's group");
/* P_call(rg, nt, ...): GV_T rows (rg) or one × nt (1..3) tokens of a dtype, called directly */
#define DEF_GVT_SET(P, WT, LDW)                                                                    \
    DEF_GVT(P##_r1, WT, LDW, GV_T, 1)                                                              \
    DEF_GVT(P##_r2, WT, LDW, GV_T, 2)                                                              \
    DEF_GVT(P##_r3, WT, LDW, GV_T, 3)                                                              \
    DEF_GVT(P##_11, WT, LDW, 1, 1)                                                                 \
    DEF_GVT(P##_12, WT, LDW, 1, 2)                                                                 \
    DEF_GVT(P##_13, WT, LDW, 1, 3)                                                                 \
    static inline __attribute__((always_inline)) void P##_call(                                    \
        bool rg, int nt, const WT *w, int64_t ld, const float *x, int64_t ldx, int64_t n_main,     \
        VEC *acc) {                                                                                \
        if (rg)                                                                                    \
            nt == 1   ? P##_r1(w, ld, x, ldx, n_main, acc)                                         \
            : nt == 2 ? P##_r2(w, ld, x, ldx, n_main, acc)                                         \
                      : P##_r3(w, ld, x, ldx, n_main, acc);                                        \
        else                                                                                       \
            nt == 1   ? P##_11(w, ld, x, ldx, n_main, acc)                                         \
            : nt == 2 ? P##_12(w, ld, x, ldx, n_main, acc)                                         \
                      : P##_13(w, ld, x, ldx, n_main, acc);                                        \
    }
DEF_GVT_SET(gvt_bf16, uint16_t, ldw_bf16)
DEF_GVT_SET(gvt_f32, float, ldw_f32)
/* F32/BF16 rows [o0, o1) × T tokens: GV_T rows at a time (then single rows), their tokens 3 at
 * a time, each token's sums folded as gemv_seq / gemv_rows fold them (the same bits). */
static void gemv_rows_t(const k3_tensor *W, const float *x, int64_t T, int64_t o0, int64_t o1,
                        int64_t n_main, float *y) {
    const int64_t in = W->shape[1], out = W->shape[0];
    const bool bf = W->dtype == K3_DT_BF16;
    VEC acc[2 * GV_T * 3];
    for (int64_t o = o0; o < o1;) {
        const int R = o1 - o >= GV_T ? GV_T : 1;
        const uint16_t *wb = (const uint16_t *)W->data + o * in;
        const float *wf = (const float *)W->data + o * in;
        for (int64_t t0 = 0; t0 < T; t0 += 3) {
            const int nt = (int)K3_MIN((int64_t)3, T - t0);
            const float *xt = x + t0 * in;
            if (bf)
                gvt_bf16_call(R > 1, nt, wb, in, xt, in, n_main, acc);
            else
                gvt_f32_call(R > 1, nt, wf, in, xt, in, n_main, acc);
            for (int u = 0; u < nt; u++)
                gv_fold(W, acc + u * R * 2, R, GV_T, o, x + (t0 + u) * in, n_main,
                        y + (t0 + u) * out + o);
        }
        o += R;
    }
}
#endif

/* seq's streams: rows k and h + k of a call (ld = h rows apart), each prefetched GV_SPF ahead
   in its own stream. Two: in the model (small preset, interleaved rounds) three were no faster at
   one thread and slower at two (5 of 5 rounds), though a lone matrix streamed faster with three
   (below). */
#define GV_SEQ 2
DEF_GV(gv_f32_sn, float, ldw_f32, GV_SEQ, 2)
DEF_GV(gv_bf16_sn, uint16_t, ldw_bf16, GV_SEQ, 2)

/* gemv_seq's walk of F32/BF16 rows [o0, o1): the range cut in GV_SEQ parts of h rows
 * walked side by side, row k of each at a time, so memory is read in order as GV_SEQ streams
 * (the last n % GV_SEQ rows then one by one). Rows of 1024 BF16 from DRAM, one thread, on the
 * EPYC that picks seq: one stream 16 GB/s, two 25, three 31. Each row's sums are the one-row
 * walk's. Rows without a tail are folded GV_SEQB steps (2·GV_SEQB rows) at a time by hsum_v,
 * the same bits as finish0 row by row: one row's fold alone was ~10% of the walk's time (two
 * threads, small preset; rows of 1024 take ~60 ns to stream and ~20 ns to fold one by one). */
#define GV_SEQB (VL / GV_SEQ)
static void gemv_seq(const k3_tensor *W, const float *x, int64_t T, int64_t o0, int64_t o1,
                     int64_t n_main, float *y) {
    const int64_t in = W->shape[1], out = W->shape[0], h = (o1 - o0) / GV_SEQ;
    const bool bf = W->dtype == K3_DT_BF16;
    VEC acc[2 * GV_SEQ];
    int64_t k = 0;
#if GV_SEQB > 1
    for (; n_main == in && k + GV_SEQB <= h; k += GV_SEQB) {
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * in;
            VEC v[2 * GV_SEQB]; /* v[j]: row o0 + k + j; v[GV_SEQB + j]: row o0 + h + k + j */
            _Pragma("GCC unroll 8") for (int j = 0; j < GV_SEQB; j++) {
                const int64_t o = o0 + k + j;
                if (bf)
                    gv_bf16_sn((const uint16_t *)W->data + o * in, h * in, xt, n_main, acc);
                else
                    gv_f32_sn((const float *)W->data + o * in, h * in, xt, n_main, acc);
                v[j] = V_ADD(acc[0], acc[1]);
                v[GV_SEQB + j] = V_ADD(acc[2], acc[3]);
            }
            float s[VL];
            V_STORE(s, hsum_v(v, 2 * GV_SEQB));
            memcpy(y + t * out + o0 + k, s, GV_SEQB * sizeof(float));
            memcpy(y + t * out + o0 + h + k, s + GV_SEQB, GV_SEQB * sizeof(float));
        }
    }
#endif
    for (; k < h + (o1 - o0) % GV_SEQ; k++) {
        const int n = k < h ? GV_SEQ : 1;
        const int64_t o = k < h ? o0 + k : o0 + GV_SEQ * h + (k - h);
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * in;
            if (bf)
                (n > 1 ? gv_bf16_sn : gv_bf16_s)((const uint16_t *)W->data + o * in, h * in, xt,
                                                 n_main, acc);
            else
                (n > 1 ? gv_f32_sn : gv_f32_s)((const float *)W->data + o * in, h * in, xt, n_main,
                                               acc);
            for (int r = 0; r < n; r++) {
                const int64_t row = o + r * h;
                y[t * out + row] = n_main == in
                                       ? finish0(acc[2 * r], acc[2 * r + 1])
                                       : finish(W, row, xt, n_main, acc[2 * r], acc[2 * r + 1]);
            }
        }
    }
}

/* A block's scale as the decode rows take it: with the unit's scaled tables (MX_TAB) the E8M0
 * byte itself (mx32t reads its table), else mx_scale of it, converted once per row (mx_scales). */
#if MX_TAB
typedef uint8_t gv_scale;
#define GV_MX_BLOCK(codes, s, w) mx32t(codes, s, w)
#else
typedef float gv_scale;
#define GV_MX_BLOCK(codes, s, w) mx32s(codes, s, w)
#endif
/* R MXFP4 rows (codes ld_c bytes apart, scales sc[r·nb + b]) × NT tokens whose x is in mx32's
 * order (token u's at xp + u·ldx), over nb blocks: each block is decoded once for all NT tokens
 * (the decode, not the FMAs, bounds these rows: 2 or 3 tokens cost ~1.2-1.5 of one instead of 2
 * or 3). Accumulator (r, u) meets the same terms in the same order as with NT = 1: the sums of a
 * token never depend on its neighbours. acc[(u·R + r)·2] = a0, + 1 = a1. */
#define DEF_GV_MX(NAME, R, NT)                                                                     \
    static void NAME(const uint8_t *c, int64_t ld_c, const gv_scale *sc, int64_t nb,               \
                     const float *xp, int64_t ldx, VEC *acc) {                                     \
        const int64_t pfd = K3_MAX((int64_t)GV_PF, R * ld_c);                                      \
        GVT_ZERO(R, NT)                                                                            \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                  \
                if (b % 4 == 0) V_PREFETCH((const char *)(c + r * ld_c + b * 16) + pfd);           \
                VEC wv[NVX];                                                                       \
                GV_MX_BLOCK(c + r * ld_c + b * 16, sc[r * nb + b], wv);                            \
                _Pragma("GCC unroll 32") for (int k = 0; k < NVX; k += 2)                          \
                    _Pragma("GCC unroll 4") for (int u = 0; u < NT; u++) {                         \
                    const float *xu = xp + u * ldx + b * 32 + k * VL;                              \
                    a0[r][u] = V_FMA(V_LOAD(xu), wv[k], a0[r][u]);                                 \
                    a1[r][u] = V_FMA(V_LOAD(xu + VL), wv[k + 1], a1[r][u]);                        \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        GVT_STORE(R, NT)                                                                           \
    }
DEF_GV_MX(gv_mx_r, GV_RM, 1)
DEF_GV_MX(gv_mx_1, 1, 1)
DEF_GV_MX(gv_mx_r_t2, GV_RM, 2)
DEF_GV_MX(gv_mx_1_t2, 1, 2)
DEF_GV_MX(gv_mx_r_t3, GV_RM, 3)
DEF_GV_MX(gv_mx_1_t3, 1, 3)
/* a group of R = GV_RM rows (rg) or one row × nt (1..3) tokens: the matching kernel, each called
 * directly (the compiler inlines the one-token kernels of the decode step as before) */
static inline __attribute__((always_inline)) void gv_mx_call(bool rg, int nt, const uint8_t *c,
                                                             int64_t ld_c, const gv_scale *sc,
                                                             int64_t nb, const float *xp,
                                                             int64_t ldx, VEC *acc) {
    if (rg)
        nt == 1   ? gv_mx_r(c, ld_c, sc, nb, xp, ldx, acc)
        : nt == 2 ? gv_mx_r_t2(c, ld_c, sc, nb, xp, ldx, acc)
                  : gv_mx_r_t3(c, ld_c, sc, nb, xp, ldx, acc);
    else
        nt == 1   ? gv_mx_1(c, ld_c, sc, nb, xp, ldx, acc)
        : nt == 2 ? gv_mx_1_t2(c, ld_c, sc, nb, xp, ldx, acc)
                  : gv_mx_1_t3(c, ld_c, sc, nb, xp, ldx, acc);
}

#if MX_TAB && MX_XPERM
/* GV_MXF MXFP4 rows from o (no tail) × nt tokens (x in mx32's order at xp, rows of W's width):
 * GV_MXF / GV_RM groups, then one fold per token (called with nt constant: inlined per nt) */
static inline __attribute__((always_inline)) void gv_mxf(const k3_tensor *W, int64_t nb, int64_t o,
                                                         const float *xp, const int nt, float *y) {
    const int64_t in = W->shape[1], out = W->shape[0];
    VEC acc[2 * GV_RM * 3], v[3][GV_MXF];
    _Pragma("GCC unroll 8") for (int g = 0; g < GV_MXF / GV_RM; g++) {
        const int64_t og = o + g * GV_RM;
        gv_mx_call(true, nt, (const uint8_t *)W->data + og * (in / 2), in / 2, W->scale + og * nb,
                   nb, xp, in, acc);
        _Pragma("GCC unroll 4") for (int u = 0; u < nt; u++)
            _Pragma("GCC unroll 8") for (int r = 0; r < GV_RM; r++) v[u][g * GV_RM + r] =
                V_ADD(acc[(u * GV_RM + r) * 2], acc[(u * GV_RM + r) * 2 + 1]);
    }
    _Pragma("GCC unroll 4") for (int u = 0; u < nt; u++)
        V_STOREN(y + u * out + o, hsum_v(v[u], GV_MXF), GV_MXF);
}
#endif

static void gemv_rows(const k3_tensor *W, const float *x, int64_t T, int64_t o0, int64_t o1,
                      float *y, bool seq) {
    const int64_t in = W->shape[1], out = W->shape[0];
    const int64_t n_main = in - in % (2 * VL);
    const bool mx = W->dtype == K3_DT_MXFP4;
    const int64_t nb = in / 32;
    if (mx && (nb > GV_MAX_BLOCKS || (MX_XPERM && T * in > XB_FLOATS))) {
        gemm_rows(W, x, T, o0, o1, y); /* the same sums, walked in chunks */
        return;
    }
#if GV_TMAX > 4
    if (!mx && T >= 4) {
        gemv_rows_t(W, x, T, o0, o1, n_main, y);
        return;
    }
#endif
    if (seq && !mx) {
        gemv_seq(W, x, T, o0, o1, n_main, y);
        return;
    }
    float xbuf[mx && MX_XPERM ? T * in : 1]; /* at most XB_FLOATS (above) */
#if !MX_TAB
    float sc[mx ? GV_RM * GV_MAX_BLOCKS : 1]; /* the rows' scales, converted once per row */
#endif
    if (mx && MX_XPERM)
        for (int64_t t = 0; t < T; t++) mx_xperm(x + t * in, xbuf + t * in, in);
    VEC acc[2 * (GV_R > 3 * GV_RM ? GV_R : 3 * GV_RM)]; /* F32/BF16 rows; MXFP4 rows × 3 tokens */
    for (int64_t o = o0; o < o1;) {
#if MX_TAB && MX_XPERM
        /* MXFP4 rows without a tail, GV_MXF at a time: GV_MXF / GV_RM groups, then one fold */
        if (mx && n_main == in && o1 - o >= GV_MXF) {
            for (int64_t t0 = 0; t0 < T; t0 += 3) { /* tokens 3 at a time: the rows in L1 */
                const int nt = (int)K3_MIN((int64_t)3, T - t0);
                nt == 1   ? gv_mxf(W, nb, o, xbuf + t0 * in, 1, y + t0 * out)
                : nt == 2 ? gv_mxf(W, nb, o, xbuf + t0 * in, 2, y + t0 * out)
                          : gv_mxf(W, nb, o, xbuf + t0 * in, 3, y + t0 * out);
            }
            o += GV_MXF;
            continue;
        }
#endif
        const int Rg = mx ? GV_RM : GV_R; /* the rows the fold below takes at once */
        const int R = o1 - o >= Rg ? Rg : 1;
#if !MX_TAB
        if (mx)
            for (int r = 0; r < R; r++) mx_scales(W->scale + (o + r) * nb, nb, sc + r * nb);
#endif
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * in;
            VEC *at = acc; /* this token's (a0, a1) of each row */
            if (mx) {      /* tokens 3 at a time: each block decoded once for them */
                if (t % 3 == 0) {
#if MX_TAB
                    const gv_scale *s = W->scale + o * nb; /* the E8M0 bytes as they are */
#else
                    const gv_scale *s = sc;
#endif
                    gv_mx_call(R > 1, (int)K3_MIN((int64_t)3, T - t),
                               (const uint8_t *)W->data + o * (in / 2), in / 2, s, nb,
                               (MX_XPERM ? xbuf : x) + t * in, in, acc);
                }
                at = acc + t % 3 * R * 2;
            }
            if (!mx && W->dtype == K3_DT_BF16) {
                const uint16_t *w = (const uint16_t *)W->data + o * in;
                (R > 1 ? gv_bf16_r : gv_bf16_1)(w, in, xt, n_main, acc);
            } else if (!mx) {
                const float *w = (const float *)W->data + o * in;
                (R > 1 ? gv_f32_r : gv_f32_1)(w, in, xt, n_main, acc);
            }
            if (mx)
                gv_fold(W, at, R, GV_RM, o, xt, n_main, y + t * out + o);
            else
                gv_fold(W, at, R, GV_R, o, xt, n_main, y + t * out + o);
        }
        o += R;
    }
}
