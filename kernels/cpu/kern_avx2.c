/* kern_avx2.c — the cpu kernels for AVX2 + FMA (8 lanes): kern_tmpl.h compiled with
 * -mavx2 -mfma -mf16c (CMakeLists.txt sets the flags for this file only; isa.c hands the table
 * out only when cpuid reports them). BF16 widens by a shift; an MXFP4 block decodes in registers
 * through a byte table of the doubled E2M1 values (vpshufb), scaled by half the block's E8M0
 * (exact: k·2^(e−128) = E2M1·2^(e−127)), no dequantised copy. */
#include "cpu_kern.h"

#include <immintrin.h>
#include <math.h>

#include "k3_mxfp4.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "kern_avx2.c needs -mavx2 -mfma (set in CMakeLists.txt)"
#endif

#define VEC                  __m256
#define VL                   8
#define GR                   4
#define GT                   3
#define GV_TMAX              12 /* F32/BF16 products of up to 11 tokens take the decode rows */
#define KERN_NAME            k3_cpu_kern_avx2
#define KERN_ISA             "avx2"
#define V_PREFETCH(p)        _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define V_ZERO()             _mm256_setzero_ps()
#define V_SET1(f)            _mm256_set1_ps(f)
#define V_LOAD(p)            _mm256_loadu_ps(p)
#define V_STORE(p, v)        _mm256_storeu_ps(p, v)
#define V_ADD                _mm256_add_ps
#define V_SUB                _mm256_sub_ps
#define V_MUL                _mm256_mul_ps
#define V_DIV                _mm256_div_ps
#define V_MIN                _mm256_min_ps
#define V_MAX                _mm256_max_ps
#define V_FMA(a, b, c)       _mm256_fmadd_ps(a, b, c)
#define V_SFMA(a, b, c)      fmaf(a, b, c)
#define V_ABS(v)             _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v)
#define V_COPYSIGN(m, s)     _mm256_or_ps(m, _mm256_and_ps(s, _mm256_set1_ps(-0.0f)))
#define V_SEL_LT(a, b, x, y) _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ))
#define V_POW2I(n)                                                                                 \
    _mm256_castsi256_ps(                                                                           \
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#define V_LOAD_BF16(p)                                                                             \
    _mm256_castsi256_ps(                                                                           \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi); /* 4 */
    __m128 sh = _mm_movehl_ps(lo, lo);
    lo = _mm_add_ps(lo, sh); /* 2 */
    sh = _mm_shuffle_ps(lo, lo, 1);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
/* hsum_v(v, n): lane i = hsum8(v[i]) + 0.0f for i < n <= VL (the others undefined), bit for
 * bit: the rows folded together, two per instruction, along hsum8's tree — lanes (i, i+4),
 * (k, k+2), (0, 1). Missing partners are zero vectors. */
static inline __attribute__((always_inline)) __m256 hsum_v(__m256 *v, int n) {
    int m = n;
    _Pragma("GCC unroll 3") for (int lv = 0; lv < 3; lv++) {
        if (m % 2) v[m] = _mm256_setzero_ps();
        const int h = (m + 1) / 2;
        _Pragma("GCC unroll 4") for (int i = 0; i < h; i++) {
            const __m256 a = v[2 * i], b = v[2 * i + 1];
            __m256 lo, hi;
            if (lv == 0) { /* 128-bit lane L: row 2i+L */
                lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31);
            } else if (lv == 1) { /* lane L: elements 0,1 row 4i+L, 2,3 row 4i+2+L */
                lo = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
                hi = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
            } else { /* lane L, element k: row 2k+L */
                lo = _mm256_shuffle_ps(a, b, 0x88), hi = _mm256_shuffle_ps(a, b, 0xdd);
            }
            v[i] = _mm256_add_ps(lo, hi);
        }
        m = h;
    }
    return _mm256_add_ps(_mm256_permutevar8x32_ps(v[0], _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)),
                         _mm256_setzero_ps());
}
/* lanes i < n of v to p[i] (n <= VL) */
#define V_STOREN(p, v, n)                                                                          \
    _mm256_maskstore_ps(                                                                           \
        p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), v)
#define V_HSUM(v) hsum8(v)
#define V_HMAX(v) hmax8(v)

/* the byte table gives ggml's doubled E2M1 integers; unpacking the low/high nibble results
 * byte by byte restores element order (byte m holds elements 2m, 2m+1). */
static inline float mx_scale(uint8_t e8) { /* the table holds doubled values */
    return 0.5f * k3_e8m0_to_f32(e8);
}
static inline void mx32s(const uint8_t *codes, float s, VEC *w) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i raw = _mm_loadu_si128((const __m128i *)codes);
    __m128i vlo = _mm_shuffle_epi8(lut, _mm_and_si128(raw, m4));
    __m128i vhi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
    __m128i e0 = _mm_unpacklo_epi8(vlo, vhi), e1 = _mm_unpackhi_epi8(vlo, vhi);
    __m256 dh = _mm256_set1_ps(s);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e0)), dh);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e0, 8))), dh);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e1)), dh);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e1, 8))), dh);
}

#define MX_XPERM 0 /* mx32s gives element order (kern_tmpl.h supplies mx_xperm, mx_store32) */

/* transpose_v(v): the 8 × 8 block of v[0..7] transposed in registers (lane k of v[j] becomes
 * lane j of v[k]): the row reductions (kern_tmpl.h) put 8 tokens' chains in the lanes with it.
 * Pairs of 32-bit elements, of 64-bit ones, then the 128-bit halves. */
static inline __attribute__((always_inline)) void transpose_v(__m256 *v) {
    __m256 a[8], b[8];
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    /* b[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3 */
    _Pragma("GCC unroll 2") for (int i = 0; i < 2; i++) {
        const __m256d lo = _mm256_castps_pd(a[4 * i]), lo2 = _mm256_castps_pd(a[4 * i + 2]);
        const __m256d hi = _mm256_castps_pd(a[4 * i + 1]), hi2 = _mm256_castps_pd(a[4 * i + 3]);
        b[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(lo, lo2));
        b[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(lo, lo2));
        b[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(hi, hi2));
        b[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(hi, hi2));
    }
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        v[c] = _mm256_permute2f128_ps(b[c], b[4 + c], 0x20);
        v[4 + c] = _mm256_permute2f128_ps(b[c], b[4 + c], 0x31);
    }
}

#include "kern_tmpl.h"
