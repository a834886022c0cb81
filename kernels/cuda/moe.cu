// moe.cu — MoE routing and row movement of the cuda backend: the router's grouped top-k
// (moe_topk), rows_gather / rows_scatter (device index arrays, staged by backend_cuda.c) and the
// segment-weighted row sums (rows_wsum: the MoE slot sum and the combine's pre-sum).
//   moe_topk: one block per token; lane 0 runs the ref's sequential selection verbatim
//     (cuda_math.cuh k3c_topk_token: the same comparisons, so the same tie-breaking to the lower
//     index, and the same non-finite check), with the group scratch in shared memory. A bad
//     token reports through atomicMin on one error word: the minimum is order-independent, so
//     the reported (token, expert) is the first one in index order, as ref reports.
//   rows_wsum: one block per segment, threads over the width, each element summed over the
//     segment's rows in order (the ref's order; no atomics).
// Verified on host math only; device run pending.
#include "cuda_launch.h"
#include "cuda_math.cuh"

static __global__ void topk_kernel(const float *scores, const float *bias, int E, int K, int G,
                                   int topk_group, bool renorm, float scale, float *work,
                                   int32_t *ids, float *w, unsigned long long *err) {
    extern __shared__ float sh_topk[]; /* gscore [G], then gkeep [G] bytes */
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
    topk_kernel<<<(unsigned)T, 32, sh, s>>>(scores, bias, E, K, G, topk_group, renorm, scale, work,
                                            ids, w, err);
    return (int)cudaGetLastError();
}

extern "C" int k3c_rows_copy(cudaStream_t s, const float *src, int64_t width, const int64_t *idx,
                             int64_t n, float *dst, int scatter) {
    if (n <= 0 || width <= 0) return 0;
    const unsigned blocks = (unsigned)(n > (1 << 20) ? (1 << 20) : n);
    rows_copy_kernel<<<blocks, 256, 0, s>>>(src, width, idx, n, dst, scatter);
    return (int)cudaGetLastError();
}

extern "C" int k3c_rows_wsum(cudaStream_t s, const float *x, const float *w, const int64_t *seg,
                             int64_t seg_len, int64_t n_seg, int64_t width, float *y) {
    if (n_seg <= 0 || width <= 0) return 0;
    const unsigned blocks = (unsigned)(n_seg > (1 << 20) ? (1 << 20) : n_seg);
    wsum_kernel<<<blocks, 256, 0, s>>>(x, w, seg, seg_len, n_seg, width, y);
    return (int)cudaGetLastError();
}
