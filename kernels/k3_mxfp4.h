/* k3_mxfp4.h — the MXFP4 formats, defined once for C and CUDA (static inline, no globals).
 *
 * Owns: the E2M1 code table, the E8M0 scale, the compressed-tensors `mxfp4-pack-quantized`
 * row layout of the checkpoint (the "native" layout), and ggml's `block_mxfp4` with the
 * lossless repack between them (spec/K3-MODEL.md §7.1-7.3). Everything here is a pure function
 * of bytes; the reference decode below defines what MXFP4 bytes mean for every k3 backend.
 *
 * Native layout, one row of `n` logical elements (n % 32 == 0):
 *   packed[n/2]  byte b: low nibble = element 2b, high nibble = element 2b+1
 *   scale[n/32]  E8M0 biased exponent of the 32-element group
 *   W[i] = E2M1(code[i]) * 2^(scale[i/32] - 127)
 * ggml layout: struct { uint8 e; uint8 qs[16]; } per 32 elements, qs[j] low nibble = element j,
 *   high nibble = element j+16, value = kvalues[code] * 2^(e - 128), kvalues = 2 * E2M1.
 *
 * E8M0 edge values (decided by what compressed-tensors 0.20 does, since it is the reference
 * reader of the checkpoint format): decompress_mx_scale computes 2.0 ** (e - 127) in bf16, so
 *   e = 0   -> 2^-127 (a subnormal, exact in f32 and bf16)
 *   e = 255 -> 2^128 overflows to +inf (NOT NaN as OCP specifies, NOT 2^127 as ggml decodes);
 *              a code of ±0 then gives NaN (0 * inf) and any other code ±inf, exactly as
 *              compressed-tensors' dequantize does. K3 never stores e = 255.
 * ggml's own decode of e = 255 is 2^127 (k3_e8m0_to_f32_half_ggml(255) * 2); the repack is a
 * byte permutation, so it is lossless for every byte; the two decodes agree for e <= 254. */
#ifndef K3_MXFP4_H
#define K3_MXFP4_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define K3_MXFP4_FN static __host__ __device__ __forceinline__
#else
#define K3_MXFP4_FN static inline
#endif

#define K3_MXFP4_GROUP       32 /* elements per E8M0 scale */
#define K3_MXFP4_GROUP_BYTES 16 /* packed bytes per group (2 elements per byte) */

/* ggml block_mxfp4 (ggml-common.h, GGML_TYPE_MXFP4 = 39): 17 bytes per 32 values. */
typedef struct k3_block_mxfp4 {
    uint8_t e;      /* E8M0 exponent; d = 2^(e - 128) */
    uint8_t qs[16]; /* qs[j]: low nibble = element j, high nibble = element j + 16 */
} k3_block_mxfp4;
#ifdef __cplusplus
static_assert(sizeof(k3_block_mxfp4) == 17, "block_mxfp4 is 17 bytes");
#else
_Static_assert(sizeof(k3_block_mxfp4) == 17, "block_mxfp4 is 17 bytes");
#endif

K3_MXFP4_FN float k3_mxfp4_bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* E2M1 (bit 3 = sign, bits 2..1 = exponent, bit 0 = mantissa): 0..7 -> {0, .5, 1, 1.5, 2, 3, 4,
 * 6}, 8..15 the same negated (code 8 is -0.0). Computed from the bits (no table), so the same
 * code runs on the device. */
K3_MXFP4_FN float k3_mxfp4_e2m1(unsigned code) {
    unsigned e = (code >> 1) & 3u, m = code & 1u;
    /* e == 0: subnormal m * 0.5; else (1 + m/2) * 2^(e-1). As f32 bits: exponent 127 + e - 1. */
    uint32_t mag = e == 0 ? (m ? 0x3f000000u : 0u) : ((126u + e) << 23) | (m << 22);
    return k3_mxfp4_bits_to_f32(mag | ((uint32_t)(code & 8u) << 28));
}

/* ggml kvalues_mxfp4: the doubled E2M1 values as int8 {0,1,2,3,4,6,8,12, 0,-1,...,-12}. */
K3_MXFP4_FN int k3_mxfp4_kvalue(unsigned code) {
    unsigned c = code & 7u;
    int v = c < 5 ? (int)c : (c == 5 ? 6 : (c == 6 ? 8 : 12));
    return (code & 8u) ? -v : v;
}

/* E8M0 -> f32 as compressed-tensors decodes it: 2^(e - 127); e = 0 -> 2^-127; e = 255 -> +inf. */
K3_MXFP4_FN float k3_e8m0_to_f32(uint8_t e) {
    if (e == 0) return k3_mxfp4_bits_to_f32(0x00400000u); /* 2^-127, subnormal */
    if (e == 255) return k3_mxfp4_bits_to_f32(0x7f800000u);
    return k3_mxfp4_bits_to_f32((uint32_t)e << 23);
}

/* ggml GGML_E8M0_TO_FP32_HALF: 2^(e - 128); e = 0 -> 2^-128, e = 1 -> 2^-127, e = 255 -> 2^127. */
K3_MXFP4_FN float k3_e8m0_to_f32_half_ggml(uint8_t e) {
    if (e < 2) return k3_mxfp4_bits_to_f32(0x00200000u << e);
    return k3_mxfp4_bits_to_f32((uint32_t)(e - 1) << 23);
}

/* One logical element of a native row. */
K3_MXFP4_FN float k3_mxfp4_get(const uint8_t *packed, const uint8_t *scale, int64_t i) {
    unsigned b = packed[i >> 1];
    unsigned code = (i & 1) ? (b >> 4) : (b & 15u);
    return k3_mxfp4_e2m1(code) * k3_e8m0_to_f32(scale[i / K3_MXFP4_GROUP]);
}

/* The reference decode of one native row of n elements (n % 32 == 0) into out[n]. */
K3_MXFP4_FN void k3_mxfp4_decode_row(const uint8_t *packed, const uint8_t *scale, int64_t n,
                                     float *out) {
    for (int64_t g = 0; g < n / K3_MXFP4_GROUP; g++) {
        float d = k3_e8m0_to_f32(scale[g]);
        const uint8_t *p = packed + g * K3_MXFP4_GROUP_BYTES;
        float *o = out + g * K3_MXFP4_GROUP;
        for (int m = 0; m < 16; m++) {
            o[2 * m] = k3_mxfp4_e2m1(p[m] & 15u) * d;
            o[2 * m + 1] = k3_mxfp4_e2m1(p[m] >> 4) * d;
        }
    }
}

/* Repack one 32-element group (16 native bytes + its scale) into a ggml block (§7.3). */
K3_MXFP4_FN void k3_mxfp4_repack_block(const uint8_t *packed16, uint8_t scale,
                                       k3_block_mxfp4 *dst) {
    uint8_t c[32];
    for (int m = 0; m < 16; m++) {
        c[2 * m] = (uint8_t)(packed16[m] & 15u);
        c[2 * m + 1] = (uint8_t)(packed16[m] >> 4);
    }
    dst->e = scale;
    for (int j = 0; j < 16; j++) dst->qs[j] = (uint8_t)(c[j] | (c[j + 16] << 4));
}

/* Repack a native row of n elements into n/32 ggml blocks. */
K3_MXFP4_FN void k3_mxfp4_repack_row(const uint8_t *packed, const uint8_t *scale, int64_t n,
                                     k3_block_mxfp4 *dst) {
    for (int64_t g = 0; g < n / K3_MXFP4_GROUP; g++)
        k3_mxfp4_repack_block(packed + g * K3_MXFP4_GROUP_BYTES, scale[g], dst + g);
}

/* ggml's dequantize_row_mxfp4 for one block: y[j] = kvalues[lo] * d, y[j+16] = kvalues[hi] * d. */
K3_MXFP4_FN void k3_mxfp4_decode_block_ggml(const k3_block_mxfp4 *b, float out[32]) {
    float d = k3_e8m0_to_f32_half_ggml(b->e);
    for (int j = 0; j < 16; j++) {
        out[j] = (float)k3_mxfp4_kvalue(b->qs[j] & 15u) * d;
        out[j + 16] = (float)k3_mxfp4_kvalue(b->qs[j] >> 4) * d;
    }
}

#endif /* K3_MXFP4_H */
