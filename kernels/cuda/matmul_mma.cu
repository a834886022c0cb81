// matmul_mma.cu — the dense BF16 GEMM on tensor cores (issue 44, 3e): y = x·Wᵀ for a bf16 weight
// W [out, in] and fp32 activations, on mma.m16n8k16 (k3c_mma.cuh) with the weights streamed into
// shared memory by cp.async (16 B, two stages: the next k-slab is in flight while this one is
// multiplied) and both operands loaded as fragments by ldmatrix. It serves the `matmul` op of bf16
// weights (attention and latent projections, shared experts, the LM head) and matmul_heads' plain
// (untransposed) form, one launch for every head (grid.z).
//
// Activations: x is fp32. Each block converts its tile of x to bf16 in shared memory as S planes:
// x = p_0 + p_1 + ... with p_i = bf16(x − p_0 − ... − p_{i−1}) (round to nearest even; every
// residual is exact in fp32). S = 1 is W16A16 (each x rounded to bf16: relative error <= 2^-9);
// S = 3 carries all 24 bits of an fp32 significand (8 + 8 + 8), so x = p_0 + p_1 + p_2 exactly
// (outside bf16's subnormal range) and the products are exact: the result is an fp32 GEMM whose
// only rounding is the fp32 accumulation, at 3x the tensor work (the 3xBF16 split). The backend's
// op uses S = 3 (K3C_MM_TC_SPLITS), so the model on cuda stays within the fp32 bounds of the cpu
// backend; S = 1 waits for a model-level bf16 bound (issue 44, 5).
//
// Tiles: a block of K3C_TC_WARPS = 4 warps owns K3C_TC_BN = 64 weight rows and a k-slab of
// K3C_TC_BK = 32 per stage.
//   - prefill (T > 8): 32 token rows; warp w computes tokens 16·(w & 1) .. +15 by weight rows
//     32·(w >> 1) .. +31 (four n8 tiles): A = x by ldmatrix.x4, B = W rows by ldmatrix.x4 (two n8
//     tiles per load: W [out, in] row-major is B "col").
//   - decode (T <= 8, swap-AB): the weights are the M = 16 operand, warp w's rows 16w .. +15 (A by
//     ldmatrix.x4 straight from W's rows), the <= 8 tokens the N = 8 operand (B by ldmatrix.x2),
//     so one token does not waste 15 of 16 mma rows.
// Each output is one k-ordered chain of mma (per k16 step, the S planes in order), the same in
// both tiles: a token's result does not depend on T (the determinism rule), in the emulation
// bit for bit (tests/gpu/test_cuda_ops.c).
// Needs in % 8 == 0 and a 16-byte aligned weight (cp.async of 16 B rows); matmul.cu keeps the
// CUDA-core kernel for anything else.
//
// Verified in the emulation (tests/gpu/test_cuda_mma.cu, test_cuda_ops.c); device run pending.
#include "cuda_launch.h"
#include "k3c_mma.cuh"

#define K3C_TC_WARPS 4
#define K3C_TC_BN    64              /* weight rows per block */
#define K3C_TC_BK    32              /* k per stage */
#define K3C_TC_LD    (K3C_TC_BK + 8) /* row stride in bf16: 80 bytes, 16-aligned, bank-skewed */
#define K3C_TC_PM    32              /* token rows per block, prefill */
#define K3C_TC_DM    8               /* token rows per block, decode (swap-AB) */

/* the weight slab rows [n0, n0 + BN) x k [k0, k0 + BK) -> dst by cp.async (zeros past the ends) */
static __device__ __forceinline__ void tc_stage(uint16_t *dst, const uint16_t *w, int64_t out,
                                                int64_t K, int64_t n0, int64_t k0) {
    for (int i = (int)threadIdx.x; i < K3C_TC_BN * (K3C_TC_BK / 8); i += (int)blockDim.x) {
        const int r = i / (K3C_TC_BK / 8), c = (i % (K3C_TC_BK / 8)) * 8;
        uint16_t *d = dst + r * K3C_TC_LD + c;
        const int64_t n = n0 + r, k = k0 + c;
        if (n < out && k < K) /* K % 8 == 0: the whole 8 are inside */
            k3c_cp_async16(d, w + n * K + k);
        else
            *(uint4 *)d = make_uint4(0u, 0u, 0u, 0u);
    }
}

/* x rows [m0, m0 + XR) x k [k0, k0 + BK) -> S bf16 planes (zeros past the ends) */
template <int S, int XR>
static __device__ __forceinline__ void tc_fill(uint16_t *xs, const float *x, int64_t xt, int64_t T,
                                               int64_t K, int64_t m0, int64_t k0) {
    for (int i = (int)threadIdx.x; i < XR * K3C_TC_BK; i += (int)blockDim.x) {
        const int r = i / K3C_TC_BK, c = i % K3C_TC_BK;
        const int64_t m = m0 + r, k = k0 + c;
        float v = m < T && k < K ? x[m * xt + k] : 0.0f;
#pragma unroll
        for (int p = 0; p < S; p++) {
            const uint16_t b = k3c_bf16_rne(v);
            xs[p * XR * K3C_TC_LD + r * K3C_TC_LD + c] = b;
            /* the residual is exact; a non-finite x stays in plane 0 alone (as fp32 would) */
            v = isfinite(v) ? v - k3c_bf16(b) : 0.0f;
        }
    }
}

template <bool SWAP, int S>
static __global__ void __launch_bounds__(K3C_TC_WARPS * 32)
    mm_tc_kernel(const uint16_t *w, int64_t out, int64_t K, int64_t rh, const float *x, int64_t xt,
                 int64_t xh, int64_t T, float *y, int64_t yt, int64_t yh) {
    constexpr int XR = SWAP ? K3C_TC_DM : K3C_TC_PM, NJ = SWAP ? 1 : 4;
    /* uint4 storage: 16-byte aligned for cp.async and ldmatrix under nvcc too */
    K3C_SHARED(uint4, ws_raw, [2 * K3C_TC_BN * K3C_TC_LD / 8]);
    K3C_SHARED(uint4, xs_raw, [S * XR * K3C_TC_LD / 8]);
    uint16_t *const ws = (uint16_t *)ws_raw, *const xs = (uint16_t *)xs_raw;
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3u;
    const int64_t h = blockIdx.z, n0 = (int64_t)blockIdx.x * K3C_TC_BN;
    const int64_t nk = (K + K3C_TC_BK - 1) / K3C_TC_BK;
    const uint16_t *wh = w + h * rh * K;
    x += h * xh;
    y += h * yh;
    /* the ldmatrix row of this lane within a 16-row, 16-column operand: matrix lane / 8 */
    const unsigned lr = lane % 8 + 8 * ((lane / 8) & 1u), lc = 8 * (lane / 16);
    for (int64_t m0 = (int64_t)blockIdx.y * XR; m0 < T; m0 += (int64_t)gridDim.y * XR) {
        float acc[NJ][4];
#pragma unroll
        for (int j = 0; j < NJ; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
        tc_stage(ws, wh, out, K, n0, 0);
        k3c_cp_async_commit();
        for (int64_t kc = 0; kc < nk; kc++) {
            const uint16_t *wb = ws + (kc & 1) * K3C_TC_BN * K3C_TC_LD;
            /* the next slab in flight (its buffer was last read before the barrier that ended
             * the previous step); an empty group at the end keeps wait<1> uniform */
            if (kc + 1 < nk)
                tc_stage(ws + ((kc + 1) & 1) * K3C_TC_BN * K3C_TC_LD, wh, out, K, n0,
                         (kc + 1) * K3C_TC_BK);
            k3c_cp_async_commit();
            tc_fill<S, XR>(xs, x, xt, T, K, m0, kc * K3C_TC_BK);
            k3c_cp_async_wait<1>(); /* this thread's copies of slab kc have landed */
            __syncthreads();        /* ... and every other thread's, and the x planes */
#pragma unroll
            for (int kk = 0; kk < K3C_TC_BK; kk += 16) {
                if constexpr (SWAP) {
                    uint32_t a[4];
                    k3c_ldmatrix_x4(a, wb + (16 * warp + lr) * K3C_TC_LD + kk + lc);
#pragma unroll
                    for (int p = 0; p < S; p++) {
                        uint32_t b[2]; /* B = x rowsᵀ: matrix lane / 8 of lanes 0-15 */
                        k3c_ldmatrix_x2(b, xs + p * XR * K3C_TC_LD + (lane % 8) * K3C_TC_LD + kk +
                                               8 * ((lane / 8) & 1u));
                        k3c_mma_bf16_16816(acc[0], a, b, acc[0]);
                    }
                } else {
                    uint32_t b[4][2];
#pragma unroll
                    for (int jj = 0; jj < 2; jj++) { /* n8 tiles 2jj, 2jj + 1 */
                        uint32_t r[4];
                        k3c_ldmatrix_x4(
                            r, wb +
                                   (32 * (warp >> 1) + 16 * jj + lane % 8 + 8 * (lane / 16)) *
                                       K3C_TC_LD +
                                   kk + 8 * ((lane / 8) & 1u));
                        b[2 * jj][0] = r[0], b[2 * jj][1] = r[1];
                        b[2 * jj + 1][0] = r[2], b[2 * jj + 1][1] = r[3];
                    }
#pragma unroll
                    for (int p = 0; p < S; p++) {
                        uint32_t a[4];
                        k3c_ldmatrix_x4(a, xs + p * XR * K3C_TC_LD +
                                               (16 * (warp & 1u) + lr) * K3C_TC_LD + kk + lc);
#pragma unroll
                        for (int j = 0; j < 4; j++) k3c_mma_bf16_16816(acc[j], a, b[j], acc[j]);
                    }
                }
            }
            __syncthreads(); /* slab kc and the planes are consumed */
        }
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int64_t m, n;
                if constexpr (SWAP)
                    n = n0 + 16 * warp + g + 8 * (i >> 1), m = m0 + 2 * t + (i & 1);
                else
                    m = m0 + 16 * (warp & 1u) + g + 8 * (i >> 1),
                    n = n0 + 32 * (warp >> 1) + 8 * j + 2 * t + (i & 1);
                if (m < T && n < out) y[m * yt + n] = acc[j][i];
            }
    }
}

template <int S>
static void tc_launch(cudaStream_t s, const uint16_t *w, int64_t out, int64_t K, int64_t rh, int H,
                      const float *x, int64_t xt, int64_t xh, int64_t T, float *y, int64_t yt,
                      int64_t yh) {
    const bool swap = T <= K3C_TC_DM;
    const int64_t xr = swap ? K3C_TC_DM : K3C_TC_PM, gy = (T + xr - 1) / xr;
    const dim3 grid((unsigned)((out + K3C_TC_BN - 1) / K3C_TC_BN),
                    (unsigned)(gy > 65535 ? 65535 : gy), (unsigned)H);
    if (swap) {
        K3C_LAUNCH(grid, K3C_TC_WARPS * 32, 0, s, mm_tc_kernel<true, S>)
        (w, out, K, rh, x, xt, xh, T, y, yt, yh);
    } else {
        K3C_LAUNCH(grid, K3C_TC_WARPS * 32, 0, s, mm_tc_kernel<false, S>)
        (w, out, K, rh, x, xt, xh, T, y, yt, yh);
    }
}

extern "C" bool k3c_mm_tc_ok(const void *w, int64_t in) {
    return w && (uintptr_t)w % 16 == 0 && in > 0 && in % 8 == 0;
}

extern "C" int k3c_mm_bf16_tc(cudaStream_t s, int splits, const uint16_t *w, int64_t out,
                              int64_t in, int64_t rh, int H, const float *x, int64_t xt, int64_t xh,
                              int64_t T, float *y, int64_t yt, int64_t yh) {
    if (T <= 0 || out <= 0 || H <= 0) return 0;
    if (!k3c_mm_tc_ok(w, in) || (splits != 1 && splits != 3) || H > 65535)
        return (int)cudaErrorInvalidValue;
    if (splits == 1)
        tc_launch<1>(s, w, out, in, rh, H, x, xt, xh, T, y, yt, yh);
    else
        tc_launch<3>(s, w, out, in, rh, H, x, xt, xh, T, y, yt, yh);
    return (int)cudaGetLastError();
}
