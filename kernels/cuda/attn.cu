// attn.cu — absorbed MLA decode attention over the latent cache (attn_latent, K3-MODEL.md §3.2),
// one query token, H heads. Two kernels on the stream:
//   scores: one warp per (head, cached token): s = scale · qc[h]·cache[j] with the lanes' strided
//     partials meeting in the warp butterfly (cuda_math.cuh k3c_gemv_part, scalar path) → work;
//   mix: one block per head: max and Σ exp through the block tree (work ← exp(s − max)), then
//     each thread owns latent elements i and sums p_j·cache[j][i] over j in order (coalesced).
// Verified on host math only; device run pending.
#include "cuda_launch.h"
#include "cuda_math.cuh"

static __global__ void scores_kernel(const float *qc, const float *cache, int64_t n_ctx, int W,
                                     float scale, float *work) {
    const int h = blockIdx.y, lane = threadIdx.x & 31;
    const int64_t j = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (j >= n_ctx) return;
    const float s = k3c_warp_sum(k3c_gemv_part(K3C_DT_F32, false, cache + j * W, nullptr,
                                               qc + (int64_t)h * W, W, lane, K3C_WARP));
    if (lane == 0) work[(int64_t)h * n_ctx + j] = s * scale;
}

static __global__ void mix_kernel(const float *cache, int64_t n_ctx, int W, int Rkv, float *o_lat,
                                  float *work) {
    __shared__ float sh[32];
    const int h = blockIdx.x;
    float *wk = work + (int64_t)h * n_ctx;
    const float m = k3c_block_reduce(k3c_max_part(wk, n_ctx, threadIdx.x, blockDim.x), sh, true);
    const float z =
        k3c_block_reduce(k3c_expsum_part(wk, m, n_ctx, threadIdx.x, blockDim.x, wk), sh, false);
    /* the block tree's barriers order every exp write before the reads below */
    for (int i = threadIdx.x; i < Rkv; i += blockDim.x) {
        float acc = 0.0f;
        for (int64_t j = 0; j < n_ctx; j++) acc = fmaf(wk[j] / z, cache[j * W + i], acc);
        o_lat[(int64_t)h * Rkv + i] = acc;
    }
}

extern "C" int k3c_attn_latent(cudaStream_t s, const float *qc, const float *cache, int64_t n_ctx,
                               int H, int W, int Rkv, float scale, float *o_lat, float *work) {
    if (H <= 0 || Rkv <= 0) return 0;
    if (n_ctx <= 0) return k3c_fill(s, o_lat, (int64_t)H * Rkv, 0.0f);
    dim3 grid((unsigned)((n_ctx + 7) / 8), (unsigned)H);
    scores_kernel<<<grid, 256, 0, s>>>(qc, cache, n_ctx, W, scale, work);
    mix_kernel<<<(unsigned)H, K3C_ROW_THREADS, 0, s>>>(cache, n_ctx, W, Rkv, o_lat, work);
    return (int)cudaGetLastError();
}
