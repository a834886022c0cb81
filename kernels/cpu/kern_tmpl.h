/* kern_tmpl.h — the one body of the cpu backend's hot loops, included once by each ISA's
 * translation unit (kern_avx512.c, kern_avx2.c, kern_scalar.c) after it defines the vector
 * vocabulary below; the unit's compile flags decide which instructions the same code becomes.
 * Not a header of its own: no include guard, no declarations for others.
 *
 * Vocabulary each unit defines: VEC (a vector of VL floats), VL, KERN_NAME (the table's
 * symbol), KERN_ISA (its name), GR × GT (weight rows × tokens of a prefill register tile: GR·GT
 * accumulators + GT x vectors + one weight vector fit the ISA's registers), and the operations
 *   V_ZERO() V_SET1(f) V_LOAD(p) V_STORE(p, v) V_ADD V_SUB V_MUL V_DIV V_MIN V_MAX
 *   V_FMA(a, b, c) = a·b + c   V_SFMA(a, b, c): the same on one float
 *   V_HSUM(v)   V_HMAX(v)   V_ABS(v)   V_COPYSIGN(mag, sgn)   V_SEL_LT(a, b, x, y) = a < b ? x : y
 *   hsum_v(v, n)  a vector whose lane i < n <= VL is V_HSUM(v[i]) + 0.0f, the same bits, the
 *                 rows folded together (a matmul's finished rows: a decode group, a prefill tile)
 *   V_STOREN(p, v, n)  lanes i < n of v to p[i]
 *   V_POW2I(n)  2^n for an integral float n in [-126, 127]
 *   V_LOAD_BF16(p)  VL bf16 widened to f32 (a shift: bf16 is the top half of an f32)
 *   V_PREFETCH(p)   a software prefetch of the cache line at p (no-op without SIMD)
 *   transpose_v(v)  the VL × VL block v[0 .. VL−1] transposed in registers (lane k of v[j] to
 *                   lane j of v[k]; nothing with VL 1): the row reductions' tokens in the lanes
 *   mx32s(codes, s, w)  one MXFP4 block (16 code bytes) decoded in registers to 32/VL vectors
 *                       with the factor s = mx_scale(its E8M0 byte): values exactly
 *                       k3_mxfp4_get's, in element order, or with MX_XPERM 1 the 16 even
 *                       elements then the 16 odd ones, and then (MX_XPERM 1 only; element-order
 *                       units get the trivial ones below)
 *   mx_xperm(x, xd, n)  copies n floats (n % 32 == 0) into that order, per 32-block, and
 *   mx_store32(y, v)    stores 32 values held in mx32's order to y in element order.
 *   V_MIN(a, b)/V_MAX(a, b) return b when either is NaN (the SSE rule), so clamps are written
 *   V_MIN(bound, x) to let a NaN through.
 *
 * Reduction order (the determinism rule of k3_kernels.h): y[t, o] of matmul is
 * hsum(a0 + a1) + t with a0 += x·w over vectors 0, 2, 4, ... of the row and a1 over vectors
 * 1, 3, 5, ... (one VL-tail vector into a0, the last in % VL elements into t, in order). The
 * decode tiles (one token × 1 or 2 rows), the prefill tiles (GR rows × up to GT tokens, a0's
 * and a1's terms in two passes, over chunks of the row) and kern_gemv.h all do exactly that per
 * output element, so a result depends neither on T nor on the row range a thread got.
 * Elementwise ops compute each element by one function of its inputs (tails go through a padded
 * vector), so splits never change a bit. */

#define NVX (32 / VL) /* vectors per MXFP4 block */
/* Decode tiles (one token: pure weight streaming) prefetch each row this far ahead. */
#define PF_BYTES 1024

/* A unit may keep the scaled tables of all 256 E8M0 bytes (MX_TAB 1): mx32t(codes, e8, w) is
 * mx32s(codes, mx_scale(e8), w) read from them, once mx_tab_init() has made them (the entry
 * points below call it). */
#ifndef MX_TAB
#define MX_TAB 0
static inline void mx_tab_init(void) {}
#endif
/* One MXFP4 block from its E8M0 byte. */
static inline void mx32(const uint8_t *codes, uint8_t e8, VEC *w) {
#if MX_TAB
    mx32t(codes, e8, w);
#else
    mx32s(codes, mx_scale(e8), w);
#endif
}
#if !MX_XPERM /* mx32s gives element order: x needs no copy, results store as they are */
static inline void mx_xperm(const float *x, float *xd, int64_t n) {
    (void)x, (void)xd, (void)n;
}
static inline void mx_store32(float *y, const VEC *v) {
    for (int k = 0; k < 32 / VL; k++) V_STORE(y + k * VL, v[k]);
}
#endif

/* ---- weight loaders -------------------------------------------------------------------------- */
static inline VEC ldw_f32(const float *w) {
    return V_LOAD(w);
}
static inline VEC ldw_bf16(const uint16_t *w) {
    return V_LOAD_BF16(w);
}
static inline float sw_f32(const float *w) {
    return *w;
}
static inline float sw_bf16(const uint16_t *w) {
    return k3_bf16_to_f32(*w);
}

/* ---- decode tiles (T < 4, until kern_gemv.h has its own): NR weight rows (ld elements apart) ×
 * one token over elements [i0, i1) ---------------------------------------------------------------
 * i0, i1 are multiples of 2·VL (MXFP4: of 32), so vector k of the row always lands in a(k % 2)
 * whatever the chunking; xs[0] points at the token's element i0 (for MXFP4 on an ISA with
 * MX_XPERM, at its copy in even/odd order, see mx_xperm). The accumulators live in acc (row r at
 * acc[r·acc_ld·2], a0 then a1): loaded at entry, stored at exit, so a row can be walked in chunks
 * with the same arithmetic, in the same order, as one pass. */
#define ACC_LOAD(NR, NT)                                                                           \
    VEC a0[NR][NT], a1[NR][NT];                                                                    \
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++)                                           \
        _Pragma("GCC unroll 8") for (int u = 0; u < NT; u++)                                       \
            a0[r][u] = acc[(r * acc_ld + u) * 2],                                                  \
            a1[r][u] = acc[(r * acc_ld + u) * 2 + 1];
#define ACC_STORE(NR, NT)                                                                          \
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++)                                           \
        _Pragma("GCC unroll 8") for (int u = 0; u < NT; u++)                                       \
            acc[(r * acc_ld + u) * 2] = a0[r][u],                                                  \
                                   acc[(r * acc_ld + u) * 2 + 1] = a1[r][u];
#define DEF_TILE(NAME, WT, LDW, NR, NT)                                                            \
    static void NAME(const WT *w, int64_t ld, const float *const *xs, int64_t i0, int64_t i1,      \
                     VEC *acc, int64_t acc_ld) {                                                   \
        ACC_LOAD(NR, NT)                                                                           \
        for (int64_t i = i0; i < i1; i += 2 * VL) {                                                \
            VEC x0[NT], x1[NT];                                                                    \
            _Pragma("GCC unroll 8") for (int u = 0; u < NT; u++)                                   \
                x0[u] = V_LOAD(xs[u] + (i - i0)),                                                  \
                x1[u] = V_LOAD(xs[u] + (i - i0) + VL);                                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {                                 \
                if (NT == 1) /* one prefetch per cache line this iteration reads */                \
                    for (int pf = 0; pf < (int)sizeof(WT) * 2 * VL; pf += 64)                      \
                        V_PREFETCH((const char *)(w + r * ld + i) + PF_BYTES + pf);                \
                VEC w0 = LDW(w + r * ld + i), w1 = LDW(w + r * ld + i + VL);                       \
                _Pragma("GCC unroll 8") for (int u = 0; u < NT; u++) {                             \
                    a0[r][u] = V_FMA(x0[u], w0, a0[r][u]);                                         \
                    a1[r][u] = V_FMA(x1[u], w1, a1[r][u]);                                         \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        ACC_STORE(NR, NT)                                                                          \
    }

/* MXFP4 rows: codes [in/2] bytes per row (ld_c apart), E8M0 [in/32] per row (ld_e apart). Each
 * block is decoded once into registers; vector k of a block joins a(k % 2), the same lanes as the
 * f32/bf16 rows. */
#define DEF_TILE_MX(NAME, NR, NT)                                                                  \
    static void NAME(const uint8_t *c, const uint8_t *e, int64_t ld_c, int64_t ld_e,               \
                     const float *const *xs, int64_t i0, int64_t i1, VEC *acc, int64_t acc_ld) {   \
        ACC_LOAD(NR, NT)                                                                           \
        for (int64_t b = i0 / 32; b < i1 / 32; b++) {                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {                                 \
                if (NT == 1 && b % 4 == 0)                                                         \
                    V_PREFETCH((const char *)(c + r * ld_c + b * 16) + PF_BYTES);                  \
                VEC wv[NVX];                                                                       \
                mx32(c + r * ld_c + b * 16, e[r * ld_e + b], wv);                                  \
                _Pragma("GCC unroll 32") for (int k = 0; k < NVX; k += 2)                          \
                    _Pragma("GCC unroll 8") for (int u = 0; u < NT; u++) {                         \
                    const float *xb = xs[u] + (b * 32 - i0) + k * VL;                              \
                    a0[r][u] = V_FMA(V_LOAD(xb), wv[k], a0[r][u]);                                 \
                    a1[r][u] = V_FMA(V_LOAD(xb + VL), wv[k + 1], a1[r][u]);                        \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        ACC_STORE(NR, NT)                                                                          \
    }

DEF_TILE(f32_r1t1, float, ldw_f32, 1, 1)
DEF_TILE(f32_r2t1, float, ldw_f32, 2, 1)
DEF_TILE(bf16_r1t1, uint16_t, ldw_bf16, 1, 1)
DEF_TILE(bf16_r2t1, uint16_t, ldw_bf16, 2, 1)
DEF_TILE_MX(mx_r1t1, 1, 1)
DEF_TILE_MX(mx_r2t1, 2, 1)

/* Rows [o, o + k) (k = 1 or 2) × one token over [i0, i1): the matching tile. */
static void tile(const k3_tensor *W, int64_t o, int k, const float *const *xs, int64_t i0,
                 int64_t i1, VEC *acc, int64_t acc_ld) {
    int64_t in = W->shape[1];
    switch (W->dtype) {
    case K3_DT_F32:
        (k == 2 ? f32_r2t1 : f32_r1t1)((const float *)W->data + o * in, in, xs, i0, i1, acc,
                                       acc_ld);
        break;
    case K3_DT_BF16:
        (k == 2 ? bf16_r2t1 : bf16_r1t1)((const uint16_t *)W->data + o * in, in, xs, i0, i1, acc,
                                         acc_ld);
        break;
    default:
        (k == 2 ? mx_r2t1 : mx_r1t1)((const uint8_t *)W->data + o * (in / 2),
                                     W->scale + o * (in / 32), in / 2, in / 32, xs, i0, i1, acc,
                                     acc_ld);
        break;
    }
}

/* The end of one output: the VL-tail vector into a0, the last in % VL elements in order into t,
 * hsum(a0 + a1) + t (F32/BF16; an MXFP4 row has no tail). */
static float finish(const k3_tensor *W, int64_t o, const float *x, int64_t i, VEC a0, VEC a1) {
    int64_t in = W->shape[1];
    float t = 0.0f;
    if (W->dtype == K3_DT_F32) {
        const float *w = (const float *)W->data + o * in;
        if (i + VL <= in) a0 = V_FMA(V_LOAD(x + i), ldw_f32(w + i), a0), i += VL;
        for (; i < in; i++) t += x[i] * sw_f32(w + i);
    } else if (W->dtype == K3_DT_BF16) {
        const uint16_t *w = (const uint16_t *)W->data + o * in;
        if (i + VL <= in) a0 = V_FMA(V_LOAD(x + i), ldw_bf16(w + i), a0), i += VL;
        for (; i < in; i++) t += x[i] * sw_bf16(w + i);
    }
    return V_HSUM(V_ADD(a0, a1)) + t;
}
/* finish of a row with no tail (in == n_main): the same value (+ 0.0f as finish adds t = 0:
   -0 becomes +0 there too), inline, without the per-output call and dtype tests. */
static inline float finish0(VEC a0, VEC a1) {
    return V_HSUM(V_ADD(a0, a1)) + 0.0f;
}

/* y[t, o] for T < 4 tokens, rows [o0, o1): each token streams each row once (2 rows at a time,
 * then a single), the accumulators in acc; MXFP4 with MX_XPERM reads x from a copy in even/odd
 * order (xbuf: the whole rows when they fit, else K_CHUNK at a time). */
#define DEC_ROWS  16
#define K_CHUNK   512   /* a multiple of 32 and of 2·VL */
#define XB_FLOATS 65536 /* x in mx32's order on the stack: up to 256 KB (16 tokens × 4096) */
static void gemm_few(const k3_tensor *W, const float *x, int64_t T, int64_t o0, int64_t o1,
                     float *y) {
    int64_t in = W->shape[1], out = W->shape[0];
    const int64_t n_main = in - in % (2 * VL);
    const bool perm = MX_XPERM && W->dtype == K3_DT_MXFP4;
    const bool whole = !perm || T * n_main <= XB_FLOATS; /* one chunk per row */
    const int64_t chunk = whole ? n_main : K_CHUNK;
    VEC acc[DEC_ROWS * 2];
    float xbuf[perm ? (whole ? T * n_main : K_CHUNK) : 1];
    if (perm && whole)
        for (int64_t t = 0; t < T; t++) mx_xperm(x + t * in, xbuf + t * n_main, n_main);
    for (int64_t ob = o0; ob < o1; ob += DEC_ROWS) {
        int64_t nrow = o1 - ob < DEC_ROWS ? o1 - ob : DEC_ROWS;
        for (int64_t t = 0; t < T; t++) {
            for (int64_t i = 0; i < nrow * 2; i++) acc[i] = V_ZERO();
            for (int64_t i0 = 0; i0 < n_main; i0 += chunk) {
                int64_t i1 = i0 + chunk < n_main ? i0 + chunk : n_main;
                if (perm && !whole) mx_xperm(x + t * in + i0, xbuf, i1 - i0);
                const float *xs[1] = {!perm ? x + t * in + i0 : whole ? xbuf + t * n_main : xbuf};
                for (int64_t r = 0; r < nrow;) {
                    int k = nrow - r >= 2 ? 2 : 1;
                    tile(W, ob + r, k, xs, i0, i1, acc + r * 2, 1);
                    r += k;
                }
            }
            for (int64_t r = 0; r < nrow; r++)
                y[t * out + ob + r] =
                    finish(W, ob + r, x + t * in, n_main, acc[r * 2], acc[r * 2 + 1]);
        }
    }
}

/* ---- prefill (T >= 4): packed panels × register tiles of GR rows × GT tokens -----------------
 * Blocks of GB_ROWS rows × GB_TOKS tokens, the rows walked in chunks of GB_K elements. Per chunk
 * the block's x is packed once (in mx32's order for MXFP4 with MX_XPERM), and GR rows at a time
 * are unpacked (BF16 widened, MXFP4 decoded: the same floats the decode tiles make) into a panel
 * that stays in L1 while every token tile of the block meets it. A tile keeps the accumulators of
 * one parity in registers (GR·GT of them, GT x vectors, one weight vector): a0's pass takes
 * vectors 0, 2, 4, ... of the chunk, then a1's pass vectors 1, 3, 5, ... — per accumulator the
 * decode tiles' terms in their order, so the results are theirs bit for bit. Between chunks the
 * accumulators wait in acc; the last chunk finishes its outputs at once. Rows past the block's
 * end repeat its last row (computed, never stored). Scratch on the stack: acc, the packed x block
 * and one panel (AVX-512: 384 + 256 + 24 KB). */
#define GB_ROWS  (8 * GR)       /* a packed x block serves this many rows */
#define GB_TOKS  (64 / GT * GT) /* whole tiles (xpk's blocks start at tiles); acc holds them */
#define GB_K     1024           /* a multiple of 32 and of 2·VL; measured best of 512..2048 */
#define GB_TILES ((GB_TOKS + GT - 1) / GT)
#define GB_TILE  (2 * GR * GT) /* one tile's accumulators in acc: [parity][row][token] */
#define GB_XP    (256 * 1024)  /* floats of the packed x block (1 MB: it lives in L2) */

/* wp [parity p][j][row r][VL] = vector 2j + p (of VL elements; mx32's order for MXFP4) of row
 * o + min(r, nr − 1), elements [i0, i0 + 2·VL·nv): a pass reads one sequential stream. */
static void gb_pack_w(const k3_tensor *W, int64_t o, int nr, int64_t i0, int64_t nv, float *wp) {
    const int64_t in = W->shape[1], half = nv * GR * VL;
    for (int r = 0; r < GR; r++) {
        const int64_t row = o + (r < nr ? r : nr - 1);
        float *d = wp + r * VL;
        if (W->dtype == K3_DT_F32) {
            const float *w = (const float *)W->data + row * in + i0;
            for (int64_t j = 0; j < nv; j++) {
                V_STORE(d + j * GR * VL, ldw_f32(w + 2 * j * VL));
                V_STORE(d + half + j * GR * VL, ldw_f32(w + (2 * j + 1) * VL));
            }
        } else if (W->dtype == K3_DT_BF16) {
            const uint16_t *w = (const uint16_t *)W->data + row * in + i0;
            for (int64_t j = 0; j < nv; j++) {
                V_STORE(d + j * GR * VL, ldw_bf16(w + 2 * j * VL));
                V_STORE(d + half + j * GR * VL, ldw_bf16(w + (2 * j + 1) * VL));
            }
        } else {
            const uint8_t *c = (const uint8_t *)W->data + row * (in / 2) + i0 / 2;
            const uint8_t *e = W->scale + row * (in / 32) + i0 / 32;
            for (int64_t b = 0; b < 2 * nv * VL / 32; b++) {
                VEC wv[NVX];
                mx32(c + b * 16, e[b], wv);
                _Pragma("GCC unroll 32") for (int m = 0; m < NVX; m += 2) {
                    const int64_t j = (b * NVX + m) / 2;
                    V_STORE(d + j * GR * VL, wv[m]);
                    V_STORE(d + half + j * GR * VL, wv[m + 1]);
                }
            }
        }
    }
}

/* xp [tile][parity p][j][token u][VL] = vector 2j + p of token tb + tile·GT + u, elements
 * [i0, i0 + 2·VL·nv) (MXFP4 with MX_XPERM: of its copy in mx32's order, made in tmp). */
static void gb_pack_x(const float *x, int64_t in, bool perm, int64_t ntok, int64_t i0, int64_t nv,
                      float *tmp, float *xp) {
    for (int64_t t = 0; t < ntok; t++) {
        const float *src = x + t * in + i0;
        if (perm) mx_xperm(src, tmp, 2 * nv * VL), src = tmp;
        float *d = xp + ((t / GT) * 2 * nv * GT + t % GT) * VL;
        for (int64_t j = 0; j < nv; j++) {
            V_STORE(d + j * GT * VL, V_LOAD(src + 2 * j * VL));
            V_STORE(d + (nv + j) * GT * VL, V_LOAD(src + (2 * j + 1) * VL));
        }
    }
}

/* GR rows (the panel wp) × NT tokens (xp: their tile of the packed x) over nv pairs of vectors;
 * acc [parity][GR][GT] is loaded (zero when init) and stored back. */
#define DEF_GB(NAME, NT)                                                                           \
    static void NAME(const float *wp, const float *xp, int64_t nv, bool init, VEC *acc) {          \
        for (int p = 0; p < 2; p++) {                                                              \
            VEC a[GR][NT];                                                                         \
            VEC *ap = acc + p * GR * GT;                                                           \
            _Pragma("GCC unroll 8") for (int r = 0; r < GR; r++)                                   \
                _Pragma("GCC unroll 8") for (int u = 0; u < NT; u++) a[r][u] =                     \
                    init ? V_ZERO() : ap[r * GT + u];                                              \
            const float *w = wp + p * nv * GR * VL, *xq = xp + p * nv * GT * VL;                   \
            for (int64_t j = 0; j < nv; j++) {                                                     \
                VEC xv[NT];                                                                        \
                _Pragma("GCC unroll 8") for (int u = 0; u < NT; u++) xv[u] =                       \
                    V_LOAD(xq + (j * GT + u) * VL);                                                \
                _Pragma("GCC unroll 8") for (int r = 0; r < GR; r++) {                             \
                    VEC wv = V_LOAD(w + (j * GR + r) * VL);                                        \
                    _Pragma("GCC unroll 8") for (int u = 0; u < NT; u++) a[r][u] =                 \
                        V_FMA(xv[u], wv, a[r][u]);                                                 \
                }                                                                                  \
            }                                                                                      \
            _Pragma("GCC unroll 8") for (int r = 0; r < GR; r++)                                   \
                _Pragma("GCC unroll 8") for (int u = 0; u < NT; u++) ap[r * GT + u] = a[r][u];     \
        }                                                                                          \
    }
DEF_GB(gb_t1, 1)
#if GT >= 2
DEF_GB(gb_t2, 2)
#endif
#if GT >= 3
DEF_GB(gb_t3, 3)
#endif
#if GT >= 4
DEF_GB(gb_t4, 4)
#endif
#if GT > 4
#error "GT > 4: add gb_t5.."
#endif
typedef void (*gb_fn)(const float *, const float *, int64_t, bool, VEC *);
static const gb_fn gb_tiles[GT + 1] = {
    NULL,  gb_t1,
#if GT >= 2
    gb_t2,
#endif
#if GT >= 3
    gb_t3,
#endif
#if GT >= 4
    gb_t4,
#endif
};

/* Rows [ob, ob + nrow) × tokens [tb, tb + ntok) over the chunk [i0, i1) whose x is packed in xp:
 * each GR-row group widened/decoded once into wp, met by every token tile; the last chunk
 * finishes its outputs. */
static void gb_block(const k3_tensor *W, const float *x, int64_t ob, int64_t nrow, int64_t tb,
                     int64_t ntok, int64_t i0, int64_t i1, int64_t n_main, const float *xp,
                     float *wp, VEC *acc, float *y) {
    const int64_t in = W->shape[1], out = W->shape[0], nv = (i1 - i0) / (2 * VL);
    /* the next GR rows' part of this chunk is prefetched while the tiles meet this group's
       panel (the weights come from DRAM once per token block; gb_pack_w then finds them in
       cache instead of waiting on each row) */
    const int64_t esz2 = W->dtype == K3_DT_F32 ? 8 : W->dtype == K3_DT_BF16 ? 4 : 1; /* 2 × bytes */
    const int64_t rlines = ((i1 - i0) * esz2 / 2 + 63) / 64, ntiles = (ntok + GT - 1) / GT;
    for (int64_t g = 0; g < nrow; g += GR) {
        const int nr = nrow - g < GR ? (int)(nrow - g) : GR;
        gb_pack_w(W, ob + g, nr, i0, nv, wp);
        const int64_t pr0 = ob + g + GR, npr = K3_MAX(0, K3_MIN((int64_t)GR, out - pr0));
        const int64_t per = (npr * rlines + ntiles - 1) / ntiles;
        int64_t prow = 0, pline = 0; /* the prefetch cursor: row pr0 + prow, its line pline */
        for (int64_t u0 = 0; u0 < ntok; u0 += GT) {
            const int nt = ntok - u0 < GT ? (int)(ntok - u0) : GT;
            VEC *a = i0 == 0 && i1 == n_main ? acc : acc + (g / GR * GB_TILES + u0 / GT) * GB_TILE;
            for (int64_t q = 0; q < per && prow < npr; q++) {
                V_PREFETCH((const char *)W->data + ((pr0 + prow) * in + i0) * esz2 / 2 +
                           pline * 64);
                if (++pline == rlines) pline = 0, prow++;
            }
            gb_tiles[nt](wp, xp + u0 * 2 * nv * VL, nv, i0 == 0, a);
            if (i1 == n_main && n_main == in && nr == GR && nt == GT) {
                /* the last chunk of a whole tile: its GR·GT sums folded together */
                VEC v[GR * GT];
                _Alignas(64) float s[GR * GT + VL]; /* whole-vector stores: loads forward */
                _Pragma("GCC unroll 32") for (int u = 0; u < GT; u++)
                    _Pragma("GCC unroll 8") for (int r = 0; r < GR; r++) v[u * GR + r] =
                        V_ADD(a[r * GT + u], a[(GR + r) * GT + u]);
                _Pragma("GCC unroll 8") for (int k0 = 0; k0 < GR * GT; k0 += VL)
                    V_STORE(s + k0, hsum_v(v + k0, GR * GT - k0 < VL ? GR * GT - k0 : VL));
                _Pragma("GCC unroll 8") for (int u = 0; u < GT; u++)
                    _Pragma("GCC unroll 8") for (int r = 0; r < GR; r++)
                        y[(tb + u0 + u) * out + ob + g + r] = s[u * GR + r];
            } else if (i1 == n_main && n_main == in) { /* a partial tile: one sum at a time */
                for (int r = 0; r < nr; r++)
                    for (int u = 0; u < nt; u++)
                        y[(tb + u0 + u) * out + ob + g + r] =
                            finish0(a[r * GT + u], a[(GR + r) * GT + u]);
            } else if (i1 == n_main)
                for (int r = 0; r < nr; r++)
                    for (int u = 0; u < nt; u++)
                        y[(tb + u0 + u) * out + ob + g + r] =
                            finish(W, ob + g + r, x + (tb + u0 + u) * in, n_main, a[r * GT + u],
                                   a[(GR + r) * GT + u]);
        }
    }
}

/* x packed once for a whole call (the caller shares it among the tasks that split the rows):
 * for each GB_K chunk [i0, i1) of the row, the tokens' gb_pack_x layout, chunk after chunk —
 * chunk i0 at xpk + Tpad·i0 (Tpad = T rounded up to GT), token tile u of it at u·GT·(i1 − i0).
 * xpk_pack packs tokens [t0, t1) (t0 a multiple of GT), so packing splits over tokens. */
static int64_t xpk_floats(int64_t T, int64_t in) {
    return (T + GT - 1) / GT * GT * (in - in % (2 * VL));
}
static void xpk_pack(const k3_tensor *W, const float *x, int64_t T, int64_t t0, int64_t t1,
                     float *xpk) {
    const int64_t in = W->shape[1], n_main = in - in % (2 * VL), Tpad = (T + GT - 1) / GT * GT;
    const bool perm = MX_XPERM && W->dtype == K3_DT_MXFP4;
    _Alignas(64) float tmp[MX_XPERM ? GB_K : 1];
    for (int64_t i0 = 0; i0 < n_main; i0 += GB_K) {
        const int64_t len = (i0 + GB_K < n_main ? i0 + GB_K : n_main) - i0;
        gb_pack_x(x + t0 * in, in, perm, t1 - t0, i0, len / (2 * VL), tmp,
                  xpk + Tpad * i0 + t0 * len);
    }
}

/* Prefill rows [o0, o1) × all T >= 4 tokens; x packed here per token block, or read from xpk
 * (xpk_pack's layout of all T tokens) when the caller packed it once for all tasks. */
static void gemm_rows_px(const k3_tensor *W, const float *x, const float *xpk, int64_t T,
                         int64_t o0, int64_t o1, float *y) {
    const int64_t in = W->shape[1], out = W->shape[0];
    const int64_t n_main = in - in % (2 * VL), Tpad = (T + GT - 1) / GT * GT;
    const bool perm = MX_XPERM && W->dtype == K3_DT_MXFP4;
    VEC acc[GB_ROWS / GR * GB_TILES * GB_TILE];
    _Alignas(64) float wp[GR * GB_K], xp[xpk ? 1 : GB_XP], tmp[MX_XPERM && !xpk ? GB_K : 1];
    if (n_main == 0) { /* a row shorter than 2·VL: finish alone */
        for (int64_t o = o0; o < o1; o++)
            for (int64_t t = 0; t < T; t++)
                y[t * out + o] = finish(W, o, x + t * in, 0, V_ZERO(), V_ZERO());
        return;
    }
    if (n_main <= GB_K) {
        /* one chunk per row: a token block's x (256 tokens of 1024 elements: 1 MB, in L2) meets
           every row block; the weights stream once per token block, each tile's sums finish at
           once (acc holds one tile) */
        const int64_t tblk = K3_MAX((int64_t)GT, GB_XP / n_main / GT * GT);
        for (int64_t tb = 0; tb < T; tb += tblk) {
            const int64_t ntok = T - tb < tblk ? T - tb : tblk;
            const float *xb = xpk ? xpk + tb * n_main : xp;
            if (!xpk) gb_pack_x(x + tb * in, in, perm, ntok, 0, n_main / (2 * VL), tmp, xp);
            for (int64_t ob = o0; ob < o1; ob += GB_ROWS)
                gb_block(W, x, ob, o1 - ob < GB_ROWS ? o1 - ob : GB_ROWS, tb, ntok, 0, n_main,
                         n_main, xb, wp, acc, y);
        }
        return;
    }
    for (int64_t ob = o0; ob < o1; ob += GB_ROWS) {
        const int64_t nrow = o1 - ob < GB_ROWS ? o1 - ob : GB_ROWS;
        for (int64_t tb = 0; tb < T; tb += GB_TOKS) {
            const int64_t ntok = T - tb < GB_TOKS ? T - tb : GB_TOKS;
            for (int64_t i0 = 0; i0 < n_main; i0 += GB_K) {
                const int64_t i1 = i0 + GB_K < n_main ? i0 + GB_K : n_main;
                const float *xb = xpk ? xpk + Tpad * i0 + tb * (i1 - i0) : xp;
                if (!xpk) gb_pack_x(x + tb * in, in, perm, ntok, i0, (i1 - i0) / (2 * VL), tmp, xp);
                gb_block(W, x, ob, nrow, tb, ntok, i0, i1, n_main, xb, wp, acc, y);
            }
        }
    }
}

static void gemm_rows(const k3_tensor *W, const float *x, int64_t T, int64_t o0, int64_t o1,
                      float *y) {
    if (T < 4)
        gemm_few(W, x, T, o0, o1, y);
    else
        gemm_rows_px(W, x, NULL, T, o0, o1, y);
}

/* The decode path (weight streaming; T < 4, MXFP4 T < MX_GEMV_T, F32/BF16 T < GV_TMAX: see
 * k3_cpu_gemv_path): kern_gemv.h, the same per-element arithmetic. */
#ifndef MX_GEMV_T
#define MX_GEMV_T 4
#endif
#ifndef GV_TMAX
#define GV_TMAX 4 /* F32/BF16 products of fewer tokens take the decode path */
#endif
#include "kern_gemv.h"

static void mm_rows(const k3_tensor *W, const float *x, int64_t T, int64_t o0, int64_t o1, float *y,
                    bool gemv_seq) {
    if (W->dtype == K3_DT_MXFP4) mx_tab_init();
    if (k3_cpu_gemv_path(&KERN_NAME, W, T)) /* the table gives MX_GEMV_T and GV_TMAX */
        gemv_rows(W, x, T, o0, o1, y, gemv_seq);
    else
        gemm_rows(W, x, T, o0, o1, y);
}
static void mm_rows_xpk(const k3_tensor *W, const float *x, const float *xpk, int64_t T, int64_t o0,
                        int64_t o1, float *y) {
    if (W->dtype == K3_DT_MXFP4) mx_tab_init();
    gemm_rows_px(W, x, xpk, T, o0, o1, y);
}

/* matmul_tn: y[t, c] = Σ_o x[t, o] W[o, c], one fused multiply-add per term in o order — the
 * same per element in a vector lane and in the scalar tail, so the column split never matters.
 * The rows are walked in memory order: the sums of up to MMTN_CB columns (whole MXFP4 blocks of
 * 32) sit in an L1 buffer that each row (MMTN_RU rows at a time, their terms still one after
 * another per column) updates in turn. Walking 32 columns down all rows instead read W with a
 * stride of a row per 64 bytes (BF16 81920 × 4096 at one token: 7.6 GB/s, TLB- and
 * prefetch-bound). */
#define MMTN_CB 4096 /* columns of one walk: 16 KB of sums */
#define MMTN_RU 4    /* rows per pass over the sums */
/* the NVX vectors of W's 32 columns from c in row o (MXFP4: in mx32's order) */
static inline void mmtn_w32(const k3_tensor *W, int64_t in, int64_t o, int64_t c, VEC *wv) {
    if (W->dtype == K3_DT_F32) {
        _Pragma("GCC unroll 32") for (int k = 0; k < NVX; k++) wv[k] =
            V_LOAD((const float *)W->data + o * in + c + k * VL);
    } else if (W->dtype == K3_DT_BF16) {
        _Pragma("GCC unroll 32") for (int k = 0; k < NVX; k++) wv[k] =
            V_LOAD_BF16((const uint16_t *)W->data + o * in + c + k * VL);
    } else {
        mx32((const uint8_t *)W->data + o * (in / 2) + c / 2, W->scale[o * (in / 32) + c / 32], wv);
    }
}
static void mmtn_cols(const k3_tensor *W, const float *x, int64_t T, int64_t c0, int64_t c1,
                      float *y) {
    int64_t out = W->shape[0], in = W->shape[1];
    if (W->dtype == K3_DT_MXFP4) mx_tab_init();
    _Alignas(64) float sum[MMTN_CB];
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * out;
        float *yt = y + t * in;
        const int64_t cv = c0 + (c1 - c0) / 32 * 32; /* [c0, cv): 32 columns at a time */
        for (int64_t cb = c0; cb < cv; cb += MMTN_CB) {
            const int64_t n = K3_MIN((int64_t)MMTN_CB, cv - cb);
            for (int64_t i = 0; i < n; i++) sum[i] = 0.0f;
            int64_t o = 0;
            for (; o + MMTN_RU <= out; o += MMTN_RU) {
                VEC xo[MMTN_RU];
                _Pragma("GCC unroll 8") for (int r = 0; r < MMTN_RU; r++) xo[r] = V_SET1(xt[o + r]);
                for (int64_t i = 0; i < n; i += 32) {
                    VEC acc[NVX];
                    _Pragma("GCC unroll 32") for (int k = 0; k < NVX; k++) acc[k] =
                        V_LOAD(sum + i + k * VL);
                    _Pragma("GCC unroll 8") for (int r = 0; r < MMTN_RU; r++) {
                        VEC wv[NVX];
                        mmtn_w32(W, in, o + r, cb + i, wv);
                        _Pragma("GCC unroll 32") for (int k = 0; k < NVX; k++) acc[k] =
                            V_FMA(xo[r], wv[k], acc[k]);
                    }
                    _Pragma("GCC unroll 32") for (int k = 0; k < NVX; k++)
                        V_STORE(sum + i + k * VL, acc[k]);
                }
            }
            for (; o < out; o++) {
                const VEC xo = V_SET1(xt[o]);
                for (int64_t i = 0; i < n; i += 32) {
                    VEC wv[NVX];
                    mmtn_w32(W, in, o, cb + i, wv);
                    _Pragma("GCC unroll 32") for (int k = 0; k < NVX; k++)
                        V_STORE(sum + i + k * VL, V_FMA(xo, wv[k], V_LOAD(sum + i + k * VL)));
                }
            }
            for (int64_t i = 0; i < n; i += 32) {
                if (W->dtype == K3_DT_MXFP4) { /* lanes in mx32's order */
                    VEC v[NVX];
                    _Pragma("GCC unroll 32") for (int k = 0; k < NVX; k++) v[k] =
                        V_LOAD(sum + i + k * VL);
                    mx_store32(yt + cb + i, v);
                } else {
                    memcpy(yt + cb + i, sum + i, 32 * sizeof(float));
                }
            }
        }
        for (int64_t c = cv; c < c1; c++) { /* f32/bf16 only: MXFP4 rows are whole blocks */
            float s = 0.0f;
            for (int64_t o = 0; o < out; o++) s = V_SFMA(xt[o], k3_tensor_get(W, o, c), s);
            yt[c] = s;
        }
    }
}

/* ---- exp, sigmoid, tanh ------------------------------------------------------------------------
 * exp: n = round(x·log2 e) (the 1.5·2^23 trick), r = x − n·ln2 in two parts (Cody-Waite; the
 * high part has 9 bits so n·C1 is exact), a degree-6 polynomial on |r| <= ln2/2 (Cephes expf,
 * ~1 ulp), times 2^n applied as two halves so results down to the subnormals are right and
 * x > 88.73 overflows to +inf as expf does. exp(0) is exactly 1. */
static inline VEC v_exp(VEC x) {
    const VEC magic = V_SET1(12582912.0f); /* 1.5·2^23 */
    x = V_MAX(V_SET1(-104.0f), V_MIN(V_SET1(89.0f), x));
    VEC n = V_SUB(V_FMA(x, V_SET1(1.44269504088896341f), magic), magic);
    VEC r = V_FMA(n, V_SET1(-0.693359375f), x);
    r = V_FMA(n, V_SET1(2.12194440e-4f), r);
    VEC p = V_SET1(1.9875691500e-4f);
    p = V_FMA(p, r, V_SET1(1.3981999507e-3f));
    p = V_FMA(p, r, V_SET1(8.3334519073e-3f));
    p = V_FMA(p, r, V_SET1(4.1665795894e-2f));
    p = V_FMA(p, r, V_SET1(1.6666665459e-1f));
    p = V_FMA(p, r, V_SET1(5.0000001201e-1f));
    p = V_ADD(V_FMA(V_MUL(p, r), r, r), V_SET1(1.0f));
    VEC n1 = V_SUB(V_FMA(n, V_SET1(0.5f), magic), magic); /* n = n1 + n2, both in [-75, 65] */
    VEC n2 = V_SUB(n, n1);
    return V_MUL(V_MUL(p, V_POW2I(n1)), V_POW2I(n2));
}
static inline VEC v_sigmoid(VEC x) {
    return V_DIV(V_SET1(1.0f), V_ADD(V_SET1(1.0f), v_exp(V_SUB(V_ZERO(), x))));
}
/* tanh: |z| < 0.55: the odd Taylor series to z^17 (next term < 1e-8 relative); else
 * (1 − e^{−2|z|})/(1 + e^{−2|z|}) (no cancellation: e^{−2|z|} < 1/3); the sign of z restored. */
static inline VEC v_tanh(VEC z) {
    VEC a = V_ABS(z), z2 = V_MUL(z, z);
    VEC p = V_SET1(6404582.0f / 10854718875.0f);
    p = V_FMA(p, z2, V_SET1(-929569.0f / 638512875.0f));
    p = V_FMA(p, z2, V_SET1(21844.0f / 6081075.0f));
    p = V_FMA(p, z2, V_SET1(-1382.0f / 155925.0f));
    p = V_FMA(p, z2, V_SET1(62.0f / 2835.0f));
    p = V_FMA(p, z2, V_SET1(-17.0f / 315.0f));
    p = V_FMA(p, z2, V_SET1(2.0f / 15.0f));
    p = V_FMA(p, z2, V_SET1(-1.0f / 3.0f));
    VEC small = V_FMA(V_MUL(a, z2), p, a);
    VEC t = v_exp(V_MUL(V_SET1(-2.0f), a));
    VEC big = V_DIV(V_SUB(V_SET1(1.0f), t), V_ADD(V_SET1(1.0f), t));
    return V_COPYSIGN(V_SEL_LT(a, V_SET1(0.55f), small, big), z);
}

/* ---- elementwise ops: whole vectors, then the tail through a padded vector ------------------- */
#define EW_LOOP(n, BODY)                                                                           \
    do {                                                                                           \
        int64_t i_ = 0;                                                                            \
        for (; i_ + VL <= (n); i_ += VL) {                                                         \
            const int64_t o_ = i_;                                                                 \
            BODY(o_, (n))                                                                          \
        }                                                                                          \
        if (i_ < (n)) {                                                                            \
            const int64_t o_ = i_;                                                                 \
            BODY(o_, (n))                                                                          \
        }                                                                                          \
    } while (0)
/* load/store VL elements at i of an array of n (padding with 0 past n, storing only < n) */
static inline VEC ld_pad(const float *p, int64_t i, int64_t n) {
    if (i + VL <= n) return V_LOAD(p + i);
    float b[VL] = {0};
    for (int64_t j = i; j < n; j++) b[j - i] = p[j];
    return V_LOAD(b);
}
static inline void st_pad(float *p, int64_t i, int64_t n, VEC v) {
    if (i + VL <= n) {
        V_STORE(p + i, v);
        return;
    }
    float b[VL];
    V_STORE(b, v);
    for (int64_t j = i; j < n; j++) p[j] = b[j - i];
}

#define SILU_BODY(i, n)                                                                            \
    {                                                                                              \
        VEC v = ld_pad(x, i, n);                                                                   \
        st_pad(y, i, n, V_MUL(v, v_sigmoid(v)));                                                   \
    }
static void silu(const float *x, int64_t n, float *y) {
    EW_LOOP(n, SILU_BODY);
}
#define SIGMOID_BODY(i, n) st_pad(y, i, n, v_sigmoid(ld_pad(x, i, n)));
static void sigmoid(const float *x, int64_t n, float *y) {
    EW_LOOP(n, SIGMOID_BODY);
}
#define SWIGLU_BODY(i, n)                                                                          \
    {                                                                                              \
        VEC v = ld_pad(g, i, n);                                                                   \
        st_pad(y, i, n, V_MUL(V_MUL(v, v_sigmoid(v)), ld_pad(u, i, n)));                           \
    }
static void swiglu(const float *g, const float *u, int64_t n, float *y) {
    EW_LOOP(n, SWIGLU_BODY);
}
/* SiTU (K3-MODEL.md §4.1): [β tanh(g/β) σ(g)]·[λ tanh(u/λ)] (λ <= 0: u) */
#define SITU_BODY(i, n)                                                                            \
    {                                                                                              \
        VEC gv = ld_pad(g, i, n), uv = ld_pad(u, i, n);                                            \
        VEC a = V_MUL(V_MUL(vb, v_tanh(V_DIV(gv, vb))), v_sigmoid(gv));                            \
        VEC b = lin_beta > 0.0f ? V_MUL(vl, v_tanh(V_DIV(uv, vl))) : uv;                           \
        st_pad(y, i, n, V_MUL(a, b));                                                              \
    }
static void situ(const float *g, const float *u, int64_t n, float beta, float lin_beta, float *y) {
    const VEC vb = V_SET1(beta), vl = V_SET1(lin_beta);
    EW_LOOP(n, SITU_BODY);
}

/* y = exp(x − m) over n elements (y may alias x); returns Σ y with lane-wise partial sums, then
 * the tail in order. */
static float exp_sub_sum(const float *x, int64_t n, float m, float *y) {
    const VEC vm = V_SET1(m);
    VEC vs = V_ZERO();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        VEC e = v_exp(V_SUB(V_LOAD(x + i), vm));
        V_STORE(y + i, e);
        vs = V_ADD(vs, e);
    }
    float s = V_HSUM(vs);
    if (i < n) {
        st_pad(y, i, n, v_exp(V_SUB(ld_pad(x, i, n), vm)));
        for (; i < n; i++) s += y[i];
    }
    return s;
}

/* softmax of one row: max, exp(x − max) with lane-wise partial sums, divide. */
static void softmax_row(const float *x, int64_t n, float *y) {
    float m = -INFINITY;
    int64_t i = 0;
    if (n >= VL) {
        VEC vm = V_LOAD(x);
        for (i = VL; i + VL <= n; i += VL) vm = V_MAX(vm, V_LOAD(x + i));
        m = V_HMAX(vm);
    }
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    float s = exp_sub_sum(x, n, m, y);
    const VEC vsum = V_SET1(s);
    for (i = 0; i + VL <= n; i += VL) V_STORE(y + i, V_DIV(V_LOAD(y + i), vsum));
    for (; i < n; i++) y[i] /= s;
}

/* ---- ref's loops, several outputs at a time ---------------------------------------------------
 * short_conv, rows_wsum and attnres_mix compute each output element by a fixed sequence of
 * multiplies and adds over K taps, rows or sources, never across elements. These run that same
 * sequence for VL elements at once (V_MUL then V_ADD: two roundings, as ref's C under
 * -ffp-contract=off does), so the results are ref's bit for bit; attnres's per-row sums over d
 * stay sequential, as in ref, but run VL rows at a time in the lanes (a block's tokens, or one
 * token's sources) instead of one after another. */

/* short_conv's outputs for channels [c0, c1) (ref: k3_ref_short_conv_cols); K <= CONV_KMAX. */
#define CONV_KMAX 16
#define CONV_CB   256
static void conv_cols(const float *in, int64_t n, int64_t P, int K, const float *w,
                      const float *state, float *out, int64_t c0, int64_t c1) {
    float wt[CONV_KMAX * CONV_CB]; /* the block's taps, [j][channel] */
    for (int64_t b0 = c0; b0 < c1; b0 += CONV_CB) {
        const int64_t nb = c1 - b0 < CONV_CB ? c1 - b0 : CONV_CB;
        for (int j = 0; j < K; j++)
            for (int64_t c = 0; c < nb; c++) wt[j * CONV_CB + c] = w[(b0 + c) * K + j];
        for (int64_t t = 0; t < n; t++) {
            float *o = out + t * P + b0;
            int64_t c = 0;
            for (; c + VL <= nb; c += VL) {
                VEC acc = V_ZERO();
                for (int j = 0; j < K; j++) {
                    const int64_t idx = t - (K - 1) + j;
                    const float *src = idx >= 0 ? in + idx * P : state + (idx + K - 1) * P;
                    acc = V_ADD(acc, V_MUL(V_LOAD(wt + j * CONV_CB + c), V_LOAD(src + b0 + c)));
                }
                V_STORE(o + c, acc);
            }
            for (; c < nb; c++) {
                float acc = 0.0f;
                for (int j = 0; j < K; j++) {
                    const int64_t idx = t - (K - 1) + j;
                    const float *src = idx >= 0 ? in + idx * P : state + (idx + K - 1) * P;
                    acc += wt[j * CONV_CB + c] * src[b0 + c];
                }
                o[c] = acc;
            }
        }
    }
}

/* rows_wsum's segment j (ref: k3_ref_rows_wsum_seg). */
static void wsum_seg(const float *x, const float *w, const int64_t *seg, int64_t seg_len, int64_t j,
                     int64_t width, float *y) {
    float *a = y + j * width;
    const int64_t i0 = seg ? seg[j] : j * seg_len, i1 = seg ? seg[j + 1] : (j + 1) * seg_len;
    int64_t d = 0;
    for (; d + VL <= width; d += VL) {
        VEC acc = w ? V_MUL(V_SET1(w[i0]), V_LOAD(x + i0 * width + d)) : V_LOAD(x + i0 * width + d);
        for (int64_t i = i0 + 1; i < i1; i++)
            acc = w ? V_ADD(acc, V_MUL(V_SET1(w[i]), V_LOAD(x + i * width + d)))
                    : V_ADD(acc, V_LOAD(x + i * width + d));
        V_STORE(a + d, acc);
    }
    for (; d < width; d++) {
        float acc = w ? w[i0] * x[i0 * width + d] : x[i0 * width + d];
        for (int64_t i = i0 + 1; i < i1; i++) acc += w ? w[i] * x[i * width + d] : x[i * width + d];
        a[d] = acc;
    }
}

/* ---- row reductions with the tokens in the lanes ----------------------------------------------
 * A row's sum of squares (rmsnorm, l2norm, attnres_mix's scores) and attnres_mix's dot product are
 * ref's sequential float chains over the row, in order (a multiply, then an add:
 * -ffp-contract=off), and the cpu backend must keep ref's bits. So the chains of VL tokens run side
 * by side, token k's in lane k: the VL rows' vectors at d .. d + VL - 1 are loaded and transposed
 * in registers (transpose_v), then added lane by lane in d order, so each lane does exactly ref's
 * operations for its token, VL tokens per instruction instead of one latency chain per token. A
 * block of fewer tokens (a tail, a decode batch) fills its unused lanes with copies of its first
 * row while it has at least TL_MIN tokens; fewer take one-token chains (ref's code). sqrt and
 * division are correctly rounded, so r is ref's however it is computed. */
/* the fewest tokens worth a norm block of VL lanes, measured on 1 thread, rows of 1,024: rmsnorm
   0.55 µs a token one at a time, 0.10 in full blocks of 16 (AVX-512), 0.19 in a block of 4 tokens
   (AVX-512) or 0.32 of 2 (AVX2) (attnres_mix counts its passes instead: attnres_rows) */
#define TL_MIN (VL / 4 > 2 ? VL / 4 : 2)

/* lane k: ref's ss = Σ_d rows[k][d]² (d ascending from 0.0f) */
static inline VEC tl_sumsq(const float *const *rows, int64_t n) {
    VEC acc = V_ZERO();
    int64_t d = 0;
    for (; d + VL <= n; d += VL) {
        VEC v[VL];
        _Pragma("GCC unroll 16") for (int k = 0; k < VL; k++) {
            const VEC a = V_LOAD(rows[k] + d);
            v[k] = V_MUL(a, a);
        }
        transpose_v(v);
        _Pragma("GCC unroll 16") for (int j = 0; j < VL; j++) acc = V_ADD(acc, v[j]);
    }
    for (; d < n; d++) {
        float c[VL];
        for (int k = 0; k < VL; k++) c[k] = rows[k][d] * rows[k][d];
        acc = V_ADD(acc, V_LOAD(c));
    }
    return acc;
}
/* lane k: attnres_mix's dot = Σ_d (rows[k][d]·r[k])·w[d] (d ascending from 0.0f) */
static inline VEC tl_dot(const float *const *rows, int64_t n, VEC r, const float *w) {
    VEC acc = V_ZERO();
    int64_t d = 0;
    for (; d + VL <= n; d += VL) {
        VEC v[VL];
        _Pragma("GCC unroll 16") for (int k = 0; k < VL; k++) v[k] = V_LOAD(rows[k] + d);
        transpose_v(v);
        _Pragma("GCC unroll 16") for (int j = 0; j < VL; j++) acc =
            V_ADD(acc, V_MUL(V_MUL(v[j], r), V_SET1(w[d + j])));
    }
    for (; d < n; d++) {
        float c[VL];
        for (int k = 0; k < VL; k++) c[k] = rows[k][d];
        acc = V_ADD(acc, V_MUL(V_MUL(V_LOAD(c), r), V_SET1(w[d])));
    }
    return acc;
}
/* one token's ss (ref's chain) */
static inline float row_sumsq(const float *x, int64_t n) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    return ss;
}

/* rmsnorm (l2 false; w NULL = ones) or l2norm (l2 true) of rows [t0, t1), row t at x + t·xs and
 * y + t·ys: ref's row code's bits (k3_ref_ops.rmsnorm / l2norm one row at a time). y may alias x
 * with the same strides (a row is read whole before its first write). */
static void norm_rows(const float *x, int64_t xs, const float *w, int64_t n, float eps, bool l2,
                      float *y, int64_t ys, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1;) {
        const int nt = t1 - t >= VL ? VL : t1 - t >= TL_MIN ? (int)(t1 - t) : 1;
        const float *rows[VL];
        float r[VL];
        for (int k = 0; k < VL; k++) rows[k] = x + (t + (k < nt ? k : 0)) * xs;
        if (nt > 1)
            V_STORE(r, tl_sumsq(rows, n));
        else
            r[0] = row_sumsq(rows[0], n);
        for (int k = 0; k < nt; k++) {
            const float rk = l2 ? 1.0f / sqrtf(r[k] + eps) : 1.0f / sqrtf(r[k] / (float)n + eps);
            const float *xt = rows[k];
            float *yt = y + (t + k) * ys;
            const VEC rv = V_SET1(rk);
            int64_t i = 0;
            for (; i + VL <= n; i += VL) {
                const VEC v = V_MUL(V_LOAD(xt + i), rv);
                V_STORE(yt + i, w ? V_MUL(V_LOAD(w + i), v) : v);
            }
            for (; i < n; i++) yt[i] = w ? w[i] * (xt[i] * rk) : xt[i] * rk;
        }
        t += nt;
    }
}

/* attnres_mix for tokens [t0, t1) (ref: k3_ref_attnres_mix_rows; n_bank + 1 <= 64, checked by
 * the caller). Scores: VL tokens at a time in the lanes (above), or one token with its sources
 * in the lanes, VL at a time (a decode step; a short tail: attnres_rows counts which is cheaper;
 * the scalar unit: AR_ROWS sources' chains side by side; unused lanes duplicate a row). The softmax
 * (libm's expf) and the mix are per token. */
#define AR_ROWS 8
/* source i's row of token t: the bank's rows (i < n_bank), then p */
static inline const float *ar_src(const float *bank, int n_bank, const float *p, int64_t T,
                                  int64_t D, int i, int64_t t) {
    return i < n_bank ? bank + ((int64_t)i * T + t) * D : p + t * D;
}
/* lane k: the score of row rows[k] (ref's ss, r, then dot chains), into dot */
static inline void ar_lanes(const float *const *rows, int64_t D, float eps, const float *w,
                            float *dot) {
    float r[VL];
    V_STORE(r, tl_sumsq(rows, D));
    for (int k = 0; k < VL; k++) r[k] = 1.0f / sqrtf(r[k] / (float)D + eps);
    V_STORE(dot, tl_dot(rows, D, V_LOAD(r), w));
}
#if VL == 1
/* the N scores of token t alone, into s */
static void ar_scores1(const float *bank, int n_bank, const float *p, const float *w, int64_t T,
                       int64_t D, float eps, int64_t t, float *s) {
    const int N = n_bank + 1;
    for (int i0 = 0; i0 < N; i0 += AR_ROWS) { /* the scores of sources [i0, i0 + AR_ROWS) */
        const int nr = N - i0 < AR_ROWS ? N - i0 : AR_ROWS;
        const float *v[AR_ROWS];
        float ss[AR_ROWS], dot[AR_ROWS], r[AR_ROWS];
        for (int k = 0; k < AR_ROWS; k++) {
            v[k] = ar_src(bank, n_bank, p, T, D, i0 + (k < nr ? k : 0), t);
            ss[k] = 0.0f, dot[k] = 0.0f;
        }
        for (int64_t d = 0; d < D; d++)
            _Pragma("GCC unroll 8") for (int k = 0; k < AR_ROWS; k++) ss[k] += v[k][d] * v[k][d];
        for (int k = 0; k < AR_ROWS; k++) r[k] = 1.0f / sqrtf(ss[k] / (float)D + eps);
        for (int64_t d = 0; d < D; d++)
            _Pragma("GCC unroll 8") for (int k = 0; k < AR_ROWS; k++) dot[k] +=
                (v[k][d] * r[k]) * w[d];
        for (int k = 0; k < nr; k++) s[i0 + k] = dot[k];
    }
}
#else
/* the N scores of token t alone, into s: VL sources at a time in the lanes (the unused ones
   repeat the first), each lane ref's chains over d for its source; the chains of ar_scores1
   side by side in scalar registers took 1.9x (AVX-512) and 2.1x (AVX2) as long (n_bank 1-7,
   D 1024, one thread) */
static void ar_scores1v(const float *bank, int n_bank, const float *p, const float *w, int64_t T,
                        int64_t D, float eps, int64_t t, float *s) {
    const int N = n_bank + 1;
    for (int i0 = 0; i0 < N; i0 += VL) {
        const int nr = N - i0 < VL ? N - i0 : VL;
        const float *rows[VL];
        float dot[VL];
        for (int k = 0; k < VL; k++)
            rows[k] = ar_src(bank, n_bank, p, T, D, i0 + (k < nr ? k : 0), t);
        ar_lanes(rows, D, eps, w, dot);
        for (int k = 0; k < nr; k++) s[i0 + k] = dot[k];
    }
}
#endif
/* the N scores of tokens t .. t + nt - 1 (nt <= VL; the unused lanes repeat token t), token k's
   into s + 64·k */
static void ar_scoresv(const float *bank, int n_bank, const float *p, const float *w, int64_t T,
                       int64_t D, float eps, int64_t t, int nt, float *s) {
    for (int i = 0; i <= n_bank; i++) {
        const float *rows[VL];
        float dot[VL];
        for (int k = 0; k < VL; k++)
            rows[k] = ar_src(bank, n_bank, p, T, D, i, t + (k < nt ? k : 0));
        ar_lanes(rows, D, eps, w, dot);
        for (int k = 0; k < nt; k++) s[64 * k + i] = dot[k];
    }
}
/* token t's output from its N scores s (overwritten by the weights: ref's softmax) */
static void ar_mix(const float *bank, int n_bank, const float *p, int64_t T, int64_t D, int64_t t,
                   float *s, float *out) {
    k3_ref_attnres_softmax(s, n_bank + 1);
    const float *src[64]; /* the token's source rows, found once (n_bank + 1 <= 64) */
    for (int i = 0; i <= n_bank; i++) src[i] = ar_src(bank, n_bank, p, T, D, i, t);
    /* out may alias p: each element's p is read before its write */
    int64_t d = 0;
    for (; d + VL <= D; d += VL) {
        VEC acc = V_ZERO();
        for (int i = 0; i <= n_bank; i++) acc = V_ADD(acc, V_MUL(V_SET1(s[i]), V_LOAD(src[i] + d)));
        V_STORE(out + t * D + d, acc);
    }
    for (; d < D; d++) {
        float acc = 0.0f;
        for (int i = 0; i <= n_bank; i++) acc += s[i] * src[i][d];
        out[t * D + d] = acc;
    }
}
/* A block of nt tokens in the lanes costs N = n_bank + 1 passes of ar_lanes (one per source);
   its tokens one at a time, sources in the lanes, nt·⌈N/VL⌉: the block is taken when it is no
   dearer (always for VL tokens; a tail of few tokens with many sources goes one at a time). */
static void attnres_rows(const float *bank, int n_bank, const float *p, const float *w, int64_t T,
                         int64_t D, float eps, float *out, int64_t t0, int64_t t1) {
    float s[64 * VL];
    const int N = n_bank + 1, one = (N + VL - 1) / VL; /* passes of one token alone */
    for (int64_t t = t0; t < t1;) {
        const int nt = t1 - t >= VL ? VL : (int)(t1 - t);
        if (nt > 1 && N <= nt * one) { /* all the block's scores before any output: out may
                                          alias p */
            ar_scoresv(bank, n_bank, p, w, T, D, eps, t, nt, s);
            for (int k = 0; k < nt; k++) ar_mix(bank, n_bank, p, T, D, t + k, s + 64 * k, out);
            t += nt;
            continue;
        }
#if VL > 1
        ar_scores1v(bank, n_bank, p, w, T, D, eps, t, s);
#else
        ar_scores1(bank, n_bank, p, w, T, D, eps, t, s);
#endif
        ar_mix(bank, n_bank, p, T, D, t, s, out);
        t++;
    }
}

/* KDA per head (kern_kda.h) and latent attention by tiles of (query, head) rows (kern_attn.h). */
#include "kern_attn.h"
#include "kern_kda.h"

const k3_cpu_kern KERN_NAME = {
    .name = KERN_ISA,
    .gt = GT,
    .mx_gemv_t = MX_GEMV_T,
    .gemv_t = GV_TMAX,
    .mm_rows = mm_rows,
    .xpk_floats = xpk_floats,
    .xpk_pack = xpk_pack,
    .mm_rows_xpk = mm_rows_xpk,
    .mmtn_cols = mmtn_cols,
    .silu = silu,
    .sigmoid = sigmoid,
    .situ = situ,
    .swiglu = swiglu,
    .softmax_row = softmax_row,
    .attn_rows = attn_rows,
    .attn_sb = ATT_SB,
    .attn_part = attn_part,
    .attn_merge = attn_merge,
    .attn_final = attn_final,
    .kda_head = kda_head,
    .conv_cols = conv_cols,
    .wsum_seg = wsum_seg,
    .attnres_rows = attnres_rows,
    .norm_rows = norm_rows,
};
