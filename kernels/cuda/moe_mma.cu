// moe_mma.cu — the grouped MXFP4 expert GEMM (W4A16) on the tensor-core primitives of
// k3c_mma.cuh (issue 44): y = bf16(x) · W_eᵀ per expert e, contiguous layout (the rows of expert e
// are x rows [off[e], off[e+1])), weights repacked at load time into mma B-fragment order
// (k3c_repack.h), so each lane's B fragments for a k32 step are one 32-bit load, dequantised with
// k3c_e2m1x8_to_bf16 (bit operations and one multiply by 2^126) and one multiply by the group's
// E8M0 scale (exact: a power of two), then two mma.m16n8k16 (bf16 in, fp32 accumulate).
// Activations: each block converts its 16-row tile of x to bf16 (round to nearest even) in shared
// memory, K3C_W4_KC columns at a time, and the warps load their A fragments with ldmatrix.x4.
// Block: K3C_W4_WARPS warps, warp w the n-tile (8 outputs) blockIdx.x · K3C_W4_WARPS + w; grid.y:
// 16-row tiles of the expert (max_rows sizes it; a block past the expert's rows exits whole);
// grid.z: the expert. Layouts: contiguous (per-expert row offsets) for prefill, masked (fixed
// capacity, per-expert counts in device memory, as for graph-captured decode). Gate/up fused: with
// W3, the same lane holds the same (row, column) of both accumulators, so the activation is the
// epilogue. Not yet wired into the backend's moe_experts (see docs/DESIGN.md §3b).
//
// Verified in the emulation (tests/gpu/test_cuda_mma.cu) against the checkpoint's decode;
// device run pending.
#include "cuda_launch.h"
#include "k3c_mma.cuh"

#define K3C_W4_WARPS 4
#define K3C_W4_KC    256             /* k columns of x per shared tile */
#define K3C_W4_LD    (K3C_W4_KC + 8) /* row stride in bf16: 528 bytes, 16-aligned, bank-skewed */

/* acc += the 16 x 8 tile's product over one k32 group: B from the word and scale of (nt, kt) */
static __device__ __forceinline__ void w4_step(float acc[4], uint32_t word, uint8_t sc,
                                               const uint32_t a[2][4]) {
    uint32_t b[4];
    k3c_e2m1x8_to_bf16(word, b);
    const uint32_t s1 = k3c_e8m0_to_bf16(sc), s2 = s1 | s1 << 16;
    for (int j = 0; j < 4; j++) b[j] = k3c_bf16x2_mul(b[j], s2);
    k3c_mma_bf16_16816(acc, a[0], b, acc);
    k3c_mma_bf16_16816(acc, a[1], b + 2, acc);
}

static __global__ void __launch_bounds__(K3C_W4_WARPS * 32)
    w4a16_grouped_kernel(const uint32_t *words, const uint8_t *scales, const uint32_t *words3,
                         const uint8_t *scales3, int64_t N, int64_t K, k3c_w4_rows rows, float beta,
                         float lin_beta, const float *x, float *y) {
    K3C_SHARED(uint16_t, xs, [16 * K3C_W4_LD]);
    const int64_t e = blockIdx.z;
    int64_t r0, r1;
    if (rows.cap > 0) {
        const int64_t c = rows.count[e] < rows.cap ? rows.count[e] : rows.cap;
        r0 = e * rows.cap + 16 * (int64_t)blockIdx.y, r1 = e * rows.cap + (c > 0 ? c : 0);
    } else {
        r0 = rows.off[e] + 16 * (int64_t)blockIdx.y, r1 = rows.off[e + 1];
    }
    if (r0 >= r1) return; /* the whole block: past this expert's rows */
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3u;
    const int64_t NT = N / 8, KT = K / 32, nt = (int64_t)blockIdx.x * K3C_W4_WARPS + warp;
    const bool active = nt < NT;
    const int64_t w0 = (e * NT + nt) * KT * 32, s0 = (e * NT + nt) * KT * 8;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc3[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t kc = 0; kc < K; kc += K3C_W4_KC) {
        const int kn = (int)(K - kc < K3C_W4_KC ? K - kc : K3C_W4_KC);
        __syncthreads(); /* the previous tile is consumed */
        for (int i = (int)threadIdx.x; i < 16 * kn; i += (int)blockDim.x) {
            const int r = i / kn, c = i % kn;
            const float v = r0 + r < r1 ? x[(r0 + r) * K + kc + c] : 0.0f;
            xs[r * K3C_W4_LD + c] = k3c_bf16_rne(v);
        }
        __syncthreads();
        if (!active) continue;
        for (int kk = 0; kk < kn; kk += 32) {
            const int64_t kt = (kc + kk) / 32;
            uint32_t a[2][4];
            /* per k16 step, matrix lane / 8: rows 8·(m & 1) .. +7, columns 8·(m >> 1) */
            for (int step = 0; step < 2; step++)
                k3c_ldmatrix_x4(a[step], xs + ((lane / 8 & 1u) * 8 + lane % 8) * K3C_W4_LD + kk +
                                             16 * step + (lane / 16) * 8);
            w4_step(acc, words[w0 + kt * 32 + lane], scales[s0 + kt * 8 + g], a);
            if (words3) w4_step(acc3, words3[w0 + kt * 32 + lane], scales3[s0 + kt * 8 + g], a);
        }
    }
    if (!active) return;
    for (int i = 0; i < 4; i++) {
        const int64_t r = r0 + g + 8 * (i >> 1);
        if (r < r1)
            y[r * N + 8 * nt + 2 * t + (i & 1)] =
                words3 ? k3c_moe_act(acc[i], acc3[i], beta, lin_beta) : acc[i];
    }
}

extern "C" int k3c_w4a16_grouped(cudaStream_t s, const uint32_t *words, const uint8_t *scales,
                                 const uint32_t *words3, const uint8_t *scales3, int E, int64_t N,
                                 int64_t K, k3c_w4_rows rows, float beta, float lin_beta,
                                 const float *x, float *y) {
    if (E <= 0 || rows.max_rows <= 0) return 0;
    const dim3 grid((unsigned)((N / 8 + K3C_W4_WARPS - 1) / K3C_W4_WARPS),
                    (unsigned)((rows.max_rows + 15) / 16), (unsigned)E);
    K3C_LAUNCH(grid, K3C_W4_WARPS * 32, 0, s, w4a16_grouped_kernel)
    (words, scales, words3, scales3, N, K, rows, beta, lin_beta, x, y);
    return (int)cudaGetLastError();
}
