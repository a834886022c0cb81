/* emu_mma.cpp — k3's CUDA emulation (K3_CUDA_EMULATE builds only): the arithmetic of one warp's
 * mma.m16n8k16 bf16 -> f32, done once for the warp by its lane 0 (k3c_mma.cuh gathers the 32
 * lanes' fragments on the warp rendezvous and hands them here). The fragment maps are those of the
 * PTX ISA (lane l = 4g + t):
 *   A (16x16, row-major): a[r] of lane l holds A[g + 8(r & 1)][2t + 8(r >> 1) + h], h = 0, 1;
 *   B (16x8):             b[r] of lane l holds B[2t + 8r + h][g];
 *   C/D (16x8):           c[i] / d[i] of lane l is C[g + 8(i >> 1)][2t + (i & 1)].
 * Each element is summed in double over k = 0..15 in order, then c is added and the sum rounded
 * once to fp32: the bf16 products are exact, so the result does not depend on the order (the
 * layout oracle's exact tiles) and is within one fp32 rounding of the exact dot product.
 * This file is compiled with optimisation even in Debug builds (CMakeLists.txt): it is the
 * emulator's arithmetic, run ~100k times a model step, not code under test. */
#include "cuda_runtime.h"

#include <string.h>

namespace k3emu {

static inline float bf16_lo(uint32_t w) {
    const uint32_t u = w << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float bf16_hi(uint32_t w) {
    const uint32_t u = w & 0xffff0000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void mma_m16n8k16_bf16(const uint64_t *lanes) {
    double A[16][16], B[8][16]; /* B transposed: B[col][k] */
    for (unsigned l = 0; l < 32; l++) {
        const mma_frag *f = (const mma_frag *)(uintptr_t)lanes[l];
        const unsigned g = l >> 2, t = l & 3u;
        for (unsigned r = 0; r < 4; r++) {
            const unsigned row = g + 8u * (r & 1u), k = 2u * t + 8u * (r >> 1);
            A[row][k] = bf16_lo(f->a[r]);
            A[row][k + 1] = bf16_hi(f->a[r]);
        }
        for (unsigned r = 0; r < 2; r++) {
            const unsigned k = 2u * t + 8u * r;
            B[g][k] = bf16_lo(f->b[r]);
            B[g][k + 1] = bf16_hi(f->b[r]);
        }
    }
    for (unsigned l = 0; l < 32; l++) {
        mma_frag *f = (mma_frag *)(uintptr_t)lanes[l];
        const unsigned g = l >> 2, t = l & 3u;
        for (unsigned i = 0; i < 4; i++) {
            const double *a = A[g + 8u * (i >> 1)], *b = B[2u * t + (i & 1u)];
            double s = 0;
            for (unsigned k = 0; k < 16; k++) s += a[k] * b[k];
            f->d[i] = (float)(s + (double)f->c[i]);
        }
    }
}

} // namespace k3emu
