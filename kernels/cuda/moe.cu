// moe.cu — MoE routing and row movement of the cuda backend: the router's grouped top-k
// (moe_topk), rows_gather / rows_scatter (device index arrays, staged by backend_cuda.c) and the
// segment-weighted row sums (rows_wsum: the MoE slot sum and the combine's pre-sum).
//   moe_topk: one block per token; lane 0 runs the ref's sequential selection verbatim
//     (cuda_math.cuh k3c_topk_token: the same comparisons, so the same tie-breaking to the lower
//     index, and the same non-finite rule: NaN weights), with the group scratch in shared
//     memory. A token that runs out of experts reports through atomicMin on one error word: the
//     minimum is order-independent, so the reported token is the first one, as ref reports.
//   rows_wsum: one block per segment, threads over the width, each element summed over the
//     segment's rows in order (the ref's order; no atomics).
//   moe_experts: the routed experts of slot rows whose ids stay on the device, through a table of
//     the E experts' pointers (backend_cuda.c builds it). In tiles of rows: moe_up_kernel, a block
//     per (row, 32 columns of I) with matmul's shape (lane = output row of W1 / W3, warp = K-slice,
//     slices added in slice order: k3c_gemv_row, with matmul's choice of vector path), then the
//     activation → h [tile, I] in the op's work; moe_down_kernel, a block per (output row, 32
//     columns of Lw) the same way for W2 — with w, the K slot items of a token are summed in k
//     order, the first initialising (k3c_wsum_step: rows_wsum's arithmetic). So each item is the
//     bits of matmul → act → matmul on this backend, and the weighted row those of rows_wsum over
//     them, without an [n, Lw] buffer. No grouping of rows by expert, so each row reads its
//     expert's weights: the F32 / BF16 expert path; MXFP4 experts run on the grouped tensor-core
//     GEMM (moe_mma.cu, backend_cuda.c moe_mma).
//   nonfinite_rows: a block per sequence; rows_last: a block per (sequence, slab).
// Verified on host math only; device run pending.
#include "cuda_launch.h"
#include "cuda_math.cuh"

static __global__ void topk_kernel(const float *scores, const float *bias, int E, int K, int G,
                                   int topk_group, bool renorm, float scale, float *work,
                                   int32_t *ids, float *w, unsigned long long *err) {
    K3C_DYN_SHARED(float, sh_topk); /* gscore [G], then gkeep [G] bytes */
    if (threadIdx.x != 0) return;
    const int64_t t = blockIdx.x;
    const int r =
        k3c_topk_token(scores + t * E, bias, E, K, G, topk_group, renorm, scale, work + t * E,
                       ids + t * K, w + t * K, sh_topk, (unsigned char *)(sh_topk + G));
    if (r != -1)
        atomicMin(err, (unsigned long long)t * (unsigned long long)(E + 2) +
                           (unsigned long long)(r >= 0 ? r : E + 1));
}

static __global__ void rows_copy_kernel(const float *src, int64_t width, const int64_t *idx,
                                        int64_t n, float *dst, int scatter) {
    for (int64_t j = blockIdx.x; j < n; j += gridDim.x) {
        const float *a = scatter ? src + j * width : src + idx[j] * width;
        float *b = scatter ? dst + idx[j] * width : dst + j * width;
        for (int64_t d = threadIdx.x; d < width; d += blockDim.x) b[d] = a[d];
    }
}

static __global__ void wsum_kernel(const float *x, const float *w, const int64_t *seg,
                                   int64_t seg_len, int64_t n_seg, int64_t width, float *y) {
    for (int64_t j = blockIdx.x; j < n_seg; j += gridDim.x) {
        const int64_t i0 = seg ? seg[j] : j * seg_len, i1 = seg ? seg[j + 1] : (j + 1) * seg_len;
        for (int64_t d = threadIdx.x; d < width; d += blockDim.x)
            y[j * width + d] = k3c_wsum_elem(x, w, i0, i1, width, d);
    }
}

extern "C" int k3c_moe_topk(cudaStream_t s, const float *scores, const float *bias, int64_t T,
                            int E, int K, int G, int topk_group, bool renorm, float scale,
                            float *work, int32_t *ids, float *w, unsigned long long *err) {
    if (T <= 0) return 0;
    const size_t sh = (size_t)G * (sizeof(float) + 1);
    K3C_LAUNCH((unsigned)T, 32, sh, s, topk_kernel)
    (scores, bias, E, K, G, topk_group, renorm, scale, work, ids, w, err);
    return (int)cudaGetLastError();
}

extern "C" int k3c_rows_copy(cudaStream_t s, const float *src, int64_t width, const int64_t *idx,
                             int64_t n, float *dst, int scatter) {
    if (n <= 0 || width <= 0) return 0;
    const unsigned blocks = (unsigned)(n > (1 << 20) ? (1 << 20) : n);
    K3C_LAUNCH(blocks, 256, 0, s, rows_copy_kernel)(src, width, idx, n, dst, scatter);
    return (int)cudaGetLastError();
}

extern "C" int k3c_rows_wsum(cudaStream_t s, const float *x, const float *w, const int64_t *seg,
                             int64_t seg_len, int64_t n_seg, int64_t width, float *y) {
    if (n_seg <= 0 || width <= 0) return 0;
    const unsigned blocks = (unsigned)(n_seg > (1 << 20) ? (1 << 20) : n_seg);
    K3C_LAUNCH(blocks, 256, 0, s, wsum_kernel)(x, w, seg, seg_len, n_seg, width, y);
    return (int)cudaGetLastError();
}

/* ---- varlen row ops ------------------------------------------------------------------------ */
static __global__ void nonfinite_kernel(k3c_seqs sq, float *y, int64_t D, bool per_seq,
                                        int32_t code, int32_t *flags) {
    const int i = blockIdx.x;
    if (flags[i] != 0) return; /* block-uniform: already failed, left as it is */
    const int64_t r0 = per_seq ? i : sq.tok0[i], r1 = per_seq ? i + 1 : sq.tok0[i + 1];
    float *rows = y + r0 * D;
    const int64_t n = (r1 - r0) * D;
    int bad = 0;
    for (int64_t e = threadIdx.x; e < n && !bad; e += blockDim.x) bad = !isfinite(rows[e]);
    if (!__syncthreads_or(bad)) return;
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) rows[e] = 0.0f;
    if (threadIdx.x == 0) flags[i] = code;
}

static __global__ void rows_last_kernel(k3c_seqs sq, const float *src, int64_t slab, int64_t D,
                                        float *dst) {
    const int i = blockIdx.x, j = blockIdx.y;
    const float *a = src + j * slab + ((int64_t)sq.tok0[i + 1] - 1) * D;
    float *b = dst + ((int64_t)j * sq.n_seqs + i) * D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) b[d] = a[d];
}

extern "C" int k3c_nonfinite_rows(cudaStream_t s, const k3c_seqs *sq, float *y, int64_t D,
                                  bool per_seq, int32_t code, int32_t *flags) {
    if (sq->n_seqs <= 0 || D <= 0) return 0;
    K3C_LAUNCH((unsigned)sq->n_seqs, 256, 0, s, nonfinite_kernel)(*sq, y, D, per_seq, code, flags);
    return (int)cudaGetLastError();
}

extern "C" int k3c_rows_last(cudaStream_t s, const k3c_seqs *sq, const float *src, int64_t slab,
                             int n_slab, int64_t D, float *dst) {
    if (sq->n_seqs <= 0 || n_slab <= 0 || D <= 0) return 0;
    dim3 grid((unsigned)sq->n_seqs, (unsigned)n_slab);
    K3C_LAUNCH(grid, 256, 0, s, rows_last_kernel)(*sq, src, slab, D, dst);
    return (int)cudaGetLastError();
}

/* ---- moe_experts ---------------------------------------------------------------------------- */
static __global__ void moe_check_kernel(const int32_t *ids, int64_t n, int E, const k3c_expert *tab,
                                        unsigned long long *err) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int32_t e = ids[i];
        /* min: the first bad row, order-free; every id / presence error before any shape one
           (ref checks all rows' ids first) */
        if (e < 0 || e >= E || !tab[e].data[0])
            atomicMin(err, (unsigned long long)i);
        else if (tab[e].bad)
            atomicMin(err, (unsigned long long)(n + i));
    }
}

/* Slice s's partial of weight row o (of a matrix [rows, in] of dtype dt) against x: the chunk
 * walk of matmul_kernel (k3c_gemv_part) with matmul's choice of path (k3c_mm_vec). */
static __device__ __forceinline__ float expert_part(const k3c_expert &ex, int m, int64_t o,
                                                    int64_t in, const float *x, bool x_vec, int s) {
    const int dt = ex.dt[m];
    const size_t row_bytes =
        dt == K3C_DT_MXFP4 ? (size_t)in / 2 : (size_t)in * (dt == K3C_DT_F32 ? 4 : 2);
    const uint8_t *row = (const uint8_t *)ex.data[m] + (size_t)o * row_bytes;
    const uint8_t *srow = dt == K3C_DT_MXFP4 ? ex.scale[m] + o * (in / 32) : nullptr;
    const bool vec = k3c_mm_vec(dt, ex.data[m], in, x_vec);
    return k3c_gemv_part(dt, vec, row, srow, x, in, s, K3C_MM_SLICES);
}

/* part [K3C_MM_SLICES][32]: the slices of one output row per lane, summed by warp 0 in slice
 * order (matmul_kernel's epilogue = k3c_gemv_row); every thread calls it (two barriers). */
static __device__ __forceinline__ float slices_sum(float (*part)[K3C_MM_ROWS], float v) {
    const int lane = threadIdx.x & 31, s = threadIdx.x >> 5;
    part[s][lane] = v;
    __syncthreads();
    float r = part[0][lane];
    for (int s2 = 1; s2 < K3C_MM_SLICES; s2++) r += part[s2][lane];
    __syncthreads(); /* part is reused by the caller's next call */
    return r;
}

static __global__ void __launch_bounds__(K3C_MM_ROWS *K3C_MM_SLICES)
    moe_up_kernel(const float *src, int64_t row_div, const int32_t *row_of, const int32_t *ids,
                  const k3c_expert *tab, int64_t r0, int64_t Lw, int64_t I, bool x_vec, float beta,
                  float lin_beta, float *h) {
    K3C_SHARED(float, part, [K3C_MM_SLICES][K3C_MM_ROWS]);
    const int lane = threadIdx.x & 31, s = threadIdx.x >> 5;
    const int64_t j = blockIdx.y, i = r0 + j; /* tile row j = slot row i */
    const int64_t o = (int64_t)blockIdx.x * K3C_MM_ROWS + lane;
    const bool live = o < I;
    const k3c_expert ex = tab[ids[i]]; /* checked by moe_check_kernel */
    const float *x = src + (row_of ? (int64_t)row_of[i] : i / row_div) * Lw;
    const float g = slices_sum(part, live ? expert_part(ex, 0, o, Lw, x, x_vec, s) : 0.0f);
    const float u = slices_sum(part, live ? expert_part(ex, 1, o, Lw, x, x_vec, s) : 0.0f);
    if (s == 0 && live) h[j * I + o] = k3c_moe_act(g, u, beta, lin_beta);
}

/* block (columns, y): y = a slot row (w NULL) or a token's K slot rows (w), K = per */
static __global__ void __launch_bounds__(K3C_MM_ROWS *K3C_MM_SLICES)
    moe_down_kernel(const float *h, const int32_t *ids, const float *w, int64_t per,
                    const k3c_expert *tab, int64_t r0, int64_t Lw, int64_t I, bool h_vec,
                    float *out) {
    K3C_SHARED(float, part, [K3C_MM_SLICES][K3C_MM_ROWS]);
    const int lane = threadIdx.x & 31, s = threadIdx.x >> 5;
    const int64_t o = (int64_t)blockIdx.x * K3C_MM_ROWS + lane;
    const bool live = o < Lw;
    const int64_t i0 = r0 + (int64_t)blockIdx.y * per; /* the block's first slot row */
    float acc = 0.0f;
    for (int64_t k = 0; k < per; k++) {
        const int64_t i = i0 + k;
        const k3c_expert ex = tab[ids[i]];
        const float *x = h + (i - r0) * I;
        const float v = slices_sum(part, live ? expert_part(ex, 2, o, I, x, h_vec, s) : 0.0f);
        acc = k3c_wsum_step(acc, w, i, v, k == 0);
    }
    const int64_t row = w ? i0 / per : i0;
    if (s == 0 && live) out[row * Lw + o] = acc;
}

extern "C" int k3c_moe_check(cudaStream_t s, const int32_t *ids, int64_t n, int E,
                             const k3c_expert *tab, unsigned long long *err) {
    if (n <= 0) return 0;
    K3C_LAUNCH(k3c_blocks(n, 256), 256, 0, s, moe_check_kernel)(ids, n, E, tab, err);
    return (int)cudaGetLastError();
}

extern "C" int k3c_moe_up(cudaStream_t s, const float *src, int64_t row_div, const int32_t *row_of,
                          const int32_t *ids, const k3c_expert *tab, int64_t r0, int64_t m,
                          int64_t Lw, int64_t I, bool x_vec, float beta, float lin_beta, float *h) {
    if (m <= 0 || I <= 0) return 0;
    dim3 grid((unsigned)((I + K3C_MM_ROWS - 1) / K3C_MM_ROWS), (unsigned)m);
    K3C_LAUNCH(grid, K3C_MM_ROWS * K3C_MM_SLICES, 0, s, moe_up_kernel)
    (src, row_div, row_of, ids, tab, r0, Lw, I, x_vec, beta, lin_beta, h);
    return (int)cudaGetLastError();
}

extern "C" int k3c_moe_down(cudaStream_t s, const float *h, const int32_t *ids, const float *w,
                            int64_t row_div, const k3c_expert *tab, int64_t r0, int64_t m,
                            int64_t Lw, int64_t I, bool h_vec, float *out) {
    if (m <= 0 || Lw <= 0) return 0;
    const int64_t per = w ? row_div : 1;
    dim3 grid((unsigned)((Lw + K3C_MM_ROWS - 1) / K3C_MM_ROWS), (unsigned)(m / per));
    K3C_LAUNCH(grid, K3C_MM_ROWS * K3C_MM_SLICES, 0, s, moe_down_kernel)
    (h, ids, w, per, tab, r0, Lw, I, h_vec, out);
    return (int)cudaGetLastError();
}
