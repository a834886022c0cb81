// matmul.cu — y = x·Wᵀ (matmul) and y = x·W (matmul_tn) for weights W [out, in] of dtype F32,
// BF16 or MXFP4, activations and accumulation fp32. Weights stay in their stored format in HBM:
// MXFP4 groups (16 packed bytes + one E8M0 byte) are loaded as one uint4 and decoded to E2M1
// values in registers (cuda_math.cuh k3c_dot_chunk_mxfp4); BF16 as 8 values per uint4.
//
// matmul: one warp per output row, K3C_MM_WARPS rows per block; a lane walks the row's chunks
// c = lane, lane + 32, ... and keeps K3C_MM_TOK token accumulators, so each weight chunk is read
// once per K3C_MM_TOK tokens; the lanes meet in the warp butterfly. Token t's sum has the same
// order whatever T is (the determinism rule). This is a CUDA-core GEMV/GEMM: at decode batch it
// is bandwidth-bound, which is what it is for; prefill at large T wants a tensor-core (bf16 MMA)
// path that this file does not have yet (no cuBLASLt either).
// matmul_tn: one thread per input column i, summing over o in order (coalesced across i).
//
// Verified on host math only; device run pending.
#include "cuda_launch.h"
#include "cuda_math.cuh"

/* The uint4 at byte address p, aligned (one 16-byte load) or not (16 byte loads). */
template <bool ALIGNED> static __device__ __forceinline__ uint4 load16(const uint8_t *p) {
    if constexpr (ALIGNED) {
        return *(const uint4 *)p;
    } else {
        uint32_t u[4];
        for (int m = 0; m < 4; m++)
            u[m] = (uint32_t)p[4 * m] | (uint32_t)p[4 * m + 1] << 8 | (uint32_t)p[4 * m + 2] << 16 |
                   (uint32_t)p[4 * m + 3] << 24;
        return make_uint4(u[0], u[1], u[2], u[3]);
    }
}

template <int DT, bool VEC>
static __global__ void __launch_bounds__(K3C_MM_WARPS *K3C_WARP)
    matmul_kernel(const void *data, const uint8_t *scale, int64_t out, int64_t in, const float *x,
                  int64_t T, float *y) {
    const int lane = threadIdx.x & 31;
    const int64_t o = (int64_t)blockIdx.x * K3C_MM_WARPS + (threadIdx.x >> 5);
    if (o >= out) return; /* whole warps only: no block-level barrier below */
    const int ch = DT == K3C_DT_MXFP4 ? 32 : !VEC ? 1 : DT == K3C_DT_F32 ? 4 : 8;
    const int64_t nch = in / ch;
    const size_t row_bytes =
        DT == K3C_DT_MXFP4 ? (size_t)in / 2 : (size_t)in * (DT == K3C_DT_F32 ? 4 : 2);
    const uint8_t *row = (const uint8_t *)data + (size_t)o * row_bytes;
    const uint8_t *srow = DT == K3C_DT_MXFP4 ? scale + o * (in / 32) : nullptr;
    for (int64_t t0 = (int64_t)blockIdx.y * K3C_MM_TOK; t0 < T;
         t0 += (int64_t)gridDim.y * K3C_MM_TOK) {
        const int nt = T - t0 < K3C_MM_TOK ? (int)(T - t0) : K3C_MM_TOK;
        const float *xt = x + t0 * in;
        float acc[K3C_MM_TOK];
#pragma unroll
        for (int tt = 0; tt < K3C_MM_TOK; tt++) acc[tt] = 0.0f;
        for (int64_t c = lane; c < nch; c += K3C_WARP) {
            if constexpr (DT == K3C_DT_MXFP4) {
                const uint4 p = load16<VEC>(row + c * 16);
                const uint8_t e = srow[c];
#pragma unroll
                for (int tt = 0; tt < K3C_MM_TOK; tt++)
                    if (tt < nt)
                        acc[tt] = k3c_dot_chunk_mxfp4(p, e, xt + tt * in + c * 32, acc[tt]);
            } else if constexpr (VEC && DT == K3C_DT_F32) {
                const float4 w = ((const float4 *)row)[c];
#pragma unroll
                for (int tt = 0; tt < K3C_MM_TOK; tt++)
                    if (tt < nt) acc[tt] = k3c_dot_chunk_f32x4(w, xt + tt * in + c * 4, acc[tt]);
            } else if constexpr (VEC) {
                const uint4 w = ((const uint4 *)row)[c];
#pragma unroll
                for (int tt = 0; tt < K3C_MM_TOK; tt++)
                    if (tt < nt) acc[tt] = k3c_dot_chunk_bf16x8(w, xt + tt * in + c * 8, acc[tt]);
            } else {
                const float w = k3c_w_elem(DT, row, c);
#pragma unroll
                for (int tt = 0; tt < K3C_MM_TOK; tt++)
                    if (tt < nt) acc[tt] = fmaf(w, xt[tt * in + c], acc[tt]);
            }
        }
#pragma unroll
        for (int tt = 0; tt < K3C_MM_TOK; tt++) {
            if (tt >= nt) break; /* warp-uniform */
            const float v = k3c_warp_sum(acc[tt]);
            if (lane == 0) y[(t0 + tt) * out + o] = v;
        }
    }
}

static __global__ void matmul_tn_kernel(int dt, const void *data, const uint8_t *scale, int64_t out,
                                        int64_t in, const float *x, int64_t T, float *y) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= in) return;
    for (int64_t t0 = (int64_t)blockIdx.y * K3C_MM_TOK; t0 < T;
         t0 += (int64_t)gridDim.y * K3C_MM_TOK) {
        const int nt = T - t0 < K3C_MM_TOK ? (int)(T - t0) : K3C_MM_TOK;
        float acc[K3C_MM_TOK];
#pragma unroll
        for (int tt = 0; tt < K3C_MM_TOK; tt++) acc[tt] = 0.0f;
        for (int64_t o = 0; o < out; o++) {
            const float w = k3c_w_get(dt, data, scale, in, o, i);
#pragma unroll
            for (int tt = 0; tt < K3C_MM_TOK; tt++)
                if (tt < nt) acc[tt] = fmaf(x[(t0 + tt) * out + o], w, acc[tt]);
        }
        for (int tt = 0; tt < nt; tt++) y[(t0 + tt) * in + i] = acc[tt];
    }
}

static unsigned tok_groups(int64_t T) {
    int64_t g = (T + K3C_MM_TOK - 1) / K3C_MM_TOK;
    return (unsigned)(g > 65535 ? 65535 : g);
}

template <int DT, bool VEC>
static void launch(cudaStream_t s, const void *data, const uint8_t *scale, int64_t out, int64_t in,
                   const float *x, int64_t T, float *y) {
    dim3 grid((unsigned)((out + K3C_MM_WARPS - 1) / K3C_MM_WARPS), tok_groups(T));
    matmul_kernel<DT, VEC><<<grid, K3C_MM_WARPS * K3C_WARP, 0, s>>>(data, scale, out, in, x, T, y);
}

extern "C" int k3c_matmul(cudaStream_t s, int dt, const void *data, const uint8_t *scale,
                          int64_t out, int64_t in, const float *x, int64_t T, float *y) {
    if (T <= 0 || out <= 0) return 0;
    if (in <= 0) return k3c_fill(s, y, T * out, 0.0f);
    const size_t row_bytes =
        dt == K3C_DT_MXFP4 ? (size_t)in / 2 : (size_t)in * (dt == K3C_DT_F32 ? 4 : 2);
    const bool vec = ((uintptr_t)data % 16 == 0) && row_bytes % 16 == 0;
    if (dt == K3C_DT_MXFP4)
        vec ? launch<K3C_DT_MXFP4, true>(s, data, scale, out, in, x, T, y)
            : launch<K3C_DT_MXFP4, false>(s, data, scale, out, in, x, T, y);
    else if (dt == K3C_DT_F32)
        vec ? launch<K3C_DT_F32, true>(s, data, scale, out, in, x, T, y)
            : launch<K3C_DT_F32, false>(s, data, scale, out, in, x, T, y);
    else
        vec ? launch<K3C_DT_BF16, true>(s, data, scale, out, in, x, T, y)
            : launch<K3C_DT_BF16, false>(s, data, scale, out, in, x, T, y);
    return (int)cudaGetLastError();
}

extern "C" int k3c_matmul_tn(cudaStream_t s, int dt, const void *data, const uint8_t *scale,
                             int64_t out, int64_t in, const float *x, int64_t T, float *y) {
    if (T <= 0 || in <= 0) return 0;
    if (out <= 0) return k3c_fill(s, y, T * in, 0.0f);
    dim3 grid((unsigned)((in + 255) / 256), tok_groups(T));
    matmul_tn_kernel<<<grid, 256, 0, s>>>(dt, data, scale, out, in, x, T, y);
    return (int)cudaGetLastError();
}
