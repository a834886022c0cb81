// matmul.cu — y = x·Wᵀ (matmul) and y = x·W (matmul_tn) for weights W [out, in] of dtype F32,
// BF16 or MXFP4, activations and accumulation fp32. Weights stay in their stored format in HBM:
// MXFP4 groups (16 packed bytes + one E8M0 byte) are loaded as one uint4 and decoded to E2M1
// values in registers (cuda_math.cuh k3c_dot_chunk_mxfp4); BF16 as 8 values per uint4.
//
// matmul: a block owns K3C_MM_ROWS = 32 output rows (one per lane) and cuts each row into
// K3C_MM_SLICES K-slices (one per warp: chunks c = s, s + 8, ...). So a warp-wide load reads one
// 16-byte chunk of 32 rows while every lane needs the same x: x is a broadcast from L1, not 32
// scattered lines. Each thread keeps K3C_MM_TOK token accumulators (a weight chunk is read once
// per K3C_MM_TOK tokens); the slices meet in shared memory, added in slice order by warp 0.
// Token t's sum has the same order whatever T is (the determinism rule). This is a CUDA-core
// GEMV/GEMM: at decode batch it is bandwidth-bound, which is what it is for. A BF16 weight with
// in % 8 == 0 and 16-byte aligned rows goes to the tensor-core GEMM instead (matmul_mma.cu), for
// matmul and matmul_heads' plain form alike (so a head is still its matmul's bits).
// matmul_tn: a block owns 32 columns i (one per lane: a warp reads 32 adjacent weights of a row)
// and cuts the summed rows o into K3C_TN_SLICES slices (one per warp), added in slice order.
// matmul_heads (absorbed MLA's per-head products) runs the same two kernels over a strided view
// of H heads, grid.z = head: one launch for every head and token.
//
// Verified on host math only; device run pending.
#include "cuda_launch.h"
#include "cuda_math.cuh"

/* A view of H heads (blockIdx.z = head h): weight rows [h·rh, h·rh + out) of data/scale, x_h[t] =
 * x + h·xh + t·xt, y_h[t] = y + h·yh + t·yt. A plain matmul is H = 1 with xt = in, yt = out. xa:
 * every x_h[t] is 16-byte aligned (the chunks' arithmetic is the same either way). */
struct mm_view {
    int64_t out, in, rh, xt, xh, yt, yh;
    bool xa;
};

template <int DT, bool VEC>
static __global__ void __launch_bounds__(K3C_MM_ROWS *K3C_MM_SLICES)
    matmul_kernel(const void *data, const uint8_t *scale, mm_view v, const float *x, int64_t T,
                  float *y) {
    K3C_SHARED(float, part, [K3C_MM_SLICES][K3C_MM_TOK][K3C_MM_ROWS]);
    const int lane = threadIdx.x & 31, s = threadIdx.x >> 5;
    const int64_t out = v.out, in = v.in, h = blockIdx.z;
    const int64_t o = (int64_t)blockIdx.x * K3C_MM_ROWS + lane;
    const bool live = o < out, xa = v.xa;
    const int ch = k3c_chunk(DT, VEC);
    const int64_t nch = in / ch;
    const size_t row_bytes =
        DT == K3C_DT_MXFP4 ? (size_t)in / 2 : (size_t)in * (DT == K3C_DT_F32 ? 4 : 2);
    const int64_t wr = h * v.rh + (live ? o : 0); /* the weight row */
    const uint8_t *row = (const uint8_t *)data + (size_t)wr * row_bytes;
    const uint8_t *srow = DT == K3C_DT_MXFP4 ? scale + wr * (in / 32) : nullptr;
    x += h * v.xh;
    y += h * v.yh;
    for (int64_t t0 = (int64_t)blockIdx.y * K3C_MM_TOK; t0 < T;
         t0 += (int64_t)gridDim.y * K3C_MM_TOK) { /* block-uniform: the barriers below are safe */
        const int nt = T - t0 < K3C_MM_TOK ? (int)(T - t0) : K3C_MM_TOK;
        const float *xt = x + t0 * v.xt;
        const int64_t xs = v.xt;
        float acc[K3C_MM_TOK];
#pragma unroll
        for (int tt = 0; tt < K3C_MM_TOK; tt++) acc[tt] = 0.0f;
        for (int64_t c = s; live && c < nch; c += K3C_MM_SLICES) {
            /* the 32 lanes read 32 rows' chunk c, and all read the same x: a broadcast */
            if constexpr (DT == K3C_DT_MXFP4) {
                const uint4 p = k3c_ld16(row + c * 16, VEC);
                const uint8_t e = srow[c];
#pragma unroll
                for (int tt = 0; tt < K3C_MM_TOK; tt++)
                    if (tt < nt)
                        acc[tt] =
                            k3c_dot_chunk_mxfp4(p, e, xt + tt * xs + c * 32, acc[tt], VEC && xa);
            } else if constexpr (VEC && DT == K3C_DT_F32) {
                const float4 w = ((const float4 *)row)[c];
#pragma unroll
                for (int tt = 0; tt < K3C_MM_TOK; tt++)
                    if (tt < nt)
                        acc[tt] = k3c_dot_chunk_f32x4(w, xt + tt * xs + c * 4, acc[tt], xa);
            } else if constexpr (VEC) {
                const uint4 w = ((const uint4 *)row)[c];
#pragma unroll
                for (int tt = 0; tt < K3C_MM_TOK; tt++)
                    if (tt < nt)
                        acc[tt] = k3c_dot_chunk_bf16x8(w, xt + tt * xs + c * 8, acc[tt], xa);
            } else {
                const float w = k3c_w_elem(DT, row, c);
#pragma unroll
                for (int tt = 0; tt < K3C_MM_TOK; tt++)
                    if (tt < nt) acc[tt] = fmaf(w, xt[tt * xs + c], acc[tt]);
            }
        }
#pragma unroll
        for (int tt = 0; tt < K3C_MM_TOK; tt++) part[s][tt][lane] = acc[tt];
        __syncthreads();
        if (s == 0 && live) /* the slices in slice order (k3c_gemv_row) */
            for (int tt = 0; tt < nt; tt++) {
                float r = part[0][tt][lane];
                for (int s2 = 1; s2 < K3C_MM_SLICES; s2++) r += part[s2][tt][lane];
                y[(t0 + tt) * v.yt + o] = r;
            }
        __syncthreads();
    }
}

/* a block: 32 columns (one per lane) x K3C_TN_SLICES slices of the rows o (one per warp); heads
 * as matmul_kernel's view (x_h[t] rows of out floats, y_h[t] rows of in floats) */
static __global__ void __launch_bounds__(K3C_WARP *K3C_TN_SLICES)
    matmul_tn_kernel(int dt, const void *data, const uint8_t *scale, mm_view v, const float *x,
                     int64_t T, float *y) {
    K3C_SHARED(float, part, [K3C_TN_SLICES][K3C_MM_TOK][K3C_WARP]);
    const int lane = threadIdx.x & 31, s = threadIdx.x >> 5;
    const int64_t out = v.out, in = v.in, h = blockIdx.z;
    const int64_t i = (int64_t)blockIdx.x * K3C_WARP + lane;
    const bool live = i < in;
    const int64_t r0 = h * v.rh; /* the head's first weight row */
    const void *hd = dt == K3C_DT_MXFP4 ? (const void *)((const uint8_t *)data + r0 * (in / 2))
                     : dt == K3C_DT_F32 ? (const void *)((const float *)data + r0 * in)
                                        : (const void *)((const uint16_t *)data + r0 * in);
    const uint8_t *hs = dt == K3C_DT_MXFP4 ? scale + r0 * (in / 32) : nullptr;
    x += h * v.xh;
    y += h * v.yh;
    for (int64_t t0 = (int64_t)blockIdx.y * K3C_MM_TOK; t0 < T;
         t0 += (int64_t)gridDim.y * K3C_MM_TOK) { /* block-uniform */
        const int nt = T - t0 < K3C_MM_TOK ? (int)(T - t0) : K3C_MM_TOK;
        float acc[K3C_MM_TOK];
#pragma unroll
        for (int tt = 0; tt < K3C_MM_TOK; tt++) acc[tt] = 0.0f;
        for (int64_t o = s; live && o < out; o += K3C_TN_SLICES) { /* k3c_tn_part, 8 tokens */
            const float w = k3c_w_get(dt, hd, hs, in, o, i);
#pragma unroll
            for (int tt = 0; tt < K3C_MM_TOK; tt++)
                if (tt < nt) acc[tt] = fmaf(x[(t0 + tt) * v.xt + o], w, acc[tt]);
        }
#pragma unroll
        for (int tt = 0; tt < K3C_MM_TOK; tt++) part[s][tt][lane] = acc[tt];
        __syncthreads();
        if (s == 0 && live) /* the slices in slice order (k3c_tn_col) */
            for (int tt = 0; tt < nt; tt++) {
                float r = part[0][tt][lane];
                for (int s2 = 1; s2 < K3C_TN_SLICES; s2++) r += part[s2][tt][lane];
                y[(t0 + tt) * v.yt + i] = r;
            }
        __syncthreads();
    }
}

static unsigned tok_groups(int64_t T) {
    int64_t g = (T + K3C_MM_TOK - 1) / K3C_MM_TOK;
    return (unsigned)(g > 65535 ? 65535 : g);
}

template <int DT, bool VEC>
static void launch(cudaStream_t s, const void *data, const uint8_t *scale, const mm_view &v, int H,
                   const float *x, int64_t T, float *y) {
    dim3 grid((unsigned)((v.out + K3C_MM_ROWS - 1) / K3C_MM_ROWS), tok_groups(T), (unsigned)H);
    K3C_LAUNCH(grid, K3C_MM_ROWS * K3C_MM_SLICES, 0, s, matmul_kernel<DT, VEC>)
    (data, scale, v, x, T, y);
}

/* vec: the chunking of the vector path (weights aligned, whole chunks); v.xa: x aligned too */
static void launch_mm(cudaStream_t s, int dt, bool vec, const void *data, const uint8_t *scale,
                      const mm_view &v, int H, const float *x, int64_t T, float *y) {
    if (dt == K3C_DT_MXFP4)
        vec ? launch<K3C_DT_MXFP4, true>(s, data, scale, v, H, x, T, y)
            : launch<K3C_DT_MXFP4, false>(s, data, scale, v, H, x, T, y);
    else if (dt == K3C_DT_F32)
        vec ? launch<K3C_DT_F32, true>(s, data, scale, v, H, x, T, y)
            : launch<K3C_DT_F32, false>(s, data, scale, v, H, x, T, y);
    else
        vec ? launch<K3C_DT_BF16, true>(s, data, scale, v, H, x, T, y)
            : launch<K3C_DT_BF16, false>(s, data, scale, v, H, x, T, y);
}

extern "C" int k3c_matmul(cudaStream_t s, int dt, const void *data, const uint8_t *scale,
                          int64_t out, int64_t in, const float *x, int64_t T, float *y) {
    if (T <= 0 || out <= 0) return 0;
    if (in <= 0) return k3c_fill(s, y, T * out, 0.0f);
    if (dt == K3C_DT_BF16 && k3c_mm_tc_ok(data, in)) /* tensor cores (matmul_mma.cu) */
        return k3c_mm_bf16_tc(s, K3C_MM_TC_SPLITS, (const uint16_t *)data, out, in, 0, 1, x, in, 0,
                              T, y, out, 0);
    /* the vector path: 16-byte loads of weights and of x */
    const bool vec = k3c_mm_vec(dt, data, in, (uintptr_t)x % 16 == 0);
    const mm_view v = {out, in, 0, in, 0, out, 0, vec};
    launch_mm(s, dt, vec, data, scale, v, 1, x, T, y);
    return (int)cudaGetLastError();
}

extern "C" int k3c_matmul_tn(cudaStream_t s, int dt, const void *data, const uint8_t *scale,
                             int64_t out, int64_t in, const float *x, int64_t T, float *y) {
    if (T <= 0 || in <= 0) return 0;
    if (out <= 0) return k3c_fill(s, y, T * in, 0.0f);
    const mm_view v = {out, in, 0, out, 0, in, 0, false};
    dim3 grid((unsigned)((in + K3C_WARP - 1) / K3C_WARP), tok_groups(T), 1);
    K3C_LAUNCH(grid, K3C_WARP * K3C_TN_SLICES, 0, s, matmul_tn_kernel)(dt, data, scale, v, x, T, y);
    return (int)cudaGetLastError();
}

/* matmul_heads: the H per-head products in one launch (grid.z = head). Bit for bit H matmul /
 * matmul_tn calls on contiguous (16-byte aligned) copies of the heads: the chunking follows the
 * weights alone, as it would for an aligned copy of x; x that is not aligned is read with
 * unaligned loads of the same values. */
extern "C" int k3c_matmul_heads(cudaStream_t s, int dt, const void *data, const uint8_t *scale,
                                int64_t nr, int64_t in, int64_t rh, int H, const float *x,
                                int64_t xt, int64_t xh, int64_t T, float *y, int64_t yt, int64_t yh,
                                bool trans) {
    if (T <= 0 || H <= 0) return 0;
    if (trans) {
        if (in <= 0) return 0;
        const mm_view v = {nr, in, rh, xt, xh, yt, yh, false};
        if (nr <= 0) { /* every y_h[t] row is zero (a fill per row: rare, empty views) */
            for (int h = 0; h < H; h++)
                for (int64_t t = 0; t < T; t++) {
                    const int e = k3c_fill(s, y + h * yh + t * yt, in, 0.0f);
                    if (e) return e;
                }
            return 0;
        }
        dim3 grid((unsigned)((in + K3C_WARP - 1) / K3C_WARP), tok_groups(T), (unsigned)H);
        K3C_LAUNCH(grid, K3C_WARP * K3C_TN_SLICES, 0, s, matmul_tn_kernel)
        (dt, data, scale, v, x, T, y);
        return (int)cudaGetLastError();
    }
    if (nr <= 0) return 0;
    if (in <= 0) {
        for (int h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                const int e = k3c_fill(s, y + h * yh + t * yt, nr, 0.0f);
                if (e) return e;
            }
        return 0;
    }
    if (dt == K3C_DT_BF16 && k3c_mm_tc_ok(data, in)) /* as k3c_matmul: tensor cores */
        return k3c_mm_bf16_tc(s, K3C_MM_TC_SPLITS, (const uint16_t *)data, nr, in, rh, H, x, xt, xh,
                              T, y, yt, yh);
    const bool vec = k3c_mm_vec(dt, data, in, true);
    const bool xa = (uintptr_t)x % 16 == 0 && (T <= 1 || xt % 4 == 0) && (H <= 1 || xh % 4 == 0);
    const mm_view v = {nr, in, rh, xt, xh, yt, yh, xa};
    launch_mm(s, dt, vec, data, scale, v, H, x, T, y);
    return (int)cudaGetLastError();
}
