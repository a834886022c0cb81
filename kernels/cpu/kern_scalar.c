/* kern_scalar.c — the cpu kernels with no SIMD (one lane): kern_tmpl.h compiled with the
 * project's default flags. The fallback on a CPU without AVX2 + FMA, and K3_ISA=scalar for
 * tests. V_FMA is a*b + c, not fused (the build has -ffp-contract=off through -std=c11), so the
 * arithmetic is the same whatever the compiler's target. */
#include "cpu_kern.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "k3_mxfp4.h"

#define VEC                  float
#define VL                   1
#define GR                   4
#define GT                   4
#define KERN_NAME            k3_cpu_kern_scalar
#define KERN_ISA             "scalar"
#define V_PREFETCH(p)        ((void)(p))
#define V_ZERO()             0.0f
#define V_SET1(f)            (f)
#define V_LOAD(p)            (*(p))
#define V_STORE(p, v)        (*(p) = (v))
#define V_ADD(a, b)          ((a) + (b))
#define V_SUB(a, b)          ((a) - (b))
#define V_MUL(a, b)          ((a) * (b))
#define V_DIV(a, b)          ((a) / (b))
#define V_MIN(a, b)          ((a) < (b) ? (a) : (b))
#define V_MAX(a, b)          ((a) > (b) ? (a) : (b))
#define V_FMA(a, b, c)       ((a) * (b) + (c))
#define V_SFMA(a, b, c)      ((a) * (b) + (c))
#define V_HSUM(v)            (v)
#define V_HMAX(v)            (v)
#define V_ABS(v)             fabsf(v)
#define V_COPYSIGN(m, s)     copysignf(m, s)
#define V_SEL_LT(a, b, x, y) ((a) < (b) ? (x) : (y))
#define V_LOAD_BF16(p)       k3_bf16_to_f32(*(p))
static inline float hsum_v(float *v, int n) { /* one lane: the sum is the value */
    (void)n;
    return v[0] + 0.0f;
}
#define V_STOREN(p, v, n) ((void)(n), *(p) = (v))

static inline float pow2i(float n) {
    if (n != n) return n; /* NaN: the cast below would be undefined */
    uint32_t u = (uint32_t)((int32_t)n + 127) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#define V_POW2I(n) pow2i(n)

static inline float mx_scale(uint8_t e8) {
    return k3_e8m0_to_f32(e8);
}
static inline void mx32s(const uint8_t *codes, float d, VEC *w) {
    for (int m = 0; m < 16; m++) {
        w[2 * m] = k3_mxfp4_e2m1(codes[m] & 15u) * d;
        w[2 * m + 1] = k3_mxfp4_e2m1(codes[m] >> 4) * d;
    }
}

#define MX_XPERM 0 /* mx32s gives element order (kern_tmpl.h supplies mx_xperm, mx_store32) */

/* transpose_v(v): one lane, nothing to move (kern_tmpl.h's row reductions, one token at a time) */
static inline void transpose_v(VEC *v) {
    (void)v;
}

#include "kern_tmpl.h"
