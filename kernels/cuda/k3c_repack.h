/* k3c_repack.h — the load-time repack of MXFP4 weights into mma.m16n8k16 B-fragment order (issue
 * 44), pure C (static inline; C and C++, host only), for the W4A16 kernels of k3c_mma.cuh.
 *
 * The GEMM is y[T, N] = x[T, K] · Wᵀ with W [N, K] an MXFP4 matrix in the checkpoint's native
 * layout (k3_mxfp4.h: packed[N][K/2], low nibble first; scale[N][K/32] E8M0). As the mma's B
 * operand (K x N, "col"), B[k][n] = W[n][k], so lane l (g = l >> 2, t = l % 4) of a warp needs,
 * per 16 x 8 tile at (k0, n0): b[0] = W[n0 + g][k0 + 2t + {0,1}], b[1] = W[n0 + g][k0 + 2t + 8 +
 * {0,1}] (k3c_mma.cuh). One 32-bit word per lane covers a tile of 8 rows x 32 k — two k16 steps
 * and exactly one E8M0 group — so one coalesced 128-byte load per warp feeds two mma:
 *   word (nt, kt) of lane l, nibble 2j + h (j = 0..3, h = 0, 1) = code of W[8nt + g][32kt + 16·(j
 *   >> 1) + 8·(j & 1) + 2t + h]
 * so k3c_e2m1x8_to_bf16(word) gives out[0], out[1] = b[0], b[1] of k16 step 0 and out[2], out[3]
 * those of step 1. Words are stored tile by tile, n-tile major: words[((nt·KT + kt)·32 + l], KT =
 * K/32 (a warp walking K for one n-tile reads consecutive 128-byte lines); the scales likewise,
 * one byte per row of the tile: scales[(nt·KT + kt)·8 + g] = scale[8nt + g][kt].
 * The repack is a permutation of the nibbles and of the scale bytes: lossless for every byte
 * (k3c_mxfp4_unpack inverts it). Needs N % 8 == 0 and K % 32 == 0. */
#ifndef K3C_REPACK_H
#define K3C_REPACK_H

#include <stdint.h>

#include "k3_mxfp4.h"

/* the (row, column) of W that nibble p (0..7) of lane l's word of tile (nt, kt) holds */
static inline void k3c_mxfp4_frag_pos(int64_t nt, int64_t kt, unsigned l, unsigned p, int64_t *n,
                                      int64_t *k) {
    const unsigned g = l >> 2, t = l & 3u, j = p >> 1, h = p & 1u;
    *n = 8 * nt + g;
    *k = 32 * kt + 16 * (j >> 1) + 8 * (j & 1u) + 2 * t + h;
}
static inline int64_t k3c_mxfp4_frag_words(int64_t N, int64_t K) {
    return N / 8 * (K / 32) * 32;
}
static inline int64_t k3c_mxfp4_frag_scales(int64_t N, int64_t K) {
    return N / 8 * (K / 32) * 8;
}

/* native (packed [N][K/2], scale [N][K/32]) -> words [frag_words], scales [frag_scales] */
static inline void k3c_mxfp4_repack(const uint8_t *packed, const uint8_t *scale, int64_t N,
                                    int64_t K, uint32_t *words, uint8_t *scales) {
    const int64_t KT = K / 32;
    for (int64_t nt = 0; nt < N / 8; nt++)
        for (int64_t kt = 0; kt < KT; kt++) {
            const int64_t tile = nt * KT + kt;
            for (unsigned l = 0; l < 32; l++) {
                uint32_t w = 0;
                for (unsigned p = 0; p < 8; p++) {
                    int64_t n, k;
                    k3c_mxfp4_frag_pos(nt, kt, l, p, &n, &k);
                    const uint32_t code = (packed[n * (K / 2) + k / 2] >> (4 * (k & 1))) & 15u;
                    w |= code << (4 * p);
                }
                words[tile * 32 + l] = w;
            }
            for (unsigned g = 0; g < 8; g++) scales[tile * 8 + g] = scale[(8 * nt + g) * KT + kt];
        }
}

/* the inverse: words, scales -> native packed, scale */
static inline void k3c_mxfp4_unpack(const uint32_t *words, const uint8_t *scales, int64_t N,
                                    int64_t K, uint8_t *packed, uint8_t *scale) {
    const int64_t KT = K / 32;
    for (int64_t nt = 0; nt < N / 8; nt++)
        for (int64_t kt = 0; kt < KT; kt++) {
            const int64_t tile = nt * KT + kt;
            for (unsigned l = 0; l < 32; l++)
                for (unsigned p = 0; p < 8; p++) {
                    int64_t n, k;
                    k3c_mxfp4_frag_pos(nt, kt, l, p, &n, &k);
                    uint8_t *b = &packed[n * (K / 2) + k / 2];
                    const unsigned sh = 4 * (unsigned)(k & 1);
                    *b = (uint8_t)((*b & ~(15u << sh)) |
                                   (((words[tile * 32 + l] >> (4 * p)) & 15u) << sh));
                }
            for (unsigned g = 0; g < 8; g++) scale[(8 * nt + g) * KT + kt] = scales[tile * 8 + g];
        }
}

#endif /* K3C_REPACK_H */
