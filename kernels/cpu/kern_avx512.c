/* kern_avx512.c — the cpu kernels for AVX-512 F/BW/VL (16 lanes): kern_tmpl.h compiled with
 * -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma (CMakeLists.txt sets the flags for this file
 * only; isa.c hands the table out only when cpuid reports them). BF16 widens by a shift; an
 * MXFP4 block decodes in registers through a 16-entry float table scaled by the block's E8M0
 * (vpermps), no dequantised copy. */
#include "cpu_kern.h"

#include <immintrin.h>
#include <math.h>
#include <pthread.h>

#include "k3_mxfp4.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "kern_avx512.c needs -mavx512f -mavx512bw -mavx512vl (set in CMakeLists.txt)"
#endif

#define VEC             __m512
#define VL              16
#define GR              6
#define GT              4
#define MX_GEMV_T       16 /* MXFP4 products of up to 15 tokens take the decode path */
#define GV_TMAX         24 /* F32/BF16: up to 23 */
#define KERN_NAME       k3_cpu_kern_avx512
#define KERN_ISA        "avx512"
#define V_PREFETCH(p)   _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define V_ZERO()        _mm512_setzero_ps()
#define V_SET1(f)       _mm512_set1_ps(f)
#define V_LOAD(p)       _mm512_loadu_ps(p)
#define V_STORE(p, v)   _mm512_storeu_ps(p, v)
#define V_ADD           _mm512_add_ps
#define V_SUB           _mm512_sub_ps
#define V_MUL           _mm512_mul_ps
#define V_DIV           _mm512_div_ps
#define V_MIN           _mm512_min_ps
#define V_MAX           _mm512_max_ps
#define V_FMA(a, b, c)  _mm512_fmadd_ps(a, b, c)
#define V_SFMA(a, b, c) fmaf(a, b, c)
#define V_HSUM(v)       _mm512_reduce_add_ps(v)
#define V_HMAX(v)       _mm512_reduce_max_ps(v)
#define V_ABS(v)        _mm512_abs_ps(v)
#define V_COPYSIGN(m, s)                                                                           \
    _mm512_castsi512_ps(_mm512_or_si512(                                                           \
        _mm512_castps_si512(m),                                                                    \
        _mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32((int)0x80000000u))))
#define V_SEL_LT(a, b, x, y) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x)
#define V_POW2I(n)                                                                                 \
    _mm512_castsi512_ps(                                                                           \
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define V_LOAD_BF16(p)                                                                             \
    _mm512_castsi512_ps(                                                                           \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))

/* hsum_v(v, n): lane i = V_HSUM(v[i]) + 0.0f for i < n <= VL (the others undefined), bit for
 * bit: the rows are folded together, two per instruction, along _mm512_reduce_add_ps's own tree
 * — lanes (i, i+8), then (j, j+4), (k, k+2), (0, 1) — instead of one row's latency chain at a
 * time (16 rows: ~50 instructions instead of ~180). Missing partners are zero vectors. */
static inline __attribute__((always_inline)) VEC hsum_v(VEC *v, int n) {
    int m = n;
    _Pragma("GCC unroll 4") for (int lv = 0; lv < 4; lv++) {
        if (m % 2) v[m] = V_ZERO();
        const int h = (m + 1) / 2;
        _Pragma("GCC unroll 8") for (int i = 0; i < h; i++) {
            const __m512 a = v[2 * i], b = v[2 * i + 1];
            __m512 lo, hi;
            if (lv == 0) { /* row 2i in lanes 0-7, 2i+1 in 8-15 */
                lo = _mm512_shuffle_f32x4(a, b, 0x44), hi = _mm512_shuffle_f32x4(a, b, 0xee);
            } else if (lv == 1) { /* 128-bit lane L: row 4i+L */
                lo = _mm512_shuffle_f32x4(a, b, 0x88), hi = _mm512_shuffle_f32x4(a, b, 0xdd);
            } else if (lv == 2) { /* lane L: elements 0,1 row 8i+L, 2,3 row 8i+4+L */
                lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
                hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
            } else { /* lane L, element k: row 4k+L */
                lo = _mm512_shuffle_ps(a, b, 0x88), hi = _mm512_shuffle_ps(a, b, 0xdd);
            }
            v[i] = _mm512_add_ps(lo, hi);
        }
        m = h;
    }
    const __m512i rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_add_ps(_mm512_permutexvar_ps(rows, v[0]), _mm512_setzero_ps());
}
/* lanes i < n of v to p[i] (n <= VL) */
#define V_STOREN(p, v, n) _mm512_mask_storeu_ps(p, (__mmask16)((1u << (n)) - 1), v)

/* codes byte m: low nibble = element 2m, high = 2m+1. Both nibbles index the scaled E2M1 table
 * (vpermps reads index bits 3..0 only, so the low nibble needs no mask): w[0] = the 16 even
 * elements, w[1] = the 16 odd ones (MX_XPERM: x is copied in that order once, by mx_xperm, instead
 * of interleaving every weight block back). */
#define MX_XPERM 1
/* mx_scale(e8): the factor mx32s takes for a block's E8M0 byte (decode paths convert a row's
 * scales ahead, kern_gemv.h). */
static inline float mx_scale(uint8_t e8) {
    return k3_e8m0_to_f32(e8);
}
static inline void mx32s(const uint8_t *codes, float s, VEC *w) {
    const __m512 tbl = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                      -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    __m512 ts = _mm512_mul_ps(tbl, _mm512_set1_ps(s));
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    w[0] = _mm512_permutexvar_ps(v, ts);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts);
}
/* The decode matmul's form (MX_TAB): the scaled tables of all 256 E8M0 bytes, 16 KB made once
 * (mx_tab[e][c] = the E2M1 value of c × mx_scale(e), the very products mx32s's vmulps makes),
 * so a block's two permutes read their table from memory by its scale byte: one multiply and
 * one broadcast fewer per block (6 vector uops instead of 7; the decode of MXFP4 rows is bound
 * by them, not by DRAM). */
#define MX_TAB 1
static _Alignas(64) float mx_tab[256][16];
static pthread_once_t mx_tab_once = PTHREAD_ONCE_INIT;
static void mx_tab_fill(void) {
    static const float e2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    for (int e = 0; e < 256; e++)
        for (int c = 0; c < 16; c++) mx_tab[e][c] = e2m1[c] * mx_scale((uint8_t)e);
}
static inline void mx_tab_init(void) {
    pthread_once(&mx_tab_once, mx_tab_fill);
}
static inline void mx32t(const uint8_t *codes, uint8_t e8, VEC *w) {
    const __m512 ts = _mm512_load_ps(mx_tab[e8]);
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    w[0] = _mm512_permutexvar_ps(v, ts);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts);
}
static inline void mx_xperm(const float *x, float *xd, int64_t n) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int64_t i = 0; i < n; i += 32) {
        __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        _mm512_storeu_ps(xd + i, _mm512_permutex2var_ps(a, ev, b));
        _mm512_storeu_ps(xd + i + 16, _mm512_permutex2var_ps(a, od, b));
    }
}
static inline void mx_store32(float *y, const VEC *v) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi =
        _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    _mm512_storeu_ps(y, _mm512_permutex2var_ps(v[0], lo, v[1]));
    _mm512_storeu_ps(y + 16, _mm512_permutex2var_ps(v[0], hi, v[1]));
}

/* transpose_v(v): the 16 × 16 block of v[0..15] transposed in registers (lane k of v[j] becomes
 * lane j of v[k]): the row reductions (kern_tmpl.h) put 16 tokens' chains in the lanes with it.
 * Four rounds of 16 shuffles: pairs of 32-bit elements, of 64-bit ones, then the 4 × 4 blocks of
 * 128-bit lanes in two rounds of vshuff32x4. */
static inline __attribute__((always_inline)) void transpose_v(__m512 *v) {
    __m512 a[16], b[16];
    _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    /* b[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3 */
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        const __m512d lo = _mm512_castps_pd(a[4 * i]), lo2 = _mm512_castps_pd(a[4 * i + 2]);
        const __m512d hi = _mm512_castps_pd(a[4 * i + 1]), hi2 = _mm512_castps_pd(a[4 * i + 3]);
        b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, lo2));
        b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, lo2));
        b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi, hi2));
        b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi, hi2));
    }
    /* column 4L + c = lane L of b[c], b[4 + c], b[8 + c], b[12 + c] */
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        const __m512 s0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x44);
        const __m512 s1 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xee);
        const __m512 s2 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x44);
        const __m512 s3 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xee);
        v[c] = _mm512_shuffle_f32x4(s0, s2, 0x88);
        v[4 + c] = _mm512_shuffle_f32x4(s0, s2, 0xdd);
        v[8 + c] = _mm512_shuffle_f32x4(s1, s3, 0x88);
        v[12 + c] = _mm512_shuffle_f32x4(s1, s3, 0xdd);
    }
}

#include "kern_tmpl.h"
